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
#include "store/store.h"

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
/* The key of checkpoint_<number> ("<prefix>/checkpoints/checkpoint_<n>"). */
char *ckpt__remote_number_key(const ckpt_remote *r, int64_t number);

/* What is under <prefix>/checkpoints/ (one listing): one entry per
 * checkpoint_<n>/ with any object under it, ascending, with its objects. */
typedef struct ckpt_remote_entry {
    int64_t number;
    bool committed;   /* its manifest exists */
    int64_t nobjects; /* objects under it, the manifest included */
    uint64_t bytes;   /* their sizes */
    char **names;     /* each object's key below checkpoint_<n>/ */
    uint64_t *sizes;
    int64_t cap;
} ckpt_remote_entry;
int ckpt__remote_scan(ckpt_remote *r, ckpt_remote_entry **out, int64_t *count);
void ckpt__remote_scan_free(ckpt_remote_entry *v, int64_t count);
/* The entry of number in v (NULL if none). */
const ckpt_remote_entry *ckpt__remote_find(const ckpt_remote_entry *v, int64_t n, int64_t number);

/* The manifest of the checkpoint folder at key dir (no trailing slash),
 * parsed as hostile input; CKPT_ENOENT if it has none. */
int ckpt__remote_manifest(ckpt_remote *r, const char *dir, ckpt_manifest *m);
/* Checks the checkpoint at key dir as ckpt__checkpoint_open does a folder:
 * every listed file exists with its size (one listing, or the scan's entry
 * e when not NULL), no .safetensors object the manifest does not list;
 * deep: each is read (ranged GETs in parallel, a window at a time) and its
 * XXH3-64 compared. m gets the manifest when it parsed (*have_manifest). */
int ckpt__remote_check(ckpt_remote *r, const char *dir, const ckpt_remote_entry *e, bool deep,
                       ckpt_manifest *m, bool *have_manifest);
/* Copies the checkpoint at key dir into the local folder local_dir (which
 * must not exist), every file verified against the manifest as it arrives
 * (sizes by HEAD before reading, XXH3-64 of the bytes written), the folder
 * appearing whole or not at all (the folder transaction). */
int ckpt__remote_fetch(ckpt_remote *r, const char *dir, const char *local_dir,
                       const ckpt_logger *lg);

/* ---- a load's read phase (accel/load.c) ------------------------------------ */

/* The checkpoint at key dir as ckpt__checkpoint_open_manifest opens a
 * folder: c zeroed, its manifest fetched and parsed (c->no_manifest: the
 * prefix holds objects but no manifest); url names it in messages. */
int ckpt__remote_open_manifest(ckpt_remote *r, const char *dir, const char *url,
                               ckpt_checkpoint_open *c);
/* ckpt__checkpoint_read_files for the checkpoint at key dir: one listing
 * checks every listed object's size (and that no .safetensors object is
 * unlisted) before anything is reserved or read; the files not shallow are
 * then read by parallel ranged GETs straight into arena (the load's
 * buffers), each response checked against the object's size, each file
 * hashed in order as its ranges arrive and compared with the manifest. */
int ckpt__remote_read_files(ckpt_remote *r, const char *dir, const char *url, const bool *shallow,
                            ckpt_arena *arena, ckpt_checkpoint_open *c);

/* ---- a save's objects ---------------------------------------------------------- */

/* Uploads the local file path to key, reading it once: the bytes sent are
 * hashed and compared with f (a file changed since it was listed is not
 * uploaded; the upload is aborted). etag_out (may be NULL, 128 bytes). */
int ckpt__remote_upload_file(ckpt_remote *r, const char *path, const char *key,
                             const ckpt_manifest_file *f, char *etag_out);
/* Before an explicit save to key dir: CKPT_EEXIST if a checkpoint (its
 * manifest) is there (a checkpoint is never replaced in object storage:
 * there is no atomic rename); objects without a manifest (a failed save's)
 * are removed with a warning each. */
int ckpt__remote_prepare_dir(ckpt_remote *r, const char *dir, const ckpt_logger *lg);
/* The commit of the checkpoint whose data objects are under checkpoint_
 * <number> (or, explicit, under key dir): m's text PUT as its manifest with
 * If-None-Match: *. With renumber (automatic names) a 412 (another writer
 * committed that number meanwhile) moves the checkpoint to the next number
 * under which nothing is stored: its data objects copied there server-side
 * (each only if its ETag is still etags[i] when known: nobody overwrote it),
 * m->iteration set to the number + 1, the manifest PUT there, and the old
 * number's copies left to the rotation of leftovers; *committed gets the
 * number used. Without renumber a 412 is CKPT_EEXIST. */
int ckpt__remote_commit(ckpt_remote *r, const char *dir, int64_t number, bool renumber,
                        ckpt_manifest *m, const char *const *etags, int64_t *committed,
                        const ckpt_logger *lg);

/* ---- removal, rotation ------------------------------------------------------------ */

/* Removes checkpoint_<number>: its manifest first (it is gone for every
 * reader from then on), then its other objects (those of e when not NULL,
 * else those a listing finds). */
int ckpt__remote_remove(ckpt_remote *r, int64_t number, const ckpt_remote_entry *e);
/* Removes every uncommitted checkpoint_<n>/ of the scan v (the leftovers of
 * killed saves), warning about each and dropping them from v; only under the
 * lock. *removed may be NULL. */
int ckpt__remote_remove_leftovers(ckpt_remote *r, ckpt_remote_entry *v, int64_t *n,
                                  const ckpt_logger *lg, int64_t *removed);
/* The rule of ckpt_checkpoint_prune_ex (keep, retention policy) over the
 * committed checkpoints of the scan v: checks are shallow (the manifest
 * against the listing) unless deep_kept, which reads every byte of the
 * kept ones (prune); `fresh` (-1: none), whose manifest is m, was just
 * committed and needs no check. */
int ckpt__remote_rotate(ckpt_remote *r, const ckpt_remote_entry *v, int64_t n, int64_t fresh,
                        const ckpt_manifest *m, bool deep_kept, ckpt_rotation *rot);
/* What a manifest tells a listing of checkpoints (ckpt_checkpoint_info). */
void ckpt__remote_fill_info(ckpt_checkpoint_info *info, const ckpt_manifest *m);

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
