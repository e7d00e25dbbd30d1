/* torchfile.c — torch.save files: the public reader (zip + allow-list
 * unpickler into a value tree), flattening into a state dict, and the
 * builder that writes files torch.load(..., weights_only=True) opens. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "format/statedict.h"
#include "base/io.h"
#include "format/torch/pickle.h"
#include "format/torch/zip.h"

/* ---- reading ------------------------------------------------------------- */

struct ckpt_torch_file {
    ckpt_mapped map;
    ckpt_zip zip;
    ckpt_pkl_arena arena;
    const ckpt_torch_value *root;
    char *name;
    char *prefix; /* "<folder>/" */
};

/* torch.save before 1.6 (or with _use_new_zipfile_serialization=False):
 * PROTO 2, LONG1 of the magic number 0x1950a86a20f9469cfc6c. */
static const uint8_t legacy_magic[] = {0x80, 0x02, 0x8a, 0x0a, 0x6c, 0xfc, 0x9c,
                                       0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};

static int storage_cb(void *ctx, const char *key, ckpt_dtype dt, int64_t numel,
                      const uint8_t **data) {
    ckpt_torch_file *f = ctx;
    char rec[512];
    if (strlen(key) > 256) return ckpt__err(CKPT_ECORRUPT, "%s: storage key too long", f->name);
    snprintf(rec, sizeof rec, "%sdata/%s", f->prefix, key);
    const ckpt_zip_record *r = ckpt__zip_find(&f->zip, rec);
    if (!r) return ckpt__err(CKPT_ECORRUPT, "%s: storage '%s' has no record %s", f->name, key, rec);
    uint64_t need = 0;
    int64_t shape[1] = {numel};
    if (ckpt_tensor_nbytes(dt, 1, shape, &need) < 0 || r->usize != need)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: storage '%s' (%" PRId64 " elements of %s) needs %" PRIu64
                         " bytes, its record has %" PRIu64,
                         f->name, key, numel, ckpt_dtype_name(dt), need, r->usize);
    return ckpt__zip_read(&f->zip, r, data);
}

static int parse(ckpt_torch_file *f) {
    const uint8_t *d = f->map.data;
    uint64_t n = f->map.size;
    if (n >= sizeof legacy_magic && memcmp(d, legacy_magic, sizeof legacy_magic) == 0)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: a legacy torch.save file (PyTorch before 1.6, or saved with "
                         "_use_new_zipfile_serialization=False); re-save it with a current "
                         "PyTorch: torch.save(torch.load(f), f)", f->name);
    if (n < 4 || memcmp(d, "PK\x03\x04", 4) != 0)
        return ckpt__err(CKPT_ECORRUPT, "%s: not a torch.save file (no zip signature)%s", f->name,
                         n && d[0] == 0x80 ? "; it looks like a bare pickle" : "");
    CKPT_TRY(ckpt__zip_open(&f->zip, d, n, f->name));
    /* the archive's one folder: the one holding data.pkl */
    const ckpt_zip_record *pkl = NULL;
    for (int64_t i = 0; i < f->zip.count; i++) {
        const char *nm = f->zip.recs[i].name, *slash = strchr(nm, '/');
        if (slash && slash != nm && strcmp(slash + 1, "data.pkl") == 0) {
            if (pkl) return ckpt__err(CKPT_ECORRUPT, "%s: two data.pkl records", f->name);
            pkl = &f->zip.recs[i];
        }
    }
    if (!pkl) return ckpt__err(CKPT_ECORRUPT, "%s: no <folder>/data.pkl record", f->name);
    size_t plen = (size_t)(strchr(pkl->name, '/') - pkl->name) + 1;
    f->prefix = ckpt__malloc(plen + 1);
    if (!f->prefix) return ckpt__err_nomem("torch file");
    memcpy(f->prefix, pkl->name, plen);
    f->prefix[plen] = '\0';
    char rec[600];
    snprintf(rec, sizeof rec, "%sconstants.pkl", f->prefix);
    if (ckpt__zip_find(&f->zip, rec))
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: a TorchScript archive (torch.jit.save), not a "
                         "torch.save file", f->name);
    snprintf(rec, sizeof rec, "%sversion", f->prefix);
    const ckpt_zip_record *vr = ckpt__zip_find(&f->zip, rec);
    if (!vr) return ckpt__err(CKPT_ECORRUPT, "%s: no %s record", f->name, rec);
    const uint8_t *vd = NULL;
    CKPT_TRY(ckpt__zip_read(&f->zip, vr, &vd));
    int64_t version = 0;
    uint64_t k = 0;
    while (k < vr->usize && k < 8 && vd[k] >= '0' && vd[k] <= '9')
        version = version * 10 + (vd[k++] - '0');
    while (k < vr->usize && (vd[k] == '\n' || vd[k] == '\r' || vd[k] == ' ')) k++;
    if (k == 0 || k != vr->usize)
        return ckpt__err(CKPT_ECORRUPT, "%s: the version record is not a number", f->name);
    if (version < 1 || version > 10)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: archive format version %" PRId64 " (1 to 10 are read)", f->name,
                         version);
    const uint8_t *pd = NULL;
    CKPT_TRY(ckpt__zip_read(&f->zip, pkl, &pd));
    f->arena.gather_limit = n + (64u << 20);
    return ckpt__unpickle(&f->arena, pd, (size_t)pkl->usize, f->name, storage_cb, f, &f->root);
}

int ckpt_torch_open_memory(ckpt_torch_file **out, const void *buf, size_t len, const char *name) {
    if (!out || (!buf && len)) return ckpt__err(CKPT_EINVAL, "torch_open: NULL argument");
    *out = NULL;
    ckpt_torch_file *f = ckpt__calloc(1, sizeof *f);
    if (!f) return ckpt__err_nomem("torch file");
    f->name = ckpt__strdup(name ? name : "torch file");
    if (!f->name) {
        free(f);
        return ckpt__err_nomem("torch file");
    }
    f->map.data = buf ? buf : (const uint8_t *)"";
    f->map.size = len;
    int rc = parse(f);
    if (rc < 0) {
        ckpt_torch_close(f);
        return rc;
    }
    *out = f;
    return CKPT_OK;
}

int ckpt_torch_open(ckpt_torch_file **out, const char *path) {
    if (!out || !path) return ckpt__err(CKPT_EINVAL, "torch_open: NULL argument");
    *out = NULL;
    ckpt_torch_file *f = ckpt__calloc(1, sizeof *f);
    if (!f) return ckpt__err_nomem("torch file");
    f->name = ckpt__strdup(path);
    int rc = f->name ? ckpt__map_file(path, &f->map) : ckpt__err_nomem("torch file");
    if (rc == 0) rc = parse(f);
    if (rc < 0) {
        ckpt_torch_close(f);
        return rc;
    }
    *out = f;
    return CKPT_OK;
}

void ckpt_torch_close(ckpt_torch_file *f) {
    if (!f) return;
    ckpt__pkl_arena_free(&f->arena);
    ckpt__zip_close(&f->zip);
    if (f->map.map_base || f->map.heap) ckpt__unmap(&f->map);
    free(f->prefix);
    free(f->name);
    free(f);
}

const ckpt_torch_value *ckpt_torch_root(const ckpt_torch_file *f) { return f ? f->root : NULL; }

const ckpt_torch_value *ckpt_torch_dict_get(const ckpt_torch_value *d, const char *key) {
    if (!d || !key || d->kind != CKPT_TORCH_DICT) return NULL;
    size_t n = strlen(key);
    for (int64_t i = 0; i < d->n; i++) {
        const ckpt_torch_value *k = d->items[2 * i];
        if (k->kind == CKPT_TORCH_STR && k->len == n && memcmp(k->s, key, n) == 0)
            return d->items[2 * i + 1];
    }
    return NULL;
}

/* ---- flattening ---------------------------------------------------------- */

/* Shared containers are visited once per path; a file whose paths multiply
 * (a list of the same list of the same list...) stops here. */
#define FLATTEN_MAX_VISITS (1u << 22)

typedef struct flat {
    ckpt_writer *w;
    char key[CKPT_MAX_KEY + 2];
    uint64_t visits;
} flat;

static int flatten(flat *fl, const ckpt_torch_value *v, size_t klen, int depth) {
    if (++fl->visits > FLATTEN_MAX_VISITS)
        return ckpt__err(CKPT_ECORRUPT, "torch flatten: more than %u values (shared containers)",
                         FLATTEN_MAX_VISITS);
    if (depth > CKPT_TORCH_MAX_DEPTH)
        return ckpt__err(CKPT_ECORRUPT, "torch flatten: nested too deep");
    const char *key = fl->key;
    bool leaf =
        v->kind != CKPT_TORCH_DICT && v->kind != CKPT_TORCH_LIST && v->kind != CKPT_TORCH_TUPLE;
    if (leaf && klen == 0 && v->kind != CKPT_TORCH_NONE)
        return ckpt__err(CKPT_EINVAL, "torch flatten: a %s needs a key (give a prefix)",
                         ckpt_torch_kind_name(v->kind));
    switch (v->kind) {
    case CKPT_TORCH_NONE: return CKPT_OK;
    case CKPT_TORCH_BOOL: return ckpt_write_i64(fl->w, key, v->b);
    case CKPT_TORCH_INT: return ckpt_write_i64(fl->w, key, v->i);
    case CKPT_TORCH_FLOAT: return ckpt_write_f64(fl->w, key, v->f);
    case CKPT_TORCH_STR:
        if (strlen(v->s) != v->len)
            return ckpt__err(CKPT_EUNSUPPORTED, "torch flatten: '%s': a string with a NUL", key);
        return ckpt_write_str(fl->w, key, v->s);
    case CKPT_TORCH_BYTES: return ckpt_write_bytes(fl->w, key, v->s, v->len);
    case CKPT_TORCH_TENSOR:
        return ckpt_write_tensor(fl->w, key, v->dtype, v->ndim, v->shape, v->data);
    case CKPT_TORCH_SET:
        return ckpt__err(CKPT_EUNSUPPORTED, "torch flatten: '%s': a set has no keys", key);
    default: break;
    }
    bool dict = v->kind == CKPT_TORCH_DICT;
    for (int64_t i = 0; i < v->n; i++) {
        char part[64];
        const char *name = part;
        size_t plen = 0;
        if (dict) {
            const ckpt_torch_value *k = v->items[2 * i];
            if (k->kind == CKPT_TORCH_STR) {
                name = k->s;
                plen = k->len;
                if (strlen(k->s) != k->len)
                    return ckpt__err(CKPT_EUNSUPPORTED, "torch flatten: a key with a NUL");
            } else if (k->kind == CKPT_TORCH_INT) {
                plen = (size_t)snprintf(part, sizeof part, "%" PRId64, k->i);
            } else {
                return ckpt__err(CKPT_EUNSUPPORTED, "torch flatten: '%s': a dict key of kind %s "
                                 "(strings and ints only)", klen ? key : "(root)",
                                 ckpt_torch_kind_name(k->kind));
            }
        } else {
            plen = (size_t)snprintf(part, sizeof part, "%" PRId64, i);
        }
        size_t nk = klen + (klen ? 1 : 0) + plen;
        if (nk > CKPT_MAX_KEY)
            return ckpt__err(CKPT_EINVAL, "torch flatten: key '%.60s...' longer than %d bytes",
                             fl->key, CKPT_MAX_KEY);
        if (klen) fl->key[klen] = '.';
        memcpy(fl->key + klen + (klen ? 1 : 0), name, plen);
        fl->key[nk] = '\0';
        CKPT_TRY(flatten(fl, dict ? v->items[2 * i + 1] : v->items[i], nk, depth + 1));
        fl->key[klen] = '\0';
    }
    return CKPT_OK;
}

int ckpt_torch_flatten(const ckpt_torch_value *v, const char *prefix, ckpt_writer *w) {
    if (!v || !w) return ckpt__err(CKPT_EINVAL, "torch_flatten: NULL argument");
    flat *fl = ckpt__calloc(1, sizeof *fl);
    if (!fl) return ckpt__err_nomem("torch flatten");
    fl->w = w;
    size_t klen = prefix ? strlen(prefix) : 0;
    if (klen > CKPT_MAX_KEY) {
        free(fl);
        return ckpt__err(CKPT_EINVAL, "torch_flatten: prefix longer than %d bytes", CKPT_MAX_KEY);
    }
    if (klen) memcpy(fl->key, prefix, klen);
    int rc = flatten(fl, v, klen, 0);
    free(fl);
    return rc;
}

/* ---- writing ------------------------------------------------------------- */

enum { F_DICT = 1, F_LIST, F_TUPLE };

typedef struct wtensor {
    const void *data;
    uint64_t nbytes;
    ckpt_dtype dtype;
} wtensor;

struct ckpt_torch_writer {
    ckpt_pkl_buf pk;
    struct {
        int kind;
        int64_t count;
    } frames[CKPT_TORCH_MAX_DEPTH];
    int depth;
    bool have_root;
    int err; /* sticky: a misuse spoils the file */
    wtensor *tensors;
    int64_t ntensors, cap;
};

static int misuse(ckpt_torch_writer *w, const char *fmt, const char *detail) {
    w->err = CKPT_EINVAL;
    return ckpt__err(CKPT_EINVAL, "torch writer: %s%s", fmt, detail ? detail : "");
}

int ckpt_torch_writer_new(ckpt_torch_writer **out) {
    if (!out) return ckpt__err(CKPT_EINVAL, "torch_writer_new: out is NULL");
    *out = ckpt__calloc(1, sizeof **out);
    if (!*out) return ckpt__err_nomem("torch writer");
    ckpt__pkl_bytes(&(*out)->pk, "\x80\x02", 2); /* PROTO 2 */
    return CKPT_OK;
}

void ckpt_torch_writer_free(ckpt_torch_writer *w) {
    if (!w) return;
    ckpt__pkl_buf_free(&w->pk);
    free(w->tensors);
    free(w);
}

/* Where the next value goes: checks it may go there and counts it. */
static int slot(ckpt_torch_writer *w, bool key_ok) {
    if (!w) return ckpt__err(CKPT_EINVAL, "torch writer is NULL");
    if (w->err) return ckpt__err(CKPT_EINVAL, "torch writer: an earlier call failed");
    if (w->depth == 0) {
        if (w->have_root) return misuse(w, "a second object at the top level", NULL);
        w->have_root = true;
        return CKPT_OK;
    }
    if (w->frames[w->depth - 1].kind == F_DICT && w->frames[w->depth - 1].count % 2 == 0 && !key_ok)
        return misuse(w, "a dict key must be a string, int, bool, float or None", NULL);
    w->frames[w->depth - 1].count++;
    return CKPT_OK;
}

static int open_frame(ckpt_torch_writer *w, int kind) {
    CKPT_TRY(slot(w, false));
    if (w->depth == CKPT_TORCH_MAX_DEPTH) return misuse(w, "nested too deep", NULL);
    w->frames[w->depth].kind = kind;
    w->frames[w->depth].count = 0;
    w->depth++;
    return CKPT_OK;
}

static int emitted(ckpt_torch_writer *w) {
    if (w->pk.err) {
        w->err = w->pk.err;
        return w->pk.err;
    }
    return CKPT_OK;
}

int ckpt_torch_begin_dict(ckpt_torch_writer *w, bool ordered) {
    CKPT_TRY(open_frame(w, F_DICT));
    if (ordered) {
        ckpt__pkl_global(&w->pk, "collections", "OrderedDict");
        ckpt__pkl_bytes(&w->pk, ")R", 2); /* OrderedDict() */
    } else {
        ckpt__pkl_byte(&w->pk, '}');
    }
    ckpt__pkl_byte(&w->pk, '(');
    return emitted(w);
}

int ckpt_torch_begin_list(ckpt_torch_writer *w) {
    CKPT_TRY(open_frame(w, F_LIST));
    ckpt__pkl_bytes(&w->pk, "](", 2);
    return emitted(w);
}

int ckpt_torch_begin_tuple(ckpt_torch_writer *w) {
    CKPT_TRY(open_frame(w, F_TUPLE));
    ckpt__pkl_byte(&w->pk, '(');
    return emitted(w);
}

int ckpt_torch_end(ckpt_torch_writer *w) {
    if (!w) return ckpt__err(CKPT_EINVAL, "torch writer is NULL");
    if (w->err) return ckpt__err(CKPT_EINVAL, "torch writer: an earlier call failed");
    if (w->depth == 0) return misuse(w, "end without an open dict, list or tuple", NULL);
    int kind = w->frames[w->depth - 1].kind;
    if (kind == F_DICT && w->frames[w->depth - 1].count % 2)
        return misuse(w, "a dict key without a value", NULL);
    w->depth--;
    ckpt__pkl_byte(&w->pk, kind == F_DICT   ? 'u'
                           : kind == F_LIST ? 'e'
                                            : 't'); /* SETITEMS APPENDS TUPLE */
    return emitted(w);
}

int ckpt_torch_put_none(ckpt_torch_writer *w) {
    CKPT_TRY(slot(w, true));
    ckpt__pkl_byte(&w->pk, 'N');
    return emitted(w);
}

int ckpt_torch_put_bool(ckpt_torch_writer *w, bool v) {
    CKPT_TRY(slot(w, true));
    ckpt__pkl_byte(&w->pk, v ? 0x88 : 0x89);
    return emitted(w);
}

int ckpt_torch_put_int(ckpt_torch_writer *w, int64_t v) {
    CKPT_TRY(slot(w, true));
    ckpt__pkl_int(&w->pk, v);
    return emitted(w);
}

int ckpt_torch_put_uint(ckpt_torch_writer *w, uint64_t v) {
    CKPT_TRY(slot(w, true));
    ckpt__pkl_uint(&w->pk, v);
    return emitted(w);
}

int ckpt_torch_put_float(ckpt_torch_writer *w, double v) {
    CKPT_TRY(slot(w, true));
    ckpt__pkl_float(&w->pk, v);
    return emitted(w);
}

int ckpt_torch_put_str(ckpt_torch_writer *w, const char *v) {
    if (!v) return misuse(w, "string is NULL", NULL);
    if (!ckpt__utf8_valid((const unsigned char *)v, strlen(v)))
        return misuse(w, "string is not valid UTF-8", NULL);
    CKPT_TRY(slot(w, true));
    ckpt__pkl_str(&w->pk, v, strlen(v));
    return emitted(w);
}

int ckpt_torch_put_tensor(ckpt_torch_writer *w, ckpt_dtype dt, int ndim, const int64_t *shape,
                          const void *data) {
    if (!w) return ckpt__err(CKPT_EINVAL, "torch writer is NULL");
    const char *cls = ckpt__pkl_storage_name(dt);
    if (!cls)
        return ckpt__err(CKPT_EUNSUPPORTED, "torch writer: PyTorch has no storage for dtype %s",
                         ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "(invalid)");
    uint64_t nbytes = 0;
    if (ckpt_tensor_nbytes(dt, ndim, shape, &nbytes) < 0) {
        w->err = CKPT_EINVAL;
        return ckpt__err_prefix(CKPT_EINVAL, "torch writer");
    }
    if (nbytes && !data) return misuse(w, "tensor data is NULL", NULL);
    CKPT_TRY(slot(w, false));
    /* The very bytes of an earlier tensor of the dtype: its storage, shared
     * (torch.load gives both one storage, as torch.save of tied weights). */
    int64_t id = -1;
    for (int64_t i = 0; i < w->ntensors && nbytes > 0 && id < 0; i++)
        if (w->tensors[i].data == data && w->tensors[i].nbytes == nbytes &&
            w->tensors[i].dtype == dt)
            id = i;
    if (id < 0 && w->ntensors == w->cap) {
        int64_t cap = w->cap ? w->cap * 2 : 16;
        void *p = ckpt__realloc(w->tensors, (size_t)cap * sizeof *w->tensors);
        if (!p) {
            w->err = CKPT_ENOMEM;
            return ckpt__err_nomem("torch writer");
        }
        w->tensors = p;
        w->cap = cap;
    }
    if (id < 0) {
        id = w->ntensors++;
        w->tensors[id] = (wtensor){data, nbytes, dt};
    }
    char key[32];
    int klen = snprintf(key, sizeof key, "%" PRId64, id);
    size_t es = (size_t)ckpt_dtype_bits(dt) / 8;
    ckpt_pkl_buf *b = &w->pk;
    ckpt__pkl_global(b, "torch._utils", "_rebuild_tensor_v2");
    ckpt__pkl_bytes(b, "((", 2);
    ckpt__pkl_str(b, "storage", 7);
    ckpt__pkl_global(b, "torch", cls);
    ckpt__pkl_str(b, key, (size_t)klen);
    ckpt__pkl_str(b, "cpu", 3);
    ckpt__pkl_int(b, (int64_t)(nbytes / es));
    ckpt__pkl_bytes(b, "tQ", 2); /* TUPLE, BINPERSID */
    ckpt__pkl_int(b, 0);         /* storage offset */
    ckpt__pkl_byte(b, '(');
    for (int d = 0; d < ndim; d++) ckpt__pkl_int(b, shape[d]);
    ckpt__pkl_byte(b, 't');
    ckpt__pkl_byte(b, '(');
    int64_t stride = 1, strides[CKPT_MAX_NDIM];
    for (int d = ndim - 1; d >= 0; d--) {
        strides[d] = stride;
        stride *= shape[d] ? shape[d] : 1;
    }
    for (int d = 0; d < ndim; d++) ckpt__pkl_int(b, strides[d]);
    ckpt__pkl_byte(b, 't');
    ckpt__pkl_byte(b, 0x89); /* requires_grad False */
    ckpt__pkl_global(b, "collections", "OrderedDict");
    ckpt__pkl_bytes(b, ")R", 2);
    ckpt__pkl_bytes(b, "tR", 2); /* the arguments, REDUCE */
    return emitted(w);
}

typedef struct save_ctx {
    ckpt_torch_writer *w;
    const char *prefix;
} save_ctx;

static int fill(ckpt_ostream *s, void *ctx) {
    save_ctx *c = ctx;
    ckpt_zip_writer zw;
    ckpt__zip_writer_init(&zw, s);
    char name[320];
    snprintf(name, sizeof name, "%s/data.pkl", c->prefix);
    int rc = ckpt__zip_add(&zw, name, c->w->pk.p, c->w->pk.n);
    snprintf(name, sizeof name, "%s/byteorder", c->prefix);
    if (rc == 0) rc = ckpt__zip_add(&zw, name, "little", 6);
    for (int64_t i = 0; i < c->w->ntensors && rc == 0; i++) {
        snprintf(name, sizeof name, "%s/data/%" PRId64, c->prefix, i);
        rc = ckpt__zip_add(&zw, name, c->w->tensors[i].data, c->w->tensors[i].nbytes);
    }
    snprintf(name, sizeof name, "%s/version", c->prefix);
    if (rc == 0) rc = ckpt__zip_add(&zw, name, "3\n", 2);
    if (rc < 0) {
        ckpt__zip_writer_free(&zw);
        return rc;
    }
    return ckpt__zip_finish(&zw);
}

int ckpt_torch_writer_save(ckpt_torch_writer *w, const char *path) {
    if (!w || !path) return ckpt__err(CKPT_EINVAL, "torch_writer_save: NULL argument");
    if (w->err) return ckpt__err(CKPT_EINVAL, "torch writer: %s: an earlier call failed", path);
    if (!w->have_root || w->depth)
        return ckpt__err(CKPT_EINVAL, "torch writer: %s: the object is not finished (%d open)",
                         path, w->depth);
    /* the archive's folder: the file name's stem, as torch.save names it */
    const char *base = strrchr(path, '/');
    base = base ? base + 1 : path;
    char prefix[201];
    size_t n = 0;
    for (const char *q = base; *q && *q != '.' && n < sizeof prefix - 1; q++) {
        char ch = *q;
        bool ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') ||
                  (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
        prefix[n++] = ok ? ch : '_';
    }
    prefix[n] = '\0';
    if (!n) snprintf(prefix, sizeof prefix, "archive");
    ckpt__pkl_byte(&w->pk, '.'); /* STOP, taken off again below so saving can repeat */
    if (w->pk.err) return w->pk.err;
    save_ctx c = {w, prefix};
    int rc = ckpt__publish_file(path, fill, &c, NULL, NULL);
    w->pk.n--;
    return rc < 0 ? ckpt__err_prefix(rc, "torch writer") : rc;
}
