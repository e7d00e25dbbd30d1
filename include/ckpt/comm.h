/*
 * ckpt/comm.h — communicators: what a checkpoint needs from a process group.
 *
 * The core library has no MPI dependency; ckpt_mpi.h makes a ckpt_comm from an
 * MPI communicator, other launchers fill the struct themselves.
 * Included by ckpt.h; may be included on its own (it includes ckpt.h).
 */
#ifndef CKPT_COMM_H
#define CKPT_COMM_H

#include "../ckpt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* ------------------------------------------------------------------------ */
/* Communicators: many processes                                             */
/* ------------------------------------------------------------------------ */

/* What a checkpoint needs from a process group. The core library has no MPI
 * dependency: libckpt_mpi fills this struct from an MPI communicator
 * (ckpt_mpi.h), and users of another launcher (NCCL, gloo, their own) fill
 * it themselves. Every function is collective: all ranks call it, in the
 * same order. Each returns 0 or a negative ckpt_status (setting a message). */
typedef enum ckpt_reduce_op {
    CKPT_REDUCE_MIN = 0,
    CKPT_REDUCE_MAX = 1,
    CKPT_REDUCE_SUM = 2
} ckpt_reduce_op;

typedef struct ckpt_comm {
    int rank;       /* 0..size-1 */
    int size;       /* number of processes, >= 1 */
    int local_rank; /* rank among the processes of this node */
    int local_size;
    int node;       /* index of this node, 0..num_nodes-1 */
    int num_nodes;
    void *ctx;      /* the implementation's state, passed to every function */
    int (*barrier)(void *ctx);
    /* n bytes at buf from root to every rank. */
    int (*bcast)(void *ctx, void *buf, size_t n, int root);
    /* Every rank sends n bytes (n may differ between ranks); at root, *out
     * gets every rank's bytes back to back in rank order (malloc'd: the
     * caller free()s it) and lens[r] the byte count of rank r (lens has size
     * entries). Elsewhere out and lens are not used. */
    int (*gather)(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root);
    /* Every rank sends lens[rank] bytes; every rank receives all of them back
     * to back in rank order into out (sum of lens bytes). */
    int (*allgather)(void *ctx, const void *buf, void *out, const size_t *lens);
    /* Elementwise over n values, in place, on every rank. */
    int (*allreduce_i64)(void *ctx, int64_t *v, int n, ckpt_reduce_op op);
    /* Releases ctx (may be NULL); called by ckpt_comm_free. */
    void (*destroy)(void *ctx);
    /* Optional (NULL: no deadlines, every collective waits as long as it
     * takes). A save or load calls it on every rank at the same points:
     * deadline(ctx, s, phase) says that until the next call each collective
     * waits at most s seconds (s <= 0: no limit) and then returns
     * CKPT_ETIMEDOUT with a message naming phase and the ranks that did not
     * arrive; deadline(ctx, 0, NULL) ends the operation. The first call with
     * a phase after that (or since the comm was made) starts a new
     * operation: a rank that is late for one operation must not have its
     * messages paired with a later one's (ckpt_comm_mpi runs each operation
     * on a communicator of its own), and after a timeout the rest of the
     * operation's collectives fail at once. phase is borrowed for the call
     * only. Collectives called outside an operation (ZeRO-1 optimizer steps,
     * ckpt_should_save) have no deadline. See docs/DISTRIBUTED.md. */
    void (*deadline)(void *ctx, double seconds, const char *phase);
    /* Optional (NULL: ckpt moves such bytes with gather, one root rank at a
     * time: P gathers where one exchange would do). Collective: every rank
     * calls it at the same point. This rank sends sn bytes at sbuf to rank
     * dest and receives rn bytes from rank src into rbuf (dest or src < 0,
     * or a count of 0: nothing that way); what a rank sends another is
     * exactly what that rank expects from it (the same count). With a
     * deadline it waits as the collectives do. How node-local tiers move
     * each rank's part to the nodes that keep a copy, and back
     * (docs/DISTRIBUTED.md "Storage tiers"). */
    int (*exchange)(void *ctx, const void *sbuf, size_t sn, int dest, void *rbuf, size_t rn,
                    int src);
    /* Optional (NULL: an asynchronous save's replication to other nodes runs
     * in the caller's thread, at the next ckpt_save_poll that finds every
     * rank's files written, ckpt_save_wait, save, load or free). exchange
     * for ckpt's background thread: it is called there
     * while the caller's thread may be in this communicator's other
     * functions (or in the application's own traffic), so it must move its
     * bytes on a channel of its own (ckpt_comm_mpi: a duplicate of the
     * communicator, set only under MPI_THREAD_MULTIPLE). Pairs as exchange
     * does, with exchanges of other ranks' background threads only, one
     * background save at a time. Gives up after timeout_s seconds (<= 0:
     * never) with CKPT_ETIMEDOUT. */
    int (*exchange_background)(void *ctx, const void *sbuf, size_t sn, int dest, void *rbuf,
                               size_t rn, int src, double timeout_s);
} ckpt_comm;

/* For communicator implementations: ckpt_set_error (see Errors above) sets
 * this thread's message and returns the code, so a collective can `return
 * ckpt_set_error(CKPT_EIO, "allgather: %s", why);` and the caller's
 * ckpt_errmsg names it. */

/* A communicator of one process (rank 0 of 1): static, never freed. */
CKPT_API const ckpt_comm *ckpt_comm_self(void);
/* Calls c->destroy(c->ctx) and frees c; for communicators made by a ckpt
 * constructor (ckpt_comm_mpi). NULL is a no-op. */
CKPT_API void ckpt_comm_free(ckpt_comm *c);

#ifdef __cplusplus
}
#endif

#endif /* CKPT_COMM_H */
