/* test_load_op.c — the load as an object driven through its phases
 * (src/accel/load_op.h): in order they load the newest checkpoint, falling
 * back past a damaged one through choose again; out of order (a phase
 * skipped, repeated or run after the finish would be due) they fail with
 * CKPT_EINVAL naming both phases and apply nothing, on every rank alike;
 * after an agreed failure the later phases do nothing; a load into an
 * object no accelerator holds takes its reader from the caller. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/load_op.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

enum { N = 1024 };

/* One custom object: a tensor of N floats and a counter. */
typedef struct obj {
    float t[N];
    int64_t v;
} obj;

static int obj_sd(void *self, ckpt_writer *w) {
    obj *o = self;
    int rc = ckpt_write_tensor(w, "t", CKPT_F32, 1, (int64_t[]){N}, o->t);
    return rc ? rc : ckpt_write_i64(w, "v", o->v);
}
static int obj_load(void *self, ckpt_reader *r) {
    obj *o = self;
    int rc = ckpt_read_tensor(r, "t", CKPT_F32, 1, (int64_t[]){N}, o->t);
    return rc ? rc : ckpt_read_i64(r, "v", &o->v);
}
static const ckpt_stateful_ops obj_ops = {.state_dict = obj_sd, .load_state_dict = obj_load};

static obj g_obj;
static ckpt_accelerator *g_acc;

static void set_obj(obj *o, int64_t v) {
    o->v = v;
    for (int i = 0; i < N; i++) o->t[i] = (float)(v * N + i);
}

static int setup(void **state) {
    if (tu_tmpdir_setup(state)) return -1;
    set_obj(&g_obj, 1);
    ckpt_project_config cfg = {.project_dir = tu_dir(), .automatic_checkpoint_naming = true};
    if (ckpt_accelerator_new(&g_acc, &cfg) != 0) return -1;
    return ckpt_register_for_checkpointing(g_acc, &obj_ops, &g_obj) == 0 ? 0 : -1;
}

static int teardown(void **state) {
    ckpt_accelerator_free(g_acc);
    g_acc = NULL;
    return tu_tmpdir_teardown(state);
}

/* checkpoint_0 holds v = 1 and checkpoint_1 v = 2; the object then moves
 * on to v = 3. */
static void two_checkpoints(void) {
    set_obj(&g_obj, 1);
    assert_int_equal(ckpt_save_state(g_acc, NULL), 0);
    set_obj(&g_obj, 2);
    assert_int_equal(ckpt_save_state(g_acc, NULL), 0);
    set_obj(&g_obj, 3);
}

static void assert_obj(const obj *o, int64_t v) {
    assert_int_equal(o->v, v);
    for (int i = 0; i < N; i++) assert_true(o->t[i] == (float)(v * N + i));
}

static void test_phases_in_order_load_the_newest(void **st) {
    (void)st;
    two_checkpoints();
    ckpt_load_report rep;
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new(g_acc, NULL, NULL, &rep, &op), 0);
    assert_int_equal(ckpt__load_op_choose(op), 0);
    assert_int_equal(ckpt__load_op_plan(op), 0);
    assert_int_equal(ckpt__load_op_read(op), 0);
    char *want = tu_pathf("%s/checkpoints/checkpoint_1", tu_dir());
    assert_string_equal(ckpt__load_op_dir(op), want);
    assert_int_equal(ckpt__load_op_check(op), 0);
    assert_obj(&g_obj, 3); /* the check changes nothing */
    assert_int_equal(ckpt__load_op_agree(op), 0);
    assert_int_equal(ckpt__load_op_apply(op), 0);
    assert_obj(&g_obj, 2);
    assert_int_equal(ckpt__load_op_finish(op), 0);
    ckpt__load_op_free(op);
    assert_string_equal(rep.dir, want);
    assert_true(rep.full);
    ckpt_load_report_free(&rep);
    assert_string_equal(ckpt_accelerator_last_dir(g_acc), want);
    free(want);
}

static void test_damaged_newest_goes_back_to_choose(void **st) {
    (void)st;
    two_checkpoints();
    char *f = tu_pathf("%s/checkpoints/checkpoint_1/custom_checkpoint_0.safetensors", tu_dir());
    tu_flip_byte(f, tu_file_size(f) - 3);
    free(f);
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new(g_acc, NULL, NULL, NULL, &op), 0);
    assert_int_equal(ckpt__load_op_choose(op), 0);
    assert_int_equal(ckpt__load_op_plan(op), 0);
    assert_int_equal(ckpt__load_op_read(op), CKPT__LOAD_NEXT);
    /* check would be out of order here: choose comes first */
    assert_int_equal(ckpt__load_op_choose(op), 0);
    assert_int_equal(ckpt__load_op_plan(op), 0);
    assert_int_equal(ckpt__load_op_read(op), 0);
    assert_int_equal(ckpt__load_op_check(op), 0);
    assert_int_equal(ckpt__load_op_agree(op), 0);
    assert_int_equal(ckpt__load_op_apply(op), 0);
    assert_int_equal(ckpt__load_op_finish(op), 0);
    ckpt__load_op_free(op);
    assert_obj(&g_obj, 1);
}

/* new, then the phases up to (and without) `stop`, then `bad` out of order;
 * every later phase and finish fail alike and nothing is loaded; saves are
 * refused afterwards, as after any failed load. */
enum { CHOOSE, PLAN, READ, CHECK, AGREE, APPLY, FINISH };
static int run_phase(ckpt__load_op *op, int ph) {
    switch (ph) {
    case CHOOSE: return ckpt__load_op_choose(op);
    case PLAN: return ckpt__load_op_plan(op);
    case READ: return ckpt__load_op_read(op);
    case CHECK: return ckpt__load_op_check(op);
    case AGREE: return ckpt__load_op_agree(op);
    case APPLY: return ckpt__load_op_apply(op);
    default: return ckpt__load_op_finish(op);
    }
}

static void out_of_order(int stop, int bad, const char *want) {
    two_checkpoints();
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new(g_acc, NULL, NULL, NULL, &op), 0);
    for (int ph = CHOOSE; ph < stop; ph++) assert_int_equal(run_phase(op, ph), 0);
    assert_int_equal(run_phase(op, bad), CKPT_EINVAL);
    tu_assert_contains(ckpt_errmsg(), want);
    tu_assert_contains(ckpt_errmsg(), "out of order");
    for (int ph = bad + 1; ph <= FINISH; ph++) assert_int_equal(run_phase(op, ph), CKPT_EINVAL);
    ckpt__load_op_free(op);
    assert_obj(&g_obj, 3);
    assert_int_equal(ckpt_accelerator_step(g_acc), 0);
    assert_int_not_equal(ckpt_save_state(g_acc, NULL), 0);
}

static void test_check_before_read_applies_nothing(void **st) {
    (void)st;
    out_of_order(READ, CHECK, "check phase was called after its plan phase");
}

static void test_apply_before_agree_applies_nothing(void **st) {
    (void)st;
    out_of_order(AGREE, APPLY, "apply phase was called after its check phase");
}

static void test_plan_first_applies_nothing(void **st) {
    (void)st;
    out_of_order(CHOOSE, PLAN, "plan phase was called after its new phase");
}

static void test_finish_before_apply_applies_nothing(void **st) {
    (void)st;
    out_of_order(APPLY, FINISH, "finish phase was called after its agree phase");
}

static void test_read_twice_applies_nothing(void **st) {
    (void)st;
    two_checkpoints();
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new(g_acc, NULL, NULL, NULL, &op), 0);
    assert_int_equal(ckpt__load_op_choose(op), 0);
    assert_int_equal(ckpt__load_op_plan(op), 0);
    assert_int_equal(ckpt__load_op_read(op), 0);
    assert_int_equal(ckpt__load_op_read(op), CKPT_EINVAL);
    tu_assert_contains(ckpt_errmsg(), "read phase was called after its read phase");
    assert_int_equal(ckpt__load_op_check(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_agree(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_apply(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_finish(op), CKPT_EINVAL);
    ckpt__load_op_free(op);
    assert_obj(&g_obj, 3);
}

/* A failure agreed on (here: an explicit folder that is not there, which is
 * CKPT_EINVAL, never the fresh start of CKPT_ENOENT) is every later phase's
 * status; nothing runs. */
static void test_after_an_agreed_failure_phases_do_nothing(void **st) {
    (void)st;
    char *missing = tu_pathf("%s/checkpoints/checkpoint_9", tu_dir());
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new(g_acc, missing, NULL, NULL, &op), 0);
    /* this rank's failure: read agrees on it (with several ranks every one
     * takes part), then it is every phase's */
    assert_int_equal(ckpt__load_op_choose(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_plan(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_read(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_check(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_agree(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_apply(op), CKPT_EINVAL);
    int rc = ckpt__load_op_finish(op);
    ckpt__load_op_free(op);
    free(missing);
    assert_obj(&g_obj, 1);
    /* an error the resume idiom stops at, and nothing was applied */
    assert_int_equal(rc, CKPT_EINVAL);
}

static void test_bad_options_fail_at_new(void **st) {
    (void)st;
    two_checkpoints();
    ckpt_load_options opt = {.objects = 1u << 30};
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new(g_acc, NULL, &opt, NULL, &op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_choose(op), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_finish(op), CKPT_EINVAL);
    ckpt__load_op_free(op);
    /* bad options change nothing, not even the refusal of saves */
    assert_int_equal(ckpt_save_state(g_acc, NULL), 0);
}

/* ckpt_model_load_weights' path: an object no accelerator holds, its
 * reader from the caller. */
static void test_an_object_without_accelerator_reads_from_the_caller(void **st) {
    (void)st;
    two_checkpoints();
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    obj o;
    set_obj(&o, 7);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_checkpoint_open_object(dir, "custom_checkpoint_0.safetensors", &r), 0);
    ckpt_load_options none;
    memset(&none, 0, sizeof none);
    ckpt_load_report rep;
    ckpt__load_op *op = NULL;
    assert_int_equal(ckpt__load_op_new_object(K_CUSTOM, &obj_ops, &o, &none, &rep, "test", &op), 0);
    /* choose and plan are the accelerator's: out of order here */
    assert_int_equal(ckpt__load_op_read_from(op, dir, 5, r), 0);
    assert_int_equal(ckpt__load_op_check(op), 0);
    assert_int_equal(ckpt__load_op_agree(op), 0);
    assert_int_equal(ckpt__load_op_apply(op), 0);
    assert_int_equal(ckpt__load_op_finish(op), 0);
    ckpt__load_op_free(op);
    assert_obj(&o, 1);
    assert_int_equal(rep.step, 5);
    assert_false(rep.full);
    assert_int_equal(rep.num_loaded, 1);
    assert_string_equal(rep.dir, dir);
    ckpt_load_report_free(&rep);
    /* an accelerator's op takes no reader from the caller */
    assert_int_equal(ckpt_checkpoint_open_object(dir, "custom_checkpoint_0.safetensors", &r), 0);
    assert_int_equal(ckpt__load_op_new(g_acc, NULL, NULL, NULL, &op), 0);
    assert_int_equal(ckpt__load_op_read_from(op, dir, 0, r), CKPT_EINVAL);
    assert_int_equal(ckpt__load_op_finish(op), CKPT_EINVAL);
    ckpt__load_op_free(op);
    free(dir);
    assert_obj(&g_obj, 3);
}

/* ---- several ranks: an out-of-order phase fails every rank alike --------- */

enum { P = 3 };

typedef struct ranks_job {
    char dir[512];
    int rc[P], bad_rc[P];
    int64_t v[P];
} ranks_job;

static void ranks_rank(const ckpt_comm *comm, void *arg) {
    ranks_job *j = arg;
    int r = comm->rank;
    ckpt_project_config cfg = {
        .project_dir = j->dir, .automatic_checkpoint_naming = true, .comm = comm};
    ckpt_accelerator *acc = NULL;
    obj *o = calloc(1, sizeof *o);
    if (!o || ckpt_accelerator_new(&acc, &cfg) != 0 ||
        ckpt_register_for_checkpointing(acc, &obj_ops, o) != 0) {
        j->rc[r] = -100;
        ckpt_accelerator_free(acc);
        free(o);
        return;
    }
    set_obj(o, 1);
    int rc = ckpt_save_state(acc, NULL);
    set_obj(o, 2);
    ckpt__load_op *op = NULL;
    if (rc == 0) rc = ckpt__load_op_new(acc, NULL, NULL, NULL, &op);
    if (op) {
        ckpt__load_op_choose(op);
        ckpt__load_op_plan(op);
        ckpt__load_op_read(op);
        ckpt__load_op_check(op);
        /* agree skipped on every rank */
        j->bad_rc[r] = ckpt__load_op_apply(op);
        rc = ckpt__load_op_finish(op);
        ckpt__load_op_free(op);
    }
    j->rc[r] = rc;
    j->v[r] = o->v;
    ckpt_accelerator_free(acc);
    free(o);
}

static void test_out_of_order_fails_every_rank_alike(void **st) {
    (void)st;
    ranks_job *j = calloc(1, sizeof *j);
    assert_non_null(j);
    snprintf(j->dir, sizeof j->dir, "%s/ranks", tu_dir());
    tc_run(P, ranks_rank, j);
    for (int r = 0; r < P; r++) {
        assert_int_equal(j->bad_rc[r], CKPT_EINVAL);
        assert_int_equal(j->rc[r], CKPT_EINVAL);
        assert_int_equal(j->v[r], 2); /* nothing applied */
    }
    free(j);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_phases_in_order_load_the_newest, setup, teardown),
        cmocka_unit_test_setup_teardown(test_damaged_newest_goes_back_to_choose, setup, teardown),
        cmocka_unit_test_setup_teardown(test_check_before_read_applies_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_apply_before_agree_applies_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_plan_first_applies_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_finish_before_apply_applies_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_read_twice_applies_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_after_an_agreed_failure_phases_do_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_bad_options_fail_at_new, setup, teardown),
        cmocka_unit_test_setup_teardown(test_an_object_without_accelerator_reads_from_the_caller,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_out_of_order_fails_every_rank_alike, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
