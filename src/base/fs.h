/* fs.h — the one table of the OS calls the library makes on files, folders
 * and mappings.
 *
 * fs.c holds the only implementation (POSIX) and is the only file of the
 * library that names those libc functions (tests/integration/test_layers.sh
 * checks it on the object files). Every other file calls through the table
 * of the moment, ckpt__fs(), mostly by the ckpt__os_* helpers of io.h and
 * below. A test build wraps the table (src/testing: fault injection, the
 * power-loss recorder); the shipped library only ever uses the POSIX one.
 *
 * Each entry has the contract of the libc call it is named after: -1 (NULL,
 * MAP_FAILED) and errno on failure, EINTR returned to the caller (the
 * helpers retry). */
#ifndef CKPT_FS_H
#define CKPT_FS_H

#include <dirent.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/types.h>

/* What a layer may want to know that is not an OS call. */
typedef enum ckpt_fs_note {
    /* value: this process's rank in its job (the accelerator says so once
     * it knows its communicator), for a layer that acts on one rank only. */
    CKPT_FS_NOTE_RANK,
    /* The calling thread's next calls, until EXEMPT_END, are housekeeping
     * (lock files, the undo steps of error paths) that a fault-injecting
     * layer must not fail (a recorder still sees them); they nest. */
    CKPT_FS_NOTE_EXEMPT_BEGIN,
    CKPT_FS_NOTE_EXEMPT_END
} ckpt_fs_note;

typedef struct ckpt_fs {
    /* open/openat always get O_CLOEXEC added. */
    int (*open)(const char *path, int flags, mode_t mode);
    int (*openat)(int dirfd, const char *path, int flags, mode_t mode);
    int (*close)(int fd);
    ssize_t (*pread)(int fd, void *p, size_t n, off_t off);
    ssize_t (*write)(int fd, const void *p, size_t n);
    ssize_t (*pwrite)(int fd, const void *p, size_t n, off_t off);
    off_t (*lseek)(int fd, off_t off, int whence);
    int (*fsync)(int fd);
    int (*ftruncate)(int fd, off_t len);
    /* fcntl(F_SETFL) of O_NONBLOCK on (on) or off. */
    int (*set_nonblock)(int fd, bool on);
    int (*flock)(int fd, int op);
    /* posix_fadvise and sync_file_range(SYNC_FILE_RANGE_WRITE): hints, so
     * they return 0 or an errno value, like posix_fadvise. */
    int (*fadvise)(int fd, off_t off, off_t len, int advice);
    int (*writeback)(int fd, off_t off, off_t len);
    int (*rename)(const char *from, const char *to);
    /* renameat2(AT_FDCWD, from, AT_FDCWD, to, flags): RENAME_EXCHANGE,
     * RENAME_NOREPLACE; ENOSYS where the kernel has none. */
    int (*renameat2)(const char *from, const char *to, unsigned flags);
    int (*mkdir)(const char *path, mode_t mode);
    int (*rmdir)(const char *path);
    int (*unlink)(const char *path);
    int (*link)(const char *from, const char *to);
    int (*stat)(const char *path, struct stat *st);
    int (*lstat)(const char *path, struct stat *st);
    int (*fstat)(int fd, struct stat *st);
    int (*fstatat)(int dirfd, const char *name, struct stat *st, int flags);
    ssize_t (*readlink)(const char *path, char *buf, size_t n);
    DIR *(*opendir)(const char *path);
    struct dirent *(*readdir)(DIR *d);
    int (*closedir)(DIR *d);
    int (*dirfd)(DIR *d);
    void *(*mmap)(void *addr, size_t len, int prot, int flags, int fd, off_t off);
    int (*munmap)(void *p, size_t len);
    /* statfs(2)'s f_type of the file system holding path (what kind of
     * storage a folder is on: tmpfs is memory). */
    int (*fs_type)(const char *path, int64_t *type);
    /* Not an OS call: see ckpt_fs_note. The POSIX table ignores it. */
    void (*note)(ckpt_fs_note what, long value);
} ckpt_fs;

/* The POSIX implementation (fs.c). */
extern const ckpt_fs ckpt__fs_posix;
/* The table in use: the POSIX one unless a test layer was installed. */
extern _Atomic(const ckpt_fs *) ckpt__fs_current;

static inline const ckpt_fs *ckpt__fs(void) {
    return atomic_load_explicit(&ckpt__fs_current, memory_order_acquire);
}
/* Installs t (a layer that wraps the table it replaced, returned) for the
 * whole process. Tests only; before the first call of the layer's users. */
const ckpt_fs *ckpt__fs_install(const ckpt_fs *t);

/* ---- thin helpers for the calls that need no retry or count -------------- */
static inline int ckpt__os_close(int fd) { return ckpt__fs()->close(fd); }
static inline int ckpt__os_stat(const char *p, struct stat *st) { return ckpt__fs()->stat(p, st); }
static inline int ckpt__os_lstat(const char *p, struct stat *st) {
    return ckpt__fs()->lstat(p, st);
}
static inline int ckpt__os_fstat(int fd, struct stat *st) { return ckpt__fs()->fstat(fd, st); }
static inline int ckpt__os_fstatat(int dirfd, const char *name, struct stat *st, int flags) {
    return ckpt__fs()->fstatat(dirfd, name, st, flags);
}
static inline DIR *ckpt__os_opendir(const char *p) { return ckpt__fs()->opendir(p); }
static inline struct dirent *ckpt__os_readdir(DIR *d) { return ckpt__fs()->readdir(d); }
static inline int ckpt__os_closedir(DIR *d) { return ckpt__fs()->closedir(d); }
static inline int ckpt__os_dirfd(DIR *d) { return ckpt__fs()->dirfd(d); }
static inline int ckpt__os_flock(int fd, int op) { return ckpt__fs()->flock(fd, op); }
static inline int ckpt__os_set_nonblock(int fd, bool on) {
    return ckpt__fs()->set_nonblock(fd, on);
}
static inline int ckpt__os_fadvise(int fd, uint64_t off, uint64_t len, int advice) {
    return ckpt__fs()->fadvise(fd, (off_t)off, (off_t)len, advice);
}
static inline int ckpt__os_munmap(void *p, size_t len) { return ckpt__fs()->munmap(p, len); }
/* Anonymous private memory (no file): MAP_FAILED and errno on failure. */
static inline void *ckpt__os_map_anon(size_t len, int prot, int extra_flags) {
    return ckpt__fs()->mmap(NULL, len, prot, MAP_PRIVATE | MAP_ANONYMOUS | extra_flags, -1, 0);
}

/* Tells the table this process's rank (CKPT_FS_NOTE_RANK). */
static inline void ckpt__fs_note_rank(int rank) { ckpt__fs()->note(CKPT_FS_NOTE_RANK, rank); }
/* Brackets housekeeping calls (CKPT_FS_NOTE_EXEMPT_BEGIN/END). */
static inline void ckpt__fs_exempt_begin(void) { ckpt__fs()->note(CKPT_FS_NOTE_EXEMPT_BEGIN, 0); }
static inline void ckpt__fs_exempt_end(void) { ckpt__fs()->note(CKPT_FS_NOTE_EXEMPT_END, 0); }

#endif
