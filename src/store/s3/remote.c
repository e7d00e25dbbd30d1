/* remote.c — a project folder in object storage (remote.h): scan, check,
 * fetch, publish, remove, leftovers and the lease lock. */
#include "store/s3/remote.h"

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

/* ---- scan ------------------------------------------------------------------ */

typedef struct scan_ctx {
    size_t plen; /* length of "<prefix>/checkpoints/" */
    ckpt_remote_entry *v;
    int64_t n, cap;
    int err;
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

static int scan_item(void *user, const char *key, uint64_t size, bool is_prefix) {
    scan_ctx *s = user;
    if (is_prefix || strlen(key) <= s->plen) return 0;
    const char *rest = key + s->plen, *slash = strchr(rest, '/');
    if (!slash) return 0; /* .lock and the like */
    char name[64];
    size_t nl = (size_t)(slash - rest);
    if (nl >= sizeof name) return 0;
    memcpy(name, rest, nl);
    name[nl] = '\0';
    int64_t number;
    if (!ckpt__parse_checkpoint_name(name, &number)) return 0;
    ckpt_remote_entry *e = entry_for(s, number);
    if (!e) return ckpt__err_nomem("s3 checkpoint list");
    e->nobjects++;
    e->bytes += size;
    if (strcmp(slash + 1, CKPT_MANIFEST_NAME) == 0) e->committed = true;
    return 0;
}

static int cmp_entry(const void *a, const void *b) {
    int64_t x = ((const ckpt_remote_entry *)a)->number, y = ((const ckpt_remote_entry *)b)->number;
    return (x > y) - (x < y);
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
        free(s.v);
        return rc;
    }
    if (s.n > 1) qsort(s.v, (size_t)s.n, sizeof *s.v, cmp_entry);
    *out = s.v;
    *count = s.n;
    return 0;
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

typedef struct listing {
    char **names;
    uint64_t *sizes;
    int64_t n, cap;
    size_t plen;
} listing;

static int list_item(void *user, const char *key, uint64_t size, bool is_prefix) {
    listing *l = user;
    if (is_prefix || strlen(key) <= l->plen) return 0;
    if (l->n == l->cap) {
        int64_t cap = l->cap ? l->cap * 2 : 32;
        char **nn = ckpt__realloc(l->names, (size_t)cap * sizeof *nn);
        if (!nn) return ckpt__err_nomem("s3 listing");
        l->names = nn;
        uint64_t *ns = ckpt__realloc(l->sizes, (size_t)cap * sizeof *ns);
        if (!ns) return ckpt__err_nomem("s3 listing");
        l->sizes = ns;
        l->cap = cap;
    }
    if (!(l->names[l->n] = ckpt__strdup(key + l->plen))) return ckpt__err_nomem("s3 listing");
    l->sizes[l->n++] = size;
    return 0;
}

static void listing_free(listing *l) {
    for (int64_t i = 0; i < l->n; i++) free(l->names[i]);
    free(l->names);
    free(l->sizes);
}

static int list_dir(ckpt_remote *r, const char *dir, listing *l) {
    *l = (listing){0};
    char *p = ckpt__malloc(strlen(dir) + 2);
    if (!p) return ckpt__err_nomem("s3 listing");
    sprintf(p, "%s/", dir);
    l->plen = strlen(p);
    int rc = ckpt__s3_list(r->c, p, NULL, list_item, l);
    free(p);
    return rc;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t a = strlen(s), b = strlen(suffix);
    return a >= b && strcmp(s + a - b, suffix) == 0;
}

int ckpt__remote_check(ckpt_remote *r, const char *dir, bool deep, ckpt_manifest *m,
                       bool *have_manifest) {
    *have_manifest = false;
    CKPT_TRY(ckpt__remote_manifest(r, dir, m));
    *have_manifest = true;
    listing l;
    int rc = list_dir(r, dir, &l);
    for (int64_t i = 0; rc == 0 && i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        int64_t j = 0;
        while (j < l.n && strcmp(l.names[j], f->name) != 0) j++;
        if (j == l.n)
            rc = ckpt__err(CKPT_ECORRUPT, "s3://%s/%s/%s: missing (the manifest lists it)",
                           r->bucket, dir, f->name);
        else if (l.sizes[j] != f->size)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "s3://%s/%s/%s: %" PRIu64 " bytes, the manifest says %" PRIu64,
                           r->bucket, dir, f->name, l.sizes[j], f->size);
    }
    for (int64_t j = 0; rc == 0 && j < l.n; j++)
        if (ends_with(l.names[j], ".safetensors") && !ckpt__manifest_find(m, l.names[j]))
            rc = ckpt__err(CKPT_ECORRUPT, "s3://%s/%s/%s: a state file the manifest does not list",
                           r->bucket, dir, l.names[j]);
    listing_free(&l);
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

/* ---- publish ------------------------------------------------------------- */

/* Uploads one local file, reading it once: the bytes sent are the bytes
 * hashed and compared with the manifest (a file changed since it was
 * written is not published; the upload is aborted). */
static int upload_file(ckpt_remote *r, const char *path, const char *key,
                       const ckpt_manifest_file *f) {
    struct stat st;
    int fd = ckpt__open_read(path, path, true, &st);
    if (fd < 0) return fd;
    int rc = 0;
    if ((uint64_t)st.st_size != f->size)
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %lld bytes, the manifest says %" PRIu64, path,
                       (long long)st.st_size, f->size);
    ckpt_s3_upload *u = NULL;
    if (rc == 0) rc = ckpt__s3_upload_begin(r->c, key, &u);
    size_t piece = (size_t)ckpt__s3_options(r->c)->part_size;
    uint8_t *buf = rc == 0 ? ckpt__malloc(piece) : NULL;
    XXH3_state_t *hs = rc == 0 ? XXH3_createState() : NULL;
    if (rc == 0 && (!buf || !hs)) rc = ckpt__err_nomem("s3 upload");
    if (rc == 0) XXH3_64bits_reset(hs);
    uint64_t off = 0;
    while (rc == 0 && off < f->size) {
        size_t want = f->size - off < piece ? (size_t)(f->size - off) : piece;
        ssize_t got = ckpt__os_pread(fd, buf, want, off);
        if (got < 0) rc = ckpt__err_os(errno, "%s: read", path);
        else if (got == 0) rc = ckpt__err(CKPT_ECORRUPT, "%s: ends early", path);
        else {
            XXH3_64bits_update(hs, buf, (size_t)got);
            rc = ckpt__s3_upload_write(u, buf, (size_t)got);
            off += (uint64_t)got;
        }
    }
    if (rc == 0 && XXH3_64bits_digest(hs) != f->xxh3)
        rc = ckpt__err(CKPT_ECORRUPT, "%s: does not match its manifest (checksum); not uploaded",
                       path);
    XXH3_freeState(hs);
    free(buf);
    ckpt__os_close(fd);
    if (rc == 0) rc = ckpt__s3_upload_finish(u, NULL);
    else ckpt__s3_upload_abort(u);
    return rc;
}

/* Whether anything is stored under checkpoints/checkpoint_<n>/. */
static int number_used(ckpt_remote *r, int64_t n, bool *used) {
    char rel[80];
    snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, n);
    char *dir = ckpt__remote_key(r, rel);
    if (!dir) return ckpt__err_nomem("s3 key");
    listing l;
    int rc = list_dir(r, dir, &l);
    *used = l.n > 0;
    listing_free(&l);
    free(dir);
    return rc;
}

int ckpt__remote_publish(ckpt_remote *r, const char *local_dir, int64_t number, int64_t *committed,
                         const ckpt_logger *lg) {
    if (committed) *committed = -1;
    ckpt_manifest m;
    CKPT_TRY(ckpt__manifest_read(local_dir, &m));
    char *mpath = ckpt__path_join(local_dir, CKPT_MANIFEST_NAME);
    char *mtext = NULL;
    size_t mlen = 0;
    int rc = mpath ? ckpt__read_small_file(mpath, true, CKPT_MANIFEST_MAX_BYTES, &mtext, &mlen)
                   : ckpt__err_nomem("s3 publish");
    for (int tries = 0; rc == 0; tries++, number++) {
        bool used = false;
        rc = number_used(r, number, &used);
        if (rc < 0) break;
        if (used) {
            ckpt__log(lg, CKPT_LOG_WARNING,
                      "%s/checkpoints/checkpoint_%" PRId64
                      " already holds objects (another writer?); saving as the next number",
                      r->url, number);
            if (tries >= 100) {
                rc = ckpt__err(CKPT_EBUSY, "%s: 100 checkpoint numbers in a row are taken", r->url);
                break;
            }
            continue;
        }
        char rel[80];
        snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, number);
        char *dir = ckpt__remote_key(r, rel);
        if (!dir) {
            rc = ckpt__err_nomem("s3 key");
            break;
        }
        for (int64_t i = 0; rc == 0 && i < m.nfiles; i++) {
            char *path = ckpt__path_join(local_dir, m.files[i].name);
            char *key = ckpt__path_join(dir, m.files[i].name);
            rc = path && key ? upload_file(r, path, key, &m.files[i])
                             : ckpt__err_nomem("s3 publish");
            free(path);
            free(key);
        }
        /* the commit: the manifest, only if nobody committed this number */
        char *mkey = rc == 0 ? ckpt__path_join(dir, CKPT_MANIFEST_NAME) : NULL;
        if (rc == 0 && !mkey) rc = ckpt__err_nomem("s3 key");
        if (rc == 0) rc = ckpt__s3_put(r->c, mkey, mtext, mlen, CKPT_S3_IF_ABSENT, NULL, NULL);
        free(mkey);
        free(dir);
        if (rc == CKPT_EEXIST && tries < 100) {
            ckpt__log(lg, CKPT_LOG_WARNING,
                      "%s/checkpoints/checkpoint_%" PRId64
                      " was committed by another writer during this save; saving as the next "
                      "number",
                      r->url, number);
            rc = 0;
            continue;
        }
        if (rc == 0 && committed) *committed = number;
        break;
    }
    free(mtext);
    free(mpath);
    ckpt__manifest_clear(&m);
    return rc;
}

/* ---- removal -------------------------------------------------------------- */

static int remove_dir_objects(ckpt_remote *r, const char *dir, bool manifest_first) {
    if (manifest_first) {
        char *mkey = ckpt__path_join(dir, CKPT_MANIFEST_NAME);
        if (!mkey) return ckpt__err_nomem("s3 key");
        int rc = ckpt__s3_delete(r->c, mkey);
        free(mkey);
        CKPT_TRY(rc);
    }
    listing l;
    int rc = list_dir(r, dir, &l);
    for (int64_t i = 0; rc == 0 && i < l.n; i++) {
        char *key = ckpt__path_join(dir, l.names[i]);
        rc = key ? ckpt__s3_delete(r->c, key) : ckpt__err_nomem("s3 key");
        free(key);
    }
    listing_free(&l);
    return rc;
}

int ckpt__remote_remove(ckpt_remote *r, int64_t number) {
    char rel[80];
    snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, number);
    char *dir = ckpt__remote_key(r, rel);
    if (!dir) return ckpt__err_nomem("s3 key");
    int rc = remove_dir_objects(r, dir, true);
    free(dir);
    return rc;
}

int ckpt__remote_remove_leftovers(ckpt_remote *r, const ckpt_logger *lg, int64_t *removed) {
    if (removed) *removed = 0;
    ckpt_remote_entry *v = NULL;
    int64_t n = 0;
    CKPT_TRY(ckpt__remote_scan(r, &v, &n));
    int rc = 0;
    for (int64_t i = 0; rc == 0 && i < n; i++) {
        if (v[i].committed) continue;
        char rel[80];
        snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, v[i].number);
        char *dir = ckpt__remote_key(r, rel);
        if (!dir) {
            rc = ckpt__err_nomem("s3 key");
            break;
        }
        ckpt__log(lg, CKPT_LOG_WARNING,
                  "removing s3://%s/%s/: %" PRId64 " objects of a save that did not finish",
                  r->bucket, dir, v[i].nobjects);
        rc = remove_dir_objects(r, dir, false);
        if (rc == 0 && removed) (*removed)++;
        free(dir);
    }
    free(v);
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
