/* statedict_adapt.c — adapted readers (ckpt_load_state_ex): a reader whose
 * entries are taken, renamed or converted, from other readers and writers. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "format/statedict.h"
#include "format/statedict_int.h"

/* ---- adapted readers (ckpt_load_state_ex) ------------------------------- */

int ckpt__reader_new_adapted(ckpt_reader **out, const char *name) {
    return ckpt__reader_new_empty(out, name);
}

int ckpt__reader_adopt_reader(ckpt_reader *r, ckpt_reader *sub) {
    CKPT_TRY(grow((void **)&r->subs, &r->subcap, r->nsubs + 1, sizeof *r->subs));
    r->subs[r->nsubs++] = sub;
    return CKPT_OK;
}

/* A new entry with s's kind, dtype, shape and size, nothing else. */
static entry entry_header(const entry *s) {
    entry e;
    memset(&e, 0, sizeof e);
    e.kind = s->kind;
    e.dtype = s->dtype;
    e.ndim = s->ndim;
    memcpy(e.shape, s->shape, sizeof e.shape);
    e.nbytes = s->nbytes;
    return e;
}

static char *reader_own_strdup(ckpt_reader *r, const char *s, size_t n) {
    /* Room first, so that nothing is freed on the way (the release build's
     * use-after-free analysis cannot follow a free on a failure path). */
    if (grow((void **)&r->owned, &r->ownedcap, r->nowned + 1, sizeof *r->owned)) {
        ckpt__err_nomem("adapted reader");
        return NULL;
    }
    char *p = ckpt__malloc(n + 1);
    if (!p) {
        ckpt__err_nomem("adapted reader");
        return NULL;
    }
    memcpy(p, s, n);
    p[n] = '\0';
    r->owned[r->nowned++] = p;
    return p;
}

/* Appends *e (key already owned by r) and indexes it. On failure e->bytes
 * is freed (everything else r owns already). */
static int adapted_append(ckpt_reader *r, entry *e) {
    int rc = grow((void **)&r->entries, &r->ecap, r->count + 1, sizeof *r->entries);
    if (rc) {
        free(e->bytes);
        return rc;
    }
    r->entries[r->count] = *e;
    rc = reader_index_add(r, r->count);
    if (rc) {
        free(e->bytes);
        memset(&r->entries[r->count], 0, sizeof *r->entries);
        return rc;
    }
    r->count++;
    return CKPT_OK;
}

static int adapted_scalar(ckpt_reader *r, entry *e, const entry *s) {
    e->i64 = s->i64;
    e->u64 = s->u64;
    e->f64 = s->f64;
    if (s->kind == CKPT_ENTRY_ALIAS) {
        if (!(e->str = reader_own_strdup(r, s->str, strlen(s->str)))) return CKPT_ENOMEM;
    } else if (s->kind == CKPT_ENTRY_STR) {
        if (!(e->str = reader_own_strdup(r, s->str ? s->str : "", (size_t)s->nbytes)))
            return CKPT_ENOMEM;
    } else if (s->kind == CKPT_ENTRY_BYTES && s->nbytes) {
        if (!(e->bytes = ckpt__malloc((size_t)s->nbytes))) return ckpt__err_nomem("adapted reader");
        memcpy(e->bytes, s->bytes, (size_t)s->nbytes);
    }
    return CKPT_OK;
}

int ckpt__reader_put_from_reader(ckpt_reader *r, const char *key, ckpt_reader *src,
                                 const char *src_key, ckpt_dtype dt) {
    const entry *s = reader_get(src, src_key);
    if (!s) return ckpt__err(CKPT_ENOENT, "%s: no key '%s'", src->name, src_key);
    entry e = entry_header(s);
    if (!(e.key = reader_own_strdup(r, key, strlen(key)))) return CKPT_ENOMEM;
    if (s->kind != CKPT_ENTRY_TENSOR) {
        CKPT_TRY(adapted_scalar(r, &e, s));
        return adapted_append(r, &e);
    }
    if (dt == CKPT_DTYPE_INVALID) dt = s->dtype;
    CKPT_TRY(materialize(src, s)); /* its bytes in its dtype */
    const uint8_t *bytes = NULL;
    if (s->nbytes && s->sk) { /* a sharded tensor: assembled whole */
        uint8_t *buf = ckpt__malloc((size_t)s->nbytes);
        CKPT_TRY(reader_own(r, buf));
        CKPT_TRY(ckpt_read_tensor(src, src_key, s->dtype, s->ndim, s->shape, buf));
        bytes = buf;
    } else if (s->nbytes) {
        bytes = s->data;
        if (!bytes) {
            CKPT_TRY(reader_map(src));
            if (!src->mem)
                return ckpt__err(CKPT_EIO, "%s: tensor '%s': no bytes", src->name, src_key);
            bytes = src->mem + s->offset;
        }
    }
    if (dt != s->dtype) {
        /* converted when read: straight into the caller's buffer */
        if (!ckpt__dtype_convertible(s->dtype) || !ckpt__dtype_convertible(dt))
            return ckpt__err(CKPT_EINVAL, "%s: tensor '%s': %s does not convert to %s", src->name,
                             src_key, ckpt_dtype_name(s->dtype),
                             ckpt_dtype_name(dt) ? ckpt_dtype_name(dt) : "?");
        CKPT_TRY(ckpt_tensor_nbytes(dt, s->ndim, s->shape, &e.nbytes));
        e.dtype = dt;
        e.conv_from = s->dtype;
    }
    e.data = bytes;
    return adapted_append(r, &e);
}

int ckpt__reader_put_alias(ckpt_reader *r, const char *key, const char *target) {
    entry e;
    memset(&e, 0, sizeof e);
    e.kind = CKPT_ENTRY_ALIAS;
    if (!(e.key = reader_own_strdup(r, key, strlen(key))) ||
        !(e.str = reader_own_strdup(r, target, strlen(target))))
        return CKPT_ENOMEM;
    const entry *t = reader_get(r, target);
    if (t && t->kind == CKPT_ENTRY_TENSOR) {
        e.dtype = t->dtype;
        e.ndim = t->ndim;
        memcpy(e.shape, t->shape, sizeof e.shape);
    }
    return adapted_append(r, &e);
}

int ckpt__reader_put_writer_views(ckpt_reader *r, const ckpt_writer *w) {
    for (int64_t i = 0; i < w->count; i++) {
        const entry *s = &w->entries[i];
        if (s->kind == CKPT_ENTRY_ALIAS) {
            CKPT_TRY(ckpt__reader_put_alias(r, s->key, s->str));
            continue;
        }
        if (s->kind != CKPT_ENTRY_TENSOR || (s->shard && !shard_is_whole(s)))
            return ckpt__err(CKPT_EINVAL, "state dict: '%s' is not a whole tensor", s->key);
        if (s->mem.ops)
            return ckpt__err(CKPT_EUNSUPPORTED,
                             "state dict: '%s' is behind memory ops: no view of it", s->key);
        entry e = entry_header(s);
        e.data = s->data;
        if (!(e.key = reader_own_strdup(r, s->key, strlen(s->key)))) return CKPT_ENOMEM;
        CKPT_TRY(adapted_append(r, &e));
    }
    return CKPT_OK;
}

int ckpt__reader_put_from_writer(ckpt_reader *r, const ckpt_writer *w, const char *key) {
    int64_t i = key_index_get(&w->index, key);
    if (i < 0) return ckpt__err(CKPT_ENOENT, "state dict: no key '%s'", key);
    const entry *s = &w->entries[i];
    if (w->schema) return ckpt__err(CKPT_EINVAL, "adapted reader: a schema writer holds no values");
    if (s->shard && !shard_is_whole(s))
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "tensor '%s' is sharded across processes; a sharded tensor cannot be "
                         "missing from the file in a non-strict load",
                         key);
    entry e = entry_header(s);
    if (!(e.key = reader_own_strdup(r, key, strlen(key)))) return CKPT_ENOMEM;
    if (s->kind != CKPT_ENTRY_TENSOR) {
        CKPT_TRY(adapted_scalar(r, &e, s));
        return adapted_append(r, &e);
    }
    if (s->nbytes) { /* a copy: the object reads it back into the memory it came from */
        uint8_t *buf = ckpt__malloc((size_t)s->nbytes);
        CKPT_TRY(reader_own(r, buf));
        if (s->mem.ops) CKPT_TRY(ckpt__mem_get(&s->mem, 0, buf, s->nbytes, key));
        else memcpy(buf, s->data, (size_t)s->nbytes);
        e.data = buf;
    }
    return adapted_append(r, &e);
}
