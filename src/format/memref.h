/* memref.h — tensors whose bytes live behind the caller's memory ops
 * (ckpt_memory_ops: device memory the library never dereferences): a
 * reference to such bytes, the destination of a read (host memory or such
 * bytes), and the calls that move bytes through the ops in pieces of at most
 * CKPT_MEMORY_PIECE. Shared by the safetensors writer, the state-dict writer
 * and reader, slice copies and the optimizer. */
#ifndef CKPT_MEMREF_H
#define CKPT_MEMREF_H

#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ckpt.h"

/* Bytes behind ops: byte k of the tensor is byte off + k of handle. ops
 * NULL: none (the bytes are in host memory). */
typedef struct ckpt_mem_ref {
    const ckpt_memory_ops *ops;
    void *handle;
    uint64_t off;
} ckpt_mem_ref;

/* Where a read's bytes go: host memory at host, or (mem.ops set) the bytes
 * behind ops. */
typedef struct ckpt_dst {
    uint8_t *host;
    ckpt_mem_ref mem;
    const char *key; /* the tensor, for messages */
} ckpt_dst;

static inline ckpt_dst ckpt__dst_host(void *p) {
    ckpt_dst d;
    memset(&d, 0, sizeof d);
    d.host = p;
    return d;
}

/* d moved on by n bytes. */
static inline ckpt_dst ckpt__dst_at(const ckpt_dst *d, uint64_t n) {
    ckpt_dst e = *d;
    if (e.mem.ops) e.mem.off += n;
    else if (e.host) e.host += n;
    return e;
}

/* CKPT_EINVAL naming what unless ops has both functions. */
int ckpt__mem_check_ops(const ckpt_memory_ops *ops, const char *what);

/* Bytes [off, off + n) behind m into host memory at dst / from src, through
 * to_host / from_host in pieces of at most CKPT_MEMORY_PIECE. A failing call
 * is CKPT_EIO (or the negative ckpt_status it returned) naming key. */
int ckpt__mem_get(const ckpt_mem_ref *m, uint64_t off, void *dst, uint64_t n, const char *key);
int ckpt__mem_put(const ckpt_mem_ref *m, uint64_t off, const void *src, uint64_t n,
                  const char *key);

/* n host bytes at src into bytes [off, off + n) of d. */
static inline int ckpt__dst_put(const ckpt_dst *d, uint64_t off, const void *src, uint64_t n) {
    if (d->mem.ops) return ckpt__mem_put(&d->mem, off, src, n, d->key);
    if (n) memcpy(d->host + off, src, (size_t)n);
    return 0;
}

/* A host buffer for moving up to n bytes through ops: min(n, the piece),
 * at least 1 byte; *cap gets its size. NULL when out of memory (message
 * set naming what). Free with free(). */
void *ckpt__mem_bounce(uint64_t n, uint64_t *cap, const char *what);

#endif
