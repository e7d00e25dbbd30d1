/* tier.c — node-local tiers: the configuration, the placement rule, each
 * rank's folder and its lock, and moving bytes between two ranks (tier.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "accel/accel.h"
#include "accel/tier.h"
#include "base/error.h"
#include "base/io.h"
#include "store/store.h"

/* ---- configuration -------------------------------------------------------- */

/* NULL if the pattern is fine, else what is wrong with it. */
static const char *pattern_problem(const char *p) {
    for (const char *s = p; *s; s++) {
        if (*s != '%') continue;
        if (s[1] == 'n' || s[1] == 'r' || s[1] == '%') {
            s++;
            continue;
        }
        return s[1] ? "a '%' that is not %n, %r or %%" : "a '%' at the end";
    }
    return NULL;
}

static bool has_placeholder(const char *p) {
    for (const char *s = p; *s; s++)
        if (*s == '%') {
            if (s[1] == 'n' || s[1] == 'r') return true;
            if (s[1]) s++;
        }
    return false;
}

int ckpt__tier_configure(ckpt_tier *t, const ckpt_project_config *cfg, int nprocs) {
    memset(t, 0, sizeof *t);
    t->lock.fd = -1;
    t->highest = -1;
    const char *w = "accelerator_new";
    if (cfg->persist_every < 0)
        return ckpt__err(CKPT_EINVAL, "%s: persist_every is %d, expected >= 0 (0: every save)", w,
                         cfg->persist_every);
    if (cfg->ranks_per_node < 0)
        return ckpt__err(CKPT_EINVAL,
                         "%s: ranks_per_node is %d, expected >= 0 (0: the communicator's)", w,
                         cfg->ranks_per_node);
    if (cfg->local_total_limit < 0)
        return ckpt__err(CKPT_EINVAL, "%s: local_total_limit is %d, expected >= 0 (0: 1)", w,
                         cfg->local_total_limit);
    if (!cfg->local_dir || !cfg->local_dir[0]) return CKPT_OK;
    const char *why = pattern_problem(cfg->local_dir);
    if (why)
        return ckpt__err(CKPT_EINVAL, "%s: local_dir '%s' has %s", w, cfg->local_dir, why);
    if (!cfg->project_dir)
        return ckpt__err(CKPT_EINVAL,
                         "%s: local_dir needs a project_dir (every persist_every-th save, and the "
                         "last one, go there)",
                         w);
    if (cfg->ranks_per_node > 0 && nprocs % cfg->ranks_per_node != 0)
        return ckpt__err(CKPT_EINVAL,
                         "%s: ranks_per_node %d does not divide the %d processes into nodes", w,
                         cfg->ranks_per_node, nprocs);
    /* Simulated nodes on fewer machines would share one folder. */
    if (cfg->ranks_per_node > 0 && cfg->comm &&
        cfg->comm->num_nodes < nprocs / cfg->ranks_per_node && !has_placeholder(cfg->local_dir))
        return ckpt__err(CKPT_EINVAL,
                         "%s: local_dir '%s' has neither %%n nor %%r, and ranks_per_node %d "
                         "makes %d nodes of ranks on %d machine%s: they would share one folder",
                         w, cfg->local_dir, cfg->ranks_per_node, nprocs / cfg->ranks_per_node,
                         cfg->comm->num_nodes, cfg->comm->num_nodes == 1 ? "" : "s");
    if (!(t->pattern = ckpt__strdup(cfg->local_dir))) return ckpt__err_nomem("local_dir");
    t->replicas_cfg = cfg->local_replicas;
    t->persist_every = cfg->persist_every ? cfg->persist_every : 1;
    t->per_node_cfg = cfg->ranks_per_node;
    t->keep = cfg->local_total_limit ? cfg->local_total_limit : 1;
    return CKPT_OK;
}

void ckpt__tier_free(ckpt_tier *t) {
    ckpt__lock_release(&t->lock);
    free(t->pattern);
    free(t->root);
    free(t->dir);
    memset(t, 0, sizeof *t);
    t->lock.fd = -1;
}

char *ckpt__tier_expand(const char *pattern, int node, int rank) {
    size_t cap = strlen(pattern) * 6 + 1; /* each %x at most 11 digits from 2 bytes */
    char *out = ckpt__malloc(cap);
    if (!out) return NULL;
    size_t n = 0;
    for (const char *s = pattern; *s; s++) {
        if (s[0] == '%' && (s[1] == 'n' || s[1] == 'r')) {
            n += (size_t)snprintf(out + n, cap - n, "%d", s[1] == 'n' ? node : rank);
            s++;
        } else if (s[0] == '%' && s[1] == '%') {
            out[n++] = '%';
            s++;
        } else {
            out[n++] = *s;
        }
    }
    out[n] = '\0';
    return out;
}

/* ---- placement ------------------------------------------------------------- */

int ckpt__tier_replica_holder(const ckpt_tier *t, int nprocs, int q, int k) {
    return (int)(((int64_t)q + (int64_t)k * t->per_node) % nprocs);
}

int ckpt__tier_replica_source(const ckpt_tier *t, int nprocs, int holder, int k) {
    int64_t s = ((int64_t)holder - (int64_t)k * t->per_node) % nprocs;
    return (int)(s < 0 ? s + nprocs : s);
}

/* ---- this rank's folder ------------------------------------------------------ */

/* This rank's part of the setup: the folder made and locked. */
static int setup_folder(ckpt_accelerator *acc) {
    ckpt_tier *t = &acc->tier;
    int rank = acc->comm->rank;
    t->root = ckpt__tier_expand(t->pattern, t->node, rank);
    char sub[32];
    snprintf(sub, sizeof sub, "rank_%d", rank);
    if (!t->root || !(t->dir = ckpt__path_join(t->root, sub))) return ckpt__err_nomem("local_dir");
    int rc = ckpt__mkdirs(t->dir);
    if (rc < 0) return ckpt__err_prefix(rc, "local_dir");
    char *lp = ckpt__path_join(t->dir, ".lock");
    if (!lp) return ckpt__err_nomem("local_dir");
    rc = ckpt__lock_acquire(&t->lock, lp, false);
    free(lp);
    if (rc < 0) return ckpt__err_prefix(rc, "local_dir");
    t->ram = ckpt__in_memory_fs(t->dir);
    return CKPT_OK;
}

int ckpt__tier_setup(ckpt_accelerator *acc) {
    ckpt_tier *t = &acc->tier;
    const ckpt_comm *c = acc->comm;
    if (t->ready) return CKPT_OK;
    int p = c->size, rc = CKPT_OK;
    /* The node split: configured, or the communicator's, which must put
     * rank r on node r / J for every rank with one J. */
    int j = t->per_node_cfg > 0 ? t->per_node_cfg : (c->local_size > 0 ? c->local_size : 1);
    int64_t v[3] = {1, j, -j};
    if (t->per_node_cfg == 0 && (p % j != 0 || c->node != c->rank / j)) v[0] = 0;
    if (p > 1) {
        int crc = c->allreduce_i64(c->ctx, v, 3, CKPT_REDUCE_MIN);
        if (crc < 0) return ckpt__err_prefix(crc, "local_dir: communicator: allreduce");
    }
    if (!v[0] || v[1] != -v[2])
        rc = ckpt__err(CKPT_EINVAL,
                       "local_dir: the ranks are not laid out by node (rank r on node r / J, "
                       "the same J ranks on every node): place them by core or slot (mpirun "
                       "--map-by core, Slurm's block distribution), or set ranks_per_node");
    if (rc == 0) {
        t->per_node = j;
        t->nodes = p / j;
        t->node = c->rank / j;
        int want = t->replicas_cfg == 0 ? 1 : t->replicas_cfg < 0 ? 0 : t->replicas_cfg;
        t->replicas = want < t->nodes - 1 ? want : t->nodes - 1;
        if (t->replicas < t->replicas_cfg && c->rank == 0) /* asked for explicitly */
            ckpt__log(&acc->log, CKPT_LOG_WARNING,
                      "local_replicas %d, but the job has %d node%s (%d rank%s each): %d "
                      "replica%s of each part, on the other nodes",
                      want, t->nodes, t->nodes == 1 ? "" : "s", j, j == 1 ? "" : "s", t->replicas,
                      t->replicas == 1 ? "" : "s");
        rc = setup_folder(acc);
    }
    rc = ckpt__coll_agree(c, rc, NULL);
    if (rc == 0) t->ready = true;
    else {
        ckpt__lock_release(&t->lock);
        free(t->root);
        free(t->dir);
        t->root = t->dir = NULL;
    }
    return rc;
}

int ckpt__tier_list(ckpt_accelerator *acc, int64_t **nums, int64_t *count) {
    ckpt_tier *t = &acc->tier;
    *nums = NULL;
    *count = 0;
    int rc = ckpt__remove_leftovers(t->dir, NULL, &acc->log);
    if (rc == 0) rc = ckpt__list_numbers(t->dir, nums, count);
    if (rc < 0) return ckpt__err_prefix(rc, "local_dir");
    t->highest = *count > 0 ? (*nums)[*count - 1] : -1;
    return CKPT_OK;
}

char *ckpt__tier_folder(const ckpt_tier *t, int64_t n) {
    char name[48];
    snprintf(name, sizeof name, "checkpoint_%" PRId64, n);
    return ckpt__path_join(t->dir, name);
}

/* ---- moving bytes ------------------------------------------------------------- */

int ckpt__tier_exchange(const ckpt_comm *c, const void *sbuf, size_t sn, int dest, void *rbuf,
                        size_t rn, int src) {
    if (c->size <= 1) {
        if (rn && sn == rn && dest == 0 && src == 0) memcpy(rbuf, sbuf, rn);
        return CKPT_OK;
    }
    if (c->exchange) {
        int crc = c->exchange(c->ctx, sbuf, sn, dest, rbuf, rn, src);
        return crc < 0 ? ckpt__err_prefix(crc, "communicator: exchange") : CKPT_OK;
    }
    /* Without an exchange: one gather per receiving rank, the others
     * sending nothing. Every rank takes part in every gather. */
    size_t *lens = ckpt__calloc((size_t)c->size, sizeof *lens);
    if (!lens) return ckpt__err_nomem("exchange");
    int rc = CKPT_OK;
    for (int root = 0; root < c->size; root++) {
        void *all = NULL;
        bool to_root = dest == root && sn > 0;
        int crc = c->gather(c->ctx, sbuf, to_root ? sn : 0, &all, lens, root);
        if (crc < 0 && rc == 0) rc = ckpt__err_prefix(crc, "communicator: gather");
        if (crc == 0 && root == c->rank && rn > 0 && src >= 0 && src < c->size) {
            size_t off = 0;
            for (int r = 0; r < src; r++) off += lens[r];
            if (lens[src] != rn && rc == 0)
                rc = ckpt__err(CKPT_EIO, "exchange: %zu bytes from rank %d, expected %zu",
                               lens[src], src, rn);
            else if (rc == 0) memcpy(rbuf, (const char *)all + off, rn);
        }
        free(all);
    }
    free(lens);
    return rc;
}
