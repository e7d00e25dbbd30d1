/* io_publish.c — paths and crash-safe publication: a file or a folder
 * written under a temporary name beside its target, fsynced, renamed into
 * place, and the parent folder fsynced. */
#include <errno.h>
#include <fcntl.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "base/io_int.h"

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
    ckpt__os_close(fd);
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
            ckpt__os_rename_raw(old, path);
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
    if (ckpt__os_lstat(path, &st) == 0) {
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
        if (ckpt__os_rename_noreplace(tmp_dir, final) == 0) goto synced;
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
        rc = ckpt__fsync_dir(parent);
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
            ckpt__os_rename_raw(aside, final);
            free(aside);
            goto out;
        }
        rc = ckpt__fsync_dir(parent);
        if (!rc && ckpt__remove_tree(aside) != CKPT_OK) ckpt_clear_error();
        free(aside);
        goto out;
    }
synced:
    rc = ckpt__fsync_dir(parent);
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
            if (ckpt__os_stat(p, &st) == 0) {
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

/* Removes what is inside the folder at path (st: its lstat), depth first,
 * through the table: never following a symlink (a link is removed, not its
 * target) nor entering another file system (a mount point inside is left,
 * and its removal fails). */
static int remove_children(const char *path, const struct stat *st, int depth) {
    if (depth > 64) return ckpt__err(CKPT_EINVAL, "%s: remove: folders nested too deep", path);
    DIR *d = ckpt__os_opendir(path);
    if (!d) return errno == ENOENT ? CKPT_OK : ckpt__err_os(errno, "%s: remove folder", path);
    int rc = CKPT_OK;
    struct dirent *e;
    while (rc == 0 && (e = ckpt__os_readdir(d)) != NULL) {
        if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0) continue;
        size_t n = strlen(path) + strlen(e->d_name) + 2;
        /* Plain malloc, not ckpt__malloc: this runs on the cleanup path of
         * a failed save, which must not fail by the allocation-failure hook
         * that made the save fail (opendir allocates with malloc too). */
        char *p = malloc(n);
        if (p) snprintf(p, n, "%s/%s", path, e->d_name);
        if (!p) {
            rc = ckpt__err_nomem("remove folder");
            break;
        }
        struct stat cst;
        if (ckpt__os_lstat(p, &cst) != 0) {
            if (errno != ENOENT) rc = ckpt__err_os(errno, "%s: remove", p);
        } else if (S_ISDIR(cst.st_mode)) {
            if (cst.st_dev == st->st_dev) rc = remove_children(p, &cst, depth + 1);
            if (rc == 0 && ckpt__os_rmdir(p) < 0 && errno != ENOENT)
                rc = ckpt__err_os(errno, "%s: remove", p);
        } else if (ckpt__os_unlink(p) < 0 && errno != ENOENT) {
            rc = ckpt__err_os(errno, "%s: remove", p);
        }
        free(p);
    }
    ckpt__os_closedir(d);
    return rc;
}

int ckpt__remove_tree(const char *path) {
    struct stat st;
    if (ckpt__os_lstat(path, &st) < 0) {
        if (errno == ENOENT) return CKPT_OK;
        return ckpt__err_os(errno, "%s: stat", path);
    }
    if (!S_ISDIR(st.st_mode)) {
        if (ckpt__os_unlink(path) < 0) return ckpt__err_os(errno, "%s: remove", path);
        return CKPT_OK;
    }
    CKPT_TRY(remove_children(path, &st, 0));
    if (ckpt__os_rmdir(path) < 0 && errno != ENOENT) return ckpt__err_os(errno, "%s: remove", path);
    return CKPT_OK;
}
