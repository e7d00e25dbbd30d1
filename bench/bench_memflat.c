/* bench_memflat.c — host memory stays flat over many saves and loads
 * (issue 25): counts bytes, times nothing.
 *
 * A model of MIB MiB of fp32 parameters (tensors of 4 MiB) and an AdamW
 * optimizer over a small second model (so the optimizer's own state is
 * saved too), on an accelerator with total_limit 2, then three phases of N
 * operations each:
 *
 *   async   ckpt_save_state_async, one parameter changed before each (the
 *           next call waits for the previous save)
 *   sync    ckpt_save_state
 *   load    ckpt_load_state of the newest checkpoint
 *
 * For each phase, VmRSS and VmHWM (/proc/self/status) after the 10th
 * operation (settled: the save waited for) and after the last; a phase
 * passes if both end within 1 MiB of their value after the 10th. Exit
 * status 1 if any phase grew, 0 if all stayed flat.
 *
 *   bench_memflat FOLDER [MIB] [N]      (defaults: 100 MiB, 1000)
 *
 * `make memflat` runs it on a release build with the defaults (the issue's
 * figure: 1,000 saves of a ~100 MB state); tests/unit/test_memflat.c runs
 * the same phases on a smaller state under the sanitizers. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#define BENCH_NAME "bench_memflat"
#define BENCH_DIE_CODE 2
#include "bench_util.h"

#define TENSOR_FLOATS ((int64_t)1 << 20) /* 4 MiB */

typedef struct phase {
    const char *name;
    long rss10, hwm10, rss_end, hwm_end;
} phase;

/* This process's resident set and its peak (KiB). */
static void rss_hwm(long *rss, long *hwm) {
    *rss = status_kib("VmRSS");
    *hwm = status_kib("VmHWM");
}

static bool flat(const phase *p) {
    return p->rss_end <= p->rss10 + 1024 && p->hwm_end <= p->hwm10 + 1024;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_memflat FOLDER [MiB] [N]\n");
        return 2;
    }
    long mib = argc > 2 ? atol(argv[2]) : 100;
    long n = argc > 3 ? atol(argv[3]) : 1000;
    if (mib < 4) mib = 4;
    if (n < 11) n = 11;
    char proj[4096];
    snprintf(proj, sizeof proj, "%s/memflat_project", argv[1]);

    int nt = (int)(mib / 4);
    float **w = calloc((size_t)nt, sizeof *w);
    ckpt_model *model, *small;
    if (!w || ckpt_model_new(&model) || ckpt_model_new(&small)) die("model_new");
    for (int i = 0; i < nt; i++) {
        w[i] = malloc((size_t)TENSOR_FLOATS * sizeof(float));
        if (!w[i]) die("malloc");
        for (int64_t k = 0; k < TENSOR_FLOATS; k++) w[i][k] = (float)(k % 1000) * 1e-3f + (float)i;
        char name[64];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        if (ckpt_model_add_param(model, name, CKPT_F32, 1, (int64_t[]){TENSOR_FLOATS}, w[i], NULL))
            die("add_param");
    }
    static float sp[4096], sg[4096];
    for (int k = 0; k < 4096; k++) sg[k] = 1e-3f * (float)(k % 7);
    if (ckpt_model_add_param(small, "head.weight", CKPT_F32, 1, (int64_t[]){4096}, sp, sg))
        die("add_param");
    ckpt_optimizer *opt;
    if (ckpt_adamw_new(&opt, small, 1e-3, 0.9, 0.999, 1e-8, 0.01) || ckpt_optimizer_step(opt))
        die("adamw");
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 2;
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (ckpt_prepare_model(acc, model) || ckpt_prepare_model(acc, small) ||
        ckpt_prepare_optimizer(acc, opt))
        die("prepare");
    if (ckpt_accelerator_prepare_async(acc)) die("prepare_async");

    phase ph[3] = {{"async save", 0, 0, 0, 0}, {"sync save", 0, 0, 0, 0}, {"load", 0, 0, 0, 0}};
    for (int p = 0; p < 3; p++) {
        for (long i = 1; i <= n; i++) {
            int rc = 0;
            if (p < 2) {
                w[i % nt][i % TENSOR_FLOATS] += 1.0f;
                ckpt_accelerator_set_step(acc, p * n + i);
                rc = p == 0 ? ckpt_save_state_async(acc, NULL) : ckpt_save_state(acc, NULL);
            } else {
                rc = ckpt_load_state(acc, NULL);
            }
            if (rc) die(ph[p].name);
            if (i == 10 || i == n) {
                if (ckpt_save_wait(acc)) die("save_wait");
                rss_hwm(i == 10 ? &ph[p].rss10 : &ph[p].rss_end,
                        i == 10 ? &ph[p].hwm10 : &ph[p].hwm_end);
            }
        }
    }
    printf("bench_memflat: %d x 4 MiB tensors (%.1f MB of model) + AdamW state, total_limit 2, "
           "%ld operations per phase\n",
           nt, (double)nt * 4 * 1048576 / 1e6, n);
    int bad = 0;
    for (int p = 0; p < 3; p++) {
        printf("  %-10s VmRSS after #10 %8.1f MiB, after #%ld %8.1f MiB (%+.2f MiB); "
               "VmHWM %8.1f -> %8.1f MiB (%+.2f)  %s\n",
               ph[p].name, ph[p].rss10 / 1024.0, n, ph[p].rss_end / 1024.0,
               (ph[p].rss_end - ph[p].rss10) / 1024.0, ph[p].hwm10 / 1024.0, ph[p].hwm_end / 1024.0,
               (ph[p].hwm_end - ph[p].hwm10) / 1024.0, flat(&ph[p]) ? "flat" : "GREW (> 1 MiB)");
        bad += !flat(&ph[p]);
    }
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    ckpt_model_free(small);
    for (int i = 0; i < nt; i++) free(w[i]);
    free(w);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", proj);
    if (system(cmd) != 0) fprintf(stderr, "bench_memflat: could not remove %s\n", proj);
    return bad ? 1 : 0;
}
