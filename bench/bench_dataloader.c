/* bench_dataloader.c — throughput of ckpt_dataloader with 0, 1 and 2 prefetch
 * workers against a plain loop calling get, on a dataset whose get does real
 * work (a hash loop of about 20 us per sample, like decoding a record).
 *
 * Two cases, each as a ratio to the plain loop measured in the same run:
 *   load only   the loop only fetches samples;
 *   with step   the loop also does ~20 us of work per sample (a training
 *               step), which prefetch workers overlap with loading.
 * Also prints the cost of one shuffled index and of skipping a whole epoch.
 *
 * Usage: bench_dataloader [samples]   (default 4000) */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"

#define SAMPLE_BYTES 256
#define BATCH 32

static unsigned g_rounds = 1000; /* calibrated to ~20 us */

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* FNV-style mixing over the sample, g_rounds times: stands for decoding. */
static uint64_t work(uint64_t seed, unsigned rounds) {
    uint64_t h = seed ^ 0xcbf29ce484222325ULL;
    for (unsigned r = 0; r < rounds; r++) {
        h ^= r;
        h *= 0x100000001b3ULL;
        h ^= h >> 29;
    }
    return h;
}

typedef struct {
    int64_t n;
} bench_ds;

static int64_t ds_len(void *self) { return ((bench_ds *)self)->n; }

static int ds_get(void *self, int64_t index, void *out) {
    (void)self;
    uint64_t h = work((uint64_t)index, g_rounds);
    uint64_t *o = out;
    for (size_t i = 0; i < SAMPLE_BYTES / 8; i++) o[i] = h + i;
    return 0;
}

static volatile uint64_t sink;

static void calibrate(void) {
    unsigned rounds = 1000;
    for (;;) {
        double t0 = now();
        sink += work(1, rounds);
        double dt = now() - t0;
        if (dt > 2e-3) {
            g_rounds = (unsigned)((double)rounds * 20e-6 / dt);
            if (g_rounds == 0) g_rounds = 1;
            return;
        }
        rounds *= 2;
    }
}

/* Samples per second of a plain loop: get (and step) for every index. */
static double plain(int64_t n, unsigned step_rounds) {
    bench_ds d = {n};
    uint64_t buf[SAMPLE_BYTES / 8];
    double t0 = now();
    for (int64_t i = 0; i < n; i++) {
        ds_get(&d, i, buf);
        if (step_rounds) sink += work(buf[0], step_rounds);
        sink += buf[0];
    }
    return (double)n / (now() - t0);
}

/* Samples per second of one shuffled epoch through the loader. */
static double loader(int64_t n, int workers, unsigned step_rounds) {
    bench_ds d = {n};
    ckpt_dataset ds = {0};
    ds.len = ds_len;
    ds.get = ds_get;
    ds.sample_bytes = SAMPLE_BYTES;
    ds.self = &d;
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = BATCH;
    cfg.shuffle = true;
    cfg.seed = 1;
    cfg.num_workers = workers;
    ckpt_dataloader *dl = NULL;
    if (ckpt_dataloader_new(&dl, &ds, &cfg) != 0) {
        fprintf(stderr, "bench_dataloader: %s\n", ckpt_errmsg());
        exit(1);
    }
    int64_t samples = 0;
    ckpt_batch b;
    double t0 = now();
    int rc;
    while ((rc = ckpt_dataloader_next(dl, &b)) > 0) {
        const uint64_t *p = b.data;
        for (int64_t k = 0; k < b.size; k++) {
            if (step_rounds) sink += work(p[k * (SAMPLE_BYTES / 8)], step_rounds);
            sink += p[k * (SAMPLE_BYTES / 8)];
        }
        samples += b.size;
    }
    double dt = now() - t0;
    if (rc < 0 || samples != n) {
        fprintf(stderr, "bench_dataloader: %s\n", ckpt_errmsg());
        exit(1);
    }
    ckpt_dataloader_free(dl);
    return (double)n / dt;
}

int main(int argc, char **argv) {
    int64_t n = argc > 1 ? atoll(argv[1]) : 4000;
    if (n <= 0) n = 4000;
    calibrate();
    printf("dataloader: %lld samples of %d bytes, batch %d, shuffled, get ~20 us (%u rounds)\n",
           (long long)n, SAMPLE_BYTES, BATCH, g_rounds);

    for (int with_step = 0; with_step < 2; with_step++) {
        unsigned step = with_step ? g_rounds : 0;
        double base = plain(n, step);
        printf("%s:\n", with_step ? "with a ~20 us step per sample" : "load only");
        printf("  plain get loop        %10.0f samples/s   1.00x\n", base);
        for (int w = 0; w <= 2; w++) {
            double s = loader(n, w, step);
            printf("  loader, %d worker%s      %10.0f samples/s   %.2fx\n", w, w == 1 ? " " : "s",
                   s, s / base);
        }
    }

    /* The order costs O(1) per index and skipping reads nothing. */
    int64_t big = 100000000, m = 1000000;
    bench_ds d = {big};
    ckpt_dataset ds = {0};
    ds.len = ds_len;
    ds.get = ds_get;
    ds.sample_bytes = SAMPLE_BYTES;
    ds.self = &d;
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = 1;
    cfg.shuffle = true;
    g_rounds = 1; /* measure the order, not the get */
    ckpt_dataloader *dl = NULL;
    if (ckpt_dataloader_new(&dl, &ds, &cfg) != 0) return 1;
    ckpt_batch b;
    double t0 = now();
    for (int64_t q = 0; q < m; q++) {
        if (ckpt_dataloader_next(dl, &b) != 1) return 1;
    }
    double per = (now() - t0) / (double)m;
    t0 = now();
    if (ckpt_skip_first_batches(dl, big - m) != 0) return 1;
    double skip = now() - t0;
    printf("shuffled 1e8-sample dataset: %.0f ns per batch of 1 (order + trivial get), "
           "skipping %lld batches: %.1f us, no permutation in memory\n",
           per * 1e9, (long long)(big - m), skip * 1e6);
    ckpt_dataloader_free(dl);
    return 0;
}
