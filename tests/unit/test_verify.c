/* Deep verification hashes a checkpoint's files on two threads once they are
 * large enough. These tests force the threaded path on small checkpoints and
 * check that it finds every corrupted file, reports the same error as the
 * sequential check (the lowest-numbered bad file), and still lets a good
 * checkpoint load. Then the tools built on it: prune and total_limit
 * rotation count only verified checkpoints. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "format/manifest.h"
#include "helpers/testutil.h"

enum { NA = 4096, NB = 1024, NC = 64 };

typedef struct fixture {
    float a[NA], b[NB], c[NC];
    ckpt_model *m1, *m2, *m3;
    ckpt_accelerator *acc;
} fixture;

static fixture fx;

static void build(const char *project) {
    memset(&fx, 0, sizeof fx);
    for (int i = 0; i < NA; i++) fx.a[i] = (float)i;
    for (int i = 0; i < NB; i++) fx.b[i] = (float)-i;
    for (int i = 0; i < NC; i++) fx.c[i] = 0.5f * (float)i;
    assert_int_equal(ckpt_model_new(&fx.m1), 0);
    assert_int_equal(ckpt_model_new(&fx.m2), 0);
    assert_int_equal(ckpt_model_new(&fx.m3), 0);
    assert_int_equal(ckpt_model_add_param(fx.m1, "a", CKPT_F32, 1, (int64_t[]){NA}, fx.a, NULL), 0);
    assert_int_equal(ckpt_model_add_param(fx.m2, "b", CKPT_F32, 1, (int64_t[]){NB}, fx.b, NULL), 0);
    assert_int_equal(ckpt_model_add_param(fx.m3, "c", CKPT_F32, 1, (int64_t[]){NC}, fx.c, NULL), 0);
    /* every checkpoint its own copy of each file: the tests corrupt one */
    ckpt_project_config cfg = {
        .project_dir = project, .automatic_checkpoint_naming = true, .no_link_unchanged = true};
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.m1), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.m2), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.m3), 0);
}

static void destroy(void) {
    ckpt_accelerator_free(fx.acc);
    ckpt_model_free(fx.m1);
    ckpt_model_free(fx.m2);
    ckpt_model_free(fx.m3);
}

static int setup(void **state) {
    if (tu_tmpdir_setup(state)) return -1;
    ckpt__set_parallel_check_bytes(0);
    build(tu_dir());
    return 0;
}

static int teardown(void **state) {
    destroy();
    ckpt__set_parallel_check_bytes(64u << 20);
    return tu_tmpdir_teardown(state);
}

/* Saves checkpoint_0 and returns its path (static buffer). */
static const char *save_one(void) {
    static char dir[4096];
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    snprintf(dir, sizeof dir, "%s", ckpt_accelerator_last_dir(fx.acc));
    return dir;
}

static void test_threaded_check_accepts_a_good_checkpoint_and_loads_it(void **state) {
    (void)state;
    const char *dir = save_one();
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    assert_int_equal(info.status, CKPT_CHECKPOINT_COMPLETE);
    fx.a[7] = 99.0f;
    fx.c[3] = -1.0f;
    assert_int_equal(ckpt_load_state(fx.acc, NULL), 0);
    assert_true(fx.a[7] == 7.0f);
    assert_true(fx.c[3] == 1.5f);
}

/* Every file, whichever thread hashes it, is checked; and the same with
 * the threads off. */
static void flip_each_file_and_verify(const char *dir) {
    const char *names[] = {"model.safetensors", "model_1.safetensors", "model_2.safetensors",
                           "random_states_0.safetensors"};
    for (size_t i = 0; i < sizeof names / sizeof *names; i++) {
        char path[4096];
        tu_path(path, sizeof path, dir, names[i]);
        tu_flip_byte(path, -1);
        ckpt_checkpoint_info info;
        tu_expect_error(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT, names[i]);
        assert_int_equal(info.status, CKPT_CHECKPOINT_CORRUPT);
        tu_flip_byte(path, -1);
        assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    }
}

static void test_threaded_check_finds_a_flipped_byte_in_every_file(void **state) {
    (void)state;
    flip_each_file_and_verify(save_one());
}

static void test_sequential_check_finds_a_flipped_byte_in_every_file(void **state) {
    (void)state;
    ckpt__set_parallel_check_bytes(UINT64_MAX);
    flip_each_file_and_verify(save_one());
}

/* With two bad files on different threads, the error names the one listed
 * first in the manifest, as the sequential check does. */
static void test_threaded_check_reports_the_first_bad_file_like_the_sequential_one(void **state) {
    (void)state;
    const char *dir = save_one();
    char p1[4096], p3[4096];
    tu_flip_byte(tu_path(p1, sizeof p1, dir, "model.safetensors"), -1);
    tu_flip_byte(tu_path(p3, sizeof p3, dir, "model_2.safetensors"), -1);
    ckpt_checkpoint_info info;
    tu_expect_error(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT, "model.safetensors");
    char threaded[2048];
    snprintf(threaded, sizeof threaded, "%s", ckpt_errmsg());
    ckpt__set_parallel_check_bytes(UINT64_MAX);
    tu_expect_error(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT, "model.safetensors");
    assert_string_equal(threaded, ckpt_errmsg());
    /* and a load refuses it, changing nothing */
    fx.a[0] = 42.0f;
    tu_expect_error(ckpt_load_state(fx.acc, dir), CKPT_ECORRUPT, "model.safetensors");
    assert_true(fx.a[0] == 42.0f);
}

/* The number of checkpoint folders of the fixture's project and whether
 * checkpoint_<n> is among them. */
static bool has_checkpoint(int n) {
    char path[4096];
    snprintf(path, sizeof path, "%s/checkpoints/checkpoint_%d", tu_dir(), n);
    struct stat st;
    return stat(path, &st) == 0;
}

/* total_limit rotation counts only valid checkpoints: with the newest old
 * one corrupt, the next save with total_limit 2 keeps the new one and the
 * newest valid older one, and removes the corrupt one (older than the
 * newest valid) and the oldest. Counting folders would keep the corrupt one
 * and leave a single loadable checkpoint. */
static void test_total_limit_rotation_counts_only_valid_checkpoints(void **state) {
    (void)state;
    for (int i = 0; i < 3; i++) save_one();
    char path[4096];
    snprintf(path, sizeof path, "%s/checkpoints/checkpoint_2/model.safetensors", tu_dir());
    tu_flip_byte(path, -1);
    ckpt_accelerator_free(fx.acc);
    ckpt_project_config cfg = {.project_dir = tu_dir(),
                               .automatic_checkpoint_naming = true,
                               .total_limit = 2,
                               .no_link_unchanged = true};
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.m1), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.m2), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.m3), 0);
    save_one(); /* checkpoint_3 */
    assert_false(has_checkpoint(0));
    assert_true(has_checkpoint(1));
    assert_false(has_checkpoint(2));
    assert_true(has_checkpoint(3));
}

typedef struct seen {
    int n;
    char paths[8][4096];
    ckpt_prune_reason reasons[8];
} seen;

static void record(void *user, const char *path, ckpt_prune_reason reason, const char *why) {
    seen *s = user;
    (void)why;
    if (s->n < 8) {
        snprintf(s->paths[s->n], sizeof s->paths[0], "%s", path);
        s->reasons[s->n++] = reason;
    }
}

/* prune never removes the newest valid checkpoint, keeps invalid ones newer
 * than it, reports (and in a dry run only reports) what goes and why, and
 * removes a leftover temporary folder. */
static void test_prune_counts_only_valid_checkpoints(void **state) {
    (void)state;
    for (int i = 0; i < 3; i++) save_one();
    char path[4096];
    snprintf(path, sizeof path, "%s/checkpoints/checkpoint_2/model.safetensors", tu_dir());
    tu_flip_byte(path, -1);
    snprintf(path, sizeof path, "%s/checkpoints/checkpoint_0/checkpoint.json", tu_dir());
    assert_int_equal(unlink(path), 0); /* checkpoint_0: partial */
    snprintf(path, sizeof path, "%s/checkpoints/.checkpoint_5.tmp.999999999", tu_dir());
    assert_int_equal(mkdir(path, 0755), 0);

    ckpt_leftover_info *lo = NULL;
    int64_t nlo = 0;
    assert_int_equal(ckpt_checkpoint_leftovers(tu_dir(), &lo, &nlo), 0);
    assert_int_equal(nlo, 1);
    assert_string_equal(lo[0].path, path);
    assert_int_equal(lo[0].pid, 999999999);
    free(lo);

    seen s = {0};
    ckpt_prune_options o = {.keep = 1, .dry_run = true, .report = record, .user = &s};
    int64_t removed = -1;
    assert_int_equal(ckpt_checkpoint_prune_ex(tu_dir(), &o, &removed), 0);
    assert_int_equal(removed, 1);
    assert_int_equal(s.n, 2);
    assert_int_equal(s.reasons[0], CKPT_PRUNE_LEFTOVER);
    tu_assert_contains(s.paths[1], "checkpoint_0");
    assert_int_equal(s.reasons[1], CKPT_PRUNE_INVALID);
    assert_true(has_checkpoint(0)); /* a dry run removes nothing */

    memset(&s, 0, sizeof s);
    o.dry_run = false;
    /* The run that saved owns the project until it is freed (a dry run
     * takes no lock; a real prune does). */
    ckpt_accelerator_free(fx.acc);
    fx.acc = NULL;
    assert_int_equal(ckpt_checkpoint_prune_ex(tu_dir(), &o, &removed), 0);
    assert_int_equal(removed, 1);
    assert_int_equal(s.n, 2);
    assert_false(has_checkpoint(0));
    assert_true(has_checkpoint(1)); /* the newest valid */
    assert_true(has_checkpoint(2)); /* corrupt, newer than the newest valid */
    assert_int_equal(ckpt_checkpoint_leftovers(tu_dir(), &lo, &nlo), 0);
    assert_int_equal(nlo, 0);
    free(lo);
    /* keep 0 removes them all */
    assert_int_equal(ckpt_checkpoint_prune(tu_dir(), 0, &removed), 0);
    assert_int_equal(removed, 2);
    assert_false(has_checkpoint(1));
    assert_false(has_checkpoint(2));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_threaded_check_accepts_a_good_checkpoint_and_loads_it,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_threaded_check_finds_a_flipped_byte_in_every_file,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_sequential_check_finds_a_flipped_byte_in_every_file,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(
            test_threaded_check_reports_the_first_bad_file_like_the_sequential_one, setup, teardown),
        cmocka_unit_test_setup_teardown(test_total_limit_rotation_counts_only_valid_checkpoints,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_prune_counts_only_valid_checkpoints, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
