/* optim_trace — runs every optimizer configuration, scheduler and the loss
 * scaler for a fixed number of steps on fixed values and a fixed gradient
 * sequence, printing every value; tests/python/test_torch_numerics.py runs
 * the same in PyTorch and compares.
 *
 * Lines:  opt <config> <step> <param values...>        (%.9g: exact float32)
 *         sched <config> <step> <lr of group 0> <lr of group 1>   (%.17g)
 *         scaler <step> <scale> <stepped> <param values...>
 * Parameters: w [3,4] and b [5]; initial value j of parameter k is
 * float(0.5*sin(0.3*j + 1 + k)); gradient at step t is
 * float(sin(0.37*j + t + k) + 0.1*value).
 *
 * optim_trace <path> also writes the model's state dict (the initial values)
 * to <path>, for the test to read back as a plain safetensors state dict. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

#define STEPS 50
#define NW 12
#define NB 5

static float w[NW], b[NB], gw[NW], gb[NB];

static void init_params(void) {
    for (int j = 0; j < NW; j++) w[j] = (float)(0.5 * sin(0.3 * j + 1.0 + 0));
    for (int j = 0; j < NB; j++) b[j] = (float)(0.5 * sin(0.3 * j + 1.0 + 1));
}

static void make_grads(int t) {
    for (int j = 0; j < NW; j++) gw[j] = (float)(sin(0.37 * j + t + 0) + 0.1 * (double)w[j]);
    for (int j = 0; j < NB; j++) gb[j] = (float)(sin(0.37 * j + t + 1) + 0.1 * (double)b[j]);
}

static void print_params(void) {
    for (int j = 0; j < NW; j++) printf(" %.9g", (double)w[j]);
    for (int j = 0; j < NB; j++) printf(" %.9g", (double)b[j]);
    printf("\n");
}

static int fail(const char *what, int rc) {
    fprintf(stderr, "optim_trace: %s: %s: %s\n", what, ckpt_strerror(rc), ckpt_errmsg());
    exit(1);
}

static ckpt_model *make_model(void) {
    ckpt_model *m;
    int rc = ckpt_model_new(&m);
    if (rc < 0) fail("model", rc);
    int64_t sw[2] = {3, 4}, sb[1] = {NB};
    if ((rc = ckpt_model_add_param(m, "w", CKPT_F32, 2, sw, w, gw)) < 0) fail("add w", rc);
    if ((rc = ckpt_model_add_param(m, "b", CKPT_F32, 1, sb, b, gb)) < 0) fail("add b", rc);
    return m;
}

typedef struct opt_config {
    const char *name;
    ckpt_optim_kind kind;
    ckpt_optim_options g0;
    bool two_groups;
    ckpt_optim_options g1;
} opt_config;

static void run_optimizer(const opt_config *c) {
    init_params();
    ckpt_model *m = make_model();
    ckpt_optimizer *o;
    int rc = ckpt_optimizer_new(&o, c->kind, m, &c->g0);
    if (rc < 0) fail(c->name, rc);
    if (c->two_groups) {
        int group_of[2] = {0, 1};
        ckpt_optim_options opts[2] = {c->g0, c->g1};
        if ((rc = ckpt_optimizer_set_groups(o, 2, group_of, opts)) < 0) fail(c->name, rc);
    }
    for (int t = 1; t <= STEPS; t++) {
        make_grads(t);
        if ((rc = ckpt_optimizer_step(o)) < 0) fail(c->name, rc);
        printf("opt %s %d", c->name, t);
        print_params();
    }
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

static ckpt_optim_options sgd(double lr, double mom, double damp, double wd, bool nesterov,
                              bool maximize) {
    ckpt_optim_options o = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    o.lr = lr;
    o.momentum = mom;
    o.dampening = damp;
    o.weight_decay = wd;
    o.nesterov = nesterov;
    o.maximize = maximize;
    return o;
}

static ckpt_optim_options adam(ckpt_optim_kind k, double lr, double wd, bool amsgrad,
                               bool maximize) {
    ckpt_optim_options o = ckpt_optim_defaults(k);
    o.lr = lr;
    o.weight_decay = wd;
    o.amsgrad = amsgrad;
    o.maximize = maximize;
    return o;
}

typedef struct sched_config {
    const char *name;
    int kind;
    int64_t a, b;
    double x, y;
} sched_config;

static void run_scheduler(const sched_config *c) {
    init_params();
    ckpt_model *m = make_model();
    ckpt_optimizer *o;
    ckpt_optim_options g0 = sgd(0.1, 0, 0, 0, false, false), g1 = sgd(0.05, 0, 0, 0, false, false);
    int rc = ckpt_optimizer_new(&o, CKPT_OPTIM_SGD, m, &g0);
    if (rc < 0) fail(c->name, rc);
    int group_of[2] = {0, 1};
    ckpt_optim_options opts[2] = {g0, g1};
    if ((rc = ckpt_optimizer_set_groups(o, 2, group_of, opts)) < 0) fail(c->name, rc);
    ckpt_scheduler *s = NULL;
    static const int64_t milestones[4] = {5, 15, 15, 30};
    switch (c->kind) {
    case 0: rc = ckpt_steplr_new(&s, o, c->a, c->x); break;
    case 1: rc = ckpt_multisteplr_new(&s, o, 4, milestones, c->x); break;
    case 2: rc = ckpt_exponentiallr_new(&s, o, c->x); break;
    case 3: rc = ckpt_cosinelr_new(&s, o, c->a, c->y); break;
    case 4: rc = ckpt_warmup_cosine_new(&s, o, c->a, c->b); break;
    case 5: rc = ckpt_warmup_linear_new(&s, o, c->a, c->b); break;
    default: rc = ckpt_constant_new(&s, o, c->a); break;
    }
    if (rc < 0) fail(c->name, rc);
    for (int t = 0; t <= STEPS; t++) {
        if (t > 0 && (rc = ckpt_scheduler_step(s)) < 0) fail(c->name, rc);
        printf("sched %s %d %.17g %.17g\n", c->name, t, ckpt_optimizer_get_lr(o, 0),
               ckpt_optimizer_get_lr(o, 1));
    }
    ckpt_scheduler_free(s);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

/* Loss scaling with SGD: gradients are produced scaled (as backward of a
 * scaled loss) and some steps get an inf or NaN. */
static void run_scaler(void) {
    init_params();
    ckpt_model *m = make_model();
    ckpt_optimizer *o;
    int rc = ckpt_sgd_new(&o, m, 0.1, 0.9, 0, false);
    if (rc < 0) fail("scaler sgd", rc);
    ckpt_grad_scaler *gs;
    if ((rc = ckpt_grad_scaler_new(&gs, 1024.0, 2.0, 0.5, 3)) < 0) fail("scaler", rc);
    for (int t = 1; t <= STEPS; t++) {
        make_grads(t);
        float scale = (float)ckpt_grad_scaler_scale(gs);
        for (int j = 0; j < NW; j++) gw[j] *= scale;
        for (int j = 0; j < NB; j++) gb[j] *= scale;
        if (t % 7 == 3) gw[t % NW] = INFINITY;
        if (t == 20 || t == 21) gb[2] = NAN;
        bool stepped;
        if ((rc = ckpt_grad_scaler_step(gs, o, &stepped)) < 0) fail("scaler step", rc);
        if ((rc = ckpt_grad_scaler_update(gs)) < 0) fail("scaler update", rc);
        printf("scaler %d %.9g %d", t, ckpt_grad_scaler_scale(gs), stepped ? 1 : 0);
        print_params();
    }
    ckpt_grad_scaler_free(gs);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

static void write_model(const char *path) {
    init_params();
    ckpt_model *m = make_model();
    ckpt_writer *wr;
    int rc = ckpt_writer_new(&wr);
    if (rc < 0) fail("writer", rc);
    if ((rc = ckpt_model_ops()->state_dict(m, wr)) < 0) fail("model state_dict", rc);
    if ((rc = ckpt_writer_save(wr, path)) < 0) fail("model save", rc);
    ckpt_writer_free(wr);
    ckpt_model_free(m);
}

int main(int argc, char **argv) {
    const ckpt_optim_options NONE = ckpt_optim_defaults(CKPT_OPTIM_SGD);
    const opt_config opts[] = {
        {"sgd_plain", CKPT_OPTIM_SGD, sgd(0.1, 0, 0, 0, false, false), false, NONE},
        {"sgd_momentum", CKPT_OPTIM_SGD, sgd(0.05, 0.9, 0, 0, false, false), false, NONE},
        {"sgd_nesterov", CKPT_OPTIM_SGD, sgd(0.05, 0.9, 0, 0, true, false), false, NONE},
        {"sgd_dampening", CKPT_OPTIM_SGD, sgd(0.05, 0.9, 0.3, 0, false, false), false, NONE},
        {"sgd_weight_decay", CKPT_OPTIM_SGD, sgd(0.05, 0.5, 0, 0.01, false, false), false, NONE},
        {"sgd_maximize", CKPT_OPTIM_SGD, sgd(0.01, 0.9, 0, 0.1, false, true), false, NONE},
        {"adam", CKPT_OPTIM_ADAM, adam(CKPT_OPTIM_ADAM, 1e-2, 0, false, false), false, NONE},
        {"adam_l2", CKPT_OPTIM_ADAM, adam(CKPT_OPTIM_ADAM, 1e-2, 0.1, false, false), false, NONE},
        {"adam_maximize", CKPT_OPTIM_ADAM, adam(CKPT_OPTIM_ADAM, 1e-2, 0, false, true), false,
         NONE},
        {"adamw", CKPT_OPTIM_ADAMW, adam(CKPT_OPTIM_ADAMW, 1e-2, 0.01, false, false), false, NONE},
        {"adamw_amsgrad", CKPT_OPTIM_ADAMW, adam(CKPT_OPTIM_ADAMW, 1e-2, 0.01, true, false), false,
         NONE},
        {"adamw_two_groups", CKPT_OPTIM_ADAMW, adam(CKPT_OPTIM_ADAMW, 1e-2, 0.01, false, false),
         true, adam(CKPT_OPTIM_ADAMW, 5e-3, 0, true, false)},
        {"sgd_two_groups", CKPT_OPTIM_SGD, sgd(0.05, 0.9, 0, 0, true, false), true,
         sgd(0.1, 0, 0, 0.01, false, false)},
    };
    for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) run_optimizer(&opts[i]);
    const sched_config scheds[] = {
        {"steplr", 0, 7, 0, 0.5, 0},         {"multisteplr", 1, 0, 0, 0.3, 0},
        {"exponentiallr", 2, 0, 0, 0.93, 0}, {"cosinelr", 3, 12, 0, 0, 0.001},
        {"warmup_cosine", 4, 5, 40, 0, 0},   {"warmup_linear", 5, 5, 40, 0, 0},
        {"constant", 6, 0, 0, 0, 0},         {"constant_warmup", 6, 7, 0, 0, 0},
    };
    for (size_t i = 0; i < sizeof scheds / sizeof scheds[0]; i++) run_scheduler(&scheds[i]);
    run_scaler();
    if (argc > 1) write_model(argv[1]);
    return 0;
}
