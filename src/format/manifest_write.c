/* manifest_write.c — checkpoint.json and the file records sent between
 * processes, written: JSON built from the records, laid out one file per
 * line, self-checksummed and published. */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/manifest_int.h"

/* ---- writing ------------------------------------------------------------ */

/* jansson reports allocation failure as a NULL value or a -1 status. */
#define JSET(obj, key, val)                                                                        \
    do {                                                                                           \
        if (json_object_set_new((obj), (key), (val)) != 0) goto nomem;                             \
    } while (0)

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
    if (f->has_header_xxh3) {
        hex64(f->header_xxh3, hex);
        JSET(jf, "header_xxh3", json_string(hex));
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

int ckpt__manifest_text(ckpt_manifest *m, char **out, size_t *len) {
    *out = NULL;
    *len = 0;
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
    *out = withnl;
    *len = n + 1;
    return CKPT_OK;
}

int ckpt__manifest_publish(const char *text, size_t len, const char *dir) {
    size_t plen = strlen(dir) + sizeof("/" CKPT_MANIFEST_NAME);
    char *path = ckpt__malloc(plen);
    if (!path) return ckpt__err_nomem("manifest path");
    snprintf(path, plen, "%s/%s", dir, CKPT_MANIFEST_NAME);
    text_ctx t = {text, len};
    int rc = ckpt__publish_file(path, fill_text, &t, NULL, NULL);
    free(path);
    return rc;
}

int ckpt__manifest_write(ckpt_manifest *m, const char *dir) {
    char *text = NULL;
    size_t n = 0;
    CKPT_TRY(ckpt__manifest_text(m, &text, &n));
    int rc = ckpt__manifest_publish(text, n, dir);
    free(text);
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
