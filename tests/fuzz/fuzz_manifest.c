/* fuzz_manifest.c — libFuzzer target for the checkpoint.json parser: parse
 * the input as a manifest, then touch everything the verifier and the loader
 * would (every file entry, its name, kind and tensor digests) and check the
 * promises the parser makes about what it accepted. Any crash, sanitizer
 * report or leak is a bug; a rejected input is fine. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "format/manifest.h"
#include "format/shard.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* What parse_file promises: a name that is safe to join to a folder path. */
static void check_plain_name(const char *name) {
    size_t len = strlen(name);
    if (len == 0 || len > 255 || name[0] == '.' || strstr(name, "..") != NULL) abort();
    if (strchr(name, '/') != NULL || strchr(name, '\\') != NULL) abort();
    if (strcmp(name, CKPT_MANIFEST_NAME) == 0) abort();
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ckpt_manifest m;
    int rc = ckpt__manifest_parse((const char *)data, size, "fuzz/checkpoint.json", &m);
    if (rc != CKPT_OK) {
        /* A failed parse leaves nothing behind and says why. */
        if (m.nfiles != 0 || m.files != NULL) abort();
        if (rc != CKPT_ECORRUPT && rc != CKPT_EUNSUPPORTED && rc != CKPT_ENOMEM) abort();
        if (ckpt_errmsg()[0] == '\0') abort();
        ckpt__manifest_clear(&m);
        return 0;
    }
    if (m.format_version < 1 || m.format_version > CKPT_FORMAT_VERSION) abort();
    if (m.num_processes < 1 || m.process_index < -1 || m.process_index >= m.num_processes) abort();
    if (m.iteration < 0 || m.nfiles < 0 || m.nfiles > m.cap) abort();
    if (memchr(m.library_version, '\0', sizeof m.library_version) == NULL) abort();
    if (memchr(m.created, '\0', sizeof m.created) == NULL) abort();
    volatile uint64_t sink = 0;
    for (int64_t i = 0; i < m.nfiles; i++) {
        const ckpt_manifest_file *f = &m.files[i];
        check_plain_name(f->name);
        size_t klen = strlen(f->kind);
        if (klen == 0 || klen > 64) abort();
        if (f->size > (uint64_t)INT64_MAX) abort();
        /* Names are unique, so a lookup finds this very entry (first and
         * last only: the walk stays linear on a manifest of many files). */
        if ((i == 0 || i == m.nfiles - 1) && ckpt__manifest_find(&m, f->name) != f) abort();
        if (f->ntensors < 0 || (f->ntensors > 0 && (!f->tensor_keys || !f->tensor_xxh3))) abort();
        for (int64_t t = 0; t < f->ntensors; t++) {
            size_t tl = strlen(f->tensor_keys[t]);
            if (tl == 0 || tl > CKPT_MAX_KEY) abort();
            sink += f->tensor_xxh3[t] + tl;
        }
        sink += f->size ^ f->xxh3;
        /* Chunk records lie within their tensors, and the sets tile them. */
        for (int64_t t = 0; f->chunks && t < f->ntensors; t++)
            if (ckpt__chunk_check(&f->chunks[t], CKPT_ECORRUPT, "fuzz", f->tensor_keys[t], NULL))
                abort();
    }
    if (ckpt__manifest_check_chunks(&m, CKPT_ECORRUPT, "fuzz") != CKPT_OK) abort();
    (void)sink;
    ckpt__manifest_clear(&m);
    if (m.nfiles != 0 || m.files != NULL) abort();
    return 0;
}
