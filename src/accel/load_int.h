/* load_int.h — the load op's state, shared by the files that make it up and
 * by nothing else: the phases (load.c), what the check and apply phases do
 * to each object (load_objects.c) and how the files' bytes reach the ranks
 * that need them, the replicated chunks streamed (load_stream.c). The
 * phases themselves are declared in load_op.h. */
#ifndef CKPT_LOAD_INT_H
#define CKPT_LOAD_INT_H

#include <stdbool.h>
#include <stdint.h>

#include "accel/accel.h"
#include "accel/load_op.h"
#include "accel/tier_load.h"
#include "format/keymap.h"
#include "format/manifest.h"
#include "format/statedict.h"
#include "train/rng.h"

struct ckpt__load_op {
    /* NULL for a load into one object that no accelerator holds
     * (ckpt__load_op_new_object): one process, no hooks, no lock. */
    ckpt_accelerator *acc;
    const ckpt_comm *comm;
    const char *what; /* "load_state" or "load_weights": the messages' prefix */
    /* the phase last run (load_op.h), and this rank's status so far:
     * agreed says every rank holds the same one */
    int phase;
    int rc;
    bool agreed;
    /* The caller's input folder (NULL: the project's newest valid
     * checkpoint) and its report (may be NULL). */
    char *input_dir;
    ckpt_load_report *report;
    /* choose: the candidates of a load of the newest checkpoint (rank 0's
     * list on every rank, ascending), the next one to try, and why each
     * newer one was skipped, for the final message */
    char *cdir;
    int64_t *nums, ncand, next;
    char why[1536];
    bool retry; /* read skipped a damaged candidate: choose takes the next */
    /* A node-local tier (tier_load.c): the choice among the tiers, whether
     * the candidate is that save (tier), and whether, after it failed, the
     * project's candidates are still to be listed (tier_fallback). */
    ckpt_tier_pick tpick;
    bool tier, tier_fallback;
    /* The candidate being tried, then the checkpoint chosen. */
    char *dir;
    ckpt_checkpoint_open c;
    ckpt_acc_obj *objs;
    int nobjs;
    ckpt_reader **readers;
    bool nothing;     /* there is no checkpoint at all: the CKPT_ENOENT of a fresh start */
    bool bad_options; /* new failed: nothing changes, not even the refusal of saves */
    bool in_op;       /* the collectives' operation (deadlines) began and has not ended */
    /* The checkpoint was saved by another number of processes: this rank's
     * generator is derived from rank 0's (docs/DISTRIBUTED.md, "Reshard"). */
    bool rng_reshard;
    ckpt_rng_reshard rr;
    /* ckpt_load_state_ex: the options (NULL: everything, exactly), which
     * objects are selected, and whether that is all of them */
    const ckpt_load_options *opt;
    bool *sel;
    bool full;
    /* an adapted object: readers[i] is the adapted reader, srcs[i] the
     * file's, extra[i] what the adapted one also borrows from */
    ckpt_reader **srcs, **extra;
    ckpt_adapt_result res;
    /* ckpt__load_op_read_from: the step of the caller's source */
    bool external;
    int64_t external_step;
    /* The read plan of the candidate being opened (several processes): per
     * manifest file, the rank that reads and verifies it (-1: none, only
     * its presence and size are checked) and whether its bytes then go to
     * every rank. */
    int *reader;
    bool *shared;
    /* After share_files: whether this rank holds file j's bytes (NULL: all
     * of them); a shard file it does not hold is attached from the
     * manifest's records alone. */
    bool *have;
    /* Bytes of the opened candidate's files this rank holds (load_held.h). */
    uint64_t held;
    /* Streamed chunks (load_stream.c): every chunk of the shard files
     * numbered in manifest order, file j's first at cbase[j] (cfile: each
     * chunk's file); streamed[c] says that every rank reads chunk c, so its
     * bytes go from its file's reader to all ranks while the objects read
     * it, through window on a receiving rank. */
    int64_t *cbase, *cfile, nchunks, nstreamed;
    bool *streamed;
    uint8_t *window;
    size_t window_size; /* SHARE_PIECE, or the largest streamed chunk if smaller */
    /* A Hugging Face part of a model (no chunk records: each tensor is a
     * chunk of its own) that this rank neither read nor was sent: its
     * header, broadcast by its reader (share_headers). */
    uint8_t **hdr;
    uint64_t *hdr_len;
    /* This rank stopped because another one did (its failure echoes). */
    bool echo;
    /* One pass, where it applies (ckpt_load_options.one_pass, or the
     * accelerator's first load unless transactional): the files are checked
     * shallowly at the choice and verified while the objects read them.
     * applied: the objects began to read (apply ran). below: a retry after
     * a one-pass load found the newest checkpoint damaged while the objects
     * read it; only candidates numbered below it are tried. */
    bool one_pass;
    bool applied;
    int64_t below;
    /* Object storage (load_remote.c): the candidates and dir are s3://
     * URLs, read from the bucket by rem (the accelerator's client, or
     * rem_own) at key rdir; hook_dir: a local folder holding the
     * checkpoint's pre-hook files for the load hooks. */
    bool remote;
    struct ckpt_remote *rem;
    struct ckpt_remote *rem_own;
    char *rdir;
    char *hook_dir;
    /* The default load of one process, where the checkpoint allows it
     * (plain files, every tensor's digest in the manifest, no adapting
     * option): read verifies every file whole without keeping its bytes,
     * then the objects read their tensors straight from the files into
     * their own memory, each piece hashed there as it lands (the readers of
     * one_pass). Transactional as the two passes: a damaged file is found
     * before anything changes; no buffer area. */
    bool stream;
};

/* ---- object storage (load_remote.c) ---------------------------------------- */

/* Whether the load reads from object storage (the input URL, or the
 * project's bucket). */
bool ckpt__load_is_remote(const ckpt_accelerator *acc, const char *input_dir);
/* Rank 0: the committed checkpoints of the project's bucket (one listing),
 * ascending; op->cdir is the bucket's checkpoints URL. */
int ckpt__load_remote_numbers(ckpt__load_op *op, int64_t **nums, int64_t *count);
/* The candidate's manifest (plan), and this rank's files read straight
 * into the load's buffers (read; shallow as ckpt__checkpoint_read_files). */
int ckpt__load_remote_manifest(ckpt__load_op *op);
int ckpt__load_remote_read(ckpt__load_op *op, const bool *shallow);
/* The folder the load hooks get: a local one holding the checkpoint's
 * pre-hook files (kind "extra"), made from the verified bytes. */
int ckpt__load_remote_hook_dir(ckpt__load_op *op);
void ckpt__load_remote_free(ckpt__load_op *op);

/* ---- the objects (load_objects.c) ------------------------------------------ */

/* The name options select an object by: its file name without
 * ".safetensors", and "random_states" for the generator. */
void ckpt__load_object_name(const ckpt__load_op *op, const ckpt_acc_obj *o, char *buf, size_t cap);
/* The file an object's state is in ("model.safetensors", ...). Without an
 * accelerator the object is a model: its name does not depend on the
 * process (only a generator's does). */
static inline void ckpt__load_file_name(const ckpt__load_op *op, const ckpt_acc_obj *o, char *buf,
                                        size_t cap) {
    ckpt__acc_file_name(op->acc, o, buf, cap);
}
/* Which objects opt selects (op->sel, op->full); CKPT_EINVAL for bad
 * options, before anything is read. */
int ckpt__load_select(ckpt__load_op *op);
/* Matches the registered objects with the checkpoint's files, checks every
 * object's schema against its file, then every value through the objects'
 * check_state_dict; changes nothing. */
int ckpt__load_check_objects(ckpt__load_op *op);
/* The same for the one object of a caller's source (ckpt__load_op_read_from). */
int ckpt__load_check_external(ckpt__load_op *op);
/* Every selected object loads; the accelerator's step, numbering and
 * folders move on (a full load). */
int ckpt__load_apply_objects(ckpt__load_op *op);

/* ---- the files' bytes between the ranks (load_stream.c) ------------------- */

/* Whether a model's file is read tensor by tensor, each a chunk (a part of
 * a model saved as Hugging Face shards, a large model file), or is a shard
 * file: its tensors are numbered as chunks. */
bool ckpt__load_has_chunks(const ckpt_manifest_file *f);
/* Whether f is a part of a model saved as Hugging Face shards. */
bool ckpt__load_is_hf_part(const ckpt_manifest_file *f);
/* Whether some tensor of file j is streamed. */
bool ckpt__load_any_streamed(const ckpt__load_op *op, int64_t j);
/* After every rank verified its files of the chosen checkpoint (and all
 * agreed): each file a rank needs reaches it, the replicated chunks every
 * rank reads are left to be streamed (collective). */
int ckpt__load_share_files(ckpt__load_op *op);
/* The reader's fetch of a streamed chunk (ckpt__reader_set_fetch; ctx is
 * the op). */
int ckpt__load_fetch(void *ctx, int64_t id, const void *local, uint64_t nbytes, size_t group,
                     ckpt__piece_fn put, void *put_ctx);
/* The end of a phase whose objects may have read streamed chunks: every
 * rank waits for the others (collective when chunks are streamed). */
int ckpt__load_stream_end(ckpt__load_op *op);
/* Makes file f (a part of a model saved as Hugging Face shards, or a large
 * model file) readable through r, each tensor a whole chunk of its own, the
 * streamed ones read through fetch. */
int ckpt__load_attach_whole(ckpt__load_op *op, ckpt_reader *r, const ckpt_manifest_file *f);
/* The streaming state and the files' bytes leave memory. */
void ckpt__load_stream_free(ckpt__load_op *op);

#endif
