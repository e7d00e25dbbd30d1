/* io_read.c — reads: opening a checkpoint's files safely, whole-file maps
 * and reads, reads that hash on the way, and reusable memory. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/hashread.h"
#include "base/io.h"
#include "base/xxh.h"
#include "base/io_int.h"

/* ---- reads -------------------------------------------------------------- */

const char *ckpt__file_type_name(mode_t mode) {
    if (S_ISREG(mode)) return "a regular file";
    if (S_ISDIR(mode)) return "a folder";
    if (S_ISLNK(mode)) return "a symlink";
    if (S_ISFIFO(mode)) return "a FIFO";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    return "not a regular file";
}

static void (*_Atomic verified_hook)(void *user, const char *path);
static void *_Atomic verified_user;

void ckpt__io_set_verified_hook(void (*fn)(void *user, const char *path), void *user) {
    atomic_store(&verified_user, user);
    atomic_store(&verified_hook, fn);
}

void ckpt__io_verified(const char *path) {
    void (*fn)(void *, const char *) = atomic_load(&verified_hook);
    if (fn) fn(atomic_load(&verified_user), path);
}

int ckpt__open_read(const char *path, const char *what, bool own, struct stat *st) {
    struct stat tmp;
    if (!st) st = &tmp;
    int bad = own ? CKPT_ECORRUPT : CKPT_EINVAL;
    /* Look before opening: a device is not opened at all. A checkpoint's own
     * file is never a symlink: ckpt writes none. */
    if ((own ? ckpt__os_lstat(path, st) : ckpt__os_stat(path, st)) != 0)
        return ckpt__err_os(errno, "%s: open", what);
    if (!S_ISREG(st->st_mode))
        return ckpt__err(bad, "%s: %s, expected a regular file", what,
                         ckpt__file_type_name(st->st_mode));
    /* The file may be swapped between the look and the open: O_NONBLOCK so
     * a FIFO put there cannot hang the open, O_NOFOLLOW for a symlink. */
    int flags = O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC | (own ? O_NOFOLLOW : 0);
    int fd = ckpt__os_open(path, flags, 0);
    if (fd < 0) {
        int e = errno;
        if (own && e == ELOOP)
            return ckpt__err(bad, "%s: a symlink, expected a regular file", what);
        return ckpt__err_os(e, "%s: open", what);
    }
    int rc = CKPT_OK;
    if (ckpt__os_fstat(fd, st) != 0) rc = ckpt__err_os(errno, "%s: stat", what);
    else if (!S_ISREG(st->st_mode))
        rc = ckpt__err(bad, "%s: %s, expected a regular file", what,
                       ckpt__file_type_name(st->st_mode));
    else if (ckpt__os_set_nonblock(fd, false) != 0) rc = ckpt__err_os(errno, "%s: fcntl", what);
    if (rc < 0) {
        ckpt__os_close(fd);
        return rc;
    }
    return fd;
}

static const uint8_t empty_file_byte;

int ckpt__map_file(const char *path, ckpt_mapped *m) {
    memset(m, 0, sizeof *m);
    struct stat st;
    int fd = ckpt__open_read(path, path, false, &st);
    if (fd < 0) return fd;
    int rc = CKPT_OK;
    if (st.st_size == 0) {
        m->data = &empty_file_byte;
        goto out;
    }
    if ((uint64_t)st.st_size > (uint64_t)SIZE_MAX) {
        rc = ckpt__err(CKPT_EINVAL, "%s: too large to map", path);
        goto out;
    }
    void *p = ckpt__os_map_read(fd, (size_t)st.st_size);
    if (p == MAP_FAILED) {
        rc = ckpt__err_os(errno, "%s: mmap", path);
        goto out;
    }
    m->data = p;
    m->size = (uint64_t)st.st_size;
    m->map_base = p;
    m->map_len = (size_t)st.st_size;
out:
    ckpt__os_close(fd);
    return rc;
}

void ckpt__unmap(ckpt_mapped *m) {
    if (!m) return;
    if (m->map_base) ckpt__os_munmap(m->map_base, m->map_len);
    free(m->heap);
    memset(m, 0, sizeof *m);
}

int ckpt__read_small_file(const char *path, bool own, uint64_t max, char **out, size_t *len) {
    *out = NULL;
    if (len) *len = 0;
    struct stat st;
    int fd = ckpt__open_read(path, path, own, &st);
    if (fd < 0) return fd;
    int rc = CKPT_OK;
    char *buf = NULL;
    if ((uint64_t)st.st_size > max) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %lld bytes, more than the %llu-byte limit", path,
                       (long long)st.st_size, (unsigned long long)max);
        goto out;
    }
    size_t n = (size_t)st.st_size;
    buf = ckpt__malloc(n + 1);
    if (!buf) {
        rc = ckpt__err_nomem(path);
        goto out;
    }
    size_t got = 0;
    while (got < n) {
        ssize_t r = ckpt__os_pread(fd, buf + got, n - got, got);
        if (r < 0) {
            rc = ckpt__err_os(errno, "%s: read", path);
            goto out;
        }
        if (r == 0) break; /* shrank meanwhile: take what is there */
        got += (size_t)r;
    }
    buf[got] = '\0';
    *out = buf;
    buf = NULL;
    if (len) *len = got;
out:
    free(buf);
    ckpt__os_close(fd);
    return rc;
}

uint64_t ckpt__xxh3(const void *p, size_t n) { return XXH3_64bits(p, n); }

ckpt_h128 ckpt__xxh128(const void *p, size_t n) {
    XXH128_hash_t v = XXH3_128bits(p, n);
    return (ckpt_h128){v.low64, v.high64};
}

/* ---- reads that hash on the way --------------------------------------------- */

/* Each piece is read and then hashed while it is in the CPU cache (256 KiB:
 * the kernel's copy and the hash touch memory once, and a verification-only
 * read never leaves the cache), the reads on a second thread where that
 * pays (hashread.h); reads from disk still go in large requests: the kernel
 * is asked to read ahead a window of 8 MiB at a time (a cold read in 1 MiB
 * requests ran at a third of the speed of 8 MiB ones). */

static int read_hashed(const char *path, const char *what, uint64_t size, uint8_t *dst,
                       uint64_t *digest, ckpt_h128 *wide) {
    size_t align = _Alignof(XXH3_state_t) > 64 ? _Alignof(XXH3_state_t) : 64;
    /* without a destination the pieces pass through a ring of at most
     * CKPT_HASHREAD_RING bytes */
    uint64_t pieces = (size + CKPT_HASHREAD_PIECE - 1) / CKPT_HASHREAD_PIECE;
    uint64_t ring = pieces * CKPT_HASHREAD_PIECE < CKPT_HASHREAD_RING ? pieces * CKPT_HASHREAD_PIECE
                                                                      : CKPT_HASHREAD_RING;
    void *mem = ckpt__malloc(sizeof(XXH3_state_t) + align + (dst ? 0 : (size_t)ring));
    if (!mem) return ckpt__err_nomem(what);
    uintptr_t a = ((uintptr_t)mem + align - 1) & ~(uintptr_t)(align - 1);
    XXH3_state_t *h = (XXH3_state_t *)a; /* both digests come from it (xxh.h) */
    uint8_t *scratch = (uint8_t *)(h + 1);
    XXH3_INITSTATE(h);
    XXH3_64bits_reset(h);
    int rc = CKPT_OK;
    struct stat st;
    int fd = ckpt__open_read(path, what, true, &st);
    if (fd < 0) {
        free(mem);
        return fd;
    }
    ckpt__hashread_fail why;
    if ((uint64_t)st.st_size != size) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %lld bytes, the manifest says %llu", what,
                       (long long)st.st_size, (unsigned long long)size);
    } else {
        /* The kernel reads ahead further for a file read from start to end
         * (and hashread asks for the next window as it goes). */
        (void)ckpt__os_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        if (ckpt__hashread(NULL, fd, 0, size, dst, dst ? NULL : scratch, h, &why) < 0)
            rc = why.err ? ckpt__err_os(why.err, "%s: read", what)
                         : ckpt__err(CKPT_ECORRUPT, "%s: ends at byte %llu, the manifest says %llu",
                                     what, (unsigned long long)why.at, (unsigned long long)size);
    }
    ckpt__os_close(fd);
    if (rc == 0 && digest) *digest = XXH3_64bits_digest(h);
    if (rc == 0 && wide) {
        XXH128_hash_t v = XXH3_128bits_digest(h);
        *wide = (ckpt_h128){v.low64, v.high64};
    }
    free(mem);
    return rc;
}

int ckpt__read_hashed(const char *path, const char *what, uint64_t size, uint8_t *dst,
                      uint64_t *digest) {
    return read_hashed(path, what, size, dst, digest, NULL);
}

int ckpt__read_hashed128(const char *path, const char *what, uint64_t size, uint64_t *digest,
                         ckpt_h128 *wide) {
    return read_hashed(path, what, size, NULL, digest, wide);
}

int ckpt__read_private(const char *path, const char *what, uint64_t size, ckpt_mapped *m,
                       uint64_t *digest) {
    memset(m, 0, sizeof *m);
    if (size > (uint64_t)SIZE_MAX / 2)
        return ckpt__err(CKPT_ECORRUPT, "%s: %llu bytes cannot be read into memory", what,
                         (unsigned long long)size);
    uint8_t *buf = size ? ckpt__malloc((size_t)size) : NULL;
    if (size && !buf) return ckpt__err_nomem(what);
    int rc = ckpt__read_hashed(path, what, size, buf, digest);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    m->data = buf ? buf : &empty_file_byte;
    m->size = size;
    m->heap = buf;
    return CKPT_OK;
}

bool ckpt__in_memory_fs(const char *path) {
    int64_t t = 0;
    if (ckpt__fs()->fs_type(path, &t) != 0) return false;
    return t == 0x01021994 /* TMPFS_MAGIC */ || t == (int64_t)0x858458f6 /* RAMFS_MAGIC */;
}

bool ckpt__addressable(uint64_t n) {
    if (n > (uint64_t)SIZE_MAX / 2) return false;
    if (n == 0) return true;
    /* Address space only: nothing is committed or touched. */
    void *p = ckpt__os_map_anon((size_t)n, PROT_NONE, MAP_NORESERVE);
    if (p == MAP_FAILED) return false;
    ckpt__os_munmap(p, (size_t)n);
    return true;
}

/* ---- reusable memory ------------------------------------------------------------ */

int ckpt__arena_reserve(ckpt_arena *a, uint64_t n) {
    if (n <= a->cap) return CKPT_OK;
    ckpt__arena_free(a);
    if (n > (uint64_t)SIZE_MAX / 2) return ckpt__err_nomem("buffer area");
    /* Whole pages. (No MADV_HUGEPAGE: where the kernel defragments on
     * demand, the first touch of a huge-page area can stall for seconds.) */
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t len = (n + page - 1) / page * page;
    void *probe = ckpt__malloc(1); /* the allocation-failure sweep counts this area too */
    if (!probe) return ckpt__err_nomem("buffer area");
    free(probe);
    void *p = ckpt__os_map_anon((size_t)len, PROT_READ | PROT_WRITE, 0);
    if (p == MAP_FAILED) return ckpt__err_nomem("buffer area");
    a->p = p;
    a->cap = len;
    return CKPT_OK;
}

void ckpt__arena_free(ckpt_arena *a) {
    if (a->p) ckpt__os_munmap(a->p, (size_t)a->cap);
    a->p = NULL;
    a->cap = 0;
}
