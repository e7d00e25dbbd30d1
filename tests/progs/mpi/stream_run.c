/* stream_run.c — a load of many processes whose replicated tensors are
 * streamed (docs/DISTRIBUTED.md, "Who receives what"), and how it fails.
 *
 *   mpirun -np P stream_run <project_dir> <case>
 *
 * Every rank registers one custom object: two replicated F32 tensors "a"
 * and "b" of 2 MiB each (so the save spreads them over the ranks' shard
 * files and the load streams them) and a tensor "s" sharded by rows over
 * the ranks. It saves, overwrites its values with a sentinel, and loads.
 * By case, the last rank:
 *
 *   same     nothing (the load must give back every value)
 *   order    reads "b" before "a" in load_state_dict
 *   refuse   refuses the state in load_state_dict before reading anything
 *   check    refuses it in check_state_dict after reading "a", which every
 *            rank's check_state_dict reads in this case (streamed in the
 *            check phase)
 *   slice    reads, in check_state_dict, the rows of "s" another rank owns
 *            (never sent to it: the needed piece is missing)
 *   corrupt  flips a bit of every piece of 128 KiB or more it receives
 *            through a broadcast after the save (its communicator's bcast,
 *            wrapped): a transfer corrupted on the way
 *
 * Each rank prints
 *
 *   rank <r> load <CKPT_STATUS> <message>
 *   rank <r> values saved|sentinel|mixed
 *   rank <r> save <CKPT_STATUS>
 *
 * (the save after the load: refused after a failed apply). The shell test
 * (tests/integration/test_stream.sh) checks the statuses and messages are
 * the same on every rank and which values each rank holds. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_mpi.h"

enum { N = 512 * 1024, ROWS = 64, COLS = 256 };

typedef struct obj {
    float *a, *b, *s; /* s: this rank's rows [lo, hi) of [ROWS, COLS] */
    int64_t lo, hi;
    int rank, size;
    const char *mode; /* the case, on the last rank; "same" elsewhere */
    bool check_reads; /* every rank's check_state_dict reads "a" */
} obj;

static const int64_t n1[1] = {N}, sg[2] = {ROWS, COLS};

static int obj_save(void *self, ckpt_writer *w) {
    obj *o = self;
    int rc = ckpt_write_tensor(w, "a", CKPT_F32, 1, n1, o->a);
    if (!rc) rc = ckpt_write_tensor(w, "b", CKPT_F32, 1, n1, o->b);
    int64_t off[2] = {o->lo, 0}, loc[2] = {o->hi - o->lo, COLS};
    if (!rc) rc = ckpt_write_tensor_shard(w, "s", CKPT_F32, 2, sg, off, loc, o->s);
    return rc;
}

static int read_rows(ckpt_reader *r, int64_t lo, int64_t hi, float *dst) {
    int64_t off[2] = {lo, 0}, loc[2] = {hi - lo, COLS};
    return ckpt_read_tensor_shard(r, "s", CKPT_F32, 2, sg, off, loc, dst);
}

static int obj_load(void *self, ckpt_reader *r) {
    obj *o = self;
    if (strcmp(o->mode, "refuse") == 0) {
        fprintf(stderr, "stream_run: rank %d refuses\n", o->rank);
        return -1;
    }
    bool swap = strcmp(o->mode, "order") == 0;
    int rc = ckpt_read_tensor(r, swap ? "b" : "a", CKPT_F32, 1, n1, swap ? o->b : o->a);
    if (!rc) rc = ckpt_read_tensor(r, swap ? "a" : "b", CKPT_F32, 1, n1, swap ? o->a : o->b);
    if (!rc) rc = read_rows(r, o->lo, o->hi, o->s);
    return rc;
}

static int obj_check(void *self, ckpt_reader *r) {
    obj *o = self;
    if (o->check_reads) {
        float *tmp = malloc(sizeof(float) * N);
        if (!tmp) return -1;
        int rc = ckpt_read_tensor(r, "a", CKPT_F32, 1, n1, tmp);
        bool good = rc == 0 && tmp[N - 1] == (float)(10000000 + N - 1);
        free(tmp);
        if (rc) return rc;
        if (!good) return -2;
        if (strcmp(o->mode, "check") == 0) {
            fprintf(stderr, "stream_run: rank %d refuses in its check\n", o->rank);
            return -1; /* read, then refused */
        }
    }
    if (strcmp(o->mode, "slice") == 0) {
        int64_t lo = o->rank == 0 ? o->hi : 0, hi = o->rank == 0 ? ROWS : o->lo;
        float *tmp = malloc(sizeof(float) * (size_t)((hi - lo) * COLS) + 1);
        if (!tmp) return -1;
        int rc = read_rows(r, lo, hi, tmp);
        free(tmp);
        return rc;
    }
    return 0;
}

static float saved(int t, int64_t i) { return (float)(t * 10000000 + i); }

/* "corrupt": the wrapped broadcast of the last rank. */
static int (*real_bcast)(void *ctx, void *buf, size_t n, int root);
static int my_rank;

static int flip_bcast(void *ctx, void *buf, size_t n, int root) {
    int rc = real_bcast(ctx, buf, n, root);
    if (rc == 0 && root != my_rank && n >= (size_t)128 << 10) ((unsigned char *)buf)[n / 2] ^= 1;
    return rc;
}

static void fill(obj *o, bool sentinel) {
    for (int64_t i = 0; i < N; i++) {
        o->a[i] = sentinel ? -1.0f : saved(1, i);
        o->b[i] = sentinel ? -1.0f : saved(2, i);
    }
    for (int64_t i = 0; i < (o->hi - o->lo) * COLS; i++)
        o->s[i] = sentinel ? -1.0f : saved(3, o->lo * COLS + i);
}

/* "saved" if every value is the saved one, "sentinel" if none was touched. */
static const char *which(const obj *o) {
    int64_t good = 0, sent = 0, n = 2 * N + (o->hi - o->lo) * COLS;
    for (int64_t i = 0; i < N; i++) {
        good += (o->a[i] == saved(1, i)) + (o->b[i] == saved(2, i));
        sent += (o->a[i] == -1.0f) + (o->b[i] == -1.0f);
    }
    for (int64_t i = 0; i < (o->hi - o->lo) * COLS; i++) {
        good += o->s[i] == saved(3, o->lo * COLS + i);
        sent += o->s[i] == -1.0f;
    }
    return good == n ? "saved" : sent == n ? "sentinel" : "mixed";
}

static void say(int rank, const char *what, int rc, bool msg) {
    const char *name = ckpt_strerror(rc);
    printf("rank %d %s %.*s %s\n", rank, what, (int)strcspn(name, ":"), name,
           rc < 0 && msg ? ckpt_errmsg() : "");
    fflush(stdout);
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s <project_dir> same|order|refuse|check|slice|corrupt\n", argv[0]);
        return 2;
    }
    MPI_Init(&argc, &argv);
    int rank, size;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    obj o = {.rank = rank, .size = size, .mode = rank == size - 1 ? argv[2] : "same"};
    o.lo = ROWS * rank / size;
    o.hi = ROWS * (rank + 1) / size;
    o.a = malloc(sizeof(float) * N);
    o.b = malloc(sizeof(float) * N);
    o.s = malloc(sizeof(float) * (size_t)((o.hi - o.lo) * COLS) + 1);
    static const ckpt_stateful_ops ops = {obj_save, obj_load, obj_check};
    ckpt_project_config cfg = {
        .project_dir = argv[1], .automatic_checkpoint_naming = true, .collective_timeout_s = 60};
    ckpt_comm *comm = NULL;
    ckpt_accelerator *acc = NULL;
    if (!o.a || !o.b || !o.s || ckpt_comm_mpi(&comm, MPI_COMM_WORLD) != 0 ||
        (cfg.comm = comm, ckpt_accelerator_new(&acc, &cfg)) != 0 ||
        ckpt_register_for_checkpointing(acc, &ops, &o) != 0) {
        fprintf(stderr, "rank %d: setup: %s\n", rank, ckpt_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    fill(&o, false);
    const char *keep = o.mode;
    o.mode = "same";
    if (ckpt_save_state(acc, NULL) != 0) {
        fprintf(stderr, "rank %d: save: %s\n", rank, ckpt_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    o.mode = keep;
    o.check_reads = strcmp(argv[2], "check") == 0;
    if (strcmp(o.mode, "corrupt") == 0) {
        my_rank = rank;
        real_bcast = comm->bcast;
        comm->bcast = flip_bcast;
    }
    fill(&o, true);
    say(rank, "load", ckpt_load_state(acc, NULL), true);
    printf("rank %d values %s\n", rank, which(&o));
    fflush(stdout);
    say(rank, "save", ckpt_save_state(acc, NULL), false);
    ckpt_accelerator_free(acc);
    ckpt_comm_free(comm);
    free(o.a);
    free(o.b);
    free(o.s);
    MPI_Finalize();
    return 0;
}
