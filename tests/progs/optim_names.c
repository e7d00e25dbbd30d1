/* optim_names — the C side of tests/python/test_torch_param_names.py: a
 * model whose parameters are registered in the order given (not
 * necessarily torch's), an AdamW optimizer over them, a load of a
 * checkpoint (one made by `ckpt import`), then the optimizer's state dict
 * written out, which names each state index's parameter, so the test can
 * check that every parameter got its own moments.
 *
 *   optim_names [--by-position] CHECKPOINT OUT NAME:D0xD1.. ...
 *
 * --by-position allows state without parameter names to load by position
 * (ckpt_optimizer_set_match_by_position). A failed load prints the error
 * on stderr and exits 3; bad usage exits 2. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

#define MAXP 16

static int fail(const char *what, int rc) {
    fprintf(stderr, "optim_names: %s: %s: %s\n", what, ckpt_strerror(rc), ckpt_errmsg());
    return 3;
}

/* "name:4x3" into name (cut in place), ndim and shape; false if malformed. */
static int parse_param(char *arg, int *ndim, int64_t *shape) {
    char *colon = strrchr(arg, ':');
    if (!colon) return 0;
    *colon = '\0';
    *ndim = 0;
    for (char *p = colon + 1; *p;) {
        char *end;
        long v = strtol(p, &end, 10);
        if (end == p || v < 0 || *ndim == CKPT_MAX_NDIM) return 0;
        shape[(*ndim)++] = v;
        p = *end == 'x' ? end + 1 : end;
        if (*end && *end != 'x') return 0;
    }
    return 1;
}

int main(int argc, char **argv) {
    int a = 1;
    int by_position = argc > 1 && strcmp(argv[1], "--by-position") == 0;
    a += by_position;
    if (argc - a < 3 || argc - a - 2 > MAXP) {
        fprintf(stderr, "usage: optim_names [--by-position] CHECKPOINT OUT NAME:D0xD1.. ...\n");
        return 2;
    }
    const char *dir = argv[a], *out = argv[a + 1];
    int np = argc - a - 2;
    float *data[MAXP] = {0}, *grad[MAXP] = {0};
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_writer *w = NULL;
    int code = 0, rc = ckpt_model_new(&m);
    for (int i = 0; i < np && rc == 0; i++) {
        int ndim;
        int64_t shape[CKPT_MAX_NDIM], n = 1;
        if (!parse_param(argv[a + 2 + i], &ndim, shape)) {
            fprintf(stderr, "optim_names: bad parameter '%s' (NAME:D0xD1..)\n", argv[a + 2 + i]);
            code = 2;
            break;
        }
        for (int d = 0; d < ndim; d++) n *= shape[d];
        data[i] = calloc((size_t)n + 1, sizeof(float));
        grad[i] = calloc((size_t)n + 1, sizeof(float));
        if (!data[i] || !grad[i]) rc = CKPT_ENOMEM;
        else rc = ckpt_model_add_param(m, argv[a + 2 + i], CKPT_F32, ndim, shape, data[i], grad[i]);
    }
    if (code == 0 && rc == 0) {
        ckpt_optim_options opt = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
        rc = ckpt_optimizer_new(&o, CKPT_OPTIM_ADAMW, m, &opt);
    }
    if (code == 0 && rc == 0) {
        ckpt_optimizer_set_match_by_position(o, by_position);
        ckpt_project_config cfg;
        memset(&cfg, 0, sizeof cfg);
        rc = ckpt_accelerator_new(&acc, &cfg);
        if (rc == 0) rc = ckpt_prepare_model(acc, m);
        if (rc == 0) rc = ckpt_prepare_optimizer(acc, o);
        if (rc < 0) code = fail("setup", rc);
    } else if (code == 0) {
        code = fail("setup", rc);
    }
    if (code == 0 && (rc = ckpt_load_state(acc, dir)) < 0) code = fail("load", rc);
    if (code == 0) {
        rc = ckpt_writer_new(&w);
        if (rc == 0) rc = ckpt_optimizer_ops()->state_dict(o, w);
        if (rc == 0) rc = ckpt_writer_save(w, out);
        if (rc < 0) code = fail("write", rc);
    }
    ckpt_writer_free(w);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    for (int i = 0; i < np; i++) free(data[i]), free(grad[i]);
    return code;
}
