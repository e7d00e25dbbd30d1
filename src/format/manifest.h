/* manifest.h — checkpoint.json, the manifest and commit record of a
 * checkpoint folder: writing it, parsing it as hostile input, and verifying a
 * folder's files against it. */
#ifndef CKPT_MANIFEST_H
#define CKPT_MANIFEST_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"
#include "base/io.h"
#include "format/statedict.h"

#define CKPT_MANIFEST_NAME "checkpoint.json"
/* The newest format version this library reads. Version 1: one process's
 * checkpoint, or several processes' where rank 0 wrote every replicated
 * tensor into its object's file. Version 2 (written when several processes
 * save): replicated tensors may be split over the ranks' shard files, as
 * chunks, like sharded tensors (docs/FORMAT.md). Version 3 (written by one
 * process that keeps a model's frozen tensors apart): version 2 with that
 * file named <model>.frozen.safetensors, not <model>-00001-of-00001 (which
 * Hugging Face readers take for a shard). One process otherwise writes 1. */
#define CKPT_FORMAT_VERSION 3
#define CKPT_FORMAT_VERSION_SPREAD 2
#define CKPT_FORMAT_VERSION_FROZEN 3
/* A manifest lists a few dozen files; anything this large is not ours. */
#define CKPT_MANIFEST_MAX_BYTES (16u << 20)

typedef struct ckpt_manifest_file {
    char *name;            /* plain file name inside the folder */
    char *kind;            /* "model", "optimizer", ..., "custom", "random_states" */
    uint64_t size;
    uint64_t xxh3;
    int64_t ntensors;
    char **tensor_keys;
    uint64_t *tensor_xxh3;
    ckpt_chunk *chunks;    /* NULL, or (a shard file) one per tensor: where it sits */
    int rank;              /* the process that wrote the file; 0 for one process */
    bool has_xxh128;       /* "xxh128": the file's XXH3-128 (absent in older manifests) */
    ckpt_h128 xxh128;      /* what an incremental save compares its bytes with */
    /* "header_xxh3": XXH3-64 of the file's first 8 + header length bytes
     * (absent in older manifests): with every tensor's digest it covers the
     * whole file, so a one-pass load needs no whole-file hash. */
    bool has_header_xxh3;
    uint64_t header_xxh3;
} ckpt_manifest_file;

typedef struct ckpt_manifest {
    int64_t format_version;
    char library_version[32];
    int64_t iteration;     /* the automatic numbering after this save (next number) */
    int64_t step;
    int process_index;     /* -1 if absent */
    int num_processes;
    int64_t created_unix;
    char created[32];      /* ISO 8601 UTC */
    int64_t nfiles;
    int64_t cap;
    ckpt_manifest_file *files;
    int nmetrics;          /* "metrics": {name: number}, written only when > 0 */
    ckpt_metric metrics[CKPT_MAX_METRICS];
} ckpt_manifest;

/* Whether name can name a metric: 1..63 bytes of [A-Za-z0-9_.:/-]. */
bool ckpt__metric_name_valid(const char *name);

void ckpt__manifest_init(ckpt_manifest *m);
/* Frees everything the manifest owns and re-initialises it. */
void ckpt__manifest_clear(ckpt_manifest *m);
/* Adds a file entry; copies name, kind and d's tensor keys and digests. */
int ckpt__manifest_add(ckpt_manifest *m, const char *name, const char *kind,
                       const ckpt_file_digest *d);
/* Whether name can be listed in a manifest: one visible path component
 * (no '/', no leading '.', no "..", no control characters), at most 255
 * bytes, valid UTF-8, not checkpoint.json. The parser refuses any other. */
bool ckpt__manifest_valid_name(const char *name);
const ckpt_manifest_file *ckpt__manifest_find(const ckpt_manifest *m, const char *name);

/* Writes <dir>/checkpoint.json crash-safely (fsynced; the folder too). Fills
 * created/created_unix if they are unset. */
int ckpt__manifest_write(ckpt_manifest *m, const char *dir);
/* The two halves of ckpt__manifest_write: the text it would write (*out
 * malloc'd, NUL-terminated, *len bytes without the NUL), and that text
 * written crash-safely as <dir>/checkpoint.json. How the same manifest,
 * byte for byte, goes into several folders (node-local tiers). */
int ckpt__manifest_text(ckpt_manifest *m, char **out, size_t *len);
int ckpt__manifest_publish(const char *text, size_t len, const char *dir);
/* Parses a manifest text; `what` names it in messages. CKPT_ECORRUPT for
 * anything malformed, CKPT_EUNSUPPORTED for a newer format version. */
int ckpt__manifest_parse(const char *text, size_t len, const char *what, ckpt_manifest *m);
/* Reads and parses <dir>/checkpoint.json. A folder without one is not a
 * checkpoint: CKPT_ENOENT "... not a checkpoint (no checkpoint.json)"; a
 * missing dir CKPT_ENOENT too. */
int ckpt__manifest_read(const char *dir, ckpt_manifest *m);
/* ckpt_checkpoint_files of a local folder (store/s3/project.c dispatches
 * s3:// URLs before it). */
int ckpt__checkpoint_files_local(const char *dir, ckpt_checkpoint_file **out, int64_t *count);

/* An opened, verified checkpoint folder: its manifest and every listed file
 * mapped (maps[i] belongs to m.files[i]). */
typedef struct ckpt_checkpoint_open {
    ckpt_manifest m;
    ckpt_mapped *maps; /* the files' bytes, in read buffers (not mappings) */
    ckpt_arena own;    /* the read buffers, unless the caller lent an arena */
    uint64_t total_bytes;
    bool have_manifest; /* the manifest was read and parsed (m is valid) */
    bool no_manifest;   /* the folder exists but has no manifest */
} ckpt_checkpoint_open;

/* Reads the manifest of dir and checks every listed file: it exists and has
 * the listed size; if deep, its XXH3-64 matches too (on mismatch the message
 * names the tensor whose digest differs when the file still parses). A
 * .safetensors file the manifest does not list makes the folder corrupt.
 * A deep check reads each file once with pread and hashes it piece by piece
 * as it is read (several files on two threads). If keep_maps (deep only),
 * the bytes read stay in c->maps, in buffers c owns until closed. */
int ckpt__checkpoint_open(const char *dir, bool deep, bool keep_maps, ckpt_checkpoint_open *c);
void ckpt__checkpoint_close(ckpt_checkpoint_open *c);
/* The same, but only the files for which want(f, ctx) is true are hashed
 * and mapped; the others are checked for presence and size only (their
 * maps stay zeroed). How each of many processes verifies just the files it
 * reads. want NULL: every file. */
int ckpt__checkpoint_open_some(const char *dir, bool deep, bool keep_maps,
                               bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                               ckpt_checkpoint_open *c);
/* ckpt__checkpoint_open_some(dir, deep, keep_maps, want, ctx) with the
 * files' bytes read into arena (reserved as needed, reused by the caller
 * from load to load: no page faults after the first) instead of buffers of
 * c's own. The arena must outlive c's use of c->maps. */
int ckpt__checkpoint_open_into(const char *dir,
                               bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                               ckpt_arena *arena, ckpt_checkpoint_open *c);
/* The two steps of the opens above, apart (a load plans between them which
 * files each process reads). open_manifest: c zeroed, then the manifest of
 * dir read and parsed (c->have_manifest; on failure c->no_manifest says
 * whether dir is a folder without one). read_files: every listed file's
 * size checked against the folder, the files with shallow[i] false (shallow
 * NULL: all) hashed if deep and, with keep_maps (deep only), read into
 * arena (NULL: c's own buffers); no unlisted .safetensors file. On failure
 * the manifest stays, the maps are dropped. */
int ckpt__checkpoint_open_manifest(const char *dir, ckpt_checkpoint_open *c);
int ckpt__checkpoint_read_files(const char *dir, bool deep, bool keep_maps, const bool *shallow,
                                ckpt_arena *arena, ckpt_checkpoint_open *c);
/* A checkpoint's files from a store other than a folder (object storage):
 * check: every listed file present with the listed size and no .safetensors
 * file the manifest does not list, before anything is reserved or read;
 * read: the files idx[0..n) (ascending) read into dst[idx[k]], their
 * XXH3-64 of exactly those bytes into h[idx[k]]. */
typedef struct ckpt_file_source {
    void *ctx;
    int (*check)(void *ctx, const ckpt_manifest *m);
    int (*read)(void *ctx, const ckpt_manifest *m, const int64_t *idx, int64_t n,
                uint8_t *const *dst, uint64_t *h);
} ckpt_file_source;
/* ckpt__checkpoint_read_files(dir, deep, keep_maps, ...) with the files
 * from src (dir names the checkpoint in messages): the same rules, sizes
 * first, the files not shallow read into arena (NULL: c's own buffers) and
 * checked against the manifest (a mismatch names the tensor). */
int ckpt__checkpoint_read_files_from(const ckpt_file_source *src, const char *dir,
                                     const bool *shallow, ckpt_arena *arena,
                                     ckpt_checkpoint_open *c);
/* Deep checks hash the files on two threads once they hold at least this
 * many bytes (default 64 MiB). Tests set 0 to exercise the threaded path on
 * small checkpoints; returns the previous value. */
uint64_t ckpt__set_parallel_check_bytes(uint64_t bytes);

/* Whether the chunks recorded by m's shard files tile every sharded tensor
 * exactly (per object, i.e. per shard-file stem, and key): consistent dtype
 * and global shape, within bounds, no overlap, no hole. Fails with `code`
 * (CKPT_ECORRUPT when parsing, CKPT_EINVAL before a save commits) naming
 * `what`, the object, the key and the files at fault. */
int ckpt__manifest_check_chunks(const ckpt_manifest *m, int code, const char *what);

/* The file entries of m as one JSON text (*out malloc'd, *len bytes), and
 * back: appended to m from such a text (hostile-input rules as for the
 * manifest; `what` names it). How each rank's file records reach the rank
 * that writes the manifest. */
int ckpt__manifest_files_to_json(const ckpt_manifest *m, char **out, size_t *len);
int ckpt__manifest_files_from_json(ckpt_manifest *m, const char *text, size_t len,
                                   const char *what);

#endif
