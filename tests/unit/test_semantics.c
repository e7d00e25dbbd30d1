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

int main(void) {
#define T(name) cmocka_unit_test_setup_teardown(name, tu_tmpdir_setup, tu_tmpdir_teardown)
    const struct CMUnitTest tests[] = {
        T(test_step_follows_the_first_optimizer_unless_set),
        T(test_an_explicit_step_that_disagrees_warns_once_and_is_kept),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
