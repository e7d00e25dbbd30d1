/* statedict_int.h — internals shared by the files of the state-dict writer
 * and reader (statedict*.c): the entry record, the writer and reader
 * structures, the key index, and small helpers (static inline so that each
 * file keeps calling them by their short names). Nothing outside
 * src/format/statedict*.c includes it. */
#ifndef CKPT_STATEDICT_INT_H
#define CKPT_STATEDICT_INT_H

#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "base/hashread.h"
#include "base/xxh.h"

#include "base/error.h"
#include "base/io.h"
#include "format/safetensors.h"
#include "format/shard.h"
#include "format/statedict.h"

/* Version of the __metadata__["ckpt"] document: the newest one read, and
 * the one written when the document holds no u64 or alias entry (which
 * version 2 added): files without them stay readable by version-1 readers,
 * and those readers refuse the others as too new rather than corrupt. */
#define CKPT_DOC_VERSION 2
#define CKPT_DOC_VERSION_BASE 1

/* ---- a small key -> index hash table ------------------------------------ */

typedef struct key_slot {
    const char *key; /* borrowed: owned by the writer/reader entry */
    int64_t index;
} key_slot;

typedef struct key_index {
    key_slot *slots;
    size_t cap; /* power of two, or 0 */
    size_t used;
} key_index;

static inline uint64_t hash_key(const char *s) {
    return ckpt__xxh3(s, strlen(s));
}

static inline int64_t key_index_get(const key_index *m, const char *key) {
    if (!m->cap) return -1;
    size_t mask = m->cap - 1;
    for (size_t i = (size_t)hash_key(key) & mask;; i = (i + 1) & mask) {
        if (!m->slots[i].key) return -1;
        if (strcmp(m->slots[i].key, key) == 0) return m->slots[i].index;
    }
}

/* Inserts key; returns CKPT_OK, CKPT_EEXIST (*existing set) or CKPT_ENOMEM
 * (without a message: callers say what they were doing). */
static inline int key_index_put(key_index *m, const char *key, int64_t index, int64_t *existing) {
    if ((m->used + 1) * 2 > m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 16;
        key_slot *ns = ckpt__calloc(ncap, sizeof *ns);
        if (!ns) return CKPT_ENOMEM;
        for (size_t j = 0; j < m->cap; j++) {
            if (!m->slots[j].key) continue;
            size_t i = (size_t)hash_key(m->slots[j].key) & (ncap - 1);
            while (ns[i].key) i = (i + 1) & (ncap - 1);
            ns[i] = m->slots[j];
        }
        free(m->slots);
        m->slots = ns;
        m->cap = ncap;
    }
    size_t mask = m->cap - 1;
    size_t i = (size_t)hash_key(key) & mask;
    for (; m->slots[i].key; i = (i + 1) & mask) {
        if (strcmp(m->slots[i].key, key) == 0) {
            if (existing) *existing = m->slots[i].index;
            return CKPT_EEXIST;
        }
    }
    m->slots[i].key = key;
    m->slots[i].index = index;
    m->used++;
    return CKPT_OK;
}

static inline void key_index_free(key_index *m) {
    free(m->slots);
    memset(m, 0, sizeof *m);
}

/* ---- shared entry record ------------------------------------------------ */

typedef struct entry {
    char *key;             /* writer: owned; reader: view */
    ckpt_entry_kind kind;
    ckpt_dtype dtype;
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    uint64_t nbytes;
    uint64_t offset;       /* reader tensors: absolute file offset */
    const void *data;      /* writer tensors: borrowed */
    ckpt_mem_ref mem;      /* writer tensors: mem.ops set: the bytes are behind memory ops
                              (data NULL) */
    int64_t i64;
    uint64_t u64;
    double f64;
    char *str;             /* writer: owned copy; reader: view into the doc; an alias's
                              target */
    uint8_t *bytes;        /* owned (both sides) */
    /* Sharded tensors: shape/nbytes above are the whole tensor's. */
    bool shard;                        /* writer: added with ckpt_write_tensor_shard */
    bool optional;                     /* writer: a schema check accepts a file without it */
    bool elsewhere;                    /* writer: spread, and another process writes all of it */
    bool shape_by_object;              /* writer: a schema check leaves its shape to the object */
    bool frozen;                       /* writer: a frozen parameter (ckpt__writer_set_frozen) */
    int64_t coff[CKPT_MAX_NDIM];       /* writer: this chunk's offsets */
    int64_t cshape[CKPT_MAX_NDIM];     /* writer: this chunk's shape */
    uint64_t cbytes;                   /* writer: this chunk's bytes */
    int64_t sk;                        /* reader: 1 + index into r->skeys, or 0 */
    ckpt_dtype conv_from;              /* adapted reader: data holds this dtype, converted to
                                          dtype as it is read (0: data is dtype already) */
} entry;

static inline const char *kind_name(ckpt_entry_kind k) {
    const char *n = ckpt_entry_kind_name(k);
    return n ? n : "?";
}

/* "tensor F32 [2,3]" / "i64" */
static inline const char *describe(char *buf, size_t cap, const entry *e) {
    if (e->kind == CKPT_ENTRY_ALIAS) {
        snprintf(buf, cap, "an alias of '%s'", e->str ? e->str : "?");
        return buf;
    }
    if (e->kind != CKPT_ENTRY_TENSOR) {
        snprintf(buf, cap, "%s", kind_name(e->kind));
        return buf;
    }
    char sb[200];
    snprintf(buf, cap, "tensor %s %s", ckpt_dtype_name(e->dtype),
             ckpt__shape_str(sb, sizeof sb, e->ndim, e->shape));
    return buf;
}

static inline void entry_info(const entry *e, ckpt_entry_info *info) {
    memset(info, 0, sizeof *info);
    info->key = e->key;
    info->kind = e->kind;
    info->dtype =
        e->kind == CKPT_ENTRY_TENSOR || e->kind == CKPT_ENTRY_ALIAS ? e->dtype : CKPT_DTYPE_INVALID;
    info->ndim = e->ndim;
    memcpy(info->shape, e->shape, sizeof info->shape);
    info->nbytes = e->nbytes;
    info->offset = e->offset;
    if (e->kind == CKPT_ENTRY_ALIAS) info->target = e->str;
}

/* ---- writer ------------------------------------------------------------- */

struct ckpt_writer {
    entry *entries;
    int64_t count, cap;
    key_index index;
    bool schema;
    uint64_t tensor_bytes; /* sum so far: data offsets must stay below 2^63 */
};

/* Whether a shard entry is written to this process's shard file. */
static inline bool shard_written(const entry *e) {
    return e->shard && !e->elsewhere && (e->cbytes > 0 || e->nbytes == 0);
}

/* Whether a shard entry's chunk is the whole tensor. */
static inline bool shard_is_whole(const entry *e) {
    for (int d = 0; d < e->ndim; d++)
        if (e->coff[d] != 0 || e->cshape[d] != e->shape[d]) return false;
    return true;
}

/* ---- reader ------------------------------------------------------------- */

/* One saved chunk of a sharded key, in an attached shard file. */
typedef struct shard_chunk {
    ckpt_chunk c;
    const uint8_t *data; /* into the attached buffer (borrowed) */
    const char *file;    /* r->shard_files[...] */
    bool absent;         /* listed by the manifest, but its file's bytes are not here
                            (ckpt__reader_attach_shard with buf NULL) */
    int64_t stream;      /* >= 0: its bytes come through r->fetch under this id */
} shard_chunk;

/* A sharded key: every chunk attached so far. */
typedef struct shard_key {
    char *key; /* owned; the entry's key points here */
    shard_chunk *chunks;
    int64_t n, cap;
} shard_key;

struct ckpt_reader {
    char *name;          /* for messages (owned) */
    int fd;              /* file readers: open for pread; -1 for memory */
    const uint8_t *mem;  /* memory readers: the buffer; file readers: the map once made */
    void *map;           /* mmap of the file (tensor views), or NULL */
    size_t map_len;
    uint64_t file_size;
    ckpt_st_header hdr;
    json_t *doc;         /* parsed __metadata__["ckpt"] (owned) or NULL */
    entry *entries;
    int64_t count, ecap;
    key_index index;
    shard_key *skeys;    /* sharded keys (ckpt__reader_attach_shard) */
    int64_t nskeys, skcap;
    char **shard_files;  /* names of the attached files (owned) */
    int64_t nshard_files, sfcap;
    ckpt_mapped *maps;   /* files the reader owns (ckpt__reader_adopt_map) */
    int64_t nmaps, mapcap;
    void **owned;        /* adapted readers: keys, strings, tensor copies (freed with r) */
    int64_t nowned, ownedcap;
    ckpt_reader **subs;  /* readers r borrows from and owns (ckpt__reader_adopt_reader) */
    int64_t nsubs, subcap;
    struct verify_stream *vs; /* a one-pass verified file reader (ckpt__reader_open_verified) */
    ckpt__fetch_fn fetch;     /* streamed chunks (ckpt__reader_set_fetch) */
    void *fetch_ctx;
};

/* A one-pass verified reader. By parts (the manifest records the header's
 * digest): the header is checked when the file is opened, each tensor
 * against its own digest as it lands in the caller's buffer, and the
 * tensors nobody read at the end; the header and the tensors tile the file
 * (the parser refuses holes), so that is every byte. Otherwise (older
 * manifests): the file's XXH3-64 computed over the bytes as they land in the
 * caller's buffers, in file order (the header and the padding through a
 * scratch piece); a tensor read out of that order is checked against its
 * own digest instead. */
typedef struct verify_stream {
    void *mem;             /* the allocation holding h (aligned) and scratch */
    XXH3_state_t *h;       /* the whole file, bytes [0, next) so far */
    XXH3_state_t *t;       /* one tensor read out of order */
    uint8_t *scratch;
    uint64_t next;
    uint64_t xxh3;         /* the manifest's digest of the file */
    const char *const *keys; /* the manifest's tensor keys and digests (borrowed) */
    const uint64_t *digests;
    int64_t n;
    bool by_parts;         /* header_xxh3 below is the manifest's digest of the header */
    uint64_t header_xxh3;
    /* By parts, per reader entry: its digest from the manifest (has: one is
     * recorded) and whether a read checked it. */
    uint64_t *edigest;
    bool *ehas, *edone;
    /* the reads' helper thread, kept for the reader's life (hashread.h) */
    ckpt__hashread_helper *helper;
} verify_stream;

static inline void verify_stream_free(verify_stream *vs) {
    if (!vs) return;
    ckpt__hashread_helper_free(vs->helper);
    free(vs->mem);
    free(vs->edigest);
    free(vs->ehas);
    free(vs->edone);
    free(vs);
}

/* Pieces small enough to be hashed while still in the CPU cache (its
 * second level: 512 KiB a core on the machine of bench/README.md). */
#define VERIFY_PIECE ((size_t)256 << 10)

static inline int reader_alloc(ckpt_reader **out, const char *name) {
    ckpt_reader *r = ckpt__calloc(1, sizeof *r);
    if (!r) return ckpt__err_nomem("reader");
    r->fd = -1;
    r->name = ckpt__strdup(name ? name : "(memory)");
    if (!r->name) {
        free(r);
        return ckpt__err_nomem("reader");
    }
    *out = r;
    return CKPT_OK;
}

/* Reads exactly n bytes at off; a short read means the file shrank. */
static inline int pread_all(const ckpt_reader *r, void *dst, uint64_t n, uint64_t off) {
    uint8_t *p = dst;
    while (n > 0) {
        /* 64 MiB calls: measured faster than one huge call (the copy
         * stays ahead of the kernel's page-cache walk). */
        size_t piece = n > ((size_t)64 << 20) ? ((size_t)64 << 20) : (size_t)n;
        ssize_t got = ckpt__os_pread(r->fd, p, piece, off);
        if (got < 0) return ckpt__err_os(errno, "%s: read at offset %" PRIu64, r->name, off);
        if (got == 0)
            return ckpt__err(CKPT_ECORRUPT, "%s: file ended at offset %" PRIu64 " while reading",
                             r->name, off);
        p += got;
        off += (uint64_t)got;
        n -= (uint64_t)got;
    }
    return CKPT_OK;
}

static inline const entry *reader_get(const ckpt_reader *r, const char *key) {
    int64_t i = key_index_get(&r->index, key);
    return i < 0 ? NULL : &r->entries[i];
}

static inline int grow(void **p, int64_t *cap, int64_t need, size_t elem) {
    if (need <= *cap) return CKPT_OK;
    int64_t nc = *cap ? *cap : 4;
    while (nc < need) nc *= 2;
    void *np = ckpt__realloc(*p, (size_t)nc * elem);
    if (!np) return ckpt__err_nomem("reader shards");
    *p = np;
    *cap = nc;
    return CKPT_OK;
}

static inline int reader_index_add(ckpt_reader *r, int64_t i) {
    int64_t prev = -1;
    int rc = key_index_put(&r->index, r->entries[i].key, i, &prev);
    if (rc == CKPT_ENOMEM) return ckpt__err_nomem("reader key index");
    if (rc == CKPT_EEXIST)
        return ckpt__err(CKPT_ECORRUPT, "%s: duplicate key '%s' (%s and %s)", r->name,
                         r->entries[i].key, kind_name(r->entries[prev].kind),
                         kind_name(r->entries[i].kind));
    return CKPT_OK;
}

/* r keeps p (freed with r); p is freed here if that fails. */
static inline int reader_own(ckpt_reader *r, void *p) {
    if (!p) return ckpt__err_nomem("adapted reader");
    if (grow((void **)&r->owned, &r->ownedcap, r->nowned + 1, sizeof *r->owned)) {
        free(p);
        return ckpt__err_nomem("adapted reader");
    }
    r->owned[r->nowned++] = p;
    return CKPT_OK;
}

/* Maps a file reader's file, once: loads that copy into caller buffers
 * never need it. */
static inline int reader_map(ckpt_reader *r) {
    if (!r->mem && r->fd >= 0 && r->file_size > 0) {
        void *p = ckpt__os_map_read(r->fd, (size_t)r->file_size);
        if (p == MAP_FAILED) return ckpt__err_os(errno, "%s: mmap", r->name);
        r->map = p;
        r->map_len = (size_t)r->file_size;
        r->mem = p;
    }
    return CKPT_OK;
}

/* The chunks of sharded key k must tile the tensor exactly. Checked at
 * every use rather than at attach time: only once every shard file is
 * attached is the set complete. */
static inline int shard_key_check(const ckpt_reader *r, const shard_key *k) {
    ckpt_chunk_ref *v = ckpt__calloc((size_t)(k->n ? k->n : 1), sizeof *v);
    if (!v) return ckpt__err_nomem("shard check");
    for (int64_t i = 0; i < k->n; i++) v[i] = (ckpt_chunk_ref){&k->chunks[i].c, k->chunks[i].file};
    int rc = ckpt__chunks_cover(v, k->n, CKPT_ECORRUPT, r->name, k->key);
    free(v);
    return rc;
}

/* An entry converted as it is read, made a plain one (converted once into a
 * buffer r owns) for the reads that need its bytes in place: views and
 * slices. */
static inline int materialize(ckpt_reader *r, const entry *ce) {
    entry *e = (entry *)ce; /* r's own entry */
    if (!e->conv_from) return CKPT_OK;
    uint8_t *buf = ckpt__malloc(e->nbytes ? (size_t)e->nbytes : 1);
    CKPT_TRY(reader_own(r, buf));
    uint64_t n = e->nbytes / (uint64_t)(ckpt_dtype_bits(e->dtype) / 8);
    CKPT_TRY(ckpt_dtype_convert(e->conv_from, e->data, e->dtype, buf, n));
    e->data = buf;
    e->conv_from = CKPT_DTYPE_INVALID;
    return CKPT_OK;
}

#endif
