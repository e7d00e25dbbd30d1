/* torch_export.c — ckpt_export_torch: a complete checkpoint as the folder
 * Accelerate's save_state writes, in the exact structures of PyTorch's
 * state_dict()s (docs/PYTORCH.md has the mapping). Written into a temporary
 * folder and published whole. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/error.h"
#include "base/io.h"
#include "format/hfindex.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/s3/project.h"
#include "store/s3/s3.h"
#include "store/store.h"
#include "store/txn.h"
#include "train/optim.h"

static const char readme_text[] =
    "# PyTorch export of a ckpt checkpoint\n"
    "\n"
    "Written by `ckpt export`. The files are what Hugging Face Accelerate's\n"
    "`save_state` writes and load into PyTorch objects as they are:\n"
    "\n"
    "- `model.safetensors` (or `model-0000k-of-0000N.safetensors` shards and\n"
    "  `model.safetensors.index.json`): `model.load_state_dict(...)`; with\n"
    "  `ckpt export --bin`, `pytorch_model.bin` (or `pytorch_model-0000k-of-0000N.bin`\n"
    "  and `pytorch_model.bin.index.json`) instead, for PyTorch without the\n"
    "  safetensors package\n"
    "- `optimizer.bin`: `optimizer.load_state_dict(torch.load(..., weights_only=True))`\n"
    "  for `torch.optim.SGD`, `Adam` or `AdamW` built over the same parameters, in\n"
    "  the same groups, in the same order\n"
    "- `scheduler.bin`: the matching `torch.optim.lr_scheduler` state dict\n"
    "  (warmup schedules are `LambdaLR`; build yours with the same lambda)\n"
    "- `scaler.pt`: `GradScaler.load_state_dict(...)`\n"
    "- `custom_checkpoint_<i>.pkl` (the i-th unnamed custom object, the name\n"
    "  Accelerate gives it) and `<name>.pkl` (a named one): the object's state\n"
    "  dict, flat (`torch.load(..., weights_only=True)` gives a dict: tensors,\n"
    "  ints, floats, strings, byte strings as uint8 tensors, a tied name as a\n"
    "  second key on the same storage) for its `load_state_dict`\n"
    "\n"
    "What does not carry over:\n"
    "\n"
    "- random numbers: ckpt draws from Philox4x32-10 generators, PyTorch from its\n"
    "  own; dropout masks and data order after the resume differ from what the C\n"
    "  run would have drawn.\n"
    "- data order: the data loader's position (epoch, batches yielded, shuffle\n"
    "  seed) has no PyTorch counterpart; skip the batches yourself\n"
    "  (`accelerator.skip_first_batches`).\n"
    "- a custom object holding a tensor of a dtype PyTorch has no storage for\n"
    "  (U16, U32, U64, F8...): listed at the end of this file when there is one.\n"
    "\n"
    "Which PyTorch opens what with `torch.load(..., weights_only=True)`:\n"
    "\n"
    "- PyTorch 2.x: every `.bin` and `.pt` file here.\n"
    "- PyTorch 1.13 (Debian 12's): `pytorch_model.bin` and its shards only. Its\n"
    "  weights-only unpickler lacks the float opcode (BINFLOAT) and refuses any\n"
    "  file with a Python float in it: `optimizer.bin`, `scheduler.bin`,\n"
    "  `scaler.pt` (as it refuses PyTorch's own optimizer files) and a custom\n"
    "  object's `.pkl` with a float in it. There, load the\n"
    "  state straight from the ckpt checkpoint this folder was exported from, with\n"
    "  python/ckpt_torch (in the ckpt sources), which reads only safetensors and\n"
    "  JSON and never unpickles: `ckpt_torch.load(CHECKPOINT, model=model,\n"
    "  optimizer=optimizer, scheduler=scheduler, scaler=scaler)`. Never fall back\n"
    "  to `weights_only=False` for a file you did not write yourself.\n";

/* ---- small helpers ------------------------------------------------------- */

typedef struct exp_ctx {
    const char *src;
    char *tmp;
    ckpt_manifest m;
    ckpt_reader **readers;
    int nreaders;
    char *left_out; /* README lines: the custom objects PyTorch cannot hold */
    void **kept;    /* buffers a torch writer borrows until the export ends */
    int nkept;
} exp_ctx;

static int reader_keep(exp_ctx *c, void *p) {
    void *grown = ckpt__realloc(c->kept, (size_t)(c->nkept + 1) * sizeof *c->kept);
    if (!grown) return ckpt__err_nomem("export");
    c->kept = grown;
    c->kept[c->nkept++] = p;
    return CKPT_OK;
}

static int open_state(exp_ctx *c, const char *file, ckpt_reader **out) {
    char *p = ckpt__path_join(c->src, file);
    if (!p) return ckpt__err_nomem("export");
    void *grown = ckpt__realloc(c->readers, (size_t)(c->nreaders + 1) * sizeof *c->readers);
    if (!grown) {
        free(p);
        return ckpt__err_nomem("export");
    }
    c->readers = grown;
    /* the object as the checkpoint holds it: with its shard files, or from
     * Hugging Face shards and their index */
    int rc = ckpt_checkpoint_open_object(c->src, file, out);
    if (rc == CKPT_ENOENT) rc = ckpt_reader_open(out, p);
    free(p);
    if (rc == 0) c->readers[c->nreaders++] = *out;
    return rc;
}

static bool has(const ckpt_reader *r, const char *key) {
    return ckpt_reader_find(r, key, NULL) == 0;
}

static int get_f64(const ckpt_reader *r, const char *key, double *v, const char *file) {
    int rc = ckpt_read_f64((ckpt_reader *)r, key, v);
    return rc < 0 ? ckpt__err_prefix(rc, "%s", file) : rc;
}
static int get_i64(const ckpt_reader *r, const char *key, int64_t *v, const char *file) {
    int rc = ckpt_read_i64((ckpt_reader *)r, key, v);
    return rc < 0 ? ckpt__err_prefix(rc, "%s", file) : rc;
}

static int put_key_f64(ckpt_torch_writer *w, const char *key, double v) {
    CKPT_TRY(ckpt_torch_put_str(w, key));
    return ckpt_torch_put_float(w, v);
}
static int put_key_i64(ckpt_torch_writer *w, const char *key, int64_t v) {
    CKPT_TRY(ckpt_torch_put_str(w, key));
    return ckpt_torch_put_int(w, v);
}
static int put_key_bool(ckpt_torch_writer *w, const char *key, bool v) {
    CKPT_TRY(ckpt_torch_put_str(w, key));
    return ckpt_torch_put_bool(w, v);
}
static int put_key_none(ckpt_torch_writer *w, const char *key) {
    CKPT_TRY(ckpt_torch_put_str(w, key));
    return ckpt_torch_put_none(w);
}

static int save_torch(exp_ctx *c, ckpt_torch_writer *w, const char *name) {
    char *p = ckpt__path_join(c->tmp, name);
    if (!p) return ckpt__err_nomem("export");
    int rc = ckpt_torch_writer_save(w, p);
    free(p);
    return rc;
}

/* The k-th object of a kind is <stem>.safetensors or <stem>_<k>.safetensors. */
static int object_index(const char *file, const char *stem) {
    size_t n = strlen(stem);
    if (strncmp(file, stem, n) != 0) return -1;
    if (strcmp(file + n, ".safetensors") == 0) return 0;
    int k = 0;
    char tail[32];
    if (file[n] == '_' && sscanf(file + n + 1, "%d%31s", &k, tail) == 2 && k > 0 &&
        strcmp(tail, ".safetensors") == 0)
        return k;
    return -1;
}

static void out_name(char *buf, size_t cap, const char *stem, int k, const char *ext) {
    if (k == 0) snprintf(buf, cap, "%s%s", stem, ext);
    else snprintf(buf, cap, "%s_%d%s", stem, k, ext);
}

/* ---- model ---------------------------------------------------------------- */

/* The tensors idx[0..n) of r (entry indices), and the aliases (tied names)
 * of r whose target is one of them. */
typedef struct shard_set {
    const int64_t *idx;
    int64_t n;
} shard_set;

static bool in_set(const ckpt_reader *r, const shard_set *set, const char *key) {
    for (int64_t k = 0; k < set->n; k++) {
        ckpt_entry_info e;
        if (ckpt_reader_entry(r, set->idx[k], &e) == 0 && strcmp(e.key, key) == 0) return true;
    }
    return false;
}

/* As model.safetensors: each tensor once, a tied name as an alias of its
 * tensor (with Hugging Face's record, see ckpt_write_alias). */
static int write_shard(exp_ctx *c, ckpt_reader *r, const shard_set *set, const char *name) {
    ckpt_writer *w = NULL;
    CKPT_TRY(ckpt_writer_new(&w));
    int rc = 0;
    for (int64_t k = 0; k < set->n && rc == 0; k++) {
        ckpt_entry_info e;
        const void *data = NULL;
        rc = ckpt_reader_entry(r, set->idx[k], &e);
        if (rc == 0) rc = ckpt_reader_tensor_view(r, e.key, &data, NULL);
        if (rc == 0) rc = ckpt_write_tensor(w, e.key, e.dtype, e.ndim, e.shape, data);
    }
    for (int64_t i = 0; i < ckpt_reader_count(r) && rc == 0; i++) {
        ckpt_entry_info e;
        rc = ckpt_reader_entry(r, i, &e);
        if (rc == 0 && e.kind == CKPT_ENTRY_ALIAS && in_set(r, set, e.target))
            rc = ckpt_write_alias(w, e.key, e.target);
    }
    char *p = rc == 0 ? ckpt__path_join(c->tmp, name) : NULL;
    if (rc == 0 && !p) rc = ckpt__err_nomem("export");
    if (rc == 0) rc = ckpt__writer_write_new(w, p, NULL);
    free(p);
    ckpt_writer_free(w);
    return rc;
}

typedef struct json_fill {
    const char *text;
} json_fill;
static int fill_text(ckpt_ostream *s, void *ctx) {
    const json_fill *j = ctx;
    return ckpt__ostream_write(s, j->text, strlen(j->text));
}
static int write_text(exp_ctx *c, const char *name, const char *text) {
    char *p = ckpt__path_join(c->tmp, name);
    if (!p) return ckpt__err_nomem("export");
    json_fill j = {text};
    int rc = ckpt__publish_file(p, fill_text, &j, NULL, NULL);
    free(p);
    return rc;
}

/* The tensors of set as one torch.save file: an OrderedDict of tensors,
 * what module.state_dict() gives torch.save; a tied name (an alias of one
 * of them) is a second key on the same storage, as torch.save writes tied
 * weights. */
static int write_shard_bin(exp_ctx *c, ckpt_reader *r, const shard_set *set, const char *name) {
    ckpt_torch_writer *w = NULL;
    CKPT_TRY(ckpt_torch_writer_new(&w));
    const void **views = ckpt__calloc((size_t)set->n + 1, sizeof *views);
    int rc = views ? ckpt_torch_begin_dict(w, true) : ckpt__err_nomem("export");
    for (int64_t k = 0; k < set->n && rc == 0; k++) {
        ckpt_entry_info e;
        rc = ckpt_reader_entry(r, set->idx[k], &e);
        if (rc == 0) rc = ckpt_reader_tensor_view(r, e.key, &views[k], NULL);
        if (rc == 0) rc = ckpt_torch_put_str(w, e.key);
        if (rc == 0) rc = ckpt_torch_put_tensor(w, e.dtype, e.ndim, e.shape, views[k]);
    }
    for (int64_t i = 0; i < ckpt_reader_count(r) && rc == 0; i++) {
        ckpt_entry_info e, t;
        rc = ckpt_reader_entry(r, i, &e);
        if (rc || e.kind != CKPT_ENTRY_ALIAS) continue;
        for (int64_t k = 0; k < set->n && rc == 0; k++) {
            rc = ckpt_reader_entry(r, set->idx[k], &t);
            if (rc || strcmp(t.key, e.target) != 0) continue;
            /* the target's very view: one storage in the file */
            rc = ckpt_torch_put_str(w, e.key);
            if (rc == 0) rc = ckpt_torch_put_tensor(w, t.dtype, t.ndim, t.shape, views[k]);
            break;
        }
    }
    if (rc == 0) rc = ckpt_torch_end(w);
    if (rc == 0) rc = save_torch(c, w, name);
    free(views);
    ckpt_torch_writer_free(w);
    return rc;
}

/* Every tensor entry of r, in order: *out (malloc'd) and *n. */
static int tensor_entries(const ckpt_reader *r, int64_t **out, int64_t *n) {
    int64_t count = ckpt_reader_count(r), k = 0;
    int64_t *v = ckpt__calloc((size_t)count + 1, sizeof *v);
    if (!v) return ckpt__err_nomem("export");
    for (int64_t i = 0; i < count; i++) {
        ckpt_entry_info e;
        if (ckpt_reader_entry(r, i, &e) == 0 && e.kind == CKPT_ENTRY_TENSOR) v[k++] = i;
    }
    *out = v;
    *n = k;
    return CKPT_OK;
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

/* A model the checkpoint keeps as Hugging Face shards
 * ("<object stem>-DDDDD-of-DDDDD.safetensors" + its index), exported as
 * .bin shards split exactly as the checkpoint's: part k becomes
 * "<stem>-DDDDD-of-DDDDD.bin" with the same tensors in the same order, and
 * "<stem>.bin.index.json" maps them. *done false if the model is one file. */
static int export_parts_bin(exp_ctx *c, const char *object, const char *stem, bool *done) {
    *done = false;
    size_t ostem = strlen(object) - strlen(".safetensors");
    char name[200];
    snprintf(name, sizeof name, "%s.index.json", object);
    if (!ckpt__manifest_find(&c->m, name)) return CKPT_OK;
    static const char tail[] = "-00000-of-00000.safetensors";
    const size_t digits = sizeof "-00000-of-00000" - 1;
    const char **parts = ckpt__calloc((size_t)c->m.nfiles + 1, sizeof *parts);
    if (!parts) return ckpt__err_nomem("export");
    int64_t np = 0;
    for (int64_t i = 0; i < c->m.nfiles; i++) {
        const char *f = c->m.files[i].name;
        if (strlen(f) == ostem + sizeof tail - 1 && !strncmp(f, object, ostem) && f[ostem] == '-')
            parts[np++] = f;
    }
    qsort(parts, (size_t)np, sizeof *parts, cmp_str);
    char **keys = NULL, (*files)[160] = NULL;
    int64_t nk = 0, cap = 0;
    uint64_t total = 0;
    int rc = CKPT_OK;
    for (int64_t p = 0; p < np && rc == 0; p++) {
        char bin[160];
        snprintf(bin, sizeof bin, "%s%.*s.bin", stem, (int)digits, parts[p] + ostem);
        /* a part by itself (the checkpoint was deep-verified first, as for
         * the files open_state reads plainly); freed below */
        ckpt_reader *r = NULL;
        char *path = ckpt__path_join(c->src, parts[p]);
        rc = path ? ckpt_reader_open(&r, path) : ckpt__err_nomem("export");
        free(path);
        int64_t n = rc == 0 ? ckpt_reader_count(r) : 0;
        if (rc == 0 && nk + n > cap) {
            cap = (nk + n) * 2;
            void *gk = ckpt__realloc(keys, (size_t)cap * sizeof *keys);
            if (gk) keys = gk;
            void *gf = gk ? ckpt__realloc(files, (size_t)cap * sizeof *files) : NULL;
            if (gf) files = gf;
            if (!gk || !gf) rc = ckpt__err_nomem("export");
        }
        /* tied names too: a .bin index lists both names of a shared storage */
        for (int64_t i = 0; i < n && rc == 0; i++) {
            ckpt_entry_info e;
            rc = ckpt_reader_entry(r, i, &e);
            if (rc == 0 && !(keys[nk] = ckpt__strdup(e.key))) rc = ckpt__err_nomem("export");
            if (rc == 0) {
                snprintf(files[nk++], sizeof files[0], "%s", bin);
                total += e.nbytes;
            }
        }
        int64_t *idx = NULL, ni = 0;
        if (rc == 0) rc = tensor_entries(r, &idx, &ni);
        if (rc == 0) rc = write_shard_bin(c, r, &(shard_set){idx, ni}, bin);
        free(idx);
        ckpt_reader_free(r);
    }
    char *index = NULL;
    const char **fv = rc == 0 ? ckpt__calloc((size_t)nk + 1, sizeof *fv) : NULL;
    if (rc == 0 && !fv) rc = ckpt__err_nomem("export");
    for (int64_t i = 0; i < nk && rc == 0; i++) fv[i] = files[i];
    if (rc == 0) rc = ckpt__hf_index_text((const char *const *)keys, fv, nk, total, &index);
    snprintf(name, sizeof name, "%s.bin.index.json", stem);
    if (rc == 0) rc = write_text(c, name, index);
    if (rc == 0) *done = true;
    free(index);
    free(fv);
    for (int64_t i = 0; i < nk; i++) free(keys[i]);
    free(keys);
    free(files);
    free(parts);
    return rc;
}

/* A .bin shard index lists a tied name with the shard of its target (one
 * storage); a .safetensors one, as Hugging Face's, only the tensors. */
static int bin_index(const ckpt_reader *r, const int64_t *idx, int64_t n, const ckpt_hf_layout *l,
                     char **out) {
    int64_t count = ckpt_reader_count(r), nk = 0;
    const char **keys = ckpt__calloc((size_t)count + 1, sizeof *keys);
    const char **files = ckpt__calloc((size_t)count + 1, sizeof *files);
    int rc = keys && files ? CKPT_OK : ckpt__err_nomem("export");
    uint64_t total = 0;
    for (int64_t s = 0; s < l->nshards && rc == 0; s++)
        for (int64_t k = l->starts[s]; k < l->starts[s + 1] && rc == 0; k++) {
            ckpt_entry_info e;
            rc = ckpt_reader_entry(r, idx[k], &e);
            keys[nk] = e.key;
            files[nk++] = l->names[s];
            total += e.nbytes;
        }
    for (int64_t i = 0; i < count && rc == 0; i++) {
        ckpt_entry_info e;
        rc = ckpt_reader_entry(r, i, &e);
        if (rc || e.kind != CKPT_ENTRY_ALIAS) continue;
        for (int64_t k = 0; k < n && k < nk; k++)
            if (strcmp(keys[k], e.target) == 0) {
                files[nk] = files[k];
                keys[nk++] = e.key;
                break;
            }
    }
    if (rc == 0) rc = ckpt__hf_index_text(keys, files, nk, total, out);
    free(keys);
    free(files);
    return rc;
}

static int export_model(exp_ctx *c, const char *file, int k, uint64_t max_shard, bool bin) {
    char stem[64], name[128];
    const char *ext = bin ? ".bin" : ".safetensors";
    out_name(stem, sizeof stem, bin ? "pytorch_model" : "model", k, "");
    if (bin && max_shard == 0) {
        bool done = false;
        CKPT_TRY(export_parts_bin(c, file, stem, &done));
        if (done) return CKPT_OK;
    }
    ckpt_reader *r = NULL;
    CKPT_TRY(open_state(c, file, &r));
    int64_t count = ckpt_reader_count(r), n = 0;
    for (int64_t i = 0; i < count; i++) {
        ckpt_entry_info e;
        CKPT_TRY(ckpt_reader_entry(r, i, &e));
        if (e.kind != CKPT_ENTRY_TENSOR && e.kind != CKPT_ENTRY_ALIAS)
            return ckpt__err(CKPT_ECORRUPT, "%s: entry '%s' is not a tensor", file, e.key);
    }
    int64_t *idx = NULL; /* the tensors; tied names go with their target */
    CKPT_TRY(tensor_entries(r, &idx, &n));
    uint64_t *nb = ckpt__calloc((size_t)n + 1, sizeof *nb);
    const char **keys = ckpt__calloc((size_t)n + 1, sizeof *keys);
    int rc = nb && keys ? CKPT_OK : ckpt__err_nomem("export");
    for (int64_t i = 0; i < n && rc == 0; i++) {
        ckpt_entry_info e;
        rc = ckpt_reader_entry(r, idx[i], &e);
        if (rc == 0) nb[i] = e.nbytes, keys[i] = e.key;
    }
    ckpt_hf_layout l;
    memset(&l, 0, sizeof l);
    if (rc == 0 && max_shard) rc = ckpt__hf_layout_make_ext(keys, nb, n, max_shard, stem, ext, &l);
    int (*write)(exp_ctx *, ckpt_reader *, const shard_set *, const char *) =
        bin ? write_shard_bin : write_shard;
    if (rc == 0 && l.nshards <= 1) { /* one file */
        snprintf(name, sizeof name, "%s%s", stem, ext);
        rc = write(c, r, &(shard_set){idx, n}, name);
    }
    for (int64_t s = 0; s < l.nshards && l.nshards > 1 && rc == 0; s++)
        rc =
            write(c, r, &(shard_set){idx + l.starts[s], l.starts[s + 1] - l.starts[s]}, l.names[s]);
    snprintf(name, sizeof name, "%s%s.index.json", stem, ext);
    char *index = NULL;
    if (rc == 0 && l.nshards > 1 && bin) rc = bin_index(r, idx, n, &l, &index);
    if (rc == 0 && l.nshards > 1) rc = write_text(c, name, index ? index : l.index);
    free(index);
    ckpt__hf_layout_free(&l);
    free(keys);
    free(nb);
    free(idx);
    return rc;
}

/* ---- optimizer -------------------------------------------------------------- */

static int count_groups(const ckpt_reader *r) {
    int g = 0;
    char key[64];
    for (;; g++) {
        snprintf(key, sizeof key, "param_groups.%d.params", g);
        if (!has(r, key)) return g;
    }
}

/* Group g's hyper-parameters as the descriptor lists them (lr,
 * weight_decay, maximize, then the kind's own). */
static int read_group_options(const ckpt_reader *r, const ckpt_optim_desc *d, int g,
                              ckpt_optim_options *op, const char *file) {
    char key[128];
    int64_t iv = 0;
    memset(op, 0, sizeof *op);
    snprintf(key, sizeof key, "param_groups.%d.lr", g);
    CKPT_TRY(get_f64(r, key, &op->lr, file));
    snprintf(key, sizeof key, "param_groups.%d.weight_decay", g);
    CKPT_TRY(get_f64(r, key, &op->weight_decay, file));
    snprintf(key, sizeof key, "param_groups.%d.maximize", g);
    CKPT_TRY(get_i64(r, key, &iv, file));
    op->maximize = iv != 0;
    for (int h = 0; h < d->nhparams; h++) {
        char *field = (char *)op + d->hparams[h].offset;
        snprintf(key, sizeof key, "param_groups.%d.%s", g, d->hparams[h].key);
        if (d->hparams[h].is_bool) {
            CKPT_TRY(get_i64(r, key, &iv, file));
            *(bool *)field = iv != 0;
        } else {
            CKPT_TRY(get_f64(r, key, (double *)field, file));
        }
    }
    return CKPT_OK;
}

/* The value of the hyper-parameter key of a group: *is_bool says its type. */
static double option_value(const ckpt_optim_desc *d, const ckpt_optim_options *op, const char *key,
                           bool *is_bool) {
    *is_bool = false;
    if (!strcmp(key, "lr")) return op->lr;
    if (!strcmp(key, "weight_decay")) return op->weight_decay;
    *is_bool = true;
    if (!strcmp(key, "maximize")) return op->maximize;
    for (int h = 0; h < d->nhparams; h++) {
        if (strcmp(d->hparams[h].key, key) != 0) continue;
        const char *field = (const char *)op + d->hparams[h].offset;
        *is_bool = d->hparams[h].is_bool;
        return *is_bool ? *(const bool *)field : *(const double *)field;
    }
    return 0; /* the descriptors name only their own keys */
}

/* One param_groups entry's fields, in the order PyTorch 1.13 writes them. */
static int put_group_fields(ckpt_torch_writer *w, const ckpt_optim_desc *d,
                            const ckpt_optim_options *op) {
    int rc = 0;
    bool b1 = false, b2 = false;
    for (int f = 0; f < d->ntorch_fields && rc == 0; f++) {
        const ckpt_torch_field *tf = &d->torch_fields[f];
        switch (tf->kind) {
        case CKPT_TF_HPARAM: {
            double v = option_value(d, op, tf->key, &b1);
            rc = b1 ? put_key_bool(w, tf->name, v != 0) : put_key_f64(w, tf->name, v);
            break;
        }
        case CKPT_TF_PAIR:
            rc = ckpt_torch_put_str(w, tf->name);
            if (rc == 0) rc = ckpt_torch_begin_tuple(w);
            if (rc == 0) rc = ckpt_torch_put_float(w, option_value(d, op, tf->key, &b1));
            if (rc == 0) rc = ckpt_torch_put_float(w, option_value(d, op, tf->key2, &b2));
            if (rc == 0) rc = ckpt_torch_end(w);
            break;
        case CKPT_TF_NONE: rc = put_key_none(w, tf->name); break;
        case CKPT_TF_FALSE: rc = put_key_bool(w, tf->name, false); break;
        }
    }
    return rc;
}

static int export_optimizer(exp_ctx *c, const char *file, int k, const ckpt_reader *sched) {
    ckpt_reader *r = NULL;
    CKPT_TRY(open_state(c, file, &r));
    char kind[16];
    int rc = ckpt_read_str(r, "kind", kind, sizeof kind);
    if (rc < 0) return ckpt__err_prefix(rc, "%s", file);
    const ckpt_optim_desc *d = ckpt__optim_desc_by_name(kind);
    if (!d) return ckpt__err(CKPT_EUNSUPPORTED, "%s: optimizer kind '%s'", file, kind);
    int ngroups = count_groups(r);
    ckpt_torch_writer *w = NULL;
    CKPT_TRY(ckpt_torch_writer_new(&w));
    char key[128];
    /* state: only parameters that have been stepped, as PyTorch keeps it */
    rc = ckpt_torch_begin_dict(w, false);
    if (rc == 0) rc = ckpt_torch_put_str(w, "state");
    if (rc == 0) rc = ckpt_torch_begin_dict(w, false);
    int64_t idx = 0;
    for (int g = 0; g < ngroups && rc == 0; g++) {
        ckpt_entry_info pe;
        const void *pv = NULL;
        snprintf(key, sizeof key, "param_groups.%d.params", g);
        rc = ckpt_reader_tensor_view(r, key, &pv, &pe);
        if (rc == 0 && (pe.dtype != CKPT_I64 || pe.ndim != 1))
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s is not I64 [n]", file, key);
        ckpt_optim_options op;
        if (rc == 0) rc = read_group_options(r, d, g, &op, file);
        for (int64_t j = 0; j < (rc == 0 ? pe.shape[0] : 0) && rc == 0; j++) {
            int64_t i = 0;
            memcpy(&i, (const char *)pv + 8 * j, 8);
            if (i != idx) {
                rc = ckpt__err(CKPT_ECORRUPT, "%s: parameter %" PRId64 " of group %d is %" PRId64,
                               file, j, g, i);
                break;
            }
            idx++;
            const void *sv = NULL;
            ckpt_entry_info se;
            snprintf(key, sizeof key, "state.%" PRId64 ".step", i);
            if (!has(r, key)) continue; /* a frozen parameter: no state, as in PyTorch */
            rc = ckpt_reader_tensor_view(r, key, &sv, &se);
            if (rc < 0) break;
            float step = 0;
            memcpy(&step, sv, 4);
            if (step == 0.0f) continue; /* never stepped: PyTorch has no state yet */
            rc = ckpt_torch_put_int(w, i);
            if (rc == 0) rc = ckpt_torch_begin_dict(w, false);
            if (rc == 0 && d->torch_step != CKPT_TORCH_STEP_NONE)
                rc = ckpt_torch_put_str(w, "step");
            if (rc == 0 && d->torch_step == CKPT_TORCH_STEP_TENSOR)
                rc = ckpt_torch_put_tensor(w, CKPT_F32, 0, NULL, sv);
            if (rc == 0 && d->torch_step == CKPT_TORCH_STEP_INT)
                rc = ckpt_torch_put_int(w, (int64_t)step);
            for (int b = 0; b < d->nbuffers && rc == 0; b++) {
                bool there = d->needs(b, &op);
                if (!there && !d->torch_none_buffer) continue;
                rc = ckpt_torch_put_str(w, d->buffers[b]);
                if (rc == 0 && !there) rc = ckpt_torch_put_none(w);
                if (rc < 0 || !there) continue;
                snprintf(key, sizeof key, "state.%" PRId64 ".%s", i, d->buffers[b]);
                rc = ckpt_reader_tensor_view(r, key, &sv, &se);
                if (rc == 0) rc = ckpt_torch_put_tensor(w, se.dtype, se.ndim, se.shape, sv);
            }
            /* a BF16/F16 parameter's fp32 master (master_weights): under
             * "master", which PyTorch's load_state_dict keeps as it is */
            snprintf(key, sizeof key, "state.%" PRId64 ".master", i);
            if (rc == 0 && has(r, key)) {
                rc = ckpt_reader_tensor_view(r, key, &sv, &se);
                if (rc == 0) rc = ckpt_torch_put_str(w, "master");
                if (rc == 0) rc = ckpt_torch_put_tensor(w, se.dtype, se.ndim, se.shape, sv);
            }
            if (rc == 0) rc = ckpt_torch_end(w);
        }
    }
    if (rc == 0) rc = ckpt_torch_end(w);
    if (rc == 0) rc = ckpt_torch_put_str(w, "param_groups");
    if (rc == 0) rc = ckpt_torch_begin_list(w);
    idx = 0;
    for (int g = 0; g < ngroups && rc == 0; g++) {
#define GK(name) (snprintf(key, sizeof key, "param_groups.%d.%s", g, name), key)
        ckpt_optim_options op;
        rc = ckpt_torch_begin_dict(w, false);
        if (rc == 0) rc = read_group_options(r, d, g, &op, file);
        if (rc == 0) rc = put_group_fields(w, d, &op);
        ckpt_entry_info pe;
        if (rc == 0) rc = ckpt_reader_find(r, GK("params"), &pe);
        if (rc == 0) rc = ckpt_torch_put_str(w, "params");
        if (rc == 0) rc = ckpt_torch_begin_list(w);
        int64_t first = idx;
        for (int64_t j = 0; j < (rc == 0 ? pe.shape[0] : 0) && rc == 0; j++)
            rc = ckpt_torch_put_int(w, idx++);
        if (rc == 0) rc = ckpt_torch_end(w);
        /* the parameters' names, as PyTorch (2.6 on) keeps them for an
         * optimizer made from named_parameters(); older versions keep the
         * field as it is */
        snprintf(key, sizeof key, "param_names.%" PRId64, first);
        if (rc == 0 && ckpt__reader_has(r, key, NULL)) {
            rc = ckpt_torch_put_str(w, "param_names");
            if (rc == 0) rc = ckpt_torch_begin_list(w);
            char pname[CKPT_MAX_KEY + 1];
            for (int64_t j = first; j < idx && rc == 0; j++) {
                snprintf(key, sizeof key, "param_names.%" PRId64, j);
                rc = ckpt_read_str((ckpt_reader *)r, key, pname, sizeof pname);
                if (rc == 0) rc = ckpt_torch_put_str(w, pname);
            }
            if (rc == 0) rc = ckpt_torch_end(w);
        }
        /* a scheduler sets initial_lr in every group it drives */
        char bk[64];
        snprintf(bk, sizeof bk, "base_lrs.%d", g);
        double base = 0;
        if (rc == 0 && sched && ckpt_read_f64((ckpt_reader *)sched, bk, &base) == 0)
            rc = put_key_f64(w, "initial_lr", base);
        if (rc == 0) rc = ckpt_torch_end(w);
#undef GK
    }
    if (rc == 0) rc = ckpt_torch_end(w);
    if (rc == 0) rc = ckpt_torch_end(w);
    char name[64];
    out_name(name, sizeof name, "optimizer", k, ".bin");
    if (rc == 0) rc = save_torch(c, w, name);
    ckpt_torch_writer_free(w);
    return rc < 0 ? ckpt__err_prefix(rc, "export %s", file) : rc;
}

/* ---- scheduler --------------------------------------------------------------- */

static int put_lr_list(ckpt_torch_writer *w, const ckpt_reader *r, const char *name, int n,
                       const char *file) {
    CKPT_TRY(ckpt_torch_put_str(w, name));
    CKPT_TRY(ckpt_torch_begin_list(w));
    for (int g = 0; g < n; g++) {
        char key[64];
        double v = 0;
        snprintf(key, sizeof key, "%s.%d", name, g);
        CKPT_TRY(get_f64(r, key, &v, file));
        CKPT_TRY(ckpt_torch_put_float(w, v));
    }
    return ckpt_torch_end(w);
}

static int export_scheduler(exp_ctx *c, const char *file, int k, ckpt_reader *r) {
    char kind[32];
    int rc = ckpt_read_str(r, "kind", kind, sizeof kind);
    if (rc < 0) return ckpt__err_prefix(rc, "%s", file);
    int n = 0;
    char key[64];
    for (;; n++) {
        snprintf(key, sizeof key, "base_lrs.%d", n);
        if (!has(r, key)) break;
    }
    bool lambda = !strcmp(kind, "warmup_cosine") || !strcmp(kind, "warmup_linear") ||
                  !strcmp(kind, "constant");
    if (!strcmp(kind, "multisteplr"))
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: a MultiStepLR's state holds a collections.Counter, "
                         "which torch.load(weights_only=True) refuses; export it without "
                         "the scheduler (--weights-only) or use another schedule",
                         file);
    if (!lambda && strcmp(kind, "steplr") && strcmp(kind, "exponentiallr") &&
        strcmp(kind, "cosineannealinglr"))
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: scheduler kind '%s'", file, kind);
    int64_t last_epoch = 0, step_count = 0, iv = 0;
    double v = 0;
    CKPT_TRY(get_i64(r, "last_epoch", &last_epoch, file));
    CKPT_TRY(get_i64(r, "_step_count", &step_count, file));
    ckpt_torch_writer *w = NULL;
    CKPT_TRY(ckpt_torch_writer_new(&w));
    rc = ckpt_torch_begin_dict(w, false);
    /* each class's own fields first, as in its __dict__ */
    if (rc == 0 && !strcmp(kind, "steplr")) {
        rc = get_i64(r, "step_size", &iv, file);
        if (rc == 0) rc = put_key_i64(w, "step_size", iv);
        if (rc == 0) rc = get_f64(r, "gamma", &v, file);
        if (rc == 0) rc = put_key_f64(w, "gamma", v);
    } else if (rc == 0 && !strcmp(kind, "exponentiallr")) {
        rc = get_f64(r, "gamma", &v, file);
        if (rc == 0) rc = put_key_f64(w, "gamma", v);
    } else if (rc == 0 && !strcmp(kind, "cosineannealinglr")) {
        rc = get_i64(r, "T_max", &iv, file);
        if (rc == 0) rc = put_key_i64(w, "T_max", iv);
        if (rc == 0) rc = get_f64(r, "eta_min", &v, file);
        if (rc == 0) rc = put_key_f64(w, "eta_min", v);
    }
    if (rc == 0) rc = put_lr_list(w, r, "base_lrs", n, file);
    if (rc == 0) rc = put_key_i64(w, "last_epoch", last_epoch);
    if (rc == 0) rc = put_key_bool(w, "verbose", false);
    if (rc == 0) rc = put_key_i64(w, "_step_count", step_count);
    if (rc == 0) rc = put_key_bool(w, "_get_lr_called_within_step", false);
    if (rc == 0) rc = put_lr_list(w, r, "_last_lr", n, file);
    if (rc == 0 && lambda) {
        /* LambdaLR keeps the __dict__ of callable objects here; ours carry
         * the schedule in transformers' keyword names, so a load keeps the
         * user's own lambdas and an import gets the schedule back */
        int64_t warmup = 0, total = 0;
        rc = get_i64(r, "warmup", &warmup, file);
        if (rc == 0 && strcmp(kind, "constant")) rc = get_i64(r, "total", &total, file);
        if (rc == 0) rc = ckpt_torch_put_str(w, "lr_lambdas");
        if (rc == 0) rc = ckpt_torch_begin_list(w);
        for (int g = 0; g < n && rc == 0; g++) {
            rc = ckpt_torch_begin_dict(w, false);
            if (rc == 0) rc = put_key_i64(w, "num_warmup_steps", warmup);
            if (rc == 0 && strcmp(kind, "constant"))
                rc = put_key_i64(w, "num_training_steps", total);
            if (rc == 0 && !strcmp(kind, "warmup_cosine")) rc = put_key_f64(w, "num_cycles", 0.5);
            if (rc == 0) rc = ckpt_torch_end(w);
        }
        if (rc == 0) rc = ckpt_torch_end(w);
    }
    if (rc == 0) rc = ckpt_torch_end(w);
    char name[64];
    out_name(name, sizeof name, "scheduler", k, ".bin");
    if (rc == 0) rc = save_torch(c, w, name);
    ckpt_torch_writer_free(w);
    return rc < 0 ? ckpt__err_prefix(rc, "export %s", file) : rc;
}

static int export_scaler(exp_ctx *c, const char *file) {
    ckpt_reader *r = NULL;
    CKPT_TRY(open_state(c, file, &r));
    double scale = 0, gf = 0, bf = 0;
    int64_t gi = 0, gt = 0;
    CKPT_TRY(get_f64(r, "scale", &scale, file));
    CKPT_TRY(get_f64(r, "growth_factor", &gf, file));
    CKPT_TRY(get_f64(r, "backoff_factor", &bf, file));
    CKPT_TRY(get_i64(r, "growth_interval", &gi, file));
    CKPT_TRY(get_i64(r, "_growth_tracker", &gt, file));
    ckpt_torch_writer *w = NULL;
    CKPT_TRY(ckpt_torch_writer_new(&w));
    int rc = ckpt_torch_begin_dict(w, false);
    if (rc == 0) rc = put_key_f64(w, "scale", scale);
    if (rc == 0) rc = put_key_f64(w, "growth_factor", gf);
    if (rc == 0) rc = put_key_f64(w, "backoff_factor", bf);
    if (rc == 0) rc = put_key_i64(w, "growth_interval", gi);
    if (rc == 0) rc = put_key_i64(w, "_growth_tracker", gt);
    if (rc == 0) rc = ckpt_torch_end(w);
    if (rc == 0) rc = save_torch(c, w, "scaler.pt");
    ckpt_torch_writer_free(w);
    return rc;
}

/* ---- custom objects --------------------------------------------------------- */

/* Why PyTorch cannot hold object r (a tensor of a dtype it has no storage
 * for), into why; false if it can. */
static bool torch_lacks(ckpt_reader *r, char *why, size_t cap) {
    for (int64_t i = 0; i < ckpt_reader_count(r); i++) {
        ckpt_entry_info e;
        if (ckpt_reader_entry(r, i, &e) < 0 || e.kind != CKPT_ENTRY_TENSOR) continue;
        if (e.dtype == CKPT_F64 || e.dtype == CKPT_F32 || e.dtype == CKPT_F16 ||
            e.dtype == CKPT_BF16 || e.dtype == CKPT_I64 || e.dtype == CKPT_I32 ||
            e.dtype == CKPT_I16 || e.dtype == CKPT_I8 || e.dtype == CKPT_U8 || e.dtype == CKPT_BOOL)
            continue;
        snprintf(why, cap, "tensor '%s' is %s", e.key, ckpt_dtype_name(e.dtype));
        return true;
    }
    return false;
}

/* A custom object as Accelerate saves one (torch.save of its state dict):
 * custom_checkpoint_<i>.pkl, or <name>.pkl for a named object. Its flat
 * entries in file order: tensors, a tied name a second key on its tensor's
 * storage, ints (u64 ones too), floats, strings, byte strings as uint8
 * tensors. An object with a tensor PyTorch has no dtype for is left out and
 * listed in the README. */
static int export_custom(exp_ctx *c, const char *file) {
    ckpt_reader *r = NULL;
    CKPT_TRY(open_state(c, file, &r));
    char name[300], why[CKPT_MAX_KEY + 64];
    snprintf(name, sizeof name, "%.*s.pkl", (int)(strlen(file) - strlen(".safetensors")), file);
    if (torch_lacks(r, why, sizeof why)) {
        size_t have = c->left_out ? strlen(c->left_out) : 0, add = strlen(name) + strlen(why) + 8;
        char *grown = ckpt__realloc(c->left_out, have + add);
        if (!grown) return ckpt__err_nomem("export");
        snprintf(grown + have, add, "- %s: %s\n", name, why);
        c->left_out = grown;
        return CKPT_OK;
    }
    int64_t n = ckpt_reader_count(r);
    const void **views = ckpt__calloc((size_t)n + 1, sizeof *views);
    ckpt_torch_writer *w = NULL;
    int rc = views ? ckpt_torch_writer_new(&w) : ckpt__err_nomem("export");
    if (rc == 0) rc = ckpt_torch_begin_dict(w, false);
    for (int64_t i = 0; i < n && rc == 0; i++) {
        ckpt_entry_info e;
        rc = ckpt_reader_entry(r, i, &e);
        if (rc == 0) rc = ckpt_torch_put_str(w, e.key);
        if (rc < 0) break;
        switch (e.kind) {
        case CKPT_ENTRY_TENSOR:
            rc = ckpt_reader_tensor_view(r, e.key, &views[i], NULL);
            if (rc == 0) rc = ckpt_torch_put_tensor(w, e.dtype, e.ndim, e.shape, views[i]);
            break;
        case CKPT_ENTRY_ALIAS: { /* its target's very view: one storage */
            ckpt_entry_info t;
            int64_t j = 0;
            while (j < i && !(ckpt_reader_entry(r, j, &t) == 0 && !strcmp(t.key, e.target))) j++;
            if (j == i)
                rc = ckpt__err(CKPT_ECORRUPT, "%s: '%s' is an alias of '%s', which it lacks", file,
                               e.key, e.target);
            else rc = ckpt_torch_put_tensor(w, t.dtype, t.ndim, t.shape, views[j]);
            break;
        }
        case CKPT_ENTRY_I64: {
            int64_t v = 0;
            rc = ckpt_read_i64(r, e.key, &v);
            if (rc == 0) rc = ckpt_torch_put_int(w, v);
            break;
        }
        case CKPT_ENTRY_U64: {
            uint64_t v = 0;
            rc = ckpt_read_u64(r, e.key, &v);
            if (rc == 0) rc = ckpt_torch_put_uint(w, v);
            break;
        }
        case CKPT_ENTRY_F64: {
            double v = 0;
            rc = ckpt_read_f64(r, e.key, &v);
            if (rc == 0) rc = ckpt_torch_put_float(w, v);
            break;
        }
        case CKPT_ENTRY_STR: {
            char *v = ckpt__malloc((size_t)e.nbytes + 1);
            rc = v ? ckpt_read_str(r, e.key, v, (size_t)e.nbytes + 1) : ckpt__err_nomem("export");
            if (rc == 0) rc = ckpt_torch_put_str(w, v);
            free(v);
            break;
        }
        case CKPT_ENTRY_BYTES: {
            uint8_t *v = ckpt__malloc((size_t)e.nbytes + 1);
            size_t got = 0;
            rc = v ? ckpt_read_bytes(r, e.key, v, (size_t)e.nbytes, &got)
                   : ckpt__err_nomem("export");
            int64_t len[1] = {(int64_t)got};
            if (rc == 0) rc = ckpt_torch_put_tensor(w, CKPT_U8, 1, len, v);
            /* the writer borrows v until it is saved: kept with the readers */
            if (rc == 0) rc = reader_keep(c, v);
            else free(v);
            break;
        }
        }
    }
    if (rc == 0) rc = ckpt_torch_end(w);
    if (rc == 0) rc = save_torch(c, w, name);
    ckpt_torch_writer_free(w);
    free(views);
    return rc < 0 ? ckpt__err_prefix(rc, "%s", file) : rc;
}

/* ---- the whole folder ---------------------------------------------------------- */

static int export_all(exp_ctx *c, const ckpt_export_options *o) {
    const ckpt_manifest *m = &c->m;
    for (int64_t i = 0; i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        int k = 0;
        char obj[160];
        size_t len = strlen(f->name), ix = strlen(".index.json");
        const char *name = f->name;
        if (len > ix && !strcmp(f->name + len - ix, ".index.json")) { /* saved as HF shards */
            snprintf(obj, sizeof obj, "%.*s", (int)(len - ix), f->name);
            name = obj;
        }
        if (!strcmp(f->kind, "model") && (k = object_index(name, "model")) >= 0)
            CKPT_TRY(export_model(c, name, k, o->max_shard_size, o->torch_bin));
    }
    if (o->weights_only) return CKPT_OK;
    for (int64_t i = 0; i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        int k = 0;
        if (!strcmp(f->kind, "scheduler") && (k = object_index(f->name, "scheduler")) >= 0) {
            ckpt_reader *r = NULL;
            CKPT_TRY(open_state(c, f->name, &r));
            CKPT_TRY(export_scheduler(c, f->name, k, r));
        }
    }
    for (int64_t i = 0; i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        int k = 0;
        if (!strcmp(f->kind, "optimizer") && (k = object_index(f->name, "optimizer")) >= 0) {
            /* its scheduler (the same index) gives the groups' initial_lr */
            char sname[64];
            out_name(sname, sizeof sname, "scheduler", k, ".safetensors");
            ckpt_reader *sched = NULL;
            if (ckpt__manifest_find(m, sname)) CKPT_TRY(open_state(c, sname, &sched));
            CKPT_TRY(export_optimizer(c, f->name, k, sched));
        } else if (!strcmp(f->kind, "scaler")) {
            CKPT_TRY(export_scaler(c, f->name));
        } else if (!strcmp(f->kind, "custom") &&
                   !ckpt__shard_file_parse(f->name, NULL, NULL, NULL)) {
            CKPT_TRY(export_custom(c, f->name));
        }
    }
    return CKPT_OK;
}

int ckpt_export_torch(const char *checkpoint_dir, const char *out_dir,
                      const ckpt_export_options *opt) {
    if (!checkpoint_dir || !out_dir) return ckpt__err(CKPT_EINVAL, "export: NULL argument");
    if (ckpt__s3_is_url(out_dir))
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "export: %s: exports go to a local folder (copy it with any S3 client)",
                         out_dir);
    if (ckpt__s3_is_url(checkpoint_dir)) {
        /* from a verified local copy, removed afterwards */
        char *local = NULL, *root = NULL;
        int rc = ckpt__remote_checkout(checkpoint_dir, &local, &root);
        if (rc < 0) return ckpt__err_prefix(rc, "export");
        rc = ckpt_export_torch(local, out_dir, opt);
        char saved[2048];
        snprintf(saved, sizeof saved, "%s", rc < 0 ? ckpt_errmsg() : "");
        ckpt__remote_checkout_done(local, root);
        if (rc < 0) ckpt__err(rc, "%s", saved);
        return rc;
    }
    ckpt_export_options o = {0};
    if (opt) o = *opt;
    ckpt_checkpoint_info info;
    int rc = ckpt_checkpoint_verify(checkpoint_dir, true, &info);
    if (rc < 0) return ckpt__err_prefix(rc, "export");
    struct stat st;
    if (ckpt__os_lstat(out_dir, &st) == 0)
        return ckpt__err(CKPT_EEXIST, "export: %s already exists", out_dir);
    exp_ctx c = {.src = checkpoint_dir};
    ckpt__manifest_init(&c.m);
    rc = ckpt__manifest_read(checkpoint_dir, &c.m);
    ckpt_txn t = {0};
    if (rc == 0) rc = ckpt__txn_begin(&t, out_dir, "export", true, NULL);
    c.tmp = t.tmp;
    if (rc == 0) rc = export_all(&c, &o);
    char *readme = NULL;
    if (rc == 0 && c.left_out) {
        const char *head = "\nLeft out of this export (PyTorch has no dtype for these tensors; "
                           "python/ckpt_torch reads them from the checkpoint):\n\n";
        size_t n = strlen(readme_text) + strlen(head) + strlen(c.left_out) + 1;
        if ((readme = ckpt__malloc(n)))
            snprintf(readme, n, "%s%s%s", readme_text, head, c.left_out);
        else rc = ckpt__err_nomem("export");
    }
    if (rc == 0) rc = write_text(&c, "README.md", readme ? readme : readme_text);
    free(readme);
    free(c.left_out);
    for (int i = 0; i < c.nreaders; i++) ckpt_reader_free(c.readers[i]);
    free(c.readers);
    for (int i = 0; i < c.nkept; i++) free(c.kept[i]);
    free(c.kept);
    if (rc == 0) rc = ckpt__txn_commit(&t, false, NULL);
    ckpt__txn_end(&t, NULL);
    if (rc < 0) rc = ckpt__err_prefix(rc, "export %s", checkpoint_dir);
    ckpt__manifest_clear(&c.m);
    return rc;
}
