/* test_rng.c — Philox4x32-10 known answers, the stream API, and exact
 * continuation of a generator after its state dict is saved and loaded. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ckpt.h"
#include "train/rng.h"
#include "helpers/testutil.h"

/* Saves g's state dict to a file and loads it into *to. */
static int round_trip(ckpt_rng *from, ckpt_rng *to) {
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "rng.safetensors");
    tu_save_state(ckpt_rng_ops(), from, path);
    return tu_load_state(ckpt_rng_ops(), to, path);
}

/* ---- tests --------------------------------------------------------------- */

static void test_philox_matches_random123_known_answers(void **state) {
    (void)state;
    static const uint32_t vec[3][10] = {
        {0, 0, 0, 0, 0, 0, 0x6627e8d5, 0xe169c58d, 0xbc57ac4c, 0x9b00dbd8},
        {0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0xffffffff, 0x408f276d,
         0x41c83b0e, 0xa20bc7c6, 0x6d5451fd},
        {0x243f6a88, 0x85a308d3, 0x13198a2e, 0x03707344, 0xa4093822, 0x299f31d0, 0xd16cfe09,
         0x94fdcceb, 0x5001e420, 0x24126ea1},
    };
    for (int i = 0; i < 3; i++) {
        uint32_t out[4];
        ckpt_philox4x32_10(vec[i], vec[i] + 4, out);
        for (int k = 0; k < 4; k++) assert_int_equal(out[k], vec[i][6 + k]);
    }
}

static void test_u32_stream_is_philox_of_successive_counters(void **state) {
    (void)state;
    ckpt_rng g;
    uint64_t seed = 0x0123456789abcdefULL;
    ckpt_rng_seed_stream(&g, seed, 7);
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    for (uint32_t block = 0; block < 3; block++) {
        uint32_t ctr[4] = {block, 0, 7, 0}, out[4];
        ckpt_philox4x32_10(ctr, key, out);
        for (int k = 0; k < 4; k++) assert_int_equal(ckpt_rng_u32(&g), out[k]);
    }
}

static void test_distinct_seeds_and_streams_differ(void **state) {
    (void)state;
    ckpt_rng a, b, c, d;
    ckpt_rng_seed(&a, 1);
    ckpt_rng_seed_stream(&b, 1, 1);
    ckpt_rng_seed(&c, 2);
    ckpt_rng_seed_stream(&d, 1, 0);
    int same_ab = 0, same_ac = 0;
    for (int i = 0; i < 64; i++) {
        uint32_t x = ckpt_rng_u32(&a), y = ckpt_rng_u32(&b), z = ckpt_rng_u32(&c);
        same_ab += x == y;
        same_ac += x == z;
        (void)ckpt_rng_u32(&d);
    }
    assert_true(same_ab < 2);
    assert_true(same_ac < 2);
    /* seed() is stream 0 */
    ckpt_rng_seed(&a, 1);
    ckpt_rng_seed_stream(&d, 1, 0);
    for (int i = 0; i < 16; i++) assert_int_equal(ckpt_rng_u32(&a), ckpt_rng_u32(&d));
}

static void test_uniform_is_in_unit_interval_and_covers_it(void **state) {
    (void)state;
    ckpt_rng g;
    ckpt_rng_seed(&g, 42);
    double lo = 1, hi = 0, sum = 0;
    float flo = 1, fhi = 0;
    for (int i = 0; i < 200000; i++) {
        double u = ckpt_rng_uniform(&g);
        assert_true(u >= 0.0 && u < 1.0);
        lo = u < lo ? u : lo;
        hi = u > hi ? u : hi;
        sum += u;
        float f = ckpt_rng_uniform_f32(&g);
        assert_true(f >= 0.0f && f < 1.0f);
        flo = f < flo ? f : flo;
        fhi = f > fhi ? f : fhi;
    }
    assert_true(lo < 1e-4 && hi > 1 - 1e-4);
    assert_true(flo < 1e-4f && fhi > 1 - 1e-4f);
    assert_true(sum / 200000 > 0.49 && sum / 200000 < 0.51);
}

static void test_uniform_uses_53_bits_of_u64(void **state) {
    (void)state;
    ckpt_rng a, b;
    ckpt_rng_seed(&a, 9);
    ckpt_rng_seed(&b, 9);
    for (int i = 0; i < 100; i++) {
        uint64_t x = ckpt_rng_u64(&a);
        assert_true(ckpt_rng_uniform(&b) == (double)(x >> 11) / 9007199254740992.0);
    }
}

static void test_normal_has_unit_moments_and_caches_pairs(void **state) {
    (void)state;
    ckpt_rng g;
    ckpt_rng_seed(&g, 3);
    double s = 0, s2 = 0;
    const int n = 100000;
    for (int i = 0; i < n; i++) {
        double z = ckpt_rng_normal(&g);
        s += z;
        s2 += z * z;
    }
    assert_true(s / n > -0.02 && s / n < 0.02);
    assert_true(s2 / n > 0.98 && s2 / n < 1.02);
    /* a pair costs 4 words: two uniforms of 53 bits */
    ckpt_rng_seed(&g, 3);
    (void)ckpt_rng_normal(&g);
    assert_int_equal(g.has_normal, 1);
    (void)ckpt_rng_normal(&g);
    assert_int_equal(g.has_normal, 0);
    assert_int_equal(g.pos, 4);
    assert_int_equal(g.counter[0], 1);
}

static void test_below_stays_in_range_and_is_balanced(void **state) {
    (void)state;
    ckpt_rng g;
    ckpt_rng_seed(&g, 5);
    assert_int_equal(ckpt_rng_below(&g, 0), 0);
    assert_int_equal(ckpt_rng_below(&g, 1), 0);
    int64_t count[6] = {0};
    for (int i = 0; i < 60000; i++) {
        uint64_t v = ckpt_rng_below(&g, 6);
        assert_true(v < 6);
        count[v]++;
    }
    for (int k = 0; k < 6; k++) assert_true(count[k] > 9500 && count[k] < 10500);
    uint64_t big = (UINT64_C(1) << 63) + 12345;
    for (int i = 0; i < 1000; i++) assert_true(ckpt_rng_below(&g, big) < big);
}

/* Draws a mixed sequence and returns a digest of everything drawn. */
static void draw_mixed(ckpt_rng *g, double *out, int n) {
    for (int i = 0; i < n; i++) {
        switch (i % 5) {
        case 0: out[i] = ckpt_rng_u32(g); break;
        case 1: out[i] = ckpt_rng_uniform(g); break;
        case 2: out[i] = ckpt_rng_normal(g); break;
        case 3: out[i] = (double)ckpt_rng_below(g, 1000003); break;
        default: out[i] = ckpt_rng_uniform_f32(g); break;
        }
    }
}

static void test_stream_continues_identically_after_state_dict_round_trip(void **state) {
    (void)state;
    /* Every position in a block (0..4 words used), and with a cached normal. */
    for (int skip = 0; skip <= 9; skip++) {
        for (int cached = 0; cached <= 1; cached++) {
            ckpt_rng g, h;
            ckpt_rng_seed_stream(&g, 1234 + (uint64_t)skip, 99);
            for (int i = 0; i < skip; i++) (void)ckpt_rng_u32(&g);
            if (cached) {
                (void)ckpt_rng_normal(&g);
                assert_int_equal(g.has_normal, 1);
            }
            ckpt_rng_seed(&h, 777); /* something else entirely */
            (void)ckpt_rng_normal(&h);
            (void)ckpt_rng_u32(&h);
            assert_int_equal(round_trip(&g, &h), CKPT_OK);
            double a[64], b[64];
            draw_mixed(&g, a, 64);
            draw_mixed(&h, b, 64);
            assert_memory_equal(a, b, sizeof a);
        }
    }
}

/* Writes a generator state dict with pos, has_normal and normal as given. */
static void write_state(const char *path, const ckpt_rng *src, int64_t pos, int64_t has_normal,
                        double normal) {
    ckpt_writer *w;
    const int64_t two = 2, four = 4;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "key", CKPT_U32, 1, &two, src->key), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "counter", CKPT_U32, 1, &four, src->counter), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "block", CKPT_U32, 1, &four, src->block), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "pos", pos), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "has_normal", has_normal), CKPT_OK);
    assert_int_equal(ckpt_write_f64(w, "normal", normal), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
}

static void test_load_rejects_bad_position_and_changes_nothing(void **state) {
    (void)state;
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "bad.safetensors");
    ckpt_rng src;
    ckpt_rng_seed(&src, 1);
    write_state(path, &src, 7, 0, 0.0);
    ckpt_rng g, before;
    ckpt_rng_seed(&g, 55);
    (void)ckpt_rng_u32(&g);
    before = g;
    tu_expect_error(tu_load_state(ckpt_rng_ops(), &g, path), CKPT_ECORRUPT, "pos");
    assert_memory_equal(&g, &before, sizeof g);
}

/* check_state_dict refuses what load_state_dict refuses (same code, same
 * message) and never changes the generator, not even for a good state. */
static void test_check_state_dict_refuses_what_load_refuses_and_changes_nothing(void **state) {
    (void)state;
    const ckpt_stateful_ops *ops = ckpt_rng_ops();
    assert_non_null(ops->check_state_dict);
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "check.safetensors");
    ckpt_rng src;
    ckpt_rng_seed(&src, 1);
    (void)ckpt_rng_u32(&src);
    static const struct {
        int64_t pos, has_normal;
        int code;
        const char *needle;
    } cases[] = {
        {7, 0, CKPT_ECORRUPT, "rng: pos: expected 0..4, got 7"},
        {-1, 0, CKPT_ECORRUPT, "rng: pos: expected 0..4, got -1"},
        {2, 2, CKPT_ECORRUPT, "rng: has_normal: expected 0 or 1, got 2"},
        {2, 1, CKPT_OK, ""},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        write_state(path, &src, cases[i].pos, cases[i].has_normal, 0.25);
        ckpt_rng g, before;
        ckpt_rng_seed(&g, 55);
        (void)ckpt_rng_normal(&g);
        before = g;
        ckpt_reader *r;
        assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
        char msg[256];
        tu_check_state(ops, &g, r, cases[i].code, cases[i].needle, i, msg, sizeof msg);
        assert_memory_equal(&g, &before, sizeof g);
        tu_load_state_like_check(ops, &g, r, cases[i].code, msg);
        if (cases[i].code != CKPT_OK) {
            assert_memory_equal(&g, &before, sizeof g);
        } else {
            assert_memory_equal(g.key, src.key, sizeof g.key);
            assert_int_equal(g.pos, 2);
            assert_int_equal(g.has_normal, 1);
        }
        ckpt_reader_free(r);
    }
}

static void test_state_dict_has_exactly_the_documented_keys(void **state) {
    (void)state;
    ckpt_rng g;
    ckpt_rng_seed(&g, 1);
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new_schema(&w), CKPT_OK);
    assert_int_equal(ckpt_rng_ops()->state_dict(&g, w), CKPT_OK);
    static const char *keys[] = {"key", "counter", "block", "pos", "has_normal", "normal"};
    assert_int_equal(ckpt_writer_entry_count(w), 6);
    for (int i = 0; i < 6; i++) {
        ckpt_entry_info e;
        assert_int_equal(ckpt_writer_entry(w, i, &e), CKPT_OK);
        assert_string_equal(e.key, keys[i]);
    }
    ckpt_writer_free(w);
}

/* Another process count: rank 0 continues exactly; rank r draws what stream
 * r of rank 0's key gives from rank 0's block position, different from
 * every other rank's draws and from rank 0's own. */
static void test_reshard_derivation(void **state) {
    (void)state;
    ckpt_rng g0, g0b;
    ckpt_rng_seed_stream(&g0, 1234, 0);
    for (int i = 0; i < 13; i++) (void)ckpt_rng_u32(&g0);
    (void)ckpt_rng_normal(&g0);
    g0b = g0;
    ckpt_rng out[3];
    for (int r = 0; r < 3; r++) ckpt__rng_reshard(&g0, r, &out[r]);
    assert_memory_equal(&out[0], &g0, sizeof g0);
    assert_true(ckpt_rng_normal(&out[0]) == ckpt_rng_normal(&g0b));
    /* Rank 2 = a fresh stream 2 moved to rank 0's block. */
    ckpt_rng want;
    ckpt_rng_seed_stream(&want, 1234, 2);
    want.counter[0] = g0.counter[0];
    want.counter[1] = g0.counter[1];
    for (int i = 0; i < 8; i++) assert_int_equal(ckpt_rng_u32(&out[2]), ckpt_rng_u32(&want));
    uint32_t a = ckpt_rng_u32(&out[1]), b = ckpt_rng_u32(&g0b);
    assert_true(a != b);
    /* The same through the stateful object a load uses. */
    char *path = tu_pathf("%s/rs0.safetensors", tu_dir());
    tu_save_state(ckpt_rng_ops(), &g0, path);
    ckpt_rng target;
    memset(&target, 0, sizeof target);
    ckpt_rng_reshard x = {&target, 1};
    assert_int_equal(tu_load_state(ckpt__rng_reshard_ops(), &x, path), CKPT_OK);
    ckpt__rng_reshard(&g0, 1, &want);
    assert_memory_equal(&target, &want, sizeof want);
    free(path);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_reshard_derivation, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test(test_philox_matches_random123_known_answers),
        cmocka_unit_test(test_u32_stream_is_philox_of_successive_counters),
        cmocka_unit_test(test_distinct_seeds_and_streams_differ),
        cmocka_unit_test(test_uniform_is_in_unit_interval_and_covers_it),
        cmocka_unit_test(test_uniform_uses_53_bits_of_u64),
        cmocka_unit_test(test_normal_has_unit_moments_and_caches_pairs),
        cmocka_unit_test(test_below_stays_in_range_and_is_balanced),
        cmocka_unit_test_setup_teardown(
            test_stream_continues_identically_after_state_dict_round_trip, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_load_rejects_bad_position_and_changes_nothing, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(
            test_check_state_dict_refuses_what_load_refuses_and_changes_nothing, tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test(test_state_dict_has_exactly_the_documented_keys),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
