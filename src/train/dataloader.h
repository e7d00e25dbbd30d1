/* dataloader.h — internals of ckpt_dataloader shared with the accelerator. */
#ifndef CKPT_DATALOADER_H
#define CKPT_DATALOADER_H

#include <stdint.h>

#include "ckpt.h"

/* Shards the loader for process process_index of num_processes (what
 * ckpt_prepare_dataloader calls). Each global batch is batch_size *
 * num_processes samples of the epoch's order; process p takes slice p. The
 * loader restarts at the first batch of its current epoch. num_processes 0
 * means 1. A call with the loader's current shard changes nothing (its
 * position is kept). CKPT_EINVAL if num_processes < 0 or process_index is
 * outside [0, num_processes). */
int ckpt__dataloader_set_shard(ckpt_dataloader *dl, int num_processes, int process_index);

/* Reads the state dict in r and checks it against dl as load_state_dict
 * would (every key present, dataset length, batch size, shuffle, drop_last,
 * even_batches, num_processes equal; values in range), changing nothing. It
 * is the check_state_dict of ckpt_dataloader_ops(), which ckpt_load_state
 * calls before loading anything, so a mismatch aborts the whole load; and
 * load_state_dict runs the same check before it commits. Same errors as
 * load_state_dict. */
int ckpt__dataloader_check_state(const ckpt_dataloader *dl, ckpt_reader *r);

/* Position in the current epoch: batches already yielded (or skipped). */
int64_t ckpt__dataloader_position(const ckpt_dataloader *dl);

/* The dataset index at position pos (0 <= pos < n) of the order of (seed,
 * epoch): the keyed permutation used when shuffle is on. Pure function. */
int64_t ckpt__shuffle_index(uint64_t seed, int64_t epoch, int64_t n, int64_t pos);

/* get of ckpt_memory_dataset; self is a ckpt_dataset it filled. The loader
 * recognises it to point self at its own copy of the dataset. */
int ckpt__memory_get(void *self, int64_t index, void *sample_out);

#endif
