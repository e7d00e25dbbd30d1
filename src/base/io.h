/* io.h — the one write stream, crash-safe publication, hostile-safe reads,
 * and the ckpt__os_* helpers over the file-system table (fs.h).
 *
 * Every OS call on a file goes through the table; a test build wraps it to
 * make the N-th call fail or to record what reached the disk (src/testing). */
#ifndef CKPT_IO_H
#define CKPT_IO_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/stat.h>
#include <sys/types.h>

#include "base/fs.h"
#include "ckpt.h"

/* Helpers over the table (same contract as the syscalls: -1 and errno on
 * failure). Each retries EINTR where the syscall can be restarted. A test
 * layer may fail the open, write, pread, fsync, rename, exchange and mkdir
 * calls (src/testing). */
int ckpt__os_open(const char *path, int flags, mode_t mode);
int ckpt__os_openat(int dirfd, const char *path, int flags, mode_t mode);
ssize_t ckpt__os_write(int fd, const void *p, size_t n);
ssize_t ckpt__os_pread(int fd, void *p, size_t n, uint64_t off);
int ckpt__os_fsync(int fd);
int ckpt__os_rename(const char *from, const char *to);
/* renameat2(RENAME_EXCHANGE): swaps two existing paths atomically. */
int ckpt__os_exchange(const char *a, const char *b);
int ckpt__os_mkdir(const char *path, mode_t mode);
/* Never failed by a test layer (they run on cleanup paths too). */
ssize_t ckpt__os_pwrite(int fd, const void *p, size_t n, uint64_t off);
int ckpt__os_ftruncate(int fd, uint64_t len);
int ckpt__os_unlink(const char *path);
int ckpt__os_rmdir(const char *path);
int ckpt__os_link(const char *from, const char *to);
/* mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0), counted as len bytes read
 * (ckpt__io_bytes); MAP_FAILED and errno on failure. */
void *ckpt__os_map_read(int fd, size_t len);

/* ---- byte counts (tests and benchmarks) ---------------------------------- */
/* Bytes this process moved between memory and files through this layer
 * since it started: every pread, every mmap of a file (its whole length,
 * counted when mapped), every write and pwrite. Relaxed atomic counters,
 * always on (one add per call). How a test proves that each of P ranks reads
 * and writes about 1/P of a checkpoint, whatever path the bytes took. */
typedef struct ckpt_io_bytes {
    uint64_t read;
    uint64_t written;
} ckpt_io_bytes;
void ckpt__io_bytes(ckpt_io_bytes *out);

/* ---- the write stream --------------------------------------------------- */
/* An XXH3-128 digest: what decides that a file about to be written has
 * exactly the bytes of a file already on disk (incremental saves). */
typedef struct ckpt_h128 {
    uint64_t lo, hi;
} ckpt_h128;

/* Where a stream's bytes go instead of a file (ckpt__ostream_open_sink): an
 * object-storage upload, for instance. write takes every byte in order;
 * finish completes it (called once, after the last write); abort drops it
 * (a failed or abandoned stream). Each returns or leaves a message. */
typedef struct ckpt_ostream_sink {
    int (*write)(void *ctx, const void *p, size_t n);
    int (*finish)(void *ctx);
    void (*abort)(void *ctx);
} ckpt_ostream_sink;

typedef struct ckpt_ostream {
    int fd;
    const ckpt_ostream_sink *sink; /* instead of fd (ckpt__ostream_open_sink) */
    void *sink_ctx;
    char *path;         /* for messages (owned) */
    int err;            /* sticky: first error status, 0 if none */
    uint64_t bytes;     /* written so far */
    uint64_t kicked;    /* bytes whose writeback has been started (see ostream_write) */
    void *hash;         /* XXH3 state of the whole stream (owned) */
    void *part_hash;    /* XXH3 state of the current part (see part_begin) */
    void *hash_mem;     /* the allocation holding the states (owned) */
    bool dry;           /* no file: only counts and hashes (ckpt__ostream_open_dry) */
    bool want128;       /* also an XXH3-128 of the whole stream */
    ckpt_h128 h128;     /* that digest, set by ckpt__ostream_finish */
    const uint64_t *expect; /* dry: the parts' expected XXH3-64 (ckpt__ostream_expect_parts) */
    int64_t nexpect;
    int64_t nparts; /* dry: parts begun */
    bool differs;   /* dry: a part differs from its expectation (kept after finish) */
} ckpt_ostream;

/* Creates path exclusively (O_CREAT|O_EXCL, 0644). */
int ckpt__ostream_open(ckpt_ostream *s, const char *path);
/* A stream into sink (ctx its state) instead of a file: the same checksums
 * on the bytes handed to it, finish calls sink->finish (nothing to fsync),
 * abort and a failed finish call sink->abort. what names it in messages. */
int ckpt__ostream_open_sink(ckpt_ostream *s, const char *what, const ckpt_ostream_sink *sink,
                            void *ctx);
/* A stream that writes nothing: it counts the bytes and computes only their
 * XXH3-128 (h128 after finish; the 64-bit digests stay 0). How a save learns,
 * from memory, whether a file it would write equals one already on disk.
 * what names it in messages. */
int ckpt__ostream_open_dry(ckpt_ostream *s, const char *what);
/* A dry stream compares each part (ckpt__ostream_part_begin) with the
 * XXH3-64 expected at its position, xxh3[0..n) (borrowed until finish): at
 * the first part that differs, or when the parts are more or fewer than n,
 * the stream differs (s->differs, kept after finish; h128 is then zero) and
 * stops hashing, so that a file that changed costs a save the hash of its
 * first changed part, not of the whole file. No-op on a stream that writes. */
void ckpt__ostream_expect_parts(ckpt_ostream *s, const uint64_t *xxh3, int64_t n);
/* Makes an open stream give the XXH3-128 of its bytes as well (into s->h128
 * at finish); the same pass gives both digests. */
void ckpt__ostream_want128(ckpt_ostream *s);
/* Writes all n bytes (EINTR, short writes handled), updating the checksums:
 * in pieces of 256 KiB, each hashed and then written while it is in the CPU
 * cache (one read of the caller's memory), the writeback of every 16 MiB
 * started at once (sync_file_range). After an error, every call returns
 * that error without writing. Error messages name the file and the OS
 * error. */
int ckpt__ostream_write(ckpt_ostream *s, const void *p, size_t n);
/* Starts a part checksum (e.g. one tensor's bytes) / returns it. */
void ckpt__ostream_part_begin(ckpt_ostream *s);
uint64_t ckpt__ostream_part_digest(const ckpt_ostream *s);
/* fsyncs and closes; *digest = XXH3-64 of all bytes, *size = bytes (both
 * may be NULL). Releases everything on success AND on failure; on failure
 * (or if the stream already had an error) the file is also unlinked. */
int ckpt__ostream_finish(ckpt_ostream *s, uint64_t *digest, uint64_t *size);
/* Closes (if open) and unlinks the file; frees. A no-op after finish (the
 * finished file stays) and on a zeroed or already aborted stream. */
void ckpt__ostream_abort(ckpt_ostream *s);

/* ---- crash-safe publication -------------------------------------------- */
/* Writes path crash-safely: a temporary file ".<name>.tmp.<pid>.<n>" beside
 * it is created, filled by fill(s, ctx), fsynced and closed, renamed over
 * path, and the folder is fsynced. On any failure the temporary file is
 * removed and path is untouched. digest/size (may be NULL) describe the file. */
typedef int (*ckpt_fill_fn)(ckpt_ostream *s, void *ctx);
int ckpt__publish_file(const char *path, ckpt_fill_fn fill, void *ctx, uint64_t *digest,
                       uint64_t *size);
/* Publishes a finished folder: fsync tmp_dir, then rename it to final (if
 * final exists and replace is true: exchange the two atomically and remove
 * the old one, which is left as a hidden leftover if removal fails), then
 * fsync final's parent. CKPT_EEXIST if final exists and !replace. */
int ckpt__publish_dir(const char *tmp_dir, const char *final, bool replace);
/* fsyncs a folder by path. */
int ckpt__fsync_dir(const char *path);
/* mkdir -p with 0755; existing folders are fine; a file in the way is
 * CKPT_EINVAL naming it. */
int ckpt__mkdirs(const char *path);
/* rm -rf of a folder we own (no symlink following). */
int ckpt__remove_tree(const char *path);

/* ---- reads -------------------------------------------------------------- */
typedef struct ckpt_mapped {
    const uint8_t *data;
    uint64_t size;
    void *map_base;     /* for munmap; NULL if data is heap or borrowed */
    size_t map_len;
    void *heap;         /* owned heap copy (small files / no mmap) */
} ckpt_mapped;
/* Opening for reading. A folder may hold anything under a file's name (a
 * FIFO, a device, a symlink), so every read of a file starts here: path is
 * looked at first (a device is never opened), then opened with O_NONBLOCK
 * (cleared once the file is known to be regular: a FIFO swapped in cannot
 * hang the open) and checked again with fstat. own: a file ckpt wrote (a
 * checkpoint's manifest or state file): a symlink is not followed, and
 * anything but a regular file is CKPT_ECORRUPT (damage: a load falls back);
 * else (a user's input) symlinks are followed and anything but a regular
 * file is CKPT_EINVAL. Messages are "<what>: a FIFO, expected a regular
 * file" and the like. Returns the descriptor (the caller closes it), or a
 * negative status. st (may be NULL) gets the open file's fstat. */
int ckpt__open_read(const char *path, const char *what, bool own, struct stat *st);
/* "a FIFO", "a folder", "a symlink", ... for messages. */
const char *ckpt__file_type_name(mode_t mode);

/* Maps a whole regular file read-only (empty files give size 0, data != NULL);
 * a user's input (see ckpt__open_read). Messages name the path. Nothing a
 * load applies comes from such a mapping: another process's write to the
 * file shows through it. */
int ckpt__map_file(const char *path, ckpt_mapped *m);
void ckpt__unmap(ckpt_mapped *m);
/* Reads a checkpoint's file at path, which must hold exactly size bytes, with
 * pread in 256 KiB pieces, hashing each piece (XXH3-64) right after reading
 * it, while it is still in the CPU cache (the kernel reading ahead 8 MiB
 * windows meanwhile): the checksum rides on the read. Into dst (size bytes,
 * memory the caller owns) if not NULL, so the bytes hashed are the bytes
 * kept; else through a 256 KiB scratch piece that never leaves the cache
 * (verification only: memory is not written at all). *digest gets the
 * file's XXH3-64. A file of another size, or one that ends early, or one
 * that is not a regular file (ckpt__open_read, own) is CKPT_ECORRUPT naming
 * what (e.g. "dir: name"). */
int ckpt__read_hashed(const char *path, const char *what, uint64_t size, uint8_t *dst,
                      uint64_t *digest);
/* ckpt__read_hashed (verification only) that also gives the file's
 * XXH3-128: how an incremental save checks that a file it linked has
 * exactly the bytes it would have written. */
int ckpt__read_hashed128(const char *path, const char *what, uint64_t size, uint64_t *digest,
                         ckpt_h128 *wide);
/* ckpt__read_hashed into private heap memory it allocates: m owns it (free
 * with ckpt__unmap). A later write to the file cannot change what m holds. */
int ckpt__read_private(const char *path, const char *what, uint64_t size, ckpt_mapped *m,
                       uint64_t *digest);

/* Tests only: fn(user, path) runs right after each file of a checkpoint was
 * read and verified against the manifest and before any of it is used, so
 * a test can rewrite the file in place at that moment and check that the
 * bytes used are still the verified ones. NULL clears it. */
void ckpt__io_set_verified_hook(void (*fn)(void *user, const char *path), void *user);
void ckpt__io_verified(const char *path);

/* Whether path is on a file system in memory (tmpfs, ramfs: what it holds
 * is gone when the machine stops); false if it cannot be told. */
bool ckpt__in_memory_fs(const char *path);

/* Whether n bytes fit in this process's address space at all (a range of
 * that size can be reserved; nothing is allocated). Checkpoint files whose
 * listed sizes add up past it cannot have been saved from memory: damage. */
bool ckpt__addressable(uint64_t n);

/* A memory area reused from call to call (an asynchronous save's staging,
 * a verified load's read buffers): anonymous pages, grown when asked for
 * more, never shrunk; its pages
 * touched once stay mapped, so the next use takes no page faults. */
typedef struct ckpt_arena {
    uint8_t *p;
    uint64_t cap;
} ckpt_arena;
/* At least n bytes at a->p (the old contents are not kept when it grows). */
int ckpt__arena_reserve(ckpt_arena *a, uint64_t n);
void ckpt__arena_free(ckpt_arena *a);

/* Reads a whole small file (<= max bytes, else CKPT_ECORRUPT) into a
 * NUL-terminated heap buffer; own as for ckpt__open_read. */
int ckpt__read_small_file(const char *path, bool own, uint64_t max, char **out, size_t *len);
/* XXH3-64 of a buffer. */
uint64_t ckpt__xxh3(const void *p, size_t n);
/* XXH3-128 of a buffer. */
ckpt_h128 ckpt__xxh128(const void *p, size_t n);
static inline bool ckpt__h128_eq(ckpt_h128 a, ckpt_h128 b) { return a.lo == b.lo && a.hi == b.hi; }

#endif
