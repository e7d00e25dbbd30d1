/* manifest_parse.c — checkpoint.json and the file records of other
 * processes, parsed as hostile input; the chunk sets of sharded tensors
 * checked across files. */
#include <errno.h>
#include <inttypes.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/manifest_int.h"
#include "format/shard.h"

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
    const char *hhex = NULL;
    size_t hhlen = 0;
    uint64_t hdigest = 0;
    CKPT_TRY(get_str(jf, "header_xxh3", false, &hhex, &hhlen, where));
    if (hhex && parse_hex64(hhex, hhlen, &hdigest) != 0)
        return ckpt__err(CKPT_ECORRUPT, "%s: \"header_xxh3\" must be 16 lowercase hex digits",
                         where);
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
    f->has_header_xxh3 = hhex != NULL;
    f->header_xxh3 = hdigest;
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

int ckpt__manifest_read(const char *dir, ckpt_manifest *m) {
    ckpt__manifest_init(m);
    struct stat st;
    if (ckpt__os_stat(dir, &st) != 0) return ckpt__err_os(errno, "%s", dir);
    if (!S_ISDIR(st.st_mode)) return ckpt__err(CKPT_EINVAL, "%s: not a folder", dir);
    char *path = join(dir, CKPT_MANIFEST_NAME);
    if (!path) return ckpt__err_nomem("manifest path");
    if (ckpt__os_lstat(path, &st) != 0 && errno == ENOENT) {
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
