/* tied_run — the C side of tests/python/test_tied_named.py: a checkpoint
 * with tied weights, named and unnamed custom objects and u64 entries.
 *
 *   tied_run save DIR    writes DIR: a model (wte [6,4], h [4,4], lm_head
 *                        tied to wte, bias [6]) after two AdamW steps, the
 *                        named object "rng_state" (u64 seed 2^64 - 1, i64,
 *                        f64, str, bytes, tensor 'buf' F32 [3] and its alias
 *                        'buf_alias', 0-dim F32 'scale'), one unnamed object
 *                        (i64 'k' = 7) and the named "counts" holding a U32
 *                        tensor (PyTorch has no such dtype)
 *   tied_run load DIR    loads DIR into fresh objects of the same shape
 *                        (a fresh run tied by registering lm_head on wte's
 *                        buffer, objects registered in another order) and
 *                        prints "wte <24 values>", "seed <u64>", "k <i64>"
 *   tied_run untied DIR  the same with lm_head a parameter of its own: the
 *                        load must fail; prints the error and exits 3 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

enum { V = 6, D = 4 };

static float wte[V * D], gwte[V * D], h[D * D], gh[D * D], bias[V], gbias[V];
static float head[V * D], ghead[V * D];

typedef struct rngobj {
    uint64_t seed;
    int64_t n;
    double x;
    char s[16];
    unsigned char b[3];
    float buf[3];
    float scale;
} rngobj;

static int rng_sd(void *self, ckpt_writer *w) {
    rngobj *o = self;
    int64_t s3[1] = {3};
    int rc = ckpt_write_tensor(w, "buf", CKPT_F32, 1, s3, o->buf);
    if (rc == 0) rc = ckpt_write_alias(w, "buf_alias", "buf");
    if (rc == 0) rc = ckpt_write_tensor(w, "scale", CKPT_F32, 0, NULL, &o->scale);
    if (rc == 0) rc = ckpt_write_u64(w, "seed", o->seed);
    if (rc == 0) rc = ckpt_write_i64(w, "n", o->n);
    if (rc == 0) rc = ckpt_write_f64(w, "x", o->x);
    if (rc == 0) rc = ckpt_write_str(w, "s", o->s);
    if (rc == 0) rc = ckpt_write_bytes(w, "b", o->b, sizeof o->b);
    return rc;
}

static int rng_lsd(void *self, ckpt_reader *r) {
    rngobj *o = self;
    int64_t s3[1] = {3};
    size_t n = 0;
    int rc = ckpt_read_tensor(r, "buf", CKPT_F32, 1, s3, o->buf);
    if (rc == 0) rc = ckpt_read_tensor(r, "scale", CKPT_F32, 0, NULL, &o->scale);
    if (rc == 0) rc = ckpt_read_u64(r, "seed", &o->seed);
    if (rc == 0) rc = ckpt_read_i64(r, "n", &o->n);
    if (rc == 0) rc = ckpt_read_f64(r, "x", &o->x);
    if (rc == 0) rc = ckpt_read_str(r, "s", o->s, sizeof o->s);
    if (rc == 0) rc = ckpt_read_bytes(r, "b", o->b, sizeof o->b, &n);
    return rc;
}

static int64_t k_value;
static int k_sd(void *self, ckpt_writer *w) { return ckpt_write_i64(w, "k", *(int64_t *)self); }
static int k_lsd(void *self, ckpt_reader *r) { return ckpt_read_i64(r, "k", (int64_t *)self); }

static uint32_t counts[5];
static int c_sd(void *self, ckpt_writer *w) {
    int64_t s[1] = {5};
    return ckpt_write_tensor(w, "counts", CKPT_U32, 1, s, self);
}
static int c_lsd(void *self, ckpt_reader *r) {
    int64_t s[1] = {5};
    return ckpt_read_tensor(r, "counts", CKPT_U32, 1, s, self);
}

static const ckpt_stateful_ops rng_ops = {.state_dict = rng_sd, .load_state_dict = rng_lsd};
static const ckpt_stateful_ops k_ops = {.state_dict = k_sd, .load_state_dict = k_lsd};
static const ckpt_stateful_ops c_ops = {.state_dict = c_sd, .load_state_dict = c_lsd};

static void die(const char *what, int rc) {
    fprintf(stderr, "tied_run: %s: %s: %s\n", what, ckpt_strerror(rc), ckpt_errmsg());
    exit(1);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: tied_run save|load|untied DIR\n");
        return 2;
    }
    bool save = strcmp(argv[1], "save") == 0, untied = strcmp(argv[1], "untied") == 0;
    for (int i = 0; i < V * D; i++) wte[i] = save ? 0.1f * (float)(i % 7) - 0.3f : 9.0f;
    for (int i = 0; i < D * D; i++) h[i] = save ? 0.05f * (float)i : 9.0f;
    for (int i = 0; i < V; i++) bias[i] = save ? (float)i : 9.0f;
    rngobj ro = {0};
    if (save) {
        ro = (rngobj){.seed = UINT64_MAX,
                      .n = -5,
                      .x = 0.25,
                      .s = "philox",
                      .b = {0, 1, 255},
                      .buf = {1.5f, -2.0f, 3.25f},
                      .scale = 0.5f};
        k_value = 7;
        for (int i = 0; i < 5; i++) counts[i] = 4000000000u + (uint32_t)i;
    }
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {0};
    int64_t se[2] = {V, D}, sh[2] = {D, D}, sb[1] = {V};
    int rc = ckpt_model_new(&m);
    if (rc == 0) rc = ckpt_model_add_param(m, "wte", CKPT_F32, 2, se, wte, gwte);
    if (rc == 0) rc = ckpt_model_add_param(m, "h", CKPT_F32, 2, sh, h, gh);
    if (rc == 0 && untied) rc = ckpt_model_add_param(m, "lm_head", CKPT_F32, 2, se, head, ghead);
    else if (rc == 0 && !save) rc = ckpt_model_add_param(m, "lm_head", CKPT_F32, 2, se, wte, NULL);
    if (rc == 0) rc = ckpt_model_add_param(m, "bias", CKPT_F32, 1, sb, bias, gbias);
    if (rc == 0 && save) rc = ckpt_model_tie(m, "lm_head", "wte");
    if (rc == 0) rc = ckpt_adamw_new(&o, m, 0.01, 0.9, 0.999, 1e-8, 0.01);
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, m);
    if (rc == 0) rc = ckpt_prepare_optimizer(acc, o);
    if (rc == 0 && save)
        rc = ckpt_register_for_checkpointing_named(acc, "rng_state", &rng_ops, &ro);
    if (rc == 0) rc = ckpt_register_for_checkpointing(acc, &k_ops, &k_value);
    if (rc == 0) rc = ckpt_register_for_checkpointing_named(acc, "counts", &c_ops, counts);
    if (rc == 0 && !save)
        rc = ckpt_register_for_checkpointing_named(acc, "rng_state", &rng_ops, &ro);
    if (rc < 0) die("setup", rc);
    if (save) {
        for (int step = 1; step <= 2; step++) {
            for (int i = 0; i < V * D; i++) gwte[i] = 0.01f * (float)((i * step) % 5) - 0.02f;
            for (int i = 0; i < D * D; i++) gh[i] = 0.02f * (float)step;
            for (int i = 0; i < V; i++) gbias[i] = -0.01f * (float)i;
            if ((rc = ckpt_optimizer_step(o)) < 0) die("step", rc);
        }
        if ((rc = ckpt_save_state(acc, argv[2])) < 0) die("save", rc);
    } else {
        rc = ckpt_load_state(acc, argv[2]);
        if (rc < 0 && untied) {
            printf("error %s\n", ckpt_errmsg());
            ckpt_accelerator_free(acc);
            ckpt_optimizer_free(o);
            ckpt_model_free(m);
            return 3;
        }
        if (rc < 0) die("load", rc);
        printf("wte");
        for (int i = 0; i < V * D; i++) printf(" %.9g", wte[i]);
        printf("\nseed %" PRIu64 "\nk %" PRId64 "\n", ro.seed, k_value);
    }
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    return 0;
}
