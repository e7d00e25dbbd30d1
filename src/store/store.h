/* store.h — the checkpoint store: project lock, automatic numbering,
 * leftover temporary folders, rotation. */
#ifndef CKPT_STORE_H
#define CKPT_STORE_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"
#include "base/error.h"

/* "<a>/<b>" in a ckpt__malloc'd string; NULL on allocation failure. */
char *ckpt__path_join(const char *a, const char *b);
/* "<project_dir>/checkpoints". */
char *ckpt__checkpoints_dir(const char *project_dir);

/* 1 and *n if name is exactly "checkpoint_<digits>" (no sign, no leading
 * zero unless the number is 0, fits in int64); else 0. */
int ckpt__parse_checkpoint_name(const char *name, int64_t *n);

/* The numbers of every checkpoint_<n> folder in dir, ascending (malloc'd;
 * free()). A missing dir gives 0 entries. */
int ckpt__list_numbers(const char *dir, int64_t **nums, int64_t *count);

/* For a message about path, a folder that is not a checkpoint: "; <dir>
 * holds checkpoint_5, checkpoint_6 and checkpoint_7" where <dir> is path's
 * folder or else project_dir's checkpoints (may be NULL), or "; there is
 * no checkpoint_<n> folder in ...", into buf (cap bytes; "" if out of
 * memory). A typo (checkpoint_07 for checkpoint_7) is then plain. */
void ckpt__checkpoints_near(const char *path, const char *project_dir, char *buf, size_t cap);

/* Every entry of dir named checkpoint_<n>, whatever its type: *highest gets
 * the largest n (-1: none), so automatic numbering steps over a file, a
 * symlink or anything else that holds a checkpoint name (a commit could
 * never rename over it). odd (cap bytes; may be NULL) gets those that are
 * no checkpoint folder, "checkpoint_8 (a symbolic link), ..." ("": none).
 * A missing dir has none. */
int ckpt__names_taken(const char *dir, int64_t *highest, char *odd, size_t cap);
/* Removes the leftover temporary folders in dir (".checkpoint_<n>.tmp.<pid>"
 * and rotation's ".old." ones) whose process is gone, one warning each;
 * those of a process still running (this one too) stay. Only under the lock
 * that covers dir. Failures to remove are warnings. */
void ckpt__remove_dead_leftovers(const char *dir, const ckpt_logger *lg);

/* An exclusive, non-blocking flock on a lock file (created if missing). */
typedef struct ckpt_lock {
    int fd;
    bool skipped; /* a load on a read-only file system with no lock file */
} ckpt_lock;
/* CKPT_EBUSY naming the lock file (and the holder's pid when known). The
 * lock file is never followed or written unless it is ckpt's own: a regular
 * file with one name holding nothing but a "<pid> <host>" line; a symlink,
 * a hard link, a FIFO, a folder or other content is CKPT_EINVAL naming what
 * was found, and that file is left untouched. load_only: the caller only
 * reads the folder; where the lock cannot be opened for writing (read-only
 * file system, EROFS; no write permission, EACCES) an existing lock file is
 * locked through a read-only descriptor, and on a read-only file system
 * without one the lock is skipped (returns 0, lk->fd -1, lk->skipped true:
 * nothing can save there). */
int ckpt__lock_acquire(ckpt_lock *lk, const char *lock_path, bool load_only);
void ckpt__lock_release(ckpt_lock *lk);

/* The lock that covers saves to <parent>/<base>: "<parent>/.lock" when base
 * is an automatic name checkpoint_<n> (one lock for the whole checkpoints
 * folder, so numbering, rotation and cleanup are serialised), else
 * "<parent>/.<base>.lock" (one lock per explicit folder). */
char *ckpt__lock_path(const char *parent, const char *base);
/* Name of the temporary folder of a save whose final folder is `base`:
 * ".<base>.tmp.<pid>". */
char *ckpt__temp_name(const char *base);
/* Removes leftover temporary folders of interrupted saves in dir: hidden
 * ".<base>.tmp*" names (base NULL: any ".checkpoint_<digits>.tmp*" name),
 * warning about each. Only called under the lock that covers those names. */
int ckpt__remove_leftovers(const char *dir, const char *base, const ckpt_logger *lg);
/* Removes checkpoint folder `name` of dir: hidden first by one rename
 * (".<name>.old.<pid>", made durable), then deleted, so a crash midway never
 * leaves a visible half-deleted checkpoint; the next save or prune removes
 * the hidden leftover. A failure to delete is only logged through lg. */
int ckpt__remove_checkpoint(const char *dir, const char *name, const ckpt_logger *lg);
/* What a retention keeps beyond the newest `keep` (ckpt_prune_options'
 * policy fields; all 0 / NULL: none). */
typedef struct ckpt_retention {
    int64_t keep_every_steps;
    const char *best_metric;
    ckpt_best_mode best_mode;
    int best_k;
} ckpt_retention;
/* Whether a policy is set (the rule of ckpt_checkpoint_prune_ex changes). */
bool ckpt__retention_active(const ckpt_retention *pol);
/* CKPT_EINVAL naming `what` and the field for a bad policy. */
int ckpt__retention_check(const ckpt_retention *pol, const char *what);
/* What a save's rotation knows beyond the rule (NULL: nothing).
 *   fresh  the number of the checkpoint the save just committed (-1:
 *          none): every one of its files was hashed by this process on its
 *          way to the disk, or read back and hashed after it was linked, so
 *          it counts as valid after a shallow check (manifest and sizes)
 *          instead of a second read of all its bytes.
 *   defer  where the deletion of each removed folder goes: the folder is
 *          renamed to a hidden leftover name (".checkpoint_<n>.old.<pid>")
 *          and the folder above fsynced, which is all anyone sees of the
 *          removal, and defer(user, hidden path) is handed the deletion of
 *          its files (the path is the callee's to free). NULL: deleted here. */
typedef struct ckpt_rotate_opts {
    int64_t fresh;
    void (*defer)(void *user, char *hidden);
    void *user;
} ckpt_rotate_opts;
/* What a rotation or prune is asked to do, and what it did. */
typedef struct ckpt_rotation {
    int64_t keep;
    const ckpt_retention *pol; /* NULL or inactive: the newest `keep` only */
    bool dry_run;
    bool verify_all;     /* also verify the checkpoints beyond keep (to say why each goes) */
    bool shallow_beyond; /* ... checking those against their manifests only, not reading them */
    ckpt_prune_fn report;
    void *user;
    const ckpt_logger *lg;        /* NULL: no warnings (the report says it) */
    const ckpt_rotate_opts *opts; /* a save's (ckpt__rotate), else NULL */
    int64_t removed;
    int64_t valid_kept; /* valid checkpoints not removed (of those verified) */
} ckpt_rotation;
/* Where the checkpoints of a rotation are: a local checkpoints folder, or
 * a bucket's (store/s3). numbers: the checkpoint numbers, ascending;
 * verify: checkpoint_<number> checked (deep: every byte) as
 * ckpt_checkpoint_verify does, info filled; remove: it goes, for every
 * reader at once. where names the checkpoints' parent in reports. */
typedef struct ckpt_rotate_src {
    void *ctx;
    const char *where;
    int (*numbers)(void *ctx, int64_t **nums, int64_t *count);
    int (*verify)(void *ctx, int64_t number, bool deep, ckpt_checkpoint_info *info);
    int (*remove)(void *ctx, int64_t number, const ckpt_logger *lg);
} ckpt_rotate_src;
/* The rule of ckpt_checkpoint_prune_ex over src: which checkpoints go
 * (keep, the retention policy), reported, removed unless a dry run. */
int ckpt__rotate_src(const ckpt_rotate_src *src, ckpt_rotation *r);
/* Removes the checkpoint_<n> folders of dir the retention rule does not
 * keep (ckpt_checkpoint_prune_ex's rule; keep >= 0; pol may be NULL).
 * *removed (may be NULL) gets the count. */
int ckpt__rotate(const char *dir, int64_t keep, const ckpt_retention *pol, const ckpt_logger *lg,
                 const ckpt_rotate_opts *opts, int64_t *removed);

/* The folder tools of include/ckpt/files.h on local folders (store.c); the
 * public functions (store/s3/project.c) hand s3:// URLs to object storage
 * and everything else to these. */
int ckpt__checkpoint_verify_local(const char *dir, bool deep, ckpt_checkpoint_info *info);
int ckpt__checkpoint_verify_file_local(const char *dir, const char *name);
int ckpt__checkpoint_shared_bytes_local(const char *dir, const char *other, uint64_t *bytes);
int ckpt__checkpoint_list_local(const char *project_dir, bool deep, ckpt_checkpoint_info **out,
                                int64_t *count);
int ckpt__checkpoint_leftovers_local(const char *project_dir, ckpt_leftover_info **out,
                                     int64_t *count);
int ckpt__checkpoint_prune_ex_local(const char *project_dir, const ckpt_prune_options *opts,
                                    int64_t *removed);

#endif
