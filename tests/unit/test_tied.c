/* test_tied.c — tied weights (ckpt_model_tie, and two parameters registered
 * on one buffer): one parameter, one optimizer state, saved once with an
 * alias record, loaded into the one buffer; a file tied where memory is not
 * (or the reverse) is a clear error; Hugging Face shards, several processes
 * and a file that leaves the tied name out. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

enum { V = 6, D = 4 }; /* vocabulary x width: wte [V, D] is lm_head */

/* A small model in GPT-2's shape: wte, a hidden layer, lm_head tied to wte. */
typedef struct net {
    float wte[V * D], gwte[V * D];
    float h[D * D], gh[D * D];
    float bias[V], gbias[V];
    ckpt_model *m;
    ckpt_optimizer *o;
} net;

static void net_fill(net *n, float base) {
    for (int i = 0; i < V * D; i++) n->wte[i] = base + 0.01f * (float)i;
    for (int i = 0; i < D * D; i++) n->h[i] = base - 0.02f * (float)i;
    for (int i = 0; i < V; i++) n->bias[i] = base * 0.5f + (float)i;
}

/* tie: 0 none (lm_head a parameter of its own, on its own buffer), 1 by
 * ckpt_model_tie, 2 registered on wte's buffer. */
static float own_head[V * D], own_ghead[V * D];
static void net_init(net *n, int tie, float base) {
    memset(n, 0, sizeof *n);
    net_fill(n, base);
    int64_t se[2] = {V, D}, sh[2] = {D, D}, sb[1] = {V};
    assert_int_equal(ckpt_model_new(&n->m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(n->m, "wte", CKPT_F32, 2, se, n->wte, n->gwte), 0);
    assert_int_equal(ckpt_model_add_param(n->m, "h", CKPT_F32, 2, sh, n->h, n->gh), 0);
    if (tie == 2)
        assert_int_equal(ckpt_model_add_param(n->m, "lm_head", CKPT_F32, 2, se, n->wte, NULL), 0);
    if (tie == 0) {
        memcpy(own_head, n->wte, sizeof own_head);
        assert_int_equal(
            ckpt_model_add_param(n->m, "lm_head", CKPT_F32, 2, se, own_head, own_ghead), 0);
    }
    assert_int_equal(ckpt_model_add_param(n->m, "bias", CKPT_F32, 1, sb, n->bias, n->gbias), 0);
    if (tie == 1) assert_int_equal(ckpt_model_tie(n->m, "lm_head", "wte"), CKPT_OK);
    assert_int_equal(ckpt_adamw_new(&n->o, n->m, 0.01, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
}

static void net_free(net *n) {
    ckpt_optimizer_free(n->o);
    ckpt_model_free(n->m);
}

static void net_step(net *n, int k) {
    for (int i = 0; i < V * D; i++) n->gwte[i] = 0.1f * (float)((i + k) % 5) - 0.2f;
    for (int i = 0; i < D * D; i++) n->gh[i] = 0.05f * (float)((i * k) % 3);
    for (int i = 0; i < V; i++) n->gbias[i] = 0.01f * (float)(i - k);
    assert_int_equal(ckpt_optimizer_step(n->o), CKPT_OK);
}

static ckpt_accelerator *acc_new(const char *dir, net *n, uint64_t max_shard) {
    ckpt_project_config cfg = {.project_dir = dir, .max_shard_size = max_shard};
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_prepare_model(acc, n->m), CKPT_OK);
    assert_int_equal(ckpt_prepare_optimizer(acc, n->o), CKPT_OK);
    return acc;
}

static void test_tie_makes_one_parameter(void **state) {
    (void)state;
    for (int tie = 1; tie <= 2; tie++) {
        net n;
        net_init(&n, tie, 1.0f);
        assert_int_equal(ckpt_model_num_params(n.m), 4);
        assert_int_equal(ckpt_model_num_elements(n.m), V * D + D * D + V); /* wte once */
        ckpt_param_info info;
        int64_t head = tie == 2 ? 2 : 3;
        assert_int_equal(ckpt_model_param(n.m, head, &info), CKPT_OK);
        assert_string_equal(info.name, "lm_head");
        assert_non_null(info.tied_to);
        assert_string_equal(info.tied_to, "wte");
        assert_ptr_equal(info.data, n.wte);
        assert_ptr_equal(info.grad, n.gwte);
        assert_int_equal(ckpt_model_param(n.m, 0, &info), CKPT_OK);
        assert_null(info.tied_to);
        /* the tie again, or through the alias: nothing changes */
        assert_int_equal(ckpt_model_tie(n.m, "lm_head", "wte"), CKPT_OK);
        assert_int_equal(ckpt_model_tie(n.m, "wte", "lm_head"), CKPT_EINVAL);
        assert_int_equal(ckpt_model_num_params(n.m), 4);
        /* one state for the pair: the optimizer's state dict has three */
        ckpt_writer *w = NULL;
        assert_int_equal(ckpt_writer_new_schema(&w), CKPT_OK);
        assert_int_equal(ckpt_optimizer_ops()->state_dict(n.o, w), CKPT_OK);
        ckpt_entry_info e;
        assert_int_equal(ckpt_writer_entry(w, 0, &e), CKPT_OK);
        bool has2 = false, has3 = false;
        for (int64_t i = 0; i < ckpt_writer_entry_count(w); i++) {
            assert_int_equal(ckpt_writer_entry(w, i, &e), CKPT_OK);
            has2 = has2 || strcmp(e.key, "state.2.exp_avg") == 0;
            has3 = has3 || strcmp(e.key, "state.3.exp_avg") == 0;
        }
        assert_true(has2);
        assert_false(has3);
        ckpt_writer_free(w);
        /* freezing the alias freezes the pair */
        assert_int_equal(ckpt_model_set_frozen(n.m, "lm_head", true), 1);
        assert_int_equal(ckpt_model_param(n.m, 0, &info), CKPT_OK);
        assert_true(info.frozen);
        assert_int_equal(ckpt_model_set_frozen(n.m, "lm_head", false), 1);
        net_free(&n);
    }
}

static void test_tie_refusals_name_the_parameters(void **state) {
    (void)state;
    float a[4], b[4], ga[4], gb[4];
    int64_t s[1] = {4}, s2[2] = {2, 2};
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "a", CKPT_F32, 1, s, a, ga), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "b", CKPT_F32, 1, s, b, gb), CKPT_OK);
    tu_expect_error(ckpt_model_tie(m, "c", "nope"), CKPT_ENOENT, "'nope'");
    tu_expect_error(ckpt_model_tie(m, "b", "a"), CKPT_EEXIST, "'b'");
    tu_expect_error(ckpt_model_tie(m, "bad\x01", "a"), CKPT_EINVAL, "control character");
    /* one buffer, two gradients: refused */
    tu_expect_error(ckpt_model_add_param(m, "a2", CKPT_F32, 1, s, a, gb), CKPT_EINVAL, "gradient");
    /* one buffer seen as another shape: not a tie, two parameters */
    assert_int_equal(ckpt_model_add_param(m, "a_view", CKPT_F32, 2, s2, a, NULL), CKPT_OK);
    ckpt_param_info info;
    assert_int_equal(ckpt_model_param(m, 2, &info), CKPT_OK);
    assert_null(info.tied_to);
    /* a tie to an alias ties to its target */
    assert_int_equal(ckpt_model_tie(m, "c", "a"), CKPT_OK);
    assert_int_equal(ckpt_model_tie(m, "d", "c"), CKPT_OK);
    assert_int_equal(ckpt_model_param(m, 4, &info), CKPT_OK);
    assert_string_equal(info.tied_to, "a");
    tu_expect_error(ckpt_model_tie(m, "c", "b"), CKPT_EEXIST, "tied to 'a'");
    ckpt_model_free(m);
}

/* The model file holds wte once, the alias record (ckpt document version 2,
 * Hugging Face's __metadata__ record), and a load fills the one buffer. */
static void test_save_once_load_into_one_buffer(void **state) {
    (void)state;
    const char *dir = tu_dir();
    net a;
    net_init(&a, 1, 1.0f);
    ckpt_accelerator *acc = acc_new(dir, &a, 0);
    net_step(&a, 1);
    net_step(&a, 2);
    char ck[4096];
    snprintf(ck, sizeof ck, "%s/ck", dir);
    assert_int_equal(ckpt_save_state(acc, ck), CKPT_OK);
    ckpt_accelerator_free(acc);

    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", ck);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    assert_int_equal(ckpt_reader_count(r), 4); /* wte, h, bias, the alias */
    ckpt_entry_info e;
    assert_int_equal(ckpt_reader_find(r, "lm_head", &e), CKPT_OK);
    assert_int_equal(e.kind, CKPT_ENTRY_ALIAS);
    assert_string_equal(e.target, "wte");
    assert_int_equal(e.dtype, CKPT_F32);
    assert_int_equal(e.shape[0], V);
    float got[V * D];
    int64_t se[2] = {V, D};
    assert_int_equal(ckpt_read_tensor(r, "lm_head", CKPT_F32, 2, se, got), CKPT_OK);
    assert_memory_equal(got, a.wte, sizeof got);
    ckpt_reader_free(r);
    size_t len = 0;
    char *bytes = tu_read_file(path, &len);
    tu_assert_contains(bytes + 8, "\"lm_head\":\"wte\"");        /* Hugging Face's record */
    tu_assert_contains(bytes + 8, "\\\"type\\\":\\\"alias\\\""); /* ckpt's */
    tu_assert_contains(bytes + 8, "{\\\"version\\\":2");
    free(bytes);

    /* a fresh run, tied either way, resumes exactly: both continue alike */
    float after[2][V * D];
    for (int tie = 1; tie <= 2; tie++) {
        net b;
        net_init(&b, tie, -3.0f);
        ckpt_accelerator *acc2 = acc_new(dir, &b, 0);
        assert_int_equal(ckpt_load_state(acc2, ck), CKPT_OK);
        assert_memory_equal(b.wte, a.wte, sizeof a.wte);
        assert_memory_equal(b.h, a.h, sizeof a.h);
        net_step(&b, 3);
        net_step(&b, 4);
        memcpy(after[tie - 1], b.wte, sizeof after[0]);
        ckpt_accelerator_free(acc2);
        net_free(&b);
    }
    net_step(&a, 3);
    net_step(&a, 4);
    assert_memory_equal(after[0], a.wte, sizeof a.wte);
    assert_memory_equal(after[1], a.wte, sizeof a.wte);
    net_free(&a);
}

/* An asynchronous save (staged), then a one-pass load: the same bytes. */
static void test_async_save_and_one_pass_load(void **state) {
    (void)state;
    const char *dir = tu_dir();
    char ck[4096];
    snprintf(ck, sizeof ck, "%s/async", dir);
    net a, b;
    net_init(&a, 2, 1.0f);
    net_init(&b, 1, 4.0f);
    ckpt_accelerator *acc = acc_new(dir, &a, 0);
    net_step(&a, 1);
    assert_int_equal(ckpt_save_state_async(acc, ck), CKPT_OK);
    float saved[V * D];
    memcpy(saved, a.wte, sizeof saved);
    net_step(&a, 2); /* the save holds the state at the call */
    assert_int_equal(ckpt_save_wait(acc), CKPT_OK);
    ckpt_accelerator_free(acc);
    acc = acc_new(dir, &b, 0);
    ckpt_load_options o = {.one_pass = true};
    assert_int_equal(ckpt_load_state_ex(acc, ck, &o, NULL), CKPT_OK);
    assert_memory_equal(b.wte, saved, sizeof saved);
    ckpt_accelerator_free(acc);
    net_free(&a);
    net_free(&b);
}

/* Tied in the file and not in memory, or the reverse: CKPT_EMISMATCH naming
 * both names, nothing changed. */
static void test_tied_mismatch_is_a_clear_error(void **state) {
    (void)state;
    const char *dir = tu_dir();
    char tied[4096], untied[4096];
    snprintf(tied, sizeof tied, "%s/tied", dir);
    snprintf(untied, sizeof untied, "%s/untied", dir);
    net a, b;
    net_init(&a, 1, 1.0f);
    net_init(&b, 0, 2.0f);
    ckpt_accelerator *acc = acc_new(dir, &a, 0);
    assert_int_equal(ckpt_save_state(acc, tied), CKPT_OK);
    ckpt_accelerator_free(acc);
    acc = acc_new(dir, &b, 0);
    assert_int_equal(ckpt_save_state(acc, untied), CKPT_OK);
    float before[V * D];
    memcpy(before, b.wte, sizeof before);
    int rc = ckpt_load_state(acc, tied);
    assert_int_equal(rc, CKPT_EMISMATCH);
    tu_assert_errmsg_has("lm_head");
    tu_assert_errmsg_has("wte");
    tu_assert_errmsg_has("tied");
    assert_memory_equal(b.wte, before, sizeof before);
    ckpt_accelerator_free(acc);

    acc = acc_new(dir, &a, 0);
    memcpy(before, a.wte, sizeof before);
    assert_int_equal(ckpt_load_state(acc, untied), CKPT_EMISMATCH);
    tu_assert_errmsg_has("lm_head");
    tu_assert_errmsg_has("tied");
    assert_memory_equal(a.wte, before, sizeof before);
    ckpt_accelerator_free(acc);

    /* the weights alone, from a file that leaves the tied name out (as
     * Hugging Face's model.safetensors does): the target fills the buffer */
    ckpt_writer *w = NULL;
    net src;
    memset(&src, 0, sizeof src);
    net_fill(&src, 7.0f);
    int64_t se[2] = {V, D}, sh[2] = {D, D}, sb[1] = {V};
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "wte", CKPT_F32, 2, se, src.wte), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "h", CKPT_F32, 2, sh, src.h), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "bias", CKPT_F32, 1, sb, src.bias), CKPT_OK);
    char hf[4200];
    snprintf(hf, sizeof hf, "%s/hf.safetensors", dir);
    assert_int_equal(ckpt_writer_save(w, hf), CKPT_OK);
    ckpt_writer_free(w);
    assert_int_equal(ckpt_model_load_weights(a.m, hf, NULL, NULL), CKPT_OK);
    assert_memory_equal(a.wte, src.wte, sizeof a.wte);
    /* into an untied model it is a missing key, as in PyTorch */
    assert_int_equal(ckpt_model_load_weights(b.m, hf, NULL, NULL), CKPT_EMISMATCH);
    tu_assert_errmsg_has("lm_head");
    net_free(&a);
    net_free(&b);
}

/* Saved as Hugging Face shards: the index names the tensors, the alias is
 * in its target's part; the load fills the one buffer. */
static void test_hf_shards_keep_the_alias(void **state) {
    (void)state;
    const char *dir = tu_dir();
    net a, b;
    net_init(&a, 2, 1.0f);
    net_init(&b, 1, 5.0f);
    ckpt_accelerator *acc = acc_new(dir, &a, 40); /* every tensor in a part of its own */
    net_step(&a, 1);
    char ck[4096];
    snprintf(ck, sizeof ck, "%s/hf", dir);
    assert_int_equal(ckpt_save_state(acc, ck), CKPT_OK);
    ckpt_accelerator_free(acc);
    char idx[4200];
    snprintf(idx, sizeof idx, "%s/model.safetensors.index.json", ck);
    size_t tlen = 0;
    char *text = tu_read_file(idx, &tlen);
    assert_null(strstr(text, "lm_head"));
    free(text);
    acc = acc_new(dir, &b, 40);
    assert_int_equal(ckpt_load_state(acc, ck), CKPT_OK);
    assert_memory_equal(b.wte, a.wte, sizeof a.wte);
    ckpt_accelerator_free(acc);
    net_free(&a);
    net_free(&b);
}

/* Two processes (thread ranks): the tied tensor is spread like any other,
 * the alias in rank 0's file; each rank loads it into its one buffer. */
typedef struct mp_arg {
    char dir[4096];
    bool load;
    int rc[2];
    bool same[2];
    float ref[V * D];
} mp_arg;

static void mp_run(const ckpt_comm *comm, void *p) {
    mp_arg *x = p;
    net n;
    memset(&n, 0, sizeof n);
    net_fill(&n, x->load ? 9.0f : 1.0f);
    int64_t se[2] = {V, D}, sh[2] = {D, D}, sb[1] = {V};
    ckpt_model_new(&n.m);
    ckpt_model_add_param(n.m, "wte", CKPT_F32, 2, se, n.wte, n.gwte);
    ckpt_model_add_param(n.m, "h", CKPT_F32, 2, sh, n.h, n.gh);
    ckpt_model_add_param(n.m, "bias", CKPT_F32, 1, sb, n.bias, n.gbias);
    ckpt_model_tie(n.m, "lm_head", "wte");
    ckpt_project_config cfg = {.comm = comm};
    ckpt_accelerator *acc = NULL;
    int rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, n.m);
    if (rc == 0) rc = x->load ? ckpt_load_state(acc, x->dir) : ckpt_save_state(acc, x->dir);
    x->rc[comm->rank] = rc;
    x->same[comm->rank] = memcmp(n.wte, x->ref, sizeof n.wte) == 0;
    ckpt_accelerator_free(acc);
    ckpt_model_free(n.m);
}

static void test_two_processes(void **state) {
    (void)state;
    mp_arg x;
    memset(&x, 0, sizeof x);
    snprintf(x.dir, sizeof x.dir, "%s/mp", tu_dir());
    net ref;
    memset(&ref, 0, sizeof ref);
    net_fill(&ref, 1.0f);
    memcpy(x.ref, ref.wte, sizeof x.ref);
    tc_run(2, mp_run, &x);
    assert_int_equal(x.rc[0], CKPT_OK);
    assert_int_equal(x.rc[1], CKPT_OK);
    x.load = true;
    tc_run(2, mp_run, &x);
    assert_int_equal(x.rc[0], CKPT_OK);
    assert_int_equal(x.rc[1], CKPT_OK);
    assert_true(x.same[0]);
    assert_true(x.same[1]);
}

/* A model file of 4 MiB or more (saved by one process) is streamed tensor by
 * tensor to several processes (its header's tensors, not its alias record):
 * the tie still loads, the target filling the one buffer. */
enum { BIG = (5 << 20) / 4 };
typedef struct big_arg {
    char dir[4096];
    bool load;
    int rc[2];
    bool same[2];
} big_arg;

static void big_run(const ckpt_comm *comm, void *p) {
    big_arg *x = p;
    float *w = calloc(BIG, sizeof *w);
    for (int64_t i = 0; w && i < BIG; i++) w[i] = x->load ? -1.0f : (float)(i % 1000) * 0.5f;
    int64_t s[1] = {BIG};
    ckpt_model *m = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {.comm = comm};
    int rc = w ? ckpt_model_new(&m) : CKPT_ENOMEM;
    if (rc == 0) rc = ckpt_model_add_param(m, "wte", CKPT_F32, 1, s, w, NULL);
    if (rc == 0) rc = ckpt_model_add_param(m, "lm_head", CKPT_F32, 1, s, w, NULL);
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, m);
    if (rc == 0) rc = x->load ? ckpt_load_state(acc, x->dir) : ckpt_save_state(acc, x->dir);
    bool same = w != NULL;
    for (int64_t i = 0; same && i < BIG; i++) same = w[i] == (float)(i % 1000) * 0.5f;
    x->rc[comm->rank] = rc;
    x->same[comm->rank] = same;
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
    free(w);
}

static void test_streamed_load_of_a_large_tied_model(void **state) {
    (void)state;
    big_arg x;
    memset(&x, 0, sizeof x);
    snprintf(x.dir, sizeof x.dir, "%s/big", tu_dir());
    tc_run(1, big_run, &x); /* one process: the tensor whole in model.safetensors */
    assert_int_equal(x.rc[0], CKPT_OK);
    x.load = true;
    tc_run(2, big_run, &x);
    for (int r = 0; r < 2; r++) {
        if (x.rc[r] != CKPT_OK) fail_msg("rank %d: %d", r, x.rc[r]);
        assert_true(x.same[r]);
    }
}

/* The reader side of aliases: a writer refuses what cannot be an alias, a
 * file whose alias names nothing is refused when read. */
static void test_alias_rules(void **state) {
    (void)state;
    float t[2] = {1, 2};
    int64_t s[1] = {2};
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "n", 3), CKPT_OK);
    tu_expect_error(ckpt_write_alias(w, "a", "t"), CKPT_ENOENT, "'t'");
    tu_expect_error(ckpt_write_alias(w, "a", "n"), CKPT_ENOENT, "i64");
    assert_int_equal(ckpt_write_tensor(w, "t", CKPT_F32, 1, s, t), CKPT_OK);
    assert_int_equal(ckpt_write_alias(w, "a", "t"), CKPT_OK);
    tu_expect_error(ckpt_write_alias(w, "a", "t"), CKPT_EEXIST, "'a'");
    tu_expect_error(ckpt_write_alias(w, "b", "a"), CKPT_ENOENT, "alias");
    char path[4200];
    snprintf(path, sizeof path, "%s/a.safetensors", tu_dir());
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
    /* the alias pointed elsewhere (same length, so the header still parses) */
    size_t n = 0;
    char *b = tu_read_file(path, &n);
    char *v = strstr(b + 8, "\\\"value\\\":\\\"t\\\"");
    assert_non_null(v);
    v[strlen("\\\"value\\\":\\\"")] = 'x';
    tu_write_file(path, b, n);
    free(b);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    float got[2];
    tu_expect_error(ckpt_read_tensor(r, "a", CKPT_F32, 1, s, got), CKPT_ECORRUPT, "alias of 'x'");
    ckpt_reader_free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_tie_makes_one_parameter),
        cmocka_unit_test(test_tie_refusals_name_the_parameters),
        cmocka_unit_test_setup_teardown(test_save_once_load_into_one_buffer, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_async_save_and_one_pass_load, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_tied_mismatch_is_a_clear_error, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_hf_shards_keep_the_alias, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_two_processes, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_streamed_load_of_a_large_tied_model, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_alias_rules, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
