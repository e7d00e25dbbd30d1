/* save_op.h — a save as an object driven through its phases, in order:
 *
 *   new       capture the accelerator's numbering, step, metrics and logger;
 *             check the arguments
 *   plan      rank 0 takes the project lock, picks the number and the
 *             temporary folder, and tells every rank (collective)
 *   snapshot  the pre-hooks (with the temporary folder), every object's
 *             state_dict, the spread plan (local)
 *  [stage]    an asynchronous save copies the tensors into its staging area
 *   write     this rank's files into the temporary folder (local, any thread)
 *   commit    agree (every rank's status, the same objects in the same
 *             order on every rank), rank 0 writes the manifest, renames,
 *             applies total_limit, releases; every rank returns the same
 *             status (collective; with one process any thread)
 *   apply     the caller's thread: the numbering and last folder move on,
 *             the post-hooks run (nothing after a failed commit)
 *   free
 *
 * ckpt_save_state runs them in a row in the caller's thread (async.c); an
 * asynchronous save runs plan, snapshot and stage in the caller's thread,
 * write (and with one process commit) in its background thread, and with
 * several processes commits in the caller's thread at the next wait.
 *
 * A phase called out of order fails the op with CKPT_EINVAL naming both
 * phases: nothing is committed, and commit (which must still be called,
 * on every rank) only releases. Once the op has failed, plan, snapshot,
 * stage and write do nothing but the collectives every rank takes part in;
 * commit agrees on the failure and removes the temporary folder. free
 * removes it too if commit never ran (one process). */
#ifndef CKPT_SAVE_OP_H
#define CKPT_SAVE_OP_H

#include <stdbool.h>
#include <stdint.h>

#include "accel/accel.h"

typedef struct ckpt_save_op ckpt_save_op;

/* A save of acc into output_dir (NULL: the next automatic checkpoint).
 * *out is the op (NULL only if out of memory), to be committed and freed
 * whatever the status; returns this rank's status so far. */
int ckpt__save_op_new(ckpt_accelerator *acc, const char *output_dir, ckpt_save_op **out);
/* Each returns the op's status so far (0, or its first failure). */
int ckpt__save_op_plan(ckpt_save_op *op);
int ckpt__save_op_snapshot(ckpt_save_op *op);
/* Asynchronous saves with several processes: every rank learns whether
 * every snapshot succeeded (collective), before anything is staged. */
int ckpt__save_op_agree_snapshot(ckpt_save_op *op);
/* Copies the files this rank writes into acc's staging area, as many whole
 * files in object order as fit under its limit (ckpt__save_stage_fits); the
 * others are written now. After stage the op borrows nothing of the
 * caller's objects. */
int ckpt__save_op_stage(ckpt_save_op *op);
/* This rank's files not written yet. */
int ckpt__save_op_write(ckpt_save_op *op);
/* The final status, the same on every rank. */
int ckpt__save_op_commit(ckpt_save_op *op);
/* After commit, in the caller's thread (a post-hook may save again). */
void ckpt__save_op_apply(ckpt_save_op *op);
/* NULL is fine. */
void ckpt__save_op_free(ckpt_save_op *op);

/* Before commit: the rotation (total_limit) renames each old checkpoint it
 * removes to a hidden name, which is all anyone sees of the removal, and
 * leaves the deletion of its files to the driver: ckpt__save_op_take_trash
 * after commit hands over their paths. Without it they are deleted inside
 * commit. */
void ckpt__save_op_defer_removal(ckpt_save_op *op);
/* The hidden folders left to delete (malloc'd array of malloc'd paths,
 * the caller's to free), or NULL with *n 0. */
char **ckpt__save_op_take_trash(ckpt_save_op *op, int *n);

/* Records a failure (kept if one is already): commit will agree on it. */
void ckpt__save_op_fail(ckpt_save_op *op, int rc);
int ckpt__save_op_status(const ckpt_save_op *op);
/* The automatic checkpoint's number once planned; -1 for an explicit folder. */
int64_t ckpt__save_op_number(const ckpt_save_op *op);
/* The log callback as at new. */
/* An asynchronous save: with a node-local tier and a communicator with
 * exchange_background (several processes), its replication runs in the
 * background thread after the write (tier_save.c). Right after new. */
void ckpt__save_op_replicate_in_background(ckpt_save_op *op);
bool ckpt__save_op_replicates_in_background(const ckpt_save_op *op);
/* The background thread, after write: that replication (nothing else). */
void ckpt__save_op_replicate(ckpt_save_op *op);
const ckpt_logger *ckpt__save_op_logger(const ckpt_save_op *op);

/* Whether a file of b staging bytes still fits under limit (0: none) with
 * *total staged before it; if so it is counted. Whole files, in object
 * order: the rule of stage and of ckpt_accelerator_prepare_async. */
static inline bool ckpt__save_stage_fits(uint64_t limit, uint64_t *total, uint64_t b) {
    if (limit && (b > limit || *total > limit - b)) return false;
    *total += b;
    return true;
}

#endif
