/* save_spread.c — the save plan: which rank writes which replicated tensor,
 * and which Hugging Face shard, so that every tensor is written once and
 * each rank writes about 1/P of the bytes. Every rank computes the same
 * plan from the same state dicts, with no communication. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "accel/save_int.h"
#include "base/error.h"
#include "base/io.h"
#include "format/shard.h"

/* Whether object i is written as Hugging Face shards: a model beyond
 * max_shard_size with tensors (and aliases: tied names) only, none sharded
 * across processes. */
static bool hf_decide(const save_op *op, int i) {
    const ckpt_writer *w = op->writers[i];
    if (op->objs[i].kind != K_MODEL || !op->acc->max_shard_size || ckpt__writer_has_shards(w))
        return false;
    uint64_t total = 0;
    for (int64_t j = 0; j < ckpt_writer_entry_count(w); j++) {
        ckpt_entry_info e;
        if (ckpt_writer_entry(w, j, &e) < 0) return false;
        if (e.kind == CKPT_ENTRY_ALIAS) continue;
        if (e.kind != CKPT_ENTRY_TENSOR) return false;
        total += e.nbytes;
    }
    return total > op->acc->max_shard_size;
}

/* The same, as the plan decided it (before it spread the model's tensors). */
bool ckpt__save_hf_sharded(const save_op *op, int i) {
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
    int64_t *entry = ckpt__calloc((size_t)n + 1, sizeof *entry);
    int rc = nb && keys && entry ? CKPT_OK : ckpt__err_nomem("save shards");
    int64_t k = 0; /* the tensors: tied names go with their target (write_hf) */
    for (int64_t j = 0; j < n && rc == 0; j++) {
        ckpt_entry_info e;
        rc = ckpt_writer_entry(w, j, &e);
        if (rc < 0 || e.kind == CKPT_ENTRY_ALIAS) continue;
        nb[k] = e.nbytes;
        keys[k] = e.key;
        entry[k++] = j;
    }
    if (rc == 0) rc = ckpt__hf_layout_make(keys, nb, k, op->acc->max_shard_size, stem, l);
    if (rc == 0) l->entry = entry;
    else free(entry);
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
                if (ckpt_writer_entry(op->writers[i], l->entry[j], &e) == 0) v[t].bytes += e.nbytes;
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
bool ckpt__save_plan_entry(const save_op *op, int i, int64_t j, int64_t *rows, uint64_t *nbytes) {
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
 * frozen tensors apart, whole, in its shard file, named
 * <model>.frozen.safetensors (format version 3; the tensors are chunks that
 * are the whole tensor, as in version 2's <model>-00001-of-00001), so that
 * file has the same bytes at every save and is linked, not written. A
 * model of one kind only stays one file (it changes as a whole or not at
 * all); a model saved as Hugging Face shards keeps its layout. */
static int split_frozen(save_op *op) {
    op->frozen_apart = ckpt__calloc((size_t)(op->nobjs ? op->nobjs : 1), sizeof *op->frozen_apart);
    if (!op->frozen_apart) return ckpt__err_nomem("save plan");
    for (int i = 0; i < op->nobjs; i++) {
        ckpt_writer *w = op->writers[i];
        if (op->objs[i].kind != K_MODEL || op->hf_model[i] || ckpt__writer_has_shards(w)) continue;
        int64_t n = ckpt_writer_entry_count(w), nfrozen = 0, ntrain = 0, rows;
        uint64_t nb;
        for (int64_t j = 0; j < n; j++) {
            if (!ckpt__save_plan_entry(op, i, j, &rows, &nb)) continue;
            if (ckpt__writer_entry_frozen(w, j)) nfrozen++;
            else ntrain++;
        }
        if (nfrozen == 0 || ntrain == 0) continue;
        for (int64_t j = 0; j < n; j++)
            if (ckpt__save_plan_entry(op, i, j, &rows, &nb) && ckpt__writer_entry_frozen(w, j))
                CKPT_TRY(ckpt__writer_spread(w, j, 0, rows));
        op->split = op->frozen_apart[i] = true;
    }
    return CKPT_OK;
}

int ckpt__save_shard_name(const save_op *op, int i, const char *own, char *buf, size_t cap) {
    const ckpt_comm *c = op->comm;
    if (op->frozen_apart && op->frozen_apart[i]) return ckpt__acc_frozen_name(own, buf, cap);
    return ckpt__acc_shard_name(own, c->rank, c->size, buf, cap);
}

/* With several processes, the replicated tensors of every object (a
 * replicated model, an optimizer's replicated part, custom objects) are
 * placed on the ranks so that each writes about 1/P of their bytes: laid
 * end to end, the tensors under PLAN_CUT_MIN bytes first and then the
 * others, each group in state order, rank r takes the bytes from r/P to
 * (r+1)/P of the total. A tensor of at least PLAN_CUT_MIN bytes is cut at
 * the row nearest each boundary (each rank's part is a run of whole rows:
 * one box chunk); a smaller one goes whole to the rank its middle byte falls
 * in. A small tensor that falls whole to rank 0 stays a plain tensor of its
 * object's file, which rank 0 writes anyway: no chunk record (a large one
 * goes to rank 0's shard file, so that a load streams it instead of sending
 * the object's file whole to every rank). Small tensors go first so that
 * they are those (biases, norms, an optimizer's step counts: most of the
 * keys, few of the bytes), and the manifest's chunk records are those of the
 * large tensors and of the cuts, O(K_large + P).
 * Every rank computes the same plan from the same state dicts, with no
 * communication; the chunk check at the commit catches ranks whose
 * replicated state differs in shape. A model saved as Hugging Face shards
 * keeps its layout, its shard files placed on the ranks by plan_hf; the
 * other tensors' shares then make up each rank's total to about 1/P of
 * everything (share_start). The generators are per process. */
int ckpt__save_plan_spread(save_op *op) {
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
            if (!ckpt__save_plan_entry(op, i, j, &rows, &nb)) continue;
            if (ckpt__writer_entry_frozen(w, j)) any_frozen = true;
            else any_trained = true;
        }
        mixed[i] = any_frozen && any_trained;
    }
#define KEPT_WHOLE(i, j) (mixed[i] && !ckpt__writer_entry_frozen(op->writers[i], j))
    for (int i = 0; i < op->nobjs; i++) {
        if (op->objs[i].kind == K_RNG || op->hf_model[i]) continue;
        for (int64_t j = 0; j < ckpt_writer_entry_count(op->writers[i]); j++)
            if (ckpt__save_plan_entry(op, i, j, &rows, &nb) && !KEPT_WHOLE(i, j)) total += nb;
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
                if (!ckpt__save_plan_entry(op, i, j, &rows, &nb) ||
                    (nb < PLAN_CUT_MIN) != (pass == 0) || KEPT_WHOLE(i, j))
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
                /* Only small tensors stay in the object's file: every rank
                 * of a load receives that file whole before the check, while
                 * the large tensors' chunks are streamed to the ranks as the
                 * objects read them (load.c). A mixed model's frozen tensors
                 * all go to shard files, rank 0's too. */
                if (!whole0 || mixed[i] || nb >= PLAN_CUT_MIN)
                    rc = ckpt__writer_spread(op->writers[i], j, lo, hi);
                pos += nb;
            }
        }
    }
#undef KEPT_WHOLE
    free(mixed);
    return rc;
}

/* Whether this rank writes a shard of object i, a model saved as Hugging
 * Face shards. */
bool ckpt__save_hf_writes(const save_op *op, int i) {
    for (int64_t s = 0; op->hf_owner && op->hf_owner[i] && s < op->hfl[i].nshards; s++)
        if (op->hf_owner[i][s] == op->comm->rank) return true;
    return false;
}
