/* save_link.c — incremental saves: a file whose bytes equal the previous
 * checkpoint's file of the same name is hard-linked, not written. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

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

/* Whether the file the save would write as name equals the previous
 * checkpoint's file of that name, decided from memory: the same size and
 * XXH3-128 as its manifest records. If so it is hard-linked into the
 * temporary folder at path (1; d from the record). 0: write it (d->xxh128
 * may already hold its hash). The old file is never read to decide; it is
 * read once linked, to check that its bytes are those in memory and those
 * its manifest records (a file changed after its commit is never linked). */
int ckpt__save_try_link(save_op *op, ckpt_writer *w, const char *name, bool shards,
                        const char *path, ckpt_file_digest *d) {
    if (!op->have_prev || op->link_off) return 0;
    const ckpt_manifest_file *f = ckpt__manifest_find(&op->prev, name);
    if (!f || !f->has_xxh128) return 0;
    uint64_t size = 0;
    ckpt_h128 h;
    CKPT_TRY(ckpt__writer_hash128(w, path, shards, &size, &h));
    d->has_xxh128 = true;
    d->xxh128 = h;
    if (size != f->size || !ckpt__h128_eq(h, f->xxh128)) return 0;
    char *from = ckpt__path_join(op->prev_dir, name);
    if (!from) return ckpt__err_nomem("save path");
    if (ckpt__os_link(from, path) != 0) {
        int e = errno;
        if (e != ENOENT) { /* EXDEV, EPERM, EMLINK, ENOTSUP...: for this save, write */
            op->link_off = true;
            ckpt__log(&op->log, CKPT_LOG_WARNING,
                      "save_state: cannot hard-link unchanged files from %s (%s: %s); writing "
                      "them instead",
                      op->prev_dir, name, strerror(e));
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
