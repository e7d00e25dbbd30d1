/* optim_kernels.c — the optimizer kinds' step kernels, as PyTorch 1.13's
 * single-tensor (foreach=False) implementations compute them: fp32 tensors,
 * Python-float (double) scalars rounded to float where PyTorch's kernels
 * round them, in PyTorch's order of operations, so trajectories agree with
 * PyTorch's bit for bit. Each kind's descriptor (optim.c) names its update. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "ckpt.h"
#include "train/optim_int.h"

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

static void adam_like_update(opt_view *v, const ckpt_optim_options *o, bool decoupled) {
    v->step += 1.0f;
    double step = v->step;
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
    if (v->n == 0) return;
    adam_kernels()[variant](v->data, v->grad, v->buf[0], v->buf[1], v->buf[2], v->n, &c);
}

void ckpt__optim_adam_update(opt_view *v, const ckpt_optim_options *g) {
    adam_like_update(v, g, false);
}
void ckpt__optim_adamw_update(opt_view *v, const ckpt_optim_options *g) {
    adam_like_update(v, g, true);
}

void ckpt__optim_sgd_update(opt_view *v, const ckpt_optim_options *g) {
    if (v->n > 0) sgd_update(v->data, v->grad, v->buf[0], v->n, g, v->step == 0);
    v->step += 1.0f;
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

void ckpt__optim_rmsprop_update(opt_view *v, const ckpt_optim_options *g) {
    v->step += 1.0f;
    if (v->n > 0) rmsprop_loop(v->data, v->grad, v->buf[0], v->buf[1], v->buf[2], v->n, g);
}

/* ---- a parameter's update, with or without a master ----------------------- */

/* Elements converted at a time: a gradient's and a master's rounding fit
 * the stack and the first-level cache. */
#define MASTER_CHUNK 1024

/* n 16-bit values of dt at q: where they differ from the rounding of the
 * fp32 master m, m takes their value (exactly: BF16/F16 widen to F32). */
static void take_up(float *m, const unsigned char *q, ckpt_dtype dt, int64_t n) {
    uint16_t r[MASTER_CHUNK];
    float f[MASTER_CHUNK];
    for (int64_t a = 0; a < n; a += MASTER_CHUNK) {
        int64_t c = n - a < MASTER_CHUNK ? n - a : MASTER_CHUNK;
        (void)ckpt_dtype_convert(CKPT_F32, m + a, dt, r, (uint64_t)c);
        if (memcmp(r, q + 2 * a, (size_t)c * 2) == 0) continue;
        (void)ckpt_dtype_convert(dt, q + 2 * a, CKPT_F32, f, (uint64_t)c);
        for (int64_t i = 0; i < c; i++)
            if (memcmp(&r[i], q + 2 * (a + i), 2) != 0) m[a + i] = f[i];
    }
}

void ckpt__optim_master_take_up(opt_param *p) {
    if (!p->needs_master || !p->master || p->hi == p->lo) return;
    take_up(p->master, (const unsigned char *)p->data + 2 * p->lo, p->dtype, p->hi - p->lo);
}

void ckpt__optim_update_param(const kind_impl *k, opt_param *p, const ckpt_optim_options *g) {
    int64_t n = p->hi - p->lo;
    opt_view v;
    memset(&v, 0, sizeof v);
    v.step = p->step;
    if (!p->needs_master || n == 0) {
        v.data = n ? (float *)p->data + p->lo : NULL;
        v.grad = n ? (const float *)p->grad + p->lo : NULL;
        for (int b = 0; b < CKPT_OPTIM_MAX_BUFFERS; b++) v.buf[b] = p->buf[b];
        v.n = n;
        k->update(&v, g);
        p->step = v.step;
        return;
    }
    /* The fp32 update of the master, a chunk at a time, each from the same
     * step count: the gradient widened exactly, the parameter written back
     * rounded to nearest, ties to even. */
    float gf[MASTER_CHUNK];
    unsigned char *param = (unsigned char *)p->data + 2 * p->lo;
    const unsigned char *grad = (const unsigned char *)p->grad + 2 * p->lo;
    float after = p->step;
    for (int64_t a = 0; a < n; a += MASTER_CHUNK) {
        int64_t c = n - a < MASTER_CHUNK ? n - a : MASTER_CHUNK;
        take_up(p->master + a, param + 2 * a, p->dtype, c);
        (void)ckpt_dtype_convert(p->dtype, grad + 2 * a, CKPT_F32, gf, (uint64_t)c);
        v.data = p->master + a;
        v.grad = gf;
        for (int b = 0; b < CKPT_OPTIM_MAX_BUFFERS; b++)
            v.buf[b] = p->buf[b] ? p->buf[b] + a : NULL;
        v.n = c;
        v.step = p->step;
        k->update(&v, g);
        after = v.step;
        (void)ckpt_dtype_convert(CKPT_F32, p->master + a, p->dtype, param + 2 * a, (uint64_t)c);
    }
    p->step = after;
}
