/* sigv4.c — AWS Signature Version 4 for S3 requests (s3.h): the canonical
 * request, the string to sign, the derived signing key and the
 * Authorization header, with OpenSSL's SHA-256 and HMAC-SHA256. */
#include "store/s3/sigv4.h"

#include "base/error.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifdef CKPT_HAVE_S3
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/sha.h>
#endif

static bool unreserved(unsigned char ch) {
    return (ch >= 'A' && ch <= 'Z') || (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') ||
           ch == '-' || ch == '_' || ch == '.' || ch == '~';
}

char *ckpt__s3_uri_encode(const char *s, bool keep_slash) {
    size_t n = strlen(s);
    if (n > (SIZE_MAX - 1) / 3) return NULL;
    char *out = ckpt__malloc(3 * n + 1);
    if (!out) return NULL;
    static const char hex[] = "0123456789ABCDEF";
    size_t o = 0;
    for (size_t i = 0; i < n; i++) {
        unsigned char ch = (unsigned char)s[i];
        if (unreserved(ch) || (keep_slash && ch == '/')) {
            out[o++] = (char)ch;
        } else {
            out[o++] = '%';
            out[o++] = hex[ch >> 4];
            out[o++] = hex[ch & 15];
        }
    }
    out[o] = '\0';
    return out;
}

#ifdef CKPT_HAVE_S3

static void to_hex(const unsigned char *d, size_t n, char *out) {
    static const char hex[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hex[d[i] >> 4];
        out[2 * i + 1] = hex[d[i] & 15];
    }
    out[2 * n] = '\0';
}

void ckpt__sha256_hex(const void *p, size_t n, char out[65]) {
    unsigned char d[SHA256_DIGEST_LENGTH];
    SHA256(p, n, d);
    to_hex(d, sizeof d, out);
}

static int hmac(const void *key, size_t klen, const char *msg, unsigned char out[32]) {
    unsigned int olen = 0;
    if (!HMAC(EVP_sha256(), key, (int)klen, (const unsigned char *)msg, strlen(msg), out, &olen) ||
        olen != 32)
        return ckpt__err(CKPT_EIO, "Signature V4: HMAC-SHA256 failed (OpenSSL)");
    return 0;
}

/* A growable string for the canonical request. */
typedef struct sbuf {
    char *p;
    size_t n, cap;
    bool oom;
} sbuf;

static void sb_add(sbuf *b, const char *s, size_t n) {
    if (b->oom) return;
    if (b->n + n + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->n + n + 1) cap *= 2;
        char *np = ckpt__realloc(b->p, cap);
        if (!np) {
            b->oom = true;
            return;
        }
        b->p = np;
        b->cap = cap;
    }
    memcpy(b->p + b->n, s, n);
    b->n += n;
    b->p[b->n] = '\0';
}
static void sb_str(sbuf *b, const char *s) { sb_add(b, s, strlen(s)); }

/* A header value as SigV4 wants it: leading and trailing blanks dropped,
 * inner runs of blanks as one space. */
static void sb_trimmed(sbuf *b, const char *v) {
    while (*v == ' ' || *v == '\t') v++;
    size_t n = strlen(v);
    while (n > 0 && (v[n - 1] == ' ' || v[n - 1] == '\t')) n--;
    bool space = false;
    for (size_t i = 0; i < n; i++) {
        if (v[i] == ' ' || v[i] == '\t') {
            space = true;
            continue;
        }
        if (space) sb_add(b, " ", 1);
        space = false;
        sb_add(b, v + i, 1);
    }
}

static int cmp_hdr(const void *a, const void *b) {
    return strcmp(((const ckpt_s3_hdr *)a)->name, ((const ckpt_s3_hdr *)b)->name);
}

int ckpt__sigv4(const ckpt_s3_creds *cr, const char *method, const char *canon_uri,
                const char *canon_query, const ckpt_s3_hdr *hdrs, int nhdrs,
                const char *payload_hash, const char *amz_date, char **canonical, char **to_sign,
                char **authorization) {
    if (canonical) *canonical = NULL;
    if (to_sign) *to_sign = NULL;
    if (authorization) *authorization = NULL;
    if (strlen(amz_date) != 16 || amz_date[8] != 'T' || amz_date[15] != 'Z')
        return ckpt__err(CKPT_EINVAL, "Signature V4: date '%s' is not YYYYMMDDTHHMMSSZ", amz_date);
    if (nhdrs < 1 || nhdrs > 32) return ckpt__err(CKPT_EINVAL, "Signature V4: %d headers", nhdrs);
    ckpt_s3_hdr sorted[32];
    memcpy(sorted, hdrs, (size_t)nhdrs * sizeof *hdrs);
    qsort(sorted, (size_t)nhdrs, sizeof *sorted, cmp_hdr);

    sbuf creq = {0}, signed_names = {0}, sts = {0};
    sb_str(&creq, method);
    sb_str(&creq, "\n");
    sb_str(&creq, canon_uri);
    sb_str(&creq, "\n");
    sb_str(&creq, canon_query);
    sb_str(&creq, "\n");
    for (int i = 0; i < nhdrs; i++) {
        sb_str(&creq, sorted[i].name);
        sb_str(&creq, ":");
        sb_trimmed(&creq, sorted[i].value);
        sb_str(&creq, "\n");
        if (i) sb_str(&signed_names, ";");
        sb_str(&signed_names, sorted[i].name);
    }
    sb_str(&creq, "\n");
    sb_str(&creq, signed_names.p ? signed_names.p : "");
    sb_str(&creq, "\n");
    sb_str(&creq, payload_hash);

    char date[9];
    memcpy(date, amz_date, 8);
    date[8] = '\0';
    char scope[160];
    snprintf(scope, sizeof scope, "%s/%s/s3/aws4_request", date, cr->region);
    char creq_hash[65];
    if (!creq.oom) ckpt__sha256_hex(creq.p, creq.n, creq_hash);
    sb_str(&sts, "AWS4-HMAC-SHA256\n");
    sb_str(&sts, amz_date);
    sb_str(&sts, "\n");
    sb_str(&sts, scope);
    sb_str(&sts, "\n");
    sb_str(&sts, creq.oom ? "" : creq_hash);

    int rc = 0;
    if (creq.oom || signed_names.oom || sts.oom) rc = ckpt__err_nomem("Signature V4");
    unsigned char k[32], sig[32];
    if (rc == 0) {
        /* kSigning = HMAC(HMAC(HMAC(HMAC("AWS4" + secret, date), region), "s3"), "aws4_request") */
        size_t sl = strlen(cr->secret_key);
        char *k0 = ckpt__malloc(sl + 5);
        if (!k0) rc = ckpt__err_nomem("Signature V4");
        else {
            memcpy(k0, "AWS4", 4);
            memcpy(k0 + 4, cr->secret_key, sl + 1);
            rc = hmac(k0, sl + 4, date, k);
            memset(k0, 0, sl + 4);
            free(k0);
        }
        if (rc == 0) rc = hmac(k, 32, cr->region, k);
        if (rc == 0) rc = hmac(k, 32, "s3", k);
        if (rc == 0) rc = hmac(k, 32, "aws4_request", k);
        if (rc == 0) rc = hmac(k, 32, sts.p, sig);
        memset(k, 0, sizeof k);
    }
    if (rc == 0 && authorization) {
        char sighex[65];
        to_hex(sig, 32, sighex);
        size_t n = strlen(cr->access_key) + strlen(scope) + signed_names.n + 160;
        *authorization = ckpt__malloc(n);
        if (!*authorization) rc = ckpt__err_nomem("Signature V4");
        else
            snprintf(*authorization, n,
                     "AWS4-HMAC-SHA256 Credential=%s/%s, SignedHeaders=%s, Signature=%s",
                     cr->access_key, scope, signed_names.p, sighex);
    }
    if (rc == 0 && canonical) {
        *canonical = creq.p;
        creq.p = NULL;
    }
    if (rc == 0 && to_sign) {
        *to_sign = sts.p;
        sts.p = NULL;
    }
    free(creq.p);
    free(signed_names.p);
    free(sts.p);
    return rc;
}

#else /* no OpenSSL: the object-store client is not built (s3.c says so) */

void ckpt__sha256_hex(const void *p, size_t n, char out[65]) {
    (void)p;
    (void)n;
    out[0] = '\0';
}

int ckpt__sigv4(const ckpt_s3_creds *cr, const char *method, const char *canon_uri,
                const char *canon_query, const ckpt_s3_hdr *hdrs, int nhdrs,
                const char *payload_hash, const char *amz_date, char **canonical, char **to_sign,
                char **authorization) {
    if (canonical) *canonical = NULL;
    if (to_sign) *to_sign = NULL;
    if (authorization) *authorization = NULL;
    return ckpt__err(CKPT_EUNSUPPORTED,
                     "Signature V4: this ckpt was built without object storage (s3://) support");
}

#endif
