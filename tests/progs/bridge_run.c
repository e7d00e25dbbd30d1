/* bridge_run — the C side of tests/python/test_torch_continue.py: a small
 * problem trained with one of the configurations PyTorch runs too, saved as
 * a checkpoint after k steps, and continued from a checkpoint (its own, or
 * one PyTorch's state made through `ckpt import` or ckpt_torch.save).
 *
 *   bridge_run save CONFIG K DIR       train steps 1..K, save to DIR, print
 *   bridge_run continue CONFIG K M DIR load DIR, train steps K+1..K+M, print
 *
 * Prints one line: "params <w[12]> <b[5]>" (%.9g: exact float32), then
 * "lr <group 0> [<group 1>]" and, with a scaler, "scale <scale>".
 * Parameters w [3,4] and b [5] start at float(0.5*sin(0.3*j + 1 + k)); the
 * gradient at step t is float(sin(0.37*j + t + k) + 0.1*value), scaled by
 * the loss scale when there is a scaler, with an inf in w at steps t % 7 == 3
 * (the scaler skips those and backs off).
 *
 * CONFIG:
 *   sgd    SGD lr 0.05, momentum 0.9, nesterov, weight_decay 1e-3; StepLR(3, 0.5)
 *   adam   Adam lr 0.01, weight_decay 0.01; warmup_cosine(3, 20)
 *   adamw  AdamW, two groups: w lr 0.01 wd 0.1, b lr 0.02 wd 0 amsgrad;
 *          warmup_cosine(3, 20); GradScaler(256, 2, 0.5, 3)
 *   rmsprop  RMSprop lr 0.01, alpha 0.9, eps 1e-6, weight_decay 0.01,
 *          momentum 0.5, centered; StepLR(3, 0.5) */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

#define NW 12
#define NB 5

static float w[NW], b[NB], gw[NW], gb[NB];

static void die(const char *what, int rc) {
    fprintf(stderr, "bridge_run: %s: %s: %s\n", what, ckpt_strerror(rc), ckpt_errmsg());
    exit(1);
}

typedef struct setup {
    ckpt_accelerator *acc;
    ckpt_model *m;
    ckpt_optimizer *o;
    ckpt_scheduler *s;
    ckpt_grad_scaler *gs;
    int ngroups;
} setup;

static void build(setup *x, const char *config) {
    memset(x, 0, sizeof *x);
    for (int j = 0; j < NW; j++) w[j] = (float)(0.5 * sin(0.3 * j + 1.0 + 0));
    for (int j = 0; j < NB; j++) b[j] = (float)(0.5 * sin(0.3 * j + 1.0 + 1));
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    int rc = ckpt_accelerator_new(&x->acc, &cfg);
    if (rc == 0) rc = ckpt_model_new(&x->m);
    int64_t sw[2] = {3, 4}, sb[1] = {NB};
    if (rc == 0) rc = ckpt_model_add_param(x->m, "w", CKPT_F32, 2, sw, w, gw);
    if (rc == 0) rc = ckpt_model_add_param(x->m, "b", CKPT_F32, 1, sb, b, gb);
    if (rc < 0) die("model", rc);
    x->ngroups = 1;
    if (strcmp(config, "sgd") == 0) {
        rc = ckpt_sgd_new(&x->o, x->m, 0.05, 0.9, 1e-3, true);
        if (rc == 0) rc = ckpt_steplr_new(&x->s, x->o, 3, 0.5);
    } else if (strcmp(config, "adam") == 0) {
        rc = ckpt_adam_new(&x->o, x->m, 0.01, 0.9, 0.999, 1e-8, 0.01);
        if (rc == 0) rc = ckpt_warmup_cosine_new(&x->s, x->o, 3, 20);
    } else if (strcmp(config, "adamw") == 0) {
        ckpt_optim_options g[2] = {ckpt_optim_defaults(CKPT_OPTIM_ADAMW),
                                   ckpt_optim_defaults(CKPT_OPTIM_ADAMW)};
        g[0].lr = 0.01;
        g[0].weight_decay = 0.1;
        g[1].lr = 0.02;
        g[1].weight_decay = 0.0;
        g[1].amsgrad = true;
        int group_of[2] = {0, 1};
        rc = ckpt_optimizer_new(&x->o, CKPT_OPTIM_ADAMW, x->m, &g[0]);
        if (rc == 0) rc = ckpt_optimizer_set_groups(x->o, 2, group_of, g);
        if (rc == 0) rc = ckpt_warmup_cosine_new(&x->s, x->o, 3, 20);
        if (rc == 0) rc = ckpt_grad_scaler_new(&x->gs, 256.0, 2.0, 0.5, 3);
        x->ngroups = 2;
    } else if (strcmp(config, "rmsprop") == 0) {
        rc = ckpt_rmsprop_new(&x->o, x->m, 0.01, 0.9, 1e-6, 0.01, 0.5, true);
        if (rc == 0) rc = ckpt_steplr_new(&x->s, x->o, 3, 0.5);
    } else {
        fprintf(stderr, "bridge_run: unknown config '%s'\n", config);
        exit(2);
    }
    if (rc < 0) die(config, rc);
    rc = ckpt_prepare_model(x->acc, x->m);
    if (rc == 0) rc = ckpt_prepare_optimizer(x->acc, x->o);
    if (rc == 0) rc = ckpt_prepare_scheduler(x->acc, x->s);
    if (rc == 0 && x->gs) rc = ckpt_prepare_scaler(x->acc, x->gs);
    if (rc < 0) die("prepare", rc);
}

static void step(setup *x, int t) {
    for (int j = 0; j < NW; j++) gw[j] = (float)(sin(0.37 * j + t + 0) + 0.1 * (double)w[j]);
    for (int j = 0; j < NB; j++) gb[j] = (float)(sin(0.37 * j + t + 1) + 0.1 * (double)b[j]);
    int rc;
    if (x->gs) {
        float scale = (float)ckpt_grad_scaler_scale(x->gs);
        for (int j = 0; j < NW; j++) gw[j] *= scale;
        for (int j = 0; j < NB; j++) gb[j] *= scale;
        if (t % 7 == 3) gw[t % NW] = INFINITY;
        rc = ckpt_grad_scaler_step(x->gs, x->o, NULL);
        if (rc == 0) rc = ckpt_grad_scaler_update(x->gs);
    } else {
        rc = ckpt_optimizer_step(x->o);
    }
    if (rc == 0) rc = ckpt_scheduler_step(x->s);
    if (rc < 0) die("step", rc);
}

static void print(const setup *x) {
    printf("params");
    for (int j = 0; j < NW; j++) printf(" %.9g", (double)w[j]);
    for (int j = 0; j < NB; j++) printf(" %.9g", (double)b[j]);
    printf("\nlr");
    for (int g = 0; g < x->ngroups; g++) printf(" %.17g", ckpt_optimizer_get_lr(x->o, g));
    printf("\n");
    if (x->gs) printf("scale %.17g\n", ckpt_grad_scaler_scale(x->gs));
}

static void teardown(setup *x) {
    ckpt_accelerator_free(x->acc);
    ckpt_grad_scaler_free(x->gs);
    ckpt_scheduler_free(x->s);
    ckpt_optimizer_free(x->o);
    ckpt_model_free(x->m);
}

int main(int argc, char **argv) {
    setup x;
    if (argc == 5 && strcmp(argv[1], "save") == 0) {
        int k = atoi(argv[3]);
        build(&x, argv[2]);
        for (int t = 1; t <= k; t++) step(&x, t);
        ckpt_accelerator_set_step(x.acc, k);
        int rc = ckpt_save_state(x.acc, argv[4]);
        if (rc < 0) die("save", rc);
    } else if (argc == 6 && strcmp(argv[1], "continue") == 0) {
        int k = atoi(argv[3]), m = atoi(argv[4]);
        build(&x, argv[2]);
        int rc = ckpt_load_state(x.acc, argv[5]);
        if (rc < 0) die("load", rc);
        for (int t = k + 1; t <= k + m; t++) step(&x, t);
    } else {
        fprintf(stderr, "usage: bridge_run save CONFIG K DIR | continue CONFIG K M DIR\n");
        return 2;
    }
    print(&x);
    teardown(&x);
    return 0;
}
