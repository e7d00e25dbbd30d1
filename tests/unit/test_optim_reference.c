/* test_optim_reference.c — the C optimizers against PyTorch's numbers,
 * hard-coded (helpers/torch_optim_values.h, generated with PyTorch 1.13 by
 * tests/python/gen_optim_reference.py), so that no PyTorch is needed: AdamW
 * with weight decay (and amsgrad), Adam with L2 weight decay, SGD with
 * nesterov momentum and weight decay, SGD with dampening and weight decay,
 * RMSprop plain, with momentum and weight decay, and centered, six steps
 * each, every parameter after every step equal bit for bit; and the same run
 * saved after three steps and continued by new objects. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "helpers/testutil.h"
#include "helpers/torch_optim_values.h"

#define NW TORCH_REF_NW
#define NB TORCH_REF_NB
#define NV (NW + NB)

typedef struct run {
    float w[NW], gw[NW], b[NB], gb[NB];
    ckpt_model *m;
    ckpt_optimizer *o;
} run;

static void run_open(run *r, ckpt_optim_kind kind, const ckpt_optim_options *opt) {
    memset(r, 0, sizeof *r);
    for (int j = 0; j < NW; j++) r->w[j] = ((float)j - 2.5f) / 4;
    for (int j = 0; j < NB; j++) r->b[j] = (float)(j + 1) / 8;
    int64_t sw[2] = {2, 3}, sb[1] = {NB};
    assert_int_equal(ckpt_model_new(&r->m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(r->m, "w", CKPT_F32, 2, sw, r->w, r->gw), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(r->m, "b", CKPT_F32, 1, sb, r->b, r->gb), CKPT_OK);
    assert_int_equal(ckpt_optimizer_new(&r->o, kind, r->m, opt), CKPT_OK);
}

static void run_close(run *r) {
    ckpt_optimizer_free(r->o);
    ckpt_model_free(r->m);
}

/* The generator's gradients at step t: binary fractions, exact in float. */
static void run_step(run *r, int t) {
    for (int j = 0; j < NW; j++) r->gw[j] = (float)((5 * j + 3 * t) % 7 - 3) / 8 + (float)t / 32;
    for (int j = 0; j < NB; j++) r->gb[j] = (float)((3 * j + 2 * t) % 5 - 2) / 4 - (float)t / 64;
    assert_int_equal(ckpt_optimizer_step(r->o), CKPT_OK);
}

/* How many of the values after step t differ from PyTorch's (printing the first). */
static int differs(const char *what, const run *r, int t, const float want[NV]) {
    float got[NV];
    memcpy(got, r->w, sizeof r->w);
    memcpy(got + NW, r->b, sizeof r->b);
    int bad = 0;
    for (int j = 0; j < NV; j++) {
        if (memcmp(&got[j], &want[j], sizeof(float)) == 0) continue;
        if (!bad)
            print_message("%s: step %d, value %d: %a in C, %a in PyTorch\n", what, t, j,
                          (double)got[j], (double)want[j]);
        bad++;
    }
    return bad;
}

/* Six steps equal PyTorch's after every step; then the same run saved
 * after three steps and continued by new objects. */
static void expect_torch(const char *what, ckpt_optim_kind kind, const ckpt_optim_options *opt,
                         const float want[TORCH_REF_STEPS][NV]) {
    run a;
    run_open(&a, kind, opt);
    for (int t = 1; t <= TORCH_REF_STEPS; t++) {
        run_step(&a, t);
        assert_int_equal(differs(what, &a, t, want[t - 1]), 0);
    }
    run_close(&a);

    run b, c;
    run_open(&b, kind, opt);
    for (int t = 1; t <= 3; t++) run_step(&b, t);
    char *path = tu_pathf("%s/%s.safetensors", tu_dir(), what);
    tu_save_state(ckpt_optimizer_ops(), b.o, path);
    run_open(&c, kind, opt);
    memcpy(c.w, b.w, sizeof b.w);
    memcpy(c.b, b.b, sizeof b.b);
    run_close(&b);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), c.o, path), CKPT_OK);
    for (int t = 4; t <= TORCH_REF_STEPS; t++) {
        run_step(&c, t);
        assert_int_equal(differs(what, &c, t, want[t - 1]), 0);
    }
    run_close(&c);
    free(path);
}

static ckpt_optim_options adam_opts(ckpt_optim_kind kind, double lr, double b1, double b2,
                                    double eps, double wd, bool amsgrad) {
    ckpt_optim_options o = ckpt_optim_defaults(kind);
    o.lr = lr;
    o.beta1 = b1;
    o.beta2 = b2;
    o.eps = eps;
    o.weight_decay = wd;
    o.amsgrad = amsgrad;
    return o;
}

static void test_adamw_with_weight_decay_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = adam_opts(CKPT_OPTIM_ADAMW, 0.01, 0.9, 0.999, 1e-8, 0.1, false);
    expect_torch("adamw", CKPT_OPTIM_ADAMW, &o, torch_ref_adamw);
}

static void test_adamw_amsgrad_with_weight_decay_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = adam_opts(CKPT_OPTIM_ADAMW, 0.02, 0.8, 0.99, 1e-6, 0.05, true);
    expect_torch("adamw_amsgrad", CKPT_OPTIM_ADAMW, &o, torch_ref_adamw_amsgrad);
}

static void test_adam_with_l2_weight_decay_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = adam_opts(CKPT_OPTIM_ADAM, 0.01, 0.9, 0.999, 1e-8, 0.1, false);
    expect_torch("adam_l2", CKPT_OPTIM_ADAM, &o, torch_ref_adam_l2);
}

static void test_sgd_nesterov_with_weight_decay_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    o.lr = 0.05;
    o.momentum = 0.9;
    o.nesterov = true;
    o.weight_decay = 0.01;
    expect_torch("sgd_nesterov", CKPT_OPTIM_SGD, &o, torch_ref_sgd_nesterov);
}

static void test_sgd_dampening_with_weight_decay_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    o.lr = 0.1;
    o.momentum = 0.8;
    o.dampening = 0.3;
    o.weight_decay = 0.02;
    expect_torch("sgd_dampening", CKPT_OPTIM_SGD, &o, torch_ref_sgd_dampening);
}

static ckpt_optim_options rmsprop_opts(double lr, double alpha, double eps, double wd,
                                       double momentum, bool centered) {
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_RMSPROP);
    o.lr = lr;
    o.alpha = alpha;
    o.eps = eps;
    o.weight_decay = wd;
    o.momentum = momentum;
    o.centered = centered;
    return o;
}

static void test_rmsprop_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = rmsprop_opts(0.01, 0.99, 1e-8, 0, 0, false);
    expect_torch("rmsprop", CKPT_OPTIM_RMSPROP, &o, torch_ref_rmsprop);
}

static void test_rmsprop_momentum_with_weight_decay_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = rmsprop_opts(0.02, 0.9, 1e-6, 0.05, 0.8, false);
    expect_torch("rmsprop_momentum", CKPT_OPTIM_RMSPROP, &o, torch_ref_rmsprop_momentum);
}

static void test_rmsprop_centered_equals_pytorch(void **state) {
    (void)state;
    ckpt_optim_options o = rmsprop_opts(0.005, 0.95, 1e-4, 0.1, 0.5, true);
    expect_torch("rmsprop_centered", CKPT_OPTIM_RMSPROP, &o, torch_ref_rmsprop_centered);
    o = rmsprop_opts(0.01, 0.99, 1e-8, 0, 0, true);
    expect_torch("rmsprop_centered_plain", CKPT_OPTIM_RMSPROP, &o,
                 torch_ref_rmsprop_centered_plain);
}

/* The comparison can fail: without the weight decay, or as Adam instead of
 * AdamW, the values differ from PyTorch's from the first step on. */
static void test_reference_comparison_detects_another_update(void **state) {
    (void)state;
    ckpt_optim_options variants[2] = {
        adam_opts(CKPT_OPTIM_ADAMW, 0.01, 0.9, 0.999, 1e-8, 0.0, false),
        adam_opts(CKPT_OPTIM_ADAM, 0.01, 0.9, 0.999, 1e-8, 0.1, false)};
    ckpt_optim_kind kinds[2] = {CKPT_OPTIM_ADAMW, CKPT_OPTIM_ADAM};
    for (int v = 0; v < 2; v++) {
        run r;
        run_open(&r, kinds[v], &variants[v]);
        run_step(&r, 1);
        assert_true(differs("variant", &r, 1, torch_ref_adamw[0]) > 0);
        run_close(&r);
    }
}

int main(void) {
#define T(name) cmocka_unit_test_setup_teardown(name, tu_tmpdir_setup, tu_tmpdir_teardown)
    const struct CMUnitTest tests[] = {
        T(test_adamw_with_weight_decay_equals_pytorch),
        T(test_adamw_amsgrad_with_weight_decay_equals_pytorch),
        T(test_adam_with_l2_weight_decay_equals_pytorch),
        T(test_sgd_nesterov_with_weight_decay_equals_pytorch),
        T(test_sgd_dampening_with_weight_decay_equals_pytorch),
        T(test_rmsprop_equals_pytorch),
        T(test_rmsprop_momentum_with_weight_decay_equals_pytorch),
        T(test_rmsprop_centered_equals_pytorch),
        T(test_reference_comparison_detects_another_update),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
