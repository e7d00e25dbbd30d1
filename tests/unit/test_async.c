/* test_async.c — ckpt_save_state_async / ckpt_save_wait: what is saved is the
 * state at the call, whatever changes after it; the background failure of
 * every I/O call reaches the next wait (and the log at once) with nothing
 * partial visible and the previous checkpoint loading; two saves in a row,
 * a load or a free while one is pending; the staging limit; several
 * processes (threads as ranks) with the communicator used only from the
 * ranks' own threads. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <errno.h>
#include <glob.h>
#include <pthread.h>
#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "testing/testing.h"
#include "format/manifest.h"
#include "store/store.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

/* ---- state: a counter whose whole content is a function of its value ---- */

#define BIG (1 << 18) /* floats: 1 MiB, so a background write takes a while */

typedef struct counter {
    int64_t value;
    float *w; /* BIG */
} counter;

static void counter_set(counter *c, int64_t v) {
    c->value = v;
    for (int i = 0; i < BIG; i++) c->w[i] = (float)v + (float)(i % 1024) / 1024.0f;
}

static int counter_sd(void *self, ckpt_writer *w) {
    counter *c = self;
    int64_t shape[1] = {BIG};
    CKPT_TRY(ckpt_write_i64(w, "value", c->value));
    return ckpt_write_tensor(w, "w", CKPT_F32, 1, shape, c->w);
}

static int counter_load(void *self, ckpt_reader *r) {
    counter *c = self;
    int64_t shape[1] = {BIG};
    CKPT_TRY(ckpt_read_i64(r, "value", &c->value));
    return ckpt_read_tensor(r, "w", CKPT_F32, 1, shape, c->w);
}

static const ckpt_stateful_ops counter_ops = {.state_dict = counter_sd,
                                              .load_state_dict = counter_load};

/* What the log callback received (written by the background thread, read
 * after a wait, which orders the two). */
typedef struct logbook {
    int errors, warnings;
    char last_error[2048];
} logbook;

static void log_to_book(void *user, ckpt_log_level level, const char *msg) {
    logbook *b = user;
    if (level == CKPT_LOG_ERROR) {
        b->errors++;
        snprintf(b->last_error, sizeof b->last_error, "%s", msg);
    } else {
        b->warnings++;
    }
}

/* A model of two small parameters and the counter, all functions of v. */
typedef struct run {
    counter c;
    float p[6];
    ckpt_model *model;
    ckpt_accelerator *acc;
    logbook log;
} run;

static void run_set(run *r, int64_t v) {
    counter_set(&r->c, v);
    for (int i = 0; i < 6; i++) r->p[i] = (float)v * 2.0f + (float)i;
    ckpt_accelerator_set_step(r->acc, v);
}

static void run_open(run *r, const char *project, const char *explicit_dir) {
    memset(r, 0, sizeof *r);
    r->c.w = malloc(sizeof(float) * BIG);
    assert_non_null(r->c.w);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = explicit_dir ? NULL : project;
    cfg.automatic_checkpoint_naming = explicit_dir == NULL;
    /* every save makes the same I/O calls (the fault tests count them):
     * an unchanged file is linked at every save, never copied once more */
    cfg.link_copies = 1;
    assert_int_equal(ckpt_accelerator_new(&r->acc, &cfg), 0);
    ckpt_accelerator_set_log(r->acc, log_to_book, &r->log);
    assert_int_equal(ckpt_model_new(&r->model), 0);
    assert_int_equal(
        ckpt_model_add_param(r->model, "p", CKPT_F32, 1, (int64_t[]){6}, r->p, NULL), 0);
    assert_int_equal(ckpt_prepare_model(r->acc, r->model), 0);
    assert_int_equal(ckpt_register_for_checkpointing(r->acc, &counter_ops, &r->c), 0);
    run_set(r, -1);
}

static void run_close(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_model_free(r->model);
    free(r->c.w);
}

/* The state is exactly what run_set(v) makes, v being the loaded step. */
static bool run_consistent(const run *r) {
    int64_t v = r->c.value;
    if (ckpt_accelerator_step(r->acc) != v) return false;
    for (int i = 0; i < 6; i++)
        if (r->p[i] != (float)v * 2.0f + (float)i) return false;
    for (int i = 0; i < BIG; i++)
        if (r->c.w[i] != (float)v + (float)(i % 1024) / 1024.0f) return false;
    return true;
}

/* Loads dir (NULL: the project's newest complete checkpoint) with a fresh
 * run that owns no project (the run under test owns it); the value, or
 * -1000 + the status. */
static int64_t load_fresh(const char *project, const char *dir) {
    char newest[4200] = "";
    if (!dir) {
        ckpt_checkpoint_info *infos = NULL;
        int64_t count = 0;
        assert_int_equal(ckpt_checkpoint_list(project, true, &infos, &count), 0);
        for (int64_t i = 0; i < count; i++)
            if (infos[i].status == CKPT_CHECKPOINT_COMPLETE)
                snprintf(newest, sizeof newest, "%s", infos[i].path);
        free(infos);
        if (!newest[0]) return -1000 + CKPT_ENOENT;
        dir = newest;
    }
    run r;
    run_open(&r, NULL, dir);
    int rc = ckpt_load_state(r.acc, dir);
    int64_t v = rc == 0 ? r.c.value : -1000 + rc;
    if (rc == 0 && !run_consistent(&r)) fail_msg("loaded state of value %lld is inconsistent", (long long)v);
    run_close(&r);
    return v;
}

/* "<project>/checkpoints/checkpoint_<n>" in one of a few static buffers
 * (the tests use at most two at once). */
static const char *cp_dir(const char *project, int n) {
    static char bufs[4][4200];
    static int next;
    char *b = bufs[next++ % 4];
    snprintf(b, sizeof bufs[0], "%s/checkpoints/checkpoint_%d", project, n);
    return b;
}

/* Every visible checkpoint verifies; n of them; no temporary folder left. */
static void assert_checkpoints(const char *project, int64_t n) {
    ckpt_checkpoint_info *infos = NULL;
    int64_t count = 0;
    assert_int_equal(ckpt_checkpoint_list(project, true, &infos, &count), 0);
    for (int64_t i = 0; i < count; i++)
        if (infos[i].status != CKPT_CHECKPOINT_COMPLETE)
            fail_msg("%s is visible but not complete (status %d)", infos[i].path, infos[i].status);
    free(infos);
    assert_int_equal(count, n);
    char *cd = tu_pathf("%s/checkpoints", project);
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    free(cd);
}

/* ---- the snapshot is the state at the call ---------------------------------- */

static void test_changes_after_the_call_are_not_saved(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    /* At once: the background thread is still writing. */
    run_set(&r, 2);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_int_equal(r.log.errors, 0);
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), cp_dir(t, 0));
    assert_checkpoints(t, 1);
    assert_int_equal(load_fresh(t, NULL), 1);
    /* The same bytes as a synchronous save of the same state. */
    run_set(&r, 1);
    char *sync_dir = tu_pathf("%s/sync", t);
    assert_int_equal(ckpt_save_state(r.acc, sync_dir), 0);
    char *a = tu_pathf("%s/custom_checkpoint_0.safetensors", cp_dir(t, 0));
    char *b = tu_pathf("%s/custom_checkpoint_0.safetensors", sync_dir);
    tu_assert_same_file(a, b, "async vs sync custom_checkpoint_0");
    free(a), free(b);
    a = tu_pathf("%s/model.safetensors", cp_dir(t, 0));
    b = tu_pathf("%s/model.safetensors", sync_dir);
    tu_assert_same_file(a, b, "async vs sync model");
    free(a), free(b), free(sync_dir);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- two saves, a load, a free while one is pending ------------------------- */

static void test_two_async_saves_in_a_row_get_consecutive_numbers(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    assert_int_equal(ckpt_accelerator_iteration(r.acc), 1); /* counted at the call */
    run_set(&r, 2);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0); /* waits for the first */
    assert_int_equal(ckpt_accelerator_iteration(r.acc), 2);
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), cp_dir(t, 0));
    run_set(&r, 3);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), cp_dir(t, 1));
    assert_int_equal(ckpt_save_wait(r.acc), 0); /* nothing pending: OK */
    assert_checkpoints(t, 2);
    assert_int_equal(load_fresh(t, cp_dir(t, 0)), 1);
    assert_int_equal(load_fresh(t, cp_dir(t, 1)), 2);
    /* A synchronous save after an asynchronous one waits for it too. */
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    run_set(&r, 4);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    assert_checkpoints(t, 4);
    assert_int_equal(load_fresh(t, cp_dir(t, 2)), 3);
    assert_int_equal(load_fresh(t, NULL), 4);
    run_close(&r);
    tu_tmpdir_free(t);
}

static void test_load_while_pending_loads_the_pending_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    run_set(&r, 2);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    run_set(&r, 3);
    assert_int_equal(ckpt_load_state(r.acc, NULL), 0); /* waits, then loads checkpoint_1 */
    assert_int_equal(r.c.value, 2);
    assert_true(run_consistent(&r));
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), cp_dir(t, 1));
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* The number of I/O calls an asynchronous save + wait makes here (the
 * project lock already held: a save before it took it). */
static uint64_t count_io_calls(run *r) {
    ckpt__fault_arm(CKPT_FAULT_ANY, UINT64_MAX, EIO, false);
    assert_int_equal(ckpt_save_state_async(r->acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(r->acc), 0);
    uint64_t n = ckpt__fault_count();
    ckpt__fault_disarm();
    return n;
}

static void test_a_failed_pending_save_does_not_stop_a_load_and_reaches_the_wait(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0); /* checkpoint_0 */
    /* counted on a changed state, as the save below (an unchanged file is
     * linked and read back: other calls) */
    run_set(&r, 5);
    uint64_t calls = count_io_calls(&r); /* checkpoint_1 */
    run_set(&r, 2);
    /* The last call (the final folder fsync) is made by the background thread. */
    ckpt__fault_arm(CKPT_FAULT_ANY, calls, EIO, false);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    assert_int_equal(ckpt_load_state(r.acc, NULL), 0);
    assert_true(ckpt__fault_fired());
    ckpt__fault_disarm();
    assert_int_equal(r.c.value, 5); /* checkpoint_2 was never committed */
    assert_true(run_consistent(&r));
    assert_int_equal(r.log.errors, 1);
    ckpt_clear_error();
    assert_int_equal(ckpt_save_wait(r.acc), CKPT_EIO);
    tu_assert_contains(r.log.last_error, ckpt_errmsg());
    tu_assert_errmsg_has("checkpoint_2");
    assert_int_equal(ckpt_save_wait(r.acc), 0); /* returned once */
    assert_int_equal(ckpt_accelerator_iteration(r.acc), 2); /* the number is given back */
    assert_checkpoints(t, 2);
    run_close(&r);
    tu_tmpdir_free(t);
}

static void test_free_while_pending_commits_the_save(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 5);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    run_set(&r, 6);
    run_close(&r);
    assert_checkpoints(t, 1);
    assert_int_equal(load_fresh(t, NULL), 5);
    /* and a failing one: logged at once, nothing visible */
    run_open(&r, t, NULL);
    run_set(&r, 7);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0); /* checkpoint_1 */
    uint64_t calls = count_io_calls(&r);               /* checkpoint_2 */
    ckpt__fault_arm(CKPT_FAULT_ANY, calls, ENOSPC, false);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    ckpt_accelerator_free(r.acc);
    r.acc = NULL;
    assert_true(ckpt__fault_fired());
    ckpt__fault_disarm();
    assert_int_equal(r.log.errors, 1);
    tu_assert_contains(r.log.last_error, "checkpoint_3");
    run_close(&r);
    assert_checkpoints(t, 3);
    assert_int_equal(load_fresh(t, NULL), 7);
    tu_tmpdir_free(t);
}

/* A failure of the call itself is returned by the call; nothing is pending. */
static void test_a_failure_at_the_call_is_returned_by_the_call(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    char *dir = tu_pathf("%s/notes", t);
    tu_assert_contains(dir, "notes");
    char *f = tu_pathf("%s/notes/todo.txt", t);
    assert_int_equal(ckpt__mkdirs(dir), 0);
    tu_write_text(f, "mine");
    run r;
    run_open(&r, NULL, dir);
    tu_expect_error(ckpt_save_state_async(r.acc, dir), CKPT_EEXIST, "not a checkpoint");
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    tu_assert_file_text(f, "mine");
    assert_int_equal(r.log.errors, 0);
    run_close(&r);
    free(dir), free(f);
    tu_tmpdir_free(t);
}

/* ---- every I/O call of the background path fails once --------------------- */

static void sweep(int errnum) {
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    int64_t latest = 1, ncommitted = 1;
    int at_call = 0, background = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 1000);
        int64_t v = 100 + (int64_t)n;
        run_set(&r, v);
        int errors_before = r.log.errors;
        ckpt__fault_arm(CKPT_FAULT_ANY, n, errnum, false);
        int rc1 = ckpt_save_state_async(r.acc, NULL);
        run_set(&r, -v); /* the caller goes on training */
        ckpt_clear_error();
        int rc2 = rc1 < 0 ? 0 : ckpt_save_wait(r.acc);
        bool fired = ckpt__fault_fired();
        ckpt__fault_disarm();
        if (!fired) {
            assert_int_equal(rc1, 0);
            assert_int_equal(rc2, 0);
            latest = v;
            ncommitted++;
            break;
        }
        int want = errnum == ENOSPC ? CKPT_ENOSPC : CKPT_EIO;
        if (rc1 < 0) { /* in the caller's part: as a synchronous save */
            assert_int_equal(rc1, want);
            assert_int_equal(r.log.errors, errors_before);
            at_call++;
        } else if (rc2 < 0) {
            if (rc2 != want) fail_msg("N=%llu: wait returned %d (%s)", (unsigned long long)n, rc2, ckpt_errmsg());
            /* logged once, from the background, with the message the wait gives */
            assert_int_equal(r.log.errors, errors_before + 1);
            assert_true(ckpt_errmsg()[0] != '\0');
            tu_assert_contains(r.log.last_error, ckpt_errmsg());
            background++;
        } else {
            /* a fault the save absorbs (a leftover it could not remove) */
            latest = v;
            ncommitted++;
        }
        /* nothing partial, the newest committed checkpoint loads */
        assert_checkpoints(t, ncommitted);
        assert_int_equal(load_fresh(t, NULL), latest);
    }
    if (getenv("CKPT_TEST_VERBOSE"))
        print_message("  %d failures at the call, %d in the background\n", at_call, background);
    assert_true(background >= 6);
    /* the next save works and leaves nothing else behind */
    run_set(&r, 5000);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_checkpoints(t, ncommitted + 1);
    assert_int_equal(load_fresh(t, NULL), 5000);
    run_close(&r);
    tu_tmpdir_free(t);
}

static void test_every_background_io_call_failing_enospc_reaches_the_wait(void **st) {
    (void)st;
    sweep(ENOSPC);
}

static void test_every_background_io_call_failing_eio_reaches_the_wait(void **st) {
    (void)st;
    sweep(EIO);
}

/* The next save, not only the wait, returns a background failure (and does
 * not save); the one after saves. */
static void test_the_next_save_returns_a_background_failure(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0); /* checkpoint_0 */
    uint64_t calls = count_io_calls(&r);               /* checkpoint_1 */
    ckpt__fault_arm(CKPT_FAULT_ANY, calls - 1, ENOSPC, false);
    run_set(&r, 2);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    run_set(&r, 3);
    tu_expect_error(ckpt_save_state_async(r.acc, NULL), CKPT_ENOSPC, "checkpoint_2");
    assert_true(ckpt__fault_fired());
    ckpt__fault_disarm();
    assert_checkpoints(t, 2);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), cp_dir(t, 2));
    assert_checkpoints(t, 3);
    assert_int_equal(load_fresh(t, NULL), 3);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- the staging limit ------------------------------------------------------- */

static void test_past_the_staging_limit_files_are_written_at_the_call(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    /* Room for the model and the random state, not for the counter's 1 MiB. */
    assert_int_equal(ckpt_accelerator_set_async_staging_limit(r.acc, 64 * 1024), 0);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    /* The counter's file is already in the temporary folder (or committed). */
    char *pat = tu_pathf("%s/checkpoints/.checkpoint_0.tmp*/custom_checkpoint_0.safetensors", t);
    char *done = tu_pathf("%s/custom_checkpoint_0.safetensors", cp_dir(t, 0));
    glob_t g;
    bool there = glob(pat, 0, NULL, &g) == 0;
    if (there) globfree(&g);
    assert_true(there || tu_exists(done));
    run_set(&r, 2);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_checkpoints(t, 1);
    assert_int_equal(load_fresh(t, NULL), 1);
    /* A limit of one byte: everything is written at the call. */
    assert_int_equal(ckpt_accelerator_set_async_staging_limit(r.acc, 1), 0);
    run_set(&r, 3);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    run_set(&r, 4);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_checkpoints(t, 2);
    assert_int_equal(load_fresh(t, NULL), 3);
    free(pat), free(done);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- a prepared staging area ------------------------------------------------- */

/* Page faults of the calling thread so far (minor: memory first touched). */
static long thread_faults(void) {
    struct rusage ru;
    assert_int_equal(getrusage(RUSAGE_THREAD, &ru), 0);
    return ru.ru_minflt;
}

/* After ckpt_accelerator_prepare_async (and the wait for its background
 * touch), the first asynchronous save copies into pages that are already
 * there: it takes far fewer page faults than the staging area has pages,
 * where an unprepared first save takes one per page. Counted, not timed. */
static void test_a_prepared_first_save_takes_no_page_faults_for_staging(void **st) {
    (void)st;
    long pages = (long)(sizeof(float) * BIG) / 4096; /* the counter's tensor */
    long faults[2];
    for (int prepared = 0; prepared < 2; prepared++) {
        char *t = tu_tmpdir_new("async");
        run r;
        run_open(&r, t, NULL);
        run_set(&r, 1);
        if (prepared) {
            assert_int_equal(ckpt_accelerator_prepare_async(r.acc), 0);
            assert_int_equal(ckpt_save_wait(r.acc), 0); /* the touch is done */
        }
        long f0 = thread_faults();
        assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
        faults[prepared] = thread_faults() - f0;
        run_set(&r, 2);
        assert_int_equal(ckpt_save_wait(r.acc), 0);
        assert_int_equal(load_fresh(t, NULL), 1);
        run_close(&r);
        tu_tmpdir_free(t);
    }
    print_message("staging pages %ld: first-save faults unprepared %ld, prepared %ld\n", pages,
                  faults[0], faults[1]);
    if (faults[0] < pages) fail_msg("unprepared: %ld faults for %ld pages", faults[0], pages);
    if (faults[1] >= pages / 2)
        fail_msg("prepared: %ld faults for %ld staging pages (unprepared: %ld)", faults[1], pages,
                 faults[0]);
}

static int failing_sd(void *self, ckpt_writer *w) {
    (void)self, (void)w;
    ckpt__err(CKPT_EIO, "sensor offline");
    return CKPT_EIO;
}

static int ignore_load(void *self, ckpt_reader *r) {
    (void)self, (void)r;
    return 0;
}

/* A state_dict that fails while the area is sized is returned, named. */
static void test_prepare_async_names_a_failing_state_dict(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    static const ckpt_stateful_ops bad = {.state_dict = failing_sd, .load_state_dict = ignore_load};
    int dummy = 0;
    assert_int_equal(ckpt_register_for_checkpointing(r.acc, &bad, &dummy), 0);
    assert_int_equal(ckpt_accelerator_prepare_async(r.acc), CKPT_EIO);
    assert_non_null(strstr(ckpt_errmsg(), "custom_checkpoint_1"));
    assert_non_null(strstr(ckpt_errmsg(), "sensor offline"));
    assert_int_equal(ckpt_accelerator_prepare_async(NULL), CKPT_EINVAL);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* The writer's classes: unknown bits refused; saves at either setting are
 * the same checkpoints, and a wait on an idle-class job returns. */
static void test_async_background_classes(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    assert_int_equal(ckpt_accelerator_set_async_background(r.acc, 0x10), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "unknown bits 0x10"));
    assert_int_equal(ckpt_accelerator_set_async_background(NULL, 0), CKPT_EINVAL);
    const unsigned modes[] = {CKPT_ASYNC_IDLE, 0, CKPT_ASYNC_CPU_IDLE, CKPT_ASYNC_IO_IDLE};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(ckpt_accelerator_set_async_background(r.acc, modes[i]), 0);
        run_set(&r, i + 1);
        assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
        run_set(&r, 100);
        assert_int_equal(ckpt_save_wait(r.acc), 0);
        assert_int_equal(load_fresh(t, NULL), i + 1);
    }
    assert_int_equal(r.log.errors, 0);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- hooks ------------------------------------------------------------------ */

typedef struct hook_log {
    int pre, post;
    bool post_in_caller;
    pthread_t caller;
    char pre_dir[4200], post_dir[4200];
} hook_log;

static int pre_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)acc;
    hook_log *h = user;
    h->pre++;
    snprintf(h->pre_dir, sizeof h->pre_dir, "%s", dir);
    return 0;
}

static int post_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)acc;
    hook_log *h = user;
    h->post++;
    h->post_in_caller = pthread_equal(pthread_self(), h->caller);
    snprintf(h->post_dir, sizeof h->post_dir, "%s", dir);
    return 0;
}

/* Pre-hooks at the call (with the temporary folder), post-hooks when the
 * save is waited for, in the waiting thread, with the final folder. */
static void test_hooks_run_at_the_call_and_at_the_wait(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    hook_log h;
    memset(&h, 0, sizeof h);
    h.caller = pthread_self();
    assert_int_equal(ckpt_register_save_state_pre_hook(r.acc, pre_hook, &h, NULL), 0);
    assert_int_equal(ckpt_register_save_state_post_hook(r.acc, post_hook, &h, NULL), 0);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    assert_int_equal(h.pre, 1);
    tu_assert_contains(h.pre_dir, "/checkpoints/.checkpoint_0.tmp");
    assert_int_equal(h.post, 0);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_int_equal(h.post, 1);
    assert_true(h.post_in_caller);
    assert_string_equal(h.post_dir, cp_dir(t, 0));
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- the verified load's read ----------------------------------------------- */

/* Files read into the buffers (pread, hashed piece by piece), warm or not:
 * the values, the refusal of a flipped byte naming the tensor, the
 * fallback. */
static void test_load_through_the_hashed_read(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    run_set(&r, 2);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    run_set(&r, 3);
    assert_int_equal(ckpt_load_state(r.acc, NULL), 0);
    assert_int_equal(r.c.value, 2);
    assert_true(run_consistent(&r));
    /* a flipped byte in the middle of the counter's tensor of checkpoint_1 */
    char *f = tu_pathf("%s/custom_checkpoint_0.safetensors", cp_dir(t, 1));
    tu_flip_byte(f, tu_file_size(f) / 2);
    tu_expect_error(ckpt_load_state(r.acc, cp_dir(t, 1)), CKPT_ECORRUPT, "tensor 'w': checksum mismatch");
    assert_int_equal(r.c.value, 2); /* nothing changed */
    assert_true(run_consistent(&r));
    assert_int_equal(ckpt_load_state(r.acc, NULL), 0); /* falls back to checkpoint_0 */
    assert_int_equal(r.c.value, 1);
    assert_true(run_consistent(&r));
    assert_int_equal(r.log.warnings, 1);
    free(f);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- ckpt_save_poll ----------------------------------------------------------- */

/* A gate the background writer stops at: the recorder (called after each
 * mutating I/O call, from the thread that made it) holds the first call on
 * a path containing `hold` until the gate opens. */
typedef struct gate {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    const char *hold;
    bool open, held;
} gate;

static gate the_gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, NULL, false, false};

static void gate_record(void *user, const ckpt_io_event *ev) {
    gate *g = user;
    if (!ev->path || !g->hold || !strstr(ev->path, g->hold)) return;
    pthread_mutex_lock(&g->mu);
    g->held = true;
    pthread_cond_broadcast(&g->cv);
    while (!g->open) pthread_cond_wait(&g->cv, &g->mu);
    pthread_mutex_unlock(&g->mu);
}

static void gate_close(const char *hold) {
    pthread_mutex_lock(&the_gate.mu);
    the_gate.hold = hold;
    the_gate.open = false;
    the_gate.held = false;
    pthread_mutex_unlock(&the_gate.mu);
    ckpt__io_set_recorder(gate_record, &the_gate);
}

static void gate_wait_held(void) {
    pthread_mutex_lock(&the_gate.mu);
    while (!the_gate.held) pthread_cond_wait(&the_gate.cv, &the_gate.mu);
    pthread_mutex_unlock(&the_gate.mu);
}

static void gate_open(void) {
    pthread_mutex_lock(&the_gate.mu);
    the_gate.open = true;
    pthread_cond_broadcast(&the_gate.cv);
    pthread_mutex_unlock(&the_gate.mu);
}

static void gate_remove(void) {
    ckpt__io_set_recorder(NULL, NULL);
    gate_open();
}

/* Polls until the answer is not 0 (the background job finishing is only a
 * matter of time once its gate is open). */
static int poll_until_done(ckpt_accelerator *acc) {
    for (;;) {
        int rc = ckpt_save_poll(acc);
        if (rc != 0) return rc;
        usleep(1000);
    }
}

/* One process: 0 while the files are being written (at once, however long
 * the write takes), then 1 with the checkpoint committed and applied; a
 * background failure is returned once, then 1. */
static void test_poll_never_waits_and_commits_a_finished_save(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    run r;
    run_open(&r, t, NULL);
    assert_int_equal(ckpt_save_poll(r.acc), 1); /* nothing pending */
    run_set(&r, 1);
    gate_close("custom_checkpoint_0");
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    gate_wait_held(); /* the writer is stopped inside the save */
    for (int k = 0; k < 3; k++) assert_int_equal(ckpt_save_poll(r.acc), 0);
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), "");
    gate_open();
    assert_int_equal(poll_until_done(r.acc), 1);
    gate_remove();
    assert_string_equal(ckpt_accelerator_last_dir(r.acc), cp_dir(t, 0));
    assert_checkpoints(t, 1);
    assert_int_equal(load_fresh(t, NULL), 1);
    assert_int_equal(ckpt_save_poll(r.acc), 1);
    /* a failure in the background: returned by a poll, once */
    run_set(&r, 2);
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 1, EIO, true);
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), 0);
    tu_expect_error(poll_until_done(r.acc), CKPT_EIO, NULL);
    ckpt__fault_disarm();
    assert_int_equal(ckpt_save_poll(r.acc), 1);
    assert_int_equal(ckpt_save_wait(r.acc), 0);
    assert_checkpoints(t, 1);
    run_close(&r);
    tu_tmpdir_free(t);
}

/* ---- several processes (threads as ranks) ---------------------------------- */

#define P 3

/* A communicator that forwards to the thread one and counts the calls made
 * from any thread but the rank's own. */
typedef struct watched {
    ckpt_comm comm;
    const ckpt_comm *inner;
    pthread_t owner;
    int foreign;
} watched;

static void watch(const watched *w) {
    if (!pthread_equal(pthread_self(), w->owner)) ((watched *)w)->foreign++;
}
static int w_barrier(void *ctx) {
    const watched *w = ctx;
    watch(w);
    return w->inner->barrier(w->inner->ctx);
}
static int w_bcast(void *ctx, void *buf, size_t n, int root) {
    const watched *w = ctx;
    watch(w);
    return w->inner->bcast(w->inner->ctx, buf, n, root);
}
static int w_gather(void *ctx, const void *send, size_t n, void **recv, size_t *lens, int root) {
    const watched *w = ctx;
    watch(w);
    return w->inner->gather(w->inner->ctx, send, n, recv, lens, root);
}
static int w_allgather(void *ctx, const void *send, void *recv, const size_t *lens) {
    const watched *w = ctx;
    watch(w);
    return w->inner->allgather(w->inner->ctx, send, recv, lens);
}
static int w_allreduce(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    const watched *w = ctx;
    watch(w);
    return w->inner->allreduce_i64(w->inner->ctx, v, n, op);
}

typedef struct mscen {
    const char *proj;
    int rc1[P], rc2[P], rc3[P], foreign[P];
    char msg[P][2048];
    int64_t value[P];
    float p0[P];
} mscen;

static void rank_job(const ckpt_comm *c, void *arg) {
    mscen *s = arg;
    int r = c->rank;
    watched w = {.inner = c, .owner = pthread_self()};
    w.comm = *c;
    w.comm.ctx = &w;
    w.comm.barrier = w_barrier;
    w.comm.bcast = w_bcast;
    w.comm.gather = w_gather;
    w.comm.allgather = w_allgather;
    w.comm.allreduce_i64 = w_allreduce;
    float p[4] = {1, 2, 3, 4};
    int64_t value = 10 + r;
    ckpt_model *m = NULL;
    ckpt_accelerator *acc = NULL;
    /* every rank writes (and fsyncs) its files at every save: no links */
    ckpt_project_config cfg = {.project_dir = s->proj,
                               .automatic_checkpoint_naming = true,
                               .comm = &w.comm,
                               .no_link_unchanged = true};
    int rc = ckpt_model_new(&m);
    if (rc == 0) rc = ckpt_model_add_param(m, "p", CKPT_F32, 1, (int64_t[]){4}, p, NULL);
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, m);
    if (rc == 0) ckpt_accelerator_set_step(acc, value);
    if (rc == 0) rc = ckpt_save_state_async(acc, NULL);
    s->rc1[r] = rc;
    p[0] = 100; /* changed at once: not saved */
    ckpt_accelerator_set_step(acc, 99);
    if (rc == 0) rc = ckpt_save_wait(acc);
    s->rc2[r] = rc;
    /* a background failure on every rank: the first fsync of each */
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 1, EIO, true);
    if (rc == 0) rc = ckpt_save_state_async(acc, NULL);
    if (rc == 0) rc = ckpt_save_wait(acc);
    s->rc3[r] = rc;
    snprintf(s->msg[r], sizeof s->msg[r], "%s", ckpt_errmsg());
    /* every rank's disarm comes after every rank's wait (the wait agrees) */
    c->barrier(c->ctx);
    if (r == 0) ckpt__fault_disarm();
    c->barrier(c->ctx);
    if (acc && ckpt_load_state(acc, NULL) == 0) {
        s->value[r] = ckpt_accelerator_step(acc);
        s->p0[r] = p[0];
    }
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
    s->foreign[r] = w.foreign;
}

/* Several processes: every rank polls at the same points and gets the same
 * answer; 0 (nothing committed) while one rank's writer is held, then the
 * commit at the poll that finds every rank's files written, not at a later
 * wait. A preemption caught by ckpt_should_save commits a pending save. */
typedef struct pscen {
    const char *proj;
    int answers[P][64], nanswers[P], last[P]; /* the first 64 answers, how many, the last */
    bool visible_while_held[P], committed_at_poll[P], committed_at_should_save[P];
    int rc[P];
} pscen;

static bool visible(const char *proj, int n) {
    char *m = tu_pathf("%s/checkpoints/checkpoint_%d/checkpoint.json", proj, n);
    bool v = tu_exists(m);
    free(m);
    return v;
}

static void poll_job(const ckpt_comm *c, void *arg) {
    pscen *s = arg;
    int r = c->rank;
    float p[4] = {1, 2, 3, 4};
    ckpt_model *m = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {.project_dir = s->proj,
                               .automatic_checkpoint_naming = true,
                               .comm = c,
                               .no_link_unchanged = true};
    int rc = ckpt_model_new(&m);
    if (rc == 0) rc = ckpt_model_add_param(m, "p", CKPT_F32, 1, (int64_t[]){4}, p, NULL);
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, m);
    if (rc == 0) rc = ckpt_save_state_async(acc, NULL);
    /* rank 1's writer is held at its generator's file until rank 0 has seen
     * three answers of 0 */
    for (int k = 0; rc == 0; k++) { /* as long as the writer takes */
        int a = ckpt_save_poll(acc);
        if (k < 64) s->answers[r][k] = a;
        s->nanswers[r]++;
        s->last[r] = a;
        if (a != 0) {
            rc = a < 0 ? a : 0;
            break;
        }
        if (k == 0) s->visible_while_held[r] = visible(s->proj, 0);
        if (r == 0 && k == 2) gate_open();
        usleep(2000);
    }
    s->committed_at_poll[r] = visible(s->proj, 0);
    /* a preemption: should_save commits the pending save before it answers */
    c->barrier(c->ctx);
    if (rc == 0) rc = ckpt_save_state_async(acc, NULL);
    if (r == 0) raise(SIGUSR1);
    c->barrier(c->ctx);
    if (rc == 0) rc = ckpt_should_save(acc, 1) == 1 ? 0 : CKPT_EINVAL;
    s->committed_at_should_save[r] = visible(s->proj, 1);
    if (rc == 0) rc = ckpt_save_wait(acc);
    s->rc[r] = rc;
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
}

static void test_several_processes_poll_alike_and_commit_at_the_poll(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    pscen s;
    memset(&s, 0, sizeof s);
    s.proj = t;
    static const int sigs[] = {SIGUSR1};
    assert_int_equal(ckpt_preemption_install(sigs, 1), 0);
    gate_close("random_states_1");
    tc_run(P, poll_job, &s);
    gate_remove();
    ckpt_preemption_uninstall();
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.rc[r], 0);
        assert_int_equal(s.nanswers[r], s.nanswers[0]); /* the same answers */
        for (int k = 0; k < s.nanswers[0] && k < 64; k++)
            assert_int_equal(s.answers[r][k], s.answers[0][k]);
        assert_true(s.nanswers[r] >= 4); /* three or more 0, then 1 */
        for (int k = 0; k < 3; k++) assert_int_equal(s.answers[r][k], 0);
        assert_int_equal(s.last[r], 1);
        assert_false(s.visible_while_held[r]);
        assert_true(s.committed_at_poll[r]);
        assert_true(s.committed_at_should_save[r]);
    }
    assert_checkpoints(t, 2);
    tu_tmpdir_free(t);
}

static void test_several_processes_commit_in_the_callers_thread(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("async");
    mscen s;
    memset(&s, 0, sizeof s);
    s.proj = t;
    tc_run(P, rank_job, &s);
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.rc1[r], 0);
        assert_int_equal(s.rc2[r], 0);
        assert_int_equal(s.rc3[r], CKPT_EIO);
        assert_string_equal(s.msg[r], s.msg[0]); /* the same message on every rank */
        assert_int_equal(s.value[r], 10);         /* rank 0's step, at the call */
        assert_true(s.p0[r] == 1.0f);
        assert_int_equal(s.foreign[r], 0); /* the communicator never left the rank's thread */
    }
    tu_assert_contains(s.msg[0], "rank 0: ");
    assert_checkpoints(t, 1);
    char *rs = tu_pathf("%s/random_states_2.safetensors", cp_dir(t, 0));
    assert_true(tu_exists(rs));
    free(rs);
    tu_tmpdir_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_changes_after_the_call_are_not_saved),
        cmocka_unit_test(test_two_async_saves_in_a_row_get_consecutive_numbers),
        cmocka_unit_test(test_load_while_pending_loads_the_pending_checkpoint),
        cmocka_unit_test(test_a_failed_pending_save_does_not_stop_a_load_and_reaches_the_wait),
        cmocka_unit_test(test_free_while_pending_commits_the_save),
        cmocka_unit_test(test_a_failure_at_the_call_is_returned_by_the_call),
        cmocka_unit_test(test_every_background_io_call_failing_enospc_reaches_the_wait),
        cmocka_unit_test(test_every_background_io_call_failing_eio_reaches_the_wait),
        cmocka_unit_test(test_the_next_save_returns_a_background_failure),
        cmocka_unit_test(test_past_the_staging_limit_files_are_written_at_the_call),
        cmocka_unit_test(test_a_prepared_first_save_takes_no_page_faults_for_staging),
        cmocka_unit_test(test_prepare_async_names_a_failing_state_dict),
        cmocka_unit_test(test_async_background_classes),
        cmocka_unit_test(test_hooks_run_at_the_call_and_at_the_wait),
        cmocka_unit_test(test_load_through_the_hashed_read),
        cmocka_unit_test(test_several_processes_commit_in_the_callers_thread),
        cmocka_unit_test(test_poll_never_waits_and_commits_a_finished_save),
        cmocka_unit_test(test_several_processes_poll_alike_and_commit_at_the_poll),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
