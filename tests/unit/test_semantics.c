/* test_semantics.c — what the words mean, as a PyTorch user reads them:
 *  - the step follows the optimizer (ckpt_accelerator_step is the first
 *    prepared optimizer's count unless set; a disagreeing explicit step
 *    warns once);
 *  - an explicit load path that does not exist, or is not a checkpoint, is
 *    an error the resume idiom cannot take for a fresh start, and saves
 *    refuse after it (a typo never rotates a run away);
 *  - an entry named checkpoint_<n> that is no checkpoint folder is stepped
 *    over by the numbering, left alone, and said once;
 *  - a resume removes the temporary folders of killed saves. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "helpers/testutil.h"

/* ---- a small run ------------------------------------------------------------ */

typedef struct logbook {
    int warnings, infos;
    char text[8192];
} logbook;

static void log_to(void *user, ckpt_log_level level, const char *msg) {
    logbook *l = user;
    if (level == CKPT_LOG_WARNING) l->warnings++;
    else if (level == CKPT_LOG_INFO) l->infos++;
    size_t n = strlen(l->text);
    snprintf(l->text + n, sizeof l->text - n, "%s\n", msg);
}

typedef struct run {
    float w[4], gw[4];
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_accelerator *acc;
    logbook log;
} run;

static void run_init(run *r, const char *project, int total_limit, bool optimizer) {
    memset(r, 0, sizeof *r);
    for (int j = 0; j < 4; j++) r->w[j] = 0.25f * (float)(j + 1);
    assert_int_equal(ckpt_model_new(&r->m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(r->m, "w", CKPT_F32, 1, (int64_t[]){4}, r->w, r->gw),
                     CKPT_OK);
    ckpt_project_config cfg = {
        .project_dir = project, .automatic_checkpoint_naming = true, .total_limit = total_limit};
    assert_int_equal(ckpt_accelerator_new(&r->acc, &cfg), CKPT_OK);
    ckpt_accelerator_set_log(r->acc, log_to, &r->log);
    assert_int_equal(ckpt_prepare_model(r->acc, r->m), CKPT_OK);
    if (optimizer) {
        assert_int_equal(ckpt_adamw_new(&r->o, r->m, 0.01, 0.9, 0.999, 1e-8, 0.0), CKPT_OK);
        assert_int_equal(ckpt_prepare_optimizer(r->acc, r->o), CKPT_OK);
    }
}

static void run_steps(run *r, int n) {
    for (int t = 0; t < n; t++) {
        for (int j = 0; j < 4; j++) r->gw[j] = 0.1f * (float)(j - t);
        assert_int_equal(ckpt_optimizer_step(r->o), CKPT_OK);
    }
}

static void run_free(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_optimizer_free(r->o);
    ckpt_model_free(r->m);
}

static int64_t manifest_step(const char *dir) {
    ckpt_checkpoint_info info;
    assert_int_equal(ckpt_checkpoint_verify(dir, false, &info), CKPT_OK);
    return info.step;
}

static char *project(void) { return tu_pathf("%s/run", tu_dir()); }

/* ---- the step follows the optimizer ----------------------------------------- */

/* A loop that never sets the step saves the optimizer's count and resumes
 * there (it used to save step 0 over trained weights). */
static void test_step_follows_the_first_optimizer_unless_set(void **state) {
    (void)state;
    char *p = project();
    run a;
    run_init(&a, p, 0, true);
    assert_int_equal(ckpt_accelerator_step(a.acc), 0);
    run_steps(&a, 7);
    assert_int_equal(ckpt_accelerator_step(a.acc), 7);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    assert_int_equal(manifest_step(ckpt_accelerator_last_dir(a.acc)), 7);
    assert_int_equal(a.log.warnings, 0);
    run_free(&a);

    run b;
    run_init(&b, p, 0, true);
    assert_int_equal(ckpt_load_state(b.acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_accelerator_step(b.acc), 7);
    run_steps(&b, 2); /* and goes on following it */
    assert_int_equal(ckpt_accelerator_step(b.acc), 9);
    /* once set, the step is what was set */
    ckpt_accelerator_set_step(b.acc, 9);
    run_steps(&b, 1);
    assert_int_equal(ckpt_accelerator_step(b.acc), 9);
    run_free(&b);

    free(p);

    /* without an optimizer the step is the accelerator's own */
    p = tu_pathf("%s/plain", tu_dir());
    run c, d;
    run_init(&c, p, 0, false);
    assert_int_equal(ckpt_accelerator_step(c.acc), 0);
    ckpt_accelerator_set_step(c.acc, 5);
    assert_int_equal(ckpt_save_state(c.acc, NULL), CKPT_OK);
    run_free(&c);
    run_init(&d, p, 0, false);
    assert_int_equal(ckpt_load_state(d.acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_accelerator_step(d.acc), 5);
    run_free(&d);
    free(p);
}

/* A step set explicitly to another value than the optimizer's count (a
 * loop counting micro-batches) is recorded, with one warning for the run;
 * a resume keeps it as loaded. */
static void test_an_explicit_step_that_disagrees_warns_once_and_is_kept(void **state) {
    (void)state;
    char *p = project();
    run a;
    run_init(&a, p, 0, true);
    run_steps(&a, 3);
    ckpt_accelerator_set_step(a.acc, 12);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    assert_int_equal(a.log.warnings, 1);
    tu_assert_contains(a.log.text, "(12)");
    tu_assert_contains(a.log.text, "(3)");
    assert_int_equal(manifest_step(ckpt_accelerator_last_dir(a.acc)), 12);
    run_steps(&a, 1);
    ckpt_accelerator_set_step(a.acc, 16);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    assert_int_equal(a.log.warnings, 1); /* once */
    run_free(&a);

    run b;
    run_init(&b, p, 0, true);
    assert_int_equal(ckpt_load_state(b.acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_accelerator_step(b.acc), 16);
    assert_int_equal(ckpt_optimizer_get_step(b.o), 4);
    run_steps(&b, 1); /* it does not jump to the optimizer's 5 */
    assert_int_equal(ckpt_accelerator_step(b.acc), 16);
    /* an explicit step equal to the optimizer's says nothing */
    run c;
    run_free(&b);
    run_init(&c, p, 0, true);
    run_steps(&c, 2);
    ckpt_accelerator_set_step(c.acc, 2);
    assert_int_equal(ckpt_accelerator_start_over(c.acc), CKPT_OK);
    assert_int_equal(ckpt_save_state(c.acc, NULL), CKPT_OK);
    assert_int_equal(c.log.warnings, 0);
    run_free(&c);
    free(p);
}

/* ---- an explicit load path is no fresh start --------------------------------- */

/* Three automatic saves (checkpoint_5.. checkpoint_7 after two made and
 * rotated away with total_limit 3). */
static void three_saves(const char *p) {
    run a;
    run_init(&a, p, 3, true);
    for (int k = 0; k < 8; k++) {
        run_steps(&a, 1);
        assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    }
    run_free(&a);
}

static int count_checkpoints(const char *p) {
    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    assert_int_equal(ckpt_checkpoint_list(p, false, &list, &n), CKPT_OK);
    free(list);
    return (int)n;
}

/* The report's typo: checkpoint_07 where checkpoint_7 exists. The resume
 * idiom (only CKPT_ENOENT is a fresh start) stops; if the program carries
 * on anyway, its saves refuse, so total_limit rotates nothing away. */
static void test_a_typo_in_an_explicit_load_path_is_an_error_not_a_fresh_start(void **state) {
    (void)state;
    char *p = project();
    three_saves(p);
    char *typo = tu_pathf("%s/checkpoints/checkpoint_07", p);
    run b;
    run_init(&b, p, 3, true);
    int rc = ckpt_load_state(b.acc, typo);
    assert_int_not_equal(rc, CKPT_ENOENT);
    tu_expect_error(rc, CKPT_EINVAL, "checkpoint_07: no such checkpoint folder");
    /* the message names the checkpoints that do exist */
    tu_assert_errmsg_has("holds checkpoint_5, checkpoint_6 and checkpoint_7");
    for (int k = 0; k < 4; k++) /* a program that ignores the error */
        tu_expect_error(ckpt_save_state(b.acc, NULL), CKPT_EINVAL, "refused");
    assert_int_equal(count_checkpoints(p), 3);
    char *kept = tu_pathf("%s/checkpoints/checkpoint_5", p);
    assert_true(tu_exists(kept));
    /* ckpt_load_state_ex alike; an explicit save refuses too */
    tu_expect_error(ckpt_load_state_ex(b.acc, typo, NULL, NULL), CKPT_EINVAL, "checkpoint_07");
    tu_expect_error(ckpt_save_state(b.acc, typo), CKPT_EINVAL, "refused");
    assert_false(tu_exists(typo));
    /* the right path loads, and saves go on */
    char *right = tu_pathf("%s/checkpoints/checkpoint_7", p);
    assert_int_equal(ckpt_load_state(b.acc, right), CKPT_OK);
    assert_int_equal(ckpt_save_state(b.acc, NULL), CKPT_OK);
    run_free(&b);
    free(kept);
    free(right);
    free(typo);
    free(p);
}

/* A folder without a manifest, a file, a dangling symlink: none is a
 * checkpoint, all are errors; a bare name lists the project's checkpoints;
 * start_over lets a run that means it begin again. */
static void test_an_explicit_path_that_is_not_a_checkpoint_is_an_error(void **state) {
    (void)state;
    char *p = project();
    three_saves(p);
    char *folder = tu_pathf("%s/stuff", tu_dir());
    char *file = tu_pathf("%s/file", tu_dir());
    char *link = tu_pathf("%s/link", tu_dir());
    assert_int_equal(mkdir(folder, 0755), 0);
    tu_write_text(file, "x");
    assert_int_equal(symlink("nowhere", link), 0);
    run b;
    run_init(&b, p, 3, true);
    tu_expect_error(ckpt_load_state(b.acc, folder), CKPT_EINVAL,
                    "not a checkpoint (no checkpoint.json)");
    /* beside it no checkpoint: the project's are named */
    tu_assert_errmsg_has("checkpoints holds checkpoint_5, checkpoint_6 and checkpoint_7");
    tu_expect_error(ckpt_load_state(b.acc, file), CKPT_EINVAL, "file: not a folder");
    tu_expect_error(ckpt_load_state(b.acc, link), CKPT_EINVAL, "link: no such checkpoint folder");
    tu_expect_error(ckpt_load_state(b.acc, "checkpoint_7"), CKPT_EINVAL,
                    "checkpoint_7: no such checkpoint folder");
    tu_assert_errmsg_has("checkpoint_5, checkpoint_6 and checkpoint_7");
    tu_expect_error(ckpt_save_state(b.acc, NULL), CKPT_EINVAL, "refused");
    assert_int_equal(ckpt_accelerator_start_over(b.acc), CKPT_OK);
    assert_int_equal(ckpt_save_state(b.acc, NULL), CKPT_OK);
    run_free(&b);
    /* without any checkpoint near it, the message says so */
    run c;
    char *empty = tu_pathf("%s/empty", tu_dir());
    run_init(&c, empty, 0, true);
    tu_expect_error(ckpt_load_state(c.acc, folder), CKPT_EINVAL, "there is no checkpoint_<n>");
    /* and a NULL input_dir with no checkpoint at all is the one fresh start */
    assert_int_equal(ckpt_accelerator_start_over(c.acc), CKPT_OK);
    tu_expect_error(ckpt_load_state(c.acc, NULL), CKPT_ENOENT, "no checkpoint");
    assert_int_equal(ckpt_save_state(c.acc, NULL), CKPT_OK);
    run_free(&c);
    free(empty);
    free(folder);
    free(file);
    free(link);
    free(p);
}

/* ---- names that are no checkpoint folder ------------------------------------- */

static int count_lines_with(const char *text, const char *needle) {
    int n = 0;
    for (const char *at = strstr(text, needle); at; at = strstr(at + 1, needle)) n++;
    return n;
}

/* A file, a dangling symlink and a symlinked folder named checkpoint_<n>:
 * numbering steps over every one (a commit cannot rename over them), they
 * are left exactly as they were, and one warning names them. */
static void test_entries_named_like_checkpoints_are_stepped_over_and_left_alone(void **state) {
    (void)state;
    char *p = project();
    char *cdir = tu_pathf("%s/checkpoints", p);
    run a;
    run_init(&a, p, 2, true);
    run_steps(&a, 1);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK); /* checkpoint_0 */
    char *file = tu_pathf("%s/checkpoint_1", cdir);
    char *dangling = tu_pathf("%s/checkpoint_2", cdir);
    char *linked = tu_pathf("%s/checkpoint_3", cdir);
    char *elsewhere = tu_pathf("%s/elsewhere", tu_dir());
    tu_write_text(file, "notes");
    assert_int_equal(symlink("nowhere", dangling), 0);
    assert_int_equal(mkdir(elsewhere, 0755), 0);
    assert_int_equal(symlink(elsewhere, linked), 0);
    for (int k = 0; k < 3; k++) {
        run_steps(&a, 1);
        assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    }
    char *last = tu_pathf("%s/checkpoint_6", cdir);
    assert_string_equal(ckpt_accelerator_last_dir(a.acc), last);
    assert_int_equal(count_lines_with(a.log.text, "not checkpoint folders"), 1);
    tu_assert_contains(a.log.text, "checkpoint_1 (a regular file)");
    tu_assert_contains(a.log.text, "checkpoint_2 (a symlink)");
    tu_assert_contains(a.log.text, "checkpoint_3 (a symlink)");
    run_free(&a);
    /* untouched, and rotation (total_limit 2) removed real folders only */
    tu_assert_file_text(file, "notes");
    char target[64] = "";
    assert_true(readlink(dangling, target, sizeof target - 1) > 0);
    assert_string_equal(target, "nowhere");
    struct stat st;
    assert_int_equal(lstat(linked, &st), 0);
    assert_true(S_ISLNK(st.st_mode));
    assert_int_equal(count_checkpoints(p), 2);
    /* a resume loads the newest real checkpoint and numbers on, saying it once */
    run b;
    run_init(&b, p, 2, true);
    assert_int_equal(ckpt_load_state(b.acc, NULL), CKPT_OK);
    assert_string_equal(ckpt_accelerator_last_dir(b.acc), last);
    assert_int_equal(ckpt_save_state(b.acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_save_state(b.acc, NULL), CKPT_OK);
    assert_int_equal(count_lines_with(b.log.text, "not checkpoint folders"), 1);
    run_free(&b);
    /* even a name above every folder's number is stepped over */
    char *high = tu_pathf("%s/checkpoint_40", cdir);
    tu_write_text(high, "x");
    run c;
    run_init(&c, p, 2, true);
    assert_int_equal(ckpt_load_state(c.acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_save_state(c.acc, NULL), CKPT_OK);
    char *c41 = tu_pathf("%s/checkpoint_41", cdir);
    assert_string_equal(ckpt_accelerator_last_dir(c.acc), c41);
    tu_assert_file_text(high, "x");
    run_free(&c);
    free(c41);
    free(high);
    free(last);
    free(elsewhere);
    free(linked);
    free(dangling);
    free(file);
    free(cdir);
    free(p);
}

/* ---- a resume removes what killed saves left ------------------------------- */

static pid_t gone_pid(void) {
    pid_t pid = fork();
    assert_true(pid >= 0);
    if (pid == 0) _exit(0);
    int status;
    assert_int_equal(waitpid(pid, &status, 0), pid);
    return pid;
}

static void test_a_resume_removes_temporary_folders_of_killed_saves(void **state) {
    (void)state;
    char *p = project();
    run a;
    run_init(&a, p, 0, true);
    run_steps(&a, 1);
    assert_int_equal(ckpt_save_state(a.acc, NULL), CKPT_OK);
    run_free(&a);
    pid_t dead = gone_pid();
    char *killed = tu_pathf("%s/checkpoints/.checkpoint_1.tmp.%ld", p, (long)dead);
    char *rotated = tu_pathf("%s/checkpoints/.checkpoint_0.old.%ld", p, (long)dead);
    char *alive = tu_pathf("%s/checkpoints/.checkpoint_1.tmp.%ld", p, (long)getppid());
    char *inner = tu_pathf("%s/model.safetensors", killed);
    for (int k = 0; k < 3; k++) {
        const char *d = k == 0 ? killed : k == 1 ? rotated : alive;
        assert_int_equal(mkdir(d, 0755), 0);
    }
    tu_write_text(inner, "half written");
    run b;
    run_init(&b, p, 0, true);
    assert_int_equal(ckpt_load_state(b.acc, NULL), CKPT_OK);
    /* gone at the load, before any save; one line each; a live one stays */
    assert_false(tu_exists(killed));
    assert_false(tu_exists(rotated));
    assert_true(tu_exists(alive));
    assert_int_equal(count_lines_with(b.log.text, "whose process"), 2);
    tu_assert_contains(b.log.text, killed);
    tu_assert_contains(b.log.text, rotated);
    run_free(&b);
    free(inner);
    free(alive);
    free(rotated);
    free(killed);
    free(p);
}

int main(void) {
#define T(name) cmocka_unit_test_setup_teardown(name, tu_tmpdir_setup, tu_tmpdir_teardown)
    const struct CMUnitTest tests[] = {
        T(test_step_follows_the_first_optimizer_unless_set),
        T(test_an_explicit_step_that_disagrees_warns_once_and_is_kept),
        T(test_a_typo_in_an_explicit_load_path_is_an_error_not_a_fresh_start),
        T(test_an_explicit_path_that_is_not_a_checkpoint_is_an_error),
        T(test_entries_named_like_checkpoints_are_stepped_over_and_left_alone),
        T(test_a_resume_removes_temporary_folders_of_killed_saves),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
