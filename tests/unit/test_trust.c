/* test_trust.c — the trust rules at the C level: bytes applied are bytes
 * hashed (a file rewritten in place right after its verification changes
 * nothing a load or an object reader hands out); opens for reading never
 * block on a FIFO and never follow a checkpoint's symlink; the lock file is
 * never followed, truncated or written unless it is ckpt's own; a newest
 * checkpoint whose manifest is not a regular file, or whose manifest forges
 * a huge size, is damage a load falls back from. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "store/store.h"
#include "helpers/testutil.h"

/* ---- a stateful object: a counter and a tensor ------------------------------ */

typedef struct counter {
    int64_t value;
    float w[64];
} counter;

static int counter_sd(void *self, ckpt_writer *w) {
    counter *c = self;
    CKPT_TRY(ckpt_write_i64(w, "value", c->value));
    int64_t shape[1] = {64};
    return ckpt_write_tensor(w, "w", CKPT_F32, 1, shape, c->w);
}

static int counter_load(void *self, ckpt_reader *r) {
    counter *c = self;
    int64_t v;
    float w[64];
    int64_t shape[1] = {64};
    CKPT_TRY(ckpt_read_i64(r, "value", &v));
    CKPT_TRY(ckpt_read_tensor(r, "w", CKPT_F32, 1, shape, w));
    c->value = v;
    memcpy(c->w, w, sizeof w);
    return 0;
}

static const ckpt_stateful_ops counter_ops = {.state_dict = counter_sd,
                                              .load_state_dict = counter_load};

static void counter_set(counter *c, int64_t v) {
    c->value = v;
    for (int i = 0; i < 64; i++) c->w[i] = (float)v + 0.25f * (float)i;
}

static void assert_counter_is(const counter *c, int64_t v) {
    counter want;
    counter_set(&want, v);
    assert_int_equal(c->value, v);
    assert_memory_equal(c->w, want.w, sizeof want.w);
}

typedef struct logbuf {
    int warnings;
    char last[2048];
} logbuf;

static void log_collect(void *user, ckpt_log_level level, const char *msg) {
    logbuf *l = user;
    if (level == CKPT_LOG_WARNING) l->warnings++;
    snprintf(l->last, sizeof l->last, "%s", msg);
}

/* A project with checkpoint_0 (counter 1) and checkpoint_1 (counter 2); the
 * accelerator's counter is left at 3. */
static ckpt_accelerator *two_saves(const char *project, counter *c, logbuf *lb) {
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = project;
    cfg.automatic_checkpoint_naming = true;
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    memset(lb, 0, sizeof *lb);
    ckpt_accelerator_set_log(acc, log_collect, lb);
    counter_set(c, 1);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, c), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    counter_set(c, 2);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    counter_set(c, 3);
    return acc;
}

static char *cp(const char *project, int n) {
    return tu_pathf("%s/checkpoints/checkpoint_%d", project, n);
}

/* ---- bytes applied are bytes hashed ----------------------------------------- */

/* The hook: zeroes the tensor data of the custom object's file in place (its
 * header stays), as another process writing the file would, at the moment
 * between its verification and its use. */
static int rewrites;

static void zero_in_place(void *user, const char *path) {
    (void)user;
    size_t n = strlen(path), k = strlen("custom_checkpoint_0.safetensors");
    if (n < k || strcmp(path + n - k, "custom_checkpoint_0.safetensors") != 0) return;
    int fd = open(path, O_RDWR);
    assert_true(fd >= 0);
    uint8_t len8[8];
    assert_int_equal(pread(fd, len8, 8, 0), 8);
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
    struct stat st;
    assert_int_equal(fstat(fd, &st), 0);
    size_t data = (size_t)st.st_size - 8 - (size_t)hlen;
    uint8_t *zeros = calloc(1, data);
    assert_non_null(zeros);
    assert_int_equal(pwrite(fd, zeros, data, (off_t)(8 + hlen)), (ssize_t)data);
    free(zeros);
    close(fd);
    rewrites++;
}

/* The two passes (a load with an adapting option, here non_strict): the
 * bytes applied are the private copy verified, whatever happens to the file
 * after its check. */
static void test_two_pass_load_applies_the_bytes_it_verified(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("trust");
    counter c;
    logbuf lb;
    ckpt_accelerator *acc = two_saves(t, &c, &lb);
    /* Warm files: the page cache holds every byte just written. */
    rewrites = 0;
    ckpt__io_set_verified_hook(zero_in_place, NULL);
    ckpt_load_options o = {.non_strict = true};
    int rc = ckpt_load_state_ex(acc, NULL, &o, NULL);
    ckpt__io_set_verified_hook(NULL, NULL);
    assert_int_equal(rc, 0);
    assert_int_equal(rewrites, 1);
    assert_counter_is(&c, 2); /* not the zeros written after the check */
    /* the file really changed: the next load refuses it and falls back */
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_counter_is(&c, 1);
    assert_int_equal(lb.warnings, 1);
    tu_assert_contains(lb.last, "checksum mismatch");
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

/* The default load (verified whole, then read straight into the objects,
 * hashed as the bytes land): a file rewritten after its verification is
 * never loaded silently. The rewrite is found as the object reads it, the
 * load fails naming the file and saying that the state is partially loaded
 * (saves refuse, as after any failed load), and the next load, finding the
 * file damaged, falls back to the older checkpoint. */
static void test_streamed_load_refuses_a_file_rewritten_after_its_check(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("trust");
    counter c;
    logbuf lb;
    ckpt_accelerator *acc = two_saves(t, &c, &lb);
    rewrites = 0;
    ckpt__io_set_verified_hook(zero_in_place, NULL);
    int rc = ckpt_load_state(acc, NULL);
    ckpt__io_set_verified_hook(NULL, NULL);
    assert_int_equal(rewrites, 1);
    assert_int_equal(rc, CKPT_ECORRUPT);
    tu_assert_contains(ckpt_errmsg(), "custom_checkpoint_0.safetensors");
    tu_assert_contains(ckpt_errmsg(), "changed after it was verified");
    tu_expect_error(ckpt_save_state(acc, NULL), CKPT_EINVAL, "last load_state");
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_counter_is(&c, 1);
    assert_int_equal(lb.warnings, 1);
    tu_assert_contains(lb.last, "checksum mismatch");
    assert_int_equal(ckpt_save_state(acc, NULL), 0); /* a successful load lifts the refusal */
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

static void test_object_reader_hands_out_the_bytes_it_verified(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("trust");
    counter c;
    logbuf lb;
    ckpt_accelerator *acc = two_saves(t, &c, &lb);
    char *dir = cp(t, 1);
    rewrites = 0;
    ckpt__io_set_verified_hook(zero_in_place, NULL);
    ckpt_reader *r = NULL;
    int rc = ckpt_checkpoint_open_object(dir, "custom_checkpoint_0.safetensors", &r);
    ckpt__io_set_verified_hook(NULL, NULL);
    assert_int_equal(rc, 0);
    assert_int_equal(rewrites, 1);
    counter got;
    memset(&got, 0, sizeof got);
    assert_int_equal(counter_load(&got, r), 0);
    assert_counter_is(&got, 2);
    ckpt_reader_free(r);
    /* opened again, the rewritten file is refused */
    tu_expect_error(ckpt_checkpoint_open_object(dir, "custom_checkpoint_0.safetensors", &r),
                    CKPT_ECORRUPT, "custom_checkpoint_0.safetensors does not match the manifest");
    free(dir);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

/* ---- opens for reading -------------------------------------------------------- */

static void test_open_read_never_blocks_on_a_fifo(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("trust");
    char *fifo = tu_pathf("%s/f.safetensors", t);
    assert_int_equal(mkfifo(fifo, 0644), 0);
    /* Each of these would block forever in open() if it opened the FIFO
     * without O_NONBLOCK: no writer ever comes. */
    tu_expect_error(ckpt__open_read(fifo, "f", true, NULL), CKPT_ECORRUPT,
                    "f: a FIFO, expected a regular file");
    tu_expect_error(ckpt__open_read(fifo, "f", false, NULL), CKPT_EINVAL,
                    "f: a FIFO, expected a regular file");
    ckpt_reader *r = NULL;
    tu_expect_error(ckpt_reader_open(&r, fifo), CKPT_EINVAL, "a FIFO, expected a regular file");
    ckpt_mapped m;
    tu_expect_error(ckpt__map_file(fifo, &m), CKPT_EINVAL, "a FIFO");
    char *text = NULL;
    tu_expect_error(ckpt__read_small_file(fifo, true, 100, &text, NULL), CKPT_ECORRUPT, "a FIFO");
    uint64_t h;
    tu_expect_error(ckpt__read_hashed(fifo, "f", 0, NULL, &h), CKPT_ECORRUPT, "a FIFO");
    /* a checkpoint's file is not followed; a user's input is */
    char *real = tu_pathf("%s/real", t), *link = tu_pathf("%s/link", t);
    tu_write_text(real, "abc");
    assert_int_equal(symlink("real", link), 0);
    tu_expect_error(ckpt__open_read(link, "link", true, NULL), CKPT_ECORRUPT,
                    "link: a symlink, expected a regular file");
    int fd = ckpt__open_read(link, "link", false, NULL);
    assert_true(fd >= 0);
    assert_int_equal(fcntl(fd, F_GETFL) & O_NONBLOCK, 0); /* cleared for the reads */
    close(fd);
    char *dev = tu_pathf("%s/zero", t);
    assert_int_equal(symlink("/dev/zero", dev), 0);
    tu_expect_error(ckpt__open_read(dev, "zero", false, NULL), CKPT_EINVAL,
                    "zero: a character device, expected a regular file");
    free(dev);
    free(real);
    free(link);
    free(fifo);
    tu_tmpdir_free(t);
}

/* ---- the lock ----------------------------------------------------------------- */

static void test_lock_never_follows_or_overwrites_what_is_not_its_own(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("trust");
    char *lp = tu_pathf("%s/.lock", t), *precious = tu_pathf("%s/precious", t);
    tu_write_text(precious, "precious bytes");
    ckpt_lock lk = {.fd = -1};

    assert_int_equal(symlink("precious", lp), 0);
    tu_expect_error(ckpt__lock_acquire(&lk, lp, false), CKPT_EINVAL, ".lock is a symlink");
    tu_expect_error(ckpt__lock_acquire(&lk, lp, true), CKPT_EINVAL, ".lock is a symlink");
    tu_assert_file_text(precious, "precious bytes");
    assert_int_equal(unlink(lp), 0);

    assert_int_equal(link(precious, lp), 0);
    tu_expect_error(ckpt__lock_acquire(&lk, lp, false), CKPT_EINVAL, "has 2 names");
    tu_assert_file_text(precious, "precious bytes");
    assert_int_equal(unlink(lp), 0);

    assert_int_equal(mkfifo(lp, 0644), 0);
    tu_expect_error(ckpt__lock_acquire(&lk, lp, false), CKPT_EINVAL,
                    ".lock is a FIFO, expected a regular file");
    assert_int_equal(unlink(lp), 0);

    assert_int_equal(mkdir(lp, 0755), 0);
    tu_expect_error(ckpt__lock_acquire(&lk, lp, false), CKPT_EINVAL, ".lock");
    assert_int_equal(rmdir(lp), 0);

    tu_write_text(lp, "someone's notes\n");
    tu_expect_error(ckpt__lock_acquire(&lk, lp, false), CKPT_EINVAL, "not touching it");
    tu_assert_file_text(lp, "someone's notes\n");
    assert_int_equal(lk.fd, -1);

    /* ckpt's own: empty, zeroed by a power cut, or a holder's line */
    const char *own[] = {"", "123 host\n", "123\n"};
    for (int i = 0; i < 4; i++) {
        if (i < 3) tu_write_text(lp, own[i]);
        else tu_write_file(lp, "\0\0\0\0\0\0", 6);
        assert_int_equal(ckpt__lock_acquire(&lk, lp, false), 0);
        assert_true(lk.fd >= 0);
        size_t n = 0;
        char *text = tu_read_file(lp, &n);
        char want[64];
        snprintf(want, sizeof want, "%ld ", (long)getpid());
        assert_true(n > strlen(want) && strncmp(text, want, strlen(want)) == 0);
        free(text);
        ckpt__lock_release(&lk);
    }
    free(lp);
    free(precious);
    tu_tmpdir_free(t);
}

/* ---- a damaged newest checkpoint ---------------------------------------------- */

static void test_load_falls_back_from_a_non_regular_manifest(void **st) {
    (void)st;
    for (int kind = 0; kind < 3; kind++) {
        char *t = tu_tmpdir_new("trust");
        counter c;
        logbuf lb;
        ckpt_accelerator *acc = two_saves(t, &c, &lb);
        char *dir = cp(t, 1);
        char *m = tu_pathf("%s/checkpoint.json", dir);
        assert_int_equal(unlink(m), 0);
        const char *what = kind == 0 ? "a FIFO" : kind == 1 ? "a folder" : "a symlink";
        if (kind == 0) assert_int_equal(mkfifo(m, 0644), 0);
        else if (kind == 1) assert_int_equal(mkdir(m, 0755), 0);
        else assert_int_equal(symlink("/dev/zero", m), 0);
        ckpt_checkpoint_info info;
        tu_expect_error(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT, what);
        assert_int_equal(info.status, CKPT_CHECKPOINT_CORRUPT);
        assert_int_equal(ckpt_load_state(acc, NULL), 0);
        assert_counter_is(&c, 1);
        assert_int_equal(lb.warnings, 1);
        tu_assert_contains(lb.last, "checkpoint.json: ");
        tu_assert_contains(lb.last, what);
        ckpt_accelerator_free(acc); /* its project lock with it */
        /* prune keeps damage newer than the newest valid one, as always */
        int64_t removed = -1;
        assert_int_equal(ckpt_checkpoint_prune(t, 1, &removed), 0);
        assert_int_equal(removed, 0);
        free(m);
        free(dir);
        tu_tmpdir_free(t);
    }
}

/* Replaces the first `from` in dir's manifest with `to` and reseals the
 * manifest's own checksum, as a forger would. */
static void forge_manifest(const char *dir, const char *from, const char *to) {
    char *f = tu_pathf("%s/checkpoint.json", dir);
    size_t len = 0;
    char *text = tu_read_file(f, &len);
    char *at = strstr(text, from);
    assert_non_null(at);
    size_t nlen = len - strlen(from) + strlen(to);
    char *out = malloc(nlen + 1);
    assert_non_null(out);
    size_t head = (size_t)(at - text);
    memcpy(out, text, head);
    memcpy(out + head, to, strlen(to));
    memcpy(out + head + strlen(to), at + strlen(from), len - head - strlen(from));
    out[nlen] = '\0';
    char *sum = strstr(out, "\"manifest_xxh3\": \"");
    assert_non_null(sum);
    sum += strlen("\"manifest_xxh3\": \"");
    memset(sum, '0', 16);
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, ckpt__xxh3(out, nlen));
    memcpy(sum, hex, 16);
    tu_write_file(f, out, nlen);
    free(out);
    free(text);
    free(f);
}

static void test_load_falls_back_from_a_forged_huge_size(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("trust");
    counter c;
    logbuf lb;
    ckpt_accelerator *acc = two_saves(t, &c, &lb);
    char *dir = cp(t, 1);
    char *f = tu_pathf("%s/custom_checkpoint_0.safetensors", dir);
    char from[64];
    snprintf(from, sizeof from, "\"size\": %lld", (long long)tu_file_size(f));
    forge_manifest(dir, from, "\"size\": 4611686018427387904");
    ckpt_checkpoint_info info;
    tu_expect_error(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT,
                    "the manifest says 4611686018427387904");
    /* stat before any reservation: damage, never "out of memory" */
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_counter_is(&c, 1);
    assert_int_equal(lb.warnings, 1);
    tu_assert_contains(lb.last, "the manifest says 4611686018427387904");
    free(f);
    free(dir);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_pass_load_applies_the_bytes_it_verified),
        cmocka_unit_test(test_streamed_load_refuses_a_file_rewritten_after_its_check),
        cmocka_unit_test(test_object_reader_hands_out_the_bytes_it_verified),
        cmocka_unit_test(test_open_read_never_blocks_on_a_fifo),
        cmocka_unit_test(test_lock_never_follows_or_overwrites_what_is_not_its_own),
        cmocka_unit_test(test_load_falls_back_from_a_non_regular_manifest),
        cmocka_unit_test(test_load_falls_back_from_a_forged_huge_size),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
