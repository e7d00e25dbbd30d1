/* clock.c — the accelerator's monotonic clock (ckpt__now), replaceable by
 * tests (ckpt__set_clock). A leaf: the save, the load and the save policy all
 * read it, and it calls none of them. */
#include <time.h>

#include "accel/accel.h"

/* ---- the clock ------------------------------------------------------------ */

static double real_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double (*clock_fn)(void) = real_now;

double ckpt__now(void) { return clock_fn(); }
void ckpt__set_clock(double (*fn)(void)) { clock_fn = fn ? fn : real_now; }
