/* comm_mpi.c — libckpt_mpi: the collectives of a ckpt_comm on MPI. Only the
 * public API of libckpt is used (errors through ckpt_set_error), so this
 * file builds into its own library. */
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt_mpi.h"

typedef struct mpi_ctx {
    MPI_Comm comm;
} mpi_ctx;

static int mpi_fail(int err, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(err, msg, &len) != MPI_SUCCESS) len = 0;
    msg[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = '\0';
    return ckpt_set_error(CKPT_EIO, "MPI: %s: %s", what, len ? msg : "error");
}

static int mpi_barrier(void *ctx) {
    int e = MPI_Barrier(((mpi_ctx *)ctx)->comm);
    return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Barrier");
}

/* MPI counts are int: large buffers go in pieces of at most 1 GiB. */
#define PIECE ((size_t)1 << 30)

static int mpi_bcast(void *ctx, void *buf, size_t n, int root) {
    mpi_ctx *c = ctx;
    for (size_t off = 0; off < n; off += PIECE) {
        size_t k = n - off < PIECE ? n - off : PIECE;
        int e = MPI_Bcast((char *)buf + off, (int)k, MPI_BYTE, root, c->comm);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Bcast");
    }
    return CKPT_OK;
}

static int comm_size(MPI_Comm comm) {
    int p = 1;
    MPI_Comm_size(comm, &p);
    return p;
}

/* Counts and displacements as MPI wants them; CKPT_EINVAL beyond INT_MAX
 * bytes in all (records and gradients are far smaller). */
static int layout(const size_t *lens, int p, int **counts, int **displs, const char *what) {
    *counts = malloc((size_t)p * sizeof **counts);
    *displs = malloc((size_t)p * sizeof **displs);
    if (!*counts || !*displs) {
        free(*counts), free(*displs);
        *counts = *displs = NULL;
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (%s)", what);
    }
    size_t total = 0;
    for (int r = 0; r < p; r++) {
        if (lens[r] > (size_t)INT_MAX - total) {
            free(*counts), free(*displs);
            *counts = *displs = NULL;
            return ckpt_set_error(CKPT_EINVAL, "%s: more than %d bytes in all", what, INT_MAX);
        }
        (*displs)[r] = (int)total;
        (*counts)[r] = (int)lens[r];
        total += lens[r];
    }
    return CKPT_OK;
}

static int mpi_gather(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root) {
    mpi_ctx *c = ctx;
    int rank = 0, p = comm_size(c->comm);
    MPI_Comm_rank(c->comm, &rank);
    uint64_t mine = n;
    /* Out of memory on one rank leaves the others waiting in the
     * collective: MPI has no way back from that, as for any MPI program. */
    uint64_t *all = rank == root ? malloc((size_t)p * sizeof *all) : NULL;
    if (rank == root && !all) return ckpt_set_error(CKPT_ENOMEM, "out of memory (gather)");
    int e = MPI_Gather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, root, c->comm);
    if (e != MPI_SUCCESS) {
        free(all);
        return mpi_fail(e, "MPI_Gather");
    }
    int *counts = NULL, *displs = NULL;
    char *data = NULL;
    int rc = CKPT_OK;
    if (rank == root) {
        for (int r = 0; r < p; r++) lens[r] = (size_t)all[r];
        rc = layout(lens, p, &counts, &displs, "gather");
        if (rc == 0) {
            size_t total = (size_t)displs[p - 1] + lens[p - 1];
            data = malloc(total ? total : 1);
            if (!data) rc = ckpt_set_error(CKPT_ENOMEM, "out of memory (gather)");
        }
    } else if (n > INT_MAX) {
        rc = ckpt_set_error(CKPT_EINVAL, "gather: %zu bytes from one rank, more than %d", n, INT_MAX);
    }
    free(all);
    /* A size MPI cannot count, on any rank, stops every rank here alike. */
    int bad = rc < 0;
    e = MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT, MPI_MAX, c->comm);
    if (e != MPI_SUCCESS && rc == 0) rc = mpi_fail(e, "MPI_Allreduce");
    if (bad && rc == 0) rc = ckpt_set_error(CKPT_EINVAL, "gather: another rank's data is too large");
    if (rc < 0) {
        free(counts), free(displs), free(data);
        return rc;
    }
    e = MPI_Gatherv(buf, (int)n, MPI_BYTE, data, counts, displs, MPI_BYTE, root, c->comm);
    free(counts);
    free(displs);
    if (e != MPI_SUCCESS) {
        free(data);
        return mpi_fail(e, "MPI_Gatherv");
    }
    if (rank == root) *out = data;
    return CKPT_OK;
}

static int mpi_allgather(void *ctx, const void *buf, void *out, const size_t *lens) {
    mpi_ctx *c = ctx;
    int rank = 0, p = comm_size(c->comm);
    MPI_Comm_rank(c->comm, &rank);
    int *counts = NULL, *displs = NULL;
    int rc = layout(lens, p, &counts, &displs, "allgather");
    if (rc < 0) return rc;
    int e = MPI_Allgatherv(buf, counts[rank], MPI_BYTE, out, counts, displs, MPI_BYTE, c->comm);
    free(counts);
    free(displs);
    return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Allgatherv");
}

static int mpi_allreduce_i64(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    MPI_Op mop = op == CKPT_REDUCE_MIN ? MPI_MIN : op == CKPT_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    int e = MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_INT64_T, mop, ((mpi_ctx *)ctx)->comm);
    return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Allreduce");
}

static void mpi_destroy(void *ctx) {
    mpi_ctx *c = ctx;
    if (!c) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized && c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
    free(c);
}

/* local_rank/local_size from the node's ranks; node = how many nodes have
 * a lowest rank below this node's. */
static int find_node(ckpt_comm *out, MPI_Comm comm) {
    MPI_Comm node_comm = MPI_COMM_NULL;
    int e = MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, out->rank, MPI_INFO_NULL, &node_comm);
    if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Comm_split_type");
    MPI_Comm_rank(node_comm, &out->local_rank);
    MPI_Comm_size(node_comm, &out->local_size);
    int leader = out->rank; /* the node's lowest rank (its local rank 0) */
    e = MPI_Bcast(&leader, 1, MPI_INT, 0, node_comm);
    MPI_Comm_free(&node_comm);
    if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Bcast");
    int *leads = malloc((size_t)out->size * sizeof *leads);
    int is_leader = out->local_rank == 0;
    if (!leads) return ckpt_set_error(CKPT_ENOMEM, "out of memory (comm_mpi)");
    e = MPI_Allgather(&is_leader, 1, MPI_INT, leads, 1, MPI_INT, comm);
    if (e != MPI_SUCCESS) {
        free(leads);
        return mpi_fail(e, "MPI_Allgather");
    }
    out->node = out->num_nodes = 0;
    for (int r = 0; r < out->size; r++) {
        if (!leads[r]) continue;
        if (r < leader) out->node++;
        out->num_nodes++;
    }
    free(leads);
    return CKPT_OK;
}

int ckpt_comm_mpi(ckpt_comm **out, MPI_Comm comm) {
    if (!out) return ckpt_set_error(CKPT_EINVAL, "comm_mpi: out is NULL");
    *out = NULL;
    int inited = 0;
    MPI_Initialized(&inited);
    if (!inited) return ckpt_set_error(CKPT_EINVAL, "comm_mpi: MPI is not initialised (MPI_Init)");
    if (comm == MPI_COMM_NULL) return ckpt_set_error(CKPT_EINVAL, "comm_mpi: comm is MPI_COMM_NULL");
    ckpt_comm *c = calloc(1, sizeof *c);
    mpi_ctx *ctx = calloc(1, sizeof *ctx);
    if (!c || !ctx) {
        free(c), free(ctx);
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (comm_mpi)");
    }
    ctx->comm = MPI_COMM_NULL;
    int e = MPI_Comm_dup(comm, &ctx->comm);
    if (e != MPI_SUCCESS) {
        free(c), free(ctx);
        return mpi_fail(e, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(ctx->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ctx->comm, &c->rank);
    MPI_Comm_size(ctx->comm, &c->size);
    c->ctx = ctx;
    c->barrier = mpi_barrier;
    c->bcast = mpi_bcast;
    c->gather = mpi_gather;
    c->allgather = mpi_allgather;
    c->allreduce_i64 = mpi_allreduce_i64;
    c->destroy = mpi_destroy;
    int rc = find_node(c, ctx->comm);
    if (rc < 0) {
        ckpt_comm_free(c);
        return rc;
    }
    *out = c;
    return CKPT_OK;
}
