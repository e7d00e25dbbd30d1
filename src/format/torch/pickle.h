/* pickle.h — the allow-list unpickler behind torch files, and the pickle
 * emitter of the torch writer. */
#ifndef CKPT_TORCH_PICKLE_H
#define CKPT_TORCH_PICKLE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"

/* Every node the unpickler makes lives in one arena, freed at once. */
typedef struct ckpt_pkl_node ckpt_pkl_node;
typedef struct ckpt_pkl_arena {
    ckpt_pkl_node *head;
    uint64_t gathered;      /* bytes copied for non-contiguous tensors */
    uint64_t gather_limit;  /* most such bytes allowed */
} ckpt_pkl_arena;
void ckpt__pkl_arena_free(ckpt_pkl_arena *a);

/* Resolves a persistent storage id: the record of storage `key` holding
 * numel elements of dt. Returns its bytes (exactly numel * element size) or
 * an error naming the problem. */
typedef int (*ckpt_pkl_storage_fn)(void *ctx, const char *key, ckpt_dtype dt, int64_t numel,
                                   const uint8_t **data);

/* The memory one pickle of n bytes may make the machine allocate (its
 * objects, their item arrays, string copies, the stack, the marks and the
 * memo): CKPT_PKL_MEM_PER_BYTE bytes per pickle byte, at least
 * CKPT_PKL_MEM_FLOOR, never more than CKPT_PKL_MEM_CAP. Each allocation is
 * charged before it is made; None, the booleans, the empty tuple and the
 * ints 0..65535 are made once per pickle. Measured on what torch.save
 * writes: model and optimizer state dicts need ~20 bytes per byte, long
 * lists of floats, strings, tuples or distinct ints 13 to 40; an object
 * (~160 bytes) per one- or two-byte opcode, as a pickle of nothing but
 * empty lists has, is what the limit stops. */
#define CKPT_PKL_MEM_PER_BYTE 64u
#define CKPT_PKL_MEM_FLOOR ((uint64_t)32 << 20)
#define CKPT_PKL_MEM_CAP ((uint64_t)1 << 30)
uint64_t ckpt__pkl_mem_budget(uint64_t n);

/* Runs the pickle p[0..n) on the allow-list machine and checks the result
 * (no internal objects left in it, no cycles, depth, duplicate dict keys).
 * *root is a view valid until the arena is freed. name is for messages. */
int ckpt__unpickle(ckpt_pkl_arena *a, const uint8_t *p, size_t n, const char *name,
                   ckpt_pkl_storage_fn storage, void *ctx, const ckpt_torch_value **root);

/* The storage class name of a dtype ("FloatStorage"), NULL if torch has none. */
const char *ckpt__pkl_storage_name(ckpt_dtype dt);


/* ---- emitting ---- */
typedef struct ckpt_pkl_buf {
    uint8_t *p;
    size_t n, cap;
    int err; /* sticky */
} ckpt_pkl_buf;
void ckpt__pkl_byte(ckpt_pkl_buf *b, uint8_t op);
void ckpt__pkl_bytes(ckpt_pkl_buf *b, const void *p, size_t n);
/* The shortest of BININT1, BININT2, BININT, LONG1. */
void ckpt__pkl_int(ckpt_pkl_buf *b, int64_t v);
/* The same for an unsigned value: LONG1 of 9 bytes from 2^63 on. */
void ckpt__pkl_uint(ckpt_pkl_buf *b, uint64_t v);
void ckpt__pkl_float(ckpt_pkl_buf *b, double v);
/* BINUNICODE */
void ckpt__pkl_str(ckpt_pkl_buf *b, const char *s, size_t n);
/* GLOBAL "module\nname\n" */
void ckpt__pkl_global(ckpt_pkl_buf *b, const char *module, const char *name);
void ckpt__pkl_buf_free(ckpt_pkl_buf *b);

#endif
