/* test_signals.c — a save and a load while a timer signal arrives every
 * 100 µs, its handler installed without SA_RESTART, so every system call the
 * library makes may be interrupted (EINTR) or cut short: the checkpoint is
 * byte for byte the one saved without signals, and the load restores the
 * same state. Once more with every write also capped at an odd size, so the
 * short-write path runs under the signals too.
 *
 * On a local disk the kernel does not interrupt regular-file I/O for a
 * caught signal, so the timer mostly proves that nothing else the library
 * does (threads, locks, maps) trips over EINTR. The EINTR retry of every
 * wrapper is driven directly: an EINTR injected at the n-th I/O call of a
 * save and of a load, for every n. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <errno.h>
#include <sys/time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/io.h"
#include "testing/testing.h"
#include "helpers/testutil.h"

#define NPARAM (1 << 20) /* 4 MB of weights, 12 MB with the AdamW moments */
#define NDATA 4096

static volatile sig_atomic_t g_signals;

static void on_alarm(int sig) {
    (void)sig;
    g_signals++;
}

static void timer_start(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_alarm;
    sa.sa_flags = 0; /* no SA_RESTART: interrupted calls fail with EINTR */
    sigemptyset(&sa.sa_mask);
    assert_int_equal(sigaction(SIGALRM, &sa, NULL), 0);
    struct itimerval it = {{0, 100}, {0, 100}};
    assert_int_equal(setitimer(ITIMER_REAL, &it, NULL), 0);
}

static void timer_stop(void) {
    struct itimerval it;
    memset(&it, 0, sizeof it);
    assert_int_equal(setitimer(ITIMER_REAL, &it, NULL), 0);
    signal(SIGALRM, SIG_IGN);
}

static int64_t ds_len(void *self) {
    (void)self;
    return NDATA;
}

static int ds_get(void *self, int64_t i, void *out) {
    (void)self;
    memcpy(out, &i, sizeof i);
    return 0;
}

typedef struct world {
    int64_t nparam;
    float *w, *g;
    ckpt_model *model;
    ckpt_optimizer *opt;
    ckpt_dataloader *dl;
    ckpt_accelerator *acc;
} world;

static world *world_new(const char *project, int64_t nparam) {
    world *w = calloc(1, sizeof *w);
    assert_non_null(w);
    w->nparam = nparam;
    w->w = calloc((size_t)nparam, sizeof *w->w);
    w->g = calloc((size_t)nparam, sizeof *w->g);
    assert_true(w->w && w->g);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = project;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 1;
    assert_int_equal(ckpt_accelerator_new(&w->acc, &cfg), 0);
    assert_int_equal(ckpt_model_new(&w->model), 0);
    int64_t shape[2] = {1024, nparam / 1024};
    assert_int_equal(ckpt_model_add_param(w->model, "w", CKPT_F32, 2, shape, w->w, w->g), 0);
    assert_int_equal(ckpt_adamw_new(&w->opt, w->model, 1e-3, 0.9, 0.999, 1e-8, 0.0), 0);
    static const ckpt_dataset ds = {.len = ds_len, .get = ds_get, .sample_bytes = sizeof(int64_t)};
    ckpt_dataloader_config dc = {.batch_size = 16, .shuffle = true, .seed = 5, .num_workers = 2};
    assert_int_equal(ckpt_dataloader_new(&w->dl, &ds, &dc), 0);
    assert_int_equal(ckpt_prepare_model(w->acc, w->model), 0);
    assert_int_equal(ckpt_prepare_optimizer(w->acc, w->opt), 0);
    assert_int_equal(ckpt_prepare_dataloader(w->acc, w->dl), 0);
    return w;
}

static void world_free(world *w) {
    ckpt_accelerator_free(w->acc);
    ckpt_dataloader_free(w->dl);
    ckpt_optimizer_free(w->opt);
    ckpt_model_free(w->model);
    free(w->w);
    free(w->g);
    free(w);
}

/* Two training steps and 10 batches in. */
static void world_train(world *w) {
    ckpt_rng *r = ckpt_accelerator_rng(w->acc);
    ckpt_rng_seed(r, 42);
    for (int s = 0; s < 2; s++) {
        for (int64_t i = 0; i < w->nparam; i++) {
            w->w[i] = (float)ckpt_rng_uniform(r);
            w->g[i] = (float)ckpt_rng_uniform(r) - 0.5f;
        }
        assert_int_equal(ckpt_optimizer_step(w->opt), 0);
    }
    ckpt_batch b;
    for (int i = 0; i < 10; i++) assert_int_equal(ckpt_dataloader_next(w->dl, &b), 1);
    ckpt_accelerator_set_step(w->acc, 2);
}

/* The next batch's first index, then the whole state as bytes. */
static char *world_bytes(world *w, const char *tmp, size_t *n) {
    char p[4200];
    tu_path(p, sizeof p, tmp, "state.safetensors");
    size_t a = 0, b = 0;
    char *m = tu_state_bytes(ckpt_model_ops(), w->model, p, &a);
    char *o = tu_state_bytes(ckpt_optimizer_ops(), w->opt, p, &b);
    ckpt_batch bt;
    assert_int_equal(ckpt_dataloader_next(w->dl, &bt), 1);
    int64_t first = bt.indices[0];
    *n = a + b + sizeof first;
    char *all = malloc(*n);
    assert_non_null(all);
    memcpy(all, m, a);
    memcpy(all + a, o, b);
    memcpy(all + a + b, &first, sizeof first);
    free(m);
    free(o);
    return all;
}

/* Every file of a and b but the manifest (which holds its creation time) is
 * the same; b verifies. */
static void assert_same_checkpoint(const char *a, const char *b) {
    assert_int_equal(ckpt_checkpoint_verify(b, true, NULL), 0);
    DIR *d = opendir(a);
    assert_non_null(d);
    struct dirent *e;
    int files = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.' || strcmp(e->d_name, "checkpoint.json") == 0) continue;
        char pa[4200], pb[4200];
        tu_path(pa, sizeof pa, a, e->d_name);
        tu_path(pb, sizeof pb, b, e->d_name);
        tu_assert_same_file(pa, pb, e->d_name);
        files++;
    }
    closedir(d);
    assert_int_equal(files, 4); /* model, optimizer, dataloader, random states */
}

static void save_and_load_under_signals(size_t max_write) {
    char *t = tu_tmpdir_new("signals");
    char ref[4200], proj[4200], latest[4200];
    tu_path(ref, sizeof ref, t, "ref");
    tu_path(proj, sizeof proj, t, "proj");
    tu_path(latest, sizeof latest, t, "proj/checkpoints/checkpoint_1");

    /* Without signals: the reference checkpoint and state. */
    world *w = world_new(NULL, NPARAM);
    world_train(w);
    assert_int_equal(ckpt_save_state(w->acc, ref), 0);
    size_t nref = 0;
    char *want = world_bytes(w, t, &nref);
    world_free(w);

    /* The same save, twice (so rotation runs too), under the timer. */
    w = world_new(proj, NPARAM);
    world_train(w);
    ckpt__fault_set_max_write(max_write);
    g_signals = 0;
    timer_start();
    int rc1 = ckpt_save_state(w->acc, NULL);
    int rc2 = ckpt_save_state(w->acc, NULL);
    timer_stop();
    ckpt__fault_set_max_write(0);
    sig_atomic_t during_save = g_signals;
    assert_int_equal(rc1, 0);
    assert_int_equal(rc2, 0);
    world_free(w);
    assert_same_checkpoint(ref, latest);

    /* A load under the timer restores exactly that state. */
    w = world_new(proj, NPARAM);
    g_signals = 0;
    timer_start();
    int rc = ckpt_load_state(w->acc, NULL);
    timer_stop();
    sig_atomic_t during_load = g_signals;
    assert_int_equal(rc, 0);
    assert_string_equal(ckpt_accelerator_last_dir(w->acc), latest);
    size_t ngot = 0;
    char *got = world_bytes(w, t, &ngot);
    tu_assert_bytes_equal(got, ngot, want, nref);
    world_free(w);
    print_message("  %d signals during the saves, %d during the load (writes capped at %zu)\n",
                  (int)during_save, (int)during_load, max_write);
    /* The timer really fired while the library worked. */
    assert_true(during_save >= 10);
    assert_true(during_load >= 1);
    free(want);
    free(got);
    tu_tmpdir_free(t);
}

static void test_save_and_load_under_a_100us_timer_signal(void **st) {
    (void)st;
    save_and_load_under_signals(0);
}

static void test_save_and_load_under_signals_with_short_writes(void **st) {
    (void)st;
    save_and_load_under_signals(4093);
}

/* An EINTR at the n-th open, write, fsync or read of a save, then of a load,
 * for every n: the call is retried, the checkpoint and the loaded state are
 * exactly the reference ones. */
static void test_injected_eintr_at_every_io_call_is_retried(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("signals");
    char ref[4200], out[4200];
    tu_path(ref, sizeof ref, t, "ref");
    tu_path(out, sizeof out, t, "out");
    const int64_t small = 4096;
    world *w = world_new(NULL, small);
    world_train(w);
    assert_int_equal(ckpt_save_state(w->acc, ref), 0);
    size_t nref = 0;
    char *want = world_bytes(w, t, &nref);
    world_free(w);
    const unsigned kinds = CKPT_FAULT_OPEN | CKPT_FAULT_WRITE | CKPT_FAULT_FSYNC | CKPT_FAULT_READ;
    int saves = 0, loads = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 10000);
        w = world_new(NULL, small);
        world_train(w);
        ckpt__fault_arm(kinds, n, EINTR, false);
        int rc = ckpt_save_state(w->acc, out);
        bool fired = ckpt__fault_fired();
        ckpt__fault_disarm();
        world_free(w);
        assert_int_equal(rc, 0);
        if (!fired) break;
        assert_same_checkpoint(ref, out);
        saves++;
    }
    for (uint64_t n = 1;; n++) {
        assert_true(n < 10000);
        w = world_new(NULL, small);
        ckpt__fault_arm(kinds, n, EINTR, false);
        int rc = ckpt_load_state(w->acc, ref);
        bool fired = ckpt__fault_fired();
        ckpt__fault_disarm();
        assert_int_equal(rc, 0);
        size_t ngot = 0;
        char *got = world_bytes(w, t, &ngot);
        tu_assert_bytes_equal(got, ngot, want, nref);
        free(got);
        world_free(w);
        if (!fired) break;
        loads++;
    }
    print_message("  an EINTR at each of %d calls of a save and %d of a load\n", saves, loads);
    assert_true(saves >= 10);
    assert_true(loads >= 5);
    free(want);
    tu_tmpdir_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_and_load_under_a_100us_timer_signal),
        cmocka_unit_test(test_save_and_load_under_signals_with_short_writes),
        cmocka_unit_test(test_injected_eintr_at_every_io_call_is_retried),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
