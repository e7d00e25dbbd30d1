/* optim_external.c — an optimizer whose update the caller runs: ckpt keeps
 * its kind, groups and step count and borrows the caller's state buffers
 * (PyTorch's fields, and fp32 masters), so that they are saved, loaded,
 * sharded, linked, exported and imported exactly as ckpt's own optimizer's
 * of that kind. */
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "train/optim.h"
#include "train/optim_int.h"

int ckpt_optimizer_external_new(ckpt_optimizer **out, ckpt_optim_kind kind, ckpt_model *m,
                                const ckpt_optim_options *opts) {
    return ckpt__optimizer_make(out, kind, m, opts, true);
}

/* The fields a parameter of group g may have, for messages: "exp_avg,
 * exp_avg_sq" and so on. */
static const char *field_list(const ckpt_optimizer *o, const opt_param *p, char *buf, size_t n) {
    const char *names[CKPT_OPTIM_MAX_FIELDS];
    float *bufs[CKPT_OPTIM_MAX_FIELDS];
    int k = ckpt__optim_fields(o, p, names, bufs, NULL);
    buf[0] = '\0';
    for (int j = 0; j < k; j++) {
        size_t len = strlen(buf);
        snprintf(buf + len, n - len, "%s%s", j ? ", " : "", names[j]);
    }
    if (k == 0) snprintf(buf, n, "none under its group's options");
    return buf;
}

/* Where parameter p's field named field is kept (*slot in host memory,
 * *mslot behind memory ops), or CKPT_EINVAL naming what the field may be. */
static int field_slot(ckpt_optimizer *o, opt_param *p, const char *field, float ***slot,
                      ckpt_mem_ref **mslot) {
    const ckpt_optim_desc *d = &o->impl->d;
    for (int b = 0; b < d->nbuffers; b++)
        if (!strcmp(d->buffers[b], field) && d->needs(b, &o->opts[p->group])) {
            *slot = &p->buf[b];
            *mslot = &p->mbuf[b];
            return CKPT_OK;
        }
    if (!strcmp(field, "master") && p->needs_master) {
        *slot = &p->master;
        *mslot = &p->mmaster;
        return CKPT_OK;
    }
    char list[160];
    return ckpt__err(
        CKPT_EINVAL,
        "optimizer_set_state: '%s' is not a state field of parameter '%s' (a %s parameter "
        "of a %s optimizer's group %d has: %s)",
        field, p->name, ckpt_dtype_name(p->dtype) ? ckpt_dtype_name(p->dtype) : "?", d->name,
        p->group, field_list(o, p, list, sizeof list));
}

static int external_only(const ckpt_optimizer *o, const char *fn) {
    if (!o) return ckpt__err(CKPT_EINVAL, "%s: optimizer is NULL", fn);
    if (!o->external)
        return ckpt__err(CKPT_EINVAL,
                         "%s: this optimizer keeps its own state (ckpt_optimizer_new); only an "
                         "external one (ckpt_optimizer_external_new) borrows the caller's",
                         fn);
    return CKPT_OK;
}

/* The trainable parameter named param of external optimizer o (*out), and
 * the slots of its field; fn names the call in messages. */
static int find_slot(ckpt_optimizer *o, const char *fn, const char *param, const char *field,
                     opt_param **out, float ***slot, ckpt_mem_ref **mslot) {
    CKPT_TRY(external_only(o, fn));
    if (!param || !field) return ckpt__err(CKPT_EINVAL, "%s: NULL name", fn);
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    opt_param *p = NULL;
    for (int64_t i = 0; i < o->np && !p; i++)
        if (!strcmp(o->p[i].name, param)) p = &o->p[i];
    ckpt_param_info info; /* a tied name (ckpt_model_tie): its parameter's state */
    for (int64_t i = 0; !p && i < ckpt_model_num_params(o->model); i++)
        if (ckpt_model_param(o->model, i, &info) == 0 && info.tied_to && !strcmp(info.name, param))
            for (int64_t k = 0; k < o->np && !p; k++)
                if (!strcmp(o->p[k].name, info.tied_to)) p = &o->p[k];
    if (!p)
        return ckpt__err(CKPT_ENOENT, "%s: no parameter '%s' in this optimizer's groups", fn,
                         param);
    if (p->frozen)
        return ckpt__err(CKPT_EINVAL,
                         "%s: parameter '%s' is frozen (ckpt_model_set_frozen): frozen "
                         "parameters have no optimizer state",
                         fn, param);
    CKPT_TRY(field_slot(o, p, field, slot, mslot));
    *out = p;
    return CKPT_OK;
}

int ckpt_optimizer_set_state(ckpt_optimizer *o, const char *param, const char *field, void *data) {
    opt_param *p = NULL;
    float **slot = NULL;
    ckpt_mem_ref *mslot = NULL;
    CKPT_TRY(find_slot(o, "optimizer_set_state", param, field, &p, &slot, &mslot));
    if (!data && p->numel > 0)
        return ckpt__err(CKPT_EINVAL, "optimizer_set_state: '%s' of '%s': data is NULL", field,
                         param);
    *slot = data;
    memset(mslot, 0, sizeof *mslot);
    return CKPT_OK;
}

int ckpt_optimizer_set_state_mem(ckpt_optimizer *o, const char *param, const char *field,
                                 const ckpt_memory_ops *ops, void *handle) {
    opt_param *p = NULL;
    float **slot = NULL;
    ckpt_mem_ref *mslot = NULL;
    CKPT_TRY(find_slot(o, "optimizer_set_state_mem", param, field, &p, &slot, &mslot));
    char what[CKPT_MAX_KEY + 64];
    snprintf(what, sizeof what, "optimizer_set_state_mem: '%s' of '%s'", field, param);
    CKPT_TRY(ckpt__mem_check_ops(ops, what));
    *slot = NULL;
    *mslot = (ckpt_mem_ref){ops, handle, 0};
    return CKPT_OK;
}

int ckpt_optimizer_set_state_block(ckpt_optimizer *o, const char *field, void *state_base,
                                   const void *params_base) {
    CKPT_TRY(external_only(o, "optimizer_set_state_block"));
    if (!field || !state_base || !params_base)
        return ckpt__err(CKPT_EINVAL, "optimizer_set_state_block: NULL argument");
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    /* Check every parameter before attaching any. Frozen ones have no
     * state; those behind memory ops no address (ckpt_optimizer_set_state_mem). */
    for (int64_t i = 0; i < o->np; i++) {
        opt_param *p = &o->p[i];
        if (p->frozen || p->mem.ops) continue;
        size_t es = ckpt__optim_esize(p);
        uintptr_t at = (uintptr_t)p->data, base = (uintptr_t)params_base;
        if (p->dtype != CKPT_F32 && p->dtype != CKPT_BF16 && p->dtype != CKPT_F16)
            return ckpt__err(CKPT_EINVAL,
                             "optimizer_set_state_block: parameter '%s' is %s: a block lays out "
                             "F32, BF16 or F16 parameters (use ckpt_optimizer_set_state)",
                             p->name, ckpt_dtype_name(p->dtype) ? ckpt_dtype_name(p->dtype) : "?");
        if (p->numel > 0 && (at < base || (at - base) % es != 0))
            return ckpt__err(CKPT_EINVAL,
                             "optimizer_set_state_block: parameter '%s' is not in the block at "
                             "params_base (its data is %s params_base%s)",
                             p->name, at < base ? "before" : "after",
                             at < base ? "" : ", not a whole number of elements from it");
        float **slot = NULL;
        ckpt_mem_ref *mslot = NULL;
        CKPT_TRY(field_slot(o, p, field, &slot, &mslot));
    }
    for (int64_t i = 0; i < o->np; i++) {
        opt_param *p = &o->p[i];
        if (p->frozen || p->mem.ops) continue;
        size_t es = ckpt__optim_esize(p);
        size_t elem = p->numel > 0 ? ((uintptr_t)p->data - (uintptr_t)params_base) / es : 0;
        float **slot = NULL;
        ckpt_mem_ref *mslot = NULL;
        (void)field_slot(o, p, field, &slot, &mslot); /* checked above */
        *slot = (float *)state_base + elem;
        memset(mslot, 0, sizeof *mslot);
    }
    return CKPT_OK;
}

int ckpt__optimizer_check_ready(ckpt_optimizer *o) {
    CKPT_TRY(ckpt__optim_sync_frozen(o));
    return ckpt__optim_check_attached(o);
}
