/* torch_import.c — ckpt_import_torch: a ckpt checkpoint from an Accelerate
 * folder, Hugging Face weights (single or sharded, safetensors or
 * pytorch_model.bin) or one torch.save'd state dict. PyTorch's nested state
 * dicts become the flat keys of docs/TRAINING.md; files are read with the
 * allow-list unpickler only. The checkpoint is committed as a save is: files
 * in a temporary folder, manifest last, one rename. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "accel/accel.h"
#include "accel/load_op.h"
#include "base/error.h"
#include "base/io.h"
#include "format/keymap.h"
#include "format/manifest.h"
#include "format/statedict.h"
#include "store/store.h"
#include "store/txn.h"
#include "train/optim.h"

typedef struct mparam {
    char *name;
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    ckpt_dtype dtype;
    const void *data; /* the model's tensors: where their bytes are (shared storages) */
} mparam;

typedef struct imp {
    ckpt_import_options o;
    ckpt_torch_file **tfiles;
    int ntf;
    ckpt_reader **readers;
    int nrd;
    void **bufs;
    int nbufs;
    mparam *params;
    int64_t nparams;
    int64_t nshared; /* tied names: a tensor on the storage of an earlier one */
    ckpt_writer *model, *optim, *sched, *scaler, *rng;
    int opt_groups;
    int64_t opt_step; /* largest Adam step; -1 if none */
    /* parameter names (import_param_names) */
    bool model_in_order; /* the model came from one pickled state dict: torch's order */
    bool opt_named;      /* optimizer.bin carried param_names */
    int64_t opt_count;   /* the optimizer's parameters (state indices) */
    int64_t opt_nshapes;
    mparam *opt_shapes; /* state index -> its state tensors' shape (ndim -1: none seen) */
    uint64_t in_bytes; /* bytes of the files read (the output cap's base) */
    ckpt_rng gen;
} imp;

static ckpt_import_options defaults(void) {
    ckpt_import_options o = {0};
    o.warmup = o.total = o.step = -1;
    return o;
}

ckpt_import_options ckpt_import_defaults(void) { return defaults(); }

/* Everything an import holds: its writers, the files it read (whose bytes
 * the writers borrow), its buffers. */
static void imp_free(imp *x) {
    ckpt_writer_free(x->model);
    ckpt_writer_free(x->optim);
    ckpt_writer_free(x->sched);
    ckpt_writer_free(x->scaler);
    ckpt_writer_free(x->rng);
    for (int i = 0; i < x->ntf; i++) ckpt_torch_close(x->tfiles[i]);
    for (int i = 0; i < x->nrd; i++) ckpt_reader_free(x->readers[i]);
    for (int i = 0; i < x->nbufs; i++) free(x->bufs[i]);
    for (int64_t i = 0; i < x->nparams; i++) free(x->params[i].name);
    free(x->opt_shapes);
    free(x->tfiles);
    free(x->readers);
    free(x->bufs);
    free(x->params);
    memset(x, 0, sizeof *x);
}

static void *keep(imp *x, void *p) {
    if (!p) return NULL;
    void *g = ckpt__realloc(x->bufs, (size_t)(x->nbufs + 1) * sizeof *x->bufs);
    if (!g) {
        free(p);
        return NULL;
    }
    x->bufs = g;
    x->bufs[x->nbufs++] = p;
    return p;
}

/* ---- the output cap ---------------------------------------------------------- */

/* Adds a file's size to the bytes read. */
static void count_input(imp *x, const char *path) {
    struct stat st;
    if (ckpt__os_stat(path, &st) == 0 && st.st_size > 0) x->in_bytes += (uint64_t)st.st_size;
}

static uint64_t writer_bytes(const ckpt_writer *w) {
    uint64_t sum = 0;
    for (int64_t i = 0; w && i < ckpt_writer_entry_count(w); i++) {
        ckpt_entry_info e;
        if (ckpt_writer_entry(w, i, &e) == 0) sum += e.nbytes;
    }
    return sum;
}

/* Before anything is written: reports the sizes, and refuses an output
 * past the cap (ckpt_import_options.max_output_size). */
static int check_output_size(const imp *x, const char *src) {
    uint64_t out = writer_bytes(x->model) + writer_bytes(x->optim) + writer_bytes(x->sched) +
                   writer_bytes(x->scaler) + writer_bytes(x->rng);
    if (x->o.on_sizes) x->o.on_sizes(x->o.user, x->in_bytes, out);
    uint64_t cap = x->o.max_output_size;
    if (cap == 0) {
        const uint64_t floor = 1u << 20, ratio = 64;
        cap = x->in_bytes > UINT64_MAX / ratio ? UINT64_MAX : x->in_bytes * ratio;
        if (cap < floor) cap = floor;
    }
    if (out <= cap) return CKPT_OK;
    return ckpt__err(
        CKPT_EUNSUPPORTED,
        "import: %s: the checkpoint would hold %" PRIu64 " bytes of tensors from %" PRIu64
        " bytes read, over the limit of %" PRIu64 " (%s); a torch file's "
        "storage can be shared by many tensors. If that is expected, raise the "
        "limit (max_output_size; ckpt import --max-output-size BYTES); nothing was "
        "written",
        src, out, x->in_bytes, cap,
        x->o.max_output_size ? "max_output_size" : "64 times the input, at least 1 MiB");
}

static int open_torch(imp *x, const char *path, const ckpt_torch_value **root) {
    void *g = ckpt__realloc(x->tfiles, (size_t)(x->ntf + 1) * sizeof *x->tfiles);
    if (!g) return ckpt__err_nomem("import");
    x->tfiles = g;
    ckpt_torch_file *f = NULL;
    CKPT_TRY(ckpt_torch_open(&f, path));
    x->tfiles[x->ntf++] = f;
    count_input(x, path);
    *root = ckpt_torch_root(f);
    if ((*root)->kind != CKPT_TORCH_DICT)
        return ckpt__err(CKPT_EUNSUPPORTED, "import: %s holds a %s, not a state dict", path,
                         ckpt_torch_kind_name((*root)->kind));
    return CKPT_OK;
}

static int open_st(imp *x, const char *path, ckpt_reader **r) {
    void *g = ckpt__realloc(x->readers, (size_t)(x->nrd + 1) * sizeof *x->readers);
    if (!g) return ckpt__err_nomem("import");
    x->readers = g;
    CKPT_TRY(ckpt_reader_open(r, path));
    x->readers[x->nrd++] = *r;
    count_input(x, path);
    return CKPT_OK;
}

/* Something is there: the reader then says what, if it is not a regular
 * file (a FIFO or a folder is not silently taken for a missing file). */
static bool present(const char *path) {
    struct stat st;
    return ckpt__os_stat(path, &st) == 0;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* ---- the model ------------------------------------------------------------- */

static int add_param(imp *x, const char *name, ckpt_dtype dt, int ndim, const int64_t *shape,
                     const void *data, const char *file) {
    int rc = ckpt_write_tensor(x->model, name, dt, ndim, shape, data);
    if (rc < 0) return ckpt__err_prefix(rc, "import: %s", file);
    void *g = ckpt__realloc(x->params, (size_t)(x->nparams + 1) * sizeof *x->params);
    if (!g) return ckpt__err_nomem("import");
    x->params = g;
    mparam *p = &x->params[x->nparams];
    memset(p, 0, sizeof *p);
    p->name = ckpt__strdup(name);
    if (!p->name) return ckpt__err_nomem("import");
    p->ndim = ndim;
    if (ndim) memcpy(p->shape, shape, (size_t)ndim * sizeof *shape);
    p->dtype = dt;
    p->data = data;
    x->nparams++;
    return CKPT_OK;
}

/* A tensor of a torch file on the very bytes of an earlier one, seen the
 * same way: PyTorch's tied weights (torch.save keeps a shared storage
 * once). The earlier tensor's name, or NULL. */
static const char *shared_with(const imp *x, const ckpt_torch_value *v) {
    for (int64_t i = 0; v->nbytes > 0 && i < x->nparams; i++) {
        const mparam *p = &x->params[i];
        bool same = p->data == v->data && p->dtype == v->dtype && p->ndim == v->ndim;
        for (int d = 0; same && d < v->ndim; d++) same = p->shape[d] == v->shape[d];
        if (same) return p->name;
    }
    return NULL;
}

static int model_from_torch(imp *x, const char *path) {
    const ckpt_torch_value *root = NULL;
    CKPT_TRY(open_torch(x, path, &root));
    for (int64_t i = 0; i < root->n; i++) {
        const ckpt_torch_value *k = root->items[2 * i], *v = root->items[2 * i + 1];
        if (k->kind != CKPT_TORCH_STR)
            return ckpt__err(CKPT_EUNSUPPORTED,
                             "import: %s: a key of kind %s in a model state dict", path,
                             ckpt_torch_kind_name(k->kind));
        if (v->kind != CKPT_TORCH_TENSOR)
            return ckpt__err(CKPT_EUNSUPPORTED, "import: %s: '%s' is a %s, not a tensor (not a "
                             "model state dict; an Accelerate folder keeps the optimizer in "
                             "optimizer.bin)", path, k->s, ckpt_torch_kind_name(v->kind));
        const char *target = shared_with(x, v);
        if (target) { /* tied: one parameter, saved once (ckpt_model_tie) */
            int rc = ckpt_write_alias(x->model, k->s, target);
            if (rc < 0) return ckpt__err_prefix(rc, "import: %s", path);
            x->nshared++;
            continue;
        }
        CKPT_TRY(add_param(x, k->s, v->dtype, v->ndim, v->shape, v->data, path));
    }
    return CKPT_OK;
}

static int model_from_safetensors(imp *x, const char *path) {
    ckpt_reader *r = NULL;
    CKPT_TRY(open_st(x, path, &r));
    int64_t n = ckpt_reader_count(r);
    for (int64_t i = 0; i < n; i++) {
        ckpt_entry_info e;
        const void *data = NULL;
        CKPT_TRY(ckpt_reader_entry(r, i, &e));
        if (e.kind == CKPT_ENTRY_ALIAS) { /* a ckpt file's tied name (after the tensors) */
            int rc = ckpt_write_alias(x->model, e.key, e.target);
            if (rc < 0) return ckpt__err_prefix(rc, "import: %s", path);
            continue;
        }
        if (e.kind != CKPT_ENTRY_TENSOR) continue;
        CKPT_TRY(ckpt_reader_tensor_view(r, e.key, &data, NULL));
        CKPT_TRY(add_param(x, e.key, e.dtype, e.ndim, e.shape, data, path));
    }
    return CKPT_OK;
}

/* An HF index: {"metadata": ..., "weight_map": {tensor: shard file}}. */
static int model_from_index(imp *x, const char *dir, const char *index) {
    char *path = ckpt__path_join(dir, index), *text = NULL;
    if (!path) return ckpt__err_nomem("import");
    size_t len = 0;
    int rc = ckpt__read_small_file(path, false, 64u << 20, &text, &len);
    json_error_t je;
    json_t *root = rc == 0 ? json_loadb(text, len, 0, &je) : NULL;
    json_t *map = root ? json_object_get(root, "weight_map") : NULL;
    if (rc == 0 && !json_is_object(map))
        rc = ckpt__err(CKPT_ECORRUPT, "import: %s: no weight_map object", path);
    const char **shards = NULL;
    size_t nshards = 0;
    const char *key;
    json_t *val;
    if (rc == 0) {
        shards = ckpt__calloc(json_object_size(map) + 1, sizeof *shards);
        if (!shards) rc = ckpt__err_nomem("import");
    }
    json_object_foreach(map, key, val) {
        if (rc < 0) break;
        const char *s = json_string_value(val);
        if (!s || !*s || strchr(s, '/') || !strcmp(s, "..") || !strcmp(s, ".")) {
            rc = ckpt__err(CKPT_ECORRUPT, "import: %s: '%s' maps to a bad file name", path, key);
            break;
        }
        size_t k = 0;
        while (k < nshards && strcmp(shards[k], s)) k++;
        if (k == nshards) shards[nshards++] = s;
    }
    int64_t before = x->nparams, shared_before = x->nshared;
    for (size_t k = 0; k < nshards && rc == 0; k++) {
        char *sp = ckpt__path_join(dir, shards[k]);
        if (!sp) rc = ckpt__err_nomem("import");
        else if (ends_with(sp, ".safetensors")) rc = model_from_safetensors(x, sp);
        else rc = model_from_torch(x, sp);
        free(sp);
    }
    /* a .bin index lists tied names too (their shard shares the storage) */
    int64_t held = x->nparams - before + x->nshared - shared_before;
    if (rc == 0 && (size_t)held != json_object_size(map))
        rc = ckpt__err(CKPT_ECORRUPT, "import: %s lists %zu tensors, its shards hold %" PRId64,
                       path, json_object_size(map), held);
    /* the index's order is the model's (the shards' own order is by name) */
    if (rc == 0) {
        int64_t pos = before;
        json_object_foreach(map, key, val) {
            for (int64_t j = pos; j < x->nparams; j++) {
                if (!strcmp(x->params[j].name, key)) {
                    mparam t = x->params[pos];
                    x->params[pos] = x->params[j];
                    x->params[j] = t;
                    pos++;
                    break;
                }
            }
        }
    }
    free(shards);
    json_decref(root);
    free(text);
    free(path);
    return rc;
}

static int import_model(imp *x, const char *src, bool dir) {
    if (!dir) {
        if (ends_with(src, ".safetensors")) return model_from_safetensors(x, src);
        if (ends_with(src, ".index.json")) {
            const char *slash = strrchr(src, '/');
            char *d = slash ? strndup(src, (size_t)(slash - src)) : strdup(".");
            if (!d) return ckpt__err_nomem("import");
            int rc = model_from_index(x, d, slash ? slash + 1 : src);
            free(d);
            return rc;
        }
        x->model_in_order = true;
        return model_from_torch(x, src);
    }
    static const char *const names[] = {"model.safetensors.index.json", "model.safetensors",
                                        "pytorch_model.bin.index.json", "pytorch_model.bin"};
    for (int i = 0; i < 4; i++) {
        char *p = ckpt__path_join(src, names[i]);
        if (!p) return ckpt__err_nomem("import");
        bool found = present(p);
        int rc = 0;
        x->model_in_order = found && i == 3;
        if (found) rc = i == 0 || i == 2 ? model_from_index(x, src, names[i])
                        : i == 1        ? model_from_safetensors(x, p)
                                        : model_from_torch(x, p);
        free(p);
        if (found) return rc;
    }
    return ckpt__err(CKPT_ENOENT, "import: %s has no model.safetensors, pytorch_model.bin or an "
                     "index of their shards", src);
}

/* ---- values -------------------------------------------------------------------- */

static int number(const ckpt_torch_value *v, double *out) {
    if (!v) return -1;
    switch (v->kind) {
    case CKPT_TORCH_FLOAT: *out = v->f; return 0;
    case CKPT_TORCH_INT: *out = (double)v->i; return 0;
    case CKPT_TORCH_BOOL: *out = v->b; return 0;
    case CKPT_TORCH_TENSOR:
        if (v->ndim == 0 && v->dtype == CKPT_F32) {
            float f = 0;
            memcpy(&f, v->data, 4);
            *out = f;
            return 0;
        }
        if (v->ndim == 0 && v->dtype == CKPT_F64) {
            memcpy(out, v->data, 8);
            return 0;
        }
        return -1;
    default: return -1;
    }
}

static int get_num(const ckpt_torch_value *d, const char *key, double *out, bool required,
                   double dflt, const char *what) {
    const ckpt_torch_value *v = ckpt_torch_dict_get(d, key);
    if (!v || v->kind == CKPT_TORCH_NONE) {
        if (required) return ckpt__err(CKPT_ECORRUPT, "import: %s has no '%s'", what, key);
        *out = dflt;
        return CKPT_OK;
    }
    if (number(v, out) < 0)
        return ckpt__err(CKPT_ECORRUPT, "import: %s: '%s' is a %s, not a number", what, key,
                         ckpt_torch_kind_name(v->kind));
    return CKPT_OK;
}

static int get_int(const ckpt_torch_value *d, const char *key, int64_t *out, const char *what) {
    const ckpt_torch_value *v = ckpt_torch_dict_get(d, key);
    if (!v || (v->kind != CKPT_TORCH_INT && v->kind != CKPT_TORCH_BOOL))
        return ckpt__err(CKPT_ECORRUPT, "import: %s: '%s' missing or not an int", what, key);
    *out = v->kind == CKPT_TORCH_INT ? v->i : v->b;
    return CKPT_OK;
}

static const ckpt_torch_value *int_key(const ckpt_torch_value *d, int64_t i) {
    if (!d || d->kind != CKPT_TORCH_DICT) return NULL;
    for (int64_t k = 0; k < d->n; k++)
        if (d->items[2 * k]->kind == CKPT_TORCH_INT && d->items[2 * k]->i == i)
            return d->items[2 * k + 1];
    return NULL;
}

/* ---- optimizer ------------------------------------------------------------------- */

/* Records the shape of state index i's state tensors (for import_param_names). */
static int note_state_shape(imp *x, int64_t i, int ndim, const int64_t *shape) {
    if (i >= x->opt_nshapes) {
        void *g = ckpt__realloc(x->opt_shapes, (size_t)(i + 1) * sizeof *x->opt_shapes);
        if (!g) return ckpt__err_nomem("import");
        x->opt_shapes = g;
        for (int64_t j = x->opt_nshapes; j <= i; j++) {
            memset(&x->opt_shapes[j], 0, sizeof x->opt_shapes[j]);
            x->opt_shapes[j].ndim = -1;
        }
        x->opt_nshapes = i + 1;
    }
    mparam *p = &x->opt_shapes[i];
    p->ndim = ndim;
    if (ndim > 0) memcpy(p->shape, shape, (size_t)ndim * sizeof *shape);
    return CKPT_OK;
}

static int state_tensor(imp *x, const char *file, int64_t i, const ckpt_torch_value *st,
                        const char *name, const ckpt_torch_value *like, char *key, size_t cap) {
    snprintf(key, cap, "state.%" PRId64 ".%s", i, name);
    const ckpt_torch_value *t = ckpt_torch_dict_get(st, name);
    if (t && t->kind == CKPT_TORCH_TENSOR) {
        if (t->dtype != CKPT_F32)
            return ckpt__err(CKPT_EUNSUPPORTED, "import: %s: state %" PRId64 " '%s' is %s (ckpt's "
                             "optimizers keep float32)", file, i, name, ckpt_dtype_name(t->dtype));
        CKPT_TRY(note_state_shape(x, i, t->ndim, t->shape));
        return ckpt_write_tensor(x->optim, key, CKPT_F32, t->ndim, t->shape, t->data);
    }
    /* not stepped yet: zeros of the parameter's shape */
    int ndim = 0;
    const int64_t *shape = NULL;
    if (like) {
        ndim = like->ndim;
        shape = like->shape;
    } else if (x->nparams > i) {
        ndim = x->params[i].ndim;
        shape = x->params[i].shape;
    } else {
        return ckpt__err(CKPT_EUNSUPPORTED, "import: %s: parameter %" PRId64 " has no state and "
                         "the model does not say its shape", file, i);
    }
    uint64_t nb = 0;
    CKPT_TRY(ckpt_tensor_nbytes(CKPT_F32, ndim, shape, &nb));
    void *z = keep(x, ckpt__calloc(1, nb ? (size_t)nb : 1));
    if (!z) return ckpt__err_nomem("import");
    return ckpt_write_tensor(x->optim, key, CKPT_F32, ndim, shape, z);
}

/* A torch param_group's hyper-parameters into *op (which holds the kind's
 * defaults for the fields a file may lack), by the kind's descriptor: lr is
 * required, a pair ("betas") must be two numbers. */
static int read_torch_group(const ckpt_torch_value *gr, const ckpt_optim_desc *d,
                            ckpt_optim_options *op, const char *what) {
    CKPT_TRY(get_num(gr, "lr", &op->lr, true, 0, what));
    double v = 0;
    CKPT_TRY(get_num(gr, "weight_decay", &op->weight_decay, false, 0, what));
    CKPT_TRY(get_num(gr, "maximize", &v, false, 0, what));
    op->maximize = v != 0;
    for (int f = 0; f < d->ntorch_fields; f++) {
        const ckpt_torch_field *tf = &d->torch_fields[f];
        const char *keys[2] = {tf->key, tf->key2};
        double vals[2] = {0, 0};
        if (tf->kind == CKPT_TF_HPARAM) {
            if (!strcmp(tf->key, "lr") || !strcmp(tf->key, "weight_decay") ||
                !strcmp(tf->key, "maximize"))
                continue;
        } else if (tf->kind != CKPT_TF_PAIR) {
            continue;
        }
        for (int h = 0; h < d->nhparams; h++) {
            const ckpt_optim_hparam *hp = &d->hparams[h];
            char *field = (char *)op + hp->offset;
            int which = !strcmp(hp->key, keys[0])              ? 0
                        : keys[1] && !strcmp(hp->key, keys[1]) ? 1
                                                               : -1;
            if (which < 0) continue;
            if (tf->kind == CKPT_TF_PAIR) {
                const ckpt_torch_value *b = ckpt_torch_dict_get(gr, tf->name);
                if (!b || (b->kind != CKPT_TORCH_TUPLE && b->kind != CKPT_TORCH_LIST) ||
                    b->n != 2 || number(b->items[0], &vals[0]) < 0 ||
                    number(b->items[1], &vals[1]) < 0)
                    return ckpt__err(CKPT_ECORRUPT, "import: %s: '%s' is not a pair of numbers",
                                     what, tf->name);
                v = vals[which];
            } else {
                double dflt = hp->is_bool ? *(const bool *)field : *(const double *)field;
                CKPT_TRY(get_num(gr, tf->name, &v, false, dflt, what));
            }
            if (hp->is_bool) *(bool *)field = v != 0;
            else *(double *)field = v;
        }
    }
    return CKPT_OK;
}

static int import_optimizer(imp *x, const char *path) {
    const ckpt_torch_value *root = NULL;
    CKPT_TRY(open_torch(x, path, &root));
    const ckpt_torch_value *state = ckpt_torch_dict_get(root, "state");
    const ckpt_torch_value *groups = ckpt_torch_dict_get(root, "param_groups");
    if (!state || state->kind != CKPT_TORCH_DICT || !groups || groups->kind != CKPT_TORCH_LIST ||
        groups->n == 0)
        return ckpt__err(CKPT_ECORRUPT, "import: %s: not an optimizer state dict (no 'state' dict "
                         "and 'param_groups' list)", path);
    ckpt_optim_kind kind = x->o.optimizer;
    if (!kind) {
        /* the kind whose own number fields the group has (Adam and AdamW
         * share theirs) */
        const ckpt_torch_value *g0 = groups->items[0];
        for (int i = 0; i < ckpt__optim_desc_count() && !kind; i++) {
            const ckpt_optim_desc *d = ckpt__optim_desc_at(i);
            bool all = true;
            for (int h = 0; h < d->nhparams && all; h++) {
                char field[32];
                snprintf(field, sizeof field, "%s", d->hparams[h].key);
                char *dot = strchr(field, '.'); /* "betas.0": the pair "betas" */
                if (dot) *dot = '\0';
                all = d->hparams[h].is_bool || ckpt_torch_dict_get(g0, field) != NULL;
            }
            if (all) kind = d->kind;
        }
        if (kind == CKPT_OPTIM_ADAM || kind == CKPT_OPTIM_ADAMW) {
            /* Adam and AdamW keep the same fields; without weight decay they
             * compute the same thing */
            bool decay = false;
            for (int64_t g = 0; g < groups->n; g++) {
                double wd = 0;
                CKPT_TRY(get_num(groups->items[g], "weight_decay", &wd, false, 0, path));
                if (wd != 0) decay = true;
            }
            if (decay)
                return ckpt__err(CKPT_EINVAL, "import: %s: Adam or AdamW state with weight decay "
                                 "(the file cannot say which); give the optimizer kind "
                                 "(--optimizer adam|adamw)", path);
            kind = CKPT_OPTIM_ADAM;
        } else if (!kind) {
            return ckpt__err(CKPT_EUNSUPPORTED,
                             "import: %s: an optimizer other than SGD, Adam, "
                             "AdamW or RMSprop",
                             path);
        }
    }
    const ckpt_optim_desc *d = ckpt__optim_desc(kind);
    if (!d) return ckpt__err(CKPT_EINVAL, "import: optimizer kind %d", (int)kind);
    CKPT_TRY(ckpt_writer_new(&x->optim));
    CKPT_TRY(ckpt_write_str(x->optim, "kind", d->name));
    char key[160], what[200];
    int64_t idx = 0;
    for (int64_t g = 0; g < groups->n; g++) {
        const ckpt_torch_value *gr = groups->items[g];
        snprintf(what, sizeof what, "%s: param_groups[%" PRId64 "]", path, g);
        if (gr->kind != CKPT_TORCH_DICT)
            return ckpt__err(CKPT_ECORRUPT, "import: %s is not a dict", what);
        const ckpt_torch_value *params = ckpt_torch_dict_get(gr, "params");
        if (!params || params->kind != CKPT_TORCH_LIST)
            return ckpt__err(CKPT_ECORRUPT, "import: %s has no 'params' list", what);
#define GK(name) (snprintf(key, sizeof key, "param_groups.%" PRId64 ".%s", g, name), key)
        ckpt_optim_options op = ckpt_optim_defaults(kind);
        CKPT_TRY(read_torch_group(gr, d, &op, what));
        CKPT_TRY(ckpt_write_f64(x->optim, GK("lr"), op.lr));
        CKPT_TRY(ckpt_write_f64(x->optim, GK("weight_decay"), op.weight_decay));
        CKPT_TRY(ckpt_write_i64(x->optim, GK("maximize"), op.maximize));
        for (int h = 0; h < d->nhparams; h++) {
            const char *field = (const char *)&op + d->hparams[h].offset;
            if (d->hparams[h].is_bool)
                CKPT_TRY(ckpt_write_i64(x->optim, GK(d->hparams[h].key), *(const bool *)field));
            else CKPT_TRY(ckpt_write_f64(x->optim, GK(d->hparams[h].key), *(const double *)field));
        }
        /* PyTorch 2.6 on keeps the parameters' names beside their indices */
        const ckpt_torch_value *names = ckpt_torch_dict_get(gr, "param_names");
        if (names && (names->kind != CKPT_TORCH_LIST || names->n != params->n))
            return ckpt__err(CKPT_ECORRUPT, "import: %s: 'param_names' is not a list as long as "
                             "'params'", what);
        if (names) x->opt_named = true;
        for (int64_t j = 0; names && j < names->n; j++) {
            const ckpt_torch_value *nm = names->items[j];
            if (nm->kind != CKPT_TORCH_STR)
                return ckpt__err(CKPT_ECORRUPT,
                                 "import: %s: param_names[%" PRId64 "] is not a string", what, j);
            snprintf(key, sizeof key, "param_names.%" PRId64, idx + j);
            CKPT_TRY(ckpt_write_str(x->optim, key, nm->s));
        }
        int64_t *ids = keep(x, ckpt__calloc(params->n ? (size_t)params->n : 1, sizeof *ids));
        if (!ids) return ckpt__err_nomem("import");
        for (int64_t j = 0; j < params->n; j++) {
            const ckpt_torch_value *p = params->items[j];
            if (p->kind != CKPT_TORCH_INT || p->i != idx)
                return ckpt__err(CKPT_EUNSUPPORTED,
                                 "import: %s: params[%" PRId64 "] is not %" PRId64
                                 " (ckpt numbers parameters group by group, in order)",
                                 what, j, idx);
            ids[j] = idx;
            const ckpt_torch_value *st = int_key(state, idx);
            if (st && st->kind != CKPT_TORCH_DICT)
                return ckpt__err(CKPT_ECORRUPT, "import: %s: state %" PRId64 " is not a dict", path,
                                 idx);
            float *step = keep(x, ckpt__calloc(1, sizeof *step));
            if (!step) return ckpt__err_nomem("import");
            if (d->torch_step == CKPT_TORCH_STEP_NONE) {
                *step = st ? 1.0f : 0.0f; /* PyTorch's SGD keeps no count; ckpt needs "stepped" */
            } else {
                double sv = 0;
                if (st) CKPT_TRY(get_num(st, "step", &sv, true, 0, path));
                *step = (float)sv;
                if (sv > (double)x->opt_step) x->opt_step = (int64_t)sv;
            }
            /* zeros of the first state tensor's shape where a buffer is missing */
            const ckpt_torch_value *like = NULL;
            for (int b = 0; b < d->nbuffers && !like && d->torch_step != CKPT_TORCH_STEP_NONE;
                 b++) {
                like = ckpt_torch_dict_get(st, d->buffers[b]);
                if (like && like->kind != CKPT_TORCH_TENSOR) like = NULL;
            }
            for (int b = 0; b < d->nbuffers; b++) {
                if (!d->needs(b, &op)) continue;
                const ckpt_torch_value *bv = ckpt_torch_dict_get(st, d->buffers[b]);
                if (d->torch_none_buffer && bv && bv->kind == CKPT_TORCH_NONE) *step = 0.0f;
                CKPT_TRY(state_tensor(x, path, idx, st, d->buffers[b], like, key, sizeof key));
            }
            /* a master (ckpt export of master_weights state): carried as it is */
            const ckpt_torch_value *mv = ckpt_torch_dict_get(st, "master");
            if (mv && mv->kind != CKPT_TORCH_TENSOR)
                return ckpt__err(CKPT_ECORRUPT,
                                 "import: %s: state %" PRId64 " 'master' is not a tensor", path,
                                 idx);
            if (mv) CKPT_TRY(state_tensor(x, path, idx, st, "master", NULL, key, sizeof key));
            snprintf(key, sizeof key, "state.%" PRId64 ".step", idx);
            CKPT_TRY(ckpt_write_tensor(x->optim, key, CKPT_F32, 0, NULL, step));
            idx++;
        }
        int64_t n = params->n;
        CKPT_TRY(ckpt_write_tensor(x->optim, GK("params"), CKPT_I64, 1, &n, ids));
#undef GK
    }
    if (state->n > idx)
        return ckpt__err(CKPT_ECORRUPT, "import: %s: state for %" PRId64 " parameters, the groups "
                         "hold %" PRId64, path, state->n, idx);
    x->opt_groups = (int)groups->n;
    x->opt_count = idx;
    return CKPT_OK;
}

/* ---- scheduler, scaler ------------------------------------------------------------ */

static int lr_list(imp *x, const ckpt_torch_value *root, const char *name, const char *path,
                   int *n) {
    const ckpt_torch_value *l = ckpt_torch_dict_get(root, name);
    if (!l || l->kind != CKPT_TORCH_LIST)
        return ckpt__err(CKPT_ECORRUPT, "import: %s: '%s' is not a list", path, name);
    char key[64];
    for (int64_t g = 0; g < l->n; g++) {
        double v = 0;
        if (number(l->items[g], &v) < 0)
            return ckpt__err(CKPT_ECORRUPT, "import: %s: %s[%" PRId64 "] is not a number", path,
                             name, g);
        snprintf(key, sizeof key, "%s.%" PRId64, name, g);
        CKPT_TRY(ckpt_write_f64(x->sched, key, v));
    }
    *n = (int)l->n;
    return CKPT_OK;
}

static int import_scheduler(imp *x, const char *path) {
    const ckpt_torch_value *root = NULL;
    CKPT_TRY(open_torch(x, path, &root));
    const char *kind = x->o.scheduler;
    const ckpt_torch_value *lambdas = ckpt_torch_dict_get(root, "lr_lambdas");
    const ckpt_torch_value *l0 =
        lambdas && lambdas->kind == CKPT_TORCH_LIST && lambdas->n ? lambdas->items[0] : NULL;
    if (l0 && l0->kind != CKPT_TORCH_DICT) l0 = NULL;
    if (!kind) {
        if (lambdas) {
            if (l0 && ckpt_torch_dict_get(l0, "num_cycles")) kind = "warmup_cosine";
            else if (l0 && ckpt_torch_dict_get(l0, "num_training_steps")) kind = "warmup_linear";
            else if (l0 && ckpt_torch_dict_get(l0, "num_warmup_steps")) kind = "constant";
            else
                return ckpt__err(CKPT_EINVAL, "import: %s: a LambdaLR whose lambdas the file does "
                                 "not describe; give the schedule (--scheduler warmup_cosine|"
                                 "warmup_linear|constant --warmup N --total N)", path);
        } else if (ckpt_torch_dict_get(root, "step_size")) kind = "steplr";
        else if (ckpt_torch_dict_get(root, "T_max")) kind = "cosineannealinglr";
        else if (ckpt_torch_dict_get(root, "gamma")) kind = "exponentiallr";
        else
            return ckpt__err(CKPT_EUNSUPPORTED, "import: %s: a scheduler ckpt does not know", path);
    }
    bool lambda = !strcmp(kind, "warmup_cosine") || !strcmp(kind, "warmup_linear") ||
                  !strcmp(kind, "constant");
    if (!lambda && strcmp(kind, "steplr") && strcmp(kind, "cosineannealinglr") &&
        strcmp(kind, "exponentiallr"))
        return ckpt__err(CKPT_EUNSUPPORTED, "import: scheduler kind '%s' (steplr, exponentiallr, "
                         "cosineannealinglr, warmup_cosine, warmup_linear, constant)", kind);
    CKPT_TRY(ckpt_writer_new(&x->sched));
    int64_t le = 0, sc = 0, iv = 0;
    double v = 0;
    CKPT_TRY(ckpt_write_str(x->sched, "kind", kind));
    CKPT_TRY(get_int(root, "last_epoch", &le, path));
    CKPT_TRY(get_int(root, "_step_count", &sc, path));
    CKPT_TRY(ckpt_write_i64(x->sched, "last_epoch", le));
    CKPT_TRY(ckpt_write_i64(x->sched, "_step_count", sc));
    int nb = 0, nl = 0;
    CKPT_TRY(lr_list(x, root, "base_lrs", path, &nb));
    CKPT_TRY(lr_list(x, root, "_last_lr", path, &nl));
    if (nb != nl || (x->opt_groups && nb != x->opt_groups))
        return ckpt__err(CKPT_EMISMATCH,
                         "import: %s: %d base_lrs, %d _last_lr, the optimizer has %d "
                         "groups",
                         path, nb, nl, x->opt_groups);
    if (!strcmp(kind, "steplr")) {
        CKPT_TRY(get_int(root, "step_size", &iv, path));
        CKPT_TRY(ckpt_write_i64(x->sched, "step_size", iv));
    }
    if (!strcmp(kind, "steplr") || !strcmp(kind, "exponentiallr")) {
        CKPT_TRY(get_num(root, "gamma", &v, true, 0, path));
        CKPT_TRY(ckpt_write_f64(x->sched, "gamma", v));
    }
    if (!strcmp(kind, "cosineannealinglr")) {
        CKPT_TRY(get_int(root, "T_max", &iv, path));
        CKPT_TRY(ckpt_write_i64(x->sched, "T_max", iv));
        CKPT_TRY(get_num(root, "eta_min", &v, true, 0, path));
        CKPT_TRY(ckpt_write_f64(x->sched, "eta_min", v));
    }
    if (lambda) {
        int64_t warmup = x->o.warmup, total = x->o.total;
        if (warmup < 0 && l0 && ckpt_torch_dict_get(l0, "num_warmup_steps"))
            CKPT_TRY(get_int(l0, "num_warmup_steps", &warmup, path));
        if (total < 0 && l0 && ckpt_torch_dict_get(l0, "num_training_steps"))
            CKPT_TRY(get_int(l0, "num_training_steps", &total, path));
        if (warmup < 0 || (total < 0 && strcmp(kind, "constant")))
            return ckpt__err(CKPT_EINVAL,
                             "import: %s: the %s schedule's warmup and total steps are "
                             "not in the file; give them (--warmup N --total N)",
                             path, kind);
        CKPT_TRY(ckpt_write_i64(x->sched, "warmup", warmup));
        if (strcmp(kind, "constant")) CKPT_TRY(ckpt_write_i64(x->sched, "total", total));
    }
    return CKPT_OK;
}

static int import_scaler(imp *x, const char *path) {
    const ckpt_torch_value *root = NULL;
    CKPT_TRY(open_torch(x, path, &root));
    if (root->n == 0) return CKPT_OK; /* a disabled GradScaler saves {} */
    double scale = 0, gf = 0, bf = 0;
    int64_t gi = 0, gt = 0;
    CKPT_TRY(get_num(root, "scale", &scale, true, 0, path));
    CKPT_TRY(get_num(root, "growth_factor", &gf, true, 0, path));
    CKPT_TRY(get_num(root, "backoff_factor", &bf, true, 0, path));
    CKPT_TRY(get_int(root, "growth_interval", &gi, path));
    CKPT_TRY(get_int(root, "_growth_tracker", &gt, path));
    CKPT_TRY(ckpt_writer_new(&x->scaler));
    CKPT_TRY(ckpt_write_f64(x->scaler, "scale", scale));
    CKPT_TRY(ckpt_write_f64(x->scaler, "growth_factor", gf));
    CKPT_TRY(ckpt_write_f64(x->scaler, "backoff_factor", bf));
    CKPT_TRY(ckpt_write_i64(x->scaler, "growth_interval", gi));
    return ckpt_write_i64(x->scaler, "_growth_tracker", gt);
}

/* ---- the checkpoint ------------------------------------------------------------------ */

static int write_obj(ckpt_writer *w, const char *tmp, const char *name, const char *kind,
                     ckpt_manifest *m) {
    if (!w) return CKPT_OK;
    char *p = ckpt__path_join(tmp, name);
    if (!p) return ckpt__err_nomem("import");
    ckpt_file_digest d;
    memset(&d, 0, sizeof d);
    int rc = ckpt__writer_write_new(w, p, &d);
    if (rc == 0) rc = ckpt__manifest_add(m, name, kind, &d);
    ckpt__file_digest_free(&d);
    free(p);
    return rc;
}

/* ---- parameter names --------------------------------------------------------------- */

/* Whether state index i's state tensors have the shape of model tensor p
 * (true when it has none: a parameter torch never stepped). */
static bool state_fits(const imp *x, int64_t i, const mparam *p) {
    if (i >= x->opt_nshapes || x->opt_shapes[i].ndim < 0) return true;
    const mparam *s = &x->opt_shapes[i];
    if (s->ndim != p->ndim) return false;
    for (int d = 0; d < p->ndim; d++)
        if (s->shape[d] != p->shape[d]) return false;
    return true;
}

static const mparam *model_tensor(const imp *x, const char *name) {
    for (int64_t i = 0; i < x->nparams; i++)
        if (!strcmp(x->params[i].name, name)) return &x->params[i];
    return NULL;
}

/* The names the user gave (ckpt_import_options.param_names), checked: one
 * per optimizer parameter, distinct, each a model tensor whose shape is its
 * state's. */
static int given_param_names(imp *x, const char *src) {
    const ckpt_import_options *o = &x->o;
    if (!x->optim)
        return ckpt__err(CKPT_EINVAL,
                         "import: %s: parameter names given, but there is no "
                         "optimizer.bin to name",
                         src);
    if (x->opt_named)
        return ckpt__err(CKPT_EINVAL,
                         "import: %s: optimizer.bin names its parameters itself "
                         "(param_names); parameter names may not be given too",
                         src);
    if (o->num_param_names != x->opt_count || !o->param_names)
        return ckpt__err(CKPT_EINVAL,
                         "import: %s: %" PRId64 " parameter names given, "
                         "optimizer.bin has %" PRId64 " parameters",
                         src, o->num_param_names, x->opt_count);
    char key[64], a[200], b[200];
    for (int64_t i = 0; i < x->opt_count; i++) {
        const char *name = o->param_names[i];
        if (!name || !*name)
            return ckpt__err(CKPT_EINVAL, "import: parameter name %" PRId64 " is empty", i);
        for (int64_t j = 0; j < i; j++)
            if (!strcmp(o->param_names[j], name))
                return ckpt__err(CKPT_EINVAL,
                                 "import: parameter name '%s' given twice (for "
                                 "parameters %" PRId64 " and %" PRId64 ")",
                                 name, j, i);
        const mparam *p = model_tensor(x, name);
        if (!p)
            return ckpt__err(CKPT_EINVAL,
                             "import: %s: parameter name %" PRId64 " '%s' is not a "
                             "tensor of the model",
                             src, i, name);
        if (!state_fits(x, i, p))
            return ckpt__err(
                CKPT_EMISMATCH,
                "import: %s: parameter %" PRId64 " '%s' is %s in the "
                "model, its optimizer state is %s",
                src, i, name, ckpt__shape_str(a, sizeof a, p->ndim, p->shape),
                ckpt__shape_str(b, sizeof b, x->opt_shapes[i].ndim, x->opt_shapes[i].shape));
        snprintf(key, sizeof key, "param_names.%" PRId64, i);
        CKPT_TRY(ckpt_write_str(x->optim, key, name));
    }
    return CKPT_OK;
}

/* torch 1.13's optimizer.bin numbers its parameters without naming them,
 * and a load by position gives two same-shaped parameters registered in
 * another order each other's moments. So the import names them
 * (param_names.<i>): from the names the user gave, or where the mapping is
 * certain: the model is one pickled state dict (in torch's registration
 * order; safetensors files and Hugging Face indices sort their names), the
 * optimizer has one group (several groups may list the parameters in any
 * order), and the model's tensors and the optimizer's parameters pair one
 * to one in order with equal shapes (a buffer, a frozen or a tied parameter
 * breaks the count). Otherwise the state stays unnamed, and a load refuses
 * it unless allowed by position. */
static int import_param_names(imp *x, const char *src) {
    if (x->o.param_names || x->o.num_param_names) return given_param_names(x, src);
    if (!x->optim || x->opt_named) return CKPT_OK;
    if (!x->model_in_order || x->opt_groups != 1 || x->nparams != x->opt_count) return CKPT_OK;
    for (int64_t i = 0; i < x->opt_count; i++)
        if (!state_fits(x, i, &x->params[i])) return CKPT_OK;
    char key[64];
    for (int64_t i = 0; i < x->opt_count; i++) {
        snprintf(key, sizeof key, "param_names.%" PRId64, i);
        CKPT_TRY(ckpt_write_str(x->optim, key, x->params[i].name));
    }
    return CKPT_OK;
}

static int import_sources(imp *x, const char *src) {
    struct stat st;
    if (ckpt__os_stat(src, &st) != 0) return ckpt__err_os(errno, "import: %s", src);
    bool dir = S_ISDIR(st.st_mode);
    CKPT_TRY(ckpt_writer_new(&x->model));
    CKPT_TRY(import_model(x, src, dir));
    if (dir) {
        static const char *const files[] = {"optimizer.bin", "scheduler.bin", "scaler.pt"};
        int (*const fns[])(imp *, const char *) = {import_optimizer, import_scheduler,
                                                   import_scaler};
        for (int i = 0; i < 3; i++) {
            char *p = ckpt__path_join(src, files[i]);
            if (!p) return ckpt__err_nomem("import");
            int rc = present(p) ? fns[i](x, p) : 0;
            free(p);
            CKPT_TRY(rc);
        }
    }
    CKPT_TRY(import_param_names(x, src));
    CKPT_TRY(ckpt_writer_new(&x->rng));
    ckpt_rng_seed_stream(&x->gen, x->o.seed, 0);
    return ckpt_rng_ops()->state_dict(&x->gen, x->rng);
}

int ckpt_import_torch(const char *src, const char *checkpoint_dir, const ckpt_import_options *opt) {
    if (!src || !checkpoint_dir) return ckpt__err(CKPT_EINVAL, "import: NULL argument");
    imp x;
    memset(&x, 0, sizeof x);
    x.o = opt ? *opt : defaults();
    x.opt_step = -1;
    struct stat st;
    if (ckpt__os_lstat(checkpoint_dir, &st) == 0)
        return ckpt__err(CKPT_EEXIST, "import: %s already exists", checkpoint_dir);
    int rc = import_sources(&x, src);
    if (rc == 0) rc = check_output_size(&x, src);
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    ckpt_txn t = {0};
    if (rc == 0) rc = ckpt__txn_begin(&t, checkpoint_dir, "import", true, NULL);
    const char *tmp = t.tmp;
    if (rc == 0) rc = write_obj(x.model, tmp, "model.safetensors", "model", &m);
    if (rc == 0) rc = write_obj(x.optim, tmp, "optimizer.safetensors", "optimizer", &m);
    if (rc == 0) rc = write_obj(x.sched, tmp, "scheduler.safetensors", "scheduler", &m);
    if (rc == 0) rc = write_obj(x.scaler, tmp, "scaler.safetensors", "scaler", &m);
    if (rc == 0) rc = write_obj(x.rng, tmp, "random_states_0.safetensors", "random_states", &m);
    if (rc == 0) {
        m.step = x.o.step >= 0 ? x.o.step : x.opt_step > 0 ? x.opt_step : 0;
        m.iteration = 0;
        m.process_index = 0;
        m.num_processes = 1;
        rc = ckpt__manifest_write(&m, tmp);
    }
    if (rc == 0) rc = ckpt__txn_commit(&t, false, NULL);
    ckpt__txn_end(&t, NULL);
    if (rc < 0) rc = ckpt__err_prefix(rc, "import %s", src);
    ckpt__manifest_clear(&m);
    imp_free(&x);
    return rc;
}

/* ---- weights straight into a model ---------------------------------------- */

int ckpt_model_load_weights(ckpt_model *m, const char *src, const ckpt_load_options *opt,
                            ckpt_load_report *report) {
    if (report) memset(report, 0, sizeof *report);
    if (!m || !src) return ckpt__err(CKPT_EINVAL, "load_weights: NULL argument");
    ckpt_load_options none;
    memset(&none, 0, sizeof none);
    if (!opt) opt = &none;
    CKPT_TRY(ckpt__keymap_check(opt, "load_weights"));
    imp x;
    memset(&x, 0, sizeof x);
    x.o = defaults();
    ckpt_reader *file = NULL;
    int64_t step = 0;
    struct stat st;
    int rc = ckpt__os_stat(src, &st) == 0 ? CKPT_OK : ckpt__err_os(errno, "load_weights: %s", src);
    char *manifest = rc == 0 ? ckpt__path_join(src, "checkpoint.json") : NULL;
    if (rc == 0 && !manifest) rc = ckpt__err_nomem("load_weights");
    if (rc == 0 && S_ISDIR(st.st_mode) && present(manifest)) {
        /* a ckpt checkpoint: its first model, verified against the manifest */
        rc = ckpt_checkpoint_open_object(src, "model.safetensors", &file);
        ckpt_manifest man;
        if (rc == 0 && ckpt__manifest_read(src, &man) == 0) { /* for the report's step */
            step = man.step;
            ckpt__manifest_clear(&man);
        }
    } else if (rc == 0) {
        /* Hugging Face / PyTorch weights, read by import's readers (no copy) */
        rc = ckpt_writer_new(&x.model);
        if (rc == 0) rc = import_model(&x, src, S_ISDIR(st.st_mode));
        if (rc == 0) rc = ckpt__reader_new_adapted(&file, src);
        if (rc == 0) rc = ckpt__reader_put_writer_views(file, x.model);
    }
    free(manifest);
    /* The rest is the load op's (accel/load_op.h) from its read phase on,
     * with this source: match, adapt and check (nothing changes before all
     * of it passed), then apply. */
    ckpt__load_op *op = NULL;
    if (rc == 0)
        rc = ckpt__load_op_new_object(K_MODEL, ckpt_model_ops(), m, opt, report, "load_weights",
                                      &op);
    if (op) {
        ckpt__load_op_read_from(op, src, step, file); /* takes file over */
        file = NULL;
        ckpt__load_op_check(op);
        ckpt__load_op_agree(op);
        ckpt__load_op_apply(op);
        rc = ckpt__load_op_finish(op);
        ckpt__load_op_free(op);
    }
    if (rc < 0 && report) ckpt_load_report_free(report);
    if (rc < 0) rc = ckpt__err_prefix(rc, "load_weights");
    ckpt_reader_free(file);
    imp_free(&x);
    return rc;
}
