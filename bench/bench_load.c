/* bench_load.c — the verified load against a raw read of the same bytes
 * (issue 37), on the foreign trainer's GPT-2-small state of bench_save
 * (foreign.h: 1.49 GB in model.safetensors and optimizer.safetensors).
 *
 * One save (total_limit 1), the page cache warmed with one read of every
 * file. Then REPS rounds (BENCH_REPS, default 5), each with a new
 * accelerator over the same objects (a resumed run), and in it a pair,
 * the order alternated from round to round:
 *
 *   pread   every file of the checkpoint read with pread in 8 MiB pieces
 *           into a buffer allocated and touched beforehand (the bytes land
 *           in memory once; no verification, nothing parsed)
 *   resume  ckpt_load_state of that checkpoint, the accelerator's first
 *           load: each file read once into the objects' own memory, every
 *           byte hashed as it lands and checked against the manifest
 *
 * and after the pair a later load of the same accelerator (transactional:
 * every file verified whole before anything changes, then read into the
 * objects, hashed again), its ratio against the round's pread.
 *
 * It prints each round, the median of the ratios (pread time / load time:
 * 1.0x is a load as fast as the raw read; the target for the resume is
 * >= 0.9x), the CPU time of each (user + system, getrusage: what other work
 * on the machine cannot stretch), the resident set the first load of the
 * process kept (VmRSS after less before; the target is <= +16 MiB), and,
 * where the tree has the load op (src/accel/load_op.h), each load's phases:
 *
 *   choose   new, choose and plan: the options, the project lock, the
 *            candidates, the manifest
 *   read     the files read and verified (the later load: every file hashed
 *            whole, nothing kept; the resume: sizes only)
 *   check    the objects matched with their files, schemas checked; agree
 *   apply    every object reads its tensors into its own memory, straight
 *            from the files, each piece hashed as it lands
 *   finish   the post-hooks, the refusal of saves lifted, free
 *
 *   bench_load FOLDER
 *   bench_load FOLDER --cold     the same with the page cache emptied before
 *                                each timed read and load (sync, then
 *                                /proc/sys/vm/drop_caches: needs root); the
 *                                figures are then against a raw cold read
 *   bench_load FOLDER --once     one save, one warm resume (for perf record
 *                                -k CLOCK_MONOTONIC, then perf report --time
 *                                with the times it prints)
 *
 * The source uses the public API, foreign.h and bench_util.h, plus the load op's header
 * where the tree has it, so that it also builds against a tree from before
 * the load op (copied there with foreign.h) for a "before" column. */
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
#define BENCH_NAME "bench_load"
#include "bench_util.h"
#include "foreign.h"
#if defined(__has_include)
#if __has_include("accel/load_op.h")
#define BENCH_LOAD_OP 1
#include "accel/load_op.h"
#endif
#endif

/* --cold: the page cache emptied (the files' bytes come from the disk). */
static bool cold;
static void drop_cache(void) {
    if (!cold) return;
    sync();
    FILE *f = fopen("/proc/sys/vm/drop_caches", "w");
    if (!f || fputs("1\n", f) < 0 || fclose(f) != 0) {
        fprintf(stderr, "bench_load: --cold: cannot write /proc/sys/vm/drop_caches (root?)\n");
        exit(1);
    }
}

enum { P_CHOOSE, P_READ, P_CHECK, P_APPLY, P_FINISH, NP };
static const char *const pname[NP] = {"choose", "read", "check", "apply", "finish"};

/* One load of dir; its phases' wall and CPU times where the op is known. */
static void load(ckpt_accelerator *acc, const char *dir, double *pw, double *pc) {
#ifdef BENCH_LOAD_OP
    double t[NP + 1], c[NP + 1];
    t[0] = now(), c[0] = cpu();
    ckpt__load_op *op = NULL;
    ckpt__load_op_new(acc, dir, NULL, NULL, &op);
    if (!op) die("load_op_new");
    ckpt__load_op_choose(op);
    ckpt__load_op_plan(op);
    t[1] = now(), c[1] = cpu();
    if (ckpt__load_op_read(op) != 0) die("load: read");
    t[2] = now(), c[2] = cpu();
    ckpt__load_op_check(op);
    ckpt__load_op_agree(op);
    t[3] = now(), c[3] = cpu();
    ckpt__load_op_apply(op);
    t[4] = now(), c[4] = cpu();
    int rc = ckpt__load_op_finish(op);
    ckpt__load_op_free(op);
    t[5] = now(), c[5] = cpu();
    if (rc) die("load");
    for (int k = 0; k < NP; k++) pw[k] = t[k + 1] - t[k], pc[k] = c[k + 1] - c[k];
#else
    for (int k = 0; k < NP; k++) pw[k] = pc[k] = 0;
    if (ckpt_load_state(acc, dir)) die("load");
#endif
}

#define MAXREPS 32

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_load FOLDER [--once]\n");
        return 2;
    }
    bool once = argc > 2 && strcmp(argv[2], "--once") == 0;
    cold = argc > 2 && strcmp(argv[2], "--cold") == 0;
    const char *e = getenv("BENCH_REPS");
    int reps = e && *e ? atoi(e) : 5;
    if (reps < 1) reps = 1;
    if (reps > MAXREPS) reps = MAXREPS;
    char proj[4096];
    snprintf(proj, sizeof proj, "%.4000s/load_project", argv[1]);

    foreign F;
    foreign_new(&F);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 1;
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (foreign_prepare(acc, &F)) die("prepare");
    foreign_step(&F);
    if (ckpt_save_state(acc, NULL)) die("save");
    char last[4096];
    snprintf(last, sizeof last, "%s", ckpt_accelerator_last_dir(acc));
    ckpt_accelerator_free(acc);
    acc = NULL;
    uint64_t nb = (uint64_t)F.n * 4 * 3, cap = nb + ((uint64_t)16 << 20);
    uint8_t *buf = malloc((size_t)cap);
    if (!buf) die("malloc");
    memset(buf, 2, (size_t)cap);
    uint64_t bytes = raw_read_dir(last, buf, cap); /* the page cache warm */
    double pw[NP], pc[NP];
    if (once) { /* the resume: a new accelerator's first load */
        if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
        if (foreign_prepare(acc, &F)) die("prepare");
        double t0 = now(), c0 = cpu();
        load(acc, last, pw, pc);
        double t1 = now();
        /* CLOCK_MONOTONIC: perf record -k CLOCK_MONOTONIC, report --time */
        printf("bench_load: one load: %.3f s, cpu %.3f s (from %.6f to %.6f)\n", t1 - t0,
               cpu() - c0, t0, t1);
        goto out;
    }
    /* per pair: raw read, the resume (first load), then a later load */
    double rw[MAXREPS], rc[MAXREPS], lw[MAXREPS], lc[MAXREPS], ratio[MAXREPS], cratio[MAXREPS];
    double tw[MAXREPS], tc[MAXREPS], tratio[MAXREPS], tcratio[MAXREPS];
    double phw[NP][MAXREPS], phc[NP][MAXREPS], thw[NP][MAXREPS], thc[NP][MAXREPS];
    long kept = 0;
    for (int r = 0; r < reps; r++) {
        /* A resumed run: a new accelerator over the same objects. */
        if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
        if (foreign_prepare(acc, &F)) die("prepare");
        for (int half = 0; half < 2; half++) {
            if ((half == 0) == (r % 2 == 0)) {
                drop_cache();
                double t0 = now(), c0 = cpu();
                raw_read_dir(last, buf, cap);
                rw[r] = now() - t0, rc[r] = cpu() - c0;
            } else {
                F.params[1] = -1.0f; /* the load puts it back */
                drop_cache();
                long rss0 = status_kib("VmRSS");
                double t0 = now(), c0 = cpu();
                load(acc, last, pw, pc);
                lw[r] = now() - t0, lc[r] = cpu() - c0;
                if (r == 0) kept = status_kib("VmRSS") - rss0;
                if (F.params[1] == -1.0f) die("the load did not put the state back");
                for (int k = 0; k < NP; k++) phw[k][r] = pw[k], phc[k][r] = pc[k];
            }
        }
        /* and a later load of the same accelerator (transactional), right
         * after */
        F.params[1] = -1.0f;
        drop_cache();
        double t0 = now(), c0 = cpu();
        load(acc, last, pw, pc);
        tw[r] = now() - t0, tc[r] = cpu() - c0;
        if (F.params[1] == -1.0f) die("the later load did not put the state back");
        for (int k = 0; k < NP; k++) thw[k][r] = pw[k], thc[k][r] = pc[k];
        ckpt_accelerator_free(acc);
        acc = NULL;
        ratio[r] = rw[r] / lw[r];
        tratio[r] = rw[r] / tw[r];
        cratio[r] = rc[r] / lc[r];
        tcratio[r] = rc[r] / tc[r];
    }
    char ld[64];
    load_average(ld, sizeof ld);
    printf("bench_load: foreign trainer's state, %.3f GB in the checkpoint's files, %s, "
           "load average %s\n",
           (double)bytes / 1e9, cold ? "cold (page cache dropped before each)" : "warm", ld);
    for (int r = 0; r < reps; r++)
        printf("  pair %d (%s first): pread %.3f s, resume %.3f s: %.2fx; later load %.3f s: "
               "%.2fx\n",
               r + 1, r % 2 == 0 ? "pread" : "resume", rw[r], lw[r], ratio[r], tw[r], tratio[r]);
    printf("  median of %d pairs: pread / resume (first load, one pass) %.2fx (target >= 0.9x); "
           "pread %.3f s (cpu %.3f s), resume %.3f s (cpu %.3f s)\n",
           reps, median(ratio, reps), median(rw, reps), median(rc, reps), median(lw, reps),
           median(lc, reps));
    printf("  later load (transactional, two passes): pread / later %.2fx (DESIGN: >= 0.5x "
           "warm, >= 0.9x cold), %.3f s (cpu %.3f s)\n",
           median(tratio, reps), median(tw, reps), median(tc, reps));
    printf("  cpu time: pread / resume %.2fx, pread / later %.2fx\n", median(cratio, reps),
           median(tcratio, reps));
#ifdef BENCH_LOAD_OP
    for (int w = 0; w < 2; w++) {
        printf("  %s phases (median):", w == 0 ? "the resume's" : "the later load's");
        for (int k = 0; k < NP; k++)
            printf(" %s %.3f s (cpu %.3f)%s", pname[k], median(w ? thw[k] : phw[k], reps),
                   median(w ? thc[k] : phc[k], reps), k + 1 < NP ? "," : "\n");
    }
#else
    (void)phw, (void)phc, (void)thw, (void)thc, (void)pname;
#endif
    printf("  resident set the first load of the process kept: %+.1f MiB (target <= +16 MiB)\n",
           (double)kept / 1024.0);
out:
    free(buf);
    if (acc) ckpt_accelerator_free(acc);
    char cmd[4200];
    snprintf(cmd, sizeof cmd, "rm -rf '%.4000s'", proj);
    if (system(cmd) != 0) fprintf(stderr, "bench_load: could not remove %s\n", proj);
    foreign_free(&F);
    return 0;
}
