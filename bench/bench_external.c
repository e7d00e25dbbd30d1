/* bench_external.c — a trainer's own optimizer state saved through ckpt, at
 * GPT-2 small's size, against ckpt's own optimizer's, each as a ratio to a
 * raw write + fsync of the same bytes measured in the same run:
 *
 *   own:      GPT-2 small's 148 tensors in fp32 (124,439,808 elements) and
 *             ckpt's AdamW over them (exp_avg, exp_avg_sq; one step taken):
 *             ~1.49 GB.
 *   external: the same tensors in BF16, in one parameter block as llm.c keeps
 *             them, with an external AdamW (ckpt_optimizer_external_new)
 *             whose fp32 master, exp_avg and exp_avg_sq live in the caller's
 *             three blocks (ckpt_optimizer_set_state_block, master_weights):
 *             ~1.74 GB.
 *
 *   external behind memory ops: the same four blocks, but every tensor
 *             registered behind ckpt_memory_ops (ckpt_model_add_param_mem,
 *             ckpt_optimizer_set_state_mem) whose to_host is a memcpy from
 *             host memory: what the indirection itself costs (the bounce
 *             buffer the pieces go through), without a device's transfer.
 *
 *   save: ckpt_save_state to the next automatic checkpoint (the full durable
 *   commit)  vs  dd conv=fsync of the checkpoint's bytes right after it. The
 *   three states live side by side and are measured in turn, five rounds;
 *   each save's ratio is taken against its own dd (save/dd: dd's time over
 *   the save's), and each round's external ratios against that round's own
 *   ratio, so that the drift of a shared disk cancels; medians of 5.
 *
 *   bench_external FOLDER
 *
 * FOLDER is a scratch folder on the disk to measure; what is written there is
 * removed at the end. */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#define BENCH_NAME "bench_external"
#include "bench_util.h"
#include "gpt2.h"

enum { NV = 3, REPS = 5 }; /* the states; the rounds */

static void shell(const char *cmd) {
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_external: command failed: %s\n", cmd);
        exit(1);
    }
}

static void *xcalloc(size_t n, size_t size) {
    void *p = calloc(n ? n : 1, size);
    if (!p) {
        fprintf(stderr, "bench_external: out of memory\n");
        exit(1);
    }
    return p;
}

typedef struct {
    char name[64];
    int ndim;
    int64_t shape[2], numel, at; /* at: its first element in the block */
} tensor;

static tensor T[MAXP];
static int nt;
static int64_t total;

static void add(const char *name, int ndim, int64_t a, int64_t b) {
    tensor *t = &T[nt++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = a;
    t->shape[1] = b;
    t->numel = ndim == 1 ? a : a * b;
    t->at = total;
    total += t->numel;
}

/* The bytes of the files of a checkpoint folder. */
static uint64_t folder_bytes(const char *dir) {
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "du -sb --apparent-size '%s'", dir);
    FILE *f = popen(cmd, "r");
    unsigned long long n = 0;
    if (!f || fscanf(f, "%llu", &n) != 1) {
        fprintf(stderr, "bench_external: du failed\n");
        exit(1);
    }
    pclose(f);
    return n;
}

/* One save of acc's state and one dd of the same bytes, timed; the
 * checkpoint is removed after. */
static void measure_once(ckpt_accelerator *acc, const char *dd, double *t_save, double *t_dd,
                         uint64_t *bytes) {
    char cmd[8400], last[4096];
    shell("sync");
    double t0 = now();
    if (ckpt_save_state(acc, NULL)) die("save_state");
    *t_save = now() - t0;
    snprintf(last, sizeof last, "%s", ckpt_accelerator_last_dir(acc));
    *bytes = folder_bytes(last);
    snprintf(cmd, sizeof cmd,
             "dd if=/dev/zero of='%s' bs=1M count=%llu iflag=count_bytes conv=fsync status=none",
             dd, (unsigned long long)*bytes);
    unlink(dd);
    shell("sync");
    t0 = now();
    shell(cmd);
    *t_dd = now() - t0;
    unlink(dd);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", last);
    shell(cmd);
}

/* Memory ops over host memory: the handle is the tensor's address. */
static int host_to_host(void *handle, uint64_t offset, void *dst, uint64_t n) {
    memcpy(dst, (const char *)handle + offset, (size_t)n);
    return 0;
}
static int host_from_host(void *handle, uint64_t offset, const void *src, uint64_t n) {
    memcpy((char *)handle + offset, src, (size_t)n);
    return 0;
}
static const ckpt_memory_ops host_ops = {host_to_host, host_from_host};

static ckpt_accelerator *accelerator(const char *proj, ckpt_model *m, ckpt_optimizer *o) {
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.no_link_unchanged = true; /* every save writes every byte */
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (ckpt_prepare_model(acc, m) || ckpt_prepare_optimizer(acc, o)) die("prepare");
    return acc;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: bench_external FOLDER\n");
        return 2;
    }
    char proj[NV][4096], dd[4096], cmd[12600];
    for (int k = 0; k < NV; k++)
        snprintf(proj[k], sizeof proj[k], "%s/external_%s", argv[1],
                 (const char *[]){"own", "ext", "mem"}[k]);
    snprintf(dd, sizeof dd, "%s/external_dd.bin", argv[1]);
    gpt2_small_each(add);
    if (total != GPT2_SMALL_PARAMS) {
        fprintf(stderr, "bench_external: %lld parameters\n", (long long)total);
        return 1;
    }
    size_t n = (size_t)total;

    /* ---- ckpt's own AdamW over fp32 parameters ---- */
    float *w = xcalloc(n, 4), *g = xcalloc(n, 4);
    for (size_t i = 0; i < n; i++) {
        w[i] = (float)(i % 1000) * 1e-3f;
        g[i] = (float)(i % 7) * 1e-2f;
    }
    ckpt_model *m[NV];
    ckpt_optimizer *o[NV];
    ckpt_accelerator *acc[NV];
    if (ckpt_model_new(&m[0])) die("model_new");
    for (int i = 0; i < nt; i++)
        if (ckpt_model_add_param(m[0], T[i].name, CKPT_F32, T[i].ndim, T[i].shape, w + T[i].at,
                                 g + T[i].at))
            die("add_param");
    if (ckpt_adamw_new(&o[0], m[0], 1e-3, 0.9, 0.999, 1e-8, 0.01)) die("adamw_new");
    if (ckpt_optimizer_step(o[0])) die("step");
    acc[0] = accelerator(proj[0], m[0], o[0]);

    /* ---- an external AdamW: BF16 block, fp32 master, exp_avg, exp_avg_sq ---- */
    uint16_t *hw = xcalloc(n, 2);
    float *master = xcalloc(n, 4), *mo = xcalloc(n, 4), *v = xcalloc(n, 4);
    for (size_t i = 0; i < n; i++) {
        master[i] = (float)(i % 1000) * 1e-3f;
        mo[i] = (float)(i % 13) * 1e-4f;
        v[i] = (float)(i % 17) * 1e-6f;
    }
    if (ckpt_dtype_convert(CKPT_F32, master, CKPT_BF16, hw, n)) die("convert");
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    op.master_weights = true;
    for (int k = 1; k < NV; k++) {
        bool mem = k == 2; /* the same blocks, behind memory ops */
        if (ckpt_model_new(&m[k])) die("model_new");
        for (int i = 0; i < nt; i++)
            if (mem ? ckpt_model_add_param_mem(m[k], T[i].name, CKPT_BF16, T[i].ndim, T[i].shape,
                                               &host_ops, hw + T[i].at)
                    : ckpt_model_add_param(m[k], T[i].name, CKPT_BF16, T[i].ndim, T[i].shape,
                                           hw + T[i].at, NULL))
                die("add_param");
        if (ckpt_optimizer_external_new(&o[k], CKPT_OPTIM_ADAMW, m[k], &op)) die("external_new");
        if (!mem && (ckpt_optimizer_set_state_block(o[k], "master", master, hw) ||
                     ckpt_optimizer_set_state_block(o[k], "exp_avg", mo, hw) ||
                     ckpt_optimizer_set_state_block(o[k], "exp_avg_sq", v, hw)))
            die("set_state_block");
        for (int i = 0; mem && i < nt; i++)
            if (ckpt_optimizer_set_state_mem(o[k], T[i].name, "master", &host_ops,
                                             master + T[i].at) ||
                ckpt_optimizer_set_state_mem(o[k], T[i].name, "exp_avg", &host_ops, mo + T[i].at) ||
                ckpt_optimizer_set_state_mem(o[k], T[i].name, "exp_avg_sq", &host_ops, v + T[i].at))
                die("set_state_mem");
        if (ckpt_optimizer_set_step(o[k], 1)) die("set_step");
        acc[k] = accelerator(proj[k], m[k], o[k]);
    }

    /* ---- rounds: each state saved, then dd of its bytes, in turn ---- */
    double save[NV][REPS], ddt[NV][REPS], ratio[NV][REPS], rel[NV][REPS];
    uint64_t bytes[NV];
    for (int r = 0; r < REPS; r++)
        for (int k = 0; k < NV; k++) {
            measure_once(acc[k], dd, &save[k][r], &ddt[k][r], &bytes[k]);
            ratio[k][r] = ddt[k][r] / save[k][r];
        }
    for (int r = 0; r < REPS; r++)
        for (int k = 0; k < NV; k++) rel[k][r] = ratio[k][r] / ratio[0][r];
    for (int k = 0; k < NV; k++) {
        ckpt_accelerator_free(acc[k]);
        ckpt_optimizer_free(o[k]);
        ckpt_model_free(m[k]);
    }
    free(w);
    free(g);
    free(hw);
    free(master);
    free(mo);
    free(v);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s' '%s'", proj[0], proj[1], proj[2]);
    shell(cmd);

    static const char *const label[NV] = {
        "own AdamW, fp32:            ", "external AdamW, bf16+master:",
        "external, behind memory ops:"};
    printf("bench_external: GPT-2 small, %d tensors, %lld params, medians of %d rounds:\n", nt,
           (long long)total, REPS);
    for (int k = 0; k < NV; k++) {
        double gb = (double)bytes[k] / 1e9, ts = median(save[k], REPS), td = median(ddt[k], REPS);
        printf("  %s  %.3f GB  save %6.3f s (%5.2f GB/s)  dd %6.3f s  save/dd %.2fx\n", label[k],
               gb, ts, gb / ts, td, median(ratio[k], REPS));
    }
    printf("  external's ratio / own's ratio: %.2f (1: the same cost relative to the disk)\n",
           median(rel[1], REPS));
    printf("  behind memory ops, ratio / own's ratio: %.2f\n", median(rel[2], REPS));
    return 0;
}
