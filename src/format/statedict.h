/* statedict.h — internals of ckpt_writer / ckpt_reader shared with the
 * accelerator and the checkpoint store. */
#ifndef CKPT_STATEDICT_H
#define CKPT_STATEDICT_H

#include "ckpt.h"
#include "base/io.h"

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
} ckpt_file_digest;
void ckpt__file_digest_free(ckpt_file_digest *d);

/* Like ckpt_writer_save, and fills *d (may be NULL). */
int ckpt__writer_save_digest(ckpt_writer *w, const char *path, ckpt_file_digest *d);
/* Writes the file at path (which must not exist) with plain create + fsync,
 * no rename: for files inside a checkpoint's temporary folder, which is
 * published as a whole. */
int ckpt__writer_write_new(ckpt_writer *w, const char *path, ckpt_file_digest *d);
/* Whether r has an entry named key (and its info if info is not NULL). A
 * probe: sets no error message either way, unlike ckpt_reader_find. */
bool ckpt__reader_has(const ckpt_reader *r, const char *key, ckpt_entry_info *info);
/* Whether w is a schema writer. */
bool ckpt__writer_is_schema(const ckpt_writer *w);
/* Compares what a schema writer recorded with what reader r holds: the same
 * keys, kinds, dtypes and shapes, nothing missing or extra. On mismatch
 * CKPT_EMISMATCH naming `what` (e.g. "optimizer.safetensors") and the key,
 * with file vs memory. */
int ckpt__schema_check(const ckpt_writer *schema, const ckpt_reader *r, const char *what);
/* Sets the name used in reader/writer error messages (copied). */
void ckpt__reader_set_name(ckpt_reader *r, const char *name);
/* Key validation shared by writer and model: CKPT_EINVAL naming `what`. */
int ckpt__check_key(const char *key, const char *what);

#endif
