/* store.c — the checkpoint store: lock, numbering, leftovers, rotation, and
 * the folder tools (verify, list, prune). */
#include "store/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"

char *ckpt__path_join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = ckpt__malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

char *ckpt__checkpoints_dir(const char *project_dir) {
    return ckpt__path_join(project_dir, "checkpoints");
}

int ckpt__parse_checkpoint_name(const char *name, int64_t *n) {
    static const char prefix[] = "checkpoint_";
    if (strncmp(name, prefix, sizeof prefix - 1) != 0) return 0;
    const char *d = name + sizeof prefix - 1;
    size_t len = strlen(d);
    if (len == 0 || len > 18 || (d[0] == '0' && len > 1)) return 0;
    int64_t v = 0;
    for (size_t i = 0; i < len; i++) {
        if (d[i] < '0' || d[i] > '9') return 0;
        v = v * 10 + (d[i] - '0');
    }
    *n = v;
    return 1;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* No allocation here: a listing must not silently skip a folder when
 * memory is short. */
static bool is_dir_at(DIR *d, const char *name) {
    struct stat st;
    return ckpt__os_fstatat(ckpt__os_dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) == 0 &&
           S_ISDIR(st.st_mode);
}

int ckpt__list_numbers(const char *dir, int64_t **nums, int64_t *count) {
    *nums = NULL;
    *count = 0;
    DIR *d = ckpt__os_opendir(dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "%s", dir);
    }
    int64_t cap = 0, n = 0;
    int64_t *v = NULL;
    struct dirent *e;
    int rc = 0;
    while ((e = ckpt__os_readdir(d)) != NULL) {
        int64_t k;
        if (!ckpt__parse_checkpoint_name(e->d_name, &k) || !is_dir_at(d, e->d_name)) continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 16;
            int64_t *nv = ckpt__realloc(v, (size_t)cap * sizeof *nv);
            if (!nv) {
                rc = ckpt__err_nomem("checkpoint list");
                break;
            }
            v = nv;
        }
        v[n++] = k;
    }
    ckpt__os_closedir(d);
    if (rc < 0) {
        free(v);
        return rc;
    }
    if (n) qsort(v, (size_t)n, sizeof *v, cmp_i64);
    *nums = v;
    *count = n;
    return 0;
}

/* The folder part of path ("." for a bare name), malloc'd. */
static char *parent_of(const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    while (n > 0 && path[n - 1] != '/') n--;
    while (n > 1 && path[n - 1] == '/') n--;
    if (n == 0) return ckpt__strdup(".");
    char *p = ckpt__malloc(n + 1);
    if (p) {
        memcpy(p, path, n);
        p[n] = '\0';
    }
    return p;
}

/* "checkpoint_5, checkpoint_6 and checkpoint_7" (the newest 8, then how
 * many older) into buf at *used. */
static void name_numbers(const int64_t *nums, int64_t count, char *buf, size_t cap, size_t *used) {
    int64_t first = count > 8 ? count - 8 : 0;
    for (int64_t i = first; i < count && *used < cap; i++) {
        const char *sep = i == first ? "" : i == count - 1 ? " and " : ", ";
        *used += (size_t)snprintf(buf + *used, cap - *used, "%scheckpoint_%" PRId64, sep, nums[i]);
    }
    if (first > 0 && *used < cap)
        *used += (size_t)snprintf(buf + *used, cap - *used, " (and %" PRId64 " older)", first);
}

void ckpt__checkpoints_near(const char *path, const char *project_dir, char *buf, size_t cap) {
    buf[0] = '\0';
    char *parent = parent_of(path);
    char *pdir = project_dir ? ckpt__checkpoints_dir(project_dir) : NULL;
    const char *where[2] = {parent, pdir};
    size_t used = 0;
    for (int k = 0; k < 2 && used == 0; k++) {
        int64_t *nums = NULL, count = 0;
        if (!where[k] || (k == 1 && parent && strcmp(where[0], where[1]) == 0)) continue;
        if (ckpt__list_numbers(where[k], &nums, &count) == 0 && count > 0) {
            used = (size_t)snprintf(buf, cap, "; %s holds ", where[k]);
            if (used < cap) name_numbers(nums, count, buf, cap, &used);
        }
        free(nums);
    }
    if (used == 0 && parent)
        snprintf(buf, cap, "; there is no checkpoint_<n> folder in %s%s%s", parent,
                 pdir && strcmp(parent, pdir) != 0 ? " nor in " : "",
                 pdir && strcmp(parent, pdir) != 0 ? pdir : "");
    ckpt_clear_error(); /* a listing that failed only leaves the hint out */
    free(parent);
    free(pdir);
}

int ckpt__names_taken(const char *dir, int64_t *highest, char *odd, size_t cap) {
    *highest = -1;
    if (odd && cap) odd[0] = '\0';
    DIR *d = ckpt__os_opendir(dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "%s", dir);
    }
    size_t used = 0;
    int nodd = 0;
    struct dirent *e;
    while ((e = ckpt__os_readdir(d)) != NULL) {
        int64_t k;
        if (!ckpt__parse_checkpoint_name(e->d_name, &k)) continue;
        if (k > *highest) *highest = k;
        if (!odd) continue;
        struct stat st;
        int src = ckpt__os_fstatat(ckpt__os_dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW);
        if (src == 0 && S_ISDIR(st.st_mode)) continue;
        const char *what = src == 0 ? ckpt__file_type_name(st.st_mode) : "cannot be looked at";
        if (++nodd <= 4 && used < cap)
            used += (size_t)snprintf(odd + used, cap - used, "%s%s (%s)", nodd > 1 ? ", " : "",
                                     e->d_name, what);
        else if (nodd == 5 && used < cap) used += (size_t)snprintf(odd + used, cap - used, ", ...");
    }
    ckpt__os_closedir(d);
    return 0;
}

char *ckpt__lock_path(const char *parent, const char *base) {
    int64_t n;
    if (ckpt__parse_checkpoint_name(base, &n)) return ckpt__path_join(parent, ".lock");
    size_t len = strlen(base) + 8;
    char *name = ckpt__malloc(len);
    if (!name) return NULL;
    snprintf(name, len, ".%s.lock", base);
    char *p = ckpt__path_join(parent, name);
    free(name);
    return p;
}

/* More than any "<pid> <host>\n" line a holder writes. */
#define LOCK_TEXT_MAX 512

/* What a lock file may hold: nothing yet, or the "<pid> <host>\n" (from
 * python/ckpt_torch, "<pid>\n") a holder wrote (NUL bytes where a power cut
 * lost that write). Anything else is not a lock file ckpt made, and is never
 * truncated or written. */
static bool lock_text_ok(const char *text, ssize_t n) {
    if (n <= 0) return n == 0;
    bool zeros = true;
    for (ssize_t i = 0; i < n; i++) zeros = zeros && text[i] == '\0';
    if (zeros) return true;
    long pid = 0;
    char host[256] = "";
    int end = 0;
    if (text[n - 1] != '\n' || memchr(text, '\0', (size_t)n)) return false;
    /* "<pid>\n" alone is what python/ckpt_torch writes */
    if (sscanf(text, "%ld\n%n", &pid, &end) == 1 && pid > 0 && end == (int)n) return true;
    end = 0;
    return sscanf(text, "%ld %255s\n%n", &pid, host, &end) == 2 && pid > 0 && end == (int)n;
}

/* The lock file is opened, never followed: a symlink or a hard link named
 * .lock could point at any file (a checkpoint's, the user's), and the
 * holder writes its pid there. O_NONBLOCK: a FIFO cannot hang the open. */
/* Reads a lock file's text: housekeeping that a test layer does not fail. */
static ssize_t lock_read(int fd, char *text) {
    ckpt__fs_exempt_begin();
    ssize_t n = ckpt__os_pread(fd, text, LOCK_TEXT_MAX, 0);
    int e = errno;
    ckpt__fs_exempt_end();
    errno = e;
    return n;
}

static int lock_open(const char *lock_path, int flags, struct stat *st, char *text, ssize_t *n,
                     int *oserr) {
    *oserr = 0;
    int fd = ckpt__os_open(lock_path, flags | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644);
    if (fd < 0) {
        int e = *oserr = errno;
        if (e == ELOOP)
            return ckpt__err(CKPT_EINVAL,
                             "lock file %s is a symlink; ckpt makes a regular file "
                             "there (remove the link)",
                             lock_path);
        return ckpt__err_os(e, "lock file %s", lock_path);
    }
    int rc = CKPT_OK;
    if (ckpt__os_fstat(fd, st) != 0) rc = ckpt__err_os(errno, "lock file %s", lock_path);
    else if (!S_ISREG(st->st_mode))
        rc = ckpt__err(CKPT_EINVAL, "lock file %s is %s, expected a regular file (remove it)",
                       lock_path, ckpt__file_type_name(st->st_mode));
    else if (st->st_nlink > 1)
        rc = ckpt__err(CKPT_EINVAL,
                       "lock file %s has %lu names (a hard link to another file?); "
                       "ckpt uses a file of its own there (remove it)",
                       lock_path, (unsigned long)st->st_nlink);
    else if (st->st_size > LOCK_TEXT_MAX)
        rc = ckpt__err(CKPT_EINVAL,
                       "lock file %s holds %lld bytes, not a lock ckpt wrote (remove it)",
                       lock_path, (long long)st->st_size);
    if (rc == 0 && ckpt__os_set_nonblock(fd, false) != 0)
        rc = ckpt__err_os(errno, "lock file %s", lock_path);
    if (rc == 0) {
        *n = lock_read(fd, text);
        if (*n < 0) rc = ckpt__err_os(errno, "lock file %s: read", lock_path);
        else text[*n] = '\0';
    }
    if (rc < 0) {
        ckpt__os_close(fd);
        return rc;
    }
    return fd;
}

int ckpt__lock_acquire(ckpt_lock *lk, const char *lock_path, bool load_only) {
    lk->fd = -1;
    lk->skipped = false;
    struct stat st;
    char holder[LOCK_TEXT_MAX + 1];
    ssize_t got = 0;
    int e = 0;
    int fd = lock_open(lock_path, O_RDWR | O_CREAT, &st, holder, &got, &e);
    bool writable = fd >= 0;
    if (fd < 0 && load_only && (e == EROFS || e == EACCES)) {
        /* A load needs no write: on read-only media, or without the right
         * to write here, take the lock through a read-only descriptor
         * (flock does not need write access). */
        int first = e;
        fd = lock_open(lock_path, O_RDONLY, &st, holder, &got, &e);
        if (fd < 0 && e == ENOENT && first == EROFS) {
            /* Nothing can save into a read-only file system, so there is no
             * one to keep out. */
            ckpt_clear_error();
            lk->skipped = true;
            return 0;
        }
    }
    if (fd < 0) return fd;
    if (ckpt__os_flock(fd, LOCK_EX | LOCK_NB) != 0) {
        e = errno;
        /* The holder wrote "<pid> <host>\n" once it took the lock: read it
         * again now, the text read before may be its predecessor's. */
        if (e == EWOULDBLOCK) {
            ssize_t again = lock_read(fd, holder);
            if (again > 0) holder[again] = '\0';
            if (again > 0) got = again;
        }
        ckpt__os_close(fd);
        if (e == EWOULDBLOCK) {
            long pid = 0;
            char host[256] = "", me[256] = "";
            if (gethostname(me, sizeof me) != 0) me[0] = '\0';
            me[sizeof me - 1] = '\0';
            if (got > 0 && sscanf(holder, "%ld %255s", &pid, host) == 2 && pid > 0 &&
                pid == (long)getpid() && strcmp(host, me) == 0)
                return ckpt__err(CKPT_EBUSY,
                                 "%s is held by this process (pid %ld) itself: another "
                                 "accelerator of this project, not freed yet, or a save or load "
                                 "of it still running",
                                 lock_path, pid);
            if (got > 0 && sscanf(holder, "%ld %255s", &pid, host) == 2 && pid > 0)
                return ckpt__err(CKPT_EBUSY,
                                 "%s is held by another process (pid %ld on host %s) that saves "
                                 "into or loads from this folder",
                                 lock_path, pid, host);
            return ckpt__err(CKPT_EBUSY,
                             "%s is held by another process that saves into or loads from this "
                             "folder",
                             lock_path);
        }
        return ckpt__err_os(e, "lock %s", lock_path);
    }
    if (!writable) {
        lk->fd = fd;
        return 0;
    }
    /* Read again under the lock: the holder before us may have written it. */
    got = lock_read(fd, holder);
    if (got < 0 || !lock_text_ok(holder, got)) {
        ckpt__os_close(fd);
        return ckpt__err(CKPT_EINVAL,
                         "lock file %s holds something other than the \"<pid> <host>\" line ckpt "
                         "writes; not touching it (remove it)",
                         lock_path);
    }
    /* Who holds it only makes the busy message more useful: best effort. */
    char host[256];
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "unknown");
    host[sizeof host - 1] = '\0';
    char line[320];
    int n = snprintf(line, sizeof line, "%ld %s\n", (long)getpid(), host);
    if (n > 0 && (size_t)n < sizeof line && ckpt__os_ftruncate(fd, 0) == 0 &&
        ckpt__os_pwrite(fd, line, (size_t)n, 0) < 0) {
        /* ignored: informational only */
    }
    lk->fd = fd;
    return 0;
}

void ckpt__lock_release(ckpt_lock *lk) {
    if (lk->fd >= 0) {
        /* Closing drops the flock; the file stays so that the lock's inode is
         * stable for other processes waiting on it. */
        ckpt__os_close(lk->fd);
        lk->fd = -1;
    }
}

char *ckpt__temp_name(const char *base) {
    size_t len = strlen(base) + 48;
    char *p = ckpt__malloc(len);
    if (p) snprintf(p, len, ".%s.tmp.%ld", base, (long)getpid());
    return p;
}

/* 1..20 digits, then the end of the string or `stop`; returns the position
 * after them or NULL. */
static const char *digits(const char *s, char stop) {
    size_t n = 0;
    while (s[n] >= '0' && s[n] <= '9') n++;
    if (n == 0 || n > 20 || (s[n] != '\0' && s[n] != stop)) return NULL;
    return s + n;
}

/* The suffix of a hidden name we leave behind: ".tmp.<pid>" (a save's
 * temporary folder), ".old.<pid>" (rotation) or ".old.<pid>.<n>" (io's
 * replaced folder when it could not be removed). */
static bool leftover_suffix(const char *s) {
    const char *d;
    if (strncmp(s, ".tmp.", 5) == 0) return (d = digits(s + 5, '\0')) && !*d;
    if (strncmp(s, ".old.", 5) != 0 || !(d = digits(s + 5, '.'))) return false;
    return !*d || ((d = digits(d + 1, '\0')) && !*d);
}

/* ".<base><suffix>", or for base NULL ".checkpoint_<n><suffix>". */
static bool is_leftover(const char *name, const char *base) {
    if (name[0] != '.') return false;
    const char *rest = name + 1;
    if (base) {
        size_t b = strlen(base);
        return strncmp(rest, base, b) == 0 && leftover_suffix(rest + b);
    }
    static const char prefix[] = "checkpoint_";
    if (strncmp(rest, prefix, sizeof prefix - 1) != 0) return false;
    const char *d = digits(rest + sizeof prefix - 1, '.');
    return d && *d && leftover_suffix(d);
}

int ckpt__remove_leftovers(const char *dir, const char *base, const ckpt_logger *lg) {
    DIR *d = ckpt__os_opendir(dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "%s", dir);
    }
    int rc = 0;
    struct dirent *e;
    while ((e = ckpt__os_readdir(d)) != NULL) {
        if (!is_leftover(e->d_name, base)) continue;
        char *p = ckpt__path_join(dir, e->d_name);
        if (!p) {
            rc = ckpt__err_nomem("leftover path");
            break;
        }
        struct stat st;
        if (ckpt__os_lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) {
            ckpt__log(lg, CKPT_LOG_WARNING,
                      "removing %s, the temporary folder of an interrupted save", p);
            int r = ckpt__remove_tree(p);
            if (r < 0)
                ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s: %s", p, ckpt_errmsg());
        }
        free(p);
    }
    ckpt__os_closedir(d);
    return rc;
}

/* The pid in a leftover's name: the digits after ".tmp." or ".old.". */
static int64_t leftover_pid(const char *name) {
    const char *s = strstr(name, ".tmp.");
    if (!s) s = strstr(name, ".old.");
    if (!s) return -1;
    int64_t v = 0;
    for (s += 5; *s >= '0' && *s <= '9'; s++) {
        if (v > INT32_MAX) return -1;
        v = v * 10 + (*s - '0');
    }
    return v;
}

static bool process_running(int64_t pid) {
    if (pid <= 0 || pid > INT32_MAX) return false;
    return kill((pid_t)pid, 0) == 0 || errno == EPERM;
}

/* Calls fn for every leftover folder (".checkpoint_<n>.tmp.<pid>" and the
 * like) in dir; a missing dir has none. Stops at fn's first error. */
typedef int (*leftover_fn)(void *user, const char *dir, const char *name);
static int each_leftover(const char *dir, leftover_fn fn, void *user) {
    DIR *d = ckpt__os_opendir(dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "%s", dir);
    }
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = ckpt__os_readdir(d)) != NULL)
        if (is_leftover(e->d_name, NULL) && is_dir_at(d, e->d_name)) rc = fn(user, dir, e->d_name);
    ckpt__os_closedir(d);
    return rc;
}

static int remove_if_dead(void *user, const char *dir, const char *name) {
    const ckpt_logger *lg = user;
    int64_t pid = leftover_pid(name);
    if (process_running(pid)) return 0;
    char *p = ckpt__path_join(dir, name);
    if (!p) return ckpt__err_nomem("leftover path");
    ckpt__log(lg, CKPT_LOG_WARNING,
              "removing %s, the temporary folder of a save whose process (%" PRId64 ") is gone", p,
              pid);
    if (ckpt__remove_tree(p) < 0)
        ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s: %s", p, ckpt_errmsg());
    free(p);
    return 0;
}

void ckpt__remove_dead_leftovers(const char *dir, const ckpt_logger *lg) {
    if (each_leftover(dir, remove_if_dead, (void *)lg) < 0) {
        ckpt__log(lg, CKPT_LOG_WARNING, "leftover temporary folders not removed: %s",
                  ckpt_errmsg());
        ckpt_clear_error();
    }
}

typedef ckpt_rotation rotation;

bool ckpt__retention_active(const ckpt_retention *pol) {
    return pol && (pol->keep_every_steps > 0 || pol->best_k > 0);
}

int ckpt__retention_check(const ckpt_retention *pol, const char *what) {
    if (!pol) return 0;
    if (pol->keep_every_steps < 0)
        return ckpt__err(CKPT_EINVAL, "%s: keep_every_steps is %" PRId64 ", expected >= 0", what,
                         pol->keep_every_steps);
    if (pol->best_k < 0)
        return ckpt__err(CKPT_EINVAL, "%s: best_k is %d, expected >= 0", what, pol->best_k);
    if (pol->best_mode != CKPT_BEST_MIN && pol->best_mode != CKPT_BEST_MAX)
        return ckpt__err(CKPT_EINVAL,
                         "%s: best_mode is %d, expected CKPT_BEST_MIN or CKPT_BEST_MAX", what,
                         (int)pol->best_mode);
    if (pol->best_k > 0 && !pol->best_metric)
        return ckpt__err(CKPT_EINVAL, "%s: best_k is %d but best_metric is not set", what,
                         pol->best_k);
    if (pol->best_metric && !ckpt__metric_name_valid(pol->best_metric))
        return ckpt__err(CKPT_EINVAL,
                         "%s: best_metric '%.64s' is not 1..63 bytes of [A-Za-z0-9_.:/-]", what,
                         pol->best_metric);
    return 0;
}

/* Hides checkpoint folder `name` of dir (one atomic rename), makes the
 * rename durable (folder fsync), then deletes it: a crash or power cut
 * midway leaves a hidden leftover that the next save or prune removes, never
 * a visible half-deleted checkpoint. Without the fsync a power cut could
 * undo the rename but keep some of the deletions. */
static int remove_checkpoint(const char *dir, const char *name, const ckpt_logger *lg,
                             const ckpt_rotate_opts *o) {
    char hidden[96];
    snprintf(hidden, sizeof hidden, ".%s.old.%ld", name, (long)getpid());
    char *p = ckpt__path_join(dir, name);
    char *h = ckpt__path_join(dir, hidden);
    int rc = 0;
    if (!p || !h) {
        rc = ckpt__err_nomem("rotation path");
    } else if (ckpt__os_rename(p, h) != 0) {
        rc = ckpt__err_os(errno, "removing old checkpoint %s", p);
    } else if (ckpt__fsync_dir(dir) < 0) {
        ckpt__log(lg, CKPT_LOG_WARNING, "left %s hidden, not deleted: %s", h, ckpt_errmsg());
    } else if (o && o->defer) {
        o->defer(o->user, h); /* its files are deleted later, by the callee */
        h = NULL;
    } else if (ckpt__remove_tree(h) < 0) {
        ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s: %s", h, ckpt_errmsg());
    }
    free(p);
    free(h);
    return rc;
}

int ckpt__remove_checkpoint(const char *dir, const char *name, const ckpt_logger *lg) {
    return remove_checkpoint(dir, name, lg, NULL);
}

/* One checkpoint folder's fate. */
typedef struct verdict {
    bool remove;
    ckpt_prune_reason reason;
    char *why; /* malloc'd verification message of an invalid one, or NULL */
    bool valid;
    bool has_metric; /* valid, with the policy's best_metric */
    int64_t number, step;
    double metric;
} verdict;

static const ckpt_retention *sort_pol; /* qsort has no context argument */

/* Best first: the better value, then the newer checkpoint. */
static int cmp_best(const void *a, const void *b) {
    const verdict *x = *(const verdict *const *)a, *y = *(const verdict *const *)b;
    if (x->metric != y->metric) {
        bool x_better = sort_pol->best_mode == CKPT_BEST_MIN ? x->metric < y->metric
                                                            : x->metric > y->metric;
        return x_better ? -1 : 1;
    }
    return x->number > y->number ? -1 : x->number < y->number;
}

/* The policies' keeps among the valid checkpoints: multiples of
 * keep_every_steps and the best_k by best_metric. */
static int apply_policy(verdict *v, int64_t count, const ckpt_retention *pol) {
    for (int64_t i = 0; i < count; i++)
        if (v[i].valid && pol->keep_every_steps > 0 && v[i].step % pol->keep_every_steps == 0)
            v[i].remove = false;
    if (pol->best_k <= 0) return 0;
    verdict **rank = count ? ckpt__calloc((size_t)count, sizeof *rank) : NULL;
    if (count && !rank) return ckpt__err_nomem("retention plan");
    int64_t n = 0;
    for (int64_t i = 0; i < count; i++)
        if (v[i].has_metric) rank[n++] = &v[i];
    sort_pol = pol;
    if (n > 1) qsort(rank, (size_t)n, sizeof *rank, cmp_best);
    for (int64_t i = 0; i < n && i < pol->best_k; i++) rank[i]->remove = false;
    free(rank);
    return 0;
}

static void note_valid(verdict *v, const ckpt_checkpoint_info *info, const ckpt_retention *pol) {
    v->valid = true;
    v->step = info->step;
    if (!pol || !pol->best_metric) return;
    for (int k = 0; k < info->num_metrics; k++)
        if (strcmp(info->metrics[k].name, pol->best_metric) == 0) {
            v->has_metric = true;
            v->metric = info->metrics[k].value;
        }
}

/* Counts only complete, deep-verified checkpoints toward keep, newest
 * first. Removes the valid ones beyond keep, and partial or corrupt ones
 * older than the newest valid checkpoint (nothing can fall back to them
 * before that one); keeps those newer than it (the evidence of what went
 * wrong) and those of a newer format. With no valid checkpoint nothing
 * goes. keep 0 removes every checkpoint. A failure to verify that says
 * nothing about the folder (memory, I/O) stops before anything is removed.
 * With a retention policy the newest valid one always stays (keep 0 adds
 * nothing), the ones beyond keep are checked against their manifests
 * (shallow) to learn their step and metrics, and the policy keeps some of
 * them (apply_policy). */
int ckpt__rotate_src(const ckpt_rotate_src *src, rotation *r) {
    int64_t *nums = NULL, count = 0;
    CKPT_TRY(src->numbers(src->ctx, &nums, &count));
    verdict *v = count ? ckpt__calloc((size_t)count, sizeof *v) : NULL;
    if (count && !v) {
        free(nums);
        return ckpt__err_nomem("rotation plan");
    }
    bool policy = ckpt__retention_active(r->pol);
    int64_t keep = policy && r->keep < 1 ? 1 : r->keep;
    int rc = 0;
    int64_t kept = 0;
    for (int64_t i = count - 1; i >= 0 && rc == 0; i--) {
        v[i].number = nums[i];
        bool beyond = kept >= keep;
        if (beyond) {
            v[i].remove = true;
            v[i].reason = CKPT_PRUNE_OLD;
            if (!r->verify_all && !policy) continue;
        }
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
        ckpt_checkpoint_info info;
        /* The checkpoint the save just committed was hashed on its way out. */
        bool fresh = r->opts && r->opts->fresh >= 0 && nums[i] == r->opts->fresh;
        bool deep = (!beyond || (r->verify_all && !r->shallow_beyond)) && !fresh;
        int vrc = src->verify(src->ctx, nums[i], deep, &info);
        if (vrc == 0) {
            if (!beyond) kept++;
            note_valid(&v[i], &info, policy ? r->pol : NULL);
        } else if (vrc == CKPT_ECORRUPT || vrc == CKPT_ENOENT) {
            v[i].why = ckpt__strdup(ckpt_errmsg());
            if (kept > 0) {
                v[i].remove = true;
                v[i].reason = CKPT_PRUNE_INVALID;
            }
        } else if (vrc == CKPT_EUNSUPPORTED) {
            v[i].remove = false; /* a newer library's: not ours to judge */
        } else {
            rc = ckpt__err_prefix(vrc, "rotation: verifying %s", name);
        }
    }
    if (rc == 0 && policy) rc = apply_policy(v, count, r->pol);
    for (int64_t i = 0; rc == 0 && i < count; i++) r->valid_kept += v[i].valid && !v[i].remove;
    for (int64_t i = 0; rc == 0 && i < count; i++) {
        if (!v[i].remove) continue;
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
        char *p = ckpt__path_join(src->where, name);
        if (!p) {
            rc = ckpt__err_nomem("rotation path");
            break;
        }
        if (r->report) r->report(r->user, p, v[i].reason, v[i].why);
        if (v[i].reason == CKPT_PRUNE_INVALID && r->lg && !r->dry_run)
            ckpt__log(r->lg, CKPT_LOG_WARNING,
                      "removing %s, older than the newest valid checkpoint: %s", p,
                      v[i].why ? v[i].why : "invalid");
        free(p);
        if (!r->dry_run) rc = src->remove(src->ctx, nums[i], r->lg);
        if (rc == 0) r->removed++;
    }
    for (int64_t i = 0; i < count; i++) free(v[i].why);
    free(v);
    free(nums);
    return rc;
}

/* The checkpoint folders of a local checkpoints folder, for the rotation. */
typedef struct local_src {
    const char *dir;
    const ckpt_rotate_opts *opts;
} local_src;

static int local_numbers(void *ctx, int64_t **nums, int64_t *count) {
    const local_src *x = ctx;
    return ckpt__list_numbers(x->dir, nums, count);
}

static int local_verify(void *ctx, int64_t number, bool deep, ckpt_checkpoint_info *info) {
    const local_src *x = ctx;
    char name[48];
    snprintf(name, sizeof name, "checkpoint_%" PRId64, number);
    char *p = ckpt__path_join(x->dir, name);
    if (!p) return ckpt__err_nomem("rotation path");
    int rc = ckpt__checkpoint_verify_local(p, deep, info);
    free(p);
    return rc;
}

static int local_remove(void *ctx, int64_t number, const ckpt_logger *lg) {
    const local_src *x = ctx;
    char name[48];
    snprintf(name, sizeof name, "checkpoint_%" PRId64, number);
    return remove_checkpoint(x->dir, name, lg, x->opts);
}

static int rotate(const char *dir, rotation *r) {
    local_src x = {dir, r->opts};
    ckpt_rotate_src src = {&x, dir, local_numbers, local_verify, local_remove};
    return ckpt__rotate_src(&src, r);
}

int ckpt__rotate(const char *dir, int64_t keep, const ckpt_retention *pol, const ckpt_logger *lg,
                 const ckpt_rotate_opts *opts, int64_t *removed) {
    rotation r = {.keep = keep, .pol = pol, .lg = lg, .opts = opts};
    int rc = rotate(dir, &r);
    if (removed) *removed = r.removed;
    return rc;
}

/* ---- folder tools -------------------------------------------------------- */

static const char *base_name(const char *path, char *buf, size_t cap) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    size_t len = n - s;
    if (len >= cap) len = cap - 1;
    memcpy(buf, path + s, len);
    buf[len] = '\0';
    return buf;
}

int ckpt__checkpoint_shared_bytes_local(const char *dir, const char *other, uint64_t *bytes) {
    if (bytes) *bytes = 0;
    if (!dir || !other || !bytes)
        return ckpt__err(CKPT_EINVAL, "checkpoint_shared_bytes: NULL argument");
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    int rc = ckpt__manifest_read(dir, &m);
    for (int64_t i = 0; rc == 0 && i < m.nfiles; i++) {
        char *a = ckpt__path_join(dir, m.files[i].name);
        char *b = ckpt__path_join(other, m.files[i].name);
        struct stat sa, sb;
        if (!a || !b) rc = ckpt__err_nomem("checkpoint path");
        else if (ckpt__os_lstat(a, &sa) == 0 && ckpt__os_lstat(b, &sb) == 0 &&
                 S_ISREG(sa.st_mode) && sa.st_dev == sb.st_dev && sa.st_ino == sb.st_ino)
            *bytes += m.files[i].size;
        free(a);
        free(b);
    }
    ckpt__manifest_clear(&m);
    return rc;
}

int ckpt__checkpoint_verify_file_local(const char *dir, const char *name) {
    if (!dir || !name) return ckpt__err(CKPT_EINVAL, "checkpoint_verify_file: NULL argument");
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    int rc = ckpt__manifest_read(dir, &m);
    const ckpt_manifest_file *f = rc == 0 ? ckpt__manifest_find(&m, name) : NULL;
    if (rc == 0 && !f)
        rc = ckpt__err(CKPT_ENOENT, "%s: the manifest lists no file '%s'", dir, name);
    char *p = f ? ckpt__path_join(dir, name) : NULL;
    if (f && !p) rc = ckpt__err_nomem("checkpoint path");
    if (p) {
        char what[4400];
        snprintf(what, sizeof what, "%s: %s", dir, name);
        uint64_t h = 0;
        rc = ckpt__read_hashed(p, what, f->size, NULL, &h);
        if (rc == 0 && h != f->xxh3)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: checksum mismatch (XXH3-64 %016" PRIx64
                           ", the manifest records %016" PRIx64 ")",
                           what, h, f->xxh3);
    }
    free(p);
    ckpt__manifest_clear(&m);
    return rc;
}

/* The highest-numbered checkpoint_<m>, m < n, beside dir (malloc'd), or
 * NULL. */
static char *predecessor(const char *dir, int64_t n) {
    char *parent = NULL;
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/') len--;
    while (len > 0 && dir[len - 1] != '/') len--;
    parent = len == 0 ? ckpt__strdup(".") : ckpt__malloc(len + 1);
    if (!parent) return NULL;
    if (len > 0) {
        memcpy(parent, dir, len);
        parent[len] = '\0';
    }
    int64_t *nums = NULL, count = 0, best = -1;
    if (ckpt__list_numbers(parent, &nums, &count) == 0)
        for (int64_t i = 0; i < count; i++)
            if (nums[i] < n) best = nums[i];
    free(nums);
    char *out = NULL;
    if (best >= 0) {
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, best);
        out = ckpt__path_join(parent, name);
    }
    free(parent);
    return out;
}

int ckpt__checkpoint_verify_local(const char *dir, bool deep, ckpt_checkpoint_info *info) {
    ckpt_checkpoint_info local;
    if (!info) info = &local;
    memset(info, 0, sizeof *info);
    info->number = -1;
    info->status = CKPT_CHECKPOINT_CORRUPT;
    if (!dir) return ckpt__err(CKPT_EINVAL, "checkpoint_verify: dir is NULL");
    snprintf(info->path, sizeof info->path, "%s", dir);
    char base[256];
    int64_t n;
    if (ckpt__parse_checkpoint_name(base_name(dir, base, sizeof base), &n)) info->number = n;
    ckpt_checkpoint_open c;
    int rc = ckpt__checkpoint_open(dir, deep, false, &c);
    if (c.have_manifest) {
        info->step = c.m.step;
        info->iteration = c.m.iteration;
        info->created_unix = c.m.created_unix;
        info->num_files = (int)c.m.nfiles;
        info->num_processes = c.m.num_processes;
        info->format_version = (int)c.m.format_version;
        snprintf(info->library_version, sizeof info->library_version, "%s", c.m.library_version);
        info->num_metrics = c.m.nmetrics;
        memcpy(info->metrics, c.m.metrics, sizeof info->metrics);
        for (int64_t i = 0; i < c.m.nfiles; i++) info->total_bytes += c.m.files[i].size;
    }
    if (rc == 0) info->status = CKPT_CHECKPOINT_COMPLETE;
    else if (c.no_manifest) info->status = CKPT_CHECKPOINT_PARTIAL;
    bool listed = c.have_manifest;
    ckpt__checkpoint_close(&c);
    char *prev = listed && info->number > 0 ? predecessor(dir, info->number) : NULL;
    if (prev) {
        /* the verification's message stays the one callers read */
        char *keep = rc < 0 ? ckpt__strdup(ckpt_errmsg()) : NULL;
        (void)ckpt__checkpoint_shared_bytes_local(dir, prev, &info->shared_bytes);
        if (keep) ckpt__err(rc, "%s", keep);
        else if (rc == 0) ckpt_clear_error();
        free(keep);
        free(prev);
    }
    return rc;
}

int ckpt__checkpoint_list_local(const char *project_dir, bool deep, ckpt_checkpoint_info **out,
                                int64_t *count) {
    if (out) *out = NULL;
    if (count) *count = 0;
    if (!project_dir || !out || !count)
        return ckpt__err(CKPT_EINVAL, "checkpoint_list: NULL argument");
    struct stat st;
    if (ckpt__os_stat(project_dir, &st) != 0)
        return ckpt__err_os(errno, "project folder %s", project_dir);
    if (!S_ISDIR(st.st_mode))
        return ckpt__err(CKPT_EINVAL, "project folder %s is not a folder", project_dir);
    char *dir = ckpt__checkpoints_dir(project_dir);
    if (!dir) return ckpt__err_nomem("checkpoints path");
    int64_t *nums = NULL, n = 0;
    int rc = ckpt__list_numbers(dir, &nums, &n);
    ckpt_checkpoint_info *infos = NULL;
    if (rc == 0 && n > 0) {
        infos = ckpt__calloc((size_t)n, sizeof *infos);
        if (!infos) rc = ckpt__err_nomem("checkpoint list");
    }
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
        char *p = ckpt__path_join(dir, name);
        if (!p) {
            rc = ckpt__err_nomem("checkpoint path");
            break;
        }
        /* A bad checkpoint is an entry with its status, not a failure of the list. */
        (void)ckpt__checkpoint_verify_local(p, deep, &infos[i]);
        free(p);
    }
    free(nums);
    free(dir);
    if (rc < 0) {
        free(infos);
        return rc;
    }
    *out = infos;
    *count = n;
    return 0;
}

/* <project_dir>/checkpoints, after checking project_dir is a folder; *dir
 * NULL (and 0) when the project has no checkpoints folder. */
static int project_checkpoints(const char *what, const char *project_dir, char **dir) {
    *dir = NULL;
    if (!project_dir) return ckpt__err(CKPT_EINVAL, "%s: project_dir is NULL", what);
    struct stat st;
    if (ckpt__os_stat(project_dir, &st) != 0)
        return ckpt__err_os(errno, "project folder %s", project_dir);
    if (!S_ISDIR(st.st_mode))
        return ckpt__err(CKPT_EINVAL, "project folder %s is not a folder", project_dir);
    char *d = ckpt__checkpoints_dir(project_dir);
    if (!d) return ckpt__err_nomem("checkpoints path");
    if (ckpt__os_stat(d, &st) != 0) {
        int rc = errno == ENOENT ? 0 : ckpt__err_os(errno, "%s", d);
        free(d);
        return rc;
    }
    *dir = d;
    return 0;
}

typedef struct leftover_list {
    ckpt_leftover_info *v;
    int64_t n, cap;
} leftover_list;

static int collect_leftover(void *user, const char *dir, const char *name) {
    leftover_list *l = user;
    if (l->n == l->cap) {
        int64_t cap = l->cap ? l->cap * 2 : 8;
        ckpt_leftover_info *nv = ckpt__realloc(l->v, (size_t)cap * sizeof *nv);
        if (!nv) return ckpt__err_nomem("leftover list");
        l->v = nv;
        l->cap = cap;
    }
    ckpt_leftover_info *e = &l->v[l->n++];
    memset(e, 0, sizeof *e);
    snprintf(e->path, sizeof e->path, "%s/%s", dir, name);
    e->pid = leftover_pid(name);
    e->running = process_running(e->pid);
    return 0;
}

static int cmp_leftover(const void *a, const void *b) {
    return strcmp(((const ckpt_leftover_info *)a)->path, ((const ckpt_leftover_info *)b)->path);
}

int ckpt__checkpoint_leftovers_local(const char *project_dir, ckpt_leftover_info **out,
                                     int64_t *count) {
    if (out) *out = NULL;
    if (count) *count = 0;
    if (!out || !count) return ckpt__err(CKPT_EINVAL, "checkpoint_leftovers: NULL argument");
    char *dir = NULL;
    CKPT_TRY(project_checkpoints("checkpoint_leftovers", project_dir, &dir));
    if (!dir) return 0;
    leftover_list l = {0};
    int rc = each_leftover(dir, collect_leftover, &l);
    free(dir);
    if (rc < 0) {
        free(l.v);
        return rc;
    }
    if (l.n > 1) qsort(l.v, (size_t)l.n, sizeof *l.v, cmp_leftover);
    *out = l.v;
    *count = l.n;
    return 0;
}

/* Under the project lock no save is under way, so every temporary folder
 * is a leftover; a dry run (no lock) passes over those whose process still
 * runs. */
static int prune_leftover(void *user, const char *dir, const char *name) {
    rotation *r = user;
    if (r->dry_run && process_running(leftover_pid(name))) return 0;
    char *p = ckpt__path_join(dir, name);
    if (!p) return ckpt__err_nomem("leftover path");
    if (r->report) r->report(r->user, p, CKPT_PRUNE_LEFTOVER, NULL);
    int rc = r->dry_run ? 0 : ckpt__remove_tree(p);
    if (rc < 0) rc = ckpt__err_prefix(rc, "removing leftover %s", p);
    free(p);
    return rc;
}

int ckpt__checkpoint_prune_ex_local(const char *project_dir, const ckpt_prune_options *opts,
                                    int64_t *removed) {
    if (removed) *removed = 0;
    if (!opts) return ckpt__err(CKPT_EINVAL, "checkpoint_prune: opts is NULL");
    if (opts->keep < 0)
        return ckpt__err(CKPT_EINVAL, "checkpoint_prune: keep is %d, expected >= 0", opts->keep);
    ckpt_retention pol = {.keep_every_steps = opts->keep_every_steps,
                          .best_metric = opts->best_metric,
                          .best_mode = opts->best_mode,
                          .best_k = opts->best_k};
    CKPT_TRY(ckpt__retention_check(&pol, "checkpoint_prune"));
    if (opts->valid_kept) *opts->valid_kept = 0;
    char *dir = NULL;
    CKPT_TRY(project_checkpoints("checkpoint_prune", project_dir, &dir));
    if (!dir) return 0;
    rotation r = {.keep = opts->keep, .pol = &pol, .dry_run = opts->dry_run, .verify_all = true,
                  .report = opts->report, .user = opts->user};
    ckpt_lock lk = {.fd = -1};
    int rc = 0;
    if (!opts->dry_run) {
        char *lp = ckpt__path_join(dir, ".lock");
        rc = lp ? ckpt__lock_acquire(&lk, lp, false) : ckpt__err_nomem("lock path");
        free(lp);
    }
    if (rc == 0) rc = each_leftover(dir, prune_leftover, &r);
    if (rc == 0) rc = rotate(dir, &r);
    ckpt__lock_release(&lk);
    if (removed) *removed = r.removed;
    if (opts->valid_kept) *opts->valid_kept = rc == 0 ? r.valid_kept : 0;
    free(dir);
    return rc;
}
