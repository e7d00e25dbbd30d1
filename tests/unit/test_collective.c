/* test_collective.c — the collective save and load protocol on 3 ranks that
 * are threads (helpers/thread_comm.c), under the sanitizers: who writes
 * what, one outcome for every rank with the failing rank named, nothing
 * committed or applied anywhere when one rank fails, the same fallback on
 * every rank; plus the agreement itself and the file records that travel
 * between ranks. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "base/error.h"
#include "format/manifest.h"
#include "store/store.h"
#include "train/rng.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

#define P 3

/* What every rank did, checked by the main thread afterwards. */
typedef struct scen {
    const char *proj;
    int fail_rank;     /* the rank whose custom object fails, when armed */
    int phase;         /* for scenarios run in several jobs */
    int rc[P], rc2[P];
    char msg[P][2048];
    char last[P][512];
    uint32_t draw[P], draw2[P];
    float w[P][4];
    int64_t step[P];
} scen;

/* A custom object that fails on one rank when armed: its state_dict (a
 * save) or its check_state_dict (a load). */
typedef struct flaky {
    int64_t value;
    int rank, fail_rank;
    bool fail_save, fail_check;
} flaky;

static int flaky_sd(void *self, ckpt_writer *w) {
    flaky *f = self;
    if (f->fail_save && f->rank == f->fail_rank)
        return ckpt_set_error(CKPT_ENOSPC, "disk full on purpose");
    return ckpt_write_i64(w, "value", f->value);
}
static int flaky_check(void *self, ckpt_reader *r) {
    flaky *f = self;
    if (f->fail_check && f->rank == f->fail_rank)
        return ckpt_set_error(CKPT_EMISMATCH, "value refused on purpose");
    int64_t v;
    return ckpt_read_i64(r, "value", &v);
}
static int flaky_load(void *self, ckpt_reader *r) {
    return ckpt_read_i64(r, "value", &((flaky *)self)->value);
}
static const ckpt_stateful_ops flaky_ops = {
    .state_dict = flaky_sd, .load_state_dict = flaky_load, .check_state_dict = flaky_check};

/* One rank's accelerator: a model of 4 floats (the same on every rank),
 * the flaky object and the rank's generator seeded with 7. */
typedef struct rank_state {
    ckpt_accelerator *acc;
    ckpt_model *model;
    float w[4];
    flaky fl;
} rank_state;

static int rank_setup(rank_state *st, const ckpt_comm *c, const scen *s) {
    memset(st, 0, sizeof *st);
    for (int i = 0; i < 4; i++) st->w[i] = (float)i + 0.5f;
    st->fl = (flaky){.value = 10, .rank = c->rank, .fail_rank = s->fail_rank};
    /* every file written by every save (no links): the scenarios corrupt
     * one checkpoint's file and count the ranks' writes */
    ckpt_project_config cfg = {.project_dir = s->proj,
                               .automatic_checkpoint_naming = true,
                               .comm = c,
                               .no_link_unchanged = true};
    int rc;
    if ((rc = ckpt_model_new(&st->model)) < 0) return rc;
    if ((rc = ckpt_model_add_param(st->model, "w", CKPT_F32, 1, (int64_t[]){4}, st->w, NULL)) < 0)
        return rc;
    if ((rc = ckpt_accelerator_new(&st->acc, &cfg)) < 0) return rc;
    if ((rc = ckpt_prepare_model(st->acc, st->model)) < 0) return rc;
    if ((rc = ckpt_register_for_checkpointing(st->acc, &flaky_ops, &st->fl)) < 0) return rc;
    return ckpt_set_seed(st->acc, 7);
}

static void rank_free(rank_state *st) {
    ckpt_accelerator_free(st->acc);
    ckpt_model_free(st->model);
}

static void record(scen *s, int r, int rc, const ckpt_accelerator *acc) {
    s->rc[r] = rc;
    snprintf(s->msg[r], sizeof s->msg[r], "%s", rc < 0 ? ckpt_errmsg() : "");
    snprintf(s->last[r], sizeof s->last[r], "%s", ckpt_accelerator_last_dir(acc));
}

/* Every rank returned code, with one message containing needle. */
static void assert_same_outcome(const scen *s, int code, const char *needle) {
    for (int r = 0; r < P; r++) {
        if (s->rc[r] != code) fprintf(stderr, "rank %d: rc %d: %s\n", r, s->rc[r], s->msg[r]);
        assert_int_equal(s->rc[r], code);
        assert_string_equal(s->msg[r], s->msg[0]);
        assert_string_equal(s->last[r], s->last[0]);
    }
    if (needle) tu_assert_contains(s->msg[0], needle);
}

static char *ckpt_dir(const char *proj, int n) {
    return tu_pathf("%s/checkpoints/checkpoint_%d", proj, n);
}

/* ---- save ------------------------------------------------------------------ */

static void save_twice(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    int rc = rank_setup(&st, c, s);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    record(s, c->rank, rc, st.acc);
    rank_free(&st);
}

static void test_collective_save_writes_replicated_files_once_and_a_random_state_per_rank(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = -1};
    tc_run(P, save_twice, &s);
    assert_same_outcome(&s, 0, NULL);
    char *dir = ckpt_dir(s.proj, 1);
    assert_string_equal(s.last[0], dir);
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    assert_int_equal(m.num_processes, P);
    assert_int_equal(m.process_index, 0);
    /* model, the model's tensor, custom object, then one random state per
     * rank, written by it. The save plan places the replicated tensors:
     * the model's one 16-byte tensor goes whole to the rank its middle byte
     * falls to (rank 1 of 3), as a chunk in its shard file; the model's own
     * file, written by rank 0, keeps the rest. */
    assert_int_equal(m.format_version, 2);
    assert_int_equal(m.nfiles, 3 + P);
    assert_string_equal(m.files[0].name, "model.safetensors");
    assert_int_equal(m.files[0].rank, 0);
    assert_int_equal(m.files[0].ntensors, 0);
    assert_string_equal(m.files[1].name, "custom_checkpoint_0.safetensors");
    const ckpt_manifest_file *mf = ckpt__manifest_find(&m, "model-00002-of-00003.safetensors");
    assert_non_null(mf);
    assert_int_equal(mf->rank, 1);
    assert_int_equal(mf->ntensors, 1);
    assert_string_equal(mf->tensor_keys[0], "w");
    assert_int_equal(mf->chunks[0].offsets[0], 0);
    assert_int_equal(mf->chunks[0].shape[0], 4);
    for (int r = 0; r < P; r++) {
        char name[64];
        snprintf(name, sizeof name, "random_states_%d.safetensors", r);
        const ckpt_manifest_file *f = ckpt__manifest_find(&m, name);
        assert_non_null(f);
        assert_int_equal(f->rank, r);
        assert_string_equal(f->kind, "random_states");
    }
    ckpt__manifest_clear(&m);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    char *cdir = tu_pathf("%s/checkpoints", s.proj);
    assert_int_equal(tu_count_hidden_tmp(cdir), 0);
    free(cdir);
    free(dir);
}

/* ---- load ------------------------------------------------------------------ */

static void save_change_load(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    int rc = rank_setup(&st, c, s);
    ckpt_accelerator_set_step(st.acc, 5);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    ckpt_rng *g = ckpt_accelerator_rng(st.acc);
    s->draw[c->rank] = ckpt_rng_u32(g); /* the first draw after the save */
    for (int i = 0; i < 4; i++) st.w[i] = -1.0f;
    st.fl.value = 99;
    ckpt_accelerator_set_step(st.acc, 0);
    if (rc == 0) rc = ckpt_load_state(st.acc, NULL);
    s->draw2[c->rank] = ckpt_rng_u32(g);
    memcpy(s->w[c->rank], st.w, sizeof st.w);
    s->step[c->rank] = ckpt_accelerator_step(st.acc);
    s->rc2[c->rank] = (int)st.fl.value;
    record(s, c->rank, rc, st.acc);
    rank_free(&st);
}

static void test_collective_load_restores_every_rank_with_its_own_random_state(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = -1};
    tc_run(P, save_change_load, &s);
    assert_same_outcome(&s, 0, NULL);
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.draw2[r], s.draw[r]); /* the generator is back where it was saved */
        for (int i = 0; i < 4; i++) assert_true(s.w[r][i] == (float)i + 0.5f);
        assert_int_equal(s.step[r], 5);
        assert_int_equal(s.rc2[r], 10);
    }
    assert_int_not_equal(s.draw[0], s.draw[1]); /* each rank has a stream of its own */
    assert_int_not_equal(s.draw[1], s.draw[2]);
}

/* ---- another process count ---------------------------------------------- */

/* Saved by P ranks, loaded by q: every rank loads, rank 0 continues its
 * saved generator exactly and rank r the documented derivation of it. */
typedef struct reshard_scen {
    const char *proj;
    int rc[8];
    ckpt_rng saved0; /* rank 0's generator right after the save */
    uint32_t draw[8];
    int warnings;    /* on rank 0 */
} reshard_scen;

static void count_warnings(void *user, ckpt_log_level level, const char *msg) {
    if (level == CKPT_LOG_WARNING && strstr(msg, "random generators continue")) (*(int *)user)++;
}

static void reshard_save(const ckpt_comm *c, void *arg) {
    reshard_scen *s = arg;
    scen sc = {.proj = s->proj, .fail_rank = -1};
    rank_state st;
    int rc = rank_setup(&st, c, &sc);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    if (c->rank == 0) s->saved0 = *ckpt_accelerator_rng(st.acc);
    s->rc[c->rank] = rc;
    rank_free(&st);
}

static void reshard_load(const ckpt_comm *c, void *arg) {
    reshard_scen *s = arg;
    scen sc = {.proj = s->proj, .fail_rank = -1};
    rank_state st;
    int rc = rank_setup(&st, c, &sc);
    if (c->rank == 0) ckpt_accelerator_set_log(st.acc, count_warnings, &s->warnings);
    if (rc == 0) rc = ckpt_load_state(st.acc, NULL);
    s->draw[c->rank] = ckpt_rng_u32(ckpt_accelerator_rng(st.acc));
    s->rc[c->rank] = rc;
    rank_free(&st);
}

static void test_collective_load_on_another_process_count_derives_every_ranks_generator(void **st) {
    (void)st;
    for (int q = 1; q <= 4; q++) {
        if (q == P) continue;
        char *proj = tu_pathf("%s/q%d", tu_dir(), q);
        reshard_scen s = {.proj = proj};
        tc_run(P, reshard_save, &s);
        for (int r = 0; r < P; r++) assert_int_equal(s.rc[r], 0);
        tc_run(q, reshard_load, &s);
        for (int r = 0; r < q; r++) {
            if (s.rc[r] != 0) fprintf(stderr, "q=%d rank %d: %s\n", q, r, ckpt_errmsg());
            assert_int_equal(s.rc[r], 0);
            ckpt_rng want;
            ckpt__rng_reshard(&s.saved0, r, &want);
            assert_int_equal(s.draw[r], ckpt_rng_u32(&want));
        }
        ckpt_rng same = s.saved0; /* rank 0 continues exactly */
        assert_int_equal(s.draw[0], ckpt_rng_u32(&same));
        if (q > 1) assert_int_not_equal(s.draw[0], s.draw[1]);
        assert_int_equal(s.warnings, 1); /* said once, by rank 0 */
        free(proj);
    }
}

/* ---- a failure on one rank --------------------------------------------------- */

static void save_then_fail(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    int rc = rank_setup(&st, c, s);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    s->rc2[c->rank] = rc;
    st.fl.fail_save = true;
    st.fl.value = 11;
    rc = ckpt_save_state(st.acc, NULL);
    record(s, c->rank, rc, st.acc);
    /* the previous checkpoint still loads, on every rank */
    st.fl.fail_save = false;
    s->draw[c->rank] = (uint32_t)ckpt_load_state(st.acc, NULL);
    s->step[c->rank] = st.fl.value;
    rank_free(&st);
}

static void test_collective_save_failing_on_one_rank_fails_on_every_rank_naming_it(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = 2};
    tc_run(P, save_then_fail, &s);
    for (int r = 0; r < P; r++) assert_int_equal(s.rc2[r], 0);
    assert_same_outcome(&s, CKPT_ENOSPC, "rank 2: save_state: ");
    tu_assert_contains(s.msg[0], "custom_checkpoint_0.safetensors: state_dict: disk full on purpose");
    char *cdir = tu_pathf("%s/checkpoints", s.proj);
    int64_t *nums = NULL, count = 0;
    assert_int_equal(ckpt__list_numbers(cdir, &nums, &count), 0);
    assert_int_equal(count, 1); /* no new checkpoint */
    assert_int_equal(nums[0], 0);
    free(nums);
    assert_int_equal(tu_count_hidden_tmp(cdir), 0);
    free(cdir);
    for (int r = 0; r < P; r++) {
        assert_int_equal((int)s.draw[r], 0);
        assert_int_equal(s.step[r], 10); /* what checkpoint_0 holds */
    }
}

static void load_with_refusal(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    int rc = rank_setup(&st, c, s);
    ckpt_accelerator_set_step(st.acc, 3);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    s->rc2[c->rank] = rc;
    for (int i = 0; i < 4; i++) st.w[i] = 9.0f;
    st.fl.value = 12;
    ckpt_accelerator_set_step(st.acc, 4);
    ckpt_rng *g = ckpt_accelerator_rng(st.acc);
    ckpt_rng before = *g;
    st.fl.fail_check = true;
    rc = ckpt_load_state(st.acc, NULL);
    record(s, c->rank, rc, st.acc);
    memcpy(s->w[c->rank], st.w, sizeof st.w);
    s->step[c->rank] = ckpt_accelerator_step(st.acc) * 100 + st.fl.value;
    s->draw[c->rank] = memcmp(&before, g, sizeof before) == 0;
    rank_free(&st);
}

static void test_collective_load_refused_on_one_rank_changes_nothing_on_any_rank(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = 1};
    tc_run(P, load_with_refusal, &s);
    for (int r = 0; r < P; r++) assert_int_equal(s.rc2[r], 0);
    /* last_dir stays the saved folder's on every rank: the load did not happen */
    assert_same_outcome(&s, CKPT_EMISMATCH, "rank 1: load_state: ");
    tu_assert_contains(s.msg[0], "value refused on purpose");
    for (int r = 0; r < P; r++) {
        for (int i = 0; i < 4; i++) assert_true(s.w[r][i] == 9.0f);
        assert_int_equal(s.step[r], 4 * 100 + 12);
        assert_int_equal(s.draw[r], 1); /* the generator untouched */
    }
}

/* ---- fallback -------------------------------------------------------------- */

static void save_or_load(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    int rc = rank_setup(&st, c, s);
    if (s->phase == 0) {
        for (int k = 0; rc == 0 && k < 2; k++) {
            ckpt_accelerator_set_step(st.acc, 10 + k);
            rc = ckpt_save_state(st.acc, NULL);
        }
    } else if (rc == 0) {
        rc = ckpt_load_state(st.acc, NULL);
    }
    s->step[c->rank] = ckpt_accelerator_step(st.acc);
    record(s, c->rank, rc, st.acc);
    rank_free(&st);
}

static void test_collective_load_falls_back_on_every_rank_past_one_ranks_corrupt_file(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = -1};
    tc_run(P, save_or_load, &s);
    assert_same_outcome(&s, 0, NULL);
    char *newest = ckpt_dir(s.proj, 1), *older = ckpt_dir(s.proj, 0);
    char *f = tu_pathf("%s/random_states_2.safetensors", newest);
    tu_flip_byte(f, -1);
    s.phase = 1;
    tc_run(P, save_or_load, &s);
    assert_same_outcome(&s, 0, NULL);
    for (int r = 0; r < P; r++) {
        assert_string_equal(s.last[r], older);
        assert_int_equal(s.step[r], 10);
    }
    /* and with every older one gone, the same error everywhere */
    char *model = tu_pathf("%s/model.safetensors", older);
    tu_flip_byte(model, 0);
    free(model);
    tc_run(P, save_or_load, &s);
    assert_same_outcome(&s, CKPT_ECORRUPT, "load_state: no valid checkpoint in ");
    tu_assert_contains(s.msg[0], "rank 2: ");
    free(f);
    free(newest);
    free(older);
}

/* ---- rank 0's plan fails ------------------------------------------------------ */

static void save_once(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    int rc = rank_setup(&st, c, s);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    record(s, c->rank, rc, st.acc);
    rank_free(&st);
}

static void test_collective_save_busy_on_rank_0_is_busy_on_every_rank(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = -1};
    char *cdir = tu_pathf("%s/checkpoints", s.proj);
    assert_int_equal(ckpt__mkdirs(cdir), 0);
    char *lockp = ckpt__lock_path(cdir, "checkpoint_0");
    ckpt_lock lk = {.fd = -1};
    assert_int_equal(ckpt__lock_acquire(&lk, lockp, false), 0);
    tc_run(P, save_once, &s);
    ckpt__lock_release(&lk);
    assert_same_outcome(&s, CKPT_EBUSY, "rank 0: save_state: ");
    tc_run(P, save_once, &s);
    assert_same_outcome(&s, 0, NULL);
    free(lockp);
    free(cdir);
}

/* ---- sharded tensors ------------------------------------------------------------ */

/* Rank r owns rows 2r, 2r+1 of a [2P, 3] tensor. */
typedef struct rows {
    int rank;
    bool overlap; /* rank 2 claims rank 1's rows */
    float v[2][3];
} rows;

static int rows_sd(void *self, ckpt_writer *w) {
    rows *x = self;
    int first = x->overlap && x->rank == 2 ? 2 : 2 * x->rank;
    int64_t global[2] = {2 * P, 3}, off[2] = {first, 0}, local[2] = {2, 3};
    CKPT_TRY(ckpt_write_i64(w, "ranks", P));
    return ckpt_write_tensor_shard(w, "table", CKPT_F32, 2, global, off, local, x->v);
}
static int rows_load(void *self, ckpt_reader *r) {
    rows *x = self;
    int64_t global[2] = {2 * P, 3}, off[2] = {2 * x->rank, 0}, local[2] = {2, 3};
    return ckpt_read_tensor_shard(r, "table", CKPT_F32, 2, global, off, local, x->v);
}
static const ckpt_stateful_ops rows_ops = {.state_dict = rows_sd, .load_state_dict = rows_load};

static void save_shards(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    rows x = {.rank = c->rank};
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 3; j++) x.v[i][j] = (float)(100 * c->rank + 10 * i + j);
    int rc = rank_setup(&st, c, s);
    if (rc == 0) rc = ckpt_register_for_checkpointing(st.acc, &rows_ops, &x);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    memset(x.v, 0, sizeof x.v);
    if (rc == 0) rc = ckpt_load_state(st.acc, NULL);
    s->w[c->rank][0] = x.v[0][0];
    s->w[c->rank][1] = x.v[1][2];
    record(s, c->rank, rc, st.acc);
    rank_free(&st);
}

static void save_overlapping_shards(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    rank_state st;
    rows x = {.rank = c->rank, .overlap = true};
    int rc = rank_setup(&st, c, s);
    if (rc == 0) rc = ckpt_register_for_checkpointing(st.acc, &rows_ops, &x);
    if (rc == 0) rc = ckpt_save_state(st.acc, NULL);
    record(s, c->rank, rc, st.acc);
    rank_free(&st);
}

static void test_collective_save_of_chunks_that_overlap_fails_on_every_rank(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = -1};
    tc_run(P, save_overlapping_shards, &s);
    assert_same_outcome(&s, CKPT_EINVAL, "rank 0: save_state: ");
    tu_assert_contains(s.msg[0], "table");
    char *cdir = tu_pathf("%s/checkpoints", s.proj);
    int64_t *nums = NULL, count = 0;
    assert_int_equal(ckpt__list_numbers(cdir, &nums, &count), 0);
    assert_int_equal(count, 0);
    free(nums);
    assert_int_equal(tu_count_hidden_tmp(cdir), 0);
    free(cdir);
}

static void test_collective_save_writes_each_ranks_shard_file_and_load_reads_it(void **st) {
    (void)st;
    scen s = {.proj = tu_dir(), .fail_rank = -1};
    tc_run(P, save_shards, &s);
    assert_same_outcome(&s, 0, NULL);
    for (int r = 0; r < P; r++) { /* each rank read its rows back */
        assert_true(s.w[r][0] == (float)(100 * r));
        assert_true(s.w[r][1] == (float)(100 * r + 12));
    }
    char *dir = ckpt_dir(s.proj, 0);
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    /* the replicated part once, by rank 0 */
    const ckpt_manifest_file *f = ckpt__manifest_find(&m, "custom_checkpoint_1.safetensors");
    assert_non_null(f);
    assert_int_equal(f->rank, 0);
    assert_int_equal(f->ntensors, 0);
    for (int r = 0; r < P; r++) {
        char name[96];
        snprintf(name, sizeof name, "custom_checkpoint_1-%05d-of-%05d.safetensors", r + 1, P);
        f = ckpt__manifest_find(&m, name);
        assert_non_null(f);
        assert_int_equal(f->rank, r);
        assert_string_equal(f->kind, "custom");
        /* the file holds exactly rank r's rows */
        char *path = tu_pathf("%s/%s", dir, name);
        ckpt_reader *rd = NULL;
        assert_int_equal(ckpt_reader_open(&rd, path), 0);
        assert_int_equal(ckpt_reader_count(rd), 1);
        const void *p = NULL;
        ckpt_entry_info info;
        assert_int_equal(ckpt_reader_entry(rd, 0, &info), 0);
        assert_int_equal(ckpt_reader_tensor_view(rd, info.key, &p, &info), 0);
        assert_int_equal(info.nbytes, 6 * sizeof(float));
        assert_true(((const float *)p)[5] == (float)(100 * r + 12));
        ckpt_reader_free(rd);
        free(path);
    }
    ckpt__manifest_clear(&m);
    free(dir);
}

/* ---- the agreement itself ------------------------------------------------------ */

static bool fatal(int rc) { return rc != CKPT_ECORRUPT; }

static void agree_cases(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    int r = c->rank, rc = 0;
    if (r == 1) rc = ckpt_set_error(CKPT_ECORRUPT, "bad file on 1");
    if (r == 2) rc = ckpt_set_error(CKPT_ENOMEM, "no memory on 2");
    s->rc[r] = ckpt__coll_agree(c, rc, NULL);
    snprintf(s->msg[r], sizeof s->msg[r], "%s", ckpt_errmsg());
    if (r == 1) rc = ckpt_set_error(CKPT_ECORRUPT, "bad file on 1");
    if (r == 2) rc = ckpt_set_error(CKPT_ENOMEM, "no memory on 2");
    s->rc2[r] = ckpt__coll_agree(c, rc, fatal);
    snprintf(s->last[r], sizeof s->last[r], "%s", ckpt_errmsg());
    ckpt_clear_error();
    s->step[r] = ckpt__coll_agree(c, 0, NULL);
    s->draw[r] = (uint32_t)strlen(ckpt_errmsg());
}

static void test_agree_names_the_lowest_failing_rank_or_the_preferred_failure(void **st) {
    (void)st;
    scen s = {.proj = tu_dir()};
    tc_run(P, agree_cases, &s);
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.rc[r], CKPT_ECORRUPT);
        assert_string_equal(s.msg[r], "rank 1: bad file on 1 (1 other rank failed too)");
        assert_int_equal(s.rc2[r], CKPT_ENOMEM);
        assert_string_equal(s.last[r], "rank 2: no memory on 2 (1 other rank failed too)");
        assert_int_equal(s.step[r], 0);
        assert_int_equal(s.draw[r], 0); /* success leaves the message alone */
    }
}

/* ---- file records between ranks ---------------------------------------------- */

static void add_file(ckpt_manifest *m, const char *name, const char *kind, int rank) {
    char *key = (char *)"t";
    uint64_t digest = 0x1234;
    ckpt_file_digest d = {.size = 100, .xxh3 = 0xabcdef, .ntensors = 1, .tensor_keys = &key,
                          .tensor_xxh3 = &digest};
    assert_int_equal(ckpt__manifest_add(m, name, kind, &d), 0);
    m->files[m->nfiles - 1].rank = rank;
}

/* ---- warnings ---------------------------------------------------------------- */

/* A data loader's warning is about what every rank holds alike: said by
 * rank 0 alone, not once per rank (as mpirun showed it, twice). */
typedef struct warn_scen {
    const char *proj;
    int rc[P];
    int warnings[P];
    char last[P][512];
} warn_scen;

static void count_warning(void *user, ckpt_log_level level, const char *msg) {
    int *n = user;
    if (level == CKPT_LOG_WARNING) (*n)++;
    (void)msg;
}

static void skip_after_load(const ckpt_comm *c, void *arg) {
    warn_scen *s = arg;
    static const float data[P][64] = {{0}};
    ckpt_dataset ds;
    ckpt_dataloader *dl = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_dataloader_config dc = ckpt_dataloader_defaults();
    dc.batch_size = 4;
    ckpt_project_config cfg = {
        .project_dir = s->proj, .automatic_checkpoint_naming = true, .comm = c};
    ckpt_batch b;
    int rc = ckpt_memory_dataset(&ds, data[c->rank], 64, sizeof(float));
    if (rc == 0) rc = ckpt_dataloader_new(&dl, &ds, &dc);
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) ckpt_accelerator_set_log(acc, count_warning, &s->warnings[c->rank]);
    if (rc == 0) rc = ckpt_prepare_dataloader(acc, dl);
    for (int i = 0; i < 3 && rc == 0; i++) rc = ckpt_dataloader_next(dl, &b) == 1 ? 0 : -1;
    if (rc == 0) rc = ckpt_save_state(acc, NULL);
    if (rc == 0) rc = ckpt_load_state(acc, NULL);
    if (rc == 0) rc = ckpt_skip_first_batches(dl, 1); /* on top of the restored position */
    s->rc[c->rank] = rc;
    if (acc) snprintf(s->last[c->rank], sizeof s->last[0], "%s", ckpt_accelerator_last_dir(acc));
    ckpt_accelerator_free(acc);
    ckpt_dataloader_free(dl);
}

static void test_warnings_about_replicated_state_are_said_once(void **st) {
    (void)st;
    warn_scen s = {.proj = tu_dir()};
    tc_run(P, skip_after_load, &s);
    for (int r = 0; r < P; r++) assert_int_equal(s.rc[r], 0);
    assert_int_equal(s.warnings[0], 1);
    for (int r = 1; r < P; r++) assert_int_equal(s.warnings[r], 0);
}

static void test_file_records_travel_as_json_and_are_checked_on_arrival(void **st) {
    (void)st;
    ckpt_manifest a, b;
    ckpt__manifest_init(&a);
    ckpt__manifest_init(&b);
    add_file(&a, "model.safetensors", "model", 0);
    add_file(&a, "random_states_1.safetensors", "random_states", 1);
    char *json = NULL;
    size_t len = 0;
    assert_int_equal(ckpt__manifest_files_to_json(&a, &json, &len), 0);
    b.num_processes = 2;
    assert_int_equal(ckpt__manifest_files_from_json(&b, json, len, "records"), 0);
    assert_int_equal(b.nfiles, 2);
    for (int i = 0; i < 2; i++) {
        assert_string_equal(b.files[i].name, a.files[i].name);
        assert_string_equal(b.files[i].kind, a.files[i].kind);
        assert_int_equal(b.files[i].rank, a.files[i].rank);
        assert_int_equal(b.files[i].size, 100);
        assert_int_equal(b.files[i].xxh3, 0xabcdef);
        assert_int_equal(b.files[i].ntensors, 1);
        assert_int_equal(b.files[i].tensor_xxh3[0], 0x1234);
    }
    /* the same records again: names clash, and b keeps what it had */
    tu_expect_error(ckpt__manifest_files_from_json(&b, json, len, "records of rank 1"), CKPT_ECORRUPT,
                    "records of rank 1: file \"model.safetensors\" is listed twice");
    assert_int_equal(b.nfiles, 2);
    /* a rank outside the job, and garbage */
    ckpt__manifest_clear(&b);
    b.num_processes = 1;
    tu_expect_error(ckpt__manifest_files_from_json(&b, json, len, "records"), CKPT_ECORRUPT,
                    "\"rank\" is 1, expected 0..0");
    assert_int_equal(b.nfiles, 0);
    static const char *const bad[] = {"", "{}", "[1]", "[{\"name\":\"../x\"}]", "[{\"name\":\"a\"}"};
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        assert_true(ckpt__manifest_files_from_json(&b, bad[i], strlen(bad[i]), "records") ==
                    CKPT_ECORRUPT);
        assert_int_equal(b.nfiles, 0);
    }
    free(json);
    ckpt__manifest_clear(&a);
    ckpt__manifest_clear(&b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(
            test_collective_save_writes_replicated_files_once_and_a_random_state_per_rank,
            tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_load_restores_every_rank_with_its_own_random_state, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_save_failing_on_one_rank_fails_on_every_rank_naming_it, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_load_refused_on_one_rank_changes_nothing_on_any_rank, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_load_falls_back_on_every_rank_past_one_ranks_corrupt_file,
            tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_collective_save_busy_on_rank_0_is_busy_on_every_rank,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_save_writes_each_ranks_shard_file_and_load_reads_it, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_save_of_chunks_that_overlap_fails_on_every_rank, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_agree_names_the_lowest_failing_rank_or_the_preferred_failure, tu_tmpdir_setup,
            tu_tmpdir_teardown),
        cmocka_unit_test(test_file_records_travel_as_json_and_are_checked_on_arrival),
        cmocka_unit_test_setup_teardown(test_warnings_about_replicated_state_are_said_once,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_collective_load_on_another_process_count_derives_every_ranks_generator,
            tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
