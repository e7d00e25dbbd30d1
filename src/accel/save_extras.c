/* save_extras.c — the files a save pre-hook leaves in the temporary folder:
 * checked against the names the save writes, then listed as kind "extra". */
#include <dirent.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "ckpt.h"
#include "accel/save_int.h"
#include "base/error.h"
#include "base/io.h"

/* Whether this rank will write a file named name (its share of write_files). */
static bool writes_name(const save_op *op, const char *name) {
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        char own[96], shard[160];
        ckpt__acc_file_name(op->acc, o, own, sizeof own);
        if ((o->kind == K_RNG || op->committer) && strcmp(name, own) == 0) return true;
        if (ckpt__save_hf_sharded(op,
                                  i)) { /* its Hugging Face shards (the plan's), rank 0 the index */
            char index[128];
            snprintf(index, sizeof index, "%s.index.json", own);
            if (op->committer && strcmp(name, index) == 0) return true;
            for (int64_t s = 0; s < op->hfl[i].nshards; s++)
                if (op->hf_owner[i][s] == op->comm->rank && strcmp(name, op->hfl[i].names[s]) == 0)
                    return true;
        }
        if (ckpt__writer_shard_file_needed(op->writers[i]) &&
            ckpt__save_shard_name(op, i, own, shard, sizeof shard) == 0 && strcmp(name, shard) == 0)
            return true;
    }
    return false;
}

/* After this rank's pre-hooks: none of them took a name this rank is about
 * to write (the write would fail on "File exists", a less useful message).
 * Only this rank's own names: other ranks may already have written theirs. */
int ckpt__save_check_hook_names(save_op *op) {
    DIR *d = ckpt__os_opendir(op->wdir);
    if (!d) return ckpt__err_os(errno, "save_state: %s", op->wdir);
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = ckpt__os_readdir(d)) != NULL)
        if (writes_name(op, e->d_name))
            rc = ckpt__err(CKPT_EINVAL,
                           "save_state: %s: a save pre-hook wrote '%s', which is the name of one "
                           "of the checkpoint's state files",
                           op->target, e->d_name);
    ckpt__os_closedir(d);
    return rc;
}

/* Makes one pre-hook file durable and lists it: fsync, then size and
 * XXH3-64 of what is on disk. */
static int add_extra(save_op *op, const char *name) {
    char *path = ckpt__path_join(op->wdir, name);
    if (!path) return ckpt__err_nomem("save path");
    int rc = 0;
    /* The hook's file goes into the checkpoint: a regular file, no link. */
    int fd = ckpt__open_read(path, path, true, NULL);
    if (fd < 0) rc = ckpt__err_prefix(fd, "save_state: a save pre-hook's file");
    else if (ckpt__os_fsync(fd) != 0) rc = ckpt__err_os(errno, "save_state: %s: fsync", path);
    if (fd >= 0) ckpt__os_close(fd);
    ckpt_mapped mp;
    memset(&mp, 0, sizeof mp);
    if (rc == 0) rc = ckpt__map_file(path, &mp);
    if (rc == 0) {
        ckpt_file_digest d;
        memset(&d, 0, sizeof d);
        d.size = mp.size;
        d.xxh3 = ckpt__xxh3(mp.data, (size_t)mp.size);
        rc = ckpt__manifest_add(&op->all, name, "extra", &d);
        ckpt__unmap(&mp);
    }
    free(path);
    return rc;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Rank 0, at the commit: every entry of the temporary folder that no rank
 * listed was left by a pre-hook. Only regular files with names a manifest
 * can list are kept (listed as kind "extra", in name order); anything else
 * fails the save, naming it: dropping a file the user meant to keep, or
 * following a link out of the folder, would be worse. */
int ckpt__save_add_extras(save_op *op) {
    DIR *d = ckpt__os_opendir(op->wdir);
    if (!d) return ckpt__err_os(errno, "save_state: %s", op->wdir);
    char **names = NULL;
    int n = 0, cap = 0, rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = ckpt__os_readdir(d)) != NULL) {
        const char *nm = e->d_name;
        if (strcmp(nm, ".") == 0 || strcmp(nm, "..") == 0 || ckpt__manifest_find(&op->all, nm))
            continue;
        struct stat st;
        if (ckpt__os_fstatat(ckpt__os_dirfd(d), nm, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = ckpt__err_os(errno, "save_state: %s/%s", op->wdir, nm);
            break;
        }
        const char *why = NULL;
        if (S_ISLNK(st.st_mode)) why = "is a symbolic link; only regular files are kept";
        else if (S_ISDIR(st.st_mode))
            why = "is a folder; only regular files at the top of the checkpoint folder are kept";
        else if (!S_ISREG(st.st_mode)) why = "is not a regular file";
        else if (strcmp(nm, CKPT_MANIFEST_NAME) == 0) why = "is the manifest's name";
        else if (!ckpt__manifest_valid_name(nm))
            why = "is not a name a checkpoint can list (hidden, \"..\", control characters or "
                  "not UTF-8)";
        if (why) {
            rc = ckpt__err(CKPT_EINVAL, "save_state: %s: a save pre-hook wrote '%s', which %s",
                           op->target, nm, why);
            break;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            char **nn = ckpt__realloc(names, (size_t)cap * sizeof *nn);
            if (!nn) {
                rc = ckpt__err_nomem("save extras");
                break;
            }
            names = nn;
        }
        if (!(names[n] = ckpt__strdup(nm))) {
            rc = ckpt__err_nomem("save extras");
            break;
        }
        n++;
    }
    ckpt__os_closedir(d);
    if (rc == 0 && n > 1) qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int i = 0; rc == 0 && i < n; i++) rc = add_extra(op, names[i]);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    return rc;
}
