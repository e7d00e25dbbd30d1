/* rng.c — Philox4x32-10 (Salmon et al., SC'11): a counter-based generator.
 * Its whole state is a key, a counter and where we are in the current block,
 * so it checkpoints in a few words and splits into independent streams. */
#include <math.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "train/rng.h"

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

static void philox_round(uint32_t c[4], const uint32_t k[2]) {
    uint64_t p0 = (uint64_t)PHILOX_M0 * c[0];
    uint64_t p1 = (uint64_t)PHILOX_M1 * c[2];
    uint32_t r0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k[0];
    uint32_t r1 = (uint32_t)p1;
    uint32_t r2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k[1];
    uint32_t r3 = (uint32_t)p0;
    c[0] = r0;
    c[1] = r1;
    c[2] = r2;
    c[3] = r3;
}

void ckpt_philox4x32_10(const uint32_t counter[4], const uint32_t key[2], uint32_t out[4]) {
    uint32_t c[4] = {counter[0], counter[1], counter[2], counter[3]};
    uint32_t k[2] = {key[0], key[1]};
    for (int r = 0; r < 10; r++) {
        if (r > 0) {
            k[0] += PHILOX_W0;
            k[1] += PHILOX_W1;
        }
        philox_round(c, k);
    }
    memcpy(out, c, sizeof c);
}

void ckpt_rng_seed_stream(ckpt_rng *g, uint64_t seed, uint64_t stream) {
    memset(g, 0, sizeof *g);
    g->key[0] = (uint32_t)seed;
    g->key[1] = (uint32_t)(seed >> 32);
    g->counter[2] = (uint32_t)stream;
    g->counter[3] = (uint32_t)(stream >> 32);
    g->pos = 4; /* no block drawn yet */
}

void ckpt_rng_seed(ckpt_rng *g, uint64_t seed) { ckpt_rng_seed_stream(g, seed, 0); }

uint32_t ckpt_rng_u32(ckpt_rng *g) {
    if (g->pos >= 4) {
        ckpt_philox4x32_10(g->counter, g->key, g->block);
        /* Only the low 64 bits count blocks: the high words name the stream. */
        if (++g->counter[0] == 0) g->counter[1]++;
        g->pos = 0;
    }
    return g->block[g->pos++];
}

uint64_t ckpt_rng_u64(ckpt_rng *g) {
    uint64_t hi = ckpt_rng_u32(g);
    uint64_t lo = ckpt_rng_u32(g);
    return (hi << 32) | lo;
}

double ckpt_rng_uniform(ckpt_rng *g) {
    return (double)(ckpt_rng_u64(g) >> 11) * 0x1.0p-53;
}

float ckpt_rng_uniform_f32(ckpt_rng *g) { return (float)(ckpt_rng_u32(g) >> 8) * 0x1.0p-24f; }

double ckpt_rng_normal(ckpt_rng *g) {
    if (g->has_normal) {
        g->has_normal = 0;
        return g->normal;
    }
    /* 1 - u lies in (0, 1], so the logarithm is finite. */
    double u1 = 1.0 - ckpt_rng_uniform(g);
    double u2 = ckpt_rng_uniform(g);
    double r = sqrt(-2.0 * log(u1));
    double t = 6.283185307179586476925286766559 * u2;
    g->normal = r * sin(t);
    g->has_normal = 1;
    return r * cos(t);
}

uint64_t ckpt_rng_below(ckpt_rng *g, uint64_t n) {
    if (n == 0) return 0;
    /* Reject the first 2^64 mod n values so every residue is equally likely. */
    uint64_t threshold = (0 - n) % n;
    for (;;) {
        uint64_t x = ckpt_rng_u64(g);
        if (x >= threshold) return x % n;
    }
}

/* ---- state dict --------------------------------------------------------- */

static int rng_state_dict(void *self, ckpt_writer *w) {
    ckpt_rng *g = self;
    const int64_t two = 2, four = 4;
    CKPT_TRY(ckpt_write_tensor(w, "key", CKPT_U32, 1, &two, g->key));
    CKPT_TRY(ckpt_write_tensor(w, "counter", CKPT_U32, 1, &four, g->counter));
    CKPT_TRY(ckpt_write_tensor(w, "block", CKPT_U32, 1, &four, g->block));
    CKPT_TRY(ckpt_write_i64(w, "pos", g->pos));
    CKPT_TRY(ckpt_write_i64(w, "has_normal", g->has_normal));
    CKPT_TRY(ckpt_write_f64(w, "normal", g->normal));
    return CKPT_OK;
}

/* Reads and checks the whole state in r into *n; changes nothing else. */
static int rng_read(ckpt_reader *r, ckpt_rng *n) {
    memset(n, 0, sizeof *n);
    const int64_t two = 2, four = 4;
    int64_t pos, has_normal;
    CKPT_TRY(ckpt_read_tensor(r, "key", CKPT_U32, 1, &two, n->key));
    CKPT_TRY(ckpt_read_tensor(r, "counter", CKPT_U32, 1, &four, n->counter));
    CKPT_TRY(ckpt_read_tensor(r, "block", CKPT_U32, 1, &four, n->block));
    CKPT_TRY(ckpt_read_i64(r, "pos", &pos));
    CKPT_TRY(ckpt_read_i64(r, "has_normal", &has_normal));
    CKPT_TRY(ckpt_read_f64(r, "normal", &n->normal));
    if (pos < 0 || pos > 4)
        return ckpt__err(CKPT_ECORRUPT, "rng: pos: expected 0..4, got %lld", (long long)pos);
    if (has_normal != 0 && has_normal != 1)
        return ckpt__err(CKPT_ECORRUPT, "rng: has_normal: expected 0 or 1, got %lld",
                         (long long)has_normal);
    n->pos = (uint32_t)pos;
    n->has_normal = (uint32_t)has_normal;
    return CKPT_OK;
}

static int rng_check_state_dict(void *self, ckpt_reader *r) {
    (void)self;
    ckpt_rng n;
    return rng_read(r, &n);
}

static int rng_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_rng *g = self;
    ckpt_rng n;
    /* The check reads everything into a copy: a bad value leaves g untouched. */
    CKPT_TRY(rng_read(r, &n));
    *g = n;
    return CKPT_OK;
}

static const ckpt_stateful_ops rng_ops = {rng_state_dict, rng_load_state_dict,
                                          rng_check_state_dict};

const ckpt_stateful_ops *ckpt_rng_ops(void) { return &rng_ops; }

/* ---- another process count ------------------------------------------------ */

void ckpt__rng_reshard(const ckpt_rng *saved0, int rank, ckpt_rng *out) {
    *out = *saved0;
    if (rank == 0) return;
    uint64_t stream = (uint64_t)saved0->counter[2] | (uint64_t)saved0->counter[3] << 32;
    stream += (uint64_t)rank;
    out->counter[2] = (uint32_t)stream;
    out->counter[3] = (uint32_t)(stream >> 32);
    memset(out->block, 0, sizeof out->block);
    out->pos = 4;
    out->has_normal = 0;
    out->normal = 0;
}

static int reshard_state_dict(void *self, ckpt_writer *w) {
    return rng_state_dict(((ckpt_rng_reshard *)self)->target, w);
}

static int reshard_check(void *self, ckpt_reader *r) {
    (void)self;
    ckpt_rng n;
    return rng_read(r, &n);
}

static int reshard_load(void *self, ckpt_reader *r) {
    ckpt_rng_reshard *x = self;
    ckpt_rng n;
    CKPT_TRY(rng_read(r, &n));
    ckpt__rng_reshard(&n, x->rank, x->target);
    return CKPT_OK;
}

static const ckpt_stateful_ops reshard_ops = {reshard_state_dict, reshard_load, reshard_check};

const ckpt_stateful_ops *ckpt__rng_reshard_ops(void) { return &reshard_ops; }
