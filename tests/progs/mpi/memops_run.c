/* memops_run.c — memory ckpt cannot touch, under MPI: a model whose
 * parameters and external AdamW state (ZeRO-1 sharded) live on an emulated
 * device (tests/emudev.h: PROT_NONE outside the ops' own copies).
 *
 *   mpirun -np P memops_run <project_dir> save|host|load
 *
 * The state: "emb" F32 [1536, 1024] (6 MiB: the save plan spreads its rows
 * over the ranks' shard files, the load streams it), "w" F32 [64, 32] and
 * "b" F32 [32] (host memory), each with exp_avg and exp_avg_sq; every rank
 * holds the same values (a function of the element only), its optimizer
 * sharded over the ranks (ckpt_optimizer_set_shard). save saves the device
 * state twice (synchronously, then asynchronously: checkpoints 0 and 1, every
 * file written); host saves the same values held in host memory once
 * (the shell compares the two checkpoints file by file); load zeros the
 * device and loads the newest checkpoint (saved by any process count).
 * Each rank prints
 *
 *   rank <r> <mode> <CKPT_STATUS> <message>
 *   rank <r> values saved|wrong             (load only)
 *   rank <r> to_host <bytes> from_host <bytes> total <bytes> errors <n>
 *
 * total: the bytes of the device state (what a rank would move if it moved
 * everything); errors: ops calls out of bounds, over CKPT_MEMORY_PIECE or
 * from another thread. tests/integration/test_memops_mpi.sh checks them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_mpi.h"
#include "../../emudev.h"

enum { NP = 3 };
static const char *const NAME[NP] = {"emb", "w", "b"};
static const int64_t SHAPE[NP][2] = {{1536, 1024}, {64, 32}, {32, 0}};
static const int NDIM[NP] = {2, 2, 1};
static const char *const FIELD[2] = {"exp_avg", "exp_avg_sq"};

static int64_t numel(int i) { return SHAPE[i][0] * (NDIM[i] > 1 ? SHAPE[i][1] : 1); }
static float value(int i, int f, int64_t k) {
    return (float)(i * 1000000 + f * 100000) + (float)k * 0.5f;
}

static void say(int rank, const char *what, int rc) {
    const char *name = ckpt_strerror(rc);
    printf("rank %d %s %.*s %s\n", rank, what, (int)strcspn(name, ":"), name,
           rc < 0 ? ckpt_errmsg() : "");
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <project_dir> save|host|load\n", argv[0]);
        return 2;
    }
    const char *mode = argv[2];
    bool dev = strcmp(mode, "host") != 0;
    MPI_Init(&argc, &argv);
    int rank;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    emudev_init();
    void *val[NP], *st[NP][2];
    uint64_t total = 0;
    ckpt_model *m = NULL;
    ckpt_optimizer *o = NULL;
    ckpt_comm *comm = NULL;
    ckpt_accelerator *acc = NULL;
    bool ok = ckpt_model_new(&m) == 0;
    for (int i = 0; ok && i < NP; i++) {
        bool on = dev && i != 2;
        size_t n = (size_t)numel(i);
        float *host[3];
        for (int f = 0; f < 3; f++) {
            host[f] = malloc(n * 4);
            for (size_t k = 0; k < n; k++) host[f][k] = value(i, f, (int64_t)k);
        }
        val[i] = on ? emudev_alloc(n * 4, host[0]) : host[0];
        for (int f = 0; f < 2; f++) st[i][f] = on ? emudev_alloc(n * 4, host[f + 1]) : host[f + 1];
        for (int f = 0; f < 3; f++)
            if (on) free(host[f]);
        if (on) total += 3 * n * 4;
        ok =
            (on ? ckpt_model_add_param_mem(m, NAME[i], CKPT_F32, NDIM[i], SHAPE[i], &emudev_ops,
                                           val[i])
                : ckpt_model_add_param(m, NAME[i], CKPT_F32, NDIM[i], SHAPE[i], val[i], NULL)) == 0;
    }
    ckpt_optim_options opt = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    ok = ok && ckpt_optimizer_external_new(&o, CKPT_OPTIM_ADAMW, m, &opt) == 0;
    for (int i = 0; ok && i < NP; i++)
        for (int f = 0; ok && f < 2; f++)
            ok = (dev && i != 2
                      ? ckpt_optimizer_set_state_mem(o, NAME[i], FIELD[f], &emudev_ops, st[i][f])
                      : ckpt_optimizer_set_state(o, NAME[i], FIELD[f], st[i][f])) == 0;
    ckpt_project_config cfg = {.project_dir = argv[1],
                               .automatic_checkpoint_naming = true,
                               .collective_timeout_s = 120,
                               .no_link_unchanged = true};
    bool load = strcmp(mode, "load") == 0;
    ok = ok && ckpt_comm_mpi(&comm, MPI_COMM_WORLD) == 0 &&
         ckpt_optimizer_set_shard(o, comm) == 0 && ckpt_optimizer_set_step(o, load ? 0 : 7) == 0 &&
         (cfg.comm = comm, ckpt_accelerator_new(&acc, &cfg)) == 0 &&
         ckpt_prepare_model(acc, m) == 0 && ckpt_prepare_optimizer(acc, o) == 0;
    if (!ok) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, ckpt_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    if (!load) { /* host: one save; save: a synchronous one, then an asynchronous one */
        int rc = ckpt_save_state(acc, NULL);
        if (rc == 0 && dev) rc = ckpt_save_state_async(acc, NULL);
        if (rc == 0) rc = ckpt_save_wait(acc);
        say(rank, mode, rc);
    } else {
        void *zero = calloc((size_t)numel(0), 4);
        for (int i = 0; i < 2; i++) {
            emudev_poke(val[i], 0, zero, (size_t)numel(i) * 4);
            for (int f = 0; f < 2; f++) emudev_poke(st[i][f], 0, zero, (size_t)numel(i) * 4);
        }
        say(rank, mode, ckpt_load_state(acc, NULL));
        /* the parameters whole on every rank; the state: this rank's share
         * at least (what it loaded: its rows are the saved values) */
        float *got = malloc((size_t)numel(0) * 4);
        bool good = ckpt_optimizer_get_step(o) == 7;
        for (int i = 0; i < 2; i++) {
            emudev_peek(val[i], 0, got, (size_t)numel(i) * 4);
            for (int64_t k = 0; k < numel(i); k++) good &= got[k] == value(i, 0, k);
            for (int f = 0; f < 2; f++) {
                emudev_peek(st[i][f], 0, got, (size_t)numel(i) * 4);
                int64_t held = 0;
                for (int64_t k = 0; k < numel(i); k++) {
                    if (got[k] == 0.0f) continue; /* another rank's share */
                    good &= got[k] == value(i, f + 1, k);
                    held++;
                }
                good &= held > 0 || i == 1; /* "w" may fall in one rank's share */
            }
        }
        printf("rank %d values %s\n", rank, good ? "saved" : "wrong");
        free(got);
        free(zero);
    }
    printf("rank %d to_host %llu from_host %llu total %llu errors %d\n", rank,
           (unsigned long long)emudev_g.to_host_bytes, (unsigned long long)emudev_g.from_host_bytes,
           (unsigned long long)total, emudev_g.errors + emudev_g.foreign_thread);
    fflush(stdout);
    ckpt_accelerator_free(acc);
    ckpt_comm_free(comm);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
    for (int i = 0; i < NP; i++)
        if (!dev || i == 2) {
            free(val[i]);
            free(st[i][0]);
            free(st[i][1]);
        }
    emudev_free_all();
    MPI_Finalize();
    return 0;
}
