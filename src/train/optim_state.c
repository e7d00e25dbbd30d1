/* optim_state.c — the optimizer's state dict: its parameter groups and
 * per-parameter state written under PyTorch's keys, and a load that maps the
 * file's state to the parameters by name, checks everything, then commits
 * (ZeRO-1: each rank its own slice of every state buffer). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "ckpt.h"
#include "base/error.h"
#include "format/statedict.h"
#include "train/optim.h"
#include "train/optim_int.h"

/* ---- state dict --------------------------------------------------------- */

#define KEY_CAP 96

static int write_group(const ckpt_optimizer *o, ckpt_writer *w, int g) {
    const ckpt_optim_options *op = &o->opts[g];
    char k[KEY_CAP];
#define GKEY(name) (snprintf(k, sizeof k, "param_groups.%d." name, g), k)
    CKPT_TRY(ckpt_write_f64(w, GKEY("lr"), op->lr));
    CKPT_TRY(ckpt_write_f64(w, GKEY("weight_decay"), op->weight_decay));
    CKPT_TRY(ckpt_write_i64(w, GKEY("maximize"), op->maximize));
    const ckpt_optim_desc *d = &o->impl->d;
    for (int h = 0; h < d->nhparams; h++) {
        const ckpt_optim_hparam *hp = &d->hparams[h];
        const char *field = (const char *)op + hp->offset;
        snprintf(k, sizeof k, "param_groups.%d.%s", g, hp->key);
        if (hp->is_bool) CKPT_TRY(ckpt_write_i64(w, k, *(const bool *)field));
        else CKPT_TRY(ckpt_write_f64(w, k, *(const double *)field));
    }
    int64_t n = o->group_start[g + 1] - o->group_start[g];
    CKPT_TRY(ckpt_write_tensor(w, GKEY("params"), CKPT_I64, 1, &n,
                               o->param_index + o->group_start[g]));
#undef GKEY
    return CKPT_OK;
}

/* This rank's part [lo, hi) of a sharded parameter as a box: whole rows. */
static void share_box(const opt_param *p, int64_t *off, int64_t *local) {
    int64_t row = ckpt__optim_row_size(p);
    for (int d = 0; d < p->ndim; d++) {
        off[d] = 0;
        local[d] = p->shape[d];
    }
    off[0] = p->lo / row;
    local[0] = (p->hi - p->lo) / row;
}

/* Writes one state field: a chunk of the whole tensor when sharded (every
 * rank writes one, empty if it owns no row of the parameter, so every rank's
 * state dict has the same keys), else the tensor. */
/* Where the state of element lo of p starts in a buffer behind memory ops
 * (only an external optimizer's, which holds the whole parameter's). */
static ckpt_mem_ref mem_at(const opt_param *p, const ckpt_mem_ref *m) {
    ckpt_mem_ref r = *m;
    r.off += (uint64_t)p->lo * sizeof(float);
    return r;
}

/* Writes one state field (buf, or behind memory ops at *mem when its ops
 * are set): a chunk of the whole tensor when sharded (every rank writes
 * one, empty if it owns no row of the parameter, so every rank's state dict
 * has the same keys), else the tensor. */
static int write_state(const ckpt_optimizer *o, ckpt_writer *w, const char *k, const opt_param *p,
                       float *buf, const ckpt_mem_ref *mem) {
    const float *at = ckpt__optim_state_at(o, p, buf);
    ckpt_mem_ref m = mem->ops ? mem_at(p, mem) : *mem;
    bool whole = !o->comm || !p->sharded;
    int64_t off[CKPT_MAX_NDIM], local[CKPT_MAX_NDIM];
    if (!whole) share_box(p, off, local);
    if (m.ops && whole) return ckpt__write_tensor_at(w, k, CKPT_F32, p->ndim, p->shape, &m);
    if (m.ops)
        return ckpt__write_tensor_shard_at(w, k, CKPT_F32, p->ndim, p->shape, off, local, &m);
    if (whole) return ckpt_write_tensor(w, k, CKPT_F32, p->ndim, p->shape, at);
    return ckpt_write_tensor_shard(w, k, CKPT_F32, p->ndim, p->shape, off, local, at);
}

/* Reads one state field: this rank's slice when sharded, from however
 * many chunks (or a whole tensor) the file has. */
static int read_state(const ckpt_optimizer *o, ckpt_reader *r, const char *k, const opt_param *p,
                      float *buf, const ckpt_mem_ref *mem) {
    ckpt_dst d = {(uint8_t *)ckpt__optim_state_at(o, p, buf), {0}, k};
    if (mem->ops) d.mem = mem_at(p, mem);
    if (!o->comm || !p->sharded) return ckpt__read_tensor_to(r, k, CKPT_F32, p->ndim, p->shape, &d);
    if (p->hi == p->lo) return CKPT_OK;
    int64_t off[CKPT_MAX_NDIM], local[CKPT_MAX_NDIM];
    share_box(p, off, local);
    return ckpt__read_tensor_shard_to(r, k, CKPT_F32, p->ndim, p->shape, off, local, &d);
}

/* A schema entry a file may or may not have (state of a parameter frozen
 * or not when it was saved): its shape is checked by the object. */
static int schema_optional(ckpt_writer *w, const char *k) {
    CKPT_TRY(ckpt__writer_set_optional(w, k));
    return ckpt__writer_set_shape_by_object(w, k);
}

static int optimizer_state_dict(void *self, ckpt_writer *w) {
    ckpt_optimizer *o = self;
    bool schema = ckpt__writer_is_schema(w);
    char k[KEY_CAP];
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    CKPT_TRY(ckpt__optim_check_attached(o));
    for (int64_t i = 0; i < o->np && !schema && !o->external; i++)
        if (!o->p[i].frozen) ckpt__optim_master_take_up(&o->p[i]);
    CKPT_TRY(ckpt_write_str(w, "kind", o->impl->d.name));
    /* Each state index's parameter name, so a load maps state by name, not
     * by position (files written before these entries load by position). */
    for (int64_t i = 0; i < o->np; i++) {
        snprintf(k, sizeof k, "param_names.%lld", (long long)i);
        CKPT_TRY(ckpt_write_str(w, k, o->p[i].name));
        CKPT_TRY(ckpt__writer_set_optional(w, k));
    }
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        const char *names[CKPT_OPTIM_MAX_FIELDS];
        float *bufs[CKPT_OPTIM_MAX_FIELDS];
        ckpt_mem_ref mems[CKPT_OPTIM_MAX_FIELDS];
        int n = ckpt__optim_fields(o, p, names, bufs, mems);
        /* A frozen parameter has no state. A file saved before it was
         * frozen has some, which a load skips: the schema allows it. */
        if (p->frozen && !schema) continue;
        snprintf(k, sizeof k, "state.%lld.step", (long long)i);
        CKPT_TRY(ckpt_write_tensor(w, k, CKPT_F32, 0, NULL, &p->step));
        /* the file's state.<i> may be another parameter's (a load maps by
         * name), or missing (its parameter frozen when saved): the object
         * checks it after the mapping */
        if (schema) CKPT_TRY(schema_optional(w, k));
        for (int j = 0; j < n; j++) {
            snprintf(k, sizeof k, "state.%lld.%s", (long long)i, names[j]);
            if (p->frozen) CKPT_TRY(ckpt_write_tensor(w, k, CKPT_F32, p->ndim, p->shape, NULL));
            else CKPT_TRY(write_state(o, w, k, p, bufs[j], &mems[j]));
            if (schema) CKPT_TRY(schema_optional(w, k));
        }
    }
    for (int g = 0; g < o->ngroups; g++) CKPT_TRY(write_group(o, w, g));
    return CKPT_OK;
}

static int read_bool(ckpt_reader *r, const char *key, bool *out) {
    int64_t v;
    CKPT_TRY(ckpt_read_i64(r, key, &v));
    if (v != 0 && v != 1)
        return ckpt__err(CKPT_ECORRUPT, "optimizer: %s: expected 0 or 1, got %lld", key,
                         (long long)v);
    *out = v != 0;
    return CKPT_OK;
}

/* Reads group g's hyper-parameters into *op (which starts as the current
 * ones) and checks its parameter list against ours. */
static int read_group(const ckpt_optimizer *o, ckpt_reader *r, int g, ckpt_optim_options *op) {
    char k[KEY_CAP];
#define GKEY(name) (snprintf(k, sizeof k, "param_groups.%d." name, g), k)
    CKPT_TRY(ckpt_read_f64(r, GKEY("lr"), &op->lr));
    CKPT_TRY(ckpt_read_f64(r, GKEY("weight_decay"), &op->weight_decay));
    CKPT_TRY(read_bool(r, GKEY("maximize"), &op->maximize));
    const ckpt_optim_desc *d = &o->impl->d;
    for (int h = 0; h < d->nhparams; h++) {
        const ckpt_optim_hparam *hp = &d->hparams[h];
        char *field = (char *)op + hp->offset;
        snprintf(k, sizeof k, "param_groups.%d.%s", g, hp->key);
        if (hp->is_bool) CKPT_TRY(read_bool(r, k, (bool *)field));
        else CKPT_TRY(ckpt_read_f64(r, k, (double *)field));
    }
    int64_t n = o->group_start[g + 1] - o->group_start[g];
    ckpt_entry_info e;
    int rc = ckpt_reader_find(r, GKEY("params"), &e);
    if (rc < 0 || e.kind != CKPT_ENTRY_TENSOR || e.dtype != CKPT_I64 || e.ndim != 1 ||
        e.shape[0] != n)
        return ckpt__err(CKPT_EMISMATCH,
                         "optimizer: %s: expected an I64 tensor of %lld parameter indices", k,
                         (long long)n);
    const void *data;
    CKPT_TRY(ckpt_reader_tensor_view(r, k, &data, &e));
    for (int64_t j = 0; j < n; j++) {
        int64_t v;
        memcpy(&v, (const char *)data + j * 8, 8); /* little-endian hosts only, as the format */
        if (v != o->param_index[o->group_start[g] + j])
            return ckpt__err(CKPT_EMISMATCH,
                             "optimizer: %s[%lld]: parameter %lld in file, %lld in memory", k,
                             (long long)j, (long long)v,
                             (long long)o->param_index[o->group_start[g] + j]);
    }
#undef GKEY
    int code = ckpt__optim_check_options(o->impl, op, g);
    if (code < 0) return ckpt__err_prefix(CKPT_ECORRUPT, "state dict");
    const ckpt_optim_options *cur = &o->opts[g];
    for (int b = 0; b < d->nbuffers; b++)
        if (d->needs(b, op) != d->needs(b, cur))
            return ckpt__err(CKPT_EMISMATCH,
                             "optimizer: param_groups.%d: the file's %s differs from this "
                             "optimizer's (its state buffers would not match)",
                             g, d->needs_what);
    return CKPT_OK;
}

/* Checks that a state tensor exists with the parameter's shape. */
static int check_state_tensor(ckpt_reader *r, const char *key, int ndim, const int64_t *shape) {
    ckpt_entry_info e;
    int rc = ckpt_reader_find(r, key, &e);
    if (rc == CKPT_ENOENT || (rc == CKPT_OK && e.kind != CKPT_ENTRY_TENSOR))
        return ckpt__err(CKPT_EMISMATCH, "optimizer: state dict has no tensor '%s'", key);
    if (rc < 0) return rc;
    bool same = e.dtype == CKPT_F32 && e.ndim == ndim;
    for (int d = 0; same && d < ndim; d++) same = e.shape[d] == shape[d];
    if (!same)
        return ckpt__err(CKPT_EMISMATCH,
                         "optimizer: '%s': dtype or shape in the file differs from the parameter's",
                         key);
    return CKPT_OK;
}

/* Reads state.<i>.step into *step and checks it is a whole number >= 0. */
static int read_step(ckpt_reader *r, int64_t i, float *step) {
    char k[KEY_CAP];
    snprintf(k, sizeof k, "state.%lld.step", (long long)i);
    CKPT_TRY(ckpt_read_tensor(r, k, CKPT_F32, 0, NULL, step));
    if (!(*step >= 0 && *step == floorf(*step)))
        return ckpt__err(CKPT_ECORRUPT, "optimizer: %s: expected a whole number >= 0, got %g", k,
                         (double)*step);
    return CKPT_OK;
}

/* Which of the file's state indices holds each of our parameters: map[i]
 * for our state index i. By the file's param_names.<j> (a model whose
 * parameters were registered in another order still gets each parameter's
 * own state). A file without names (state imported from a torch 1.13
 * optimizer.bin whose order could not be proven, or written before the
 * names existed) loads by position only when the caller said so
 * (ckpt_optimizer_set_match_by_position): two same-shaped parameters
 * registered in another order would silently swap their moments. *unnamed
 * says which rule was used. Each parameter must sit in the same group on
 * both sides. */
static int map_by_name(const ckpt_optimizer *o, ckpt_reader *r, int64_t *map, bool *unnamed) {
    char k[KEY_CAP];
    for (int64_t i = 0; i < o->np; i++) map[i] = i;
    *unnamed = !ckpt__reader_has(r, "param_names.0", NULL);
    if (*unnamed && o->by_position) return CKPT_OK;
    if (*unnamed)
        return ckpt__err(CKPT_EMISMATCH,
                         "optimizer: the state dict does not name its parameters "
                         "(no param_names.<i>, as in state imported from a torch 1.13 "
                         "optimizer.bin), so which state belongs to which parameter is not "
                         "known; import again with the names (ckpt import --param-names FILE), "
                         "or, if this model registers its parameters in the file's order, allow "
                         "a load by position (ckpt_optimizer_set_match_by_position)");
    snprintf(k, sizeof k, "param_names.%lld", (long long)o->np);
    if (ckpt__reader_has(r, k, NULL))
        return ckpt__err(CKPT_EMISMATCH,
                         "optimizer: the state dict names more than %lld parameters",
                         (long long)o->np);
    for (int64_t i = 0; i < o->np; i++) map[i] = -1;
    char name[CKPT_MAX_KEY + 1];
    for (int64_t j = 0; j < o->np; j++) {
        snprintf(k, sizeof k, "param_names.%lld", (long long)j);
        int rc = ckpt_read_str(r, k, name, sizeof name);
        if (rc == CKPT_ENOENT)
            return ckpt__err(CKPT_EMISMATCH,
                             "optimizer: the state dict names %lld parameters, this "
                             "optimizer has %lld",
                             (long long)j, (long long)o->np);
        if (rc < 0) return rc;
        int64_t i = 0;
        while (i < o->np && strcmp(o->p[i].name, name) != 0) i++;
        if (i == o->np)
            return ckpt__err(CKPT_EMISMATCH,
                             "optimizer: %s: the state dict has state for parameter "
                             "'%s', which this optimizer does not optimize",
                             k, name);
        if (map[i] >= 0)
            return ckpt__err(CKPT_ECORRUPT, "optimizer: %s: parameter '%s' named twice", k, name);
        map[i] = j;
    }
    /* the same group on both sides: the file's groups are consecutive ranges
     * of its state indices, as ours, of the same sizes (read_group checked) */
    for (int g = 0; g < o->ngroups; g++)
        for (int64_t i = o->group_start[g]; i < o->group_start[g + 1]; i++)
            if (map[i] < o->group_start[g] || map[i] >= o->group_start[g + 1])
                return ckpt__err(CKPT_EMISMATCH, "optimizer: parameter '%s' is in another group in "
                                 "the file than in memory (group %d here)", o->p[i].name, g);
    return CKPT_OK;
}

/* The check: reads and validates every entry a load takes (the kind, every
 * group's hyper-parameters and parameter list, no extra groups or
 * parameters, the parameter names, every step, every state tensor's dtype
 * and shape), changing nothing, so that it cannot fail for a reason the
 * commit would not also meet. map gets the file index of each parameter
 * and *unnamed whether the file named them (map_by_name). */
static int optimizer_check(const ckpt_optimizer *o, ckpt_reader *r, int64_t *map, bool *unnamed) {
    char kind[16], k[KEY_CAP];
    int rc = ckpt_read_str(r, "kind", kind, sizeof kind);
    if (rc == CKPT_EINVAL || (rc == CKPT_OK && strcmp(kind, o->impl->d.name) != 0))
        return ckpt__err(CKPT_EMISMATCH,
                         "optimizer: the state dict is for a%s %s optimizer, this "
                         "one is %s",
                         rc == CKPT_OK && kind[0] == 'a' ? "n" : "",
                         rc == CKPT_OK ? kind : "different", o->impl->d.name);
    if (rc < 0) return rc;
    for (int g = 0; g < o->ngroups; g++) {
        ckpt_optim_options op = o->opts[g];
        CKPT_TRY(read_group(o, r, g, &op));
    }
    snprintf(k, sizeof k, "param_groups.%d.lr", o->ngroups);
    if (ckpt__reader_has(r, k, NULL)) /* a probe: sets no message */
        return ckpt__err(CKPT_EMISMATCH, "optimizer: the state dict has more than %d groups",
                         o->ngroups);
    snprintf(k, sizeof k, "state.%lld.step", (long long)o->np);
    if (ckpt__reader_has(r, k, NULL)) /* a probe: sets no message */
        return ckpt__err(CKPT_EMISMATCH, "optimizer: the state dict has state for more than %lld "
                         "parameters", (long long)o->np);
    CKPT_TRY(map_by_name(o, r, map, unnamed));
    const char *names[CKPT_OPTIM_MAX_FIELDS];
    float *bufs[CKPT_OPTIM_MAX_FIELDS];
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        if (p->frozen) continue; /* whatever the file has for it is not read */
        snprintf(k, sizeof k, "state.%lld.step", (long long)map[i]);
        if (!ckpt__reader_has(r, k, NULL)) {
            /* frozen when saved (the file names it but keeps no state):
             * fresh state; a file without names cannot say so */
            if (*unnamed)
                return ckpt__err(CKPT_EMISMATCH, "optimizer: state dict has no tensor '%s'", k);
            continue;
        }
        float step;
        CKPT_TRY(read_step(r, map[i], &step));
        for (int j = 0, n = ckpt__optim_fields(o, p, names, bufs, NULL); j < n; j++) {
            snprintf(k, sizeof k, "state.%lld.%s", (long long)map[i], names[j]);
            if (!strcmp(names[j], "master") && !ckpt__reader_has(r, k, NULL)) {
                if (!o->external) continue; /* the master starts as the parameter */
                return ckpt__err(CKPT_EMISMATCH,
                                 "optimizer: the state dict has no master weights for parameter "
                                 "'%s' ('%s': saved without master_weights), and an external "
                                 "optimizer's masters are the caller's to fill",
                                 p->name, k);
            }
            CKPT_TRY(check_state_tensor(r, k, p->ndim, p->shape));
        }
    }
    return CKPT_OK;
}

static int optimizer_check_state_dict(void *self, ckpt_reader *r) {
    ckpt_optimizer *o = self;
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    CKPT_TRY(ckpt__optim_check_attached(o));
    int64_t *map = ckpt__malloc((size_t)(o->np ? o->np : 1) * sizeof *map);
    if (!map) return ckpt__err_nomem("optimizer check");
    bool unnamed;
    int rc = optimizer_check(o, r, map, &unnamed);
    free(map);
    return rc;
}

static int optimizer_commit(ckpt_optimizer *o, ckpt_reader *r, const int64_t *map);

void ckpt_optimizer_set_match_by_position(ckpt_optimizer *o, bool on) {
    if (o) o->by_position = on;
}

void ckpt__optimizer_set_log(ckpt_optimizer *o, ckpt_log_fn fn, void *user) {
    if (!o) return;
    o->log_fn = fn;
    o->log_user = user;
}

/* Logs what a load did that a plain resume never does: state in the file
 * for parameters now frozen (not loaded), parameters without state in the
 * file (frozen when saved: fresh state), masters missing (taken from the
 * parameters). */
static void log_load(const ckpt_optimizer *o, ckpt_reader *r, const int64_t *map, bool unnamed) {
    ckpt_logger lg = {o->log_fn, o->log_user};
    char k[KEY_CAP];
    int64_t dropped = 0, fresh = 0, masters = 0;
    const char *first[3] = {NULL, NULL, NULL};
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        snprintf(k, sizeof k, "state.%lld.step", (long long)map[i]);
        bool has = ckpt__reader_has(r, k, NULL);
        snprintf(k, sizeof k, "state.%lld.master", (long long)map[i]);
        if (p->frozen && has && !dropped++) first[0] = p->name;
        if (!p->frozen && !has && !fresh++) first[1] = p->name;
        if (!p->frozen && has && p->needs_master && !ckpt__reader_has(r, k, NULL) && !masters++)
            first[2] = p->name;
    }
    if (dropped)
        ckpt__log(&lg, CKPT_LOG_WARNING,
                  "optimizer: the state dict holds state for %lld parameter%s frozen here "
                  "('%s'%s): not loaded, frozen parameters have none",
                  (long long)dropped, dropped == 1 ? "" : "s", first[0],
                  dropped > 1 ? ", ..." : "");
    if (fresh)
        ckpt__log(&lg, CKPT_LOG_WARNING,
                  "optimizer: the state dict holds no state for %lld parameter%s ('%s'%s: frozen "
                  "when saved): %s from fresh state (step 0)",
                  (long long)fresh, fresh == 1 ? "" : "s", first[1], fresh > 1 ? ", ..." : "",
                  fresh == 1 ? "it starts" : "they start");
    if (masters)
        ckpt__log(&lg, CKPT_LOG_WARNING,
                  "optimizer: the state dict holds no master weights for %lld parameter%s "
                  "('%s'%s): %s the parameter's value",
                  (long long)masters, masters == 1 ? "" : "s", first[2], masters > 1 ? ", ..." : "",
                  masters == 1 ? "its master starts as" : "their masters start as");
    if (unnamed)
        ckpt__log(&lg, CKPT_LOG_WARNING,
                  "optimizer: the state dict does not name its parameters; its state was "
                  "matched by position (%lld parameters, as allowed by "
                  "ckpt_optimizer_set_match_by_position)",
                  (long long)o->np);
}

static int optimizer_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_optimizer *o = self;
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    CKPT_TRY(ckpt__optim_check_attached(o));
    /* Validate everything before changing anything. */
    bool unnamed;
    CKPT_TRY(optimizer_check(o, r, o->load_map, &unnamed));
    CKPT_TRY(optimizer_commit(o, r, o->load_map));
    log_load(o, r, o->load_map, unnamed);
    return CKPT_OK;
}

/* Fresh state of one field into d (elements [lo, hi) of p, from d on) in
 * pieces, where the field or the parameter is behind memory ops: zeros, or
 * (master) the parameter's values widened. */
static int fresh_pieces(const opt_param *p, const ckpt_dst *d, bool master) {
    uint64_t own = (uint64_t)(p->hi - p->lo), cap = 0;
    float *buf = ckpt__mem_bounce(own * sizeof(float), &cap, "optimizer fresh state");
    if (!buf) return CKPT_ENOMEM;
    uint16_t *half = master && p->mem.ops ? ckpt__malloc((size_t)cap / 2 + 1) : NULL;
    int rc = master && p->mem.ops && !half ? ckpt__err_nomem("optimizer fresh state") : 0;
    if (!master) memset(buf, 0, (size_t)cap);
    uint64_t per = cap / sizeof(float) ? cap / sizeof(float) : 1;
    for (uint64_t i = 0; rc == 0 && i < own; i += per) {
        uint64_t k = own - i < per ? own - i : per, e = (uint64_t)p->lo + i;
        const void *src = half ? (const void *)half : (const char *)p->data + 2 * e;
        if (half) rc = ckpt__mem_get(&p->mem, 2 * e, half, 2 * k, p->name);
        if (master && rc == 0) rc = ckpt_dtype_convert(p->dtype, src, CKPT_F32, buf, k);
        if (rc == 0) rc = ckpt__dst_put(d, i * sizeof(float), buf, k * sizeof(float));
    }
    free(half);
    free(buf);
    return rc;
}

/* Fresh state for trainable p (no state in the file): zeros, step 0, the
 * master as the parameter. */
static int fresh_state(const ckpt_optimizer *o, opt_param *p) {
    const char *names[CKPT_OPTIM_MAX_FIELDS];
    float *bufs[CKPT_OPTIM_MAX_FIELDS];
    ckpt_mem_ref mems[CKPT_OPTIM_MAX_FIELDS];
    int64_t own = p->hi - p->lo;
    for (int j = 0, n = ckpt__optim_fields(o, p, names, bufs, mems); j < n && own > 0; j++) {
        bool master = !strcmp(names[j], "master");
        float *at = ckpt__optim_state_at(o, p, bufs[j]);
        if (mems[j].ops || (master && p->mem.ops)) {
            ckpt_dst d = {(uint8_t *)at, {0}, names[j]};
            if (mems[j].ops) d.mem = mem_at(p, &mems[j]);
            CKPT_TRY(fresh_pieces(p, &d, master));
        } else if (master) {
            (void)ckpt_dtype_convert(p->dtype, (const char *)p->data + 2 * p->lo, CKPT_F32, at,
                                     (uint64_t)own);
        } else {
            memset(at, 0, (size_t)own * sizeof(float));
        }
    }
    p->step = 0;
    return CKPT_OK;
}

static int optimizer_commit(ckpt_optimizer *o, ckpt_reader *r, const int64_t *map) {
    /* Commit: the same reads, every one checked above, so they cannot fail
     * now, but for a read error of a file-backed reader midway through the
     * tensor copies (never in ckpt_load_state, whose readers are in memory)
     * or a failing memory ops call. */
    ckpt_optim_options op;
    for (int g = 0; g < o->ngroups; g++) {
        op = o->opts[g];
        CKPT_TRY(read_group(o, r, g, &op));
        o->opts[g] = op;
    }
    char k[KEY_CAP];
    const char *names[CKPT_OPTIM_MAX_FIELDS];
    float *bufs[CKPT_OPTIM_MAX_FIELDS];
    ckpt_mem_ref mems[CKPT_OPTIM_MAX_FIELDS];
    for (int64_t i = 0; i < o->np; i++) {
        opt_param *p = &o->p[i];
        if (p->frozen) continue;
        snprintf(k, sizeof k, "state.%lld.step", (long long)map[i]);
        if (!ckpt__reader_has(r, k, NULL)) {
            CKPT_TRY(fresh_state(o, p));
            continue;
        }
        float step;
        CKPT_TRY(read_step(r, map[i], &step));
        for (int j = 0, n = ckpt__optim_fields(o, p, names, bufs, mems); j < n; j++) {
            snprintf(k, sizeof k, "state.%lld.%s", (long long)map[i], names[j]);
            if (!strcmp(names[j], "master") && !ckpt__reader_has(r, k, NULL)) {
                /* the master follows the parameter (ckpt__optim_master_take_up) */
                int64_t own = p->hi - p->lo;
                if (own > 0)
                    (void)ckpt_dtype_convert(p->dtype, (const char *)p->data + 2 * p->lo, CKPT_F32,
                                             bufs[j], (uint64_t)own);
                continue;
            }
            CKPT_TRY(read_state(o, r, k, p, bufs[j], &mems[j]));
        }
        p->step = step;
    }
    return CKPT_OK;
}

static const ckpt_stateful_ops optimizer_ops = {optimizer_state_dict, optimizer_load_state_dict,
                                                optimizer_check_state_dict};

const ckpt_stateful_ops *ckpt_optimizer_ops(void) { return &optimizer_ops; }
