/* test_tiers.c — node-local tiers (ckpt_project_config.local_dir) on 4 ranks
 * that are threads (helpers/thread_comm.c), as 2 nodes of 2 (ranks_per_node),
 * and on one process: where each save goes (each rank's folder holds its part
 * and its replica's, byte for byte the project's files; every K-th save
 * persisted), and what a load takes: the newest save whose every part is
 * verified somewhere (a lost node's parts from the other node's replicas, a
 * corrupt copy skipped for the other one, a node back with a stale tier), the
 * project folder otherwise with one line saying why, never a mix of two
 * saves; the configuration's errors; asynchronous saves. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>
#include <dirent.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "base/error.h"
#include "base/io.h"
#include "store/store.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

#define P 4
#define NW 300000 /* model floats: 1.2 MB, spread over the ranks' shard files */

/* What every rank did, checked by the main thread afterwards. */
typedef struct scen {
    char proj[512], local[512];
    int persist_every, keep;
    int nsaves;        /* saves of this job */
    int gen0;          /* the state of its first save: gen0, then gen0 + 1, ... */
    bool load;         /* load first */
    bool async;        /* asynchronous saves */
    bool persist_next; /* ask for the job's last save to be persisted */
    /* async: before waiting, each rank watches its local temporary folder
     * until the replica it keeps has arrived (the background thread's
     * doing); seen[r] says whether it did */
    bool watch_bg;
    bool seen[P];
    int fail_rank, fail_save; /* this rank's state_dict fails at that save (fail_rank >= 0) */
    int rc[P], save_rc[P];
    char msg[P][2048];
    char last[P][512];
    int64_t iteration[P];
    float w0[P];      /* the model's first weight after the load */
    int64_t value[P]; /* the custom object's after the load */
    uint32_t draw[P]; /* the generator's next draw after the load (or after the saves) */
    char warn[4096];  /* rank 0's warnings */
} scen;

/* The state of "generation" g: the model's weights and the custom value
 * depend on it; the generator is drawn from after each save. */
typedef struct rank_state {
    ckpt_accelerator *acc;
    ckpt_model *model;
    float w[NW];
    int64_t value;
} rank_state;

static int value_sd(void *self, ckpt_writer *w) {
    if (*(int64_t *)self == -7) return -1; /* a failing state_dict (scen.fail_rank) */
    return ckpt_write_i64(w, "value", *(int64_t *)self);
}

/* Whether a temporary folder in rank r's local folder holds the replica of
 * rank q's generator (its file exists: the background thread received it). */
static bool replica_arriving(const scen *s, int r, int q) {
    char *dir = tu_pathf("%s/l%d/rank_%d", tu_dir(), r / 2, r);
    bool found = false;
    DIR *d = opendir(dir);
    struct dirent *e;
    while (d && !found && (e = readdir(d)) != NULL) {
        if (strncmp(e->d_name, ".checkpoint_", 12) != 0) continue;
        char *f = tu_pathf("%s/%s/random_states_%d.safetensors", dir, e->d_name, q);
        found = tu_exists(f);
        free(f);
    }
    if (d) closedir(d);
    free(dir);
    (void)s;
    return found;
}
static int value_load(void *self, ckpt_reader *r) { return ckpt_read_i64(r, "value", self); }
static const ckpt_stateful_ops value_ops = {.state_dict = value_sd, .load_state_dict = value_load};

static void collect_warning(void *user, ckpt_log_level level, const char *msg) {
    scen *s = user;
    if (level == CKPT_LOG_INFO) return;
    size_t n = strlen(s->warn);
    snprintf(s->warn + n, sizeof s->warn - n, "%s\n", msg);
}

static void set_gen(rank_state *st, int g) {
    for (int i = 0; i < NW; i++) st->w[i] = (float)g + (float)i * 0.25f;
    st->value = 1000 + g;
}

static int rank_setup(rank_state *st, const ckpt_comm *c, scen *s) {
    memset(st, 0, sizeof *st);
    set_gen(st, -1);
    ckpt_project_config cfg = {.project_dir = s->proj,
                               .automatic_checkpoint_naming = true,
                               .comm = c,
                               .local_dir = s->local,
                               .ranks_per_node = c && c->size > 1 ? 2 : 0,
                               .persist_every = s->persist_every,
                               .local_total_limit = s->keep};
    int rc;
    if ((rc = ckpt_model_new(&st->model)) < 0) return rc;
    if ((rc = ckpt_model_add_param(st->model, "w", CKPT_F32, 1, (int64_t[]){NW}, st->w, NULL)) < 0)
        return rc;
    if ((rc = ckpt_accelerator_new(&st->acc, &cfg)) < 0) return rc;
    if (!c || c->rank == 0) ckpt_accelerator_set_log(st->acc, collect_warning, s);
    if ((rc = ckpt_prepare_model(st->acc, st->model)) < 0) return rc;
    if ((rc = ckpt_register_for_checkpointing(st->acc, &value_ops, &st->value)) < 0) return rc;
    return ckpt_set_seed(st->acc, 7);
}

/* One job: optionally load, then nsaves saves of generations gen0, ... */
static void job(const ckpt_comm *c, void *arg) {
    scen *s = arg;
    int r = c ? c->rank : 0;
    rank_state *st = calloc(1, sizeof *st);
    int rc = st ? rank_setup(st, c, s) : CKPT_ENOMEM;
    /* the other ranks' log goes nowhere: keep a scratch scen alive */
    static scen sink[P];
    if (rc == 0 && c && r != 0) ckpt_accelerator_set_log(st->acc, collect_warning, &sink[r]);
    if (rc == 0 && s->load) {
        rc = ckpt_load_state(st->acc, NULL);
        s->w0[r] = st->w[0];
        s->value[r] = st->value;
        s->draw[r] = ckpt_rng_u32(ckpt_accelerator_rng(st->acc));
        s->iteration[r] = ckpt_accelerator_iteration(st->acc);
        snprintf(s->last[r], sizeof s->last[r], "%s", ckpt_accelerator_last_dir(st->acc));
    }
    s->rc[r] = rc;
    snprintf(s->msg[r], sizeof s->msg[r], "%s", rc < 0 ? ckpt_errmsg() : "");
    int src = 0;
    for (int k = 0; k < s->nsaves && st && st->acc; k++) {
        set_gen(st, s->gen0 + k);
        if (s->fail_rank == r && s->fail_save == k) st->value = -7;
        if (s->persist_next && k == s->nsaves - 1) ckpt_accelerator_persist_next_save(st->acc);
        int x = s->async ? ckpt_save_state_async(st->acc, NULL) : ckpt_save_state(st->acc, NULL);
        if (s->async && s->watch_bg && x == 0 && c) {
            /* up to 20 s: the replica appears while nobody waits for the save */
            for (int i = 0; i < 2000 && !s->seen[r]; i++) {
                s->seen[r] = replica_arriving(s, r, (r + 2) % P);
                if (!s->seen[r]) usleep(10000);
            }
        }
        if (x < 0 && src == 0) {
            src = x;
            snprintf(s->msg[r], sizeof s->msg[r], "%s", ckpt_errmsg());
        }
        if (!s->load) s->draw[r] = ckpt_rng_u32(ckpt_accelerator_rng(st->acc));
    }
    if (st && st->acc && s->async) {
        int x = ckpt_save_wait(st->acc);
        if (x < 0 && src == 0) {
            src = x;
            snprintf(s->msg[r], sizeof s->msg[r], "%s", ckpt_errmsg());
        }
    }
    s->save_rc[r] = src;
    if (st && s->nsaves && !s->load)
        snprintf(s->last[r], sizeof s->last[r], "%s", ckpt_accelerator_last_dir(st->acc));
    if (st) {
        ckpt_accelerator_free(st->acc);
        ckpt_model_free(st->model);
    }
    free(st);
}

static void init_scen(scen *s, int persist_every) {
    memset(s, 0, sizeof *s);
    snprintf(s->proj, sizeof s->proj, "%s/proj", tu_dir());
    snprintf(s->local, sizeof s->local, "%s/l%%n", tu_dir());
    s->persist_every = persist_every;
    s->fail_rank = -1;
}

static void run(scen *s, bool load, int nsaves, int gen0) {
    s->load = load;
    s->nsaves = nsaves;
    s->gen0 = gen0;
    s->warn[0] = '\0';
    tc_run(P, job, s);
}

static void assert_ok(const scen *s) {
    for (int r = 0; r < P; r++) {
        if (s->rc[r] || s->save_rc[r])
            fprintf(stderr, "rank %d: rc %d/%d: %s\n", r, s->rc[r], s->save_rc[r], s->msg[r]);
        assert_int_equal(s->rc[r], 0);
        assert_int_equal(s->save_rc[r], 0);
    }
}

/* Every rank loaded generation g (the model, the custom value). */
static void assert_loaded_gen(const scen *s, int g) {
    for (int r = 0; r < P; r++) {
        assert_true(s->w0[r] == (float)g);
        assert_int_equal(s->value[r], 1000 + g);
    }
}

/* Paths made by tu_pathf, freed after each test. */
static char *kept[512];
static int nkept;
static char *K(char *p) {
    if (nkept < (int)(sizeof kept / sizeof kept[0])) kept[nkept++] = p;
    return p;
}
static int teardown(void **state) {
    while (nkept > 0) free(kept[--nkept]);
    return tu_tmpdir_teardown(state);
}

static char *node_dir(int n) { return K(tu_pathf("%s/l%d", tu_dir(), n)); }
static char *rank_ckpt(int rank, int number) {
    return K(tu_pathf("%s/l%d/rank_%d/checkpoint_%d", tu_dir(), rank / 2, rank, number));
}
static char *proj_ckpt(int number) {
    return K(tu_pathf("%s/proj/checkpoints/checkpoint_%d", tu_dir(), number));
}

/* ---- where a save goes ----------------------------------------------------------- */

static void test_tiers_each_rank_keeps_its_part_and_its_replica_as_the_project_has_them(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 1);
    run(&s, false, 2, 0); /* checkpoint_0 and _1, both persisted; keep 1 locally */
    assert_ok(&s);
    for (int r = 0; r < P; r++) {
        char *gone = rank_ckpt(r, 0), *dir = rank_ckpt(r, 1);
        assert_false(tu_exists(gone)); /* local_total_limit 1 */
        assert_string_equal(s.last[r], K(tu_pathf("%s/checkpoints/checkpoint_1", s.proj)));
        /* its own generator, and its replica's (rank r - 2, the other node) */
        char *own = K(tu_pathf("%s/random_states_%d.safetensors", dir, r));
        char *rep = K(tu_pathf("%s/random_states_%d.safetensors", dir, (r + 2) % P));
        char *other = K(tu_pathf("%s/random_states_%d.safetensors", dir, (r + 1) % 2 + r / 2 * 2));
        assert_true(tu_exists(own));
        assert_true(tu_exists(rep));
        assert_false(tu_exists(other));
        /* every file there is the project's, byte for byte, manifest included */
        char *proj = proj_ckpt(1);
        ckpt_checkpoint_file *files = NULL;
        int64_t n = 0;
        assert_int_equal(ckpt_checkpoint_files(dir, &files, &n), 0);
        int here = 0;
        for (int64_t j = 0; j < n; j++) {
            char *a = K(tu_pathf("%s/%s", dir, files[j].name));
            if (!tu_exists(a)) continue;
            here++;
            tu_assert_same_file(a, K(tu_pathf("%s/%s", proj, files[j].name)), files[j].name);
        }
        assert_true(here > 2 && here < n);
        tu_assert_same_file(K(tu_pathf("%s/checkpoint.json", dir)),
                            K(tu_pathf("%s/checkpoint.json", proj)), "manifest");
        free(files);
    }
}

static void test_tiers_every_kth_save_and_the_one_asked_for_go_to_the_project(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 3);
    s.persist_next = true;
    run(&s, false, 5, 0); /* numbers 0..4: 2 (the third), 4 (asked for) */
    assert_ok(&s);
    assert_false(tu_exists(proj_ckpt(0)));
    assert_false(tu_exists(proj_ckpt(1)));
    assert_true(tu_exists(proj_ckpt(2)));
    assert_false(tu_exists(proj_ckpt(3)));
    assert_true(tu_exists(proj_ckpt(4)));
    s.persist_next = false;
    run(&s, true, 1, 5); /* number 5: not persisted (5 - 4 < 3); a local folder */
    assert_ok(&s);
    assert_loaded_gen(&s, 4);
    assert_false(tu_exists(proj_ckpt(5)));
    for (int r = 0; r < P; r++) assert_true(tu_exists(rank_ckpt(r, 5)));
}

/* ---- what a load takes ----------------------------------------------------------- */

/* Saves generations 0..4 (numbers 0..4; persisted: 3) and records each
 * rank's generator draw after the last one. */
static void five_saves(scen *s, uint32_t draws[P]) {
    init_scen(s, 4);
    run(s, false, 5, 0);
    assert_ok(s);
    assert_true(tu_exists(proj_ckpt(3)));
    assert_false(tu_exists(proj_ckpt(4)));
    memcpy(draws, s->draw, sizeof s->draw);
}

static void lost_node(bool exchange) {
    scen s;
    uint32_t draws[P];
    tc_set_exchange(exchange);
    five_saves(&s, draws);
    char *n1 = node_dir(1);
    assert_int_equal(tu_tmpdir_remove(n1), 0); /* node 1 and its tier are gone */
    run(&s, true, 0, 0);
    assert_ok(&s);
    assert_loaded_gen(&s, 4); /* newer than the project's checkpoint_3 */
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.draw[r], draws[r]); /* each rank's own generator */
        assert_int_equal(s.iteration[r], 5);
        /* node 1's ranks keep the part they received */
        assert_string_equal(s.last[r], rank_ckpt(r, 4));
        assert_true(tu_exists(K(tu_pathf("%s/random_states_%d.safetensors", rank_ckpt(r, 4), r))));
    }
    assert_string_equal(s.warn, "");
    tc_set_exchange(false);
}

static void test_tiers_a_lost_node_is_recovered_from_the_replicas_on_the_other(void **st) {
    (void)st;
    lost_node(false);
}

static void test_tiers_a_lost_node_is_recovered_with_exchanges(void **st) {
    (void)st;
    lost_node(true);
}

static void test_tiers_both_nodes_lost_fall_back_to_the_project_saying_why(void **st) {
    (void)st;
    scen s;
    uint32_t draws[P];
    five_saves(&s, draws);
    assert_int_equal(tu_tmpdir_remove(node_dir(0)), 0);
    assert_int_equal(tu_tmpdir_remove(node_dir(1)), 0);
    run(&s, true, 0, 0);
    assert_ok(&s);
    assert_loaded_gen(&s, 3);
    tu_assert_contains(s.warn, "no node holds a local checkpoint");
    tu_assert_contains(s.warn, "checkpoint_3");
    assert_string_equal(s.last[0], proj_ckpt(3));
}

static void test_tiers_a_corrupt_copy_is_passed_over_for_the_other(void **st) {
    (void)st;
    scen s;
    uint32_t draws[P];
    five_saves(&s, draws);
    /* rank 2's own copy of its generator: its replica on rank 0 serves */
    tu_flip_byte(K(tu_pathf("%s/random_states_2.safetensors", rank_ckpt(2, 4))), 30);
    run(&s, true, 0, 0);
    assert_ok(&s);
    assert_loaded_gen(&s, 4);
    for (int r = 0; r < P; r++) assert_int_equal(s.draw[r], draws[r]);
    assert_string_equal(s.warn, "");
}

static void test_tiers_a_lost_node_and_a_corrupt_replica_fall_back_to_the_project(void **st) {
    (void)st;
    scen s;
    uint32_t draws[P];
    five_saves(&s, draws);
    assert_int_equal(tu_tmpdir_remove(node_dir(1)), 0);
    tu_flip_byte(K(tu_pathf("%s/random_states_2.safetensors", rank_ckpt(0, 4))), 30);
    run(&s, true, 0, 0);
    assert_ok(&s);
    assert_loaded_gen(&s, 3);
    /* one line: which save, which rank's part, and what is loaded instead */
    tu_assert_contains(s.warn, "checkpoint_4 lacks a verified copy of the part of rank 2");
    tu_assert_contains(s.warn, "checksum mismatch");
    tu_assert_contains(s.warn, "checkpoint_3");
    assert_int_equal((int)(strchr(s.warn, '\n') - s.warn) + 1, (int)strlen(s.warn));
}

static void test_tiers_a_node_back_with_a_stale_tier_takes_the_newer_save(void **st) {
    (void)st;
    scen s;
    uint32_t draws[P];
    five_saves(&s, draws);
    /* node 1 goes away with its tier (at checkpoint_4) */
    char *n1 = node_dir(1), *stale = K(tu_pathf("%s/l1.away", tu_dir()));
    assert_int_equal(rename(n1, stale), 0);
    run(&s, true, 2, 10); /* loads 4 from node 0; saves 5 and 6 (gens 10, 11) */
    assert_ok(&s);
    assert_loaded_gen(&s, 4);
    /* node 1 comes back with what it had, the new one's tier lost */
    assert_int_equal(tu_tmpdir_remove(n1), 0);
    assert_int_equal(rename(stale, n1), 0);
    assert_true(tu_exists(rank_ckpt(2, 4)));
    run(&s, true, 1, 20); /* loads 6; saves 7 */
    assert_ok(&s);
    assert_loaded_gen(&s, 11);
    for (int r = 0; r < P; r++) assert_int_equal(s.iteration[r], 7);
    /* the save after it: every rank keeps only checkpoint_7, the stale 4 gone */
    for (int r = 0; r < P; r++) {
        assert_true(tu_exists(rank_ckpt(r, 7)));
        assert_false(tu_exists(rank_ckpt(r, 4)));
        assert_false(tu_exists(rank_ckpt(r, 6)));
    }
}

static void test_tiers_parts_of_a_run_and_no_whole_checkpoint_is_no_fresh_start(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 100); /* nothing persisted */
    run(&s, false, 2, 0);
    assert_ok(&s);
    assert_false(tu_exists(proj_ckpt(1)));
    assert_int_equal(tu_tmpdir_remove(node_dir(1)), 0);
    tu_flip_byte(K(tu_pathf("%s/random_states_3.safetensors", rank_ckpt(1, 1))), 30);
    run(&s, true, 1, 5);
    for (int r = 0; r < P; r++) {
        assert_int_equal(s.rc[r], CKPT_ECORRUPT);
        assert_string_equal(s.msg[r], s.msg[0]);
        assert_int_equal(s.save_rc[r], CKPT_EINVAL); /* saves refuse after a failed load */
    }
    tu_assert_contains(s.msg[0], "no whole checkpoint");
    tu_assert_contains(s.msg[0], "part of rank 3");
}

static void test_tiers_asynchronous_saves_replicate_at_the_next_call(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 2);
    s.async = true;
    run(&s, false, 3, 0); /* 0, 1 (persisted), 2 */
    assert_ok(&s);
    assert_true(tu_exists(proj_ckpt(1)));
    assert_false(tu_exists(proj_ckpt(2)));
    for (int r = 0; r < P; r++) {
        assert_true(tu_exists(rank_ckpt(r, 2)));
        assert_true(tu_exists(
            K(tu_pathf("%s/random_states_%d.safetensors", rank_ckpt(r, 2), (r + 2) % P))));
    }
    s.async = false;
    assert_int_equal(tu_tmpdir_remove(node_dir(0)), 0);
    run(&s, true, 0, 0);
    assert_ok(&s);
    assert_loaded_gen(&s, 2);
}

/* With a background channel (ckpt_comm.exchange_background, what
 * ckpt_comm_mpi has under MPI_THREAD_MULTIPLE) the replication runs in the
 * background thread: each rank's replica arrives while the caller trains on,
 * before anything waits for the save; the commit checks each received file
 * against the manifest. A rank whose save fails still takes part (no rank
 * waits for it), and every rank reports the failure. */
static void test_tiers_asynchronous_saves_replicate_in_the_background(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 2);
    s.async = true;
    s.watch_bg = true;
    tc_set_exchange_background(true);
    run(&s, false, 3, 0); /* 0, 1 (persisted), 2 */
    assert_ok(&s);
    for (int r = 0; r < P; r++) {
        assert_true(s.seen[r]);
        char *mine = K(tu_pathf("%s/random_states_%d.safetensors", rank_ckpt(r, 2), (r + 2) % P));
        char *theirs =
            K(tu_pathf("%s/random_states_%d.safetensors", rank_ckpt((r + 2) % P, 2), (r + 2) % P));
        size_t n1 = 0, n2 = 0;
        char *a = tu_read_file(mine, &n1), *b = tu_read_file(theirs, &n2);
        assert_non_null(a);
        assert_non_null(b);
        assert_true(n1 == n2 && memcmp(a, b, n1) == 0);
        free(a);
        free(b);
    }
    assert_null(strstr(s.warn, "replicating again"));
    assert_true(tu_exists(proj_ckpt(1)));
    assert_false(tu_exists(proj_ckpt(2)));
    /* node 0 lost: save 2 whole from node 1's parts and replicas */
    s.async = false;
    s.watch_bg = false;
    assert_int_equal(tu_tmpdir_remove(node_dir(0)), 0);
    run(&s, true, 0, 0);
    assert_ok(&s);
    assert_loaded_gen(&s, 2);

    /* rank 1's state_dict fails at the second save of a job: all return it */
    s.async = true;
    s.fail_rank = 1;
    s.fail_save = 1;
    run(&s, false, 2, 5); /* 3 (persisted: 2 past 1), then 4 fails */
    for (int r = 0; r < P; r++) {
        assert_true(s.save_rc[r] < 0);
        assert_int_equal(s.save_rc[r], s.save_rc[0]);
        assert_true(tu_exists(rank_ckpt(r, 3)));
        assert_false(tu_exists(rank_ckpt(r, 4)));
    }
    tc_set_exchange_background(false);
}

/* ---- one process ------------------------------------------------------------------ */

static void test_tiers_one_process_saves_locally_and_resumes_from_the_newer(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 3);
    s.nsaves = 5;
    job(NULL, &s); /* 0..4: 2 persisted */
    assert_int_equal(s.save_rc[0], 0);
    char *local = K(tu_pathf("%s/l0/rank_0/checkpoint_4", tu_dir()));
    assert_string_equal(s.last[0], local);
    assert_true(tu_exists(proj_ckpt(2)));
    assert_false(tu_exists(proj_ckpt(4)));
    s.load = true;
    s.nsaves = 0;
    job(NULL, &s);
    assert_int_equal(s.rc[0], 0);
    assert_true(s.w0[0] == 4.0f);
    assert_string_equal(s.last[0], local);
    /* without the tier: the project's */
    assert_int_equal(tu_tmpdir_remove(K(tu_pathf("%s/l0", tu_dir()))), 0);
    job(NULL, &s);
    assert_int_equal(s.rc[0], 0);
    assert_true(s.w0[0] == 2.0f);
    tu_assert_contains(s.warn, "no node holds a local checkpoint");
}

static void test_tiers_a_save_after_a_preemption_signal_goes_to_the_project(void **st) {
    (void)st;
    scen s;
    init_scen(&s, 100);
    s.nsaves = 1;
    job(NULL, &s); /* checkpoint_0: local only */
    assert_int_equal(s.save_rc[0], 0);
    assert_false(tu_exists(proj_ckpt(0)));
    assert_int_equal(ckpt_preemption_install((const int[]){SIGUSR1}, 1), 0);
    raise(SIGUSR1);
    s.gen0 = 1;
    job(NULL, &s); /* checkpoint_1: persisted, a preemption signal was caught */
    ckpt_preemption_uninstall();
    assert_int_equal(s.save_rc[0], 0);
    assert_true(tu_exists(proj_ckpt(1)));
    assert_string_equal(s.last[0], proj_ckpt(1));
}

/* ---- the configuration ----------------------------------------------------------- */

static void expect_config_error(const ckpt_project_config *cfg, const char *needle) {
    ckpt_accelerator *acc = NULL;
    int rc = ckpt_accelerator_new(&acc, cfg);
    tu_expect_error(rc, CKPT_EINVAL, needle);
    assert_null(acc);
}

static void test_tiers_configuration_errors_name_the_field(void **st) {
    (void)st;
    ckpt_project_config c = {.project_dir = tu_dir(), .local_dir = "/tmp/x%q"};
    expect_config_error(&c, "local_dir '/tmp/x%q' has a '%' that is not %n, %r or %%");
    c.local_dir = "/tmp/x%";
    expect_config_error(&c, "a '%' at the end");
    c = (ckpt_project_config){.local_dir = "/tmp/x"};
    expect_config_error(&c, "local_dir needs a project_dir");
    c = (ckpt_project_config){.project_dir = tu_dir(), .local_dir = "/tmp/x", .persist_every = -1};
    expect_config_error(&c, "persist_every is -1");
    c = (ckpt_project_config){.project_dir = tu_dir(), .local_dir = "/tmp/x", .ranks_per_node = -2};
    expect_config_error(&c, "ranks_per_node is -2");
    c = (ckpt_project_config){
        .project_dir = tu_dir(), .local_dir = "/tmp/x", .local_total_limit = -1};
    expect_config_error(&c, "local_total_limit is -1");
    c = (ckpt_project_config){
        .project_dir = tu_dir(), .local_dir = "/tmp/x", .num_processes = 4, .ranks_per_node = 3};
    expect_config_error(&c, "ranks_per_node 3 does not divide the 4 processes");
}

typedef struct cfgjob {
    int rc[P];
    char msg[P][1024];
    const char *local, *proj;
} cfgjob;

static void shared_folder_job(const ckpt_comm *c, void *arg) {
    cfgjob *j = arg;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {.project_dir = j->proj,
                               .automatic_checkpoint_naming = true,
                               .comm = c,
                               .local_dir = j->local,
                               .ranks_per_node = 2};
    int rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_save_state(acc, NULL);
    j->rc[c->rank] = rc;
    snprintf(j->msg[c->rank], sizeof j->msg[0], "%s", rc < 0 ? ckpt_errmsg() : "");
    ckpt_accelerator_free(acc);
}

static void
test_tiers_simulated_nodes_need_a_folder_each_and_a_folder_serves_one_project(void **st) {
    (void)st;
    cfgjob j = {.local = K(tu_pathf("%s/shared", tu_dir())), .proj = K(tu_pathf("%s/a", tu_dir()))};
    tc_run(P, shared_folder_job, &j);
    for (int r = 0; r < P; r++) assert_int_equal(j.rc[r], CKPT_EINVAL);
    tu_assert_contains(j.msg[0], "has neither %n nor %r");
    j.local = K(tu_pathf("%s/t%%n", tu_dir()));
    tc_run(P, shared_folder_job, &j);
    for (int r = 0; r < P; r++) assert_int_equal(j.rc[r], 0);
    j.proj = K(tu_pathf("%s/b", tu_dir())); /* another project, the same local folders */
    tc_run(P, shared_folder_job, &j);
    for (int r = 0; r < P; r++) {
        assert_int_equal(j.rc[r], CKPT_EINVAL);
        assert_string_equal(j.msg[r], j.msg[0]);
    }
    tu_assert_contains(j.msg[0], "keeps the node-local checkpoints of the project");
}

static void test_tiers_a_tier_in_memory_says_so(void **st) {
    (void)st;
    if (!ckpt__in_memory_fs("/dev/shm")) {
        skip();
        return;
    }
    char root[128];
    snprintf(root, sizeof root, "/dev/shm/test_tiers_%d", (int)getpid());
    scen s;
    init_scen(&s, 1);
    snprintf(s.local, sizeof s.local, "%s/%%n", root);
    s.nsaves = 1;
    job(NULL, &s);
    assert_int_equal(s.save_rc[0], 0);
    ckpt_tier_info *v = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_tier_list(K(tu_pathf("%s/0", root)), true, &v, &n), 0);
    assert_int_equal(n, 1);
    assert_true(v[0].in_memory);
    assert_int_equal(v[0].status, CKPT_CHECKPOINT_COMPLETE);
    assert_int_equal(v[0].rank, 0);
    assert_int_equal(v[0].num_parts, 1);
    assert_int_equal(v[0].parts[0], 0);
    free(v);
    assert_int_equal(tu_tmpdir_remove(root), 0);
}

int main(void) {
    const struct CMUnitTest tests[] = {
#define T(f) cmocka_unit_test_setup_teardown(f, tu_tmpdir_setup, teardown)
        T(test_tiers_each_rank_keeps_its_part_and_its_replica_as_the_project_has_them),
        T(test_tiers_every_kth_save_and_the_one_asked_for_go_to_the_project),
        T(test_tiers_a_lost_node_is_recovered_from_the_replicas_on_the_other),
        T(test_tiers_a_lost_node_is_recovered_with_exchanges),
        T(test_tiers_both_nodes_lost_fall_back_to_the_project_saying_why),
        T(test_tiers_a_corrupt_copy_is_passed_over_for_the_other),
        T(test_tiers_a_lost_node_and_a_corrupt_replica_fall_back_to_the_project),
        T(test_tiers_a_node_back_with_a_stale_tier_takes_the_newer_save),
        T(test_tiers_parts_of_a_run_and_no_whole_checkpoint_is_no_fresh_start),
        T(test_tiers_asynchronous_saves_replicate_at_the_next_call),
        T(test_tiers_asynchronous_saves_replicate_in_the_background),
        T(test_tiers_one_process_saves_locally_and_resumes_from_the_newer),
        T(test_tiers_a_save_after_a_preemption_signal_goes_to_the_project),
        T(test_tiers_configuration_errors_name_the_field),
        T(test_tiers_simulated_nodes_need_a_folder_each_and_a_folder_serves_one_project),
        T(test_tiers_a_tier_in_memory_says_so),
#undef T
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
