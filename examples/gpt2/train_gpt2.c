/* train_gpt2.c — a GPT-2 trainer in llm.c's shape, made resumable with ckpt.
 *
 * What a C trainer written without ckpt in mind looks like: all parameters
 * in one block (bf16), their gradients in another (fp32), its own AdamW
 * with fp32 master weights and moment buffers laid out like the parameter
 * block, the token embedding reused as the output layer (tied weights), a
 * loader that walks token shards and keeps its position, and its own random
 * generator (xorshift64*), which the loader draws from. The data set is a
 * small synthetic language generated deterministically at start-up (two
 * training shards and a validation shard of tokens from a fixed Markov
 * chain), so the run needs no download.
 *
 * The lines that make it resumable lie between the markers "// ckpt begin"
 * and "// ckpt end" (39 non-blank lines; tests/integration/
 * test_gpt2_example.sh counts them and requires fewer than 40):
 * the parameters registered over the block, the output layer tied to the
 * embedding, an external AdamW whose moments and masters are the trainer's
 * own blocks, the loader's position and generator as a named object, one
 * load, the step count, an asynchronous save every few steps.
 * Kill it at any moment, run it again: it resumes from the newest
 * checkpoint and ends bit for bit where an uninterrupted run ends.
 *
 *   example_gpt2 PROJECT_DIR [--steps N] [--save-every K] [--layers L]
 *                [--heads H] [--channels C] [--seq T] [--batch B]
 *                [--vocab V] [--eval-out FILE] [--quiet]
 *
 * --eval-out writes the validation batch (its B x (T + 1) tokens) and the
 * loss of the final parameters on it, for tests/python/test_gpt2_example.py,
 * which computes the same loss in PyTorch from `ckpt export --bin`'s files
 * (make demo runs it on the resumed run's export: scripts/demo-gpt2).
 */
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// ckpt begin
#include "ckpt.h"
// ckpt end

/* ---- configuration and parameters ---------------------------------------- */

typedef struct Config {
    int vocab, seq, layers, heads, channels;
} Config;

enum { NPARAM = 16 };
/* llm.c's parameter tensors, each layer's stacked along a first dimension. */
static const char *const PARAM_NAMES[NPARAM] = {
    "wte",  "wpe",  "ln1w", "ln1b", "qkvw",    "qkvb",    "attprojw", "attprojb",
    "ln2w", "ln2b", "fcw",  "fcb",  "fcprojw", "fcprojb", "lnfw",     "lnfb"};

typedef struct Shape {
    int ndim;
    int64_t dim[3];
} Shape;

static void param_shapes(const Config *c, Shape *s) {
    int64_t V = c->vocab, T = c->seq, L = c->layers, C = c->channels;
    const Shape t[NPARAM] = {
        {2, {V, C}},        {2, {T, C}},     {2, {L, C}},        {2, {L, C}},
        {3, {L, 3 * C, C}}, {2, {L, 3 * C}}, {3, {L, C, C}},     {2, {L, C}},
        {2, {L, C}},        {2, {L, C}},     {3, {L, 4 * C, C}}, {2, {L, 4 * C}},
        {3, {L, C, 4 * C}}, {2, {L, C}},     {1, {C}},           {1, {C}}};
    memcpy(s, t, sizeof t);
}

/* Pointers into one block, in PARAM_NAMES order. */
typedef struct Params {
    float *p[NPARAM];
} Params;

/* ---- bf16 ------------------------------------------------------------------ */

static float bf16_to_float(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static uint16_t bf16_round(float f) { /* to nearest, ties to even */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

/* ---- the random generator (xorshift64*) --------------------------------- */

typedef struct Rng {
    uint64_t state;
} Rng;

static uint32_t rng_u32(Rng *r) {
    r->state ^= r->state >> 12;
    r->state ^= r->state << 25;
    r->state ^= r->state >> 27;
    return (uint32_t)((r->state * 0x2545F4914F6CDD1Dull) >> 32);
}

static float rng_f32(Rng *r) { return (float)(rng_u32(r) >> 8) / 16777216.0f; }

static float rng_normal(Rng *r) {
    float u1 = rng_f32(r), u2 = rng_f32(r);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.2831853f * u2);
}

/* ---- the data: token shards and their loader ------------------------------ */

enum { NSHARDS = 2, SHARD_TOKENS = 16384, VAL_TOKENS = 4096 };

/* A small language: each token is followed by one of three successors
 * (chosen by a fixed table), with probabilities 0.6, 0.3 and 0.1. */
static void make_tokens(uint16_t *out, size_t n, int vocab, uint64_t seed) {
    Rng table = {0x9E3779B97F4A7C15ull}, r = {seed};
    uint16_t *succ = malloc(sizeof *succ * (size_t)vocab * 3);
    for (int i = 0; i < vocab * 3; i++) succ[i] = (uint16_t)(rng_u32(&table) % (uint32_t)vocab);
    uint16_t t = 0;
    for (size_t i = 0; i < n; i++) {
        out[i] = t;
        float u = rng_f32(&r);
        t = succ[t * 3 + (u < 0.6f ? 0 : u < 0.9f ? 1 : 2)];
    }
    free(succ);
}

/* Walks the training shards B x T tokens at a time; each batch starts a
 * random jitter (drawn from the loader's own generator) past the position. */
typedef struct Loader {
    const uint16_t *shards[NSHARDS];
    int B, T;
    uint64_t shard, pos; /* the position: which shard, which token */
    Rng rng;
} Loader;

static void loader_next(Loader *l, int *inputs, int *targets) {
    size_t span = (size_t)l->B * (size_t)l->T;
    if (l->pos + span + (size_t)l->T + 1 > SHARD_TOKENS) {
        l->shard = (l->shard + 1) % NSHARDS;
        l->pos = 0;
    }
    size_t at = (size_t)l->pos + rng_u32(&l->rng) % (uint32_t)l->T;
    const uint16_t *tok = l->shards[l->shard % NSHARDS] + at;
    for (size_t i = 0; i < span; i++) {
        inputs[i] = tok[i];
        targets[i] = tok[i + 1];
    }
    l->pos += span;
}

/* ---- the layers, forward and backward --------------------------------------- */

static void encoder_forward(float *out, const int *tok, const float *wte, const float *wpe, int B,
                            int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            float *o = out + ((size_t)b * T + t) * C;
            const float *e = wte + (size_t)tok[b * T + t] * C, *p = wpe + (size_t)t * C;
            for (int c = 0; c < C; c++) o[c] = e[c] + p[c];
        }
}

static void encoder_backward(float *dwte, float *dwpe, const float *dout, const int *tok, int B,
                             int T, int C) {
    for (int b = 0; b < B; b++)
        for (int t = 0; t < T; t++) {
            const float *d = dout + ((size_t)b * T + t) * C;
            float *e = dwte + (size_t)tok[b * T + t] * C, *p = dwpe + (size_t)t * C;
            for (int c = 0; c < C; c++) {
                e[c] += d[c];
                p[c] += d[c];
            }
        }
}

static void layernorm_forward(float *out, float *mean, float *rstd, const float *in, const float *w,
                              const float *bias, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *x = in + (size_t)n * C;
        float m = 0, v = 0;
        for (int c = 0; c < C; c++) m += x[c];
        m /= (float)C;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= (float)C;
        float s = 1.0f / sqrtf(v + 1e-5f);
        for (int c = 0; c < C; c++) out[(size_t)n * C + c] = (x[c] - m) * s * w[c] + bias[c];
        mean[n] = m;
        rstd[n] = s;
    }
}

static void layernorm_backward(float *din, float *dw, float *dbias, const float *dout,
                               const float *in, const float *w, const float *mean,
                               const float *rstd, int N, int C) {
    for (int n = 0; n < N; n++) {
        const float *d = dout + (size_t)n * C, *x = in + (size_t)n * C;
        float *dx = din + (size_t)n * C;
        float dn_mean = 0, dn_dot = 0; /* means of dnorm and dnorm * norm */
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - mean[n]) * rstd[n], dnorm = w[c] * d[c];
            dn_mean += dnorm;
            dn_dot += dnorm * norm;
        }
        dn_mean /= (float)C;
        dn_dot /= (float)C;
        for (int c = 0; c < C; c++) {
            float norm = (x[c] - mean[n]) * rstd[n], dnorm = w[c] * d[c];
            dbias[c] += d[c];
            dw[c] += norm * d[c];
            dx[c] += (dnorm - dn_mean - norm * dn_dot) * rstd[n];
        }
    }
}

/* out[n][o] = bias[o] + in[n] . W[o] (W: OC rows of C, as nn.Linear). */
static void matmul_forward(float *out, const float *in, const float *W, const float *bias, int N,
                           int C, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            const float *x = in + (size_t)n * C, *wr = W + (size_t)o * C;
            float s = bias ? bias[o] : 0.0f;
            for (int c = 0; c < C; c++) s += x[c] * wr[c];
            out[(size_t)n * OC + o] = s;
        }
}

static void matmul_backward(float *din, float *dW, float *dbias, const float *dout, const float *in,
                            const float *W, int N, int C, int OC) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < OC; o++) {
            float d = dout[(size_t)n * OC + o];
            const float *wr = W + (size_t)o * C, *x = in + (size_t)n * C;
            float *dx = din + (size_t)n * C, *dwr = dW + (size_t)o * C;
            for (int c = 0; c < C; c++) {
                dx[c] += d * wr[c];
                dwr[c] += d * x[c];
            }
            if (dbias) dbias[o] += d;
        }
}

/* Causal self-attention over qkv [B, T, 3C] (q, k, v of NH heads of C / NH). */
static void attention_forward(float *out, float *att, const float *qkv, int B, int T, int C,
                              int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                float *a = att + (((size_t)b * NH + h) * T + t) * T, mx = -INFINITY;
                for (int u = 0; u <= t; u++) {
                    const float *k = qkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    float s = 0;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    a[u] = s * scale;
                    if (a[u] > mx) mx = a[u];
                }
                float sum = 0;
                for (int u = 0; u <= t; u++) sum += a[u] = expf(a[u] - mx);
                for (int u = 0; u < T; u++) a[u] = u <= t ? a[u] / sum : 0.0f;
                float *o = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0;
                for (int u = 0; u <= t; u++) {
                    const float *v = qkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) o[i] += a[u] * v[i];
                }
            }
}

static void attention_backward(float *dqkv, float *datt, const float *dout, const float *qkv,
                               const float *att, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < NH; h++)
            for (int t = 0; t < T; t++) {
                const float *a = att + (((size_t)b * NH + h) * T + t) * T;
                float *da = datt + (((size_t)b * NH + h) * T + t) * T;
                const float *d = dout + ((size_t)b * T + t) * C + h * hs;
                for (int u = 0; u <= t; u++) { /* through out = att . v */
                    const float *v = qkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * hs;
                    float *dv = dqkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * hs;
                    float s = 0;
                    for (int i = 0; i < hs; i++) {
                        s += v[i] * d[i];
                        dv[i] += a[u] * d[i];
                    }
                    da[u] = s;
                }
                float dot = 0; /* through the softmax */
                for (int u = 0; u <= t; u++) dot += a[u] * da[u];
                const float *q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                float *dq = dqkv + ((size_t)b * T + t) * 3 * C + h * hs;
                for (int u = 0; u <= t; u++) {
                    float dpre = a[u] * (da[u] - dot) * scale;
                    const float *k = qkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    float *dk = dqkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    for (int i = 0; i < hs; i++) {
                        dq[i] += dpre * k[i];
                        dk[i] += dpre * q[i];
                    }
                }
            }
}

#define GELU_K 0.7978845608f /* sqrt(2 / pi) */

static void gelu_forward(float *out, const float *in, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float x = in[i];
        out[i] = 0.5f * x * (1.0f + tanhf(GELU_K * (x + 0.044715f * x * x * x)));
    }
}

static void gelu_backward(float *din, const float *in, const float *dout, size_t n) {
    for (size_t i = 0; i < n; i++) {
        float x = in[i], u = GELU_K * (x + 0.044715f * x * x * x), th = tanhf(u);
        float du = GELU_K * (1.0f + 3.0f * 0.044715f * x * x);
        din[i] += dout[i] * (0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du);
    }
}

/* ---- the model ------------------------------------------------------------- */

typedef struct Acts { /* what the forward pass keeps for the backward one */
    float *encoded, *ln1, *ln1_mean, *ln1_rstd, *qkv, *atty, *att, *attproj, *res2, *ln2, *ln2_mean,
        *ln2_rstd, *fch, *fch_gelu, *fcproj, *res3, *lnf, *lnf_mean, *lnf_rstd, *logits, *probs;
} Acts;

typedef struct GPT2 {
    Config cfg;
    Shape shapes[NPARAM];
    size_t sizes[NPARAM], nparams;
    uint16_t *params_bf16;     /* the parameters (one block) */
    float *params_f32;         /* their values widened, for the forward and backward passes */
    float *grads;              /* their gradients (one block) */
    float *m, *v, *master;     /* AdamW's moments and fp32 master weights, laid out as params */
    Params w, g;               /* into params_f32 and grads */
    uint16_t *bf16_at[NPARAM]; /* into params_bf16 */
    int B, T;
    Acts a, d; /* activations and their gradients */
    float *act_block, *dact_block;
    size_t nacts;
    int *inputs, *targets;
    float loss;
} GPT2;

static size_t acts_carve(Acts *a, float *block, const Config *c, int B, int T) {
    size_t N = (size_t)B * T, C = (size_t)c->channels, L = (size_t)c->layers, NH = (size_t)c->heads;
    size_t sizes[] = {N * C,
                      L * N * C,
                      L * N,
                      L * N,
                      L * N * 3 * C,
                      L * N * C,
                      L * B * NH * T * T,
                      L * N * C,
                      L * N * C,
                      L * N * C,
                      L * N,
                      L * N,
                      L * N * 4 * C,
                      L * N * 4 * C,
                      L * N * C,
                      L * N * C,
                      N * C,
                      N,
                      N,
                      N * c->vocab,
                      N * c->vocab};
    float **p[] = {
        &a->encoded, &a->ln1,  &a->ln1_mean, &a->ln1_rstd, &a->qkv,      &a->atty,   &a->att,
        &a->attproj, &a->res2, &a->ln2,      &a->ln2_mean, &a->ln2_rstd, &a->fch,    &a->fch_gelu,
        &a->fcproj,  &a->res3, &a->lnf,      &a->lnf_mean, &a->lnf_rstd, &a->logits, &a->probs};
    size_t off = 0;
    for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
        if (block) *p[i] = block + off;
        off += sizes[i];
    }
    return off;
}

static void gpt2_build(GPT2 *m, const Config *c, int B, int T) {
    Rng init = {0x2545F4914F6CDD1Dull};
    memset(m, 0, sizeof *m);
    m->cfg = *c;
    m->B = B;
    m->T = T;
    param_shapes(c, m->shapes);
    for (int i = 0; i < NPARAM; i++) {
        m->sizes[i] = 1;
        for (int d = 0; d < m->shapes[i].ndim; d++) m->sizes[i] *= (size_t)m->shapes[i].dim[d];
        m->nparams += m->sizes[i];
    }
    size_t n = m->nparams;
    m->params_bf16 = malloc(n * 2);
    m->params_f32 = malloc(n * 4);
    m->grads = calloc(n, 4);
    m->m = calloc(n, 4);
    m->v = calloc(n, 4);
    m->master = malloc(n * 4);
    for (size_t i = 0, off = 0; i < NPARAM; off += m->sizes[i++]) {
        m->bf16_at[i] = m->params_bf16 + off;
        m->w.p[i] = m->params_f32 + off;
        m->g.p[i] = m->grads + off;
    }
    /* GPT-2's initialisation: N(0, 0.02), the residual projections scaled
     * down by sqrt(2 L); layer norms 1 and 0; biases 0 */
    for (int i = 0; i < NPARAM; i++) {
        bool ln_w = i == 2 || i == 8 || i == 14, bias = m->shapes[i].ndim < 3 && i > 1;
        float std = (i == 6 || i == 12) ? 0.02f / sqrtf(2.0f * (float)c->layers) : 0.02f;
        for (size_t k = 0; k < m->sizes[i]; k++)
            m->w.p[i][k] = ln_w ? 1.0f : bias ? 0.0f : std * rng_normal(&init);
    }
    for (size_t k = 0; k < n; k++) {
        m->params_bf16[k] = bf16_round(m->params_f32[k]);
        m->master[k] = bf16_to_float(m->params_bf16[k]);
    }
    m->nacts = acts_carve(&m->a, NULL, c, B, T);
    m->act_block = malloc(m->nacts * 4);
    m->dact_block = malloc(m->nacts * 4);
    acts_carve(&m->a, m->act_block, c, B, T);
    acts_carve(&m->d, m->dact_block, c, B, T);
    m->inputs = malloc(sizeof(int) * (size_t)B * T);
    m->targets = malloc(sizeof(int) * (size_t)B * T);
}

static void gpt2_free(GPT2 *m) {
    free(m->params_bf16);
    free(m->params_f32);
    free(m->grads);
    free(m->m);
    free(m->v);
    free(m->master);
    free(m->act_block);
    free(m->dact_block);
    free(m->inputs);
    free(m->targets);
}

/* The mean cross-entropy of the next token over the batch in m->inputs /
 * m->targets, keeping what the backward pass needs. */
static float gpt2_forward(GPT2 *m) {
    const Config *c = &m->cfg;
    int B = m->B, T = m->T, C = c->channels, L = c->layers, NH = c->heads, V = c->vocab;
    size_t N = (size_t)B * T;
    for (size_t k = 0; k < m->nparams; k++) m->params_f32[k] = bf16_to_float(m->params_bf16[k]);
    float *const *w = m->w.p;
    Acts *a = &m->a;
    encoder_forward(a->encoded, m->inputs, w[0], w[1], B, T, C);
    const float *res = a->encoded;
    for (int l = 0; l < L; l++) {
        size_t NC = N * C;
        float *ln1 = a->ln1 + l * NC, *qkv = a->qkv + l * 3 * NC, *atty = a->atty + l * NC;
        float *att = a->att + (size_t)l * B * NH * T * T, *attproj = a->attproj + l * NC;
        float *res2 = a->res2 + l * NC, *ln2 = a->ln2 + l * NC, *fch = a->fch + l * 4 * NC;
        float *fch_gelu = a->fch_gelu + l * 4 * NC, *fcproj = a->fcproj + l * NC;
        float *res3 = a->res3 + l * NC;
        layernorm_forward(ln1, a->ln1_mean + l * N, a->ln1_rstd + l * N, res, w[2] + l * C,
                          w[3] + l * C, (int)N, C);
        matmul_forward(qkv, ln1, w[4] + (size_t)l * 3 * C * C, w[5] + l * 3 * C, (int)N, C, 3 * C);
        attention_forward(atty, att, qkv, B, T, C, NH);
        matmul_forward(attproj, atty, w[6] + (size_t)l * C * C, w[7] + l * C, (int)N, C, C);
        for (size_t i = 0; i < NC; i++) res2[i] = res[i] + attproj[i];
        layernorm_forward(ln2, a->ln2_mean + l * N, a->ln2_rstd + l * N, res2, w[8] + l * C,
                          w[9] + l * C, (int)N, C);
        matmul_forward(fch, ln2, w[10] + (size_t)l * 4 * C * C, w[11] + l * 4 * C, (int)N, C,
                       4 * C);
        gelu_forward(fch_gelu, fch, 4 * NC);
        matmul_forward(fcproj, fch_gelu, w[12] + (size_t)l * 4 * C * C, w[13] + l * C, (int)N,
                       4 * C, C);
        for (size_t i = 0; i < NC; i++) res3[i] = res2[i] + fcproj[i];
        res = res3;
    }
    layernorm_forward(a->lnf, a->lnf_mean, a->lnf_rstd, res, w[14], w[15], (int)N, C);
    matmul_forward(a->logits, a->lnf, w[0], NULL, (int)N, C, V); /* the tied output layer */
    double loss = 0;
    for (size_t n = 0; n < N; n++) {
        const float *z = a->logits + n * V;
        float *p = a->probs + n * V, mx = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) mx = z[v] > mx ? z[v] : mx;
        for (int v = 0; v < V; v++) sum += p[v] = expf(z[v] - mx);
        for (int v = 0; v < V; v++) p[v] /= sum;
        loss -= logf(p[m->targets[n]]);
    }
    return m->loss = (float)(loss / (double)N);
}

static void gpt2_backward(GPT2 *m) {
    const Config *c = &m->cfg;
    int B = m->B, T = m->T, C = c->channels, L = c->layers, NH = c->heads, V = c->vocab;
    size_t N = (size_t)B * T, NC = N * C;
    memset(m->grads, 0, m->nparams * 4);
    memset(m->dact_block, 0, m->nacts * 4);
    float *const *w = m->w.p, *const *g = m->g.p;
    Acts *a = &m->a, *d = &m->d;
    for (size_t n = 0; n < N; n++) /* d(mean loss) / d(logits) */
        for (int v = 0; v < V; v++)
            d->logits[n * V + v] =
                (a->probs[n * V + v] - (v == m->targets[n] ? 1.0f : 0.0f)) / (float)N;
    matmul_backward(d->lnf, g[0], NULL, d->logits, a->lnf, w[0], (int)N, C, V);
    const float *res_last = L > 0 ? a->res3 + (L - 1) * NC : a->encoded;
    float *dres = L > 0 ? d->res3 + (L - 1) * NC : d->encoded;
    layernorm_backward(dres, g[14], g[15], d->lnf, res_last, w[14], a->lnf_mean, a->lnf_rstd,
                       (int)N, C);
    for (int l = L - 1; l >= 0; l--) {
        const float *res = l ? a->res3 + (l - 1) * NC : a->encoded;
        float *dres_in = l ? d->res3 + (l - 1) * NC : d->encoded;
        float *dres3 = d->res3 + l * NC, *dres2 = d->res2 + l * NC;
        for (size_t i = 0; i < NC; i++) { /* res3 = res2 + fcproj */
            dres2[i] += dres3[i];
            d->fcproj[l * NC + i] += dres3[i];
        }
        matmul_backward(d->fch_gelu + l * 4 * NC, g[12] + (size_t)l * 4 * C * C, g[13] + l * C,
                        d->fcproj + l * NC, a->fch_gelu + l * 4 * NC, w[12] + (size_t)l * 4 * C * C,
                        (int)N, 4 * C, C);
        gelu_backward(d->fch + l * 4 * NC, a->fch + l * 4 * NC, d->fch_gelu + l * 4 * NC, 4 * NC);
        matmul_backward(d->ln2 + l * NC, g[10] + (size_t)l * 4 * C * C, g[11] + l * 4 * C,
                        d->fch + l * 4 * NC, a->ln2 + l * NC, w[10] + (size_t)l * 4 * C * C, (int)N,
                        C, 4 * C);
        layernorm_backward(dres2, g[8] + l * C, g[9] + l * C, d->ln2 + l * NC, a->res2 + l * NC,
                           w[8] + l * C, a->ln2_mean + l * N, a->ln2_rstd + l * N, (int)N, C);
        for (size_t i = 0; i < NC; i++) { /* res2 = res + attproj */
            dres_in[i] += dres2[i];
            d->attproj[l * NC + i] += dres2[i];
        }
        matmul_backward(d->atty + l * NC, g[6] + (size_t)l * C * C, g[7] + l * C,
                        d->attproj + l * NC, a->atty + l * NC, w[6] + (size_t)l * C * C, (int)N, C,
                        C);
        attention_backward(d->qkv + l * 3 * NC, d->att + (size_t)l * B * NH * T * T,
                           d->atty + l * NC, a->qkv + l * 3 * NC,
                           a->att + (size_t)l * B * NH * T * T, B, T, C, NH);
        matmul_backward(d->ln1 + l * NC, g[4] + (size_t)l * 3 * C * C, g[5] + l * 3 * C,
                        d->qkv + l * 3 * NC, a->ln1 + l * NC, w[4] + (size_t)l * 3 * C * C, (int)N,
                        C, 3 * C);
        layernorm_backward(dres_in, g[2] + l * C, g[3] + l * C, d->ln1 + l * NC, res, w[2] + l * C,
                           a->ln1_mean + l * N, a->ln1_rstd + l * N, (int)N, C);
    }
    encoder_backward(g[0], g[1], d->encoded, m->inputs, B, T, C);
}

/* AdamW as PyTorch's (decoupled weight decay, bias corrections) on the fp32
 * masters; the bf16 parameters are the masters rounded to nearest even. */
static void gpt2_update(GPT2 *m, float lr, float b1, float b2, float eps, float wd, int t) {
    float bc1 = 1.0f - powf(b1, (float)t), bc2 = 1.0f - powf(b2, (float)t);
    for (size_t i = 0; i < m->nparams; i++) {
        float gr = m->grads[i], x = m->master[i] * (1.0f - lr * wd);
        m->m[i] = b1 * m->m[i] + (1.0f - b1) * gr;
        m->v[i] = b2 * m->v[i] + (1.0f - b2) * gr * gr;
        float denom = sqrtf(m->v[i]) / sqrtf(bc2) + eps;
        x -= lr / bc1 * (m->m[i] / denom);
        m->master[i] = x;
        m->params_bf16[i] = bf16_round(x);
    }
}

/* ---- ckpt: the loader's position and generator, as a named object ---------- */

// ckpt begin
static int loader_save(void *self, ckpt_writer *w) { /* the position and the generator */
    int rc = ckpt_write_u64(w, "shard", ((Loader *)self)->shard);
    rc = rc ? rc : ckpt_write_u64(w, "pos", ((Loader *)self)->pos);
    return rc ? rc : ckpt_write_u64(w, "rng", ((Loader *)self)->rng.state);
}
static int loader_load(void *self, ckpt_reader *r) {
    int rc = ckpt_read_u64(r, "shard", &((Loader *)self)->shard);
    rc = rc ? rc : ckpt_read_u64(r, "pos", &((Loader *)self)->pos);
    return rc ? rc : ckpt_read_u64(r, "rng", &((Loader *)self)->rng.state);
}
// ckpt end

/* ---- main --------------------------------------------------------------------- */

static int usage(void) {
    fprintf(stderr, "usage: example_gpt2 PROJECT_DIR [--steps N] [--save-every K] [--layers L] "
                    "[--heads H] [--channels C] [--seq T] [--batch B] [--vocab V] "
                    "[--eval-out FILE] [--quiet]\n");
    return 2;
}

int main(int argc, char **argv) {
    Config cfg = {.vocab = 64, .seq = 32, .layers = 2, .heads = 2, .channels = 32};
    int B = 4, steps = 60, save_every = 10;
    const char *eval_out = NULL, *project = NULL;
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int *ip = !strcmp(a, "--steps")        ? &steps
                  : !strcmp(a, "--save-every") ? &save_every
                  : !strcmp(a, "--layers")     ? &cfg.layers
                  : !strcmp(a, "--heads")      ? &cfg.heads
                  : !strcmp(a, "--channels")   ? &cfg.channels
                  : !strcmp(a, "--seq")        ? &cfg.seq
                  : !strcmp(a, "--batch")      ? &B
                  : !strcmp(a, "--vocab")      ? &cfg.vocab
                                               : NULL;
        if (ip && i + 1 < argc) *ip = atoi(argv[++i]);
        else if (!strcmp(a, "--eval-out") && i + 1 < argc) eval_out = argv[++i];
        else if (!strcmp(a, "--quiet")) quiet = true;
        else if (a[0] != '-' && !project) project = a;
        else return usage();
    }
    if (!project || steps < 1 || save_every < 1 || cfg.layers < 1 || cfg.heads < 1 ||
        cfg.channels % cfg.heads || cfg.seq < 2 || B < 1 || cfg.vocab < 2 || cfg.vocab > 65535 ||
        (size_t)B * (cfg.seq + 1) > VAL_TOKENS || (size_t)(B + 1) * cfg.seq + 1 > SHARD_TOKENS)
        return usage();
    int T = cfg.seq;

    /* the data: two training shards and a validation shard */
    static uint16_t train[NSHARDS][SHARD_TOKENS], val[VAL_TOKENS];
    for (int s = 0; s < NSHARDS; s++) make_tokens(train[s], SHARD_TOKENS, cfg.vocab, 1000 + s);
    make_tokens(val, VAL_TOKENS, cfg.vocab, 2000);
    Loader loader = {
        .shards = {train[0], train[1]}, .B = B, .T = T, .rng = {0x853C49E6748FEA9Bull}};
    GPT2 model;
    gpt2_build(&model, &cfg, B, T);
    if (!quiet)
        printf("GPT-2: %d layers, %d heads, %d channels, vocabulary %d, context %d: %zu "
               "parameters (bf16, fp32 masters)\n",
               cfg.layers, cfg.heads, cfg.channels, cfg.vocab, T, model.nparams);
    const float lr = 3e-3f, b1 = 0.9f, b2 = 0.95f, eps = 1e-8f, wd = 0.0f;
    int step = 0;

    // ckpt begin
#define CK(c) ((c) < 0 ? fprintf(stderr, "ckpt: %s\n", ckpt_errmsg()), exit(1) : (void)0)
    ckpt_model *cm;
    ckpt_optimizer *opt;
    ckpt_accelerator *acc;
    CK(ckpt_model_new(&cm));
    for (int i = 0; i < NPARAM; i++)
        CK(ckpt_model_add_param(cm, PARAM_NAMES[i], CKPT_BF16, model.shapes[i].ndim,
                                model.shapes[i].dim, model.bf16_at[i], NULL));
    CK(ckpt_model_tie(cm, "lm_head.weight", "wte")); /* the output layer is wte */
    ckpt_optim_options oo = {
        .lr = lr, .beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd, .master_weights = true};
    CK(ckpt_optimizer_external_new(&opt, CKPT_OPTIM_ADAMW, cm, &oo));
    CK(ckpt_optimizer_set_state_block(opt, "exp_avg", model.m, model.params_bf16));
    CK(ckpt_optimizer_set_state_block(opt, "exp_avg_sq", model.v, model.params_bf16));
    CK(ckpt_optimizer_set_state_block(opt, "master", model.master, model.params_bf16));
    ckpt_project_config pc = {.project_dir = project, .automatic_checkpoint_naming = true};
    CK(ckpt_accelerator_new(&acc, &pc));
    CK(ckpt_prepare_model(acc, cm));
    CK(ckpt_prepare_optimizer(acc, opt));
    static const ckpt_stateful_ops loader_ops = {loader_save, loader_load, NULL};
    CK(ckpt_register_for_checkpointing_named(acc, "loader", &loader_ops, &loader));
    int rc = ckpt_load_state(acc, NULL); /* the newest checkpoint; CKPT_ENOENT: none yet */
    if (rc != CKPT_ENOENT) CK(rc);
    if ((step = (int)ckpt_optimizer_get_step(opt)) > 0) printf("resumed at step %d\n", step);
    // ckpt end

    for (; step < steps; step++) {
        loader_next(&loader, model.inputs, model.targets);
        float loss = gpt2_forward(&model);
        gpt2_backward(&model);
        gpt2_update(&model, lr, b1, b2, eps, wd, step + 1);
        if (!quiet) printf("step %d/%d: loss %.6f\n", step + 1, steps, loss), fflush(stdout);
        // ckpt begin
        CK(ckpt_optimizer_set_step(opt, step + 1));
        if ((step + 1) % save_every == 0 || step + 1 == steps) CK(ckpt_save_state_async(acc, NULL));
        // ckpt end
    }

    /* the validation batch: the first B x (T + 1) tokens of the validation shard */
    for (int i = 0; i < B * T; i++) {
        model.inputs[i] = val[(i / T) * (T + 1) + i % T];
        model.targets[i] = val[(i / T) * (T + 1) + i % T + 1];
    }
    float vloss = gpt2_forward(&model);
    printf("final validation loss %.9g\n", vloss);
    if (eval_out) {
        FILE *f = fopen(eval_out, "w");
        if (!f) return perror(eval_out), 1;
        fprintf(f,
                "{\"B\": %d, \"T\": %d, \"layers\": %d, \"heads\": %d, \"loss\": %.9g, "
                "\"tokens\": [",
                B, T, cfg.layers, cfg.heads, vloss);
        for (int i = 0; i < B * (T + 1); i++) fprintf(f, "%s%d", i ? ", " : "", val[i]);
        fprintf(f, "]}\n");
        fclose(f);
    }
    // ckpt begin
    CK(ckpt_save_wait(acc));
    ckpt_accelerator_free(acc), ckpt_optimizer_free(opt), ckpt_model_free(cm);
    // ckpt end
    gpt2_free(&model);
    return 0;
}
