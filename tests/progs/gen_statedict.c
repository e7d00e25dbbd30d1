/* gen_statedict.c — writes one state-dict file holding every dtype and every
 * scalar kind with known values, for checkers written independently of this
 * library (tests/python/test_safetensors_independent.py).
 *
 *   gen_statedict <out.safetensors>
 *
 * Tensor "t.<DTYPE>" has shape [3, 4] (12 elements); element i is:
 *   F64, F32, F16         i * 0.5 - 3
 *   BF16                  the upper 16 bits of the F32 value i * 0.25 - 1
 *   I64, I32, I16, I8     (i odd ? -i : i) * 3
 *   U64, U32, U16, U8     i * 5
 *   BOOL                  i % 3 == 0
 *   C64                   (i, -2i) as two F32
 *   F8_*, F4, F6_*        raw bytes: byte k = (k * 37 + 11) & 0xff
 * plus "ext.i64" = [INT64_MIN, INT64_MAX, -1, 0], "scalar.f64" (shape [])
 * = 2.5 and "empty.f32" with shape [0, 5]. Scalar entries are listed in
 * main(). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

#define N 12

static int check(int rc, const char *what) {
    if (rc != CKPT_OK) {
        fprintf(stderr, "gen_statedict: %s: %s\n", what, ckpt_errmsg());
        exit(1);
    }
    return rc;
}

static uint16_t f32_to_f16(float f) {
    /* Exact for the values used here (multiples of 0.5 in [-3, 3]). */
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    int32_t exp = (int32_t)((x >> 23) & 0xff) - 127 + 15;
    uint32_t mant = (x >> 13) & 0x3ff;
    if ((x & 0x7fffffff) == 0) return (uint16_t)sign;
    return (uint16_t)(sign | (uint32_t)exp << 10 | mant);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: gen_statedict <out.safetensors>\n");
        return 2;
    }
    ckpt_writer *w;
    check(ckpt_writer_new(&w), "writer");
    int64_t shape[2] = {3, 4};
    static double f64[N];
    static float f32[N];
    static uint16_t f16[N], bf16[N], u16[N];
    static int64_t i64[N];
    static int32_t i32[N];
    static int16_t i16[N];
    static int8_t i8[N];
    static uint64_t u64[N];
    static uint32_t u32[N];
    static uint8_t u8[N], bools[N], raw[N * 2];
    static float c64[N * 2];
    for (int i = 0; i < N; i++) {
        double v = i * 0.5 - 3;
        f64[i] = v;
        f32[i] = (float)v;
        f16[i] = f32_to_f16((float)v);
        float b = (float)(i * 0.25 - 1);
        uint32_t bits;
        memcpy(&bits, &b, 4);
        bf16[i] = (uint16_t)(bits >> 16);
        int64_t s = (i % 2 ? -i : i) * 3;
        i64[i] = s;
        i32[i] = (int32_t)s;
        i16[i] = (int16_t)s;
        i8[i] = (int8_t)s;
        u64[i] = (uint64_t)i * 5;
        u32[i] = (uint32_t)i * 5;
        u16[i] = (uint16_t)(i * 5);
        u8[i] = (uint8_t)(i * 5);
        bools[i] = i % 3 == 0;
        c64[2 * i] = (float)i;
        c64[2 * i + 1] = (float)(-2 * i);
    }
    for (int k = 0; k < N * 2; k++) raw[k] = (uint8_t)((k * 37 + 11) & 0xff);
    struct {
        ckpt_dtype dt;
        const void *p;
    } t[] = {
        {CKPT_F64, f64},         {CKPT_F32, f32},          {CKPT_F16, f16},
        {CKPT_BF16, bf16},       {CKPT_I64, i64},          {CKPT_I32, i32},
        {CKPT_I16, i16},         {CKPT_I8, i8},            {CKPT_U64, u64},
        {CKPT_U32, u32},         {CKPT_U16, u16},          {CKPT_U8, u8},
        {CKPT_BOOL, bools},      {CKPT_C64, c64},          {CKPT_F8_E5M2, raw},
        {CKPT_F8_E4M3, raw},     {CKPT_F8_E8M0, raw},      {CKPT_F8_E4M3FNUZ, raw},
        {CKPT_F8_E5M2FNUZ, raw}, {CKPT_F4, raw},           {CKPT_F6_E2M3, raw},
        {CKPT_F6_E3M2, raw},
    };
    char key[64];
    for (size_t i = 0; i < sizeof t / sizeof t[0]; i++) {
        snprintf(key, sizeof key, "t.%s", ckpt_dtype_name(t[i].dt));
        check(ckpt_write_tensor(w, key, t[i].dt, 2, shape, t[i].p), key);
    }
    static const int64_t ext[4] = {INT64_MIN, INT64_MAX, -1, 0};
    int64_t s4[1] = {4};
    check(ckpt_write_tensor(w, "ext.i64", CKPT_I64, 1, s4, ext), "ext.i64");
    double sc = 2.5;
    check(ckpt_write_tensor(w, "scalar.f64", CKPT_F64, 0, NULL, &sc), "scalar.f64");
    int64_t s05[2] = {0, 5};
    check(ckpt_write_tensor(w, "empty.f32", CKPT_F32, 2, s05, NULL), "empty.f32");

    check(ckpt_write_i64(w, "i64.min", INT64_MIN), "i64");
    check(ckpt_write_i64(w, "i64.max", INT64_MAX), "i64");
    check(ckpt_write_i64(w, "i64.step", 12), "i64");
    check(ckpt_write_f64(w, "f64.tenth", 0.1), "f64");
    check(ckpt_write_f64(w, "f64.negzero", -0.0), "f64");
    check(ckpt_write_f64(w, "f64.denorm", 5e-324), "f64");
    check(ckpt_write_f64(w, "f64.tiny", 1e-308), "f64");
    check(ckpt_write_f64(w, "f64.third", 1.0 / 3.0), "f64");
    check(ckpt_write_f64(w, "f64.one", 1.0), "f64");
    check(ckpt_write_f64(w, "f64.inf", INFINITY), "f64");
    check(ckpt_write_f64(w, "f64.neginf", -INFINITY), "f64");
    check(ckpt_write_f64(w, "f64.nan", NAN), "f64");
    check(ckpt_write_str(w, "str.empty", ""), "str");
    check(ckpt_write_str(w, "str.utf8", "h\xc3\xa9llo \xe2\x98\x83 \"quoted\" \\ tab\t"), "str");
    uint8_t all[256];
    for (int i = 0; i < 256; i++) all[i] = (uint8_t)i;
    check(ckpt_write_bytes(w, "bytes.empty", NULL, 0), "bytes");
    check(ckpt_write_bytes(w, "bytes.all", all, 256), "bytes");
    check(ckpt_writer_save(w, argv[1]), argv[1]);
    ckpt_writer_free(w);
    return 0;
}
