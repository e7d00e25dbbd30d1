/* tier.h — storage tiers: which save goes where, over the folder logic of
 * src/store (docs/DISTRIBUTED.md "Storage tiers").
 *
 * With ckpt_project_config.local_dir every automatic save goes first to a
 * node-local folder. Each rank r keeps its own folder there,
 * <local_dir>/rank_<r>, holding checkpoint_<n> folders committed like the
 * project's (a temporary folder, fsyncs, one rename): the save's manifest,
 * byte for byte the one the project folder gets when the save is persisted,
 * and the files of the parts rank r holds, a part being every file the
 * manifest lists with "rank": q. Rank r holds its own part and, with R
 * replicas and J ranks per node, the parts of ranks r - J, ..., r - R*J
 * (mod P): rank q's part is copied to ranks q + J, ..., q + R*J, each on
 * another node. Every persist_every-th save also goes to the project folder.
 *
 *   tier.c       the configuration, the placement, this rank's folder and
 *                its lock, moving bytes between ranks (ckpt_comm.exchange)
 *   tier_save.c  a save's part of it: numbering, the folders, the copy of a
 *                part to the project folder, replication, the local commit
 *   tier_load.c  choosing the newest save whose every part is verified
 *                somewhere, and moving the parts to the ranks that lack them
 */
#ifndef CKPT_TIER_H
#define CKPT_TIER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"
#include "format/manifest.h"
#include "store/store.h"

typedef struct ckpt_tier {
    char *pattern;     /* local_dir as configured; NULL: no tier */
    int replicas_cfg;  /* local_replicas as configured (0: 1; < 0: none) */
    int persist_every; /* >= 1 */
    int per_node_cfg;  /* ranks_per_node as configured (0: the comm's) */
    int keep;          /* local_total_limit, >= 1 */
    bool persist_next; /* ckpt_accelerator_persist_next_save */
    /* Known after ckpt__tier_setup (the first save or load of the run). */
    bool ready;
    int per_node, nodes, node, replicas; /* J, P / J, this rank's node, R */
    char *root;                          /* pattern expanded for this rank */
    char *dir;                           /* <root>/rank_<rank>: this rank's folder */
    ckpt_lock lock;                      /* held on <dir>/.lock until the accelerator is freed */
    bool ram;                            /* dir is on a file system in memory (tmpfs) */
    int64_t highest; /* this rank's newest committed local checkpoint; -1: none */
} ckpt_tier;

/* ---- tier.c ---------------------------------------------------------------- */

/* From the config, at ckpt_accelerator_new (nprocs: the process count):
 * CKPT_EINVAL naming the field for a bad value. No tier: t->pattern NULL. */
int ckpt__tier_configure(ckpt_tier *t, const ckpt_project_config *cfg, int nprocs);
void ckpt__tier_free(ckpt_tier *t);
static inline bool ckpt__tier_on(const ckpt_tier *t) { return t->pattern != NULL; }
/* The pattern with %n, %r and %% expanded (malloc'd; NULL if out of memory). */
char *ckpt__tier_expand(const char *pattern, int node, int rank);
/* Collective, at the first save or load (again after a failure): the node
 * split, the replicas, this rank's folder made and locked. Every rank
 * returns the same status. */
int ckpt__tier_setup(ckpt_accelerator *acc);
/* The rank that keeps replica k (1..R) of rank q's part, and the rank whose
 * part this rank keeps as its replica k. */
int ckpt__tier_replica_holder(const ckpt_tier *t, int nprocs, int q, int k);
int ckpt__tier_replica_source(const ckpt_tier *t, int nprocs, int holder, int k);
/* This rank's committed local checkpoints, ascending (ckpt__list_numbers of
 * its folder), after removing the leftovers of interrupted saves there. */
int ckpt__tier_list(ckpt_accelerator *acc, int64_t **nums, int64_t *count);
/* "<dir>/checkpoint_<n>" (malloc'd). */
char *ckpt__tier_folder(const ckpt_tier *t, int64_t n);
/* Collective: every rank sends sn bytes to dest and receives rn from src
 * (ckpt_comm.exchange, or gathers where the comm has none). */
int ckpt__tier_exchange(const ckpt_comm *c, const void *sbuf, size_t sn, int dest, void *rbuf,
                        size_t rn, int src);
/* Bytes moved per exchange. */
#define CKPT_TIER_PIECE ((size_t)16 << 20)

/* The files of one rank's part (the manifest's files with that "rank", in
 * manifest order), read from a folder as one stream of bytes. Zeroed but
 * for m, dir, rank and fd = -1. */
typedef struct ckpt_part_reader {
    const ckpt_manifest *m;
    const char *dir;
    int rank;
    int64_t j; /* the file being read */
    int fd;
    uint64_t off;
} ckpt_part_reader;
/* The next n bytes into buf. After a failure (rc, or one here) the bytes
 * are zeros, so that the exchanges they go into stay paired (the
 * receiver's checksum refuses them); returns the first failure. */
int ckpt__part_read(ckpt_part_reader *pr, uint8_t *buf, size_t n, int rc);
void ckpt__part_reader_end(ckpt_part_reader *pr);

/* What one local checkpoint folder holds (ckpt__tier_scan). */
#define CKPT_TIER_MAX_PARTS 16
typedef struct ckpt_tier_scan {
    int64_t number;
    uint64_t digest;   /* XXH3-64 of its manifest's bytes: the save's identity */
    int num_processes; /* the manifest's */
    int64_t step, created_unix;
    uint64_t bytes; /* of the files held */
    int nparts;     /* parts held whole (every file there, of the listed size, and with
                          deep, of the listed checksum), ascending ranks (at most
                          CKPT_TIER_MAX_PARTS) */
    int parts[CKPT_TIER_MAX_PARTS];
    bool bad; /* the manifest, or a file of a part, fails (why says how) */
} ckpt_tier_scan;

/* Looks at the local checkpoint folder dir: its manifest (read, checked,
 * digested; kept in *m and its text in *text, *len when those are not
 * NULL) and which parts it holds. The files of rank `own` (-1: none) are
 * only looked at (there, of their size), not read: the caller reads and
 * checks them itself. A folder whose manifest cannot be read, or with a
 * file of some part that fails, is bad (out->bad) with the first reason in
 * why; returns 0 then too. Only running out of memory is returned as a
 * failure. */
int ckpt__tier_scan(const char *dir, bool deep, int own, ckpt_tier_scan *out, ckpt_manifest *m,
                    char **text, size_t *len, char *why, size_t cap);

#endif
