/* test_hashread.c — a byte range read on two threads and hashed in order on
 * one (src/base/hashread.c): the digest is XXH3-64 of the bytes in file
 * order and the destination holds exactly them, with and without the helper
 * thread, into the caller's memory and through a ring, for ranges shorter
 * than a piece, of whole pieces and ragged; a file that ends early and a
 * failing read are reported at the first failing offset in file order, and
 * nothing lands after the call returns. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "base/hashread.h"
#include "base/io.h"
#include "base/xxh.h"
#include "testing/testing.h"
#include "helpers/testutil.h"

#define SIZE ((size_t)(9u << 20) + 12345u) /* 9 MiB and a ragged tail */

typedef struct fixture {
    char dir[512], path[600];
    uint8_t *data;
    int fd;
} fixture;

static int setup(void **state) {
    fixture *f = calloc(1, sizeof *f);
    if (!f) return -1;
    if (tu_tmpdir_make(f->dir, sizeof f->dir, "hashread") != 0) return -1;
    snprintf(f->path, sizeof f->path, "%s/f.bin", f->dir);
    f->data = malloc(SIZE);
    uint64_t x = 0x9E3779B97F4A7C15ull;
    for (size_t i = 0; i < SIZE; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17;
        f->data[i] = (uint8_t)x;
    }
    FILE *fp = fopen(f->path, "wb");
    if (!fp || fwrite(f->data, 1, SIZE, fp) != SIZE) return -1;
    fclose(fp);
    f->fd = open(f->path, O_RDONLY);
    *state = f;
    return f->fd < 0 ? -1 : 0;
}

static int teardown(void **state) {
    fixture *f = *state;
    close(f->fd);
    ckpt__hashread_set_helpers(1);
    tu_tmpdir_remove(f->dir);
    free(f->data);
    free(f);
    return 0;
}

/* The helper kept across calls (NULL: one per call), as a file reader keeps
 * it. */
static ckpt__hashread_helper *kept;
static ckpt__hashread_helper **kept_slot;

static uint64_t digest_of(const uint8_t *p, size_t n) { return XXH3_64bits(p, n); }

/* One range through both modes; the digest and the bytes must be the file's. */
static void check_range(fixture *f, uint64_t off, uint64_t n) {
    XXH3_state_t *h = XXH3_createState();
    uint8_t *dst = malloc(n ? n : 1), *ring = malloc(CKPT_HASHREAD_RING);
    ckpt__hashread_fail why;
    memset(dst, 0xAB, n ? n : 1);
    XXH3_64bits_reset(h);
    assert_int_equal(ckpt__hashread(kept_slot, f->fd, off, n, dst, NULL, h, &why), 0);
    assert_true(XXH3_64bits_digest(h) == digest_of(f->data + off, n));
    assert_memory_equal(dst, f->data + off, n);
    XXH3_64bits_reset(h);
    assert_int_equal(ckpt__hashread(kept_slot, f->fd, off, n, NULL, ring, h, &why), 0);
    assert_true(XXH3_64bits_digest(h) == digest_of(f->data + off, n));
    free(dst);
    free(ring);
    XXH3_freeState(h);
}

static void ranges(fixture *f) {
    const uint64_t P = CKPT_HASHREAD_PIECE;
    check_range(f, 0, 0);
    check_range(f, 0, 1);
    check_range(f, 7, P - 3);
    check_range(f, 0, 3 * P);
    check_range(f, 0, SIZE);           /* past the ring many times over */
    check_range(f, 4097, SIZE - 4097); /* nothing aligned */
    check_range(f, 0, CKPT_HASHREAD_MIN - 1);
    check_range(f, 1, CKPT_HASHREAD_MIN);
}

static void test_ranges_helper(void **state) {
    ckpt__hashread_set_helpers(1);
    ranges(*state);
}

static void test_ranges_alone(void **state) {
    ckpt__hashread_set_helpers(0);
    ranges(*state);
}

/* A range past the end: the failure is at the file's end, the first
 * offset that could not be read, whichever thread met it. */
static void ends_early(fixture *f) {
    XXH3_state_t *h = XXH3_createState();
    uint8_t *dst = malloc(SIZE);
    ckpt__hashread_fail why = {-1, 0};
    XXH3_64bits_reset(h);
    assert_int_equal(ckpt__hashread(kept_slot, f->fd, 1000, SIZE, dst, NULL, h, &why), -1);
    assert_int_equal(why.err, 0);
    assert_true(why.at == SIZE);
    free(dst);
    XXH3_freeState(h);
}

static void test_ends_early(void **state) {
    ckpt__hashread_set_helpers(1);
    ends_early(*state);
    ckpt__hashread_set_helpers(0);
    ends_early(*state);
}

/* The same through one helper kept across the calls (a reader's), which
 * then stops cleanly. */
static void test_ranges_kept_helper(void **state) {
    ckpt__hashread_set_helpers(1);
    kept_slot = &kept;
    ranges(*state);
    ends_early(*state);
    ranges(*state);
    assert_non_null(kept);
    ckpt__hashread_helper_free(kept);
    kept = NULL;
    kept_slot = NULL;
}

/* The n-th read fails with EIO, for every n up to the number of reads: the
 * error comes back (never a digest), with the errno, whichever thread read. */
static void test_read_fails(void **state) {
    fixture *f = *state;
    XXH3_state_t *h = XXH3_createState();
    uint8_t *dst = malloc(SIZE), *ring = malloc(CKPT_HASHREAD_RING);
    for (int helpers = 0; helpers <= 1; helpers++) {
        ckpt__hashread_set_helpers(helpers);
        uint64_t reads = (SIZE + CKPT_HASHREAD_PIECE - 1) / CKPT_HASHREAD_PIECE;
        for (uint64_t n = 1; n <= reads; n += 5) {
            ckpt__hashread_fail why = {0, 0};
            XXH3_64bits_reset(h);
            ckpt__fault_arm(CKPT_FAULT_READ, n, EIO, false);
            int rc = ckpt__hashread(kept_slot, f->fd, 0, SIZE, n % 2 ? dst : NULL,
                                    n % 2 ? NULL : ring, h, &why);
            bool fired = ckpt__fault_fired();
            ckpt__fault_disarm();
            assert_true(fired);
            assert_int_equal(rc, -1);
            assert_int_equal(why.err, EIO);
            assert_true(why.at % CKPT_HASHREAD_PIECE == 0 && why.at < SIZE);
        }
    }
    free(dst);
    free(ring);
    XXH3_freeState(h);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_ranges_helper, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ranges_alone, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ranges_kept_helper, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ends_early, setup, teardown),
        cmocka_unit_test_setup_teardown(test_read_fails, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
