/* statedict_schema.c — the schema check of transactional loads: does a
 * file hold every entry a schema writer describes, of the same kind, dtype
 * and shape? */
#include <stdio.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* ---- schema check ------------------------------------------------------- */

int ckpt__schema_check(const ckpt_writer *schema, const ckpt_reader *r, const char *what) {
    if (!schema || !r) return ckpt__err(CKPT_EINVAL, "schema check: NULL argument");
    if (!what) what = r->name;
    char a[260], b[260];
    for (int64_t i = 0; i < schema->count; i++) {
        const entry *m = &schema->entries[i];
        const entry *f = reader_get(r, m->key);
        if (!f && m->optional) continue; /* written by newer versions only */
        /* A tied name the file leaves out (as Hugging Face's files do): its
         * target, checked as any tensor, fills the one buffer. */
        if (!f && m->kind == CKPT_ENTRY_ALIAS) continue;
        if (!f)
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s' missing in file (memory has %s)", what,
                             m->key, describe(a, sizeof a, m));
        if (f->kind != m->kind || (m->kind == CKPT_ENTRY_ALIAS && strcmp(f->str, m->str) != 0))
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s': %s in file, %s in memory%s", what,
                             m->key, describe(a, sizeof a, f), describe(b, sizeof b, m),
                             f->kind == CKPT_ENTRY_ALIAS || m->kind == CKPT_ENTRY_ALIAS
                                 ? " (tied tensors must be tied alike in the file and in memory)"
                                 : "");
        if (m->kind == CKPT_ENTRY_ALIAS) {
            const entry *t = reader_get(r, f->str);
            if (!t || t->kind != CKPT_ENTRY_TENSOR)
                return ckpt__err(CKPT_ECORRUPT, "%s: '%s' is an alias of '%s', which %s", what,
                                 m->key, f->str, t ? "is not a tensor" : "the file does not hold");
            continue;
        }
        if (m->kind != CKPT_ENTRY_TENSOR) continue;
        if (f->dtype != m->dtype)
            return ckpt__err(CKPT_EMISMATCH, "%s: tensor '%s': dtype %s in file, %s in memory",
                             what, m->key, ckpt_dtype_name(f->dtype), ckpt_dtype_name(m->dtype));
        bool same = f->ndim == m->ndim;
        for (int d = 0; same && d < m->ndim; d++) same = f->shape[d] == m->shape[d];
        if (!same && !m->shape_by_object)
            return ckpt__err(CKPT_EMISMATCH, "%s: tensor '%s': shape %s in file, %s in memory",
                             what, m->key, ckpt__shape_str(a, sizeof a, f->ndim, f->shape),
                             ckpt__shape_str(b, sizeof b, m->ndim, m->shape));
        if (f->sk) CKPT_TRY(shard_key_check(r, &r->skeys[f->sk - 1]));
    }
    for (int64_t i = 0; i < r->count; i++) {
        const entry *f = &r->entries[i];
        if (key_index_get(&schema->index, f->key) < 0)
            return ckpt__err(CKPT_EMISMATCH, "%s: key '%s' in file (%s) but not in memory", what,
                             f->key, describe(a, sizeof a, f));
    }
    return CKPT_OK;
}

/* ---- which saved chunks a schema reads ------------------------------------ */

bool ckpt__schema_needs_chunk(const ckpt_writer *schema, const char *key, const ckpt_chunk *c,
                              bool *known) {
    int64_t i = schema && key ? key_index_get(&schema->index, key) : -1;
    if (known) *known = false;
    if (i < 0) return true; /* not the object's key as such: whatever reads it may need it */
    const entry *m = &schema->entries[i];
    if (m->kind != CKPT_ENTRY_TENSOR || m->ndim != c->ndim) return true;
    if (known) *known = true;
    if (!m->shard) return true; /* put whole: every chunk is read */
    for (int d = 0; d < c->ndim; d++) {
        if (m->cshape[d] == 0 || c->shape[d] == 0) return false; /* an empty box meets nothing */
        if (m->coff[d] + m->cshape[d] <= c->offsets[d] || c->offsets[d] + c->shape[d] <= m->coff[d])
            return false;
    }
    return true;
}
