/* comm_mpi.c — libckpt_mpi: the collectives of a ckpt_comm on MPI. Only the
 * public API of libckpt is used (errors through ckpt_set_error), so this
 * file builds into its own library.
 *
 * Deadlines (ckpt_comm.deadline). Inside an operation with a deadline every
 * collective is non-blocking (MPI_Ibarrier, MPI_Ibcast, MPI_Igatherv,
 * MPI_Iallgatherv, MPI_Iallreduce) on the "work" communicator, polled with
 * MPI_Test until it completes or the deadline passes. What keeps a rank that
 * comes late from doing harm:
 *  - MPI pairs collectives by their order on a communicator. After a
 *    timeout the ranks may have posted different numbers of them (a
 *    broadcast's root can finish without the late rank), so that
 *    communicator is never used again: the operation's ranks mark it dirty,
 *    and the next operation starts on a fresh duplicate.
 *  - Each operation starts with a handshake of point-to-point messages on
 *    the duplicate made at creation ("base"), stamped with the operation's
 *    number: every rank says hello to rank 0 (and whether its work
 *    communicator is dirty); rank 0, once it has heard from every rank,
 *    answers "go" or "duplicate", and then every rank, all known present,
 *    calls the blocking MPI_Comm_dup of base together. (MPI_Comm_idup is not
 *    used: Open MPI 4.1 stalls a second one while an abandoned first is
 *    pending.) A rank that is late for the handshake finds rank 0's verdict
 *    when it arrives; nothing was posted on the work communicator for it.
 *  - After a timeout the rest of the operation's collectives fail at once
 *    without being posted, and an abandoned request is never freed (MPI
 *    forbids it): it is kept with the buffers it may still touch (copies of
 *    the caller's) and tested again at every later call. The late rank
 *    posts its part of the collective it was late for, so these usually
 *    complete: before a communicator they may run on is freed (the dirty
 *    work communicator at the next operation, both at ckpt_comm_free) they
 *    get up to min(timeout, 10 s) to do so. One that still cannot keeps its
 *    communicator for the rest of the process (bury): Open MPI's
 *    MPI_Finalize would otherwise progress it on a freed communicator and
 *    crash.
 *  - Who did not arrive: at each collective every rank sends rank 0 an empty
 *    "arrived" message and rank 0 sends one to every rank. At its deadline
 *    rank 0 names the ranks it has no message from and sends that verdict
 *    to every rank, which all return it. A rank that sees no arrival from
 *    rank 0 by its own deadline names rank 0 and tells it so ("gave up"). */
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt_mpi.h"

/* Point-to-point tags; base and the work communicators carry nothing else. */
#define TAG_ARRIVE 7001 /* work: entered a collective (empty) */
#define TAG_HELLO 7002  /* base, to rank 0: at operation op's handshake; flag: dirty */
#define TAG_ROOT 7003   /* base, from rank 0: rank 0 is at op's handshake */
#define TAG_REPLY 7004  /* base, from rank 0: flag GO, DUP or DEAD (text) */
#define TAG_GIVEUP 7005 /* base, to rank 0: gave up waiting for it in op */
#define TAG_EXCH 7006   /* work (base outside an operation): an exchange's bytes */
/* The longest nap while an exchange's bytes move (see await_naps). */
#define EXCHANGE_NAP_NS 0 /* 0: no nap, sched_yield() */
#define VERDICT_TEXT 512
enum { GO = 0, DUP = 1, DEAD = 2 };

#define CKPT_MPI_TRY(expr)                                                                         \
    do {                                                                                           \
        int rc_try_ = (expr);                                                                      \
        if (rc_try_ < 0) return rc_try_;                                                           \
    } while (0)

/* A control message on base. */
typedef struct note {
    int64_t op;
    int64_t flag;
    char text[VERDICT_TEXT];
} note;

/* Requests that may still complete, and the buffers they may still touch
 * (freed once they do). */
typedef struct inflight {
    int n;
    MPI_Request *reqs;
    void *bufs[4];
    struct inflight *next;
} inflight;

typedef struct mpi_ctx {
    MPI_Comm comm; /* base: the duplicate made at creation */
    int rank, size;
    /* the operation */
    int64_t op;     /* operations started */
    bool in_op;     /* started and not ended, with a deadline */
    bool ready;     /* its handshake is done */
    double timeout; /* seconds */
    char phase[160];
    bool dead; /* a collective of this operation timed out */
    char dead_msg[VERDICT_TEXT + 64];
    /* the work communicator; dirty after a timeout on it (and before the
     * first operation); work_dead: a timeout happened on it, so requests of
     * some rank may stay pending on it forever */
    MPI_Comm work;
    bool dirty, work_dead;
    bool ever_dead;   /* some operation timed out: notes on base may be unread */
    int64_t n;        /* collectives entered on work */
    int64_t *arrived; /* arrival messages on work, per sender */
    /* the handshake, as heard */
    /* an exchange's copies of its buffers, kept from one to the next (a
     * fresh 16 MiB each time costs its page faults: more than the copy on
     * a virtual machine); handed to an abandoned request's keeping */
    char *xout, *xin;
    size_t xout_cap, xin_cap;
    int64_t *hello_op; /* rank 0: the last operation each rank said hello for */
    bool any_dirty;    /* rank 0: some hello said dirty */
    int64_t root_op;   /* others: the last operation rank 0 reached */
    int64_t reply_op;  /* others: the last operation rank 0 answered */
    int64_t reply_flag;
    /* a message for a later operation (this rank is behind), by tag */
    bool has_pending[2];
    note pending[2];
    int pending_from[2];
    inflight *flying;
    /* exchange_background's own communicator (MPI_THREAD_MULTIPLE only),
     * used by one background thread; dead after one of its timeouts */
    MPI_Comm bg;
    bool bg_dead;
} mpi_ctx;

static int mpi_fail(int err, const char *what) {
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(err, msg, &len) != MPI_SUCCESS) len = 0;
    msg[len < MPI_MAX_ERROR_STRING ? len : MPI_MAX_ERROR_STRING - 1] = '\0';
    return ckpt_set_error(CKPT_EIO, "MPI: %s: %s", what, len ? msg : "error");
}

/* ---- deadlines ------------------------------------------------------------ */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static void nap(long ns) {
    struct timespec ts = {0, ns};
    nanosleep(&ts, NULL);
}

/* Requests still in flight when their comm was freed: reachable until the
 * process exits, since MPI may still write their buffers. */
static pthread_mutex_t graveyard_lock = PTHREAD_MUTEX_INITIALIZER;
static inflight *graveyard;

/* Communicators on which a collective timed out: some rank's abandoned
 * requests may never complete there (the rank they wait for never posts its
 * part), and freeing such a communicator lets MPI_Finalize's progress
 * engine run them on a destroyed one (a segfault in Open MPI 4.1's libnbc).
 * They are never freed: kept here, reachable, until the process exits, one
 * per timeout. */
typedef struct buried {
    MPI_Comm comm;
    struct buried *next;
} buried;
static buried *cemetery;

static void bury(MPI_Comm *c) {
    if (*c == MPI_COMM_NULL) return;
    buried *b = malloc(sizeof *b);
    if (b) {
        b->comm = *c;
        pthread_mutex_lock(&graveyard_lock);
        b->next = cemetery;
        cemetery = b;
        pthread_mutex_unlock(&graveyard_lock);
    } /* out of memory: it is simply never freed */
    *c = MPI_COMM_NULL;
}

static void inflight_free(inflight *f) {
    for (int i = 0; i < 4; i++) free(f->bufs[i]);
    free(f->reqs);
    free(f);
}

/* Tests what is in flight; frees what completed. */
static void reap(mpi_ctx *x) {
    for (inflight **pp = &x->flying; *pp;) {
        inflight *f = *pp;
        int done = 0;
        if (MPI_Testall(f->n, f->reqs, &done, MPI_STATUSES_IGNORE) != MPI_SUCCESS) done = 1;
        if (done) {
            *pp = f->next;
            inflight_free(f);
        } else {
            pp = &f->next;
        }
    }
}

/* Keeps n requests (copied) and the buffers until they complete. Out of
 * memory: the buffers stay allocated for good (never freed under MPI). */
static void keep(mpi_ctx *x, MPI_Request *reqs, int n, void *const bufs[4]) {
    inflight *f = calloc(1, sizeof *f);
    MPI_Request *r = malloc((size_t)(n > 0 ? n : 1) * sizeof *r);
    if (!f || !r) {
        free(f), free(r);
        return;
    }
    memcpy(r, reqs, (size_t)n * sizeof *r);
    f->n = n;
    f->reqs = r;
    if (bufs) memcpy(f->bufs, bufs, sizeof f->bufs);
    f->next = x->flying;
    x->flying = f;
}

/* Sends a note (copied) to the ranks in [lo, hi) other than this one. */
static void send_note(mpi_ctx *x, int tag, int64_t flag, const char *text, int lo, int hi) {
    note *m = calloc(1, sizeof *m);
    MPI_Request *reqs = malloc((size_t)x->size * sizeof *reqs);
    if (!m || !reqs) {
        free(m), free(reqs);
        return;
    }
    m->op = x->op;
    m->flag = flag;
    if (text) snprintf(m->text, sizeof m->text, "%s", text);
    int n = 0;
    for (int r = lo; r < hi; r++)
        if (r != x->rank &&
            MPI_Isend(m, (int)sizeof *m, MPI_BYTE, r, tag, x->comm, &reqs[n]) == MPI_SUCCESS)
            n++;
    void *bufs[4] = {m, NULL, NULL, NULL};
    keep(x, reqs, n, bufs);
    free(reqs);
}

/* Entering a collective on work: counted, and rank 0 (or, from rank 0,
 * every rank) told. */
static void arrive(mpi_ctx *x) {
    x->n++;
    for (int r = x->rank == 0 ? 1 : 0; r < (x->rank == 0 ? x->size : 1); r++) {
        MPI_Request q;
        if (MPI_Isend(NULL, 0, MPI_BYTE, r, TAG_ARRIVE, x->work, &q) == MPI_SUCCESS)
            MPI_Request_free(&q);
    }
}

/* The operation failed: msg is what every collective of it returns from now
 * on; rank 0 tells every rank. */
static void go_dead(mpi_ctx *x, const char *msg) {
    x->dead = true;
    x->dirty = true;
    x->work_dead = true;
    x->ever_dead = true;
    snprintf(x->dead_msg, sizeof x->dead_msg, "%s", msg);
    if (x->rank == 0) send_note(x, TAG_REPLY, DEAD, msg, 0, x->size);
}

/* One note for this operation (older ones are dropped by the caller). */
static void take_note(mpi_ctx *x, int tag, int from, const note *m) {
    if (tag == TAG_HELLO) {
        x->hello_op[from] = m->op;
        if (m->flag) x->any_dirty = true;
    } else if (tag == TAG_GIVEUP) {
        char msg[sizeof x->dead_msg];
        snprintf(msg, sizeof msg, "%s: rank %d gave up waiting for rank 0 after %g s", x->phase,
                 from, x->timeout);
        if (!x->dead) go_dead(x, msg);
    } else if (tag == TAG_ROOT) {
        x->root_op = m->op;
    } else if (m->flag == DEAD) {
        if (!x->dead) go_dead(x, m->text);
    } else {
        x->reply_op = m->op;
        x->reply_flag = m->flag;
    }
}

/* Receives the notes of one tag: those of earlier operations are dropped,
 * the first of a later one waits in a pending slot (slot < 0: hellos, kept
 * per rank instead). */
static void drain_tag(mpi_ctx *x, int tag, int slot) {
    if (slot >= 0 && x->has_pending[slot]) {
        if (x->pending[slot].op > x->op) return;
        x->has_pending[slot] = false;
        if (x->pending[slot].op == x->op)
            take_note(x, tag, x->pending_from[slot], &x->pending[slot]);
    }
    for (;;) {
        int flag = 0;
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, tag, x->comm, &flag, &st) != MPI_SUCCESS || !flag) return;
        note m;
        memset(&m, 0, sizeof m);
        MPI_Recv(&m, (int)sizeof m, MPI_BYTE, st.MPI_SOURCE, tag, x->comm, MPI_STATUS_IGNORE);
        m.text[sizeof m.text - 1] = '\0';
        if (st.MPI_SOURCE < 0 || st.MPI_SOURCE >= x->size) continue;
        if (slot < 0) { /* hellos: the latest per rank is all rank 0 needs */
            take_note(x, tag, st.MPI_SOURCE, &m);
            continue;
        }
        if (m.op < x->op) continue;
        if (m.op > x->op) {
            x->has_pending[slot] = true;
            x->pending[slot] = m;
            x->pending_from[slot] = st.MPI_SOURCE;
            return;
        }
        take_note(x, tag, st.MPI_SOURCE, &m);
    }
}

/* Receives what is waiting: arrivals on work, notes on base. */
static void drain(mpi_ctx *x) {
    for (int flag = 1; flag && x->work != MPI_COMM_NULL;) {
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, TAG_ARRIVE, x->work, &flag, &st) != MPI_SUCCESS) break;
        if (!flag) break;
        MPI_Recv(NULL, 0, MPI_BYTE, st.MPI_SOURCE, TAG_ARRIVE, x->work, MPI_STATUS_IGNORE);
        if (st.MPI_SOURCE >= 0 && st.MPI_SOURCE < x->size) x->arrived[st.MPI_SOURCE]++;
    }
    if (x->rank == 0) {
        drain_tag(x, TAG_HELLO, -1);
        drain_tag(x, TAG_GIVEUP, 0);
    } else {
        drain_tag(x, TAG_ROOT, 0);
        drain_tag(x, TAG_REPLY, 1);
    }
}

/* Whether rank 0 has heard from rank r: by arrivals on work (handshake:
 * hellos). */
static bool heard_from(const mpi_ctx *x, bool handshake, int r) {
    return handshake ? x->hello_op[r] >= x->op : x->arrived[r] >= x->n;
}

static bool heard_from_all(const mpi_ctx *x, bool handshake) {
    for (int r = 1; r < x->size; r++)
        if (!heard_from(x, handshake, r)) return false;
    return true;
}

/* "2, 5" (count 2): the ranks rank 0 has not heard from. */
static int missing_list(const mpi_ctx *x, bool handshake, char *out, size_t cap) {
    int count = 0;
    size_t used = 0;
    out[0] = '\0';
    for (int r = 1; r < x->size; r++) {
        if (heard_from(x, handshake, r)) continue;
        count++;
        if (count <= 16 && used < cap)
            used += (size_t)snprintf(out + used, cap - used, "%s%d", count > 1 ? ", " : "", r);
    }
    if (count > 16 && used < cap) snprintf(out + used, cap - used, " and %d more", count - 16);
    return count;
}

/* At this rank's deadline: rank 0 names who is missing; another rank names
 * rank 0 if it never saw it arrive, else waits for its verdict (a second
 * timeout at most). */
static void on_deadline(mpi_ctx *x, bool handshake, double late) {
    char msg[sizeof x->dead_msg], who[256];
    if (x->rank == 0) {
        int count = missing_list(x, handshake, who, sizeof who);
        if (count > 0)
            snprintf(msg, sizeof msg, "%s: %s %s did not arrive within %g s", x->phase,
                     count > 1 ? "ranks" : "rank", who, x->timeout);
        else
            snprintf(msg, sizeof msg,
                     "%s: every rank arrived but the collective did not complete within %g s",
                     x->phase, x->timeout);
        go_dead(x, msg);
        return;
    }
    bool root_here = handshake ? x->root_op >= x->op : x->arrived[0] >= x->n;
    if (!root_here) {
        send_note(x, TAG_GIVEUP, 0, NULL, 0, 1);
        snprintf(msg, sizeof msg, "%s: rank 0 did not arrive within %g s", x->phase, x->timeout);
        go_dead(x, msg);
    } else if (late >= x->timeout) {
        snprintf(msg, sizeof msg, "%s: rank 0 arrived but reported nothing within %g s", x->phase,
                 2 * x->timeout);
        go_dead(x, msg);
    }
}

/* Waits for the n requests (n = 0: for the handshake's answer) until they
 * complete (0) or the operation fails (CKPT_ETIMEDOUT): then the requests
 * and bufs are kept in flight and belong to x. */
static int await_naps(mpi_ctx *x, MPI_Request *reqs, int n, void *const bufs[4], long max_ns);

static int await(mpi_ctx *x, MPI_Request *reqs, int n, void *const bufs[4]) {
    return await_naps(x, reqs, n, bufs, 2000000);
}

/* The same, napping at most max_ns between tests (0: sched_yield only).
 * MPI moves a large message only while its ranks are inside MPI calls (the
 * shared-memory transport sends it in fragments), so an exchange of
 * megabytes yields instead of napping. Measured with 4 ranks on this
 * 2-core VM, 16 MiB exchanges with a deadline: 73 MB/s a rank with fresh
 * copies of the buffers (their page faults) and the collectives' naps,
 * 130-230 MB/s with the copies kept (mpi_ctx.xout/xin), where a blocking
 * MPI_Sendrecv made 230-720 (the machine shared with other jobs). */
static int await_naps(mpi_ctx *x, MPI_Request *reqs, int n, void *const bufs[4], long max_ns) {
    double limit = now_s() + x->timeout;
    long ns = 20000 < max_ns ? 20000 : max_ns;
    for (int spin = 0;; spin++) {
        if (n > 0) {
            int done = 0;
            int e = MPI_Testall(n, reqs, &done, MPI_STATUSES_IGNORE);
            if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Testall");
            if (done) return CKPT_OK;
        }
        drain(x);
        if (n == 0 && !x->dead) { /* the handshake */
            if (x->rank == 0 && heard_from_all(x, true)) return CKPT_OK;
            if (x->rank != 0 && x->reply_op == x->op) return CKPT_OK;
        }
        double t = x->dead ? 0 : now_s();
        if (!x->dead && t >= limit) on_deadline(x, n == 0, t - limit);
        if (x->dead) {
            if (n > 0) keep(x, reqs, n, bufs);
            return ckpt_set_error(CKPT_ETIMEDOUT, "%s", x->dead_msg);
        }
        if (spin >= 50) {
            if (max_ns > 0) nap(ns);
            else sched_yield();
            if (ns < max_ns) ns = ns * 2 < max_ns ? ns * 2 : max_ns;
        }
    }
}

/* Drops every message waiting on c (notes nobody will read now). */
static void drop_messages(MPI_Comm c) {
    for (int flag = 1; flag && c != MPI_COMM_NULL;) {
        MPI_Status st;
        if (MPI_Iprobe(MPI_ANY_SOURCE, MPI_ANY_TAG, c, &flag, &st) != MPI_SUCCESS || !flag) break;
        int n = 0;
        MPI_Get_count(&st, MPI_BYTE, &n);
        char *buf = malloc(n > 0 ? (size_t)n : 1);
        if (!buf) break;
        MPI_Recv(buf, n, MPI_BYTE, st.MPI_SOURCE, st.MPI_TAG, c, MPI_STATUS_IGNORE);
        free(buf);
    }
}

/* After a timeout: gives the abandoned requests up to `seconds` to complete
 * (the rank that was late posts its part of the collective it was late
 * for when it comes), receiving the arrivals on work meanwhile (and with
 * notes, the notes on base: only when no operation can follow). Whether
 * none is left. */
static bool settle_flying(mpi_ctx *x, double seconds, bool notes) {
    double limit = now_s() + seconds;
    for (long ns = 20000;; ns = ns < 2000000 ? ns * 2 : ns) {
        reap(x);
        if (!x->flying) return true;
        if (now_s() >= limit) return false;
        drop_messages(x->work);
        if (notes) drop_messages(x->comm);
        nap(ns);
    }
}

/* How long a communicator that timed out waits for its abandoned requests
 * before it gives up on them (and keeps them for good). */
#define SETTLE_MAX_S 10.0

static double settle_time(const mpi_ctx *x) {
    return x->timeout < SETTLE_MAX_S ? x->timeout : SETTLE_MAX_S;
}

/* Replaces the work communicator by a fresh duplicate of base. Every rank
 * calls it at the same point, all known present: a collective the late rank
 * posted completes now, and only what no rank will ever match stays (with
 * its communicator, see bury). */
static int fresh_work(mpi_ctx *x) {
    if (x->work_dead && !settle_flying(x, settle_time(x), false)) bury(&x->work);
    else if (x->work != MPI_COMM_NULL) MPI_Comm_free(&x->work);
    x->work_dead = false;
    int e = MPI_Comm_dup(x->comm, &x->work);
    if (e != MPI_SUCCESS) {
        x->work = MPI_COMM_NULL;
        x->dirty = true;
        return mpi_fail(e, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(x->work, MPI_ERRORS_RETURN);
    x->dirty = false;
    x->n = 0;
    memset(x->arrived, 0, (size_t)x->size * sizeof *x->arrived);
    return CKPT_OK;
}

/* Before a collective with a deadline: the handshake (first time in the
 * operation), and 0; or CKPT_ETIMEDOUT if the operation already failed or
 * fails here. */
static int op_ready(mpi_ctx *x) {
    reap(x);
    if (x->dead) return ckpt_set_error(CKPT_ETIMEDOUT, "%s", x->dead_msg);
    if (x->ready) return CKPT_OK;
    if (x->rank == 0) {
        x->hello_op[0] = x->op;
        if (x->dirty) x->any_dirty = true;
        send_note(x, TAG_ROOT, 0, NULL, 0, x->size);
    } else {
        send_note(x, TAG_HELLO, x->dirty || x->work == MPI_COMM_NULL, NULL, 0, 1);
    }
    CKPT_MPI_TRY(await(x, NULL, 0, NULL));
    bool dup;
    if (x->rank == 0) {
        dup = x->any_dirty;
        x->any_dirty = false;
        send_note(x, TAG_REPLY, dup ? DUP : GO, NULL, 0, x->size);
    } else {
        dup = x->reply_flag == DUP;
    }
    if (dup) CKPT_MPI_TRY(fresh_work(x));
    x->ready = true;
    return CKPT_OK;
}

static void op_end(mpi_ctx *x) {
    x->in_op = false;
    x->ready = false;
    x->dead = false;
    reap(x);
}

static void mpi_deadline(void *ctx, double seconds, const char *phase) {
    mpi_ctx *x = ctx;
    if (!phase) {
        if (x->in_op) op_end(x);
        return;
    }
    snprintf(x->phase, sizeof x->phase, "%s", phase);
    if (x->in_op) return;       /* the next phase of this operation */
    if (!(seconds > 0)) return; /* no deadline: blocking collectives on base */
    x->op++;
    x->in_op = true;
    x->ready = false;
    x->timeout = seconds;
    x->dead = false;
}

/* ---- collectives ---------------------------------------------------------- */

/* A collective with a deadline: the caller has counted its arrival
 * (arrive) and posted it (MPI error code e, request req); this waits for it.
 * On any failure bufs (up to four, NULL ones ignored) are no longer the
 * caller's: freed, or kept in flight with an abandoned request. */
static int finish(mpi_ctx *x, const char *what, int e, MPI_Request *req, void *const bufs[4]) {
    if (e != MPI_SUCCESS) {
        for (int i = 0; bufs && i < 4; i++) free(bufs[i]);
        return mpi_fail(e, what);
    }
    return await(x, req, 1, bufs);
}

static int mpi_barrier(void *ctx) {
    mpi_ctx *x = ctx;
    if (x->in_op) {
        CKPT_MPI_TRY(op_ready(x));
        MPI_Request req;
        arrive(x);
        return finish(x, "MPI_Ibarrier", MPI_Ibarrier(x->work, &req), &req, NULL);
    }
    int e = MPI_Barrier(x->comm);
    return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Barrier");
}

/* MPI counts are int: large buffers go in pieces of at most 1 GiB. */
#define PIECE ((size_t)1 << 30)

/* With a deadline the collectives work on copies: an abandoned one may
 * still read or write its buffers after the caller has freed its own. */
static int bcast_piece(mpi_ctx *x, char *buf, size_t k, int root) {
    char *tmp = malloc(k ? k : 1);
    if (!tmp) return ckpt_set_error(CKPT_ENOMEM, "out of memory (bcast)");
    if (x->rank == root) memcpy(tmp, buf, k);
    void *bufs[4] = {tmp, NULL, NULL, NULL};
    MPI_Request req;
    arrive(x);
    int e = MPI_Ibcast(tmp, (int)k, MPI_BYTE, root, x->work, &req);
    CKPT_MPI_TRY(finish(x, "MPI_Ibcast", e, &req, bufs));
    if (x->rank != root) memcpy(buf, tmp, k);
    free(tmp);
    return CKPT_OK;
}

static int mpi_bcast(void *ctx, void *buf, size_t n, int root) {
    mpi_ctx *c = ctx;
    if (c->in_op) CKPT_MPI_TRY(op_ready(c));
    for (size_t off = 0; off < n; off += PIECE) {
        size_t k = n - off < PIECE ? n - off : PIECE;
        if (c->in_op) {
            CKPT_MPI_TRY(bcast_piece(c, (char *)buf + off, k, root));
            continue;
        }
        int e = MPI_Bcast((char *)buf + off, (int)k, MPI_BYTE, root, c->comm);
        if (e != MPI_SUCCESS) return mpi_fail(e, "MPI_Bcast");
    }
    return CKPT_OK;
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

/* The sizes of a gather reach root (all: size entries there, malloc'd). */
static int gather_sizes(mpi_ctx *c, uint64_t mine, uint64_t **all, int root) {
    int p = c->size;
    /* Out of memory on one rank leaves the others waiting in the
     * collective (or, with a deadline, timing out). */
    *all = c->rank == root ? malloc((size_t)p * sizeof **all) : NULL;
    if (c->rank == root && !*all) return ckpt_set_error(CKPT_ENOMEM, "out of memory (gather)");
    if (!c->in_op) {
        int e = MPI_Gather(&mine, 1, MPI_UINT64_T, *all, 1, MPI_UINT64_T, root, c->comm);
        if (e != MPI_SUCCESS) {
            free(*all);
            *all = NULL;
            return mpi_fail(e, "MPI_Gather");
        }
        return CKPT_OK;
    }
    uint64_t *in = malloc(sizeof *in);
    uint64_t *tmp = c->rank == root ? malloc((size_t)p * sizeof *tmp) : NULL;
    if (!in || (c->rank == root && !tmp)) {
        free(in), free(tmp), free(*all);
        *all = NULL;
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (gather)");
    }
    *in = mine;
    void *bufs[4] = {in, tmp, NULL, NULL};
    MPI_Request req;
    arrive(c);
    int e = MPI_Igather(in, 1, MPI_UINT64_T, tmp, 1, MPI_UINT64_T, root, c->work, &req);
    int rc = finish(c, "MPI_Igather", e, &req, bufs);
    if (rc < 0) {
        free(*all);
        *all = NULL;
        return rc;
    }
    if (c->rank == root) memcpy(*all, tmp, (size_t)p * sizeof *tmp);
    free(in), free(tmp);
    return CKPT_OK;
}

static int allreduce_deadline(mpi_ctx *c, int64_t *v, int n, MPI_Datatype t, MPI_Op op) {
    size_t bytes = (size_t)(n > 0 ? n : 1) * sizeof *v;
    int64_t *tmp = malloc(bytes);
    if (!tmp) return ckpt_set_error(CKPT_ENOMEM, "out of memory (allreduce)");
    if (n > 0) memcpy(tmp, v, (size_t)n * sizeof *v);
    void *bufs[4] = {tmp, NULL, NULL, NULL};
    MPI_Request req;
    arrive(c);
    int e = MPI_Iallreduce(MPI_IN_PLACE, tmp, n, t, op, c->work, &req);
    CKPT_MPI_TRY(finish(c, "MPI_Iallreduce", e, &req, bufs));
    if (n > 0) memcpy(v, tmp, (size_t)n * sizeof *v);
    free(tmp);
    return CKPT_OK;
}

static int mpi_gather(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root) {
    mpi_ctx *c = ctx;
    int rank = c->rank, p = c->size;
    if (c->in_op) CKPT_MPI_TRY(op_ready(c));
    uint64_t *all = NULL;
    CKPT_MPI_TRY(gather_sizes(c, n, &all, root));
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
        rc = ckpt_set_error(CKPT_EINVAL, "gather: %zu bytes from one rank, more than %d", n,
                            INT_MAX);
    }
    free(all);
    /* A size MPI cannot count, on any rank, stops every rank here alike. */
    int64_t bad = rc < 0;
    int crc;
    if (c->in_op) {
        crc = allreduce_deadline(c, &bad, 1, MPI_INT64_T, MPI_MAX);
    } else {
        int e = MPI_Allreduce(MPI_IN_PLACE, &bad, 1, MPI_INT64_T, MPI_MAX, c->comm);
        crc = e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Allreduce");
    }
    if (crc < 0 && rc == 0) rc = crc;
    if (bad && rc == 0)
        rc = ckpt_set_error(CKPT_EINVAL, "gather: another rank's data is too large");
    if (rc < 0) {
        free(counts), free(displs), free(data);
        return rc;
    }
    if (!c->in_op) {
        int e = MPI_Gatherv(buf, (int)n, MPI_BYTE, data, counts, displs, MPI_BYTE, root, c->comm);
        free(counts);
        free(displs);
        if (e != MPI_SUCCESS) {
            free(data);
            return mpi_fail(e, "MPI_Gatherv");
        }
        if (rank == root) *out = data;
        return CKPT_OK;
    }
    char *in = malloc(n ? n : 1);
    if (!in) {
        free(counts), free(displs), free(data);
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (gather)");
    }
    if (n) memcpy(in, buf, n);
    /* data, counts and displs go in flight with the request if abandoned */
    void *bufs[4] = {in, data, counts, displs};
    MPI_Request req;
    arrive(c);
    int e = MPI_Igatherv(in, (int)n, MPI_BYTE, data, counts, displs, MPI_BYTE, root, c->work, &req);
    CKPT_MPI_TRY(finish(c, "MPI_Igatherv", e, &req, bufs));
    free(in), free(counts), free(displs);
    if (rank == root) *out = data;
    return CKPT_OK;
}

static int mpi_allgather(void *ctx, const void *buf, void *out, const size_t *lens) {
    mpi_ctx *c = ctx;
    int rank = c->rank, p = c->size;
    if (c->in_op) CKPT_MPI_TRY(op_ready(c));
    int *counts = NULL, *displs = NULL;
    int rc = layout(lens, p, &counts, &displs, "allgather");
    if (rc < 0) return rc;
    if (c->in_op) {
        size_t total = (size_t)displs[p - 1] + (size_t)counts[p - 1];
        char *in = malloc(counts[rank] ? (size_t)counts[rank] : 1);
        char *tmp = malloc(total ? total : 1);
        if (!in || !tmp) {
            free(in), free(tmp), free(counts), free(displs);
            return ckpt_set_error(CKPT_ENOMEM, "out of memory (allgather)");
        }
        memcpy(in, buf, (size_t)counts[rank]);
        void *bufs[4] = {in, tmp, counts, displs};
        MPI_Request req;
        arrive(c);
        int e = MPI_Iallgatherv(in, counts[rank], MPI_BYTE, tmp, counts, displs, MPI_BYTE, c->work,
                                &req);
        CKPT_MPI_TRY(finish(c, "MPI_Iallgatherv", e, &req, bufs));
        memcpy(out, tmp, total);
        free(in), free(tmp), free(counts), free(displs);
        return CKPT_OK;
    }
    int e = MPI_Allgatherv(buf, counts[rank], MPI_BYTE, out, counts, displs, MPI_BYTE, c->comm);
    free(counts);
    free(displs);
    return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Allgatherv");
}

static int mpi_allreduce_i64(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    mpi_ctx *c = ctx;
    MPI_Op mop = op == CKPT_REDUCE_MIN ? MPI_MIN : op == CKPT_REDUCE_MAX ? MPI_MAX : MPI_SUM;
    if (c->in_op) {
        CKPT_MPI_TRY(op_ready(c));
        return allreduce_deadline(c, v, n, MPI_INT64_T, mop);
    }
    int e = MPI_Allreduce(MPI_IN_PLACE, v, n, MPI_INT64_T, mop, c->comm);
    return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Allreduce");
}

/* One exchange (ckpt_comm.exchange): a send and a receive between pairs
 * of ranks, every rank taking part. Messages between two ranks with one tag
 * on one communicator arrive in order, so successive exchanges pair up. */
static int mpi_exchange(void *ctx, const void *sbuf, size_t sn, int dest, void *rbuf, size_t rn,
                        int src) {
    mpi_ctx *c = ctx;
    if (sn > INT_MAX || rn > INT_MAX)
        return ckpt_set_error(CKPT_EINVAL, "exchange: more than %d bytes at once", INT_MAX);
    if ((dest >= c->size && sn) || (src >= c->size && rn))
        return ckpt_set_error(CKPT_EINVAL, "exchange: rank %d outside [0, %d)",
                              dest >= c->size ? dest : src, c->size);
    int to = dest >= 0 && sn ? dest : MPI_PROC_NULL;
    int from = src >= 0 && rn ? src : MPI_PROC_NULL;
    if (!c->in_op) {
        int e = MPI_Sendrecv(sbuf, (int)sn, MPI_BYTE, to, TAG_EXCH, rbuf, (int)rn, MPI_BYTE, from,
                             TAG_EXCH, c->comm, MPI_STATUS_IGNORE);
        return e == MPI_SUCCESS ? CKPT_OK : mpi_fail(e, "MPI_Sendrecv");
    }
    CKPT_MPI_TRY(op_ready(c));
    /* Copies: an abandoned request may still touch its buffers. */
    if (c->xout_cap < sn || !c->xout) {
        free(c->xout);
        c->xout_cap = 0;
        if ((c->xout = malloc(sn ? sn : 1))) c->xout_cap = sn;
    }
    if (c->xin_cap < rn || !c->xin) {
        free(c->xin);
        c->xin_cap = 0;
        if ((c->xin = malloc(rn ? rn : 1))) c->xin_cap = rn;
    }
    char *out = c->xout, *in = c->xin;
    if (!out || !in) return ckpt_set_error(CKPT_ENOMEM, "out of memory (exchange)");
    if (sn) memcpy(out, sbuf, sn);
    /* from here on a failure gives the copies to the request's keeping */
    size_t ocap = c->xout_cap, icap = c->xin_cap;
    c->xout = c->xin = NULL;
    c->xout_cap = c->xin_cap = 0;
    void *bufs[4] = {out, in, NULL, NULL};
    MPI_Request req[2];
    arrive(c);
    int e = MPI_Isend(out, (int)sn, MPI_BYTE, to, TAG_EXCH, c->work, &req[0]);
    if (e == MPI_SUCCESS) {
        e = MPI_Irecv(in, (int)rn, MPI_BYTE, from, TAG_EXCH, c->work, &req[1]);
        if (e != MPI_SUCCESS) {
            keep(c, req, 1, bufs); /* the send may still read out */
            return mpi_fail(e, "MPI_Irecv");
        }
    }
    if (e != MPI_SUCCESS) {
        free(out), free(in);
        return mpi_fail(e, "MPI_Isend");
    }
    CKPT_MPI_TRY(await_naps(c, req, 2, bufs, EXCHANGE_NAP_NS));
    if (rn) memcpy(rbuf, in, rn);
    c->xout = out; /* done with: kept for the next exchange */
    c->xin = in;
    c->xout_cap = ocap;
    c->xin_cap = icap;
    return CKPT_OK;
}

/* ckpt_comm.exchange_background: the same pairs on the background
 * communicator, from ckpt's background thread (MPI_THREAD_MULTIPLE). The
 * bytes go through copies: after a timeout the requests stay in flight
 * with them (the graveyard) and the channel is dead, since the ranks' later
 * exchanges would no longer pair up. */
static int mpi_exchange_bg(void *ctx, const void *sbuf, size_t sn, int dest, void *rbuf, size_t rn,
                           int src, double timeout_s) {
    mpi_ctx *c = ctx;
    if (c->bg_dead)
        return ckpt_set_error(CKPT_ETIMEDOUT, "exchange in the background: an earlier one timed "
                                              "out");
    if (sn > INT_MAX || rn > INT_MAX)
        return ckpt_set_error(CKPT_EINVAL, "exchange: more than %d bytes at once", INT_MAX);
    if ((dest >= c->size && sn) || (src >= c->size && rn))
        return ckpt_set_error(CKPT_EINVAL, "exchange: rank %d outside [0, %d)",
                              dest >= c->size ? dest : src, c->size);
    int to = dest >= 0 && sn ? dest : MPI_PROC_NULL;
    int from = src >= 0 && rn ? src : MPI_PROC_NULL;
    char *out = malloc(sn ? sn : 1), *in = malloc(rn ? rn : 1);
    if (!out || !in) {
        free(out), free(in);
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (exchange)");
    }
    if (sn) memcpy(out, sbuf, sn);
    MPI_Request req[2];
    int e = MPI_Isend(out, (int)sn, MPI_BYTE, to, TAG_EXCH, c->bg, &req[0]);
    if (e != MPI_SUCCESS) {
        free(out), free(in);
        return mpi_fail(e, "MPI_Isend");
    }
    e = MPI_Irecv(in, (int)rn, MPI_BYTE, from, TAG_EXCH, c->bg, &req[1]);
    int n = e == MPI_SUCCESS ? 2 : 1;
    double limit = now_s() + timeout_s;
    for (int spin = 0; e == MPI_SUCCESS; spin++) {
        int done = 0;
        e = MPI_Testall(n, req, &done, MPI_STATUSES_IGNORE);
        if (e == MPI_SUCCESS && done) {
            if (rn) memcpy(rbuf, in, rn);
            free(out), free(in);
            return CKPT_OK;
        }
        if (timeout_s > 0 && now_s() >= limit) break;
        if (spin >= 50) sched_yield();
    }
    /* failed or timed out: the requests keep their copies for good */
    c->bg_dead = true;
    inflight *f = calloc(1, sizeof *f);
    MPI_Request *r = malloc(sizeof req);
    if (f && r) {
        memcpy(r, req, sizeof req);
        f->n = n;
        f->reqs = r;
        f->bufs[0] = out;
        f->bufs[1] = in;
        pthread_mutex_lock(&graveyard_lock);
        f->next = graveyard;
        graveyard = f;
        pthread_mutex_unlock(&graveyard_lock);
    } else {
        free(f), free(r);
    }
    if (e != MPI_SUCCESS) return mpi_fail(e, "exchange in the background");
    return ckpt_set_error(CKPT_ETIMEDOUT,
                          "exchange in the background: rank %d or %d did not take part within %g s",
                          dest, src, timeout_s);
}

static void mpi_destroy(void *ctx) {
    mpi_ctx *c = ctx;
    if (!c) return;
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (!finalized) {
        if (c->in_op) op_end(c);
        /* After a timeout, what was abandoned gets its chance to complete
         * (every rank frees its communicator after the operation failed
         * everywhere); what still cannot keeps its communicators (bury).
         * Freeing them under pending requests makes MPI_Finalize progress
         * those on destroyed communicators. */
        bool settled = !c->ever_dead || settle_flying(c, settle_time(c), true);
        if (settled) drop_messages(c->work), drop_messages(c->comm);
        if (!settled) bury(&c->work);
        else if (c->work != MPI_COMM_NULL) MPI_Comm_free(&c->work);
        if (!settled) bury(&c->comm);
        else if (c->comm != MPI_COMM_NULL) MPI_Comm_free(&c->comm);
        /* the background channel: kept too after one of its timeouts */
        if (c->bg_dead) bury(&c->bg);
        else if (c->bg != MPI_COMM_NULL) MPI_Comm_free(&c->bg);
    }
    /* What never completed (a rank that never came) stays allocated. */
    if (c->flying) {
        pthread_mutex_lock(&graveyard_lock);
        inflight *last = c->flying;
        while (last->next) last = last->next;
        last->next = graveyard;
        graveyard = c->flying;
        pthread_mutex_unlock(&graveyard_lock);
    }
    free(c->arrived);
    free(c->hello_op);
    free(c->xout);
    free(c->xin);
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
    if (comm == MPI_COMM_NULL)
        return ckpt_set_error(CKPT_EINVAL, "comm_mpi: comm is MPI_COMM_NULL");
    ckpt_comm *c = calloc(1, sizeof *c);
    mpi_ctx *ctx = calloc(1, sizeof *ctx);
    if (!c || !ctx) {
        free(c), free(ctx);
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (comm_mpi)");
    }
    ctx->comm = MPI_COMM_NULL;
    ctx->bg = MPI_COMM_NULL;
    int e = MPI_Comm_dup(comm, &ctx->comm);
    if (e != MPI_SUCCESS) {
        free(c), free(ctx);
        return mpi_fail(e, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(ctx->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(ctx->comm, &c->rank);
    MPI_Comm_size(ctx->comm, &c->size);
    ctx->rank = c->rank;
    ctx->size = c->size;
    ctx->work = MPI_COMM_NULL;
    ctx->dirty = true; /* the first operation with a deadline makes it */
    ctx->arrived = calloc((size_t)c->size, sizeof *ctx->arrived);
    ctx->hello_op = calloc((size_t)c->size, sizeof *ctx->hello_op);
    c->ctx = ctx;
    c->destroy = mpi_destroy;
    if (!ctx->arrived || !ctx->hello_op) {
        ckpt_comm_free(c);
        return ckpt_set_error(CKPT_ENOMEM, "out of memory (comm_mpi)");
    }
    c->barrier = mpi_barrier;
    c->bcast = mpi_bcast;
    c->gather = mpi_gather;
    c->allgather = mpi_allgather;
    c->allreduce_i64 = mpi_allreduce_i64;
    c->deadline = mpi_deadline;
    c->exchange = mpi_exchange;
    /* A channel for ckpt's background thread, if MPI allows calls from
     * several threads at once (every rank has the same level). */
    int level = MPI_THREAD_SINGLE;
    if (MPI_Query_thread(&level) == MPI_SUCCESS && level == MPI_THREAD_MULTIPLE) {
        e = MPI_Comm_dup(ctx->comm, &ctx->bg);
        if (e != MPI_SUCCESS) {
            ctx->bg = MPI_COMM_NULL;
            ckpt_comm_free(c);
            return mpi_fail(e, "MPI_Comm_dup");
        }
        MPI_Comm_set_errhandler(ctx->bg, MPI_ERRORS_RETURN);
        c->exchange_background = mpi_exchange_bg;
    }
    int rc = find_node(c, ctx->comm);
    if (rc < 0) {
        ckpt_comm_free(c);
        return rc;
    }
    *out = c;
    return CKPT_OK;
}
