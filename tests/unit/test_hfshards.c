/* test_hfshards.c — max_shard_size: a model beyond it is saved as Hugging
 * Face shards plus an index inside the same atomic commit (no
 * model.safetensors), the shards split as transformers splits, every file
 * in the manifest; ckpt_load_state, ckpt_load_state_ex and
 * ckpt_checkpoint_open_object read the layout back bit for bit; a damaged
 * shard or index is a clear error; below the limit nothing changes. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "helpers/testutil.h"

#define NP 5

typedef struct net {
    ckpt_accelerator *acc;
    ckpt_model *m;
    float *p[NP];
} net;

static const int64_t sizes[NP] = {100, 300, 50, 400, 20}; /* floats: 400, 1200, 200, 1600, 80 B */
static const char *const names[NP] = {"embed.weight", "layers.0.weight", "layers.0.bias",
                                      "layers.1.weight", "head.bias"};

static void net_open(net *n, const char *proj, uint64_t max_shard, float base) {
    memset(n, 0, sizeof *n);
    ckpt_project_config cfg = {.project_dir = proj, .automatic_checkpoint_naming = true,
                               .max_shard_size = max_shard};
    assert_int_equal(ckpt_accelerator_new(&n->acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_model_new(&n->m), CKPT_OK);
    for (int i = 0; i < NP; i++) {
        n->p[i] = calloc((size_t)sizes[i], sizeof(float));
        for (int64_t j = 0; j < sizes[i]; j++) n->p[i][j] = base + (float)i + 0.001f * (float)j;
        assert_int_equal(ckpt_model_add_param(n->m, names[i], CKPT_F32, 1, &sizes[i], n->p[i], NULL),
                         CKPT_OK);
    }
    assert_int_equal(ckpt_prepare_model(n->acc, n->m), CKPT_OK);
}

static void net_close(net *n) {
    ckpt_accelerator_free(n->acc);
    ckpt_model_free(n->m);
    for (int i = 0; i < NP; i++) free(n->p[i]);
}

static void test_save_as_shards_and_load(void **state) {
    (void)state;
    char *proj = tu_pathf("%s/p", tu_dir());
    net a;
    net_open(&a, proj, 1500, 1.0f);
    ckpt_accelerator_set_step(a.acc, 9);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    const char *ck = ckpt_accelerator_last_dir(a.acc);
    char *d = strdup(ck);
    /* greedy in order: [400], [1200] (400+1200 > 1500), [200], [1600], [80]? no:
     * 1200+200 = 1400 <= 1500 -> [1200, 200]; 1600 alone; 80 -> [80] after 1600 */
    const char *want[] = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                          "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                          "model.safetensors.index.json"};
    for (size_t i = 0; i < 5; i++) {
        char *p = tu_pathf("%s/%s", d, want[i]);
        if (!tu_exists(p)) fail_msg("missing %s", want[i]);
        free(p);
    }
    char *single = tu_pathf("%s/model.safetensors", d);
    assert_false(tu_exists(single));
    free(single);
    /* the index: total_size and where each tensor is */
    char *ip = tu_pathf("%s/model.safetensors.index.json", d);
    size_t n;
    char *text = tu_read_file(ip, &n);
    tu_assert_contains(text, "\"total_size\": 3480");
    tu_assert_contains(text, "\"layers.0.bias\": \"model-00002-of-00004.safetensors\"");
    tu_assert_contains(text, "\"layers.1.weight\": \"model-00003-of-00004.safetensors\"");
    tu_assert_contains(text, "\"head.bias\": \"model-00004-of-00004.safetensors\"");
    free(text);
    /* every file is in the manifest and verifies deeply */
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(d, true, &info), CKPT_OK);
    /* loads back bit for bit, into a fresh run */
    net b;
    char *proj2 = tu_pathf("%s/q", tu_dir());
    net_open(&b, proj2, 0, 7.0f);
    assert_int_equal(ckpt_load_state(b.acc, d), CKPT_OK);
    for (int i = 0; i < NP; i++) assert_memory_equal(a.p[i], b.p[i], (size_t)sizes[i] * 4);
    assert_int_equal(ckpt_accelerator_step(b.acc), 9);
    /* and with options: the models only, non-strictly */
    for (int i = 0; i < NP; i++) b.p[i][0] = -1.0f;
    ckpt_load_options o = {.objects = CKPT_LOAD_MODELS, .non_strict = true};
    assert_int_equal(ckpt_load_state_ex(b.acc, d, &o, NULL), CKPT_OK);
    for (int i = 0; i < NP; i++) assert_memory_equal(a.p[i], b.p[i], (size_t)sizes[i] * 4);
    /* the object as tools open it */
    ckpt_reader *r;
    assert_int_equal(ckpt_checkpoint_open_object(d, "model.safetensors", &r), CKPT_OK);
    assert_int_equal(ckpt_reader_count(r), NP);
    float buf[400];
    assert_int_equal(ckpt_read_tensor(r, "layers.1.weight", CKPT_F32, 1, &sizes[3], buf), CKPT_OK);
    assert_memory_equal(buf, a.p[3], sizeof buf);
    ckpt_reader_free(r);
    /* the next automatic save rotates shards away with their folder */
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    net_close(&b);
    net_close(&a);
    free(ip);
    free(proj2);
    free(d);
    free(proj);
}

static void test_below_the_limit_is_one_file(void **state) {
    (void)state;
    char *proj = tu_pathf("%s/p", tu_dir());
    net a;
    net_open(&a, proj, 1u << 20, 1.0f);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    char *single = tu_pathf("%s/model.safetensors", ckpt_accelerator_last_dir(a.acc));
    char *index = tu_pathf("%s/model.safetensors.index.json", ckpt_accelerator_last_dir(a.acc));
    assert_true(tu_exists(single));
    assert_false(tu_exists(index));
    net_close(&a);
    free(single);
    free(index);
    free(proj);
}

static void test_damage_is_named(void **state) {
    (void)state;
    char *proj = tu_pathf("%s/p", tu_dir());
    net a, b;
    net_open(&a, proj, 1500, 1.0f);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    char *d = strdup(ckpt_accelerator_last_dir(a.acc));
    net_close(&a);
    char *shard = tu_pathf("%s/model-00003-of-00004.safetensors", d);
    tu_flip_byte(shard, -5);
    char *proj2 = tu_pathf("%s/q", tu_dir());
    net_open(&b, proj2, 0, 7.0f);
    float before = b.p[3][0];
    tu_expect_error(ckpt_load_state(b.acc, d), CKPT_ECORRUPT, "model-00003-of-00004.safetensors");
    assert_true(b.p[3][0] == before);
    tu_flip_byte(shard, -5);
    /* an index that names a file the manifest does not list: the manifest
     * checksum already refuses an edited index; a consistent but wrong one
     * is caught by the parts check */
    char *ip = tu_pathf("%s/model.safetensors.index.json", d);
    tu_flip_byte(ip, 10);
    assert_int_equal(ckpt_accelerator_start_over(b.acc), CKPT_OK);
    tu_expect_error(ckpt_load_state(b.acc, d), CKPT_ECORRUPT, "model.safetensors.index.json");
    /* said as what it is: JSON, not a safetensors header */
    tu_flip_byte(ip, 10);
    tu_flip_byte(ip, 0);
    ckpt_checkpoint_info info;
    tu_expect_error(ckpt_checkpoint_verify(d, true, &info), CKPT_ECORRUPT,
                    "model.safetensors.index.json: checksum mismatch and the shard index does not "
                    "parse: model.safetensors.index.json: not valid JSON");
    assert_null(strstr(ckpt_errmsg(), "header"));
    tu_flip_byte(ip, 0);
    FILE *f = fopen(ip, "r+b"); /* one digit of total_size changed: still an index */
    assert_non_null(f);
    char text[4096];
    size_t n = fread(text, 1, sizeof text - 1, f);
    text[n] = '\0';
    char *at = strstr(text, "\"total_size\": ");
    assert_non_null(at);
    at += strlen("\"total_size\": ");
    *at = *at == '9' ? '8' : '9';
    assert_int_equal(fseek(f, 0, SEEK_SET), 0);
    assert_int_equal(fwrite(text, 1, n, f), n);
    assert_int_equal(fclose(f), 0);
    tu_expect_error(ckpt_checkpoint_verify(d, true, &info), CKPT_ECORRUPT,
                    "model.safetensors.index.json: checksum mismatch in the shard index (it still "
                    "parses)");
    net_close(&b);
    free(ip);
    free(shard);
    free(proj2);
    free(d);
    free(proj);
}

/* ckpt_model_load_weights: from a checkpoint in the sharded layout, from a
 * bare Hugging Face folder (shards + index, no manifest), from one
 * .safetensors file with other key names; a mismatch changes nothing. */
static void test_model_load_weights(void **state) {
    (void)state;
    char *proj = tu_pathf("%s/p", tu_dir());
    net a;
    net_open(&a, proj, 1500, 1.0f);
    ckpt_accelerator_set_step(a.acc, 12);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    char *d = strdup(ckpt_accelerator_last_dir(a.acc));
    net b;
    char *proj2 = tu_pathf("%s/q", tu_dir());
    net_open(&b, proj2, 0, 5.0f);
    ckpt_load_report rep;
    assert_int_equal(ckpt_model_load_weights(b.m, d, NULL, &rep), CKPT_OK);
    for (int i = 0; i < NP; i++) assert_memory_equal(a.p[i], b.p[i], (size_t)sizes[i] * 4);
    assert_int_equal(rep.step, 12);
    assert_int_equal(rep.num_loaded, 1);
    ckpt_load_report_free(&rep);
    /* a bare Hugging Face folder: the shards and the index only */
    char *hf = tu_pathf("%s/hf", tu_dir());
    assert_int_equal(mkdir(hf, 0755), 0);
    const char *files[] = {"model-00001-of-00004.safetensors", "model-00002-of-00004.safetensors",
                           "model-00003-of-00004.safetensors", "model-00004-of-00004.safetensors",
                           "model.safetensors.index.json"};
    for (size_t i = 0; i < 5; i++) {
        char *from = tu_pathf("%s/%s", d, files[i]), *to = tu_pathf("%s/%s", hf, files[i]);
        size_t n;
        char *bytes = tu_read_file(from, &n);
        tu_write_file(to, bytes, n);
        free(bytes);
        free(from);
        free(to);
    }
    for (int i = 0; i < NP; i++) b.p[i][1] = 99.0f;
    assert_int_equal(ckpt_model_load_weights(b.m, hf, NULL, NULL), CKPT_OK);
    for (int i = 0; i < NP; i++) assert_memory_equal(a.p[i], b.p[i], (size_t)sizes[i] * 4);
    /* one file whose keys carry a prefix, and a tensor the model lacks */
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    char key[64];
    for (int i = 0; i < NP; i++) {
        snprintf(key, sizeof key, "transformer.%s", names[i]);
        assert_int_equal(ckpt_write_tensor(w, key, CKPT_F32, 1, &sizes[i], a.p[i]), CKPT_OK);
    }
    float extra[2] = {1, 2};
    int64_t two = 2;
    assert_int_equal(ckpt_write_tensor(w, "transformer.rotary.inv_freq", CKPT_F32, 1, &two, extra), CKPT_OK);
    char *one = tu_pathf("%s/weights.safetensors", tu_dir());
    assert_int_equal(ckpt_writer_save(w, one), CKPT_OK);
    ckpt_writer_free(w);
    for (int i = 0; i < NP; i++) b.p[i][1] = 99.0f;
    tu_expect_error(ckpt_model_load_weights(b.m, one, NULL, NULL), CKPT_EMISMATCH,
                    "'embed.weight' missing in file");
    assert_true(b.p[0][1] == 99.0f);
    ckpt_key_prefix strip[] = {{"transformer.", ""}};
    ckpt_load_options o = {.prefix_map = strip, .num_prefix_map = 1, .non_strict = true};
    assert_int_equal(ckpt_model_load_weights(b.m, one, &o, &rep), CKPT_OK);
    for (int i = 0; i < NP; i++) assert_memory_equal(a.p[i], b.p[i], (size_t)sizes[i] * 4);
    assert_int_equal(rep.num_unexpected, 1);
    assert_string_equal(rep.unexpected[0].file_key, "transformer.rotary.inv_freq");
    assert_int_equal(rep.num_renamed, NP);
    ckpt_load_report_free(&rep);
    tu_expect_error(ckpt_model_load_weights(b.m, "/nonexistent/weights", NULL, NULL), CKPT_ENOENT,
                    "/nonexistent/weights");
    net_close(&b);
    net_close(&a);
    free(one);
    free(hf);
    free(proj2);
    free(d);
    free(proj);
}

/* Every allocation failure of a sharded save and of its load is a clean
 * ENOMEM: no partial checkpoint visible, the model untouched. */
static void test_allocation_failures(void **state) {
    (void)state;
    char *proj = tu_pathf("%s/p", tu_dir());
    char *cd = tu_pathf("%s/checkpoints", proj);
    net a;
    net_open(&a, proj, 1500, 1.0f);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    int failures = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 100000);
        ckpt__alloc_fail_after(n);
        int rc = ckpt_save_state(a.acc, NULL);
        ckpt__alloc_fail_after(0);
        if (rc == 0) break;
        if (rc != CKPT_ENOMEM) fail_msg("save, allocation %llu: %d %s", (unsigned long long)n, rc, ckpt_errmsg());
        failures++;
        assert_int_equal(tu_count_hidden_tmp(cd), 0);
        char *next = tu_pathf("%s/checkpoint_1", cd);
        assert_false(tu_exists(next));
        free(next);
    }
    assert_true(failures > 10);
    char *d = strdup(ckpt_accelerator_last_dir(a.acc));
    net b;
    char *proj2 = tu_pathf("%s/q", tu_dir());
    net_open(&b, proj2, 0, 5.0f);
    failures = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 100000);
        ckpt__alloc_fail_after(n);
        int rc = ckpt_load_state(b.acc, d);
        ckpt__alloc_fail_after(0);
        if (rc == 0) break;
        if (rc != CKPT_ENOMEM) fail_msg("load, allocation %llu: %d %s", (unsigned long long)n, rc, ckpt_errmsg());
        failures++;
        assert_true(b.p[1][0] == 6.0f);
        assert_int_equal(ckpt_accelerator_start_over(b.acc), CKPT_OK);
    }
    assert_true(failures > 10);
    for (int i = 0; i < NP; i++) assert_memory_equal(a.p[i], b.p[i], (size_t)sizes[i] * 4);
    net_close(&b);
    net_close(&a);
    free(proj2);
    free(d);
    free(cd);
    free(proj);
}

static int shard_named_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)user, (void)acc;
    char *p = tu_pathf("%s/model-00001-of-00004.safetensors", dir);
    tu_write_text(p, "not a shard");
    free(p);
    return 0;
}

/* A save pre-hook may add files, but not one named like the model's shards. */
static void test_hook_cannot_take_a_shard_name(void **state) {
    (void)state;
    char *proj = tu_pathf("%s/p", tu_dir());
    net a;
    net_open(&a, proj, 1500, 1.0f);
    ckpt_hook_handle *h = NULL;
    assert_int_equal(ckpt_register_save_state_pre_hook(a.acc, shard_named_hook, NULL, &h), CKPT_OK);
    tu_expect_error(ckpt_save_state(a.acc, NULL), CKPT_EINVAL,
                    "a save pre-hook wrote 'model-00001-of-00004.safetensors'");
    net_close(&a);
    free(proj);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_save_as_shards_and_load, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_below_the_limit_is_one_file, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_damage_is_named, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_model_load_weights, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_allocation_failures, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_hook_cannot_take_a_shard_name, tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
