/* fs.c — the POSIX implementation of the file-system table (fs.h): the only
 * file of the library that calls libc's file, folder and mapping functions. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/vfs.h>
#include <unistd.h>

#include "base/fs.h"

static int posix_open(const char *path, int flags, mode_t mode) {
    return open(path, flags | O_CLOEXEC, mode);
}

static int posix_openat(int dirfd_, const char *path, int flags, mode_t mode) {
    return openat(dirfd_, path, flags | O_CLOEXEC, mode);
}

static int posix_set_nonblock(int fd, bool on) {
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0) return -1;
    return fcntl(fd, F_SETFL, on ? fl | O_NONBLOCK : fl & ~O_NONBLOCK);
}

static int fs_fadvise(int fd, off_t off, off_t len, int advice) {
    return posix_fadvise(fd, off, len, advice);
}

static int posix_writeback(int fd, off_t off, off_t len) {
    return sync_file_range(fd, off, len, SYNC_FILE_RANGE_WRITE) == 0 ? 0 : errno;
}

/* Through syscall(): older C libraries have no renameat2 wrapper. */
static int posix_renameat2(const char *from, const char *to, unsigned flags) {
#ifdef SYS_renameat2
    return (int)syscall(SYS_renameat2, AT_FDCWD, from, AT_FDCWD, to, flags);
#else
    (void)from;
    (void)to;
    (void)flags;
    errno = ENOSYS;
    return -1;
#endif
}

static int posix_fstatat(int dirfd_, const char *name, struct stat *st, int flags) {
    return fstatat(dirfd_, name, st, flags);
}

static int posix_fs_type(const char *path, int64_t *type) {
    struct statfs st;
    if (statfs(path, &st) != 0) return -1;
    *type = (int64_t)st.f_type;
    return 0;
}

static ssize_t posix_readlink(const char *path, char *buf, size_t n) {
    return readlink(path, buf, n);
}

static void posix_note(ckpt_fs_note what, long value) {
    (void)what;
    (void)value;
}

const ckpt_fs ckpt__fs_posix = {
    .open = posix_open,
    .openat = posix_openat,
    .close = close,
    .pread = pread,
    .write = write,
    .pwrite = pwrite,
    .lseek = lseek,
    .fsync = fsync,
    .ftruncate = ftruncate,
    .set_nonblock = posix_set_nonblock,
    .flock = flock,
    .fadvise = fs_fadvise,
    .writeback = posix_writeback,
    .rename = rename,
    .renameat2 = posix_renameat2,
    .mkdir = mkdir,
    .rmdir = rmdir,
    .unlink = unlink,
    .link = link,
    .stat = stat,
    .lstat = lstat,
    .fstat = fstat,
    .fstatat = posix_fstatat,
    .readlink = posix_readlink,
    .opendir = opendir,
    .readdir = readdir,
    .closedir = closedir,
    .dirfd = dirfd,
    .mmap = mmap,
    .munmap = munmap,
    .fs_type = posix_fs_type,
    .note = posix_note,
};

_Atomic(const ckpt_fs *) ckpt__fs_current = &ckpt__fs_posix;

const ckpt_fs *ckpt__fs_install(const ckpt_fs *t) {
    return atomic_exchange_explicit(&ckpt__fs_current, t, memory_order_acq_rel);
}
