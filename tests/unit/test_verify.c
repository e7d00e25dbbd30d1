/* Deep verification hashes a checkpoint's files on two threads once they are
 * large enough. These tests force the threaded path on small checkpoints and
 * check that it finds every corrupted file, reports the same error as the
 * sequential check (the lowest-numbered bad file), and still lets a good
 * checkpoint load. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

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
    ckpt_project_config cfg = {.project_dir = project, .automatic_checkpoint_naming = true};
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
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
