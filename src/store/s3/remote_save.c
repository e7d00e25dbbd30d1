/* remote_save.c — a project in object storage (remote.h): a save's objects
 * that are not streamed (the files pre-hooks leave), the commit (the
 * manifest last, conditional, a lost number moved on by server-side
 * copies), removal, leftovers and the rotation. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <xxhash.h>

#include "base/io.h"
#include "store/s3/remote.h"
#include "store/s3/remote_int.h"
#include "store/store.h"

/* ---- objects --------------------------------------------------------------------- */

int ckpt__remote_upload_file(ckpt_remote *r, const char *path, const char *key,
                             const ckpt_manifest_file *f, char *etag_out) {
    struct stat st;
    int fd = ckpt__open_read(path, path, true, &st);
    if (fd < 0) return fd;
    int rc = 0;
    if ((uint64_t)st.st_size != f->size)
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %lld bytes, the manifest says %" PRIu64, path,
                       (long long)st.st_size, f->size);
    ckpt_s3_upload *u = NULL;
    if (rc == 0) rc = ckpt__s3_upload_begin(r->c, key, &u);
    size_t piece = (size_t)ckpt__s3_options(r->c)->part_size;
    uint8_t *buf = rc == 0 ? ckpt__malloc(piece) : NULL;
    XXH3_state_t *hs = rc == 0 ? XXH3_createState() : NULL;
    if (rc == 0 && (!buf || !hs)) rc = ckpt__err_nomem("s3 upload");
    if (rc == 0) XXH3_64bits_reset(hs);
    uint64_t off = 0;
    while (rc == 0 && off < f->size) {
        size_t want = f->size - off < piece ? (size_t)(f->size - off) : piece;
        ssize_t got = ckpt__os_pread(fd, buf, want, off);
        if (got < 0) rc = ckpt__err_os(errno, "%s: read", path);
        else if (got == 0) rc = ckpt__err(CKPT_ECORRUPT, "%s: ends early", path);
        else {
            XXH3_64bits_update(hs, buf, (size_t)got);
            rc = ckpt__s3_upload_write(u, buf, (size_t)got);
            off += (uint64_t)got;
        }
    }
    if (rc == 0 && XXH3_64bits_digest(hs) != f->xxh3)
        rc = ckpt__err(CKPT_ECORRUPT, "%s: does not match its manifest (checksum); not uploaded",
                       path);
    XXH3_freeState(hs);
    free(buf);
    ckpt__os_close(fd);
    if (rc == 0) rc = ckpt__s3_upload_finish(u, NULL, etag_out);
    else ckpt__s3_upload_abort(u);
    return rc;
}

/* Deletes the objects of e under key dir (the manifest first if it is
 * among them, and not at all when the caller deleted it already). */
static int remove_listed(ckpt_remote *r, const char *dir, const ckpt_remote_entry *e,
                         bool manifest_gone) {
    int rc = 0;
    for (int pass = manifest_gone ? 1 : 0; pass < 2 && rc == 0; pass++)
        for (int64_t i = 0; rc == 0 && i < e->nobjects; i++) {
            bool manifest = strcmp(e->names[i], CKPT_MANIFEST_NAME) == 0;
            if (manifest != (pass == 0)) continue;
            char *key = ckpt__path_join(dir, e->names[i]);
            rc = key ? ckpt__s3_delete(r->c, key) : ckpt__err_nomem("s3 key");
            free(key);
        }
    return rc;
}

int ckpt__remote_prepare_dir(ckpt_remote *r, const char *dir, const ckpt_logger *lg) {
    ckpt_remote_entry e;
    int rc = ckpt__remote_list_dir(r, dir, &e);
    bool committed = false;
    for (int64_t i = 0; rc == 0 && i < e.nobjects; i++)
        committed |= strcmp(e.names[i], CKPT_MANIFEST_NAME) == 0;
    if (rc == 0 && committed)
        rc = ckpt__err(CKPT_EEXIST,
                       "save_state: s3://%s/%s holds a checkpoint already: a checkpoint in object "
                       "storage is never replaced (there is no atomic rename); save under "
                       "another name, or remove it first (ckpt prune, or any S3 client)",
                       r->bucket, dir);
    if (rc == 0 && e.nobjects > 0) {
        ckpt__log(lg, CKPT_LOG_WARNING,
                  "removing s3://%s/%s/: %" PRId64 " objects of a save that did not finish",
                  r->bucket, dir, e.nobjects);
        rc = remove_listed(r, dir, &e, false);
    }
    ckpt__remote_entry_clear(&e);
    return rc;
}

/* ---- the commit ---------------------------------------------------------------------- */

/* Copies every data object of m from key `from` to key `to` (server-side),
 * each only if its ETag is still etags[i] when that is known. */
static int copy_objects(ckpt_remote *r, const char *from, const char *to, const ckpt_manifest *m,
                        const char *const *etags) {
    int rc = 0;
    for (int64_t i = 0; rc == 0 && i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        char *src = ckpt__path_join(from, f->name);
        char *dst = ckpt__path_join(to, f->name);
        rc = src && dst ? ckpt__s3_copy(r->c, src, dst, f->size, etags ? etags[i] : NULL, NULL)
                        : ckpt__err_nomem("s3 key");
        if (rc == CKPT_EEXIST)
            rc = ckpt__err(CKPT_EIO,
                           "s3://%s/%s changed after this save uploaded it (another writer "
                           "wrote it): not committed",
                           r->bucket, src);
        free(src);
        free(dst);
    }
    return rc;
}

int ckpt__remote_commit(ckpt_remote *r, const char *dir, int64_t number, bool renumber,
                        ckpt_manifest *m, const char *const *etags, int64_t *committed,
                        const ckpt_logger *lg) {
    if (committed) *committed = -1;
    char *at = dir ? ckpt__strdup(dir) : ckpt__remote_number_key(r, number);
    if (!at) return ckpt__err_nomem("s3 key");
    int rc = 0;
    for (int tries = 0;; tries++) {
        char *text = NULL, *mkey = NULL;
        size_t len = 0;
        rc = ckpt__manifest_text(m, &text, &len);
        if (rc == 0 && !(mkey = ckpt__path_join(at, CKPT_MANIFEST_NAME)))
            rc = ckpt__err_nomem("s3 key");
        /* the commit: the manifest, only if nobody committed this number */
        if (rc == 0) rc = ckpt__s3_put(r->c, mkey, text, len, CKPT_S3_IF_ABSENT, NULL, NULL);
        free(text);
        free(mkey);
        if (rc != CKPT_EEXIST || !renumber) break;
        if (tries >= 100) {
            rc = ckpt__err(CKPT_EBUSY, "%s: 100 checkpoint numbers in a row are taken", r->url);
            break;
        }
        /* another writer committed this number meanwhile: the next number
         * under which nothing is stored, the data objects copied there */
        int64_t next = number + 1;
        ckpt_remote_entry e = {.number = -1};
        char *to = NULL;
        for (;; next++) {
            free(to);
            to = ckpt__remote_number_key(r, next);
            if (!to) {
                rc = ckpt__err_nomem("s3 key");
                break;
            }
            rc = ckpt__remote_list_dir(r, to, &e);
            bool used = e.nobjects > 0;
            ckpt__remote_entry_clear(&e);
            if (rc < 0 || !used) break;
        }
        if (rc == 0)
            ckpt__log(lg, CKPT_LOG_WARNING,
                      "%s/checkpoints/checkpoint_%" PRId64
                      " was committed by another writer during this save; saving as "
                      "checkpoint_%" PRId64 " (the data objects copied there)",
                      r->url, number, next);
        if (rc == 0) rc = copy_objects(r, at, to, m, etags);
        free(at);
        at = to;
        if (rc < 0) break;
        number = next;
        m->iteration = number + 1;
    }
    free(at);
    if (rc == 0 && committed) *committed = number;
    return rc;
}

/* ---- removal ------------------------------------------------------------------------- */

int ckpt__remote_remove(ckpt_remote *r, int64_t number, const ckpt_remote_entry *e) {
    char *dir = ckpt__remote_number_key(r, number);
    if (!dir) return ckpt__err_nomem("s3 key");
    int rc = 0;
    if (e) {
        /* the manifest first, even if the listing missed it */
        char *mkey = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
        rc = mkey ? ckpt__s3_delete(r->c, mkey) : ckpt__err_nomem("s3 key");
        free(mkey);
        if (rc == 0) rc = remove_listed(r, dir, e, true);
    } else {
        char *mkey = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
        rc = mkey ? ckpt__s3_delete(r->c, mkey) : ckpt__err_nomem("s3 key");
        free(mkey);
        ckpt_remote_entry own;
        if (rc == 0) rc = ckpt__remote_list_dir(r, dir, &own);
        if (rc == 0) rc = remove_listed(r, dir, &own, true);
        ckpt__remote_entry_clear(&own);
    }
    free(dir);
    return rc;
}

int ckpt__remote_remove_leftovers(ckpt_remote *r, ckpt_remote_entry *v, int64_t *n,
                                  const ckpt_logger *lg, int64_t *removed) {
    if (removed) *removed = 0;
    int rc = 0;
    int64_t k = 0;
    for (int64_t i = 0; i < *n; i++) {
        if (v[i].committed || rc < 0) {
            v[k++] = v[i];
            continue;
        }
        char *dir = ckpt__remote_number_key(r, v[i].number);
        if (!dir) {
            rc = ckpt__err_nomem("s3 key");
            v[k++] = v[i];
            continue;
        }
        ckpt__log(lg, CKPT_LOG_WARNING,
                  "removing s3://%s/%s/: %" PRId64 " objects of a save that did not finish",
                  r->bucket, dir, v[i].nobjects);
        rc = remove_listed(r, dir, &v[i], false);
        free(dir);
        if (rc < 0) {
            v[k++] = v[i];
            continue;
        }
        if (removed) (*removed)++;
        ckpt__remote_entry_clear(&v[i]);
    }
    *n = k;
    return rc;
}

/* ---- rotation -------------------------------------------------------------------------- */

void ckpt__remote_fill_info(ckpt_checkpoint_info *info, const ckpt_manifest *m) {
    info->step = m->step;
    info->iteration = m->iteration;
    info->created_unix = m->created_unix;
    info->num_files = (int)m->nfiles;
    info->num_processes = m->num_processes;
    info->format_version = (int)m->format_version;
    snprintf(info->library_version, sizeof info->library_version, "%s", m->library_version);
    info->num_metrics = m->nmetrics;
    memcpy(info->metrics, m->metrics, sizeof info->metrics);
    info->total_bytes = 0;
    for (int64_t i = 0; i < m->nfiles; i++) info->total_bytes += m->files[i].size;
}

typedef struct rot_ctx {
    ckpt_remote *r;
    const ckpt_remote_entry *v;
    int64_t n, fresh;
    const ckpt_manifest *m;
    bool deep_kept;
} rot_ctx;

static int rot_numbers(void *ctx, int64_t **nums, int64_t *count) {
    rot_ctx *x = ctx;
    *nums = ckpt__calloc((size_t)(x->n + 1), sizeof **nums);
    if (!*nums) return ckpt__err_nomem("rotation plan");
    int64_t k = 0;
    bool fresh_in = x->fresh < 0;
    for (int64_t i = 0; i < x->n; i++) {
        if (!fresh_in && x->v[i].number > x->fresh) {
            (*nums)[k++] = x->fresh;
            fresh_in = true;
        }
        if (x->v[i].number == x->fresh) fresh_in = true;
        if (x->v[i].committed || x->v[i].number == x->fresh) (*nums)[k++] = x->v[i].number;
    }
    if (!fresh_in) (*nums)[k++] = x->fresh;
    *count = k;
    return 0;
}

static int rot_verify(void *ctx, int64_t number, bool deep, ckpt_checkpoint_info *info) {
    rot_ctx *x = ctx;
    memset(info, 0, sizeof *info);
    if (number == x->fresh) { /* just committed, from this manifest */
        ckpt__remote_fill_info(info, x->m);
        return 0;
    }
    char *dir = ckpt__remote_number_key(x->r, number);
    if (!dir) return ckpt__err_nomem("s3 key");
    ckpt_manifest m;
    bool have = false;
    int rc = ckpt__remote_check(x->r, dir, ckpt__remote_find(x->v, x->n, number),
                                deep && x->deep_kept, &m, &have);
    if (have) {
        ckpt__remote_fill_info(info, &m);
        ckpt__manifest_clear(&m);
    }
    free(dir);
    return rc;
}

static int rot_remove(void *ctx, int64_t number, const ckpt_logger *lg) {
    rot_ctx *x = ctx;
    (void)lg;
    return ckpt__remote_remove(x->r, number,
                               number == x->fresh ? NULL : ckpt__remote_find(x->v, x->n, number));
}

int ckpt__remote_rotate(ckpt_remote *r, const ckpt_remote_entry *v, int64_t n, int64_t fresh,
                        const ckpt_manifest *m, bool deep_kept, ckpt_rotation *rot) {
    char *where = ckpt__malloc(strlen(r->url) + 16);
    if (!where) return ckpt__err_nomem("rotation");
    sprintf(where, "%s/checkpoints", r->url);
    rot_ctx x = {r, v, n, fresh, m, deep_kept};
    ckpt_rotate_src src = {&x, where, rot_numbers, rot_verify, rot_remove};
    int rc = ckpt__rotate_src(&src, rot);
    free(where);
    return rc;
}
