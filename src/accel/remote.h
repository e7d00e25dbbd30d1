/* remote.h — an accelerator whose project folder is in object storage
 * (project_dir "s3://bucket/prefix"; remote.c says how). The save streams
 * into the bucket (save_remote.c), the load reads from it (load_remote.c);
 * both through the same phases as a local project's. */
#ifndef CKPT_ACC_REMOTE_H
#define CKPT_ACC_REMOTE_H

#include <stdint.h>

#include "accel/accel.h"
#include "store/s3/remote.h"

/* What an accelerator knows of its bucket. */
struct ckpt_acc_remote {
    char *url;
    ckpt_remote r; /* opened at the first save or load (on every rank) */
    bool opened;
    ckpt_remote_lock lk; /* rank 0: held from the first save until free */
    /* rank 0: the plan's listing of the checkpoints, kept for the rotation
     * after the commit (one listing per save) */
    ckpt_remote_entry *scan;
    int64_t nscan;
};

/* At accelerator_new: project_dir becomes the local folder (remote.c). */
int ckpt__acc_remote_init(ckpt_accelerator *acc, const char *url);
void ckpt__acc_remote_free(ckpt_accelerator *acc);
/* "s3://bucket/prefix" of a remote project, else NULL. */
const char *ckpt__acc_remote_url(const ckpt_accelerator *acc);
/* Opens the project's client once. */
int ckpt__acc_remote_open(ckpt_accelerator *acc);
/* A client for a checkpoint URL: the project's when the bucket is its
 * (own->c NULL then), else own, opened here (ckpt__remote_close it).
 * *dir gets the checkpoint's key (ckpt__malloc'd). */
int ckpt__acc_remote_for(ckpt_accelerator *acc, const char *url, ckpt_remote *own, ckpt_remote **r,
                         char **dir);

#endif
