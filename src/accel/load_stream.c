/* load_stream.c — how the files of a checkpoint reach the ranks of a load
 * that need them (the read phase's second half, load_op.h), and the
 * replicated chunks every rank reads, streamed from their reader while the
 * objects read them (the check and apply phases). With one process nothing
 * here moves a byte.
 *
 * After every rank verified its share of the files and all agreed on the
 * checkpoint, which ranks need which files and chunks is shared (one
 * reduction of a value per chunk, one allgather of a byte per file). A chunk
 * every rank reads (a replicated tensor's part, a large model file's
 * tensor, a Hugging Face part's) is streamed: it stays with its file's
 * reader and reaches the others a window at a time while the objects read
 * it (ckpt__load_fetch). Each other file a rank needs goes from its reader
 * to it whole (send_file). So a rank holds the files it read and those it
 * needs for other than replicated tensors, never the whole checkpoint's. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/load_held.h"
#include "accel/load_int.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/safetensors.h"
#include "format/shard.h"
#include "format/statedict.h"

#include <xxhash.h>

/* Bytes per transfer: what a rank holds beyond the files it needs. */
#define SHARE_PIECE ((size_t)16 << 20)

/* Whether object o reads its keys under other names or types than its
 * schema's (ckpt_load_state_ex's adaptations): then every chunk of its
 * shard files may be read. */
static bool adapted(const ckpt__load_op *op, const ckpt_acc_obj *o) {
    const ckpt_load_options *opt = op->opt;
    if (!opt || (o->kind != K_MODEL && o->kind != K_CUSTOM)) return false;
    return opt->rename || opt->num_prefix_map > 0 || opt->non_strict || opt->convert_dtypes;
}

/* Whether f is a part of a model saved as Hugging Face shards: a model's
 * shard-named file without chunk records. */
bool ckpt__load_is_hf_part(const ckpt_manifest_file *f) {
    return !f->chunks && strcmp(f->kind, ckpt__kind_name[K_MODEL]) == 0 &&
           ckpt__acc_is_shard_of(f->name, NULL);
}

/* A model's own file of at least this many bytes is streamed tensor by
 * tensor rather than sent whole (the trainable tensors of a model with
 * frozen ones, a checkpoint saved by one process): smaller ones, a few
 * small tensors, go whole in one transfer. */
#define STREAM_FILE_MIN ((uint64_t)4 << 20)

/* Whether f is such a model file: a model's plain file, not a shard. */
static bool is_big_model_file(const ckpt_manifest_file *f) {
    size_t n = strlen(f->name);
    return !f->chunks && f->size >= STREAM_FILE_MIN &&
           strcmp(f->kind, ckpt__kind_name[K_MODEL]) == 0 &&
           !ckpt__acc_is_shard_of(f->name, NULL) && n > 12 &&
           strcmp(f->name + n - 12, ".safetensors") == 0;
}

/* Whether file f's tensors are numbered as chunks: shard files, and the
 * files a model reads every tensor of whole (the parts of a model saved as
 * Hugging Face shards, a large model file), each tensor a chunk. */
bool ckpt__load_has_chunks(const ckpt_manifest_file *f) {
    return f->chunks || ((ckpt__load_is_hf_part(f) || is_big_model_file(f)) && f->tensor_keys);
}

/* Whether chunk c can be streamed: bytes of whole elements, some of them. */
static bool streamable(const ckpt_chunk *c) {
    int bits = ckpt_dtype_bits(c->dtype);
    uint64_t n = 0;
    return bits > 0 && bits % 8 == 0 && ckpt_tensor_nbytes(c->dtype, c->ndim, c->shape, &n) == 0 &&
           n > 0;
}

/* Which files of the opened checkpoint this rank needs (need[j]): for each
 * selected object, its file and, of its shard files, those holding a chunk
 * that meets a slice the object reads (its schema: ckpt_write_tensor_shard
 * puts its own slice; a tensor put whole needs every chunk of its key). A
 * model saved as Hugging Face shards needs every part. Files of objects not
 * selected, and other ranks' generators, are not needed. Conservative: what
 * cannot be decided (an object's state_dict fails, which the check reports
 * later) is needed. Per chunk of the shard files whose chunks were looked
 * at (cneed, by op->cbase): 0 not needed, 1 needed and streamable, 2 needed
 * and not. */
static int find_needs(ckpt__load_op *op, bool *need, uint8_t *cneed) {
    const ckpt_manifest *m = &op->c.m;
    for (int64_t j = 0; j < m->nfiles; j++) need[j] = true;
    char name[96];
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        if (o->kind == K_RNG) continue;
        ckpt__load_file_name(op, o, name, sizeof name);
        bool main_file = false;
        for (int64_t j = 0; j < m->nfiles; j++) main_file |= strcmp(m->files[j].name, name) == 0;
        if (!main_file && o->kind == K_MODEL && op->sel[i] && !adapted(op, o)) {
            /* saved as Hugging Face shards: every tensor of every part is
             * read whole, and can be streamed */
            for (int64_t j = 0; j < m->nfiles; j++)
                for (int64_t k = 0;
                     ckpt__load_is_hf_part(&m->files[j]) && ckpt__load_has_chunks(&m->files[j]) &&
                     ckpt__acc_is_shard_of(m->files[j].name, name) && k < m->files[j].ntensors;
                     k++)
                    cneed[op->cbase[j] + k] = 1;
        }
        if (!main_file) continue; /* Hugging Face parts, or no file: all needed */
        ckpt_writer *schema = NULL;
        bool all = adapted(op, o);
        if (op->sel[i] && !all) {
            CKPT_TRY(ckpt_writer_new_schema(&schema));
            ckpt_clear_error();
            all = o->ops->state_dict(o->self, schema) != 0;
            ckpt_clear_error();
        }
        for (int64_t j = 0; j < m->nfiles; j++) {
            const ckpt_manifest_file *f = &m->files[j];
            bool shard = ckpt__acc_is_shard_of(f->name, name);
            if (!shard && strcmp(f->name, name) != 0) continue;
            if (!op->sel[i]) {
                need[j] = false;
                continue;
            }
            if (!shard && !all && o->kind == K_MODEL && ckpt__load_has_chunks(f)) {
                /* a large model file: every tensor read whole, streamable */
                for (int64_t k = 0; k < f->ntensors; k++) cneed[op->cbase[j] + k] = 1;
                continue;
            }
            if (!shard || all || !f->chunks) continue;
            need[j] = false;
            for (int64_t k = 0; k < f->ntensors; k++) {
                const ckpt_chunk *ch = &f->chunks[k];
                bool known = false;
                bool n = ckpt__schema_needs_chunk(schema, f->tensor_keys[k], ch, &known);
                /* streamed only where the schema says this rank reads it:
                 * a guess (a key the schema lacks) is sent, not streamed */
                cneed[op->cbase[j] + k] = !n ? 0 : known && streamable(ch) ? 1 : 2;
                need[j] |= n;
            }
        }
        ckpt_writer_free(schema);
    }
    return CKPT_OK;
}

/* One file's bytes from its reader to the ranks in to[] (n of them, the
 * reader not among them), in pieces of SHARE_PIECE bytes: broadcast when
 * every other rank needs it, else gathered at each receiver in turn (the
 * reader the only rank sending). buf: the reader's bytes there, the
 * receiver's buffer at a receiver. Every rank calls it alike; after a
 * failure the rest of the pieces still travel (the collectives stay
 * paired) and the first failure is returned. */
static int send_file(const ckpt_comm *c, const ckpt_manifest_file *f, int from, uint8_t *buf,
                     const int *to, int n, size_t *lens) {
    int rc = CKPT_OK;
    if (n == c->size - 1) {
        for (uint64_t off = 0; off < f->size; off += SHARE_PIECE) {
            size_t k = f->size - off < SHARE_PIECE ? (size_t)(f->size - off) : SHARE_PIECE;
            int crc = c->bcast(c->ctx, buf + off, k, from);
            if (crc < 0 && rc == 0)
                rc = ckpt__err_prefix(crc, "load_state: %s: communicator: bcast", f->name);
        }
        return rc;
    }
    for (int t = 0; t < n; t++) {
        for (uint64_t off = 0; off < f->size; off += SHARE_PIECE) {
            size_t k = f->size - off < SHARE_PIECE ? (size_t)(f->size - off) : SHARE_PIECE;
            void *out = NULL;
            bool me = c->rank == from;
            int crc = c->gather(c->ctx, me ? buf + off : NULL, me ? k : 0, &out, lens, to[t]);
            if (crc == 0 && c->rank == to[t]) {
                ckpt__load_held_add(k); /* the piece, until copied into place */
                if (lens[from] == k) memcpy(buf + off, out, k);
                else
                    crc = ckpt__err(CKPT_EIO, "gather: %zu bytes from rank %d, %zu expected",
                                    lens[from], from, k);
                ckpt__load_held_sub(k);
            }
            free(out);
            if (crc < 0 && rc == 0)
                rc = ckpt__err_prefix(crc, "load_state: %s: communicator: gather", f->name);
        }
    }
    return rc;
}

/* Numbers every chunk of the opened checkpoint's shard files (op->cbase,
 * op->cfile, op->nchunks), in manifest order: the same on every rank. */
static int number_chunks(ckpt__load_op *op) {
    const ckpt_manifest *m = &op->c.m;
    int64_t nf = m->nfiles, n = 0;
    free(op->cbase);
    free(op->cfile);
    op->cfile = NULL;
    op->cbase = ckpt__calloc((size_t)(nf ? nf : 1), sizeof *op->cbase);
    if (!op->cbase) return ckpt__err_nomem("load: chunk plan");
    for (int64_t j = 0; j < nf; j++) {
        op->cbase[j] = n;
        if (ckpt__load_has_chunks(&m->files[j])) n += m->files[j].ntensors;
    }
    op->nchunks = n;
    op->cfile = ckpt__calloc((size_t)(n ? n : 1), sizeof *op->cfile);
    if (!op->cfile) return ckpt__err_nomem("load: chunk plan");
    for (int64_t j = 0; j < nf; j++)
        for (int64_t k = 0; ckpt__load_has_chunks(&m->files[j]) && k < m->files[j].ntensors; k++)
            op->cfile[op->cbase[j] + k] = j;
    return CKPT_OK;
}

/* Which chunks are streamed: those every rank needs and can stream (the
 * minimum over the ranks, one reduction of a value per chunk). A rank then
 * needs a shard file before the check only for the chunks it needs that are
 * not streamed. */
static int choose_streamed(ckpt__load_op *op, bool *need, const uint8_t *cneed) {
    const ckpt_comm *c = op->comm;
    const ckpt_manifest *m = &op->c.m;
    int64_t n = op->nchunks;
    op->streamed = ckpt__calloc((size_t)(n ? n : 1), sizeof *op->streamed);
    int64_t *v = ckpt__calloc((size_t)(n ? n : 1), sizeof *v);
    int rc = op->streamed && v ? CKPT_OK : ckpt__err_nomem("load: chunk plan");
    rc = ckpt__coll_agree(c, rc, NULL);
    for (int64_t k = 0; k < n && rc == 0; k++) v[k] = cneed[k] == 1;
    /* one reduction per million chunks: the count is an int */
    for (int64_t at = 0; at < n && rc == 0; at += 1 << 20) {
        int k = n - at < (1 << 20) ? (int)(n - at) : 1 << 20;
        int crc = c->allreduce_i64(c->ctx, v + at, k, CKPT_REDUCE_MIN);
        if (crc < 0) rc = ckpt__err_prefix(crc, "load_state: communicator: allreduce");
    }
    rc = ckpt__coll_agree(c, rc, NULL);
    for (int64_t k = 0; k < n && rc == 0; k++) {
        op->streamed[k] = v[k] == 1;
        op->nstreamed += op->streamed[k];
    }
    for (int64_t j = 0; j < m->nfiles && rc == 0; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        bool looked = false, still = false;
        for (int64_t k = op->cbase[j]; ckpt__load_has_chunks(f) && k < op->cbase[j] + f->ntensors;
             k++) {
            looked |= cneed[k] != 0;
            still |= cneed[k] == 2 || (cneed[k] == 1 && !op->streamed[k]);
        }
        if (looked) need[j] = still;
    }
    free(v);
    return rc;
}

/* Whether some tensor of file j is streamed. */
bool ckpt__load_any_streamed(const ckpt__load_op *op, int64_t j) {
    const ckpt_manifest_file *f = &op->c.m.files[j];
    for (int64_t k = 0; op->streamed && ckpt__load_has_chunks(f) && k < f->ntensors; k++)
        if (op->streamed[op->cbase[j] + k]) return true;
    return false;
}

/* Where tensor `key` of file f sits in the manifest's list of f's tensors
 * (its chunk number, less f's first), or -1. */
static int64_t manifest_key(const ckpt_manifest_file *f, const char *key) {
    for (int64_t k = 0; k < f->ntensors; k++)
        if (strcmp(f->tensor_keys[k], key) == 0) return k;
    return -1;
}

/* The parsed header of whole-tensor file f (a Hugging Face part, a large
 * model file): from its bytes where this rank holds them, else from the
 * header its reader sent (share_headers); *held says which. */
static int whole_header(const ckpt__load_op *op, const ckpt_manifest_file *f, ckpt_st_header *h,
                        bool *held) {
    int64_t j = f - op->c.m.files;
    *held = !op->have || op->have[j];
    const uint8_t *bytes = *held ? op->c.maps[j].data : op->hdr ? op->hdr[j] : NULL;
    uint64_t len = *held ? op->c.maps[j].size : op->hdr_len ? op->hdr_len[j] : 0, hl = 0;
    memset(h, 0, sizeof *h);
    if (!bytes)
        return ckpt__err(CKPT_EMISMATCH,
                         "%s: %s: this process holds neither the part nor its header (the load "
                         "plan sends it neither)",
                         op->dir, f->name);
    if (len < 8) return ckpt__err(CKPT_ECORRUPT, "%s: no header", f->name);
    CKPT_TRY(ckpt__st_header_len(bytes, f->size, f->name, &hl));
    if (len < 8 + hl) return ckpt__err(CKPT_ECORRUPT, "%s: header cut short", f->name);
    return ckpt__st_parse(bytes + 8, hl, f->size, f->name, h);
}

/* The window's size (op->window_size): the largest streamed tensor or
 * chunk, at most SHARE_PIECE, at least 1 byte; a whole-tensor file's
 * tensors from its header (its bytes, or what share_headers sent). The same
 * on every rank: the same manifest, the same header bytes. A header that
 * does not parse counts nothing (the object's open reports it). */
static void size_window(ckpt__load_op *op) {
    const ckpt_manifest *m = &op->c.m;
    uint64_t most = 1;
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        if (!ckpt__load_any_streamed(op, j)) continue;
        for (int64_t k = 0; f->chunks && k < f->ntensors; k++) {
            const ckpt_chunk *ch = &f->chunks[k];
            uint64_t nb = 0;
            if (op->streamed[op->cbase[j] + k] &&
                ckpt_tensor_nbytes(ch->dtype, ch->ndim, ch->shape, &nb) == 0 && nb > most)
                most = nb;
        }
        if (f->chunks) continue;
        ckpt_st_header h;
        bool held;
        if (whole_header(op, f, &h, &held) != 0) {
            ckpt_clear_error();
            continue;
        }
        for (int64_t t = 0; t < h.ntensors; t++) {
            int64_t k = manifest_key(f, h.tensors[t].name);
            uint64_t nb = h.tensors[t].end - h.tensors[t].begin;
            if (k >= 0 && op->streamed[op->cbase[j] + k] && nb > most) most = nb;
        }
        ckpt__st_header_free(&h);
    }
    op->window_size = most < SHARE_PIECE ? (size_t)most : SHARE_PIECE;
}

/* The header of each Hugging Face part with streamed tensors goes from its
 * reader to the ranks that do not hold the part (its tensors' dtypes,
 * shapes and order: what a reader over the part needs besides the bytes),
 * its length first. Every rank takes every such part in turn. */
static int share_headers(ckpt__load_op *op) {
    const ckpt_comm *c = op->comm;
    const ckpt_manifest *m = &op->c.m;
    int64_t nf = m->nfiles;
    int rc = CKPT_OK, late = CKPT_OK; /* late: a header's transfer failed here */
    op->hdr = ckpt__calloc((size_t)(nf ? nf : 1), sizeof *op->hdr);
    op->hdr_len = ckpt__calloc((size_t)(nf ? nf : 1), sizeof *op->hdr_len);
    if (!op->hdr || !op->hdr_len) rc = ckpt__err_nomem("load: part headers");
    rc = ckpt__coll_agree(c, rc, NULL);
    for (int64_t j = 0; j < nf && rc == 0; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        if (f->chunks || !ckpt__load_has_chunks(f) || !ckpt__load_any_streamed(op, j)) continue;
        int root = op->reader[j];
        uint64_t len = 0;
        if (c->rank == root &&
            ckpt__st_header_len(op->c.maps[j].data, op->c.maps[j].size, f->name, &len) == 0)
            len += 8; /* the length, then the header */
        int crc = c->bcast(c->ctx, &len, sizeof len, root);
        rc = crc < 0 ? ckpt__err_prefix(crc, "load_state: %s: communicator: bcast", f->name) : 0;
        /* every rank goes on alike: the length is agreed on before it is used */
        rc = ckpt__coll_agree(c, rc, NULL);
        /* the root checked the header's length against the file; 0: it
         * could not read one (its parse of the part fails alike later) */
        if (rc < 0 || len == 0) continue;
        uint8_t *buf =
            c->rank == root ? (uint8_t *)(uintptr_t)op->c.maps[j].data : ckpt__malloc((size_t)len);
        rc = ckpt__coll_agree(c, buf ? CKPT_OK : ckpt__err_nomem(f->name), NULL);
        if (rc == 0) {
            crc = c->bcast(c->ctx, buf, (size_t)len, root);
            if (crc < 0 && late == 0)
                late = ckpt__err_prefix(crc, "load_state: %s: communicator: bcast", f->name);
        }
        if (c->rank == root || !buf) continue;
        if (rc < 0 || crc < 0 || op->have[j]) {
            free(buf); /* it holds the part itself */
            continue;
        }
        op->hdr[j] = buf;
        op->hdr_len[j] = len;
        op->held += len;
        ckpt__load_held_add(len);
    }
    return ckpt__coll_agree(c, rc < 0 ? rc : late, NULL);
}

/* After every rank verified its files of the chosen checkpoint (and all
 * agreed): which ranks need which files and chunks is shared (one reduction
 * of a value per chunk, one allgather of a byte per file). A chunk every
 * rank reads (a replicated tensor's part) is streamed: it stays with its
 * file's reader, and reaches the others while the objects read it (fetch),
 * a window at a time. Each other file a rank needs goes from its reader to
 * it (send_file), into a buffer of the receiving rank's (freed with the
 * checkpoint). So a rank holds the files it read and those it needs for
 * other than replicated tensors, never the whole checkpoint's. The sizes are
 * the manifest's, which every rank checked against the file. */
int ckpt__load_share_files(ckpt__load_op *op) {
    const ckpt_comm *c = op->comm;
    if (c->size <= 1 || !op->reader) return CKPT_OK;
    static const uint8_t empty = 0;
    int64_t nf = op->c.m.nfiles;
    int q = c->size;
    size_t nb = (size_t)(nf ? nf : 1);
    free(op->have);
    op->have = ckpt__calloc(nb, sizeof *op->have);
    bool *need = ckpt__calloc(nb, sizeof *need);
    uint8_t *mine = ckpt__calloc(nb, 1), *all = ckpt__calloc((size_t)q * nb, 1), *cneed = NULL;
    size_t *lens = ckpt__calloc((size_t)q, sizeof *lens);
    int *to = ckpt__calloc((size_t)q, sizeof *to);
    int rc = op->have && need && mine && all && lens && to ? CKPT_OK
                                                           : ckpt__err_nomem("load: share plan");
    if (rc == 0) rc = number_chunks(op);
    if (rc == 0 && !(cneed = ckpt__calloc((size_t)(op->nchunks ? op->nchunks : 1), 1)))
        rc = ckpt__err_nomem("load: share plan");
    if (rc == 0) rc = find_needs(op, need, cneed);
    /* Agreed on first so that no rank drops out of the reduction. */
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc == 0) rc = choose_streamed(op, need, cneed);
    /* Every rank's needs on every rank. */
    if (rc == 0) {
        for (int64_t j = 0; j < nf; j++) mine[j] = need[j];
        for (int r = 0; r < q; r++) lens[r] = nb;
        int crc = c->allgather(c->ctx, mine, all, lens);
        if (crc < 0) rc = ckpt__err_prefix(crc, "load_state: communicator: allgather");
        rc = ckpt__coll_agree(c, rc, NULL);
    }
    /* Every buffer, agreed on, so that no rank drops out of the transfers. */
    for (int64_t j = 0; j < nf && rc == 0; j++) {
        const ckpt_manifest_file *f = &op->c.m.files[j];
        ckpt_mapped *mp = &op->c.maps[j];
        op->have[j] = op->reader[j] == c->rank;
        if (!op->shared[j] || c->rank == op->reader[j] || !all[(size_t)c->rank * nb + (size_t)j])
            continue;
        uint8_t *buf = NULL;
        if (f->size > 0 && (f->size > (uint64_t)SIZE_MAX || !(buf = ckpt__malloc((size_t)f->size))))
            rc = ckpt__err_nomem(f->name);
        mp->heap = buf;
        mp->data = buf ? buf : &empty;
        mp->size = buf ? f->size : 0;
        op->have[j] = true;
        op->held += mp->size;
        ckpt__load_held_add(mp->size);
    }
    rc = ckpt__coll_agree(c, rc, NULL);
    /* Every rank takes every file in turn, whatever failed on the way. */
    bool go = rc == 0;
    for (int64_t j = 0; j < nf && go; j++) {
        if (!op->shared[j]) continue;
        int n = 0;
        for (int r = 0; r < q; r++)
            if (r != op->reader[j] && all[(size_t)r * nb + (size_t)j]) to[n++] = r;
        if (n == 0) continue;
        uint8_t *buf = (uint8_t *)(uintptr_t)op->c.maps[j].data; /* the root's is only read */
        int src = send_file(c, &op->c.m.files[j], op->reader[j], buf, to, n, lens);
        if (src < 0 && rc == 0) rc = src;
    }
    free(need);
    free(mine);
    free(all);
    free(cneed);
    free(lens);
    free(to);
    /* the transfers' failures are each rank's own: agreed first */
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc == 0) rc = share_headers(op);
    /* The window streamed pieces land in, on every rank, before any is
     * streamed: a rank without one could not take part. */
    if (rc == 0 && op->nstreamed) {
        size_window(op);
        op->window = ckpt__malloc(op->window_size);
        if (op->window) {
            op->held += op->window_size;
            ckpt__load_held_add(op->window_size);
        }
        rc = ckpt__coll_agree(c, op->window ? CKPT_OK : ckpt__err_nomem("load: window"), NULL);
    }
    return rc;
}

/* What a rank asks for in a round of the streaming: a chunk's number, or
 * STREAM_DONE when it has read everything it reads (or stopped). */
#define STREAM_DONE (-1)

/* One round: every rank says what it asks for (one reduction of two
 * values); *lo and *hi get the smallest and largest request. */
static int stream_round(const ckpt_comm *c, int64_t ask, int64_t *lo, int64_t *hi) {
    int64_t v[2] = {ask, -ask};
    int crc = c->allreduce_i64(c->ctx, v, 2, CKPT_REDUCE_MAX);
    if (crc < 0) return ckpt__err_prefix(crc, "communicator: allreduce");
    *hi = v[0];
    *lo = -v[1];
    return CKPT_OK;
}

/* How many times a streamed chunk is sent again after a transfer that
 * failed on some rank. */
#define STREAM_RETRIES 2

/* The reader's fetch (ckpt__reader_set_fetch) of a streamed chunk: every
 * rank asks for the same chunk at the same point (it reads the same
 * replicated keys in the same order); the chunk's file's reader then
 * broadcasts it in pieces of SHARE_PIECE bytes (whole elements), each put
 * where the read wants it, and a receiving rank checks the bytes against
 * the manifest's digest of the chunk. A rank whose request differs from the
 * others' (it stopped, or reads in another order) makes every rank's
 * request fail, without any bytes moved, so no rank waits on a transfer
 * the others never start. */
int ckpt__load_fetch(void *ctx, int64_t id, const void *local, uint64_t nbytes, size_t group,
                     ckpt__piece_fn put, void *put_ctx) {
    ckpt__load_op *op = ctx;
    const ckpt_comm *c = op->comm;
    int64_t lo = 0, hi = 0;
    CKPT_TRY(stream_round(c, id, &lo, &hi));
    if (lo != hi) {
        if (lo == STREAM_DONE) {
            op->echo = true;
            return ckpt__err(CKPT_EINVAL,
                             "another rank finished or stopped reading before this chunk "
                             "(if it failed, its failure is the load's; if not, the ranks read "
                             "replicated state differently)");
        }
        return ckpt__err(CKPT_EINVAL,
                         "the ranks read replicated state in different orders (chunk %" PRId64
                         " here, %" PRId64 " on some rank): every rank must register the same "
                         "objects and read them alike",
                         id, lo == id ? hi : lo);
    }
    if (id < 0 || id >= op->nchunks || !op->streamed[id])
        return ckpt__err(CKPT_EINVAL, "chunk %" PRId64 " is not streamed", id);
    int64_t j = op->cfile[id], k = id - op->cbase[j];
    const ckpt_manifest_file *f = &op->c.m.files[j];
    int root = op->reader[j];
    bool me = c->rank == root;
    size_t piece = op->window_size / group * group;
    if (piece == 0 || !op->window) /* the same on every rank: the plan is */
        return ckpt__err(CKPT_EINVAL, "chunk %" PRId64 " does not fit the window", k);
    /* After a failure the pieces still travel (the broadcasts stay paired);
     * the first failure is returned. A root without the bytes (it read the
     * file, so never) sends the window's, which the receivers' digest
     * refuses. A chunk that did not arrive whole on some rank (the
     * transport failed, or the bytes differ from the manifest's digest, the
     * root's copy being verified) is sent again, to every rank, up to
     * STREAM_RETRIES times: the objects may be loading (apply), and a
     * transfer that failed on one rank must not leave it alone half loaded. */
    XXH3_state_t *h = me ? NULL : XXH3_createState();
    for (int attempt = 0;; attempt++) {
        int rc = me && !local
                     ? ckpt__err(CKPT_EINVAL, "chunk %" PRId64 " not held by its reader", k)
                     : 0;
        bool again = false; /* this rank's failure is one a new transfer may cure */
        if (h) XXH3_64bits_reset(h);
        for (uint64_t off = 0; off < nbytes; off += piece) {
            size_t n = nbytes - off < piece ? (size_t)(nbytes - off) : piece;
            uint8_t *p = me && local ? (uint8_t *)(uintptr_t)local + off : op->window;
            int crc = c->bcast(c->ctx, p, n, root);
            if (crc < 0 && rc == 0) {
                rc = ckpt__err_prefix(crc, "communicator: bcast from rank %d", root);
                again = crc != CKPT_ETIMEDOUT;
            }
            if (rc == 0 && h) XXH3_64bits_update(h, p, n);
            if (rc == 0) rc = put(put_ctx, p, off, n);
        }
        if (rc == 0 && !me && f->tensor_xxh3 && k < f->ntensors &&
            (!h || XXH3_64bits_digest(h) != f->tensor_xxh3[k])) {
            rc = h ? ckpt__err(CKPT_ECORRUPT,
                               "chunk %" PRId64 " received from rank %d differs from the "
                               "manifest's digest",
                               k, root)
                   : ckpt__err_nomem("chunk digest");
            again = h != NULL;
        }
        /* every rank: is a new transfer wanted, and would it be enough */
        int64_t v[2] = {rc < 0 && again, rc < 0 && !again};
        int crc = c->allreduce_i64(c->ctx, v, 2, CKPT_REDUCE_MAX);
        if (crc < 0 && rc == 0) rc = ckpt__err_prefix(crc, "communicator: allreduce");
        if (crc < 0 || !v[0] || v[1] || attempt == STREAM_RETRIES) {
            XXH3_freeState(h);
            return rc;
        }
    }
}

/* The end of a phase whose objects may have read streamed chunks: every
 * rank says it is done, and answers the requests of ranks still reading
 * (each such request fails, see fetch) until every rank is done. Returns
 * the communicator's failure, if any. */
int ckpt__load_stream_end(ckpt__load_op *op) {
    if (!op->nstreamed) return CKPT_OK;
    for (;;) {
        int64_t lo = 0, hi = 0;
        CKPT_TRY(stream_round(op->comm, STREAM_DONE, &lo, &hi));
        if (hi == STREAM_DONE) return CKPT_OK;
    }
}

/* Makes file f (a part of a model saved as Hugging Face shards, or a large
 * model file) readable through r, each tensor a whole chunk of its own (its
 * dtype and shape from the file's header: the file's bytes where this rank
 * holds them, else the header its reader sent), the streamed ones read
 * through fetch. */
int ckpt__load_attach_whole(ckpt__load_op *op, ckpt_reader *r, const ckpt_manifest_file *f) {
    int64_t j = f - op->c.m.files;
    ckpt_st_header h;
    bool held;
    int rc = whole_header(op, f, &h, &held);
    size_t n = (size_t)(h.ntensors ? h.ntensors : 1);
    const char **keys = rc ? NULL : ckpt__calloc(n, sizeof *keys);
    ckpt_chunk *chunks = rc ? NULL : ckpt__calloc(n, sizeof *chunks);
    int64_t *ids = rc ? NULL : ckpt__calloc(n, sizeof *ids);
    if (rc == 0 && (!keys || !chunks || !ids)) rc = ckpt__err_nomem("load: part");
    for (int64_t t = 0; t < h.ntensors && rc == 0; t++) {
        const ckpt_st_tensor *st = &h.tensors[t];
        keys[t] = st->name;
        chunks[t].dtype = st->dtype;
        chunks[t].ndim = st->ndim;
        for (int d = 0; d < st->ndim; d++)
            chunks[t].global_shape[d] = chunks[t].shape[d] = st->shape[d];
        int64_t k = manifest_key(f, st->name);
        if (k < 0)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s: tensor '%s' is not in the manifest's list of it",
                           op->dir, f->name, st->name);
        else ids[t] = op->streamed && op->streamed[op->cbase[j] + k] ? op->cbase[j] + k : -1;
    }
    if (rc == 0)
        rc = ckpt__reader_attach_shard(r, held ? op->c.maps[j].data : NULL,
                                       held ? (size_t)op->c.maps[j].size : 0, f->name, keys, chunks,
                                       h.ntensors, ids);
    free(keys);
    free(chunks);
    free(ids);
    ckpt__st_header_free(&h);
    return rc;
}

void ckpt__load_stream_free(ckpt__load_op *op) {
    free(op->have);
    op->have = NULL;
    for (int64_t j = 0; op->hdr && j < op->c.m.nfiles; j++) free(op->hdr[j]);
    free(op->hdr);
    free(op->hdr_len);
    op->hdr = NULL;
    op->hdr_len = NULL;
    free(op->cbase);
    free(op->cfile);
    free(op->streamed);
    free(op->window);
    op->cbase = op->cfile = NULL;
    op->streamed = NULL;
    op->window = NULL;
    op->nchunks = op->nstreamed = 0;
}
