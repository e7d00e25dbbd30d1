/* test_flexload.c — ckpt_load_state_ex: loading only some objects (the
 * others untouched byte for byte, the step left alone), non-strict keys with
 * the report of every missing and unexpected key, F32/F16/BF16 conversion
 * (the rounding checked against an independent nearest-value search over
 * all 2^16 narrow values and a million wide ones), key renaming by prefix
 * map and hook, and bad options refused before anything is read. */
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
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

/* ---- dtype conversion ------------------------------------------------------ */

/* The exact value of a narrow float, from its fields (no conversion code). */
static double f16_value(uint16_t h) {
    int e = (h >> 10) & 0x1f, m = h & 0x3ff;
    double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
    return (h & 0x8000) ? -v : v;
}
static double bf16_value(uint16_t h) {
    int e = (h >> 7) & 0xff, m = h & 0x7f;
    double v = e == 0 ? ldexp(m, -133) : e == 255 ? (m ? NAN : INFINITY) : ldexp(128 + m, e - 134);
    return (h & 0x8000) ? -v : v;
}
static float f32_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* h must be the nearest narrow value to x, ties to the even mantissa, and
 * infinity past the rounding boundary (max + half an ulp). */
static void check_nearest(float x, uint16_t h, double (*value)(uint16_t), double max,
                          double half_ulp_max) {
    double xv = x, hv = value(h);
    if (isnan(xv)) {
        assert_true(isnan(hv));
        return;
    }
    if (fabs(xv) >= max + half_ulp_max) {
        assert_true(isinf(hv) && (hv > 0) == (xv > 0));
        return;
    }
    assert_false(isinf(hv));
    /* neighbours in magnitude */
    uint16_t mag = h & 0x7fff, sign = h & 0x8000;
    double err = fabs(xv - hv);
    for (int d = -1; d <= 1; d += 2) {
        if (mag == 0 && d < 0) continue;
        uint16_t nb = (uint16_t)(sign | (uint16_t)(mag + d));
        double nv = value(nb);
        if (isinf(nv) || isnan(nv)) continue;
        double nerr = fabs(xv - nv);
        if (nerr < err) fail_msg("%a: got %#x (%a), %#x (%a) is nearer", xv, h, hv, nb, nv);
        if (nerr == err && (mag & 1)) fail_msg("%a: tie went to odd %#x", xv, h);
    }
}

static void test_convert_exhaustive(void **state) {
    (void)state;
    /* every narrow value widens exactly and narrows back to itself */
    for (uint32_t i = 0; i < 65536; i++) {
        uint16_t h = (uint16_t)i, back;
        float f;
        assert_int_equal(ckpt_dtype_convert(CKPT_F16, &h, CKPT_F32, &f, 1), CKPT_OK);
        double want = f16_value(h);
        if (isnan(want)) assert_true(isnan(f));
        else if (!((double)f == want && !signbit(f) == !signbit(want)))
            fail_msg("F16 %#x widened to %a, want %a", h, (double)f, want);
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, &f, CKPT_F16, &back, 1), CKPT_OK);
        if (!isnan(want)) assert_int_equal(back, h);
        else assert_true(isnan(f16_value(back)));
        assert_int_equal(ckpt_dtype_convert(CKPT_BF16, &h, CKPT_F32, &f, 1), CKPT_OK);
        want = bf16_value(h);
        if (isnan(want)) assert_true(isnan(f));
        else assert_true((double)f == want && !signbit(f) == !signbit(want));
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, &f, CKPT_BF16, &back, 1), CKPT_OK);
        if (!isnan(want)) assert_int_equal(back, h);
    }
    /* a million random F32 bit patterns, and every exponent's halfway points */
    uint64_t s = 0x9e3779b97f4a7c15ull;
    for (int i = 0; i < 1000000; i++) {
        s ^= s << 13, s ^= s >> 7, s ^= s << 17;
        uint32_t u = (uint32_t)s;
        if (i % 4 == 1) u = (u & 0xffffe000u) | 0x1000u; /* an F16 tie */
        if (i % 4 == 2) u = (u & 0xffff0000u) | 0x8000u; /* a BF16 tie */
        if (i % 4 == 3) u = (u & 0x87ffffffu) | 0x30000000u; /* around F16's range */
        float x = f32_of(u);
        uint16_t h, b;
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, &x, CKPT_F16, &h, 1), CKPT_OK);
        check_nearest(x, h, f16_value, 65504.0, 16.0);
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, &x, CKPT_BF16, &b, 1), CKPT_OK);
        check_nearest(x, b, bf16_value, ldexp(255, 120), ldexp(1, 119));
        /* F16 <-> BF16 rounds once, through the exact F32 */
        uint16_t hb, bh;
        assert_int_equal(ckpt_dtype_convert(CKPT_F16, &h, CKPT_BF16, &hb, 1), CKPT_OK);
        check_nearest((float)f16_value(h), hb, bf16_value, ldexp(255, 120), ldexp(1, 119));
        assert_int_equal(ckpt_dtype_convert(CKPT_BF16, &b, CKPT_F16, &bh, 1), CKPT_OK);
        if (!isnan(bf16_value(b))) check_nearest((float)bf16_value(b), bh, f16_value, 65504.0, 16.0);
    }
}

/* The documented examples (docs/CHECKPOINTS.md). */
static void test_convert_examples(void **state) {
    (void)state;
    struct {
        float x;
        uint16_t f16, bf16;
    } t[] = {
        {1.0f, 0x3c00, 0x3f80},
        {1.0f + 0x1p-11f, 0x3c00, 0x3f80},        /* F16 tie: to even (down) */
        {1.0f + 0x3p-11f, 0x3c02, 0x3f80},        /* F16 tie: to even (up) */
        {1.0f + 0x1p-8f, 0x3c04, 0x3f80},         /* BF16 tie: down to 1 */
        {1.0f + 0x3p-8f, 0x3c0c, 0x3f82},         /* BF16 tie: up */
        {65504.0f, 0x7bff, 0x4780},
        {65519.0f, 0x7bff, 0x4780},
        {65520.0f, 0x7c00, 0x4780},               /* F16 overflow: infinity */
        {0x1p-24f, 0x0001, 0x3380},               /* smallest F16 subnormal */
        {0x1p-25f, 0x0000, 0x3300},               /* tie with zero: even */
        {0x1.000002p-25f, 0x0001, 0x3300},
        {-0.0f, 0x8000, 0x8000},
        {INFINITY, 0x7c00, 0x7f80},
        {3.3895314e38f, 0x7c00, 0x7f7f},          /* largest BF16 */
        {3.40282347e38f, 0x7c00, 0x7f80},         /* FLT_MAX: BF16 infinity */
    };
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        uint16_t h, b;
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, &t[i].x, CKPT_F16, &h, 1), CKPT_OK);
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, &t[i].x, CKPT_BF16, &b, 1), CKPT_OK);
        if (h != t[i].f16 || b != t[i].bf16)
            fail_msg("case %zu (%a): F16 %#x (want %#x), BF16 %#x (want %#x)", i, (double)t[i].x, h,
                     t[i].f16, b, t[i].bf16);
    }
    float nan = NAN;
    uint16_t h;
    assert_int_equal(ckpt_dtype_convert(CKPT_F32, &nan, CKPT_F16, &h, 1), CKPT_OK);
    assert_true((h & 0x7c00) == 0x7c00 && (h & 0x3ff));
    int64_t i64 = 0;
    tu_expect_error(ckpt_dtype_convert(CKPT_I64, &i64, CKPT_F32, &h, 1), CKPT_EINVAL,
                    "only F32, F16 and BF16");
}

/* ---- a small run to checkpoint --------------------------------------------- */

/* A custom object: a counter and a vector. */
typedef struct counter {
    int64_t n;
    float v[4];
    bool refuse; /* check_state_dict refuses any file */
} counter;
static int counter_sd(void *self, ckpt_writer *w) {
    counter *c = self;
    int64_t shape[1] = {4};
    int rc = ckpt_write_i64(w, "n", c->n);
    return rc ? rc : ckpt_write_tensor(w, "v", CKPT_F32, 1, shape, c->v);
}
static int counter_lsd(void *self, ckpt_reader *r) {
    counter *c = self;
    int64_t shape[1] = {4};
    int rc = ckpt_read_i64(r, "n", &c->n);
    return rc ? rc : ckpt_read_tensor(r, "v", CKPT_F32, 1, shape, c->v);
}
static int counter_check(void *self, ckpt_reader *r) {
    (void)r;
    return ((counter *)self)->refuse ? CKPT_EMISMATCH : CKPT_OK;
}
static const ckpt_stateful_ops counter_ops = {counter_sd, counter_lsd, counter_check};

typedef struct run {
    ckpt_accelerator *acc;
    ckpt_model *model;
    ckpt_optimizer *opt;
    counter c;
    float w[6], g[6], b[3], gb[3], extra[2];
    uint16_t w16[6]; /* bf16 or f16 weights, for conversion */
} run;

enum { M_F32, M_BF16, M_F16, M_RENAMED, M_EXTRA, M_NO_B, M_BAD_SHAPE };

static void run_open(run *r, const char *dir, int kind, bool with_opt) {
    memset(r, 0, sizeof *r);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = dir;
    cfg.automatic_checkpoint_naming = true;
    assert_int_equal(ckpt_accelerator_new(&r->acc, &cfg), CKPT_OK);
    ckpt_accelerator_set_log(r->acc, NULL, NULL);
    assert_int_equal(ckpt_model_new(&r->model), CKPT_OK);
    int64_t ws[2] = {2, 3}, bs[1] = {3}, bad[2] = {3, 2}, es[1] = {2};
    const char *wn = kind == M_RENAMED ? "module.w" : "w";
    const char *bn = kind == M_RENAMED ? "module.b" : "b";
    if (kind == M_BF16 || kind == M_F16)
        assert_int_equal(ckpt_model_add_param(r->model, wn, kind == M_BF16 ? CKPT_BF16 : CKPT_F16,
                                              2, ws, r->w16, NULL),
                         CKPT_OK);
    else
        assert_int_equal(ckpt_model_add_param(r->model, wn, CKPT_F32, 2,
                                              kind == M_BAD_SHAPE ? bad : ws, r->w, r->g),
                         CKPT_OK);
    if (kind != M_NO_B)
        assert_int_equal(ckpt_model_add_param(r->model, bn, CKPT_F32, 1, bs, r->b, r->gb), CKPT_OK);
    if (kind == M_EXTRA)
        assert_int_equal(ckpt_model_add_param(r->model, "head", CKPT_F32, 1, es, r->extra, NULL),
                         CKPT_OK);
    assert_int_equal(ckpt_prepare_model(r->acc, r->model), CKPT_OK);
    if (with_opt) {
        assert_int_equal(ckpt_adam_new(&r->opt, r->model, 0.1, 0.9, 0.999, 1e-8, 0), CKPT_OK);
        assert_int_equal(ckpt_prepare_optimizer(r->acc, r->opt), CKPT_OK);
    }
    assert_int_equal(ckpt_register_for_checkpointing(r->acc, &counter_ops, &r->c), CKPT_OK);
    assert_int_equal(ckpt_set_seed(r->acc, 7), CKPT_OK);
}

static void run_close(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_optimizer_free(r->opt);
    ckpt_model_free(r->model);
}

static void fill(run *r, float base) {
    for (int i = 0; i < 6; i++) r->w[i] = base + 0.3f * (float)i + 0x1p-12f;
    for (int i = 0; i < 3; i++) r->b[i] = -base - (float)i;
    for (int i = 0; i < 2; i++) r->extra[i] = 100.0f + (float)i;
    for (int i = 0; i < 4; i++) r->c.v[i] = base * 2 + (float)i;
    r->c.n = (int64_t)base;
}

/* Saves a checkpoint of an F32 model {w, b} + Adam (stepped) + counter +
 * generator at step 42 into <dir>/src; returns its folder (free it). */
static char *make_checkpoint(const char *dir, int kind) {
    char *proj = tu_pathf("%s/src", dir);
    run r;
    run_open(&r, proj, kind, true);
    fill(&r, 1.0f);
    for (int i = 0; i < 6; i++) r.g[i] = 0.5f - 0.1f * (float)i;
    for (int i = 0; i < 3; i++) r.gb[i] = 0.25f;
    assert_int_equal(ckpt_optimizer_step(r.opt), CKPT_OK);
    ckpt_accelerator_set_step(r.acc, 42);
    assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_OK);
    char *out = strdup(ckpt_accelerator_last_dir(r.acc));
    run_close(&r);
    free(proj);
    return out;
}

static char *state_of(const ckpt_stateful_ops *ops, void *self, const char *dir, size_t *n) {
    char p[512];
    return tu_state_bytes(ops, self, tu_path(p, sizeof p, dir, "probe.safetensors"), n);
}

/* ---- selective loads -------------------------------------------------------- */

static void test_select_model_only(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32);
    char *proj = tu_pathf("%s/dst", tu_dir());
    run r;
    run_open(&r, proj, M_F32, true);
    fill(&r, 9.0f);
    ckpt_accelerator_set_step(r.acc, 5);
    size_t n0, n1;
    char *opt0 = state_of(ckpt_optimizer_ops(), r.opt, tu_dir(), &n0);
    ckpt_rng before = *ckpt_accelerator_rng(r.acc);
    counter cbefore = r.c;
    ckpt_load_options o = {.objects = CKPT_LOAD_MODELS};
    ckpt_load_report rep;
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    /* the model is the checkpoint's */
    run ref;
    char *refproj = tu_pathf("%s/ref", tu_dir());
    run_open(&ref, refproj, M_F32, true);
    assert_int_equal(ckpt_load_state(ref.acc, ck), CKPT_OK);
    tu_assert_bytes_equal(r.w, sizeof r.w, ref.w, sizeof ref.w);
    tu_assert_bytes_equal(r.b, sizeof r.b, ref.b, sizeof ref.b);
    /* the others untouched, byte for byte */
    char *opt1 = state_of(ckpt_optimizer_ops(), r.opt, tu_dir(), &n1);
    tu_assert_bytes_equal(opt0, n0, opt1, n1);
    tu_assert_bytes_equal(&cbefore, sizeof cbefore, &r.c, sizeof r.c);
    tu_assert_bytes_equal(&before, sizeof before, ckpt_accelerator_rng(r.acc), sizeof before);
    /* a partial load leaves the step and numbering alone */
    assert_int_equal(ckpt_accelerator_step(r.acc), 5);
    assert_int_equal(ckpt_accelerator_iteration(r.acc), 0);
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), "");
    assert_false(rep.full);
    assert_int_equal(rep.step, 42);
    assert_string_equal(rep.dir, ck);
    assert_int_equal(rep.num_loaded, 1);
    assert_string_equal(rep.loaded[0], "model");
    assert_int_equal(rep.num_skipped, 3);
    assert_string_equal(rep.skipped[0], "optimizer");
    assert_string_equal(rep.skipped[1], "custom_checkpoint_0");
    assert_string_equal(rep.skipped[2], "random_states");
    assert_int_equal(rep.num_missing + rep.num_unexpected + rep.num_converted + rep.num_renamed, 0);
    ckpt_load_report_free(&rep);
    /* saves are allowed and number from this project's own 0 */
    assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_OK);
    tu_assert_contains(ckpt_accelerator_last_dir(r.acc), "checkpoint_0");
    free(opt0);
    free(opt1);
    run_close(&ref);
    run_close(&r);
    free(refproj);
    free(proj);
    free(ck);
}

static void test_select_by_name_and_full(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32);
    char *proj = tu_pathf("%s/dst", tu_dir());
    run r;
    run_open(&r, proj, M_F32, true);
    fill(&r, 9.0f);
    float w0[6];
    memcpy(w0, r.w, sizeof w0);
    const char *names[] = {"custom_checkpoint_0", "random_states"};
    ckpt_load_options o = {.names = names, .num_names = 2};
    ckpt_load_report rep;
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    assert_int_equal(r.c.n, 1);
    tu_assert_bytes_equal(w0, sizeof w0, r.w, sizeof r.w); /* model untouched */
    assert_int_equal(rep.num_loaded, 2);
    ckpt_load_report_free(&rep);
    /* every bit set: a full load, as ckpt_load_state */
    o = (ckpt_load_options){.objects = CKPT_LOAD_ALL};
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    assert_true(rep.full);
    assert_int_equal(ckpt_accelerator_step(r.acc), 42);
    assert_int_equal(rep.num_skipped, 0);
    ckpt_load_report_free(&rep);
    /* report NULL is fine */
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_OK);
    run_close(&r);
    free(proj);
    free(ck);
}

/* ---- non-strict keys -------------------------------------------------------- */

static void test_non_strict(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32); /* file: w, b */
    char *proj = tu_pathf("%s/dst", tu_dir());
    run r;
    run_open(&r, proj, M_EXTRA, false); /* memory: w, b, head */
    fill(&r, 9.0f);
    ckpt_load_options o = {.objects = CKPT_LOAD_MODELS};
    float w0[6];
    memcpy(w0, r.w, sizeof w0);
    /* strict: refused, names the key, changes nothing */
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EMISMATCH, "'head' missing in file");
    tu_assert_contains(ckpt_errmsg(), "non-strict");
    tu_assert_bytes_equal(w0, sizeof w0, r.w, sizeof r.w);
    assert_int_equal(ckpt_accelerator_start_over(r.acc), CKPT_OK);
    o.non_strict = true;
    ckpt_load_report rep;
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    assert_true(r.w[0] != w0[0]);
    assert_true(r.extra[0] == 100.0f && r.extra[1] == 101.0f); /* kept */
    assert_int_equal(rep.num_missing, 1);
    assert_string_equal(rep.missing[0].object, "model");
    assert_string_equal(rep.missing[0].key, "head");
    assert_null(rep.missing[0].file_key);
    assert_int_equal(rep.num_unexpected, 0);
    ckpt_load_report_free(&rep);
    run_close(&r);

    /* memory lacks b: unexpected in the file */
    run_open(&r, proj, M_NO_B, false);
    fill(&r, 9.0f);
    o.non_strict = false;
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EMISMATCH,
                    "key 'b' in file (tensor) but not in memory");
    assert_int_equal(ckpt_accelerator_start_over(r.acc), CKPT_OK);
    o.non_strict = true;
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    assert_int_equal(rep.num_unexpected, 1);
    assert_string_equal(rep.unexpected[0].file_key, "b");
    assert_null(rep.unexpected[0].key);
    assert_int_equal(rep.unexpected[0].file_dtype, CKPT_F32);
    ckpt_load_report_free(&rep);
    run_close(&r);

    /* a shape difference is an error even non-strictly */
    run_open(&r, proj, M_BAD_SHAPE, false);
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EMISMATCH,
                    "tensor 'w': shape [2,3] in file, [3,2] in memory");
    run_close(&r);
    free(proj);
    free(ck);
}

/* A load that fails on the second object leaves the first untouched too. */
static void test_transactional(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32);
    char *proj = tu_pathf("%s/dst", tu_dir());
    run r;
    run_open(&r, proj, M_EXTRA, false);
    fill(&r, 9.0f);
    r.c.refuse = true;
    float w0[6];
    memcpy(w0, r.w, sizeof w0);
    ckpt_load_options o = {.objects = CKPT_LOAD_MODELS | CKPT_LOAD_CUSTOM, .non_strict = true};
    ckpt_load_report rep;
    int rc = ckpt_load_state_ex(r.acc, ck, &o, &rep);
    assert_int_equal(rc, CKPT_EMISMATCH);
    tu_assert_bytes_equal(w0, sizeof w0, r.w, sizeof r.w);
    assert_null(rep.loaded);
    assert_int_equal(rep.num_missing, 0);
    /* the failed load refuses saves, as ckpt_load_state's does */
    tu_expect_error(ckpt_save_state(r.acc, NULL), CKPT_EINVAL, NULL);
    run_close(&r);
    free(proj);
    free(ck);
}

/* ---- dtype conversion on load ------------------------------------------------ */

static void test_load_bf16_from_f32_and_back(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32);
    run ref;
    char *refproj = tu_pathf("%s/ref", tu_dir());
    run_open(&ref, refproj, M_F32, true);
    assert_int_equal(ckpt_load_state(ref.acc, ck), CKPT_OK);
    for (int dt = 0; dt < 2; dt++) {
        ckpt_dtype want = dt ? CKPT_F16 : CKPT_BF16;
        char *proj = tu_pathf("%s/dst%d", tu_dir(), dt);
        run r;
        run_open(&r, proj, dt ? M_F16 : M_BF16, false);
        ckpt_load_options o = {.objects = CKPT_LOAD_MODELS};
        tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EMISMATCH,
                        "convert_dtypes would convert it");
        assert_int_equal(ckpt_accelerator_start_over(r.acc), CKPT_OK);
        o.convert_dtypes = true;
        ckpt_load_report rep;
        assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
        uint16_t exp[6];
        assert_int_equal(ckpt_dtype_convert(CKPT_F32, ref.w, want, exp, 6), CKPT_OK);
        tu_assert_bytes_equal(exp, sizeof exp, r.w16, sizeof r.w16);
        assert_int_equal(rep.num_converted, 1);
        assert_string_equal(rep.converted[0].key, "w");
        assert_int_equal(rep.converted[0].file_dtype, CKPT_F32);
        assert_int_equal(rep.converted[0].dtype, want);
        ckpt_load_report_free(&rep);
        /* and back: the narrow checkpoint widens exactly */
        assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_OK);
        char *ck2 = strdup(ckpt_accelerator_last_dir(r.acc));
        char *proj2 = tu_pathf("%s/wide%d", tu_dir(), dt);
        run w;
        run_open(&w, proj2, M_F32, false);
        assert_int_equal(ckpt_load_state_ex(w.acc, ck2, &o, &rep), CKPT_OK);
        float back[6];
        assert_int_equal(ckpt_dtype_convert(want, r.w16, CKPT_F32, back, 6), CKPT_OK);
        tu_assert_bytes_equal(back, sizeof back, w.w, sizeof w.w);
        assert_false(rep.full); /* models only */
        ckpt_load_report_free(&rep);
        run_close(&w);
        run_close(&r);
        free(proj2);
        free(ck2);
        free(proj);
    }
    run_close(&ref);
    free(refproj);
    free(ck);
}

/* ---- renaming ----------------------------------------------------------------- */

static int rename_hook(void *user, const char *object, const char *key, char *out, size_t cap) {
    (void)user;
    if (strcmp(object, "model") != 0) return 0;
    if (strcmp(key, "b") == 0) return snprintf(out, cap, "module.b") > 0 ? 1 : CKPT_EINVAL;
    return 0;
}
static int failing_hook(void *user, const char *object, const char *key, char *out, size_t cap) {
    (void)user, (void)object, (void)key, (void)out, (void)cap;
    return CKPT_EIO;
}

static void test_rename(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32); /* file: w, b */
    char *proj = tu_pathf("%s/dst", tu_dir());
    run r;
    run_open(&r, proj, M_RENAMED, false); /* memory: module.w, module.b */
    ckpt_load_options o = {.objects = CKPT_LOAD_MODELS};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EMISMATCH,
                    "'module.w' missing in file");
    assert_int_equal(ckpt_accelerator_start_over(r.acc), CKPT_OK);
    ckpt_key_prefix pm[] = {{"w", "module.w"}, {"", "module."}};
    o.prefix_map = pm;
    o.num_prefix_map = 2;
    ckpt_load_report rep;
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    assert_int_equal(rep.num_renamed, 2);
    assert_string_equal(rep.renamed[0].key, "module.w");
    assert_string_equal(rep.renamed[0].file_key, "w");
    assert_string_equal(rep.renamed[1].key, "module.b");
    assert_string_equal(rep.renamed[1].file_key, "b");
    ckpt_load_report_free(&rep);
    run ref;
    char *refproj = tu_pathf("%s/ref", tu_dir());
    run_open(&ref, refproj, M_F32, true);
    assert_int_equal(ckpt_load_state(ref.acc, ck), CKPT_OK);
    tu_assert_bytes_equal(r.w, sizeof r.w, ref.w, sizeof ref.w);
    tu_assert_bytes_equal(r.b, sizeof r.b, ref.b, sizeof ref.b);
    /* two keys onto one name */
    ckpt_key_prefix clash[] = {{"w", "module.b"}, {"b", "module.b"}};
    o.prefix_map = clash;
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EMISMATCH,
                    "both become 'module.b'");
    assert_int_equal(ckpt_accelerator_start_over(r.acc), CKPT_OK);
    /* the hook, after the prefix map */
    ckpt_key_prefix only_w[] = {{"w", "module.w"}};
    o.prefix_map = only_w;
    o.num_prefix_map = 1;
    o.rename = rename_hook;
    assert_int_equal(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_OK);
    assert_int_equal(rep.num_renamed, 2);
    ckpt_load_report_free(&rep);
    o.rename = failing_hook;
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EIO, "rename hook");
    assert_int_equal(ckpt_accelerator_start_over(r.acc), CKPT_OK);
    /* a prefix map stripping a whole key leaves an invalid one */
    ckpt_key_prefix strip[] = {{"w", ""}};
    o.prefix_map = strip;
    o.rename = NULL;
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EINVAL, "key is empty");
    run_close(&ref);
    run_close(&r);
    free(refproj);
    free(proj);
    free(ck);
}

/* ---- bad options -------------------------------------------------------------- */

static void test_bad_options(void **state) {
    (void)state;
    char *ck = make_checkpoint(tu_dir(), M_F32);
    char *proj = tu_pathf("%s/dst", tu_dir());
    run r;
    run_open(&r, proj, M_F32, false);
    ckpt_load_report rep;
    ckpt_load_options o = {.objects = 0x80};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, &rep), CKPT_EINVAL, "unknown bits 0x80");
    assert_null(rep.dir);
    o = (ckpt_load_options){.objects = CKPT_LOAD_SCALERS};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EINVAL,
                    "select none of the registered objects");
    const char *bad[] = {"modle"};
    o = (ckpt_load_options){.names = bad, .num_names = 1};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EINVAL,
                    "'modle' is no registered object (there are: model, custom_checkpoint_0, "
                    "random_states)");
    o = (ckpt_load_options){.num_names = 1};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EINVAL, "names is NULL");
    ckpt_key_prefix pm[] = {{NULL, "x"}};
    o = (ckpt_load_options){.prefix_map = pm, .num_prefix_map = 1};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EINVAL, "prefix_map[0].from is NULL");
    o = (ckpt_load_options){.num_prefix_map = 2};
    tu_expect_error(ckpt_load_state_ex(r.acc, ck, &o, NULL), CKPT_EINVAL, "prefix_map is NULL");
    /* bad options are not a failed load: saves stay allowed */
    assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_OK);
    /* a selected object the checkpoint lacks */
    ckpt_load_options m = {.objects = CKPT_LOAD_MODELS};
    tu_expect_error(ckpt_load_state_ex(NULL, ck, &m, NULL), CKPT_EINVAL, "acc is NULL");
    run_close(&r);
    free(proj);
    free(ck);
}

/* ---- several processes -------------------------------------------------------- */

/* Two thread ranks, a ZeRO-sharded Adam: save at step 42, then load only the
 * model into BF16 parameters in a new project. Results per rank, checked
 * after the threads end (no cmocka inside them). */
typedef struct mp_state {
    char *dir;
    int save_rc[2], load_rc[2], conv[2], full[2];
    int64_t step_after[2];
    uint16_t w16[2][6];
    float w_saved[6];
} mp_state;

static int mp_open(run *r, const ckpt_comm *c, const char *proj, int kind) {
    memset(r, 0, sizeof *r);
    ckpt_project_config cfg = {.comm = c, .project_dir = proj, .automatic_checkpoint_naming = true};
    int64_t ws[2] = {2, 3}, bs[1] = {3};
    int rc = ckpt_accelerator_new(&r->acc, &cfg);
    if (rc == 0) rc = ckpt_model_new(&r->model);
    if (rc == 0)
        rc = kind == M_BF16 ? ckpt_model_add_param(r->model, "w", CKPT_BF16, 2, ws, r->w16, NULL)
                            : ckpt_model_add_param(r->model, "w", CKPT_F32, 2, ws, r->w, r->g);
    if (rc == 0) rc = ckpt_model_add_param(r->model, "b", CKPT_F32, 1, bs, r->b, r->gb);
    if (rc == 0) rc = ckpt_prepare_model(r->acc, r->model);
    if (rc == 0 && kind != M_BF16) rc = ckpt_adam_new(&r->opt, r->model, 0.1, 0.9, 0.999, 1e-8, 0);
    if (rc == 0 && r->opt) rc = ckpt_optimizer_set_shard(r->opt, c);
    if (rc == 0 && r->opt) rc = ckpt_prepare_optimizer(r->acc, r->opt);
    return rc;
}

static void mp_rank(const ckpt_comm *c, void *arg) {
    mp_state *st = arg;
    int k = c->rank;
    char *proj = tu_pathf("%s/mp_src", st->dir);
    run r;
    int rc = mp_open(&r, c, proj, M_F32);
    fill(&r, 1.0f);
    for (int i = 0; i < 6; i++) r.g[i] = 0.5f - 0.1f * (float)i;
    for (int i = 0; i < 3; i++) r.gb[i] = 0.25f;
    if (rc == 0) rc = ckpt_optimizer_step(r.opt);
    if (rc == 0) {
        ckpt_accelerator_set_step(r.acc, 42);
        rc = ckpt_save_state(r.acc, NULL);
    }
    st->save_rc[k] = rc;
    if (k == 0) memcpy(st->w_saved, r.w, sizeof st->w_saved);
    char *ck = rc == 0 ? strdup(ckpt_accelerator_last_dir(r.acc)) : NULL;
    run_close(&r);
    free(proj);
    proj = tu_pathf("%s/mp_dst", st->dir);
    run d;
    /* every step's status is checked: a failed save leaves no checkpoint to
     * load (and no report to read) */
    rc = mp_open(&d, c, proj, M_BF16);
    ckpt_load_options o = {.objects = CKPT_LOAD_MODELS, .convert_dtypes = true};
    ckpt_load_report rep;
    memset(&rep, 0, sizeof rep);
    if (rc == 0) rc = ck ? ckpt_load_state_ex(d.acc, ck, &o, &rep) : CKPT_ENOENT;
    st->load_rc[k] = rc;
    if (rc == 0) {
        st->conv[k] = (int)rep.num_converted;
        st->full[k] = rep.full;
        ckpt_load_report_free(&rep);
    }
    st->step_after[k] = ckpt_accelerator_step(d.acc);
    memcpy(st->w16[k], d.w16, sizeof d.w16);
    run_close(&d);
    free(proj);
    free(ck);
}

static void test_two_ranks(void **state) {
    (void)state;
    mp_state st;
    memset(&st, 0, sizeof st);
    st.dir = (char *)tu_dir();
    tc_run(2, mp_rank, &st);
    uint16_t want[6];
    assert_int_equal(ckpt_dtype_convert(CKPT_F32, st.w_saved, CKPT_BF16, want, 6), CKPT_OK);
    for (int k = 0; k < 2; k++) {
        assert_int_equal(st.save_rc[k], CKPT_OK);
        assert_int_equal(st.load_rc[k], CKPT_OK);
        assert_int_equal(st.conv[k], 1);
        assert_int_equal(st.full[k], 0);
        assert_int_equal(st.step_after[k], 0);
        tu_assert_bytes_equal(want, sizeof want, st.w16[k], sizeof st.w16[k]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_convert_exhaustive),
        cmocka_unit_test(test_convert_examples),
        cmocka_unit_test_setup_teardown(test_select_model_only, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_select_by_name_and_full, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_non_strict, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_transactional, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_load_bf16_from_f32_and_back, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_rename, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_bad_options, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_two_ranks, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
