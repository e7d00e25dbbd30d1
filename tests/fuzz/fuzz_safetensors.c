/* fuzz_safetensors.c — libFuzzer target for the safetensors reader: open the
 * input as a file image, then touch everything a loader would (every entry,
 * every scalar, every tensor's bytes). Any crash, sanitizer report or leak is
 * a bug; a rejected input is fine. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ckpt_reader *r = NULL;
    if (ckpt_reader_open_memory(&r, data, size, "fuzz.safetensors") != CKPT_OK) return 0;
    int64_t n = ckpt_reader_count(r);
    volatile uint64_t sink = 0;
    for (int64_t i = 0; i < n; i++) {
        ckpt_entry_info info;
        if (ckpt_reader_entry(r, i, &info) != CKPT_OK) abort();
        ckpt_entry_info again;
        if (ckpt_reader_find(r, info.key, &again) != CKPT_OK || again.kind != info.kind) abort();
        switch (info.kind) {
        case CKPT_ENTRY_TENSOR: {
            const void *view = NULL;
            if (ckpt_reader_tensor_view(r, info.key, &view, NULL) != CKPT_OK) abort();
            const uint8_t *b = view;
            for (uint64_t k = 0; k < info.nbytes; k++) sink += b[k];
            /* a bounded copy through the typed path as well */
            if (info.nbytes <= (1u << 20)) {
                void *dst = malloc(info.nbytes ? (size_t)info.nbytes : 1);
                if (ckpt_read_tensor(r, info.key, info.dtype, info.ndim, info.shape, dst) != CKPT_OK)
                    abort();
                if (info.nbytes && memcmp(dst, view, (size_t)info.nbytes) != 0) abort();
                free(dst);
            }
            break;
        }
        case CKPT_ENTRY_I64: {
            int64_t v;
            if (ckpt_read_i64(r, info.key, &v) != CKPT_OK) abort();
            sink += (uint64_t)v;
            break;
        }
        case CKPT_ENTRY_F64: {
            double v;
            if (ckpt_read_f64(r, info.key, &v) != CKPT_OK) abort();
            sink += v == v;
            break;
        }
        case CKPT_ENTRY_STR: {
            char *buf = malloc((size_t)info.nbytes + 1);
            if (ckpt_read_str(r, info.key, buf, (size_t)info.nbytes + 1) != CKPT_OK) abort();
            if (strlen(buf) != info.nbytes) abort();
            free(buf);
            break;
        }
        case CKPT_ENTRY_BYTES: {
            void *buf = malloc(info.nbytes ? (size_t)info.nbytes : 1);
            size_t got = 0;
            if (ckpt_read_bytes(r, info.key, buf, (size_t)info.nbytes, &got) != CKPT_OK) abort();
            if (got != info.nbytes) abort();
            free(buf);
            break;
        }
        case CKPT_ENTRY_U64: {
            uint64_t v;
            if (ckpt_read_u64(r, info.key, &v) != CKPT_OK) abort();
            sink += v;
            break;
        }
        case CKPT_ENTRY_ALIAS: {
            /* its target's tensor, or a clear error when the file lacks it */
            ckpt_entry_info t;
            const void *view = NULL;
            if (!info.target) abort();
            bool has =
                ckpt_reader_find(r, info.target, &t) == CKPT_OK && t.kind == CKPT_ENTRY_TENSOR;
            int rc = ckpt_reader_tensor_view(r, info.key, &view, NULL);
            if (has != (rc == CKPT_OK) || (!has && rc != CKPT_ECORRUPT)) abort();
            break;
        }
        }
    }
    (void)sink;
    ckpt_reader_free(r);
    return 0;
}
