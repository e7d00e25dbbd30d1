/* digits.c — reads data/digits.csv.gz (zlib reads plain files as well). */
#include "digits.h"

#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

int digits_parse_line(const char *line, digits_sample *s, char *err, size_t errcap) {
    const char *p = line;
    for (int i = 0; i <= DIGITS_PIXELS; i++) {
        char *end;
        errno = 0;
        long v = strtol(p, &end, 10);
        if (end == p || errno) {
            snprintf(err, errcap, "field %d: expected an integer", i + 1);
            return -1;
        }
        long hi = i < DIGITS_PIXELS ? 16 : DIGITS_CLASSES - 1;
        if (v < 0 || v > hi) {
            snprintf(err, errcap, "field %d: expected 0..%ld, got %ld", i + 1, hi, v);
            return -1;
        }
        if (i < DIGITS_PIXELS) {
            s->x[i] = (float)v / 16.0f;
            if (*end != ',') {
                snprintf(err, errcap, "expected %d fields, got %d", DIGITS_PIXELS + 1, i + 1);
                return -1;
            }
            p = end + 1;
        } else {
            s->label = (int32_t)v;
            while (*end == '\r' || *end == '\n' || *end == ' ') end++;
            if (*end) {
                snprintf(err, errcap, "expected %d fields, got more", DIGITS_PIXELS + 1);
                return -1;
            }
        }
    }
    return 0;
}

int digits_load(const char *path, digits_sample **out, int64_t *n, char *err, size_t errcap) {
    *out = NULL;
    *n = 0;
    /* Never blocks on a FIFO: only a regular file is read. */
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC);
    struct stat st;
    const char *bad = NULL;
    if (fd < 0 || fstat(fd, &st) != 0) bad = strerror(errno);
    else if (!S_ISREG(st.st_mode)) bad = "not a regular file";
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) bad = strerror(errno);
    if (bad) {
        if (fd >= 0) close(fd);
        snprintf(err, errcap, "%s: %s", path, bad);
        return -1;
    }
    gzFile f = gzdopen(fd, "rb");
    if (!f) {
        close(fd);
        snprintf(err, errcap, "%s: %s", path, errno ? strerror(errno) : "cannot open");
        return -1;
    }
    int64_t cap = 2048, count = 0, lineno = 0;
    digits_sample *rows = malloc((size_t)cap * sizeof *rows);
    char line[1024], why[128];
    int rc = rows ? 0 : -1;
    if (!rows) snprintf(err, errcap, "%s: out of memory", path);
    while (rc == 0 && gzgets(f, line, sizeof line)) {
        lineno++;
        if (!strchr(line, '\n') && !gzeof(f)) {
            snprintf(err, errcap, "%s:%lld: line too long", path, (long long)lineno);
            rc = -1;
            break;
        }
        if (line[0] == '\n' || line[0] == '\0') continue;
        if (count == cap) {
            digits_sample *bigger = realloc(rows, (size_t)(cap * 2) * sizeof *rows);
            if (!bigger) {
                snprintf(err, errcap, "%s: out of memory", path);
                rc = -1;
                break;
            }
            rows = bigger;
            cap *= 2;
        }
        if (digits_parse_line(line, &rows[count], why, sizeof why) != 0) {
            snprintf(err, errcap, "%s:%lld: %s", path, (long long)lineno, why);
            rc = -1;
            break;
        }
        count++;
    }
    int zerr = 0;
    const char *zmsg = gzerror(f, &zerr);
    if (rc == 0 && zerr != Z_OK) {
        snprintf(err, errcap, "%s: read error: %s", path, zmsg);
        rc = -1;
    }
    gzclose(f);
    if (rc == 0 && count == 0) {
        snprintf(err, errcap, "%s: no rows", path);
        rc = -1;
    }
    if (rc != 0) {
        free(rows);
        return -1;
    }
    *out = rows;
    *n = count;
    return 0;
}
