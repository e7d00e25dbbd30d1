/* s3_tool.c — drives the object-store client (src/store/s3) from the
 * integration tests, one operation per run:
 *
 *   s3_tool put <bucket> <key> <file> [absent]    PUT (If-None-Match: * with "absent")
 *   s3_tool upload <bucket> <key> <file> [piece]  streamed upload, written in pieces
 *   s3_tool get <bucket> <key> <size> <out>       parallel ranged GET, hashed in order
 *   s3_tool getmany <bucket> <key> <size> [<key> <size>...]
 *                                                 several objects' ranges at once (no HEAD)
 *   s3_tool copy <bucket> <src> <dst> <size> [etag]  server-side copy (if the source's ETag
 *                                                 is etag)
 *   s3_tool head <bucket> <key>
 *   s3_tool cat <bucket> <key>                    small GET to stdout
 *   s3_tool delete <bucket> <key>
 *   s3_tool list <bucket> <prefix> [delimiter]
 *
 * Prints what it learned, then "requests=N retries=M"; on failure
 * "error <STATUS>: <message>" on stderr and exit 1. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "base/io.h"
#include "store/s3/s3.h"

static char *slurp(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        perror(path);
        exit(2);
    }
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)len + 1);
    if (!p || fread(p, 1, (size_t)len, f) != (size_t)len) {
        perror(path);
        exit(2);
    }
    fclose(f);
    *n = (size_t)len;
    return p;
}

static int print_item(void *user, const char *key, uint64_t size, bool is_prefix) {
    (void)user;
    printf("%s %s %" PRIu64 "\n", is_prefix ? "prefix" : "key", key, size);
    return 0;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: s3_tool <op> <bucket> <key> ...\n");
        return 2;
    }
    const char *op = argv[1], *bucket = argv[2], *key = argv[3];
    ckpt_s3 *c = NULL;
    int rc = ckpt__s3_new(&c, bucket);
    if (rc == 0 && getenv("S3_TOOL_LIST_PAGE"))
        ckpt__s3_set_list_page(c, atoi(getenv("S3_TOOL_LIST_PAGE")));
    if (rc == 0 && strcmp(op, "put") == 0 && argc >= 5) {
        size_t n;
        char *p = slurp(argv[4], &n);
        char etag[128] = "";
        rc = ckpt__s3_put(c, key, p, n,
                          argc > 5 && strcmp(argv[5], "absent") == 0 ? CKPT_S3_IF_ABSENT
                                                                     : CKPT_S3_ALWAYS,
                          NULL, etag);
        if (rc == 0) printf("etag %s\n", etag);
        free(p);
    } else if (rc == 0 && strcmp(op, "upload") == 0 && argc >= 5) {
        size_t n;
        char *p = slurp(argv[4], &n);
        size_t piece = argc > 5 ? (size_t)strtoull(argv[5], NULL, 10) : 1000003;
        ckpt_s3_upload *u = NULL;
        rc = ckpt__s3_upload_begin(c, key, &u);
        for (size_t off = 0; rc == 0 && off < n; off += piece)
            rc = ckpt__s3_upload_write(u, p + off, n - off < piece ? n - off : piece);
        uint64_t size = 0;
        char etag[128] = "";
        if (rc == 0) rc = ckpt__s3_upload_finish(u, &size, etag);
        else ckpt__s3_upload_abort(u);
        if (rc == 0) printf("uploaded %" PRIu64 " etag %s\n", size, etag);
        free(p);
    } else if (rc == 0 && strcmp(op, "get") == 0 && argc >= 6) {
        uint64_t size = strtoull(argv[4], NULL, 10), h = 0;
        uint8_t *dst = malloc(size ? size : 1);
        rc = ckpt__s3_get(c, key, size, dst, &h);
        if (rc == 0) {
            FILE *f = fopen(argv[5], "wb");
            if (!f || fwrite(dst, 1, size, f) != size || fclose(f) != 0) {
                perror(argv[5]);
                return 2;
            }
            printf("xxh3 %016" PRIx64 " (of the bytes kept: %016" PRIx64 ")\n", h,
                   ckpt__xxh3(dst, size));
        }
        free(dst);
    } else if (rc == 0 && strcmp(op, "getmany") == 0 && argc >= 5 && argc % 2 == 1) {
        int64_t n = (argc - 3) / 2;
        const char *keys[16];
        uint64_t sizes[16], h[16];
        uint8_t *dst[16];
        int64_t failed = -1;
        if (n > 16) n = 16;
        for (int64_t i = 0; i < n; i++) {
            keys[i] = argv[3 + 2 * i];
            sizes[i] = strtoull(argv[4 + 2 * i], NULL, 10);
            dst[i] = malloc(sizes[i] ? sizes[i] : 1);
        }
        rc = ckpt__s3_get_many(c, n, keys, sizes, dst, h, &failed);
        for (int64_t i = 0; i < n; i++) {
            if (rc == 0)
                printf("%s xxh3 %016" PRIx64 " (of the bytes kept: %016" PRIx64 ")\n", keys[i],
                       h[i], ckpt__xxh3(dst[i], sizes[i]));
            free(dst[i]);
        }
        if (rc < 0) printf("failed %" PRId64 "\n", failed);
    } else if (rc == 0 && strcmp(op, "copy") == 0 && argc >= 6) {
        char etag[128] = "";
        rc = ckpt__s3_copy(c, key, argv[4], strtoull(argv[5], NULL, 10), argc > 6 ? argv[6] : NULL,
                           etag);
        if (rc == 0) printf("copied etag %s\n", etag);
    } else if (rc == 0 && strcmp(op, "head") == 0) {
        ckpt_s3_head h;
        rc = ckpt__s3_head(c, key, &h);
        if (rc == 0)
            printf("size %" PRIu64 " etag %s age %" PRId64 "\n", h.size, h.etag,
                   h.server_now - h.last_modified);
    } else if (rc == 0 && strcmp(op, "cat") == 0) {
        char *p = NULL;
        size_t n = 0;
        rc = ckpt__s3_get_small(c, key, 1u << 20, &p, &n, NULL);
        if (rc == 0) fwrite(p, 1, n, stdout);
        free(p);
    } else if (rc == 0 && strcmp(op, "delete") == 0) {
        rc = ckpt__s3_delete(c, key);
    } else if (rc == 0 && strcmp(op, "list") == 0) {
        rc = ckpt__s3_list(c, key, argc > 4 ? argv[4] : NULL, print_item, NULL);
    } else if (rc == 0) {
        fprintf(stderr, "s3_tool: unknown operation or missing argument: %s\n", op);
        ckpt__s3_free(c);
        return 2;
    }
    if (c) {
        ckpt_s3_stats st;
        ckpt__s3_stats(c, &st);
        printf("requests=%" PRIu64 " retries=%" PRIu64 "\n", st.requests, st.retries);
    }
    ckpt__s3_free(c);
    if (rc < 0) {
        fprintf(stderr, "error %s: %s\n", ckpt__status_name(rc), ckpt_errmsg());
        return 1;
    }
    return 0;
}
