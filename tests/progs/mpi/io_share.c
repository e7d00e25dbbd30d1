/* io_share.c — proof by counting that each of P ranks saves and loads about
 * 1/P of a checkpoint. Run under `mpirun -np P io_share FOLDER LAYOUT`:
 *
 *   dp       a model and AdamW, both replicated (data parallel)
 *   zero1    the model replicated, AdamW sharded (ckpt_optimizer_set_shard)
 *   sharded  one custom object whose tensor is split by rows over the ranks
 *   hf       dp, with the model saved as Hugging Face shards (max_shard_size
 *            2 MiB: four shards, spread over the ranks by the save plan)
 *   frozen   dp, with two of the four parameters frozen
 *            (ckpt_model_set_frozen): the save keeps the two trainable ones
 *            whole in the model's own file, on rank 0, so that the frozen
 *            shard files stay the same and are linked; rank 0 writes and
 *            reads 4 MiB more than its share, so only the bound below on
 *            what a rank is sent applies
 *
 * The state is 24 MiB of tensors in each layout. Every rank counts the bytes
 * the library reads and writes on files (ckpt__io_bytes: every pread, mmap,
 * write and pwrite of the I/O layer) during one ckpt_save_state and one
 * ckpt_load_state; rank 0 prints a line per phase
 *
 *   io_share LAYOUT P=<p> save: max=<bytes> total=<bytes> ratio=<max/(state/P)>
 *
 * and fails (exit 1) unless, for the save and for the load, the most any
 * rank moved is at most 1.25 x state/P + 1 MiB and the bytes read by all
 * ranks together are at most 1.25 x state. The load must also give back the
 * saved values bit for bit (they are overwritten between save and load).
 * Rank 0 also prints the most bytes of checkpoint files one rank held in
 * memory during the load (ckpt__load_held_peak: the files it read and those
 * it received)
 *
 *   io_share LAYOUT P=<p> load held: max=<bytes> ratio=<max/(state/P)> per rank: ...
 *
 * and, in every layout, fails unless that is at most 1.25 x state/P + 3 MiB
 * (the transfer window: here the largest tensor, 2 MiB; and 1 MiB): each
 * rank holds the files it read, is sent only the shard files whose chunks
 * meet its slices, and receives the replicated tensors (a model saved as
 * Hugging Face shards: its parts' tensors, after their headers; a large
 * model file's tensors) streamed, a window at a time. And in every layout
 * (the process count is the save's), a rank holds at most 2 MiB + 64 KiB
 * beyond the bytes it read itself (the window: the largest streamed
 * tensor, 2 MiB here): it is sent no large file whole, only small ones and
 * headers.
 * Then a second save of the unchanged state: an incremental save, in which
 * every rank links its own files from the first checkpoint and writes none
 * (rank 0 writes the manifest only); rank 0 prints
 *
 *   io_share LAYOUT P=<p> second save: every rank linked its own files */
#include <mpi.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "ckpt_mpi.h"
#include "accel/load_held.h"
#include "base/io.h"

#define MIB ((uint64_t)1 << 20)
#define ROWS 2048
#define COLS 1024 /* a [2048, 1024] F32 tensor is 8 MiB */

static int rank_, size_;

static void die(const char *what) {
    fprintf(stderr, "io_share: rank %d: %s: %s\n", rank_, what, ckpt_errmsg());
    MPI_Abort(MPI_COMM_WORLD, 2);
}

/* The fully sharded custom object: rows [lo, hi) of a [3 * ROWS, COLS] F32
 * tensor (24 MiB in all). */
typedef struct rows_obj {
    int64_t lo, hi;
    float *data;
} rows_obj;

static int rows_state_dict(void *self, ckpt_writer *w) {
    rows_obj *o = self;
    int64_t g[2] = {3 * ROWS, COLS}, off[2] = {o->lo, 0}, sh[2] = {o->hi - o->lo, COLS};
    return ckpt_write_tensor_shard(w, "rows", CKPT_F32, 2, g, off, sh, o->data);
}

static int rows_load(void *self, ckpt_reader *r) {
    rows_obj *o = self;
    int64_t g[2] = {3 * ROWS, COLS}, off[2] = {o->lo, 0}, sh[2] = {o->hi - o->lo, COLS};
    return ckpt_read_tensor_shard(r, "rows", CKPT_F32, 2, g, off, sh, o->data);
}

static float value(int64_t i, int salt) { return (float)((i * 7 + salt) % 1009) * 0.001f; }

typedef struct counts {
    uint64_t read, written;
} counts;

static counts since(const ckpt_io_bytes *a) {
    ckpt_io_bytes b;
    ckpt__io_bytes(&b);
    return (counts){b.read - a->read, b.written - a->written};
}

/* Gathers every rank's count; on rank 0 prints the phase's line and checks
 * the bounds. Returns 1 on rank 0 if a bound is broken. */
static int report(const char *layout, const char *phase, counts mine, uint64_t state, bool bound) {
    uint64_t v[2] = {mine.read, mine.written}, *all = NULL;
    if (rank_ == 0 && !(all = malloc(sizeof v * (size_t)size_))) die("out of memory");
    MPI_Gather(v, 2, MPI_UINT64_T, all, 2, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    if (rank_ != 0) return 0;
    bool save = strcmp(phase, "save") == 0;
    uint64_t max = 0, total_read = 0;
    for (int r = 0; r < size_; r++) {
        uint64_t moved = save ? all[2 * r + 1] : all[2 * r];
        if (moved > max) max = moved;
        total_read += all[2 * r];
    }
    double share = (double)state / size_;
    printf("io_share %-7s P=%d %s: max=%llu total_read=%llu ratio=%.2f per rank:", layout, size_,
           phase, (unsigned long long)max, (unsigned long long)total_read, (double)max / share);
    for (int r = 0; r < size_; r++)
        printf(" %llu", (unsigned long long)(save ? all[2 * r + 1] : all[2 * r]));
    printf("\n");
    free(all);
    int bad = 0;
    if (bound && (double)max > 1.25 * share + (double)MIB) {
        fprintf(stderr, "io_share %s P=%d %s: one rank moved %llu bytes, more than 1.25 x %.0f + "
                        "1 MiB\n", layout, size_, phase, (unsigned long long)max, share);
        bad = 1;
    }
    if ((double)total_read > 1.25 * (double)state) {
        fprintf(stderr, "io_share %s P=%d %s: the ranks read %llu bytes in all, more than 1.25 x "
                        "%llu\n", layout, size_, phase, (unsigned long long)total_read,
                (unsigned long long)state);
        bad = 1;
    }
    fflush(stdout);
    return bad;
}

/* The most checkpoint bytes one rank held during the load; rank 0 prints
 * it and, where bound, checks it. Returns 1 on rank 0 if the bound is
 * broken. */
static int report_held(const char *layout, uint64_t state, bool bound, uint64_t read) {
    uint64_t mine[2] = {ckpt__load_held_peak(), read}, *all = NULL;
    if (rank_ == 0 && !(all = malloc(sizeof mine * (size_t)size_))) die("out of memory");
    MPI_Gather(mine, 2, MPI_UINT64_T, all, 2, MPI_UINT64_T, 0, MPI_COMM_WORLD);
    if (rank_ != 0) return 0;
    uint64_t max = 0;
    int64_t got = INT64_MIN; /* the most held beyond what a rank read itself */
    for (int r = 0; r < size_; r++) {
        if (all[2 * r] > max) max = all[2 * r];
        if ((int64_t)(all[2 * r] - all[2 * r + 1]) > got)
            got = (int64_t)(all[2 * r] - all[2 * r + 1]);
    }
    double share = (double)state / size_, limit = 1.25 * share + (double)(3 * MIB);
    printf("io_share %-7s P=%d load held: max=%llu ratio=%.2f beyond_read=%lld per rank:", layout,
           size_, (unsigned long long)max, (double)max / share, (long long)got);
    for (int r = 0; r < size_; r++) printf(" %llu", (unsigned long long)all[2 * r]);
    printf("\n");
    fflush(stdout);
    free(all);
    int bad = 0;
    if (bound && (double)max > limit) {
        fprintf(stderr,
                "io_share %s P=%d load: one rank held %llu bytes, more than 1.25 x %.0f + "
                "3 MiB\n",
                layout, size_, (unsigned long long)max, share);
        bad = 1;
    }
    if (got > (int64_t)(2 * MIB + 64 * 1024)) {
        fprintf(stderr,
                "io_share %s P=%d load: a rank held %lld bytes beyond what it read, more than the "
                "window (2 MiB here) + 64 KiB: it was sent a large file whole\n",
                layout, size_, (long long)got);
        bad = 1;
    }
    return bad;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    if (argc != 3) {
        fprintf(stderr, "usage: mpirun -np P io_share FOLDER dp|zero1|sharded|hf|frozen\n");
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    const char *layout = argv[2];
    bool dp = !strcmp(layout, "dp"), zero1 = !strcmp(layout, "zero1");
    bool sharded = !strcmp(layout, "sharded"), hf = !strcmp(layout, "hf");
    bool frozen = !strcmp(layout, "frozen");
    if (!dp && !zero1 && !sharded && !hf && !frozen) die("unknown layout");
    ckpt_comm *comm = NULL;
    if (ckpt_comm_mpi(&comm, MPI_COMM_WORLD) < 0) die("comm");
    rank_ = comm->rank;
    size_ = comm->size;
    char project[4096];
    snprintf(project, sizeof project, "%s/%s-%d", argv[1], layout, size_);
    /* link_copies 1: the second save of an unchanged state links every
     * file (with the default it would write a second copy) */
    ckpt_project_config cfg = {.project_dir = project,
                               .automatic_checkpoint_naming = true,
                               .comm = comm,
                               .max_shard_size = hf ? 2 * MIB : 0,
                               .link_copies = 1};
    ckpt_accelerator *acc = NULL;
    if (ckpt_accelerator_new(&acc, &cfg) < 0) die("accelerator");

    ckpt_model *model = NULL;
    ckpt_optimizer *opt = NULL;
    rows_obj ro = {0};
    float *params[4] = {0}, *grads[4] = {0};
    const int64_t n = (int64_t)ROWS * COLS / 4; /* four [ROWS / 4, COLS] parameters */
    if (!sharded) {
        if (ckpt_model_new(&model) < 0) die("model");
        for (int p = 0; p < 4; p++) {
            params[p] = malloc((size_t)n * sizeof(float));
            grads[p] = malloc((size_t)n * sizeof(float));
            if (!params[p] || !grads[p]) die("out of memory");
            for (int64_t i = 0; i < n; i++) {
                params[p][i] = value(i, p);
                grads[p][i] = value(i, p + 10) - 0.5f;
            }
            char name[32];
            snprintf(name, sizeof name, "layer%d.weight", p);
            int64_t shape[2] = {ROWS / 4, COLS};
            if (ckpt_model_add_param(model, name, CKPT_F32, 2, shape, params[p], grads[p]) < 0)
                die(name);
        }
        if (frozen && (ckpt_model_set_frozen(model, "layer0.*", true) < 0 ||
                       ckpt_model_set_frozen(model, "layer1.*", true) < 0))
            die("set_frozen");
        if (ckpt_adamw_new(&opt, model, 1e-3, 0.9, 0.999, 1e-8, 0.01) < 0) die("adamw");
        if (zero1 && ckpt_optimizer_set_shard(opt, comm) < 0) die("set_shard");
        if (ckpt_optimizer_step(opt) < 0) die("step"); /* non-zero moments */
        if (ckpt_prepare_model(acc, model) < 0 || ckpt_prepare_optimizer(acc, opt) < 0)
            die("prepare");
    } else {
        ro.lo = 3 * (int64_t)ROWS * rank_ / size_;
        ro.hi = 3 * (int64_t)ROWS * (rank_ + 1) / size_;
        ro.data = malloc((size_t)(ro.hi - ro.lo) * COLS * sizeof(float) + 1);
        if (!ro.data) die("out of memory");
        for (int64_t i = 0; i < (ro.hi - ro.lo) * COLS; i++)
            ro.data[i] = value(ro.lo * COLS + i, 3);
        static const ckpt_stateful_ops ops = {.state_dict = rows_state_dict,
                                              .load_state_dict = rows_load};
        if (ckpt_register_for_checkpointing(acc, &ops, &ro) < 0) die("register");
    }
    const uint64_t state = 3 * (uint64_t)ROWS * COLS * sizeof(float);

    ckpt_io_bytes t0;
    MPI_Barrier(MPI_COMM_WORLD);
    ckpt__io_bytes(&t0);
    if (ckpt_save_state(acc, NULL) < 0) die("save");
    counts s = since(&t0);
    int bad = report(layout, "save", s, state, !frozen);

    /* Overwrite what was saved, so that the load has to bring it back. */
    float *keep = NULL;
    if (!sharded) {
        keep = malloc(4 * (size_t)n * sizeof(float));
        if (!keep) die("out of memory");
        for (int p = 0; p < 4; p++) {
            memcpy(keep + p * n, params[p], (size_t)n * sizeof(float));
            memset(params[p], 0, (size_t)n * sizeof(float));
        }
    } else {
        memset(ro.data, 0, (size_t)(ro.hi - ro.lo) * COLS * sizeof(float));
    }
    MPI_Barrier(MPI_COMM_WORLD);
    ckpt__io_bytes(&t0);
    if (ckpt_load_state(acc, NULL) < 0) die("load");
    counts l = since(&t0);
    bad |= report(layout, "load", l, state, !frozen);
    bad |= report_held(layout, state, !frozen, l.read);
    int wrong = 0;
    if (!sharded) {
        for (int p = 0; p < 4; p++)
            wrong |= memcmp(keep + p * n, params[p], (size_t)n * sizeof(float)) != 0;
    } else {
        for (int64_t i = 0; i < (ro.hi - ro.lo) * COLS && !wrong; i++)
            wrong = ro.data[i] != value(ro.lo * COLS + i, 3);
    }
    if (wrong) {
        fprintf(stderr, "io_share %s P=%d: rank %d: the load did not give back the saved values\n",
                layout, size_, rank_);
        bad = 1;
    }

    /* Nothing changed since the first save: each rank links what it wrote. */
    MPI_Barrier(MPI_COMM_WORLD);
    ckpt__io_bytes(&t0);
    if (ckpt_save_state(acc, NULL) < 0) die("second save");
    counts s2 = since(&t0);
    uint64_t written = 0, linked = 0;
    ckpt_accelerator_last_save_bytes(acc, &written, &linked);
    if (written != 0 || linked == 0 || s2.written > (rank_ == 0 ? MIB : 0)) {
        fprintf(stderr,
                "io_share %s P=%d: rank %d: second save wrote %llu bytes of state files (%llu "
                "in all), linked %llu: expected only links\n",
                layout, size_, rank_, (unsigned long long)written, (unsigned long long)s2.written,
                (unsigned long long)linked);
        bad = 1;
    }
    MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    if (!bad && rank_ == 0)
        printf("io_share %s P=%d second save: every rank linked its own files\n", layout, size_);

    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    for (int p = 0; p < 4; p++) {
        free(params[p]);
        free(grads[p]);
    }
    free(keep);
    free(ro.data);
    ckpt_comm_free(comm);
    MPI_Finalize();
    return bad;
}
