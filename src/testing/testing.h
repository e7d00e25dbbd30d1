/* testing.h — the layers a test build puts over the file-system table
 * (base/fs.h): fault injection, the power-loss recorder and the switches
 * that deliberately break durability. Compiled only into the test variant
 * of the library (CMake option CKPT_FAULT_ENV, which the tests require);
 * the shipped library has none of this and reads no test variable.
 *
 * The layer wraps the table once, when the library is loaded, so it is in
 * place before the first I/O call. */
#ifndef CKPT_TESTING_H
#define CKPT_TESTING_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ---- fault injection ---------------------------------------------------- */
enum {
    CKPT_FAULT_OPEN = 1 << 0,
    CKPT_FAULT_WRITE = 1 << 1,
    CKPT_FAULT_FSYNC = 1 << 2,
    CKPT_FAULT_RENAME = 1 << 3,
    CKPT_FAULT_MKDIR = 1 << 4,
    CKPT_FAULT_READ = 1 << 5,
    CKPT_FAULT_ANY = 0x3f
};
/* From now on, count calls of the kinds in mask; the n-th (1-based) fails
 * with errnum (and, if persist, every later one too). n = 0 disarms. Calls
 * between CKPT_FS_NOTE_EXEMPT_BEGIN/END on their thread are not counted.
 * The environment variable CKPT_FAULT="<kinds>:<n>:<errno name>[:persist]"
 * (kinds: open,write,fsync,rename,mkdir,read,any joined by '+'; e.g.
 * "write:3:ENOSPC") arms it at the first I/O call of a process, so tools and
 * end-to-end tests can inject faults through the public API. With
 * CKPT_FAULT_RANK=<r> as well, it is armed only in the process whose rank
 * is r, when the library notes its rank (CKPT_FS_NOTE_RANK). */
void ckpt__fault_arm(unsigned mask, uint64_t n, int errnum, bool persist);
void ckpt__fault_disarm(void);
/* Calls of the armed kinds made since arming (to find the range of N). */
uint64_t ckpt__fault_count(void);
/* Whether an injected fault has fired since arming. */
bool ckpt__fault_fired(void);
/* Caps every write call at max bytes (0 = no cap), so the short-write
 * paths run. */
void ckpt__fault_set_max_write(size_t max);

/* The environment variable CKPT_OPEN_LOG=<file> makes the layer append
 * "read <path>" or "write <path>" for every file the library opens to
 * <file>, one a line (shared by the processes of a job: O_APPEND). */

/* ---- crash recording ----------------------------------------------------- */
/* Every successful mutating call (and every open, so a recorder can map
 * descriptors to files) is reported to the recorder, if one is set, after
 * it returned. The power-loss simulator (tests/crashsim) rebuilds from this
 * record every state a power cut could leave. */
typedef enum ckpt_io_op {
    CKPT_IO_OPEN,     /* path, flags, fd (the result) */
    CKPT_IO_WRITE,    /* fd, offset, data, len */
    CKPT_IO_TRUNCATE, /* fd, offset (the new length) */
    CKPT_IO_FSYNC,    /* fd (a file or a folder) */
    CKPT_IO_MKDIR,    /* path */
    CKPT_IO_RENAME,   /* path -> path2 (replacing path2 if it exists) */
    CKPT_IO_EXCHANGE, /* path <-> path2 */
    CKPT_IO_LINK,     /* path2 becomes a new name of path */
    CKPT_IO_UNLINK,   /* path */
    CKPT_IO_RMDIR     /* path */
} ckpt_io_op;
typedef struct ckpt_io_event {
    ckpt_io_op op;
    int fd;
    int flags;
    const char *path;
    const char *path2;
    uint64_t offset;
    const void *data; /* valid only during the call */
    size_t len;
} ckpt_io_event;
typedef void (*ckpt_io_record_fn)(void *user, const ckpt_io_event *ev);
/* Sets (fn non-NULL) or clears the recorder. Calls from any thread are
 * reported; the recorder serialises them itself. */
void ckpt__io_set_recorder(ckpt_io_record_fn fn, void *user);

/* Switches that deliberately break durability, so a test can show that the
 * power-loss simulator catches a missing fsync. The layer drops the fsync
 * calls (and the writeback hints) they name before they reach the OS or the
 * recorder. */
enum {
    CKPT_IO_SKIP_FILE_FSYNC = 1 << 0,    /* no fsync of a regular file */
    CKPT_IO_SKIP_PUBLISH_FSYNC = 1 << 1, /* no fsync of a folder */
    CKPT_IO_SKIP_EVERY_FSYNC = 1 << 2    /* no fsync at all (scratch files in tests) */
};
void ckpt__io_set_unsafe(unsigned mask);
unsigned ckpt__io_unsafe(void);

#endif
