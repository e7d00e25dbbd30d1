/* io.c — the OS wrappers every file access of the library goes through, the
 * fault-injection counter they consult and the crash recorder they report
 * to. The write stream is in io_stream.c, publication in io_publish.c, reads
 * in io_read.c. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "base/io_int.h"

#ifndef RENAME_NOREPLACE
#define RENAME_NOREPLACE (1 << 0)
#endif
#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

/* ---- fault injection ---------------------------------------------------- */

/* One process-wide counter: tests arm it from one thread, but OS calls may
 * come from any thread, so the state sits behind a mutex. */
static pthread_mutex_t fault_mu = PTHREAD_MUTEX_INITIALIZER;
static unsigned fault_mask;
static uint64_t fault_n;
static int fault_errnum;
static bool fault_persist;
static uint64_t fault_calls;
static bool fault_has_fired;
static _Atomic size_t fault_max_write;
static pthread_once_t fault_env_once = PTHREAD_ONCE_INIT;

#ifdef CKPT_FAULT_ENV
/* Test builds only (CMake option CKPT_FAULT_ENV, on where the tests are
 * built): the library that `make build`/`make install` ships reads no
 * test variable from the environment. */
static unsigned kinds_from_names(const char *s, size_t len) {
    static const struct { const char *name; unsigned bit; } tab[] = {
        {"open", CKPT_FAULT_OPEN},   {"write", CKPT_FAULT_WRITE}, {"fsync", CKPT_FAULT_FSYNC},
        {"rename", CKPT_FAULT_RENAME}, {"mkdir", CKPT_FAULT_MKDIR}, {"read", CKPT_FAULT_READ},
        {"any", CKPT_FAULT_ANY},
    };
    unsigned mask = 0;
    size_t i = 0;
    while (i < len) {
        size_t j = i;
        while (j < len && s[j] != '+') j++;
        bool found = false;
        for (size_t k = 0; k < sizeof tab / sizeof tab[0]; k++) {
            if (strlen(tab[k].name) == j - i && memcmp(tab[k].name, s + i, j - i) == 0) {
                mask |= tab[k].bit;
                found = true;
            }
        }
        if (!found) return 0;
        i = j + 1;
    }
    return mask;
}

static int errno_from_name(const char *s) {
    static const struct { const char *name; int value; } tab[] = {
        {"ENOSPC", ENOSPC}, {"EIO", EIO},       {"EDQUOT", EDQUOT}, {"EACCES", EACCES},
        {"EPERM", EPERM},   {"EROFS", EROFS},   {"EINTR", EINTR},   {"ENOENT", ENOENT},
        {"EEXIST", EEXIST}, {"ENOMEM", ENOMEM}, {"EFBIG", EFBIG},   {"EAGAIN", EAGAIN},
        {"EBADF", EBADF},   {"EMFILE", EMFILE},
    };
    for (size_t k = 0; k < sizeof tab / sizeof tab[0]; k++)
        if (strcmp(tab[k].name, s) == 0) return tab[k].value;
    char *end = NULL;
    long v = strtol(s, &end, 10);
    if (end != s && *end == '\0' && v > 0 && v < 4096) return (int)v;
    return 0;
}

/* CKPT_FAULT="<kinds>:<n>:<errno name>[:persist]". A malformed value is
 * reported on stderr once and ignored: it only ever comes from a test. */
static void fault_parse_env(void) {
    const char *v = getenv("CKPT_FAULT");
    if (!v || !*v) return;
    char buf[128];
    if (strlen(v) >= sizeof buf) goto bad;
    strcpy(buf, v);
    char *c1 = strchr(buf, ':');
    if (!c1) goto bad;
    char *c2 = strchr(c1 + 1, ':');
    if (!c2) goto bad;
    *c2 = '\0';
    char *c3 = strchr(c2 + 1, ':');
    bool persist = false;
    if (c3) {
        *c3 = '\0';
        if (strcmp(c3 + 1, "persist") != 0) goto bad;
        persist = true;
    }
    unsigned mask = kinds_from_names(buf, (size_t)(c1 - buf));
    char *end = NULL;
    unsigned long long n = strtoull(c1 + 1, &end, 10);
    int e = errno_from_name(c2 + 1);
    if (!mask || end == c1 + 1 || *end != '\0' || n == 0 || !e) goto bad;
    ckpt__fault_arm(mask, n, e, persist);
    return;
bad:
    fprintf(stderr, "ckpt: warning: ignoring malformed CKPT_FAULT=\"%s\"\n", v);
}

/* With CKPT_FAULT_RANK set, the fault waits for ckpt__fault_env_rank. */
static void fault_from_env(void) {
    const char *r = getenv("CKPT_FAULT_RANK");
    if (!r || !*r) fault_parse_env();
}

void ckpt__fault_env_rank(int rank) {
    pthread_once(&fault_env_once, fault_from_env);
    const char *r = getenv("CKPT_FAULT_RANK");
    if (!r || !*r) return;
    char *end = NULL;
    long want = strtol(r, &end, 10);
    if (end == r || *end != '\0' || want < 0) {
        fprintf(stderr, "ckpt: warning: ignoring malformed CKPT_FAULT_RANK=\"%s\"\n", r);
        return;
    }
    if (want == rank) fault_parse_env();
}
#else
static void fault_from_env(void) {}
void ckpt__fault_env_rank(int rank) { (void)rank; }
#endif

void ckpt__fault_arm(unsigned mask, uint64_t n, int errnum, bool persist) {
    pthread_mutex_lock(&fault_mu);
    fault_mask = n ? mask : 0;
    fault_n = n;
    fault_errnum = errnum;
    fault_persist = persist;
    fault_calls = 0;
    fault_has_fired = false;
    pthread_mutex_unlock(&fault_mu);
}

void ckpt__fault_disarm(void) { ckpt__fault_arm(0, 0, 0, false); }

uint64_t ckpt__fault_count(void) {
    pthread_mutex_lock(&fault_mu);
    uint64_t c = fault_calls;
    pthread_mutex_unlock(&fault_mu);
    return c;
}

bool ckpt__fault_fired(void) {
    pthread_mutex_lock(&fault_mu);
    bool f = fault_has_fired;
    pthread_mutex_unlock(&fault_mu);
    return f;
}

void ckpt__fault_set_max_write(size_t max) { fault_max_write = max; }

/* Counts one call of `kind`; returns true (errno set) if it must fail. */
static bool fault_hit(unsigned kind) {
    pthread_once(&fault_env_once, fault_from_env);
    bool fail = false;
    int e = 0;
    pthread_mutex_lock(&fault_mu);
    if (fault_mask & kind) {
        fault_calls++;
        if (fault_calls == fault_n || (fault_persist && fault_calls > fault_n)) {
            fail = true;
            fault_has_fired = true;
            e = fault_errnum;
        }
    }
    pthread_mutex_unlock(&fault_mu);
    if (fail) errno = e;
    return fail;
}

/* ---- crash recording ----------------------------------------------------- */

static _Atomic(ckpt_io_record_fn) rec_fn;
static void *_Atomic rec_user;
static _Atomic unsigned io_unsafe;

void ckpt__io_set_recorder(ckpt_io_record_fn fn, void *user) {
    atomic_store_explicit(&rec_user, user, memory_order_relaxed);
    atomic_store_explicit(&rec_fn, fn, memory_order_release);
}

void ckpt__io_set_unsafe(unsigned mask) { io_unsafe = mask; }
unsigned ckpt__io_unsafe(void) { return io_unsafe; }

static bool recording(void) {
    return atomic_load_explicit(&rec_fn, memory_order_relaxed) != NULL;
}

static void record(ckpt_io_op op, int fd, int flags, const char *path, const char *path2,
                   uint64_t offset, const void *data, size_t len) {
    ckpt_io_record_fn fn = atomic_load_explicit(&rec_fn, memory_order_acquire);
    if (!fn) return;
    ckpt_io_event ev = {op, fd, flags, path, path2, offset, data, len};
    fn(atomic_load_explicit(&rec_user, memory_order_relaxed), &ev);
}

/* The position a write just ended at tells where it started. */
static void record_write(int fd, const void *p, size_t w) {
    off_t end = lseek(fd, 0, SEEK_CUR);
    record(CKPT_IO_WRITE, fd, 0, NULL, NULL, end < 0 ? 0 : (uint64_t)end - w, p, w);
}

/* ---- OS wrappers -------------------------------------------------------- */

int ckpt__os_open(const char *path, int flags, mode_t mode) {
    for (;;) {
        if (fault_hit(CKPT_FAULT_OPEN)) {
            if (errno == EINTR) continue;
            return -1;
        }
        int fd = open(path, flags | O_CLOEXEC, mode);
        if (fd < 0 && errno == EINTR) continue;
        if (fd >= 0 && recording()) record(CKPT_IO_OPEN, fd, flags, path, NULL, 0, NULL, 0);
        return fd;
    }
}

int ckpt__os_openat(int dirfd, const char *path, int flags, mode_t mode) {
    for (;;) {
        if (fault_hit(CKPT_FAULT_OPEN)) {
            if (errno == EINTR) continue;
            return -1;
        }
        int fd = openat(dirfd, path, flags | O_CLOEXEC, mode);
        if (fd < 0 && errno == EINTR) continue;
        if (fd >= 0 && recording()) {
            /* The recorder knows paths, not folder descriptors. */
            char link[64], full[4096];
            ssize_t k = -1;
            if (path[0] != '/' && dirfd != AT_FDCWD) {
                snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd);
                k = readlink(link, full, sizeof full - 1);
            }
            if (k > 0 && (size_t)k + strlen(path) + 2 <= sizeof full) {
                full[k] = '\0';
                strcat(full, "/");
                strcat(full, path);
                record(CKPT_IO_OPEN, fd, flags, full, NULL, 0, NULL, 0);
            } else {
                record(CKPT_IO_OPEN, fd, flags, path, NULL, 0, NULL, 0);
            }
        }
        return fd;
    }
}

static _Atomic uint64_t bytes_read, bytes_written;

void ckpt__io_count_read(uint64_t n) {
    atomic_fetch_add_explicit(&bytes_read, n, memory_order_relaxed);
}
static void count_written(uint64_t n) {
    atomic_fetch_add_explicit(&bytes_written, n, memory_order_relaxed);
}

void ckpt__io_bytes(ckpt_io_bytes *out) {
    out->read = atomic_load_explicit(&bytes_read, memory_order_relaxed);
    out->written = atomic_load_explicit(&bytes_written, memory_order_relaxed);
}

ssize_t ckpt__os_write(int fd, const void *p, size_t n) {
    size_t cap = fault_max_write;
    if (cap && n > cap) n = cap;
    for (;;) {
        if (fault_hit(CKPT_FAULT_WRITE)) {
            if (errno == EINTR) continue;
            return -1;
        }
        ssize_t w = write(fd, p, n);
        if (w < 0 && errno == EINTR) continue;
        if (w > 0) count_written((uint64_t)w);
        if (w > 0 && recording()) record_write(fd, p, (size_t)w);
        return w;
    }
}

ssize_t ckpt__os_pread(int fd, void *p, size_t n, uint64_t off) {
    if (off > (uint64_t)INT64_MAX) {
        errno = EINVAL;
        return -1;
    }
    for (;;) {
        if (fault_hit(CKPT_FAULT_READ)) {
            if (errno == EINTR) continue;
            return -1;
        }
        ssize_t r = pread(fd, p, n, (off_t)off);
        if (r < 0 && errno == EINTR) continue;
        if (r > 0) ckpt__io_count_read((uint64_t)r);
        return r;
    }
}

int ckpt__os_fsync(int fd) {
    if (io_unsafe & CKPT_IO_SKIP_EVERY_FSYNC) return 0;
    for (;;) {
        if (fault_hit(CKPT_FAULT_FSYNC)) {
            if (errno == EINTR) continue;
            return -1;
        }
        int r = fsync(fd);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0 && recording()) record(CKPT_IO_FSYNC, fd, 0, NULL, NULL, 0, NULL, 0);
        return r;
    }
}

/* rename without fault injection: the undo steps of error paths. */
int ckpt__os_rename_raw(const char *from, const char *to) {
    int r = rename(from, to);
    if (r == 0 && recording()) record(CKPT_IO_RENAME, -1, 0, from, to, 0, NULL, 0);
    return r;
}

int ckpt__os_rename(const char *from, const char *to) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    return ckpt__os_rename_raw(from, to);
}

static int sys_renameat2(const char *a, const char *b, unsigned flags) {
#ifdef SYS_renameat2
    return (int)syscall(SYS_renameat2, AT_FDCWD, a, AT_FDCWD, b, flags);
#else
    (void)a;
    (void)b;
    (void)flags;
    errno = ENOSYS;
    return -1;
#endif
}

int ckpt__os_exchange(const char *a, const char *b) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    int r = sys_renameat2(a, b, RENAME_EXCHANGE);
    if (r == 0 && recording()) record(CKPT_IO_EXCHANGE, -1, 0, a, b, 0, NULL, 0);
    return r;
}

/* rename that refuses to replace an existing target; falls back to a check
 * plus rename on file systems without RENAME_NOREPLACE. */
int ckpt__os_rename_noreplace(const char *from, const char *to) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    int r = sys_renameat2(from, to, RENAME_NOREPLACE);
    if (r == 0 && recording()) record(CKPT_IO_RENAME, -1, 0, from, to, 0, NULL, 0);
    if (r == 0 || (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)) return r;
    struct stat st;
    if (lstat(to, &st) == 0) {
        errno = EEXIST;
        return -1;
    }
    return ckpt__os_rename_raw(from, to);
}

int ckpt__os_mkdir(const char *path, mode_t mode) {
    if (fault_hit(CKPT_FAULT_MKDIR)) return -1;
    int r = mkdir(path, mode);
    if (r == 0 && recording()) record(CKPT_IO_MKDIR, -1, 0, path, NULL, 0, NULL, 0);
    return r;
}

ssize_t ckpt__os_pwrite(int fd, const void *p, size_t n, uint64_t off) {
    if (off > (uint64_t)INT64_MAX) {
        errno = EINVAL;
        return -1;
    }
    for (;;) {
        ssize_t w = pwrite(fd, p, n, (off_t)off);
        if (w < 0 && errno == EINTR) continue;
        if (w > 0) count_written((uint64_t)w);
        if (w > 0 && recording()) record(CKPT_IO_WRITE, fd, 0, NULL, NULL, off, p, (size_t)w);
        return w;
    }
}

void *ckpt__os_map_read(int fd, size_t len) {
    void *p = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p != MAP_FAILED) ckpt__io_count_read(len);
    return p;
}

int ckpt__os_ftruncate(int fd, uint64_t len) {
    if (len > (uint64_t)INT64_MAX) {
        errno = EINVAL;
        return -1;
    }
    for (;;) {
        int r = ftruncate(fd, (off_t)len);
        if (r < 0 && errno == EINTR) continue;
        if (r == 0 && recording()) record(CKPT_IO_TRUNCATE, fd, 0, NULL, NULL, len, NULL, 0);
        return r;
    }
}

int ckpt__os_unlink(const char *path) {
    int r = unlink(path);
    if (r == 0 && recording()) record(CKPT_IO_UNLINK, -1, 0, path, NULL, 0, NULL, 0);
    return r;
}

int ckpt__os_rmdir(const char *path) {
    int r = rmdir(path);
    if (r == 0 && recording()) record(CKPT_IO_RMDIR, -1, 0, path, NULL, 0, NULL, 0);
    return r;
}

int ckpt__os_link(const char *from, const char *to) {
    int r = link(from, to);
    if (r == 0 && recording()) record(CKPT_IO_LINK, -1, 0, from, to, 0, NULL, 0);
    return r;
}
