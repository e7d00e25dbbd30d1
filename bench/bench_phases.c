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
 *   load    ckpt_load_state of the last checkpoint (page cache warm) and the
 *           one-pass load, against pread of its files into a touched buffer
 *           (8 MiB pieces), and the resident memory the first load left
 *
 * Each save follows a change of every byte of the state and a sync; the
 * project keeps one checkpoint (total_limit 1), so every save replaces the
 * previous one, linking on (the defaults). Prints the median of REPS saves
 * of each kind (BENCH_REPS, default 3) and the process's CPU time in each
 * phase (user + system, getrusage): CPU time is what other work on the
 * machine cannot stretch; wall time is what a caller waits.
 *
 *   bench_phases FOLDER
 *   bench_phases FOLDER --load-once   one save, then one load (for callgrind:
 *                                     --toggle-collect=ckpt_load_state)
 *
 * For the system calls inside write and commit: strace -f -tt -T on
 * `bench_save FOLDER --once save`; for the instructions: valgrind
 * --tool=callgrind on the same (bench/README.md, "Profile"). */
#include <dirent.h>
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
#define BENCH_NAME "bench_phases"
#include "bench_util.h"
#include "accel/accel.h"
#include "accel/save_op.h"
#include "base/io.h"
#include "foreign.h"

static foreign F;

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
        fprintf(stderr, "usage: bench_phases FOLDER [--load-once]\n");
        return 2;
    }
    bool load_once = argc > 2 && strcmp(argv[2], "--load-once") == 0;
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
    if (load_once) {
        ckpt_accelerator_free(acc);
        if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
        if (foreign_prepare(acc, &F)) die("prepare");
        double t0 = now(), c0 = cpu();
        if (ckpt_load_state(acc, NULL)) die("load");
        printf("bench_phases: one load: %.3f s, cpu %.3f s\n", now() - t0, cpu() - c0);
        goto out;
    }

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
    free(copy);
    /* ---- loads, warm: a fresh accelerator (a resumed run) ---- */
    double lw[3][MAXREPS], lc[3][MAXREPS];
    long kept = 0;
    char last[4096];
    snprintf(last, sizeof last, "%s", ckpt_accelerator_last_dir(acc));
    uint8_t *rbuf = malloc((size_t)nb * 3 + ((size_t)16 << 20));
    if (!rbuf) die("malloc");
    memset(rbuf, 2, (size_t)nb * 3 + ((size_t)16 << 20));
    raw_read_dir(last, rbuf, (uint64_t)nb * 3 + ((uint64_t)16 << 20)); /* the page cache warm */
    ckpt_accelerator_free(acc);
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (foreign_prepare(acc, &F)) die("prepare");
    ckpt_load_options one;
    memset(&one, 0, sizeof one);
    one.one_pass = true;
    for (int r = 0; r < reps; r++) {
        double t0 = now(), c0 = cpu();
        raw_read_dir(last, rbuf, (uint64_t)nb * 3 + ((uint64_t)16 << 20));
        lw[0][r] = now() - t0, lc[0][r] = cpu() - c0;
        long rss0 = status_kib("VmRSS");
        t0 = now(), c0 = cpu();
        if (ckpt_load_state(acc, last)) die("load");
        lw[1][r] = now() - t0, lc[1][r] = cpu() - c0;
        if (r == 0) kept = status_kib("VmRSS") - rss0;
        t0 = now(), c0 = cpu();
        if (ckpt_load_state_ex(acc, last, &one, NULL)) die("one-pass load");
        lw[2][r] = now() - t0, lc[2][r] = cpu() - c0;
    }
    free(rbuf);
    char ld[64];
    load_average(ld, sizeof ld);
    printf("bench_phases: foreign trainer's state, %.3f GB, total_limit 1, load average %s\n",
           (double)nb * 3 / 1e9, ld);
    report("ckpt_save_state", sname, NS, sw, sc, reps);
    report("ckpt_save_state_async, the call", aname, NA, aw, ac, reps);
    printf("  stall / memcpy %.2fx (wall), %.2fx (cpu)\n",
           median(aw[A_TOTAL], reps) / median(aw[A_MEMCPY], reps),
           median(ac[A_TOTAL], reps) / median(ac[A_MEMCPY], reps));
    static const char *const lname[3] = {"pread", "load", "one pass"};
    report("loads, warm (a fresh accelerator)", lname, 3, lw, lc, reps);
    printf("  raw / load %.2fx (wall), %.2fx (cpu); raw / one pass %.2fx (wall), %.2fx (cpu); "
           "resident set the first load kept: %+.1f MiB\n",
           median(lw[0], reps) / median(lw[1], reps), median(lc[0], reps) / median(lc[1], reps),
           median(lw[0], reps) / median(lw[2], reps), median(lc[0], reps) / median(lc[2], reps),
           (double)kept / 1024.0);
out:
    ckpt_accelerator_free(acc);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%.4000s'", proj);
    if (system(cmd) != 0) fprintf(stderr, "bench_phases: could not remove %s\n", proj);
    foreign_free(&F);
    return 0;
}
