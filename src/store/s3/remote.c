/* remote.c — a project folder in object storage (remote.h): scan, check,
 * fetch, publish, remove, leftovers and the lease lock. */
#include "store/s3/remote.h"
#include "store/s3/remote_int.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <xxhash.h>

#include "base/io.h"
#include "store/store.h"
#include "store/txn.h"

int ckpt__remote_open(ckpt_remote *r, const char *url) {
    *r = (ckpt_remote){0};
    CKPT_TRY(ckpt__s3_available(url));
    CKPT_TRY(ckpt__s3_parse_url(url, &r->bucket, &r->prefix));
    size_t n = strlen(r->bucket) + strlen(r->prefix) + 8;
    r->url = ckpt__malloc(n);
    if (!r->url) {
        ckpt__remote_close(r);
        return ckpt__err_nomem("s3 URL");
    }
    snprintf(r->url, n, "s3://%s%s%s", r->bucket, *r->prefix ? "/" : "", r->prefix);
    int rc = ckpt__s3_new(&r->c, r->bucket);
    if (rc < 0) ckpt__remote_close(r);
    return rc;
}

void ckpt__remote_close(ckpt_remote *r) {
    ckpt__s3_free(r->c);
    free(r->bucket);
    free(r->prefix);
    free(r->url);
    *r = (ckpt_remote){0};
}

char *ckpt__remote_key(const ckpt_remote *r, const char *rel) {
    if (!*r->prefix) return ckpt__strdup(rel);
    return ckpt__path_join(r->prefix, rel);
}

char *ckpt__remote_number_key(const ckpt_remote *r, int64_t number) {
    char rel[80];
    snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, number);
    return ckpt__remote_key(r, rel);
}

/* ---- scan ------------------------------------------------------------------ */

typedef struct scan_ctx {
    size_t plen; /* length of "<prefix>/checkpoints/" */
    ckpt_remote_entry *v;
    int64_t n, cap;
} scan_ctx;

static ckpt_remote_entry *entry_for(scan_ctx *s, int64_t number) {
    for (int64_t i = s->n - 1; i >= 0; i--)
        if (s->v[i].number == number) return &s->v[i];
    if (s->n == s->cap) {
        int64_t cap = s->cap ? s->cap * 2 : 16;
        ckpt_remote_entry *nv = ckpt__realloc(s->v, (size_t)cap * sizeof *nv);
        if (!nv) return NULL;
        s->v = nv;
        s->cap = cap;
    }
    s->v[s->n] = (ckpt_remote_entry){.number = number};
    return &s->v[s->n++];
}

static int entry_add(ckpt_remote_entry *e, const char *name, uint64_t size) {
    if (e->nobjects == e->cap) {
        int64_t cap = e->cap ? e->cap * 2 : 16;
        char **nn = ckpt__realloc(e->names, (size_t)cap * sizeof *nn);
        if (!nn) return ckpt__err_nomem("s3 checkpoint list");
        e->names = nn;
        uint64_t *ns = ckpt__realloc(e->sizes, (size_t)cap * sizeof *ns);
        if (!ns) return ckpt__err_nomem("s3 checkpoint list");
        e->sizes = ns;
        e->cap = cap;
    }
    if (!(e->names[e->nobjects] = ckpt__strdup(name))) return ckpt__err_nomem("s3 checkpoint list");
    e->sizes[e->nobjects++] = size;
    e->bytes += size;
    return 0;
}

static int scan_item(void *user, const char *key, uint64_t size, bool is_prefix) {
    scan_ctx *s = user;
    if (is_prefix || strlen(key) <= s->plen) return 0;
    const char *rest = key + s->plen, *slash = strchr(rest, '/');
    if (!slash || !slash[1]) return 0; /* .lock and the like */
    char name[64];
    size_t nl = (size_t)(slash - rest);
    if (nl >= sizeof name) return 0;
    memcpy(name, rest, nl);
    name[nl] = '\0';
    int64_t number;
    if (!ckpt__parse_checkpoint_name(name, &number)) return 0;
    ckpt_remote_entry *e = entry_for(s, number);
    if (!e) return ckpt__err_nomem("s3 checkpoint list");
    if (strcmp(slash + 1, CKPT_MANIFEST_NAME) == 0) e->committed = true;
    return entry_add(e, slash + 1, size);
}

static int cmp_entry(const void *a, const void *b) {
    int64_t x = ((const ckpt_remote_entry *)a)->number, y = ((const ckpt_remote_entry *)b)->number;
    return (x > y) - (x < y);
}

void ckpt__remote_scan_free(ckpt_remote_entry *v, int64_t count) {
    for (int64_t i = 0; v && i < count; i++) {
        for (int64_t k = 0; k < v[i].nobjects; k++) free(v[i].names[k]);
        free(v[i].names);
        free(v[i].sizes);
    }
    free(v);
}

int ckpt__remote_scan(ckpt_remote *r, ckpt_remote_entry **out, int64_t *count) {
    *out = NULL;
    *count = 0;
    char *dir = ckpt__remote_key(r, "checkpoints/");
    if (!dir) return ckpt__err_nomem("s3 checkpoint list");
    scan_ctx s = {.plen = strlen(dir)};
    int rc = ckpt__s3_list(r->c, dir, NULL, scan_item, &s);
    free(dir);
    if (rc < 0) {
        ckpt__remote_scan_free(s.v, s.n);
        return rc;
    }
    if (s.n > 1) qsort(s.v, (size_t)s.n, sizeof *s.v, cmp_entry);
    *out = s.v;
    *count = s.n;
    return 0;
}

const ckpt_remote_entry *ckpt__remote_find(const ckpt_remote_entry *v, int64_t n, int64_t number) {
    for (int64_t i = 0; i < n; i++)
        if (v[i].number == number) return &v[i];
    return NULL;
}

/* ---- manifest and check ---------------------------------------------------- */

int ckpt__remote_manifest(ckpt_remote *r, const char *dir, ckpt_manifest *m) {
    ckpt__manifest_init(m);
    char *key = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
    if (!key) return ckpt__err_nomem("s3 manifest");
    char *text = NULL;
    size_t len = 0;
    int rc = ckpt__s3_get_small(r->c, key, CKPT_MANIFEST_MAX_BYTES, &text, &len, NULL);
    if (rc == CKPT_ENOENT)
        rc = ckpt__err(CKPT_ENOENT,
                       "s3://%s/%s: no " CKPT_MANIFEST_NAME
                       " (not a checkpoint, or a save that did not finish)",
                       r->bucket, dir);
    char what[600];
    snprintf(what, sizeof what, "s3://%s/%s", r->bucket, key);
    if (rc == 0) rc = ckpt__manifest_parse(text, len, what, m);
    free(text);
    free(key);
    return rc;
}

/* Every object under key dir/ (an entry of its own, number unused). */
static int list_item(void *user, const char *key, uint64_t size, bool is_prefix) {
    scan_ctx *s = user;
    if (is_prefix || strlen(key) <= s->plen) return 0;
    return entry_add(&s->v[0], key + s->plen, size);
}

int ckpt__remote_list_dir(ckpt_remote *r, const char *dir, ckpt_remote_entry *e) {
    *e = (ckpt_remote_entry){.number = -1};
    char *p = ckpt__malloc(strlen(dir) + 2);
    if (!p) return ckpt__err_nomem("s3 listing");
    sprintf(p, "%s/", dir);
    scan_ctx s = {.plen = strlen(p), .v = e, .n = 1};
    int rc = ckpt__s3_list(r->c, p, NULL, list_item, &s);
    free(p);
    return rc;
}

void ckpt__remote_entry_clear(ckpt_remote_entry *e) {
    for (int64_t k = 0; k < e->nobjects; k++) free(e->names[k]);
    free(e->names);
    free(e->sizes);
    *e = (ckpt_remote_entry){.number = -1};
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

/* Every file m lists is in e with its size, no state file is unlisted:
 * what a look at a folder tells before anything is read. url names the
 * checkpoint in messages. */
int ckpt__remote_check_listing(const char *url, const ckpt_manifest *m,
                               const ckpt_remote_entry *e) {
    for (int64_t i = 0; i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        int64_t j = 0;
        while (j < e->nobjects && strcmp(e->names[j], f->name) != 0) j++;
        if (j == e->nobjects)
            return ckpt__err(CKPT_ECORRUPT, "%s: %s is listed in the manifest but missing", url,
                             f->name);
        if (e->sizes[j] != f->size)
            return ckpt__err(
                CKPT_ECORRUPT, "%s: %s: size %" PRIu64 " bytes, the manifest says %" PRIu64 "%s",
                url, f->name, e->sizes[j], f->size, e->sizes[j] < f->size ? " (truncated)" : "");
    }
    for (int64_t j = 0; j < e->nobjects; j++)
        if (ends_with(e->names[j], ".safetensors") && !ckpt__manifest_find(m, e->names[j]))
            return ckpt__err(CKPT_ECORRUPT, "%s: %s is not listed in the manifest", url,
                             e->names[j]);
    return 0;
}

int ckpt__remote_check(ckpt_remote *r, const char *dir, const ckpt_remote_entry *e, bool deep,
                       ckpt_manifest *m, bool *have_manifest) {
    *have_manifest = false;
    CKPT_TRY(ckpt__remote_manifest(r, dir, m));
    *have_manifest = true;
    char url[1200];
    snprintf(url, sizeof url, "s3://%s/%s", r->bucket, dir);
    ckpt_remote_entry own = {.number = -1};
    int rc = e ? 0 : ckpt__remote_list_dir(r, dir, &own);
    if (rc == 0) rc = ckpt__remote_check_listing(url, m, e ? e : &own);
    ckpt__remote_entry_clear(&own);
    for (int64_t i = 0; rc == 0 && deep && i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        char *key = ckpt__path_join(dir, f->name);
        uint64_t h = 0;
        rc = key ? ckpt__s3_get_stream(r->c, key, f->size, NULL, NULL, &h)
                 : ckpt__err_nomem("s3 key");
        if (rc == 0 && h != f->xxh3)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "s3://%s/%s: checksum mismatch (XXH3-64 %016" PRIx64
                           ", the manifest records %016" PRIx64 ")",
                           r->bucket, key, h, f->xxh3);
        free(key);
    }
    return rc;
}

/* ---- a load's read phase ------------------------------------------------------ */

int ckpt__remote_open_manifest(ckpt_remote *r, const char *dir, const char *url,
                               ckpt_checkpoint_open *c) {
    memset(c, 0, sizeof *c);
    int rc = ckpt__remote_manifest(r, dir, &c->m);
    if (rc == CKPT_ENOENT) {
        /* a prefix with objects but no manifest: a save that did not finish */
        ckpt_remote_entry e;
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
        if (ckpt__remote_list_dir(r, dir, &e) == 0 && e.nobjects > 0) c->no_manifest = true;
        ckpt__remote_entry_clear(&e);
        ckpt__err(rc, "%s", saved);
    }
    if (rc < 0) return rc;
    c->have_manifest = true;
    for (int64_t i = 0; i < c->m.nfiles; i++)
        if (__builtin_add_overflow(c->total_bytes, c->m.files[i].size, &c->total_bytes))
            c->total_bytes = UINT64_MAX;
    (void)url;
    return 0;
}

typedef struct read_src {
    ckpt_remote *r;
    const char *dir, *url;
} read_src;

static int src_check(void *ctx, const ckpt_manifest *m) {
    read_src *s = ctx;
    ckpt_remote_entry e;
    int rc = ckpt__remote_list_dir(s->r, s->dir, &e);
    if (rc == 0) rc = ckpt__remote_check_listing(s->url, m, &e);
    ckpt__remote_entry_clear(&e);
    return rc;
}

static int src_read(void *ctx, const ckpt_manifest *m, const int64_t *idx, int64_t n,
                    uint8_t *const *dst, uint64_t *h) {
    read_src *s = ctx;
    char **keys = ckpt__calloc((size_t)(n ? n : 1), sizeof *keys);
    uint64_t *sizes = ckpt__calloc((size_t)(n ? n : 1), sizeof *sizes);
    uint8_t **to = ckpt__calloc((size_t)(n ? n : 1), sizeof *to);
    uint64_t *got = ckpt__calloc((size_t)(n ? n : 1), sizeof *got);
    int rc = keys && sizes && to && got ? 0 : ckpt__err_nomem("s3 read");
    for (int64_t k = 0; rc == 0 && k < n; k++) {
        const ckpt_manifest_file *f = &m->files[idx[k]];
        if (!(keys[k] = ckpt__path_join(s->dir, f->name))) rc = ckpt__err_nomem("s3 key");
        sizes[k] = f->size;
        to[k] = dst[idx[k]];
    }
    if (rc == 0)
        rc = ckpt__s3_get_many(s->r->c, n, (const char *const *)keys, sizes, to, got, NULL);
    for (int64_t k = 0; rc == 0 && k < n; k++) h[idx[k]] = got[k];
    for (int64_t k = 0; keys && k < n; k++) free(keys[k]);
    free(keys);
    free(sizes);
    free(to);
    free(got);
    return rc;
}

int ckpt__remote_read_files(ckpt_remote *r, const char *dir, const char *url, const bool *shallow,
                            ckpt_arena *arena, ckpt_checkpoint_open *c) {
    read_src s = {r, dir, url};
    ckpt_file_source src = {&s, src_check, src_read};
    return ckpt__checkpoint_read_files_from(&src, url, shallow, arena, c);
}

/* ---- fetch ------------------------------------------------------------------ */

static int write_piece(void *user, const uint8_t *p, size_t n) {
    return ckpt__ostream_write(user, p, n);
}

int ckpt__remote_fetch(ckpt_remote *r, const char *dir, const char *local_dir,
                       const ckpt_logger *lg) {
    ckpt_manifest m;
    CKPT_TRY(ckpt__remote_manifest(r, dir, &m));
    ckpt_txn t;
    int rc = ckpt__txn_begin(&t, local_dir, "fetch", true, lg);
    for (int64_t i = 0; rc == 0 && i < m.nfiles; i++) {
        const ckpt_manifest_file *f = &m.files[i];
        char *key = ckpt__path_join(dir, f->name);
        char *path = ckpt__path_join(t.tmp, f->name);
        ckpt_ostream s;
        memset(&s, 0, sizeof s);
        uint64_t h = 0;
        if (!key || !path) rc = ckpt__err_nomem("s3 fetch");
        if (rc == 0) rc = ckpt__ostream_open(&s, path);
        if (rc == 0) rc = ckpt__s3_get_stream(r->c, key, f->size, write_piece, &s, &h);
        if (rc == 0 && h != f->xxh3)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "s3://%s/%s: does not match the manifest (XXH3-64 %016" PRIx64
                           ", the manifest records %016" PRIx64 ")",
                           r->bucket, key, h, f->xxh3);
        if (rc == 0) rc = ckpt__ostream_finish(&s, NULL, NULL);
        else ckpt__ostream_abort(&s);
        free(key);
        free(path);
    }
    /* the manifest last, as fetched (it checks itself) */
    char *mkey = rc == 0 ? ckpt__path_join(dir, CKPT_MANIFEST_NAME) : NULL;
    char *text = NULL;
    size_t len = 0;
    if (rc == 0 && !mkey) rc = ckpt__err_nomem("s3 fetch");
    if (rc == 0) rc = ckpt__s3_get_small(r->c, mkey, CKPT_MANIFEST_MAX_BYTES, &text, &len, NULL);
    if (rc == 0) {
        ckpt_manifest again;
        char what[64] = "fetched manifest";
        rc = ckpt__manifest_parse(text, len, what, &again);
        if (rc == 0 && (again.nfiles != m.nfiles || again.created_unix != m.created_unix))
            rc = ckpt__err(CKPT_ECORRUPT, "s3://%s/%s: the manifest changed during the fetch",
                           r->bucket, mkey);
        ckpt__manifest_clear(&again);
    }
    char *mpath = rc == 0 ? ckpt__path_join(t.tmp, CKPT_MANIFEST_NAME) : NULL;
    if (rc == 0 && !mpath) rc = ckpt__err_nomem("s3 fetch");
    if (rc == 0) {
        ckpt_ostream s;
        rc = ckpt__ostream_open(&s, mpath);
        if (rc == 0) rc = ckpt__ostream_write(&s, text, len);
        if (rc == 0) rc = ckpt__ostream_finish(&s, NULL, NULL);
        else ckpt__ostream_abort(&s);
    }
    if (rc == 0) rc = ckpt__txn_commit(&t, false, lg);
    ckpt__txn_end(&t, lg);
    free(mpath);
    free(mkey);
    free(text);
    ckpt__manifest_clear(&m);
    return rc;
}

/* ---- the lease lock --------------------------------------------------------- */

int64_t ckpt__remote_lease(void) {
    const char *v = getenv("CKPT_S3_LOCK_LEASE");
    char *end = NULL;
    long long n = v ? strtoll(v, &end, 10) : 0;
    return v && end && !*end && n > 0 ? (int64_t)n : 900;
}

static void owner_line(char *out, size_t cap) {
    char host[256];
    if (gethostname(host, sizeof host) != 0) snprintf(host, sizeof host, "unknown");
    host[sizeof host - 1] = '\0';
    for (char *p = host; *p; p++)
        if (*p == ' ' || (unsigned char)*p < 0x21) *p = '_';
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    snprintf(out, cap, "%s %ld %lx%lx\n", host, (long)getpid(), (unsigned long)ts.tv_nsec,
             (unsigned long)ts.tv_sec);
}

/* Whether a holder line names a process of this host that is gone. */
static bool holder_dead_here(const char *text) {
    char host[256], mine[256];
    long pid = 0;
    if (sscanf(text, "%255s %ld", host, &pid) != 2 || pid <= 0) return false;
    if (gethostname(mine, sizeof mine) != 0) return false;
    mine[sizeof mine - 1] = '\0';
    for (char *p = mine; *p; p++)
        if (*p == ' ' || (unsigned char)*p < 0x21) *p = '_';
    if (strcmp(host, mine) != 0) return false;
    return kill((pid_t)pid, 0) != 0 && errno == ESRCH;
}

int ckpt__remote_lock(ckpt_remote *r, ckpt_remote_lock *lk, const ckpt_logger *lg) {
    memset(lk, 0, sizeof *lk);
    char *key = ckpt__remote_key(r, "checkpoints/.lock");
    if (!key) return ckpt__err_nomem("s3 lock");
    owner_line(lk->owner, sizeof lk->owner);
    int rc = 0;
    for (int tries = 0; tries < 5; tries++) {
        rc = ckpt__s3_put(r->c, key, lk->owner, strlen(lk->owner), CKPT_S3_IF_ABSENT, NULL,
                          lk->etag);
        if (rc != CKPT_EEXIST) break;
        /* held: by whom, since when (the server's clock) */
        char *text = NULL;
        size_t len = 0;
        ckpt_s3_head h;
        rc = ckpt__s3_get_small(r->c, key, 4096, &text, &len, &h);
        if (rc == CKPT_ENOENT) continue; /* released meanwhile */
        if (rc < 0) break;
        for (size_t i = 0; i < len; i++)
            if ((unsigned char)text[i] < 0x20 && text[i] != '\n') text[i] = '?';
        int64_t age = h.server_now && h.last_modified ? h.server_now - h.last_modified : 0;
        bool dead = holder_dead_here(text);
        if (!dead && age <= ckpt__remote_lease()) {
            char *nl = strchr(text, '\n');
            if (nl) *nl = '\0';
            rc = ckpt__err(CKPT_EBUSY,
                           "s3://%s/%s is held by another process (%s, renewed %" PRId64
                           " s ago, lease %" PRId64 " s) that saves into this project",
                           r->bucket, key, text, age, ckpt__remote_lease());
            free(text);
            break;
        }
        ckpt__log(lg, CKPT_LOG_WARNING, "taking over s3://%s/%s from %s", r->bucket, key,
                  dead ? "a process of this host that is gone" : "a holder whose lease ran out");
        free(text);
        /* one of several takers wins: the PUT is conditional on the stale ETag */
        rc = ckpt__s3_put(r->c, key, lk->owner, strlen(lk->owner), CKPT_S3_IF_ETAG, h.etag,
                          lk->etag);
        if (rc != CKPT_EEXIST) break;
    }
    if (rc == 0) lk->held = true;
    free(key);
    return rc;
}

int ckpt__remote_lock_renew(ckpt_remote *r, ckpt_remote_lock *lk) {
    if (!lk->held) return ckpt__err(CKPT_EINVAL, "%s: the project lock is not held", r->url);
    char *key = ckpt__remote_key(r, "checkpoints/.lock");
    if (!key) return ckpt__err_nomem("s3 lock");
    char etag[128];
    int rc = ckpt__s3_put(r->c, key, lk->owner, strlen(lk->owner), CKPT_S3_IF_ETAG, lk->etag, etag);
    if (rc == CKPT_EEXIST) {
        lk->held = false;
        rc = ckpt__err(CKPT_EBUSY,
                       "s3://%s/%s: the project lock was taken over by another process (this "
                       "one did not renew it within its lease); not saving",
                       r->bucket, key);
    } else if (rc == 0) {
        snprintf(lk->etag, sizeof lk->etag, "%s", etag);
    }
    free(key);
    return rc;
}

void ckpt__remote_unlock(ckpt_remote *r, ckpt_remote_lock *lk) {
    if (!lk->held) return;
    lk->held = false;
    char *key = ckpt__remote_key(r, "checkpoints/.lock");
    if (!key) return;
    /* still ours? (a DELETE cannot be made conditional everywhere) */
    ckpt_s3_head h;
    if (ckpt__s3_head(r->c, key, &h) == 0 && strcmp(h.etag, lk->etag) == 0)
        (void)ckpt__s3_delete(r->c, key);
    ckpt_clear_error();
    free(key);
}
