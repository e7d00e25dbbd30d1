/* optim.c — the optimizer object: its kinds' descriptors (SGD, Adam, AdamW,
 * RMSprop), construction and parameter groups, ZeRO-1 sharding of its state,
 * the step driver and the state dict. The step kernels, bit for bit
 * PyTorch 1.13's, are in optim_kernels.c. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "format/statedict.h"
#include "train/optim.h"
#include "train/optim_int.h"

/* ---- the kinds --------------------------------------------------------- */

static const kind_impl KINDS[4];

const ckpt_optim_desc *ckpt__optim_desc(ckpt_optim_kind kind) {
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++)
        if (KINDS[i].d.kind == kind) return &KINDS[i].d;
    return NULL;
}

const ckpt_optim_desc *ckpt__optim_desc_by_name(const char *name) {
    for (size_t i = 0; i < sizeof KINDS / sizeof KINDS[0]; i++)
        if (strcmp(KINDS[i].d.name, name) == 0) return &KINDS[i].d;
    return NULL;
}

int ckpt__optim_desc_count(void) { return (int)(sizeof KINDS / sizeof KINDS[0]); }

const ckpt_optim_desc *ckpt__optim_desc_at(int i) {
    return i >= 0 && i < ckpt__optim_desc_count() ? &KINDS[i].d : NULL;
}

static const kind_impl *impl_of(ckpt_optim_kind kind) {
    return (const kind_impl *)ckpt__optim_desc(kind);
}

ckpt_optim_options ckpt_optim_defaults(ckpt_optim_kind kind) {
    ckpt_optim_options o;
    memset(&o, 0, sizeof o);
    o.lr = 1e-3;
    const ckpt_optim_desc *d = ckpt__optim_desc(kind);
    if (d) d->defaults(&o);
    return o;
}

#define BAD(field, want, val)                                                                      \
    ckpt__err(CKPT_EINVAL, "optimizer: param_groups.%d." field ": expected " want ", got %g", g,   \
              (double)(val))

/* PyTorch's argument checks (plus finiteness), naming the group's key: the
 * ones every kind has, then the kind's own. */
int ckpt__optim_check_options(const kind_impl *k, const ckpt_optim_options *o, int g) {
    if (!(o->lr >= 0) || !isfinite(o->lr)) return BAD("lr", ">= 0", o->lr);
    if (!(o->weight_decay >= 0) || !isfinite(o->weight_decay))
        return BAD("weight_decay", ">= 0", o->weight_decay);
    return k->d.check(o, g);
}

static int sgd_check(const ckpt_optim_options *o, int g) {
    if (!(o->momentum >= 0) || !isfinite(o->momentum)) return BAD("momentum", ">= 0", o->momentum);
    if (!isfinite(o->dampening)) return BAD("dampening", "a finite value", o->dampening);
    if (o->nesterov && (o->momentum <= 0 || o->dampening != 0))
        return ckpt__err(CKPT_EINVAL,
                         "optimizer: param_groups.%d.nesterov: needs momentum > 0 and "
                         "dampening 0, got momentum %g, dampening %g",
                         g, o->momentum, o->dampening);
    return CKPT_OK;
}

static int adam_check(const ckpt_optim_options *o, int g) {
    if (!(o->eps >= 0) || !isfinite(o->eps)) return BAD("eps", ">= 0", o->eps);
    if (!(o->beta1 >= 0 && o->beta1 < 1)) return BAD("betas.0", "in [0, 1)", o->beta1);
    if (!(o->beta2 >= 0 && o->beta2 < 1)) return BAD("betas.1", "in [0, 1)", o->beta2);
    return CKPT_OK;
}

static int rmsprop_check(const ckpt_optim_options *o, int g) {
    if (!(o->eps >= 0) || !isfinite(o->eps)) return BAD("eps", ">= 0", o->eps);
    if (!(o->momentum >= 0) || !isfinite(o->momentum)) return BAD("momentum", ">= 0", o->momentum);
    if (!(o->alpha >= 0) || !isfinite(o->alpha)) return BAD("alpha", ">= 0", o->alpha);
    if (o->maximize)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "optimizer: param_groups.%d.maximize: RMSprop "
                         "supports only maximize = false",
                         g);
    return CKPT_OK;
}
#undef BAD

static void sgd_defaults(ckpt_optim_options *o) { (void)o; }

static void adam_defaults(ckpt_optim_options *o) {
    o->beta1 = 0.9;
    o->beta2 = 0.999;
    o->eps = 1e-8;
}

static void adamw_defaults(ckpt_optim_options *o) {
    adam_defaults(o);
    o->weight_decay = 1e-2;
}

static void rmsprop_defaults(ckpt_optim_options *o) {
    o->lr = 1e-2;
    o->alpha = 0.99;
    o->eps = 1e-8;
}

/* Which state buffers a parameter needs under its group's options. */
static bool sgd_needs(int b, const ckpt_optim_options *g) { return b == 0 && g->momentum != 0; }
static bool adam_needs(int b, const ckpt_optim_options *g) { return b < 2 || g->amsgrad; }
static bool rmsprop_needs(int b, const ckpt_optim_options *g) {
    return b == 0 || (b == 1 && g->momentum > 0) || (b == 2 && g->centered);
}

/* Drops p's state: frees what ckpt's own optimizer allocated; an external
 * one's buffers are the caller's. */
static void free_state(const ckpt_optimizer *o, opt_param *p) {
    for (int b = 0; b < CKPT_OPTIM_MAX_BUFFERS; b++) {
        if (!o->external) free(p->buf[b]);
        p->buf[b] = NULL;
    }
    if (!o->external) free(p->master);
    p->master = NULL;
    memset(p->mbuf, 0, sizeof p->mbuf);
    memset(&p->mmaster, 0, sizeof p->mmaster);
}

static void free_params(const ckpt_optimizer *o, opt_param *p, int64_t n) {
    if (!p) return;
    for (int64_t i = 0; i < n; i++) free_state(o, &p[i]);
    free(p);
}

static float *zeros(int64_t n) { return ckpt__calloc(n > 0 ? (size_t)n : 1, sizeof(float)); }

/* Whether ckpt's own optimizer can update a parameter of dtype dt under
 * group options g: F32, or BF16/F16 through an fp32 master. */
static int check_dtype(const ckpt_optimizer *o, const opt_param *p, const ckpt_optim_options *g) {
    if (o->external || p->dtype == CKPT_F32) return CKPT_OK;
    const char *dn = ckpt_dtype_name(p->dtype);
    if ((p->dtype == CKPT_BF16 || p->dtype == CKPT_F16) && !g->master_weights)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "optimizer: parameter '%s' is %s: its group needs master_weights "
                         "(an fp32 master per parameter), or make the parameter F32",
                         p->name, dn);
    if (p->dtype != CKPT_BF16 && p->dtype != CKPT_F16)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "optimizer: parameter '%s' is %s: only F32 parameters (and BF16/F16 "
                         "ones with master_weights) are supported",
                         p->name, dn ? dn : "?");
    return CKPT_OK;
}

/* Fresh state for a trainable parameter of ckpt's own optimizer: zeroed
 * buffers as its group needs, a master equal to the parameter, step 0
 * (elements [lo, hi)). State exists from the start so that the state dict
 * has the same keys before and after the first step. Nothing for an
 * external optimizer (the caller attaches its own). */
static int alloc_one(const ckpt_optimizer *o, opt_param *p, const ckpt_optim_options *g) {
    p->step = 0;
    if (o->external || p->frozen) return CKPT_OK;
    if (p->mem.ops)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "optimizer: parameter '%s' lives behind memory ops "
                         "(ckpt_model_add_param_mem), which ckpt's own optimizers cannot update "
                         "(they update host memory): update it with an external optimizer "
                         "(ckpt_optimizer_external_new, its state attached with "
                         "ckpt_optimizer_set_state_mem), or freeze it (ckpt_model_set_frozen) "
                         "before making this optimizer",
                         p->name);
    CKPT_TRY(check_dtype(o, p, g));
    int64_t own = p->hi - p->lo; /* the whole parameter unless sharded */
    bool ok = true;
    for (int b = 0; b < o->impl->d.nbuffers; b++)
        if (o->impl->d.needs(b, g)) ok = ok && (p->buf[b] = zeros(own)) != NULL;
    if (ok && p->needs_master) {
        ok = (p->master = zeros(own)) != NULL;
        if (ok && own > 0)
            (void)ckpt_dtype_convert(p->dtype, (const char *)p->data + 2 * p->lo, CKPT_F32,
                                     p->master, (uint64_t)own);
    }
    if (!ok) return ckpt__err_nomem("optimizer state");
    return CKPT_OK;
}

static int alloc_state(const ckpt_optimizer *o, opt_param *p, int64_t n,
                       const ckpt_optim_options *opts) {
    for (int64_t i = 0; i < n; i++) CKPT_TRY(alloc_one(o, &p[i], &opts[p[i].group]));
    return CKPT_OK;
}

/* p as the model's parameter mi in group g (no state yet, not sharded). */
static void param_init(const ckpt_optimizer *o, opt_param *p, int64_t mi, int g,
                       const ckpt_optim_options *opts) {
    ckpt_param_info info;
    ckpt_model_param(o->model, mi, &info);
    memset(p, 0, sizeof *p);
    p->name = info.name;
    p->midx = mi;
    p->dtype = info.dtype;
    p->ndim = info.ndim;
    memcpy(p->shape, info.shape, sizeof p->shape);
    p->numel = info.numel;
    p->data = info.data;
    p->grad = info.grad;
    p->mem.ops = info.mem_ops;
    p->mem.handle = info.mem_handle;
    p->group = g;
    p->hi = p->numel;
    p->frozen = ckpt__model_user_frozen(o->model, mi);
    p->needs_master = opts[g].master_weights && (info.dtype == CKPT_BF16 || info.dtype == CKPT_F16);
}

/* An external optimizer's new parameter list keeps the buffers the caller
 * attached to each parameter in the old one, where its group still needs
 * them. */
static void keep_attached(const ckpt_optimizer *o, opt_param *np_, int64_t n,
                          const ckpt_optim_options *opts) {
    if (!o->external) return;
    for (int64_t k = 0; k < n; k++) {
        opt_param *q = &np_[k];
        for (int64_t i = 0; i < o->np && !q->frozen; i++) {
            const opt_param *old = &o->p[i];
            if (old->midx != q->midx) continue;
            for (int b = 0; b < o->impl->d.nbuffers; b++)
                if (o->impl->d.needs(b, &opts[q->group])) {
                    q->buf[b] = old->buf[b];
                    q->mbuf[b] = old->mbuf[b];
                }
            if (q->needs_master) {
                q->master = old->master;
                q->mmaster = old->mmaster;
            }
            q->step = old->step;
        }
    }
}

void ckpt_optimizer_free(ckpt_optimizer *o) {
    if (!o) return;
    free_params(o, o->p, o->np);
    free(o->opts);
    free(o->group_start);
    free(o->param_index);
    free(o->rank_start);
    free(o->exchange);
    free(o->send);
    free(o->exchange_lens);
    free(o->load_map);
    free(o);
}

int ckpt__optimizer_make(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                         const ckpt_optim_options *opt, bool external) {
    const char *fn = external ? "optimizer_external_new" : "optimizer_new";
    if (!out) return ckpt__err(CKPT_EINVAL, "%s: out is NULL", fn);
    *out = NULL;
    if (!m || !opt) return ckpt__err(CKPT_EINVAL, "%s: model or options is NULL", fn);
    const kind_impl *impl = impl_of(kind);
    if (!impl) return ckpt__err(CKPT_EINVAL, "%s: unknown kind %d", fn, (int)kind);
    int64_t np = ckpt__model_num_distinct(m); /* tied names: one parameter, one state */
    if (np == 0) return ckpt__err(CKPT_EINVAL, "optimizer: the model has no parameters");
    CKPT_TRY(ckpt__optim_check_options(impl, opt, 0));
    ckpt_optimizer *o = ckpt__calloc(1, sizeof *o);
    if (!o) return ckpt__err_nomem("optimizer");
    o->kind = kind;
    o->impl = impl;
    o->model = m;
    o->external = external;
    o->frozen_gen = ckpt__model_frozen_gen(m);
    o->np = np;
    o->ngroups = 1;
    o->p = ckpt__calloc((size_t)np, sizeof *o->p);
    o->opts = ckpt__malloc(sizeof *o->opts);
    o->group_start = ckpt__malloc(2 * sizeof *o->group_start);
    o->param_index = ckpt__malloc((size_t)np * sizeof *o->param_index);
    o->load_map = ckpt__malloc((size_t)np * sizeof *o->load_map);
    if (!o->p || !o->opts || !o->group_start || !o->param_index || !o->load_map) {
        ckpt_optimizer_free(o);
        return ckpt__err_nomem("optimizer");
    }
    o->opts[0] = *opt;
    o->group_start[0] = 0;
    o->group_start[1] = np;
    for (int64_t i = 0; i < np; i++) {
        param_init(o, &o->p[i], ckpt__model_distinct(m, i), 0, o->opts);
        o->param_index[i] = i;
    }
    int rc = alloc_state(o, o->p, np, o->opts);
    if (rc < 0) {
        ckpt_optimizer_free(o);
        return rc;
    }
    for (int64_t i = 0; i < ckpt_model_num_params(m); i++) ckpt__model_set_grouped(m, i, true);
    *out = o;
    return CKPT_OK;
}

int ckpt_optimizer_new(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                       const ckpt_optim_options *opt) {
    return ckpt__optimizer_make(out, kind, m, opt, false);
}

int ckpt_sgd_new(ckpt_optimizer **out, ckpt_model *m, double lr, double momentum,
                 double weight_decay, bool nesterov) {
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    o.lr = lr;
    o.momentum = momentum;
    o.weight_decay = weight_decay;
    o.nesterov = nesterov;
    return ckpt_optimizer_new(out, CKPT_OPTIM_SGD, m, &o);
}

static int adam_like_new(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m, double lr,
                         double beta1, double beta2, double eps, double weight_decay) {
    ckpt_optim_options o = ckpt_optim_defaults(kind);
    o.lr = lr;
    o.beta1 = beta1;
    o.beta2 = beta2;
    o.eps = eps;
    o.weight_decay = weight_decay;
    return ckpt_optimizer_new(out, kind, m, &o);
}

int ckpt_adam_new(ckpt_optimizer **out, ckpt_model *m, double lr, double beta1, double beta2,
                  double eps, double weight_decay) {
    return adam_like_new(out, CKPT_OPTIM_ADAM, m, lr, beta1, beta2, eps, weight_decay);
}

int ckpt_adamw_new(ckpt_optimizer **out, ckpt_model *m, double lr, double beta1, double beta2,
                   double eps, double weight_decay) {
    return adam_like_new(out, CKPT_OPTIM_ADAMW, m, lr, beta1, beta2, eps, weight_decay);
}

int ckpt_rmsprop_new(ckpt_optimizer **out, ckpt_model *model, double lr, double alpha, double eps,
                     double weight_decay, double momentum, bool centered) {
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_RMSPROP);
    o.lr = lr;
    o.alpha = alpha;
    o.eps = eps;
    o.weight_decay = weight_decay;
    o.momentum = momentum;
    o.centered = centered;
    return ckpt_optimizer_new(out, CKPT_OPTIM_RMSPROP, model, &o);
}

static bool has_stepped(const ckpt_optimizer *o) {
    for (int64_t i = 0; i < o->np; i++)
        if (o->p[i].step != 0) return true;
    return false;
}

/* ---- ZeRO-1 ------------------------------------------------------------- */

/* Parameters that take part in the split: at least one dimension and one
 * element, and trainable when the split is made. Scalars, empty tensors and
 * frozen parameters (should they be unfrozen later) are updated by every
 * rank in full. */
static bool splittable(const opt_param *p) { return p->ndim >= 1 && p->numel > 0 && !p->frozen; }

/* The split (docs/DISTRIBUTED.md, "ZeRO-1"): the splittable parameters, in
 * state order, form one flat range of N elements. Rank r's nominal share
 * starts at floor(r * N / P); a start that falls inside a parameter moves to
 * the nearest row boundary of that parameter (ties: the lower one). So each
 * rank owns a contiguous range, and its part of each parameter is a run of
 * whole rows: one box chunk [row0, 0, ...] + [nrows, shape[1], ...]. Sets
 * every p[i].sharded/lo/hi and *cuts_out (size + 1 flat offsets). */
static int shard_layout(const ckpt_comm *c, opt_param *p, int64_t np, int64_t **cuts_out) {
    int P = c->size;
    int64_t *cuts = ckpt__calloc((size_t)P + 1, sizeof *cuts);
    if (!cuts) return ckpt__err_nomem("optimizer shards");
    uint64_t total = 0;
    for (int64_t i = 0; i < np; i++)
        if (splittable(&p[i])) total += (uint64_t)p[i].numel;
    for (int r = 0; r <= P; r++) {
        uint64_t b = (uint64_t)(((unsigned __int128)total * (unsigned)r) / (unsigned)P);
        /* Snap b to a row boundary of the parameter it falls in. */
        uint64_t s = 0;
        for (int64_t i = 0; i < np; i++) {
            if (!splittable(&p[i])) continue;
            uint64_t n = (uint64_t)p[i].numel;
            if (b > s && b < s + n) {
                uint64_t row = (uint64_t)ckpt__optim_row_size(&p[i]);
                uint64_t k = (b - s) / row, rem = (b - s) % row;
                if (rem * 2 > row) k++;
                b = s + k * row;
                break;
            }
            s += n;
        }
        cuts[r] = (int64_t)b;
    }
    uint64_t s = 0;
    for (int64_t i = 0; i < np; i++) {
        opt_param *q = &p[i];
        q->sharded = splittable(q);
        q->lo = 0;
        q->hi = q->numel;
        if (!q->sharded) continue;
        int64_t a = cuts[c->rank], b = cuts[c->rank + 1];
        int64_t lo = a - (int64_t)s, hi = b - (int64_t)s;
        if (lo < 0) lo = 0;
        if (hi > q->numel) hi = q->numel;
        if (hi < lo) hi = lo = 0;
        q->lo = lo;
        q->hi = hi;
        s += (uint64_t)q->numel;
    }
    *cuts_out = cuts;
    return CKPT_OK;
}

static int exchange_alloc(ckpt_optimizer *o);

int ckpt_optimizer_set_shard(ckpt_optimizer *o, const ckpt_comm *comm) {
    if (!o || !comm) return ckpt__err(CKPT_EINVAL, "optimizer_set_shard: NULL argument");
    if (comm->size < 1 || comm->rank < 0 || comm->rank >= comm->size || !comm->allgather)
        return ckpt__err(CKPT_EINVAL,
                         "optimizer_set_shard: communicator of rank %d of %d (or without "
                         "allgather)",
                         comm->rank, comm->size);
    if (has_stepped(o))
        return ckpt__err(CKPT_EINVAL, "optimizer_set_shard: only before the first step");
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    int64_t *cuts = NULL;
    opt_param *p = ckpt__calloc((size_t)o->np, sizeof *p);
    size_t *lens = ckpt__calloc((size_t)comm->size, sizeof *lens);
    if (!p || !lens) {
        free(p);
        free(lens);
        return ckpt__err_nomem("optimizer shards");
    }
    for (int64_t i = 0; i < o->np; i++) {
        p[i] = o->p[i];
        if (!o->external) {
            memset(p[i].buf, 0, sizeof p[i].buf);
            p[i].master = NULL;
        }
    }
    int rc = shard_layout(comm, p, o->np, &cuts);
    if (rc == 0) rc = alloc_state(o, p, o->np, o->opts);
    if (rc < 0) {
        free_params(o, p, o->np);
        free(cuts);
        free(lens);
        return rc;
    }
    free_params(o, o->p, o->np);
    free(o->rank_start);
    free(o->exchange_lens);
    o->p = p;
    o->comm = comm;
    o->rank_start = cuts;
    o->exchange_lens = lens;
    return exchange_alloc(o);
}

/* The bytes rank r contributes to the exchange: its share of every sharded
 * parameter, each in the parameter's dtype. */
static size_t share_bytes(const ckpt_optimizer *o, int r) {
    int64_t a = o->rank_start[r], b = o->rank_start[r + 1], s = 0;
    size_t n = 0;
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        if (!p->sharded) continue;
        int64_t lo = a > s ? a : s, hi = b < s + p->numel ? b : s + p->numel;
        if (hi > lo) n += (size_t)(hi - lo) * ckpt__optim_esize(p);
        s += p->numel;
    }
    return n;
}

/* (Re)allocates the exchange buffers for the current cuts. */
static int exchange_alloc(ckpt_optimizer *o) {
    const ckpt_comm *c = o->comm;
    size_t total = 0;
    for (int r = 0; r < c->size; r++) total += o->exchange_lens[r] = share_bytes(o, r);
    size_t own = o->exchange_lens[c->rank];
    free(o->exchange);
    free(o->send);
    o->exchange = ckpt__malloc(total ? total : 1);
    o->send = ckpt__malloc(own ? own : 1);
    if (!o->exchange || !o->send) return ckpt__err_nomem("optimizer exchange buffer");
    return CKPT_OK;
}

/* After each rank updated its share: every rank gets every share's new
 * values (one allgather of the flat range, in rank order). */
static int exchange_shares(ckpt_optimizer *o) {
    const ckpt_comm *c = o->comm;
    unsigned char *ex = o->exchange;
    unsigned char *mine = o->send;
    if (!ex || !mine) return ckpt__err(CKPT_ENOMEM, "optimizer step: no exchange buffer");
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        if (!p->sharded || p->hi == p->lo) continue;
        size_t es = ckpt__optim_esize(p);
        memcpy(mine, (const char *)p->data + (size_t)p->lo * es, (size_t)(p->hi - p->lo) * es);
        mine += (size_t)(p->hi - p->lo) * es;
    }
    int rc = c->allgather(c->ctx, o->send, ex, o->exchange_lens);
    if (rc < 0) return ckpt__err_prefix(rc, "optimizer step: exchanging updated parameters");
    /* rank r's bytes are its part of each parameter in turn: walk the
     * ranks' parts of each parameter in rank order */
    size_t *at = ckpt__calloc((size_t)c->size, sizeof *at);
    if (!at) return ckpt__err_nomem("optimizer exchange");
    size_t base = 0;
    for (int r = 0; r < c->size; r++) {
        at[r] = base;
        base += o->exchange_lens[r];
    }
    int64_t s = 0;
    for (int64_t i = 0; i < o->np; i++) {
        opt_param *p = &o->p[i];
        if (!p->sharded) continue;
        size_t es = ckpt__optim_esize(p);
        for (int r = 0; r < c->size; r++) {
            int64_t a = o->rank_start[r], b = o->rank_start[r + 1];
            int64_t lo = a > s ? a : s, hi = b < s + p->numel ? b : s + p->numel;
            if (hi <= lo) continue;
            memcpy((char *)p->data + (size_t)(lo - s) * es, ex + at[r], (size_t)(hi - lo) * es);
            at[r] += (size_t)(hi - lo) * es;
        }
        s += p->numel;
    }
    free(at);
    return CKPT_OK;
}

int ckpt_optimizer_set_groups(ckpt_optimizer *o, int ngroups, const int *group_of,
                              const ckpt_optim_options *opts) {
    if (!o || !group_of || !opts)
        return ckpt__err(CKPT_EINVAL, "optimizer_set_groups: NULL argument");
    if (has_stepped(o))
        return ckpt__err(CKPT_EINVAL, "optimizer_set_groups: only before the first step");
    if (ngroups < 1) return ckpt__err(CKPT_EINVAL, "optimizer_set_groups: %d groups", ngroups);
    int64_t nm = ckpt_model_num_params(o->model);
    for (int g = 0; g < ngroups; g++) CKPT_TRY(ckpt__optim_check_options(o->impl, &opts[g], g));
    int64_t *count = ckpt__calloc((size_t)ngroups + 1, sizeof *count);
    if (!count) return ckpt__err_nomem("optimizer groups");
    int64_t np = 0;
    for (int64_t i = 0; i < nm; i++) {
        /* not optimized (a frozen parameter), or a tied name (its parameter's group) */
        if (group_of[i] == -1 || ckpt__model_is_tied(o->model, i)) continue;
        if (group_of[i] < 0 || group_of[i] >= ngroups) {
            free(count);
            return ckpt__err(CKPT_EINVAL,
                             "optimizer_set_groups: parameter %lld: group %d outside -1..%d",
                             (long long)i, group_of[i], ngroups - 1);
        }
        count[group_of[i]]++;
        np++;
    }
    for (int g = 0; g < ngroups; g++)
        if (count[g] == 0) {
            free(count);
            return ckpt__err(CKPT_EINVAL, "optimizer_set_groups: group %d has no parameters", g);
        }
    opt_param *p = ckpt__calloc((size_t)np, sizeof *p);
    ckpt_optim_options *nopts = ckpt__malloc((size_t)ngroups * sizeof *nopts);
    int64_t *start = ckpt__malloc(((size_t)ngroups + 1) * sizeof *start);
    int64_t *index = ckpt__malloc((size_t)np * sizeof *index);
    int64_t *lmap = ckpt__malloc((size_t)(np ? np : 1) * sizeof *lmap);
    if (!p || !nopts || !start || !index || !lmap) {
        free(p);
        free(nopts);
        free(start);
        free(index);
        free(lmap);
        free(count);
        return ckpt__err_nomem("optimizer groups");
    }
    memcpy(nopts, opts, (size_t)ngroups * sizeof *nopts);
    start[0] = 0;
    for (int g = 0; g < ngroups; g++) start[g + 1] = start[g] + count[g];
    memset(count, 0, ((size_t)ngroups + 1) * sizeof *count);
    for (int64_t i = 0; i < nm; i++) {
        if (group_of[i] == -1 || ckpt__model_is_tied(o->model, i)) continue;
        int g = group_of[i];
        int64_t k = start[g] + count[g]++;
        param_init(o, &p[k], i, g, nopts);
        index[k] = k;
    }
    free(count);
    keep_attached(o, p, np, nopts);
    int64_t *cuts = NULL;
    int rc = o->comm ? shard_layout(o->comm, p, np, &cuts) : CKPT_OK;
    if (rc == 0) rc = alloc_state(o, p, np, nopts);
    if (rc < 0) {
        free(cuts);
        free_params(o, p, np);
        free(nopts);
        free(start);
        free(index);
        free(lmap);
        return rc;
    }
    free_params(o, o->p, o->np);
    free(o->opts);
    free(o->group_start);
    free(o->param_index);
    free(o->load_map);
    o->p = p;
    o->np = np;
    o->opts = nopts;
    o->ngroups = ngroups;
    o->group_start = start;
    o->param_index = index;
    o->load_map = lmap;
    o->frozen_gen = ckpt__model_frozen_gen(o->model);
    for (int64_t i = 0; i < nm; i++) ckpt__model_set_grouped(o->model, i, group_of[i] != -1);
    if (o->comm) {
        free(o->rank_start);
        o->rank_start = cuts;
        return exchange_alloc(o);
    }
    return CKPT_OK;
}

int ckpt_optimizer_num_groups(const ckpt_optimizer *o) { return o ? o->ngroups : 0; }

double ckpt_optimizer_get_lr(const ckpt_optimizer *o, int group) {
    if (!o || group < 0 || group >= o->ngroups) return NAN;
    return o->opts[group].lr;
}

int ckpt_optimizer_set_lr(ckpt_optimizer *o, int group, double lr) {
    if (!o) return ckpt__err(CKPT_EINVAL, "optimizer_set_lr: optimizer is NULL");
    if (group < 0 || group >= o->ngroups)
        return ckpt__err(CKPT_EINVAL, "optimizer_set_lr: group %d outside 0..%d", group,
                         o->ngroups - 1);
    if (!(lr >= 0) || !isfinite(lr))
        return ckpt__err(CKPT_EINVAL, "optimizer: param_groups.%d.lr: expected >= 0, got %g",
                         group, lr);
    o->opts[group].lr = lr;
    return CKPT_OK;
}

/* The kinds: hyper-parameters in state-dict order (after lr, weight_decay,
 * maximize), state buffers, PyTorch 1.13's param_group fields in its order. */
#define HP(k, field, isb)                                                                          \
    { .key = k, .offset = offsetof(ckpt_optim_options, field), .is_bool = isb }
#define TF_HP(n)                                                                                   \
    { .name = n, .kind = CKPT_TF_HPARAM, .key = n }
#define TF_NONE(n)                                                                                 \
    { .name = n, .kind = CKPT_TF_NONE }
#define TF_FALSE(n)                                                                                \
    { .name = n, .kind = CKPT_TF_FALSE }
#define TF_BETAS                                                                                   \
    { .name = "betas", .kind = CKPT_TF_PAIR, .key = "betas.0", .key2 = "betas.1" }
#define ADAM_HPARAMS                                                                               \
    .nhparams = 4,                                                                                 \
    .hparams = {HP("betas.0", beta1, false), HP("betas.1", beta2, false), HP("eps", eps, false),   \
                HP("amsgrad", amsgrad, true)},                                                     \
    .nbuffers = 3, .buffers = {"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, .needs = adam_needs,    \
    .needs_what = "amsgrad", .check = adam_check, .torch_step = CKPT_TORCH_STEP_TENSOR
static const kind_impl KINDS[4] = {
    {.d = {.kind = CKPT_OPTIM_SGD,
           .name = "sgd",
           .torch_name = "SGD",
           .nhparams = 3,
           .hparams = {HP("momentum", momentum, false), HP("dampening", dampening, false),
                       HP("nesterov", nesterov, true)},
           .nbuffers = 1,
           .buffers = {"momentum_buffer"},
           .needs = sgd_needs,
           .needs_what = "momentum (zero vs non-zero)",
           .check = sgd_check,
           .defaults = sgd_defaults,
           .torch_step = CKPT_TORCH_STEP_NONE,
           .torch_none_buffer = true,
           .ntorch_fields = 8,
           .torch_fields = {TF_HP("lr"), TF_HP("momentum"), TF_HP("dampening"),
                            TF_HP("weight_decay"), TF_HP("nesterov"), TF_HP("maximize"),
                            TF_NONE("foreach"), TF_FALSE("differentiable")}},
     .update = ckpt__optim_sgd_update},
    {.d = {.kind = CKPT_OPTIM_ADAM,
           .name = "adam",
           .torch_name = "Adam",
           ADAM_HPARAMS,
           .defaults = adam_defaults,
           .ntorch_fields = 10,
           .torch_fields = {TF_HP("lr"), TF_BETAS, TF_HP("eps"), TF_HP("weight_decay"),
                            TF_HP("amsgrad"), TF_HP("maximize"), TF_NONE("foreach"),
                            TF_FALSE("capturable"), TF_FALSE("differentiable"), TF_FALSE("fused")}},
     .update = ckpt__optim_adam_update},
    {.d = {.kind = CKPT_OPTIM_ADAMW,
           .name = "adamw",
           .torch_name = "AdamW",
           ADAM_HPARAMS,
           .defaults = adamw_defaults,
           .ntorch_fields = 8,
           .torch_fields = {TF_HP("lr"), TF_BETAS, TF_HP("eps"), TF_HP("weight_decay"),
                            TF_HP("amsgrad"), TF_NONE("foreach"), TF_HP("maximize"),
                            TF_FALSE("capturable")}},
     .update = ckpt__optim_adamw_update},
    {.d = {.kind = CKPT_OPTIM_RMSPROP,
           .name = "rmsprop",
           .torch_name = "RMSprop",
           .nhparams = 4,
           .hparams = {HP("alpha", alpha, false), HP("eps", eps, false),
                       HP("momentum", momentum, false), HP("centered", centered, true)},
           .nbuffers = 3,
           .buffers = {"square_avg", "momentum_buffer", "grad_avg"},
           .needs = rmsprop_needs,
           .needs_what = "momentum (zero vs non-zero) or centered",
           .check = rmsprop_check,
           .defaults = rmsprop_defaults,
           .torch_step = CKPT_TORCH_STEP_INT,
           .ntorch_fields = 9,
           .torch_fields = {TF_HP("lr"), TF_HP("momentum"), TF_HP("alpha"), TF_HP("eps"),
                            TF_HP("centered"), TF_HP("weight_decay"), TF_NONE("foreach"),
                            TF_HP("maximize"), TF_FALSE("differentiable")}},
     .update = ckpt__optim_rmsprop_update},
};
#undef ADAM_HPARAMS
#undef TF_BETAS
#undef TF_FALSE
#undef TF_NONE
#undef HP
#undef TF_HP

/* ---- frozen parameters ------------------------------------------------ */

int ckpt__optim_sync_frozen(ckpt_optimizer *o) {
    uint64_t gen = ckpt__model_frozen_gen(o->model);
    if (gen == o->frozen_gen) return CKPT_OK;
    for (int64_t i = 0; i < o->np; i++) {
        opt_param *p = &o->p[i];
        bool f = ckpt__model_user_frozen(o->model, p->midx);
        if (f == p->frozen) continue;
        free_state(o, p); /* frozen: none; unfrozen: fresh (own) or the caller's (external) */
        p->step = 0;
        p->frozen = f;
        int rc = f ? CKPT_OK : alloc_one(o, p, &o->opts[p->group]);
        if (rc < 0) {
            free_state(o, p);
            p->frozen = true; /* tried again at the next call */
            return rc;
        }
    }
    o->frozen_gen = gen;
    return CKPT_OK;
}

/* ---- state fields --------------------------------------------------------- */

int ckpt__optim_fields(const ckpt_optimizer *o, const opt_param *p, const char **names,
                       float **bufs, ckpt_mem_ref *mems) {
    int n = 0;
    const ckpt_optim_options *g = &o->opts[p->group];
    for (int b = 0; b < o->impl->d.nbuffers; b++)
        if (o->impl->d.needs(b, g)) {
            names[n] = o->impl->d.buffers[b];
            if (mems) mems[n] = p->mbuf[b];
            bufs[n++] = p->buf[b];
        }
    if (p->needs_master) {
        names[n] = "master";
        if (mems) mems[n] = p->mmaster;
        bufs[n++] = p->master;
    }
    return n;
}

int ckpt__optim_check_attached(const ckpt_optimizer *o) {
    if (!o->external) return CKPT_OK;
    const char *names[CKPT_OPTIM_MAX_FIELDS];
    float *bufs[CKPT_OPTIM_MAX_FIELDS];
    ckpt_mem_ref mems[CKPT_OPTIM_MAX_FIELDS];
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        if (p->frozen || p->numel == 0) continue;
        for (int j = 0, n = ckpt__optim_fields(o, p, names, bufs, mems); j < n; j++)
            if (!bufs[j] && !mems[j].ops)
                return ckpt__err(CKPT_EINVAL,
                                 "optimizer: external %s optimizer: parameter '%s' has no '%s' "
                                 "(every trainable parameter needs every field of its group: "
                                 "ckpt_optimizer_set_state, _block or _mem)",
                                 o->impl->d.name, p->name, names[j]);
    }
    return CKPT_OK;
}

/* ---- the step ------------------------------------------------------------ */

int ckpt_optimizer_step(ckpt_optimizer *o) {
    if (!o) return ckpt__err(CKPT_EINVAL, "optimizer_step: optimizer is NULL");
    if (o->external)
        return ckpt__err(CKPT_EINVAL,
                         "optimizer_step: this optimizer is external "
                         "(ckpt_optimizer_external_new): the caller runs its update, and says "
                         "how many it ran with ckpt_optimizer_set_step");
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    /* Check first so that a missing gradient changes nothing. */
    for (int64_t i = 0; i < o->np; i++)
        if (!o->p[i].frozen && !o->p[i].grad && o->p[i].numel > 0)
            return ckpt__err(CKPT_EINVAL,
                             "optimizer: parameter '%s' (state %lld) has no gradient buffer",
                             o->p[i].name, (long long)i);
    for (int64_t i = 0; i < o->np; i++)
        if (!o->p[i].frozen) ckpt__optim_update_param(o->impl, &o->p[i], &o->opts[o->p[i].group]);
    if (o->comm && o->comm->size > 1) return exchange_shares(o);
    return CKPT_OK;
}

/* PyTorch counts steps in a float32 per parameter: exact up to 2^24. */
#define STEP_MAX ((int64_t)1 << 24)

int ckpt_optimizer_set_step(ckpt_optimizer *o, int64_t step) {
    if (!o) return ckpt__err(CKPT_EINVAL, "optimizer_set_step: optimizer is NULL");
    if (step < 0 || step > STEP_MAX)
        return ckpt__err(CKPT_EINVAL,
                         "optimizer_set_step: step %lld, expected 0..%lld (PyTorch keeps the "
                         "count in a float32, exact up to 2^24)",
                         (long long)step, (long long)STEP_MAX);
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    for (int64_t i = 0; i < o->np; i++)
        if (!o->p[i].frozen) o->p[i].step = (float)step; /* frozen: no state, no count */
    return CKPT_OK;
}

int64_t ckpt_optimizer_get_step(const ckpt_optimizer *o) {
    if (!o) return 0;
    float most = 0.0f;
    for (int64_t i = 0; i < o->np; i++)
        if (!o->p[i].frozen && o->p[i].step > most) most = o->p[i].step;
    return (int64_t)most;
}

void ckpt_optimizer_zero_grad(ckpt_optimizer *o) {
    if (!o) return;
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        uint64_t nb = 0;
        if (p->grad && ckpt_tensor_nbytes(p->dtype, p->ndim, p->shape, &nb) == 0)
            memset(p->grad, 0, (size_t)nb);
    }
}

/* ---- internal accessors (optim.h) -------------------------------------- */

int64_t ckpt__optimizer_num_params(const ckpt_optimizer *o) { return o ? o->np : 0; }

void *ckpt__optimizer_grad(const ckpt_optimizer *o, int64_t i, int64_t *numel, ckpt_dtype *dt) {
    const opt_param *p = &o->p[i];
    if (numel) *numel = p->numel;
    if (dt) *dt = p->dtype;
    return p->frozen ? NULL : p->grad;
}

const char *ckpt__optimizer_param_name(const ckpt_optimizer *o, int64_t i) {
    return o->p[i].name;
}
