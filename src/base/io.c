/* io.c — the ckpt__os_* helpers over the file-system table (fs.h) that do
 * more than forward a call: EINTR retries, argument checks and the byte
 * counters of ckpt__io_bytes. The write stream is in io_stream.c,
 * publication in io_publish.c, reads in io_read.c. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include "base/fs.h"
#include "base/io.h"
#include "base/io_int.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

/* ---- byte counts -------------------------------------------------------- */

static _Atomic uint64_t bytes_read, bytes_written;

static void count_read(uint64_t n) {
    atomic_fetch_add_explicit(&bytes_read, n, memory_order_relaxed);
}
static void count_written(uint64_t n) {
    atomic_fetch_add_explicit(&bytes_written, n, memory_order_relaxed);
}

void ckpt__io_bytes(ckpt_io_bytes *out) {
    out->read = atomic_load_explicit(&bytes_read, memory_order_relaxed);
    out->written = atomic_load_explicit(&bytes_written, memory_order_relaxed);
}

/* ---- helpers ------------------------------------------------------------ */

int ckpt__os_open(const char *path, int flags, mode_t mode) {
    for (;;) {
        int fd = ckpt__fs()->open(path, flags, mode);
        if (fd < 0 && errno == EINTR) continue;
        return fd;
    }
}

int ckpt__os_openat(int dirfd, const char *path, int flags, mode_t mode) {
    for (;;) {
        int fd = ckpt__fs()->openat(dirfd, path, flags, mode);
        if (fd < 0 && errno == EINTR) continue;
        return fd;
    }
}

ssize_t ckpt__os_write(int fd, const void *p, size_t n) {
    for (;;) {
        ssize_t w = ckpt__fs()->write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w > 0) count_written((uint64_t)w);
        return w;
    }
}

ssize_t ckpt__os_pread(int fd, void *p, size_t n, uint64_t off) {
    if (off > (uint64_t)INT64_MAX) {
        errno = EINVAL;
        return -1;
    }
    for (;;) {
        ssize_t r = ckpt__fs()->pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r > 0) count_read((uint64_t)r);
        return r;
    }
}

int ckpt__os_fsync(int fd) {
    for (;;) {
        int r = ckpt__fs()->fsync(fd);
        if (r < 0 && errno == EINTR) continue;
        return r;
    }
}

int ckpt__os_rename(const char *from, const char *to) { return ckpt__fs()->rename(from, to); }

int ckpt__os_rename_raw(const char *from, const char *to) {
    ckpt__fs_exempt_begin();
    int r = ckpt__fs()->rename(from, to);
    int e = errno;
    ckpt__fs_exempt_end();
    errno = e;
    return r;
}

int ckpt__os_exchange(const char *a, const char *b) {
    return ckpt__fs()->renameat2(a, b, RENAME_EXCHANGE);
}

/* Falls back to a check plus rename on file systems without
 * RENAME_NOREPLACE. */
int ckpt__os_rename_noreplace(const char *from, const char *to) {
    int r = ckpt__fs()->renameat2(from, to, RENAME_NOREPLACE);
    if (r == 0 || (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)) return r;
    struct stat st;
    if (ckpt__os_lstat(to, &st) == 0) {
        errno = EEXIST;
        return -1;
    }
    return ckpt__os_rename_raw(from, to);
}

int ckpt__os_mkdir(const char *path, mode_t mode) { return ckpt__fs()->mkdir(path, mode); }

ssize_t ckpt__os_pwrite(int fd, const void *p, size_t n, uint64_t off) {
    if (off > (uint64_t)INT64_MAX) {
        errno = EINVAL;
        return -1;
    }
    for (;;) {
        ssize_t w = ckpt__fs()->pwrite(fd, p, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w > 0) count_written((uint64_t)w);
        return w;
    }
}

void *ckpt__os_map_read(int fd, size_t len) {
    void *p = ckpt__fs()->mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p != MAP_FAILED) count_read(len);
    return p;
}

int ckpt__os_ftruncate(int fd, uint64_t len) {
    if (len > (uint64_t)INT64_MAX) {
        errno = EINVAL;
        return -1;
    }
    for (;;) {
        int r = ckpt__fs()->ftruncate(fd, (off_t)len);
        if (r < 0 && errno == EINTR) continue;
        return r;
    }
}

int ckpt__os_unlink(const char *path) { return ckpt__fs()->unlink(path); }

int ckpt__os_rmdir(const char *path) { return ckpt__fs()->rmdir(path); }

int ckpt__os_link(const char *from, const char *to) { return ckpt__fs()->link(from, to); }

int ckpt__os_writeback(int fd, uint64_t off, uint64_t len) {
    return ckpt__fs()->writeback(fd, (off_t)off, (off_t)len);
}
