/* load_op.h — a load as an object driven through its phases, in order, the
 * mirror of the save (save_op.h):
 *
 *   new      capture the accelerator, the options and the report; select
 *            the objects (bad options fail here, before anything is read,
 *            and change nothing, not even the refusal of saves)
 *   choose   the checkpoint to try: at the first call a pending
 *            asynchronous save ends, rank 0 takes the project lock and the
 *            candidates are listed (the caller's folder, or the project's
 *            checkpoints, newest first: rank 0's list on every rank); after
 *            a damaged candidate, the next older one. Where a later
 *            "newest step available on some tier" decision plugs in.
 *   plan     the candidate's manifest; which rank reads and verifies which
 *            file (a function of the manifest: the same on every rank)
 *   read     this rank's files read and verified (hashed on the way into
 *            private memory; the default load of one process: hashed
 *            whole and not kept, hashed again as the objects read them;
 *            one pass: checked by size now and hashed while the objects
 *            read them); every rank agrees on the
 *            candidate. Damaged (corrupt, unsupported, missing) with an
 *            older candidate left: returns CKPT__LOAD_NEXT and the driver
 *            goes back to choose. Taken: with several processes the files
 *            reach the ranks that need them, the replicated chunks left to
 *            be streamed while the objects read them (load_stream.c). Where
 *            another storage back end (an object store) plugs in.
 *   check    the pre-hooks; every object matched with its file, its schema
 *            and values checked (check_state_dict), changing nothing; the
 *            report made
 *   agree    every rank's verdict: nothing is applied anywhere unless every
 *            rank's checks passed
 *   apply    every object loads; after a full load the accelerator's step,
 *            numbering and last folder move on
 *   finish   the post-hooks after a success; the refusal of saves set or
 *            lifted (ckpt.h); the final status, the same on every rank
 *   free
 *
 * ckpt_load_state_ex runs them in a row (load.c), for one process and for
 * many alike (the collectives are trivial with one); ckpt_model_load_weights
 * (src/interop) runs new_object, read_from, check, agree, apply, finish.
 *
 * Every phase returns the op's status so far (0, or this rank's first
 * failure). Phases with collectives (choose, read, check with streamed
 * chunks, agree, apply, finish) take part in them on every rank even after
 * a failure of this rank's own that the ranks have not agreed on yet; once
 * a failure is agreed (the same on every rank), a phase does nothing. A
 * phase called out of order fails the op with CKPT_EINVAL naming both
 * phases: nothing is applied, and finish reports it like any failed load. */
#ifndef CKPT_LOAD_OP_H
#define CKPT_LOAD_OP_H

#include <stdint.h>

#include "accel/accel.h"

typedef struct ckpt__load_op ckpt__load_op;

/* read: the candidate is damaged and an older one is left (see above). */
#define CKPT__LOAD_NEXT 1

/* A load of acc from input_dir (NULL: the project's newest valid
 * checkpoint) with opt (NULL: everything, exactly); report (may be NULL) is
 * zeroed now, filled on success. Collective. *out is the op (NULL only if
 * out of memory, then the status is returned), to be finished and freed
 * whatever the status. */
int ckpt__load_op_new(ckpt_accelerator *acc, const char *input_dir, const ckpt_load_options *opt,
                      ckpt_load_report *report, ckpt__load_op **out);
/* A load into one object that no accelerator holds (kind K_MODEL: a
 * model), one process: no hooks, no lock, no refusal of saves, nothing
 * logged; what names the op in messages ("load_weights"). Its source comes
 * from read_from. */
int ckpt__load_op_new_object(int kind, const ckpt_stateful_ops *ops, void *self,
                             const ckpt_load_options *opt, ckpt_load_report *report,
                             const char *what, ckpt__load_op **out);
int ckpt__load_op_choose(ckpt__load_op *op);
int ckpt__load_op_plan(ckpt__load_op *op);
/* 0, a failure, or CKPT__LOAD_NEXT. */
int ckpt__load_op_read(ckpt__load_op *op);
/* Instead of choose, plan and read: the selected object's reader from a
 * source of the caller's (Hugging Face or PyTorch weights, one object of a
 * checkpoint), taken over whatever the status; name names the source in
 * messages and the report, step is the report's. One process only. */
int ckpt__load_op_read_from(ckpt__load_op *op, const char *name, int64_t step, ckpt_reader *r);
int ckpt__load_op_check(ckpt__load_op *op);
int ckpt__load_op_agree(ckpt__load_op *op);
int ckpt__load_op_apply(ckpt__load_op *op);
/* The final status (see above). */
int ckpt__load_op_finish(ckpt__load_op *op);
/* NULL is fine. */
void ckpt__load_op_free(ckpt__load_op *op);

/* The op's status so far, and the folder chosen (NULL before read). */
int ckpt__load_op_status(const ckpt__load_op *op);
const char *ckpt__load_op_dir(const ckpt__load_op *op);

#endif
