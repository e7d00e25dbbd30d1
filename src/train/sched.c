/* sched.c — learning-rate schedulers as PyTorch 1.13 computes them: step()
 * uses each scheduler's recursive get_lr() (not the closed form, which rounds
 * differently), in doubles, in the same operation order. The warmup kinds are
 * transformers' LambdaLR schedules: lr = base_lr * lambda(last_epoch). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "format/statedict.h"

typedef enum sched_kind {
    SCHED_STEP,
    SCHED_MULTISTEP,
    SCHED_EXPONENTIAL,
    SCHED_COSINE,
    SCHED_WARMUP_COSINE,
    SCHED_WARMUP_LINEAR,
    SCHED_CONSTANT
} sched_kind;

static const char *const kind_names[] = {"steplr",        "multisteplr",   "exponentiallr",
                                         "cosineannealinglr", "warmup_cosine", "warmup_linear",
                                         "constant"};

struct ckpt_scheduler {
    sched_kind kind;
    ckpt_optimizer *o;
    int ngroups;
    double *base_lrs;
    double *last_lr;
    int64_t last_epoch;
    int64_t step_count;
    int64_t step_size;
    double gamma;
    int nmilestones;
    int64_t *milestones;
    int64_t t_max;
    double eta_min;
    int64_t warmup, total;
};

/* Python's % for a positive divisor: the result has the divisor's sign. */
static int64_t py_mod(int64_t a, int64_t b) {
    int64_t r = a % b;
    return r < 0 ? r + b : r;
}

static int64_t max_i64(int64_t a, int64_t b) { return a > b ? a : b; }

static double lambda(const ckpt_scheduler *s, int64_t step) {
    int64_t w = s->warmup;
    if (step < w) return (double)step / (double)max_i64(1, w);
    switch (s->kind) {
    case SCHED_WARMUP_COSINE: {
        double progress = (double)(step - w) / (double)max_i64(1, s->total - w);
        /* transformers: cos(pi * num_cycles * 2 * progress), num_cycles 0.5 */
        double v = 0.5 * (1.0 + cos(M_PI * 0.5 * 2.0 * progress));
        return v > 0.0 ? v : 0.0;
    }
    case SCHED_WARMUP_LINEAR: {
        double v = (double)(s->total - step) / (double)max_i64(1, s->total - w);
        return v > 0.0 ? v : 0.0;
    }
    default: return 1.0;
    }
}

/* PyTorch's get_lr() after last_epoch was advanced; lr is the group's current. */
static double next_lr(const ckpt_scheduler *s, int g, double lr) {
    int64_t e = s->last_epoch;
    switch (s->kind) {
    case SCHED_STEP:
        if (e == 0 || e % s->step_size != 0) return lr;
        return lr * s->gamma;
    case SCHED_MULTISTEP: {
        int count = 0;
        for (int i = 0; i < s->nmilestones; i++) count += s->milestones[i] == e;
        if (count == 0) return lr;
        return lr * pow(s->gamma, count);
    }
    case SCHED_EXPONENTIAL:
        if (e == 0) return lr;
        return lr * s->gamma;
    case SCHED_COSINE: {
        double t = (double)s->t_max, base = s->base_lrs[g];
        if (e == 0) return lr;
        if (py_mod(e - 1 - s->t_max, 2 * s->t_max) == 0)
            return lr + (base - s->eta_min) * (1.0 - cos(M_PI / t)) / 2.0;
        return (1.0 + cos(M_PI * (double)e / t)) / (1.0 + cos(M_PI * (double)(e - 1) / t)) *
                   (lr - s->eta_min) +
               s->eta_min;
    }
    default: return s->base_lrs[g] * lambda(s, e);
    }
}

int ckpt_scheduler_step(ckpt_scheduler *s) {
    if (!s) return ckpt__err(CKPT_EINVAL, "scheduler_step: scheduler is NULL");
    if (ckpt_optimizer_num_groups(s->o) != s->ngroups)
        return ckpt__err(CKPT_EINVAL, "scheduler: the optimizer has %d groups, the scheduler %d",
                         ckpt_optimizer_num_groups(s->o), s->ngroups);
    /* A loaded state may sit at the counters' limit; stepping past it would
     * overflow. */
    if (s->last_epoch == INT64_MAX || s->step_count == INT64_MAX)
        return ckpt__err(CKPT_EINVAL, "scheduler %s: step counter is at its maximum (%lld)",
                         kind_names[s->kind], (long long)INT64_MAX);
    double stack[8];
    double *v = s->ngroups <= 8 ? stack : ckpt__malloc((size_t)s->ngroups * sizeof *v);
    if (!v) return ckpt__err_nomem("scheduler step");
    s->last_epoch++;
    int rc = CKPT_OK;
    for (int g = 0; g < s->ngroups && rc == CKPT_OK; g++) {
        v[g] = next_lr(s, g, ckpt_optimizer_get_lr(s->o, g));
        if (!(v[g] >= 0) || !isfinite(v[g]))
            rc = ckpt__err(CKPT_EINVAL, "scheduler %s: step %lld: group %d: learning rate %g",
                           kind_names[s->kind], (long long)s->last_epoch, g, v[g]);
    }
    if (rc == CKPT_OK) {
        s->step_count++;
        for (int g = 0; g < s->ngroups; g++) {
            ckpt_optimizer_set_lr(s->o, g, v[g]);
            s->last_lr[g] = v[g];
        }
    } else {
        s->last_epoch--;
    }
    if (v != stack) free(v);
    return rc;
}

void ckpt_scheduler_free(ckpt_scheduler *s) {
    if (!s) return;
    free(s->base_lrs);
    free(s->last_lr);
    free(s->milestones);
    free(s);
}

/* Common construction: base_lrs = the groups' current rates (initial_lr),
 * last_epoch -1, then one step to epoch 0 as PyTorch's constructor does. */
static int sched_new(ckpt_scheduler **out, ckpt_optimizer *o, ckpt_scheduler *s) {
    if (!o) {
        ckpt_scheduler_free(s);
        return ckpt__err(CKPT_EINVAL, "scheduler: optimizer is NULL");
    }
    s->o = o;
    s->ngroups = ckpt_optimizer_num_groups(o);
    s->base_lrs = ckpt__calloc((size_t)s->ngroups, sizeof *s->base_lrs);
    s->last_lr = ckpt__calloc((size_t)s->ngroups, sizeof *s->last_lr);
    if (!s->base_lrs || !s->last_lr) {
        ckpt_scheduler_free(s);
        return ckpt__err_nomem("scheduler");
    }
    for (int g = 0; g < s->ngroups; g++) s->base_lrs[g] = ckpt_optimizer_get_lr(o, g);
    s->last_epoch = -1;
    s->step_count = 0;
    int rc = ckpt_scheduler_step(s);
    if (rc < 0) {
        ckpt_scheduler_free(s);
        return rc;
    }
    *out = s;
    return CKPT_OK;
}

static int alloc_sched(ckpt_scheduler **out, sched_kind kind, ckpt_scheduler **s) {
    if (!out) return ckpt__err(CKPT_EINVAL, "scheduler: out is NULL");
    *out = NULL;
    *s = ckpt__calloc(1, sizeof **s);
    if (!*s) return ckpt__err_nomem("scheduler");
    (*s)->kind = kind;
    return CKPT_OK;
}

static int check_gamma(const char *what, double gamma) {
    if (!(gamma >= 0) || !isfinite(gamma))
        return ckpt__err(CKPT_EINVAL, "%s: gamma: expected a finite value >= 0, got %g", what,
                         gamma);
    return CKPT_OK;
}

int ckpt_steplr_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t step_size, double gamma) {
    if (step_size < 1)
        return ckpt__err(CKPT_EINVAL, "steplr: step_size: expected >= 1, got %lld",
                         (long long)step_size);
    CKPT_TRY(check_gamma("steplr", gamma));
    ckpt_scheduler *s;
    CKPT_TRY(alloc_sched(out, SCHED_STEP, &s));
    s->step_size = step_size;
    s->gamma = gamma;
    return sched_new(out, o, s);
}

int ckpt_multisteplr_new(ckpt_scheduler **out, ckpt_optimizer *o, int nmilestones,
                         const int64_t *milestones, double gamma) {
    if (nmilestones < 0 || (nmilestones > 0 && !milestones))
        return ckpt__err(CKPT_EINVAL, "multisteplr: bad milestones (%d)", nmilestones);
    for (int i = 0; i < nmilestones; i++)
        if (milestones[i] < 0)
            return ckpt__err(CKPT_EINVAL, "multisteplr: milestones[%d]: expected >= 0, got %lld",
                             i, (long long)milestones[i]);
    CKPT_TRY(check_gamma("multisteplr", gamma));
    ckpt_scheduler *s;
    CKPT_TRY(alloc_sched(out, SCHED_MULTISTEP, &s));
    s->gamma = gamma;
    s->nmilestones = nmilestones;
    s->milestones = ckpt__malloc((size_t)(nmilestones ? nmilestones : 1) * sizeof(int64_t));
    if (!s->milestones) {
        ckpt_scheduler_free(s);
        return ckpt__err_nomem("scheduler milestones");
    }
    if (nmilestones) memcpy(s->milestones, milestones, (size_t)nmilestones * sizeof(int64_t));
    return sched_new(out, o, s);
}

int ckpt_exponentiallr_new(ckpt_scheduler **out, ckpt_optimizer *o, double gamma) {
    CKPT_TRY(check_gamma("exponentiallr", gamma));
    ckpt_scheduler *s;
    CKPT_TRY(alloc_sched(out, SCHED_EXPONENTIAL, &s));
    s->gamma = gamma;
    return sched_new(out, o, s);
}

int ckpt_cosinelr_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t t_max, double eta_min) {
    if (t_max < 1)
        return ckpt__err(CKPT_EINVAL, "cosinelr: T_max: expected >= 1, got %lld",
                         (long long)t_max);
    if (!(eta_min >= 0) || !isfinite(eta_min))
        return ckpt__err(CKPT_EINVAL, "cosinelr: eta_min: expected a finite value >= 0, got %g",
                         eta_min);
    ckpt_scheduler *s;
    CKPT_TRY(alloc_sched(out, SCHED_COSINE, &s));
    s->t_max = t_max;
    s->eta_min = eta_min;
    return sched_new(out, o, s);
}

static int warmup_new(ckpt_scheduler **out, sched_kind kind, ckpt_optimizer *o, int64_t warmup,
                      int64_t total) {
    const char *what = kind_names[kind];
    if (warmup < 0)
        return ckpt__err(CKPT_EINVAL, "%s: warmup: expected >= 0, got %lld", what,
                         (long long)warmup);
    if (kind != SCHED_CONSTANT && total < warmup)
        return ckpt__err(CKPT_EINVAL, "%s: total: expected >= warmup (%lld), got %lld", what,
                         (long long)warmup, (long long)total);
    ckpt_scheduler *s;
    CKPT_TRY(alloc_sched(out, kind, &s));
    s->warmup = warmup;
    s->total = total;
    return sched_new(out, o, s);
}

int ckpt_warmup_cosine_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t warmup,
                           int64_t total) {
    return warmup_new(out, SCHED_WARMUP_COSINE, o, warmup, total);
}

int ckpt_warmup_linear_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t warmup,
                           int64_t total) {
    return warmup_new(out, SCHED_WARMUP_LINEAR, o, warmup, total);
}

int ckpt_constant_new(ckpt_scheduler **out, ckpt_optimizer *o, int64_t warmup) {
    return warmup_new(out, SCHED_CONSTANT, o, warmup, 0);
}

double ckpt_scheduler_last_lr(const ckpt_scheduler *s, int group) {
    if (!s || group < 0 || group >= s->ngroups) return NAN;
    return s->last_lr[group];
}

/* ---- state dict --------------------------------------------------------- */

static int sched_state_dict(void *self, ckpt_writer *w) {
    const ckpt_scheduler *s = self;
    char k[64];
    CKPT_TRY(ckpt_write_str(w, "kind", kind_names[s->kind]));
    CKPT_TRY(ckpt_write_i64(w, "last_epoch", s->last_epoch));
    CKPT_TRY(ckpt_write_i64(w, "_step_count", s->step_count));
    for (int g = 0; g < s->ngroups; g++) {
        snprintf(k, sizeof k, "base_lrs.%d", g);
        CKPT_TRY(ckpt_write_f64(w, k, s->base_lrs[g]));
        snprintf(k, sizeof k, "_last_lr.%d", g);
        CKPT_TRY(ckpt_write_f64(w, k, s->last_lr[g]));
    }
    switch (s->kind) {
    case SCHED_STEP:
        CKPT_TRY(ckpt_write_i64(w, "step_size", s->step_size));
        CKPT_TRY(ckpt_write_f64(w, "gamma", s->gamma));
        break;
    case SCHED_MULTISTEP: {
        int64_t n = s->nmilestones;
        CKPT_TRY(ckpt_write_tensor(w, "milestones", CKPT_I64, 1, &n, s->milestones));
        CKPT_TRY(ckpt_write_f64(w, "gamma", s->gamma));
        break;
    }
    case SCHED_EXPONENTIAL: CKPT_TRY(ckpt_write_f64(w, "gamma", s->gamma)); break;
    case SCHED_COSINE:
        CKPT_TRY(ckpt_write_i64(w, "T_max", s->t_max));
        CKPT_TRY(ckpt_write_f64(w, "eta_min", s->eta_min));
        break;
    case SCHED_WARMUP_COSINE:
    case SCHED_WARMUP_LINEAR:
        CKPT_TRY(ckpt_write_i64(w, "warmup", s->warmup));
        CKPT_TRY(ckpt_write_i64(w, "total", s->total));
        break;
    case SCHED_CONSTANT: CKPT_TRY(ckpt_write_i64(w, "warmup", s->warmup)); break;
    }
    return CKPT_OK;
}

/* What a load restores: the position. The schedule's parameters (step_size,
 * gamma, milestones, T_max, eta_min, warmup, total) are the constructor's;
 * the file's copies are for reference and never read (see ckpt.h). */
typedef struct sched_vals {
    int64_t last_epoch, step_count;
} sched_vals;

/* Reads base_lrs.<g> and _last_lr.<g>; checks the base rate. */
static int read_group_lrs(ckpt_reader *r, int g, double *base, double *last) {
    char k[64];
    snprintf(k, sizeof k, "base_lrs.%d", g);
    CKPT_TRY(ckpt_read_f64(r, k, base));
    snprintf(k, sizeof k, "_last_lr.%d", g);
    CKPT_TRY(ckpt_read_f64(r, k, last));
    if (!(*base >= 0) || !isfinite(*base))
        return ckpt__err(CKPT_ECORRUPT, "scheduler: base_lrs.%d: expected >= 0, got %g", g, *base);
    return CKPT_OK;
}

/* The check: reads and validates every entry a load takes (the kind, the
 * counters, every group's rates, no extra group), changing nothing and
 * allocating nothing. The counters go to *v. */
static int sched_check(const ckpt_scheduler *s, ckpt_reader *r, sched_vals *v) {
    char kind[32], k[64];
    int rc = ckpt_read_str(r, "kind", kind, sizeof kind);
    if (rc == CKPT_EINVAL || (rc == CKPT_OK && strcmp(kind, kind_names[s->kind]) != 0))
        return ckpt__err(CKPT_EMISMATCH,
                         "scheduler: the state dict is for %s, this scheduler is %s",
                         rc == CKPT_OK ? kind : "another kind", kind_names[s->kind]);
    if (rc < 0) return rc;
    CKPT_TRY(ckpt_read_i64(r, "last_epoch", &v->last_epoch));
    CKPT_TRY(ckpt_read_i64(r, "_step_count", &v->step_count));
    for (int g = 0; g < s->ngroups; g++) {
        double base, last;
        CKPT_TRY(read_group_lrs(r, g, &base, &last));
    }
    /* A probe: absence is the expected answer, so it leaves no message. */
    snprintf(k, sizeof k, "base_lrs.%d", s->ngroups);
    if (ckpt__reader_has(r, k, NULL))
        return ckpt__err(CKPT_EMISMATCH, "scheduler: the state dict has more than %d groups",
                         s->ngroups);
    if (v->last_epoch < 0)
        return ckpt__err(CKPT_ECORRUPT, "scheduler: last_epoch: expected >= 0, got %lld",
                         (long long)v->last_epoch);
    return CKPT_OK;
}

static int sched_check_state_dict(void *self, ckpt_reader *r) {
    sched_vals v;
    return sched_check(self, r, &v);
}

static int sched_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_scheduler *s = self;
    sched_vals v;
    /* Validate everything before changing anything. */
    CKPT_TRY(sched_check(s, r, &v));
    /* Commit: the same reads, every one checked above. */
    for (int g = 0; g < s->ngroups; g++) {
        double base, last;
        CKPT_TRY(read_group_lrs(r, g, &base, &last));
        s->base_lrs[g] = base;
        s->last_lr[g] = last;
    }
    s->last_epoch = v.last_epoch;
    s->step_count = v.step_count;
    return CKPT_OK;
}

static const ckpt_stateful_ops sched_ops = {sched_state_dict, sched_load_state_dict,
                                            sched_check_state_dict};

const ckpt_stateful_ops *ckpt_scheduler_ops(void) { return &sched_ops; }
