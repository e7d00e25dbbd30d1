/* reshard_check.c — saves a small multi-process state on P ranks and checks
 * it loaded on Q ranks, bit for bit:
 *
 *   mpirun -np P reshard_check save FOLDER    (FOLDER/checkpoints/checkpoint_0)
 *   mpirun -np Q reshard_check check FOLDER   (loads that checkpoint)
 *
 * The state: a model of two parameters ([5, 3] and [4]) with AdamW after one
 * step, sharded ZeRO-1 over the ranks unless CKPT_TEST_ZERO=0, and a custom
 * object holding rows [lo, hi) of a [7, 2] F32 tensor (on 3 ranks, rank 2
 * holds none). check compares the parameters and the custom rows with the
 * values the saver had, then takes one more step and compares the
 * parameters with a job that never saved: equal bit for bit only if the
 * moments came back exactly. Exit 0 if all is equal.
 *
 * tests/fixtures/v1-3proc is what `save` on 3 ranks wrote with the library
 * of format version 1 (rank 0 wrote every replicated tensor, every rank a
 * chunk of every sharded key, empty ones included). */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "ckpt_mpi.h"

static int rank_;

static void die(const char *what) {
    fprintf(stderr, "reshard_check: rank %d: %s: %s\n", rank_, what, ckpt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 2);
}

typedef struct rows_obj {
    int64_t lo, hi;
    float data[14];
} rows_obj;

static int rows_sd(void *self, ckpt_writer *w) {
    rows_obj *o = self;
    int64_t g[2] = {7, 2}, off[2] = {o->lo, 0}, sh[2] = {o->hi - o->lo, 2};
    return ckpt_write_tensor_shard(w, "rows", CKPT_F32, 2, g, off, sh, o->data);
}
static int rows_load(void *self, ckpt_reader *r) {
    rows_obj *o = self;
    int64_t g[2] = {7, 2}, off[2] = {o->lo, 0}, sh[2] = {o->hi - o->lo, 2};
    return ckpt_read_tensor_shard(r, "rows", CKPT_F32, 2, g, off, sh, o->data);
}

typedef struct job {
    ckpt_model *model;
    ckpt_optimizer *opt;
    float a[15], b[4], ga[15], gb[4];
    rows_obj rows;
} job;

/* The state every run starts from, and one step of AdamW on it. */
static void job_new(job *j, ckpt_comm *comm, int p) {
    memset(j, 0, sizeof *j);
    for (int i = 0; i < 15; i++) {
        j->a[i] = 0.25f * (float)i - 1.0f;
        j->ga[i] = 0.1f * (float)(i % 4);
    }
    for (int i = 0; i < 4; i++) j->b[i] = 0.5f + (float)i, j->gb[i] = -0.2f * (float)i;
    if (ckpt_model_new(&j->model) < 0) die("model");
    if (ckpt_model_add_param(j->model, "a", CKPT_F32, 2, (int64_t[]){5, 3}, j->a, j->ga) < 0 ||
        ckpt_model_add_param(j->model, "b", CKPT_F32, 1, (int64_t[]){4}, j->b, j->gb) < 0)
        die("params");
    if (ckpt_adamw_new(&j->opt, j->model, 1e-2, 0.9, 0.999, 1e-8, 0.01) < 0) die("adamw");
    const char *zero = getenv("CKPT_TEST_ZERO");
    if ((!zero || strcmp(zero, "0") != 0) && ckpt_optimizer_set_shard(j->opt, comm) < 0)
        die("set_shard");
    if (ckpt_optimizer_step(j->opt) < 0) die("step");
    /* 7 rows over p ranks, the last rank holding none when p = 3 */
    static const int64_t lo3[3] = {0, 4, 7}, hi3[3] = {4, 7, 7};
    j->rows.lo = p == 3 ? lo3[rank_] : rank_ * 7 / p;
    j->rows.hi = p == 3 ? hi3[rank_] : (rank_ + 1) * 7 / p;
    for (int64_t i = 0; i < (j->rows.hi - j->rows.lo) * 2; i++)
        j->rows.data[i] = 3.0f + (float)(j->rows.lo * 2 + i);
}

static void job_free(job *j) {
    ckpt_optimizer_free(j->opt);
    ckpt_model_free(j->model);
}

static ckpt_accelerator *accel(job *j, ckpt_comm *comm, const char *dir) {
    ckpt_project_config cfg = {.project_dir = dir, .automatic_checkpoint_naming = true,
                               .comm = comm};
    ckpt_accelerator *acc = NULL;
    static const ckpt_stateful_ops ops = {.state_dict = rows_sd, .load_state_dict = rows_load};
    if (ckpt_accelerator_new(&acc, &cfg) < 0 || ckpt_prepare_model(acc, j->model) < 0 ||
        ckpt_prepare_optimizer(acc, j->opt) < 0 ||
        ckpt_register_for_checkpointing(acc, &ops, &j->rows) < 0)
        die("accelerator");
    return acc;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    if (argc != 3 || (strcmp(argv[1], "save") && strcmp(argv[1], "check"))) {
        fprintf(stderr, "usage: mpirun -np P reshard_check save|check FOLDER\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    ckpt_comm *comm = NULL;
    if (ckpt_comm_mpi(&comm, MPI_COMM_WORLD) < 0) die("comm");
    rank_ = comm->rank;
    int bad = 0;
    job ref;
    job_new(&ref, comm, comm->size);
    if (!strcmp(argv[1], "save")) {
        ckpt_accelerator *acc = accel(&ref, comm, argv[2]);
        if (ckpt_save_state(acc, NULL) < 0) die("save");
        ckpt_accelerator_free(acc);
    } else {
        job got;
        job_new(&got, comm, comm->size);
        memset(got.a, 0, sizeof got.a);
        memset(got.b, 0, sizeof got.b);
        memset(got.rows.data, 0, sizeof got.rows.data);
        ckpt_accelerator *acc = accel(&got, comm, argv[2]);
        char dir[4200];
        snprintf(dir, sizeof dir, "%s/checkpoints/checkpoint_0", argv[2]);
        if (ckpt_load_state(acc, dir) < 0) die("load");
        bad |= memcmp(got.a, ref.a, sizeof got.a) || memcmp(got.b, ref.b, sizeof got.b);
        bad |= memcmp(got.rows.data, ref.rows.data, sizeof got.rows.data) != 0;
        if (ckpt_optimizer_step(got.opt) < 0 || ckpt_optimizer_step(ref.opt) < 0) die("step");
        bad |= memcmp(got.a, ref.a, sizeof got.a) || memcmp(got.b, ref.b, sizeof got.b);
        if (bad) fprintf(stderr, "reshard_check: rank %d: loaded state differs\n", rank_);
        ckpt_accelerator_free(acc);
        job_free(&got);
    }
    job_free(&ref);
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    ckpt_comm_free(comm);
    MPI_Finalize();
    return bad;
}
