/* statedict.c — state dicts: their keys and entry kinds. The writer that
 * collects entries (tensor data borrowed, never copied) is in
 * statedict_writer.c and saves them as one safetensors file
 * (statedict_save.c); the reader that validates the whole file before handing
 * anything out is in statedict_reader.c and statedict_read.c, readers built
 * from other readers in statedict_adapt.c, the schema check of transactional
 * loads in statedict_schema.c. Non-tensor entries travel in
 * __metadata__["ckpt"] as one JSON document (docs/FORMAT.md). */
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* ---- keys --------------------------------------------------------------- */

bool ckpt__utf8_valid(const unsigned char *s, size_t n) {
    size_t i = 0;
    while (i < n) {
        unsigned c = s[i];
        if (c < 0x80) {
            i++;
            continue;
        }
        size_t len;
        uint32_t cp, min;
        if (c >= 0xc2 && c <= 0xdf) len = 2, cp = c & 0x1f, min = 0x80;
        else if (c >= 0xe0 && c <= 0xef) len = 3, cp = c & 0x0f, min = 0x800;
        else if (c >= 0xf0 && c <= 0xf4) len = 4, cp = c & 0x07, min = 0x10000;
        else return false;
        if (n - i < len) return false;
        for (size_t k = 1; k < len; k++) {
            if ((s[i + k] & 0xc0) != 0x80) return false;
            cp = cp << 6 | (s[i + k] & 0x3f);
        }
        if (cp < min || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) return false;
        i += len;
    }
    return true;
}

int ckpt__check_key(const char *key, const char *what) {
    if (!what) what = "state dict";
    if (!key) return ckpt__err(CKPT_EINVAL, "%s: key is NULL", what);
    size_t n = strlen(key);
    if (n == 0) return ckpt__err(CKPT_EINVAL, "%s: key is empty", what);
    if (n > CKPT_MAX_KEY)
        return ckpt__err(CKPT_EINVAL, "%s: key '%.40s...' is %zu bytes, longer than %d", what, key,
                         n, CKPT_MAX_KEY);
    if (!ckpt__utf8_valid((const unsigned char *)key, n))
        return ckpt__err(CKPT_EINVAL, "%s: key is not valid UTF-8", what);
    for (size_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)key[i];
        /* C0, DEL, and C1 (U+0080..U+009F, encoded 0xC2 0x80..0x9F). */
        if (c < 0x20 || c == 0x7f ||
            (c == 0xc2 && i + 1 < n && (unsigned char)key[i + 1] >= 0x80 &&
             (unsigned char)key[i + 1] <= 0x9f))
            return ckpt__err(CKPT_EINVAL, "%s: key contains a control character at byte %zu",
                             what, i);
    }
    if (strcmp(key, "__metadata__") == 0)
        return ckpt__err(CKPT_EINVAL, "%s: key '__metadata__' is reserved by the file format",
                         what);
    return CKPT_OK;
}

const char *ckpt_entry_kind_name(ckpt_entry_kind kind) {
    switch (kind) {
    case CKPT_ENTRY_TENSOR: return "tensor";
    case CKPT_ENTRY_I64: return "i64";
    case CKPT_ENTRY_F64: return "f64";
    case CKPT_ENTRY_STR: return "str";
    case CKPT_ENTRY_BYTES: return "bytes";
    case CKPT_ENTRY_U64: return "u64";
    case CKPT_ENTRY_ALIAS: return "alias";
    }
    return NULL;
}
