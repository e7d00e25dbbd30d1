/* statedict.h — internals of ckpt_writer / ckpt_reader shared with the
 * accelerator and the checkpoint store. */
#ifndef CKPT_STATEDICT_H
#define CKPT_STATEDICT_H

#include "ckpt.h"
#include "base/io.h"
#include "format/memref.h"

/* Whether ckpt_dtype_convert converts to and from dt (F32, F16, BF16;
 * dtype.c). */
bool ckpt__dtype_convertible(ckpt_dtype dt);

/* Where one saved chunk of a sharded tensor sits in the whole tensor
 * (ckpt_write_tensor_shard): the box [offsets, offsets + shape) of a tensor
 * of global_shape. */
typedef struct ckpt_chunk {
    ckpt_dtype dtype;
    int ndim;
    int64_t global_shape[CKPT_MAX_NDIM];
    int64_t offsets[CKPT_MAX_NDIM];
    int64_t shape[CKPT_MAX_NDIM];
} ckpt_chunk;

/* Digest of one written state file: whole-file size and XXH3-64, and each
 * tensor's XXH3-64 (so verify can name the tensor that went bad). */
typedef struct ckpt_file_digest {
    uint64_t size;
    uint64_t xxh3;
    int64_t ntensors;
    char **tensor_keys;      /* owned */
    uint64_t *tensor_xxh3;   /* owned */
    uint64_t *tensor_offset; /* owned: absolute file offset of each tensor's data */
    uint64_t *tensor_nbytes; /* owned */
    struct ckpt_chunk *tensor_chunk; /* owned; NULL, or (a shard file) one per tensor */
    bool has_xxh128;                 /* xxh128 below is the XXH3-128 of the whole file */
    ckpt_h128 xxh128;
    bool has_header_xxh3;  /* header_xxh3: XXH3-64 of the first 8 + header length bytes */
    uint64_t header_xxh3;
} ckpt_file_digest;
void ckpt__file_digest_free(ckpt_file_digest *d);

/* Like ckpt_writer_save, and fills *d (may be NULL). */
int ckpt__writer_save_digest(ckpt_writer *w, const char *path, ckpt_file_digest *d);
/* Writes the file at path (which must not exist) with plain create + fsync,
 * no rename: for files inside a checkpoint's temporary folder, which is
 * published as a whole. */
int ckpt__writer_write_new(ckpt_writer *w, const char *path, ckpt_file_digest *d);
/* ckpt__writer_write_new (shards: ckpt__writer_write_shards_new) that also
 * fills d->xxh128 (the file's XXH3-128) when want128. */
int ckpt__writer_write_new_ex(ckpt_writer *w, const char *path, bool shards, bool want128,
                              ckpt_file_digest *d);
/* The same file into a stream's sink instead of a path (an object-storage
 * upload: ckpt__ostream_open_sink), want128 as above; the sink is finished
 * (or aborted on failure) before this returns. what names it in messages. */
int ckpt__writer_write_sink(ckpt_writer *w, const char *what, const ckpt_ostream_sink *sink,
                            void *ctx, bool shards, bool want128, ckpt_file_digest *d);
/* What ckpt__writer_write_new_ex(w, ..., shards, ...) would write, measured
 * in memory without writing anything: its size and its XXH3-128. `what`
 * names the file in messages. With expect (n digests; NULL: none), the
 * XXH3-64 each tensor would have in the file, in file order (a previous
 * file's record): at the first tensor that differs the hashing stops,
 * *differs is set and *h is zero (the file cannot be that one); else
 * *differs is false and *h is the file's. */
int ckpt__writer_hash128(ckpt_writer *w, const char *what, bool shards, const uint64_t *expect,
                         int64_t n, uint64_t *size, ckpt_h128 *h, bool *differs);
/* The position of r's entry named key (as ckpt_reader_entry counts), or -1.
 * No message either way. */
int64_t ckpt__reader_index(const ckpt_reader *r, const char *key);
/* Whether r has an entry named key (and its info if info is not NULL). A
 * probe: sets no error message either way, unlike ckpt_reader_find. */
bool ckpt__reader_has(const ckpt_reader *r, const char *key, ckpt_entry_info *info);
/* Marks w's entry key optional: ckpt__schema_check accepts a file without it
 * (an entry older files lack, which the object reads only when present).
 * CKPT_ENOENT if there is no such entry. */
int ckpt__writer_set_optional(ckpt_writer *w, const char *key);
/* Marks w's tensor entry key as one whose shape ckpt__schema_check leaves to
 * the object's check_state_dict (an optimizer maps its state by parameter
 * name, so the file's state.<i> may be another parameter's, of another
 * shape); kind and dtype are still compared. CKPT_ENOENT if no such entry. */
int ckpt__writer_set_shape_by_object(ckpt_writer *w, const char *key);
/* Adds w's tensor entry j to dst under its key, whole, its bytes borrowed
 * as w borrows them (host memory, staged, or behind memory ops).
 * CKPT_EINVAL for another kind of entry or a chunk of a sharded tensor. */
int ckpt__writer_put_tensor_of(ckpt_writer *dst, const ckpt_writer *w, int64_t j);

/* ---- tensors behind memory ops (ckpt_memory_ops) ---------------------------
 * ckpt_write_tensor / ckpt_write_tensor_shard whose bytes (the tensor's, or
 * the chunk's) start at *m (copied; its ops and handle borrowed as data
 * would be). */
int ckpt__write_tensor_at(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                          const int64_t *shape, const ckpt_mem_ref *m);
int ckpt__write_tensor_shard_at(ckpt_writer *w, const char *key, ckpt_dtype dt, int ndim,
                                const int64_t *global_shape, const int64_t *offsets,
                                const int64_t *local_shape, const ckpt_mem_ref *m);
/* ckpt_read_tensor / ckpt_read_tensor_shard into dst, host memory or bytes
 * behind memory ops (through bounded pieces: a file's bytes through one
 * buffer of at most CKPT_MEMORY_PIECE, a verified reader's through its
 * 256 KiB piece, in-memory bytes and streamed pieces straight from where
 * they are). */
int ckpt__read_tensor_to(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                         const int64_t *shape, const ckpt_dst *dst);
int ckpt__read_tensor_shard_to(ckpt_reader *r, const char *key, ckpt_dtype dt, int ndim,
                               const int64_t *global_shape, const int64_t *offsets,
                               const int64_t *local_shape, const ckpt_dst *dst);
/* Marks w's tensor entry key as a frozen parameter's (a model's state dict):
 * a save may write it to a file of its own that later saves link.
 * CKPT_ENOENT if there is no such tensor entry. */
int ckpt__writer_set_frozen(ckpt_writer *w, const char *key);
/* Whether entry j was marked with ckpt__writer_set_frozen. */
bool ckpt__writer_entry_frozen(const ckpt_writer *w, int64_t j);
/* Whether w has an entry named key (no message either way). */
bool ckpt__writer_has(const ckpt_writer *w, const char *key);
/* Whether w is a schema writer. */
bool ckpt__writer_is_schema(const ckpt_writer *w);
/* Compares what a schema writer recorded with what reader r holds: the same
 * keys, kinds, dtypes and shapes, nothing missing or extra. On mismatch
 * CKPT_EMISMATCH naming `what` (e.g. "optimizer.safetensors") and the key,
 * with file vs memory. */
int ckpt__schema_check(const ckpt_writer *schema, const ckpt_reader *r, const char *what);
/* Whether an object whose schema writer is schema reads any element of the
 * saved chunk c of key: the chunk meets the slice the object put with
 * ckpt_write_tensor_shard, or the object puts key otherwise (whole), or not
 * at all under that name (an adaptation may read it under another). *known
 * (may be NULL) says whether the schema decided it: it holds key as a
 * tensor of c's rank (false: the answer is a guess, true to be safe). */
bool ckpt__schema_needs_chunk(const ckpt_writer *schema, const char *key, const ckpt_chunk *c,
                              bool *known);
/* Sets the name used in reader/writer error messages (copied). */
void ckpt__reader_set_name(ckpt_reader *r, const char *name);
/* Strict UTF-8 (no overlong forms, no surrogates, nothing past U+10FFFF):
 * keys, strings, and the torch pickle reader/writer. */
bool ckpt__utf8_valid(const unsigned char *s, size_t n);
/* Key validation shared by writer and model: CKPT_EINVAL naming `what`. */
int ckpt__check_key(const char *key, const char *what);

/* ---- staging (asynchronous saves) ----------------------------------------
 * A writer borrows its tensors' bytes; to let the caller change them while
 * the file is written elsewhere, the bytes are first copied into a staging
 * area. stage_bytes: the room the copy needs (each tensor 64-byte aligned,
 * shard chunks included). stage: copies every tensor's bytes to dst (which
 * has that room, 64-byte aligned) and makes the writer borrow the copies
 * instead; returns the bytes used. */
uint64_t ckpt__writer_stage_bytes(const ckpt_writer *w);
/* Tensors behind memory ops are copied through to_host straight into dst.
 * *used gets the bytes used; on failure (a to_host call failed, named) the
 * writer may borrow some copies and some originals: it still describes the
 * same state. */
int ckpt__writer_stage(ckpt_writer *w, uint8_t *dst, uint64_t *used);

/* ---- sharded entries (many processes) ------------------------------------ */
/* Whether w holds entries added with ckpt_write_tensor_shard. Such entries
 * are never part of the file ckpt__writer_write_new / ckpt_writer_save write;
 * they go to this process's shard file. */
bool ckpt__writer_has_shards(const ckpt_writer *w);
/* Whether this process has a shard file to write for w: a sharded entry
 * with a non-empty chunk (or a chunk of an empty tensor). Empty chunks of
 * non-empty tensors are not written: other processes hold those elements. */
bool ckpt__writer_shard_file_needed(const ckpt_writer *w);
/* Many processes, a replicated tensor written once (the save plan): entry j
 * of w, a plain tensor, is split by rows (dimension 0; a scalar is one row)
 * over the processes, and this one writes rows [lo, hi) of it, as a chunk in
 * its shard file, not in the object's file. lo == hi: another process
 * writes all of it. The entry's data pointer moves to row lo; CKPT_EINVAL if
 * j is not a plain tensor or the range does not fit. */
int ckpt__writer_spread(ckpt_writer *w, int64_t j, int64_t lo, int64_t hi);
/* Entry j's kind, dtype, ndim, shape and byte count (the whole tensor's),
 * and whether it is a sharded entry, without copying. */
int ckpt__writer_entry_shape(const ckpt_writer *w, int64_t j, ckpt_entry_kind *kind,
                             ckpt_dtype *dt, int *ndim, const int64_t **shape, uint64_t *nbytes,
                             bool *shard);
/* Writes only w's shard entries to path (create + fsync, no rename, like
 * ckpt__writer_write_new): one safetensors tensor per chunk. d->tensor_chunk
 * gets each tensor's chunk record (for the manifest). */
int ckpt__writer_write_shards_new(ckpt_writer *w, const char *path, ckpt_file_digest *d);
/* Makes the chunks of one shard file readable through r (ckpt_read_tensor_shard,
 * ckpt_read_tensor of the whole tensor, entry listing, schema checks):
 * buf/len are the file's bytes (borrowed until r is freed), name is used in
 * messages, and keys[i]/chunks[i] (i < n; copied) come from the manifest and
 * are checked against the file's own header. */
/* A file reader (as ckpt_reader_open of path; messages say name) that
 * verifies in one pass. With header_xxh3 (the manifest's digest of the
 * header; NULL for older manifests) the file is checked by parts: the
 * header when it is opened, each tensor against its own digest (keys/
 * digests, n of them, borrowed: the manifest's) right after each 256 KiB
 * piece lands in the caller's buffer, in any order. Without it, the file's
 * XXH3-64 (xxh3, the manifest's) is computed over the header it parses and
 * over every tensor's bytes as they land, in file order; a tensor read out
 * of file order (or twice) is checked against its own digest. A tensor
 * view reads the bytes, verified, into memory the reader owns (never a
 * mapping). A mismatch found while reading a tensor fails that read
 * (CKPT_ECORRUPT naming the tensor); the rest of the file is checked by
 * ckpt__reader_verify_finish, after the reads. */
int ckpt__reader_open_verified(ckpt_reader **out, const char *path, const char *name,
                               uint64_t xxh3, const uint64_t *header_xxh3,
                               const char *const *keys, const uint64_t *digests, int64_t n);
/* The bytes no read covered, hashed; CKPT_ECORRUPT "<name>: checksum
 * mismatch" unless the whole file's digest is the manifest's (by parts:
 * "<name>: tensor '<key>': checksum mismatch" for a tensor no read
 * checked). CKPT_OK for any other reader. */
int ckpt__reader_verify_finish(ckpt_reader *r);
/* For a file already verified whole (every byte hashed against the
 * manifest before any object read it): whether the bytes the reads put in
 * place are the file's. By parts, every read was checked against its
 * tensor's digest as it landed, so nothing is left to do; else the whole
 * file's digest is completed as ckpt__reader_verify_finish does. */
int ckpt__reader_verify_applied(ckpt_reader *r);
/* buf NULL (len 0): the chunks are recorded from the manifest alone, their
 * bytes absent (a shard file this process did not receive): a read that
 * needs one fails with CKPT_EMISMATCH naming the key and the file; the
 * others, and schema checks, work as usual. stream (NULL: none) gives each
 * chunk an id >= 0 if its bytes are to come through the reader's fetch
 * (ckpt__reader_set_fetch) instead, whether or not buf holds them; -1 if
 * not. */
int ckpt__reader_attach_shard(ckpt_reader *r, const void *buf, size_t len, const char *name,
                              const char *const *keys, const ckpt_chunk *chunks, int64_t n,
                              const int64_t *stream);

/* Streamed chunks (the load of many processes, docs/DISTRIBUTED.md). A read
 * of a key with streamed chunks fetches every one of them, in the key's
 * chunk order (attach order), whether or not it meets the slice read: the
 * sequence of fetches depends only on the sequence of keys read, so ranks
 * that read a replicated object alike fetch alike. fetch(ctx, id, local,
 * nbytes, group, put, put_ctx) delivers the chunk's nbytes bytes (local:
 * this process's copy, or NULL) as consecutive pieces, each a multiple of
 * group bytes (whole elements in whole bytes): put(put_ctx, p, off, n) for
 * bytes [off, off + n) of the chunk in row-major order; it returns the
 * first failure. A slice of a streamed chunk of a sub-byte dtype is
 * CKPT_EUNSUPPORTED (the whole chunk reads). */
typedef int (*ckpt__piece_fn)(void *put_ctx, const uint8_t *p, uint64_t off, uint64_t n);
typedef int (*ckpt__fetch_fn)(void *ctx, int64_t id, const void *local, uint64_t nbytes,
                              size_t group, ckpt__piece_fn put, void *put_ctx);
void ckpt__reader_set_fetch(ckpt_reader *r, ckpt__fetch_fn fn, void *ctx);

/* ---- adapted readers (ckpt_load_state_ex) ----------------------------------
 * A reader built entry by entry: an object's file seen under other key
 * names, with converted dtypes, and with the object's own values for keys the
 * file lacks. Read like any reader (ckpt_read_*, views, schema checks). */
int ckpt__reader_new_adapted(ckpt_reader **out, const char *name);
/* r takes over sub (freed with r, after r's own entries). */
int ckpt__reader_adopt_reader(ckpt_reader *r, ckpt_reader *sub);
/* Adds src's entry src_key under key. A tensor whose dtype differs from dt
 * (CKPT_DTYPE_INVALID: keep) is converted (ckpt_dtype_convert); a sharded
 * one is assembled whole. Otherwise its bytes are borrowed from src, which
 * must outlive r. CKPT_EEXIST if key is there already. */
int ckpt__reader_put_from_reader(ckpt_reader *r, const char *key, ckpt_reader *src,
                                 const char *src_key, ckpt_dtype dt);
/* Adds key as an alias of target (a tensor r holds, or will: resolved when
 * read). */
int ckpt__reader_put_alias(ckpt_reader *r, const char *key, const char *target);
/* Adds every tensor and alias of writer w under its own key, borrowing the
 * bytes w borrows (they must outlive r). Other entries are CKPT_EINVAL. */
int ckpt__reader_put_writer_views(ckpt_reader *r, const ckpt_writer *w);
/* Adds a copy of writer w's entry key (its value as memory holds it now).
 * CKPT_EUNSUPPORTED for a chunk of a sharded tensor. */
int ckpt__reader_put_from_writer(ckpt_reader *r, const ckpt_writer *w, const char *key);

#endif
