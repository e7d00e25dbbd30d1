/* scaler.c — dynamic loss scaling with torch.cuda.amp.GradScaler's rules: the
 * scale is a float32, unscaling multiplies by float(1/scale), a step with an
 * inf/NaN gradient is skipped and backs the scale off, growth_interval clean
 * steps in a row grow it. */
#include <math.h>
#include <stdlib.h>

#include "ckpt.h"
#include "base/error.h"
#include "train/optim.h"

enum { STAGE_READY = 0, STAGE_UNSCALED = 1, STAGE_STEPPED = 2 };

typedef struct scaler_entry {
    ckpt_optimizer *o;
    int stage;
    bool found_inf;
} scaler_entry;

struct ckpt_grad_scaler {
    float scale;
    double growth_factor;
    double backoff_factor;
    int64_t growth_interval;
    int64_t growth_tracker;
    scaler_entry *e; /* optimizers seen since the last update (PyTorch's per_optimizer_states) */
    int n, cap;
};

static int check_params(double init_scale, double growth_factor, double backoff_factor,
                        int64_t growth_interval, int code) {
    if (!(init_scale > 0) || !isfinite((float)init_scale))
        return ckpt__err(code, "grad_scaler: scale: expected a finite float32 > 0, got %g",
                         init_scale);
    if (!(growth_factor > 1) || !isfinite(growth_factor))
        return ckpt__err(code, "grad_scaler: growth_factor: expected > 1, got %g", growth_factor);
    if (!(backoff_factor > 0 && backoff_factor < 1))
        return ckpt__err(code, "grad_scaler: backoff_factor: expected in (0, 1), got %g",
                         backoff_factor);
    if (growth_interval < 1)
        return ckpt__err(code, "grad_scaler: growth_interval: expected >= 1, got %lld",
                         (long long)growth_interval);
    return CKPT_OK;
}

int ckpt_grad_scaler_new(ckpt_grad_scaler **out, double init_scale, double growth_factor,
                         double backoff_factor, int64_t growth_interval) {
    if (!out) return ckpt__err(CKPT_EINVAL, "grad_scaler_new: out is NULL");
    *out = NULL;
    CKPT_TRY(check_params(init_scale, growth_factor, backoff_factor, growth_interval,
                          CKPT_EINVAL));
    ckpt_grad_scaler *gs = ckpt__calloc(1, sizeof *gs);
    if (!gs) return ckpt__err_nomem("grad_scaler");
    gs->scale = (float)init_scale;
    gs->growth_factor = growth_factor;
    gs->backoff_factor = backoff_factor;
    gs->growth_interval = growth_interval;
    *out = gs;
    return CKPT_OK;
}

void ckpt_grad_scaler_free(ckpt_grad_scaler *gs) {
    if (!gs) return;
    free(gs->e);
    free(gs);
}

double ckpt_grad_scaler_scale(const ckpt_grad_scaler *gs) { return gs ? (double)gs->scale : 0.0; }

static int entry_of(ckpt_grad_scaler *gs, ckpt_optimizer *o, scaler_entry **out) {
    for (int i = 0; i < gs->n; i++)
        if (gs->e[i].o == o) {
            *out = &gs->e[i];
            return CKPT_OK;
        }
    if (gs->n == gs->cap) {
        int cap = gs->cap ? gs->cap * 2 : 4;
        scaler_entry *e = ckpt__realloc(gs->e, (size_t)cap * sizeof *e);
        if (!e) return ckpt__err_nomem("grad_scaler");
        gs->e = e;
        gs->cap = cap;
    }
    scaler_entry *e = &gs->e[gs->n++];
    e->o = o;
    e->stage = STAGE_READY;
    e->found_inf = false;
    *out = e;
    return CKPT_OK;
}

/* A BF16/F16 gradient (a parameter with an fp32 master), as PyTorch's
 * unscale does it: each value widened, checked, multiplied in fp32 and
 * rounded back to nearest even. */
static bool unscale_half(void *g, ckpt_dtype dt, int64_t n, float inv) {
    float f[512];
    bool found = false;
    for (int64_t a = 0; a < n; a += 512) {
        int64_t c = n - a < 512 ? n - a : 512;
        char *at = (char *)g + 2 * a;
        (void)ckpt_dtype_convert(dt, at, CKPT_F32, f, (uint64_t)c);
        for (int64_t j = 0; j < c; j++) {
            found |= !isfinite(f[j]);
            f[j] *= inv;
        }
        (void)ckpt_dtype_convert(CKPT_F32, f, dt, at, (uint64_t)c);
    }
    return found;
}

static void unscale_grads(const ckpt_grad_scaler *gs, ckpt_optimizer *o, scaler_entry *e) {
    /* PyTorch: inv_scale = scale.double().reciprocal().float() */
    const float inv = (float)(1.0 / (double)gs->scale);
    bool found = false;
    for (int64_t i = 0; i < ckpt__optimizer_num_params(o); i++) {
        int64_t n;
        ckpt_dtype dt;
        void *gv = ckpt__optimizer_grad(o, i, &n, &dt);
        if (!gv) continue;
        if (dt != CKPT_F32) {
            if (dt == CKPT_BF16 || dt == CKPT_F16) found |= unscale_half(gv, dt, n, inv);
            continue;
        }
        float *restrict g = gv;
        for (int64_t j = 0; j < n; j++) {
            found |= !isfinite(g[j]);
            g[j] *= inv;
        }
    }
    e->found_inf = found;
    e->stage = STAGE_UNSCALED;
}

int ckpt_grad_scaler_unscale(ckpt_grad_scaler *gs, ckpt_optimizer *o, bool *found_inf) {
    if (!gs || !o) return ckpt__err(CKPT_EINVAL, "grad_scaler_unscale: NULL argument");
    scaler_entry *e = NULL;
    CKPT_TRY(entry_of(gs, o, &e));
    if (e->stage == STAGE_UNSCALED)
        return ckpt__err(CKPT_EINVAL,
                         "grad_scaler: unscale already called on this optimizer since the last "
                         "update");
    if (e->stage == STAGE_STEPPED)
        return ckpt__err(CKPT_EINVAL, "grad_scaler: unscale called after step (call update first)");
    unscale_grads(gs, o, e);
    if (found_inf) *found_inf = e->found_inf;
    return CKPT_OK;
}

int ckpt_grad_scaler_step(ckpt_grad_scaler *gs, ckpt_optimizer *o, bool *stepped) {
    if (stepped) *stepped = false;
    if (!gs || !o) return ckpt__err(CKPT_EINVAL, "grad_scaler_step: NULL argument");
    scaler_entry *e = NULL;
    CKPT_TRY(entry_of(gs, o, &e));
    if (e->stage == STAGE_STEPPED)
        return ckpt__err(CKPT_EINVAL, "grad_scaler: step already called on this optimizer "
                                      "since the last update");
    if (e->stage == STAGE_READY) unscale_grads(gs, o, e);
    if (!e->found_inf) {
        CKPT_TRY(ckpt_optimizer_step(o));
        if (stepped) *stepped = true;
    }
    e->stage = STAGE_STEPPED;
    return CKPT_OK;
}

int ckpt_grad_scaler_update(ckpt_grad_scaler *gs) {
    if (!gs) return ckpt__err(CKPT_EINVAL, "grad_scaler_update: scaler is NULL");
    bool any = false, found = false;
    for (int i = 0; i < gs->n; i++) {
        if (gs->e[i].stage == STAGE_READY) continue;
        any = true;
        found |= gs->e[i].found_inf;
    }
    if (!any)
        return ckpt__err(CKPT_EINVAL,
                         "grad_scaler: update without an unscale or step since the last update");
    /* PyTorch's _amp_update_scale_: float scale times a double factor. */
    if (found) {
        gs->scale = (float)((double)gs->scale * gs->backoff_factor);
        gs->growth_tracker = 0;
    } else if (gs->growth_tracker + 1 == gs->growth_interval) {
        float grown = (float)((double)gs->scale * gs->growth_factor);
        if (isfinite(grown)) gs->scale = grown;
        gs->growth_tracker = 0;
    } else {
        gs->growth_tracker++;
    }
    gs->n = 0;
    return CKPT_OK;
}

/* ---- state dict (PyTorch's GradScaler.state_dict names) ---------------- */

static int scaler_state_dict(void *self, ckpt_writer *w) {
    const ckpt_grad_scaler *gs = self;
    CKPT_TRY(ckpt_write_f64(w, "scale", (double)gs->scale));
    CKPT_TRY(ckpt_write_f64(w, "growth_factor", gs->growth_factor));
    CKPT_TRY(ckpt_write_f64(w, "backoff_factor", gs->backoff_factor));
    CKPT_TRY(ckpt_write_i64(w, "growth_interval", gs->growth_interval));
    CKPT_TRY(ckpt_write_i64(w, "_growth_tracker", gs->growth_tracker));
    return CKPT_OK;
}

typedef struct scaler_state {
    double scale, growth_factor, backoff_factor;
    int64_t growth_interval, growth_tracker;
} scaler_state;

/* Reads and checks the whole state in r into *st; changes nothing else. */
static int scaler_read(ckpt_reader *r, scaler_state *st) {
    CKPT_TRY(ckpt_read_f64(r, "scale", &st->scale));
    CKPT_TRY(ckpt_read_f64(r, "growth_factor", &st->growth_factor));
    CKPT_TRY(ckpt_read_f64(r, "backoff_factor", &st->backoff_factor));
    CKPT_TRY(ckpt_read_i64(r, "growth_interval", &st->growth_interval));
    CKPT_TRY(ckpt_read_i64(r, "_growth_tracker", &st->growth_tracker));
    CKPT_TRY(check_params(st->scale, st->growth_factor, st->backoff_factor, st->growth_interval,
                          CKPT_ECORRUPT));
    if (st->growth_tracker < 0 || st->growth_tracker >= st->growth_interval)
        return ckpt__err(CKPT_ECORRUPT, "grad_scaler: _growth_tracker: expected 0..%lld, got %lld",
                         (long long)st->growth_interval - 1, (long long)st->growth_tracker);
    return CKPT_OK;
}

static int scaler_check_state_dict(void *self, ckpt_reader *r) {
    (void)self;
    scaler_state st;
    return scaler_read(r, &st);
}

static int scaler_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_grad_scaler *gs = self;
    scaler_state st;
    CKPT_TRY(scaler_read(r, &st));
    gs->scale = (float)st.scale;
    gs->growth_factor = st.growth_factor;
    gs->backoff_factor = st.backoff_factor;
    gs->growth_interval = st.growth_interval;
    gs->growth_tracker = st.growth_tracker;
    gs->n = 0; /* a load starts a fresh step */
    return CKPT_OK;
}

static const ckpt_stateful_ops scaler_ops = {scaler_state_dict, scaler_load_state_dict,
                                             scaler_check_state_dict};

const ckpt_stateful_ops *ckpt_grad_scaler_ops(void) { return &scaler_ops; }
