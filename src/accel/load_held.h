/* load_held.h — how many bytes of checkpoint files a load holds in memory:
 * the files this process read (its share of the read plan) and those it
 * received from other ranks, from the moment they are in memory until the
 * checkpoint is closed. For tests and benchmarks (the peak of one load is
 * what docs/DISTRIBUTED.md bounds); not part of the API. */
#ifndef CKPT_LOAD_HELD_H
#define CKPT_LOAD_HELD_H

#include <stdint.h>

/* A load starts: nothing held, peak 0. */
void ckpt__load_held_reset(void);
void ckpt__load_held_add(uint64_t n);
void ckpt__load_held_sub(uint64_t n);
/* Bytes held now, and the most held at once since the last reset (the last
 * load's peak once it returned). */
uint64_t ckpt__load_held_now(void);
uint64_t ckpt__load_held_peak(void);

#endif
