/* bench_save.c — the durable save of a foreign trainer's state against a raw
 * write + fsync of the same bytes (issue 37).
 *
 * The state is laid out as a C trainer in llm.c's style keeps it: one
 * contiguous block of GPT-2 small's 124,439,808 fp32 parameters (148
 * tensors with Hugging Face names, views into the block, registered with
 * ckpt_model_add_param), and the trainer's own AdamW moments, two more
 * blocks of the same size, registered as plain tensors of a custom object
 * (exp_avg.<name>, exp_avg_sq.<name>). 1.49 GB in all. Every byte of the
 * three blocks changes before each timed operation (outside the timing), so
 * no save can link an unchanged file, and the dirty pages of the previous
 * operation are written out (sync) before it.
 *
 * Paired runs: each repetition times, in an order that turns by one each
 * repetition,
 *
 *   raw       write + fsync of the three blocks into three files of a fresh
 *             folder (the model's bytes, the moments' bytes, a small file
 *             for the generator), then the folder fsynced
 *   save      ckpt_save_state(acc, NULL), total_limit 1 (the previous
 *             checkpoint is removed inside the call, after the commit),
 *             incremental linking on (the defaults)
 *   nolink    the same with no_link_unchanged (nothing hashed to decide)
 *   norot     the same without total_limit (the previous checkpoint
 *             removed outside the timing)
 *
 * and prints, for each ckpt variant, the time ratio raw / variant of every
 * repetition and their median (>= 0.95 is the target for `save`), then the
 * medians of the times.
 *
 *   bench_save FOLDER                 the paired runs (BENCH_REPS, default 5)
 *   bench_save FOLDER --once KIND     set up, then one operation of KIND
 *                                     (raw, save, nolink, norot) after a
 *                                     first save (the previous checkpoint):
 *                                     for profilers (strace -T, callgrind);
 *                                     prints the time of that operation */
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
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

/* CPU time of the calling thread (user + system): the kernel's copy into
 * the page cache and the writeback it starts are charged to it, so this is
 * the work each way costs, whatever else the machine runs. */
static double thread_cpu(void) {
    struct rusage ru;
    getrusage(RUSAGE_THREAD, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static void die(const char *what) {
    fprintf(stderr, "bench_save: %s: %s\n", what, ckpt_errmsg());
    exit(1);
}

static void shell(const char *cmd) {
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_save: command failed: %s\n", cmd);
        exit(1);
    }
}

/* ---- the foreign trainer's state ---- */

typedef struct {
    char name[64];
    int ndim;
    int64_t shape[2];
    int64_t numel, off;
} tensor;

static tensor T[MAXP];
static int nt;
static int64_t total;
static float *params, *grads, *m1, *m2;

static void add(const char *name, int ndim, int64_t a, int64_t b) {
    tensor *t = &T[nt++];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->ndim = ndim;
    t->shape[0] = a;
    t->shape[1] = b;
    t->numel = ndim == 1 ? a : a * b;
    t->off = total;
    total += t->numel;
}

/* The moments as a custom object of plain tensors. */
static int moments_sd(void *self, ckpt_writer *w) {
    (void)self;
    char key[96];
    for (int i = 0; i < nt; i++) {
        snprintf(key, sizeof key, "exp_avg.%.63s", T[i].name);
        int rc = ckpt_write_tensor(w, key, CKPT_F32, T[i].ndim, T[i].shape, m1 + T[i].off);
        if (rc) return rc;
        snprintf(key, sizeof key, "exp_avg_sq.%.63s", T[i].name);
        rc = ckpt_write_tensor(w, key, CKPT_F32, T[i].ndim, T[i].shape, m2 + T[i].off);
        if (rc) return rc;
    }
    return 0;
}

static int moments_lsd(void *self, ckpt_reader *r) {
    (void)self;
    char key[96];
    for (int i = 0; i < nt; i++) {
        snprintf(key, sizeof key, "exp_avg.%.63s", T[i].name);
        int rc = ckpt_read_tensor(r, key, CKPT_F32, T[i].ndim, T[i].shape, m1 + T[i].off);
        if (rc) return rc;
        snprintf(key, sizeof key, "exp_avg_sq.%.63s", T[i].name);
        rc = ckpt_read_tensor(r, key, CKPT_F32, T[i].ndim, T[i].shape, m2 + T[i].off);
        if (rc) return rc;
    }
    return 0;
}

static const ckpt_stateful_ops moments_ops = {.state_dict = moments_sd,
                                              .load_state_dict = moments_lsd};

/* Every byte of the three blocks changes (an update step's worth of work). */
static void change_state(int round) {
    float d = 1e-6f * (float)(round + 1);
    for (int64_t i = 0; i < total; i++) {
        params[i] += d;
        m1[i] = m1[i] * 0.9f + d;
        m2[i] = m2[i] * 0.999f + d * d;
    }
}

/* ---- the raw baseline ---- */

static void write_all(int fd, const void *p, uint64_t n, const char *path) {
    const uint8_t *b = p;
    while (n > 0) {
        size_t want = n < ((uint64_t)64 << 20) ? (size_t)n : (size_t)64 << 20;
        ssize_t w = write(fd, b, want);
        if (w <= 0) {
            perror(path);
            exit(1);
        }
        b += w;
        n -= (uint64_t)w;
    }
}

static void raw_file(const char *dir, const char *name, const void *a, uint64_t na, const void *b,
                     uint64_t nb) {
    char path[4400];
    snprintf(path, sizeof path, "%.3000s/%.200s", dir, name);
    int fd = open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        perror(path);
        exit(1);
    }
    write_all(fd, a, na, path);
    if (b) write_all(fd, b, nb, path);
    if (fsync(fd) != 0) perror("fsync");
    close(fd);
}

/* The same bytes as the checkpoint's tensors, in three files of a fresh
 * folder (made outside the timing), then the folder fsynced. */
static double raw_save(const char *dir) {
    static uint8_t rng[64];
    uint64_t nb = (uint64_t)total * 4;
    double t0 = now();
    raw_file(dir, "model.safetensors", params, nb, NULL, 0);
    raw_file(dir, "custom_checkpoint_0.safetensors", m1, nb, m2, nb);
    raw_file(dir, "random_states_0.safetensors", rng, sizeof rng, NULL, 0);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY);
    if (dfd >= 0) {
        fsync(dfd);
        close(dfd);
    }
    return now() - t0;
}

/* ---- the variants ---- */

enum { V_RAW, V_SAVE, V_NOLINK, V_NOROT, NV };
static const char *const vname[NV] = {"raw", "save", "nolink", "norot"};

typedef struct {
    ckpt_accelerator *acc;
    char proj[4096];
} project;

static project prj[NV];

static void make_project(int v, const char *base, ckpt_model *model) {
    project *p = &prj[v];
    snprintf(p->proj, sizeof p->proj, "%.3000s/save_%s", base, vname[v]);
    if (v == V_RAW) return;
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = p->proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = v == V_NOROT ? 0 : 1;
    cfg.no_link_unchanged = v == V_NOLINK;
    if (ckpt_accelerator_new(&p->acc, &cfg)) die("accelerator_new");
    if (ckpt_prepare_model(p->acc, model)) die("prepare_model");
    if (ckpt_register_for_checkpointing(p->acc, &moments_ops, NULL)) die("register");
    ckpt_set_seed(p->acc, 1);
}

/* Everything a timed operation of variant v must not pay for: the raw
 * folder made fresh, the previous checkpoints of norot removed, every dirty
 * page written out. */
static void before(int v) {
    char cmd[9000];
    if (v == V_RAW) {
        snprintf(cmd, sizeof cmd, "rm -rf '%.3500s' && mkdir -p '%.3500s'", prj[v].proj,
                 prj[v].proj);
        shell(cmd);
    } else if (v == V_NOROT) {
        snprintf(cmd, sizeof cmd, "rm -rf '%.3500s'/checkpoints/checkpoint_*", prj[v].proj);
        shell(cmd);
    }
    sync();
}

static double run(int v, int step, double *cpu) {
    double c0 = thread_cpu();
    double t;
    if (v == V_RAW) {
        t = raw_save(prj[v].proj);
    } else {
        ckpt_accelerator_set_step(prj[v].acc, step);
        double t0 = now();
        if (ckpt_save_state(prj[v].acc, NULL)) die(vname[v]);
        t = now() - t0;
    }
    if (cpu) *cpu = thread_cpu() - c0;
    return t;
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
static double median(const double *v, int n) {
    double s[64];
    memcpy(s, v, (size_t)n * sizeof *v);
    qsort(s, (size_t)n, sizeof *s, cmp_d);
    return n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
}

static float *block(void) {
    float *p = malloc((size_t)total * sizeof(float));
    if (!p) {
        fprintf(stderr, "bench_save: out of memory\n");
        exit(1);
    }
    return p;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_save FOLDER [--once raw|save|nolink|norot]\n");
        return 2;
    }
    const char *base = argv[1];
    int once = -1;
    if (argc > 3 && strcmp(argv[2], "--once") == 0)
        for (int v = 0; v < NV; v++)
            if (strcmp(argv[3], vname[v]) == 0) once = v;
    if (argc > 2 && once < 0) {
        fprintf(stderr, "bench_save: unknown arguments\n");
        return 2;
    }
    const char *e = getenv("BENCH_REPS");
    int reps = e && *e ? atoi(e) : 5;
    if (reps < 1) reps = 1;
    if (reps > 64) reps = 64;

    gpt2_small_each(add);
    params = block();
    m1 = block();
    m2 = block();
    grads = block(); /* never touched: not resident */
    for (int64_t i = 0; i < total; i++) {
        params[i] = (float)(i % 997) * 1e-3f - 0.5f;
        m1[i] = (float)(i % 773) * 1e-4f;
        m2[i] = (float)(i % 331) * 1e-6f;
    }
    ckpt_model *model;
    if (ckpt_model_new(&model)) die("model_new");
    for (int i = 0; i < nt; i++)
        if (ckpt_model_add_param(model, T[i].name, CKPT_F32, T[i].ndim, T[i].shape,
                                 params + T[i].off, grads + T[i].off))
            die("add_param");
    double gb = (double)total * 12 / 1e9;

    if (once >= 0) {
        make_project(once, base, model);
        /* the previous checkpoint (or raw folder) the operation replaces */
        before(once);
        run(once, 0, NULL);
        change_state(0);
        before(once);
        double c = 0, t = run(once, 1, &c);
        printf("bench_save: --once %s: %.3f s (cpu %.3f s) for %.3f GB\n", vname[once], t, c, gb);
    } else {
        for (int v = 0; v < NV; v++) make_project(v, base, model);
        double t[NV][64], c[NV][64];
        for (int v = 0; v < NV; v++) { /* a first checkpoint each: the one later saves replace */
            before(v);
            run(v, 0, NULL);
        }
        for (int r = 0; r < reps; r++)
            for (int k = 0; k < NV; k++) {
                int v = (k + r) % NV;
                change_state(r * NV + k);
                before(v);
                t[v][r] = run(v, 1 + r, &c[v][r]);
            }
        char ld[64] = "?";
        FILE *f = fopen("/proc/loadavg", "r");
        if (f) {
            if (!fgets(ld, sizeof ld, f)) ld[0] = '\0';
            ld[strcspn(ld, " ")] = '\0';
            fclose(f);
        }
        printf("bench_save: foreign trainer (one parameter block + its own AdamW moments as "
               "plain tensors), %.3f GB, state changed before each, %d paired reps, load "
               "average %s\n",
               gb, reps, ld);
        for (int v = V_SAVE; v < NV; v++) {
            double ratio[64];
            printf("  raw / %-6s per rep:", vname[v]);
            for (int r = 0; r < reps; r++) {
                ratio[r] = t[V_RAW][r] / t[v][r];
                printf(" %.2f", ratio[r]);
            }
            printf("   median %.2fx%s\n", median(ratio, reps),
                   v == V_SAVE ? (median(ratio, reps) >= 0.95 ? "  (target >= 0.95: met)"
                                                               : "  (target >= 0.95: NOT met)")
                               : "");
        }
        printf("  median times:");
        for (int v = 0; v < NV; v++) printf(" %s %.3f s", vname[v], median(t[v], reps));
        printf("\n  median cpu of the calling thread:");
        for (int v = 0; v < NV; v++) printf(" %s %.3f s", vname[v], median(c[v], reps));
        printf("\n");
    }
    char cmd[9000];
    for (int v = 0; v < NV; v++) {
        if (prj[v].acc) ckpt_accelerator_free(prj[v].acc);
        if (prj[v].proj[0]) {
            snprintf(cmd, sizeof cmd, "rm -rf '%.3500s'", prj[v].proj);
            shell(cmd);
        }
    }
    ckpt_model_free(model);
    free(params);
    free(m1);
    free(m2);
    free(grads);
    return 0;
}
