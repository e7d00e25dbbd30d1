/* Incremental saves: a state file whose bytes equal the same file of the
 * newest committed checkpoint is hard-linked into the new checkpoint instead
 * of written. These tests show that the link happens (same inode, fewer
 * bytes written), that it is decided from memory (the hash of the bytes the
 * save would write), that an old file changed after its commit is never
 * linked, that deleting an old checkpoint leaves the newer one complete, that
 * the project option turns it off, and that asynchronous saves link too.
 * Most tests look at the link itself and set link_copies 1 (link whenever
 * the bytes are equal); the default, 2 (no single physical copy serves
 * every retained checkpoint), has tests of its own below. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/io.h"
#include "testing/testing.h"
#include "format/manifest.h"
#include "format/statedict.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

enum { NBASE = 64 * 1024, NHEAD = 256 };

/* A frozen base (never changes) and a trained head (changes every step),
 * as two prepared models: model.safetensors and model_1.safetensors. */
typedef struct fixture {
    float base[NBASE], head[NHEAD];
    ckpt_model *mbase, *mhead;
    ckpt_accelerator *acc;
    char log[4096];
    int nwarn;
} fixture;

static fixture fx;

static void on_log(void *user, ckpt_log_level level, const char *msg) {
    (void)user;
    if (level == CKPT_LOG_WARNING) fx.nwarn++;
    size_t n = strlen(fx.log);
    snprintf(fx.log + n, sizeof fx.log - n, "%s\n", msg);
}

static void open_acc(const char *project, bool no_link) {
    ckpt_project_config cfg = {.project_dir = project,
                               .automatic_checkpoint_naming = true,
                               .no_link_unchanged = no_link,
                               .link_copies = 1};
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    ckpt_accelerator_set_log(fx.acc, on_log, NULL);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mbase), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mhead), 0);
}

static void build(const char *project, bool no_link) {
    memset(&fx, 0, sizeof fx);
    for (int i = 0; i < NBASE; i++) fx.base[i] = (float)i * 0.25f;
    for (int i = 0; i < NHEAD; i++) fx.head[i] = (float)-i;
    assert_int_equal(ckpt_model_new(&fx.mbase), 0);
    assert_int_equal(ckpt_model_new(&fx.mhead), 0);
    assert_int_equal(
        ckpt_model_add_param(fx.mbase, "base", CKPT_F32, 1, (int64_t[]){NBASE}, fx.base, NULL), 0);
    assert_int_equal(
        ckpt_model_add_param(fx.mhead, "head", CKPT_F32, 1, (int64_t[]){NHEAD}, fx.head, NULL), 0);
    open_acc(project, no_link);
}

static void destroy(void) {
    ckpt_accelerator_free(fx.acc);
    ckpt_model_free(fx.mbase);
    ckpt_model_free(fx.mhead);
}

static int setup(void **state) {
    if (tu_tmpdir_setup(state)) return -1;
    build(tu_dir(), false);
    return 0;
}

static int setup_off(void **state) {
    if (tu_tmpdir_setup(state)) return -1;
    build(tu_dir(), true);
    return 0;
}

static int teardown(void **state) {
    destroy();
    return tu_tmpdir_teardown(state);
}

static void train_step(void) {
    for (int i = 0; i < NHEAD; i++) fx.head[i] += 1.0f;
}

static char *ckpt_file(int n, const char *name) {
    return tu_pathf("%s/checkpoints/checkpoint_%d/%s", tu_dir(), n, name);
}

static struct stat stat_of(int n, const char *name) {
    char *p = ckpt_file(n, name);
    struct stat st;
    assert_int_equal(lstat(p, &st), 0);
    free(p);
    return st;
}

static bool same_file(int a, int b, const char *name) {
    struct stat x = stat_of(a, name), y = stat_of(b, name);
    return x.st_dev == y.st_dev && x.st_ino == y.st_ino;
}

static uint64_t written_now(void) {
    ckpt_io_bytes b;
    ckpt__io_bytes(&b);
    return b.written;
}

static void verify_deep(int n) {
    char *dir = tu_pathf("%s/checkpoints/checkpoint_%d", tu_dir(), n);
    ckpt_checkpoint_info info;
    int rc = ckpt_checkpoint_verify(dir, true, &info);
    if (rc != 0) fail_msg("verify %s: %s", dir, ckpt_errmsg());
    free(dir);
}

/* Loads checkpoint n into fresh memory and checks both models' bytes. */
static void load_and_check(int n) {
    float base[NBASE], head[NHEAD];
    memcpy(base, fx.base, sizeof base);
    memcpy(head, fx.head, sizeof head);
    memset(fx.base, 0, sizeof fx.base);
    memset(fx.head, 0, sizeof fx.head);
    char *dir = tu_pathf("%s/checkpoints/checkpoint_%d", tu_dir(), n);
    int rc = ckpt_load_state(fx.acc, dir);
    if (rc != 0) fail_msg("load %s: %s", dir, ckpt_errmsg());
    free(dir);
    assert_memory_equal(fx.base, base, sizeof base);
    assert_memory_equal(fx.head, head, sizeof head);
}

/* The hash a save compares is that of exactly the bytes it would write. */
static void test_hash_in_memory_is_the_hash_of_the_written_file(void **state) {
    (void)state;
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), 0);
    assert_int_equal(ckpt_write_tensor(w, "base", CKPT_F32, 1, (int64_t[]){NBASE}, fx.base), 0);
    assert_int_equal(ckpt_write_i64(w, "n", 7), 0);
    uint64_t size = 0;
    ckpt_h128 h = {0, 0};
    uint64_t before = written_now();
    bool differs = true;
    assert_int_equal(ckpt__writer_hash128(w, "x.safetensors", false, NULL, 0, &size, &h, &differs),
                     0);
    assert_false(differs);
    assert_int_equal(written_now(), before); /* nothing written */
    char path[4096];
    tu_path(path, sizeof path, tu_dir(), "x.safetensors");
    ckpt_file_digest d;
    assert_int_equal(ckpt__writer_write_new_ex(w, path, false, true, &d), 0);
    size_t n = 0;
    char *bytes = tu_read_file(path, &n);
    ckpt_h128 want = ckpt__xxh128(bytes, n);
    assert_int_equal(size, n);
    assert_true(ckpt__h128_eq(h, want));
    assert_true(d.has_xxh128);
    assert_true(ckpt__h128_eq(d.xxh128, want));
    assert_int_equal(d.xxh3, ckpt__xxh3(bytes, n));
    /* Against the file's own tensor digests (a previous file's record): the
     * same hash. Against a tensor that differs, or a record of fewer
     * tensors: it differs, and no hash is given. */
    ckpt_h128 h2 = {1, 1};
    assert_int_equal(d.ntensors, 1);
    assert_int_equal(
        ckpt__writer_hash128(w, "x", false, d.tensor_xxh3, d.ntensors, &size, &h2, &differs), 0);
    assert_false(differs);
    assert_true(ckpt__h128_eq(h2, want));
    uint64_t other = d.tensor_xxh3[0] ^ 1;
    assert_int_equal(ckpt__writer_hash128(w, "x", false, &other, 1, &size, &h2, &differs), 0);
    assert_true(differs);
    assert_true(ckpt__h128_eq(h2, (ckpt_h128){0, 0}));
    assert_int_equal(ckpt__writer_hash128(w, "x", false, d.tensor_xxh3, 0, &size, &h2, &differs),
                     0);
    assert_true(differs);
    ckpt__file_digest_free(&d);
    free(bytes);
    ckpt_writer_free(w);
}

static void test_unchanged_file_is_linked_and_not_written(void **state) {
    (void)state;
    uint64_t w0 = written_now();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    uint64_t first = written_now() - w0;
    train_step();
    w0 = written_now();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    uint64_t second = written_now() - w0;

    assert_true(same_file(0, 1, "model.safetensors"));
    assert_false(same_file(0, 1, "model_1.safetensors"));
    struct stat st = stat_of(1, "model.safetensors");
    assert_int_equal(st.st_nlink, 2);
    /* the base was not written again: the second save wrote the first's
     * bytes less the base's file (the manifests may differ by a few bytes) */
    assert_true(first > (uint64_t)st.st_size);
    assert_true(second + (uint64_t)st.st_size <= first + 64);
    assert_int_equal(fx.nwarn, 0);

    /* the manifest records the XXH3-128 that decided it */
    ckpt_manifest m;
    char *dir = tu_pathf("%s/checkpoints/checkpoint_1", tu_dir());
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    const ckpt_manifest_file *f = ckpt__manifest_find(&m, "model.safetensors");
    assert_non_null(f);
    assert_true(f->has_xxh128);
    char *p = ckpt_file(1, "model.safetensors");
    size_t n = 0;
    char *bytes = tu_read_file(p, &n);
    assert_true(ckpt__h128_eq(f->xxh128, ckpt__xxh128(bytes, n)));
    free(bytes);
    free(p);
    ckpt__manifest_clear(&m);
    free(dir);
    verify_deep(1);
    load_and_check(1);
}

/* A third save links from the second (the newest), which links the first:
 * all three names are one file. */
static void test_links_chain_through_saves(void **state) {
    (void)state;
    for (int i = 0; i < 3; i++) {
        assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
        train_step();
    }
    assert_true(same_file(0, 2, "model.safetensors"));
    assert_int_equal(stat_of(2, "model.safetensors").st_nlink, 3);
}

/* Bad input: the old file was changed after its commit (here one flipped
 * byte, in place). Its bytes no longer match its manifest: the save writes
 * the file anew, says so, and the new checkpoint is complete. */
static void test_old_file_changed_after_commit_is_not_linked(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    char *old = ckpt_file(0, "model.safetensors");
    tu_flip_byte(old, -5);
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_false(same_file(0, 1, "model.safetensors"));
    assert_int_equal(stat_of(1, "model.safetensors").st_nlink, 1);
    assert_int_equal(fx.nwarn, 1);
    assert_non_null(strstr(fx.log, "model.safetensors no longer has the bytes its manifest"));
    verify_deep(1);
    load_and_check(1);
    free(old);
}

/* Worse: the old file changed and its manifest rewritten to match (sealed
 * again), its "xxh128" left as it was. What is linked is checked against the
 * bytes in memory, not only against the manifest: not linked either. */
static void test_old_file_and_manifest_changed_is_not_linked(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    char *old = ckpt_file(0, "model.safetensors");
    tu_flip_byte(old, -5);
    size_t n = 0;
    char *bytes = tu_read_file(old, &n);
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    for (int64_t i = 0; i < m.nfiles; i++)
        if (strcmp(m.files[i].name, "model.safetensors") == 0) {
            m.files[i].xxh3 = ckpt__xxh3(bytes, n);
            m.created[0] = '\0';
        }
    assert_int_equal(ckpt__manifest_write(&m, dir), 0);
    ckpt__manifest_clear(&m);
    free(bytes);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, false, &info), 0); /* a valid manifest */
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_false(same_file(0, 1, "model.safetensors"));
    assert_int_equal(fx.nwarn, 1);
    verify_deep(1);
    load_and_check(1);
    free(old);
    free(dir);
}

/* A link is a full file: deleting the checkpoint it came from (total_limit
 * rotation, prune, rm -r) leaves the newer checkpoint complete. */
static void test_deleting_old_checkpoint_keeps_newer_complete(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_true(same_file(0, 1, "model.safetensors"));
    /* the run ends; prune (under the project lock) keeps the newest only */
    ckpt_accelerator_free(fx.acc);
    int64_t removed = 0;
    assert_int_equal(ckpt_checkpoint_prune(tu_dir(), 1, &removed), 0);
    assert_int_equal(removed, 1);
    char *gone = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    assert_false(tu_exists(gone));
    free(gone);
    assert_int_equal(stat_of(1, "model.safetensors").st_nlink, 1);
    verify_deep(1);
    open_acc(tu_dir(), false);
    load_and_check(1);
    /* and the next save links from checkpoint_1 */
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_true(same_file(1, 2, "model.safetensors"));
}

/* total_limit rotation after each save removes the old names only. */
static void test_rotation_keeps_linked_files(void **state) {
    (void)state;
    ckpt_accelerator_free(fx.acc);
    ckpt_project_config cfg = {.project_dir = tu_dir(),
                               .automatic_checkpoint_naming = true,
                               .total_limit = 1,
                               .link_copies = 1};
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mbase), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mhead), 0);
    for (int i = 0; i < 4; i++) {
        assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
        train_step();
    }
    char *gone = tu_pathf("%s/checkpoints/checkpoint_2", tu_dir());
    assert_false(tu_exists(gone));
    free(gone);
    /* checkpoint_2's files are deleted in the background: wait for it */
    assert_int_equal(ckpt_save_wait(fx.acc), 0);
    assert_int_equal(stat_of(3, "model.safetensors").st_nlink, 1);
    verify_deep(3);
}

/* The rotation does not read again what the save just wrote to count it
 * valid (every byte was hashed on its way out), and the removed folder's
 * files are deleted in the background: out of sight when the save returns. */
static void test_rotation_reads_nothing_of_the_new_checkpoint(void **state) {
    (void)state;
    ckpt_accelerator_free(fx.acc);
    ckpt_project_config cfg = {.project_dir = tu_dir(),
                               .automatic_checkpoint_naming = true,
                               .total_limit = 1,
                               .no_link_unchanged = true};
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mbase), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mhead), 0);
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    train_step();
    ckpt_io_bytes a, b;
    ckpt__io_bytes(&a);
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    ckpt__io_bytes(&b);
    /* manifests only; model.safetensors alone is 256 KiB */
    assert_true(b.read - a.read < 64 * 1024);
    char *gone = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    assert_false(tu_exists(gone));
    free(gone);
    verify_deep(1);
    assert_int_equal(ckpt_save_wait(fx.acc), 0);
    char *cd = tu_pathf("%s/checkpoints", tu_dir());
    assert_int_equal(tu_count_hidden_tmp(cd), 0);
    free(cd);
}

static void test_option_off_writes_every_file(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_false(same_file(0, 1, "model.safetensors"));
    ckpt_manifest m;
    char *dir = tu_pathf("%s/checkpoints/checkpoint_1", tu_dir());
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    assert_false(ckpt__manifest_find(&m, "model.safetensors")->has_xxh128);
    ckpt__manifest_clear(&m);
    free(dir);
}

/* A checkpoint saved with the option off (or by an older library) records
 * no XXH3-128: the next save cannot know its files' identity and writes. */
static void test_previous_without_xxh128_never_links(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    ckpt_accelerator_free(fx.acc);
    open_acc(tu_dir(), false);
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_false(same_file(0, 1, "model.safetensors"));
    /* from here on the records are there */
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    assert_true(same_file(1, 2, "model.safetensors"));
}

static void test_async_save_links_too(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state_async(fx.acc, NULL), 0);
    assert_int_equal(ckpt_save_wait(fx.acc), 0);
    train_step();
    assert_int_equal(ckpt_save_state_async(fx.acc, NULL), 0);
    train_step(); /* the staged copy is what is saved */
    assert_int_equal(ckpt_save_wait(fx.acc), 0);
    assert_true(same_file(0, 1, "model.safetensors"));
    assert_false(same_file(0, 1, "model_1.safetensors"));
    verify_deep(1);
}

/* Where no link can be made (here: the previous checkpoint is on another
 * file system), the save writes the file and says so once. */
static void test_link_across_file_systems_falls_back_to_writing(void **state) {
    (void)state;
    struct stat a, b;
    if (stat("/dev/shm", &a) != 0 || stat(tu_dir(), &b) != 0 || a.st_dev == b.st_dev) {
        skip();
        return;
    }
    char shm[64] = "/dev/shm/ckpt_incremental_XXXXXX";
    if (!mkdtemp(shm)) {
        skip();
        return;
    }
    char *first = tu_pathf("%s/first", shm);
    char *second = tu_pathf("%s/second", tu_dir());
    assert_int_equal(ckpt_save_state(fx.acc, first), 0);
    assert_int_equal(ckpt_save_state(fx.acc, second), 0);
    assert_int_equal(fx.nwarn, 1);
    assert_non_null(strstr(fx.log, "cannot hard-link unchanged files"));
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(second, true, &info), 0);
    /* an explicit folder on the same file system links from the last one */
    char *third = tu_pathf("%s/third", tu_dir());
    assert_int_equal(ckpt_save_state(fx.acc, third), 0);
    char *p2 = tu_pathf("%s/model.safetensors", second);
    char *p3 = tu_pathf("%s/model.safetensors", third);
    struct stat s2, s3;
    assert_int_equal(stat(p2, &s2), 0);
    assert_int_equal(stat(p3, &s3), 0);
    assert_int_equal(s2.st_ino, s3.st_ino);
    assert_int_equal(fx.nwarn, 1);
    free(p2);
    free(p3);
    free(third);
    free(second);
    free(first);
    assert_int_equal(tu_tmpdir_remove(shm), 0);
}

/* A save that fails after it linked leaves the previous checkpoints as
 * they were, and nothing of its own. */
static void test_failed_save_after_link_loses_nothing(void **state) {
    (void)state;
    assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
    train_step();
    /* the manifest is the last file written: fail its write */
    ckpt__fault_arm(CKPT_FAULT_WRITE, 1, ENOSPC, true);
    uint64_t n = 0;
    int rc = ckpt_save_state(fx.acc, NULL);
    n = ckpt__fault_count();
    ckpt__fault_disarm();
    assert_int_not_equal(rc, 0);
    assert_true(n > 0);
    char *newer = tu_pathf("%s/checkpoints/checkpoint_1", tu_dir());
    assert_false(tu_exists(newer));
    free(newer);
    assert_int_equal(stat_of(0, "model.safetensors").st_nlink, 1);
    char *parent = tu_pathf("%s/checkpoints", tu_dir());
    assert_int_equal(tu_count_hidden_tmp(parent), 0);
    free(parent);
    verify_deep(0);
}

/* ---- frozen parameters in a file of their own --------------------------- */

/* One model, a frozen base (no gradient buffer) and a trained head. */
typedef struct one_model {
    float base[NBASE], head[NHEAD], ghead[NHEAD];
    ckpt_model *m;
    ckpt_accelerator *acc;
} one_model;

static void one_model_open(one_model *om, const char *project, bool head_grad) {
    assert_int_equal(ckpt_model_new(&om->m), 0);
    assert_int_equal(
        ckpt_model_add_param(om->m, "base.w", CKPT_F32, 1, (int64_t[]){NBASE}, om->base, NULL), 0);
    assert_int_equal(ckpt_model_add_param(om->m, "head.w", CKPT_F32, 1, (int64_t[]){NHEAD},
                                          om->head, head_grad ? om->ghead : NULL),
                     0);
    ckpt_project_config cfg = {
        .project_dir = project, .automatic_checkpoint_naming = true, .link_copies = 1};
    assert_int_equal(ckpt_accelerator_new(&om->acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(om->acc, om->m), 0);
}

static void one_model_close(one_model *om) {
    ckpt_accelerator_free(om->acc);
    ckpt_model_free(om->m);
}

static void test_frozen_parameters_go_to_a_file_that_later_saves_link(void **state) {
    (void)state;
    static one_model om;
    memset(&om, 0, sizeof om);
    for (int i = 0; i < NBASE; i++) om.base[i] = (float)i;
    one_model_open(&om, tu_dir(), true);
    assert_int_equal(ckpt_save_state(om.acc, NULL), 0);
    for (int i = 0; i < NHEAD; i++) om.head[i] += 1.0f;
    uint64_t w0 = written_now();
    assert_int_equal(ckpt_save_state(om.acc, NULL), 0);
    uint64_t second = written_now() - w0;
    /* the frozen base sits in a file of its own that no Hugging Face reader
     * takes for a shard, the head in model.safetensors */
    assert_true(same_file(0, 1, "model.frozen.safetensors"));
    char *hf_like = ckpt_file(1, "model-00001-of-00001.safetensors");
    assert_false(tu_exists(hf_like));
    free(hf_like);
    assert_false(same_file(0, 1, "model.safetensors"));
    assert_true(stat_of(1, "model.safetensors").st_size < NHEAD * 4 + 4096);
    assert_true(second < NBASE * 4 / 4); /* the base's 256 KiB were not written */
    char *dir = tu_pathf("%s/checkpoints/checkpoint_1", tu_dir());
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    assert_int_equal(m.format_version, 3);
    ckpt__manifest_clear(&m);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    /* the model reads as one object, from both files */
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_checkpoint_open_object(dir, "model.safetensors", &r), 0);
    static float got[NBASE];
    assert_int_equal(ckpt_read_tensor(r, "base.w", CKPT_F32, 1, (int64_t[]){NBASE}, got), 0);
    assert_memory_equal(got, om.base, sizeof om.base);
    assert_int_equal(ckpt_read_tensor(r, "head.w", CKPT_F32, 1, (int64_t[]){NHEAD}, got), 0);
    assert_memory_equal(got, om.head, sizeof om.head);
    ckpt_reader_free(r);
    /* and loads back into the model */
    float head[NHEAD];
    memcpy(head, om.head, sizeof head);
    memset(om.base, 0, sizeof om.base);
    memset(om.head, 0, sizeof om.head);
    assert_int_equal(ckpt_load_state(om.acc, dir), 0);
    assert_float_equal(om.base[NBASE - 1], (float)(NBASE - 1), 0);
    assert_memory_equal(om.head, head, sizeof head);
    free(dir);
    one_model_close(&om);
}

/* Format version 2 kept a one-process model's frozen tensors in
 * <model>-00001-of-00001.safetensors: such a checkpoint (made here from a
 * new one: the file renamed, the manifest rewritten as version 2) still
 * verifies, opens and loads, and the next save writes the new name. */
static void test_version_2_frozen_file_still_loads(void **state) {
    (void)state;
    static one_model om;
    memset(&om, 0, sizeof om);
    for (int i = 0; i < NBASE; i++) om.base[i] = (float)i;
    one_model_open(&om, tu_dir(), true);
    assert_int_equal(ckpt_save_state(om.acc, NULL), 0);
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    char *from = ckpt_file(0, "model.frozen.safetensors");
    char *to = ckpt_file(0, "model-00001-of-00001.safetensors");
    assert_int_equal(rename(from, to), 0);
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    bool renamed = false;
    for (int64_t i = 0; i < m.nfiles; i++) {
        if (strcmp(m.files[i].name, "model.frozen.safetensors") != 0) continue;
        free(m.files[i].name);
        m.files[i].name = strdup("model-00001-of-00001.safetensors");
        renamed = true;
    }
    assert_true(renamed);
    m.format_version = 2;
    assert_int_equal(ckpt__manifest_write(&m, dir), 0);
    ckpt__manifest_clear(&m);
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, true, &info), 0);
    assert_int_equal(info.format_version, 2);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_checkpoint_open_object(dir, "model.safetensors", &r), 0);
    static float got[NBASE];
    assert_int_equal(ckpt_read_tensor(r, "base.w", CKPT_F32, 1, (int64_t[]){NBASE}, got), 0);
    assert_memory_equal(got, om.base, sizeof om.base);
    ckpt_reader_free(r);
    memset(om.base, 0, sizeof om.base);
    assert_int_equal(ckpt_load_state(om.acc, dir), 0);
    assert_float_equal(om.base[NBASE - 1], (float)(NBASE - 1), 0);
    assert_int_equal(ckpt_save_state(om.acc, NULL), 0);
    char *next = ckpt_file(1, "model.frozen.safetensors");
    assert_true(tu_exists(next));
    free(next);
    free(from);
    free(to);
    free(dir);
    one_model_close(&om);
}

/* A model whose parameters are all frozen (or all trainable) stays one
 * file, as before: it changes as a whole or not at all. */
static void test_model_of_one_kind_stays_one_file(void **state) {
    (void)state;
    static one_model om;
    memset(&om, 0, sizeof om);
    one_model_open(&om, tu_dir(), false);
    assert_int_equal(ckpt_save_state(om.acc, NULL), 0);
    char *shard = ckpt_file(0, "model.frozen.safetensors");
    assert_false(tu_exists(shard));
    free(shard);
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    ckpt_manifest m;
    assert_int_equal(ckpt__manifest_read(dir, &m), 0);
    assert_int_equal(m.format_version, 1);
    ckpt__manifest_clear(&m);
    free(dir);
    one_model_close(&om);
}

/* ckpt_model_set_frozen: by glob; the optimizer's group -1 freezes too. */
static void test_set_frozen_by_pattern_and_by_optimizer_group(void **state) {
    (void)state;
    static one_model om;
    memset(&om, 0, sizeof om);
    one_model_open(&om, tu_dir(), true);
    ckpt_param_info pi;
    assert_int_equal(ckpt_model_param(om.m, 1, &pi), 0);
    assert_false(pi.frozen);
    assert_int_equal(ckpt_model_param(om.m, 0, &pi), 0);
    assert_true(pi.frozen); /* no gradient buffer */
    assert_int_equal(ckpt_model_set_frozen(om.m, "*.w", true), 2);
    assert_int_equal(ckpt_model_param(om.m, 1, &pi), 0);
    assert_true(pi.frozen);
    assert_int_equal(ckpt_model_set_frozen(om.m, "head.w", false), 1);
    assert_int_equal(ckpt_model_param(om.m, 1, &pi), 0);
    assert_false(pi.frozen);
    tu_expect_error(ckpt_model_set_frozen(om.m, "fc9.*", true), CKPT_ENOENT, "'fc9.*'");
    one_model_close(&om);

    /* a model whose every parameter has a gradient: the optimizer's groups
     * decide (group -1: frozen) */
    float a[8] = {0}, ga[8] = {0}, b[8] = {0}, gb[8] = {0};
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    assert_int_equal(ckpt_model_new(&m), 0);
    assert_int_equal(ckpt_model_add_param(m, "a", CKPT_F32, 1, (int64_t[]){8}, a, ga), 0);
    assert_int_equal(ckpt_model_add_param(m, "b", CKPT_F32, 1, (int64_t[]){8}, b, gb), 0);
    assert_int_equal(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0.0), 0);
    ckpt_optim_options opts = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    assert_int_equal(ckpt_optimizer_set_groups(o, 1, (int[]){-1, 0}, &opts), 0);
    assert_int_equal(ckpt_model_param(m, 0, &pi), 0);
    assert_true(pi.frozen);
    assert_int_equal(ckpt_model_param(m, 1, &pi), 0);
    assert_false(pi.frozen);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

/* Flexible loading reads the model from both files too: weights only into a
 * model of another dtype (converted), and ckpt_load_state_ex of the model. */
static void test_split_model_loads_flexibly(void **state) {
    (void)state;
    static one_model om;
    memset(&om, 0, sizeof om);
    for (int i = 0; i < NBASE; i++) om.base[i] = (float)(i % 256);
    for (int i = 0; i < NHEAD; i++) om.head[i] = (float)-i;
    one_model_open(&om, tu_dir(), true);
    assert_int_equal(ckpt_save_state(om.acc, NULL), 0);
    char *dir = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    /* weights only, converted to BF16 (exact for these small integers) */
    static uint16_t bbase[NBASE], bhead[NHEAD];
    ckpt_model *m = NULL;
    assert_int_equal(ckpt_model_new(&m), 0);
    assert_int_equal(
        ckpt_model_add_param(m, "base.w", CKPT_BF16, 1, (int64_t[]){NBASE}, bbase, NULL), 0);
    assert_int_equal(
        ckpt_model_add_param(m, "head.w", CKPT_BF16, 1, (int64_t[]){NHEAD}, bhead, NULL), 0);
    ckpt_load_options lo = {.convert_dtypes = true};
    int rc = ckpt_model_load_weights(m, dir, &lo, NULL);
    if (rc != 0) fail_msg("load_weights: %s", ckpt_errmsg());
    static float back[NBASE];
    assert_int_equal(ckpt_dtype_convert(CKPT_BF16, bbase, CKPT_F32, back, NBASE), 0);
    assert_memory_equal(back, om.base, sizeof om.base);
    assert_int_equal(ckpt_dtype_convert(CKPT_BF16, bhead, CKPT_F32, back, NHEAD), 0);
    assert_memory_equal(back, om.head, sizeof om.head);
    ckpt_model_free(m);
    /* the model only, into the same accelerator's objects */
    memset(om.base, 0, sizeof om.base);
    memset(om.head, 0, sizeof om.head);
    ckpt_load_options mo = {.objects = CKPT_LOAD_MODELS};
    rc = ckpt_load_state_ex(om.acc, dir, &mo, NULL);
    if (rc != 0) fail_msg("load_state_ex: %s", ckpt_errmsg());
    assert_float_equal(om.base[255], 255.0f, 0);
    assert_float_equal(om.head[NHEAD - 1], (float)-(NHEAD - 1), 0);
    free(dir);
    one_model_close(&om);
}

/* ---- several processes: each rank links its own files ---------------------- */

enum { MPR = 2, MPBASE = 512 * 1024 }; /* the base: 2 MiB, cut between the ranks */

typedef struct mp_job {
    const char *proj;
    int rc[MPR];
    char msg[MPR][512];
    uint64_t written[MPR][3], linked[MPR][3];
} mp_job;

/* Each rank (a thread): a frozen base and a trained head, both replicated;
 * the save plan spreads their tensors over the ranks, so each rank writes a
 * share of each model into its own shard files. Three saves, the head
 * changed between them, with the default link_copies (2): the second save
 * writes a second copy of every unchanged file, the third links. */
static void mp_rank(const ckpt_comm *c, void *arg) {
    mp_job *j = arg;
    static float base[MPR][MPBASE], head[MPR][NHEAD];
    float *b = base[c->rank], *h = head[c->rank];
    for (int i = 0; i < MPBASE; i++) b[i] = (float)i;
    for (int i = 0; i < NHEAD; i++) h[i] = 1.0f;
    ckpt_model *mb = NULL, *mh = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {
        .project_dir = j->proj, .automatic_checkpoint_naming = true, .comm = c};
    int rc = ckpt_model_new(&mb);
    if (rc == 0) rc = ckpt_model_new(&mh);
    if (rc == 0)
        rc = ckpt_model_add_param(mb, "base", CKPT_F32, 2, (int64_t[]){MPBASE / 64, 64}, b, NULL);
    if (rc == 0)
        rc = ckpt_model_add_param(mh, "head", CKPT_F32, 2, (int64_t[]){NHEAD / 8, 8}, h, NULL);
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, mb);
    if (rc == 0) rc = ckpt_prepare_model(acc, mh);
    for (int k = 0; k < 3 && rc == 0; k++) {
        for (int i = 0; i < NHEAD; i++) h[i] += 1.0f;
        rc = ckpt_save_state(acc, NULL);
        ckpt_accelerator_last_save_bytes(acc, &j->written[c->rank][k], &j->linked[c->rank][k]);
    }
    j->rc[c->rank] = rc;
    if (rc) snprintf(j->msg[c->rank], sizeof j->msg[0], "%s", ckpt_errmsg());
    ckpt_accelerator_free(acc);
    ckpt_model_free(mb);
    ckpt_model_free(mh);
}

static void test_each_rank_links_its_own_files(void **state) {
    (void)state;
    mp_job j;
    memset(&j, 0, sizeof j);
    j.proj = tu_dir();
    tc_run(MPR, mp_rank, &j);
    for (int r = 0; r < MPR; r++)
        if (j.rc[r]) fail_msg("rank %d: %s", r, j.msg[r]);
    for (int r = 0; r < MPR; r++) {
        char name[64];
        /* the base's share of rank r, and rank r's generator */
        snprintf(name, sizeof name, "model-%05d-of-%05d.safetensors", r + 1, MPR);
        assert_false(same_file(0, 1, name)); /* the second copy */
        assert_true(same_file(1, 2, name));
        snprintf(name, sizeof name, "random_states_%d.safetensors", r);
        assert_false(same_file(0, 1, name));
        assert_true(same_file(1, 2, name));
        /* every rank linked at the third save only, and wrote less then */
        assert_int_equal(j.linked[r][0], 0);
        assert_int_equal(j.linked[r][1], 0);
        assert_true(j.linked[r][2] > 0);
        assert_true(j.written[r][2] < j.written[r][1]);
    }
    verify_deep(2);
}

/* ---- link_copies: retained checkpoints are independent copies ----------------- */

/* The default config (link_copies 0 = 2) with total_limit `limit`. */
static void open_default(int limit) {
    ckpt_accelerator_free(fx.acc);
    ckpt_project_config cfg = {
        .project_dir = tu_dir(), .automatic_checkpoint_naming = true, .total_limit = limit};
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mbase), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mhead), 0);
}

/* How many distinct inodes hold model.safetensors (the frozen base) among
 * the checkpoints listed. */
static int copies_of_base(const int *nums, int n) {
    struct stat seen[16];
    int k = 0;
    for (int i = 0; i < n; i++) {
        struct stat st = stat_of(nums[i], "model.safetensors");
        bool dup = false;
        for (int j = 0; j < k; j++) dup = dup || (seen[j].st_ino == st.st_ino);
        if (!dup) seen[k++] = st;
    }
    return k;
}

/* total_limit 0: one extra copy ever. The second save writes the unchanged
 * base again (a link would leave one copy for both checkpoints), every
 * later save links. A flipped byte in either copy leaves a loadable
 * checkpoint. */
static void test_link_copies_default_keeps_two_copies_with_no_limit(void **state) {
    (void)state;
    open_default(0);
    uint64_t linked[5];
    for (int i = 0; i < 5; i++) {
        assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
        ckpt_accelerator_last_save_bytes(fx.acc, NULL, &linked[i]);
        train_step();
    }
    assert_false(same_file(0, 1, "model.safetensors"));
    for (int n = 2; n < 5; n++) assert_true(same_file(1, n, "model.safetensors"));
    assert_int_equal(linked[0], 0);
    assert_int_equal(linked[1], 0);
    for (int i = 2; i < 5; i++) assert_true(linked[i] > NBASE * 4);
    /* the newest's copy is damaged: an older checkpoint on the other copy
     * still loads (the fallback), although four of five share the bad one */
    char *f = ckpt_file(4, "model.safetensors");
    tu_flip_byte(f, tu_file_size(f) / 2);
    free(f);
    assert_int_equal(ckpt_load_state(fx.acc, NULL), 0);
    char *c0 = tu_pathf("%s/checkpoints/checkpoint_0", tu_dir());
    assert_string_equal(ckpt_accelerator_last_dir(fx.acc), c0);
    free(c0);
}

/* total_limit 3: the retained three never share one copy; an unchanged
 * file is written again about every second save (N - 1). */
static void test_link_copies_default_with_total_limit(void **state) {
    (void)state;
    open_default(3);
    int writes = 0;
    for (int i = 0; i < 9; i++) {
        uint64_t linked = 0;
        assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
        ckpt_accelerator_last_save_bytes(fx.acc, NULL, &linked);
        writes += linked < NBASE * 4;
        if (i >= 2) {
            int kept[3] = {i - 2, i - 1, i};
            assert_int_equal(copies_of_base(kept, 3), 2);
        }
        train_step();
    }
    assert_int_equal(writes, 5); /* saves 0, 1, 3, 5, 7 */
}

/* link_copies 1 keeps today's rule; 3 keeps three copies; negative is
 * refused. */
static void test_link_copies_option(void **state) {
    (void)state;
    ckpt_accelerator_free(fx.acc);
    fx.acc = NULL;
    ckpt_project_config cfg = {
        .project_dir = tu_dir(), .automatic_checkpoint_naming = true, .link_copies = -1};
    tu_expect_error(ckpt_accelerator_new(&fx.acc, &cfg), CKPT_EINVAL, "link_copies");
    cfg.link_copies = 3;
    assert_int_equal(ckpt_accelerator_new(&fx.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mbase), 0);
    assert_int_equal(ckpt_prepare_model(fx.acc, fx.mhead), 0);
    for (int i = 0; i < 5; i++) {
        assert_int_equal(ckpt_save_state(fx.acc, NULL), 0);
        train_step();
    }
    int all[5] = {0, 1, 2, 3, 4};
    assert_int_equal(copies_of_base(all, 5), 3);
    assert_true(same_file(2, 4, "model.safetensors"));
}

/* An explicit folder keeps its link source a copy apart: a fine-tune's
 * first save next to the checkpoint it started from writes its own copy
 * (the source stays, the new folder would otherwise share its only one);
 * replacing the folder it links from links (that one goes). */
static void test_link_copies_explicit_folders(void **state) {
    (void)state;
    open_default(0);
    char *a = tu_pathf("%s/a", tu_dir()), *b = tu_pathf("%s/b", tu_dir());
    char *fa = tu_pathf("%s/model.safetensors", a), *fb = tu_pathf("%s/model.safetensors", b);
    assert_int_equal(ckpt_save_state(fx.acc, a), 0);
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, b), 0);
    struct stat sa, sb;
    assert_int_equal(lstat(fa, &sa), 0);
    assert_int_equal(lstat(fb, &sb), 0);
    assert_true(sa.st_ino != sb.st_ino);
    uint64_t linked = 0;
    train_step();
    assert_int_equal(ckpt_save_state(fx.acc, b), 0); /* replaces b, links from b */
    ckpt_accelerator_last_save_bytes(fx.acc, NULL, &linked);
    assert_true(linked >= NBASE * 4);
    free(a), free(b), free(fa), free(fb);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_hash_in_memory_is_the_hash_of_the_written_file, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_unchanged_file_is_linked_and_not_written, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_links_chain_through_saves, setup, teardown),
        cmocka_unit_test_setup_teardown(test_old_file_changed_after_commit_is_not_linked, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_old_file_and_manifest_changed_is_not_linked, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_deleting_old_checkpoint_keeps_newer_complete, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_rotation_keeps_linked_files, setup, teardown),
        cmocka_unit_test_setup_teardown(test_rotation_reads_nothing_of_the_new_checkpoint, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_option_off_writes_every_file, setup_off, teardown),
        cmocka_unit_test_setup_teardown(test_previous_without_xxh128_never_links, setup_off,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_async_save_links_too, setup, teardown),
        cmocka_unit_test_setup_teardown(test_link_across_file_systems_falls_back_to_writing, setup,
                                        teardown),
        cmocka_unit_test_setup_teardown(test_failed_save_after_link_loses_nothing, setup, teardown),
        cmocka_unit_test_setup_teardown(test_frozen_parameters_go_to_a_file_that_later_saves_link,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_version_2_frozen_file_still_loads, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_model_of_one_kind_stays_one_file, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_set_frozen_by_pattern_and_by_optimizer_group,
                                        tu_tmpdir_setup, tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_split_model_loads_flexibly, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_each_rank_links_its_own_files, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_link_copies_default_keeps_two_copies_with_no_limit,
                                        setup, teardown),
        cmocka_unit_test_setup_teardown(test_link_copies_default_with_total_limit, setup, teardown),
        cmocka_unit_test_setup_teardown(test_link_copies_option, setup, teardown),
        cmocka_unit_test_setup_teardown(test_link_copies_explicit_folders, setup, teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
