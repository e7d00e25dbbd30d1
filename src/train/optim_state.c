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

/* A parameter's state tensors besides step, in key order: their key suffixes
 * and buffers. Returns how many it has. */
static int state_buffers(const ckpt_optimizer *o, const opt_param *p,
                         const char *names[CKPT_OPTIM_MAX_BUFFERS],
                         float *bufs[CKPT_OPTIM_MAX_BUFFERS]) {
    int n = 0;
    for (int b = 0; b < o->impl->d.nbuffers; b++)
        if (p->buf[b]) {
            names[n] = o->impl->d.buffers[b];
            bufs[n++] = p->buf[b];
        }
    return n;
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

/* Writes one state buffer: a chunk of the whole tensor when sharded (every
 * rank writes one, empty if it owns no row of the parameter, so every rank's
 * state dict has the same keys), else the tensor. */
static int write_state(const ckpt_optimizer *o, ckpt_writer *w, const char *k, const opt_param *p,
                       const float *buf) {
    if (!o->comm || !p->sharded) return ckpt_write_tensor(w, k, CKPT_F32, p->ndim, p->shape, buf);
    int64_t off[CKPT_MAX_NDIM], local[CKPT_MAX_NDIM];
    share_box(p, off, local);
    return ckpt_write_tensor_shard(w, k, CKPT_F32, p->ndim, p->shape, off, local, buf);
}

/* Reads one state buffer: this rank's slice when sharded, from however
 * many chunks (or a whole tensor) the file has. */
static int read_state(const ckpt_optimizer *o, ckpt_reader *r, const char *k, const opt_param *p,
                      float *buf) {
    if (!o->comm || !p->sharded) return ckpt_read_tensor(r, k, CKPT_F32, p->ndim, p->shape, buf);
    if (p->hi == p->lo) return CKPT_OK;
    int64_t off[CKPT_MAX_NDIM], local[CKPT_MAX_NDIM];
    share_box(p, off, local);
    return ckpt_read_tensor_shard(r, k, CKPT_F32, p->ndim, p->shape, off, local, buf);
}

static int optimizer_state_dict(void *self, ckpt_writer *w) {
    const ckpt_optimizer *o = self;
    char k[KEY_CAP];
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
        snprintf(k, sizeof k, "state.%lld.step", (long long)i);
        CKPT_TRY(ckpt_write_tensor(w, k, CKPT_F32, 0, NULL, &p->step));
        const char *names[CKPT_OPTIM_MAX_BUFFERS];
        float *bufs[CKPT_OPTIM_MAX_BUFFERS];
        for (int j = 0, n = state_buffers(o, p, names, bufs); j < n; j++) {
            snprintf(k, sizeof k, "state.%lld.%s", (long long)i, names[j]);
            CKPT_TRY(write_state(o, w, k, p, bufs[j]));
            /* the file's state.<i> may be another parameter's (a load maps
             * by name): its shape is checked after the mapping */
            if (ckpt__writer_is_schema(w)) CKPT_TRY(ckpt__writer_set_shape_by_object(w, k));
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
    const char *names[CKPT_OPTIM_MAX_BUFFERS];
    float *bufs[CKPT_OPTIM_MAX_BUFFERS];
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        float step;
        CKPT_TRY(read_step(r, map[i], &step));
        for (int j = 0, n = state_buffers(o, p, names, bufs); j < n; j++) {
            snprintf(k, sizeof k, "state.%lld.%s", (long long)map[i], names[j]);
            CKPT_TRY(check_state_tensor(r, k, p->ndim, p->shape));
        }
    }
    return CKPT_OK;
}

static int optimizer_check_state_dict(void *self, ckpt_reader *r) {
    const ckpt_optimizer *o = self;
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

static int optimizer_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_optimizer *o = self;
    /* Validate everything before changing anything. */
    bool unnamed;
    CKPT_TRY(optimizer_check(o, r, o->load_map, &unnamed));
    CKPT_TRY(optimizer_commit(o, r, o->load_map));
    if (unnamed)
        ckpt__log(&(ckpt_logger){o->log_fn, o->log_user}, CKPT_LOG_WARNING,
                   "optimizer: the state dict does not name its parameters; its state was "
                   "matched by position (%lld parameters, as allowed by "
                   "ckpt_optimizer_set_match_by_position)",
                   (long long)o->np);
    return CKPT_OK;
}

static int optimizer_commit(ckpt_optimizer *o, ckpt_reader *r, const int64_t *map) {
    /* Commit: the same reads, every one checked above, so they cannot fail
     * now, but for a read error of a file-backed reader midway through the
     * tensor copies (never in ckpt_load_state, whose readers are in memory). */
    ckpt_optim_options op;
    for (int g = 0; g < o->ngroups; g++) {
        op = o->opts[g];
        CKPT_TRY(read_group(o, r, g, &op));
        o->opts[g] = op;
    }
    char k[KEY_CAP];
    const char *names[CKPT_OPTIM_MAX_BUFFERS];
    float *bufs[CKPT_OPTIM_MAX_BUFFERS];
    for (int64_t i = 0; i < o->np; i++) {
        opt_param *p = &o->p[i];
        float step;
        CKPT_TRY(read_step(r, map[i], &step));
        for (int j = 0, n = state_buffers(o, p, names, bufs); j < n; j++) {
            snprintf(k, sizeof k, "state.%lld.%s", (long long)map[i], names[j]);
            CKPT_TRY(read_state(o, r, k, p, bufs[j]));
        }
        p->step = step;
    }
    return CKPT_OK;
}

static const ckpt_stateful_ops optimizer_ops = {optimizer_state_dict, optimizer_load_state_dict,
                                                optimizer_check_state_dict};

const ckpt_stateful_ops *ckpt_optimizer_ops(void) { return &optimizer_ops; }
