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
#include "format/manifest.h"

/* The whole layout of n tensors (keys[i] of nbytes[i] bytes, in order)
 * saved as "<stem>" shards of at most max bytes: split greedily in order, a
 * tensor larger than max alone in its shard (transformers' rule); each
 * shard's name "<stem>-%05d-of-%05d.safetensors"; the index document,
 * pretty printed with sorted keys as transformers writes it. nshards may be
 * 1 (the caller may then write one plain file instead). */
typedef struct ckpt_hf_layout {
    int64_t nshards;
    int64_t *starts;     /* nshards + 1: shard s holds tensors [starts[s], starts[s+1]) */
    char (*names)[160];  /* nshards */
    char *index;         /* the index document */
    int64_t *entry;      /* NULL, or the caller's: entry[k] is the state-dict entry of the
                            layout's tensor k (a state dict whose aliases are left out of
                            the layout, as Hugging Face leaves tied names out); freed with
                            the layout */
} ckpt_hf_layout;
int ckpt__hf_layout_make(const char *const *keys, const uint64_t *nbytes, int64_t n, uint64_t max,
                         const char *stem, ckpt_hf_layout *out);
/* The same with shards named "<stem>-%05d-of-%05d<ext>" (".bin": the
 * pytorch_model.bin shards transformers reads with
 * pytorch_model.bin.index.json). */
int ckpt__hf_layout_make_ext(const char *const *keys, const uint64_t *nbytes, int64_t n,
                             uint64_t max, const char *stem, const char *ext, ckpt_hf_layout *out);
void ckpt__hf_layout_free(ckpt_hf_layout *l);
/* The index document for keys[i] in files[i] (n pairs, total tensor bytes),
 * as the layout's; *out is malloc'd. */
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
 * part (part_readers[p] for parts[p], borrowed: free *out first), and the
 * aliases (tied names) the parts hold. Every part's tensors must be exactly
 * the keys the index gives it (CKPT_ECORRUPT otherwise); other non-tensor
 * entries are refused. */
int ckpt__hf_combine(const ckpt_hf_index *x, ckpt_reader *const *part_readers, const char *what,
                     ckpt_reader **out);

/* A checkpoint's model saved as Hugging Face shards: its index (manifest
 * entry `index`, its bytes already checked against the manifest) and every
 * part the index names, each of which the manifest must list as a model file
 * of one process (no chunks). part(ctx, f, &r) opens part f's reader from
 * bytes checked against the manifest; *out owns every part reader. where
 * (the folder) and what (the object's file name) name things in messages. */
int ckpt__hf_open(const ckpt_manifest *m, const ckpt_manifest_file *index, const void *bytes,
                  size_t len, const char *where, const char *what,
                  int (*part)(void *ctx, const ckpt_manifest_file *f, ckpt_reader **out), void *ctx,
                  ckpt_reader **out);

#endif
