/* io.c — the one write stream, crash-safe publication, whole-file reads, and
 * the fault-injection counter every OS wrapper consults. */
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "base/error.h"
#include "base/io.h"

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
        if (r > 0) count_read((uint64_t)r);
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
static int os_rename_raw(const char *from, const char *to) {
    int r = rename(from, to);
    if (r == 0 && recording()) record(CKPT_IO_RENAME, -1, 0, from, to, 0, NULL, 0);
    return r;
}

int ckpt__os_rename(const char *from, const char *to) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    return os_rename_raw(from, to);
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
static int os_rename_noreplace(const char *from, const char *to) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    int r = sys_renameat2(from, to, RENAME_NOREPLACE);
    if (r == 0 && recording()) record(CKPT_IO_RENAME, -1, 0, from, to, 0, NULL, 0);
    if (r == 0 || (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)) return r;
    struct stat st;
    if (lstat(to, &st) == 0) {
        errno = EEXIST;
        return -1;
    }
    return os_rename_raw(from, to);
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
    if (p != MAP_FAILED) count_read(len);
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

/* ---- the write stream --------------------------------------------------- */

/* The XXH3 states live in one allocation made through ckpt__malloc (so the
 * allocation-failure sweep covers it), aligned by hand as XXH3 requires. */
typedef struct hash_pair {
    XXH3_state_t whole;
    XXH3_state_t part;
    XXH3_state_t wide; /* XXH3-128 of the whole stream, when wanted */
} hash_pair;

static hash_pair *hash_pair_of(const ckpt_ostream *s) { return (hash_pair *)s->hash; }

static void ostream_release(ckpt_ostream *s) {
    free(s->path);
    free(s->hash_mem);
    s->path = NULL;
    s->hash_mem = NULL;
    s->hash = NULL;
    s->part_hash = NULL;
    s->fd = -1;
}

static int ostream_init(ckpt_ostream *s, const char *path) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->path = ckpt__strdup(path);
    size_t align = _Alignof(hash_pair) > 64 ? _Alignof(hash_pair) : 64;
    s->hash_mem = ckpt__malloc(sizeof(hash_pair) + align);
    if (!s->path || !s->hash_mem) {
        ostream_release(s);
        return ckpt__err_nomem("write stream");
    }
    uintptr_t a = ((uintptr_t)s->hash_mem + align - 1) & ~(uintptr_t)(align - 1);
    hash_pair *h = (hash_pair *)a;
    XXH3_INITSTATE(&h->whole);
    XXH3_INITSTATE(&h->part);
    XXH3_INITSTATE(&h->wide);
    XXH3_64bits_reset(&h->whole);
    XXH3_64bits_reset(&h->part);
    s->hash = h;
    s->part_hash = &h->part;
    return CKPT_OK;
}

int ckpt__ostream_open_dry(ckpt_ostream *s, const char *what) {
    CKPT_TRY(ostream_init(s, what));
    s->dry = true;
    ckpt__ostream_want128(s);
    return CKPT_OK;
}

void ckpt__ostream_want128(ckpt_ostream *s) {
    if (!s->hash || s->want128) return;
    XXH3_128bits_reset(&hash_pair_of(s)->wide);
    s->want128 = true;
}

int ckpt__ostream_open(ckpt_ostream *s, const char *path) {
    CKPT_TRY(ostream_init(s, path));
    int fd = ckpt__os_open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        int e = errno;
        ostream_release(s);
        return ckpt__err_os(e, "%s: create", path);
    }
    s->fd = fd;
    return CKPT_OK;
}

/* Large buffers go down in pieces so no single call has to move gigabytes
 * (Linux caps a write near 2 GiB anyway) and the checksum runs on data that
 * was just touched. */
#define OSTREAM_CHUNK ((size_t)64 << 20)

/* The kernel starts writing a file's dirty pages back only when a large
 * share of memory is dirty, so a big file written and then fsynced goes to
 * disk only at the fsync: the copy into the page cache and the disk write
 * follow each other. Starting the writeback of each finished window right
 * away (sync_file_range, which waits for nothing) lets them overlap, and the
 * final fsync finds most of the file already on its way. Durability still
 * comes only from that fsync; this call promises nothing (a power cut may
 * keep any part of it, as the crash model assumes anyway), and its failure
 * is ignored (the fsync reports real errors). */
#define OSTREAM_WRITEBACK_WINDOW ((uint64_t)16 << 20)

static void ostream_kick_writeback(ckpt_ostream *s) {
    uint64_t pending = s->bytes - s->kicked;
    if (pending < OSTREAM_WRITEBACK_WINDOW) return;
    if (!(io_unsafe & CKPT_IO_SKIP_FILE_FSYNC) && !(io_unsafe & CKPT_IO_SKIP_EVERY_FSYNC))
        (void)sync_file_range(s->fd, (off_t)s->kicked, (off_t)pending, SYNC_FILE_RANGE_WRITE);
    s->kicked = s->bytes;
}

int ckpt__ostream_write(ckpt_ostream *s, const void *p, size_t n) {
    if (s->err) return s->err;
    if (s->dry) {
        if (s->hash) XXH3_128bits_update(&hash_pair_of(s)->wide, p, n);
        s->bytes += n;
        return CKPT_OK;
    }
    if (s->fd < 0) return s->err = ckpt__err(CKPT_EINVAL, "write stream: not open");
    const uint8_t *b = p;
    hash_pair *h = hash_pair_of(s);
    while (n > 0) {
        size_t piece = n < OSTREAM_CHUNK ? n : OSTREAM_CHUNK;
        size_t done = 0;
        while (done < piece) {
            ssize_t w = ckpt__os_write(s->fd, b + done, piece - done);
            if (w < 0) return s->err = ckpt__err_os(errno, "%s: write", s->path);
            if (w == 0) return s->err = ckpt__err_os(EIO, "%s: write made no progress", s->path);
            done += (size_t)w;
        }
        XXH3_64bits_update(&h->whole, b, piece);
        XXH3_64bits_update(&h->part, b, piece);
        if (s->want128) XXH3_128bits_update(&h->wide, b, piece);
        s->bytes += piece;
        b += piece;
        n -= piece;
        ostream_kick_writeback(s);
    }
    return CKPT_OK;
}

void ckpt__ostream_part_begin(ckpt_ostream *s) {
    if (s->hash && !s->dry) XXH3_64bits_reset(&hash_pair_of(s)->part);
}

uint64_t ckpt__ostream_part_digest(const ckpt_ostream *s) {
    return s->hash && !s->dry ? XXH3_64bits_digest(&hash_pair_of(s)->part) : 0;
}

static void take_h128(ckpt_ostream *s) {
    memset(&s->h128, 0, sizeof s->h128);
    if (!s->want128 || !s->hash) return;
    XXH128_hash_t v = XXH3_128bits_digest(&hash_pair_of(s)->wide);
    s->h128.lo = v.low64;
    s->h128.hi = v.high64;
}

int ckpt__ostream_finish(ckpt_ostream *s, uint64_t *digest, uint64_t *size) {
    if (s->fd < 0 && !s->path) return ckpt__err(CKPT_EINVAL, "write stream: not open");
    int rc = s->err;
    if (s->dry) {
        if (!rc) take_h128(s);
        if (!rc && digest) *digest = 0;
        if (!rc && size) *size = s->bytes;
        ostream_release(s);
        return rc;
    }
    if (!rc && !(io_unsafe & CKPT_IO_SKIP_FILE_FSYNC) && ckpt__os_fsync(s->fd) < 0)
        rc = ckpt__err_os(errno, "%s: fsync", s->path);
    if (s->fd >= 0) {
        /* A failing close can report a delayed write error (NFS): count it. */
        if (close(s->fd) < 0 && !rc) rc = ckpt__err_os(errno, "%s: close", s->path);
        s->fd = -1;
    }
    if (rc) {
        ckpt__os_unlink(s->path);
        ostream_release(s);
        return rc;
    }
    if (digest) *digest = XXH3_64bits_digest(&hash_pair_of(s)->whole);
    if (size) *size = s->bytes;
    take_h128(s);
    ostream_release(s);
    return CKPT_OK;
}

void ckpt__ostream_abort(ckpt_ostream *s) {
    if (!s) return;
    if (s->fd >= 0) close(s->fd);
    if (s->path && !s->dry) ckpt__os_unlink(s->path);
    ostream_release(s);
}

/* ---- paths -------------------------------------------------------------- */

/* Splits path into a malloc'd folder ("." if none) and a pointer to the
 * final component. */
static int split_path(const char *path, char **dir, const char **base) {
    const char *slash = strrchr(path, '/');
    if (!slash) {
        *dir = ckpt__strdup(".");
        *base = path;
    } else {
        size_t n = (size_t)(slash - path);
        if (n == 0) n = 1; /* "/name": the folder is "/" */
        *dir = ckpt__malloc(n + 1);
        if (*dir) {
            memcpy(*dir, path, n);
            (*dir)[n] = '\0';
        }
        *base = slash + 1;
    }
    if (!*dir) return ckpt__err_nomem("path");
    if (!**base) {
        free(*dir);
        *dir = NULL;
        return ckpt__err(CKPT_EINVAL, "%s: not a file path (ends with '/')", path);
    }
    return CKPT_OK;
}

static _Atomic uint64_t temp_counter;

/* "<dir>/.<base>.<tag>.<pid>.<n>" */
static char *sibling_name(const char *dir, const char *base, const char *tag) {
    uint64_t n = ++temp_counter;
    int len = snprintf(NULL, 0, "%s/.%s.%s.%ld.%llu", dir, base, tag, (long)getpid(),
                       (unsigned long long)n);
    char *s = ckpt__malloc((size_t)len + 1);
    if (s)
        snprintf(s, (size_t)len + 1, "%s/.%s.%s.%ld.%llu", dir, base, tag, (long)getpid(),
                 (unsigned long long)n);
    return s;
}

/* ---- crash-safe publication -------------------------------------------- */

int ckpt__fsync_dir(const char *path) {
    int fd = ckpt__os_open(path, O_RDONLY | O_DIRECTORY, 0);
    if (fd < 0) return ckpt__err_os(errno, "%s: open folder for fsync", path);
    int rc = CKPT_OK;
    /* Some file systems cannot fsync a folder (EINVAL): nothing to make durable. */
    if (ckpt__os_fsync(fd) < 0 && errno != EINVAL)
        rc = ckpt__err_os(errno, "%s: fsync folder", path);
    close(fd);
    return rc;
}

int ckpt__publish_file(const char *path, ckpt_fill_fn fill, void *ctx, uint64_t *digest,
                       uint64_t *size) {
    if (!path || !fill) return ckpt__err(CKPT_EINVAL, "publish: no path or fill function");
    char *dir = NULL;
    const char *base = NULL;
    CKPT_TRY(split_path(path, &dir, &base));
    char *tmp = sibling_name(dir, base, "tmp");
    char *old = sibling_name(dir, base, "old");
    int rc = CKPT_OK;
    bool have_old = false;
    ckpt_ostream s;
    memset(&s, 0, sizeof s);
    s.fd = -1;
    if (!tmp || !old) {
        rc = ckpt__err_nomem("publish");
        goto out;
    }
    rc = ckpt__ostream_open(&s, tmp);
    if (rc) goto fail_prefix;
    rc = fill(&s, ctx);
    if (!rc && s.err) rc = s.err;
    if (rc) {
        ckpt__ostream_abort(&s);
        goto fail_prefix;
    }
    uint64_t d = 0, sz = 0;
    rc = ckpt__ostream_finish(&s, &d, &sz);
    if (rc) goto fail_prefix;
    /* Keep a hard link to the file being replaced, so that if the folder
     * fsync after the rename fails we can put it back: the caller is told
     * "failed" and finds the old bytes, not an undurable new file. */
    if (ckpt__os_link(path, old) == 0) have_old = true;
    if (ckpt__os_rename(tmp, path) < 0) {
        rc = ckpt__err_os(errno, "%s: rename temporary file into place", path);
        ckpt__os_unlink(tmp);
        if (have_old) ckpt__os_unlink(old);
        goto out;
    }
    rc = ckpt__fsync_dir(dir);
    if (rc) {
        if (have_old)
            os_rename_raw(old, path);
        else
            ckpt__os_unlink(path);
        rc = ckpt__err_prefix(rc, "%s", path);
        goto out;
    }
    if (have_old) ckpt__os_unlink(old);
    if (digest) *digest = d;
    if (size) *size = sz;
    goto out;
fail_prefix:
    /* Messages from the stream name the temporary file; say what it was for. */
    rc = ckpt__err_prefix(rc, "%s", path);
    if (tmp) ckpt__os_unlink(tmp);
out:
    free(tmp);
    free(old);
    free(dir);
    return rc;
}

static int dir_exists(const char *path, bool *exists) {
    struct stat st;
    if (lstat(path, &st) == 0) {
        if (!S_ISDIR(st.st_mode))
            return ckpt__err(CKPT_EINVAL, "%s: exists and is not a folder", path);
        *exists = true;
        return CKPT_OK;
    }
    if (errno == ENOENT) {
        *exists = false;
        return CKPT_OK;
    }
    return ckpt__err_os(errno, "%s: stat", path);
}

int ckpt__publish_dir(const char *tmp_dir, const char *final, bool replace) {
    if (!tmp_dir || !final) return ckpt__err(CKPT_EINVAL, "publish folder: missing path");
    CKPT_TRY(ckpt__fsync_dir(tmp_dir));
    char *parent = NULL;
    const char *base = NULL;
    CKPT_TRY(split_path(final, &parent, &base));
    int rc = CKPT_OK;
    bool exists = false;
    rc = dir_exists(final, &exists);
    if (rc) goto out;
    if (!exists) {
        if (os_rename_noreplace(tmp_dir, final) == 0) goto synced;
        if (errno != EEXIST && errno != ENOTEMPTY) {
            rc = ckpt__err_os(errno, "%s: rename %s into place", final, tmp_dir);
            goto out;
        }
        exists = true; /* appeared meanwhile: treat as a replacement */
    }
    if (!replace) {
        rc = ckpt__err(CKPT_EEXIST, "%s: already exists", final);
        goto out;
    }
    if (ckpt__os_exchange(tmp_dir, final) == 0) {
        /* tmp_dir now holds the old checkpoint: make the swap durable first. */
        rc = (io_unsafe & CKPT_IO_SKIP_PUBLISH_FSYNC) ? CKPT_OK : ckpt__fsync_dir(parent);
        if (rc) goto out;
        if (ckpt__remove_tree(tmp_dir) != CKPT_OK) ckpt_clear_error(); /* a hidden leftover */
        goto out;
    }
    if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP) {
        rc = ckpt__err_os(errno, "%s: exchange with %s", final, tmp_dir);
        goto out;
    }
    {
        /* No RENAME_EXCHANGE on this file system: move the old folder aside
         * first. A crash between the two renames leaves no checkpoint at
         * final, but both folders stay on disk. */
        char *aside = sibling_name(parent, base, "old");
        if (!aside) {
            rc = ckpt__err_nomem("publish folder");
            goto out;
        }
        if (ckpt__os_rename(final, aside) < 0) {
            rc = ckpt__err_os(errno, "%s: move old folder aside", final);
            free(aside);
            goto out;
        }
        if (ckpt__os_rename(tmp_dir, final) < 0) {
            rc = ckpt__err_os(errno, "%s: rename %s into place", final, tmp_dir);
            os_rename_raw(aside, final);
            free(aside);
            goto out;
        }
        rc = ckpt__fsync_dir(parent);
        if (!rc && ckpt__remove_tree(aside) != CKPT_OK) ckpt_clear_error();
        free(aside);
        goto out;
    }
synced:
    rc = (io_unsafe & CKPT_IO_SKIP_PUBLISH_FSYNC) ? CKPT_OK : ckpt__fsync_dir(parent);
out:
    free(parent);
    return rc;
}

int ckpt__mkdirs(const char *path) {
    if (!path || !*path) return ckpt__err(CKPT_EINVAL, "mkdirs: empty path");
    char *p = ckpt__strdup(path);
    if (!p) return ckpt__err_nomem("mkdirs");
    int rc = CKPT_OK;
    size_t len = strlen(p);
    for (size_t i = 1; i <= len; i++) {
        if (p[i] != '/' && p[i] != '\0') continue;
        if (p[i - 1] == '/') continue; /* "a//b" */
        char saved = p[i];
        p[i] = '\0';
        if (ckpt__os_mkdir(p, 0755) < 0) {
            int e = errno;
            struct stat st;
            /* EEXIST, or EACCES on a parent we may not write but that exists. */
            if (stat(p, &st) == 0) {
                if (!S_ISDIR(st.st_mode)) {
                    rc = ckpt__err(CKPT_EINVAL, "%s: exists and is not a folder", p);
                    break;
                }
            } else {
                rc = ckpt__err_os(e, "%s: mkdir", p);
                break;
            }
        }
        p[i] = saved;
    }
    free(p);
    return rc;
}

static int remove_one(const char *path, const struct stat *st, int type, struct FTW *ftw) {
    (void)st;
    (void)ftw;
    int r = (type == FTW_DP) ? ckpt__os_rmdir(path) : ckpt__os_unlink(path);
    if (r < 0 && errno != ENOENT) {
        ckpt__err_os(errno, "%s: remove", path);
        return 1;
    }
    return 0;
}

int ckpt__remove_tree(const char *path) {
    struct stat st;
    if (lstat(path, &st) < 0) {
        if (errno == ENOENT) return CKPT_OK;
        return ckpt__err_os(errno, "%s: stat", path);
    }
    if (!S_ISDIR(st.st_mode)) {
        if (ckpt__os_unlink(path) < 0) return ckpt__err_os(errno, "%s: remove", path);
        return CKPT_OK;
    }
    /* FTW_PHYS: never follow a symlink out of the tree we own. */
    int r = nftw(path, remove_one, 16, FTW_DEPTH | FTW_PHYS | FTW_MOUNT);
    if (r == 1) return CKPT_EIO;
    if (r < 0) return ckpt__err_os(errno, "%s: remove folder", path);
    return CKPT_OK;
}

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
    if ((own ? lstat(path, st) : stat(path, st)) != 0) return ckpt__err_os(errno, "%s: open", what);
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
    if (fstat(fd, st) != 0) rc = ckpt__err_os(errno, "%s: stat", what);
    else if (!S_ISREG(st->st_mode))
        rc = ckpt__err(bad, "%s: %s, expected a regular file", what,
                       ckpt__file_type_name(st->st_mode));
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0)
        rc = ckpt__err_os(errno, "%s: fcntl", what);
    if (rc < 0) {
        close(fd);
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
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        rc = ckpt__err_os(errno, "%s: mmap", path);
        goto out;
    }
    count_read((uint64_t)st.st_size);
    m->data = p;
    m->size = (uint64_t)st.st_size;
    m->map_base = p;
    m->map_len = (size_t)st.st_size;
out:
    close(fd);
    return rc;
}

void ckpt__unmap(ckpt_mapped *m) {
    if (!m) return;
    if (m->map_base) munmap(m->map_base, m->map_len);
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
    close(fd);
    return rc;
}

uint64_t ckpt__xxh3(const void *p, size_t n) { return XXH3_64bits(p, n); }

ckpt_h128 ckpt__xxh128(const void *p, size_t n) {
    XXH128_hash_t v = XXH3_128bits(p, n);
    return (ckpt_h128){v.low64, v.high64};
}

/* ---- reads that hash on the way --------------------------------------------- */

/* Small enough to stay in the CPU cache between the read and the hash,
 * large enough that a read from disk is one large request (a cold read in
 * 1 MiB pieces ran at a third of the speed of 8 MiB ones). */
#define HASH_PIECE ((size_t)8 << 20)

static int read_hashed(const char *path, const char *what, uint64_t size, uint8_t *dst,
                       uint64_t *digest, ckpt_h128 *wide) {
    size_t align = _Alignof(XXH3_state_t) > 64 ? _Alignof(XXH3_state_t) : 64;
    void *mem = ckpt__malloc(2 * sizeof(XXH3_state_t) + align + (dst ? 0 : HASH_PIECE));
    if (!mem) return ckpt__err_nomem(what);
    uintptr_t a = ((uintptr_t)mem + align - 1) & ~(uintptr_t)(align - 1);
    XXH3_state_t *h = (XXH3_state_t *)a, *h2 = h + 1;
    uint8_t *scratch = (uint8_t *)(h + 2);
    XXH3_INITSTATE(h);
    XXH3_64bits_reset(h);
    if (wide) {
        XXH3_INITSTATE(h2);
        XXH3_128bits_reset(h2);
    }
    int rc = CKPT_OK;
    struct stat st;
    int fd = ckpt__open_read(path, what, true, &st);
    if (fd < 0) {
        free(mem);
        return fd;
    }
    if ((uint64_t)st.st_size != size) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %lld bytes, the manifest says %llu", what,
                       (long long)st.st_size, (unsigned long long)size);
    } else {
        /* The kernel reads ahead further for a file read from start to end. */
        (void)posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
        uint64_t off = 0;
        while (off < size) {
            size_t want = size - off < HASH_PIECE ? (size_t)(size - off) : HASH_PIECE;
            uint8_t *p = dst ? dst + off : scratch;
            size_t got = 0;
            while (got < want) {
                ssize_t r = ckpt__os_pread(fd, p + got, want - got, off + got);
                if (r < 0) {
                    rc = ckpt__err_os(errno, "%s: read", what);
                    break;
                }
                if (r == 0) {
                    rc = ckpt__err(CKPT_ECORRUPT, "%s: ends at byte %llu, the manifest says %llu",
                                   what, (unsigned long long)(off + got), (unsigned long long)size);
                    break;
                }
                got += (size_t)r;
            }
            if (rc < 0) break;
            /* From disk: the next piece is on its way while this one is hashed. */
            if (off + want < size)
                (void)posix_fadvise(fd, (off_t)(off + want), (off_t)HASH_PIECE,
                                    POSIX_FADV_WILLNEED);
            XXH3_64bits_update(h, p, want);
            if (wide) XXH3_128bits_update(h2, p, want);
            off += want;
        }
    }
    close(fd);
    if (rc == 0 && digest) *digest = XXH3_64bits_digest(h);
    if (rc == 0 && wide) {
        XXH128_hash_t v = XXH3_128bits_digest(h2);
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

bool ckpt__addressable(uint64_t n) {
    if (n > (uint64_t)SIZE_MAX / 2) return false;
    if (n == 0) return true;
    /* Address space only: nothing is committed or touched. */
    void *p = mmap(NULL, (size_t)n, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) return false;
    munmap(p, (size_t)n);
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
    void *p = mmap(NULL, (size_t)len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return ckpt__err_nomem("buffer area");
    a->p = p;
    a->cap = len;
    return CKPT_OK;
}

void ckpt__arena_free(ckpt_arena *a) {
    if (a->p) munmap(a->p, (size_t)a->cap);
    a->p = NULL;
    a->cap = 0;
}
