/* test_zero.c — the sharded optimizer (ZeRO-1) on ranks that are threads
 * (helpers/thread_comm.c): SGD with momentum, Adam and AdamW sharded over
 * 2..5 ranks produce the unsharded optimizer's parameters bit for bit; a
 * checkpoint saved by 4 ranks loads on 2, 1 and 3 with the same moments, and
 * training continues exactly. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>

#include <cmocka.h>

#include "ckpt.h"
#include "helpers/testutil.h"
#include "helpers/thread_comm.h"

#define MAXP 5
#define NPARAM 6

/* Parameters of every shape the split must handle: matrices, a vector, a
 * scalar, a 3-d tensor, a single row and an empty tensor. */
static const int nd[NPARAM] = {2, 1, 0, 3, 2, 2};
static const int64_t shapes[NPARAM][3] = {{5, 3}, {7}, {0}, {2, 3, 4}, {1, 9}, {0, 4}};
static const char *names[NPARAM] = {"a", "b", "c", "d", "e", "z"};

static int64_t numel_of(int i) {
    int64_t n = 1;
    for (int d = 0; d < nd[i]; d++) n *= shapes[i][d];
    return n;
}

typedef struct net {
    ckpt_model *m;
    ckpt_optimizer *o;
    float *w[NPARAM], *g[NPARAM];
} net;

static int net_new(net *n, int kind) {
    memset(n, 0, sizeof *n);
    int rc = ckpt_model_new(&n->m);
    for (int i = 0; rc == 0 && i < NPARAM; i++) {
        int64_t k = numel_of(i);
        n->w[i] = calloc((size_t)(k ? k : 1), sizeof(float));
        n->g[i] = calloc((size_t)(k ? k : 1), sizeof(float));
        for (int64_t e = 0; e < k; e++) n->w[i][e] = (float)sin((double)(i * 31 + e) * 0.7) * 0.5f;
        rc = ckpt_model_add_param(n->m, names[i], CKPT_F32, nd[i], shapes[i], n->w[i], n->g[i]);
    }
    if (rc) return rc;
    if (kind == CKPT_OPTIM_SGD) {
        ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_SGD);
        op.lr = 0.05;
        op.momentum = 0.9;
        op.weight_decay = 0.01;
        op.nesterov = true;
        return ckpt_optimizer_new(&n->o, CKPT_OPTIM_SGD, n->m, &op);
    }
    ckpt_optim_options op = ckpt_optim_defaults((ckpt_optim_kind)kind);
    op.lr = 0.01;
    op.weight_decay = 0.02;
    op.amsgrad = kind == CKPT_OPTIM_ADAMW;
    return ckpt_optimizer_new(&n->o, (ckpt_optim_kind)kind, n->m, &op);
}

static void net_free(net *n) {
    ckpt_optimizer_free(n->o);
    ckpt_model_free(n->m);
    for (int i = 0; i < NPARAM; i++) {
        free(n->w[i]);
        free(n->g[i]);
    }
}

/* The same gradients on every rank (data parallel after the allreduce). */
static int train(net *n, int from, int to) {
    for (int s = from; s < to; s++) {
        for (int i = 0; i < NPARAM; i++)
            for (int64_t e = 0; e < numel_of(i); e++)
                n->g[i][e] = (float)cos((double)s * 1.3 + (double)e * 0.37 + i) + n->w[i][e] * 0.1f;
        int rc = ckpt_optimizer_step(n->o);
        if (rc) return rc;
    }
    return CKPT_OK;
}

static void copy_params(const net *n, float *out) {
    for (int i = 0; i < NPARAM; i++) {
        memcpy(out, n->w[i], (size_t)numel_of(i) * sizeof(float));
        out += numel_of(i);
    }
}

enum { TOTAL = 15 + 7 + 1 + 24 + 9 + 0 };

typedef struct job {
    int kind, steps;
    const char *dir;    /* checkpoint folder for save/load jobs */
    int load_steps;     /* steps after loading */
    int rc[MAXP];
    char msg[MAXP][1024];
    float w[MAXP][TOTAL];
} job;

static void job_fail(job *j, int r, int rc) {
    j->rc[r] = rc;
    snprintf(j->msg[r], sizeof j->msg[r], "%s", ckpt_errmsg());
}

static void run_sharded(const ckpt_comm *c, void *arg) {
    job *j = arg;
    net n;
    int rc = net_new(&n, j->kind);
    if (rc == 0) rc = ckpt_optimizer_set_shard(n.o, c);
    if (rc == 0) rc = train(&n, 0, j->steps);
    if (rc) job_fail(j, c->rank, rc);
    copy_params(&n, j->w[c->rank]);
    net_free(&n);
}

static void reference(int kind, int steps, float *out) {
    net n;
    assert_int_equal(net_new(&n, kind), CKPT_OK);
    assert_int_equal(train(&n, 0, steps), CKPT_OK);
    copy_params(&n, out);
    net_free(&n);
}

static void assert_all_ranks(const job *j, int p, const float *want) {
    for (int r = 0; r < p; r++) {
        if (j->rc[r]) fail_msg("rank %d of %d: %d: %s", r, p, j->rc[r], j->msg[r]);
        assert_memory_equal(j->w[r], want, sizeof(float) * TOTAL);
    }
}

static void test_sharded_steps_match_unsharded(void **state) {
    (void)state;
    const int kinds[3] = {CKPT_OPTIM_SGD, CKPT_OPTIM_ADAM, CKPT_OPTIM_ADAMW};
    for (int k = 0; k < 3; k++) {
        float want[TOTAL];
        reference(kinds[k], 6, want);
        for (int p = 1; p <= MAXP; p++) {
            job j;
            memset(&j, 0, sizeof j);
            j.kind = kinds[k];
            j.steps = 6;
            tc_run(p, run_sharded, &j);
            assert_all_ranks(&j, p, want);
        }
    }
}

/* ---- reshard through checkpoints ----------------------------------------- */

static int acc_for(ckpt_accelerator **acc, const ckpt_comm *c, net *n) {
    ckpt_project_config cfg = {.comm = c};
    int rc = ckpt_accelerator_new(acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(*acc, n->m);
    if (rc == 0) rc = ckpt_prepare_optimizer(*acc, n->o);
    return rc;
}

static void save_job(const ckpt_comm *c, void *arg) {
    job *j = arg;
    net n;
    ckpt_accelerator *acc = NULL;
    int rc = net_new(&n, j->kind);
    if (rc == 0) rc = ckpt_optimizer_set_shard(n.o, c);
    if (rc == 0) rc = train(&n, 0, j->steps);
    if (rc == 0) rc = acc_for(&acc, c, &n);
    if (rc == 0) rc = ckpt_save_state(acc, j->dir);
    if (rc) job_fail(j, c->rank, rc);
    ckpt_accelerator_free(acc);
    net_free(&n);
}

/* Loads j->dir on this many ranks (sharded), trains load_steps more. */
static void load_job(const ckpt_comm *c, void *arg) {
    job *j = arg;
    net n;
    ckpt_accelerator *acc = NULL;
    int rc = net_new(&n, j->kind);
    if (rc == 0) rc = ckpt_optimizer_set_shard(n.o, c);
    if (rc == 0) rc = acc_for(&acc, c, &n);
    if (rc == 0) rc = ckpt_load_state(acc, j->dir);
    if (rc == 0) rc = train(&n, j->steps, j->steps + j->load_steps);
    if (rc) job_fail(j, c->rank, rc);
    copy_params(&n, j->w[c->rank]);
    ckpt_accelerator_free(acc);
    net_free(&n);
}

/* The optimizer state dict of an unsharded optimizer, as file bytes. */
static char *unsharded_state(net *n, const char *path, size_t *len) {
    return tu_state_bytes(ckpt_optimizer_ops(), n->o, path, len);
}

static void test_reshard_4_to_2_1_3(void **state) {
    (void)state;
    const int kinds[2] = {CKPT_OPTIM_ADAMW, CKPT_OPTIM_SGD};
    for (int k = 0; k < 2; k++) {
        char *dir = tu_pathf("%s/ck%d", tu_dir(), k);
        job j;
        memset(&j, 0, sizeof j);
        j.kind = kinds[k];
        j.steps = 4;
        j.dir = dir;
        tc_run(4, save_job, &j);
        for (int r = 0; r < 4; r++)
            if (j.rc[r]) fail_msg("save rank %d: %s", r, j.msg[r]);
        char *shard = tu_pathf("%s/optimizer-00003-of-00004.safetensors", dir);
        assert_true(tu_exists(shard));
        free(shard);

        /* Unsharded (one process, no communicator): the moments are the
         * reference optimizer's, bit for bit. */
        net ref, one;
        assert_int_equal(net_new(&ref, kinds[k]), CKPT_OK);
        assert_int_equal(train(&ref, 0, 4), CKPT_OK);
        assert_int_equal(net_new(&one, kinds[k]), CKPT_OK);
        ckpt_accelerator *acc = NULL;
        assert_int_equal(acc_for(&acc, NULL, &one), CKPT_OK);
        if (ckpt_load_state(acc, dir) != CKPT_OK) fail_msg("load on 1: %s", ckpt_errmsg());
        char *pa = tu_pathf("%s/ref.safetensors", tu_dir()), *pb = tu_pathf("%s/one.safetensors", tu_dir());
        size_t la = 0, lb = 0;
        char *a = unsharded_state(&ref, pa, &la), *b = unsharded_state(&one, pb, &lb);
        tu_assert_bytes_equal(a, la, b, lb);
        free(a);
        free(b);
        free(pa);
        free(pb);
        ckpt_accelerator_free(acc);
        net_free(&one);

        /* Sharded on 2 and 3 ranks (and 1 rank sharded): training goes on
         * exactly as the unsharded reference does. */
        assert_int_equal(train(&ref, 4, 7), CKPT_OK);
        float want[TOTAL];
        copy_params(&ref, want);
        net_free(&ref);
        const int qs[3] = {2, 1, 3};
        for (int q = 0; q < 3; q++) {
            job l;
            memset(&l, 0, sizeof l);
            l.kind = kinds[k];
            l.steps = 4;
            l.load_steps = 3;
            l.dir = dir;
            tc_run(qs[q], load_job, &l);
            assert_all_ranks(&l, qs[q], want);
        }
        free(dir);
    }
}

/* The split: whole rows per rank, documented rule, every rank the same
 * keys; invalid arguments refused. */
static void test_set_shard_validates(void **state) {
    (void)state;
    net n;
    assert_int_equal(net_new(&n, CKPT_OPTIM_ADAM), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_shard(n.o, NULL), CKPT_EINVAL);
    ckpt_comm bad = *ckpt_comm_self();
    bad.rank = 1;
    assert_int_equal(ckpt_optimizer_set_shard(n.o, &bad), CKPT_EINVAL);
    assert_int_equal(train(&n, 0, 1), CKPT_OK);
    assert_int_equal(ckpt_optimizer_set_shard(n.o, ckpt_comm_self()), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "only before the first step"));
    net_free(&n);
}

/* ---- frozen, BF16 with masters, external: sharded as ckpt's own -------------- */

/* A BF16 matrix with a master, an F32 vector, an F32 scalar and an F32
 * matrix frozen before the split (left out of it: never updated, no state). */
enum { MH = 36, MF = 7, MZ = 12, MIXN = MH + MF + 1 + MZ };

typedef struct mix {
    uint16_t h[MH], gh[MH];
    float f[MF], gf[MF], s, gs, z[MZ], gz[MZ];
    /* external: whole parameters' state, NaN where a rank holds none */
    float m[MIXN], v[MIXN], master[MH];
    ckpt_model *mo;
    ckpt_optimizer *o;
} mix;

static uint16_t bf16_of(float x) {
    uint16_t h;
    ckpt_dtype_convert(CKPT_F32, &x, CKPT_BF16, &h, 1);
    return h;
}

static int mix_new(mix *x, bool external) {
    memset(x, 0, sizeof *x);
    for (int e = 0; e < MH; e++) x->h[e] = bf16_of((float)sin(e * 0.7) * 0.5f);
    for (int e = 0; e < MF; e++) x->f[e] = (float)cos(e * 0.3);
    x->s = 0.25f;
    for (int e = 0; e < MZ; e++) x->z[e] = (float)e;
    int rc = ckpt_model_new(&x->mo);
    if (rc == 0)
        rc = ckpt_model_add_param(x->mo, "h", CKPT_BF16, 2, (int64_t[]){9, 4}, x->h, x->gh);
    if (rc == 0) rc = ckpt_model_add_param(x->mo, "f", CKPT_F32, 1, (int64_t[]){MF}, x->f, x->gf);
    if (rc == 0) rc = ckpt_model_add_param(x->mo, "s", CKPT_F32, 0, NULL, &x->s, &x->gs);
    if (rc == 0) rc = ckpt_model_add_param(x->mo, "z", CKPT_F32, 2, (int64_t[]){6, 2}, x->z, x->gz);
    if (rc == 0 && ckpt_model_set_frozen(x->mo, "z", true) != 1) rc = CKPT_EINVAL;
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    op.lr = 0.01;
    op.master_weights = true;
    if (rc == 0 && !external) return ckpt_optimizer_new(&x->o, CKPT_OPTIM_ADAMW, x->mo, &op);
    if (rc == 0) rc = ckpt_optimizer_external_new(&x->o, CKPT_OPTIM_ADAMW, x->mo, &op);
    const char *pn[3] = {"h", "f", "s"};
    int at[3] = {0, MH, MH + MF};
    for (int i = 0; i < 3 && rc == 0; i++) {
        rc = ckpt_optimizer_set_state(x->o, pn[i], "exp_avg", x->m + at[i]);
        if (rc == 0) rc = ckpt_optimizer_set_state(x->o, pn[i], "exp_avg_sq", x->v + at[i]);
    }
    if (rc == 0) rc = ckpt_optimizer_set_state(x->o, "h", "master", x->master);
    return rc;
}

static void mix_free(mix *x) {
    ckpt_optimizer_free(x->o);
    ckpt_model_free(x->mo);
}

static int mix_train(mix *x, int from, int to) {
    for (int t = from; t < to; t++) {
        for (int e = 0; e < MH; e++) x->gh[e] = bf16_of((float)cos(t * 1.1 + e * 0.37));
        for (int e = 0; e < MF; e++) x->gf[e] = (float)sin(t + e * 0.5);
        x->gs = (float)t * 0.1f;
        for (int e = 0; e < MZ; e++) x->gz[e] = 1.0f;
        int rc = ckpt_optimizer_step(x->o);
        if (rc) return rc;
    }
    return CKPT_OK;
}

/* The caller's state of an external optimizer: values of step t. */
static void mix_fill(mix *x, int t) {
    for (int e = 0; e < MIXN; e++) {
        x->m[e] = e < MH + MF + 1 ? (float)(t * 100 + e) : NAN; /* z: frozen, none */
        x->v[e] = e < MH + MF + 1 ? (float)(t * 1000 + e) * 0.5f : NAN;
    }
    for (int e = 0; e < MH; e++) x->master[e] = (float)(t + e) * 0.125f;
}

typedef struct mix_job {
    int p, steps, load_steps, save_p;
    bool external, save;
    const char *dir;
    int rc[MAXP];
    char msg[MAXP][1024];
    unsigned char out[MAXP][sizeof(uint16_t) * MH + sizeof(float) * (MF + 1 + MZ)];
    float m[MAXP][MIXN], v[MAXP][MIXN], master[MAXP][MH];
} mix_job;

static void mix_out(const mix *x, unsigned char *out) {
    memcpy(out, x->h, sizeof x->h);
    memcpy(out + sizeof x->h, x->f, sizeof x->f);
    memcpy(out + sizeof x->h + sizeof x->f, &x->s, sizeof x->s);
    memcpy(out + sizeof x->h + sizeof x->f + sizeof x->s, x->z, sizeof x->z);
}

static void mix_run(const ckpt_comm *c, void *arg) {
    mix_job *j = arg;
    mix x;
    ckpt_accelerator *acc = NULL;
    int rc = mix_new(&x, j->external);
    if (j->external) {
        for (int e = 0; e < MIXN; e++) x.m[e] = x.v[e] = NAN;
        for (int e = 0; e < MH; e++) x.master[e] = NAN;
    }
    if (rc == 0 && c->size > 1) rc = ckpt_optimizer_set_shard(x.o, c);
    ckpt_project_config cfg = {.comm = c};
    if (rc == 0) rc = ckpt_accelerator_new(&acc, &cfg);
    if (rc == 0) rc = ckpt_prepare_model(acc, x.mo);
    if (rc == 0) rc = ckpt_prepare_optimizer(acc, x.o);
    if (rc == 0 && j->save) {
        if (j->external) {
            mix_fill(&x, j->steps);
            rc = ckpt_optimizer_set_step(x.o, j->steps);
        } else {
            rc = mix_train(&x, 0, j->steps);
        }
        if (rc == 0) rc = ckpt_save_state(acc, j->dir);
    } else if (rc == 0) {
        if (j->dir) rc = ckpt_load_state(acc, j->dir);
        if (rc == 0 && !j->external)
            rc = mix_train(&x, j->dir ? j->steps : 0, j->steps + j->load_steps);
        if (rc == 0 && j->external && ckpt_optimizer_get_step(x.o) != j->steps) rc = CKPT_EINVAL;
    }
    if (rc) {
        j->rc[c->rank] = rc;
        snprintf(j->msg[c->rank], sizeof j->msg[c->rank], "%s", ckpt_errmsg());
    }
    mix_out(&x, j->out[c->rank]);
    memcpy(j->m[c->rank], x.m, sizeof x.m);
    memcpy(j->v[c->rank], x.v, sizeof x.v);
    memcpy(j->master[c->rank], x.master, sizeof x.master);
    ckpt_accelerator_free(acc);
    mix_free(&x);
}

static void mix_check(const mix_job *j, int p) {
    for (int r = 0; r < p; r++)
        if (j->rc[r]) fail_msg("rank %d of %d: %d: %s", r, p, j->rc[r], j->msg[r]);
}

/* A frozen matrix, a BF16 matrix with its master: the sharded update is the
 * unsharded one, bit for bit; saved on 3 ranks, resumed on 2, 1 and 4. */
static void test_sharded_masters_and_frozen(void **state) {
    (void)state;
    mix_job ref;
    memset(&ref, 0, sizeof ref);
    ref.steps = 0;
    ref.load_steps = 8;
    tc_run(1, mix_run, &ref);
    mix_check(&ref, 1);
    for (int e = 0; e < MZ; e++) {
        float z;
        memcpy(&z, ref.out[0] + sizeof(uint16_t) * MH + sizeof(float) * (MF + 1 + e), 4);
        assert_true(z == (float)e); /* frozen: never updated */
    }
    for (int p = 2; p <= 4; p++) {
        mix_job j;
        memset(&j, 0, sizeof j);
        j.load_steps = 8;
        tc_run(p, mix_run, &j);
        mix_check(&j, p);
        for (int r = 0; r < p; r++) assert_memory_equal(j.out[r], ref.out[0], sizeof ref.out[0]);
    }
    char *dir = tu_pathf("%s/mix", tu_dir());
    mix_job s;
    memset(&s, 0, sizeof s);
    s.save = true;
    s.steps = 5;
    s.dir = dir;
    tc_run(3, mix_run, &s);
    mix_check(&s, 3);
    const int qs[3] = {2, 1, 4};
    for (int q = 0; q < 3; q++) {
        mix_job l;
        memset(&l, 0, sizeof l);
        l.steps = 5;
        l.load_steps = 3;
        l.dir = dir;
        tc_run(qs[q], mix_run, &l);
        mix_check(&l, qs[q]);
        for (int r = 0; r < qs[q]; r++)
            assert_memory_equal(l.out[r], ref.out[0], sizeof ref.out[0]);
    }
    free(dir);
}

/* An external optimizer's state saved on 3 ranks: each rank saves its share
 * of the caller's buffers; loaded whole on 1 and in shares on 2 (every
 * element on some rank, nothing outside a rank's share written). */
static void test_sharded_external_state(void **state) {
    (void)state;
    char *dir = tu_pathf("%s/ext", tu_dir());
    mix_job s;
    memset(&s, 0, sizeof s);
    s.save = s.external = true;
    s.steps = 7;
    s.dir = dir;
    tc_run(3, mix_run, &s);
    mix_check(&s, 3);
    char *shard = tu_pathf("%s/optimizer-00003-of-00003.safetensors", dir);
    assert_true(tu_exists(shard)); /* each rank saved its share */
    free(shard);
    mix want;
    memset(&want, 0, sizeof want);
    mix_fill(&want, 7);
    for (int p = 1; p <= 2; p++) {
        mix_job l;
        memset(&l, 0, sizeof l);
        l.external = true;
        l.steps = 7;
        l.dir = dir;
        tc_run(p, mix_run, &l);
        mix_check(&l, p);
        int alone = 0; /* elements one rank of several holds: the state was split */
        for (int e = 0; e < MIXN; e++) {
            int seen = 0;
            for (int r = 0; r < p; r++) {
                float a = l.m[r][e], b = l.v[r][e];
                if (isnan(a) && isnan(b)) continue;
                if (a != want.m[e] || b != want.v[e])
                    fail_msg("%d ranks: rank %d element %d: %g %g, want %g %g", p, r, e, a, b,
                             want.m[e], want.v[e]);
                seen++;
            }
            if (e < MH + MF + 1 && seen == 0) fail_msg("%d ranks: element %d loaded nowhere", p, e);
            alone += seen == 1;
            if (e >= MH + MF + 1 && seen) fail_msg("frozen element %d has state", e);
        }
        if (p > 1) assert_true(alone >= MH); /* h and f are split */
        for (int e = 0; e < MH; e++) {
            bool any = false;
            for (int r = 0; r < p; r++) any |= l.master[r][e] == want.master[e];
            if (!any) fail_msg("%d ranks: master %d loaded nowhere", p, e);
        }
    }
    free(dir);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_sharded_steps_match_unsharded),
        cmocka_unit_test_setup_teardown(test_reshard_4_to_2_1_3, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test(test_set_shard_validates),
        cmocka_unit_test_setup_teardown(test_sharded_masters_and_frozen, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_sharded_external_state, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
