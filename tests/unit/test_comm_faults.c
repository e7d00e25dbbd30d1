/* test_comm_faults.c — a communicator call that fails on one rank, at every
 * collective of a save and of a load, on 3 ranks that are threads: every
 * rank returns the same status and message and nothing hangs; a failed save
 * commits nothing (no new checkpoint, no temporary folder), a failed load
 * applies nothing (every rank's objects unchanged). Where what was lost is
 * recovered exactly (rank 0's status, broadcast, also travels in the
 * reduction that follows) the operation succeeds on every rank instead, and
 * then it has committed (the checkpoint verifies) or applied (every object
 * holds the checkpoint's values). The failing call still takes part in the
 * exchange (the others are not left waiting) but its rank gets garbage in
 * its buffers and CKPT_EIO, as from a transport error.
 *
 * The wrapper is strict: before each collective every rank publishes what
 * it calls (kind, root, size) and all compare, so ranks that take different
 * paths (one skipped an agreement the others made) are seen at once, as an
 * error on every rank instead of a hang or a silent mix of two collectives.
 * That is what catches a missing agreement, such as the one after the MPI
 * load's file transfers (share_files, src/accel/load.c). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

#define P 3
#define MAXCALLS 512

enum { C_BARRIER, C_BCAST, C_GATHER, C_ALLGATHER, C_ALLREDUCE };
static const char *const kind_name[] = {"barrier", "bcast", "gather", "allgather", "allreduce"};

/* What a rank is about to call, published for the others to compare. */
typedef struct call {
    int kind, root;
    int64_t size; /* bcast: n; allgather: sum of lens; allreduce: n * 4 + op */
} call;

/* Shared by the ranks of one job. */
typedef struct strict {
    call slot[P];
    bool broken; /* the ranks diverged: every later call fails at once */
    char why[256];
    /* injection: rank fail_rank's call number fail_at (1-based) fails */
    int fail_rank, fail_at;
    /* recorded: each rank's sequence of kinds */
    int kinds[P][MAXCALLS];
    int ncalls[P];
} strict;

typedef struct wrap {
    const ckpt_comm *inner;
    ckpt_comm comm;
    strict *s;
    int rank;
} wrap;

/* Every rank: publish, meet, compare, meet. Returns 0 or CKPT_EIO (the same
 * on every rank). */
static int agree_on(wrap *w, call me) {
    strict *s = w->s;
    if (s->broken) return ckpt_set_error(CKPT_EIO, "strict comm: %s", s->why);
    if (s->ncalls[w->rank] < MAXCALLS) s->kinds[w->rank][s->ncalls[w->rank]] = me.kind;
    s->ncalls[w->rank]++;
    s->slot[w->rank] = me;
    w->inner->barrier(w->inner->ctx);
    int bad = -1;
    for (int r = 1; r < P && bad < 0; r++)
        if (memcmp(&s->slot[r], &s->slot[0], sizeof me) != 0) bad = r;
    char why[256] = "";
    if (bad >= 0)
        snprintf(why, sizeof why,
                 "rank 0 called %s (root %d, size %lld), rank %d %s (root %d, "
                 "size %lld)",
                 kind_name[s->slot[0].kind], s->slot[0].root, (long long)s->slot[0].size, bad,
                 kind_name[s->slot[bad].kind], s->slot[bad].root, (long long)s->slot[bad].size);
    w->inner->barrier(w->inner->ctx);
    if (bad < 0) return CKPT_OK;
    if (w->rank == 0) snprintf(s->why, sizeof s->why, "%s", why);
    s->broken = true; /* written by every rank alike, read after a barrier only */
    w->inner->barrier(w->inner->ctx);
    return ckpt_set_error(CKPT_EIO, "strict comm: %s", why);
}

/* Whether this call is the one to fail (data moved, then garbage). */
static bool injected(wrap *w) {
    strict *s = w->s;
    return w->rank == s->fail_rank && s->ncalls[w->rank] == s->fail_at;
}

static int fail_now(wrap *w, const char *what) {
    return ckpt_set_error(CKPT_EIO, "injected: rank %d's call %d (%s) failed", w->rank,
                          w->s->fail_at, what);
}

static int s_barrier(void *ctx) {
    wrap *w = ctx;
    CKPT_TRY(agree_on(w, (call){C_BARRIER, -1, 0}));
    return w->inner->barrier(w->inner->ctx);
}

static int s_bcast(void *ctx, void *buf, size_t n, int root) {
    wrap *w = ctx;
    CKPT_TRY(agree_on(w, (call){C_BCAST, root, (int64_t)n}));
    int rc = w->inner->bcast(w->inner->ctx, buf, n, root);
    if (rc == 0 && injected(w)) {
        if (w->rank != root) memset(buf, 0xa5, n);
        return fail_now(w, "bcast");
    }
    return rc;
}

static int s_gather(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root) {
    wrap *w = ctx;
    CKPT_TRY(agree_on(w, (call){C_GATHER, root, 0}));
    int rc = w->inner->gather(w->inner->ctx, buf, n, out, lens, root);
    if (rc == 0 && injected(w)) {
        if (w->rank == root) {
            free(*out);
            *out = NULL;
        }
        return fail_now(w, "gather");
    }
    return rc;
}

static int s_allgather(void *ctx, const void *buf, void *out, const size_t *lens) {
    wrap *w = ctx;
    int64_t total = 0;
    for (int r = 0; r < P; r++) total += (int64_t)lens[r];
    CKPT_TRY(agree_on(w, (call){C_ALLGATHER, -1, total}));
    int rc = w->inner->allgather(w->inner->ctx, buf, out, lens);
    if (rc == 0 && injected(w)) {
        memset(out, 0xa5, (size_t)total);
        return fail_now(w, "allgather");
    }
    return rc;
}

static int s_allreduce(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    wrap *w = ctx;
    CKPT_TRY(agree_on(w, (call){C_ALLREDUCE, -1, (int64_t)n * 4 + op}));
    return w->inner->allreduce_i64(w->inner->ctx, v, n, op);
}

static void wrap_init(wrap *w, const ckpt_comm *inner, strict *s) {
    memset(w, 0, sizeof *w);
    w->inner = inner;
    w->s = s;
    w->rank = inner->rank;
    w->comm = *inner;
    w->comm.ctx = w;
    w->comm.barrier = s_barrier;
    w->comm.bcast = s_bcast;
    w->comm.gather = s_gather;
    w->comm.allgather = s_allgather;
    w->comm.allreduce_i64 = s_allreduce;
    w->comm.destroy = NULL;
}

/* ---- the run: a model, an optimizer, a scheduler, a custom object ----------- */

#define NW 4096 /* 16 KiB: replicated, spread over the ranks on save */

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

typedef struct rank_run {
    float w[NW], g[NW], b[64], gb[64];
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_scheduler *sch;
    value val;
    ckpt_accelerator *acc;
} rank_run;

static int run_open(rank_run *u, const char *proj, const ckpt_comm *c) {
    memset(u, 0, sizeof *u);
    for (int i = 0; i < NW; i++) u->w[i] = (float)(i % 97) * 0.01f;
    for (int i = 0; i < 64; i++) u->b[i] = (float)i;
    ckpt_project_config cfg = {.project_dir = proj,
                               .automatic_checkpoint_naming = true,
                               .comm = c,
                               .no_link_unchanged = true};
    int rc = ckpt_model_new(&u->m);
    if (rc == 0) rc = ckpt_model_add_param(u->m, "w", CKPT_F32, 2, (int64_t[]){64, 64}, u->w, u->g);
    if (rc == 0) rc = ckpt_model_add_param(u->m, "b", CKPT_F32, 1, (int64_t[]){64}, u->b, u->gb);
    if (rc == 0) rc = ckpt_adamw_new(&u->o, u->m, 1e-3, 0.9, 0.999, 1e-8, 0.0);
    if (rc == 0) rc = ckpt_steplr_new(&u->sch, u->o, 1, 0.5);
    if (rc == 0) rc = ckpt_accelerator_new(&u->acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(u->acc, u->m);
    if (rc == 0) rc = ckpt_prepare_optimizer(u->acc, u->o);
    if (rc == 0) rc = ckpt_prepare_scheduler(u->acc, u->sch);
    if (rc == 0) rc = ckpt_register_for_checkpointing(u->acc, &value_ops, &u->val);
    return rc;
}

/* One optimizer step: every object changes. */
static int run_step(rank_run *u, int k) {
    for (int i = 0; i < NW; i++) u->g[i] = 0.001f * (float)((i + k) % 13);
    for (int i = 0; i < 64; i++) u->gb[i] = 0.01f * (float)k;
    u->val.v = 100 + k;
    int rc = ckpt_optimizer_step(u->o);
    return rc == 0 ? ckpt_scheduler_step(u->sch) : rc;
}

static void run_close(rank_run *u) {
    ckpt_accelerator_free(u->acc);
    ckpt_scheduler_free(u->sch);
    ckpt_optimizer_free(u->o);
    ckpt_model_free(u->m);
}

/* ---- one job ------------------------------------------------------------------ */

typedef struct job {
    const char *proj;
    bool load; /* the faulty operation: a load (else a save) */
    strict s;
    int prep[P]; /* setting up (a clean save) */
    int rc[P];   /* the faulty operation */
    char msg[P][1024];
    bool unchanged[P]; /* a load: every object as before it */
    bool loaded[P];    /* a load: every object as saved in checkpoint_0 */
    int after[P];      /* a clean save afterwards (the communicator still works) */
    bool recovered;    /* the injected failure was recovered from: success everywhere */
    int fail_at;       /* armed once the operation starts */
    int opcalls[P];    /* the collectives each rank made in the operation */
} job;

static void job_rank(const ckpt_comm *c, void *arg) {
    job *j = arg;
    int r = c->rank;
    static rank_run runs[P];
    rank_run *u = &runs[r];
    wrap w;
    wrap_init(&w, c, &j->s);
    int rc = run_open(u, j->proj, &w.comm);
    if (rc == 0) rc = run_step(u, 1);
    if (rc == 0) rc = ckpt_save_state(u->acc, NULL); /* checkpoint_0: not counted */
    j->prep[r] = rc;
    float w1 = u->w[5], b1 = u->b[3];
    int64_t v1 = u->val.v, s1 = ckpt_optimizer_get_step(u->o);
    if (rc == 0) rc = run_step(u, 2);
    /* a load: what every object holds now must survive a failed load */
    float w0 = u->w[5], b0 = u->b[3];
    int64_t v0 = u->val.v;
    double lr0 = ckpt_optimizer_get_lr(u->o, 0);
    int64_t s0 = ckpt_optimizer_get_step(u->o);
    c->barrier(c->ctx); /* every rank set up before the count starts */
    if (r == 0) {
        memset(j->s.ncalls, 0, sizeof j->s.ncalls);
        j->s.fail_at = j->fail_at; /* armed for the operation only */
    }
    c->barrier(c->ctx);
    if (rc == 0) {
        rc = j->load ? ckpt_load_state(u->acc, NULL) : ckpt_save_state(u->acc, NULL);
        j->rc[r] = rc;
        snprintf(j->msg[r], sizeof j->msg[r], "%s", rc < 0 ? ckpt_errmsg() : "");
        j->unchanged[r] = u->w[5] == w0 && u->b[3] == b0 && u->val.v == v0 &&
                          ckpt_optimizer_get_lr(u->o, 0) == lr0 &&
                          ckpt_optimizer_get_step(u->o) == s0;
        j->loaded[r] =
            u->w[5] == w1 && u->b[3] == b1 && u->val.v == v1 && ckpt_optimizer_get_step(u->o) == s1;
    }
    /* A rank done with the operation meets the others through the strict
     * comm: one still inside it (another path) is found out here, and then
     * every call fails at once, so nobody waits for ever. Then a clean save. */
    j->opcalls[r] = j->s.ncalls[r];
    w.comm.barrier(w.comm.ctx);
    c->barrier(c->ctx);
    if (r == 0) j->s.fail_at = 0;
    c->barrier(c->ctx);
    if (!j->s.broken) {
        if (j->rc[r] < 0) ckpt_accelerator_start_over(u->acc);
        j->after[r] = ckpt_save_state(u->acc, NULL);
    }
    run_close(u);
}

static int count_checkpoints(const char *proj) {
    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_checkpoint_list(proj, false, &list, &n), CKPT_OK);
    for (int64_t i = 0; i < n; i++)
        if (list[i].status != CKPT_CHECKPOINT_COMPLETE)
            fail_msg("%s is not complete (%d)", list[i].path, list[i].status);
    free(list);
    return (int)n;
}

/* Runs one job on a fresh project; fail_at 0: none. */
static void run_job(job *j, bool load, int fail_rank, int fail_at) {
    char *proj = tu_tmpdir_new("commfaults");
    memset(j, 0, sizeof *j);
    j->proj = proj;
    j->load = load;
    j->s.fail_rank = fail_rank;
    j->fail_at = fail_at;
    tc_run(P, job_rank, j);
    for (int r = 0; r < P; r++)
        if (j->prep[r] != 0) fail_msg("rank %d: setting up failed", r);
    if (j->s.broken)
        fail_msg("%s: the ranks diverged after rank %d's call %d failed: %s",
                 load ? "load" : "save", fail_rank, fail_at, j->s.why);
    /* one outcome on every rank */
    for (int r = 1; r < P; r++) {
        if (j->rc[r] != j->rc[0] || strcmp(j->msg[r], j->msg[0]) != 0)
            fail_msg("%s, rank %d's call %d failing: rank 0 returned %d (%s), rank %d %d (%s)",
                     load ? "load" : "save", fail_rank, fail_at, j->rc[0], j->msg[0], r, j->rc[r],
                     j->msg[r]);
    }
    if (fail_at > 0 && j->rc[0] < 0) tu_assert_contains(j->msg[0], "injected");
    if (fail_at > 0 && j->rc[0] == 0) j->recovered = true;
    if (fail_at == 0 && j->rc[0] != 0)
        fail_msg("the clean %s failed: %s", load ? "load" : "save", j->msg[0]);
    /* nothing committed, nothing applied: checkpoint_0, the operation's if
     * it was a save that succeeded, and the clean save afterwards */
    char *cd = tu_pathf("%s/checkpoints", proj);
    int want = 1 + (!load && j->rc[0] == 0) + 1;
    for (int r = 0; r < P; r++) {
        if (j->after[r] != 0) fail_msg("rank %d: the save after the failure failed", r);
        if (load && j->rc[0] < 0 && !j->unchanged[r])
            fail_msg("load: rank %d's objects changed although the load failed (rank %d's call "
                     "%d): %s",
                     r, fail_rank, fail_at, j->msg[0]);
        if (load && j->rc[0] == 0 && !j->loaded[r])
            fail_msg("load: rank %d's objects are not the checkpoint's although the load "
                     "succeeded (rank %d's call %d failed)",
                     r, fail_rank, fail_at);
    }
    assert_int_equal(count_checkpoints(proj), want);
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    free(cd);
    tu_tmpdir_free(proj);
}

/* Every gather, bcast and allgather of the operation, failing on each rank
 * in turn. */
static void every_call_fails_once(bool load) {
    job clean;
    run_job(&clean, load, -1, 0);
    int n = clean.opcalls[0];
    for (int r = 1; r < P; r++) assert_int_equal(clean.opcalls[r], n);
    assert_true(n > 5 && n < MAXCALLS);
    int tried = 0, recovered = 0;
    for (int rank = 0; rank < P; rank++)
        for (int k = 1; k <= n; k++) {
            int kind = clean.s.kinds[rank][k - 1];
            if (kind != C_BCAST && kind != C_GATHER && kind != C_ALLGATHER) continue;
            job j;
            if (getenv("CKPT_TEST_VERBOSE"))
                fprintf(stderr, "%s: rank %d's call %d (%s)\n", load ? "load" : "save", rank, k,
                        kind_name[kind]);
            run_job(&j, load, rank, k);
            if (getenv("CKPT_TEST_VERBOSE")) fprintf(stderr, "  -> %d %s\n", j.rc[0], j.msg[0]);
            tried++;
            recovered += j.recovered;
        }
    printf("%s: %d collectives a rank, %d failures injected, %d recovered exactly\n",
           load ? "load" : "save", n, tried, recovered);
    assert_true(tried > 3);
}

static void test_a_failing_collective_of_a_save_fails_it_on_every_rank(void **state) {
    (void)state;
    every_call_fails_once(false);
}

static void test_a_failing_collective_of_a_load_fails_it_on_every_rank(void **state) {
    (void)state;
    every_call_fails_once(true);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_a_failing_collective_of_a_save_fails_it_on_every_rank),
        cmocka_unit_test(test_a_failing_collective_of_a_load_fails_it_on_every_rank),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
