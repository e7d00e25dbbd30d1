/* fuzz_torch.c — libFuzzer target for the torch.save reader: open the input
 * as a file image, then walk the whole value tree (every tensor byte) and
 * flatten it into a state dict, as an import would. Any crash, sanitizer
 * report or leak is a bug; a rejected input is fine. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

/* Values are shared (the memo), so paths can multiply: bound the walk. */
static uint64_t budget;

static uint64_t touch(const ckpt_torch_value *v, int depth) {
    if (depth > CKPT_TORCH_MAX_DEPTH + 1) abort(); /* the reader bounds nesting */
    if (budget == 0) return 0;
    budget--;
    uint64_t sum = (uint64_t)v->kind;
    switch (v->kind) {
    case CKPT_TORCH_STR:
        if (v->s[v->len] != '\0') abort();
        /* fall through */
    case CKPT_TORCH_BYTES:
        for (size_t i = 0; i < v->len; i++) sum += (uint8_t)v->s[i];
        break;
    case CKPT_TORCH_TENSOR: {
        uint64_t nb;
        if (ckpt_tensor_nbytes(v->dtype, v->ndim, v->shape, &nb) != CKPT_OK || nb != v->nbytes) abort();
        for (uint64_t i = 0; i < v->nbytes; i++) sum += ((const uint8_t *)v->data)[i];
        break;
    }
    case CKPT_TORCH_TUPLE: case CKPT_TORCH_LIST: case CKPT_TORCH_SET: case CKPT_TORCH_DICT: {
        int64_t n = v->kind == CKPT_TORCH_DICT ? 2 * v->n : v->n;
        for (int64_t i = 0; i < n; i++) sum += touch(v->items[i], depth + 1);
        break;
    }
    default: break;
    }
    return sum;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    ckpt_torch_file *f = NULL;
    if (ckpt_torch_open_memory(&f, data, size, "fuzz.pt") != CKPT_OK) {
        if (ckpt_errmsg()[0] == '\0') abort(); /* every rejection says why */
        return 0;
    }
    const ckpt_torch_value *root = ckpt_torch_root(f);
    if (!root) abort();
    budget = 1u << 20;
    volatile uint64_t sink = touch(root, 0);
    (void)sink;
    ckpt_writer *w = NULL;
    if (ckpt_writer_new(&w) == CKPT_OK) {
        (void)ckpt_torch_flatten(root, "x", w);
        ckpt_writer_free(w);
    }
    ckpt_torch_close(f);
    return 0;
}
