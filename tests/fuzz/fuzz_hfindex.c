/* fuzz_hfindex.c — libFuzzer target for the parser of Hugging Face shard
 * indexes (<model>.safetensors.index.json), which a checkpoint load, a
 * model loader and the tools read from disk: parse the input, check the
 * promises the parser makes about what it accepted, and combine parts that
 * hold nothing (which must fail cleanly). Any crash, sanitizer report or leak
 * is a bug; a rejected input is fine. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "format/hfindex.h"
#include "format/statedict.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ckpt_hf_index x;
    int rc = ckpt__hf_index_parse((const char *)data, size, "fuzz/model.safetensors.index.json", &x);
    if (rc != CKPT_OK) {
        if (x.n != 0 || x.keys || x.parts) abort();
        if (rc != CKPT_ECORRUPT && rc != CKPT_EINVAL && rc != CKPT_ENOMEM) abort();
        if (ckpt_errmsg()[0] == '\0') abort();
        return 0;
    }
    if (x.n < 1 || x.nparts < 1 || x.nparts > x.n) abort();
    for (int64_t p = 0; p < x.nparts; p++) {
        const char *f = x.parts[p];
        size_t len = strlen(f);
        /* a plain .safetensors name, safe to join to the folder */
        if (len <= 12 || f[0] == '.' || strchr(f, '/') || strcmp(f + len - 12, ".safetensors") != 0)
            abort();
        for (int64_t q = 0; q < p; q++)
            if (strcmp(x.parts[q], f) == 0) abort();
    }
    for (int64_t i = 0; i < x.n; i++) {
        bool found = false;
        for (int64_t p = 0; p < x.nparts && !found; p++) found = strcmp(x.parts[p], x.files[i]) == 0;
        if (!found || !x.keys[i][0]) abort();
    }
    /* parts without tensors: the combination must refuse, naming the index */
    ckpt_reader **parts = calloc((size_t)x.nparts, sizeof *parts);
    if (!parts) abort();
    bool ok = true;
    for (int64_t p = 0; p < x.nparts && ok; p++) ok = ckpt__reader_new_adapted(&parts[p], x.parts[p]) == 0;
    ckpt_reader *r = NULL;
    if (ok && ckpt__hf_combine(&x, parts, "fuzz", &r) != CKPT_ECORRUPT) abort();
    if (r) abort();
    for (int64_t p = 0; p < x.nparts; p++) ckpt_reader_free(parts[p]);
    free(parts);
    ckpt__hf_index_free(&x);
    return 0;
}
