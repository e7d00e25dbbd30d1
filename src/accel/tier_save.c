/* tier_save.c — a save with a node-local tier (tier.h), on top of the save's
 * phases (save.c):
 *
 *   plan     every rank lists its local folder; the number is above every
 *            rank's newest local checkpoint as well as the project's; rank 0
 *            decides whether the save is persisted (goes to the project too)
 *   write    each rank writes its files into its own local temporary folder;
 *            a persisted save then copies them (or links unchanged ones)
 *            into the project's temporary folder: 1/P per rank, as always
 *   commit   the agreement and file records as always; rank 0 makes the
 *            manifest and, if persisted, commits the project folder; then
 *            (tier_finish) the manifest's text reaches every rank, every
 *            part goes to its replicas (exchanges of CKPT_TIER_PIECE
 *            bytes, written and verified against the manifest on arrival),
 *            each rank commits its local folder, all agree, and each rank
 *            removes its local checkpoints beyond local_total_limit.
 *
 * An asynchronous save does plan in the caller's thread, write (the copy to
 * the project included) in the background, and with several processes the
 * commit, replication included, in the caller's thread at the next wait,
 * save, load or free: the communicator is never used from another thread. */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/save_int.h"
#include "accel/save_op.h"
#include "accel/tier.h"
#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "store/store.h"
#include "store/txn.h"

/* ---- plan ------------------------------------------------------------------ */

int ckpt__tier_plan(save_op *op, int rc) {
    ckpt_accelerator *acc = op->acc;
    const ckpt_comm *c = op->comm;
    int src = ckpt__tier_setup(acc);
    if (src < 0) return ckpt__err_prefix(src, "save_state");
    int64_t *nums = NULL, count = 0;
    if (rc == 0) rc = ckpt__tier_list(acc, &nums, &count);
    free(nums);
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc < 0) return rc;
    int64_t v = acc->tier.highest;
    if (c->size > 1) {
        int crc = c->allreduce_i64(c->ctx, &v, 1, CKPT_REDUCE_MAX);
        if (crc < 0) return ckpt__err_prefix(crc, "save_state: communicator: allreduce");
    }
    op->tier_highest = v;
    return CKPT_OK;
}

int ckpt__tier_open(save_op *op) {
    ckpt_tier *t = &op->acc->tier;
    char base[48];
    snprintf(base, sizeof base, "checkpoint_%" PRId64, op->number);
    char *tname = ckpt__temp_name(base);
    op->ltarget = ckpt__tier_folder(t, op->number);
    op->ltmp = tname ? ckpt__path_join(t->dir, tname) : NULL;
    free(tname);
    if (!op->ltarget || !op->ltmp) return ckpt__err_nomem("save path");
    /* Unchanged files link from this rank's previous local checkpoint; the
     * project's previous one (rank 0's pick) serves the copy there. */
    op->pprev_dir = op->prev_dir;
    op->prev_dir = NULL;
    if (op->link && t->highest >= 0 && t->highest < op->number &&
        !(op->prev_dir = ckpt__tier_folder(t, t->highest)))
        return ckpt__err_nomem("save path");
    if (!op->persist && !(op->target = ckpt__strdup(op->ltarget)))
        return ckpt__err_nomem("save path");
    if (ckpt__os_mkdir(op->ltmp, 0755) != 0)
        return ckpt__err_os(errno, "save_state: %s: create temporary folder", op->ltmp);
    op->ltmp_made = true;
    op->wdir = op->ltmp;
    return CKPT_OK;
}

/* ---- copying a file, verified ------------------------------------------------ */

/* Copies from/name to to/name (created), checking that the bytes are
 * size bytes with XXH3-64 xxh3: the file as the manifest records it. */
static int copy_file(const char *from, const char *to, const char *name, uint64_t size,
                     uint64_t xxh3) {
    char *src = ckpt__path_join(from, name), *dst = ckpt__path_join(to, name);
    uint8_t *buf = ckpt__malloc(CKPT_TIER_PIECE);
    int rc = src && dst && buf ? CKPT_OK : ckpt__err_nomem("copy");
    int fd = rc == 0 ? ckpt__open_read(src, src, true, NULL) : -1;
    if (rc == 0 && fd < 0) rc = fd;
    ckpt_ostream s;
    memset(&s, 0, sizeof s);
    s.fd = -1;
    if (rc == 0) rc = ckpt__ostream_open(&s, dst);
    uint64_t off = 0;
    while (rc == 0 && off < size) {
        size_t n = size - off < CKPT_TIER_PIECE ? (size_t)(size - off) : CKPT_TIER_PIECE;
        ssize_t got = ckpt__os_pread(fd, buf, n, off);
        if (got < 0) rc = ckpt__err_os(errno, "%s: read", src);
        else if (got == 0)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: ends at %" PRIu64 " bytes, expected %" PRIu64, src,
                           off, size);
        else {
            rc = ckpt__ostream_write(&s, buf, (size_t)got);
            off += (uint64_t)got;
        }
    }
    uint64_t h = 0, n = 0;
    if (rc == 0) rc = ckpt__ostream_finish(&s, &h, &n);
    else ckpt__ostream_abort(&s);
    if (rc == 0 && (h != xxh3 || n != size)) {
        rc = ckpt__err(CKPT_ECORRUPT,
                       "%s: its bytes changed after it was written (checksum mismatch): not "
                       "copied",
                       src);
        (void)ckpt__os_unlink(dst);
    }
    if (fd >= 0) ckpt__os_close(fd);
    free(buf);
    free(src);
    free(dst);
    return rc;
}

/* One of this rank's files into the project folder: linked from the
 * project's previous checkpoint when it has the same bytes, else copied. */
static int persist_one(save_op *op, const save_slot *sl) {
    int rc = 0;
    if (op->have_pprev && sl->d.has_xxh128) {
        char *path = ckpt__path_join(op->tmp, sl->name);
        ckpt_file_digest scratch;
        memset(&scratch, 0, sizeof scratch);
        rc = path ? ckpt__save_link_same(op, &op->pprev, op->pprev_dir, sl->name, sl->d.size,
                                         sl->d.xxh128, path, &scratch)
                  : ckpt__err_nomem("save path");
        ckpt__file_digest_free(&scratch);
        free(path);
        if (rc != 0) return rc < 0 ? rc : CKPT_OK;
    }
    rc = copy_file(op->wdir, op->tmp, sl->name, sl->d.size, sl->d.xxh3);
    if (rc == 0) op->written_bytes += sl->d.size;
    return rc;
}

int ckpt__tier_persist(save_op *op) {
    if (op->link && op->pprev_dir) {
        ckpt__manifest_init(&op->pprev);
        if (ckpt__manifest_read(op->pprev_dir, &op->pprev) == 0) {
            op->have_pprev = true;
        } else {
            ckpt__manifest_clear(&op->pprev);
            ckpt_clear_error();
        }
    }
    int rc = CKPT_OK;
    for (int i = 0; rc == 0 && i < op->nobjs; i++)
        for (int k = -1; rc == 0 && k < op->nhf[i] + 1; k++) {
            const save_slot *sl = k < 0            ? &op->slots[2 * i]
                                  : k < op->nhf[i] ? &op->hf[i][k]
                                                   : &op->slots[2 * i + 1];
            if (sl->has) rc = persist_one(op, sl);
        }
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    return CKPT_OK;
}

int ckpt__tier_persist_extras(save_op *op) {
    for (int64_t j = 0; j < op->all.nfiles; j++) {
        const ckpt_manifest_file *f = &op->all.files[j];
        if (strcmp(f->kind, "extra") == 0)
            CKPT_TRY(copy_file(op->wdir, op->tmp, f->name, f->size, f->xxh3));
    }
    return CKPT_OK;
}

/* ---- replication ---------------------------------------------------------------- */

/* The files of another rank's part, written into a folder as the bytes
 * arrive, each checked against the manifest when complete. */
typedef struct part_writer {
    const ckpt_manifest *m;
    const char *dir;
    int rank; /* whose part */
    int64_t j;
    bool open;
    ckpt_ostream s;
    uint64_t off;
    /* NULL: check each file against m; else m's files with no checksum yet
     * (a background replication, before the manifest): the XXH3-64 of what
     * arrived goes into rec's entry instead */
    ckpt_manifest *rec;
} part_writer;

/* Opens, finishes and checks files until the current one has bytes left
 * (or the part is done). */
static int part_advance(part_writer *pw, int rc) {
    while (pw->j < pw->m->nfiles) {
        const ckpt_manifest_file *f = &pw->m->files[pw->j];
        if (f->rank != pw->rank) {
            pw->j++;
            continue;
        }
        if (!pw->open && rc == 0) {
            char *path = ckpt__path_join(pw->dir, f->name);
            rc = path ? ckpt__ostream_open(&pw->s, path) : ckpt__err_nomem("replica");
            free(path);
            pw->open = rc == 0;
        }
        if (pw->off < f->size) return rc;
        if (pw->open) {
            uint64_t h = 0, n = 0;
            pw->open = false;
            int frc = ckpt__ostream_finish(&pw->s, &h, &n);
            if (frc == 0 && pw->rec && n == f->size) pw->rec->files[pw->j].xxh3 = h;
            else if (frc == 0 && (h != f->xxh3 || n != f->size)) {
                frc = ckpt__err(CKPT_ECORRUPT,
                                "%s/%s: the copy received from rank %d differs from the "
                                "manifest's checksum",
                                pw->dir, f->name, pw->rank);
                char *path = ckpt__path_join(pw->dir, f->name);
                if (path) (void)ckpt__os_unlink(path);
                free(path);
            }
            if (rc == 0) rc = frc;
        }
        pw->off = 0;
        pw->j++;
    }
    return rc;
}

static int part_write(part_writer *pw, const uint8_t *buf, size_t n, int rc) {
    size_t done = 0;
    rc = part_advance(pw, rc);
    while (done < n && pw->j < pw->m->nfiles) {
        const ckpt_manifest_file *f = &pw->m->files[pw->j];
        size_t k = f->size - pw->off < n - done ? (size_t)(f->size - pw->off) : n - done;
        if (rc == 0 && pw->open) rc = ckpt__ostream_write(&pw->s, buf + done, k);
        done += k;
        pw->off += k;
        rc = part_advance(pw, rc);
    }
    return rc;
}

static void part_writer_end(part_writer *pw) {
    if (pw->open) ckpt__ostream_abort(&pw->s);
    pw->open = false;
}

/* Every part to its replicas: in round k (1..R) each rank sends its part to
 * rank + kJ and receives the part of rank - kJ, CKPT_TIER_PIECE bytes per
 * exchange; every rank makes as many exchanges as the largest part needs
 * (the same count everywhere: it follows from the manifest). A rank's own
 * failure (a read, a write, a checksum) keeps it exchanging, so that no
 * rank waits for one that stopped; it is returned after the last round. */
static int replicate(save_op *op, const ckpt_manifest *m, int rc) {
    const ckpt_comm *c = op->comm;
    const ckpt_tier *t = &op->acc->tier;
    int p = c->size, me = c->rank;
    if (t->replicas <= 0 || p <= 1) return rc;
    uint64_t *part = ckpt__calloc((size_t)p, sizeof *part);
    uint8_t *sbuf = ckpt__malloc(CKPT_TIER_PIECE), *rbuf = ckpt__malloc(CKPT_TIER_PIECE);
    if ((!part || !sbuf || !rbuf) && rc == 0) rc = ckpt__err_nomem("replication");
    uint64_t most = 0;
    for (int64_t j = 0; part && j < m->nfiles; j++) {
        int r = m->files[j].rank;
        if (r >= 0 && r < p) part[r] += m->files[j].size;
    }
    for (int r = 0; part && r < p; r++)
        if (part[r] > most) most = part[r];
    uint64_t steps = (most + CKPT_TIER_PIECE - 1) / CKPT_TIER_PIECE;
    for (int k = 1; k <= t->replicas; k++) {
        int dest = ckpt__tier_replica_holder(t, p, me, k);
        int src = ckpt__tier_replica_source(t, p, me, k);
        ckpt_part_reader pr = {.m = m, .dir = op->ltmp, .rank = me, .fd = -1};
        part_writer pw = {.m = m, .dir = op->ltmp, .rank = src};
        for (uint64_t i = 0; i < steps; i++) {
            uint64_t at = i * CKPT_TIER_PIECE;
            size_t sn =
                part && part[me] > at
                    ? (size_t)(part[me] - at < CKPT_TIER_PIECE ? part[me] - at : CKPT_TIER_PIECE)
                    : 0;
            size_t rn =
                part && part[src] > at
                    ? (size_t)(part[src] - at < CKPT_TIER_PIECE ? part[src] - at : CKPT_TIER_PIECE)
                    : 0;
            if (sn && sbuf) rc = ckpt__part_read(&pr, sbuf, sn, rc);
            int crc = ckpt__tier_exchange(c, sbuf, sbuf ? sn : 0, dest, rbuf, rbuf ? rn : 0, src);
            if (crc < 0 && rc == 0) rc = crc;
            if (crc == 0 && rbuf) rc = part_write(&pw, rbuf, rn, rc);
        }
        /* the files of the part past its last byte (empty ones) */
        if (steps == 0 || (part && part[src] == 0)) rc = part_write(&pw, NULL, 0, rc);
        ckpt__part_reader_end(&pr);
        part_writer_end(&pw);
    }
    free(part);
    free(sbuf);
    free(rbuf);
    if (rc < 0) rc = ckpt__err_prefix(rc, "save_state: %s: replication", op->ltarget);
    return rc;
}

/* ---- the local commit ------------------------------------------------------------ */

static int local_commit(save_op *op) {
    int rc = ckpt__manifest_publish(op->mtext, op->mlen, op->ltmp);
    if (rc == 0) {
        ckpt_txn t = {
            .target = op->ltarget, .tmp = op->ltmp, .what = "save_state", .made = op->ltmp_made};
        rc = ckpt__txn_commit(&t, false, &op->log);
        op->ltmp_made = t.made;
    }
    return rc;
}

/* This rank's local checkpoints beyond local_total_limit go, oldest first,
 * once the new one is committed on every rank. */
static void local_rotate(save_op *op) {
    ckpt_tier *t = &op->acc->tier;
    int64_t *nums = NULL, count = 0;
    if (ckpt__list_numbers(t->dir, &nums, &count) < 0) {
        ckpt__log(&op->log, CKPT_LOG_WARNING, "local_dir rotation: %s", ckpt_errmsg());
        return;
    }
    for (int64_t i = 0; i + t->keep < count; i++) {
        char name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
        if (ckpt__remove_checkpoint(t->dir, name, &op->log) < 0)
            ckpt__log(&op->log, CKPT_LOG_WARNING, "local_dir rotation: %s", ckpt_errmsg());
    }
    t->highest = count > 0 ? nums[count - 1] : -1;
    free(nums);
}

/* The manifest's text from rank 0 to every rank, parsed there. */
static int share_manifest(save_op *op) {
    const ckpt_comm *c = op->comm;
    char *text = op->committer ? op->mtext : NULL;
    size_t n = op->committer ? op->mlen : 0;
    CKPT_TRY(ckpt__coll_bcast_bytes(c, &text, &n));
    if (!op->committer) {
        op->mtext = text;
        op->mlen = n;
    }
    int rc =
        ckpt__manifest_parse(op->mtext, op->mlen, "save_state: the manifest from rank 0", &op->tm);
    op->have_tm = true;
    return rc;
}

/* ---- replication in the background ---------------------------------------------
 * An asynchronous save's background thread, after its write and before the
 * commit (so before the manifest exists), when the communicator has
 * exchange_background: in round k each rank sends rank + kJ a header (its
 * status, then each of its part's files: size and name) and the files'
 * bytes, and receives the same from rank - kJ, writing them into its local
 * temporary folder with the XXH3-64 of what arrived. At the commit
 * (check_background) every received file is compared with the manifest's
 * record of it: the same verification as a replication after the commit,
 * with nothing read twice. If any rank's check fails, every rank replicates
 * again in the caller's thread as a synchronous save does. */

/* This rank's part: the files it wrote (and rank 0 the pre-hooks' files of
 * its folder), sizes as written, into own (rank me). */
static int own_part(save_op *op, ckpt_manifest *own, int me) {
    ckpt_file_digest d;
    memset(&d, 0, sizeof d);
    for (int i = 0; i < op->nobjs; i++)
        for (int k = -1; k < op->nhf[i] + 1; k++) {
            const save_slot *sl = k < 0            ? &op->slots[2 * i]
                                  : k < op->nhf[i] ? &op->hf[i][k]
                                                   : &op->slots[2 * i + 1];
            if (!sl->has) continue;
            d.size = sl->d.size;
            CKPT_TRY(ckpt__manifest_add(own, sl->name, "part", &d));
        }
    if (me == 0) {
        DIR *dh = ckpt__os_opendir(op->wdir);
        if (!dh) return ckpt__err_os(errno, "%s", op->wdir);
        struct dirent *e;
        int rc = CKPT_OK;
        while (rc == 0 && (e = ckpt__os_readdir(dh)) != NULL) {
            struct stat st;
            if (!ckpt__manifest_valid_name(e->d_name) || ckpt__manifest_find(own, e->d_name) ||
                ckpt__os_fstatat(ckpt__os_dirfd(dh), e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
                !S_ISREG(st.st_mode))
                continue;
            d.size = (uint64_t)st.st_size;
            rc = ckpt__manifest_add(own, e->d_name, "extra", &d);
        }
        ckpt__os_closedir(dh);
        CKPT_TRY(rc);
    }
    for (int64_t j = 0; j < own->nfiles; j++) own->files[j].rank = me;
    return CKPT_OK;
}

static void put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The header: status, file count, then per file its size, name length and
 * name. */
static int header_make(const ckpt_manifest *own, bool ok, uint8_t **out, size_t *len) {
    size_t n = 16;
    for (int64_t j = 0; ok && j < own->nfiles; j++) n += 16 + strlen(own->files[j].name);
    uint8_t *h = ckpt__malloc(n);
    if (!h) return ckpt__err_nomem("replication");
    put_u64(h, ok ? 0 : 1);
    put_u64(h + 8, ok ? (uint64_t)own->nfiles : 0);
    size_t at = 16;
    for (int64_t j = 0; ok && j < own->nfiles; j++) {
        size_t l = strlen(own->files[j].name);
        put_u64(h + at, own->files[j].size);
        put_u64(h + at + 8, l);
        memcpy(h + at + 16, own->files[j].name, l);
        at += 16 + l;
    }
    *out = h;
    *len = n;
    return CKPT_OK;
}

/* A header from rank src into rx (files of rank src, no checksum yet). */
static int header_parse(const uint8_t *h, size_t len, int src, ckpt_manifest *rx, bool *sender_ok) {
    *sender_ok = false;
    if (len < 16)
        return ckpt__err(CKPT_EIO, "replication: a header of %zu bytes from rank %d", len, src);
    *sender_ok = get_u64(h) == 0;
    uint64_t n = get_u64(h + 8);
    size_t at = 16;
    ckpt_file_digest d;
    memset(&d, 0, sizeof d);
    char name[256];
    for (uint64_t j = 0; j < n; j++) {
        uint64_t l = at + 16 <= len ? get_u64(h + at + 8) : 0;
        if (at + 16 > len || l == 0 || l >= sizeof name || l > len - at - 16)
            return ckpt__err(CKPT_EIO, "replication: rank %d's header is malformed", src);
        d.size = get_u64(h + at);
        memcpy(name, h + at + 16, l);
        name[l] = '\0';
        if (!ckpt__manifest_valid_name(name) || ckpt__manifest_find(rx, name))
            return ckpt__err(CKPT_EIO, "replication: rank %d sends a file named '%s'", src, name);
        CKPT_TRY(ckpt__manifest_add(rx, name, "part", &d));
        rx->files[rx->nfiles - 1].rank = src;
        at += 16 + (size_t)l;
    }
    return CKPT_OK;
}

static uint64_t part_bytes(const ckpt_manifest *m) {
    uint64_t t = 0;
    for (int64_t j = 0; j < m->nfiles; j++) t += m->files[j].size;
    return t;
}

static size_t piece_at(uint64_t total, uint64_t at) {
    return total > at ? (size_t)(total - at < CKPT_TIER_PIECE ? total - at : CKPT_TIER_PIECE) : 0;
}

/* One exchange on the background channel. */
static int bg_exchange(save_op *op, const void *sbuf, size_t sn, int dest, void *rbuf, size_t rn,
                       int src) {
    const ckpt_comm *c = op->comm;
    int crc = c->exchange_background(c->ctx, sbuf, sn, dest, rbuf, rn, src, op->acc->coll_timeout);
    return crc < 0 ? ckpt__err_prefix(crc, "communicator: exchange in the background") : CKPT_OK;
}

void ckpt__tier_replicate_background(save_op *op) {
    const ckpt_comm *c = op->comm;
    const ckpt_tier *t = &op->acc->tier;
    int p = c->size, me = c->rank;
    if (!op->tier_bg || t->replicas <= 0 || p <= 1) return;
    ckpt_manifest own;
    ckpt__manifest_init(&own);
    /* crc: the channel's failure (the rounds stop: nothing pairs up any
     * more); frc: this rank's first own failure (the rounds go on, so that
     * no other rank waits for this one) */
    int crc = CKPT_OK, frc = CKPT_OK;
    op->rx = ckpt__calloc((size_t)t->replicas, sizeof *op->rx);
    uint8_t *sbuf = ckpt__malloc(CKPT_TIER_PIECE), *rbuf = ckpt__malloc(CKPT_TIER_PIECE);
    if (!op->rx || !sbuf || !rbuf) crc = ckpt__err_nomem("replication");
    int local = op->rc < 0 || !op->ltmp ? CKPT_EINVAL : CKPT_OK; /* this rank has a part */
    if (crc == 0 && local == 0) local = own_part(op, &own, me);
    uint64_t total_s = local == 0 ? part_bytes(&own) : 0;
    uint8_t *hs = NULL;
    size_t hn = 0;
    if (crc == 0) crc = header_make(&own, local == 0, &hs, &hn);
    if (local < 0) frc = local;
    for (int k = 1; crc == 0 && k <= t->replicas; k++) {
        int dest = ckpt__tier_replica_holder(t, p, me, k);
        int src = ckpt__tier_replica_source(t, p, me, k);
        ckpt_manifest *rx = &op->rx[k - 1];
        ckpt__manifest_init(rx);
        op->nrx = k;
        uint8_t lenb[8], rlenb[8];
        put_u64(lenb, hn);
        crc = bg_exchange(op, lenb, 8, dest, rlenb, 8, src);
        uint64_t rl = crc == 0 ? get_u64(rlenb) : 0;
        uint8_t *hr =
            crc == 0 && rl < ((uint64_t)1 << 30) ? ckpt__malloc(rl ? (size_t)rl : 1) : NULL;
        if (crc == 0 && !hr) crc = ckpt__err_nomem("replication header");
        if (crc == 0) crc = bg_exchange(op, hs, hn, dest, hr, (size_t)rl, src);
        bool sender_ok = false;
        int lrc = crc == 0 ? header_parse(hr, (size_t)rl, src, rx, &sender_ok) : CKPT_OK;
        free(hr);
        if (crc < 0) break;
        if (lrc == 0 && !sender_ok)
            lrc = ckpt__err(CKPT_EIO, "replication: rank %d has no part to send", src);
        /* Both sides know both counts now: the pieces pair up. */
        uint64_t total_r = part_bytes(rx), most = total_s > total_r ? total_s : total_r;
        uint64_t steps = (most + CKPT_TIER_PIECE - 1) / CKPT_TIER_PIECE;
        ckpt_part_reader pr = {.m = &own, .dir = op->ltmp, .rank = me, .fd = -1};
        part_writer pw = {.m = rx, .dir = op->ltmp, .rank = src, .rec = rx};
        if (frc < 0) lrc = frc; /* nothing written for a failed op */
        for (uint64_t i = 0; crc == 0 && i < steps; i++) {
            size_t sn = piece_at(total_s, i * CKPT_TIER_PIECE);
            size_t rn = piece_at(total_r, i * CKPT_TIER_PIECE);
            if (sn) local = ckpt__part_read(&pr, sbuf, sn, local);
            crc = bg_exchange(op, sbuf, sn, dest, rbuf, rn, src);
            if (crc == 0 && rn) lrc = part_write(&pw, rbuf, rn, lrc);
        }
        if (crc == 0) lrc = part_write(&pw, NULL, 0, lrc); /* empty files */
        ckpt__part_reader_end(&pr);
        part_writer_end(&pw);
        if (frc == 0 && local < 0) frc = local;
        if (frc == 0 && lrc < 0) frc = lrc;
    }
    free(hs);
    free(sbuf);
    free(rbuf);
    ckpt__manifest_clear(&own);
    int rc = crc < 0 ? crc : frc;
    if (rc < 0) {
        op->bg_rc = ckpt__err_prefix(rc, "save_state: %s: replication",
                                     op->ltarget ? op->ltarget : "node-local tier");
        op->bg_msg = ckpt__strdup(ckpt_errmsg());
    }
}

/* At the commit: every file received in the background is the manifest's
 * file of that rank, of its size and XXH3-64, and every file of that
 * rank's part arrived; a file the manifest does not list (another rank's
 * pre-hook file) goes. Agreed: if any rank's check fails, every rank drops
 * what it received and replicates in the caller's thread. */
static int check_background(save_op *op) {
    const ckpt_comm *c = op->comm;
    const ckpt_tier *t = &op->acc->tier;
    if (t->replicas <= 0 || c->size <= 1) return CKPT_OK;
    int rc = op->bg_rc;
    if (rc < 0) ckpt__err(rc, "%s", op->bg_msg ? op->bg_msg : "replication failed");
    for (int k = 1; rc == 0 && k <= t->replicas; k++) {
        int src = ckpt__tier_replica_source(t, c->size, c->rank, k);
        const ckpt_manifest *rx = k <= op->nrx ? &op->rx[k - 1] : NULL;
        for (int64_t j = 0; rc == 0 && j < op->tm.nfiles; j++) {
            const ckpt_manifest_file *f = &op->tm.files[j];
            if (f->rank != src) continue;
            const ckpt_manifest_file *g = rx ? ckpt__manifest_find(rx, f->name) : NULL;
            if (!g)
                rc =
                    ckpt__err(CKPT_EIO, "%s/%s: not received from rank %d", op->ltmp, f->name, src);
            else if (g->size != f->size || g->xxh3 != f->xxh3)
                rc = ckpt__err(CKPT_ECORRUPT,
                               "%s/%s: the copy received from rank %d differs from the manifest's "
                               "checksum",
                               op->ltmp, f->name, src);
        }
        for (int64_t j = 0; rc == 0 && rx && j < rx->nfiles; j++) {
            const ckpt_manifest_file *f = ckpt__manifest_find(&op->tm, rx->files[j].name);
            if (f && f->rank == src) continue;
            char *path = ckpt__path_join(op->ltmp, rx->files[j].name);
            if (path) (void)ckpt__os_unlink(path);
            free(path);
        }
    }
    int arc = ckpt__coll_agree(c, rc, NULL);
    if (arc == 0) return CKPT_OK;
    if (c->rank == 0)
        ckpt__log(&op->log, CKPT_LOG_WARNING,
                  "save_state: the replication in the background failed (%s); replicating "
                  "again",
                  ckpt_errmsg());
    for (int k = 0; k < op->nrx; k++)
        for (int64_t j = 0; j < op->rx[k].nfiles; j++) {
            char *path = ckpt__path_join(op->ltmp, op->rx[k].files[j].name);
            if (path) (void)ckpt__os_unlink(path);
            free(path);
        }
    op->tier_bg = false; /* tier_finish replicates as a synchronous save does */
    return CKPT_OK;
}

void ckpt__save_op_replicate_in_background(ckpt_save_op *op) {
    op->tier_bg = op->tier && op->comm->size > 1 && op->comm->exchange_background != NULL;
}

bool ckpt__save_op_replicates_in_background(const ckpt_save_op *op) { return op->tier_bg; }

void ckpt__save_op_replicate(ckpt_save_op *op) { ckpt__tier_replicate_background(op); }

int ckpt__tier_finish(save_op *op, int rc) {
    const ckpt_comm *c = op->comm;
    ckpt_accelerator *acc = op->acc;
    if (rc < 0) return rc;
    ckpt__coll_phase(acc, "save: share the manifest");
    int lrc = share_manifest(op);
    lrc = ckpt__coll_agree(c, lrc, NULL);
    if (lrc == 0 && op->tier_bg) lrc = check_background(op);
    if (lrc == 0) {
        ckpt__coll_phase(acc, "save: replicate to other nodes");
        if (!op->tier_bg) lrc = replicate(op, &op->tm, lrc);
        if (lrc == 0) lrc = local_commit(op);
        ckpt__coll_phase(acc, "save: agree on the node-local copies");
        lrc = ckpt__coll_agree(c, lrc, NULL);
    }
    if (lrc == 0) {
        local_rotate(op);
        return CKPT_OK;
    }
    if (!op->persist) return lrc;
    /* The project folder has it: the save holds; the tier is behind. */
    if (c->rank == 0)
        ckpt__log(&op->log, CKPT_LOG_WARNING, "%s is committed, but its node-local copy failed: %s",
                  op->target, ckpt_errmsg());
    return CKPT_OK;
}

void ckpt__tier_release(save_op *op) {
    /* a failed save leaves the request for the next one */
    if (op->rc < 0 && op->persist_next) op->acc->tier.persist_next = true;
    op->persist_next = false;
    if (op->ltmp_made && ckpt__remove_tree(op->ltmp) < 0)
        ckpt__log(&op->log, CKPT_LOG_WARNING, "could not remove %s after a failed save: %s",
                  op->ltmp, ckpt_errmsg());
    op->ltmp_made = false;
    free(op->ltarget);
    free(op->ltmp);
    free(op->pprev_dir);
    if (op->have_pprev) ckpt__manifest_clear(&op->pprev);
    if (op->have_tm) ckpt__manifest_clear(&op->tm);
    for (int k = 0; k < op->nrx; k++) ckpt__manifest_clear(&op->rx[k]);
    free(op->rx);
    free(op->bg_msg);
    op->rx = NULL;
    op->nrx = 0;
    op->bg_msg = NULL;
    free(op->mtext);
    op->ltarget = op->ltmp = op->pprev_dir = op->mtext = NULL;
    op->have_pprev = op->have_tm = false;
}
