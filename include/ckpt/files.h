/*
 * ckpt/files.h — state-dict files and checkpoint folders, for tools.
 *
 * Standalone safetensors files written and read entry by entry (writers,
 * readers, entry listings), and the checkpoint folders of a project
 * (listing, verification, pruning) as ckpt ls / verify / prune use them.
 * Included by ckpt.h; may be included on its own (it includes ckpt.h).
 */
#ifndef CKPT_FILES_H
#define CKPT_FILES_H

#include "../ckpt.h"

#ifdef __cplusplus
extern "C" {
#endif

/* --- standalone state-dict files (one safetensors file each) ------------- */

/* A writer that collects entries in memory (tensor data borrowed). */
CKPT_API int ckpt_writer_new(ckpt_writer **out);
/* A schema writer: records keys, kinds, dtypes and shapes only, never reads
 * data (used for transactional loads: compare before touching anything). */
CKPT_API int ckpt_writer_new_schema(ckpt_writer **out);
CKPT_API void ckpt_writer_free(ckpt_writer *w);
/* Writes every entry to path as one safetensors file, crash-safely: a
 * temporary file beside path, fsync, rename over path, fsync of the folder.
 * On failure nothing is left at path (or the old file is intact) and no
 * temporary file remains. The writer can be saved again or freed. */
CKPT_API int ckpt_writer_save(ckpt_writer *w, const char *path);
/* Number of entries added so far. */
CKPT_API int64_t ckpt_writer_count(const ckpt_writer *w);

/* Opens and fully validates a safetensors file (every rule of the format,
 * and our __metadata__ document if present). Files written by other tools
 * open too: their tensors are readable, they simply have no scalar entries. */
CKPT_API int ckpt_reader_open(ckpt_reader **out, const char *path);
/* The same over a caller's buffer (borrowed until the reader is freed). name
 * is used in messages. */
CKPT_API int ckpt_reader_open_memory(ckpt_reader **out, const void *buf, size_t len,
                                     const char *name);
CKPT_API void ckpt_reader_free(ckpt_reader *r);

typedef enum ckpt_entry_kind {
    CKPT_ENTRY_TENSOR = 1,
    CKPT_ENTRY_I64 = 2,
    CKPT_ENTRY_F64 = 3,
    CKPT_ENTRY_STR = 4,
    CKPT_ENTRY_BYTES = 5,
    CKPT_ENTRY_U64 = 6,  /* ckpt_write_u64 */
    CKPT_ENTRY_ALIAS = 7 /* ckpt_write_alias: a second name of a tensor */
} ckpt_entry_kind;

/* "tensor", "i64", "f64", "str", "bytes", "u64", "alias"; NULL for an
 * invalid value. Static. */
CKPT_API const char *ckpt_entry_kind_name(ckpt_entry_kind kind);

typedef struct ckpt_entry_info {
    const char *key;       /* view valid until the reader/writer is freed */
    ckpt_entry_kind kind;
    ckpt_dtype dtype;      /* tensors only */
    int ndim;              /* tensors only */
    int64_t shape[CKPT_MAX_NDIM];
    uint64_t nbytes;       /* tensor bytes; string length; bytes length; 8 for i64/f64/u64;
                              0 for an alias (its bytes are its target's) */
    uint64_t offset;       /* tensors in a reader: byte offset of the data in the file */
    /* Aliases: the tensor this key names (a view like key); dtype, ndim and
     * shape are then that tensor's (dtype CKPT_DTYPE_INVALID where a reader
     * does not hold it). NULL for other entries. */
    const char *target;
} ckpt_entry_info;

/* Entries in file order (tensors by data offset, then scalar entries and
 * aliases in the order they were written). */
CKPT_API int64_t ckpt_reader_count(const ckpt_reader *r);
CKPT_API int ckpt_reader_entry(const ckpt_reader *r, int64_t i, ckpt_entry_info *info);
/* CKPT_ENOENT if absent. */
CKPT_API int ckpt_reader_find(const ckpt_reader *r, const char *key, ckpt_entry_info *info);
/* Zero-copy view of a tensor's bytes (mmap of the file). View valid until the
 * reader is freed. A tensor a checkpoint holds in several chunks (saved by
 * several processes) is assembled whole into memory the reader owns: a copy,
 * made at every call. */
CKPT_API int ckpt_reader_tensor_view(ckpt_reader *r, const char *key, const void **data,
                                     ckpt_entry_info *info);
/* The same entry listing for a writer (schema writers included). */
CKPT_API int64_t ckpt_writer_entry_count(const ckpt_writer *w);
CKPT_API int ckpt_writer_entry(const ckpt_writer *w, int64_t i, ckpt_entry_info *info);


/* ------------------------------------------------------------------------ */
/* Checkpoint folders (for tools: ls, verify, prune)                         */
/* ------------------------------------------------------------------------ */

typedef enum ckpt_checkpoint_status {
    CKPT_CHECKPOINT_COMPLETE = 0, /* manifest valid, every file matches */
    CKPT_CHECKPOINT_PARTIAL = 1,  /* no manifest: not a checkpoint (CKPT_ENOENT) */
    CKPT_CHECKPOINT_CORRUPT = 2   /* manifest or a file fails verification */
} ckpt_checkpoint_status;

typedef struct ckpt_checkpoint_info {
    char path[4096];
    int64_t number;          /* n of checkpoint_<n>; -1 for other folders */
    int64_t step;
    int64_t iteration;
    int64_t created_unix;    /* seconds since the epoch */
    uint64_t total_bytes;
    int num_files;
    int num_processes;
    int format_version;
    char library_version[32];
    ckpt_checkpoint_status status;
    int num_metrics;         /* the metrics recorded with it (ckpt_set_metric) */
    ckpt_metric metrics[CKPT_MAX_METRICS];
    /* Bytes of its files that are the very same files on disk (hard links,
     * incremental saves) as those of the same names in its predecessor: the
     * highest-numbered checkpoint_<m>, m < number, in the same folder. 0
     * for a folder not named checkpoint_<n>, or without a predecessor. */
    uint64_t shared_bytes;
} ckpt_checkpoint_info;

/* Reads dir's manifest and, if deep, verifies every file's size and
 * checksum. Returns CKPT_OK when the checkpoint is complete and valid;
 * otherwise the error (ckpt_errmsg names the file) with info->status set:
 * CKPT_ENOENT for a folder without a manifest (PARTIAL: not a checkpoint),
 * CKPT_ECORRUPT for a bad manifest or file. info is filled as far as could
 * be read. */
CKPT_API int ckpt_checkpoint_verify(const char *dir, bool deep, ckpt_checkpoint_info *info);
/* One file a checkpoint's manifest lists. */
typedef struct ckpt_checkpoint_file {
    char name[256];  /* plain file name inside the folder */
    char kind[65];   /* "model", "optimizer", ..., "random_states", "extra" (a
                        save pre-hook's file) */
    uint64_t size;
    uint64_t xxh3;   /* XXH3-64 of the whole file */
    /* The file on disk (lstat; all 0 if it is missing or not a regular
     * file): two checkpoints' files with the same device and inode are one
     * copy (an incremental save linked it), links is how many names it has. */
    uint64_t device, inode;
    uint64_t links;
} ckpt_checkpoint_file;
/* The files dir's manifest lists, in manifest order (the manifest is read and
 * parsed, the files are not checked: see ckpt_checkpoint_verify). *out is
 * malloc'd (NULL when *count is 0); free() it. Same errors as a load's
 * manifest read. */
CKPT_API int ckpt_checkpoint_files(const char *dir, ckpt_checkpoint_file **out, int64_t *count);
/* Deep-verifies one file dir's manifest lists (name): its size and XXH3-64.
 * CKPT_OK, CKPT_ENOENT if the manifest does not list it, CKPT_ECORRUPT
 * naming what differs. How a tool finds which shared file is damaged. */
CKPT_API int ckpt_checkpoint_verify_file(const char *dir, const char *name);
/* Bytes of dir's listed files that are the very same files on disk (same
 * device and inode: an incremental save linked them) as other's files of
 * the same names. Only manifests are read, files are only looked at. */
CKPT_API int ckpt_checkpoint_shared_bytes(const char *dir, const char *other, uint64_t *bytes);
/* Lists <project_dir>/checkpoints/checkpoint_<n> folders, ascending n, with
 * their status (deep verification if deep). *out is malloc'd; free() it. */
CKPT_API int ckpt_checkpoint_list(const char *project_dir, bool deep, ckpt_checkpoint_info **out,
                                  int64_t *count);
/* Opens one object of the checkpoint folder dir as a reader: file names its
 * file ("optimizer.safetensors"), and every shard file of it the manifest
 * lists (optimizer-<i>-of-<P>.safetensors) is attached, so sharded tensors
 * read whole (ckpt_read_tensor) or in any slice (ckpt_read_tensor_shard)
 * whatever process count saved them. Each file is checked against the
 * manifest (size and XXH3-64) first. CKPT_ENOENT if the manifest lists no
 * such object, CKPT_ECORRUPT for a bad file or chunk table. *out is freed
 * with ckpt_reader_free. */
CKPT_API int ckpt_checkpoint_open_object(const char *dir, const char *file, ckpt_reader **out);
/* Object storage: every function of this header that takes a folder also
 * takes an s3:// URL (a project "s3://bucket/prefix", a checkpoint
 * "s3://bucket/prefix/checkpoints/checkpoint_<n>"; docs/OBJECT_STORAGE.md).
 * Copies the checkpoint at url into the local folder local_dir, which must
 * not exist, every file checked against the manifest as it arrives (size
 * before reading, XXH3-64 of the bytes written); the folder appears whole
 * or not at all. CKPT_ENOENT if url holds no checkpoint (no manifest),
 * CKPT_ECORRUPT naming the object that does not match, CKPT_EUNSUPPORTED
 * if this library was built without object storage. */
CKPT_API int ckpt_checkpoint_fetch(const char *url, const char *local_dir);
/* Removes old automatic checkpoints of <project_dir>/checkpoints so that the
 * newest `keep` VALID ones remain (complete and deep-verified; partial and
 * corrupt folders do not count toward keep), and removes leftover temporary
 * folders of interrupted saves. The rule (the same as total_limit rotation
 * after each save):
 *   - the newest valid checkpoint is never removed (keep >= 1);
 *   - valid checkpoints older than the newest `keep` valid ones go;
 *   - partial or corrupt ones older than the newest valid checkpoint go
 *     (nothing could fall back to them before it); newer ones stay, as the
 *     evidence of what went wrong; with no valid checkpoint nothing goes;
 *   - a checkpoint of a newer format version (CKPT_EUNSUPPORTED) stays;
 *   - keep == 0 removes every checkpoint, valid or not.
 * Runs under the project lock: CKPT_EBUSY (nothing removed), naming the
 * owner's pid and host, while a save holds it or a run (an accelerator not
 * yet freed) owns the project. ckpt_checkpoint_list and
 * ckpt_checkpoint_verify take no lock. *removed (may be NULL) gets how many checkpoints went.
 * Equivalent to ckpt_checkpoint_prune_ex with only keep set. */
CKPT_API int ckpt_checkpoint_prune(const char *project_dir, int keep, int64_t *removed);

/* Why a prune removes a folder. */
typedef enum ckpt_prune_reason {
    CKPT_PRUNE_OLD = 0,      /* a checkpoint older than the newest `keep` valid ones */
    CKPT_PRUNE_INVALID = 1,  /* partial or corrupt, older than the newest valid checkpoint */
    CKPT_PRUNE_LEFTOVER = 2  /* a temporary folder an interrupted save or rotation left */
} ckpt_prune_reason;

/* Called once for each folder a prune removes (in a dry run: would remove),
 * before it goes. `why` is the verification error of an invalid checkpoint
 * (and of an old one that fails verification), else NULL; both strings are
 * valid only during the call. */
typedef void (*ckpt_prune_fn)(void *user, const char *path, ckpt_prune_reason reason,
                              const char *why);

typedef struct ckpt_prune_options {
    int keep;             /* valid checkpoints to keep (>= 0; 0 removes them all) */
    bool dry_run;         /* decide and report, remove nothing, take no lock; leftovers of a
                             process that is still running are not reported */
    ckpt_prune_fn report; /* may be NULL */
    void *user;           /* passed to report */
    /* Retention policies (0 / NULL: off), as in ckpt_project_config: */
    int64_t keep_every_steps;
    const char *best_metric;
    ckpt_best_mode best_mode;
    int best_k;
    /* Out (may be NULL): how many valid checkpoints remain (would remain, in
     * a dry run); 0 when none is valid, and then only leftovers go. */
    int64_t *valid_kept;
} ckpt_prune_options;

/* Retention with policies. When keep_every_steps or best_k is set (here or
 * in the project config) the kept set is the union of
 *   - the newest valid checkpoint (always: a run can resume);
 *   - the newest `keep` (total_limit) valid ones, if keep > 0 (with a policy
 *     set, 0 adds nothing here instead of keeping or removing all);
 *   - every valid one whose step is a positive multiple of keep_every_steps
 *     (and step 0 too: 0 is a multiple);
 *   - the best_k valid ones by best_metric (lowest with CKPT_BEST_MIN,
 *     highest with CKPT_BEST_MAX; one without the metric is never among
 *     them; equal values: the newer ranks first).
 * Every other valid checkpoint goes; partial and corrupt ones as above. The
 * newest `keep` are deep-verified; older ones are checked against their
 * manifest (sizes; their checksums are ckpt verify's job) to read their
 * step and metrics. CKPT_EINVAL for best_k < 0, keep_every_steps < 0, or
 * best_k without a valid best_metric name. */

/* ckpt_checkpoint_prune with options (rule above). Leftovers are removed
 * (reported) first, then checkpoints, oldest first. *removed (may be NULL)
 * gets how many checkpoints went (would go, in a dry run); leftovers are
 * only reported. */
CKPT_API int ckpt_checkpoint_prune_ex(const char *project_dir, const ckpt_prune_options *opts,
                                      int64_t *removed);

/* A hidden temporary folder in <project_dir>/checkpoints that a save or a
 * rotation left (".checkpoint_<n>.tmp.<pid>", ".checkpoint_<n>.old.<pid>"). */
typedef struct ckpt_leftover_info {
    char path[4096];
    int64_t pid;  /* the pid in its name, -1 if none */
    bool running; /* a process with that pid runs: possibly a save in progress */
} ckpt_leftover_info;

/* Lists the leftover temporary folders of a project, sorted by path. The
 * next save, or ckpt_checkpoint_prune, removes them; so does a resume (the
 * first ckpt_load_state of a run) for those whose process is gone. *out is
 * malloc'd; free() it. A project without a checkpoints folder has none. */
CKPT_API int ckpt_checkpoint_leftovers(const char *project_dir, ckpt_leftover_info **out,
                                       int64_t *count);

/* ------------------------------------------------------------------------ */
/* Node-local tiers (ckpt_project_config.local_dir), for ckpt ls             */
/* ------------------------------------------------------------------------ */

/* One checkpoint folder of a node-local tier: what one rank keeps of a save
 * (its own part and the parts it keeps for ranks on other nodes). */
typedef struct ckpt_tier_info {
    char path[4096]; /* <local_dir>/rank_<r>/checkpoint_<n> */
    int rank;        /* r: whose folder */
    int64_t number;  /* n */
    int64_t step;
    int64_t created_unix; /* seconds since the epoch */
    int num_processes;    /* the save's */
    uint64_t bytes;       /* of the files it holds that check */
    int num_parts;        /* the ranks whose part it holds whole: each of their files there,
                             of the listed size (and with deep, checksum) */
    int parts[16];        /* those ranks, ascending (the first 16) */
    bool in_memory;       /* on a file system in memory (tmpfs, ramfs): it lasts only as long
                             as the node runs */
    ckpt_checkpoint_status status; /* COMPLETE: every file it holds checks; PARTIAL: no
                                      manifest; CORRUPT: the manifest or a file fails */
} ckpt_tier_info;

/* Lists the checkpoint folders of a node-local tier, by rank then number:
 * dir is what a local_dir expanded to on a node (its rank_<r> folders), or
 * one rank_<r> folder, or one checkpoint folder in one. *out is malloc'd
 * (NULL when *count is 0); free() it. CKPT_ENOENT if dir holds no rank_<r>
 * folder and is none. A folder that fails gets its status; the reason is
 * ckpt_tier_verify's. */
CKPT_API int ckpt_tier_list(const char *dir, bool deep, ckpt_tier_info **out, int64_t *count);
/* Looks at one checkpoint folder of a tier (<...>/rank_<r>/checkpoint_<n>):
 * CKPT_OK if its manifest and every file it holds check, else the first
 * failure (ckpt_errmsg names the file), with info filled as far as read. */
CKPT_API int ckpt_tier_verify(const char *dir, bool deep, ckpt_tier_info *info);

#ifdef __cplusplus
}
#endif

#endif /* CKPT_FILES_H */
