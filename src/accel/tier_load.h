/* tier_load.h — a load's use of the node-local tiers (tier_load.c): the
 * choice among them and the project folder, then the parts moved to the
 * ranks that need them. Driven by the load (load.c). */
#ifndef CKPT_TIER_LOAD_H
#define CKPT_TIER_LOAD_H

#include <stdbool.h>
#include <stdint.h>

#include "accel/accel.h"
#include "format/manifest.h"

/* What the ranks chose, the same on every rank. */
typedef struct ckpt_tier_pick {
    bool use; /* load (number, digest) from the tiers */
    int64_t number;
    uint64_t digest;        /* XXH3-64 of its manifest's bytes */
    int *source;            /* per rank q: the rank that holds q's part for it (q itself: its
                               own folder) */
    int mroot;              /* -1: every rank holds the manifest; else the rank that sends it */
    bool have_m;            /* this rank holds the manifest */
    int64_t project_newest; /* the project folder's newest checkpoint number, -1: none */
    char *mtext;            /* after fetch: the manifest's text */
    size_t mlen;
    bool adopted; /* after fetch: this rank's part came from another rank */
    /* The choice read this rank's part of its newest local save (number,
     * digest) into acc's buffer area already, verified: fetch uses it. */
    bool preloaded;
    int64_t pre_number;
    uint64_t pre_digest;
} ckpt_tier_pick;

/* Collective: every rank's newest local checkpoints, verified, in one
 * allgather of a fixed-size record; the pick. Not use: load the project
 * folder (rank 0 logged why when a tier was passed over). CKPT_ECORRUPT
 * when the tiers hold parts of a run and neither they nor the project
 * folder a whole checkpoint. Every rank returns the same status. */
int ckpt__tier_choose(ckpt_accelerator *acc, ckpt_tier_pick *pick);
/* Collective: the pick's manifest into c->m on every rank, and this rank's
 * files (its part) verified into acc's buffer area, c->maps[j] for each
 * (the other maps zeroed): from its own folder or received from a rank that
 * holds them. *dir gets this rank's local folder of the save (malloc'd).
 * Every rank returns the same status; on failure the caller falls back to
 * the project folder. */
int ckpt__tier_fetch(ckpt_accelerator *acc, ckpt_tier_pick *pick, ckpt_checkpoint_open *c,
                     char **dir, uint64_t *held);
/* After a fetch that received this rank's part: commits it, with the
 * manifest, to this rank's own local folder (nothing if that folder has
 * the save already); a failure is only logged. */
void ckpt__tier_adopt(ckpt_accelerator *acc, const ckpt_tier_pick *pick,
                      const ckpt_checkpoint_open *c);
void ckpt__tier_pick_free(ckpt_tier_pick *pick);

#endif
