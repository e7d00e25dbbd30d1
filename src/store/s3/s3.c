/* s3.c — the object-store client (s3.h): configuration from the
 * environment, one signed request with its retries, and the single-request
 * operations (PUT, HEAD, small GET, DELETE, ListObjectsV2).
 *
 * Payload signing. A request body is signed with its SHA-256 when it is
 * under 1 MiB (a manifest, a lock, a small state file, the multipart
 * completion: nothing to pay) or when CKPT_S3_SIGN_PAYLOAD=1; larger bodies
 * go as UNSIGNED-PAYLOAD. Hashing every byte with SHA-256 (about 1.5 GB/s
 * on one core with the SHA extensions, far less without) would cost a save
 * more than its own XXH3 and write. What protects those bytes instead: TLS
 * on an https endpoint in transit, and end to end the manifest's XXH3 of
 * every file, which every reader checks before it uses a byte; the manifest
 * itself is always signed (and self-checksummed). Over plain http to a
 * server that is not on loopback, set CKPT_S3_SIGN_PAYLOAD=1. */
#include "store/s3/s3.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#ifdef CKPT_HAVE_S3
#include <curl/curl.h>
#include <pthread.h>

#include "store/s3/s3_int.h"
#endif

bool ckpt__s3_is_url(const char *path) { return path && strncmp(path, "s3://", 5) == 0; }

static bool bucket_char(char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-' || ch == '.' ||
           (ch >= 'A' && ch <= 'Z') || ch == '_';
}

int ckpt__s3_parse_url(const char *url, char **bucket, char **prefix) {
    *bucket = *prefix = NULL;
    if (!ckpt__s3_is_url(url)) return ckpt__err(CKPT_EINVAL, "%s: not an s3:// URL", url);
    const char *b = url + 5, *slash = strchr(b, '/');
    size_t bl = slash ? (size_t)(slash - b) : strlen(b);
    if (bl < 3 || bl > 63)
        return ckpt__err(CKPT_EINVAL, "%s: the bucket name must be 3..63 characters", url);
    for (size_t i = 0; i < bl; i++)
        if (!bucket_char(b[i]))
            return ckpt__err(CKPT_EINVAL, "%s: the bucket name holds '%c' (a-z, 0-9, '-', '.')",
                             url, isprint((unsigned char)b[i]) ? b[i] : '?');
    const char *p = slash ? slash + 1 : "";
    size_t pl = strlen(p);
    while (pl > 0 && p[pl - 1] == '/') pl--;
    /* every segment non-empty, not "." or "..", no control character */
    size_t seg = 0;
    for (size_t i = 0; i <= pl; i++) {
        if (i < pl && (unsigned char)p[i] < 0x20)
            return ckpt__err(CKPT_EINVAL, "%s: a control character in the key prefix", url);
        if (i < pl && p[i] != '/') continue;
        size_t n = i - seg;
        if (pl > 0 &&
            (n == 0 || (n == 1 && p[seg] == '.') || (n == 2 && p[seg] == '.' && p[seg + 1] == '.')))
            return ckpt__err(CKPT_EINVAL,
                             "%s: the key prefix has an empty, '.' or '..' segment; object "
                             "keys are not paths to be normalised",
                             url);
        seg = i + 1;
    }
    *bucket = ckpt__malloc(bl + 1);
    *prefix = ckpt__malloc(pl + 1);
    if (!*bucket || !*prefix) {
        free(*bucket);
        free(*prefix);
        *bucket = *prefix = NULL;
        return ckpt__err_nomem("s3 URL");
    }
    memcpy(*bucket, b, bl);
    (*bucket)[bl] = '\0';
    memcpy(*prefix, p, pl);
    (*prefix)[pl] = '\0';
    return 0;
}

#ifndef CKPT_HAVE_S3

int ckpt__s3_available(const char *what) {
    return ckpt__err(CKPT_EUNSUPPORTED,
                     "%s: this ckpt was built without object storage (s3://) support: libcurl "
                     "and OpenSSL were not found when it was built, or CKPT_WITH_S3 was OFF "
                     "(Debian: libcurl4-openssl-dev and libssl-dev; scripts/setup installs them)",
                     what);
}
int ckpt__s3_new(ckpt_s3 **out, const char *bucket) {
    *out = NULL;
    (void)bucket;
    return ckpt__s3_available("s3 client");
}
void ckpt__s3_free(ckpt_s3 *c) { (void)c; }
const ckpt_s3_options *ckpt__s3_options(const ckpt_s3 *c) {
    (void)c;
    return NULL;
}
const char *ckpt__s3_bucket(const ckpt_s3 *c) {
    (void)c;
    return "";
}
void ckpt__s3_set_list_page(ckpt_s3 *c, int n) { (void)c, (void)n; }
void ckpt__s3_stats(const ckpt_s3 *c, ckpt_s3_stats *out) {
    (void)c;
    memset(out, 0, sizeof *out);
}
int ckpt__s3_put(ckpt_s3 *c, const char *key, const void *p, size_t n, ckpt_s3_cond cond,
                 const char *etag, char *etag_out) {
    return ckpt__s3_available(key);
}
int ckpt__s3_head(ckpt_s3 *c, const char *key, ckpt_s3_head *h) { return ckpt__s3_available(key); }
int ckpt__s3_get_small(ckpt_s3 *c, const char *key, uint64_t max, char **out, size_t *len,
                       ckpt_s3_head *h) {
    *out = NULL;
    return ckpt__s3_available(key);
}
int ckpt__s3_delete(ckpt_s3 *c, const char *key) { return ckpt__s3_available(key); }
int ckpt__s3_list(ckpt_s3 *c, const char *prefix, const char *delimiter, ckpt_s3_list_fn fn,
                  void *user) {
    return ckpt__s3_available(prefix);
}

#else

/* ---- configuration -------------------------------------------------------- */

int ckpt__s3_available(const char *what) {
    (void)what;
    return 0;
}

static pthread_once_t curl_once = PTHREAD_ONCE_INIT;
static int curl_init_rc;
static void curl_init(void) {
    curl_init_rc = curl_global_init(CURL_GLOBAL_DEFAULT) == CURLE_OK ? 0 : -1;
}

static const char *env(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

/* A byte count with an optional K/M/G suffix (powers of 1024), at most max. */
static int env_bytes(const char *name, uint64_t dflt, uint64_t max, uint64_t *out) {
    const char *v = env(name);
    *out = dflt;
    if (!v) return 0;
    char *end = NULL;
    errno = 0;
    unsigned long long n = strtoull(v, &end, 10);
    uint64_t mul = 1;
    if (end && (*end == 'K' || *end == 'k')) mul = 1024, end++;
    else if (end && (*end == 'M' || *end == 'm')) mul = 1024 * 1024, end++;
    else if (end && (*end == 'G' || *end == 'g')) mul = 1024ull * 1024 * 1024, end++;
    if (errno || end == v || *end || n == 0 || n > UINT64_MAX / mul || n * mul > max)
        return ckpt__err(CKPT_EINVAL, "%s='%s': expected a size such as 8M (at most %" PRIu64 "M)",
                         name, v, max >> 20);
    *out = n * mul;
    return 0;
}

static int env_long(const char *name, long dflt, long lo, long hi, long *out) {
    const char *v = env(name);
    *out = dflt;
    if (!v) return 0;
    char *end = NULL;
    errno = 0;
    long n = strtol(v, &end, 10);
    if (errno || end == v || *end || n < lo || n > hi)
        return ckpt__err(CKPT_EINVAL, "%s='%s': expected an integer in %ld..%ld", name, v, lo, hi);
    *out = n;
    return 0;
}

static int read_options(ckpt_s3_options *o, bool custom_endpoint) {
    long conns, retries, timeout, backoff, sign;
    CKPT_TRY(env_bytes("CKPT_S3_PART_SIZE", 8u << 20, 1ull << 32, &o->part_size));
    CKPT_TRY(env_bytes("CKPT_S3_COPY_MAX", 5ull << 30, 5ull << 30, &o->copy_max));
    CKPT_TRY(env_long("CKPT_S3_CONNECTIONS", 8, 1, 64, &conns));
    CKPT_TRY(env_long("CKPT_S3_RETRIES", 5, 0, 100, &retries));
    CKPT_TRY(env_long("CKPT_S3_TIMEOUT", 60, 1, 86400, &timeout));
    CKPT_TRY(env_long("CKPT_S3_BACKOFF_MS", 200, 0, 60000, &backoff));
    CKPT_TRY(env_long("CKPT_S3_SIGN_PAYLOAD", 0, 0, 1, &sign));
    /* S3 refuses parts under 5 MiB but the last; a custom endpoint may not */
    if (!custom_endpoint && o->part_size < (5u << 20))
        return ckpt__err(CKPT_EINVAL,
                         "CKPT_S3_PART_SIZE is %" PRIu64 " bytes; S3 needs at least 5M",
                         o->part_size);
    o->connections = (int)conns;
    o->retries = (int)retries;
    o->timeout_ms = timeout * 1000;
    o->backoff_ms = backoff;
    o->sign_payload = sign != 0;
    o->list_page = 1000;
    return 0;
}

/* "scheme://host[:port]" with nothing after but an optional "/". */
static int parse_endpoint(ckpt_s3 *c, const char *ep) {
    const char *h = strstr(ep, "://");
    if (!h || (strncmp(ep, "http://", 7) != 0 && strncmp(ep, "https://", 8) != 0))
        return ckpt__err(CKPT_EINVAL,
                         "AWS_ENDPOINT_URL='%s': expected http://host[:port] or "
                         "https://host[:port]",
                         ep);
    h += 3;
    size_t hl = strcspn(h, "/?#");
    if (hl == 0 || (h[hl] && strcmp(h + hl, "/") != 0))
        return ckpt__err(CKPT_EINVAL,
                         "AWS_ENDPOINT_URL='%s': expected http://host[:port] with no path", ep);
    for (size_t i = 0; i < hl; i++)
        if ((unsigned char)h[i] <= 0x20 || h[i] == '@')
            return ckpt__err(CKPT_EINVAL, "AWS_ENDPOINT_URL='%s': not a host[:port]", ep);
    size_t el = (size_t)(h - ep) + hl;
    c->endpoint = ckpt__malloc(el + 1);
    c->host = ckpt__malloc(hl + 1);
    if (!c->endpoint || !c->host) return ckpt__err_nomem("s3 endpoint");
    memcpy(c->endpoint, ep, el);
    c->endpoint[el] = '\0';
    memcpy(c->host, h, hl);
    c->host[hl] = '\0';
    c->path_style = true;
    return 0;
}

/* The client's memory: its handle lists (the handles already cleaned up),
 * its strings (the secret wiped first) and itself. */
static void free_client(ckpt_s3 *c) {
    free(c->handles);
    free(c->free_handles);
    if (c->secret_key) memset(c->secret_key, 0, strlen(c->secret_key));
    free(c->bucket);
    free(c->access_key);
    free(c->secret_key);
    free(c->region);
    free(c->token);
    free(c->endpoint);
    free(c->host);
    free(c);
}

int ckpt__s3_new(ckpt_s3 **out, const char *bucket) {
    *out = NULL;
    pthread_once(&curl_once, curl_init);
    if (curl_init_rc < 0) return ckpt__err(CKPT_EIO, "s3: libcurl failed to initialise");
    const char *ak = env("AWS_ACCESS_KEY_ID"), *sk = env("AWS_SECRET_ACCESS_KEY");
    if (!ak || !sk)
        return ckpt__err(CKPT_EINVAL,
                         "s3://%s: no credentials: set AWS_ACCESS_KEY_ID and "
                         "AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary ones)",
                         bucket);
    const char *region = env("AWS_REGION");
    if (!region) region = env("AWS_DEFAULT_REGION");
    if (!region) region = "us-east-1";
    const char *ep = env("AWS_ENDPOINT_URL_S3");
    if (!ep) ep = env("AWS_ENDPOINT_URL");
    ckpt_s3 *c = ckpt__calloc(1, sizeof *c);
    if (!c) return ckpt__err_nomem("s3 client");
    int rc = read_options(&c->o, ep != NULL);
    c->bucket = ckpt__strdup(bucket);
    c->access_key = ckpt__strdup(ak);
    c->secret_key = ckpt__strdup(sk);
    c->region = ckpt__strdup(region);
    if (env("AWS_SESSION_TOKEN")) c->token = ckpt__strdup(env("AWS_SESSION_TOKEN"));
    if (rc == 0 && (!c->bucket || !c->access_key || !c->secret_key || !c->region ||
                    (env("AWS_SESSION_TOKEN") && !c->token)))
        rc = ckpt__err_nomem("s3 client");
    for (const char *r = region; rc == 0 && *r; r++)
        if (!isalnum((unsigned char)*r) && *r != '-')
            rc = ckpt__err(CKPT_EINVAL, "AWS_REGION='%s': not a region name", region);
    if (rc == 0 && ep) rc = parse_endpoint(c, ep);
    else if (rc == 0) {
        /* virtual-hosted style; a bucket with dots would break the
         * certificate's name, so it goes path-style */
        size_t n = strlen(bucket) + strlen(region) + 64;
        c->host = ckpt__malloc(n);
        c->endpoint = ckpt__malloc(n + 8);
        if (!c->host || !c->endpoint) rc = ckpt__err_nomem("s3 endpoint");
        else if (strchr(bucket, '.')) {
            snprintf(c->host, n, "s3.%s.amazonaws.com", region);
            c->path_style = true;
        } else {
            snprintf(c->host, n, "%s.s3.%s.amazonaws.com", bucket, region);
        }
        if (rc == 0) snprintf(c->endpoint, n + 8, "https://%s", c->host);
    }
    if (rc == 0) {
        c->nhandles = c->o.connections + 2;
        c->handles = ckpt__calloc((size_t)c->nhandles, sizeof *c->handles);
        c->free_handles = ckpt__calloc((size_t)c->nhandles, sizeof *c->free_handles);
        if (!c->handles || !c->free_handles) rc = ckpt__err_nomem("s3 client");
    }
    if (rc == 0) {
        pthread_mutex_init(&c->pool_mu, NULL);
        pthread_mutex_init(&c->mu, NULL);
        pthread_cond_init(&c->work_cv, NULL);
        pthread_cond_init(&c->done_cv, NULL);
    }
    if (rc < 0) {
        free_client(c); /* no handle, lock or thread exists yet */
        return rc;
    }
    *out = c;
    return 0;
}

void ckpt__s3_free(ckpt_s3 *c) {
    if (!c) return;
    ckpt__s3_workers_stop(c);
    for (int i = 0; i < c->nhandles; i++)
        if (c->handles[i]) curl_easy_cleanup(c->handles[i]);
    pthread_mutex_destroy(&c->pool_mu);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->done_cv);
    free_client(c);
}

const ckpt_s3_options *ckpt__s3_options(const ckpt_s3 *c) { return &c->o; }
const char *ckpt__s3_bucket(const ckpt_s3 *c) { return c->bucket; }
void ckpt__s3_set_list_page(ckpt_s3 *c, int n) {
    if (n >= 1 && n <= 1000) c->o.list_page = n;
}

void ckpt__s3_stats(const ckpt_s3 *c, ckpt_s3_stats *out) {
    ckpt_s3 *m = (ckpt_s3 *)c;
    out->requests = atomic_load(&m->n_requests);
    out->retries = atomic_load(&m->n_retries);
    out->puts = atomic_load(&m->n_put);
    out->gets = atomic_load(&m->n_get);
    out->heads = atomic_load(&m->n_head);
    out->lists = atomic_load(&m->n_list);
    out->deletes = atomic_load(&m->n_delete);
    out->posts = atomic_load(&m->n_post);
    out->bytes_sent = atomic_load(&m->n_sent);
    out->bytes_received = atomic_load(&m->n_received);
}

/* ---- easy handles ------------------------------------------------------- */

static CURL *handle_get(ckpt_s3 *c) {
    CURL *h = NULL;
    pthread_mutex_lock(&c->pool_mu);
    if (c->nfree > 0) h = c->free_handles[--c->nfree];
    else
        for (int i = 0; i < c->nhandles && !h; i++)
            if (!c->handles[i]) h = c->handles[i] = curl_easy_init();
    pthread_mutex_unlock(&c->pool_mu);
    return h;
}

static void handle_put(ckpt_s3 *c, CURL *h) {
    pthread_mutex_lock(&c->pool_mu);
    c->free_handles[c->nfree++] = h;
    pthread_mutex_unlock(&c->pool_mu);
}

/* ---- one attempt -------------------------------------------------------- */

typedef struct body_src {
    const uint8_t *p;
    size_t n, off;
} body_src;

static size_t read_cb(char *buf, size_t size, size_t nitems, void *user) {
    body_src *b = user;
    size_t want = size * nitems, left = b->n - b->off;
    if (want > left) want = left;
    memcpy(buf, b->p + b->off, want);
    b->off += want;
    return want;
}

/* A header line's value after "name:", trimmed; NULL if the line is not it. */
static const char *header_is(const char *line, size_t n, const char *name, size_t *vlen) {
    size_t nl = strlen(name);
    if (n <= nl || strncasecmp(line, name, nl) != 0 || line[nl] != ':') return NULL;
    const char *v = line + nl + 1;
    size_t l = n - nl - 1;
    while (l && (*v == ' ' || *v == '\t')) v++, l--;
    while (l && (v[l - 1] == '\r' || v[l - 1] == '\n' || v[l - 1] == ' ')) l--;
    *vlen = l;
    return v;
}

static size_t header_cb(char *line, size_t size, size_t nitems, void *user) {
    s3_req *r = user;
    size_t n = size * nitems, vl = 0;
    const char *v;
    char tmp[160];
    if (n >= 5 && strncmp(line, "HTTP/", 5) == 0) { /* a new response (after 100 Continue) */
        r->has_length = r->has_range = false;
        r->head.etag[0] = '\0';
        return n;
    }
    if ((v = header_is(line, n, "ETag", &vl)) && vl < sizeof r->head.etag) {
        memcpy(r->head.etag, v, vl);
        r->head.etag[vl] = '\0';
    } else if ((v = header_is(line, n, "Content-Length", &vl)) && vl > 0 && vl < 21) {
        uint64_t x = 0;
        bool ok = true;
        for (size_t i = 0; i < vl; i++) {
            if (v[i] < '0' || v[i] > '9' || x > (UINT64_MAX - 9) / 10) ok = false;
            else x = x * 10 + (uint64_t)(v[i] - '0');
        }
        r->has_length = ok;
        r->head.size = ok ? x : 0;
    } else if ((v = header_is(line, n, "Content-Range", &vl)) && vl < sizeof tmp) {
        memcpy(tmp, v, vl);
        tmp[vl] = '\0';
        unsigned long long a, b, t;
        int end = 0;
        if (sscanf(tmp, "bytes %llu-%llu/%llu%n", &a, &b, &t, &end) == 3 && end == (int)vl) {
            r->has_range = true;
            r->cr_start = a;
            r->cr_end = b;
            r->cr_total = t;
        }
    } else if ((v = header_is(line, n, "Last-Modified", &vl)) && vl < sizeof tmp) {
        memcpy(tmp, v, vl);
        tmp[vl] = '\0';
        time_t t = curl_getdate(tmp, NULL);
        r->head.last_modified = t > 0 ? (int64_t)t : 0;
    } else if ((v = header_is(line, n, "Date", &vl)) && vl < sizeof tmp) {
        memcpy(tmp, v, vl);
        tmp[vl] = '\0';
        time_t t = curl_getdate(tmp, NULL);
        r->head.server_now = t > 0 ? (int64_t)t : 0;
    }
    return n;
}

typedef struct sink_ctx {
    s3_req *r;
    CURL *h;
    size_t cap;
    bool checked;
} sink_ctx;

static int sink_refuse(s3_req *r, const char *fmt, uint64_t a, uint64_t b) {
    r->sink_err = CKPT_ECORRUPT;
    snprintf(r->sink_msg, sizeof r->sink_msg, fmt, a, b);
    return 0;
}

/* Before the first byte of a 2xx body is kept: is it the range asked for? */
static bool range_ok(sink_ctx *s, long status) {
    s3_req *r = s->r;
    if (status == 206) {
        if (!r->has_range || r->cr_start != r->range_off ||
            r->cr_end + 1 != r->range_off + r->dst_len || r->cr_total != r->range_total)
            return sink_refuse(r, "the server sent another range than bytes %" PRIu64 "+%" PRIu64,
                               r->range_off, r->dst_len);
        return true;
    }
    /* a 200 is the whole object: fine only if that is what was asked */
    if (r->range_off != 0 || r->dst_len != r->range_total || !r->has_length ||
        r->head.size != r->dst_len)
        return sink_refuse(
            r, "the server sent the whole object (%" PRIu64 " bytes) for a range of %" PRIu64,
            r->has_length ? r->head.size : 0, r->dst_len);
    return true;
}

static size_t write_cb(char *data, size_t size, size_t nitems, void *user) {
    sink_ctx *s = user;
    s3_req *r = s->r;
    size_t n = size * nitems;
    long status = 0;
    curl_easy_getinfo(s->h, CURLINFO_RESPONSE_CODE, &status);
    bool ok2xx = status >= 200 && status < 300;
    if (ok2xx && r->dst) {
        if (!s->checked) {
            if (!range_ok(s, status)) return 0;
            s->checked = true;
        }
        if (n > r->dst_len - r->got) {
            sink_refuse(
                r, "the server sent more than the %" PRIu64 " bytes asked for (offset %" PRIu64 ")",
                r->dst_len, r->range_off);
            return 0;
        }
        memcpy(r->dst + r->got, data, n);
        r->got += n;
        return n;
    }
    /* a small body (or an error's, kept to 64 KiB for its message) */
    uint64_t max = ok2xx ? r->max_body : 65536;
    if (r->body_out_len + n > max) {
        if (!ok2xx) return n; /* the rest of an error body is not needed */
        sink_refuse(r, "the response is larger than %" PRIu64 " bytes (%" PRIu64 " arrived)", max,
                    r->body_out_len + n);
        return 0;
    }
    if (r->body_out_len + n + 1 > s->cap) {
        size_t cap = s->cap ? s->cap : 4096;
        while (cap < r->body_out_len + n + 1) cap *= 2;
        char *np = ckpt__realloc(r->body_out, cap);
        if (!np) {
            r->sink_err = CKPT_ENOMEM;
            snprintf(r->sink_msg, sizeof r->sink_msg, "out of memory for a response");
            return 0;
        }
        r->body_out = np;
        s->cap = cap;
    }
    memcpy(r->body_out + r->body_out_len, data, n);
    r->body_out_len += n;
    r->body_out[r->body_out_len] = '\0';
    return n;
}

static void amz_now(char out[17]) {
    time_t t = time(NULL);
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(out, 17, "%Y%m%dT%H%M%SZ", &tm);
}

/* One attempt. Returns the curl code; r->status etc. filled. */
static CURLcode attempt(ckpt_s3 *c, CURL *h, s3_req *r, char *url, int *sign_rc) {
    *sign_rc = 0;
    free(r->body_out);
    r->body_out = NULL;
    r->body_out_len = 0;
    r->got = 0;
    r->status = 0;
    r->sink_err = 0;
    r->has_length = r->has_range = false;
    memset(&r->head, 0, sizeof r->head);

    char date[17], phash[65];
    amz_now(date);
    if (r->body && r->sign_body) ckpt__sha256_hex(r->body, r->body_len, phash);
    else if (!r->body || r->body_len == 0) snprintf(phash, sizeof phash, "%s", CKPT_SHA256_EMPTY);
    else snprintf(phash, sizeof phash, "UNSIGNED-PAYLOAD");

    ckpt_s3_hdr hd[12];
    int nh = 0;
    hd[nh++] = (ckpt_s3_hdr){"host", c->host};
    hd[nh++] = (ckpt_s3_hdr){"x-amz-content-sha256", phash};
    hd[nh++] = (ckpt_s3_hdr){"x-amz-date", date};
    if (c->token) hd[nh++] = (ckpt_s3_hdr){"x-amz-security-token", c->token};
    for (int i = 0; i < r->nextra; i++) hd[nh++] = r->extra[i];

    /* the canonical URI: /<bucket>/<key> path-style, else /<key> */
    char *ekey = ckpt__s3_uri_encode(r->key, true);
    size_t ul = (ekey ? strlen(ekey) : 0) + strlen(c->bucket) + 4;
    char *curi = ckpt__malloc(ul);
    if (!ekey || !curi) {
        free(ekey);
        free(curi);
        *sign_rc = ckpt__err_nomem("s3 request");
        return CURLE_OUT_OF_MEMORY;
    }
    if (c->path_style) snprintf(curi, ul, "/%s%s%s", c->bucket, *r->key ? "/" : "", ekey);
    else snprintf(curi, ul, "/%s", ekey);
    free(ekey);
    ckpt_s3_creds cr = {c->access_key, c->secret_key, c->token, c->region};
    char *auth = NULL;
    int src = ckpt__sigv4(&cr, r->method, curi, r->query, hd, nh, phash, date, NULL, NULL, &auth);
    if (src < 0) {
        free(curi);
        *sign_rc = src;
        return CURLE_OUT_OF_MEMORY;
    }
    snprintf(url, 8192, "%s%s%s%s", c->endpoint, curi, *r->query ? "?" : "", r->query);
    free(curi);

    struct curl_slist *list = NULL;
    char line[4096];
    bool oom = false;
    for (int i = 0; i < nh; i++) {
        snprintf(line, sizeof line, "%s: %s", hd[i].name, hd[i].value);
        struct curl_slist *nl = curl_slist_append(list, line);
        if (!nl) oom = true;
        else list = nl;
    }
    snprintf(line, sizeof line, "Authorization: %s", auth);
    free(auth);
    const char *more[] = {line, "Expect:", "Accept:"};
    for (size_t i = 0; i < sizeof more / sizeof *more; i++) {
        struct curl_slist *nl = curl_slist_append(list, more[i]);
        if (!nl) oom = true;
        else list = nl;
    }
    if (oom) {
        curl_slist_free_all(list);
        *sign_rc = ckpt__err_nomem("s3 request headers");
        return CURLE_OUT_OF_MEMORY;
    }

    curl_easy_reset(h);
    body_src src_body = {r->body, r->body_len, 0};
    sink_ctx sink = {.r = r, .h = h};
    curl_easy_setopt(h, CURLOPT_URL, url);
    curl_easy_setopt(h, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(h, CURLOPT_HTTPHEADER, list);
    curl_easy_setopt(h, CURLOPT_HEADERFUNCTION, header_cb);
    curl_easy_setopt(h, CURLOPT_HEADERDATA, r);
    curl_easy_setopt(h, CURLOPT_WRITEFUNCTION, write_cb);
    curl_easy_setopt(h, CURLOPT_WRITEDATA, &sink);
    curl_easy_setopt(h, CURLOPT_CONNECTTIMEOUT_MS, c->o.timeout_ms);
    /* a request that moves less than a byte a second for the timeout is stalled */
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(h, CURLOPT_LOW_SPEED_TIME, (c->o.timeout_ms + 999) / 1000);
    curl_easy_setopt(h, CURLOPT_PROTOCOLS_STR, "http,https");
    curl_easy_setopt(h, CURLOPT_FOLLOWLOCATION, 0L);
    if (strcmp(r->method, "HEAD") == 0) {
        curl_easy_setopt(h, CURLOPT_NOBODY, 1L);
    } else if (strcmp(r->method, "GET") == 0) {
        curl_easy_setopt(h, CURLOPT_HTTPGET, 1L);
    } else {
        if (r->body || strcmp(r->method, "PUT") == 0 || strcmp(r->method, "POST") == 0) {
            curl_easy_setopt(h, CURLOPT_UPLOAD, 1L);
            curl_easy_setopt(h, CURLOPT_READFUNCTION, read_cb);
            curl_easy_setopt(h, CURLOPT_READDATA, &src_body);
            curl_easy_setopt(h, CURLOPT_INFILESIZE_LARGE, (curl_off_t)r->body_len);
        }
        curl_easy_setopt(h, CURLOPT_CUSTOMREQUEST, r->method);
    }
    CURLcode cc = curl_easy_perform(h);
    curl_easy_getinfo(h, CURLINFO_RESPONSE_CODE, &r->status);
    curl_slist_free_all(list);
    atomic_fetch_add(&c->n_sent, src_body.off);
    atomic_fetch_add(&c->n_received, r->got + r->body_out_len);
    return cc;
}

static bool retry_curl(CURLcode cc) {
    switch (cc) {
    case CURLE_COULDNT_CONNECT:
    case CURLE_COULDNT_RESOLVE_HOST:
    case CURLE_OPERATION_TIMEDOUT:
    case CURLE_SEND_ERROR:
    case CURLE_RECV_ERROR:
    case CURLE_GOT_NOTHING:
    case CURLE_PARTIAL_FILE:
    case CURLE_SSL_CONNECT_ERROR:
    case CURLE_HTTP2:
    case CURLE_HTTP2_STREAM:
    case CURLE_WEIRD_SERVER_REPLY: return true;
    default: return false;
    }
}

static bool retry_status(const s3_req *r) {
    if (r->status >= 500 || r->status == 429) return true;
    if (r->status == 409 && r->nextra > 0) return true; /* a conditional write raced */
    if (r->status == 400 && r->body_out && strstr(r->body_out, "<Code>RequestTimeout</Code>"))
        return true;
    return false;
}

static void backoff(const ckpt_s3 *c, int attempt_no, unsigned *seed) {
    long ms = c->o.backoff_ms;
    for (int i = 1; i < attempt_no && ms < 5000; i++) ms *= 2;
    if (ms > 5000) ms = 5000;
    if (ms <= 0) return;
    /* half fixed, half random: retries of many parts do not arrive together */
    long wait = ms / 2 + (long)(rand_r(seed) % (unsigned)(ms / 2 + 1));
    struct timespec ts = {wait / 1000, (wait % 1000) * 1000000L};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

/* The S3 error code and message of an error body, for messages. */
static void error_detail(const s3_req *r, char *out, size_t cap) {
    char code[96] = "", msg[256] = "";
    if (r->body_out) {
        ckpt__s3_xml_text(r->body_out, r->body_out_len, "Code", code, sizeof code);
        ckpt__s3_xml_text(r->body_out, r->body_out_len, "Message", msg, sizeof msg);
    }
    for (char *p = msg; *p; p++)
        if ((unsigned char)*p < 0x20) *p = ' ';
    for (char *p = code; *p; p++)
        if ((unsigned char)*p < 0x20) *p = ' ';
    if (*code && *msg) snprintf(out, cap, " (%s: %s)", code, msg);
    else if (*code) snprintf(out, cap, " (%s)", code);
    else out[0] = '\0';
}

void ckpt__s3_req_clear(s3_req *r) {
    free(r->body_out);
    r->body_out = NULL;
    r->body_out_len = 0;
}

int ckpt__s3_send(ckpt_s3 *c, s3_req *r, const char *what) {
    CURL *h = handle_get(c);
    if (!h) return ckpt__err_nomem("s3 connection");
    char *url = ckpt__malloc(8192);
    if (!url) {
        handle_put(c, h);
        return ckpt__err_nomem("s3 request");
    }
    unsigned seed = (unsigned)time(NULL) ^ (unsigned)(uintptr_t)r;
    CURLcode cc = CURLE_OK;
    int sign_rc = 0;
    r->attempts = 0;
    for (;;) {
        r->attempts++;
        atomic_fetch_add(&c->n_requests, 1);
        switch (r->method[0]) {
        case 'G': atomic_fetch_add(&c->n_get, 1); break;
        case 'H': atomic_fetch_add(&c->n_head, 1); break;
        case 'D': atomic_fetch_add(&c->n_delete, 1); break;
        case 'P':
            if (r->method[1] == 'U') atomic_fetch_add(&c->n_put, 1);
            else atomic_fetch_add(&c->n_post, 1);
            break;
        default: break;
        }
        if (strcmp(r->method, "GET") == 0 && strstr(r->query, "list-type=2"))
            atomic_fetch_add(&c->n_list, 1);
        cc = attempt(c, h, r, url, &sign_rc);
        if (sign_rc < 0) break;
        if (r->sink_err && r->sink_err != CKPT_ECORRUPT) break;
        bool again = r->sink_err == CKPT_ECORRUPT ? false
                     : cc != CURLE_OK             ? retry_curl(cc)
                                                  : retry_status(r);
        if (!again || r->attempts > c->o.retries) break;
        atomic_fetch_add(&c->n_retries, 1);
        backoff(c, r->attempts, &seed);
    }
    handle_put(c, h);
    free(url);
    if (sign_rc < 0) return sign_rc;
    const char *b = c->bucket, *k = r->key;
    const char *sep = *k ? "/" : "";
    if (r->sink_err)
        return ckpt__err(r->sink_err, "s3://%s%s%s: %s: %s", b, sep, k, what, r->sink_msg);
    if (cc != CURLE_OK)
        return ckpt__err(CKPT_EIO, "s3://%s%s%s: %s: %s (after %d attempt%s)", b, sep, k, what,
                         curl_easy_strerror(cc), r->attempts, r->attempts == 1 ? "" : "s");
    if (r->status >= 200 && r->status < 300) return 0;
    char detail[400];
    error_detail(r, detail, sizeof detail);
    switch (r->status) {
    case 404:
        if (r->body_out && strstr(r->body_out, "<Code>NoSuchBucket</Code>"))
            return ckpt__err(CKPT_ENOENT, "s3://%s: %s: no such bucket%s", b, what, detail);
        return ckpt__err(CKPT_ENOENT, "s3://%s%s%s: %s: not found (HTTP 404)%s", b, sep, k, what,
                         detail);
    case 412:
        return ckpt__err(CKPT_EEXIST, "s3://%s%s%s: %s: precondition failed (HTTP 412): %s", b, sep,
                         k, what,
                         r->nextra && strcmp(r->extra[0].name, "if-none-match") == 0
                             ? "the key already exists"
                             : "the object changed or is gone");
    case 403:
        return ckpt__err(CKPT_EIO,
                         "s3://%s%s%s: %s: access denied (HTTP 403)%s; check AWS_ACCESS_KEY_ID, "
                         "AWS_SECRET_ACCESS_KEY, AWS_SESSION_TOKEN and the bucket's policy",
                         b, sep, k, what, detail);
    default:
        return ckpt__err(CKPT_EIO, "s3://%s%s%s: %s: HTTP %ld%s%s", b, sep, k, what, r->status,
                         detail, retry_status(r) && r->attempts > 1 ? " (after retries)" : "");
    }
}

/* ---- XML ---------------------------------------------------------------- */

/* Decodes the five named entities and numeric ones (ASCII only) of
 * src[0..n) into out; -1 if it does not fit or an entity is unknown. */
static int xml_decode(const char *src, size_t n, char *out, size_t cap) {
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        char ch = src[i];
        if (ch == '&') {
            const char *semi = memchr(src + i, ';', n - i);
            if (!semi) return -1;
            const char *e = src + i + 1; /* the entity's name, up to the ';' */
            size_t el = (size_t)(semi - e);
            if (el == 3 && !strncmp(e, "amp", 3)) ch = '&';
            else if (el == 2 && !strncmp(e, "lt", 2)) ch = '<';
            else if (el == 2 && !strncmp(e, "gt", 2)) ch = '>';
            else if (el == 4 && !strncmp(e, "quot", 4)) ch = '"';
            else if (el == 4 && !strncmp(e, "apos", 4)) ch = '\'';
            else if (el >= 2 && el < 10 && e[0] == '#') {
                char num[12];
                memcpy(num, e + 1, el - 1);
                num[el - 1] = '\0';
                char *end = NULL;
                long v = num[0] == 'x' ? strtol(num + 1, &end, 16) : strtol(num, &end, 10);
                if (!end || *end || v <= 0 || v > 127) return -1;
                ch = (char)v;
            } else {
                return -1;
            }
            i += el + 1; /* past the ';' */
        }
        if (o + 1 >= cap) return -1;
        out[o++] = ch;
    }
    out[o] = '\0';
    return 0;
}

/* The first <tag>text</tag> in [xml, xml+len): text bounds, or NULL. */
static const char *xml_find(const char *xml, size_t len, const char *tag, size_t *tl,
                            const char **after) {
    char open[64], close[64];
    int ol = snprintf(open, sizeof open, "<%s>", tag);
    int cl = snprintf(close, sizeof close, "</%s>", tag);
    if (ol <= 0 || cl <= 0 || (size_t)ol >= sizeof open) return NULL;
    const char *end = xml + len;
    for (const char *p = xml; p + ol <= end; p++) {
        if (memcmp(p, open, (size_t)ol) != 0) continue;
        const char *t = p + ol;
        for (const char *q = t; q + cl <= end; q++)
            if (memcmp(q, close, (size_t)cl) == 0) {
                *tl = (size_t)(q - t);
                if (after) *after = q + cl;
                return t;
            }
        return NULL;
    }
    return NULL;
}

int ckpt__s3_xml_text(const char *xml, size_t len, const char *tag, char *out, size_t cap) {
    size_t tl = 0;
    const char *t = xml_find(xml, len, tag, &tl, NULL);
    if (!t) return -1;
    return xml_decode(t, tl, out, cap);
}

/* ---- single-request operations ------------------------------------------- */

int ckpt__s3_put(ckpt_s3 *c, const char *key, const void *p, size_t n, ckpt_s3_cond cond,
                 const char *etag, char *etag_out) {
    s3_req r = {.method = "PUT", .key = key, .query = "", .body = p, .body_len = n};
    r.sign_body = c->o.sign_payload || n < CKPT_S3_SIGN_MAX;
    if (cond == CKPT_S3_IF_ABSENT) r.extra[r.nextra++] = (ckpt_s3_hdr){"if-none-match", "*"};
    else if (cond == CKPT_S3_IF_ETAG) r.extra[r.nextra++] = (ckpt_s3_hdr){"if-match", etag};
    int rc = ckpt__s3_send(c, &r, "PUT");
    if (rc == CKPT_EEXIST && cond == CKPT_S3_IF_ABSENT && r.attempts > 1) {
        /* An attempt whose answer was lost may have written the object: then
         * the 412 is our own write, and the object holds exactly our bytes. */
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
        char *got = NULL;
        size_t gl = 0;
        ckpt_s3_head h;
        if (ckpt__s3_get_small(c, key, n, &got, &gl, &h) == 0 && gl == n &&
            memcmp(got, p, n) == 0) {
            rc = 0;
            if (etag_out) snprintf(etag_out, 128, "%s", h.etag);
        } else {
            ckpt__err(CKPT_EEXIST, "%s", saved);
        }
        free(got);
        ckpt__s3_req_clear(&r);
        return rc;
    }
    if (rc == 0 && etag_out) snprintf(etag_out, 128, "%s", r.head.etag);
    ckpt__s3_req_clear(&r);
    return rc;
}

int ckpt__s3_head(ckpt_s3 *c, const char *key, ckpt_s3_head *h) {
    s3_req r = {.method = "HEAD", .key = key, .query = ""};
    int rc = ckpt__s3_send(c, &r, "HEAD");
    if (rc == 0 && !r.has_length)
        rc = ckpt__err(CKPT_ECORRUPT, "s3://%s/%s: HEAD: no Content-Length in the answer",
                       c->bucket, key);
    if (rc == 0 && h) *h = r.head;
    ckpt__s3_req_clear(&r);
    return rc;
}

int ckpt__s3_get_small(ckpt_s3 *c, const char *key, uint64_t max, char **out, size_t *len,
                       ckpt_s3_head *h) {
    *out = NULL;
    if (len) *len = 0;
    s3_req r = {.method = "GET", .key = key, .query = "", .max_body = max};
    int rc = ckpt__s3_send(c, &r, "GET");
    if (rc == 0 && r.has_length && r.head.size != r.body_out_len)
        rc = ckpt__err(CKPT_ECORRUPT,
                       "s3://%s/%s: GET: %zu bytes arrived, Content-Length said %" PRIu64,
                       c->bucket, key, r.body_out_len, r.head.size);
    if (rc == 0 && !r.body_out) {
        r.body_out = ckpt__malloc(1);
        if (!r.body_out) rc = ckpt__err_nomem("s3 GET");
        else r.body_out[0] = '\0';
    }
    if (rc < 0) {
        ckpt__s3_req_clear(&r);
        return rc;
    }
    if (h) {
        *h = r.head;
        h->size = r.body_out_len;
    }
    *out = r.body_out;
    if (len) *len = r.body_out_len;
    return 0;
}

int ckpt__s3_delete(ckpt_s3 *c, const char *key) {
    s3_req r = {.method = "DELETE", .key = key, .query = ""};
    int rc = ckpt__s3_send(c, &r, "DELETE");
    ckpt__s3_req_clear(&r);
    return rc;
}

/* Appends "&name=<encoded value>" (no '&' first) to q. */
static int q_add(char *q, size_t cap, const char *name, const char *value) {
    char *e = ckpt__s3_uri_encode(value, false);
    if (!e) return ckpt__err_nomem("s3 query");
    size_t used = strlen(q);
    int n = snprintf(q + used, cap - used, "%s%s=%s", used ? "&" : "", name, e);
    free(e);
    if (n < 0 || (size_t)n >= cap - used) return ckpt__err(CKPT_EINVAL, "s3: query too long");
    return 0;
}

int ckpt__s3_list(ckpt_s3 *c, const char *prefix, const char *delimiter, ckpt_s3_list_fn fn,
                  void *user) {
    char token[2048] = "";
    int rc = 0;
    char *q = ckpt__malloc(8192);
    char *item = ckpt__malloc(4096);
    if (!q || !item) rc = ckpt__err_nomem("s3 list");
    for (int page = 0; rc == 0; page++) {
        /* sorted by name: continuation-token, delimiter, list-type, max-keys, prefix */
        q[0] = '\0';
        char page_s[16];
        snprintf(page_s, sizeof page_s, "%d", c->o.list_page);
        if (*token) rc = q_add(q, 8192, "continuation-token", token);
        if (rc == 0 && delimiter) rc = q_add(q, 8192, "delimiter", delimiter);
        if (rc == 0) rc = q_add(q, 8192, "list-type", "2");
        if (rc == 0 && c->o.list_page != 1000) rc = q_add(q, 8192, "max-keys", page_s);
        if (rc == 0) rc = q_add(q, 8192, "prefix", prefix);
        if (rc < 0) break;
        s3_req r = {.method = "GET", .key = "", .query = q, .max_body = 16u << 20};
        char what[80];
        snprintf(what, sizeof what, "ListObjectsV2 of '%.40s'", prefix);
        rc = ckpt__s3_send(c, &r, what);
        const char *x = r.body_out ? r.body_out : "";
        size_t xl = r.body_out_len, tl = 0;
        const char *t, *after = NULL;
        /* <Contents><Key>k</Key>...<Size>n</Size>...</Contents> */
        const char *cur = x;
        while (rc == 0 && (t = xml_find(cur, xl - (size_t)(cur - x), "Contents", &tl, &after))) {
            char size_s[32] = "";
            if (ckpt__s3_xml_text(t, tl, "Key", item, 4096) < 0 ||
                ckpt__s3_xml_text(t, tl, "Size", size_s, sizeof size_s) < 0) {
                rc = ckpt__err(CKPT_ECORRUPT,
                               "s3://%s: ListObjectsV2: an entry without a "
                               "readable Key and Size",
                               c->bucket);
                break;
            }
            char *end = NULL;
            errno = 0;
            unsigned long long sz = strtoull(size_s, &end, 10);
            if (errno || !end || *end || size_s[0] == '-') {
                rc = ckpt__err(CKPT_ECORRUPT, "s3://%s/%s: ListObjectsV2: size '%s'", c->bucket,
                               item, size_s);
                break;
            }
            rc = fn(user, item, sz, false);
            cur = after;
        }
        cur = x;
        while (rc == 0 &&
               (t = xml_find(cur, xl - (size_t)(cur - x), "CommonPrefixes", &tl, &after))) {
            if (ckpt__s3_xml_text(t, tl, "Prefix", item, 4096) == 0) rc = fn(user, item, 0, true);
            cur = after;
        }
        char trunc[16] = "";
        bool more = rc == 0 && ckpt__s3_xml_text(x, xl, "IsTruncated", trunc, sizeof trunc) == 0 &&
                    strcmp(trunc, "true") == 0;
        if (more && ckpt__s3_xml_text(x, xl, "NextContinuationToken", token, sizeof token) < 0)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "s3://%s: ListObjectsV2: truncated without a continuation token",
                           c->bucket);
        ckpt__s3_req_clear(&r);
        if (!more || page > 1000000) break;
    }
    free(q);
    free(item);
    return rc;
}

#endif
