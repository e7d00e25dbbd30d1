/* keymap.h — adapting an object's file to what the object asks for
 * (ckpt_load_state_ex): file keys renamed by a prefix map and a hook, keys
 * matched strictly or not, F32/F16/BF16 tensors converted. The format
 * layer's half of a flexible load; the accelerator decides which objects. */
#ifndef CKPT_KEYMAP_H
#define CKPT_KEYMAP_H

#include "ckpt.h"

/* A growing list of report keys (ckpt_load_key, every string owned). */
typedef struct ckpt_key_list {
    ckpt_load_key *v;
    int64_t n, cap;
} ckpt_key_list;
int ckpt__key_list_add(ckpt_key_list *l, const char *object, const char *key,
                       const char *file_key, ckpt_dtype file_dtype, ckpt_dtype dtype);
void ckpt__key_list_free(ckpt_key_list *l);
/* Moves l's entries to the end of to (l is emptied). */
int ckpt__key_list_move(ckpt_key_list *to, ckpt_key_list *l);

/* What one adaptation found. */
typedef struct ckpt_adapt_result {
    ckpt_key_list missing, unexpected, renamed, converted;
} ckpt_adapt_result;
void ckpt__adapt_result_free(ckpt_adapt_result *r);

/* Whether opt asks for any adaptation of keys or dtypes. */
bool ckpt__adapt_wanted(const ckpt_load_options *opt);
/* Checks the prefix map (entries, NULL strings): CKPT_EINVAL naming `what`. */
int ckpt__keymap_check(const ckpt_load_options *opt, const char *what);
/* The name a file key takes in memory: the first prefix entry that matches,
 * then the hook. *renamed says whether it differs from key. */
int ckpt__keymap_apply(const ckpt_load_options *opt, const char *object, const char *key,
                       char *out, size_t cap, bool *renamed);

/* Matches src (the object's file, named `what` in messages) with schema
 * (what the object holds) under opt. *out is NULL when src serves as it is
 * (no key renamed, nothing converted, missing or unexpected); otherwise an
 * adapted reader that borrows from src and from *extra (free *out, then
 * *extra, then src). current(ctx, w) puts the object's present state into
 * w; it is called only when a key is missing in a non-strict match. Strict
 * mismatches are CKPT_EMISMATCH naming what and the key. res gets the keys
 * (object named `object`). */
int ckpt__adapt(const ckpt_writer *schema, ckpt_reader *src, const ckpt_load_options *opt,
                const char *object, const char *what, int (*current)(void *ctx, ckpt_writer *w),
                void *ctx, ckpt_reader **out, ckpt_reader **extra, ckpt_adapt_result *res);

#endif
