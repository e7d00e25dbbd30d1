/* manifest_int.h — helpers shared by the files of the manifest (manifest.c,
 * manifest_write.c, manifest_parse.c, manifest_verify.c); nothing outside
 * src/format/manifest*.c includes it. */
#ifndef CKPT_MANIFEST_INT_H
#define CKPT_MANIFEST_INT_H

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"

static inline void file_clear(ckpt_manifest_file *f) {
    free(f->name);
    free(f->kind);
    for (int64_t i = 0; i < f->ntensors; i++) free(f->tensor_keys[i]);
    free(f->tensor_keys);
    free(f->tensor_xxh3);
    free(f->chunks);
    memset(f, 0, sizeof *f);
}

static inline ckpt_manifest_file *push_file(ckpt_manifest *m) {
    if (m->nfiles == m->cap) {
        int64_t cap = m->cap ? m->cap * 2 : 8;
        ckpt_manifest_file *nf = ckpt__realloc(m->files, (size_t)cap * sizeof *nf);
        if (!nf) return NULL;
        m->files = nf;
        m->cap = cap;
    }
    ckpt_manifest_file *f = &m->files[m->nfiles++];
    memset(f, 0, sizeof *f);
    return f;
}

static inline int alloc_tensors(ckpt_manifest_file *f, int64_t n) {
    f->tensor_keys = ckpt__calloc((size_t)(n ? n : 1), sizeof *f->tensor_keys);
    f->tensor_xxh3 = ckpt__calloc((size_t)(n ? n : 1), sizeof *f->tensor_xxh3);
    if (!f->tensor_keys || !f->tensor_xxh3) return ckpt__err_nomem("manifest tensors");
    return 0;
}

/* "a/b", malloc'd; NULL when out of memory. */
static inline char *join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = ckpt__malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

static inline void hex64(uint64_t v, char out[17]) { snprintf(out, 17, "%016" PRIx64, v); }

/* The manifest checksums itself: its last member is
 *   "manifest_xxh3": "<16 hex digits>"
 * the XXH3-64 of the file's bytes with those 16 digits read as '0's. Every
 * other file is covered by the manifest, so without this a changed step, size
 * or tensor checksum in the manifest would go unnoticed. */
#define MANIFEST_SUM_KEY "manifest_xxh3"
#define MANIFEST_SUM_ZERO "0000000000000000"
static const char manifest_sum_prefix[] = "\"" MANIFEST_SUM_KEY "\": \"";

/* Where the 16 digits of the checksum are in text: the one occurrence of
 * the key's bytes followed by 16 characters and a quote. NULL if there is
 * not exactly one. (Inside a JSON string a quote is always escaped, so these
 * bytes can only be the member itself.) */
static inline const char *find_sum_digits(const char *text, size_t len) {
    const size_t plen = sizeof manifest_sum_prefix - 1;
    const char *found = NULL;
    for (const char *p = text; (size_t)(p - text) + plen + 17 <= len;) {
        const char *q = memmem(p, len - (size_t)(p - text), manifest_sum_prefix, plen);
        if (!q || (size_t)(q - text) + plen + 17 > len) break;
        if (found) return NULL;
        found = q + plen;
        p = q + 1;
    }
    if (found && found[16] != '"') return NULL;
    return found;
}

static inline int manifest_sum(const char *text, size_t len, const char *digits, uint64_t *out) {
    char *copy = ckpt__malloc(len);
    if (!copy) return ckpt__err_nomem("manifest checksum");
    memcpy(copy, text, len);
    memset(copy + (digits - text), '0', 16);
    *out = ckpt__xxh3(copy, len);
    free(copy);
    return CKPT_OK;
}

#endif
