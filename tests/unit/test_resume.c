/* test_resume.c — exact resume with every kind of state at once: two models,
 * two optimizers (SGD with momentum and AdamW, two parameter groups each),
 * two schedulers, a loss scaler (with an inf step), the accelerator's RNG (as
 * gradient noise, resumed with and without a cached normal), a custom object,
 * a custom table loaded as column slices of an unsharded tensor, and a
 * shuffling data loader. Training to n without stopping and training to k,
 * saving, loading into new objects and training on to n give identical bits. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "helpers/testutil.h"

#define NSAMPLES 22
#define BATCH 4

/* A custom object: running statistics of the loss. */
typedef struct loss_stats {
    double sum;
    int64_t count;
} loss_stats;

static int stats_sd(void *self, ckpt_writer *w) {
    loss_stats *s = self;
    CKPT_TRY(ckpt_write_f64(w, "sum", s->sum));
    return ckpt_write_i64(w, "count", s->count);
}

static int stats_load(void *self, ckpt_reader *r) {
    loss_stats *s = self, t;
    CKPT_TRY(ckpt_read_f64(r, "sum", &t.sum));
    CKPT_TRY(ckpt_read_i64(r, "count", &t.count));
    *s = t;
    return 0;
}

static const ckpt_stateful_ops stats_ops = {.state_dict = stats_sd,
                                            .load_state_dict = stats_load};

/* A table held in two column halves, as a tensor-parallel layer keeps its
 * share: saved as one unsharded [3, 4] tensor, loaded back by reading each
 * half as a column slice of it (ckpt_read_tensor_shard). */
typedef struct split_table {
    float left[6], right[6]; /* columns 0-1 and 2-3 of each of the 3 rows */
    float whole[12];         /* the saved tensor (the writer borrows it) */
} split_table;

static const int64_t table_shape[2] = {3, 4}, half_shape[2] = {3, 2};

static int table_sd(void *self, ckpt_writer *w) {
    split_table *t = self;
    for (int r = 0; r < 3; r++)
        for (int c = 0; c < 2; c++) {
            t->whole[r * 4 + c] = t->left[r * 2 + c];
            t->whole[r * 4 + 2 + c] = t->right[r * 2 + c];
        }
    return ckpt_write_tensor(w, "table", CKPT_F32, 2, table_shape, t->whole);
}

static int table_load(void *self, ckpt_reader *r) {
    split_table *t = self;
    float l[6], rt[6];
    const int64_t at_left[2] = {0, 0}, at_right[2] = {0, 2};
    CKPT_TRY(ckpt_read_tensor_shard(r, "table", CKPT_F32, 2, table_shape, at_left, half_shape, l));
    CKPT_TRY(
        ckpt_read_tensor_shard(r, "table", CKPT_F32, 2, table_shape, at_right, half_shape, rt));
    memcpy(t->left, l, sizeof l);
    memcpy(t->right, rt, sizeof rt);
    return 0;
}

static const ckpt_stateful_ops table_ops = {.state_dict = table_sd, .load_state_dict = table_load};

/* h = W x + b; out = V h + c; loss = 0.5 * mean ||out - y||^2. */
typedef struct world {
    float W[6], b[2], V[4], c[2];
    float gW[6], gb[2], gV[4], gc[2];
    float data[NSAMPLES * 5]; /* x[3], y[2] per sample */
    ckpt_dataset ds;
    ckpt_model *mA, *mB;
    ckpt_optimizer *o1, *o2;
    ckpt_scheduler *s1, *s2;
    ckpt_grad_scaler *gs;
    ckpt_dataloader *dl;
    ckpt_accelerator *acc;
    loss_stats stats;
    split_table table;
} world;

static void quiet(void *user, ckpt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    (void)msg;
}

/* init_shift makes the initial weights differ, so a load must overwrite them. */
static void world_open(world *w, const char *project, float init_shift) {
    memset(w, 0, sizeof *w);
    for (int i = 0; i < 6; i++) w->W[i] = 0.1f * (float)(i - 2) + init_shift;
    for (int i = 0; i < 2; i++) w->b[i] = 0.05f * (float)i + init_shift;
    for (int i = 0; i < 4; i++) w->V[i] = 0.2f * (float)(i % 3) - 0.1f + init_shift;
    for (int i = 0; i < 2; i++) w->c[i] = -0.03f + init_shift;
    for (int s = 0; s < NSAMPLES; s++) {
        float *p = &w->data[s * 5];
        p[0] = (float)s / NSAMPLES;
        p[1] = (float)((s * 7) % 5) / 5.0f;
        p[2] = 1.0f - p[0];
        p[3] = 0.5f * p[0] - p[1] + 0.25f;
        p[4] = p[2] * p[1];
    }
    assert_int_equal(ckpt_memory_dataset(&w->ds, w->data, NSAMPLES, 5 * sizeof(float)), 0);

    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = project;
    cfg.automatic_checkpoint_naming = true;
    assert_int_equal(ckpt_accelerator_new(&w->acc, &cfg), 0);
    ckpt_accelerator_set_log(w->acc, quiet, NULL);
    assert_int_equal(ckpt_set_seed(w->acc, 2024), 0);

    int64_t sW[2] = {2, 3}, sb[1] = {2}, sV[2] = {2, 2}, sc[1] = {2};
    assert_int_equal(ckpt_model_new(&w->mA), 0);
    assert_int_equal(ckpt_model_add_param(w->mA, "enc.weight", CKPT_F32, 2, sW, w->W, w->gW), 0);
    assert_int_equal(ckpt_model_add_param(w->mA, "enc.bias", CKPT_F32, 1, sb, w->b, w->gb), 0);
    assert_int_equal(ckpt_model_new(&w->mB), 0);
    assert_int_equal(ckpt_model_add_param(w->mB, "head.weight", CKPT_F32, 2, sV, w->V, w->gV), 0);
    assert_int_equal(ckpt_model_add_param(w->mB, "head.bias", CKPT_F32, 1, sc, w->c, w->gc), 0);

    int groups[2] = {0, 1};
    ckpt_optim_options sgd[2] = {ckpt_optim_defaults(CKPT_OPTIM_SGD), ckpt_optim_defaults(CKPT_OPTIM_SGD)};
    sgd[0].lr = 0.1;
    sgd[0].momentum = 0.9;
    sgd[1].lr = 0.05;
    sgd[1].momentum = 0.5;
    sgd[1].weight_decay = 0.01;
    assert_int_equal(ckpt_optimizer_new(&w->o1, CKPT_OPTIM_SGD, w->mA, &sgd[0]), 0);
    assert_int_equal(ckpt_optimizer_set_groups(w->o1, 2, groups, sgd), 0);
    ckpt_optim_options adamw[2] = {ckpt_optim_defaults(CKPT_OPTIM_ADAMW),
                                   ckpt_optim_defaults(CKPT_OPTIM_ADAMW)};
    adamw[0].lr = 0.01;
    adamw[1].lr = 0.02;
    adamw[1].weight_decay = 0.1;
    assert_int_equal(ckpt_optimizer_new(&w->o2, CKPT_OPTIM_ADAMW, w->mB, &adamw[0]), 0);
    assert_int_equal(ckpt_optimizer_set_groups(w->o2, 2, groups, adamw), 0);
    assert_int_equal(ckpt_steplr_new(&w->s1, w->o1, 3, 0.5), 0);
    assert_int_equal(ckpt_warmup_cosine_new(&w->s2, w->o2, 4, 30), 0);
    assert_int_equal(ckpt_grad_scaler_new(&w->gs, 1024.0, 2.0, 0.5, 3), 0);

    ckpt_dataloader_config dc = ckpt_dataloader_defaults();
    dc.batch_size = BATCH;
    dc.shuffle = true;
    dc.seed = 7;
    assert_int_equal(ckpt_dataloader_new(&w->dl, &w->ds, &dc), 0);

    assert_int_equal(ckpt_prepare_model(w->acc, w->mA), 0);
    assert_int_equal(ckpt_prepare_model(w->acc, w->mB), 0);
    assert_int_equal(ckpt_prepare_optimizer(w->acc, w->o1), 0);
    assert_int_equal(ckpt_prepare_optimizer(w->acc, w->o2), 0);
    assert_int_equal(ckpt_prepare_scheduler(w->acc, w->s1), 0);
    assert_int_equal(ckpt_prepare_scheduler(w->acc, w->s2), 0);
    assert_int_equal(ckpt_prepare_scaler(w->acc, w->gs), 0);
    assert_int_equal(ckpt_prepare_dataloader(w->acc, w->dl), 0);
    assert_int_equal(ckpt_register_for_checkpointing(w->acc, &stats_ops, &w->stats), 0);
    for (int i = 0; i < 6; i++) {
        w->table.left[i] = 0.25f * (float)i + init_shift;
        w->table.right[i] = -0.5f * (float)i + init_shift;
    }
    assert_int_equal(ckpt_register_for_checkpointing(w->acc, &table_ops, &w->table), 0);
}

static void world_close(world *w) {
    ckpt_accelerator_free(w->acc);
    ckpt_dataloader_free(w->dl);
    ckpt_grad_scaler_free(w->gs);
    ckpt_scheduler_free(w->s1);
    ckpt_scheduler_free(w->s2);
    ckpt_optimizer_free(w->o1);
    ckpt_optimizer_free(w->o2);
    ckpt_model_free(w->mA);
    ckpt_model_free(w->mB);
}

static void train_step(world *w) {
    ckpt_batch bt;
    int rc = ckpt_dataloader_next(w->dl, &bt);
    if (rc == 0) rc = ckpt_dataloader_next(w->dl, &bt); /* the next epoch */
    assert_int_equal(rc, 1);
    ckpt_optimizer_zero_grad(w->o1);
    ckpt_optimizer_zero_grad(w->o2);
    float scale = (float)ckpt_grad_scaler_scale(w->gs);
    double loss = 0;
    const float *samples = bt.data;
    for (int64_t s = 0; s < bt.size; s++) {
        const float *x = &samples[s * 5], *y = x + 3;
        float h[2], out[2], dout[2], dh[2];
        for (int i = 0; i < 2; i++) h[i] = w->W[i * 3] * x[0] + w->W[i * 3 + 1] * x[1] + w->W[i * 3 + 2] * x[2] + w->b[i];
        for (int i = 0; i < 2; i++) out[i] = w->V[i * 2] * h[0] + w->V[i * 2 + 1] * h[1] + w->c[i];
        for (int i = 0; i < 2; i++) {
            dout[i] = (out[i] - y[i]) / (float)bt.size;
            loss += 0.5 * (double)((out[i] - y[i]) * (out[i] - y[i])) / (double)bt.size;
        }
        for (int i = 0; i < 2; i++) {
            for (int j = 0; j < 2; j++) w->gV[i * 2 + j] += scale * dout[i] * h[j];
            w->gc[i] += scale * dout[i];
        }
        for (int j = 0; j < 2; j++) dh[j] = w->V[j] * dout[0] + w->V[2 + j] * dout[1];
        for (int i = 0; i < 2; i++) {
            for (int j = 0; j < 3; j++) w->gW[i * 3 + j] += scale * dh[i] * x[j];
            w->gb[i] += scale * dh[i];
        }
    }
    /* Gradient noise from the accelerator's generator: its state matters. */
    ckpt_rng *g = ckpt_accelerator_rng(w->acc);
    for (int i = 0; i < 6; i++) w->gW[i] += scale * 1e-3f * (float)ckpt_rng_normal(g);
    /* a seventh normal: after an odd step the generator holds a cached
     * second Box-Muller value, which a resume must carry over */
    w->gb[0] += scale * 1e-3f * (float)ckpt_rng_normal(g);
    /* the table's halves move with the weights (distinct per column) */
    for (int i = 0; i < 6; i++) {
        w->table.left[i] = 0.9f * w->table.left[i] + 0.1f * w->W[i];
        w->table.right[i] = 0.8f * w->table.right[i] - 0.05f * w->V[i % 4] + 0.01f * (float)i;
    }
    int64_t step = ckpt_accelerator_step(w->acc);
    if (step % 7 == 3) w->gV[1] = INFINITY; /* the scaler skips and backs off */
    bool stepped;
    assert_int_equal(ckpt_grad_scaler_step(w->gs, w->o1, &stepped), 0);
    assert_int_equal(ckpt_grad_scaler_step(w->gs, w->o2, &stepped), 0);
    assert_int_equal(ckpt_grad_scaler_update(w->gs), 0);
    assert_int_equal(ckpt_scheduler_step(w->s1), 0);
    assert_int_equal(ckpt_scheduler_step(w->s2), 0);
    w->stats.sum += loss;
    w->stats.count++;
    ckpt_accelerator_set_step(w->acc, step + 1);
}

static void train_to(world *w, int64_t n) {
    while (ckpt_accelerator_step(w->acc) < n) train_step(w);
}

static const char *const state_files[] = {"model.safetensors",
                                          "model_1.safetensors",
                                          "optimizer.safetensors",
                                          "optimizer_1.safetensors",
                                          "scheduler.safetensors",
                                          "scheduler_1.safetensors",
                                          "scaler.safetensors",
                                          "dataloader.safetensors",
                                          "custom_checkpoint_0.safetensors",
                                          "custom_checkpoint_1.safetensors",
                                          "random_states_0.safetensors"};

/* Every state file of two checkpoints is identical, byte for byte. */
static void assert_same_files(const char *a, const char *b) {
    for (size_t i = 0; i < sizeof state_files / sizeof *state_files; i++) {
        char pa[4200], pb[4200];
        tu_assert_same_file(tu_path(pa, sizeof pa, a, state_files[i]),
                            tu_path(pb, sizeof pb, b, state_files[i]), state_files[i]);
    }
}

static void assert_same_world(world *a, world *b) {
    assert_memory_equal(a->W, b->W, sizeof a->W);
    assert_memory_equal(a->b, b->b, sizeof a->b);
    assert_memory_equal(a->V, b->V, sizeof a->V);
    assert_memory_equal(a->c, b->c, sizeof a->c);
    assert_memory_equal(&a->stats, &b->stats, sizeof a->stats);
    assert_memory_equal(a->table.left, b->table.left, sizeof a->table.left);
    assert_memory_equal(a->table.right, b->table.right, sizeof a->table.right);
    assert_memory_equal(ckpt_accelerator_rng(a->acc), ckpt_accelerator_rng(b->acc), sizeof(ckpt_rng));
    assert_true(ckpt_grad_scaler_scale(a->gs) == ckpt_grad_scaler_scale(b->gs));
    for (int g = 0; g < 2; g++) {
        assert_true(ckpt_optimizer_get_lr(a->o1, g) == ckpt_optimizer_get_lr(b->o1, g));
        assert_true(ckpt_optimizer_get_lr(a->o2, g) == ckpt_optimizer_get_lr(b->o2, g));
    }
    assert_int_equal(ckpt_dataloader_epoch(a->dl), ckpt_dataloader_epoch(b->dl));
    assert_int_equal(ckpt_accelerator_step(a->acc), ckpt_accelerator_step(b->acc));
}

static void resume_at(int64_t k, int64_t n) {
    char *t = tu_tmpdir_new("resume");
    char ref[4200], res[4200], pa[4200], pb[4200];
    tu_path(pa, sizeof pa, t, "a");
    tu_path(pb, sizeof pb, t, "b");
    tu_path(ref, sizeof ref, t, "a_final");
    tu_path(res, sizeof res, t, "b_final");

    world a;
    world_open(&a, pa, 0.0f);
    train_to(&a, n);
    assert_int_equal(ckpt_save_state(a.acc, ref), 0);

    world b;
    world_open(&b, pb, 0.0f);
    train_to(&b, k);
    /* 7 normals a step: an odd step count leaves one cached, and the resume
     * must continue with it */
    assert_int_equal(ckpt_accelerator_rng(b.acc)->has_normal, (uint32_t)(k % 2));
    assert_int_equal(ckpt_save_state(b.acc, NULL), 0);
    world_close(&b);

    world c;
    world_open(&c, pb, 0.75f);
    assert_int_equal(ckpt_load_state(c.acc, NULL), 0);
    assert_int_equal(ckpt_accelerator_step(c.acc), k);
    train_to(&c, n);
    assert_int_equal(ckpt_save_state(c.acc, res), 0);

    assert_same_world(&a, &c);
    assert_same_files(ref, res);
    /* The next draws and batches agree too. */
    train_step(&a);
    train_step(&c);
    assert_same_world(&a, &c);
    world_close(&a);
    world_close(&c);
    tu_tmpdir_free(t);
}

static void test_resume_mid_epoch_with_every_kind_is_bit_exact(void **st) {
    (void)st;
    resume_at(7, 19); /* 6 batches an epoch: step 7 is batch 1 of epoch 1; a normal cached */
}

static void test_resume_at_an_epoch_boundary_is_bit_exact(void **st) {
    (void)st;
    resume_at(12, 20);
}

static void test_resume_at_step_0_is_bit_exact(void **st) {
    (void)st;
    resume_at(0, 9);
}

/* A world that was never trained differs from one that was: the comparison
 * above can fail. */
static void test_resume_comparison_detects_a_missing_load(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("resume");
    char pa[4200], pb[4200];
    tu_path(pa, sizeof pa, t, "a");
    tu_path(pb, sizeof pb, t, "b");
    world a, c;
    world_open(&a, pa, 0.0f);
    world_open(&c, pb, 0.0f);
    train_to(&a, 5);
    ckpt_accelerator_set_step(c.acc, 3);
    train_to(&c, 5);
    assert_true(memcmp(a.W, c.W, sizeof a.W) != 0);
    world_close(&a);
    world_close(&c);
    tu_tmpdir_free(t);
}

/* Load is transactional over every kind: a mismatch in the last object
 * (the custom one) leaves every model, optimizer, scheduler, scaler, loader
 * and the RNG untouched. */
static int stats_sd_other(void *self, ckpt_writer *w) {
    CKPT_TRY(stats_sd(self, w));
    return ckpt_write_i64(w, "new_field", 0);
}
static const ckpt_stateful_ops stats_ops_other = {.state_dict = stats_sd_other,
                                                  .load_state_dict = stats_load};

static void test_load_state_mismatch_changes_nothing_in_any_object(void **st) {
    (void)st;
    char *t = tu_tmpdir_new("resume");
    world a;
    world_open(&a, t, 0.0f);
    train_to(&a, 4);
    assert_int_equal(ckpt_save_state(a.acc, NULL), 0);
    world_close(&a);

    /* The same objects, except the custom one declares a key the file lacks. */
    world c;
    world_open(&c, t, 0.5f);
    ckpt_accelerator_free(c.acc);
    ckpt_project_config cfg = {.project_dir = t, .automatic_checkpoint_naming = true};
    assert_int_equal(ckpt_accelerator_new(&c.acc, &cfg), 0);
    assert_int_equal(ckpt_prepare_model(c.acc, c.mA), 0);
    assert_int_equal(ckpt_prepare_model(c.acc, c.mB), 0);
    assert_int_equal(ckpt_prepare_optimizer(c.acc, c.o1), 0);
    assert_int_equal(ckpt_prepare_optimizer(c.acc, c.o2), 0);
    assert_int_equal(ckpt_prepare_scheduler(c.acc, c.s1), 0);
    assert_int_equal(ckpt_prepare_scheduler(c.acc, c.s2), 0);
    assert_int_equal(ckpt_prepare_scaler(c.acc, c.gs), 0);
    assert_int_equal(ckpt_prepare_dataloader(c.acc, c.dl), 0);
    assert_int_equal(ckpt_register_for_checkpointing(c.acc, &stats_ops_other, &c.stats), 0);
    assert_int_equal(ckpt_register_for_checkpointing(c.acc, &table_ops, &c.table), 0);
    train_to(&c, 2);

    /* Snapshot every registered state through its own state_dict. */
    char snap1[4200], snap2[4200];
    tu_path(snap1, sizeof snap1, t, "snap1");
    tu_path(snap2, sizeof snap2, t, "snap2");
    assert_int_equal(ckpt_save_state(c.acc, snap1), 0);
    float W[6], V[4];
    memcpy(W, c.W, sizeof W);
    memcpy(V, c.V, sizeof V);
    char cp[4200];
    tu_path(cp, sizeof cp, t, "checkpoints/checkpoint_0");
    tu_expect_error(ckpt_load_state(c.acc, cp), CKPT_EMISMATCH, "custom_checkpoint_0.safetensors");
    tu_assert_errmsg_has("new_field");
    assert_int_equal(ckpt_accelerator_step(c.acc), 2);
    assert_memory_equal(W, c.W, sizeof W);
    assert_memory_equal(V, c.V, sizeof V);
    /* After a failed load the accelerator saves nothing until told to. */
    tu_expect_error(ckpt_save_state(c.acc, snap2), CKPT_EINVAL, "new_field");
    assert_int_equal(ckpt_accelerator_start_over(c.acc), 0);
    assert_int_equal(ckpt_save_state(c.acc, snap2), 0);
    assert_same_files(snap1, snap2);
    world_close(&c);
    tu_tmpdir_free(t);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_mid_epoch_with_every_kind_is_bit_exact),
        cmocka_unit_test(test_resume_at_an_epoch_boundary_is_bit_exact),
        cmocka_unit_test(test_resume_at_step_0_is_bit_exact),
        cmocka_unit_test(test_resume_comparison_detects_a_missing_load),
        cmocka_unit_test(test_load_state_mismatch_changes_nothing_in_any_object),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
