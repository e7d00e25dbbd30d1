/* keymap.c — a flexible load's adaptation of one object's file: renamed
 * keys, non-strict matching, converted dtypes (see keymap.h). Everything is
 * decided before the object sees anything: the result is either "the file as
 * it is" or an adapted reader that holds exactly the object's schema. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "format/keymap.h"
#include "format/statedict.h"

/* ---- report key lists ---------------------------------------------------- */

static void key_free(ckpt_load_key *k) {
    free(k->object);
    free(k->key);
    free(k->file_key);
}

static int list_reserve(ckpt_key_list *l, int64_t need) {
    if (need <= l->cap) return CKPT_OK;
    int64_t nc = l->cap ? l->cap : 8;
    while (nc < need) nc *= 2;
    ckpt_load_key *v = ckpt__realloc(l->v, (size_t)nc * sizeof *v);
    if (!v) return ckpt__err_nomem("load report");
    l->v = v;
    l->cap = nc;
    return CKPT_OK;
}

int ckpt__key_list_add(ckpt_key_list *l, const char *object, const char *key,
                       const char *file_key, ckpt_dtype file_dtype, ckpt_dtype dtype) {
    CKPT_TRY(list_reserve(l, l->n + 1));
    ckpt_load_key k = {.file_dtype = file_dtype, .dtype = dtype};
    k.object = ckpt__strdup(object);
    if (key) k.key = ckpt__strdup(key);
    if (file_key) k.file_key = ckpt__strdup(file_key);
    if (!k.object || (key && !k.key) || (file_key && !k.file_key)) {
        key_free(&k);
        return ckpt__err_nomem("load report");
    }
    l->v[l->n++] = k;
    return CKPT_OK;
}

void ckpt__key_list_free(ckpt_key_list *l) {
    for (int64_t i = 0; i < l->n; i++) key_free(&l->v[i]);
    free(l->v);
    memset(l, 0, sizeof *l);
}

int ckpt__key_list_move(ckpt_key_list *to, ckpt_key_list *l) {
    if (l->n == 0) return CKPT_OK;
    CKPT_TRY(list_reserve(to, to->n + l->n));
    memcpy(to->v + to->n, l->v, (size_t)l->n * sizeof *l->v);
    to->n += l->n;
    free(l->v);
    memset(l, 0, sizeof *l);
    return CKPT_OK;
}

void ckpt__adapt_result_free(ckpt_adapt_result *r) {
    ckpt__key_list_free(&r->missing);
    ckpt__key_list_free(&r->unexpected);
    ckpt__key_list_free(&r->renamed);
    ckpt__key_list_free(&r->converted);
}

/* The report's lists are key lists: freed here, beside them. */
void ckpt_load_report_free(ckpt_load_report *r) {
    if (!r) return;
    free(r->dir);
    for (int i = 0; i < r->num_loaded; i++) free(r->loaded[i]);
    free(r->loaded);
    for (int i = 0; i < r->num_skipped; i++) free(r->skipped[i]);
    free(r->skipped);
    ckpt_key_list l[4] = {{r->missing, r->num_missing, r->num_missing},
                          {r->unexpected, r->num_unexpected, r->num_unexpected},
                          {r->renamed, r->num_renamed, r->num_renamed},
                          {r->converted, r->num_converted, r->num_converted}};
    for (int i = 0; i < 4; i++) ckpt__key_list_free(&l[i]);
    memset(r, 0, sizeof *r);
}

/* ---- key names --------------------------------------------------------- */

bool ckpt__adapt_wanted(const ckpt_load_options *opt) {
    return opt &&
           (opt->non_strict || opt->convert_dtypes || opt->num_prefix_map > 0 || opt->rename);
}

int ckpt__keymap_check(const ckpt_load_options *opt, const char *what) {
    if (opt->num_prefix_map < 0)
        return ckpt__err(CKPT_EINVAL, "%s: num_prefix_map is %d, expected >= 0", what,
                         opt->num_prefix_map);
    if (opt->num_prefix_map > 0 && !opt->prefix_map)
        return ckpt__err(CKPT_EINVAL, "%s: prefix_map is NULL but num_prefix_map is %d", what,
                         opt->num_prefix_map);
    for (int i = 0; i < opt->num_prefix_map; i++) {
        if (!opt->prefix_map[i].from || !opt->prefix_map[i].to)
            return ckpt__err(CKPT_EINVAL, "%s: prefix_map[%d].%s is NULL", what, i,
                             opt->prefix_map[i].from ? "to" : "from");
    }
    return CKPT_OK;
}

int ckpt__keymap_apply(const ckpt_load_options *opt, const char *object, const char *key,
                       char *out, size_t cap, bool *renamed) {
    *renamed = false;
    int n = snprintf(out, cap, "%s", key);
    for (int i = 0; i < opt->num_prefix_map; i++) {
        const ckpt_key_prefix *p = &opt->prefix_map[i];
        size_t len = strlen(p->from);
        if (strncmp(key, p->from, len) != 0) continue;
        n = snprintf(out, cap, "%s%s", p->to, key + len);
        if (n < 0 || (size_t)n >= cap)
            return ckpt__err(CKPT_EINVAL,
                             "%s: key '%s' renamed by prefix_map[%d] ('%s' -> '%s') is longer "
                             "than %d bytes",
                             object, key, i, p->from, p->to, CKPT_MAX_KEY);
        break;
    }
    if (opt->rename) {
        char hb[CKPT_MAX_KEY + 2];
        hb[0] = '\0';
        ckpt_clear_error();
        int rc = opt->rename(opt->rename_user, object, out, hb, sizeof hb);
        if (rc < 0)
            return ckpt__err_prefix(ckpt__callback_failed(rc, "rename hook"), "%s: key '%s'",
                                    object, out);
        if (rc > 1)
            return ckpt__err(CKPT_EINVAL,
                             "%s: rename hook returned %d on key '%s', expected 0, 1 or a "
                             "negative status",
                             object, rc, out);
        if (rc == 1) {
            if (!memchr(hb, '\0', sizeof hb))
                return ckpt__err(CKPT_EINVAL,
                                 "%s: rename hook left the new name of '%s' unterminated", object,
                                 out);
            if (strlen(hb) > CKPT_MAX_KEY)
                return ckpt__err(CKPT_EINVAL,
                                 "%s: rename hook: new name of '%s' is longer than %d bytes",
                                 object, out, CKPT_MAX_KEY);
            snprintf(out, cap, "%s", hb);
        }
    }
    if (strcmp(out, key) == 0) return CKPT_OK;
    *renamed = true;
    int rc = ckpt__check_key(out, "key map");
    if (rc) return ckpt__err_prefix(rc, "%s: file key '%s' renamed to '%s'", object, key, out);
    return CKPT_OK;
}

/* ---- matching ---------------------------------------------------------- */

static bool convertible(ckpt_dtype dt) { return ckpt__dtype_convertible(dt); }

/* The file's keys under their memory names: a reader of views (no copy but
 * for sharded tensors, assembled). orig[j] = src's key of entry j. */
static int rename_all(ckpt_reader *src, const ckpt_load_options *opt, const char *object,
                      const char *what, ckpt_reader **out, const char ***orig, bool *any) {
    int64_t n = ckpt_reader_count(src);
    *any = false;
    *orig = ckpt__calloc((size_t)(n ? n : 1), sizeof **orig);
    if (!*orig) return ckpt__err_nomem("key map");
    CKPT_TRY(ckpt__reader_new_adapted(out, what));
    char nk[CKPT_MAX_KEY + 1];
    for (int64_t j = 0; j < n; j++) {
        ckpt_entry_info info;
        CKPT_TRY(ckpt_reader_entry(src, j, &info));
        bool r = false;
        CKPT_TRY(ckpt__keymap_apply(opt, object, info.key, nk, sizeof nk, &r));
        *any = *any || r;
        if (ckpt__reader_has(*out, nk, NULL)) {
            const char *first = (*orig)[ckpt__reader_index(*out, nk)];
            return ckpt__err(CKPT_EMISMATCH, "%s: file keys '%s' and '%s' both become '%s'", what,
                             first, info.key, nk);
        }
        if (info.kind == CKPT_ENTRY_ALIAS) { /* its target under the target's new name */
            char nt[CKPT_MAX_KEY + 1];
            bool rt = false;
            CKPT_TRY(ckpt__keymap_apply(opt, object, info.target, nt, sizeof nt, &rt));
            *any = *any || rt;
            CKPT_TRY(ckpt__reader_put_alias(*out, nk, nt));
        } else {
            CKPT_TRY(ckpt__reader_put_from_reader(*out, nk, src, info.key, CKPT_DTYPE_INVALID));
        }
        (*orig)[j] = info.key; /* a view into src, which outlives this */
    }
    return CKPT_OK;
}

/* The file key behind memory key `key` of the named reader. */
static const char *file_key_of(ckpt_reader *named, const char **orig, const char *key) {
    int64_t j = orig ? ckpt__reader_index(named, key) : -1;
    return j >= 0 ? orig[j] : key;
}

static int match(const ckpt_writer *schema, ckpt_reader *named, const char **orig,
                 const ckpt_load_options *opt, const char *object, const char *what,
                 ckpt_adapt_result *res, bool *need) {
    char a[200], b[200];
    int64_t ns = ckpt_writer_entry_count(schema);
    for (int64_t i = 0; i < ns; i++) {
        ckpt_entry_info m, f;
        CKPT_TRY(ckpt_writer_entry(schema, i, &m));
        bool present = ckpt__reader_has(named, m.key, &f);
        /* a tied name the file leaves out: its target fills the one buffer */
        if (!present && m.kind == CKPT_ENTRY_ALIAS) continue;
        if (!present) {
            if (!opt->non_strict)
                return ckpt__err(CKPT_EMISMATCH,
                                 "%s: key '%s' missing in file (memory has %s%s); a non-strict "
                                 "load would keep its value",
                                 what, m.key, ckpt_entry_kind_name(m.kind),
                                 m.kind == CKPT_ENTRY_TENSOR ? " tensor" : "");
            CKPT_TRY(
                ckpt__key_list_add(&res->missing, object, m.key, NULL, CKPT_DTYPE_INVALID,
                                   m.kind == CKPT_ENTRY_TENSOR ? m.dtype : CKPT_DTYPE_INVALID));
            *need = true;
            continue;
        }
        const char *fk = file_key_of(named, orig, m.key);
        if (f.kind != m.kind)
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s'%s%s%s: %s in file, %s in memory%s", what,
                             m.key, fk != m.key ? " (file key '" : "", fk != m.key ? fk : "",
                             fk != m.key ? "')" : "", ckpt_entry_kind_name(f.kind),
                             ckpt_entry_kind_name(m.kind),
                             f.kind == CKPT_ENTRY_ALIAS || m.kind == CKPT_ENTRY_ALIAS
                                 ? " (tied tensors must be tied alike in the file and in memory)"
                                 : "");
        if (m.kind == CKPT_ENTRY_ALIAS && strcmp(f.target, m.target) != 0)
            return ckpt__err(CKPT_EMISMATCH,
                             "%s: key '%s': an alias of '%s' in file, of '%s' in memory", what,
                             m.key, f.target, m.target);
        if (strcmp(fk, m.key) != 0)
            CKPT_TRY(ckpt__key_list_add(&res->renamed, object, m.key, fk, f.dtype, m.dtype));
        if (m.kind != CKPT_ENTRY_TENSOR) continue;
        bool same = f.ndim == m.ndim;
        for (int d = 0; same && d < m.ndim; d++) same = f.shape[d] == m.shape[d];
        if (!same)
            return ckpt__err(CKPT_EMISMATCH, "%s: tensor '%s': shape %s in file, %s in memory",
                             what, m.key, ckpt__shape_str(a, sizeof a, f.ndim, f.shape),
                             ckpt__shape_str(b, sizeof b, m.ndim, m.shape));
        if (f.dtype == m.dtype) continue;
        if (!opt->convert_dtypes || !convertible(f.dtype) || !convertible(m.dtype))
            return ckpt__err(CKPT_EMISMATCH, "%s: tensor '%s': dtype %s in file, %s in memory%s",
                             what, m.key, ckpt_dtype_name(f.dtype), ckpt_dtype_name(m.dtype),
                             convertible(f.dtype) && convertible(m.dtype)
                                 ? " (convert_dtypes would convert it)"
                                 : "");
        CKPT_TRY(ckpt__key_list_add(&res->converted, object, m.key, fk, f.dtype, m.dtype));
        *need = true;
    }
    int64_t nf = ckpt_reader_count(named);
    for (int64_t j = 0; j < nf; j++) {
        ckpt_entry_info f;
        CKPT_TRY(ckpt_reader_entry(named, j, &f));
        if (ckpt__writer_has(schema, f.key)) continue;
        const char *fk = orig ? orig[j] : f.key;
        if (!opt->non_strict)
            return ckpt__err(CKPT_EMISMATCH,
                             "%s: key '%s' in file (%s) but not in memory; a non-strict load "
                             "would ignore it",
                             what, fk, ckpt_entry_kind_name(f.kind));
        CKPT_TRY(ckpt__key_list_add(&res->unexpected, object, NULL, fk, 
                                    f.kind == CKPT_ENTRY_TENSOR ? f.dtype : CKPT_DTYPE_INVALID,
                                    CKPT_DTYPE_INVALID));
        *need = true;
    }
    return CKPT_OK;
}

int ckpt__adapt(const ckpt_writer *schema, ckpt_reader *src, const ckpt_load_options *opt,
                const char *object, const char *what, int (*current)(void *ctx, ckpt_writer *w),
                void *ctx, ckpt_reader **out, ckpt_reader **extra, ckpt_adapt_result *res) {
    *out = NULL;
    *extra = NULL;
    ckpt_adapt_result local;
    memset(&local, 0, sizeof local);
    ckpt_reader *ren = NULL, *fin = NULL;
    ckpt_writer *cur = NULL;
    const char **orig = NULL;
    bool any_renamed = false, need = false;
    int rc = CKPT_OK;
    if (opt->num_prefix_map > 0 || opt->rename) {
        rc = rename_all(src, opt, object, what, &ren, &orig, &any_renamed);
        if (rc) goto fail;
    }
    ckpt_reader *named = any_renamed ? ren : src;
    rc = match(schema, named, any_renamed ? orig : NULL, opt, object, what, &local, &need);
    if (rc) goto fail;
    if (!need && !any_renamed) { /* the file serves as it is */
        ckpt_reader_free(ren);
        free(orig);
        return CKPT_OK;
    }
    if ((rc = ckpt__reader_new_adapted(&fin, what))) goto fail;
    int64_t ns = ckpt_writer_entry_count(schema);
    for (int64_t i = 0; i < ns && rc == 0; i++) {
        ckpt_entry_info m;
        if ((rc = ckpt_writer_entry(schema, i, &m))) break;
        if (m.kind == CKPT_ENTRY_ALIAS && !ckpt__reader_has(named, m.key, NULL)) {
            rc = ckpt__reader_put_alias(fin, m.key, m.target);
            continue;
        }
        if (ckpt__reader_has(named, m.key, NULL)) {
            rc = ckpt__reader_put_from_reader(fin, m.key, named, m.key,
                                              m.kind == CKPT_ENTRY_TENSOR ? m.dtype
                                                                          : CKPT_DTYPE_INVALID);
            continue;
        }
        if (!cur) { /* the object's present values, for the keys the file lacks */
            if ((rc = ckpt_writer_new(&cur))) break;
            ckpt_clear_error();
            rc = current(ctx, cur);
            if (rc) {
                rc = ckpt__err_prefix(ckpt__callback_failed(rc, "state_dict"), "%s", what);
                break;
            }
        }
        rc = ckpt__reader_put_from_writer(fin, cur, m.key);
        if (rc) rc = ckpt__err_prefix(rc, "%s", what);
    }
    ckpt_writer_free(cur);
    if (rc) goto fail;
    if ((rc = ckpt__key_list_move(&res->missing, &local.missing)) ||
        (rc = ckpt__key_list_move(&res->unexpected, &local.unexpected)) ||
        (rc = ckpt__key_list_move(&res->renamed, &local.renamed)) ||
        (rc = ckpt__key_list_move(&res->converted, &local.converted)))
        goto fail;
    free(orig);
    *out = fin;
    *extra = ren;
    return CKPT_OK;
fail:
    ckpt__adapt_result_free(&local);
    ckpt_reader_free(fin);
    ckpt_reader_free(ren);
    free(orig);
    return rc;
}
