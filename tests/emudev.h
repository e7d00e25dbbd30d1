/* emudev.h — an emulated device for tests of memory ckpt cannot touch
 * (ckpt_memory_ops): each buffer is an anonymous mapping whose pages are
 * PROT_NONE except inside the ops' own memcpy, which opens only the pages it
 * copies and closes them again. The handle is the buffer's address, so a
 * library that dereferenced a handle (or kept a pointer the ops opened)
 * would crash the test with SIGSEGV. The ops count calls and bytes, check
 * every call against the buffer's bounds and CKPT_MEMORY_PIECE, and record
 * whether a call came from a thread other than the one that made the
 * device. Header only: unit tests, test programs and benchmarks include it.
 * Single device per process; not thread-safe (the library calls the ops one
 * at a time, from the caller's thread). */
#ifndef CKPT_TEST_EMUDEV_H
#define CKPT_TEST_EMUDEV_H

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "ckpt.h"

#define EMUDEV_MAX_BUFS 256

typedef struct emudev {
    struct {
        uint8_t *base;
        size_t size, mapped;
    } bufs[EMUDEV_MAX_BUFS];
    int nbufs;
    pthread_t owner;
    uint64_t to_host_calls, from_host_calls, to_host_bytes, from_host_bytes, max_piece;
    int errors;         /* calls out of bounds, too large, on an unknown handle */
    int foreign_thread; /* calls from another thread than the owner's */
    int fail_after;     /* > 0: the fail_after-th call from now fails (CKPT_EIO) */
} emudev;

static emudev emudev_g;

static inline void emudev_init(void) {
    memset(&emudev_g, 0, sizeof emudev_g);
    emudev_g.owner = pthread_self();
}

static inline size_t emudev_page(void) { return (size_t)sysconf(_SC_PAGESIZE); }

/* A device buffer of size bytes, filled with src (NULL: zeros). Its address
 * is the handle. */
static inline void *emudev_alloc(size_t size, const void *src) {
    if (emudev_g.nbufs == EMUDEV_MAX_BUFS) return NULL;
    size_t pg = emudev_page(), mapped = (size ? size + pg - 1 : pg) / pg * pg;
    void *p = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
    if (src && size) memcpy(p, src, size);
    mprotect(p, mapped, PROT_NONE);
    int i = emudev_g.nbufs++;
    emudev_g.bufs[i].base = p;
    emudev_g.bufs[i].size = size;
    emudev_g.bufs[i].mapped = mapped;
    return p;
}

static inline int emudev_find(const void *handle) {
    for (int i = 0; i < emudev_g.nbufs; i++)
        if (emudev_g.bufs[i].base == handle) return i;
    return -1;
}

/* Opens (prot) or closes the pages of [p, p + n). */
static inline void emudev_protect(uint8_t *p, size_t n, int prot) {
    size_t pg = emudev_page();
    uintptr_t a = (uintptr_t)p / pg * pg, e = ((uintptr_t)p + n + pg - 1) / pg * pg;
    if (e > a) mprotect((void *)a, e - a, prot);
}

static inline int emudev_check(void *handle, uint64_t off, uint64_t n, int *slot) {
    if (!pthread_equal(pthread_self(), emudev_g.owner)) emudev_g.foreign_thread++;
    if (n > emudev_g.max_piece) emudev_g.max_piece = n;
    int i = emudev_find(handle);
    if (i < 0 || off > emudev_g.bufs[i].size || n > emudev_g.bufs[i].size - off ||
        n > CKPT_MEMORY_PIECE || n == 0) {
        emudev_g.errors++;
        return ckpt_set_error(CKPT_EINVAL, "emudev: bad call (handle %p, offset %llu, %llu bytes)",
                              handle, (unsigned long long)off, (unsigned long long)n);
    }
    if (emudev_g.fail_after > 0 && --emudev_g.fail_after == 0)
        return ckpt_set_error(CKPT_EIO, "emudev: injected copy failure");
    *slot = i;
    return 0;
}

static inline int emudev_to_host(void *handle, uint64_t off, void *dst, uint64_t n) {
    int i = -1, rc = emudev_check(handle, off, n, &i);
    if (rc) return rc;
    uint8_t *p = emudev_g.bufs[i].base + off;
    emudev_protect(p, (size_t)n, PROT_READ);
    memcpy(dst, p, (size_t)n);
    emudev_protect(p, (size_t)n, PROT_NONE);
    emudev_g.to_host_calls++;
    emudev_g.to_host_bytes += n;
    return 0;
}

static inline int emudev_from_host(void *handle, uint64_t off, const void *src, uint64_t n) {
    int i = -1, rc = emudev_check(handle, off, n, &i);
    if (rc) return rc;
    uint8_t *p = emudev_g.bufs[i].base + off;
    emudev_protect(p, (size_t)n, PROT_READ | PROT_WRITE);
    memcpy(p, src, (size_t)n);
    emudev_protect(p, (size_t)n, PROT_NONE);
    emudev_g.from_host_calls++;
    emudev_g.from_host_bytes += n;
    return 0;
}

static const ckpt_memory_ops emudev_ops = {emudev_to_host, emudev_from_host};

/* The test's own look at a buffer (not the library's): n bytes at off. */
static inline void emudev_peek(void *handle, uint64_t off, void *dst, size_t n) {
    uint8_t *p = (uint8_t *)handle + off;
    emudev_protect(p, n, PROT_READ);
    memcpy(dst, p, n);
    emudev_protect(p, n, PROT_NONE);
}

static inline void emudev_poke(void *handle, uint64_t off, const void *src, size_t n) {
    uint8_t *p = (uint8_t *)handle + off;
    emudev_protect(p, n, PROT_READ | PROT_WRITE);
    memcpy(p, src, n);
    emudev_protect(p, n, PROT_NONE);
}

static inline void emudev_free_all(void) {
    for (int i = 0; i < emudev_g.nbufs; i++) munmap(emudev_g.bufs[i].base, emudev_g.bufs[i].mapped);
    emudev_g.nbufs = 0;
}

#endif
