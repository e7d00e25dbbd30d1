/* statedict_writer.c — the writer: entries collected by key (tensor data
 * borrowed, never copied; sharded tensors as chunks), marked for the
 * schema check, and staged into one buffer for asynchronous saves. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "base/mem.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* ---- writer ------------------------------------------------------------- */

static int writer_new(ckpt_writer **out, bool schema) {
    if (!out) return ckpt__err(CKPT_EINVAL, "writer: out is NULL");
    *out = ckpt__calloc(1, sizeof **out);
    if (!*out) return ckpt__err_nomem("writer");
    (*out)->schema = schema;
    return CKPT_OK;
}

int ckpt_writer_new(ckpt_writer **out) { return writer_new(out, false); }
int ckpt_writer_new_schema(ckpt_writer **out) { return writer_new(out, true); }

static void entry_free_owned(entry *e) {
    free(e->key);
    free(e->str);
    free(e->bytes);
}

void ckpt_writer_free(ckpt_writer *w) {
    if (!w) return;
    for (int64_t i = 0; i < w->count; i++) entry_free_owned(&w->entries[i]);
    free(w->entries);
    key_index_free(&w->index);
    free(w);
}

int64_t ckpt_writer_count(const ckpt_writer *w) { return w ? w->count : 0; }
int64_t ckpt_writer_entry_count(const ckpt_writer *w) { return ckpt_writer_count(w); }

bool ckpt__writer_is_schema(const ckpt_writer *w) { return w && w->schema; }

int ckpt__writer_set_optional(ckpt_writer *w, const char *key) {
    int64_t i = w && key ? key_index_get(&w->index, key) : -1;
    if (i < 0)
        return ckpt__err(CKPT_ENOENT, "state dict: no key '%s' to mark optional",
                         key ? key : "(null)");
    w->entries[i].optional = true;
    return CKPT_OK;
}

int ckpt__writer_set_shape_by_object(ckpt_writer *w, const char *key) {
    int64_t i = w && key ? key_index_get(&w->index, key) : -1;
    if (i < 0)
        return ckpt__err(CKPT_ENOENT, "state dict: no key '%s' to mark", key ? key : "(null)");
    w->entries[i].shape_by_object = true;
    return CKPT_OK;
}

int ckpt__writer_set_frozen(ckpt_writer *w, const char *key) {
    int64_t i = w && key ? key_index_get(&w->index, key) : -1;
    if (i < 0 || w->entries[i].kind != CKPT_ENTRY_TENSOR)
        return ckpt__err(CKPT_ENOENT, "state dict: no tensor '%s' to mark frozen",
                         key ? key : "(null)");
    w->entries[i].frozen = true;
    return CKPT_OK;
}

bool ckpt__writer_entry_frozen(const ckpt_writer *w, int64_t j) {
    return w && j >= 0 && j < w->count && w->entries[j].frozen;
}

bool ckpt__writer_has(const ckpt_writer *w, const char *key) {
    return w && key && key_index_get(&w->index, key) >= 0;
}

int ckpt_writer_entry(const ckpt_writer *w, int64_t i, ckpt_entry_info *info) {
    if (!w || !info) return ckpt__err(CKPT_EINVAL, "writer entry: NULL argument");
    if (i < 0 || i >= w->count)
        return ckpt__err(CKPT_EINVAL, "writer entry: index %" PRId64 " outside 0..%" PRId64, i,
                         w->count - 1);
    entry_info(&w->entries[i], info);
    return CKPT_OK;
}

/* Validates the key, reserves a slot; on success the caller fills *e (the
 * key is already copied and indexed). Nothing changes on failure. */
static int writer_add(ckpt_writer *w, const char *key, ckpt_entry_kind kind, entry **e) {
    if (!w) return ckpt__err(CKPT_EINVAL, "write: writer is NULL");
    CKPT_TRY(ckpt__check_key(key, "state dict"));
    if (key_index_get(&w->index, key) >= 0)
        return ckpt__err(CKPT_EEXIST, "state dict: key '%s' written twice", key);
    if (w->count == w->cap) {
        int64_t ncap = w->cap ? w->cap * 2 : 16;
        entry *ne = ckpt__realloc(w->entries, (size_t)ncap * sizeof *ne);
        if (!ne) return ckpt__err_nomem("state dict entries");
        w->entries = ne;
        w->cap = ncap;
    }
    char *k = ckpt__strdup(key);
    if (!k) return ckpt__err_nomem("state dict key");
    int rc = key_index_put(&w->index, k, w->count, NULL);
    if (rc) {
        free(k);
        return ckpt__err_nomem("state dict key index");
    }
    entry *x = &w->entries[w->count];
    memset(x, 0, sizeof *x);
    x->key = k;
    x->kind = kind;
    *e = x;
    return CKPT_OK;
}

static int check_mem(const ckpt_mem_ref *m, const char *key) {
    char what[CKPT_MAX_KEY + 40];
    snprintf(what, sizeof what, "state dict: tensor '%s'", key ? key : "(null)");
    return ckpt__mem_check_ops(m->ops, what);
}

/* A tensor at data, or (m not NULL) behind memory ops at *m. */
static int write_tensor(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                        const int64_t *shape, const void *data, const ckpt_mem_ref *m) {
    uint64_t nb = 0;
    int rc = ckpt_tensor_nbytes(dt, ndim, shape, &nb);
    if (rc) return ckpt__err_prefix(rc, "state dict: tensor '%s'", key ? key : "(null)");
    if (m) CKPT_TRY(check_mem(m, key));
    if (w && !w->schema && !m && !data && nb)
        return ckpt__err(CKPT_EINVAL, "state dict: tensor '%s': data is NULL for %" PRIu64 " bytes",
                         key ? key : "(null)", nb);
    if (w && (w->tensor_bytes + nb >= ((uint64_t)1 << 63)))
        return ckpt__err(CKPT_EINVAL, "state dict: tensor '%s': total tensor bytes reach 2^63",
                         key ? key : "(null)");
    entry *e = NULL;
    CKPT_TRY(writer_add(w, key, CKPT_ENTRY_TENSOR, &e));
    e->dtype = dt;
    e->ndim = ndim;
    for (int i = 0; i < ndim; i++) e->shape[i] = shape[i];
    e->nbytes = nb;
    e->data = w->schema || m ? NULL : data;
    if (m && !w->schema) e->mem = *m;
    w->tensor_bytes += nb;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_tensor(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                      const int64_t *shape, const void *data) {
    return write_tensor(w, key, dt, ndim, shape, data, NULL);
}

int ckpt__write_tensor_at(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                          const int64_t *shape, const ckpt_mem_ref *m) {
    return write_tensor(w, key, dt, ndim, shape, NULL, m);
}

int ckpt_write_tensor_mem(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                          const int64_t *shape, const ckpt_memory_ops *ops, void *handle) {
    ckpt_mem_ref m = {ops, handle, 0};
    return write_tensor(w, key, dt, ndim, shape, NULL, &m);
}

static int write_shard(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                       const int64_t *global_shape, const int64_t *offsets,
                       const int64_t *local_shape, const void *data, const ckpt_mem_ref *m) {
    const char *k = key ? key : "(null)";
    if (m) CKPT_TRY(check_mem(m, key));
    if (ndim > 0 && (!global_shape || !offsets || !local_shape))
        return ckpt__err(CKPT_EINVAL, "state dict: sharded tensor '%s': a shape or offsets is NULL",
                         k);
    if (ndim < 0 || ndim > CKPT_MAX_NDIM)
        return ckpt__err(CKPT_EINVAL, "state dict: sharded tensor '%s': ndim %d outside 0..%d", k,
                         ndim, CKPT_MAX_NDIM);
    ckpt_chunk c;
    memset(&c, 0, sizeof c);
    c.dtype = dt;
    c.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        c.global_shape[d] = global_shape[d];
        c.offsets[d] = offsets[d];
        c.shape[d] = local_shape[d];
    }
    uint64_t cb = 0, gb = 0;
    CKPT_TRY(ckpt__chunk_check(&c, CKPT_EINVAL, "state dict", k, &cb));
    CKPT_TRY(ckpt_tensor_nbytes(dt, ndim, global_shape, &gb));
    if (w && !w->schema && !m && !data && cb)
        return ckpt__err(CKPT_EINVAL,
                         "state dict: sharded tensor '%s': data is NULL for %" PRIu64 " bytes", k,
                         cb);
    if (w && (w->tensor_bytes + cb >= ((uint64_t)1 << 63)))
        return ckpt__err(CKPT_EINVAL, "state dict: tensor '%s': total tensor bytes reach 2^63", k);
    entry *e = NULL;
    CKPT_TRY(writer_add(w, key, CKPT_ENTRY_TENSOR, &e));
    e->dtype = dt;
    e->ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        e->shape[d] = global_shape[d];
        e->coff[d] = offsets[d];
        e->cshape[d] = local_shape[d];
    }
    e->nbytes = gb;
    e->cbytes = cb;
    e->shard = true;
    e->data = w->schema || m ? NULL : data;
    if (m && !w->schema) e->mem = *m;
    w->tensor_bytes += cb;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_tensor_shard(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                            const int64_t *global_shape, const int64_t *offsets,
                            const int64_t *local_shape, const void *data) {
    return write_shard(w, key, dt, ndim, global_shape, offsets, local_shape, data, NULL);
}

int ckpt__write_tensor_shard_at(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                                const int64_t *global_shape, const int64_t *offsets,
                                const int64_t *local_shape, const ckpt_mem_ref *m) {
    return write_shard(w, key, dt, ndim, global_shape, offsets, local_shape, NULL, m);
}

int ckpt__writer_put_tensor_of(ckpt_writer *dst, const ckpt_writer *w, int64_t j) {
    if (!w || j < 0 || j >= w->count)
        return ckpt__err(CKPT_EINVAL, "writer: entry %lld out of range", (long long)j);
    const entry *e = &w->entries[j];
    if (e->kind != CKPT_ENTRY_TENSOR || (e->shard && !shard_is_whole(e)))
        return ckpt__err(CKPT_EINVAL, "state dict: '%s' is not a whole tensor", e->key);
    return write_tensor(dst, e->key, e->dtype, e->ndim, e->shape, e->data,
                        e->mem.ops ? &e->mem : NULL);
}

bool ckpt__writer_has_shards(const ckpt_writer *w) {
    for (int64_t i = 0; w && i < w->count; i++)
        if (w->entries[i].shard) return true;
    return false;
}

bool ckpt__writer_shard_file_needed(const ckpt_writer *w) {
    for (int64_t i = 0; w && i < w->count; i++)
        if (w->entries[i].kind == CKPT_ENTRY_TENSOR && shard_written(&w->entries[i])) return true;
    return false;
}

int ckpt__writer_spread(ckpt_writer *w, int64_t j, int64_t lo, int64_t hi) {
    if (!w || j < 0 || j >= w->count)
        return ckpt__err(CKPT_EINVAL, "save plan: entry %lld out of range", (long long)j);
    entry *e = &w->entries[j];
    int64_t rows = e->ndim > 0 ? e->shape[0] : 1;
    if (e->kind != CKPT_ENTRY_TENSOR || e->shard || w->schema || lo < 0 || lo > hi || hi > rows)
        return ckpt__err(CKPT_EINVAL, "save plan: '%s': rows [%lld, %lld) of a %s", e->key,
                         (long long)lo, (long long)hi,
                         e->kind != CKPT_ENTRY_TENSOR ? "non-tensor" : "tensor");
    uint64_t row_bytes = rows > 0 ? e->nbytes / (uint64_t)rows : 0;
    e->shard = true;
    for (int d = 0; d < e->ndim; d++) {
        e->coff[d] = 0;
        e->cshape[d] = e->shape[d];
    }
    if (lo == hi) {
        e->elsewhere = true;
        e->cbytes = 0;
        e->data = NULL;
        memset(&e->mem, 0, sizeof e->mem);
        return CKPT_OK;
    }
    if (e->ndim > 0) {
        e->coff[0] = lo;
        e->cshape[0] = hi - lo;
    }
    e->cbytes = row_bytes * (uint64_t)(hi - lo);
    if (e->data) e->data = (const uint8_t *)e->data + row_bytes * (uint64_t)lo;
    if (e->mem.ops) e->mem.off += row_bytes * (uint64_t)lo;
    return CKPT_OK;
}

int ckpt__writer_entry_shape(const ckpt_writer *w, int64_t j, ckpt_entry_kind *kind,
                             ckpt_dtype *dt, int *ndim, const int64_t **shape, uint64_t *nbytes,
                             bool *shard) {
    if (!w || j < 0 || j >= w->count)
        return ckpt__err(CKPT_EINVAL, "writer: entry %lld out of range", (long long)j);
    const entry *e = &w->entries[j];
    *kind = e->kind;
    *dt = e->dtype;
    *ndim = e->ndim;
    *shape = e->shape;
    *nbytes = e->nbytes;
    *shard = e->shard;
    return CKPT_OK;
}

/* Staging (asynchronous saves): each tensor's bytes at a 64-byte boundary. */
#define STAGE_ALIGN 64

static uint64_t stage_size(const entry *e) {
    if (e->kind != CKPT_ENTRY_TENSOR || (!e->data && !e->mem.ops) || e->elsewhere) return 0;
    return e->shard ? e->cbytes : e->nbytes;
}

uint64_t ckpt__writer_stage_bytes(const ckpt_writer *w) {
    uint64_t n = 0;
    for (int64_t i = 0; w && i < w->count; i++) {
        uint64_t b = stage_size(&w->entries[i]);
        if (b) n += (b + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
    }
    return n;
}

int ckpt__writer_stage(ckpt_writer *w, uint8_t *dst, uint64_t *used) {
    uint64_t off = 0;
    *used = 0;
    for (int64_t i = 0; w && i < w->count; i++) {
        entry *e = &w->entries[i];
        uint64_t b = stage_size(e);
        if (!b) continue;
        if (e->mem.ops) { /* the one copy, piece by piece */
            CKPT_TRY(ckpt__mem_get(&e->mem, 0, dst + off, b, e->key));
            memset(&e->mem, 0, sizeof e->mem);
        } else {
            ckpt__copy_stream(dst + off, e->data, (size_t)b);
        }
        e->data = dst + off;
        off += (b + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
        *used = off;
    }
    return CKPT_OK;
}

int ckpt_write_i64(ckpt_writer *w, const char *key, int64_t v) {
    entry *e = NULL;
    CKPT_TRY(writer_add(w, key, CKPT_ENTRY_I64, &e));
    e->i64 = v;
    e->nbytes = 8;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_u64(ckpt_writer *w, const char *key, uint64_t v) {
    entry *e = NULL;
    CKPT_TRY(writer_add(w, key, CKPT_ENTRY_U64, &e));
    e->u64 = v;
    e->nbytes = 8;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_alias(ckpt_writer *w, const char *alias, const char *target) {
    if (!w) return ckpt__err(CKPT_EINVAL, "write: writer is NULL");
    if (!target)
        return ckpt__err(CKPT_EINVAL, "state dict: alias '%s': target is NULL",
                         alias ? alias : "(null)");
    int64_t t = key_index_get(&w->index, target);
    const entry *te = t >= 0 ? &w->entries[t] : NULL;
    if (!te || te->kind != CKPT_ENTRY_TENSOR)
        return ckpt__err(CKPT_ENOENT,
                         "state dict: alias '%s': '%s' is %s, expected a tensor written before",
                         alias ? alias : "(null)", target,
                         !te ? "no key of this state dict" : kind_name(te->kind));
    if (te->shard)
        return ckpt__err(CKPT_EINVAL,
                         "state dict: alias '%s': '%s' is a sharded tensor; only a tensor written "
                         "whole can have an alias",
                         alias ? alias : "(null)", target);
    char *copy = ckpt__strdup(target);
    if (!copy) return ckpt__err_nomem("state dict alias");
    entry *e = NULL;
    int rc = writer_add(w, alias, CKPT_ENTRY_ALIAS, &e);
    if (rc) {
        free(copy);
        return rc;
    }
    te = &w->entries[t]; /* writer_add may have moved the entries */
    e->str = copy;
    e->dtype = te->dtype;
    e->ndim = te->ndim;
    memcpy(e->shape, te->shape, sizeof e->shape);
    e->frozen = te->frozen;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_f64(ckpt_writer *w, const char *key, double v) {
    entry *e = NULL;
    CKPT_TRY(writer_add(w, key, CKPT_ENTRY_F64, &e));
    e->f64 = v;
    e->nbytes = 8;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_str(ckpt_writer *w, const char *key, const char *v) {
    if (!v) return ckpt__err(CKPT_EINVAL, "state dict: string '%s' is NULL", key ? key : "(null)");
    size_t n = strlen(v);
    if (!ckpt__utf8_valid((const unsigned char *)v, n))
        return ckpt__err(CKPT_EINVAL, "state dict: string '%s' is not valid UTF-8",
                         key ? key : "(null)");
    /* Copy first, so a failure leaves the writer unchanged. */
    char *copy = ckpt__strdup(v);
    if (!copy) return ckpt__err_nomem("state dict string");
    entry *e = NULL;
    int rc = writer_add(w, key, CKPT_ENTRY_STR, &e);
    if (rc) {
        free(copy);
        return rc;
    }
    e->str = copy;
    e->nbytes = n;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_bytes(ckpt_writer *w, const char *key, const void *p, size_t n) {
    if (!p && n)
        return ckpt__err(CKPT_EINVAL, "state dict: bytes '%s' are NULL", key ? key : "(null)");
    /* base64 grows 4/3 and the header is capped at 100 MB. */
    if (n > (size_t)CKPT_ST_MAX_HEADER / 4 * 3)
        return ckpt__err(CKPT_EINVAL, "state dict: bytes '%s': %zu bytes do not fit in a header",
                         key ? key : "(null)", n);
    uint8_t *copy = ckpt__malloc(n ? n : 1);
    if (!copy) return ckpt__err_nomem("state dict bytes");
    if (n) memcpy(copy, p, n);
    entry *e = NULL;
    int rc = writer_add(w, key, CKPT_ENTRY_BYTES, &e);
    if (rc) {
        free(copy);
        return rc;
    }
    e->bytes = copy;
    e->nbytes = n;
    w->count++;
    return CKPT_OK;
}
