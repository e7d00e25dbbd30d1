/* order_run.c — ranks that save different objects or tensors under mpirun.
 *
 *   mpirun -np P order_run <project_dir> <case>
 *
 * Every rank registers two objects, each one replicated tensor; the first
 * save has the same state on every rank. Before the second save the last
 * rank changes, by case: "same" nothing, "shape" the first tensor's shape,
 * "name" its name, "order" the order it registers the objects in, "extra" a
 * third object. Each rank prints
 *
 *   rank <r> <what> <CKPT_STATUS> <message>
 *
 * for what = save1, save2. The shell test (tests/integration/
 * test_mpi_order.sh) checks that save2 fails alike on every rank (or, for
 * "same", succeeds) and that nothing was committed. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_mpi.h"

enum { N = 64 * 1024 };

typedef struct obj {
    const char *key;
    int64_t n;
    float *t;
} obj;

static int obj_save(void *self, ckpt_writer *w) {
    obj *o = self;
    return ckpt_write_tensor(w, o->key, CKPT_F32, 1, (int64_t[]){o->n}, o->t);
}

static int obj_load(void *self, ckpt_reader *r) {
    (void)self, (void)r;
    return 0;
}

static void say(int rank, const char *what, int rc) {
    const char *name = ckpt_strerror(rc);
    printf("rank %d %s %.*s %s\n", rank, what, (int)strcspn(name, ":"), name,
           rc < 0 ? ckpt_errmsg() : "");
    fflush(stdout);
}

static ckpt_accelerator *open_acc(const char *dir, const ckpt_comm *comm, obj *objs, int n,
                                  bool swap) {
    static const ckpt_stateful_ops ops = {obj_save, obj_load, NULL};
    ckpt_project_config cfg = {
        .project_dir = dir, .automatic_checkpoint_naming = true, .comm = comm};
    ckpt_accelerator *acc = NULL;
    if (ckpt_accelerator_new(&acc, &cfg) != 0) return NULL;
    for (int i = 0; i < n; i++) {
        int k = swap && i < 2 ? 1 - i : i;
        if (ckpt_register_for_checkpointing(acc, &ops, &objs[k]) != 0) {
            ckpt_accelerator_free(acc);
            return NULL;
        }
    }
    return acc;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <project_dir> same|shape|name|order|extra\n", argv[0]);
        return 2;
    }
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    const char *c = argv[2];
    static float data[3][N];
    for (int k = 0; k < 3; k++)
        for (int i = 0; i < N; i++) data[k][i] = (float)(k * N + i);
    obj objs[3] = {{"a", N, data[0]}, {"b", N, data[1]}, {"c", N, data[2]}};
    ckpt_comm *comm = NULL;
    ckpt_accelerator *acc = NULL;
    if (ckpt_comm_mpi(&comm, MPI_COMM_WORLD) != 0 ||
        !(acc = open_acc(argv[1], comm, objs, 2, false))) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, ckpt_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    say(rank, "save1", ckpt_save_state(acc, NULL));
    bool odd = rank == size - 1, swap = false;
    int n = 2;
    if (odd && strcmp(c, "shape") == 0) objs[0].n = N / 2;
    if (odd && strcmp(c, "name") == 0) objs[0].key = "z";
    if (odd && strcmp(c, "order") == 0) swap = true;
    if (odd && strcmp(c, "extra") == 0) n = 3;
    /* A fresh accelerator per rank (the objects are registered in order). */
    ckpt_accelerator_free(acc);
    if (!(acc = open_acc(argv[1], comm, objs, n, swap))) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, ckpt_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    say(rank, "save2", ckpt_save_state(acc, NULL));
    ckpt_accelerator_free(acc);
    ckpt_comm_free(comm);
    MPI_Finalize();
    return 0;
}
