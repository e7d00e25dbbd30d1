/* load.c — ckpt_load_state as explicit phases, the mirror of save.c, the
 * same for one process and for many:
 *
 *   choose   rank 0 lists the candidates, newest first; for each, every rank
 *            verifies what it will read (the manifest, the replicated and
 *            shard files, its own per-process file) and all agree: the first
 *            candidate every rank accepts is taken, a corrupt one is skipped
 *            by all ranks alike
 *   check    every rank matches its objects with the files, checks every
 *            schema and value (check_state_dict), changing nothing
 *   agree    nothing is applied anywhere unless every rank's checks passed
 *   apply    every rank loads its objects
 *   post     every rank runs the post-hooks
 *
 * Every rank returns the same status and message. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/load_held.h"
#include "base/error.h"
#include "base/io.h"
#include "format/hfindex.h"
#include "format/keymap.h"
#include "format/manifest.h"
#include "format/safetensors.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/store.h"
#include "train/rng.h"

#include <xxhash.h>

typedef struct load_op {
    ckpt_accelerator *acc;
    const ckpt_comm *comm;
    char *dir;
    ckpt_checkpoint_open c;
    ckpt_acc_obj *objs;
    int nobjs;
    ckpt_reader **readers;
    bool nothing; /* there is no checkpoint at all: the CKPT_ENOENT of a fresh start */
    /* The checkpoint was saved by another number of processes: this rank's
     * generator is derived from rank 0's (docs/DISTRIBUTED.md, "Reshard"). */
    bool rng_reshard;
    ckpt_rng_reshard rr;
    /* ckpt_load_state_ex: the options (NULL: everything, exactly), which
     * objects are selected, and whether that is all of them */
    const ckpt_load_options *opt;
    bool *sel;
    bool full;
    /* an adapted object: readers[i] is the adapted reader, srcs[i] the
     * file's, extra[i] what the adapted one also borrows from */
    ckpt_reader **srcs, **extra;
    ckpt_adapt_result res;
    /* The read plan of the candidate being opened (several processes): per
     * manifest file, the rank that reads and verifies it (-1: none, only
     * its presence and size are checked) and whether its bytes then go to
     * every rank. */
    int *reader;
    bool *shared;
    /* After share_files: whether this rank holds file j's bytes (NULL: all
     * of them); a shard file it does not hold is attached from the
     * manifest's records alone. */
    bool *have;
    /* Bytes of the opened candidate's files this rank holds (load_held.h). */
    uint64_t held;
    /* Streamed chunks (share_files, fetch): every chunk of the shard files
     * numbered in manifest order, file j's first at cbase[j] (cfile: each
     * chunk's file); streamed[c] says that every rank reads chunk c, so its
     * bytes go from its file's reader to all ranks while the objects read
     * it, through window on a receiving rank. */
    int64_t *cbase, *cfile, nchunks, nstreamed;
    bool *streamed;
    uint8_t *window;
    size_t window_size; /* SHARE_PIECE, or the largest streamed chunk if smaller */
    /* A Hugging Face part of a model (no chunk records: each tensor is a
     * chunk of its own) that this rank neither read nor was sent: its
     * header, broadcast by its reader (share_headers). */
    uint8_t **hdr;
    uint64_t *hdr_len;
    /* This rank stopped because another one did (its failure echoes). */
    bool echo;
    /* ckpt_load_options.one_pass, where it applies: the files are checked
     * shallowly at the choice and verified while the objects read them */
    bool one_pass;
} load_op;

/* ---- choose ---------------------------------------------------------------- */

typedef struct sized {
    uint64_t size;
    int64_t index;
} sized;

static int cmp_sized_desc(const void *a, const void *b) {
    const sized *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? 1 : -1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The rank that wrote f, where the manifest says: a process's shard file
 * by its number, any file by its "rank" from format version 2 on; -1 if
 * unknown. */
static int own_reader(const ckpt_manifest *m, const ckpt_manifest_file *f, int saved_np) {
    int index = 0, count = 0;
    if (f->chunks && ckpt__shard_file_parse(f->name, NULL, &index, &count) && count == saved_np)
        return index - 1;
    if (m->format_version >= CKPT_FORMAT_VERSION_SPREAD) return f->rank;
    return -1;
}

/* The read plan of many processes, the same on every rank (a function of
 * the manifest): each file is read and verified by one rank only. A rank's
 * own generator file is read by that rank (or, for another process count,
 * rank 0's by rank 0 for all). With as many processes as the save had, each
 * rank reads the files it wrote; otherwise the files, largest first, each go
 * to the rank with the fewest bytes so far (ties: the lowest rank). Their
 * bytes then reach the ranks that need them through the communicator
 * (share_files). Files a save pre-hook left (kind "extra") are verified,
 * not sent. */
static int plan_reads(load_op *op) {
    const ckpt_manifest *m = &op->c.m;
    int64_t n = m->nfiles;
    int q = op->comm->size;
    free(op->reader);
    free(op->shared);
    op->reader = ckpt__malloc((size_t)(n ? n : 1) * sizeof *op->reader);
    op->shared = ckpt__calloc((size_t)(n ? n : 1), sizeof *op->shared);
    sized *v = ckpt__calloc((size_t)(n ? n : 1), sizeof *v);
    uint64_t *load = ckpt__calloc((size_t)q, sizeof *load);
    if (!op->reader || !op->shared || !v || !load) {
        free(v);
        free(load);
        free(op->reader);
        free(op->shared);
        op->reader = NULL;
        op->shared = NULL;
        return ckpt__err_nomem("load plan");
    }
    int saved_np = m->num_processes > 0 ? m->num_processes : 1;
    bool reshard = saved_np != op->acc->num_processes;
    char mine[96];
    ckpt_acc_obj rng = {.kind = K_RNG};
    ckpt__acc_file_name(op->acc, &rng, mine, sizeof mine);
    int64_t nv = 0;
    for (int64_t j = 0; j < n; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        op->reader[j] = -1;
        if (strcmp(f->kind, ckpt__kind_name[K_RNG]) == 0) {
            /* Rank 0's generator is what every rank continues from when
             * the checkpoint was saved by another number of processes. */
            if (reshard && strcmp(f->name, "random_states_0.safetensors") == 0) {
                op->reader[j] = 0;
                op->shared[j] = true;
            } else if (!reshard && strcmp(f->name, mine) == 0) {
                op->reader[j] = op->comm->rank;
            }
            continue;
        }
        /* The same number of processes as at the save: each rank reads
         * the files it wrote (the save spread them by bytes), its own shard
         * files first of all. */
        int own = reshard ? -1 : own_reader(m, f, saved_np);
        if (own >= 0 && own < q) {
            op->reader[j] = own;
            op->shared[j] = strcmp(f->kind, "extra") != 0;
            load[own] += f->size;
            continue;
        }
        v[nv++] = (sized){f->size, j};
    }
    qsort(v, (size_t)nv, sizeof *v, cmp_sized_desc);
    for (int64_t k = 0; k < nv; k++) {
        int best = 0;
        for (int r = 1; r < q; r++)
            if (load[r] < load[best]) best = r;
        load[best] += v[k].size;
        op->reader[v[k].index] = best;
        op->shared[v[k].index] = strcmp(m->files[v[k].index].kind, "extra") != 0;
    }
    free(v);
    free(load);
    return CKPT_OK;
}

/* Which files this rank reads: called once per file, in order, right after
 * the manifest was parsed into op->c.m; the first call makes the plan. */
static bool rank_reads(const ckpt_manifest_file *f, void *ctx) {
    load_op *op = ctx;
    int64_t j = f - op->c.m.files;
    if (j == 0 && plan_reads(op) < 0) return true; /* no memory: read it, as before */
    return !op->reader || op->reader[j] < 0 ? false : op->reader[j] == op->comm->rank;
}

/* Whether every file of the opened checkpoint can be verified in one pass:
 * plain files (no Hugging Face index, no shard files of several
 * processes), each tensor with its digest in the manifest. */
static bool one_pass_fits(const ckpt_manifest *m) {
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        size_t n = strlen(f->name);
        if (f->chunks || (n > 11 && strcmp(f->name + n - 11, ".index.json") == 0)) return false;
        if (f->ntensors > 0 && (!f->tensor_keys || !f->tensor_xxh3)) return false;
    }
    return true;
}

static int open_checkpoint(load_op *op, const char *dir) {
    bool many = op->comm->size > 1;
    free(op->reader);
    free(op->shared);
    op->reader = NULL;
    op->shared = NULL;
    if (op->one_pass) {
        /* Manifest, sizes, unlisted files now; the checksums as the objects
         * read (ckpt__reader_open_verified). */
        int rc = ckpt__checkpoint_open(dir, false, false, &op->c);
        if (rc < 0 || one_pass_fits(&op->c.m)) return rc;
        ckpt__checkpoint_close(&op->c);
        op->one_pass = false; /* this checkpoint: the two passes */
    }
    /* Read once, hashed on the way, into the accelerator's reusable area. */
    int rc = ckpt__checkpoint_open_into(dir, many ? rank_reads : NULL, op, &op->acc->arena, &op->c);
    /* no plan (no memory for it): this rank cannot take part; the choice's
     * agreement stops the load on every rank */
    if (rc == 0 && many && op->c.m.nfiles > 0 && !op->reader) rc = ckpt__err_nomem("load plan");
    for (int64_t j = 0; op->c.have_manifest && op->c.maps && j < op->c.m.nfiles; j++)
        if (!many || (op->reader && op->reader[j] == op->comm->rank))
            op->held += op->c.m.files[j].size;
    ckpt__load_held_add(op->held);
    return rc;
}

/* Bytes per transfer: what a rank holds beyond the files it needs. */
#define SHARE_PIECE ((size_t)16 << 20)

/* Whether object o reads its keys under other names or types than its
 * schema's (ckpt_load_state_ex's adaptations): then every chunk of its
 * shard files may be read. */
static bool adapted(const load_op *op, const ckpt_acc_obj *o) {
    const ckpt_load_options *opt = op->opt;
    if (!opt || (o->kind != K_MODEL && o->kind != K_CUSTOM)) return false;
    return opt->rename || opt->num_prefix_map > 0 || opt->non_strict || opt->convert_dtypes;
}

/* Whether f is a part of a model saved as Hugging Face shards: a model's
 * shard-named file without chunk records. */
static bool is_hf_part(const ckpt_manifest_file *f) {
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
static bool has_chunks(const ckpt_manifest_file *f) {
    return f->chunks || ((is_hf_part(f) || is_big_model_file(f)) && f->tensor_keys);
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
static int find_needs(load_op *op, bool *need, uint8_t *cneed) {
    const ckpt_manifest *m = &op->c.m;
    for (int64_t j = 0; j < m->nfiles; j++) need[j] = true;
    char name[96];
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        if (o->kind == K_RNG) continue;
        ckpt__acc_file_name(op->acc, o, name, sizeof name);
        bool main_file = false;
        for (int64_t j = 0; j < m->nfiles; j++) main_file |= strcmp(m->files[j].name, name) == 0;
        if (!main_file && o->kind == K_MODEL && op->sel[i] && !adapted(op, o)) {
            /* saved as Hugging Face shards: every tensor of every part is
             * read whole, and can be streamed */
            for (int64_t j = 0; j < m->nfiles; j++)
                for (int64_t k = 0;
                     is_hf_part(&m->files[j]) && has_chunks(&m->files[j]) &&
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
            if (!shard && !all && o->kind == K_MODEL && has_chunks(f)) {
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
static int number_chunks(load_op *op) {
    const ckpt_manifest *m = &op->c.m;
    int64_t nf = m->nfiles, n = 0;
    free(op->cbase);
    free(op->cfile);
    op->cfile = NULL;
    op->cbase = ckpt__calloc((size_t)(nf ? nf : 1), sizeof *op->cbase);
    if (!op->cbase) return ckpt__err_nomem("load: chunk plan");
    for (int64_t j = 0; j < nf; j++) {
        op->cbase[j] = n;
        if (has_chunks(&m->files[j])) n += m->files[j].ntensors;
    }
    op->nchunks = n;
    op->cfile = ckpt__calloc((size_t)(n ? n : 1), sizeof *op->cfile);
    if (!op->cfile) return ckpt__err_nomem("load: chunk plan");
    for (int64_t j = 0; j < nf; j++)
        for (int64_t k = 0; has_chunks(&m->files[j]) && k < m->files[j].ntensors; k++)
            op->cfile[op->cbase[j] + k] = j;
    return CKPT_OK;
}

/* Which chunks are streamed: those every rank needs and can stream (the
 * minimum over the ranks, one reduction of a value per chunk). A rank then
 * needs a shard file before the check only for the chunks it needs that are
 * not streamed. */
static int choose_streamed(load_op *op, bool *need, const uint8_t *cneed) {
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
        for (int64_t k = op->cbase[j]; has_chunks(f) && k < op->cbase[j] + f->ntensors; k++) {
            looked |= cneed[k] != 0;
            still |= cneed[k] == 2 || (cneed[k] == 1 && !op->streamed[k]);
        }
        if (looked) need[j] = still;
    }
    free(v);
    return rc;
}

/* Whether some tensor of file j is streamed. */
static bool any_streamed(const load_op *op, int64_t j) {
    const ckpt_manifest_file *f = &op->c.m.files[j];
    for (int64_t k = 0; op->streamed && has_chunks(f) && k < f->ntensors; k++)
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
static int whole_header(const load_op *op, const ckpt_manifest_file *f, ckpt_st_header *h,
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
static void size_window(load_op *op) {
    const ckpt_manifest *m = &op->c.m;
    uint64_t most = 1;
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        if (!any_streamed(op, j)) continue;
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
static int share_headers(load_op *op) {
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
        if (f->chunks || !has_chunks(f) || !any_streamed(op, j)) continue;
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
static int share_files(load_op *op) {
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

/* ---- streamed chunks ------------------------------------------------------- */

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

/* The reader's fetch (ckpt__reader_set_fetch) of a streamed chunk: every
 * rank asks for the same chunk at the same point (it reads the same
 * replicated keys in the same order); the chunk's file's reader then
 * broadcasts it in pieces of SHARE_PIECE bytes (whole elements), each put
 * where the read wants it, and a receiving rank checks the bytes against
 * the manifest's digest of the chunk. A rank whose request differs from the
 * others' (it stopped, or reads in another order) makes every rank's
 * request fail, without any bytes moved, so no rank waits on a transfer
 * the others never start. */
static int fetch(void *ctx, int64_t id, const void *local, uint64_t nbytes, size_t group,
                 ckpt__piece_fn put, void *put_ctx) {
    load_op *op = ctx;
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
     * refuses. */
    int rc =
        me && !local ? ckpt__err(CKPT_EINVAL, "chunk %" PRId64 " not held by its reader", k) : 0;
    XXH3_state_t *h = me ? NULL : XXH3_createState();
    if (h) XXH3_64bits_reset(h);
    for (uint64_t off = 0; off < nbytes; off += piece) {
        size_t n = nbytes - off < piece ? (size_t)(nbytes - off) : piece;
        uint8_t *p = me && local ? (uint8_t *)(uintptr_t)local + off : op->window;
        int crc = c->bcast(c->ctx, p, n, root);
        if (crc < 0 && rc == 0)
            rc = ckpt__err_prefix(crc, "communicator: bcast from rank %d", root);
        if (rc == 0 && h) XXH3_64bits_update(h, p, n);
        if (rc == 0) rc = put(put_ctx, p, off, n);
    }
    if (rc == 0 && !me && f->tensor_xxh3 && k < f->ntensors &&
        (!h || XXH3_64bits_digest(h) != f->tensor_xxh3[k]))
        rc = h ? ckpt__err(CKPT_ECORRUPT,
                           "chunk %" PRId64 " received from rank %d differs from the manifest's "
                           "digest",
                           k, root)
               : ckpt__err_nomem("chunk digest");
    XXH3_freeState(h);
    return rc;
}

/* The end of a phase whose objects may have read streamed chunks: every
 * rank says it is done, and answers the requests of ranks still reading
 * (each such request fails, see fetch) until every rank is done. Returns
 * the communicator's failure, if any. */
static int stream_end(load_op *op) {
    if (!op->nstreamed) return CKPT_OK;
    for (;;) {
        int64_t lo = 0, hi = 0;
        CKPT_TRY(stream_round(op->comm, STREAM_DONE, &lo, &hi));
        if (hi == STREAM_DONE) return CKPT_OK;
    }
}

/* The checkpoint's files leave memory: what load_held.h counts drops. */
static void close_checkpoint(load_op *op) {
    ckpt__load_held_sub(op->held);
    op->held = 0;
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
    ckpt__checkpoint_close(&op->c);
}

/* A bad checkpoint, skipped for an older one; anything else (memory, I/O on
 * some rank) must not silently load an older state. */
static bool can_fall_back(int rc) {
    return rc == CKPT_ECORRUPT || rc == CKPT_EUNSUPPORTED || rc == CKPT_ENOENT;
}
static bool is_fatal(int rc) { return !can_fall_back(rc); }

/* Rank 0's list of checkpoint numbers, ascending, on every rank. */
static int list_candidates(load_op *op, const char *cdir, int64_t **nums, int64_t *count) {
    const ckpt_comm *c = op->comm;
    int rc = 0;
    if (c->rank == 0) {
        rc = ckpt__list_numbers(cdir, nums, count);
        if (rc == 0 && *count == 0)
            rc = ckpt__err(CKPT_ENOENT, "load_state: no checkpoint in %s", cdir);
    }
    if (c->size > 1) rc = ckpt__coll_share(c, rc);
    /* The one way this fails with CKPT_ENOENT (a missing folder lists as
     * empty). */
    if (rc == CKPT_ENOENT) op->nothing = true;
    if (c->size <= 1 || rc < 0) return rc;
    char *blob = (char *)*nums;
    size_t n = c->rank == 0 ? (size_t)*count * sizeof **nums : 0;
    CKPT_TRY(ckpt__coll_bcast_bytes(c, &blob, &n));
    if (c->rank != 0) {
        *nums = (int64_t *)(void *)blob;
        *count = (int64_t)(n / sizeof **nums);
    }
    return CKPT_OK;
}

/* The warning for a checkpoint skipped by load_state(NULL): the message
 * usually starts with the folder already. */
static void warn_skipped(ckpt_accelerator *acc, const char *dir, const char *msg, bool older) {
    size_t n = strlen(dir);
    bool named = strncmp(msg, dir, n) == 0 && msg[n] == ':';
    ckpt__log(&acc->log, CKPT_LOG_WARNING, "skipping %s%s%s%s", named ? "" : dir, named ? "" : ": ",
              msg, older ? "; falling back to an older checkpoint" : "");
}

/* An explicit folder: CKPT_ENOENT if it does not exist or is not a
 * checkpoint (no manifest): there is no checkpoint, a fresh start. */
static int choose_folder(load_op *op, const char *input_dir) {
    if (!input_dir[0]) return ckpt__err(CKPT_EINVAL, "load_state: input_dir is empty");
    struct stat st;
    if (ckpt__os_lstat(input_dir, &st) != 0 && errno == ENOENT)
        return ckpt__err(CKPT_ENOENT, "load_state: %s: no such checkpoint folder", input_dir);
    if (!(op->dir = ckpt__strdup(input_dir))) return ckpt__err_nomem("load path");
    int rc = open_checkpoint(op, op->dir);
    if (rc < 0) rc = ckpt__err_prefix(rc, "load_state");
    return rc;
}

static int choose_latest(load_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (!acc->project_dir)
        return ckpt__err(CKPT_EINVAL, "load_state: no input folder given and no project_dir");
    char *cdir = ckpt__checkpoints_dir(acc->project_dir);
    if (!cdir) return ckpt__err_nomem("load path");
    int64_t *nums = NULL, count = 0;
    int rc = list_candidates(op, cdir, &nums, &count);
    /* Why each newer checkpoint was skipped, for the final message. */
    char why[1536] = "";
    for (int64_t i = count - 1; rc == 0 && i >= 0; i--) {
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
        op->dir = ckpt__path_join(cdir, name);
        int orc = op->dir ? open_checkpoint(op, op->dir) : ckpt__err_nomem("load path");
        orc = ckpt__coll_agree(op->comm, orc, is_fatal);
        if (orc == 0) {
            rc = ckpt__coll_agree(op->comm, share_files(op), NULL);
            if (rc < 0) rc = ckpt__err_prefix(rc, "load_state");
            break;
        }
        if (!can_fall_back(orc)) {
            rc = ckpt__err_prefix(orc, "load_state");
            break;
        }
        if (op->comm->rank == 0) warn_skipped(acc, op->dir, ckpt_errmsg(), i > 0);
        size_t used = strlen(why);
        snprintf(why + used, sizeof why - used, "%s%s", used ? "; " : "", ckpt_errmsg());
        close_checkpoint(op);
        free(op->dir);
        op->dir = NULL;
        if (i == 0)
            rc = ckpt__err(CKPT_ECORRUPT, "load_state: no valid checkpoint in %s: %s", cdir, why);
    }
    free(nums);
    free(cdir);
    return rc;
}

/* ---- check ----------------------------------------------------------------- */

static void plural(char *buf, size_t cap, int n, const char *noun) {
    snprintf(buf, cap, "%d %s%s", n, noun, n == 1 ? "" : "s");
}

/* The checkpoint holds one file for each registered object of each kind
 * (shard files and per-process files aside). */
static int check_counts(const load_op *op) {
    const ckpt_accelerator *acc = op->acc;
    if (!op->full) return CKPT_OK; /* a partial load: each selected object finds its file */
    const ckpt_manifest *m = &op->c.m;
    int have[K_COUNT] = {0};
    for (int64_t i = 0; i < m->nfiles; i++) {
        if (ckpt__acc_is_shard_of(m->files[i].name, NULL)) continue;
        for (int k = 0; k < K_COUNT; k++)
            if (strcmp(m->files[i].kind, ckpt__kind_name[k]) == 0) have[k]++;
    }
    for (int k = 0; k < K_RNG; k++) {
        if (have[k] == acc->count[k]) continue;
        char a[64];
        plural(a, sizeof a, have[k], ckpt__kind_noun[k]);
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: checkpoint has %s, %d %s registered",
                         op->dir, a, acc->count[k], acc->count[k] == 1 ? "is" : "are");
    }
    return CKPT_OK;
}

/* Makes every shard file of the object whose file is `name` readable
 * through r, with the chunks the manifest records. */
static int attach_shards(load_op *op, ckpt_reader *r, const char *name, const char *kind) {
    const ckpt_manifest *m = &op->c.m;
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        if (!ckpt__acc_is_shard_of(f->name, name)) continue;
        if (strcmp(f->kind, kind) != 0)
            return ckpt__err(CKPT_ECORRUPT, "%s: %s holds a %s, expected a %s", op->dir, f->name,
                             f->kind, kind);
        if (!f->chunks && f->ntensors > 0)
            return ckpt__err(CKPT_ECORRUPT, "%s: %s: the manifest records no chunks for it",
                             op->dir, f->name);
        /* A shard file this rank does not hold (none of its chunks meets
         * the object's slices, or only streamed ones): its chunks from the
         * manifest, no bytes. */
        const ckpt_mapped *mp = &op->c.maps[j];
        bool held = !op->have || op->have[j];
        int64_t *ids = NULL;
        if (op->nstreamed && f->ntensors > 0) {
            if (!(ids = ckpt__malloc((size_t)f->ntensors * sizeof *ids)))
                return ckpt__err_nomem("load: chunk plan");
            for (int64_t k = 0; k < f->ntensors; k++) {
                int64_t id = op->cbase[j] + k;
                ids[k] = op->streamed[id] ? id : -1;
            }
            ckpt__reader_set_fetch(r, fetch, op);
        }
        int rc = ckpt__reader_attach_shard(r, held ? mp->data : NULL, held ? (size_t)mp->size : 0,
                                           f->name, (const char *const *)f->tensor_keys, f->chunks,
                                           f->ntensors, ids);
        free(ids);
        CKPT_TRY(rc);
    }
    return CKPT_OK;
}

/* The name options select an object by: its file name without
 * ".safetensors", and "random_states" for the generator. */
static void object_name(const ckpt_accelerator *acc, const ckpt_acc_obj *o, char *buf, size_t cap) {
    if (o->kind == K_RNG) {
        snprintf(buf, cap, "%s", ckpt__kind_stem[K_RNG]);
        return;
    }
    ckpt__acc_file_name(acc, o, buf, cap);
    char *dot = strstr(buf, ".safetensors");
    if (dot) *dot = '\0';
}

static int current_state(void *ctx, ckpt_writer *w) {
    const ckpt_acc_obj *o = ctx;
    return o->ops->state_dict(o->self, w);
}

/* Models and custom objects are adapted as the options say (renamed keys,
 * non-strict matching, converted dtypes); the library's own objects never. */
static int adapt_object(load_op *op, int i, const ckpt_writer *schema, const char *file) {
    ckpt_acc_obj *o = &op->objs[i];
    if (!op->opt || (o->kind != K_MODEL && o->kind != K_CUSTOM)) return CKPT_OK;
    char object[96];
    object_name(op->acc, o, object, sizeof object);
    ckpt_reader *ad = NULL, *ex = NULL;
    CKPT_TRY(ckpt__adapt(schema, op->readers[i], op->opt, object, file, current_state, o, &ad, &ex,
                         &op->res));
    if (ad) {
        op->srcs[i] = op->readers[i];
        op->extra[i] = ex;
        op->readers[i] = ad;
    }
    return CKPT_OK;
}

/* A part of a model saved as Hugging Face shards: a reader over the bytes
 * the choose phase read and verified. */
static int open_part(void *ctx, const ckpt_manifest_file *f, ckpt_reader **out) {
    const load_op *op = ctx;
    const ckpt_mapped *mp = &op->c.maps[f - op->c.m.files];
    return ckpt_reader_open_memory(out, mp->data, (size_t)mp->size, f->name);
}

/* Makes file f (a part of a model saved as Hugging Face shards, or a large
 * model file) readable through r, each tensor a whole chunk of its own (its
 * dtype and shape from the file's header: the file's bytes where this rank
 * holds them, else the header its reader sent), the streamed ones read
 * through fetch. */
static int attach_whole(load_op *op, ckpt_reader *r, const ckpt_manifest_file *f) {
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

/* Whether a model saved as Hugging Face shards, its parts named after
 * file `name`, has streamed tensors: then it is read through its parts'
 * headers (open_hf_streamed), not their bytes. */
static bool hf_streams(const load_op *op, const char *name) {
    for (int64_t j = 0; op->nstreamed && j < op->c.m.nfiles; j++)
        if (is_hf_part(&op->c.m.files[j]) && ckpt__acc_is_shard_of(op->c.m.files[j].name, name) &&
            any_streamed(op, j))
            return true;
    return false;
}

/* A model saved as Hugging Face shards whose tensors are streamed: one
 * reader over every part the index names (attach_whole), checked against
 * the index as ckpt__hf_open checks it: the parts hold exactly the tensors
 * the index names. */
static int open_hf_streamed(load_op *op, int i, const ckpt_manifest_file *index, const char *name) {
    const ckpt_manifest *m = &op->c.m;
    const ckpt_mapped *im = &op->c.maps[index - m->files];
    ckpt_hf_index x;
    int rc = ckpt__hf_index_parse((const char *)im->data, (size_t)im->size, index->name, &x);
    if (rc) return ckpt__err_prefix(rc, "%s", op->dir);
    ckpt_reader *r = NULL;
    rc = ckpt__reader_new_empty(&r, name);
    if (rc == 0) ckpt__reader_set_fetch(r, fetch, op);
    for (int64_t p = 0; p < x.nparts && rc == 0; p++) {
        const ckpt_manifest_file *f = ckpt__manifest_find(m, x.parts[p]);
        if (!f || !is_hf_part(f) || !has_chunks(f))
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: %s names %s, which the manifest does not list as a model file",
                           op->dir, index->name, x.parts[p]);
        else rc = attach_whole(op, r, f);
    }
    if (rc == 0 && ckpt_reader_count(r) != x.n)
        rc = ckpt__err(CKPT_ECORRUPT,
                       "%s: %s: the parts hold %" PRId64 " tensors, the index names %" PRId64,
                       op->dir, index->name, ckpt_reader_count(r), x.n);
    for (int64_t k = 0; k < x.n && rc == 0; k++)
        if (!ckpt__reader_has(r, x.keys[k], NULL))
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s names tensor '%s', which no part holds", op->dir,
                           index->name, x.keys[k]);
    ckpt__hf_index_free(&x);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    op->readers[i] = r;
    return CKPT_OK;
}

/* One object's reader over its file (and its shard files), and its schema
 * checked against them. */
static int open_object(load_op *op, int i) {
    ckpt_acc_obj *o = &op->objs[i];
    const ckpt_manifest *m = &op->c.m;
    char name[96];
    if (o->kind == K_RNG && op->rng_reshard) {
        op->rr = (ckpt_rng_reshard){.target = o->self, .rank = op->acc->process_index};
        o->ops = ckpt__rng_reshard_ops();
        o->self = &op->rr;
        snprintf(name, sizeof name, "%s_0.safetensors", ckpt__kind_stem[K_RNG]);
    } else {
        ckpt__acc_file_name(op->acc, o, name, sizeof name);
    }
    int64_t idx = -1, hf = -1;
    char iname[128];
    snprintf(iname, sizeof iname, "%s.index.json", name);
    for (int64_t j = 0; j < m->nfiles; j++) {
        if (strcmp(m->files[j].name, name) == 0) idx = j;
        if (o->kind == K_MODEL && strcmp(m->files[j].name, iname) == 0) hf = j;
    }
    if (idx < 0 && hf >= 0) { /* saved as Hugging Face shards */
        if (strcmp(m->files[hf].kind, ckpt__kind_name[K_MODEL]) != 0)
            return ckpt__err(CKPT_EMISMATCH, "load_state: %s: %s holds a %s, expected a model",
                             op->dir, iname, m->files[hf].kind);
        const ckpt_mapped *im = &op->c.maps[hf];
        int rc = hf_streams(op, name)
                     ? open_hf_streamed(op, i, &m->files[hf], name)
                     : ckpt__hf_open(m, &m->files[hf], im->data, (size_t)im->size, op->dir, name,
                                     open_part, op, &op->readers[i]);
        if (rc < 0) return ckpt__err_prefix(rc, "load_state");
    } else if (idx < 0) {
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: checkpoint has no %s (for %s %d)",
                         op->dir, name, ckpt__kind_noun[o->kind], o->index);
    }
    if (idx >= 0 && strcmp(m->files[idx].kind, ckpt__kind_name[o->kind]) != 0)
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: %s holds a %s, expected a %s", op->dir,
                         name, m->files[idx].kind, ckpt__kind_name[o->kind]);
    int rc = CKPT_OK;
    if (idx >= 0 && op->one_pass) {
        const ckpt_manifest_file *f = &m->files[idx];
        char *path = ckpt__path_join(op->dir, name);
        rc = path ? ckpt__reader_open_verified(&op->readers[i], path, name, f->xxh3,
                                               f->has_header_xxh3 ? &f->header_xxh3 : NULL,
                                               (const char *const *)f->tensor_keys,
                                               f->tensor_xxh3, f->ntensors)
                  : ckpt__err_nomem("load path");
        free(path);
    } else if (idx >= 0 && any_streamed(op, idx)) { /* a large model file, streamed */
        rc = ckpt__reader_new_empty(&op->readers[i], name);
        if (rc == 0) {
            ckpt__reader_set_fetch(op->readers[i], fetch, op);
            rc = attach_whole(op, op->readers[i], &m->files[idx]);
        }
        if (rc == 0) rc = attach_shards(op, op->readers[i], name, ckpt__kind_name[o->kind]);
    } else if (idx >= 0) {
        const ckpt_mapped *mp = &op->c.maps[idx];
        rc = ckpt_reader_open_memory(&op->readers[i], mp->data, (size_t)mp->size, name);
        if (rc == 0) rc = attach_shards(op, op->readers[i], name, ckpt__kind_name[o->kind]);
    }
    if (rc < 0) return ckpt__err_prefix(rc, "load_state: %s", op->dir);
    ckpt_writer *schema = NULL;
    CKPT_TRY(ckpt_writer_new_schema(&schema));
    ckpt_clear_error();
    rc = o->ops->state_dict(o->self, schema);
    if (rc != 0) {
        bool own = ckpt_errmsg()[0] != '\0';
        rc = ckpt__callback_failed(rc, "state_dict");
        rc = ckpt__err_prefix(rc, own ? "%s: state_dict" : "%s", name);
    } else {
        rc = adapt_object(op, i, schema, name);
        if (rc == 0) rc = ckpt__schema_check(schema, op->readers[i], name);
    }
    ckpt_writer_free(schema);
    if (rc < 0) rc = ckpt__err_prefix(rc, "load_state: %s", op->dir);
    return rc;
}

/* Matches the registered objects with the checkpoint's files, checks every
 * object's schema against its file, then every value through the objects'
 * check_state_dict; changes nothing. */
static int check(load_op *op) {
    CKPT_TRY(check_counts(op));
    int saved_np = op->c.m.num_processes > 0 ? op->c.m.num_processes : 1;
    op->rng_reshard = saved_np != op->acc->num_processes;
    if (op->rng_reshard && op->comm->rank == 0)
        ckpt__log(&op->acc->log, CKPT_LOG_WARNING,
                  "%s was saved by %d process%s and is loaded by %d: random generators continue "
                  "from rank 0's by the documented derivation, not as the saved processes' "
                  "would have (docs/DISTRIBUTED.md, \"Reshard\")",
                  op->dir, saved_np, saved_np == 1 ? "" : "es", op->acc->num_processes);
    size_t nr = (size_t)(op->nobjs ? op->nobjs : 1);
    op->readers = ckpt__calloc(nr, sizeof *op->readers);
    op->srcs = ckpt__calloc(nr, sizeof *op->srcs);
    op->extra = ckpt__calloc(nr, sizeof *op->extra);
    if (!op->readers || !op->srcs || !op->extra) return ckpt__err_nomem("load plan");
    for (int i = 0; i < op->nobjs; i++)
        if (op->sel[i]) CKPT_TRY(open_object(op, i));
    /* Every schema matches: now every value, still changing nothing. Each
     * check sees the objects as they were before the load. */
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        if (!op->sel[i] || !o->ops->check_state_dict) continue;
        ckpt_clear_error();
        int rc = o->ops->check_state_dict(o->self, op->readers[i]);
        if (rc == 0) continue;
        rc = ckpt__callback_failed(rc, "check_state_dict");
        char name[96];
        ckpt__acc_file_name(op->acc, o, name, sizeof name);
        return ckpt__err_prefix(rc, "load_state: %s: %s", op->dir, name);
    }
    return CKPT_OK;
}

/* ---- apply ----------------------------------------------------------------- */

static int apply(load_op *op) {
    ckpt_accelerator *acc = op->acc;
    const ckpt_manifest *m = &op->c.m;
    /* Allocated before anything is applied: past this point only an
     * object's own load_state_dict can fail. */
    char *last = ckpt__strdup(op->dir);
    if (!last) return ckpt__err_nomem("last_dir");
    /* The built-in objects' load_state_dict is their check (passed above)
     * plus the commit, so a failure past this point is a value refused by a
     * custom object without check_state_dict (documented in CHECKPOINTS.md);
     * the objects before it are already loaded. */
    int done = 0, nsel = 0;
    for (int i = 0; i < op->nobjs; i++) nsel += op->sel[i];
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        if (!op->sel[i]) continue;
        ckpt_clear_error();
        int rc = o->ops->load_state_dict(o->self, op->readers[i]);
        if (rc != 0) {
            rc = ckpt__callback_failed(rc, "load_state_dict");
            char name[96];
            ckpt__acc_file_name(acc, o, name, sizeof name);
            free(last);
            return ckpt__err_prefix(rc, "load_state: %s: %s (state partially loaded: %d of %d "
                                        "objects were loaded before this one)",
                                    op->dir, name, done, nsel);
        }
        done++;
    }
    /* One pass: what no read covered (the tail, tensors nobody read), and
     * the whole file's digest. The objects hold the file's bytes already. */
    for (int i = 0; op->one_pass && i < op->nobjs; i++) {
        int rc = op->sel[i] ? ckpt__reader_verify_finish(op->readers[i]) : 0;
        if (rc < 0) {
            free(last);
            return ckpt__err_prefix(rc, "load_state: %s (one-pass load: the objects already hold "
                                        "what was read; they are not to be trusted until a load "
                                        "succeeds)",
                                    op->dir);
        }
    }
    /* What the next save may link its unchanged files from (incremental
     * saves), whether the load was full or partial: a fine-tune's first save
     * links the frozen base from the checkpoint it started from. */
    char *link = ckpt__strdup(op->dir);
    if (link) {
        free(acc->link_dir);
        acc->link_dir = link;
    }
    /* A partial load (fine-tuning from another run's checkpoint, say)
     * leaves the step, the numbering and the last folder alone. */
    if (!op->full) {
        free(last);
        return CKPT_OK;
    }
    ckpt__acc_restore_step(acc, m->step);
    int64_t next = m->iteration;
    {
        const char *dir = op->dir;
        char base[256];
        size_t len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        size_t s = len;
        while (s > 0 && dir[s - 1] != '/') s--;
        int64_t num;
        if (len - s < sizeof base) {
            memcpy(base, dir + s, len - s);
            base[len - s] = '\0';
            if (ckpt__parse_checkpoint_name(base, &num) && num + 1 > next) next = num + 1;
        }
    }
    if (next > acc->iteration) acc->iteration = next;
    free(acc->last_dir);
    acc->last_dir = last;
    return CKPT_OK;
}

/* After a load: a success lifts a refusal of saves; a failure other than
 * "no checkpoint" sets one (see ckpt.h). Every rank holds the same status and
 * message here, so every rank decides alike. */
static int record_outcome(ckpt_accelerator *acc, int rc, bool nothing) {
    if (rc == 0) return ckpt_accelerator_start_over(acc);
    if (nothing) return rc;
    /* CKPT_ENOENT is promised for "no checkpoint" only, so that a caller may
     * take it for a fresh start: a key an object reads and the file lacks
     * (or a hook's missing file) is a mismatch between checkpoint and run. */
    if (rc == CKPT_ENOENT) rc = CKPT_EMISMATCH;
    free(acc->load_failed_msg);
    acc->load_failed_msg = ckpt__strdup(ckpt_errmsg());
    acc->load_failed = true;
    acc->load_failed_code = rc;
    return rc;
}

/* Which objects opt selects (op->sel, op->full); CKPT_EINVAL for bad
 * options, before anything is read. */
static int select_objects(load_op *op) {
    const ckpt_load_options *opt = op->opt;
    op->objs = ckpt__acc_plan_objects(op->acc, &op->nobjs);
    op->sel = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *op->sel);
    if (!op->objs || !op->sel) return ckpt__err_nomem("load plan");
    bool all = !opt || (opt->objects == 0 && opt->num_names == 0);
    if (opt) {
        if (opt->objects & ~CKPT_LOAD_ALL)
            return ckpt__err(CKPT_EINVAL, "load_state: objects has unknown bits 0x%x (known: 0x%x)",
                             opt->objects & ~CKPT_LOAD_ALL, CKPT_LOAD_ALL);
        if (opt->num_names < 0 || (opt->num_names > 0 && !opt->names))
            return ckpt__err(CKPT_EINVAL, "load_state: names is %s with num_names %d",
                             opt->names ? "set" : "NULL", opt->num_names);
        CKPT_TRY(ckpt__keymap_check(opt, "load_state"));
    }
    char name[96];
    for (int n = 0; opt && n < opt->num_names; n++) {
        if (!opt->names[n]) return ckpt__err(CKPT_EINVAL, "load_state: names[%d] is NULL", n);
        bool found = false;
        for (int i = 0; i < op->nobjs && !found; i++) {
            object_name(op->acc, &op->objs[i], name, sizeof name);
            found = strcmp(name, opt->names[n]) == 0;
        }
        if (found) continue;
        char known[512] = "";
        for (int i = 0; i < op->nobjs; i++) {
            object_name(op->acc, &op->objs[i], name, sizeof name);
            size_t u = strlen(known);
            snprintf(known + u, sizeof known - u, "%s%s", u ? ", " : "", name);
        }
        return ckpt__err(CKPT_EINVAL,
                         "load_state: names[%d] '%s' is no registered object (there are: %s)", n,
                         opt->names[n], known);
    }
    static const unsigned bit[K_COUNT] = {CKPT_LOAD_MODELS,   CKPT_LOAD_OPTIMIZERS,
                                          CKPT_LOAD_SCHEDULERS, CKPT_LOAD_DATALOADERS,
                                          CKPT_LOAD_SCALERS, CKPT_LOAD_CUSTOM, CKPT_LOAD_RNG};
    int nsel = 0;
    for (int i = 0; i < op->nobjs; i++) {
        bool on = all || (opt->objects & bit[op->objs[i].kind]);
        object_name(op->acc, &op->objs[i], name, sizeof name);
        for (int n = 0; !on && opt && n < opt->num_names; n++)
            on = strcmp(name, opt->names[n]) == 0;
        op->sel[i] = on;
        nsel += on;
    }
    if (nsel == 0)
        return ckpt__err(CKPT_EINVAL,
                         "load_state: the options select none of the registered objects "
                         "(objects 0x%x)",
                         opt->objects);
    op->full = nsel == op->nobjs;
    return CKPT_OK;
}

static int names_of(const load_op *op, bool selected, char ***out, int *n) {
    *out = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof **out);
    if (!*out) return ckpt__err_nomem("load report");
    char name[96];
    *n = 0;
    for (int i = 0; i < op->nobjs; i++) {
        if (op->sel[i] != selected) continue;
        object_name(op->acc, &op->objs[i], name, sizeof name);
        if (!((*out)[*n] = ckpt__strdup(name))) return ckpt__err_nomem("load report");
        (*n)++;
    }
    return CKPT_OK;
}


/* After a success: what was loaded. The key lists move from op. */
static int fill_report(load_op *op, ckpt_load_report *r) {
    r->step = op->c.m.step;
    r->full = op->full;
    if (!(r->dir = ckpt__strdup(op->dir))) return ckpt__err_nomem("load report");
    CKPT_TRY(names_of(op, true, &r->loaded, &r->num_loaded));
    CKPT_TRY(names_of(op, false, &r->skipped, &r->num_skipped));
    r->missing = op->res.missing.v;
    r->num_missing = op->res.missing.n;
    r->unexpected = op->res.unexpected.v;
    r->num_unexpected = op->res.unexpected.n;
    r->renamed = op->res.renamed.v;
    r->num_renamed = op->res.renamed.n;
    r->converted = op->res.converted.v;
    r->num_converted = op->res.converted.n;
    memset(&op->res, 0, sizeof op->res);
    return CKPT_OK;
}

/* Every key the adaptation changed or could not match, at INFO (missing
 * and unexpected keys at WARNING: nothing is silent). */
static void log_adaptation(load_op *op, const ckpt_load_report *r) {
    const ckpt_adapt_result *a = &op->res;
    ckpt_adapt_result view; /* the lists moved to the report */
    if (r) {
        view.missing = (ckpt_key_list){r->missing, r->num_missing, r->num_missing};
        view.unexpected = (ckpt_key_list){r->unexpected, r->num_unexpected, r->num_unexpected};
        view.renamed = (ckpt_key_list){r->renamed, r->num_renamed, r->num_renamed};
        view.converted = (ckpt_key_list){r->converted, r->num_converted, r->num_converted};
        a = &view;
    }
    const ckpt_logger *log = &op->acc->log;
    if (op->comm->rank != 0) return;
    for (int64_t i = 0; i < a->missing.n; i++)
        ckpt__log(log, CKPT_LOG_WARNING,
                  "%s: %s: key '%s' missing in the checkpoint: kept its value", op->dir,
                  a->missing.v[i].object, a->missing.v[i].key);
    for (int64_t i = 0; i < a->unexpected.n; i++)
        ckpt__log(log, CKPT_LOG_WARNING, "%s: %s: key '%s' in the checkpoint is used by nothing",
                  op->dir, a->unexpected.v[i].object, a->unexpected.v[i].file_key);
    if (a->converted.n)
        ckpt__log(log, CKPT_LOG_INFO, "%s: %" PRId64 " tensor%s converted (first: '%s' %s to %s)",
                  op->dir, a->converted.n, a->converted.n == 1 ? "" : "s", a->converted.v[0].key,
                  ckpt_dtype_name(a->converted.v[0].file_dtype),
                  ckpt_dtype_name(a->converted.v[0].dtype));
    if (a->renamed.n)
        ckpt__log(log, CKPT_LOG_INFO, "%s: %" PRId64 " key%s renamed (first: '%s' as '%s')",
                  op->dir, a->renamed.n, a->renamed.n == 1 ? "" : "s", a->renamed.v[0].file_key,
                  a->renamed.v[0].key);
}

/* The load of a local folder (remote.c's ckpt_load_state_ex copies a
 * checkpoint of object storage into one first). */
int ckpt__load_state_local(ckpt_accelerator *acc, const char *input_dir,
                           const ckpt_load_options *opt, ckpt_load_report *report) {
    if (report) memset(report, 0, sizeof *report);
    if (!acc) return ckpt__err(CKPT_EINVAL, "load_state: acc is NULL");
    load_op op;
    memset(&op, 0, sizeof op);
    op.acc = acc;
    op.comm = acc->comm;
    op.opt = opt;
    ckpt__load_held_reset();
    op.one_pass = opt && opt->one_pass && op.comm->size <= 1 && !opt->non_strict &&
                  !opt->convert_dtypes && opt->num_prefix_map == 0 && !opt->rename;
    ckpt__coll_begin(acc, "load: agree on the options");
    bool in_op = true;
    /* Bad options change nothing, not even the refusal of saves. */
    int rc = ckpt__coll_agree(op.comm, select_objects(&op), NULL);
    if (rc < 0) goto done;
    /* A pending asynchronous save ends first (its failure, if any, is kept
     * for the next wait or save). */
    ckpt__async_settle(acc, false);
    /* One run per project: rank 0 owns it from the first save or load on. */
    ckpt__coll_phase(acc, "load: take the project lock");
    rc = op.comm->rank == 0 ? ckpt__acc_own_project(acc, false, "load_state") : 0;
    rc = ckpt__coll_agree(op.comm, rc, NULL);
    if (rc < 0) goto out;
    /* choose */
    ckpt__coll_phase(acc, "load: choose the checkpoint");
    if (input_dir) {
        rc = ckpt__coll_agree(op.comm, choose_folder(&op, input_dir), NULL);
        op.nothing = rc == CKPT_ENOENT; /* no such folder, or not a checkpoint */
        if (rc == 0) rc = ckpt__coll_agree(op.comm, share_files(&op), NULL);
    } else {
        rc = choose_latest(&op);
    }
    if (rc < 0) goto out;
    /* check, agree */
    ckpt__coll_phase(acc, "load: pre-hooks and check");
    rc = ckpt__acc_run_hooks(acc, HOOK_LOAD, op.dir, "load_state");
    if (rc == 0) rc = check(&op);
    /* a check_state_dict may read streamed chunks: every rank ends alike */
    int src = stream_end(&op);
    if (rc == 0) rc = src;
    /* the report is made before anything changes: its failure (memory)
     * still leaves everything as it was */
    if (rc == 0 && report) rc = fill_report(&op, report);
    ckpt__coll_phase(acc, "load: agree on the verdict");
    rc = ckpt__coll_agree_echo(op.comm, rc, NULL, op.echo);
    if (rc == 0) log_adaptation(&op, report);
    /* apply: the objects read the streamed chunks as they load */
    ckpt__coll_phase(acc, "load: apply");
    if (rc == 0) {
        op.echo = false; /* a check's swallowed echo is not this phase's */
        rc = apply(&op);
        src = stream_end(&op);
        if (rc == 0) rc = src;
        rc = ckpt__coll_agree_echo(op.comm, rc, NULL, op.echo);
    }
    ckpt__coll_end(acc); /* the post-hooks may save or load */
    in_op = false;
    /* post */
    if (rc == 0) {
        acc->interval_start = ckpt__now(); /* a resumed run's time interval starts now */
        close_checkpoint(&op);             /* the post-hooks may rewrite the folder */
        ckpt__acc_run_hooks(acc, HOOK_LOAD_POST, op.dir, "load_state");
    }
out:
    rc = record_outcome(acc, rc, op.nothing);
done:
    for (int i = 0; i < op.nobjs; i++) {
        if (op.readers) ckpt_reader_free(op.readers[i]);
        if (op.extra) ckpt_reader_free(op.extra[i]);
        if (op.srcs) ckpt_reader_free(op.srcs[i]);
    }
    free(op.readers);
    free(op.extra);
    free(op.srcs);
    free(op.sel);
    free(op.objs);
    free(op.reader);
    free(op.shared);
    ckpt__adapt_result_free(&op.res);
    close_checkpoint(&op);
    free(op.dir);
    if (rc < 0 && report) ckpt_load_report_free(report);
    if (in_op) ckpt__coll_end(acc); /* a goto skipped the one above */
    return rc;
}
