/* statedict_read.c — reading a reader's entries: tensors (checked in one
 * pass against the manifest's digests when the reader verifies, converted,
 * viewed in place, or sliced out of the chunks of attached shard files) and
 * scalars. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/error.h"
#include "base/hashread.h"
#include "base/io.h"
#include "format/safetensors.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* Hashes the file's bytes [v->next, end) into the whole-file digest
 * through the scratch piece: the header's end, padding, tensors nobody
 * read (yet), the tail. */
static int verify_skip_to(ckpt_reader *r, uint64_t end) {
    verify_stream *v = r->vs;
    while (v->next < end) {
        size_t k = end - v->next < VERIFY_PIECE ? (size_t)(end - v->next) : VERIFY_PIECE;
        CKPT_TRY(pread_all(r, v->scratch, k, v->next));
        XXH3_64bits_update(v->h, v->scratch, k);
        v->next += k;
    }
    return CKPT_OK;
}

/* At most this many bytes between the end of what the stream hashed and
 * the next tensor read are hashed through the scratch piece to keep the
 * stream going (padding, a small tensor nobody reads). A read further ahead
 * (a check that reads the small entries of a file first, say) is checked
 * against its own digest instead and leaves the stream where it is, so the
 * large tensors it jumps over are still read once, into their buffers. */
#define VERIFY_GAP_MAX ((uint64_t)64 << 10)

/* Where piece [off, ...) of a verified read lands to be hashed: the
 * caller's host memory itself, or the scratch piece (no destination, or one
 * behind memory ops, which gets the piece once it is hashed). */
static uint8_t *landing(const verify_stream *v, const ckpt_dst *dst, uint64_t off) {
    return dst && !dst->mem.ops ? dst->host + off : v->scratch;
}

/* The bytes [off, off + n) of r's file into host memory to, hashed into h
 * in order as they land (two threads for a large range: hashread.h). */
static int read_hashed_to(ckpt_reader *r, const char *key, uint8_t *to, uint64_t n, uint64_t off,
                          XXH3_state_t *h) {
    ckpt__hashread_fail why;
    if (ckpt__hashread(&r->vs->helper, r->fd, off, n, to, NULL, h, &why) == 0) return CKPT_OK;
    int rc = why.err
                 ? ckpt__err_os(why.err, "%s: read at offset %" PRIu64, r->name, why.at)
                 : ckpt__err(CKPT_ECORRUPT, "%s: file ended at offset %" PRIu64 " while reading",
                             r->name, why.at);
    return ckpt__err_prefix(rc, "tensor '%s'", key);
}

/* By parts: entry e's bytes into dst (NULL: through the scratch piece),
 * each piece hashed right after it lands, against e's own digest. */
static int part_read(ckpt_reader *r, const entry *e, const char *key, const ckpt_dst *dst) {
    verify_stream *v = r->vs;
    int64_t j = e - r->entries;
    if (!v->ehas[j])
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': the manifest records no checksum for it",
                         r->name, key);
    XXH3_64bits_reset(v->t);
    if (dst && !dst->mem.ops)
        CKPT_TRY(read_hashed_to(r, key, dst->host, e->nbytes, e->offset, v->t));
    for (uint64_t off = 0; !(dst && !dst->mem.ops) && off < e->nbytes;) {
        size_t k = e->nbytes - off < VERIFY_PIECE ? (size_t)(e->nbytes - off) : VERIFY_PIECE;
        uint8_t *to = landing(v, dst, off);
        int rc = pread_all(r, to, k, e->offset + off);
        if (rc) return ckpt__err_prefix(rc, "tensor '%s'", key);
        XXH3_64bits_update(v->t, to, k);
        if (dst && dst->mem.ops) CKPT_TRY(ckpt__dst_put(dst, off, to, k));
        off += k;
    }
    if (XXH3_64bits_digest(v->t) != v->edigest[j])
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': checksum mismatch", r->name, key);
    v->edone[j] = true;
    return CKPT_OK;
}

/* A tensor's bytes from the file into dst, hashed piece by piece right
 * after each piece lands there (so the bytes hashed are the bytes kept):
 * into the whole-file digest when it comes next in file order, else
 * against the tensor's own digest from the manifest. */
static int verified_read(ckpt_reader *r, const entry *e, const char *key, const ckpt_dst *dst) {
    verify_stream *v = r->vs;
    if (v->by_parts) return part_read(r, e, key, dst);
    bool in_order = e->offset >= v->next && e->offset - v->next <= VERIFY_GAP_MAX;
    if (in_order) CKPT_TRY(verify_skip_to(r, e->offset));
    else XXH3_64bits_reset(v->t);
    if (!dst->mem.ops)
        CKPT_TRY(read_hashed_to(r, key, dst->host, e->nbytes, e->offset, in_order ? v->h : v->t));
    for (uint64_t off = 0; dst->mem.ops && off < e->nbytes;) {
        size_t k = e->nbytes - off < VERIFY_PIECE ? (size_t)(e->nbytes - off) : VERIFY_PIECE;
        uint8_t *to = landing(v, dst, off);
        int rc = pread_all(r, to, k, e->offset + off);
        if (rc) return ckpt__err_prefix(rc, "tensor '%s'", key);
        XXH3_64bits_update(in_order ? v->h : v->t, to, k);
        if (dst->mem.ops) CKPT_TRY(ckpt__dst_put(dst, off, to, k));
        off += k;
    }
    if (in_order) {
        v->next = e->offset + e->nbytes;
        return CKPT_OK;
    }
    for (int64_t i = 0; i < v->n; i++) {
        if (strcmp(v->keys[i], e->key) != 0) continue;
        if (XXH3_64bits_digest(v->t) != v->digests[i])
            return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': checksum mismatch", r->name, key);
        return CKPT_OK;
    }
    return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': the manifest records no checksum for it",
                     r->name, key);
}

int ckpt__reader_verify_finish(ckpt_reader *r) {
    if (!r || !r->vs) return CKPT_OK;
    if (r->vs->by_parts) {
        /* The header was checked at the open, each tensor read since
         * against its digest: what is left is the tensors nobody read. */
        for (int64_t j = 0; j < r->count; j++) {
            const entry *e = &r->entries[j];
            if (e->kind == CKPT_ENTRY_TENSOR && !r->vs->edone[j])
                CKPT_TRY(part_read(r, e, e->key, NULL));
        }
        return CKPT_OK;
    }
    CKPT_TRY(verify_skip_to(r, r->file_size));
    if (XXH3_64bits_digest(r->vs->h) != r->vs->xxh3)
        return ckpt__err(CKPT_ECORRUPT, "%s: checksum mismatch", r->name);
    return CKPT_OK;
}

int ckpt__reader_verify_applied(ckpt_reader *r) {
    if (!r || !r->vs || r->vs->by_parts) return CKPT_OK;
    return ckpt__reader_verify_finish(r);
}

static int find_tensor(const ckpt_reader *r, const char *key, const entry **out) {
    if (!r || !key) return ckpt__err(CKPT_EINVAL, "read tensor: NULL argument");
    const entry *e = reader_get(r, key);
    if (!e) return ckpt__err(CKPT_ENOENT, "%s: no tensor '%s'", r->name, key);
    if (e->kind == CKPT_ENTRY_ALIAS) { /* its target's tensor */
        const entry *t = reader_get(r, e->str);
        if (!t || t->kind != CKPT_ENTRY_TENSOR)
            return ckpt__err(CKPT_ECORRUPT, "%s: '%s' is an alias of '%s', which %s", r->name, key,
                             e->str, t ? "is not a tensor" : "the file does not hold");
        e = t;
    }
    if (e->kind != CKPT_ENTRY_TENSOR)
        return ckpt__err(CKPT_ENOENT, "%s: key '%s' is a %s, not a tensor", r->name, key,
                         kind_name(e->kind));
    *out = e;
    return CKPT_OK;
}

/* A chunk a read needs whose file this process did not receive. */
static int absent_chunk(const ckpt_reader *r, const char *key, const shard_chunk *c) {
    char a[200];
    return ckpt__err(CKPT_EMISMATCH,
                     "%s: key '%s': the chunk at offsets %s is in %s, which this process did not "
                     "receive (the load plan gives it no such chunk)",
                     r->name, key, ckpt__shape_str(a, sizeof a, c->c.ndim, c->c.offsets), c->file);
}

/* Whether boxes [ao, ao + as) and [bo, bo + bs) share an element. */
static bool boxes_meet(int ndim, const int64_t *ao, const int64_t *as, const int64_t *bo,
                       const int64_t *bs) {
    for (int d = 0; d < ndim; d++)
        if (as[d] == 0 || bs[d] == 0 || ao[d] + as[d] <= bo[d] || bo[d] + bs[d] <= ao[d])
            return false;
    return true;
}

/* Where a streamed chunk's pieces go: the slice a read asked for (same:
 * it is the chunk's own box, so the bytes land as they come). */
typedef struct piece_dst {
    const shard_chunk *c;
    const int64_t *offsets, *shape;
    const ckpt_dst *dst;
    bool same;
} piece_dst;

static int put_piece(void *ctx, const uint8_t *p, uint64_t off, uint64_t n) {
    const piece_dst *d = ctx;
    if (d->same) return ckpt__dst_put(d->dst, off, p, n);
    int bits = ckpt_dtype_bits(d->c->c.dtype);
    if (bits % 8)
        return ckpt__err(CKPT_EUNSUPPORTED, "a slice of a streamed %s chunk (only whole chunks)",
                         ckpt_dtype_name(d->c->c.dtype));
    uint64_t esz = (uint64_t)bits / 8;
    return ckpt__box_copy_range_to(d->c->c.dtype, d->c->c.ndim, d->c->c.offsets, d->c->c.shape,
                                   off / esz, n / esz, p, d->offsets, d->shape, d->dst);
}

/* A streamed chunk of key, fetched whole; the part of it in the slice
 * [offsets, offsets + shape) lands in dst. */
static int fetch_chunk(ckpt_reader *r, const char *key, const shard_chunk *c,
                       const int64_t *offsets, const int64_t *shape, const ckpt_dst *dst) {
    uint64_t nbytes = 0;
    CKPT_TRY(ckpt__chunk_check(&c->c, CKPT_ECORRUPT, c->file, key, &nbytes));
    if (!r->fetch)
        return ckpt__err(CKPT_EINVAL,
                         "%s: key '%s': the chunk in %s is streamed, but the reader has no fetch",
                         r->name, key, c->file);
    /* whole elements in whole bytes: the least multiple of the element's
     * bits that is whole bytes */
    int bits = ckpt_dtype_bits(c->c.dtype), g = bits;
    while (g % 8) g += bits;
    piece_dst d = {c, offsets, shape, dst, true};
    for (int i = 0; i < c->c.ndim; i++)
        d.same &= offsets[i] == c->c.offsets[i] && shape[i] == c->c.shape[i];
    int rc = r->fetch(r->fetch_ctx, c->stream, c->data, nbytes, (size_t)g / 8, put_piece, &d);
    if (rc) return ckpt__err_prefix(rc, "%s: key '%s'", c->file, key);
    return CKPT_OK;
}

int ckpt_reader_tensor_view(ckpt_reader *r, const char *key, const void **data,
                            ckpt_entry_info *info) {
    const entry *e = NULL;
    CKPT_TRY(find_tensor(r, key, &e));
    CKPT_TRY(materialize(r, e));
    if (!data) return ckpt__err(CKPT_EINVAL, "tensor view: data is NULL");
    static const uint8_t empty = 0;
    if (e->sk) {
        /* A view needs the tensor in one piece: one chunk that is all of it. */
        const shard_key *k = &r->skeys[e->sk - 1];
        CKPT_TRY(shard_key_check(r, k));
        const shard_chunk *whole = NULL;
        for (int64_t i = 0; i < k->n; i++) {
            bool all = k->chunks[i].stream < 0; /* streamed: assembled below */
            for (int d = 0; all && d < e->ndim; d++) all = k->chunks[i].c.shape[d] == e->shape[d];
            if (all) whole = &k->chunks[i];
        }
        if (!whole && e->nbytes) {
            /* Saved in several chunks: assembled once into memory the
             * reader owns, so a view still works (at the cost of a copy). */
            if (e->nbytes > (uint64_t)SIZE_MAX) return ckpt__err_nomem("tensor view");
            uint8_t *buf = ckpt__malloc((size_t)e->nbytes);
            CKPT_TRY(reader_own(r, buf));
            int64_t zero[CKPT_MAX_NDIM] = {0};
            CKPT_TRY(ckpt_read_tensor_shard(r, key, e->dtype, e->ndim, e->shape, zero, e->shape,
                                            buf));
            *data = buf;
            if (info) entry_info(e, info);
            return CKPT_OK;
        }
        if (whole && whole->absent && e->nbytes) return absent_chunk(r, k->key, whole);
        *data = whole && whole->data ? (const void *)whole->data : (const void *)&empty;
        if (info) entry_info(e, info);
        return CKPT_OK;
    }
    if (e->data) {
        *data = e->data;
        if (info) entry_info(e, info);
        return CKPT_OK;
    }
    if (r->vs && e->nbytes) {
        /* Never a look through a mapping: the bytes, verified, into memory
         * the reader owns, which later reads of the key use too. */
        if (e->nbytes > (uint64_t)SIZE_MAX) return ckpt__err_nomem("tensor view");
        uint8_t *buf = ckpt__malloc((size_t)e->nbytes);
        CKPT_TRY(reader_own(r, buf));
        ckpt_dst d = ckpt__dst_host(buf);
        d.key = key;
        CKPT_TRY(verified_read(r, e, key, &d));
        ((entry *)e)->data = buf; /* r's own entry */
        *data = buf;
        if (info) entry_info(e, info);
        return CKPT_OK;
    }
    CKPT_TRY(reader_map(r));
    *data = r->mem ? (const void *)(r->mem + e->offset) : (const void *)&empty;
    if (info) entry_info(e, info);
    return CKPT_OK;
}

int ckpt_read_tensor_shard(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                           const int64_t *global_shape, const int64_t *offsets,
                           const int64_t *local_shape, void *dst) {
    ckpt_dst d = ckpt__dst_host(dst);
    d.key = key;
    return ckpt__read_tensor_shard_to(r, key, dt, ndim, global_shape, offsets, local_shape, &d);
}

int ckpt__read_tensor_shard_to(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                               const int64_t *global_shape, const int64_t *offsets,
                               const int64_t *local_shape, const ckpt_dst *dst) {
    const entry *e = NULL;
    CKPT_TRY(find_tensor(r, key, &e));
    char a[200], b[200];
    if (ndim < 0 || ndim > CKPT_MAX_NDIM ||
        (ndim > 0 && (!global_shape || !offsets || !local_shape)))
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': invalid slice asked (ndim %d)", r->name, key,
                         ndim);
    if (dt != e->dtype)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': dtype %s in file, %s asked", r->name, key,
                         ckpt_dtype_name(e->dtype),
                         ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "(invalid)");
    bool same = ndim == e->ndim;
    for (int d = 0; same && d < ndim; d++) same = global_shape[d] == e->shape[d];
    if (!same)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': global shape %s in file, %s asked", r->name,
                         key, ckpt__shape_str(a, sizeof a, e->ndim, e->shape),
                         ckpt__shape_str(b, sizeof b, ndim, global_shape));
    ckpt_chunk q;
    memset(&q, 0, sizeof q);
    q.dtype = dt;
    q.ndim = ndim;
    for (int d = 0; d < ndim; d++) {
        q.global_shape[d] = global_shape[d];
        q.offsets[d] = offsets[d];
        q.shape[d] = local_shape[d];
    }
    uint64_t qbytes = 0;
    int rc = ckpt__chunk_check(&q, CKPT_EINVAL, r->name, key, &qbytes);
    if (rc) return rc;
    if (qbytes == 0) return CKPT_OK;
    if (!dst->host && !dst->mem.ops)
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': destination is NULL", r->name, key);
    if (!e->sk) {
        bool whole = true;
        for (int d = 0; whole && d < ndim; d++)
            whole = offsets[d] == 0 && local_shape[d] == e->shape[d];
        if (whole) return ckpt__read_tensor_to(r, key, dt, ndim, global_shape, dst);
        CKPT_TRY(materialize(r, e));
        const uint8_t *src = e->data;
        if (!src) {
            CKPT_TRY(reader_map(r));
            src = r->mem + e->offset;
        }
        static const int64_t zero[CKPT_MAX_NDIM];
        rc = ckpt__box_copy_to(dt, ndim, zero, e->shape, src, offsets, local_shape, dst);
        if (rc) return ckpt__err_prefix(rc, "%s: key '%s'", r->name, key);
        return CKPT_OK;
    }
    const shard_key *k = &r->skeys[e->sk - 1];
    CKPT_TRY(shard_key_check(r, k));
    for (int64_t i = 0; i < k->n; i++) {
        const shard_chunk *c = &k->chunks[i];
        if (c->stream >= 0) {
            rc = fetch_chunk(r, key, c, offsets, local_shape, dst);
            if (rc) return rc;
            continue;
        }
        if (c->absent && boxes_meet(ndim, c->c.offsets, c->c.shape, offsets, local_shape))
            return absent_chunk(r, key, c);
        if (!c->data) continue; /* an empty chunk, or one this read does not need */
        rc = ckpt__box_copy_to(dt, ndim, c->c.offsets, c->c.shape, c->data, offsets, local_shape,
                               dst);
        if (rc) return ckpt__err_prefix(rc, "%s: key '%s'", c->file, key);
    }
    return CKPT_OK;
}

int ckpt__reader_adopt_map(ckpt_reader *r, ckpt_mapped *m) {
    CKPT_TRY(grow((void **)&r->maps, &r->mapcap, r->nmaps + 1, sizeof *r->maps));
    r->maps[r->nmaps++] = *m;
    memset(m, 0, sizeof *m);
    return CKPT_OK;
}

int ckpt__reader_new_empty(ckpt_reader **out, const char *name) {
    if (!out) return ckpt__err(CKPT_EINVAL, "reader: out is NULL");
    *out = NULL;
    ckpt_reader *r = NULL;
    CKPT_TRY(reader_alloc(&r, name));
    r->entries = ckpt__calloc(1, sizeof *r->entries);
    if (!r->entries) {
        ckpt_reader_free(r);
        return ckpt__err_nomem("reader entries");
    }
    r->ecap = 1;
    *out = r;
    return CKPT_OK;
}

/* Finds the tensor named key among a parsed header's tensors (linear: shard
 * files hold a handful of tensors, and the index is built per call). */
static int attach_index(const ckpt_st_header *h, key_index *ix) {
    for (int64_t i = 0; i < h->ntensors; i++) {
        int rc = key_index_put(ix, h->tensors[i].name, i, NULL);
        if (rc == CKPT_ENOMEM) return ckpt__err_nomem("shard attach");
        /* duplicates were rejected by the parser */
    }
    return CKPT_OK;
}

/* The i-th chunk listed for a shard file against the file's parsed header
 * h: its tensor is there, of the listed dtype and shape, listed once. */
static int chunk_in_file(const ckpt_st_header *h, const key_index *ix, int64_t *where,
                         const char *name, const char *key, const ckpt_chunk *c, int64_t i) {
    char a[200], b[200];
    int64_t t = key_index_get(ix, key);
    if (t < 0) return ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%s' is not in the file", name, key);
    const ckpt_st_tensor *ft = &h->tensors[t];
    bool same = ft->dtype == c->dtype && ft->ndim == c->ndim;
    for (int d = 0; same && d < ft->ndim; d++) same = ft->shape[d] == c->shape[d];
    if (!same)
        return ckpt__err(
            CKPT_ECORRUPT, "%s: chunk of '%s': %s %s in the file, %s %s listed", name, key,
            ckpt_dtype_name(ft->dtype), ckpt__shape_str(a, sizeof a, ft->ndim, ft->shape),
            ckpt_dtype_name(c->dtype), ckpt__shape_str(b, sizeof b, c->ndim, c->shape));
    if (where[t]) return ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%s' is listed twice", name, key);
    where[t] = i + 1;
    return CKPT_OK;
}

void ckpt__reader_set_fetch(ckpt_reader *r, ckpt__fetch_fn fn, void *ctx) {
    if (!r) return;
    r->fetch = fn;
    r->fetch_ctx = ctx;
}

int ckpt__reader_attach_shard(ckpt_reader *r, const void *buf, size_t len, const char *name,
                              const char *const *keys, const ckpt_chunk *chunks, int64_t n,
                              const int64_t *stream) {
    if (!r || (!buf && len) || (n > 0 && (!keys || !chunks)) || n < 0)
        return ckpt__err(CKPT_EINVAL, "attach shard: invalid argument");
    bool absent = !buf; /* the manifest's records only */
    if (!name) name = "(shard)";
    char a[200], b[200];
    ckpt_st_header h;
    memset(&h, 0, sizeof h);
    key_index ix;
    memset(&ix, 0, sizeof ix);
    int64_t *where = NULL;
    char *fname = NULL;
    uint64_t hl = 0;
    int rc = absent ? CKPT_OK : ckpt__st_header_len(buf, len, name, &hl);
    if (!rc && !absent) rc = ckpt__st_parse((const uint8_t *)buf + 8, hl, len, name, &h);
    if (!rc && !absent) rc = attach_index(&h, &ix);
    if (rc) goto out;
    if (!absent && h.ntensors != n) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %" PRId64 " tensors in the file, %" PRId64
                       " chunks listed for it",
                       name, h.ntensors, n);
        goto out;
    }
    where = ckpt__calloc((size_t)(n ? n : 1), sizeof *where);
    fname = ckpt__strdup(name);
    if (!where || !fname) {
        rc = ckpt__err_nomem("shard attach");
        goto out;
    }
    /* Check everything first, so a failure leaves r as it was. */
    for (int64_t i = 0; i < n && !rc; i++) {
        const char *key = keys[i];
        if (!key || ckpt__check_key(key, name) != CKPT_OK) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: chunk %" PRId64 " has an invalid key", name, i);
            break;
        }
        rc = ckpt__chunk_check(&chunks[i], CKPT_ECORRUPT, name, key, NULL);
        if (rc) break;
        if (!absent && (rc = chunk_in_file(&h, &ix, where, name, key, &chunks[i], i)) != 0) break;
        const entry *e = reader_get(r, key);
        if (e && !e->sk) {
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: '%s' is both a sharded tensor and a plain entry of %s", name, key,
                           r->name);
            break;
        }
        if (e) {
            const ckpt_chunk *c0 = &r->skeys[e->sk - 1].chunks[0].c;
            bool agree = c0->dtype == chunks[i].dtype && c0->ndim == chunks[i].ndim;
            for (int d = 0; agree && d < c0->ndim; d++)
                agree = c0->global_shape[d] == chunks[i].global_shape[d];
            if (!agree) {
                rc = ckpt__err(CKPT_ECORRUPT,
                               "%s: chunk of '%s' is of a %s %s tensor, %s says %s %s", name, key,
                               ckpt_dtype_name(chunks[i].dtype),
                               ckpt__shape_str(a, sizeof a, chunks[i].ndim, chunks[i].global_shape),
                               r->skeys[e->sk - 1].chunks[0].file, ckpt_dtype_name(c0->dtype),
                               ckpt__shape_str(b, sizeof b, c0->ndim, c0->global_shape));
                break;
            }
        }
    }
    if (rc) goto out;
    /* Reserve room, then apply (nothing can fail after this). */
    rc = grow((void **)&r->shard_files, &r->sfcap, r->nshard_files + 1, sizeof *r->shard_files);
    if (!rc) rc = grow((void **)&r->entries, &r->ecap, r->count + n, sizeof *r->entries);
    if (!rc) rc = grow((void **)&r->skeys, &r->skcap, r->nskeys + n, sizeof *r->skeys);
    if (rc) goto out;
    r->shard_files[r->nshard_files++] = fname;
    for (int64_t i = 0; i < n; i++) {
        const ckpt_st_tensor *ft = absent ? NULL : &h.tensors[key_index_get(&ix, keys[i])];
        const entry *e = reader_get(r, keys[i]);
        shard_key *k;
        if (e) {
            k = &r->skeys[e->sk - 1];
        } else {
            k = &r->skeys[r->nskeys];
            memset(k, 0, sizeof *k);
            k->key = ckpt__strdup(keys[i]);
            if (!k->key) {
                rc = ckpt__err_nomem("shard attach");
                goto out_applied;
            }
            entry *ne = &r->entries[r->count];
            memset(ne, 0, sizeof *ne);
            ne->key = k->key;
            ne->kind = CKPT_ENTRY_TENSOR;
            ne->dtype = chunks[i].dtype;
            ne->ndim = chunks[i].ndim;
            memcpy(ne->shape, chunks[i].global_shape, sizeof ne->shape);
            (void)ckpt_tensor_nbytes(ne->dtype, ne->ndim, ne->shape, &ne->nbytes);
            ne->sk = r->nskeys + 1;
            r->nskeys++;
            if (key_index_put(&r->index, k->key, r->count, NULL) != CKPT_OK) {
                rc = ckpt__err_nomem("shard attach");
                goto out_applied;
            }
            r->count++;
        }
        rc = grow((void **)&k->chunks, &k->cap, k->n + 1, sizeof *k->chunks);
        if (rc) goto out_applied;
        shard_chunk *sc = &k->chunks[k->n++];
        sc->c = chunks[i];
        sc->data =
            ft && ft->end > ft->begin ? (const uint8_t *)buf + h.data_start + ft->begin : NULL;
        sc->stream = stream && stream[i] >= 0 ? stream[i] : -1;
        sc->absent = absent && sc->stream < 0;
        sc->file = fname;
    }
    fname = NULL;
    goto out;
out_applied:
    /* Only an allocation failed; r holds some of the file's chunks: the
     * caller frees it (documented). */
    fname = NULL;
out:
    free(fname);
    free(where);
    key_index_free(&ix);
    ckpt__st_header_free(&h);
    return rc;
}

/* A file's bytes [off, off + n) into memory behind ops, through one buffer
 * of at most a piece. */
static int pread_to_mem(const ckpt_reader *r, const char *key, const ckpt_dst *dst, uint64_t n,
                        uint64_t off) {
    uint64_t cap = 0;
    uint8_t *buf = ckpt__mem_bounce(n, &cap, "memory ops buffer");
    if (!buf) return CKPT_ENOMEM;
    int rc = CKPT_OK;
    for (uint64_t at = 0; rc == 0 && at < n; at += cap) {
        uint64_t k = n - at < cap ? n - at : cap;
        rc = pread_all(r, buf, k, off + at);
        if (rc) rc = ckpt__err_prefix(rc, "tensor '%s'", key);
        else rc = ckpt__dst_put(dst, at, buf, k);
    }
    free(buf);
    return rc;
}

/* Entry e, read converted from e->conv_from, into memory behind ops: each
 * piece converted into one buffer, then put. */
static int convert_to_mem(const entry *e, const ckpt_dst *dst) {
    uint64_t out_es = (uint64_t)ckpt_dtype_bits(e->dtype) / 8;
    uint64_t in_es = (uint64_t)ckpt_dtype_bits(e->conv_from) / 8;
    uint64_t cap = 0;
    uint8_t *buf = ckpt__mem_bounce(e->nbytes, &cap, "memory ops buffer");
    if (!buf) return CKPT_ENOMEM;
    uint64_t n = e->nbytes / out_es, per = cap / out_es ? cap / out_es : 1;
    int rc = CKPT_OK;
    for (uint64_t i = 0; rc == 0 && i < n; i += per) {
        uint64_t k = n - i < per ? n - i : per;
        rc = ckpt_dtype_convert(e->conv_from, (const uint8_t *)e->data + i * in_es, e->dtype, buf,
                                k);
        if (rc == 0) rc = ckpt__dst_put(dst, i * out_es, buf, k * out_es);
    }
    free(buf);
    return rc;
}

int ckpt_read_tensor(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                     const int64_t *shape, void *dst) {
    ckpt_dst d = ckpt__dst_host(dst);
    d.key = key;
    return ckpt__read_tensor_to(r, key, dt, ndim, shape, &d);
}

int ckpt_read_tensor_mem(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                         const int64_t *shape, const ckpt_memory_ops *ops, void *handle) {
    char what[CKPT_MAX_KEY + 32];
    snprintf(what, sizeof what, "%s: tensor '%s'", r ? r->name : "read tensor", key ? key : "?");
    CKPT_TRY(ckpt__mem_check_ops(ops, what));
    ckpt_dst d = ckpt__dst_host(NULL);
    d.mem = (ckpt_mem_ref){ops, handle, 0};
    d.key = key;
    return ckpt__read_tensor_to(r, key, dt, ndim, shape, &d);
}

int ckpt__read_tensor_to(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                         const int64_t *shape, const ckpt_dst *dst) {
    const entry *e = NULL;
    CKPT_TRY(find_tensor(r, key, &e));
    if (e->sk) {
        /* The whole of a sharded tensor: assembled from its chunks. */
        static const int64_t zero[CKPT_MAX_NDIM];
        return ckpt__read_tensor_shard_to(r, key, dt, ndim, shape, zero, shape, dst);
    }
    char a[200], b[200];
    if (dt != e->dtype)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': dtype %s in file, %s asked", r->name, key,
                         ckpt_dtype_name(e->dtype),
                         ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "(invalid)");
    bool same = ndim == e->ndim && (ndim == 0 || shape);
    for (int i = 0; same && i < ndim; i++) same = shape[i] == e->shape[i];
    if (!same) {
        if (ndim < 0 || ndim > CKPT_MAX_NDIM || (ndim > 0 && !shape))
            return ckpt__err(CKPT_EINVAL, "%s: key '%s': invalid shape asked (ndim %d)", r->name,
                             key, ndim);
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': shape %s in file, %s asked", r->name, key,
                         ckpt__shape_str(a, sizeof a, e->ndim, e->shape),
                         ckpt__shape_str(b, sizeof b, ndim, shape));
    }
    if (e->nbytes == 0) return CKPT_OK;
    if (!dst->host && !dst->mem.ops)
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': destination is NULL", r->name, key);
    if (e->data && e->conv_from && dst->mem.ops) return convert_to_mem(e, dst);
    if (e->data && e->conv_from) { /* converted straight into dst: no copy in between */
        uint64_t n = e->nbytes / (uint64_t)(ckpt_dtype_bits(e->dtype) / 8);
        return ckpt_dtype_convert(e->conv_from, e->data, e->dtype, dst->host, n);
    }
    if (e->data) /* an adapted reader's entry */
        return ckpt__dst_put(dst, 0, e->data, e->nbytes);
    if (r->vs) return verified_read(r, e, key, dst);
    if (r->mem) return ckpt__dst_put(dst, 0, r->mem + e->offset, e->nbytes);
    if (dst->mem.ops) return pread_to_mem(r, key, dst, e->nbytes, e->offset);
    int rc = pread_all(r, dst->host, e->nbytes, e->offset);
    if (rc) return ckpt__err_prefix(rc, "tensor '%s'", key);
    return CKPT_OK;
}

static int find_scalar(const ckpt_reader *r, const char *key, ckpt_entry_kind kind,
                       const entry **out) {
    if (!r || !key) return ckpt__err(CKPT_EINVAL, "read %s: NULL argument", kind_name(kind));
    const entry *e = reader_get(r, key);
    if (!e) return ckpt__err(CKPT_ENOENT, "%s: no key '%s'", r->name, key);
    if (e->kind != kind)
        return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': %s in file, %s asked", r->name, key,
                         kind_name(e->kind), kind_name(kind));
    *out = e;
    return CKPT_OK;
}

int ckpt_read_i64(ckpt_reader *r, const char *key, int64_t *v) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_I64, &e));
    if (v) *v = e->i64;
    return CKPT_OK;
}

int ckpt_read_u64(ckpt_reader *r, const char *key, uint64_t *v) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_U64, &e));
    if (v) *v = e->u64;
    return CKPT_OK;
}

int ckpt_read_f64(ckpt_reader *r, const char *key, double *v) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_F64, &e));
    if (v) *v = e->f64;
    return CKPT_OK;
}

int ckpt_read_str(ckpt_reader *r, const char *key, char *buf, size_t cap) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_STR, &e));
    if (!buf || cap < e->nbytes + 1)
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': string of %" PRIu64 " bytes needs %" PRIu64
                         " bytes of buffer, %zu given",
                         r->name, key, e->nbytes, e->nbytes + 1, buf ? cap : 0);
    memcpy(buf, e->str, (size_t)e->nbytes + 1);
    return CKPT_OK;
}

int ckpt_read_bytes(ckpt_reader *r, const char *key, void *buf, size_t cap, size_t *n) {
    const entry *e = NULL;
    CKPT_TRY(find_scalar(r, key, CKPT_ENTRY_BYTES, &e));
    if (n) *n = (size_t)e->nbytes;
    if (e->nbytes > cap || (!buf && e->nbytes))
        return ckpt__err(CKPT_EINVAL, "%s: key '%s': %" PRIu64 " bytes, buffer holds %zu", r->name,
                         key, e->nbytes, buf ? cap : 0);
    if (e->nbytes) memcpy(buf, e->bytes, (size_t)e->nbytes);
    return CKPT_OK;
}
