/* s3_xfer.c — the object-store client's parallel transfers (s3.h): a pool
 * of worker threads, the streamed multipart upload and the parallel ranged
 * GET verified in order as its ranges arrive. */
#include "store/s3/s3.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef CKPT_HAVE_S3
#include <stdatomic.h>
#include <xxhash.h>

#include "store/s3/s3_int.h"

static void job_fail(s3_job *j, int rc) {
    j->status = rc;
    snprintf(j->msg, sizeof j->msg, "%s", ckpt_errmsg());
}

/* ---- parallel ranged GET ------------------------------------------------- */

typedef struct range_job {
    s3_job job; /* first */
    const char *key;
    uint8_t *dst; /* where this range's bytes go */
    uint64_t off, len, total;
    atomic_bool *stop; /* NULL, or set when a range of the same read failed */
} range_job;

/* Bytes off..off+len-1 of an object of total bytes into dst (len bytes). */
static int get_range(ckpt_s3 *c, const char *key, uint8_t *dst, uint64_t off, uint64_t len,
                     uint64_t total) {
    char range[64];
    snprintf(range, sizeof range, "bytes=%" PRIu64 "-%" PRIu64, off, off + len - 1);
    s3_req r = {.method = "GET",
                .key = key,
                .query = "",
                .dst = dst,
                .dst_len = len,
                .range_off = off,
                .range_total = total};
    r.extra[r.nextra++] = (ckpt_s3_hdr){"range", range};
    char what[96];
    snprintf(what, sizeof what, "GET of bytes %" PRIu64 "..%" PRIu64, off, off + len - 1);
    int rc = ckpt__s3_send(c, &r, what);
    if (rc == 0 && r.got != len)
        rc = ckpt__err(CKPT_ECORRUPT, "s3://%s/%s: %s: %" PRIu64 " bytes arrived", c->bucket, key,
                       what, r.got);
    ckpt__s3_req_clear(&r);
    return rc;
}

static void run_range(ckpt_s3 *c, s3_job *j) {
    range_job *rj = (range_job *)j;
    if (rj->stop && atomic_load(rj->stop)) return; /* dropped: the read failed already */
    int rc = get_range(c, rj->key, rj->dst, rj->off, rj->len, rj->total);
    if (rc < 0) {
        job_fail(j, rc);
        if (rj->stop) atomic_store(rj->stop, true);
    }
}

int ckpt__s3_get_many(ckpt_s3 *c, int64_t n, const char *const *keys, const uint64_t *sizes,
                      uint8_t *const *dst, uint64_t *xxh3, int64_t *failed) {
    if (failed) *failed = -1;
    uint64_t part = c->o.part_size, total = 0;
    for (int64_t i = 0; i < n; i++) total += (sizes[i] + part - 1) / part;
    range_job *jobs = ckpt__calloc((size_t)(total ? total : 1), sizeof *jobs);
    XXH3_state_t *st = XXH3_createState();
    if (!jobs || !st) {
        free(jobs);
        XXH3_freeState(st);
        return ckpt__err_nomem("s3 GET");
    }
    atomic_bool stop = false;
    int rc = 0;
    uint64_t submitted = 0, k = 0;
    for (int64_t i = 0; i < n && rc == 0; i++)
        for (uint64_t off = 0; off < sizes[i] && rc == 0; off += part, k++) {
            range_job *rj = &jobs[k];
            rj->job.run = run_range;
            rj->key = keys[i];
            rj->dst = dst[i] + off;
            rj->off = off;
            rj->len = sizes[i] - off < part ? sizes[i] - off : part;
            rj->total = sizes[i];
            rj->stop = &stop;
            rc = ckpt__s3_submit(c, &rj->job);
            if (rc == 0) submitted++;
        }
    if (rc < 0) {
        atomic_store(&stop, true);
        if (failed) *failed = 0;
    }
    /* each object hashed in order, range by range as they complete, while
     * the later ones still arrive; every submitted job is waited for (it
     * writes into dst) */
    k = 0;
    for (int64_t i = 0; i < n; i++) {
        XXH3_64bits_reset(st);
        for (uint64_t off = 0; off < sizes[i]; off += part, k++) {
            if (k >= submitted) break;
            ckpt__s3_wait(c, &jobs[k].job);
            if (rc == 0 && jobs[k].job.status < 0) {
                rc = ckpt__s3_job_raise(&jobs[k].job);
                if (failed) *failed = i;
            }
            if (rc == 0) XXH3_64bits_update(st, jobs[k].dst, (size_t)jobs[k].len);
        }
        if (rc == 0) xxh3[i] = sizes[i] ? XXH3_64bits_digest(st) : XXH3_64bits(dst[i], 0);
    }
    XXH3_freeState(st);
    free(jobs);
    return rc;
}

/* HEAD of key: it must hold exactly size bytes. */
static int head_of_size(ckpt_s3 *c, const char *key, uint64_t size) {
    ckpt_s3_head h;
    CKPT_TRY(ckpt__s3_head(c, key, &h));
    if (h.size != size)
        return ckpt__err(CKPT_ECORRUPT,
                         "s3://%s/%s: the object holds %" PRIu64 " bytes, expected %" PRIu64,
                         c->bucket, key, h.size, size);
    return CKPT_OK;
}

int ckpt__s3_get(ckpt_s3 *c, const char *key, uint64_t size, uint8_t *dst, uint64_t *xxh3) {
    CKPT_TRY(head_of_size(c, key, size));
    if (size == 0) {
        *xxh3 = XXH3_64bits(dst, 0);
        return 0;
    }
    uint64_t part = c->o.part_size, n = (size + part - 1) / part;
    if (n == 1) {
        CKPT_TRY(get_range(c, key, dst, 0, size, size));
        *xxh3 = XXH3_64bits(dst, (size_t)size);
        return 0;
    }
    range_job *jobs = ckpt__calloc((size_t)n, sizeof *jobs);
    XXH3_state_t *st = XXH3_createState();
    if (!jobs || !st) {
        free(jobs);
        XXH3_freeState(st);
        return ckpt__err_nomem("s3 GET");
    }
    XXH3_64bits_reset(st);
    int rc = 0;
    uint64_t submitted = 0;
    for (uint64_t i = 0; i < n && rc == 0; i++) {
        range_job *rj = &jobs[i];
        rj->job.run = run_range;
        rj->key = key;
        rj->dst = dst + i * part;
        rj->off = i * part;
        rj->len = i + 1 < n ? part : size - i * part;
        rj->total = size;
        rc = ckpt__s3_submit(c, &rj->job);
        if (rc == 0) submitted++;
    }
    /* hash in order, each range as soon as it is there, while the later
     * ones are still arriving; every submitted job is waited for, since it
     * writes into dst */
    for (uint64_t i = 0; i < submitted; i++) {
        ckpt__s3_wait(c, &jobs[i].job);
        if (rc == 0 && jobs[i].job.status < 0) rc = ckpt__s3_job_raise(&jobs[i].job);
        if (rc == 0) XXH3_64bits_update(st, jobs[i].dst, (size_t)jobs[i].len);
    }
    if (rc == 0) *xxh3 = XXH3_64bits_digest(st);
    XXH3_freeState(st);
    free(jobs);
    return rc;
}

int ckpt__s3_get_stream(ckpt_s3 *c, const char *key, uint64_t size, ckpt_s3_bytes_fn fn, void *user,
                        uint64_t *xxh3) {
    CKPT_TRY(head_of_size(c, key, size));
    uint64_t part = c->o.part_size;
    uint64_t per = (uint64_t)c->o.connections;
    uint64_t win = size < part * per ? size : part * per;
    uint8_t *buf = ckpt__malloc(win ? (size_t)win : 1);
    range_job *jobs = ckpt__calloc((size_t)per, sizeof *jobs);
    XXH3_state_t *st = XXH3_createState();
    int rc = 0;
    if (!buf || !jobs || !st) rc = ckpt__err_nomem("s3 GET window");
    if (rc == 0) XXH3_64bits_reset(st);
    for (uint64_t base = 0; rc == 0 && base < size; base += win) {
        uint64_t left = size - base, n = 0;
        /* the window's ranges, each at its place in buf */
        for (; n < per && n * part < left && rc == 0; n++) {
            range_job *rj = &jobs[n];
            memset(rj, 0, sizeof *rj);
            rj->job.run = run_range;
            rj->key = key;
            rj->dst = buf + n * part;
            rj->off = base + n * part;
            rj->len = left - n * part < part ? left - n * part : part;
            rj->total = size;
            if (n + 1 == per || (n + 1) * part >= left) break;
        }
        uint64_t count = n + 1, sent = 0;
        if (count == 1) {
            rc = get_range(c, key, buf, jobs[0].off, jobs[0].len, size);
            sent = 0;
        } else {
            for (uint64_t i = 0; i < count && rc == 0; i++) {
                rc = ckpt__s3_submit(c, &jobs[i].job);
                if (rc == 0) sent++;
            }
            for (uint64_t i = 0; i < sent; i++) {
                ckpt__s3_wait(c, &jobs[i].job);
                if (rc == 0 && jobs[i].job.status < 0) rc = ckpt__s3_job_raise(&jobs[i].job);
            }
        }
        uint64_t got = 0;
        for (uint64_t i = 0; i < count; i++) got += jobs[i].len;
        if (rc == 0) XXH3_64bits_update(st, buf, (size_t)got);
        if (rc == 0 && fn) rc = fn(user, buf, (size_t)got);
    }
    if (rc == 0) *xxh3 = size ? XXH3_64bits_digest(st) : XXH3_64bits(buf, 0);
    XXH3_freeState(st);
    free(jobs);
    free(buf);
    return rc;
}

/* ---- streamed multipart upload ------------------------------------------ */

#define MAX_PARTS 10000

typedef struct part_job {
    s3_job job; /* first */
    struct ckpt_s3_upload *u;
    int number;
    uint8_t *data;
    size_t len;
    /* an UploadPartCopy instead: bytes copy_off..+len of the copy's source */
    bool copy;
    uint64_t copy_off;
    char etag[128];
} part_job;

struct ckpt_s3_upload {
    ckpt_s3 *c;
    char *key;
    char *upload_id; /* NULL until the first part is full */
    uint8_t *buf;    /* the part being filled */
    size_t fill;
    uint64_t total;
    part_job **parts;
    int nparts, cap;
    int inflight_next; /* the oldest part not yet waited for */
    int err;
    char errmsg[640];
    char etag[128]; /* the completed object's */
    /* a multipart copy: its source ("/bucket/key", encoded) and condition */
    char *copy_source;
    const char *copy_if_match;
};

/* A 2xx answer whose body is an <Error> (CopyObject, UploadPartCopy and
 * CompleteMultipartUpload may fail after answering 200). */
static int body_error(ckpt_s3 *c, const char *key, const char *what, const s3_req *r) {
    char code[96] = "";
    if (!r->body_out || !strstr(r->body_out, "<Error>")) return 0;
    ckpt__s3_xml_text(r->body_out, r->body_out_len, "Code", code, sizeof code);
    return ckpt__err(CKPT_EIO, "s3://%s/%s: %s failed (%s)", c->bucket, key, what,
                     *code ? code : "an error in a 200 answer");
}

static void run_part(ckpt_s3 *c, s3_job *j) {
    part_job *pj = (part_job *)j;
    char q[1200];
    char *id = ckpt__s3_uri_encode(pj->u->upload_id, false);
    if (!id) {
        job_fail(j, ckpt__err_nomem("s3 part"));
        return;
    }
    snprintf(q, sizeof q, "partNumber=%d&uploadId=%s", pj->number, id);
    free(id);
    s3_req r = {
        .method = "PUT", .key = pj->u->key, .query = q, .body = pj->data, .body_len = pj->len};
    r.sign_body = c->o.sign_payload || pj->len < CKPT_S3_SIGN_MAX;
    char what[64], range[64];
    snprintf(what, sizeof what, "%s of part %d", pj->copy ? "copy" : "upload", pj->number);
    if (pj->copy) {
        /* UploadPartCopy: no body; the ETag comes in <CopyPartResult> */
        r.body = NULL;
        r.body_len = 0;
        r.max_body = 1u << 20;
        snprintf(range, sizeof range, "bytes=%" PRIu64 "-%" PRIu64, pj->copy_off,
                 pj->copy_off + pj->len - 1);
        r.extra[r.nextra++] = (ckpt_s3_hdr){"x-amz-copy-source", pj->u->copy_source};
        if (pj->u->copy_if_match && *pj->u->copy_if_match)
            r.extra[r.nextra++] = (ckpt_s3_hdr){"x-amz-copy-source-if-match", pj->u->copy_if_match};
        r.extra[r.nextra++] = (ckpt_s3_hdr){"x-amz-copy-source-range", range};
    }
    int rc = ckpt__s3_send(c, &r, what);
    if (rc == 0 && pj->copy) {
        rc = body_error(c, pj->u->key, what, &r);
        if (rc == 0 && r.body_out)
            ckpt__s3_xml_text(r.body_out, r.body_out_len, "ETag", r.head.etag, sizeof r.head.etag);
    }
    if (rc == 0 && !r.head.etag[0])
        rc = ckpt__err(CKPT_EIO, "s3://%s/%s: %s: no ETag in the answer", c->bucket, pj->u->key,
                       what);
    if (rc == 0) snprintf(pj->etag, sizeof pj->etag, "%s", r.head.etag);
    ckpt__s3_req_clear(&r);
    free(pj->data);
    pj->data = NULL;
    if (rc < 0) job_fail(j, rc);
}

static int up_fail(ckpt_s3_upload *u, int rc) {
    if (!u->err) {
        u->err = rc;
        snprintf(u->errmsg, sizeof u->errmsg, "%s", ckpt_errmsg());
    }
    return u->err;
}

static int up_err(const ckpt_s3_upload *u) { return ckpt__err(u->err, "%s", u->errmsg); }

int ckpt__s3_upload_begin(ckpt_s3 *c, const char *key, ckpt_s3_upload **out) {
    *out = NULL;
    ckpt_s3_upload *u = ckpt__calloc(1, sizeof *u);
    if (!u) return ckpt__err_nomem("s3 upload");
    u->c = c;
    u->key = ckpt__strdup(key);
    if (!u->key) {
        free(u);
        return ckpt__err_nomem("s3 upload");
    }
    *out = u;
    return 0;
}

/* Waits for the oldest part in flight; its failure becomes the upload's. */
static void wait_oldest(ckpt_s3_upload *u) {
    part_job *pj = u->parts[u->inflight_next++];
    ckpt__s3_wait(u->c, &pj->job);
    if (pj->job.status < 0 && !u->err) {
        u->err = pj->job.status;
        snprintf(u->errmsg, sizeof u->errmsg, "%s", pj->job.msg);
    }
}

static int initiate(ckpt_s3_upload *u) {
    s3_req r = {.method = "POST", .key = u->key, .query = "uploads=", .max_body = 1u << 20};
    int rc = ckpt__s3_send(u->c, &r, "start of a multipart upload");
    char id[1024];
    if (rc == 0 &&
        (!r.body_out ||
         ckpt__s3_xml_text(r.body_out, r.body_out_len, "UploadId", id, sizeof id) < 0 || !*id))
        rc = ckpt__err(CKPT_EIO,
                       "s3://%s/%s: start of a multipart upload: no UploadId in the answer",
                       u->c->bucket, u->key);
    if (rc == 0 && !(u->upload_id = ckpt__strdup(id))) rc = ckpt__err_nomem("s3 upload");
    ckpt__s3_req_clear(&r);
    return rc;
}

/* Hands the filled buffer to the workers as the next part. */
static int send_part(ckpt_s3_upload *u) {
    if (!u->upload_id) {
        int rc = initiate(u);
        if (rc < 0) return up_fail(u, rc);
    }
    if (u->nparts == MAX_PARTS)
        return up_fail(u, ckpt__err(CKPT_EINVAL,
                                    "s3://%s/%s: more than %d parts of %" PRIu64
                                    " bytes; raise CKPT_S3_PART_SIZE",
                                    u->c->bucket, u->key, MAX_PARTS, u->c->o.part_size));
    if (u->nparts == u->cap) {
        int cap = u->cap ? u->cap * 2 : 16;
        part_job **np = ckpt__realloc(u->parts, (size_t)cap * sizeof *np);
        if (!np) return up_fail(u, ckpt__err_nomem("s3 upload"));
        u->parts = np;
        u->cap = cap;
    }
    /* at most `connections` parts in flight: wait for the oldest */
    while (u->nparts - u->inflight_next >= u->c->o.connections) wait_oldest(u);
    if (u->err) return u->err;
    part_job *pj = ckpt__calloc(1, sizeof *pj);
    if (!pj) return up_fail(u, ckpt__err_nomem("s3 upload"));
    pj->job.run = run_part;
    pj->u = u;
    pj->number = u->nparts + 1;
    pj->data = u->buf;
    pj->len = u->fill;
    u->buf = NULL;
    u->fill = 0;
    u->parts[u->nparts++] = pj;
    int rc = ckpt__s3_submit(u->c, &pj->job);
    if (rc < 0) {
        free(pj->data);
        pj->data = NULL;
        pj->job.done = true;
        return up_fail(u, rc);
    }
    return 0;
}

int ckpt__s3_upload_write(ckpt_s3_upload *u, const void *p, size_t n) {
    if (u->err) return up_err(u);
    const uint8_t *src = p;
    size_t part = (size_t)u->c->o.part_size;
    while (n > 0) {
        if (!u->buf) {
            u->buf = ckpt__malloc(part);
            if (!u->buf) return up_fail(u, ckpt__err_nomem("s3 upload part"));
        }
        size_t take = part - u->fill < n ? part - u->fill : n;
        memcpy(u->buf + u->fill, src, take);
        u->fill += take;
        u->total += take;
        src += take;
        n -= take;
        if (u->fill == part && send_part(u) < 0) return up_err(u);
    }
    return 0;
}

static void free_upload(ckpt_s3_upload *u) {
    for (int i = 0; i < u->nparts; i++) {
        free(u->parts[i]->data);
        free(u->parts[i]);
    }
    free(u->copy_source);
    free(u->parts);
    free(u->buf);
    free(u->upload_id);
    free(u->key);
    free(u);
}

static void wait_all(ckpt_s3_upload *u) {
    while (u->inflight_next < u->nparts) wait_oldest(u);
}

static int complete(ckpt_s3_upload *u) {
    size_t cap = (size_t)u->nparts * 200 + 128;
    char *x = ckpt__malloc(cap);
    if (!x) return ckpt__err_nomem("s3 upload");
    size_t o = (size_t)snprintf(x, cap, "<CompleteMultipartUpload>");
    for (int i = 0; i < u->nparts; i++) {
        /* the ETag as S3 sent it, quotes and all, escaped for XML */
        char et[200];
        size_t e = 0;
        for (const char *s = u->parts[i]->etag; *s && e + 7 < sizeof et; s++) {
            if (*s == '"') e += (size_t)snprintf(et + e, sizeof et - e, "&quot;");
            else if (*s == '&') e += (size_t)snprintf(et + e, sizeof et - e, "&amp;");
            else if (*s == '<') e += (size_t)snprintf(et + e, sizeof et - e, "&lt;");
            else et[e++] = *s;
        }
        et[e] = '\0';
        o += (size_t)snprintf(x + o, cap - o,
                              "<Part><PartNumber>%d</PartNumber><ETag>%s</ETag></Part>",
                              u->parts[i]->number, et);
    }
    o += (size_t)snprintf(x + o, cap - o, "</CompleteMultipartUpload>");
    char *id = ckpt__s3_uri_encode(u->upload_id, false);
    char q[1200];
    if (id) snprintf(q, sizeof q, "uploadId=%s", id);
    free(id);
    if (!id) {
        free(x);
        return ckpt__err_nomem("s3 upload");
    }
    s3_req r = {.method = "POST",
                .key = u->key,
                .query = q,
                .body = (const uint8_t *)x,
                .body_len = o,
                .sign_body = true,
                .max_body = 1u << 20};
    int rc = ckpt__s3_send(u->c, &r, "completion of a multipart upload");
    /* S3 may answer 200 and put the failure in the body */
    if (rc == 0) rc = body_error(u->c, u->key, "completion of a multipart upload", &r);
    if (rc == 0 && r.body_out &&
        ckpt__s3_xml_text(r.body_out, r.body_out_len, "ETag", u->etag, sizeof u->etag) < 0)
        u->etag[0] = '\0';
    ckpt__s3_req_clear(&r);
    free(x);
    return rc;
}

static void abort_server(ckpt_s3_upload *u) {
    if (!u->upload_id) return;
    char *id = ckpt__s3_uri_encode(u->upload_id, false);
    if (!id) return;
    char q[1200];
    snprintf(q, sizeof q, "uploadId=%s", id);
    free(id);
    s3_req r = {.method = "DELETE", .key = u->key, .query = q};
    (void)ckpt__s3_send(u->c, &r, "abort of a multipart upload");
    ckpt__s3_req_clear(&r);
}

int ckpt__s3_upload_finish(ckpt_s3_upload *u, uint64_t *size, char *etag_out) {
    if (size) *size = 0;
    if (etag_out) etag_out[0] = '\0';
    int rc = u->err;
    if (rc == 0 && !u->upload_id) {
        /* smaller than one part: one PUT */
        rc = ckpt__s3_put(u->c, u->key, u->buf ? u->buf : (const uint8_t *)"", u->fill,
                          CKPT_S3_ALWAYS, NULL, etag_out);
        if (rc == 0 && size) *size = u->total;
        free_upload(u);
        return rc;
    }
    if (rc == 0 && u->fill > 0) rc = send_part(u) < 0 ? u->err : 0;
    wait_all(u);
    if (rc == 0 && u->err) rc = u->err;
    if (rc == 0) rc = complete(u);
    else rc = up_err(u);
    if (rc < 0) {
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
        abort_server(u);
        ckpt__err(rc, "%s", saved);
    } else {
        if (size) *size = u->total;
        if (etag_out) snprintf(etag_out, 128, "%s", u->etag);
    }
    free_upload(u);
    return rc;
}

void ckpt__s3_upload_abort(ckpt_s3_upload *u) {
    if (!u) return;
    wait_all(u);
    /* the caller's message (why it aborts) stays */
    char saved[1024];
    snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
    abort_server(u);
    if (*saved) ckpt__err(CKPT_EIO, "%s", saved);
    else ckpt_clear_error();
    free_upload(u);
}

/* ---- an upload as a write stream's sink ------------------------------------ */

static int sink_write(void *ctx, const void *p, size_t n) {
    return ckpt__s3_upload_write(((ckpt_s3_sink *)ctx)->u, p, n);
}

static int sink_finish(void *ctx) {
    ckpt_s3_sink *s = ctx;
    ckpt_s3_upload *u = s->u;
    s->u = NULL;
    return ckpt__s3_upload_finish(u, &s->size, s->etag);
}

static void sink_abort(void *ctx) {
    ckpt_s3_sink *s = ctx;
    ckpt__s3_upload_abort(s->u);
    s->u = NULL;
}

const ckpt_ostream_sink ckpt__s3_sink_ops = {sink_write, sink_finish, sink_abort};

/* ---- server-side copies ------------------------------------------------------- */

/* "/<bucket>/<key>", URI-encoded (slashes kept): x-amz-copy-source. */
static char *copy_source(const ckpt_s3 *c, const char *key) {
    char *ek = ckpt__s3_uri_encode(key, true);
    char *eb = ckpt__s3_uri_encode(c->bucket, false);
    char *out = ek && eb ? ckpt__malloc(strlen(ek) + strlen(eb) + 3) : NULL;
    if (out) sprintf(out, "/%s/%s", eb, ek);
    free(ek);
    free(eb);
    return out;
}

int ckpt__s3_copy(ckpt_s3 *c, const char *src_key, const char *dst_key, uint64_t size,
                  const char *if_match, char *etag_out) {
    if (etag_out) etag_out[0] = '\0';
    char *src = copy_source(c, src_key);
    if (!src) return ckpt__err_nomem("s3 copy");
    char what[600];
    snprintf(what, sizeof what, "copy from s3://%s/%s", c->bucket, src_key);
    int rc = 0;
    if (size <= c->o.copy_max) {
        s3_req r = {.method = "PUT", .key = dst_key, .query = "", .max_body = 1u << 20};
        r.extra[r.nextra++] = (ckpt_s3_hdr){"x-amz-copy-source", src};
        if (if_match && *if_match)
            r.extra[r.nextra++] = (ckpt_s3_hdr){"x-amz-copy-source-if-match", if_match};
        rc = ckpt__s3_send(c, &r, what);
        if (rc == 0) rc = body_error(c, dst_key, what, &r);
        if (rc == 0 && etag_out &&
            (!r.body_out || ckpt__s3_xml_text(r.body_out, r.body_out_len, "ETag", etag_out, 128)))
            etag_out[0] = '\0';
        ckpt__s3_req_clear(&r);
        free(src);
        return rc;
    }
    /* larger than one CopyObject: UploadPartCopy ranges of copy_max bytes,
     * `connections` at a time, then the completion */
    ckpt_s3_upload *u = NULL;
    rc = ckpt__s3_upload_begin(c, dst_key, &u);
    if (rc < 0) {
        free(src);
        return rc;
    }
    u->copy_source = src;
    u->copy_if_match = if_match;
    rc = initiate(u);
    if (rc < 0) up_fail(u, rc);
    for (uint64_t off = 0; u->err == 0 && off < size; off += c->o.copy_max) {
        if (u->nparts == MAX_PARTS) {
            up_fail(u, ckpt__err(CKPT_EINVAL, "s3://%s/%s: a copy of more than %d parts", c->bucket,
                                 dst_key, MAX_PARTS));
            break;
        }
        if (u->nparts == u->cap) {
            int cap = u->cap ? u->cap * 2 : 16;
            part_job **np = ckpt__realloc(u->parts, (size_t)cap * sizeof *np);
            if (!np) {
                up_fail(u, ckpt__err_nomem("s3 copy"));
                break;
            }
            u->parts = np;
            u->cap = cap;
        }
        while (u->nparts - u->inflight_next >= c->o.connections) wait_oldest(u);
        if (u->err) break;
        part_job *pj = ckpt__calloc(1, sizeof *pj);
        if (!pj) {
            up_fail(u, ckpt__err_nomem("s3 copy"));
            break;
        }
        pj->job.run = run_part;
        pj->u = u;
        pj->number = u->nparts + 1;
        pj->copy = true;
        pj->copy_off = off;
        pj->len = (size_t)(size - off < c->o.copy_max ? size - off : c->o.copy_max);
        u->parts[u->nparts++] = pj;
        int sub = ckpt__s3_submit(c, &pj->job);
        if (sub < 0) {
            pj->job.done = true;
            up_fail(u, sub);
        }
    }
    wait_all(u);
    rc = u->err ? up_err(u) : complete(u);
    if (rc < 0) {
        char saved[1024];
        snprintf(saved, sizeof saved, "%s", ckpt_errmsg());
        abort_server(u);
        ckpt__err(rc, "%s", saved);
    } else if (etag_out) {
        snprintf(etag_out, 128, "%s", u->etag);
    }
    free_upload(u);
    return rc;
}

#else

int ckpt__s3_get_stream(ckpt_s3 *c, const char *key, uint64_t size, ckpt_s3_bytes_fn fn, void *user,
                        uint64_t *xxh3) {
    return ckpt__s3_available(key);
}
int ckpt__s3_get(ckpt_s3 *c, const char *key, uint64_t size, uint8_t *dst, uint64_t *xxh3) {
    return ckpt__s3_available(key);
}
int ckpt__s3_upload_begin(ckpt_s3 *c, const char *key, ckpt_s3_upload **out) {
    *out = NULL;
    return ckpt__s3_available(key);
}
int ckpt__s3_upload_write(ckpt_s3_upload *u, const void *p, size_t n) {
    return ckpt__s3_available("s3 upload");
}
int ckpt__s3_upload_finish(ckpt_s3_upload *u, uint64_t *size, char *etag_out) {
    return ckpt__s3_available("s3 upload");
}
void ckpt__s3_upload_abort(ckpt_s3_upload *u) { (void)u; }
int ckpt__s3_get_many(ckpt_s3 *c, int64_t n, const char *const *keys, const uint64_t *sizes,
                      uint8_t *const *dst, uint64_t *xxh3, int64_t *failed) {
    if (failed) *failed = 0;
    return ckpt__s3_available("s3 GET");
}
int ckpt__s3_copy(ckpt_s3 *c, const char *src_key, const char *dst_key, uint64_t size,
                  const char *if_match, char *etag_out) {
    return ckpt__s3_available(dst_key);
}
static int sink_write(void *ctx, const void *p, size_t n) {
    return ckpt__s3_available("s3 upload");
}
static int sink_finish(void *ctx) { return ckpt__s3_available("s3 upload"); }
static void sink_abort(void *ctx) { (void)ctx; }
const ckpt_ostream_sink ckpt__s3_sink_ops = {sink_write, sink_finish, sink_abort};

#endif
