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
 *   save: ckpt_save_state to the next automatic checkpoint (the full durable
 *   commit)  vs  dd conv=fsync of the checkpoint's bytes. Best of 3,
 *   interleaved; the two states one after the other (one in memory at a
 *   time).
 *
 *   bench_external FOLDER
 *
 * FOLDER is a scratch folder on the disk to measure; what is written there is
 * removed at the end. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "gpt2.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void die(const char *what) {
    fprintf(stderr, "bench_external: %s: %s\n", what, ckpt_errmsg());
    exit(1);
}

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

/* Saves acc's state 3 times, each followed by dd of the same bytes; the best
 * of each. */
static void measure(ckpt_accelerator *acc, const char *dd, double *t_save, double *t_dd,
                    uint64_t *bytes) {
    char cmd[8400], last[4096] = "";
    *t_save = *t_dd = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        if (last[0]) {
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", last);
            shell(cmd);
        }
        shell("sync");
        double t0 = now();
        if (ckpt_save_state(acc, NULL)) die("save_state");
        double t = now() - t0;
        if (t < *t_save) *t_save = t;
        snprintf(last, sizeof last, "%s", ckpt_accelerator_last_dir(acc));
        *bytes = folder_bytes(last);
        snprintf(
            cmd, sizeof cmd,
            "dd if=/dev/zero of='%s' bs=1M count=%llu iflag=count_bytes conv=fsync status=none", dd,
            (unsigned long long)*bytes);
        unlink(dd);
        shell("sync");
        t0 = now();
        shell(cmd);
        t = now() - t0;
        unlink(dd);
        if (t < *t_dd) *t_dd = t;
    }
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", last);
    shell(cmd);
}

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
    char proj_own[4096], proj_ext[4096], dd[4096], cmd[8400];
    snprintf(proj_own, sizeof proj_own, "%s/external_own", argv[1]);
    snprintf(proj_ext, sizeof proj_ext, "%s/external_ext", argv[1]);
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
    ckpt_model *m;
    if (ckpt_model_new(&m)) die("model_new");
    for (int i = 0; i < nt; i++)
        if (ckpt_model_add_param(m, T[i].name, CKPT_F32, T[i].ndim, T[i].shape, w + T[i].at,
                                 g + T[i].at))
            die("add_param");
    ckpt_optimizer *o;
    if (ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0.01)) die("adamw_new");
    if (ckpt_optimizer_step(o)) die("step");
    ckpt_accelerator *acc = accelerator(proj_own, m, o);
    double own_save, own_dd;
    uint64_t own_bytes;
    measure(acc, dd, &own_save, &own_dd, &own_bytes);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    free(w);
    free(g);

    /* ---- an external AdamW: BF16 block, fp32 master, exp_avg, exp_avg_sq ---- */
    uint16_t *hw = xcalloc(n, 2);
    float *master = xcalloc(n, 4), *mo = xcalloc(n, 4), *v = xcalloc(n, 4);
    for (size_t i = 0; i < n; i++) {
        master[i] = (float)(i % 1000) * 1e-3f;
        mo[i] = (float)(i % 13) * 1e-4f;
        v[i] = (float)(i % 17) * 1e-6f;
    }
    if (ckpt_dtype_convert(CKPT_F32, master, CKPT_BF16, hw, n)) die("convert");
    if (ckpt_model_new(&m)) die("model_new");
    for (int i = 0; i < nt; i++)
        if (ckpt_model_add_param(m, T[i].name, CKPT_BF16, T[i].ndim, T[i].shape, hw + T[i].at,
                                 NULL))
            die("add_param");
    ckpt_optim_options op = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    op.master_weights = true;
    if (ckpt_optimizer_external_new(&o, CKPT_OPTIM_ADAMW, m, &op)) die("external_new");
    if (ckpt_optimizer_set_state_block(o, "master", master, hw) ||
        ckpt_optimizer_set_state_block(o, "exp_avg", mo, hw) ||
        ckpt_optimizer_set_state_block(o, "exp_avg_sq", v, hw))
        die("set_state_block");
    if (ckpt_optimizer_set_step(o, 1)) die("set_step");
    acc = accelerator(proj_ext, m, o);
    double ext_save, ext_dd;
    uint64_t ext_bytes;
    measure(acc, dd, &ext_save, &ext_dd, &ext_bytes);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    free(hw);
    free(master);
    free(mo);
    free(v);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' '%s'", proj_own, proj_ext);
    shell(cmd);

    double go = (double)own_bytes / 1e9, ge = (double)ext_bytes / 1e9;
    printf("bench_external: GPT-2 small, %d tensors, %lld params, best of 3:\n", nt,
           (long long)total);
    printf("  own AdamW, fp32:              %.3f GB  save %6.3f s (%5.2f GB/s)  dd %6.3f s  "
           "save/dd %.2fx\n",
           go, own_save, go / own_save, own_dd, own_dd / own_save);
    printf("  external AdamW, bf16+master:  %.3f GB  save %6.3f s (%5.2f GB/s)  dd %6.3f s  "
           "save/dd %.2fx\n",
           ge, ext_save, ge / ext_save, ext_dd, ext_dd / ext_save);
    printf("  external's ratio / own's ratio: %.2f (1: the same cost relative to the disk)\n",
           (ext_dd / ext_save) / (own_dd / own_save));
    return 0;
}
