/* fuzz_state_loaders.c — libFuzzer target for the built-in kinds' state-dict
 * loaders. The first byte picks a kind (model, each optimizer, each
 * scheduler, data loader, grad scaler, generator); the rest is opened as a
 * safetensors image and given to a freshly built object's check_state_dict
 * and load_state_dict, as a user calling the ops directly would (no schema
 * comparison first: the loaders must stand on their own). Then the object is
 * used for a few steps and saved again, so a value a loader accepts but the
 * object cannot live with shows up too. Any crash, sanitizer report or leak
 * is a bug; a rejected input is fine.
 *
 * The seed corpus is what the library writes for each kind: build these same
 * objects, step them, and save ops->state_dict with ckpt_writer_save, with
 * the kind's byte in front. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

enum fuzz_kind {
    FK_MODEL,
    FK_SGD,
    FK_ADAM,
    FK_ADAMW,
    FK_STEPLR,
    FK_MULTISTEPLR,
    FK_EXPONENTIALLR,
    FK_COSINELR,
    FK_WARMUP_COSINE,
    FK_WARMUP_LINEAR,
    FK_CONSTANT,
    FK_DATALOADER,
    FK_SCALER,
    FK_RNG,
    FK_COUNT
};

enum { NSAMPLES = 20 };

/* Everything one input needs; what a kind does not use stays NULL. */
typedef struct fuzz_objects {
    float w[6], gw[6], b[2], gb[2];
    int32_t samples[NSAMPLES];
    ckpt_model *model;
    ckpt_optimizer *opt;
    ckpt_scheduler *sched;
    ckpt_dataloader *loader;
    ckpt_grad_scaler *scaler;
    ckpt_rng rng;
    const ckpt_stateful_ops *ops;
    void *self; /* the object under test */
} fuzz_objects;

static void fill_grads(fuzz_objects *o, float g) {
    for (int i = 0; i < 6; i++) o->gw[i] = g * (float)(i + 1);
    for (int i = 0; i < 2; i++) o->gb[i] = -g;
}

/* Builds the objects of kind k; 0 or a ckpt error. */
static int fuzz_objects_new(fuzz_objects *o, int k) {
    memset(o, 0, sizeof *o);
    for (int i = 0; i < 6; i++) o->w[i] = 0.25f * (float)i - 0.5f;
    o->b[0] = 0.125f;
    o->b[1] = -1.0f;
    for (int i = 0; i < NSAMPLES; i++) o->samples[i] = i * 3;
    int rc = ckpt_model_new(&o->model);
    if (rc == 0) rc = ckpt_model_add_param(o->model, "w", CKPT_F32, 2, (int64_t[]){3, 2}, o->w, o->gw);
    if (rc == 0) rc = ckpt_model_add_param(o->model, "b", CKPT_F32, 1, (int64_t[]){2}, o->b, o->gb);
    if (rc < 0) return rc;
    switch (k) {
    case FK_MODEL:
        o->ops = ckpt_model_ops();
        o->self = o->model;
        return 0;
    case FK_SGD: rc = ckpt_sgd_new(&o->opt, o->model, 0.1, 0.9, 0.01, true); break;
    case FK_ADAM: rc = ckpt_adam_new(&o->opt, o->model, 0.01, 0.9, 0.999, 1e-8, 0.0); break;
    case FK_SCALER: rc = ckpt_sgd_new(&o->opt, o->model, 0.1, 0.0, 0.0, false); break;
    default: rc = ckpt_adamw_new(&o->opt, o->model, 0.01, 0.9, 0.999, 1e-8, 0.01); break;
    }
    if (rc < 0) return rc;
    o->ops = ckpt_scheduler_ops();
    switch (k) {
    case FK_SGD:
    case FK_ADAM:
    case FK_ADAMW:
        o->ops = ckpt_optimizer_ops();
        o->self = o->opt;
        return 0;
    case FK_STEPLR: rc = ckpt_steplr_new(&o->sched, o->opt, 3, 0.5); break;
    case FK_MULTISTEPLR:
        rc = ckpt_multisteplr_new(&o->sched, o->opt, 2, (int64_t[]){2, 5}, 0.1);
        break;
    case FK_EXPONENTIALLR: rc = ckpt_exponentiallr_new(&o->sched, o->opt, 0.9); break;
    case FK_COSINELR: rc = ckpt_cosinelr_new(&o->sched, o->opt, 10, 0.001); break;
    case FK_WARMUP_COSINE: rc = ckpt_warmup_cosine_new(&o->sched, o->opt, 2, 10); break;
    case FK_WARMUP_LINEAR: rc = ckpt_warmup_linear_new(&o->sched, o->opt, 2, 10); break;
    case FK_CONSTANT: rc = ckpt_constant_new(&o->sched, o->opt, 2); break;
    case FK_DATALOADER: {
        ckpt_dataset ds;
        rc = ckpt_memory_dataset(&ds, o->samples, NSAMPLES, sizeof o->samples[0]);
        ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
        cfg.batch_size = 3;
        cfg.shuffle = true;
        cfg.seed = 7;
        if (rc == 0) rc = ckpt_dataloader_new(&o->loader, &ds, &cfg);
        o->ops = ckpt_dataloader_ops();
        o->self = o->loader;
        return rc;
    }
    case FK_SCALER:
        rc = ckpt_grad_scaler_new(&o->scaler, 65536.0, 2.0, 0.5, 3);
        o->ops = ckpt_grad_scaler_ops();
        o->self = o->scaler;
        return rc;
    case FK_RNG:
        ckpt_rng_seed(&o->rng, 1234);
        o->ops = ckpt_rng_ops();
        o->self = &o->rng;
        return 0;
    default: return CKPT_EINVAL;
    }
    o->self = o->sched;
    return rc;
}

static void fuzz_objects_free(fuzz_objects *o) {
    ckpt_dataloader_free(o->loader);
    ckpt_grad_scaler_free(o->scaler);
    ckpt_scheduler_free(o->sched);
    ckpt_optimizer_free(o->opt);
    ckpt_model_free(o->model);
}

/* Uses the object of kind k for a few steps, as training would after a
 * resume. Errors are fine (a value may be legal yet unusable); crashes and
 * undefined behaviour are not. */
static void fuzz_objects_exercise(fuzz_objects *o, int k, int steps) {
    volatile double sink = 0;
    for (int s = 0; s < steps; s++) {
        fill_grads(o, 0.5f + (float)s);
        switch (k) {
        case FK_MODEL: sink += o->w[0] + o->b[1]; break;
        case FK_SGD:
        case FK_ADAM:
        case FK_ADAMW: (void)ckpt_optimizer_step(o->opt); break;
        case FK_DATALOADER: {
            ckpt_batch b;
            if (ckpt_dataloader_next(o->loader, &b) == 1)
                for (int64_t i = 0; i < b.size; i++) sink += (double)((int32_t *)b.data)[i];
            break;
        }
        case FK_SCALER: {
            bool inf = false, stepped = false;
            if (s == 1) o->gw[0] = INFINITY;
            sink += ckpt_grad_scaler_scale(o->scaler);
            if (ckpt_grad_scaler_unscale(o->scaler, o->opt, &inf) == 0 &&
                ckpt_grad_scaler_step(o->scaler, o->opt, &stepped) == 0)
                (void)ckpt_grad_scaler_update(o->scaler);
            break;
        }
        case FK_RNG:
            sink += (double)ckpt_rng_u64(&o->rng) + ckpt_rng_normal(&o->rng) +
                    ckpt_rng_uniform(&o->rng);
            break;
        default:
            (void)ckpt_optimizer_step(o->opt);
            (void)ckpt_scheduler_step(o->sched);
            sink += ckpt_scheduler_last_lr(o->sched, 0) + ckpt_optimizer_get_lr(o->opt, 0);
            break;
        }
    }
    (void)sink;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int k = data[0] % FK_COUNT;
    ckpt_reader *r = NULL;
    if (ckpt_reader_open_memory(&r, data + 1, size - 1, "fuzz.safetensors") != CKPT_OK) return 0;
    fuzz_objects o;
    if (fuzz_objects_new(&o, k) != 0) abort();
    int checked = o.ops->check_state_dict(o.self, r);
    int loaded = o.ops->load_state_dict(o.self, r);
    /* load_state_dict is check_state_dict followed by the commit. */
    if (checked != loaded) abort();
    if (loaded == CKPT_OK) {
        fuzz_objects_exercise(&o, k, 3);
        ckpt_writer *w = NULL;
        if (ckpt_writer_new(&w) != 0) abort();
        if (o.ops->state_dict(o.self, w) != 0 || ckpt_writer_count(w) < 1) abort();
        ckpt_writer_free(w);
    }
    fuzz_objects_free(&o);
    ckpt_reader_free(r);
    return 0;
}
