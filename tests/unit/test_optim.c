/* test_optim.c — SGD / Adam / AdamW: argument checks, the update formulas on
 * hand-checked values, parameter groups, and state dicts that resume a run
 * bit for bit (the numbers against PyTorch are in test_torch_numerics.py). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "train/optim.h"
#include "helpers/testutil.h"

/* ---- a two-parameter model ---------------------------------------------- */

typedef struct fixture {
    float w[6], gw[6], b[3], gb[3];
    ckpt_model *m;
} fixture;

static void fixture_init(fixture *f) {
    memset(f, 0, sizeof *f);
    for (int j = 0; j < 6; j++) f->w[j] = (float)(0.5 * sin(0.3 * j + 1));
    for (int j = 0; j < 3; j++) f->b[j] = (float)(0.5 * sin(0.3 * j + 2));
    assert_int_equal(ckpt_model_new(&f->m), CKPT_OK);
    int64_t sw[2] = {2, 3}, sb[1] = {3};
    assert_int_equal(ckpt_model_add_param(f->m, "w", CKPT_F32, 2, sw, f->w, f->gw), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(f->m, "b", CKPT_F32, 1, sb, f->b, f->gb), CKPT_OK);
}

static void grads(fixture *f, int t) {
    for (int j = 0; j < 6; j++) f->gw[j] = (float)sin(0.37 * j + t);
    for (int j = 0; j < 3; j++) f->gb[j] = (float)sin(0.37 * j + t + 1);
}

static char *path_of(const char *name) {
    static char path[128];
    return tu_path(path, sizeof path, tu_dir(), name);
}

/* The optimizer's whole state as bytes (its state dict file). */
static char *state_bytes(ckpt_optimizer *o, const char *name, size_t *n) {
    char path[128];
    return tu_state_bytes(ckpt_optimizer_ops(), o, tu_path(path, sizeof path, tu_dir(), name), n);
}

/* ---- argument checks ----------------------------------------------------- */

static void test_new_rejects_bad_hyperparameters(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *o = (ckpt_optimizer *)&f; /* must be reset to NULL on failure */
    assert_int_equal(ckpt_sgd_new(&o, f.m, -0.5, 0, 0, false), CKPT_EINVAL);
    assert_null(o);
    assert_string_equal(ckpt_errmsg(), "optimizer: param_groups.0.lr: expected >= 0, got -0.5");
    assert_int_equal(ckpt_sgd_new(&o, f.m, NAN, 0, 0, false), CKPT_EINVAL);
    assert_int_equal(ckpt_sgd_new(&o, f.m, 0.1, -0.1, 0, false), CKPT_EINVAL);
    tu_assert_errmsg_has("momentum");
    assert_int_equal(ckpt_sgd_new(&o, f.m, 0.1, 0, -1, false), CKPT_EINVAL);
    tu_assert_errmsg_has("weight_decay");
    assert_int_equal(ckpt_sgd_new(&o, f.m, 0.1, 0, 0, true), CKPT_EINVAL);
    tu_assert_errmsg_has("nesterov");
    ckpt_optim_options so = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    so.momentum = 0.9;
    so.dampening = 0.1;
    so.nesterov = true;
    assert_int_equal(ckpt_optimizer_new(&o, CKPT_OPTIM_SGD, f.m, &so), CKPT_EINVAL);
    tu_assert_errmsg_has("dampening");
    assert_int_equal(ckpt_adamw_new(&o, f.m, 1e-3, 1.0, 0.999, 1e-8, 0), CKPT_EINVAL);
    assert_string_equal(ckpt_errmsg(),
                        "optimizer: param_groups.0.betas.0: expected in [0, 1), got 1");
    assert_int_equal(ckpt_adamw_new(&o, f.m, 1e-3, 0.9, -0.1, 1e-8, 0), CKPT_EINVAL);
    tu_assert_errmsg_has("betas.1");
    assert_int_equal(ckpt_adam_new(&o, f.m, 1e-3, 0.9, 0.999, -1e-8, 0), CKPT_EINVAL);
    tu_assert_errmsg_has("eps");
    assert_int_equal(ckpt_adam_new(&o, f.m, -1e-3, 0.9, 0.999, 1e-8, 0), CKPT_EINVAL);
    assert_null(o);
    ckpt_model_free(f.m);
}

static void test_new_rejects_a_model_without_parameters(void **state) {
    (void)state;
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0.01), CKPT_EINVAL);
    assert_string_equal(ckpt_errmsg(), "optimizer: the model has no parameters");
    assert_null(o);
    ckpt_model_free(m);
}

static void test_new_rejects_non_f32_parameters_naming_them(void **state) {
    (void)state;
    ckpt_model *m;
    double d[2];
    int64_t s[1] = {2};
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "dbl", CKPT_F64, 1, s, d, d), CKPT_OK);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_sgd_new(&o, m, 0.1, 0, 0, false), CKPT_EUNSUPPORTED);
    tu_assert_errmsg_has("'dbl' is F64");
    ckpt_model_free(m);
}

static void test_step_without_gradient_fails_and_changes_nothing(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    float frozen[2] = {1, 2};
    int64_t s[1] = {2};
    assert_int_equal(ckpt_model_add_param(f.m, "frozen", CKPT_F32, 1, s, frozen, NULL), CKPT_OK);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_adamw_new(&o, f.m, 1e-2, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    grads(&f, 1);
    size_t n0, n1;
    char *before = state_bytes(o, "before.safetensors", &n0);
    float w0[6], b0[3];
    memcpy(w0, f.w, sizeof w0);
    memcpy(b0, f.b, sizeof b0);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_EINVAL);
    tu_assert_errmsg_has("'frozen'");
    tu_assert_errmsg_has("no gradient");
    char *after = state_bytes(o, "after.safetensors", &n1);
    tu_assert_bytes_equal(before, n0, after, n1);
    assert_memory_equal(w0, f.w, sizeof w0);
    assert_memory_equal(b0, f.b, sizeof b0);
    free(before);
    free(after);
    ckpt_optimizer_free(o);
    /* excluded from the optimizer (group -1), it is fine */
    assert_int_equal(ckpt_adamw_new(&o, f.m, 1e-2, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    int group_of[3] = {0, 0, -1};
    ckpt_optim_options opts = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    assert_int_equal(ckpt_optimizer_set_groups(o, 1, group_of, &opts), CKPT_OK);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    assert_float_equal(frozen[0], 1, 0);
    ckpt_optimizer_free(o);
    ckpt_model_free(f.m);
}

/* ---- the formulas -------------------------------------------------------- */

static void test_sgd_momentum_first_step_copies_gradient_then_dampens(void **state) {
    (void)state;
    float p[1] = {1.0f}, g[1] = {0.5f};
    int64_t s[1] = {1};
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "p", CKPT_F32, 1, s, p, g), CKPT_OK);
    ckpt_optim_options so = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    so.lr = 0.1;
    so.momentum = 0.9;
    so.dampening = 0.5;
    ckpt_optimizer *o;
    assert_int_equal(ckpt_optimizer_new(&o, CKPT_OPTIM_SGD, m, &so), CKPT_OK);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    /* buf = g (no dampening on the first step); p -= lr * buf */
    float expect = fmaf(-0.1f, 0.5f, 1.0f);
    assert_true(p[0] == expect);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    /* buf = 0.9*buf + (1-0.5)*g */
    float buf = fmaf(0.5f, 0.5f, 0.5f * 0.9f);
    expect = fmaf(-0.1f, buf, expect);
    assert_true(p[0] == expect);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

static void test_adamw_first_step_moves_each_weight_by_lr_times_sign(void **state) {
    (void)state;
    /* After one step Adam's update is lr * g/|g| (bias-corrected), so with no
     * weight decay every weight moves by about lr against its gradient. */
    fixture f;
    fixture_init(&f);
    float w0[6];
    memcpy(w0, f.w, sizeof w0);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_adamw_new(&o, f.m, 0.01, 0.9, 0.999, 1e-8, 0), CKPT_OK);
    grads(&f, 1);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    for (int j = 0; j < 6; j++) {
        float want = f.gw[j] > 0 ? -0.01f : 0.01f;
        assert_float_equal(f.w[j] - w0[j], want, 1e-6);
    }
    ckpt_optimizer_free(o);
    ckpt_model_free(f.m);
}

static void test_zero_grad_and_learning_rate_accessors(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_sgd_new(&o, f.m, 0.1, 0, 0, false), CKPT_OK);
    grads(&f, 3);
    ckpt_optimizer_zero_grad(o);
    for (int j = 0; j < 6; j++) assert_true(f.gw[j] == 0.0f);
    for (int j = 0; j < 3; j++) assert_true(f.gb[j] == 0.0f);
    assert_int_equal(ckpt_optimizer_num_groups(o), 1);
    assert_true(ckpt_optimizer_get_lr(o, 0) == 0.1);
    assert_int_equal(ckpt_optimizer_set_lr(o, 0, 0.25), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(o, 0) == 0.25);
    assert_int_equal(ckpt_optimizer_set_lr(o, 0, -1), CKPT_EINVAL);
    assert_int_equal(ckpt_optimizer_set_lr(o, 1, 0.1), CKPT_EINVAL);
    assert_true(ckpt_optimizer_get_lr(o, 0) == 0.25);
    ckpt_optimizer_free(o);
    ckpt_optimizer_free(NULL);
    ckpt_optimizer_zero_grad(NULL);
    ckpt_model_free(f.m);
}

static void test_set_groups_numbers_state_like_pytorch(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_adam_new(&o, f.m, 1e-3, 0.9, 0.999, 1e-8, 0), CKPT_OK);
    /* b in group 0, w in group 1: PyTorch numbers b as state 0, w as state 1 */
    int group_of[2] = {1, 0};
    ckpt_optim_options opts[2] = {ckpt_optim_defaults(CKPT_OPTIM_ADAM),
                                  ckpt_optim_defaults(CKPT_OPTIM_ADAM)};
    opts[1].lr = 0.5;
    opts[1].amsgrad = true;
    int bad_group[2] = {0, 2};
    assert_int_equal(ckpt_optimizer_set_groups(o, 2, bad_group, opts), CKPT_EINVAL);
    assert_int_equal(ckpt_optimizer_set_groups(o, 2, group_of, opts), CKPT_OK);
    assert_int_equal(ckpt_optimizer_num_groups(o), 2);
    assert_true(ckpt_optimizer_get_lr(o, 1) == 0.5);
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new_schema(&w), CKPT_OK);
    assert_int_equal(ckpt_optimizer_ops()->state_dict(o, w), CKPT_OK);
    static const char *keys[] = {
        "kind", "param_names.0", "param_names.1",
        "state.0.step", "state.0.exp_avg", "state.0.exp_avg_sq",
        "state.1.step", "state.1.exp_avg", "state.1.exp_avg_sq", "state.1.max_exp_avg_sq",
        "param_groups.0.lr", "param_groups.0.weight_decay", "param_groups.0.maximize",
        "param_groups.0.betas.0", "param_groups.0.betas.1", "param_groups.0.eps",
        "param_groups.0.amsgrad", "param_groups.0.params",
        "param_groups.1.lr", "param_groups.1.weight_decay", "param_groups.1.maximize",
        "param_groups.1.betas.0", "param_groups.1.betas.1", "param_groups.1.eps",
        "param_groups.1.amsgrad", "param_groups.1.params",
    };
    int n = (int)(sizeof keys / sizeof keys[0]);
    assert_int_equal(ckpt_writer_entry_count(w), n);
    for (int i = 0; i < n; i++) {
        ckpt_entry_info e;
        assert_int_equal(ckpt_writer_entry(w, i, &e), CKPT_OK);
        assert_string_equal(e.key, keys[i]);
        if (strcmp(e.key, "state.0.exp_avg") == 0) { /* b's shape */
            assert_int_equal(e.ndim, 1);
            assert_int_equal(e.shape[0], 3);
        }
        if (strcmp(e.key, "state.1.step") == 0) { /* a float32 0-d tensor, as PyTorch */
            assert_int_equal(e.kind, CKPT_ENTRY_TENSOR);
            assert_int_equal(e.dtype, CKPT_F32);
            assert_int_equal(e.ndim, 0);
        }
    }
    ckpt_writer_free(w);
    /* groups are fixed once stepping started */
    grads(&f, 1);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_groups(o, 2, group_of, opts), CKPT_EINVAL);
    ckpt_optimizer_free(o);
    ckpt_model_free(f.m);
}

/* ---- state dicts --------------------------------------------------------- */

/* Runs `total` steps straight, and again with a save after `cut` steps and a
 * load into a fresh model + optimizer: the parameters must match bit for bit. */
static void check_resume(ckpt_optim_kind kind, const ckpt_optim_options *opts, int cut,
                         int total) {
    fixture a, b;
    fixture_init(&a);
    ckpt_optimizer *oa;
    assert_int_equal(ckpt_optimizer_new(&oa, kind, a.m, opts), CKPT_OK);
    for (int t = 1; t <= total; t++) {
        grads(&a, t);
        assert_int_equal(ckpt_optimizer_step(oa), CKPT_OK);
    }
    fixture_init(&b);
    ckpt_optimizer *ob;
    assert_int_equal(ckpt_optimizer_new(&ob, kind, b.m, opts), CKPT_OK);
    for (int t = 1; t <= cut; t++) {
        grads(&b, t);
        assert_int_equal(ckpt_optimizer_step(ob), CKPT_OK);
    }
    tu_save_state(ckpt_model_ops(), b.m, path_of("model.safetensors"));
    tu_save_state(ckpt_optimizer_ops(), ob, path_of("optimizer.safetensors"));
    ckpt_optimizer_free(ob);
    ckpt_model_free(b.m);

    fixture c;
    fixture_init(&c);
    ckpt_optimizer *oc;
    ckpt_optim_options other = *opts;
    other.lr = opts->lr * 3; /* the file's hyper-parameters win, as in PyTorch */
    assert_int_equal(ckpt_optimizer_new(&oc, kind, c.m, &other), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_model_ops(), c.m, path_of("model.safetensors")), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), oc, path_of("optimizer.safetensors")), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(oc, 0) == opts->lr);
    for (int t = cut + 1; t <= total; t++) {
        grads(&c, t);
        assert_int_equal(ckpt_optimizer_step(oc), CKPT_OK);
    }
    assert_memory_equal(a.w, c.w, sizeof a.w);
    assert_memory_equal(a.b, c.b, sizeof a.b);
    ckpt_optimizer_free(oa);
    ckpt_optimizer_free(oc);
    ckpt_model_free(a.m);
    ckpt_model_free(c.m);
}

static void test_adamw_amsgrad_resumes_bit_for_bit(void **state) {
    (void)state;
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    o.lr = 0.01;
    o.amsgrad = true;
    check_resume(CKPT_OPTIM_ADAMW, &o, 5, 12);
    check_resume(CKPT_OPTIM_ADAMW, &o, 0, 3); /* saved before the first step */
}

static void test_adam_resumes_bit_for_bit(void **state) {
    (void)state;
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_ADAM);
    o.weight_decay = 0.1;
    o.maximize = true;
    check_resume(CKPT_OPTIM_ADAM, &o, 7, 10);
}

static void test_sgd_dampening_resumes_bit_for_bit_even_before_first_step(void **state) {
    (void)state;
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    o.lr = 0.05;
    o.momentum = 0.9;
    o.dampening = 0.3;
    /* before the first step the buffer does not exist yet in PyTorch's
     * terms: after loading, the first step must still copy the gradient */
    check_resume(CKPT_OPTIM_SGD, &o, 0, 4);
    check_resume(CKPT_OPTIM_SGD, &o, 3, 8);
}

static void test_loading_sgd_state_into_adamw_is_a_mismatch_and_changes_nothing(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *sgd, *adamw;
    assert_int_equal(ckpt_sgd_new(&sgd, f.m, 0.1, 0.9, 0, false), CKPT_OK);
    grads(&f, 1);
    assert_int_equal(ckpt_optimizer_step(sgd), CKPT_OK);
    tu_save_state(ckpt_optimizer_ops(), sgd, path_of("sgd.safetensors"));
    assert_int_equal(ckpt_adamw_new(&adamw, f.m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    assert_int_equal(ckpt_optimizer_step(adamw), CKPT_OK);
    size_t n0, n1;
    char *before = state_bytes(adamw, "before.safetensors", &n0);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), adamw, path_of("sgd.safetensors")),
                     CKPT_EMISMATCH);
    assert_string_equal(ckpt_errmsg(),
                        "optimizer: the state dict is for a sgd optimizer, this one is adamw");
    char *after = state_bytes(adamw, "after.safetensors", &n1);
    tu_assert_bytes_equal(before, n0, after, n1);
    free(before);
    free(after);
    ckpt_optimizer_free(sgd);
    ckpt_optimizer_free(adamw);
    ckpt_model_free(f.m);
}

static void test_load_rejects_bad_values_and_changes_nothing(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_adamw_new(&o, f.m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    grads(&f, 1);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    /* a state dict with a negative learning rate and beta1 = 1: hand-made
     * from a valid one by copying every entry but those */
    tu_save_state(ckpt_optimizer_ops(), o, path_of("good.safetensors"));
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, path_of("good.safetensors")), CKPT_OK);
    for (int variant = 0; variant < 3; variant++) {
        ckpt_writer *w;
        assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
        for (int64_t i = 0; i < ckpt_reader_count(r); i++) {
            ckpt_entry_info e;
            assert_int_equal(ckpt_reader_entry(r, i, &e), CKPT_OK);
            if (e.kind == CKPT_ENTRY_TENSOR) {
                const void *data;
                assert_int_equal(ckpt_reader_tensor_view(r, e.key, &data, &e), CKPT_OK);
                assert_int_equal(ckpt_write_tensor(w, e.key, e.dtype, e.ndim, e.shape, data),
                                 CKPT_OK);
            } else if (e.kind == CKPT_ENTRY_F64) {
                double v;
                assert_int_equal(ckpt_read_f64(r, e.key, &v), CKPT_OK);
                if (variant == 0 && strcmp(e.key, "param_groups.0.lr") == 0) v = -0.5;
                if (variant == 1 && strcmp(e.key, "param_groups.0.betas.0") == 0) v = 1.0;
                assert_int_equal(ckpt_write_f64(w, e.key, v), CKPT_OK);
            } else if (e.kind == CKPT_ENTRY_I64) {
                int64_t v;
                assert_int_equal(ckpt_read_i64(r, e.key, &v), CKPT_OK);
                if (variant == 2 && strcmp(e.key, "param_groups.0.amsgrad") == 0) v = 1;
                assert_int_equal(ckpt_write_i64(w, e.key, v), CKPT_OK);
            } else {
                char s[64];
                assert_int_equal(ckpt_read_str(r, e.key, s, sizeof s), CKPT_OK);
                assert_int_equal(ckpt_write_str(w, e.key, s), CKPT_OK);
            }
        }
        assert_int_equal(ckpt_writer_save(w, path_of("bad.safetensors")), CKPT_OK);
        ckpt_writer_free(w);
        size_t n0, n1;
        char *before = state_bytes(o, "before.safetensors", &n0);
        float w0[6];
        memcpy(w0, f.w, sizeof w0);
        int rc = tu_load_state(ckpt_optimizer_ops(), o, path_of("bad.safetensors"));
        if (variant == 0) {
            assert_int_equal(rc, CKPT_ECORRUPT);
            tu_assert_errmsg_has("param_groups.0.lr: expected >= 0, got -0.5");
        } else if (variant == 1) {
            assert_int_equal(rc, CKPT_ECORRUPT);
            tu_assert_errmsg_has("betas.0");
        } else {
            assert_int_equal(rc, CKPT_EMISMATCH);
            tu_assert_errmsg_has("amsgrad");
        }
        char *after = state_bytes(o, "after.safetensors", &n1);
        tu_assert_bytes_equal(before, n0, after, n1);
        assert_memory_equal(w0, f.w, sizeof w0);
        free(before);
        free(after);
    }
    ckpt_reader_free(r);
    ckpt_optimizer_free(o);
    ckpt_model_free(f.m);
}

/* check_state_dict refuses what load_state_dict refuses (same code, same
 * message) and changes nothing: not the state, not the model; on a good
 * state it changes nothing either. */
static void test_check_state_dict_refuses_what_load_refuses_and_changes_nothing(void **state) {
    (void)state;
    const ckpt_stateful_ops *ops = ckpt_optimizer_ops();
    assert_non_null(ops->check_state_dict);
    enum { SGD, ADAM, ADAMW };
    static const struct {
        int src;
        const char *key;
        double v;
        int elem;
        int code;
        const char *needle;
    } cases[] = {
        {ADAM, NULL, 0, 0, CKPT_EMISMATCH,
         "optimizer: the state dict is for an adam optimizer, this one is adamw"},
        {SGD, NULL, 0, 0, CKPT_EMISMATCH,
         "optimizer: the state dict is for a sgd optimizer, this one is adamw"},
        {ADAMW, "param_groups.0.lr", -0.5, 0, CKPT_ECORRUPT,
         "param_groups.0.lr: expected >= 0, got -0.5"},
        {ADAMW, "param_groups.0.eps", -1, 0, CKPT_ECORRUPT, "param_groups.0.eps: expected >= 0"},
        {ADAMW, "param_groups.0.betas.1", 1, 0, CKPT_ECORRUPT,
         "param_groups.0.betas.1: expected in [0, 1), got 1"},
        {ADAMW, "param_groups.0.amsgrad", 1, 0, CKPT_EMISMATCH, "param_groups.0: the file's amsgrad"},
        {ADAMW, "param_groups.0.maximize", 2, 0, CKPT_ECORRUPT,
         "param_groups.0.maximize: expected 0 or 1, got 2"},
        {ADAMW, "state.1.step", 1.5, 0, CKPT_ECORRUPT,
         "state.1.step: expected a whole number >= 0, got 1.5"},
        {ADAMW, "state.0.step", -1, 0, CKPT_ECORRUPT,
         "state.0.step: expected a whole number >= 0, got -1"},
        {ADAMW, "param_groups.0.params", 0, 1, CKPT_EMISMATCH,
         "param_groups.0.params[1]: parameter 0 in file, 1 in memory"},
        {ADAMW, NULL, 0, 0, CKPT_OK, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fixture a, b;
        fixture_init(&a);
        fixture_init(&b);
        ckpt_optimizer *oa, *ob;
        if (cases[i].src == SGD) assert_int_equal(ckpt_sgd_new(&oa, a.m, 0.1, 0.9, 0, false), CKPT_OK);
        else if (cases[i].src == ADAM)
            assert_int_equal(ckpt_adam_new(&oa, a.m, 0.02, 0.8, 0.99, 1e-6, 0.0), CKPT_OK);
        else assert_int_equal(ckpt_adamw_new(&oa, a.m, 0.02, 0.8, 0.99, 1e-6, 0.1), CKPT_OK);
        assert_int_equal(ckpt_adamw_new(&ob, b.m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
        for (int t = 0; t < 2; t++) {
            grads(&a, t);
            assert_int_equal(ckpt_optimizer_step(oa), CKPT_OK);
        }
        grads(&b, 7);
        assert_int_equal(ckpt_optimizer_step(ob), CKPT_OK);
        tu_save_state(ops, oa, path_of("good.safetensors"));
        char bad[128];
        snprintf(bad, sizeof bad, "%s", path_of("bad.safetensors"));
        tu_copy_state_with(path_of("good.safetensors"), bad, cases[i].key, cases[i].v, cases[i].elem);
        size_t n0, n1;
        char *before = state_bytes(ob, "before.safetensors", &n0);
        float w0[6], b0[3];
        memcpy(w0, b.w, sizeof w0);
        memcpy(b0, b.b, sizeof b0);
        ckpt_reader *r;
        assert_int_equal(ckpt_reader_open(&r, bad), CKPT_OK);
        char msg[256];
        tu_check_state(ops, ob, r, cases[i].code, cases[i].needle, i, msg, sizeof msg);
        char *after = state_bytes(ob, "after.safetensors", &n1);
        tu_assert_bytes_equal(before, n0, after, n1);
        free(after);
        tu_load_state_like_check(ops, ob, r, cases[i].code, msg);
        if (cases[i].code != CKPT_OK) {
            after = state_bytes(ob, "after.safetensors", &n1);
            tu_assert_bytes_equal(before, n0, after, n1);
            free(after);
        } else {
            size_t ng;
            char *want = state_bytes(oa, "want.safetensors", &ng);
            after = state_bytes(ob, "after.safetensors", &n1);
            tu_assert_bytes_equal(want, ng, after, n1);
            free(want);
            free(after);
        }
        assert_memory_equal(w0, b.w, sizeof w0); /* a load never touches the parameters */
        assert_memory_equal(b0, b.b, sizeof b0);
        free(before);
        ckpt_reader_free(r);
        ckpt_optimizer_free(oa);
        ckpt_optimizer_free(ob);
        ckpt_model_free(a.m);
        ckpt_model_free(b.m);
    }
}

static void test_state_before_first_step_is_zeros_and_step_zero(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *o;
    assert_int_equal(ckpt_adamw_new(&o, f.m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    tu_save_state(ckpt_optimizer_ops(), o, path_of("o.safetensors"));
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, path_of("o.safetensors")), CKPT_OK);
    float step = -1, m[6] = {1};
    assert_int_equal(ckpt_read_tensor(r, "state.0.step", CKPT_F32, 0, NULL, &step), CKPT_OK);
    assert_true(step == 0.0f);
    int64_t s[2] = {2, 3};
    assert_int_equal(ckpt_read_tensor(r, "state.0.exp_avg", CKPT_F32, 2, s, m), CKPT_OK);
    for (int j = 0; j < 6; j++) assert_true(m[j] == 0.0f);
    char kind[16];
    assert_int_equal(ckpt_read_str(r, "kind", kind, sizeof kind), CKPT_OK);
    assert_string_equal(kind, "adamw");
    int64_t two = 2, pidx[2];
    assert_int_equal(ckpt_read_tensor(r, "param_groups.0.params", CKPT_I64, 1, &two, pidx),
                     CKPT_OK);
    assert_int_equal(pidx[0], 0);
    assert_int_equal(pidx[1], 1);
    ckpt_reader_free(r);
    ckpt_optimizer_free(o);
    ckpt_model_free(f.m);
}

/* The step count is PyTorch's state[p]["step"]: one per update, restored
 * by a load, settable for an optimizer whose update the caller runs. */
static void test_step_count_follows_updates_and_loads_and_can_be_set(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_optimizer *o, *back;
    assert_int_equal(ckpt_adamw_new(&o, f.m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    assert_int_equal(ckpt_optimizer_get_step(o), 0);
    for (int t = 0; t < 3; t++) {
        grads(&f, t);
        assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    }
    assert_int_equal(ckpt_optimizer_get_step(o), 3);
    tu_save_state(ckpt_optimizer_ops(), o, path_of("o.safetensors"));
    ckpt_reader *r;
    float step = -1;
    assert_int_equal(ckpt_reader_open(&r, path_of("o.safetensors")), CKPT_OK);
    assert_int_equal(ckpt_read_tensor(r, "state.1.step", CKPT_F32, 0, NULL, &step), CKPT_OK);
    assert_true(step == 3.0f);
    ckpt_reader_free(r);
    assert_int_equal(ckpt_adamw_new(&back, f.m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), back, path_of("o.safetensors")), CKPT_OK);
    assert_int_equal(ckpt_optimizer_get_step(back), 3);
    /* set: every parameter's count, saved as such */
    assert_int_equal(ckpt_optimizer_set_step(back, 1000), CKPT_OK);
    assert_int_equal(ckpt_optimizer_get_step(back), 1000);
    tu_save_state(ckpt_optimizer_ops(), back, path_of("o2.safetensors"));
    assert_int_equal(ckpt_reader_open(&r, path_of("o2.safetensors")), CKPT_OK);
    for (int i = 0; i < 2; i++) {
        char k[32];
        snprintf(k, sizeof k, "state.%d.step", i);
        assert_int_equal(ckpt_read_tensor(r, k, CKPT_F32, 0, NULL, &step), CKPT_OK);
        assert_true(step == 1000.0f);
    }
    ckpt_reader_free(r);
    /* a float32 counts exactly up to 2^24; nothing changes on a refusal */
    assert_int_equal(ckpt_optimizer_set_step(back, ((int64_t)1 << 24) + 1), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "2^24"));
    assert_int_equal(ckpt_optimizer_set_step(back, -1), CKPT_EINVAL);
    assert_int_equal(ckpt_optimizer_get_step(back), 1000);
    assert_int_equal(ckpt_optimizer_set_step(back, (int64_t)1 << 24), CKPT_OK);
    assert_int_equal(ckpt_optimizer_get_step(back), (int64_t)1 << 24);
    assert_int_equal(ckpt_optimizer_set_step(NULL, 1), CKPT_EINVAL);
    assert_int_equal(ckpt_optimizer_get_step(NULL), 0);
    /* a count set before the first step counts as a step: groups refuse */
    ckpt_optimizer *fresh;
    assert_int_equal(ckpt_sgd_new(&fresh, f.m, 0.1, 0.0, 0.0, false), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_step(fresh, 2), CKPT_OK);
    int groups[2] = {0, 0};
    ckpt_optim_options go = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    assert_int_equal(ckpt_optimizer_set_groups(fresh, 1, groups, &go), CKPT_EINVAL);
    assert_int_equal(ckpt_optimizer_set_step(fresh, 0), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_groups(fresh, 1, groups, &go), CKPT_OK);
    ckpt_optimizer_free(fresh);
    ckpt_optimizer_free(back);
    ckpt_optimizer_free(o);
    ckpt_model_free(f.m);
}

static void test_new_allocation_failures_are_clean(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    for (uint64_t n = 1;; n++) {
        ckpt_optimizer *o = NULL;
        ckpt__alloc_fail_after(n);
        int rc = ckpt_adamw_new(&o, f.m, 0.01, 0.9, 0.999, 1e-8, 0.01);
        if (rc == CKPT_OK) {
            int group_of[2] = {0, 1};
            ckpt_optim_options opts[2] = {ckpt_optim_defaults(CKPT_OPTIM_ADAMW),
                                          ckpt_optim_defaults(CKPT_OPTIM_ADAMW)};
            opts[1].amsgrad = true;
            rc = ckpt_optimizer_set_groups(o, 2, group_of, opts);
            if (rc != CKPT_OK) assert_int_equal(ckpt_optimizer_num_groups(o), 1);
        }
        ckpt__alloc_fail_after(0);
        if (rc == CKPT_OK) {
            assert_int_equal(ckpt_optimizer_num_groups(o), 2);
            ckpt_optimizer_free(o);
            break;
        }
        assert_int_equal(rc, CKPT_ENOMEM);
        ckpt_optimizer_free(o);
    }
    ckpt_model_free(f.m);
}

static void test_simd_and_portable_adam_loops_agree_bit_for_bit(void **state) {
    (void)state;
    enum { N = 37 }; /* four 8-lane blocks and a tail */
    float p[2][N], g[N];
    int64_t shape[1] = {N};
    for (int j = 0; j < N; j++) p[0][j] = p[1][j] = (float)sin(j * 0.61);
    ckpt_optim_options opt = ckpt_optim_defaults(CKPT_OPTIM_ADAM);
    opt.lr = 0.01;
    opt.weight_decay = 0.05;
    opt.amsgrad = true;
    opt.maximize = true;
    for (int kind = 0; kind < 2; kind++) {
        for (int k = 0; k < 2; k++) {
            ckpt_model *m;
            ckpt_optimizer *o;
            assert_int_equal(ckpt_model_new(&m), CKPT_OK);
            assert_int_equal(ckpt_model_add_param(m, "p", CKPT_F32, 1, shape, p[k], g), CKPT_OK);
            assert_int_equal(
                ckpt_optimizer_new(&o, kind ? CKPT_OPTIM_ADAMW : CKPT_OPTIM_ADAM, m, &opt),
                CKPT_OK);
            ckpt__optim_force_generic(k == 1);
            for (int t = 1; t <= 20; t++) {
                for (int j = 0; j < N; j++) g[j] = (float)cos(j * 0.37 + t * 1.3);
                assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
            }
            ckpt__optim_force_generic(false);
            ckpt_optimizer_free(o);
            ckpt_model_free(m);
        }
        assert_memory_equal(p[0], p[1], sizeof p[0]);
    }
}

/* ---- parameter names ------------------------------------------------------ */

/* Two parameters of one shape, registered in the given order. */
typedef struct pq {
    float p[4], gp[4], q[4], gq[4];
    ckpt_model *m;
    ckpt_optimizer *o;
} pq;

static void pq_init(pq *x, bool q_first) {
    memset(x, 0, sizeof *x);
    for (int j = 0; j < 4; j++) x->p[j] = 0.1f * (float)j, x->q[j] = -0.2f * (float)j;
    assert_int_equal(ckpt_model_new(&x->m), CKPT_OK);
    int64_t s[1] = {4};
    if (q_first) assert_int_equal(ckpt_model_add_param(x->m, "q", CKPT_F32, 1, s, x->q, x->gq), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(x->m, "p", CKPT_F32, 1, s, x->p, x->gp), CKPT_OK);
    if (!q_first) assert_int_equal(ckpt_model_add_param(x->m, "q", CKPT_F32, 1, s, x->q, x->gq), CKPT_OK);
    assert_int_equal(ckpt_adam_new(&x->o, x->m, 0.01, 0.9, 0.999, 1e-8, 0), CKPT_OK);
}

static void pq_step(pq *x, int t) {
    for (int j = 0; j < 4; j++) x->gp[j] = (float)sin(t + j), x->gq[j] = (float)cos(3 * t + j);
    assert_int_equal(ckpt_optimizer_step(x->o), CKPT_OK);
}

static void pq_free(pq *x) {
    ckpt_optimizer_free(x->o);
    ckpt_model_free(x->m);
}

/* Copies the state file at src to dst without its param_names entries: a
 * file as written before the names existed. */
static void strip_names(const char *src, const char *dst) {
    ckpt_reader *r;
    ckpt_writer *w;
    assert_int_equal(ckpt_reader_open(&r, src), CKPT_OK);
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    char sbuf[256];
    for (int64_t i = 0; i < ckpt_reader_count(r); i++) {
        ckpt_entry_info e;
        assert_int_equal(ckpt_reader_entry(r, i, &e), CKPT_OK);
        if (strncmp(e.key, "param_names.", 12) == 0) continue;
        if (e.kind == CKPT_ENTRY_TENSOR) {
            const void *d;
            assert_int_equal(ckpt_reader_tensor_view(r, e.key, &d, &e), CKPT_OK);
            assert_int_equal(ckpt_write_tensor(w, e.key, e.dtype, e.ndim, e.shape, d), CKPT_OK);
        } else if (e.kind == CKPT_ENTRY_STR) {
            assert_int_equal(ckpt_read_str(r, e.key, sbuf, sizeof sbuf), CKPT_OK);
            assert_int_equal(ckpt_write_str(w, e.key, sbuf), CKPT_OK);
        } else if (e.kind == CKPT_ENTRY_I64) {
            int64_t v;
            assert_int_equal(ckpt_read_i64(r, e.key, &v), CKPT_OK);
            assert_int_equal(ckpt_write_i64(w, e.key, v), CKPT_OK);
        } else {
            double v;
            assert_int_equal(ckpt_read_f64(r, e.key, &v), CKPT_OK);
            assert_int_equal(ckpt_write_f64(w, e.key, v), CKPT_OK);
        }
    }
    assert_int_equal(ckpt_writer_save(w, dst), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_reader_free(r);
}

/* The state file names each state index's parameter; a model that
 * registers its parameters in another order still gets each parameter's own
 * state (by position it would silently get the other's: same shapes). */
static void test_state_maps_by_parameter_name(void **state) {
    (void)state;
    pq a, b, ref;
    pq_init(&a, false); /* p, q */
    for (int t = 1; t <= 3; t++) pq_step(&a, t);
    char *path = tu_pathf("%s/opt.safetensors", tu_dir());
    tu_save_state(ckpt_optimizer_ops(), a.o, path);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    char name[16];
    assert_int_equal(ckpt_read_str(r, "param_names.0", name, sizeof name), CKPT_OK);
    assert_string_equal(name, "p");
    ckpt_reader_free(r);
    /* the same run continued with the parameters registered q, p */
    pq_init(&b, true);
    memcpy(b.p, a.p, sizeof a.p);
    memcpy(b.q, a.q, sizeof a.q);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), b.o, path), CKPT_OK);
    pq_init(&ref, false);
    memcpy(ref.p, a.p, sizeof a.p);
    memcpy(ref.q, a.q, sizeof a.q);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), ref.o, path), CKPT_OK);
    for (int t = 4; t <= 6; t++) pq_step(&b, t), pq_step(&ref, t);
    assert_memory_equal(b.p, ref.p, sizeof b.p);
    assert_memory_equal(b.q, ref.q, sizeof b.q);
    /* by-position permission does not override names */
    pq c;
    pq_init(&c, true);
    ckpt_optimizer_set_match_by_position(c.o, true);
    memcpy(c.p, a.p, sizeof a.p);
    memcpy(c.q, a.q, sizeof a.q);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), c.o, path), CKPT_OK);
    for (int t = 4; t <= 6; t++) pq_step(&c, t);
    assert_memory_equal(c.p, ref.p, sizeof c.p);
    assert_memory_equal(c.q, ref.q, sizeof c.q);
    /* a name this optimizer does not have: refused, nothing changed */
    pq d;
    memset(&d, 0, sizeof d);
    assert_int_equal(ckpt_model_new(&d.m), CKPT_OK);
    int64_t s4[1] = {4};
    assert_int_equal(ckpt_model_add_param(d.m, "p", CKPT_F32, 1, s4, d.p, d.gp), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(d.m, "r", CKPT_F32, 1, s4, d.q, d.gq), CKPT_OK);
    assert_int_equal(ckpt_adam_new(&d.o, d.m, 0.01, 0.9, 0.999, 1e-8, 0), CKPT_OK);
    size_t nb;
    char *before = state_bytes(d.o, "d0.safetensors", &nb);
    tu_expect_error(tu_load_state(ckpt_optimizer_ops(), d.o, path), CKPT_EMISMATCH,
                    "state for parameter 'q', which this optimizer does not optimize");
    size_t na;
    char *after = state_bytes(d.o, "d1.safetensors", &na);
    tu_assert_bytes_equal(before, nb, after, na);
    free(before);
    free(after);
    pq_free(&a), pq_free(&b), pq_free(&ref), pq_free(&c), pq_free(&d);
    free(path);
}

/* Through ckpt_load_state (whose schema check compares every key's shape
 * before the optimizer maps its state by name): a model that registers
 * parameters of different shapes in another order (b [3] before w [2,3])
 * loads the optimizer state of a run that registered w first, each
 * parameter getting its own. */
static void test_load_state_maps_differently_shaped_parameters_by_name(void **state) {
    (void)state;
    float w[6], gw[6], b[3], gb[3];
    int64_t sw[2] = {2, 3}, sb[1] = {3};
    ckpt_model *m1, *m2;
    ckpt_optimizer *o1, *o2;
    ckpt_accelerator *a1, *a2;
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    for (int j = 0; j < 6; j++) w[j] = 0.1f * (float)j;
    for (int j = 0; j < 3; j++) b[j] = -0.3f * (float)j;
    assert_int_equal(ckpt_model_new(&m1), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m1, "w", CKPT_F32, 2, sw, w, gw), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m1, "b", CKPT_F32, 1, sb, b, gb), CKPT_OK);
    assert_int_equal(ckpt_adamw_new(&o1, m1, 0.01, 0.9, 0.999, 1e-8, 0.1), CKPT_OK);
    for (int t = 1; t <= 3; t++) {
        for (int j = 0; j < 6; j++) gw[j] = (float)sin(t + j);
        for (int j = 0; j < 3; j++) gb[j] = (float)cos(t * 2 + j);
        assert_int_equal(ckpt_optimizer_step(o1), CKPT_OK);
    }
    assert_int_equal(ckpt_accelerator_new(&a1, &cfg), CKPT_OK);
    assert_int_equal(ckpt_prepare_model(a1, m1), CKPT_OK);
    assert_int_equal(ckpt_prepare_optimizer(a1, o1), CKPT_OK);
    char *dir = tu_pathf("%s/ck", tu_dir());
    assert_int_equal(ckpt_save_state(a1, dir), CKPT_OK);
    assert_int_equal(ckpt_model_new(&m2), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m2, "b", CKPT_F32, 1, sb, b, gb), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m2, "w", CKPT_F32, 2, sw, w, gw), CKPT_OK);
    assert_int_equal(ckpt_adamw_new(&o2, m2, 0.01, 0.9, 0.999, 1e-8, 0.1), CKPT_OK);
    assert_int_equal(ckpt_accelerator_new(&a2, &cfg), CKPT_OK);
    assert_int_equal(ckpt_prepare_model(a2, m2), CKPT_OK);
    assert_int_equal(ckpt_prepare_optimizer(a2, o2), CKPT_OK);
    assert_int_equal(ckpt_load_state(a2, dir), CKPT_OK);
    /* o2's state index 0 is b: it must hold o1's state 1 (b's), and so on */
    char *p1 = tu_pathf("%s/s1.safetensors", tu_dir()),
         *p2 = tu_pathf("%s/s2.safetensors", tu_dir());
    tu_save_state(ckpt_optimizer_ops(), o1, p1);
    tu_save_state(ckpt_optimizer_ops(), o2, p2);
    ckpt_reader *r1, *r2;
    assert_int_equal(ckpt_reader_open(&r1, p1), CKPT_OK);
    assert_int_equal(ckpt_reader_open(&r2, p2), CKPT_OK);
    static const char *const bufs[] = {"exp_avg", "exp_avg_sq"};
    for (int k = 0; k < 2; k++) {
        float x1[6], x2[6], y1[3], y2[3];
        char k1[64], k2[64];
        snprintf(k1, sizeof k1, "state.0.%s", bufs[k]);
        snprintf(k2, sizeof k2, "state.1.%s", bufs[k]);
        assert_int_equal(ckpt_read_tensor(r1, k1, CKPT_F32, 2, sw, x1), CKPT_OK);
        assert_int_equal(ckpt_read_tensor(r2, k2, CKPT_F32, 2, sw, x2), CKPT_OK);
        assert_memory_equal(x1, x2, sizeof x1);
        assert_int_equal(ckpt_read_tensor(r1, k2, CKPT_F32, 1, sb, y1), CKPT_OK);
        assert_int_equal(ckpt_read_tensor(r2, k1, CKPT_F32, 1, sb, y2), CKPT_OK);
        assert_memory_equal(y1, y2, sizeof y1);
    }
    ckpt_reader_free(r1);
    ckpt_reader_free(r2);
    ckpt_accelerator_free(a1);
    ckpt_accelerator_free(a2);
    ckpt_optimizer_free(o1);
    ckpt_optimizer_free(o2);
    ckpt_model_free(m1);
    ckpt_model_free(m2);
    free(dir);
    free(p1);
    free(p2);
}

typedef struct log_capture {
    int warnings;
    char last[600];
} log_capture;

static void capture_log(void *user, ckpt_log_level level, const char *msg) {
    log_capture *c = user;
    if (level == CKPT_LOG_WARNING) c->warnings++;
    snprintf(c->last, sizeof c->last, "%s", msg);
}

/* State without parameter names (as imported from a torch 1.13
 * optimizer.bin, which keeps none) into a model that registers two
 * same-shaped parameters in another order (q before p, as a C model with
 * ln.bias before ln.weight): a load by position would give each the other's
 * moments with CKPT_OK. It is refused, nothing changes, unless the caller
 * allows a load by position, which then says so in a warning. */
static void test_unnamed_state_is_refused_unless_by_position_is_allowed(void **state) {
    (void)state;
    pq a;
    pq_init(&a, false); /* p, q */
    for (int t = 1; t <= 3; t++) pq_step(&a, t);
    char *path = tu_pathf("%s/opt.safetensors", tu_dir());
    char *old = tu_pathf("%s/unnamed.safetensors", tu_dir());
    tu_save_state(ckpt_optimizer_ops(), a.o, path);
    strip_names(path, old);
    /* refused, by check and by load, and nothing changed */
    pq b;
    pq_init(&b, true); /* q, p */
    log_capture lc;
    memset(&lc, 0, sizeof lc);
    ckpt__optimizer_set_log(b.o, capture_log, &lc);
    size_t nb, na;
    char *before = state_bytes(b.o, "b0.safetensors", &nb);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, old), CKPT_OK);
    tu_expect_error(ckpt_optimizer_ops()->check_state_dict(b.o, r), CKPT_EMISMATCH,
                    "does not name its parameters");
    ckpt_reader_free(r);
    tu_expect_error(tu_load_state(ckpt_optimizer_ops(), b.o, old), CKPT_EMISMATCH,
                    "ckpt import --param-names FILE");
    tu_assert_errmsg_has("ckpt_optimizer_set_match_by_position");
    char *after = state_bytes(b.o, "b1.safetensors", &na);
    tu_assert_bytes_equal(before, nb, after, na);
    assert_int_equal(lc.warnings, 0);
    /* allowed by position: state index i to parameter i, with a warning */
    pq c;
    pq_init(&c, false);
    memset(&lc, 0, sizeof lc);
    ckpt__optimizer_set_log(c.o, capture_log, &lc);
    ckpt_optimizer_set_match_by_position(c.o, true);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), c.o, old), CKPT_OK);
    assert_int_equal(lc.warnings, 1);
    tu_assert_contains(lc.last, "matched by position");
    size_t n1, n2;
    char *s1 = state_bytes(c.o, "c.safetensors", &n1);
    char *s2 = state_bytes(a.o, "a.safetensors", &n2);
    tu_assert_bytes_equal(s1, n1, s2, n2);
    /* a named load logs nothing */
    memset(&lc, 0, sizeof lc);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), c.o, path), CKPT_OK);
    assert_int_equal(lc.warnings, 0);
    free(s1);
    free(s2);
    free(before);
    free(after);
    pq_free(&a), pq_free(&b), pq_free(&c);
    free(path);
    free(old);
}

int main(void) {
#define T(name) cmocka_unit_test_setup_teardown(name, tu_tmpdir_setup, tu_tmpdir_teardown)
    const struct CMUnitTest tests[] = {
        T(test_new_rejects_bad_hyperparameters),
        T(test_new_rejects_a_model_without_parameters),
        T(test_new_rejects_non_f32_parameters_naming_them),
        T(test_step_without_gradient_fails_and_changes_nothing),
        T(test_sgd_momentum_first_step_copies_gradient_then_dampens),
        T(test_adamw_first_step_moves_each_weight_by_lr_times_sign),
        T(test_zero_grad_and_learning_rate_accessors),
        T(test_set_groups_numbers_state_like_pytorch),
        T(test_adamw_amsgrad_resumes_bit_for_bit),
        T(test_adam_resumes_bit_for_bit),
        T(test_sgd_dampening_resumes_bit_for_bit_even_before_first_step),
        T(test_loading_sgd_state_into_adamw_is_a_mismatch_and_changes_nothing),
        T(test_load_rejects_bad_values_and_changes_nothing),
        T(test_check_state_dict_refuses_what_load_refuses_and_changes_nothing),
        T(test_state_before_first_step_is_zeros_and_step_zero),
        T(test_step_count_follows_updates_and_loads_and_can_be_set),
        T(test_new_allocation_failures_are_clean),
        T(test_simd_and_portable_adam_loops_agree_bit_for_bit),
        T(test_state_maps_by_parameter_name),
        T(test_unnamed_state_is_refused_unless_by_position_is_allowed),
        T(test_load_state_maps_differently_shaped_parameters_by_name),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
