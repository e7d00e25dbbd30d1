/* accelerator.c — ckpt_save_state / ckpt_load_state: what is saved, the
 * atomic commit of a checkpoint folder and the transactional load. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <dirent.h>

#include "ckpt.h"
#include "train/dataloader.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/statedict.h"
#include "store/store.h"

/* The kinds of saved objects, in the order their files are written. */
enum {
    K_MODEL,
    K_OPTIMIZER,
    K_SCHEDULER,
    K_DATALOADER,
    K_SCALER,
    K_CUSTOM,
    K_RNG,
    K_COUNT
};
/* File name stem, manifest "kind", and the noun used in messages. */
static const char *const kind_stem[K_COUNT] = {"model",  "optimizer",         "scheduler",
                                               "dataloader", "scaler", "custom_checkpoint",
                                               "random_states"};
static const char *const kind_name[K_COUNT] = {"model",  "optimizer", "scheduler",    "dataloader",
                                               "scaler", "custom",    "random_states"};
static const char *const kind_noun[K_COUNT] = {"model",  "optimizer",     "scheduler",   "data loader",
                                               "scaler", "custom object", "random state"};

typedef struct acc_obj {
    int kind;
    int index; /* k-th of its kind */
    const ckpt_stateful_ops *ops;
    void *self;
} acc_obj;

enum { HOOK_SAVE = 0, HOOK_LOAD = 1 };

struct ckpt_hook_handle {
    ckpt_accelerator *acc;
    int which;
    ckpt_state_hook_fn fn;
    void *user;
    ckpt_hook_handle *prev, *next;
};

struct ckpt_accelerator {
    char *project_dir;
    char *logging_dir;
    bool automatic_checkpoint_naming;
    int total_limit;
    int64_t iteration;
    bool save_on_each_node;
    int process_index;
    int num_processes;
    ckpt_logger log;
    acc_obj *objs;
    int nobjs, cap;
    int count[K_COUNT];
    ckpt_rng rng;
    int64_t step;
    char *last_dir;
    ckpt_hook_handle *hooks[2];
    ckpt_lock project_lock; /* held from the first save or load until free */
};

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
    if (cfg->process_index < 0 || cfg->process_index >= np)
        return ckpt__err(CKPT_EINVAL, "accelerator_new: process_index %d outside [0, %d)",
                         cfg->process_index, np);
    if (cfg->project_dir && !cfg->project_dir[0])
        return ckpt__err(CKPT_EINVAL, "accelerator_new: project_dir is empty");
    ckpt_accelerator *acc = ckpt__calloc(1, sizeof *acc);
    if (!acc) return ckpt__err_nomem("accelerator");
    acc->project_lock.fd = -1;
    acc->automatic_checkpoint_naming = cfg->automatic_checkpoint_naming;
    acc->total_limit = cfg->total_limit;
    acc->iteration = cfg->iteration;
    acc->save_on_each_node = cfg->save_on_each_node;
    acc->process_index = cfg->process_index;
    acc->num_processes = np;
    if (cfg->project_dir) {
        acc->project_dir = ckpt__strdup(cfg->project_dir);
        if (!acc->project_dir) goto nomem;
    }
    if (cfg->logging_dir) acc->logging_dir = ckpt__strdup(cfg->logging_dir);
    else if (cfg->project_dir) acc->logging_dir = ckpt__path_join(cfg->project_dir, "logs");
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
    for (int w = 0; w < 2; w++) {
        ckpt_hook_handle *h = acc->hooks[w];
        while (h) {
            ckpt_hook_handle *next = h->next;
            free(h);
            h = next;
        }
    }
    ckpt__lock_release(&acc->project_lock);
    free(acc->objs);
    free(acc->project_dir);
    free(acc->logging_dir);
    free(acc->last_dir);
    free(acc);
}

void ckpt_accelerator_set_log(ckpt_accelerator *acc, ckpt_log_fn fn, void *user) {
    if (!acc) return;
    acc->log.fn = fn;
    acc->log.user = user;
}

int ckpt_accelerator_process_index(const ckpt_accelerator *acc) { return acc ? acc->process_index : 0; }
int ckpt_accelerator_num_processes(const ckpt_accelerator *acc) { return acc ? acc->num_processes : 1; }
ckpt_rng *ckpt_accelerator_rng(ckpt_accelerator *acc) { return acc ? &acc->rng : NULL; }

int ckpt_set_seed(ckpt_accelerator *acc, uint64_t seed) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "set_seed: acc is NULL");
    ckpt_rng_seed_stream(&acc->rng, seed, (uint64_t)acc->process_index);
    return 0;
}

int64_t ckpt_accelerator_step(const ckpt_accelerator *acc) { return acc ? acc->step : 0; }
void ckpt_accelerator_set_step(ckpt_accelerator *acc, int64_t step) {
    if (acc) acc->step = step;
}
int64_t ckpt_accelerator_iteration(const ckpt_accelerator *acc) { return acc ? acc->iteration : 0; }
const char *ckpt_accelerator_last_dir(const ckpt_accelerator *acc) {
    return acc && acc->last_dir ? acc->last_dir : "";
}

/* ---- registration ---------------------------------------------------------- */

static int add_obj(ckpt_accelerator *acc, int kind, const ckpt_stateful_ops *ops, void *self,
                   const char *what) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "%s: acc is NULL", what);
    for (int i = 0; i < acc->nobjs; i++) {
        const acc_obj *o = &acc->objs[i];
        if ((self && o->self == self) || (!self && !o->self && o->ops == ops))
            return ckpt__err(CKPT_EEXIST, "%s: this object is already registered (as %s %d)", what,
                             kind_noun[o->kind], o->index);
    }
    if (acc->nobjs == acc->cap) {
        int cap = acc->cap ? acc->cap * 2 : 8;
        acc_obj *n = ckpt__realloc(acc->objs, (size_t)cap * sizeof *n);
        if (!n) return ckpt__err_nomem(what);
        acc->objs = n;
        acc->cap = cap;
    }
    acc->objs[acc->nobjs++] = (acc_obj){kind, acc->count[kind]++, ops, self};
    return 0;
}

static int prepare_builtin(ckpt_accelerator *acc, int kind, const ckpt_stateful_ops *ops,
                           void *self, const char *what) {
    if (!self) return ckpt__err(CKPT_EINVAL, "%s: object is NULL", what);
    if (!ops)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: %s support is not built into this library", what,
                         kind_noun[kind]);
    return add_obj(acc, kind, ops, self, what);
}

int ckpt_prepare_model(ckpt_accelerator *acc, ckpt_model *m) {
    return prepare_builtin(acc, K_MODEL, ckpt_model_ops(), m, "prepare_model");
}
int ckpt_prepare_optimizer(ckpt_accelerator *acc, ckpt_optimizer *o) {
    return prepare_builtin(acc, K_OPTIMIZER, ckpt_optimizer_ops(), o, "prepare_optimizer");
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
    return prepare_builtin(acc, K_DATALOADER, ckpt_dataloader_ops(), dl, "prepare_dataloader");
}
int ckpt_prepare_scaler(ckpt_accelerator *acc, ckpt_grad_scaler *gs) {
    return prepare_builtin(acc, K_SCALER, ckpt_grad_scaler_ops(), gs,
                           "prepare_scaler");
}

int ckpt_register_for_checkpointing(ckpt_accelerator *acc, const ckpt_stateful_ops *ops,
                                    void *self) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "register_for_checkpointing: acc is NULL");
    int i = acc->count[K_CUSTOM];
    if (!ops)
        return ckpt__err(CKPT_EINVAL,
                         "register_for_checkpointing: custom object %d: ops is NULL (it needs "
                         "state_dict and load_state_dict)",
                         i);
    if (!ops->state_dict || !ops->load_state_dict)
        return ckpt__err(CKPT_EINVAL,
                         "register_for_checkpointing: custom object %d: ops has no %s function",
                         i, !ops->state_dict ? "state_dict" : "load_state_dict");
    return add_obj(acc, K_CUSTOM, ops, self, "register_for_checkpointing");
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

void ckpt_hook_remove(ckpt_hook_handle *h) {
    if (!h) return;
    if (h->prev) h->prev->next = h->next;
    else h->acc->hooks[h->which] = h->next;
    if (h->next) h->next->prev = h->prev;
    free(h);
}

static int run_hooks(ckpt_accelerator *acc, int which, const char *dir, const char *what) {
    ckpt_hook_handle *h = acc->hooks[which];
    while (h) {
        /* A hook may remove itself: take the next one first. */
        ckpt_hook_handle *next = h->next;
        int r = h->fn(h->user, acc, dir);
        if (r != 0) {
            int code = r < 0 && r >= CKPT_EUNSUPPORTED ? r : CKPT_EINVAL;
            return ckpt__err(code, "%s: %s: a %s pre-hook failed (returned %d)", what, dir,
                             which == HOOK_SAVE ? "save_state" : "load_state", r);
        }
        h = next;
    }
    return 0;
}

/* ---- the project lock -------------------------------------------------------- */

/* One run per project: the first save or load takes the project lock and
 * keeps it until the accelerator is freed, so a second run is refused at its
 * first call rather than failing a later save. A load takes it only if the
 * checkpoints folder exists (a load creates nothing). */
static int own_project(ckpt_accelerator *acc, bool create, const char *what) {
    if (!acc->project_dir || acc->project_lock.fd >= 0) return 0;
    char *dir = ckpt__checkpoints_dir(acc->project_dir);
    char *lp = dir ? ckpt__path_join(dir, ".lock") : NULL;
    int rc = 0;
    struct stat st;
    if (!lp) rc = ckpt__err_nomem("lock path");
    else if (create) rc = ckpt__mkdirs(dir);
    else if (stat(dir, &st) != 0) goto out;
    if (rc == 0) rc = ckpt__lock_acquire(&acc->project_lock, lp);
    if (rc < 0) rc = ckpt__err_prefix(rc, "%s", what);
out:
    free(lp);
    free(dir);
    return rc;
}

/* Whether lock_path is the lock file this accelerator already holds. */
static bool holds_lock_file(const ckpt_accelerator *acc, const char *lock_path) {
    struct stat a, b;
    return acc->project_lock.fd >= 0 && stat(lock_path, &a) == 0 &&
           fstat(acc->project_lock.fd, &b) == 0 && a.st_dev == b.st_dev && a.st_ino == b.st_ino;
}

/* ---- saving ---------------------------------------------------------------- */

static void obj_file_name(const ckpt_accelerator *acc, const acc_obj *o, char *buf, size_t cap) {
    if (o->kind == K_RNG) snprintf(buf, cap, "%s_%d.safetensors", kind_stem[K_RNG], acc->process_index);
    else if (o->kind == K_CUSTOM) snprintf(buf, cap, "%s_%d.safetensors", kind_stem[K_CUSTOM], o->index);
    else if (o->index == 0) snprintf(buf, cap, "%s.safetensors", kind_stem[o->kind]);
    else snprintf(buf, cap, "%s_%d.safetensors", kind_stem[o->kind], o->index);
}

/* Every saved object in file order, the accelerator's generator last. *n
 * entries in a ckpt__malloc'd array. */
static acc_obj *plan_objects(ckpt_accelerator *acc, int *n) {
    acc_obj *v = ckpt__malloc((size_t)(acc->nobjs + 1) * sizeof *v);
    if (!v) return NULL;
    int k = 0;
    for (int kind = 0; kind < K_COUNT; kind++)
        for (int i = 0; i < acc->nobjs; i++)
            if (acc->objs[i].kind == kind) v[k++] = acc->objs[i];
    v[k++] = (acc_obj){K_RNG, 0, ckpt_rng_ops(), &acc->rng};
    *n = k;
    return v;
}

static int save_object(ckpt_accelerator *acc, const acc_obj *o, const char *tmp, ckpt_manifest *m) {
    char name[96];
    obj_file_name(acc, o, name, sizeof name);
    ckpt_writer *w = NULL;
    CKPT_TRY(ckpt_writer_new(&w));
    int rc = o->ops->state_dict(o->self, w);
    if (rc != 0) {
        if (rc > 0) rc = ckpt__err(CKPT_EINVAL, "state_dict returned %d", rc);
        ckpt_writer_free(w);
        return ckpt__err_prefix(rc, "%s: state_dict", name);
    }
    char *path = ckpt__path_join(tmp, name);
    if (!path) {
        ckpt_writer_free(w);
        return ckpt__err_nomem("save path");
    }
    ckpt_file_digest d;
    memset(&d, 0, sizeof d);
    rc = ckpt__writer_write_new(w, path, &d);
    if (rc == 0) rc = ckpt__manifest_add(m, name, kind_name[o->kind], &d);
    ckpt__file_digest_free(&d);
    ckpt_writer_free(w);
    free(path);
    return rc;
}

/* Splits an explicit output folder into parent and final component (both
 * malloc'd), ignoring trailing slashes. */
static int split_dir(const char *path, char **parent, char **base) {
    *parent = *base = NULL;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    if (n == s || (n - s == 1 && path[s] == '.') || (n - s == 2 && path[s] == '.' && path[s + 1] == '.'))
        return ckpt__err(CKPT_EINVAL, "save_state: %s: not a folder name a checkpoint can be saved as",
                         path);
    *base = ckpt__malloc(n - s + 1);
    if (s == 0) *parent = ckpt__strdup(".");
    else {
        size_t pl = s > 1 ? s - 1 : 1; /* "/x": the parent is "/" */
        *parent = ckpt__malloc(pl + 1);
        if (*parent) {
            memcpy(*parent, path, pl);
            (*parent)[pl] = '\0';
        }
    }
    if (!*base || !*parent) {
        free(*base);
        free(*parent);
        *base = *parent = NULL;
        return ckpt__err_nomem("save path");
    }
    memcpy(*base, path + s, n - s);
    (*base)[n - s] = '\0';
    return 0;
}

/* An explicit folder that exists may only be replaced if it is a checkpoint
 * (or empty): never delete a user's unrelated files. */
static int check_replaceable(const char *target) {
    struct stat st;
    if (lstat(target, &st) != 0) {
        if (errno == ENOENT) return 0;
        return ckpt__err_os(errno, "save_state: %s", target);
    }
    if (!S_ISDIR(st.st_mode))
        return ckpt__err(CKPT_EEXIST, "save_state: %s exists and is not a folder", target);
    char *mp = ckpt__path_join(target, CKPT_MANIFEST_NAME);
    if (!mp) return ckpt__err_nomem("save path");
    bool has_manifest = lstat(mp, &st) == 0;
    free(mp);
    if (has_manifest) return 0;
    DIR *d = opendir(target);
    if (!d) return ckpt__err_os(errno, "save_state: %s", target);
    struct dirent *e;
    bool empty = true;
    while ((e = readdir(d)) != NULL)
        if (strcmp(e->d_name, ".") != 0 && strcmp(e->d_name, "..") != 0) empty = false;
    closedir(d);
    if (!empty)
        return ckpt__err(CKPT_EEXIST,
                         "save_state: %s exists, is not empty and is not a checkpoint (no "
                         CKPT_MANIFEST_NAME "); refusing to replace it",
                         target);
    return 0;
}

/* publish_dir failed. If the new folder was already moved into place (the
 * failure was the final folder fsync), take it back out, so that a failed
 * save never leaves its checkpoint visible: the caller was told it failed. */
static void undo_publish(ckpt_accelerator *acc, const char *tmp, const char *target,
                         const struct stat *ours, bool existed, bool *tmp_made) {
    struct stat st;
    if (lstat(target, &st) != 0 || st.st_dev != ours->st_dev || st.st_ino != ours->st_ino) return;
    char saved[2048];
    snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
    if (!existed) {
        if (ckpt__remove_tree(target) < 0)
            ckpt__log(&acc->log, CKPT_LOG_WARNING, "could not remove %s after a failed save: %s",
                      target, ckpt_errmsg());
        *tmp_made = false;
    } else if (ckpt__os_exchange(tmp, target) != 0) {
        /* tmp holds the old checkpoint now: keep it as a hidden leftover. */
        *tmp_made = false;
        ckpt__log(&acc->log, CKPT_LOG_WARNING,
                  "%s holds the new checkpoint although the save failed; the old one is in %s",
                  target, tmp);
    }
    ckpt__err(CKPT_EIO, "%s", saved); /* the message of the failure, not of the undo */
}


int ckpt_save_state(ckpt_accelerator *acc, const char *output_dir) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "save_state: acc is NULL");
    bool automatic = output_dir == NULL;
    if (automatic && !acc->automatic_checkpoint_naming)
        return ckpt__err(CKPT_EINVAL, "save_state: no output folder given and "
                                      "automatic_checkpoint_naming is off");
    if (automatic && !acc->project_dir)
        return ckpt__err(CKPT_EINVAL,
                         "save_state: automatic checkpoint naming needs a project_dir");
    if (!automatic && !output_dir[0]) return ckpt__err(CKPT_EINVAL, "save_state: output_dir is empty");
    CKPT_TRY(own_project(acc, true, "save_state"));

    char *parent = NULL, *base = NULL, *target = NULL, *tmp = NULL, *lockp = NULL, *tname = NULL;
    acc_obj *plan = NULL;
    ckpt_lock lk = {-1};
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    bool tmp_made = false;
    int64_t number = -1;
    int rc = 0;

    if (automatic) {
        parent = ckpt__checkpoints_dir(acc->project_dir);
        if (!parent) {
            rc = ckpt__err_nomem("save path");
            goto out;
        }
    } else {
        rc = split_dir(output_dir, &parent, &base);
        if (rc < 0) goto out;
    }
    rc = ckpt__mkdirs(parent);
    if (rc < 0) {
        rc = ckpt__err_prefix(rc, "save_state");
        goto out;
    }
    lockp = ckpt__lock_path(parent, automatic ? "checkpoint_0" : base);
    if (!lockp) {
        rc = ckpt__err_nomem("lock path");
        goto out;
    }
    if (!holds_lock_file(acc, lockp)) rc = ckpt__lock_acquire(&lk, lockp);
    if (rc < 0) {
        rc = ckpt__err_prefix(rc, "save_state");
        goto out;
    }
    {
        int64_t n;
        bool numbered = automatic || ckpt__parse_checkpoint_name(base, &n);
        rc = ckpt__remove_leftovers(parent, numbered ? NULL : base, &acc->log);
        if (rc < 0) goto out;
    }
    if (automatic) {
        int64_t *nums = NULL, count = 0;
        rc = ckpt__list_numbers(parent, &nums, &count);
        if (rc < 0) {
            rc = ckpt__err_prefix(rc, "save_state");
            goto out;
        }
        number = acc->iteration;
        if (count > 0 && nums[count - 1] + 1 > number) number = nums[count - 1] + 1;
        free(nums);
        base = ckpt__malloc(48);
        if (!base) {
            rc = ckpt__err_nomem("save path");
            goto out;
        }
        snprintf(base, 48, "checkpoint_%" PRId64, number);
    }
    target = ckpt__path_join(parent, base);
    tname = ckpt__temp_name(base);
    if (!target || !tname || !(tmp = ckpt__path_join(parent, tname))) {
        rc = ckpt__err_nomem("save path");
        goto out;
    }
    if (!automatic) {
        rc = check_replaceable(target);
        if (rc < 0) goto out;
    }
    rc = run_hooks(acc, HOOK_SAVE, target, "save_state");
    if (rc < 0) goto out;

    if (ckpt__os_mkdir(tmp, 0755) != 0) {
        rc = ckpt__err_os(errno, "save_state: %s: create temporary folder", tmp);
        goto out;
    }
    tmp_made = true;
    int nplan = 0;
    plan = plan_objects(acc, &nplan);
    if (!plan) {
        rc = ckpt__err_nomem("save plan");
        goto out;
    }
    for (int i = 0; i < nplan; i++) {
        rc = save_object(acc, &plan[i], tmp, &m);
        if (rc < 0) {
            rc = ckpt__err_prefix(rc, "save_state: %s", target);
            goto out;
        }
    }
    m.step = acc->step;
    m.iteration = automatic ? number + 1 : acc->iteration;
    m.process_index = acc->process_index;
    m.num_processes = acc->num_processes;
    /* The manifest is the commit record: written last, after every file is
     * durable, so a folder with a valid manifest is a complete checkpoint. */
    rc = ckpt__manifest_write(&m, tmp);
    if (rc < 0) {
        rc = ckpt__err_prefix(rc, "save_state: %s", target);
        goto out;
    }
    struct stat tmp_st, tgt_st;
    bool existed = lstat(target, &tgt_st) == 0;
    if (stat(tmp, &tmp_st) != 0) {
        rc = ckpt__err_os(errno, "save_state: %s", tmp);
        goto out;
    }
    rc = ckpt__publish_dir(tmp, target, !automatic);
    if (rc < 0) {
        rc = ckpt__err_prefix(rc, "save_state");
        undo_publish(acc, tmp, target, &tmp_st, existed, &tmp_made);
        goto out;
    }
    tmp_made = false;
    /* Committed: nothing below may fail the save. */
    if (automatic) acc->iteration = number + 1;
    free(acc->last_dir);
    acc->last_dir = target;
    target = NULL;
    if (automatic && acc->total_limit > 0) {
        /* Rotation only after the commit: the newest checkpoint is never at
         * risk. A failure here leaves an extra old checkpoint, not a failed save. */
        int64_t removed = 0;
        if (ckpt__rotate(parent, acc->total_limit, &acc->log, &removed) < 0)
            ckpt__log(&acc->log, CKPT_LOG_WARNING, "total_limit rotation: %s", ckpt_errmsg());
    }
out:
    if (tmp_made && ckpt__remove_tree(tmp) < 0)
        ckpt__log(&acc->log, CKPT_LOG_WARNING, "could not remove %s after a failed save", tmp);
    ckpt__lock_release(&lk);
    ckpt__manifest_clear(&m);
    free(plan);
    free(parent);
    free(base);
    free(target);
    free(tmp);
    free(tname);
    free(lockp);
    return rc;
}

/* ---- loading --------------------------------------------------------------- */

static void plural(char *buf, size_t cap, int n, const char *noun) {
    snprintf(buf, cap, "%d %s%s", n, noun, n == 1 ? "" : "s");
}

/* Matches the registered objects with the checkpoint's files, checks every
 * object's schema against its file, then every value through the objects'
 * check_state_dict, and only then loads them all. */
static int apply_checkpoint(ckpt_accelerator *acc, const char *dir, ckpt_checkpoint_open *c) {
    const ckpt_manifest *m = &c->m;
    int have[K_COUNT] = {0};
    for (int64_t i = 0; i < m->nfiles; i++)
        for (int k = 0; k < K_COUNT; k++)
            if (strcmp(m->files[i].kind, kind_name[k]) == 0) have[k]++;
    for (int k = 0; k < K_RNG; k++) {
        if (have[k] == acc->count[k]) continue;
        char a[64];
        plural(a, sizeof a, have[k], kind_noun[k]);
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: checkpoint has %s, %d %s registered", dir,
                         a, acc->count[k], acc->count[k] == 1 ? "is" : "are");
    }
    int n = 0;
    acc_obj *plan = plan_objects(acc, &n);
    ckpt_reader **readers = ckpt__calloc((size_t)(n ? n : 1), sizeof *readers);
    char *last = NULL;
    int rc = 0;
    if (!plan || !readers) {
        rc = ckpt__err_nomem("load plan");
        goto out;
    }
    for (int i = 0; i < n && rc == 0; i++) {
        char name[96];
        obj_file_name(acc, &plan[i], name, sizeof name);
        int64_t idx = -1;
        for (int64_t j = 0; j < m->nfiles; j++)
            if (strcmp(m->files[j].name, name) == 0) idx = j;
        if (idx < 0) {
            rc = ckpt__err(CKPT_EMISMATCH, "load_state: %s: checkpoint has no %s (for %s %d)", dir,
                           name, kind_noun[plan[i].kind], plan[i].index);
            break;
        }
        if (strcmp(m->files[idx].kind, kind_name[plan[i].kind]) != 0) {
            rc = ckpt__err(CKPT_EMISMATCH, "load_state: %s: %s holds a %s, expected a %s", dir, name,
                           m->files[idx].kind, kind_name[plan[i].kind]);
            break;
        }
        rc = ckpt_reader_open_memory(&readers[i], c->maps[idx].data, (size_t)c->maps[idx].size, name);
        if (rc < 0) {
            rc = ckpt__err_prefix(rc, "load_state: %s", dir);
            break;
        }
        ckpt_writer *schema = NULL;
        rc = ckpt_writer_new_schema(&schema);
        if (rc < 0) break;
        rc = plan[i].ops->state_dict(plan[i].self, schema);
        if (rc > 0) rc = ckpt__err(CKPT_EINVAL, "state_dict returned %d", rc);
        if (rc < 0) rc = ckpt__err_prefix(rc, "%s: state_dict", name);
        else rc = ckpt__schema_check(schema, readers[i], name);
        ckpt_writer_free(schema);
        if (rc < 0) rc = ckpt__err_prefix(rc, "load_state: %s", dir);
    }
    if (rc < 0) goto out;
    /* Every schema matches: now every value, still changing nothing. Each
     * check sees the objects as they were before the load. */
    for (int i = 0; i < n; i++) {
        if (!plan[i].ops->check_state_dict) continue;
        rc = plan[i].ops->check_state_dict(plan[i].self, readers[i]);
        if (rc == 0) continue;
        if (rc > 0) rc = ckpt__err(CKPT_EINVAL, "check_state_dict returned %d", rc);
        char name[96];
        obj_file_name(acc, &plan[i], name, sizeof name);
        rc = ckpt__err_prefix(rc, "load_state: %s: %s", dir, name);
        goto out;
    }
    /* Allocated before anything is applied: past this point only an
     * object's own load_state_dict can fail. */
    last = ckpt__strdup(dir);
    if (!last) {
        rc = ckpt__err_nomem("last_dir");
        goto out;
    }
    /* Everything matches: apply. The built-in objects' load_state_dict is
     * their check (passed above) plus the commit, so a failure past this
     * point is a value refused by a custom object without check_state_dict
     * (documented in CHECKPOINTS.md); the objects before it are already
     * loaded. */
    for (int i = 0; i < n; i++) {
        rc = plan[i].ops->load_state_dict(plan[i].self, readers[i]);
        if (rc != 0) {
            if (rc > 0) rc = ckpt__err(CKPT_EINVAL, "load_state_dict returned %d", rc);
            char name[96];
            obj_file_name(acc, &plan[i], name, sizeof name);
            rc = ckpt__err_prefix(rc, "load_state: %s: %s (state partially loaded: %d of %d "
                                      "objects were loaded before this one)",
                                  dir, name, i, n);
            goto out;
        }
    }
    acc->step = m->step;
    int64_t next = m->iteration;
    {
        char base[256];
        size_t len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        size_t s = len;
        while (s > 0 && dir[s - 1] != '/') s--;
        int64_t num;
        if (len - s < sizeof base) {
            memcpy(base, dir + s, len - s);
            base[len - s] = '\0';
            if (ckpt__parse_checkpoint_name(base, &num) && num + 1 > next) next = num + 1;
        }
    }
    if (next > acc->iteration) acc->iteration = next;
    free(acc->last_dir);
    acc->last_dir = last;
    last = NULL;
out:
    free(last);
    if (readers)
        for (int i = 0; i < n; i++) ckpt_reader_free(readers[i]);
    free(readers);
    free(plan);
    return rc;
}

int ckpt_load_state(ckpt_accelerator *acc, const char *input_dir) {
    if (!acc) return ckpt__err(CKPT_EINVAL, "load_state: acc is NULL");
    if (input_dir && !input_dir[0]) return ckpt__err(CKPT_EINVAL, "load_state: input_dir is empty");
    CKPT_TRY(own_project(acc, false, "load_state"));
    ckpt_checkpoint_open c;
    memset(&c, 0, sizeof c);
    char *dir = NULL;
    int rc = 0;
    if (input_dir) {
        if (!input_dir[0]) return ckpt__err(CKPT_EINVAL, "load_state: input_dir is empty");
        dir = ckpt__strdup(input_dir);
        if (!dir) return ckpt__err_nomem("load path");
        rc = ckpt__checkpoint_open(dir, true, true, &c);
        if (rc < 0) {
            rc = ckpt__err_prefix(rc, "load_state");
            goto out;
        }
    } else {
        if (!acc->project_dir)
            return ckpt__err(CKPT_EINVAL, "load_state: no input folder given and no project_dir");
        char *cdir = ckpt__checkpoints_dir(acc->project_dir);
        if (!cdir) return ckpt__err_nomem("load path");
        int64_t *nums = NULL, count = 0;
        rc = ckpt__list_numbers(cdir, &nums, &count);
        if (rc == 0 && count == 0)
            rc = ckpt__err(CKPT_ENOENT, "load_state: no checkpoint in %s", cdir);
        /* Why each newer checkpoint was skipped, for the final message. */
        char why[1536] = "";
        for (int64_t i = count - 1; rc == 0 && i >= 0; i--) {
            char name[48];
            snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
            dir = ckpt__path_join(cdir, name);
            if (!dir) {
                rc = ckpt__err_nomem("load path");
                break;
            }
            int orc = ckpt__checkpoint_open(dir, true, true, &c);
            if (orc == 0) break;
            /* Fall back only past a bad checkpoint; a failure of this process
             * (memory, I/O) must not silently load an older state. */
            if (orc != CKPT_ECORRUPT && orc != CKPT_EUNSUPPORTED && orc != CKPT_ENOENT) {
                rc = ckpt__err_prefix(orc, "load_state");
                break;
            }
            ckpt__log(&acc->log, CKPT_LOG_WARNING, "skipping %s: %s%s", dir, ckpt_errmsg(),
                      i > 0 ? "; falling back to an older checkpoint" : "");
            size_t used = strlen(why);
            snprintf(why + used, sizeof why - used, "%s%s", used ? "; " : "", ckpt_errmsg());
            ckpt__checkpoint_close(&c);
            free(dir);
            dir = NULL;
            if (i == 0)
                rc = ckpt__err(CKPT_ECORRUPT, "load_state: no valid checkpoint in %s: %s", cdir, why);
        }
        free(nums);
        free(cdir);
        if (rc < 0) goto out;
    }
    rc = run_hooks(acc, HOOK_LOAD, dir, "load_state");
    if (rc == 0) rc = apply_checkpoint(acc, dir, &c);
out:
    ckpt__checkpoint_close(&c);
    free(dir);
    return rc;
}
