/* tier_load.c — where ckpt_load_state(acc, NULL) takes its checkpoint from
 * when the accelerator has a node-local tier (tier.h):
 *
 *   choose  every rank looks at its newest local checkpoints (their
 *           manifests, and every file of the parts they hold, hashed), and
 *           all ranks learn what every rank holds in one allgather of a
 *           fixed-size record (O(P) bytes a rank: at most TIER_CANDS saves
 *           of CKPT_TIER_MAX_PARTS parts each, and from rank 0 the project's
 *           newest checkpoint number). Every rank then picks alike: the
 *           newest save (number, and the digest of its manifest, so two
 *           saves that got one number in two histories never mix) whose
 *           every rank's part is held, verified, somewhere, unless the
 *           project folder has a newer checkpoint; else the project folder,
 *           with one line saying why when a tier was passed over.
 *   fetch   the manifest reaches the ranks that hold nothing of that save
 *           (one broadcast), each rank reads its own part from its own
 *           folder or receives it from a rank that holds it (exchanges of
 *           CKPT_TIER_PIECE bytes, hashed as they arrive and compared with
 *           the manifest), into the accelerator's reusable buffer area.
 *   adopt   a rank whose part came from another rank commits it to its own
 *           local folder, so that its node holds it again.
 *
 * From there the load goes on as a load of the project folder by the same
 * number of processes does, each rank holding the files it wrote. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <xxhash.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/tier.h"
#include "accel/tier_load.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "store/store.h"
#include "store/txn.h"

/* Local checkpoints a rank reports (its newest ones). */
#define TIER_CANDS 4

/* One rank's record, as it travels. */
typedef struct tier_rec {
    int64_t project_newest; /* rank 0: the project's newest checkpoint number, -1: none */
    int32_t ncand, pad;
    struct {
        int64_t number;
        uint64_t digest;
        int32_t nparts, pad;
        int32_t parts[CKPT_TIER_MAX_PARTS];
    } cand[TIER_CANDS];
} tier_rec;

void ckpt__tier_pick_free(ckpt_tier_pick *pk) {
    free(pk->source);
    free(pk->mtext);
    memset(pk, 0, sizeof *pk);
}

/* ---- choose ------------------------------------------------------------------ */

/* This rank's own part from its own folder: read and hashed into the slots. */
static int read_own(const ckpt_manifest *m, const char *dir, int me, ckpt_mapped *maps,
                    uint8_t **dst) {
    static const uint8_t none[1];
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        if (f->rank != me) continue;
        char *path = ckpt__path_join(dir, f->name);
        if (!path) return ckpt__err_nomem("load path");
        uint64_t h = 0;
        int rc = ckpt__read_hashed(path, path, f->size, f->size ? dst[j] : NULL, &h);
        if (rc == 0 && h != f->xxh3) rc = ckpt__err(CKPT_ECORRUPT, "%s: checksum mismatch", path);
        if (rc == 0) ckpt__io_verified(path);
        free(path);
        if (rc < 0) return rc;
        maps[j].data = f->size ? dst[j] : none;
        maps[j].size = f->size;
    }
    return CKPT_OK;
}

/* Where this rank's files (its part) go in acc's buffer area: dst[j] for
 * each (a 64-byte aligned slot, in manifest order), the area reserved;
 * *total: their bytes. The same layout every time for one manifest, so a
 * part read at the choice is where the fetch expects it. */
static int own_layout(ckpt_accelerator *acc, const ckpt_manifest *m, int me, uint8_t **dst,
                      uint64_t *total) {
    uint64_t len = 0, off = 0;
    *total = 0;
    for (int64_t j = 0; j < m->nfiles; j++)
        if (m->files[j].rank == me) len += (m->files[j].size + 63) & ~(uint64_t)63;
    CKPT_TRY(ckpt__arena_reserve(&acc->arena, len));
    for (int64_t j = 0; j < m->nfiles; j++) {
        if (m->files[j].rank != me) continue;
        dst[j] = acc->arena.p + off;
        off += (m->files[j].size + 63) & ~(uint64_t)63;
        *total += m->files[j].size;
    }
    return CKPT_OK;
}

/* This rank's record: its newest local checkpoints saved by this number of
 * processes, each with the parts it holds verified. why gets the first
 * problem seen (for the line a fallback logs). */
static int make_record(ckpt_accelerator *acc, tier_rec *rec, ckpt_tier_pick *pk, char *why,
                       size_t cap) {
    const ckpt_tier *t = &acc->tier;
    int me = acc->comm->rank;
    memset(rec, 0, sizeof *rec);
    rec->project_newest = -1;
    int64_t *nums = NULL, count = 0;
    CKPT_TRY(ckpt__tier_list(acc, &nums, &count));
    int rc = CKPT_OK;
    for (int64_t i = count - 1; i >= 0 && rec->ncand < TIER_CANDS && rc == 0; i--) {
        char *dir = ckpt__tier_folder(t, nums[i]);
        if (!dir) {
            rc = ckpt__err_nomem("local_dir");
            break;
        }
        /* The newest one's own part is read into the buffer area now, as
         * the load would read it, and checked there: read once. */
        bool first = rec->ncand == 0;
        ckpt_tier_scan sc;
        ckpt_manifest m;
        ckpt__manifest_init(&m);
        char w[1024];
        rc = ckpt__tier_scan(dir, true, first ? me : -1, &sc, first ? &m : NULL, NULL, NULL, w,
                             sizeof w);
        if (rc == 0 && sc.bad && !why[0]) snprintf(why, cap, "%s", w);
        bool usable = rc == 0 && sc.num_processes == acc->comm->size && sc.nparts > 0;
        if (usable && first) {
            int at = -1;
            for (int k = 0; k < sc.nparts; k++)
                if (sc.parts[k] == me) at = k;
            uint8_t **dst =
                at >= 0 ? ckpt__calloc((size_t)(m.nfiles ? m.nfiles : 1), sizeof *dst) : NULL;
            ckpt_mapped *maps =
                dst ? ckpt__calloc((size_t)(m.nfiles ? m.nfiles : 1), sizeof *maps) : NULL;
            uint64_t total = 0;
            int orc = at < 0          ? 1
                      : !dst || !maps ? ckpt__err_nomem("load buffers")
                                      : own_layout(acc, &m, me, dst, &total);
            if (orc == 0) orc = read_own(&m, dir, me, maps, dst);
            if (orc == 0) {
                pk->preloaded = true;
                pk->pre_number = nums[i];
                pk->pre_digest = sc.digest;
            } else if (orc < 0) {
                if (orc == CKPT_ENOMEM) rc = orc;
                if (!why[0]) snprintf(why, cap, "%s", ckpt_errmsg());
                /* this rank's own copy is not held after all */
                for (int k = at + 1; k < sc.nparts; k++) sc.parts[k - 1] = sc.parts[k];
                sc.nparts--;
                usable = sc.nparts > 0;
            }
            free(dst);
            free(maps);
        }
        ckpt__manifest_clear(&m);
        free(dir);
        if (rc < 0 || !usable) continue;
        int k = rec->ncand++;
        rec->cand[k].number = nums[i];
        rec->cand[k].digest = sc.digest;
        rec->cand[k].nparts = sc.nparts;
        memcpy(rec->cand[k].parts, sc.parts, sizeof sc.parts);
    }
    free(nums);
    return rc;
}

/* Whether rec holds part q of save (number, digest). */
static bool holds(const tier_rec *rec, int64_t number, uint64_t digest, int q, bool *any) {
    for (int k = 0; k < rec->ncand && k < TIER_CANDS; k++) {
        if (rec->cand[k].number != number || rec->cand[k].digest != digest) continue;
        if (any) *any = true;
        for (int i = 0; i < rec->cand[k].nparts && i < CKPT_TIER_MAX_PARTS; i++)
            if (rec->cand[k].parts[i] == q) return true;
    }
    return false;
}

/* The ranks whose part of (number, digest) no rank holds, as "2, 3" (how
 * many in *n). */
static void missing_parts(const tier_rec *all, int p, int64_t number, uint64_t digest, char *buf,
                          size_t cap, int *n) {
    size_t used = 0;
    *n = 0;
    buf[0] = '\0';
    for (int q = 0; q < p; q++) {
        bool found = false;
        for (int r = 0; r < p && !found; r++) found = holds(&all[r], number, digest, q, NULL);
        if (found) continue;
        (*n)++;
        if (*n <= 8 && used < cap)
            used += (size_t)snprintf(buf + used, cap - used, "%s%d", *n > 1 ? ", " : "", q);
    }
    if (*n > 8 && used < cap) snprintf(buf + used, cap - used, " and %d more", *n - 8);
}

int ckpt__tier_choose(ckpt_accelerator *acc, ckpt_tier_pick *pk) {
    const ckpt_comm *c = acc->comm;
    int p = c->size;
    memset(pk, 0, sizeof *pk);
    pk->mroot = -1;
    int rc = ckpt__tier_setup(acc);
    if (rc < 0) return ckpt__err_prefix(rc, "load_state");
    tier_rec mine;
    char why[1024] = "";
    rc = make_record(acc, &mine, pk, why, sizeof why);
    if (rc == 0 && c->rank == 0) {
        char *cdir = ckpt__checkpoints_dir(acc->project_dir);
        int64_t *nums = NULL, count = 0;
        rc = cdir ? ckpt__list_numbers(cdir, &nums, &count) : ckpt__err_nomem("load path");
        if (rc == 0 && count > 0) mine.project_newest = nums[count - 1];
        free(nums);
        free(cdir);
    }
    tier_rec *all = ckpt__calloc((size_t)p, sizeof *all);
    size_t *lens = ckpt__calloc((size_t)p, sizeof *lens);
    if ((!all || !lens) && rc == 0) rc = ckpt__err_nomem("load_state: tier records");
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc == 0) {
        for (int r = 0; r < p; r++) lens[r] = sizeof mine;
        int crc = c->allgather(c->ctx, &mine, all, lens);
        if (crc < 0) rc = ckpt__err_prefix(crc, "load_state: communicator: allgather");
        rc = ckpt__coll_agree(c, rc, NULL);
    }
    if (rc < 0) {
        free(all);
        free(lens);
        return rc;
    }
    /* Every rank decides alike from the same records: the newest complete
     * save; on a tie of numbers (two histories), the larger digest. */
    int64_t best = -1, seen = -1;
    uint64_t bestd = 0, seend = 0;
    for (int r = 0; r < p; r++)
        for (int k = 0; k < all[r].ncand && k < TIER_CANDS; k++) {
            int64_t n = all[r].cand[k].number;
            uint64_t d = all[r].cand[k].digest;
            if (n > seen || (n == seen && d > seend)) {
                seen = n;
                seend = d;
            }
            if (n < best || (n == best && d <= bestd)) continue;
            bool complete = true;
            for (int q = 0; q < p && complete; q++) {
                bool found = false;
                for (int h = 0; h < p && !found; h++) found = holds(&all[h], n, d, q, NULL);
                complete = found;
            }
            if (complete) {
                best = n;
                bestd = d;
            }
        }
    int64_t project = all[0].project_newest;
    pk->project_newest = project;
    if (best >= 0 && best >= project) {
        pk->use = true;
        pk->number = best;
        pk->digest = bestd;
        pk->source = ckpt__malloc((size_t)p * sizeof *pk->source);
        if (!pk->source) rc = ckpt__err_nomem("load_state: tier plan");
        bool everyone = true;
        for (int q = 0; q < p && rc == 0; q++) {
            /* its own folder first, else the lowest rank holding it */
            pk->source[q] = -1;
            if (holds(&all[q], best, bestd, q, NULL)) pk->source[q] = q;
            for (int h = 0; h < p && pk->source[q] < 0; h++)
                if (holds(&all[h], best, bestd, q, NULL)) pk->source[q] = h;
            bool any = false;
            holds(&all[q], best, bestd, -1, &any);
            if (!any) everyone = false;
        }
        for (int h = 0; h < p && !everyone && pk->mroot < 0; h++) {
            bool any = false;
            holds(&all[h], best, bestd, -1, &any);
            if (any) pk->mroot = h;
        }
        bool any = false;
        holds(&all[c->rank], best, bestd, -1, &any);
        pk->have_m = any;
        rc = ckpt__coll_agree(c, rc, NULL);
    } else if (c->rank == 0 && (seen > project || (seen < 0 && project >= 0))) {
        /* Passed over for the project folder: one line says why. */
        char msg[2048], miss[256], proj[96] = "nothing (there is no checkpoint there)";
        int nmiss = 0;
        if (project >= 0)
            snprintf(proj, sizeof proj, "its newest checkpoint, checkpoint_%" PRId64, project);
        if (seen < 0) {
            snprintf(msg, sizeof msg, "no node holds a local checkpoint of this run");
        } else {
            missing_parts(all, p, seen, seend, miss, sizeof miss, &nmiss);
            snprintf(msg, sizeof msg,
                     "checkpoint_%" PRId64 " lacks a verified copy of the part%s of rank%s %s "
                     "on every node%s%s%s",
                     seen, nmiss == 1 ? "" : "s", nmiss == 1 ? "" : "s", miss,
                     why[0] ? " (rank 0 found: " : "", why, why[0] ? ")" : "");
        }
        ckpt__log(&acc->log, CKPT_LOG_WARNING,
                  "load_state: node-local tiers: %s; loading from the project folder %s: %s", msg,
                  acc->project_dir, proj);
    }
    /* Parts of a run in the tiers and no whole checkpoint anywhere: not a
     * fresh start (the message is built from what every rank knows). */
    if (rc == 0 && !pk->use && seen >= 0 && project < 0) {
        char miss[256];
        int nmiss = 0;
        missing_parts(all, p, seen, seend, miss, sizeof miss, &nmiss);
        rc = ckpt__err(
            CKPT_ECORRUPT,
            "load_state: no whole checkpoint: the node-local tiers hold checkpoint_%" PRId64
            " without a verified copy of the part%s of rank%s %s, and %s/checkpoints "
            "has none",
            seen, nmiss == 1 ? "" : "s", nmiss == 1 ? "" : "s", miss, acc->project_dir);
    }
    free(all);
    free(lens);
    return rc;
}

/* ---- fetch ---------------------------------------------------------------------- */

/* root's n bytes at *buf reach every rank (elsewhere *buf malloc'd). */
static int bcast_from(const ckpt_comm *c, int root, char **buf, size_t *n) {
    uint64_t len = c->rank == root ? (uint64_t)*n : 0;
    int crc = c->bcast(c->ctx, &len, sizeof len, root);
    if (crc < 0) return ckpt__err_prefix(crc, "communicator: bcast");
    if (len > CKPT_MANIFEST_MAX_BYTES)
        return ckpt__err(CKPT_ECORRUPT, "rank %d sent a manifest of %" PRIu64 " bytes", root, len);
    char *p = c->rank == root ? *buf : ckpt__malloc((size_t)len + 1);
    if (!p) return ckpt__err_nomem("manifest"); /* as ckpt__coll_bcast_bytes */
    int rc = CKPT_OK;
    if (len) {
        crc = c->bcast(c->ctx, p, (size_t)len, root);
        if (crc < 0) rc = ckpt__err_prefix(crc, "communicator: bcast");
    }
    if (c->rank != root) {
        p[len] = '\0';
        if (rc == 0) {
            free(*buf); /* a rank that held it already: the sender's is the same */
            *buf = p;
            *n = (size_t)len;
        } else {
            free(p);
        }
    }
    return rc;
}

/* The received bytes of this rank's part, into its files' slots, each
 * file hashed as it fills and compared with the manifest when full. */
typedef struct part_sink {
    const ckpt_manifest *m;
    ckpt_mapped *maps;
    uint8_t **dst;
    int rank, from;
    int64_t j;
    uint64_t off;
    XXH3_state_t *h;
} part_sink;

static int sink_advance(part_sink *ps, int rc) {
    while (ps->j < ps->m->nfiles) {
        const ckpt_manifest_file *f = &ps->m->files[ps->j];
        if (f->rank != ps->rank) {
            ps->j++;
            continue;
        }
        if (ps->off == 0) XXH3_64bits_reset(ps->h);
        if (ps->off < f->size) return rc;
        if (rc == 0 && XXH3_64bits_digest(ps->h) != f->xxh3)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s received from rank %d differs from the manifest's checksum", f->name,
                           ps->from);
        if (rc == 0) {
            static const uint8_t none[1];
            ps->maps[ps->j].data = f->size ? ps->dst[ps->j] : none;
            ps->maps[ps->j].size = f->size;
        }
        ps->off = 0;
        ps->j++;
    }
    return rc;
}

static int sink_put(part_sink *ps, const uint8_t *buf, size_t n, int rc) {
    size_t done = 0;
    rc = sink_advance(ps, rc);
    while (done < n && ps->j < ps->m->nfiles) {
        const ckpt_manifest_file *f = &ps->m->files[ps->j];
        size_t k = f->size - ps->off < n - done ? (size_t)(f->size - ps->off) : n - done;
        if (rc == 0) {
            memcpy(ps->dst[ps->j] + ps->off, buf + done, k);
            XXH3_64bits_update(ps->h, buf + done, k);
        }
        done += k;
        ps->off += k;
        rc = sink_advance(ps, rc);
    }
    return rc;
}

/* The transfers: in each round every rank that holds parts for others
 * sends one of them (to the lowest rank still waiting for it), every
 * waiting rank receives from its source, until every rank has its part. */
static int transfer(ckpt_accelerator *acc, const ckpt_tier_pick *pk, const ckpt_manifest *m,
                    const char *dir, ckpt_mapped *maps, uint8_t **dst, int rc) {
    const ckpt_comm *c = acc->comm;
    int p = c->size, me = c->rank;
    uint64_t *part = ckpt__calloc((size_t)p, sizeof *part);
    bool *served = ckpt__calloc((size_t)p, sizeof *served);
    int *to = ckpt__malloc((size_t)p * sizeof *to), *from = ckpt__malloc((size_t)p * sizeof *from);
    uint8_t *sbuf = ckpt__malloc(CKPT_TIER_PIECE), *rbuf = ckpt__malloc(CKPT_TIER_PIECE);
    XXH3_state_t *h = XXH3_createState();
    bool ok = part && served && to && from && sbuf && rbuf && h;
    if (!ok && rc == 0) rc = ckpt__err_nomem("load_state: transfers");
    /* every rank must take part in every exchange: without memory it
     * cannot know the plan, so the agreement before stops all (below) */
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc < 0) goto out;
    for (int64_t j = 0; j < m->nfiles; j++) {
        int r = m->files[j].rank;
        if (r >= 0 && r < p) part[r] += m->files[j].size;
    }
    for (int q = 0; q < p; q++) served[q] = pk->source[q] == q;
    for (;;) {
        for (int r = 0; r < p; r++) to[r] = from[r] = -1;
        uint64_t most = 0;
        bool any = false;
        for (int q = 0; q < p; q++) {
            int s = pk->source[q];
            if (served[q] || s < 0 || s >= p || to[s] >= 0) continue;
            to[s] = q;
            from[q] = s;
            any = true;
            if (part[q] > most) most = part[q];
        }
        if (!any) break;
        uint64_t steps = (most + CKPT_TIER_PIECE - 1) / CKPT_TIER_PIECE;
        ckpt_part_reader pr = {.m = m, .dir = dir, .rank = to[me], .fd = -1};
        part_sink ps = {.m = m, .maps = maps, .dst = dst, .rank = me, .from = from[me], .h = h};
        for (uint64_t i = 0; i < steps; i++) {
            uint64_t at = i * CKPT_TIER_PIECE;
            size_t sn = 0, rn = 0;
            if (to[me] >= 0 && part[to[me]] > at)
                sn = part[to[me]] - at < CKPT_TIER_PIECE ? (size_t)(part[to[me]] - at)
                                                         : CKPT_TIER_PIECE;
            if (from[me] >= 0 && part[me] > at)
                rn = part[me] - at < CKPT_TIER_PIECE ? (size_t)(part[me] - at) : CKPT_TIER_PIECE;
            int src = 0;
            if (sn) src = ckpt__part_read(&pr, sbuf, sn, 0);
            if (src < 0 && rc == 0) rc = src;
            int crc = ckpt__tier_exchange(c, sbuf, sn, to[me], rbuf, rn, from[me]);
            if (crc < 0 && rc == 0) rc = crc;
            if (from[me] >= 0 && crc == 0) rc = sink_put(&ps, rbuf, rn, rc);
        }
        if (from[me] >= 0) rc = sink_put(&ps, NULL, 0, rc); /* empty files at the end */
        ckpt__part_reader_end(&pr);
        for (int q = 0; q < p; q++)
            if (from[q] >= 0) served[q] = true;
    }
out:
    XXH3_freeState(h);
    free(part);
    free(served);
    free(to);
    free(from);
    free(sbuf);
    free(rbuf);
    return rc;
}

int ckpt__tier_fetch(ckpt_accelerator *acc, ckpt_tier_pick *pk, ckpt_checkpoint_open *cop,
                     char **dir_out, uint64_t *held) {
    const ckpt_comm *c = acc->comm;
    int me = c->rank;
    memset(cop, 0, sizeof *cop);
    ckpt__manifest_init(&cop->m);
    *dir_out = NULL;
    *held = 0;
    char *dir = ckpt__tier_folder(&acc->tier, pk->number);
    int rc = dir ? CKPT_OK : ckpt__err_nomem("load path");
    /* the manifest: from this rank's folder, or sent by one that holds it */
    if (rc == 0 && pk->have_m) {
        char *path = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
        rc = path
                 ? ckpt__read_small_file(path, true, CKPT_MANIFEST_MAX_BYTES, &pk->mtext, &pk->mlen)
                 : ckpt__err_nomem("load path");
        if (rc == 0 && ckpt__xxh3(pk->mtext, pk->mlen) != pk->digest)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: changed since it was looked at", path);
        free(path);
    }
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc == 0 && pk->mroot >= 0) {
        rc = bcast_from(c, pk->mroot, &pk->mtext, &pk->mlen);
        if (rc == 0 && ckpt__xxh3(pk->mtext, pk->mlen) != pk->digest)
            rc = ckpt__err(CKPT_ECORRUPT, "the manifest sent by rank %d differs from its digest",
                           pk->mroot);
        rc = ckpt__coll_agree(c, rc, NULL);
    }
    char what[96];
    snprintf(what, sizeof what, "checkpoint_%" PRId64 "/" CKPT_MANIFEST_NAME, pk->number);
    if (rc == 0) {
        rc = ckpt__manifest_parse(pk->mtext, pk->mlen, what, &cop->m);
        cop->have_manifest = rc == 0;
        if (rc == 0 && cop->m.num_processes != c->size)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: saved by %d processes, loaded by %d", what,
                           cop->m.num_processes, c->size);
        rc = ckpt__coll_agree(c, rc, NULL);
    }
    /* this rank's files' places in the buffer area */
    uint8_t **dst = NULL;
    int64_t nf = cop->m.nfiles;
    if (rc == 0) {
        cop->maps = ckpt__calloc((size_t)(nf ? nf : 1), sizeof *cop->maps);
        dst = ckpt__calloc((size_t)(nf ? nf : 1), sizeof *dst);
        rc = cop->maps && dst ? own_layout(acc, &cop->m, me, dst, held)
                              : ckpt__err_nomem("load buffers");
        /* this rank's own part: read at the choice already, or now */
        bool pre = pk->preloaded && pk->pre_number == pk->number && pk->pre_digest == pk->digest;
        static const uint8_t none[1];
        for (int64_t j = 0; rc == 0 && pre && pk->source[me] == me && j < nf; j++) {
            if (cop->m.files[j].rank != me) continue;
            cop->maps[j].data = cop->m.files[j].size ? dst[j] : none;
            cop->maps[j].size = cop->m.files[j].size;
        }
        if (rc == 0 && !pre && pk->source[me] == me)
            rc = read_own(&cop->m, dir, me, cop->maps, dst);
        /* the transfers agree on their plan first: every rank takes part */
        rc = transfer(acc, pk, &cop->m, dir, cop->maps, dst, rc);
        rc = ckpt__coll_agree(c, rc, NULL);
    }
    free(dst);
    pk->adopted = rc == 0 && pk->source[me] != me;
    if (rc < 0) {
        ckpt__checkpoint_close(cop);
        *held = 0;
        free(dir);
        return rc;
    }
    *dir_out = dir;
    return CKPT_OK;
}

/* ---- adopt ------------------------------------------------------------------- */

void ckpt__tier_adopt(ckpt_accelerator *acc, const ckpt_tier_pick *pk,
                      const ckpt_checkpoint_open *cop) {
    if (!pk->adopted) return;
    const ckpt_tier *t = &acc->tier;
    int me = acc->comm->rank;
    char *target = ckpt__tier_folder(t, pk->number);
    struct stat st;
    if (!target || ckpt__os_lstat(target, &st) == 0) { /* there already */
        free(target);
        return;
    }
    ckpt_txn tx;
    memset(&tx, 0, sizeof tx);
    int rc = ckpt__txn_begin(&tx, target, "load_state: keep the received part", true, &acc->log);
    for (int64_t j = 0; rc == 0 && j < cop->m.nfiles; j++) {
        const ckpt_manifest_file *f = &cop->m.files[j];
        if (f->rank != me) continue;
        char *path = ckpt__path_join(tx.tmp, f->name);
        ckpt_ostream s;
        rc = path ? ckpt__ostream_open(&s, path) : ckpt__err_nomem("load path");
        if (rc == 0) {
            rc = ckpt__ostream_write(&s, cop->maps[j].data, (size_t)f->size);
            if (rc == 0) rc = ckpt__ostream_finish(&s, NULL, NULL);
            else ckpt__ostream_abort(&s);
        }
        free(path);
    }
    if (rc == 0) rc = ckpt__manifest_publish(pk->mtext, pk->mlen, tx.tmp);
    if (rc == 0) rc = ckpt__txn_commit(&tx, false, &acc->log);
    if (rc < 0)
        ckpt__log(&acc->log, CKPT_LOG_WARNING,
                  "load_state: could not keep the part received from rank %d in %s: %s",
                  pk->source[me], target, ckpt_errmsg());
    ckpt__txn_end(&tx, &acc->log);
    free(target);
}
