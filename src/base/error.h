/* error.h — internal error helpers: set the thread's message and return a code. */
#ifndef CKPT_ERROR_H
#define CKPT_ERROR_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"

#if defined(__GNUC__)
#define CKPT_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define CKPT_PRINTF(a, b)
#endif

/* Formats the thread's message and returns code (so: return ckpt__err(...)). */
int ckpt__err(int code, const char *fmt, ...) CKPT_PRINTF(2, 3);
/* Same, appending ": <strerror(errnum)>" and mapping errnum to a status
 * (ENOSPC/EDQUOT -> CKPT_ENOSPC, ENOENT -> CKPT_ENOENT, EEXIST -> CKPT_EEXIST,
 * ENOMEM -> CKPT_ENOMEM, EWOULDBLOCK -> CKPT_EBUSY, EINVAL/ENOTDIR/EISDIR/
 * ENAMETOOLONG -> CKPT_EINVAL (a path that cannot name what was asked for),
 * else CKPT_EIO). */
int ckpt__err_os(int errnum, const char *fmt, ...) CKPT_PRINTF(2, 3);
/* Maps an errno value to a status as above. */
int ckpt__status_from_errno(int errnum);
/* Prefixes the current message with "<prefix>: " (adding context on the way
 * up) and returns code unchanged. With no current message the result is the
 * prefix alone. Callers call it right after the failure it explains; code
 * that runs user callbacks clears the message first (ckpt_clear_error), so a
 * message left by an earlier, unrelated call is never appended. */
int ckpt__err_prefix(int code, const char *fmt, ...) CKPT_PRINTF(2, 3);
/* "CKPT_EINVAL", ...; NULL for a value that is not a ckpt_status. Static. */
const char *ckpt__status_name(int code);
/* A user callback (state_dict, load_state_dict, check_state_dict, a hook)
 * named fn returned rc != 0; call it with the thread's message cleared before
 * the callback ran. Returns the status to report: rc itself if it is a
 * negative ckpt_status (with the callback's own message, or "<fn> returned
 * CKPT_X" if it set none); CKPT_EINVAL "<fn> returned <rc>, which is not a
 * ckpt_status" for any other value. */
int ckpt__callback_failed(int rc, const char *fn);
/* Formats a shape as "[2,3]" ("[]" for a scalar) into buf, cut short if it
 * does not fit; returns buf. For messages. */
const char *ckpt__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape);
/* CKPT_ENOMEM with "out of memory (<what>)". */
int ckpt__err_nomem(const char *what);

/* Return early on error: CKPT_TRY(call) */
#define CKPT_TRY(expr)                                                                             \
    do {                                                                                           \
        int ckpt_try_rc_ = (expr);                                                                 \
        if (ckpt_try_rc_ < 0) return ckpt_try_rc_;                                                 \
    } while (0)

/* Allocation wrappers that tests can make fail (see ckpt__alloc_fail_after). */
void *ckpt__malloc(size_t n);
void *ckpt__calloc(size_t n, size_t size);
void *ckpt__realloc(void *p, size_t n);
char *ckpt__strdup(const char *s);
/* Testing: the n-th allocation from now (1-based) and every later one fail;
 * n = 0 switches failures off. Returns how many allocations were made since
 * the last call. */
uint64_t ckpt__alloc_fail_after(uint64_t n);

/* Where warnings go (the accelerator's log callback, or stderr). */
typedef struct ckpt_logger {
    ckpt_log_fn fn; /* NULL: "ckpt: warning: <msg>" on stderr */
    void *user;
} ckpt_logger;
void ckpt__log(const ckpt_logger *lg, ckpt_log_level level, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;

#endif
