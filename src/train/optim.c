/* optim.c — SGD, Adam and AdamW as PyTorch 1.13's single-tensor (foreach=False)
 * implementations compute them: fp32 tensors, Python-float (double) scalars
 * rounded to float where PyTorch's kernels round them, in PyTorch's order of
 * operations, so trajectories agree with PyTorch's bit for bit. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "format/statedict.h"
#include "train/optim.h"

/* PyTorch's CPU kernels (AVX2 build) compute add(x, alpha=a) and addcmul with
 * a fused multiply-add; we use fmaf at the same places so that the results
 * agree bit for bit. On x86-64 the SGD loop is compiled twice, for FMA
 * hardware (fmaf becomes one vectorized instruction) and for the baseline
 * (fmaf is a libm call: exact, but slower), picked at load time; the Adam loop
 * has an explicit AVX2 version (below). */
#define FMADD(a, b, c) fmaf((a), (b), (c))
/* (Not under ThreadSanitizer: its runtime is not ready when the loader runs
 * the clones' resolver.) */
#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__) && !defined(CKPT_NO_IFUNC)
#define UPDATE_CLONES __attribute__((target_clones("fma", "default")))
#else
#define UPDATE_CLONES
#endif

typedef struct opt_param {
    const char *name; /* view into the model */
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    int64_t numel;
    float *data;
    float *grad;
    int group;
    float step; /* PyTorch keeps a float32 0-d tensor */
    /* The kind's state buffers (its descriptor's buffers[b]), NULL where
     * the group's options need none: Adam's exp_avg, exp_avg_sq,
     * max_exp_avg_sq; SGD's momentum_buffer; RMSprop's square_avg,
     * momentum_buffer, grad_avg. */
    float *buf[CKPT_OPTIM_MAX_BUFFERS];
    /* ZeRO-1: this rank updates and keeps state for elements [lo, hi) only
     * (whole rows); unsharded, and for parameters that are never split
     * (scalars, empty tensors), lo = 0 and hi = numel. */
    bool sharded;
    int64_t lo, hi;
} opt_param;

struct ckpt_optimizer {
    ckpt_optim_kind kind;
    const struct kind_impl *impl; /* the kind's descriptor and step */
    ckpt_model *model;
    int64_t np;
    opt_param *p; /* in PyTorch's numbering: group 0's parameters, then group 1's... */
    int ngroups;
    ckpt_optim_options *opts;
    int64_t *group_start; /* ngroups + 1 offsets into p */
    int64_t *param_index; /* 0..np-1, the data of the param_groups.<g>.params tensors */
    const ckpt_comm *comm; /* ZeRO-1 (ckpt_optimizer_set_shard), or NULL */
    int64_t *rank_start;   /* comm->size + 1 cuts of the flattened sharded parameters */
    float *exchange;       /* every rank's updated values, flat (rank_start) */
    float *send;           /* this rank's updated values (never aliases exchange) */
    size_t *exchange_lens; /* bytes each rank contributes */
    int64_t *load_map;     /* np: a load's file state index of each parameter, kept so
                              that load_state_dict allocates nothing past its checks */
    bool by_position;      /* state without parameter names may load by position */
    ckpt_log_fn log_fn;    /* NULL: stderr */
    void *log_user;
};

/* ---- the kinds --------------------------------------------------------- */

typedef struct kind_impl {
    ckpt_optim_desc d; /* first: a descriptor pointer is its kind_impl's */
    /* One parameter's update (this rank's elements [lo, hi)), step count
     * included. */
    void (*update)(opt_param *p, const ckpt_optim_options *g);
} kind_impl;

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
static int check_options(const kind_impl *k, const ckpt_optim_options *o, int g) {
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

static void free_state(opt_param *p) {
    for (int b = 0; b < CKPT_OPTIM_MAX_BUFFERS; b++) {
        free(p->buf[b]);
        p->buf[b] = NULL;
    }
}

static void free_params(opt_param *p, int64_t n) {
    if (!p) return;
    for (int64_t i = 0; i < n; i++) free_state(&p[i]);
    free(p);
}

static float *zeros(int64_t n) { return ckpt__calloc(n > 0 ? (size_t)n : 1, sizeof(float)); }

/* Allocates zeroed state for every parameter of p as its group needs.
 * State exists from the start (zeros, step 0) so that the state dict has the
 * same keys before and after the first step. */
static int alloc_state(const ckpt_optimizer *o, opt_param *p, int64_t n,
                       const ckpt_optim_options *opts) {
    for (int64_t i = 0; i < n; i++) {
        const ckpt_optim_options *g = &opts[p[i].group];
        bool ok = true;
        int64_t own = p[i].hi - p[i].lo; /* the whole parameter unless sharded */
        for (int b = 0; b < o->impl->d.nbuffers; b++)
            if (o->impl->d.needs(b, g)) ok = ok && (p[i].buf[b] = zeros(own)) != NULL;
        if (!ok) return ckpt__err_nomem("optimizer state");
    }
    return CKPT_OK;
}

void ckpt_optimizer_free(ckpt_optimizer *o) {
    if (!o) return;
    free_params(o->p, o->np);
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

int ckpt_optimizer_new(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                       const ckpt_optim_options *opt) {
    if (!out) return ckpt__err(CKPT_EINVAL, "optimizer_new: out is NULL");
    *out = NULL;
    if (!m || !opt) return ckpt__err(CKPT_EINVAL, "optimizer_new: model or options is NULL");
    const kind_impl *impl = impl_of(kind);
    if (!impl) return ckpt__err(CKPT_EINVAL, "optimizer_new: unknown kind %d", (int)kind);
    int64_t np = ckpt_model_num_params(m);
    if (np == 0) return ckpt__err(CKPT_EINVAL, "optimizer: the model has no parameters");
    CKPT_TRY(check_options(impl, opt, 0));
    for (int64_t i = 0; i < np; i++) {
        ckpt_param_info info;
        CKPT_TRY(ckpt_model_param(m, i, &info));
        if (info.dtype != CKPT_F32) {
            const char *dn = ckpt_dtype_name(info.dtype);
            return ckpt__err(CKPT_EUNSUPPORTED,
                             "optimizer: parameter '%s' is %s: only F32 parameters are supported",
                             info.name, dn ? dn : "?");
        }
    }
    ckpt_optimizer *o = ckpt__calloc(1, sizeof *o);
    if (!o) return ckpt__err_nomem("optimizer");
    o->kind = kind;
    o->impl = impl;
    o->model = m;
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
        ckpt_param_info info;
        ckpt_model_param(m, i, &info);
        opt_param *p = &o->p[i];
        p->name = info.name;
        p->ndim = info.ndim;
        memcpy(p->shape, info.shape, sizeof p->shape);
        p->numel = info.numel;
        p->data = info.data;
        p->grad = info.grad;
        p->hi = p->numel;
        o->param_index[i] = i;
    }
    int rc = alloc_state(o, o->p, np, o->opts);
    if (rc < 0) {
        ckpt_optimizer_free(o);
        return rc;
    }
    *out = o;
    return CKPT_OK;
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
 * element. Scalars and empty tensors are updated by every rank in full. */
static bool splittable(const opt_param *p) { return p->ndim >= 1 && p->numel > 0; }

/* Elements per row (dimension 0) of p: the granularity of a cut. */
static int64_t row_size(const opt_param *p) { return p->numel / p->shape[0]; }

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
                uint64_t row = (uint64_t)row_size(&p[i]);
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
        memset(p[i].buf, 0, sizeof p[i].buf);
    }
    int rc = shard_layout(comm, p, o->np, &cuts);
    if (rc == 0) rc = alloc_state(o, p, o->np, o->opts);
    if (rc < 0) {
        free_params(p, o->np);
        free(cuts);
        free(lens);
        return rc;
    }
    free_params(o->p, o->np);
    free(o->rank_start);
    free(o->exchange_lens);
    o->p = p;
    o->comm = comm;
    o->rank_start = cuts;
    o->exchange_lens = lens;
    return exchange_alloc(o);
}

/* (Re)allocates the exchange buffers for the current cuts. */
static int exchange_alloc(ckpt_optimizer *o) {
    const ckpt_comm *c = o->comm;
    int64_t total = o->rank_start[c->size];
    int64_t own = o->rank_start[c->rank + 1] - o->rank_start[c->rank];
    free(o->exchange);
    free(o->send);
    o->exchange = ckpt__malloc((size_t)(total ? total : 1) * sizeof(float));
    o->send = ckpt__malloc((size_t)(own ? own : 1) * sizeof(float));
    if (!o->exchange || !o->send) return ckpt__err_nomem("optimizer exchange buffer");
    for (int r = 0; r < c->size; r++)
        o->exchange_lens[r] = (size_t)(o->rank_start[r + 1] - o->rank_start[r]) * sizeof(float);
    return CKPT_OK;
}

/* After each rank updated its share: every rank gets every share's new
 * values (one allgather of the flat range, in rank order). */
static int exchange_shares(ckpt_optimizer *o) {
    const ckpt_comm *c = o->comm;
    int64_t total = o->rank_start[c->size];
    float *ex = o->exchange;
    float *mine = o->send;
    if (!ex || !mine) return ckpt__err(CKPT_ENOMEM, "optimizer step: no exchange buffer");
    for (int64_t i = 0; i < o->np; i++) {
        const opt_param *p = &o->p[i];
        if (!p->sharded || p->hi == p->lo) continue;
        memcpy(mine, p->data + p->lo, (size_t)(p->hi - p->lo) * sizeof(float));
        mine += p->hi - p->lo;
    }
    int rc = c->allgather(c->ctx, o->send, ex, o->exchange_lens);
    if (rc < 0) return ckpt__err_prefix(rc, "optimizer step: exchanging updated parameters");
    int64_t s = 0;
    for (int64_t i = 0; i < o->np && total > 0; i++) {
        opt_param *p = &o->p[i];
        if (!p->sharded) continue;
        memcpy(p->data, ex + s, (size_t)p->numel * sizeof(float));
        s += p->numel;
    }
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
    for (int g = 0; g < ngroups; g++) CKPT_TRY(check_options(o->impl, &opts[g], g));
    int64_t *count = ckpt__calloc((size_t)ngroups + 1, sizeof *count);
    if (!count) return ckpt__err_nomem("optimizer groups");
    int64_t np = 0;
    for (int64_t i = 0; i < nm; i++) {
        if (group_of[i] == -1) continue; /* not optimized (a frozen parameter) */
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
    if (!p || !nopts || !start || !index) {
        free(p);
        free(nopts);
        free(start);
        free(index);
        free(count);
        return ckpt__err_nomem("optimizer groups");
    }
    memcpy(nopts, opts, (size_t)ngroups * sizeof *nopts);
    start[0] = 0;
    for (int g = 0; g < ngroups; g++) start[g + 1] = start[g] + count[g];
    memset(count, 0, ((size_t)ngroups + 1) * sizeof *count);
    for (int64_t i = 0; i < nm; i++) {
        if (group_of[i] == -1) continue;
        int g = group_of[i];
        int64_t k = start[g] + count[g]++;
        ckpt_param_info info;
        ckpt_model_param(o->model, i, &info);
        p[k].name = info.name;
        p[k].ndim = info.ndim;
        memcpy(p[k].shape, info.shape, sizeof p[k].shape);
        p[k].numel = info.numel;
        p[k].data = info.data;
        p[k].grad = info.grad;
        p[k].hi = p[k].numel;
        p[k].group = g;
        index[k] = k;
    }
    free(count);
    int64_t *cuts = NULL;
    int rc = o->comm ? shard_layout(o->comm, p, np, &cuts) : CKPT_OK;
    if (rc == 0) rc = alloc_state(o, p, np, nopts);
    if (rc < 0) {
        free(cuts);
        free_params(p, np);
        free(nopts);
        free(start);
        free(index);
        return rc;
    }
    free_params(o->p, o->np);
    free(o->opts);
    free(o->group_start);
    free(o->param_index);
    o->p = p;
    o->np = np;
    o->opts = nopts;
    o->ngroups = ngroups;
    o->group_start = start;
    o->param_index = index;
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

/* ---- the updates -------------------------------------------------------- */

/* torch.optim.SGD, one tensor. first: no momentum buffer yet (buf = d_p). */
UPDATE_CLONES static void sgd_update(float *restrict p, const float *restrict g,
                                     float *restrict buf, int64_t n, const ckpt_optim_options *o,
                                     bool first) {
    const float sign = o->maximize ? -1.0f : 1.0f;
    const float wd = (float)o->weight_decay;
    const float mom = (float)o->momentum;
    const float damp = (float)(1.0 - o->dampening);
    const float neg_lr = (float)-o->lr;
    const bool has_wd = o->weight_decay != 0, has_mom = o->momentum != 0;
    const bool nesterov = o->nesterov;
    for (int64_t i = 0; i < n; i++) {
        float d = sign * g[i];
        if (has_wd) d = FMADD(wd, p[i], d);
        if (has_mom) {
            float b = first ? d : FMADD(damp, d, buf[i] * mom);
            buf[i] = b;
            d = nesterov ? FMADD(mom, b, d) : b;
        }
        p[i] = FMADD(neg_lr, d, p[i]);
    }
}

typedef struct adam_consts {
    float sign, wd, decay, b1, omb1, b2, omb2, bc2_sqrt, eps, neg_step_size;
} adam_consts;

/* torch.optim.Adam / AdamW, one tensor: the portable loop. The flags are
 * constants in each instantiation below (the loop is inlined into them). */
#if defined(__GNUC__)
#define ALWAYS_INLINE __attribute__((always_inline))
#else
#define ALWAYS_INLINE
#endif

static inline ALWAYS_INLINE void adam_loop(float *restrict p, const float *restrict g,
                                           float *restrict m, float *restrict v,
                                           float *restrict vmax, int64_t n, const adam_consts *k,
                                           bool l2, bool decoupled, bool amsgrad) {
    const adam_consts c = *k;
    for (int64_t i = 0; i < n; i++) {
        float gi = c.sign * g[i];
        float pi = p[i];
        if (l2) gi = FMADD(c.wd, pi, gi);
        if (decoupled) pi = pi * c.decay;
        float mi = FMADD(c.omb1, gi, m[i] * c.b1);
        float vi = FMADD(c.omb2 * gi, gi, v[i] * c.b2);
        m[i] = mi;
        v[i] = vi;
        if (amsgrad) {
            vi = vmax[i] > vi ? vmax[i] : vi;
            vmax[i] = vi;
        }
        float denom = sqrtf(vi) / c.bc2_sqrt + c.eps;
        p[i] = pi + (c.neg_step_size * mi) / denom;
    }
}

typedef void (*adam_fn)(float *restrict p, const float *restrict g, float *restrict m,
                        float *restrict v, float *restrict vmax, int64_t n, const adam_consts *k);

#define ADAM_VARIANT(attr, name, loop, l2, decoupled, amsgrad)                                     \
    attr static void name(float *restrict p, const float *restrict g, float *restrict m,          \
                          float *restrict v, float *restrict vmax, int64_t n,                     \
                          const adam_consts *k) {                                                 \
        loop(p, g, m, v, vmax, n, k, l2, decoupled, amsgrad);                                     \
    }
ADAM_VARIANT(, adam_generic_0, adam_loop, false, false, false)
ADAM_VARIANT(, adam_generic_1, adam_loop, false, false, true)
ADAM_VARIANT(, adam_generic_2, adam_loop, true, false, false)
ADAM_VARIANT(, adam_generic_3, adam_loop, true, false, true)
ADAM_VARIANT(, adam_generic_4, adam_loop, false, true, false)
ADAM_VARIANT(, adam_generic_5, adam_loop, false, true, true)
static const adam_fn adam_generic[6] = {adam_generic_0, adam_generic_1, adam_generic_2,
                                        adam_generic_3, adam_generic_4, adam_generic_5};

#if defined(__GNUC__) && defined(__x86_64__)
#include <immintrin.h>
/* The same loop eight lanes at a time with AVX2 + FMA. Compilers will not
 * vectorize sqrtf while it may set errno, so the lanes are written out; every
 * operation is the correctly rounded IEEE one of the scalar loop, so results
 * are identical, lane or tail. */
#define AVX2 __attribute__((target("avx2,fma")))
static inline ALWAYS_INLINE AVX2 void adam_loop_avx2(float *restrict p, const float *restrict g,
                                                     float *restrict m, float *restrict v,
                                                     float *restrict vmax, int64_t n,
                                                     const adam_consts *k, bool l2,
                                                     bool decoupled, bool amsgrad) {
    const adam_consts c = *k;
    const __m256 sign = _mm256_set1_ps(c.sign), wd = _mm256_set1_ps(c.wd);
    const __m256 decay = _mm256_set1_ps(c.decay), b1 = _mm256_set1_ps(c.b1);
    const __m256 omb1 = _mm256_set1_ps(c.omb1), b2 = _mm256_set1_ps(c.b2);
    const __m256 omb2 = _mm256_set1_ps(c.omb2), bc2 = _mm256_set1_ps(c.bc2_sqrt);
    const __m256 eps = _mm256_set1_ps(c.eps), nss = _mm256_set1_ps(c.neg_step_size);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gi = _mm256_mul_ps(sign, _mm256_loadu_ps(g + i));
        __m256 pi = _mm256_loadu_ps(p + i);
        if (l2) gi = _mm256_fmadd_ps(wd, pi, gi);
        if (decoupled) pi = _mm256_mul_ps(pi, decay);
        __m256 mi = _mm256_fmadd_ps(omb1, gi, _mm256_mul_ps(_mm256_loadu_ps(m + i), b1));
        __m256 vi = _mm256_fmadd_ps(_mm256_mul_ps(omb2, gi), gi,
                                    _mm256_mul_ps(_mm256_loadu_ps(v + i), b2));
        _mm256_storeu_ps(m + i, mi);
        _mm256_storeu_ps(v + i, vi);
        if (amsgrad) {
            vi = _mm256_max_ps(_mm256_loadu_ps(vmax + i), vi); /* a > b ? a : b, as above */
            _mm256_storeu_ps(vmax + i, vi);
        }
        __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), bc2), eps);
        _mm256_storeu_ps(p + i, _mm256_add_ps(pi, _mm256_div_ps(_mm256_mul_ps(nss, mi), denom)));
    }
    adam_loop(p + i, g + i, m + i, v + i, amsgrad ? vmax + i : vmax, n - i, k, l2, decoupled,
              amsgrad);
}
ADAM_VARIANT(AVX2, adam_avx2_0, adam_loop_avx2, false, false, false)
ADAM_VARIANT(AVX2, adam_avx2_1, adam_loop_avx2, false, false, true)
ADAM_VARIANT(AVX2, adam_avx2_2, adam_loop_avx2, true, false, false)
ADAM_VARIANT(AVX2, adam_avx2_3, adam_loop_avx2, true, false, true)
ADAM_VARIANT(AVX2, adam_avx2_4, adam_loop_avx2, false, true, false)
ADAM_VARIANT(AVX2, adam_avx2_5, adam_loop_avx2, false, true, true)
static const adam_fn adam_avx2[6] = {adam_avx2_0, adam_avx2_1, adam_avx2_2,
                                     adam_avx2_3, adam_avx2_4, adam_avx2_5};

static bool force_generic;

void ckpt__optim_force_generic(bool on) { force_generic = on; }

static const adam_fn *adam_kernels(void) {
    __builtin_cpu_init();
    if (!force_generic && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return adam_avx2;
    return adam_generic;
}
#else
void ckpt__optim_force_generic(bool on) { (void)on; }

static const adam_fn *adam_kernels(void) { return adam_generic; }
#endif

static void adam_like_update(opt_param *prm, const ckpt_optim_options *o, bool decoupled) {
    /* Only this rank's elements [lo, hi); the state buffers hold just those. */
    prm->step += 1.0f;
    double step = prm->step;
    double bc1 = 1.0 - pow(o->beta1, step);
    double bc2 = 1.0 - pow(o->beta2, step);
    adam_consts c;
    c.sign = o->maximize ? -1.0f : 1.0f;
    c.wd = (float)o->weight_decay;
    c.decay = (float)(1.0 - o->lr * o->weight_decay);
    c.b1 = (float)o->beta1;
    c.omb1 = (float)(1.0 - o->beta1);
    c.b2 = (float)o->beta2;
    c.omb2 = (float)(1.0 - o->beta2);
    c.bc2_sqrt = (float)sqrt(bc2);
    c.eps = (float)o->eps;
    c.neg_step_size = (float)-(o->lr / bc1);
    bool l2 = !decoupled && o->weight_decay != 0;
    int variant = (decoupled ? 4 : l2 ? 2 : 0) + (o->amsgrad ? 1 : 0);
    if (prm->hi == prm->lo) return;
    adam_kernels()[variant](prm->data + prm->lo, prm->grad + prm->lo, prm->buf[0], prm->buf[1],
                            prm->buf[2], prm->hi - prm->lo, &c);
}

static void adam_update(opt_param *p, const ckpt_optim_options *g) {
    adam_like_update(p, g, false);
}
static void adamw_update(opt_param *p, const ckpt_optim_options *g) {
    adam_like_update(p, g, true);
}

static void sgd_param_update(opt_param *p, const ckpt_optim_options *g) {
    if (p->hi > p->lo)
        sgd_update(p->data + p->lo, p->grad + p->lo, p->buf[0], p->hi - p->lo, g, p->step == 0);
    p->step += 1.0f;
}

/* torch.optim.RMSprop (foreach=False), one tensor, with PyTorch's CPU
 * kernels' roundings: add(alpha=) and addcmul as a fused multiply-add
 * (square_avg: fma((1 - alpha) * g, g, alpha * square_avg)), addcdiv as
 * value * t1 / t2 + self, each scalar rounded to float first. */
UPDATE_CLONES static void rmsprop_loop(float *restrict p, const float *restrict g,
                                       float *restrict sq, float *restrict buf,
                                       float *restrict gavg, int64_t n,
                                       const ckpt_optim_options *o) {
    const float wd = (float)o->weight_decay, alpha = (float)o->alpha;
    const float oma = (float)(1.0 - o->alpha), eps = (float)o->eps;
    const float mom = (float)o->momentum, neg_lr = (float)-o->lr;
    const bool has_wd = o->weight_decay != 0, has_mom = o->momentum > 0;
    const bool centered = o->centered;
    for (int64_t i = 0; i < n; i++) {
        float d = g[i];
        if (has_wd) d = FMADD(wd, p[i], d);
        float s = FMADD(oma * d, d, sq[i] * alpha);
        sq[i] = s;
        float avg;
        if (centered) {
            float a = FMADD(oma, d, gavg[i] * alpha);
            gavg[i] = a;
            avg = sqrtf(FMADD(-1.0f * a, a, s));
        } else {
            avg = sqrtf(s);
        }
        avg = avg + eps;
        if (has_mom) {
            float b = buf[i] * mom + d / avg;
            buf[i] = b;
            p[i] = FMADD(neg_lr, b, p[i]);
        } else {
            p[i] = p[i] + (neg_lr * d) / avg;
        }
    }
}

static void rmsprop_update(opt_param *p, const ckpt_optim_options *g) {
    p->step += 1.0f;
    if (p->hi > p->lo)
        rmsprop_loop(p->data + p->lo, p->grad + p->lo, p->buf[0], p->buf[1], p->buf[2],
                     p->hi - p->lo, g);
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
     .update = sgd_param_update},
    {.d = {.kind = CKPT_OPTIM_ADAM,
           .name = "adam",
           .torch_name = "Adam",
           ADAM_HPARAMS,
           .defaults = adam_defaults,
           .ntorch_fields = 10,
           .torch_fields = {TF_HP("lr"), TF_BETAS, TF_HP("eps"), TF_HP("weight_decay"),
                            TF_HP("amsgrad"), TF_HP("maximize"), TF_NONE("foreach"),
                            TF_FALSE("capturable"), TF_FALSE("differentiable"), TF_FALSE("fused")}},
     .update = adam_update},
    {.d = {.kind = CKPT_OPTIM_ADAMW,
           .name = "adamw",
           .torch_name = "AdamW",
           ADAM_HPARAMS,
           .defaults = adamw_defaults,
           .ntorch_fields = 8,
           .torch_fields = {TF_HP("lr"), TF_BETAS, TF_HP("eps"), TF_HP("weight_decay"),
                            TF_HP("amsgrad"), TF_NONE("foreach"), TF_HP("maximize"),
                            TF_FALSE("capturable")}},
     .update = adamw_update},
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
     .update = rmsprop_update},
};
#undef ADAM_HPARAMS
#undef TF_BETAS
#undef TF_FALSE
#undef TF_NONE
#undef HP
#undef TF_HP

int ckpt_optimizer_step(ckpt_optimizer *o) {
    if (!o) return ckpt__err(CKPT_EINVAL, "optimizer_step: optimizer is NULL");
    /* Check first so that a missing gradient changes nothing. */
    for (int64_t i = 0; i < o->np; i++)
        if (!o->p[i].grad && o->p[i].numel > 0)
            return ckpt__err(CKPT_EINVAL,
                             "optimizer: parameter '%s' (state %lld) has no gradient buffer",
                             o->p[i].name, (long long)i);
    for (int64_t i = 0; i < o->np; i++) o->impl->update(&o->p[i], &o->opts[o->p[i].group]);
    if (o->comm && o->comm->size > 1) return exchange_shares(o);
    return CKPT_OK;
}

void ckpt_optimizer_zero_grad(ckpt_optimizer *o) {
    if (!o) return;
    for (int64_t i = 0; i < o->np; i++)
        if (o->p[i].grad) memset(o->p[i].grad, 0, (size_t)o->p[i].numel * sizeof(float));
}

/* ---- internal accessors (optim.h) -------------------------------------- */

int64_t ckpt__optimizer_num_params(const ckpt_optimizer *o) { return o ? o->np : 0; }

float *ckpt__optimizer_grad(const ckpt_optimizer *o, int64_t i, int64_t *numel) {
    if (numel) *numel = o->p[i].numel;
    return o->p[i].grad;
}

const char *ckpt__optimizer_param_name(const ckpt_optimizer *o, int64_t i) {
    return o->p[i].name;
}

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
    int64_t row = row_size(p);
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
    int code = check_options(o->impl, op, g);
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
