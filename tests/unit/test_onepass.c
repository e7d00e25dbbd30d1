/* test_onepass.c — ckpt_load_options.one_pass: the files are read straight
 * into the objects and verified on the way. A good checkpoint loads exactly
 * as the two-pass load does; a corrupted byte (in a tensor read in file
 * order, in one read out of order, in bytes no object reads) fails the load
 * with CKPT_ECORRUPT naming the file, after which saves refuse until a load
 * succeeds; the options it does not apply to fall back to the two passes.
 * With the manifest's header digests (header_xxh3) every byte is read once
 * whatever order the objects read in, a damaged header is caught when its
 * file is opened, and a tensor nobody read is checked at the end; a
 * manifest without them (older checkpoints) still loads in one pass.
 * The first load of an accelerator (the resume) is one pass by default:
 * it reads each file once where a later load reads it twice; a newest
 * checkpoint found damaged while a tensor read on two threads lands is
 * replaced by the next older one, loaded over the objects, with a warning;
 * with every checkpoint damaged the error says what the objects hold, and a
 * transactional load leaves them untouched. */
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
#include "base/io.h"
#include "format/manifest.h"
#include "helpers/testutil.h"

#define N 4096

/* A model of two parameters and a custom object whose load reads its two
 * tensors in reverse file order. */
typedef struct rev {
    float a[N], b[N];
} rev;

static int rev_sd(void *self, ckpt_writer *w) {
    rev *r = self;
    CKPT_TRY(ckpt_write_tensor(w, "a", CKPT_F32, 1, (int64_t[]){N}, r->a));
    return ckpt_write_tensor(w, "b", CKPT_F32, 1, (int64_t[]){N}, r->b);
}

/* When set, the custom object's load reads only "b". */
static bool skip_a;

static int rev_load(void *self, ckpt_reader *rd) {
    rev *r = self;
    CKPT_TRY(ckpt_read_tensor(rd, "b", CKPT_F32, 1, (int64_t[]){N}, r->b));
    if (skip_a) return CKPT_OK;
    return ckpt_read_tensor(rd, "a", CKPT_F32, 1, (int64_t[]){N}, r->a);
}

static const ckpt_stateful_ops rev_ops = {.state_dict = rev_sd, .load_state_dict = rev_load};

typedef struct run {
    float w[N], v[N];
    rev c;
    ckpt_model *model;
    ckpt_accelerator *acc;
    char *dir;
} run;

static void run_set(run *r, float x) {
    for (int i = 0; i < N; i++) {
        r->w[i] = x + (float)i;
        r->v[i] = -x - (float)i;
        r->c.a[i] = 2 * x + (float)i;
        r->c.b[i] = 3 * x + (float)i;
    }
}

static bool run_is(const run *r, float x) {
    for (int i = 0; i < N; i++)
        if (r->w[i] != x + (float)i || r->v[i] != -x - (float)i || r->c.a[i] != 2 * x + (float)i ||
            r->c.b[i] != 3 * x + (float)i)
            return false;
    return true;
}

static void quiet(void *user, ckpt_log_level level, const char *msg) {
    (void)user, (void)level, (void)msg;
}

static void run_open(run *r) {
    memset(r, 0, sizeof *r);
    r->dir = tu_tmpdir_new("onepass");
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = r->dir;
    cfg.automatic_checkpoint_naming = true;
    assert_int_equal(ckpt_accelerator_new(&r->acc, &cfg), 0);
    ckpt_accelerator_set_log(r->acc, quiet, NULL);
    assert_int_equal(ckpt_model_new(&r->model), 0);
    int64_t shape[1] = {N};
    assert_int_equal(ckpt_model_add_param(r->model, "w", CKPT_F32, 1, shape, r->w, NULL), 0);
    assert_int_equal(ckpt_model_add_param(r->model, "v", CKPT_F32, 1, shape, r->v, NULL), 0);
    assert_int_equal(ckpt_prepare_model(r->acc, r->model), 0);
    assert_int_equal(ckpt_register_for_checkpointing(r->acc, &rev_ops, &r->c), 0);
}

static void run_close(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_model_free(r->model);
    tu_tmpdir_free(r->dir);
}

static int load_one_pass(run *r) {
    ckpt_load_options o;
    memset(&o, 0, sizeof o);
    o.one_pass = true;
    return ckpt_load_state_ex(r->acc, NULL, &o, NULL);
}

/* Flips one byte of checkpoint_0's file at offset off (negative: from the
 * end). */
static void flip(run *r, const char *file, long off) {
    char *path = tu_pathf("%s/checkpoints/checkpoint_0/%s", r->dir, file);
    FILE *f = fopen(path, "r+b");
    assert_non_null(f);
    assert_int_equal(fseek(f, off, off < 0 ? SEEK_END : SEEK_SET), 0);
    int c = fgetc(f);
    assert_true(c != EOF);
    assert_int_equal(fseek(f, -1, SEEK_CUR), 0);
    assert_true(fputc(c ^ 0x20, f) != EOF);
    assert_int_equal(fclose(f), 0);
    free(path);
}

static void test_one_pass_loads_what_was_saved(void **st) {
    (void)st;
    run r;
    run_open(&r);
    run_set(&r, 1);
    ckpt_accelerator_set_step(r.acc, 7);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    run_set(&r, 2);
    ckpt_accelerator_set_step(r.acc, 9);
    assert_int_equal(load_one_pass(&r), 0);
    assert_true(run_is(&r, 1));
    assert_int_equal(ckpt_accelerator_step(r.acc), 7);
    /* loaded twice in a row, and a save after it */
    assert_int_equal(load_one_pass(&r), 0);
    assert_true(run_is(&r, 1));
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    run_close(&r);
}

/* A corrupted byte: the load fails naming the file, saves refuse until a
 * good load, then all is as before. */
static void corrupted(const char *file, long off, const char *expect) {
    run r;
    run_open(&r);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    flip(&r, file, off);
    run_set(&r, 2);
    assert_int_equal(load_one_pass(&r), CKPT_ECORRUPT);
    const char *msg = ckpt_errmsg();
    if (!strstr(msg, file) || !strstr(msg, expect))
        fail_msg("message '%s' does not name %s and '%s'", msg, file, expect);
    /* the objects are not trusted: saves refuse */
    assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "refused"));
    assert_int_equal(ckpt_save_state_async(r.acc, NULL), CKPT_EINVAL);
    /* the two-pass load refuses the same checkpoint and changes nothing */
    run_set(&r, 3);
    assert_int_equal(ckpt_load_state(r.acc, NULL), CKPT_ECORRUPT);
    assert_true(run_is(&r, 3));
    assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_EINVAL);
    /* repaired: a good load lifts the refusal */
    flip(&r, file, off);
    assert_int_equal(load_one_pass(&r), 0);
    assert_true(run_is(&r, 1));
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    run_close(&r);
}

static void test_a_corrupted_byte_read_in_order_fails_and_saves_refuse(void **st) {
    (void)st;
    /* the last byte of the model's file: inside its last tensor */
    corrupted("model.safetensors", -1, "checksum mismatch");
}

static void test_a_corrupted_tensor_read_out_of_order_is_named(void **st) {
    (void)st;
    /* 'b' is read first, then 'a' (before it in the file): 'a' is checked
     * against its own digest and named. 'a' ends 4 N bytes before the end. */
    corrupted("custom_checkpoint_0.safetensors", -(long)(4 * N) - 1,
              "tensor 'a': checksum mismatch");
}

/* The bytes of every file in checkpoint_0, the manifest included. */
static uint64_t checkpoint_bytes(run *r) {
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", r->dir);
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    uint64_t sum = 0;
    for (int64_t i = 0; i < m.nfiles; i++) {
        assert_true(m.files[i].has_header_xxh3);
        sum += m.files[i].size;
    }
    ckpt__manifest_clear(&m);
    char *man = tu_pathf("%s/checkpoint.json", dir);
    FILE *f = fopen(man, "rb");
    assert_non_null(f);
    assert_int_equal(fseek(f, 0, SEEK_END), 0);
    sum += (uint64_t)ftell(f);
    fclose(f);
    free(man);
    free(dir);
    return sum;
}

static void test_out_of_order_reads_read_every_byte_once(void **st) {
    (void)st;
    run r;
    run_open(&r);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    uint64_t total = checkpoint_bytes(&r);
    run_set(&r, 2);
    ckpt_io_bytes before, after;
    ckpt__io_bytes(&before);
    assert_int_equal(load_one_pass(&r), 0);
    ckpt__io_bytes(&after);
    assert_true(run_is(&r, 1));
    /* 'b' read before 'a' used to cost a second read of 'a' (16 KiB) for the
     * whole-file digest; by parts it is each byte once (the headers' 8-byte
     * length prefixes read apart, a few bytes more). */
    uint64_t got = after.read - before.read;
    if (got > total + 1024)
        fail_msg("a one-pass load read %llu bytes of a %llu-byte checkpoint",
                 (unsigned long long)got, (unsigned long long)total);
    run_close(&r);
}

static void test_a_corrupted_header_is_caught_when_its_file_opens(void **st) {
    (void)st;
    /* byte 20: inside the header's JSON, which still parses or not: the
     * digest is checked first */
    corrupted("custom_checkpoint_0.safetensors", 20, "checksum mismatch in the header");
}

static void test_a_corrupted_tensor_nobody_read_is_found_at_the_end(void **st) {
    (void)st;
    run r;
    run_open(&r);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    flip(&r, "custom_checkpoint_0.safetensors", -(long)(4 * N) - 1); /* in 'a' */
    skip_a = true;
    assert_int_equal(load_one_pass(&r), CKPT_ECORRUPT);
    skip_a = false;
    assert_non_null(strstr(ckpt_errmsg(), "tensor 'a': checksum mismatch"));
    assert_int_equal(ckpt_save_state(r.acc, NULL), CKPT_EINVAL);
    run_close(&r);
}

/* A manifest as older versions wrote it: no header digests. */
static void drop_header_digests(run *r) {
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", r->dir);
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    for (int64_t i = 0; i < m.nfiles; i++) m.files[i].has_header_xxh3 = false;
    assert_int_equal(ckpt__manifest_write(&m, dir), 0);
    ckpt__manifest_clear(&m);
    char *man = tu_pathf("%s/checkpoint.json", dir);
    FILE *f = fopen(man, "rb");
    assert_non_null(f);
    char buf[8192];
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    fclose(f);
    assert_null(strstr(buf, "header_xxh3"));
    free(man);
    free(dir);
}

static void test_an_older_manifest_loads_in_one_pass_by_the_whole_file(void **st) {
    (void)st;
    run r;
    run_open(&r);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    drop_header_digests(&r);
    run_set(&r, 2);
    assert_int_equal(load_one_pass(&r), 0);
    assert_true(run_is(&r, 1));
    /* a damaged header is still caught, by the whole file's digest */
    flip(&r, "custom_checkpoint_0.safetensors", 20);
    run_set(&r, 2);
    int rc = load_one_pass(&r);
    assert_int_equal(rc, CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "custom_checkpoint_0.safetensors"));
    run_close(&r);
}

static void test_options_one_pass_does_not_apply_to_fall_back_to_two_passes(void **st) {
    (void)st;
    run r;
    run_open(&r);
    run_set(&r, 1);
    assert_int_equal(ckpt_save_state(r.acc, NULL), 0);
    flip(&r, "model.safetensors", -1);
    run_set(&r, 2);
    ckpt_load_options o;
    memset(&o, 0, sizeof o);
    o.one_pass = true;
    o.non_strict = true; /* adapting: two passes, transactional */
    assert_int_equal(ckpt_load_state_ex(r.acc, NULL, &o, NULL), CKPT_ECORRUPT);
    assert_true(run_is(&r, 2)); /* nothing changed */
    run_close(&r);
}

/* ---- the first load of an accelerator: one pass, and its fallback ------- */

/* A model with one tensor large enough to be read on two threads
 * (hashread.h: CKPT_HASHREAD_MIN), and a step. */
#define BIG ((int64_t)(3u << 20) / 4) /* 3 MiB of F32 */

typedef struct bigrun {
    float *big;
    ckpt_model *model;
    ckpt_accelerator *acc;
    char *dir;
    char warned[2048];
} bigrun;

static void keep_warning(void *user, ckpt_log_level level, const char *msg) {
    bigrun *b = user;
    if (level == CKPT_LOG_WARNING && !b->warned[0])
        snprintf(b->warned, sizeof b->warned, "%s", msg);
}

static void big_set(bigrun *b, float x) {
    for (int64_t i = 0; i < BIG; i++) b->big[i] = x + (float)(i % 1000);
}

static bool big_is(const bigrun *b, float x) {
    for (int64_t i = 0; i < BIG; i++)
        if (b->big[i] != x + (float)(i % 1000)) return false;
    return true;
}

/* A new accelerator (a resumed run) over the project dir (NULL: a new one). */
static void big_open(bigrun *b, char *dir) {
    memset(b, 0, sizeof *b);
    b->dir = dir ? dir : tu_tmpdir_new("onepass_big");
    b->big = malloc((size_t)BIG * sizeof(float));
    assert_non_null(b->big);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = b->dir;
    cfg.automatic_checkpoint_naming = true;
    assert_int_equal(ckpt_accelerator_new(&b->acc, &cfg), 0);
    ckpt_accelerator_set_log(b->acc, keep_warning, b);
    assert_int_equal(ckpt_model_new(&b->model), 0);
    assert_int_equal(
        ckpt_model_add_param(b->model, "big", CKPT_F32, 1, (int64_t[]){BIG}, b->big, NULL), 0);
    assert_int_equal(ckpt_prepare_model(b->acc, b->model), 0);
}

/* Frees all but the project folder, which it returns. */
static char *big_close(bigrun *b) {
    ckpt_accelerator_free(b->acc);
    ckpt_model_free(b->model);
    free(b->big);
    return b->dir;
}

static void flip_in(const char *dir, int n, const char *file, long off) {
    char *path = tu_pathf("%s/checkpoints/checkpoint_%d/%s", dir, n, file);
    tu_flip_byte(path, off);
    free(path);
}

static uint64_t bytes_read(void) {
    ckpt_io_bytes io;
    ckpt__io_bytes(&io);
    return io.read;
}

/* Three checkpoints of steps 10, 20, 30 (values 1, 2, 3). */
static char *three_saves(void) {
    bigrun b;
    big_open(&b, NULL);
    for (int k = 1; k <= 3; k++) {
        big_set(&b, (float)k);
        ckpt_accelerator_set_step(b.acc, 10 * k);
        assert_int_equal(ckpt_save_state(b.acc, NULL), 0);
    }
    return big_close(&b);
}

static void test_the_first_load_reads_once_and_later_loads_twice(void **st) {
    (void)st;
    char *dir = three_saves();
    char *model = tu_pathf("%s/checkpoints/checkpoint_2/model.safetensors", dir);
    uint64_t size = (uint64_t)tu_file_size(model);
    free(model);
    bigrun b;
    big_open(&b, dir);
    big_set(&b, 9);
    uint64_t r0 = bytes_read();
    assert_int_equal(ckpt_load_state(b.acc, NULL), 0);
    uint64_t first = bytes_read() - r0;
    assert_true(big_is(&b, 3));
    assert_int_equal(ckpt_accelerator_step(b.acc), 30);
    /* the first load read the model's file once (and the small generator
     * file); a later load verifies everything first: twice */
    assert_true(first >= size && first < size + size / 2);
    big_set(&b, 9);
    r0 = bytes_read();
    assert_int_equal(ckpt_load_state(b.acc, NULL), 0);
    uint64_t later = bytes_read() - r0;
    assert_true(big_is(&b, 3));
    assert_true(later >= 2 * size);
    /* transactional on a first load: twice as well */
    big_close(&b);
    big_open(&b, dir);
    ckpt_load_options t = {.transactional = true};
    r0 = bytes_read();
    assert_int_equal(ckpt_load_state_ex(b.acc, NULL, &t, NULL), 0);
    assert_true(bytes_read() - r0 >= 2 * size);
    /* both at once contradict each other */
    ckpt_load_options both = {.transactional = true, .one_pass = true};
    tu_expect_error(ckpt_load_state_ex(b.acc, NULL, &both, NULL), CKPT_EINVAL, "contradict");
    tu_tmpdir_free(big_close(&b));
}

static void test_a_damaged_newest_is_replaced_by_the_next_older(void **st) {
    (void)st;
    char *dir = three_saves();
    /* a byte near the end of the big tensor: read by the helper thread,
     * after most of the tensor has landed in the objects */
    flip_in(dir, 2, "model.safetensors", -100);
    bigrun b;
    big_open(&b, dir);
    big_set(&b, 9);
    assert_int_equal(ckpt_load_state(b.acc, NULL), 0);
    assert_true(big_is(&b, 2)); /* checkpoint_1, whole */
    assert_int_equal(ckpt_accelerator_step(b.acc), 20);
    tu_assert_contains(b.warned, "checkpoint_2");
    tu_assert_contains(b.warned, "tensor 'big': checksum mismatch");
    tu_assert_contains(b.warned, "an older checkpoint is loaded over them");
    /* saves go on, numbered after the damaged one */
    assert_int_equal(ckpt_save_state(b.acc, NULL), 0);
    tu_assert_contains(ckpt_accelerator_last_dir(b.acc), "checkpoint_3");
    tu_tmpdir_free(big_close(&b));
}

static void test_every_checkpoint_damaged_says_what_the_objects_hold(void **st) {
    (void)st;
    char *dir = three_saves();
    for (int n = 0; n <= 2; n++) flip_in(dir, n, "model.safetensors", -100);
    bigrun b;
    big_open(&b, dir);
    big_set(&b, 9);
    tu_expect_error(ckpt_load_state(b.acc, NULL), CKPT_ECORRUPT, "no valid checkpoint in");
    tu_assert_errmsg_has("checkpoint_2");
    tu_assert_errmsg_has("checkpoint_1");
    tu_assert_errmsg_has("the objects hold part of checkpoint_0");
    tu_expect_error(ckpt_save_state(b.acc, NULL), CKPT_EINVAL, "refused");
    big_close(&b);
    /* transactional: the same verdict, the objects untouched */
    big_open(&b, dir);
    big_set(&b, 9);
    ckpt_load_options t = {.transactional = true};
    tu_expect_error(ckpt_load_state_ex(b.acc, NULL, &t, NULL), CKPT_ECORRUPT,
                    "no valid checkpoint in");
    assert_true(big_is(&b, 9));
    tu_tmpdir_free(big_close(&b));
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_one_pass_loads_what_was_saved),
        cmocka_unit_test(test_the_first_load_reads_once_and_later_loads_twice),
        cmocka_unit_test(test_a_damaged_newest_is_replaced_by_the_next_older),
        cmocka_unit_test(test_every_checkpoint_damaged_says_what_the_objects_hold),
        cmocka_unit_test(test_a_corrupted_byte_read_in_order_fails_and_saves_refuse),
        cmocka_unit_test(test_a_corrupted_tensor_read_out_of_order_is_named),
        cmocka_unit_test(test_options_one_pass_does_not_apply_to_fall_back_to_two_passes),
        cmocka_unit_test(test_out_of_order_reads_read_every_byte_once),
        cmocka_unit_test(test_a_corrupted_header_is_caught_when_its_file_opens),
        cmocka_unit_test(test_a_corrupted_tensor_nobody_read_is_found_at_the_end),
        cmocka_unit_test(test_an_older_manifest_loads_in_one_pass_by_the_whole_file),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
