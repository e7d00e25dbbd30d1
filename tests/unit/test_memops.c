/* test_memops.c — memory ckpt cannot touch (ckpt_memory_ops): parameters
 * and optimizer state on an emulated device whose pages are inaccessible
 * outside the ops' own copies (tests/emudev.h: a dereferenced handle
 * crashes the test). The same training state held on the device or in host
 * memory gives the same files, byte for byte, saved synchronously or
 * asynchronously (staged in the caller's thread), as Hugging Face shards,
 * linked when unchanged, and exported; it loads back (two-pass and
 * one-pass) through from_host only; every ops call moves at most
 * CKPT_MEMORY_PIECE bytes and lies inside its buffer; a failing call fails
 * the save (nothing committed) or the load, naming the tensor. The MPI side
 * (replicated rows, ZeRO-1 shares, streamed chunks) is
 * tests/integration/test_memops_mpi.sh. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <dirent.h>

#include "ckpt.h"
#include "ckpt/files.h"
#include "ckpt/torch.h"
#include "helpers/testutil.h"
#include "../emudev.h"

/* ---- a training state: four parameters, an external AdamW with masters --- */

/* "big" is larger than one piece (CKPT_MEMORY_PIECE) so its copies come in
 * several calls; "ln" stays in host memory in every run. */
enum { NP = 4, BIG = 2200000 };
static const char *const PNAME[NP] = {"wte", "big", "ln", "h"};
static const ckpt_dtype PDT[NP] = {CKPT_BF16, CKPT_F32, CKPT_F32, CKPT_BF16};
static const int64_t PN[NP] = {300 * 8, BIG, 8, 4 * 8};
static const int PNDIM[NP] = {2, 1, 1, 2};
static const int64_t PSHAPE[NP][2] = {{300, 8}, {BIG, 0}, {8, 0}, {4, 8}};
static const char *const FIELD[3] = {"exp_avg", "exp_avg_sq", "master"};

typedef struct run {
    bool dev;
    void *val[NP];   /* host memory, or a device handle */
    void *st[NP][3]; /* exp_avg, exp_avg_sq, master (BF16 ones) */
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_accelerator *acc;
} run;

static bool on_dev(const run *r, int i) { return r->dev && i != 2; }
static size_t esize(int i) { return PDT[i] == CKPT_F32 ? 4 : 2; }
static int nfields(int i) { return PDT[i] == CKPT_BF16 ? 3 : 2; }

static uint16_t bf16_of(float f) {
    uint16_t h;
    ckpt_dtype_convert(CKPT_F32, &f, CKPT_BF16, &h, 1);
    return h;
}

/* The values of step t, as an external trainer would leave them: parameter
 * i's element k, field f's element k. Written wherever the run keeps them. */
static void fill(run *r, int t) {
    for (int i = 0; i < NP; i++) {
        size_t n = (size_t)PN[i];
        uint8_t *v = malloc(n * esize(i));
        float *s = malloc(n * 4);
        for (size_t k = 0; k < n; k++) {
            float x = (float)sin(0.001 * (double)k + i + 0.1 * t);
            if (esize(i) == 4) memcpy(v + 4 * k, &x, 4);
            else {
                uint16_t h = bf16_of(x);
                memcpy(v + 2 * k, &h, 2);
            }
        }
        if (on_dev(r, i)) emudev_poke(r->val[i], 0, v, n * esize(i));
        else memcpy(r->val[i], v, n * esize(i));
        for (int f = 0; f < nfields(i); f++) {
            for (size_t k = 0; k < n; k++) s[k] = (float)cos(0.002 * (double)k + 3 * f + i + t);
            if (on_dev(r, i)) emudev_poke(r->st[i][f], 0, s, n * 4);
            else memcpy(r->st[i][f], s, n * 4);
        }
        free(v);
        free(s);
    }
}

/* Zeros everywhere (what a load must overwrite). */
static void scramble(run *r) {
    for (int i = 0; i < NP; i++) {
        size_t n = (size_t)PN[i];
        void *z = calloc(n, 4);
        if (on_dev(r, i)) emudev_poke(r->val[i], 0, z, n * esize(i));
        else memset(r->val[i], 0, n * esize(i));
        for (int f = 0; f < nfields(i); f++) {
            if (on_dev(r, i)) emudev_poke(r->st[i][f], 0, z, n * 4);
            else memset(r->st[i][f], 0, n * 4);
        }
        free(z);
    }
}

/* Fails unless r holds the values of step t. */
static void expect(run *r, int t) {
    run h = {0};
    for (int i = 0; i < NP; i++) {
        h.val[i] = malloc((size_t)PN[i] * esize(i));
        for (int f = 0; f < nfields(i); f++) h.st[i][f] = malloc((size_t)PN[i] * 4);
    }
    fill(&h, t);
    for (int i = 0; i < NP; i++) {
        size_t n = (size_t)PN[i];
        uint8_t *got = malloc(n * 4);
        if (on_dev(r, i)) emudev_peek(r->val[i], 0, got, n * esize(i));
        else memcpy(got, r->val[i], n * esize(i));
        if (memcmp(got, h.val[i], n * esize(i))) fail_msg("%s differs", PNAME[i]);
        for (int f = 0; f < nfields(i); f++) {
            if (on_dev(r, i)) emudev_peek(r->st[i][f], 0, got, n * 4);
            else memcpy(got, r->st[i][f], n * 4);
            if (memcmp(got, h.st[i][f], n * 4)) fail_msg("%s.%s differs", PNAME[i], FIELD[f]);
        }
        free(got);
        free(h.val[i]);
        for (int f = 0; f < nfields(i); f++) free(h.st[i][f]);
    }
}

/* Fails unless every device buffer of r holds zeros (as scramble left it). */
static void expect_zero_on_dev(run *r) {
    for (int i = 0; i < NP; i++) {
        if (!on_dev(r, i)) continue;
        size_t n = (size_t)PN[i] * 4;
        uint8_t *got = malloc(n), *zero = calloc(n, 1);
        emudev_peek(r->val[i], 0, got, (size_t)PN[i] * esize(i));
        if (memcmp(got, zero, (size_t)PN[i] * esize(i))) fail_msg("%s was written", PNAME[i]);
        for (int f = 0; f < nfields(i); f++) {
            emudev_peek(r->st[i][f], 0, got, n);
            if (memcmp(got, zero, n)) fail_msg("%s.%s was written", PNAME[i], FIELD[f]);
        }
        free(got);
        free(zero);
    }
}

static void run_free(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_optimizer_free(r->o);
    ckpt_model_free(r->m);
    for (int i = 0; i < NP; i++) {
        if (on_dev(r, i)) continue;
        free(r->val[i]);
        for (int f = 0; f < nfields(i); f++) free(r->st[i][f]);
    }
    if (r->dev) emudev_free_all();
    memset(r, 0, sizeof *r);
}

/* A run's model, optimizer and accelerator over project (NULL: none);
 * max_shard > 0 saves the model as Hugging Face shards. */
static void run_make(run *r, bool dev, const char *project, uint64_t max_shard) {
    memset(r, 0, sizeof *r);
    r->dev = dev;
    if (dev) emudev_init();
    assert_int_equal(ckpt_model_new(&r->m), CKPT_OK);
    for (int i = 0; i < NP; i++) {
        size_t n = (size_t)PN[i];
        r->val[i] = on_dev(r, i) ? emudev_alloc(n * esize(i), NULL) : calloc(n, esize(i));
        for (int f = 0; f < nfields(i); f++)
            r->st[i][f] = on_dev(r, i) ? emudev_alloc(n * 4, NULL) : calloc(n, 4);
        int rc = on_dev(r, i) ? ckpt_model_add_param_mem(r->m, PNAME[i], PDT[i], PNDIM[i],
                                                         PSHAPE[i], &emudev_ops, r->val[i])
                              : ckpt_model_add_param(r->m, PNAME[i], PDT[i], PNDIM[i], PSHAPE[i],
                                                     r->val[i], NULL);
        assert_int_equal(rc, CKPT_OK);
    }
    ckpt_optim_options opt = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    opt.master_weights = true;
    assert_int_equal(ckpt_optimizer_external_new(&r->o, CKPT_OPTIM_ADAMW, r->m, &opt), CKPT_OK);
    for (int i = 0; i < NP; i++)
        for (int f = 0; f < nfields(i); f++) {
            int rc = on_dev(r, i) ? ckpt_optimizer_set_state_mem(r->o, PNAME[i], FIELD[f],
                                                                 &emudev_ops, r->st[i][f])
                                  : ckpt_optimizer_set_state(r->o, PNAME[i], FIELD[f], r->st[i][f]);
            if (rc) fail_msg("attach %s.%s: %s", PNAME[i], FIELD[f], ckpt_errmsg());
        }
    if (!project) return;
    ckpt_project_config cfg = {0};
    cfg.project_dir = project;
    cfg.automatic_checkpoint_naming = true;
    cfg.max_shard_size = max_shard;
    cfg.link_copies = 1; /* an unchanged file is linked at the next save */
    assert_int_equal(ckpt_accelerator_new(&r->acc, &cfg), CKPT_OK);
    assert_int_equal(ckpt_prepare_model(r->acc, r->m), CKPT_OK);
    if (ckpt_prepare_optimizer(r->acc, r->o)) fail_msg("prepare: %s", ckpt_errmsg());
}

static char *proj(const char *name) { return tu_pathf("%s/%s", tu_dir(), name); }

static char *ck(const char *project, int n) {
    return tu_pathf("%s/checkpoints/checkpoint_%d", project, n);
}

/* Every state file of checkpoint a is in b with the same bytes. */
static void same_files(const char *a, const char *b, const char *const *names, int n) {
    for (int i = 0; i < n; i++) {
        char *x = tu_pathf("%s/%s", a, names[i]), *y = tu_pathf("%s/%s", b, names[i]);
        tu_assert_same_file(x, y, names[i]);
        free(x);
        free(y);
    }
}

/* Every file of folder a is in b with the same bytes, and no more. */
static void same_dirs(const char *a, const char *b) {
    int na = 0, nb = 0;
    DIR *d = opendir(a);
    assert_non_null(d);
    for (struct dirent *e; (e = readdir(d));) {
        if (e->d_name[0] == '.') continue;
        same_files(a, b, (const char *const[]){e->d_name}, 1);
        na++;
    }
    closedir(d);
    assert_non_null(d = opendir(b));
    for (struct dirent *e; (e = readdir(d));) nb += e->d_name[0] != '.';
    closedir(d);
    assert_int_equal(na, nb);
    assert_true(na >= 2);
}

static const char *const FILES[] = {"model.safetensors", "optimizer.safetensors"};

static void save_host(const char *project, int t) {
    run h;
    run_make(&h, false, project, 0);
    fill(&h, t);
    ckpt_optimizer_set_step(h.o, t);
    if (ckpt_save_state(h.acc, NULL)) fail_msg("host save: %s", ckpt_errmsg());
    run_free(&h);
}

/* The bytes of a run's device state (what one copy of it moves). */
static uint64_t dev_bytes(const run *r) {
    uint64_t n = 0;
    for (int i = 0; i < NP; i++)
        if (on_dev(r, i)) n += (uint64_t)PN[i] * (esize(i) + 4 * (uint64_t)nfields(i));
    return n;
}

static void no_trouble(void) {
    assert_int_equal(emudev_g.errors, 0);
    assert_int_equal(emudev_g.foreign_thread, 0);
    assert_true(emudev_g.max_piece <= CKPT_MEMORY_PIECE);
}

/* ---- tests ----------------------------------------------------------------- */

static void test_sync_save_equals_host_and_loads_back(void **state) {
    (void)state;
    char *ph = proj("host"), *pd = proj("dev");
    save_host(ph, 3);
    run d;
    run_make(&d, true, pd, 0);
    fill(&d, 3);
    ckpt_optimizer_set_step(d.o, 3);
    if (ckpt_save_state(d.acc, NULL)) fail_msg("save: %s", ckpt_errmsg());
    /* every byte of the device state went through to_host once, in pieces */
    assert_true(emudev_g.to_host_bytes == dev_bytes(&d));
    assert_true(emudev_g.max_piece == CKPT_MEMORY_PIECE);
    assert_int_equal(emudev_g.from_host_calls, 0);
    char *a = ck(ph, 0), *b = ck(pd, 0);
    same_files(a, b, FILES, 2);
    assert_int_equal(ckpt_checkpoint_verify(b, true, NULL), CKPT_OK);
    /* loaded back (two passes: verified, then from_host) */
    scramble(&d);
    emudev_g.to_host_calls = 0;
    if (ckpt_load_state(d.acc, NULL)) fail_msg("load: %s", ckpt_errmsg());
    expect(&d, 3);
    assert_true(emudev_g.from_host_bytes == dev_bytes(&d));
    assert_int_equal(ckpt_optimizer_get_step(d.o), 3);
    /* one pass: read straight through the 1 MiB verified piece */
    scramble(&d);
    ckpt_load_options lo = {0};
    lo.one_pass = true;
    if (ckpt_load_state_ex(d.acc, NULL, &lo, NULL)) fail_msg("one-pass: %s", ckpt_errmsg());
    expect(&d, 3);
    assert_int_equal(emudev_g.to_host_calls, 0); /* a load never reads the device */
    no_trouble();
    run_free(&d);
    free(a);
    free(b);
    free(ph);
    free(pd);
}

static void test_async_save_stages_in_the_callers_thread(void **state) {
    (void)state;
    char *ph = proj("ahost"), *pd = proj("adev");
    save_host(ph, 5);
    run d;
    run_make(&d, true, pd, 0);
    assert_int_equal(ckpt_accelerator_prepare_async(d.acc), CKPT_OK);
    fill(&d, 5);
    ckpt_optimizer_set_step(d.o, 5);
    uint64_t before = emudev_g.to_host_bytes;
    if (ckpt_save_state_async(d.acc, NULL)) fail_msg("async: %s", ckpt_errmsg());
    /* staged before the call returned: one copy of the device state */
    uint64_t staged = emudev_g.to_host_bytes - before;
    assert_true(staged == dev_bytes(&d));
    fill(&d, 6); /* the trainer goes on at once */
    if (ckpt_save_wait(d.acc)) fail_msg("wait: %s", ckpt_errmsg());
    assert_int_equal(emudev_g.to_host_bytes - before, staged); /* the background read nothing */
    char *a = ck(ph, 0), *b = ck(pd, 0);
    same_files(a, b, FILES, 2);
    no_trouble(); /* no call from the background thread */
    /* a limit below the state: files that do not fit are written in the call */
    assert_int_equal(ckpt_accelerator_set_async_staging_limit(d.acc, 1 << 20), CKPT_OK);
    if (ckpt_save_state_async(d.acc, NULL) || ckpt_save_wait(d.acc))
        fail_msg("async limited: %s", ckpt_errmsg());
    scramble(&d);
    if (ckpt_load_state(d.acc, NULL)) fail_msg("load: %s", ckpt_errmsg());
    expect(&d, 6);
    no_trouble();
    run_free(&d);
    free(a);
    free(b);
    free(ph);
    free(pd);
}

static void test_shards_links_and_export(void **state) {
    (void)state;
    char *ph = proj("shost"), *pd = proj("sdev");
    run h, d;
    run_make(&h, false, ph, 1 << 20);
    fill(&h, 2);
    assert_int_equal(ckpt_save_state(h.acc, NULL), CKPT_OK);
    run_free(&h);
    run_make(&d, true, pd, 1 << 20); /* model as Hugging Face shards */
    fill(&d, 2);
    if (ckpt_save_state(d.acc, NULL)) fail_msg("save: %s", ckpt_errmsg());
    char *a = ck(ph, 0), *b = ck(pd, 0);
    ckpt_checkpoint_file *fa = NULL, *fb = NULL;
    int64_t na = 0, nb = 0;
    assert_int_equal(ckpt_checkpoint_files(a, &fa, &na), CKPT_OK);
    assert_int_equal(ckpt_checkpoint_files(b, &fb, &nb), CKPT_OK);
    assert_int_equal(na, nb);
    assert_true(na > 4); /* shards, their index, the optimizer, the generator */
    for (int64_t i = 0; i < na; i++) same_files(a, b, (const char *const[]){fa[i].name}, 1);
    free(fa);
    free(fb);
    /* unchanged: the next save hashes through to_host and links every file */
    if (ckpt_save_state(d.acc, NULL)) fail_msg("second save: %s", ckpt_errmsg());
    uint64_t written = 0, linked = 0;
    ckpt_accelerator_last_save_bytes(d.acc, &written, &linked);
    assert_true(linked > 4 * (uint64_t)BIG * 3);
    scramble(&d);
    if (ckpt_load_state(d.acc, NULL)) fail_msg("load shards: %s", ckpt_errmsg());
    expect(&d, 2);
    /* exported as the host run's checkpoint is */
    char *ea = tu_pathf("%s/exp_host", tu_dir()), *eb = tu_pathf("%s/exp_dev", tu_dir());
    assert_int_equal(ckpt_export_torch(a, ea, NULL), CKPT_OK);
    assert_int_equal(ckpt_export_torch(b, eb, NULL), CKPT_OK);
    same_dirs(ea, eb);
    no_trouble();
    run_free(&d);
    free(ea);
    free(eb);
    free(a);
    free(b);
    free(ph);
    free(pd);
}

static void test_failing_ops_fail_cleanly(void **state) {
    (void)state;
    char *pd = proj("fail");
    run d;
    run_make(&d, true, pd, 0);
    fill(&d, 1);
    assert_int_equal(ckpt_save_state(d.acc, NULL), CKPT_OK);
    fill(&d, 2);
    emudev_g.fail_after = 3;
    tu_expect_error(ckpt_save_state(d.acc, NULL), CKPT_EIO, "injected copy failure");
    tu_assert_errmsg_has("memory ops: to_host");
    char *c1 = ck(pd, 1);
    assert_false(tu_exists(c1)); /* nothing committed */
    emudev_g.fail_after = 3;
    tu_expect_error(ckpt_save_state_async(d.acc, NULL), CKPT_EIO, "to_host");
    assert_false(tu_exists(c1));
    /* a load whose from_host fails names the tensor; a retry loads */
    emudev_g.fail_after = 2;
    tu_expect_error(ckpt_load_state(d.acc, NULL), CKPT_EIO, "from_host");
    tu_assert_errmsg_has("tensor '");
    assert_int_equal(ckpt_load_state(d.acc, NULL), CKPT_OK);
    expect(&d, 1);
    /* out-of-range and oversize calls never happened */
    emudev_g.errors = 0;
    run_free(&d);
    free(c1);
    free(pd);
}

/* A load touches the device only after the checkpoint verified: a damaged
 * newest checkpoint is refused without one from_host call, the load falls
 * back to the older one and puts it once; a damaged only checkpoint leaves
 * the device as it was. */
static void test_load_puts_only_verified_bytes(void **state) {
    (void)state;
    char *pd = proj("verified");
    run d;
    run_make(&d, true, pd, 0);
    fill(&d, 1);
    assert_int_equal(ckpt_save_state(d.acc, NULL), CKPT_OK);
    fill(&d, 2);
    assert_int_equal(ckpt_save_state(d.acc, NULL), CKPT_OK);
    char *f1 = tu_pathf("%s/checkpoints/checkpoint_1/optimizer.safetensors", pd);
    char *f0 = tu_pathf("%s/checkpoints/checkpoint_0/optimizer.safetensors", pd);
    tu_flip_byte(f1, tu_file_size(f1) / 2); /* a byte of state on the device */
    scramble(&d);
    emudev_g.from_host_calls = emudev_g.from_host_bytes = 0;
    assert_int_equal(ckpt_load_state(d.acc, NULL), CKPT_OK);
    expect(&d, 1);
    assert_true(emudev_g.from_host_bytes == dev_bytes(&d)); /* checkpoint_0, once */
    /* nothing verifies: not a byte reaches the device */
    tu_flip_byte(f0, tu_file_size(f0) / 2);
    scramble(&d);
    emudev_g.from_host_calls = emudev_g.from_host_bytes = 0;
    assert_int_not_equal(ckpt_load_state(d.acc, NULL), CKPT_OK);
    assert_int_equal(emudev_g.from_host_calls, 0);
    expect_zero_on_dev(&d);
    no_trouble();
    run_free(&d);
    free(f0);
    free(f1);
    free(pd);
}

static void test_own_optimizer_refuses_trainable_mem_parameters(void **state) {
    (void)state;
    emudev_init();
    float host[4] = {1, 2, 3, 4}, grad[4] = {0.5f, 0.5f, 0.5f, 0.5f};
    void *dv = emudev_alloc(16, host);
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(ckpt_model_add_param(m, "a", CKPT_F32, 1, (int64_t[]){4}, host, grad),
                     CKPT_OK);
    assert_int_equal(ckpt_model_add_param_mem(m, "d", CKPT_F32, 1, (int64_t[]){4}, &emudev_ops, dv),
                     CKPT_OK);
    ckpt_param_info pi;
    assert_int_equal(ckpt_model_param(m, 1, &pi), CKPT_OK);
    assert_ptr_equal(pi.mem_ops, &emudev_ops);
    assert_ptr_equal(pi.mem_handle, dv);
    assert_null(pi.data);
    assert_null(pi.grad);
    tu_expect_error(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0), CKPT_EUNSUPPORTED,
                    "parameter 'd' lives behind memory ops");
    tu_assert_errmsg_has("ckpt_optimizer_external_new");
    /* frozen, it is saved and loaded, and the step leaves it alone */
    assert_int_equal(ckpt_model_set_frozen(m, "d", true), 1);
    assert_int_equal(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0), CKPT_OK);
    assert_int_equal(ckpt_optimizer_step(o), CKPT_OK);
    ckpt_optimizer_zero_grad(o);
    tu_expect_error(ckpt_optimizer_set_state_mem(o, "a", "exp_avg", &emudev_ops, dv), CKPT_EINVAL,
                    "external");
    /* unfrozen later: refused at the next step */
    assert_int_equal(ckpt_model_set_frozen(m, "d", false), 1);
    tu_expect_error(ckpt_optimizer_step(o), CKPT_EUNSUPPORTED, "memory ops");
    ckpt_optimizer_free(o);
    /* bad ops */
    tu_expect_error(ckpt_model_add_param_mem(m, "x", CKPT_F32, 1, (int64_t[]){4}, NULL, dv),
                    CKPT_EINVAL, "parameter 'x'");
    ckpt_memory_ops half = {emudev_to_host, NULL};
    tu_expect_error(ckpt_model_add_param_mem(m, "x", CKPT_F32, 1, (int64_t[]){4}, &half, dv),
                    CKPT_EINVAL, "from_host");
    /* an external optimizer: state behind ops, a block skips the parameter */
    float blk_state[4] = {0};
    assert_int_equal(ckpt_model_set_frozen(m, "d", false), 1);
    ckpt_optim_options opt = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    opt.momentum = 0.9;
    assert_int_equal(ckpt_optimizer_external_new(&o, CKPT_OPTIM_SGD, m, &opt), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_state_block(o, "momentum_buffer", blk_state, host),
                     CKPT_OK);
    void *dm = emudev_alloc(16, NULL);
    tu_expect_error(ckpt_optimizer_ops()->state_dict(o, NULL), CKPT_EINVAL,
                    "parameter 'd' has no 'momentum_buffer'");
    tu_expect_error(ckpt_optimizer_set_state_mem(o, "d", "exp_avg", &emudev_ops, dm), CKPT_EINVAL,
                    "not a state field");
    assert_int_equal(ckpt_optimizer_set_state_mem(o, "d", "momentum_buffer", &emudev_ops, dm),
                     CKPT_OK);
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_optimizer_ops()->state_dict(o, w), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    emudev_free_all();
}

static void test_standalone_files_and_adapted_loads(void **state) {
    (void)state;
    emudev_init();
    float a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {7, 8, 9};
    void *da = emudev_alloc(sizeof a, a), *db = emudev_alloc(sizeof b, b);
    char *path = tu_pathf("%s/mem.safetensors", tu_dir());
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ckpt_write_tensor_mem(w, "a", CKPT_F32, 2, (int64_t[]){2, 3}, &emudev_ops, da),
                     CKPT_OK);
    tu_expect_error(ckpt_write_tensor_mem(w, "c", CKPT_F32, 1, (int64_t[]){3}, NULL, db),
                    CKPT_EINVAL, "tensor 'c'");
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
    /* a file reader (pread through one piece) into the device */
    emudev_poke(da, 0, (float[6]){0}, sizeof a);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    tu_expect_error(ckpt_read_tensor_mem(r, "a", CKPT_F32, 2, (int64_t[]){2, 3}, NULL, da),
                    CKPT_EINVAL, "tensor 'a': memory ops are NULL");
    tu_expect_error(ckpt_read_tensor_mem(r, "a", CKPT_F32, 1, (int64_t[]){6}, &emudev_ops, da),
                    CKPT_EMISMATCH, "shape");
    assert_int_equal(ckpt_read_tensor_mem(r, "a", CKPT_F32, 2, (int64_t[]){2, 3}, &emudev_ops, da),
                     CKPT_OK);
    ckpt_reader_free(r);
    float got[6];
    emudev_peek(da, 0, got, sizeof got);
    assert_memory_equal(got, a, sizeof a);
    /* a model behind ops, loaded non-strictly from a file without "b" (its
     * value kept: copied out and back) and with "a" converted from F32 */
    ckpt_model *m = NULL;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(
        ckpt_model_add_param_mem(m, "a", CKPT_BF16, 2, (int64_t[]){2, 3}, &emudev_ops, db),
        CKPT_OK);
    void *dc = emudev_alloc(sizeof b, b);
    assert_int_equal(ckpt_model_add_param_mem(m, "b", CKPT_F32, 1, (int64_t[]){3}, &emudev_ops, dc),
                     CKPT_OK);
    ckpt_load_options lo = {0};
    lo.non_strict = true;
    lo.convert_dtypes = true;
    if (ckpt_model_load_weights(m, path, &lo, NULL)) fail_msg("load_weights: %s", ckpt_errmsg());
    uint16_t h[6], want[6];
    ckpt_dtype_convert(CKPT_F32, a, CKPT_BF16, want, 6);
    emudev_peek(db, 0, h, sizeof h);
    assert_memory_equal(h, want, sizeof h);
    emudev_peek(dc, 0, got, sizeof b);
    assert_memory_equal(got, b, sizeof b);
    no_trouble();
    ckpt_model_free(m);
    emudev_free_all();
    free(path);
}

/* Tied names behind ops: by the call (the 17th name, which moves the
 * parameter array while the tie reads its target) and by registering the
 * same ops and handle twice; saved once, the alias carrying the target's
 * ops. */
static void test_tied_parameters_behind_ops(void **state) {
    (void)state;
    emudev_init();
    float v[4] = {1, 2, 3, 4};
    void *dv[16];
    ckpt_model *m = NULL;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    for (int i = 0; i < 16; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        dv[i] = emudev_alloc(sizeof v, v);
        assert_int_equal(
            ckpt_model_add_param_mem(m, name, CKPT_F32, 1, (int64_t[]){4}, &emudev_ops, dv[i]),
            CKPT_OK);
    }
    assert_int_equal(ckpt_model_tie(m, "lm_head", "p0"), CKPT_OK);
    assert_int_equal(
        ckpt_model_add_param_mem(m, "again", CKPT_F32, 1, (int64_t[]){4}, &emudev_ops, dv[3]),
        CKPT_OK);
    ckpt_param_info pi;
    assert_int_equal(ckpt_model_param(m, 16, &pi), CKPT_OK);
    assert_string_equal(pi.tied_to, "p0");
    assert_ptr_equal(pi.mem_handle, dv[0]);
    assert_int_equal(ckpt_model_param(m, 17, &pi), CKPT_OK);
    assert_string_equal(pi.tied_to, "p3");
    assert_int_equal(ckpt_model_num_elements(m), 16 * 4);
    char *path = tu_pathf("%s/tied.safetensors", tu_dir());
    tu_save_state(ckpt_model_ops(), m, path);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    ckpt_entry_info e;
    assert_int_equal(ckpt_reader_find(r, "lm_head", &e), CKPT_OK);
    assert_int_equal(e.kind, CKPT_ENTRY_ALIAS);
    assert_int_equal(ckpt_reader_count(r), 18);
    ckpt_reader_free(r);
    emudev_poke(dv[0], 0, (float[4]){0}, sizeof v);
    assert_int_equal(tu_load_state(ckpt_model_ops(), m, path), CKPT_OK);
    float got[4];
    emudev_peek(dv[0], 0, got, sizeof got);
    assert_memory_equal(got, v, sizeof v);
    /* host parameters: the same move of the array under the tie */
    ckpt_model *h = NULL;
    float hv[16][4];
    assert_int_equal(ckpt_model_new(&h), CKPT_OK);
    for (int i = 0; i < 16; i++) {
        char name[16];
        snprintf(name, sizeof name, "p%d", i);
        assert_int_equal(ckpt_model_add_param(h, name, CKPT_F32, 1, (int64_t[]){4}, hv[i], NULL),
                         CKPT_OK);
    }
    assert_int_equal(ckpt_model_tie(h, "lm_head", "p0"), CKPT_OK);
    assert_int_equal(ckpt_model_param(h, 16, &pi), CKPT_OK);
    assert_int_equal(pi.shape[0], 4);
    no_trouble();
    ckpt_model_free(h);
    ckpt_model_free(m);
    emudev_free_all();
    free(path);
}

/* A checkpoint saved while a parameter behind ops was frozen has no state
 * for it: loaded into it trainable, its device state starts fresh (moments
 * zero, the master the loaded parameter widened), written through from_host
 * in pieces. */
static void test_fresh_state_behind_ops(void **state) {
    (void)state;
    emudev_init();
    enum { NB = 3000000 }; /* the master's floats: more than a piece */
    uint16_t *h = malloc(2 * NB);
    float *junk = malloc(4 * NB), *got = malloc(4 * NB), *want = malloc(4 * NB);
    for (int i = 0; i < NB; i++) {
        h[i] = bf16_of((float)sin(0.001 * i));
        junk[i] = 7.0f;
    }
    void *dp = emudev_alloc(2 * (size_t)NB, h), *ds[3];
    for (int f = 0; f < 3; f++) ds[f] = emudev_alloc(4 * (size_t)NB, junk);
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    assert_int_equal(ckpt_model_new(&m), CKPT_OK);
    assert_int_equal(
        ckpt_model_add_param_mem(m, "d", CKPT_BF16, 1, (int64_t[]){NB}, &emudev_ops, dp), CKPT_OK);
    ckpt_optim_options opt = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    opt.master_weights = true;
    assert_int_equal(ckpt_optimizer_external_new(&o, CKPT_OPTIM_ADAMW, m, &opt), CKPT_OK);
    assert_int_equal(ckpt_model_set_frozen(m, "d", true), 1);
    char *pm = tu_pathf("%s/fresh_model.safetensors", tu_dir());
    char *po = tu_pathf("%s/fresh_optimizer.safetensors", tu_dir());
    tu_save_state(ckpt_model_ops(), m, pm);
    tu_save_state(ckpt_optimizer_ops(), o, po);
    assert_int_equal(ckpt_model_set_frozen(m, "d", false), 1);
    for (int f = 0; f < 3; f++)
        assert_int_equal(ckpt_optimizer_set_state_mem(o, "d", FIELD[f], &emudev_ops, ds[f]),
                         CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_model_ops(), m, pm), CKPT_OK);
    assert_int_equal(tu_load_state(ckpt_optimizer_ops(), o, po), CKPT_OK);
    for (int f = 0; f < 2; f++) {
        emudev_peek(ds[f], 0, got, 4 * (size_t)NB);
        for (int i = 0; i < NB; i++)
            if (got[i] != 0.0f) fail_msg("%s[%d] = %g", FIELD[f], i, (double)got[i]);
    }
    ckpt_dtype_convert(CKPT_BF16, h, CKPT_F32, want, NB);
    emudev_peek(ds[2], 0, got, 4 * (size_t)NB);
    assert_memory_equal(got, want, 4 * (size_t)NB);
    assert_int_equal(ckpt_optimizer_get_step(o), 0);
    no_trouble();
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    emudev_free_all();
    free(h);
    free(junk);
    free(got);
    free(want);
    free(pm);
    free(po);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sync_save_equals_host_and_loads_back),
        cmocka_unit_test(test_async_save_stages_in_the_callers_thread),
        cmocka_unit_test(test_shards_links_and_export),
        cmocka_unit_test(test_failing_ops_fail_cleanly),
        cmocka_unit_test(test_load_puts_only_verified_bytes),
        cmocka_unit_test(test_own_optimizer_refuses_trainable_mem_parameters),
        cmocka_unit_test(test_standalone_files_and_adapted_loads),
        cmocka_unit_test(test_tied_parameters_behind_ops),
        cmocka_unit_test(test_fresh_state_behind_ops),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
