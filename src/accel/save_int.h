/* save_int.h — what the save's files share: the op itself (save.c: the
 * phases; save_spread.c: the save plan; save_link.c: incremental saves;
 * save_extras.c: the files pre-hooks add). Drivers see save_op.h only. */
#ifndef CKPT_SAVE_INT_H
#define CKPT_SAVE_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/save_op.h"
#include "format/hfindex.h"
#include "format/manifest.h"
#include "format/statedict.h"
#include "store/s3/remote.h"
#include "store/store.h"

/* One file a rank wrote, kept in its object's slot so the manifest lists
 * the files in object order whichever thread wrote them and when. */
typedef struct save_slot {
    bool has;
    char name[160];
    const char *kind;
    ckpt_file_digest d;
    char etag[128]; /* object storage: the object's ETag ("" if unknown) */
} save_slot;

/* The phases in the order they run (save_op.h). */
enum save_phase { PH_NEW, PH_PLAN, PH_SNAPSHOT, PH_WRITE, PH_COMMIT, PH_APPLY };

struct ckpt_save_op {
    ckpt_accelerator *acc;
    int phase;        /* the last phase entered (enum save_phase) */
    char *output_dir; /* the caller's folder; NULL: automatic */
    const ckpt_comm *comm;
    ckpt_logger log; /* the accelerator's, as at the call */
    int64_t step;    /* the accelerator's step and numbering at the call */
    int64_t iteration;
    bool automatic;
    bool committer; /* rank 0: plans, commits, rotates */
    int rc;         /* this rank's status so far (0, or the first failure) */
    bool ended;     /* the plan failed on rank 0 and every rank knows: no agreement */
    /* plan: made by rank 0, known to every rank */
    char *parent, *base, *target, *tmp, *tname, *lockp;
    int64_t number;
    ckpt_lock lk;
    bool tmp_made;
    /* snapshot */
    ckpt_acc_obj *objs;
    int nobjs;
    ckpt_writer **writers;
    bool *hf_model;      /* per object: a model saved as Hugging Face shards */
    ckpt_hf_layout *hfl; /* per object: its shards, if hf_model (made by the plan) */
    int **hf_owner;      /* per object: the rank that writes each of its shards */
    /* write: two slots per object (its file, its shard file), and the
     * files of a model saved as Hugging Face shards (hf[i], nhf[i]) */
    save_slot *slots;
    save_slot **hf;
    int *nhf;
    bool *written;
    /* agree + commit: this rank's files, then every rank's (rank 0) */
    ckpt_manifest mine;
    ckpt_manifest all;
    int nmetrics; /* ckpt_set_metric's, taken at the call */
    ckpt_metric metrics[CKPT_MAX_METRICS];
    char *post_dir; /* the final folder for the post-hooks (a copy: they may save) */
    /* incremental saves: the checkpoint whose unchanged files are linked */
    bool link;      /* linking is on (the project option) */
    bool link_off;  /* a link failed for a reason that will not go away: write */
    char *prev_dir; /* rank 0 picks it, every rank reads its manifest */
    ckpt_manifest prev;
    bool have_prev;
    /* link_copies > 1: the other checkpoints retained after this save
     * (rank 0 lists them, every rank gets the list), and their manifests,
     * read when a copy of theirs has to be compared */
    int link_copies;
    char **kept;
    int nkept;
    ckpt_manifest *kept_m;
    signed char *kept_read; /* 0: not yet, 1: kept_m[i] read, -1: unreadable */
    bool split;             /* a model's frozen tensors went to a file of their own */
    bool *frozen_apart;     /* per object: its frozen tensors went there (one process) */
    uint64_t linked_bytes;  /* this rank's files linked, not written */
    uint64_t written_bytes; /* this rank's files written */
    /* The objects and replicated tensors the spread plan depends on, one
     * line per object: "<file> <hash> <count>\n" (order_digest). Every
     * rank must have the same: rank 0 compares at the commit. */
    char *order;
    /* Object storage (save_remote.c): target and prev_dir are s3:// URLs,
     * each file streams into its object, tmp is a local folder for what
     * pre-hooks leave. */
    bool remote;
    ckpt_remote *rem; /* the bucket's client: the accelerator's, or rem_own */
    ckpt_remote rem_own;
    char *rdir;        /* the target's key */
    char *rprev;       /* prev_dir's key, when it is in the same bucket */
    char **etags_mine; /* the ETag of each file of mine ("" unknown) */
    int64_t netags_mine;
    char **etags; /* rank 0, after the agreement: of each file of all */
    int64_t netags;
    /* The rotation's removed folders, renamed away and left for the driver
     * to delete (ckpt__save_op_defer_removal): their hidden paths. */
    bool defer_removal;
    char **trash;
    int ntrash, trash_cap;
    /* Where this rank writes its files: tmp, or with a node-local tier its
     * own temporary folder there (ltmp). Borrowed. */
    const char *wdir;
    /* A save to the node-local tier (tier_save.c): an automatic save of an
     * accelerator with a local_dir. persist: it also goes to the project
     * folder (target, tmp; else target is this rank's local folder and tmp
     * NULL), as rank 0 decided at the plan. */
    bool tier, persist;
    bool persist_next;    /* ckpt_accelerator_persist_next_save, taken at new (back if it fails) */
    int64_t tier_highest; /* the newest local checkpoint of any rank, -1: none */
    char *ltarget, *ltmp; /* this rank's local folder of the save, and its temporary one */
    bool ltmp_made;
    char *pprev_dir; /* persist: the project checkpoint its unchanged files link from */
    ckpt_manifest pprev;
    bool have_pprev;
    char *mtext; /* the manifest's text, the same in every folder */
    size_t mlen;
    ckpt_manifest tm; /* that manifest, parsed (every rank) */
    bool have_tm;
    /* An asynchronous save whose communicator has exchange_background: the
     * background thread replicates after the write (before the commit),
     * recording in rx[k-1] the files of replica k it received, each with the
     * XXH3-64 of the bytes that arrived; the commit compares them with the
     * manifest. bg_rc, bg_msg: that replication's own failure. */
    bool tier_bg;
    ckpt_manifest *rx;
    int nrx;
    int bg_rc;
    char *bg_msg;
};
typedef struct ckpt_save_op save_op;

/* ---- the save plan (save_spread.c) ----------------------------------------- */

/* After the snapshot, on every rank alike, from the state dicts alone: which
 * models are saved as Hugging Face shards and which rank writes each shard,
 * and each rank's share of the replicated tensors (marked in the writers). */
int ckpt__save_plan_spread(save_op *op);
/* Whether entry j of object i is a replicated tensor the plan places (its
 * rows and bytes); the same before and after the plan marks it. */
bool ckpt__save_plan_entry(const save_op *op, int i, int64_t j, int64_t *rows, uint64_t *nbytes);
/* The name of this rank's shard file of object i, whose own file is own:
 * "<stem>-<rank+1>-of-<P>.safetensors", or "<stem>.frozen.safetensors" for
 * the frozen tensors a one-process model keeps apart. */
int ckpt__save_shard_name(const save_op *op, int i, const char *own, char *buf, size_t cap);
/* Whether object i is saved as Hugging Face shards, as the plan decided. */
bool ckpt__save_hf_sharded(const save_op *op, int i);
/* Whether this rank writes a shard of object i (saved as such shards). */
bool ckpt__save_hf_writes(const save_op *op, int i);

/* ---- incremental saves (save_link.c) --------------------------------------- */

/* Every rank, after the plan: the manifest of the checkpoint to link from. */
void ckpt__save_read_prev(save_op *op);
/* Rank 0, planning an automatic save with links (nums: the project's
 * checkpoint numbers, ascending) or an explicit one: which other
 * checkpoints the save retains (op->kept), for link_copies. */
int ckpt__save_plan_kept(save_op *op, const int64_t *nums, int64_t count);
/* The kept list on the wire (rank 0) and back (the others): "<n>\0" then n
 * NUL-terminated paths. */
int ckpt__save_kept_encode(const save_op *op, char **out, size_t *len);
int ckpt__save_kept_decode(save_op *op, const char *p, size_t len);
void ckpt__save_kept_free(save_op *op);
/* 1: the file this rank would write at where as name has the previous
 * checkpoint's size and XXH3-128 for it (*fp: that record); 0: write it;
 * < 0: a failure (save_link.c). */
int ckpt__save_unchanged(save_op *op, ckpt_writer *w, const char *name, bool shards,
                         const char *where, ckpt_file_digest *d, const ckpt_manifest_file **fp);
/* 1: the file this rank would write at path as name is the previous
 * checkpoint's, linked there (d from its record); 0: write it (d->xxh128
 * may already hold its hash); < 0: a failure. */
int ckpt__save_try_link(save_op *op, ckpt_writer *w, const char *name, bool shards,
                        const char *path, ckpt_file_digest *d);
/* The same for a file whose size and XXH3-128 are known, against any
 * checkpoint's manifest prev and folder prev_dir. */
int ckpt__save_link_same(save_op *op, const ckpt_manifest *prev, const char *prev_dir,
                         const char *name, uint64_t size, ckpt_h128 h, const char *path,
                         ckpt_file_digest *d);

/* ---- node-local tiers (tier_save.c) ---------------------------------------- */

/* In the plan, before rank 0 picks the number, on every rank (collective):
 * the tier set up, this rank's local checkpoints listed, and the newest of
 * any rank into op->tier_highest. rc: this rank's status so far; returns
 * the agreed one. */
int ckpt__tier_plan(save_op *op, int rc);
/* After the plan reached every rank: this rank's local folder, temporary
 * folder (created) and the checkpoint its unchanged files link from. */
int ckpt__tier_open(save_op *op);
/* After this rank's files are written, if the save is persisted: each of
 * them copied (or linked from the project's previous checkpoint) into the
 * project's temporary folder. */
int ckpt__tier_persist(save_op *op);
/* Rank 0 at the commit, with the manifest's text in op->mtext: the
 * pre-hooks' files of its local folder copied to the project's. */
int ckpt__tier_persist_extras(save_op *op);
/* After the project commit (or none) and its agreed outcome rc: the
 * manifest reaches every rank, each part goes to its replicas, every rank
 * commits its local folder, and all agree (collective). Returns the save's
 * status; a persisted save succeeds even if its node-local copy failed
 * (logged). */
int ckpt__tier_finish(save_op *op, int rc);
/* Removes the local temporary folder if the save did not commit it. */
void ckpt__tier_release(save_op *op);
/* The background thread of an asynchronous save with op->tier_bg, after
 * the write: this rank's part to its replica nodes, and theirs received,
 * over comm->exchange_background (every rank's thread takes part, a
 * failed op's too, sending nothing). Its failure is kept in op->bg_rc. */
void ckpt__tier_replicate_background(save_op *op);

/* The digest of a file the previous checkpoint has with the same bytes,
 * from its manifest's record. */
int ckpt__save_digest_from_record(const ckpt_manifest_file *f, ckpt_file_digest *d);

/* ---- object storage (save_remote.c) ----------------------------------------- */

/* Rank 0's plan of a save into object storage, after the project lock: the
 * lock object taken or renewed, one listing (leftovers removed, the number
 * above every stored one, the checkpoint to copy from); an explicit URL
 * checked (never a checkpoint already there); the local temporary folder. */
int ckpt__save_remote_plan(save_op *op);
/* Every rank, once the plan is known: the client of the target's bucket. */
int ckpt__save_remote_open(save_op *op);
/* Every rank, after the plan: prev_dir's manifest from the bucket. */
void ckpt__save_remote_read_prev(save_op *op);
/* One file of this rank: a server-side copy of the previous checkpoint's
 * object when the bytes are the same (XXH3-128 from memory), else the bytes
 * streamed into its object as they are produced (a multipart upload of
 * parallel parts, or one PUT for less than a part), hashed on the way. */
int ckpt__save_remote_file(save_op *op, ckpt_writer *w, const char *name, bool shards,
                           save_slot *slot);
/* A small text file (a shard index) into its object. */
int ckpt__save_remote_text(save_op *op, const char *name, const char *text, save_slot *slot);
/* Rank 0's commit: the pre-hooks' files uploaded, the lease renewed, the
 * manifest PUT last with If-None-Match: * (automatic names: a lost number
 * moves on, op->number and target follow), then the rotation. */
int ckpt__save_remote_commit(save_op *op);
/* After the commit's outcome is shared: every rank learns the number the
 * commit used (collective; several processes only). */
int ckpt__save_remote_share_number(save_op *op);
void ckpt__save_remote_free(save_op *op);

/* ---- files a save pre-hook adds (save_extras.c) ---------------------------- */

/* After this rank's pre-hooks: none took a name this rank writes. */
int ckpt__save_check_hook_names(save_op *op);
/* Rank 0, at the commit: the pre-hooks' files, made durable and listed in
 * op->all as kind "extra"; anything else in the folder fails the save. */
int ckpt__save_add_extras(save_op *op);

#endif
