/* optim_kernels.c — the optimizer kinds' step kernels, as PyTorch 1.13's
 * single-tensor (foreach=False) implementations compute them: fp32 tensors,
 * Python-float (double) scalars rounded to float where PyTorch's kernels
 * round them, in PyTorch's order of operations, so trajectories agree with
 * PyTorch's bit for bit. Each kind's descriptor (optim.c) names its update. */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>

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

void ckpt__optim_adam_update(opt_param *p, const ckpt_optim_options *g) {
    adam_like_update(p, g, false);
}
void ckpt__optim_adamw_update(opt_param *p, const ckpt_optim_options *g) {
    adam_like_update(p, g, true);
}

void ckpt__optim_sgd_update(opt_param *p, const ckpt_optim_options *g) {
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

void ckpt__optim_rmsprop_update(opt_param *p, const ckpt_optim_options *g) {
    p->step += 1.0f;
    if (p->hi > p->lo)
        rmsprop_loop(p->data + p->lo, p->grad + p->lo, p->buf[0], p->buf[1], p->buf[2],
                     p->hi - p->lo, g);
}
