/* io_stream.c — the one write stream: a file written front to back with its
 * XXH3 checksums computed on the way, then fsynced. */
#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "base/io_int.h"
#include "base/xxh.h"

/* ---- the write stream --------------------------------------------------- */

/* The XXH3 states live in one allocation made through ckpt__malloc (so the
 * allocation-failure sweep covers it), aligned by hand as XXH3 requires. One
 * state of the whole stream gives both its XXH3-64 and its XXH3-128
 * (xxh.h): wanting the wide digest costs no second pass. */
typedef struct hash_pair {
    XXH3_state_t whole;
    XXH3_state_t part;
} hash_pair;

static hash_pair *hash_pair_of(const ckpt_ostream *s) { return (hash_pair *)s->hash; }

static void ostream_release(ckpt_ostream *s) {
    free(s->path);
    free(s->hash_mem);
    s->path = NULL;
    s->hash_mem = NULL;
    s->hash = NULL;
    s->part_hash = NULL;
    s->fd = -1;
    s->sink = NULL;
    s->sink_ctx = NULL;
}

static int ostream_init(ckpt_ostream *s, const char *path) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->path = ckpt__strdup(path);
    size_t align = _Alignof(hash_pair) > 64 ? _Alignof(hash_pair) : 64;
    s->hash_mem = ckpt__malloc(sizeof(hash_pair) + align);
    if (!s->path || !s->hash_mem) {
        ostream_release(s);
        return ckpt__err_nomem("write stream");
    }
    uintptr_t a = ((uintptr_t)s->hash_mem + align - 1) & ~(uintptr_t)(align - 1);
    hash_pair *h = (hash_pair *)a;
    XXH3_INITSTATE(&h->whole);
    XXH3_INITSTATE(&h->part);
    XXH3_64bits_reset(&h->whole);
    XXH3_64bits_reset(&h->part);
    s->hash = h;
    s->part_hash = &h->part;
    return CKPT_OK;
}

int ckpt__ostream_open_dry(ckpt_ostream *s, const char *what) {
    CKPT_TRY(ostream_init(s, what));
    s->dry = true;
    s->want128 = true;
    return CKPT_OK;
}

void ckpt__ostream_expect_parts(ckpt_ostream *s, const uint64_t *xxh3, int64_t n) {
    if (!s->dry) return;
    s->expect = xxh3;
    s->nexpect = n;
}

void ckpt__ostream_want128(ckpt_ostream *s) {
    if (s->hash) s->want128 = true;
}

int ckpt__ostream_open(ckpt_ostream *s, const char *path) {
    CKPT_TRY(ostream_init(s, path));
    int fd = ckpt__os_open(path, O_WRONLY | O_CREAT | O_EXCL, 0644);
    if (fd < 0) {
        int e = errno;
        ostream_release(s);
        return ckpt__err_os(e, "%s: create", path);
    }
    s->fd = fd;
    return CKPT_OK;
}

int ckpt__ostream_open_sink(ckpt_ostream *s, const char *what, const ckpt_ostream_sink *sink,
                            void *ctx) {
    CKPT_TRY(ostream_init(s, what));
    s->sink = sink;
    s->sink_ctx = ctx;
    return CKPT_OK;
}

/* Bytes go down in pieces small enough to stay in the CPU's cache: each
 * piece is hashed (the whole stream's digest, then the part's) and then
 * written, so the two hashes and the kernel's copy into the page cache read
 * it from the cache and memory is read once, not three times. (A piece
 * also never asks one call to move gigabytes; Linux caps a write near
 * 2 GiB.) */
#define OSTREAM_PIECE ((size_t)256 << 10)

/* The kernel starts writing a file's dirty pages back only when a large
 * share of memory is dirty, so a big file written and then fsynced goes to
 * disk only at the fsync: the copy into the page cache and the disk write
 * follow each other. Starting the writeback of each finished window right
 * away (sync_file_range, which waits for nothing) lets them overlap, and the
 * final fsync finds most of the file already on its way. Durability still
 * comes only from that fsync; this call promises nothing (a power cut may
 * keep any part of it, as the crash model assumes anyway), and its failure
 * is ignored (the fsync reports real errors). */
#define OSTREAM_WRITEBACK_WINDOW ((uint64_t)16 << 20)

static void ostream_kick_writeback(ckpt_ostream *s) {
    uint64_t pending = s->bytes - s->kicked;
    if (pending < OSTREAM_WRITEBACK_WINDOW) return;
    (void)ckpt__os_writeback(s->fd, s->kicked, pending);
    s->kicked = s->bytes;
}

/* A dry stream with expectations: whether the part that just ended has the
 * digest expected at its position (else the stream differs, and stops
 * hashing). */
static void check_part(ckpt_ostream *s) {
    if (!s->expect || s->differs || s->nparts == 0) return;
    int64_t k = s->nparts - 1;
    if (k >= s->nexpect || XXH3_64bits_digest(&hash_pair_of(s)->part) != s->expect[k])
        s->differs = true;
}

int ckpt__ostream_write(ckpt_ostream *s, const void *p, size_t n) {
    if (s->err) return s->err;
    if (!s->hash) return s->err = ckpt__err(CKPT_EINVAL, "write stream: not open");
    if (!s->dry && s->fd < 0 && !s->sink)
        return s->err = ckpt__err(CKPT_EINVAL, "write stream: not open");
    const uint8_t *b = p;
    hash_pair *h = hash_pair_of(s);
    if (s->dry) {
        /* Only the hashes: the whole stream's, and the parts' when they are
         * compared. Once a part differs nothing more needs hashing. */
        if (!s->differs) {
            for (size_t off = 0; off < n; off += OSTREAM_PIECE) {
                size_t piece = n - off < OSTREAM_PIECE ? n - off : OSTREAM_PIECE;
                XXH3_64bits_update(&h->whole, b + off, piece);
                if (s->expect) XXH3_64bits_update(&h->part, b + off, piece);
            }
        }
        s->bytes += n;
        return CKPT_OK;
    }
    while (n > 0) {
        size_t piece = n < OSTREAM_PIECE ? n : OSTREAM_PIECE;
        XXH3_64bits_update(&h->whole, b, piece);
        XXH3_64bits_update(&h->part, b, piece);
        size_t done = s->sink ? piece : 0;
        if (s->sink) {
            /* hashed as handed over: the bytes sent are the bytes hashed */
            int rc = s->sink->write(s->sink_ctx, b, piece);
            if (rc < 0) return s->err = rc;
        }
        while (done < piece) {
            ssize_t w = ckpt__os_write(s->fd, b + done, piece - done);
            if (w < 0) return s->err = ckpt__err_os(errno, "%s: write", s->path);
            if (w == 0) return s->err = ckpt__err_os(EIO, "%s: write made no progress", s->path);
            done += (size_t)w;
        }
        s->bytes += piece;
        b += piece;
        n -= piece;
        if (!s->sink) ostream_kick_writeback(s);
    }
    return CKPT_OK;
}

void ckpt__ostream_part_begin(ckpt_ostream *s) {
    if (!s->hash) return;
    if (s->dry) {
        check_part(s);
        s->nparts++;
    }
    XXH3_64bits_reset(&hash_pair_of(s)->part);
}

uint64_t ckpt__ostream_part_digest(const ckpt_ostream *s) {
    return s->hash && !s->dry ? XXH3_64bits_digest(&hash_pair_of(s)->part) : 0;
}

static void take_h128(ckpt_ostream *s) {
    memset(&s->h128, 0, sizeof s->h128);
    if (!s->want128 || !s->hash || s->differs) return;
    XXH128_hash_t v = XXH3_128bits_digest(&hash_pair_of(s)->whole);
    s->h128.lo = v.low64;
    s->h128.hi = v.high64;
}

int ckpt__ostream_finish(ckpt_ostream *s, uint64_t *digest, uint64_t *size) {
    if (s->fd < 0 && !s->path) return ckpt__err(CKPT_EINVAL, "write stream: not open");
    int rc = s->err;
    if (s->dry) {
        check_part(s);
        if (s->expect && !s->differs && s->nparts != s->nexpect) s->differs = true;
        if (!rc) take_h128(s);
        if (!rc && digest) *digest = 0;
        if (!rc && size) *size = s->bytes;
        ostream_release(s);
        return rc;
    }
    if (s->sink) {
        if (rc) s->sink->abort(s->sink_ctx);
        else rc = s->sink->finish(s->sink_ctx);
        if (!rc && digest) *digest = XXH3_64bits_digest(&hash_pair_of(s)->whole);
        if (!rc && size) *size = s->bytes;
        if (!rc) take_h128(s);
        ostream_release(s);
        return rc;
    }
    if (!rc && ckpt__os_fsync(s->fd) < 0) rc = ckpt__err_os(errno, "%s: fsync", s->path);
    if (s->fd >= 0) {
        /* A failing close can report a delayed write error (NFS): count it. */
        if (ckpt__os_close(s->fd) < 0 && !rc) rc = ckpt__err_os(errno, "%s: close", s->path);
        s->fd = -1;
    }
    if (rc) {
        ckpt__os_unlink(s->path);
        ostream_release(s);
        return rc;
    }
    if (digest) *digest = XXH3_64bits_digest(&hash_pair_of(s)->whole);
    if (size) *size = s->bytes;
    take_h128(s);
    ostream_release(s);
    return CKPT_OK;
}

void ckpt__ostream_abort(ckpt_ostream *s) {
    if (!s) return;
    if (s->sink) {
        s->sink->abort(s->sink_ctx);
        ostream_release(s);
        return;
    }
    if (s->fd >= 0) ckpt__os_close(s->fd);
    if (s->path && !s->dry) ckpt__os_unlink(s->path);
    ostream_release(s);
}
