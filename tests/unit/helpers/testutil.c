/* testutil.c — see testutil.h. */
#include <stdarg.h>
#include <stddef.h>
#include <setjmp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/io.h"
#include "helpers/testutil.h"

int tu_tmpdir_make(char *buf, size_t cap, const char *tag) {
    int n = snprintf(buf, cap, "/tmp/ckpt_%s_XXXXXX", tag);
    if (n < 0 || (size_t)n >= cap) return -1;
    return mkdtemp(buf) ? 0 : -1;
}

int tu_tmpdir_remove(const char *dir) { return ckpt__remove_tree(dir) == CKPT_OK ? 0 : -1; }

char *tu_tmpdir_new(const char *tag) {
    char buf[256];
    assert_int_equal(tu_tmpdir_make(buf, sizeof buf, tag), 0);
    char *t = strdup(buf);
    assert_non_null(t);
    return t;
}

void tu_tmpdir_free(char *dir) {
    assert_int_equal(tu_tmpdir_remove(dir), 0);
    free(dir);
}

static char tu_current_dir[256];

int tu_tmpdir_setup(void **state) {
    if (tu_tmpdir_make(tu_current_dir, sizeof tu_current_dir, program_invocation_short_name) != 0)
        return -1;
    *state = tu_current_dir;
    return 0;
}

int tu_tmpdir_teardown(void **state) {
    (void)state;
    int rc = tu_tmpdir_remove(tu_current_dir);
    tu_current_dir[0] = '\0';
    return rc;
}

const char *tu_dir(void) {
    assert_true(tu_current_dir[0] != '\0');
    return tu_current_dir;
}

char *tu_path(char *buf, size_t cap, const char *dir, const char *name) {
    int n = snprintf(buf, cap, "%s/%s", dir, name);
    assert_true(n >= 0 && (size_t)n < cap);
    return buf;
}

char *tu_pathf(const char *fmt, ...) {
    char buf[4096];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    char *p = strdup(buf);
    assert_non_null(p);
    return p;
}

bool tu_exists(const char *path) {
    struct stat st;
    return lstat(path, &st) == 0;
}

int tu_count_hidden_tmp(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return 0;
    int n = 0;
    struct dirent *e;
    while ((e = readdir(d)) != NULL)
        if (e->d_name[0] == '.' && (strstr(e->d_name, ".tmp") || strstr(e->d_name, ".old."))) n++;
    closedir(d);
    return n;
}

char *tu_read_file(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    if (!fp) fail_msg("cannot open %s", path);
    assert_int_equal(fseek(fp, 0, SEEK_END), 0);
    long len = ftell(fp);
    assert_true(len >= 0);
    assert_int_equal(fseek(fp, 0, SEEK_SET), 0);
    char *buf = malloc((size_t)len + 1);
    assert_non_null(buf);
    assert_int_equal(fread(buf, 1, (size_t)len, fp), (size_t)len);
    fclose(fp);
    buf[len] = '\0';
    *n = (size_t)len;
    return buf;
}

void tu_write_file(const char *path, const void *data, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp) fail_msg("cannot create %s", path);
    assert_int_equal(fwrite(data, 1, n, fp), n);
    assert_int_equal(fclose(fp), 0);
}

void tu_write_text(const char *path, const char *text) { tu_write_file(path, text, strlen(text)); }

off_t tu_file_size(const char *path) {
    struct stat s;
    if (stat(path, &s) != 0) fail_msg("cannot stat %s", path);
    return s.st_size;
}

void tu_flip_byte(const char *path, off_t off) {
    int fd = open(path, O_RDWR);
    if (fd < 0) fail_msg("cannot open %s", path);
    struct stat s;
    assert_int_equal(fstat(fd, &s), 0);
    if (off < 0) off += s.st_size;
    assert_true(off >= 0 && off < s.st_size);
    unsigned char b;
    assert_int_equal(pread(fd, &b, 1, off), 1);
    b ^= 0x01;
    assert_int_equal(pwrite(fd, &b, 1, off), 1);
    close(fd);
}

void tu_truncate(const char *path, off_t size) { assert_int_equal(truncate(path, size), 0); }

void tu_assert_file_is(const char *path, const void *data, size_t n) {
    size_t len = 0;
    char *buf = tu_read_file(path, &len);
    tu_assert_bytes_equal(buf, len, data, n);
    free(buf);
}

void tu_assert_file_text(const char *path, const char *text) { tu_assert_file_is(path, text, strlen(text)); }

void tu_assert_same_file(const char *a, const char *b, const char *what) {
    ckpt_mapped ma, mb;
    assert_int_equal(ckpt__map_file(a, &ma), 0);
    assert_int_equal(ckpt__map_file(b, &mb), 0);
    if (ma.size != mb.size || memcmp(ma.data, mb.data, (size_t)ma.size) != 0)
        fail_msg("%s differs: %s vs %s", what, a, b);
    ckpt__unmap(&ma);
    ckpt__unmap(&mb);
}

void tu_assert_bytes_equal(const void *a, size_t na, const void *b, size_t nb) {
    assert_int_equal(na, nb);
    assert_memory_equal(a, b, na);
}

void tu_save_state(const ckpt_stateful_ops *ops, void *self, const char *path) {
    ckpt_writer *w = NULL;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    assert_int_equal(ops->state_dict(self, w), CKPT_OK);
    assert_int_equal(ckpt_writer_save(w, path), CKPT_OK);
    ckpt_writer_free(w);
}

int tu_load_state(const ckpt_stateful_ops *ops, void *self, const char *path) {
    ckpt_reader *r = NULL;
    assert_int_equal(ckpt_reader_open(&r, path), CKPT_OK);
    int rc = ops->load_state_dict(self, r);
    ckpt_reader_free(r);
    return rc;
}

char *tu_state_bytes(const ckpt_stateful_ops *ops, void *self, const char *path, size_t *n) {
    tu_save_state(ops, self, path);
    return tu_read_file(path, n);
}

void tu_copy_state_with(const char *src, const char *dst, const char *key, double v, int elem) {
    ckpt_reader *r;
    assert_int_equal(ckpt_reader_open(&r, src), CKPT_OK);
    ckpt_writer *w;
    assert_int_equal(ckpt_writer_new(&w), CKPT_OK);
    void *bufs[64];
    int nbufs = 0;
    for (int64_t i = 0; i < ckpt_reader_count(r); i++) {
        ckpt_entry_info e;
        assert_int_equal(ckpt_reader_entry(r, i, &e), CKPT_OK);
        bool hit = key && strcmp(e.key, key) == 0;
        if (e.kind == CKPT_ENTRY_TENSOR) {
            assert_true(nbufs < 64);
            void *buf = bufs[nbufs++] = malloc(e.nbytes ? e.nbytes : 1);
            assert_non_null(buf);
            assert_int_equal(ckpt_read_tensor(r, e.key, e.dtype, e.ndim, e.shape, buf), CKPT_OK);
            if (hit && e.dtype == CKPT_F32) ((float *)buf)[elem] = (float)v;
            if (hit && e.dtype == CKPT_I64) ((int64_t *)buf)[elem] = (int64_t)v;
            assert_int_equal(ckpt_write_tensor(w, e.key, e.dtype, e.ndim, e.shape, buf), CKPT_OK);
        } else if (e.kind == CKPT_ENTRY_F64) {
            double x;
            assert_int_equal(ckpt_read_f64(r, e.key, &x), CKPT_OK);
            assert_int_equal(ckpt_write_f64(w, e.key, hit ? v : x), CKPT_OK);
        } else if (e.kind == CKPT_ENTRY_I64) {
            int64_t x;
            assert_int_equal(ckpt_read_i64(r, e.key, &x), CKPT_OK);
            assert_int_equal(ckpt_write_i64(w, e.key, hit ? (int64_t)v : x), CKPT_OK);
        } else {
            char str[64];
            assert_int_equal(ckpt_read_str(r, e.key, str, sizeof str), CKPT_OK);
            assert_int_equal(ckpt_write_str(w, e.key, str), CKPT_OK);
        }
    }
    assert_int_equal(ckpt_writer_save(w, dst), CKPT_OK);
    ckpt_writer_free(w);
    for (int i = 0; i < nbufs; i++) free(bufs[i]);
    ckpt_reader_free(r);
}

void tu_check_state(const ckpt_stateful_ops *ops, void *self, ckpt_reader *r, int code,
                    const char *needle, size_t case_no, char *msg, size_t cap) {
    ckpt_clear_error();
    assert_int_equal(ops->check_state_dict(self, r), code);
    snprintf(msg, cap, "%s", ckpt_errmsg());
    if (!strstr(msg, needle)) fail_msg("case %zu: \"%s\"", case_no, msg);
}

void tu_load_state_like_check(const ckpt_stateful_ops *ops, void *self, ckpt_reader *r, int code,
                              const char *msg) {
    ckpt_clear_error();
    assert_int_equal(ops->load_state_dict(self, r), code);
    assert_string_equal(ckpt_errmsg(), msg);
}

void tu_assert_contains(const char *hay, const char *needle) {
    if (!strstr(hay, needle)) fail_msg("message \"%s\" does not contain \"%s\"", hay, needle);
}

void tu_assert_errmsg_has(const char *needle) {
    if (!strstr(ckpt_errmsg(), needle)) fail_msg("message \"%s\" lacks \"%s\"", ckpt_errmsg(), needle);
}

void tu_expect_error(int rc, int code, const char *substring) {
    if (rc != code) fail_msg("status %d, expected %d (message: \"%s\")", rc, code, ckpt_errmsg());
    if (substring) tu_assert_errmsg_has(substring);
}
