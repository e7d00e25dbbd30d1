/* test_retention.c — metrics recorded with a checkpoint, and the retention
 * rule (total_limit, keep_every_steps, best_k by a metric): long random
 * sequences of real saves against a plain reference computation of the kept
 * set, the newest always kept, nothing removed by a save that fails,
 * ckpt_checkpoint_prune_ex with the same policies, and bad options. */
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

/* A custom object whose state_dict fails on demand: a save that fails
 * before its commit. */
typedef struct {
    bool fail;
    int64_t v;
} flaky;

static int flaky_state_dict(void *self, ckpt_writer *w) {
    flaky *f = self;
    if (f->fail) return ckpt_set_error(CKPT_EIO, "flaky: refused on purpose");
    return ckpt_write_i64(w, "v", f->v);
}
static int flaky_load(void *self, ckpt_reader *r) {
    (void)self;
    (void)r;
    return 0;
}
static const ckpt_stateful_ops flaky_ops = {flaky_state_dict, flaky_load, NULL};

/* One save of the history the reference replays. */
typedef struct {
    int64_t number, step;
    bool has_metric;
    double metric;
} rec;

typedef struct {
    int total_limit;
    int64_t keep_every;
    int best_k;
    ckpt_best_mode mode;
} policy;

static bool better(const rec *a, const rec *b, ckpt_best_mode mode) {
    if (a->metric != b->metric) return mode == CKPT_BEST_MIN ? a->metric < b->metric : a->metric > b->metric;
    return a->number > b->number;
}

/* The reference: what stays of `live` (ascending numbers) after a rotation,
 * written as plainly as the rule in the header reads. */
static int reference_rotate(rec *live, int n, const policy *p) {
    bool active = p->keep_every > 0 || p->best_k > 0;
    if (!active && p->total_limit <= 0) return n; /* no rotation */
    bool keep[512] = {false};
    int newest = active && p->total_limit < 1 ? 1 : p->total_limit;
    for (int i = n - 1; i >= 0 && i >= n - newest; i--) keep[i] = true;
    if (active) {
        for (int i = 0; i < n; i++)
            if (p->keep_every > 0 && live[i].step % p->keep_every == 0) keep[i] = true;
        for (int i = 0; i < n; i++) { /* i is among the best k: fewer than k are better */
            if (!live[i].has_metric || p->best_k <= 0) continue;
            int ahead = 0;
            for (int j = 0; j < n; j++)
                if (j != i && live[j].has_metric && better(&live[j], &live[i], p->mode)) ahead++;
            if (ahead < p->best_k) keep[i] = true;
        }
    }
    int m = 0;
    for (int i = 0; i < n; i++)
        if (keep[i]) live[m++] = live[i];
    return m;
}

static ckpt_accelerator *new_acc(const char *dir, const policy *p, const char *metric) {
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = dir;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = p->total_limit;
    cfg.keep_every_steps = p->keep_every;
    cfg.best_metric = metric;
    cfg.best_mode = p->mode;
    cfg.best_k = p->best_k;
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    return acc;
}

static void expect_kept(const char *dir, const rec *live, int n, uint64_t seed, int save) {
    ckpt_checkpoint_info *info = NULL;
    int64_t count = 0;
    assert_int_equal(ckpt_checkpoint_list(dir, false, &info, &count), CKPT_OK);
    if (count != n) {
        fprintf(stderr, "seed %llu, save %d: %lld kept, the reference keeps %d\n",
                (unsigned long long)seed, save, (long long)count, n);
        fail();
    }
    for (int i = 0; i < n; i++) {
        if (info[i].number != live[i].number) {
            fprintf(stderr, "seed %llu, save %d: kept[%d] is checkpoint_%lld, expected %lld\n",
                    (unsigned long long)seed, save, i, (long long)info[i].number,
                    (long long)live[i].number);
            fail();
        }
        assert_int_equal(info[i].step, live[i].step);
        assert_int_equal(info[i].num_metrics, live[i].has_metric ? 1 : 0);
        if (live[i].has_metric) {
            assert_string_equal(info[i].metrics[0].name, "val_loss");
            assert_true(info[i].metrics[0].value == live[i].metric); /* exact round trip */
        }
    }
    free(info);
}

/* Random sequences of saves, every combination of the policies, each kept
 * set compared with the reference after every save. Values come from a
 * small set so that ties happen; some saves carry no metric; one save in
 * seven fails (nothing may be removed then). */
static void test_random_sequences(void **state) {
    (void)state;
    const int limits[] = {0, 1, 3};
    const int64_t everies[] = {0, 4};
    const int bests[] = {0, 1, 3};
    uint64_t seed = 20261204;
    int combos = 0, saves = 0;
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 2; b++)
            for (int c = 0; c < 3; c++)
                for (int mode = 0; mode < 2; mode++) {
                    if (bests[c] == 0 && mode == 1) continue;
                    policy p = {limits[a], everies[b], bests[c], (ckpt_best_mode)mode};
                    char *dir = tu_tmpdir_new("retention");
                    ckpt_accelerator *acc = new_acc(dir, &p, p.best_k ? "val_loss" : NULL);
                    flaky f = {false, 0};
                    assert_int_equal(ckpt_register_for_checkpointing(acc, &flaky_ops, &f), CKPT_OK);
                    rec live[512];
                    int n = 0;
                    int64_t step = 0, number = 0;
                    srand((unsigned)seed);
                    for (int s = 0; s < 30; s++) {
                        step += 1 + rand() % 3;
                        ckpt_accelerator_set_step(acc, step);
                        bool has = rand() % 5 != 0;
                        double val = (double)(rand() % 6) / 4.0 - 0.3;
                        if (has) assert_int_equal(ckpt_set_metric(acc, "val_loss", val), CKPT_OK);
                        f.fail = rand() % 7 == 0;
                        int rc = ckpt_save_state(acc, NULL);
                        if (f.fail) {
                            assert_int_equal(rc, CKPT_EIO);
                            ckpt_clear_metrics(acc);
                        } else {
                            assert_int_equal(rc, CKPT_OK);
                            live[n++] = (rec){number, step, has, val};
                            n = reference_rotate(live, n, &p);
                            /* the newest is always there */
                            assert_int_equal(live[n - 1].number, number);
                            number++;
                            saves++;
                        }
                        expect_kept(dir, live, n, seed, s);
                    }
                    ckpt_accelerator_free(acc);
                    tu_tmpdir_free(dir);
                    seed++;
                    combos++;
                }
    printf("retention: %d policy combinations, %d saves, kept sets equal to the reference\n",
           combos, saves);
}

/* Metrics: recorded, shown by verify, cleared by a successful save, kept by
 * a failed one; bad names and values refused. */
static void test_metrics(void **state) {
    (void)state;
    policy none = {0, 0, 0, CKPT_BEST_MIN};
    ckpt_accelerator *acc = new_acc(tu_dir(), &none, NULL);
    flaky f = {false, 1};
    assert_int_equal(ckpt_register_for_checkpointing(acc, &flaky_ops, &f), CKPT_OK);
    assert_int_equal(ckpt_set_metric(acc, "val_loss", 0.1), CKPT_OK);
    assert_int_equal(ckpt_set_metric(acc, "accuracy", 97.25), CKPT_OK);
    assert_int_equal(ckpt_set_metric(acc, "val_loss", 1.0 / 3.0), CKPT_OK); /* replaces */
    f.fail = true;
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_EIO);
    f.fail = false;
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK); /* the retry has them */
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK); /* cleared: none */
    ckpt_checkpoint_info *info = NULL;
    int64_t count = 0;
    assert_int_equal(ckpt_checkpoint_list(tu_dir(), true, &info, &count), CKPT_OK);
    assert_int_equal(count, 2);
    assert_int_equal(info[0].status, CKPT_CHECKPOINT_COMPLETE);
    assert_int_equal(info[0].num_metrics, 2);
    assert_string_equal(info[0].metrics[0].name, "val_loss");
    assert_true(info[0].metrics[0].value == 1.0 / 3.0);
    assert_string_equal(info[0].metrics[1].name, "accuracy");
    assert_true(info[0].metrics[1].value == 97.25);
    assert_int_equal(info[1].num_metrics, 0);
    free(info);

    const char *bad_names[] = {"", "has space", "quote\"", "x{}",
                               "a_name_that_is_far_too_long_to_be_a_metric_name_in_a_manifest_xx"};
    for (size_t i = 0; i < sizeof bad_names / sizeof bad_names[0]; i++) {
        assert_int_equal(ckpt_set_metric(acc, bad_names[i], 1.0), CKPT_EINVAL);
        assert_non_null(strstr(ckpt_errmsg(), "A-Za-z0-9"));
    }
    assert_int_equal(ckpt_set_metric(acc, NULL, 1.0), CKPT_EINVAL);
    assert_int_equal(ckpt_set_metric(acc, "x", NAN), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "finite"));
    assert_int_equal(ckpt_set_metric(acc, "x", -INFINITY), CKPT_EINVAL);
    assert_int_equal(ckpt_set_metric(NULL, "x", 1.0), CKPT_EINVAL);
    char name[16];
    for (int i = 0; i < CKPT_MAX_METRICS; i++) {
        snprintf(name, sizeof name, "m%d", i);
        assert_int_equal(ckpt_set_metric(acc, name, i), CKPT_OK);
    }
    assert_int_equal(ckpt_set_metric(acc, "one_more", 1.0), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "at most 16"));
    assert_int_equal(ckpt_set_metric(acc, "m3", -1.0), CKPT_OK); /* a replacement fits */
    ckpt_clear_metrics(acc);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_checkpoint_list(tu_dir(), false, &info, &count), CKPT_OK);
    assert_int_equal(info[count - 1].num_metrics, 0);
    free(info);
    ckpt_accelerator_free(acc);
}

/* A manifest whose metrics were edited fails its checksum; hostile metrics
 * are refused by the parser (see also the fuzz corpus). */
static void test_metrics_in_manifest(void **state) {
    (void)state;
    policy none = {0, 0, 0, CKPT_BEST_MIN};
    ckpt_accelerator *acc = new_acc(tu_dir(), &none, NULL);
    assert_int_equal(ckpt_set_metric(acc, "val_loss", 0.5), CKPT_OK);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    char *mp = tu_pathf("%s/checkpoint.json", dir);
    size_t n = 0;
    char *text = tu_read_file(mp, &n);
    char *at = strstr(text, "\"val_loss\": 0.5");
    assert_non_null(at);
    at[strlen("\"val_loss\": 0.")] = '4';
    tu_write_file(mp, text, n);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, false, &info), CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "checksum"));
    free(text);
    free(mp);
    free(dir);
    ckpt_accelerator_free(acc);
}

static void test_bad_options(void **state) {
    (void)state;
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = tu_dir();
    ckpt_accelerator *acc = NULL;
    cfg.best_k = 2;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "best_metric is not set"));
    cfg.best_metric = "bad name";
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "best_metric 'bad name'"));
    cfg.best_metric = "val_loss";
    cfg.best_k = -1;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "best_k is -1"));
    cfg.best_k = 1;
    cfg.best_mode = (ckpt_best_mode)7;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "best_mode"));
    cfg.best_mode = CKPT_BEST_MAX;
    cfg.keep_every_steps = -5;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "keep_every_steps is -5"));
    assert_null(acc);

    ckpt_prune_options po;
    memset(&po, 0, sizeof po);
    po.keep = 1;
    po.best_k = 3;
    assert_int_equal(ckpt_checkpoint_prune_ex(tu_dir(), &po, NULL), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "checkpoint_prune: best_k is 3 but best_metric"));
}

static void count_report(void *user, const char *path, ckpt_prune_reason reason, const char *why) {
    (void)path;
    (void)why;
    assert_int_equal(reason, CKPT_PRUNE_OLD);
    (*(int *)user)++;
}

/* ckpt_checkpoint_prune_ex applies the same rule to a project saved
 * without a policy. */
static void test_prune_with_policy(void **state) {
    (void)state;
    policy none = {0, 0, 0, CKPT_BEST_MIN};
    ckpt_accelerator *acc = new_acc(tu_dir(), &none, NULL);
    const double vals[] = {0.9, 0.4, 0.7, 0.4, 0.8, 0.95, 0.6, 0.5, 0.3, 0.99};
    rec live[16];
    for (int i = 0; i < 10; i++) {
        ckpt_accelerator_set_step(acc, 10 * (i + 1));
        assert_int_equal(ckpt_set_metric(acc, "val_loss", vals[i]), CKPT_OK);
        assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
        live[i] = (rec){i, 10 * (i + 1), true, vals[i]};
    }
    ckpt_accelerator_free(acc);
    policy p = {1, 40, 2, CKPT_BEST_MIN};
    ckpt_prune_options po;
    memset(&po, 0, sizeof po);
    po.keep = 1;
    po.keep_every_steps = 40;
    po.best_metric = "val_loss";
    po.best_mode = CKPT_BEST_MIN;
    po.best_k = 2;
    int reported = 0;
    po.report = count_report;
    po.user = &reported;
    po.dry_run = true;
    int64_t removed = 0;
    assert_int_equal(ckpt_checkpoint_prune_ex(tu_dir(), &po, &removed), CKPT_OK);
    int n = reference_rotate(live, 10, &p);
    /* kept: step 100 (newest), 40 and 80 (multiples), 0.3 (step 90) and the
     * newer of the two 0.4 (step 40) */
    assert_int_equal(n, 4);
    assert_int_equal(removed, 10 - n);
    assert_int_equal(reported, 10 - n);
    expect_kept(tu_dir(), (rec[]){{0, 10, true, 0.9}, {1, 20, true, 0.4}, {2, 30, true, 0.7},
                                  {3, 40, true, 0.4}, {4, 50, true, 0.8}, {5, 60, true, 0.95},
                                  {6, 70, true, 0.6}, {7, 80, true, 0.5}, {8, 90, true, 0.3},
                                  {9, 100, true, 0.99}},
                10, 0, 0); /* a dry run removed nothing */
    po.dry_run = false;
    reported = 0;
    assert_int_equal(ckpt_checkpoint_prune_ex(tu_dir(), &po, &removed), CKPT_OK);
    assert_int_equal(removed, 6);
    expect_kept(tu_dir(), live, n, 0, 0);
    assert_int_equal(live[0].step, 40);
    assert_int_equal(live[1].step, 80);
    assert_int_equal(live[2].step, 90);
    assert_int_equal(live[3].step, 100);

    /* keep 0 with a policy never removes the newest */
    po.keep = 0;
    po.keep_every_steps = 0;
    po.best_metric = "val_loss";
    po.best_mode = CKPT_BEST_MAX;
    po.best_k = 1;
    assert_int_equal(ckpt_checkpoint_prune_ex(tu_dir(), &po, &removed), CKPT_OK);
    ckpt_checkpoint_info *info = NULL;
    int64_t count = 0;
    assert_int_equal(ckpt_checkpoint_list(tu_dir(), false, &info, &count), CKPT_OK);
    assert_int_equal(count, 1); /* step 100: the newest, and the highest (0.99) */
    assert_int_equal(info[0].step, 100);
    free(info);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_random_sequences),
        cmocka_unit_test_setup_teardown(test_metrics, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_metrics_in_manifest, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_bad_options, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_prune_with_policy, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
