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
 * a no-op, so this is exactly the single-process save. The save plan is in
 * save_spread.c, incremental linking in save_link.c, the pre-hooks' files
 * in save_extras.c; what they share in save_int.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/remote.h"
#include "accel/save_op.h"
#include "base/error.h"
#include "base/io.h"
#include "format/hfindex.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/s3/s3.h"
#include "store/store.h"
#include "store/txn.h"
#include "accel/save_int.h"

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
    /* object storage: save_remote.c */
    if (op->remote) return ckpt__save_remote_plan(op);
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
    int64_t *nums = NULL, count = 0;
    if (op->automatic) {
        int64_t taken = -1;
        char odd[512];
        rc = ckpt__list_numbers(op->parent, &nums, &count);
        if (rc == 0) rc = ckpt__names_taken(op->parent, &taken, odd, sizeof odd);
        if (rc < 0) {
            free(nums);
            return ckpt__err_prefix(rc, "save_state");
        }
        /* Past every name in use, folder or not: a commit never renames
         * over an entry, so a file or a symlink named checkpoint_<n> would
         * otherwise fail every save from then on. */
        op->number = acc->iteration;
        if (taken + 1 > op->number) op->number = taken + 1;
        if (op->tier) {
            /* Above every number of any rank's local tier too, so that a
             * number is never reused for another state; to the project
             * folder once persist_every numbers past its newest checkpoint,
             * when asked, and after a preemption signal. */
            if (op->tier_highest + 1 > op->number) op->number = op->tier_highest + 1;
            int64_t newest = count > 0 ? nums[count - 1] : -1;
            op->persist = op->persist_next || ckpt_preemption_requested() ||
                          op->number - newest >= acc->tier.persist_every;
        }
        if (odd[0] && !acc->odd_names_said) {
            acc->odd_names_said = true;
            ckpt__log(&op->log, CKPT_LOG_WARNING,
                      "save_state: in %s, %s: not checkpoint folders; numbering steps over them "
                      "and leaves them alone",
                      op->parent, odd);
        }
        if (op->link && count > 0) {
            char nm[48];
            snprintf(nm, sizeof nm, "checkpoint_%" PRId64, nums[count - 1]);
            op->prev_dir = ckpt__path_join(op->parent, nm);
        }
        op->base = ckpt__malloc(48);
        if (!op->base) {
            free(nums);
            return ckpt__err_nomem("save path");
        }
        snprintf(op->base, 48, "checkpoint_%" PRId64, op->number);
    }
    /* Before the project has a checkpoint (or for a folder of the user's):
     * the checkpoint this accelerator saved or loaded last, e.g. the one a
     * fine-tune started from. */
    if (op->link && !op->prev_dir && !op->tier && acc->link_dir && acc->link_dir[0] &&
        !ckpt__s3_is_url(acc->link_dir))
        op->prev_dir = ckpt__strdup(acc->link_dir);
    /* Only to the node-local tiers: no project folder is made. */
    if (op->tier && !op->persist) {
        free(nums);
        return CKPT_OK;
    }
    op->target = ckpt__path_join(op->parent, op->base);
    op->tname = ckpt__temp_name(op->base);
    rc = op->target && op->tname && (op->tmp = ckpt__path_join(op->parent, op->tname))
             ? ckpt__save_plan_kept(op, nums, count)
             : ckpt__err_nomem("save path");
    free(nums);
    if (rc < 0) return rc;
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
        const char *tg = op->target ? op->target : "", *tp = op->tmp ? op->tmp : "";
        size_t nt = strlen(tg), np = strlen(tp), nv = strlen(prev), nk = 0;
        char *kept = NULL;
        CKPT_TRY(ckpt__save_kept_encode(op, &kept, &nk));
        n = 24 + nt + 1 + np + 1 + nv + 1 + nk;
        blob = ckpt__malloc(n);
        if (!blob) {
            free(kept);
            return ckpt__err_nomem("save plan");
        }
        memset(blob, 0, 24);
        snprintf(blob, 24, "%" PRId64 " %d", op->number, (int)op->persist);
        memcpy(blob + 24, tg, nt + 1);
        memcpy(blob + 24 + nt + 1, tp, np + 1);
        memcpy(blob + 24 + nt + 1 + np + 1, prev, nv + 1);
        memcpy(blob + 24 + nt + 1 + np + 1 + nv + 1, kept, nk);
        free(kept);
    }
    int rc = ckpt__coll_bcast_bytes(c, &blob, &n);
    if (rc == 0 && c->rank != 0) {
        /* From rank 0 of this job, but still checked: four strings (the
         * last, the checkpoint to link from, may be empty), then the kept
         * checkpoints. */
        const char *t = blob + 24, *end = blob + n;
        const char *p = n > 24 ? memchr(t, '\0', (size_t)(end - t)) : NULL;
        const char *v = p ? memchr(p + 1, '\0', (size_t)(end - p - 1)) : NULL;
        const char *k = v ? memchr(v + 1, '\0', (size_t)(end - v - 1)) : NULL;
        if (!k || !memchr(blob, '\0', 24)) {
            rc = ckpt__err(CKPT_EINVAL, "save_state: rank 0 sent a malformed plan");
        } else {
            rc = ckpt__save_kept_decode(op, k + 1, (size_t)(end - k - 1));
            char *rest = NULL;
            op->number = strtoll(blob, &rest, 10);
            op->persist = strtol(rest, NULL, 10) != 0;
            /* empty: a save to the node-local tiers only */
            if (t[0] && !(op->target = ckpt__strdup(t))) rc = ckpt__err_nomem("save plan");
            if (p[1] && !(op->tmp = ckpt__strdup(p + 1))) rc = ckpt__err_nomem("save plan");
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

/* Writes one file of the op's rank into the temporary folder (or links
 * the previous checkpoint's identical file there), recording it in slot. */
static int write_file(save_op *op, ckpt_writer *w, const char *name, const char *kind, bool shards,
                      save_slot *slot) {
    if (op->remote) { /* into its object (save_remote.c) */
        int rc = ckpt__save_remote_file(op, w, name, shards, slot);
        if (rc == 0) {
            slot->has = true;
            slot->kind = kind;
            snprintf(slot->name, sizeof slot->name, "%s", name);
        }
        return rc;
    }
    char *path = ckpt__path_join(op->wdir, name);
    if (!path) return ckpt__err_nomem("save path");
    ckpt__file_digest_free(&slot->d);
    memset(&slot->d, 0, sizeof slot->d);
    int rc = op->link ? ckpt__save_try_link(op, w, name, shards, path, &slot->d) : 0;
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

/* The index as a file of the temporary folder, with its digest. */
static int write_text_file(save_op *op, const char *name, const char *text, save_slot *slot) {
    if (op->remote) {
        CKPT_TRY(ckpt__save_remote_text(op, name, text, slot));
        slot->has = true;
        slot->kind = ckpt__kind_name[K_MODEL];
        snprintf(slot->name, sizeof slot->name, "%s", name);
        return CKPT_OK;
    }
    char *path = ckpt__path_join(op->wdir, name);
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
        for (int64_t j = l->starts[s]; j < l->starts[s + 1] && rc == 0; j++)
            rc = ckpt__writer_put_tensor_of(part, w, l->entry[j]);
        /* a tied name in the part of its target; the index names tensors only */
        for (int64_t j = 0; j < ckpt_writer_entry_count(w) && rc == 0; j++) {
            ckpt_entry_info e;
            rc = ckpt_writer_entry(w, j, &e);
            if (rc == 0 && e.kind == CKPT_ENTRY_ALIAS && ckpt__writer_has(part, e.target))
                rc = ckpt_write_alias(part, e.key, e.target);
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

/* Who writes what: rank 0 the objects' own files, every rank its random
 * state, its Hugging Face shards of a model saved so (the plan's), and, for
 * an object it holds chunks of (the plan's share of the replicated tensors,
 * its own sharded tensors), its own shard file. */
static int write_object(save_op *op, int i) {
    const ckpt_acc_obj *o = &op->objs[i];
    char name[96];
    ckpt__acc_file_name(op->acc, o, name, sizeof name);
    int rc = 0;
    if (ckpt__save_hf_sharded(op, i)) rc = write_hf(op, i, name);
    else if (o->kind == K_RNG || op->committer)
        rc = write_file(op, op->writers[i], name, ckpt__kind_name[o->kind], false,
                        &op->slots[2 * i]);
    if (rc == 0 && ckpt__writer_shard_file_needed(op->writers[i])) {
        char shard[160];
        rc = ckpt__save_shard_name(op, i, name, shard, sizeof shard);
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
            if (op->remote) { /* the ETag of each object, for the commit */
                char **nv =
                    ckpt__realloc(op->etags_mine, (size_t)(op->netags_mine + 1) * sizeof *nv);
                if (!nv) return ckpt__err_nomem("file records");
                op->etags_mine = nv;
                if (!(nv[op->netags_mine] = ckpt__strdup(sl->etag)))
                    return ckpt__err_nomem("file records");
                op->netags_mine++;
            }
        }
    }
    return CKPT_OK;
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
            if (!ckpt__save_plan_entry(op, i, j, &rows, &nb)) continue;
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
 * NUL, its file records as JSON, a NUL, then (object storage) the ETag of
 * each of its files, one per line. */
static int records_to_wire(save_op *op, char **out, size_t *len) {
    char *json = NULL;
    size_t jlen = 0;
    CKPT_TRY(ckpt__manifest_files_to_json(&op->mine, &json, &jlen));
    size_t olen = strlen(op->order), elen = 0;
    for (int64_t i = 0; i < op->netags_mine; i++) elen += strlen(op->etags_mine[i]) + 1;
    char *w = ckpt__malloc(olen + 1 + jlen + 1 + elen);
    if (!w) {
        free(json);
        return ckpt__err_nomem("file records");
    }
    memcpy(w, op->order, olen + 1);
    memcpy(w + olen + 1, json, jlen);
    w[olen + 1 + jlen] = '\0';
    size_t at = olen + 1 + jlen + 1;
    for (int64_t i = 0; i < op->netags_mine; i++) {
        size_t n = strlen(op->etags_mine[i]);
        memcpy(w + at, op->etags_mine[i], n);
        w[at + n] = '\n';
        at += n + 1;
    }
    free(json);
    *out = w;
    *len = at;
    return CKPT_OK;
}

/* A rank's ETags (one line per file it listed, n of them) into op->etags. */
static int etags_from_wire(save_op *op, const char *p, size_t len, int64_t n, int r) {
    char **nv = ckpt__realloc(op->etags, (size_t)(op->netags + n + 1) * sizeof *nv);
    if (!nv) return ckpt__err_nomem("file records");
    op->etags = nv;
    for (int64_t i = 0; i < n; i++) {
        const char *nl = memchr(p, '\n', len);
        if (!nl || (size_t)(nl - p) >= 128)
            return ckpt__err(CKPT_EINVAL, "save_state: rank %d sent malformed object ETags", r);
        char *e = ckpt__malloc((size_t)(nl - p) + 1);
        if (!e) return ckpt__err_nomem("file records");
        memcpy(e, p, (size_t)(nl - p));
        e[nl - p] = '\0';
        op->etags[op->netags++] = e;
        len -= (size_t)(nl - p) + 1;
        p = nl + 1;
    }
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
            const char *jend = memchr(p + ol, '\0', lens[r] - ol);
            if (!jend)
                rc = ckpt__err(CKPT_EINVAL, "save_state: rank %d sent malformed file records", r);
            size_t jl = jend ? (size_t)(jend - (p + ol)) : 0;
            int64_t had = op->all.nfiles;
            if (rc == 0) rc = ckpt__manifest_files_from_json(&op->all, p + ol, jl, what);
            if (rc == 0 && op->remote)
                rc = etags_from_wire(op, jend + 1, lens[r] - ol - jl - 1, op->all.nfiles - had, r);
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
    m->format_version = op->split            ? CKPT_FORMAT_VERSION_FROZEN
                        : op->comm->size > 1 ? CKPT_FORMAT_VERSION_SPREAD
                                             : 1;
    m->nmetrics = op->nmetrics;
    memcpy(m->metrics, op->metrics, sizeof m->metrics);
    /* The ranks' chunks of each sharded tensor must tile it exactly. */
    int rc = ckpt__manifest_check_chunks(m, CKPT_EINVAL, "save_state");
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    /* object storage: the manifest PUT last (save_remote.c) */
    if (op->remote) return ckpt__save_remote_commit(op);
    CKPT_TRY(ckpt__save_add_extras(op));
    /* The manifest is the commit record: written last, after every file of
     * every rank is durable, so a folder with a valid manifest is a complete
     * checkpoint. With a node-local tier the same text goes into every
     * rank's local folder too, after the project's commit. */
    rc = ckpt__manifest_text(m, &op->mtext, &op->mlen);
    if (rc == 0 && op->tier && op->persist) rc = ckpt__tier_persist_extras(op);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state: %s", op->target);
    if (op->tier && !op->persist) return CKPT_OK;
    rc = ckpt__manifest_publish(op->mtext, op->mlen, op->tmp);
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

/* The rotation's hand-over of a folder to delete later (ckpt_rotate_opts). */
static void keep_trash(void *user, char *hidden) {
    save_op *op = user;
    if (op->ntrash == op->trash_cap) {
        int cap = op->trash_cap ? 2 * op->trash_cap : 4;
        char **t = ckpt__realloc(op->trash, (size_t)cap * sizeof *t);
        if (!t) { /* no room to remember it: delete it now */
            if (ckpt__remove_tree(hidden) < 0)
                ckpt__log(&op->log, CKPT_LOG_WARNING, "could not remove %s: %s", hidden,
                          ckpt_errmsg());
            free(hidden);
            return;
        }
        op->trash = t;
        op->trash_cap = cap;
    }
    op->trash[op->ntrash++] = hidden;
}

/* Rotation only after the commit: the newest checkpoint is never at risk. A
 * failure here leaves an extra old checkpoint, not a failed save. The
 * checkpoint just committed is not read again to count it valid: this save
 * hashed every byte of it (store.h, ckpt_rotate_opts). */
static void rotate(save_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (!op->automatic || op->remote ||
        (acc->total_limit <= 0 && !ckpt__retention_active(&acc->retention)))
        return; /* object storage: rotated by the commit (save_remote.c) */
    int64_t removed = 0;
    ckpt_rotate_opts o = {
        .fresh = op->number, .defer = op->defer_removal ? keep_trash : NULL, .user = op};
    if (ckpt__rotate(op->parent, acc->total_limit, &acc->retention, &op->log, &o, &removed) < 0)
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
    free(op->frozen_apart);
    free(op->writers);
    free(op->objs);
    ckpt__manifest_clear(&op->mine);
    ckpt__manifest_clear(&op->all);
    if (op->have_prev) ckpt__manifest_clear(&op->prev);
    ckpt__tier_release(op);
    ckpt__save_kept_free(op);
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
    ckpt__save_remote_free(op);
    for (int i = 0; i < op->ntrash; i++) { /* never taken: deleted now */
        if (ckpt__remove_tree(op->trash[i]) < 0) ckpt_clear_error();
        free(op->trash[i]);
    }
    free(op->trash);
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
    acc->objects_live = true; /* later loads are transactional (load.c) */
    op->step = ckpt__acc_save_step(acc);
    op->iteration = acc->iteration;
    op->automatic = output_dir == NULL;
    op->committer = acc->comm->rank == 0;
    op->number = -1;
    op->lk.fd = -1;
    op->link = !acc->no_link_unchanged;
    op->tier = output_dir == NULL && ckpt__tier_on(&acc->tier);
    op->persist_next = op->tier && acc->tier.persist_next;
    if (op->tier) acc->tier.persist_next = false; /* this save's (back if it fails) */
    op->tier_highest = -1;
    op->link_copies = acc->link_copies;
    op->remote = output_dir ? ckpt__s3_is_url(output_dir) : acc->remote != NULL;
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
        if (op->rc == 0 && op->tier) op->rc = ckpt__tier_plan(op, op->rc);
        if (op->rc == 0) op->rc = plan_local(op, op->output_dir);
        if (op->rc == 0) op->wdir = op->tmp;
        if (op->rc == 0 && op->tier) op->rc = ckpt__tier_open(op);
        if (op->rc == 0 && op->remote) op->rc = ckpt__save_remote_open(op);
        return op->rc;
    }
    ckpt__coll_begin(op->acc, "save: share the plan");
    int rc = op->rc;
    if (op->tier) {
        rc = ckpt__tier_plan(op, rc);
        if (rc < 0) { /* agreed: every rank knows */
            op->ended = true;
            ckpt__coll_end(op->acc);
            return op->rc = rc;
        }
    }
    if (op->committer && rc == 0) rc = plan_local(op, op->output_dir);
    int prc = ckpt__coll_share(c, op->committer ? rc : CKPT_OK);
    if (prc < 0) { /* every rank knows: no agreement follows */
        op->ended = true;
        rc = prc;
    } else {
        int src = plan_share(op);
        if (rc == 0) rc = src;
        op->wdir = op->tmp;
        if (rc == 0 && op->tier) rc = ckpt__tier_open(op);
        if (rc == 0 && op->remote) rc = ckpt__save_remote_open(op);
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
    if (rc == 0) rc = ckpt__acc_run_hooks(acc, HOOK_SAVE, op->wdir, "save_state");
    if (rc == 0 && op->remote) ckpt__save_remote_read_prev(op);
    else if (rc == 0) ckpt__save_read_prev(op);
    if (rc == 0) rc = snapshot(op);
    if (rc == 0) rc = order_digest(op); /* before the plan marks what it spreads */
    if (rc == 0) rc = ckpt__save_plan_spread(op);
    if (rc == 0) rc = ckpt__save_check_hook_names(op);
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
    return op->objs[i].kind == K_RNG || op->committer || ckpt__save_hf_writes(op, i) ||
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
    if (rc == 0 && total > 0) acc->arena_staging = true;
    uint64_t off = 0;
    for (int i = 0; rc == 0 && i < n; i++) {
        uint64_t used = 0;
        if (staged[i]) rc = ckpt__writer_stage(op->writers[i], acc->arena.p + off, &used);
        else if (writes_object(op, i)) rc = write_one(op, i);
        off += used;
    }
    free(staged);
    if (rc < 0) ckpt__save_op_fail(op, rc);
    return op->rc;
}

int ckpt__save_op_write(save_op *op) {
    if (!enter(op, PH_WRITE)) return op->rc;
    for (int i = 0; op->rc == 0 && i < op->nobjs; i++) write_one(op, i);
    /* a tier's persisted save: this rank's part into the project folder too */
    if (op->rc == 0 && op->tier && op->persist) op->rc = ckpt__tier_persist(op);
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
    if (rc == 0 && c->size > 1) {
        ckpt__coll_phase(op->acc, "save: gather the file records");
        /* a rank whose records did not reach rank 0 (or rank 0 that could
         * not read them) stops the commit on every rank */
        rc = ckpt__coll_agree(c, gather_records(op, json, jlen), NULL);
    } else if (rc == 0) {
        op->all = op->mine;
        ckpt__manifest_init(&op->mine);
        op->etags = op->etags_mine;
        op->netags = op->netags_mine;
        op->etags_mine = NULL;
        op->netags_mine = 0;
    }
    if (rc == 0) {
        /* commit, rotate */
        if (op->committer) rc = commit(op);
        if (rc == 0 && op->committer && (!op->tier || op->persist)) rotate(op);
        if (op->committer) release(op);
        ckpt__coll_phase(op->acc, "save: share the outcome of the commit");
        rc = ckpt__coll_share(c, rc);
        /* object storage: a number lost to another writer moved the commit */
        if (rc == 0 && op->remote) rc = ckpt__save_remote_share_number(op);
        /* the node-local tiers: replicas, every rank's local commit */
        if (op->tier) rc = ckpt__tier_finish(op, rc);
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
    /* NULL: no linking next time, that is all (a URL: copies, in its bucket) */
    acc->link_dir = ckpt__strdup(acc->last_dir);
    acc->last_save_written = op->written_bytes;
    acc->last_save_linked = op->linked_bytes;
    /* After the lock is released, so that a post-hook may save again. In
     * object storage the folder is the checkpoint's URL (the number the
     * commit used). */
    if (op->post_dir && op->remote && acc->last_dir) {
        char *u = ckpt__strdup(acc->last_dir);
        if (u) {
            free(op->post_dir);
            op->post_dir = u;
        }
    }
    if (op->post_dir) ckpt__acc_run_hooks(acc, HOOK_SAVE_POST, op->post_dir, "save_state");
}

void ckpt__save_op_defer_removal(save_op *op) { op->defer_removal = true; }

char **ckpt__save_op_take_trash(save_op *op, int *n) {
    char **t = op->trash;
    *n = op->ntrash;
    op->trash = NULL;
    op->ntrash = op->trash_cap = 0;
    return t;
}

void ckpt__save_op_fail(save_op *op, int rc) {
    if (op->rc == 0) op->rc = rc < 0 ? rc : CKPT_EINVAL;
}
int ckpt__save_op_status(const save_op *op) { return op->rc; }
int64_t ckpt__save_op_number(const save_op *op) { return op->automatic ? op->number : -1; }
const ckpt_logger *ckpt__save_op_logger(const save_op *op) { return &op->log; }
