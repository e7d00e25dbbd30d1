/* test_optim_ext.c — what an optimizer does beyond PyTorch's plain fp32
 * update: frozen parameters (no state, never updated, whatever the order of
 * freezing and saving), external optimizers (the caller's update, ckpt's
 * files), and BF16/F16 parameters with fp32 masters (the fp32 update, then
 * rounding to nearest even, bit for bit; resumed bit for bit; exported and
 * imported with the masters). The numbers against PyTorch are in
 * tests/python/test_master_weights.py. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <cmocka.h>

#include "ckpt.h"
#include "ckpt/files.h"
#include "ckpt/torch.h"
#include "helpers/testutil.h"

/* ---- a model of two parameters in one block -------------------------------- */

enum { NW = 6, NB = 3, NBLK = NW + NB };

typedef struct net {
    float blk[NBLK], grad[NBLK]; /* w = blk[0..5] (2 x 3), b = blk[6..8] */
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_accelerator *acc;
} net;

static void net_model(net *n) {
    memset(n, 0, sizeof *n);
    for (int j = 0; j < NBLK; j++) n->blk[j] = (float)(0.5 * sin(0.3 * j + 1));
    assert_int_equal(ckpt_model_new(&n->m), CKPT_OK);
    assert_int_equal(
        ckpt_model_add_param(n->m, "w", CKPT_F32, 2, (int64_t[]){2, 3}, n->blk, n->grad), CKPT_OK);
    assert_int_equal(
        ckpt_model_add_param(n->m, "b", CKPT_F32, 1, (int64_t[]){NB}, n->blk + NW, n->grad + NW),
        CKPT_OK);
}

static void net_adamw(net *n) {
    assert_int_equal(ckpt_adamw_new(&n->o, n->m, 1e-2, 0.9, 0.999, 1e-8, 0.01), CKPT_OK);
}

static void net_free(net *n) {
    ckpt_accelerator_free(n->acc);
    ckpt_optimizer_free(n->o);
    ckpt_model_free(n->m);
}

static void set_grads(net *n, int t) {
    for (int j = 0; j < NBLK; j++) n->grad[j] = (float)sin(0.37 * j + t);
}

static void train(net *n, int from, int to) {
    for (int t = from; t < to; t++) {
        set_grads(n, t);
        if (ckpt_optimizer_step(n->o) != CKPT_OK) fail_msg("step %d: %s", t, ckpt_errmsg());
    }
}

/* The optimizer's state dict in memory (a writer: its entries by key). */
static ckpt_writer *state_of(ckpt_optimizer *o) {
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_optimizer_ops()->state_dict(o, w), CKPT_OK);
    return w;
}

static bool writer_has(const ckpt_writer *w, const char *key) {
    for (int64_t i = 0; i < ckpt_writer_count(w); i++) {
        ckpt_entry_info e;
        assert_int_equal(ckpt_writer_entry(w, i, &e), CKPT_OK);
        if (!strcmp(e.key, key)) return true;
    }
    return false;
}

static char *bytes_of(ckpt_optimizer *o, const char *name, size_t *len) {
    char *path = tu_pathf("%s/%s", tu_dir(), name);
    char *b = tu_state_bytes(ckpt_optimizer_ops(), o, path, len);
    free(path);
    return b;
}

/* One float of a state file's tensor key. */
static float file_float(const char *path, const char *key, int64_t at) {
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    ckpt_entry_info e;
    const void *data = NULL;
    if (ckpt_reader_tensor_view(r, key, &data, &e) != CKPT_OK) fail_msg("%s: %s", path, key);
    float v;
    memcpy(&v, (const char *)data + 4 * at, 4);
    ckpt_reader_free(r);
    return v;
}

/* Warnings a load logs, one after another. */
static char logged[4096];
static void collect(void *user, ckpt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    size_t n = strlen(logged);
    snprintf(logged + n, sizeof logged - n, "%s\n", msg);
}

static void net_prepare(net *n) {
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&n->acc, &cfg), CKPT_OK);
    ckpt_accelerator_set_log(n->acc, collect, NULL);
    assert_int_equal(ckpt_prepare_model(n->acc, n->m), CKPT_OK);
    if (ckpt_prepare_optimizer(n->acc, n->o) != CKPT_OK) fail_msg("prepare: %s", ckpt_errmsg());
}

/* ---- frozen parameters ------------------------------------------------------ */

/* Frozen before the optimizer is made: no state, never updated, the other
 * parameter's update unaffected (as b alone). */
static void test_frozen_parameter_keeps_no_state_and_never_changes(void **state) {
    (void)state;
    net n, alone;
    net_model(&n);
    assert_int_equal(ckpt_model_set_frozen(n.m, "w", true), 1);
    net_adamw(&n);
    float w0[NW];
    memcpy(w0, n.blk, sizeof w0);
    train(&n, 0, 3);
    assert_memory_equal(n.blk, w0, sizeof w0);
    ckpt_param_info pi;
    assert_int_equal(ckpt_model_param(n.m, 0, &pi), CKPT_OK);
    assert_true(pi.frozen);
    assert_int_equal(ckpt_model_param(n.m, 1, &pi), CKPT_OK);
    assert_false(pi.frozen);
    ckpt_writer *w = state_of(n.o);
    assert_true(writer_has(w, "param_names.0"));
    assert_false(writer_has(w, "state.0.step"));
    assert_false(writer_has(w, "state.0.exp_avg"));
    assert_true(writer_has(w, "state.1.exp_avg_sq"));
    assert_true(writer_has(w, "param_groups.0.params"));
    ckpt_writer_free(w);
    assert_int_equal(ckpt_optimizer_get_step(n.o), 3);

    /* b trained alone: the same bits */
    memset(&alone, 0, sizeof alone);
    for (int j = 0; j < NBLK; j++) alone.blk[j] = (float)(0.5 * sin(0.3 * j + 1));
    assert_int_equal(ckpt_model_new(&alone.m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(alone.m, "b", CKPT_F32, 1, (int64_t[]){NB},
                                          alone.blk + NW, alone.grad + NW),
                     CKPT_OK);
    net_adamw(&alone);
    train(&alone, 0, 3);
    assert_memory_equal(alone.blk + NW, n.blk + NW, NB * sizeof(float));
    net_free(&alone);
    net_free(&n);
}

/* Freezing after steps drops the state at once; unfreezing starts from
 * fresh state (step 0), as a new parameter would. */
static void test_freezing_mid_run_drops_state_unfreezing_starts_fresh(void **state) {
    (void)state;
    net n;
    net_model(&n);
    net_adamw(&n);
    train(&n, 0, 2);
    assert_int_equal(ckpt_model_set_frozen(n.m, "w", true), 1);
    float w0[NW];
    memcpy(w0, n.blk, sizeof w0);
    train(&n, 2, 4);
    assert_memory_equal(n.blk, w0, sizeof w0);
    ckpt_writer *w = state_of(n.o);
    assert_false(writer_has(w, "state.0.exp_avg"));
    ckpt_writer_free(w);
    assert_int_equal(ckpt_model_set_frozen(n.m, "w", false), 1);
    /* the first step after: the same as a fresh optimizer's on w's values */
    net fresh;
    memset(&fresh, 0, sizeof fresh);
    memcpy(fresh.blk, n.blk, sizeof fresh.blk);
    assert_int_equal(ckpt_model_new(&fresh.m), CKPT_OK);
    assert_int_equal(
        ckpt_model_add_param(fresh.m, "w", CKPT_F32, 2, (int64_t[]){2, 3}, fresh.blk, fresh.grad),
        CKPT_OK);
    net_adamw(&fresh);
    set_grads(&fresh, 4);
    assert_int_equal(ckpt_optimizer_step(fresh.o), CKPT_OK);
    train(&n, 4, 5);
    assert_memory_equal(n.blk, fresh.blk, NW * sizeof(float));
    assert_int_equal(ckpt_optimizer_get_step(n.o), 5); /* b's count */
    net_free(&fresh);
    net_free(&n);
}

/* Trainable or frozen by default: in an optimizer's group, trainable
 * whatever its gradient buffer; in none, frozen; without an optimizer, by
 * its gradient buffer. */
static void test_grad_less_parameter_in_a_group_is_trainable(void **state) {
    (void)state;
    float x[4] = {1, 2, 3, 4}, gy[4] = {0}, y[4] = {0};
    ckpt_model *m = NULL;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "x", CKPT_F32, 1, (int64_t[]){4}, x, NULL), 0);
    assert_int_equal(ckpt_model_add_param(m, "y", CKPT_F32, 1, (int64_t[]){4}, y, gy), 0);
    ckpt_param_info pi;
    assert_int_equal(ckpt_model_param(m, 0, &pi), CKPT_OK);
    assert_true(pi.frozen); /* no optimizer yet */
    ckpt_optimizer *o = NULL;
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    assert_int_equal(ckpt_optimizer_external_new(&o, CKPT_OPTIM_ADAMW, m, &op), CKPT_OK);
    assert_int_equal(ckpt_model_param(m, 0, &pi), CKPT_OK);
    assert_false(pi.frozen); /* in the optimizer's group: trainable */
    assert_int_equal(ckpt_optimizer_set_groups(o, 1, (int[]){-1, 0}, &op), CKPT_OK);
    assert_int_equal(ckpt_model_param(m, 0, &pi), CKPT_OK);
    assert_true(pi.frozen);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

/* A checkpoint saved before freezing loads: the frozen parameter's weights
 * from the model's file, its optimizer state in the file skipped (said
 * once); one saved while frozen loads into a trainable parameter with
 * fresh state (said once). */
static void test_checkpoints_across_freezing_load(void **state) {
    (void)state;
    char *before = tu_pathf("%s/before", tu_dir()), *frozen = tu_pathf("%s/frozen", tu_dir());
    net a;
    net_model(&a);
    net_adamw(&a);
    train(&a, 0, 2);
    net_prepare(&a);
    assert_int_equal(ckpt_save_state(a.acc, before), CKPT_OK);

    net f;
    net_model(&f);
    assert_int_equal(ckpt_model_set_frozen(f.m, "w", true), 1);
    net_adamw(&f);
    net_prepare(&f);
    logged[0] = '\0';
    if (ckpt_load_state(f.acc, before) != CKPT_OK) fail_msg("load: %s", ckpt_errmsg());
    assert_memory_equal(f.blk, a.blk, sizeof a.blk);
    tu_assert_contains(logged, "state for 1 parameter frozen here ('w')");
    assert_int_equal(ckpt_optimizer_get_step(f.o), 2);
    train(&a, 2, 4);
    train(&f, 2, 4);
    assert_memory_equal(f.blk + NW, a.blk + NW, NB * sizeof(float)); /* b's moments loaded */
    assert_int_equal(ckpt_save_state(f.acc, frozen), CKPT_OK);
    char *split = tu_pathf("%s/model.frozen.safetensors", frozen);
    assert_true(tu_exists(split)); /* w in the frozen model file */
    free(split);

    net t;
    net_model(&t);
    net_adamw(&t);
    net_prepare(&t);
    logged[0] = '\0';
    if (ckpt_load_state(t.acc, frozen) != CKPT_OK) fail_msg("load: %s", ckpt_errmsg());
    tu_assert_contains(logged, "no state for 1 parameter ('w': frozen when saved)");
    assert_memory_equal(t.blk, f.blk, sizeof f.blk);
    ckpt_writer *w = state_of(t.o);
    ckpt_writer_free(w);
    char *p = tu_pathf("%s/t.safetensors", tu_dir());
    tu_save_state(ckpt_optimizer_ops(), t.o, p);
    assert_true(file_float(p, "state.0.step", 0) == 0.0f);
    assert_true(file_float(p, "state.0.exp_avg", 3) == 0.0f);
    assert_true(file_float(p, "state.1.step", 0) == 4.0f);
    free(p);
    net_free(&t);
    net_free(&f);
    net_free(&a);
    free(before);
    free(frozen);
}

/* ---- external optimizers ---------------------------------------------------- */

typedef struct ext {
    net n;
    float m[NBLK], v[NBLK], vmax[NBLK];
} ext;

static void ext_new(ext *x, bool amsgrad) {
    memset(x, 0, sizeof *x);
    net_model(&x->n);
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    op.lr = 1e-2;
    op.amsgrad = amsgrad;
    assert_int_equal(ckpt_optimizer_external_new(&x->n.o, CKPT_OPTIM_ADAMW, x->n.m, &op), CKPT_OK);
}

static void ext_attach(ext *x) {
    assert_int_equal(ckpt_optimizer_set_state_block(x->n.o, "exp_avg", x->m, x->n.blk), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_state_block(x->n.o, "exp_avg_sq", x->v, x->n.blk), CKPT_OK);
}

static void test_external_checks_its_fields(void **state) {
    (void)state;
    ext x;
    ext_new(&x, false);
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&x.n.acc, &cfg), CKPT_OK);
    tu_expect_error(ckpt_prepare_optimizer(x.n.acc, x.n.o), CKPT_EINVAL,
                    "parameter 'w' has no 'exp_avg'");
    tu_expect_error(ckpt_optimizer_set_state(x.n.o, "w", "momentum_buffer", x.m), CKPT_EINVAL,
                    "has: exp_avg, exp_avg_sq)");
    tu_expect_error(ckpt_optimizer_set_state(x.n.o, "nope", "exp_avg", x.m), CKPT_ENOENT, "'nope'");
    assert_int_equal(ckpt_optimizer_set_state(x.n.o, "w", "exp_avg", x.m), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_state(x.n.o, "w", "exp_avg_sq", x.v), CKPT_OK);
    tu_expect_error(ckpt_prepare_optimizer(x.n.acc, x.n.o), CKPT_EINVAL,
                    "parameter 'b' has no 'exp_avg'");
    /* a block whose base is past a parameter: refused, nothing attached */
    tu_expect_error(ckpt_optimizer_set_state_block(x.n.o, "exp_avg", x.m, x.n.blk + 1), CKPT_EINVAL,
                    "parameter 'w' is not in the block");
    ext_attach(&x);
    assert_int_equal(ckpt_prepare_optimizer(x.n.acc, x.n.o), CKPT_OK);
    tu_expect_error(ckpt_optimizer_step(x.n.o), CKPT_EINVAL, "external");
    /* frozen: no state to attach; unfrozen again: attach again */
    assert_int_equal(ckpt_model_set_frozen(x.n.m, "b", true), 1);
    tu_expect_error(ckpt_optimizer_set_state(x.n.o, "b", "exp_avg", x.m + NW), CKPT_EINVAL,
                    "frozen");
    char *dir = tu_pathf("%s/fields_ck", tu_dir());
    assert_int_equal(ckpt_save_state(x.n.acc, dir), CKPT_OK);
    assert_int_equal(ckpt_model_set_frozen(x.n.m, "b", false), 1);
    char *dir2 = tu_pathf("%s/fields_ck2", tu_dir());
    tu_expect_error(ckpt_save_state(x.n.acc, dir2), CKPT_EINVAL, "parameter 'b' has no 'exp_avg'");
    free(dir);
    free(dir2);
    net_free(&x.n);

    /* amsgrad: max_exp_avg_sq too; ckpt's own optimizer borrows nothing */
    ext_new(&x, true);
    ext_attach(&x);
    assert_int_equal(ckpt_accelerator_new(&x.n.acc, &cfg), CKPT_OK);
    tu_expect_error(ckpt_prepare_optimizer(x.n.acc, x.n.o), CKPT_EINVAL, "'max_exp_avg_sq'");
    net_free(&x.n);
    net own;
    net_model(&own);
    net_adamw(&own);
    tu_expect_error(ckpt_optimizer_set_state(own.o, "w", "exp_avg", x.m), CKPT_EINVAL,
                    "keeps its own state");
    net_free(&own);
}

/* The caller's state in ckpt's files: an external AdamW's state dict is
 * byte for byte ckpt's own AdamW's with the same moments and step count, a
 * load fills the caller's buffers, the export to optimizer.bin is the same
 * file, and a save with nothing changed links the optimizer's file. */
static void test_external_state_is_saved_as_the_own_optimizers(void **state) {
    (void)state;
    net own;
    net_model(&own);
    net_adamw(&own);
    train(&own, 0, 3);
    size_t la = 0, lb = 0;
    char *a = bytes_of(own.o, "own.safetensors", &la);

    ext x;
    ext_new(&x, false);
    ext_attach(&x);
    x.n.blk[0] = 7; /* the model's values are not the optimizer's state */
    char *path = tu_pathf("%s/own.safetensors", tu_dir());
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), x.n.o, path), CKPT_OK);
    free(path);
    assert_int_equal(ckpt_optimizer_get_step(x.n.o), 3);
    assert_true(x.m[2] != 0 && x.v[8] != 0);
    char *b = bytes_of(x.n.o, "ext.safetensors", &lb);
    tu_assert_bytes_equal(a, la, b, lb);
    free(a);
    free(b);

    /* through checkpoints and the export */
    memcpy(x.n.blk, own.blk, sizeof own.blk);
    net_prepare(&own);
    net_prepare(&x.n);
    char *d1 = tu_pathf("%s/own_ck", tu_dir()), *d2 = tu_pathf("%s/ext_ck", tu_dir());
    assert_int_equal(ckpt_save_state(own.acc, d1), CKPT_OK);
    assert_int_equal(ckpt_save_state(x.n.acc, d2), CKPT_OK);
    char *e1 = tu_pathf("%s/own_out", tu_dir()), *e2 = tu_pathf("%s/ext_out", tu_dir());
    assert_int_equal(ckpt_export_torch(d1, e1, NULL), CKPT_OK);
    assert_int_equal(ckpt_export_torch(d2, e2, NULL), CKPT_OK);
    char *b1 = tu_pathf("%s/optimizer.bin", e1), *b2 = tu_pathf("%s/optimizer.bin", e2);
    tu_assert_same_file(b1, b2, "optimizer.bin");
    free(b1);
    free(b2);

    /* a load into zeroed buffers gives them back */
    float m[NBLK], v[NBLK];
    memcpy(m, x.m, sizeof m);
    memcpy(v, x.v, sizeof v);
    memset(x.m, 0, sizeof x.m);
    memset(x.v, 0, sizeof x.v);
    assert_int_equal(ckpt_optimizer_set_step(x.n.o, 0), CKPT_OK);
    assert_int_equal(ckpt_load_state(x.n.acc, d1), CKPT_OK);
    assert_memory_equal(m, x.m, sizeof m);
    assert_memory_equal(v, x.v, sizeof v);
    assert_int_equal(ckpt_optimizer_get_step(x.n.o), 3);

    /* the caller's step: new moments, a new count; nothing changed: linked
     * (link_copies 1: the default would write a second copy first) */
    ckpt_project_config cfg = {
        .project_dir = tu_dir(), .automatic_checkpoint_naming = true, .link_copies = 1};
    ckpt_accelerator *acc = NULL;
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_prepare_model(acc, x.n.m), CKPT_OK);
    assert_int_equal(ckpt_prepare_optimizer(acc, x.n.o), CKPT_OK);
    for (int j = 0; j < NBLK; j++) x.m[j] += 1.0f;
    assert_int_equal(ckpt_optimizer_set_step(x.n.o, 4), CKPT_OK);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    assert_int_equal(ckpt_save_state(acc, NULL), CKPT_OK);
    char *f0 = tu_pathf("%s/checkpoints/checkpoint_0/optimizer.safetensors", tu_dir());
    char *f1 = tu_pathf("%s/checkpoints/checkpoint_1/optimizer.safetensors", tu_dir());
    struct stat s0, s1;
    assert_int_equal(stat(f0, &s0), 0);
    assert_int_equal(stat(f1, &s1), 0);
    assert_true(s0.st_ino == s1.st_ino);
    assert_true(file_float(f1, "state.0.exp_avg", 0) == x.m[0]);
    assert_true(file_float(f1, "state.1.step", 0) == 4.0f);
    free(f0);
    free(f1);
    ckpt_accelerator_free(acc);
    free(d1);
    free(d2);
    free(e1);
    free(e2);
    net_free(&x.n);
    net_free(&own);
}

/* ---- BF16 / F16 parameters with fp32 masters -------------------------------- */

enum { NH = 2600 }; /* more than one of the update's chunks (1024) */

static uint16_t round16(ckpt_dtype dt, float f) {
    uint16_t h;
    assert_int_equal(ckpt_dtype_convert(CKPT_F32, &f, dt, &h, 1), CKPT_OK);
    return h;
}

static float widen(ckpt_dtype dt, uint16_t h) {
    float f;
    assert_int_equal(ckpt_dtype_convert(dt, &h, CKPT_F32, &f, 1), CKPT_OK);
    return f;
}

typedef struct half_net {
    ckpt_dtype dt;
    uint16_t *w, *g;  /* the half model */
    float *w32, *g32; /* the reference: the same update in fp32 */
    ckpt_model *m, *m32;
    ckpt_optimizer *o, *o32;
} half_net;

static void half_new(half_net *h, ckpt_dtype dt, ckpt_optim_kind kind) {
    memset(h, 0, sizeof *h);
    h->dt = dt;
    h->w = calloc(NH, 2);
    h->g = calloc(NH, 2);
    h->w32 = calloc(NH, 4);
    h->g32 = calloc(NH, 4);
    for (int j = 0; j < NH; j++) {
        h->w[j] = round16(dt, (float)(0.5 * sin(0.01 * j + 1)));
        h->w32[j] = widen(dt, h->w[j]);
    }
    int64_t shape[2] = {NH / 10, 10};
    assert_int_equal(ckpt_model_new(&h->m), CKPT_OK);
    assert_int_equal(ckpt_model_new(&h->m32), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(h->m, "w", dt, 2, shape, h->w, h->g), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(h->m32, "w", CKPT_F32, 2, shape, h->w32, h->g32),
                     CKPT_OK);
    ckpt_optim_options op = ckpt_optim_defaults(kind);
    op.lr = kind == CKPT_OPTIM_SGD ? 0.05 : 2e-3;
    op.momentum = kind == CKPT_OPTIM_SGD || kind == CKPT_OPTIM_RMSPROP ? 0.9 : 0;
    op.weight_decay = 0.01;
    op.master_weights = true;
    assert_int_equal(ckpt_optimizer_new(&h->o, kind, h->m, &op), CKPT_OK);
    assert_int_equal(ckpt_optimizer_new(&h->o32, kind, h->m32, &op), CKPT_OK);
}

static void half_free(half_net *h) {
    ckpt_optimizer_free(h->o);
    ckpt_optimizer_free(h->o32);
    ckpt_model_free(h->m);
    ckpt_model_free(h->m32);
    free(h->w);
    free(h->g);
    free(h->w32);
    free(h->g32);
}

/* Gradients of the half dtype; the reference gets them widened. */
static void half_step(half_net *h, int t, bool ref) {
    for (int j = 0; j < NH; j++) {
        h->g[j] = round16(h->dt, (float)(sin(0.37 * j + t) * 0.3 + widen(h->dt, h->w[j]) * 0.1));
        h->g32[j] = widen(h->dt, h->g[j]);
    }
    if (ckpt_optimizer_step(h->o) != CKPT_OK) fail_msg("step: %s", ckpt_errmsg());
    if (ref) assert_int_equal(ckpt_optimizer_step(h->o32), CKPT_OK);
}

static void assert_rounded(const half_net *h) {
    for (int j = 0; j < NH; j++)
        if (h->w[j] != round16(h->dt, h->w32[j]))
            fail_msg("w[%d]: %04x, the fp32 update rounds to %04x", j, h->w[j],
                     round16(h->dt, h->w32[j]));
}

static void test_master_weights_equal_the_fp32_update_then_rounding(void **state) {
    (void)state;
    const ckpt_dtype dts[2] = {CKPT_BF16, CKPT_F16};
    const ckpt_optim_kind kinds[4] = {CKPT_OPTIM_ADAMW, CKPT_OPTIM_ADAM, CKPT_OPTIM_SGD,
                                      CKPT_OPTIM_RMSPROP};
    for (int d = 0; d < 2; d++)
        for (int k = 0; k < 4; k++) {
            half_net h;
            half_new(&h, dts[d], kinds[k]);
            for (int t = 0; t < 8; t++) {
                half_step(&h, t, true);
                assert_rounded(&h);
            }
            /* the master is the reference's fp32 parameter, bit for bit */
            char *p = tu_pathf("%s/half.safetensors", tu_dir());
            tu_save_state(ckpt_optimizer_ops(), h.o, p);
            for (int j = 0; j < NH; j += 97) {
                float mj = file_float(p, "state.0.master", j);
                assert_memory_equal(&mj, &h.w32[j], 4);
            }
            free(p);
            half_free(&h);
        }
}

static void test_half_parameters_need_master_weights(void **state) {
    (void)state;
    uint16_t w[4] = {0}, g[4] = {0};
    ckpt_model *m = NULL;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "hw", CKPT_BF16, 1, (int64_t[]){4}, w, g), 0);
    ckpt_optimizer *o = NULL;
    tu_expect_error(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0.0), CKPT_EUNSUPPORTED,
                    "parameter 'hw' is BF16: its group needs master_weights");
    /* frozen, it needs nothing */
    assert_int_equal(ckpt_model_set_frozen(m, "hw", true), 1);
    assert_int_equal(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0.0), CKPT_OK);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    assert_int_equal(ckpt_model_set_frozen(m, "hw", false), 1);
    tu_expect_error(ckpt_optimizer_step(o), CKPT_EUNSUPPORTED, "master_weights");
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

/* A parameter set after the optimizer was made (initialised, or loaded
 * alone) is taken into its master before the next update. */
static void test_master_takes_up_a_parameter_changed_outside(void **state) {
    (void)state;
    half_net h;
    half_new(&h, CKPT_BF16, CKPT_OPTIM_ADAMW);
    for (int j = 0; j < NH; j++) {
        h.w[j] = round16(CKPT_BF16, (float)cos(0.02 * j));
        h.w32[j] = widen(CKPT_BF16, h.w[j]);
    }
    char *p = tu_pathf("%s/init.safetensors", tu_dir());
    tu_save_state(ckpt_optimizer_ops(), h.o, p);
    float m5 = file_float(p, "state.0.master", 5);
    assert_memory_equal(&m5, &h.w32[5], 4);
    free(p);
    for (int t = 0; t < 3; t++) half_step(&h, t, true);
    assert_rounded(&h);
    half_free(&h);
}

/* Resumed bit for bit: the BF16 parameters in the model's file, the masters
 * in the optimizer's; exported with them under "master", and imported
 * back. */
static void test_master_weights_resume_export_import(void **state) {
    (void)state;
    half_net h;
    half_new(&h, CKPT_BF16, CKPT_OPTIM_ADAMW);
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_prepare_model(acc, h.m), CKPT_OK);
    assert_int_equal(ckpt_prepare_optimizer(acc, h.o), CKPT_OK);
    for (int t = 0; t < 3; t++) half_step(&h, t, false);
    char *dir = tu_pathf("%s/half_ck", tu_dir());
    assert_int_equal(ckpt_save_state(acc, dir), CKPT_OK);
    for (int t = 3; t < 6; t++) half_step(&h, t, false);
    uint16_t *want = malloc(NH * 2);
    memcpy(want, h.w, NH * 2);
    size_t la = 0, lb = 0;
    char *a = bytes_of(h.o, "a.safetensors", &la);
    memset(h.w, 0, NH * 2);
    assert_int_equal(ckpt_load_state(acc, dir), CKPT_OK);
    for (int t = 3; t < 6; t++) half_step(&h, t, false);
    assert_memory_equal(h.w, want, NH * 2);
    char *b = bytes_of(h.o, "b.safetensors", &lb);
    tu_assert_bytes_equal(a, la, b, lb);
    free(a);
    free(b);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_checkpoint_open_object(dir, "model.safetensors", &r), CKPT_OK);
    ckpt_entry_info e;
    assert_int_equal(ckpt_reader_find(r, "w", &e), CKPT_OK);
    assert_int_equal(e.dtype, CKPT_BF16);
    ckpt_reader_free(r);
    assert_int_equal(ckpt_checkpoint_open_object(dir, "optimizer.safetensors", &r), CKPT_OK);
    assert_int_equal(ckpt_reader_find(r, "state.0.master", &e), CKPT_OK);
    assert_int_equal(e.dtype, CKPT_F32);
    float m0;
    const void *view = NULL;
    assert_int_equal(ckpt_reader_tensor_view(r, "state.0.master", &view, &e), CKPT_OK);
    memcpy(&m0, (const char *)view + 4 * 11, 4);
    ckpt_reader_free(r);

    /* export: state[0]["master"], float32, the same values */
    char *out = tu_pathf("%s/out", tu_dir()), *bin = tu_pathf("%s/out/optimizer.bin", tu_dir());
    assert_int_equal(ckpt_export_torch(dir, out, NULL), CKPT_OK);
    ckpt_torch_file *tf = NULL;
    assert_int_equal(ckpt_torch_open(&tf, bin), CKPT_OK);
    const ckpt_torch_value *st = ckpt_torch_dict_get(ckpt_torch_root(tf), "state");
    assert_non_null(st);
    assert_int_equal(st->n, 1);
    const ckpt_torch_value *s0 = st->items[1];
    const ckpt_torch_value *mv = ckpt_torch_dict_get(s0, "master");
    assert_non_null(mv);
    assert_int_equal(mv->kind, CKPT_TORCH_TENSOR);
    assert_int_equal(mv->dtype, CKPT_F32);
    float x0;
    memcpy(&x0, (const char *)mv->data + 4 * 11, 4);
    assert_memory_equal(&x0, &m0, 4);
    ckpt_torch_close(tf);
    /* import: the master comes back */
    char *imp = tu_pathf("%s/imp", tu_dir());
    ckpt_import_options io = ckpt_import_defaults();
    io.optimizer = CKPT_OPTIM_ADAMW;
    assert_int_equal(ckpt_import_torch(out, imp, &io), CKPT_OK);
    char *opt = tu_pathf("%s/optimizer.safetensors", imp);
    float y0 = file_float(opt, "state.0.master", 11);
    assert_memory_equal(&y0, &m0, 4);
    free(opt);
    free(imp);
    free(out);
    free(bin);
    free(want);
    free(dir);
    ckpt_accelerator_free(acc);
    half_free(&h);
}

/* The loss scaler unscales BF16 gradients in fp32, rounded back. */
static void test_scaler_unscales_half_gradients(void **state) {
    (void)state;
    half_net h;
    half_new(&h, CKPT_BF16, CKPT_OPTIM_SGD);
    ckpt_grad_scaler *gs = NULL;
    assert_int_equal(ckpt_grad_scaler_new(&gs, 1024.0, 2.0, 0.5, 2000), CKPT_OK);
    for (int j = 0; j < NH; j++) h.g[j] = round16(CKPT_BF16, (float)(sin(j) * 1000.0));
    uint16_t g5 = h.g[5];
    bool inf = true;
    assert_int_equal(ckpt_grad_scaler_unscale(gs, h.o, &inf), CKPT_OK);
    assert_false(inf);
    assert_int_equal(h.g[5], round16(CKPT_BF16, widen(CKPT_BF16, g5) * (1.0f / 1024.0f)));
    assert_int_equal(ckpt_grad_scaler_update(gs), CKPT_OK);
    h.g[7] = 0x7f80; /* +inf */
    assert_int_equal(ckpt_grad_scaler_unscale(gs, h.o, &inf), CKPT_OK);
    assert_true(inf);
    ckpt_grad_scaler_free(gs);
    half_free(&h);
}

/* An external optimizer's masters: field "master" of a BF16 parameter of a
 * master_weights group, saved as ckpt's own. */
static void test_external_master_field(void **state) {
    (void)state;
    uint16_t w[4] = {0x3f80, 0x4000, 0x4040, 0x4080}, g[4] = {0};
    float master[4] = {1.001f, 2.002f, 3.003f, 4.004f}, m[4] = {0}, v[4] = {0};
    ckpt_model *mo = NULL;
    assert_int_equal(ckpt_model_new(&mo), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(mo, "hw", CKPT_BF16, 1, (int64_t[]){4}, w, g), 0);
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    op.master_weights = true;
    ckpt_optimizer *o = NULL;
    assert_int_equal(ckpt_optimizer_external_new(&o, CKPT_OPTIM_ADAMW, mo, &op), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_state_block(o, "exp_avg", m, w), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_state_block(o, "exp_avg_sq", v, w), CKPT_OK);
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {0};
    assert_int_equal(ckpt_accelerator_new(&acc, &cfg), CKPT_OK);
    tu_expect_error(ckpt_prepare_optimizer(acc, o), CKPT_EINVAL, "has no 'master'");
    assert_int_equal(ckpt_optimizer_set_state(o, "hw", "master", master), CKPT_OK);
    assert_int_equal(ckpt_prepare_optimizer(acc, o), CKPT_OK);
    char *p = tu_pathf("%s/x.safetensors", tu_dir());
    tu_save_state(ckpt_optimizer_ops(), o, p);
    float x = file_float(p, "state.0.master", 2);
    assert_memory_equal(&x, &master[2], 4);
    /* the caller's master, untouched by ckpt */
    assert_true(master[0] == 1.001f);
    free(p);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(mo);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_frozen_parameter_keeps_no_state_and_never_changes),
        cmocka_unit_test(test_freezing_mid_run_drops_state_unfreezing_starts_fresh),
        cmocka_unit_test(test_grad_less_parameter_in_a_group_is_trainable),
        cmocka_unit_test(test_checkpoints_across_freezing_load),
        cmocka_unit_test(test_external_checks_its_fields),
        cmocka_unit_test(test_external_state_is_saved_as_the_own_optimizers),
        cmocka_unit_test(test_master_weights_equal_the_fp32_update_then_rounding),
        cmocka_unit_test(test_half_parameters_need_master_weights),
        cmocka_unit_test(test_master_takes_up_a_parameter_changed_outside),
        cmocka_unit_test(test_master_weights_resume_export_import),
        cmocka_unit_test(test_scaler_unscales_half_gradients),
        cmocka_unit_test(test_external_master_field),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
