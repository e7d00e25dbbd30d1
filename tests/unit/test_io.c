/* test_io.c — the write stream, crash-safe publication of files and folders,
 * whole-file reads, and the fault-injection hook (also via CKPT_FAULT). */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "testing/testing.h"
#include "helpers/testutil.h"

typedef struct fx {
    char dir[64];
} fx;

static int setup(void **state) {
    fx *f = calloc(1, sizeof *f);
    if (tu_tmpdir_make(f->dir, sizeof f->dir, "test_io") != 0) return -1;
    *state = f;
    return 0;
}

static int teardown(void **state) {
    fx *f = *state;
    ckpt__fault_disarm();
    ckpt__fault_set_max_write(0);
    tu_tmpdir_remove(f->dir);
    free(f);
    return 0;
}

static int count_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)))
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* ---- the stream --------------------------------------------------------- */

static void test_ostream_writes_all_bytes_and_checksums_them(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "s.bin");
    static uint8_t data[100000];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i * 7);
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&s, data, 10), CKPT_OK);
    ckpt__ostream_part_begin(&s);
    assert_int_equal(ckpt__ostream_write(&s, data + 10, sizeof data - 10), CKPT_OK);
    assert_true(ckpt__ostream_part_digest(&s) == ckpt__xxh3(data + 10, sizeof data - 10));
    uint64_t dg = 0, sz = 0;
    assert_int_equal(ckpt__ostream_finish(&s, &dg, &sz), CKPT_OK);
    assert_int_equal(sz, sizeof data);
    assert_true(dg == ckpt__xxh3(data, sizeof data));
    ckpt__ostream_abort(&s); /* no-op after finish: the file stays */
    tu_assert_file_is(p, data, sizeof data);
}

/* Several pieces (the stream hashes and writes 256 KiB at a time), a part
 * that spans them, and the wide digest: the 64- and 128-bit digests of one
 * state are those of the bytes (libxxhash resets and updates both kinds
 * alike), a dry stream gives the same 128-bit digest, and so does a read
 * of the file back. */
static void test_ostream_pieces_and_both_digests_from_one_pass(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "big.bin");
    size_t n = ((size_t)1 << 20) + 300001;
    uint8_t *data = malloc(n);
    assert_non_null(data);
    for (size_t i = 0; i < n; i++) data[i] = (uint8_t)(i * 131 + (i >> 9));
    size_t head = 100003; /* the part starts inside the first piece */
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    ckpt__ostream_want128(&s);
    assert_int_equal(ckpt__ostream_write(&s, data, head), CKPT_OK);
    ckpt__ostream_part_begin(&s);
    assert_int_equal(ckpt__ostream_write(&s, data + head, n - head), CKPT_OK);
    assert_true(ckpt__ostream_part_digest(&s) == ckpt__xxh3(data + head, n - head));
    uint64_t dg = 0, sz = 0;
    assert_int_equal(ckpt__ostream_finish(&s, &dg, &sz), CKPT_OK);
    assert_int_equal(sz, n);
    assert_true(dg == ckpt__xxh3(data, n));
    ckpt_h128 want = ckpt__xxh128(data, n);
    assert_true(ckpt__h128_eq(s.h128, want));
    tu_assert_file_is(p, data, n);
    ckpt_ostream d;
    assert_int_equal(ckpt__ostream_open_dry(&d, "dry"), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&d, data, head), CKPT_OK);
    ckpt__ostream_part_begin(&d);
    assert_int_equal(ckpt__ostream_write(&d, data + head, n - head), CKPT_OK);
    assert_int_equal(ckpt__ostream_finish(&d, NULL, &sz), CKPT_OK);
    assert_false(d.differs);
    assert_true(ckpt__h128_eq(d.h128, want));
    uint64_t rd = 0;
    ckpt_h128 rw = {0, 0};
    assert_int_equal(ckpt__read_hashed128(p, "big.bin", n, &rd, &rw), CKPT_OK);
    assert_true(rd == dg);
    assert_true(ckpt__h128_eq(rw, want));
    free(data);
}

/* A dry stream with the parts' expected digests stops at the first part
 * that differs, and says so; the same parts as expected keep the digest. */
static void test_dry_stream_compares_parts_with_expected_digests(void **state) {
    (void)state;
    static uint8_t a[3000], b[5000];
    for (size_t i = 0; i < sizeof a; i++) a[i] = (uint8_t)i;
    for (size_t i = 0; i < sizeof b; i++) b[i] = (uint8_t)(i * 3);
    uint64_t expect[2] = {ckpt__xxh3(a, sizeof a), ckpt__xxh3(b, sizeof b)};
    for (int k = 0; k < 4; k++) {
        uint64_t e[2] = {expect[0], expect[1]};
        int64_t ne = 2;
        if (k == 1) e[0] ^= 1; /* the first part differs */
        if (k == 2) e[1] ^= 1; /* the last one */
        if (k == 3) ne = 1;    /* more parts than expected */
        ckpt_ostream d;
        assert_int_equal(ckpt__ostream_open_dry(&d, "dry"), CKPT_OK);
        ckpt__ostream_expect_parts(&d, e, ne);
        assert_int_equal(ckpt__ostream_write(&d, "header", 6), CKPT_OK);
        ckpt__ostream_part_begin(&d);
        assert_int_equal(ckpt__ostream_write(&d, a, sizeof a), CKPT_OK);
        ckpt__ostream_part_begin(&d);
        assert_int_equal(ckpt__ostream_write(&d, b, sizeof b), CKPT_OK);
        uint64_t sz = 0;
        assert_int_equal(ckpt__ostream_finish(&d, NULL, &sz), CKPT_OK);
        assert_int_equal(sz, 6 + sizeof a + sizeof b);
        assert_true(d.differs == (k != 0));
        if (k == 0) {
            uint8_t all[6 + sizeof a + sizeof b];
            memcpy(all, "header", 6);
            memcpy(all + 6, a, sizeof a);
            memcpy(all + 6 + sizeof a, b, sizeof b);
            assert_true(ckpt__h128_eq(d.h128, ckpt__xxh128(all, sizeof all)));
        }
    }
}

static void test_ostream_handles_short_writes(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "short.bin");
    uint8_t data[1000];
    for (size_t i = 0; i < sizeof data; i++) data[i] = (uint8_t)(i ^ 0x5a);
    ckpt__fault_set_max_write(3);
    ckpt__fault_arm(CKPT_FAULT_WRITE, UINT64_MAX, EIO, false); /* only counts */
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&s, data, sizeof data), CKPT_OK);
    assert_int_equal(ckpt__fault_count(), 334); /* ceil(1000 / 3) write calls */
    ckpt__fault_set_max_write(0);
    uint64_t dg;
    assert_int_equal(ckpt__ostream_finish(&s, &dg, NULL), CKPT_OK);
    assert_true(dg == ckpt__xxh3(data, sizeof data));
    tu_assert_file_is(p, data, sizeof data);
}

static void test_ostream_retries_eintr(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "eintr.bin");
    ckpt__fault_arm(CKPT_FAULT_ANY, 1, EINTR, false); /* the create is interrupted */
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    assert_true(ckpt__fault_fired());
    ckpt__fault_arm(CKPT_FAULT_WRITE | CKPT_FAULT_FSYNC, 1, EINTR, false);
    assert_int_equal(ckpt__ostream_write(&s, "abc", 3), CKPT_OK);
    assert_true(ckpt__fault_fired());
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 1, EINTR, false);
    assert_int_equal(ckpt__ostream_finish(&s, NULL, NULL), CKPT_OK);
    assert_true(ckpt__fault_fired());
    tu_assert_file_text(p, "abc");
}

static void test_ostream_error_is_sticky_and_named(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "sticky.bin");
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    ckpt__fault_arm(CKPT_FAULT_WRITE, 2, ENOSPC, false);
    assert_int_equal(ckpt__ostream_write(&s, "a", 1), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&s, "b", 1), CKPT_ENOSPC);
    tu_assert_errmsg_has("sticky.bin: write: No space left on device");
    assert_int_equal(ckpt__ostream_write(&s, "c", 1), CKPT_ENOSPC);
    assert_int_equal(ckpt__fault_count(), 2); /* the third call never reached the OS */
    ckpt__fault_disarm();
    assert_int_equal(ckpt__ostream_finish(&s, NULL, NULL), CKPT_ENOSPC);
    assert_int_equal(access(p, F_OK), -1); /* a failed stream removes its file */
    ckpt__ostream_abort(&s);                /* and abort afterwards is harmless */
}

static void test_ostream_fsync_failure_removes_file(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "fs.bin");
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&s, "abc", 3), CKPT_OK);
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 1, EIO, false);
    assert_int_equal(ckpt__ostream_finish(&s, NULL, NULL), CKPT_EIO);
    tu_assert_errmsg_has("fs.bin: fsync: Input/output error");
    assert_int_equal(access(p, F_OK), -1);
}

static void test_ostream_open_is_exclusive_and_abort_unlinks(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "ex.bin");
    tu_write_text(p, "old");
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_EEXIST);
    tu_assert_errmsg_has("ex.bin: create");
    tu_assert_file_text(p, "old");
    unlink(p);
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&s, "x", 1), CKPT_OK);
    ckpt__ostream_abort(&s);
    assert_int_equal(access(p, F_OK), -1);
    ckpt__ostream_abort(&s); /* twice is harmless */
}

/* ---- publish_file ------------------------------------------------------- */

static int fill_text(ckpt_ostream *s, void *ctx) { return ckpt__ostream_write(s, ctx, strlen(ctx)); }

static int fill_fails(ckpt_ostream *s, void *ctx) {
    (void)ctx;
    CKPT_TRY(ckpt__ostream_write(s, "partial", 7));
    return ckpt__err(CKPT_EINVAL, "fill: refused");
}

static void test_publish_file_creates_and_replaces_atomically(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "pub.txt");
    uint64_t dg = 0, sz = 0;
    assert_int_equal(ckpt__publish_file(p, fill_text, "first", &dg, &sz), CKPT_OK);
    tu_assert_file_text(p, "first");
    assert_int_equal(sz, 5);
    assert_true(dg == ckpt__xxh3("first", 5));
    assert_int_equal(ckpt__publish_file(p, fill_text, "second!", NULL, NULL), CKPT_OK);
    tu_assert_file_text(p, "second!");
    assert_int_equal(count_entries(f->dir), 1); /* no temporary or backup left */
}

static void test_publish_file_fill_failure_leaves_nothing(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "pub.txt");
    assert_int_equal(ckpt__publish_file(p, fill_fails, NULL, NULL, NULL), CKPT_EINVAL);
    tu_assert_errmsg_has("fill: refused");
    assert_int_equal(count_entries(f->dir), 0);
    tu_write_text(p, "keep");
    assert_int_equal(ckpt__publish_file(p, fill_fails, NULL, NULL, NULL), CKPT_EINVAL);
    tu_assert_file_text(p, "keep");
    assert_int_equal(count_entries(f->dir), 1);
}

static void test_publish_file_every_fault_keeps_old_file(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "pub.txt");
    tu_write_text(p, "old contents");
    ckpt__fault_arm(CKPT_FAULT_ANY, UINT64_MAX, EIO, false);
    assert_int_equal(ckpt__publish_file(p, fill_text, "new", NULL, NULL), CKPT_OK);
    uint64_t calls = ckpt__fault_count();
    ckpt__fault_disarm();
    tu_write_text(p, "old contents");
    for (uint64_t n = 1; n <= calls; n++) {
        ckpt__fault_arm(CKPT_FAULT_ANY, n, EIO, false);
        int rc = ckpt__publish_file(p, fill_text, "new", NULL, NULL);
        ckpt__fault_disarm();
        assert_int_equal(rc, CKPT_EIO);
        tu_assert_errmsg_has(p);
        tu_assert_file_text(p, "old contents");
        assert_int_equal(count_entries(f->dir), 1);
    }
    /* persistent failure: the same */
    ckpt__fault_arm(CKPT_FAULT_WRITE, 1, ENOSPC, true);
    assert_int_equal(ckpt__publish_file(p, fill_text, "new", NULL, NULL), CKPT_ENOSPC);
    ckpt__fault_disarm();
    tu_assert_file_text(p, "old contents");
    assert_int_equal(count_entries(f->dir), 1);
}

static void test_publish_file_rejects_folder_paths(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "sub/");
    assert_int_equal(ckpt__publish_file(p, fill_text, "x", NULL, NULL), CKPT_EINVAL);
    tu_path(p, sizeof p, f->dir, "missing/file");
    assert_int_equal(ckpt__publish_file(p, fill_text, "x", NULL, NULL), CKPT_ENOENT);
    tu_assert_errmsg_has("missing/file");
}

/* ---- folders ------------------------------------------------------------ */

static void make_tree(const char *root, const char *content) {
    char p[256];
    assert_int_equal(ckpt__mkdirs(root), CKPT_OK);
    snprintf(p, sizeof p, "%s/a/b", root);
    assert_int_equal(ckpt__mkdirs(p), CKPT_OK);
    snprintf(p, sizeof p, "%s/a/b/file", root);
    tu_write_text(p, content);
    snprintf(p, sizeof p, "%s/top", root);
    tu_write_text(p, content);
}

static void test_publish_dir_new_and_replace_and_refuse(void **state) {
    fx *f = *state;
    char tmp[128], fin[128], p[256];
    tu_path(tmp, sizeof tmp, f->dir, ".tmp1");
    tu_path(fin, sizeof fin, f->dir, "ckpt");
    make_tree(tmp, "one");
    assert_int_equal(ckpt__publish_dir(tmp, fin, false), CKPT_OK);
    snprintf(p, sizeof p, "%s/a/b/file", fin);
    tu_assert_file_text(p, "one");
    assert_int_equal(access(tmp, F_OK), -1);

    make_tree(tmp, "two");
    assert_int_equal(ckpt__publish_dir(tmp, fin, false), CKPT_EEXIST);
    tu_assert_errmsg_has("already exists");
    tu_assert_file_text(p, "one");
    assert_int_equal(ckpt__publish_dir(tmp, fin, true), CKPT_OK);
    tu_assert_file_text(p, "two");
    assert_int_equal(access(tmp, F_OK), -1); /* the old folder was removed */
    assert_int_equal(count_entries(f->dir), 1);
}

static void test_publish_dir_fault_keeps_old_folder(void **state) {
    fx *f = *state;
    char tmp[128], fin[128], p[256];
    tu_path(tmp, sizeof tmp, f->dir, ".tmp1");
    tu_path(fin, sizeof fin, f->dir, "ckpt");
    make_tree(fin, "old");
    make_tree(tmp, "new");
    ckpt__fault_arm(CKPT_FAULT_RENAME, 1, EIO, false);
    assert_int_equal(ckpt__publish_dir(tmp, fin, true), CKPT_EIO);
    ckpt__fault_disarm();
    snprintf(p, sizeof p, "%s/top", fin);
    tu_assert_file_text(p, "old");
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 1, EIO, false); /* the temp folder's fsync */
    assert_int_equal(ckpt__publish_dir(tmp, fin, true), CKPT_EIO);
    ckpt__fault_disarm();
    tu_assert_file_text(p, "old");
    assert_int_equal(ckpt__publish_dir(tmp, fin, true), CKPT_OK);
    tu_assert_file_text(p, "new");
}

static void test_fsync_dir_reports_failures(void **state) {
    fx *f = *state;
    assert_int_equal(ckpt__fsync_dir(f->dir), CKPT_OK);
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 1, EIO, false);
    assert_int_equal(ckpt__fsync_dir(f->dir), CKPT_EIO);
    tu_assert_errmsg_has("fsync folder");
    ckpt__fault_disarm();
    char p[128];
    tu_path(p, sizeof p, f->dir, "nope");
    assert_int_equal(ckpt__fsync_dir(p), CKPT_ENOENT);
}

static void test_mkdirs_nested_existing_and_file_in_the_way(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "a/b//c/d/");
    assert_int_equal(ckpt__mkdirs(p), CKPT_OK);
    assert_int_equal(ckpt__mkdirs(p), CKPT_OK);
    struct stat st;
    tu_path(p, sizeof p, f->dir, "a/b/c/d");
    assert_int_equal(stat(p, &st), 0);
    assert_true(S_ISDIR(st.st_mode));
    tu_path(p, sizeof p, f->dir, "a/file");
    tu_write_text(p, "x");
    tu_path(p, sizeof p, f->dir, "a/file/sub");
    assert_int_equal(ckpt__mkdirs(p), CKPT_EINVAL);
    tu_assert_errmsg_has("a/file: exists and is not a folder");
    tu_path(p, sizeof p, f->dir, "m/n");
    /* mkdir calls: /tmp, the test folder (both exist: a failure there is
     * moot), then "m", which must fail. */
    ckpt__fault_arm(CKPT_FAULT_MKDIR, 3, ENOSPC, false);
    int rc = ckpt__mkdirs(p);
    ckpt__fault_disarm();
    assert_int_equal(rc, CKPT_ENOSPC);
    tu_assert_errmsg_has("mkdir");
}

static void test_remove_tree_does_not_follow_symlinks(void **state) {
    fx *f = *state;
    char root[128], outside[128], p[256];
    tu_path(root, sizeof root, f->dir, "tree");
    tu_path(outside, sizeof outside, f->dir, "outside");
    make_tree(root, "x");
    make_tree(outside, "keep");
    snprintf(p, sizeof p, "%s/a/link", root);
    assert_int_equal(symlink(outside, p), 0);
    assert_int_equal(ckpt__remove_tree(root), CKPT_OK);
    assert_int_equal(access(root, F_OK), -1);
    snprintf(p, sizeof p, "%s/a/b/file", outside);
    tu_assert_file_text(p, "keep");
    assert_int_equal(ckpt__remove_tree(root), CKPT_OK); /* already gone: fine */
}

/* ---- reads -------------------------------------------------------------- */

static void test_map_file_regular_empty_folder_missing(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "m.txt");
    tu_write_text(p, "hello");
    ckpt_mapped m;
    assert_int_equal(ckpt__map_file(p, &m), CKPT_OK);
    assert_int_equal(m.size, 5);
    assert_memory_equal(m.data, "hello", 5);
    ckpt__unmap(&m);
    tu_write_text(p, "");
    assert_int_equal(ckpt__map_file(p, &m), CKPT_OK);
    assert_int_equal(m.size, 0);
    assert_non_null(m.data);
    ckpt__unmap(&m);
    assert_int_equal(ckpt__map_file(f->dir, &m), CKPT_EINVAL);
    tu_assert_errmsg_has("a folder, expected a regular file");
    tu_path(p, sizeof p, f->dir, "absent");
    assert_int_equal(ckpt__map_file(p, &m), CKPT_ENOENT);
    tu_assert_errmsg_has("absent: open");
    ckpt__unmap(NULL);
}

static void test_read_small_file_limits_size(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "r.txt");
    tu_write_text(p, "0123456789");
    char *buf;
    size_t len;
    assert_int_equal(ckpt__read_small_file(p, false, 10, &buf, &len), CKPT_OK);
    assert_int_equal(len, 10);
    assert_int_equal(buf[10], '\0');
    free(buf);
    assert_int_equal(ckpt__read_small_file(p, false, 9, &buf, &len), CKPT_ECORRUPT);
    assert_null(buf);
    tu_assert_errmsg_has("9-byte limit");
    ckpt__fault_arm(CKPT_FAULT_READ, 1, EIO, false);
    assert_int_equal(ckpt__read_small_file(p, false, 10, &buf, &len), CKPT_EIO);
    tu_assert_errmsg_has("r.txt: read");
}

/* ---- fault hook details ------------------------------------------------- */

static void test_fault_counts_only_armed_kinds_and_persist(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "k.bin");
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 2, EIO, true);
    ckpt_ostream s;
    assert_int_equal(ckpt__ostream_open(&s, p), CKPT_OK);
    assert_int_equal(ckpt__ostream_write(&s, "x", 1), CKPT_OK);
    assert_int_equal(ckpt__fault_count(), 0); /* opens and writes are not counted */
    assert_int_equal(ckpt__fault_fired(), false);
    assert_int_equal(ckpt__ostream_finish(&s, NULL, NULL), CKPT_OK); /* fsync #1 */
    assert_int_equal(ckpt__fsync_dir(f->dir), CKPT_EIO);               /* fsync #2 */
    assert_int_equal(ckpt__fsync_dir(f->dir), CKPT_EIO);               /* persists */
    assert_true(ckpt__fault_fired());
    ckpt__fault_arm(CKPT_FAULT_FSYNC, 0, EIO, true); /* n = 0 disarms */
    assert_int_equal(ckpt__fsync_dir(f->dir), CKPT_OK);
}

/* CKPT_FAULT is read at a process's first I/O call, so it is checked in a
 * child process started fresh with the variable set. */
static const char *self_exe;

static int child_main(void) {
    ckpt_ostream s;
    const char *p = getenv("CKPT_TEST_CHILD_PATH");
    int rc = ckpt__ostream_open(&s, p);
    if (rc) return 10;
    rc = ckpt__ostream_write(&s, "a", 1);
    if (rc) return 11;
    rc = ckpt__ostream_write(&s, "b", 1);
    if (rc != CKPT_ENOSPC) return 12;
    ckpt__ostream_abort(&s);
    return 0;
}

static void test_fault_env_variable_arms_the_hook(void **state) {
    fx *f = *state;
    char p[128];
    tu_path(p, sizeof p, f->dir, "env.bin");
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) {
        setenv("CKPT_FAULT", "write+fsync:2:ENOSPC", 1);
        setenv("CKPT_TEST_CHILD", "1", 1);
        setenv("CKPT_TEST_CHILD_PATH", p, 1);
        char *argv[] = {(char *)self_exe, NULL};
        execv(self_exe, argv);
        _exit(99);
    }
    int status = 0;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    assert_true(WIFEXITED(status));
    assert_int_equal(WEXITSTATUS(status), 0);
}

int main(int argc, char **argv) {
    (void)argc;
    if (getenv("CKPT_TEST_CHILD")) return child_main();
    /* The resolved path, not /proc/self/exe: under valgrind that names
     * valgrind's own tool binary. */
    static char exe[4096];
    ssize_t k = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (k > 0) exe[k] = '\0';
    self_exe = k > 0 ? exe : "/proc/self/exe";
    (void)argv;
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_ostream_writes_all_bytes_and_checksums_them, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_ostream_pieces_and_both_digests_from_one_pass, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_dry_stream_compares_parts_with_expected_digests, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_ostream_handles_short_writes, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ostream_retries_eintr, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ostream_error_is_sticky_and_named, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ostream_fsync_failure_removes_file, setup, teardown),
        cmocka_unit_test_setup_teardown(test_ostream_open_is_exclusive_and_abort_unlinks, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_publish_file_creates_and_replaces_atomically, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_publish_file_fill_failure_leaves_nothing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_publish_file_every_fault_keeps_old_file, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_publish_file_rejects_folder_paths, setup, teardown),
        cmocka_unit_test_setup_teardown(test_publish_dir_new_and_replace_and_refuse, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_publish_dir_fault_keeps_old_folder, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fsync_dir_reports_failures, setup, teardown),
        cmocka_unit_test_setup_teardown(test_mkdirs_nested_existing_and_file_in_the_way, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_remove_tree_does_not_follow_symlinks, setup, teardown),
        cmocka_unit_test_setup_teardown(test_map_file_regular_empty_folder_missing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_read_small_file_limits_size, setup, teardown),
        cmocka_unit_test_setup_teardown(test_fault_counts_only_armed_kinds_and_persist, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_fault_env_variable_arms_the_hook, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
