/* error.c — status names, the thread's detailed message, counted allocations. */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdatomic.h>
#include <string.h>

#include "base/error.h"

#define ERRMSG_CAP 2048

static _Thread_local char tls_msg[ERRMSG_CAP];

const char *ckpt_version(void) { return CKPT_VERSION_STRING; }

const char *ckpt_strerror(int code) {
    switch (code) {
    case CKPT_OK: return "CKPT_OK: success";
    case CKPT_EINVAL: return "CKPT_EINVAL: invalid argument";
    case CKPT_EIO: return "CKPT_EIO: input/output error";
    case CKPT_ENOSPC: return "CKPT_ENOSPC: no space left on device";
    case CKPT_ENOENT: return "CKPT_ENOENT: not found";
    case CKPT_ECORRUPT: return "CKPT_ECORRUPT: corrupt or malformed file";
    case CKPT_EMISMATCH: return "CKPT_EMISMATCH: checkpoint does not match the objects in memory";
    case CKPT_EEXIST: return "CKPT_EEXIST: already exists";
    case CKPT_ENOMEM: return "CKPT_ENOMEM: out of memory";
    case CKPT_EBUSY: return "CKPT_EBUSY: busy (locked by another process)";
    case CKPT_EUNSUPPORTED: return "CKPT_EUNSUPPORTED: not supported";
    case CKPT_ETIMEDOUT: return "CKPT_ETIMEDOUT: a rank did not arrive within the deadline";
    default: return "unknown ckpt status";
    }
}

const char *ckpt_errmsg(void) { return tls_msg; }

void ckpt_clear_error(void) { tls_msg[0] = '\0'; }

int ckpt__status_from_errno(int errnum) {
    switch (errnum) {
    case ENOSPC:
#ifdef EDQUOT
    case EDQUOT:
#endif
        return CKPT_ENOSPC;
    case ENOENT: return CKPT_ENOENT;
    case EEXIST: return CKPT_EEXIST;
    case ENOMEM: return CKPT_ENOMEM;
    case EWOULDBLOCK: return CKPT_EBUSY;
    case EINVAL:
    case ENOTDIR:
    case EISDIR:
    case ENAMETOOLONG: return CKPT_EINVAL;
    default: return CKPT_EIO;
    }
}

static void vset(const char *fmt, va_list ap) { vsnprintf(tls_msg, sizeof tls_msg, fmt, ap); }

int ckpt__err(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset(fmt, ap);
    va_end(ap);
    return code;
}

int ckpt__err_os(int errnum, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vset(fmt, ap);
    va_end(ap);
    size_t len = strlen(tls_msg);
    snprintf(tls_msg + len, sizeof tls_msg - len, ": %s", strerror(errnum));
    return ckpt__status_from_errno(errnum);
}

int ckpt_set_error(int code, const char *fmt, ...) {
    if (!fmt) {
        tls_msg[0] = '\0';
        return code;
    }
    va_list ap;
    va_start(ap, fmt);
    vset(fmt, ap);
    va_end(ap);
    return code;
}

int ckpt__err_prefix(int code, const char *fmt, ...) {
    char old[ERRMSG_CAP];
    memcpy(old, tls_msg, sizeof old);
    va_list ap;
    va_start(ap, fmt);
    vset(fmt, ap);
    va_end(ap);
    /* No cause to append: say nothing rather than end on ": ". */
    if (!old[0]) return code;
    size_t len = strlen(tls_msg);
    snprintf(tls_msg + len, sizeof tls_msg - len, ": %s", old);
    return code;
}

const char *ckpt__status_name(int code) {
    switch (code) {
    case CKPT_OK: return "CKPT_OK";
    case CKPT_EINVAL: return "CKPT_EINVAL";
    case CKPT_EIO: return "CKPT_EIO";
    case CKPT_ENOSPC: return "CKPT_ENOSPC";
    case CKPT_ENOENT: return "CKPT_ENOENT";
    case CKPT_ECORRUPT: return "CKPT_ECORRUPT";
    case CKPT_EMISMATCH: return "CKPT_EMISMATCH";
    case CKPT_EEXIST: return "CKPT_EEXIST";
    case CKPT_ENOMEM: return "CKPT_ENOMEM";
    case CKPT_EBUSY: return "CKPT_EBUSY";
    case CKPT_EUNSUPPORTED: return "CKPT_EUNSUPPORTED";
    case CKPT_ETIMEDOUT: return "CKPT_ETIMEDOUT";
    default: return NULL;
    }
}

int ckpt__callback_failed(int rc, const char *fn) {
    const char *name = ckpt__status_name(rc);
    if (rc >= 0 || !name)
        return ckpt__err(CKPT_EINVAL, "%s returned %d, which is not a ckpt_status", fn, rc);
    if (!tls_msg[0]) return ckpt__err(rc, "%s returned %s", fn, name);
    return rc;
}

const char *ckpt__shape_str(char *buf, size_t cap, int ndim, const int64_t *shape) {
    if (cap == 0) return buf;
    size_t o = (size_t)snprintf(buf, cap, "[");
    for (int i = 0; i < ndim && o < cap; i++)
        o += (size_t)snprintf(buf + o, cap - o, i ? ",%lld" : "%lld", (long long)shape[i]);
    if (o < cap) snprintf(buf + o, cap - o, "]");
    return buf;
}

int ckpt__err_nomem(const char *what) {
    return ckpt__err(CKPT_ENOMEM, "out of memory (%s)", what);
}

/* Allocation failure injection: tests raise the cap step by step and check
 * that every failure comes back as a clean CKPT_ENOMEM. Process-wide; tests
 * that use it are single-threaded. */
static _Atomic uint64_t alloc_count;
static _Atomic uint64_t alloc_fail_at; /* 0: never */

static bool alloc_should_fail(void) {
    alloc_count++;
    return alloc_fail_at != 0 && alloc_count >= alloc_fail_at;
}

uint64_t ckpt__alloc_fail_after(uint64_t n) {
    uint64_t made = alloc_count;
    alloc_count = 0;
    alloc_fail_at = n;
    return made;
}

void *ckpt__malloc(size_t n) { return alloc_should_fail() ? NULL : malloc(n ? n : 1); }

void *ckpt__calloc(size_t n, size_t size) {
    return alloc_should_fail() ? NULL : calloc(n ? n : 1, size ? size : 1);
}

void *ckpt__realloc(void *p, size_t n) {
    return alloc_should_fail() ? NULL : realloc(p, n ? n : 1);
}

char *ckpt__strdup(const char *s) {
    size_t n = strlen(s) + 1;
    char *d = ckpt__malloc(n);
    if (d) memcpy(d, s, n);
    return d;
}

void ckpt__log(const ckpt_logger *lg, ckpt_log_level level, const char *fmt, ...) {
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (lg && lg->fn) {
        lg->fn(lg->user, level, msg);
        return;
    }
    fprintf(stderr, "ckpt: %s%s\n",
            level == CKPT_LOG_WARNING ? "warning: "
            : level == CKPT_LOG_ERROR ? "error: "
                                      : "",
            msg);
}
