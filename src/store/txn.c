/* txn.c — the folder transaction (txn.h): temporary folder, commit, abort. */
#include "store/txn.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"

static int split(ckpt_txn *t, const char *path) {
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    if (n == s || (n - s == 1 && path[s] == '.') ||
        (n - s == 2 && path[s] == '.' && path[s + 1] == '.'))
        return ckpt__err(CKPT_EINVAL, "%s: %s: not a folder name that can be created", t->what,
                         path);
    t->target = ckpt__malloc(n + 1);
    t->base = ckpt__malloc(n - s + 1);
    /* "/x": the parent is "/"; "x": "." */
    size_t pl = s == 0 ? 1 : s > 1 ? s - 1 : 1;
    t->parent = ckpt__malloc(pl + 1);
    if (!t->target || !t->base || !t->parent) return ckpt__err_nomem("folder names");
    memcpy(t->target, path, n);
    t->target[n] = '\0';
    memcpy(t->base, path + s, n - s);
    t->base[n - s] = '\0';
    memcpy(t->parent, s == 0 ? "." : path, pl);
    t->parent[pl] = '\0';
    return CKPT_OK;
}

/* ".<base>.tmp.<digits>" */
static bool is_temp_of(const char *name, const char *base) {
    size_t b = strlen(base);
    if (name[0] != '.' || strncmp(name + 1, base, b) != 0 || strncmp(name + 1 + b, ".tmp.", 5))
        return false;
    const char *d = name + 1 + b + 5;
    size_t n = 0;
    while (d[n] >= '0' && d[n] <= '9') n++;
    return n > 0 && n <= 20 && d[n] == '\0';
}

/* An exclusive flock on the folder at path, without blocking; the open
 * descriptor in *fd. 1 if taken, 0 if another open file holds it, < 0 if
 * the folder cannot be opened or locked (not a folder, a link, gone). */
static int lock_folder(const char *path, int *fd) {
    /* Housekeeping, not the save: a test layer does not fail it. */
    ckpt__fs_exempt_begin();
    *fd = ckpt__os_open(path, O_RDONLY | O_DIRECTORY | O_NOFOLLOW, 0);
    ckpt__fs_exempt_end();
    if (*fd < 0) return -1;
    if (ckpt__os_flock(*fd, LOCK_EX | LOCK_NB) == 0) return 1;
    int e = errno;
    ckpt__os_close(*fd);
    *fd = -1;
    return e == EWOULDBLOCK ? 0 : -1;
}

/* Removes the temporary folders of t's target that no live transaction
 * holds (their process died: killed, or the machine lost power). */
static void remove_dead_temps(const ckpt_txn *t, const ckpt_logger *lg) {
    DIR *d = ckpt__os_opendir(t->parent);
    if (!d) return;
    struct dirent *e;
    while ((e = ckpt__os_readdir(d)) != NULL) {
        if (!is_temp_of(e->d_name, t->base)) continue;
        char *p = ckpt__path_join(t->parent, e->d_name);
        int fd = -1;
        if (p && lock_folder(p, &fd) == 1) {
            ckpt__log(lg, CKPT_LOG_WARNING,
                      "%s: removing %s, the temporary folder of an interrupted %s", t->what, p,
                      t->what);
            if (ckpt__remove_tree(p) < 0)
                ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s: %s", p, ckpt_errmsg());
        }
        if (fd >= 0) ckpt__os_close(fd);
        free(p);
    }
    ckpt__os_closedir(d);
}

int ckpt__txn_begin(ckpt_txn *t, const char *target, const char *what, bool create,
                    const ckpt_logger *lg) {
    *t = (ckpt_txn){.what = what, .lock_fd = -1};
    int rc = split(t, target);
    char *tname = NULL;
    if (rc == 0 &&
        (!(tname = ckpt__temp_name(t->base)) || !(t->tmp = ckpt__path_join(t->parent, tname))))
        rc = ckpt__err_nomem("folder names");
    free(tname);
    if (rc == 0 && create) {
        rc = ckpt__mkdirs(t->parent);
        if (rc < 0) rc = ckpt__err_prefix(rc, "%s", what);
        if (rc == 0) remove_dead_temps(t, lg);
        if (rc == 0 && ckpt__os_mkdir(t->tmp, 0755) != 0)
            rc = ckpt__err_os(errno, "%s: %s%s", what, t->tmp,
                              errno == EEXIST ? " (another transaction of this process)" : "");
        else if (rc == 0) t->made = true;
        if (rc == 0 && lock_folder(t->tmp, &t->lock_fd) != 1)
            rc = ckpt__err(CKPT_EEXIST, "%s: %s: taken by another process", what, t->tmp);
        if (rc == 0) t->locked = true;
    }
    if (rc < 0) ckpt__txn_end(t, NULL);
    return rc;
}

int ckpt__txn_check_replaceable(const ckpt_txn *t) {
    struct stat st;
    if (ckpt__os_lstat(t->target, &st) != 0) {
        if (errno == ENOENT) return CKPT_OK;
        return ckpt__err_os(errno, "%s: %s", t->what, t->target);
    }
    if (!S_ISDIR(st.st_mode))
        return ckpt__err(CKPT_EEXIST, "%s: %s exists and is not a folder", t->what, t->target);
    char *mp = ckpt__path_join(t->target, CKPT_MANIFEST_NAME);
    if (!mp) return ckpt__err_nomem("folder names");
    bool has_manifest = ckpt__os_lstat(mp, &st) == 0;
    free(mp);
    if (has_manifest) return CKPT_OK;
    DIR *d = ckpt__os_opendir(t->target);
    if (!d) return ckpt__err_os(errno, "%s: %s", t->what, t->target);
    struct dirent *e;
    bool empty = true;
    while ((e = ckpt__os_readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) empty = false;
    ckpt__os_closedir(d);
    if (!empty)
        return ckpt__err(CKPT_EEXIST,
                         "%s: %s exists, is not empty and is not a checkpoint (no "
                         CKPT_MANIFEST_NAME "); refusing to replace it",
                         t->what, t->target);
    return CKPT_OK;
}

/* The publication failed. If the new folder was already moved into place
 * (the failure was the parent's fsync), take it back out: the caller is told
 * the commit failed, so it must not be visible. */
static void undo_publish(ckpt_txn *t, const ckpt_logger *lg, const struct stat *ours, bool existed,
                         int code) {
    struct stat st;
    if (ckpt__os_lstat(t->target, &st) != 0 || st.st_dev != ours->st_dev ||
        st.st_ino != ours->st_ino)
        return;
    char saved[2048];
    snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
    if (!existed) {
        if (ckpt__remove_tree(t->target) < 0)
            ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s after a failed %s: %s", t->target,
                      t->what, ckpt_errmsg());
        t->made = false;
    } else if (ckpt__os_exchange(t->tmp, t->target) != 0) {
        /* tmp holds the old folder now: keep it as a hidden leftover. */
        t->made = false;
        ckpt__log(lg, CKPT_LOG_WARNING,
                  "%s holds the new folder although the %s failed; the old one is in %s",
                  t->target, t->what, t->tmp);
    }
    /* else: the old folder is back in place and tmp (ours) holds the new one. */
    ckpt__err(code, "%s", saved); /* the failure's message, not the undo's */
}

int ckpt__txn_commit(ckpt_txn *t, bool replace, const ckpt_logger *lg) {
    if (!t->made) return ckpt__err(CKPT_EINVAL, "%s: no temporary folder to commit", t->what);
    if (replace) CKPT_TRY(ckpt__txn_check_replaceable(t));
    struct stat tmp_st, tgt_st;
    bool existed = ckpt__os_lstat(t->target, &tgt_st) == 0;
    if (existed && !replace)
        return ckpt__err(CKPT_EEXIST, "%s: %s already exists", t->what, t->target);
    if (ckpt__os_stat(t->tmp, &tmp_st) != 0) return ckpt__err_os(errno, "%s: %s", t->what, t->tmp);
    int rc = ckpt__publish_dir(t->tmp, t->target, replace);
    if (rc < 0) {
        rc = ckpt__err_prefix(rc, "%s: %s", t->what, t->target);
        undo_publish(t, lg, &tmp_st, existed, rc);
        return rc;
    }
    t->made = false;
    return CKPT_OK;
}

void ckpt__txn_end(ckpt_txn *t, const ckpt_logger *lg) {
    if (t->made && t->tmp && ckpt__remove_tree(t->tmp) < 0)
        ckpt__log(lg, CKPT_LOG_WARNING, "could not remove %s after a failed %s: %s", t->tmp,
                  t->what ? t->what : "write", ckpt_errmsg());
    t->made = false;
    if (t->locked)
        ckpt__os_close(t->lock_fd); /* after the removal: nobody takes it for dead before */
    t->locked = false;
    t->lock_fd = -1;
    free(t->target);
    free(t->parent);
    free(t->base);
    free(t->tmp);
    t->target = t->parent = t->base = t->tmp = NULL;
}
