/* test_named.c — named custom objects (ckpt_register_for_checkpointing_named):
 * the name rules, <name>.safetensors found by name whatever the
 * registration order, the unnamed ones' numbering untouched, selection by
 * name, incremental links, and several processes (sharded and spread
 * tensors, resharded to another process count). */
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

/* A custom object: a counter, a seed (u64) and a vector. */
enum { N = 300000 }; /* 1.2 MB: spread over the ranks like any large tensor */
typedef struct obj {
    int64_t count;
    uint64_t seed;
    float *v;
    int64_t n;
    /* several processes: the vector is sharded, each rank its rows */
    bool sharded;
    int rank, size;
} obj;

static int obj_sd(void *self, ckpt_writer *w) {
    obj *o = self;
    CKPT_TRY(ckpt_write_i64(w, "count", o->count));
    CKPT_TRY(ckpt_write_u64(w, "seed", o->seed));
    int64_t shape[1] = {o->n};
    if (!o->sharded) return ckpt_write_tensor(w, "v", CKPT_F32, 1, shape, o->v);
    int64_t lo = o->n * o->rank / o->size, hi = o->n * (o->rank + 1) / o->size;
    int64_t off[1] = {lo}, loc[1] = {hi - lo};
    return ckpt_write_tensor_shard(w, "v", CKPT_F32, 1, shape, off, loc, o->v + lo);
}

static int obj_lsd(void *self, ckpt_reader *r) {
    obj *o = self;
    int64_t c;
    uint64_t s;
    CKPT_TRY(ckpt_read_i64(r, "count", &c));
    CKPT_TRY(ckpt_read_u64(r, "seed", &s));
    int64_t shape[1] = {o->n};
    if (!o->sharded) CKPT_TRY(ckpt_read_tensor(r, "v", CKPT_F32, 1, shape, o->v));
    else {
        int64_t lo = o->n * o->rank / o->size, hi = o->n * (o->rank + 1) / o->size;
        int64_t off[1] = {lo}, loc[1] = {hi - lo};
        CKPT_TRY(ckpt_read_tensor_shard(r, "v", CKPT_F32, 1, shape, off, loc, o->v + lo));
    }
    o->count = c;
    o->seed = s;
    return CKPT_OK;
}

static const ckpt_stateful_ops obj_ops = {.state_dict = obj_sd, .load_state_dict = obj_lsd};

static void obj_init(obj *o, int64_t n, float base) {
    memset(o, 0, sizeof *o);
    o->n = n;
    o->v = calloc((size_t)n, sizeof *o->v);
    assert_non_null(o->v);
    for (int64_t i = 0; i < n; i++) o->v[i] = base + (float)(i % 97);
    o->count = (int64_t)base;
    o->seed = UINT64_MAX - (uint64_t)base;
    o->size = 1;
}

static bool has_file(const char *dir, const char *name) {
    char *p = tu_pathf("%s/%s", dir, name);
    bool e = tu_exists(p);
    free(p);
    return e;
}

static void test_name_rules(void **state) {
    (void)state;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    int a, b, c;
    static const struct {
        const char *name;
        int code;
        const char *msg;
    } bad[] = {
        {"", CKPT_EINVAL, "1 to 64"},
        {"a/b", CKPT_EINVAL, "[A-Za-z0-9_.-]"},
        {"a b", CKPT_EINVAL, "byte 1"},
        {"caf\xc3\xa9", CKPT_EINVAL, "[A-Za-z0-9_.-]"},
        {".hidden", CKPT_EINVAL, "starts with '.'"},
        {"..", CKPT_EINVAL, "starts with '.'"},
        {"model", CKPT_EINVAL, "library's own files"},
        {"Model", CKPT_EINVAL, "library's own files"},
        {"model_3", CKPT_EINVAL, "library's own files"},
        {"optimizer", CKPT_EINVAL, "library's own"},
        {"scheduler_1", CKPT_EINVAL, "library's own"},
        {"dataloader", CKPT_EINVAL, "library's own"},
        {"scaler", CKPT_EINVAL, "library's own"},
        {"custom_checkpoint_0", CKPT_EINVAL, "library's own"},
        {"random_states_2", CKPT_EINVAL, "library's own"},
        {"rng-00001-of-00002", CKPT_EINVAL, "shard file"},
        {"model_ema.frozen", CKPT_EINVAL, "frozen file's (.frozen)"},
        {"x.FROZEN", CKPT_EINVAL, "frozen file's (.frozen)"},
        {"a.safetensors.b", CKPT_EINVAL, "contains '.safetensors'"},
        {"a.SafeTensors", CKPT_EINVAL, "contains '.safetensors'"},
        {"0123456789012345678901234567890123456789012345678901234567890123456789", CKPT_EINVAL,
         "1 to 64"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        int rc = ckpt_register_for_checkpointing_named(acc, bad[i].name, &obj_ops, &a);
        if (rc != bad[i].code) fail_msg("'%s': got %d (%s)", bad[i].name, rc, ckpt_errmsg());
        tu_assert_errmsg_has(bad[i].msg);
    }
    /* names that only look like the library's are fine */
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "model_ema", &obj_ops, &a), 0);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "rng.state-1", &obj_ops, &b), 0);
    tu_expect_error(ckpt_register_for_checkpointing_named(acc, "RNG.state-1", &obj_ops, &c),
                    CKPT_EEXIST, "letter case");
    tu_expect_error(ckpt_register_for_checkpointing_named(acc, "other", &obj_ops, &a), CKPT_EEXIST,
                    "'model_ema'");
    tu_expect_error(ckpt_register_for_checkpointing(acc, &obj_ops, &b), CKPT_EEXIST, "rng.state-1");
    tu_expect_error(ckpt_register_for_checkpointing_named(acc, "x", NULL, &c), CKPT_EINVAL,
                    "custom object 'x': ops is NULL");
    tu_expect_error(ckpt_register_for_checkpointing_named(acc, NULL, &obj_ops, &c), CKPT_EINVAL,
                    "name is NULL");
    tu_expect_error(ckpt_register_for_checkpointing_named(NULL, "x", &obj_ops, &c), CKPT_EINVAL,
                    "acc is NULL");
    ckpt_accelerator_free(acc);
}

/* Registered as A(named "loader"), U0, B(named "rng"), U1 and loaded as
 * U0', B', U1', A': each object gets its own state back. */
static void test_found_by_name_in_any_order(void **state) {
    (void)state;
    char ck[4200];
    snprintf(ck, sizeof ck, "%s/ck", tu_dir());
    obj a, b, u0, u1;
    obj_init(&a, 10, 1);
    obj_init(&b, 20, 2);
    obj_init(&u0, 30, 3);
    obj_init(&u1, 40, 4);
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {.project_dir = tu_dir()};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "loader", &obj_ops, &a), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &obj_ops, &u0), 0);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "rng", &obj_ops, &b), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &obj_ops, &u1), 0);
    assert_int_equal(ckpt_save_state(acc, ck), CKPT_OK);
    ckpt_accelerator_free(acc);
    static const char *const files[] = {"loader.safetensors", "rng.safetensors",
                                        "custom_checkpoint_0.safetensors",
                                        "custom_checkpoint_1.safetensors"};
    for (size_t i = 0; i < 4; i++) assert_true(has_file(ck, files[i]));
    assert_false(has_file(ck, "custom_checkpoint_2.safetensors"));
    /* the manifest lists them as custom objects */
    ckpt_checkpoint_file *list = NULL;
    int64_t nf = 0;
    assert_int_equal(ckpt_checkpoint_files(ck, &list, &nf), CKPT_OK);
    int customs = 0;
    for (int64_t i = 0; i < nf; i++) customs += strcmp(list[i].kind, "custom") == 0;
    assert_int_equal(customs, 4);
    free(list);

    obj a2, b2, u02, u12;
    obj_init(&a2, 10, 11);
    obj_init(&b2, 20, 12);
    obj_init(&u02, 30, 13);
    obj_init(&u12, 40, 14);
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &obj_ops, &u02), 0);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "rng", &obj_ops, &b2), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &obj_ops, &u12), 0);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "loader", &obj_ops, &a2), 0);
    assert_int_equal(ckpt_load_state(acc, ck), CKPT_OK);
    const obj *want[] = {&a, &b, &u0, &u1}, *got[] = {&a2, &b2, &u02, &u12};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(got[i]->count, want[i]->count);
        assert_true(got[i]->seed == want[i]->seed);
        assert_memory_equal(got[i]->v, want[i]->v, (size_t)want[i]->n * sizeof(float));
    }
    ckpt_accelerator_free(acc);

    /* a name the checkpoint lacks: the error names the file */
    obj c;
    obj_init(&c, 10, 5);
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "loaderx", &obj_ops, &c), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &obj_ops, &u02), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &obj_ops, &u12), 0);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "rng", &obj_ops, &b2), 0);
    tu_expect_error(ckpt_load_state(acc, ck), CKPT_EMISMATCH, "loaderx.safetensors");
    assert_int_equal(ckpt_accelerator_start_over(acc), CKPT_OK);

    /* selected by name: only that object changes; the report names it */
    b2.count = -7;
    u02.count = -8;
    const char *names[] = {"rng"};
    ckpt_load_options o = {.names = names, .num_names = 1};
    ckpt_load_report rep;
    assert_int_equal(ckpt_load_state_ex(acc, ck, &o, &rep), CKPT_OK);
    assert_int_equal(b2.count, b.count);
    assert_int_equal(u02.count, -8);
    assert_int_equal(rep.num_loaded, 1);
    assert_string_equal(rep.loaded[0], "rng");
    ckpt_load_report_free(&rep);
    const char *unknown[] = {"nope"};
    o.names = unknown;
    tu_expect_error(ckpt_load_state_ex(acc, ck, &o, NULL), CKPT_EINVAL, "nope");
    ckpt_accelerator_free(acc);
    obj *all[] = {&a, &b, &u0, &u1, &a2, &b2, &u02, &u12, &c};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]->v);
}

/* An unchanged named object's file is linked by the next save. */
static void test_unchanged_named_file_is_linked(void **state) {
    (void)state;
    obj a;
    obj_init(&a, N, 1);
    ckpt_accelerator *acc = NULL;
    /* link_copies 1: the second save links (the default writes a second copy) */
    ckpt_project_config cfg = {
        .project_dir = tu_dir(), .automatic_checkpoint_naming = true, .link_copies = 1};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_register_for_checkpointing_named(acc, "table", &obj_ops, &a), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    uint64_t written = 0, linked = 0;
    ckpt_accelerator_last_save_bytes(acc, &written, &linked);
    assert_true(linked >= (uint64_t)N * sizeof(float));
    ckpt_accelerator_free(acc);
    free(a.v);
}

/* Several processes: a named object with a sharded vector and one with a
 * replicated large one (spread over the ranks), saved by 2 and loaded by 3. */
typedef struct mp {
    char dir[4096];
    int mode; /* 0 save, 1 load */
    int rc[4];
    bool ok[4];
} mp;

static void mp_run(const ckpt_comm *comm, void *p) {
    mp *x = p;
    obj s, r;
    memset(&s, 0, sizeof s);
    memset(&r, 0, sizeof r);
    float base = x->mode == 0 ? 1.0f : 50.0f;
    s.n = r.n = N;
    s.v = calloc(N, sizeof(float));
    r.v = calloc(N, sizeof(float));
    for (int64_t i = 0; i < N; i++) s.v[i] = r.v[i] = base + (float)(i % 101);
    s.sharded = true;
    s.rank = comm->rank;
    s.size = comm->size;
    s.seed = r.seed = x->mode == 0 ? UINT64_MAX : 0;
    ckpt_project_config cfg = {.comm = comm};
    ckpt_accelerator *acc = NULL;
    int rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_register_for_checkpointing_named(acc, "sharded", &obj_ops, &s);
    if (rc == 0) rc = ckpt_register_for_checkpointing_named(acc, "replicated", &obj_ops, &r);
    if (rc == 0) rc = x->mode == 0 ? ckpt_save_state(acc, x->dir) : ckpt_load_state(acc, x->dir);
    x->rc[comm->rank] = rc;
    bool ok = s.seed == UINT64_MAX && r.seed == UINT64_MAX;
    int64_t lo = N * (int64_t)comm->rank / comm->size,
            hi = N * (int64_t)(comm->rank + 1) / comm->size;
    for (int64_t i = lo; ok && i < hi; i++) ok = s.v[i] == 1.0f + (float)(i % 101);
    for (int64_t i = 0; ok && i < N; i++) ok = r.v[i] == 1.0f + (float)(i % 101);
    x->ok[comm->rank] = ok;
    ckpt_accelerator_free(acc);
    free(s.v);
    free(r.v);
}

static void test_several_processes(void **state) {
    (void)state;
    mp x;
    memset(&x, 0, sizeof x);
    snprintf(x.dir, sizeof x.dir, "%s/mp", tu_dir());
    tc_run(2, mp_run, &x);
    assert_int_equal(x.rc[0], CKPT_OK);
    assert_int_equal(x.rc[1], CKPT_OK);
    assert_true(has_file(x.dir, "sharded-00001-of-00002.safetensors"));
    assert_true(has_file(x.dir, "replicated.safetensors"));
    assert_true(has_file(x.dir, "replicated-00002-of-00002.safetensors"));
    x.mode = 1;
    tc_run(3, mp_run, &x);
    for (int r = 0; r < 3; r++) {
        if (x.rc[r] != CKPT_OK) fail_msg("rank %d: %d", r, x.rc[r]);
        assert_true(x.ok[r]);
    }
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_name_rules),
        cmocka_unit_test_setup_teardown(test_found_by_name_in_any_order, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_unchanged_named_file_is_linked, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_several_processes, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
