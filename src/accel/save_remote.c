/* save_remote.c — the save's phases when the checkpoint goes to object
 * storage (save_int.h): the plan over one listing of the bucket, each file
 * streamed into its object as the writer produces it (or copied server-side
 * when unchanged), and the commit: the manifest last, conditional, then the
 * rotation. Nothing of a checkpoint is written to the local disk; the local
 * temporary folder holds only what save pre-hooks leave there. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "accel/remote.h"
#include "accel/save_int.h"
#include "base/error.h"
#include "base/io.h"
#include "store/s3/s3.h"

/* ---- plan ------------------------------------------------------------------ */

/* "s3://<bucket>/<key>" (ckpt__malloc'd). */
static char *url_of(const ckpt_remote *r, const char *key) {
    size_t n = strlen(r->bucket) + strlen(key) + 8;
    char *p = ckpt__malloc(n);
    if (p) snprintf(p, n, "s3://%s/%s", r->bucket, key);
    return p;
}

/* The local folder that stands for the checkpoint while pre-hooks run:
 * under the project's local folder, else under $TMPDIR. */
static int make_tmp(save_op *op, const char *base) {
    ckpt_accelerator *acc = op->acc;
    if (acc->project_dir && !ckpt__s3_is_url(acc->project_dir)) {
        op->parent = ckpt__checkpoints_dir(acc->project_dir);
    } else {
        const char *t = getenv("TMPDIR");
        op->parent = ckpt__strdup(t && *t ? t : "/tmp");
    }
    if (!op->parent) return ckpt__err_nomem("save path");
    int rc = ckpt__mkdirs(op->parent);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    op->tname = ckpt__temp_name(base);
    if (!op->tname || !(op->tmp = ckpt__path_join(op->parent, op->tname)))
        return ckpt__err_nomem("save path");
    /* a killed run's folder of the same name (same pid after a reboot) */
    struct stat st;
    if (ckpt__os_lstat(op->tmp, &st) == 0) CKPT_TRY(ckpt__remove_tree(op->tmp));
    if (ckpt__os_mkdir(op->tmp, 0755) != 0)
        return ckpt__err_os(errno, "save_state: %s: create temporary folder", op->tmp);
    op->tmp_made = true;
    return CKPT_OK;
}

/* The newest committed checkpoint of the scan, or -1. */
static int64_t newest_committed(const struct ckpt_acc_remote *rm) {
    for (int64_t i = rm->nscan - 1; i >= 0; i--)
        if (rm->scan[i].committed) return rm->scan[i].number;
    return -1;
}

static int plan_automatic(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    struct ckpt_acc_remote *rm = acc->remote;
    CKPT_TRY(ckpt__acc_remote_open(acc));
    int rc = rm->lk.held ? ckpt__remote_lock_renew(&rm->r, &rm->lk)
                         : ckpt__remote_lock(&rm->r, &rm->lk, &op->log);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    /* one listing: under the lock nothing else writes, so what has no
     * manifest is a leftover; the number goes above every stored one; the
     * rotation after the commit works from it too */
    ckpt__remote_scan_free(rm->scan, rm->nscan);
    rm->scan = NULL;
    rm->nscan = 0;
    rc = ckpt__remote_scan(&rm->r, &rm->scan, &rm->nscan);
    if (rc == 0) rc = ckpt__remote_remove_leftovers(&rm->r, rm->scan, &rm->nscan, &op->log, NULL);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    op->number = acc->iteration;
    if (rm->nscan > 0 && rm->scan[rm->nscan - 1].number + 1 > op->number)
        op->number = rm->scan[rm->nscan - 1].number + 1;
    int64_t prev = op->link ? newest_committed(rm) : -1;
    op->base = ckpt__malloc(48);
    if (!op->base) return ckpt__err_nomem("save path");
    snprintf(op->base, 48, "checkpoint_%" PRId64, op->number);
    char *key = ckpt__remote_number_key(&rm->r, op->number);
    op->target = key ? url_of(&rm->r, key) : NULL;
    free(key);
    if (!op->target) return ckpt__err_nomem("save path");
    if (prev >= 0) {
        key = ckpt__remote_number_key(&rm->r, prev);
        op->prev_dir = key ? url_of(&rm->r, key) : NULL;
        free(key);
        if (!op->prev_dir) return ckpt__err_nomem("save path");
    }
    /* a killed local run's temporary folders (under the project lock) */
    return CKPT_OK;
}

static int plan_explicit(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    ckpt_remote own, *r = NULL;
    char *dir = NULL;
    CKPT_TRY(ckpt__acc_remote_for(acc, op->output_dir, &own, &r, &dir));
    /* never over a checkpoint: the commit could not be atomic */
    int rc = ckpt__remote_prepare_dir(r, dir, &op->log);
    if (rc == 0 && !(op->target = url_of(r, dir))) rc = ckpt__err_nomem("save path");
    const char *slash = strrchr(dir, '/');
    if (rc == 0 && !(op->base = ckpt__strdup(slash ? slash + 1 : dir)))
        rc = ckpt__err_nomem("save path");
    /* the checkpoint this accelerator saved or loaded last, if it is here */
    if (rc == 0 && op->link && acc->link_dir && ckpt__s3_is_url(acc->link_dir) &&
        !(op->prev_dir = ckpt__strdup(acc->link_dir)))
        rc = ckpt__err_nomem("save path");
    free(dir);
    if (own.c) ckpt__remote_close(&own);
    return rc;
}

int ckpt__save_remote_plan(save_op *op) {
    CKPT_TRY(op->automatic ? plan_automatic(op) : plan_explicit(op));
    if (op->automatic) {
        /* the local folder's leftovers of killed runs (under the project lock) */
        char *local = ckpt__checkpoints_dir(op->acc->project_dir);
        if (!local) return ckpt__err_nomem("save path");
        int rc = ckpt__mkdirs(local);
        if (rc == 0) rc = ckpt__remove_leftovers(local, NULL, &op->log);
        free(local);
        CKPT_TRY(rc);
    }
    return make_tmp(op, op->base);
}

int ckpt__save_remote_open(save_op *op) {
    char *dir = NULL;
    int rc = ckpt__acc_remote_for(op->acc, op->target, &op->rem_own, &op->rem, &dir);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    op->rdir = dir;
    /* the checkpoint to copy from: only in the same bucket */
    char *pb = NULL, *pk = NULL;
    if (op->prev_dir && ckpt__s3_is_url(op->prev_dir) &&
        ckpt__s3_parse_url(op->prev_dir, &pb, &pk) == 0 && strcmp(pb, op->rem->bucket) == 0 &&
        *pk) {
        op->rprev = pk;
        pk = NULL;
    }
    free(pb);
    free(pk);
    ckpt_clear_error();
    /* another host's rank: the plan's local folder is rank 0's */
    struct stat st;
    if (op->tmp && !op->committer && ckpt__os_lstat(op->tmp, &st) != 0) (void)ckpt__mkdirs(op->tmp);
    return CKPT_OK;
}

void ckpt__save_remote_read_prev(save_op *op) {
    if (!op->link || !op->rprev) return;
    if (ckpt__remote_manifest(op->rem, op->rprev, &op->prev) == 0) {
        op->have_prev = true;
    } else {
        ckpt__manifest_clear(&op->prev);
        ckpt_clear_error();
    }
}

/* ---- write ----------------------------------------------------------------- */

/* Whether the file the save would write as name equals the previous
 * checkpoint's object of that name (the same size and XXH3-128 as its
 * manifest records, decided from memory); if so it is copied server-side
 * (1; d from the record). 0: write it (d->xxh128 may hold its hash). The
 * old object's bytes are not read: S3 keeps objects at rest whole, and a
 * damaged one would fail the new checkpoint's digests as it fails the old
 * one's (a load then falls back). */
static int try_copy(save_op *op, ckpt_writer *w, const char *name, bool shards, const char *key,
                    ckpt_file_digest *d, save_slot *slot) {
    const ckpt_manifest_file *f = NULL;
    int same = ckpt__save_unchanged(op, w, name, shards, key, d, &f);
    if (same <= 0) return same;
    char *from = ckpt__path_join(op->rprev, name);
    if (!from) return ckpt__err_nomem("save path");
    int rc = ckpt__s3_copy(op->rem->c, from, key, f->size, NULL, slot->etag);
    if (rc == CKPT_ENOENT || rc == CKPT_EIO) {
        /* gone, or a store without CopyObject: write it (and the rest) */
        if (rc == CKPT_EIO) {
            op->link_off = true;
            ckpt__log(&op->log, CKPT_LOG_WARNING,
                      "save_state: cannot copy unchanged objects from s3://%s/%s (%s); "
                      "uploading them instead",
                      op->rem->bucket, op->rprev, ckpt_errmsg());
        }
        ckpt_clear_error();
        free(from);
        return 0;
    }
    free(from);
    CKPT_TRY(rc);
    CKPT_TRY(ckpt__save_digest_from_record(f, d));
    op->linked_bytes += f->size;
    return 1;
}

int ckpt__save_remote_file(save_op *op, ckpt_writer *w, const char *name, bool shards,
                           save_slot *slot) {
    char *key = ckpt__path_join(op->rdir, name);
    char *what = key ? url_of(op->rem, key) : NULL;
    if (!what) {
        free(key);
        return ckpt__err_nomem("save path");
    }
    ckpt__file_digest_free(&slot->d);
    memset(&slot->d, 0, sizeof slot->d);
    slot->etag[0] = '\0';
    int rc = op->link ? try_copy(op, w, name, shards, key, &slot->d, slot) : 0;
    if (rc == 0) {
        bool known = slot->d.has_xxh128;
        ckpt_h128 h = slot->d.xxh128;
        ckpt_s3_sink sink = {0};
        rc = ckpt__s3_upload_begin(op->rem->c, key, &sink.u);
        if (rc == 0)
            rc = ckpt__writer_write_sink(w, what, &ckpt__s3_sink_ops, &sink, shards,
                                         op->link && !known, &slot->d);
        if (rc == 0) {
            snprintf(slot->etag, sizeof slot->etag, "%s", sink.etag);
            op->written_bytes += slot->d.size;
        }
        if (rc == 0 && known) {
            slot->d.has_xxh128 = true;
            slot->d.xxh128 = h;
        }
    } else if (rc > 0) {
        rc = 0;
    }
    free(key);
    free(what);
    return rc;
}

int ckpt__save_remote_text(save_op *op, const char *name, const char *text, save_slot *slot) {
    char *key = ckpt__path_join(op->rdir, name);
    if (!key) return ckpt__err_nomem("save path");
    size_t n = strlen(text);
    char etag[128] = "";
    int rc = ckpt__s3_put(op->rem->c, key, text, n, CKPT_S3_ALWAYS, NULL, etag);
    free(key);
    if (rc < 0) return rc;
    memset(&slot->d, 0, sizeof slot->d);
    slot->d.size = n;
    slot->d.xxh3 = ckpt__xxh3(text, n);
    snprintf(slot->etag, sizeof slot->etag, "%s", etag);
    op->written_bytes += n;
    return CKPT_OK;
}

/* ---- commit ------------------------------------------------------------------ */

/* Appends one ETag to op->etags (one per file of op->all, in order). */
static int add_etag(save_op *op, const char *etag) {
    char **nv = ckpt__realloc(op->etags, (size_t)(op->netags + 1) * sizeof *nv);
    if (!nv) return ckpt__err_nomem("save records");
    op->etags = nv;
    if (!(op->etags[op->netags] = ckpt__strdup(etag ? etag : "")))
        return ckpt__err_nomem("save records");
    op->netags++;
    return CKPT_OK;
}

/* The rotation in the bucket (total_limit, keep_every_steps, best_k), from
 * the plan's listing and the manifest just committed; a failure is a
 * warning: the save is committed. */
static void rotate_remote(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    struct ckpt_acc_remote *rm = acc->remote;
    if (!op->automatic || (acc->total_limit <= 0 && !ckpt__retention_active(&acc->retention)))
        return;
    ckpt_rotation rot = {.keep = acc->total_limit, .pol = &acc->retention, .lg = &op->log};
    if (ckpt__remote_rotate(&rm->r, rm->scan, rm->nscan, op->number, &op->all, false, &rot) < 0)
        ckpt__log(&op->log, CKPT_LOG_WARNING, "total_limit rotation: %s", ckpt_errmsg());
}

int ckpt__save_remote_commit(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    ckpt_manifest *m = &op->all;
    /* the pre-hooks' files: listed as kind "extra", uploaded (read once,
     * checked against the listing while sent) */
    int64_t before = m->nfiles;
    int rc = 0;
    while (rc == 0 && op->netags < before) rc = add_etag(op, ""); /* (memory ran out) */
    if (rc == 0) rc = ckpt__save_add_extras(op);
    for (int64_t i = before; rc == 0 && i < m->nfiles; i++) {
        char *path = ckpt__path_join(op->tmp, m->files[i].name);
        char *key = ckpt__path_join(op->rdir, m->files[i].name);
        char etag[128] = "";
        rc = path && key ? ckpt__remote_upload_file(op->rem, path, key, &m->files[i], etag)
                         : ckpt__err_nomem("save path");
        if (rc == 0) rc = add_etag(op, etag);
        free(path);
        free(key);
    }
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    /* still ours? a lease that ran out during a long save means another
     * process may write here now */
    if (op->automatic) rc = ckpt__remote_lock_renew(&acc->remote->r, &acc->remote->lk);
    int64_t used = op->number;
    if (rc == 0)
        rc = ckpt__remote_commit(op->rem, op->automatic ? NULL : op->rdir, op->number,
                                 op->automatic, m, (const char *const *)op->etags, &used, &op->log);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    if (op->automatic && used != op->number) {
        op->number = used;
        char *key = ckpt__remote_number_key(op->rem, used);
        char *url = key ? url_of(op->rem, key) : NULL;
        free(key);
        if (!url) return ckpt__err_nomem("save path");
        free(op->target);
        op->target = url;
    }
    rotate_remote(op);
    return CKPT_OK;
}

int ckpt__save_remote_share_number(save_op *op) {
    const ckpt_comm *c = op->comm;
    if (c->size <= 1) return CKPT_OK;
    char *blob = NULL;
    size_t n = 0;
    if (c->rank == 0) {
        n = strlen(op->target) + 1;
        if (!(blob = ckpt__strdup(op->target))) n = 0;
    }
    int rc = ckpt__coll_bcast_bytes(c, &blob, &n);
    if (rc == 0 && c->rank != 0 && n > 0 && blob[n - 1] == '\0') {
        free(op->target);
        op->target = blob;
        blob = NULL;
        const char *s = strrchr(op->target, '_');
        if (op->automatic && s) op->number = strtoll(s + 1, NULL, 10);
    }
    free(blob);
    return rc;
}

void ckpt__save_remote_free(save_op *op) {
    if (op->rem_own.c) ckpt__remote_close(&op->rem_own);
    for (int64_t i = 0; i < op->netags; i++) free(op->etags[i]);
    free(op->etags);
    for (int64_t i = 0; i < op->netags_mine; i++) free(op->etags_mine[i]);
    free(op->etags_mine);
    free(op->rdir);
    free(op->rprev);
}
