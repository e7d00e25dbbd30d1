/* test_scaler.c — dynamic loss scaling: unscale, skipped steps on inf/NaN,
 * backoff and growth, call-order errors, and the state dict. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "helpers/testutil.h"

typedef struct fixture {
    float p[3], g[3];
    ckpt_model *m;
    ckpt_optimizer *o;
} fixture;

static void fixture_init(fixture *f) {
    memset(f, 0, sizeof *f);
    f->p[0] = 1;
    f->p[1] = 2;
    f->p[2] = 3;
    assert_int_equal(ckpt_model_new(&f->m), CKPT_OK);
    int64_t s[1] = {3};
    assert_int_equal(ckpt_model_add_param(f->m, "p", CKPT_F32, 1, s, f->p, f->g), CKPT_OK);
    assert_int_equal(ckpt_sgd_new(&f->o, f->m, 0.5, 0, 0, false), CKPT_OK);
}

static void fixture_free(fixture *f) {
    ckpt_optimizer_free(f->o);
    ckpt_model_free(f->m);
}

static void scaled_grads(fixture *f, ckpt_grad_scaler *gs) {
    float s = (float)ckpt_grad_scaler_scale(gs);
    f->g[0] = 1 * s;
    f->g[1] = 2 * s;
    f->g[2] = 4 * s;
}

static void test_new_rejects_bad_arguments(void **state) {
    (void)state;
    ckpt_grad_scaler *gs = NULL;
    assert_int_equal(ckpt_grad_scaler_new(&gs, 0, 2, 0.5, 10), CKPT_EINVAL);
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1e39, 2, 0.5, 10), CKPT_EINVAL); /* not a float */
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1024, 1.0, 0.5, 10), CKPT_EINVAL);
    assert_string_equal(ckpt_errmsg(), "grad_scaler: growth_factor: expected > 1, got 1");
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1024, 2, 1.0, 10), CKPT_EINVAL);
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1024, 2, 0.5, 0), CKPT_EINVAL);
    assert_null(gs);
    assert_int_equal(ckpt_grad_scaler_new(&gs, 65536.0, 2.0, 0.5, 2000), CKPT_OK);
    assert_true(ckpt_grad_scaler_scale(gs) == 65536.0);
    ckpt_grad_scaler_free(gs);
    ckpt_grad_scaler_free(NULL);
}

static void test_unscale_divides_gradients_and_step_updates(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_grad_scaler *gs;
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1024, 2, 0.5, 100), CKPT_OK);
    scaled_grads(&f, gs);
    bool found = true, stepped = false;
    assert_int_equal(ckpt_grad_scaler_unscale(gs, f.o, &found), CKPT_OK);
    assert_false(found);
    assert_true(f.g[0] == 1 && f.g[1] == 2 && f.g[2] == 4);
    /* a second unscale in the same step is a usage error */
    assert_int_equal(ckpt_grad_scaler_unscale(gs, f.o, NULL), CKPT_EINVAL);
    assert_true(f.g[0] == 1);
    assert_int_equal(ckpt_grad_scaler_step(gs, f.o, &stepped), CKPT_OK);
    assert_true(stepped);
    assert_true(f.p[0] == 0.5f && f.p[1] == 1.0f && f.p[2] == 1.0f);
    assert_int_equal(ckpt_grad_scaler_step(gs, f.o, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_OK);
    assert_true(ckpt_grad_scaler_scale(gs) == 1024);
    /* update with nothing recorded since the last one */
    assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_EINVAL);
    ckpt_grad_scaler_free(gs);
    fixture_free(&f);
}

static void test_inf_or_nan_skips_the_step_and_backs_off(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_grad_scaler *gs;
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1024, 2, 0.5, 2), CKPT_OK);
    /* one clean step: tracker 1 */
    scaled_grads(&f, gs);
    assert_int_equal(ckpt_grad_scaler_step(gs, f.o, NULL), CKPT_OK);
    assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_OK);
    float p[3];
    memcpy(p, f.p, sizeof p);
    for (int k = 0; k < 2; k++) {
        scaled_grads(&f, gs);
        f.g[1] = k == 0 ? INFINITY : NAN;
        bool stepped = true;
        assert_int_equal(ckpt_grad_scaler_step(gs, f.o, &stepped), CKPT_OK);
        assert_false(stepped);
        assert_memory_equal(p, f.p, sizeof p);
        assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_OK);
    }
    assert_true(ckpt_grad_scaler_scale(gs) == 256); /* 1024 * 0.5 * 0.5 */
    /* the backoff reset the tracker: growth needs 2 more clean steps */
    for (int k = 0; k < 2; k++) {
        assert_true(ckpt_grad_scaler_scale(gs) == 256);
        scaled_grads(&f, gs);
        assert_int_equal(ckpt_grad_scaler_step(gs, f.o, NULL), CKPT_OK);
        assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_OK);
    }
    assert_true(ckpt_grad_scaler_scale(gs) == 512);
    ckpt_grad_scaler_free(gs);
    fixture_free(&f);
}

static void test_growth_never_overflows_to_infinity(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f);
    ckpt_grad_scaler *gs;
    assert_int_equal(ckpt_grad_scaler_new(&gs, FLT_MAX / 1.5, 2, 0.5, 1), CKPT_OK);
    float before = (float)ckpt_grad_scaler_scale(gs);
    f.g[0] = f.g[1] = f.g[2] = 0;
    assert_int_equal(ckpt_grad_scaler_step(gs, f.o, NULL), CKPT_OK);
    assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_OK);
    assert_true((float)ckpt_grad_scaler_scale(gs) == before);
    ckpt_grad_scaler_free(gs);
    fixture_free(&f);
}

static void test_state_dict_round_trip_with_pytorch_names(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "scaler.safetensors");
    fixture f;
    fixture_init(&f);
    ckpt_grad_scaler *a, *b;
    assert_int_equal(ckpt_grad_scaler_new(&a, 4096, 3.0, 0.25, 5), CKPT_OK);
    for (int k = 0; k < 3; k++) {
        scaled_grads(&f, a);
        if (k == 0) f.g[0] = INFINITY;
        assert_int_equal(ckpt_grad_scaler_step(a, f.o, NULL), CKPT_OK);
        assert_int_equal(ckpt_grad_scaler_update(a), CKPT_OK);
    }
    tu_save_state(ckpt_grad_scaler_ops(), a, path);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    double v;
    int64_t i;
    assert_int_equal(ckpt_read_f64(r, "scale", &v), CKPT_OK);
    assert_true(v == 1024);
    assert_int_equal(ckpt_read_f64(r, "growth_factor", &v), CKPT_OK);
    assert_true(v == 3.0);
    assert_int_equal(ckpt_read_f64(r, "backoff_factor", &v), CKPT_OK);
    assert_true(v == 0.25);
    assert_int_equal(ckpt_read_i64(r, "growth_interval", &i), CKPT_OK);
    assert_int_equal(i, 5);
    assert_int_equal(ckpt_read_i64(r, "_growth_tracker", &i), CKPT_OK);
    assert_int_equal(i, 2);
    assert_int_equal(ckpt_grad_scaler_new(&b, 65536, 2, 0.5, 2000), CKPT_OK);
    assert_int_equal(ckpt_grad_scaler_ops()->load_state_dict(b, r), CKPT_OK);
    ckpt_reader_free(r);
    /* both continue identically: 3 more clean steps grow once (tracker 2 -> 5) */
    for (int k = 0; k < 4; k++) {
        ckpt_grad_scaler *gs[2] = {a, b};
        for (int j = 0; j < 2; j++) {
            scaled_grads(&f, gs[j]);
            assert_int_equal(ckpt_grad_scaler_unscale(gs[j], f.o, NULL), CKPT_OK);
            assert_int_equal(ckpt_grad_scaler_update(gs[j]), CKPT_OK);
        }
        assert_true(ckpt_grad_scaler_scale(a) == ckpt_grad_scaler_scale(b));
        assert_true(ckpt_grad_scaler_scale(a) == (k < 2 ? 1024 : 3072));
    }
    ckpt_grad_scaler_free(a);
    ckpt_grad_scaler_free(b);
    fixture_free(&f);
}

static void test_load_rejects_bad_values_and_changes_nothing(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "bad.safetensors");
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_write_f64(w, "scale", 1024), CKPT_OK);
    assert_int_equal(ckpt_write_f64(w, "growth_factor", 0.5), CKPT_OK);
    assert_int_equal(ckpt_write_f64(w, "backoff_factor", 0.5), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "growth_interval", 10), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "_growth_tracker", 0), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_grad_scaler *gs;
    assert_int_equal(ckpt_grad_scaler_new(&gs, 8, 2, 0.5, 3), CKPT_OK);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    assert_int_equal(ckpt_grad_scaler_ops()->load_state_dict(gs, r), CKPT_ECORRUPT);
    tu_assert_errmsg_has("growth_factor");
    ckpt_reader_free(r);
    assert_true(ckpt_grad_scaler_scale(gs) == 8);
    ckpt_grad_scaler_free(gs);
}

/* The scaler's saved state as the bytes of its state dict file. */
static char *scaler_bytes(ckpt_grad_scaler *gs, size_t *n) {
    char path[128];
    return tu_state_bytes(ckpt_grad_scaler_ops(), gs, tu_path(path, sizeof path, tu_dir(), "snap.safetensors"), n);
}

/* check_state_dict refuses what load_state_dict refuses (same code, same
 * message) and changes nothing: not the saved state, not the step in
 * progress (a load starts a fresh step, a check must not). */
static void test_check_state_dict_refuses_what_load_refuses_and_changes_nothing(void **state) {
    (void)state;
    const ckpt_stateful_ops *ops = ckpt_grad_scaler_ops();
    assert_non_null(ops->check_state_dict);
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "check.safetensors");
    static const struct {
        double scale, gf, bf;
        int64_t gi, gt;
        int code;
        const char *needle;
    } cases[] = {
        {0, 2, 0.5, 10, 0, CKPT_ECORRUPT, "grad_scaler: scale: expected a finite float32 > 0, got 0"},
        {-4, 2, 0.5, 10, 0, CKPT_ECORRUPT, "scale: expected a finite float32 > 0, got -4"},
        {1e300, 2, 0.5, 10, 0, CKPT_ECORRUPT, "scale: expected a finite float32 > 0"},
        {1024, 0.5, 0.5, 10, 0, CKPT_ECORRUPT, "growth_factor: expected > 1, got 0.5"},
        {1024, 2, 1.5, 10, 0, CKPT_ECORRUPT, "backoff_factor: expected in (0, 1), got 1.5"},
        {1024, 2, 0.5, 0, 0, CKPT_ECORRUPT, "growth_interval: expected >= 1, got 0"},
        {1024, 2, 0.5, 10, 10, CKPT_ECORRUPT, "_growth_tracker: expected 0..9, got 10"},
        {1024, 2, 0.5, 10, 3, CKPT_OK, ""},
    };
    fixture f;
    fixture_init(&f);
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        ckpt_writer *w;
        assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
        assert_int_equal(ckpt_write_f64(w, "scale", cases[i].scale), CKPT_OK);
        assert_int_equal(ckpt_write_f64(w, "growth_factor", cases[i].gf), CKPT_OK);
        assert_int_equal(ckpt_write_f64(w, "backoff_factor", cases[i].bf), CKPT_OK);
        assert_int_equal(ckpt_write_i64(w, "growth_interval", cases[i].gi), CKPT_OK);
        assert_int_equal(ckpt_write_i64(w, "_growth_tracker", cases[i].gt), CKPT_OK);
        assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
        ckpt_writer_free(w);
        ckpt_grad_scaler *gs;
        assert_int_equal(ckpt_grad_scaler_new(&gs, 8, 2, 0.5, 3), CKPT_OK);
        scaled_grads(&f, gs);
        assert_int_equal(ckpt_grad_scaler_unscale(gs, f.o, NULL), CKPT_OK);
        size_t n0, n1;
        char *before = scaler_bytes(gs, &n0);
        ckpt_reader *r;
        assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
        char msg[256];
        tu_check_state(ops, gs, r, cases[i].code, cases[i].needle, i, msg, sizeof msg);
        char *after = scaler_bytes(gs, &n1);
        tu_assert_bytes_equal(before, n0, after, n1);
        free(after);
        /* the step in progress is still there: unscaling twice is refused */
        assert_int_equal(ckpt_grad_scaler_unscale(gs, f.o, NULL), CKPT_EINVAL);
        tu_load_state_like_check(ops, gs, r, cases[i].code, msg);
        if (cases[i].code != CKPT_OK) {
            after = scaler_bytes(gs, &n1);
            tu_assert_bytes_equal(before, n0, after, n1);
            free(after);
        } else {
            assert_true(ckpt_grad_scaler_scale(gs) == 1024);
        }
        free(before);
        ckpt_reader_free(r);
        ckpt_grad_scaler_free(gs);
    }
    fixture_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_new_rejects_bad_arguments),
        cmocka_unit_test(test_unscale_divides_gradients_and_step_updates),
        cmocka_unit_test(test_inf_or_nan_skips_the_step_and_backs_off),
        cmocka_unit_test(test_growth_never_overflows_to_infinity),
        cmocka_unit_test_setup_teardown(test_state_dict_round_trip_with_pytorch_names, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_load_rejects_bad_values_and_changes_nothing, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_check_state_dict_refuses_what_load_refuses_and_changes_nothing, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
