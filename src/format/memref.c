/* memref.c — bytes moved through the caller's memory ops, in pieces. */
#include <inttypes.h>
#include <stdlib.h>

#include "base/error.h"
#include "format/memref.h"

int ckpt__mem_check_ops(const ckpt_memory_ops *ops, const char *what) {
    if (!ops || !ops->to_host || !ops->from_host)
        return ckpt__err(CKPT_EINVAL,
                         "%s: memory ops %s (a tensor behind memory ops needs both to_host and "
                         "from_host)",
                         what,
                         !ops            ? "are NULL"
                         : !ops->to_host ? "lack to_host"
                                         : "lack from_host");
    return CKPT_OK;
}

/* The status of a failed call of fn: its own negative ckpt_status (with its
 * message, or "<fn> returned CKPT_X"), else CKPT_EIO. */
static int failed(int rc, const char *fn, const char *key, uint64_t off, uint64_t n) {
    if (rc >= 0 || !ckpt__status_name(rc)) {
        ckpt__err(CKPT_EIO, "%s returned %d", fn, rc);
        rc = CKPT_EIO;
    } else {
        rc = ckpt__callback_failed(rc, fn);
    }
    return ckpt__err_prefix(
        rc, "tensor '%s': memory ops: %s of bytes [%" PRIu64 ", %" PRIu64 ") failed",
        key ? key : "?", fn, off, off + n);
}

int ckpt__mem_get(const ckpt_mem_ref *m, uint64_t off, void *dst, uint64_t n, const char *key) {
    uint8_t *p = dst;
    for (uint64_t done = 0; done < n;) {
        uint64_t k = n - done < CKPT_MEMORY_PIECE ? n - done : CKPT_MEMORY_PIECE;
        ckpt_clear_error();
        int rc = m->ops->to_host(m->handle, m->off + off + done, p + done, k);
        if (rc != 0) return failed(rc, "to_host", key, m->off + off + done, k);
        done += k;
    }
    return CKPT_OK;
}

int ckpt__mem_put(const ckpt_mem_ref *m, uint64_t off, const void *src, uint64_t n,
                  const char *key) {
    const uint8_t *p = src;
    for (uint64_t done = 0; done < n;) {
        uint64_t k = n - done < CKPT_MEMORY_PIECE ? n - done : CKPT_MEMORY_PIECE;
        ckpt_clear_error();
        int rc = m->ops->from_host(m->handle, m->off + off + done, p + done, k);
        if (rc != 0) return failed(rc, "from_host", key, m->off + off + done, k);
        done += k;
    }
    return CKPT_OK;
}

void *ckpt__mem_bounce(uint64_t n, uint64_t *cap, const char *what) {
    uint64_t c = n < CKPT_MEMORY_PIECE ? n : CKPT_MEMORY_PIECE;
    if (c == 0) c = 1;
    void *p = ckpt__malloc((size_t)c);
    if (!p) {
        ckpt__err_nomem(what);
        return NULL;
    }
    *cap = c;
    return p;
}
