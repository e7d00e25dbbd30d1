/* bench_phases.c — where the time of one save goes, phase by phase (issue
 * 37's profile), on the foreign trainer's GPT-2-small state of bench_save
 * (foreign.h: one parameter block, its own AdamW's moments; 1.49 GB).
 *
 * It drives the save's phases (src/accel/save_op.h) itself, as
 * ckpt_save_state and ckpt_save_state_async do, with a clock around each:
 *
 *   sync    new+plan, snapshot, write, commit (manifest, publish, rotation),
 *           and the deletion of the folder the rotation removed (which
 *           ckpt_save_state leaves to the background thread)
 *   async   new+plan, snapshot, stage: the stall of ckpt_save_state_async
 *           (the write and commit follow untimed), against a memcpy of the
 *           same bytes into a touched buffer
 *
 * Each save follows a change of every byte of the state and a sync; the
 * project keeps one checkpoint (total_limit 1), so every save replaces the
 * previous one, linking on (the defaults). Prints the median of REPS saves
 * of each kind (BENCH_REPS, default 3) and the process's CPU time in each
 * phase (user + system, getrusage): CPU time is what other work on the
 * machine cannot stretch; wall time is what a caller waits.
 *
 *   bench_phases FOLDER
 *
 * For the system calls inside write and commit: strace -f -tt -T on
 * `bench_save FOLDER --once save`; for the instructions: valgrind
 * --tool=callgrind on the same (bench/README.md, "Profile"). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/save_op.h"
#include "base/io.h"
#include "foreign.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double cpu(void) {
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

static void die(const char *what) {
    fprintf(stderr, "bench_phases: %s: %s\n", what, ckpt_errmsg());
    exit(1);
}

static foreign F;

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

enum { S_PLAN, S_SNAP, S_WRITE, S_COMMIT, S_DELETE, S_TOTAL, NS };
static const char *const sname[NS] = {"new+plan", "snapshot", "write",
                                      "commit",   "deletion", "total"};
enum { A_PLAN, A_SNAP, A_STAGE, A_TOTAL, A_MEMCPY, NA };
static const char *const aname[NA] = {"new+plan", "snapshot", "stage", "stall", "memcpy"};

#define MAXREPS 32

/* One synchronous save, phase by phase, as ckpt_save_state runs them. */
static void sync_save(ckpt_accelerator *acc, double *wall, double *cpus) {
    ckpt_save_op *op = NULL;
    double t[NS + 1], c[NS + 1];
    t[0] = now();
    c[0] = cpu();
    ckpt__save_op_new(acc, NULL, &op);
    if (!op) die("save_op_new");
    ckpt__save_op_plan(op);
    t[1] = now(), c[1] = cpu();
    ckpt__save_op_snapshot(op);
    t[2] = now(), c[2] = cpu();
    ckpt__save_op_write(op);
    t[3] = now(), c[3] = cpu();
    ckpt__save_op_defer_removal(op);
    if (ckpt__save_op_commit(op)) die("commit");
    int ntrash = 0;
    char **trash = ckpt__save_op_take_trash(op, &ntrash);
    ckpt__save_op_apply(op);
    ckpt__save_op_free(op);
    t[4] = now(), c[4] = cpu();
    for (int i = 0; i < ntrash; i++) {
        if (ckpt__remove_tree(trash[i]) < 0) die("remove_tree");
        free(trash[i]);
    }
    free(trash);
    t[5] = now(), c[5] = cpu();
    for (int k = 0; k < S_TOTAL; k++) {
        wall[k] = t[k + 1] - t[k];
        cpus[k] = c[k + 1] - c[k];
    }
    wall[S_TOTAL] = t[5] - t[0];
    cpus[S_TOTAL] = c[5] - c[0];
}

/* The stall of one asynchronous save, phase by phase, as
 * ckpt_save_state_async runs them; the write and commit follow, untimed. */
static void async_save(ckpt_accelerator *acc, double *wall, double *cpus) {
    ckpt_save_op *op = NULL;
    double t[4], c[4];
    t[0] = now();
    c[0] = cpu();
    ckpt__save_op_new(acc, NULL, &op);
    if (!op) die("save_op_new");
    ckpt__save_op_plan(op);
    t[1] = now(), c[1] = cpu();
    ckpt__save_op_snapshot(op);
    ckpt__save_op_agree_snapshot(op);
    t[2] = now(), c[2] = cpu();
    if (ckpt__save_op_stage(op)) die("stage");
    t[3] = now(), c[3] = cpu();
    ckpt__save_op_write(op);
    if (ckpt__save_op_commit(op)) die("commit");
    ckpt__save_op_apply(op);
    ckpt__save_op_free(op);
    for (int k = 0; k < A_TOTAL; k++) {
        wall[k] = t[k + 1] - t[k];
        cpus[k] = c[k + 1] - c[k];
    }
    wall[A_TOTAL] = t[3] - t[0];
    cpus[A_TOTAL] = c[3] - c[0];
}

static void report(const char *title, const char *const *names, int n, double w[][MAXREPS],
                   double c[][MAXREPS], int reps) {
    printf("%s (median of %d)\n", title, reps);
    for (int k = 0; k < n; k++)
        printf("  %-9s wall %7.3f s   cpu %7.3f s\n", names[k], median(w[k], reps),
               median(c[k], reps));
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_phases FOLDER\n");
        return 2;
    }
    const char *e = getenv("BENCH_REPS");
    int reps = e && *e ? atoi(e) : 3;
    if (reps < 1) reps = 1;
    if (reps > MAXREPS) reps = MAXREPS;
    char proj[4096];
    snprintf(proj, sizeof proj, "%.4000s/phases_project", argv[1]);

    foreign_new(&F);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 1;
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (foreign_prepare(acc, &F)) die("prepare");
    if (ckpt_save_state(acc, NULL)) die("first save"); /* the one the next replaces */

    double sw[NS][MAXREPS], sc[NS][MAXREPS], aw[NA][MAXREPS], ac[NA][MAXREPS];
    for (int r = 0; r < reps; r++) {
        foreign_step(&F);
        sync();
        double w[NS], c[NS];
        sync_save(acc, w, c);
        for (int k = 0; k < NS; k++) sw[k][r] = w[k], sc[k][r] = c[k];
    }
    if (ckpt_accelerator_prepare_async(acc) || ckpt_save_wait(acc)) die("prepare_async");
    uint64_t nb = (uint64_t)F.n * 4;
    uint8_t *copy = malloc((size_t)nb * 3);
    if (!copy) die("malloc");
    memset(copy, 1, (size_t)nb * 3);
    for (int r = 0; r < reps; r++) {
        foreign_step(&F);
        sync();
        double w[NA], c[NA];
        async_save(acc, w, c);
        for (int k = 0; k < A_MEMCPY; k++) aw[k][r] = w[k], ac[k][r] = c[k];
        double t0 = now(), c0 = cpu();
        memcpy(copy, F.params, nb);
        memcpy(copy + nb, F.m, nb);
        memcpy(copy + 2 * nb, F.v, nb);
        aw[A_MEMCPY][r] = now() - t0;
        ac[A_MEMCPY][r] = cpu() - c0;
    }
    char ld[64] = "?";
    FILE *f = fopen("/proc/loadavg", "r");
    if (f) {
        if (!fgets(ld, sizeof ld, f)) ld[0] = '\0';
        ld[strcspn(ld, " ")] = '\0';
        fclose(f);
    }
    printf("bench_phases: foreign trainer's state, %.3f GB, total_limit 1, load average %s\n",
           (double)nb * 3 / 1e9, ld);
    report("ckpt_save_state", sname, NS, sw, sc, reps);
    report("ckpt_save_state_async, the call", aname, NA, aw, ac, reps);
    printf("  stall / memcpy %.2fx (wall), %.2fx (cpu)\n",
           median(aw[A_TOTAL], reps) / median(aw[A_MEMCPY], reps),
           median(ac[A_TOTAL], reps) / median(ac[A_MEMCPY], reps));
    ckpt_accelerator_free(acc);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%.4000s'", proj);
    if (system(cmd) != 0) fprintf(stderr, "bench_phases: could not remove %s\n", proj);
    foreign_free(&F);
    free(copy);
    return 0;
}
