/* async.c — the drivers of save.c's phases. ckpt_save_state runs them all
 * in the caller's thread; ckpt_save_state_async / ckpt_save_wait run them in
 * two places:
 *
 *   caller's thread   plan + snapshot (save_op.h), then every
 *                     tensor copied into the staging area (or, past
 *                     async_staging_limit, its file written at once)
 *   background thread write; with one process also agree (trivial),
 *                     commit, rotate and release; with node-local tiers
 *                     and ckpt_comm.exchange_background, the replication
 *                     of this rank's part to other nodes
 *   caller's thread   at the next wait / save / load / free: with several
 *                     processes the agreement and the commit (collectives
 *                     never leave the caller's thread); the numbering and
 *                     last folder move on, or a failure is kept to be
 *                     returned
 *
 * One background thread per accelerator, started at the first asynchronous
 * save and joined at free; at most one save is pending. */
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "accel/accel.h"
#include "accel/save_op.h"
#include "base/error.h"
#include "base/io.h"
#include "format/statedict.h"

#define MSG_CAP 2048

typedef struct ckpt_async {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    pthread_t th;
    bool started;
    bool quit;           /* under mu: the thread ends */
    ckpt_save_op *job;   /* under mu: handed to the thread, NULL once it is done */
    bool job_finish;     /* under mu: the thread also finishes it (one process) */
    char bg_msg[MSG_CAP]; /* the thread's message of a failed job (read after it is done) */
    uint8_t *prefault;   /* under mu: pages the thread touches once, NULL when done */
    uint64_t prefault_len;
    char **trash; /* under mu: hidden folders of old checkpoints the thread deletes */
    int ntrash, trash_cap;
    bool trashing;         /* under mu: the thread is deleting some */
    ckpt_logger trash_log; /* under mu: where a failed deletion is reported */
    pid_t tid;           /* the thread's id (under mu; 0 until it runs) */
    unsigned background; /* CKPT_ASYNC_* of the next job (the caller's copy at hand-over) */
    bool lowered;        /* under mu: the running job runs at the lowered priority */
    /* The caller's side, never touched by the thread. */
    ckpt_save_op *pending;
    int64_t iteration_before;
    int failed;          /* a settled failure not yet returned */
    char failed_msg[MSG_CAP];
} ckpt_async;

/* ---- the background thread --------------------------------------------------- */

/* Writes (and with one process commits) the job; a failure is logged at
 * once, from this thread, and its message kept for the waiter (the
 * message of ckpt_errmsg() is the thread's own). */
static void run_job(ckpt_async *as, ckpt_save_op *op, bool finish) {
    int rc = ckpt__save_op_write(op);
    /* with node-local tiers and a channel for it: the replication too
     * (every rank's thread takes part, whatever its status) */
    if (ckpt__save_op_replicates_in_background(op)) ckpt__save_op_replicate(op);
    if (finish) rc = ckpt__save_op_commit(op);
    if (rc < 0) {
        snprintf(as->bg_msg, sizeof as->bg_msg, "%s", ckpt_errmsg());
        ckpt__log(ckpt__save_op_logger(op), CKPT_LOG_ERROR, "asynchronous save failed: %s",
                  as->bg_msg);
    }
}

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif

/* Every page of [p, p + n) backed by memory, so that the first copy into it
 * costs what a later one does. The kernel maps the pages in one call
 * (MADV_POPULATE_WRITE, where it has it); then one write per page from
 * here: under a hypervisor that backs a guest's memory lazily, the first
 * write to each page is what costs (measured on a 2-vCPU VM: 1.5 GB
 * populated in 0.65 s, and the first memcpy into it still took 5.5 s,
 * against 0.3 s for later ones; after a write per page the first took
 * 0.3-0.5 s). The contents do not matter: nobody uses them yet. */
static void touch_pages(uint8_t *p, uint64_t n) {
    if (n == 0) return;
    (void)madvise(p, (size_t)n, MADV_POPULATE_WRITE);
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    for (uint64_t off = 0; off < n; off += page) ((volatile uint8_t *)p)[off] = 0;
}

/* ---- the thread's priority --------------------------------------------------
 * A job runs at the lowest priority the caller asked for (CKPT_ASYNC_*), so
 * that the training thread keeps its core: the scheduler's idle class
 * (SCHED_IDLE: it runs only on a core nobody else wants) and the idle I/O
 * class (its own reads and fsyncs are served when the disk is otherwise
 * idle, where the disk's I/O scheduler honours classes). When the caller
 * waits for the job (the next save, a load, a wait, free), the job is the
 * caller's critical path: it goes back to the normal classes at once, so a
 * waiting caller never waits on an idle-class thread. Unprivileged threads
 * may make both changes (back to SCHED_OTHER at an unchanged nice value,
 * I/O best effort); a refused change is ignored: priorities are a hint. */

#define IOPRIO_CLASS_SHIFT 13
enum { IOPRIO_CLASS_BE_ = 2, IOPRIO_CLASS_IDLE_ = 3, IOPRIO_WHO_PROCESS_ = 1 };

static void set_io_class(pid_t tid, int cls) {
#ifdef SYS_ioprio_set
    (void)syscall(SYS_ioprio_set, IOPRIO_WHO_PROCESS_, (int)tid,
                  (cls << IOPRIO_CLASS_SHIFT) | (cls == IOPRIO_CLASS_BE_ ? 4 : 0));
#else
    (void)tid, (void)cls;
#endif
}

/* The calling thread (the worker) lowered as flags say; under mu. */
static void lower_self(ckpt_async *as, unsigned flags) {
    struct sched_param sp = {0};
    if (flags & CKPT_ASYNC_CPU_IDLE) (void)pthread_setschedparam(pthread_self(), SCHED_IDLE, &sp);
    if (flags & CKPT_ASYNC_IO_IDLE) set_io_class(as->tid, IOPRIO_CLASS_IDLE_);
    as->lowered = flags != 0;
}

/* The worker back to the normal classes (from any thread); under mu. */
static void raise_worker(ckpt_async *as) {
    if (!as->lowered) return;
    struct sched_param sp = {0};
    (void)pthread_setschedparam(as->th, SCHED_OTHER, &sp);
    set_io_class(as->tid, IOPRIO_CLASS_BE_);
    as->lowered = false;
}

/* Deletes the old checkpoints a synchronous save's rotation renamed away
 * (ckpt__save_op_defer_removal); under mu on entry and return. */
static void take_out_trash(ckpt_async *as) {
    char **t = as->trash;
    int n = as->ntrash;
    ckpt_logger lg = as->trash_log;
    as->trash = NULL;
    as->ntrash = as->trash_cap = 0;
    as->trashing = true;
    pthread_mutex_unlock(&as->mu);
    /* Housekeeping after a commit: nothing depends on it (a folder left
     * behind is a hidden leftover the next save removes), so a fault layer
     * neither counts nor fails its calls; they run whenever this thread
     * gets to them. */
    ckpt__fs_exempt_begin();
    for (int i = 0; i < n; i++) {
        if (ckpt__remove_tree(t[i]) < 0)
            ckpt__log(&lg, CKPT_LOG_WARNING, "could not remove %s: %s", t[i], ckpt_errmsg());
        free(t[i]);
    }
    ckpt__fs_exempt_end();
    free(t);
    pthread_mutex_lock(&as->mu);
    as->trashing = false;
    pthread_cond_broadcast(&as->cv);
}

static void *worker(void *arg) {
    ckpt_async *as = arg;
    pthread_mutex_lock(&as->mu);
    as->tid = (pid_t)syscall(SYS_gettid);
    for (;;) {
        while (!as->job && !as->quit && !as->prefault && !as->ntrash)
            pthread_cond_wait(&as->cv, &as->mu);
        if (as->prefault) {
            uint8_t *p = as->prefault;
            uint64_t n = as->prefault_len;
            lower_self(as, as->background & CKPT_ASYNC_CPU_IDLE);
            pthread_mutex_unlock(&as->mu);
            touch_pages(p, n);
            pthread_mutex_lock(&as->mu);
            raise_worker(as);
            as->prefault = NULL;
            pthread_cond_broadcast(&as->cv);
            continue;
        }
        if (as->ntrash) {
            take_out_trash(as);
            continue;
        }
        if (!as->job) break;
        ckpt_save_op *op = as->job;
        bool finish = as->job_finish;
        lower_self(as, as->background);
        pthread_mutex_unlock(&as->mu);
        run_job(as, op, finish);
        pthread_mutex_lock(&as->mu);
        raise_worker(as);
        as->job = NULL;
        pthread_cond_broadcast(&as->cv);
    }
    pthread_mutex_unlock(&as->mu);
    return NULL;
}

/* ---- the caller's side ---------------------------------------------------------- */

static ckpt_async *async_get(ckpt_accelerator *acc) {
    if (acc->async) return acc->async;
    ckpt_async *as = ckpt__calloc(1, sizeof *as);
    if (!as) return NULL;
    if (pthread_mutex_init(&as->mu, NULL) != 0) {
        free(as);
        return NULL;
    }
    if (pthread_cond_init(&as->cv, NULL) != 0) {
        pthread_mutex_destroy(&as->mu);
        free(as);
        return NULL;
    }
    acc->async = as;
    return as;
}

static int start_thread(ckpt_async *as) {
    if (as->started) return CKPT_OK;
    int e = pthread_create(&as->th, NULL, worker, as);
    if (e != 0) return ckpt__err_os(e, "save_state_async: start the background thread");
    as->started = true;
    return CKPT_OK;
}

/* Waits for the thread to finish touching the staging area's pages and
 * deleting old checkpoints. */
static void wait_chores(ckpt_async *as) {
    pthread_mutex_lock(&as->mu);
    if (as->prefault) raise_worker(as); /* the caller waits for it now */
    while (as->prefault || as->ntrash || as->trashing) pthread_cond_wait(&as->cv, &as->mu);
    pthread_mutex_unlock(&as->mu);
}

/* The old checkpoints a synchronous save's rotation renamed away, deleted
 * by the background thread (or here, if it cannot start): the save returns
 * once they are out of sight, not once their files are gone. Takes t. */
static void hand_over_trash(ckpt_accelerator *acc, char **t, int n) {
    if (n == 0) {
        free(t);
        return;
    }
    ckpt_async *as = async_get(acc);
    bool handed = false;
    if (as && start_thread(as) == 0) {
        pthread_mutex_lock(&as->mu);
        if (as->ntrash + n > as->trash_cap) {
            int cap = as->ntrash + n;
            char **g = ckpt__realloc(as->trash, (size_t)cap * sizeof *g);
            if (g) {
                as->trash = g;
                as->trash_cap = cap;
            }
        }
        if (as->ntrash + n <= as->trash_cap) {
            memcpy(as->trash + as->ntrash, t, (size_t)n * sizeof *t);
            as->ntrash += n;
            as->trash_log = acc->log;
            handed = true;
            pthread_cond_broadcast(&as->cv);
        }
        pthread_mutex_unlock(&as->mu);
    }
    ckpt_clear_error(); /* the save succeeded: a thread that could not start is no failure */
    for (int i = 0; !handed && i < n; i++) {
        if (ckpt__remove_tree(t[i]) < 0)
            ckpt__log(&acc->log, CKPT_LOG_WARNING, "could not remove %s: %s", t[i], ckpt_errmsg());
        free(t[i]);
    }
    free(t);
}

int ckpt__async_settle(ckpt_accelerator *acc, bool report) {
    ckpt_async *as = acc->async;
    if (!as) return CKPT_OK;
    /* Nothing uses the buffer area while the thread is touching it, and
     * the next save's look for leftovers finds no folder being deleted. */
    wait_chores(as);
    if (as->pending) {
        ckpt_save_op *op = as->pending;
        as->pending = NULL;
        pthread_mutex_lock(&as->mu);
        if (as->job) raise_worker(as); /* the caller waits for it now */
        while (as->job) pthread_cond_wait(&as->cv, &as->mu);
        pthread_mutex_unlock(&as->mu);
        int rc = ckpt__save_op_status(op);
        bool logged = rc < 0; /* the thread logged its own failure */
        /* The thread's message becomes this thread's. */
        if (rc < 0) ckpt__err(rc, "%s", as->bg_msg);
        if (acc->comm->size > 1) {
            rc = ckpt__save_op_commit(op);
            if (rc < 0 && !logged)
                ckpt__log(ckpt__save_op_logger(op), CKPT_LOG_ERROR, "asynchronous save failed: %s",
                          ckpt_errmsg());
        }
        if (rc < 0) {
            acc->iteration = as->iteration_before;
            as->failed = rc;
            snprintf(as->failed_msg, sizeof as->failed_msg, "%s", ckpt_errmsg());
        }
        ckpt__save_op_apply(op); /* the post-save hooks run here, in the caller's thread */
        ckpt__save_op_free(op);
    }
    if (report && as->failed < 0) {
        int rc = ckpt__err(as->failed, "%s", as->failed_msg);
        as->failed = 0;
        return rc;
    }
    return CKPT_OK;
}

int ckpt_save_state_async(ckpt_accelerator *acc, const char *output_dir) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "save_state_async: acc is NULL");
    /* The pending save ends first; its failure is this call's. */
    CKPT_TRY(ckpt__async_settle(acc, true));
    ckpt_async *as = async_get(acc);
    if (!as) return ckpt__err_nomem("save_state_async");
    ckpt_save_op *op = NULL;
    ckpt__save_op_new(acc, output_dir, &op);
    if (!op) return ckpt__err_nomem("save_state_async");
    ckpt__save_op_replicate_in_background(op);
    bool bg = ckpt__save_op_replicates_in_background(op);
    ckpt__save_op_plan(op);
    ckpt__save_op_snapshot(op);
    int rc = ckpt__save_op_agree_snapshot(op);
    if (rc == 0) rc = ckpt__save_op_stage(op);
    if (rc == 0 || bg) {
        int trc = start_thread(as);
        if (rc == 0) rc = trc;
    }
    if (rc < 0 && acc->comm->size <= 1) {
        /* Nothing handed over: ends here, as a synchronous save would. */
        ckpt__save_op_fail(op, rc);
        rc = ckpt__save_op_commit(op);
        ckpt__save_op_free(op);
        return rc;
    }
    /* With several processes a local failure is kept in op and reported at
     * the agreement, on every rank, at the next wait. */
    if (rc < 0) {
        ckpt__save_op_fail(op, rc);
        snprintf(as->bg_msg, sizeof as->bg_msg, "%s", ckpt_errmsg());
        ckpt__log(ckpt__save_op_logger(op), CKPT_LOG_ERROR, "asynchronous save failed: %s",
                  as->bg_msg);
    }
    as->pending = op;
    as->iteration_before = acc->iteration;
    int64_t num = ckpt__save_op_number(op);
    if (rc == 0 && num >= 0 && num + 1 > acc->iteration) acc->iteration = num + 1;
    /* A failed rank's thread still takes part in the replication's
     * exchanges (sending nothing), so that no other rank waits for it. */
    if (rc == 0 || (bg && as->started)) {
        pthread_mutex_lock(&as->mu);
        as->job = op;
        as->job_finish = acc->comm->size <= 1;
        as->background = acc->async_background;
        pthread_cond_broadcast(&as->cv);
        pthread_mutex_unlock(&as->mu);
        if (rc == 0) acc->nmetrics = 0; /* the pending save carries them */
    }
    return CKPT_OK;
}

int ckpt_accelerator_prepare_async(ckpt_accelerator *acc) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "prepare_async: acc is NULL");
    /* The area is not resized under a pending save (or a touch in progress). */
    ckpt__async_settle(acc, false);
    ckpt_async *as = async_get(acc);
    if (!as) return ckpt__err_nomem("prepare_async");
    /* The sizes as a save would stage them: every object's state_dict into
     * a writer that only borrows the tensors (nothing is copied). */
    int n = 0;
    ckpt_acc_obj *objs = ckpt__acc_plan_objects(acc, &n);
    if (!objs) return ckpt__err_nomem("prepare_async");
    uint64_t total = 0;
    int rc = CKPT_OK;
    for (int i = 0; i < n && rc == 0; i++) {
        ckpt_writer *w = NULL;
        rc = ckpt_writer_new(&w);
        if (rc < 0) break;
        ckpt_clear_error();
        int src = objs[i].ops->state_dict(objs[i].self, w);
        if (src != 0) {
            bool own = ckpt_errmsg()[0] != '\0';
            char name[96];
            ckpt__acc_file_name(acc, &objs[i], name, sizeof name);
            rc = ckpt__callback_failed(src, "state_dict");
            rc = ckpt__err_prefix(rc, own ? "prepare_async: %s: state_dict" : "prepare_async: %s",
                                  name);
        } else {
            ckpt__save_stage_fits(acc->async_staging_limit, &total, ckpt__writer_stage_bytes(w));
        }
        ckpt_writer_free(w);
    }
    free(objs);
    if (rc == 0 && total > acc->arena.cap) rc = ckpt__arena_reserve(&acc->arena, total);
    if (rc == 0 && total > 0) acc->arena_staging = true;
    if (rc == 0 && total > 0) rc = start_thread(as);
    if (rc < 0 || total == 0) return rc;
    /* The pages are touched in the background; the next save, load, wait
     * or free waits for that first. */
    pthread_mutex_lock(&as->mu);
    as->prefault = acc->arena.p;
    as->prefault_len = acc->arena.cap;
    as->background = acc->async_background;
    pthread_cond_broadcast(&as->cv);
    pthread_mutex_unlock(&as->mu);
    return CKPT_OK;
}

/* Whether this rank's background job is done (no pending save counts as
 * done): a look under the lock, never a wait. */
static bool job_done(ckpt_async *as) {
    if (!as || !as->pending) return true;
    pthread_mutex_lock(&as->mu);
    bool done = as->job == NULL;
    pthread_mutex_unlock(&as->mu);
    return done;
}

int ckpt_save_poll(ckpt_accelerator *acc) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "save_poll: acc is NULL");
    int64_t ready = job_done(acc->async);
    const ckpt_comm *c = acc->comm;
    if (c->size > 1) {
        /* every rank's files written, or no rank commits */
        ckpt__coll_begin(acc, "save: poll");
        int crc = c->allreduce_i64(c->ctx, &ready, 1, CKPT_REDUCE_MIN);
        ckpt__coll_end(acc);
        if (crc < 0) return ckpt__err_prefix(crc, "save_poll: communicator");
    }
    if (!ready) return 0;
    int rc = ckpt__async_settle(acc, true);
    return rc < 0 ? rc : 1;
}

int ckpt_save_wait(ckpt_accelerator *acc) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "save_wait: acc is NULL");
    return ckpt__async_settle(acc, true);
}

int ckpt_accelerator_set_async_background(ckpt_accelerator *acc, unsigned flags) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "set_async_background: acc is NULL");
    if (flags & ~(unsigned)CKPT_ASYNC_IDLE)
        return ckpt__err(CKPT_EINVAL, "set_async_background: unknown bits 0x%x (known: 0x%x)",
                         flags & ~(unsigned)CKPT_ASYNC_IDLE, (unsigned)CKPT_ASYNC_IDLE);
    acc->async_background = flags;
    return CKPT_OK;
}

int ckpt_accelerator_set_async_staging_limit(ckpt_accelerator *acc, uint64_t bytes) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "set_async_staging_limit: acc is NULL");
    acc->async_staging_limit = bytes;
    return CKPT_OK;
}

void ckpt__async_free(ckpt_accelerator *acc) {
    ckpt_async *as = acc->async;
    if (!as) return;
    /* A failure not yet returned was logged when it happened. (A post-save
     * hook may have started another save.) */
    while (as->pending) ckpt__async_settle(acc, false);
    if (as->started) {
        pthread_mutex_lock(&as->mu);
        as->quit = true;
        pthread_cond_broadcast(&as->cv);
        pthread_mutex_unlock(&as->mu);
        pthread_join(as->th, NULL);
    }
    for (int i = 0; i < as->ntrash; i++) { /* the thread never ran */
        if (ckpt__remove_tree(as->trash[i]) < 0) ckpt_clear_error();
        free(as->trash[i]);
    }
    free(as->trash);
    pthread_cond_destroy(&as->cv);
    pthread_mutex_destroy(&as->mu);
    free(as);
    acc->async = NULL;
}

/* The synchronous save: every phase in the caller's thread. Here, beside
 * the asynchronous driver, because it ends a pending background save first
 * (save.c knows neither driver). */
int ckpt_save_state(ckpt_accelerator *acc, const char *output_dir) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "save_state: acc is NULL");
    /* A pending asynchronous save ends first; its failure is this call's. */
    CKPT_TRY(ckpt__async_settle(acc, true));
    ckpt_save_op *op = NULL;
    ckpt__save_op_new(acc, output_dir, &op);
    if (!op) return ckpt__err_nomem("save_state");
    /* Each phase does nothing once the op has failed, but the collectives
     * every rank takes part in; commit agrees on the outcome. */
    ckpt__save_op_plan(op);
    ckpt__save_op_snapshot(op);
    ckpt__save_op_write(op);
    ckpt__save_op_defer_removal(op);
    int rc = ckpt__save_op_commit(op);
    int ntrash = 0;
    char **trash = ckpt__save_op_take_trash(op, &ntrash);
    hand_over_trash(acc, trash, ntrash); /* before the post-hooks, which may save again */
    ckpt__save_op_apply(op);
    ckpt__save_op_free(op);
    if (rc == 0) acc->nmetrics = 0; /* recorded; a failed save keeps them for the retry */
    return rc;
}
