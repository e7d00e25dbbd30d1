/* policy.c — when to save: ckpt_should_save (step and time intervals, agreed
 * over the process group; preemption signals: preempt.c). */
#include <inttypes.h>
#include <math.h>
#include <string.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "base/error.h"

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
