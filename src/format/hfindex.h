/* hfindex.h — Hugging Face's sharded weights: a model's tensors split over
 * "<stem>-00001-of-0000N.safetensors" files and named in
 * "<stem>.safetensors.index.json" ({"metadata": {"total_size": bytes},
 * "weight_map": {key: file}}), as transformers' save_pretrained and
 * Accelerate's save_model(max_shard_size) write them. Used by checkpoint
 * saves with max_shard_size, their loads, and export. */
#ifndef CKPT_HFINDEX_H
#define CKPT_HFINDEX_H

#include <stdint.h>

#include "ckpt.h"

/* Splits n tensors of nbytes[i] bytes, in order, greedily into shards of at
 * most max bytes (a tensor larger than max gets a shard of its own):
 * starts[s] is shard s's first tensor, starts[*nshards] = n. starts has room
 * for n + 1 entries. */
void ckpt__hf_plan(const uint64_t *nbytes, int64_t n, uint64_t max, int64_t *starts,
                   int64_t *nshards);
/* "<stem>-%05d-of-%05d.safetensors" (more digits if needed). */
int ckpt__hf_shard_name(char *buf, size_t cap, const char *stem, int64_t s, int64_t n);
/* The index document (keys[i] in files[i]; total tensor bytes), pretty
 * printed with sorted keys as transformers writes it. *out: free(). */
int ckpt__hf_index_text(const char *const *keys, const char *const *files, int64_t n,
                        uint64_t total, char **out);

/* A parsed index: pairs in document order and the distinct files. */
typedef struct ckpt_hf_index {
    int64_t n;
    char **keys, **files; /* owned */
    int64_t nparts;
    char **parts;         /* owned: each file once, in first-use order */
} ckpt_hf_index;
/* Parses the index text (what names it in messages), treating it as
 * hostile: CKPT_ECORRUPT for anything but an object with a "weight_map"
 * object of string values that are plain file names ending .safetensors. */
int ckpt__hf_index_parse(const char *text, size_t len, const char *what, ckpt_hf_index *out);
void ckpt__hf_index_free(ckpt_hf_index *x);
/* One reader over every part: each key the index names, read from its
 * part (part_readers[p] for parts[p], borrowed: free *out first). Every
 * part's tensors must be exactly the keys the index gives it
 * (CKPT_ECORRUPT otherwise); non-tensor entries are refused. */
int ckpt__hf_combine(const ckpt_hf_index *x, ckpt_reader *const *part_readers, const char *what,
                     ckpt_reader **out);

#endif
