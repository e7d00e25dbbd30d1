/* bench_mpi_tiers.c — storage tiers on 2 simulated nodes of 2 ranks each
 * (ranks_per_node 2, 4 MPI processes on this machine): a data-parallel model
 * of MIB MiB (default 128, in 16 tensors) with a ZeRO-1 AdamW (moments 2x
 * the model, sharded), so the state is 3 x MIB MiB and each rank's part
 * about a quarter of it. Every time is the best of BENCH_REPS (default 3),
 * each a collective call between barriers, and every ratio is against a
 * time measured in the same run:
 *
 *   mpirun -np 4 bench_mpi_tiers FOLDER [MIB]
 *
 * FOLDER holds the project folders (a disk); the node-local tiers go to
 * FOLDER (disk) and to /dev/shm (memory) in turn. Rank 0 prints:
 *
 *   bench_mpi_tiers state=<bytes> part=<bytes> (the largest rank's part)
 *   save: project <s> | disk tier <s> (<x>) +replica <s> (<x>) | memory tier <s> (<x>)
 *         +replica <s> (<x>) | persisted (memory + replica + project) <s> (<x>)
 *     ratios against the save to the project folder alone
 *   replication: <bytes> sent per rank a save (<x> its part), <s> (memory tier, replica
 *     against none), peak RSS +<MiB> over a save without replica
 *   load: project <s> | memory tier <s> (<x>) | node 1 lost, from node 0 <s> (<x>)
 *     ratios against the load from the project folder (what recovery takes without tiers)
 *   async stall: project <s> | memory tier +replica, replicated in the background <s> (<x>)
 *     | at the next call <s> (<x>): the caller's stall at ckpt_save_state_async, with
 *     1.5x a synchronous save's time of training (a sleep) between saves
 *   footprint: node <n> holds <bytes> (<x> the state) on disk / in memory, per tier folder
 *
 * The loads read files the page cache holds (warm). The folders are
 * removed at the end. */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "ckpt_mpi.h"
#include "base/io.h"

#define NT 16

static int rank_;
static ckpt_comm *comm;
static ckpt_model *model;
static ckpt_optimizer *opt;
static float *data[NT], *grad[NT];
static int reps = 3;

static void die(const char *what) {
    fprintf(stderr, "bench_mpi_tiers: rank %d: %s: %s\n", rank_, what, ckpt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

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

static void reset_peak(void) {
    FILE *f = fopen("/proc/self/clear_refs", "w");
    if (!f) return;
    fputs("5", f);
    fclose(f);
}

static void rm_rf(const char *path) {
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", path);
    if (system(cmd) != 0) fprintf(stderr, "bench_mpi_tiers: could not remove %s\n", path);
}

/* Bytes of the files under path (du's apparent size, by a walk). */
static uint64_t tree_bytes(const char *path) {
    char cmd[4400];
    snprintf(cmd, sizeof cmd, "du -sb --apparent-size '%s' 2>/dev/null", path);
    FILE *p = popen(cmd, "r");
    unsigned long long v = 0;
    if (p && fscanf(p, "%llu", &v) != 1) v = 0;
    if (p) pclose(p);
    return v;
}

/* An accelerator of the model and optimizer: a tier in local (NULL: none),
 * replicas (-1: none), persisted every `every` saves. */
static ckpt_accelerator *make(const char *project, const char *local, int replicas, int every) {
    ckpt_project_config cfg = {.project_dir = project,
                               .automatic_checkpoint_naming = true,
                               .total_limit = 1,
                               .comm = comm,
                               .local_dir = local,
                               .local_replicas = replicas,
                               .persist_every = every,
                               .ranks_per_node = local ? 2 : 0,
                               .collective_timeout_s = getenv("BENCH_NO_DEADLINE") ? -1 : 0};
    ckpt_accelerator *acc = NULL;
    if (ckpt_accelerator_new(&acc, &cfg) < 0) die("accelerator");
    if (ckpt_prepare_model(acc, model) < 0 || ckpt_prepare_optimizer(acc, opt) < 0) die("prepare");
    return acc;
}

/* The best time of reps saves; *rss: the most a save raised the peak RSS
 * (KiB); *sent: this rank's bytes written by the library in the last one. */
static double time_saves(ckpt_accelerator *acc, uint64_t *rss, uint64_t *written) {
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        ckpt_optimizer_step(opt); /* a state that changed: nothing is linked */
        reset_peak();
        uint64_t before = status_kib("VmRSS:");
        ckpt_io_bytes b0, b1;
        MPI_Barrier(MPI_COMM_WORLD);
        ckpt__io_bytes(&b0);
        double t0 = now();
        if (ckpt_save_state(acc, NULL) < 0) die("save");
        MPI_Barrier(MPI_COMM_WORLD);
        double t = now() - t0;
        ckpt__io_bytes(&b1);
        if (t < best) best = t;
        uint64_t hwm = status_kib("VmHWM:");
        if (rss && hwm > before && hwm - before > *rss) *rss = hwm - before;
        if (written) *written = b1.written - b0.written;
    }
    return best;
}

/* The best time of reps loads by a fresh accelerator each (a job that
 * starts again); before each, lose (if not NULL) is removed on the ranks
 * of node 1 (their tier folders: a lost node). */
static double time_loads(const char *project, const char *local, const char *lose) {
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        MPI_Barrier(MPI_COMM_WORLD);
        if (lose && rank_ == 2) rm_rf(lose);
        MPI_Barrier(MPI_COMM_WORLD);
        ckpt_accelerator *acc = make(project, local, 1, 1000000);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        if (ckpt_load_state(acc, NULL) < 0) die("load");
        MPI_Barrier(MPI_COMM_WORLD);
        double t = now() - t0;
        if (t < best) best = t;
        ckpt_accelerator_free(acc);
    }
    return best;
}

static double maxd(double v) {
    double m = 0;
    MPI_Allreduce(&v, &m, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    return m;
}

/* Asynchronous saves: the caller's stall, the slowest rank's, at each
 * ckpt_save_state_async (which first ends the previous save: its commit,
 * and without a background channel its replication), with `train` seconds
 * of "training" (a sleep) between saves; the best of reps after a first
 * one. c: the communicator the accelerator gets. */
static double time_async(const ckpt_comm *c, const char *project, const char *local, double train) {
    ckpt_project_config cfg = {.project_dir = project,
                               .automatic_checkpoint_naming = true,
                               .total_limit = 1,
                               .comm = c,
                               .local_dir = local,
                               .persist_every = 1000000,
                               .ranks_per_node = local ? 2 : 0};
    ckpt_accelerator *acc = NULL;
    if (ckpt_accelerator_new(&acc, &cfg) < 0) die("accelerator");
    if (ckpt_prepare_model(acc, model) < 0 || ckpt_prepare_optimizer(acc, opt) < 0) die("prepare");
    if (ckpt_accelerator_prepare_async(acc) < 0) die("prepare_async");
    double best = 1e30;
    for (int r = 0; r <= reps; r++) {
        ckpt_optimizer_step(opt);
        MPI_Barrier(MPI_COMM_WORLD);
        double t0 = now();
        if (ckpt_save_state_async(acc, NULL) < 0) die("save_state_async");
        double t = maxd(now() - t0);
        if (r > 0 && t < best) best = t;
        usleep((useconds_t)(train * 1e6));
    }
    if (ckpt_save_wait(acc) < 0) die("save_wait");
    ckpt_accelerator_free(acc);
    return best;
}

int main(int argc, char **argv) {
    int level = 0; /* MPI_THREAD_MULTIPLE: replication in the background */
    MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &level);
    if (argc < 2 || argc > 3) {
        fprintf(stderr, "usage: mpirun -np 4 bench_mpi_tiers FOLDER [MIB]\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (getenv("BENCH_REPS")) reps = atoi(getenv("BENCH_REPS"));
    if (reps < 1) reps = 1;
    const char *folder = argv[1];
    int64_t mib = argc == 3 ? atoll(argv[2]) : 128;
    if (ckpt_comm_mpi(&comm, MPI_COMM_WORLD) < 0) die("comm");
    rank_ = comm->rank;
    if (comm->size != 4) {
        if (rank_ == 0) fprintf(stderr, "bench_mpi_tiers: run it on 4 processes\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    /* the model: NT tensors of mib/NT MiB each, rows of 1024 floats */
    if (ckpt_model_new(&model) < 0) die("model");
    int64_t rows = mib * 1024 * 1024 / 4 / 1024 / NT;
    for (int t = 0; t < NT; t++) {
        size_t n = (size_t)rows * 1024;
        data[t] = malloc(n * sizeof(float));
        grad[t] = malloc(n * sizeof(float));
        if (!data[t] || !grad[t]) die("out of memory");
        for (size_t i = 0; i < n; i++) {
            data[t][i] = (float)((i * 7 + (size_t)t) % 1000) * 1e-3f;
            grad[t][i] = (float)((i * 13 + (size_t)t) % 997) * 1e-4f - 0.05f;
        }
        char name[32];
        snprintf(name, sizeof name, "layer%d.weight", t);
        if (ckpt_model_add_param(model, name, CKPT_F32, 2, (int64_t[]){rows, 1024}, data[t],
                                 grad[t]) < 0)
            die(name);
    }
    if (ckpt_adamw_new(&opt, model, 1e-4, 0.9, 0.999, 1e-8, 0.01) < 0) die("adamw");
    if (ckpt_optimizer_set_shard(opt, comm) < 0) die("set_shard");
    uint64_t state = (uint64_t)rows * 1024 * NT * 4 * 3;

    char base[4096], shm[4096], p[6][4200], l[6][4200];
    snprintf(base, sizeof base, "%s/tiers", folder);
    snprintf(shm, sizeof shm, "/dev/shm/bench_mpi_tiers.%d", (int)getppid());
    for (int i = 0; i < 6; i++) snprintf(p[i], sizeof p[i], "%s/p%d", base, i);
    snprintf(l[1], sizeof l[1], "%s/d1/n%%n", base); /* disk, no replica */
    snprintf(l[2], sizeof l[2], "%s/d2/n%%n", base); /* disk, a replica */
    snprintf(l[3], sizeof l[3], "%s/m3/n%%n", shm);  /* memory, no replica */
    snprintf(l[4], sizeof l[4], "%s/m4/n%%n", shm);  /* memory, a replica */
    snprintf(l[5], sizeof l[5], "%s/m5/n%%n", shm);  /* memory, a replica, persisted */

    /* saves */
    uint64_t rss_none = 0, rss_rep = 0, w_none = 0, w_rep = 0;
    double save[6];
    ckpt_accelerator *acc = make(p[0], NULL, 0, 0);
    save[0] = maxd(time_saves(acc, NULL, NULL));
    ckpt_accelerator_free(acc);
    double load_proj = maxd(time_loads(p[0], NULL, NULL));
    for (int i = 1; i <= 5; i++) {
        bool rep = i == 2 || i == 4 || i == 5;
        acc = make(p[i], l[i], rep ? 1 : -1, i == 5 ? 1 : 1000000);
        save[i] = maxd(time_saves(acc,
                                  i == 3   ? &rss_none
                                  : i == 4 ? &rss_rep
                                           : NULL,
                                  i == 3   ? &w_none
                                  : i == 4 ? &w_rep
                                           : NULL));
        ckpt_accelerator_free(acc);
    }
    /* each node's folders after the saves (before a lost node's load) */
    uint64_t foot[2][2] = {{0, 0}, {0, 0}};
    for (int n = 0; rank_ == 0 && n < 2; n++) {
        char d[4200], m[4200];
        snprintf(d, sizeof d, "%s/d2/n%d", base, n);
        snprintf(m, sizeof m, "%s/m4/n%d", shm, n);
        foot[n][0] = tree_bytes(d);
        foot[n][1] = tree_bytes(m);
    }
    /* loads from the memory tier with a replica: whole, then node 1 lost */
    double load_tier = maxd(time_loads(p[4], l[4], NULL));
    char lost[4200];
    snprintf(lost, sizeof lost, "%s/m4/n1", shm);
    double load_lost = maxd(time_loads(p[4], l[4], lost));

    /* asynchronous saves: no tier; memory tier with a replica, replicated in
     * the background, and (a comm without the channel) at the next call */
    double train = 1.5 * save[4], async[3] = {0, 0, 0};
    if (comm->exchange_background) {
        ckpt_comm fg = *comm; /* the same channels but the background one */
        fg.exchange_background = NULL;
        fg.destroy = NULL;
        async[0] = time_async(comm, p[0], NULL, train);
        async[1] = time_async(comm, p[4], l[4], train);
        async[2] = time_async(&fg, p[4], l[4], train);
    }

    /* this rank's part: what it writes without a replica; what the replica adds */
    uint64_t mine[3] = {w_none, w_rep > w_none ? w_rep - w_none : 0,
                        rss_rep > rss_none ? rss_rep - rss_none : 0};
    uint64_t most[3];
    MPI_Reduce(mine, most, 3, MPI_UINT64_T, MPI_MAX, 0, MPI_COMM_WORLD);
    if (rank_ == 0) {
        printf("bench_mpi_tiers state=%llu part=%llu (4 ranks as 2 nodes of 2, best of %d)\n",
               (unsigned long long)state, (unsigned long long)most[0], reps);
        printf("bench_mpi_tiers save: project %.3f s | disk tier %.3f s (%.2fx) +replica %.3f s "
               "(%.2fx) | memory tier %.3f s (%.2fx) +replica %.3f s (%.2fx) | persisted "
               "(memory + replica + project) %.3f s (%.2fx); x: against the project\n",
               save[0], save[1], save[1] / save[0], save[2], save[2] / save[0], save[3],
               save[3] / save[0], save[4], save[4] / save[0], save[5], save[5] / save[0]);
        printf("bench_mpi_tiers replication: %llu bytes written per rank a save for the replica "
               "(%.2fx its own part), %.3f s a save (memory tier, %.2fx the save without), peak "
               "RSS +%.1f MiB over the save without\n",
               (unsigned long long)most[1], most[0] ? (double)most[1] / (double)most[0] : 0.0,
               save[4] - save[3], save[4] / save[3], (double)most[2] / 1024.0);
        printf("bench_mpi_tiers load: project %.3f s | memory tier %.3f s (%.2fx) | node 1 lost, "
               "from node 0 %.3f s (%.2fx); x: against the project\n",
               load_proj, load_tier, load_tier / load_proj, load_lost, load_lost / load_proj);
        if (async[0] > 0)
            printf("bench_mpi_tiers async stall: project %.3f s | memory tier +replica, replicated "
                   "in the background %.3f s (%.2fx) | at the next call %.3f s (%.2fx); %.1f s of "
                   "training between saves; x: against the project\n",
                   async[0], async[1], async[1] / async[0], async[2], async[2] / async[0], train);
        else printf("bench_mpi_tiers async stall: not measured (MPI below MPI_THREAD_MULTIPLE)\n");
        for (int n = 0; n < 2; n++) {
            uint64_t bd = foot[n][0], bm = foot[n][1];
            printf("bench_mpi_tiers footprint: node %d holds %llu bytes on disk (%.2fx the state, "
                   "one save, a replica), %llu in memory (%.2fx)\n",
                   n, (unsigned long long)bd, (double)bd / (double)state, (unsigned long long)bm,
                   (double)bm / (double)state);
        }
    }
    MPI_Barrier(MPI_COMM_WORLD);
    if (rank_ == 0 && !getenv("BENCH_KEEP")) {
        rm_rf(base);
        rm_rf(shm);
    }
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    for (int t = 0; t < NT; t++) {
        free(data[t]);
        free(grad[t]);
    }
    ckpt_comm_free(comm);
    MPI_Finalize();
    return 0;
}
