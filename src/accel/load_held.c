/* load_held.c — the counter of load_held.h. One process may run several
 * accelerators at once (threads standing for ranks in the tests, or a program
 * with two projects), so the counters are atomic: relaxed, since they order
 * nothing and only count. The figures are then the process's sum. */
#include <stdatomic.h>

#include "accel/load_held.h"

static _Atomic uint64_t held_now, held_peak;

void ckpt__load_held_reset(void) {
    atomic_store_explicit(&held_now, 0, memory_order_relaxed);
    atomic_store_explicit(&held_peak, 0, memory_order_relaxed);
}

void ckpt__load_held_add(uint64_t n) {
    uint64_t now = atomic_fetch_add_explicit(&held_now, n, memory_order_relaxed) + n;
    uint64_t peak = atomic_load_explicit(&held_peak, memory_order_relaxed);
    while (now > peak && !atomic_compare_exchange_weak_explicit(
                             &held_peak, &peak, now, memory_order_relaxed, memory_order_relaxed)) {
    }
}

void ckpt__load_held_sub(uint64_t n) {
    uint64_t now = atomic_load_explicit(&held_now, memory_order_relaxed);
    uint64_t next;
    do {
        next = n > now ? 0 : now - n;
    } while (!atomic_compare_exchange_weak_explicit(&held_now, &now, next, memory_order_relaxed,
                                                    memory_order_relaxed));
}

uint64_t ckpt__load_held_now(void) { return atomic_load_explicit(&held_now, memory_order_relaxed); }

uint64_t ckpt__load_held_peak(void) {
    return atomic_load_explicit(&held_peak, memory_order_relaxed);
}
