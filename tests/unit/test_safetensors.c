/* test_safetensors.c — the format layer: one crafted file per rule of the
 * format, each rejected with CKPT_ECORRUPT and a message naming the rule;
 * valid edge cases accepted; the writer's layout (metadata first, padding,
 * order, alignment) checked byte by byte. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/io.h"
#include "format/safetensors.h"
#include "helpers/testutil.h"

/* A file: 8-byte little-endian length, header text, then data_len bytes
 * (value i & 0xff). */
static uint8_t *make_file(const char *header, size_t data_len, size_t *len) {
    size_t n = strlen(header);
    uint8_t *b = malloc(8 + n + data_len + 1);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)n >> (8 * i));
    memcpy(b + 8, header, n);
    for (size_t i = 0; i < data_len; i++) b[8 + n + i] = (uint8_t)i;
    *len = 8 + n + data_len;
    return b;
}

static void expect(const uint8_t *buf, size_t len, int code, const char *needle) {
    ckpt_reader *r = NULL;
    int rc = ckpt_reader_open_memory(&r, buf, len, "x.safetensors");
    tu_expect_error(rc, code, needle);
    if (code == CKPT_OK)
        assert_non_null(r);
    else
        assert_null(r);
    ckpt_reader_free(r);
}

static void expect_header(const char *header, size_t data_len, int code, const char *needle) {
    size_t len;
    uint8_t *b = make_file(header, data_len, &len);
    expect(b, len, code, needle);
    /* and through the file path (pread) as well */
    char dir[64], path[128];
    assert_int_equal(tu_tmpdir_make(dir, sizeof dir, "test_st"), 0);
    tu_write_file(tu_path(path, sizeof path, dir, "x.safetensors"), b, len);
    ckpt_reader *r = NULL;
    int rc = ckpt_reader_open(&r, path);
    tu_expect_error(rc, code, needle); /* the same through the file */
    if (code != CKPT_OK) tu_assert_errmsg_has(path);
    ckpt_reader_free(r);
    assert_int_equal(tu_tmpdir_remove(dir), 0);
    free(b);
}

#define T(name, dtype, shape, b, e) \
    "\"" name "\":{\"dtype\":\"" dtype "\",\"shape\":" shape ",\"data_offsets\":[" #b "," #e "]}"

/* ---- the prefix --------------------------------------------------------- */

static void test_rejects_file_shorter_than_8_bytes(void **state) {
    (void)state;
    uint8_t b[7] = {2, 0, 0, 0, 0, 0, 0};
    expect(b, 7, CKPT_ECORRUPT, "x.safetensors: file is shorter than 8 bytes");
    expect(b, 0, CKPT_ECORRUPT, "shorter than 8 bytes");
}

static void test_rejects_header_length_over_limit(void **state) {
    (void)state;
    uint8_t b[16] = {0};
    uint64_t n = 200000000;
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)(n >> (8 * i));
    expect(b, 16, CKPT_ECORRUPT, "header length 200000000 exceeds the 100000000-byte limit");
    memset(b, 0xff, 8); /* 2^64-1: no overflow in 8 + N either */
    expect(b, 16, CKPT_ECORRUPT, "exceeds the 100000000-byte limit");
}

static void test_rejects_header_past_end_of_file(void **state) {
    (void)state;
    uint8_t b[12] = {5, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' '};
    expect(b, 12, CKPT_ECORRUPT, "header extends past end of file");
}

/* ---- the JSON ----------------------------------------------------------- */

static void test_rejects_header_not_starting_with_brace(void **state) {
    (void)state;
    expect_header(" {}     ", 0, CKPT_ECORRUPT, "header does not start with '{'");
    expect_header("[]      ", 0, CKPT_ECORRUPT, "header does not start with '{'");
    uint8_t b[8] = {0};
    expect(b, 8, CKPT_ECORRUPT, "header does not start with '{'"); /* N = 0 */
}

static void test_rejects_invalid_json(void **state) {
    (void)state;
    expect_header("{\"a\":", 0, CKPT_ECORRUPT, "header is not valid JSON");
    expect_header("{\"a\xff\":1}", 0, CKPT_ECORRUPT, "not valid JSON"); /* not UTF-8 */
}

static void test_rejects_duplicate_keys(void **state) {
    (void)state;
    expect_header("{" T("a", "U8", "[1]", 0, 1) "," T("a", "U8", "[1]", 1, 2) "}", 2,
                  CKPT_ECORRUPT, "duplicate key");
    expect_header("{\"__metadata__\":{\"k\":\"1\",\"k\":\"2\"}}", 0, CKPT_ECORRUPT, "duplicate key");
}

static void test_rejects_padding_other_than_spaces(void **state) {
    (void)state;
    expect_header("{}     \n", 0, CKPT_ECORRUPT, "padding other than spaces");
    expect_header("{}\t      ", 0, CKPT_ECORRUPT, "padding other than spaces");
    size_t len;
    uint8_t *b = make_file("{}      ", 0, &len);
    b[8 + 3] = 0; /* a NUL in the padding */
    expect(b, len, CKPT_ECORRUPT, "padding other than spaces");
    free(b);
    expect_header("{} x", 0, CKPT_ECORRUPT, "padding other than spaces");
}

static void test_accepts_space_padding_and_unpadded_headers(void **state) {
    (void)state;
    expect_header("{}      ", 0, CKPT_OK, NULL);
    expect_header("{}", 0, CKPT_OK, NULL); /* padding is optional */
    expect_header("{" T("a", "U8", "[3]", 0, 3) "}   ", 3, CKPT_OK, NULL);
}

static void test_rejects_non_string_metadata_values(void **state) {
    (void)state;
    expect_header("{\"__metadata__\":{\"x\":1}}", 0, CKPT_ECORRUPT,
                  "__metadata__ value for 'x' is not a string");
    expect_header("{\"__metadata__\":{\"x\":null}}", 0, CKPT_ECORRUPT, "value for 'x' is not a string");
    expect_header("{\"__metadata__\":[]}", 0, CKPT_ECORRUPT, "__metadata__ is not a JSON object");
    expect_header("{\"__metadata__\":{\"format\":\"pt\",\"other\":\"anything\"}}", 0, CKPT_OK, NULL);
}

/* ---- tensor entries ----------------------------------------------------- */

static void test_rejects_unknown_dtype(void **state) {
    (void)state;
    expect_header("{" T("w", "F33", "[1]", 0, 4) "}", 4, CKPT_ECORRUPT,
                  "tensor 'w': unknown dtype 'F33'");
    expect_header("{\"w\":{\"dtype\":5,\"shape\":[1],\"data_offsets\":[0,1]}}", 1, CKPT_ECORRUPT,
                  "dtype is not a string");
}

static void test_rejects_missing_fields(void **state) {
    (void)state;
    expect_header("{\"w\":{\"shape\":[1],\"data_offsets\":[0,1]}}", 1, CKPT_ECORRUPT,
                  "tensor 'w': missing dtype");
    expect_header("{\"w\":{\"dtype\":\"U8\",\"data_offsets\":[0,1]}}", 1, CKPT_ECORRUPT,
                  "tensor 'w': missing shape");
    expect_header("{\"w\":{\"dtype\":\"U8\",\"shape\":[1]}}", 1, CKPT_ECORRUPT,
                  "tensor 'w': missing data_offsets");
    expect_header("{\"w\":[1]}", 1, CKPT_ECORRUPT, "tensor 'w': entry is not a JSON object");
}

static void test_rejects_extra_fields(void **state) {
    (void)state;
    expect_header("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1],\"stride\":[1]}}", 1,
                  CKPT_ECORRUPT, "tensor 'w': unknown field 'stride'");
}

static void test_rejects_negative_or_non_integer_shape(void **state) {
    (void)state;
    expect_header("{" T("w", "U8", "[-1]", 0, 0) "}", 0, CKPT_ECORRUPT,
                  "shape dimension 0 is not a non-negative integer");
    expect_header("{" T("w", "U8", "[2.0]", 0, 2) "}", 2, CKPT_ECORRUPT,
                  "shape dimension 0 is not a non-negative integer");
    expect_header("{" T("w", "U8", "[1,\"2\"]", 0, 2) "}", 2, CKPT_ECORRUPT, "shape dimension 1");
    expect_header("{" T("w", "U8", "7", 0, 7) "}", 7, CKPT_ECORRUPT, "shape is not an array");
    expect_header("{" T("w", "U8", "[1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1]", 0, 1) "}", 1,
                  CKPT_ECORRUPT, "17 dimensions, at most 16");
}

static void test_rejects_bad_data_offsets(void **state) {
    (void)state;
    expect_header("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0]}}", 1, CKPT_ECORRUPT,
                  "data_offsets is not a [BEGIN, END] pair");
    expect_header("{\"w\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[0,1,2]}}", 1,
                  CKPT_ECORRUPT, "not a [BEGIN, END] pair");
    expect_header("{" T("w", "U8", "[1]", -1, 0) "}", 0, CKPT_ECORRUPT,
                  "data_offsets are not non-negative integers");
    expect_header("{" T("w", "U8", "[1]", 0, 1.0) "}", 1, CKPT_ECORRUPT,
                  "data_offsets are not non-negative integers");
}

static void test_rejects_end_before_begin(void **state) {
    (void)state;
    expect_header("{" T("w", "U8", "[0]", 8, 4) "}", 8, CKPT_ECORRUPT,
                  "tensor 'w': data_offsets [8, 4]: END < BEGIN");
}

static void test_rejects_size_not_matching_shape(void **state) {
    (void)state;
    expect_header("{" T("w", "F32", "[2,2]", 0, 12) "}", 12, CKPT_ECORRUPT,
                  "tensor 'w': data_offsets [0, 12] hold 12 bytes, F32 shape [2,2] needs 16");
    expect_header("{" T("w", "F32", "[]", 0, 0) "}", 0, CKPT_ECORRUPT,
                  "hold 0 bytes, F32 shape [] needs 4"); /* a scalar is one element */
}

static void test_rejects_shape_size_overflow(void **state) {
    (void)state;
    expect_header("{" T("w", "F64", "[4611686018427387904,4]", 0, 0) "}", 0, CKPT_ECORRUPT,
                  "x element size overflows");
    expect_header("{" T("w", "U8", "[9223372036854775807,9223372036854775807]", 0, 0) "}", 0,
                  CKPT_ECORRUPT, "overflows");
    expect_header("{\"w\":{\"dtype\":\"U8\",\"shape\":[99999999999999999999],\"data_offsets\":[0,0]}}",
                  0, CKPT_ECORRUPT, "not valid JSON"); /* beyond int64: the parser refuses */
}

static void test_sub_byte_dtypes_follow_the_spec(void **state) {
    (void)state;
    expect_header("{" T("q", "F4", "[4]", 0, 2) "}", 2, CKPT_OK, NULL);
    expect_header("{" T("q", "F4", "[3]", 0, 2) "}", 2, CKPT_ECORRUPT, "not a whole number of bytes");
    expect_header("{" T("q", "F6_E2M3", "[4]", 0, 3) "}", 3, CKPT_OK, NULL);
    expect_header("{" T("q", "F6_E3M2", "[2,3]", 0, 5) "}", 5, CKPT_ECORRUPT, "whole number of bytes");
    expect_header("{" T("q", "F4", "[2,0]", 0, 0) "}", 0, CKPT_OK, NULL);
}

/* ---- layout of the data buffer ------------------------------------------ */

static void test_rejects_overlapping_tensors(void **state) {
    (void)state;
    expect_header("{" T("a", "F32", "[4]", 0, 16) "," T("w", "F32", "[3]", 8, 20) "}", 20,
                  CKPT_ECORRUPT, "tensor 'w': data_offsets [8, 20] overlap the previous tensor (ends at 16)");
    expect_header("{" T("a", "F32", "[4]", 0, 16) "," T("w", "F32", "[3]", 0, 12) "}", 16,
                  CKPT_ECORRUPT, "tensor 'a': data_offsets [0, 16] overlap the previous tensor (ends at 12)");
    expect_header("{" T("a", "U8", "[4]", 0, 4) "," T("b", "U8", "[4]", 2, 6) "}", 6,
                  CKPT_ECORRUPT, "tensor 'b': data_offsets [2, 6] overlap the previous tensor (ends at 4)");
}

static void test_rejects_holes_between_tensors(void **state) {
    (void)state;
    expect_header("{" T("a", "U8", "[4]", 0, 4) "," T("b", "U8", "[4]", 8, 12) "}", 12,
                  CKPT_ECORRUPT, "tensor 'b': data_offsets [8, 12] leave a hole after the previous tensor 'a' (ends at 4)");
    expect_header("{" T("a", "U8", "[4]", 4, 8) "}", 8, CKPT_ECORRUPT,
                  "the first tensor must begin at 0");
}

static void test_rejects_trailing_bytes(void **state) {
    (void)state;
    size_t len;
    uint8_t *b = make_file("{" T("a", "U8", "[4]", 0, 4) "}", 4 + 8, &len);
    char msg[128];
    snprintf(msg, sizeof msg, "trailing bytes: file has %zu bytes, tensors end at %zu", len, len - 8);
    expect(b, len, CKPT_ECORRUPT, msg);
    free(b);
    expect_header("{}", 1, CKPT_ECORRUPT, "trailing bytes");
}

static void test_rejects_data_past_end_of_file(void **state) {
    (void)state;
    expect_header("{" T("a", "U8", "[4]", 0, 4) "}", 3, CKPT_ECORRUPT,
                  "tensor data extends past end of file");
}

static void test_accepts_scalars_zero_sized_and_unordered_entries(void **state) {
    (void)state;
    /* entries listed out of offset order, zero-sized tensors sharing offsets */
    const char *h = "{" T("z", "F32", "[0,3]", 4, 4) "," T("s", "I32", "[]", 0, 4) ","
                    T("e", "U8", "[0]", 4, 4) "," T("t", "U8", "[2]", 4, 6) "}";
    size_t len;
    uint8_t *b = make_file(h, 6, &len);
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open_memory(&r, b, len, "ok"), CKPT_OK);
    assert_int_equal(ckpt_reader_count(r), 4);
    ckpt_entry_info info;
    assert_int_equal(ckpt_reader_entry(r, 0, &info), CKPT_OK);
    assert_string_equal(info.key, "s");
    assert_int_equal(ckpt_reader_entry(r, 3, &info), CKPT_OK);
    assert_string_equal(info.key, "t");
    assert_int_equal(info.offset, 8 + strlen(h) + 4);
    uint8_t t[2];
    int64_t s2[] = {2};
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_U8, 1, s2, t), CKPT_OK);
    assert_int_equal(t[0], 4);
    assert_int_equal(t[1], 5);
    ckpt_reader_free(r);
    free(b);
}

/* ---- the writer's layout ------------------------------------------------ */

static void test_writer_layout_metadata_first_padded_sorted_aligned(void **state) {
    (void)state;
    char dir[64], path[128];
    assert_int_equal(tu_tmpdir_make(dir, sizeof dir, "test_st"), 0);
    tu_path(path, sizeof path, dir, "l.safetensors");
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    uint8_t u8[3] = {1, 2, 3};
    uint16_t h[1] = {0x3c00};
    double d[2] = {1.5, -2};
    float fl[1] = {7};
    int64_t s3[] = {3}, s1[] = {1}, s2[] = {2};
    assert_int_equal(ckpt_write_tensor(w, "a.u8", CKPT_U8, 1, s3, u8), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "b.f16", CKPT_F16, 1, s1, h), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "c.f64", CKPT_F64, 1, s2, d), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "a.f32", CKPT_F32, 1, s1, fl), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "b.f32", CKPT_F32, 1, s1, fl), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "n", 3), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);

    size_t len;
    char *buf = tu_read_file(path, &len);
    const uint8_t *b = (const uint8_t *)buf;
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | b[i];
    assert_int_equal((8 + n) % 8, 0); /* data 8-aligned */
    assert_true(8 + n <= len);
    assert_int_equal(buf[8], '{');
    const char *first = "{\"__metadata__\":{\"format\":\"pt\",\"ckpt\":";
    assert_memory_equal(buf + 8, first, strlen(first));
    size_t end = 8 + (size_t)n;
    while (buf[end - 1] == ' ') end--;
    assert_int_equal(buf[end - 1], '}');
    assert_true(8 + n - end < 8); /* at most 7 spaces of padding */
    json_error_t err;
    json_t *root = json_loadb(buf + 8, (size_t)n, 0, &err);
    assert_non_null(root);
    /* order in the header and in the data: alignment descending, then name */
    const char *order[] = {"__metadata__", "c.f64", "a.f32", "b.f32", "b.f16", "a.u8"};
    const uint64_t begins[] = {0, 0, 16, 20, 24, 26};
    int i = 0;
    const char *k;
    json_t *v;
    json_object_foreach(root, k, v) {
        assert_true(i < 6);
        assert_string_equal(k, order[i]);
        if (i > 0) {
            json_t *offs = json_object_get(v, "data_offsets");
            assert_int_equal(json_integer_value(json_array_get(offs, 0)), begins[i]);
        }
        i++;
    }
    assert_int_equal(i, 6);
    assert_int_equal(len, 8 + n + 29);
    double d2[2];
    memcpy(d2, buf + 8 + n, 16);
    assert_true(d2[0] == 1.5 && d2[1] == -2);
    assert_memory_equal(buf + 8 + n + 26, u8, 3);
    json_t *meta = json_object_get(root, "__metadata__");
    assert_int_equal(json_object_size(meta), 2);
    assert_string_equal(json_string_value(json_object_get(meta, "format")), "pt");
    assert_string_equal(json_string_value(json_object_get(meta, "ckpt")),
                        "{\"version\":1,\"entries\":[{\"key\":\"n\",\"type\":\"i64\",\"value\":3}]}");
    json_decref(root);
    free(buf);
    assert_int_equal(tu_tmpdir_remove(dir), 0);
}

static void test_header_parser_rejects_every_truncation_of_a_valid_file(void **state) {
    (void)state;
    size_t len;
    uint8_t *b = make_file("{\"__metadata__\":{\"format\":\"pt\"}," T("a", "F32", "[2]", 0, 8) "}", 8, &len);
    expect(b, len, CKPT_OK, NULL);
    for (size_t cut = 0; cut < len; cut++) {
        ckpt_reader *r = NULL;
        int rc = ckpt_reader_open_memory(&r, b, cut, "cut");
        if (rc != CKPT_ECORRUPT) fail_msg("truncated to %zu: got %d", cut, rc);
        assert_null(r);
    }
    free(b);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_rejects_file_shorter_than_8_bytes),
        cmocka_unit_test(test_rejects_header_length_over_limit),
        cmocka_unit_test(test_rejects_header_past_end_of_file),
        cmocka_unit_test(test_rejects_header_not_starting_with_brace),
        cmocka_unit_test(test_rejects_invalid_json),
        cmocka_unit_test(test_rejects_duplicate_keys),
        cmocka_unit_test(test_rejects_padding_other_than_spaces),
        cmocka_unit_test(test_accepts_space_padding_and_unpadded_headers),
        cmocka_unit_test(test_rejects_non_string_metadata_values),
        cmocka_unit_test(test_rejects_unknown_dtype),
        cmocka_unit_test(test_rejects_missing_fields),
        cmocka_unit_test(test_rejects_extra_fields),
        cmocka_unit_test(test_rejects_negative_or_non_integer_shape),
        cmocka_unit_test(test_rejects_bad_data_offsets),
        cmocka_unit_test(test_rejects_end_before_begin),
        cmocka_unit_test(test_rejects_size_not_matching_shape),
        cmocka_unit_test(test_rejects_shape_size_overflow),
        cmocka_unit_test(test_sub_byte_dtypes_follow_the_spec),
        cmocka_unit_test(test_rejects_overlapping_tensors),
        cmocka_unit_test(test_rejects_holes_between_tensors),
        cmocka_unit_test(test_rejects_trailing_bytes),
        cmocka_unit_test(test_rejects_data_past_end_of_file),
        cmocka_unit_test(test_accepts_scalars_zero_sized_and_unordered_entries),
        cmocka_unit_test(test_writer_layout_metadata_first_padded_sorted_aligned),
        cmocka_unit_test(test_header_parser_rejects_every_truncation_of_a_valid_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
