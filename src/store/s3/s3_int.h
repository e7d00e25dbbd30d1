/* s3_int.h — what the object-store client's files share (s3.c: the
 * configuration and one request with its retries; s3_xfer.c: the parallel
 * transfers). Nothing else includes it. */
#ifndef CKPT_S3_INT_H
#define CKPT_S3_INT_H

#ifdef CKPT_HAVE_S3

#include <pthread.h>
#include <stdatomic.h>

#include "store/s3/s3.h"

/* One request: what to send and what came back. */
typedef struct s3_req {
    const char *method; /* GET, PUT, HEAD, DELETE, POST */
    const char *key;    /* "" for the bucket itself */
    const char *query;  /* canonical query string (sorted, encoded), "" for none */
    ckpt_s3_hdr extra[4];
    int nextra;
    const uint8_t *body;
    size_t body_len;
    bool sign_body; /* SHA-256 of the body instead of UNSIGNED-PAYLOAD */
    /* Where a 2xx body goes: exactly dst_len bytes into dst (a range that
     * must start at range_off of an object of range_total bytes), or a heap
     * buffer of at most max_body bytes. */
    uint8_t *dst;
    uint64_t dst_len, range_off, range_total;
    uint64_t max_body;
    /* results */
    long status;
    char *body_out; /* the body (2xx without dst, or an error's), NUL-terminated */
    size_t body_out_len;
    uint64_t got; /* bytes written into dst */
    bool has_length;
    ckpt_s3_head head; /* size = Content-Length */
    bool has_range;
    uint64_t cr_start, cr_end, cr_total;
    int sink_err; /* the sink refused the body: CKPT_ECORRUPT and why */
    char sink_msg[200];
    int attempts;
} s3_req;

struct ckpt_s3 {
    char *bucket;
    char *endpoint; /* scheme://host[:port], no trailing slash */
    char *host;     /* the Host header */
    bool path_style;
    char *access_key, *secret_key, *token, *region;
    ckpt_s3_options o;
    /* easy handles, reused (their connections stay open) */
    pthread_mutex_t pool_mu;
    void **handles;
    int nhandles, nfree;
    void **free_handles;
    /* the transfer workers (s3_xfer.c), started on first use */
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    struct s3_job *queue_head, *queue_tail;
    pthread_t *workers;
    int nworkers;
    bool stop;
    /* counters */
    _Atomic uint64_t n_requests, n_retries, n_put, n_get, n_head, n_list, n_delete, n_post;
    _Atomic uint64_t n_sent, n_received;
};

/* A unit of work for the transfer workers. */
typedef struct s3_job {
    struct s3_job *next;
    void (*run)(ckpt_s3 *c, struct s3_job *j);
    void *ctx;
    int status;
    char msg[640];
    bool done;
} s3_job;

/* Sends r (signing it, with retries on 5xx, 429 and network failures);
 * returns 0 when the final status is 2xx, else the status for it with a
 * message naming s3://bucket/key and `what` (the operation, for messages).
 * 404 gives CKPT_ENOENT, 412 CKPT_EEXIST, 403 CKPT_EIO. r->body_out is
 * the caller's to free (also on failure). */
int ckpt__s3_send(ckpt_s3 *c, s3_req *r, const char *what);
void ckpt__s3_req_clear(s3_req *r);

/* Text of the first <tag>...</tag> in xml (entities decoded) into out; 0 if
 * found, -1 if not (or it does not fit in cap). */
int ckpt__s3_xml_text(const char *xml, size_t len, const char *tag, char *out, size_t cap);

/* The workers: queue j (its run sets status and msg, and done is set after
 * it returns); wait until j is done. */
int ckpt__s3_submit(ckpt_s3 *c, s3_job *j);
void ckpt__s3_wait(ckpt_s3 *c, s3_job *j);
void ckpt__s3_workers_stop(ckpt_s3 *c);
/* A failed job's status and message raised in the calling thread. */
int ckpt__s3_job_raise(const s3_job *j);

#endif
#endif
