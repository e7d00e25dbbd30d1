/* optim.h — what the loss scaler needs from an optimizer, and each
 * optimizer kind's descriptor, which the optimizer and the torch bridge
 * both read: a new kind is one descriptor plus its step kernel. */
#ifndef CKPT_OPTIM_H
#define CKPT_OPTIM_H

#include <stdbool.h>
#include <stddef.h>

#include "ckpt.h"

/* Parameters the optimizer updates (in PyTorch's numbering across groups). */
int64_t ckpt__optimizer_num_params(const ckpt_optimizer *o);
/* The gradient of parameter i (of the parameter's dtype: F32, or BF16/F16
 * with a master), its element count and dtype; NULL for a parameter without
 * one or frozen (ckpt_model_set_frozen). */
void *ckpt__optimizer_grad(const ckpt_optimizer *o, int64_t i, int64_t *numel, ckpt_dtype *dt);
/* The name of parameter i, for messages. */
const char *ckpt__optimizer_param_name(const ckpt_optimizer *o, int64_t i);

/* Ready to be prepared: up to date with the model's frozen parameters and,
 * external, every trainable parameter's every field attached (CKPT_EINVAL
 * naming the first one missing). */
int ckpt__optimizer_check_ready(ckpt_optimizer *o);

/* Where the optimizer's warnings go (fn NULL: stderr); set by the
 * accelerator that prepares it (ckpt_prepare_optimizer, ckpt_accelerator_set_log). */
void ckpt__optimizer_set_log(ckpt_optimizer *o, ckpt_log_fn fn, void *user);

/* The model's side of an optimizer's groups (ckpt_optimizer_new puts every
 * parameter in one, ckpt_optimizer_set_groups group -1 in none): a
 * parameter in a group is trainable, one in none frozen, unless the user
 * said otherwise (ckpt_model_set_frozen). */
void ckpt__model_set_grouped(ckpt_model *m, int64_t i, bool grouped);
/* Whether the user froze parameter i (ckpt_model_set_frozen(..., true)):
 * the optimizers keep no state for it and never update it. */
bool ckpt__model_user_frozen(const ckpt_model *m, int64_t i);
/* Changes whenever ckpt_model_set_frozen matched a parameter: an optimizer
 * compares it with the value it last saw before it steps, saves or loads. */
uint64_t ckpt__model_frozen_gen(const ckpt_model *m);
/* The model's distinct parameters, what an optimizer updates: its names
 * without the tied ones (ckpt_model_tie: one parameter, one state). How
 * many, the model index of the k-th (-1 outside 0..count-1), and whether
 * the model's i-th name is a tied one. */
int64_t ckpt__model_num_distinct(const ckpt_model *m);
int64_t ckpt__model_distinct(const ckpt_model *m, int64_t k);
bool ckpt__model_is_tied(const ckpt_model *m, int64_t i);

#define CKPT_OPTIM_MAX_BUFFERS 3
#define CKPT_OPTIM_MAX_HPARAMS 6
#define CKPT_OPTIM_MAX_TORCH_FIELDS 12

/* A hyper-parameter of a parameter group: its key in the state dict (after
 * "param_groups.<g>."), which is PyTorch's name ("betas.0": element 0 of
 * PyTorch's pair "betas"), and its field of ckpt_optim_options. */
typedef struct ckpt_optim_hparam {
    const char *key;
    size_t offset; /* offsetof(ckpt_optim_options, field) */
    bool is_bool;  /* a bool field, kept as i64 0/1; else a double, kept as f64 */
} ckpt_optim_hparam;

/* One field of PyTorch's param_groups[g] dict, in the order PyTorch 1.13
 * writes them. */
typedef enum ckpt_torch_field_kind {
    CKPT_TF_HPARAM, /* the hyper-parameter key (a float or a bool) */
    CKPT_TF_PAIR,   /* a tuple of the hyper-parameters key and key2 ("betas") */
    CKPT_TF_NONE,   /* None (foreach) */
    CKPT_TF_FALSE   /* False (capturable, differentiable, fused) */
} ckpt_torch_field_kind;

typedef struct ckpt_torch_field {
    const char *name;
    ckpt_torch_field_kind kind;
    const char *key, *key2; /* hyper-parameter keys (CKPT_TF_HPARAM, CKPT_TF_PAIR) */
} ckpt_torch_field;

/* How PyTorch 1.13 keeps state[i]["step"]. */
typedef enum ckpt_torch_step {
    CKPT_TORCH_STEP_NONE,   /* no count (SGD) */
    CKPT_TORCH_STEP_TENSOR, /* a float32 0-d tensor (Adam, AdamW) */
    CKPT_TORCH_STEP_INT     /* a Python int (RMSprop) */
} ckpt_torch_step;

/* One optimizer kind. Every kind also has lr, weight_decay and maximize,
 * first in its groups. */
typedef struct ckpt_optim_desc {
    ckpt_optim_kind kind;
    const char *name;       /* the state dict's "kind": "sgd", "adam", ... */
    const char *torch_name; /* torch.optim's class: "SGD", "Adam", ... */
    int nhparams;           /* the kind's own hyper-parameters, in state-dict order */
    ckpt_optim_hparam hparams[CKPT_OPTIM_MAX_HPARAMS];
    /* State buffers in state-dict order; their names are PyTorch's keys. */
    int nbuffers;
    const char *buffers[CKPT_OPTIM_MAX_BUFFERS];
    /* Whether buffer b exists under a group's options. */
    bool (*needs)(int b, const ckpt_optim_options *g);
    const char *needs_what; /* the options needs() reads, for messages */
    /* PyTorch's argument checks of a group (plus finiteness); message
     * names param_groups.<g>.<key>. */
    int (*check)(const ckpt_optim_options *o, int g);
    void (*defaults)(ckpt_optim_options *o);
    ckpt_torch_step torch_step;
    /* SGD only: PyTorch keeps "momentum_buffer": None for a parameter
     * without momentum instead of leaving the key out. */
    bool torch_none_buffer;
    int ntorch_fields;
    ckpt_torch_field torch_fields[CKPT_OPTIM_MAX_TORCH_FIELDS];
} ckpt_optim_desc;

/* NULL for an unknown kind or name. */
const ckpt_optim_desc *ckpt__optim_desc(ckpt_optim_kind kind);
const ckpt_optim_desc *ckpt__optim_desc_by_name(const char *name);
/* Every kind, for lookups by PyTorch's fields: desc(i) for i in 0..n-1. */
int ckpt__optim_desc_count(void);
const ckpt_optim_desc *ckpt__optim_desc_at(int i);

/* Testing: use the portable Adam loop even where a SIMD one exists. */
void ckpt__optim_force_generic(bool on);

#endif
