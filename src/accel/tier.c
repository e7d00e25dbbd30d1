/* tier.c — node-local tiers: the configuration, the placement rule, each
 * rank's folder and its lock, and moving bytes between two ranks (tier.h). */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

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
    if (why) return ckpt__err(CKPT_EINVAL, "%s: local_dir '%s' has %s", w, cfg->local_dir, why);
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

typedef struct text_ctx {
    const char *p;
    size_t n;
} text_ctx;

static int fill_text(ckpt_ostream *s, void *ctx) {
    const text_ctx *t = ctx;
    return ckpt__ostream_write(s, t->p, t->n);
}

/* A local folder serves one project: its "project" file names it (the
 * project_dir made absolute), so that a load never takes another run's
 * saves for this one's. Written the first time; another project's is
 * CKPT_EINVAL. */
static int claim_folder(ckpt_accelerator *acc) {
    const ckpt_tier *t = &acc->tier;
    char cwd[4096] = "";
    const char *pd = acc->project_dir;
    if (pd[0] != '/' && !getcwd(cwd, sizeof cwd))
        return ckpt__err_os(errno, "local_dir: the current folder");
    size_t n = strlen(cwd) + strlen(pd) + 3;
    char *want = ckpt__malloc(n), *path = ckpt__path_join(t->dir, "project");
    int rc = want && path ? CKPT_OK : ckpt__err_nomem("local_dir");
    if (rc == 0) snprintf(want, n, "%s%s%s\n", cwd, cwd[0] ? "/" : "", pd);
    char *have = NULL;
    size_t hl = 0;
    struct stat st;
    if (rc == 0 && ckpt__os_lstat(path, &st) == 0) {
        rc = ckpt__read_small_file(path, true, 8192, &have, &hl);
        if (rc == 0 && (hl != strlen(want) || memcmp(have, want, hl) != 0))
            rc = ckpt__err(CKPT_EINVAL,
                           "local_dir: %s keeps the node-local checkpoints of the project %.*s, "
                           "not of %.*s: give each project a local_dir of its own (or remove "
                           "that folder)",
                           t->dir, (int)(hl && have[hl - 1] == '\n' ? hl - 1 : hl), have,
                           (int)strlen(want) - 1, want);
        if (rc < 0 && rc != CKPT_EINVAL) rc = ckpt__err_prefix(rc, "local_dir");
    } else if (rc == 0) {
        text_ctx tc = {want, strlen(want)};
        rc = ckpt__publish_file(path, fill_text, &tc, NULL, NULL);
        if (rc < 0) rc = ckpt__err_prefix(rc, "local_dir");
    }
    free(have);
    free(want);
    free(path);
    return rc;
}

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
    return claim_folder(acc);
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

/* ---- what a local folder holds ------------------------------------------------ */

/* Whether file f of dir is there, a regular file of its listed size, and
 * with deep, of its listed checksum; if not, why. */
static int check_file(const char *dir, const ckpt_manifest_file *f, bool deep, char *why,
                      size_t cap) {
    char *path = ckpt__path_join(dir, f->name);
    if (!path) return ckpt__err_nomem("local_dir");
    struct stat st;
    int ok = 1;
    if (ckpt__os_lstat(path, &st) != 0) {
        snprintf(why, cap, "%s: %s: %s", dir, f->name,
                 errno == ENOENT ? "missing" : strerror(errno));
        ok = 0;
    } else if (!S_ISREG(st.st_mode) || (uint64_t)st.st_size != f->size) {
        snprintf(why, cap, "%s: %s: %s", dir, f->name,
                 !S_ISREG(st.st_mode) ? "not a regular file" : "size differs from the manifest's");
        ok = 0;
    } else if (deep) {
        uint64_t h = 0;
        int rc = ckpt__read_hashed(path, path, f->size, NULL, &h);
        if (rc == CKPT_ENOMEM) {
            free(path);
            return rc;
        }
        if (rc < 0 || h != f->xxh3) {
            snprintf(why, cap, "%s", rc < 0 ? ckpt_errmsg() : "");
            if (rc == 0) snprintf(why, cap, "%s: %s: checksum mismatch", dir, f->name);
            ok = 0;
        }
    }
    free(path);
    return ok;
}

int ckpt__tier_scan(const char *dir, bool deep, int own, ckpt_tier_scan *out, ckpt_manifest *m,
                    char **text, size_t *len, char *why, size_t cap) {
    memset(out, 0, sizeof *out);
    out->number = -1;
    if (why && cap) why[0] = '\0';
    char tmpwhy[1024];
    if (!why) {
        why = tmpwhy;
        cap = sizeof tmpwhy;
    }
    char base[256];
    size_t n = strlen(dir), s = n;
    while (s > 0 && dir[s - 1] != '/') s--;
    snprintf(base, sizeof base, "%s", dir + s);
    int64_t num;
    if (ckpt__parse_checkpoint_name(base, &num)) out->number = num;
    char *path = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
    if (!path) return ckpt__err_nomem("local_dir");
    char *t = NULL;
    size_t tl = 0;
    ckpt_manifest mm;
    ckpt__manifest_init(&mm);
    int rc = ckpt__read_small_file(path, true, CKPT_MANIFEST_MAX_BYTES, &t, &tl);
    if (rc == 0) rc = ckpt__manifest_parse(t, tl, path, &mm);
    free(path);
    if (rc == CKPT_ENOMEM) {
        free(t);
        ckpt__manifest_clear(&mm);
        return rc;
    }
    if (rc < 0) {
        snprintf(why, cap, "%s", ckpt_errmsg());
        out->bad = true;
        free(t);
        ckpt__manifest_clear(&mm);
        return CKPT_OK;
    }
    out->digest = ckpt__xxh3(t, tl);
    out->num_processes = mm.num_processes;
    out->step = mm.step;
    out->created_unix = mm.created_unix;
    /* per rank: 1 every file of its part is fine so far, 0 one is not,
     * -1 it has no file here */
    int np = mm.num_processes > 0 ? mm.num_processes : 1;
    signed char *ok = ckpt__malloc((size_t)np);
    if (!ok) {
        free(t);
        ckpt__manifest_clear(&mm);
        return ckpt__err_nomem("local_dir");
    }
    memset(ok, -1, (size_t)np);
    for (int64_t j = 0; j < mm.nfiles; j++) {
        const ckpt_manifest_file *f = &mm.files[j];
        int q = f->rank >= 0 && f->rank < np ? f->rank : 0;
        char *fp = ckpt__path_join(dir, f->name);
        struct stat st;
        bool there = fp && ckpt__os_lstat(fp, &st) == 0;
        free(fp);
        if (!there) {
            if (ok[q] == 1) ok[q] = 0;        /* a part with some files missing: not held */
            else if (ok[q] == -1) ok[q] = -2; /* none here so far */
            continue;
        }
        if (ok[q] == -2) ok[q] = 0; /* this one is there, an earlier one missing */
        if (ok[q] == -1) ok[q] = 1;
        char w[1024];
        int c = check_file(dir, f, deep && f->rank != own, w, sizeof w);
        if (c < 0) {
            free(ok);
            free(t);
            ckpt__manifest_clear(&mm);
            return c;
        }
        if (c == 0) {
            if (ok[q] == 1) ok[q] = 0;
            if (!out->bad) snprintf(why, cap, "%s", w);
            out->bad = true;
        } else {
            out->bytes += f->size;
        }
    }
    for (int q = 0; q < np && out->nparts < CKPT_TIER_MAX_PARTS; q++)
        if (ok[q] == 1) out->parts[out->nparts++] = q;
    free(ok);
    if (m) *m = mm;
    else ckpt__manifest_clear(&mm);
    if (text) {
        *text = t;
        *len = tl;
    } else {
        free(t);
    }
    return CKPT_OK;
}

/* ---- a part as a stream of bytes --------------------------------------------- */

/* The files of one rank's part (manifest order) as one stream of bytes,
 * read from a folder. */

/* The next n bytes of the part into buf (zeros after a failure, so that
 * the exchanges stay paired; the receiver's digest then refuses them). */
int ckpt__part_read(ckpt_part_reader *pr, uint8_t *buf, size_t n, int rc) {
    size_t done = 0;
    while (done < n) {
        if (pr->j >= pr->m->nfiles) {
            memset(buf + done, 0, n - done);
            return rc == 0 ? ckpt__err(CKPT_EINVAL, "replication: part shorter than planned") : rc;
        }
        const ckpt_manifest_file *f = &pr->m->files[pr->j];
        if (f->rank != pr->rank || pr->off == f->size) {
            if (pr->fd >= 0) ckpt__os_close(pr->fd);
            pr->fd = -1;
            pr->off = 0;
            pr->j++;
            continue;
        }
        size_t want = f->size - pr->off < n - done ? (size_t)(f->size - pr->off) : n - done;
        if (rc == 0 && pr->fd < 0) {
            char *path = ckpt__path_join(pr->dir, f->name);
            pr->fd = path ? ckpt__open_read(path, path, true, NULL) : ckpt__err_nomem("replica");
            free(path);
            if (pr->fd < 0) {
                rc = pr->fd;
                pr->fd = -1;
            }
        }
        ssize_t got = -1;
        if (rc == 0) {
            got = ckpt__os_pread(pr->fd, buf + done, want, pr->off);
            if (got < 0) rc = ckpt__err_os(errno, "%s/%s: read", pr->dir, f->name);
            else if ((size_t)got < want)
                rc = ckpt__err(CKPT_ECORRUPT, "%s/%s: shorter than its %" PRIu64 " bytes", pr->dir,
                               f->name, f->size);
        }
        if (rc < 0) memset(buf + done, 0, want);
        done += want;
        pr->off += want;
    }
    return rc;
}

void ckpt__part_reader_end(ckpt_part_reader *pr) {
    if (pr->fd >= 0) ckpt__os_close(pr->fd);
    pr->fd = -1;
}
