/* bench_save.c — the durable save of a foreign trainer's state against a raw
 * write + fsync of the same bytes (issue 37).
 *
 * The state (foreign.h): a C trainer in llm.c's style, one contiguous block
 * of GPT-2 small's 124,439,808 fp32 parameters and its own AdamW
 * (ckpt_optimizer_external_new) over two more blocks, exp_avg and
 * exp_avg_sq; 1.49 GB. Every byte of the three blocks changes before each
 * timed operation (outside the timing), so no save can link an unchanged
 * file, and the dirty pages of the previous operation are written out
 * (sync) before it.
 *
 * Paired runs: each repetition times, in an order that turns by one each
 * repetition,
 *
 *   raw       write + fsync of the three blocks into three files of a fresh
 *             folder (the parameters' bytes, the moments' bytes, a small file
 *             for the generator), then the folder fsynced
 *   save      ckpt_save_state(acc, NULL), total_limit 1 (the previous
 *             checkpoint is removed by the call, after the commit: renamed
 *             out of sight, its files deleted by the background thread,
 *             which is waited for before the next operation, untimed),
 *             incremental linking on (the defaults)
 *   nolink    the same with no_link_unchanged (nothing hashed to decide)
 *   norot     the same without total_limit (the previous checkpoint
 *             removed outside the timing)
 *
 * and prints, for each ckpt variant, the time ratio raw / variant of every
 * repetition and their median (>= 0.95 is the target for `save`), the
 * medians of the times, and of the CPU time of the calling thread; at the
 * end every variant's last checkpoint is verified (every file's digest).
 *
 *   bench_save FOLDER                 the paired runs (BENCH_REPS, default 5)
 *   bench_save FOLDER --once KIND     set up, then one operation of KIND
 *                                     (raw, save, nolink, norot) after a
 *                                     first one (the previous checkpoint):
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
#define BENCH_NAME "bench_save"
#include "bench_util.h"
#include "foreign.h"

static void shell(const char *cmd) {
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_save: command failed: %s\n", cmd);
        exit(1);
    }
}

static foreign F;

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
    uint64_t nb = (uint64_t)F.n * 4;
    double t0 = now();
    raw_file(dir, "model.safetensors", F.params, nb, NULL, 0);
    raw_file(dir, "optimizer.safetensors", F.m, nb, F.v, nb);
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

static void make_project(int v, const char *base) {
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
    if (foreign_prepare(p->acc, &F)) die("prepare");
    ckpt_set_seed(p->acc, 1);
}

/* Everything a timed operation of variant v must not pay for: the raw
 * folder made fresh, the previous checkpoints of norot removed, every dirty
 * page written out. */
static void before(int v) {
    char cmd[9000];
    /* what the previous saves left to the background (the rotated folders'
     * deletion) is done first: no operation pays for another's */
    for (int k = 0; k < NV; k++)
        if (prj[k].acc && ckpt_save_wait(prj[k].acc)) die("save_wait");
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

static double run(int v, double *cpu) {
    double c0 = thread_cpu();
    double t;
    if (v == V_RAW) {
        t = raw_save(prj[v].proj);
    } else {
        double t0 = now();
        if (ckpt_save_state(prj[v].acc, NULL)) die(vname[v]);
        t = now() - t0;
    }
    if (cpu) *cpu = thread_cpu() - c0;
    return t;
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

    foreign_new(&F);
    double gb = (double)F.n * 12 / 1e9;

    if (once >= 0) {
        make_project(once, base);
        /* the previous checkpoint (or raw folder) the operation replaces */
        before(once);
        run(once, NULL);
        foreign_step(&F);
        before(once);
        double c = 0, t = run(once, &c);
        printf("bench_save: --once %s: %.3f s (cpu %.3f s) for %.3f GB\n", vname[once], t, c, gb);
    } else {
        for (int v = 0; v < NV; v++) make_project(v, base);
        double t[NV][64], c[NV][64];
        for (int v = 0; v < NV; v++) { /* a first checkpoint each: the one later saves replace */
            before(v);
            run(v, NULL);
        }
        for (int r = 0; r < reps; r++)
            for (int k = 0; k < NV; k++) {
                int v = (k + r) % NV;
                foreign_step(&F);
                before(v);
                t[v][r] = run(v, &c[v][r]);
            }
        char ld[64];
        load_average(ld, sizeof ld);
        printf("bench_save: foreign trainer (one parameter block, its own AdamW's moments), "
               "%.3f GB, state changed before each, %d paired reps, load average %s\n",
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
    /* the checkpoints are sound: every file's digest checked */
    for (int v = V_SAVE; v < NV; v++) {
        if (!prj[v].acc) continue;
        ckpt_checkpoint_info info;
        if (ckpt_checkpoint_verify(ckpt_accelerator_last_dir(prj[v].acc), true, &info))
            die("verify");
    }
    char cmd[9000];
    for (int v = 0; v < NV; v++) {
        if (prj[v].acc) ckpt_accelerator_free(prj[v].acc);
        if (prj[v].proj[0]) {
            snprintf(cmd, sizeof cmd, "rm -rf '%.3500s'", prj[v].proj);
            shell(cmd);
        }
    }
    foreign_free(&F);
    return 0;
}
