/* testutil.h — helpers shared by the unit tests (tests/unit/test_*.c):
 * temporary folders, paths, whole-file reads and writes, byte flips and
 * truncation, state-dict round trips through a file, and error checks.
 * Every helper fails the current cmocka test on an unexpected error. */
#ifndef CKPT_TESTUTIL_H
#define CKPT_TESTUTIL_H

#include <stdbool.h>
#include <stddef.h>
#include <sys/types.h>

#include "ckpt.h"

/* ---- temporary folders --------------------------------------------------- */

/* Creates /tmp/ckpt_<tag>_XXXXXX into buf (cap bytes); 0 on success, -1 if
 * not (so a cmocka setup function can return it directly). */
int tu_tmpdir_make(char *buf, size_t cap, const char *tag);
/* Removes dir and everything below it; 0 on success, -1 if not. */
int tu_tmpdir_remove(const char *dir);

/* The same as a heap string: asserts the folder was made / removed; free
 * releases the string. */
char *tu_tmpdir_new(const char *tag);
void tu_tmpdir_free(char *dir);

/* A cmocka setup/teardown pair (per test or per group): a fresh folder
 * /tmp/ckpt_<program>_XXXXXX, named by tu_dir() (and put in *state),
 * removed with everything in it afterwards. */
int tu_tmpdir_setup(void **state);
int tu_tmpdir_teardown(void **state);
/* The folder of the current tu_tmpdir_setup. */
const char *tu_dir(void);

/* ---- paths --------------------------------------------------------------- */

/* Writes dir/name into buf (cap bytes, asserted large enough); returns buf. */
char *tu_path(char *buf, size_t cap, const char *dir, const char *name);
/* printf-formatted path as a heap string (free it). */
char *tu_pathf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/* Whether path exists (lstat: a dangling link counts). */
bool tu_exists(const char *path);
/* Entries of dir whose names start with '.' and contain ".tmp" or ".old."
 * (left-over temporary files); 0 if dir does not exist. */
int tu_count_hidden_tmp(const char *dir);

/* ---- whole files --------------------------------------------------------- */

/* The file's bytes (heap, with a NUL after the last byte); *n = its size. */
char *tu_read_file(const char *path, size_t *n);
/* Creates or replaces path with the n bytes at data. */
void tu_write_file(const char *path, const void *data, size_t n);
/* Creates or replaces path with the text (without its NUL). */
void tu_write_text(const char *path, const char *text);
/* The size of path in bytes. */
off_t tu_file_size(const char *path);
/* XORs the byte at offset off with 0x01; off < 0 counts from the end
 * (-1 is the last byte). */
void tu_flip_byte(const char *path, off_t off);
/* Cuts (or extends) path to size bytes. */
void tu_truncate(const char *path, off_t size);
/* Fails unless path holds exactly the n bytes at data / the text. */
void tu_assert_file_is(const char *path, const void *data, size_t n);
void tu_assert_file_text(const char *path, const char *text);
/* Asserts two files hold the same bytes; what names them in the failure. */
void tu_assert_same_file(const char *a, const char *b, const char *what);

/* Fails unless the na bytes at a and the nb bytes at b are the same
 * (same length, same bytes). */
void tu_assert_bytes_equal(const void *a, size_t na, const void *b, size_t nb);

/* ---- state dicts through a file ----------------------------------------- */

/* Writes self's state dict (ops->state_dict) to path; asserts success. */
void tu_save_state(const ckpt_stateful_ops *ops, void *self, const char *path);
/* Loads path into self with ops->load_state_dict; the open is asserted, the
 * load's status is returned. */
int tu_load_state(const ckpt_stateful_ops *ops, void *self, const char *path);
/* Saves self's state dict to path and returns the file's bytes (free them). */
char *tu_state_bytes(const ckpt_stateful_ops *ops, void *self, const char *path, size_t *n);
/* Copies the state dict at src to dst with one entry replaced by v: an f64
 * or i64 key, or element elem of an F32 / I64 tensor (NULL key: a plain
 * copy); strings are copied as they are. */
void tu_copy_state_with(const char *src, const char *dst, const char *key, double v, int elem);
/* check_state_dict against load_state_dict, one case of a table: with the
 * error cleared, ops->check_state_dict(self, r) returns code and a message
 * containing needle (case_no names the case on failure); the message is
 * copied to msg (cap bytes). */
void tu_check_state(const ckpt_stateful_ops *ops, void *self, ckpt_reader *r, int code,
                    const char *needle, size_t case_no, char *msg, size_t cap);
/* Then, with the error cleared, ops->load_state_dict(self, r) returns the
 * same code with exactly the same message. */
void tu_load_state_like_check(const ckpt_stateful_ops *ops, void *self, ckpt_reader *r, int code,
                              const char *msg);

/* ---- errors and messages ------------------------------------------------- */

/* Fails unless hay contains needle. */
void tu_assert_contains(const char *hay, const char *needle);
/* Fails unless ckpt_errmsg() contains needle. */
void tu_assert_errmsg_has(const char *needle);
/* Fails unless rc == code and (if substring is not NULL) ckpt_errmsg()
 * contains substring; prints ckpt_errmsg() on a mismatch. */
void tu_expect_error(int rc, int code, const char *substring);

#endif
