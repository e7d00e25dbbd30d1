/* test_statedict.c — state-dict writer/reader: round trips of every dtype and
 * scalar kind, key rules, typed reads, schema checks, crash safety under
 * injected I/O faults, and allocation failures. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <jansson.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "testing/testing.h"
#include "format/statedict.h"
#include "helpers/testutil.h"

/* ---- fixtures ----------------------------------------------------------- */

typedef struct fx {
    char dir[64];
    char path[128];
} fx;

static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    if (tu_tmpdir_make(f->dir, sizeof f->dir, "test_sd") != 0) return -1;
    tu_path(f->path, sizeof f->path, f->dir, "x.safetensors");
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    ckpt__fault_disarm();
    ckpt__alloc_fail_after(0);
    tu_tmpdir_remove(f->dir);
    free(f);
    return 0;
}

/* Names of the folder's entries other than . and .., joined by '|'. */
static void list_dir(const char *dir, char *out, size_t cap) {
    out[0] = '\0';
    DIR *d = opendir(dir);
    assert_non_null(d);
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (out[0]) strncat(out, "|", cap - strlen(out) - 1);
        strncat(out, de->d_name, cap - strlen(out) - 1);
    }
    closedir(d);
}

/* ---- dtypes and sizes --------------------------------------------------- */

static void test_dtype_names_round_trip(void **state) {
    (void)state;
    for (int i = 1; i < CKPT_DTYPE_COUNT_; i++) {
        const char *n = ckpt_dtype_name((ckpt_dtype)i);
        assert_non_null(n);
        ckpt_dtype back = CKPT_DTYPE_INVALID;
        assert_int_equal(ckpt_dtype_from_name(n, &back), CKPT_OK);
        assert_int_equal(back, i);
    }
    assert_null(ckpt_dtype_name(CKPT_DTYPE_INVALID));
    assert_null(ckpt_dtype_name(CKPT_DTYPE_COUNT_));
    ckpt_dtype d;
    assert_int_equal(ckpt_dtype_from_name("F33", &d), CKPT_EINVAL);
    assert_int_equal(ckpt_dtype_from_name("f32", &d), CKPT_EINVAL);
    assert_int_equal(ckpt_dtype_bits(CKPT_F4), 4);
    assert_int_equal(ckpt_dtype_bits(CKPT_F6_E3M2), 6);
    assert_int_equal(ckpt_dtype_bits(CKPT_BOOL), 8);
    assert_int_equal(ckpt_dtype_bits(CKPT_BF16), 16);
    assert_int_equal(ckpt_dtype_bits(CKPT_C64), 64);
    assert_int_equal(ckpt_dtype_bits(CKPT_DTYPE_INVALID), 0);
}

static void test_tensor_nbytes_checks_overflow_and_sub_byte(void **state) {
    (void)state;
    uint64_t n = 0;
    int64_t s1[] = {2, 3};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F32, 2, s1, &n), CKPT_OK);
    assert_int_equal(n, 24);
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F64, 0, NULL, &n), CKPT_OK);
    assert_int_equal(n, 8); /* scalar: one element */
    int64_t z[] = {(int64_t)1 << 62, 0, (int64_t)1 << 62};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F64, 3, z, &n), CKPT_OK);
    assert_int_equal(n, 0);
    /* 2^62 bytes is fine; 2^63 is not. */
    int64_t big[] = {(int64_t)1 << 62};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_U8, 1, big, &n), CKPT_OK);
    assert_int_equal(n, (uint64_t)1 << 62);
    int64_t big2[] = {(int64_t)1 << 61};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F32, 1, big2, &n), CKPT_EINVAL); /* 2^63 */
    assert_int_equal(ckpt_tensor_nbytes(CKPT_I16, 1, big2, &n), CKPT_OK);
    assert_int_equal(n, (uint64_t)1 << 62);
    /* element count itself overflowing 2^64 */
    int64_t ov[] = {(int64_t)1 << 40, (int64_t)1 << 40};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_U8, 2, ov, &n), CKPT_EINVAL);
    int64_t ov2[] = {INT64_MAX, 2};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_BOOL, 2, ov2, &n), CKPT_EINVAL);
    int64_t ov3[] = {(int64_t)1 << 58};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F64, 1, ov3, &n), CKPT_OK); /* 2^61 bytes */
    assert_int_equal(n, (uint64_t)1 << 61);
    int64_t ov4[] = {(int64_t)1 << 60};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F64, 1, ov4, &n), CKPT_EINVAL);
    /* sub-byte */
    int64_t odd[] = {3};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F4, 1, odd, &n), CKPT_EINVAL);
    tu_assert_errmsg_has("whole number of bytes");
    int64_t even[] = {6};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F4, 1, even, &n), CKPT_OK);
    assert_int_equal(n, 3);
    int64_t six[] = {4};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F6_E2M3, 1, six, &n), CKPT_OK);
    assert_int_equal(n, 3);
    int64_t six2[] = {2};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F6_E2M3, 1, six2, &n), CKPT_EINVAL);
    int64_t hugef4[] = {INT64_MAX - 1}; /* even, but 4 bits each is >= 2^62 bytes... */
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F4, 1, hugef4, &n), CKPT_OK);
    assert_int_equal(n, (uint64_t)(INT64_MAX - 1) / 2);
    int64_t hugef6[] = {INT64_MAX - 3}; /* multiple of 4, 6 bits each: 0.75 * 2^63 */
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F6_E3M2, 1, hugef6, &n), CKPT_OK);
    assert_int_equal(n, (uint64_t)(INT64_MAX - 3) / 4 * 3);
    /* bad arguments */
    int64_t neg[] = {2, -1};
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F32, 2, neg, &n), CKPT_EINVAL);
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F32, CKPT_MAX_NDIM + 1, s1, &n), CKPT_EINVAL);
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F32, -1, s1, &n), CKPT_EINVAL);
    assert_int_equal(ckpt_tensor_nbytes(CKPT_DTYPE_INVALID, 1, s1, &n), CKPT_EINVAL);
    assert_int_equal(ckpt_tensor_nbytes((ckpt_dtype)99, 1, s1, &n), CKPT_EINVAL);
    assert_int_equal(ckpt_tensor_nbytes(CKPT_F32, 1, NULL, &n), CKPT_EINVAL);
}

/* ---- round trips -------------------------------------------------------- */

static void fill_pattern(uint8_t *p, size_t n, unsigned seed) {
    uint32_t x = seed * 2654435761u + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        p[i] = (uint8_t)x;
    }
}

static void test_round_trip_every_dtype(void **state) {
    fx *f = *state;
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    uint8_t *bufs[CKPT_DTYPE_COUNT_] = {0};
    int64_t shapes[CKPT_DTYPE_COUNT_][2];
    uint64_t sizes[CKPT_DTYPE_COUNT_];
    char key[32];
    for (int i = 1; i < CKPT_DTYPE_COUNT_; i++) {
        shapes[i][0] = 3;
        shapes[i][1] = 4 + i % 3 * 4; /* 12, 24 or 36 elements: fine for F4 and F6 */
        assert_int_equal(ckpt_tensor_nbytes((ckpt_dtype)i, 2, shapes[i], &sizes[i]), CKPT_OK);
        bufs[i] = malloc(sizes[i]);
        fill_pattern(bufs[i], sizes[i], (unsigned)i);
        if (i == CKPT_BOOL)
            for (uint64_t k = 0; k < sizes[i]; k++) bufs[i][k] &= 1;
        snprintf(key, sizeof key, "t.%s", ckpt_dtype_name((ckpt_dtype)i));
        assert_int_equal(ckpt_write_tensor(w, key, (ckpt_dtype)i, 2, shapes[i], bufs[i]), CKPT_OK);
    }
    assert_int_equal(ckpt_writer_save(w, f->path), CKPT_OK);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    assert_int_equal(ckpt_reader_count(r), CKPT_DTYPE_COUNT_ - 1);
    for (int i = 1; i < CKPT_DTYPE_COUNT_; i++) {
        snprintf(key, sizeof key, "t.%s", ckpt_dtype_name((ckpt_dtype)i));
        uint8_t *got = malloc(sizes[i]);
        memset(got, 0xee, sizes[i]);
        assert_int_equal(ckpt_read_tensor(r, key, (ckpt_dtype)i, 2, shapes[i], got), CKPT_OK);
        assert_memory_equal(got, bufs[i], sizes[i]);
        const void *view = NULL;
        ckpt_entry_info info;
        assert_int_equal(ckpt_reader_tensor_view(r, key, &view, &info), CKPT_OK);
        assert_memory_equal(view, bufs[i], sizes[i]);
        assert_int_equal(info.kind, CKPT_ENTRY_TENSOR);
        assert_int_equal(info.dtype, i);
        assert_int_equal(info.nbytes, sizes[i]);
        /* every tensor's data is aligned to its element size (file offset) */
        int bits = ckpt_dtype_bits((ckpt_dtype)i);
        if (bits >= 8) assert_int_equal(info.offset % (uint64_t)(bits / 8), 0);
        free(got);
        free(bufs[i]);
    }
    ckpt_reader_free(r);
    ckpt_writer_free(w);
}

static void test_round_trip_scalars_and_zero_sized_tensors(void **state) {
    fx *f = *state;
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    double s = 3.25;
    int64_t z1[] = {0};
    int64_t z2[] = {4, 0, 7};
    int32_t one = -7;
    assert_int_equal(ckpt_write_tensor(w, "scalar", CKPT_F64, 0, NULL, &s), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "empty", CKPT_F32, 1, z1, NULL), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "empty3", CKPT_I64, 3, z2, NULL), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "one", CKPT_I32, 0, NULL, &one), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, f->path), CKPT_OK);
    ckpt_writer_free(w);

    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    double s2 = 0;
    assert_int_equal(ckpt_read_tensor(r, "scalar", CKPT_F64, 0, NULL, &s2), CKPT_OK);
    assert_true(s2 == 3.25);
    int32_t one2 = 0;
    assert_int_equal(ckpt_read_tensor(r, "one", CKPT_I32, 0, NULL, &one2), CKPT_OK);
    assert_int_equal(one2, -7);
    assert_int_equal(ckpt_read_tensor(r, "empty", CKPT_F32, 1, z1, NULL), CKPT_OK);
    assert_int_equal(ckpt_read_tensor(r, "empty3", CKPT_I64, 3, z2, NULL), CKPT_OK);
    ckpt_entry_info info;
    assert_int_equal(ckpt_reader_find(r, "empty3", &info), CKPT_OK);
    assert_int_equal(info.ndim, 3);
    assert_int_equal(info.shape[2], 7);
    assert_int_equal(info.nbytes, 0);
    assert_int_equal(ckpt_reader_find(r, "scalar", &info), CKPT_OK);
    assert_int_equal(info.ndim, 0);
    assert_int_equal(info.nbytes, 8);
    /* a scalar asked as shape [1] is a mismatch: exact shapes only */
    int64_t s1[] = {1};
    assert_int_equal(ckpt_read_tensor(r, "scalar", CKPT_F64, 1, s1, &s2), CKPT_EMISMATCH);
    tu_assert_errmsg_has("shape [] in file, [1] asked");
    ckpt_reader_free(r);
}

static uint64_t bits_of(double d) {
    uint64_t u;
    memcpy(&u, &d, 8);
    return u;
}

static void test_round_trip_i64_f64_str_bytes_exactly(void **state) {
    fx *f = *state;
    static const int64_t ints[] = {0, 1, -1, INT64_MAX, INT64_MIN, INT64_MIN + 1, 9007199254740993LL};
    static const double dbls[] = {0.0, -0.0, 1.0, -1.5, 0.1, 1e-308, 4.9406564584124654e-324,
                                  2.2250738585072009e-308, DBL_MAX, -DBL_MAX, DBL_MIN,
                                  1.0 / 3.0, 123456789.123456789, 1e300, INFINITY, -INFINITY};
    const size_t ni = sizeof ints / sizeof ints[0], nd = sizeof dbls / sizeof dbls[0];
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    char key[32];
    for (size_t i = 0; i < ni; i++) {
        snprintf(key, sizeof key, "i.%zu", i);
        assert_int_equal(ckpt_write_i64(w, key, ints[i]), CKPT_OK);
    }
    for (size_t i = 0; i < nd; i++) {
        snprintf(key, sizeof key, "d.%zu", i);
        assert_int_equal(ckpt_write_f64(w, key, dbls[i]), CKPT_OK);
    }
    assert_int_equal(ckpt_write_f64(w, "nan", NAN), CKPT_OK);
    assert_int_equal(ckpt_write_str(w, "s.empty", ""), CKPT_OK);
    assert_int_equal(ckpt_write_str(w, "s.utf8", "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 \"q\" \\ \n\t"), CKPT_OK);
    uint8_t bin[256];
    for (int i = 0; i < 256; i++) bin[i] = (uint8_t)i;
    assert_int_equal(ckpt_write_bytes(w, "b.empty", NULL, 0), CKPT_OK);
    assert_int_equal(ckpt_write_bytes(w, "b.bin", bin, 256), CKPT_OK);
    assert_int_equal(ckpt_write_bytes(w, "b.1", bin + 200, 1), CKPT_OK);
    assert_int_equal(ckpt_write_bytes(w, "b.2", bin + 200, 2), CKPT_OK);
    assert_int_equal(ckpt_write_str(w, "\xc3\xbc.key \xe2\x82\xac", "v"), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, f->path), CKPT_OK);
    ckpt_writer_free(w);

    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    for (size_t i = 0; i < ni; i++) {
        snprintf(key, sizeof key, "i.%zu", i);
        int64_t v = 0;
        assert_int_equal(ckpt_read_i64(r, key, &v), CKPT_OK);
        assert_true(v == ints[i]);
    }
    for (size_t i = 0; i < nd; i++) {
        snprintf(key, sizeof key, "d.%zu", i);
        double v = 0;
        assert_int_equal(ckpt_read_f64(r, key, &v), CKPT_OK);
        if (bits_of(v) != bits_of(dbls[i]))
            fail_msg("%s: %a read back as %a", key, dbls[i], v);
    }
    double nan = 0;
    assert_int_equal(ckpt_read_f64(r, "nan", &nan), CKPT_OK);
    assert_true(isnan(nan));
    char buf[128];
    assert_int_equal(ckpt_read_str(r, "s.empty", buf, sizeof buf), CKPT_OK);
    assert_string_equal(buf, "");
    assert_int_equal(ckpt_read_str(r, "s.utf8", buf, sizeof buf), CKPT_OK);
    assert_string_equal(buf, "h\xc3\xa9llo \xe6\x97\xa5\xe6\x9c\xac \xf0\x9f\x98\x80 \"q\" \\ \n\t");
    assert_int_equal(ckpt_read_str(r, "\xc3\xbc.key \xe2\x82\xac", buf, sizeof buf), CKPT_OK);
    assert_string_equal(buf, "v");
    uint8_t got[300];
    size_t n = 99;
    assert_int_equal(ckpt_read_bytes(r, "b.empty", got, sizeof got, &n), CKPT_OK);
    assert_int_equal(n, 0);
    assert_int_equal(ckpt_read_bytes(r, "b.bin", got, sizeof got, &n), CKPT_OK);
    assert_int_equal(n, 256);
    assert_memory_equal(got, bin, 256);
    assert_int_equal(ckpt_read_bytes(r, "b.1", got, sizeof got, &n), CKPT_OK);
    assert_int_equal(n, 1);
    assert_int_equal(got[0], 200);
    assert_int_equal(ckpt_read_bytes(r, "b.2", got, sizeof got, &n), CKPT_OK);
    assert_int_equal(n, 2);
    assert_int_equal(got[1], 201);
    /* the same through a memory reader */
    size_t len;
    uint8_t *file = (uint8_t *)tu_read_file(f->path, &len);
    ckpt_reader *m;
    assert_int_equal(ckpt_reader_open_memory(&m, file, len, "mem"), CKPT_OK);
    int64_t v = 0;
    assert_int_equal(ckpt_read_i64(m, "i.4", &v), CKPT_OK);
    assert_true(v == INT64_MIN);
    assert_int_equal(ckpt_reader_count(m), ckpt_reader_count(r));
    ckpt_reader_free(m);
    free(file);
    ckpt_reader_free(r);
}

/* u64 entries: every 64-bit value exactly (a decimal string in the
 * document), a kind of their own; the document says version 2 only when it
 * holds one (or an alias). */
static void test_round_trip_u64_exactly(void **state) {
    fx *f = *state;
    static const uint64_t vals[] = {0,
                                    1,
                                    9007199254740993ULL,
                                    (uint64_t)INT64_MAX,
                                    (uint64_t)INT64_MAX + 1,
                                    UINT64_MAX - 1,
                                    UINT64_MAX};
    const size_t nv = sizeof vals / sizeof vals[0];
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    char key[32];
    for (size_t i = 0; i < nv; i++) {
        snprintf(key, sizeof key, "u.%zu", i);
        assert_int_equal(ckpt_write_u64(w, key, vals[i]), CKPT_OK);
    }
    assert_int_equal(ckpt_write_i64(w, "i", -1), CKPT_OK);
    assert_int_equal(ckpt_write_u64(w, "i", 1), CKPT_EEXIST);
    assert_int_equal(ckpt_writer_save(w, f->path), CKPT_OK);
    ckpt_writer_free(w);
    size_t len = 0;
    char *bytes = tu_read_file(f->path, &len);
    tu_assert_contains(bytes + 8, "{\\\"version\\\":2");
    tu_assert_contains(bytes + 8,
                       "\\\"type\\\":\\\"u64\\\",\\\"value\\\":\\\"18446744073709551615\\\"");
    free(bytes);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    for (size_t i = 0; i < nv; i++) {
        snprintf(key, sizeof key, "u.%zu", i);
        uint64_t v = 7;
        assert_int_equal(ckpt_read_u64(r, key, &v), CKPT_OK);
        assert_true(v == vals[i]);
        ckpt_entry_info e;
        assert_int_equal(ckpt_reader_find(r, key, &e), CKPT_OK);
        assert_int_equal(e.kind, CKPT_ENTRY_U64);
        assert_int_equal(e.nbytes, 8);
        assert_string_equal(ckpt_entry_kind_name(e.kind), "u64");
    }
    int64_t i64 = 0;
    uint64_t u64 = 0;
    tu_expect_error(ckpt_read_i64(r, "u.1", &i64), CKPT_EMISMATCH, "u64 in file, i64 asked");
    tu_expect_error(ckpt_read_u64(r, "i", &u64), CKPT_EMISMATCH, "i64 in file, u64 asked");
    ckpt_reader_free(r);
    /* without a u64 (or an alias) the document stays version 1 */
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "i", 1), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, f->path), CKPT_OK);
    ckpt_writer_free(w);
    bytes = tu_read_file(f->path, &len);
    tu_assert_contains(bytes + 8, "{\\\"version\\\":1");
    free(bytes);
}

static void test_entries_listed_in_file_order(void **state) {
    fx *f = *state;
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    uint8_t b[4] = {1, 2, 3, 4};
    double d[1] = {1};
    int64_t s1[] = {4}, s2[] = {1};
    assert_int_equal(ckpt_write_i64(w, "z_step", 5), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "b_u8", CKPT_U8, 1, s1, b), CKPT_OK);
    assert_int_equal(ckpt_write_str(w, "a_name", "x"), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "c_f64", CKPT_F64, 1, s2, d), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "a_u8", CKPT_U8, 1, s1, b), CKPT_OK);
    assert_int_equal(ckpt_writer_count(w), 5);
    assert_int_equal(ckpt_writer_entry_count(w), 5);
    ckpt_entry_info info;
    assert_int_equal(ckpt_writer_entry(w, 2, &info), CKPT_OK);
    assert_string_equal(info.key, "a_name");
    assert_int_equal(info.kind, CKPT_ENTRY_STR);
    assert_int_equal(info.nbytes, 1);
    assert_int_equal(ckpt_writer_entry(w, 5, &info), CKPT_EINVAL);
    assert_int_equal(ckpt_writer_save(w, f->path), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    /* tensors by offset (8-byte F64 first, then by name), then scalars as written */
    const char *order[] = {"c_f64", "a_u8", "b_u8", "z_step", "a_name"};
    for (int i = 0; i < 5; i++) {
        assert_int_equal(ckpt_reader_entry(r, i, &info), CKPT_OK);
        assert_string_equal(info.key, order[i]);
    }
    assert_int_equal(ckpt_reader_entry(r, 0, &info), CKPT_OK);
    assert_int_equal(info.offset % 8, 0);
    assert_int_equal(ckpt_reader_entry(r, -1, &info), CKPT_EINVAL);
    ckpt_reader_free(r);
}

/* ---- keys --------------------------------------------------------------- */

static void test_writer_rejects_malformed_keys(void **state) {
    (void)state;
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    char long_key[CKPT_MAX_KEY + 2];
    memset(long_key, 'k', CKPT_MAX_KEY + 1);
    long_key[CKPT_MAX_KEY + 1] = '\0';
    assert_int_equal(ckpt_write_i64(w, long_key, 1), CKPT_EINVAL);
    tu_assert_errmsg_has("longer than 1024");
    long_key[CKPT_MAX_KEY] = '\0';
    assert_int_equal(ckpt_write_i64(w, long_key, 1), CKPT_OK); /* exactly 1024 is fine */
    assert_int_equal(ckpt_write_i64(w, "", 1), CKPT_EINVAL);
    tu_assert_errmsg_has("empty");
    assert_int_equal(ckpt_write_i64(w, NULL, 1), CKPT_EINVAL);
    assert_int_equal(ckpt_write_i64(w, "a\nb", 1), CKPT_EINVAL);
    tu_assert_errmsg_has("control character");
    assert_int_equal(ckpt_write_i64(w, "a\x7f", 1), CKPT_EINVAL);
    assert_int_equal(ckpt_write_i64(w, "a\xc2\x85", 1), CKPT_EINVAL); /* C1 NEL */
    assert_int_equal(ckpt_write_i64(w, "a\xff", 1), CKPT_EINVAL);
    tu_assert_errmsg_has("UTF-8");
    assert_int_equal(ckpt_write_i64(w, "\xc0\xaf", 1), CKPT_EINVAL);     /* overlong */
    assert_int_equal(ckpt_write_i64(w, "\xed\xa0\x80", 1), CKPT_EINVAL); /* surrogate */
    assert_int_equal(ckpt_write_i64(w, "\xe2\x82", 1), CKPT_EINVAL);     /* truncated */
    assert_int_equal(ckpt_write_i64(w, "__metadata__", 1), CKPT_EINVAL);
    tu_assert_errmsg_has("reserved");
    int64_t s[] = {1};
    float x = 1;
    assert_int_equal(ckpt_write_tensor(w, "__metadata__", CKPT_F32, 1, s, &x), CKPT_EINVAL);
    assert_int_equal(ckpt_write_str(w, "s", "bad \xff utf8"), CKPT_EINVAL);
    assert_int_equal(ckpt_write_str(w, "s", NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_write_bytes(w, "b", NULL, 3), CKPT_EINVAL);
    assert_int_equal(ckpt_write_tensor(w, "t", CKPT_F32, 1, s, NULL), CKPT_EINVAL);
    tu_assert_errmsg_has("data is NULL");
    assert_int_equal(ckpt_write_tensor(w, "t", CKPT_DTYPE_INVALID, 1, s, &x), CKPT_EINVAL);
    int64_t neg[] = {-2};
    assert_int_equal(ckpt_write_tensor(w, "t", CKPT_F32, 1, neg, &x), CKPT_EINVAL);
    assert_int_equal(ckpt_writer_count(w), 1); /* only the 1024-byte key got in */
    assert_int_equal(ckpt_write_i64(NULL, "k", 1), CKPT_EINVAL);
    ckpt_writer_free(w);
}

static void test_writer_rejects_duplicate_keys_across_kinds(void **state) {
    (void)state;
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    int64_t s[] = {1};
    float x = 1;
    assert_int_equal(ckpt_write_tensor(w, "a", CKPT_F32, 1, s, &x), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "a", 1), CKPT_EEXIST);
    tu_assert_errmsg_has("'a'");
    assert_int_equal(ckpt_write_f64(w, "a", 1), CKPT_EEXIST);
    assert_int_equal(ckpt_write_str(w, "a", "x"), CKPT_EEXIST);
    assert_int_equal(ckpt_write_bytes(w, "a", "x", 1), CKPT_EEXIST);
    assert_int_equal(ckpt_write_tensor(w, "a", CKPT_F32, 1, s, &x), CKPT_EEXIST);
    assert_int_equal(ckpt_write_str(w, "b", "x"), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "b", CKPT_F32, 1, s, &x), CKPT_EEXIST);
    /* many keys: the index grows and still finds every duplicate */
    char key[32];
    for (int i = 0; i < 2000; i++) {
        snprintf(key, sizeof key, "k%d", i);
        assert_int_equal(ckpt_write_i64(w, key, i), CKPT_OK);
    }
    for (int i = 0; i < 2000; i += 97) {
        snprintf(key, sizeof key, "k%d", i);
        assert_int_equal(ckpt_write_f64(w, key, i), CKPT_EEXIST);
    }
    assert_int_equal(ckpt_writer_count(w), 2002);
    ckpt_writer_free(w);
}

/* ---- typed reads -------------------------------------------------------- */

static void write_small(const char *path) {
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    float x[6] = {1, 2, 3, 4, 5, 6};
    int64_t s[] = {2, 3};
    assert_int_equal(ckpt_write_tensor(w, "w", CKPT_F32, 2, s, x), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "step", 12), CKPT_OK);
    assert_int_equal(ckpt_write_f64(w, "lr", 0.001), CKPT_OK);
    assert_int_equal(ckpt_write_str(w, "name", "abc"), CKPT_OK);
    assert_int_equal(ckpt_write_bytes(w, "blob", "\x00\x01\x02\x03", 4), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
}

static void test_read_tensor_rejects_dtype_and_shape_mismatch(void **state) {
    fx *f = *state;
    write_small(f->path);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    float y[6];
    int64_t ok[] = {2, 3}, t[] = {3, 2}, l[] = {6};
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 2, ok, y), CKPT_OK);
    assert_true(y[5] == 6.0f);
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 2, t, y), CKPT_EMISMATCH);
    tu_assert_errmsg_has("key 'w': shape [2,3] in file, [3,2] asked");
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 1, l, y), CKPT_EMISMATCH);
    tu_assert_errmsg_has("[2,3] in file, [6] asked");
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_I32, 2, ok, y), CKPT_EMISMATCH);
    tu_assert_errmsg_has("dtype F32 in file, I32 asked");
    assert_int_equal(ckpt_read_tensor(r, "nope", CKPT_F32, 2, ok, y), CKPT_ENOENT);
    tu_assert_errmsg_has("'nope'");
    assert_int_equal(ckpt_read_tensor(r, "step", CKPT_I64, 0, NULL, y), CKPT_ENOENT);
    tu_assert_errmsg_has("not a tensor");
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 2, ok, NULL), CKPT_EINVAL);
    ckpt_reader_free(r);
}

static void test_scalar_reads_check_kind_and_capacity(void **state) {
    fx *f = *state;
    write_small(f->path);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    int64_t i = 0;
    double d = 0;
    assert_int_equal(ckpt_read_i64(r, "step", &i), CKPT_OK);
    assert_int_equal(i, 12);
    assert_int_equal(ckpt_read_f64(r, "lr", &d), CKPT_OK);
    assert_true(d == 0.001);
    assert_int_equal(ckpt_read_i64(r, "lr", &i), CKPT_EMISMATCH);
    tu_assert_errmsg_has("key 'lr': f64 in file, i64 asked");
    assert_int_equal(ckpt_read_f64(r, "step", &d), CKPT_EMISMATCH);
    assert_int_equal(ckpt_read_i64(r, "w", &i), CKPT_EMISMATCH);
    assert_int_equal(ckpt_read_i64(r, "missing", &i), CKPT_ENOENT);
    char buf[4];
    assert_int_equal(ckpt_read_str(r, "name", buf, 3), CKPT_EINVAL); /* no room for the NUL */
    assert_int_equal(ckpt_read_str(r, "name", buf, 4), CKPT_OK);
    assert_string_equal(buf, "abc");
    uint8_t b[4];
    size_t n = 0;
    assert_int_equal(ckpt_read_bytes(r, "blob", b, 3, &n), CKPT_EINVAL);
    assert_int_equal(n, 4);
    assert_int_equal(ckpt_read_bytes(r, "blob", b, 4, &n), CKPT_OK);
    assert_memory_equal(b, "\x00\x01\x02\x03", 4);
    assert_int_equal(ckpt_read_bytes(r, "name", b, 4, &n), CKPT_EMISMATCH);
    ckpt_entry_info info;
    assert_int_equal(ckpt_reader_find(r, "blob", &info), CKPT_OK);
    assert_int_equal(info.kind, CKPT_ENTRY_BYTES);
    assert_int_equal(info.nbytes, 4);
    assert_int_equal(ckpt_reader_find(r, "absent", &info), CKPT_ENOENT);
    ckpt_reader_free(r);
}

static void test_reader_open_missing_file_is_enoent(void **state) {
    fx *f = *state;
    ckpt_reader *r = (ckpt_reader *)1;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_ENOENT);
    assert_null(r);
    tu_assert_errmsg_has("x.safetensors");
    assert_int_equal(ckpt_reader_open(&r, f->dir), CKPT_EINVAL); /* a folder */
    ckpt_reader_free(NULL);
    ckpt_writer_free(NULL);
}

/* ---- schema ------------------------------------------------------------- */

static ckpt_writer *schema_like_small(void) {
    ckpt_writer *s;
    assert_int_equal(ckpt_writer_new_schema(&s), CKPT_OK);
    int64_t sh[] = {2, 3};
    assert_int_equal(ckpt_write_tensor(s, "w", CKPT_F32, 2, sh, NULL), CKPT_OK);
    assert_int_equal(ckpt_write_i64(s, "step", 0), CKPT_OK);
    assert_int_equal(ckpt_write_f64(s, "lr", 0), CKPT_OK);
    assert_int_equal(ckpt_write_str(s, "name", ""), CKPT_OK);
    return s;
}

static void test_schema_check_reports_missing_extra_dtype_shape_kind(void **state) {
    fx *f = *state;
    write_small(f->path);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);

    ckpt_writer *s = schema_like_small();
    assert_true(ckpt__writer_is_schema(s));
    assert_int_equal(ckpt_write_bytes(s, "blob", "", 0), CKPT_OK);
    assert_int_equal(ckpt__schema_check(s, r, "opt.safetensors"), CKPT_OK);
    assert_int_equal(ckpt_writer_save(s, f->path), CKPT_EINVAL); /* schemas hold no data */
    ckpt_writer_free(s);

    s = schema_like_small(); /* no "blob": the file has an extra key */
    assert_int_equal(ckpt__schema_check(s, r, "opt.safetensors"), CKPT_EMISMATCH);
    tu_assert_errmsg_has("opt.safetensors: key 'blob' in file (bytes) but not in memory");
    assert_int_equal(ckpt_write_bytes(s, "blob", "", 0), CKPT_OK);
    assert_int_equal(ckpt_write_i64(s, "epoch", 0), CKPT_OK);
    assert_int_equal(ckpt__schema_check(s, r, "opt.safetensors"), CKPT_EMISMATCH);
    tu_assert_errmsg_has("opt.safetensors: key 'epoch' missing in file (memory has i64)");
    ckpt_writer_free(s);

    ckpt_writer *s2;
    assert_int_equal(ckpt_writer_new_schema(&s2), CKPT_OK);
    int64_t sh[] = {2, 3}, sh2[] = {3, 2};
    assert_int_equal(ckpt_write_tensor(s2, "w", CKPT_F16, 2, sh, NULL), CKPT_OK);
    assert_int_equal(ckpt__schema_check(s2, r, "m"), CKPT_EMISMATCH);
    tu_assert_errmsg_has("m: tensor 'w': dtype F32 in file, F16 in memory");
    ckpt_writer_free(s2);

    assert_int_equal(ckpt_writer_new_schema(&s2), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(s2, "w", CKPT_F32, 2, sh2, NULL), CKPT_OK);
    assert_int_equal(ckpt__schema_check(s2, r, "m"), CKPT_EMISMATCH);
    tu_assert_errmsg_has("m: tensor 'w': shape [2,3] in file, [3,2] in memory");
    ckpt_writer_free(s2);

    assert_int_equal(ckpt_writer_new_schema(&s2), CKPT_OK);
    assert_int_equal(ckpt_write_i64(s2, "w", 0), CKPT_OK);
    assert_int_equal(ckpt__schema_check(s2, r, "m"), CKPT_EMISMATCH);
    tu_assert_errmsg_has("m: key 'w': tensor F32 [2,3] in file, i64 in memory");
    ckpt_writer_free(s2);

    assert_int_equal(ckpt_writer_new_schema(&s2), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(s2, "w", CKPT_F32, 2, sh, NULL), CKPT_OK);
    assert_int_equal(ckpt_write_i64(s2, "step", 0), CKPT_OK);
    assert_int_equal(ckpt_write_i64(s2, "lr", 0), CKPT_OK); /* f64 in the file */
    assert_int_equal(ckpt__schema_check(s2, r, "m"), CKPT_EMISMATCH);
    tu_assert_errmsg_has("m: key 'lr': f64 in file, i64 in memory");
    ckpt_writer_free(s2);
    ckpt_reader_free(r);
}

/* ---- digests and plain creation ----------------------------------------- */

static void test_save_digest_matches_file_and_tensor_bytes(void **state) {
    fx *f = *state;
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    uint8_t a[40], b[16];
    fill_pattern(a, sizeof a, 1);
    fill_pattern(b, sizeof b, 2);
    int64_t sa[] = {10}, sb[] = {16};
    assert_int_equal(ckpt_write_tensor(w, "a", CKPT_F32, 1, sa, a), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "b", CKPT_U8, 1, sb, b), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "n", 1), CKPT_OK);
    ckpt_file_digest d;
    assert_int_equal(ckpt__writer_save_digest(w, f->path, &d), CKPT_OK);
    size_t len;
    uint8_t *file = (uint8_t *)tu_read_file(f->path, &len);
    assert_int_equal(d.size, len);
    assert_true(d.xxh3 == ckpt__xxh3(file, len));
    assert_int_equal(d.ntensors, 2);
    assert_string_equal(d.tensor_keys[0], "a");
    assert_string_equal(d.tensor_keys[1], "b");
    assert_int_equal(d.tensor_nbytes[0], 40);
    assert_memory_equal(file + d.tensor_offset[0], a, 40);
    assert_memory_equal(file + d.tensor_offset[1], b, 16);
    assert_true(d.tensor_xxh3[0] == ckpt__xxh3(a, 40));
    assert_true(d.tensor_xxh3[1] == ckpt__xxh3(b, 16));
    ckpt__file_digest_free(&d);
    ckpt__file_digest_free(&d); /* twice is harmless */

    /* write_new: plain creation, refuses an existing file */
    char p2[160];
    tu_path(p2, sizeof p2, f->dir, "new.safetensors");
    assert_int_equal(ckpt__writer_write_new(w, p2, &d), CKPT_OK);
    size_t len2;
    uint8_t *file2 = (uint8_t *)tu_read_file(p2, &len2);
    assert_int_equal(len2, len);
    assert_memory_equal(file2, file, len); /* same bytes as a published save */
    assert_true(d.xxh3 == ckpt__xxh3(file2, len2));
    ckpt__file_digest_free(&d);
    assert_int_equal(ckpt__writer_write_new(w, p2, NULL), CKPT_EEXIST);
    free(file);
    free(file2);
    ckpt_writer_free(w);
}

/* ---- crash safety under injected faults --------------------------------- */

static ckpt_writer *fault_writer(uint8_t *buf, size_t n) {
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    int64_t s[] = {(int64_t)n / 4};
    assert_int_equal(ckpt_write_tensor(w, "w", CKPT_F32, 1, s, buf), CKPT_OK);
    int64_t s2[] = {3};
    assert_int_equal(ckpt_write_tensor(w, "b", CKPT_U8, 1, s2, buf), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "step", 7), CKPT_OK);
    return w;
}

static void sweep_faults(fx *f, bool overwrite, int errnum, int expect) {
    uint8_t data[4096];
    fill_pattern(data, sizeof data, 9);
    ckpt_writer *w = fault_writer(data, sizeof data);
    uint8_t *old = NULL;
    size_t old_len = 0;
    if (overwrite) {
        ckpt_writer *w0;
        assert_int_equal(ckpt_writer_new(&w0), CKPT_OK);
        assert_int_equal(ckpt_write_str(w0, "old", "previous contents"), CKPT_OK);
        assert_int_equal(ckpt_writer_save(w0, f->path), CKPT_OK);
        ckpt_writer_free(w0);
        old = (uint8_t *)tu_read_file(f->path, &old_len);
    }
    /* Count the I/O calls a clean save makes (into a scratch path). */
    char scratch[160];
    tu_path(scratch, sizeof scratch, f->dir, "scratch.safetensors");
    ckpt__fault_arm(CKPT_FAULT_ANY, UINT64_MAX, EIO, false);
    assert_int_equal(ckpt_writer_save(w, scratch), CKPT_OK);
    uint64_t calls = ckpt__fault_count();
    ckpt__fault_disarm();
    unlink(scratch);
    assert_true(calls >= 6); /* create, write x3+, fsync, rename, dir open, dir fsync */
    const char *ops[] = {"create", "write", "fsync", "rename", "open"};
    for (uint64_t n = 1; n <= calls + 1; n++) {
        ckpt__fault_arm(CKPT_FAULT_ANY, n, errnum, false);
        int rc = ckpt_writer_save(w, f->path);
        bool fired = ckpt__fault_fired();
        ckpt__fault_disarm();
        char listing[512];
        list_dir(f->dir, listing, sizeof listing);
        if (n == calls + 1) {
            assert_false(fired);
            assert_int_equal(rc, CKPT_OK);
            assert_string_equal(listing, "x.safetensors");
            break;
        }
        assert_true(fired);
        if (rc != expect) fail_msg("fault at call %llu: got %d (%s)", (unsigned long long)n, rc, ckpt_errmsg());
        tu_assert_errmsg_has(f->path);
        bool named_op = false;
        for (size_t k = 0; k < sizeof ops / sizeof ops[0]; k++) named_op |= strstr(ckpt_errmsg(), ops[k]) != NULL;
        if (!named_op) fail_msg("message names no operation: %s", ckpt_errmsg());
        tu_assert_errmsg_has(strerror(errnum));
        if (overwrite) {
            assert_string_equal(listing, "x.safetensors");
            size_t len;
            uint8_t *now = (uint8_t *)tu_read_file(f->path, &len);
            tu_assert_bytes_equal(now, len, old, old_len);
            free(now);
        } else {
            if (listing[0]) fail_msg("fault at call %llu left: %s", (unsigned long long)n, listing);
        }
    }
    /* and the final save is complete and readable */
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    int64_t step = 0;
    assert_int_equal(ckpt_read_i64(r, "step", &step), CKPT_OK);
    assert_int_equal(step, 7);
    ckpt_reader_free(r);
    free(old);
    ckpt_writer_free(w);
}

static void test_save_fault_sweep_enospc_new_file(void **state) {
    sweep_faults(*state, false, ENOSPC, CKPT_ENOSPC);
}
static void test_save_fault_sweep_eio_new_file(void **state) {
    sweep_faults(*state, false, EIO, CKPT_EIO);
}
static void test_save_fault_sweep_enospc_keeps_previous_file(void **state) {
    sweep_faults(*state, true, ENOSPC, CKPT_ENOSPC);
}
static void test_save_fault_sweep_eio_keeps_previous_file(void **state) {
    sweep_faults(*state, true, EIO, CKPT_EIO);
}

static void test_save_survives_short_writes_and_eintr(void **state) {
    fx *f = *state;
    uint8_t data[1000];
    fill_pattern(data, sizeof data, 3);
    ckpt_writer *w = fault_writer(data, sizeof data);
    ckpt__fault_set_max_write(7);
    ckpt__fault_arm(CKPT_FAULT_WRITE, 2, EINTR, false);
    int rc = ckpt_writer_save(w, f->path);
    bool fired = ckpt__fault_fired();
    ckpt__fault_disarm();
    ckpt__fault_set_max_write(0);
    assert_int_equal(rc, CKPT_OK);
    assert_true(fired);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    uint8_t back[1000];
    int64_t s[] = {250};
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 1, s, back), CKPT_OK);
    assert_memory_equal(back, data, sizeof data);
    ckpt_reader_free(r);
    ckpt_writer_free(w);
}

static void test_write_new_fault_leaves_no_file(void **state) {
    fx *f = *state;
    uint8_t data[64] = {0};
    ckpt_writer *w = fault_writer(data, sizeof data);
    for (uint64_t n = 1; n <= 5; n++) {
        ckpt__fault_arm(CKPT_FAULT_ANY, n, ENOSPC, false);
        int rc = ckpt__writer_write_new(w, f->path, NULL);
        ckpt__fault_disarm();
        assert_int_equal(rc, CKPT_ENOSPC);
        assert_false(tu_exists(f->path));
    }
    ckpt_writer_free(w);
}

static void test_read_fault_is_reported(void **state) {
    fx *f = *state;
    write_small(f->path);
    ckpt__fault_arm(CKPT_FAULT_READ, 1, EIO, false);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_EIO);
    tu_assert_errmsg_has("read");
    ckpt__fault_disarm();
    assert_int_equal(ckpt_reader_open(&r, f->path), CKPT_OK);
    ckpt__fault_arm(CKPT_FAULT_READ, 1, EIO, false);
    float y[6];
    int64_t s[] = {2, 3};
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 2, s, y), CKPT_EIO);
    tu_assert_errmsg_has("tensor 'w'");
    ckpt__fault_disarm();
    assert_int_equal(ckpt_read_tensor(r, "w", CKPT_F32, 2, s, y), CKPT_OK);
    ckpt_reader_free(r);
}

/* ---- allocation failures ------------------------------------------------ */

/* A whole write-save-open-read cycle; returns the first failure. */
static int alloc_scenario(const char *path) {
    int rc;
    ckpt_writer *w = NULL, *s = NULL;
    ckpt_reader *r = NULL;
    float x[4] = {1, 2, 3, 4};
    int64_t sh[] = {4};
    ckpt_file_digest d;
    memset(&d, 0, sizeof d);
    unlink(path);
    if ((rc = ckpt_writer_new(&w))) goto out;
    if ((rc = ckpt_write_tensor(w, "x", CKPT_F32, 1, sh, x))) goto out;
    if ((rc = ckpt_write_i64(w, "i", 1))) goto out;
    if ((rc = ckpt_write_f64(w, "f", 0.5))) goto out;
    if ((rc = ckpt_write_str(w, "s", "str"))) goto out;
    if ((rc = ckpt_write_bytes(w, "b", "\x01\x02", 2))) goto out;
    for (int i = 0; i < 20; i++) { /* forces the key index and entry array to grow */
        char k[16];
        snprintf(k, sizeof k, "k%d", i);
        if ((rc = ckpt_write_i64(w, k, i))) goto out;
    }
    if ((rc = ckpt__writer_save_digest(w, path, &d))) goto out;
    if ((rc = ckpt_reader_open(&r, path))) goto out;
    if ((rc = ckpt_writer_new_schema(&s))) goto out;
    if ((rc = ckpt_write_tensor(s, "x", CKPT_F32, 1, sh, NULL))) goto out;
    if ((rc = ckpt__schema_check(s, r, "alloc"))) {
        if (rc == CKPT_EMISMATCH) rc = CKPT_OK; /* expected: the schema lacks keys */
        else goto out;
    }
    float y[4];
    if ((rc = ckpt_read_tensor(r, "x", CKPT_F32, 1, sh, y))) goto out;
    uint8_t b[2];
    size_t n;
    if ((rc = ckpt_read_bytes(r, "b", b, 2, &n))) goto out;
out:
    ckpt__file_digest_free(&d);
    ckpt_reader_free(r);
    ckpt_writer_free(s);
    ckpt_writer_free(w);
    return rc;
}

static void test_allocation_failure_sweep_is_clean_enomem(void **state) {
    fx *f = *state;
    uint64_t n = 1;
    for (;; n++) {
        ckpt__alloc_fail_after(n);
        int rc = alloc_scenario(f->path);
        ckpt__alloc_fail_after(0);
        if (rc == CKPT_OK) break;
        if (rc != CKPT_ENOMEM) fail_msg("allocation %llu: got %d (%s)", (unsigned long long)n, rc, ckpt_errmsg());
        /* a failed save leaves no temporary file behind */
        char listing[512];
        list_dir(f->dir, listing, sizeof listing);
        if (listing[0] && strcmp(listing, "x.safetensors") != 0) fail_msg("left: %s", listing);
        assert_true(n < 10000);
    }
    assert_true(n > 10); /* the sweep did cover the allocations */
}

/* ---- hostile metadata documents ----------------------------------------- */

/* Builds a file in memory with one U8 tensor and the given "ckpt" text. */
static uint8_t *file_with_doc(const char *doc, size_t *len) {
    char *hdr = NULL;
    json_t *root = json_object();
    json_t *meta = json_object();
    json_object_set_new(meta, "format", json_string("pt"));
    if (doc) json_object_set_new(meta, "ckpt", json_string(doc));
    json_object_set_new(root, "__metadata__", meta);
    json_t *t = json_pack("{s:s,s:[i],s:[i,i]}", "dtype", "U8", "shape", 2, "data_offsets", 0, 2);
    json_object_set_new(root, "t", t);
    hdr = json_dumps(root, JSON_COMPACT);
    json_decref(root);
    size_t n = strlen(hdr);
    uint8_t *buf = malloc(8 + n + 2);
    for (int i = 0; i < 8; i++) buf[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(buf + 8, hdr, n);
    buf[8 + n] = 7;
    buf[9 + n] = 9;
    free(hdr);
    *len = 8 + n + 2;
    return buf;
}

static void expect_doc(const char *doc, int code, const char *needle) {
    size_t len;
    uint8_t *buf = file_with_doc(doc, &len);
    ckpt_reader *r = NULL;
    int rc = ckpt_reader_open_memory(&r, buf, len, "doc.safetensors");
    if (rc != code) fail_msg("doc %s: got %d (%s), expected %d", doc ? doc : "(none)", rc, ckpt_errmsg(), code);
    if (needle) tu_assert_errmsg_has(needle);
    ckpt_reader_free(r);
    free(buf);
}

static void test_reader_rejects_hostile_metadata_documents(void **state) {
    (void)state;
    expect_doc(NULL, CKPT_OK, NULL); /* a file from another tool: tensors only */
    expect_doc("{\"version\":1,\"entries\":[]}", CKPT_OK, NULL);
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"f64\",\"value\":2}]}", CKPT_OK, NULL);
    expect_doc("{\"version\":2,\"entries\":[]}", CKPT_OK, NULL);
    expect_doc("{\"version\":3,\"entries\":[]}", CKPT_EUNSUPPORTED, "version 3 is newer");
    /* u64: a decimal string, every 64-bit value and nothing else */
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":"
               "\"18446744073709551615\"}]}",
               CKPT_OK, NULL);
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":\"0\"}]}",
               CKPT_OK, NULL);
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":"
               "\"18446744073709551616\"}]}",
               CKPT_ECORRUPT, "below 2^64");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":"
               "\"99999999999999999999\"}]}",
               CKPT_ECORRUPT, "u64 value");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":\"007\"}]}",
               CKPT_ECORRUPT, "leading zero");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":\"-1\"}]}",
               CKPT_ECORRUPT, "u64 value");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":\"\"}]}",
               CKPT_ECORRUPT, "u64 value");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"u64\",\"value\":7}]}",
               CKPT_ECORRUPT, "u64 value");
    /* alias: the name of a tensor, never itself, never a scalar */
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"alias\",\"value\":\"t\"}]}",
               CKPT_OK, NULL);
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"alias\",\"value\":\"a\"}]}",
               CKPT_ECORRUPT, "an alias of itself");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"alias\",\"value\":3}]}",
               CKPT_ECORRUPT, "not a valid tensor name");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"a\",\"type\":\"alias\",\"value\":\"\"}]}",
               CKPT_ECORRUPT, "not a valid tensor name");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"n\",\"type\":\"i64\",\"value\":1},{\"key\":"
               "\"a\",\"type\":\"alias\",\"value\":\"n\"}]}",
               CKPT_ECORRUPT, "not a tensor");
    expect_doc("{\"version\":2,\"entries\":[{\"key\":\"t\",\"type\":\"alias\",\"value\":\"x\"}]}",
               CKPT_ECORRUPT, "duplicate key 't'");
    expect_doc("{\"version\":0,\"entries\":[]}", CKPT_ECORRUPT, "version");
    expect_doc("{\"version\":\"1\",\"entries\":[]}", CKPT_ECORRUPT, "version");
    expect_doc("{\"entries\":[]}", CKPT_ECORRUPT, "version is missing");
    expect_doc("{\"version\":1}", CKPT_ECORRUPT, "entries is missing");
    expect_doc("{\"version\":1,\"entries\":{}}", CKPT_ECORRUPT, "not an array");
    expect_doc("{\"version\":1,\"entries\":[],\"x\":1}", CKPT_ECORRUPT, "unknown field 'x'");
    expect_doc("not json", CKPT_ECORRUPT, "not valid JSON");
    expect_doc("[1]", CKPT_ECORRUPT, "not a JSON object");
    expect_doc("{\"version\":1,\"version\":1,\"entries\":[]}", CKPT_ECORRUPT, "duplicate");
    expect_doc("{\"version\":1,\"entries\":[1]}", CKPT_ECORRUPT, "entries[0] is not an object");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"i64\"}]}", CKPT_ECORRUPT, "value is missing");
    expect_doc("{\"version\":1,\"entries\":[{\"type\":\"i64\",\"value\":1}]}", CKPT_ECORRUPT, "key is missing");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"value\":1}]}", CKPT_ECORRUPT, "type is missing");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"i64\",\"value\":1,\"z\":0}]}", CKPT_ECORRUPT, "unknown field 'z'");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"i32\",\"value\":1}]}", CKPT_ECORRUPT, "unknown type 'i32'");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"i64\",\"value\":1.5}]}", CKPT_ECORRUPT, "not an integer");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"f64\",\"value\":\"NaN!\"}]}", CKPT_ECORRUPT, "not a number");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"f64\",\"value\":null}]}", CKPT_ECORRUPT, "not a number");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"str\",\"value\":3}]}", CKPT_ECORRUPT, "not a string");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"bytes\",\"value\":\"abc\"}]}", CKPT_ECORRUPT, "base64");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"bytes\",\"value\":\"ab!=\"}]}", CKPT_ECORRUPT, "invalid character");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"bytes\",\"value\":\"AB==\"}]}", CKPT_ECORRUPT, "unused bits");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"bytes\",\"value\":\"AQ==\"}]}", CKPT_OK, NULL);
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"t\",\"type\":\"i64\",\"value\":1}]}", CKPT_ECORRUPT, "duplicate key 't'");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\",\"type\":\"i64\",\"value\":1},{\"key\":\"a\",\"type\":\"str\",\"value\":\"\"}]}", CKPT_ECORRUPT, "duplicate key 'a'");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"\",\"type\":\"i64\",\"value\":1}]}", CKPT_ECORRUPT, "invalid key");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"__metadata__\",\"type\":\"i64\",\"value\":1}]}", CKPT_ECORRUPT, "invalid key");
    expect_doc("{\"version\":1,\"entries\":[{\"key\":\"a\\u0001\",\"type\":\"i64\",\"value\":1}]}", CKPT_ECORRUPT, "invalid key");
}

static void test_memory_reader_uses_given_name_in_messages(void **state) {
    (void)state;
    uint8_t junk[4] = {1, 2, 3, 4};
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open_memory(&r, junk, 4, "given-name"), CKPT_ECORRUPT);
    tu_assert_errmsg_has("given-name: file is shorter than 8 bytes");
    size_t len;
    uint8_t *buf = file_with_doc(NULL, &len);
    assert_int_equal(ckpt_reader_open_memory(&r, buf, len, "a"), CKPT_OK);
    ckpt__reader_set_name(r, "renamed.safetensors");
    int64_t v;
    assert_int_equal(ckpt_read_i64(r, "zz", &v), CKPT_ENOENT);
    tu_assert_errmsg_has("renamed.safetensors: no key 'zz'");
    const void *view;
    ckpt_entry_info info;
    assert_int_equal(ckpt_reader_tensor_view(r, "t", &view, &info), CKPT_OK);
    assert_ptr_equal(view, buf + len - 2); /* zero copy */
    ckpt_reader_free(r);
    free(buf);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_dtype_names_round_trip),
        cmocka_unit_test(test_tensor_nbytes_checks_overflow_and_sub_byte),
        cmocka_unit_test_setup_teardown(test_round_trip_every_dtype, setup, teardown),
        cmocka_unit_test_setup_teardown(test_round_trip_scalars_and_zero_sized_tensors, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_round_trip_i64_f64_str_bytes_exactly, setup, teardown),
        cmocka_unit_test_setup_teardown(test_round_trip_u64_exactly, setup, teardown),
        cmocka_unit_test_setup_teardown(test_entries_listed_in_file_order, setup, teardown),
        cmocka_unit_test(test_writer_rejects_malformed_keys),
        cmocka_unit_test(test_writer_rejects_duplicate_keys_across_kinds),
        cmocka_unit_test_setup_teardown(test_read_tensor_rejects_dtype_and_shape_mismatch, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_scalar_reads_check_kind_and_capacity, setup, teardown),
        cmocka_unit_test_setup_teardown(test_reader_open_missing_file_is_enoent, setup, teardown),
        cmocka_unit_test_setup_teardown(test_schema_check_reports_missing_extra_dtype_shape_kind,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_digest_matches_file_and_tensor_bytes, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_save_fault_sweep_enospc_new_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_fault_sweep_eio_new_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_save_fault_sweep_enospc_keeps_previous_file, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_save_fault_sweep_eio_keeps_previous_file, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_save_survives_short_writes_and_eintr, setup, teardown),
        cmocka_unit_test_setup_teardown(test_write_new_fault_leaves_no_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_read_fault_is_reported, setup, teardown),
        cmocka_unit_test_setup_teardown(test_allocation_failure_sweep_is_clean_enomem, setup,
                                        teardown),
        cmocka_unit_test(test_reader_rejects_hostile_metadata_documents),
        cmocka_unit_test(test_memory_reader_uses_given_name_in_messages),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
