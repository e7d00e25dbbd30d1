/* bench_safetensors.c — durable save and load of a state-dict file against
 * the OS tools doing the same bytes, in the same run:
 *
 *   write: ckpt_writer_save (temp file, fsync, rename, folder fsync) of
 *          4 tensors from memory  vs  dd if=/dev/zero bs=1M conv=fsync
 *          (and dd without fsync, the page-cache-only ceiling)
 *   read:  ckpt_reader_open + ckpt_read_tensor into allocated buffers (file
 *          in page cache)  vs  cat file > /dev/null, and vs a memcpy of the
 *          same bytes (what a load into buffers cannot beat)
 *
 *   bench_safetensors [folder] [MiB]     (defaults: . and 1024)
 *
 * Prints seconds, GB/s and ratios (throughput of ckpt / throughput of the
 * tool: above 1 means ckpt is faster). Only the ratios are meaningful. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"

#define NT 4

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static double run_shell(const char *cmd) {
    if (system("sync") != 0) return -1;
    double t0 = now();
    int rc = system(cmd);
    double t = now() - t0;
    if (rc != 0) {
        fprintf(stderr, "bench: command failed: %s\n", cmd);
        exit(1);
    }
    return t;
}

static void die(const char *what) {
    fprintf(stderr, "bench: %s: %s\n", what, ckpt_errmsg());
    exit(1);
}

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : ".";
    long mib = argc > 2 ? atol(argv[2]) : 1024;
    if (mib < NT || mib % NT) {
        fprintf(stderr, "bench: MiB must be a positive multiple of %d\n", NT);
        return 2;
    }
    size_t per = (size_t)mib / NT << 20;
    double gb = (double)mib * 1048576.0 / 1e9;
    char path[4096], ddpath[4096], cmd[8192];
    snprintf(path, sizeof path, "%s/bench_state.safetensors", dir);
    snprintf(ddpath, sizeof ddpath, "%s/bench_dd.bin", dir);

    float *t[NT], *back[NT];
    for (int i = 0; i < NT; i++) {
        t[i] = malloc(per);
        back[i] = malloc(per);
        if (!t[i] || !back[i]) {
            fprintf(stderr, "bench: out of memory\n");
            return 1;
        }
        /* touch every page so neither side pays for first-touch faults */
        size_t n = per / sizeof(float);
        for (size_t k = 0; k < n; k++) t[i][k] = (float)(k % 1000) * 0.001f + (float)i;
        /* non-zero: a zero memset after malloc may become calloc and leave
         * the pages untouched, which would bill page faults to the load */
        memset(back[i], 0xa5, per);
    }
    int64_t shape[1] = {(int64_t)(per / sizeof(float))};

    /* ---- write ---- */
    ckpt_writer *w;
    if (ckpt_writer_new(&w)) die("writer");
    char key[32];
    for (int i = 0; i < NT; i++) {
        snprintf(key, sizeof key, "layer%d.weight", i);
        if (ckpt_write_tensor(w, key, CKPT_F32, 1, shape, t[i])) die("write_tensor");
    }
    unlink(path);
    if (system("sync") != 0) return 1;
    double t0 = now();
    if (ckpt_writer_save(w, path)) die("save");
    double t_save = now() - t0;

    snprintf(cmd, sizeof cmd, "dd if=/dev/zero of='%s' bs=1M count=%ld conv=fsync status=none",
             ddpath, mib);
    unlink(ddpath);
    double t_dd_sync = run_shell(cmd);
    snprintf(cmd, sizeof cmd, "dd if=/dev/zero of='%s' bs=1M count=%ld status=none", ddpath, mib);
    unlink(ddpath);
    double t_dd = run_shell(cmd);
    unlink(ddpath);

    /* ---- read (the file is in the page cache after the save) ----
     * Best of 3, interleaved: the machine is shared and a single sub-second
     * measurement is at the mercy of whatever else runs. */
    snprintf(cmd, sizeof cmd, "cat '%s' > /dev/null", path);
    double t_cat = 1e30, t_load = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        double tc = run_shell(cmd);
        if (tc < t_cat) t_cat = tc;
        t0 = now();
        ckpt_reader *r;
        if (ckpt_reader_open(&r, path)) die("open");
        for (int i = 0; i < NT; i++) {
            snprintf(key, sizeof key, "layer%d.weight", i);
            if (ckpt_read_tensor(r, key, CKPT_F32, 1, shape, back[i])) die("read_tensor");
        }
        ckpt_reader_free(r);
        double tl = now() - t0;
        if (tl < t_load) t_load = tl;
    }
    for (int i = 0; i < NT; i++)
        if (memcmp(t[i], back[i], per) != 0) {
            fprintf(stderr, "bench: tensor %d read back differently\n", i);
            return 1;
        }

    /* The floor for any load into buffers: copying the same bytes from
     * memory (cat never writes its data anywhere big, a load must). */
    double t_memcpy = 1e30;
    for (int rep = 0; rep < 3; rep++) {
        t0 = now();
        for (int i = 0; i < NT; i++) memcpy(back[i], t[i], per);
        double tm = now() - t0;
        if (tm < t_memcpy) t_memcpy = tm;
    }
    if (memcmp(back[NT - 1], t[NT - 1], 64) != 0) return 1;

    printf("bench_safetensors: %ld MiB in %d tensors, folder %s\n", mib, NT, dir);
    printf("  write  ckpt_writer_save (durable)   %7.3f s  %6.2f GB/s\n", t_save, gb / t_save);
    printf("         dd conv=fsync                %7.3f s  %6.2f GB/s\n", t_dd_sync, gb / t_dd_sync);
    printf("         dd (no fsync)                %7.3f s  %6.2f GB/s\n", t_dd, gb / t_dd);
    printf("  read   ckpt_read_tensor x %d         %7.3f s  %6.2f GB/s\n", NT, t_load, gb / t_load);
    printf("         cat > /dev/null              %7.3f s  %6.2f GB/s\n", t_cat, gb / t_cat);
    printf("         memcpy of the same bytes     %7.3f s  %6.2f GB/s\n", t_memcpy, gb / t_memcpy);
    printf("  ratio  save / dd conv=fsync          %.2fx  (target >= 0.9)\n", t_dd_sync / t_save);
    printf("  ratio  save / dd without fsync       %.2fx  (ckpt still fsyncs)\n", t_dd / t_save);
    printf("  ratio  load / cat                    %.2fx  (target >= 0.8)\n", t_cat / t_load);
    printf("  ratio  load / memcpy                 %.2fx  (memory-bandwidth ceiling)\n", t_memcpy / t_load);

    unlink(path);
    ckpt_writer_free(w);
    for (int i = 0; i < NT; i++) {
        free(t[i]);
        free(back[i]);
    }
    return 0;
}
