/* load_objects.c — what a load does to each object (load_op.h): which
 * objects the options select, the check phase (every object matched with
 * its file or files, its schema and values checked, changing nothing) and
 * the apply phase (every object loads, then the accelerator moves on). */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "accel/accel.h"
#include "accel/load_int.h"
#include "base/error.h"
#include "format/hfindex.h"
#include "format/keymap.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/store.h"
#include "train/rng.h"

/* The name options select an object by: its file name without
 * ".safetensors", and "random_states" for the generator. */
void ckpt__load_object_name(const ckpt__load_op *op, const ckpt_acc_obj *o, char *buf, size_t cap) {
    if (o->kind == K_RNG) {
        snprintf(buf, cap, "%s", ckpt__kind_stem[K_RNG]);
        return;
    }
    ckpt__load_file_name(op, o, buf, cap);
    char *dot = strstr(buf, ".safetensors");
    if (dot) *dot = '\0';
}

/* Which objects opt selects (op->sel, op->full); CKPT_EINVAL for bad
 * options, before anything is read. */
int ckpt__load_select(ckpt__load_op *op) {
    const ckpt_load_options *opt = op->opt;
    op->objs = ckpt__acc_plan_objects(op->acc, &op->nobjs);
    op->sel = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *op->sel);
    if (!op->objs || !op->sel) return ckpt__err_nomem("load plan");
    bool all = !opt || (opt->objects == 0 && opt->num_names == 0);
    if (opt) {
        if (opt->objects & ~CKPT_LOAD_ALL)
            return ckpt__err(CKPT_EINVAL, "load_state: objects has unknown bits 0x%x (known: 0x%x)",
                             opt->objects & ~CKPT_LOAD_ALL, CKPT_LOAD_ALL);
        if (opt->num_names < 0 || (opt->num_names > 0 && !opt->names))
            return ckpt__err(CKPT_EINVAL, "load_state: names is %s with num_names %d",
                             opt->names ? "set" : "NULL", opt->num_names);
        CKPT_TRY(ckpt__keymap_check(opt, "load_state"));
    }
    char name[96];
    for (int n = 0; opt && n < opt->num_names; n++) {
        if (!opt->names[n]) return ckpt__err(CKPT_EINVAL, "load_state: names[%d] is NULL", n);
        bool found = false;
        for (int i = 0; i < op->nobjs && !found; i++) {
            ckpt__load_object_name(op, &op->objs[i], name, sizeof name);
            found = strcmp(name, opt->names[n]) == 0;
        }
        if (found) continue;
        char known[512] = "";
        for (int i = 0; i < op->nobjs; i++) {
            ckpt__load_object_name(op, &op->objs[i], name, sizeof name);
            size_t u = strlen(known);
            snprintf(known + u, sizeof known - u, "%s%s", u ? ", " : "", name);
        }
        return ckpt__err(CKPT_EINVAL,
                         "load_state: names[%d] '%s' is no registered object (there are: %s)", n,
                         opt->names[n], known);
    }
    static const unsigned bit[K_COUNT] = {
        CKPT_LOAD_MODELS,  CKPT_LOAD_OPTIMIZERS, CKPT_LOAD_SCHEDULERS, CKPT_LOAD_DATALOADERS,
        CKPT_LOAD_SCALERS, CKPT_LOAD_CUSTOM,     CKPT_LOAD_RNG};
    int nsel = 0;
    for (int i = 0; i < op->nobjs; i++) {
        bool on = all || (opt->objects & bit[op->objs[i].kind]);
        ckpt__load_object_name(op, &op->objs[i], name, sizeof name);
        for (int n = 0; !on && opt && n < opt->num_names; n++)
            on = strcmp(name, opt->names[n]) == 0;
        op->sel[i] = on;
        nsel += on;
    }
    if (nsel == 0)
        return ckpt__err(CKPT_EINVAL,
                         "load_state: the options select none of the registered objects "
                         "(objects 0x%x)",
                         opt->objects);
    op->full = nsel == op->nobjs;
    return CKPT_OK;
}

static void plural(char *buf, size_t cap, int n, const char *noun) {
    snprintf(buf, cap, "%d %s%s", n, noun, n == 1 ? "" : "s");
}

/* The checkpoint holds one file for each registered object of each kind
 * (shard files and per-process files aside). */
static int check_counts(const ckpt__load_op *op) {
    const ckpt_accelerator *acc = op->acc;
    if (!op->full) return CKPT_OK; /* a partial load: each selected object finds its file */
    const ckpt_manifest *m = &op->c.m;
    int have[K_COUNT] = {0};
    for (int64_t i = 0; i < m->nfiles; i++) {
        if (ckpt__acc_is_shard_of(m->files[i].name, NULL)) continue;
        for (int k = 0; k < K_COUNT; k++)
            if (strcmp(m->files[i].kind, ckpt__kind_name[k]) == 0) have[k]++;
    }
    for (int k = 0; k < K_RNG; k++) {
        if (have[k] == acc->count[k]) continue;
        char a[64];
        plural(a, sizeof a, have[k], ckpt__kind_noun[k]);
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: checkpoint has %s, %d %s registered",
                         op->dir, a, acc->count[k], acc->count[k] == 1 ? "is" : "are");
    }
    return CKPT_OK;
}

/* Makes every shard file of the object whose file is `name` readable
 * through r, with the chunks the manifest records. */
static int attach_shards(ckpt__load_op *op, ckpt_reader *r, const char *name, const char *kind) {
    const ckpt_manifest *m = &op->c.m;
    for (int64_t j = 0; j < m->nfiles; j++) {
        const ckpt_manifest_file *f = &m->files[j];
        if (!ckpt__acc_is_shard_of(f->name, name)) continue;
        if (strcmp(f->kind, kind) != 0)
            return ckpt__err(CKPT_ECORRUPT, "%s: %s holds a %s, expected a %s", op->dir, f->name,
                             f->kind, kind);
        if (!f->chunks && f->ntensors > 0)
            return ckpt__err(CKPT_ECORRUPT, "%s: %s: the manifest records no chunks for it",
                             op->dir, f->name);
        /* A shard file this rank does not hold (none of its chunks meets
         * the object's slices, or only streamed ones): its chunks from the
         * manifest, no bytes. */
        const ckpt_mapped *mp = &op->c.maps[j];
        bool held = !op->have || op->have[j];
        int64_t *ids = NULL;
        if (op->nstreamed && f->ntensors > 0) {
            if (!(ids = ckpt__malloc((size_t)f->ntensors * sizeof *ids)))
                return ckpt__err_nomem("load: chunk plan");
            for (int64_t k = 0; k < f->ntensors; k++) {
                int64_t id = op->cbase[j] + k;
                ids[k] = op->streamed[id] ? id : -1;
            }
            ckpt__reader_set_fetch(r, ckpt__load_fetch, op);
        }
        int rc = ckpt__reader_attach_shard(r, held ? mp->data : NULL, held ? (size_t)mp->size : 0,
                                           f->name, (const char *const *)f->tensor_keys, f->chunks,
                                           f->ntensors, ids);
        free(ids);
        CKPT_TRY(rc);
    }
    return CKPT_OK;
}

static int current_state(void *ctx, ckpt_writer *w) {
    const ckpt_acc_obj *o = ctx;
    return o->ops->state_dict(o->self, w);
}

/* Models and custom objects are adapted as the options say (renamed keys,
 * non-strict matching, converted dtypes); the library's own objects never. */
static int adapt_object(ckpt__load_op *op, int i, const ckpt_writer *schema, const char *file) {
    ckpt_acc_obj *o = &op->objs[i];
    if (!op->opt || (o->kind != K_MODEL && o->kind != K_CUSTOM)) return CKPT_OK;
    char object[96];
    ckpt__load_object_name(op, o, object, sizeof object);
    ckpt_reader *ad = NULL, *ex = NULL;
    CKPT_TRY(ckpt__adapt(schema, op->readers[i], op->opt, object, file, current_state, o, &ad, &ex,
                         &op->res));
    if (ad) {
        op->srcs[i] = op->readers[i];
        op->extra[i] = ex;
        op->readers[i] = ad;
    }
    return CKPT_OK;
}

/* A part of a model saved as Hugging Face shards: a reader over the bytes
 * the choose phase read and verified. */
static int open_part(void *ctx, const ckpt_manifest_file *f, ckpt_reader **out) {
    const ckpt__load_op *op = ctx;
    const ckpt_mapped *mp = &op->c.maps[f - op->c.m.files];
    return ckpt_reader_open_memory(out, mp->data, (size_t)mp->size, f->name);
}

/* Whether a model saved as Hugging Face shards, its parts named after
 * file `name`, has streamed tensors: then it is read through its parts'
 * headers (open_hf_streamed), not their bytes. */
static bool hf_streams(const ckpt__load_op *op, const char *name) {
    for (int64_t j = 0; op->nstreamed && j < op->c.m.nfiles; j++)
        if (ckpt__load_is_hf_part(&op->c.m.files[j]) &&
            ckpt__acc_is_shard_of(op->c.m.files[j].name, name) && ckpt__load_any_streamed(op, j))
            return true;
    return false;
}

/* A model saved as Hugging Face shards whose tensors are streamed: one
 * reader over every part the index names (attach_whole), checked against
 * the index as ckpt__hf_open checks it: the parts hold exactly the tensors
 * the index names. */
static int open_hf_streamed(ckpt__load_op *op, int i, const ckpt_manifest_file *index,
                            const char *name) {
    const ckpt_manifest *m = &op->c.m;
    const ckpt_mapped *im = &op->c.maps[index - m->files];
    ckpt_hf_index x;
    int rc = ckpt__hf_index_parse((const char *)im->data, (size_t)im->size, index->name, &x);
    if (rc) return ckpt__err_prefix(rc, "%s", op->dir);
    ckpt_reader *r = NULL;
    rc = ckpt__reader_new_empty(&r, name);
    if (rc == 0) ckpt__reader_set_fetch(r, ckpt__load_fetch, op);
    for (int64_t p = 0; p < x.nparts && rc == 0; p++) {
        const ckpt_manifest_file *f = ckpt__manifest_find(m, x.parts[p]);
        if (!f || !ckpt__load_is_hf_part(f) || !ckpt__load_has_chunks(f))
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: %s names %s, which the manifest does not list as a model file",
                           op->dir, index->name, x.parts[p]);
        else rc = ckpt__load_attach_whole(op, r, f);
    }
    if (rc == 0 && ckpt_reader_count(r) != x.n)
        rc = ckpt__err(CKPT_ECORRUPT,
                       "%s: %s: the parts hold %" PRId64 " tensors, the index names %" PRId64,
                       op->dir, index->name, ckpt_reader_count(r), x.n);
    for (int64_t k = 0; k < x.n && rc == 0; k++)
        if (!ckpt__reader_has(r, x.keys[k], NULL))
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s names tensor '%s', which no part holds", op->dir,
                           index->name, x.keys[k]);
    ckpt__hf_index_free(&x);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    op->readers[i] = r;
    return CKPT_OK;
}

/* One object's reader over its file (and its shard files), and its schema
 * checked against them. */
static int open_object(ckpt__load_op *op, int i) {
    ckpt_acc_obj *o = &op->objs[i];
    const ckpt_manifest *m = &op->c.m;
    char name[96];
    if (o->kind == K_RNG && op->rng_reshard) {
        op->rr = (ckpt_rng_reshard){.target = o->self, .rank = op->acc->process_index};
        o->ops = ckpt__rng_reshard_ops();
        o->self = &op->rr;
        snprintf(name, sizeof name, "%s_0.safetensors", ckpt__kind_stem[K_RNG]);
    } else {
        ckpt__load_file_name(op, o, name, sizeof name);
    }
    int64_t idx = -1, hf = -1;
    char iname[128];
    snprintf(iname, sizeof iname, "%s.index.json", name);
    for (int64_t j = 0; j < m->nfiles; j++) {
        if (strcmp(m->files[j].name, name) == 0) idx = j;
        if (o->kind == K_MODEL && strcmp(m->files[j].name, iname) == 0) hf = j;
    }
    if (idx < 0 && hf >= 0) { /* saved as Hugging Face shards */
        if (strcmp(m->files[hf].kind, ckpt__kind_name[K_MODEL]) != 0)
            return ckpt__err(CKPT_EMISMATCH, "load_state: %s: %s holds a %s, expected a model",
                             op->dir, iname, m->files[hf].kind);
        const ckpt_mapped *im = &op->c.maps[hf];
        int rc = hf_streams(op, name)
                     ? open_hf_streamed(op, i, &m->files[hf], name)
                     : ckpt__hf_open(m, &m->files[hf], im->data, (size_t)im->size, op->dir, name,
                                     open_part, op, &op->readers[i]);
        if (rc < 0) return ckpt__err_prefix(rc, "load_state");
    } else if (idx < 0) {
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: checkpoint has no %s (for %s %d)",
                         op->dir, name, ckpt__kind_noun[o->kind], o->index);
    }
    if (idx >= 0 && strcmp(m->files[idx].kind, ckpt__kind_name[o->kind]) != 0)
        return ckpt__err(CKPT_EMISMATCH, "load_state: %s: %s holds a %s, expected a %s", op->dir,
                         name, m->files[idx].kind, ckpt__kind_name[o->kind]);
    int rc = CKPT_OK;
    if (idx >= 0 && (op->one_pass || op->stream)) {
        const ckpt_manifest_file *f = &m->files[idx];
        char *path = ckpt__path_join(op->dir, name);
        rc = path ? ckpt__reader_open_verified(&op->readers[i], path, name, f->xxh3,
                                               f->has_header_xxh3 ? &f->header_xxh3 : NULL,
                                               (const char *const *)f->tensor_keys, f->tensor_xxh3,
                                               f->ntensors)
                  : ckpt__err_nomem("load path");
        free(path);
    } else if (idx >= 0 && ckpt__load_any_streamed(op, idx)) { /* a large model file, streamed */
        rc = ckpt__reader_new_empty(&op->readers[i], name);
        if (rc == 0) {
            ckpt__reader_set_fetch(op->readers[i], ckpt__load_fetch, op);
            rc = ckpt__load_attach_whole(op, op->readers[i], &m->files[idx]);
        }
        if (rc == 0) rc = attach_shards(op, op->readers[i], name, ckpt__kind_name[o->kind]);
    } else if (idx >= 0) {
        const ckpt_mapped *mp = &op->c.maps[idx];
        rc = ckpt_reader_open_memory(&op->readers[i], mp->data, (size_t)mp->size, name);
        if (rc == 0) rc = attach_shards(op, op->readers[i], name, ckpt__kind_name[o->kind]);
    }
    if (rc < 0) return ckpt__err_prefix(rc, "load_state: %s", op->dir);
    ckpt_writer *schema = NULL;
    CKPT_TRY(ckpt_writer_new_schema(&schema));
    ckpt_clear_error();
    rc = o->ops->state_dict(o->self, schema);
    if (rc != 0) {
        bool own = ckpt_errmsg()[0] != '\0';
        rc = ckpt__callback_failed(rc, "state_dict");
        rc = ckpt__err_prefix(rc, own ? "%s: state_dict" : "%s", name);
    } else {
        rc = adapt_object(op, i, schema, name);
        if (rc == 0) rc = ckpt__schema_check(schema, op->readers[i], name);
    }
    ckpt_writer_free(schema);
    if (rc < 0) rc = ckpt__err_prefix(rc, "load_state: %s", op->dir);
    return rc;
}

/* Matches the registered objects with the checkpoint's files, checks every
 * object's schema against its file, then every value through the objects'
 * check_state_dict; changes nothing. */
int ckpt__load_check_objects(ckpt__load_op *op) {
    CKPT_TRY(check_counts(op));
    int saved_np = op->c.m.num_processes > 0 ? op->c.m.num_processes : 1;
    op->rng_reshard = saved_np != op->acc->num_processes;
    if (op->rng_reshard && op->comm->rank == 0)
        ckpt__log(&op->acc->log, CKPT_LOG_WARNING,
                  "%s was saved by %d process%s and is loaded by %d: random generators continue "
                  "from rank 0's by the documented derivation, not as the saved processes' "
                  "would have (docs/DISTRIBUTED.md, \"Reshard\")",
                  op->dir, saved_np, saved_np == 1 ? "" : "es", op->acc->num_processes);
    size_t nr = (size_t)(op->nobjs ? op->nobjs : 1);
    op->readers = ckpt__calloc(nr, sizeof *op->readers);
    op->srcs = ckpt__calloc(nr, sizeof *op->srcs);
    op->extra = ckpt__calloc(nr, sizeof *op->extra);
    if (!op->readers || !op->srcs || !op->extra) return ckpt__err_nomem("load plan");
    for (int i = 0; i < op->nobjs; i++)
        if (op->sel[i]) CKPT_TRY(open_object(op, i));
    /* Every schema matches: now every value, still changing nothing. Each
     * check sees the objects as they were before the load. */
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        if (!op->sel[i] || !o->ops->check_state_dict) continue;
        ckpt_clear_error();
        int rc = o->ops->check_state_dict(o->self, op->readers[i]);
        if (rc == 0) continue;
        rc = ckpt__callback_failed(rc, "check_state_dict");
        char name[96];
        ckpt__load_file_name(op, o, name, sizeof name);
        return ckpt__err_prefix(rc, "load_state: %s: %s", op->dir, name);
    }
    return CKPT_OK;
}

int ckpt__load_apply_objects(ckpt__load_op *op) {
    ckpt_accelerator *acc = op->acc;
    const ckpt_manifest *m = &op->c.m;
    /* Allocated before anything is applied: past this point only an
     * object's own load_state_dict can fail. */
    char *last = ckpt__strdup(op->dir);
    if (!last) return ckpt__err_nomem("last_dir");
    /* The built-in objects' load_state_dict is their check (passed above)
     * plus the commit, so a failure past this point is a value refused by a
     * custom object without check_state_dict (documented in CHECKPOINTS.md);
     * the objects before it are already loaded. */
    int done = 0, nsel = 0;
    for (int i = 0; i < op->nobjs; i++) nsel += op->sel[i];
    for (int i = 0; i < op->nobjs; i++) {
        const ckpt_acc_obj *o = &op->objs[i];
        if (!op->sel[i]) continue;
        ckpt_clear_error();
        int rc = o->ops->load_state_dict(o->self, op->readers[i]);
        if (rc != 0) {
            rc = ckpt__callback_failed(rc, "load_state_dict");
            char name[96];
            ckpt__acc_file_name(acc, o, name, sizeof name);
            free(last);
            /* Streamed, every file verified whole before: a checksum that no
             * longer matches is a file rewritten since. */
            const char *why =
                op->stream && rc == CKPT_ECORRUPT ? "the file changed after it was verified; " : "";
            return ckpt__err_prefix(rc,
                                    "load_state: %s: %s (%sstate partially loaded: %d of %d "
                                    "objects were loaded before this one)",
                                    op->dir, name, why, done, nsel);
        }
        done++;
    }
    /* One pass: what no read covered (the tail, tensors nobody read), and
     * the whole file's digest. The objects hold the file's bytes already. */
    for (int i = 0; op->one_pass && i < op->nobjs; i++) {
        int rc = op->sel[i] ? ckpt__reader_verify_finish(op->readers[i]) : 0;
        if (rc < 0) {
            free(last);
            return ckpt__err_prefix(rc,
                                    "load_state: %s (one-pass load: the objects already hold "
                                    "what was read; they are not to be trusted until a load "
                                    "succeeds)",
                                    op->dir);
        }
    }
    /* Streamed: every file was verified whole before anything changed; what
     * the reads put in place was hashed as it landed. A difference now
     * means a file changed after it was verified. */
    for (int i = 0; op->stream && i < op->nobjs; i++) {
        int rc = op->sel[i] ? ckpt__reader_verify_applied(op->readers[i]) : 0;
        if (rc < 0) {
            free(last);
            return ckpt__err_prefix(rc,
                                    "load_state: %s (a file changed after it was verified: "
                                    "state partially loaded; the objects are not to be "
                                    "trusted until a load succeeds)",
                                    op->dir);
        }
    }
    if (!acc) { /* an object no accelerator holds: nothing else moves */
        free(last);
        return CKPT_OK;
    }
    /* What the next save may link its unchanged files from (incremental
     * saves), whether the load was full or partial: a fine-tune's first save
     * links the frozen base from the checkpoint it started from. */
    char *link = ckpt__strdup(op->dir);
    if (link) {
        free(acc->link_dir);
        acc->link_dir = link;
    }
    /* A partial load (fine-tuning from another run's checkpoint, say)
     * leaves the step, the numbering and the last folder alone. */
    if (!op->full) {
        free(last);
        return CKPT_OK;
    }
    ckpt__acc_restore_step(acc, m->step);
    int64_t next = m->iteration;
    {
        const char *dir = op->dir;
        char base[256];
        size_t len = strlen(dir);
        while (len > 1 && dir[len - 1] == '/') len--;
        size_t s = len;
        while (s > 0 && dir[s - 1] != '/') s--;
        int64_t num;
        if (len - s < sizeof base) {
            memcpy(base, dir + s, len - s);
            base[len - s] = '\0';
            if (ckpt__parse_checkpoint_name(base, &num) && num + 1 > next) next = num + 1;
        }
    }
    if (next > acc->iteration) acc->iteration = next;
    free(acc->last_dir);
    acc->last_dir = last;
    return CKPT_OK;
}

/* ckpt__load_op_read_from's one object, checked as ckpt_model_load_weights
 * always has: its schema (adapted as the options say) against the source,
 * then its values; the messages are the source's, not prefixed here. */
int ckpt__load_check_external(ckpt__load_op *op) {
    ckpt_acc_obj *o = &op->objs[0];
    char object[96];
    ckpt__load_object_name(op, o, object, sizeof object);
    ckpt_writer *schema = NULL;
    ckpt_reader *ad = NULL, *ex = NULL;
    int rc = ckpt_writer_new_schema(&schema);
    if (rc == 0) rc = o->ops->state_dict(o->self, schema);
    if (rc == 0)
        rc = ckpt__adapt(schema, op->readers[0], op->opt, object, op->dir, current_state, o, &ad,
                         &ex, &op->res);
    if (ad) {
        op->srcs[0] = op->readers[0];
        op->readers[0] = ad;
    }
    op->extra[0] = ex;
    if (rc == 0) rc = ckpt__schema_check(schema, op->readers[0], op->dir);
    if (rc == 0 && o->ops->check_state_dict) rc = o->ops->check_state_dict(o->self, op->readers[0]);
    ckpt_writer_free(schema);
    return rc;
}
