/* gpt2.h — GPT-2 small's parameter tensors (the names Hugging Face
 * transformers gives them, fp32 shapes), shared by the benchmarks that
 * checkpoint a GPT-2-small-sized state. 148 tensors, 124,439,808 values. */
#ifndef CKPT_BENCH_GPT2_H
#define CKPT_BENCH_GPT2_H

#include <stdint.h>
#include <stdio.h>

#define D 768
#define LAYERS 12
#define VOCAB 50257
#define CTX 1024
#define MAXP (2 + 12 * LAYERS + 2)
#define GPT2_SMALL_PARAMS 124439808LL

/* Receives one tensor: its name, 1 or 2 dimensions, the shape (b is 0 for
 * one dimension). */
typedef void (*gpt2_add_fn)(const char *name, int ndim, int64_t a, int64_t b);

/* Calls add once per tensor, in the model's order. */
static inline void gpt2_small_each(gpt2_add_fn add) {
    static const struct {
        const char *suffix;
        int ndim;
        int64_t a, b;
    } block[] = {
        {"ln_1.weight", 1, D, 0},          {"ln_1.bias", 1, D, 0},
        {"attn.c_attn.weight", 2, D, 3 * D}, {"attn.c_attn.bias", 1, 3 * D, 0},
        {"attn.c_proj.weight", 2, D, D},   {"attn.c_proj.bias", 1, D, 0},
        {"ln_2.weight", 1, D, 0},          {"ln_2.bias", 1, D, 0},
        {"mlp.c_fc.weight", 2, D, 4 * D},  {"mlp.c_fc.bias", 1, 4 * D, 0},
        {"mlp.c_proj.weight", 2, 4 * D, D}, {"mlp.c_proj.bias", 1, D, 0},
    };
    char n[64];
    add("transformer.wte.weight", 2, VOCAB, D);
    add("transformer.wpe.weight", 2, CTX, D);
    for (int i = 0; i < LAYERS; i++)
        for (size_t k = 0; k < sizeof block / sizeof block[0]; k++) {
            snprintf(n, sizeof n, "transformer.h.%d.%s", i, block[k].suffix);
            add(n, block[k].ndim, block[k].a, block[k].b);
        }
    add("transformer.ln_f.weight", 1, D, 0);
    add("transformer.ln_f.bias", 1, D, 0);
}

#endif
