/* dataloader.c — batches of a map-style dataset in an order that is a pure
 * function of (seed, epoch), with O(1) skipping and exact mid-epoch resume.
 *
 * Order. Position q of epoch e maps to a dataset index by a keyed bijection
 * of [0, n): a balanced Feistel network over the smallest 4^k >= n whose round
 * function is Philox4x32-10 keyed by the seed (counter = half, round, epoch),
 * with cycle-walking to stay inside [0, n). Any position is computed on its
 * own in O(1) time and memory, so no permutation is ever materialised: a
 * 10^8-sample dataset costs nothing, and skipping is arithmetic.
 *
 * Shards. A global batch is batch_size * num_processes consecutive positions;
 * process p takes the p-th slice of batch_size (Accelerate's default,
 * split_batches = false). A short last global batch is dropped (drop_last),
 * completed from the start of the epoch's order (even_batches), or split as
 * far as it goes (some processes then get a smaller batch or none).
 *
 * Workers. Batches form one stream numbered t = 0, 1, ... from a base
 * position; the t-th batch goes to slot t % nslots of a ring. Workers claim
 * stream numbers in order and fill slots; the consumer takes them in order,
 * so threads never change order or content. Anything that moves the position
 * (set_epoch, skip, load, shard) pauses the workers, waits for fills in
 * flight, and restarts the stream at the new position.
 */
#include <limits.h>
#include <pthread.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

#include "train/dataloader.h"
#include "base/error.h"

#define MSG_CAP 1024
#define FEISTEL_ROUNDS 6

enum { SLOT_FREE = 0, SLOT_FILLING = 1, SLOT_READY = 2 };

typedef struct dl_slot {
    int state;
    int64_t t;       /* stream number held (READY) */
    int status;      /* fill result: 0 or a ckpt_status */
    int64_t epoch, index, size;
    void *data;      /* batch_bytes */
    int64_t *indices;/* batch_size */
    void *scratch;   /* batch_size * sample_bytes, collate input (NULL without collate) */
    char msg[MSG_CAP];
} dl_slot;

struct ckpt_dataloader {
    ckpt_dataset ds;
    ckpt_dataloader_config cfg;
    int64_t n;            /* dataset length, read once at creation */
    int64_t nb;           /* this process's batches per epoch */
    int64_t full;         /* full global batches per epoch */
    size_t batch_bytes;

    /* consumer position: the next batch is (epoch, pos) */
    int64_t epoch, pos;
    /* the stream: batch t is (base_epoch, base_pos) advanced by t */
    int64_t base_epoch, base_pos;
    int64_t consumed;     /* stream batches taken by the consumer */
    bool holding;         /* the consumer holds slot of stream batch consumed-1 */

    int nslots;
    dl_slot *slots;

    int nthreads;         /* workers started */
    pthread_t *threads;
    bool sync_init;
    pthread_mutex_t mu;
    pthread_cond_t cv_work; /* workers wait for work */
    pthread_cond_t cv_done; /* consumer / pause wait for fills */
    bool stop, paused, started;
    uint64_t gen;
    int64_t next_claim;   /* next stream number a worker takes */
    int64_t released;     /* stream batches the consumer has given back */
    int nbusy;            /* fills in flight */

    /* A load restored a position past the epoch's first batch and nothing has
     * been yielded or repositioned since (see set_epoch and skip). */
    bool restored;
    ckpt_log_fn log_fn;   /* NULL: stderr */
    void *log_user;
};

/* ------------------------------------------------------------------------ */
/* Order                                                                     */
/* ------------------------------------------------------------------------ */

static uint64_t feistel(uint64_t x, int k, uint64_t mask, const uint32_t key[2], int64_t epoch) {
    uint64_t l = x >> k, r = x & mask;
    for (uint32_t round = 0; round < FEISTEL_ROUNDS; round++) {
        uint32_t ctr[4] = {(uint32_t)r, round | ((uint32_t)k << 8), (uint32_t)(uint64_t)epoch,
                           (uint32_t)((uint64_t)epoch >> 32)};
        uint32_t out[4];
        ckpt_philox4x32_10(ctr, key, out);
        uint64_t f = (((uint64_t)out[1] << 32) | out[0]) & mask;
        uint64_t nl = r, nr = l ^ f;
        l = nl;
        r = nr;
    }
    return (l << k) | r;
}

int64_t ckpt__shuffle_index(uint64_t seed, int64_t epoch, int64_t n, int64_t pos) {
    if (n <= 1) return pos;
    int bits = 64 - __builtin_clzll((unsigned long long)(n - 1)); /* 2^bits >= n */
    int k = (bits + 1) / 2;
    uint64_t mask = (k >= 64) ? ~0ULL : ((1ULL << k) - 1);
    uint32_t key[2] = {(uint32_t)seed, (uint32_t)(seed >> 32)};
    /* The domain 4^k is < 4n, so the walk takes fewer than 4 steps on
     * average; it ends because a permutation's cycle through pos returns to
     * [0, n). */
    uint64_t x = (uint64_t)pos;
    do {
        x = feistel(x, k, mask, key, epoch);
    } while (x >= (uint64_t)n);
    return (int64_t)x;
}

static int64_t order_at(const ckpt_dataloader *dl, int64_t epoch, int64_t q) {
    return dl->cfg.shuffle ? ckpt__shuffle_index(dl->cfg.seed, epoch, dl->n, q) : q;
}

static int nprocs(const ckpt_dataloader_config *cfg) {
    return cfg->num_processes > 1 ? cfg->num_processes : 1;
}

/* Batches per epoch for this process, from n, batch size and the shard. */
static int compute_nb(ckpt_dataloader *dl) {
    int64_t b = dl->cfg.batch_size, p = nprocs(&dl->cfg);
    if (b > INT64_MAX / p)
        return ckpt__err(CKPT_EINVAL, "dataloader: batch_size %lld * num_processes %lld overflows",
                         (long long)b, (long long)p);
    int64_t g = b * p;
    dl->full = dl->n / g;
    int64_t rem = dl->n % g;
    if (dl->cfg.drop_last || rem == 0)
        dl->nb = dl->full;
    else if (dl->cfg.even_batches || p == 1)
        dl->nb = dl->full + 1;
    else
        dl->nb = dl->full + (rem > (int64_t)dl->cfg.process_index * b ? 1 : 0);
    return 0;
}

/* The dataset indices of this process's batch `index` of `epoch`. */
static int64_t batch_indices(const ckpt_dataloader *dl, int64_t epoch, int64_t index,
                             int64_t *out) {
    int64_t b = dl->cfg.batch_size, g = b * nprocs(&dl->cfg);
    int64_t start = index * g + (int64_t)dl->cfg.process_index * b;
    int64_t size = b;
    if (index >= dl->full && !(dl->cfg.even_batches && nprocs(&dl->cfg) > 1))
        size = dl->n - start < b ? dl->n - start : b;
    for (int64_t k = 0; k < size; k++) {
        int64_t q = start + k;
        /* even_batches (several processes): positions past the end wrap to
         * the epoch's start */
        if (q >= dl->n) q %= dl->n;
        out[k] = order_at(dl, epoch, q);
    }
    return size;
}

/* ------------------------------------------------------------------------ */
/* Filling one batch (caller's thread or a worker)                           */
/* ------------------------------------------------------------------------ */

/* The message a failing get or collate left, or "" if it left none (a
 * message from before the batch must not be blamed on it). */
static const char *fresh_msg(const char *before) {
    const char *m = ckpt_errmsg();
    return strncmp(m, before, MSG_CAP - 1) == 0 ? "" : m;
}

static void fill(ckpt_dataloader *dl, dl_slot *s, int64_t epoch, int64_t index, bool in_worker) {
    s->epoch = epoch;
    s->index = index;
    s->status = 0;
    s->msg[0] = '\0';
    s->size = batch_indices(dl, epoch, index, s->indices);
    size_t sb = dl->ds.sample_bytes;
    char *dst = dl->cfg.collate ? s->scratch : s->data;
    /* A worker's own message can simply be cleared; the caller's thread
     * keeps its last message (valid until its next failing call). */
    char before[MSG_CAP];
    if (in_worker) ckpt_clear_error();
    snprintf(before, sizeof before, "%s", ckpt_errmsg());
    for (int64_t k = 0; k < s->size; k++) {
        int rc = dl->ds.get(dl->ds.self, s->indices[k], dst + (size_t)k * sb);
        if (rc != 0) {
            s->status = (rc < 0 && rc >= CKPT_EUNSUPPORTED) ? rc : CKPT_EIO;
            const char *why = fresh_msg(before);
            snprintf(s->msg, sizeof s->msg,
                     "dataloader: dataset get(index %lld) failed (returned %d) in batch %lld of "
                     "epoch %lld%s%s",
                     (long long)s->indices[k], rc, (long long)index, (long long)epoch,
                     why[0] ? ": " : "", why);
            return;
        }
    }
    if (dl->cfg.collate) {
        int rc = dl->cfg.collate(dl->cfg.collate_user, s->indices, s->size, s->scratch, s->data);
        if (rc != 0) {
            s->status = (rc < 0 && rc >= CKPT_EUNSUPPORTED) ? rc : CKPT_EIO;
            const char *why = fresh_msg(before);
            snprintf(s->msg, sizeof s->msg,
                     "dataloader: collate failed (returned %d) in batch %lld of epoch %lld%s%s", rc,
                     (long long)index, (long long)epoch, why[0] ? ": " : "", why);
        }
    }
}

/* Stream number t from the base position -> (epoch, index). nb > 0. */
static void stream_pos(const ckpt_dataloader *dl, int64_t t, int64_t *epoch, int64_t *index) {
    int64_t off = dl->base_pos + t;
    *epoch = dl->base_epoch + off / dl->nb;
    *index = off % dl->nb;
}

static void *worker_main(void *arg) {
    ckpt_dataloader *dl = arg;
    pthread_mutex_lock(&dl->mu);
    for (;;) {
        if (dl->stop) break;
        int64_t t = dl->next_claim;
        dl_slot *s = dl->nb > 0 ? &dl->slots[t % dl->nslots] : NULL;
        if (dl->paused || !s || t >= dl->released + dl->nslots || s->state != SLOT_FREE) {
            pthread_cond_wait(&dl->cv_work, &dl->mu);
            continue;
        }
        dl->next_claim++;
        uint64_t gen = dl->gen;
        int64_t epoch, index;
        stream_pos(dl, t, &epoch, &index);
        s->state = SLOT_FILLING;
        dl->nbusy++;
        pthread_mutex_unlock(&dl->mu);

        fill(dl, s, epoch, index, true);

        pthread_mutex_lock(&dl->mu);
        dl->nbusy--;
        if (gen == dl->gen) {
            s->state = SLOT_READY;
            s->t = t;
        } else {
            s->state = SLOT_FREE; /* the position moved: nobody wants it */
        }
        pthread_cond_broadcast(&dl->cv_done);
    }
    pthread_mutex_unlock(&dl->mu);
    return NULL;
}

/* Stops the stream: no new claims, every fill in flight finished, every slot
 * free. Returns with the lock held (workers mode) so the caller can change
 * the position or the order. */
static void pipeline_pause(ckpt_dataloader *dl) {
    dl->holding = false;
    if (dl->nthreads == 0) return;
    pthread_mutex_lock(&dl->mu);
    dl->gen++;
    dl->paused = true;
    while (dl->nbusy > 0) pthread_cond_wait(&dl->cv_done, &dl->mu);
    for (int i = 0; i < dl->nslots; i++) dl->slots[i].state = SLOT_FREE;
}

/* Restarts the stream at the consumer's position; releases the lock. */
static void pipeline_resume(ckpt_dataloader *dl) {
    dl->base_epoch = dl->epoch;
    dl->base_pos = dl->pos;
    dl->consumed = 0;
    if (dl->nthreads == 0) return;
    dl->next_claim = 0;
    dl->released = 0;
    dl->paused = !dl->started;
    pthread_cond_broadcast(&dl->cv_work);
    pthread_mutex_unlock(&dl->mu);
}

/* Gives the slot of the batch last returned back to the workers. */
static void release_held(ckpt_dataloader *dl) {
    if (!dl->holding) return;
    dl->holding = false;
    if (dl->nthreads == 0) return;
    pthread_mutex_lock(&dl->mu);
    dl->slots[(dl->consumed - 1) % dl->nslots].state = SLOT_FREE;
    dl->released++;
    pthread_cond_broadcast(&dl->cv_work);
    pthread_mutex_unlock(&dl->mu);
}

/* ------------------------------------------------------------------------ */
/* Construction                                                              */
/* ------------------------------------------------------------------------ */

ckpt_dataloader_config ckpt_dataloader_defaults(void) {
    ckpt_dataloader_config c;
    memset(&c, 0, sizeof c);
    c.batch_size = 1;
    c.even_batches = true;
    return c;
}

static int check_shard(int num_processes, int process_index) {
    int p = num_processes > 1 ? num_processes : 1;
    if (num_processes < 0)
        return ckpt__err(CKPT_EINVAL, "dataloader: num_processes: expected >= 0, got %d",
                         num_processes);
    if (process_index < 0 || process_index >= p)
        return ckpt__err(CKPT_EINVAL, "dataloader: process_index: expected 0..%d, got %d", p - 1,
                         process_index);
    return 0;
}

static void free_slots(ckpt_dataloader *dl) {
    if (!dl->slots) return;
    for (int i = 0; i < dl->nslots; i++) {
        free(dl->slots[i].data);
        free(dl->slots[i].indices);
        free(dl->slots[i].scratch);
    }
    free(dl->slots);
    dl->slots = NULL;
}

static int alloc_slots(ckpt_dataloader *dl) {
    size_t sb = dl->ds.sample_bytes;
    size_t b = (size_t)dl->cfg.batch_size;
    dl->slots = ckpt__calloc((size_t)dl->nslots, sizeof *dl->slots);
    if (!dl->slots) return ckpt__err_nomem("dataloader: batch slots");
    for (int i = 0; i < dl->nslots; i++) {
        dl_slot *s = &dl->slots[i];
        s->data = ckpt__malloc(dl->batch_bytes);
        s->indices = ckpt__malloc(b * sizeof(int64_t));
        if (dl->cfg.collate) s->scratch = ckpt__malloc(b * sb);
        if (!s->data || !s->indices || (dl->cfg.collate && !s->scratch))
            return ckpt__err_nomem("dataloader: batch buffers");
    }
    return 0;
}

static void stop_workers(ckpt_dataloader *dl) {
    if (dl->nthreads > 0) {
        pthread_mutex_lock(&dl->mu);
        dl->stop = true;
        pthread_cond_broadcast(&dl->cv_work);
        pthread_mutex_unlock(&dl->mu);
        for (int i = 0; i < dl->nthreads; i++) pthread_join(dl->threads[i], NULL);
        dl->nthreads = 0;
    }
}

void ckpt_dataloader_free(ckpt_dataloader *dl) {
    if (!dl) return;
    stop_workers(dl);
    if (dl->sync_init) {
        pthread_cond_destroy(&dl->cv_work);
        pthread_cond_destroy(&dl->cv_done);
        pthread_mutex_destroy(&dl->mu);
    }
    free(dl->threads);
    free_slots(dl);
    free(dl);
}

static int check_config(const ckpt_dataset *ds, const ckpt_dataloader_config *cfg) {
    if (!ds) return ckpt__err(CKPT_EINVAL, "dataloader: dataset is NULL");
    if (!cfg) return ckpt__err(CKPT_EINVAL, "dataloader: config is NULL");
    if (!ds->len) return ckpt__err(CKPT_EINVAL, "dataloader: dataset has no len function");
    if (!ds->get) return ckpt__err(CKPT_EINVAL, "dataloader: dataset has no get function");
    if (ds->sample_bytes == 0)
        return ckpt__err(CKPT_EINVAL, "dataloader: dataset sample_bytes: expected > 0, got 0");
    if (cfg->batch_size <= 0)
        return ckpt__err(CKPT_EINVAL, "dataloader: batch_size: expected > 0, got %lld",
                         (long long)cfg->batch_size);
    if (cfg->num_workers < 0)
        return ckpt__err(CKPT_EINVAL, "dataloader: num_workers: expected >= 0, got %d",
                         cfg->num_workers);
    if (cfg->num_workers > 1024)
        return ckpt__err(CKPT_EINVAL, "dataloader: num_workers: expected <= 1024, got %d",
                         cfg->num_workers);
    if (cfg->prefetch_factor < 0 || cfg->prefetch_factor > 64)
        return ckpt__err(CKPT_EINVAL, "dataloader: prefetch_factor: expected 0..64, got %d",
                         cfg->prefetch_factor);
    CKPT_TRY(check_shard(cfg->num_processes, cfg->process_index));
    if (cfg->collate && cfg->batch_bytes == 0)
        return ckpt__err(CKPT_EINVAL,
                         "dataloader: batch_bytes: expected > 0 with a collate function, got 0");
    /* Buffers must stay addressable: batch_size * sample_bytes < 2^62. */
    if ((uint64_t)cfg->batch_size > ((uint64_t)1 << 62) / ds->sample_bytes)
        return ckpt__err(CKPT_EINVAL,
                         "dataloader: batch_size %lld * sample_bytes %zu is too large",
                         (long long)cfg->batch_size, ds->sample_bytes);
    return 0;
}

int ckpt_dataloader_new(ckpt_dataloader **out, const ckpt_dataset *ds,
                        const ckpt_dataloader_config *cfg) {
    if (!out) return ckpt__err(CKPT_EINVAL, "dataloader: out is NULL");
    *out = NULL;
    CKPT_TRY(check_config(ds, cfg));
    /* The memory dataset reads its descriptor through self: point it at our
     * own copy so the caller's struct need not outlive the loader (nor be
     * where it was when ckpt_memory_dataset filled it). */
    ckpt_dataset copy = *ds;
    if (copy.get == ckpt__memory_get) copy.self = &copy;
    int64_t n = copy.len(copy.self);
    if (n <= 0)
        return ckpt__err(CKPT_EINVAL, "dataloader: dataset is empty: len() returned %lld",
                         (long long)n);

    ckpt_dataloader *dl = ckpt__calloc(1, sizeof *dl);
    if (!dl) return ckpt__err_nomem("dataloader");
    dl->ds = *ds;
    dl->cfg = *cfg;
    if (dl->cfg.num_processes < 1) dl->cfg.num_processes = 1;
    if (dl->cfg.prefetch_factor == 0) dl->cfg.prefetch_factor = 2;
    dl->n = n;
    if (dl->ds.get == ckpt__memory_get) dl->ds.self = &dl->ds;
    int rc = compute_nb(dl);
    if (rc < 0) goto fail;
    dl->batch_bytes = cfg->collate ? cfg->batch_bytes
                                   : (size_t)cfg->batch_size * ds->sample_bytes;
    dl->nslots = cfg->num_workers > 0 ? cfg->num_workers * dl->cfg.prefetch_factor + 1 : 1;
    if ((rc = alloc_slots(dl)) < 0) goto fail;

    if (cfg->num_workers > 0) {
        if (pthread_mutex_init(&dl->mu, NULL) != 0) {
            rc = ckpt__err(CKPT_ENOMEM, "dataloader: cannot create a mutex");
            goto fail;
        }
        if (pthread_cond_init(&dl->cv_work, NULL) != 0) {
            pthread_mutex_destroy(&dl->mu);
            rc = ckpt__err(CKPT_ENOMEM, "dataloader: cannot create a condition variable");
            goto fail;
        }
        if (pthread_cond_init(&dl->cv_done, NULL) != 0) {
            pthread_cond_destroy(&dl->cv_work);
            pthread_mutex_destroy(&dl->mu);
            rc = ckpt__err(CKPT_ENOMEM, "dataloader: cannot create a condition variable");
            goto fail;
        }
        dl->sync_init = true;
        /* Workers wait until the first next(): a resume (load, skip) right
         * after creation must not read batches it then throws away. */
        dl->paused = true;
        dl->threads = ckpt__calloc((size_t)cfg->num_workers, sizeof *dl->threads);
        if (!dl->threads) {
            rc = ckpt__err_nomem("dataloader: threads");
            goto fail;
        }
        for (int i = 0; i < cfg->num_workers; i++) {
            int e = pthread_create(&dl->threads[i], NULL, worker_main, dl);
            if (e != 0) {
                rc = ckpt__err_os(e, "dataloader: cannot start worker %d of %d", i,
                                  cfg->num_workers);
                goto fail;
            }
            dl->nthreads++;
        }
    }
    *out = dl;
    return 0;
fail:
    ckpt_dataloader_free(dl);
    return rc;
}

/* ------------------------------------------------------------------------ */
/* Iteration                                                                 */
/* ------------------------------------------------------------------------ */

static int take(ckpt_dataloader *dl, dl_slot *s, ckpt_batch *b) {
    if (s->status < 0) return ckpt__err(s->status, "%s", s->msg);
    b->data = s->data;
    b->size = s->size;
    b->indices = s->indices;
    b->epoch = s->epoch;
    b->index = s->index;
    b->end_of_epoch = s->index == dl->nb - 1;
    return 1;
}

int ckpt_dataloader_next(ckpt_dataloader *dl, ckpt_batch *b) {
    if (!dl || !b) return ckpt__err(CKPT_EINVAL, "dataloader_next: loader or batch is NULL");
    release_held(dl);
    if (dl->pos >= dl->nb) {
        if (dl->epoch == INT64_MAX)
            return ckpt__err(CKPT_EINVAL, "dataloader: epoch counter would overflow");
        /* The stream runs on into the next epoch, so workers keep their
         * prefetched batches across the boundary. */
        dl->epoch++;
        dl->pos = 0;
        dl->restored = false;
        return 0;
    }
    int rc;
    if (dl->nthreads == 0) {
        dl_slot *s = &dl->slots[0];
        fill(dl, s, dl->epoch, dl->pos, false);
        rc = take(dl, s, b);
        if (rc < 0) return rc;
    } else {
        pthread_mutex_lock(&dl->mu);
        if (!dl->started) {
            dl->started = true;
            dl->paused = false;
            pthread_cond_broadcast(&dl->cv_work);
        }
        int64_t t = dl->consumed;
        dl_slot *s = &dl->slots[t % dl->nslots];
        while (!(s->state == SLOT_READY && s->t == t)) pthread_cond_wait(&dl->cv_done, &dl->mu);
        pthread_mutex_unlock(&dl->mu);
        rc = take(dl, s, b);
        if (rc < 0) {
            /* The position stays at the failed batch: restart the stream
             * there, idle until the next call, so that a retry reads it
             * again then (the dataset may have recovered meanwhile). */
            pipeline_pause(dl);
            dl->started = false;
            pipeline_resume(dl);
            return rc;
        }
    }
    dl->consumed++;
    dl->holding = true;
    dl->pos++;
    dl->restored = false;
    return 1;
}

void ckpt_dataloader_set_log(ckpt_dataloader *dl, ckpt_log_fn fn, void *user) {
    if (!dl) return;
    dl->log_fn = fn;
    dl->log_user = user;
}

int ckpt_dataloader_set_epoch(ckpt_dataloader *dl, int64_t epoch) {
    if (!dl) return ckpt__err(CKPT_EINVAL, "dataloader_set_epoch: loader is NULL");
    if (epoch < 0)
        return ckpt__err(CKPT_EINVAL, "dataloader_set_epoch: epoch: expected >= 0, got %lld",
                         (long long)epoch);
    /* Already there (the usual loop calls it after the end-of-epoch 0), or
     * at a position a load restored in this epoch (the resumed loop calls it
     * before its first batch): keep the position and the prefetched stream. */
    if (epoch == dl->epoch && (dl->pos == 0 || dl->restored)) return 0;
    dl->restored = false;
    pipeline_pause(dl);
    dl->epoch = epoch;
    dl->pos = 0;
    pipeline_resume(dl);
    return 0;
}

int64_t ckpt_dataloader_epoch(const ckpt_dataloader *dl) { return dl ? dl->epoch : 0; }

int64_t ckpt_dataloader_num_batches(const ckpt_dataloader *dl) { return dl ? dl->nb : 0; }

int64_t ckpt__dataloader_position(const ckpt_dataloader *dl) { return dl ? dl->pos : 0; }

int ckpt_skip_first_batches(ckpt_dataloader *dl, int64_t num_batches) {
    if (!dl) return ckpt__err(CKPT_EINVAL, "skip_first_batches: loader is NULL");
    if (num_batches < 0)
        return ckpt__err(CKPT_EINVAL, "skip_first_batches: num_batches: expected >= 0, got %lld",
                         (long long)num_batches);
    if (num_batches > dl->nb - dl->pos)
        return ckpt__err(CKPT_EINVAL,
                         "skip_first_batches: cannot skip %lld batches at batch %lld of epoch "
                         "%lld: the epoch has %lld batches",
                         (long long)num_batches, (long long)dl->pos, (long long)dl->epoch,
                         (long long)dl->nb);
    if (num_batches == 0) return 0;
    if (dl->restored) {
        /* Accelerate's recipe (load, then skip_first_batches) would skip
         * twice here: the load already resumed mid-epoch. */
        ckpt__log(&(ckpt_logger){dl->log_fn, dl->log_user}, CKPT_LOG_WARNING,
                "skip_first_batches: skipping %lld batches on top of the position restored by "
                "load_state (batch %lld of epoch %lld): the load already resumed mid-epoch, so "
                "these batches will not be trained on; skip only when the loader was not loaded",
                (long long)num_batches, (long long)dl->pos, (long long)dl->epoch);
        dl->restored = false;
    }
    pipeline_pause(dl);
    dl->pos += num_batches;
    pipeline_resume(dl);
    return 0;
}

int ckpt__dataloader_set_shard(ckpt_dataloader *dl, int num_processes, int process_index) {
    if (!dl) return ckpt__err(CKPT_EINVAL, "dataloader_set_shard: loader is NULL");
    if (num_processes == 0) num_processes = 1; /* as in the configs: 0 means one */
    if (num_processes < 1)
        return ckpt__err(CKPT_EINVAL, "dataloader: num_processes: expected >= 1, got %d",
                         num_processes);
    CKPT_TRY(check_shard(num_processes, process_index));
    int64_t b = dl->cfg.batch_size;
    if (b > INT64_MAX / num_processes)
        return ckpt__err(CKPT_EINVAL, "dataloader: batch_size %lld * num_processes %d overflows",
                         (long long)b, num_processes);
    /* Preparing a loader already sharded this way keeps its position. */
    if (num_processes == dl->cfg.num_processes && process_index == dl->cfg.process_index)
        return 0;
    pipeline_pause(dl);
    dl->cfg.num_processes = num_processes;
    dl->cfg.process_index = process_index;
    compute_nb(dl); /* cannot fail: checked above */
    dl->pos = 0;
    dl->restored = false;
    pipeline_resume(dl);
    return 0;
}

/* ------------------------------------------------------------------------ */
/* State dict                                                                */
/* ------------------------------------------------------------------------ */

static int dl_state_dict(void *self, ckpt_writer *w) {
    ckpt_dataloader *dl = self;
    if (!dl || !w) return ckpt__err(CKPT_EINVAL, "dataloader: state_dict: loader is NULL");
    CKPT_TRY(ckpt_write_i64(w, "seed", (int64_t)dl->cfg.seed));
    CKPT_TRY(ckpt_write_i64(w, "epoch", dl->epoch));
    CKPT_TRY(ckpt_write_i64(w, "batches_yielded", dl->pos));
    CKPT_TRY(ckpt_write_i64(w, "dataset_length", dl->n));
    CKPT_TRY(ckpt_write_i64(w, "batch_size", dl->cfg.batch_size));
    CKPT_TRY(ckpt_write_i64(w, "shuffle", dl->cfg.shuffle ? 1 : 0));
    CKPT_TRY(ckpt_write_i64(w, "drop_last", dl->cfg.drop_last ? 1 : 0));
    CKPT_TRY(ckpt_write_i64(w, "even_batches", dl->cfg.even_batches ? 1 : 0));
    CKPT_TRY(ckpt_write_i64(w, "num_processes", dl->cfg.num_processes));
    CKPT_TRY(ckpt_write_i64(w, "process_index", dl->cfg.process_index));
    return 0;
}

static int read_key(ckpt_reader *r, const char *key, int64_t *v) {
    int rc = ckpt_read_i64(r, key, v);
    if (rc < 0) return ckpt__err_prefix(rc, "dataloader");
    return 0;
}

static int must_match(const char *key, int64_t saved, int64_t mine) {
    if (saved != mine)
        return ckpt__err(CKPT_EMISMATCH, "dataloader: %s: saved %lld, this loader has %lld", key,
                         (long long)saved, (long long)mine);
    return 0;
}

typedef struct dl_state {
    int64_t seed, epoch, pos;
} dl_state;

/* A global batch saved as bs x np must be the global batch now (b x p),
 * else CKPT_EMISMATCH saying what would make it so. */
static int check_global_batch(int64_t bs, int64_t np, int64_t b, int64_t p) {
    if (bs * np == b * p) return CKPT_OK;
    int64_t g = bs * np;
    char hint[160];
    if (g % p == 0)
        snprintf(hint, sizeof hint, "use batch_size %lld on %lld process%s", (long long)(g / p),
                 (long long)p, p == 1 ? "" : "es");
    else if (g % b == 0)
        snprintf(hint, sizeof hint, "run %lld processes with batch_size %lld", (long long)(g / b),
                 (long long)b);
    else
        snprintf(hint, sizeof hint, "no batch_size on %lld processes gives %lld", (long long)p,
                 (long long)g);
    return ckpt__err(CKPT_EMISMATCH,
                     "dataloader: saved with %lld process%s x batch %lld = global batch %lld; now "
                     "%lld x %lld = %lld: %s (the position counts global batches)",
                     (long long)np, np == 1 ? "" : "es", (long long)bs, (long long)g, (long long)p,
                     (long long)b, (long long)(b * p), hint);
}

/* Reads and checks a saved state against dl; changes nothing. */
static int read_state(const ckpt_dataloader *dl, ckpt_reader *r, dl_state *st) {
    int64_t seed, epoch, pos, n, bs, shuffle, drop_last, even, np, pi;
    CKPT_TRY(read_key(r, "seed", &seed));
    CKPT_TRY(read_key(r, "epoch", &epoch));
    CKPT_TRY(read_key(r, "batches_yielded", &pos));
    CKPT_TRY(read_key(r, "dataset_length", &n));
    CKPT_TRY(read_key(r, "batch_size", &bs));
    CKPT_TRY(read_key(r, "shuffle", &shuffle));
    CKPT_TRY(read_key(r, "drop_last", &drop_last));
    CKPT_TRY(read_key(r, "even_batches", &even));
    CKPT_TRY(read_key(r, "num_processes", &np));
    CKPT_TRY(read_key(r, "process_index", &pi));
    /* Everything the order depends on must be the same, or the saved
     * position would name other samples. The position counts global batches
     * (batch_size x num_processes samples each, the same for every process),
     * so the process index may differ, and so may the process count as long
     * as the global batch stays the same: the loader then continues at the
     * same global sample. */
    CKPT_TRY(must_match("dataset_length", n, dl->n));
    CKPT_TRY(must_match("shuffle", shuffle, dl->cfg.shuffle ? 1 : 0));
    CKPT_TRY(must_match("drop_last", drop_last, dl->cfg.drop_last ? 1 : 0));
    CKPT_TRY(must_match("even_batches", even, dl->cfg.even_batches ? 1 : 0));
    int64_t snp = np > 1 ? np : 1;
    if (np < 0 || np > INT_MAX || bs < 1 || bs > INT64_MAX / snp)
        return ckpt__err(CKPT_ECORRUPT,
                         "dataloader: batch_size %lld x num_processes %lld is not a valid shard",
                         (long long)bs, (long long)np);
    CKPT_TRY(check_global_batch(bs, snp, dl->cfg.batch_size, nprocs(&dl->cfg)));
    if (pi < 0 || pi >= snp)
        return ckpt__err(CKPT_ECORRUPT, "dataloader: process_index: expected 0..%lld, got %lld",
                         (long long)np - 1, (long long)pi);
    if (epoch < 0)
        return ckpt__err(CKPT_ECORRUPT, "dataloader: epoch: expected >= 0, got %lld",
                         (long long)epoch);
    if (pos < 0 || pos > dl->nb)
        return ckpt__err(CKPT_ECORRUPT, "dataloader: batches_yielded: expected 0..%lld, got %lld",
                         (long long)dl->nb, (long long)pos);
    st->seed = seed;
    st->epoch = epoch;
    st->pos = pos;
    return 0;
}

int ckpt__dataloader_check_state(const ckpt_dataloader *dl, ckpt_reader *r) {
    if (!dl || !r) return ckpt__err(CKPT_EINVAL, "dataloader: check_state: NULL argument");
    dl_state st;
    return read_state(dl, r, &st);
}

static int dl_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_dataloader *dl = self;
    if (!dl || !r) return ckpt__err(CKPT_EINVAL, "dataloader: load_state_dict: NULL argument");
    dl_state st;
    /* The check (read_state, what check_state_dict runs), then the commit. */
    CKPT_TRY(read_state(dl, r, &st));
    pipeline_pause(dl);
    dl->cfg.seed = (uint64_t)st.seed;
    dl->epoch = st.epoch;
    dl->pos = st.pos;
    dl->restored = st.pos > 0;
    pipeline_resume(dl);
    return 0;
}

static int dl_check_state_dict(void *self, ckpt_reader *r) {
    return ckpt__dataloader_check_state(self, r);
}

static const ckpt_stateful_ops dl_ops = {dl_state_dict, dl_load_state_dict, dl_check_state_dict};

const ckpt_stateful_ops *ckpt_dataloader_ops(void) { return &dl_ops; }

/* ------------------------------------------------------------------------ */
/* In-memory dataset                                                         */
/* ------------------------------------------------------------------------ */

/* self is a ckpt_dataset filled by ckpt_memory_dataset (the loader points it
 * at its own copy). */
static int64_t memory_len(void *self) {
    const ckpt_dataset *ds = self;
    return ds ? ds->mem_len : -1;
}

int ckpt__memory_get(void *self, int64_t index, void *sample_out) {
    const ckpt_dataset *ds = self;
    if (!ds || !sample_out) return ckpt__err(CKPT_EINVAL, "memory dataset: NULL argument");
    if (index < 0 || index >= ds->mem_len)
        return ckpt__err(CKPT_EINVAL, "memory dataset: index %lld outside 0..%lld",
                         (long long)index, (long long)ds->mem_len - 1);
    memcpy(sample_out, (const char *)ds->mem_data + (size_t)index * ds->sample_bytes,
           ds->sample_bytes);
    return 0;
}

int ckpt_memory_dataset(ckpt_dataset *out, const void *data, int64_t n, size_t sample_bytes) {
    if (!out) return ckpt__err(CKPT_EINVAL, "memory_dataset: out is NULL");
    memset(out, 0, sizeof *out);
    if (!data) return ckpt__err(CKPT_EINVAL, "memory_dataset: data is NULL");
    if (n <= 0)
        return ckpt__err(CKPT_EINVAL, "memory_dataset: n: expected > 0, got %lld", (long long)n);
    if (sample_bytes == 0)
        return ckpt__err(CKPT_EINVAL, "memory_dataset: sample_bytes: expected > 0, got 0");
    if ((uint64_t)n > ((uint64_t)1 << 62) / sample_bytes)
        return ckpt__err(CKPT_EINVAL, "memory_dataset: %lld samples of %zu bytes is too large",
                         (long long)n, sample_bytes);
    out->len = memory_len;
    out->get = ckpt__memory_get;
    out->sample_bytes = sample_bytes;
    out->self = out;
    out->mem_data = data;
    out->mem_len = n;
    return 0;
}
