/* quickstart.c — the ckpt API on one page: a model, an optimizer, a
 * learning-rate scheduler, a shuffled prefetching data loader and an
 * accelerator that saves them all every 25 steps. Run it, kill it whenever
 * you like, run it again: it resumes where the last checkpoint left off
 * (weights, AdamW moments, learning rate, data order, step), exactly.
 *
 *   example_quickstart [PROJECT_DIR]      (default: runs/quickstart)
 */
#include <stdio.h>

#include "ckpt.h"

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ < 0) {                                                                             \
            fprintf(stderr, "quickstart: %s\n", ckpt_errmsg());                                    \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

enum { N = 256, FEATURES = 4, STEPS = 300 };

typedef struct sample { float x[FEATURES], y; } sample;

int main(int argc, char **argv) {
    static sample data[N]; /* y = 1 + 2*x0 - 3*x1 + 0.5*x2 + x3 */
    ckpt_rng g;
    ckpt_rng_seed(&g, 42);
    for (int i = 0; i < N; i++) {
        for (int k = 0; k < FEATURES; k++) data[i].x[k] = ckpt_rng_uniform_f32(&g);
        data[i].y = 1 + 2 * data[i].x[0] - 3 * data[i].x[1] + 0.5f * data[i].x[2] + data[i].x[3];
    }
    float w[FEATURES] = {0}, b[1] = {0}, gw[FEATURES], gb[1];

    /* --- the ~20 lines that matter ------------------------------------------ */
    ckpt_model *model;
    ckpt_optimizer *opt;
    ckpt_scheduler *sched;
    ckpt_dataloader *loader;
    ckpt_accelerator *acc;
    ckpt_dataset ds;
    CHECK(ckpt_model_new(&model));
    CHECK(ckpt_model_add_param(model, "linear.weight", CKPT_F32, 1, (int64_t[]){FEATURES}, w, gw));
    CHECK(ckpt_model_add_param(model, "linear.bias", CKPT_F32, 1, (int64_t[]){1}, b, gb));
    CHECK(ckpt_adamw_new(&opt, model, 0.1, 0.9, 0.999, 1e-8, 0.0));
    CHECK(ckpt_steplr_new(&sched, opt, 100, 0.5)); /* halves lr every 100 steps */
    CHECK(ckpt_memory_dataset(&ds, data, N, sizeof(sample)));
    ckpt_dataloader_config dc = ckpt_dataloader_defaults();
    dc.batch_size = 16;
    dc.shuffle = true;
    dc.seed = 1;
    dc.num_workers = 2; /* prefetch threads: they never change the order */
    CHECK(ckpt_dataloader_new(&loader, &ds, &dc));
    ckpt_project_config cfg = {.project_dir = argc > 1 ? argv[1] : "runs/quickstart",
                               .automatic_checkpoint_naming = true, .total_limit = 2};
    CHECK(ckpt_accelerator_new(&acc, &cfg));
    CHECK(ckpt_prepare_model(acc, model));
    CHECK(ckpt_prepare_optimizer(acc, opt));
    CHECK(ckpt_prepare_dataloader(acc, loader));
    CHECK(ckpt_prepare_scheduler(acc, sched)); /* a scheduler: ckpt export writes scheduler.bin */
    int rc = ckpt_load_state(acc, NULL); /* the newest complete checkpoint, if any */
    if (rc < 0 && rc != CKPT_ENOENT) CHECK(rc);
    if (rc == CKPT_OK) printf("resumed from %s\n", ckpt_accelerator_last_dir(acc));
    /* ------------------------------------------------------------------------ */

    ckpt_batch batch;
    double loss = 0;
    for (int64_t step = ckpt_accelerator_step(acc); step < STEPS;) {
        int got = ckpt_dataloader_next(loader, &batch);
        CHECK(got);
        if (got == 0) continue; /* end of an epoch; the next call starts the next */
        const sample *s = batch.data;
        ckpt_optimizer_zero_grad(opt);
        loss = 0;
        for (int64_t i = 0; i < batch.size; i++) { /* mean squared error and its gradient */
            float err = b[0] - s[i].y;
            for (int k = 0; k < FEATURES; k++) err += w[k] * s[i].x[k];
            loss += (double)err * err / (double)batch.size;
            for (int k = 0; k < FEATURES; k++) gw[k] += 2 * err * s[i].x[k] / (float)batch.size;
            gb[0] += 2 * err / (float)batch.size;
        }
        CHECK(ckpt_optimizer_step(opt));
        CHECK(ckpt_scheduler_step(sched));
        ckpt_accelerator_set_step(acc, ++step);
        if (step % 25 == 0) {
            CHECK(ckpt_save_state(acc, NULL)); /* <dir>/checkpoints/checkpoint_<n> */
            printf("step %lld: loss %.6f, saved %s\n", (long long)step, loss,
                   ckpt_accelerator_last_dir(acc));
        }
    }
    printf("w = [%.6f %.6f %.6f %.6f], b = %.6f (true: [2 -3 0.5 1], 1)\n", w[0], w[1], w[2], w[3], b[0]);

    ckpt_accelerator_free(acc);
    ckpt_dataloader_free(loader);
    ckpt_scheduler_free(sched);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    return 0;
}
