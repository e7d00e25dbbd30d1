/* pickle.c — a pickle machine that can only build data. It knows the opcodes
 * of protocols 2 to 5 that a state dict needs and four globals (the tensor
 * and parameter rebuilds, OrderedDict, the typed storages); REDUCE applies
 * only those, and only to the arguments they take. Everything is checked
 * against the bytes left, the memo against the pickle's length, every
 * allocation against a memory budget set by the pickle's length (charged
 * before it is made), and the finished object for cycles, depth and
 * duplicate keys, so a hostile file can make it fail but never run code,
 * loop, or allocate more than a small multiple of its size. */
#include "format/torch/pickle.h"

#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "format/statedict.h"

/* The names of the value kinds, for messages; here because the machine's
 * own errors name them and torchfile.c, which builds on this file, must not
 * be called back. */
static const char *const kind_names[] = {
    [CKPT_TORCH_NONE] = "none", [CKPT_TORCH_BOOL] = "bool",   [CKPT_TORCH_INT] = "int",
    [CKPT_TORCH_FLOAT] = "float", [CKPT_TORCH_STR] = "str",   [CKPT_TORCH_BYTES] = "bytes",
    [CKPT_TORCH_TUPLE] = "tuple", [CKPT_TORCH_LIST] = "list", [CKPT_TORCH_SET] = "set",
    [CKPT_TORCH_DICT] = "dict",   [CKPT_TORCH_TENSOR] = "tensor",
};

const char *ckpt_torch_kind_name(ckpt_torch_kind kind) {
    return (int)kind >= CKPT_TORCH_NONE && (int)kind <= CKPT_TORCH_TENSOR ? kind_names[kind] : NULL;
}

enum ikind { IK_VALUE = 0, IK_GLOBAL, IK_STORAGE };
enum gkind { G_REBUILD_V2 = 1, G_REBUILD_PARAM, G_ODICT, G_STORAGE, G_SET };

struct ckpt_pkl_node {
    ckpt_torch_value v;     /* first: a node is its value */
    uint8_t ikind;
    uint8_t global;         /* IK_GLOBAL */
    uint8_t mark;           /* walk: 0 unseen, 1 on the path, 2 done */
    /* a G_STORAGE global and an IK_STORAGE keep their dtype in v.dtype, an
     * IK_STORAGE its element count in v.i and its bytes in v.data */
    int64_t nitems, cap; /* v.items: a dict holds 2 items a pair */
    void *owned;         /* string bytes, gathered tensor data */
    ckpt_pkl_node *next;
    int64_t dims[]; /* a tensor's shape (v.shape) */
};

static const struct {
    const char *name;
    ckpt_dtype dt;
} storages[] = {
    {"DoubleStorage", CKPT_F64}, {"FloatStorage", CKPT_F32}, {"HalfStorage", CKPT_F16},
    {"BFloat16Storage", CKPT_BF16}, {"LongStorage", CKPT_I64}, {"IntStorage", CKPT_I32},
    {"ShortStorage", CKPT_I16}, {"CharStorage", CKPT_I8}, {"ByteStorage", CKPT_U8},
    {"BoolStorage", CKPT_BOOL},
};

const char *ckpt__pkl_storage_name(ckpt_dtype dt) {
    for (size_t i = 0; i < sizeof storages / sizeof storages[0]; i++)
        if (storages[i].dt == dt) return storages[i].name;
    return NULL;
}

void ckpt__pkl_arena_free(ckpt_pkl_arena *a) {
    ckpt_pkl_node *n = a->head;
    while (n) {
        ckpt_pkl_node *next = n->next;
        free((void *)n->v.items);
        free(n->owned);
        free(n);
        n = next;
    }
    a->head = NULL;
}

/* ---- the machine --------------------------------------------------------- */

typedef struct vm {
    ckpt_pkl_arena *a;
    const uint8_t *p;
    size_t n, pos;
    const char *name;
    ckpt_pkl_storage_fn storage;
    void *ctx;
    ckpt_pkl_node **stack;
    size_t sp, scap;
    size_t *marks;
    size_t mp, mcap;
    ckpt_pkl_node **memo;
    size_t memo_cap;
    size_t memo_count; /* entries set, for MEMOIZE */
    uint64_t used, budget; /* bytes charged so far, most allowed */
    int fail;              /* why node_new last returned NULL */
    /* the immutable values pickles repeat, made once each: None, the
     * booleans, the empty tuple and the ints 0..65535 (BININT1, BININT2) */
    ckpt_pkl_node *none, *boolean[2], *empty_tuple, **small_int;
} vm;

static int bad(vm *m, const char *fmt, ...) CKPT_PRINTF(2, 3);
static int bad(vm *m, const char *fmt, ...) {
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    return ckpt__err(CKPT_ECORRUPT, "%s: data.pkl at byte %zu: %s", m->name, m->pos, msg);
}

uint64_t ckpt__pkl_mem_budget(uint64_t n) {
    if (n > CKPT_PKL_MEM_CAP / CKPT_PKL_MEM_PER_BYTE) return CKPT_PKL_MEM_CAP;
    uint64_t b = n * CKPT_PKL_MEM_PER_BYTE;
    return b < CKPT_PKL_MEM_FLOOR ? CKPT_PKL_MEM_FLOOR : b;
}

/* Charges bytes against the pickle's budget before they are allocated. */
static int charge(vm *m, uint64_t bytes, const char *what_) {
    if (bytes <= m->budget - m->used) {
        m->used += bytes;
        return CKPT_OK;
    }
    return ckpt__err(CKPT_EUNSUPPORTED,
                     "%s: data.pkl at byte %zu: its objects need more than %" PRIu64
                     " MiB of memory (at %s), the most a pickle of %zu bytes may use (%u bytes "
                     "per byte, at least %" PRIu64 " MiB, at most %" PRIu64 " MiB)",
                     m->name, m->pos, m->budget >> 20, what_, m->n, CKPT_PKL_MEM_PER_BYTE,
                     CKPT_PKL_MEM_FLOOR >> 20, CKPT_PKL_MEM_CAP >> 20);
}

/* A new node in the arena with room for ndims sizes; NULL with the error in
 * m->fail. Charged with the allocator's header. */
static ckpt_pkl_node *node_alloc(vm *m, ckpt_torch_kind kind, size_t ndims) {
    size_t size = sizeof(ckpt_pkl_node) + ndims * sizeof(int64_t);
    m->fail = charge(m, (size + 31) / 16 * 16, "an object");
    if (m->fail < 0) return NULL;
    ckpt_pkl_node *nd = ckpt__calloc(1, size);
    if (!nd) {
        m->fail = ckpt__err_nomem("unpickler");
        return NULL;
    }
    nd->v.kind = kind;
    nd->next = m->a->head;
    m->a->head = nd;
    return nd;
}

static ckpt_pkl_node *node_new(vm *m, ckpt_torch_kind kind) { return node_alloc(m, kind, 0); }

/* One of the immutable values a pickle repeats: made on first use, then
 * shared (nothing changes a leaf or an empty tuple once made). */
static ckpt_pkl_node *shared(vm *m, ckpt_pkl_node **slot, ckpt_torch_kind kind) {
    if (!*slot) *slot = node_new(m, kind);
    return *slot;
}

static int push(vm *m, ckpt_pkl_node *nd) {
    if (!nd) return m->fail; /* node_new failed */
    if (m->sp == m->scap) {
        size_t cap = m->scap ? m->scap * 2 : 64;
        CKPT_TRY(charge(m, (cap - m->scap) * sizeof *m->stack, "the stack"));
        void *s = ckpt__realloc(m->stack, cap * sizeof *m->stack);
        if (!s) return ckpt__err_nomem("unpickler stack");
        m->stack = s;
        m->scap = cap;
    }
    m->stack[m->sp++] = nd;
    return CKPT_OK;
}

static int push_bool(vm *m, bool b) {
    ckpt_pkl_node *nd = shared(m, &m->boolean[b], CKPT_TORCH_BOOL);
    if (nd) nd->v.b = b;
    return push(m, nd);
}

static size_t base_of_frame(const vm *m) { return m->mp ? m->marks[m->mp - 1] : 0; }

static int pop(vm *m, ckpt_pkl_node **out, const char *op) {
    if (m->sp <= base_of_frame(m)) return bad(m, "%s on an empty stack", op);
    *out = m->stack[--m->sp];
    return CKPT_OK;
}

static int top(vm *m, ckpt_pkl_node **out, const char *op) {
    if (m->sp <= base_of_frame(m)) return bad(m, "%s on an empty stack", op);
    *out = m->stack[m->sp - 1];
    return CKPT_OK;
}

/* Pops everything above the innermost mark: items in [*first, m->sp). */
static int pop_mark(vm *m, size_t *first, const char *op) {
    if (!m->mp) return bad(m, "%s without a MARK", op);
    *first = m->marks[--m->mp];
    return CKPT_OK;
}

/* Room for more items in c: exactly `more` for a container that has none
 * yet (a tuple is made whole), else at least double. */
static int reserve(vm *m, ckpt_pkl_node *c, size_t more) {
    if ((uint64_t)(c->cap - c->nitems) >= more) return CKPT_OK;
    uint64_t want = (uint64_t)c->nitems + more, cap = c->cap ? (uint64_t)c->cap * 2 : 0;
    if (cap < want) cap = want;
    if (cap > m->n && want <= m->n) cap = m->n; /* each item took a byte at least */
    CKPT_TRY(charge(m, (cap - (uint64_t)c->cap) * sizeof *c->v.items, "a container's items"));
    void *p = ckpt__realloc((void *)c->v.items, (size_t)cap * sizeof *c->v.items);
    if (!p) return ckpt__err_nomem("unpickler container");
    c->v.items = p;
    c->cap = (int64_t)cap;
    return CKPT_OK;
}

static int add_item(vm *m, ckpt_pkl_node *c, ckpt_pkl_node *it) {
    CKPT_TRY(reserve(m, c, 1));
    ((ckpt_torch_value **)c->v.items)[c->nitems++] = &it->v;
    c->v.n = c->v.kind == CKPT_TORCH_DICT ? c->nitems / 2 : c->nitems;
    return CKPT_OK;
}

static const char *what(const ckpt_pkl_node *nd) {
    if (nd->ikind == IK_GLOBAL) return "a global";
    if (nd->ikind == IK_STORAGE) return "a storage";
    return ckpt_torch_kind_name(nd->v.kind);
}

static int need(vm *m, size_t k, const char *op) {
    if (m->n - m->pos < k) return bad(m, "%s runs past the end of the pickle", op);
    return CKPT_OK;
}

static uint64_t le(const uint8_t *p, int k) {
    uint64_t v = 0;
    for (int i = k - 1; i >= 0; i--) v = v << 8 | p[i];
    return v;
}


/* A str (utf8) or bytes value of len bytes at the current position. */
static int push_text(vm *m, uint64_t len, bool utf8, const char *op) {
    if (len > m->n - m->pos) return bad(m, "%s of %" PRIu64 " bytes runs past the end", op, len);
    const uint8_t *s = m->p + m->pos;
    if (utf8 && !ckpt__utf8_valid(s, (size_t)len)) return bad(m, "%s is not valid UTF-8", op);
    ckpt_pkl_node *nd = node_new(m, utf8 ? CKPT_TORCH_STR : CKPT_TORCH_BYTES);
    if (!nd) return m->fail;
    CKPT_TRY(charge(m, (len + 1 + 31) / 16 * 16, "a string"));
    char *copy = ckpt__malloc((size_t)len + 1);
    if (!copy) return ckpt__err_nomem("unpickler string");
    memcpy(copy, s, (size_t)len);
    copy[len] = '\0';
    nd->owned = copy;
    nd->v.s = copy;
    nd->v.len = (size_t)len;
    m->pos += (size_t)len;
    return push(m, nd);
}

#define SMALL_INTS 65536

static int push_int(vm *m, int64_t v) {
    if (v < 0 || v >= SMALL_INTS) {
        ckpt_pkl_node *nd = node_new(m, CKPT_TORCH_INT);
        if (nd) nd->v.i = v;
        return push(m, nd);
    }
    if (!m->small_int) {
        CKPT_TRY(charge(m, SMALL_INTS * sizeof *m->small_int, "the table of small ints"));
        m->small_int = ckpt__calloc(SMALL_INTS, sizeof *m->small_int);
        if (!m->small_int) return ckpt__err_nomem("unpickler ints");
    }
    ckpt_pkl_node *nd = shared(m, &m->small_int[v], CKPT_TORCH_INT);
    if (nd) nd->v.i = v;
    return push(m, nd);
}

/* LONG1 / LONG4: little-endian two's complement of k bytes. */
static int push_long(vm *m, uint64_t k, const char *op) {
    if (k > m->n - m->pos) return bad(m, "%s of %" PRIu64 " bytes runs past the end", op, k);
    const uint8_t *b = m->p + m->pos;
    uint64_t u = 0;
    if (k > 0) {
        uint64_t take = k < 8 ? k : 8;
        u = le(b, (int)take);
        bool neg = b[k - 1] & 0x80;
        if (k < 8 && neg) u |= ~(uint64_t)0 << (8 * k);
        /* bytes past the eighth must only extend the sign */
        for (uint64_t i = 8; i < k; i++)
            if (b[i] != (((u >> 63) & 1) ? 0xff : 0x00))
                return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: an integer wider "
                                 "than 64 bits", m->name, m->pos);
    }
    m->pos += (size_t)k;
    return push_int(m, (int64_t)u);
}

static int memo_put(vm *m, uint64_t idx) {
    /* writers number memo entries from 0 and each put costs at least two
     * bytes, so an index as large as the pickle is not a real one */
    if (idx >= m->n) return bad(m, "memo index %" PRIu64 " too large", idx);
    ckpt_pkl_node *t = NULL;
    CKPT_TRY(top(m, &t, "BINPUT"));
    if (idx >= m->memo_cap) {
        size_t cap = m->memo_cap ? m->memo_cap : 64;
        while (cap <= idx) cap *= 2;
        if (cap > m->n) cap = m->n;
        CKPT_TRY(charge(m, (cap - m->memo_cap) * sizeof *m->memo, "the memo"));
        void *p = ckpt__realloc(m->memo, cap * sizeof *m->memo);
        if (!p) return ckpt__err_nomem("unpickler memo");
        memset((ckpt_pkl_node **)p + m->memo_cap, 0, (cap - m->memo_cap) * sizeof *m->memo);
        m->memo = p;
        m->memo_cap = cap;
    }
    if (!m->memo[idx]) m->memo_count++;
    m->memo[idx] = t;
    return CKPT_OK;
}

static int memo_get(vm *m, uint64_t idx) {
    if (idx >= m->memo_cap || !m->memo[idx])
        return bad(m, "memo index %" PRIu64 " was never set", idx);
    return push(m, m->memo[idx]);
}

/* GLOBAL / STACK_GLOBAL: only the allow-list. */
static int push_global(vm *m, const char *mod, const char *name) {
    int g = 0;
    ckpt_dtype dt = CKPT_DTYPE_INVALID;
    if (!strcmp(mod, "torch._utils") && !strcmp(name, "_rebuild_tensor_v2")) g = G_REBUILD_V2;
    else if (!strcmp(mod, "torch._utils") && !strcmp(name, "_rebuild_parameter"))
        g = G_REBUILD_PARAM;
    else if (!strcmp(mod, "collections") && !strcmp(name, "OrderedDict")) g = G_ODICT;
    /* protocol 2 pickles a set as set(list) */
    else if ((!strcmp(mod, "__builtin__") || !strcmp(mod, "builtins")) &&
             (!strcmp(name, "set") || !strcmp(name, "frozenset")))
        g = G_SET;
    else if (!strcmp(mod, "torch")) {
        for (size_t i = 0; i < sizeof storages / sizeof storages[0]; i++)
            if (!strcmp(name, storages[i].name)) g = G_STORAGE, dt = storages[i].dt;
    }
    if (!g)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: data.pkl at byte %zu: global '%s.%s' is not allowed (only tensor "
                         "rebuilds, typed storages, OrderedDict and set); nothing was run",
                         m->name, m->pos, mod, name);
    ckpt_pkl_node *nd = node_new(m, CKPT_TORCH_NONE);
    if (!nd) return m->fail;
    nd->ikind = IK_GLOBAL;
    nd->global = g;
    nd->v.dtype = dt;
    return push(m, nd);
}

static int read_line(vm *m, char *buf, size_t cap) {
    size_t i = 0;
    while (m->pos < m->n && m->p[m->pos] != '\n') {
        if (i + 1 >= cap) return bad(m, "GLOBAL name longer than %zu bytes", cap - 1);
        char c = (char)m->p[m->pos++];
        if (c == '\0') return bad(m, "NUL in a GLOBAL name");
        buf[i++] = c;
    }
    if (m->pos >= m->n) return bad(m, "GLOBAL runs past the end of the pickle");
    m->pos++;
    buf[i] = '\0';
    return CKPT_OK;
}

static const char *global_name(const ckpt_pkl_node *g) {
    switch (g->global) {
    case G_REBUILD_V2: return "torch._utils._rebuild_tensor_v2";
    case G_REBUILD_PARAM: return "torch._utils._rebuild_parameter";
    case G_ODICT: return "collections.OrderedDict";
    case G_SET: return "set";
    default: return "a torch storage class";
    }
}

static bool is_int(const ckpt_torch_value *v) { return v->kind == CKPT_TORCH_INT; }

/* BINPERSID: ('storage', <storage class>, key, location, numel). */
static int persistent_load(vm *m, ckpt_pkl_node *pid) {
    const ckpt_torch_value *t = &pid->v;
    if (pid->ikind || t->kind != CKPT_TORCH_TUPLE || t->n != 5)
        return bad(m, "persistent id is %s, not a 5-tuple ('storage', type, key, location, numel)",
                   what(pid));
    const ckpt_pkl_node *tag = (const ckpt_pkl_node *)t->items[0];
    const ckpt_pkl_node *cls = (const ckpt_pkl_node *)t->items[1];
    const ckpt_torch_value *key = t->items[2], *numel = t->items[4];
    if (tag->ikind || tag->v.kind != CKPT_TORCH_STR || strcmp(tag->v.s, "storage") != 0)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: persistent id of a kind "
                         "other than 'storage'", m->name, m->pos);
    if (cls->ikind != IK_GLOBAL || cls->global != G_STORAGE)
        return bad(m, "persistent id names %s, not a storage class", what(cls));
    if (key->kind != CKPT_TORCH_STR || !is_int(numel) || numel->i < 0)
        return bad(m, "persistent id with a bad key or element count");
    if (((const ckpt_pkl_node *)t->items[3])->v.kind != CKPT_TORCH_STR)
        return bad(m, "persistent id with a bad location");
    const uint8_t *data = NULL;
    CKPT_TRY(m->storage(m->ctx, key->s, cls->v.dtype, numel->i, &data));
    ckpt_pkl_node *st = node_new(m, CKPT_TORCH_NONE);
    if (!st) return m->fail;
    st->ikind = IK_STORAGE;
    st->v.dtype = cls->v.dtype;
    st->v.i = numel->i;
    st->v.data = data;
    st->v.s = key->s; /* for messages; the key's node lives in the arena too */
    return push(m, st);
}

static int int_tuple(vm *m, const ckpt_torch_value *t, int64_t *out, const char *what_) {
    if (t->kind != CKPT_TORCH_TUPLE) return bad(m, "tensor %s is not a tuple", what_);
    if (t->n > CKPT_MAX_NDIM)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: a tensor of %" PRId64 " dimensions (at most %d)",
                         m->name, t->n, CKPT_MAX_NDIM);
    for (int64_t i = 0; i < t->n; i++) {
        if (!is_int(t->items[i]) || t->items[i]->i < 0)
            return bad(m, "tensor %s holds something other than a non-negative int", what_);
        out[i] = t->items[i]->i;
    }
    return CKPT_OK;
}

/* _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) */
static int rebuild_tensor(vm *m, const ckpt_torch_value *args) {
    if (args->kind != CKPT_TORCH_TUPLE || (args->n != 6 && args->n != 7))
        return bad(m, "_rebuild_tensor_v2 takes 6 or 7 arguments");
    const ckpt_pkl_node *st = (const ckpt_pkl_node *)args->items[0];
    if (st->ikind != IK_STORAGE) return bad(m, "_rebuild_tensor_v2 of %s, not a storage", what(st));
    const ckpt_torch_value *off = args->items[1], *rg = args->items[4], *hooks = args->items[5];
    if (!is_int(off) || off->i < 0)
        return bad(m, "tensor storage offset is not a non-negative int");
    if (rg->kind != CKPT_TORCH_BOOL) return bad(m, "tensor requires_grad is not a bool");
    if (hooks->kind != CKPT_TORCH_DICT) return bad(m, "tensor backward hooks are not a dict");
    if (hooks->n)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: a tensor with backward hooks", m->name);
    const ckpt_torch_value *size = args->items[2];
    if (size->kind != CKPT_TORCH_TUPLE) return bad(m, "tensor size is not a tuple");
    if (size->n > CKPT_MAX_NDIM)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: a tensor of %" PRId64 " dimensions (at most %d)",
                         m->name, size->n, CKPT_MAX_NDIM);
    ckpt_pkl_node *nd = node_alloc(m, CKPT_TORCH_TENSOR, (size_t)size->n);
    if (!nd) return m->fail;
    int64_t stride[CKPT_MAX_NDIM];
    CKPT_TRY(int_tuple(m, size, nd->dims, "size"));
    CKPT_TRY(int_tuple(m, args->items[3], stride, "stride"));
    int nd_ = (int)size->n;
    if (args->items[3]->n != nd_) return bad(m, "tensor size and stride differ in length");
    nd->v.shape = nd->dims;
    nd->v.ndim = nd_;
    nd->v.dtype = st->v.dtype;
    nd->v.requires_grad = rg->b;
    if (ckpt_tensor_nbytes(st->v.dtype, nd_, nd->dims, &nd->v.nbytes) < 0)
        return bad(m, "tensor too large");
    size_t es = (size_t)ckpt_dtype_bits(st->v.dtype) / 8;
    uint64_t numel = nd->v.nbytes / es;
    if (numel == 0) {
        nd->v.data = st->v.data;
        return push(m, nd);
    }
    /* the last element's index must lie inside the storage */
    uint64_t last = (uint64_t)off->i;
    bool contiguous = true;
    uint64_t expect = 1;
    for (int d = nd_ - 1; d >= 0; d--) {
        uint64_t span = 0;
        if (__builtin_mul_overflow((uint64_t)(nd->v.shape[d] - 1), (uint64_t)stride[d], &span) ||
            __builtin_add_overflow(last, span, &last))
            return bad(m, "tensor extent overflows");
        if (nd->v.shape[d] != 1 && (uint64_t)stride[d] != expect) contiguous = false;
        expect *= (uint64_t)nd->v.shape[d];
    }
    const uint8_t *sdata = st->v.data;
    if (last >= (uint64_t)st->v.i)
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: storage '%s' has %" PRId64 " elements, a tensor "
                         "needs element %" PRIu64,
                         m->name, st->v.s, st->v.i, last);
    if (contiguous) {
        nd->v.data = sdata + (uint64_t)off->i * es;
        return push(m, nd);
    }
    if (m->a->gathered + nd->v.nbytes > m->a->gather_limit)
        return ckpt__err(CKPT_ECORRUPT, "%s: strided tensors expand to more than %" PRIu64
                         " bytes", m->name, m->a->gather_limit);
    m->a->gathered += nd->v.nbytes;
    uint8_t *dst = ckpt__malloc((size_t)nd->v.nbytes);
    if (!dst) return ckpt__err_nomem("strided tensor");
    nd->owned = dst;
    int64_t idx[CKPT_MAX_NDIM] = {0};
    for (uint64_t e = 0; e < numel; e++) {
        uint64_t src = (uint64_t)off->i;
        for (int d = 0; d < nd_; d++) src += (uint64_t)idx[d] * (uint64_t)stride[d];
        memcpy(dst + e * es, sdata + src * es, es);
        for (int d = nd_ - 1; d >= 0; d--) {
            if (++idx[d] < nd->dims[d]) break;
            idx[d] = 0;
        }
    }
    nd->v.data = dst;
    return push(m, nd);
}

static bool hashable(const ckpt_pkl_node *k) {
    if (k->ikind) return false;
    switch (k->v.kind) {
    case CKPT_TORCH_LIST: case CKPT_TORCH_DICT: case CKPT_TORCH_SET: return false;
    default: return true;
    }
}

static int reduce(vm *m) {
    ckpt_pkl_node *args = NULL, *fn = NULL;
    CKPT_TRY(pop(m, &args, "REDUCE"));
    CKPT_TRY(pop(m, &fn, "REDUCE"));
    if (fn->ikind != IK_GLOBAL)
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: REDUCE of %s, which is "
                         "not an allowed callable", m->name, m->pos, what(fn));
    if (args->ikind || args->v.kind != CKPT_TORCH_TUPLE)
        return bad(m, "REDUCE arguments are not a tuple");
    switch (fn->global) {
    case G_REBUILD_V2: return rebuild_tensor(m, &args->v);
    case G_REBUILD_PARAM: {
        const ckpt_torch_value *a = &args->v;
        if (a->n != 3 || a->items[0]->kind != CKPT_TORCH_TENSOR ||
            a->items[1]->kind != CKPT_TORCH_BOOL || a->items[2]->kind != CKPT_TORCH_DICT)
            return bad(m, "_rebuild_parameter takes (tensor, requires_grad, hooks)");
        ckpt_pkl_node *nd = node_new(m, CKPT_TORCH_TENSOR);
        if (!nd) return m->fail;
        nd->v = *a->items[0];
        nd->v.requires_grad = a->items[1]->b;
        nd->v.parameter = true;
        return push(m, nd);
    }
    case G_ODICT: {
        if (args->v.n != 0)
            return ckpt__err(CKPT_EUNSUPPORTED, "%s: OrderedDict built from arguments", m->name);
        ckpt_pkl_node *nd = node_new(m, CKPT_TORCH_DICT);
        if (nd) nd->v.ordered = true;
        return push(m, nd);
    }
    case G_SET: {
        const ckpt_torch_value *a = &args->v;
        if (a->n > 1 || (a->n == 1 && a->items[0]->kind != CKPT_TORCH_LIST))
            return bad(m, "set() takes one list");
        ckpt_pkl_node *nd = node_new(m, CKPT_TORCH_SET);
        if (!nd) return m->fail;
        const ckpt_pkl_node *l = a->n ? (const ckpt_pkl_node *)a->items[0] : NULL;
        if (l) CKPT_TRY(reserve(m, nd, (size_t)l->nitems));
        for (int64_t i = 0; l && i < l->nitems; i++) {
            if (!hashable((const ckpt_pkl_node *)l->v.items[i]))
                return bad(m, "set item is not hashable");
            CKPT_TRY(add_item(m, nd, (ckpt_pkl_node *)l->v.items[i]));
        }
        return push(m, nd);
    }
    default:
        return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: REDUCE of %s is not allowed",
                         m->name, m->pos, global_name(fn));
    }
}

static int set_items(vm *m, ckpt_pkl_node *d, size_t first, const char *op) {
    if (d->ikind || d->v.kind != CKPT_TORCH_DICT)
        return bad(m, "%s on %s, not a dict", op, what(d));
    if ((m->sp - first) % 2) return bad(m, "%s with an odd number of items", op);
    CKPT_TRY(reserve(m, d, m->sp - first));
    for (size_t i = first; i < m->sp; i += 2) {
        if (!hashable(m->stack[i])) return bad(m, "%s: dict key is %s", op, what(m->stack[i]));
        CKPT_TRY(add_item(m, d, m->stack[i]));
        CKPT_TRY(add_item(m, d, m->stack[i + 1]));
    }
    m->sp = first;
    return CKPT_OK;
}

static int append_items(vm *m, ckpt_pkl_node *l, size_t first, ckpt_torch_kind kind,
                        const char *op) {
    if (l->ikind || l->v.kind != kind)
        return bad(m, "%s on %s, not a %s", op, what(l), ckpt_torch_kind_name(kind));
    CKPT_TRY(reserve(m, l, m->sp - first));
    for (size_t i = first; i < m->sp; i++) {
        if (kind == CKPT_TORCH_SET && !hashable(m->stack[i]))
            return bad(m, "%s: set item is %s", op, what(m->stack[i]));
        CKPT_TRY(add_item(m, l, m->stack[i]));
    }
    m->sp = first;
    return CKPT_OK;
}

static int make_seq(vm *m, ckpt_torch_kind kind, size_t first) {
    if (kind == CKPT_TORCH_TUPLE && first == m->sp)
        return push(m, shared(m, &m->empty_tuple, CKPT_TORCH_TUPLE));
    ckpt_pkl_node *t = node_new(m, kind);
    if (!t) return m->fail;
    CKPT_TRY(reserve(m, t, m->sp - first));
    for (size_t i = first; i < m->sp; i++) CKPT_TRY(add_item(m, t, m->stack[i]));
    m->sp = first;
    return push(m, t);
}

static int run(vm *m) {
    for (;;) {
        if (m->pos >= m->n) return bad(m, "pickle ends without STOP");
        uint8_t op = m->p[m->pos++];
        ckpt_pkl_node *a = NULL, *b = NULL;
        size_t first = 0;
        switch (op) {
        case 0x80: /* PROTO */
            CKPT_TRY(need(m, 1, "PROTO"));
            if (m->p[m->pos] < 2 || m->p[m->pos] > 5)
                return ckpt__err(CKPT_EUNSUPPORTED, "%s: pickle protocol %u (2 to 5 are read)",
                                 m->name, m->p[m->pos]);
            m->pos++;
            break;
        case 0x95: /* FRAME: a length hint only */
            CKPT_TRY(need(m, 8, "FRAME"));
            m->pos += 8;
            break;
        case '.': /* STOP */
            if (m->mp) return bad(m, "STOP with an open MARK");
            if (m->sp != 1) return bad(m, "STOP with %zu objects on the stack, not 1", m->sp);
            return CKPT_OK;
        case '(': /* MARK */
            if (m->mp == m->mcap) {
                size_t cap = m->mcap ? m->mcap * 2 : 16;
                CKPT_TRY(charge(m, (cap - m->mcap) * sizeof *m->marks, "the marks"));
                void *p = ckpt__realloc(m->marks, cap * sizeof *m->marks);
                if (!p) return ckpt__err_nomem("unpickler marks");
                m->marks = p;
                m->mcap = cap;
            }
            m->marks[m->mp++] = m->sp;
            break;
        case 'N': CKPT_TRY(push(m, shared(m, &m->none, CKPT_TORCH_NONE))); break;
        case 0x88: /* NEWTRUE */
        case 0x89: /* NEWFALSE */ CKPT_TRY(push_bool(m, op == 0x88)); break;
        case 'K':
            CKPT_TRY(need(m, 1, "BININT1"));
            CKPT_TRY(push_int(m, m->p[m->pos]));
            m->pos += 1;
            break;
        case 'M':
            CKPT_TRY(need(m, 2, "BININT2"));
            CKPT_TRY(push_int(m, (int64_t)le(m->p + m->pos, 2)));
            m->pos += 2;
            break;
        case 'J':
            CKPT_TRY(need(m, 4, "BININT"));
            CKPT_TRY(push_int(m, (int32_t)(uint32_t)le(m->p + m->pos, 4)));
            m->pos += 4;
            break;
        case 0x8a: /* LONG1 */
            CKPT_TRY(need(m, 1, "LONG1"));
            m->pos++;
            CKPT_TRY(push_long(m, m->p[m->pos - 1], "LONG1"));
            break;
        case 0x8b: /* LONG4 */
            CKPT_TRY(need(m, 4, "LONG4"));
            m->pos += 4;
            CKPT_TRY(push_long(m, le(m->p + m->pos - 4, 4), "LONG4"));
            break;
        case 'G': { /* BINFLOAT, big-endian */
            CKPT_TRY(need(m, 8, "BINFLOAT"));
            uint64_t u = 0;
            for (int i = 0; i < 8; i++) u = u << 8 | m->p[m->pos + (size_t)i];
            m->pos += 8;
            a = node_new(m, CKPT_TORCH_FLOAT);
            if (a) memcpy(&a->v.f, &u, 8);
            CKPT_TRY(push(m, a));
            break;
        }
        case 'X': /* BINUNICODE */
            CKPT_TRY(need(m, 4, "BINUNICODE"));
            m->pos += 4;
            CKPT_TRY(push_text(m, le(m->p + m->pos - 4, 4), true, "BINUNICODE"));
            break;
        case 0x8c: /* SHORT_BINUNICODE */
            CKPT_TRY(need(m, 1, "SHORT_BINUNICODE"));
            m->pos++;
            CKPT_TRY(push_text(m, m->p[m->pos - 1], true, "SHORT_BINUNICODE"));
            break;
        case 0x8d: /* BINUNICODE8 */
            CKPT_TRY(need(m, 8, "BINUNICODE8"));
            m->pos += 8;
            CKPT_TRY(push_text(m, le(m->p + m->pos - 8, 8), true, "BINUNICODE8"));
            break;
        case 'U': /* SHORT_BINSTRING: a Python 2 str, read as text */
            CKPT_TRY(need(m, 1, "SHORT_BINSTRING"));
            m->pos++;
            CKPT_TRY(push_text(m, m->p[m->pos - 1], true, "SHORT_BINSTRING"));
            break;
        case 'C': /* SHORT_BINBYTES */
            CKPT_TRY(need(m, 1, "SHORT_BINBYTES"));
            m->pos++;
            CKPT_TRY(push_text(m, m->p[m->pos - 1], false, "SHORT_BINBYTES"));
            break;
        case 'B': /* BINBYTES */
            CKPT_TRY(need(m, 4, "BINBYTES"));
            m->pos += 4;
            CKPT_TRY(push_text(m, le(m->p + m->pos - 4, 4), false, "BINBYTES"));
            break;
        case 0x8e: /* BINBYTES8 */
            CKPT_TRY(need(m, 8, "BINBYTES8"));
            m->pos += 8;
            CKPT_TRY(push_text(m, le(m->p + m->pos - 8, 8), false, "BINBYTES8"));
            break;
        case ')': CKPT_TRY(push(m, shared(m, &m->empty_tuple, CKPT_TORCH_TUPLE))); break;
        case ']': CKPT_TRY(push(m, node_new(m, CKPT_TORCH_LIST))); break;
        case '}': CKPT_TRY(push(m, node_new(m, CKPT_TORCH_DICT))); break;
        case 0x8f: CKPT_TRY(push(m, node_new(m, CKPT_TORCH_SET))); break; /* EMPTY_SET */
        case 't':
            CKPT_TRY(pop_mark(m, &first, "TUPLE"));
            CKPT_TRY(make_seq(m, CKPT_TORCH_TUPLE, first));
            break;
        case 0x91: /* FROZENSET */
            CKPT_TRY(pop_mark(m, &first, "FROZENSET"));
            for (size_t i = first; i < m->sp; i++)
                if (!hashable(m->stack[i]))
                    return bad(m, "FROZENSET item is %s", what(m->stack[i]));
            CKPT_TRY(make_seq(m, CKPT_TORCH_SET, first));
            break;
        case 0x85: case 0x86: case 0x87: { /* TUPLE1..3 */
            size_t k = (size_t)(op - 0x84);
            if (m->sp - base_of_frame(m) < k) return bad(m, "TUPLE%zu on a short stack", k);
            CKPT_TRY(make_seq(m, CKPT_TORCH_TUPLE, m->sp - k));
            break;
        }
        case 'a': /* APPEND */
            CKPT_TRY(pop(m, &a, "APPEND"));
            CKPT_TRY(top(m, &b, "APPEND"));
            if (b->ikind || b->v.kind != CKPT_TORCH_LIST) return bad(m, "APPEND to %s", what(b));
            CKPT_TRY(add_item(m, b, a));
            break;
        case 'e': /* APPENDS */
            CKPT_TRY(pop_mark(m, &first, "APPENDS"));
            if (first == base_of_frame(m)) return bad(m, "APPENDS with no list below its MARK");
            CKPT_TRY(append_items(m, m->stack[first - 1], first, CKPT_TORCH_LIST, "APPENDS"));
            break;
        case 0x90: /* ADDITEMS */
            CKPT_TRY(pop_mark(m, &first, "ADDITEMS"));
            if (first == base_of_frame(m)) return bad(m, "ADDITEMS with no set below its MARK");
            CKPT_TRY(append_items(m, m->stack[first - 1], first, CKPT_TORCH_SET, "ADDITEMS"));
            break;
        case 's': { /* SETITEM */
            if (m->sp - base_of_frame(m) < 3) return bad(m, "SETITEM on a short stack");
            CKPT_TRY(set_items(m, m->stack[m->sp - 3], m->sp - 2, "SETITEM"));
            break;
        }
        case 'u': /* SETITEMS */
            CKPT_TRY(pop_mark(m, &first, "SETITEMS"));
            if (first == base_of_frame(m)) return bad(m, "SETITEMS with no dict below its MARK");
            CKPT_TRY(set_items(m, m->stack[first - 1], first, "SETITEMS"));
            break;
        case 'q':
            CKPT_TRY(need(m, 1, "BINPUT"));
            m->pos++;
            CKPT_TRY(memo_put(m, m->p[m->pos - 1]));
            break;
        case 'r':
            CKPT_TRY(need(m, 4, "LONG_BINPUT"));
            m->pos += 4;
            CKPT_TRY(memo_put(m, le(m->p + m->pos - 4, 4)));
            break;
        case 0x94: /* MEMOIZE: index = entries so far */
            CKPT_TRY(memo_put(m, m->memo_count));
            break;
        case 'h':
            CKPT_TRY(need(m, 1, "BINGET"));
            m->pos++;
            CKPT_TRY(memo_get(m, m->p[m->pos - 1]));
            break;
        case 'j':
            CKPT_TRY(need(m, 4, "LONG_BINGET"));
            m->pos += 4;
            CKPT_TRY(memo_get(m, le(m->p + m->pos - 4, 4)));
            break;
        case 'c': { /* GLOBAL */
            char mod[128], name[128];
            CKPT_TRY(read_line(m, mod, sizeof mod));
            CKPT_TRY(read_line(m, name, sizeof name));
            CKPT_TRY(push_global(m, mod, name));
            break;
        }
        case 0x93: /* STACK_GLOBAL */
            CKPT_TRY(pop(m, &b, "STACK_GLOBAL"));
            CKPT_TRY(pop(m, &a, "STACK_GLOBAL"));
            if (a->ikind || b->ikind || a->v.kind != CKPT_TORCH_STR ||
                b->v.kind != CKPT_TORCH_STR || strlen(a->v.s) != a->v.len ||
                strlen(b->v.s) != b->v.len)
                return bad(m, "STACK_GLOBAL of something other than two strings");
            CKPT_TRY(push_global(m, a->v.s, b->v.s));
            break;
        case 'Q': /* BINPERSID */
            CKPT_TRY(pop(m, &a, "BINPERSID"));
            CKPT_TRY(persistent_load(m, a));
            break;
        case 'R': CKPT_TRY(reduce(m)); break;
        case 'b': /* BUILD: only the attributes of an OrderedDict (_metadata), ignored */
            CKPT_TRY(pop(m, &a, "BUILD"));
            CKPT_TRY(top(m, &b, "BUILD"));
            if (b->ikind || b->v.kind != CKPT_TORCH_DICT || !b->v.ordered)
                return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: BUILD of %s (only "
                                 "an OrderedDict's attributes are accepted)", m->name, m->pos,
                                 what(b));
            if (a->ikind || (a->v.kind != CKPT_TORCH_DICT && a->v.kind != CKPT_TORCH_TUPLE))
                return bad(m, "BUILD state is %s", what(a));
            break;
        default: {
            static const struct {
                uint8_t op;
                const char *name;
            } known[] = {{'0', "POP"},         {'1', "POP_MARK"},     {'2', "DUP"},
                         {'F', "FLOAT"},       {'I', "INT"},          {'L', "LONG"},
                         {'P', "PERSID"},      {'S', "STRING"},       {'V', "UNICODE"},
                         {'T', "BINSTRING"},   {'d', "DICT"},         {'g', "GET"},
                         {'i', "INST"},        {'l', "LIST"},         {'o', "OBJ"},
                         {'p', "PUT"},         {0x81, "NEWOBJ"},      {0x82, "EXT1"},
                         {0x83, "EXT2"},       {0x84, "EXT4"},        {0x92, "NEWOBJ_EX"},
                         {0x96, "BYTEARRAY8"}, {0x97, "NEXT_BUFFER"}, {0x98, "READONLY_BUFFER"}};
            for (size_t i = 0; i < sizeof known / sizeof known[0]; i++)
                if (known[i].op == op)
                    return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: pickle opcode "
                                     "%s is not allowed", m->name, m->pos - 1, known[i].name);
            return ckpt__err(CKPT_EUNSUPPORTED, "%s: data.pkl at byte %zu: unknown pickle opcode "
                             "0x%02x", m->name, m->pos - 1, op);
        }
        }
    }
}

/* ---- checking the finished object ------------------------------------------ */

static int key_cmp(const void *x, const void *y) {
    const ckpt_torch_value *a = *(ckpt_torch_value *const *)x, *b = *(ckpt_torch_value *const *)y;
    if (a->kind != b->kind) return a->kind < b->kind ? -1 : 1;
    switch (a->kind) {
    case CKPT_TORCH_INT: return a->i < b->i ? -1 : a->i > b->i;
    case CKPT_TORCH_BOOL: return (int)a->b - (int)b->b;
    case CKPT_TORCH_STR:
    case CKPT_TORCH_BYTES: {
        size_t n = a->len < b->len ? a->len : b->len;
        int c = memcmp(a->s, b->s, n);
        return c ? c : (a->len < b->len ? -1 : a->len > b->len);
    }
    case CKPT_TORCH_NONE: return 0;
    default: return a < b ? -1 : a > b; /* other keys: by identity */
    }
}

static int check_keys(const ckpt_torch_value *d, const char *name) {
    if (d->n < 2) return CKPT_OK;
    ckpt_torch_value **keys = ckpt__malloc((size_t)d->n * sizeof *keys);
    if (!keys) return ckpt__err_nomem("dict keys");
    for (int64_t i = 0; i < d->n; i++) keys[i] = d->items[2 * i];
    qsort(keys, (size_t)d->n, sizeof *keys, key_cmp);
    int rc = CKPT_OK;
    for (int64_t i = 0; i + 1 < d->n && rc == 0; i++) {
        if (key_cmp(&keys[i], &keys[i + 1]) == 0 && keys[i]->kind != CKPT_TORCH_FLOAT &&
            keys[i]->kind != CKPT_TORCH_TUPLE && keys[i]->kind != CKPT_TORCH_TENSOR) {
            if (keys[i]->kind == CKPT_TORCH_STR)
                rc = ckpt__err(CKPT_ECORRUPT, "%s: dict key '%s' appears twice", name, keys[i]->s);
            else
                rc = ckpt__err(CKPT_ECORRUPT, "%s: a dict key appears twice", name);
        }
    }
    free(keys);
    return rc;
}

static int walk(ckpt_pkl_node *nd, int depth, const char *name) {
    if (nd->mark == 2) return CKPT_OK;
    if (nd->mark == 1) return ckpt__err(CKPT_ECORRUPT, "%s: a container contains itself", name);
    if (depth > CKPT_TORCH_MAX_DEPTH)
        return ckpt__err(CKPT_ECORRUPT, "%s: nested deeper than %d", name, CKPT_TORCH_MAX_DEPTH);
    if (nd->ikind)
        return ckpt__err(CKPT_ECORRUPT, "%s: %s outside a tensor rebuild", name,
                         nd->ikind == IK_GLOBAL ? "a global" : "a storage");
    nd->mark = 1;
    int64_t items = nd->v.kind == CKPT_TORCH_TENSOR ? 0 : nd->nitems;
    for (int64_t i = 0; i < items; i++)
        CKPT_TRY(walk((ckpt_pkl_node *)nd->v.items[i], depth + 1, name));
    if (nd->v.kind == CKPT_TORCH_DICT) CKPT_TRY(check_keys(&nd->v, name));
    nd->mark = 2;
    return CKPT_OK;
}

int ckpt__unpickle(ckpt_pkl_arena *a, const uint8_t *p, size_t n, const char *name,
                   ckpt_pkl_storage_fn storage, void *ctx, const ckpt_torch_value **root) {
    vm m = {.a = a,
            .p = p,
            .n = n,
            .name = name,
            .storage = storage,
            .ctx = ctx,
            .budget = ckpt__pkl_mem_budget(n)};
    int rc = run(&m);
    if (rc == 0) rc = walk(m.stack[0], 0, name);
    if (rc == 0) *root = &m.stack[0]->v;
    free(m.stack);
    free(m.marks);
    free(m.memo);
    free(m.small_int);
    return rc;
}

/* ---- emitting --------------------------------------------------------------- */

void ckpt__pkl_bytes(ckpt_pkl_buf *b, const void *p, size_t n) {
    if (b->err) return;
    if (b->cap - b->n < n) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap - b->n < n) cap *= 2;
        void *q = ckpt__realloc(b->p, cap);
        if (!q) {
            b->err = ckpt__err_nomem("pickle");
            return;
        }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->n, p, n);
    b->n += n;
}

void ckpt__pkl_byte(ckpt_pkl_buf *b, uint8_t op) { ckpt__pkl_bytes(b, &op, 1); }

void ckpt__pkl_int(ckpt_pkl_buf *b, int64_t v) {
    uint8_t x[10];
    if (v >= 0 && v < 256) {
        x[0] = 'K';
        x[1] = (uint8_t)v;
        ckpt__pkl_bytes(b, x, 2);
    } else if (v >= 0 && v < 65536) {
        x[0] = 'M';
        x[1] = (uint8_t)v;
        x[2] = (uint8_t)(v >> 8);
        ckpt__pkl_bytes(b, x, 3);
    } else if (v >= INT32_MIN && v <= INT32_MAX) {
        x[0] = 'J';
        for (int i = 0; i < 4; i++) x[1 + i] = (uint8_t)((uint64_t)v >> 8 * i);
        ckpt__pkl_bytes(b, x, 5);
    } else {
        x[0] = 0x8a;
        x[1] = 8;
        for (int i = 0; i < 8; i++) x[2 + i] = (uint8_t)((uint64_t)v >> 8 * i);
        ckpt__pkl_bytes(b, x, 10);
    }
}

void ckpt__pkl_uint(ckpt_pkl_buf *b, uint64_t v) {
    if (v <= (uint64_t)INT64_MAX) {
        ckpt__pkl_int(b, (int64_t)v);
        return;
    }
    uint8_t x[11];
    x[0] = 0x8a; /* LONG1: two's complement, so a ninth byte keeps it positive */
    x[1] = 9;
    for (int i = 0; i < 8; i++) x[2 + i] = (uint8_t)(v >> 8 * i);
    x[10] = 0;
    ckpt__pkl_bytes(b, x, 11);
}

void ckpt__pkl_float(ckpt_pkl_buf *b, double v) {
    uint64_t u = 0;
    memcpy(&u, &v, 8);
    uint8_t x[9];
    x[0] = 'G';
    for (int i = 0; i < 8; i++) x[1 + i] = (uint8_t)(u >> (56 - 8 * i));
    ckpt__pkl_bytes(b, x, 9);
}

void ckpt__pkl_str(ckpt_pkl_buf *b, const char *s, size_t n) {
    uint8_t x[5];
    x[0] = 'X';
    for (int i = 0; i < 4; i++) x[1 + i] = (uint8_t)((uint64_t)n >> 8 * i);
    ckpt__pkl_bytes(b, x, 5);
    ckpt__pkl_bytes(b, s, n);
}

void ckpt__pkl_global(ckpt_pkl_buf *b, const char *module, const char *name) {
    ckpt__pkl_byte(b, 'c');
    ckpt__pkl_bytes(b, module, strlen(module));
    ckpt__pkl_byte(b, '\n');
    ckpt__pkl_bytes(b, name, strlen(name));
    ckpt__pkl_byte(b, '\n');
}

void ckpt__pkl_buf_free(ckpt_pkl_buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}
