/* optim_int.h — what the optimizer's three files share: optim.c (the
 * object, its kinds' descriptors, groups, ZeRO-1, the step driver),
 * optim_state.c (its state dict) and optim_kernels.c (the kinds' step
 * kernels): the object, one parameter's view, each kind's update. */
#ifndef CKPT_OPTIM_INT_H
#define CKPT_OPTIM_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"
#include "train/optim.h"

typedef struct opt_param {
    const char *name; /* view into the model */
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    int64_t numel;
    float *data;
    float *grad;
    int group;
    float step; /* PyTorch keeps a float32 0-d tensor */
    /* The kind's state buffers (its descriptor's buffers[b]), NULL where
     * the group's options need none: Adam's exp_avg, exp_avg_sq,
     * max_exp_avg_sq; SGD's momentum_buffer; RMSprop's square_avg,
     * momentum_buffer, grad_avg. */
    float *buf[CKPT_OPTIM_MAX_BUFFERS];
    /* ZeRO-1: this rank updates and keeps state for elements [lo, hi) only
     * (whole rows); unsharded, and for parameters that are never split
     * (scalars, empty tensors), lo = 0 and hi = numel. */
    bool sharded;
    int64_t lo, hi;
} opt_param;

struct ckpt_optimizer {
    ckpt_optim_kind kind;
    const struct kind_impl *impl; /* the kind's descriptor and step */
    ckpt_model *model;
    int64_t np;
    opt_param *p; /* in PyTorch's numbering: group 0's parameters, then group 1's... */
    int ngroups;
    ckpt_optim_options *opts;
    int64_t *group_start; /* ngroups + 1 offsets into p */
    int64_t *param_index; /* 0..np-1, the data of the param_groups.<g>.params tensors */
    const ckpt_comm *comm; /* ZeRO-1 (ckpt_optimizer_set_shard), or NULL */
    int64_t *rank_start;   /* comm->size + 1 cuts of the flattened sharded parameters */
    float *exchange;       /* every rank's updated values, flat (rank_start) */
    float *send;           /* this rank's updated values (never aliases exchange) */
    size_t *exchange_lens; /* bytes each rank contributes */
    int64_t *load_map;     /* np: a load's file state index of each parameter, kept so
                              that load_state_dict allocates nothing past its checks */
    bool by_position;      /* state without parameter names may load by position */
    ckpt_log_fn log_fn;    /* NULL: stderr */
    void *log_user;
};

typedef struct kind_impl {
    ckpt_optim_desc d; /* first: a descriptor pointer is its kind_impl's */
    /* One parameter's update (this rank's elements [lo, hi)), step count
     * included. */
    void (*update)(opt_param *p, const ckpt_optim_options *g);
} kind_impl;

/* Elements per row (dimension 0) of p: the granularity of a ZeRO-1 cut. */
static inline int64_t ckpt__optim_row_size(const opt_param *p) { return p->numel / p->shape[0]; }

/* PyTorch's argument checks of group g's options (plus finiteness): the
 * ones every kind has, then the kind's own. */
int ckpt__optim_check_options(const kind_impl *k, const ckpt_optim_options *o, int g);

/* One parameter's update under its group's options: this rank's elements
 * [lo, hi) only (ZeRO-1), the step count included. A kind's descriptor
 * names one of these. */
void ckpt__optim_sgd_update(opt_param *p, const ckpt_optim_options *g);
void ckpt__optim_adam_update(opt_param *p, const ckpt_optim_options *g);
void ckpt__optim_adamw_update(opt_param *p, const ckpt_optim_options *g);
void ckpt__optim_rmsprop_update(opt_param *p, const ckpt_optim_options *g);

#endif
