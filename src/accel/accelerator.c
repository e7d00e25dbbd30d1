/* accelerator.c — the accelerator: its configuration and process group,
 * the objects and hooks registered with it, metrics. Saving is in save.c
 * and async.c, loading in load.c; what those share (kinds and file names,
 * the save plan, the project lock, running hooks) is in objects.c. */
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/remote.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "store/s3/s3.h"
#include "train/dataloader.h"
#include "train/optim.h"

/* ---- lifecycle ------------------------------------------------------------ */

int ckpt_accelerator_new(ckpt_accelerator **out, const ckpt_project_config *cfg) {
    if (!out) return ckpt__err(CKPT_EINVAL, "accelerator_new: out is NULL");
    *out = NULL;
    if (!cfg) return ckpt__err(CKPT_EINVAL, "accelerator_new: cfg is NULL");
    if (cfg->total_limit < 0)
        return ckpt__err(CKPT_EINVAL, "accelerator_new: total_limit is %d, expected >= 0",
                         cfg->total_limit);
    if (cfg->iteration < 0)
        return ckpt__err(CKPT_EINVAL, "accelerator_new: iteration is %" PRId64 ", expected >= 0",
                         cfg->iteration);
    int np = cfg->num_processes <= 0 ? 1 : cfg->num_processes;
    int pi = cfg->process_index;
    if (cfg->comm) {
        CKPT_TRY(ckpt__comm_check(cfg->comm, "accelerator_new"));
        np = cfg->comm->size;
        pi = cfg->comm->rank;
        ckpt__fs_note_rank(pi);
    } else if (pi < 0 || pi >= np) {
        return ckpt__err(CKPT_EINVAL, "accelerator_new: process_index %d outside [0, %d)", pi, np);
    }
    if (cfg->project_dir && !cfg->project_dir[0])
        return ckpt__err(CKPT_EINVAL, "accelerator_new: project_dir is empty");
    ckpt_retention pol = {.keep_every_steps = cfg->keep_every_steps,
                          .best_metric = cfg->best_metric,
                          .best_mode = cfg->best_mode,
                          .best_k = cfg->best_k};
    CKPT_TRY(ckpt__retention_check(&pol, "accelerator_new"));
    if (cfg->save_interval_steps < 0)
        return ckpt__err(CKPT_EINVAL,
                         "accelerator_new: save_interval_steps is %" PRId64 ", expected >= 0",
                         cfg->save_interval_steps);
    if (!(cfg->save_interval_seconds >= 0) || isinf(cfg->save_interval_seconds))
        return ckpt__err(CKPT_EINVAL,
                         "accelerator_new: save_interval_seconds is %g, expected a finite "
                         "number >= 0",
                         cfg->save_interval_seconds);
    if (cfg->link_copies < 0)
        return ckpt__err(CKPT_EINVAL,
                         "accelerator_new: link_copies is %d, expected >= 0 (0: the "
                         "default, 2)",
                         cfg->link_copies);
    if (isnan(cfg->collective_timeout_s))
        return ckpt__err(CKPT_EINVAL, "accelerator_new: collective_timeout_s is NaN, expected "
                                      "seconds (0: the default, negative: no deadline)");
    ckpt_tier tier;
    CKPT_TRY(ckpt__tier_configure(&tier, cfg, np));
    ckpt_accelerator *acc = ckpt__calloc(1, sizeof *acc);
    if (!acc) {
        ckpt__tier_free(&tier);
        return ckpt__err_nomem("accelerator");
    }
    acc->tier = tier;
    acc->project_lock.fd = -1;
    acc->automatic_checkpoint_naming = cfg->automatic_checkpoint_naming;
    acc->total_limit = cfg->total_limit;
    acc->iteration = cfg->iteration;
    acc->save_on_each_node = cfg->save_on_each_node;
    acc->process_index = pi;
    acc->num_processes = np;
    acc->comm = cfg->comm ? cfg->comm : ckpt_comm_self();
    acc->retention = (ckpt_retention){.keep_every_steps = cfg->keep_every_steps,
                                      .best_mode = cfg->best_mode,
                                      .best_k = cfg->best_k};
    if (cfg->best_metric && !(acc->retention.best_metric = ckpt__strdup(cfg->best_metric)))
        goto nomem;
    acc->save_interval_steps = cfg->save_interval_steps;
    acc->max_shard_size = cfg->max_shard_size;
    acc->no_link_unchanged = cfg->no_link_unchanged;
    acc->link_copies = cfg->link_copies ? cfg->link_copies : CKPT_LINK_COPIES_DEFAULT;
    acc->save_interval_seconds = cfg->save_interval_seconds;
    acc->coll_timeout = cfg->collective_timeout_s == 0 ? CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S
                        : cfg->collective_timeout_s < 0 || isinf(cfg->collective_timeout_s)
                            ? -1.0
                            : cfg->collective_timeout_s;
    acc->interval_start = ckpt__now();
    if (cfg->project_dir) {
        acc->project_dir = ckpt__strdup(cfg->project_dir);
        if (!acc->project_dir) goto nomem;
        /* s3://bucket/prefix: project_dir becomes the local staging folder */
        if (ckpt__s3_is_url(cfg->project_dir)) {
            int rrc = cfg->local_dir && cfg->local_dir[0]
                          ? ckpt__err(CKPT_EUNSUPPORTED,
                                      "%s: a node-local tier (local_dir) over a project in object "
                                      "storage is not supported",
                                      cfg->project_dir)
                          : ckpt__acc_remote_init(acc, cfg->project_dir);
            if (rrc < 0) {
                ckpt_accelerator_free(acc);
                return ckpt__err_prefix(rrc, "accelerator_new");
            }
        }
    }
    if (cfg->logging_dir) acc->logging_dir = ckpt__strdup(cfg->logging_dir);
    else if (cfg->project_dir) acc->logging_dir = ckpt__path_join(acc->project_dir, "logs");
    if ((cfg->logging_dir || cfg->project_dir) && !acc->logging_dir) goto nomem;
    ckpt_rng_seed_stream(&acc->rng, 0, (uint64_t)acc->process_index);
    *out = acc;
    return 0;
nomem:
    ckpt_accelerator_free(acc);
    return ckpt__err_nomem("accelerator");
}

void ckpt_accelerator_free(ckpt_accelerator *acc) {
    if (!acc) return;
    ckpt__async_free(acc); /* a pending save ends first */
    ckpt__arena_free(&acc->arena);
    for (int w = 0; w < HOOK_KINDS; w++) {
        ckpt_hook_handle *h = acc->hooks[w];
        while (h) {
            ckpt_hook_handle *next = h->next;
            free(h);
            h = next;
        }
    }
    ckpt__lock_release(&acc->project_lock);
    ckpt__acc_remote_free(acc);
    ckpt__tier_free(&acc->tier);
    free(acc->objs);
    free(acc->project_dir);
    free(acc->logging_dir);
    free(acc->last_dir);
    free(acc->link_dir);
    free(acc->load_failed_msg);
    free((char *)acc->retention.best_metric);
    free(acc);
}

/* ---- metrics ------------------------------------------------------------------ */

int ckpt_set_metric(ckpt_accelerator *acc, const char *name, double value) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "set_metric: acc is NULL");
    if (!name || !ckpt__metric_name_valid(name))
        return ckpt__err(CKPT_EINVAL,
                         "set_metric: name '%.64s' is not 1..63 bytes of [A-Za-z0-9_.:/-]",
                         name ? name : "(null)");
    if (!isfinite(value))
        return ckpt__err(CKPT_EINVAL, "set_metric: %s is %g, expected a finite number", name,
                         value);
    for (int i = 0; i < acc->nmetrics; i++)
        if (strcmp(acc->metrics[i].name, name) == 0) {
            acc->metrics[i].value = value;
            return CKPT_OK;
        }
    if (acc->nmetrics == CKPT_MAX_METRICS)
        return ckpt__err(CKPT_EINVAL, "set_metric: %s would be metric %d, at most %d per save",
                         name, CKPT_MAX_METRICS + 1, CKPT_MAX_METRICS);
    snprintf(acc->metrics[acc->nmetrics].name, sizeof acc->metrics[0].name, "%s", name);
    acc->metrics[acc->nmetrics].value = value;
    acc->nmetrics++;
    return CKPT_OK;
}

void ckpt_clear_metrics(ckpt_accelerator *acc) {
    if (acc) acc->nmetrics = 0;
}

/* The warnings of a prepared data loader or optimizer are about state that
 * every rank holds alike (a skip on top of a restored position, optimizer
 * state matched by position or dropped for a frozen parameter): under
 * several processes rank 0 alone reports them, or mpirun would print each
 * once per rank. The other ranks' objects get this logger, which drops them. */
static void quiet_log(void *user, ckpt_log_level level, const char *msg) {
    (void)user;
    (void)level;
    (void)msg;
}

static void set_object_log(const ckpt_accelerator *acc, const ckpt_acc_obj *o) {
    ckpt_log_fn fn = acc->process_index == 0 ? acc->log.fn : quiet_log;
    void *user = acc->process_index == 0 ? acc->log.user : NULL;
    if (o->kind == K_DATALOADER) ckpt_dataloader_set_log(o->self, fn, user);
    if (o->kind == K_OPTIMIZER) ckpt__optimizer_set_log(o->self, fn, user);
}

void ckpt_accelerator_set_log(ckpt_accelerator *acc, ckpt_log_fn fn, void *user) {
    if (!acc) return;
    acc->log.fn = fn;
    acc->log.user = user;
    for (int i = 0; i < acc->nobjs; i++) set_object_log(acc, &acc->objs[i]);
}

int ckpt_accelerator_start_over(ckpt_accelerator *acc) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "accelerator_start_over: acc is NULL");
    acc->load_failed = false;
    acc->load_failed_code = 0;
    free(acc->load_failed_msg);
    acc->load_failed_msg = NULL;
    return CKPT_OK;
}

int ckpt_accelerator_process_index(const ckpt_accelerator *acc) {
    return acc ? acc->process_index : 0;
}
int ckpt_accelerator_num_processes(const ckpt_accelerator *acc) {
    return acc ? acc->num_processes : 1;
}
ckpt_rng *ckpt_accelerator_rng(ckpt_accelerator *acc) { return acc ? &acc->rng : NULL; }

int ckpt_set_seed(ckpt_accelerator *acc, uint64_t seed) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "set_seed: acc is NULL");
    ckpt_rng_seed_stream(&acc->rng, seed, (uint64_t)acc->process_index);
    return 0;
}

/* The first prepared optimizer, or NULL. */
int64_t ckpt_accelerator_iteration(const ckpt_accelerator *acc) { return acc ? acc->iteration : 0; }
void ckpt_accelerator_last_save_bytes(const ckpt_accelerator *acc, uint64_t *written,
                                      uint64_t *linked) {
    if (written) *written = acc ? acc->last_save_written : 0;
    if (linked) *linked = acc ? acc->last_save_linked : 0;
}

const char *ckpt_accelerator_last_dir(const ckpt_accelerator *acc) {
    return acc && acc->last_dir ? acc->last_dir : "";
}

const char *ckpt_accelerator_logging_dir(const ckpt_accelerator *acc) {
    return acc && acc->logging_dir ? acc->logging_dir : "";
}

int ckpt_accelerator_persist_next_save(ckpt_accelerator *acc) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "accelerator_persist_next_save: acc is NULL");
    acc->tier.persist_next = true;
    return CKPT_OK;
}

/* ---- registration ---------------------------------------------------------- */

static int add_named(ckpt_accelerator *acc, int kind, const ckpt_stateful_ops *ops, void *self,
                     const char *name, const char *what) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "%s: acc is NULL", what);
    for (int i = 0; i < acc->nobjs; i++) {
        const ckpt_acc_obj *o = &acc->objs[i];
        if ((self && o->self == self) || (!self && !o->self && o->ops == ops)) {
            if (o->name[0])
                return ckpt__err(CKPT_EEXIST, "%s: this object is already registered (as '%s')",
                                 what, o->name);
            return ckpt__err(CKPT_EEXIST, "%s: this object is already registered (as %s %d)", what,
                             ckpt__kind_noun[o->kind], o->index);
        }
    }
    if (acc->nobjs == acc->cap) {
        int cap = acc->cap ? acc->cap * 2 : 8;
        ckpt_acc_obj *n = ckpt__realloc(acc->objs, (size_t)cap * sizeof *n);
        if (!n) return ckpt__err_nomem(what);
        acc->objs = n;
        acc->cap = cap;
    }
    ckpt_acc_obj *o = &acc->objs[acc->nobjs++];
    *o = (ckpt_acc_obj){kind, acc->count[kind]++, ops, self, ""};
    if (name) snprintf(o->name, sizeof o->name, "%s", name);
    else if (kind == K_CUSTOM) o->index = acc->unnamed++; /* named ones do not shift these */
    return 0;
}

static int add_obj(ckpt_accelerator *acc, int kind, const ckpt_stateful_ops *ops, void *self,
                   const char *what) {
    return add_named(acc, kind, ops, self, NULL, what);
}

static int prepare_builtin(ckpt_accelerator *acc, int kind, const ckpt_stateful_ops *ops,
                           void *self, const char *what) {
    if (!self) return ckpt__err(CKPT_EINVAL, "%s: object is NULL", what);
    if (!ops)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: %s support is not built into this library", what,
                         ckpt__kind_noun[kind]);
    return add_obj(acc, kind, ops, self, what);
}

int ckpt_prepare_model(ckpt_accelerator *acc, ckpt_model *m) {
    return prepare_builtin(acc, K_MODEL, ckpt_model_ops(), m, "prepare_model");
}
int ckpt_prepare_optimizer(ckpt_accelerator *acc, ckpt_optimizer *o) {
    /* an external optimizer: every trainable parameter's state attached */
    if (o) CKPT_TRY(ckpt__optimizer_check_ready(o));
    CKPT_TRY(prepare_builtin(acc, K_OPTIMIZER, ckpt_optimizer_ops(), o, "prepare_optimizer"));
    set_object_log(acc, &acc->objs[acc->nobjs - 1]);
    return CKPT_OK;
}
int ckpt_prepare_scheduler(ckpt_accelerator *acc, ckpt_scheduler *s) {
    return prepare_builtin(acc, K_SCHEDULER, ckpt_scheduler_ops(), s,
                           "prepare_scheduler");
}
int ckpt_prepare_dataloader(ckpt_accelerator *acc, ckpt_dataloader *dl) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "prepare_dataloader: acc is NULL");
    if (!dl) return ckpt__err(CKPT_EINVAL, "prepare_dataloader: object is NULL");
    for (int i = 0; i < acc->nobjs; i++)
        if (acc->objs[i].self == dl)
            return ckpt__err(CKPT_EEXIST, "prepare_dataloader: this object is already registered");
    CKPT_TRY(ckpt__dataloader_set_shard(dl, acc->num_processes, acc->process_index));
    CKPT_TRY(prepare_builtin(acc, K_DATALOADER, ckpt_dataloader_ops(), dl, "prepare_dataloader"));
    set_object_log(acc, &acc->objs[acc->nobjs - 1]);
    return CKPT_OK;
}
int ckpt_prepare_scaler(ckpt_accelerator *acc, ckpt_grad_scaler *gs) {
    return prepare_builtin(acc, K_SCALER, ckpt_grad_scaler_ops(), gs,
                           "prepare_scaler");
}

static int check_ops(const ckpt_stateful_ops *ops, const char *what, const char *obj) {
    if (!ops)
        return ckpt__err(CKPT_EINVAL,
                         "%s: %s: ops is NULL (it needs state_dict and load_state_dict)", what,
                         obj);
    if (!ops->state_dict || !ops->load_state_dict)
        return ckpt__err(CKPT_EINVAL, "%s: %s: ops has no %s function", what, obj,
                         !ops->state_dict ? "state_dict" : "load_state_dict");
    return CKPT_OK;
}

int ckpt_register_for_checkpointing(ckpt_accelerator *acc, const ckpt_stateful_ops *ops,
                                    void *self) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "register_for_checkpointing: acc is NULL");
    char obj[48];
    snprintf(obj, sizeof obj, "custom object %d", acc->unnamed);
    CKPT_TRY(check_ops(ops, "register_for_checkpointing", obj));
    return add_obj(acc, K_CUSTOM, ops, self, "register_for_checkpointing");
}

/* Whether name is stem, or stem followed by "_<digits>", letter case aside:
 * the name of one of the library's own files. */
static bool is_builtin_name(const char *name, const char *stem) {
    size_t n = strlen(stem);
    if (strncasecmp(name, stem, n) != 0) return false;
    if (name[n] == '\0') return true;
    return name[n] == '_' && name[n + 1] &&
           strspn(name + n + 1, "0123456789") == strlen(name + n + 1);
}

/* The rules of ckpt.h: a file name of its own, the same on every file
 * system, that no file of the library's can take. */
static int check_object_name(const ckpt_accelerator *acc, const char *name, const char *what) {
    if (!name) return ckpt__err(CKPT_EINVAL, "%s: name is NULL", what);
    size_t n = strlen(name);
    if (n == 0 || n > CKPT_ACC_NAME_MAX)
        return ckpt__err(CKPT_EINVAL, "%s: name '%.80s' is %zu bytes, expected 1 to %d", what, name,
                         n, CKPT_ACC_NAME_MAX);
    size_t ok = strspn(name, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.-");
    if (ok != n)
        return ckpt__err(CKPT_EINVAL,
                         "%s: name '%s': byte %zu (0x%02x) is not one of [A-Za-z0-9_.-]", what,
                         name, ok, (unsigned char)name[ok]);
    if (name[0] == '.')
        return ckpt__err(CKPT_EINVAL, "%s: name '%s' starts with '.' (a hidden file)", what, name);
    if (strcasestr(name, ".safetensors"))
        return ckpt__err(CKPT_EINVAL,
                         "%s: name '%s' contains '.safetensors' (the name is the file's stem)",
                         what, name);
    for (int k = 0; k < K_COUNT; k++)
        if (is_builtin_name(name, ckpt__kind_stem[k]))
            return ckpt__err(CKPT_EINVAL,
                             "%s: name '%s' is taken by the library's own files (%s, %s_<k>)", what,
                             name, ckpt__kind_stem[k], ckpt__kind_stem[k]);
    char file[CKPT_ACC_NAME_MAX + 16];
    snprintf(file, sizeof file, "%s.safetensors", name);
    size_t tail = strlen(".frozen");
    if (ckpt__acc_is_shard_of(file, NULL) ||
        (n > tail && strcasecmp(name + n - tail, ".frozen") == 0))
        return ckpt__err(CKPT_EINVAL,
                         "%s: name '%s' ends like a shard file's (-DDDDD-of-DDDDD) or a frozen "
                         "file's (.frozen), which another object's files may take",
                         what, name);
    for (int i = 0; i < acc->nobjs; i++)
        if (acc->objs[i].name[0] && strcasecmp(acc->objs[i].name, name) == 0)
            return ckpt__err(CKPT_EEXIST, "%s: name '%s' is taken by another object ('%s')%s", what,
                             name, acc->objs[i].name,
                             strcmp(acc->objs[i].name, name) != 0
                                 ? " (names differing only in letter case would be one file on a "
                                   "case-insensitive file system)"
                                 : "");
    return CKPT_OK;
}

int ckpt_register_for_checkpointing_named(ckpt_accelerator *acc, const char *name,
                                          const ckpt_stateful_ops *ops, void *self) {
    const char *what = "register_for_checkpointing_named";
    if (!acc) return ckpt__err(CKPT_EINVAL, "%s: acc is NULL", what);
    CKPT_TRY(check_object_name(acc, name, what));
    char obj[CKPT_ACC_NAME_MAX + 24];
    snprintf(obj, sizeof obj, "custom object '%s'", name);
    CKPT_TRY(check_ops(ops, what, obj));
    return add_named(acc, K_CUSTOM, ops, self, name, what);
}

/* ---- hooks ----------------------------------------------------------------- */

static int add_hook(ckpt_accelerator *acc, int which, ckpt_state_hook_fn fn, void *user,
                    ckpt_hook_handle **handle, const char *what) {
    if (handle) *handle = NULL;
    if (!acc || !fn) return ckpt__err(CKPT_EINVAL, "%s: acc or fn is NULL", what);
    ckpt_hook_handle *h = ckpt__calloc(1, sizeof *h);
    if (!h) return ckpt__err_nomem(what);
    h->acc = acc;
    h->which = which;
    h->fn = fn;
    h->user = user;
    /* Appended: hooks run in registration order. */
    ckpt_hook_handle **pp = &acc->hooks[which];
    while (*pp) {
        h->prev = *pp;
        pp = &(*pp)->next;
    }
    *pp = h;
    if (handle) *handle = h;
    return 0;
}

int ckpt_register_save_state_pre_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn, void *user,
                                      ckpt_hook_handle **handle) {
    return add_hook(acc, HOOK_SAVE, fn, user, handle, "register_save_state_pre_hook");
}
int ckpt_register_load_state_pre_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn, void *user,
                                      ckpt_hook_handle **handle) {
    return add_hook(acc, HOOK_LOAD, fn, user, handle, "register_load_state_pre_hook");
}
int ckpt_register_save_state_post_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn, void *user,
                                       ckpt_hook_handle **handle) {
    return add_hook(acc, HOOK_SAVE_POST, fn, user, handle, "register_save_state_post_hook");
}
int ckpt_register_load_state_post_hook(ckpt_accelerator *acc, ckpt_state_hook_fn fn, void *user,
                                       ckpt_hook_handle **handle) {
    return add_hook(acc, HOOK_LOAD_POST, fn, user, handle, "register_load_state_post_hook");
}

void ckpt_hook_remove(ckpt_hook_handle *h) {
    if (!h) return;
    if (h->prev) h->prev->next = h->next;
    else h->acc->hooks[h->which] = h->next;
    if (h->next) h->next->prev = h->prev;
    free(h);
}
