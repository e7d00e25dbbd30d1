/* reseal_manifest.c — recomputes the self-checksum of a checkpoint.json a
 * test edited, as a forger would, so that what a reader must catch is the
 * edit itself (a forged size, a missing file) and not the checksum.
 *
 *   reseal_manifest <checkpoint.json>
 *
 * The checksum is XXH3-64 of the file with the 16 digits of its
 * "manifest_xxh3" member set to '0' (docs/FORMAT.md). */
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The library's XXH3-64 (an internal symbol of the static library). */
uint64_t ckpt__xxh3(const void *p, size_t n);

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: reseal_manifest <checkpoint.json>\n");
        return 2;
    }
    FILE *f = fopen(argv[1], "rb");
    if (!f) {
        perror(argv[1]);
        return 1;
    }
    static char text[1 << 24];
    size_t len = fread(text, 1, sizeof text, f);
    fclose(f);
    static const char prefix[] = "\"manifest_xxh3\": \"";
    char *at = NULL;
    for (size_t i = 0; i + sizeof prefix - 1 + 17 <= len; i++)
        if (memcmp(text + i, prefix, sizeof prefix - 1) == 0) {
            at = text + i + sizeof prefix - 1;
            break;
        }
    if (!at) {
        fprintf(stderr, "reseal_manifest: %s: no manifest_xxh3 member\n", argv[1]);
        return 1;
    }
    memset(at, '0', 16);
    char hex[17];
    snprintf(hex, sizeof hex, "%016" PRIx64, ckpt__xxh3(text, len));
    memcpy(at, hex, 16);
    f = fopen(argv[1], "wb");
    if (!f || fwrite(text, 1, len, f) != len || fclose(f) != 0) {
        perror(argv[1]);
        return 1;
    }
    return 0;
}
