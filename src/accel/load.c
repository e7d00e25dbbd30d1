/* load.c — ckpt_load_state as a load op driven through its phases
 * (load_op.h), the mirror of the save op (save.c): the op's life and
 * order, the choice of the checkpoint, the read plan, the read, the
 * agreements, the outcome and the report. What the check and apply phases
 * do to each object is in load_objects.c, how the files' bytes reach the
 * ranks that need them in load_stream.c. The same for one process and for
 * many: every rank returns the same status and message. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/load_held.h"
#include "accel/load_int.h"
#include "accel/load_op.h"
#include "accel/remote.h"
#include "base/error.h"
#include "base/io.h"
#include "format/keymap.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/store.h"

/* ---- the op's order -------------------------------------------------------- */

enum { PH_NEW, PH_CHOOSE, PH_PLAN, PH_READ, PH_CHECK, PH_AGREE, PH_APPLY, PH_FINISH };
static const char *const phase_name[] = {"new",   "choose", "plan",  "read",
                                         "check", "agree",  "apply", "finish"};

/* Records this rank's failure (the first one is kept); agreed: every rank
 * holds the same. */
static int fail(ckpt__load_op *op, int rc, bool agreed) {
    if (rc < 0 && op->rc == 0) op->rc = rc;
    if (rc < 0) op->agreed = agreed;
    return op->rc;
}

/* Whether phase ph runs now. Out of order (in_order false) the op fails,
 * alike on every rank (every rank drives the same way), and the phase does
 * nothing; after an agreed failure it does nothing either. */
static bool enter(ckpt__load_op *op, int ph, bool in_order) {
    if (!in_order) {
        if (op->rc == 0) /* else the first failure stays, with its message */
            op->rc = ckpt__err(CKPT_EINVAL,
                               "%s: the load's %s phase was called after its %s phase "
                               "(out of order): nothing is loaded",
                               op->what, phase_name[ph], phase_name[op->phase]);
        op->agreed = true;
        op->phase = ph;
        return false;
    }
    op->phase = ph;
    return !(op->rc < 0 && op->agreed);
}

/* The deadline's phase name (ckpt__coll_phase) when there is an accelerator. */
static void name_phase(ckpt__load_op *op, const char *phase) {
    if (op->acc) ckpt__coll_phase(op->acc, phase);
}

/* ---- new ------------------------------------------------------------------- */

int ckpt__load_op_new(ckpt_accelerator *acc, const char *input_dir, const ckpt_load_options *opt,
                      ckpt_load_report *report, ckpt__load_op **out) {
    if (report) memset(report, 0, sizeof *report);
    *out = NULL;
    if (!acc) return ckpt__err(CKPT_EINVAL, "load_state: acc is NULL");
    ckpt__load_op *op = ckpt__calloc(1, sizeof *op);
    if (!op) return ckpt__err_nomem("load");
    *out = op;
    op->acc = acc;
    op->comm = acc->comm;
    op->what = "load_state";
    op->opt = opt;
    op->report = report;
    op->phase = PH_NEW;
    ckpt__load_held_reset();
    /* object storage: the files are read into the load's buffers as they
     * arrive (ranged GETs), verified there: neither one pass nor the
     * streamed default load applies */
    op->remote = ckpt__load_is_remote(acc, input_dir);
    bool plain = op->comm->size <= 1 && !op->remote &&
                 (!opt || (!opt->non_strict && !opt->convert_dtypes && opt->num_prefix_map == 0 &&
                           !opt->rename));
    /* The first load of an accelerator (no save yet, no load applied) is
     * the resume: the objects hold only their initial values, so it reads
     * each file once, verified as it lands, and an older checkpoint is
     * loaded over them if the newest turns out damaged (the driver below).
     * Any later load verifies everything before it changes anything. */
    bool first = !acc->objects_live && !(opt && opt->transactional);
    op->one_pass = plain && ((opt && opt->one_pass) || first);
    op->stream = plain && !op->one_pass;
    ckpt__coll_begin(acc, "load: agree on the options");
    op->in_op = true;
    int rc = opt && opt->one_pass && opt->transactional
                 ? ckpt__err(CKPT_EINVAL, "load_state: options one_pass and transactional "
                                          "contradict each other: set one of them")
                 : ckpt__load_select(op);
    if (rc == 0 && input_dir && !(op->input_dir = ckpt__strdup(input_dir)))
        rc = ckpt__err_nomem("load path");
    /* Bad options change nothing, not even the refusal of saves. */
    rc = ckpt__coll_agree(op->comm, rc, NULL);
    op->bad_options = rc < 0;
    return fail(op, rc, true);
}

int ckpt__load_op_new_object(int kind, const ckpt_stateful_ops *ops, void *self,
                             const ckpt_load_options *opt, ckpt_load_report *report,
                             const char *what, ckpt__load_op **out) {
    if (report) memset(report, 0, sizeof *report);
    *out = NULL;
    ckpt__load_op *op = ckpt__calloc(1, sizeof *op);
    if (!op) return ckpt__err_nomem(what);
    *out = op;
    op->comm = ckpt_comm_self();
    op->what = what;
    op->opt = opt;
    op->report = report;
    op->phase = PH_NEW;
    op->nobjs = 1;
    op->objs = ckpt__calloc(1, sizeof *op->objs);
    op->sel = ckpt__calloc(1, sizeof *op->sel);
    op->readers = ckpt__calloc(1, sizeof *op->readers);
    op->srcs = ckpt__calloc(1, sizeof *op->srcs);
    op->extra = ckpt__calloc(1, sizeof *op->extra);
    if (!op->objs || !op->sel || !op->readers || !op->srcs || !op->extra)
        return fail(op, ckpt__err_nomem(what), true);
    op->objs[0] = (ckpt_acc_obj){.kind = kind, .index = 0, .ops = ops, .self = self};
    op->sel[0] = true;
    return CKPT_OK;
}

/* ---- choose ---------------------------------------------------------------- */

/* A bad checkpoint, skipped for an older one; anything else (memory, I/O on
 * some rank) must not silently load an older state. */
static bool can_fall_back(int rc) {
    return rc == CKPT_ECORRUPT || rc == CKPT_EUNSUPPORTED || rc == CKPT_ENOENT;
}
static bool is_fatal(int rc) { return !can_fall_back(rc); }

/* Rank 0's list of checkpoint numbers, ascending, on every rank. */
static int list_candidates(ckpt__load_op *op, const char *cdir, int64_t **nums, int64_t *count) {
    const ckpt_comm *c = op->comm;
    int rc = 0;
    if (c->rank == 0) {
        rc = op->remote ? ckpt__load_remote_numbers(op, nums, count)
                        : ckpt__list_numbers(cdir, nums, count);
        if (rc == 0 && *count == 0)
            rc = ckpt__err(CKPT_ENOENT, "load_state: no checkpoint in %s", cdir);
    }
    if (c->size > 1) rc = ckpt__coll_share(c, rc);
    /* The one way this fails with CKPT_ENOENT (a missing folder lists as
     * empty). */
    if (rc == CKPT_ENOENT) op->nothing = true;
    if (c->size <= 1 || rc < 0) return rc;
    char *blob = (char *)*nums;
    size_t n = c->rank == 0 ? (size_t)*count * sizeof **nums : 0;
    CKPT_TRY(ckpt__coll_bcast_bytes(c, &blob, &n));
    if (c->rank != 0) {
        *nums = (int64_t *)(void *)blob;
        *count = (int64_t)(n / sizeof **nums);
    }
    return CKPT_OK;
}

/* The warning for a checkpoint skipped by load_state(NULL): the message
 * usually starts with the folder already. */
static void warn_skipped(ckpt_accelerator *acc, const char *dir, const char *msg, bool older) {
    size_t n = strlen(dir);
    bool named = strncmp(msg, dir, n) == 0 && msg[n] == ':';
    ckpt__log(&acc->log, CKPT_LOG_WARNING, "skipping %s%s%s%s", named ? "" : dir, named ? "" : ": ",
              msg, older ? "; falling back to an older checkpoint" : "");
}

/* An explicit folder that is not there or is not a checkpoint: CKPT_EINVAL,
 * never the CKPT_ENOENT of a fresh start (a typo in a resume path must not
 * let the run start over and rotate its checkpoints away). */
static int not_a_checkpoint(const ckpt__load_op *op, const char *what) {
    char near[1024] = ""; /* (a bucket's are not listed here) */
    if (!op->remote) ckpt__checkpoints_near(op->input_dir, op->acc->project_dir, near, sizeof near);
    return ckpt__err(CKPT_EINVAL,
                     "load_state: %s: %s%s; an explicit input_dir must be a checkpoint "
                     "(NULL loads the project's newest valid one)",
                     op->input_dir, what, near);
}

/* The first choice: a pending asynchronous save ends, rank 0 takes the
 * project lock (collective), and the candidates are found: the caller's
 * folder (CKPT_EINVAL naming the checkpoints there are if it is not a
 * folder; this rank's alone, agreed on by read), or the project's
 * checkpoints (rank 0's list on every rank). */
static int find_candidates(ckpt__load_op *op) {
    ckpt_accelerator *acc = op->acc;
    /* A pending asynchronous save ends first (its failure, if any, is kept
     * for the next wait or save). */
    ckpt__async_settle(acc, false);
    /* One run per project: rank 0 owns it from the first save or load on. */
    ckpt__coll_phase(acc, "load: take the project lock");
    int rc = op->comm->rank == 0 ? ckpt__acc_own_project(acc, false, "load_state") : 0;
    rc = ckpt__coll_agree(op->comm, rc, NULL);
    if (rc < 0) return fail(op, rc, true);
    ckpt__coll_phase(acc, "load: choose the checkpoint");
    if (op->input_dir) {
        const char *in = op->input_dir;
        struct stat st;
        int src = in[0] && !op->remote ? ckpt__os_stat(in, &st) : 0;
        if (!in[0]) rc = ckpt__err(CKPT_EINVAL, "load_state: input_dir is empty");
        else if (op->remote) /* a URL: its manifest says (plan) */
            rc = (op->dir = ckpt__strdup(in)) ? 0 : ckpt__err_nomem("load path");
        else if (src != 0 && (errno == ENOENT || errno == ENOTDIR))
            rc = not_a_checkpoint(op, "no such checkpoint folder");
        else if (src == 0 && !S_ISDIR(st.st_mode)) rc = not_a_checkpoint(op, "not a folder");
        else if (!(op->dir = ckpt__strdup(in))) rc = ckpt__err_nomem("load path");
        return fail(op, rc, false);
    }
    if (!acc->project_dir)
        return fail(op,
                    ckpt__err(CKPT_EINVAL, "load_state: no input folder given and no project_dir"),
                    true);
    if (op->remote) { /* the bucket's: s3://bucket/prefix/checkpoints */
        const char *u = ckpt__acc_remote_url(acc);
        if ((op->cdir = ckpt__malloc(strlen(u) + 16))) sprintf(op->cdir, "%s/checkpoints", u);
    } else {
        op->cdir = ckpt__checkpoints_dir(acc->project_dir);
    }
    if (!op->cdir) return fail(op, ckpt__err_nomem("load path"), true);
    /* With a node-local tier: the newest save whose every part is on some
     * node, if the project folder has nothing newer (tier_load.c). */
    if (ckpt__tier_on(&acc->tier)) {
        ckpt__coll_phase(acc, "load: choose among the node-local tiers");
        rc = ckpt__tier_choose(acc, &op->tpick);
        if (rc < 0) return fail(op, rc, true);
        if (op->tpick.use) {
            op->tier = true;
            op->dir = ckpt__tier_folder(&acc->tier, op->tpick.number);
            rc = ckpt__coll_agree(op->comm, op->dir ? CKPT_OK : ckpt__err_nomem("load path"), NULL);
            return fail(op, rc, true);
        }
        ckpt__coll_phase(acc, "load: choose the checkpoint");
    }
    rc = list_candidates(op, op->cdir, &op->nums, &op->ncand);
    /* a retry after a one-pass load found a candidate damaged: the older
     * ones only */
    while (rc == 0 && op->below > 0 && op->ncand > 0 && op->nums[op->ncand - 1] >= op->below)
        op->ncand--;
    if (rc == 0 && op->ncand == 0)
        rc = ckpt__err(CKPT_ECORRUPT,
                       "load_state: no checkpoint older than checkpoint_%" PRId64 " is left in %s",
                       op->below, op->cdir);
    op->next = op->ncand - 1;
    return fail(op, rc, true);
}

int ckpt__load_op_choose(ckpt__load_op *op) {
    bool first = op->phase == PH_NEW;
    if (!enter(op, PH_CHOOSE, first || op->retry)) return op->rc;
    op->retry = false;
    if (first && find_candidates(op) < 0) return op->rc;
    if (op->input_dir || op->tier) return op->rc;
    if (op->tier_fallback) { /* the tiers' save failed: the project's checkpoints */
        op->tier_fallback = false;
        ckpt__coll_phase(op->acc, "load: choose the checkpoint");
        int rc = list_candidates(op, op->cdir, &op->nums, &op->ncand);
        op->next = op->ncand - 1;
        if (fail(op, rc, true) < 0) return op->rc;
    }
    /* The next candidate, newest first (read never asks past the oldest). */
    char name[48];
    snprintf(name, sizeof name, "checkpoint_%" PRId64, op->nums[op->next--]);
    op->dir = ckpt__path_join(op->cdir, name);
    return fail(op, op->dir ? CKPT_OK : ckpt__err_nomem("load path"), false);
}

/* ---- plan ------------------------------------------------------------------ */

typedef struct sized {
    uint64_t size;
    int64_t index;
} sized;

static int cmp_sized_desc(const void *a, const void *b) {
    const sized *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? 1 : -1;
    return (x->index > y->index) - (x->index < y->index);
}

/* The rank that wrote f, where the manifest says: a process's shard file
 * by its number, any file by its "rank" from format version 2 on; -1 if
 * unknown. */
static int own_reader(const ckpt_manifest *m, const ckpt_manifest_file *f, int saved_np) {
    int index = 0, count = 0;
    if (f->chunks && ckpt__shard_file_parse(f->name, NULL, &index, &count) && count == saved_np)
        return index - 1;
    if (m->format_version >= CKPT_FORMAT_VERSION_SPREAD) return f->rank;
    return -1;
}

/* The read plan of many processes, the same on every rank (a function of
 * the manifest): each file is read and verified by one rank only. A rank's
 * own generator file is read by that rank (or, for another process count,
 * rank 0's by rank 0 for all). With as many processes as the save had, each
 * rank reads the files it wrote; otherwise the files, largest first, each go
 * to the rank with the fewest bytes so far (ties: the lowest rank). Their
 * bytes then reach the ranks that need them through the communicator
 * (share_files). Files a save pre-hook left (kind "extra") are verified,
 * not sent. */
static int plan_reads(ckpt__load_op *op) {
    const ckpt_manifest *m = &op->c.m;
    int64_t n = m->nfiles;
    int q = op->comm->size;
    free(op->reader);
    free(op->shared);
    op->reader = ckpt__malloc((size_t)(n ? n : 1) * sizeof *op->reader);
    op->shared = ckpt__calloc((size_t)(n ? n : 1), sizeof *op->shared);
    sized *v = ckpt__calloc((size_t)(n ? n : 1), sizeof *v);
    uint64_t *load = ckpt__calloc((size_t)q, sizeof *load);
    if (!op->reader || !op->shared || !v || !load) {
        free(v);
        free(load);
        free(op->reader);
        free(op->shared);
        op->reader = NULL;
        op->shared = NULL;
        return ckpt__err_nomem("load plan");
    }
    int saved_np = m->num_processes > 0 ? m->num_processes : 1;
    bool reshard = saved_np != op->acc->num_processes;
    char mine[96];
    ckpt_acc_obj rng = {.kind = K_RNG};
    ckpt__load_file_name(op, &rng, mine, sizeof mine);
    int64_t nv = 0;
    for (int64_t j = 0; j < n; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        op->reader[j] = -1;
        if (strcmp(f->kind, ckpt__kind_name[K_RNG]) == 0) {
            /* Rank 0's generator is what every rank continues from when
             * the checkpoint was saved by another number of processes. */
            if (reshard && strcmp(f->name, "random_states_0.safetensors") == 0) {
                op->reader[j] = 0;
                op->shared[j] = true;
            } else if (!reshard && strcmp(f->name, mine) == 0) {
                op->reader[j] = op->comm->rank;
            }
            continue;
        }
        /* The same number of processes as at the save: each rank reads
         * the files it wrote (the save spread them by bytes), its own shard
         * files first of all. */
        int own = reshard ? -1 : own_reader(m, f, saved_np);
        if (own >= 0 && own < q) {
            op->reader[j] = own;
            op->shared[j] = strcmp(f->kind, "extra") != 0;
            load[own] += f->size;
            continue;
        }
        v[nv++] = (sized){f->size, j};
    }
    qsort(v, (size_t)nv, sizeof *v, cmp_sized_desc);
    for (int64_t k = 0; k < nv; k++) {
        int best = 0;
        for (int r = 1; r < q; r++)
            if (load[r] < load[best]) best = r;
        load[best] += v[k].size;
        op->reader[v[k].index] = best;
        op->shared[v[k].index] = strcmp(m->files[v[k].index].kind, "extra") != 0;
    }
    free(v);
    free(load);
    return CKPT_OK;
}

/* Whether every file of the opened checkpoint can be verified in one pass:
 * plain files (no Hugging Face index, no shard files of several
 * processes), each tensor with its digest in the manifest. */
static bool one_pass_fits(const ckpt_manifest *m) {
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        size_t n = strlen(f->name);
        if (f->chunks || (n > 11 && strcmp(f->name + n - 11, ".index.json") == 0)) return false;
        if (f->ntensors > 0 && (!f->tensor_keys || !f->tensor_xxh3)) return false;
    }
    return true;
}

int ckpt__load_op_plan(ckpt__load_op *op) {
    if (!enter(op, PH_PLAN, op->phase == PH_CHOOSE) || op->rc < 0) return op->rc;
    if (op->tier) return op->rc; /* the manifest comes with the parts (read) */
    free(op->reader);
    free(op->shared);
    op->reader = NULL;
    op->shared = NULL;
    int rc = op->remote ? ckpt__load_remote_manifest(op)
                        : ckpt__checkpoint_open_manifest(op->dir, &op->c);
    /* One pass, or verified and then streamed, where every file fits it
     * (else this checkpoint: the two passes). */
    bool fits = rc == 0 && one_pass_fits(&op->c.m);
    if (op->one_pass && !fits) op->one_pass = false;
    if (op->stream && !fits) op->stream = false;
    if (rc == 0 && op->comm->size > 1) rc = plan_reads(op);
    if (rc == CKPT_ENOENT && op->input_dir && op->c.no_manifest)
        rc = not_a_checkpoint(op, "not a checkpoint (no checkpoint.json)");
    else if (rc < 0 && op->input_dir) rc = ckpt__err_prefix(rc, "load_state");
    return fail(op, rc, false);
}

/* ---- read ------------------------------------------------------------------ */

/* The checkpoint's files leave memory: what load_held.h counts drops. */
static void close_checkpoint(ckpt__load_op *op) {
    ckpt__load_held_sub(op->held);
    op->held = 0;
    ckpt__load_stream_free(op);
    ckpt__checkpoint_close(&op->c);
}

/* This rank's files of the candidate: one pass, every file's size now (the
 * checksums as the objects read, ckpt__reader_open_verified); else read
 * once, hashed on the way, into the accelerator's reusable area, with
 * several processes only the files the plan gives this rank (the others'
 * presence and size checked). */
static int read_files(ckpt__load_op *op) {
    if (op->one_pass || op->stream) {
        /* Every byte hashed now when streamed (damage is found before
         * anything changes, and the load can fall back), none kept. One
         * pass: the files a save pre-hook added (kind "extra"), which no
         * object reads and the load hooks may, are hashed now; the others
         * as the objects read them. */
        bool *shallow = NULL;
        int64_t n = op->c.m.nfiles;
        if (op->one_pass && !(shallow = ckpt__calloc((size_t)(n ? n : 1), sizeof *shallow)))
            return ckpt__err_nomem("checkpoint check");
        for (int64_t j = 0; shallow && j < n; j++)
            shallow[j] = strcmp(op->c.m.files[j].kind, "extra") != 0;
        int rc = ckpt__checkpoint_read_files(op->dir, true, false, shallow, NULL, &op->c);
        free(shallow);
        if (rc < 0 && op->input_dir) rc = ckpt__err_prefix(rc, "load_state");
        return rc;
    }
    bool many = op->comm->size > 1;
    int64_t n = op->c.m.nfiles;
    bool *shallow = NULL;
    if (many && !(shallow = ckpt__calloc((size_t)(n ? n : 1), sizeof *shallow)))
        return ckpt__err_nomem("checkpoint check");
    /* object storage: every rank reads the pre-hooks' files (its hooks find
     * them in a local folder of its own) */
    for (int64_t j = 0; many && j < n; j++)
        shallow[j] = op->reader[j] != op->comm->rank &&
                     !(op->remote && strcmp(op->c.m.files[j].kind, "extra") == 0);
    int rc = op->remote ? ckpt__load_remote_read(op, shallow)
                        : ckpt__checkpoint_read_files(op->dir, true, true, shallow, &op->acc->arena,
                                                      &op->c);
    free(shallow);
    for (int64_t j = 0; op->c.have_manifest && op->c.maps && j < n; j++)
        if (!many || op->reader[j] == op->comm->rank) op->held += op->c.m.files[j].size;
    ckpt__load_held_add(op->held);
    if (rc < 0 && op->input_dir) rc = ckpt__err_prefix(rc, "load_state");
    return rc;
}

/* The tiers' save: the manifest and this rank's part, from its own folder
 * or another rank's (tier_load.c), then the read plan of the same number of
 * processes (each rank holds the files it wrote) and the files shared as
 * for the project's. If the parts cannot be had whole and verified, the
 * project's checkpoints are tried instead, with one line saying why. */
static int read_tier(ckpt__load_op *op) {
    ckpt_accelerator *acc = op->acc;
    ckpt__coll_phase(acc, "load: move parts between nodes");
    op->one_pass = false; /* the parts arrive verified whole */
    uint64_t held = 0;
    char *dir = NULL;
    int rc = ckpt__tier_fetch(acc, &op->tpick, &op->c, &dir, &held);
    if (rc == 0) {
        free(op->dir);
        op->dir = dir;
        op->held += held;
        ckpt__load_held_add(held);
        ckpt__tier_adopt(acc, &op->tpick, &op->c);
        if (op->comm->size > 1) rc = ckpt__coll_agree(op->comm, plan_reads(op), NULL);
        if (rc == 0) rc = ckpt__coll_agree(op->comm, ckpt__load_share_files(op), NULL);
        if (rc < 0) rc = ckpt__err_prefix(rc, "load_state");
        return fail(op, rc, true);
    }
    if (op->comm->rank == 0)
        ckpt__log(&acc->log, CKPT_LOG_WARNING,
                  "load_state: node-local tiers: checkpoint_%" PRId64
                  ": %s; loading from the project folder %s",
                  op->tpick.number, ckpt_errmsg(), acc->project_dir);
    close_checkpoint(op);
    free(op->dir);
    op->dir = NULL;
    op->tier = false;
    op->tier_fallback = true;
    op->retry = true;
    return CKPT__LOAD_NEXT;
}

int ckpt__load_op_read(ckpt__load_op *op) {
    if (!enter(op, PH_READ, op->phase == PH_PLAN)) return op->rc;
    if (op->tier) return read_tier(op); /* its choice was agreed: op->rc is 0 here */
    int rc = op->rc < 0 ? op->rc : read_files(op);
    op->rc = 0; /* agreed on now */
    if (op->input_dir) {
        /* The caller's folder: no such folder, or not a checkpoint (no
         * manifest), failed already (CKPT_EINVAL, never a fresh start). */
        rc = ckpt__coll_agree(op->comm, rc, NULL);
        if (rc == 0) rc = ckpt__coll_agree(op->comm, ckpt__load_share_files(op), NULL);
        return fail(op, rc, true);
    }
    /* A corrupt candidate is skipped by every rank alike; anything else
     * (memory, I/O on some rank) stops the load. */
    int orc = ckpt__coll_agree(op->comm, rc, is_fatal);
    if (orc == 0) {
        rc = ckpt__coll_agree(op->comm, ckpt__load_share_files(op), NULL);
        if (rc < 0) rc = ckpt__err_prefix(rc, "load_state");
        return fail(op, rc, true);
    }
    if (!can_fall_back(orc)) return fail(op, ckpt__err_prefix(orc, "load_state"), true);
    bool older = op->next >= 0;
    if (op->comm->rank == 0) warn_skipped(op->acc, op->dir, ckpt_errmsg(), older);
    size_t used = strlen(op->why);
    snprintf(op->why + used, sizeof op->why - used, "%s%s", used ? "; " : "", ckpt_errmsg());
    close_checkpoint(op);
    free(op->dir);
    op->dir = NULL;
    if (!older)
        return fail(op,
                    ckpt__err(CKPT_ECORRUPT, "load_state: no valid checkpoint in %s: %s", op->cdir,
                              op->why),
                    true);
    op->retry = true;
    return CKPT__LOAD_NEXT;
}

int ckpt__load_op_read_from(ckpt__load_op *op, const char *name, int64_t step, ckpt_reader *r) {
    if (!enter(op, PH_READ, op->phase == PH_NEW && !op->acc)) {
        ckpt_reader_free(r);
        return op->rc;
    }
    op->readers[0] = r;
    op->external = true;
    op->external_step = step;
    op->dir = ckpt__strdup(name);
    return fail(op, op->dir ? CKPT_OK : ckpt__err_nomem(op->what), true);
}

/* ---- check, agree ---------------------------------------------------------- */

static int names_of(const ckpt__load_op *op, bool selected, char ***out, int *n) {
    *out = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof **out);
    if (!*out) return ckpt__err_nomem("load report");
    char name[96];
    *n = 0;
    for (int i = 0; i < op->nobjs; i++) {
        if (op->sel[i] != selected) continue;
        ckpt__load_object_name(op, &op->objs[i], name, sizeof name);
        if (!((*out)[*n] = ckpt__strdup(name))) return ckpt__err_nomem("load report");
        (*n)++;
    }
    return CKPT_OK;
}

/* After a success: what was loaded. The key lists move from op. */
static int fill_report(ckpt__load_op *op, ckpt_load_report *r) {
    r->step = op->external ? op->external_step : op->c.m.step;
    r->full = op->full;
    if (!(r->dir = ckpt__strdup(op->dir))) return ckpt__err_nomem("load report");
    CKPT_TRY(names_of(op, true, &r->loaded, &r->num_loaded));
    CKPT_TRY(names_of(op, false, &r->skipped, &r->num_skipped));
    r->missing = op->res.missing.v;
    r->num_missing = op->res.missing.n;
    r->unexpected = op->res.unexpected.v;
    r->num_unexpected = op->res.unexpected.n;
    r->renamed = op->res.renamed.v;
    r->num_renamed = op->res.renamed.n;
    r->converted = op->res.converted.v;
    r->num_converted = op->res.converted.n;
    memset(&op->res, 0, sizeof op->res);
    return CKPT_OK;
}

/* Every key the adaptation changed or could not match, at INFO (missing
 * and unexpected keys at WARNING: nothing is silent). */
static void log_adaptation(ckpt__load_op *op, const ckpt_load_report *r) {
    const ckpt_adapt_result *a = &op->res;
    ckpt_adapt_result view; /* the lists moved to the report */
    if (r) {
        view.missing = (ckpt_key_list){r->missing, r->num_missing, r->num_missing};
        view.unexpected = (ckpt_key_list){r->unexpected, r->num_unexpected, r->num_unexpected};
        view.renamed = (ckpt_key_list){r->renamed, r->num_renamed, r->num_renamed};
        view.converted = (ckpt_key_list){r->converted, r->num_converted, r->num_converted};
        a = &view;
    }
    if (!op->acc || op->comm->rank != 0) return; /* a load without one logs nothing */
    const ckpt_logger *log = &op->acc->log;
    for (int64_t i = 0; i < a->missing.n; i++)
        ckpt__log(log, CKPT_LOG_WARNING,
                  "%s: %s: key '%s' missing in the checkpoint: kept its value", op->dir,
                  a->missing.v[i].object, a->missing.v[i].key);
    for (int64_t i = 0; i < a->unexpected.n; i++)
        ckpt__log(log, CKPT_LOG_WARNING, "%s: %s: key '%s' in the checkpoint is used by nothing",
                  op->dir, a->unexpected.v[i].object, a->unexpected.v[i].file_key);
    if (a->converted.n)
        ckpt__log(log, CKPT_LOG_INFO, "%s: %" PRId64 " tensor%s converted (first: '%s' %s to %s)",
                  op->dir, a->converted.n, a->converted.n == 1 ? "" : "s", a->converted.v[0].key,
                  ckpt_dtype_name(a->converted.v[0].file_dtype),
                  ckpt_dtype_name(a->converted.v[0].dtype));
    if (a->renamed.n)
        ckpt__log(log, CKPT_LOG_INFO, "%s: %" PRId64 " key%s renamed (first: '%s' as '%s')",
                  op->dir, a->renamed.n, a->renamed.n == 1 ? "" : "s", a->renamed.v[0].file_key,
                  a->renamed.v[0].key);
}

int ckpt__load_op_check(ckpt__load_op *op) {
    if (!enter(op, PH_CHECK, op->phase == PH_READ && !op->retry)) return op->rc;
    int rc = op->rc;
    if (op->external) {
        if (rc == 0) rc = ckpt__load_check_external(op);
    } else {
        name_phase(op, "load: pre-hooks and check");
        /* object storage: the hooks get a local folder with the pre-hooks' files */
        if (rc == 0 && op->remote) rc = ckpt__load_remote_hook_dir(op);
        if (rc == 0)
            rc = ckpt__acc_run_hooks(op->acc, HOOK_LOAD, op->remote ? op->hook_dir : op->dir,
                                     "load_state");
        if (rc == 0) rc = ckpt__load_check_objects(op);
        /* a check_state_dict may read streamed chunks: every rank ends alike */
        int src = ckpt__load_stream_end(op);
        if (rc == 0) rc = src;
    }
    /* the report is made before anything changes: its failure (memory)
     * still leaves everything as it was */
    if (rc == 0 && op->report) rc = fill_report(op, op->report);
    return fail(op, rc, false);
}

int ckpt__load_op_agree(ckpt__load_op *op) {
    if (!enter(op, PH_AGREE, op->phase == PH_CHECK)) return op->rc;
    name_phase(op, "load: agree on the verdict");
    int rc = ckpt__coll_agree_echo(op->comm, op->rc, NULL, op->echo);
    op->rc = 0;
    fail(op, rc, true);
    if (rc == 0) log_adaptation(op, op->report);
    return rc;
}

/* ---- apply, finish ------------------------------------------------------------ */

/* After a load: a success lifts a refusal of saves; a failure other than
 * "no checkpoint" sets one (see ckpt.h). Every rank holds the same status and
 * message here, so every rank decides alike. */
static int record_outcome(ckpt_accelerator *acc, int rc, bool nothing) {
    if (rc == 0) return ckpt_accelerator_start_over(acc);
    if (nothing) return rc;
    /* CKPT_ENOENT is promised for "no checkpoint" only, so that a caller may
     * take it for a fresh start: a key an object reads and the file lacks
     * (or a hook's missing file) is a mismatch between checkpoint and run. */
    if (rc == CKPT_ENOENT) rc = CKPT_EMISMATCH;
    free(acc->load_failed_msg);
    acc->load_failed_msg = ckpt__strdup(ckpt_errmsg());
    acc->load_failed = true;
    acc->load_failed_code = rc;
    return rc;
}

int ckpt__load_op_apply(ckpt__load_op *op) {
    if (!enter(op, PH_APPLY, op->phase == PH_AGREE)) return op->rc;
    if (op->external) { /* the source's failure as it is (load_weights adds its name) */
        const ckpt_acc_obj *o = &op->objs[0];
        return fail(op, o->ops->load_state_dict(o->self, op->readers[0]), true);
    }
    /* apply: the objects read the streamed chunks as they load */
    name_phase(op, "load: apply");
    op->applied = true;
    if (op->acc) op->acc->objects_live = true; /* later loads are transactional */
    op->echo = false; /* a check's swallowed echo is not this phase's */
    int rc = ckpt__load_apply_objects(op);
    int src = ckpt__load_stream_end(op);
    if (rc == 0) rc = src;
    return fail(op, ckpt__coll_agree_echo(op->comm, rc, NULL, op->echo), true);
}

int ckpt__load_op_finish(ckpt__load_op *op) {
    if (op->phase != PH_APPLY && op->rc == 0) enter(op, PH_FINISH, false);
    op->phase = PH_FINISH;
    int rc = op->rc;
    ckpt_accelerator *acc = op->acc;
    if (op->in_op) {
        ckpt__coll_end(acc); /* the post-hooks may save or load */
        op->in_op = false;
    }
    if (acc && rc == 0) {
        acc->interval_start = ckpt__now(); /* a resumed run's time interval starts now */
        close_checkpoint(op);              /* the post-hooks may rewrite the folder */
        ckpt__acc_run_hooks(acc, HOOK_LOAD_POST, op->remote ? op->hook_dir : op->dir, "load_state");
    }
    if (acc && !op->bad_options) rc = record_outcome(acc, rc, op->nothing);
    if (rc < 0 && op->report) ckpt_load_report_free(op->report);
    op->rc = rc;
    return rc;
}

void ckpt__load_op_free(ckpt__load_op *op) {
    if (!op) return;
    for (int i = 0; i < op->nobjs; i++) {
        if (op->readers) ckpt_reader_free(op->readers[i]);
        if (op->extra) ckpt_reader_free(op->extra[i]);
        if (op->srcs) ckpt_reader_free(op->srcs[i]);
    }
    free(op->readers);
    free(op->extra);
    free(op->srcs);
    free(op->sel);
    free(op->objs);
    free(op->reader);
    free(op->shared);
    ckpt__adapt_result_free(&op->res);
    close_checkpoint(op);
    /* The read buffers leave memory with the load, unless they are the
     * asynchronous saves' staging area (which stays by design). */
    if (op->acc && !op->acc->arena_staging) ckpt__arena_free(&op->acc->arena);
    free(op->dir);
    free(op->input_dir);
    free(op->cdir);
    free(op->nums);
    ckpt__load_remote_free(op);
    ckpt__tier_pick_free(&op->tpick);
    if (op->in_op) ckpt__coll_end(op->acc); /* never finished */
    free(op);
}

int ckpt__load_op_status(const ckpt__load_op *op) { return op->rc; }

const char *ckpt__load_op_dir(const ckpt__load_op *op) { return op->rc == 0 ? op->dir : NULL; }

/* ---- the driver ---------------------------------------------------------------- */

int ckpt_load_state(ckpt_accelerator *acc, const char *input_dir) {
    return ckpt_load_state_ex(acc, input_dir, NULL, NULL);
}

/* A one-pass load of the project's newest checkpoint that found it damaged
 * while the objects read it (they hold part of it): with an older candidate
 * left, its number (the driver then loads the older one over the objects,
 * which a strict load rewrites whole, and the retry's op->why starts with
 * this one's message); else -1, and without an older candidate the failure
 * says that no valid checkpoint is left and what the objects hold. */
static int64_t damaged_while_applied(ckpt__load_op *op) {
    if (!(op->rc == CKPT_ECORRUPT && op->applied && op->one_pass && !op->input_dir && !op->tier &&
          !op->remote && op->comm->size <= 1))
        return -1;
    int64_t number = op->nums[op->next + 1];
    char msg[1200];
    snprintf(msg, sizeof msg, "%s", ckpt_errmsg());
    size_t used = strlen(op->why);
    snprintf(op->why + used, sizeof op->why - used, "%s%s", used ? "; " : "", msg);
    if (op->next < 0) {
        op->rc = ckpt__err(CKPT_ECORRUPT,
                           "load_state: no valid checkpoint in %s: %s (the objects hold part of "
                           "checkpoint_%" PRId64 ": the first load reads each file once, "
                           "verified as it lands; load a good checkpoint, or set them anew "
                           "and call ckpt_accelerator_start_over)",
                           op->cdir, op->why, number);
        return -1;
    }
    snprintf(msg + strlen(msg), sizeof msg - strlen(msg),
             " (the objects hold part of it: the first load reads each file once; an older "
             "checkpoint is loaded over them)");
    warn_skipped(op->acc, op->dir, msg, true);
    return number;
}

int ckpt_load_state_ex(ckpt_accelerator *acc, const char *input_dir, const ckpt_load_options *opt,
                       ckpt_load_report *report) {
    int64_t below = 0;
    char why[sizeof((ckpt__load_op *)0)->why] = "";
    for (;;) {
        ckpt__load_op *op = NULL;
        int rc = ckpt__load_op_new(acc, input_dir, opt, report, &op);
        if (!op) return rc;
        if (below > 0) { /* the retry of the resume: one pass again, older ones */
            op->below = below;
            op->one_pass = true;
            op->stream = false;
            memcpy(op->why, why, sizeof why);
        }
        /* a damaged candidate: the next older one */
        do {
            ckpt__load_op_choose(op);
            ckpt__load_op_plan(op);
        } while (ckpt__load_op_read(op) == CKPT__LOAD_NEXT);
        ckpt__load_op_check(op);
        ckpt__load_op_agree(op);
        ckpt__load_op_apply(op);
        int64_t damaged = damaged_while_applied(op);
        if (damaged >= 0) memcpy(why, op->why, sizeof why);
        rc = ckpt__load_op_finish(op);
        ckpt__load_op_free(op);
        if (damaged < 0) {
            if (rc < 0 && below > 0 && !strstr(ckpt_errmsg(), "the objects hold part of")) {
                char m[1200];
                snprintf(m, sizeof m, "%s", ckpt_errmsg());
                rc = ckpt__err(rc,
                               "%s (the objects hold part of checkpoint_%" PRId64
                               ", found damaged while they read it)",
                               m, below);
            }
            return rc;
        }
        below = damaged;
    }
}
