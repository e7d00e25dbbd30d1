/* bench_flexload.c — what the layouts and loads added for issues 13 and 14
 * cost, as ratios against the plain path measured in the same run:
 *
 *   state: a model of 64 F32 tensors of 8 MiB (512 MiB), on an accelerator.
 *   save:  ckpt_save_state with max_shard_size 100 MB (Hugging Face shards +
 *          index) vs without (one model.safetensors); both durable.
 *   load:  ckpt_load_state of the sharded checkpoint vs of the plain one;
 *          ckpt_load_state_ex with a prefix map renaming every key (an
 *          adapted reader of views) vs the plain load; the same checkpoint
 *          into a BF16 model with convert_dtypes vs the plain F32 load (the
 *          conversion reads 512 MiB and writes 256 MiB more than a copy);
 *          ckpt_model_load_weights from the checkpoint vs the plain load.
 *   Median of 5 runs each, interleaved, page cache warm.
 *
 *   bench_flexload FOLDER      (everything written there is removed) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"

#define NT 64
#define NE (2 * 1024 * 1024) /* floats a tensor: 8 MiB */
#define RUNS 5

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void check(int rc, const char *what) {
    if (rc == 0) return;
    fprintf(stderr, "bench_flexload: %s: %s\n", what, ckpt_errmsg());
    exit(1);
}

typedef struct run {
    ckpt_accelerator *acc;
    ckpt_model *m;
    void *buf[NT];
} run;

static void run_open(run *r, const char *proj, uint64_t max_shard, ckpt_dtype dt, const char *prefix) {
    memset(r, 0, sizeof *r);
    ckpt_project_config cfg = {.project_dir = proj, .automatic_checkpoint_naming = true,
                               .max_shard_size = max_shard, .total_limit = 1};
    check(ckpt_accelerator_new(&r->acc, &cfg), "accelerator");
    check(ckpt_model_new(&r->m), "model");
    int64_t shape[1] = {NE};
    size_t es = dt == CKPT_F32 ? 4 : 2;
    for (int i = 0; i < NT; i++) {
        char name[64];
        snprintf(name, sizeof name, "%slayers.%d.weight", prefix, i);
        r->buf[i] = malloc((size_t)NE * es);
        if (!r->buf[i]) exit(1);
        if (dt == CKPT_F32)
            for (int j = 0; j < NE; j++) ((float *)r->buf[i])[j] = 0.001f * (float)((i * 7 + j) % 1000);
        else memset(r->buf[i], 0, (size_t)NE * es);
        check(ckpt_model_add_param(r->m, name, dt, 1, shape, r->buf[i], NULL), "param");
    }
    check(ckpt_prepare_model(r->acc, r->m), "prepare");
}

static void run_close(run *r) {
    ckpt_accelerator_free(r->acc);
    ckpt_model_free(r->m);
    for (int i = 0; i < NT; i++) free(r->buf[i]);
}

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v) {
    qsort(v, RUNS, sizeof *v, cmp);
    return v[RUNS / 2];
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: bench_flexload FOLDER\n");
        return 2;
    }
    char pp[4096], ps[4096], cmd[8300];
    snprintf(pp, sizeof pp, "%s/flex_plain", argv[1]);
    snprintf(ps, sizeof ps, "%s/flex_sharded", argv[1]);
    run plain, sharded, dst, bf, pre;
    run_open(&plain, pp, 0, CKPT_F32, "");
    run_open(&sharded, ps, 100000000, CKPT_F32, "");
    double save_p[RUNS], save_s[RUNS];
    for (int k = 0; k < RUNS; k++) {
        double t0 = now();
        check(ckpt_save_state(plain.acc, NULL), "save plain");
        save_p[k] = now() - t0;
        t0 = now();
        check(ckpt_save_state(sharded.acc, NULL), "save sharded");
        save_s[k] = now() - t0;
    }
    char ckp[4096], cks[4096];
    snprintf(ckp, sizeof ckp, "%s", ckpt_accelerator_last_dir(plain.acc));
    snprintf(cks, sizeof cks, "%s", ckpt_accelerator_last_dir(sharded.acc));
    run_close(&plain);
    run_close(&sharded);
    snprintf(pp, sizeof pp, "%s/flex_dst", argv[1]);
    run_open(&dst, pp, 0, CKPT_F32, "");
    snprintf(pp, sizeof pp, "%s/flex_bf16", argv[1]);
    run_open(&bf, pp, 0, CKPT_BF16, "");
    snprintf(pp, sizeof pp, "%s/flex_pre", argv[1]);
    run_open(&pre, pp, 0, CKPT_F32, "model.");
    ckpt_key_prefix pm[] = {{"", "model."}};
    ckpt_load_options rename = {.prefix_map = pm, .num_prefix_map = 1};
    ckpt_load_options conv = {.convert_dtypes = true};
    double lp[RUNS], ls[RUNS], lr[RUNS], lc[RUNS], lw[RUNS];
    for (int k = 0; k < RUNS; k++) {
        double t0 = now();
        check(ckpt_load_state(dst.acc, ckp), "load plain");
        lp[k] = now() - t0;
        t0 = now();
        check(ckpt_load_state(dst.acc, cks), "load sharded");
        ls[k] = now() - t0;
        t0 = now();
        check(ckpt_load_state_ex(pre.acc, ckp, &rename, NULL), "load renamed");
        lr[k] = now() - t0;
        t0 = now();
        check(ckpt_load_state_ex(bf.acc, ckp, &conv, NULL), "load converted");
        lc[k] = now() - t0;
        t0 = now();
        check(ckpt_model_load_weights(dst.m, ckp, NULL, NULL), "load_weights");
        lw[k] = now() - t0;
    }
    double gb = (double)NT * NE * 4 / 1e9;
    double sp = median(save_p), ss = median(save_s), mp = median(lp), ms = median(ls),
           mr = median(lr), mc = median(lc), mw = median(lw);
    printf("bench_flexload: %d F32 tensors, %.3f GB; medians of %d\n", NT, gb, RUNS);
    printf("  save  plain %.3f s, HF shards of 100 MB %.3f s     sharded / plain time  %5.2fx\n", sp, ss,
           ss / sp);
    printf("  load  plain %.3f s (%.2f GB/s)\n", mp, gb / mp);
    printf("        from HF shards          %.3f s               time / plain          %5.2fx\n", ms, ms / mp);
    printf("        every key renamed       %.3f s               time / plain          %5.2fx\n", mr, mr / mp);
    printf("        F32 -> BF16 converted   %.3f s               time / plain          %5.2fx\n", mc, mc / mp);
    printf("        ckpt_model_load_weights %.3f s               time / plain          %5.2fx\n", mw, mw / mp);
    run_close(&dst);
    run_close(&bf);
    run_close(&pre);
    snprintf(cmd, sizeof cmd, "rm -rf '%s/flex_plain' '%s/flex_sharded' '%s/flex_dst' '%s/flex_bf16' '%s/flex_pre'",
             argv[1], argv[1], argv[1], argv[1], argv[1]);
    return system(cmd) == 0 ? 0 : 1;
}
