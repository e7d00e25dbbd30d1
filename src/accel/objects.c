/* objects.c — what the accelerator's save and load share: the kinds of
 * objects and their file names, the plan of objects to save, the project
 * lock, the hooks and the step. Kept apart from accelerator.c (lifecycle and
 * registration) so that save.c and load.c depend on this file and
 * accelerator.c on them, never back: the call graph has no cycle. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "store/store.h"

const char *const ckpt__kind_stem[K_COUNT] = {"model",      "optimizer", "scheduler",
                                             "dataloader", "scaler",    "custom_checkpoint",
                                             "random_states"};
const char *const ckpt__kind_name[K_COUNT] = {"model",  "optimizer", "scheduler",    "dataloader",
                                             "scaler", "custom",    "random_states"};
const char *const ckpt__kind_noun[K_COUNT] = {
    "model", "optimizer", "scheduler", "data loader", "scaler", "custom object", "random state"};

/* ---- the project lock -------------------------------------------------------- */

int ckpt__acc_own_project(ckpt_accelerator *acc, bool create, const char *what) {
    if (!acc->project_dir || acc->project_lock.fd >= 0) return 0;
    char *dir = ckpt__checkpoints_dir(acc->project_dir);
    char *lp = dir ? ckpt__path_join(dir, ".lock") : NULL;
    int rc = 0;
    struct stat st;
    if (!lp) rc = ckpt__err_nomem("lock path");
    else if (create) rc = ckpt__mkdirs(dir);
    else if (ckpt__os_stat(dir, &st) != 0)
        goto out; /* nothing to own yet; a load creates nothing */
    if (rc == 0) rc = ckpt__lock_acquire(&acc->project_lock, lp, !create);
    /* A resume owns the project from here: the temporary folders of saves
     * that were killed are garbage now (a save removes them all anyway). */
    if (rc == 0 && !create && acc->project_lock.fd >= 0)
        ckpt__remove_dead_leftovers(dir, &acc->log);
    if (rc == 0 && acc->project_lock.skipped)
        ckpt__log(&acc->log, CKPT_LOG_WARNING,
                  "%s: %s: read-only file system: loading without the project lock (nothing can "
                  "save there)",
                  what, lp);
    if (rc < 0) rc = ckpt__err_prefix(rc, "%s", what);
out:
    free(lp);
    free(dir);
    return rc;
}

bool ckpt__acc_holds_lock_file(const ckpt_accelerator *acc, const char *lock_path) {
    struct stat a, b;
    return acc->project_lock.fd >= 0 && ckpt__os_lstat(lock_path, &a) == 0 &&
           ckpt__os_fstat(acc->project_lock.fd, &b) == 0 && a.st_dev == b.st_dev &&
           a.st_ino == b.st_ino;
}


/* ---- hooks ---------------------------------------------------------------- */

static const char *const hook_name[HOOK_KINDS] = {"save_state pre-hook", "load_state pre-hook",
                                                  "save_state post-hook", "load_state post-hook"};

int ckpt__acc_run_hooks(ckpt_accelerator *acc, int which, const char *dir, const char *what) {
    ckpt_hook_handle *h = acc->hooks[which];
    bool post = which == HOOK_SAVE_POST || which == HOOK_LOAD_POST;
    while (h) {
        /* A hook may remove itself: take the next one first. */
        ckpt_hook_handle *next = h->next;
        ckpt_clear_error();
        int r = h->fn(h->user, acc, dir);
        if (r != 0) {
            r = ckpt__callback_failed(r, "the hook");
            r = ckpt__err_prefix(r, "%s: %s: a %s failed", what, dir, hook_name[which]);
            if (!post) return r;
            ckpt__log(&acc->log, CKPT_LOG_WARNING, "%s", ckpt_errmsg());
        }
        h = next;
    }
    if (post) ckpt_clear_error();
    return 0;
}

/* ---- file names and the save plan ------------------------------------------ */

void ckpt__acc_file_name(const ckpt_accelerator *acc, const ckpt_acc_obj *o, char *buf,
                         size_t cap) {
    if (o->kind == K_RNG)
        snprintf(buf, cap, "%s_%d.safetensors", ckpt__kind_stem[K_RNG], acc->process_index);
    else if (o->kind == K_CUSTOM && o->name[0]) snprintf(buf, cap, "%s.safetensors", o->name);
    else if (o->kind == K_CUSTOM)
        snprintf(buf, cap, "%s_%d.safetensors", ckpt__kind_stem[K_CUSTOM], o->index);
    else if (o->index == 0) snprintf(buf, cap, "%s.safetensors", ckpt__kind_stem[o->kind]);
    else snprintf(buf, cap, "%s_%d.safetensors", ckpt__kind_stem[o->kind], o->index);
}

#define SAFETENSORS_EXT ".safetensors"

/* The object's file name without ".safetensors": the stem of its shards. */
static size_t stem_len(const char *file) {
    size_t n = strlen(file), k = strlen(SAFETENSORS_EXT);
    return n >= k && strcmp(file + n - k, SAFETENSORS_EXT) == 0 ? n - k : n;
}

int ckpt__acc_shard_name(const char *file, int rank, int size, char *buf, size_t cap) {
    char stem[128];
    size_t n = stem_len(file);
    if (n >= sizeof stem) return ckpt__err(CKPT_EINVAL, "%s: name too long for a shard file", file);
    memcpy(stem, file, n);
    stem[n] = '\0';
    return ckpt__shard_file_name(buf, cap, stem, rank, size);
}

int ckpt__acc_frozen_name(const char *file, char *buf, size_t cap) {
    char stem[128];
    size_t n = stem_len(file);
    if (n >= sizeof stem)
        return ckpt__err(CKPT_EINVAL, "%s: name too long for a frozen file", file);
    memcpy(stem, file, n);
    stem[n] = '\0';
    return ckpt__frozen_file_name(buf, cap, stem);
}

bool ckpt__acc_is_shard_of(const char *name, const char *stem_file) {
    size_t n = 0;
    int index = 0, count = 0;
    if (!ckpt__shard_file_parse(name, &n, &index, &count)) return false;
    if (!stem_file) return true;
    return n == stem_len(stem_file) && memcmp(name, stem_file, n) == 0;
}

ckpt_acc_obj *ckpt__acc_plan_objects(ckpt_accelerator *acc, int *n) {
    ckpt_acc_obj *v = ckpt__malloc((size_t)(acc->nobjs + 1) * sizeof *v);
    if (!v) return NULL;
    int k = 0;
    for (int kind = 0; kind < K_COUNT; kind++)
        for (int i = 0; i < acc->nobjs; i++)
            if (acc->objs[i].kind == kind) v[k++] = acc->objs[i];
    v[k++] = (ckpt_acc_obj){.kind = K_RNG, .ops = ckpt_rng_ops(), .self = &acc->rng};
    *n = k;
    return v;
}

/* ---- the step -------------------------------------------------------------- */

static const ckpt_optimizer *first_optimizer(const ckpt_accelerator *acc) {
    for (int i = 0; i < acc->nobjs; i++)
        if (acc->objs[i].kind == K_OPTIMIZER) return acc->objs[i].self;
    return NULL;
}

/* The step follows the first prepared optimizer unless it was set. */
int64_t ckpt_accelerator_step(const ckpt_accelerator *acc) {
    if (!acc) return 0;
    const ckpt_optimizer *o = acc->step_set ? NULL : first_optimizer(acc);
    return o ? ckpt_optimizer_get_step(o) : acc->step;
}

void ckpt_accelerator_set_step(ckpt_accelerator *acc, int64_t step) {
    if (!acc) return;
    acc->step = step;
    acc->step_set = true;
}

void ckpt__acc_restore_step(ckpt_accelerator *acc, int64_t step) {
    const ckpt_optimizer *o = first_optimizer(acc);
    acc->step = step;
    /* a checkpoint whose step is its optimizer's goes on following it */
    acc->step_set = !o || ckpt_optimizer_get_step(o) != step;
}

int64_t ckpt__acc_save_step(ckpt_accelerator *acc) {
    const ckpt_optimizer *o = first_optimizer(acc);
    int64_t step = ckpt_accelerator_step(acc);
    if (!o || !acc->step_set || acc->step_warned || ckpt_optimizer_get_step(o) == step) return step;
    acc->step_warned = true;
    if (acc->comm->rank == 0)
        ckpt__log(&acc->log, CKPT_LOG_WARNING,
                  "save_state: the step set with ckpt_accelerator_set_step (%" PRId64
                  ") differs from the step count of the first prepared optimizer (%" PRId64
                  "); the checkpoint records %" PRId64 " (said once)",
                  step, ckpt_optimizer_get_step(o), step);
    return step;
}
