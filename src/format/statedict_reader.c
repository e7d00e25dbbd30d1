/* statedict_reader.c — the reader: a file or a buffer opened, its header and
 * __metadata__["ckpt"] document validated as a whole before anything is
 * handed out, and its entries looked up by key. */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/error.h"
#include "base/io.h"
#include "base/base64.h"
#include "format/safetensors.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* ---- reader ------------------------------------------------------------- */

void ckpt__reader_set_name(ckpt_reader *r, const char *name) {
    if (!r || !name) return;
    char *n = ckpt__strdup(name);
    if (!n) return; /* keep the old name: it only feeds messages */
    free(r->name);
    r->name = n;
}

void ckpt_reader_free(ckpt_reader *r) {
    if (!r) return;
    for (int64_t i = 0; i < r->count; i++) free(r->entries[i].bytes);
    free(r->entries);
    for (int64_t i = 0; i < r->nskeys; i++) {
        free(r->skeys[i].key);
        free(r->skeys[i].chunks);
    }
    free(r->skeys);
    for (int64_t i = 0; i < r->nshard_files; i++) free(r->shard_files[i]);
    free(r->shard_files);
    for (int64_t i = 0; i < r->nmaps; i++) ckpt__unmap(&r->maps[i]);
    free(r->maps);
    for (int64_t i = 0; i < r->nowned; i++) free(r->owned[i]);
    free(r->owned);
    for (int64_t i = 0; i < r->nsubs; i++) ckpt_reader_free(r->subs[i]);
    free(r->subs);
    key_index_free(&r->index);
    json_decref(r->doc);
    ckpt__st_header_free(&r->hdr);
    if (r->map) ckpt__os_munmap(r->map, r->map_len);
    if (r->fd >= 0) ckpt__os_close(r->fd);
    verify_stream_free(r->vs);
    free(r->name);
    free(r);
}

static int doc_err(const ckpt_reader *r, const char *fmt, const char *a, const char *b) {
    char msg[1400];
    snprintf(msg, sizeof msg, fmt, a ? a : "", b ? b : "");
    return ckpt__err(CKPT_ECORRUPT, "%s: __metadata__ 'ckpt': %s", r->name, msg);
}

/* Parses one entry of the document into e (key/str views into the doc). */
static int parse_doc_entry(ckpt_reader *r, json_t *o, size_t idx, entry *e) {
    char at[32];
    snprintf(at, sizeof at, "%zu", idx);
    if (!json_is_object(o)) return doc_err(r, "entries[%s] is not an object", at, NULL);
    const char *f;
    json_t *fv;
    json_object_foreach(o, f, fv) {
        if (strcmp(f, "key") && strcmp(f, "type") && strcmp(f, "value"))
            return doc_err(r, "entries[%s]: unknown field '%s'", at, f);
    }
    json_t *jk = json_object_get(o, "key"), *jt = json_object_get(o, "type"),
           *jv = json_object_get(o, "value");
    if (!json_is_string(jk))
        return doc_err(r, "entries[%s]: key is missing or not a string", at, NULL);
    if (!json_is_string(jt))
        return doc_err(r, "entries[%s]: type is missing or not a string", at, NULL);
    if (!jv) return doc_err(r, "entries[%s]: value is missing", at, NULL);
    const char *key = json_string_value(jk);
    if (strlen(key) != json_string_length(jk) || ckpt__check_key(key, "entry") != CKPT_OK)
        return doc_err(r, "entries[%s]: invalid key '%s'", at, key);
    e->key = (char *)key;
    const char *type = json_string_value(jt);
    if (strcmp(type, "i64") == 0) {
        if (!json_is_integer(jv))
            return doc_err(r, "entry '%s': i64 value is not an integer", key, NULL);
        e->kind = CKPT_ENTRY_I64;
        e->i64 = (int64_t)json_integer_value(jv);
        e->nbytes = 8;
    } else if (strcmp(type, "u64") == 0) {
        /* a decimal string of 1 to 20 digits, no sign, no leading zero */
        const char *s = json_is_string(jv) ? json_string_value(jv) : NULL;
        size_t n = s ? json_string_length(jv) : 0;
        bool ok = s && n >= 1 && n <= 20 && strspn(s, "0123456789") == n && (n == 1 || s[0] != '0');
        uint64_t v = 0;
        for (size_t i = 0; ok && i < n; i++) {
            unsigned d = (unsigned)(s[i] - '0');
            if (v > (UINT64_MAX - d) / 10) ok = false;
            else v = v * 10 + d;
        }
        if (!ok)
            return doc_err(r,
                           "entry '%s': u64 value is not a string of decimal digits below 2^64 "
                           "(no sign, no leading zero)",
                           key, NULL);
        e->kind = CKPT_ENTRY_U64;
        e->u64 = v;
        e->nbytes = 8;
    } else if (strcmp(type, "alias") == 0) {
        const char *t = json_is_string(jv) ? json_string_value(jv) : NULL;
        if (!t || strlen(t) != json_string_length(jv) || ckpt__check_key(t, "alias") != CKPT_OK)
            return doc_err(r, "entry '%s': alias value is not a valid tensor name", key, NULL);
        if (strcmp(t, key) == 0) return doc_err(r, "entry '%s': an alias of itself", key, NULL);
        e->kind = CKPT_ENTRY_ALIAS;
        e->str = (char *)t;
    } else if (strcmp(type, "f64") == 0) {
        e->kind = CKPT_ENTRY_F64;
        e->nbytes = 8;
        if (json_is_real(jv)) {
            e->f64 = json_real_value(jv);
        } else if (json_is_integer(jv)) {
            e->f64 = (double)json_integer_value(jv);
        } else if (json_is_string(jv)) {
            const char *s = json_string_value(jv);
            if (strcmp(s, "nan") == 0) e->f64 = NAN;
            else if (strcmp(s, "inf") == 0) e->f64 = INFINITY;
            else if (strcmp(s, "-inf") == 0) e->f64 = -INFINITY;
            else
                return doc_err(
                    r, "entry '%s': f64 value '%s' is not a number, \"nan\", \"inf\" or \"-inf\"",
                    key, s);
        } else {
            return doc_err(r, "entry '%s': f64 value is not a number", key, NULL);
        }
    } else if (strcmp(type, "str") == 0) {
        if (!json_is_string(jv))
            return doc_err(r, "entry '%s': str value is not a string", key, NULL);
        e->kind = CKPT_ENTRY_STR;
        e->str = (char *)json_string_value(jv);
        e->nbytes = json_string_length(jv);
        if (strlen(e->str) != e->nbytes)
            return doc_err(r, "entry '%s': str value contains a NUL character", key, NULL);
    } else if (strcmp(type, "bytes") == 0) {
        if (!json_is_string(jv))
            return doc_err(r, "entry '%s': bytes value is not a string", key, NULL);
        e->kind = CKPT_ENTRY_BYTES;
        size_t n = 0;
        int rc = ckpt__base64_decode(json_string_value(jv), json_string_length(jv), &e->bytes, &n);
        if (rc == CKPT_ENOMEM) return rc;
        if (rc) return ckpt__err_prefix(rc, "%s: __metadata__ 'ckpt': entry '%s'", r->name, key);
        e->nbytes = n;
    } else {
        return doc_err(r, "entry '%s': unknown type '%s'", key, type);
    }
    return CKPT_OK;
}

static int parse_doc(ckpt_reader *r, const char *text, json_t **doc_out, json_t **entries_out) {
    json_error_t jerr;
    json_t *doc = json_loads(text, JSON_REJECT_DUPLICATES, &jerr);
    if (!doc)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: __metadata__ 'ckpt' is not valid JSON: %s (at byte %d)", r->name,
                         jerr.text, jerr.position);
    *doc_out = doc;
    if (!json_is_object(doc)) return doc_err(r, "not a JSON object", NULL, NULL);
    const char *f;
    json_t *fv;
    json_object_foreach(doc, f, fv) {
        if (strcmp(f, "version") && strcmp(f, "entries"))
            return doc_err(r, "unknown field '%s'", f, NULL);
    }
    json_t *ver = json_object_get(doc, "version");
    if (!json_is_integer(ver))
        return doc_err(r, "version is missing or not an integer", NULL, NULL);
    json_int_t v = json_integer_value(ver);
    if (v > CKPT_DOC_VERSION)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: __metadata__ 'ckpt': version %lld is newer than this library "
                         "supports (%d)",
                         r->name, (long long)v, CKPT_DOC_VERSION);
    if (v < 1) return doc_err(r, "version is not a positive integer", NULL, NULL);
    json_t *arr = json_object_get(doc, "entries");
    if (!json_is_array(arr)) return doc_err(r, "entries is missing or not an array", NULL, NULL);
    *entries_out = arr;
    return CKPT_OK;
}

/* Builds the entry list from the parsed header (+ document). */
static int reader_build(ckpt_reader *r) {
    json_t *arr = NULL;
    size_t nscalar = 0;
    if (r->hdr.metadata) {
        json_t *jdoc = json_object_get(r->hdr.metadata, "ckpt");
        if (jdoc) {
            CKPT_TRY(parse_doc(r, json_string_value(jdoc), &r->doc, &arr));
            nscalar = json_array_size(arr);
        }
    }
    size_t total = (size_t)r->hdr.ntensors + nscalar;
    r->entries = ckpt__calloc(total ? total : 1, sizeof *r->entries);
    if (!r->entries) return ckpt__err_nomem("reader entries");
    r->ecap = total ? (int64_t)total : 1;
    for (int64_t i = 0; i < r->hdr.ntensors; i++) {
        const ckpt_st_tensor *t = &r->hdr.tensors[i];
        entry *e = &r->entries[r->count];
        e->key = (char *)t->name;
        e->kind = CKPT_ENTRY_TENSOR;
        e->dtype = t->dtype;
        e->ndim = t->ndim;
        memcpy(e->shape, t->shape, sizeof e->shape);
        e->nbytes = t->end - t->begin;
        e->offset = r->hdr.data_start + t->begin;
        r->count++;
        CKPT_TRY(reader_index_add(r, r->count - 1));
    }
    for (size_t i = 0; i < nscalar; i++) {
        entry *e = &r->entries[r->count];
        int rc = parse_doc_entry(r, json_array_get(arr, i), i, e);
        r->count++; /* counted even on failure so free() releases e->bytes */
        if (rc) return rc;
        CKPT_TRY(reader_index_add(r, r->count - 1));
    }
    /* An alias names a tensor: of this file, or (a checkpoint's object
     * file) of the shard files attached to it later, found when read. */
    for (int64_t i = 0; i < r->count; i++) {
        entry *e = &r->entries[i];
        if (e->kind != CKPT_ENTRY_ALIAS) continue;
        const entry *t = reader_get(r, e->str);
        if (t && t->kind != CKPT_ENTRY_TENSOR)
            return doc_err(r, "entry '%s': an alias of '%s', which is not a tensor", e->key,
                           e->str);
        if (t) {
            e->dtype = t->dtype;
            e->ndim = t->ndim;
            memcpy(e->shape, t->shape, sizeof e->shape);
        }
    }
    return CKPT_OK;
}

int ckpt_reader_open_memory(ckpt_reader **out, const void *buf, size_t len, const char *name) {
    if (!out) return ckpt__err(CKPT_EINVAL, "reader: out is NULL");
    *out = NULL;
    if (!buf && len) return ckpt__err(CKPT_EINVAL, "reader: buffer is NULL");
    ckpt_reader *r = NULL;
    CKPT_TRY(reader_alloc(&r, name));
    r->mem = buf;
    r->file_size = len;
    uint64_t n = 0;
    int rc = ckpt__st_header_len(buf, len, r->name, &n);
    if (!rc) rc = ckpt__st_parse((const uint8_t *)buf + 8, n, len, r->name, &r->hdr);
    if (!rc) rc = reader_build(r);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    *out = r;
    return CKPT_OK;
}

static int reader_open_file(ckpt_reader **out, const char *path, const char *name,
                            verify_stream *vs);

int ckpt_reader_open(ckpt_reader **out, const char *path) {
    if (!out) return ckpt__err(CKPT_EINVAL, "reader: out is NULL");
    *out = NULL;
    if (!path) return ckpt__err(CKPT_EINVAL, "reader: path is NULL");
    return reader_open_file(out, path, path, NULL);
}

int ckpt__reader_open_verified(ckpt_reader **out, const char *path, const char *name,
                               uint64_t xxh3, const uint64_t *header_xxh3,
                               const char *const *keys, const uint64_t *digests, int64_t n) {
    *out = NULL;
    verify_stream *vs = ckpt__calloc(1, sizeof *vs);
    if (!vs) return ckpt__err_nomem("verified reader");
    size_t align = _Alignof(XXH3_state_t) > 64 ? _Alignof(XXH3_state_t) : 64;
    vs->mem = ckpt__malloc(2 * sizeof(XXH3_state_t) + align + VERIFY_PIECE);
    if (!vs->mem) {
        free(vs);
        return ckpt__err_nomem("verified reader");
    }
    uintptr_t a = ((uintptr_t)vs->mem + align - 1) & ~(uintptr_t)(align - 1);
    vs->h = (XXH3_state_t *)a;
    vs->t = vs->h + 1;
    vs->scratch = (uint8_t *)(vs->t + 1);
    XXH3_INITSTATE(vs->h);
    XXH3_INITSTATE(vs->t);
    XXH3_64bits_reset(vs->h);
    vs->xxh3 = xxh3;
    vs->keys = keys;
    vs->digests = digests;
    vs->n = n;
    vs->by_parts = header_xxh3 != NULL;
    vs->header_xxh3 = header_xxh3 ? *header_xxh3 : 0;
    int rc = reader_open_file(out, path, name, vs);
    if (rc < 0) verify_stream_free(vs);
    return rc;
}

/* By parts: each entry's digest from the manifest's list, found through
 * the reader's key index (linear in the keys). */
static int verify_parts_init(ckpt_reader *r, verify_stream *vs) {
    size_t n = r->count ? (size_t)r->count : 1;
    vs->edigest = ckpt__calloc(n, sizeof *vs->edigest);
    vs->ehas = ckpt__calloc(n, sizeof *vs->ehas);
    vs->edone = ckpt__calloc(n, sizeof *vs->edone);
    if (!vs->edigest || !vs->ehas || !vs->edone) return ckpt__err_nomem("verified reader");
    for (int64_t i = 0; i < vs->n; i++) {
        int64_t j = key_index_get(&r->index, vs->keys[i]);
        if (j < 0) continue;
        vs->edigest[j] = vs->digests[i];
        vs->ehas[j] = true;
    }
    return CKPT_OK;
}

static int reader_open_file(ckpt_reader **out, const char *path, const char *name,
                            verify_stream *vs) {
    ckpt_reader *r = NULL;
    CKPT_TRY(reader_alloc(&r, name));
    int rc = CKPT_OK;
    uint8_t *hbuf = NULL;
    struct stat st;
    r->fd = ckpt__open_read(path, path, false, &st);
    if (r->fd < 0) {
        rc = r->fd;
        goto out;
    }
    r->file_size = (uint64_t)st.st_size;
    uint8_t prefix[8] = {0};
    if (r->file_size >= 8) {
        rc = pread_all(r, prefix, 8, 0);
        if (rc) goto out;
    }
    uint64_t n = 0;
    rc = ckpt__st_header_len(prefix, r->file_size, r->name, &n);
    if (rc) goto out;
    /* Only the header is read now: tensor bytes go straight from the file
     * into the caller's buffers later. */
    hbuf = ckpt__malloc(n ? (size_t)n : 1);
    if (!hbuf) {
        rc = ckpt__err_nomem("safetensors header");
        goto out;
    }
    rc = pread_all(r, hbuf, n, 8);
    if (!rc && vs) {
        /* The header parsed is the header hashed. */
        XXH3_64bits_update(vs->h, prefix, 8);
        XXH3_64bits_update(vs->h, hbuf, (size_t)n);
        vs->next = 8 + n;
        if (vs->by_parts && XXH3_64bits_digest(vs->h) != vs->header_xxh3)
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: checksum mismatch in the header (names, shapes, offsets, "
                           "scalars): it is not the header the manifest records",
                           r->name);
    }
    if (!rc) rc = ckpt__st_parse(hbuf, n, r->file_size, r->name, &r->hdr);
    if (!rc) rc = reader_build(r);
    if (!rc && vs && vs->by_parts) rc = verify_parts_init(r, vs);
out:
    free(hbuf);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    r->vs = vs;
    *out = r;
    return CKPT_OK;
}

int64_t ckpt_reader_count(const ckpt_reader *r) { return r ? r->count : 0; }

int ckpt_reader_entry(const ckpt_reader *r, int64_t i, ckpt_entry_info *info) {
    if (!r || !info) return ckpt__err(CKPT_EINVAL, "reader entry: NULL argument");
    if (i < 0 || i >= r->count)
        return ckpt__err(CKPT_EINVAL, "%s: entry index %" PRId64 " outside 0..%" PRId64, r->name, i,
                         r->count - 1);
    entry_info(&r->entries[i], info);
    return CKPT_OK;
}

int ckpt_reader_find(const ckpt_reader *r, const char *key, ckpt_entry_info *info) {
    if (!r || !key) return ckpt__err(CKPT_EINVAL, "reader find: NULL argument");
    const entry *e = reader_get(r, key);
    if (!e) return ckpt__err(CKPT_ENOENT, "%s: no key '%s'", r->name, key);
    if (info) entry_info(e, info);
    return CKPT_OK;
}

int64_t ckpt__reader_index(const ckpt_reader *r, const char *key) {
    return r && key ? key_index_get(&r->index, key) : -1;
}

bool ckpt__reader_has(const ckpt_reader *r, const char *key, ckpt_entry_info *info) {
    const entry *e = r && key ? reader_get(r, key) : NULL;
    if (e && info) entry_info(e, info);
    return e != NULL;
}
