/* statedict.c — state dicts: a writer that collects entries (tensor data
 * borrowed, never copied) and saves them as one safetensors file, a schema
 * writer for transactional loads, and a reader that validates the whole file
 * before handing anything out. Non-tensor entries travel in
 * __metadata__["ckpt"] as one JSON document (docs/FORMAT.md). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define XXH_STATIC_LINKING_ONLY
#include <xxhash.h>

#include "base/base64.h"
#include "base/error.h"
#include "base/io.h"
#include "format/safetensors.h"
#include "format/shard.h"
#include "format/statedict.h"

/* Version of the __metadata__["ckpt"] document. */
#define CKPT_DOC_VERSION 1

/* ---- keys --------------------------------------------------------------- */

bool ckpt__utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp, min;
        if (c >= 0xc2 && c <= 0xdf) len = 2, cp = c & 0x1f, min = 0x80;
        else if (c >= 0xe0 && c <= 0xef) len = 3, cp = c & 0x0f, min = 0x800;
        else if (c >= 0xf0 && c <= 0xf4) len = 4, cp = c & 0x07, min = 0x10000;
        else return false;
        if (n - i < len) return false;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        i += len;
    }
    return true;
}

int ckpt__check_key(const char *key, const char *what) {
    if (!what) what = "state dict";
    if (!key) return ckpt__err(CKPT_EINVAL, "%s: key is NULL", what);
    size_t n = strlen(key);
    if (n == 0) return ckpt__err(CKPT_EINVAL, "%s: key is empty", what);
    if (n > CKPT_MAX_KEY)
        return ckpt__err(CKPT_EINVAL, "%s: key '%.40s...' is %zu bytes, longer than %d", what, key,
                         n, CKPT_MAX_KEY);
    if (!ckpt__utf8_valid((const unsigned char *)key, n))
        return ckpt__err(CKPT_EINVAL, "%s: key is not valid UTF-8", what);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)key[i];
        /* C0, DEL, and C1 (U+0080..U+009F, encoded 0xC2 0x80..0x9F). */
        if (c < 0x20 || c == 0x7f ||
            (c == 0xc2 && i + 1 < n && (unsigned char)key[i + 1] >= 0x80 &&
             (unsigned char)key[i + 1] <= 0x9f))
            return ckpt__err(CKPT_EINVAL, "%s: key contains a control character at byte %zu",
                             what, i);
    }
    if (strcmp(key, "__metadata__") == 0)
        return ckpt__err(CKPT_EINVAL, "%s: key '__metadata__' is reserved by the file format",
                         what);
    return CKPT_OK;
}

/* ---- a small key -> index hash table ------------------------------------ */

typedef struct key_slot {
    const char *key; /* borrowed: owned by the writer/reader entry */
    int64_t index;
} key_slot;

typedef struct key_index {
    key_slot *slots;
    size_t cap; /* power of two, or 0 */
    size_t used;
} key_index;

static uint64_t hash_key(const char *s) {
    return ckpt__xxh3(s, strlen(s));
}

static int64_t key_index_get(const key_index *m, const char *key) {
    if (!m->cap) return -1;
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)hash_key(key) & mask;; i = (i + 1) & mask) {
        if (!m->slots[i].key) return -1;
        if (strcmp(m->slots[i].key, key) == 0) return m->slots[i].index;
    }
}

/* Inserts key; returns CKPT_OK, CKPT_EEXIST (*existing set) or CKPT_ENOMEM
 * (without a message: callers say what they were doing). */
static int key_index_put(key_index *m, const char *key, int64_t index, int64_t *existing) {
    if ((m->used + 1) * 2 > m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 16;
        key_slot *ns = ckpt__calloc(ncap, sizeof *ns);
        if (!ns) return CKPT_ENOMEM;
        for (size_t j = 0; j < m->cap; j++) {
            if (!m->slots[j].key) continue;
            size_t i = (size_t)hash_key(m->slots[j].key) & (ncap - 1);
            while (ns[i].key) i = (i + 1) & (ncap - 1);
            ns[i] = m->slots[j];
        }
        free(m->slots);
        m->slots = ns;
        m->cap = ncap;
    }
    size_t mask = m->cap - 1;
    size_t i = (size_t)hash_key(key) & mask;
    for (; m->slots[i].key; i = (i + 1) & mask) {
        if (strcmp(m->slots[i].key, key) == 0) {
            if (existing) *existing = m->slots[i].index;
            return CKPT_EEXIST;
        }
    }
    m->slots[i].key = key;
    m->slots[i].index = index;
    m->used++;
    return CKPT_OK;
}

static void key_index_free(key_index *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

/* ---- shared entry record ------------------------------------------------ */

typedef struct entry {
    char *key;             /* writer: owned; reader: view */
    ckpt_entry_kind kind;
    ckpt_dtype dtype;
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    uint64_t nbytes;
    uint64_t offset;       /* reader tensors: absolute file offset */
    const void *data;      /* writer tensors: borrowed */
    int64_t i64;
    double f64;
    char *str;             /* writer: owned copy; reader: view into the doc */
    uint8_t *bytes;        /* owned (both sides) */
    /* Sharded tensors: shape/nbytes above are the whole tensor's. */
    bool shard;                        /* writer: added with ckpt_write_tensor_shard */
    bool optional;                     /* writer: a schema check accepts a file without it */
    bool elsewhere;                    /* writer: spread, and another process writes all of it */
    bool shape_by_object;              /* writer: a schema check leaves its shape to the object */
    bool frozen;                       /* writer: a frozen parameter (ckpt__writer_set_frozen) */
    int64_t coff[CKPT_MAX_NDIM];       /* writer: this chunk's offsets */
    int64_t cshape[CKPT_MAX_NDIM];     /* writer: this chunk's shape */
    uint64_t cbytes;                   /* writer: this chunk's bytes */
    int64_t sk;                        /* reader: 1 + index into r->skeys, or 0 */
    ckpt_dtype conv_from;              /* adapted reader: data holds this dtype, converted to
                                          dtype as it is read (0: data is dtype already) */
} entry;

const char *ckpt_entry_kind_name(ckpt_entry_kind kind) {
    switch (kind) {
    case CKPT_ENTRY_TENSOR: return "tensor";
    case CKPT_ENTRY_I64: return "i64";
    case CKPT_ENTRY_F64: return "f64";
    case CKPT_ENTRY_STR: return "str";
    case CKPT_ENTRY_BYTES: return "bytes";
    }
    return NULL;
}

static const char *kind_name(ckpt_entry_kind k) {
    const char *n = ckpt_entry_kind_name(k);
    return n ? n : "?";
}


/* "tensor F32 [2,3]" / "i64" */
static const char *describe(char *buf, size_t cap, const entry *e) {
    if (e->kind != CKPT_ENTRY_TENSOR) {
        snprintf(buf, cap, "%s", kind_name(e->kind));
        return buf;
    }
    char sb[200];
    snprintf(buf, cap, "tensor %s %s", ckpt_dtype_name(e->dtype),
             ckpt__shape_str(sb, sizeof sb, e->ndim, e->shape));
    return buf;
}

static void entry_info(const entry *e, ckpt_entry_info *info) {
    memset(info, 0, sizeof *info);
    info->key = e->key;
    info->kind = e->kind;
    info->dtype = e->kind == CKPT_ENTRY_TENSOR ? e->dtype : CKPT_DTYPE_INVALID;
    info->ndim = e->ndim;
    memcpy(info->shape, e->shape, sizeof info->shape);
    info->nbytes = e->nbytes;
    info->offset = e->offset;
}

/* ---- writer ------------------------------------------------------------- */

struct ckpt_writer {
    entry *entries;
    int64_t count, cap;
    key_index index;
    bool schema;
    uint64_t tensor_bytes; /* sum so far: data offsets must stay below 2^63 */
};

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

const void *ckpt__writer_tensor_data(const ckpt_writer *w, int64_t i) {
    if (!w || i < 0 || i >= w->count || w->entries[i].kind != CKPT_ENTRY_TENSOR) return NULL;
    return w->entries[i].data;
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

int ckpt_write_tensor(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                      const int64_t *shape, const void *data) {
    uint64_t nb = 0;
    int rc = ckpt_tensor_nbytes(dt, ndim, shape, &nb);
    if (rc) return ckpt__err_prefix(rc, "state dict: tensor '%s'", key ? key : "(null)");
    if (w && !w->schema && !data && nb)
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
    e->data = w->schema ? NULL : data;
    w->tensor_bytes += nb;
    w->count++;
    return CKPT_OK;
}

int ckpt_write_tensor_shard(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                            const int64_t *global_shape, const int64_t *offsets,
                            const int64_t *local_shape, const void *data) {
    const char *k = key ? key : "(null)";
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
    if (w && !w->schema && !data && cb)
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
    e->data = w->schema ? NULL : data;
    w->tensor_bytes += cb;
    w->count++;
    return CKPT_OK;
}

bool ckpt__writer_has_shards(const ckpt_writer *w) {
    for (int64_t i = 0; w && i < w->count; i++)
        if (w->entries[i].shard) return true;
    return false;
}

/* Whether a shard entry is written to this process's shard file. */
static bool shard_written(const entry *e) {
    return e->shard && !e->elsewhere && (e->cbytes > 0 || e->nbytes == 0);
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
        return CKPT_OK;
    }
    if (e->ndim > 0) {
        e->coff[0] = lo;
        e->cshape[0] = hi - lo;
    }
    e->cbytes = row_bytes * (uint64_t)(hi - lo);
    if (e->data) e->data = (const uint8_t *)e->data + row_bytes * (uint64_t)lo;
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
    if (e->kind != CKPT_ENTRY_TENSOR || !e->data || e->elsewhere) return 0;
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

uint64_t ckpt__writer_stage(ckpt_writer *w, uint8_t *dst) {
    uint64_t off = 0;
    for (int64_t i = 0; w && i < w->count; i++) {
        entry *e = &w->entries[i];
        uint64_t b = stage_size(e);
        if (!b) continue;
        memcpy(dst + off, e->data, (size_t)b);
        e->data = dst + off;
        off += (b + STAGE_ALIGN - 1) / STAGE_ALIGN * STAGE_ALIGN;
    }
    return off;
}

/* Whether a shard entry's chunk is the whole tensor. */
static bool shard_is_whole(const entry *e) {
    for (int d = 0; d < e->ndim; d++)
        if (e->coff[d] != 0 || e->cshape[d] != e->shape[d]) return false;
    return true;
}

int ckpt_write_i64(ckpt_writer *w, const char *key, int64_t v) {
    entry *e = NULL;
    CKPT_TRY(writer_add(w, key, CKPT_ENTRY_I64, &e));
    e->i64 = v;
    e->nbytes = 8;
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

/* The __metadata__["ckpt"] document for the writer's non-tensor entries. */
static int build_doc(const ckpt_writer *w, char **out) {
    *out = NULL;
    int rc = CKPT_OK;
    json_t *doc = json_object();
    json_t *arr = json_array();
    if (!doc || !arr || json_object_set_new(doc, "version", json_integer(CKPT_DOC_VERSION)) ||
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
} save_ctx;

/* What a save writes: a standalone file (sharded entries only if their chunk
 * is the whole tensor), a checkpoint's object file (no sharded entries), or
 * a checkpoint's shard file (only the sharded entries). */
typedef enum save_mode { SAVE_STANDALONE, SAVE_PLAIN, SAVE_SHARDS } save_mode;

static int fill_file(ckpt_ostream *s, void *ctx) {
    save_ctx *c = ctx;
    return ckpt__st_write(s, c->outs, c->nt, c->doc, c->res);
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
            c->outs[k] = (ckpt_st_out){e->key, e->dtype, e->ndim, e->cshape, e->data, e->cbytes};
            ckpt_chunk *ch = &c->chunks[k];
            ch->dtype = e->dtype;
            ch->ndim = e->ndim;
            memcpy(ch->global_shape, e->shape, sizeof ch->global_shape);
            memcpy(ch->offsets, e->coff, sizeof ch->offsets);
            memcpy(ch->shape, e->cshape, sizeof ch->shape);
        } else {
            c->outs[k] = (ckpt_st_out){e->key, e->dtype, e->ndim, e->shape, e->data, e->nbytes};
        }
        k++;
    }
    c->nt = nt;
    if (mode == SAVE_SHARDS) return CKPT_OK; /* shard files carry tensors only */
    char *doc = NULL;
    int rc = build_doc(w, &doc);
    if (rc) return ckpt__err_prefix(rc, "%s", path);
    c->doc = doc;
    return CKPT_OK;
}

static void save_release(save_ctx *c) {
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

static int write_new(ckpt_writer *w, const char *path, ckpt_file_digest *d, save_mode mode,
                     bool want128) {
    if (d) digest_clear(d);
    save_ctx c;
    int rc = save_prepare(w, path, &c, mode);
    uint64_t size = 0, xxh = 0;
    ckpt_ostream s;
    if (!rc) {
        rc = ckpt__ostream_open(&s, path);
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
    return write_new(w, path, d, SAVE_PLAIN, false);
}

int ckpt__writer_write_shards_new(ckpt_writer *w, const char *path, ckpt_file_digest *d) {
    return write_new(w, path, d, SAVE_SHARDS, false);
}

int ckpt__writer_write_new_ex(ckpt_writer *w, const char *path, bool shards, bool want128,
                              ckpt_file_digest *d) {
    return write_new(w, path, d, shards ? SAVE_SHARDS : SAVE_PLAIN, want128);
}

int ckpt__writer_hash128(ckpt_writer *w, const char *what, bool shards, uint64_t *size,
                         ckpt_h128 *h) {
    save_ctx c;
    int rc = save_prepare(w, what, &c, shards ? SAVE_SHARDS : SAVE_PLAIN);
    ckpt_ostream s;
    if (!rc) rc = ckpt__ostream_open_dry(&s, what);
    if (!rc) {
        rc = fill_file(&s, &c);
        if (rc) ckpt__ostream_abort(&s);
        else rc = ckpt__ostream_finish(&s, NULL, size);
        if (!rc) *h = s.h128;
    }
    save_release(&c);
    return rc;
}

/* ---- reader ------------------------------------------------------------- */

/* One saved chunk of a sharded key, in an attached shard file. */
typedef struct shard_chunk {
    ckpt_chunk c;
    const uint8_t *data; /* into the attached buffer (borrowed) */
    const char *file;    /* r->shard_files[...] */
} shard_chunk;

/* A sharded key: every chunk attached so far. */
typedef struct shard_key {
    char *key; /* owned; the entry's key points here */
    shard_chunk *chunks;
    int64_t n, cap;
} shard_key;

struct ckpt_reader {
    char *name;          /* for messages (owned) */
    int fd;              /* file readers: open for pread; -1 for memory */
    const uint8_t *mem;  /* memory readers: the buffer; file readers: the map once made */
    void *map;           /* mmap of the file (tensor views), or NULL */
    size_t map_len;
    uint64_t file_size;
    ckpt_st_header hdr;
    json_t *doc;         /* parsed __metadata__["ckpt"] (owned) or NULL */
    entry *entries;
    int64_t count, ecap;
    key_index index;
    shard_key *skeys;    /* sharded keys (ckpt__reader_attach_shard) */
    int64_t nskeys, skcap;
    char **shard_files;  /* names of the attached files (owned) */
    int64_t nshard_files, sfcap;
    ckpt_mapped *maps;   /* files the reader owns (ckpt__reader_adopt_map) */
    int64_t nmaps, mapcap;
    void **owned;        /* adapted readers: keys, strings, tensor copies (freed with r) */
    int64_t nowned, ownedcap;
    ckpt_reader **subs;  /* readers r borrows from and owns (ckpt__reader_adopt_reader) */
    int64_t nsubs, subcap;
    struct verify_stream *vs; /* a one-pass verified file reader (ckpt__reader_open_verified) */
};

/* A one-pass verified reader: the file's XXH3-64 computed over the bytes as
 * they land in the caller's buffers, in file order (the header and the
 * padding through a scratch piece); a tensor read out of that order is
 * checked against its own digest instead. */
typedef struct verify_stream {
    void *mem;             /* the allocation holding h (aligned) and scratch */
    XXH3_state_t *h;       /* the whole file, bytes [0, next) so far */
    XXH3_state_t *t;       /* one tensor read out of order */
    uint8_t *scratch;
    uint64_t next;
    uint64_t xxh3;         /* the manifest's digest of the file */
    const char *const *keys; /* the manifest's tensor keys and digests (borrowed) */
    const uint64_t *digests;
    int64_t n;
} verify_stream;

/* Pieces small enough to be hashed while still in the CPU cache. */
#define VERIFY_PIECE ((size_t)1 << 20)

void ckpt__reader_set_name(ckpt_reader *r, const char *name) {
    if (!r || !name) return;
    char *n = ckpt__strdup(name);
    if (!n) return; /* keep the old name: it only feeds messages */
    free(r->name);
    r->name = n;
}

void ckpt_reader_free(ckpt_reader *r) {
    if (!r) return;
    for (int64_t i = 0; i < r->count; i++) free(r->entries[i].bytes);
    free(r->entries);
    for (int64_t i = 0; i < r->nskeys; i++) {
        free(r->skeys[i].key);
        free(r->skeys[i].chunks);
    }
    free(r->skeys);
    for (int64_t i = 0; i < r->nshard_files; i++) free(r->shard_files[i]);
    free(r->shard_files);
    for (int64_t i = 0; i < r->nmaps; i++) ckpt__unmap(&r->maps[i]);
    free(r->maps);
    for (int64_t i = 0; i < r->nowned; i++) free(r->owned[i]);
    free(r->owned);
    for (int64_t i = 0; i < r->nsubs; i++) ckpt_reader_free(r->subs[i]);
    free(r->subs);
    key_index_free(&r->index);
    json_decref(r->doc);
    ckpt__st_header_free(&r->hdr);
    if (r->map) munmap(r->map, r->map_len);
    if (r->fd >= 0) close(r->fd);
    if (r->vs) free(r->vs->mem);
    free(r->vs);
    free(r->name);
    free(r);
}

static int reader_alloc(ckpt_reader **out, const char *name) {
    ckpt_reader *r = ckpt__calloc(1, sizeof *r);
    if (!r) return ckpt__err_nomem("reader");
    r->fd = -1;
    r->name = ckpt__strdup(name ? name : "(memory)");
    if (!r->name) {
        free(r);
        return ckpt__err_nomem("reader");
    }
    *out = r;
    return CKPT_OK;
}

static int reader_index_add(ckpt_reader *r, int64_t i) {
    int64_t prev = -1;
    int rc = key_index_put(&r->index, r->entries[i].key, i, &prev);
    if (rc == CKPT_ENOMEM) return ckpt__err_nomem("reader key index");
    if (rc == CKPT_EEXIST)
        return ckpt__err(CKPT_ECORRUPT, "%s: duplicate key '%s' (%s and %s)", r->name,
                         r->entries[i].key, kind_name(r->entries[prev].kind),
                         kind_name(r->entries[i].kind));
    return CKPT_OK;
}

static int doc_err(const ckpt_reader *r, const char *fmt, const char *a, const char *b) {
    char msg[1400];
    snprintf(msg, sizeof msg, fmt, a ? a : "", b ? b : "");
    return ckpt__err(CKPT_ECORRUPT, "%s: __metadata__ 'ckpt': %s", r->name, msg);
}

/* Parses one entry of the document into e (key/str views into the doc). */
static int parse_doc_entry(ckpt_reader *r, json_t *o, size_t idx, entry *e) {
    char at[32];
    snprintf(at, sizeof at, "%zu", idx);
    if (!json_is_object(o)) return doc_err(r, "entries[%s] is not an object", at, NULL);
    const char *f;
    json_t *fv;
    json_object_foreach(o, f, fv) {
        if (strcmp(f, "key") && strcmp(f, "type") && strcmp(f, "value"))
            return doc_err(r, "entries[%s]: unknown field '%s'", at, f);
    }
    json_t *jk = json_object_get(o, "key"), *jt = json_object_get(o, "type"),
           *jv = json_object_get(o, "value");
    if (!json_is_string(jk))
        return doc_err(r, "entries[%s]: key is missing or not a string", at, NULL);
    if (!json_is_string(jt))
        return doc_err(r, "entries[%s]: type is missing or not a string", at, NULL);
    if (!jv) return doc_err(r, "entries[%s]: value is missing", at, NULL);
    const char *key = json_string_value(jk);
    if (strlen(key) != json_string_length(jk) || ckpt__check_key(key, "entry") != CKPT_OK)
        return doc_err(r, "entries[%s]: invalid key '%s'", at, key);
    e->key = (char *)key;
    const char *type = json_string_value(jt);
    if (strcmp(type, "i64") == 0) {
        if (!json_is_integer(jv))
            return doc_err(r, "entry '%s': i64 value is not an integer", key, NULL);
        e->kind = CKPT_ENTRY_I64;
        e->i64 = (int64_t)json_integer_value(jv);
        e->nbytes = 8;
    } else if (strcmp(type, "f64") == 0) {
        e->kind = CKPT_ENTRY_F64;
        e->nbytes = 8;
        if (json_is_real(jv)) {
            e->f64 = json_real_value(jv);
        } else if (json_is_integer(jv)) {
            e->f64 = (double)json_integer_value(jv);
        } else if (json_is_string(jv)) {
            const char *s = json_string_value(jv);
            if (strcmp(s, "nan") == 0) e->f64 = NAN;
            else if (strcmp(s, "inf") == 0) e->f64 = INFINITY;
            else if (strcmp(s, "-inf") == 0) e->f64 = -INFINITY;
            else
                return doc_err(
                    r, "entry '%s': f64 value '%s' is not a number, \"nan\", \"inf\" or \"-inf\"",
                    key, s);
        } else {
            return doc_err(r, "entry '%s': f64 value is not a number", key, NULL);
        }
    } else if (strcmp(type, "str") == 0) {
        if (!json_is_string(jv))
            return doc_err(r, "entry '%s': str value is not a string", key, NULL);
        e->kind = CKPT_ENTRY_STR;
        e->str = (char *)json_string_value(jv);
        e->nbytes = json_string_length(jv);
        if (strlen(e->str) != e->nbytes)
            return doc_err(r, "entry '%s': str value contains a NUL character", key, NULL);
    } else if (strcmp(type, "bytes") == 0) {
        if (!json_is_string(jv))
            return doc_err(r, "entry '%s': bytes value is not a string", key, NULL);
        e->kind = CKPT_ENTRY_BYTES;
        size_t n = 0;
        int rc = ckpt__base64_decode(json_string_value(jv), json_string_length(jv), &e->bytes, &n);
        if (rc == CKPT_ENOMEM) return rc;
        if (rc) return ckpt__err_prefix(rc, "%s: __metadata__ 'ckpt': entry '%s'", r->name, key);
        e->nbytes = n;
    } else {
        return doc_err(r, "entry '%s': unknown type '%s'", key, type);
    }
    return CKPT_OK;
}

static int parse_doc(ckpt_reader *r, const char *text, json_t **doc_out, json_t **entries_out) {
    json_error_t jerr;
    json_t *doc = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!doc)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: __metadata__ 'ckpt' is not valid JSON: %s (at byte %d)", r->name,
                         jerr.text, jerr.position);
    *doc_out = doc;
    if (!json_is_object(doc)) return doc_err(r, "not a JSON object", NULL, NULL);
    const char *f;
    json_t *fv;
    json_object_foreach(doc, f, fv) {
        if (strcmp(f, "version") && strcmp(f, "entries"))
            return doc_err(r, "unknown field '%s'", f, NULL);
    }
    json_t *ver = json_object_get(doc, "version");
    if (!json_is_integer(ver))
        return doc_err(r, "version is missing or not an integer", NULL, NULL);
    json_int_t v = json_integer_value(ver);
    if (v > CKPT_DOC_VERSION)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: __metadata__ 'ckpt': version %lld is newer than this library "
                         "supports (%d)",
                         r->name, (long long)v, CKPT_DOC_VERSION);
    if (v < 1) return doc_err(r, "version is not a positive integer", NULL, NULL);
    json_t *arr = json_object_get(doc, "entries");
    if (!json_is_array(arr)) return doc_err(r, "entries is missing or not an array", NULL, NULL);
    *entries_out = arr;
    return CKPT_OK;
}

/* Builds the entry list from the parsed header (+ document). */
static int reader_build(ckpt_reader *r) {
    json_t *arr = NULL;
    size_t nscalar = 0;
    if (r->hdr.metadata) {
        json_t *jdoc = json_object_get(r->hdr.metadata, "ckpt");
        if (jdoc) {
            CKPT_TRY(parse_doc(r, json_string_value(jdoc), &r->doc, &arr));
            nscalar = json_array_size(arr);
        }
    }
    size_t total = (size_t)r->hdr.ntensors + nscalar;
    r->entries = ckpt__calloc(total ? total : 1, sizeof *r->entries);
    if (!r->entries) return ckpt__err_nomem("reader entries");
    r->ecap = total ? (int64_t)total : 1;
    for (int64_t i = 0; i < r->hdr.ntensors; i++) {
        const ckpt_st_tensor *t = &r->hdr.tensors[i];
        entry *e = &r->entries[r->count];
        e->key = (char *)t->name;
        e->kind = CKPT_ENTRY_TENSOR;
        e->dtype = t->dtype;
        e->ndim = t->ndim;
        memcpy(e->shape, t->shape, sizeof e->shape);
        e->nbytes = t->end - t->begin;
        e->offset = r->hdr.data_start + t->begin;
        r->count++;
        CKPT_TRY(reader_index_add(r, r->count - 1));
    }
    for (size_t i = 0; i < nscalar; i++) {
        entry *e = &r->entries[r->count];
        int rc = parse_doc_entry(r, json_array_get(arr, i), i, e);
        r->count++; /* counted even on failure so free() releases e->bytes */
        if (rc) return rc;
        CKPT_TRY(reader_index_add(r, r->count - 1));
    }
    return CKPT_OK;
}

int ckpt_reader_open_memory(ckpt_reader **out, const void *buf, size_t len, const char *name) {
    if (!out) return ckpt__err(CKPT_EINVAL, "reader: out is NULL");
    *out = NULL;
    if (!buf && len) return ckpt__err(CKPT_EINVAL, "reader: buffer is NULL");
    ckpt_reader *r = NULL;
    CKPT_TRY(reader_alloc(&r, name));
    r->mem = buf;
    r->file_size = len;
    uint64_t n = 0;
    int rc = ckpt__st_header_len(buf, len, r->name, &n);
    if (!rc) rc = ckpt__st_parse((const uint8_t *)buf + 8, n, len, r->name, &r->hdr);
    if (!rc) rc = reader_build(r);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    *out = r;
    return CKPT_OK;
}

/* Reads exactly n bytes at off; a short read means the file shrank. */
static int pread_all(const ckpt_reader *r, void *dst, uint64_t n, uint64_t off) {
    uint8_t *p = dst;
    while (n > 0) {
        /* 64 MiB calls: measured faster than one huge call (the copy
         * stays ahead of the kernel's page-cache walk). */
        size_t piece = n > ((size_t)64 << 20) ? ((size_t)64 << 20) : (size_t)n;
        ssize_t got = ckpt__os_pread(r->fd, p, piece, off);
        if (got < 0) return ckpt__err_os(errno, "%s: read at offset %" PRIu64, r->name, off);
        if (got == 0)
            return ckpt__err(CKPT_ECORRUPT, "%s: file ended at offset %" PRIu64 " while reading",
                             r->name, off);
        p += got;
        off += (uint64_t)got;
        n -= (uint64_t)got;
    }
    return CKPT_OK;
}

static int reader_open_file(ckpt_reader **out, const char *path, const char *name,
                            verify_stream *vs);

int ckpt_reader_open(ckpt_reader **out, const char *path) {
    if (!out) return ckpt__err(CKPT_EINVAL, "reader: out is NULL");
    *out = NULL;
    if (!path) return ckpt__err(CKPT_EINVAL, "reader: path is NULL");
    return reader_open_file(out, path, path, NULL);
}

int ckpt__reader_open_verified(ckpt_reader **out, const char *path, const char *name,
                               uint64_t xxh3, const char *const *keys, const uint64_t *digests,
                               int64_t n) {
    *out = NULL;
    verify_stream *vs = ckpt__calloc(1, sizeof *vs);
    if (!vs) return ckpt__err_nomem("verified reader");
    size_t align = _Alignof(XXH3_state_t) > 64 ? _Alignof(XXH3_state_t) : 64;
    vs->mem = ckpt__malloc(2 * sizeof(XXH3_state_t) + align + VERIFY_PIECE);
    if (!vs->mem) {
        free(vs);
        return ckpt__err_nomem("verified reader");
    }
    uintptr_t a = ((uintptr_t)vs->mem + align - 1) & ~(uintptr_t)(align - 1);
    vs->h = (XXH3_state_t *)a;
    vs->t = vs->h + 1;
    vs->scratch = (uint8_t *)(vs->t + 1);
    XXH3_INITSTATE(vs->h);
    XXH3_INITSTATE(vs->t);
    XXH3_64bits_reset(vs->h);
    vs->xxh3 = xxh3;
    vs->keys = keys;
    vs->digests = digests;
    vs->n = n;
    int rc = reader_open_file(out, path, name, vs);
    if (rc < 0) {
        free(vs->mem);
        free(vs);
    }
    return rc;
}

static int reader_open_file(ckpt_reader **out, const char *path, const char *name,
                            verify_stream *vs) {
    ckpt_reader *r = NULL;
    CKPT_TRY(reader_alloc(&r, name));
    int rc = CKPT_OK;
    uint8_t *hbuf = NULL;
    struct stat st;
    r->fd = ckpt__open_read(path, path, false, &st);
    if (r->fd < 0) {
        rc = r->fd;
        goto out;
    }
    r->file_size = (uint64_t)st.st_size;
    uint8_t prefix[8] = {0};
    if (r->file_size >= 8) {
        rc = pread_all(r, prefix, 8, 0);
        if (rc) goto out;
    }
    uint64_t n = 0;
    rc = ckpt__st_header_len(prefix, r->file_size, r->name, &n);
    if (rc) goto out;
    /* Only the header is read now: tensor bytes go straight from the file
     * into the caller's buffers later. */
    hbuf = ckpt__malloc(n ? (size_t)n : 1);
    if (!hbuf) {
        rc = ckpt__err_nomem("safetensors header");
        goto out;
    }
    rc = pread_all(r, hbuf, n, 8);
    if (!rc && vs) {
        /* The header parsed is the header hashed. */
        XXH3_64bits_update(vs->h, prefix, 8);
        XXH3_64bits_update(vs->h, hbuf, (size_t)n);
        vs->next = 8 + n;
    }
    if (!rc) rc = ckpt__st_parse(hbuf, n, r->file_size, r->name, &r->hdr);
    if (!rc) rc = reader_build(r);
out:
    free(hbuf);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    r->vs = vs;
    *out = r;
    return CKPT_OK;
}

int64_t ckpt_reader_count(const ckpt_reader *r) { return r ? r->count : 0; }

int ckpt_reader_entry(const ckpt_reader *r, int64_t i, ckpt_entry_info *info) {
    if (!r || !info) return ckpt__err(CKPT_EINVAL, "reader entry: NULL argument");
    if (i < 0 || i >= r->count)
        return ckpt__err(CKPT_EINVAL, "%s: entry index %" PRId64 " outside 0..%" PRId64, r->name, i,
                         r->count - 1);
    entry_info(&r->entries[i], info);
    return CKPT_OK;
}

static const entry *reader_get(const ckpt_reader *r, const char *key) {
    int64_t i = key_index_get(&r->index, key);
    return i < 0 ? NULL : &r->entries[i];
}

int ckpt_reader_find(const ckpt_reader *r, const char *key, ckpt_entry_info *info) {
    if (!r || !key) return ckpt__err(CKPT_EINVAL, "reader find: NULL argument");
    const entry *e = reader_get(r, key);
    if (!e) return ckpt__err(CKPT_ENOENT, "%s: no key '%s'", r->name, key);
    if (info) entry_info(e, info);
    return CKPT_OK;
}

int64_t ckpt__reader_index(const ckpt_reader *r, const char *key) {
    return r && key ? key_index_get(&r->index, key) : -1;
}

bool ckpt__reader_has(const ckpt_reader *r, const char *key, ckpt_entry_info *info) {
    const entry *e = r && key ? reader_get(r, key) : NULL;
    if (e && info) entry_info(e, info);
    return e != NULL;
}

/* Hashes the file's bytes [v->next, end) into the whole-file digest
 * through the scratch piece: the header's end, padding, tensors nobody
 * read (yet), the tail. */
static int verify_skip_to(ckpt_reader *r, uint64_t end) {
    verify_stream *v = r->vs;
    while (v->next < end) {
        size_t k = end - v->next < VERIFY_PIECE ? (size_t)(end - v->next) : VERIFY_PIECE;
        CKPT_TRY(pread_all(r, v->scratch, k, v->next));
        XXH3_64bits_update(v->h, v->scratch, k);
        v->next += k;
    }
    return CKPT_OK;
}

/* At most this many bytes between the end of what the stream hashed and
 * the next tensor read are hashed through the scratch piece to keep the
 * stream going (padding, a small tensor nobody reads). A read further ahead
 * (a check that reads the small entries of a file first, say) is checked
 * against its own digest instead and leaves the stream where it is, so the
 * large tensors it jumps over are still read once, into their buffers. */
#define VERIFY_GAP_MAX ((uint64_t)64 << 10)

/* A tensor's bytes from the file into dst, hashed piece by piece right
 * after each piece lands there (so the bytes hashed are the bytes kept):
 * into the whole-file digest when it comes next in file order, else
 * against the tensor's own digest from the manifest. */
static int verified_read(ckpt_reader *r, const entry *e, const char *key, uint8_t *dst) {
    verify_stream *v = r->vs;
    bool in_order = e->offset >= v->next && e->offset - v->next <= VERIFY_GAP_MAX;
    if (in_order) CKPT_TRY(verify_skip_to(r, e->offset));
    else XXH3_64bits_reset(v->t);
    for (uint64_t off = 0; off < e->nbytes;) {
        size_t k = e->nbytes - off < VERIFY_PIECE ? (size_t)(e->nbytes - off) : VERIFY_PIECE;
        int rc = pread_all(r, dst + off, k, e->offset + off);
        if (rc) return ckpt__err_prefix(rc, "tensor '%s'", key);
        XXH3_64bits_update(in_order ? v->h : v->t, dst + off, k);
        off += k;
    }
    if (in_order) {
        v->next = e->offset + e->nbytes;
        return CKPT_OK;
    }
    for (int64_t i = 0; i < v->n; i++) {
        if (strcmp(v->keys[i], e->key) != 0) continue;
        if (XXH3_64bits_digest(v->t) != v->digests[i])
            return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': checksum mismatch", r->name, key);
        return CKPT_OK;
    }
    return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': the manifest records no checksum for it",
                     r->name, key);
}

int ckpt__reader_verify_finish(ckpt_reader *r) {
    if (!r || !r->vs) return CKPT_OK;
    CKPT_TRY(verify_skip_to(r, r->file_size));
    if (XXH3_64bits_digest(r->vs->h) != r->vs->xxh3)
        return ckpt__err(CKPT_ECORRUPT, "%s: checksum mismatch", r->name);
    return CKPT_OK;
}

static int find_tensor(const ckpt_reader *r, const char *key, const entry **out) {
    if (!r || !key) return ckpt__err(CKPT_EINVAL, "read tensor: NULL argument");
    const entry *e = reader_get(r, key);
    if (!e) return ckpt__err(CKPT_ENOENT, "%s: no tensor '%s'", r->name, key);
    if (e->kind != CKPT_ENTRY_TENSOR)
        return ckpt__err(CKPT_ENOENT, "%s: key '%s' is a %s, not a tensor", r->name, key,
                         kind_name(e->kind));
    *out = e;
    return CKPT_OK;
}

/* Maps a file reader's file, once: loads that copy into caller buffers
 * never need it. */
static int reader_map(ckpt_reader *r) {
    if (!r->mem && r->fd >= 0 && r->file_size > 0) {
        void *p = ckpt__os_map_read(r->fd, (size_t)r->file_size);
        if (p == MAP_FAILED) return ckpt__err_os(errno, "%s: mmap", r->name);
        r->map = p;
        r->map_len = (size_t)r->file_size;
        r->mem = p;
    }
    return CKPT_OK;
}

/* The chunks of sharded key k must tile the tensor exactly. Checked at
 * every use rather than at attach time: only once every shard file is
 * attached is the set complete. */
static int shard_key_check(const ckpt_reader *r, const shard_key *k) {
    ckpt_chunk_ref *v = ckpt__calloc((size_t)(k->n ? k->n : 1), sizeof *v);
    if (!v) return ckpt__err_nomem("shard check");
    for (int64_t i = 0; i < k->n; i++) v[i] = (ckpt_chunk_ref){&k->chunks[i].c, k->chunks[i].file};
    int rc = ckpt__chunks_cover(v, k->n, CKPT_ECORRUPT, r->name, k->key);
    free(v);
    return rc;
}

static int reader_own(ckpt_reader *r, void *p);

/* An entry converted as it is read, made a plain one (converted once into a
 * buffer r owns) for the reads that need its bytes in place: views and
 * slices. */
static int materialize(ckpt_reader *r, const entry *ce) {
    entry *e = (entry *)ce; /* r's own entry */
    if (!e->conv_from) return CKPT_OK;
    uint8_t *buf = ckpt__malloc(e->nbytes ? (size_t)e->nbytes : 1);
    CKPT_TRY(reader_own(r, buf));
    uint64_t n = e->nbytes / (uint64_t)(ckpt_dtype_bits(e->dtype) / 8);
    CKPT_TRY(ckpt_dtype_convert(e->conv_from, e->data, e->dtype, buf, n));
    e->data = buf;
    e->conv_from = CKPT_DTYPE_INVALID;
    return CKPT_OK;
}

int ckpt_reader_tensor_view(ckpt_reader *r, const char *key, const void **data,
                            ckpt_entry_info *info) {
    const entry *e = NULL;
    CKPT_TRY(find_tensor(r, key, &e));
    CKPT_TRY(materialize(r, e));
    if (!data) return ckpt__err(CKPT_EINVAL, "tensor view: data is NULL");
    static const uint8_t empty = 0;
    if (e->sk) {
        /* A view needs the tensor in one piece: one chunk that is all of it. */
        const shard_key *k = &r->skeys[e->sk - 1];
        CKPT_TRY(shard_key_check(r, k));
        const shard_chunk *whole = NULL;
        for (int64_t i = 0; i < k->n; i++) {
            bool all = true;
            for (int d = 0; all && d < e->ndim; d++) all = k->chunks[i].c.shape[d] == e->shape[d];
            if (all) whole = &k->chunks[i];
        }
        if (!whole && e->nbytes) {
            /* Saved in several chunks: assembled once into memory the
             * reader owns, so a view still works (at the cost of a copy). */
            if (e->nbytes > (uint64_t)SIZE_MAX) return ckpt__err_nomem("tensor view");
            uint8_t *buf = ckpt__malloc((size_t)e->nbytes);
            CKPT_TRY(reader_own(r, buf));
            int64_t zero[CKPT_MAX_NDIM] = {0};
            CKPT_TRY(ckpt_read_tensor_shard(r, key, e->dtype, e->ndim, e->shape, zero, e->shape,
                                            buf));
            *data = buf;
            if (info) entry_info(e, info);
            return CKPT_OK;
        }
        *data = whole && whole->data ? (const void *)whole->data : (const void *)&empty;
        if (info) entry_info(e, info);
        return CKPT_OK;
    }
    if (e->data) {
        *data = e->data;
        if (info) entry_info(e, info);
        return CKPT_OK;
    }
    if (r->vs && e->nbytes) {
        /* Never a look through a mapping: the bytes, verified, into memory
         * the reader owns, which later reads of the key use too. */
        if (e->nbytes > (uint64_t)SIZE_MAX) return ckpt__err_nomem("tensor view");
        uint8_t *buf = ckpt__malloc((size_t)e->nbytes);
        CKPT_TRY(reader_own(r, buf));
        CKPT_TRY(verified_read(r, e, key, buf));
        ((entry *)e)->data = buf; /* r's own entry */
        *data = buf;
        if (info) entry_info(e, info);
        return CKPT_OK;
    }
    CKPT_TRY(reader_map(r));
    *data = r->mem ? (const void *)(r->mem + e->offset) : (const void *)&empty;
    if (info) entry_info(e, info);
    return CKPT_OK;
}

int ckpt_read_tensor_shard(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                           const int64_t *global_shape, const int64_t *offsets,
                           const int64_t *local_shape, void *dst) {
    const entry *e = NULL;
    CKPT_TRY(find_tensor(r, key, &e));
    char a[200], b[200];
    if (ndim < 0 || ndim > CKPT_MAX_NDIM ||
        (ndim > 0 && (!global_shape || !offsets || !local_shape)))
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': invalid slice asked (ndim %d)", r->name, key,
                         ndim);
    if (dt != e->dtype)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': dtype %s in file, %s asked", r->name, key,
                         ckpt_dtype_name(e->dtype),
                         ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "(invalid)");
    bool same = ndim == e->ndim;
    for (int d = 0; same && d < ndim; d++) same = global_shape[d] == e->shape[d];
    if (!same)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': global shape %s in file, %s asked", r->name,
                         key, ckpt__shape_str(a, sizeof a, e->ndim, e->shape),
                         ckpt__shape_str(b, sizeof b, ndim, global_shape));
    ckpt_chunk q;
    memset(&q, 0, sizeof q);
    q.dtype = dt;
    q.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        q.global_shape[d] = global_shape[d];
        q.offsets[d] = offsets[d];
        q.shape[d] = local_shape[d];
    }
    uint64_t qbytes = 0;
    int rc = ckpt__chunk_check(&q, CKPT_EINVAL, r->name, key, &qbytes);
    if (rc) return rc;
    if (qbytes == 0) return CKPT_OK;
    if (!dst) return ckpt__err(CKPT_EINVAL, "%s: key '%s': destination is NULL", r->name, key);
    if (!e->sk) {
        bool whole = true;
        for (int d = 0; whole && d < ndim; d++)
            whole = offsets[d] == 0 && local_shape[d] == e->shape[d];
        if (whole) return ckpt_read_tensor(r, key, dt, ndim, global_shape, dst);
        CKPT_TRY(materialize(r, e));
        const uint8_t *src = e->data;
        if (!src) {
            CKPT_TRY(reader_map(r));
            src = r->mem + e->offset;
        }
        static const int64_t zero[CKPT_MAX_NDIM];
        rc = ckpt__box_copy(dt, ndim, zero, e->shape, src, offsets, local_shape, dst);
        if (rc) return ckpt__err_prefix(rc, "%s: key '%s'", r->name, key);
        return CKPT_OK;
    }
    const shard_key *k = &r->skeys[e->sk - 1];
    CKPT_TRY(shard_key_check(r, k));
    for (int64_t i = 0; i < k->n; i++) {
        const shard_chunk *c = &k->chunks[i];
        if (!c->data) continue; /* an empty chunk */
        rc = ckpt__box_copy(dt, ndim, c->c.offsets, c->c.shape, c->data, offsets, local_shape, dst);
        if (rc) return ckpt__err_prefix(rc, "%s: key '%s'", c->file, key);
    }
    return CKPT_OK;
}

static int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return CKPT_OK;
    int64_t nc = *cap ? *cap : 4;
    while (nc < need) nc *= 2;
    void *np = ckpt__realloc(*p, (size_t)nc * elem);
    if (!np) return ckpt__err_nomem("reader shards");
    *p = np;
    *cap = nc;
    return CKPT_OK;
}

int ckpt__reader_adopt_map(ckpt_reader *r, ckpt_mapped *m) {
    CKPT_TRY(grow((void **)&r->maps, &r->mapcap, r->nmaps + 1, sizeof *r->maps));
    r->maps[r->nmaps++] = *m;
    memset(m, 0, sizeof *m);
    return CKPT_OK;
}

int ckpt__reader_new_empty(ckpt_reader **out, const char *name) {
    if (!out) return ckpt__err(CKPT_EINVAL, "reader: out is NULL");
    *out = NULL;
    ckpt_reader *r = NULL;
    CKPT_TRY(reader_alloc(&r, name));
    r->entries = ckpt__calloc(1, sizeof *r->entries);
    if (!r->entries) {
        ckpt_reader_free(r);
        return ckpt__err_nomem("reader entries");
    }
    r->ecap = 1;
    *out = r;
    return CKPT_OK;
}

/* Finds the tensor named key among a parsed header's tensors (linear: shard
 * files hold a handful of tensors, and the index is built per call). */
static int attach_index(const ckpt_st_header *h, key_index *ix) {
    for (int64_t i = 0; i < h->ntensors; i++) {
        int rc = key_index_put(ix, h->tensors[i].name, i, NULL);
        if (rc == CKPT_ENOMEM) return ckpt__err_nomem("shard attach");
        /* duplicates were rejected by the parser */
    }
    return CKPT_OK;
}


int ckpt__reader_attach_shard(ckpt_reader *r, const void *buf, size_t len, const char *name,
                              const char *const *keys, const ckpt_chunk *chunks, int64_t n) {
    if (!r || (!buf && len) || (n > 0 && (!keys || !chunks)) || n < 0)
        return ckpt__err(CKPT_EINVAL, "attach shard: invalid argument");
    if (!name) name = "(shard)";
    char a[200], b[200];
    ckpt_st_header h;
    memset(&h, 0, sizeof h);
    key_index ix;
    memset(&ix, 0, sizeof ix);
    int64_t *where = NULL;
    char *fname = NULL;
    uint64_t hl = 0;
    int rc = ckpt__st_header_len(buf, len, name, &hl);
    if (!rc) rc = ckpt__st_parse((const uint8_t *)buf + 8, hl, len, name, &h);
    if (!rc) rc = attach_index(&h, &ix);
    if (rc) goto out;
    if (h.ntensors != n) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %" PRId64 " tensors in the file, %" PRId64
                       " chunks listed for it",
                       name, h.ntensors, n);
        goto out;
    }
    where = ckpt__calloc((size_t)(n ? n : 1), sizeof *where);
    fname = ckpt__strdup(name);
    if (!where || !fname) {
        rc = ckpt__err_nomem("shard attach");
        goto out;
    }
    /* Check everything first, so a failure leaves r as it was. */
    for (int64_t i = 0; i < n && !rc; i++) {
        const char *key = keys[i];
        if (!key || ckpt__check_key(key, name) != CKPT_OK) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: chunk %" PRId64 " has an invalid key", name, i);
            break;
        }
        rc = ckpt__chunk_check(&chunks[i], CKPT_ECORRUPT, name, key, NULL);
        if (rc) break;
        int64_t t = key_index_get(&ix, key);
        if (t < 0) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%s' is not in the file", name, key);
            break;
        }
        const ckpt_st_tensor *ft = &h.tensors[t];
        bool same = ft->dtype == chunks[i].dtype && ft->ndim == chunks[i].ndim;
        for (int d = 0; same && d < ft->ndim; d++) same = ft->shape[d] == chunks[i].shape[d];
        if (!same) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%s': %s %s in the file, %s %s listed",
                           name, key, ckpt_dtype_name(ft->dtype),
                           ckpt__shape_str(a, sizeof a, ft->ndim, ft->shape),
                           ckpt_dtype_name(chunks[i].dtype),
                           ckpt__shape_str(b, sizeof b, chunks[i].ndim, chunks[i].shape));
            break;
        }
        if (where[t]) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%s' is listed twice", name, key);
            break;
        }
        where[t] = i + 1;
        const entry *e = reader_get(r, key);
        if (e && !e->sk) {
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: '%s' is both a sharded tensor and a plain entry of %s", name, key,
                           r->name);
            break;
        }
        if (e) {
            const ckpt_chunk *c0 = &r->skeys[e->sk - 1].chunks[0].c;
            bool agree = c0->dtype == chunks[i].dtype && c0->ndim == chunks[i].ndim;
            for (int d = 0; agree && d < c0->ndim; d++)
                agree = c0->global_shape[d] == chunks[i].global_shape[d];
            if (!agree) {
                rc = ckpt__err(CKPT_ECORRUPT,
                               "%s: chunk of '%s' is of a %s %s tensor, %s says %s %s", name, key,
                               ckpt_dtype_name(chunks[i].dtype),
                               ckpt__shape_str(a, sizeof a, chunks[i].ndim, chunks[i].global_shape),
                               r->skeys[e->sk - 1].chunks[0].file, ckpt_dtype_name(c0->dtype),
                               ckpt__shape_str(b, sizeof b, c0->ndim, c0->global_shape));
                break;
            }
        }
    }
    if (rc) goto out;
    /* Reserve room, then apply (nothing can fail after this). */
    rc = grow((void **)&r->shard_files, &r->sfcap, r->nshard_files + 1, sizeof *r->shard_files);
    if (!rc) rc = grow((void **)&r->entries, &r->ecap, r->count + n, sizeof *r->entries);
    if (!rc) rc = grow((void **)&r->skeys, &r->skcap, r->nskeys + n, sizeof *r->skeys);
    if (rc) goto out;
    r->shard_files[r->nshard_files++] = fname;
    for (int64_t i = 0; i < n; i++) {
        const ckpt_st_tensor *ft = &h.tensors[key_index_get(&ix, keys[i])];
        const entry *e = reader_get(r, keys[i]);
        shard_key *k;
        if (e) {
            k = &r->skeys[e->sk - 1];
        } else {
            k = &r->skeys[r->nskeys];
            memset(k, 0, sizeof *k);
            k->key = ckpt__strdup(keys[i]);
            if (!k->key) {
                rc = ckpt__err_nomem("shard attach");
                goto out_applied;
            }
            entry *ne = &r->entries[r->count];
            memset(ne, 0, sizeof *ne);
            ne->key = k->key;
            ne->kind = CKPT_ENTRY_TENSOR;
            ne->dtype = chunks[i].dtype;
            ne->ndim = chunks[i].ndim;
            memcpy(ne->shape, chunks[i].global_shape, sizeof ne->shape);
            (void)ckpt_tensor_nbytes(ne->dtype, ne->ndim, ne->shape, &ne->nbytes);
            ne->sk = r->nskeys + 1;
            r->nskeys++;
            if (key_index_put(&r->index, k->key, r->count, NULL) != CKPT_OK) {
                rc = ckpt__err_nomem("shard attach");
                goto out_applied;
            }
            r->count++;
        }
        rc = grow((void **)&k->chunks, &k->cap, k->n + 1, sizeof *k->chunks);
        if (rc) goto out_applied;
        shard_chunk *sc = &k->chunks[k->n++];
        sc->c = chunks[i];
        sc->data = ft->end > ft->begin ? (const uint8_t *)buf + h.data_start + ft->begin : NULL;
        sc->file = fname;
    }
    fname = NULL;
    goto out;
out_applied:
    /* Only an allocation failed; r holds some of the file's chunks: the
     * caller frees it (documented). */
    fname = NULL;
out:
    free(fname);
    free(where);
    key_index_free(&ix);
    ckpt__st_header_free(&h);
    return rc;
}

int ckpt_read_tensor(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                     const int64_t *shape, void *dst) {
    const entry *e = NULL;
    CKPT_TRY(find_tensor(r, key, &e));
    if (e->sk) {
        /* The whole of a sharded tensor: assembled from its chunks. */
        static const int64_t zero[CKPT_MAX_NDIM];
        return ckpt_read_tensor_shard(r, key, dt, ndim, shape, zero, shape, dst);
    }
    char a[200], b[200];
    if (dt != e->dtype)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': dtype %s in file, %s asked", r->name, key,
                         ckpt_dtype_name(e->dtype),
                         ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "(invalid)");
    bool same = ndim == e->ndim && (ndim == 0 || shape);
    for (int i = 0; same && i < ndim; i++) same = shape[i] == e->shape[i];
    if (!same) {
        if (ndim < 0 || ndim > CKPT_MAX_NDIM || (ndim > 0 && !shape))
            return ckpt__err(CKPT_EINVAL, "%s: key '%s': invalid shape asked (ndim %d)", r->name,
                             key, ndim);
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': shape %s in file, %s asked", r->name, key,
                         ckpt__shape_str(a, sizeof a, e->ndim, e->shape),
                         ckpt__shape_str(b, sizeof b, ndim, shape));
    }
    if (e->nbytes == 0) return CKPT_OK;
    if (!dst) return ckpt__err(CKPT_EINVAL, "%s: key '%s': destination is NULL", r->name, key);
    if (e->data && e->conv_from) { /* converted straight into dst: no copy in between */
        uint64_t n = e->nbytes / (uint64_t)(ckpt_dtype_bits(e->dtype) / 8);
        return ckpt_dtype_convert(e->conv_from, e->data, e->dtype, dst, n);
    }
    if (e->data) { /* an adapted reader's entry */
        memcpy(dst, e->data, (size_t)e->nbytes);
        return CKPT_OK;
    }
    if (r->vs) return verified_read(r, e, key, dst);
    if (r->mem) {
        memcpy(dst, r->mem + e->offset, (size_t)e->nbytes);
        return CKPT_OK;
    }
    int rc = pread_all(r, dst, e->nbytes, e->offset);
    if (rc) return ckpt__err_prefix(rc, "tensor '%s'", key);
    return CKPT_OK;
}

static int find_scalar(const ckpt_reader *r, const char *key, ckpt_entry_kind kind,
                       const entry **out) {
    if (!r || !key) return ckpt__err(CKPT_EINVAL, "read %s: NULL argument", kind_name(kind));
    const entry *e = reader_get(r, key);
    if (!e) return ckpt__err(CKPT_ENOENT, "%s: no key '%s'", r->name, key);
    if (e->kind != kind)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': %s in file, %s asked", r->name, key,
                         kind_name(e->kind), kind_name(kind));
    *out = e;
    return CKPT_OK;
}

int ckpt_read_i64(ckpt_reader *r, const char *key, int64_t *v) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_I64, &e));
    if (v) *v = e->i64;
    return CKPT_OK;
}

int ckpt_read_f64(ckpt_reader *r, const char *key, double *v) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_F64, &e));
    if (v) *v = e->f64;
    return CKPT_OK;
}

int ckpt_read_str(ckpt_reader *r, const char *key, char *buf, size_t cap) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_STR, &e));
    if (!buf || cap < e->nbytes + 1)
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': string of %" PRIu64 " bytes needs %" PRIu64
                         " bytes of buffer, %zu given",
                         r->name, key, e->nbytes, e->nbytes + 1, buf ? cap : 0);
    memcpy(buf, e->str, (size_t)e->nbytes + 1);
    return CKPT_OK;
}

int ckpt_read_bytes(ckpt_reader *r, const char *key, void *buf, size_t cap, size_t *n) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_BYTES, &e));
    if (n) *n = (size_t)e->nbytes;
    if (e->nbytes > cap || (!buf && e->nbytes))
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': %" PRIu64 " bytes, buffer holds %zu", r->name,
                         key, e->nbytes, buf ? cap : 0);
    if (e->nbytes) memcpy(buf, e->bytes, (size_t)e->nbytes);
    return CKPT_OK;
}

/* ---- adapted readers (ckpt_load_state_ex) ------------------------------- */

int ckpt__reader_new_adapted(ckpt_reader **out, const char *name) {
    return ckpt__reader_new_empty(out, name);
}

int ckpt__reader_adopt_reader(ckpt_reader *r, ckpt_reader *sub) {
    CKPT_TRY(grow((void **)&r->subs, &r->subcap, r->nsubs + 1, sizeof *r->subs));
    r->subs[r->nsubs++] = sub;
    return CKPT_OK;
}

/* A new entry with s's kind, dtype, shape and size, nothing else. */
static entry entry_header(const entry *s) {
    entry e;
    memset(&e, 0, sizeof e);
    e.kind = s->kind;
    e.dtype = s->dtype;
    e.ndim = s->ndim;
    memcpy(e.shape, s->shape, sizeof e.shape);
    e.nbytes = s->nbytes;
    return e;
}

/* r keeps p (freed with r); p is freed here if that fails. */
static int reader_own(ckpt_reader *r, void *p) {
    if (!p) return ckpt__err_nomem("adapted reader");
    if (grow((void **)&r->owned, &r->ownedcap, r->nowned + 1, sizeof *r->owned)) {
        free(p);
        return ckpt__err_nomem("adapted reader");
    }
    r->owned[r->nowned++] = p;
    return CKPT_OK;
}

static char *reader_own_strdup(ckpt_reader *r, const char *s, size_t n) {
    /* Room first, so that nothing is freed on the way (the release build's
     * use-after-free analysis cannot follow a free on a failure path). */
    if (grow((void **)&r->owned, &r->ownedcap, r->nowned + 1, sizeof *r->owned)) {
        ckpt__err_nomem("adapted reader");
        return NULL;
    }
    char *p = ckpt__malloc(n + 1);
    if (!p) {
        ckpt__err_nomem("adapted reader");
        return NULL;
    }
    memcpy(p, s, n);
    p[n] = '\0';
    r->owned[r->nowned++] = p;
    return p;
}

/* Appends *e (key already owned by r) and indexes it. On failure e->bytes
 * is freed (everything else r owns already). */
static int adapted_append(ckpt_reader *r, entry *e) {
    int rc = grow((void **)&r->entries, &r->ecap, r->count + 1, sizeof *r->entries);
    if (rc) {
        free(e->bytes);
        return rc;
    }
    r->entries[r->count] = *e;
    rc = reader_index_add(r, r->count);
    if (rc) {
        free(e->bytes);
        memset(&r->entries[r->count], 0, sizeof *r->entries);
        return rc;
    }
    r->count++;
    return CKPT_OK;
}

static int adapted_scalar(ckpt_reader *r, entry *e, const entry *s) {
    e->i64 = s->i64;
    e->f64 = s->f64;
    if (s->kind == CKPT_ENTRY_STR) {
        if (!(e->str = reader_own_strdup(r, s->str ? s->str : "", (size_t)s->nbytes)))
            return CKPT_ENOMEM;
    } else if (s->kind == CKPT_ENTRY_BYTES && s->nbytes) {
        if (!(e->bytes = ckpt__malloc((size_t)s->nbytes))) return ckpt__err_nomem("adapted reader");
        memcpy(e->bytes, s->bytes, (size_t)s->nbytes);
    }
    return CKPT_OK;
}

int ckpt__reader_put_from_reader(ckpt_reader *r, const char *key, ckpt_reader *src,
                                 const char *src_key, ckpt_dtype dt) {
    const entry *s = reader_get(src, src_key);
    if (!s) return ckpt__err(CKPT_ENOENT, "%s: no key '%s'", src->name, src_key);
    entry e = entry_header(s);
    if (!(e.key = reader_own_strdup(r, key, strlen(key)))) return CKPT_ENOMEM;
    if (s->kind != CKPT_ENTRY_TENSOR) {
        CKPT_TRY(adapted_scalar(r, &e, s));
        return adapted_append(r, &e);
    }
    if (dt == CKPT_DTYPE_INVALID) dt = s->dtype;
    CKPT_TRY(materialize(src, s)); /* its bytes in its dtype */
    const uint8_t *bytes = NULL;
    if (s->nbytes && s->sk) { /* a sharded tensor: assembled whole */
        uint8_t *buf = ckpt__malloc((size_t)s->nbytes);
        CKPT_TRY(reader_own(r, buf));
        CKPT_TRY(ckpt_read_tensor(src, src_key, s->dtype, s->ndim, s->shape, buf));
        bytes = buf;
    } else if (s->nbytes) {
        bytes = s->data;
        if (!bytes) {
            CKPT_TRY(reader_map(src));
            if (!src->mem)
                return ckpt__err(CKPT_EIO, "%s: tensor '%s': no bytes", src->name, src_key);
            bytes = src->mem + s->offset;
        }
    }
    if (dt != s->dtype) {
        /* converted when read: straight into the caller's buffer */
        if (!ckpt__dtype_convertible(s->dtype) || !ckpt__dtype_convertible(dt))
            return ckpt__err(CKPT_EINVAL, "%s: tensor '%s': %s does not convert to %s", src->name,
                             src_key, ckpt_dtype_name(s->dtype),
                             ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "?");
        CKPT_TRY(ckpt_tensor_nbytes(dt, s->ndim, s->shape, &e.nbytes));
        e.dtype = dt;
        e.conv_from = s->dtype;
    }
    e.data = bytes;
    return adapted_append(r, &e);
}

int ckpt__reader_put_writer_views(ckpt_reader *r, const ckpt_writer *w) {
    for (int64_t i = 0; i < w->count; i++) {
        const entry *s = &w->entries[i];
        if (s->kind != CKPT_ENTRY_TENSOR || (s->shard && !shard_is_whole(s)))
            return ckpt__err(CKPT_EINVAL, "state dict: '%s' is not a whole tensor", s->key);
        entry e = entry_header(s);
        e.data = s->data;
        if (!(e.key = reader_own_strdup(r, s->key, strlen(s->key)))) return CKPT_ENOMEM;
        CKPT_TRY(adapted_append(r, &e));
    }
    return CKPT_OK;
}

int ckpt__reader_put_from_writer(ckpt_reader *r, const ckpt_writer *w, const char *key) {
    int64_t i = key_index_get(&w->index, key);
    if (i < 0) return ckpt__err(CKPT_ENOENT, "state dict: no key '%s'", key);
    const entry *s = &w->entries[i];
    if (w->schema) return ckpt__err(CKPT_EINVAL, "adapted reader: a schema writer holds no values");
    if (s->shard && !shard_is_whole(s))
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "tensor '%s' is sharded across processes; a sharded tensor cannot be "
                         "missing from the file in a non-strict load",
                         key);
    entry e = entry_header(s);
    if (!(e.key = reader_own_strdup(r, key, strlen(key)))) return CKPT_ENOMEM;
    if (s->kind != CKPT_ENTRY_TENSOR) {
        CKPT_TRY(adapted_scalar(r, &e, s));
        return adapted_append(r, &e);
    }
    if (s->nbytes) { /* a copy: the object reads it back into the memory it came from */
        uint8_t *buf = ckpt__malloc((size_t)s->nbytes);
        CKPT_TRY(reader_own(r, buf));
        memcpy(buf, s->data, (size_t)s->nbytes);
        e.data = buf;
    }
    return adapted_append(r, &e);
}

/* ---- schema check ------------------------------------------------------- */

int ckpt__schema_check(const ckpt_writer *schema, const ckpt_reader *r, const char *what) {
    if (!schema || !r) return ckpt__err(CKPT_EINVAL, "schema check: NULL argument");
    if (!what) what = r->name;
    char a[260], b[260];
    for (int64_t i = 0; i < schema->count; i++) {
        const entry *m = &schema->entries[i];
        const entry *f = reader_get(r, m->key);
        if (!f && m->optional) continue; /* written by newer versions only */
        if (!f)
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s' missing in file (memory has %s)", what,
                             m->key, describe(a, sizeof a, m));
        if (f->kind != m->kind)
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': %s in file, %s in memory", what, m->key,
                             describe(a, sizeof a, f), describe(b, sizeof b, m));
        if (m->kind != CKPT_ENTRY_TENSOR) continue;
        if (f->dtype != m->dtype)
            return ckpt__err(CKPT_EMISMATCH, "%s: tensor '%s': dtype %s in file, %s in memory",
                             what, m->key, ckpt_dtype_name(f->dtype), ckpt_dtype_name(m->dtype));
        bool same = f->ndim == m->ndim;
        for (int d = 0; same && d < m->ndim; d++) same = f->shape[d] == m->shape[d];
        if (!same && !m->shape_by_object)
            return ckpt__err(CKPT_EMISMATCH, "%s: tensor '%s': shape %s in file, %s in memory",
                             what, m->key, ckpt__shape_str(a, sizeof a, f->ndim, f->shape),
                             ckpt__shape_str(b, sizeof b, m->ndim, m->shape));
        if (f->sk) CKPT_TRY(shard_key_check(r, &r->skeys[f->sk - 1]));
    }
    for (int64_t i = 0; i < r->count; i++) {
        const entry *f = &r->entries[i];
        if (key_index_get(&schema->index, f->key) < 0)
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s' in file (%s) but not in memory", what,
                             f->key, describe(a, sizeof a, f));
    }
    return CKPT_OK;
}
