/* layers.c — the test build's layer over the file-system table: fault
 * injection (with its CKPT_FAULT / CKPT_FAULT_RANK variables), the crash
 * recorder and the durability-breaking switches (testing.h). It wraps the
 * table that was in place when the library was loaded and forwards every
 * call to it. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/fs.h"
#include "testing/testing.h"

#ifndef RENAME_EXCHANGE
#define RENAME_EXCHANGE (1 << 1)
#endif

static const ckpt_fs *next; /* the wrapped table */

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
static _Thread_local int exempt_depth;

static unsigned kinds_from_names(const char *s, size_t len) {
    static const struct {
        const char *name;
        unsigned bit;
    } tab[] = {
        {"open", CKPT_FAULT_OPEN},     {"write", CKPT_FAULT_WRITE}, {"fsync", CKPT_FAULT_FSYNC},
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
    static const struct {
        const char *name;
        int value;
    } tab[] = {
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

/* With CKPT_FAULT_RANK set, the fault waits for the rank note. */
static void fault_from_env(void) {
    const char *r = getenv("CKPT_FAULT_RANK");
    if (!r || !*r) fault_parse_env();
}

static void fault_note_rank(long rank) {
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
    if (exempt_depth > 0) return false;
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

static bool recording(void) { return atomic_load_explicit(&rec_fn, memory_order_relaxed) != NULL; }

static void record(ckpt_io_op op, int fd, int flags, const char *path, const char *path2,
                   uint64_t offset, const void *data, size_t len) {
    ckpt_io_record_fn fn = atomic_load_explicit(&rec_fn, memory_order_acquire);
    if (!fn) return;
    ckpt_io_event ev = {op, fd, flags, path, path2, offset, data, len};
    fn(atomic_load_explicit(&rec_user, memory_order_relaxed), &ev);
}

/* ---- the open log ------------------------------------------------------------ */

/* CKPT_OPEN_LOG=<file>: every file the library opens is appended to <file>,
 * one line each ("read <path>" or "write <path>"; a path as the library
 * gave it, openat's made whole through /proc/self/fd; " [thread]" after it
 * when a thread other than the process's first opened it, e.g. an
 * asynchronous save's), so that an end-to-end test can tell which files a
 * run read (a load that must not touch the project folder) and where.
 * Written with O_APPEND: the ranks of a job may share the file. */
static pthread_once_t open_log_once = PTHREAD_ONCE_INIT;
static int open_log_fd = -1;

static void open_log_init(void) {
    const char *p = getenv("CKPT_OPEN_LOG");
    if (p && *p) open_log_fd = next->open(p, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
}

static void open_log(const char *path, int flags) {
    pthread_once(&open_log_once, open_log_init);
    if (open_log_fd < 0 || !path) return;
    char line[4200];
    bool first = (pid_t)syscall(SYS_gettid) == getpid();
    int n =
        snprintf(line, sizeof line, "%s %s%s\n", (flags & O_ACCMODE) == O_RDONLY ? "read" : "write",
                 path, first ? "" : " [thread]");
    if (n > 0 && (size_t)n < sizeof line) (void)!next->write(open_log_fd, line, (size_t)n);
}

/* ---- the layer's table ---------------------------------------------------- */

static int l_open(const char *path, int flags, mode_t mode) {
    if (fault_hit(CKPT_FAULT_OPEN)) return -1;
    int fd = next->open(path, flags, mode);
    if (fd >= 0) open_log(path, flags);
    if (fd >= 0 && recording()) record(CKPT_IO_OPEN, fd, flags, path, NULL, 0, NULL, 0);
    return fd;
}

static int l_openat(int dirfd_, const char *path, int flags, mode_t mode) {
    if (fault_hit(CKPT_FAULT_OPEN)) return -1;
    int fd = next->openat(dirfd_, path, flags, mode);
    pthread_once(&open_log_once, open_log_init);
    if (fd >= 0 && (recording() || open_log_fd >= 0)) {
        /* The recorder knows paths, not folder descriptors. */
        char link[64], full[4096];
        ssize_t k = -1;
        if (path[0] != '/' && dirfd_ != AT_FDCWD) {
            snprintf(link, sizeof link, "/proc/self/fd/%d", dirfd_);
            k = next->readlink(link, full, sizeof full - 1);
        }
        if (k > 0 && (size_t)k + strlen(path) + 2 <= sizeof full) {
            full[k] = '\0';
            strcat(full, "/");
            strcat(full, path);
            open_log(full, flags);
            record(CKPT_IO_OPEN, fd, flags, full, NULL, 0, NULL, 0);
        } else {
            open_log(path, flags);
            record(CKPT_IO_OPEN, fd, flags, path, NULL, 0, NULL, 0);
        }
    }
    return fd;
}

static ssize_t l_write(int fd, const void *p, size_t n) {
    size_t cap = fault_max_write;
    if (cap && n > cap) n = cap;
    if (fault_hit(CKPT_FAULT_WRITE)) return -1;
    ssize_t w = next->write(fd, p, n);
    if (w > 0 && recording()) {
        /* The position a write just ended at tells where it started. */
        off_t end = next->lseek(fd, 0, SEEK_CUR);
        record(CKPT_IO_WRITE, fd, 0, NULL, NULL, end < 0 ? 0 : (uint64_t)end - (uint64_t)w, p,
               (size_t)w);
    }
    return w;
}

static ssize_t l_pread(int fd, void *p, size_t n, off_t off) {
    if (fault_hit(CKPT_FAULT_READ)) return -1;
    return next->pread(fd, p, n, off);
}

static ssize_t l_pwrite(int fd, const void *p, size_t n, off_t off) {
    ssize_t w = next->pwrite(fd, p, n, off);
    if (w > 0 && recording()) record(CKPT_IO_WRITE, fd, 0, NULL, NULL, (uint64_t)off, p, (size_t)w);
    return w;
}

/* Whether the unsafe switches drop this fsync. */
static bool fsync_skipped(int fd) {
    unsigned u = io_unsafe;
    if (u & CKPT_IO_SKIP_EVERY_FSYNC) return true;
    if (!(u & (CKPT_IO_SKIP_FILE_FSYNC | CKPT_IO_SKIP_PUBLISH_FSYNC))) return false;
    struct stat st;
    if (next->fstat(fd, &st) != 0) return false;
    if (S_ISDIR(st.st_mode)) return (u & CKPT_IO_SKIP_PUBLISH_FSYNC) != 0;
    return (u & CKPT_IO_SKIP_FILE_FSYNC) != 0;
}

static int l_fsync(int fd) {
    if (fsync_skipped(fd)) return 0;
    if (fault_hit(CKPT_FAULT_FSYNC)) return -1;
    int r = next->fsync(fd);
    if (r == 0 && recording()) record(CKPT_IO_FSYNC, fd, 0, NULL, NULL, 0, NULL, 0);
    return r;
}

static int l_writeback(int fd, off_t off, off_t len) {
    if (io_unsafe & (CKPT_IO_SKIP_FILE_FSYNC | CKPT_IO_SKIP_EVERY_FSYNC)) return 0;
    return next->writeback(fd, off, len);
}

static int l_ftruncate(int fd, off_t len) {
    int r = next->ftruncate(fd, len);
    if (r == 0 && recording()) record(CKPT_IO_TRUNCATE, fd, 0, NULL, NULL, (uint64_t)len, NULL, 0);
    return r;
}

static int l_rename(const char *from, const char *to) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    int r = next->rename(from, to);
    if (r == 0 && recording()) record(CKPT_IO_RENAME, -1, 0, from, to, 0, NULL, 0);
    return r;
}

static int l_renameat2(const char *from, const char *to, unsigned flags) {
    if (fault_hit(CKPT_FAULT_RENAME)) return -1;
    int r = next->renameat2(from, to, flags);
    if (r == 0 && recording())
        record((flags & RENAME_EXCHANGE) ? CKPT_IO_EXCHANGE : CKPT_IO_RENAME, -1, 0, from, to, 0,
               NULL, 0);
    return r;
}

static int l_mkdir(const char *path, mode_t mode) {
    if (fault_hit(CKPT_FAULT_MKDIR)) return -1;
    int r = next->mkdir(path, mode);
    if (r == 0 && recording()) record(CKPT_IO_MKDIR, -1, 0, path, NULL, 0, NULL, 0);
    return r;
}

static int l_rmdir(const char *path) {
    int r = next->rmdir(path);
    if (r == 0 && recording()) record(CKPT_IO_RMDIR, -1, 0, path, NULL, 0, NULL, 0);
    return r;
}

static int l_unlink(const char *path) {
    int r = next->unlink(path);
    if (r == 0 && recording()) record(CKPT_IO_UNLINK, -1, 0, path, NULL, 0, NULL, 0);
    return r;
}

static int l_link(const char *from, const char *to) {
    int r = next->link(from, to);
    if (r == 0 && recording()) record(CKPT_IO_LINK, -1, 0, from, to, 0, NULL, 0);
    return r;
}

static void l_note(ckpt_fs_note what, long value) {
    switch (what) {
    case CKPT_FS_NOTE_RANK: fault_note_rank(value); break;
    case CKPT_FS_NOTE_EXEMPT_BEGIN: exempt_depth++; break;
    case CKPT_FS_NOTE_EXEMPT_END:
        if (exempt_depth > 0) exempt_depth--;
        break;
    }
    next->note(what, value);
}

/* The calls the layer does not watch go straight to the wrapped table:
 * filled in from it at install time. */
static ckpt_fs layer;

/* Runs when the library is loaded (the test variant links this file into
 * every program: see CMakeLists.txt), before any I/O call. */
__attribute__((constructor)) static void layer_install(void) {
    layer = *ckpt__fs();
    layer.open = l_open;
    layer.openat = l_openat;
    layer.write = l_write;
    layer.pread = l_pread;
    layer.pwrite = l_pwrite;
    layer.fsync = l_fsync;
    layer.writeback = l_writeback;
    layer.ftruncate = l_ftruncate;
    layer.rename = l_rename;
    layer.renameat2 = l_renameat2;
    layer.mkdir = l_mkdir;
    layer.rmdir = l_rmdir;
    layer.unlink = l_unlink;
    layer.link = l_link;
    layer.note = l_note;
    next = ckpt__fs_install(&layer);
}

/* What the test variant's link line names so that this file is always
 * linked from the static library, even into a program that calls none of
 * testing.h (the CLI honours CKPT_FAULT too). */
const int ckpt__testing_layer = 1;
