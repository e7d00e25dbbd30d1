/* replay_main.c — a plain main for fuzz targets: runs every file of the
 * corpus folder given as argv[1] through LLVMFuzzerTestOneInput, so the
 * ordinary test run replays what the fuzzer found (under the sanitizers). */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static int cmp_names(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s <corpus folder>\n", argv[0]);
        return 2;
    }
    DIR *d = opendir(argv[1]);
    if (!d) {
        perror(argv[1]);
        return 2;
    }
    char **names = NULL;
    size_t n = 0, cap = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.') continue;
        if (n == cap) {
            cap = cap ? cap * 2 : 64;
            names = realloc(names, cap * sizeof *names);
            if (!names) return 2;
        }
        names[n++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(names, n, sizeof *names, cmp_names); /* a stable order for reproducible logs */
    size_t ran = 0;
    for (size_t i = 0; i < n; i++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", argv[1], names[i]);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode)) {
            free(names[i]);
            continue;
        }
        FILE *f = fopen(path, "rb");
        if (!f) {
            perror(path);
            return 1;
        }
        size_t len = (size_t)st.st_size;
        uint8_t *buf = malloc(len ? len : 1);
        if (!buf || fread(buf, 1, len, f) != len) {
            fprintf(stderr, "%s: read failed\n", path);
            return 1;
        }
        fclose(f);
        LLVMFuzzerTestOneInput(buf, len);
        free(buf);
        free(names[i]);
        ran++;
    }
    free(names);
    printf("replayed %zu inputs from %s\n", ran, argv[1]);
    return 0;
}
