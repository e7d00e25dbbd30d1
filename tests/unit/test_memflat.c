/* test_memflat.c — host memory stays flat over many saves and loads: after
 * the 10th asynchronous save, synchronous save or load, VmRSS and VmHWM
 * (/proc/self/status) grow by at most 1 MiB over the following ones. Counts
 * bytes, times nothing.
 *
 * The figure is 1,000 saves of a ~100 MB state; that is
 * bench/bench_memflat.c (`make memflat`, release build: a few minutes, most
 * of it the disk). Here, in the suite under the sanitizers, the same phases
 * run on a 4 MiB state, 60 operations each: the growth a leak or an
 * allocator cache per operation would show (a buffer per save, a manifest
 * per load) is at least a few KiB per operation, > 1 MiB over 50 of them
 * only if it is some 20 KiB each, so the state's size does not matter to
 * what is caught. No fsync (CKPT_IO_SKIP_EVERY_FSYNC): memory does not
 * depend on it, and on a busy shared disk the fsyncs of 180 saves took
 * minutes.
 *
 * And what one load leaves behind: a resumed run's first load of a 192 MiB
 * state (a 64 MiB model and its AdamW), then a load of the two passes
 * (non_strict) and a one-pass load, each keeping at most 16 MiB of VmRSS
 * after it returns (issue 37: the read buffers leave with the load). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/io.h"
#include "testing/testing.h"
#include "helpers/testutil.h"

/* Under AddressSanitizer freed blocks wait in a quarantine (256 MiB by
 * default) before they are reused: RSS would grow with every free. Without
 * it the sanitizer's allocator reuses memory as malloc does. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
    return "quarantine_size_mb=0:thread_local_quarantine_size_kb=0";
}

#define NT 4                            /* tensors */
#define TENSOR_FLOATS ((int64_t)1 << 18) /* 1 MiB each */
#define OPS 60

static void status_kib(long *rss, long *hwm) {
    *rss = *hwm = -1;
    FILE *f = fopen("/proc/self/status", "r");
    assert_non_null(f);
    char line[256];
    while (fgets(line, sizeof line, f)) {
        if (strncmp(line, "VmRSS:", 6) == 0) *rss = atol(line + 6);
        if (strncmp(line, "VmHWM:", 6) == 0) *hwm = atol(line + 6);
    }
    fclose(f);
    assert_true(*rss > 0 && *hwm > 0);
}

typedef struct state {
    float *w[NT];
    float sp[1024], sg[1024];
    ckpt_model *model, *small;
    ckpt_optimizer *opt;
    ckpt_accelerator *acc;
    char *dir;
} state;

static void state_open(state *s) {
    memset(s, 0, sizeof *s);
    s->dir = tu_tmpdir_new("memflat");
    assert_int_equal(ckpt_model_new(&s->model), 0);
    assert_int_equal(ckpt_model_new(&s->small), 0);
    for (int i = 0; i < NT; i++) {
        s->w[i] = malloc((size_t)TENSOR_FLOATS * sizeof(float));
        assert_non_null(s->w[i]);
        for (int64_t k = 0; k < TENSOR_FLOATS; k++) s->w[i][k] = (float)(k % 100) + (float)i;
        char name[32];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        assert_int_equal(ckpt_model_add_param(s->model, name, CKPT_F32, 1,
                                              (int64_t[]){TENSOR_FLOATS}, s->w[i], NULL),
                         0);
    }
    for (int k = 0; k < 1024; k++) s->sg[k] = 1e-3f * (float)(k % 5);
    assert_int_equal(
        ckpt_model_add_param(s->small, "head.weight", CKPT_F32, 1, (int64_t[]){1024}, s->sp, s->sg),
        0);
    assert_int_equal(ckpt_adamw_new(&s->opt, s->small, 1e-3, 0.9, 0.999, 1e-8, 0.01), 0);
    assert_int_equal(ckpt_optimizer_step(s->opt), 0);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = s->dir;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 2;
    assert_int_equal(ckpt_accelerator_new(&s->acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(s->acc, s->model), 0);
    assert_int_equal(ckpt_prepare_model(s->acc, s->small), 0);
    assert_int_equal(ckpt_prepare_optimizer(s->acc, s->opt), 0);
}

static void state_close(state *s) {
    ckpt_accelerator_free(s->acc);
    ckpt_optimizer_free(s->opt);
    ckpt_model_free(s->model);
    ckpt_model_free(s->small);
    for (int i = 0; i < NT; i++) free(s->w[i]);
    tu_tmpdir_free(s->dir);
}

enum { ASYNC, SYNC, LOAD };

/* OPS operations of one kind; the growth of VmRSS and VmHWM after the 10th. */
static void run_phase(state *s, int kind, const char *name) {
    long rss10 = 0, hwm10 = 0, rss = 0, hwm = 0;
    for (int i = 1; i <= OPS; i++) {
        if (kind == LOAD) {
            assert_int_equal(ckpt_load_state(s->acc, NULL), 0);
        } else {
            s->w[i % NT][i] += 1.0f;
            ckpt_accelerator_set_step(s->acc, i);
            int rc = kind == ASYNC ? ckpt_save_state_async(s->acc, NULL)
                                   : ckpt_save_state(s->acc, NULL);
            assert_int_equal(rc, 0);
        }
        if (i == 10 || i == OPS) {
            assert_int_equal(ckpt_save_wait(s->acc), 0);
            status_kib(i == 10 ? &rss10 : &rss, i == 10 ? &hwm10 : &hwm);
        }
    }
    print_message("%s: VmRSS %ld -> %ld KiB, VmHWM %ld -> %ld KiB over saves 10..%d\n", name,
                  rss10, rss, hwm10, hwm, OPS);
    if (rss > rss10 + 1024 || hwm > hwm10 + 1024)
        fail_msg("%s: memory grew after the 10th: VmRSS %ld -> %ld KiB, VmHWM %ld -> %ld KiB", name,
                 rss10, rss, hwm10, hwm);
    /* total_limit held: two checkpoints at most */
    ckpt_checkpoint_info *infos = NULL;
    int64_t count = 0;
    assert_int_equal(ckpt_checkpoint_list(s->dir, true, &infos, &count), 0);
    free(infos);
    assert_true(count <= 2);
}

static void test_async_saves_keep_memory_flat(void **st) {
    (void)st;
    state s;
    state_open(&s);
    assert_int_equal(ckpt_accelerator_prepare_async(s.acc), 0);
    run_phase(&s, ASYNC, "async saves");
    state_close(&s);
}

static void test_sync_saves_keep_memory_flat(void **st) {
    (void)st;
    state s;
    state_open(&s);
    run_phase(&s, SYNC, "sync saves");
    state_close(&s);
}

static void test_loads_keep_memory_flat(void **st) {
    (void)st;
    state s;
    state_open(&s);
    assert_int_equal(ckpt_save_state(s.acc, NULL), 0);
    run_phase(&s, LOAD, "loads");
    state_close(&s);
}

/* VmRSS kept by one load (after less before), in KiB. */
static long load_kept_kib(ckpt_accelerator *acc, const ckpt_load_options *o) {
    long rss0, hwm, rss1;
    status_kib(&rss0, &hwm);
    assert_int_equal(ckpt_load_state_ex(acc, NULL, o, NULL), 0);
    status_kib(&rss1, &hwm);
    return rss1 - rss0;
}

#define BIG_NT 8
#define BIG_FLOATS ((int64_t)2 << 20) /* 8 MiB each: a 64 MiB model */

static void test_a_load_keeps_at_most_16_mib(void **st) {
    (void)st;
    char *dir = tu_tmpdir_new("loadrss");
    float *w[BIG_NT], *g[BIG_NT];
    ckpt_model *model;
    assert_int_equal(ckpt_model_new(&model), 0);
    for (int i = 0; i < BIG_NT; i++) {
        w[i] = malloc((size_t)BIG_FLOATS * sizeof(float));
        g[i] = malloc((size_t)BIG_FLOATS * sizeof(float));
        assert_true(w[i] && g[i]);
        for (int64_t k = 0; k < BIG_FLOATS; k++) {
            w[i][k] = (float)(k % 97) + (float)i;
            g[i][k] = 1e-3f * (float)(k % 7);
        }
        char name[32];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        assert_int_equal(
            ckpt_model_add_param(model, name, CKPT_F32, 1, (int64_t[]){BIG_FLOATS}, w[i], g[i]), 0);
    }
    ckpt_optimizer *opt;
    assert_int_equal(ckpt_adamw_new(&opt, model, 1e-3, 0.9, 0.999, 1e-8, 0.01), 0);
    assert_int_equal(ckpt_optimizer_step(opt), 0); /* the moments exist and are touched */
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = dir;
    cfg.automatic_checkpoint_naming = true;
    ckpt_accelerator *acc;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(acc, model), 0);
    assert_int_equal(ckpt_prepare_optimizer(acc, opt), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    const float saved = w[0][1];
    ckpt_accelerator_free(acc);
    /* A resumed run: a new accelerator over the same objects. */
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(acc, model), 0);
    assert_int_equal(ckpt_prepare_optimizer(acc, opt), 0);
    const ckpt_load_options two = {.non_strict = true}, one = {.one_pass = true};
    static const char *const what[] = {"the first load", "a second load", "a two-pass load",
                                       "a one-pass load"};
    const ckpt_load_options *opts[] = {NULL, NULL, &two, &one};
    for (int k = 0; k < 4; k++) {
        w[0][1] = -1.0f; /* the load puts it back */
        long kept = load_kept_kib(acc, opts[k]);
        print_message("%s of a 192 MiB state: VmRSS %+ld KiB\n", what[k], kept);
        assert_true(w[0][1] == saved);
        if (kept > 16 * 1024)
            fail_msg("%s kept %ld KiB of a 192 MiB state resident (at most 16 MiB)", what[k], kept);
    }
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    for (int i = 0; i < BIG_NT; i++) free(w[i]), free(g[i]);
    tu_tmpdir_free(dir);
}

int main(void) {
    ckpt__io_set_unsafe(CKPT_IO_SKIP_EVERY_FSYNC);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_async_saves_keep_memory_flat),
        cmocka_unit_test(test_sync_saves_keep_memory_flat),
        cmocka_unit_test(test_loads_keep_memory_flat),
        cmocka_unit_test(test_a_load_keeps_at_most_16_mib),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
