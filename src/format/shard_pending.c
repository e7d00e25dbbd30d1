/* shard_pending.c — placeholders for the sharded-tensor writer and reader
 * until they land: weak, so the real definitions replace them. Nothing puts
 * shard entries yet, so a writer never has any. */
#include "base/error.h"
#include "format/statedict.h"

__attribute__((weak)) bool ckpt__writer_has_shards(const ckpt_writer *w) {
    (void)w;
    return false;
}

__attribute__((weak)) int ckpt__writer_write_shards_new(ckpt_writer *w, const char *path,
                                                        ckpt_file_digest *d) {
    (void)w, (void)d;
    return ckpt__err(CKPT_EUNSUPPORTED, "%s: sharded tensors are not supported yet", path);
}

__attribute__((weak)) int ckpt__reader_attach_shard(ckpt_reader *r, const void *buf, size_t len,
                                                    const char *name, const char *const *keys,
                                                    const ckpt_chunk *chunks, int64_t n) {
    (void)r, (void)buf, (void)len, (void)keys, (void)chunks, (void)n;
    return ckpt__err(CKPT_EUNSUPPORTED, "%s: sharded tensors are not supported yet", name);
}
