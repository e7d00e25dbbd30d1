/* comm.c — the one-process communicator, and freeing constructed ones.
 * Real process groups come from libckpt_mpi (src/mpi) or from the user. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"

static int self_barrier(void *ctx) {
    (void)ctx;
    return CKPT_OK;
}

static int self_bcast(void *ctx, void *buf, size_t n, int root) {
    (void)ctx, (void)buf, (void)n;
    return root == 0 ? CKPT_OK : ckpt__err(CKPT_EINVAL, "comm: bcast root %d outside [0, 1)", root);
}

static int self_gather(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root) {
    (void)ctx;
    if (root != 0) return ckpt__err(CKPT_EINVAL, "comm: gather root %d outside [0, 1)", root);
    void *p = malloc(n ? n : 1);
    if (!p) return ckpt__err_nomem("comm gather");
    if (n) memcpy(p, buf, n);
    *out = p;
    lens[0] = n;
    return CKPT_OK;
}

static int self_allgather(void *ctx, const void *buf, void *out, const size_t *lens) {
    (void)ctx;
    if (lens[0] && out != buf) memmove(out, buf, lens[0]);
    return CKPT_OK;
}

static int self_allreduce_i64(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    (void)ctx, (void)v, (void)n, (void)op;
    return CKPT_OK;
}

static const ckpt_comm self_comm = {
    .rank = 0, .size = 1, .local_rank = 0, .local_size = 1, .node = 0, .num_nodes = 1,
    .ctx = NULL,
    .barrier = self_barrier,
    .bcast = self_bcast,
    .gather = self_gather,
    .allgather = self_allgather,
    .allreduce_i64 = self_allreduce_i64,
    .destroy = NULL,
};

const ckpt_comm *ckpt_comm_self(void) { return &self_comm; }

void ckpt_comm_free(ckpt_comm *c) {
    if (!c) return;
    if (c->destroy) c->destroy(c->ctx);
    free(c);
}
