/* test_powerloss_interop.c — power cuts during ckpt_export_torch and
 * ckpt_import_torch. Both commit through the folder transaction the save uses
 * (store/txn), and the simulator (tests/crashsim) proves it here for them too:
 * every mutating I/O call of the operation is recorded, and for every prefix
 * of the record every state the file system may be in after a power cut
 * there is rebuilt and checked:
 *
 *   - the target folder is absent or complete: exactly the names and bytes
 *     of the same operation run without a cut (an import's checkpoint also
 *     verifies deeply); once the call had returned it is there;
 *   - whatever a cut left behind, the same operation run again succeeds (or,
 *     the target being complete, refuses with CKPT_EEXIST), and nothing but
 *     hidden temporary folders sits beside the target.
 *
 * Then the same export with the files' fsync removed (a test-only switch of
 * the I/O layer) must make the checker find a violation: the check can fail.
 * The seed is printed; CKPT_CRASHSIM_SEED replays one. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/io.h"
#include "testing/testing.h"
#include "crashsim/crashsim.h"
#include "helpers/testutil.h"

static uint64_t g_seed;

/* ---- a checkpoint to export, made once ---------------------------------------- */

#define NW 600 /* several 512-byte sectors, so the simulated writes can tear */
#define NB 24

static float w[NW], gw[NW], b[NB], gb[NB];

/* Saves a trained model + AdamW + scheduler + scaler at dir. */
static void make_checkpoint(const char *dir) {
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_scheduler *s = NULL;
    ckpt_grad_scaler *gs = NULL;
    ckpt_accelerator *acc = NULL;
    for (int i = 0; i < NW; i++) w[i] = (float)i * 1e-3f - 0.2f;
    for (int i = 0; i < NB; i++) b[i] = (float)i * 0.25f;
    int64_t sw[2] = {NB, NW / NB}, sb[1] = {NB};
    assert_int_equal(ckpt_model_new(&m), 0);
    assert_int_equal(ckpt_model_add_param(m, "fc.weight", CKPT_F32, 2, sw, w, gw), 0);
    assert_int_equal(ckpt_model_add_param(m, "fc.bias", CKPT_F32, 1, sb, b, gb), 0);
    assert_int_equal(ckpt_adamw_new(&o, m, 0.01, 0.9, 0.999, 1e-8, 0.01), 0);
    assert_int_equal(ckpt_warmup_cosine_new(&s, o, 2, 20), 0);
    assert_int_equal(ckpt_grad_scaler_new(&gs, 256.0, 2.0, 0.5, 3), 0);
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(acc, m), 0);
    assert_int_equal(ckpt_prepare_optimizer(acc, o), 0);
    assert_int_equal(ckpt_prepare_scheduler(acc, s), 0);
    assert_int_equal(ckpt_prepare_scaler(acc, gs), 0);
    for (int step = 0; step < 3; step++) {
        for (int i = 0; i < NW; i++) gw[i] = (float)((i * 7 + step) % 5) - 2.0f;
        for (int i = 0; i < NB; i++) gb[i] = 0.5f * (float)(i - step);
        assert_int_equal(ckpt_grad_scaler_step(gs, o, NULL), 0);
        assert_int_equal(ckpt_grad_scaler_update(gs), 0);
        assert_int_equal(ckpt_scheduler_step(s), 0);
    }
    ckpt_accelerator_set_step(acc, 3);
    assert_int_equal(ckpt_save_state(acc, dir), 0);
    ckpt_accelerator_free(acc);
    ckpt_grad_scaler_free(gs);
    ckpt_scheduler_free(s);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

/* ---- the operations and their check ------------------------------------------ */

typedef enum { OP_EXPORT, OP_IMPORT } op_kind;

typedef struct check_ctx {
    op_kind op;
    const char *src; /* the export's checkpoint or the import's torch folder */
    const char *ref; /* the same operation's result without a power cut */
} check_ctx;

static int run_op(const check_ctx *x, const char *target) {
    if (x->op == OP_EXPORT) return ckpt_export_torch(x->src, target, NULL);
    ckpt_import_options io = ckpt_import_defaults();
    io.optimizer = CKPT_OPTIM_ADAMW;
    return ckpt_import_torch(x->src, target, &io);
}

static int why_fail(char *why, size_t cap, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(why, cap, fmt, ap);
    va_end(ap);
    return 1;
}

/* The visible (not dot-prefixed) names of dir, sorted, joined by '/'. */
static void visible_names(const char *dir, char *out, size_t cap) {
    char names[32][256];
    int n = 0;
    DIR *d = opendir(dir);
    out[0] = '\0';
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d)) && n < 32)
        if (e->d_name[0] != '.') snprintf(names[n++], sizeof names[0], "%s", e->d_name);
    closedir(d);
    for (int i = 0; i < n; i++)
        for (int j = i + 1; j < n; j++)
            if (strcmp(names[j], names[i]) < 0) {
                char t[256];
                memcpy(t, names[i], sizeof t);
                memcpy(names[i], names[j], sizeof t);
                memcpy(names[j], t, sizeof t);
            }
    for (int i = 0; i < n; i++) {
        size_t len = strlen(out);
        snprintf(out + len, cap - len, "%s%s", i ? "/" : "", names[i]);
    }
}

/* Whether target holds exactly ref's names and bytes (an import's
 * checkpoint.json records when it was made, so its bytes are not compared:
 * the deep verification checks it against every file instead). */
static int same_as_ref(const check_ctx *x, const char *target, char *why, size_t cap) {
    char have[4096], want[4096];
    visible_names(target, have, sizeof have);
    visible_names(x->ref, want, sizeof want);
    if (strcmp(have, want) != 0)
        return why_fail(why, cap, "the target holds [%s], the operation makes [%s]", have, want);
    char *list = strdup(want);
    int bad = 0;
    for (char *save = NULL, *name = strtok_r(list, "/", &save); name && !bad;
         name = strtok_r(NULL, "/", &save)) {
        if (x->op == OP_IMPORT && strcmp(name, "checkpoint.json") == 0) continue;
        char a[4200], r[4200];
        tu_path(a, sizeof a, target, name);
        tu_path(r, sizeof r, x->ref, name);
        size_t na = 0, nr = 0;
        char *ba = tu_read_file(a, &na), *br = tu_read_file(r, &nr);
        if (!ba || !br || na != nr || memcmp(ba, br, na) != 0)
            bad = why_fail(why, cap, "%s differs from the same operation without a cut", name);
        free(ba);
        free(br);
    }
    free(list);
    if (!bad && x->op == OP_IMPORT) {
        ckpt_checkpoint_info info;
        if (ckpt_checkpoint_verify(target, true, &info) != 0)
            bad = why_fail(why, cap, "the imported checkpoint does not verify: %s", ckpt_errmsg());
    }
    return bad;
}

static int check_state_unsynced(void *user, const char *root, const cs_crash *c, char *why,
                                size_t cap) {
    check_ctx *x = user;
    char target[4200];
    tu_path(target, sizeof target, root, "target");
    struct stat st;
    bool there = stat(target, &st) == 0;
    if (c->complete && !there)
        return why_fail(why, cap, "the call had returned, yet the target is gone: not durable");
    if (there && same_as_ref(x, target, why, cap)) return 1;
    /* Nothing left behind may stop the same operation, or be visible. */
    int rc = run_op(x, target);
    if (there ? rc != CKPT_EEXIST : rc != 0)
        return why_fail(why, cap, "the operation run again gave %d (%s)", rc, ckpt_errmsg());
    if (!there && same_as_ref(x, target, why, cap)) return 1;
    char names[4096];
    visible_names(root, names, sizeof names);
    if (strcmp(names, "target") != 0) return why_fail(why, cap, "beside the target: [%s]", names);
    return 0;
}

static int check_state(void *user, const char *root, const cs_crash *c, char *why, size_t cap) {
    ckpt__io_set_unsafe(CKPT_IO_SKIP_EVERY_FSYNC); /* scratch: its durability is not checked */
    int bad = check_state_unsynced(user, root, c, why, cap);
    ckpt__io_set_unsafe(0);
    return bad;
}

/* Records op into <t>/root/target with the I/O layer's switches unsafe, and
 * explores every power cut. */
static cs_result simulate(op_kind op, unsigned unsafe, int samples, size_t *events) {
    char *t = tu_tmpdir_new("powerloss_interop");
    char ck[4200], exported[4200], ref[4200], root[4200], target[4200], scratch[4200];
    tu_path(ck, sizeof ck, t, "ck");
    tu_path(exported, sizeof exported, t, "exported");
    tu_path(ref, sizeof ref, t, "ref");
    tu_path(root, sizeof root, t, "root");
    tu_path(target, sizeof target, root, "target");
    tu_path(scratch, sizeof scratch, t, "crash");
    make_checkpoint(ck);
    assert_int_equal(ckpt_export_torch(ck, exported, NULL), 0);
    check_ctx x = {.op = op, .src = op == OP_EXPORT ? ck : exported, .ref = ref};
    assert_int_equal(run_op(&x, ref), 0);
    assert_int_equal(mkdir(root, 0755), 0);
    cs_sim *s = NULL;
    assert_int_equal(cs_start(&s, root), 0);
    ckpt__io_set_unsafe(unsafe);
    int rc = run_op(&x, target);
    ckpt__io_set_unsafe(0);
    assert_int_equal(rc, 0);
    /* The record must explain the folder exactly: no call bypassed the layer. */
    assert_int_equal(cs_stop(s), 0);
    cs_options o = {.seed = g_seed, .samples = samples, .exhaustive_max = samples};
    cs_result r;
    memset(&r, 0, sizeof r);
    assert_int_equal(cs_explore(s, scratch, &o, check_state, &x, &r), 0);
    *events = cs_event_count(s);
    cs_free(s);
    tu_tmpdir_free(t);
    return r;
}

static void report(const char *what, const cs_result *r, size_t events) {
    printf("power-loss: %-40s %zu calls, %zu crash points (%zu sampled), %zu states, %zu "
           "distinct checked, %zu violations (seed %llu)\n",
           what, events, r->crash_points, r->sampled_points, r->generated, r->checked,
           r->violations, (unsigned long long)r->seed);
    if (r->violations) printf("power-loss:   first: %s\n", r->first_violation);
    fflush(stdout);
}

static void test_powerloss_export(void **state) {
    (void)state;
    size_t events = 0;
    cs_result r = simulate(OP_EXPORT, 0, 8, &events);
    report("export to PyTorch:", &r, events);
    assert_true(r.checked > 10);
    assert_int_equal(r.violations, 0);
}

static void test_powerloss_import(void **state) {
    (void)state;
    size_t events = 0;
    cs_result r = simulate(OP_IMPORT, 0, 8, &events);
    report("import from PyTorch:", &r, events);
    assert_true(r.checked > 10);
    assert_int_equal(r.violations, 0);
}

/* The check can fail: without the files' fsync, a cut right after the
 * export returned can leave the folder's names durable and its bytes not. */
static void test_powerloss_export_catches_missing_file_fsync(void **state) {
    (void)state;
    size_t events = 0;
    cs_result r = simulate(OP_EXPORT, CKPT_IO_SKIP_FILE_FSYNC, 8, &events);
    report("export WITHOUT file fsync (must fail):", &r, events);
    assert_true(r.violations > 0);
}

int main(void) {
    const char *e = getenv("CKPT_CRASHSIM_SEED");
    g_seed =
        e && *e ? strtoull(e, NULL, 0) : (uint64_t)time(NULL) * 2654435761u + (uint64_t)getpid();
    if (!g_seed) g_seed = 1;
    printf("power-loss: seed %llu (replay with CKPT_CRASHSIM_SEED=%llu)\n",
           (unsigned long long)g_seed, (unsigned long long)g_seed);
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_powerloss_export),
        cmocka_unit_test(test_powerloss_import),
        cmocka_unit_test(test_powerloss_export_catches_missing_file_fsync),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
