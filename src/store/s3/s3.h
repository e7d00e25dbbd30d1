/* s3.h — an object-store client for the checkpoint store: the S3 REST API
 * over libcurl, requests signed with AWS Signature Version 4 (OpenSSL's
 * HMAC-SHA256 and SHA-256).
 *
 * Where it is configured: the standard AWS environment.
 *   AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY   required
 *   AWS_SESSION_TOKEN                          optional (temporary credentials)
 *   AWS_REGION (or AWS_DEFAULT_REGION)         default us-east-1
 *   AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL    a custom endpoint (MinIO, a
 *       loopback test server, ...), addressed path-style: <endpoint>/<bucket>/<key>;
 *       without one, https://<bucket>.s3.<region>.amazonaws.com/<key>
 * and ckpt's own knobs (each optional):
 *   CKPT_S3_PART_SIZE     bytes per multipart part and per ranged GET (K/M/G
 *                         suffixes; default 16M, at least 5M unless an endpoint is set)
 *   CKPT_S3_CONNECTIONS   requests in flight at once (default 8, 1..64)
 *   CKPT_S3_RETRIES       attempts after the first on 5xx, 429 and network
 *                         failures (default 5)
 *   CKPT_S3_TIMEOUT       seconds a request may make no progress (default 60)
 *   CKPT_S3_BACKOFF_MS    first retry delay, doubled each time up to 5 s, with
 *                         jitter (default 200)
 *   CKPT_S3_SIGN_PAYLOAD  1: SHA-256 every request body (default: bodies up
 *                         under 1 MiB, see s3.c)
 *   CKPT_S3_COPY_MAX      the largest object one CopyObject copies (default
 *                         5G, S3's limit); larger ones are copied by
 *                         UploadPartCopy in parts of that size
 *
 * A library built without libcurl or OpenSSL keeps this interface: every
 * call then returns CKPT_EUNSUPPORTED saying so (ckpt__s3_available).
 *
 * Statuses: CKPT_ENOENT for 404 (naming the key, or the bucket), CKPT_EEXIST
 * for 412 (a conditional write lost: the key exists, or changed), CKPT_EIO
 * for 403 (naming the key and saying to check the credentials), other
 * refusals and failures after the retries; CKPT_ECORRUPT for a response that
 * does not match what was asked (a size, a range). Messages name
 * s3://<bucket>/<key>. */
#ifndef CKPT_S3_H
#define CKPT_S3_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "base/error.h"
#include "base/io.h"
#include "store/s3/sigv4.h"

typedef struct ckpt_s3_options {
    uint64_t part_size;
    uint64_t copy_max; /* larger server-side copies go by UploadPartCopy, in parts of this size */
    int connections;
    int retries;
    long timeout_ms;
    long backoff_ms;
    bool sign_payload;
    int list_page; /* max-keys of one ListObjectsV2 page (1000; tests set less) */
} ckpt_s3_options;

typedef struct ckpt_s3 ckpt_s3;

/* Bodies under this many bytes are signed with their SHA-256 (s3.c). */
#define CKPT_S3_SIGN_MAX (1u << 20)

/* Whether path names an object-store location ("s3://..."). */
bool ckpt__s3_is_url(const char *path);
/* Splits "s3://<bucket>[/<prefix>]" into its bucket and prefix (no leading
 * or trailing slash; "" for none), both ckpt__malloc'd. CKPT_EINVAL naming
 * url for anything else (an empty or invalid bucket name, "." or ".."
 * segments, empty segments, control characters). */
int ckpt__s3_parse_url(const char *url, char **bucket, char **prefix);
/* 0 where this library was built with object-store support, else
 * CKPT_EUNSUPPORTED with a message saying what `what` needs. */
int ckpt__s3_available(const char *what);

/* A client of one bucket, configured from the environment (above). */
int ckpt__s3_new(ckpt_s3 **out, const char *bucket);
void ckpt__s3_free(ckpt_s3 *c);
const ckpt_s3_options *ckpt__s3_options(const ckpt_s3 *c);
const char *ckpt__s3_bucket(const ckpt_s3 *c);
/* Tests: the keys per ListObjectsV2 page (1..1000), to see pagination. */
void ckpt__s3_set_list_page(ckpt_s3 *c, int n);

/* Request counters since the client was made (for tests, benchmarks and the
 * cost per save in docs/STORAGE.md). */
typedef struct ckpt_s3_stats {
    uint64_t requests; /* every attempt, retries included */
    uint64_t retries;
    uint64_t puts, gets, heads, lists, deletes, posts;
    uint64_t bytes_sent, bytes_received;
} ckpt_s3_stats;
void ckpt__s3_stats(const ckpt_s3 *c, ckpt_s3_stats *out);

/* What a conditional PUT asks. */
typedef enum ckpt_s3_cond {
    CKPT_S3_ALWAYS = 0,
    CKPT_S3_IF_ABSENT, /* If-None-Match: * — CKPT_EEXIST if the key exists */
    CKPT_S3_IF_ETAG    /* If-Match: <etag> — CKPT_EEXIST if it changed or is gone */
} ckpt_s3_cond;

/* PUT of n bytes in one request. etag_out (may be NULL, 128 bytes) gets the
 * new object's ETag. */
int ckpt__s3_put(ckpt_s3 *c, const char *key, const void *p, size_t n, ckpt_s3_cond cond,
                 const char *etag, char *etag_out);

/* What HEAD (or a small GET) learns of an object. Times are the server's
 * (seconds since the epoch; 0 if it did not say). */
typedef struct ckpt_s3_head {
    uint64_t size;
    char etag[128];
    int64_t last_modified;
    int64_t server_now; /* the response's Date */
} ckpt_s3_head;
int ckpt__s3_head(ckpt_s3 *c, const char *key, ckpt_s3_head *h);

/* GET of a whole small object (a manifest, a lock): at most max bytes, else
 * CKPT_ECORRUPT; NUL-terminated heap copy in *out (free()), its length in
 * *len. h (may be NULL) gets its metadata. */
int ckpt__s3_get_small(ckpt_s3 *c, const char *key, uint64_t max, char **out, size_t *len,
                       ckpt_s3_head *h);

/* GET of an object that must hold exactly size bytes into dst: ranged GETs
 * of part_size in parallel, each response checked (status, Content-Range,
 * length) before its bytes are kept and written only inside its range; the
 * caller's thread hashes the ranges in order as they complete (XXH3-64 of the
 * whole object into *xxh3), so the bytes hashed are the bytes in dst. A HEAD
 * first: an object of another size is CKPT_ECORRUPT before anything is read. */
int ckpt__s3_get(ckpt_s3 *c, const char *key, uint64_t size, uint8_t *dst, uint64_t *xxh3);

/* The same bytes delivered in order instead of kept: ranges of part_size
 * fetched `connections` at a time into a window of that many parts, each
 * window hashed and then handed to fn (may be NULL: verification only) in
 * object order; fn's non-zero return stops the read and is returned. The
 * memory used is the window, whatever the object's size. */
typedef int (*ckpt_s3_bytes_fn)(void *user, const uint8_t *p, size_t n);
int ckpt__s3_get_stream(ckpt_s3 *c, const char *key, uint64_t size, ckpt_s3_bytes_fn fn, void *user,
                        uint64_t *xxh3);

/* Several objects at once, each of exactly sizes[i] bytes (the caller
 * checked them, from a listing, before asking) into dst[i]: the ranges of
 * every object fetched `connections` at a time, each response checked
 * before its bytes are kept (status, Content-Range and the object's total
 * size, length), the caller's thread hashing each object's ranges in order
 * as they arrive (XXH3-64 into xxh3[i]). No HEAD. On failure *failed (may
 * be NULL) is the first object, in order, that failed; the ranges not yet
 * started are dropped. */
int ckpt__s3_get_many(ckpt_s3 *c, int64_t n, const char *const *keys, const uint64_t *sizes,
                      uint8_t *const *dst, uint64_t *xxh3, int64_t *failed);

/* A server-side copy of the object src_key (size bytes, in this bucket) to
 * dst_key: CopyObject, or for an object over copy_max a multipart upload of
 * UploadPartCopy ranges. if_match (may be NULL or ""): copy only if the
 * source's ETag is that (x-amz-copy-source-if-match; CKPT_EEXIST if not).
 * etag_out (may be NULL, 128 bytes) gets the new object's ETag. A failure
 * reported in a 200 answer's body is a failure. */
int ckpt__s3_copy(ckpt_s3 *c, const char *src_key, const char *dst_key, uint64_t size,
                  const char *if_match, char *etag_out);

/* DELETE (a missing key is fine: S3 says 204 either way). */
int ckpt__s3_delete(ckpt_s3 *c, const char *key);

/* ListObjectsV2 of every key under prefix, page by page (continuation
 * tokens). With delimiter (may be NULL) the common prefixes come too
 * (is_prefix true, size 0). fn's non-zero return stops the listing and is
 * returned. */
typedef int (*ckpt_s3_list_fn)(void *user, const char *key, uint64_t size, bool is_prefix);
int ckpt__s3_list(ckpt_s3 *c, const char *prefix, const char *delimiter, ckpt_s3_list_fn fn,
                  void *user);

/* A streamed upload: bytes written are cut into parts of part_size, each
 * sent as soon as it is full (up to `connections` parts in flight; the
 * writer waits when that many are); finish sends what is left and
 * completes the upload. An object smaller than one part is sent by one
 * PUT at finish (no multipart request at all). A failed part stops the
 * upload (sticky error: every later call returns it); abort (and finish
 * after a failure) aborts the multipart upload on the server. */
typedef struct ckpt_s3_upload ckpt_s3_upload;
int ckpt__s3_upload_begin(ckpt_s3 *c, const char *key, ckpt_s3_upload **out);
int ckpt__s3_upload_write(ckpt_s3_upload *u, const void *p, size_t n);
/* Completes and frees u (also on failure, the multipart upload then
 * aborted); *size (may be NULL) gets the bytes uploaded, etag_out (may be
 * NULL, 128 bytes) the object's ETag ("" if the store gave none). */
int ckpt__s3_upload_finish(ckpt_s3_upload *u, uint64_t *size, char *etag_out);
/* Aborts and frees u; NULL is fine. */
void ckpt__s3_upload_abort(ckpt_s3_upload *u);

/* An upload as a write stream's sink (ckpt__ostream_open_sink with ctx a
 * ckpt_s3_sink whose u was begun): what a save streams into an object. At
 * finish, size and etag are set and u is gone (so it is after abort). */
typedef struct ckpt_s3_sink {
    ckpt_s3_upload *u;
    uint64_t size;
    char etag[128];
} ckpt_s3_sink;
extern const ckpt_ostream_sink ckpt__s3_sink_ops;

#endif
