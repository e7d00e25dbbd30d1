/* foreign.h — a foreign trainer's state, as a C trainer in llm.c's style
 * keeps it (issue 36), at GPT-2 small's size: one contiguous block of the
 * 124,439,808 fp32 parameters (148 tensors with Hugging Face names, views
 * into the block), and the trainer's own AdamW, run by the trainer itself
 * (ckpt_optimizer_external_new), whose exp_avg and exp_avg_sq are two more
 * blocks of the same size attached with ckpt_optimizer_set_state_block.
 * 1.49 GB in all; a checkpoint of it is model.safetensors (0.50 GB),
 * optimizer.safetensors (1.00 GB) and the generator's file. Shared by
 * bench_save and bench_phases. */
#ifndef CKPT_BENCH_FOREIGN_H
#define CKPT_BENCH_FOREIGN_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ckpt.h"
#include "gpt2.h"

typedef struct foreign {
    int64_t n; /* parameters */
    float *params, *m, *v;
    ckpt_model *model;
    ckpt_optimizer *opt;
    int64_t step;
} foreign;

static int foreign_nt_;
static int64_t foreign_total_;
static struct {
    char name[64];
    int ndim;
    int64_t shape[2], at;
} foreign_t_[MAXP];

static void foreign_add_(const char *name, int ndim, int64_t a, int64_t b) {
    int i = foreign_nt_++;
    snprintf(foreign_t_[i].name, sizeof foreign_t_[i].name, "%s", name);
    foreign_t_[i].ndim = ndim;
    foreign_t_[i].shape[0] = a;
    foreign_t_[i].shape[1] = b;
    foreign_t_[i].at = foreign_total_;
    foreign_total_ += ndim == 1 ? a : a * b;
}

static float *foreign_block_(int64_t n) {
    float *p = malloc((size_t)n * sizeof(float));
    if (!p) {
        fprintf(stderr, "foreign: out of memory\n");
        exit(1);
    }
    return p;
}

/* The state, every byte written once; exits on failure. */
static void foreign_new(foreign *f) {
    if (foreign_nt_ == 0) gpt2_small_each(foreign_add_);
    f->n = foreign_total_;
    f->params = foreign_block_(f->n);
    f->m = foreign_block_(f->n);
    f->v = foreign_block_(f->n);
    for (int64_t i = 0; i < f->n; i++) {
        f->params[i] = (float)(i % 997) * 1e-3f - 0.5f;
        f->m[i] = (float)(i % 773) * 1e-4f;
        f->v[i] = (float)(i % 331) * 1e-6f;
    }
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    int rc = ckpt_model_new(&f->model);
    for (int i = 0; rc == 0 && i < foreign_nt_; i++)
        rc = ckpt_model_add_param(f->model, foreign_t_[i].name, CKPT_F32, foreign_t_[i].ndim,
                                  foreign_t_[i].shape, f->params + foreign_t_[i].at, NULL);
    if (rc == 0) rc = ckpt_optimizer_external_new(&f->opt, CKPT_OPTIM_ADAMW, f->model, &o);
    if (rc == 0) rc = ckpt_optimizer_set_state_block(f->opt, "exp_avg", f->m, f->params);
    if (rc == 0) rc = ckpt_optimizer_set_state_block(f->opt, "exp_avg_sq", f->v, f->params);
    if (rc == 0) rc = ckpt_optimizer_set_step(f->opt, f->step = 1);
    if (rc) {
        fprintf(stderr, "foreign: %s\n", ckpt_errmsg());
        exit(1);
    }
}

/* One training step's worth of change: every byte of the three blocks. */
static void foreign_step(foreign *f) {
    float d = 1e-6f * (float)(f->step % 1000 + 1);
    for (int64_t i = 0; i < f->n; i++) {
        f->params[i] += d;
        f->m[i] = f->m[i] * 0.9f + d;
        f->v[i] = f->v[i] * 0.999f + d * d;
    }
    if (ckpt_optimizer_set_step(f->opt, ++f->step)) {
        fprintf(stderr, "foreign: %s\n", ckpt_errmsg());
        exit(1);
    }
}

/* Prepares the model and the optimizer on acc. */
static int foreign_prepare(ckpt_accelerator *acc, foreign *f) {
    int rc = ckpt_prepare_model(acc, f->model);
    return rc ? rc : ckpt_prepare_optimizer(acc, f->opt);
}

static void foreign_free(foreign *f) {
    ckpt_optimizer_free(f->opt);
    ckpt_model_free(f->model);
    free(f->params);
    free(f->m);
    free(f->v);
}

#endif
