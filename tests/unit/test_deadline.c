/* test_deadline.c — what a save or load tells a communicator about
 * deadlines (ckpt_comm.deadline: balanced operations, named phases, the
 * configured seconds), how a CKPT_ETIMEDOUT from the communicator reaches
 * every rank unchanged with nothing committed, the config's checks, and the
 * manifest size limit enforced when saving. The MPI side (ranks held past a
 * real deadline under mpirun) is tests/integration/test_deadline.sh. */
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
#include "helpers/thread_comm.h"

/* ---- a communicator that records its deadline calls ------------------------ */

#define MAX_CALLS 256
#define P 3

typedef struct rec_call {
    double seconds;
    char phase[96]; /* "" for the end of an operation */
} rec_call;

typedef struct wrap {
    const ckpt_comm *inner;
    ckpt_comm comm;
    rec_call calls[MAX_CALLS];
    int ncalls;
    /* this rank's first allreduce in phase fail_phase fails with a timeout */
    const char *fail_phase;
    bool failed;
} wrap;

static int w_barrier(void *ctx) {
    const ckpt_comm *c = ((wrap *)ctx)->inner;
    return c->barrier(c->ctx);
}
static int w_bcast(void *ctx, void *buf, size_t n, int root) {
    const ckpt_comm *c = ((wrap *)ctx)->inner;
    return c->bcast(c->ctx, buf, n, root);
}
static int w_gather(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root) {
    const ckpt_comm *c = ((wrap *)ctx)->inner;
    return c->gather(c->ctx, buf, n, out, lens, root);
}
static int w_allgather(void *ctx, const void *buf, void *out, const size_t *lens) {
    const ckpt_comm *c = ((wrap *)ctx)->inner;
    return c->allgather(c->ctx, buf, out, lens);
}
/* Every rank takes part in the reduction (so no thread is left waiting);
 * on the chosen one every rank then reports a timeout, as every rank of a
 * real communicator would. */
static int w_allreduce(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    wrap *w = ctx;
    int rc = w->inner->allreduce_i64(w->inner->ctx, v, n, op);
    if (rc == 0 && w->fail_phase && !w->failed && w->ncalls &&
        strcmp(w->calls[w->ncalls - 1].phase, w->fail_phase) == 0 && (w->failed = true))
        return ckpt_set_error(CKPT_ETIMEDOUT, "%s: rank 2 did not arrive within %g s",
                              w->ncalls ? w->calls[w->ncalls - 1].phase : "?",
                              w->ncalls ? w->calls[w->ncalls - 1].seconds : 0.0);
    return rc;
}
static void w_deadline(void *ctx, double seconds, const char *phase) {
    wrap *w = ctx;
    if (w->ncalls >= MAX_CALLS) return;
    rec_call *r = &w->calls[w->ncalls++];
    r->seconds = seconds;
    snprintf(r->phase, sizeof r->phase, "%s", phase ? phase : "");
}

static void wrap_init(wrap *w, const ckpt_comm *inner, const char *fail_phase) {
    memset(w, 0, sizeof *w);
    w->inner = inner;
    w->fail_phase = fail_phase;
    w->comm = *inner;
    w->comm.ctx = w;
    w->comm.barrier = w_barrier;
    w->comm.bcast = w_bcast;
    w->comm.gather = w_gather;
    w->comm.allgather = w_allgather;
    w->comm.allreduce_i64 = w_allreduce;
    w->comm.destroy = NULL;
    w->comm.deadline = w_deadline;
}

typedef struct value {
    int64_t v;
} value;
static int value_sd(void *self, ckpt_writer *w) {
    return ckpt_write_i64(w, "v", ((value *)self)->v);
}
static int value_load(void *self, ckpt_reader *r) {
    return ckpt_read_i64(r, "v", &((value *)self)->v);
}
static const ckpt_stateful_ops value_ops = {.state_dict = value_sd, .load_state_dict = value_load};

typedef struct job {
    char dir[512];
    double timeout; /* the config's */
    const char *fail_phase; /* see wrap */
    wrap w[P];
    int save_rc[P], load_rc[P], save2_rc[P];
    char save_msg[P][512];
    int64_t loaded[P];
} job;

static job *job_of(void *arg, const ckpt_comm *c, wrap **w) {
    job *j = arg;
    *w = &j->w[c->rank];
    return j;
}

/* save (v = 5), load into v = -1, then save again (v = 6). */
static void save_load(const ckpt_comm *comm, void *arg) {
    wrap *w;
    job *j = job_of(arg, comm, &w);
    int r = comm->rank;
    wrap_init(w, comm, j->fail_phase);
    ckpt_project_config cfg = {.project_dir = j->dir,
                               .automatic_checkpoint_naming = true,
                               .comm = &w->comm,
                               .collective_timeout_s = j->timeout};
    ckpt_accelerator *acc = NULL;
    value val = {5};
    if (ckpt_accelerator_new(&acc, &cfg) != 0 ||
        ckpt_register_for_checkpointing(acc, &value_ops, &val) != 0) {
        j->save_rc[r] = -100;
        ckpt_accelerator_free(acc);
        return;
    }
    j->save_rc[r] = ckpt_save_state(acc, NULL);
    snprintf(j->save_msg[r], sizeof j->save_msg[r], "%s", ckpt_errmsg());
    val.v = -1;
    j->load_rc[r] = ckpt_load_state(acc, NULL);
    j->loaded[r] = val.v;
    val.v = 6;
    j->save2_rc[r] = ckpt_save_state(acc, NULL);
    ckpt_accelerator_free(acc);
}

/* Each rank's calls: operations balanced (each ends with a NULL phase, none
 * nested), every phase named "save: ..." or "load: ...", with want seconds. */
static void check_calls(const wrap *w, double want, int *nops) {
    bool open = false;
    *nops = 0;
    assert_true(w->ncalls > 0 && w->ncalls < MAX_CALLS);
    for (int i = 0; i < w->ncalls; i++) {
        const rec_call *c = &w->calls[i];
        if (!c->phase[0]) {
            assert_true(open);
            open = false;
            continue;
        }
        if (!open) ++*nops;
        open = true;
        assert_true(strncmp(c->phase, "save: ", 6) == 0 || strncmp(c->phase, "load: ", 6) == 0);
        assert_true(c->seconds == want);
    }
    assert_false(open);
}

static void test_saves_and_loads_give_the_comm_balanced_named_phases(void **st) {
    (void)st;
    job *j = calloc(1, sizeof *j);
    assert_non_null(j);
    snprintf(j->dir, sizeof j->dir, "%s/run", tu_dir());
    j->timeout = 7.5;
    tc_run(P, save_load, j);
    int nops0 = -1;
    for (int r = 0; r < P; r++) {
        assert_int_equal(j->save_rc[r], 0);
        assert_int_equal(j->load_rc[r], 0);
        assert_int_equal(j->loaded[r], 5);
        assert_int_equal(j->save2_rc[r], 0);
        int nops;
        check_calls(&j->w[r], 7.5, &nops);
        if (r == 0) nops0 = nops;
        assert_int_equal(nops, nops0); /* the same operations on every rank */
    }
    /* two saves of two operations (start, finish) and one load */
    assert_int_equal(nops0, 5);
    free(j);
}

static void test_the_default_deadline_is_600_s_and_negative_is_none(void **st) {
    (void)st;
    double cases[][2] = {{0, CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S}, {-1, -1}, {INFINITY, -1}};
    for (int k = 0; k < 3; k++) {
        job *j = calloc(1, sizeof *j);
        assert_non_null(j);
        snprintf(j->dir, sizeof j->dir, "%s/run%d", tu_dir(), k);
        j->timeout = cases[k][0];
        tc_run(P, save_load, j);
        for (int r = 0; r < P; r++) {
            int nops;
            assert_int_equal(j->save_rc[r], 0);
            check_calls(&j->w[r], cases[k][1], &nops);
        }
        free(j);
    }
    assert_float_equal(CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S, 600.0, 0);
}

/* The agreement before the commit (the first save's first reduction) times
 * out: every rank returns CKPT_ETIMEDOUT with the comm's message as is,
 * nothing is committed, and the next save works. */
static void test_a_timeout_reaches_every_rank_unchanged_and_commits_nothing(void **st) {
    (void)st;
    job *j = calloc(1, sizeof *j);
    assert_non_null(j);
    snprintf(j->dir, sizeof j->dir, "%s/run", tu_dir());
    j->timeout = 3;
    j->fail_phase = "save: agree on the commit"; /* its first reduction */
    tc_run(P, save_load, j);
    for (int r = 0; r < P; r++) {
        assert_int_equal(j->save_rc[r], CKPT_ETIMEDOUT);
        assert_string_equal(j->save_msg[r],
                            "save: agree on the commit: rank 2 did not arrive within 3 s");
        assert_int_equal(j->load_rc[r], CKPT_ENOENT); /* nothing was committed */
        assert_int_equal(j->loaded[r], -1);
        assert_int_equal(j->save2_rc[r], 0);
    }
    char *cdir = tu_pathf("%s/checkpoints", j->dir);
    assert_int_equal(tu_count_hidden_tmp(cdir), 0);
    char *first = tu_pathf("%s/checkpoint_0", cdir);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(first, true, &info), 0);
    free(first);
    free(cdir);
    free(j);
}

static void test_collective_timeout_nan_is_refused(void **st) {
    (void)st;
    ckpt_project_config cfg = {.project_dir = tu_dir(), .collective_timeout_s = NAN};
    ckpt_accelerator *acc = NULL;
    tu_expect_error(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL, "collective_timeout_s");
    assert_null(acc);
    tu_assert_contains(ckpt_strerror(CKPT_ETIMEDOUT), "CKPT_ETIMEDOUT");
}

/* ---- the manifest limit ----------------------------------------------------- */

/* 17,000 one-element tensors with 1000-byte keys: each is a line of the
 * manifest (its key and hash), over 16 MiB in all. */
#define WIDE_KEYS 17000
static int wide_sd(void *self, ckpt_writer *w) {
    (void)self;
    char key[1001];
    memset(key, 'k', 1000);
    key[1000] = '\0';
    int64_t shape[1] = {1};
    static const float x = 1.0f; /* borrowed until the file is written */
    for (int i = 0; i < WIDE_KEYS; i++) {
        snprintf(key, 12, "%011d", i);
        key[11] = 'k';
        int rc = ckpt_write_tensor(w, key, CKPT_F32, 1, shape, &x);
        if (rc < 0) return rc;
    }
    return 0;
}
static int wide_load(void *self, ckpt_reader *r) {
    (void)self, (void)r;
    return 0;
}
static const ckpt_stateful_ops wide_ops = {.state_dict = wide_sd, .load_state_dict = wide_load};

static void test_a_save_over_the_manifest_limit_fails_and_commits_nothing(void **st) {
    (void)st;
    ckpt_project_config cfg = {.project_dir = tu_dir(), .automatic_checkpoint_naming = true};
    ckpt_accelerator *acc = NULL;
    value val = {5};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &value_ops, &val), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &wide_ops, NULL), 0);
    tu_expect_error(ckpt_save_state(acc, NULL), CKPT_EINVAL, "more than the 16777216");
    tu_assert_errmsg_has("manifest");
    ckpt_accelerator_free(acc);
    char *cdir = tu_pathf("%s/checkpoints", tu_dir());
    char *second = tu_pathf("%s/checkpoint_1", cdir);
    char *first = tu_pathf("%s/checkpoint_0", cdir);
    assert_false(tu_exists(second));
    assert_int_equal(tu_count_hidden_tmp(cdir), 0);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(first, true, &info), 0);
    free(first);
    free(second);
    free(cdir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_saves_and_loads_give_the_comm_balanced_named_phases,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_the_default_deadline_is_600_s_and_negative_is_none,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_a_timeout_reaches_every_rank_unchanged_and_commits_nothing, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_collective_timeout_nan_is_refused, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_a_save_over_the_manifest_limit_fails_and_commits_nothing, tu_tmpdir_setup,
            tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
