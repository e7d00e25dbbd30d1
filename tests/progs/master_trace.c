/* master_trace — AdamW with fp32 master weights over BF16 (or F16)
 * parameters for 30 steps, printing every parameter's bits after each step
 * and saving a checkpoint after step 20; tests/python/test_master_weights.py
 * runs torch.optim.AdamW on fp32 copies, rounds them after each step, and
 * continues from the checkpoint's export.
 *
 * Usage: master_trace <dir> bf16|f16   (writes <dir>/ck, and <dir>/fz after
 * step 30 with b frozen: no optimizer state for it)
 * Lines: step <t> <hex bits of w (7 x 13), then b (29)...>
 * Parameter k's initial value j is round(float(0.5*sin(0.3*j + 1 + k)));
 * its gradient at step t is round(float(sin(0.37*j + t + k) + 0.1*value)),
 * value the parameter widened to double. AdamW: lr 1e-2, betas (0.9,
 * 0.999), eps 1e-8, weight_decay 0.01. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

#define NW (7 * 13)
#define NB 29

static uint16_t w[NW], b[NB], gw[NW], gb[NB];
static ckpt_dtype dt;

static int fail(const char *what, int rc) {
    fprintf(stderr, "master_trace: %s: %s: %s\n", what, ckpt_strerror(rc), ckpt_errmsg());
    exit(1);
}

static uint16_t narrow(double x) {
    float f = (float)x;
    uint16_t h;
    ckpt_dtype_convert(CKPT_F32, &f, dt, &h, 1);
    return h;
}

static double wide(uint16_t h) {
    float f;
    ckpt_dtype_convert(dt, &h, CKPT_F32, &f, 1);
    return f;
}

static void fill(uint16_t *v, int n, int k) {
    for (int j = 0; j < n; j++) v[j] = narrow(0.5 * sin(0.3 * j + 1 + k));
}

static void grads(uint16_t *g, const uint16_t *v, int n, int t, int k) {
    for (int j = 0; j < n; j++) g[j] = narrow(sin(0.37 * j + t + k) + 0.1 * wide(v[j]));
}

int main(int argc, char **argv) {
    if (argc != 3 || (strcmp(argv[2], "bf16") && strcmp(argv[2], "f16"))) {
        fprintf(stderr, "usage: master_trace <dir> bf16|f16\n");
        return 2;
    }
    dt = strcmp(argv[2], "bf16") ? CKPT_F16 : CKPT_BF16;
    fill(w, NW, 0);
    fill(b, NB, 1);
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_accelerator *acc = NULL;
    int rc = ckpt_model_new(&m);
    if (rc < 0) fail("model", rc);
    if ((rc = ckpt_model_add_param(m, "w", dt, 2, (int64_t[]){7, 13}, w, gw)) < 0) fail("w", rc);
    if ((rc = ckpt_model_add_param(m, "b", dt, 1, (int64_t[]){NB}, b, gb)) < 0) fail("b", rc);
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    op.lr = 1e-2;
    op.weight_decay = 0.01;
    op.master_weights = true;
    if ((rc = ckpt_optimizer_new(&o, CKPT_OPTIM_ADAMW, m, &op)) < 0) fail("optimizer", rc);
    ckpt_project_config cfg = {0};
    if ((rc = ckpt_accelerator_new(&acc, &cfg)) < 0) fail("accelerator", rc);
    if ((rc = ckpt_prepare_model(acc, m)) < 0) fail("prepare", rc);
    if ((rc = ckpt_prepare_optimizer(acc, o)) < 0) fail("prepare", rc);
    char ck[4096];
    snprintf(ck, sizeof ck, "%s/ck", argv[1]);
    for (int t = 1; t <= 30; t++) {
        grads(gw, w, NW, t, 0);
        grads(gb, b, NB, t, 1);
        if ((rc = ckpt_optimizer_step(o)) < 0) fail("step", rc);
        printf("step %d", t);
        for (int j = 0; j < NW; j++) printf(" %04x", w[j]);
        for (int j = 0; j < NB; j++) printf(" %04x", b[j]);
        printf("\n");
        if (t == 20 && (rc = ckpt_save_state(acc, ck)) < 0) fail("save", rc);
    }
    snprintf(ck, sizeof ck, "%s/fz", argv[1]);
    if ((rc = ckpt_model_set_frozen(m, "b", true)) < 0) fail("freeze", rc);
    if ((rc = ckpt_save_state(acc, ck)) < 0) fail("save", rc);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    return 0;
}
