/* test_txn.c — the folder transaction that saves, exports and imports share:
 * names it refuses, commit, replace rules, abort, and every fault of the
 * commit leaving either the old state or the new one, never a half. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "base/io.h"
#include "testing/testing.h"
#include "format/manifest.h"
#include "store/txn.h"
#include "helpers/testutil.h"

static void fill(const ckpt_txn *t, const char *text) {
    char p[512];
    tu_write_text(tu_path(p, sizeof p, t->tmp, "file"), text);
}

static void test_txn_refuses_names_that_are_not_folders(void **state) {
    (void)state;
    const char *bad[] = {"", ".", "..", "a/.", "a/..", "a/../", "./"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        ckpt_txn t;
        assert_int_equal(ckpt__txn_begin(&t, bad[i], "export", true, NULL), CKPT_EINVAL);
        tu_assert_errmsg_has("export");
        tu_assert_errmsg_has("not a folder name");
        assert_null(t.tmp);
    }
}

static void test_txn_commit_publishes_and_removes_the_temporary_folder(void **state) {
    (void)state;
    char *target = tu_pathf("%s/deep/er/out//", tu_dir());
    ckpt_txn t;
    assert_int_equal(ckpt__txn_begin(&t, target, "import", true, NULL), CKPT_OK);
    assert_string_equal(t.base, "out");
    char *parent = tu_pathf("%s/deep/er", tu_dir());
    assert_string_equal(t.parent, parent);
    assert_true(tu_exists(t.tmp));
    assert_int_equal(tu_count_hidden_tmp(parent), 1);
    fill(&t, "new");
    assert_int_equal(ckpt__txn_commit(&t, false, NULL), CKPT_OK);
    ckpt__txn_end(&t, NULL);
    char *f = tu_pathf("%s/deep/er/out/file", tu_dir());
    tu_assert_file_text(f, "new");
    assert_int_equal(tu_count_hidden_tmp(parent), 0);
    free(f);
    free(parent);
    free(target);
}

static void test_txn_end_without_commit_aborts(void **state) {
    (void)state;
    char *target = tu_pathf("%s/out", tu_dir());
    ckpt_txn t;
    assert_int_equal(ckpt__txn_begin(&t, target, "export", true, NULL), CKPT_OK);
    fill(&t, "half");
    ckpt__txn_end(&t, NULL);
    assert_false(tu_exists(target));
    assert_int_equal(tu_count_hidden_tmp(tu_dir()), 0);
    ckpt__txn_end(&t, NULL); /* twice is harmless */
    free(target);
}

static void test_txn_never_replaces_unasked_or_a_users_folder(void **state) {
    (void)state;
    char *target = tu_pathf("%s/out", tu_dir());
    char *keep = tu_pathf("%s/out/precious.txt", tu_dir());
    assert_int_equal(mkdir(target, 0755), 0);
    tu_write_text(keep, "mine");
    ckpt_txn t;
    assert_int_equal(ckpt__txn_begin(&t, target, "export", true, NULL), CKPT_OK);
    fill(&t, "new");
    assert_int_equal(ckpt__txn_commit(&t, false, NULL), CKPT_EEXIST);
    tu_assert_errmsg_has("already exists");
    assert_int_equal(ckpt__txn_commit(&t, true, NULL), CKPT_EEXIST);
    tu_assert_errmsg_has("not a checkpoint");
    ckpt__txn_end(&t, NULL);
    tu_assert_file_text(keep, "mine");
    assert_int_equal(tu_count_hidden_tmp(tu_dir()), 0);
    free(keep);
    free(target);
}

static void test_txn_replaces_a_checkpoint_folder(void **state) {
    (void)state;
    char *target = tu_pathf("%s/ck", tu_dir());
    char *man = tu_pathf("%s/ck/" CKPT_MANIFEST_NAME, tu_dir());
    char *file = tu_pathf("%s/ck/file", tu_dir());
    assert_int_equal(mkdir(target, 0755), 0);
    tu_write_text(man, "{}");
    ckpt_txn t;
    assert_int_equal(ckpt__txn_begin(&t, target, "save_state", true, NULL), CKPT_OK);
    fill(&t, "new");
    assert_int_equal(ckpt__txn_commit(&t, true, NULL), CKPT_OK);
    ckpt__txn_end(&t, NULL);
    tu_assert_file_text(file, "new");
    assert_false(tu_exists(man));
    free(file);
    free(man);
    free(target);
}

/* Every single fault of the commit (fsyncs and renames, counted until one
 * runs clean): the commit fails and the target is as before, or it succeeds
 * and the target is the new folder. */
static void test_txn_every_commit_fault_leaves_old_or_new(void **state) {
    (void)state;
    for (int replace = 0; replace <= 1; replace++) {
        for (uint64_t n = 1;; n++) {
            char *target = tu_pathf("%s/f%d_%llu", tu_dir(), replace, (unsigned long long)n);
            char *file = tu_pathf("%s/file", target);
            if (replace) {
                char *man = tu_pathf("%s/" CKPT_MANIFEST_NAME, target);
                assert_int_equal(mkdir(target, 0755), 0);
                tu_write_text(man, "{}");
                tu_write_text(file, "old");
                free(man);
            }
            ckpt_txn t;
            assert_int_equal(ckpt__txn_begin(&t, target, "save_state", true, NULL), CKPT_OK);
            fill(&t, "new");
            ckpt__fault_arm(CKPT_FAULT_FSYNC | CKPT_FAULT_RENAME, n, EIO, false);
            int rc = ckpt__txn_commit(&t, replace, NULL);
            bool fired = ckpt__fault_fired();
            ckpt__fault_disarm();
            ckpt__txn_end(&t, NULL);
            if (rc == 0) {
                tu_assert_file_text(file, "new");
            } else {
                assert_int_equal(rc, CKPT_EIO);
                if (replace) tu_assert_file_text(file, "old");
                else assert_false(tu_exists(target));
            }
            assert_int_equal(tu_count_hidden_tmp(tu_dir()), 0);
            free(file);
            free(target);
            if (!fired) break;
            assert_true(n < 20);
        }
    }
}

/* A process killed (or a machine that lost power) mid-export leaves its
 * temporary folder; after a reboot the next process may even get the same
 * pid. Such a folder, which no live transaction holds, is removed by the
 * next begin for the same target; one a live transaction holds (its flock)
 * is left alone. */
static void test_txn_removes_dead_temporaries_only(void **state) {
    (void)state;
    char *target = tu_pathf("%s/out", tu_dir());
    char *mine = tu_pathf("%s/.out.tmp.%ld", tu_dir(), (long)getpid());
    char *dead = tu_pathf("%s/.out.tmp.999998", tu_dir());
    char *live = tu_pathf("%s/.out.tmp.999999", tu_dir());
    char *other = tu_pathf("%s/.other.tmp.999997", tu_dir());
    const char *all[] = {mine, dead, live, other};
    for (int i = 0; i < 4; i++) {
        assert_int_equal(mkdir(all[i], 0755), 0);
        char p[600];
        tu_write_text(tu_path(p, sizeof p, all[i], "half-written"), "x");
    }
    int fd = open(live, O_RDONLY | O_DIRECTORY);
    assert_true(fd >= 0);
    assert_int_equal(flock(fd, LOCK_EX | LOCK_NB), 0); /* a live transaction's hold */
    ckpt_txn t;
    assert_int_equal(ckpt__txn_begin(&t, target, "export", true, NULL), CKPT_OK);
    assert_string_equal(t.tmp, mine);
    char p[600];
    assert_false(tu_exists(tu_path(p, sizeof p, mine, "half-written"))); /* fresh, empty */
    assert_false(tu_exists(dead));
    assert_true(tu_exists(live));
    assert_true(tu_exists(other)); /* another target's */
    /* while t lives, its folder is held: a second begin leaves it alone */
    ckpt_txn u;
    tu_expect_error(ckpt__txn_begin(&u, target, "export", true, NULL), CKPT_EEXIST, mine);
    assert_true(tu_exists(mine));
    fill(&t, "new");
    assert_int_equal(ckpt__txn_commit(&t, false, NULL), CKPT_OK);
    ckpt__txn_end(&t, NULL);
    assert_true(tu_exists(live));
    close(fd);
    free(target);
    for (int i = 0; i < 4; i++) free((char *)all[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_txn_refuses_names_that_are_not_folders),
        cmocka_unit_test_setup_teardown(test_txn_commit_publishes_and_removes_the_temporary_folder,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_txn_end_without_commit_aborts, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_txn_never_replaces_unasked_or_a_users_folder,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_txn_replaces_a_checkpoint_folder, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_txn_every_commit_fault_leaves_old_or_new,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_txn_removes_dead_temporaries_only, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
