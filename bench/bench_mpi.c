/* bench_mpi.c — save and load of a GPT-2-small-sized training state by P
 * MPI processes, the same total bytes whatever P: the model (124,439,808
 * fp32 parameters, HF transformers' shapes) is replicated, and the save
 * plan spreads its tensors over the ranks; AdamW is sharded ZeRO-1 style
 * (ckpt_optimizer_set_shard), so its moments (2x the model) are written 1/P
 * by every rank. Run under `mpirun -np P` for P = 1, 2, 4; bench/run
 * prints each P's times as ratios against P = 1 measured in the same run.
 *
 *   mpirun -np P bench_mpi FOLDER
 *
 * Prints one line on rank 0:
 *
 *   bench_mpi P=<p> bytes=<n> save=<s> load=<s> save_max=<x> load_max=<x>
 *     load_total=<x> rss_max=<MiB> manifest=<bytes>
 *
 * save/load: seconds, best of 3 (a durable collective ckpt_save_state to
 * the next automatic checkpoint, then a verified collective ckpt_load_state
 * of it, page cache warm). save_max / load_max: the most bytes one rank
 * wrote / read on files during one save / load (counted in the library's
 * I/O layer), over state/P; load_total: the bytes all ranks read, over the
 * state. rss_max: the highest peak resident set of a rank (its own copy of
 * the model, its share of the moments, and what a save and a load add).
 * manifest: checkpoint.json's size. FOLDER/mpi<p> is removed at the end.
 * Then a second line on rank 0, what a load adds to a rank's memory:
 *
 *   bench_mpi P=<p> load memory: held_max=<x> extra_max=<MiB> per rank
 *     (MiB): extra <e0> <e1> ... rss <r0> <r1> ...
 *
 * held_max: the most checkpoint bytes one rank held during a load
 * (ckpt__load_held_peak: the files it read, those it was sent, the
 * streaming window), over state/P. extra: per rank, the rise of its resident
 * set during a load (the peak, VmHWM, reset just before the load through
 * /proc/self/clear_refs, less VmRSS then); rss: per rank, its peak resident
 * set over the whole run.
 *
 *   mpirun -np P bench_mpi --dp FOLDER
 *
 * The same, data parallel: AdamW replicated too (no ckpt_optimizer_set_shard),
 * so every rank holds the whole state and a load streams every replicated
 * tensor to it.
 *
 *   mpirun -np P bench_mpi --manifest FOLDER
 *
 * The cheap mode, for process counts whose full state does not fit the
 * machine: the same model and ZeRO-1 AdamW (the same 148 tensors, shapes and
 * sharding), but every parameter and gradient points into one read-only
 * mapping of zero pages shared by all of them, and no optimizer step runs
 * (the moments are the zeros AdamW allocates), so a rank holds only its
 * share of the moments. It makes one real collective save (the save plan,
 * every file written, fsynced and hashed, the manifest committed by rank 0)
 * and prints, on rank 0:
 *
 *   bench_mpi_manifest P=<p> manifest=<bytes> files=<n> chunks=<n>
 *
 * The manifest is the one a save of the trained state would commit, byte for
 * byte as long: only values differ (zeros), and a value changes no field's
 * length in it (digests are 16 hex digits). Point FOLDER at a tmpfs to spare
 * the disk: the manifest does not depend on the file system. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>

#include "ckpt.h"
#include "gpt2.h"
#include "ckpt_mpi.h"
#include "accel/load_held.h"
#include "base/io.h"
#include "format/manifest.h"

#define REPS 3 /* BENCH_REPS=<n> in the environment: n instead */

static int rank_;

static void die(const char *what) {
    fprintf(stderr, "bench_mpi: rank %d: %s: %s\n", rank_, what, ckpt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* A field of /proc/self/status in KiB (VmRSS:, VmHWM:); 0 if not found. */
static uint64_t status_kib(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    char line[256];
    uint64_t v = 0;
    size_t n = strlen(field);
    while (f && fgets(line, sizeof line, f))
        if (strncmp(line, field, n) == 0) v = strtoull(line + n, NULL, 10);
    if (f) fclose(f);
    return v;
}

/* Resets VmHWM to the current resident set (Linux 4.0 on). */
static void reset_peak(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return;
    fputs("5", f);
    fclose(f);
}

static ckpt_model *model;
static int64_t total_elems;
static float *zero_pages; /* --manifest: every parameter and gradient, read-only */

static void add(const char *name, int ndim, int64_t a, int64_t b) {
    int64_t numel = ndim == 1 ? a : a * b;
    int64_t shape[2] = {a, b};
    if (zero_pages) {
        if (ckpt_model_add_param(model, name, CKPT_F32, ndim, shape, zero_pages, zero_pages) < 0)
            die(name);
        total_elems += numel;
        return;
    }
    float *data = malloc((size_t)numel * sizeof *data);
    float *grad = malloc((size_t)numel * sizeof *grad);
    if (!data || !grad) die("out of memory");
    for (int64_t i = 0; i < numel; i++) {
        data[i] = (float)((i * 7 + total_elems) % 1000) * 1e-3f;
        grad[i] = (float)((i * 13 + total_elems) % 997) * 1e-4f - 0.05f;
    }
    if (ckpt_model_add_param(model, name, CKPT_F32, ndim, shape, data, grad) < 0) die(name);
    total_elems += numel;
}

static void gpt2_small(void) { gpt2_small_each(add); }

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    bool manifest_only = argc == 3 && strcmp(argv[1], "--manifest") == 0;
    bool dp = argc == 3 && strcmp(argv[1], "--dp") == 0;
    if (argc != 2 && !manifest_only && !dp) {
        fprintf(stderr, "usage: mpirun -np P bench_mpi [--manifest|--dp] FOLDER\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *folder = argv[argc - 1];
    ckpt_comm *comm = NULL;
    if (ckpt_comm_mpi(&comm, MPI_COMM_WORLD) < 0) die("comm");
    rank_ = comm->rank;
    char project[4096];
    snprintf(project, sizeof project, "%s/mpi%d%s", folder, comm->size,
             manifest_only ? "m"
             : dp          ? "d"
                           : "");

    size_t zero_len = (size_t)VOCAB * D * sizeof(float); /* the largest tensor */
    if (manifest_only) {
        void *z = mmap(NULL, zero_len, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (z == MAP_FAILED) die("mmap");
        zero_pages = z;
    }
    if (ckpt_model_new(&model) < 0) die("model");
    gpt2_small();
    ckpt_optimizer *opt = NULL;
    if (ckpt_adamw_new(&opt, model, 1e-4, 0.9, 0.999, 1e-8, 0.01) < 0) die("adamw");
    if (!dp && ckpt_optimizer_set_shard(opt, comm) < 0) die("set_shard");
    if (!manifest_only && ckpt_optimizer_step(opt) < 0) die("step"); /* non-zero moments */

    ckpt_project_config cfg = {.project_dir = project, .automatic_checkpoint_naming = true,
                               .total_limit = 1, .comm = comm};
    ckpt_accelerator *acc = NULL;
    if (ckpt_accelerator_new(&acc, &cfg) < 0) die("accelerator");
    if (ckpt_prepare_model(acc, model) < 0 || ckpt_prepare_optimizer(acc, opt) < 0) die("prepare");

    if (manifest_only) {
        if (ckpt_save_state(acc, NULL) < 0) die("save");
        if (rank_ == 0) {
            ckpt_manifest m;
            int64_t chunks = 0;
            const char *dir = ckpt_accelerator_last_dir(acc);
            ckpt__manifest_init(&m);
            if (ckpt__manifest_read(dir, &m) < 0) die("manifest");
            for (int64_t i = 0; i < m.nfiles; i++)
                if (m.files[i].chunks) chunks += m.files[i].ntensors;
            long long nfiles = (long long)m.nfiles;
            ckpt__manifest_clear(&m);
            char mp[4200];
            struct stat st;
            snprintf(mp, sizeof mp, "%s/checkpoint.json", dir);
            long long msize = stat(mp, &st) == 0 ? (long long)st.st_size : -1;
            printf("bench_mpi_manifest P=%d manifest=%lld files=%lld chunks=%lld\n", comm->size,
                   msize, nfiles, (long long)chunks);
        }
    }
    double best_save = 1e30, best_load = 1e30;
    uint64_t io[3] = {0, 0, 0}; /* this rank: written by a save, read by a load, read by a save */
    uint64_t held = 0, extra_kib = 0; /* the most over the loads */
    int reps = getenv("BENCH_REPS") ? atoi(getenv("BENCH_REPS")) : REPS;
    if (manifest_only) reps = 0;
    for (int rep = 0; rep < reps || (!manifest_only && rep == 0); rep++) {
        ckpt_io_bytes b0, b1, b2;
        MPI_Barrier(MPI_COMM_WORLD);
        ckpt__io_bytes(&b0);
        double t0 = now();
        if (ckpt_save_state(acc, NULL) < 0) die("save");
        MPI_Barrier(MPI_COMM_WORLD);
        double t1 = now();
        ckpt__io_bytes(&b1);
        reset_peak();
        uint64_t rss0 = status_kib("VmRSS:");
        if (ckpt_load_state(acc, NULL) < 0) die("load");
        uint64_t hwm = status_kib("VmHWM:");
        if (hwm > rss0 && hwm - rss0 > extra_kib) extra_kib = hwm - rss0;
        if (ckpt__load_held_peak() > held) held = ckpt__load_held_peak();
        MPI_Barrier(MPI_COMM_WORLD);
        double t2 = now();
        ckpt__io_bytes(&b2);
        if (t1 - t0 < best_save) best_save = t1 - t0;
        if (t2 - t1 < best_load) best_load = t2 - t1;
        io[0] = b1.written - b0.written;
        io[1] = b2.read - b1.read;
        io[2] = b1.read - b0.read;
    }
    uint64_t bytes = (uint64_t)total_elems * 4u * 3u; /* weights + exp_avg + exp_avg_sq */
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    /* per rank: held, the load's rise, the run's peak (KiB) */
    uint64_t per[3] = {held, extra_kib, (uint64_t)ru.ru_maxrss};
    uint64_t *all = rank_ == 0 ? calloc((size_t)comm->size * 3, sizeof *all) : NULL;
    if (rank_ == 0 && !all) die("out of memory");
    MPI_Gather(per, 3, MPI_UINT64_T, all, 3, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    uint64_t mine[4] = {io[0], io[1], io[2], (uint64_t)ru.ru_maxrss}, most[4], sum[4];
    MPI_Reduce(mine, most, 4, MPI_UINT64_T, MPI_MAX, 0, MPI_COMM_WORLD);
    MPI_Reduce(mine, sum, 4, MPI_UINT64_T, MPI_SUM, 0, MPI_COMM_WORLD);
    if (rank_ == 0 && !manifest_only) {
        char mp[4200];
        struct stat st;
        snprintf(mp, sizeof mp, "%s/checkpoint.json", ckpt_accelerator_last_dir(acc));
        long long msize = stat(mp, &st) == 0 ? (long long)st.st_size : -1;
        double share = (double)bytes / comm->size;
        printf("bench_mpi P=%d bytes=%llu save=%.3f load=%.3f save_max=%.2f load_max=%.2f "
               "load_total=%.2f rss_max=%.0f manifest=%lld\n",
               comm->size, (unsigned long long)bytes, best_save, best_load,
               (double)most[0] / share, (double)most[1] / share, (double)sum[1] / (double)bytes,
               (double)most[3] / 1024.0, msize);
        uint64_t hmax = 0, emax = 0;
        for (int r = 0; r < comm->size; r++) {
            if (all[3 * r] > hmax) hmax = all[3 * r];
            if (all[3 * r + 1] > emax) emax = all[3 * r + 1];
        }
        printf("bench_mpi P=%d load memory: held_max=%.2f extra_max=%.0f per rank (MiB): extra",
               comm->size, (double)hmax / share, (double)emax / 1024.0);
        for (int r = 0; r < comm->size; r++) printf(" %.0f", (double)all[3 * r + 1] / 1024.0);
        printf(" rss");
        for (int r = 0; r < comm->size; r++) printf(" %.0f", (double)all[3 * r + 2] / 1024.0);
        printf("\n");
    }
    free(all);
    ckpt_accelerator_free(acc);
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_ == 0 && !getenv("BENCH_KEEP")) { /* BENCH_KEEP=1: leave FOLDER/mpi<p>[m] */
        char cmd[4200];
        snprintf(cmd, sizeof cmd, "rm -rf '%s'", project);
        if (system(cmd) != 0) fprintf(stderr, "bench_mpi: could not remove %s\n", project);
    }
    ckpt_optimizer_free(opt);
    for (int64_t i = 0; !manifest_only && i < ckpt_model_num_params(model); i++) {
        ckpt_param_info pi;
        if (ckpt_model_param(model, i, &pi) == 0) {
            free(pi.data);
            free(pi.grad);
        }
    }
    ckpt_model_free(model);
    if (zero_pages) munmap(zero_pages, zero_len);
    ckpt_comm_free(comm);
    MPI_Finalize();
    return 0;
}
