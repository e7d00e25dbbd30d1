/* test_crash.c — crash safety of ckpt_save_state: the N-th I/O call of a
 * save fails (for every N, ENOSPC and EIO, once or from then on), and a
 * process saving in a loop is killed with SIGKILL at random moments. After
 * each, load_state(NULL) returns a complete checkpoint whose values are
 * exactly the ones saved in it, and nothing partial is visible. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "testing/testing.h"
#include "store/store.h"
#include "helpers/testutil.h"

/* ---- state: a counter whose whole content is a function of its value ---- */

typedef struct counter {
    int64_t value;
    float w[64];
} counter;

static void counter_set(counter *c, int64_t v) {
    memset(c, 0, sizeof *c);
    c->value = v;
    for (int i = 0; i < 64; i++) c->w[i] = (float)v + (float)i / 64.0f;
}

static int counter_sd(void *self, ckpt_writer *w) {
    counter *c = self;
    int64_t shape[1] = {64};
    CKPT_TRY(ckpt_write_i64(w, "value", c->value));
    return ckpt_write_tensor(w, "w", CKPT_F32, 1, shape, c->w);
}

static int counter_load(void *self, ckpt_reader *r) {
    counter *c = self;
    counter tmp;
    int64_t shape[1] = {64};
    CKPT_TRY(ckpt_read_i64(r, "value", &tmp.value));
    CKPT_TRY(ckpt_read_tensor(r, "w", CKPT_F32, 1, shape, tmp.w));
    *c = tmp;
    return 0;
}

static const ckpt_stateful_ops counter_ops = {.state_dict = counter_sd,
                                              .load_state_dict = counter_load};

/* A model whose two parameters are also functions of the same value. */
typedef struct run {
    counter c;
    float w1[6], b1[3];
    ckpt_model *model;
    ckpt_accelerator *acc;
    const char *project, *explicit_dir; /* as opened */
    int limit;
} run;

static void quiet(void *user, ckpt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    (void)msg;
}

static void run_set(run *r, int64_t v) {
    counter_set(&r->c, v);
    for (int i = 0; i < 6; i++) r->w1[i] = (float)v * 2.0f + (float)i;
    for (int i = 0; i < 3; i++) r->b1[i] = (float)v * -1.0f + (float)i;
    ckpt_accelerator_set_step(r->acc, v);
}

/* Returns 0 or the failing call's status (usable in a child process). */
static int run_open(run *r, const char *project, int limit, const char *explicit_dir) {
    memset(r, 0, sizeof *r);
    r->project = project;
    r->explicit_dir = explicit_dir;
    r->limit = limit;
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = explicit_dir ? NULL : project;
    cfg.automatic_checkpoint_naming = explicit_dir == NULL;
    cfg.total_limit = limit;
    CKPT_TRY(ckpt_accelerator_new(&r->acc, &cfg));
    ckpt_accelerator_set_log(r->acc, quiet, NULL);
    CKPT_TRY(ckpt_model_new(&r->model));
    int64_t s1[2] = {2, 3}, s2[1] = {3};
    CKPT_TRY(ckpt_model_add_param(r->model, "fc1.weight", CKPT_F32, 2, s1, r->w1, NULL));
    CKPT_TRY(ckpt_model_add_param(r->model, "fc1.bias", CKPT_F32, 1, s2, r->b1, NULL));
    CKPT_TRY(ckpt_prepare_model(r->acc, r->model));
    CKPT_TRY(ckpt_register_for_checkpointing(r->acc, &counter_ops, &r->c));
    run_set(r, -1);
    return 0;
}

static void run_close(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_model_free(r->model);
}

/* One run per project: a fresh run can load only once r is freed, so r
 * ends and starts again with the same objects (its values are set anew by
 * the next run_set). */
static void run_reopen(run *r) {
    const char *project = r->project, *explicit_dir = r->explicit_dir;
    int limit = r->limit;
    run_close(r);
    assert_int_equal(run_open(r, project, limit, explicit_dir), 0);
}

/* The loaded state is exactly what run_set(v) makes, for v = the step. */
static bool run_consistent(run *r) {
    run expect;
    memset(&expect, 0, sizeof expect);
    int64_t v = r->c.value;
    counter_set(&expect.c, v);
    for (int i = 0; i < 6; i++) expect.w1[i] = (float)v * 2.0f + (float)i;
    for (int i = 0; i < 3; i++) expect.b1[i] = (float)v * -1.0f + (float)i;
    return memcmp(&expect.c, &r->c, sizeof r->c) == 0 &&
           memcmp(expect.w1, r->w1, sizeof r->w1) == 0 &&
           memcmp(expect.b1, r->b1, sizeof r->b1) == 0 && ckpt_accelerator_step(r->acc) == v;
}

/* Loads with a fresh run; returns the loaded value, or -1000 + status. */
static int64_t load_fresh(const char *project, const char *explicit_dir) {
    run r;
    assert_int_equal(run_open(&r, project, 0, explicit_dir), 0);
    int rc = ckpt_load_state(r.acc, explicit_dir);
    int64_t v = rc == 0 ? r.c.value : -1000 + rc;
    if (rc == 0 && !run_consistent(&r)) fail_msg("loaded state for value %lld is inconsistent", (long long)v);
    run_close(&r);
    return v;
}

/* Every visible checkpoint_<n> folder verifies completely. */
static void assert_all_complete(const char *project) {
    ckpt_checkpoint_info *infos = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_checkpoint_list(project, true, &infos, &n), 0);
    for (int64_t i = 0; i < n; i++)
        if (infos[i].status != CKPT_CHECKPOINT_COMPLETE)
            fail_msg("%s is visible but not complete (status %d)", infos[i].path, infos[i].status);
    free(infos);
}

static int status_of(int errnum) { return errnum == ENOSPC ? CKPT_ENOSPC : CKPT_EIO; }

/* ---- the N-th I/O call fails ---------------------------------------------- */

/* A sweep of injected faults: for n = 1, 2, ... a save of value 100 + n
 * with its n-th I/O call failing with `errnum` (and, if `persist`, every
 * call after it), until a save runs without reaching the fault. */
typedef struct fault_sweep {
    int errnum;
    bool persist;
    const char *save_dir;   /* the folder saves go to (NULL: automatic saves) */
    const char *project;    /* the project loads look in (NULL: save_dir) */
    const char *tmp_parent; /* holds no temporary entry after a failed save */
    bool check_status;      /* a failed save returns status_of(errnum) */
} fault_sweep;

/* Runs the sweep on r, whose newest committed value is *latest (updated).
 * After every save, a fresh run loads exactly the newest committed value
 * (never half old, half new) and, with a project, every visible checkpoint
 * is complete. Returns the number of failed saves. */
static int run_fault_sweep(run *r, const fault_sweep *fs, int64_t *latest) {
    int failures = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 1000);
        int64_t v = 100 + (int64_t)n;
        run_set(r, v);
        ckpt__fault_arm(CKPT_FAULT_ANY, n, fs->errnum, fs->persist);
        int rc = ckpt_save_state(r->acc, fs->save_dir);
        bool fired = ckpt__fault_fired();
        ckpt__fault_disarm();
        if (!fired) {
            assert_int_equal(rc, 0);
            *latest = v;
            return failures;
        }
        if (rc < 0) {
            if (fs->check_status && rc != status_of(fs->errnum))
                fail_msg("N=%llu: save returned %d (%s)", (unsigned long long)n, rc, ckpt_errmsg());
            failures++;
            /* Nothing partial, not even a temporary folder. */
            assert_int_equal(tu_count_hidden_tmp(fs->tmp_parent), 0);
        } else {
            /* A fault the save could absorb (a folder that already exists,
             * a rotation left for later): the new checkpoint is committed. */
            *latest = v;
        }
        run_reopen(r);
        assert_int_equal(load_fresh(fs->project, fs->save_dir), *latest);
        if (fs->project) assert_all_complete(fs->project);
    }
}

static void fault_every_call_of_automatic_saves(int errnum, bool persist) {
    char *t = tu_tmpdir_new("crash");
    char cd[4200];
    tu_path(cd, sizeof cd, t, "checkpoints");
    run r;
    assert_int_equal(run_open(&r, t, 2, NULL), 0);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    run_set(&r, 2);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    int64_t latest = 2;
    fault_sweep fs = {.errnum = errnum, .persist = persist, .save_dir = NULL, .project = t,
                      .tmp_parent = cd, .check_status = true};
    int failures = run_fault_sweep(&r, &fs, &latest);
    if (getenv("CKPT_TEST_VERBOSE"))
        print_message("  %d failing saves out of %d calls\n", failures, failures + 1);
    assert_true(failures >= 10);
    /* The next successful save leaves no leftover at all. */
    run_set(&r, 5000);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(r.acc), 0); /* rotated folders go in the background */
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    run_reopen(&r);
    assert_int_equal(load_fresh(t, NULL), 5000);
    run_close(&r);
    tu_tmpdir_free(t);
}

static void test_save_fault_at_every_io_call_enospc(void **st) {
    (void)st;
    fault_every_call_of_automatic_saves(ENOSPC, false);
}

static void test_save_fault_at_every_io_call_eio(void **st) {
    (void)st;
    fault_every_call_of_automatic_saves(EIO, false);
}

static void test_save_persistent_fault_from_every_io_call_enospc(void **st) {
    (void)st;
    fault_every_call_of_automatic_saves(ENOSPC, true);
}

static void test_explicit_replace_fault_at_every_io_call_keeps_old_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("crash");
    char dir[4200];
    tu_path(dir, sizeof dir, t, "best");
    run r;
    assert_int_equal(run_open(&r, NULL, 0, dir), 0);
    run_set(&r, 7);
    assert_int_equal(ckpt_save_state(r.acc, dir), 0);
    int64_t latest = 7;
    fault_sweep fs = {.errnum = EIO, .persist = false, .save_dir = dir, .project = NULL,
                      .tmp_parent = t, .check_status = false};
    int failures = run_fault_sweep(&r, &fs, &latest);
    assert_true(failures >= 10);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- SIGKILL at random moments ------------------------------------------- */

/* The child: resume from the newest checkpoint, then save forever, writing
 * one byte to `done` after each completed save. */
static void save_loop_child(const char *project, int done) {
    run r;
    if (run_open(&r, project, 3, NULL) != 0) _exit(2);
    int64_t v = 0;
    int rc = ckpt_load_state(r.acc, NULL);
    if (rc == 0) {
        if (!run_consistent(&r)) _exit(3);
        v = r.c.value;
    } else if (rc != CKPT_ENOENT) {
        _exit(4);
    }
    for (;;) {
        v++;
        run_set(&r, v);
        if (ckpt_save_state(r.acc, NULL) != 0) _exit(5);
        if (write(done, "s", 1) != 1) _exit(6);
    }
}

static void test_sigkill_during_save_loop_never_leaves_a_partial_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("crash");
    unsigned seed = 12345;
    int64_t last = 0;
    int rounds_with_checkpoint = 0, mid_save = 0;
    for (int round = 0; round < 30; round++) {
        int done[2];
        assert_int_equal(pipe(done), 0);
        pid_t pid = fork();
        assert_true(pid >= 0);
        if (pid == 0) {
            close(done[0]);
            save_loop_child(t, done[1]);
        }
        close(done[1]);
        /* Every other round waits for one completed save first, so the run
         * makes progress however slow fsync is; the others kill at any time,
         * from the start of the process on. */
        char byte;
        if (round % 2 == 1 && read(done[0], &byte, 1) != 1)
            fail_msg("round %d: the child stopped before saving", round);
        struct timespec d = {0, (long)(rand_r(&seed) % 21) * 1000000L};
        nanosleep(&d, NULL);
        assert_int_equal(kill(pid, SIGKILL), 0);
        int status = 0;
        assert_int_equal(waitpid(pid, &status, 0), pid);
        close(done[0]);
        if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL))
            fail_msg("round %d: the child exited by itself (status %d)", round, status);
        char cd[4200];
        tu_path(cd, sizeof cd, t, "checkpoints");
        if (tu_count_hidden_tmp(cd) > 0) mid_save++;
        int64_t v = load_fresh(t, NULL);
        if (v == -1000 + CKPT_ENOENT) {
            assert_int_equal(last, 0); /* nothing saved yet: only possible early */
            continue;
        }
        if (v < 0) fail_msg("round %d: load_state(NULL) failed: %s", round, ckpt_errmsg());
        /* Progress is monotonic: a later round never sees an older state. */
        assert_true(v >= last);
        last = v;
        rounds_with_checkpoint++;
        assert_all_complete(t);
    }
    if (getenv("CKPT_TEST_VERBOSE"))
        print_message("  %d rounds with a checkpoint, %d killed mid-save, last value %lld\n",
                      rounds_with_checkpoint, mid_save, (long long)last);
    assert_true(rounds_with_checkpoint >= 15);
    /* The next successful save removes whatever the kills left behind. */
    run r;
    assert_int_equal(run_open(&r, t, 3, NULL), 0);
    assert_int_equal(ckpt_load_state(r.acc, NULL), 0);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(r.acc), 0); /* rotated folders go in the background */
    char cd[4200];
    tu_path(cd, sizeof cd, t, "checkpoints");
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    run_close(&r);
    tu_tmpdir_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_fault_at_every_io_call_enospc),
        cmocka_unit_test(test_save_fault_at_every_io_call_eio),
        cmocka_unit_test(test_save_persistent_fault_from_every_io_call_enospc),
        cmocka_unit_test(test_explicit_replace_fault_at_every_io_call_keeps_old_checkpoint),
        cmocka_unit_test(test_sigkill_during_save_loop_never_leaves_a_partial_checkpoint),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
