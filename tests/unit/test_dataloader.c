/* test_dataloader.c — order, batching, shards, workers, skipping and exact
 * resume of ckpt_dataloader. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "ckpt.h"
#include "train/dataloader.h"
#include "base/error.h"
#include "helpers/testutil.h"

/* ---- a counting dataset: sample i is the int64 i ------------------------ */

typedef struct counting {
    int64_t n;
    atomic_llong gets;
    atomic_llong fail_index; /* get of this index fails; -1: never */
    int fail_code;
    unsigned spin;       /* busy work per get, to let workers overlap */
} counting;

static int64_t counting_len(void *self) { return ((counting *)self)->n; }

static int counting_get(void *self, int64_t index, void *out) {
    counting *c = self;
    atomic_fetch_add(&c->gets, 1);
    if (index == atomic_load(&c->fail_index))
        return ckpt__err(c->fail_code, "record %lld is unreadable", (long long)index);
    volatile unsigned x = 0;
    for (unsigned i = 0; i < c->spin; i++) x += i;
    (void)x;
    memcpy(out, &index, sizeof index);
    return 0;
}

static void counting_init(counting *c, int64_t n) {
    memset(c, 0, sizeof *c);
    c->n = n;
    atomic_store(&c->gets, 0);
    atomic_store(&c->fail_index, -1);
    c->fail_code = CKPT_EIO;
}

static ckpt_dataset counting_ds(counting *c) {
    ckpt_dataset ds;
    memset(&ds, 0, sizeof ds);
    ds.len = counting_len;
    ds.get = counting_get;
    ds.sample_bytes = sizeof(int64_t);
    ds.self = c;
    return ds;
}

static ckpt_dataloader *make_loader(counting *c, int64_t batch, bool shuffle, uint64_t seed,
                                    int workers) {
    ckpt_dataset ds = counting_ds(c);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = batch;
    cfg.shuffle = shuffle;
    cfg.seed = seed;
    cfg.num_workers = workers;
    ckpt_dataloader *dl = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_OK);
    assert_non_null(dl);
    return dl;
}

/* ---- recording runs ------------------------------------------------------ */

/* One yielded batch: epoch, index, size and its indices, flattened. */
typedef struct trace {
    int64_t *v;
    size_t len, cap;
} trace;

static void trace_push(trace *t, int64_t x) {
    if (t->len == t->cap) {
        t->cap = t->cap ? t->cap * 2 : 256;
        t->v = realloc(t->v, t->cap * sizeof *t->v);
        assert_non_null(t->v);
    }
    t->v[t->len++] = x;
}

/* Records every batch until the end of epoch last_epoch (inclusive), or
 * until max_batches batches were taken (-1: no limit). Checks that each
 * batch's bytes are its indices (counting dataset). */
static void run(ckpt_dataloader *dl, int64_t last_epoch, int64_t max_batches, trace *t) {
    int64_t taken = 0;
    while (max_batches < 0 || taken < max_batches) {
        if (ckpt_dataloader_epoch(dl) > last_epoch) break;
        ckpt_batch b;
        int rc = ckpt_dataloader_next(dl, &b);
        assert_true(rc >= 0);
        if (rc == 0) {
            trace_push(t, -1); /* the end-of-epoch signal */
            continue;
        }
        taken++;
        trace_push(t, b.epoch);
        trace_push(t, b.index);
        trace_push(t, b.end_of_epoch ? 1 : 0);
        trace_push(t, b.size);
        for (int64_t k = 0; k < b.size; k++) {
            int64_t got;
            memcpy(&got, (const char *)b.data + k * 8, 8);
            assert_int_equal(got, b.indices[k]);
            trace_push(t, b.indices[k]);
        }
    }
}

static void assert_traces_equal(const trace *a, const trace *b) {
    assert_int_equal(a->len, b->len);
    for (size_t i = 0; i < a->len; i++) {
        if (a->v[i] != b->v[i]) fail_msg("traces differ at %zu: %lld vs %lld", i,
                                          (long long)a->v[i], (long long)b->v[i]);
    }
}

static void expect_batch(ckpt_dataloader *dl, int64_t epoch, int64_t index, int64_t first,
                         int64_t size, bool end) {
    ckpt_batch b;
    assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
    assert_int_equal(b.epoch, epoch);
    assert_int_equal(b.index, index);
    assert_int_equal(b.size, size);
    assert_int_equal(b.end_of_epoch, end);
    for (int64_t k = 0; k < size; k++) {
        assert_int_equal(b.indices[k], first + k);
        int64_t got;
        memcpy(&got, (const char *)b.data + k * 8, 8);
        assert_int_equal(got, first + k);
    }
}

static void expect_end(ckpt_dataloader *dl) {
    ckpt_batch b;
    assert_int_equal(ckpt_dataloader_next(dl, &b), 0);
}

/* Saves dl's state dict to a file and opens a reader on it. */
static ckpt_reader *save_and_open(ckpt_dataloader *dl) {
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "dl.safetensors");
    tu_save_state(ckpt_dataloader_ops(), dl, path);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    return r;
}

/* ======================================================================== */
/* Accelerate's data-loader tests, ported                                    */
/* ======================================================================== */

static void test_skip_first_two_batches_of_range16_yields_last_two(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    assert_int_equal(ckpt_skip_first_batches(dl, 2), CKPT_OK);
    assert_int_equal(atomic_load(&c.gets), 0);
    expect_batch(dl, 0, 2, 8, 4, false);
    expect_batch(dl, 0, 3, 12, 4, true);
    expect_end(dl);
    ckpt_dataloader_free(dl);
}

static void test_skip_keeps_epoch_and_next_epoch_starts_from_first_batch(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    assert_int_equal(ckpt_dataloader_set_epoch(dl, 3), CKPT_OK);
    assert_int_equal(ckpt_skip_first_batches(dl, 2), CKPT_OK);
    assert_int_equal(ckpt_dataloader_epoch(dl), 3);
    expect_batch(dl, 3, 2, 8, 4, false);
    expect_batch(dl, 3, 3, 12, 4, true);
    expect_end(dl);
    assert_int_equal(ckpt_dataloader_epoch(dl), 4);
    /* the skip applied to epoch 3 only */
    for (int64_t i = 0; i < 4; i++) expect_batch(dl, 4, i, 4 * i, 4, i == 3);
    expect_end(dl);
    ckpt_dataloader_free(dl);
}

static void test_end_of_epoch_flag_only_on_last_batch_on_both_passes(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 18); /* 4 full batches and one of 2 */
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    assert_int_equal(ckpt_dataloader_num_batches(dl), 5);
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t i = 0; i < 4; i++) expect_batch(dl, pass, i, 4 * i, 4, false);
        expect_batch(dl, pass, 4, 16, 2, true);
        expect_end(dl);
    }
    ckpt_dataloader_free(dl);
}

static void test_state_after_batch_1_resumes_with_remaining_batches(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    expect_batch(dl, 0, 0, 0, 4, false);
    expect_batch(dl, 0, 1, 4, 4, false);
    ckpt_reader *r = save_and_open(dl);
    ckpt_dataloader_free(dl);

    counting c2;
    counting_init(&c2, 16);
    ckpt_dataloader *dl2 = make_loader(&c2, 4, false, 0, 0);
    assert_int_equal(ckpt__dataloader_check_state(dl2, r), CKPT_OK);
    assert_int_equal(atomic_load(&c2.gets), 0);
    expect_batch(dl2, 0, 0, 0, 4, false); /* checking changed nothing */
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(dl2, r), CKPT_OK);
    ckpt_reader_free(r);
    assert_int_equal(atomic_load(&c2.gets), 4); /* loading read nothing */
    expect_batch(dl2, 0, 2, 8, 4, false);
    expect_batch(dl2, 0, 3, 12, 4, true);
    expect_end(dl2);
    expect_batch(dl2, 1, 0, 0, 4, false);
    ckpt_dataloader_free(dl2);
}

/* ======================================================================== */
/* Epochs and order                                                          */
/* ======================================================================== */

static void test_next_returns_zero_once_then_starts_next_epoch(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 8);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    expect_batch(dl, 0, 0, 0, 4, false);
    expect_batch(dl, 0, 1, 4, 4, true);
    assert_int_equal(ckpt_dataloader_epoch(dl), 0);
    expect_end(dl);
    assert_int_equal(ckpt_dataloader_epoch(dl), 1);
    expect_batch(dl, 1, 0, 0, 4, false);
    ckpt_dataloader_free(dl);
}

static void test_drop_last_drops_the_short_batch(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 18);
    ckpt_dataset ds = counting_ds(&c);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = 4;
    cfg.drop_last = true;
    ckpt_dataloader *dl = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_OK);
    assert_int_equal(ckpt_dataloader_num_batches(dl), 4);
    for (int64_t i = 0; i < 4; i++) expect_batch(dl, 0, i, 4 * i, 4, i == 3);
    expect_end(dl);
    ckpt_dataloader_free(dl);
}

static void test_shuffle_is_a_permutation_that_depends_only_on_seed_and_epoch(void **state) {
    (void)state;
    /* every small length, several epochs: a bijection of [0, n) */
    for (int64_t n = 1; n <= 70; n++) {
        for (int64_t e = 0; e < 3; e++) {
            unsigned char seen[70] = {0};
            for (int64_t q = 0; q < n; q++) {
                int64_t i = ckpt__shuffle_index(42, e, n, q);
                assert_true(i >= 0 && i < n);
                assert_int_equal(seen[i], 0);
                seen[i] = 1;
            }
        }
    }
    /* a real shuffle: epochs and seeds differ, the same (seed, epoch) agrees */
    int64_t n = 1000;
    int64_t same_e = 0, same_seed = 0, fixed = 0;
    for (int64_t q = 0; q < n; q++) {
        int64_t a = ckpt__shuffle_index(7, 0, n, q);
        if (a == ckpt__shuffle_index(7, 1, n, q)) same_e++;
        if (a == ckpt__shuffle_index(8, 0, n, q)) same_seed++;
        if (a == q) fixed++;
        assert_int_equal(a, ckpt__shuffle_index(7, 0, n, q));
    }
    assert_true(same_e < 20);
    assert_true(same_seed < 20);
    assert_true(fixed < 20);

    /* two loaders with one seed yield the same epochs, whatever came before */
    counting c1, c2;
    counting_init(&c1, 103);
    counting_init(&c2, 103);
    ckpt_dataloader *a = make_loader(&c1, 10, true, 99, 0);
    ckpt_dataloader *b = make_loader(&c2, 10, true, 99, 0);
    trace ta = {0}, tb = {0};
    run(a, 2, -1, &ta);
    assert_int_equal(ckpt_dataloader_set_epoch(b, 2), CKPT_OK);
    run(b, 2, -1, &tb);
    /* b's trace is a's epoch 2: find it in a's */
    assert_true(ta.len > tb.len);
    trace tail = {ta.v + (ta.len - tb.len), tb.len, 0};
    assert_traces_equal(&tail, &tb);
    free(ta.v);
    free(tb.v);
    ckpt_dataloader_free(a);
    ckpt_dataloader_free(b);
}

static void test_set_epoch_restarts_at_first_batch_of_that_epoch(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 12);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 2);
    expect_batch(dl, 0, 0, 0, 4, false);
    assert_int_equal(ckpt_dataloader_set_epoch(dl, 5), CKPT_OK);
    assert_int_equal(ckpt_dataloader_epoch(dl), 5);
    expect_batch(dl, 5, 0, 0, 4, false);
    expect_batch(dl, 5, 1, 4, 4, false);
    ckpt_dataloader_free(dl);
}

/* ======================================================================== */
/* Exact resume                                                              */
/* ======================================================================== */

/* The uninterrupted run to the end of epoch 3 against: run to (epoch 1,
 * batch 7), save, free, a new loader (workers_after) loads and continues. */
static void check_resume(int workers_before, int workers_after, int num_processes,
                         int process_index) {
    const int64_t n = 203, batch = 4;
    const uint64_t seed = 1234;
    counting c;
    counting_init(&c, n);
    ckpt_dataloader *full = make_loader(&c, batch, true, seed, workers_before);
    if (num_processes > 1)
        assert_int_equal(ckpt__dataloader_set_shard(full, num_processes, process_index), 0);
    trace want = {0};
    run(full, 3, -1, &want);
    ckpt_dataloader_free(full);

    counting c1;
    counting_init(&c1, n);
    ckpt_dataloader *first = make_loader(&c1, batch, true, seed, workers_before);
    if (num_processes > 1)
        assert_int_equal(ckpt__dataloader_set_shard(first, num_processes, process_index), 0);
    trace got = {0};
    int64_t per_epoch = ckpt_dataloader_num_batches(first);
    run(first, 3, per_epoch + 7, &got);
    assert_int_equal(ckpt_dataloader_epoch(first), 1);
    ckpt_reader *r = save_and_open(first);
    ckpt_dataloader_free(first);

    counting c2;
    counting_init(&c2, n);
    /* a different seed in the new config: the saved one must win */
    ckpt_dataloader *second = make_loader(&c2, batch, true, seed + 1, workers_after);
    if (num_processes > 1)
        assert_int_equal(ckpt__dataloader_set_shard(second, num_processes, process_index), 0);
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(second, r), CKPT_OK);
    ckpt_reader_free(r);
    assert_int_equal(atomic_load(&c2.gets), 0);
    run(second, 3, -1, &got);
    ckpt_dataloader_free(second);

    assert_traces_equal(&want, &got);
    free(want.v);
    free(got.v);
}

static void test_shuffled_resume_mid_epoch_matches_uninterrupted_run(void **state) {
    (void)state;
    check_resume(0, 0, 1, 0);
}

static void test_shuffled_resume_matches_with_2_workers(void **state) {
    (void)state;
    check_resume(2, 2, 1, 0);
    check_resume(0, 2, 1, 0);
}

static void test_shuffled_resume_matches_with_4_workers(void **state) {
    (void)state;
    check_resume(4, 4, 1, 0);
    check_resume(4, 0, 1, 0);
}

static void test_shuffled_resume_matches_on_each_of_4_shards(void **state) {
    (void)state;
    for (int p = 0; p < 4; p++) check_resume(p % 2 ? 2 : 0, p % 2 ? 0 : 2, 4, p);
}

static void test_workers_yield_the_same_batches_as_the_caller_thread(void **state) {
    (void)state;
    counting c0, c3;
    counting_init(&c0, 1000);
    counting_init(&c3, 1000);
    c3.spin = 2000;
    ckpt_dataloader *a = make_loader(&c0, 7, true, 5, 0);
    ckpt_dataloader *b = make_loader(&c3, 7, true, 5, 3);
    trace ta = {0}, tb = {0};
    /* moves in the middle: skip, set_epoch */
    run(a, 0, 10, &ta);
    run(b, 0, 10, &tb);
    assert_int_equal(ckpt_skip_first_batches(a, 50), 0);
    assert_int_equal(ckpt_skip_first_batches(b, 50), 0);
    run(a, 1, 30, &ta);
    run(b, 1, 30, &tb);
    assert_int_equal(ckpt_dataloader_set_epoch(a, 7), 0);
    assert_int_equal(ckpt_dataloader_set_epoch(b, 7), 0);
    run(a, 8, -1, &ta);
    run(b, 8, -1, &tb);
    assert_traces_equal(&ta, &tb);
    free(ta.v);
    free(tb.v);
    ckpt_dataloader_free(a);
    ckpt_dataloader_free(b);
}

/* ======================================================================== */
/* Shards                                                                    */
/* ======================================================================== */

static ckpt_dataloader *make_sharded(counting *c, int64_t batch, bool shuffle, bool even,
                                     bool drop_last, int np, int p) {
    ckpt_dataset ds = counting_ds(c);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = batch;
    cfg.shuffle = shuffle;
    cfg.seed = 77;
    cfg.even_batches = even;
    cfg.drop_last = drop_last;
    cfg.num_processes = np;
    cfg.process_index = p;
    ckpt_dataloader *dl = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_OK);
    return dl;
}

static void test_union_of_4_shards_is_exactly_each_global_batch(void **state) {
    (void)state;
    const int np = 4;
    const int64_t b = 5, n = 100; /* 5 global batches of 20 */
    counting c;
    counting_init(&c, n);
    ckpt_dataloader *global = make_loader(&c, b * np, true, 77, 0);
    ckpt_dataloader *shard[4];
    for (int p = 0; p < np; p++) shard[p] = make_sharded(&c, b, true, true, false, np, p);
    for (int epoch = 0; epoch < 2; epoch++) {
        for (int64_t g = 0; g < 5; g++) {
            ckpt_batch gb;
            assert_int_equal(ckpt_dataloader_next(global, &gb), 1);
            assert_int_equal(gb.size, b * np);
            for (int p = 0; p < np; p++) {
                ckpt_batch sb;
                assert_int_equal(ckpt_dataloader_next(shard[p], &sb), 1);
                assert_int_equal(sb.epoch, epoch);
                assert_int_equal(sb.index, g);
                assert_int_equal(sb.size, b);
                for (int64_t k = 0; k < b; k++)
                    assert_int_equal(sb.indices[k], gb.indices[p * b + k]);
            }
        }
        expect_end(global);
        for (int p = 0; p < np; p++) expect_end(shard[p]);
    }
    ckpt_dataloader_free(global);
    for (int p = 0; p < np; p++) ckpt_dataloader_free(shard[p]);
}

static void test_even_batches_complete_last_global_batch_from_epoch_start(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 22); /* global batch 8: 2 full, then 6 samples */
    ckpt_dataloader *p0 = make_sharded(&c, 4, false, true, false, 2, 0);
    ckpt_dataloader *p1 = make_sharded(&c, 4, false, true, false, 2, 1);
    assert_int_equal(ckpt_dataloader_num_batches(p0), 3);
    assert_int_equal(ckpt_dataloader_num_batches(p1), 3);
    expect_batch(p0, 0, 0, 0, 4, false);
    expect_batch(p1, 0, 0, 4, 4, false);
    expect_batch(p0, 0, 1, 8, 4, false);
    expect_batch(p1, 0, 1, 12, 4, false);
    expect_batch(p0, 0, 2, 16, 4, true);
    ckpt_batch b;
    assert_int_equal(ckpt_dataloader_next(p1, &b), 1);
    assert_int_equal(b.size, 4);
    assert_true(b.end_of_epoch);
    int64_t want[4] = {20, 21, 0, 1};
    for (int k = 0; k < 4; k++) assert_int_equal(b.indices[k], want[k]);
    expect_end(p0);
    expect_end(p1);
    ckpt_dataloader_free(p0);
    ckpt_dataloader_free(p1);
}

static void test_uneven_batches_split_the_tail_as_far_as_it_goes(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 18); /* global batch 8: 2 full, then 2 samples */
    ckpt_dataloader *p0 = make_sharded(&c, 4, false, false, false, 2, 0);
    ckpt_dataloader *p1 = make_sharded(&c, 4, false, false, false, 2, 1);
    assert_int_equal(ckpt_dataloader_num_batches(p0), 3);
    assert_int_equal(ckpt_dataloader_num_batches(p1), 2);
    expect_batch(p0, 0, 0, 0, 4, false);
    expect_batch(p0, 0, 1, 8, 4, false);
    expect_batch(p0, 0, 2, 16, 2, true);
    expect_end(p0);
    expect_batch(p1, 0, 0, 4, 4, false);
    expect_batch(p1, 0, 1, 12, 4, true);
    expect_end(p1);
    ckpt_dataloader_free(p0);
    ckpt_dataloader_free(p1);

    /* drop_last drops the short global batch on every process */
    ckpt_dataloader *d0 = make_sharded(&c, 4, false, true, true, 2, 0);
    ckpt_dataloader *d1 = make_sharded(&c, 4, false, false, true, 2, 1);
    assert_int_equal(ckpt_dataloader_num_batches(d0), 2);
    assert_int_equal(ckpt_dataloader_num_batches(d1), 2);
    ckpt_dataloader_free(d0);
    ckpt_dataloader_free(d1);
}

static void test_set_shard_restarts_epoch_with_this_process_slice(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 2, false, 0, 0);
    expect_batch(dl, 0, 0, 0, 2, false);
    assert_int_equal(ckpt__dataloader_set_shard(dl, 2, 1), 0);
    assert_int_equal(ckpt_dataloader_num_batches(dl), 4);
    expect_batch(dl, 0, 0, 2, 2, false);
    expect_batch(dl, 0, 1, 6, 2, false);
    assert_int_equal(ckpt__dataloader_set_shard(dl, 2, 2), CKPT_EINVAL);
    assert_int_equal(ckpt__dataloader_set_shard(dl, -1, 0), CKPT_EINVAL);
    /* the same shard again (preparing twice) keeps the position */
    assert_int_equal(ckpt__dataloader_set_shard(dl, 2, 1), 0);
    expect_batch(dl, 0, 2, 10, 2, false);
    ckpt_dataloader_free(dl);
}

/* ======================================================================== */
/* O(1) skipping                                                             */
/* ======================================================================== */

static void test_skipping_1e6_batches_of_1e8_samples_reads_no_sample(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 100000000); /* virtual: get computes the sample */
    ckpt_dataloader *dl = make_loader(&c, 100, true, 3, 0);
    assert_int_equal(ckpt_dataloader_num_batches(dl), 1000000);
    assert_int_equal(ckpt_skip_first_batches(dl, 999999), CKPT_OK);
    assert_int_equal(atomic_load(&c.gets), 0);
    ckpt_batch b;
    assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
    assert_int_equal(atomic_load(&c.gets), 100);
    assert_int_equal(b.index, 999999);
    assert_true(b.end_of_epoch);
    assert_int_equal(b.size, 100);
    for (int k = 0; k < 100; k++) {
        assert_true(b.indices[k] >= 0 && b.indices[k] < 100000000);
        assert_int_equal(b.indices[k], ckpt__shuffle_index(3, 0, 100000000, 99999900 + k));
        for (int j = 0; j < k; j++) assert_true(b.indices[j] != b.indices[k]);
    }
    assert_int_equal(ckpt_skip_first_batches(dl, 1), CKPT_EINVAL);
    expect_end(dl);
    /* epoch 1 starts from its first batch */
    assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
    assert_int_equal(b.epoch, 1);
    assert_int_equal(b.index, 0);
    assert_int_equal(b.indices[0], ckpt__shuffle_index(3, 1, 100000000, 0));
    ckpt_dataloader_free(dl);
}

static void test_skip_with_workers_reads_nothing_before_next(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 64);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 2);
    assert_int_equal(ckpt_skip_first_batches(dl, 14), 0);
    usleep(20000);
    assert_int_equal(atomic_load(&c.gets), 0);
    expect_batch(dl, 0, 14, 56, 4, false);
    expect_batch(dl, 0, 15, 60, 4, true);
    expect_end(dl);
    expect_batch(dl, 1, 0, 0, 4, false);
    ckpt_dataloader_free(dl);
}

/* ======================================================================== */
/* State dict                                                                */
/* ======================================================================== */

static void test_load_state_rejects_other_dataset_length_and_changes_nothing(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    expect_batch(dl, 0, 0, 0, 4, false);
    ckpt_reader *r = save_and_open(dl);
    ckpt_dataloader_free(dl);

    counting c2;
    counting_init(&c2, 17);
    ckpt_dataloader *other = make_loader(&c2, 4, false, 0, 0);
    assert_int_equal(ckpt__dataloader_check_state(other, r), CKPT_EMISMATCH);
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(other, r), CKPT_EMISMATCH);
    tu_assert_errmsg_has("dataset_length");
    tu_assert_errmsg_has("16");
    tu_assert_errmsg_has("17");
    expect_batch(other, 0, 0, 0, 4, false); /* unchanged */
    ckpt_dataloader_free(other);

    counting c3;
    counting_init(&c3, 16);
    ckpt_dataloader *bs = make_loader(&c3, 8, false, 0, 0);
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(bs, r), CKPT_EMISMATCH);
    tu_assert_errmsg_has("batch_size");
    expect_batch(bs, 0, 0, 0, 8, false);
    ckpt_dataloader_free(bs);

    ckpt_dataloader *sh = make_loader(&c3, 4, true, 0, 0);
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(sh, r), CKPT_EMISMATCH);
    tu_assert_errmsg_has("shuffle");
    ckpt_dataloader_free(sh);
    ckpt_reader_free(r);
}

/* A copy of the i64 state in r with key set to v, opened as a reader. */
static ckpt_reader *rewritten(ckpt_reader *r, const char *key, int64_t v) {
    char path[128];
    tu_path(path, sizeof path, tu_dir(), "dl_bad.safetensors");
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    for (int64_t i = 0; i < ckpt_reader_count(r); i++) {
        ckpt_entry_info e;
        assert_int_equal(ckpt_reader_entry(r, i, &e), CKPT_OK);
        int64_t x;
        assert_int_equal(ckpt_read_i64(r, e.key, &x), CKPT_OK);
        assert_int_equal(ckpt_write_i64(w, e.key, strcmp(e.key, key) == 0 ? v : x), CKPT_OK);
    }
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_reader *out = NULL;
    assert_int_equal(ckpt_reader_open(&out, path), CKPT_OK);
    return out;
}

/* check_state_dict (what ckpt_load_state runs before any load) refuses what
 * load_state_dict refuses, with the same code and message, and leaves the
 * loader where it was; on a good state it changes nothing either. */
static void test_check_state_dict_refuses_what_load_refuses_and_changes_nothing(void **state) {
    (void)state;
    const ckpt_stateful_ops *ops = ckpt_dataloader_ops();
    assert_non_null(ops->check_state_dict);
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    expect_batch(dl, 0, 0, 0, 4, false);
    expect_batch(dl, 0, 1, 4, 4, false);
    ckpt_reader *r = save_and_open(dl); /* epoch 0, 2 batches yielded */
    ckpt_dataloader_free(dl);

    static const struct {
        int64_t n, batch;
        bool shuffle;
        const char *key; /* NULL: r as saved; else this key rewritten to value */
        int64_t value;
        int code;
        const char *needle;
    } cases[] = {
        {17, 4, false, NULL, 0, CKPT_EMISMATCH, "dataset_length: saved 16, this loader has 17"},
        {16, 8, false, NULL, 0, CKPT_EMISMATCH,
         "saved with 1 process x batch 4 = global batch 4; now 1 x 8 = 8: use batch_size 4 on 1 "
         "process"},
        {16, 4, true, NULL, 0, CKPT_EMISMATCH, "shuffle"},
        {16, 4, false, "batches_yielded", 99, CKPT_ECORRUPT, "batches_yielded: expected 0..4, got 99"},
        {16, 4, false, "epoch", -1, CKPT_ECORRUPT, "epoch: expected >= 0, got -1"},
        {16, 4, false, "num_processes", 2, CKPT_EMISMATCH,
         "saved with 2 processes x batch 4 = global batch 8; now 1 x 4 = 4: use batch_size 8 on 1 "
         "process"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        counting ci;
        counting_init(&ci, cases[i].n);
        ckpt_dataloader *other = make_loader(&ci, cases[i].batch, cases[i].shuffle, 0, 0);
        assert_int_equal(ckpt_skip_first_batches(other, 1), CKPT_OK);
        ckpt_reader *src = cases[i].key ? rewritten(r, cases[i].key, cases[i].value) : r;
        assert_int_equal(ops->check_state_dict(other, src), cases[i].code);
        char msg[512];
        snprintf(msg, sizeof msg, "%s", ckpt_errmsg());
        if (!strstr(msg, cases[i].needle)) fail_msg("case %zu: \"%s\"", i, msg);
        assert_int_equal(ckpt_dataloader_epoch(other), 0);
        assert_int_equal(ckpt__dataloader_position(other), 1);
        assert_int_equal(ops->load_state_dict(other, src), cases[i].code);
        assert_string_equal(ckpt_errmsg(), msg);
        assert_int_equal(ckpt__dataloader_position(other), 1);
        if (!cases[i].shuffle)
            expect_batch(other, 0, 1, cases[i].batch, cases[i].batch,
                         2 * cases[i].batch >= cases[i].n);
        if (src != r) ckpt_reader_free(src);
        ckpt_dataloader_free(other);
    }

    counting c2;
    counting_init(&c2, 16);
    ckpt_dataloader *good = make_loader(&c2, 4, false, 0, 0);
    assert_int_equal(ops->check_state_dict(good, r), CKPT_OK);
    assert_int_equal(ckpt__dataloader_position(good), 0);
    expect_batch(good, 0, 0, 0, 4, false); /* the check moved nothing */
    assert_int_equal(ops->load_state_dict(good, r), CKPT_OK);
    expect_batch(good, 0, 2, 8, 4, false); /* the load did */
    ckpt_dataloader_free(good);
    ckpt_reader_free(r);
}

static void test_state_dict_names_every_field_with_schema_writer(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, true, 9, 0);
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new_schema(&w), CKPT_OK);
    assert_int_equal(ckpt_dataloader_ops()->state_dict(dl, w), CKPT_OK);
    const char *keys[] = {"seed",    "epoch",        "batches_yielded", "dataset_length",
                          "batch_size", "shuffle",   "drop_last",       "even_batches",
                          "num_processes", "process_index"};
    assert_int_equal(ckpt_writer_entry_count(w), 10);
    for (int i = 0; i < 10; i++) {
        ckpt_entry_info info;
        assert_int_equal(ckpt_writer_entry(w, i, &info), CKPT_OK);
        assert_string_equal(info.key, keys[i]);
        assert_int_equal(info.kind, CKPT_ENTRY_I64);
    }
    ckpt_writer_free(w);
    ckpt_dataloader_free(dl);
}

static void test_state_saved_after_last_batch_resumes_with_end_signal(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 8);
    ckpt_dataloader *dl = make_loader(&c, 4, true, 11, 0);
    ckpt_batch b;
    assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
    assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
    ckpt_reader *r = save_and_open(dl);
    ckpt_dataloader *dl2 = make_loader(&c, 4, true, 11, 2);
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(dl2, r), CKPT_OK);
    ckpt_reader_free(r);
    expect_end(dl2);
    assert_int_equal(ckpt_dataloader_next(dl2, &b), 1);
    assert_int_equal(b.epoch, 1);
    assert_int_equal(b.index, 0);
    ckpt_dataloader_free(dl);
    ckpt_dataloader_free(dl2);
}

/* Collects a loader's warnings. */
typedef struct warnings {
    int n;
    char last[1024];
} warnings;

static void collect_warning(void *user, ckpt_log_level level, const char *msg) {
    warnings *w = user;
    assert_int_equal(level, CKPT_LOG_WARNING);
    w->n++;
    snprintf(w->last, sizeof w->last, "%s", msg);
}

/* The porting traps: after a load that restored batch 2 of epoch 0,
 * set_epoch(0) keeps that position (the resumed loop's usual first call), and
 * a skip warns that it skips on top of it. Outside that window set_epoch of
 * the current epoch restarts it, and a skip is silent. */
static void test_set_epoch_keeps_a_restored_position_and_skip_after_a_load_warns(void **state) {
    (void)state;
    for (int workers = 0; workers <= 2; workers += 2) {
        counting c;
        counting_init(&c, 16);
        ckpt_dataloader *dl = make_loader(&c, 4, false, 0, workers);
        expect_batch(dl, 0, 0, 0, 4, false);
        expect_batch(dl, 0, 1, 4, 4, false);
        ckpt_reader *r = save_and_open(dl);

        ckpt_dataloader *dl2 = make_loader(&c, 4, false, 0, workers);
        warnings w = {0};
        ckpt_dataloader_set_log(dl2, collect_warning, &w);
        assert_int_equal(ckpt_dataloader_ops()->load_state_dict(dl2, r), CKPT_OK);
        assert_int_equal(ckpt_dataloader_set_epoch(dl2, 0), CKPT_OK);
        assert_int_equal(ckpt_dataloader_set_epoch(dl2, 0), CKPT_OK);
        expect_batch(dl2, 0, 2, 8, 4, false);
        /* A batch was yielded: set_epoch(0) restarts the epoch again. */
        assert_int_equal(ckpt_dataloader_set_epoch(dl2, 0), CKPT_OK);
        expect_batch(dl2, 0, 0, 0, 4, false);
        assert_int_equal(w.n, 0);

        /* Load again, then skip: it skips (as asked) and says why it is
         * probably a mistake; a second skip is not "after a load" any more. */
        assert_int_equal(ckpt_dataloader_ops()->load_state_dict(dl2, r), CKPT_OK);
        assert_int_equal(ckpt_skip_first_batches(dl2, 1), CKPT_OK);
        assert_int_equal(w.n, 1);
        tu_assert_contains(w.last, "skipping 1 batches on top of the position restored by "
                                   "load_state (batch 2 of epoch 0)");
        expect_batch(dl2, 0, 3, 12, 4, true);
        assert_int_equal(ckpt_skip_first_batches(dl2, 0), CKPT_OK);
        assert_int_equal(w.n, 1);

        /* A skip on a loader that was never loaded is silent. */
        assert_int_equal(ckpt_dataloader_set_epoch(dl2, 1), CKPT_OK);
        assert_int_equal(ckpt_skip_first_batches(dl2, 2), CKPT_OK);
        assert_int_equal(w.n, 1);
        expect_batch(dl2, 1, 2, 8, 4, false);

        /* Restored at the end of epoch 0: set_epoch(0) does not replay it. */
        ckpt_reader_free(r);
        expect_batch(dl, 0, 2, 8, 4, false);
        expect_batch(dl, 0, 3, 12, 4, true);
        r = save_and_open(dl);
        assert_int_equal(ckpt_dataloader_ops()->load_state_dict(dl2, r), CKPT_OK);
        assert_int_equal(ckpt_dataloader_set_epoch(dl2, 0), CKPT_OK);
        expect_end(dl2);
        expect_batch(dl2, 1, 0, 0, 4, false);
        ckpt_reader_free(r);
        ckpt_dataloader_free(dl);
        ckpt_dataloader_free(dl2);
    }
}

/* ======================================================================== */
/* Collate and the memory dataset                                            */
/* ======================================================================== */

/* Lays out a batch as: count, then the sum of the samples. */
static int sum_collate(void *user, const int64_t *indices, int64_t n, const void *samples,
                       void *out) {
    atomic_int *calls = user; /* collate runs in worker threads */
    atomic_fetch_add(calls, 1);
    int64_t sum = 0;
    for (int64_t k = 0; k < n; k++) {
        int64_t v;
        memcpy(&v, (const char *)samples + k * 8, 8);
        assert_int_equal(v, indices[k]);
        sum += v;
    }
    memcpy(out, &n, 8);
    memcpy((char *)out + 8, &sum, 8);
    return 0;
}

static void test_collate_lays_out_the_batch(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 10);
    ckpt_dataset ds = counting_ds(&c);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = 4;
    atomic_int calls = 0;
    cfg.collate = sum_collate;
    cfg.collate_user = &calls;
    cfg.batch_bytes = 16;
    ckpt_dataloader *dl = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_OK);
    int64_t want[3][2] = {{4, 6}, {4, 22}, {2, 17}};
    for (int i = 0; i < 3; i++) {
        ckpt_batch b;
        assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
        int64_t got[2];
        memcpy(got, b.data, 16);
        assert_int_equal(got[0], want[i][0]);
        assert_int_equal(got[1], want[i][1]);
    }
    assert_int_equal(atomic_load(&calls), 3);
    ckpt_dataloader_free(dl);

    cfg.batch_bytes = 0;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_EINVAL);
    assert_null(dl);
}

/* The memory dataset built in a helper: the loader must not depend on the
 * caller's struct. */
static ckpt_dataset memory_ds_by_value(const float *data, int64_t n) {
    ckpt_dataset ds;
    assert_int_equal(ckpt_memory_dataset(&ds, data, n, 2 * sizeof(float)), CKPT_OK);
    return ds;
}

static void test_memory_dataset_yields_its_samples(void **state) {
    (void)state;
    float data[20];
    for (int i = 0; i < 20; i++) data[i] = (float)i * 0.5f;
    ckpt_dataset ds = memory_ds_by_value(data, 10);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = 3;
    cfg.num_workers = 1;
    ckpt_dataloader *dl = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_OK);
    assert_int_equal(ckpt_dataloader_num_batches(dl), 4);
    for (int i = 0; i < 4; i++) {
        ckpt_batch b;
        assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
        assert_int_equal(b.size, i < 3 ? 3 : 1);
        assert_memory_equal(b.data, data + 6 * i, (size_t)b.size * 2 * sizeof(float));
    }
    ckpt_dataloader_free(dl);

    ckpt_dataset direct;
    assert_int_equal(ckpt_memory_dataset(&direct, data, 10, 2 * sizeof(float)), CKPT_OK);
    float two[2];
    assert_int_equal(direct.len(direct.self), 10);
    assert_int_equal(direct.get(direct.self, 9, two), CKPT_OK);
    assert_true(two[0] == data[18] && two[1] == data[19]);
    assert_int_equal(direct.get(direct.self, 10, two), CKPT_EINVAL);
    assert_int_equal(ckpt_memory_dataset(&direct, data, 0, 8), CKPT_EINVAL);
    assert_int_equal(ckpt_memory_dataset(&direct, NULL, 4, 8), CKPT_EINVAL);
    assert_int_equal(ckpt_memory_dataset(&direct, data, 4, 0), CKPT_EINVAL);
}

/* ======================================================================== */
/* Bad input and failures                                                    */
/* ======================================================================== */

static int64_t zero_len(void *self) {
    (void)self;
    return 0;
}

static void test_bad_configs_are_rejected_with_a_message(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataset ds = counting_ds(&c);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    ckpt_dataloader *dl = (ckpt_dataloader *)&c; /* must be reset to NULL */

    cfg.batch_size = 0;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_EINVAL);
    assert_null(dl);
    tu_assert_errmsg_has("batch_size");
    cfg.batch_size = -3;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("-3");
    cfg.batch_size = 4;

    cfg.num_workers = -1;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("num_workers");
    cfg.num_workers = 0;

    cfg.num_processes = 2;
    cfg.process_index = 2;
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("process_index");
    cfg.num_processes = 0;
    cfg.process_index = 0;

    ckpt_dataset bad = ds;
    bad.get = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &bad, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("get");
    bad = ds;
    bad.len = NULL;
    assert_int_equal(ckpt_dataloader_new(&dl, &bad, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("len");
    bad = ds;
    bad.sample_bytes = 0;
    assert_int_equal(ckpt_dataloader_new(&dl, &bad, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("sample_bytes");
    bad = ds;
    bad.len = zero_len;
    assert_int_equal(ckpt_dataloader_new(&dl, &bad, &cfg), CKPT_EINVAL);
    tu_assert_errmsg_has("empty");
    assert_int_equal(ckpt_dataloader_new(&dl, NULL, &cfg), CKPT_EINVAL);
    assert_int_equal(ckpt_dataloader_new(&dl, &ds, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_dataloader_new(NULL, &ds, &cfg), CKPT_EINVAL);
    assert_int_equal(atomic_load(&c.gets), 0);

    ckpt_dataloader_free(NULL);
    assert_int_equal(ckpt_dataloader_next(NULL, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_dataloader_set_epoch(NULL, 0), CKPT_EINVAL);
    assert_int_equal(ckpt_skip_first_batches(NULL, 0), CKPT_EINVAL);
}

static void test_skip_beyond_epoch_and_negative_values_are_rejected(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 16);
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, 0);
    assert_int_equal(ckpt_skip_first_batches(dl, 5), CKPT_EINVAL);
    tu_assert_errmsg_has("4 batches");
    assert_int_equal(ckpt_skip_first_batches(dl, -1), CKPT_EINVAL);
    assert_int_equal(ckpt_dataloader_set_epoch(dl, -1), CKPT_EINVAL);
    expect_batch(dl, 0, 0, 0, 4, false); /* unchanged */
    assert_int_equal(ckpt_skip_first_batches(dl, 3), CKPT_OK);
    expect_end(dl);
    ckpt_dataloader_free(dl);
}

static void check_get_failure(int workers) {
    counting c;
    counting_init(&c, 16);
    atomic_store(&c.fail_index, 7);
    c.fail_code = CKPT_ECORRUPT;
    ckpt_dataloader *dl = make_loader(&c, 4, false, 0, workers);
    expect_batch(dl, 0, 0, 0, 4, false);
    ckpt_batch b;
    ckpt_clear_error();
    assert_int_equal(ckpt_dataloader_next(dl, &b), CKPT_ECORRUPT);
    /* the message is set in this (the caller's) thread */
    tu_assert_errmsg_has("get(index 7)");
    tu_assert_errmsg_has("batch 1 of epoch 0");
    tu_assert_errmsg_has("record 7 is unreadable"); /* get's own message */
    /* the position stays at the failed batch: a retry fails the same way */
    assert_int_equal(ckpt_dataloader_next(dl, &b), CKPT_ECORRUPT);
    tu_assert_errmsg_has("get(index 7)");
    /* once the dataset recovers, the loader goes on from there */
    atomic_store(&c.fail_index, -1);
    expect_batch(dl, 0, 1, 4, 4, false);
    expect_batch(dl, 0, 2, 8, 4, false);
    ckpt_dataloader_free(dl);
}

static void test_failing_get_reports_its_index_in_the_caller_thread(void **state) {
    (void)state;
    check_get_failure(0);
    check_get_failure(1);
    check_get_failure(3);
}

static void test_free_mid_epoch_with_workers_does_not_hang_or_leak(void **state) {
    (void)state;
    for (int w = 1; w <= 4; w++) {
        counting c;
        counting_init(&c, 500);
        c.spin = 5000;
        ckpt_dataloader *dl = make_loader(&c, 8, true, 1, w);
        ckpt_batch b;
        for (int i = 0; i < w; i++) assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
        ckpt_dataloader_free(dl);
        /* never started: free at once */
        dl = make_loader(&c, 8, true, 1, w);
        ckpt_dataloader_free(dl);
    }
}

static void test_allocation_failures_are_clean_enomem(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 40);
    ckpt_dataset ds = counting_ds(&c);
    ckpt_dataloader_config cfg = ckpt_dataloader_defaults();
    cfg.batch_size = 4;
    cfg.num_workers = 2;
    cfg.collate = sum_collate;
    atomic_int calls = 0;
    cfg.collate_user = &calls;
    cfg.batch_bytes = 16;
    int failures = 0;
    for (uint64_t k = 1; k < 100; k++) {
        ckpt_dataloader *dl = NULL;
        ckpt__alloc_fail_after(k);
        int rc = ckpt_dataloader_new(&dl, &ds, &cfg);
        ckpt__alloc_fail_after(0);
        if (rc == CKPT_OK) {
            ckpt_batch b;
            assert_int_equal(ckpt_dataloader_next(dl, &b), 1);
            ckpt_dataloader_free(dl);
            break;
        }
        assert_int_equal(rc, CKPT_ENOMEM);
        assert_null(dl);
        tu_assert_errmsg_has("out of memory");
        failures++;
    }
    assert_true(failures > 3);
}

/* Saved on 2 processes with batch 4 (global batch 8), resumed on 4 with
 * batch 2 and on 1 with batch 8: the same global batches follow, in
 * order; on 4 processes with batch 4 a clear mismatch says what to use. */
static void test_resume_on_another_process_count_with_the_same_global_batch(void **state) {
    (void)state;
    counting c;
    counting_init(&c, 61);
    /* What 2 processes take: 3 batches each, then the state of rank 0. */
    ckpt_dataloader *two[2];
    for (int r = 0; r < 2; r++) {
        two[r] = make_loader(&c, 4, true, 9, 0);
        assert_int_equal(ckpt__dataloader_set_shard(two[r], 2, r), CKPT_OK);
        trace t = {0};
        run(two[r], 0, 3, &t);
        free(t.v);
    }
    ckpt_reader *r = save_and_open(two[1]);
    /* The global batches 3.. of the epoch as 2 processes see them. */
    int64_t want[64], nwant = 0;
    for (int k = 0; k < 2; k++) {
        ckpt_batch b[2];
        for (int q = 0; q < 2; q++) assert_int_equal(ckpt_dataloader_next(two[q], &b[q]), 1);
        for (int q = 0; q < 2; q++)
            for (int64_t i = 0; i < b[q].size; i++) want[nwant++] = b[q].indices[i];
    }
    for (int q = 0; q < 2; q++) ckpt_dataloader_free(two[q]);
    const int qs[2] = {4, 1};
    const int64_t bs[2] = {2, 8};
    for (int v = 0; v < 2; v++) {
        ckpt_dataloader *dl[4];
        for (int q = 0; q < qs[v]; q++) {
            dl[q] = make_loader(&c, bs[v], true, 9, 0);
            if (qs[v] > 1) assert_int_equal(ckpt__dataloader_set_shard(dl[q], qs[v], q), CKPT_OK);
            assert_int_equal(ckpt_dataloader_ops()->load_state_dict(dl[q], r), CKPT_OK);
        }
        int64_t got[64], ngot = 0;
        for (int k = 0; k < 2; k++)
            for (int q = 0; q < qs[v]; q++) {
                ckpt_batch b;
                assert_int_equal(ckpt_dataloader_next(dl[q], &b), 1);
                assert_int_equal(b.index, 3 + k);
                for (int64_t i = 0; i < b.size; i++) got[ngot++] = b.indices[i];
            }
        assert_int_equal(ngot, nwant);
        assert_memory_equal(got, want, sizeof(int64_t) * (size_t)nwant);
        for (int q = 0; q < qs[v]; q++) ckpt_dataloader_free(dl[q]);
    }
    ckpt_dataloader *bad = make_loader(&c, 4, true, 9, 0);
    assert_int_equal(ckpt__dataloader_set_shard(bad, 4, 0), CKPT_OK);
    assert_int_equal(ckpt_dataloader_ops()->load_state_dict(bad, r), CKPT_EMISMATCH);
    tu_assert_contains(ckpt_errmsg(), "saved with 2 processes x batch 4 = global batch 8; now 4 x 4 "
                                      "= 16: use batch_size 2 on 4 processes");
    ckpt_dataloader_free(bad);
    ckpt_reader_free(r);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_on_another_process_count_with_the_same_global_batch),
        cmocka_unit_test(test_skip_first_two_batches_of_range16_yields_last_two),
        cmocka_unit_test(test_skip_keeps_epoch_and_next_epoch_starts_from_first_batch),
        cmocka_unit_test(test_end_of_epoch_flag_only_on_last_batch_on_both_passes),
        cmocka_unit_test(test_state_after_batch_1_resumes_with_remaining_batches),
        cmocka_unit_test(test_next_returns_zero_once_then_starts_next_epoch),
        cmocka_unit_test(test_drop_last_drops_the_short_batch),
        cmocka_unit_test(test_shuffle_is_a_permutation_that_depends_only_on_seed_and_epoch),
        cmocka_unit_test(test_set_epoch_restarts_at_first_batch_of_that_epoch),
        cmocka_unit_test(test_set_epoch_keeps_a_restored_position_and_skip_after_a_load_warns),
        cmocka_unit_test(test_shuffled_resume_mid_epoch_matches_uninterrupted_run),
        cmocka_unit_test(test_shuffled_resume_matches_with_2_workers),
        cmocka_unit_test(test_shuffled_resume_matches_with_4_workers),
        cmocka_unit_test(test_shuffled_resume_matches_on_each_of_4_shards),
        cmocka_unit_test(test_workers_yield_the_same_batches_as_the_caller_thread),
        cmocka_unit_test(test_union_of_4_shards_is_exactly_each_global_batch),
        cmocka_unit_test(test_even_batches_complete_last_global_batch_from_epoch_start),
        cmocka_unit_test(test_uneven_batches_split_the_tail_as_far_as_it_goes),
        cmocka_unit_test(test_set_shard_restarts_epoch_with_this_process_slice),
        cmocka_unit_test(test_skipping_1e6_batches_of_1e8_samples_reads_no_sample),
        cmocka_unit_test(test_skip_with_workers_reads_nothing_before_next),
        cmocka_unit_test(test_load_state_rejects_other_dataset_length_and_changes_nothing),
        cmocka_unit_test(test_check_state_dict_refuses_what_load_refuses_and_changes_nothing),
        cmocka_unit_test(test_state_dict_names_every_field_with_schema_writer),
        cmocka_unit_test(test_state_saved_after_last_batch_resumes_with_end_signal),
        cmocka_unit_test(test_collate_lays_out_the_batch),
        cmocka_unit_test(test_memory_dataset_yields_its_samples),
        cmocka_unit_test(test_bad_configs_are_rejected_with_a_message),
        cmocka_unit_test(test_skip_beyond_epoch_and_negative_values_are_rejected),
        cmocka_unit_test(test_failing_get_reports_its_index_in_the_caller_thread),
        cmocka_unit_test(test_free_mid_epoch_with_workers_does_not_hang_or_leak),
        cmocka_unit_test(test_allocation_failures_are_clean_enomem),
    };
    return cmocka_run_group_tests(tests, tu_tmpdir_setup, tu_tmpdir_teardown);
}
