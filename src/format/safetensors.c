/* safetensors.c — the format layer: validate every rule of the format on
 * read (the file is hostile input), stream tensors without copying on write. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "format/safetensors.h"

/* ---- helpers ------------------------------------------------------------ */

static uint64_t le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = v << 8 | p[i];
    return v;
}

static void put_le64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}

/* ---- reading ------------------------------------------------------------ */

int ckpt__st_header_len(const uint8_t *prefix, uint64_t file_size, const char *name, uint64_t *n) {
    if (file_size < 8)
        return ckpt__err(CKPT_ECORRUPT, "%s: file is shorter than 8 bytes (%" PRIu64 " bytes)",
                         name, file_size);
    uint64_t len = le64(prefix);
    if (len > CKPT_ST_MAX_HEADER)
        return ckpt__err(CKPT_ECORRUPT, "%s: header length %" PRIu64 " exceeds the %llu-byte limit",
                         name, len, CKPT_ST_MAX_HEADER);
    if (8 + len > file_size)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: header extends past end of file (8 + %" PRIu64
                         " bytes, file has %" PRIu64 ")",
                         name, len, file_size);
    *n = len;
    return CKPT_OK;
}

/* A JSON value as a non-negative int64, or -1. */
static int64_t json_nonneg(const json_t *v) {
    if (!json_is_integer(v)) return -1;
    json_int_t x = json_integer_value(v);
    return x < 0 ? -1 : (int64_t)x;
}

static int parse_tensor(const char *file, const char *key, json_t *v, ckpt_st_tensor *t) {
    if (!json_is_object(v))
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': entry is not a JSON object", file, key);
    json_t *jd = json_object_get(v, "dtype");
    json_t *js = json_object_get(v, "shape");
    json_t *jo = json_object_get(v, "data_offsets");
    if (!jd) return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': missing dtype", file, key);
    if (!js) return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': missing shape", file, key);
    if (!jo) return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': missing data_offsets", file, key);
    const char *field;
    json_t *fv;
    json_object_foreach(v, field, fv) {
        if (strcmp(field, "dtype") && strcmp(field, "shape") && strcmp(field, "data_offsets"))
            return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': unknown field '%s'", file, key,
                             field);
    }
    t->name = key;
    if (!json_is_string(jd))
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': dtype is not a string", file, key);
    if (ckpt_dtype_from_name(json_string_value(jd), &t->dtype) != CKPT_OK)
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': unknown dtype '%s'", file, key,
                         json_string_value(jd));
    if (!json_is_array(js))
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': shape is not an array", file, key);
    size_t nd = json_array_size(js);
    if (nd > CKPT_MAX_NDIM)
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': %zu dimensions, at most %d supported",
                         file, key, nd, CKPT_MAX_NDIM);
    t->ndim = (int)nd;
    for (size_t i = 0; i < nd; i++) {
        int64_t d = json_nonneg(json_array_get(js, i));
        if (d < 0)
            return ckpt__err(CKPT_ECORRUPT,
                             "%s: tensor '%s': shape dimension %zu is not a non-negative integer",
                             file, key, i);
        t->shape[i] = d;
    }
    if (!json_is_array(jo) || json_array_size(jo) != 2)
        return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%s': data_offsets is not a [BEGIN, END] pair",
                         file, key);
    int64_t b = json_nonneg(json_array_get(jo, 0));
    int64_t e = json_nonneg(json_array_get(jo, 1));
    if (b < 0 || e < 0)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: tensor '%s': data_offsets are not non-negative integers", file, key);
    t->begin = (uint64_t)b;
    t->end = (uint64_t)e;
    if (t->end < t->begin)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "]: END < BEGIN",
                         file, key, t->begin, t->end);
    uint64_t need = 0;
    char sb[256];
    if (ckpt_tensor_nbytes(t->dtype, t->ndim, t->shape, &need) != CKPT_OK) {
        int bits = ckpt_dtype_bits(t->dtype);
        if (bits % 8)
            return ckpt__err(CKPT_ECORRUPT,
                             "%s: tensor '%s': %s shape %s: elements x %d bits is not a whole "
                             "number of bytes (or overflows)",
                             file, key, ckpt_dtype_name(t->dtype),
                             ckpt__shape_str(sb, sizeof sb, t->ndim, t->shape), bits);
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: tensor '%s': shape %s x element size overflows", file, key,
                         ckpt__shape_str(sb, sizeof sb, t->ndim, t->shape));
    }
    if (t->end - t->begin != need)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64 "] hold %" PRIu64
                         " bytes, %s shape %s needs %" PRIu64,
                         file, key, t->begin, t->end, t->end - t->begin, ckpt_dtype_name(t->dtype),
                         ckpt__shape_str(sb, sizeof sb, t->ndim, t->shape), need);
    return CKPT_OK;
}

static int cmp_tensor_offsets(const void *a, const void *b) {
    const ckpt_st_tensor *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return strcmp(x->name, y->name);
}

int ckpt__st_parse(const uint8_t *header, uint64_t n, uint64_t file_size, const char *name,
                   ckpt_st_header *out) {
    memset(out, 0, sizeof *out);
    out->header_len = n;
    out->data_start = 8 + n;
    if (n == 0 || header[0] != '{')
        return ckpt__err(CKPT_ECORRUPT, "%s: header does not start with '{'", name);
    json_error_t jerr;
    /* Parse the object alone, then check that only spaces follow it: the
     * format allows space padding and nothing else. */
    json_t *root = json_loadb((const char *)header, (size_t)n,
                              JSON_REJECT_DUPLICATES | JSON_DISABLE_EOF_CHECK, &jerr);
    if (!root) {
        if (strstr(jerr.text, "duplicate object key"))
            return ckpt__err(CKPT_ECORRUPT, "%s: header: duplicate key (%s, at byte %d)", name,
                             jerr.text, jerr.position);
        return ckpt__err(CKPT_ECORRUPT, "%s: header is not valid JSON: %s (at byte %d)", name,
                         jerr.text, jerr.position);
    }
    out->root = root;
    int rc = CKPT_OK;
    if (!json_is_object(root)) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: header is not a JSON object", name);
        goto fail;
    }
    for (uint64_t i = (uint64_t)jerr.position; i < n; i++) {
        if (header[i] != ' ') {
            rc = ckpt__err(CKPT_ECORRUPT,
                             "%s: header padding contains byte 0x%02x at offset %" PRIu64
                             " (padding other than spaces)",
                             name, header[i], 8 + i);
            goto fail;
        }
    }
    size_t count = json_object_size(root);
    json_t *meta = json_object_get(root, "__metadata__");
    if (meta) {
        if (!json_is_object(meta)) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: __metadata__ is not a JSON object", name);
            goto fail;
        }
        const char *k;
        json_t *v;
        json_object_foreach(meta, k, v) {
            if (!json_is_string(v)) {
                rc = ckpt__err(CKPT_ECORRUPT, "%s: __metadata__ value for '%s' is not a string",
                                 name, k);
                goto fail;
            }
        }
        out->metadata = meta;
        count--;
    }
    out->tensors = ckpt__calloc(count ? count : 1, sizeof *out->tensors);
    if (!out->tensors) {
        rc = ckpt__err_nomem("safetensors header");
        goto fail;
    }
    const char *k;
    json_t *v;
    int64_t nt = 0;
    json_object_foreach(root, k, v) {
        if (strcmp(k, "__metadata__") == 0) continue;
        rc = parse_tensor(name, k, v, &out->tensors[nt]);
        if (rc) goto fail;
        nt++;
    }
    out->ntensors = nt;
    qsort(out->tensors, (size_t)nt, sizeof *out->tensors, cmp_tensor_offsets);
    uint64_t prev_end = 0;
    const char *prev_name = NULL;
    for (int64_t i = 0; i < nt; i++) {
        ckpt_st_tensor *t = &out->tensors[i];
        if (t->begin > prev_end) {
            rc = prev_name
                ? ckpt__err(CKPT_ECORRUPT,
                            "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                            "] leave a hole after the previous tensor '%s' (ends at %" PRIu64 ")",
                            name, t->name, t->begin, t->end, prev_name, prev_end)
                : ckpt__err(CKPT_ECORRUPT,
                            "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                            "] leave a hole: the first tensor must begin at 0",
                            name, t->name, t->begin, t->end);
            goto fail;
        }
        if (t->begin < prev_end) {
            rc = ckpt__err(CKPT_ECORRUPT,
                               "%s: tensor '%s': data_offsets [%" PRIu64 ", %" PRIu64
                               "] overlap the previous tensor (ends at %" PRIu64 ")",
                               name, t->name, t->begin, t->end, prev_end);
            goto fail;
        }
        prev_end = t->end;
        prev_name = t->name;
    }
    /* 8 + N + END cannot overflow: N <= 1e8 and END < 2^63. */
    uint64_t expect = out->data_start + prev_end;
    if (expect < file_size) {
        rc = ckpt__err(CKPT_ECORRUPT,
                         "%s: trailing bytes: file has %" PRIu64 " bytes, tensors end at %" PRIu64,
                         name, file_size, expect);
        goto fail;
    }
    if (expect > file_size) {
        rc = ckpt__err(CKPT_ECORRUPT,
                         "%s: tensor data extends past end of file: tensors end at %" PRIu64
                         ", file has %" PRIu64 " bytes",
                         name, expect, file_size);
        goto fail;
    }
    return CKPT_OK;
fail:
    ckpt__st_header_free(out);
    return rc;
}

void ckpt__st_header_free(ckpt_st_header *h) {
    if (!h) return;
    free(h->tensors);
    json_decref(h->root);
    memset(h, 0, sizeof *h);
}

/* ---- writing ------------------------------------------------------------ */

typedef struct order_item {
    const ckpt_st_out *t;
    int64_t index;
} order_item;

static int align_of(ckpt_dtype dt) {
    int bits = ckpt_dtype_bits(dt);
    return bits >= 8 ? bits / 8 : 1;
}

/* The reference writer's order: larger alignment first so every tensor stays
 * aligned to its element size, then by name for a stable layout. */
static int cmp_write_order(const void *a, const void *b) {
    const order_item *x = a, *y = b;
    int ax = align_of(x->t->dtype), ay = align_of(y->t->dtype);
    if (ax != ay) return ax > ay ? -1 : 1;
    return strcmp(x->t->name, y->t->name);
}

static int set_new(json_t *obj, const char *key, json_t *v) {
    if (!v || json_object_set_new(obj, key, v) != 0) return -1;
    return 0;
}

/* A tensor behind memory ops: each piece to_host gives goes down the
 * stream, through one buffer (made at the first such tensor, of one piece
 * or less) that the write's later tensors reuse. */
static int write_mem(ckpt_ostream *s, const ckpt_st_out *x, uint8_t **buf, uint64_t *cap) {
    uint64_t want = x->nbytes < CKPT_MEMORY_PIECE ? x->nbytes : CKPT_MEMORY_PIECE;
    if (*cap < want) {
        free(*buf);
        *cap = 0;
        if (!(*buf = ckpt__mem_bounce(want, cap, "memory ops buffer"))) return CKPT_ENOMEM;
    }
    for (uint64_t off = 0; off < x->nbytes;) {
        uint64_t k = x->nbytes - off < *cap ? x->nbytes - off : *cap;
        CKPT_TRY(ckpt__mem_get(&x->mem, off, *buf, k, x->name));
        CKPT_TRY(ckpt__ostream_write(s, *buf, (size_t)k));
        off += k;
    }
    return CKPT_OK;
}

int ckpt__st_write(ckpt_ostream *s, const ckpt_st_out *t, int64_t n, const char *ckpt_doc,
                   const char *const *extra, int64_t nmeta, ckpt_st_written *res,
                   uint64_t *header_xxh3) {
    int rc = CKPT_OK;
    uint8_t *head = NULL, *bounce = NULL;
    uint64_t bounce_cap = 0;
    order_item *ord = ckpt__calloc(n > 0 ? (size_t)n : 1, sizeof *ord);
    json_t *root = json_object();
    json_t *meta = json_object();
    char *text = NULL;
    if (!ord || !root || !meta) {
        rc = ckpt__err_nomem("safetensors header");
        goto out;
    }
    for (int64_t i = 0; i < n; i++) {
        ord[i].t = &t[i];
        ord[i].index = i;
    }
    qsort(ord, (size_t)n, sizeof *ord, cmp_write_order);
    bool bad = set_new(meta, "format", json_string("pt")) ||
               (ckpt_doc && set_new(meta, "ckpt", json_string(ckpt_doc)));
    for (int64_t i = 0; i < nmeta && !bad; i++)
        if (strcmp(extra[2 * i], "format") && strcmp(extra[2 * i], "ckpt") &&
            !json_object_get(meta, extra[2 * i]))
            bad = set_new(meta, extra[2 * i], json_string(extra[2 * i + 1]));
    if (bad || json_object_set(root, "__metadata__", meta) != 0) {
        rc = ckpt__err(CKPT_ENOMEM, "safetensors header: building JSON failed");
        goto out;
    }
    uint64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        const ckpt_st_out *x = ord[i].t;
        json_t *e = json_object();
        json_t *shape = json_array();
        json_t *offs = json_array();
        bool ok = e && shape && offs;
        for (int d = 0; ok && d < x->ndim; d++)
            ok = json_array_append_new(shape, json_integer((json_int_t)x->shape[d])) == 0;
        ok = ok && json_array_append_new(offs, json_integer((json_int_t)off)) == 0 &&
             json_array_append_new(offs, json_integer((json_int_t)(off + x->nbytes))) == 0;
        ok = ok && set_new(e, "dtype", json_string(ckpt_dtype_name(x->dtype))) == 0;
        ok = ok && json_object_set(e, "shape", shape) == 0 &&
             json_object_set(e, "data_offsets", offs) == 0;
        json_decref(shape);
        json_decref(offs);
        if (!ok || json_object_set_new(root, x->name, e) != 0) {
            if (!ok) json_decref(e);
            rc = ckpt__err(CKPT_ENOMEM, "safetensors header: building JSON for '%s' failed",
                           x->name);
            goto out;
        }
        if (res) {
            res[ord[i].index].file_pos = i;
            res[ord[i].index].offset = off; /* made absolute below */
        }
        off += x->nbytes;
    }
    text = json_dumps(root, JSON_COMPACT);
    if (!text) {
        rc = ckpt__err(CKPT_ENOMEM, "safetensors header: serialising JSON failed");
        goto out;
    }
    size_t len = strlen(text);
    size_t padded = (8 + len + 7) / 8 * 8 - 8;
    /* The length prefix, the header and its padding in one piece, whose
     * digest the manifest records (a one-pass load checks the header by it). */
    head = ckpt__malloc(8 + padded);
    if (!head) {
        rc = ckpt__err_nomem("safetensors header");
        goto out;
    }
    put_le64(head, padded);
    memcpy(head + 8, text, len);
    memset(head + 8 + len, ' ', padded - len);
    if (header_xxh3) *header_xxh3 = ckpt__xxh3(head, 8 + padded);
    rc = ckpt__ostream_write(s, head, 8 + padded);
    for (int64_t i = 0; !rc && i < n; i++) {
        const ckpt_st_out *x = ord[i].t;
        ckpt__ostream_part_begin(s);
        if (x->nbytes && x->mem.ops) rc = write_mem(s, x, &bounce, &bounce_cap);
        else if (x->nbytes) rc = ckpt__ostream_write(s, x->data, (size_t)x->nbytes);
        if (!rc && res) {
            res[ord[i].index].xxh3 = ckpt__ostream_part_digest(s);
            res[ord[i].index].offset += 8 + padded;
        }
    }
out:
    free(bounce);
    free(head);
    free(text);
    json_decref(meta);
    json_decref(root);
    free(ord);
    return rc;
}
