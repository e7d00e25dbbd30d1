/* test_save_op.c — the save as an object driven through its phases
 * (src/accel/save_op.h): the phases in order commit a checkpoint; out of
 * order, aborted, or after a failed write they commit nothing, leave no
 * temporary folder and keep the previous checkpoint as it was; an
 * asynchronous save that fails while staging commits nothing; ranks that
 * save different objects or tensors all fail alike, naming the first
 * object that differs. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <errno.h>
#include <dirent.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "accel/save_op.h"
#include "base/error.h"
#include "base/io.h"
#include "testing/testing.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

enum { N = 4096 };

/* One custom object: a replicated tensor of n floats and a counter. */
typedef struct obj {
    float t[N];
    int64_t n; /* tensor elements written */
    const char *key;
    int64_t v;
} obj;

static int obj_sd(void *self, ckpt_writer *w) {
    obj *o = self;
    int rc = ckpt_write_tensor(w, o->key, CKPT_F32, 1, (int64_t[]){o->n}, o->t);
    return rc ? rc : ckpt_write_i64(w, "v", o->v);
}
static int obj_load(void *self, ckpt_reader *r) { return ckpt_read_i64(r, "v", &((obj *)self)->v); }
static const ckpt_stateful_ops obj_ops = {.state_dict = obj_sd, .load_state_dict = obj_load};

static obj g_obj;
static ckpt_accelerator *g_acc;

static void open_acc(void) {
    memset(&g_obj, 0, sizeof g_obj);
    g_obj.n = N;
    g_obj.key = "t";
    for (int i = 0; i < N; i++) g_obj.t[i] = (float)i;
    ckpt_project_config cfg = {.project_dir = tu_dir(), .automatic_checkpoint_naming = true};
    assert_int_equal(ckpt_accelerator_new(&g_acc, &cfg), 0);
    assert_int_equal(ckpt_register_for_checkpointing(g_acc, &obj_ops, &g_obj), 0);
}

static int setup(void **state) {
    if (tu_tmpdir_setup(state)) return -1;
    open_acc();
    return 0;
}

static int teardown(void **state) {
    ckpt_accelerator_free(g_acc);
    g_acc = NULL;
    return tu_tmpdir_teardown(state);
}

/* The entries of <project>/checkpoints but the project lock, sorted,
 * joined by spaces. */
static char *checkpoints(void) {
    char *dir = tu_pathf("%s/checkpoints", tu_dir());
    DIR *d = opendir(dir);
    assert_non_null(d);
    char *names[64];
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..") || !strcmp(e->d_name, ".lock"))
            continue;
        assert_true(n < 64);
        names[n++] = strdup(e->d_name);
    }
    closedir(d);
    free(dir);
    for (int i = 0; i < n; i++)
        for (int k = i + 1; k < n; k++)
            if (strcmp(names[k], names[i]) < 0) {
                char *t = names[i];
                names[i] = names[k];
                names[k] = t;
            }
    char *out = calloc(1, 64 * 260);
    assert_non_null(out);
    for (int i = 0; i < n; i++) {
        if (i) strcat(out, " ");
        strcat(out, names[i]);
        free(names[i]);
    }
    return out;
}

static void assert_checkpoints(const char *want) {
    char *got = checkpoints();
    assert_string_equal(got, want);
    free(got);
}

/* checkpoint_0 holds v = 1; the object then moves on to v = 2. */
static void first_checkpoint(void) {
    g_obj.v = 1;
    assert_int_equal(ckpt_save_state(g_acc, NULL), 0);
    g_obj.v = 2;
}

/* The previous checkpoint is still the one a load finds, with v = 1. */
static void assert_previous_intact(void) {
    assert_checkpoints("checkpoint_0");
    g_obj.v = -1;
    assert_int_equal(ckpt_load_state(g_acc, NULL), 0);
    assert_int_equal(g_obj.v, 1);
}

static void test_phases_in_order_commit_a_checkpoint(void **st) {
    (void)st;
    g_obj.v = 7;
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_non_null(op);
    assert_int_equal(ckpt__save_op_plan(op), 0);
    assert_int_equal(ckpt__save_op_number(op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), 0);
    assert_int_equal(ckpt__save_op_write(op), 0);
    char *during = checkpoints(); /* written, not yet visible: a temporary folder */
    assert_int_equal(strncmp(during, ".checkpoint_0.tmp.", 18), 0);
    free(during);
    assert_int_equal(ckpt__save_op_commit(op), 0);
    ckpt__save_op_apply(op);
    ckpt__save_op_free(op);
    assert_checkpoints("checkpoint_0");
    /* apply moved the numbering on: the next save is checkpoint_1 */
    assert_int_equal(ckpt_save_state(g_acc, NULL), 0);
    assert_checkpoints("checkpoint_0 checkpoint_1");
    g_obj.v = -1;
    assert_int_equal(ckpt_load_state(g_acc, NULL), 0);
    assert_int_equal(g_obj.v, 7);
}

static void test_commit_before_write_fails_and_commits_nothing(void **st) {
    (void)st;
    first_checkpoint();
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_int_equal(ckpt__save_op_plan(op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), 0);
    assert_int_equal(ckpt__save_op_commit(op), CKPT_EINVAL);
    assert_string_equal(ckpt_errmsg(),
                        "save_state: internal error: the commit phase after the snapshot phase");
    ckpt__save_op_apply(op); /* nothing: the commit failed */
    ckpt__save_op_free(op);
    assert_previous_intact();
    /* the numbering did not move: the next save is checkpoint_1 */
    assert_int_equal(ckpt_save_state(g_acc, NULL), 0);
    assert_checkpoints("checkpoint_0 checkpoint_1");
}

static void test_snapshot_before_plan_fails_and_later_phases_do_nothing(void **st) {
    (void)st;
    first_checkpoint();
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), CKPT_EINVAL);
    assert_string_equal(ckpt_errmsg(),
                        "save_state: internal error: the snapshot phase after the new phase");
    assert_int_equal(ckpt__save_op_write(op), CKPT_EINVAL);
    assert_int_equal(ckpt__save_op_status(op), CKPT_EINVAL);
    assert_int_equal(ckpt__save_op_commit(op), CKPT_EINVAL);
    ckpt__save_op_free(op);
    assert_previous_intact();
}

static void test_abort_after_snapshot_leaves_the_previous_checkpoint(void **st) {
    (void)st;
    first_checkpoint();
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_int_equal(ckpt__save_op_plan(op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), 0);
    char *during = checkpoints();
    assert_string_not_equal(during, "checkpoint_0"); /* and its temporary folder */
    free(during);
    ckpt__save_op_fail(op, CKPT_EIO);
    assert_int_equal(ckpt__save_op_commit(op), CKPT_EIO);
    ckpt__save_op_free(op);
    assert_previous_intact();
}

static void test_free_without_commit_leaves_nothing(void **st) {
    (void)st;
    first_checkpoint();
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_int_equal(ckpt__save_op_plan(op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), 0);
    assert_int_equal(ckpt__save_op_write(op), 0);
    char *during = checkpoints();
    assert_string_not_equal(during, "checkpoint_0"); /* and its temporary folder */
    free(during);
    ckpt__save_op_free(op);
    assert_previous_intact();
}

static void test_failed_write_commits_nothing(void **st) {
    (void)st;
    first_checkpoint();
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_int_equal(ckpt__save_op_plan(op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), 0);
    ckpt__fault_arm(CKPT_FAULT_WRITE, 1, ENOSPC, true);
    int rc = ckpt__save_op_write(op);
    bool fired = ckpt__fault_fired();
    ckpt__fault_disarm();
    assert_true(fired);
    assert_int_equal(rc, CKPT_ENOSPC);
    assert_int_equal(ckpt__save_op_commit(op), CKPT_ENOSPC);
    ckpt__save_op_apply(op);
    ckpt__save_op_free(op);
    assert_previous_intact();
}

/* One process, staging limit 1 byte: every file is written at once in the
 * caller's thread, and the first write fails. */
static void test_async_save_that_fails_to_stage_commits_nothing(void **st) {
    (void)st;
    first_checkpoint();
    assert_int_equal(ckpt_accelerator_set_async_staging_limit(g_acc, 1), 0);
    ckpt__fault_arm(CKPT_FAULT_WRITE, 1, ENOSPC, true);
    int rc = ckpt_save_state_async(g_acc, NULL);
    bool fired = ckpt__fault_fired();
    ckpt__fault_disarm();
    assert_true(fired);
    assert_int_equal(rc, CKPT_ENOSPC);
    assert_int_equal(ckpt_save_wait(g_acc), 0); /* reported once, by the call */
    assert_previous_intact();
    /* the numbering did not move */
    assert_int_equal(ckpt_save_state_async(g_acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(g_acc), 0);
    assert_checkpoints("checkpoint_0 checkpoint_1");
}

/* The staging area cannot be had: the save fails with CKPT_ENOMEM and
 * commits nothing (it once committed a checkpoint of no files). */
static void test_stage_without_memory_commits_nothing(void **st) {
    (void)st;
    first_checkpoint();
    ckpt_save_op *op = NULL;
    assert_int_equal(ckpt__save_op_new(g_acc, NULL, &op), 0);
    assert_int_equal(ckpt__save_op_plan(op), 0);
    assert_int_equal(ckpt__save_op_snapshot(op), 0);
    ckpt__alloc_fail_after(2); /* the staging plan, then the area */
    int rc = ckpt__save_op_stage(op);
    ckpt__alloc_fail_after(0);
    assert_int_equal(rc, CKPT_ENOMEM);
    assert_int_equal(ckpt__save_op_status(op), CKPT_ENOMEM);
    assert_int_equal(ckpt__save_op_commit(op), CKPT_ENOMEM);
    ckpt__save_op_apply(op);
    ckpt__save_op_free(op);
    assert_previous_intact();
}

/* ---- several ranks: the same objects in the same order -------------------------- */

enum { P = 2 };

typedef struct order_job {
    char dir[512];
    int variant; /* rank 1's difference: 1 shape, 2 tensor name, 3 an extra object */
    int rc[P];
    char msg[P][1024];
    obj o[P][2];
} order_job;

static void order_rank(const ckpt_comm *comm, void *arg) {
    order_job *j = arg;
    int r = comm->rank;
    ckpt_project_config cfg = {
        .project_dir = j->dir, .automatic_checkpoint_naming = true, .comm = comm};
    ckpt_accelerator *acc = NULL;
    obj *o = j->o[r];
    for (int k = 0; k < 2; k++) {
        o[k].n = N;
        o[k].key = "t";
    }
    bool extra = false;
    if (r == 1 && j->variant == 1) o[0].n = N / 2;
    if (r == 1 && j->variant == 2) o[0].key = "u";
    if (r == 1 && j->variant == 3) extra = true;
    if (ckpt_accelerator_new(&acc, &cfg) != 0 ||
        ckpt_register_for_checkpointing(acc, &obj_ops, &o[0]) != 0 ||
        (extra && ckpt_register_for_checkpointing(acc, &obj_ops, &o[1]) != 0)) {
        j->rc[r] = -100;
        ckpt_accelerator_free(acc);
        return;
    }
    j->rc[r] = ckpt_save_state(acc, NULL);
    snprintf(j->msg[r], sizeof j->msg[r], "%s", ckpt_errmsg());
    ckpt_accelerator_free(acc);
}

static void run_order(int variant, const char *want_tail) {
    order_job *j = calloc(1, sizeof *j);
    assert_non_null(j);
    snprintf(j->dir, sizeof j->dir, "%s/run%d", tu_dir(), variant);
    j->variant = variant;
    tc_run(P, order_rank, j);
    char want[1024];
    snprintf(want, sizeof want, "rank 0: save_state: %s/checkpoints/checkpoint_0: %s", j->dir,
             want_tail);
    for (int r = 0; r < P; r++) {
        assert_int_equal(j->rc[r], CKPT_EINVAL);
        assert_string_equal(j->msg[r], want);
    }
    char *ck = tu_pathf("%s/checkpoints", j->dir);
    assert_int_equal(tu_count_hidden_tmp(ck), 0);
    char *c0 = tu_pathf("%s/checkpoint_0", ck);
    assert_false(tu_exists(c0));
    free(c0);
    free(ck);
    free(j);
}

static void test_ranks_with_different_shapes_fail_alike(void **st) {
    (void)st;
    run_order(1, "the ranks save different state: custom_checkpoint_0.safetensors differs "
                 "between rank 0 and rank 1 (the names, order, dtypes or shapes of its "
                 "replicated tensors: 1 on rank 0, 1 on rank 1)");
}

static void test_ranks_with_different_tensor_names_fail_alike(void **st) {
    (void)st;
    run_order(2, "the ranks save different state: custom_checkpoint_0.safetensors differs "
                 "between rank 0 and rank 1 (the names, order, dtypes or shapes of its "
                 "replicated tensors: 1 on rank 0, 1 on rank 1)");
}

static void test_ranks_with_different_objects_fail_alike(void **st) {
    (void)st;
    run_order(3, "the ranks save different objects: rank 0 saves nothing where rank 1 saves "
                 "custom_checkpoint_1.safetensors");
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_phases_in_order_commit_a_checkpoint, setup, teardown),
        cmocka_unit_test_setup_teardown(test_commit_before_write_fails_and_commits_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_snapshot_before_plan_fails_and_later_phases_do_nothing,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_abort_after_snapshot_leaves_the_previous_checkpoint,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_free_without_commit_leaves_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_failed_write_commits_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_async_save_that_fails_to_stage_commits_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_stage_without_memory_commits_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ranks_with_different_shapes_fail_alike,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_ranks_with_different_tensor_names_fail_alike,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_ranks_with_different_objects_fail_alike,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
