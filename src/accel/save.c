/* save.c — the save's phases (save_op.h), the same for one process and for
 * many:
 *
 *   plan      rank 0 takes the project lock, picks the number and the
 *             temporary folder, and tells every rank (or why it cannot)
 *   snapshot  every rank runs the pre-hooks (with the temporary folder) and
 *             every object's state_dict, then computes the save plan
 *   write     rank 0 writes the objects' own files, every rank its own
 *             random state and its part by the save plan (its share of the
 *             replicated tensors, its Hugging Face shards, its shard of every
 *             sharded object), each file fsynced, its digest recorded
 *   commit    agree: every rank's status, then its file records and what
 *             its plan was computed from, reach rank 0; commit: rank 0
 *             lists the files the pre-hooks left, writes the manifest last,
 *             renames, fsyncs, only if every rank succeeded with the same
 *             objects; then applies total_limit
 *   apply     every rank: the numbering moves on, the post-hooks run
 *
 * and at the end every rank returns the same status and message. With one
 * process the communicator is the one-process one and every collective is
 * a no-op, so this is exactly the single-process save. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/save_op.h"
#include "base/error.h"
#include "base/io.h"
#include "format/hfindex.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/store.h"
#include "store/txn.h"

/* One file a rank wrote, kept in its object's slot so the manifest lists
 * the files in object order whichever thread wrote them and when. */
typedef struct save_slot {
    bool has;
    char name[160];
    const char *kind;
    ckpt_file_digest d;
} save_slot;

/* The phases in the order they run (save_op.h). */
enum save_phase { PH_NEW, PH_PLAN, PH_SNAPSHOT, PH_WRITE, PH_COMMIT, PH_APPLY };

struct ckpt_save_op {
    ckpt_accelerator *acc;
    int phase;        /* the last phase entered (enum save_phase) */
    char *output_dir; /* the caller's folder; NULL: automatic */
    const ckpt_comm *comm;
    ckpt_logger log;  /* the accelerator's, as at the call */
    int64_t step;     /* the accelerator's step and numbering at the call */
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
    bool split;             /* a model's frozen tensors went to a file of their own */
    uint64_t linked_bytes;  /* this rank's files linked, not written */
    uint64_t written_bytes; /* this rank's files written */
    /* The objects and replicated tensors the spread plan depends on, one
     * line per object: "<file> <hash> <count>\n" (order_digest). Every
     * rank must have the same: rank 0 compares at the commit. */
    char *order;
};
typedef struct ckpt_save_op save_op;

/* ---- plan ------------------------------------------------------------------ */

/* Splits an explicit output folder into parent and final component (both
 * malloc'd), ignoring trailing slashes. */
static int split_dir(const char *path, char **parent, char **base) {
    *parent = *base = NULL;
    size_t n = strlen(path);
    while (n > 1 && path[n - 1] == '/') n--;
    size_t s = n;
    while (s > 0 && path[s - 1] != '/') s--;
    if (n == s || (n - s == 1 && path[s] == '.') ||
        (n - s == 2 && path[s] == '.' && path[s + 1] == '.'))
        return ckpt__err(CKPT_EINVAL,
                         "save_state: %s: not a folder name a checkpoint can be saved as", path);
    *base = ckpt__malloc(n - s + 1);
    if (s == 0) *parent = ckpt__strdup(".");
    else {
        size_t pl = s > 1 ? s - 1 : 1; /* "/x": the parent is "/" */
        *parent = ckpt__malloc(pl + 1);
        if (*parent) {
            memcpy(*parent, path, pl);
            (*parent)[pl] = '\0';
        }
    }
    if (!*base || !*parent) {
        free(*base);
        free(*parent);
        *base = *parent = NULL;
        return ckpt__err_nomem("save path");
    }
    memcpy(*base, path + s, n - s);
    (*base)[n - s] = '\0';
    return 0;
}

/* Rank 0's part of the plan: everything up to an empty temporary folder. */
static int plan_local(save_op *op, const char *output_dir) {
    ckpt_accelerator *acc = op->acc;
    int rc;
    CKPT_TRY(ckpt__acc_own_project(acc, true, "save_state"));
    /* After a failed load (see ckpt.h); checked after the project lock so
     * that a project another run owns still says so (CKPT_EBUSY). Rank 0
     * decides for all: every rank's load ended alike. */
    if (acc->load_failed)
        return ckpt__err(CKPT_EINVAL,
                         "save_state: refused: the last load_state of this accelerator failed "
                         "(%s: %s); saving now could replace or rotate away the checkpoints it "
                         "could not load. Fix the cause and load again, or call "
                         "ckpt_accelerator_start_over to start this run over deliberately",
                         ckpt__status_name(acc->load_failed_code),
                         acc->load_failed_msg ? acc->load_failed_msg : "(message lost)");
    if (op->automatic) {
        op->parent = ckpt__checkpoints_dir(acc->project_dir);
        if (!op->parent) return ckpt__err_nomem("save path");
    } else {
        CKPT_TRY(split_dir(output_dir, &op->parent, &op->base));
    }
    rc = ckpt__mkdirs(op->parent);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    op->lockp = ckpt__lock_path(op->parent, op->automatic ? "checkpoint_0" : op->base);
    if (!op->lockp) return ckpt__err_nomem("lock path");
    /* The project lock, held since the first save or load, covers it. */
    if (!ckpt__acc_holds_lock_file(acc, op->lockp))
        rc = ckpt__lock_acquire(&op->lk, op->lockp, false);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    int64_t n;
    bool numbered = op->automatic || ckpt__parse_checkpoint_name(op->base, &n);
    CKPT_TRY(ckpt__remove_leftovers(op->parent, numbered ? NULL : op->base, &op->log));
    if (op->automatic) {
        int64_t *nums = NULL, count = 0;
        rc = ckpt__list_numbers(op->parent, &nums, &count);
        if (rc < 0) return ckpt__err_prefix(rc, "save_state");
        op->number = acc->iteration;
        if (count > 0 && nums[count - 1] + 1 > op->number) op->number = nums[count - 1] + 1;
        if (op->link && count > 0) {
            char nm[48];
            snprintf(nm, sizeof nm, "checkpoint_%" PRId64, nums[count - 1]);
            op->prev_dir = ckpt__path_join(op->parent, nm);
        }
        free(nums);
        op->base = ckpt__malloc(48);
        if (!op->base) return ckpt__err_nomem("save path");
        snprintf(op->base, 48, "checkpoint_%" PRId64, op->number);
    }
    /* Before the project has a checkpoint (or for a folder of the user's):
     * the checkpoint this accelerator saved or loaded last, e.g. the one a
     * fine-tune started from. */
    if (op->link && !op->prev_dir && acc->link_dir && acc->link_dir[0])
        op->prev_dir = ckpt__strdup(acc->link_dir);
    op->target = ckpt__path_join(op->parent, op->base);
    op->tname = ckpt__temp_name(op->base);
    if (!op->target || !op->tname || !(op->tmp = ckpt__path_join(op->parent, op->tname)))
        return ckpt__err_nomem("save path");
    if (!op->automatic) CKPT_TRY(ckpt__txn_check_replaceable(&(ckpt_txn){
                            .target = op->target, .tmp = op->tmp, .what = "save_state"}));
    if (ckpt__os_mkdir(op->tmp, 0755) != 0)
        return ckpt__err_os(errno, "save_state: %s: create temporary folder", op->tmp);
    op->tmp_made = true;
    return CKPT_OK;
}

/* The plan as it travels: the number, then target and tmp, NUL-terminated. */
static int plan_share(save_op *op) {
    const ckpt_comm *c = op->comm;
    if (c->size <= 1) return CKPT_OK;
    char *blob = NULL;
    size_t n = 0;
    if (c->rank == 0) {
        const char *prev = op->prev_dir ? op->prev_dir : "";
        size_t nt = strlen(op->target), np = strlen(op->tmp), nv = strlen(prev);
        n = 24 + nt + 1 + np + 1 + nv + 1;
        blob = ckpt__malloc(n);
        if (!blob) return ckpt__err_nomem("save plan");
        memset(blob, 0, 24);
        snprintf(blob, 24, "%" PRId64, op->number);
        memcpy(blob + 24, op->target, nt + 1);
        memcpy(blob + 24 + nt + 1, op->tmp, np + 1);
        memcpy(blob + 24 + nt + 1 + np + 1, prev, nv + 1);
    }
    int rc = ckpt__coll_bcast_bytes(c, &blob, &n);
    if (rc == 0 && c->rank != 0) {
        /* From rank 0 of this job, but still checked: four strings (the
         * last, the checkpoint to link from, may be empty). */
        const char *t = blob + 24, *end = blob + n;
        const char *p = n > 24 ? memchr(t, '\0', (size_t)(end - t)) : NULL;
        const char *v = p ? memchr(p + 1, '\0', (size_t)(end - p - 1)) : NULL;
        if (!v || !memchr(v + 1, '\0', (size_t)(end - v - 1)) || !memchr(blob, '\0', 24)) {
            rc = ckpt__err(CKPT_EINVAL, "save_state: rank 0 sent a malformed plan");
        } else {
            op->number = strtoll(blob, NULL, 10);
            op->target = ckpt__strdup(t);
            op->tmp = ckpt__strdup(p + 1);
            if (!op->target || !op->tmp) rc = ckpt__err_nomem("save plan");
            if (rc == 0 && v[1] && !(op->prev_dir = ckpt__strdup(v + 1)))
                rc = ckpt__err_nomem("save plan");
        }
    }
    free(blob);
    return rc;
}

/* ---- snapshot and write ------------------------------------------------- */

static int snapshot(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    op->objs = ckpt__acc_plan_objects(acc, &op->nobjs);
    if (!op->objs) return ckpt__err_nomem("save plan");
    op->writers = ckpt__calloc((size_t)op->nobjs, sizeof *op->writers);
    if (!op->writers) return ckpt__err_nomem("save plan");
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        char name[96];
        ckpt__acc_file_name(acc, o, name, sizeof name);
        CKPT_TRY(ckpt_writer_new(&op->writers[i]));
        ckpt_clear_error();
        int rc = o->ops->state_dict(o->self, op->writers[i]);
        if (rc != 0) {
            bool own = ckpt_errmsg()[0] != '\0';
            rc = ckpt__callback_failed(rc, "state_dict");
            rc = ckpt__err_prefix(rc, own ? "%s: state_dict" : "%s", name);
            return ckpt__err_prefix(rc, "save_state: %s", op->target);
        }
    }
    return CKPT_OK;
}

/* ---- incremental saves: unchanged files are linked -------------------------- */

/* Every rank, after the plan: the manifest of the checkpoint to link from.
 * Without a readable one nothing is linked (that is all it costs). */
static void read_prev(save_op *op) {
    if (!op->link || !op->prev_dir) return;
    ckpt__manifest_init(&op->prev);
    if (ckpt__manifest_read(op->prev_dir, &op->prev) == 0) {
        op->have_prev = true;
    } else {
        ckpt__manifest_clear(&op->prev);
        ckpt_clear_error();
    }
}

/* The digest of a linked file, from the previous manifest's record. */
static int digest_from_record(const ckpt_manifest_file *f, ckpt_file_digest *d) {
    memset(d, 0, sizeof *d);
    size_t n = f->ntensors ? (size_t)f->ntensors : 1;
    d->tensor_keys = ckpt__calloc(n, sizeof *d->tensor_keys);
    d->tensor_xxh3 = ckpt__calloc(n, sizeof *d->tensor_xxh3);
    if (f->chunks) d->tensor_chunk = ckpt__calloc(n, sizeof *d->tensor_chunk);
    if (!d->tensor_keys || !d->tensor_xxh3 || (f->chunks && !d->tensor_chunk)) {
        ckpt__file_digest_free(d);
        return ckpt__err_nomem("file digest");
    }
    d->ntensors = f->ntensors;
    for (int64_t t = 0; t < f->ntensors; t++) {
        if (!(d->tensor_keys[t] = ckpt__strdup(f->tensor_keys[t]))) {
            ckpt__file_digest_free(d);
            return ckpt__err_nomem("file digest");
        }
        d->tensor_xxh3[t] = f->tensor_xxh3[t];
        if (f->chunks) d->tensor_chunk[t] = f->chunks[t];
    }
    d->size = f->size;
    d->xxh3 = f->xxh3;
    d->has_xxh128 = true;
    d->xxh128 = f->xxh128;
    d->has_header_xxh3 = f->has_header_xxh3;
    d->header_xxh3 = f->header_xxh3;
    return CKPT_OK;
}

/* Whether the file the save would write as name equals the previous
 * checkpoint's file of that name, decided from memory: the same size and
 * XXH3-128 as its manifest records. If so it is hard-linked into the
 * temporary folder at path (1; d from the record). 0: write it (d->xxh128
 * may already hold its hash). The old file is never read to decide; it is
 * read once linked, to check that its bytes are those in memory and those
 * its manifest records (a file changed after its commit is never linked). */
static int try_link(save_op *op, ckpt_writer *w, const char *name, bool shards, const char *path,
                    ckpt_file_digest *d) {
    if (!op->have_prev || op->link_off) return 0;
    const ckpt_manifest_file *f = ckpt__manifest_find(&op->prev, name);
    if (!f || !f->has_xxh128) return 0;
    uint64_t size = 0;
    ckpt_h128 h;
    CKPT_TRY(ckpt__writer_hash128(w, path, shards, &size, &h));
    d->has_xxh128 = true;
    d->xxh128 = h;
    if (size != f->size || !ckpt__h128_eq(h, f->xxh128)) return 0;
    char *from = ckpt__path_join(op->prev_dir, name);
    if (!from) return ckpt__err_nomem("save path");
    if (ckpt__os_link(from, path) != 0) {
        int e = errno;
        if (e != ENOENT) { /* EXDEV, EPERM, EMLINK, ENOTSUP...: for this save, write */
            op->link_off = true;
            ckpt__log(&op->log, CKPT_LOG_WARNING,
                      "save_state: cannot hard-link unchanged files from %s (%s: %s); writing "
                      "them instead",
                      op->prev_dir, name, strerror(e));
        }
        free(from);
        return 0;
    }
    /* Both digests of the file as linked: XXH3-128 against the bytes in
     * memory (so what is linked is exactly what would have been written,
     * whatever the old manifest says), XXH3-64 against its record (which
     * the new manifest copies). */
    uint64_t got = 0;
    ckpt_h128 got128 = {0, 0};
    int rc = ckpt__read_hashed128(path, path, f->size, &got, &got128);
    if (rc < 0 || got != f->xxh3 || !ckpt__h128_eq(got128, h)) {
        ckpt__log(&op->log, CKPT_LOG_WARNING,
                  "save_state: %s no longer has the bytes its manifest records (%s); not "
                  "linked, written anew",
                  from, rc < 0 ? ckpt_errmsg() : "its checksum differs");
        free(from);
        ckpt_clear_error();
        if (ckpt__os_unlink(path) != 0)
            return ckpt__err_os(errno, "save_state: %s: remove a link to a damaged file", path);
        return 0;
    }
    free(from);
    CKPT_TRY(digest_from_record(f, d));
    op->linked_bytes += f->size;
    return 1;
}

/* Writes one file of the op's rank into the temporary folder (or links
 * the previous checkpoint's identical file there), recording it in slot. */
static int write_file(save_op *op, ckpt_writer *w, const char *name, const char *kind, bool shards,
                      save_slot *slot) {
    char *path = ckpt__path_join(op->tmp, name);
    if (!path) return ckpt__err_nomem("save path");
    ckpt__file_digest_free(&slot->d);
    memset(&slot->d, 0, sizeof slot->d);
    int rc = op->link ? try_link(op, w, name, shards, path, &slot->d) : 0;
    if (rc == 0) {
        bool known = slot->d.has_xxh128;
        ckpt_h128 h = slot->d.xxh128;
        rc = ckpt__writer_write_new_ex(w, path, shards, op->link && !known, &slot->d);
        if (rc == 0 && known) {
            slot->d.has_xxh128 = true;
            slot->d.xxh128 = h;
        }
    }
    if (rc > 0) rc = 0;
    else if (rc == 0) op->written_bytes += slot->d.size;
    if (rc == 0) {
        slot->has = true;
        slot->kind = kind;
        snprintf(slot->name, sizeof slot->name, "%s", name);
    }
    free(path);
    return rc;
}

/* Whether object i is written as Hugging Face shards: a model beyond
 * max_shard_size with tensors only, none sharded across processes. */
static bool hf_decide(const save_op *op, int i) {
    const ckpt_writer *w = op->writers[i];
    if (op->objs[i].kind != K_MODEL || !op->acc->max_shard_size || ckpt__writer_has_shards(w))
        return false;
    uint64_t total = 0;
    for (int64_t j = 0; j < ckpt_writer_entry_count(w); j++) {
        ckpt_entry_info e;
        if (ckpt_writer_entry(w, j, &e) < 0 || e.kind != CKPT_ENTRY_TENSOR) return false;
        total += e.nbytes;
    }
    return total > op->acc->max_shard_size;
}

/* The same, as the plan decided it (before it spread the model's tensors). */
static bool hf_sharded(const save_op *op, int i) {
    return op->hf_model && op->hfl && op->hf_owner && op->hf_model[i] && op->hf_owner[i];
}

/* ---- the save plan: every replicated tensor written once ------------------ */

/* Tensors smaller than this are never cut: each goes whole to one rank. */
#define PLAN_CUT_MIN ((uint64_t)1 << 20)

/* Where rank r's share of the replicated bytes starts, total of them, when
 * rank k already writes hf[k] bytes of Hugging Face shards: each rank's
 * share is what it lacks of 1/P of everything, max(0, (total + sum hf) / P -
 * hf[k]), scaled so that the shares add up to total. Without shards it is
 * floor(r * total / P). */
static uint64_t share_start(const uint64_t *hf, int r, int p, uint64_t total) {
    unsigned __int128 all = total, below = 0, sum = 0;
    for (int k = 0; k < p; k++) all += hf[k];
    for (int k = 0; k < p; k++) {
        unsigned __int128 mine = (unsigned __int128)hf[k] * (unsigned)p;
        unsigned __int128 q = all > mine ? all - mine : 0; /* P x the rank's quota */
        sum += q;
        if (k < r) below += q;
    }
    if (r >= p || sum == 0) return r >= p ? total : 0;
    return (uint64_t)((unsigned __int128)total * below / sum);
}

/* The row (0..rows) nearest to byte position b of a tensor that starts at
 * byte s and has rows of row_bytes bytes. */
static int64_t nearest_row(uint64_t b, uint64_t s, uint64_t row_bytes, int64_t rows) {
    if (b <= s) return 0;
    uint64_t k = (b - s + row_bytes / 2) / row_bytes;
    return k > (uint64_t)rows ? rows : (int64_t)k;
}

/* The Hugging Face layout of object i (a model saved as shards): greedy in
 * state order, as transformers splits. */
static int hf_layout(save_op *op, int i, const char *file, ckpt_hf_layout *l) {
    const ckpt_writer *w = op->writers[i];
    int64_t n = ckpt_writer_entry_count(w);
    char stem[96];
    snprintf(stem, sizeof stem, "%.*s", (int)(strlen(file) - 12), file); /* without .safetensors */
    uint64_t *nb = ckpt__calloc((size_t)n + 1, sizeof *nb);
    const char **keys = ckpt__calloc((size_t)n + 1, sizeof *keys);
    int rc = nb && keys ? CKPT_OK : ckpt__err_nomem("save shards");
    for (int64_t j = 0; j < n && rc == 0; j++) {
        ckpt_entry_info e;
        rc = ckpt_writer_entry(w, j, &e);
        nb[j] = e.nbytes;
        keys[j] = e.key;
    }
    if (rc == 0) rc = ckpt__hf_layout_make(keys, nb, n, op->acc->max_shard_size, stem, l);
    free(keys);
    free(nb);
    return rc;
}

typedef struct hf_item {
    uint64_t bytes;
    int64_t shard;
} hf_item;

/* Largest first; ties: the first shard. */
static int cmp_hf_item(const void *a, const void *b) {
    const hf_item *x = a, *y = b;
    if (x->bytes != y->bytes) return x->bytes < y->bytes ? 1 : -1;
    return (x->shard > y->shard) - (x->shard < y->shard);
}

/* The shards of every model saved as Hugging Face shards go to the ranks,
 * largest first, each to the rank with the fewest such bytes so far (ties:
 * the lowest rank); hf_bytes[r] gets each rank's total. With one process,
 * all to rank 0. */
static int plan_hf(save_op *op, uint64_t *hf_bytes) {
    int p = op->comm->size;
    op->hfl = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *op->hfl);
    op->hf_owner = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *op->hf_owner);
    if (!op->hfl || !op->hf_owner) return ckpt__err_nomem("save plan");
    for (int i = 0; i < op->nobjs; i++) {
        if (!op->hf_model[i]) continue;
        char name[96];
        ckpt__acc_file_name(op->acc, &op->objs[i], name, sizeof name);
        CKPT_TRY(hf_layout(op, i, name, &op->hfl[i]));
        const ckpt_hf_layout *l = &op->hfl[i];
        int64_t ns = l->nshards;
        int *own = op->hf_owner[i] = ckpt__calloc((size_t)(ns ? ns : 1), sizeof *own);
        hf_item *v = ckpt__calloc((size_t)(ns ? ns : 1), sizeof *v);
        if (!own || !v) {
            free(v);
            return ckpt__err_nomem("save plan");
        }
        for (int64_t t = 0; t < ns; t++) {
            v[t].shard = t;
            for (int64_t j = l->starts[t]; j < l->starts[t + 1]; j++) {
                ckpt_entry_info e;
                if (ckpt_writer_entry(op->writers[i], j, &e) == 0) v[t].bytes += e.nbytes;
            }
        }
        qsort(v, (size_t)ns, sizeof *v, cmp_hf_item);
        for (int64_t k = 0; k < ns; k++) {
            int best = 0;
            for (int r = 1; r < p; r++)
                if (hf_bytes[r] < hf_bytes[best]) best = r;
            own[v[k].shard] = best;
            hf_bytes[best] += v[k].bytes;
        }
        free(v);
    }
    return CKPT_OK;
}

/* Whether entry j of object i is a replicated tensor the plan places. */
static bool plan_entry(const save_op *op, int i, int64_t j, int64_t *rows, uint64_t *nbytes) {
    ckpt_entry_kind kind;
    ckpt_dtype dt;
    int ndim;
    const int64_t *shape;
    bool shard;
    if (ckpt__writer_entry_shape(op->writers[i], j, &kind, &dt, &ndim, &shape, nbytes, &shard) < 0)
        return false;
    *rows = ndim > 0 ? shape[0] : 1;
    return kind == CKPT_ENTRY_TENSOR && !shard && *nbytes > 0;
}

/* One process: a model with both frozen and trainable parameters keeps its
 * frozen tensors apart, whole, in its shard file
 * (<model>-00001-of-00001.safetensors, the layout of format version 2, as
 * chunks that are the whole tensor), so that file has the same bytes at
 * every save and is linked, not written. A model of one kind only stays one
 * file (it changes as a whole or not at all); a model saved as Hugging Face
 * shards keeps its layout. */
static int split_frozen(save_op *op) {
    for (int i = 0; i < op->nobjs; i++) {
        ckpt_writer *w = op->writers[i];
        if (op->objs[i].kind != K_MODEL || op->hf_model[i] || ckpt__writer_has_shards(w)) continue;
        int64_t n = ckpt_writer_entry_count(w), nfrozen = 0, ntrain = 0, rows;
        uint64_t nb;
        for (int64_t j = 0; j < n; j++) {
            if (!plan_entry(op, i, j, &rows, &nb)) continue;
            if (ckpt__writer_entry_frozen(w, j)) nfrozen++;
            else ntrain++;
        }
        if (nfrozen == 0 || ntrain == 0) continue;
        for (int64_t j = 0; j < n; j++)
            if (plan_entry(op, i, j, &rows, &nb) && ckpt__writer_entry_frozen(w, j))
                CKPT_TRY(ckpt__writer_spread(w, j, 0, rows));
        op->split = true;
    }
    return CKPT_OK;
}

/* With several processes, the replicated tensors of every object (a
 * replicated model, an optimizer's replicated part, custom objects) are
 * placed on the ranks so that each writes about 1/P of their bytes: laid
 * end to end, the tensors under PLAN_CUT_MIN bytes first and then the
 * others, each group in state order, rank r takes the bytes from r/P to
 * (r+1)/P of the total. A tensor of at least PLAN_CUT_MIN bytes is cut at
 * the row nearest each boundary (each rank's part is a run of whole rows:
 * one box chunk); a smaller one goes whole to the rank its middle byte falls
 * in. A tensor that falls whole to rank 0 stays a plain tensor of its
 * object's file, which rank 0 writes anyway: no chunk record. Small tensors
 * go first so that they are those (biases, norms, an optimizer's step
 * counts: most of the keys, few of the bytes), and the manifest's chunk
 * records are those of the large tensors and of the cuts, O(K_large + P).
 * Every rank computes the same plan from the same state dicts, with no
 * communication; the chunk check at the commit catches ranks whose
 * replicated state differs in shape. A model saved as Hugging Face shards
 * keeps its layout, its shard files placed on the ranks by plan_hf; the
 * other tensors' shares then make up each rank's total to about 1/P of
 * everything (share_start). The generators are per process. */
static int plan_spread(save_op *op) {
    const ckpt_comm *c = op->comm;
    int p = c->size, me = c->rank;
    op->hf_model = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *op->hf_model);
    uint64_t *hf_bytes = ckpt__calloc((size_t)p + 1, sizeof *hf_bytes);
    if (!op->hf_model || !hf_bytes) {
        free(hf_bytes);
        return ckpt__err_nomem("save plan");
    }
    for (int i = 0; i < op->nobjs; i++) op->hf_model[i] = hf_decide(op, i);
    int rc = plan_hf(op, hf_bytes);
    if (rc < 0 || p <= 1) {
        free(hf_bytes);
        return rc < 0 ? rc : split_frozen(op);
    }
    /* A model with frozen and trainable tensors: only the frozen ones are
     * spread, so each rank's shard file of it holds frozen bytes alone, the
     * same at every save, and is linked (incremental saves); the trainable
     * ones stay whole in the model's own file, which rank 0 writes. */
    bool *mixed = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *mixed);
    if (!mixed) {
        free(hf_bytes);
        return ckpt__err_nomem("save plan");
    }
    uint64_t total = 0, nb;
    int64_t rows;
    for (int i = 0; i < op->nobjs; i++) {
        if (op->objs[i].kind != K_MODEL || op->hf_model[i]) continue;
        const ckpt_writer *w = op->writers[i];
        bool any_frozen = false, any_trained = false;
        for (int64_t j = 0; j < ckpt_writer_entry_count(w); j++) {
            if (!plan_entry(op, i, j, &rows, &nb)) continue;
            if (ckpt__writer_entry_frozen(w, j)) any_frozen = true;
            else any_trained = true;
        }
        mixed[i] = any_frozen && any_trained;
    }
#define KEPT_WHOLE(i, j) (mixed[i] && !ckpt__writer_entry_frozen(op->writers[i], j))
    for (int i = 0; i < op->nobjs; i++) {
        if (op->objs[i].kind == K_RNG || op->hf_model[i]) continue;
        for (int64_t j = 0; j < ckpt_writer_entry_count(op->writers[i]); j++)
            if (plan_entry(op, i, j, &rows, &nb) && !KEPT_WHOLE(i, j)) total += nb;
    }
    uint64_t pos = 0;
    /* this rank's share [lo_b, hi_b); where rank 0's share ends */
    uint64_t lo_b = share_start(hf_bytes, me, p, total);
    uint64_t hi_b = share_start(hf_bytes, me + 1, p, total);
    uint64_t end0 = share_start(hf_bytes, 1, p, total);
    free(hf_bytes);
    for (int pass = 0; pass < 2 && rc == 0; pass++) { /* the small tensors, then the others */
        for (int i = 0; i < op->nobjs && rc == 0; i++) {
            if (op->objs[i].kind == K_RNG || op->hf_model[i]) continue;
            for (int64_t j = 0; j < ckpt_writer_entry_count(op->writers[i]) && rc == 0; j++) {
                if (!plan_entry(op, i, j, &rows, &nb) || (nb < PLAN_CUT_MIN) != (pass == 0) ||
                    KEPT_WHOLE(i, j))
                    continue;
                uint64_t row_bytes = nb / (uint64_t)rows;
                int64_t lo = 0, hi = 0;
                bool whole0; /* all of it falls to rank 0: left in the object's file */
                if (nb < PLAN_CUT_MIN || rows < 2 || row_bytes * (uint64_t)rows != nb) {
                    uint64_t mid = pos + nb / 2;
                    whole0 = mid < end0;
                    if (mid >= lo_b && (mid < hi_b || me == p - 1)) hi = rows;
                } else {
                    whole0 = nearest_row(end0, pos, row_bytes, rows) == rows;
                    lo = me == 0 ? 0 : nearest_row(lo_b, pos, row_bytes, rows);
                    hi = me == p - 1 ? rows : nearest_row(hi_b, pos, row_bytes, rows);
                }
                /* a mixed model's frozen tensors all go to shard files, rank 0's too */
                if (!whole0 || mixed[i]) rc = ckpt__writer_spread(op->writers[i], j, lo, hi);
                pos += nb;
            }
        }
    }
#undef KEPT_WHOLE
    free(mixed);
    return rc;
}

/* The index as a file of the temporary folder, with its digest. */
static int write_text_file(save_op *op, const char *name, const char *text, save_slot *slot) {
    char *path = ckpt__path_join(op->tmp, name);
    if (!path) return ckpt__err_nomem("save path");
    ckpt_ostream s;
    uint64_t xxh = 0, size = 0;
    int rc = ckpt__ostream_open(&s, path);
    if (rc == 0) {
        rc = ckpt__ostream_write(&s, text, strlen(text));
        if (rc) ckpt__ostream_abort(&s);
        else rc = ckpt__ostream_finish(&s, &xxh, &size);
    }
    free(path);
    if (rc) return rc;
    memset(&slot->d, 0, sizeof slot->d);
    slot->d.size = size;
    slot->d.xxh3 = xxh;
    slot->has = true;
    slot->kind = ckpt__kind_name[K_MODEL];
    snprintf(slot->name, sizeof slot->name, "%s", name);
    return CKPT_OK;
}

/* A model as <stem>-0000k-of-0000N.safetensors files of at most
 * max_shard_size bytes (the plan's layout) and <stem>.safetensors.index.json:
 * this rank writes the shards the plan gave it, rank 0 the index too (last),
 * each recorded for the manifest. */
static int write_hf(save_op *op, int i, const char *file) {
    const ckpt_writer *w = op->writers[i];
    const ckpt_hf_layout *l = &op->hfl[i];
    int rc = CKPT_OK;
    if (!(op->hf[i] = ckpt__calloc((size_t)l->nshards + 2, sizeof *op->hf[i])))
        return ckpt__err_nomem("save shards"); /* one spare slot: see op_free */
    /* every rank records the slots it wrote; the others stay empty */
    op->nhf[i] = (int)l->nshards + 1;
    for (int64_t s = 0; s < l->nshards && rc == 0; s++) {
        if (op->hf_owner[i][s] != op->comm->rank) continue;
        ckpt_writer *part = NULL;
        rc = ckpt_writer_new(&part);
        for (int64_t j = l->starts[s]; j < l->starts[s + 1] && rc == 0; j++) {
            ckpt_entry_info e;
            rc = ckpt_writer_entry(w, j, &e);
            if (rc == 0)
                rc = ckpt_write_tensor(part, e.key, e.dtype, e.ndim, e.shape,
                                       ckpt__writer_tensor_data(w, j));
        }
        if (rc == 0)
            rc = write_file(op, part, l->names[s], ckpt__kind_name[K_MODEL], false, &op->hf[i][s]);
        ckpt_writer_free(part);
    }
    char iname[160];
    snprintf(iname, sizeof iname, "%s.index.json", file);
    if (rc == 0 && op->committer) rc = write_text_file(op, iname, l->index, &op->hf[i][l->nshards]);
    return rc;
}

/* Whether this rank writes a shard of object i, a model saved as Hugging
 * Face shards. */
static bool hf_writes(const save_op *op, int i) {
    for (int64_t s = 0; op->hf_owner && op->hf_owner[i] && s < op->hfl[i].nshards; s++)
        if (op->hf_owner[i][s] == op->comm->rank) return true;
    return false;
}

/* Who writes what: rank 0 the objects' own files, every rank its random
 * state, its Hugging Face shards of a model saved so (the plan's), and, for
 * an object it holds chunks of (the plan's share of the replicated tensors,
 * its own sharded tensors), its own shard file. */
static int write_object(save_op *op, int i) {
    const ckpt_comm *c = op->comm;
    const ckpt_acc_obj *o = &op->objs[i];
    char name[96];
    ckpt__acc_file_name(op->acc, o, name, sizeof name);
    int rc = 0;
    if (hf_sharded(op, i)) rc = write_hf(op, i, name);
    else if (o->kind == K_RNG || op->committer)
        rc = write_file(op, op->writers[i], name, ckpt__kind_name[o->kind], false,
                        &op->slots[2 * i]);
    if (rc == 0 && ckpt__writer_shard_file_needed(op->writers[i])) {
        char shard[160];
        rc = ckpt__acc_shard_name(name, c->rank, c->size, shard, sizeof shard);
        if (rc == 0)
            rc = write_file(op, op->writers[i], shard, ckpt__kind_name[o->kind], true,
                            &op->slots[2 * i + 1]);
    }
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    op->written[i] = true;
    return CKPT_OK;
}

/* This rank's files in object order, into op->mine. */
static int record_files(save_op *op) {
    for (int i = 0; i < op->nobjs; i++) {
        for (int k = -1; k < op->nhf[i] + 1; k++) {
            /* the object's file, its Hugging Face shards and index, its shard file */
            const save_slot *sl = k < 0 ? &op->slots[2 * i]
                                  : k < op->nhf[i] ? &op->hf[i][k] : &op->slots[2 * i + 1];
            if (!sl->has) continue;
            CKPT_TRY(ckpt__manifest_add(&op->mine, sl->name, sl->kind, &sl->d));
            op->mine.files[op->mine.nfiles - 1].rank = op->comm->rank;
        }
    }
    return CKPT_OK;
}

/* ---- files a save pre-hook adds ------------------------------------------- */

/* Whether this rank will write a file named name (its share of write_files). */
static bool writes_name(const save_op *op, const char *name) {
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        char own[96], shard[160];
        ckpt__acc_file_name(op->acc, o, own, sizeof own);
        if ((o->kind == K_RNG || op->committer) && strcmp(name, own) == 0) return true;
        if (hf_sharded(op, i)) { /* its Hugging Face shards (the plan's), rank 0 the index */
            char index[128];
            snprintf(index, sizeof index, "%s.index.json", own);
            if (op->committer && strcmp(name, index) == 0) return true;
            for (int64_t s = 0; s < op->hfl[i].nshards; s++)
                if (op->hf_owner[i][s] == op->comm->rank && strcmp(name, op->hfl[i].names[s]) == 0)
                    return true;
        }
        if (ckpt__writer_shard_file_needed(op->writers[i]) &&
            ckpt__acc_shard_name(own, op->comm->rank, op->comm->size, shard, sizeof shard) == 0 &&
            strcmp(name, shard) == 0)
            return true;
    }
    return false;
}

/* After this rank's pre-hooks: none of them took a name this rank is about
 * to write (the write would fail on "File exists", a less useful message).
 * Only this rank's own names: other ranks may already have written theirs. */
static int check_hook_names(save_op *op) {
    DIR *d = opendir(op->tmp);
    if (!d) return ckpt__err_os(errno, "save_state: %s", op->tmp);
    int rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d)) != NULL)
        if (writes_name(op, e->d_name))
            rc = ckpt__err(CKPT_EINVAL,
                           "save_state: %s: a save pre-hook wrote '%s', which is the name of one "
                           "of the checkpoint's state files",
                           op->target, e->d_name);
    closedir(d);
    return rc;
}

/* Makes one pre-hook file durable and lists it: fsync, then size and
 * XXH3-64 of what is on disk. */
static int add_extra(save_op *op, const char *name) {
    char *path = ckpt__path_join(op->tmp, name);
    if (!path) return ckpt__err_nomem("save path");
    int rc = 0;
    /* The hook's file goes into the checkpoint: a regular file, no link. */
    int fd = ckpt__open_read(path, path, true, NULL);
    if (fd < 0) rc = ckpt__err_prefix(fd, "save_state: a save pre-hook's file");
    else if (ckpt__os_fsync(fd) != 0) rc = ckpt__err_os(errno, "save_state: %s: fsync", path);
    if (fd >= 0) close(fd);
    ckpt_mapped mp;
    memset(&mp, 0, sizeof mp);
    if (rc == 0) rc = ckpt__map_file(path, &mp);
    if (rc == 0) {
        ckpt_file_digest d;
        memset(&d, 0, sizeof d);
        d.size = mp.size;
        d.xxh3 = ckpt__xxh3(mp.data, (size_t)mp.size);
        rc = ckpt__manifest_add(&op->all, name, "extra", &d);
        ckpt__unmap(&mp);
    }
    free(path);
    return rc;
}

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Rank 0, at the commit: every entry of the temporary folder that no rank
 * listed was left by a pre-hook. Only regular files with names a manifest
 * can list are kept (listed as kind "extra", in name order); anything else
 * fails the save, naming it: dropping a file the user meant to keep, or
 * following a link out of the folder, would be worse. */
static int add_extras(save_op *op) {
    DIR *d = opendir(op->tmp);
    if (!d) return ckpt__err_os(errno, "save_state: %s", op->tmp);
    char **names = NULL;
    int n = 0, cap = 0, rc = 0;
    struct dirent *e;
    while (rc == 0 && (e = readdir(d)) != NULL) {
        const char *nm = e->d_name;
        if (strcmp(nm, ".") == 0 || strcmp(nm, "..") == 0 || ckpt__manifest_find(&op->all, nm))
            continue;
        struct stat st;
        if (fstatat(dirfd(d), nm, &st, AT_SYMLINK_NOFOLLOW) != 0) {
            rc = ckpt__err_os(errno, "save_state: %s/%s", op->tmp, nm);
            break;
        }
        const char *why = NULL;
        if (S_ISLNK(st.st_mode)) why = "is a symbolic link; only regular files are kept";
        else if (S_ISDIR(st.st_mode))
            why = "is a folder; only regular files at the top of the checkpoint folder are kept";
        else if (!S_ISREG(st.st_mode)) why = "is not a regular file";
        else if (strcmp(nm, CKPT_MANIFEST_NAME) == 0) why = "is the manifest's name";
        else if (!ckpt__manifest_valid_name(nm))
            why = "is not a name a checkpoint can list (hidden, \"..\", control characters or "
                  "not UTF-8)";
        if (why) {
            rc = ckpt__err(CKPT_EINVAL, "save_state: %s: a save pre-hook wrote '%s', which %s",
                           op->target, nm, why);
            break;
        }
        if (n == cap) {
            cap = cap ? cap * 2 : 8;
            char **nn = ckpt__realloc(names, (size_t)cap * sizeof *nn);
            if (!nn) {
                rc = ckpt__err_nomem("save extras");
                break;
            }
            names = nn;
        }
        if (!(names[n] = ckpt__strdup(nm))) {
            rc = ckpt__err_nomem("save extras");
            break;
        }
        n++;
    }
    closedir(d);
    if (rc == 0 && n > 1) qsort(names, (size_t)n, sizeof *names, cmp_name);
    for (int i = 0; rc == 0 && i < n; i++) rc = add_extra(op, names[i]);
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
    return rc;
}

/* ---- agree ----------------------------------------------------------------- */

static uint64_t fnv(uint64_t h, const void *p, size_t n) {
    const unsigned char *b = p;
    for (size_t i = 0; i < n; i++) h = (h ^ b[i]) * 0x100000001b3ULL;
    return h;
}

/* After the snapshot: what the spread plan is computed from, per object
 * (the generators are per process and left out): the names, dtypes,
 * shapes and frozen flags of its replicated tensors, in state order. Every
 * rank computes the plan alone, so ranks that differ here would write
 * parts of different tensors under the same names. */
static int order_digest(save_op *op) {
    size_t cap = (size_t)op->nobjs * 160 + 1, len = 0;
    op->order = ckpt__malloc(cap);
    if (!op->order) return ckpt__err_nomem("save plan");
    op->order[0] = '\0';
    for (int i = 0; i < op->nobjs; i++) {
        if (op->objs[i].kind == K_RNG) continue;
        const ckpt_writer *w = op->writers[i];
        uint64_t h = 0xcbf29ce484222325ULL;
        int64_t count = 0, rows;
        uint64_t nb;
        for (int64_t j = 0; j < ckpt_writer_entry_count(w); j++) {
            if (!plan_entry(op, i, j, &rows, &nb)) continue;
            ckpt_entry_info e;
            if (ckpt_writer_entry(w, j, &e) < 0) continue;
            int32_t fixed[3] = {(int32_t)e.dtype, (int32_t)e.ndim,
                                (int32_t)ckpt__writer_entry_frozen(w, j)};
            h = fnv(h, e.key, strlen(e.key) + 1);
            h = fnv(h, fixed, sizeof fixed);
            h = fnv(h, e.shape, (size_t)e.ndim * sizeof *e.shape);
            count++;
        }
        char name[96];
        ckpt__acc_file_name(op->acc, &op->objs[i], name, sizeof name);
        int k =
            snprintf(op->order + len, cap - len, "%s %016" PRIx64 " %" PRId64 "\n", name, h, count);
        if (k < 0 || (size_t)k >= cap - len) return ckpt__err(CKPT_EINVAL, "save plan: %s", name);
        len += (size_t)k;
    }
    return CKPT_OK;
}

/* The first line where rank r's order differs from rank 0's (theirs), as a
 * failure naming the object; 0 if they are the same. */
static int compare_order(const save_op *op, int r, const char *theirs) {
    const char *a = op->order, *b = theirs;
    while (*a || *b) {
        size_t la = strcspn(a, "\n"), lb = strcspn(b, "\n");
        if (la != lb || memcmp(a, b, la) != 0) {
            int na = (int)strcspn(a, " \n"), nb = (int)strcspn(b, " \n");
            const char *ca = a + strcspn(a, "\n"), *cb = b + strcspn(b, "\n");
            while (ca > a && ca[-1] != ' ') ca--;
            while (cb > b && cb[-1] != ' ') cb--;
            if (na && na == nb && memcmp(a, b, (size_t)na) == 0)
                return ckpt__err(CKPT_EINVAL,
                                 "save_state: %s: the ranks save different state: %.*s differs "
                                 "between rank 0 and rank %d (the names, order, dtypes or shapes "
                                 "of its replicated tensors: %d on rank 0, %d on rank %d)",
                                 op->target, na, a, r, atoi(ca), atoi(cb), r);
            return ckpt__err(CKPT_EINVAL,
                             "save_state: %s: the ranks save different objects: rank 0 saves "
                             "%.*s where rank %d saves %.*s",
                             op->target, na ? na : 7, na ? a : "nothing", r, nb ? nb : 7,
                             nb ? b : "nothing");
        }
        a += la + (a[la] == '\n');
        b += lb + (b[lb] == '\n');
    }
    return CKPT_OK;
}

/* What a rank sends rank 0 at the agreement: its order (order_digest), a
 * NUL, then its file records as JSON. */
static int records_to_wire(save_op *op, char **out, size_t *len) {
    char *json = NULL;
    size_t jlen = 0;
    CKPT_TRY(ckpt__manifest_files_to_json(&op->mine, &json, &jlen));
    size_t olen = strlen(op->order);
    char *w = ckpt__malloc(olen + 1 + jlen);
    if (!w) {
        free(json);
        return ckpt__err_nomem("file records");
    }
    memcpy(w, op->order, olen + 1);
    memcpy(w + olen + 1, json, jlen);
    free(json);
    *out = w;
    *len = olen + 1 + jlen;
    return CKPT_OK;
}

/* Every rank's order and file records reach rank 0, in rank order: the
 * orders must all be rank 0's; the records go into op->all. */
static int gather_records(save_op *op, const char *wire, size_t len) {
    const ckpt_comm *c = op->comm;
    size_t *lens = op->committer ? ckpt__calloc((size_t)c->size, sizeof *lens) : NULL;
    if (op->committer && !lens) return ckpt__err_nomem("file records");
    void *all = NULL;
    int rc = c->gather(c->ctx, wire, len, &all, lens, 0);
    if (rc < 0) rc = ckpt__err_prefix(rc, "communicator: gather");
    if (rc == 0 && op->committer) {
        op->all.num_processes = c->size;
        size_t off = 0;
        for (int r = 0; r < c->size && rc == 0; r++) {
            const char *p = (const char *)all + off;
            const char *nul = memchr(p, '\0', lens[r]);
            if (!nul) {
                rc = ckpt__err(CKPT_EINVAL, "save_state: rank %d sent malformed file records", r);
                break;
            }
            rc = compare_order(op, r, p);
            char what[64];
            snprintf(what, sizeof what, "save_state: file records of rank %d", r);
            size_t ol = (size_t)(nul - p) + 1;
            if (rc == 0) rc = ckpt__manifest_files_from_json(&op->all, p + ol, lens[r] - ol, what);
            off += lens[r];
        }
        for (int64_t i = 0; rc == 0 && i < op->all.nfiles; i++)
            if (op->all.files[i].rank < 0 || op->all.files[i].rank >= c->size)
                rc = ckpt__err(CKPT_EINVAL, "save_state: %s: rank %d outside [0, %d)",
                               op->all.files[i].name, op->all.files[i].rank, c->size);
    }
    free(all);
    free(lens);
    return rc;
}

/* ---- commit and rotate (rank 0) ------------------------------------------- */

static int commit(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    ckpt_manifest *m = &op->all;
    m->step = op->step;
    m->iteration = op->automatic ? op->number + 1 : op->iteration;
    m->process_index = acc->process_index;
    m->num_processes = acc->num_processes;
    /* Saved by several processes, replicated tensors may sit in shard files
     * (the save plan), and so may a model's frozen tensors (split_frozen):
     * readers of version 1 would not look for them there. */
    m->format_version = op->comm->size > 1 || op->split ? CKPT_FORMAT_VERSION_SPREAD : 1;
    m->nmetrics = op->nmetrics;
    memcpy(m->metrics, op->metrics, sizeof m->metrics);
    /* The ranks' chunks of each sharded tensor must tile it exactly. */
    int rc = ckpt__manifest_check_chunks(m, CKPT_EINVAL, "save_state");
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    CKPT_TRY(add_extras(op));
    /* The manifest is the commit record: written last, after every file of
     * every rank is durable, so a folder with a valid manifest is a complete
     * checkpoint. */
    rc = ckpt__manifest_write(m, op->tmp);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    /* The folder may have appeared (or changed) since the plan checked it,
     * while the hooks ran and the files were written: the commit checks again
     * that a user's folder is never replaced. (Automatic names are published
     * without replacing.) The save owns its names (every rank has them), so
     * the transaction is a view of them. */
    ckpt_txn t = {.target = op->target, .tmp = op->tmp, .what = "save_state", .made = op->tmp_made};
    rc = ckpt__txn_commit(&t, !op->automatic, &op->log);
    op->tmp_made = t.made;
    return rc;
}

/* Rotation only after the commit: the newest checkpoint is never at risk. A
 * failure here leaves an extra old checkpoint, not a failed save. */
static void rotate(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (!op->automatic || (acc->total_limit <= 0 && !ckpt__retention_active(&acc->retention)))
        return;
    int64_t removed = 0;
    if (ckpt__rotate(op->parent, acc->total_limit, &acc->retention, &op->log, &removed) < 0)
        ckpt__log(&op->log, CKPT_LOG_WARNING, "total_limit rotation: %s", ckpt_errmsg());
}

/* Rank 0, before the ranks learn the outcome: a failed save's temporary
 * folder goes (every rank has stopped writing into it), then the lock. */
static void release(save_op *op) {
    if (op->tmp_made && ckpt__remove_tree(op->tmp) < 0)
        ckpt__log(&op->log, CKPT_LOG_WARNING, "could not remove %s after a failed save",
                  op->tmp);
    op->tmp_made = false;
    ckpt__lock_release(&op->lk);
}

void ckpt__save_op_free(save_op *op) {
    if (!op) return;
    /* Never committed (a driver gave up): nothing of it stays behind. */
    if (op->committer) release(op);
    if (op->writers)
        for (int i = 0; i < op->nobjs; i++) ckpt_writer_free(op->writers[i]);
    if (op->slots)
        for (int i = 0; i < 2 * op->nobjs; i++) ckpt__file_digest_free(&op->slots[i].d);
    free(op->slots);
    for (int i = 0; op->hf && i < op->nobjs; i++) {
        /* a shard whose write failed may hold a digest too: free every slot */
        for (int k = 0; op->hf[i] && op->nhf && k <= op->nhf[i]; k++)
            ckpt__file_digest_free(&op->hf[i][k].d);
        free(op->hf[i]);
    }
    free(op->hf);
    free(op->nhf);
    free(op->written);
    for (int i = 0; op->hfl && i < op->nobjs; i++) ckpt__hf_layout_free(&op->hfl[i]);
    free(op->hfl);
    for (int i = 0; op->hf_owner && i < op->nobjs; i++) free(op->hf_owner[i]);
    free(op->hf_owner);
    free(op->hf_model);
    free(op->writers);
    free(op->objs);
    ckpt__manifest_clear(&op->mine);
    ckpt__manifest_clear(&op->all);
    if (op->have_prev) ckpt__manifest_clear(&op->prev);
    free(op->order);
    free(op->prev_dir);
    free(op->parent);
    free(op->base);
    free(op->target);
    free(op->tmp);
    free(op->tname);
    free(op->lockp);
    free(op->post_dir);
    free(op->output_dir);
    free(op);
}

/* ---- the phases ---------------------------------------------------------------- */

static const char *const phase_name[] = {"new", "plan", "snapshot", "write", "commit", "apply"};

/* Whether the op may run phase `to` now: right after the phase before it.
 * Out of order, the op fails (nothing will be committed). */
static bool enter(save_op *op, enum save_phase to) {
    if (op->phase + 1 == (int)to) {
        op->phase = to;
        return true;
    }
    int rc = ckpt__err(CKPT_EINVAL, "save_state: internal error: the %s phase after the %s phase",
                       phase_name[to], phase_name[op->phase]);
    ckpt__save_op_fail(op, rc);
    return false;
}

static int check_args(const ckpt_accelerator *acc, const char *output_dir) {
    bool automatic = output_dir == NULL;
    if (automatic && !acc->automatic_checkpoint_naming)
        return ckpt__err(CKPT_EINVAL, "save_state: no output folder given and "
                                      "automatic_checkpoint_naming is off");
    if (automatic && !acc->project_dir)
        return ckpt__err(CKPT_EINVAL,
                         "save_state: automatic checkpoint naming needs a project_dir");
    if (!automatic && !output_dir[0])
        return ckpt__err(CKPT_EINVAL, "save_state: output_dir is empty");
    return CKPT_OK;
}

int ckpt__save_op_new(ckpt_accelerator *acc, const char *output_dir, save_op **out) {
    save_op *op = ckpt__calloc(1, sizeof *op);
    *out = op;
    if (!op) return ckpt__err_nomem("save");
    op->acc = acc;
    op->comm = acc->comm;
    op->log = acc->log;
    op->step = acc->step;
    op->iteration = acc->iteration;
    op->automatic = output_dir == NULL;
    op->committer = acc->comm->rank == 0;
    op->number = -1;
    op->lk.fd = -1;
    op->link = !acc->no_link_unchanged;
    ckpt__manifest_init(&op->mine);
    ckpt__manifest_init(&op->all);
    /* A rank whose own checks fail still takes part in every collective
     * that follows, and reports its failure at the agreement. */
    op->rc = check_args(acc, output_dir);
    if (op->rc == 0 && output_dir && !(op->output_dir = ckpt__strdup(output_dir)))
        op->rc = ckpt__err_nomem("save path");
    if (op->rc < 0 && op->comm->size <= 1) return op->rc;
    acc->interval_start = ckpt__now(); /* ckpt_should_save's time interval */
    op->nmetrics = acc->nmetrics;
    memcpy(op->metrics, acc->metrics, sizeof op->metrics);
    return op->rc;
}

int ckpt__save_op_plan(save_op *op) {
    const ckpt_comm *c = op->comm;
    if (!enter(op, PH_PLAN) && c->size <= 1) return op->rc;
    if (c->size <= 1) {
        if (op->rc == 0) op->rc = plan_local(op, op->output_dir);
        return op->rc;
    }
    ckpt__coll_begin(op->acc, "save: share the plan");
    int rc = op->rc;
    if (op->committer && rc == 0) rc = plan_local(op, op->output_dir);
    int prc = ckpt__coll_share(c, op->committer ? rc : CKPT_OK);
    if (prc < 0) { /* every rank knows: no agreement follows */
        op->ended = true;
        rc = prc;
    } else {
        int src = plan_share(op);
        if (rc == 0) rc = src;
    }
    ckpt__coll_end(op->acc);
    return op->rc = rc;
}

int ckpt__save_op_snapshot(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (!enter(op, PH_SNAPSHOT) || op->rc < 0) return op->rc;
    /* As Accelerate's, the pre-hooks get the folder being written, and what
     * they leave there is saved with the checkpoint. */
    int rc = CKPT_OK;
    if (acc->hooks[HOOK_SAVE_POST] && !(op->post_dir = ckpt__strdup(op->target)))
        rc = ckpt__err_nomem("save path");
    if (rc == 0) rc = ckpt__acc_run_hooks(acc, HOOK_SAVE, op->tmp, "save_state");
    if (rc == 0) read_prev(op);
    if (rc == 0) rc = snapshot(op);
    if (rc == 0) rc = order_digest(op); /* before the plan marks what it spreads */
    if (rc == 0) rc = plan_spread(op);
    if (rc == 0) rc = check_hook_names(op);
    if (rc == 0) {
        op->slots = ckpt__calloc((size_t)op->nobjs * 2, sizeof *op->slots);
        op->written = ckpt__calloc((size_t)op->nobjs, sizeof *op->written);
        op->hf = ckpt__calloc((size_t)op->nobjs, sizeof *op->hf);
        op->nhf = ckpt__calloc((size_t)op->nobjs, sizeof *op->nhf);
        if (!op->slots || !op->written || !op->hf || !op->nhf) rc = ckpt__err_nomem("save plan");
    }
    return op->rc = rc;
}

int ckpt__save_op_agree_snapshot(save_op *op) {
    if (op->ended || op->comm->size <= 1) return op->rc;
    ckpt__coll_begin(op->acc, "save: agree on the snapshot");
    op->rc = ckpt__coll_agree(op->comm, op->rc, NULL);
    ckpt__coll_end(op->acc);
    if (op->rc < 0) op->ended = true; /* every rank knows: commit only releases */
    return op->rc;
}

/* Whether this rank writes a file of object i. */
static bool writes_object(const save_op *op, int i) {
    return op->objs[i].kind == K_RNG || op->committer || hf_writes(op, i) ||
           ckpt__writer_shard_file_needed(op->writers[i]);
}

static int write_one(save_op *op, int i) {
    if (op->rc == 0 && !op->written[i]) op->rc = write_object(op, i);
    return op->rc;
}

int ckpt__save_op_stage(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (op->phase != PH_SNAPSHOT) enter(op, PH_WRITE); /* fails the op: out of order */
    if (op->rc < 0) return op->rc;
    int n = op->nobjs;
    uint64_t limit = acc->async_staging_limit, total = 0;
    bool *staged = ckpt__calloc((size_t)(n ? n : 1), sizeof *staged);
    if (!staged) return op->rc = ckpt__err_nomem("staging plan");
    for (int i = 0; i < n; i++)
        if (writes_object(op, i))
            staged[i] =
                ckpt__save_stage_fits(limit, &total, ckpt__writer_stage_bytes(op->writers[i]));
    /* Reused from save to save (and shared with loads, which wait first). */
    int rc = ckpt__arena_reserve(&acc->arena, total);
    uint64_t off = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        if (staged[i]) off += ckpt__writer_stage(op->writers[i], acc->arena.p + off);
        else if (writes_object(op, i)) rc = write_one(op, i);
    }
    free(staged);
    if (rc < 0) ckpt__save_op_fail(op, rc);
    return op->rc;
}

int ckpt__save_op_write(save_op *op) {
    if (!enter(op, PH_WRITE)) return op->rc;
    for (int i = 0; op->rc == 0 && i < op->nobjs; i++) write_one(op, i);
    return op->rc;
}

static int commit_all(save_op *op) {
    const ckpt_comm *c = op->comm;
    char *json = NULL;
    size_t jlen = 0;
    int rc = op->rc;
    if (op->ended) {
        if (op->committer) release(op);
        return rc;
    }
    if (rc == 0) rc = record_files(op);
    if (rc == 0 && c->size > 1) rc = records_to_wire(op, &json, &jlen);
    /* agree */
    ckpt__coll_phase(op->acc, "save: agree on the commit");
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc == 0) {
        if (c->size > 1) {
            ckpt__coll_phase(op->acc, "save: gather the file records");
            rc = gather_records(op, json, jlen);
        } else {
            op->all = op->mine;
            ckpt__manifest_init(&op->mine);
        }
        /* commit, rotate */
        if (rc == 0 && op->committer) rc = commit(op);
        if (rc == 0 && op->committer) rotate(op);
        if (op->committer) release(op);
        ckpt__coll_phase(op->acc, "save: share the outcome of the commit");
        rc = ckpt__coll_share(c, rc);
    }
    if (op->committer) release(op);
    free(json);
    return op->rc = rc;
}

int ckpt__save_op_commit(save_op *op) {
    /* A failed op may end from any phase: commit then only agrees and
     * releases. A healthy one must have written. */
    if (op->rc == 0 && op->phase != PH_WRITE) enter(op, PH_COMMIT);
    op->phase = PH_COMMIT;
    ckpt__coll_begin(op->acc, "save: finish");
    int rc = commit_all(op);
    ckpt__coll_end(op->acc);
    return rc;
}

void ckpt__save_op_apply(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (!enter(op, PH_APPLY) || op->rc < 0) return;
    /* Committed, on every rank. */
    if (op->automatic && op->number + 1 > acc->iteration) acc->iteration = op->number + 1;
    free(acc->last_dir);
    acc->last_dir = op->target;
    op->target = NULL;
    free(acc->link_dir);
    acc->link_dir = ckpt__strdup(acc->last_dir); /* NULL: no linking next time, that is all */
    acc->last_save_written = op->written_bytes;
    acc->last_save_linked = op->linked_bytes;
    /* After the lock is released, so that a post-hook may save again. */
    if (op->post_dir) ckpt__acc_run_hooks(acc, HOOK_SAVE_POST, op->post_dir, "save_state");
}

void ckpt__save_op_fail(save_op *op, int rc) {
    if (op->rc == 0) op->rc = rc < 0 ? rc : CKPT_EINVAL;
}
int ckpt__save_op_status(const save_op *op) { return op->rc; }
int64_t ckpt__save_op_number(const save_op *op) { return op->automatic ? op->number : -1; }
const ckpt_logger *ckpt__save_op_logger(const save_op *op) { return &op->log; }
