/* test_accelerator.c — save_state / load_state: Accelerate's checkpoint tests
 * ported to C (save limit, resume from a folder, automatic naming, relative
 * project folder, invalid registration, automatic loading, hooks), numbering,
 * locking, leftovers, and every kind of bad input with the in-memory state
 * checked unchanged byte for byte. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "store/store.h"
#include "helpers/testutil.h"

/* ---- a custom stateful object: a counter and a small tensor ------------- */

typedef struct counter {
    int64_t value;
    float w[4];
    int wlen;          /* shape its state_dict declares (4 unless a test changes it) */
    ckpt_dtype wdtype; /* dtype it declares */
    bool extra_key;    /* declare one more key than was saved */
} counter;

static int counter_sd(void *self, ckpt_writer *w) {
    counter *c = self;
    CKPT_TRY(ckpt_write_i64(w, "value", c->value));
    int64_t shape[1] = {c->wlen};
    CKPT_TRY(ckpt_write_tensor(w, "w", c->wdtype, 1, shape, c->w));
    if (c->extra_key) CKPT_TRY(ckpt_write_i64(w, "extra", 1));
    return 0;
}

static int counter_load(void *self, ckpt_reader *r) {
    counter *c = self;
    int64_t v;
    float w[4];
    int64_t shape[1] = {4};
    /* Read everything first, then change the object: nothing half-applied. */
    CKPT_TRY(ckpt_read_i64(r, "value", &v));
    CKPT_TRY(ckpt_read_tensor(r, "w", CKPT_F32, 1, shape, w));
    c->value = v;
    memcpy(c->w, w, sizeof w);
    return 0;
}

static const ckpt_stateful_ops counter_ops = {.state_dict = counter_sd,
                                              .load_state_dict = counter_load};

static void counter_set(counter *c, int64_t v) {
    memset(c, 0, sizeof *c);
    c->value = v;
    c->wlen = 4;
    c->wdtype = CKPT_F32;
    for (int i = 0; i < 4; i++) c->w[i] = (float)v * 0.5f + (float)i;
}

/* Sets c to value v and registers it with acc. */
static void register_counter(ckpt_accelerator *acc, counter *c, int64_t v) {
    counter_set(c, v);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, c), 0);
}

/* ---- folders ------------------------------------------------------------ */

/* Visible entries of a folder (hidden lock and temp names excluded). */
static int count_visible(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] != '.') n++;
    closedir(d);
    return n;
}

/* Collects warnings instead of printing them. */
typedef struct logbuf {
    int n;
    char last[1024];
} logbuf;

static void log_collect(void *user, ckpt_log_level level, const char *msg) {
    logbuf *l = user;
    (void)level;
    l->n++;
    snprintf(l->last, sizeof l->last, "%s", msg);
}

static ckpt_accelerator *new_acc(const char *project, bool automatic, int limit, logbuf *lb) {
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = project;
    cfg.automatic_checkpoint_naming = automatic;
    cfg.total_limit = limit;
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    if (lb) ckpt_accelerator_set_log(acc, log_collect, lb);
    return acc;
}

/* ---- Accelerate's checkpoint tests --------------------------------------- */

static void test_save_state_with_total_limit_1_keeps_one_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 1, NULL);
    counter c;
    register_counter(acc, &c, 1);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    c.value = 2;
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    char *cd = tu_pathf("%s/checkpoints", t);
    assert_int_equal(count_visible(cd), 1);
    char *c1 = tu_pathf("%s/checkpoint_1", cd);
    assert_true(tu_exists(c1));
    free(c1);
    free(cd);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

static void test_total_limit_2_with_11_saves_leaves_checkpoint_9_and_10(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 2, NULL);
    counter c;
    register_counter(acc, &c, 0);
    for (int i = 0; i < 11; i++) {
        c.value = i;
        assert_int_equal(ckpt_save_state(acc, NULL), 0);
    }
    char *cd = tu_pathf("%s/checkpoints", t);
    assert_int_equal(count_visible(cd), 2);
    /* The rotated folders' files are deleted in the background. */
    assert_int_equal(ckpt_save_wait(acc), 0);
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    char *c9 = tu_pathf("%s/checkpoint_9", cd), *c10 = tu_pathf("%s/checkpoint_10", cd);
    assert_true(tu_exists(c9));
    assert_true(tu_exists(c10));
    assert_int_equal(ckpt_accelerator_iteration(acc), 11);
    free(c9);
    free(c10);
    free(cd);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

static void test_load_state_from_explicit_folder_restores_saved_state(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/initial", t);
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter c;
    counter_set(&c, 7);
    counter saved = c;
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &c), 0);
    ckpt_set_seed(acc, 42);
    ckpt_rng rng_saved = *ckpt_accelerator_rng(acc);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    assert_string_equal(ckpt_accelerator_last_dir(acc), dir);
    /* "train" */
    counter_set(&c, 99);
    (void)ckpt_rng_u32(ckpt_accelerator_rng(acc));
    assert_int_equal(ckpt_load_state(acc, dir), 0);
    assert_memory_equal(&c, &saved, sizeof c);
    assert_memory_equal(ckpt_accelerator_rng(acc), &rng_saved, sizeof rng_saved);
    ckpt_accelerator_free(acc);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_automatic_naming_then_explicit_loads_of_checkpoint_0_and_1(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    ckpt_accelerator_set_step(acc, 10);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    counter first = c;
    counter_set(&c, 2);
    ckpt_accelerator_set_step(acc, 20);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    counter second = c;
    counter_set(&c, 3);
    char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", t), *c1 = tu_pathf("%s/checkpoints/checkpoint_1", t);
    assert_int_equal(ckpt_load_state(acc, c0), 0);
    assert_memory_equal(&c, &first, sizeof c);
    assert_int_equal(ckpt_accelerator_step(acc), 10);
    assert_int_equal(ckpt_load_state(acc, c1), 0);
    assert_memory_equal(&c, &second, sizeof c);
    assert_int_equal(ckpt_accelerator_step(acc), 20);
    /* Loading an older checkpoint never makes the numbering collide. */
    assert_int_equal(ckpt_load_state(acc, c0), 0);
    assert_int_equal(ckpt_accelerator_iteration(acc), 2);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    char *c2 = tu_pathf("%s/checkpoints/checkpoint_2", t);
    assert_true(tu_exists(c2));
    free(c0);
    free(c1);
    free(c2);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

static void test_relative_project_dir_and_load_state_null(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char cwd[4096];
    assert_non_null(getcwd(cwd, sizeof cwd));
    assert_int_equal(chdir(t), 0);
    ckpt_accelerator *acc = new_acc("proj/run", true, 0, NULL);
    counter c;
    counter_set(&c, 5);
    counter saved = c;
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &c), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    assert_true(tu_exists("proj/run/checkpoints/checkpoint_0/checkpoint.json"));
    counter_set(&c, 6);
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_memory_equal(&c, &saved, sizeof c);
    assert_string_equal(ckpt_accelerator_last_dir(acc), "proj/run/checkpoints/checkpoint_0");
    ckpt_accelerator_free(acc);
    assert_int_equal(chdir(cwd), 0);
    tu_tmpdir_free(t);
}

static int no_load(void *self, ckpt_reader *r) {
    (void)self;
    (void)r;
    return 0;
}

static void test_register_for_checkpointing_rejects_invalid_objects_naming_them(void **st) {
    (void)st;
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter a, b;
    counter_set(&a, 1);
    counter_set(&b, 2);
    assert_int_equal(ckpt_register_for_checkpointing(acc, NULL, &a), CKPT_EINVAL);
    tu_assert_errmsg_has("custom object 0");
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &a), 0);
    ckpt_stateful_ops no_sd = {.state_dict = NULL, .load_state_dict = no_load};
    assert_int_equal(ckpt_register_for_checkpointing(acc, &no_sd, &b), CKPT_EINVAL);
    tu_assert_errmsg_has("custom object 1");
    tu_assert_errmsg_has("state_dict");
    ckpt_stateful_ops no_ld = {.state_dict = counter_sd, .load_state_dict = NULL};
    assert_int_equal(ckpt_register_for_checkpointing(acc, &no_ld, &b), CKPT_EINVAL);
    tu_assert_errmsg_has("custom object 1");
    tu_assert_errmsg_has("load_state_dict");
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &a), CKPT_EEXIST);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &b), 0);
    ckpt_accelerator_free(acc);
}

static void test_load_state_null_picks_the_newest_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 0);
    for (int i = 0; i < 3; i++) {
        counter_set(&c, i * 10);
        ckpt_accelerator_set_step(acc, i);
        assert_int_equal(ckpt_save_state(acc, NULL), 0);
    }
    counter last = c;
    ckpt_accelerator_free(acc);
    /* A fresh run over the same project resumes from checkpoint_2. */
    acc = new_acc(t, true, 0, NULL);
    register_counter(acc, &c, 1234);
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_memory_equal(&c, &last, sizeof c);
    assert_int_equal(ckpt_accelerator_step(acc), 2);
    assert_int_equal(ckpt_accelerator_iteration(acc), 3);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

typedef struct hook_log {
    int calls;
    char dir[4096];
    bool existed; /* dir was a folder when the hook ran */
} hook_log;

static int record_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    hook_log *h = user;
    (void)acc;
    h->calls++;
    snprintf(h->dir, sizeof h->dir, "%s", dir);
    struct stat sb;
    h->existed = stat(dir, &sb) == 0 && S_ISDIR(sb.st_mode);
    return 0;
}

static int failing_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)user;
    (void)acc;
    (void)dir;
    return CKPT_EINVAL;
}

static void test_save_and_load_hooks_run_and_stop_after_removal(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    hook_log sh = {0}, lh = {0}, sp = {0}, lp = {0};
    ckpt_hook_handle *hs = NULL, *hl = NULL, *hsp = NULL, *hlp = NULL;
    assert_int_equal(ckpt_register_save_state_pre_hook(acc, record_hook, &sh, &hs), 0);
    assert_int_equal(ckpt_register_load_state_pre_hook(acc, record_hook, &lh, &hl), 0);
    assert_int_equal(ckpt_register_save_state_post_hook(acc, record_hook, &sp, &hsp), 0);
    assert_int_equal(ckpt_register_load_state_post_hook(acc, record_hook, &lp, &hlp), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", t);
    char *tmp0 = tu_pathf("%s/checkpoints/.checkpoint_0.tmp.%d", t, (int)getpid());
    /* The pre-hook gets the temporary folder being written, which exists;
     * the post-hook the final folder, after the commit. */
    assert_int_equal(sh.calls, 1);
    assert_string_equal(sh.dir, tmp0);
    assert_true(sh.existed);
    assert_int_equal(sp.calls, 1);
    assert_string_equal(sp.dir, c0);
    assert_true(sp.existed);
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_int_equal(lh.calls, 1);
    assert_string_equal(lh.dir, c0);
    assert_int_equal(lp.calls, 1);
    assert_string_equal(lp.dir, c0);
    ckpt_hook_remove(hs);
    ckpt_hook_remove(hl);
    ckpt_hook_remove(hsp);
    ckpt_hook_remove(hlp);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_int_equal(sh.calls, 1);
    assert_int_equal(lh.calls, 1);
    assert_int_equal(sp.calls, 1);
    assert_int_equal(lp.calls, 1);
    /* A failing save hook aborts the save before anything is written. */
    ckpt_hook_handle *hf = NULL;
    assert_int_equal(ckpt_register_save_state_pre_hook(acc, failing_hook, NULL, &hf), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_EINVAL);
    char *cd = tu_pathf("%s/checkpoints", t);
    assert_int_equal(count_visible(cd), 2);
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    ckpt_hook_remove(hf);
    /* A handle never removed is freed with the accelerator (ASan checks). */
    assert_int_equal(ckpt_register_save_state_pre_hook(acc, record_hook, &sh, NULL), 0);
    assert_int_equal(ckpt_register_load_state_post_hook(acc, record_hook, &sh, NULL), 0);
    free(cd);
    free(tmp0);
    free(c0);
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

/* ---- files a save pre-hook writes, post-hooks ---------------------------- */

/* A save pre-hook that writes what its mode says into the folder it gets. */
typedef struct writer_hook {
    const char *mode;
    const char *text;    /* contents of notes.txt */
    const char *appear;  /* "folder": create this folder with a user's file in it */
} writer_hook;

static int writing_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    writer_hook *h = user;
    (void)acc;
    char p[4200];
    if (h->appear) {
        assert_int_equal(mkdir(h->appear, 0755), 0);
        tu_write_text(tu_path(p, sizeof p, h->appear, "mine.txt"), "user data");
    }
    if (strcmp(h->mode, "notes") == 0) {
        tu_write_text(tu_path(p, sizeof p, dir, "notes.txt"), h->text);
        tu_write_text(tu_path(p, sizeof p, dir, "config.json"), "{\"hidden\": 256}");
    } else if (strcmp(h->mode, "folder") == 0) {
        assert_int_equal(mkdir(tu_path(p, sizeof p, dir, "tokenizer"), 0755), 0);
    } else if (strcmp(h->mode, "link") == 0) {
        assert_int_equal(symlink("/etc/hostname", tu_path(p, sizeof p, dir, "link.txt")), 0);
    } else if (strcmp(h->mode, "hidden") == 0) {
        tu_write_text(tu_path(p, sizeof p, dir, ".secret"), "x");
    } else if (strcmp(h->mode, "manifest") == 0) {
        tu_write_text(tu_path(p, sizeof p, dir, "checkpoint.json"), "{}");
    } else if (strcmp(h->mode, "ours") == 0) {
        tu_write_text(tu_path(p, sizeof p, dir, "custom_checkpoint_0.safetensors"), "x");
    } else if (strcmp(h->mode, "dots") == 0) {
        tu_write_text(tu_path(p, sizeof p, dir, "a..b"), "x");
    }
    return 0;
}

/* Finds name in dir's manifest; fails the test if absent. */
static ckpt_checkpoint_file manifest_entry(const char *dir, const char *name) {
    ckpt_checkpoint_file *v = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_checkpoint_files(dir, &v, &n), CKPT_OK);
    ckpt_checkpoint_file found;
    memset(&found, 0, sizeof found);
    for (int64_t i = 0; i < n; i++)
        if (strcmp(v[i].name, name) == 0) found = v[i];
    free(v);
    if (!found.name[0]) fail_msg("%s: %s is not in the manifest", dir, name);
    return found;
}

static void test_files_a_save_pre_hook_writes_are_part_of_the_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 7);
    writer_hook wh = {"notes", "trained on shard 3\n", NULL};
    assert_int_equal(ckpt_register_save_state_pre_hook(acc, writing_hook, &wh, NULL), 0);
    char *explicit_dir = tu_pathf("%s/explicit", t);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    assert_int_equal(ckpt_save_state(acc, explicit_dir), 0);
    char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", t);
    const char *dirs[2] = {c0, explicit_dir};
    for (int i = 0; i < 2; i++) {
        char p[4200];
        tu_assert_file_text(tu_path(p, sizeof p, dirs[i], "notes.txt"), wh.text);
        ckpt_checkpoint_file f = manifest_entry(dirs[i], "notes.txt");
        assert_string_equal(f.kind, "extra");
        assert_int_equal(f.size, strlen(wh.text));
        assert_true(f.xxh3 == ckpt__xxh3(wh.text, strlen(wh.text)));
        assert_string_equal(manifest_entry(dirs[i], "config.json").kind, "extra");
        assert_string_equal(manifest_entry(dirs[i], "custom_checkpoint_0.safetensors").kind, "custom");
        ckpt_checkpoint_info info;
        assert_int_equal(ckpt_checkpoint_verify(dirs[i], true, &info), CKPT_OK);
        assert_int_equal(info.num_files, 4); /* custom, random state, 2 extra */
    }
    assert_int_equal(tu_count_hidden_tmp(t), 0);
    /* Loads verify them: a changed extra file makes the checkpoint corrupt. */
    assert_int_equal(ckpt_load_state(acc, explicit_dir), CKPT_OK);
    char *notes = tu_pathf("%s/notes.txt", explicit_dir);
    tu_flip_byte(notes, 0);
    ckpt_checkpoint_info info;
    tu_expect_error(ckpt_checkpoint_verify(explicit_dir, true, &info), CKPT_ECORRUPT,
                    "notes.txt: checksum mismatch");
    tu_expect_error(ckpt_load_state(acc, explicit_dir), CKPT_ECORRUPT, "notes.txt: checksum mismatch");
    ckpt_accelerator_free(acc);
    free(notes);
    free(c0);
    free(explicit_dir);
    tu_tmpdir_free(t);
}

static void test_a_save_pre_hook_may_write_only_plain_regular_files(void **st) {
    (void)st;
    static const struct {
        const char *mode, *needle;
    } cases[] = {
        {"folder", "'tokenizer', which is a folder"},
        {"link", "'link.txt', which is a symbolic link"},
        {"hidden", "'.secret', which is not a name a checkpoint can list"},
        {"dots", "'a..b', which is not a name a checkpoint can list"},
        {"manifest", "'checkpoint.json', which is the manifest's name"},
        {"ours", "'custom_checkpoint_0.safetensors', which is the name of one of the checkpoint's "
                 "state files"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        char *t = tu_tmpdir_new("acc");
        ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
        counter c;
        register_counter(acc, &c, 1);
        writer_hook wh = {cases[i].mode, NULL, NULL};
        assert_int_equal(ckpt_register_save_state_pre_hook(acc, writing_hook, &wh, NULL), 0);
        tu_expect_error(ckpt_save_state(acc, NULL), CKPT_EINVAL, cases[i].needle);
        tu_assert_errmsg_has("a save pre-hook wrote");
        char *cd = tu_pathf("%s/checkpoints", t);
        assert_int_equal(count_visible(cd), 0);
        assert_int_equal(tu_count_hidden_tmp(cd), 0);
        free(cd);
        ckpt_accelerator_free(acc);
        tu_tmpdir_free(t);
    }
}

static void test_an_explicit_save_never_replaces_a_folder_that_appeared_meanwhile(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, false, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    char *target = tu_pathf("%s/out", t);
    writer_hook wh = {"none", NULL, target}; /* the folder appears while the save runs */
    assert_int_equal(ckpt_register_save_state_pre_hook(acc, writing_hook, &wh, NULL), 0);
    tu_expect_error(ckpt_save_state(acc, target), CKPT_EEXIST,
                    "is not empty and is not a checkpoint");
    char *mine = tu_pathf("%s/mine.txt", target);
    tu_assert_file_text(mine, "user data");
    assert_int_equal(count_visible(target), 1);
    assert_int_equal(tu_count_hidden_tmp(t), 0);
    ckpt_accelerator_free(acc);
    free(mine);
    free(target);
    tu_tmpdir_free(t);
}

static int failing_post_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)acc;
    (void)dir;
    int *calls = user;
    (*calls)++;
    return ckpt_set_error(CKPT_EIO, "upload to the archive failed");
}

static void test_a_failing_post_hook_is_a_warning_and_the_save_stands(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    logbuf lb = {0};
    ckpt_accelerator *acc = new_acc(t, true, 0, &lb);
    counter c;
    register_counter(acc, &c, 1);
    int calls = 0;
    hook_log after = {0};
    assert_int_equal(ckpt_register_save_state_post_hook(acc, failing_post_hook, &calls, NULL), 0);
    assert_int_equal(ckpt_register_save_state_post_hook(acc, record_hook, &after, NULL), 0);
    assert_int_equal(ckpt_register_load_state_post_hook(acc, failing_post_hook, &calls, NULL), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    assert_int_equal(calls, 1);
    assert_int_equal(after.calls, 1); /* the next post-hook still ran */
    assert_int_equal(lb.n, 1);
    char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", t);
    char want[4400];
    snprintf(want, sizeof want,
             "save_state: %s: a save_state post-hook failed: upload to the archive failed", c0);
    assert_string_equal(lb.last, want);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(c0, true, &info), CKPT_OK);
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_OK);
    assert_int_equal(calls, 2);
    assert_int_equal(lb.n, 2);
    tu_assert_contains(lb.last, "a load_state post-hook failed: upload to the archive failed");
    ckpt_accelerator_free(acc);
    free(c0);
    tu_tmpdir_free(t);
}

/* ---- after a failed load, saves refuse ----------------------------------- */

/* Saves three automatic checkpoints of a counter with value 5 into t. */
/* Each with its own copy of every file (no links to the previous one's
 * unchanged files): the tests corrupt one checkpoint's file at a time. */
static void three_checkpoints(const char *t) {
    ckpt_project_config cfg = {.project_dir = t,
                               .automatic_checkpoint_naming = true,
                               .total_limit = 2,
                               .no_link_unchanged = true};
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    counter c;
    register_counter(acc, &c, 5);
    for (int i = 0; i < 3; i++) assert_int_equal(ckpt_save_state(acc, NULL), 0);
    ckpt_accelerator_free(acc);
}

static void test_saves_refuse_after_a_failed_load_until_start_over(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    three_checkpoints(t); /* checkpoint_1 and checkpoint_2 remain (total_limit 2) */
    char *cd = tu_pathf("%s/checkpoints", t);
    char *c1 = tu_pathf("%s/checkpoint_1", cd);
    char *c2 = tu_pathf("%s/checkpoint_2", cd);
    char *mine = tu_pathf("%s/mine", t);
    /* The run's configuration changed: its counter's tensor has 3 elements. */
    ckpt_accelerator *acc = new_acc(t, true, 2, NULL);
    counter c;
    register_counter(acc, &c, 1);
    c.wlen = 3;
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_EMISMATCH);
    char load_msg[2048];
    snprintf(load_msg, sizeof load_msg, "%s", ckpt_errmsg());
    /* Automatic saves (which would rotate checkpoint_1 and 2 away) and
     * explicit saves refuse, quoting the load's error. */
    for (int i = 0; i < 2; i++) {
        tu_expect_error(ckpt_save_state(acc, i ? mine : NULL), CKPT_EINVAL,
                        "refused: the last load_state of this accelerator failed (CKPT_EMISMATCH: ");
        tu_assert_errmsg_has(load_msg);
        tu_assert_errmsg_has("ckpt_accelerator_start_over");
    }
    assert_int_equal(count_visible(cd), 2);
    assert_true(tu_exists(c1) && tu_exists(c2) && !tu_exists(mine));
    /* A load that succeeds lifts it. */
    c.wlen = 4;
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_OK);
    assert_int_equal(c.value, 5);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    char *c3 = tu_pathf("%s/checkpoint_3", cd);
    assert_string_equal(ckpt_accelerator_last_dir(acc), c3);
    free(c3);
    ckpt_accelerator_free(acc);

    /* So does starting over, said explicitly. */
    acc = new_acc(t, true, 2, NULL);
    register_counter(acc, &c, 1);
    c.wlen = 3;
    assert_int_equal(ckpt_load_state(acc, c2), CKPT_EMISMATCH);
    tu_expect_error(ckpt_save_state(acc, NULL), CKPT_EINVAL, "CKPT_EMISMATCH");
    assert_int_equal(ckpt_accelerator_start_over(acc), CKPT_OK);
    assert_int_equal(ckpt_accelerator_start_over(NULL), CKPT_EINVAL);
    c.wlen = 4;
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    ckpt_accelerator_free(acc);

    /* Only corrupt checkpoints: refused as well. */
    char *t2 = tu_tmpdir_new("acc");
    three_checkpoints(t2);
    for (int n = 1; n <= 2; n++) {
        char *f = tu_pathf("%s/checkpoints/checkpoint_%d/custom_checkpoint_0.safetensors", t2, n);
        tu_flip_byte(f, -2);
        free(f);
    }
    acc = new_acc(t2, true, 2, NULL);
    logbuf lb = {0};
    ckpt_accelerator_set_log(acc, log_collect, &lb);
    register_counter(acc, &c, 1);
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_ECORRUPT);
    tu_expect_error(ckpt_save_state(acc, NULL), CKPT_EINVAL, "(CKPT_ECORRUPT: load_state: no valid checkpoint");
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t2);
    free(mine);
    free(c2);
    free(c1);
    free(cd);
    tu_tmpdir_free(t);
}

static void test_no_checkpoint_at_all_is_enoent_and_saves_stay_allowed(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    tu_expect_error(ckpt_load_state(acc, NULL), CKPT_ENOENT, "no checkpoint in");
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    /* An explicit folder that is not there is no fresh start (a typo): an
     * error, and saves refuse until the run starts over deliberately. */
    char *missing = tu_pathf("%s/not_there", t);
    tu_expect_error(ckpt_load_state(acc, missing), CKPT_EINVAL, "no such checkpoint folder");
    tu_expect_error(ckpt_save_state(acc, missing), CKPT_EINVAL, "refused");
    assert_int_equal(ckpt_accelerator_start_over(acc), CKPT_OK);
    assert_int_equal(ckpt_save_state(acc, missing), CKPT_OK);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    ckpt_accelerator_free(acc);
    free(missing);
    tu_tmpdir_free(t);
}

/* load_state_dict reads a key its state_dict does not declare. */
static int reads_an_undeclared_key(void *self, ckpt_reader *r) {
    int64_t v;
    CKPT_TRY(ckpt_read_i64(r, "undeclared", &v));
    ((counter *)self)->value = v;
    return 0;
}

static void test_a_missing_key_while_loading_is_a_mismatch_not_enoent(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    three_checkpoints(t);
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    counter_set(&c, 1);
    static const ckpt_stateful_ops ops = {.state_dict = counter_sd,
                                          .load_state_dict = reads_an_undeclared_key};
    assert_int_equal(ckpt_register_for_checkpointing(acc, &ops, &c), 0);
    /* CKPT_ENOENT would read as "no checkpoint: start from scratch". */
    tu_expect_error(ckpt_load_state(acc, NULL), CKPT_EMISMATCH, "no key 'undeclared'");
    tu_expect_error(ckpt_save_state(acc, NULL), CKPT_EINVAL, "CKPT_EMISMATCH");
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

/* ---- messages about the error -------------------------------------------- */

static int fails_silently(void *self, ckpt_reader *r) {
    (void)self;
    (void)r;
    return CKPT_EINVAL;
}

static int refuses_silently(void *self, ckpt_reader *r) {
    (void)self;
    (void)r;
    return CKPT_EMISMATCH;
}

static int refuses_with_a_reason(void *self, ckpt_reader *r) {
    (void)self;
    (void)r;
    return ckpt_set_error(CKPT_EMISMATCH, "vocabulary: %d tokens saved, %d here", 50257, 32000);
}

static void test_callback_failures_are_named_without_stale_messages(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    /* A project with a model, an optimizer, a scheduler (whose load probes
     * for a second group: "no key 'base_lrs.1'") and a custom object. */
    float w[2] = {1, 2}, g[2] = {0, 0};
    int64_t shape[1] = {2};
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_scheduler *s = NULL;
    assert_int_equal(ckpt_model_new(&m), 0);
    assert_int_equal(ckpt_model_add_param(m, "w", CKPT_F32, 1, shape, w, g), 0);
    assert_int_equal(ckpt_sgd_new(&o, m, 0.1, 0, 0, false), 0);
    assert_int_equal(ckpt_steplr_new(&s, o, 2, 0.5), 0);
    counter c;
    static const ckpt_stateful_ops silent_load = {.state_dict = counter_sd,
                                                  .load_state_dict = fails_silently};
    static const ckpt_stateful_ops silent_check = {.state_dict = counter_sd,
                                                   .load_state_dict = counter_load,
                                                   .check_state_dict = refuses_silently};
    static const ckpt_stateful_ops reasoned_check = {.state_dict = counter_sd,
                                                     .load_state_dict = counter_load,
                                                     .check_state_dict = refuses_with_a_reason};
    const ckpt_stateful_ops *ops[3] = {&silent_load, &silent_check, &reasoned_check};
    const char *want[3] = {
        ("custom_checkpoint_0.safetensors (state partially loaded: 3 of 5 objects were loaded "
         "before this one): load_state_dict returned CKPT_EINVAL"),
        "custom_checkpoint_0.safetensors: check_state_dict returned CKPT_EMISMATCH",
        "custom_checkpoint_0.safetensors: vocabulary: 50257 tokens saved, 32000 here"};
    int code[3] = {CKPT_EINVAL, CKPT_EMISMATCH, CKPT_EMISMATCH};
    for (int i = 0; i < 3; i++) {
        ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
        assert_int_equal(ckpt_prepare_model(acc, m), 0);
        assert_int_equal(ckpt_prepare_optimizer(acc, o), 0);
        assert_int_equal(ckpt_prepare_scheduler(acc, s), 0);
        counter_set(&c, 1);
        assert_int_equal(ckpt_register_for_checkpointing(acc, ops[i], &c), 0);
        if (i == 0) assert_int_equal(ckpt_save_state(acc, NULL), 0);
        char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", t);
        assert_int_equal(ckpt_load_state(acc, NULL), code[i]);
        char full[4400];
        snprintf(full, sizeof full, "load_state: %s: %s", c0, want[i]);
        assert_string_equal(ckpt_errmsg(), full);
        free(c0);
        ckpt_accelerator_free(acc);
    }
    /* A prefix with no cause to append is the prefix alone. */
    ckpt_clear_error();
    assert_int_equal(ckpt__err_prefix(CKPT_EIO, "save_state: %s", "x"), CKPT_EIO);
    assert_string_equal(ckpt_errmsg(), "save_state: x");
    assert_int_equal(ckpt_set_error(CKPT_EBUSY, "held by %d", 42), CKPT_EBUSY);
    assert_string_equal(ckpt_errmsg(), "held by 42");
    assert_int_equal(ckpt_set_error(CKPT_EIO, NULL), CKPT_EIO);
    assert_string_equal(ckpt_errmsg(), "");
    ckpt_scheduler_free(s);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    tu_tmpdir_free(t);
}

/* ---- numbering, naming, locking, leftovers ------------------------------ */

static void test_save_state_null_without_automatic_naming_is_einval(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, false, 0, NULL);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_EINVAL);
    tu_assert_errmsg_has("automatic_checkpoint_naming");
    ckpt_accelerator_free(acc);
    acc = new_acc(NULL, true, 0, NULL);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_EINVAL);
    tu_assert_errmsg_has("project_dir");
    ckpt_accelerator_free(acc);
    tu_tmpdir_free(t);
}

static void test_new_run_numbers_after_existing_checkpoints(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    counter c;
    counter_set(&c, 1);
    for (int run = 0; run < 2; run++) {
        /* Each run starts from iteration 0 as Accelerate's would, and must
         * not collide with the previous run's checkpoints. */
        ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
        assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &c), 0);
        assert_int_equal(ckpt_save_state(acc, NULL), 0);
        assert_int_equal(ckpt_save_state(acc, NULL), 0);
        ckpt_accelerator_free(acc);
    }
    char *c3 = tu_pathf("%s/checkpoints/checkpoint_3", t), *c4 = tu_pathf("%s/checkpoints/checkpoint_4", t);
    assert_true(tu_exists(c3));
    assert_false(tu_exists(c4));
    /* A configured iteration above the existing ones wins. */
    ckpt_project_config cfg = {.project_dir = t, .automatic_checkpoint_naming = true, .iteration = 10};
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    char *c10 = tu_pathf("%s/checkpoints/checkpoint_10", t);
    assert_true(tu_exists(c10));
    ckpt_accelerator_free(acc);
    free(c3);
    free(c4);
    free(c10);
    tu_tmpdir_free(t);
}

static void test_save_state_is_busy_while_another_holds_the_project_lock(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *cd = tu_pathf("%s/checkpoints", t), *lp = tu_pathf("%s/checkpoints/.lock", t);
    assert_int_equal(ckpt__mkdirs(cd), 0);
    ckpt_lock lk;
    assert_int_equal(ckpt__lock_acquire(&lk, lp, false), 0);
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_EBUSY);
    tu_assert_errmsg_has(lp);
    assert_int_equal(count_visible(cd), 0);
    ckpt__lock_release(&lk);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    assert_int_equal(count_visible(cd), 1);
    ckpt_accelerator_free(acc);
    free(cd);
    free(lp);
    tu_tmpdir_free(t);
}

static void test_save_removes_leftover_temp_folders_with_a_warning(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *left = tu_pathf("%s/checkpoints/.checkpoint_4.tmp.99999", t);
    char *leftfile = tu_pathf("%s/model.safetensors", left);
    assert_int_equal(ckpt__mkdirs(left), 0);
    tu_write_text(leftfile, "half");
    logbuf lb = {0};
    ckpt_accelerator *acc = new_acc(t, true, 0, &lb);
    /* Loads ignore leftovers: nothing to load yet. */
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_ENOENT);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    assert_false(tu_exists(left));
    assert_int_equal(lb.n, 1);
    tu_assert_contains(lb.last, ".checkpoint_4.tmp.99999");
    ckpt_accelerator_free(acc);
    free(left);
    free(leftfile);
    tu_tmpdir_free(t);
}

static void test_explicit_save_replaces_an_existing_checkpoint_atomically(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/best", t);
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    counter_set(&c, 2);
    counter second = c;
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    counter_set(&c, 3);
    assert_int_equal(ckpt_load_state(acc, dir), 0);
    assert_memory_equal(&c, &second, sizeof c);
    assert_int_equal(count_visible(t), 1);
    assert_int_equal(tu_count_hidden_tmp(t), 0);
    ckpt_accelerator_free(acc);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_explicit_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/mine", t), *file = tu_pathf("%s/mine/notes.txt", t);
    assert_int_equal(ckpt__mkdirs(dir), 0);
    tu_write_text(file, "precious");
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    assert_int_equal(ckpt_save_state(acc, dir), CKPT_EEXIST);
    tu_assert_errmsg_has("not a checkpoint");
    assert_true(tu_exists(file));
    ckpt_accelerator_free(acc);
    free(dir);
    free(file);
    tu_tmpdir_free(t);
}

static void test_manifest_lists_every_file_with_size_and_digest(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/ck", t);
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter a, b;
    counter_set(&a, 1);
    counter_set(&b, 2);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &a), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &b), 0);
    ckpt_accelerator_set_step(acc, 77);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    assert_int_equal(m.format_version, 1);
    assert_int_equal(m.step, 77);
    assert_int_equal(m.num_processes, 1);
    assert_int_equal(m.nfiles, 3);
    assert_string_equal(m.files[0].name, "custom_checkpoint_0.safetensors");
    assert_string_equal(m.files[0].kind, "custom");
    assert_string_equal(m.files[1].name, "custom_checkpoint_1.safetensors");
    assert_string_equal(m.files[2].name, "random_states_0.safetensors");
    assert_string_equal(m.files[2].kind, "random_states");
    assert_int_equal(m.files[0].ntensors, 1);
    assert_string_equal(m.files[0].tensor_keys[0], "w");
    assert_int_equal(m.files[0].tensor_xxh3[0], ckpt__xxh3(a.w, sizeof a.w));
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    assert_int_equal(info.status, CKPT_CHECKPOINT_COMPLETE);
    assert_int_equal(info.num_files, 3);
    assert_int_equal(info.step, 77);
    assert_string_equal(info.library_version, CKPT_VERSION_STRING);
    uint64_t total = 0;
    for (int64_t i = 0; i < m.nfiles; i++) {
        char *p = tu_pathf("%s/%s", dir, m.files[i].name);
        ckpt_mapped mp;
        assert_int_equal(ckpt__map_file(p, &mp), 0);
        assert_int_equal(mp.size, m.files[i].size);
        assert_int_equal(ckpt__xxh3(mp.data, (size_t)mp.size), m.files[i].xxh3);
        total += mp.size;
        ckpt__unmap(&mp);
        free(p);
    }
    assert_int_equal(info.total_bytes, total);
    ckpt__manifest_clear(&m);
    ckpt_accelerator_free(acc);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_checkpoint_list_and_prune(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    for (int i = 0; i < 4; i++) assert_int_equal(ckpt_save_state(acc, NULL), 0);
    /* An interrupted save's folder under a final name (as another tool
     * might leave): listed as partial. */
    char *p = tu_pathf("%s/checkpoints/checkpoint_9", t);
    assert_int_equal(ckpt__mkdirs(p), 0);
    ckpt_checkpoint_info *infos = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_checkpoint_list(t, true, &infos, &n), 0);
    assert_int_equal(n, 5);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(infos[i].number, i);
        assert_int_equal(infos[i].status, CKPT_CHECKPOINT_COMPLETE);
    }
    assert_int_equal(infos[4].number, 9);
    assert_int_equal(infos[4].status, CKPT_CHECKPOINT_PARTIAL);
    free(infos);
    /* load_state(NULL) skips the partial one with a warning. */
    logbuf lb = {0};
    ckpt_accelerator_set_log(acc, log_collect, &lb);
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_int_equal(lb.n, 1);
    tu_assert_contains(lb.last, "checkpoint_9");
    int64_t removed = 0;
    /* The run owns its project until it is freed: prune waits for it. */
    assert_int_equal(ckpt_checkpoint_prune(t, 2, &removed), CKPT_EBUSY);
    tu_assert_errmsg_has("held by this process (pid ");
    ckpt_accelerator_free(acc);
    acc = NULL;
    assert_int_equal(ckpt_checkpoint_prune(t, 2, &removed), 0);
    /* Only valid checkpoints count toward keep; the partial one, newer than
     * the newest valid, stays. */
    assert_int_equal(removed, 2);
    assert_int_equal(ckpt_checkpoint_list(t, false, &infos, &n), 0);
    assert_int_equal(n, 3);
    assert_int_equal(infos[0].number, 2);
    assert_int_equal(infos[1].number, 3);
    assert_int_equal(infos[2].number, 9);
    free(infos);
    ckpt_accelerator_free(acc);
    free(p);
    tu_tmpdir_free(t);
}

/* One run per project: the first save or load takes the project lock and
 * the accelerator keeps it until freed; another one is refused at its first
 * save or load with CKPT_EBUSY naming the owner's pid and host, while the
 * read-only calls (list, verify) need no lock. */
static void test_one_run_per_project(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char host[256] = "";
    assert_int_equal(gethostname(host, sizeof host), 0);
    /* the owner is this very process: the message says so, not "another" */
    char *owner = tu_pathf("held by this process (pid %ld) itself: another accelerator of this "
                           "project",
                           (long)getpid());
    (void)host;
    ckpt_accelerator *a = new_acc(t, true, 0, NULL);
    counter ca, cb;
    register_counter(a, &ca, 1);
    assert_int_equal(ckpt_save_state(a, NULL), 0);
    ckpt_accelerator *b = new_acc(t, true, 0, NULL);
    register_counter(b, &cb, 9);
    tu_expect_error(ckpt_load_state(b, NULL), CKPT_EBUSY, owner);
    tu_assert_errmsg_has("load_state: ");
    tu_expect_error(ckpt_save_state(b, NULL), CKPT_EBUSY, owner);
    assert_int_equal(cb.value, 9);
    /* The owner keeps saving; readers need no lock. */
    assert_int_equal(ckpt_save_state(a, NULL), 0);
    ckpt_checkpoint_info *infos = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_checkpoint_list(t, true, &infos, &n), 0);
    assert_int_equal(n, 2);
    free(infos);
    char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", t);
    assert_int_equal(ckpt_checkpoint_verify(c0, true, NULL), 0);
    /* Freed: the next run owns it at its first call. */
    ckpt_accelerator_free(a);
    assert_int_equal(ckpt_load_state(b, NULL), 0);
    assert_int_equal(cb.value, 1);
    a = new_acc(t, true, 0, NULL);
    register_counter(a, &ca, 1);
    tu_expect_error(ckpt_save_state(a, NULL), CKPT_EBUSY, owner);
    ckpt_accelerator_free(a);
    ckpt_accelerator_free(b);
    free(c0);
    free(owner);
    tu_tmpdir_free(t);
}

/* ---- bad input: a clear error and nothing changed in memory ------------- */

/* Saves two counters (values 1, 2) to <t>/ck and returns the folder. */
static char *save_two(const char *t) {
    char *dir = tu_pathf("%s/ck", t);
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter a, b;
    counter_set(&a, 1);
    counter_set(&b, 2);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &a), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &b), 0);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    ckpt_accelerator_free(acc);
    return dir;
}

/* The load expect_load_fails makes: the default (the first load of an
 * accelerator: one pass), or transactional (two passes). */
static bool load_transactional;

/* Loads dir into two fresh counters (values 50, 60), expecting `code` and a
 * message containing `needle`, with both counters and the RNG unchanged
 * (a failure found before anything changes: every failure of a
 * transactional load, and every one but a checksum of a first load). */
static void expect_load_fails(const char *dir, int ncounters, void (*tweak)(counter *), int code,
                              const char *needle) {
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter cs[3];
    memset(cs, 0, sizeof cs); /* compared whole below, unused ones and padding too */
    for (int i = 0; i < ncounters; i++) {
        counter_set(&cs[i], 50 + 10 * i);
        if (tweak && i == 1) tweak(&cs[i]);
        assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &cs[i]), 0);
    }
    ckpt_set_seed(acc, 3);
    counter before[3];
    memcpy(before, cs, sizeof cs);
    ckpt_rng rng_before = *ckpt_accelerator_rng(acc);
    ckpt_load_options o = {.transactional = load_transactional};
    int rc = ckpt_load_state_ex(acc, dir, &o, NULL);
    tu_expect_error(rc, code, needle);
    if (getenv("CKPT_TEST_VERBOSE")) print_message("  %s\n", ckpt_errmsg());
    assert_memory_equal(cs, before, sizeof cs);
    assert_memory_equal(ckpt_accelerator_rng(acc), &rng_before, sizeof rng_before);
    assert_int_equal(ckpt_accelerator_step(acc), 0);
    ckpt_accelerator_free(acc);
}

static void wider(counter *c) { c->wlen = 3; }
static void as_f64(counter *c) { c->wdtype = CKPT_F64; }
static void extra(counter *c) { c->extra_key = true; }

/* Saves two counters into a fresh folder, then expects loading it with
 * `ncounters` counters registered (the second one changed by `tweak`) to
 * fail as expect_load_fails describes. */
static void expect_two_saved_load_fails(int ncounters, void (*tweak)(counter *), int code,
                                        const char *needle) {
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    expect_load_fails(dir, ncounters, tweak, code, needle);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_rejects_shape_mismatch(void **st) {
    (void)st;
    expect_two_saved_load_fails(2, wider, CKPT_EMISMATCH, "'w'");
    expect_two_saved_load_fails(2, wider, CKPT_EMISMATCH, "custom_checkpoint_1.safetensors");
}

static void test_load_state_rejects_dtype_mismatch(void **st) {
    (void)st;
    expect_two_saved_load_fails(2, as_f64, CKPT_EMISMATCH, "'w'");
}

static void test_load_state_rejects_missing_key(void **st) {
    (void)st;
    expect_two_saved_load_fails(2, extra, CKPT_EMISMATCH, "extra");
}

static void test_load_state_rejects_a_different_number_of_objects(void **st) {
    (void)st;
    expect_two_saved_load_fails(3, NULL, CKPT_EMISMATCH,
                                "checkpoint has 2 custom objects, 3 are registered");
    expect_two_saved_load_fails(1, NULL, CKPT_EMISMATCH,
                                "checkpoint has 2 custom objects, 1 is registered");
}

/* ---- values an object refuses after its schema matched ------------------ */

/* A small training setup: a model, an optimizer, a scheduler, a scaler and a
 * data loader, prepared in that order (the data loader last). */
typedef struct setup {
    float w[6], gw[6], b[3], gb[3];
    int64_t data[128];
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_scheduler *s;
    ckpt_grad_scaler *gs;
    ckpt_dataloader *dl;
    ckpt_accelerator *acc;
} setup;

/* Builds the setup over a data set of nsamples, with its own values from
 * `seed`, and trains `steps` steps. */
static void setup_init(setup *u, float seed, int64_t nsamples, ckpt_optim_kind kind,
                       bool warmup_linear, int steps) {
    memset(u, 0, sizeof *u);
    for (int j = 0; j < 6; j++) u->w[j] = seed + 0.25f * (float)j;
    for (int j = 0; j < 3; j++) u->b[j] = seed - 0.5f * (float)j;
    for (int j = 0; j < 128; j++) u->data[j] = j;
    assert_int_equal(ckpt_model_new(&u->m), 0);
    int64_t sw[2] = {2, 3}, sb[1] = {3};
    assert_int_equal(ckpt_model_add_param(u->m, "w", CKPT_F32, 2, sw, u->w, u->gw), 0);
    assert_int_equal(ckpt_model_add_param(u->m, "b", CKPT_F32, 1, sb, u->b, u->gb), 0);
    ckpt_optim_options opt = ckpt_optim_defaults(kind);
    opt.lr = 0.01 * (double)seed;
    assert_int_equal(ckpt_optimizer_new(&u->o, kind, u->m, &opt), 0);
    if (warmup_linear) assert_int_equal(ckpt_warmup_linear_new(&u->s, u->o, 2, 20), 0);
    else assert_int_equal(ckpt_warmup_cosine_new(&u->s, u->o, 2, 20), 0);
    assert_int_equal(ckpt_grad_scaler_new(&u->gs, 1024.0 * seed, 2.0, 0.5, 100), 0);
    ckpt_dataset ds;
    assert_int_equal(ckpt_memory_dataset(&ds, u->data, nsamples, sizeof(int64_t)), 0);
    ckpt_dataloader_config dc = ckpt_dataloader_defaults();
    dc.batch_size = 8;
    dc.shuffle = true;
    dc.seed = 5;
    assert_int_equal(ckpt_dataloader_new(&u->dl, &ds, &dc), 0);
    u->acc = new_acc(NULL, false, 0, NULL);
    ckpt_set_seed(u->acc, (uint64_t)(seed * 100));
    assert_int_equal(ckpt_prepare_model(u->acc, u->m), 0);
    assert_int_equal(ckpt_prepare_optimizer(u->acc, u->o), 0);
    assert_int_equal(ckpt_prepare_scheduler(u->acc, u->s), 0);
    assert_int_equal(ckpt_prepare_scaler(u->acc, u->gs), 0);
    assert_int_equal(ckpt_prepare_dataloader(u->acc, u->dl), 0);
    for (int t = 0; t < steps; t++) {
        ckpt_batch bt;
        assert_int_equal(ckpt_dataloader_next(u->dl, &bt), 1);
        for (int j = 0; j < 6; j++) u->gw[j] = (float)bt.indices[j % bt.size] * 0.01f - 0.3f;
        for (int j = 0; j < 3; j++) u->gb[j] = ckpt_rng_uniform_f32(ckpt_accelerator_rng(u->acc));
        assert_int_equal(ckpt_optimizer_step(u->o), 0);
        assert_int_equal(ckpt_scheduler_step(u->s), 0);
        /* the step follows the optimizer: no ckpt_accelerator_set_step */
    }
}

static void setup_free(setup *u) {
    ckpt_accelerator_free(u->acc);
    ckpt_dataloader_free(u->dl);
    ckpt_grad_scaler_free(u->gs);
    ckpt_scheduler_free(u->s);
    ckpt_optimizer_free(u->o);
    ckpt_model_free(u->m);
}

/* Everything of a setup in memory, byte for byte. */
typedef struct snapshot {
    float w[6], b[3];
    char *bytes[5];
    size_t n[5];
    ckpt_rng rng;
    int64_t step, iteration;
    char last_dir[256];
} snapshot;

static void snap(setup *u, const char *tmp, snapshot *sn) {
    memcpy(sn->w, u->w, sizeof sn->w);
    memcpy(sn->b, u->b, sizeof sn->b);
    const ckpt_stateful_ops *ops[5] = {ckpt_model_ops(), ckpt_optimizer_ops(),
                                       ckpt_scheduler_ops(), ckpt_grad_scaler_ops(),
                                       ckpt_dataloader_ops()};
    void *self[5] = {u->m, u->o, u->s, u->gs, u->dl};
    for (int i = 0; i < 5; i++) {
        char *p = tu_pathf("%s/snap_%d.safetensors", tmp, i);
        sn->bytes[i] = tu_state_bytes(ops[i], self[i], p, &sn->n[i]);
        free(p);
    }
    sn->rng = *ckpt_accelerator_rng(u->acc);
    sn->step = ckpt_accelerator_step(u->acc);
    sn->iteration = ckpt_accelerator_iteration(u->acc);
    snprintf(sn->last_dir, sizeof sn->last_dir, "%s", ckpt_accelerator_last_dir(u->acc));
}

static void snap_free(snapshot *sn) {
    for (int i = 0; i < 5; i++) free(sn->bytes[i]);
}

static void assert_unchanged(setup *u, const char *tmp, const snapshot *before) {
    snapshot now;
    snap(u, tmp, &now);
    assert_memory_equal(now.w, before->w, sizeof now.w);
    assert_memory_equal(now.b, before->b, sizeof now.b);
    static const char *const what[5] = {"model", "optimizer", "scheduler", "scaler", "dataloader"};
    for (int i = 0; i < 5; i++) {
        if (now.n[i] != before->n[i] || memcmp(now.bytes[i], before->bytes[i], now.n[i]) != 0)
            fail_msg("the %s's state changed", what[i]);
    }
    assert_memory_equal(&now.rng, &before->rng, sizeof now.rng);
    assert_int_equal(now.step, before->step);
    assert_int_equal(now.iteration, before->iteration);
    assert_string_equal(now.last_dir, before->last_dir);
    snap_free(&now);
}

/* Saves a setup over `n_saved` samples, loads it into one that differs as
 * given, expecting `code` and a message with both needles, and everything
 * in memory unchanged. */
static void expect_value_refused(int64_t n_saved, ckpt_optim_kind k_saved, bool lin_saved,
                                 int64_t n_mine, ckpt_optim_kind k_mine, bool lin_mine, int code,
                                 const char *needle1, const char *needle2) {
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/ck", t);
    setup a, b;
    setup_init(&a, 1.0f, n_saved, k_saved, lin_saved, 5);
    assert_int_equal(ckpt_save_state(a.acc, dir), 0);
    setup_init(&b, 2.0f, n_mine, k_mine, lin_mine, 3);
    snapshot before;
    snap(&b, t, &before);
    int rc = ckpt_load_state(b.acc, dir);
    tu_expect_error(rc, code, needle1);
    tu_assert_errmsg_has(needle2);
    if (getenv("CKPT_TEST_VERBOSE")) print_message("  %s\n", ckpt_errmsg());
    assert_unchanged(&b, t, &before);
    snap_free(&before);
    setup_free(&b);
    /* The same load into a setup that matches succeeds: only the value above
     * stood in the way. */
    setup c;
    setup_init(&c, 2.0f, n_saved, k_saved, lin_saved, 3);
    assert_int_equal(ckpt_load_state(c.acc, dir), 0);
    assert_memory_equal(c.w, a.w, sizeof c.w);
    assert_memory_equal(c.b, a.b, sizeof c.b);
    assert_int_equal(ckpt_accelerator_step(c.acc), 5);
    setup_free(&c);
    setup_free(&a);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_refuses_a_dataloader_of_another_dataset_changing_nothing(void **st) {
    (void)st;
    /* model, optimizer, scheduler and scaler all match and would load first */
    expect_value_refused(100, CKPT_OPTIM_ADAMW, false, 120, CKPT_OPTIM_ADAMW, false,
                         CKPT_EMISMATCH, "dataloader.safetensors",
                         "dataloader: dataset_length: saved 100, this loader has 120");
}

static void test_load_state_refuses_an_optimizer_of_another_kind_changing_nothing(void **st) {
    (void)st;
    /* Adam and AdamW have the same keys: only the "kind" value differs */
    expect_value_refused(100, CKPT_OPTIM_ADAM, false, 100, CKPT_OPTIM_ADAMW, false,
                         CKPT_EMISMATCH, "optimizer.safetensors",
                         "the state dict is for an adam optimizer, this one is adamw");
}

static void test_load_state_refuses_a_scheduler_of_another_kind_changing_nothing(void **st) {
    (void)st;
    expect_value_refused(100, CKPT_OPTIM_ADAMW, true, 100, CKPT_OPTIM_ADAMW, false,
                         CKPT_EMISMATCH, "scheduler.safetensors",
                         "the state dict is for warmup_linear, this scheduler is warmup_cosine");
}

/* Past the checks no built-in load allocates: an allocation failure anywhere
 * in a load of every kind of object is a clean ENOMEM with nothing changed. */
static void test_load_state_of_every_kind_changes_nothing_at_any_failed_allocation(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/ck", t);
    setup a, b;
    setup_init(&a, 1.0f, 100, CKPT_OPTIM_ADAMW, false, 5);
    assert_int_equal(ckpt_save_state(a.acc, dir), 0);
    setup_init(&b, 2.0f, 100, CKPT_OPTIM_ADAMW, false, 3);
    snapshot before;
    snap(&b, t, &before);
    int failures = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 10000);
        ckpt__alloc_fail_after(n);
        int rc = ckpt_load_state(b.acc, dir);
        ckpt__alloc_fail_after(0);
        if (rc == 0) break;
        if (rc != CKPT_ENOMEM) fail_msg("allocation %llu: %d %s", (unsigned long long)n, rc, ckpt_errmsg());
        failures++;
        assert_unchanged(&b, t, &before);
    }
    assert_true(failures > 5);
    assert_memory_equal(b.w, a.w, sizeof b.w);
    assert_int_equal(ckpt_accelerator_step(b.acc), 5);
    snap_free(&before);
    setup_free(&b);
    setup_free(&a);
    free(dir);
    tu_tmpdir_free(t);
}

/* A custom object with a value check: accepts a saved value up to max. */
typedef struct picky {
    int64_t value, max;
    int id;
    char *trace; /* calls appended here: "c<id>" for a check, "l<id>" for a load */
} picky;

static int picky_sd(void *self, ckpt_writer *w) {
    return ckpt_write_i64(w, "value", ((picky *)self)->value);
}

static int picky_read(picky *p, ckpt_reader *r, int64_t *v) {
    CKPT_TRY(ckpt_read_i64(r, "value", v));
    if (*v > p->max)
        return ckpt__err(CKPT_EMISMATCH, "picky: value: saved %lld, this object takes at most %lld",
                         (long long)*v, (long long)p->max);
    return 0;
}

static void picky_log(picky *p, char what) {
    if (p->trace) snprintf(p->trace + strlen(p->trace), 8, "%c%d", what, p->id);
}

static int picky_check(void *self, ckpt_reader *r) {
    picky *p = self;
    picky_log(p, 'c');
    int64_t v;
    return picky_read(p, r, &v);
}

static int picky_load(void *self, ckpt_reader *r) {
    picky *p = self;
    picky_log(p, 'l');
    int64_t v;
    CKPT_TRY(picky_read(p, r, &v));
    p->value = v;
    return 0;
}

static int positive_check(void *self, ckpt_reader *r) {
    (void)self;
    (void)r;
    return 1;
}

static const ckpt_stateful_ops picky_ops = {picky_sd, picky_load, picky_check};
static const ckpt_stateful_ops picky_ops_unchecked = {.state_dict = picky_sd,
                                                      .load_state_dict = picky_load};
static const ckpt_stateful_ops picky_ops_positive = {picky_sd, picky_load, positive_check};

/* Saves a model (weights 1) and a picky object (value 50) to <t>/ck. */
static char *save_model_and_picky(const char *t) {
    char *dir = tu_pathf("%s/ck", t);
    float w[4] = {1, 1, 1, 1};
    int64_t shape[1] = {4};
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), 0);
    assert_int_equal(ckpt_model_add_param(m, "w", CKPT_F32, 1, shape, w, NULL), 0);
    picky p = {50, 100, 0, NULL};
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    assert_int_equal(ckpt_prepare_model(acc, m), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &picky_ops, &p), 0);
    ckpt_accelerator_set_step(acc, 9);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
    return dir;
}

/* Loads dir into a model (weights 7, registered first) and a picky object
 * (value 3, at most max) with the given ops; returns the status. */
static int load_model_and_picky(const char *dir, const ckpt_stateful_ops *ops, int64_t max,
                                float w[4], picky *p) {
    for (int i = 0; i < 4; i++) w[i] = 7;
    int64_t shape[1] = {4};
    ckpt_model *m;
    assert_int_equal(ckpt_model_new(&m), 0);
    assert_int_equal(ckpt_model_add_param(m, "w", CKPT_F32, 1, shape, w, NULL), 0);
    *p = (picky){3, max, 0, NULL};
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    assert_int_equal(ckpt_prepare_model(acc, m), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, ops, p), 0);
    ckpt_set_seed(acc, 3);
    ckpt_rng rng_before = *ckpt_accelerator_rng(acc);
    int rc = ckpt_load_state(acc, dir);
    if (rc != 0) {
        assert_memory_equal(ckpt_accelerator_rng(acc), &rng_before, sizeof rng_before);
        assert_int_equal(ckpt_accelerator_step(acc), 0);
        assert_string_equal(ckpt_accelerator_last_dir(acc), "");
    } else {
        assert_int_equal(ckpt_accelerator_step(acc), 9);
    }
    ckpt_accelerator_free(acc);
    ckpt_model_free(m);
    return rc;
}

static void test_load_state_stops_at_a_custom_check_state_dict_before_loading_anything(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_model_and_picky(t);
    const float sevens[4] = {7, 7, 7, 7}, ones[4] = {1, 1, 1, 1};
    float w[4];
    picky p;
    assert_int_equal(load_model_and_picky(dir, &picky_ops, 10, w, &p), CKPT_EMISMATCH);
    tu_assert_errmsg_has("custom_checkpoint_0.safetensors");
    tu_assert_errmsg_has("picky: value: saved 50, this object takes at most 10");
    assert_null(strstr(ckpt_errmsg(), "partially"));
    assert_memory_equal(w, sevens, sizeof w); /* the model, loaded first, is untouched */
    assert_int_equal(p.value, 3);
    /* a check returning a positive value is an error too */
    assert_int_equal(load_model_and_picky(dir, &picky_ops_positive, 100, w, &p), CKPT_EINVAL);
    tu_assert_errmsg_has("custom_checkpoint_0.safetensors");
    tu_assert_errmsg_has("check_state_dict returned 1");
    assert_memory_equal(w, sevens, sizeof w);
    assert_int_equal(p.value, 3);
    /* with room for the value it loads */
    assert_int_equal(load_model_and_picky(dir, &picky_ops, 100, w, &p), 0);
    assert_memory_equal(w, ones, sizeof w);
    assert_int_equal(p.value, 50);
    free(dir);
    tu_tmpdir_free(t);
}

/* The documented limit: a custom object without check_state_dict whose
 * load_state_dict refuses a value is found only while applying, after the
 * objects before it were loaded, and the error says so. */
static void test_a_custom_object_without_check_state_dict_can_still_fail_mid_apply(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_model_and_picky(t);
    const float ones[4] = {1, 1, 1, 1};
    float w[4];
    picky p;
    assert_int_equal(load_model_and_picky(dir, &picky_ops_unchecked, 10, w, &p), CKPT_EMISMATCH);
    tu_assert_errmsg_has("custom_checkpoint_0.safetensors");
    tu_assert_errmsg_has("state partially loaded: 1 of 3 objects were loaded before this one");
    tu_assert_errmsg_has("picky: value: saved 50");
    assert_memory_equal(w, ones, sizeof w); /* the model was loaded */
    assert_int_equal(p.value, 3);           /* the refusing object itself is unchanged */
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_runs_every_check_before_any_load(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/ck", t);
    char trace[64] = "";
    picky p0 = {1, 10, 0, NULL}, p1 = {2, 10, 1, NULL};
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &picky_ops, &p0), 0);
    assert_int_equal(ckpt_register_for_checkpointing(acc, &picky_ops, &p1), 0);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    p0.value = p1.value = 0;
    p0.trace = p1.trace = trace;
    assert_int_equal(ckpt_load_state(acc, dir), 0);
    assert_string_equal(trace, "c0c1l0l1");
    assert_int_equal(p0.value, 1);
    assert_int_equal(p1.value, 2);
    /* the second refuses: the first is neither loaded nor asked to load */
    trace[0] = '\0';
    p0.value = p1.value = 0;
    p1.max = 1;
    assert_int_equal(ckpt_load_state(acc, dir), CKPT_EMISMATCH);
    assert_string_equal(trace, "c0c1");
    tu_assert_errmsg_has("custom_checkpoint_1.safetensors");
    assert_int_equal(p0.value, 0);
    assert_int_equal(p1.value, 0);
    ckpt_accelerator_free(acc);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_names_the_tensor_with_a_flipped_byte(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    char *f = tu_pathf("%s/custom_checkpoint_1.safetensors", dir);
    /* The tensor data is the file's tail (the only tensor, 16 bytes). */
    tu_flip_byte(f, -3);
    /* The first load reads each file once: the damage is found while the
     * objects read it (the first counter is loaded, the second part). */
    ckpt_accelerator *acc = new_acc(NULL, false, 0, NULL);
    counter cs[2];
    for (int i = 0; i < 2; i++) {
        counter_set(&cs[i], 50 + 10 * i);
        assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &cs[i]), 0);
    }
    tu_expect_error(ckpt_load_state(acc, dir), CKPT_ECORRUPT,
                    "custom_checkpoint_1.safetensors: tensor 'w': checksum mismatch");
    tu_assert_errmsg_has("state partially loaded: 1 of 3 objects"); /* and the generator */
    assert_int_equal(cs[0].value, 1);
    char *out = tu_pathf("%s/out", t);
    tu_expect_error(ckpt_save_state(acc, out), CKPT_EINVAL, "refused");
    free(out);
    ckpt_accelerator_free(acc);
    /* A transactional load finds it before anything changes. */
    load_transactional = true;
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT,
                      "custom_checkpoint_1.safetensors: tensor 'w': checksum mismatch");
    load_transactional = false;
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT);
    assert_int_equal(info.status, CKPT_CHECKPOINT_CORRUPT);
    /* Shallow verification checks sizes only. */
    assert_int_equal(ckpt_checkpoint_verify(dir, false, &info), 0);
    free(f);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_rejects_a_flipped_byte_in_a_header(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    char *f = tu_pathf("%s/custom_checkpoint_0.safetensors", dir);
    tu_flip_byte(f, 12); /* inside the JSON header, after the 8-byte length */
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "custom_checkpoint_0.safetensors");
    free(f);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_rejects_a_truncated_file(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    char *f = tu_pathf("%s/custom_checkpoint_1.safetensors", dir);
    tu_truncate(f, tu_file_size(f) - 5);
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "custom_checkpoint_1.safetensors: size");
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "truncated");
    free(f);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_rejects_a_missing_manifest(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    char *f = tu_pathf("%s/checkpoint.json", dir);
    assert_int_equal(unlink(f), 0);
    /* explicit: an error, not the fresh start of CKPT_ENOENT */
    expect_load_fails(dir, 2, NULL, CKPT_EINVAL, "not a checkpoint (no checkpoint.json)");
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), CKPT_ENOENT);
    assert_int_equal(info.status, CKPT_CHECKPOINT_PARTIAL);
    free(f);
    free(dir);
    tu_tmpdir_free(t);
}

static void rewrite_manifest(const char *dir, const char *from, const char *to) {
    char *f = tu_pathf("%s/checkpoint.json", dir);
    size_t len = 0;
    char *text = tu_read_file(f, &len);
    char *at = strstr(text, from);
    assert_non_null(at);
    FILE *o = fopen(f, "w");
    assert_non_null(o);
    fwrite(text, 1, (size_t)(at - text), o);
    fputs(to, o);
    fputs(at + strlen(from), o);
    fclose(o);
    free(text);
    free(f);
}

static void test_load_state_refuses_a_newer_format_version(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    rewrite_manifest(dir, "\"format_version\": 1", "\"format_version\": 4");
    expect_load_fails(dir, 2, NULL, CKPT_EUNSUPPORTED,
                      "checkpoint format version 4 is newer than this library's (3); upgrade ckpt");
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_rejects_hostile_manifests(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    rewrite_manifest(dir, "\"custom_checkpoint_0.safetensors\"", "\"../custom_checkpoint_0.safetensors\"");
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "not a plain file name");
    rewrite_manifest(dir, "\"../custom_checkpoint_0.safetensors\"", "\"custom_checkpoint_1.safetensors\"");
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "listed twice");
    free(dir);
    dir = save_two(t);
    rewrite_manifest(dir, "\"step\": 0", "\"step\": \"0\"");
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "\"step\" must be an integer");
    free(dir);
    ckpt_manifest m;
    const char *bad[] = {"", "[]", "{\"format\":\"ckpt\"}", "{\"format\":\"other\",\"format_version\":1}",
                         "{\"format\":\"ckpt\",\"format_version\":1,\"format_version\":1}"};
    for (size_t i = 0; i < sizeof bad / sizeof *bad; i++) {
        assert_int_equal(ckpt__manifest_parse(bad[i], strlen(bad[i]), "m", &m), CKPT_ECORRUPT);
        ckpt__manifest_clear(&m);
    }
    tu_tmpdir_free(t);
}

static void test_load_state_rejects_an_unlisted_state_file(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    char *from = tu_pathf("%s/custom_checkpoint_1.safetensors", dir);
    char *to = tu_pathf("%s/model.safetensors", dir);
    assert_int_equal(link(from, to), 0);
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "model.safetensors is not listed in the manifest");
    free(from);
    free(to);
    free(dir);
    tu_tmpdir_free(t);
}

/* An explicit folder that is not there is an error (a typo must not read
 * as a fresh start); only "no checkpoint at all" is CKPT_ENOENT. */
static void test_load_state_of_a_missing_folder_is_enoent_only_without_input_dir(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = tu_pathf("%s/nothing", t);
    expect_load_fails(dir, 1, NULL, CKPT_EINVAL, "nothing: no such checkpoint folder");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_ENOENT);
    tu_assert_errmsg_has("no checkpoint");
    ckpt_accelerator_free(acc);
    free(dir);
    tu_tmpdir_free(t);
}

static void test_load_state_null_falls_back_past_a_corrupt_newest_checkpoint(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    ckpt_accelerator *acc = new_acc(t, true, 0, NULL);
    counter c;
    register_counter(acc, &c, 1);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    counter first = c;
    counter_set(&c, 2);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    char *f = tu_pathf("%s/checkpoints/checkpoint_1/custom_checkpoint_0.safetensors", t);
    tu_flip_byte(f, -2);
    counter_set(&c, 3);
    logbuf lb = {0};
    ckpt_accelerator_set_log(acc, log_collect, &lb);
    assert_int_equal(ckpt_load_state(acc, NULL), 0);
    assert_memory_equal(&c, &first, sizeof c);
    assert_int_equal(lb.n, 1);
    tu_assert_contains(lb.last, "tensor 'w': checksum mismatch");
    tu_assert_contains(lb.last, "falling back");
    /* The folder is named once, at the start. */
    char *c1 = tu_pathf("%s/checkpoints/checkpoint_1", t);
    char head[4400];
    snprintf(head, sizeof head, "skipping %s: custom_checkpoint_0.safetensors: ", c1);
    assert_int_equal(strncmp(lb.last, head, strlen(head)), 0);
    if (strstr(lb.last + strlen(head), c1)) fail_msg("path repeated: %s", lb.last);
    free(c1);
    /* With every checkpoint bad, the error lists why. */
    char *f0 = tu_pathf("%s/checkpoints/checkpoint_0/custom_checkpoint_0.safetensors", t);
    tu_truncate(f0, 10);
    assert_int_equal(ckpt_load_state(acc, NULL), CKPT_ECORRUPT);
    tu_assert_errmsg_has("no valid checkpoint");
    tu_assert_errmsg_has("truncated");
    tu_assert_errmsg_has("checksum mismatch");
    ckpt_accelerator_free(acc);
    free(f);
    free(f0);
    tu_tmpdir_free(t);
}

static void test_save_state_into_a_project_path_that_is_a_file_fails_clearly(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *file = tu_pathf("%s/plainfile", t);
    tu_write_text(file, "");
    ckpt_accelerator *acc = new_acc(file, true, 0, NULL);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_EINVAL);
    tu_assert_errmsg_has("plainfile");
    tu_assert_errmsg_has("not a folder");
    ckpt_accelerator_free(acc);
    /* A path under a file: cannot be created, whoever runs the test (root
     * ignores chmod 0500, so this is the unwritable folder case for root). */
    char *under = tu_pathf("%s/plainfile/proj", t);
    acc = new_acc(under, true, 0, NULL);
    assert_true(ckpt_save_state(acc, NULL) < 0);
    tu_assert_errmsg_has("plainfile");
    ckpt_accelerator_free(acc);
    free(under);
    free(file);
    tu_tmpdir_free(t);
}

static void test_save_state_into_an_unwritable_folder_fails_clearly(void **st) {
    (void)st;
    if (geteuid() == 0) {
        /* root writes through chmod 0500; covered by the path-under-a-file
         * case of the previous test. */
        skip();
    }
    char *t = tu_tmpdir_new("acc");
    char *ro = tu_pathf("%s/ro", t);
    assert_int_equal(mkdir(ro, 0500), 0);
    char *proj = tu_pathf("%s/ro/proj", t);
    ckpt_accelerator *acc = new_acc(proj, true, 0, NULL);
    assert_true(ckpt_save_state(acc, NULL) < 0);
    tu_assert_errmsg_has("ro/proj");
    assert_int_equal(chmod(ro, 0700), 0);
    ckpt_accelerator_free(acc);
    free(proj);
    free(ro);
    tu_tmpdir_free(t);
}

static void test_accelerator_new_validates_its_config(void **st) {
    (void)st;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {.total_limit = -1};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_null(acc);
    cfg = (ckpt_project_config){.num_processes = 2, .process_index = 2};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_EINVAL);
    assert_int_equal(ckpt_accelerator_new(&acc, NULL), CKPT_EINVAL);
    /* The strings are copied. */
    char proj[] = "/tmp/somewhere";
    cfg = (ckpt_project_config){.project_dir = proj, .num_processes = 2, .process_index = 1};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), 0);
    proj[1] = 'X';
    assert_int_equal(ckpt_accelerator_process_index(acc), 1);
    assert_int_equal(ckpt_accelerator_num_processes(acc), 2);
    ckpt_accelerator_free(acc);
    ckpt_accelerator_free(NULL);
    ckpt_hook_remove(NULL);
}

static void test_checkpoint_names_parse_only_canonical_numbers(void **st) {
    (void)st;
    int64_t n = -1;
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_0", &n), 1);
    assert_int_equal(n, 0);
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_123", &n), 1);
    assert_int_equal(n, 123);
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_", &n), 0);
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_01", &n), 0);
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_1a", &n), 0);
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_-1", &n), 0);
    assert_int_equal(ckpt__parse_checkpoint_name("checkpoint_1234567890123456789", &n), 0);
    assert_int_equal(ckpt__parse_checkpoint_name(".checkpoint_1.tmp.5", &n), 0);
}

/* ---- allocation failures: every one is a clean CKPT_ENOMEM ---------------- */

static void test_save_and_load_fail_cleanly_at_every_allocation(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *cd = tu_pathf("%s/checkpoints", t);
    ckpt_accelerator *acc = new_acc(t, true, 2, NULL);
    counter c;
    counter_set(&c, 1);
    counter saved = c;
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &c), 0);
    assert_int_equal(ckpt_save_state(acc, NULL), 0);
    int failures = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 10000);
        counter_set(&c, 100 + (int64_t)n);
        ckpt__alloc_fail_after(n);
        int rc = ckpt_save_state(acc, NULL);
        ckpt__alloc_fail_after(0);
        if (rc == 0) break;
        if (rc != CKPT_ENOMEM) fail_msg("allocation %llu: %d %s", (unsigned long long)n, rc, ckpt_errmsg());
        failures++;
        assert_int_equal(count_visible(cd), 1);
        assert_int_equal(tu_count_hidden_tmp(cd), 0);
    }
    assert_true(failures > 5);
    counter newest = c;
    ckpt_accelerator_free(acc);

    acc = new_acc(t, true, 0, NULL);
    counter_set(&c, 9);
    counter before = c;
    assert_int_equal(ckpt_register_for_checkpointing(acc, &counter_ops, &c), 0);
    failures = 0;
    for (uint64_t n = 1;; n++) {
        assert_true(n < 10000);
        ckpt__alloc_fail_after(n);
        int rc = ckpt_load_state(acc, NULL);
        ckpt__alloc_fail_after(0);
        if (rc == 0) break;
        if (rc != CKPT_ENOMEM) fail_msg("allocation %llu: %d %s", (unsigned long long)n, rc, ckpt_errmsg());
        failures++;
        assert_memory_equal(&c, &before, sizeof c);
        assert_int_equal(ckpt_accelerator_step(acc), 0);
    }
    assert_true(failures > 5);
    assert_memory_equal(&c, &newest, sizeof c);
    (void)saved;
    ckpt_accelerator_free(acc);
    free(cd);
    tu_tmpdir_free(t);
}

/* The manifest parser survives random damage: every mutation of a valid
 * manifest parses or is refused with ECORRUPT/EUNSUPPORTED (ASan watches). */
/* The manifest covers every other file; its own checksum covers it: a
 * changed step or tensor checksum, or a removed checksum, is refused. */
static void test_load_state_rejects_an_edited_manifest(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    rewrite_manifest(dir, "\"step\": 0", "\"step\": 7");
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "the manifest was changed after it was written");
    ckpt_checkpoint_info info;
    tu_expect_error(ckpt_checkpoint_verify(dir, true, &info), CKPT_ECORRUPT, "checkpoint.json");
    assert_int_equal(info.status, CKPT_CHECKPOINT_CORRUPT);
    rewrite_manifest(dir, "\"step\": 7", "\"step\": 0");
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    rewrite_manifest(dir, "\"manifest_xxh3\"", "\"manifest_xxh4\"");
    expect_load_fails(dir, 2, NULL, CKPT_ECORRUPT, "\"manifest_xxh3\" is missing");
    free(dir);
    tu_tmpdir_free(t);
}

static void test_manifest_parser_survives_random_mutations(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("acc");
    char *dir = save_two(t);
    char *f = tu_pathf("%s/checkpoint.json", dir);
    size_t len = 0;
    char *text = tu_read_file(f, &len);
    char *buf = malloc(len + 1);
    assert_non_null(buf);
    unsigned seed = 99;
    int accepted = 0;
    for (int i = 0; i < 3000; i++) {
        memcpy(buf, text, len);
        size_t n = len;
        int edits = 1 + rand_r(&seed) % 4;
        for (int e = 0; e < edits; e++) {
            size_t at = (size_t)rand_r(&seed) % n;
            switch (rand_r(&seed) % 3) {
            case 0: buf[at] = (char)(rand_r(&seed) & 0xff); break;
            case 1: n = at + 1; break;
            default: buf[at] = "0123456789\"{}[],:-."[rand_r(&seed) % 20]; break;
            }
        }
        ckpt_manifest m;
        int rc = ckpt__manifest_parse(buf, n, "m", &m);
        if (rc == 0) accepted++;
        else if (rc != CKPT_ECORRUPT && rc != CKPT_EUNSUPPORTED)
            fail_msg("mutation %d: status %d (%s)", i, rc, ckpt_errmsg());
        ckpt__manifest_clear(&m);
    }
    assert_true(accepted < 3000);
    free(buf);
    free(text);
    free(f);
    free(dir);
    tu_tmpdir_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_save_state_with_total_limit_1_keeps_one_checkpoint),
        cmocka_unit_test(test_total_limit_2_with_11_saves_leaves_checkpoint_9_and_10),
        cmocka_unit_test(test_load_state_from_explicit_folder_restores_saved_state),
        cmocka_unit_test(test_automatic_naming_then_explicit_loads_of_checkpoint_0_and_1),
        cmocka_unit_test(test_relative_project_dir_and_load_state_null),
        cmocka_unit_test(test_register_for_checkpointing_rejects_invalid_objects_naming_them),
        cmocka_unit_test(test_load_state_null_picks_the_newest_checkpoint),
        cmocka_unit_test(test_save_and_load_hooks_run_and_stop_after_removal),
        cmocka_unit_test(test_files_a_save_pre_hook_writes_are_part_of_the_checkpoint),
        cmocka_unit_test(test_a_save_pre_hook_may_write_only_plain_regular_files),
        cmocka_unit_test(test_an_explicit_save_never_replaces_a_folder_that_appeared_meanwhile),
        cmocka_unit_test(test_a_failing_post_hook_is_a_warning_and_the_save_stands),
        cmocka_unit_test(test_saves_refuse_after_a_failed_load_until_start_over),
        cmocka_unit_test(test_no_checkpoint_at_all_is_enoent_and_saves_stay_allowed),
        cmocka_unit_test(test_a_missing_key_while_loading_is_a_mismatch_not_enoent),
        cmocka_unit_test(test_callback_failures_are_named_without_stale_messages),
        cmocka_unit_test(test_save_state_null_without_automatic_naming_is_einval),
        cmocka_unit_test(test_new_run_numbers_after_existing_checkpoints),
        cmocka_unit_test(test_save_state_is_busy_while_another_holds_the_project_lock),
        cmocka_unit_test(test_save_removes_leftover_temp_folders_with_a_warning),
        cmocka_unit_test(test_explicit_save_replaces_an_existing_checkpoint_atomically),
        cmocka_unit_test(test_explicit_save_refuses_to_replace_a_folder_that_is_not_a_checkpoint),
        cmocka_unit_test(test_manifest_lists_every_file_with_size_and_digest),
        cmocka_unit_test(test_checkpoint_list_and_prune),
        cmocka_unit_test(test_one_run_per_project),
        cmocka_unit_test(test_load_state_rejects_shape_mismatch),
        cmocka_unit_test(test_load_state_rejects_dtype_mismatch),
        cmocka_unit_test(test_load_state_rejects_missing_key),
        cmocka_unit_test(test_load_state_rejects_a_different_number_of_objects),
        cmocka_unit_test(test_load_state_refuses_a_dataloader_of_another_dataset_changing_nothing),
        cmocka_unit_test(test_load_state_refuses_an_optimizer_of_another_kind_changing_nothing),
        cmocka_unit_test(test_load_state_refuses_a_scheduler_of_another_kind_changing_nothing),
        cmocka_unit_test(test_load_state_of_every_kind_changes_nothing_at_any_failed_allocation),
        cmocka_unit_test(
            test_load_state_stops_at_a_custom_check_state_dict_before_loading_anything),
        cmocka_unit_test(test_a_custom_object_without_check_state_dict_can_still_fail_mid_apply),
        cmocka_unit_test(test_load_state_runs_every_check_before_any_load),
        cmocka_unit_test(test_load_state_names_the_tensor_with_a_flipped_byte),
        cmocka_unit_test(test_load_state_rejects_a_flipped_byte_in_a_header),
        cmocka_unit_test(test_load_state_rejects_a_truncated_file),
        cmocka_unit_test(test_load_state_rejects_a_missing_manifest),
        cmocka_unit_test(test_load_state_refuses_a_newer_format_version),
        cmocka_unit_test(test_load_state_rejects_hostile_manifests),
        cmocka_unit_test(test_load_state_rejects_an_unlisted_state_file),
        cmocka_unit_test(test_load_state_of_a_missing_folder_is_enoent_only_without_input_dir),
        cmocka_unit_test(test_load_state_null_falls_back_past_a_corrupt_newest_checkpoint),
        cmocka_unit_test(test_save_state_into_a_project_path_that_is_a_file_fails_clearly),
        cmocka_unit_test(test_save_state_into_an_unwritable_folder_fails_clearly),
        cmocka_unit_test(test_accelerator_new_validates_its_config),
        cmocka_unit_test(test_checkpoint_names_parse_only_canonical_numbers),
        cmocka_unit_test(test_save_and_load_fail_cleanly_at_every_allocation),
        cmocka_unit_test(test_load_state_rejects_an_edited_manifest),
        cmocka_unit_test(test_manifest_parser_survives_random_mutations),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
