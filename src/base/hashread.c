/* hashread.c — reads on two threads, the hash in order on one (hashread.h).
 *
 * Piece k of the range is claimed by whichever thread asks first (one
 * atomic counter), read, and marked as landed in slot k % WINDOW. The
 * caller hashes piece after piece as they land; while the next one is
 * still on its way it claims and reads one itself. No thread reads more
 * than WINDOW pieces past the hash: the pieces are hashed while they are
 * still in the cache, and in ring mode (no destination) WINDOW pieces are
 * the ring. (A helper that reads every piece while the caller only hashes
 * measured 0.64-0.72x of a raw pread on the GPT-2 state, against 0.90-0.99x
 * for this: hashing bytes that sit dirty in the other core's cache costs
 * more than reading half of them oneself.) */
#include "base/hashread.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

#include "base/io.h"

#define WINDOW ((uint64_t)(CKPT_HASHREAD_RING / CKPT_HASHREAD_PIECE))

/* The kernel is asked to read ahead this much at a time (a cold read in
 * small requests runs at a third of the speed of large ones). */
#define AHEAD ((uint64_t)8 << 20)

static _Atomic int helpers = -1; /* -1: not decided yet */

int ckpt__hashread_set_helpers(int n) {
    return atomic_exchange(&helpers, n < 0 ? 0 : n > 1 ? 1 : n);
}

/* One helper where this process may run on two CPUs or more. */
static int helper_count(void) {
    int n = atomic_load(&helpers);
    if (n >= 0) return n;
    cpu_set_t set;
    CPU_ZERO(&set);
    n = sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) >= 2 ? 1 : 0;
    int unset = -1;
    atomic_compare_exchange_strong(&helpers, &unset, n);
    return atomic_load(&helpers);
}

int ckpt__hashread_helpers(void) { return helper_count(); }

typedef struct failure {
    bool failed;
    uint64_t piece;
    int err;
    uint64_t at;
} failure;

typedef struct job {
    int fd;
    uint64_t off, n, np;
    uint8_t *dst;                 /* or NULL: the ring */
    uint8_t *ring;                /* WINDOW pieces */
    _Atomic uint64_t claim;       /* the next piece nobody has claimed */
    _Atomic uint64_t hashed;      /* pieces hashed (the caller's count) */
    _Atomic uint64_t seq[WINDOW]; /* slot k % WINDOW holds piece k once it is k + 1 */
    _Atomic bool stop;
    failure helper_fail;
} job;

static uint8_t *piece_at(const job *j, uint64_t k) {
    return j->dst ? j->dst + k * CKPT_HASHREAD_PIECE : j->ring + (k % WINDOW) * CKPT_HASHREAD_PIECE;
}

static uint64_t piece_len(const job *j, uint64_t k) {
    uint64_t at = k * CKPT_HASHREAD_PIECE;
    return j->n - at < CKPT_HASHREAD_PIECE ? j->n - at : CKPT_HASHREAD_PIECE;
}

/* Reads piece k into its place and marks it landed; false (f filled) on a
 * failed read. */
static bool read_piece(job *j, uint64_t k, failure *f) {
    uint64_t at = k * CKPT_HASHREAD_PIECE, len = piece_len(j, k);
    if (at % AHEAD == 0 && at + AHEAD < j->n)
        (void)ckpt__os_fadvise(j->fd, j->off + at + AHEAD, AHEAD, POSIX_FADV_WILLNEED);
    uint8_t *p = piece_at(j, k);
    for (uint64_t got = 0; got < len;) {
        ssize_t r = ckpt__os_pread(j->fd, p + got, (size_t)(len - got), j->off + at + got);
        if (r <= 0) {
            *f = (failure){true, k, r < 0 ? errno : 0, j->off + at + got};
            atomic_store(&j->stop, true);
            return false;
        }
        got += (uint64_t)r;
    }
    atomic_store_explicit(&j->seq[k % WINDOW], k + 1, memory_order_release);
    return true;
}

static bool landed(job *j, uint64_t k) {
    return atomic_load_explicit(&j->seq[k % WINDOW], memory_order_acquire) == k + 1;
}

/* Claims the next piece if it lies within the window past the hash. */
static bool claim_next(job *j, uint64_t *k) {
    uint64_t c = atomic_load(&j->claim);
    while (c < j->np && c < atomic_load_explicit(&j->hashed, memory_order_acquire) + WINDOW) {
        if (atomic_compare_exchange_weak(&j->claim, &c, c + 1)) {
            *k = c;
            return true;
        }
    }
    return false;
}

static void *helper_main(void *arg) {
    job *j = arg;
    while (!atomic_load(&j->stop)) {
        uint64_t k;
        if (!claim_next(j, &k)) {
            if (atomic_load(&j->claim) >= j->np) break;
            sched_yield(); /* the window is full: the hash catches up */
            continue;
        }
        if (!read_piece(j, k, &j->helper_fail)) break;
    }
    return NULL;
}

/* ---- a helper thread kept for many ranges ----------------------------------- */

struct ckpt__hashread_helper {
    pthread_t th;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    job *current; /* posted by the caller, NULL once the helper is done with it */
    bool quit;
};

static void *kept_main(void *arg) {
    ckpt__hashread_helper *hp = arg;
    pthread_mutex_lock(&hp->mu);
    for (;;) {
        while (!hp->current && !hp->quit) pthread_cond_wait(&hp->cv, &hp->mu);
        if (!hp->current) break; /* quit, nothing posted */
        job *j = hp->current;
        pthread_mutex_unlock(&hp->mu);
        helper_main(j);
        pthread_mutex_lock(&hp->mu);
        hp->current = NULL;
        pthread_cond_broadcast(&hp->cv);
    }
    pthread_mutex_unlock(&hp->mu);
    return NULL;
}

/* The kept helper, started now if *slot has none; NULL if it cannot be. */
static ckpt__hashread_helper *kept_helper(ckpt__hashread_helper **slot) {
    if (*slot) return *slot;
    ckpt__hashread_helper *hp = calloc(1, sizeof *hp);
    if (!hp) return NULL;
    if (pthread_mutex_init(&hp->mu, NULL) != 0) {
        free(hp);
        return NULL;
    }
    if (pthread_cond_init(&hp->cv, NULL) != 0 ||
        pthread_create(&hp->th, NULL, kept_main, hp) != 0) {
        pthread_cond_destroy(&hp->cv);
        pthread_mutex_destroy(&hp->mu);
        free(hp);
        return NULL;
    }
    return *slot = hp;
}

void ckpt__hashread_helper_free(ckpt__hashread_helper *hp) {
    if (!hp) return;
    pthread_mutex_lock(&hp->mu);
    hp->quit = true;
    pthread_cond_broadcast(&hp->cv);
    pthread_mutex_unlock(&hp->mu);
    pthread_join(hp->th, NULL);
    pthread_cond_destroy(&hp->cv);
    pthread_mutex_destroy(&hp->mu);
    free(hp);
}

/* ---- the read ------------------------------------------------------------------ */

int ckpt__hashread(ckpt__hashread_helper **kept, int fd, uint64_t off, uint64_t n, uint8_t *dst,
                   uint8_t *ring, XXH3_state_t *h, ckpt__hashread_fail *why) {
    job jb = {.fd = fd,
              .off = off,
              .n = n,
              .np = (n + CKPT_HASHREAD_PIECE - 1) / CKPT_HASHREAD_PIECE,
              .dst = dst,
              .ring = ring};
    job *j = &jb;
    /* the helper: the caller's kept one (posted the job), else a thread of
     * this call's own */
    ckpt__hashread_helper *hp = NULL;
    pthread_t th;
    bool threaded = false;
    if (n >= CKPT_HASHREAD_MIN && helper_count() > 0) {
        if (kept && (hp = kept_helper(kept)) != NULL) {
            pthread_mutex_lock(&hp->mu);
            hp->current = j;
            pthread_cond_broadcast(&hp->cv);
            pthread_mutex_unlock(&hp->mu);
            threaded = true;
        } else {
            threaded = pthread_create(&th, NULL, helper_main, j) == 0;
        }
    }
    failure mine = {0};
    uint64_t c = 0;
    while (c < j->np && !atomic_load(&j->stop)) {
        if (landed(j, c)) {
            XXH3_64bits_update(h, piece_at(j, c), (size_t)piece_len(j, c));
            atomic_store_explicit(&j->hashed, ++c, memory_order_release);
            continue;
        }
        uint64_t k;
        if (claim_next(j, &k)) {
            if (!read_piece(j, k, &mine)) break;
        } else {
            sched_yield(); /* piece c is on its way on the helper */
        }
    }
    atomic_store(&j->stop, true);
    if (threaded && hp) { /* the kept helper lets go of the job */
        pthread_mutex_lock(&hp->mu);
        while (hp->current) pthread_cond_wait(&hp->cv, &hp->mu);
        pthread_mutex_unlock(&hp->mu);
    } else if (threaded) {
        pthread_join(th, NULL);
    }
    const failure *f = NULL;
    if (mine.failed) f = &mine;
    if (j->helper_fail.failed && (!f || j->helper_fail.piece < f->piece)) f = &j->helper_fail;
    int rc = 0;
    if (f) {
        *why = (ckpt__hashread_fail){f->err, f->at};
        rc = -1;
    }
    return rc;
}
