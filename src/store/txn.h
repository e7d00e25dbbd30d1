/* txn.h — the folder transaction: every checkpoint-shaped folder ckpt
 * creates (a save, an export, an import) is built in a temporary folder
 * beside its final name and appears there whole, or not at all.
 *
 *   ckpt_txn t;
 *   rc = ckpt__txn_begin(&t, "out/checkpoint_3", "save_state");   // t.tmp exists, empty
 *   ... write files into t.tmp (each fsynced by the write stream) ...
 *   if (rc == 0) rc = ckpt__txn_commit(&t, false, &log);          // fsync, rename, fsync parent
 *   ckpt__txn_end(&t, &log);                                        // aborts if not committed
 *
 * A save, whose names every rank shares and which owns them itself, fills
 * target, tmp, what and made and calls only check_replaceable and commit,
 * which read nothing else (it never calls begin or end).
 *
 * The power-loss simulator runs every user of it through the same commit
 * (tests/unit/test_powerloss.c: saves; test_powerloss_interop.c: export and
 * import). */
#ifndef CKPT_TXN_H
#define CKPT_TXN_H

#include <stdbool.h>

#include "store/store.h"

typedef struct ckpt_txn {
    char *target; /* the final folder, as given less trailing slashes */
    char *parent; /* its parent folder ("." for a bare name) */
    char *base;   /* its last component */
    char *tmp;    /* "<parent>/.<base>.tmp.<pid>" */
    const char *what; /* the operation, for messages ("export", ...) */
    bool made;        /* tmp exists and is ours to remove */
    bool locked;      /* lock_fd holds an flock on tmp while the transaction lives */
    int lock_fd;
} ckpt_txn;

/* Splits target into parent and base, refusing a name that is empty, "." or
 * ".." (CKPT_EINVAL naming target). With create, makes the parent folders and
 * the empty temporary folder, and holds an flock on it until the end, so
 * that another process can tell a live transaction from the leftover of a
 * dead one. Leftovers of this target (".<base>.tmp.<pid>" folders nobody
 * holds, left by a process that was killed or lost power, whose pid may
 * even be this process's own after a reboot) are removed first, with a
 * warning through lg; a temporary folder another live process holds is
 * left alone (CKPT_EEXIST if it has this process's name). Without create
 * only the names are set (a process that writes into a folder another one
 * made). On failure every field is freed. */
int ckpt__txn_begin(ckpt_txn *t, const char *target, const char *what, bool create,
                    const ckpt_logger *lg);

/* Whether an existing target may be replaced: a checkpoint folder (it has a
 * manifest) or an empty folder; a missing target is fine. CKPT_EEXIST naming
 * it otherwise: a user's unrelated files are never deleted. */
int ckpt__txn_check_replaceable(const ckpt_txn *t);

/* Publishes tmp as target: fsync tmp, rename (with replace: exchange
 * atomically with an existing checkpoint folder, checked as above, and
 * remove the old one), fsync the parent. Without replace an existing target
 * is CKPT_EEXIST. If the rename happened but the parent fsync failed, the new
 * folder is taken back out (or the old one put back), so a commit that
 * returns an error never leaves its folder visible. */
int ckpt__txn_commit(ckpt_txn *t, bool replace, const ckpt_logger *lg);

/* Removes the temporary folder if it is still ours (an uncommitted
 * transaction: the abort), warning through lg if it cannot, and frees the
 * names. Safe on a zeroed or ended ckpt_txn. */
void ckpt__txn_end(ckpt_txn *t, const ckpt_logger *lg);

#endif
