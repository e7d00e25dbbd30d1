/* accel.h — the accelerator's internals shared by its files: the registry of
 * saved objects and hooks (accelerator.c), the save phases (save.c), the
 * load phases (load.c) and the collectives they agree through
 * (collective.c). One process is the case of a one-rank communicator: the
 * phases are the same, the collectives trivial. */
#ifndef CKPT_ACCEL_H
#define CKPT_ACCEL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"
#include "base/io.h"
#include "store/store.h"
#include "accel/tier.h"

/* ckpt_project_config.link_copies when 0. */
#define CKPT_LINK_COPIES_DEFAULT 2

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
extern const char *const ckpt__kind_stem[K_COUNT];
extern const char *const ckpt__kind_name[K_COUNT];
extern const char *const ckpt__kind_noun[K_COUNT];

/* Longest name of a named custom object (ckpt_register_for_checkpointing_named). */
#define CKPT_ACC_NAME_MAX 64

typedef struct ckpt_acc_obj {
    int kind;
    int index; /* k-th of its kind (a custom object: k-th unnamed one, or, named, k-th of all) */
    const ckpt_stateful_ops *ops;
    void *self;
    char name[CKPT_ACC_NAME_MAX + 1]; /* a named custom object's name, its file's stem; else "" */
} ckpt_acc_obj;

enum { HOOK_SAVE = 0, HOOK_LOAD = 1, HOOK_SAVE_POST = 2, HOOK_LOAD_POST = 3, HOOK_KINDS = 4 };

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
    int process_index; /* names this process's files (random_states_<i>) */
    int num_processes;
    /* The process group saves and loads agree over: the config's comm, or
     * the one-process communicator. rank is comm->rank: rank 0 plans and
     * commits. Without a config comm, process_index is only recorded. */
    const ckpt_comm *comm;
    /* Each collective wait of a save or load, in seconds (< 0: none), and
     * how deeply operations nest (a load settles a pending save): only the
     * outermost one starts and ends the comm's operation. */
    double coll_timeout;
    int coll_depth;
    ckpt_logger log;
    ckpt_acc_obj *objs;
    int nobjs, cap;
    int count[K_COUNT];
    int unnamed; /* unnamed custom objects: custom_checkpoint_<i> */
    ckpt_rng rng;
    /* The step: the first prepared optimizer's count unless step_set (by
     * ckpt_accelerator_set_step, or a load of a checkpoint whose step is
     * not its optimizer's); step_warned: the save's warning that the two
     * differ was given. */
    int64_t step;
    bool step_set, step_warned;
    /* entries named checkpoint_<n> that are no checkpoint folder were
     * reported (once per accelerator) */
    bool odd_names_said;
    char *last_dir;
    ckpt_hook_handle *hooks[HOOK_KINDS];
    /* A save ran or a load began to apply: the objects may hold state no
     * checkpoint holds, so loads verify everything before changing anything
     * (two passes); until then a load is the resume, made in one pass
     * (load.c). */
    bool objects_live;
    /* The last ckpt_load_state failed (other than "no checkpoint"): saves
     * refuse until a load succeeds or ckpt_accelerator_start_over. */
    bool load_failed;
    int load_failed_code;
    char *load_failed_msg; /* may be NULL (no memory to copy it) */
    /* Asynchronous saves (async.c): NULL until the first one. */
    struct ckpt_async *async;
    uint64_t async_staging_limit; /* 0: no limit */
    unsigned async_background;    /* CKPT_ASYNC_* of the background thread's jobs */
    /* One reusable buffer area: an asynchronous save's staging, then a
     * load's read buffers (never both at once: a load waits for the save).
     * Once it is the staging area (ckpt_accelerator_prepare_async, or an
     * asynchronous save staged into it) it stays until free, by design;
     * else a load that needed it gives it back at its end. */
    ckpt_arena arena;
    bool arena_staging;
    ckpt_lock project_lock; /* rank 0: held from the first save or load until free */
    /* ckpt_should_save (policy.c) */
    int64_t save_interval_steps;
    double save_interval_seconds;
    double interval_start; /* ckpt__now(): creation, last save call, last load */
    /* retention beyond total_limit (best_metric a copy) */
    ckpt_retention retention;
    uint64_t max_shard_size; /* models beyond it are saved as HF shards */
    bool no_link_unchanged;  /* incremental saves off: every file is written */
    int link_copies;         /* physical copies kept among the retained checkpoints */
    uint64_t last_save_written, last_save_linked; /* ckpt_accelerator_last_save_bytes */
    char *link_dir; /* the checkpoint last saved or loaded (even partly): see save.c */
    /* A project in object storage (remote.c); NULL for a local one. */
    struct ckpt_acc_remote *remote;
    /* ckpt_set_metric: recorded by the next save */
    int nmetrics;
    ckpt_metric metrics[CKPT_MAX_METRICS];
    /* the node-local tier (tier.h); tier.pattern NULL: none */
    ckpt_tier tier;
};

/* Monotonic seconds (policy.c); tests replace the clock with
 * ckpt__set_clock (NULL: the real one). */
double ckpt__now(void);
void ckpt__set_clock(double (*fn)(void));

/* The file an object's state goes to: "model.safetensors",
 * "custom_checkpoint_2.safetensors", "<name>.safetensors" (a named custom
 * object), "random_states_<process_index>...". */
void ckpt__acc_file_name(const ckpt_accelerator *acc, const ckpt_acc_obj *o, char *buf, size_t cap);
/* The name of this process's shard file of the object whose file is
 * `file`: "<stem>-<rank+1>-of-<size>.safetensors", 5 digits each. */
int ckpt__acc_shard_name(const char *file, int rank, int size, char *buf, size_t cap);
/* The file of the frozen tensors of the model whose file is file, kept apart
 * by one process: "<stem>.frozen.safetensors". */
int ckpt__acc_frozen_name(const char *file, char *buf, size_t cap);
/* Whether name is a shard file "<stem>-DDDDD-of-DDDDD.safetensors" (or a
 * frozen file "<stem>.frozen.safetensors", shard 1 of 1); if so
 * and stem is not NULL, whether its stem is exactly stem (the object's file
 * name without ".safetensors"). */
bool ckpt__acc_is_shard_of(const char *name, const char *stem_file);
/* Every saved object in file order, the accelerator's generator last. *n
 * entries in a ckpt__malloc'd array; NULL if out of memory. */
ckpt_acc_obj *ckpt__acc_plan_objects(ckpt_accelerator *acc, int *n);
/* A full load restores the checkpoint's step: it is followed as set when it
 * differs from the (just loaded) first optimizer's count. */
void ckpt__acc_restore_step(ckpt_accelerator *acc, int64_t step);
/* The step a save records (ckpt_accelerator_step); the first time it was set
 * explicitly to other than the first prepared optimizer's count, a warning
 * says so (once per accelerator). */
int64_t ckpt__acc_save_step(ckpt_accelerator *acc);
/* One run per project: the first save or load (rank 0's) takes the project
 * lock, <project_dir>/checkpoints/.lock, and keeps it until the accelerator
 * is freed, so a second run is refused at its first call (CKPT_EBUSY naming
 * the owner), not at a later save. create: make the checkpoints folder (a
 * save); else (a load) take the lock only if the folder exists. No-op
 * without a project_dir or when already held. */
int ckpt__acc_own_project(ckpt_accelerator *acc, bool create, const char *what);
/* Whether lock_path is the lock file acc already holds. */
bool ckpt__acc_holds_lock_file(const ckpt_accelerator *acc, const char *lock_path);
/* Runs the hooks of one kind (HOOK_*) in registration order, each with the
 * thread's message cleared first. Pre-hooks: the first failure stops them and
 * is returned, with a message naming dir, `what` and the hook's own message
 * (or the status it returned). Post-hooks: a failure is logged as a warning
 * and the others still run; returns 0. */
int ckpt__acc_run_hooks(ckpt_accelerator *acc, int which, const char *dir, const char *what);

/* ---- the save phases: save_op.h ------------------------------------------ */

/* ---- asynchronous saves (async.c) ------------------------------------------ */
/* Ends the pending asynchronous save, if any: waits for its thread, and
 * with several processes runs its agreement and commit here (collective).
 * A failure is kept; if report, the kept failure (this one's or an earlier
 * one's) is returned, with its message, and forgotten; if not, it waits for
 * the next call that reports. */
int ckpt__async_settle(ckpt_accelerator *acc, bool report);
/* Settles, stops the thread, frees the staging area (ckpt_accelerator_free). */
void ckpt__async_free(ckpt_accelerator *acc);

/* ---- collectives (collective.c) ------------------------------------------ */
/* All are collective over c: every rank calls them in the same order. With
 * one rank they do nothing and keep the message as it is. */

/* Every rank passes its own status rc (its message in ckpt_errmsg()); every
 * rank returns the same status and holds the same message: 0 if every rc
 * was 0; else the status of the lowest failing rank, message "rank <r>:
 * <its message>" (plus how many other ranks failed). If prefer is not NULL,
 * a failing rank whose status satisfies prefer is reported before the
 * others. A failure of the communicator itself is returned as is (CKPT_EIO
 * naming it) and may differ between ranks. */
int ckpt__coll_agree(const ckpt_comm *c, int rc, bool (*prefer)(int rc));
/* The same, where this rank's failure may only echo another rank's (echo:
 * it stopped because another rank did, as a streamed load's ranks do,
 * load.c): a failing rank's own message is reported before any echo. */
int ckpt__coll_agree_echo(const ckpt_comm *c, int rc, bool (*prefer)(int rc), bool echo);
/* Rank 0's status and message reach every rank: rank 0 passes rc, the
 * others anything; all return rank 0's rc, and on failure every rank's
 * message is "rank 0: <rank 0's message>". A rank whose copy did not
 * arrive still learns rank 0's status (one reduction follows the
 * broadcast), so every rank returns the same. */
int ckpt__coll_share(const ckpt_comm *c, int rc);
/* Rank 0's n bytes at *buf reach every rank: elsewhere *buf gets a
 * ckpt__malloc'd copy (free() it; one extra NUL byte after the data) and *n
 * its length. A transfer that fails on one rank fails on every rank (each
 * step is agreed on). */
int ckpt__coll_bcast_bytes(const ckpt_comm *c, char **buf, size_t *n);
/* Deadlines (ckpt_comm.deadline; nothing for a comm without them or one
 * rank). ckpt__coll_begin starts an operation of acc (or, nested in one,
 * only names the phase), ckpt__coll_phase names the phase of the
 * collectives that follow, ckpt__coll_end ends what begin started. Every
 * rank calls them at the same points. phase is named in a CKPT_ETIMEDOUT
 * message ("save: agree on the commit"). */
void ckpt__coll_begin(ckpt_accelerator *acc, const char *phase);
void ckpt__coll_phase(ckpt_accelerator *acc, const char *phase);
void ckpt__coll_end(ckpt_accelerator *acc);
/* Checks a user-supplied communicator: rank/size in range, every function
 * set. CKPT_EINVAL naming what is wrong. */
int ckpt__comm_check(const ckpt_comm *c, const char *what);

#endif
