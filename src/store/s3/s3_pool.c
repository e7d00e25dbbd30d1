/* s3_pool.c — the object-store client's transfer threads (s3_int.h): a
 * queue of jobs, `connections` workers started on first use, each job's
 * completion waited for by its submitter. */
#include "store/s3/s3.h"

#include <stdio.h>
#include <stdlib.h>

#ifdef CKPT_HAVE_S3
#include "store/s3/s3_int.h"

/* ---- workers ------------------------------------------------------------ */

static void *worker(void *arg) {
    ckpt_s3 *c = arg;
    pthread_mutex_lock(&c->mu);
    for (;;) {
        while (!c->stop && !c->queue_head) pthread_cond_wait(&c->work_cv, &c->mu);
        if (!c->queue_head) break; /* stopping, nothing left */
        s3_job *j = c->queue_head;
        c->queue_head = j->next;
        if (!c->queue_head) c->queue_tail = NULL;
        pthread_mutex_unlock(&c->mu);
        ckpt_clear_error();
        j->run(c, j);
        pthread_mutex_lock(&c->mu);
        j->done = true;
        pthread_cond_broadcast(&c->done_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

/* Starts the workers if they are not running (under c->mu). */
static int start_workers(ckpt_s3 *c) {
    if (c->workers) return 0;
    int n = c->o.connections;
    c->workers = ckpt__calloc((size_t)n, sizeof *c->workers);
    if (!c->workers) return ckpt__err_nomem("s3 workers");
    for (int i = 0; i < n; i++) {
        if (pthread_create(&c->workers[i], NULL, worker, c) != 0) break;
        c->nworkers++;
    }
    if (c->nworkers == 0) {
        free(c->workers);
        c->workers = NULL;
        return ckpt__err(CKPT_EIO, "s3: could not start a transfer thread");
    }
    return 0;
}

int ckpt__s3_submit(ckpt_s3 *c, s3_job *j) {
    j->next = NULL;
    j->done = false;
    j->status = 0;
    j->msg[0] = '\0';
    pthread_mutex_lock(&c->mu);
    int rc = start_workers(c);
    if (rc == 0) {
        if (c->queue_tail) c->queue_tail->next = j;
        else c->queue_head = j;
        c->queue_tail = j;
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void ckpt__s3_wait(ckpt_s3 *c, s3_job *j) {
    pthread_mutex_lock(&c->mu);
    while (!j->done) pthread_cond_wait(&c->done_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

void ckpt__s3_workers_stop(ckpt_s3 *c) {
    pthread_mutex_lock(&c->mu);
    c->stop = true;
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    for (int i = 0; i < c->nworkers; i++) pthread_join(c->workers[i], NULL);
    free(c->workers);
    c->workers = NULL;
    c->nworkers = 0;
}

int ckpt__s3_job_raise(const s3_job *j) {
    if (j->status >= 0) return 0;
    return ckpt__err(j->status, "%s", j->msg);
}

#endif
