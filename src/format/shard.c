/* shard.c — chunk geometry for sharded tensors: per-chunk bounds checks,
 * exact coverage of a chunk set (no overlap, no hole), box-to-box copies,
 * and shard file names. Chunk records come from manifests and files, so
 * everything here treats them as hostile input. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "format/shard.h"

int ckpt__chunk_check(const ckpt_chunk *c, int code, const char *what, const char *key,
                      uint64_t *nbytes) {
    char a[200], b[200], g[200];
    if (!what) what = "state dict";
    if (!key) key = "(null)";
    if (!ckpt_dtype_name(c->dtype))
        return ckpt__err(code, "%s: chunk of '%s': invalid dtype %d", what, key, (int)c->dtype);
    if (c->ndim < 0 || c->ndim > CKPT_MAX_NDIM)
        return ckpt__err(code, "%s: chunk of '%s': ndim %d outside 0..%d", what, key, c->ndim,
                         CKPT_MAX_NDIM);
    if (ckpt_tensor_nbytes(c->dtype, c->ndim, c->global_shape, NULL) != CKPT_OK)
        return ckpt__err_prefix(code, "%s: chunk of '%s': global shape %s", what, key,
                                ckpt__shape_str(g, sizeof g, c->ndim, c->global_shape));
    for (int d = 0; d < c->ndim; d++) {
        int64_t o = c->offsets[d], s = c->shape[d], n = c->global_shape[d];
        if (o < 0 || s < 0 || o > n || s > n - o)
            return ckpt__err(code,
                             "%s: chunk of '%s': offsets %s + shape %s lie outside the tensor's "
                             "global shape %s (dimension %d: %" PRId64 " + %" PRId64 " > %" PRId64
                             ")",
                             what, key, ckpt__shape_str(a, sizeof a, c->ndim, c->offsets),
                             ckpt__shape_str(b, sizeof b, c->ndim, c->shape),
                             ckpt__shape_str(g, sizeof g, c->ndim, c->global_shape), d, o, s, n);
    }
    uint64_t nb = 0;
    if (ckpt_tensor_nbytes(c->dtype, c->ndim, c->shape, &nb) != CKPT_OK)
        return ckpt__err_prefix(code, "%s: chunk of '%s': shape %s", what, key,
                                ckpt__shape_str(b, sizeof b, c->ndim, c->shape));
    if (nbytes) *nbytes = nb;
    return CKPT_OK;
}

/* ---- exact coverage ------------------------------------------------------ */

static uint64_t volume(const ckpt_chunk *c) {
    uint64_t v = 1;
    for (int d = 0; d < c->ndim; d++) v *= (uint64_t)c->shape[d]; /* <= global volume */
    return v;
}

static bool empty_box(const ckpt_chunk *c) {
    for (int d = 0; d < c->ndim; d++)
        if (c->shape[d] == 0) return true;
    return false;
}

static bool boxes_overlap(const ckpt_chunk *x, const ckpt_chunk *y) {
    for (int d = 0; d < x->ndim; d++) {
        if (x->offsets[d] >= y->offsets[d] + y->shape[d]) return false;
        if (y->offsets[d] >= x->offsets[d] + x->shape[d]) return false;
    }
    return true;
}

/* qsort has no context argument: the sweep dimension is passed this way. The
 * check runs in one thread at a time per call chain, but loads may verify on
 * several threads, so it is thread-local. */
static _Thread_local int sweep_dim;

static int cmp_sweep(const void *a, const void *b) {
    const ckpt_chunk *x = ((const ckpt_chunk_ref *)a)->c, *y = ((const ckpt_chunk_ref *)b)->c;
    int d0 = sweep_dim;
    if (x->offsets[d0] != y->offsets[d0]) return x->offsets[d0] < y->offsets[d0] ? -1 : 1;
    for (int d = 0; d < x->ndim; d++)
        if (x->offsets[d] != y->offsets[d]) return x->offsets[d] < y->offsets[d] ? -1 : 1;
    return 0;
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

static const char *file_of(const ckpt_chunk_ref *r) { return r->file ? r->file : "(memory)"; }

int ckpt__chunks_cover(ckpt_chunk_ref *v, int64_t n, int code, const char *what, const char *key) {
    char a[200], b[200], c2[200], d2[200];
    if (!what) what = "checkpoint";
    if (n <= 0) return ckpt__err(code, "%s: tensor '%s' has no chunks", what, key);
    const ckpt_chunk *first = v[0].c;
    uint64_t total = 0, covered = 0;
    for (int64_t i = 0; i < n; i++) {
        const ckpt_chunk *c = v[i].c;
        CKPT_TRY(ckpt__chunk_check(c, code, file_of(&v[i]), key, NULL));
        bool same = c->dtype == first->dtype && c->ndim == first->ndim;
        for (int d = 0; same && d < c->ndim; d++)
            same = c->global_shape[d] == first->global_shape[d];
        if (!same)
            return ckpt__err(code,
                             "%s: tensor '%s': chunks disagree on the tensor: %s %s in %s, %s %s "
                             "in %s",
                             what, key, ckpt_dtype_name(first->dtype),
                             ckpt__shape_str(a, sizeof a, first->ndim, first->global_shape),
                             file_of(&v[0]), ckpt_dtype_name(c->dtype),
                             ckpt__shape_str(b, sizeof b, c->ndim, c->global_shape),
                             file_of(&v[i]));
        /* Disjoint chunks inside the tensor never sum past its volume, so
         * an overflow here already means overlap. */
        if (__builtin_add_overflow(covered, volume(c), &covered)) covered = UINT64_MAX;
    }
    total = 1;
    for (int d = 0; d < first->ndim; d++) total *= (uint64_t)first->global_shape[d];
    for (int d = 0; d < first->ndim; d++)
        if (first->global_shape[d] == 0) total = 0;

    int nd = first->ndim;
    int best = 0;
    if (nd > 1 && n > 1) {
        /* Sweep along the dimension whose chunks start at the most distinct
         * offsets: the active set then stays small for row and column
         * splits alike. */
        int64_t *tmp = ckpt__malloc((size_t)n * sizeof *tmp);
        if (!tmp) return ckpt__err_nomem("chunk check");
        int64_t most = -1;
        for (int d = 0; d < nd; d++) {
            for (int64_t i = 0; i < n; i++) tmp[i] = v[i].c->offsets[d];
            qsort(tmp, (size_t)n, sizeof *tmp, cmp_i64);
            int64_t distinct = 1;
            for (int64_t i = 1; i < n; i++) distinct += tmp[i] != tmp[i - 1];
            if (distinct > most) most = distinct, best = d;
        }
        free(tmp);
    }
    sweep_dim = best;
    if (nd > 0) qsort(v, (size_t)n, sizeof *v, cmp_sweep);

    /* Active: non-empty chunks whose extent along `best` reaches past the
     * current chunk's start. */
    int64_t *active = ckpt__malloc((size_t)n * sizeof *active);
    if (!active) return ckpt__err_nomem("chunk check");
    int64_t na = 0;
    int rc = CKPT_OK;
    for (int64_t i = 0; i < n && rc == CKPT_OK; i++) {
        const ckpt_chunk *c = v[i].c;
        if (empty_box(c)) continue;
        if (nd == 0) {
            if (na > 0) {
                rc = ckpt__err(code, "%s: tensor '%s': chunks overlap: the scalar is in %s and %s",
                               what, key, file_of(&v[active[0]]), file_of(&v[i]));
                break;
            }
            active[na++] = i;
            continue;
        }
        int64_t start = c->offsets[best], k = 0;
        for (int64_t j = 0; j < na; j++) {
            const ckpt_chunk *p = v[active[j]].c;
            if (p->offsets[best] + p->shape[best] > start) active[k++] = active[j];
        }
        na = k;
        for (int64_t j = 0; j < na; j++) {
            const ckpt_chunk_ref *p = &v[active[j]];
            if (boxes_overlap(p->c, c)) {
                rc = ckpt__err(code,
                               "%s: tensor '%s': chunks overlap: offsets %s shape %s (%s) and "
                               "offsets %s shape %s (%s)",
                               what, key, ckpt__shape_str(a, sizeof a, nd, p->c->offsets),
                               ckpt__shape_str(b, sizeof b, nd, p->c->shape), file_of(p),
                               ckpt__shape_str(c2, sizeof c2, nd, c->offsets),
                               ckpt__shape_str(d2, sizeof d2, nd, c->shape), file_of(&v[i]));
                break;
            }
        }
        active[na++] = i;
    }
    free(active);
    if (rc) return rc;
    if (covered != total)
        return ckpt__err(code,
                         "%s: tensor '%s': chunks leave a hole: they cover %" PRIu64
                         " of the %" PRIu64 " elements of %s",
                         what, key, covered, total,
                         ckpt__shape_str(a, sizeof a, nd, first->global_shape));
    return CKPT_OK;
}

/* ---- box copies ---------------------------------------------------------- */

/* Byte offset of element idx for a dtype of `bits` bits; false if it does
 * not start on a byte. */
static bool elem_byte(uint64_t idx, int bits, uint64_t *out) {
    uint64_t rem = (idx % 8) * (uint64_t)bits;
    if (rem % 8) return false;
    *out = (idx / 8) * (uint64_t)bits + rem / 8;
    return true;
}

int ckpt__box_copy_to(ckpt_dtype dt, int ndim, const int64_t *src_off, const int64_t *src_shape,
                      const void *src, const int64_t *dst_off, const int64_t *dst_shape,
                      const ckpt_dst *dst) {
    int bits = ckpt_dtype_bits(dt);
    if (bits <= 0) return ckpt__err(CKPT_EINVAL, "box copy: invalid dtype %d", (int)dt);
    if (ndim == 0) return ckpt__dst_put(dst, 0, src, (uint64_t)bits / 8);
    int64_t lo[CKPT_MAX_NDIM] = {0},
            ext[CKPT_MAX_NDIM] = {0}; /* (zeroed: -O2 cannot see ndim > 0) */
    for (int d = 0; d < ndim; d++) {
        int64_t a = src_off[d] > dst_off[d] ? src_off[d] : dst_off[d];
        int64_t se = src_off[d] + src_shape[d], de = dst_off[d] + dst_shape[d];
        int64_t e = se < de ? se : de;
        if (e <= a) return CKPT_OK; /* disjoint: nothing to copy */
        lo[d] = a;
        ext[d] = e - a;
    }
    /* Merge trailing dimensions that both boxes hold whole into one run. */
    int k = ndim - 1;
    uint64_t run = (uint64_t)ext[k];
    while (k > 0 && ext[k] == src_shape[k] && ext[k] == dst_shape[k]) {
        k--;
        run *= (uint64_t)ext[k];
    }
    uint64_t sstride[CKPT_MAX_NDIM], dstride[CKPT_MAX_NDIM];
    sstride[ndim - 1] = dstride[ndim - 1] = 1;
    for (int d = ndim - 2; d >= 0; d--) {
        sstride[d] = sstride[d + 1] * (uint64_t)src_shape[d + 1];
        dstride[d] = dstride[d + 1] * (uint64_t)dst_shape[d + 1];
    }
    uint64_t run_bytes = 0;
    if (!elem_byte(run, bits, &run_bytes))
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "box copy: %s runs of %" PRIu64 " elements are not whole bytes",
                         ckpt_dtype_name(dt), run);
    int64_t pos[CKPT_MAX_NDIM];
    for (int d = 0; d < ndim; d++) pos[d] = lo[d];
    const uint8_t *s = src;
    for (;;) {
        uint64_t si = 0, di = 0, sb, db;
        for (int d = 0; d < ndim; d++) {
            si += (uint64_t)(pos[d] - src_off[d]) * sstride[d];
            di += (uint64_t)(pos[d] - dst_off[d]) * dstride[d];
        }
        if (!elem_byte(si, bits, &sb) || !elem_byte(di, bits, &db))
            return ckpt__err(CKPT_EUNSUPPORTED,
                             "box copy: a %s slice that does not start on a byte boundary",
                             ckpt_dtype_name(dt));
        if (!dst->mem.ops) memcpy(dst->host + db, s + sb, (size_t)run_bytes);
        else CKPT_TRY(ckpt__dst_put(dst, db, s + sb, run_bytes));
        int d = k - 1;
        for (; d >= 0; d--) {
            if (++pos[d] < lo[d] + ext[d]) break;
            pos[d] = lo[d];
        }
        if (d < 0) break;
    }
    return CKPT_OK;
}

int ckpt__box_copy(ckpt_dtype dt, int ndim, const int64_t *src_off, const int64_t *src_shape,
                   const void *src, const int64_t *dst_off, const int64_t *dst_shape, void *dst) {
    ckpt_dst d = ckpt__dst_host(dst);
    return ckpt__box_copy_to(dt, ndim, src_off, src_shape, src, dst_off, dst_shape, &d);
}

/* Elements [s, e) of the box (off, shape) whose dimensions below k are held
 * at one index (shape 1 there), src at element s: whole runs of dimension k
 * are one contiguous box; a partial run at either end recurses into
 * dimension k + 1. off and shape are restored on return. */
static int range_copy(ckpt_dtype dt, int ndim, int64_t *off, int64_t *shape, int k, uint64_t s,
                      uint64_t e, const uint8_t *src, size_t esz, const int64_t *dst_off,
                      const int64_t *dst_shape, const ckpt_dst *dst) {
    if (s >= e) return CKPT_OK;
    if (k == ndim) return ckpt__box_copy_to(dt, ndim, off, shape, src, dst_off, dst_shape, dst);
    uint64_t inner = 1;
    for (int d = k + 1; d < ndim; d++) inner *= (uint64_t)shape[d];
    int64_t off_k = off[k], shape_k = shape[k];
    uint64_t a = s / inner, b = e / inner;
    int rc = CKPT_OK;
    if (s % inner) { /* the head: the rest of run a */
        uint64_t he = (a + 1) * inner < e ? (a + 1) * inner : e;
        off[k] = off_k + (int64_t)a;
        shape[k] = 1;
        rc = range_copy(dt, ndim, off, shape, k + 1, s - a * inner, he - a * inner, src, esz,
                        dst_off, dst_shape, dst);
        src += (he - s) * esz;
        s = he;
        a++;
    }
    if (rc == 0 && s < e && b > a) { /* whole runs [a, b) */
        off[k] = off_k + (int64_t)a;
        shape[k] = (int64_t)(b - a);
        rc = ckpt__box_copy_to(dt, ndim, off, shape, src, dst_off, dst_shape, dst);
        src += (b - a) * inner * esz;
        s = b * inner;
    }
    if (rc == 0 && s < e) { /* the tail: the start of run b */
        off[k] = off_k + (int64_t)b;
        shape[k] = 1;
        rc = range_copy(dt, ndim, off, shape, k + 1, 0, e - b * inner, src, esz, dst_off, dst_shape,
                        dst);
    }
    off[k] = off_k;
    shape[k] = shape_k;
    return rc;
}

int ckpt__box_copy_range(ckpt_dtype dt, int ndim, const int64_t *src_off, const int64_t *src_shape,
                         uint64_t first, uint64_t count, const void *src, const int64_t *dst_off,
                         const int64_t *dst_shape, void *dst) {
    ckpt_dst d = ckpt__dst_host(dst);
    return ckpt__box_copy_range_to(dt, ndim, src_off, src_shape, first, count, src, dst_off,
                                   dst_shape, &d);
}

int ckpt__box_copy_range_to(ckpt_dtype dt, int ndim, const int64_t *src_off,
                            const int64_t *src_shape, uint64_t first, uint64_t count,
                            const void *src, const int64_t *dst_off, const int64_t *dst_shape,
                            const ckpt_dst *dst) {
    int bits = ckpt_dtype_bits(dt);
    if (bits <= 0 || bits % 8)
        return ckpt__err(CKPT_EUNSUPPORTED, "box copy: pieces of %s elements are not whole bytes",
                         ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "(invalid)");
    if (ndim < 0 || ndim > CKPT_MAX_NDIM) return ckpt__err(CKPT_EINVAL, "box copy: ndim %d", ndim);
    int64_t off[CKPT_MAX_NDIM] = {0}, shape[CKPT_MAX_NDIM] = {0};
    for (int d = 0; d < ndim; d++) {
        off[d] = src_off[d];
        shape[d] = src_shape[d];
    }
    return range_copy(dt, ndim, off, shape, 0, first, first + count, src, (size_t)bits / 8, dst_off,
                      dst_shape, dst);
}

/* ---- shard file names ----------------------------------------------------- */

int ckpt__shard_file_name(char *buf, size_t cap, const char *stem, int rank, int size) {
    if (!stem || rank < 0 || size < 1 || rank >= size)
        return ckpt__err(CKPT_EINVAL, "shard file name: rank %d of %d", rank, size);
    int n = snprintf(buf, cap, "%s-%05d-of-%05d.safetensors", stem, rank + 1, size);
    if (n < 0 || (size_t)n >= cap)
        return ckpt__err(CKPT_EINVAL, "shard file name: '%s' is too long", stem);
    return CKPT_OK;
}

/* Parses at least 5 digits ending at `end` (exclusive), going back from it;
 * returns the start or NULL. */
static const char *digits_back(const char *start, const char *end, int *value) {
    const char *p = end;
    while (p > start && p[-1] >= '0' && p[-1] <= '9') p--;
    if (end - p < 5 || end - p > 9) return NULL;
    int v = 0;
    for (const char *q = p; q < end; q++) v = v * 10 + (*q - '0');
    *value = v;
    return p;
}

int ckpt__frozen_file_name(char *buf, size_t cap, const char *stem) {
    int n = snprintf(buf, cap, "%s" CKPT_FROZEN_FILE_TAIL, stem ? stem : "");
    if (!stem || !*stem || n < 0 || (size_t)n >= cap)
        return ckpt__err(CKPT_EINVAL, "frozen file name: '%s' is empty or too long",
                         stem ? stem : "");
    return CKPT_OK;
}

bool ckpt__shard_file_parse(const char *name, size_t *stem_len, int *index, int *count) {
    static const char ext[] = ".safetensors";
    size_t n = strlen(name), e = sizeof ext - 1, f = sizeof CKPT_FROZEN_FILE_TAIL - 1;
    if (n <= e || strcmp(name + n - e, ext) != 0) return false;
    if (n > f && strcmp(name + n - f, CKPT_FROZEN_FILE_TAIL) == 0) {
        if (stem_len) *stem_len = n - f;
        if (index) *index = 1;
        if (count) *count = 1;
        return true;
    }
    const char *end = name + n - e;
    int of = 0, idx = 0;
    const char *p = digits_back(name, end, &of);
    if (!p || p - name < 4 || memcmp(p - 4, "-of-", 4) != 0) return false;
    const char *q = digits_back(name, p - 4, &idx);
    if (!q || q - name < 2 || q[-1] != '-') return false;
    if (idx < 1 || of < 1 || idx > of) return false;
    if (stem_len) *stem_len = (size_t)(q - 1 - name);
    if (index) *index = idx;
    if (count) *count = of;
    return true;
}
