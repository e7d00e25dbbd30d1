/* safetensors.h — the safetensors format layer: a hostile-input header
 * parser that enforces every rule of the format, and a streaming writer that
 * never copies tensor data. See docs/FORMAT.md. */
#ifndef CKPT_SAFETENSORS_H
#define CKPT_SAFETENSORS_H

#include <jansson.h>
#include <stdint.h>

#include "ckpt.h"
#include "base/io.h"
#include "format/memref.h"

/* The format's limit on the JSON header. */
#define CKPT_ST_MAX_HEADER 100000000ULL

typedef struct ckpt_st_tensor {
    const char *name; /* view into the header's JSON, valid while it lives */
    ckpt_dtype dtype;
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    uint64_t begin, end; /* relative to the data buffer (byte 8 + N) */
} ckpt_st_tensor;

typedef struct ckpt_st_header {
    uint64_t header_len; /* N */
    uint64_t data_start; /* 8 + N */
    int64_t ntensors;
    ckpt_st_tensor *tensors; /* sorted by data offset (owned) */
    json_t *root;            /* the whole header (owned reference) */
    json_t *metadata;        /* root's "__metadata__" object or NULL (borrowed from root) */
} ckpt_st_header;

/* Checks the 8-byte prefix: file_size >= 8, N <= limit, 8 + N <= file_size.
 * *n = N. CKPT_ECORRUPT naming `name` and the rule. */
int ckpt__st_header_len(const uint8_t *prefix, uint64_t file_size, const char *name, uint64_t *n);
/* Parses and validates header bytes (n = N bytes, the ones after the
 * prefix) of a file of file_size bytes: JSON shape, padding, dtypes, shapes,
 * offsets (no holes, no overlap, sizes match) and the exact file size. */
int ckpt__st_parse(const uint8_t *header, uint64_t n, uint64_t file_size, const char *name,
                   ckpt_st_header *out);
void ckpt__st_header_free(ckpt_st_header *h);

/* One tensor to write. */
typedef struct ckpt_st_out {
    const char *name;
    ckpt_dtype dtype;
    int ndim;
    const int64_t *shape;
    const void *data;
    uint64_t nbytes;
    ckpt_mem_ref mem; /* mem.ops set: the bytes are behind memory ops, not at data */
} ckpt_st_out;

/* Per-tensor results of a write, indexed like the input array. */
typedef struct ckpt_st_written {
    uint64_t offset; /* absolute byte offset of the data in the file */
    uint64_t xxh3;   /* XXH3-64 of the tensor's bytes */
    int64_t file_pos; /* position in file order */
} ckpt_st_written;

/* Streams a whole safetensors file through s: the header (__metadata__
 * first with "format":"pt", then, if ckpt_doc is not NULL, "ckpt": ckpt_doc,
 * then the nmeta pairs meta[2i] : meta[2i + 1] whose key is neither;
 * then the tensors in the reference writer's order: alignment descending,
 * then name), padded with spaces so the data starts 8-aligned, then each
 * tensor straight from its data pointer (or, behind memory ops, through one
 * buffer of at most CKPT_MEMORY_PIECE bytes, piece by piece). res (may be NULL) gets n results,
 * header_xxh3 (may be NULL) the XXH3-64 of the file's first 8 + header
 * length bytes (the length, the header, its padding). */
int ckpt__st_write(ckpt_ostream *s, const ckpt_st_out *t, int64_t n, const char *ckpt_doc,
                   const char *const *meta, int64_t nmeta, ckpt_st_written *res,
                   uint64_t *header_xxh3);

#endif
