/* remote_int.h — what the files of a project in object storage share
 * (remote.c: scan, checks, the load's reads, the lock; remote_save.c: a
 * save's objects, the commit, removal and rotation). Nothing else
 * includes it. */
#ifndef CKPT_REMOTE_INT_H
#define CKPT_REMOTE_INT_H

#include "store/s3/remote.h"

/* Every object under key dir/ into e (names relative to dir/). */
int ckpt__remote_list_dir(ckpt_remote *r, const char *dir, ckpt_remote_entry *e);
void ckpt__remote_entry_clear(ckpt_remote_entry *e);
/* Every file m lists is in e with its size, and no .safetensors object is
 * unlisted; url names the checkpoint in messages. */
int ckpt__remote_check_listing(const char *url, const ckpt_manifest *m, const ckpt_remote_entry *e);

#endif
