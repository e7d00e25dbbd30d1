/* rng.h — the generator across process counts (docs/DISTRIBUTED.md,
 * "Reshard"): what a process continues with when a checkpoint was saved by
 * another number of processes. */
#ifndef CKPT_RNG_H
#define CKPT_RNG_H

#include "ckpt.h"

/* Rank `rank` of a job whose process count differs from the saving job's:
 * rank 0 continues rank 0's saved generator exactly; rank r > 0 gets rank
 * 0's key, the stream of rank 0 plus r (the high 64 bits of the counter),
 * rank 0's block position (the low 64 bits) and no partly used block or
 * cached normal. With the accelerator's seeding (stream = process index)
 * and ranks that draw alike, as data-parallel ranks do, these are streams
 * the saved processes did not use past that point. */
void ckpt__rng_reshard(const ckpt_rng *saved0, int rank, ckpt_rng *out);

/* The same as a stateful object for a load: self is a ckpt_rng_reshard;
 * its check reads a saved generator (rank 0's random_states file), its load
 * derives rank's generator from it into *target. */
typedef struct ckpt_rng_reshard {
    ckpt_rng *target;
    int rank;
} ckpt_rng_reshard;
const ckpt_stateful_ops *ckpt__rng_reshard_ops(void);

#endif
