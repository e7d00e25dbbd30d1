/* project.c — the folder tools on s3:// URLs (project.h): verify, list,
 * leftovers, prune, files, one file's check, and a verified local copy. */
#include "store/s3/project.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "base/io.h"
#include "format/manifest.h"
#include "store/s3/remote.h"
#include "store/store.h"

/* A checkpoint folder's URL: the remote of its bucket and its key ("dir"). */
static int open_dir(const char *url, ckpt_remote *r, const char **dir) {
    CKPT_TRY(ckpt__remote_open(r, url));
    if (!*r->prefix) {
        ckpt__remote_close(r);
        return ckpt__err(CKPT_EINVAL, "%s: a bucket, not a checkpoint folder", url);
    }
    *dir = r->prefix;
    return 0;
}

static int check_into(ckpt_remote *r, const char *dir, const ckpt_remote_entry *e, bool deep,
                      ckpt_checkpoint_info *info) {
    ckpt_manifest m;
    bool have = false;
    int rc = ckpt__remote_check(r, dir, e, deep, &m, &have);
    if (have) ckpt__remote_fill_info(info, &m);
    if (have) ckpt__manifest_clear(&m);
    if (rc == 0) info->status = CKPT_CHECKPOINT_COMPLETE;
    else if (!have && rc == CKPT_ENOENT) info->status = CKPT_CHECKPOINT_PARTIAL;
    else info->status = CKPT_CHECKPOINT_CORRUPT;
    return rc;
}

int ckpt__remote_verify_url(const char *url, bool deep, ckpt_checkpoint_info *info) {
    snprintf(info->path, sizeof info->path, "%s", url);
    ckpt_remote r;
    const char *dir = NULL;
    CKPT_TRY(open_dir(url, &r, &dir));
    const char *base = strrchr(dir, '/');
    int64_t n;
    if (ckpt__parse_checkpoint_name(base ? base + 1 : dir, &n)) info->number = n;
    int rc = check_into(&r, dir, NULL, deep, info);
    ckpt__remote_close(&r);
    return rc;
}

int ckpt__remote_list_url(const char *project_url, bool deep, ckpt_checkpoint_info **out,
                          int64_t *count) {
    ckpt_remote r;
    CKPT_TRY(ckpt__remote_open(&r, project_url));
    ckpt_remote_entry *v = NULL;
    int64_t n = 0, k = 0;
    int rc = ckpt__remote_scan(&r, &v, &n);
    ckpt_checkpoint_info *infos = NULL;
    if (rc == 0 && n > 0 && !(infos = ckpt__calloc((size_t)n, sizeof *infos)))
        rc = ckpt__err_nomem("checkpoint list");
    /* only committed checkpoints: objects without a manifest are a killed
     * save's leftovers (ckpt_checkpoint_leftovers), as a local save's
     * temporary folder is */
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        if (!v[i].committed) continue;
        char rel[80];
        snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, v[i].number);
        char *dir = ckpt__remote_key(&r, rel);
        if (!dir) {
            rc = ckpt__err_nomem("checkpoint list");
            break;
        }
        ckpt_checkpoint_info *info = &infos[k++];
        snprintf(info->path, sizeof info->path, "%s/%s", r.url, rel);
        info->number = v[i].number;
        /* a bad checkpoint is an entry with its status; a failure of the
         * store itself (access, network) fails the list */
        int vrc = check_into(&r, dir, &v[i], deep, info);
        if (vrc < 0 && vrc != CKPT_ECORRUPT && vrc != CKPT_ENOENT && vrc != CKPT_EUNSUPPORTED)
            rc = vrc;
        free(dir);
    }
    ckpt__remote_scan_free(v, n);
    ckpt__remote_close(&r);
    if (rc < 0) {
        free(infos);
        return rc;
    }
    ckpt_clear_error();
    if (k == 0) {
        free(infos);
        infos = NULL;
    }
    *out = infos;
    *count = k;
    return 0;
}

int ckpt__remote_leftovers_url(const char *project_url, ckpt_leftover_info **out, int64_t *count) {
    ckpt_remote r;
    CKPT_TRY(ckpt__remote_open(&r, project_url));
    ckpt_remote_entry *v = NULL;
    int64_t n = 0, k = 0;
    int rc = ckpt__remote_scan(&r, &v, &n);
    ckpt_leftover_info *l = NULL;
    if (rc == 0 && n > 0 && !(l = ckpt__calloc((size_t)n, sizeof *l)))
        rc = ckpt__err_nomem("leftover list");
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        if (v[i].committed) continue;
        snprintf(l[k].path, sizeof l[k].path, "%s/checkpoints/checkpoint_%" PRId64 "/", r.url,
                 v[i].number);
        l[k].pid = -1;
        l[k].running = false;
        k++;
    }
    ckpt__remote_scan_free(v, n);
    ckpt__remote_close(&r);
    if (rc < 0) {
        free(l);
        return rc;
    }
    if (k == 0) {
        free(l);
        l = NULL;
    }
    *out = l;
    *count = k;
    return 0;
}

int ckpt__remote_prune_url(const char *project_url, const ckpt_prune_options *opts,
                           int64_t *removed) {
    ckpt_retention pol = {.keep_every_steps = opts->keep_every_steps,
                          .best_metric = opts->best_metric,
                          .best_mode = opts->best_mode,
                          .best_k = opts->best_k};
    CKPT_TRY(ckpt__retention_check(&pol, "checkpoint_prune"));
    if (opts->valid_kept) *opts->valid_kept = 0;
    ckpt_remote r;
    CKPT_TRY(ckpt__remote_open(&r, project_url));
    ckpt_remote_lock lk = {0};
    int rc = 0;
    if (!opts->dry_run) rc = ckpt__remote_lock(&r, &lk, NULL);
    ckpt_remote_entry *v = NULL;
    int64_t n = 0;
    if (rc == 0) rc = ckpt__remote_scan(&r, &v, &n);
    /* leftovers first */
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        if (v[i].committed) continue;
        char path[4200];
        snprintf(path, sizeof path, "%s/checkpoints/checkpoint_%" PRId64 "/", r.url, v[i].number);
        if (opts->report) opts->report(opts->user, path, CKPT_PRUNE_LEFTOVER, NULL);
    }
    if (rc == 0 && !opts->dry_run) rc = ckpt__remote_remove_leftovers(&r, v, &n, NULL, NULL);
    /* the rule of a local prune: the newest `keep` valid (every byte read)
     * stay, the policies keep more, invalid ones older than the newest
     * valid one go */
    ckpt_rotation rot = {.keep = opts->keep,
                         .pol = &pol,
                         .dry_run = opts->dry_run,
                         .verify_all = true,
                         .shallow_beyond = true,
                         .report = opts->report,
                         .user = opts->user};
    if (rc == 0) rc = ckpt__remote_rotate(&r, v, n, -1, NULL, true, &rot);
    ckpt__remote_scan_free(v, n);
    if (!opts->dry_run) ckpt__remote_unlock(&r, &lk);
    ckpt__remote_close(&r);
    if (removed) *removed = rot.removed;
    if (opts->valid_kept) *opts->valid_kept = rc == 0 ? rot.valid_kept : 0;
    return rc;
}

int ckpt__remote_files_url(const char *url, ckpt_checkpoint_file **out, int64_t *count) {
    ckpt_remote r;
    const char *dir = NULL;
    CKPT_TRY(open_dir(url, &r, &dir));
    ckpt_manifest m;
    int rc = ckpt__remote_manifest(&r, dir, &m);
    ckpt_checkpoint_file *v = NULL;
    if (rc == 0 && m.nfiles > 0 && !(v = ckpt__calloc((size_t)m.nfiles, sizeof *v)))
        rc = ckpt__err_nomem("checkpoint files");
    for (int64_t i = 0; rc == 0 && i < m.nfiles; i++) {
        snprintf(v[i].name, sizeof v[i].name, "%s", m.files[i].name);
        snprintf(v[i].kind, sizeof v[i].kind, "%s", m.files[i].kind);
        v[i].size = m.files[i].size;
        v[i].xxh3 = m.files[i].xxh3;
        v[i].links = 1;
    }
    if (rc == 0) {
        *out = v;
        *count = m.nfiles;
    } else {
        free(v);
    }
    ckpt__manifest_clear(&m);
    ckpt__remote_close(&r);
    return rc;
}

int ckpt__remote_verify_file_url(const char *url, const char *name) {
    ckpt_remote r;
    const char *dir = NULL;
    CKPT_TRY(open_dir(url, &r, &dir));
    ckpt_manifest m;
    int rc = ckpt__remote_manifest(&r, dir, &m);
    const ckpt_manifest_file *f = rc == 0 ? ckpt__manifest_find(&m, name) : NULL;
    if (rc == 0 && !f)
        rc = ckpt__err(CKPT_ENOENT, "%s: the manifest lists no file '%s'", url, name);
    if (f) {
        char *key = ckpt__path_join(dir, name);
        uint64_t h = 0;
        rc = key ? ckpt__s3_get_stream(r.c, key, f->size, NULL, NULL, &h)
                 : ckpt__err_nomem("s3 key");
        if (rc == 0 && h != f->xxh3)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s/%s: checksum mismatch (XXH3-64 %016" PRIx64
                           ", the manifest records %016" PRIx64 ")",
                           url, name, h, f->xxh3);
        free(key);
    }
    if (rc == 0 || f) ckpt__manifest_clear(&m);
    ckpt__remote_close(&r);
    return rc;
}

/* ---- the public folder tools: a URL here, a folder in store.c ------------- */

int ckpt_checkpoint_verify(const char *dir, bool deep, ckpt_checkpoint_info *info) {
    if (dir && ckpt__s3_is_url(dir)) {
        ckpt_checkpoint_info local;
        if (!info) info = &local;
        memset(info, 0, sizeof *info);
        info->number = -1;
        info->status = CKPT_CHECKPOINT_CORRUPT;
        return ckpt__remote_verify_url(dir, deep, info);
    }
    return ckpt__checkpoint_verify_local(dir, deep, info);
}

int ckpt_checkpoint_verify_file(const char *dir, const char *name) {
    if (dir && name && ckpt__s3_is_url(dir)) return ckpt__remote_verify_file_url(dir, name);
    return ckpt__checkpoint_verify_file_local(dir, name);
}

int ckpt_checkpoint_shared_bytes(const char *dir, const char *other, uint64_t *bytes) {
    if (dir && other && bytes && (ckpt__s3_is_url(dir) || ckpt__s3_is_url(other))) {
        *bytes = 0; /* objects are never one copy */
        return 0;
    }
    return ckpt__checkpoint_shared_bytes_local(dir, other, bytes);
}

int ckpt_checkpoint_list(const char *project_dir, bool deep, ckpt_checkpoint_info **out,
                         int64_t *count) {
    if (project_dir && out && count && ckpt__s3_is_url(project_dir)) {
        *out = NULL;
        *count = 0;
        return ckpt__remote_list_url(project_dir, deep, out, count);
    }
    return ckpt__checkpoint_list_local(project_dir, deep, out, count);
}

int ckpt_checkpoint_leftovers(const char *project_dir, ckpt_leftover_info **out, int64_t *count) {
    if (project_dir && out && count && ckpt__s3_is_url(project_dir)) {
        *out = NULL;
        *count = 0;
        return ckpt__remote_leftovers_url(project_dir, out, count);
    }
    return ckpt__checkpoint_leftovers_local(project_dir, out, count);
}

int ckpt_checkpoint_prune_ex(const char *project_dir, const ckpt_prune_options *opts,
                             int64_t *removed) {
    if (project_dir && opts && ckpt__s3_is_url(project_dir)) {
        if (removed) *removed = 0;
        if (opts->keep < 0)
            return ckpt__err(CKPT_EINVAL, "checkpoint_prune: keep is %d, expected >= 0",
                             opts->keep);
        return ckpt__remote_prune_url(project_dir, opts, removed);
    }
    return ckpt__checkpoint_prune_ex_local(project_dir, opts, removed);
}

int ckpt_checkpoint_prune(const char *project_dir, int keep, int64_t *removed) {
    ckpt_prune_options o = {.keep = keep};
    return ckpt_checkpoint_prune_ex(project_dir, &o, removed);
}

int ckpt_checkpoint_files(const char *dir, ckpt_checkpoint_file **out, int64_t *count) {
    if (out) *out = NULL;
    if (count) *count = 0;
    if (dir && out && count && ckpt__s3_is_url(dir)) return ckpt__remote_files_url(dir, out, count);
    return ckpt__checkpoint_files_local(dir, out, count);
}

int ckpt_checkpoint_fetch(const char *url, const char *local_dir) {
    if (!url || !local_dir) return ckpt__err(CKPT_EINVAL, "checkpoint_fetch: NULL argument");
    if (!ckpt__s3_is_url(url))
        return ckpt__err(CKPT_EINVAL, "checkpoint_fetch: %s: not an s3:// URL", url);
    struct stat st;
    if (ckpt__os_lstat(local_dir, &st) == 0)
        return ckpt__err(CKPT_EEXIST, "checkpoint_fetch: %s already exists", local_dir);
    ckpt_remote r;
    const char *dir = NULL;
    CKPT_TRY(open_dir(url, &r, &dir));
    int rc = ckpt__remote_fetch(&r, dir, local_dir, NULL);
    ckpt__remote_close(&r);
    return rc;
}

static _Atomic unsigned checkout_seq;

int ckpt__remote_checkout(const char *url, char **local, char **root) {
    *local = *root = NULL;
    ckpt_remote r;
    const char *dir = NULL;
    CKPT_TRY(open_dir(url, &r, &dir));
    const char *tmp = getenv("TMPDIR");
    if (!tmp || !*tmp) tmp = "/tmp";
    size_t n = strlen(tmp) + 64;
    *root = ckpt__malloc(n);
    int rc = *root ? 0 : ckpt__err_nomem("s3 checkout");
    if (rc == 0) {
        snprintf(*root, n, "%s/.ckpt-s3-%ld-%u", tmp, (long)getpid(),
                 atomic_fetch_add(&checkout_seq, 1));
        if (ckpt__os_mkdir(*root, 0700) != 0) rc = ckpt__err_os(errno, "s3 checkout: %s", *root);
    }
    if (rc == 0 && !(*local = ckpt__path_join(*root, "checkpoint")))
        rc = ckpt__err_nomem("s3 checkout");
    if (rc == 0) rc = ckpt__remote_fetch(&r, dir, *local, NULL);
    ckpt__remote_close(&r);
    if (rc < 0) {
        char saved[2048];
        snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
        ckpt__remote_checkout_done(*local, *root);
        *local = *root = NULL;
        ckpt__err(rc, "%s", saved);
    }
    return rc;
}

void ckpt__remote_checkout_done(char *local, char *root) {
    if (root) {
        struct stat st;
        if (ckpt__os_lstat(root, &st) == 0) (void)ckpt__remove_tree(root);
    }
    free(local);
    free(root);
}
