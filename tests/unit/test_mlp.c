/* test_mlp.c — the demo's MLP (tools/mlp.c): backward agrees with finite
 * differences, loss scaling is exact, dropout draws what it says. */
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

/* the tool's source is compiled into this test: it is not part of the library */
#include "../../tools/mlp.c"

enum { IN = 5, H1 = 7, H2 = 6, OUT = 4, B = 3 };

static void fill_batch(float *x, int32_t *y) {
    ckpt_rng g;
    ckpt_rng_seed(&g, 99);
    for (int i = 0; i < B * IN; i++) x[i] = ckpt_rng_uniform_f32(&g);
    for (int b = 0; b < B; b++) y[b] = (int32_t)ckpt_rng_below(&g, OUT);
}

static void make_net(mlp *m) {
    assert_int_equal(mlp_init(m, IN, H1, H2, OUT, B), 0);
    ckpt_rng g;
    ckpt_rng_seed(&g, 7);
    mlp_init_params(m, &g);
}

/* Loss with dropout masks drawn from a generator in a fixed state, so every
 * evaluation sees the same masks. */
static float loss_at(mlp *m, const float *x, const int32_t *y, float p) {
    ckpt_rng g;
    ckpt_rng_seed(&g, 1234);
    return mlp_forward(m, x, y, B, p, &g);
}

static void check_gradient(float p) {
    mlp m;
    make_net(&m);
    float x[B * IN];
    int32_t y[B];
    fill_batch(x, y);

    memset(m.grads, 0, (size_t)m.num_params * sizeof(float));
    loss_at(&m, x, y, p);
    mlp_backward(&m, y, 1.0f);

    /* small enough not to cross a ReLU kink, large enough for fp32 */
    const float eps = 1e-3f;
    int64_t checked = 0;
    for (int64_t i = 0; i < m.num_params; i++) {
        float saved = m.params[i];
        m.params[i] = saved + eps;
        double up = loss_at(&m, x, y, p);
        m.params[i] = saved - eps;
        double down = loss_at(&m, x, y, p);
        m.params[i] = saved;
        double numeric = (up - down) / (2.0 * eps);
        double analytic = m.grads[i];
        if (fabs(numeric - analytic) > 2e-3 + 2e-2 * fabs(analytic)) {
            print_error("parameter %lld: analytic %.6g, numeric %.6g\n", (long long)i, analytic,
                        numeric);
            fail();
        }
        checked++;
    }
    assert_int_equal(checked, (int64_t)H1 * (IN + 1) + (int64_t)H2 * (H1 + 1) + (int64_t)OUT * (H2 + 1));
    mlp_free(&m);
}

static void test_mlp_gradient_matches_finite_differences(void **state) {
    (void)state;
    check_gradient(0.0f);
}

static void test_mlp_gradient_with_dropout_matches_finite_differences(void **state) {
    (void)state;
    check_gradient(0.3f);
}

static void test_mlp_backward_scales_gradients_exactly(void **state) {
    (void)state;
    mlp m;
    make_net(&m);
    float x[B * IN];
    int32_t y[B];
    fill_batch(x, y);
    size_t n = (size_t)m.num_params;
    float *plain = malloc(n * sizeof(float));
    assert_non_null(plain);

    memset(m.grads, 0, n * sizeof(float));
    loss_at(&m, x, y, 0.1f);
    mlp_backward(&m, y, 1.0f);
    memcpy(plain, m.grads, n * sizeof(float));

    memset(m.grads, 0, n * sizeof(float));
    loss_at(&m, x, y, 0.1f);
    mlp_backward(&m, y, 1024.0f);
    /* a power-of-two scale is exact in binary floating point */
    for (size_t i = 0; i < n; i++) assert_true(m.grads[i] == plain[i] * 1024.0f);
    free(plain);
    mlp_free(&m);
}

static void test_mlp_backward_accumulates_into_gradients(void **state) {
    (void)state;
    mlp m;
    make_net(&m);
    float x[B * IN];
    int32_t y[B];
    fill_batch(x, y);
    size_t n = (size_t)m.num_params;
    float *once = malloc(n * sizeof(float));
    assert_non_null(once);
    /* one row, so each gradient element gets a single term a pass and the
     * sum of two passes is exact */
    memset(m.grads, 0, n * sizeof(float));
    mlp_forward(&m, x, y, 1, 0.0f, NULL);
    mlp_backward(&m, y, 1.0f);
    memcpy(once, m.grads, n * sizeof(float));
    mlp_forward(&m, x, y, 1, 0.0f, NULL);
    mlp_backward(&m, y, 1.0f);
    for (size_t i = 0; i < n; i++) assert_true(m.grads[i] == once[i] + once[i]);
    free(once);
    mlp_free(&m);
}

static void test_mlp_zero_weights_give_uniform_prediction(void **state) {
    (void)state;
    mlp m;
    assert_int_equal(mlp_init(&m, IN, H1, H2, OUT, B), 0);
    float x[B * IN];
    int32_t y[B];
    fill_batch(x, y);
    float loss = mlp_forward(&m, x, y, B, 0.0f, NULL);
    assert_true(loss == (float)log((double)OUT));
    for (int i = 0; i < B * OUT; i++) assert_true(m.probs[i] == 0.25f);
    mlp_free(&m);
}

static void test_mlp_evaluation_draws_no_random_numbers(void **state) {
    (void)state;
    mlp m;
    make_net(&m);
    float x[B * IN];
    int32_t y[B];
    fill_batch(x, y);
    ckpt_rng g, before;
    ckpt_rng_seed(&g, 5);
    before = g;
    mlp_forward(&m, x, y, B, 0.0f, &g); /* p = 0: no dropout, no draws */
    assert_memory_equal(&g, &before, sizeof g);
    for (int l = 0; l < MLP_LAYERS - 1; l++)
        for (int i = 0; i < B * m.sizes[l + 1]; i++) assert_true(m.mask[l][i] == 1.0f);
    mlp_free(&m);
}

static void test_mlp_dropout_draws_one_number_per_hidden_unit(void **state) {
    (void)state;
    mlp m;
    make_net(&m);
    float x[B * IN];
    int32_t y[B];
    fill_batch(x, y);
    ckpt_rng g, expect;
    ckpt_rng_seed(&g, 5);
    ckpt_rng_seed(&expect, 5);
    mlp_forward(&m, x, y, B, 0.5f, &g);
    int zeros = 0, kept = 0;
    for (int l = 0; l < MLP_LAYERS - 1; l++) {
        for (int i = 0; i < B * m.sizes[l + 1]; i++) {
            float u = ckpt_rng_uniform_f32(&expect);
            float want = u < 0.5f ? 0.0f : 2.0f;
            assert_true(m.mask[l][i] == want);
            zeros += want == 0.0f;
            kept += want != 0.0f;
        }
    }
    assert_memory_equal(&g, &expect, sizeof g);
    assert_true(zeros > 0 && kept > 0);
    mlp_free(&m);
}

static void test_mlp_param_layout_matches_pytorch_linear(void **state) {
    (void)state;
    mlp m;
    assert_int_equal(mlp_init(&m, IN, H1, H2, OUT, B), 0);
    int64_t shape[2];
    assert_int_equal(mlp_param_shape(&m, 0, shape), 2);
    assert_int_equal(shape[0], H1);
    assert_int_equal(shape[1], IN);
    assert_int_equal(mlp_param_shape(&m, 5, shape), 1);
    assert_int_equal(shape[0], OUT);
    assert_string_equal(mlp_param_name(2), "fc2.weight");
    assert_null(mlp_param_name(6));
    assert_ptr_equal(mlp_param_data(&m, 0), m.params);
    assert_ptr_equal(mlp_param_data(&m, 1), m.params + H1 * IN);
    assert_ptr_equal(mlp_param_grad(&m, 5), m.grads + m.num_params - OUT);
    mlp_free(&m);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_mlp_gradient_matches_finite_differences),
        cmocka_unit_test(test_mlp_gradient_with_dropout_matches_finite_differences),
        cmocka_unit_test(test_mlp_backward_scales_gradients_exactly),
        cmocka_unit_test(test_mlp_backward_accumulates_into_gradients),
        cmocka_unit_test(test_mlp_zero_weights_give_uniform_prediction),
        cmocka_unit_test(test_mlp_evaluation_draws_no_random_numbers),
        cmocka_unit_test(test_mlp_dropout_draws_one_number_per_hidden_unit),
        cmocka_unit_test(test_mlp_param_layout_matches_pytorch_linear),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
