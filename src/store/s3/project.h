/* project.h — the folder tools of include/ckpt/files.h on s3:// URLs (the
 * public functions of store.c and object.c hand a URL here), and a local
 * copy of a remote checkpoint for the readers that need a folder. */
#ifndef CKPT_S3_PROJECT_H
#define CKPT_S3_PROJECT_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"

int ckpt__remote_verify_url(const char *url, bool deep, ckpt_checkpoint_info *info);
int ckpt__remote_list_url(const char *project_url, bool deep, ckpt_checkpoint_info **out,
                          int64_t *count);
int ckpt__remote_leftovers_url(const char *project_url, ckpt_leftover_info **out, int64_t *count);
int ckpt__remote_prune_url(const char *project_url, const ckpt_prune_options *opts,
                           int64_t *removed);
int ckpt__remote_files_url(const char *url, ckpt_checkpoint_file **out, int64_t *count);
int ckpt__remote_verify_file_url(const char *url, const char *name);

/* A verified local copy of the checkpoint at url (ckpt__remote_fetch) in a
 * fresh private folder under $TMPDIR (or /tmp): *local names the copy,
 * *root the folder to pass to ckpt__remote_checkout_done, which removes it. */
int ckpt__remote_checkout(const char *url, char **local, char **root);
void ckpt__remote_checkout_done(char *local, char *root);

#endif
