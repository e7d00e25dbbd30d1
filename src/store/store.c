/* store.c — the checkpoint store: lock, numbering, leftovers, rotation, and
 * the folder tools (verify, list, prune). */
#include "store/store.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"

void ckpt__log(const ckpt_logger *lg, ckpt_log_level level, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (lg && lg->fn) {
        lg->fn(lg->user, level, msg);
        return;
    }
    fprintf(stderr, "ckpt: %s%s\n",
            level == CKPT_LOG_WARNING ? "warning: " : level == CKPT_LOG_ERROR ? "error: " : "", msg);
}

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
    return fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISDIR(st.st_mode);
}

int ckpt__list_numbers(const char *dir, int64_t **nums, int64_t *count) {
    *nums = NULL;
    *count = 0;
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "%s", dir);
    }
    int64_t cap = 0, n = 0;
    int64_t *v = NULL;
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
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
    closedir(d);
    if (rc < 0) {
        free(v);
        return rc;
    }
    if (n) qsort(v, (size_t)n, sizeof *v, cmp_i64);
    *nums = v;
    *count = n;
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

int ckpt__lock_acquire(ckpt_lock *lk, const char *lock_path) {
    lk->fd = -1;
    int fd = ckpt__os_open(lock_path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return ckpt__err_os(errno, "lock file %s", lock_path);
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        int e = errno;
        char holder[32] = "";
        ssize_t got = pread(fd, holder, sizeof holder - 1, 0);
        close(fd);
        if (e == EWOULDBLOCK) {
            if (got > 0) {
                holder[got] = '\0';
                holder[strcspn(holder, "\n")] = '\0';
                return ckpt__err(CKPT_EBUSY,
                                 "%s is locked by another process (pid %s) saving into this folder",
                                 lock_path, holder);
            }
            return ckpt__err(CKPT_EBUSY, "%s is locked by another process saving into this folder",
                             lock_path);
        }
        return ckpt__err_os(e, "lock %s", lock_path);
    }
    /* The holder's pid only makes the busy message more useful: best effort. */
    char pid[32];
    int n = snprintf(pid, sizeof pid, "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) == 0 && pwrite(fd, pid, (size_t)n, 0) < 0) {
        /* ignored: informational only */
    }
    lk->fd = fd;
    return 0;
}

void ckpt__lock_release(ckpt_lock *lk) {
    if (lk->fd >= 0) {
        /* Closing drops the flock; the file stays so that the lock's inode is
         * stable for other processes waiting on it. */
        close(lk->fd);
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
    DIR *d = opendir(dir);
    if (!d) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "%s", dir);
    }
    int rc = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!is_leftover(e->d_name, base)) continue;
        char *p = ckpt__path_join(dir, e->d_name);
        if (!p) {
            rc = ckpt__err_nomem("leftover path");
            break;
        }
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode)) {
            ckpt__log(lg, CKPT_LOG_WARNING,
                      "removing %s, the temporary folder of an interrupted save", p);
            int r = ckpt__remove_tree(p);
            if (r < 0)
                ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s: %s", p, ckpt_errmsg());
        }
        free(p);
    }
    closedir(d);
    return rc;
}

int ckpt__rotate(const char *dir, int64_t keep, const ckpt_logger *lg, int64_t *removed) {
    if (removed) *removed = 0;
    int64_t *nums = NULL, count = 0;
    CKPT_TRY(ckpt__list_numbers(dir, &nums, &count));
    int rc = 0;
    for (int64_t i = 0; i + keep < count; i++) {
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
        char hidden[96];
        snprintf(hidden, sizeof hidden, ".%s.old.%ld", name, (long)getpid());
        char *p = ckpt__path_join(dir, name);
        char *h = ckpt__path_join(dir, hidden);
        if (!p || !h) {
            free(p);
            free(h);
            rc = ckpt__err_nomem("rotation path");
            break;
        }
        /* Hide it first (one atomic rename), then delete: a crash midway
         * leaves a hidden leftover the next save removes, never a visible
         * half-deleted checkpoint. */
        if (ckpt__os_rename(p, h) != 0) {
            rc = ckpt__err_os(errno, "removing old checkpoint %s", p);
        } else {
            if (removed) (*removed)++;
            if (ckpt__remove_tree(h) < 0)
                ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s: %s", h, ckpt_errmsg());
        }
        free(p);
        free(h);
        if (rc < 0) break;
    }
    free(nums);
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

int ckpt_checkpoint_verify(const char *dir, bool deep, ckpt_checkpoint_info *info) {
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
        for (int64_t i = 0; i < c.m.nfiles; i++) info->total_bytes += c.m.files[i].size;
    }
    if (rc == 0) info->status = CKPT_CHECKPOINT_COMPLETE;
    else if (c.no_manifest) info->status = CKPT_CHECKPOINT_PARTIAL;
    ckpt__checkpoint_close(&c);
    return rc;
}

int ckpt_checkpoint_list(const char *project_dir, bool deep, ckpt_checkpoint_info **out,
                         int64_t *count) {
    if (out) *out = NULL;
    if (count) *count = 0;
    if (!project_dir || !out || !count)
        return ckpt__err(CKPT_EINVAL, "checkpoint_list: NULL argument");
    struct stat st;
    if (stat(project_dir, &st) != 0) return ckpt__err_os(errno, "project folder %s", project_dir);
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
        (void)ckpt_checkpoint_verify(p, deep, &infos[i]);
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

int ckpt_checkpoint_prune(const char *project_dir, int keep, int64_t *removed) {
    if (removed) *removed = 0;
    if (!project_dir) return ckpt__err(CKPT_EINVAL, "checkpoint_prune: project_dir is NULL");
    if (keep < 0) return ckpt__err(CKPT_EINVAL, "checkpoint_prune: keep is %d, expected >= 0", keep);
    struct stat st;
    if (stat(project_dir, &st) != 0) return ckpt__err_os(errno, "project folder %s", project_dir);
    char *dir = ckpt__checkpoints_dir(project_dir);
    if (!dir) return ckpt__err_nomem("checkpoints path");
    if (stat(dir, &st) != 0) {
        int rc = errno == ENOENT ? 0 : ckpt__err_os(errno, "%s", dir);
        free(dir);
        return rc;
    }
    char *lp = ckpt__path_join(dir, ".lock");
    if (!lp) {
        free(dir);
        return ckpt__err_nomem("lock path");
    }
    ckpt_lock lk;
    int rc = ckpt__lock_acquire(&lk, lp);
    if (rc == 0) {
        rc = ckpt__rotate(dir, keep, NULL, removed);
        ckpt__lock_release(&lk);
    }
    free(lp);
    free(dir);
    return rc;
}
