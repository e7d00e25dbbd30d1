/* crashsim.h — a power-loss simulator for the tests.
 *
 * cs_start() snapshots a folder and records, through the I/O layer's
 * recorder (src/testing/testing.h), every mutating call the library makes
 * under it. cs_explore() then takes every prefix of that record (a power cut
 * after the k-th call) and builds the states a file system may legally be
 * in after the cut, materialises each one into a scratch folder and hands it
 * to a check function. The model of the file system is in
 * docs/CRASHSAFETY.md; in short (ext4 data=ordered, taken conservatively):
 *
 *   - a file's writes and truncations since its last fsync are each dropped,
 *     kept, or torn (an arbitrary subset of its 512-byte sectors reached the
 *     disk, the rest reads as before or as zeros);
 *   - a folder's entry operations (create, mkdir, rename, exchange, link,
 *     unlink, rmdir) since its last fsync persisted as a prefix, in their
 *     order, of that folder's operations; folders are independent;
 *   - fsync of a file makes its data durable, not its name; fsync of a
 *     folder makes its entries durable, not its own name in its parent.
 *
 * Every prefix is enumerated exhaustively when it has few states, else
 * sampled at random (the seed is printed; CKPT_CRASHSIM_SEED overrides it,
 * CKPT_CRASHSIM_SAMPLES the number of samples per crash point). States equal
 * to one already checked are counted but not checked again. */
#ifndef CKPT_CRASHSIM_H
#define CKPT_CRASHSIM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

typedef struct cs_sim cs_sim;

/* Snapshots root (an existing folder; its content is the durable state
 * before the operation) and starts recording. 0, or -1 with a message on
 * stderr. Only one simulation records at a time. */
int cs_start(cs_sim **out, const char *root);
/* Stops recording, then checks that the record explains root's real content
 * exactly (same names, types and bytes): a mutating call that bypassed the
 * I/O layer shows up here. 0, or -1 with what differs on stderr. */
int cs_stop(cs_sim *s);
void cs_free(cs_sim *s);
/* Calls that change the durable state (crash points are 0..this). */
size_t cs_event_count(const cs_sim *s);
/* Prints the record, one call a line, paths relative to root. */
void cs_print_record(const cs_sim *s, FILE *fp);

typedef struct cs_crash {
    size_t prefix;  /* calls that had been made when the power went out */
    size_t events;  /* calls in the whole record */
    bool complete;  /* prefix == events: the operation had returned */
} cs_crash;

/* Checks the state materialised at root (laid out like the recorded root).
 * 0 if it holds; else writes why into why (cap bytes) and returns nonzero. */
typedef int (*cs_check_fn)(void *user, const char *root, const cs_crash *c, char *why,
                           size_t cap);

typedef struct cs_options {
    uint64_t seed;      /* 0: CKPT_CRASHSIM_SEED if set, else from the clock */
    int exhaustive_max; /* a crash point with at most this many states is enumerated (0: 64) */
    int samples;        /* else this many random states (0: CKPT_CRASHSIM_SAMPLES or 32) */
    int max_violations; /* stop after this many (0: 3) */
    bool verbose;       /* print each violation and the record up to it */
} cs_options;

typedef struct cs_result {
    uint64_t seed;
    size_t crash_points;     /* prefixes examined (events + 1) */
    size_t generated;        /* states built */
    size_t checked;          /* distinct states checked */
    size_t sampled_points;   /* crash points with too many states to enumerate */
    size_t violations;
    char first_violation[2048];
} cs_result;

/* Explores every crash point of the record; scratch is a folder path the
 * simulator may delete and recreate. 0 when the exploration ran (violations
 * are in *r), -1 on a setup failure (stderr says why). */
int cs_explore(cs_sim *s, const char *scratch, const cs_options *o, cs_check_fn check,
               void *user, cs_result *r);

#endif
