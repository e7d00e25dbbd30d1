/* bench_util.h — what the benchmarks share: the clocks (wall, the process's
 * and the calling thread's CPU time), a failure that names the benchmark,
 * the median of the paired runs' ratios, the kernel's figures of this
 * process's memory (/proc/self/status), and the raw read every load is
 * measured against. Header-only, so each benchmark stays one program, and
 * it uses the public API only, so that it builds against an older tree too
 * (copied there with foreign.h for a "before" column).
 *
 * Define BENCH_NAME (the program's name, for messages) before including it;
 * BENCH_DIE_CODE is the exit status of die() (default 1). */
#ifndef CKPT_BENCH_UTIL_H
#define CKPT_BENCH_UTIL_H

#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"

#ifndef BENCH_NAME
#error "define BENCH_NAME before including bench_util.h"
#endif
#ifndef BENCH_DIE_CODE
#define BENCH_DIE_CODE 1
#endif

static inline double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static inline double rusage_seconds(int who) {
    struct rusage ru;
    if (getrusage(who, &ru) != 0) return 0;
    return (double)ru.ru_utime.tv_sec + (double)ru.ru_utime.tv_usec * 1e-6 +
           (double)ru.ru_stime.tv_sec + (double)ru.ru_stime.tv_usec * 1e-6;
}

/* User + system CPU time of the process, and of the calling thread (what
 * other work on the machine cannot stretch). */
static inline double cpu(void) { return rusage_seconds(RUSAGE_SELF); }
static inline double thread_cpu(void) { return rusage_seconds(RUSAGE_THREAD); }

/* "<bench>: <what>: <the library's last message>", then exit. */
static inline void die(const char *what) {
    fprintf(stderr, "%s: %s: %s\n", BENCH_NAME, what, ckpt_errmsg());
    exit(BENCH_DIE_CODE);
}

static inline int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* The median of v[0..n), v left as it is. */
static inline double median(const double *v, int n) {
    double small[64], *s = n <= 64 ? small : malloc((size_t)n * sizeof *s);
    if (n < 1 || !s) return 0;
    memcpy(s, v, (size_t)n * sizeof *v);
    qsort(s, (size_t)n, sizeof *s, cmp_double);
    double m = n % 2 ? s[n / 2] : (s[n / 2 - 1] + s[n / 2]) / 2;
    if (s != small) free(s);
    return m;
}

/* The machine's load average over the last minute, as /proc/loadavg
 * gives it ("?" if it cannot be read): printed with every run's figures. */
static inline const char *load_average(char *buf, size_t cap) {
    snprintf(buf, cap, "?");
    FILE *f = fopen("/proc/loadavg", "r");
    if (!f) return buf;
    if (!fgets(buf, (int)cap, f)) snprintf(buf, cap, "?");
    buf[strcspn(buf, " \n")] = '\0';
    fclose(f);
    return buf;
}

/* A field of /proc/self/status in KiB ("VmRSS", "VmHWM"); -1 if absent. */
static inline long status_kib(const char *field) {
    FILE *f = fopen("/proc/self/status", "r");
    if (!f) return -1;
    char line[256];
    long v = -1;
    size_t k = strlen(field);
    while (fgets(line, sizeof line, f))
        if (strncmp(line, field, k) == 0 && line[k] == ':') {
            v = atol(line + k + 1);
            break;
        }
    fclose(f);
    return v;
}

/* Every file of dir read with pread in 8 MiB pieces into buf, one after
 * the other (at most cap bytes): the raw read a load is measured against.
 * Returns the bytes read. */
static inline uint64_t raw_read_dir(const char *dir, uint8_t *buf, uint64_t cap) {
    DIR *d = opendir(dir);
    if (!d) die("opendir");
    struct dirent *e;
    uint64_t at = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[4400];
        snprintf(path, sizeof path, "%.4000s/%.300s", dir, e->d_name);
        int fd = open(path, O_RDONLY);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) die("open");
        uint64_t off = 0, size = (uint64_t)st.st_size;
        if (at + size > cap) die("raw read: buffer too small");
        while (off < size) {
            size_t want = size - off < (8u << 20) ? (size_t)(size - off) : (8u << 20);
            ssize_t r = pread(fd, buf + at + off, want, (off_t)off);
            if (r <= 0) die("pread");
            off += (uint64_t)r;
        }
        close(fd);
        at += size;
    }
    closedir(d);
    return at;
}

#endif
