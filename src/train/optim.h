/* optim.h — what the loss scaler needs from an optimizer. */
#ifndef CKPT_OPTIM_H
#define CKPT_OPTIM_H

#include <stdbool.h>

#include "ckpt.h"

/* Parameters the optimizer updates (in PyTorch's numbering across groups). */
int64_t ckpt__optimizer_num_params(const ckpt_optimizer *o);
/* The fp32 gradient of parameter i and its element count (grad may be NULL). */
float *ckpt__optimizer_grad(const ckpt_optimizer *o, int64_t i, int64_t *numel);
/* The name of parameter i, for messages. */
const char *ckpt__optimizer_param_name(const ckpt_optimizer *o, int64_t i);

/* Where the optimizer's warnings go (fn NULL: stderr); set by the
 * accelerator that prepares it (ckpt_prepare_optimizer, ckpt_accelerator_set_log). */
void ckpt__optimizer_set_log(ckpt_optimizer *o, ckpt_log_fn fn, void *user);

/* The model's side of ckpt_optimizer_set_groups: parameter i is in no
 * group of its optimizer (ungrouped), so it is frozen unless the user said
 * otherwise (ckpt_model_set_frozen). */
void ckpt__model_set_ungrouped(ckpt_model *m, int64_t i, bool ungrouped);

/* Testing: use the portable Adam loop even where a SIMD one exists. */
void ckpt__optim_force_generic(bool on);

#endif
