/* sigv4.h — AWS Signature Version 4 (sigv4.c): what the object-store client
 * (s3.c) signs its requests with, exposed for tests. A leaf of the client:
 * it takes nothing from s3.c. */
#ifndef CKPT_STORE_S3_SIGV4_H
#define CKPT_STORE_S3_SIGV4_H

#include <stdbool.h>
#include <stddef.h>

typedef struct ckpt_s3_hdr {
    const char *name; /* lower case */
    const char *value;
} ckpt_s3_hdr;
typedef struct ckpt_s3_creds {
    const char *access_key, *secret_key, *session_token, *region;
} ckpt_s3_creds;
/* Lowercase hex SHA-256 of n bytes (65 bytes with the NUL). */
void ckpt__sha256_hex(const void *p, size_t n, char out[65]);
/* The SHA-256 of no bytes, the payload hash of a request without a body. */
#define CKPT_SHA256_EMPTY "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
/* URI encoding of SigV4: every byte but A-Za-z0-9-_.~ as %XX (upper-case
 * hex); '/' kept when keep_slash. ckpt__malloc'd. */
char *ckpt__s3_uri_encode(const char *s, bool keep_slash);
/* The canonical request, string to sign and Authorization header value of
 * a request (each ckpt__malloc'd; any may be NULL when not wanted).
 * canon_query: already canonical (sorted, encoded). hdrs: the headers to
 * sign, names in lower case, in any order (host, x-amz-date and
 * x-amz-content-sha256 among them); amz_date: "YYYYMMDDTHHMMSSZ". */
int ckpt__sigv4(const ckpt_s3_creds *cr, const char *method, const char *canon_uri,
                const char *canon_query, const ckpt_s3_hdr *hdrs, int nhdrs,
                const char *payload_hash, const char *amz_date, char **canonical, char **to_sign,
                char **authorization);

#endif
