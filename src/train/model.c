/* model.c — a model is a list of named parameter tensors the caller owns.
 * Its state dict is exactly those tensors under their names, so
 * model.safetensors is a plain state dict any safetensors reader loads. */
#include <fnmatch.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "base/error.h"
#include "format/statedict.h"
#include "train/optim.h"

typedef struct model_param {
    char *name;
    ckpt_dtype dtype;
    int ndim;
    int64_t shape[CKPT_MAX_NDIM];
    int64_t numel;
    uint64_t nbytes;
    void *data;
    void *grad;
    ckpt_mem_ref mem;        /* ckpt_model_add_param_mem: mem.ops set, data and grad NULL */
    signed char frozen_user; /* ckpt_model_set_frozen: 1 / 0; -1: not said */
    signed char grouped;     /* in a group of its optimizer: 1 / 0; -1: no optimizer said */
    int64_t tied;            /* a tied name: the index of its parameter (never itself tied);
                                -1 for a parameter of its own */
} model_param;

struct ckpt_model {
    model_param *params;
    int64_t n, cap;
    int64_t numel;
    uint64_t frozen_gen; /* counts ckpt_model_set_frozen calls, for the optimizers */
    int64_t ntied;       /* tied names among params */
};

int ckpt_model_new(ckpt_model **out) {
    if (!out) return ckpt__err(CKPT_EINVAL, "model_new: out is NULL");
    *out = NULL;
    ckpt_model *m = ckpt__calloc(1, sizeof *m);
    if (!m) return ckpt__err_nomem("model");
    *out = m;
    return CKPT_OK;
}

void ckpt_model_free(ckpt_model *m) {
    if (!m) return;
    for (int64_t i = 0; i < m->n; i++) free(m->params[i].name);
    free(m->params);
    free(m);
}

/* A parameter at data (and grad), or behind memory ops (mem not NULL). */
static int add_param(ckpt_model *m, const char *name, ckpt_dtype dt, int ndim, const int64_t *shape,
                     void *data, void *grad, const ckpt_mem_ref *mem) {
    if (!m) return ckpt__err(CKPT_EINVAL, "model_add_param: model is NULL");
    /* Names become state-dict keys, so they follow the key rules. */
    CKPT_TRY(ckpt__check_key(name, "model: parameter name"));
    if (ndim < 0 || ndim > CKPT_MAX_NDIM)
        return ckpt__err(CKPT_EINVAL, "model: parameter '%s': ndim %d outside 0..%d", name, ndim,
                         CKPT_MAX_NDIM);
    if (ndim > 0 && !shape)
        return ckpt__err(CKPT_EINVAL, "model: parameter '%s': shape is NULL", name);
    uint64_t nbytes;
    int rc = ckpt_tensor_nbytes(dt, ndim, shape, &nbytes);
    if (rc < 0) return ckpt__err_prefix(rc, "model: parameter '%s'", name);
    if (mem) {
        char what[CKPT_MAX_KEY + 32];
        snprintf(what, sizeof what, "model: parameter '%s'", name);
        CKPT_TRY(ckpt__mem_check_ops(mem->ops, what));
    } else if (!data && nbytes > 0) {
        return ckpt__err(CKPT_EINVAL, "model: parameter '%s': data is NULL", name);
    }
    int64_t numel = 1;
    for (int d = 0; d < ndim; d++) numel *= shape[d]; /* no overflow: nbytes fit above */
    for (int64_t i = 0; i < m->n; i++)
        if (strcmp(m->params[i].name, name) == 0)
            return ckpt__err(CKPT_EEXIST, "model: duplicate parameter name '%s'", name);
    /* The very buffer of an earlier parameter, seen the same way: tied. */
    int64_t tied = -1;
    for (int64_t i = 0; i < m->n && tied < 0 && nbytes > 0; i++) {
        const model_param *q = &m->params[i];
        bool same = q->tied < 0 && q->dtype == dt && q->ndim == ndim &&
                    (mem ? q->mem.ops == mem->ops && q->mem.handle == mem->handle
                         : !q->mem.ops && q->data == data);
        for (int d = 0; same && d < ndim; d++) same = q->shape[d] == shape[d];
        if (!same) continue;
        if (grad && q->grad && grad != q->grad)
            return ckpt__err(CKPT_EINVAL,
                             "model: parameter '%s' is registered on the buffer of '%s', which "
                             "ties them, but with another gradient buffer: a tied pair has one "
                             "gradient (pass the same buffer, or NULL)",
                             name, q->name);
        tied = i;
    }
    if (m->n == m->cap) {
        int64_t cap = m->cap ? m->cap * 2 : 16;
        model_param *p = ckpt__realloc(m->params, (size_t)cap * sizeof *p);
        if (!p) return ckpt__err_nomem("model parameters");
        m->params = p;
        m->cap = cap;
    }
    model_param *p = &m->params[m->n];
    memset(p, 0, sizeof *p);
    p->name = ckpt__strdup(name);
    if (!p->name) return ckpt__err_nomem("model parameter name");
    p->dtype = dt;
    p->ndim = ndim;
    for (int d = 0; d < ndim; d++) p->shape[d] = shape[d];
    p->numel = numel;
    p->nbytes = nbytes;
    p->data = data;
    p->grad = grad;
    if (mem) p->mem = *mem;
    p->frozen_user = -1;
    p->grouped = -1;
    p->tied = tied;
    if (tied >= 0) {
        model_param *t = &m->params[tied];
        if (!t->grad) t->grad = grad; /* the pair's one gradient */
        p->data = p->grad = NULL;
        memset(&p->mem, 0, sizeof p->mem);
        m->ntied++;
    } else {
        m->numel += numel;
    }
    m->n++;
    return CKPT_OK;
}

static int64_t find_param(const ckpt_model *m, const char *name) {
    for (int64_t i = 0; i < m->n; i++)
        if (strcmp(m->params[i].name, name) == 0) return i;
    return -1;
}

int ckpt_model_tie(ckpt_model *m, const char *alias, const char *target) {
    if (!m || !alias || !target) return ckpt__err(CKPT_EINVAL, "model_tie: NULL argument");
    int64_t t = find_param(m, target);
    if (t < 0)
        return ckpt__err(CKPT_ENOENT, "model_tie: '%s' (to tie '%s' to) is no parameter", target,
                         alias);
    if (m->params[t].tied >= 0) t = m->params[t].tied;
    int64_t a = find_param(m, alias);
    if (a >= 0) {
        if (a == t)
            return ckpt__err(CKPT_EINVAL, "model_tie: '%s' cannot be tied to itself", alias);
        if (m->params[a].tied == t) return CKPT_OK;
        return ckpt__err(CKPT_EEXIST,
                         "model_tie: '%s' is already %s%s%s; a tied name is added by the tie (do "
                         "not register it), or registered on the target's buffer",
                         alias, m->params[a].tied >= 0 ? "tied to '" : "a parameter of its own",
                         m->params[a].tied >= 0 ? m->params[m->params[a].tied].name : "",
                         m->params[a].tied >= 0 ? "'" : "");
    }
    /* registered on the target's buffer: tied to it (the only parameter of
     * its own there), or, for an empty tensor, tied here */
    /* (copies: adding the alias may move the parameter array) */
    model_param q = m->params[t];
    int64_t shape[CKPT_MAX_NDIM];
    memcpy(shape, q.shape, sizeof shape);
    int rc = add_param(m, alias, q.dtype, q.ndim, shape, q.data, NULL, q.mem.ops ? &q.mem : NULL);
    if (rc < 0) return ckpt__err_prefix(rc, "model_tie");
    model_param *p = &m->params[m->n - 1];
    if (p->tied < 0) {
        m->numel -= p->numel;
        p->data = NULL;
        memset(&p->mem, 0, sizeof p->mem);
        m->ntied++;
    }
    p->tied = t;
    return CKPT_OK;
}

int ckpt_model_add_param(ckpt_model *m, const char *name, ckpt_dtype dt, int ndim,
                         const int64_t *shape, void *data, void *grad) {
    return add_param(m, name, dt, ndim, shape, data, grad, NULL);
}

int ckpt_model_add_param_mem(ckpt_model *m, const char *name, ckpt_dtype dt, int ndim,
                             const int64_t *shape, const ckpt_memory_ops *ops, void *handle) {
    ckpt_mem_ref mem = {ops, handle, 0};
    return add_param(m, name, dt, ndim, shape, NULL, NULL, &mem);
}

int64_t ckpt_model_num_params(const ckpt_model *m) { return m ? m->n : 0; }

int64_t ckpt_model_num_elements(const ckpt_model *m) { return m ? m->numel : 0; }

/* Frozen: what the user said; else, once an optimizer has the model, in no
 * group of it; else (no optimizer) without a gradient buffer. A tied name is
 * frozen with its parameter. */
static bool param_frozen(const ckpt_model *m, const model_param *p) {
    if (p->tied >= 0) p = &m->params[p->tied];
    if (p->frozen_user >= 0) return p->frozen_user == 1;
    if (p->grouped >= 0) return p->grouped == 0;
    return !p->grad;
}

int ckpt_model_param(const ckpt_model *m, int64_t i, ckpt_param_info *info) {
    if (!m || !info) return ckpt__err(CKPT_EINVAL, "model_param: model or info is NULL");
    if (i < 0 || i >= m->n)
        return ckpt__err(CKPT_EINVAL, "model: parameter index %lld outside 0..%lld", (long long)i,
                         (long long)m->n - 1);
    const model_param *p = &m->params[i];
    const model_param *own = p->tied >= 0 ? &m->params[p->tied] : p;
    memset(info, 0, sizeof *info);
    info->name = p->name;
    info->dtype = p->dtype;
    info->ndim = p->ndim;
    memcpy(info->shape, p->shape, sizeof p->shape);
    info->numel = p->numel;
    info->data = own->data;
    info->grad = own->grad;
    info->frozen = param_frozen(m, p);
    info->tied_to = p->tied >= 0 ? own->name : NULL;
    info->mem_ops = own->mem.ops;
    info->mem_handle = own->mem.handle;
    return CKPT_OK;
}

int ckpt_model_set_frozen(ckpt_model *m, const char *pattern, bool frozen) {
    if (!m || !pattern) return ckpt__err(CKPT_EINVAL, "model_set_frozen: model or pattern is NULL");
    int n = 0;
    for (int64_t i = 0; i < m->n; i++) {
        model_param *p = &m->params[i];
        if (strcmp(p->name, pattern) != 0 && fnmatch(pattern, p->name, 0) != 0) continue;
        if (p->tied >= 0) p = &m->params[p->tied]; /* one parameter, two names */
        p->frozen_user = frozen ? 1 : 0;
        n++;
    }
    if (n > 0) m->frozen_gen++;
    if (n == 0)
        return ckpt__err(CKPT_ENOENT,
                         "model_set_frozen: no parameter name matches '%s' (the model has %lld "
                         "parameters)",
                         pattern, (long long)m->n);
    return n;
}

void ckpt__model_set_grouped(ckpt_model *m, int64_t i, bool grouped) {
    if (m && i >= 0 && i < m->n && m->params[i].tied < 0) m->params[i].grouped = grouped ? 1 : 0;
}

int64_t ckpt__model_num_distinct(const ckpt_model *m) { return m ? m->n - m->ntied : 0; }

int64_t ckpt__model_distinct(const ckpt_model *m, int64_t k) {
    if (m && m->ntied == 0) return k >= 0 && k < m->n ? k : -1;
    for (int64_t i = 0; m && i < m->n; i++)
        if (m->params[i].tied < 0 && k-- == 0) return i;
    return -1;
}

bool ckpt__model_is_tied(const ckpt_model *m, int64_t i) {
    return m && i >= 0 && i < m->n && m->params[i].tied >= 0;
}

bool ckpt__model_user_frozen(const ckpt_model *m, int64_t i) {
    if (!m || i < 0 || i >= m->n) return false;
    const model_param *p = &m->params[i];
    if (p->tied >= 0) p = &m->params[p->tied]; /* frozen with its parameter */
    return p->frozen_user == 1;
}

uint64_t ckpt__model_frozen_gen(const ckpt_model *m) { return m ? m->frozen_gen : 0; }

/* ---- state dict --------------------------------------------------------- */

static int model_state_dict(void *self, ckpt_writer *w) {
    ckpt_model *m = self;
    for (int64_t i = 0; i < m->n; i++) {
        const model_param *p = &m->params[i];
        if (p->tied >= 0) { /* its parameter's bytes, once (written before it) */
            CKPT_TRY(ckpt_write_alias(w, p->name, m->params[p->tied].name));
            continue;
        }
        if (p->mem.ops)
            CKPT_TRY(ckpt__write_tensor_at(w, p->name, p->dtype, p->ndim, p->shape, &p->mem));
        else CKPT_TRY(ckpt_write_tensor(w, p->name, p->dtype, p->ndim, p->shape, p->data));
        if (param_frozen(m, p)) CKPT_TRY(ckpt__writer_set_frozen(w, p->name));
    }
    return CKPT_OK;
}

static bool same_shape(const ckpt_entry_info *e, const model_param *p) {
    if (e->ndim != p->ndim) return false;
    for (int d = 0; d < p->ndim; d++)
        if (e->shape[d] != p->shape[d]) return false;
    return true;
}

/* The check: every parameter present as a tensor of its dtype and shape, and
 * nothing else in the state dict. A model accepts any bytes as values, so
 * this is all load_state_dict can refuse; it is the same as the schema check
 * ckpt_load_state makes first, so there it never fails, but it lets anyone
 * using ckpt_model_ops() on its own check a file before loading it. Reads no
 * tensor data. */
static int model_check(const ckpt_model *m, ckpt_reader *r) {
    for (int64_t i = 0; i < m->n; i++) {
        const model_param *p = &m->params[i];
        ckpt_entry_info e;
        int rc = ckpt_reader_find(r, p->name, &e);
        if (p->tied >= 0) {
            /* tied in the file too, or left out (Hugging Face's files): the
             * target, checked as any parameter, fills the one buffer */
            const char *t = m->params[p->tied].name;
            if (rc == CKPT_ENOENT ||
                (rc == CKPT_OK && e.kind == CKPT_ENTRY_ALIAS && strcmp(e.target, t) == 0))
                continue;
            if (rc < 0) return rc;
            return ckpt__err(
                CKPT_EMISMATCH,
                "model: parameter '%s' is tied to '%s' in memory, but the state dict "
                "has %s%s%s (tie them alike: ckpt_model_tie, or one buffer for both)",
                p->name, t,
                e.kind == CKPT_ENTRY_ALIAS ? "it tied to '" : "it as a tensor of its own",
                e.kind == CKPT_ENTRY_ALIAS ? e.target : "", e.kind == CKPT_ENTRY_ALIAS ? "'" : "");
        }
        if (rc == CKPT_OK && e.kind == CKPT_ENTRY_ALIAS)
            return ckpt__err(CKPT_EMISMATCH,
                             "model: parameter '%s' is tied to '%s' in the state dict (saved "
                             "once), but a parameter of its own in memory (tie them alike: "
                             "ckpt_model_tie, or one buffer for both)",
                             p->name, e.target);
        if (rc == CKPT_ENOENT || (rc == CKPT_OK && e.kind != CKPT_ENTRY_TENSOR))
            return ckpt__err(CKPT_EMISMATCH, "model: parameter '%s' missing from the state dict",
                             p->name);
        if (rc < 0) return rc;
        if (e.dtype != p->dtype || !same_shape(&e, p)) {
            char fs[256], ms[256];
            ckpt__shape_str(fs, sizeof fs, e.ndim, e.shape);
            ckpt__shape_str(ms, sizeof ms, p->ndim, p->shape);
            const char *fd = ckpt_dtype_name(e.dtype), *md = ckpt_dtype_name(p->dtype);
            return ckpt__err(CKPT_EMISMATCH,
                             "model: parameter '%s': %s %s in file, %s %s in memory", p->name,
                             fd ? fd : "?", fs, md ? md : "?", ms);
        }
    }
    int64_t own = 0; /* a file may leave tied names out */
    for (int64_t i = 0; i < m->n; i++) own += m->params[i].tied < 0;
    int64_t extra = ckpt_reader_count(r) - own;
    if (extra > 0) {
        for (int64_t i = 0; i < ckpt_reader_count(r); i++) {
            ckpt_entry_info e;
            if (ckpt_reader_entry(r, i, &e) < 0) continue;
            bool known = false;
            for (int64_t j = 0; j < m->n && !known; j++)
                known = strcmp(m->params[j].name, e.key) == 0;
            if (!known)
                return ckpt__err(CKPT_EMISMATCH,
                                 "model: state dict has entry '%s', which is no parameter", e.key);
        }
    }
    return CKPT_OK;
}

static int model_check_state_dict(void *self, ckpt_reader *r) { return model_check(self, r); }

static int model_load_state_dict(void *self, ckpt_reader *r) {
    ckpt_model *m = self;
    /* Check every parameter before reading any, so a file that does not fit
     * leaves the model untouched even outside a transactional load. */
    CKPT_TRY(model_check(m, r));
    /* Commit. Only a read error of a file-backed reader can stop it midway. */
    for (int64_t i = 0; i < m->n; i++) {
        const model_param *p = &m->params[i];
        if (p->tied >= 0) continue; /* its parameter's buffer is read once */
        ckpt_dst d = {p->data, p->mem, p->name};
        CKPT_TRY(ckpt__read_tensor_to(r, p->name, p->dtype, p->ndim, p->shape, &d));
    }
    return CKPT_OK;
}

static const ckpt_stateful_ops model_ops = {model_state_dict, model_load_state_dict,
                                            model_check_state_dict};

const ckpt_stateful_ops *ckpt_model_ops(void) { return &model_ops; }
