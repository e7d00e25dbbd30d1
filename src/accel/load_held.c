/* load_held.c — the counter of load_held.h. A load runs on one thread at a
 * time per process (ckpt_load_state is not reentrant), so plain counters. */
#include "accel/load_held.h"

static uint64_t held_now, held_peak;

void ckpt__load_held_reset(void) { held_now = held_peak = 0; }

void ckpt__load_held_add(uint64_t n) {
    held_now += n;
    if (held_now > held_peak) held_peak = held_now;
}

void ckpt__load_held_sub(uint64_t n) { held_now = n > held_now ? 0 : held_now - n; }

uint64_t ckpt__load_held_now(void) { return held_now; }

uint64_t ckpt__load_held_peak(void) { return held_peak; }
