/* test_torch.c — torch.save files: the writer's values read back exactly,
 * real files made by PyTorch read as PyTorch reads them, every hostile file
 * of the fuzz corpus refused with its own error, truncations and flips
 * refused cleanly, writer misuse, flattening, and export / import of a
 * checkpoint loading back into live objects bit for bit. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdbool.h>
#include <unistd.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "helpers/testutil.h"

static char *corpus_file(const char *name) {
    const char *src = getenv("CKPT_SOURCE_DIR");
    return tu_pathf("%s/tests/fuzz/corpus/fuzz_torch/%s", src ? src : "..", name);
}

static ckpt_torch_file *open_ok(const char *path) {
    ckpt_torch_file *f = NULL;
    int rc = ckpt_torch_open(&f, path);
    if (rc != 0) fprintf(stderr, "%s\n", ckpt_errmsg());
    assert_int_equal(rc, 0);
    return f;
}

static const ckpt_torch_value *get(const ckpt_torch_value *d, const char *key) {
    const ckpt_torch_value *v = ckpt_torch_dict_get(d, key);
    if (!v) fail_msg("no key '%s'", key);
    return v;
}

/* ---- writer -> reader ------------------------------------------------------- */

static const ckpt_dtype all_dtypes[] = {CKPT_F64, CKPT_F32, CKPT_F16, CKPT_BF16, CKPT_I64,
                                        CKPT_I32, CKPT_I16, CKPT_I8,  CKPT_U8,   CKPT_BOOL};
static const int64_t ints[] = {0, 1, 255, 256, 65535, 65536, -1, -256, INT32_MIN, INT32_MAX,
                               (int64_t)INT32_MAX + 1, INT64_MIN, INT64_MAX};

static void test_writer_values_read_back_exactly(void **state) {
    (void)state;
    char *path = tu_pathf("%s/values.pt", tu_dir());
    uint8_t bytes[10][24];
    for (int d = 0; d < 10; d++)
        for (int i = 0; i < 24; i++) bytes[d][i] = (uint8_t)(d * 31 + i * 7) & (d == 9 ? 1 : 0xff);
    const int64_t shape[2] = {2, 3};
    const double floats[] = {0.1, -0.0, INFINITY, 1e-310, -3.5};
    ckpt_torch_writer *w;
    assert_int_equal(ckpt_torch_writer_new(&w), 0);
    assert_int_equal(ckpt_torch_begin_dict(w, true), 0);
    for (int d = 0; d < 10; d++) {
        assert_int_equal(ckpt_torch_put_str(w, ckpt_dtype_name(all_dtypes[d])), 0);
        int es = ckpt_dtype_bits(all_dtypes[d]) / 8;
        int64_t sh[2] = {2, 12 / es / 2 > 0 ? 12 / es / 2 : 1};
        (void)shape;
        assert_int_equal(ckpt_torch_put_tensor(w, all_dtypes[d], 2, sh, bytes[d]), 0);
    }
    assert_int_equal(ckpt_torch_put_str(w, "ints"), 0);
    assert_int_equal(ckpt_torch_begin_list(w), 0);
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) assert_int_equal(ckpt_torch_put_int(w, ints[i]), 0);
    assert_int_equal(ckpt_torch_end(w), 0);
    assert_int_equal(ckpt_torch_put_str(w, "floats"), 0);
    assert_int_equal(ckpt_torch_begin_tuple(w), 0);
    for (size_t i = 0; i < 5; i++) assert_int_equal(ckpt_torch_put_float(w, floats[i]), 0);
    assert_int_equal(ckpt_torch_end(w), 0);
    assert_int_equal(ckpt_torch_put_int(w, 7), 0);
    assert_int_equal(ckpt_torch_put_str(w, "gr\xc3\xbc\xc3\x9f" "e"), 0);
    assert_int_equal(ckpt_torch_put_str(w, "misc"), 0);
    assert_int_equal(ckpt_torch_begin_dict(w, false), 0);
    assert_int_equal(ckpt_torch_put_str(w, "none"), 0);
    assert_int_equal(ckpt_torch_put_none(w), 0);
    assert_int_equal(ckpt_torch_put_str(w, "yes"), 0);
    assert_int_equal(ckpt_torch_put_bool(w, true), 0);
    assert_int_equal(ckpt_torch_put_str(w, "scalar"), 0);
    double half = 0.5;
    assert_int_equal(ckpt_torch_put_tensor(w, CKPT_F64, 0, NULL, &half), 0);
    assert_int_equal(ckpt_torch_put_str(w, "empty"), 0);
    int64_t zero[2] = {0, 3};
    assert_int_equal(ckpt_torch_put_tensor(w, CKPT_F32, 2, zero, NULL), 0);
    assert_int_equal(ckpt_torch_end(w), 0);
    assert_int_equal(ckpt_torch_end(w), 0);
    assert_int_equal(ckpt_torch_writer_save(w, path), 0);
    ckpt_torch_writer_free(w);

    ckpt_torch_file *f = open_ok(path);
    const ckpt_torch_value *root = ckpt_torch_root(f);
    assert_int_equal(root->kind, CKPT_TORCH_DICT);
    assert_true(root->ordered);
    assert_int_equal(root->n, 14);
    for (int d = 0; d < 10; d++) {
        const ckpt_torch_value *t = get(root, ckpt_dtype_name(all_dtypes[d]));
        assert_int_equal(t->kind, CKPT_TORCH_TENSOR);
        assert_int_equal(t->dtype, all_dtypes[d]);
        assert_int_equal(t->ndim, 2);
        tu_assert_bytes_equal(t->data, (size_t)t->nbytes, bytes[d], (size_t)t->nbytes);
        assert_true(t->nbytes >= 8);
        /* data of every storage starts 64-byte aligned in the file */
    }
    const ckpt_torch_value *l = get(root, "ints");
    assert_int_equal(l->kind, CKPT_TORCH_LIST);
    assert_int_equal(l->n, (int64_t)(sizeof ints / sizeof ints[0]));
    for (int64_t i = 0; i < l->n; i++) assert_int_equal(l->items[i]->i, ints[i]);
    const ckpt_torch_value *t = get(root, "floats");
    assert_int_equal(t->kind, CKPT_TORCH_TUPLE);
    for (int i = 0; i < 5; i++) assert_memory_equal(&t->items[i]->f, &floats[i], 8);
    assert_int_equal(root->items[2 * 12]->kind, CKPT_TORCH_INT);
    assert_int_equal(root->items[2 * 12]->i, 7);
    assert_string_equal(root->items[2 * 12 + 1]->s, "gr\xc3\xbc\xc3\x9f" "e");
    const ckpt_torch_value *m = get(root, "misc");
    assert_false(m->ordered);
    assert_int_equal(get(m, "none")->kind, CKPT_TORCH_NONE);
    assert_true(get(m, "yes")->b);
    assert_int_equal(get(m, "scalar")->ndim, 0);
    assert_true(*(const double *)get(m, "scalar")->data == 0.5);
    assert_int_equal(get(m, "empty")->nbytes, 0);
    assert_int_equal(get(m, "empty")->shape[1], 3);
    ckpt_torch_close(f);

    /* alignment and CRCs: every stored record's data at a multiple of 64 */
    size_t n;
    unsigned char *raw = (unsigned char *)tu_read_file(path, &n);
    int records = 0;
    for (size_t off = 0; off + 30 < n; off++) {
        if (memcmp(raw + off, "PK\x03\x04", 4) != 0) continue;
        size_t nl = raw[off + 26] | raw[off + 27] << 8, el = raw[off + 28] | raw[off + 29] << 8;
        if (memmem(raw + off + 30, nl, "/data/", 6)) assert_int_equal((off + 30 + nl + el) % 64, 0);
        records++;
    }
    assert_int_equal(records, 10 + 1 + 2 + 1 + 1); /* 12 storages, data.pkl, byteorder, version */
    free(raw);
    free(path);
}

static void test_writer_refuses_misuse(void **state) {
    (void)state;
    ckpt_torch_writer *w;
    int64_t one = 1;
    float x = 1;
    assert_int_equal(ckpt_torch_writer_new(&w), 0);
    tu_expect_error(ckpt_torch_end(w), CKPT_EINVAL, "end without an open");
    ckpt_torch_writer_free(w);
    assert_int_equal(ckpt_torch_writer_new(&w), 0);
    assert_int_equal(ckpt_torch_begin_dict(w, false), 0);
    tu_expect_error(ckpt_torch_put_tensor(w, CKPT_F32, 1, &one, &x), CKPT_EINVAL, "dict key must be");
    tu_expect_error(ckpt_torch_put_int(w, 1), CKPT_EINVAL, "an earlier call failed");
    char *path = tu_pathf("%s/misuse.pt", tu_dir());
    tu_expect_error(ckpt_torch_writer_save(w, path), CKPT_EINVAL, "an earlier call failed");
    ckpt_torch_writer_free(w);
    assert_int_equal(ckpt_torch_writer_new(&w), 0);
    assert_int_equal(ckpt_torch_begin_list(w), 0);
    tu_expect_error(ckpt_torch_writer_save(w, path), CKPT_EINVAL, "not finished");
    tu_expect_error(ckpt_torch_put_tensor(w, CKPT_U16, 1, &one, &x), CKPT_EUNSUPPORTED, "U16");
    assert_int_equal(ckpt_torch_end(w), 0);
    tu_expect_error(ckpt_torch_put_int(w, 1), CKPT_EINVAL, "second object");
    ckpt_torch_writer_free(w);
    assert_int_equal(ckpt_torch_writer_new(&w), 0);
    assert_int_equal(ckpt_torch_begin_dict(w, false), 0);
    assert_int_equal(ckpt_torch_put_str(w, "k"), 0);
    tu_expect_error(ckpt_torch_end(w), CKPT_EINVAL, "key without a value");
    ckpt_torch_writer_free(w);
    assert_false(tu_exists(path));
    free(path);
}

/* ---- files PyTorch wrote ---------------------------------------------------------- */

static void test_reads_files_pytorch_wrote(void **state) {
    (void)state;
    char *p = corpus_file("ok_values");
    ckpt_torch_file *f = open_ok(p);
    const ckpt_torch_value *r = ckpt_torch_root(f);
    /* x = arange(12.).reshape(3, 4): x.t() is strided in its storage */
    const ckpt_torch_value *s = get(r, "strided");
    assert_int_equal(s->dtype, CKPT_F64);
    assert_int_equal(s->shape[0], 4);
    assert_int_equal(s->shape[1], 3);
    const double *d = s->data;
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 3; j++) assert_true(d[i * 3 + j] == (double)(j * 4 + i));
    const double *row = get(r, "row")->data;
    for (int j = 0; j < 4; j++) assert_true(row[j] == 4.0 + j);
    const ckpt_torch_value *sh = get(r, "shared");
    assert_ptr_equal(sh->items[0]->data, sh->items[1]->data);
    assert_true(get(r, "param")->parameter);
    const ckpt_torch_value *dt = get(r, "dtypes");
    const ckpt_dtype want[] = {CKPT_F16, CKPT_BF16, CKPT_I64, CKPT_I32, CKPT_I16, CKPT_I8, CKPT_U8, CKPT_BOOL};
    assert_int_equal(dt->n, 8);
    for (int i = 0; i < 8; i++) assert_int_equal(dt->items[i]->dtype, want[i]);
    const int64_t want_ints[] = {0, 255, 256, 65535, 65536, -1, INT32_MIN, (int64_t)1 << 31,
                                 (int64_t)1 << 62, INT64_MIN, INT64_MAX};
    const ckpt_torch_value *iv = get(r, "ints");
    assert_int_equal(iv->n, 11);
    for (int i = 0; i < 11; i++) assert_int_equal(iv->items[i]->i, want_ints[i]);
    assert_int_equal(get(r, "set")->kind, CKPT_TORCH_SET);
    assert_int_equal(get(r, "set")->n, 2);
    assert_string_equal(get(r, "text")->s, "gr\xc3\xbc\xc3\x9f" "e");
    assert_true(signbit(get(r, "floats")->items[1]->f));
    assert_int_equal(get(r, "empty")->nbytes, 0);
    assert_int_equal(get(r, "scalar")->ndim, 0);
    ckpt_torch_close(f);
    free(p);

    p = corpus_file("ok_model_state_dict");
    f = open_ok(p);
    r = ckpt_torch_root(f);
    assert_true(r->ordered);
    assert_int_equal(r->n, 9); /* 2 linears + batch norm (weight, bias, 2 running stats, count) */
    assert_string_equal(r->items[0]->s, "0.weight");
    assert_int_equal(get(r, "1.num_batches_tracked")->dtype, CKPT_I64);
    ckpt_torch_close(f);
    free(p);

    const char *others[] = {"ok_optimizer_sgd", "ok_optimizer_adam", "ok_optimizer_adamw",
                            "ok_scheduler_lambdalr", "ok_scheduler_steplr", "ok_scaler",
                            "ok_protocol4", "ok_deflated", "ok_tensor_handmade", "dag_billion_laughs"};
    for (size_t i = 0; i < sizeof others / sizeof others[0]; i++) {
        p = corpus_file(others[i]);
        ckpt_torch_file *g = open_ok(p);
        ckpt_torch_close(g);
        free(p);
    }
    p = corpus_file("ok_deflated");
    f = open_ok(p);
    const float *w = get(ckpt_torch_root(f), "w")->data;
    for (int i = 0; i < 6; i++) assert_true(w[i] == (float)i);
    ckpt_torch_close(f);
    free(p);
}

/* Every hostile file is refused with its own code and message. */
static void test_refuses_every_hostile_file(void **state) {
    (void)state;
    static const struct {
        const char *file;
        int code;
        const char *msg;
    } cases[] = {
        {"bad_global_os_system", CKPT_EUNSUPPORTED, "global 'os.system' is not allowed"},
        {"bad_global_builtins_eval", CKPT_EUNSUPPORTED, "global 'builtins.eval' is not allowed"},
        {"bad_reduce_storage_class", CKPT_EUNSUPPORTED, "REDUCE of a torch storage class"},
        {"bad_reduce_non_callable", CKPT_EUNSUPPORTED, "REDUCE of list"},
        {"bad_build_on_dict", CKPT_EUNSUPPORTED, "BUILD of dict"},
        {"bad_newobj", CKPT_EUNSUPPORTED, "opcode NEWOBJ is not allowed"},
        {"bad_persid_not_storage", CKPT_ECORRUPT, "persistent id"},
        {"bad_recursion_bomb", CKPT_ECORRUPT, "nested deeper than 256"},
        {"bad_mark_bomb", CKPT_ECORRUPT, "open MARK"},
        {"bad_self_containing_list", CKPT_ECORRUPT, "contains itself"},
        {"bad_object_bomb", CKPT_EUNSUPPORTED, "need more than 122 MiB of memory (at an object)"},
        {"bad_set_copy_bomb", CKPT_EUNSUPPORTED, "more than 32 MiB of memory (at a container's"},
        {"bad_huge_memo_index", CKPT_ECORRUPT, "memo index 4294967295 too large"},
        {"bad_memo_get_unset", CKPT_ECORRUPT, "memo index 5 was never set"},
        {"bad_long_too_wide", CKPT_EUNSUPPORTED, "wider than 64 bits"},
        {"bad_storage_too_short", CKPT_ECORRUPT, "needs 24 bytes, its record has 8"},
        {"bad_tensor_past_storage", CKPT_ECORRUPT, "has 6 elements, a tensor needs element 9"},
        {"bad_tensor_stride_past_storage", CKPT_ECORRUPT, "a tensor needs element 6"},
        {"bad_storage_missing", CKPT_ECORRUPT, "storage '9' has no record"},
        {"bad_truncated_zip", CKPT_ECORRUPT, "no end of central directory"},
        {"bad_not_zip", CKPT_ECORRUPT, "no zip signature"},
        {"bad_crc_mismatch", CKPT_ECORRUPT, "CRC-32"},
        {"bad_overlapping_records", CKPT_ECORRUPT, "overlapping records"},
        {"bad_central_directory_offset", CKPT_ECORRUPT, "central directory outside"},
        {"bad_duplicate_record", CKPT_ECORRUPT, "duplicate record"},
        {"bad_no_version", CKPT_ECORRUPT, "no archive/version record"},
        {"bad_legacy_format", CKPT_EUNSUPPORTED, "legacy torch.save file"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *p = corpus_file(cases[i].file);
        ckpt_torch_file *f = (ckpt_torch_file *)1;
        ckpt_clear_error();
        int rc = ckpt_torch_open(&f, p);
        if (rc != cases[i].code || !strstr(ckpt_errmsg(), cases[i].msg))
            fail_msg("%s: got %d '%s', want %d '%s'", cases[i].file, rc, ckpt_errmsg(),
                     cases[i].code, cases[i].msg);
        assert_null(f);
        free(p);
    }
    /* a DAG of 2^59 paths opens (each value once) but does not flatten */
    char *p = corpus_file("dag_billion_laughs");
    ckpt_torch_file *f = open_ok(p);
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), 0);
    tu_expect_error(ckpt_torch_flatten(ckpt_torch_root(f), "x", w), CKPT_ECORRUPT, "shared containers");
    ckpt_writer_free(w);
    ckpt_torch_close(f);
    free(p);
}

/* A field of /proc/self/status in KiB; -1 if it cannot be read. */
static long status_kib(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    long v = -1;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0) v = atol(line + n);
    if (f) fclose(f);
    return v;
}

/* --open FILE: opens it and prints "<rc> <VmRSS before> <VmHWM after>" (KiB). */
static int open_and_measure(const char *file) {
    long before = status_kib("VmRSS:");
    ckpt_torch_file *f = NULL;
    int rc = ckpt_torch_open(&f, file);
    long peak = status_kib("VmHWM:");
    ckpt_torch_close(f);
    printf("%d %ld %ld\n", rc, before, peak);
    return 0;
}

/* How much a fresh process's peak resident memory grows while it opens
 * file: this program run again with --open, so that nothing freed earlier
 * here can be reused and hide what the open costs. */
static long open_growth_kib(const char *file, int *rc) {
    char self[4096], cmd[8192];
    ssize_t k = readlink("/proc/self/exe", self, sizeof self - 1);
    assert_true(k > 0);
    self[k] = '\0';
    snprintf(cmd, sizeof cmd, "'%s' --open '%s'", self, file);
    FILE *p = popen(cmd, "r");
    assert_non_null(p);
    long before = -1, peak = -1;
    int got = fscanf(p, "%d %ld %ld", rc, &before, &peak);
    assert_int_equal(pclose(p), 0);
    if (got != 3 || before < 0 || peak < 0) fail_msg("--open %s: no measurement", file);
    return peak - before;
}

/* What a hostile pickle costs, measured as peak resident memory: 2 million
 * one-byte empty lists (a 2 MB pickle, 2 KB deflated) once took ~650 MB,
 * one ~300-byte object each, before STOP refused them. The unpickler now
 * charges each allocation first and stops at 64 bytes per pickle byte (122
 * MiB here). An unbounded reader makes all 2 million objects (~160 bytes
 * each now); the peak must stay well below what they alone would take. */
static void test_object_bomb_memory_is_bounded(void **state) {
    (void)state;
    char *bomb = corpus_file("bad_object_bomb");
    int rc = 0;
    long grew = open_growth_kib(bomb, &rc);
    assert_true(rc < 0);
    long budget = 2000003L * 64 / 1024, objects = 2000000L * 160 / 1024;
    print_message("object bomb: peak RSS grew %ld KiB (budget %ld KiB, the objects alone %ld "
                  "KiB)\n",
                  grew, budget, objects);
    if (grew >= objects)
        fail_msg("a 2 MB pickle of empty lists took %ld KiB at its peak (less than %ld expected)",
                 grew, objects);
    ckpt_torch_file *f = NULL;
    tu_expect_error(ckpt_torch_open(&f, bomb), CKPT_EUNSUPPORTED,
                    "need more than 122 MiB of memory (at an object)");
    free(bomb);
}

static void test_truncations_and_flips_fail_cleanly(void **state) {
    (void)state;
    char *p = corpus_file("ok_optimizer_adam");
    size_t n;
    char *buf = tu_read_file(p, &n);
    for (size_t k = 0; k < n; k++) {
        ckpt_torch_file *f = NULL;
        int rc = ckpt_torch_open_memory(&f, buf, k, "cut");
        if (rc == 0) fail_msg("a file cut to %zu of %zu bytes opened", k, n);
        assert_true(rc == CKPT_ECORRUPT || rc == CKPT_EUNSUPPORTED);
    }
    for (size_t k = 0; k < n; k++) {
        buf[k] ^= 0x20;
        ckpt_torch_file *f = NULL;
        if (ckpt_torch_open_memory(&f, buf, n, "flip") == 0) ckpt_torch_close(f);
        buf[k] ^= 0x20;
    }
    free(buf);
    free(p);
}

static void test_flatten_makes_dotted_keys(void **state) {
    (void)state;
    char *p = corpus_file("ok_optimizer_adam");
    ckpt_torch_file *f = open_ok(p);
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), 0);
    assert_int_equal(ckpt_torch_flatten(ckpt_torch_root(f), NULL, w), 0);
    char *out = tu_pathf("%s/flat.safetensors", tu_dir());
    assert_int_equal(ckpt_writer_save(w, out), 0);
    ckpt_writer_free(w);
    ckpt_torch_close(f);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, out), 0);
    ckpt_entry_info e;
    assert_int_equal(ckpt_reader_find(r, "state.0.exp_avg", &e), 0);
    assert_int_equal(e.kind, CKPT_ENTRY_TENSOR);
    assert_int_equal(e.shape[0], 3);
    assert_int_equal(e.shape[1], 4);
    assert_int_equal(ckpt_reader_find(r, "state.0.max_exp_avg_sq", &e), 0);
    double b;
    assert_int_equal(ckpt_read_f64(r, "param_groups.0.betas.1", &b), 0);
    assert_true(b == 0.999);
    int64_t ams;
    assert_int_equal(ckpt_read_i64(r, "param_groups.0.amsgrad", &ams), 0);
    assert_int_equal(ams, 1);
    assert_int_equal(ckpt_reader_find(r, "param_groups.0.foreach", &e), CKPT_ENOENT); /* None */
    ckpt_reader_free(r);
    free(out);
    free(p);
}

/* ---- export / import ------------------------------------------------------------ */

typedef struct run {
    float w[12], b[3], gw[12], gb[3];
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_scheduler *s;
    ckpt_grad_scaler *gs;
    ckpt_accelerator *acc;
} run;

static void run_make(run *u, float seed) {
    memset(u, 0, sizeof *u);
    for (int i = 0; i < 12; i++) u->w[i] = seed * (float)(i - 5) / 7.0f;
    for (int i = 0; i < 3; i++) u->b[i] = seed * (float)i / 3.0f;
    int64_t sw[2] = {3, 4}, sb[1] = {3};
    assert_int_equal(ckpt_model_new(&u->m), 0);
    assert_int_equal(ckpt_model_add_param(u->m, "fc.weight", CKPT_F32, 2, sw, u->w, u->gw), 0);
    assert_int_equal(ckpt_model_add_param(u->m, "fc.bias", CKPT_F32, 1, sb, u->b, u->gb), 0);
    assert_int_equal(ckpt_adamw_new(&u->o, u->m, 0.01, 0.9, 0.999, 1e-8, 0.01), 0);
    ckpt_optim_options g[2] = {ckpt_optim_defaults(CKPT_OPTIM_ADAMW), ckpt_optim_defaults(CKPT_OPTIM_ADAMW)};
    g[0].lr = g[1].lr = 0.01;
    g[1].weight_decay = 0;
    int group_of[2] = {0, 1};
    assert_int_equal(ckpt_optimizer_set_groups(u->o, 2, group_of, g), 0);
    assert_int_equal(ckpt_warmup_cosine_new(&u->s, u->o, 2, 20), 0);
    assert_int_equal(ckpt_grad_scaler_new(&u->gs, 256.0, 2.0, 0.5, 3), 0);
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&u->acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(u->acc, u->m), 0);
    assert_int_equal(ckpt_prepare_optimizer(u->acc, u->o), 0);
    assert_int_equal(ckpt_prepare_scheduler(u->acc, u->s), 0);
    assert_int_equal(ckpt_prepare_scaler(u->acc, u->gs), 0);
}

static void run_free(run *u) {
    ckpt_accelerator_free(u->acc);
    ckpt_grad_scaler_free(u->gs);
    ckpt_scheduler_free(u->s);
    ckpt_optimizer_free(u->o);
    ckpt_model_free(u->m);
}

static void test_export_then_import_loads_back_bit_for_bit(void **state) {
    (void)state;
    run a;
    run_make(&a, 1.0f);
    for (int step = 0; step < 5; step++) {
        for (int i = 0; i < 12; i++) a.gw[i] = (float)((i * 7 + step) % 5) - 2.0f;
        for (int i = 0; i < 3; i++) a.gb[i] = 0.5f * (float)(i - step);
        assert_int_equal(ckpt_grad_scaler_step(a.gs, a.o, NULL), 0);
        assert_int_equal(ckpt_grad_scaler_update(a.gs), 0);
        assert_int_equal(ckpt_scheduler_step(a.s), 0);
    }
    ckpt_accelerator_set_step(a.acc, 5);
    char *ck = tu_pathf("%s/ck", tu_dir()), *out = tu_pathf("%s/out", tu_dir());
    char *back = tu_pathf("%s/back", tu_dir()), *again = tu_pathf("%s/again", tu_dir());
    assert_int_equal(ckpt_save_state(a.acc, ck), 0);
    assert_int_equal(ckpt_export_torch(ck, out, NULL), 0);
    tu_expect_error(ckpt_export_torch(ck, out, NULL), CKPT_EEXIST, "already exists");
    const char *files[] = {"model.safetensors", "optimizer.bin", "scheduler.bin", "scaler.pt", "README.md"};
    for (int i = 0; i < 5; i++) {
        char *fp = tu_pathf("%s/%s", out, files[i]);
        assert_true(tu_exists(fp));
        free(fp);
    }
    /* Adam vs AdamW with weight decay: the file cannot say */
    tu_expect_error(ckpt_import_torch(out, back, NULL), CKPT_EINVAL, "--optimizer adam|adamw");
    assert_false(tu_exists(back));
    ckpt_import_options io = ckpt_import_defaults();
    io.optimizer = CKPT_OPTIM_ADAMW;
    assert_int_equal(ckpt_import_torch(out, back, &io), 0);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(back, true, &info), 0);
    assert_int_equal(info.step, 5);

    run b;
    run_make(&b, 2.0f);
    assert_int_equal(ckpt_load_state(b.acc, back), 0);
    assert_memory_equal(a.w, b.w, sizeof a.w);
    assert_memory_equal(a.b, b.b, sizeof a.b);
    assert_true(ckpt_optimizer_get_lr(a.o, 1) == ckpt_optimizer_get_lr(b.o, 1));
    assert_true(ckpt_grad_scaler_scale(a.gs) == ckpt_grad_scaler_scale(b.gs));
    /* every object's state file is the same bytes as the original's */
    assert_int_equal(ckpt_save_state(b.acc, again), 0);
    const char *objs[] = {"model.safetensors", "optimizer.safetensors", "scheduler.safetensors",
                          "scaler.safetensors"};
    for (int i = 0; i < 4; i++) {
        char *x = tu_pathf("%s/%s", ck, objs[i]), *y = tu_pathf("%s/%s", again, objs[i]);
        tu_assert_same_file(x, y, objs[i]);
        free(x);
        free(y);
    }
    run_free(&a);
    run_free(&b);
    free(ck);
    free(out);
    free(back);
    free(again);
}

static void test_export_shards_and_import_reads_the_index(void **state) {
    (void)state;
    run a;
    run_make(&a, 1.0f);
    char *ck = tu_pathf("%s/ck", tu_dir()), *out = tu_pathf("%s/out", tu_dir());
    char *back = tu_pathf("%s/back", tu_dir());
    assert_int_equal(ckpt_save_state(a.acc, ck), 0);
    ckpt_export_options eo = {.weights_only = true, .max_shard_size = 20};
    assert_int_equal(ckpt_export_torch(ck, out, &eo), 0);
    char *s1 = tu_pathf("%s/model-00001-of-00002.safetensors", out);
    char *s2 = tu_pathf("%s/model-00002-of-00002.safetensors", out);
    char *idx = tu_pathf("%s/model.safetensors.index.json", out);
    char *opt = tu_pathf("%s/optimizer.bin", out);
    assert_true(tu_exists(s1) && tu_exists(s2) && tu_exists(idx));
    assert_false(tu_exists(opt));
    size_t n;
    char *text = tu_read_file(idx, &n);
    tu_assert_contains(text, "\"total_size\": 60");
    tu_assert_contains(text, "\"fc.weight\": \"model-0000");
    free(text);
    assert_int_equal(ckpt_import_torch(out, back, NULL), 0);
    char *x = tu_pathf("%s/model.safetensors", ck), *y = tu_pathf("%s/model.safetensors", back);
    tu_assert_same_file(x, y, "model.safetensors");
    run_free(&a);
    free(x);
    free(y);
    free(s1);
    free(s2);
    free(idx);
    free(opt);
    free(ck);
    free(out);
    free(back);
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--open") == 0) return open_and_measure(argv[2]);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_writer_values_read_back_exactly, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_writer_refuses_misuse, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test(test_reads_files_pytorch_wrote),
        cmocka_unit_test(test_refuses_every_hostile_file),
        cmocka_unit_test(test_object_bomb_memory_is_bounded),
        cmocka_unit_test(test_truncations_and_flips_fail_cleanly),
        cmocka_unit_test_setup_teardown(test_flatten_makes_dotted_keys, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_export_then_import_loads_back_bit_for_bit,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_export_shards_and_import_reads_the_index,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
