/* bench_loadmem.c — the memory a load leaves behind (issue 37): counts
 * bytes, times nothing.
 *
 * A 384 MiB state: a model of 128 MiB of fp32 parameters (32 tensors of
 * 4 MiB) and ckpt's AdamW over it (exp_avg, exp_avg_sq: 256 MiB). It is
 * saved once; then a new accelerator over the same objects (a resumed run)
 * loads it, and VmRSS (/proc/self/status) is read before and after each
 * call below, and VmHWM, reset just before the call (5 into
 * /proc/self/clear_refs), for the call's peak:
 *
 *   load        ckpt_load_state of the checkpoint, the first of the process
 *   load again  the same, a second time
 *   one pass    ckpt_load_state_ex with one_pass
 *   two passes  ckpt_load_state_ex with non_strict (an adapting option:
 *               every file read into a buffer area, then the objects read
 *               from it; the area is given back at the end of the load)
 *   save        ckpt_save_state after the loads
 *   free        ckpt_accelerator_free
 *
 * and, on another accelerator, ckpt_accelerator_prepare_async (its staging
 * area stays by design) followed by a load. Each line gives the call's
 * RSS after minus before ("kept") and its peak minus before; the target
 * (issue 37) is that a load keeps at most 16 MiB. Exit status 1 if a load
 * kept more.
 *
 *   bench_loadmem FOLDER */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#define BENCH_NAME "bench_loadmem"
#define BENCH_DIE_CODE 2
#include "bench_util.h"

#define NT 32
#define TENSOR_FLOATS ((int64_t)1 << 20) /* 4 MiB */

/* This process's resident set and its peak (KiB). */
static void rss_hwm(long *rss, long *hwm) {
    *rss = status_kib("VmRSS");
    *hwm = status_kib("VmHWM");
}

static void reset_hwm(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return;
    fputs("5\n", f);
    fclose(f);
}

typedef struct {
    long before, after, peak;
} mem;

static mem begin(void) {
    mem m;
    long hwm;
    reset_hwm();
    rss_hwm(&m.before, &hwm);
    return m;
}

static void end(mem *m) { rss_hwm(&m->after, &m->peak); }

static void show(const char *what, const mem *m, bool is_load, int *bad) {
    double kept = (double)(m->after - m->before) / 1024.0;
    double peak = (double)(m->peak - m->before) / 1024.0;
    bool over = is_load && kept > 16.0;
    if (over) (*bad)++;
    printf("  %-32s kept %+9.1f MiB   peak %+9.1f MiB%s\n", what, kept, peak,
           is_load ? (over ? "   (target <= +16 MiB: NOT met)" : "   (target <= +16 MiB: met)")
                   : "");
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_loadmem FOLDER\n");
        return 2;
    }
    char proj[4096], cmd[4200];
    snprintf(proj, sizeof proj, "%.4000s/loadmem_project", argv[1]);

    float *w = malloc((size_t)NT * TENSOR_FLOATS * sizeof(float));
    float *g = malloc((size_t)NT * TENSOR_FLOATS * sizeof(float));
    if (!w || !g) die("malloc");
    for (int64_t k = 0; k < NT * TENSOR_FLOATS; k++) {
        w[k] = (float)(k % 1000) * 1e-3f;
        g[k] = (float)(k % 7) * 1e-3f;
    }
    ckpt_model *model;
    if (ckpt_model_new(&model)) die("model_new");
    for (int i = 0; i < NT; i++) {
        char name[64];
        snprintf(name, sizeof name, "layers.%d.weight", i);
        if (ckpt_model_add_param(model, name, CKPT_F32, 1, (int64_t[]){TENSOR_FLOATS},
                                 w + i * TENSOR_FLOATS, g + i * TENSOR_FLOATS))
            die("add_param");
    }
    ckpt_optimizer *opt;
    if (ckpt_adamw_new(&opt, model, 1e-3, 0.9, 0.999, 1e-8, 0.01) || ckpt_optimizer_step(opt))
        die("adamw");
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (ckpt_prepare_model(acc, model) || ckpt_prepare_optimizer(acc, opt)) die("prepare");
    if (ckpt_save_state(acc, NULL)) die("save");
    ckpt_accelerator_free(acc);

    int bad = 0;
    printf("bench_loadmem: %d x 4 MiB fp32 parameters + AdamW (384 MiB of state), resident "
           "set of each call (after - before) and its peak\n",
           NT);
    ckpt_load_options one;
    memset(&one, 0, sizeof one);
    one.one_pass = true;
    ckpt_load_options two;
    memset(&two, 0, sizeof two);
    two.non_strict = true; /* an adapting option: the two passes */
    for (int k = 0; k < 2; k++) {
        if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
        if (ckpt_prepare_model(acc, model) || ckpt_prepare_optimizer(acc, opt)) die("prepare");
        mem m;
        if (k == 1) {
            m = begin();
            if (ckpt_accelerator_prepare_async(acc) || ckpt_save_wait(acc)) die("prepare_async");
            end(&m);
            show("prepare_async (staging area)", &m, false, &bad);
        }
        m = begin();
        if (ckpt_load_state(acc, NULL)) die("load");
        end(&m);
        show(k ? "load after prepare_async" : "load (first of the process)", &m, true, &bad);
        if (k == 1) {
            m = begin();
            ckpt_accelerator_free(acc);
            end(&m);
            show("free", &m, false, &bad);
            break;
        }
        m = begin();
        if (ckpt_load_state(acc, NULL)) die("load");
        end(&m);
        show("load again", &m, true, &bad);
        m = begin();
        if (ckpt_load_state_ex(acc, NULL, &one, NULL)) die("one-pass load");
        end(&m);
        show("one-pass load", &m, true, &bad);
        m = begin();
        if (ckpt_load_state_ex(acc, NULL, &two, NULL)) die("two-pass load");
        end(&m);
        show("two-pass load (non_strict)", &m, true, &bad);
        m = begin();
        if (ckpt_save_state(acc, NULL)) die("save");
        if (ckpt_save_wait(acc)) die("save_wait");
        end(&m);
        show("save (after the loads)", &m, false, &bad);
        m = begin();
        ckpt_accelerator_free(acc);
        end(&m);
        show("free", &m, false, &bad);
    }
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    free(w);
    free(g);
    snprintf(cmd, sizeof cmd, "rm -rf '%.4000s'", proj);
    if (system(cmd) != 0) fprintf(stderr, "bench_loadmem: could not remove %s\n", proj);
    return bad ? 1 : 0;
}
