/* policy.c — when to save: ckpt_should_save (step and time intervals, agreed
 * over the process group) and preemption signals (a flag the loop polls). */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "base/error.h"

/* ---- preemption ----------------------------------------------------------- */

#define MAX_PREEMPT_SIGNALS 8

/* The handler only stores into a lock-free atomic: async-signal-safe, and
 * visible to every thread. */
static atomic_int caught;
static int installed[MAX_PREEMPT_SIGNALS];
static struct sigaction previous[MAX_PREEMPT_SIGNALS];
static int ninstalled;

static void on_preempt(int sig) {
    int none = 0;
    atomic_compare_exchange_strong(&caught, &none, sig);
}

int ckpt_preemption_install(const int *signals, int n) {
    if (n < 1 || n > MAX_PREEMPT_SIGNALS || !signals)
        return ckpt__err(CKPT_EINVAL, "preemption_install: %d signals, expected 1..%d", n,
                         MAX_PREEMPT_SIGNALS);
    for (int i = 0; i < n; i++) {
        int s = signals[i];
        if (s <= 0 || s >= NSIG || s == SIGKILL || s == SIGSTOP)
            return ckpt__err(CKPT_EINVAL,
                             "preemption_install: signal %d cannot be caught (expected e.g. "
                             "SIGTERM %d, SIGUSR1 %d)",
                             s, SIGTERM, SIGUSR1);
        for (int j = 0; j < i; j++)
            if (signals[j] == s)
                return ckpt__err(CKPT_EINVAL, "preemption_install: signal %d given twice", s);
    }
    ckpt_preemption_uninstall();
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_preempt;
    sa.sa_flags = SA_RESTART;
    sigemptyset(&sa.sa_mask);
    for (int i = 0; i < n; i++) {
        if (sigaction(signals[i], &sa, &previous[i]) != 0) {
            int e = errno;
            ckpt_preemption_uninstall();
            return ckpt__err(CKPT_EINVAL, "preemption_install: sigaction(%d): %s", signals[i],
                             strerror(e));
        }
        installed[i] = signals[i];
        ninstalled = i + 1;
    }
    return CKPT_OK;
}

void ckpt_preemption_uninstall(void) {
    for (int i = ninstalled - 1; i >= 0; i--) sigaction(installed[i], &previous[i], NULL);
    ninstalled = 0;
    atomic_store(&caught, 0);
}

bool ckpt_preemption_requested(void) { return atomic_load(&caught) != 0; }
int ckpt_preemption_signal(void) { return atomic_load(&caught); }
void ckpt_preemption_clear(void) { atomic_store(&caught, 0); }

/* ---- ckpt_should_save ----------------------------------------------------- */

int ckpt_should_save(ckpt_accelerator *acc, int64_t step) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "should_save: acc is NULL");
    if (step < 0)
        return ckpt__err(CKPT_EINVAL, "should_save: step is %" PRId64 ", expected >= 0", step);
    /* whether to save, and whether it is for a preemption */
    int64_t v[2] = {0, ckpt_preemption_requested()};
    v[0] = v[1];
    if (acc->save_interval_steps > 0 && step > 0 && step % acc->save_interval_steps == 0) v[0] = 1;
    if (acc->save_interval_seconds > 0 &&
        ckpt__now() - acc->interval_start >= acc->save_interval_seconds)
        v[0] = 1;
    const ckpt_comm *c = acc->comm;
    if (c->size > 1) {
        int rc = c->allreduce_i64(c->ctx, v, 2, CKPT_REDUCE_MAX);
        if (rc < 0 || rc > 0)
            return ckpt__err_prefix(rc < 0 ? rc : CKPT_EIO, "should_save: communicator");
    }
    /* Preempted: a pending asynchronous save is committed now, before the
     * next save starts (the job may be killed during it). Its failure, if
     * any, waits for that save, as it would have. */
    if (v[1]) ckpt__async_settle(acc, false);
    return v[0] ? 1 : 0;
}
