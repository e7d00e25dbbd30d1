/* hashread.h — a file's byte range read and hashed in order, on two threads
 * where that pays.
 *
 * XXH3 is a stream: its pieces must be hashed in file order, by one thread.
 * The reads need not be: a helper thread reads the pieces ahead of the
 * caller, who hashes each one as soon as it has landed (and reads pieces
 * itself while the next one to hash is still on its way). On two cores the
 * time is about that of the reads alone where a single thread pays reads
 * plus hash.
 *
 * dst: where the bytes land, dst[0 .. n) (the objects' own memory: the
 * bytes hashed are the bytes kept); or, dst NULL, ring: CKPT_HASHREAD_RING
 * bytes of the caller's that the pieces pass through (a check that keeps
 * nothing). Nothing is allocated. The caller's state h gets
 * the bytes in order; it is only ever touched by the calling thread.
 *
 * Failure: -1 with *why saying which read failed first in file order (the
 * errno, or 0 for a file that ended early, and the offset); nothing is
 * hashed past it. The function returns only once the helper has stopped:
 * no read lands in dst after it returns. */
#ifndef CKPT_HASHREAD_H
#define CKPT_HASHREAD_H

#include <stdint.h>

#include "base/xxh.h"

typedef struct ckpt__hashread_fail {
    int err;     /* errno of the failed pread, 0 if the file ended */
    uint64_t at; /* the file offset of the read that failed */
} ckpt__hashread_fail;

/* Pieces of this size are read and hashed. */
#define CKPT_HASHREAD_PIECE ((uint64_t)128 << 10)

/* The pieces in flight past the hash (and the ring's size). */
#define CKPT_HASHREAD_RING ((uint64_t)2 << 20)

/* Ranges shorter than this are read by the caller alone. */
#define CKPT_HASHREAD_MIN ((uint64_t)2 << 20)

/* The helper thread: kept in *kept across calls (started by the first
 * call that needs it; kept NULL: one thread started and joined by the
 * call). A kept helper serves one caller at a time: the owner of *kept
 * (a file reader) calls from one thread. */
typedef struct ckpt__hashread_helper ckpt__hashread_helper;

int ckpt__hashread(ckpt__hashread_helper **kept, int fd, uint64_t off, uint64_t n, uint8_t *dst,
                   uint8_t *ring, XXH3_state_t *h, ckpt__hashread_fail *why);

/* Stops and frees a kept helper (NULL: nothing). */
void ckpt__hashread_helper_free(ckpt__hashread_helper *helper);

/* The helper threads a large range gets (0 or 1). */
int ckpt__hashread_helpers(void);

/* How many helper threads the reads start (0 or 1; tests set 0 to compare
 * the single-threaded path); returns the previous value. */
int ckpt__hashread_set_helpers(int helpers);

#endif
