/* remote.h — a project folder in object storage (s3://bucket/prefix): the
 * checkpoint folder logic of src/store over the object-store client.
 *
 * The keys are the folder layout: <prefix>/checkpoints/checkpoint_<n>/<file>,
 * so a copy of the prefix made with any S3 client is a project folder and
 * the reverse. A checkpoint exists for a reader when, and only when, its
 * manifest object (checkpoint.json) exists: data objects go first, the
 * manifest last with If-None-Match: *, and a removal deletes the manifest
 * first. Objects under a checkpoint_<n>/ without a manifest are the
 * leftovers of a save that did not finish: listed (ckpt ls), removed by the
 * next save or prune under the project's lock.
 *
 * The project's lock is an object, <prefix>/checkpoints/.lock, created with
 * If-None-Match: * and holding "<host> <pid> <nonce>"; it is a lease: the
 * holder renews it (If-Match its ETag) at every save, and a lock whose
 * Last-Modified is older than the lease by the server's own clock (its Date
 * header; no client clock is trusted), or whose holder is a process of this
 * host that no longer runs, is taken over (If-Match the stale ETag, so of
 * two processes taking it over one wins). docs/OBJECT_STORAGE.md says what
 * it protects and what it does not. */
#ifndef CKPT_REMOTE_H
#define CKPT_REMOTE_H

#include <stdbool.h>
#include <stdint.h>

#include "base/error.h"
#include "format/manifest.h"
#include "store/s3/s3.h"

typedef struct ckpt_remote {
    ckpt_s3 *c;
    char *bucket;
    char *prefix; /* "" or "a/b" (no slash at either end) */
    char *url;    /* "s3://bucket[/prefix]" */
} ckpt_remote;

/* For a project URL (s3://bucket[/prefix]). */
int ckpt__remote_open(ckpt_remote *r, const char *url);
void ckpt__remote_close(ckpt_remote *r);
/* "<prefix>/<rel>" (or rel alone at the bucket's root), ckpt__malloc'd. */
char *ckpt__remote_key(const ckpt_remote *r, const char *rel);

/* What is under <prefix>/checkpoints/: one entry per checkpoint_<n>/ with
 * any object under it, ascending. */
typedef struct ckpt_remote_entry {
    int64_t number;
    bool committed;   /* its manifest exists */
    int64_t nobjects; /* objects under it, the manifest included */
    uint64_t bytes;   /* their sizes */
} ckpt_remote_entry;
int ckpt__remote_scan(ckpt_remote *r, ckpt_remote_entry **out, int64_t *count);

/* The manifest of the checkpoint folder at key dir (no trailing slash),
 * parsed as hostile input; CKPT_ENOENT if it has none. */
int ckpt__remote_manifest(ckpt_remote *r, const char *dir, ckpt_manifest *m);
/* Checks the checkpoint at key dir as ckpt__checkpoint_open does a folder:
 * every listed file exists with its size (one listing), no .safetensors
 * object the manifest does not list; deep: each is read (ranged GETs in
 * parallel, a window at a time) and its XXH3-64 compared. m gets the
 * manifest when it parsed (*have_manifest). */
int ckpt__remote_check(ckpt_remote *r, const char *dir, bool deep, ckpt_manifest *m,
                       bool *have_manifest);
/* Copies the checkpoint at key dir into the local folder local_dir (which
 * must not exist), every file verified against the manifest as it arrives
 * (sizes by HEAD before reading, XXH3-64 of the bytes written), the folder
 * appearing whole or not at all (the folder transaction). */
int ckpt__remote_fetch(ckpt_remote *r, const char *dir, const char *local_dir,
                       const ckpt_logger *lg);
/* Uploads the local checkpoint folder local_dir (its manifest's files, each
 * read once and checked against the manifest while it is sent) to
 * <prefix>/checkpoints/checkpoint_<number>: data objects first (large ones
 * by parallel multipart, small ones by parallel PUTs), the manifest last
 * with If-None-Match: *. A number that holds any object already, or whose
 * manifest PUT gets 412, is stepped over (with a warning) to the next
 * free one; *committed (may be NULL) gets the number used. */
int ckpt__remote_publish(ckpt_remote *r, const char *local_dir, int64_t number, int64_t *committed,
                         const ckpt_logger *lg);
/* Removes checkpoint_<number>: its manifest first (it is gone for every
 * reader from then on), then its other objects. */
int ckpt__remote_remove(ckpt_remote *r, int64_t number);
/* Removes every uncommitted checkpoint_<n>/ (the leftovers of killed
 * saves), warning about each; only under the lock. *removed may be NULL. */
int ckpt__remote_remove_leftovers(ckpt_remote *r, const ckpt_logger *lg, int64_t *removed);

/* The lock object. */
typedef struct ckpt_remote_lock {
    bool held;
    char etag[128];
    char owner[320];
} ckpt_remote_lock;
/* Lease seconds (CKPT_S3_LOCK_LEASE, default 900). */
int64_t ckpt__remote_lease(void);
/* CKPT_EBUSY naming the holder when another live holder has it. */
int ckpt__remote_lock(ckpt_remote *r, ckpt_remote_lock *lk, const ckpt_logger *lg);
/* Renews a held lease; CKPT_EBUSY if it was taken over meanwhile. */
int ckpt__remote_lock_renew(ckpt_remote *r, ckpt_remote_lock *lk);
/* Deletes the lock object if it is still ours. */
void ckpt__remote_unlock(ckpt_remote *r, ckpt_remote_lock *lk);

#endif
