/* save_link.c — incremental saves: a file whose bytes equal the previous
 * checkpoint's file of the same name is hard-linked, not written, unless
 * that would leave fewer than link_copies physical copies of it among the
 * checkpoints retained after the save. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/save_int.h"
#include "base/error.h"
#include "base/io.h"

/* Every rank, after the plan: the manifest of the checkpoint to link from.
 * Without a readable one nothing is linked (that is all it costs). */
void ckpt__save_read_prev(save_op *op) {
    if (!op->link || !op->prev_dir) return;
    ckpt__manifest_init(&op->prev);
    if (ckpt__manifest_read(op->prev_dir, &op->prev) == 0) {
        op->have_prev = true;
    } else {
        ckpt__manifest_clear(&op->prev);
        ckpt_clear_error();
    }
}

/* ---- which checkpoints stay: the copies that count --------------------------- */

static int kept_add(save_op *op, const char *dir) {
    char **v = ckpt__realloc(op->kept, (size_t)(op->nkept + 1) * sizeof *v);
    if (!v) return ckpt__err_nomem("save plan");
    op->kept = v;
    if (!(v[op->nkept] = ckpt__strdup(dir))) return ckpt__err_nomem("save plan");
    op->nkept++;
    return CKPT_OK;
}

static bool same_folder(const char *a, const char *b) {
    struct stat sa, sb;
    return ckpt__os_stat(a, &sa) == 0 && ckpt__os_stat(b, &sb) == 0 && sa.st_dev == sb.st_dev &&
           sa.st_ino == sb.st_ino;
}

int ckpt__save_plan_kept(save_op *op, const int64_t *nums, int64_t count) {
    if (!op->link || op->link_copies <= 1) return CKPT_OK;
    if (op->automatic) {
        /* what rotation keeps besides the new one: the newest total_limit - 1
         * (those a retention policy keeps too are not counted on: their
         * copies may count for less, never for more) */
        int limit = op->acc->total_limit;
        int64_t first = limit > 0 ? count - (limit - 1) : 0;
        for (int64_t i = first < 0 ? 0 : first; i < count; i++) {
            char nm[48];
            snprintf(nm, sizeof nm, "checkpoint_%" PRId64, nums[i]);
            char *d = ckpt__path_join(op->parent, nm);
            int rc = d ? kept_add(op, d) : ckpt__err_nomem("save plan");
            free(d);
            CKPT_TRY(rc);
        }
        /* a link source in no rotation's reach (a fine-tune's start) stays */
        if (op->prev_dir && count == 0) CKPT_TRY(kept_add(op, op->prev_dir));
        return CKPT_OK;
    }
    /* an explicit folder: its link source stays, unless it is the folder
     * the save replaces */
    if (op->prev_dir && !same_folder(op->prev_dir, op->target))
        CKPT_TRY(kept_add(op, op->prev_dir));
    return CKPT_OK;
}

int ckpt__save_kept_encode(const save_op *op, char **out, size_t *len) {
    char head[24];
    int h = snprintf(head, sizeof head, "%d", op->nkept);
    size_t n = (size_t)h + 1;
    for (int i = 0; i < op->nkept; i++) n += strlen(op->kept[i]) + 1;
    char *b = ckpt__malloc(n);
    if (!b) return ckpt__err_nomem("save plan");
    size_t at = 0;
    memcpy(b, head, (size_t)h + 1);
    at = (size_t)h + 1;
    for (int i = 0; i < op->nkept; i++) {
        size_t k = strlen(op->kept[i]) + 1;
        memcpy(b + at, op->kept[i], k);
        at += k;
    }
    *out = b;
    *len = n;
    return CKPT_OK;
}

int ckpt__save_kept_decode(save_op *op, const char *p, size_t len) {
    const char *end = p + len, *z = memchr(p, '\0', len);
    char *stop = NULL;
    long n = z ? strtol(p, &stop, 10) : -1;
    if (!z || stop != z || n < 0 || n > 1000000)
        return ckpt__err(CKPT_EINVAL, "save_state: rank 0 sent a malformed plan (kept list)");
    for (const char *s = z + 1; n-- > 0; s = z + 1) {
        z = s < end ? memchr(s, '\0', (size_t)(end - s)) : NULL;
        if (!z)
            return ckpt__err(CKPT_EINVAL, "save_state: rank 0 sent a malformed plan (kept list)");
        CKPT_TRY(kept_add(op, s));
    }
    return CKPT_OK;
}

void ckpt__save_kept_free(save_op *op) {
    for (int i = 0; i < op->nkept; i++) {
        free(op->kept[i]);
        if (op->kept_read && op->kept_read[i] == 1) ckpt__manifest_clear(&op->kept_m[i]);
    }
    free(op->kept);
    free(op->kept_m);
    free(op->kept_read);
    op->kept = NULL;
    op->kept_m = NULL;
    op->kept_read = NULL;
    op->nkept = 0;
}

/* Kept checkpoint i's record of name, or NULL (its manifest is read once). */
static const ckpt_manifest_file *kept_record(save_op *op, int i, const char *name) {
    if (!op->kept_m) {
        op->kept_m = ckpt__calloc((size_t)op->nkept, sizeof *op->kept_m);
        op->kept_read = ckpt__calloc((size_t)op->nkept, sizeof *op->kept_read);
        if (!op->kept_m || !op->kept_read) {
            free(op->kept_m);
            free(op->kept_read);
            op->kept_m = NULL;
            op->kept_read = NULL;
            return NULL;
        }
    }
    if (op->kept_read[i] == 0) {
        ckpt__manifest_init(&op->kept_m[i]);
        if (ckpt__manifest_read(op->kept[i], &op->kept_m[i]) == 0) {
            op->kept_read[i] = 1;
        } else {
            ckpt__manifest_clear(&op->kept_m[i]);
            ckpt_clear_error();
            op->kept_read[i] = -1;
        }
    }
    return op->kept_read[i] == 1 ? ckpt__manifest_find(&op->kept_m[i], name) : NULL;
}

/* Whether linking name from `from` (its record f) leaves link_copies
 * physical copies of these bytes among the checkpoints retained after the
 * save: the new one (which would share from's inode) and every kept one
 * holding the same bytes, as far as there are that many holders. A kept
 * file on from's inode (or on one counted already) holds them; one on
 * another inode does if its manifest records the same size and XXH3-128. */
static bool enough_copies(save_op *op, const char *name, const ckpt_manifest_file *f,
                          const char *from) {
    enum { MAXC = 16 };
    struct stat st;
    if (ckpt__os_lstat(from, &st) != 0) return false;
    int want = op->link_copies < MAXC ? op->link_copies : MAXC;
    dev_t dev[MAXC];
    ino_t ino[MAXC];
    int copies = 1, holders = 1; /* the new checkpoint, on from's inode */
    dev[0] = st.st_dev;
    ino[0] = st.st_ino;
    for (int i = 0; i < op->nkept && copies < want; i++) {
        char *p = ckpt__path_join(op->kept[i], name);
        int r = p ? ckpt__os_lstat(p, &st) : -1;
        free(p);
        if (r != 0 || !S_ISREG(st.st_mode)) continue;
        bool seen = false;
        for (int c = 0; c < copies && !seen; c++) seen = dev[c] == st.st_dev && ino[c] == st.st_ino;
        if (!seen) {
            const ckpt_manifest_file *k = kept_record(op, i, name);
            if (!k || !k->has_xxh128 || k->size != f->size || !ckpt__h128_eq(k->xxh128, f->xxh128))
                continue;
            dev[copies] = st.st_dev;
            ino[copies] = st.st_ino;
            copies++;
        }
        holders++;
    }
    return copies >= (holders < want ? holders : want);
}

/* The digest of a linked file, from the previous manifest's record. */
int ckpt__save_digest_from_record(const ckpt_manifest_file *f, ckpt_file_digest *d) {
    memset(d, 0, sizeof *d);
    size_t n = f->ntensors ? (size_t)f->ntensors : 1;
    d->tensor_keys = ckpt__calloc(n, sizeof *d->tensor_keys);
    d->tensor_xxh3 = ckpt__calloc(n, sizeof *d->tensor_xxh3);
    if (f->chunks) d->tensor_chunk = ckpt__calloc(n, sizeof *d->tensor_chunk);
    if (!d->tensor_keys || !d->tensor_xxh3 || (f->chunks && !d->tensor_chunk)) {
        ckpt__file_digest_free(d);
        return ckpt__err_nomem("file digest");
    }
    d->ntensors = f->ntensors;
    for (int64_t t = 0; t < f->ntensors; t++) {
        if (!(d->tensor_keys[t] = ckpt__strdup(f->tensor_keys[t]))) {
            ckpt__file_digest_free(d);
            return ckpt__err_nomem("file digest");
        }
        d->tensor_xxh3[t] = f->tensor_xxh3[t];
        if (f->chunks) d->tensor_chunk[t] = f->chunks[t];
    }
    d->size = f->size;
    d->xxh3 = f->xxh3;
    d->has_xxh128 = true;
    d->xxh128 = f->xxh128;
    d->has_header_xxh3 = f->has_header_xxh3;
    d->header_xxh3 = f->header_xxh3;
    return CKPT_OK;
}

/* Whether the file the save would write as name (at where: a path or a key)
 * has the size and XXH3-128 that the previous checkpoint's manifest records
 * for its file of that name, decided from memory: 1, with *fp that record;
 * 0: write it (d->xxh128 may already hold its hash). Tensor by tensor
 * against the old file's record first: a file that changed is known as such
 * at its first changed tensor, without hashing the rest (the write then
 * computes its XXH3-128 on the way). Shared by the link of a folder's save
 * and the server-side copy of a bucket's. */
int ckpt__save_unchanged(save_op *op, ckpt_writer *w, const char *name, bool shards,
                         const char *where, ckpt_file_digest *d, const ckpt_manifest_file **fp) {
    if (!op->have_prev || op->link_off) return 0;
    const ckpt_manifest_file *f = ckpt__manifest_find(&op->prev, name);
    if (!f || !f->has_xxh128) return 0;
    uint64_t size = 0;
    ckpt_h128 h;
    bool differs = false;
    const uint64_t *expect = f->ntensors > 0 ? f->tensor_xxh3 : NULL;
    CKPT_TRY(ckpt__writer_hash128(w, where, shards, expect, f->ntensors, &size, &h, &differs));
    if (differs) return 0;
    d->has_xxh128 = true;
    d->xxh128 = h;
    if (size != f->size || !ckpt__h128_eq(h, f->xxh128)) return 0;
    *fp = f;
    return 1;
}

/* Whether the file the save would write as name equals the previous
 * checkpoint's file of that name (ckpt__save_unchanged). If so it is
 * hard-linked into the temporary folder at path (1; d from the record).
 * 0: write it. The old file is never read to decide; it is read once
 * linked, to check that its bytes are those in memory and those its
 * manifest records (a file changed after its commit is never linked). */
int ckpt__save_try_link(save_op *op, ckpt_writer *w, const char *name, bool shards,
                        const char *path, ckpt_file_digest *d) {
    const ckpt_manifest_file *f = NULL;
    int rc = ckpt__save_unchanged(op, w, name, shards, path, d, &f);
    if (rc <= 0) return rc;
    return ckpt__save_link_same(op, &op->prev, op->prev_dir, name, f->size, f->xxh128, path, d);
}

int ckpt__save_link_same(save_op *op, const ckpt_manifest *prev, const char *prev_dir,
                         const char *name, uint64_t size, ckpt_h128 h, const char *path,
                         ckpt_file_digest *d) {
    if (op->link_off) return 0;
    const ckpt_manifest_file *f = ckpt__manifest_find(prev, name);
    if (!f || !f->has_xxh128 || size != f->size || !ckpt__h128_eq(h, f->xxh128)) return 0;
    char *from = ckpt__path_join(prev_dir, name);
    if (!from) return ckpt__err_nomem("save path");
    /* a copy of its own where a link would leave too few (link_copies) */
    if (op->link_copies > 1 && !enough_copies(op, name, f, from)) {
        free(from);
        return 0;
    }
    if (ckpt__os_link(from, path) != 0) {
        int e = errno;
        if (e != ENOENT) { /* EXDEV, EPERM, EMLINK, ENOTSUP...: for this save, write */
            op->link_off = true;
            ckpt__log(&op->log, CKPT_LOG_WARNING,
                      "save_state: cannot hard-link unchanged files from %s (%s: %s); writing "
                      "them instead",
                      prev_dir, name, strerror(e));
        }
        free(from);
        return 0;
    }
    /* Both digests of the file as linked: XXH3-128 against the bytes in
     * memory (so what is linked is exactly what would have been written,
     * whatever the old manifest says), XXH3-64 against its record (which
     * the new manifest copies). */
    uint64_t got = 0;
    ckpt_h128 got128 = {0, 0};
    int rc = ckpt__read_hashed128(path, path, f->size, &got, &got128);
    if (rc < 0 || got != f->xxh3 || !ckpt__h128_eq(got128, h)) {
        ckpt__log(&op->log, CKPT_LOG_WARNING,
                  "save_state: %s no longer has the bytes its manifest records (%s); not "
                  "linked, written anew",
                  from, rc < 0 ? ckpt_errmsg() : "its checksum differs");
        free(from);
        ckpt_clear_error();
        if (ckpt__os_unlink(path) != 0)
            return ckpt__err_os(errno, "save_state: %s: remove a link to a damaged file", path);
        return 0;
    }
    free(from);
    CKPT_TRY(ckpt__save_digest_from_record(f, d));
    op->linked_bytes += f->size;
    return 1;
}
