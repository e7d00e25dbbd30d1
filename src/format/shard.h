/* shard.h — sharded tensors: the geometry of chunks (boxes inside a global
 * tensor), the exact-coverage check of a tensor's chunk set, slice copies
 * between boxes, and the names of shard files. Shared by state dicts, the
 * manifest and the accelerator. */
#ifndef CKPT_SHARD_H
#define CKPT_SHARD_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"
#include "base/io.h"
#include "format/statedict.h"

/* Checks one chunk record on its own: a valid dtype, 0 <= ndim <=
 * CKPT_MAX_NDIM, a global shape of fewer than 2^63 bytes, offsets >= 0,
 * shape >= 0 and offsets + shape <= global_shape in every dimension, and a
 * whole number of bytes. Fails with `code` (CKPT_EINVAL for what a caller
 * passed, CKPT_ECORRUPT for what a file says) naming `what` and `key`. *nbytes
 * (may be NULL) gets the chunk's byte count. */
int ckpt__chunk_check(const ckpt_chunk *c, int code, const char *what, const char *key,
                      uint64_t *nbytes);

/* One chunk of a key and the file it came from (for messages). */
typedef struct ckpt_chunk_ref {
    const ckpt_chunk *c;
    const char *file;
} ckpt_chunk_ref;

/* Whether the n chunks of one key tile its tensor exactly: the same dtype
 * and global shape in all, each within bounds (ckpt__chunk_check), no two
 * overlapping, and together covering every element (no hole). v is sorted in
 * place. Sort-and-sweep along the dimension with the most distinct offsets,
 * so row splits and column splits both cost O(n log n). Fails with `code`
 * naming `what`, the key and the files of the chunks at fault. */
int ckpt__chunks_cover(ckpt_chunk_ref *v, int64_t n, int code, const char *what, const char *key);

/* Copies the elements of the box [src_off, src_off + src_shape) (row-major
 * at src) that lie in the box [dst_off, dst_off + dst_shape) (row-major at
 * dst) into their places in dst; both boxes in one tensor of dtype dt and
 * ndim dimensions, already checked to lie within it. Contiguous runs are
 * copied with memcpy. A sub-byte dtype whose runs do not start and end on
 * byte boundaries is CKPT_EUNSUPPORTED. */
int ckpt__box_copy(ckpt_dtype dt, int ndim, const int64_t *src_off, const int64_t *src_shape,
                   const void *src, const int64_t *dst_off, const int64_t *dst_shape, void *dst);

/* Copies elements [first, first + count) of the box [src_off, src_off +
 * src_shape), in row-major order (src holds exactly those elements: a piece
 * of the chunk's bytes), into their places in the box [dst_off, dst_off +
 * dst_shape) at dst, as ckpt__box_copy does; the elements outside the dst box
 * are skipped. The range is cut into at most 2 x ndim + 1 boxes. The dtype
 * must be whole bytes (CKPT_EUNSUPPORTED otherwise). */
int ckpt__box_copy_range(ckpt_dtype dt, int ndim, const int64_t *src_off, const int64_t *src_shape,
                         uint64_t first, uint64_t count, const void *src, const int64_t *dst_off,
                         const int64_t *dst_shape, void *dst);
/* Both, into a destination that may be behind memory ops (each contiguous
 * run through from_host). */
int ckpt__box_copy_to(ckpt_dtype dt, int ndim, const int64_t *src_off, const int64_t *src_shape,
                      const void *src, const int64_t *dst_off, const int64_t *dst_shape,
                      const ckpt_dst *dst);
int ckpt__box_copy_range_to(ckpt_dtype dt, int ndim, const int64_t *src_off,
                            const int64_t *src_shape, uint64_t first, uint64_t count,
                            const void *src, const int64_t *dst_off, const int64_t *dst_shape,
                            const ckpt_dst *dst);

/* Hugging Face's shard names: "<stem>-<rank+1>-of-<size>.safetensors", each
 * number 5 digits (more if needed). CKPT_EINVAL if it does not fit in cap. */
int ckpt__shard_file_name(char *buf, size_t cap, const char *stem, int rank, int size);
/* The file of a model's frozen tensors kept apart by one process (format
 * version 3): "<stem>.frozen.safetensors", a name no Hugging Face reader
 * takes for one of its shards. Version 2 named it as shard 1 of 1,
 * "<stem>-00001-of-00001.safetensors", which still reads. */
#define CKPT_FROZEN_FILE_TAIL ".frozen.safetensors"
int ckpt__frozen_file_name(char *buf, size_t cap, const char *stem);
/* Whether name is a shard name or a frozen file's name (shard 1 of 1); if
 * so *stem_len gets the length of its stem, *index its 1-based number and
 * *count the "of" number. */
bool ckpt__shard_file_parse(const char *name, size_t *stem_len, int *index, int *count);

/* A reader with no entries, for an object whose state is only sharded
 * tensors (ckpt__reader_attach_shard adds them). name is copied. */
int ckpt__reader_new_empty(ckpt_reader **out, const char *name);

/* r takes over the mapped file *m (unmapped when r is freed; *m is zeroed),
 * so it can borrow the bytes for ckpt__reader_attach_shard. */
int ckpt__reader_adopt_map(ckpt_reader *r, ckpt_mapped *m);

#endif
