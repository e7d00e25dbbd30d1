/* io_int.h — internals shared by the files of the I/O layer (io.c,
 * io_stream.c, io_publish.c, io_read.c); nothing outside src/base/io*.c
 * includes it. */
#ifndef CKPT_IO_INT_H
#define CKPT_IO_INT_H

#include <stdint.h>

/* rename that a test layer does not fail: the undo steps of error paths. */
int ckpt__os_rename_raw(const char *from, const char *to);
/* rename that refuses to replace an existing target (RENAME_NOREPLACE, or a
 * check plus rename where the file system lacks it). */
int ckpt__os_rename_noreplace(const char *from, const char *to);
/* Starts writing back [off, off+len) of fd (sync_file_range): a hint, 0 or
 * an errno value. */
int ckpt__os_writeback(int fd, uint64_t off, uint64_t len);

#endif
