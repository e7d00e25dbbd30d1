/* manifest.c — checkpoint.json: write, parse (as hostile input), verify. */
#include "format/manifest.h"

#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <jansson.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "base/error.h"
#include "format/shard.h"

void ckpt__manifest_init(ckpt_manifest *m) {
    memset(m, 0, sizeof *m);
    m->format_version = 1; /* what one process writes; see CKPT_FORMAT_VERSION */
    m->process_index = -1;
    m->num_processes = 1;
}

static void file_clear(ckpt_manifest_file *f) {
    free(f->name);
    free(f->kind);
    for (int64_t i = 0; i < f->ntensors; i++) free(f->tensor_keys[i]);
    free(f->tensor_keys);
    free(f->tensor_xxh3);
    free(f->chunks);
    memset(f, 0, sizeof *f);
}

void ckpt__manifest_clear(ckpt_manifest *m) {
    for (int64_t i = 0; i < m->nfiles; i++) file_clear(&m->files[i]);
    free(m->files);
    ckpt__manifest_init(m);
}

static ckpt_manifest_file *push_file(ckpt_manifest *m) {
    if (m->nfiles == m->cap) {
        int64_t cap = m->cap ? m->cap * 2 : 8;
        ckpt_manifest_file *nf = ckpt__realloc(m->files, (size_t)cap * sizeof *nf);
        if (!nf) return NULL;
        m->files = nf;
        m->cap = cap;
    }
    ckpt_manifest_file *f = &m->files[m->nfiles++];
    memset(f, 0, sizeof *f);
    return f;
}

static int alloc_tensors(ckpt_manifest_file *f, int64_t n) {
    f->tensor_keys = ckpt__calloc((size_t)(n ? n : 1), sizeof *f->tensor_keys);
    f->tensor_xxh3 = ckpt__calloc((size_t)(n ? n : 1), sizeof *f->tensor_xxh3);
    if (!f->tensor_keys || !f->tensor_xxh3) return ckpt__err_nomem("manifest tensors");
    return 0;
}

int ckpt__manifest_add(ckpt_manifest *m, const char *name, const char *kind,
                       const ckpt_file_digest *d) {
    ckpt_manifest_file *f = push_file(m);
    if (!f) return ckpt__err_nomem("manifest");
    f->name = ckpt__strdup(name);
    f->kind = ckpt__strdup(kind);
    int rc = (f->name && f->kind) ? 0 : ckpt__err_nomem("manifest");
    if (rc == 0) rc = alloc_tensors(f, d->ntensors);
    for (int64_t i = 0; rc == 0 && i < d->ntensors; i++) {
        f->tensor_keys[i] = ckpt__strdup(d->tensor_keys[i]);
        if (!f->tensor_keys[i]) {
            rc = ckpt__err_nomem("manifest tensor key");
            break;
        }
        f->tensor_xxh3[i] = d->tensor_xxh3[i];
        f->ntensors = i + 1;
    }
    if (rc == 0 && d->tensor_chunk) {
        f->chunks = ckpt__malloc((size_t)(d->ntensors ? d->ntensors : 1) * sizeof *f->chunks);
        if (!f->chunks) rc = ckpt__err_nomem("manifest chunks");
        else if (d->ntensors)
            memcpy(f->chunks, d->tensor_chunk, (size_t)d->ntensors * sizeof *f->chunks);
    }
    if (rc < 0) {
        file_clear(f);
        m->nfiles--;
        return rc;
    }
    f->size = d->size;
    f->xxh3 = d->xxh3;
    f->has_xxh128 = d->has_xxh128;
    f->xxh128 = d->xxh128;
    return 0;
}

const ckpt_manifest_file *ckpt__manifest_find(const ckpt_manifest *m, const char *name) {
    for (int64_t i = 0; i < m->nfiles; i++)
        if (strcmp(m->files[i].name, name) == 0) return &m->files[i];
    return NULL;
}

/* ---- writing ------------------------------------------------------------ */

static void hex64(uint64_t v, char out[17]) { snprintf(out, 17, "%016" PRIx64, v); }

/* jansson reports allocation failure as a NULL value or a -1 status. */
#define JSET(obj, key, val)                                                                        \
    do {                                                                                           \
        if (json_object_set_new((obj), (key), (val)) != 0) goto nomem;                             \
    } while (0)

/* The manifest checksums itself: its last member is
 *   "manifest_xxh3": "<16 hex digits>"
 * the XXH3-64 of the file's bytes with those 16 digits read as '0's. Every
 * other file is covered by the manifest, so without this a changed step, size
 * or tensor checksum in the manifest would go unnoticed. */
#define MANIFEST_SUM_KEY "manifest_xxh3"
#define MANIFEST_SUM_ZERO "0000000000000000"
static const char manifest_sum_prefix[] = "\"" MANIFEST_SUM_KEY "\": \"";

/* Where the 16 digits of the checksum are in text: the one occurrence of
 * the key's bytes followed by 16 characters and a quote. NULL if there is
 * not exactly one. (Inside a JSON string a quote is always escaped, so these
 * bytes can only be the member itself.) */
static const char *find_sum_digits(const char *text, size_t len) {
    const size_t plen = sizeof manifest_sum_prefix - 1;
    const char *found = NULL;
    for (const char *p = text; (size_t)(p - text) + plen + 17 <= len;) {
        const char *q = memmem(p, len - (size_t)(p - text), manifest_sum_prefix, plen);
        if (!q || (size_t)(q - text) + plen + 17 > len) break;
        if (found) return NULL;
        found = q + plen;
        p = q + 1;
    }
    if (found && found[16] != '"') return NULL;
    return found;
}

static int manifest_sum(const char *text, size_t len, const char *digits, uint64_t *out) {
    char *copy = ckpt__malloc(len);
    if (!copy) return ckpt__err_nomem("manifest checksum");
    memcpy(copy, text, len);
    memset(copy + (digits - text), '0', 16);
    *out = ckpt__xxh3(copy, len);
    free(copy);
    return CKPT_OK;
}

/* A shard file's chunk records: {"<key>": {"dtype": "F32", "global_shape":
 * [..], "offsets": [..], "shape": [..]}, ...}, one per tensor. */
static json_t *shape_json(int ndim, const int64_t *v) {
    json_t *a = json_array();
    for (int d = 0; a && d < ndim; d++)
        if (json_array_append_new(a, json_integer(v[d])) != 0) {
            json_decref(a);
            return NULL;
        }
    return a;
}

static json_t *chunks_json(const ckpt_manifest_file *f) {
    json_t *jc = json_object();
    if (!jc) return NULL;
    for (int64_t t = 0; t < f->ntensors; t++) {
        const ckpt_chunk *c = &f->chunks[t];
        json_t *o = json_object();
        if (!o || json_object_set_new(jc, f->tensor_keys[t], o) != 0) goto nomem;
        JSET(o, "dtype", json_string(ckpt_dtype_name(c->dtype)));
        JSET(o, "global_shape", shape_json(c->ndim, c->global_shape));
        JSET(o, "offsets", shape_json(c->ndim, c->offsets));
        JSET(o, "shape", shape_json(c->ndim, c->shape));
    }
    return jc;
nomem:
    json_decref(jc);
    return NULL;
}

/* One file's entry. "rank" only when not 0, so a one-process manifest reads
 * as it always did. */
static json_t *file_json(const ckpt_manifest_file *f) {
    char hex[17];
    json_t *jf = json_object();
    if (!jf) return NULL;
    JSET(jf, "name", json_string(f->name));
    JSET(jf, "kind", json_string(f->kind));
    if (f->rank != 0) JSET(jf, "rank", json_integer(f->rank));
    JSET(jf, "size", json_integer((json_int_t)f->size));
    hex64(f->xxh3, hex);
    JSET(jf, "xxh3", json_string(hex));
    if (f->has_xxh128) { /* high half first, as XXH128's canonical form */
        char wide[33];
        hex64(f->xxh128.hi, wide);
        hex64(f->xxh128.lo, wide + 16);
        JSET(jf, "xxh128", json_string(wide));
    }
    json_t *jt = json_object();
    if (!jt) goto nomem;
    JSET(jf, "tensors", jt);
    for (int64_t t = 0; t < f->ntensors; t++) {
        hex64(f->tensor_xxh3[t], hex);
        JSET(jt, f->tensor_keys[t], json_string(hex));
    }
    if (f->chunks) {
        json_t *jc = chunks_json(f);
        if (!jc) goto nomem;
        JSET(jf, "chunks", jc);
    }
    return jf;
nomem:
    json_decref(jf);
    return NULL;
}

/* Every file's entry, in order. */
static json_t *files_json(const ckpt_manifest *m) {
    json_t *files = json_array();
    if (!files) return NULL;
    for (int64_t i = 0; i < m->nfiles; i++) {
        json_t *jf = file_json(&m->files[i]);
        if (!jf || json_array_append_new(files, jf) != 0) {
            json_decref(files);
            return NULL;
        }
    }
    return files;
}

static json_t *build_json(const ckpt_manifest *m) {
    json_t *root = json_object();
    if (!root) return NULL;
    JSET(root, "format", json_string("ckpt"));
    JSET(root, "format_version", json_integer(m->format_version));
    JSET(root, "library_version", json_string(m->library_version));
    JSET(root, "iteration", json_integer(m->iteration));
    JSET(root, "step", json_integer(m->step));
    JSET(root, "process_index", json_integer(m->process_index < 0 ? 0 : m->process_index));
    JSET(root, "num_processes", json_integer(m->num_processes));
    JSET(root, "created_unix", json_integer(m->created_unix));
    JSET(root, "created", json_string(m->created));
    if (m->nmetrics > 0) {
        json_t *jm = json_object();
        if (!jm) goto nomem;
        JSET(root, "metrics", jm);
        for (int i = 0; i < m->nmetrics; i++)
            JSET(jm, m->metrics[i].name, json_real(m->metrics[i].value));
    }
    json_t *files = files_json(m);
    if (!files) goto nomem;
    JSET(root, "files", files);
    JSET(root, MANIFEST_SUM_KEY, json_string(MANIFEST_SUM_ZERO));
    return root;
nomem:
    json_decref(root);
    return NULL;
}

/* ---- the manifest's layout ------------------------------------------------- */

/* One JSON value, compact (no spaces), or a member's key. */
static bool put_json(FILE *f, const json_t *v) {
    return json_dumpf(v, f, JSON_COMPACT | JSON_ENCODE_ANY | JSON_PRESERVE_ORDER) == 0;
}

static bool put_key(FILE *f, const char *key) {
    json_t *k = json_string(key);
    bool ok = k && put_json(f, k) && fputs(": ", f) >= 0;
    json_decref(k);
    return ok;
}

/* A file's entry: its scalar members on the first line, then each member of
 * "tensors" and "chunks" on a line of its own:
 *
 *     {"name": "optimizer-00002-of-00004.safetensors", "kind": "optimizer", ...,
 *      "tensors": {
 *       "state.0.exp_avg": "6ed3c2dc87f8400f"},
 *      "chunks": {
 *       "state.0.exp_avg": {"dtype":"F32","global_shape":[50257,768],...}}}
 */
static bool put_file(FILE *f, json_t *jf) {
    const char *key;
    json_t *v;
    bool first = true, ok = fputs("    {", f) >= 0;
    json_object_foreach(jf, key, v) {
        if (!ok) break;
        bool nested = json_is_object(v);
        ok = fputs(first ? "" : nested ? ",\n     " : ", ", f) >= 0 && put_key(f, key);
        first = false;
        if (!ok || !nested) {
            ok = ok && put_json(f, v);
            continue;
        }
        const char *k2;
        json_t *v2;
        bool first2 = true;
        ok = fputc('{', f) != EOF;
        json_object_foreach(v, k2, v2) {
            ok = ok && fputs(first2 ? "\n      " : ",\n      ", f) >= 0 && put_key(f, k2) &&
                 put_json(f, v2);
            first2 = false;
        }
        ok = ok && fputc('}', f) != EOF;
    }
    return ok && fputc('}', f) != EOF;
}

/* The manifest's text: one member of the top level a line, as indented
 * JSON (the metrics one a line), and each file's entry as put_file lays it out; about 100 bytes a
 * chunk record against 250 for JSON indented throughout (docs/FORMAT.md).
 * The checksum member keeps its spelling ("manifest_xxh3": "..."). NULL when
 * out of memory. */
static char *layout_text(json_t *root) {
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    if (!f) return NULL;
    const char *key;
    json_t *v;
    bool first = true, ok = fputc('{', f) != EOF;
    json_object_foreach(root, key, v) {
        ok = ok && fputs(first ? "\n  " : ",\n  ", f) >= 0 && put_key(f, key);
        first = false;
        if (ok && strcmp(key, "files") == 0 && json_is_array(v)) {
            size_t i;
            json_t *jf;
            ok = fputc('[', f) != EOF;
            json_array_foreach(v, i, jf) {
                ok = ok && fputs(i ? ",\n" : "\n", f) >= 0 && put_file(f, jf);
            }
            ok = ok && fputs(json_array_size(v) ? "\n  ]" : "]", f) >= 0;
        } else if (ok && json_is_object(v) && json_object_size(v) > 0) { /* "metrics" */
            const char *k2;
            json_t *v2;
            bool first2 = true;
            ok = fputc('{', f) != EOF;
            json_object_foreach(v, k2, v2) {
                ok = ok && fputs(first2 ? "\n    " : ",\n    ", f) >= 0 && put_key(f, k2) &&
                     put_json(f, v2);
                first2 = false;
            }
            ok = ok && fputs("\n  }", f) >= 0;
        } else {
            ok = ok && put_json(f, v);
        }
    }
    ok = ok && fputs("\n}", f) >= 0;
    if (fclose(f) != 0) ok = false;
    if (!ok) {
        free(text);
        return NULL;
    }
    return text;
}

typedef struct text_ctx {
    const char *p;
    size_t n;
} text_ctx;

static int fill_text(ckpt_ostream *s, void *ctx) {
    text_ctx *t = ctx;
    return ckpt__ostream_write(s, t->p, t->n);
}

int ckpt__manifest_write(ckpt_manifest *m, const char *dir) {
    if (m->created_unix == 0) {
        time_t now = time(NULL);
        struct tm tm;
        m->created_unix = (int64_t)now;
        if (gmtime_r(&now, &tm)) strftime(m->created, sizeof m->created, "%Y-%m-%dT%H:%M:%SZ", &tm);
    }
    if (m->library_version[0] == '\0')
        snprintf(m->library_version, sizeof m->library_version, "%s", CKPT_VERSION_STRING);
    json_t *root = build_json(m);
    if (!root) return ckpt__err_nomem("manifest JSON");
    char *text = layout_text(root);
    json_decref(root);
    if (!text) return ckpt__err_nomem("manifest JSON text");
    size_t n = strlen(text);
    char *withnl = ckpt__malloc(n + 2);
    if (!withnl) {
        free(text);
        return ckpt__err_nomem("manifest JSON text");
    }
    memcpy(withnl, text, n);
    withnl[n] = '\n';
    withnl[n + 1] = '\0';
    free(text);
    /* Readers refuse a manifest over the limit: never commit one. */
    if (n + 1 > CKPT_MANIFEST_MAX_BYTES) {
        free(withnl);
        return ckpt__err(CKPT_EINVAL,
                         "manifest: %zu bytes, more than the %u a manifest may have (too many "
                         "tensors, shards or processes for one checkpoint)",
                         n + 1, CKPT_MANIFEST_MAX_BYTES);
    }
    char *digits = (char *)find_sum_digits(withnl, n + 1);
    if (!digits) {
        free(withnl);
        return ckpt__err(CKPT_EINVAL, "manifest: no unique %s member to fill", MANIFEST_SUM_KEY);
    }
    uint64_t sum = 0;
    int src = manifest_sum(withnl, n + 1, digits, &sum);
    if (src < 0) {
        free(withnl);
        return src;
    }
    char hex[17];
    hex64(sum, hex);
    memcpy(digits, hex, 16);
    size_t plen = strlen(dir) + sizeof("/" CKPT_MANIFEST_NAME);
    char *path = ckpt__malloc(plen);
    if (!path) {
        free(withnl);
        return ckpt__err_nomem("manifest path");
    }
    snprintf(path, plen, "%s/%s", dir, CKPT_MANIFEST_NAME);
    text_ctx t = {withnl, n + 1};
    int rc = ckpt__publish_file(path, fill_text, &t, NULL, NULL);
    free(path);
    free(withnl);
    return rc;
}

/* ---- parsing ------------------------------------------------------------ */

static int get_int(json_t *root, const char *key, bool required, int64_t lo, int64_t hi,
                   int64_t *out, const char *what) {
    json_t *v = json_object_get(root, key);
    if (!v) {
        if (!required) return 0;
        return ckpt__err(CKPT_ECORRUPT, "%s: \"%s\" is missing", what, key);
    }
    if (!json_is_integer(v))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"%s\" must be an integer", what, key);
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"%s\" is %lld, expected %" PRId64 "..%" PRId64, what,
                         key, (long long)x, lo, hi);
    *out = (int64_t)x;
    return 0;
}

static int get_str(json_t *root, const char *key, bool required, const char **out, size_t *len,
                   const char *what) {
    json_t *v = json_object_get(root, key);
    *out = NULL;
    if (!v) {
        if (!required) return 0;
        return ckpt__err(CKPT_ECORRUPT, "%s: \"%s\" is missing", what, key);
    }
    if (!json_is_string(v))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"%s\" must be a string", what, key);
    *out = json_string_value(v);
    *len = json_string_length(v);
    if (strlen(*out) != *len)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"%s\" contains a NUL character", what, key);
    return 0;
}

static int parse_hex64(const char *s, size_t len, uint64_t *out) {
    if (len != 16) return -1;
    uint64_t v = 0;
    for (size_t i = 0; i < 16; i++) {
        char c = s[i];
        int d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else return -1;
        v = (v << 4) | (uint64_t)d;
    }
    *out = v;
    return 0;
}

/* A name we will join to a folder path: a single, visible path component. */
static bool plain_name(const char *s, size_t len) {
    if (len == 0 || len > 255 || s[0] == '.') return false;
    if (strstr(s, "..")) return false;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c == '/' || c == '\\' || c < 0x20 || c == 0x7f) return false;
    }
    return strcmp(s, CKPT_MANIFEST_NAME) != 0;
}

bool ckpt__manifest_valid_name(const char *name) {
    if (!plain_name(name, strlen(name))) return false;
    json_t *j = json_string(name); /* NULL unless valid UTF-8 */
    if (!j) return false;
    json_decref(j);
    return true;
}

/* A JSON array of ndim non-negative integers. */
static int parse_dims(json_t *a, const char *field, int *ndim, int64_t *out, const char *where,
                      const char *key) {
    if (!json_is_array(a))
        return ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%.128s': \"%s\" must be an array", where,
                         key, field);
    size_t n = json_array_size(a);
    if (n > CKPT_MAX_NDIM || (*ndim >= 0 && (int)n != *ndim))
        return ckpt__err(
            CKPT_ECORRUPT,
            "%s: chunk of '%.128s': \"%s\" has %zu dimensions, expected %d (at most %d)", where,
            key, field, n, *ndim < 0 ? (int)n : *ndim, CKPT_MAX_NDIM);
    for (size_t d = 0; d < n; d++) {
        json_t *v = json_array_get(a, d);
        if (!json_is_integer(v) || json_integer_value(v) < 0)
            return ckpt__err(CKPT_ECORRUPT,
                             "%s: chunk of '%.128s': \"%s\"[%zu] must be a non-negative integer",
                             where, key, field, d);
        out[d] = (int64_t)json_integer_value(v);
    }
    *ndim = (int)n;
    return CKPT_OK;
}

/* A shard file's "chunks": exactly one record per tensor of its "tensors",
 * each within its tensor's bounds. Whether the chunks of every file tile
 * their tensors is checked once all files are read. */
static int parse_chunks(json_t *jc, ckpt_manifest_file *f, const ckpt_manifest *m,
                        const char *where) {
    if (!json_is_object(jc))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"chunks\" must be an object", where);
    int index = 0, count = 0;
    if (!ckpt__shard_file_parse(f->name, NULL, &index, &count))
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: has \"chunks\" but is not named as a shard file "
                         "(<name>-<i>-of-<n>.safetensors)",
                         where);
    if (count != m->num_processes || index != f->rank + 1)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: shard %d of %d, but the manifest says rank %d of %d processes", where,
                         index, count, f->rank, m->num_processes);
    if ((int64_t)json_object_size(jc) != f->ntensors)
        return ckpt__err(CKPT_ECORRUPT, "%s: %zu chunk records for %" PRId64 " tensors", where,
                         json_object_size(jc), f->ntensors);
    f->chunks = ckpt__calloc((size_t)(f->ntensors ? f->ntensors : 1), sizeof *f->chunks);
    if (!f->chunks) return ckpt__err_nomem("manifest chunks");
    for (int64_t t = 0; t < f->ntensors; t++) {
        const char *key = f->tensor_keys[t];
        json_t *o = json_object_get(jc, key);
        if (!json_is_object(o))
            return ckpt__err(CKPT_ECORRUPT, "%s: tensor '%.128s' has no chunk record", where, key);
        const char *field;
        json_t *fv;
        json_object_foreach(o, field, fv) {
            if (strcmp(field, "dtype") && strcmp(field, "global_shape") &&
                strcmp(field, "offsets") && strcmp(field, "shape"))
                return ckpt__err(CKPT_ECORRUPT, "%s: chunk of '%.128s': unknown field \"%.64s\"",
                                 where, key, field);
        }
        ckpt_chunk *c = &f->chunks[t];
        json_t *jd = json_object_get(o, "dtype");
        if (!json_is_string(jd) ||
            ckpt_dtype_from_name(json_string_value(jd), &c->dtype) != CKPT_OK)
            return ckpt__err(CKPT_ECORRUPT,
                             "%s: chunk of '%.128s': \"dtype\" is missing or unknown", where, key);
        c->ndim = -1;
        CKPT_TRY(parse_dims(json_object_get(o, "global_shape"), "global_shape", &c->ndim,
                            c->global_shape, where, key));
        CKPT_TRY(parse_dims(json_object_get(o, "offsets"), "offsets", &c->ndim, c->offsets, where,
                            key));
        CKPT_TRY(parse_dims(json_object_get(o, "shape"), "shape", &c->ndim, c->shape, where, key));
        CKPT_TRY(ckpt__chunk_check(c, CKPT_ECORRUPT, where, key, NULL));
    }
    return CKPT_OK;
}

static int parse_file(json_t *jf, int64_t idx, ckpt_manifest *m, const char *what) {
    char where[4400];
    snprintf(where, sizeof where, "%s: files[%" PRId64 "]", what, idx);
    if (!json_is_object(jf)) return ckpt__err(CKPT_ECORRUPT, "%s: must be an object", where);
    const char *name, *kind, *hex;
    size_t nlen = 0, klen = 0, hlen = 0;
    CKPT_TRY(get_str(jf, "name", true, &name, &nlen, where));
    if (!plain_name(name, nlen))
        return ckpt__err(CKPT_ECORRUPT, "%s: name \"%.64s\" is not a plain file name", where, name);
    snprintf(where, sizeof where, "%s: %s", what, name);
    CKPT_TRY(get_str(jf, "kind", true, &kind, &klen, where));
    if (klen == 0 || klen > 64)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"kind\" must be 1..64 characters", where);
    int64_t size = 0, rank = 0;
    CKPT_TRY(get_int(jf, "rank", false, 0, m->num_processes - 1, &rank, where));
    CKPT_TRY(get_int(jf, "size", true, 0, INT64_MAX, &size, where));
    CKPT_TRY(get_str(jf, "xxh3", true, &hex, &hlen, where));
    uint64_t digest;
    if (parse_hex64(hex, hlen, &digest) != 0)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"xxh3\" must be 16 lowercase hex digits", where);
    const char *wide = NULL;
    size_t wlen = 0;
    ckpt_h128 h128 = {0, 0};
    CKPT_TRY(get_str(jf, "xxh128", false, &wide, &wlen, where));
    if (wide && (wlen != 32 || parse_hex64(wide, 16, &h128.hi) != 0 ||
                 parse_hex64(wide + 16, 16, &h128.lo) != 0))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"xxh128\" must be 32 lowercase hex digits", where);
    json_t *jt = json_object_get(jf, "tensors");
    if (jt && !json_is_object(jt))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"tensors\" must be an object", where);

    ckpt_manifest_file *f = push_file(m);
    if (!f) return ckpt__err_nomem("manifest");
    f->name = ckpt__strdup(name);
    f->kind = ckpt__strdup(kind);
    f->size = (uint64_t)size;
    f->xxh3 = digest;
    f->rank = (int)rank;
    f->has_xxh128 = wide != NULL;
    f->xxh128 = h128;
    if (!f->name || !f->kind) return ckpt__err_nomem("manifest");
    size_t nt = jt ? json_object_size(jt) : 0;
    CKPT_TRY(alloc_tensors(f, (int64_t)nt));
    if (jt) {
        const char *key;
        json_t *val;
        json_object_foreach(jt, key, val) {
            if (key[0] == '\0' || strlen(key) > CKPT_MAX_KEY)
                return ckpt__err(CKPT_ECORRUPT, "%s: a tensor key is empty or too long", where);
            if (!json_is_string(val) ||
                parse_hex64(json_string_value(val), json_string_length(val),
                            &f->tensor_xxh3[f->ntensors]) != 0)
                return ckpt__err(CKPT_ECORRUPT,
                                 "%s: tensor '%.128s': digest must be 16 lowercase hex digits",
                                 where, key);
            f->tensor_keys[f->ntensors] = ckpt__strdup(key);
            if (!f->tensor_keys[f->ntensors]) return ckpt__err_nomem("manifest tensor key");
            f->ntensors++;
        }
    }
    json_t *jc = json_object_get(jf, "chunks");
    if (jc) CKPT_TRY(parse_chunks(jc, f, m, where));
    return 0;
}

static int cmp_file_names(const void *a, const void *b) {
    const ckpt_manifest_file *const *x = a, *const *y = b;
    return strcmp((*x)->name, (*y)->name);
}

/* Names are unique. Sorted, not pairwise: the 16 MiB limit admits ~250,000
 * files, and a pairwise check grows with the square (40,000 took 2.7 s). */
static int check_unique_names(const ckpt_manifest *m, const char *what) {
    if (m->nfiles < 2) return 0;
    const ckpt_manifest_file **v = ckpt__malloc((size_t)m->nfiles * sizeof *v);
    if (!v) return ckpt__err_nomem("manifest file names");
    for (int64_t i = 0; i < m->nfiles; i++) v[i] = &m->files[i];
    qsort(v, (size_t)m->nfiles, sizeof *v, cmp_file_names);
    int rc = 0;
    for (int64_t i = 1; i < m->nfiles && rc == 0; i++)
        if (strcmp(v[i - 1]->name, v[i]->name) == 0)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: file \"%s\" is listed twice", what, v[i]->name);
    free(v);
    return rc;
}

bool ckpt__metric_name_valid(const char *name) {
    size_t n = strlen(name);
    if (n == 0 || n > 63) return false;
    for (size_t i = 0; i < n; i++) {
        char c = name[i];
        bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                  c == '_' || c == '.' || c == ':' || c == '/' || c == '-';
        if (!ok) return false;
    }
    return true;
}

/* "metrics": optional; an object of at most CKPT_MAX_METRICS finite numbers
 * with valid names. */
static int parse_metrics(json_t *root, const char *what, ckpt_manifest *m) {
    json_t *jm = json_object_get(root, "metrics");
    if (!jm) return 0;
    if (!json_is_object(jm))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"metrics\" must be an object", what);
    if (json_object_size(jm) > CKPT_MAX_METRICS)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"metrics\" has %zu entries, expected at most %d",
                         what, json_object_size(jm), CKPT_MAX_METRICS);
    const char *key;
    json_t *v;
    json_object_foreach(jm, key, v) {
        if (!ckpt__metric_name_valid(key))
            return ckpt__err(CKPT_ECORRUPT,
                             "%s: metric name '%.64s' is not 1..63 bytes of [A-Za-z0-9_.:/-]", what,
                             key);
        if (!json_is_number(v))
            return ckpt__err(CKPT_ECORRUPT, "%s: metric '%s' must be a number", what, key);
        double x = json_number_value(v);
        if (!isfinite(x))
            return ckpt__err(CKPT_ECORRUPT, "%s: metric '%s' is not a finite number", what, key);
        snprintf(m->metrics[m->nmetrics].name, sizeof m->metrics[0].name, "%s", key);
        m->metrics[m->nmetrics].value = x;
        m->nmetrics++;
    }
    return 0;
}

static int parse_root(json_t *root, const char *what, ckpt_manifest *m) {
    if (!json_is_object(root)) return ckpt__err(CKPT_ECORRUPT, "%s: not a JSON object", what);
    const char *s;
    size_t len = 0;
    CKPT_TRY(get_str(root, "format", true, &s, &len, what));
    if (strcmp(s, "ckpt") != 0)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"format\" is \"%.32s\", expected \"ckpt\"", what, s);
    int64_t v = 0;
    CKPT_TRY(get_int(root, "format_version", true, 1, INT32_MAX, &v, what));
    if (v > CKPT_FORMAT_VERSION)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: checkpoint format version %" PRId64
                         " is newer than this library's (%d); upgrade ckpt",
                         what, v, CKPT_FORMAT_VERSION);
    m->format_version = v;
    CKPT_TRY(get_str(root, "library_version", true, &s, &len, what));
    snprintf(m->library_version, sizeof m->library_version, "%s", s);
    CKPT_TRY(get_int(root, "iteration", true, 0, INT64_MAX, &m->iteration, what));
    CKPT_TRY(get_int(root, "step", true, INT64_MIN, INT64_MAX, &m->step, what));
    CKPT_TRY(get_int(root, "num_processes", true, 1, 1 << 24, &v, what));
    m->num_processes = (int)v;
    v = -1;
    CKPT_TRY(get_int(root, "process_index", false, 0, m->num_processes - 1, &v, what));
    m->process_index = (int)v;
    CKPT_TRY(get_int(root, "created_unix", false, INT64_MIN, INT64_MAX, &m->created_unix, what));
    CKPT_TRY(get_str(root, "created", false, &s, &len, what));
    if (s) snprintf(m->created, sizeof m->created, "%s", s);
    CKPT_TRY(parse_metrics(root, what, m));
    json_t *files = json_object_get(root, "files");
    if (!json_is_array(files))
        return ckpt__err(CKPT_ECORRUPT, "%s: \"files\" must be an array", what);
    for (size_t i = 0; i < json_array_size(files); i++)
        CKPT_TRY(parse_file(json_array_get(files, i), (int64_t)i, m, what));
    CKPT_TRY(check_unique_names(m, what));
    return ckpt__manifest_check_chunks(m, CKPT_ECORRUPT, what);
}

/* After the structure and the format version: a newer format may checksum
 * differently, and a clear structural message beats "checksum mismatch". */
static int check_sum(json_t *root, const char *text, size_t len, const char *what) {
    json_t *v = json_object_get(root, MANIFEST_SUM_KEY);
    if (!v) return ckpt__err(CKPT_ECORRUPT, "%s: \"" MANIFEST_SUM_KEY "\" is missing", what);
    const char *want = json_string_value(v);
    if (!want || json_string_length(v) != 16 || strspn(want, "0123456789abcdef") != 16)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"" MANIFEST_SUM_KEY "\" must be 16 hex digits", what);
    const char *digits = find_sum_digits(text, len);
    if (!digits || memcmp(digits, want, 16) != 0)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: \"" MANIFEST_SUM_KEY "\" must appear exactly once, as written", what);
    uint64_t sum = 0;
    CKPT_TRY(manifest_sum(text, len, digits, &sum));
    char hex[17];
    hex64(sum, hex);
    if (memcmp(hex, want, 16) != 0)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: checksum mismatch: the manifest was changed after it was written "
                         "(%s in the file, %s computed)",
                         what, want, hex);
    return CKPT_OK;
}

int ckpt__manifest_parse(const char *text, size_t len, const char *what, ckpt_manifest *m) {
    ckpt__manifest_init(m);
    if (len > CKPT_MANIFEST_MAX_BYTES)
        return ckpt__err(CKPT_ECORRUPT, "%s: %zu bytes, more than the %u a manifest may have", what,
                         len, CKPT_MANIFEST_MAX_BYTES);
    json_error_t jerr;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return ckpt__err(CKPT_ECORRUPT, "%s: invalid JSON at line %d, column %d: %s", what,
                         jerr.line, jerr.column, jerr.text);
    int rc = parse_root(root, what, m);
    if (rc == 0) rc = check_sum(root, text, len, what);
    json_decref(root);
    if (rc < 0) {
        /* Keep the message; drop what was parsed so far. */
        for (int64_t i = 0; i < m->nfiles; i++) file_clear(&m->files[i]);
        free(m->files);
        m->files = NULL;
        m->nfiles = m->cap = 0;
    }
    return rc;
}

/* ---- chunk sets across files ------------------------------------------------ */

typedef struct chunk_item {
    const char *file; /* the shard file's name; its stem groups objects */
    size_t stem_len;
    const char *key;
    const ckpt_chunk *c;
} chunk_item;

static int cmp_chunk_item(const void *a, const void *b) {
    const chunk_item *x = a, *y = b;
    size_t n = x->stem_len < y->stem_len ? x->stem_len : y->stem_len;
    int s = memcmp(x->file, y->file, n);
    if (s) return s;
    if (x->stem_len != y->stem_len) return x->stem_len < y->stem_len ? -1 : 1;
    return strcmp(x->key, y->key);
}

int ckpt__manifest_check_chunks(const ckpt_manifest *m, int code, const char *what) {
    int64_t total = 0;
    for (int64_t i = 0; i < m->nfiles; i++)
        if (m->files[i].chunks) total += m->files[i].ntensors;
    if (total == 0) return CKPT_OK;
    chunk_item *v = ckpt__calloc((size_t)total, sizeof *v);
    ckpt_chunk_ref *refs = ckpt__calloc((size_t)total, sizeof *refs);
    int rc = CKPT_OK;
    if (!v || !refs) {
        rc = ckpt__err_nomem("manifest chunks");
        goto out;
    }
    int64_t k = 0;
    for (int64_t i = 0; i < m->nfiles; i++) {
        const ckpt_manifest_file *f = &m->files[i];
        if (!f->chunks) continue;
        size_t stem = 0;
        if (!ckpt__shard_file_parse(f->name, &stem, NULL, NULL)) {
            rc = ckpt__err(code, "%s: %s has chunks but is not named as a shard file", what,
                           f->name);
            goto out;
        }
        for (int64_t t = 0; t < f->ntensors; t++)
            v[k++] = (chunk_item){f->name, stem, f->tensor_keys[t], &f->chunks[t]};
    }
    qsort(v, (size_t)total, sizeof *v, cmp_chunk_item);
    for (int64_t i = 0; i < total && rc == CKPT_OK;) {
        int64_t j = i;
        while (j < total && cmp_chunk_item(&v[i], &v[j]) == 0) {
            refs[j - i] = (ckpt_chunk_ref){v[j].c, v[j].file};
            j++;
        }
        char obj[300];
        snprintf(obj, sizeof obj, "%s: %.*s", what, (int)v[i].stem_len, v[i].file);
        rc = ckpt__chunks_cover(refs, j - i, code, obj, v[i].key);
        i = j;
    }
out:
    free(v);
    free(refs);
    return rc;
}

/* ---- file records between processes ------------------------------------ */

int ckpt__manifest_files_to_json(const ckpt_manifest *m, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
    json_t *files = files_json(m);
    if (!files) return ckpt__err_nomem("file records JSON");
    char *text = json_dumps(files, JSON_COMPACT | JSON_PRESERVE_ORDER);
    json_decref(files);
    if (!text) return ckpt__err_nomem("file records JSON text");
    *out = text;
    *len = strlen(text);
    return CKPT_OK;
}

int ckpt__manifest_files_from_json(ckpt_manifest *m, const char *text, size_t len,
                                   const char *what) {
    if (len > CKPT_MANIFEST_MAX_BYTES)
        return ckpt__err(CKPT_ECORRUPT, "%s: %zu bytes, more than the %u a manifest may have", what,
                         len, CKPT_MANIFEST_MAX_BYTES);
    json_error_t jerr;
    json_t *files = json_loadb(text, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!files)
        return ckpt__err(CKPT_ECORRUPT, "%s: invalid JSON at line %d, column %d: %s", what,
                         jerr.line, jerr.column, jerr.text);
    int64_t before = m->nfiles;
    int rc = json_is_array(files)
                 ? CKPT_OK
                 : ckpt__err(CKPT_ECORRUPT, "%s: file records must be an array", what);
    for (size_t i = 0; rc == 0 && i < json_array_size(files); i++)
        rc = parse_file(json_array_get(files, i), (int64_t)i, m, what);
    json_decref(files);
    if (rc == 0) rc = check_unique_names(m, what);
    if (rc < 0) {
        /* Keep the message; m holds what it held before. */
        for (int64_t i = before; i < m->nfiles; i++) file_clear(&m->files[i]);
        m->nfiles = before;
    }
    return rc;
}

static char *join(const char *a, const char *b) {
    size_t n = strlen(a) + strlen(b) + 2;
    char *p = ckpt__malloc(n);
    if (p) snprintf(p, n, "%s/%s", a, b);
    return p;
}

int ckpt__manifest_read(const char *dir, ckpt_manifest *m) {
    ckpt__manifest_init(m);
    struct stat st;
    if (stat(dir, &st) != 0) return ckpt__err_os(errno, "%s", dir);
    if (!S_ISDIR(st.st_mode)) return ckpt__err(CKPT_EINVAL, "%s: not a folder", dir);
    char *path = join(dir, CKPT_MANIFEST_NAME);
    if (!path) return ckpt__err_nomem("manifest path");
    if (lstat(path, &st) != 0 && errno == ENOENT) {
        free(path);
        return ckpt__err(CKPT_ENOENT, "%s: not a checkpoint (no " CKPT_MANIFEST_NAME ")", dir);
    }
    char *text = NULL;
    size_t len = 0;
    int rc = ckpt__read_small_file(path, true, CKPT_MANIFEST_MAX_BYTES, &text, &len);
    if (rc == 0) rc = ckpt__manifest_parse(text, len, path, m);
    free(text);
    free(path);
    return rc;
}

/* ---- verification ------------------------------------------------------- */

/* The file's digest differs: say which tensor if the file still parses. */
static int name_mismatch(const char *dir, const ckpt_manifest_file *f, const ckpt_mapped *mp) {
    /* A save pre-hook's file is not a state file: nothing to parse. */
    if (strcmp(f->kind, "extra") == 0)
        return ckpt__err(CKPT_ECORRUPT, "%s: %s: checksum mismatch (a file a save pre-hook added)",
                         dir, f->name);
    ckpt_reader *r = NULL;
    int rc = ckpt_reader_open_memory(&r, mp->data, (size_t)mp->size, f->name);
    if (rc < 0)
        return ckpt__err_prefix(
            CKPT_ECORRUPT, "%s: %s: checksum mismatch and the file does not parse", dir, f->name);
    for (int64_t t = 0; t < f->ntensors; t++) {
        const void *p = NULL;
        ckpt_entry_info info;
        if (ckpt_reader_tensor_view(r, f->tensor_keys[t], &p, &info) < 0) {
            ckpt_reader_free(r);
            return ckpt__err(CKPT_ECORRUPT, "%s: %s: tensor '%s': missing (checksum mismatch)", dir,
                             f->name, f->tensor_keys[t]);
        }
        if (ckpt__xxh3(p, (size_t)info.nbytes) != f->tensor_xxh3[t]) {
            ckpt_reader_free(r);
            return ckpt__err(CKPT_ECORRUPT, "%s: %s: tensor '%s': checksum mismatch", dir, f->name,
                             f->tensor_keys[t]);
        }
    }
    ckpt_reader_free(r);
    return ckpt__err(CKPT_ECORRUPT,
                     "%s: %s: checksum mismatch in the header or metadata (tensor data intact)",
                     dir, f->name);
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static int check_unlisted(const char *dir, const ckpt_manifest *m) {
    DIR *d = opendir(dir);
    if (!d) return ckpt__err_os(errno, "%s", dir);
    struct dirent *e;
    int rc = 0;
    while ((e = readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".safetensors") || e->d_name[0] == '.') continue;
        if (!ckpt__manifest_find(m, e->d_name)) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s is not listed in the manifest", dir, e->d_name);
            break;
        }
    }
    closedir(d);
    return rc;
}

/* Only entries that were mapped: the others are still zeroed. */
static void unmap_if(ckpt_mapped *mp) {
    if (mp->data || mp->map_base || mp->heap) ckpt__unmap(mp);
    memset(mp, 0, sizeof *mp);
}

void ckpt__checkpoint_close(ckpt_checkpoint_open *c) {
    if (c->maps) {
        for (int64_t i = 0; i < c->m.nfiles; i++) unmap_if(&c->maps[i]);
        free(c->maps);
        c->maps = NULL;
    }
    ckpt__manifest_clear(&c->m);
    ckpt__arena_free(&c->own);
    c->total_bytes = 0;
    c->have_manifest = false;
}

static const uint8_t empty_file[1];

/* What a look at the folder can tell before anything is reserved or read:
 * each listed file is there, a regular file (not a symlink, a FIFO or a
 * folder: ckpt writes none), of the size the manifest says. A forged size
 * is damage found here, not an allocation of that size. */
static int check_size(const char *dir, const ckpt_manifest_file *f) {
    char *path = join(dir, f->name);
    if (!path) return ckpt__err_nomem("checkpoint path");
    struct stat st;
    int rc = 0;
    if (lstat(path, &st) != 0) {
        rc = errno == ENOENT
                 ? ckpt__err(CKPT_ECORRUPT, "%s: %s is listed in the manifest but missing", dir,
                             f->name)
                 : ckpt__err_os(errno, "%s", path);
    } else if (!S_ISREG(st.st_mode)) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %s: %s, expected a regular file", dir, f->name,
                       ckpt__file_type_name(st.st_mode));
    } else if ((uint64_t)st.st_size != f->size) {
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %s: size %lld bytes, the manifest says %" PRIu64 "%s",
                       dir, f->name, (long long)st.st_size, f->size,
                       (uint64_t)st.st_size < f->size ? " (truncated)" : "");
    }
    free(path);
    return rc;
}

/* A deep check reads the file with pread, hashing each piece as it arrives
 * (no mmap, no second pass): into dst (the file's slot of the read buffers,
 * private memory) when its bytes are kept for the readers, else through a
 * scratch piece. The readers use only those bytes: what a load applies is
 * what was hashed, whatever happens to the file afterwards. */
static int check_one(const char *dir, const ckpt_manifest_file *f, bool deep, ckpt_mapped *mp,
                     uint8_t *dst) {
    int rc = check_size(dir, f);
    if (rc < 0 || !deep) return rc;
    char *path = join(dir, f->name);
    if (!path) return ckpt__err_nomem("checkpoint path");
    char what[1024];
    snprintf(what, sizeof what, "%s: %s", dir, f->name);
    uint64_t h = 0;
    rc = ckpt__read_hashed(path, what, f->size, f->size ? dst : NULL, &h);
    if (rc == 0 && dst) {
        mp->data = f->size ? dst : empty_file; /* borrowed from the read buffers */
        mp->size = f->size;
    }
    if (rc == 0 && h != f->xxh3) {
        /* Which tensor went bad, from the bytes (mapped for this only). */
        ckpt_mapped tmp;
        memset(&tmp, 0, sizeof tmp);
        if (mp->data) rc = name_mismatch(dir, f, mp);
        else if ((rc = ckpt__map_file(path, &tmp)) == 0) {
            rc = name_mismatch(dir, f, &tmp);
            ckpt__unmap(&tmp);
        }
    }
    if (rc == 0 && dst) ckpt__io_verified(path);
    free(path);
    return rc;
}

/* Checks files[idx[0..n-1]] in ascending index order and stops at the first
 * failure, recording its index, status and message (the message is
 * thread-local, so a worker thread hands it over in the job). */
typedef struct check_job {
    const char *dir;
    const ckpt_manifest *m;
    bool deep;
    const bool *shallow; /* NULL, or per file: only check the size */
    ckpt_mapped *maps; /* NULL: hash each file through a scratch piece */
    uint8_t *const *dst; /* with maps: where each file's bytes go */
    const int64_t *idx;
    int64_t n;
    int64_t failed; /* index of the first failing file, or -1 */
    int rc;
    char msg[2048];
} check_job;

static void run_check_job(check_job *j) {
    j->failed = -1;
    j->rc = 0;
    for (int64_t k = 0; k < j->n; k++) {
        int64_t i = j->idx[k];
        ckpt_mapped tmp;
        memset(&tmp, 0, sizeof tmp);
        ckpt_mapped *mp = j->maps ? &j->maps[i] : &tmp;
        bool deep = j->deep && !(j->shallow && j->shallow[i]);
        int rc = check_one(j->dir, &j->m->files[i], deep, mp, j->maps ? j->dst[i] : NULL);
        if (rc < 0) {
            j->failed = i;
            j->rc = rc;
            snprintf(j->msg, sizeof j->msg, "%s", ckpt_errmsg());
            return;
        }
    }
}

static void *check_thread(void *arg) {
    run_check_job(arg);
    return NULL;
}

typedef struct sized_file {
    uint64_t size;
    int64_t index;
} sized_file;

static int cmp_size_desc(const void *a, const void *b) {
    const sized_file *x = a, *y = b;
    if (x->size != y->size) return x->size < y->size ? 1 : -1;
    return (x->index > y->index) - (x->index < y->index);
}

static int cmp_i64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

/* Below this many bytes to hash a second thread costs more than it saves. */
static _Atomic uint64_t parallel_check_bytes = 64u << 20;

uint64_t ckpt__set_parallel_check_bytes(uint64_t bytes) {
    return atomic_exchange(&parallel_check_bytes, bytes);
}

/* Checks every listed file (size; if deep, XXH3-64). Hashing is most of a
 * verified load's time, so with two or more large files it is split over
 * two threads, balanced by size. The error reported is the one of the
 * lowest-numbered failing file, as a sequential check would report. */
static int check_files(const char *dir, const ckpt_manifest *m, bool deep, const bool *shallow,
                       ckpt_mapped *maps, uint8_t *const *dst) {
    int64_t n = m->nfiles;
    if (n == 0) return CKPT_OK;
    int64_t *idx = ckpt__calloc((size_t)n * 2, sizeof *idx);
    if (!idx) return ckpt__err_nomem("checkpoint check");
    uint64_t total = 0; /* only compared with a threshold: saturates */
    for (int64_t i = 0; i < n; i++)
        if ((!shallow || !shallow[i]) && __builtin_add_overflow(total, m->files[i].size, &total))
            total = UINT64_MAX;
    check_job job[2];
    memset(job, 0, sizeof job);
    for (int w = 0; w < 2; w++) {
        job[w].dir = dir;
        job[w].m = m;
        job[w].deep = deep;
        job[w].shallow = shallow;
        job[w].maps = maps;
        job[w].dst = dst;
        job[w].idx = idx + (size_t)w * (size_t)n;
        job[w].failed = -1; /* a job that never runs has not failed */
    }
    bool parallel = deep && n >= 2 && total >= atomic_load(&parallel_check_bytes);
    if (parallel) {
        /* Greedy by size: each file, largest first, goes to the job with
         * fewer bytes so far; each job then checks its files in index order. */
        sized_file *v = ckpt__calloc((size_t)n, sizeof *v);
        if (!v) {
            free(idx);
            return ckpt__err_nomem("checkpoint check");
        }
        for (int64_t i = 0; i < n; i++) v[i] = (sized_file){m->files[i].size, i};
        qsort(v, (size_t)n, sizeof *v, cmp_size_desc);
        uint64_t load[2] = {0, 0};
        for (int64_t k = 0; k < n; k++) {
            int w = load[0] <= load[1] ? 0 : 1;
            idx[(size_t)w * (size_t)n + (size_t)job[w].n++] = v[k].index;
            load[w] += v[k].size;
        }
        free(v);
        qsort(idx, (size_t)job[0].n, sizeof *idx, cmp_i64);
        qsort(idx + n, (size_t)job[1].n, sizeof *idx, cmp_i64);
    } else {
        for (int64_t i = 0; i < n; i++) idx[i] = i;
        job[0].n = n;
    }
    pthread_t th;
    bool threaded =
        parallel && job[1].n > 0 && pthread_create(&th, NULL, check_thread, &job[1]) == 0;
    run_check_job(&job[0]);
    if (threaded) pthread_join(th, NULL);
    else if (job[1].n > 0) run_check_job(&job[1]);
    int rc = CKPT_OK;
    const check_job *bad = NULL;
    for (int w = 0; w < 2; w++)
        if (job[w].failed >= 0 && (!bad || job[w].failed < bad->failed)) bad = &job[w];
    if (bad) rc = ckpt__err(bad->rc, "%s", bad->msg);
    free(idx);
    return rc;
}

/* The files' places in the read buffers: each file a 64-byte aligned slot
 * of the arena (the caller's, or c's own). The sizes were checked against
 * the files first (check_size); a total that overflows or that no process
 * could hold is damage, not a reservation. */
static int place_files(const char *dir, ckpt_checkpoint_open *c, const bool *shallow,
                       ckpt_arena *arena, uint8_t ***dst) {
    int64_t n = c->m.nfiles;
    uint64_t total = 0;
    for (int64_t i = 0; i < n; i++) {
        if (shallow && shallow[i]) continue;
        uint64_t slot;
        if (__builtin_add_overflow(c->m.files[i].size, 63, &slot) ||
            __builtin_add_overflow(total, slot & ~(uint64_t)63, &total) ||
            total > (uint64_t)SIZE_MAX / 2)
            return ckpt__err(CKPT_ECORRUPT,
                             "%s: the listed files' sizes add up past what memory can hold "
                             "(at %s, %" PRIu64 " bytes)",
                             dir, c->m.files[i].name, c->m.files[i].size);
    }
    *dst = ckpt__calloc((size_t)(n ? n : 1), sizeof **dst);
    if (!*dst) return ckpt__err_nomem("checkpoint buffers");
    if (!arena) arena = &c->own;
    CKPT_TRY(ckpt__arena_reserve(arena, total));
    uint64_t off = 0;
    for (int64_t i = 0; i < n; i++) {
        if (shallow && shallow[i]) continue;
        (*dst)[i] = arena->p + off;
        off += (c->m.files[i].size + 63) & ~(uint64_t)63;
    }
    return CKPT_OK;
}

static int open_checkpoint(const char *dir, bool deep, bool keep_maps,
                           bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                           ckpt_arena *arena, ckpt_checkpoint_open *c);

int ckpt__checkpoint_open(const char *dir, bool deep, bool keep_maps, ckpt_checkpoint_open *c) {
    return open_checkpoint(dir, deep, keep_maps, NULL, NULL, NULL, c);
}

int ckpt__checkpoint_open_some(const char *dir, bool deep, bool keep_maps,
                               bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                               ckpt_checkpoint_open *c) {
    return open_checkpoint(dir, deep, keep_maps, want, ctx, NULL, c);
}

int ckpt__checkpoint_open_into(const char *dir,
                               bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                               ckpt_arena *arena, ckpt_checkpoint_open *c) {
    return open_checkpoint(dir, true, true, want, ctx, arena, c);
}

static int open_checkpoint(const char *dir, bool deep, bool keep_maps,
                           bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                           ckpt_arena *arena, ckpt_checkpoint_open *c) {
    memset(c, 0, sizeof *c);
    int rc = ckpt__manifest_read(dir, &c->m);
    if (rc < 0) {
        char *path = join(dir, CKPT_MANIFEST_NAME);
        struct stat st;
        c->no_manifest = path && stat(dir, &st) == 0 && S_ISDIR(st.st_mode) &&
                         stat(path, &st) != 0 && errno == ENOENT;
        free(path);
        return rc;
    }
    c->have_manifest = true;
    if (keep_maps && deep) {
        c->maps = ckpt__calloc((size_t)(c->m.nfiles ? c->m.nfiles : 1), sizeof *c->maps);
        if (!c->maps) {
            ckpt__checkpoint_close(c);
            return ckpt__err_nomem("checkpoint maps");
        }
    }
    for (int64_t i = 0; i < c->m.nfiles; i++)
        if (__builtin_add_overflow(c->total_bytes, c->m.files[i].size, &c->total_bytes))
            c->total_bytes = UINT64_MAX;
    bool *shallow = NULL;
    if (want) {
        shallow = ckpt__calloc((size_t)(c->m.nfiles ? c->m.nfiles : 1), sizeof *shallow);
        if (!shallow) {
            ckpt__checkpoint_close(c);
            return ckpt__err_nomem("checkpoint check");
        }
        for (int64_t i = 0; i < c->m.nfiles; i++) shallow[i] = !want(&c->m.files[i], ctx);
    }
    uint8_t **dst = NULL;
    /* Every size against the folder before a byte is reserved or read. */
    for (int64_t i = 0; rc == 0 && i < c->m.nfiles; i++) rc = check_size(dir, &c->m.files[i]);
    /* A checkpoint is saved from memory: files adding up to more than a
     * process can address are forged (sparse files can have any size), and
     * reading them would run for years. */
    if (rc == 0 && !ckpt__addressable(c->total_bytes)) {
        if (c->total_bytes == UINT64_MAX)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: the listed sizes add up past 2^64 (forged sizes)",
                           dir);
        else
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: the listed files' sizes add up to %" PRIu64
                           " bytes, more than memory can hold (forged sizes)",
                           dir, c->total_bytes);
    }
    if (rc == 0 && c->maps) rc = place_files(dir, c, shallow, arena, &dst);
    if (rc == 0) rc = check_files(dir, &c->m, deep, shallow, c->maps, dst);
    free(dst);
    free(shallow);
    if (rc == 0) rc = check_unlisted(dir, &c->m);
    if (rc < 0) {
        /* Keep the manifest (callers report what could be read); drop maps. */
        if (c->maps) {
            for (int64_t i = 0; i < c->m.nfiles; i++) unmap_if(&c->maps[i]);
            free(c->maps);
            c->maps = NULL;
        }
    }
    return rc;
}

int ckpt_checkpoint_files(const char *dir, ckpt_checkpoint_file **out, int64_t *count) {
    if (out) *out = NULL;
    if (count) *count = 0;
    if (!dir || !out || !count) return ckpt__err(CKPT_EINVAL, "checkpoint_files: NULL argument");
    ckpt_manifest m;
    ckpt__manifest_init(&m);
    int rc = ckpt__manifest_read(dir, &m);
    if (rc < 0) {
        ckpt__manifest_clear(&m);
        return rc;
    }
    ckpt_checkpoint_file *v = NULL;
    if (m.nfiles > 0) {
        v = ckpt__calloc((size_t)m.nfiles, sizeof *v);
        if (!v) {
            ckpt__manifest_clear(&m);
            return ckpt__err_nomem("checkpoint files");
        }
    }
    /* The parser bounds names to 255 bytes and kinds to 64. */
    for (int64_t i = 0; i < m.nfiles; i++) {
        snprintf(v[i].name, sizeof v[i].name, "%s", m.files[i].name);
        snprintf(v[i].kind, sizeof v[i].kind, "%s", m.files[i].kind);
        v[i].size = m.files[i].size;
        v[i].xxh3 = m.files[i].xxh3;
        char *p = join(dir, m.files[i].name);
        struct stat st;
        if (p && lstat(p, &st) == 0 && S_ISREG(st.st_mode)) {
            v[i].device = (uint64_t)st.st_dev;
            v[i].inode = (uint64_t)st.st_ino;
            v[i].links = (uint64_t)st.st_nlink;
        }
        free(p);
    }
    *out = v;
    *count = m.nfiles;
    ckpt__manifest_clear(&m);
    return CKPT_OK;
}
