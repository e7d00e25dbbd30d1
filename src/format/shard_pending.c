/* shard_pending.c — a placeholder for the sharded optimizer (ZeRO-1) until
 * it lands: weak, so the real definition replaces it. */
#include "base/error.h"
#include "format/statedict.h"

__attribute__((weak)) int ckpt_optimizer_set_shard(ckpt_optimizer *o, const ckpt_comm *comm) {
    (void)o, (void)comm;
    return ckpt__err(CKPT_EUNSUPPORTED, "optimizer_set_shard: the sharded optimizer is not built yet");
}
