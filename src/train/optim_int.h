/* optim_int.h — what the optimizer's three files share: optim.c (the
 * object, its kinds' descriptors, groups, ZeRO-1, the step driver),
 * optim_state.c (its state dict) and optim_kernels.c (the kinds' step
 * kernels): the object, one parameter's view, each kind's update. */
#ifndef CKPT_OPTIM_INT_H
#define CKPT_OPTIM_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"
#include "format/memref.h"
#include "train/optim.h"

/* A parameter's state fields at most: its kind's buffers and a master. */
#define CKPT_OPTIM_MAX_FIELDS (CKPT_OPTIM_MAX_BUFFERS + 1)

typedef struct opt_param {
    const char *name; /* view into the model */
    int64_t midx;     /* the parameter's index in the model */
    ckpt_dtype dtype; /* the parameter's (and its gradient's) dtype */
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    int64_t numel;
    void *data;       /* the model's values (NULL behind memory ops) */
    void *grad;       /* the model's gradient, of dtype; may be NULL */
    ckpt_mem_ref mem; /* the values behind memory ops (ckpt_model_add_param_mem): never
                         updated by ckpt's own optimizer (it refuses them unless frozen) */
    int group;
    float step; /* PyTorch keeps a float32 0-d tensor */
    /* Frozen by the user (ckpt_model_set_frozen): no state (every buffer
     * and the master NULL, step 0) and never updated. */
    bool frozen;
    /* A BF16/F16 parameter of a group with master_weights: the optimizer
     * updates an fp32 master and writes the parameter back rounded. */
    bool needs_master;
    /* The kind's state buffers (its descriptor's buffers[b]), NULL where
     * the group's options need none: Adam's exp_avg, exp_avg_sq,
     * max_exp_avg_sq; SGD's momentum_buffer; RMSprop's square_avg,
     * momentum_buffer, grad_avg. ckpt's own optimizer allocates them (this
     * rank's elements [lo, hi) only); an external one borrows the caller's
     * (the whole parameter's, of which a save reads [lo, hi)). */
    float *buf[CKPT_OPTIM_MAX_BUFFERS];
    float *master; /* needs_master: the fp32 master, held as the buffers are */
    /* External: a buffer attached behind memory ops (ckpt_optimizer_set_state_mem)
     * instead, its buf[b] / master NULL; ops NULL otherwise. */
    ckpt_mem_ref mbuf[CKPT_OPTIM_MAX_BUFFERS];
    ckpt_mem_ref mmaster;
    /* ZeRO-1: this rank updates and keeps state for elements [lo, hi) only
     * (whole rows); unsharded, and for parameters that are never split
     * (scalars, empty tensors, parameters frozen when the split was made),
     * lo = 0 and hi = numel. */
    bool sharded;
    int64_t lo, hi;
} opt_param;

/* What one update reads and writes: n fp32 values (a parameter's, or its
 * master's), their gradient, the state buffers from the same element on,
 * and the step count (in: before the update, out: after). */
typedef struct opt_view {
    float *data;
    const float *grad;
    float *buf[CKPT_OPTIM_MAX_BUFFERS];
    int64_t n;
    float step;
} opt_view;

struct ckpt_optimizer {
    ckpt_optim_kind kind;
    const struct kind_impl *impl; /* the kind's descriptor and step */
    ckpt_model *model;
    bool external;       /* ckpt_optimizer_external_new: the caller updates, state borrowed */
    uint64_t frozen_gen; /* the model's ckpt__model_frozen_gen when last synchronised */
    int64_t np;
    opt_param *p; /* in PyTorch's numbering: group 0's parameters, then group 1's... */
    int ngroups;
    ckpt_optim_options *opts;
    int64_t *group_start; /* ngroups + 1 offsets into p */
    int64_t *param_index; /* 0..np-1, the data of the param_groups.<g>.params tensors */
    const ckpt_comm *comm; /* ZeRO-1 (ckpt_optimizer_set_shard), or NULL */
    int64_t *rank_start;   /* comm->size + 1 cuts of the flattened sharded parameters */
    unsigned char *exchange; /* every rank's updated values, flat (rank_start), as bytes */
    unsigned char *send;     /* this rank's updated values (never aliases exchange) */
    size_t *exchange_lens;   /* bytes each rank contributes */
    int64_t *load_map;     /* np: a load's file state index of each parameter, kept so
                              that load_state_dict allocates nothing past its checks */
    bool by_position;      /* state without parameter names may load by position */
    ckpt_log_fn log_fn;    /* NULL: stderr */
    void *log_user;
};

typedef struct kind_impl {
    ckpt_optim_desc d; /* first: a descriptor pointer is its kind_impl's */
    /* One update of v's values under its group's options, the step count
     * included. */
    void (*update)(opt_view *v, const ckpt_optim_options *g);
} kind_impl;

/* ckpt_optimizer_new (external false) and ckpt_optimizer_external_new. */
int ckpt__optimizer_make(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                         const ckpt_optim_options *opt, bool external);

/* Elements per row (dimension 0) of p: the granularity of a ZeRO-1 cut. */
static inline int64_t ckpt__optim_row_size(const opt_param *p) { return p->numel / p->shape[0]; }

/* PyTorch's argument checks of group g's options (plus finiteness): the
 * ones every kind has, then the kind's own. */
int ckpt__optim_check_options(const kind_impl *k, const ckpt_optim_options *o, int g);

/* One update of a view under its group's options, the step count
 * included. A kind's descriptor names one of these. */
void ckpt__optim_sgd_update(opt_view *v, const ckpt_optim_options *g);
void ckpt__optim_adam_update(opt_view *v, const ckpt_optim_options *g);
void ckpt__optim_adamw_update(opt_view *v, const ckpt_optim_options *g);
void ckpt__optim_rmsprop_update(opt_view *v, const ckpt_optim_options *g);

/* One parameter's update (this rank's elements [lo, hi)): straight on an
 * F32 parameter, or on its fp32 master from the gradient converted to fp32,
 * the parameter then written back rounded to nearest even (a parameter
 * changed outside the optimizer is first taken up by its master). */
void ckpt__optim_update_param(const kind_impl *k, opt_param *p, const ckpt_optim_options *g);
/* Makes p's master agree with the parameter where the parameter's value is
 * not the master's rounding (changed outside the optimizer: initialised
 * after the optimizer was made, or loaded alone): elements [lo, hi). */
void ckpt__optim_master_take_up(opt_param *p);

/* The bytes of one element of a parameter an optimizer may hold (F32, BF16,
 * F16). */
static inline size_t ckpt__optim_esize(const opt_param *p) { return p->dtype == CKPT_F32 ? 4 : 2; }

/* Where the state of element lo of p starts in one of its buffers: the
 * buffer itself for ckpt's own optimizer (which keeps [lo, hi)), lo
 * elements in for an external one's (the whole parameter's). */
static inline float *ckpt__optim_state_at(const ckpt_optimizer *o, const opt_param *p, float *b) {
    return b && o->external ? b + p->lo : b;
}

/* Brings o up to date with the model's frozen parameters (a parameter the
 * user froze loses its state; one unfrozen gets fresh state, or, external,
 * waits for the caller's). Cheap when nothing changed. */
int ckpt__optim_sync_frozen(ckpt_optimizer *o);
/* External optimizers: every trainable parameter has every field its group
 * needs (CKPT_EINVAL naming the first missing one). CKPT_OK for ckpt's own. */
int ckpt__optim_check_attached(const ckpt_optimizer *o);
/* The state fields of p under its group's options, in state-dict order
 * (the kind's buffers, then "master"): names, host buffers and (mems, may
 * be NULL) the buffers behind memory ops; returns how many. A field is
 * attached when its buffer or its mem's ops is set. */
int ckpt__optim_fields(const ckpt_optimizer *o, const opt_param *p, const char **names,
                       float **bufs, ckpt_mem_ref *mems);

#endif
