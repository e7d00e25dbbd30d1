/* test_sched.c — learning-rate schedulers: PyTorch's values on hand-checked
 * cases, construction at step 0, state dicts that resume exactly, and
 * argument checks (the 50-step comparison with PyTorch is in
 * test_torch_numerics.py). */
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
#include "helpers/testutil.h"

typedef struct fixture {
    float p[2], g[2];
    ckpt_model *m;
    ckpt_optimizer *o;
} fixture;

static void fixture_init(fixture *f, double lr0, double lr1) {
    memset(f, 0, sizeof *f);
    assert_int_equal(ckpt_model_new(&f->m), CKPT_OK);
    int64_t s[1] = {1};
    assert_int_equal(ckpt_model_add_param(f->m, "a", CKPT_F32, 1, s, &f->p[0], &f->g[0]), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(f->m, "b", CKPT_F32, 1, s, &f->p[1], &f->g[1]), CKPT_OK);
    assert_int_equal(ckpt_sgd_new(&f->o, f->m, lr0, 0, 0, false), CKPT_OK);
    int group_of[2] = {0, 1};
    ckpt_optim_options opts[2] = {ckpt_optim_defaults(CKPT_OPTIM_SGD),
                                  ckpt_optim_defaults(CKPT_OPTIM_SGD)};
    opts[0].lr = lr0;
    opts[1].lr = lr1;
    assert_int_equal(ckpt_optimizer_set_groups(f->o, 2, group_of, opts), CKPT_OK);
}

static void fixture_free(fixture *f) {
    ckpt_optimizer_free(f->o);
    ckpt_model_free(f->m);
}

static void test_steplr_halves_every_step_size_steps(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 0.1, 0.4);
    ckpt_scheduler *s;
    assert_int_equal(ckpt_steplr_new(&s, f.o, 2, 0.5), CKPT_OK);
    const double want0[] = {0.1, 0.1, 0.1 * 0.5, 0.1 * 0.5, 0.1 * 0.5 * 0.5, 0.1 * 0.5 * 0.5};
    for (int t = 0; t < 6; t++) {
        if (t > 0) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
        assert_true(ckpt_optimizer_get_lr(f.o, 0) == want0[t]);
        assert_true(ckpt_scheduler_last_lr(s, 0) == want0[t]);
        assert_true(ckpt_optimizer_get_lr(f.o, 1) == want0[t] * 4);
    }
    ckpt_scheduler_free(s);
    ckpt_scheduler_free(NULL);
    fixture_free(&f);
}

static void test_multisteplr_applies_repeated_milestones_at_once(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 1.0, 2.0);
    ckpt_scheduler *s;
    const int64_t ms[3] = {2, 4, 4};
    assert_int_equal(ckpt_multisteplr_new(&s, f.o, 3, ms, 0.1), CKPT_OK);
    const double want[] = {1.0, 1.0, 0.1, 0.1, 0.1 * pow(0.1, 2), 0.1 * pow(0.1, 2)};
    for (int t = 0; t < 6; t++) {
        if (t > 0) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
        assert_true(ckpt_optimizer_get_lr(f.o, 0) == want[t]);
    }
    ckpt_scheduler_free(s);
    fixture_free(&f);
}

static void test_warmup_schedules_start_at_zero_on_construction(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 0.1, 0.2);
    ckpt_scheduler *s;
    assert_int_equal(ckpt_warmup_cosine_new(&s, f.o, 4, 10), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(f.o, 0) == 0.0);
    assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(f.o, 0) == 0.1 * (1.0 / 4.0));
    for (int t = 2; t <= 4; t++) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(f.o, 0) == 0.1); /* cos(0) = 1 at the peak */
    for (int t = 5; t <= 10; t++) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(f.o, 0) == 0.0); /* cos(pi) at total */
    /* past total transformers' formula rises again (it is periodic): so do we */
    for (int t = 11; t <= 12; t++) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
    assert_true(ckpt_optimizer_get_lr(f.o, 0) == 0.1 * (0.5 * (1.0 + cos(M_PI * (8.0 / 6.0)))));
    ckpt_scheduler_free(s);
    /* the next scheduler's base is the current rate (0 now), as in PyTorch */
    assert_int_equal(ckpt_optimizer_set_lr(f.o, 0, 0.3), CKPT_OK);
    assert_int_equal(ckpt_warmup_linear_new(&s, f.o, 2, 4), CKPT_OK);
    const double want[] = {0.0, 0.3 * 0.5, 0.3, 0.3 * 0.5, 0.0, 0.0};
    for (int t = 0; t < 6; t++) {
        if (t > 0) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
        assert_true(ckpt_optimizer_get_lr(f.o, 0) == want[t]);
    }
    ckpt_scheduler_free(s);
    fixture_free(&f);
}

static void test_cosine_follows_pytorch_recursive_form(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 0.1, 0.1);
    ckpt_scheduler *s;
    assert_int_equal(ckpt_cosinelr_new(&s, f.o, 4, 0.0), CKPT_OK);
    double lr = 0.1;
    for (int e = 1; e <= 12; e++) {
        assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
        /* PyTorch's get_lr(), operation for operation */
        if ((((e - 1 - 4) % 8) + 8) % 8 == 0)
            lr = lr + (0.1 - 0.0) * (1 - cos(M_PI / 4)) / 2;
        else
            lr = (1 + cos(M_PI * e / 4)) / (1 + cos(M_PI * (e - 1) / 4)) * (lr - 0.0) + 0.0;
        assert_true(ckpt_optimizer_get_lr(f.o, 0) == lr);
    }
    ckpt_scheduler_free(s);
    fixture_free(&f);
}

static void test_constructors_reject_bad_arguments(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 0.1, 0.1);
    ckpt_scheduler *s = NULL;
    assert_int_equal(ckpt_steplr_new(&s, f.o, 0, 0.5), CKPT_EINVAL);
    assert_string_equal(ckpt_errmsg(), "steplr: step_size: expected >= 1, got 0");
    assert_int_equal(ckpt_steplr_new(&s, f.o, 1, -0.5), CKPT_EINVAL);
    assert_int_equal(ckpt_cosinelr_new(&s, f.o, 0, 0), CKPT_EINVAL);
    assert_int_equal(ckpt_warmup_cosine_new(&s, f.o, 10, 5), CKPT_EINVAL);
    assert_int_equal(ckpt_warmup_linear_new(&s, f.o, -1, 5), CKPT_EINVAL);
    const int64_t bad[1] = {-3};
    assert_int_equal(ckpt_multisteplr_new(&s, f.o, 1, bad, 0.1), CKPT_EINVAL);
    assert_int_equal(ckpt_steplr_new(&s, NULL, 1, 0.5), CKPT_EINVAL);
    assert_null(s);
    assert_true(ckpt_optimizer_get_lr(f.o, 0) == 0.1);
    fixture_free(&f);
}

static void test_every_kind_resumes_exactly_after_state_dict(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "scheduler.safetensors");
    static const int64_t ms[2] = {3, 9};
    for (int kind = 0; kind < 7; kind++) {
        fixture a, b;
        ckpt_scheduler *sa = NULL, *sb = NULL;
        fixture_init(&a, 0.1, 0.05);
        fixture_init(&b, 0.7, 0.3); /* different rates: the file must win */
        ckpt_scheduler **ss[2] = {&sa, &sb};
        fixture *fs[2] = {&a, &b};
        for (int i = 0; i < 2; i++) {
            int rc;
            switch (kind) {
            case 0: rc = ckpt_steplr_new(ss[i], fs[i]->o, 3, 0.5); break;
            case 1: rc = ckpt_multisteplr_new(ss[i], fs[i]->o, 2, ms, 0.3); break;
            case 2: rc = ckpt_exponentiallr_new(ss[i], fs[i]->o, 0.9); break;
            case 3: rc = ckpt_cosinelr_new(ss[i], fs[i]->o, 5, 0.001); break;
            case 4: rc = ckpt_warmup_cosine_new(ss[i], fs[i]->o, 3, 15); break;
            case 5: rc = ckpt_warmup_linear_new(ss[i], fs[i]->o, 3, 15); break;
            default: rc = ckpt_constant_new(ss[i], fs[i]->o, 4); break;
            }
            assert_int_equal(rc, CKPT_OK);
        }
        for (int t = 0; t < 7; t++) assert_int_equal(ckpt_scheduler_step(sa), CKPT_OK);
        tu_save_state(ckpt_scheduler_ops(), sa, path);
        assert_int_equal(tu_load_state(ckpt_scheduler_ops(), sb, path), CKPT_OK);
        /* the optimizer's rates are the optimizer's state; copy them as its
         * own state dict would */
        for (int g = 0; g < 2; g++)
            assert_int_equal(ckpt_optimizer_set_lr(b.o, g, ckpt_optimizer_get_lr(a.o, g)), CKPT_OK);
        for (int g = 0; g < 2; g++)
            assert_true(ckpt_scheduler_last_lr(sb, g) == ckpt_scheduler_last_lr(sa, g));
        for (int t = 0; t < 15; t++) {
            assert_int_equal(ckpt_scheduler_step(sa), CKPT_OK);
            assert_int_equal(ckpt_scheduler_step(sb), CKPT_OK);
            for (int g = 0; g < 2; g++)
                assert_true(ckpt_optimizer_get_lr(a.o, g) == ckpt_optimizer_get_lr(b.o, g));
        }
        ckpt_scheduler_free(sa);
        ckpt_scheduler_free(sb);
        fixture_free(&a);
        fixture_free(&b);
    }
}

static void test_loading_another_kind_is_a_mismatch_and_changes_nothing(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "scheduler.safetensors");
    fixture f;
    fixture_init(&f, 0.1, 0.1);
    ckpt_scheduler *step, *cos;
    assert_int_equal(ckpt_steplr_new(&step, f.o, 3, 0.5), CKPT_OK);
    tu_save_state(ckpt_scheduler_ops(), step, path);
    assert_int_equal(ckpt_cosinelr_new(&cos, f.o, 10, 0), CKPT_OK);
    assert_int_equal(ckpt_scheduler_step(cos), CKPT_OK);
    double before = ckpt_scheduler_last_lr(cos, 0);
    assert_int_equal(tu_load_state(ckpt_scheduler_ops(), cos, path), CKPT_EMISMATCH);
    assert_string_equal(ckpt_errmsg(),
                        "scheduler: the state dict is for steplr, this scheduler is "
                        "cosineannealinglr");
    assert_true(ckpt_scheduler_last_lr(cos, 0) == before);
    ckpt_scheduler_free(step);
    ckpt_scheduler_free(cos);
    fixture_free(&f);
}

static ckpt_scheduler *make_kind(int kind, ckpt_optimizer *o) {
    static const int64_t ms[2] = {3, 9};
    ckpt_scheduler *s = NULL;
    int rc;
    switch (kind) {
    case 0: rc = ckpt_steplr_new(&s, o, 3, 0.5); break;
    case 1: rc = ckpt_multisteplr_new(&s, o, 2, ms, 0.3); break;
    case 2: rc = ckpt_exponentiallr_new(&s, o, 0.9); break;
    case 3: rc = ckpt_cosinelr_new(&s, o, 5, 0.001); break;
    case 4: rc = ckpt_warmup_cosine_new(&s, o, 3, 15); break;
    case 5: rc = ckpt_warmup_linear_new(&s, o, 3, 15); break;
    default: rc = ckpt_constant_new(&s, o, 4); break;
    }
    assert_int_equal(rc, CKPT_OK);
    return s;
}

/* The scheduler's state and its optimizer's rates, as bytes. */
static char *sched_bytes(ckpt_scheduler *s, ckpt_optimizer *o, size_t *n) {
    char path[128];
    char *buf = tu_state_bytes(ckpt_scheduler_ops(), s, tu_path(path, sizeof path, tu_dir(), "snap.safetensors"), n);
    buf = realloc(buf, *n + 2 * sizeof(double));
    assert_non_null(buf);
    for (int g = 0; g < 2; g++) {
        double lr = ckpt_optimizer_get_lr(o, g);
        memcpy(buf + *n, &lr, sizeof lr);
        *n += sizeof lr;
    }
    return buf;
}

/* check_state_dict refuses what load_state_dict refuses (same code, same
 * message), changing nothing; on a good state it changes nothing either. */
static void test_check_state_dict_refuses_what_load_refuses_and_changes_nothing(void **state) {
    (void)state;
    const ckpt_stateful_ops *ops = ckpt_scheduler_ops();
    assert_non_null(ops->check_state_dict);
    char good[128], bad[128];
    tu_path(good, sizeof good, tu_dir(), "good.safetensors");
    tu_path(bad, sizeof bad, tu_dir(), "bad.safetensors");
    static const struct {
        int src, dst; /* kinds as in make_kind */
        const char *key;
        double v;
        int elem;
        int code;
        const char *needle;
    } cases[] = {
        {5, 4, NULL, 0, 0, CKPT_EMISMATCH,
         "scheduler: the state dict is for warmup_linear, this scheduler is warmup_cosine"},
        {0, 0, "last_epoch", -1, 0, CKPT_ECORRUPT, "scheduler: last_epoch: expected >= 0, got -1"},
        {0, 0, "base_lrs.1", -0.5, 0, CKPT_ECORRUPT, "scheduler: base_lrs.1: expected >= 0, got -0.5"},
        {4, 4, NULL, 0, 0, CKPT_OK, ""},
        /* The schedule's parameters are the constructor's: the file's copies
         * are never read, so even impossible ones change nothing. */
        {0, 0, "step_size", 0, 0, CKPT_OK, ""},
        {0, 0, "gamma", NAN, 0, CKPT_OK, ""},
        {1, 1, "milestones", -1, 1, CKPT_OK, ""},
        {3, 3, "T_max", 0, 0, CKPT_OK, ""},
        {4, 4, "total", 2, 0, CKPT_OK, ""},
        {6, 6, "warmup", -2, 0, CKPT_OK, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        fixture a, b;
        fixture_init(&a, 0.1, 0.05);
        fixture_init(&b, 0.7, 0.3);
        ckpt_scheduler *sa = make_kind(cases[i].src, a.o), *sb = make_kind(cases[i].dst, b.o);
        for (int t = 0; t < 5; t++) assert_int_equal(ckpt_scheduler_step(sa), CKPT_OK);
        assert_int_equal(ckpt_scheduler_step(sb), CKPT_OK);
        tu_save_state(ckpt_scheduler_ops(), sa, good);
        tu_copy_state_with(good, bad, cases[i].key, cases[i].v, cases[i].elem);
        size_t n0, n1;
        char *before = sched_bytes(sb, b.o, &n0);
        ckpt_reader *r;
        assert_int_equal(ckpt_reader_open(&r, bad), CKPT_OK);
        char msg[256];
        tu_check_state(ops, sb, r, cases[i].code, cases[i].needle, i, msg, sizeof msg);
        char *after = sched_bytes(sb, b.o, &n1);
        tu_assert_bytes_equal(before, n0, after, n1);
        free(after);
        tu_load_state_like_check(ops, sb, r, cases[i].code, msg);
        if (cases[i].code != CKPT_OK) {
            after = sched_bytes(sb, b.o, &n1);
            tu_assert_bytes_equal(before, n0, after, n1);
            free(after);
        } else {
            for (int g = 0; g < 2; g++)
                assert_true(ckpt_scheduler_last_lr(sb, g) == ckpt_scheduler_last_lr(sa, g));
        }
        free(before);
        ckpt_reader_free(r);
        ckpt_scheduler_free(sa);
        ckpt_scheduler_free(sb);
        fixture_free(&a);
        fixture_free(&b);
    }
}

/* Steps s n times. */
static void step_n(ckpt_scheduler *s, int n) {
    for (int t = 0; t < n; t++) assert_int_equal(ckpt_scheduler_step(s), CKPT_OK);
}

/* A warmup schedule resumed with the total it was saved with continues
 * exactly; resumed with another total (a run extended on purpose) it follows
 * the constructor's schedule from the restored step, not the file's. */
static void test_schedule_parameters_are_the_constructors_after_a_load(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "warmup.safetensors");
    for (int linear = 0; linear < 2; linear++) {
        int (*make)(ckpt_scheduler **, ckpt_optimizer *, int64_t, int64_t) =
            linear ? ckpt_warmup_linear_new : ckpt_warmup_cosine_new;
        fixture fa, fb, fc, fd;
        fixture_init(&fa, 0.1, 0.05);
        fixture_init(&fb, 0.1, 0.05);
        fixture_init(&fc, 0.1, 0.05);
        fixture_init(&fd, 0.1, 0.05);
        ckpt_scheduler *saved, *same, *longer, *longer_ref;
        assert_int_equal(make(&saved, fa.o, 3, 15), CKPT_OK);
        step_n(saved, 8);
        tu_save_state(ckpt_scheduler_ops(), saved, path);

        /* The same total: bit for bit the saved schedule's continuation. */
        assert_int_equal(make(&same, fb.o, 3, 15), CKPT_OK);
        assert_int_equal(tu_load_state(ckpt_scheduler_ops(), same, path), CKPT_OK);
        for (int t = 0; t < 5; t++) {
            step_n(saved, 1);
            step_n(same, 1);
            for (int g = 0; g < 2; g++)
                assert_true(ckpt_scheduler_last_lr(same, g) == ckpt_scheduler_last_lr(saved, g));
        }

        /* A total of 30: the 30-step schedule from step 8 on, as a run built
         * with 30 from the start has it; not the file's 15. */
        assert_int_equal(make(&longer, fc.o, 3, 30), CKPT_OK);
        assert_int_equal(tu_load_state(ckpt_scheduler_ops(), longer, path), CKPT_OK);
        assert_int_equal(make(&longer_ref, fd.o, 3, 30), CKPT_OK);
        step_n(longer_ref, 8);
        for (int t = 0; t < 5; t++) {
            step_n(longer, 1);
            step_n(longer_ref, 1);
            for (int g = 0; g < 2; g++) {
                assert_true(ckpt_scheduler_last_lr(longer, g) == ckpt_scheduler_last_lr(longer_ref, g));
                assert_true(ckpt_optimizer_get_lr(fc.o, g) == ckpt_scheduler_last_lr(longer_ref, g));
            }
        }
        /* ... which is higher than the 15-step schedule at the same steps. */
        assert_true(ckpt_scheduler_last_lr(longer, 0) > ckpt_scheduler_last_lr(same, 0));
        ckpt_scheduler_free(saved);
        ckpt_scheduler_free(same);
        ckpt_scheduler_free(longer);
        ckpt_scheduler_free(longer_ref);
        fixture_free(&fa);
        fixture_free(&fb);
        fixture_free(&fc);
        fixture_free(&fd);
    }
}

static void test_constructor_allocation_failures_are_clean(void **state) {
    (void)state;
    fixture f;
    fixture_init(&f, 0.1, 0.2);
    const int64_t ms[2] = {1, 2};
    for (uint64_t n = 1;; n++) {
        ckpt_scheduler *s = NULL;
        ckpt__alloc_fail_after(n);
        int rc = ckpt_multisteplr_new(&s, f.o, 2, ms, 0.5);
        ckpt__alloc_fail_after(0);
        if (rc == CKPT_OK) {
            assert_true(ckpt_scheduler_last_lr(s, 1) == 0.2);
            ckpt_scheduler_free(s);
            break;
        }
        assert_int_equal(rc, CKPT_ENOMEM);
        assert_null(s);
        assert_true(ckpt_optimizer_get_lr(f.o, 1) == 0.2);
    }
    fixture_free(&f);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_steplr_halves_every_step_size_steps),
        cmocka_unit_test(test_multisteplr_applies_repeated_milestones_at_once),
        cmocka_unit_test(test_warmup_schedules_start_at_zero_on_construction),
        cmocka_unit_test(test_cosine_follows_pytorch_recursive_form),
        cmocka_unit_test(test_constructors_reject_bad_arguments),
        cmocka_unit_test(test_constructor_allocation_failures_are_clean),
        cmocka_unit_test_setup_teardown(test_every_kind_resumes_exactly_after_state_dict, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_loading_another_kind_is_a_mismatch_and_changes_nothing, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_check_state_dict_refuses_what_load_refuses_and_changes_nothing, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_schedule_parameters_are_the_constructors_after_a_load, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
