/* preempt.c — preemption signals: a flag the training loop polls
 * (ckpt_preemption_*), read by ckpt_should_save (policy.c) and by a save
 * with node-local tiers (a save after a signal is persisted). A file of its
 * own, called from both without a cycle between them. */
#include <errno.h>
#include <signal.h>
#include <stdatomic.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"

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
