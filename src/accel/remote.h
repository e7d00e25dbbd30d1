/* remote.h — an accelerator whose project folder is in object storage
 * (remote.c says how). Every function but init is a no-op question when the
 * project is local (acc->remote NULL). */
#ifndef CKPT_ACC_REMOTE_H
#define CKPT_ACC_REMOTE_H

#include <stdint.h>

#include "accel/accel.h"
#include "store/s3/remote.h"

/* What an accelerator knows of its bucket (remote.c, remote_load.c). */
struct ckpt_acc_remote {
    char *url;
    ckpt_remote r; /* opened at the first save or load */
    bool opened;
    ckpt_remote_lock lk; /* held from the first save until free */
};
/* Opens the client once. */
int ckpt__acc_remote_open(ckpt_accelerator *acc);
/* CKPT_EUNSUPPORTED for a job of several processes (not yet supported). */
int ckpt__acc_remote_refuse_mpi(const ckpt_accelerator *acc, const char *what);

/* At accelerator_new: project_dir becomes the local staging folder. */
int ckpt__acc_remote_init(ckpt_accelerator *acc, const char *url);
void ckpt__acc_remote_free(ckpt_accelerator *acc);
/* "s3://bucket/prefix" of a remote project, else NULL. */
const char *ckpt__acc_remote_url(const ckpt_accelerator *acc);
/* A save's plan: the lock taken or renewed, leftovers removed, and *number
 * raised above every checkpoint number in the bucket. */
int ckpt__acc_remote_plan(ckpt_accelerator *acc, int64_t *number, const ckpt_logger *lg);
/* A save's commit: the staged folder tmp (its manifest written) uploaded as
 * checkpoint_<number> (or the next free number: *committed), then
 * total_limit applied in the bucket. */
int ckpt__acc_remote_commit(ckpt_accelerator *acc, const char *tmp, int64_t number,
                            int64_t *committed, const ckpt_logger *lg);
/* "<url>/checkpoints/checkpoint_<number>" (ckpt__malloc'd). */
char *ckpt__acc_remote_checkpoint_url(const ckpt_accelerator *acc, int64_t number);
/* Before a load: input_dir NULL, the project's newest checkpoint that
 * arrives whole and verified is copied into the staging folder (where the
 * local load finds it); an s3:// input_dir is copied and *local names the
 * copy (load that instead). *url: the checkpoint copied (for last_dir). A
 * local project and a local input_dir: nothing. */
int ckpt__acc_remote_prefetch(ckpt_accelerator *acc, const char *input_dir, char **local,
                              char **url);
/* After the load: the copies are removed; frees local. */
void ckpt__acc_remote_after_load(ckpt_accelerator *acc, char *local);

#endif
