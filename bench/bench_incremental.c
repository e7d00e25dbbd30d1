/* bench_incremental.c — incremental saves (issue 26) on a fine-tune, as
 * ratios measured in the same run:
 *
 *   state: GPT-2 small's 148 tensors (124M fp32 values), frozen (no gradient
 *          buffer, in no optimizer group), plus low-rank adapters (rank 12)
 *          on every block's attn.c_attn, attn.c_proj and mlp.c_fc: 1.22M
 *          trainable values (about 1%), AdamW on those only. One model: its
 *          frozen tensors go to a file of their own.
 *   run:   one save, then SAVES saves each after an optimizer step, all
 *          durable, total_limit 3: with link_copies 1 (link every unchanged
 *          file), with the default link_copies 2 (no one copy serves every
 *          retained checkpoint), and with no_link_unchanged (every file
 *          written); then link_copies 2 with total_limit 0.
 *   report: bytes written per save after the first (the process's write(2)
 *          bytes, /proc/self/io wchar: state files, manifest, everything)
 *          against the trainable values plus their AdamW state, and against
 *          the target 1.1 x that + 256 KiB (link_copies 1); for each setting
 *          against the full save; the median save time with links against
 *          the median full save.
 *
 *   bench_incremental FOLDER      (everything written there is removed) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"
#include "gpt2.h"

#define SAVES 6
#define RANK 12
#define MAXT (MAXP + 6 * LAYERS)

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void check(int rc, const char *what) {
    if (rc == 0) return;
    fprintf(stderr, "bench_incremental: %s: %s\n", what, ckpt_errmsg());
    exit(1);
}

/* Bytes this process has passed to write(2) and friends. */
static uint64_t wchar(void) {
    FILE *f = fopen("/proc/self/io", "r");
    if (!f) return 0;
    char line[128];
    unsigned long long v = 0;
    while (fgets(line, sizeof line, f))
        if (sscanf(line, "wchar: %llu", &v) == 1) break;
    fclose(f);
    return v;
}

typedef struct tensor {
    char name[96];
    int ndim;
    int64_t shape[2];
    int64_t n;
    float *data, *grad; /* grad NULL: frozen */
} tensor;

static tensor T[MAXT];
static int nt;
static int64_t ntrain;

static void add(const char *name, int ndim, int64_t a, int64_t b, bool trainable) {
    tensor *t = &T[nt++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = a;
    t->shape[1] = b;
    t->n = ndim == 2 ? a * b : a;
    t->data = malloc((size_t)t->n * sizeof(float));
    t->grad = trainable ? malloc((size_t)t->n * sizeof(float)) : NULL;
    if (!t->data || (trainable && !t->grad)) {
        fprintf(stderr, "bench_incremental: out of memory\n");
        exit(1);
    }
    for (int64_t i = 0; i < t->n; i++) t->data[i] = 0.001f * (float)((i * 7 + nt) % 1000);
    if (trainable) ntrain += t->n;
}

static void add_frozen(const char *name, int ndim, int64_t a, int64_t b) {
    add(name, ndim, a, b, false);
}

static void build(void) {
    gpt2_small_each(add_frozen);
    static const struct {
        const char *what;
        int64_t in, out;
    } site[] = {{"attn.c_attn", D, 3 * D}, {"attn.c_proj", D, D}, {"mlp.c_fc", D, 4 * D}};
    for (int l = 0; l < LAYERS; l++)
        for (int s = 0; s < 3; s++) {
            char n[96];
            snprintf(n, sizeof n, "transformer.h.%d.%s.lora_A", l, site[s].what);
            add(n, 2, site[s].in, RANK, true);
            snprintf(n, sizeof n, "transformer.h.%d.%s.lora_B", l, site[s].what);
            add(n, 2, RANK, site[s].out, true);
        }
}

/* One optimizer step on made-up gradients: the adapters and their moments
 * change, the base does not. */
static void step(ckpt_optimizer *o, int k) {
    for (int i = 0; i < nt; i++)
        if (T[i].grad)
            for (int64_t j = 0; j < T[i].n; j++)
                T[i].grad[j] = 0.01f * (float)(((j + k) * 13 + i) % 17) - 0.08f;
    check(ckpt_optimizer_step(o), "optimizer step");
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Saves once, then SAVES times after a step each; the later saves' median
 * time and mean bytes written. */
static void run(const char *proj, bool no_link, int link_copies, int total_limit, double *median_s,
                uint64_t *bytes_later, uint64_t *bytes_first, uint64_t *linked) {
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_accelerator *acc = NULL;
    check(ckpt_model_new(&m), "model");
    int group_of[MAXT];
    for (int i = 0; i < nt; i++) {
        check(ckpt_model_add_param(m, T[i].name, CKPT_F32, T[i].ndim, T[i].shape, T[i].data,
                                   T[i].grad),
              "model");
        group_of[i] = T[i].grad ? 0 : -1;
    }
    check(ckpt_adamw_new(&o, m, 1e-4, 0.9, 0.999, 1e-8, 0.0), "optimizer");
    ckpt_optim_options g = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    g.lr = 1e-4;
    g.weight_decay = 0.0;
    check(ckpt_optimizer_set_groups(o, 1, group_of, &g), "optimizer groups");
    ckpt_project_config cfg = {.project_dir = proj,
                               .automatic_checkpoint_naming = true,
                               .total_limit = total_limit,
                               .no_link_unchanged = no_link,
                               .link_copies = link_copies};
    check(ckpt_accelerator_new(&acc, &cfg), "accelerator");
    check(ckpt_prepare_model(acc, m), "prepare");
    check(ckpt_prepare_optimizer(acc, o), "prepare");
    step(o, 0);
    uint64_t w0 = wchar();
    check(ckpt_save_state(acc, NULL), "save");
    *bytes_first = wchar() - w0;
    double t[SAVES];
    uint64_t sum = 0;
    *linked = 0;
    for (int k = 0; k < SAVES; k++) {
        step(o, k + 1);
        w0 = wchar();
        double t0 = now();
        check(ckpt_save_state(acc, NULL), "save");
        t[k] = now() - t0;
        sum += wchar() - w0;
        uint64_t l = 0;
        ckpt_accelerator_last_save_bytes(acc, NULL, &l);
        *linked += l;
    }
    *linked /= SAVES;
    qsort(t, SAVES, sizeof t[0], cmp_double);
    *median_s = SAVES % 2 ? t[SAVES / 2] : 0.5 * (t[SAVES / 2 - 1] + t[SAVES / 2]);
    *bytes_later = sum / SAVES;
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

static void remove_project(const char *proj) { ckpt_checkpoint_prune(proj, 0, NULL); }

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_incremental FOLDER\n");
        return 2;
    }
    build();
    /* the trainable values and their two AdamW moments, fp32 */
    double state = 3.0 * 4.0 * (double)ntrain, mib = 1024.0 * 1024.0;
    double target = 1.1 * state + 256.0 * 1024.0;
    printf("bench_incremental: %lld trainable values (%.2f%% of %lld), AdamW on those: %.1f MiB of "
           "state that changes per step\n",
           (long long)ntrain, 100.0 * (double)ntrain / (double)(ntrain + GPT2_SMALL_PARAMS),
           (long long)(ntrain + GPT2_SMALL_PARAMS), state / mib);
    static const struct {
        const char *name;
        bool no_link;
        int copies, limit;
    } cases[] = {{"full (no_link_unchanged), total_limit 3", true, 0, 3},
                 {"link_copies 1, total_limit 3", false, 1, 3},
                 {"link_copies 2 (default), total_limit 3", false, 2, 3},
                 {"link_copies 2 (default), total_limit 0", false, 2, 0}};
    double t[4];
    uint64_t b[4], first[4], l[4];
    for (int c = 0; c < 4; c++) {
        char proj[4096];
        snprintf(proj, sizeof proj, "%s/case%d", argv[1], c);
        run(proj, cases[c].no_link, cases[c].copies, cases[c].limit, &t[c], &b[c], &first[c],
            &l[c]);
        remove_project(proj);
        printf("bench_incremental: %-40s bytes written per save after the first: %6.1f MiB "
               "(%.3fx the changing state, %.3fx the full save); %.1f MiB linked per save; "
               "median save %.3f s (%.2fx the full save's)\n",
               cases[c].name, (double)b[c] / mib, (double)b[c] / state,
               (double)b[c] / (double)(b[0] ? b[0] : 1), (double)l[c] / mib, t[c], t[c] / t[0]);
    }
    printf("bench_incremental: link_copies 1 against the target 1.1x + 256 KiB = %.1f MiB: %s; "
           "first save %.1f MiB\n",
           target / mib, (double)b[1] <= target ? "met" : "MISSED", (double)first[1] / mib);
    for (int i = 0; i < nt; i++) {
        free(T[i].data);
        free(T[i].grad);
    }
    return 0;
}
