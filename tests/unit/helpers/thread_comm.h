/* thread_comm.h — a ckpt_comm whose ranks are threads of one process, so the
 * collective save/load protocol runs under the sanitizers without mpirun.
 * Every collective is a pair of barriers around shared slots. */
#ifndef CKPT_THREAD_COMM_H
#define CKPT_THREAD_COMM_H

#include <stdbool.h>

#include "ckpt.h"

/* Runs fn(comm, arg) on p threads at once, thread r with a communicator of
 * rank r of p (node 0, all local); returns when every thread has returned.
 * fn must not call cmocka assertions (they long-jump across threads):
 * record results in arg and check them afterwards. */
void tc_run(int p, void (*fn)(const ckpt_comm *comm, void *arg), void *arg);
/* Whether the communicators of later tc_run calls have an exchange
 * (ckpt_comm.exchange; default: none, so ckpt falls back to gathers). */
void tc_set_exchange(bool on);
/* Whether they have a background channel (ckpt_comm.exchange_background:
 * an asynchronous save replicates in its background thread; default none). */
void tc_set_exchange_background(bool on);

#endif
