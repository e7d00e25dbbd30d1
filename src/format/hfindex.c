/* hfindex.c — Hugging Face's sharded-weights layout (see hfindex.h). */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "format/hfindex.h"
#include "format/statedict.h"

static void hf_plan(const uint64_t *nbytes, int64_t n, uint64_t max, int64_t *starts,
                   int64_t *nshards) {
    int64_t s = 0;
    uint64_t cur = 0;
    for (int64_t i = 0; i < n; i++) {
        if (i == 0 || (cur > 0 && cur + nbytes[i] > max)) {
            starts[s++] = i;
            cur = 0;
        }
        cur += nbytes[i];
    }
    if (s == 0) starts[s++] = 0;
    starts[s] = n;
    *nshards = s;
}

static int hf_shard_name(char *buf, size_t cap, const char *stem, int64_t s, int64_t n,
                         const char *ext) {
    int k = snprintf(buf, cap, "%s-%05" PRId64 "-of-%05" PRId64 "%s", stem, s + 1, n, ext);
    if (k < 0 || (size_t)k >= cap)
        return ckpt__err(CKPT_EINVAL, "shard name of '%s' too long", stem);
    return CKPT_OK;
}

int ckpt__hf_index_text(const char *const *keys, const char *const *files, int64_t n,
                        uint64_t total, char **out) {
    *out = NULL;
    json_t *root = json_object(), *map = json_object(), *meta = json_object();
    int rc = root && map && meta ? CKPT_OK : CKPT_ENOMEM;
    for (int64_t i = 0; i < n && rc == 0; i++)
        if (json_object_set_new(map, keys[i], json_string(files[i])) != 0) rc = CKPT_ENOMEM;
    if (rc == 0 &&
        (json_object_set_new(meta, "total_size", json_integer((json_int_t)total)) ||
         json_object_set(root, "metadata", meta) || json_object_set(root, "weight_map", map)))
        rc = CKPT_ENOMEM;
    if (rc == 0 && !(*out = json_dumps(root, JSON_INDENT(2) | JSON_SORT_KEYS))) rc = CKPT_ENOMEM;
    json_decref(root);
    json_decref(map);
    json_decref(meta);
    return rc ? ckpt__err_nomem("shard index") : CKPT_OK;
}

int ckpt__hf_layout_make(const char *const *keys, const uint64_t *nbytes, int64_t n, uint64_t max,
                         const char *stem, ckpt_hf_layout *out) {
    return ckpt__hf_layout_make_ext(keys, nbytes, n, max, stem, ".safetensors", out);
}

int ckpt__hf_layout_make_ext(const char *const *keys, const uint64_t *nbytes, int64_t n,
                             uint64_t max, const char *stem, const char *ext, ckpt_hf_layout *out) {
    memset(out, 0, sizeof *out);
    out->starts = ckpt__calloc((size_t)n + 2, sizeof *out->starts);
    const char **files = ckpt__calloc((size_t)n + 1, sizeof *files);
    int rc = out->starts && files ? CKPT_OK : ckpt__err_nomem("shard layout");
    uint64_t total = 0;
    for (int64_t i = 0; i < n; i++) total += nbytes[i];
    if (rc == 0) {
        hf_plan(nbytes, n, max, out->starts, &out->nshards);
        if (!(out->names = ckpt__calloc((size_t)out->nshards, sizeof *out->names)))
            rc = ckpt__err_nomem("shard layout");
    }
    for (int64_t s = 0; s < out->nshards && rc == 0; s++) {
        rc = hf_shard_name(out->names[s], sizeof out->names[s], stem, s, out->nshards, ext);
        for (int64_t i = out->starts[s]; i < out->starts[s + 1]; i++) files[i] = out->names[s];
    }
    if (rc == 0) rc = ckpt__hf_index_text(keys, files, n, total, &out->index);
    free(files);
    if (rc) ckpt__hf_layout_free(out);
    return rc;
}

void ckpt__hf_layout_free(ckpt_hf_layout *l) {
    free(l->entry);
    free(l->starts);
    free(l->names);
    free(l->index);
    memset(l, 0, sizeof *l);
}

void ckpt__hf_index_free(ckpt_hf_index *x) {
    for (int64_t i = 0; i < x->n; i++) {
        free(x->keys[i]);
        free(x->files[i]);
    }
    for (int64_t i = 0; i < x->nparts; i++) free(x->parts[i]);
    free(x->keys);
    free(x->files);
    free(x->parts);
    memset(x, 0, sizeof *x);
}

static bool plain_name(const char *s) {
    size_t n = strlen(s);
    return n > 12 && n < 256 && !strchr(s, '/') && s[0] != '.' &&
           strcmp(s + n - 12, ".safetensors") == 0;
}

int ckpt__hf_index_parse(const char *text, size_t len, const char *what, ckpt_hf_index *out) {
    memset(out, 0, sizeof *out);
    json_error_t je;
    json_t *root = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return ckpt__err(CKPT_ECORRUPT, "%s: not valid JSON: %s (line %d)", what, je.text, je.line);
    int rc = CKPT_OK;
    json_t *map = json_object_get(root, "weight_map");
    size_t n = json_is_object(root) && json_is_object(map) ? json_object_size(map) : 0;
    if (!json_is_object(root) || !json_is_object(map) || n == 0) {
        rc = ckpt__err(CKPT_ECORRUPT,
                       "%s: expected an object with a non-empty \"weight_map\" object", what);
        goto out;
    }
    out->keys = ckpt__calloc(n, sizeof *out->keys);
    out->files = ckpt__calloc(n, sizeof *out->files);
    out->parts = ckpt__calloc(n, sizeof *out->parts);
    if (!out->keys || !out->files || !out->parts) {
        rc = ckpt__err_nomem("shard index");
        goto out;
    }
    const char *key;
    json_t *val;
    json_object_foreach(map, key, val) {
        const char *f = json_string_value(val);
        if (!f || !plain_name(f)) {
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: weight_map['%.128s'] is not a .safetensors file name "
                           "in the folder",
                           what, key);
            goto out;
        }
        rc = ckpt__check_key(key, what);
        if (rc) goto out;
        int64_t i = out->n;
        out->keys[i] = ckpt__strdup(key);
        out->files[i] = ckpt__strdup(f);
        if (!out->keys[i] || !out->files[i]) {
            free(out->keys[i]);
            free(out->files[i]);
            rc = ckpt__err_nomem("shard index");
            goto out;
        }
        out->n++;
        int64_t p = 0;
        while (p < out->nparts && strcmp(out->parts[p], f) != 0) p++;
        if (p == out->nparts) {
            if (!(out->parts[p] = ckpt__strdup(f))) {
                rc = ckpt__err_nomem("shard index");
                goto out;
            }
            out->nparts++;
        }
    }
out:
    json_decref(root);
    if (rc) ckpt__hf_index_free(out);
    return rc;
}

int ckpt__hf_combine(const ckpt_hf_index *x, ckpt_reader *const *part_readers, const char *what,
                     ckpt_reader **out) {
    *out = NULL;
    ckpt_reader *r = NULL;
    CKPT_TRY(ckpt__reader_new_adapted(&r, what));
    int rc = CKPT_OK;
    int64_t *used = ckpt__calloc((size_t)x->nparts, sizeof *used);
    if (!used) rc = ckpt__err_nomem("shard index");
    for (int64_t i = 0; i < x->n && rc == 0; i++) {
        int64_t p = 0;
        while (strcmp(x->parts[p], x->files[i]) != 0) p++;
        ckpt_entry_info e;
        if (!ckpt__reader_has(part_readers[p], x->keys[i], &e) || e.kind != CKPT_ENTRY_TENSOR) {
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: the index puts tensor '%s' in %s, which has no such tensor", what,
                           x->keys[i], x->files[i]);
            break;
        }
        used[p]++;
        rc = ckpt__reader_put_from_reader(r, x->keys[i], part_readers[p], x->keys[i],
                                          CKPT_DTYPE_INVALID);
    }
    /* Tied names: an alias in the part of its target (the index, as
     * Hugging Face's, names only the tensors). */
    for (int64_t p = 0; p < x->nparts && rc == 0; p++) {
        for (int64_t j = 0; j < ckpt_reader_count(part_readers[p]) && rc == 0; j++) {
            ckpt_entry_info e;
            rc = ckpt_reader_entry(part_readers[p], j, &e);
            if (rc || e.kind != CKPT_ENTRY_ALIAS) continue;
            if (ckpt__reader_has(r, e.key, NULL))
                rc = ckpt__err(CKPT_ECORRUPT, "%s: %s: '%s' is both a tensor and an alias", what,
                               x->parts[p], e.key);
            else if ((rc = ckpt__reader_put_alias(r, e.key, e.target)) == 0) used[p]++;
        }
    }
    for (int64_t p = 0; p < x->nparts && rc == 0; p++)
        if (used[p] != ckpt_reader_count(part_readers[p]))
            rc = ckpt__err(CKPT_ECORRUPT,
                           "%s: %s holds %" PRId64 " entries, the index names %" PRId64, what,
                           x->parts[p], ckpt_reader_count(part_readers[p]), used[p]);
    free(used);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    *out = r;
    return CKPT_OK;
}

int ckpt__hf_open(const ckpt_manifest *m, const ckpt_manifest_file *index, const void *bytes,
                  size_t len, const char *where, const char *what,
                  int (*part)(void *ctx, const ckpt_manifest_file *f, ckpt_reader **out), void *ctx,
                  ckpt_reader **out) {
    *out = NULL;
    ckpt_hf_index x;
    int rc = ckpt__hf_index_parse(bytes, len, index->name, &x);
    if (rc) return ckpt__err_prefix(rc, "%s", where);
    ckpt_reader **parts = ckpt__calloc((size_t)x.nparts, sizeof *parts);
    if (!parts) rc = ckpt__err_nomem("shards");
    for (int64_t p = 0; p < x.nparts && rc == 0; p++) {
        const ckpt_manifest_file *pf = ckpt__manifest_find(m, x.parts[p]);
        if (!pf || strcmp(pf->kind, "model") != 0 || pf->chunks)
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s names %s, which the manifest does not list as a "
                           "model file", where, index->name, x.parts[p]);
        else
            rc = part(ctx, pf, &parts[p]);
    }
    ckpt_reader *r = NULL;
    if (rc == 0) rc = ckpt__hf_combine(&x, parts, what, &r);
    /* r takes the parts; whatever it did not take is freed here */
    for (int64_t p = 0; parts && p < x.nparts; p++) {
        if (rc == 0 && (rc = ckpt__reader_adopt_reader(r, parts[p])) == 0) continue;
        ckpt_reader_free(parts[p]);
    }
    free(parts);
    ckpt__hf_index_free(&x);
    if (rc) {
        ckpt_reader_free(r);
        return rc;
    }
    *out = r;
    return CKPT_OK;
}
