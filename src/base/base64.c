/* base64.c — strict RFC 4648 base64. */
#include <stdlib.h>
#include <string.h>

#include "base/base64.h"
#include "base/error.h"

static const char alphabet[] =
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";

int ckpt__base64_encode(const void *p, size_t n, char **out) {
    *out = NULL;
    if (n > (SIZE_MAX - 1) / 4 * 3 - 3) return ckpt__err(CKPT_EINVAL, "base64: input too large");
    size_t len = (n + 2) / 3 * 4;
    char *s = ckpt__malloc(len + 1);
    if (!s) return ckpt__err_nomem("base64");
    const uint8_t *b = p;
    size_t o = 0, i = 0;
    for (; i + 3 <= n; i += 3) {
        uint32_t v = (uint32_t)b[i] << 16 | (uint32_t)b[i + 1] << 8 | b[i + 2];
        s[o++] = alphabet[v >> 18];
        s[o++] = alphabet[(v >> 12) & 63];
        s[o++] = alphabet[(v >> 6) & 63];
        s[o++] = alphabet[v & 63];
    }
    if (n - i == 1) {
        uint32_t v = (uint32_t)b[i] << 16;
        s[o++] = alphabet[v >> 18];
        s[o++] = alphabet[(v >> 12) & 63];
        s[o++] = '=';
        s[o++] = '=';
    } else if (n - i == 2) {
        uint32_t v = (uint32_t)b[i] << 16 | (uint32_t)b[i + 1] << 8;
        s[o++] = alphabet[v >> 18];
        s[o++] = alphabet[(v >> 12) & 63];
        s[o++] = alphabet[(v >> 6) & 63];
        s[o++] = '=';
    }
    s[o] = '\0';
    *out = s;
    return CKPT_OK;
}

static int digit(char c) {
    if (c >= 'A' && c <= 'Z') return c - 'A';
    if (c >= 'a' && c <= 'z') return c - 'a' + 26;
    if (c >= '0' && c <= '9') return c - '0' + 52;
    if (c == '+') return 62;
    if (c == '/') return 63;
    return -1;
}

int ckpt__base64_decode(const char *s, size_t len, uint8_t **out, size_t *n) {
    *out = NULL;
    *n = 0;
    if (len % 4 != 0)
        return ckpt__err(CKPT_ECORRUPT, "base64: length %zu is not a multiple of 4", len);
    size_t pad = 0;
    if (len >= 4 && s[len - 1] == '=') pad = s[len - 2] == '=' ? 2 : 1;
    size_t cap = len / 4 * 3 - pad;
    uint8_t *b = ckpt__malloc(cap ? cap : 1);
    if (!b) return ckpt__err_nomem("base64");
    size_t o = 0;
    for (size_t i = 0; i < len; i += 4) {
        bool last = i + 4 == len;
        int d[4];
        for (int k = 0; k < 4; k++) {
            char c = s[i + (size_t)k];
            if (c == '=' && last && k >= 4 - (int)pad) {
                d[k] = 0;
                continue;
            }
            d[k] = digit(c);
            if (d[k] < 0) {
                free(b);
                return ckpt__err(CKPT_ECORRUPT, "base64: invalid character at offset %zu",
                                 i + (size_t)k);
            }
        }
        uint32_t v =
            (uint32_t)d[0] << 18 | (uint32_t)d[1] << 12 | (uint32_t)d[2] << 6 | (uint32_t)d[3];
        if (last && pad == 2 && (v & 0xffff) != 0) goto bits;
        if (last && pad == 1 && (v & 0xff) != 0) goto bits;
        b[o++] = (uint8_t)(v >> 16);
        if (!(last && pad == 2)) b[o++] = (uint8_t)(v >> 8);
        if (!(last && pad >= 1)) b[o++] = (uint8_t)v;
    }
    *out = b;
    *n = o;
    return CKPT_OK;
bits:
    free(b);
    return ckpt__err(CKPT_ECORRUPT, "base64: non-zero unused bits before the padding");
}
