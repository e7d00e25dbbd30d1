/* test_policy.c — when to save: ckpt_should_save's step and time intervals
 * (a replaced clock, so no test waits), the agreement of several processes,
 * and the preemption flag (signals raised on the main thread and on another
 * thread, handlers restored on uninstall, bad arguments refused). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

static double fake_time;
static double fake_clock(void) { return fake_time; }

static ckpt_accelerator *new_acc(const char *dir, int64_t steps, double seconds) {
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = dir;
    cfg.automatic_checkpoint_naming = true;
    cfg.save_interval_steps = steps;
    cfg.save_interval_seconds = seconds;
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    return acc;
}

static void test_step_interval(void **state) {
    (void)state;
    ckpt_accelerator *acc = new_acc(NULL, 5, 0);
    int want[] = {0, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0};
    for (int s = 0; s < (int)(sizeof want / sizeof want[0]); s++)
        assert_int_equal(ckpt_should_save(acc, s), want[s]);
    assert_int_equal(ckpt_should_save(acc, 500), 1);
    assert_int_equal(ckpt_should_save(acc, -1), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "step is -1"));
    ckpt_accelerator_free(acc);
    /* no interval: never, whatever the step */
    acc = new_acc(NULL, 0, 0);
    for (int s = 0; s < 100; s++) assert_int_equal(ckpt_should_save(acc, s), 0);
    ckpt_accelerator_free(acc);
}

/* The time interval runs from creation, then from each save call and each
 * successful load. */
static void test_time_interval(void **state) {
    (void)state;
    ckpt__set_clock(fake_clock);
    fake_time = 1000.0;
    ckpt_accelerator *acc = new_acc(tu_dir(), 0, 10.0);
    fake_time = 1009.9;
    assert_int_equal(ckpt_should_save(acc, 1), 0);
    fake_time = 1010.0;
    assert_int_equal(ckpt_should_save(acc, 2), 1);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    fake_time = 1015.0;
    assert_int_equal(ckpt_should_save(acc, 3), 0);
    fake_time = 1020.5;
    assert_int_equal(ckpt_should_save(acc, 4), 1);
    /* an asynchronous save call restarts it too */
    assert_int_equal(ckpt_save_state_async(acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_should_save(acc, 5), 0);
    assert_int_equal(ckpt_save_wait(acc), CKPT_OK);
    ckpt_accelerator_free(acc);

    /* a resumed run starts its interval at the load */
    fake_time = 2000.0;
    acc = new_acc(tu_dir(), 0, 10.0);
    fake_time = 2050.0;
    assert_int_equal(ckpt_should_save(acc, 0), 1);
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_should_save(acc, 0), 0);
    fake_time = 2060.0;
    assert_int_equal(ckpt_should_save(acc, 0), 1);
    ckpt_accelerator_free(acc);
    ckpt__set_clock(NULL);
}

static void test_bad_config(void **state) {
    (void)state;
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    ckpt_accelerator *acc = NULL;
    cfg.save_interval_steps = -3;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "save_interval_steps is -3"));
    cfg.save_interval_steps = 0;
    double bad[] = {-1.0, NAN, INFINITY};
    for (int i = 0; i < 3; i++) {
        cfg.save_interval_seconds = bad[i];
        assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
        assert_non_null(strstr(ckpt_errmsg(), "save_interval_seconds"));
        assert_null(acc);
    }
    assert_int_equal(ckpt_should_save(NULL, 0), CKPT_EINVAL);
}

static int other_handler_calls;
static void other_handler(int sig) {
    (void)sig;
    other_handler_calls++;
}

static void test_preemption_flag(void **state) {
    (void)state;
    struct sigaction sa, now;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = other_handler;
    sigemptyset(&sa.sa_mask);
    assert_int_equal(sigaction(SIGUSR1, &sa, NULL), 0);

    int sigs[] = {SIGTERM, SIGUSR1};
    assert_int_equal(ckpt_preemption_install(sigs, 2), CKPT_OK);
    assert_false(ckpt_preemption_requested());
    assert_int_equal(ckpt_preemption_signal(), 0);
    ckpt_accelerator *acc = new_acc(NULL, 0, 0);
    assert_int_equal(ckpt_should_save(acc, 7), 0);

    raise(SIGUSR1);
    assert_true(ckpt_preemption_requested());
    assert_int_equal(ckpt_preemption_signal(), SIGUSR1);
    assert_int_equal(ckpt_should_save(acc, 7), 1); /* whatever the intervals */
    raise(SIGTERM); /* the first signal is the one remembered */
    assert_int_equal(ckpt_preemption_signal(), SIGUSR1);
    assert_int_equal(other_handler_calls, 0);

    ckpt_preemption_clear();
    assert_false(ckpt_preemption_requested());
    assert_int_equal(ckpt_should_save(acc, 7), 0);
    ckpt_accelerator_free(acc);

    /* uninstall puts back what was there */
    ckpt_preemption_uninstall();
    assert_int_equal(sigaction(SIGUSR1, NULL, &now), 0);
    assert_ptr_equal(now.sa_handler, other_handler);
    raise(SIGUSR1);
    assert_int_equal(other_handler_calls, 1);
    assert_false(ckpt_preemption_requested());
    assert_int_equal(sigaction(SIGTERM, NULL, &now), 0);
    assert_ptr_equal(now.sa_handler, SIG_DFL);
    signal(SIGUSR1, SIG_DFL);
}

static void *raise_on_thread(void *arg) {
    (void)arg;
    raise(SIGTERM); /* delivered to this thread, not the main one */
    return NULL;
}

/* A signal that lands on another thread (a loader's prefetch thread, say)
 * is seen by the loop's thread. */
static void test_preemption_other_thread(void **state) {
    (void)state;
    int sigs[] = {SIGTERM};
    assert_int_equal(ckpt_preemption_install(sigs, 1), CKPT_OK);
    pthread_t th;
    assert_int_equal(pthread_create(&th, NULL, raise_on_thread, NULL), 0);
    assert_int_equal(pthread_join(th, NULL), 0);
    assert_true(ckpt_preemption_requested());
    assert_int_equal(ckpt_preemption_signal(), SIGTERM);
    ckpt_preemption_uninstall();
    assert_false(ckpt_preemption_requested());
}

static void test_preemption_bad_args(void **state) {
    (void)state;
    int kill9[] = {SIGTERM, SIGKILL};
    assert_int_equal(ckpt_preemption_install(kill9, 2), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "cannot be caught"));
    int stop[] = {SIGSTOP};
    assert_int_equal(ckpt_preemption_install(stop, 1), CKPT_EINVAL);
    int twice[] = {SIGUSR1, SIGUSR1};
    assert_int_equal(ckpt_preemption_install(twice, 2), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "given twice"));
    int zero[] = {0};
    assert_int_equal(ckpt_preemption_install(zero, 1), CKPT_EINVAL);
    assert_int_equal(ckpt_preemption_install(NULL, 1), CKPT_EINVAL);
    int nine[9] = {SIGTERM, SIGUSR1, SIGUSR2, SIGINT, SIGHUP, SIGQUIT, SIGALRM, SIGVTALRM, SIGXCPU};
    assert_int_equal(ckpt_preemption_install(nine, 9), CKPT_EINVAL);
    assert_int_equal(ckpt_preemption_install(nine, 0), CKPT_EINVAL);
    /* nothing was installed by a refused call */
    struct sigaction now;
    assert_int_equal(sigaction(SIGTERM, NULL, &now), 0);
    assert_ptr_equal(now.sa_handler, SIG_DFL);
}

/* Several processes: true on one rank is true on all, at the same step. */
#define P 3
typedef struct {
    int answers[P][12];
    int rc[P];
} agree_state;

static void agree_rank(const ckpt_comm *comm, void *arg) {
    agree_state *s = arg;
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.comm = comm;
    cfg.save_interval_steps = comm->rank == 1 ? 4 : 0; /* only rank 1 would save */
    ckpt_accelerator *acc = NULL;
    s->rc[comm->rank] = ckpt_accelerator_new(&acc, &cfg);
    if (s->rc[comm->rank] < 0) return;
    for (int step = 0; step < 12; step++) s->answers[comm->rank][step] = ckpt_should_save(acc, step);
    ckpt_accelerator_free(acc);
}

static void test_ranks_agree(void **state) {
    (void)state;
    agree_state s;
    memset(&s, 0, sizeof s);
    tc_run(P, agree_rank, &s);
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.rc[r], CKPT_OK);
        for (int step = 0; step < 12; step++)
            assert_int_equal(s.answers[r][step], step > 0 && step % 4 == 0);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_step_interval),
        cmocka_unit_test_setup_teardown(test_time_interval, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test(test_bad_config),
        cmocka_unit_test(test_preemption_flag),
        cmocka_unit_test(test_preemption_other_thread),
        cmocka_unit_test(test_preemption_bad_args),
        cmocka_unit_test(test_ranks_agree),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
