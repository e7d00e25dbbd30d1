/* test_shard.c — sharded tensors: writing chunks, shard files, assembling
 * any slice from the chunks that overlap it (whatever process count saved
 * them), and rejecting chunk sets that overlap, leave holes or lie outside
 * the tensor. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <cmocka.h>

#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "helpers/testutil.h"

/* A global [R, C] F32 tensor with element (i, j) = i * 100 + j. */
enum { R = 6, C = 5 };

static float val(int64_t i, int64_t j) { return (float)(i * 100 + j); }

static void fill_box(float *dst, int64_t r0, int64_t c0, int64_t nr, int64_t nc) {
    for (int64_t i = 0; i < nr; i++)
        for (int64_t j = 0; j < nc; j++) dst[i * nc + j] = val(r0 + i, c0 + j);
}

/* One shard file in memory: its bytes and chunk records. */
typedef struct shard_file {
    char *bytes;
    size_t len;
    ckpt_file_digest d;
    char name[64];
} shard_file;

static void shard_file_free(shard_file *s) {
    free(s->bytes);
    ckpt__file_digest_free(&s->d);
}

/* Writes the chunks (row0, col0, nrows, ncols)[n] of "t" as rank `rank` of
 * `size` into a shard file and reads its bytes back. */
static void write_shard(shard_file *s, int rank, int size, const int64_t (*boxes)[4], int n) {
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    float *bufs[8];
    char key[16];
    for (int k = 0; k < n; k++) {
        const int64_t *b = boxes[k];
        bufs[k] = malloc(sizeof(float) * (size_t)(b[2] * b[3] + 1));
        fill_box(bufs[k], b[0], b[1], b[2], b[3]);
        int64_t g[2] = {R, C}, o[2] = {b[0], b[1]}, l[2] = {b[2], b[3]};
        snprintf(key, sizeof key, k == 0 ? "t" : "t%d", k);
        assert_int_equal(ckpt_write_tensor_shard(w, key, CKPT_F32, 2, g, o, l, bufs[k]), CKPT_OK);
    }
    assert_int_equal(ckpt_write_i64(w, "step", 7), CKPT_OK);
    assert_true(ckpt__writer_has_shards(w));
    assert_int_equal(ckpt__shard_file_name(s->name, sizeof s->name, "obj", rank, size), CKPT_OK);
    char *path = tu_pathf("%s/%s", tu_dir(), s->name);
    assert_int_equal(ckpt__writer_write_shards_new(w, path, &s->d), CKPT_OK);
    s->bytes = tu_read_file(path, &s->len);
    free(path);
    for (int k = 0; k < n; k++) free(bufs[k]);
    ckpt_writer_free(w);
}

static void attach(ckpt_reader *r, shard_file *s) {
    const char *keys[8];
    for (int64_t i = 0; i < s->d.ntensors; i++) keys[i] = s->d.tensor_keys[i];
    assert_int_equal(ckpt__reader_attach_shard(r, s->bytes, s->len, s->name, keys,
                                               s->d.tensor_chunk, s->d.ntensors, NULL),
                     CKPT_OK);
}

/* "t" saved by three ranks as rows [0,2) [2,3) [3,6), one file each. */
static void write_rows3(shard_file s[3]) {
    const int64_t a[][4] = {{0, 0, 2, C}}, b[][4] = {{2, 0, 1, C}}, c[][4] = {{3, 0, 3, C}};
    memset(s, 0, 3 * sizeof *s);
    write_shard(&s[0], 0, 3, a, 1);
    write_shard(&s[1], 1, 3, b, 1);
    write_shard(&s[2], 2, 3, c, 1);
}

/* Rows split over three ranks: [0,2) [2,3) [3,6). */
static void test_rows_round_trip_any_slice(void **state) {
    (void)state;
    shard_file s[3];
    write_rows3(s);
    assert_string_equal(s[1].name, "obj-00002-of-00003.safetensors");
    /* The shard file holds only the chunk, under its key, with its local shape. */
    assert_int_equal(s[2].d.ntensors, 1);
    assert_string_equal(s[2].d.tensor_keys[0], "t");
    assert_int_equal(s[2].d.tensor_chunk[0].offsets[0], 3);
    assert_int_equal(s[2].d.tensor_chunk[0].shape[0], 3);
    assert_int_equal(s[2].d.tensor_chunk[0].global_shape[0], R);
    ckpt_reader *plain = NULL;
    assert_int_equal(ckpt_reader_open_memory(&plain, s[2].bytes, s[2].len, "x"), CKPT_OK);
    ckpt_entry_info info;
    assert_int_equal(ckpt_reader_find(plain, "t", &info), CKPT_OK);
    assert_int_equal(info.shape[0], 3);
    assert_int_equal(ckpt_reader_find(plain, "step", NULL), CKPT_ENOENT);
    ckpt_reader_free(plain);

    ckpt_reader *r = NULL;
    assert_int_equal(ckpt__reader_new_empty(&r, "obj"), CKPT_OK);
    for (int i = 0; i < 3; i++) attach(r, &s[i]);
    /* Listed as one tensor with its global shape. */
    assert_int_equal(ckpt_reader_count(r), 1);
    assert_int_equal(ckpt_reader_find(r, "t", &info), CKPT_OK);
    assert_int_equal(info.kind, CKPT_ENTRY_TENSOR);
    assert_int_equal(info.ndim, 2);
    assert_int_equal(info.shape[0], R);
    assert_int_equal(info.shape[1], C);
    assert_int_equal(info.nbytes, R * C * 4);
    /* The whole tensor. */
    float whole[R * C], want[R * C];
    fill_box(want, 0, 0, R, C);
    int64_t g[2] = {R, C};
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_F32, 2, g, whole), CKPT_OK);
    assert_memory_equal(whole, want, sizeof want);
    /* Every sub-box, across chunk boundaries. */
    for (int64_t r0 = 0; r0 < R; r0++)
        for (int64_t r1 = r0 + 1; r1 <= R; r1++)
            for (int64_t c0 = 0; c0 < C; c0++)
                for (int64_t c1 = c0 + 1; c1 <= C; c1++) {
                    float got[R * C], exp[R * C];
                    int64_t o[2] = {r0, c0}, l[2] = {r1 - r0, c1 - c0};
                    memset(got, 0xff, sizeof got);
                    fill_box(exp, r0, c0, l[0], l[1]);
                    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g, o, l, got),
                                     CKPT_OK);
                    assert_memory_equal(got, exp, sizeof(float) * (size_t)(l[0] * l[1]));
                }
    /* Wrong global shape or dtype: a mismatch; out of bounds: invalid. */
    int64_t g2[2] = {R, C + 1}, o[2] = {0, 0}, l[2] = {1, 1}, far[2] = {R, 0};
    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g2, o, l, whole), CKPT_EMISMATCH);
    assert_non_null(strstr(ckpt_errmsg(), "global shape [6,5] in file"));
    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F64, 2, g, o, l, whole), CKPT_EMISMATCH);
    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g, far, l, whole), CKPT_EINVAL);
    /* A view of a tensor in several chunks is assembled whole. */
    const void *p = NULL;
    assert_int_equal(ckpt_reader_tensor_view(r, "t", &p, NULL), CKPT_OK);
    assert_memory_equal(p, want, sizeof want);
    ckpt_reader_free(r);
    for (int i = 0; i < 3; i++) shard_file_free(&s[i]);
}

/* ckpt__box_copy_range: any run of a box's elements, cut anywhere, lands
 * where ckpt__box_copy of the whole box puts it. */
static void test_box_copy_range_any_cut(void **state) {
    (void)state;
    enum { A = 3, B = 4, D = 5, N = A * B * D };
    int64_t soff[3] = {1, 2, 0}, sshape[3] = {A, B, D}; /* a chunk inside [5, 7, 5] */
    int32_t src[N];
    for (int i = 0; i < N; i++) src[i] = i + 1;
    int64_t doff[3][3] = {{0, 0, 0}, {2, 3, 1}, {1, 2, 0}};
    int64_t dshape[3][3] = {{5, 7, 5}, {2, 2, 3}, {A, B, D}};
    for (int t = 0; t < 3; t++) {
        size_t n = (size_t)(dshape[t][0] * dshape[t][1] * dshape[t][2]);
        int32_t *want = calloc(n, sizeof *want), *got = malloc(n * sizeof *got);
        assert_int_equal(ckpt__box_copy(CKPT_I32, 3, soff, sshape, src, doff[t], dshape[t], want),
                         CKPT_OK);
        for (uint64_t piece = 1; piece <= N; piece++) {
            memset(got, 0, n * sizeof *got);
            for (uint64_t first = 0; first < N; first += piece) {
                uint64_t count = N - first < piece ? N - first : piece;
                assert_int_equal(ckpt__box_copy_range(CKPT_I32, 3, soff, sshape, first, count,
                                                      src + first, doff[t], dshape[t], got),
                                 CKPT_OK);
            }
            assert_memory_equal(got, want, n * sizeof *got);
        }
        free(want);
        free(got);
    }
    /* A scalar, and a sub-byte dtype (refused: pieces are whole elements). */
    int32_t one = 42, out = 0;
    assert_int_equal(ckpt__box_copy_range(CKPT_I32, 0, NULL, NULL, 0, 1, &one, NULL, NULL, &out),
                     CKPT_OK);
    assert_int_equal(out, 42);
    assert_int_equal(ckpt__box_copy_range(CKPT_F4, 1, soff, sshape, 0, 2, src, soff, sshape, &out),
                     CKPT_EUNSUPPORTED);
}

/* A fetch that serves chunks from shard files held aside, in pieces of 7
 * elements, and records the ids asked for. */
typedef struct fake_fetch {
    shard_file *files;
    int64_t asked[64];
    int n;
    int fail_at; /* the call that fails (-1: none) */
} fake_fetch;

static int fake_fetch_fn(void *ctx, int64_t id, const void *local, uint64_t nbytes, size_t group,
                         ckpt__piece_fn put, void *put_ctx) {
    fake_fetch *f = ctx;
    if (f->n == f->fail_at) {
        f->n++;
        return ckpt__err(CKPT_EIO, "fake fetch failed");
    }
    f->asked[f->n++] = id;
    assert_null(local); /* attached without bytes */
    /* id = file * 10 + tensor index in the file */
    const shard_file *s = &f->files[id / 10];
    ckpt_reader *plain = NULL;
    assert_int_equal(ckpt_reader_open_memory(&plain, s->bytes, s->len, "x"), CKPT_OK);
    const void *data = NULL;
    ckpt_entry_info info;
    assert_int_equal(ckpt_reader_tensor_view(plain, s->d.tensor_keys[id % 10], &data, &info),
                     CKPT_OK);
    assert_int_equal(info.nbytes, nbytes);
    uint64_t step = 7 * group;
    int rc = 0;
    for (uint64_t off = 0; off < nbytes && !rc; off += step)
        rc = put(put_ctx, (const uint8_t *)data + off, off,
                 nbytes - off < step ? nbytes - off : step);
    ckpt_reader_free(plain);
    return rc;
}

/* Streamed chunks: attached without bytes, read through the fetch, every
 * one of a key's at every read of the key, in the key's chunk order. */
static void test_streamed_chunks_fetch(void **state) {
    (void)state;
    shard_file s[3];
    write_rows3(s);
    fake_fetch f = {.files = s, .fail_at = -1};
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt__reader_new_empty(&r, "obj"), CKPT_OK);
    ckpt__reader_set_fetch(r, fake_fetch_fn, &f);
    /* file 0 held here; files 1 and 2 streamed (ids 10 and 20) */
    attach(r, &s[0]);
    for (int i = 1; i < 3; i++) {
        const char *keys[1] = {s[i].d.tensor_keys[0]};
        int64_t id = i * 10;
        assert_int_equal(
            ckpt__reader_attach_shard(r, NULL, 0, s[i].name, keys, s[i].d.tensor_chunk, 1, &id),
            CKPT_OK);
    }
    float whole[R * C], want[R * C];
    fill_box(want, 0, 0, R, C);
    int64_t g[2] = {R, C};
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_F32, 2, g, whole), CKPT_OK);
    assert_memory_equal(whole, want, sizeof want);
    assert_int_equal(f.n, 2);
    assert_int_equal(f.asked[0], 10);
    assert_int_equal(f.asked[1], 20);
    /* A slice inside file 0's rows still fetches both (the same sequence on
     * every rank), and takes only its part. */
    float got[2 * 2], exp[2 * 2];
    int64_t o[2] = {0, 1}, l[2] = {2, 2};
    fill_box(exp, 0, 1, 2, 2);
    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g, o, l, got), CKPT_OK);
    assert_memory_equal(got, exp, sizeof exp);
    assert_int_equal(f.n, 4);
    /* A slice across files 1 and 2. */
    int64_t o2[2] = {2, 0}, l2[2] = {3, C};
    float got2[3 * C], exp2[3 * C];
    fill_box(exp2, 2, 0, 3, C);
    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g, o2, l2, got2), CKPT_OK);
    assert_memory_equal(got2, exp2, sizeof exp2);
    /* A view assembles the streamed chunks into the reader's memory. */
    const void *p = NULL;
    assert_int_equal(ckpt_reader_tensor_view(r, "t", &p, NULL), CKPT_OK);
    assert_memory_equal(p, want, sizeof want);
    /* A failed fetch names the file and the key. */
    f.fail_at = f.n;
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_F32, 2, g, whole), CKPT_EIO);
    assert_non_null(strstr(ckpt_errmsg(), "obj-00002-of-00003.safetensors: key 't'"));
    assert_non_null(strstr(ckpt_errmsg(), "fake fetch failed"));
    /* Without a fetch, a streamed chunk is refused clearly. */
    ckpt__reader_set_fetch(r, NULL, NULL);
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_F32, 2, g, whole), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "the reader has no fetch"));
    ckpt_reader_free(r);
    for (int i = 0; i < 3; i++) shard_file_free(&s[i]);
}

/* A 2x2 grid of blocks, saved by 4 ranks, read back as rows by 3. */
static void test_grid_saved_by_4_read_by_3(void **state) {
    (void)state;
    const int64_t q[4][1][4] = {{{0, 0, 3, 2}}, {{0, 2, 3, 3}}, {{3, 0, 3, 2}}, {{3, 2, 3, 3}}};
    shard_file s[4];
    memset(s, 0, sizeof s);
    for (int i = 0; i < 4; i++) write_shard(&s[i], i, 4, q[i], 1);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt__reader_new_empty(&r, "obj"), CKPT_OK);
    for (int i = 3; i >= 0; i--) attach(r, &s[i]);
    int64_t g[2] = {R, C};
    for (int rank = 0; rank < 3; rank++) {
        float got[2 * C], exp[2 * C];
        int64_t o[2] = {rank * 2, 0}, l[2] = {2, C};
        fill_box(exp, o[0], 0, 2, C);
        assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g, o, l, got), CKPT_OK);
        assert_memory_equal(got, exp, sizeof exp);
    }
    ckpt_reader_free(r);
    for (int i = 0; i < 4; i++) shard_file_free(&s[i]);
}

/* A plain tensor reads as one chunk; a plain file's sub-slice too. */
static void test_plain_tensor_reads_as_one_chunk(void **state) {
    (void)state;
    float all[R * C];
    fill_box(all, 0, 0, R, C);
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    int64_t g[2] = {R, C};
    assert_int_equal(ckpt_write_tensor(w, "t", CKPT_F32, 2, g, all), CKPT_OK);
    char *path = tu_pathf("%s/plain.safetensors", tu_dir());
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    float got[4], exp[4];
    int64_t o[2] = {2, 3}, l[2] = {2, 2};
    fill_box(exp, 2, 3, 2, 2);
    assert_int_equal(ckpt_read_tensor_shard(r, "t", CKPT_F32, 2, g, o, l, got), CKPT_OK);
    assert_memory_equal(got, exp, sizeof exp);
    ckpt_reader_free(r);
    free(path);
}

/* Writer validation: bounds, overflow, sub-byte chunks, NULL data. */
static void test_write_shard_validates(void **state) {
    (void)state;
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    float x[64] = {0};
    int64_t g[2] = {4, 4}, o[2] = {3, 0}, l[2] = {2, 4};
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g, o, l, x), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "outside the tensor's global shape [4,4]"));
    int64_t neg[2] = {-1, 0};
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g, neg, l, x), CKPT_EINVAL);
    int64_t big[2] = {INT64_MAX, INT64_MAX}, z[2] = {0, 0}, one[2] = {1, 1};
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, big, z, one, x), CKPT_EINVAL);
    int64_t huge_off[2] = {INT64_MAX, 0};
    int64_t g3[2] = {INT64_MAX, 0};
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g3, huge_off, one, x),
                     CKPT_EINVAL);
    /* F4: a chunk of 3 elements is not whole bytes. */
    int64_t g1[1] = {8}, o1[1] = {0}, l1[1] = {3};
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F4, 1, g1, o1, l1, x), CKPT_EINVAL);
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g, z, l, NULL), CKPT_EINVAL);
    assert_int_equal(ckpt_write_tensor_shard(w, "a", (ckpt_dtype)999, 2, g, z, l, x), CKPT_EINVAL);
    assert_int_equal(ckpt_writer_count(w), 0);
    assert_false(ckpt__writer_has_shards(w));
    /* A good chunk is listed with the global shape. */
    int64_t o2[2] = {2, 0}, l2[2] = {2, 4};
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g, o2, l2, x), CKPT_OK);
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g, z, l2, x), CKPT_EEXIST);
    ckpt_entry_info info;
    assert_int_equal(ckpt_writer_entry(w, 0, &info), CKPT_OK);
    assert_int_equal(info.shape[0], 4);
    /* A standalone save refuses a partial chunk and says why. */
    char *path = tu_pathf("%s/standalone.safetensors", tu_dir());
    assert_int_equal(ckpt_writer_save(w, path), CKPT_EINVAL);
    assert_non_null(strstr(ckpt_errmsg(), "one chunk of a sharded tensor"));
    assert_false(tu_exists(path));
    ckpt_writer_free(w);
    /* ... and writes a chunk that is the whole tensor as a plain tensor. */
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    for (int i = 0; i < 16; i++) x[i] = (float)i;
    assert_int_equal(ckpt_write_tensor_shard(w, "a", CKPT_F32, 2, g, z, g, x), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "n", 3), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    float got[16];
    assert_int_equal(ckpt_read_tensor(r, "a", CKPT_F32, 2, g, got), CKPT_OK);
    assert_memory_equal(got, x, sizeof got);
    ckpt_reader_free(r);
    free(path);
}

/* The checkpoint's object file skips sharded entries; the shard file holds
 * only them. */
static void test_object_file_skips_shards(void **state) {
    (void)state;
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    float x[8] = {1, 2, 3, 4, 5, 6, 7, 8};
    int64_t g[1] = {16}, o[1] = {8}, l[1] = {8}, pl[1] = {8};
    assert_int_equal(ckpt_write_tensor_shard(w, "s", CKPT_F32, 1, g, o, l, x), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(w, "p", CKPT_F32, 1, pl, x), CKPT_OK);
    assert_int_equal(ckpt_write_i64(w, "n", 3), CKPT_OK);
    char *path = tu_pathf("%s/obj.safetensors", tu_dir());
    ckpt_file_digest d;
    assert_int_equal(ckpt__writer_write_new(w, path, &d), CKPT_OK);
    assert_int_equal(d.ntensors, 1);
    assert_string_equal(d.tensor_keys[0], "p");
    assert_null(d.tensor_chunk);
    ckpt__file_digest_free(&d);
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    assert_int_equal(ckpt_reader_count(r), 2);
    assert_int_equal(ckpt_reader_find(r, "s", NULL), CKPT_ENOENT);
    ckpt_reader_free(r);
    free(path);
    ckpt_writer_free(w);
}

/* ---- manifests ------------------------------------------------------------ */

/* A manifest of `np` processes whose shard files obj-0000k-of-0000n hold one
 * chunk each of "t" (F32, global [g0, 4]): rows [rows[k], rows[k+1]) for
 * rank k, with per-chunk overrides through `extra` (inserted into rank
 * `bad`'s chunk record in place of its defaults when not NULL). */
static char *manifest_text(int np, const int64_t *rows, int64_t g0, int bad, const char *chunk_json) {
    size_t cap = 16384;
    char *t = malloc(cap);
    int n = snprintf(t, cap,
                     "{\"format\": \"ckpt\", \"format_version\": 1, \"library_version\": \"x\",\n"
                     " \"iteration\": 1, \"step\": 5, \"num_processes\": %d, \"files\": [\n",
                     np);
    for (int k = 0; k < np; k++) {
        char rec[512];
        if (k == bad && chunk_json)
            snprintf(rec, sizeof rec, "%s", chunk_json);
        else
            snprintf(rec, sizeof rec,
                     "{\"dtype\": \"F32\", \"global_shape\": [%" PRId64 ", 4], \"offsets\": [%" PRId64
                     ", 0], \"shape\": [%" PRId64 ", 4]}",
                     g0, rows[k], rows[k + 1] - rows[k]);
        n += snprintf(t + n, cap - (size_t)n,
                      "%s {\"name\": \"obj-%05d-of-%05d.safetensors\", \"kind\": \"optimizer\", "
                      "\"rank\": %d, \"size\": 100, \"xxh3\": \"0000000000000000\", "
                      "\"tensors\": {\"t\": \"0000000000000000\"}, \"chunks\": {\"t\": %s}}\n",
                      k ? "," : "", k + 1, np, k, rec);
    }
    snprintf(t + n, cap - (size_t)n, "], \"manifest_xxh3\": \"0000000000000000\"}\n");
    return t;
}

static int parse_text(const char *text) {
    ckpt_manifest m;
    int rc = ckpt__manifest_parse(text, strlen(text), "checkpoint.json", &m);
    ckpt__manifest_clear(&m);
    return rc;
}

/* Corrupt chunk tables: clear CKPT_ECORRUPT naming the key and the fault.
 * (A table that tiles its tensor gets as far as the manifest checksum.) */
static void test_manifest_rejects_bad_chunk_tables(void **state) {
    (void)state;
    const int64_t good[] = {0, 2, 5, 8}, hole[] = {0, 2, 5, 7};
    char *t = manifest_text(3, good, 8, -1, NULL);
    assert_int_equal(parse_text(t), CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "checksum mismatch"));
    free(t);
    struct {
        const int64_t *rows;
        int64_t g0;
        int bad;
        const char *rec;
        const char *msg;
    } cases[] = {
        {good, 8, 1, "{\"dtype\": \"F32\", \"global_shape\": [8, 4], \"offsets\": [1, 0], \"shape\": [4, 4]}",
         "tensor 't': chunks overlap: offsets [0,0] shape [2,4] (obj-00001-of-00003.safetensors) and "
         "offsets [1,0] shape [4,4] (obj-00002-of-00003.safetensors)"},
        {hole, 8, -1, NULL, "tensor 't': chunks leave a hole: they cover 28 of the 32 elements of [8,4]"},
        {good, 8, 2, "{\"dtype\": \"F32\", \"global_shape\": [8, 4], \"offsets\": [5, 0], \"shape\": [4, 4]}",
         "lie outside the tensor's global shape [8,4] (dimension 0: 5 + 4 > 8)"},
        {good, 8, 1, "{\"dtype\": \"F16\", \"global_shape\": [8, 4], \"offsets\": [2, 0], \"shape\": [3, 4]}",
         "chunks disagree on the tensor: F32 [8,4] in obj-00001-of-00003.safetensors, F16 [8,4]"},
        {good, 8, 1, "{\"dtype\": \"F32\", \"global_shape\": [9, 4], \"offsets\": [2, 0], \"shape\": [3, 4]}",
         "chunks disagree on the tensor: F32 [8,4]"},
        {good, 8, 1, "{\"dtype\": \"F32\", \"global_shape\": [8, 4], \"offsets\": [2], \"shape\": [3, 4]}",
         "\"offsets\" has 1 dimensions, expected 2"},
        {good, 8, 1, "{\"dtype\": \"F32\", \"global_shape\": [8, 4], \"offsets\": [-2, 0], \"shape\": [3, 4]}",
         "\"offsets\"[0] must be a non-negative integer"},
        {good, 8, 1, "{\"dtype\": \"Q9\", \"global_shape\": [8, 4], \"offsets\": [2, 0], \"shape\": [3, 4]}",
         "\"dtype\" is missing or unknown"},
        {good, 8, 1, "{\"dtype\": \"F32\", \"global_shape\": [9223372036854775807, 4], \"offsets\": [2, 0], \"shape\": [3, 4]}",
         "global shape [9223372036854775807,4]"},
        {good, 8, 1, "{\"dtype\": \"F32\", \"global_shape\": [8, 4], \"offsets\": [2, 0], \"shape\": [3, 4], \"x\": 1}",
         "unknown field \"x\""},
        {good, 8, 1, "[]", "tensor 't' has no chunk record"},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        t = manifest_text(3, cases[i].rows, cases[i].g0, cases[i].bad, cases[i].rec);
        int rc = parse_text(t);
        if (rc != CKPT_ECORRUPT || !strstr(ckpt_errmsg(), cases[i].msg))
            fail_msg("case %zu: rc %d, message: %s", i, rc, ckpt_errmsg());
        free(t);
    }
    /* A file with chunks must be named and numbered as a shard. */
    t = manifest_text(3, good, 8, -1, NULL);
    char *p = strstr(t, "obj-00002-of-00003");
    memcpy(p, "obj-00003-of-00003", 18);
    p = strstr(t, "obj-00003-of-00003");
    p = strstr(p + 1, "obj-00003-of-00003");
    memcpy(p, "obj-00002-of-00003", 18);
    assert_int_equal(parse_text(t), CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "shard 3 of 3, but the manifest says rank 1 of 3"));
    free(t);
}

/* Chunk records survive a manifest write and parse; a many-chunk table
 * (column split over 4000 chunks) is checked without a quadratic walk. */
static void test_manifest_chunks_round_trip(void **state) {
    (void)state;
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    m.num_processes = 2;
    for (int r = 0; r < 2; r++) {
        ckpt_file_digest d;
        memset(&d, 0, sizeof d);
        char *keys[1] = {"state.0.exp_avg"};
        uint64_t x[1] = {0x1234};
        ckpt_chunk c[1];
        memset(c, 0, sizeof c);
        c[0] = (ckpt_chunk){CKPT_BF16, 2, {3, 6}, {0, r * 3}, {3, 3}};
        d.ntensors = 1;
        d.tensor_keys = keys;
        d.tensor_xxh3 = x;
        d.tensor_chunk = c;
        char name[64];
        assert_int_equal(ckpt__shard_file_name(name, sizeof name, "optimizer", r, 2), CKPT_OK);
        assert_int_equal(ckpt__manifest_add(&m, name, "optimizer", &d), CKPT_OK);
        m.files[m.nfiles - 1].rank = r;
    }
    assert_int_equal(ckpt__manifest_write(&m, tu_dir()), CKPT_OK);
    ckpt__manifest_clear(&m);
    assert_int_equal(ckpt__manifest_read(tu_dir(), &m), CKPT_OK);
    assert_int_equal(m.nfiles, 2);
    const ckpt_manifest_file *f = ckpt__manifest_find(&m, "optimizer-00002-of-00002.safetensors");
    assert_non_null(f);
    assert_non_null(f->chunks);
    assert_int_equal(f->rank, 1);
    assert_int_equal(f->chunks[0].dtype, CKPT_BF16);
    assert_int_equal(f->chunks[0].ndim, 2);
    assert_int_equal(f->chunks[0].offsets[1], 3);
    assert_int_equal(f->chunks[0].shape[0], 3);
    assert_int_equal(f->chunks[0].global_shape[1], 6);
    ckpt__manifest_clear(&m);

    /* The layout: a file's scalar members on one line, each tensor digest and
     * each chunk record (compact) on a line of its own. */
    char *mp = tu_pathf("%s/checkpoint.json", tu_dir());
    size_t n = 0;
    char *text = tu_read_file(mp, &n);
    assert_non_null(text);
    tu_assert_contains(text,
                       "\n    {\"name\": \"optimizer-00002-of-00002.safetensors\", "
                       "\"kind\": \"optimizer\", \"rank\": 1, \"size\": 0, "
                       "\"xxh3\": \"0000000000000000\",\n     \"tensors\": {\n      "
                       "\"state.0.exp_avg\": \"0000000000001234\"},\n     \"chunks\": {\n"
                       "      \"state.0.exp_avg\": {\"dtype\":\"BF16\",\"global_shape\":[3,6],"
                       "\"offsets\":[0,3],\"shape\":[3,3]}}}\n");
    /* The same manifest indented throughout, as earlier versions wrote it,
     * reads the same (its checksum recomputed over the new bytes). */
    json_error_t je;
    json_t *doc = json_loadb(text, n, 0, &je);
    assert_non_null(doc);
    char *old = json_dumps(doc, JSON_INDENT(2) | JSON_PRESERVE_ORDER);
    json_decref(doc);
    assert_non_null(old);
    size_t on = strlen(old);
    char *sum = strstr(old, "\"manifest_xxh3\": \"") + strlen("\"manifest_xxh3\": \"");
    memset(sum, '0', 16);
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, ckpt__xxh3(old, on));
    memcpy(sum, hex, 16);
    assert_int_equal(ckpt__manifest_parse(old, on, "indented", &m), CKPT_OK);
    f = ckpt__manifest_find(&m, "optimizer-00002-of-00002.safetensors");
    assert_non_null(f);
    assert_int_equal(f->chunks[0].offsets[1], 3);
    ckpt__manifest_clear(&m);
    free(old);
    free(text);
    free(mp);

    /* 4000 columns of a [2, 4000] tensor, one chunk each, shuffled. */
    enum { N = 4000 };
    ckpt_chunk *cs = calloc(N, sizeof *cs);
    ckpt_chunk_ref *refs = calloc(N, sizeof *refs);
    for (int i = 0; i < N; i++) {
        int col = (int)(((int64_t)i * 1237) % N);
        cs[i] = (ckpt_chunk){CKPT_F32, 2, {2, N}, {0, col}, {2, 1}};
        refs[i] = (ckpt_chunk_ref){&cs[i], "f"};
    }
    assert_int_equal(ckpt__chunks_cover(refs, N, CKPT_ECORRUPT, "x", "t"), CKPT_OK);
    cs[17].offsets[1] = cs[18].offsets[1];
    for (int i = 0; i < N; i++) refs[i] = (ckpt_chunk_ref){&cs[i], "f"};
    assert_int_equal(ckpt__chunks_cover(refs, N, CKPT_ECORRUPT, "x", "t"), CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "chunks overlap"));
    free(cs);
    free(refs);
}

/* A reader given shard files whose chunks overlap or leave a hole refuses
 * to assemble the tensor, naming the files. */
static void test_reader_rejects_bad_chunk_sets(void **state) {
    (void)state;
    const int64_t a[][4] = {{0, 0, 3, C}}, b[][4] = {{2, 0, 4, C}}, c[][4] = {{4, 0, 2, C}};
    shard_file s[3];
    memset(s, 0, sizeof s);
    write_shard(&s[0], 0, 2, a, 1);
    write_shard(&s[1], 1, 2, b, 1);
    write_shard(&s[2], 1, 3, c, 1);
    int64_t g[2] = {R, C};
    float whole[R * C];
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt__reader_new_empty(&r, "obj"), CKPT_OK);
    attach(r, &s[0]);
    attach(r, &s[1]);
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_F32, 2, g, whole), CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "chunks overlap"));
    assert_non_null(strstr(ckpt_errmsg(), "(obj-00002-of-00002.safetensors)"));
    ckpt_writer *schema = NULL;
    assert_int_equal(ckpt_writer_new_schema(&schema), CKPT_OK);
    assert_int_equal(ckpt_write_tensor(schema, "t", CKPT_F32, 2, g, NULL), CKPT_OK);
    assert_int_equal(ckpt__schema_check(schema, r, "obj"), CKPT_ECORRUPT);
    ckpt_reader_free(r);
    assert_int_equal(ckpt__reader_new_empty(&r, "obj"), CKPT_OK);
    attach(r, &s[0]);
    attach(r, &s[2]);
    assert_int_equal(ckpt_read_tensor(r, "t", CKPT_F32, 2, g, whole), CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "chunks leave a hole: they cover 25 of the 30"));
    /* A chunk record that disagrees with the file's own header. */
    ckpt_chunk wrong = s[1].d.tensor_chunk[0];
    wrong.shape[0] = 3;
    const char *keys[1] = {"t"};
    assert_int_equal(ckpt__reader_attach_shard(r, s[1].bytes, s[1].len, "x", keys, &wrong, 1, NULL),
                     CKPT_ECORRUPT);
    assert_non_null(strstr(ckpt_errmsg(), "F32 [4,5] in the file, F32 [3,5] listed"));
    /* A complete set checks out against the schema. */
    ckpt_reader_free(r);
    const int64_t d[][4] = {{3, 0, 3, C}};
    shard_file s3;
    memset(&s3, 0, sizeof s3);
    write_shard(&s3, 1, 4, d, 1);
    assert_int_equal(ckpt__reader_new_empty(&r, "obj"), CKPT_OK);
    attach(r, &s[0]);
    attach(r, &s3);
    assert_int_equal(ckpt__schema_check(schema, r, "obj"), CKPT_OK);
    ckpt_reader_free(r);
    ckpt_writer_free(schema);
    shard_file_free(&s3);
    for (int i = 0; i < 3; i++) shard_file_free(&s[i]);
}

int main(void) {
    const struct CMUnitTest tests[] = {
        cmocka_unit_test_setup_teardown(test_rows_round_trip_any_slice, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test(test_box_copy_range_any_cut),
        cmocka_unit_test_setup_teardown(test_streamed_chunks_fetch, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_grid_saved_by_4_read_by_3, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_plain_tensor_reads_as_one_chunk, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_write_shard_validates, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_object_file_skips_shards, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_manifest_rejects_bad_chunk_tables, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_manifest_chunks_round_trip, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
        cmocka_unit_test_setup_teardown(test_reader_rejects_bad_chunk_sets, tu_tmpdir_setup,
                                        tu_tmpdir_teardown),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
