/* statedict_save.c — a writer saved as one safetensors file: the
 * __metadata__["ckpt"] document, the header, the data, and the digest the
 * manifest records. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "base/base64.h"
#include "format/safetensors.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* The __metadata__["ckpt"] document for the writer's non-tensor entries. */
static int build_doc(const ckpt_writer *w, char **out) {
    *out = NULL;
    int rc = CKPT_OK;
    json_t *doc = json_object();
    json_t *arr = json_array();
    /* Version 2 only for what version 1 lacks (docs/FORMAT.md). */
    int version = CKPT_DOC_VERSION_BASE;
    for (int64_t i = 0; i < w->count; i++)
        if (w->entries[i].kind == CKPT_ENTRY_U64 || w->entries[i].kind == CKPT_ENTRY_ALIAS)
            version = CKPT_DOC_VERSION;
    if (!doc || !arr || json_object_set_new(doc, "version", json_integer(version)) ||
        json_object_set(doc, "entries", arr)) {
        rc = ckpt__err(CKPT_ENOMEM, "state dict: building the metadata document failed");
        goto out;
    }
    for (int64_t i = 0; i < w->count; i++) {
        const entry *e = &w->entries[i];
        if (e->kind == CKPT_ENTRY_TENSOR) continue;
        json_t *v = NULL;
        char *b64 = NULL;
        switch (e->kind) {
        case CKPT_ENTRY_I64: v = json_integer((json_int_t)e->i64); break;
        case CKPT_ENTRY_U64: {
            /* a decimal string: a JSON integer beyond 2^63 - 1 is lost or
             * refused by many parsers (jansson's included) */
            char num[24];
            snprintf(num, sizeof num, "%" PRIu64, e->u64);
            v = json_string(num);
            break;
        }
        case CKPT_ENTRY_ALIAS: v = json_string(e->str); break;
        case CKPT_ENTRY_F64:
            if (isnan(e->f64)) v = json_string("nan");
            else if (isinf(e->f64)) v = json_string(e->f64 > 0 ? "inf" : "-inf");
            else v = json_real(e->f64);
            break;
        case CKPT_ENTRY_STR: v = json_stringn(e->str, (size_t)e->nbytes); break;
        case CKPT_ENTRY_BYTES:
            rc = ckpt__base64_encode(e->bytes, (size_t)e->nbytes, &b64);
            if (rc) goto out;
            v = json_string(b64);
            free(b64);
            break;
        case CKPT_ENTRY_TENSOR: break;
        }
        json_t *o = json_object();
        if (!v || !o || json_object_set_new(o, "key", json_string(e->key)) ||
            json_object_set_new(o, "type", json_string(kind_name(e->kind))) ||
            json_object_set_new(o, "value", v) || json_array_append_new(arr, o)) {
            json_decref(o);
            rc = ckpt__err(CKPT_ENOMEM, "state dict: building the metadata entry '%s' failed",
                           e->key);
            goto out;
        }
    }
    /* 17 significant digits: every finite double prints and parses back to
     * the same bits. */
    *out = json_dumps(doc, JSON_COMPACT | JSON_REAL_PRECISION(17));
    if (!*out) rc = ckpt__err(CKPT_ENOMEM, "state dict: serialising the metadata document failed");
out:
    json_decref(arr);
    json_decref(doc);
    return rc;
}

typedef struct save_ctx {
    const ckpt_writer *w;
    ckpt_st_out *outs;
    int64_t nt;
    const char *doc;
    ckpt_st_written *res;
    ckpt_chunk *chunks; /* SAVE_SHARDS: each out's chunk record */
    uint64_t header_xxh3;
    /* Hugging Face's record of a tied name left out (safetensors.torch's
     * save_model: __metadata__[alias] = the name kept): alias, target, ... */
    const char **meta;
    int64_t nmeta;
} save_ctx;

/* What a save writes: a standalone file (sharded entries only if their chunk
 * is the whole tensor), a checkpoint's object file (no sharded entries), or
 * a checkpoint's shard file (only the sharded entries). */
typedef enum save_mode { SAVE_STANDALONE, SAVE_PLAIN, SAVE_SHARDS } save_mode;

static int fill_file(ckpt_ostream *s, void *ctx) {
    save_ctx *c = ctx;
    return ckpt__st_write(s, c->outs, c->nt, c->doc, c->meta, c->nmeta, c->res, &c->header_xxh3);
}

static void digest_clear(ckpt_file_digest *d) { memset(d, 0, sizeof *d); }

void ckpt__file_digest_free(ckpt_file_digest *d) {
    if (!d) return;
    for (int64_t i = 0; i < d->ntensors; i++)
        if (d->tensor_keys) free(d->tensor_keys[i]);
    free(d->tensor_keys);
    free(d->tensor_xxh3);
    free(d->tensor_offset);
    free(d->tensor_nbytes);
    free(d->tensor_chunk);
    digest_clear(d);
}

/* Prepares the tensor list and document for a save. */
static int save_prepare(ckpt_writer *w, const char *path, save_ctx *c, save_mode mode) {
    memset(c, 0, sizeof *c);
    if (!w) return ckpt__err(CKPT_EINVAL, "save: writer is NULL");
    if (!path) return ckpt__err(CKPT_EINVAL, "save: path is NULL");
    if (w->schema)
        return ckpt__err(CKPT_EINVAL, "%s: a schema writer records no data and cannot be saved",
                         path);
    c->w = w;
    int64_t nt = 0;
    for (int64_t i = 0; i < w->count; i++) {
        const entry *e = &w->entries[i];
        if (e->kind != CKPT_ENTRY_TENSOR) continue;
        if (mode == SAVE_STANDALONE && e->shard && !shard_is_whole(e))
            return ckpt__err(CKPT_EINVAL,
                             "%s: tensor '%s' is one chunk of a sharded tensor; only a "
                             "checkpoint (ckpt_save_state) saves chunks, a standalone file "
                             "only a chunk that is the whole tensor",
                             path, e->key);
        if (mode == SAVE_PLAIN && e->shard) continue;
        if (mode == SAVE_SHARDS && !shard_written(e)) continue;
        nt++;
    }
    c->outs = ckpt__calloc(nt ? (size_t)nt : 1, sizeof *c->outs);
    c->res = ckpt__calloc(nt ? (size_t)nt : 1, sizeof *c->res);
    if (mode == SAVE_SHARDS) c->chunks = ckpt__calloc(nt ? (size_t)nt : 1, sizeof *c->chunks);
    if (!c->outs || !c->res || (mode == SAVE_SHARDS && !c->chunks)) return ckpt__err_nomem("save");
    int64_t k = 0;
    for (int64_t i = 0; i < w->count; i++) {
        const entry *e = &w->entries[i];
        if (e->kind != CKPT_ENTRY_TENSOR) continue;
        if (mode == SAVE_PLAIN && e->shard) continue;
        if (mode == SAVE_SHARDS && !shard_written(e)) continue;
        if (mode == SAVE_SHARDS) {
            c->outs[k] =
                (ckpt_st_out){e->key, e->dtype, e->ndim, e->cshape, e->data, e->cbytes, e->mem};
            ckpt_chunk *ch = &c->chunks[k];
            ch->dtype = e->dtype;
            ch->ndim = e->ndim;
            memcpy(ch->global_shape, e->shape, sizeof ch->global_shape);
            memcpy(ch->offsets, e->coff, sizeof ch->offsets);
            memcpy(ch->shape, e->cshape, sizeof ch->shape);
        } else {
            c->outs[k] =
                (ckpt_st_out){e->key, e->dtype, e->ndim, e->shape, e->data, e->nbytes, e->mem};
        }
        k++;
    }
    c->nt = nt;
    if (mode == SAVE_SHARDS) return CKPT_OK; /* shard files carry tensors only */
    char *doc = NULL;
    int rc = build_doc(w, &doc);
    if (rc) return ckpt__err_prefix(rc, "%s", path);
    c->doc = doc;
    for (int64_t i = 0; i < w->count; i++) c->nmeta += w->entries[i].kind == CKPT_ENTRY_ALIAS;
    if (c->nmeta && !(c->meta = ckpt__calloc((size_t)c->nmeta * 2, sizeof *c->meta)))
        return ckpt__err_nomem("save");
    for (int64_t i = 0, m = 0; i < w->count && c->nmeta; i++)
        if (w->entries[i].kind == CKPT_ENTRY_ALIAS) {
            c->meta[m++] = w->entries[i].key;
            c->meta[m++] = w->entries[i].str;
        }
    return CKPT_OK;
}

static void save_release(save_ctx *c) {
    free(c->meta);
    free(c->outs);
    free(c->res);
    free(c->chunks);
    free((char *)c->doc);
    memset(c, 0, sizeof *c);
}

static int fill_digest(const save_ctx *c, uint64_t size, uint64_t xxh, ckpt_file_digest *d) {
    digest_clear(d);
    size_t n = c->nt ? (size_t)c->nt : 1;
    d->tensor_keys = ckpt__calloc(n, sizeof *d->tensor_keys);
    d->tensor_xxh3 = ckpt__calloc(n, sizeof *d->tensor_xxh3);
    d->tensor_offset = ckpt__calloc(n, sizeof *d->tensor_offset);
    d->tensor_nbytes = ckpt__calloc(n, sizeof *d->tensor_nbytes);
    if (c->chunks) d->tensor_chunk = ckpt__calloc(n, sizeof *d->tensor_chunk);
    if (!d->tensor_keys || !d->tensor_xxh3 || !d->tensor_offset || !d->tensor_nbytes ||
        (c->chunks && !d->tensor_chunk)) {
        ckpt__file_digest_free(d);
        return ckpt__err_nomem("file digest");
    }
    d->ntensors = c->nt;
    for (int64_t i = 0; i < c->nt; i++) {
        int64_t p = c->res[i].file_pos;
        d->tensor_keys[p] = ckpt__strdup(c->outs[i].name);
        if (!d->tensor_keys[p]) {
            ckpt__file_digest_free(d);
            return ckpt__err_nomem("file digest");
        }
        d->tensor_xxh3[p] = c->res[i].xxh3;
        d->tensor_offset[p] = c->res[i].offset;
        d->tensor_nbytes[p] = c->outs[i].nbytes;
        if (c->chunks) d->tensor_chunk[p] = c->chunks[i];
    }
    d->size = size;
    d->xxh3 = xxh;
    d->has_header_xxh3 = true;
    d->header_xxh3 = c->header_xxh3;
    return CKPT_OK;
}

int ckpt__writer_save_digest(ckpt_writer *w, const char *path, ckpt_file_digest *d) {
    if (d) digest_clear(d);
    save_ctx c;
    int rc = save_prepare(w, path, &c, SAVE_STANDALONE);
    uint64_t size = 0, xxh = 0;
    if (!rc) rc = ckpt__publish_file(path, fill_file, &c, &xxh, &size);
    if (!rc && d) rc = fill_digest(&c, size, xxh, d);
    save_release(&c);
    return rc;
}

int ckpt_writer_save(ckpt_writer *w, const char *path) {
    return ckpt__writer_save_digest(w, path, NULL);
}

static int write_new(ckpt_writer *w, const char *path, const ckpt_ostream_sink *sink,
                     void *sink_ctx, ckpt_file_digest *d, save_mode mode, bool want128) {
    if (d) digest_clear(d);
    save_ctx c;
    int rc = save_prepare(w, path, &c, mode);
    uint64_t size = 0, xxh = 0;
    ckpt_ostream s;
    if (rc && sink) sink->abort(sink_ctx); /* nothing was sent: dropped all the same */
    if (!rc) {
        rc =
            sink ? ckpt__ostream_open_sink(&s, path, sink, sink_ctx) : ckpt__ostream_open(&s, path);
        if (rc && sink) sink->abort(sink_ctx);
        if (!rc) {
            if (want128) ckpt__ostream_want128(&s);
            rc = fill_file(&s, &c);
            if (rc)
                ckpt__ostream_abort(&s);
            else
                rc = ckpt__ostream_finish(&s, &xxh, &size);
        }
    }
    if (!rc && d) rc = fill_digest(&c, size, xxh, d);
    if (!rc && d && want128) {
        d->has_xxh128 = true;
        d->xxh128 = s.h128;
    }
    save_release(&c);
    return rc;
}

int ckpt__writer_write_new(ckpt_writer *w, const char *path, ckpt_file_digest *d) {
    return write_new(w, path, NULL, NULL, d, SAVE_PLAIN, false);
}

int ckpt__writer_write_shards_new(ckpt_writer *w, const char *path, ckpt_file_digest *d) {
    return write_new(w, path, NULL, NULL, d, SAVE_SHARDS, false);
}

int ckpt__writer_write_new_ex(ckpt_writer *w, const char *path, bool shards, bool want128,
                              ckpt_file_digest *d) {
    return write_new(w, path, NULL, NULL, d, shards ? SAVE_SHARDS : SAVE_PLAIN, want128);
}

int ckpt__writer_write_sink(ckpt_writer *w, const char *what, const ckpt_ostream_sink *sink,
                            void *ctx, bool shards, bool want128, ckpt_file_digest *d) {
    return write_new(w, what, sink, ctx, d, shards ? SAVE_SHARDS : SAVE_PLAIN, want128);
}

int ckpt__writer_hash128(ckpt_writer *w, const char *what, bool shards, const uint64_t *expect,
                         int64_t n, uint64_t *size, ckpt_h128 *h, bool *differs) {
    save_ctx c;
    *differs = false;
    int rc = save_prepare(w, what, &c, shards ? SAVE_SHARDS : SAVE_PLAIN);
    ckpt_ostream s;
    if (!rc) rc = ckpt__ostream_open_dry(&s, what);
    if (!rc) {
        if (expect) ckpt__ostream_expect_parts(&s, expect, n);
        rc = fill_file(&s, &c);
        if (rc) ckpt__ostream_abort(&s);
        else rc = ckpt__ostream_finish(&s, NULL, size);
        if (!rc) {
            *h = s.h128;
            *differs = s.differs;
        }
    }
    save_release(&c);
    return rc;
}
