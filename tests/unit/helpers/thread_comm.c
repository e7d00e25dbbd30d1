/* thread_comm.c — see thread_comm.h. */
#include "helpers/thread_comm.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct tc_group {
    int p;
    pthread_barrier_t bar;
    const void **slot; /* each rank's buffer of the collective in progress */
    size_t *slen;
    int *sdest; /* exchange: where each rank's bytes go */
    /* exchange_background: messages in flight, in the order sent */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    struct tc_msg *msgs;
} tc_group;

typedef struct tc_msg {
    int from, to;
    size_t n;
    struct tc_msg *next;
    unsigned char data[];
} tc_msg;

typedef struct tc_rank {
    tc_group *g;
    int rank;
    ckpt_comm comm;
    void (*fn)(const ckpt_comm *, void *);
    void *arg;
} tc_rank;

static void sync_all(tc_group *g) { pthread_barrier_wait(&g->bar); }

static int tc_barrier(void *ctx) {
    sync_all(((tc_rank *)ctx)->g);
    return CKPT_OK;
}

static int tc_bcast(void *ctx, void *buf, size_t n, int root) {
    tc_rank *me = ctx;
    tc_group *g = me->g;
    if (me->rank == root) g->slot[root] = buf;
    sync_all(g);
    if (me->rank != root && n) memcpy(buf, g->slot[root], n);
    sync_all(g);
    return CKPT_OK;
}

static int tc_gather(void *ctx, const void *buf, size_t n, void **out, size_t *lens, int root) {
    tc_rank *me = ctx;
    tc_group *g = me->g;
    g->slot[me->rank] = buf;
    g->slen[me->rank] = n;
    sync_all(g);
    int rc = CKPT_OK;
    if (me->rank == root) {
        size_t total = 0;
        for (int r = 0; r < g->p; r++) total += g->slen[r];
        char *p = malloc(total ? total : 1);
        if (!p) {
            rc = ckpt_set_error(CKPT_ENOMEM, "thread comm: gather");
        } else {
            size_t off = 0;
            for (int r = 0; r < g->p; r++) {
                if (g->slen[r]) memcpy(p + off, g->slot[r], g->slen[r]);
                lens[r] = g->slen[r];
                off += g->slen[r];
            }
            *out = p;
        }
    }
    sync_all(g);
    return rc;
}

static int tc_allgather(void *ctx, const void *buf, void *out, const size_t *lens) {
    tc_rank *me = ctx;
    tc_group *g = me->g;
    g->slot[me->rank] = buf;
    sync_all(g);
    size_t off = 0;
    for (int r = 0; r < g->p; r++) {
        if (lens[r]) memmove((char *)out + off, g->slot[r], lens[r]);
        off += lens[r];
    }
    sync_all(g);
    return CKPT_OK;
}

static int tc_allreduce_i64(void *ctx, int64_t *v, int n, ckpt_reduce_op op) {
    tc_rank *me = ctx;
    tc_group *g = me->g;
    int64_t *acc = malloc((size_t)(n > 0 ? n : 1) * sizeof *acc);
    g->slot[me->rank] = v;
    sync_all(g);
    for (int i = 0; acc && i < n; i++) {
        int64_t a = ((const int64_t *)g->slot[0])[i];
        for (int r = 1; r < g->p; r++) {
            int64_t b = ((const int64_t *)g->slot[r])[i];
            a = op == CKPT_REDUCE_MIN ? (b < a ? b : a) : op == CKPT_REDUCE_MAX ? (b > a ? b : a) : a + b;
        }
        acc[i] = a;
    }
    sync_all(g); /* everyone has read every slot before anyone writes */
    if (acc) memcpy(v, acc, (size_t)n * sizeof *v);
    free(acc);
    sync_all(g);
    return acc ? CKPT_OK : ckpt_set_error(CKPT_ENOMEM, "thread comm: allreduce");
}

static int tc_exchange(void *ctx, const void *sbuf, size_t sn, int dest, void *rbuf, size_t rn,
                       int src) {
    tc_rank *me = ctx;
    tc_group *g = me->g;
    g->slot[me->rank] = sbuf;
    g->slen[me->rank] = sn;
    g->sdest[me->rank] = sn ? dest : -1;
    sync_all(g);
    int rc = CKPT_OK;
    if (rn && src >= 0) {
        if (g->sdest[src] != me->rank || g->slen[src] != rn)
            rc = ckpt_set_error(CKPT_EIO,
                                "thread comm: exchange: rank %d sends %zu bytes to %d, "
                                "rank %d expects %zu",
                                src, g->slen[src], g->sdest[src], me->rank, rn);
        else memcpy(rbuf, g->slot[src], rn);
    }
    sync_all(g);
    return rc;
}

/* The background channel: a send is a message queued for its receiver (no
 * waiting for it); a receive takes the oldest message from src to this
 * rank, waiting up to timeout_s. */
static int tc_exchange_bg(void *ctx, const void *sbuf, size_t sn, int dest, void *rbuf, size_t rn,
                          int src, double timeout_s) {
    tc_rank *me = ctx;
    tc_group *g = me->g;
    int rc = CKPT_OK;
    pthread_mutex_lock(&g->mu);
    if (sn && dest >= 0) {
        tc_msg *m = malloc(sizeof *m + sn);
        if (!m) abort();
        *m = (tc_msg){.from = me->rank, .to = dest, .n = sn};
        memcpy(m->data, sbuf, sn);
        tc_msg **pp = &g->msgs;
        while (*pp) pp = &(*pp)->next;
        *pp = m;
        pthread_cond_broadcast(&g->cv);
    }
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_s > 0 ? (time_t)timeout_s + 1 : 3600;
    while (rn && src >= 0) {
        tc_msg **pp = &g->msgs;
        while (*pp && !((*pp)->from == src && (*pp)->to == me->rank)) pp = &(*pp)->next;
        if (*pp) {
            tc_msg *m = *pp;
            *pp = m->next;
            if (m->n != rn)
                rc = ckpt_set_error(CKPT_EIO,
                                    "thread comm: background exchange: rank %d sent %zu bytes, "
                                    "rank %d expects %zu",
                                    src, m->n, me->rank, rn);
            else memcpy(rbuf, m->data, rn);
            free(m);
            break;
        }
        if (pthread_cond_timedwait(&g->cv, &g->mu, &until) != 0) {
            rc = ckpt_set_error(CKPT_ETIMEDOUT,
                                "thread comm: background exchange: nothing from "
                                "rank %d",
                                src);
            break;
        }
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

static bool with_exchange, with_background;
void tc_set_exchange(bool on) { with_exchange = on; }
void tc_set_exchange_background(bool on) { with_background = on; }

static void *tc_main(void *arg) {
    tc_rank *me = arg;
    me->fn(&me->comm, me->arg);
    return NULL;
}

void tc_run(int p, void (*fn)(const ckpt_comm *comm, void *arg), void *arg) {
    tc_group g = {.p = p};
    g.slot = calloc((size_t)p, sizeof *g.slot);
    g.slen = calloc((size_t)p, sizeof *g.slen);
    g.sdest = calloc((size_t)p, sizeof *g.sdest);
    tc_rank *ranks = calloc((size_t)p, sizeof *ranks);
    pthread_t *th = calloc((size_t)p, sizeof *th);
    if (!g.slot || !g.slen || !g.sdest || !ranks || !th) abort();
    pthread_barrier_init(&g.bar, NULL, (unsigned)p);
    pthread_mutex_init(&g.mu, NULL);
    pthread_cond_init(&g.cv, NULL);
    for (int r = 0; r < p; r++) {
        tc_rank *me = &ranks[r];
        me->g = &g;
        me->rank = r;
        me->fn = fn;
        me->arg = arg;
        me->comm = (ckpt_comm){.rank = r,
                               .size = p,
                               .local_rank = r,
                               .local_size = p,
                               .node = 0,
                               .num_nodes = 1,
                               .ctx = me,
                               .barrier = tc_barrier,
                               .bcast = tc_bcast,
                               .gather = tc_gather,
                               .allgather = tc_allgather,
                               .allreduce_i64 = tc_allreduce_i64,
                               .exchange = with_exchange ? tc_exchange : NULL,
                               .exchange_background = with_background ? tc_exchange_bg : NULL};
    }
    for (int r = 0; r < p; r++)
        if (pthread_create(&th[r], NULL, tc_main, &ranks[r]) != 0) abort();
    for (int r = 0; r < p; r++) pthread_join(th[r], NULL);
    pthread_barrier_destroy(&g.bar);
    while (g.msgs) { /* sent and never received */
        tc_msg *m = g.msgs;
        g.msgs = m->next;
        free(m);
    }
    pthread_cond_destroy(&g.cv);
    pthread_mutex_destroy(&g.mu);
    free(th);
    free(ranks);
    free(g.slot);
    free(g.slen);
    free(g.sdest);
}
