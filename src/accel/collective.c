/* collective.c — how the ranks of a save or load reach one outcome: every
 * rank returns the same status and the same message, which names the rank
 * that failed. Built on the few functions of a ckpt_comm. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "accel/accel.h"
#include "base/error.h"

/* One rank's outcome as it travels: status, whether it only echoes another
 * rank's failure, then its message (cut short). */
#define REC_BYTES 2048
#define REC_MSG (REC_BYTES - 8)

static void rec_pack(char *rec, int rc, bool echo) {
    int32_t v = rc, e = echo;
    memset(rec, 0, REC_BYTES);
    memcpy(rec, &v, sizeof v);
    memcpy(rec + 4, &e, sizeof e);
    snprintf(rec + 8, REC_MSG, "%s", rc < 0 ? ckpt_errmsg() : "");
}

static bool rec_echo(const char *rec) {
    int32_t e;
    memcpy(&e, rec + 4, sizeof e);
    return e != 0;
}

static int rec_status(const char *rec) {
    int32_t v;
    memcpy(&v, rec, sizeof v);
    return v;
}

static int comm_failed(int rc, const char *what) {
    if (rc >= 0) rc = CKPT_EIO;
    /* A timeout's message names the phase and the missing ranks already. */
    if (rc == CKPT_ETIMEDOUT) return rc;
    return ckpt__err_prefix(rc, "communicator: %s", what);
}

/* ---- deadlines ------------------------------------------------------------ */

static bool has_deadlines(const ckpt_accelerator *acc) {
    return acc->comm->size > 1 && acc->comm->deadline;
}

void ckpt__coll_begin(ckpt_accelerator *acc, const char *phase) {
    if (!has_deadlines(acc)) return;
    acc->coll_depth++;
    acc->comm->deadline(acc->comm->ctx, acc->coll_timeout, phase);
}

void ckpt__coll_phase(ckpt_accelerator *acc, const char *phase) {
    if (has_deadlines(acc) && acc->coll_depth > 0)
        acc->comm->deadline(acc->comm->ctx, acc->coll_timeout, phase);
}

void ckpt__coll_end(ckpt_accelerator *acc) {
    if (!has_deadlines(acc) || acc->coll_depth == 0) return;
    if (--acc->coll_depth == 0) acc->comm->deadline(acc->comm->ctx, 0, NULL);
}

int ckpt__coll_agree(const ckpt_comm *c, int rc, bool (*prefer)(int rc)) {
    return ckpt__coll_agree_echo(c, rc, prefer, false);
}

/* Whether every rank failed with exactly this status and message, and the
 * message is an agreement's ("rank <r>: ..."): the outcome of an earlier
 * agreement that nested calls pass up. Naming the rank again would only
 * stutter ("rank 0: rank 0: ..."). */
static bool agreed_already(const char *all, size_t p, int status, const char *msg) {
    const char *d = strncmp(msg, "rank ", 5) == 0 ? msg + 5 : NULL;
    if (!d || *d < '0' || *d > '9') return false;
    while (*d >= '0' && *d <= '9') d++;
    if (d[0] != ':' || d[1] != ' ') return false;
    for (size_t r = 0; r < p; r++) {
        const char *rec = all + r * REC_BYTES;
        if (rec_status(rec) != status || strncmp(rec + 8, msg, REC_MSG - 1) != 0) return false;
    }
    return true;
}

int ckpt__coll_agree_echo(const ckpt_comm *c, int rc, bool (*prefer)(int rc), bool echo) {
    if (rc > 0) rc = CKPT_EINVAL;
    if (c->size <= 1) return rc;
    /* The common case costs one small reduction; only a failure moves the
     * messages. */
    int64_t failed = rc < 0;
    int crc = c->allreduce_i64(c->ctx, &failed, 1, CKPT_REDUCE_MAX);
    if (crc < 0) return comm_failed(crc, "allreduce");
    /* With deadlines, a rank may reach this reduction after the others gave
     * up on it, and it would still see the success they reported. The
     * barrier makes it wait for ranks that are no longer there, so it times
     * out too instead of acting (committing, applying a load) alone. */
    if (!failed && c->deadline) {
        crc = c->barrier(c->ctx);
        if (crc < 0) return comm_failed(crc, "barrier");
    }
    if (!failed) return CKPT_OK;
    size_t p = (size_t)c->size;
    char *mine = malloc(REC_BYTES);
    char *all = malloc(p * REC_BYTES);
    size_t *lens = malloc(p * sizeof *lens);
    if (!mine || !all || !lens) {
        free(mine), free(all), free(lens);
        return ckpt__err_nomem("agreement");
    }
    rec_pack(mine, rc, echo && rc < 0);
    for (size_t r = 0; r < p; r++) lens[r] = REC_BYTES;
    crc = c->allgather(c->ctx, mine, all, lens);
    if (crc < 0) {
        free(mine), free(all), free(lens);
        return comm_failed(crc, "allgather");
    }
    /* The first failure that is a rank's own (not an echo of another's),
     * of a preferred status first; then any. */
    int pick = -1, nfailed = 0;
    for (int pass = prefer ? 0 : 1; pass < 3 && pick < 0; pass++)
        for (size_t r = 0; r < p && pick < 0; r++) {
            const char *rec = all + r * REC_BYTES;
            int s = rec_status(rec);
            if (s < 0 && (pass == 2 || (!rec_echo(rec) && (pass == 1 || prefer(s))))) pick = (int)r;
        }
    for (size_t r = 0; r < p; r++) nfailed += rec_status(all + r * REC_BYTES) < 0;
    if (pick < 0) { /* only if the records disagree with the reduction */
        free(mine), free(all), free(lens);
        return ckpt__err(CKPT_EIO, "communicator: a rank reported a failure but sent no status");
    }
    const char *rec = all + (size_t)pick * REC_BYTES;
    int status = rec_status(rec);
    char msg[REC_MSG];
    memcpy(msg, rec + 8, REC_MSG);
    msg[REC_MSG - 1] = '\0';
    if (agreed_already(all, p, status, msg))
        ckpt__err(status, "%s", msg); /* an earlier agreement's: as it is */
    else if (nfailed > 1)
        ckpt__err(status, "rank %d: %s (%d other rank%s failed too)", pick, msg, nfailed - 1,
                  nfailed - 1 == 1 ? "" : "s");
    else
        ckpt__err(status, "rank %d: %s", pick, msg);
    free(mine), free(all), free(lens);
    return status;
}

int ckpt__coll_share(const ckpt_comm *c, int rc) {
    if (rc > 0) rc = CKPT_EINVAL;
    if (c->size <= 1) return rc;
    char rec[REC_BYTES]; /* on the stack: no rank may drop out for memory */
    memset(rec, 0, sizeof rec);
    if (c->rank == 0) rec_pack(rec, rc, false);
    int crc = c->bcast(c->ctx, rec, REC_BYTES, 0);
    /* A rank whose copy did not arrive must not go its own way: one
     * reduction tells every rank whether a copy was lost, and rank 0's
     * status (exactly: every status is <= 0). */
    int64_t v[2] = {crc < 0, c->rank == 0 ? -(int64_t)rc : 0};
    int arc = c->allreduce_i64(c->ctx, v, 2, CKPT_REDUCE_MAX);
    if (arc < 0) return comm_failed(arc, "allreduce");
    int status = v[0] ? (int)-v[1] : rec_status(rec);
    if (status == 0) return CKPT_OK;
    if (!v[0]) {
        rec[REC_BYTES - 1] = '\0';
        ckpt__err(status, "rank 0: %s", rec + 8);
        return status;
    }
    /* rank 0 failed and some rank lost its message: it travels again, in
     * an agreement (the same message on every rank) */
    if (c->rank == 0) {
        rec[REC_BYTES - 1] = '\0';
        ckpt__err(status, "%s", rec + 8);
    }
    return ckpt__coll_agree(c, c->rank == 0 ? status : CKPT_OK, NULL);
}

int ckpt__coll_bcast_bytes(const ckpt_comm *c, char **buf, size_t *n) {
    if (c->size <= 1) return CKPT_OK;
    /* Each step is agreed on: a rank whose length or bytes did not arrive
     * (or that has no memory for them) stops every rank, with one message. */
    uint64_t len = c->rank == 0 ? (uint64_t)*n : 0;
    int crc = c->bcast(c->ctx, &len, sizeof len, 0);
    CKPT_TRY(ckpt__coll_agree(c, crc < 0 ? comm_failed(crc, "bcast") : CKPT_OK, NULL));
    if (len > SIZE_MAX - 1)
        return ckpt__err(CKPT_EINVAL, "communicator: bcast of %" PRIu64 " bytes", len);
    char *p = c->rank == 0 ? *buf : malloc((size_t)len + 1);
    int rc = ckpt__coll_agree(c, p ? CKPT_OK : ckpt__err_nomem("bcast"), NULL);
    if (rc == 0 && len) {
        crc = c->bcast(c->ctx, p, (size_t)len, 0);
        rc = ckpt__coll_agree(c, crc < 0 ? comm_failed(crc, "bcast") : CKPT_OK, NULL);
    }
    if (rc < 0) {
        if (c->rank != 0) free(p);
        return rc;
    }
    if (c->rank != 0) {
        p[len] = '\0';
        *buf = p;
        *n = (size_t)len;
    }
    return CKPT_OK;
}

int ckpt__comm_check(const ckpt_comm *c, const char *what) {
    if (c->size < 1)
        return ckpt__err(CKPT_EINVAL, "%s: comm size is %d, expected >= 1", what, c->size);
    if (c->rank < 0 || c->rank >= c->size)
        return ckpt__err(CKPT_EINVAL, "%s: comm rank %d outside [0, %d)", what, c->rank, c->size);
    if (!c->barrier || !c->bcast || !c->gather || !c->allgather || !c->allreduce_i64)
        return ckpt__err(CKPT_EINVAL, "%s: comm is missing a function (barrier, bcast, gather, "
                                      "allgather and allreduce_i64 are all needed)",
                         what);
    return CKPT_OK;
}
