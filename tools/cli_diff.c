/* cli_diff.c — `ckpt diff`: how two checkpoints, projects or state files
 * differ, tensor by tensor. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "ckpt.h"
#include "cli.h"

static const char diff_help[] =
    "usage: ckpt diff [--atol X] A B\n"
    "\n"
    "Compares two checkpoint folders (every state file) or two .safetensors files,\n"
    "entry by entry: tensors by dtype, shape and value (max absolute difference,\n"
    "elements that differ, the first differing pair), scalar entries by value, and\n"
    "the manifests' step and number of processes (metrics are shown where they\n"
    "differ but are not state: they do not count). A project folder stands for its\n"
    "newest valid checkpoint (printed as 'A: <checkpoint>'). Anything else (an\n"
    "empty folder, a folder without checkpoint.json, another kind of file) is a\n"
    "usage error.\n"
    "Creation times, checkpoint numbers and library versions are not compared.\n"
    "\n"
    "  --atol X   values within X of each other count as equal (default 0: bit for bit)\n"
    "\n"
    "Exit 0 if equal, 1 if they differ, 2 if A or B is not a checkpoint, a project\n"
    "or a state file, 3 if a file cannot be read or a project has no valid checkpoint.\n";

/* ---- diff ----------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    return sign ? -v : v;
}

/* Element i of a tensor as a double; false for dtypes compared by bytes. */
static bool element_value(ckpt_dtype dt, const unsigned char *p, int64_t i, double *out) {
    union {
        float f;
        double d;
        int64_t i64;
        uint64_t u64;
        int32_t i32;
        uint32_t u32;
        int16_t i16;
        uint16_t u16;
    } u;
    switch (dt) {
    case CKPT_F64:
        memcpy(&u.d, p + 8 * i, 8);
        *out = u.d;
        return true;
    case CKPT_F32:
        memcpy(&u.f, p + 4 * i, 4);
        *out = u.f;
        return true;
    case CKPT_F16:
        memcpy(&u.u16, p + 2 * i, 2);
        *out = half_to_float(u.u16);
        return true;
    case CKPT_BF16: {
        uint16_t b;
        memcpy(&b, p + 2 * i, 2);
        u.u32 = (uint32_t)b << 16;
        float f;
        memcpy(&f, &u.u32, 4);
        *out = f;
        return true;
    }
    case CKPT_I64:
        memcpy(&u.i64, p + 8 * i, 8);
        *out = (double)u.i64;
        return true;
    case CKPT_U64:
        memcpy(&u.u64, p + 8 * i, 8);
        *out = (double)u.u64;
        return true;
    case CKPT_I32:
        memcpy(&u.i32, p + 4 * i, 4);
        *out = u.i32;
        return true;
    case CKPT_U32:
        memcpy(&u.u32, p + 4 * i, 4);
        *out = u.u32;
        return true;
    case CKPT_I16:
        memcpy(&u.i16, p + 2 * i, 2);
        *out = u.i16;
        return true;
    case CKPT_U16:
        memcpy(&u.u16, p + 2 * i, 2);
        *out = u.u16;
        return true;
    case CKPT_I8: *out = (int8_t)p[i]; return true;
    case CKPT_U8:
    case CKPT_BOOL: *out = p[i]; return true;
    default: return false;
    }
}

/* Element i of an integer tensor, exactly: signed ones in *s, unsigned in
 * *u. False for other dtypes. */
static bool element_int(ckpt_dtype dt, const unsigned char *p, int64_t i, bool *is_signed,
                        int64_t *s, uint64_t *u) {
    union {
        int64_t i64;
        uint64_t u64;
        int32_t i32;
        uint32_t u32;
        int16_t i16;
        uint16_t u16;
    } v;
    *is_signed = true;
    switch (dt) {
    case CKPT_I64:
        memcpy(&v.i64, p + 8 * i, 8);
        *s = v.i64;
        return true;
    case CKPT_I32:
        memcpy(&v.i32, p + 4 * i, 4);
        *s = v.i32;
        return true;
    case CKPT_I16:
        memcpy(&v.i16, p + 2 * i, 2);
        *s = v.i16;
        return true;
    case CKPT_I8: *s = (int8_t)p[i]; return true;
    default: break;
    }
    *is_signed = false;
    switch (dt) {
    case CKPT_U64:
        memcpy(&v.u64, p + 8 * i, 8);
        *u = v.u64;
        return true;
    case CKPT_U32:
        memcpy(&v.u32, p + 4 * i, 4);
        *u = v.u32;
        return true;
    case CKPT_U16:
        memcpy(&v.u16, p + 2 * i, 2);
        *u = v.u16;
        return true;
    case CKPT_U8:
    case CKPT_BOOL: *u = p[i]; return true;
    default: return false;
    }
}

/* Element i as text: integers as integers, floats as the shortest decimal
 * that reads back to the same value of the tensor's type. */
const char *cli_element_text(ckpt_dtype dt, const unsigned char *p, int64_t i, char *buf, int cap) {
    bool sg;
    int64_t sv;
    uint64_t uv;
    double d = 0;
    if (element_int(dt, p, i, &sg, &sv, &uv)) {
        if (sg) snprintf(buf, (size_t)cap, "%lld", (long long)sv);
        else snprintf(buf, (size_t)cap, "%llu", (unsigned long long)uv);
    } else if (element_value(dt, p, i, &d)) {
        if (dt == CKPT_F64) cli_format_double(d, buf, cap);
        else cli_format_float((float)d, buf, cap);
    } else {
        snprintf(buf, (size_t)cap, "?");
    }
    return buf;
}

typedef struct diff_ctx {
    double atol;
    int64_t differences;
    int64_t tensors, scalars;
} diff_ctx;

static void report(diff_ctx *d, const char *file, const char *key, const char *fmt, ...)
    CLI_PRINTF(4, 5);
static void report(diff_ctx *d, const char *file, const char *key, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s: %s: ", cli_esc(file), cli_esc(key));
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
    d->differences++;
}

static void diff_tensor_bytes(diff_ctx *d, const char *file, const ckpt_entry_info *ea,
                              const void *pa, const void *pb);

/* A tensor's bytes: a view, or (a tensor saved in chunks by several
 * processes) assembled into *own (free it). */
static bool tensor_bytes(ckpt_reader *r, const ckpt_entry_info *e, const void **p, void **own) {
    ckpt_entry_info info;
    int rc = ckpt_reader_tensor_view(r, e->key, p, &info);
    if (rc != CKPT_EUNSUPPORTED) return rc == CKPT_OK;
    *own = malloc(e->nbytes ? (size_t)e->nbytes : 1);
    if (!*own) return false;
    if (ckpt_read_tensor(r, e->key, e->dtype, e->ndim, e->shape, *own) < 0) return false;
    *p = *own;
    return true;
}

static void diff_tensor(diff_ctx *d, const char *file, ckpt_reader *ra, ckpt_reader *rb,
                        const ckpt_entry_info *ea, const ckpt_entry_info *eb) {
    d->tensors++;
    bool same_shape = ea->ndim == eb->ndim;
    for (int k = 0; same_shape && k < ea->ndim; k++) same_shape = ea->shape[k] == eb->shape[k];
    if (ea->dtype != eb->dtype || !same_shape) {
        printf("%s: %s: %s ", cli_esc(file), cli_esc(ea->key), ckpt_dtype_name(ea->dtype));
        cli_print_shape(ea);
        printf(" vs %s ", ckpt_dtype_name(eb->dtype));
        cli_print_shape(eb);
        putchar('\n');
        d->differences++;
        return;
    }
    const void *pa = NULL, *pb = NULL;
    void *own[2] = {NULL, NULL};
    if (!tensor_bytes(ra, ea, &pa, &own[0]) || !tensor_bytes(rb, eb, &pb, &own[1])) {
        report(d, file, ea->key, "cannot read: %s", cli_esc(ckpt_errmsg()));
        free(own[0]);
        free(own[1]);
        return;
    }
    diff_tensor_bytes(d, file, ea, pa, pb);
    free(own[0]);
    free(own[1]);
}

/* Compares the bytes of two tensors of the same dtype and shape. */
static void diff_tensor_bytes(diff_ctx *d, const char *file, const ckpt_entry_info *ea,
                              const void *pa, const void *pb) {
    if (ea->nbytes == 0 || !memcmp(pa, pb, ea->nbytes)) return;

    int64_t numel = 1;
    for (int k = 0; k < ea->ndim; k++) numel *= ea->shape[k];
    double a, b;
    if (!element_value(ea->dtype, pa, 0, &a)) {
        uint64_t nb = 0;
        for (uint64_t i = 0; i < ea->nbytes; i++)
            nb += ((const unsigned char *)pa)[i] != ((const unsigned char *)pb)[i];
        report(d, file, ea->key, "%llu of %llu bytes differ", (unsigned long long)nb,
               (unsigned long long)ea->nbytes);
        return;
    }
    double maxabs = 0.0;
    uint64_t maxint = 0; /* integer tensors: the exact largest difference */
    int64_t ndiff = 0, first = -1;
    size_t esz = (size_t)(ckpt_dtype_bits(ea->dtype) / 8);
    bool sg, integer = element_int(ea->dtype, pa, 0, &sg, &(int64_t){0}, &(uint64_t){0});
    for (int64_t i = 0; i < numel; i++) {
        if (!memcmp((const char *)pa + (size_t)i * esz, (const char *)pb + (size_t)i * esz, esz))
            continue;
        double diff;
        if (integer) {
            int64_t sa = 0, sb = 0;
            uint64_t ua = 0, ub = 0, du;
            element_int(ea->dtype, pa, i, &sg, &sa, &ua);
            element_int(ea->dtype, pb, i, &sg, &sb, &ub);
            if (sg) du = sa > sb ? (uint64_t)sa - (uint64_t)sb : (uint64_t)sb - (uint64_t)sa;
            else du = ua > ub ? ua - ub : ub - ua;
            if (du > maxint) maxint = du;
            diff = (double)du;
        } else {
            element_value(ea->dtype, pa, i, &a);
            element_value(ea->dtype, pb, i, &b);
            diff = fabs(a - b);
            if (isnan(diff)) diff = INFINITY;
            if (diff > maxabs) maxabs = diff;
        }
        if (diff > d->atol || d->atol == 0.0) {
            ndiff++;
            if (first < 0) first = i;
        }
    }
    if (ndiff == 0) return;
    char maxs[40], va[40], vb[40];
    if (integer) snprintf(maxs, sizeof maxs, "%llu", (unsigned long long)maxint);
    else cli_format_double(maxabs, maxs, sizeof maxs);
    report(d, file, ea->key,
           "max |a-b| = %s, %lld of %lld elements differ (first at flat index %lld: %s vs %s)",
           maxs, (long long)ndiff, (long long)numel, (long long)first,
           cli_element_text(ea->dtype, pa, first, va, sizeof va),
           cli_element_text(ea->dtype, pb, first, vb, sizeof vb));
}

static void diff_scalar(diff_ctx *d, const char *file, ckpt_reader *ra, ckpt_reader *rb,
                        const ckpt_entry_info *ea, const ckpt_entry_info *eb) {
    d->scalars++;
    if (ea->kind != eb->kind) {
        report(d, file, ea->key, "%s vs %s", cli_kind_name(ea->kind), cli_kind_name(eb->kind));
        return;
    }
    switch (ea->kind) {
    case CKPT_ENTRY_I64: {
        int64_t a = 0, b = 0;
        ckpt_read_i64(ra, ea->key, &a);
        ckpt_read_i64(rb, eb->key, &b);
        if (a != b) report(d, file, ea->key, "%lld vs %lld", (long long)a, (long long)b);
        break;
    }
    case CKPT_ENTRY_U64: {
        uint64_t a = 0, b = 0;
        ckpt_read_u64(ra, ea->key, &a);
        ckpt_read_u64(rb, eb->key, &b);
        if (a != b)
            report(d, file, ea->key, "%llu vs %llu", (unsigned long long)a, (unsigned long long)b);
        break;
    }
    case CKPT_ENTRY_ALIAS:
        if (strcmp(ea->target, eb->target) != 0)
            report(d, file, ea->key, "an alias of '%s' vs of '%s'", cli_esc(ea->target),
                   cli_esc(eb->target));
        break;
    case CKPT_ENTRY_F64: {
        double a = 0, b = 0;
        ckpt_read_f64(ra, ea->key, &a);
        ckpt_read_f64(rb, eb->key, &b);
        bool same = !memcmp(&a, &b, sizeof a) || (d->atol > 0 && fabs(a - b) <= d->atol);
        char sa[40], sb[40];
        char sd[40];
        if (!same)
            report(d, file, ea->key, "%s vs %s (|a-b| = %s)", cli_format_double(a, sa, sizeof sa),
                   cli_format_double(b, sb, sizeof sb),
                   cli_format_double(fabs(a - b), sd, sizeof sd));
        break;
    }
    case CKPT_ENTRY_STR:
    case CKPT_ENTRY_BYTES: {
        size_t na = ea->nbytes, nb = eb->nbytes, ga = 0, gb = 0;
        char *a = malloc(na + 1), *b = malloc(nb + 1);
        if (!a || !b) {
            report(d, file, ea->key, "out of memory");
        } else if (ea->kind == CKPT_ENTRY_STR) {
            ckpt_read_str(ra, ea->key, a, na + 1);
            ckpt_read_str(rb, eb->key, b, nb + 1);
            if (strcmp(a, b)) report(d, file, ea->key, "\"%s\" vs \"%s\"", cli_esc(a), cli_esc(b));
        } else {
            ckpt_read_bytes(ra, ea->key, a, na, &ga);
            ckpt_read_bytes(rb, eb->key, b, nb, &gb);
            if (ga != gb || memcmp(a, b, ga))
                report(d, file, ea->key, "%zu bytes vs %zu bytes, contents differ", ga, gb);
        }
        free(a);
        free(b);
        break;
    }
    case CKPT_ENTRY_TENSOR: break;
    }
}

/* Compares two state files; CLI_RUNTIME if one cannot be opened. */
static int diff_files(diff_ctx *d, const char *pa, const char *pb, const char *label) {
    ckpt_reader *ra = NULL, *rb = NULL;
    int rc = cli_open_state(pa, &ra);
    if (rc < 0) return cli_lib_error("diff", rc);
    if ((rc = cli_open_state(pb, &rb)) < 0) {
        ckpt_reader_free(ra);
        return cli_lib_error("diff", rc);
    }
    int64_t na = ckpt_reader_count(ra), nb = ckpt_reader_count(rb);
    for (int64_t i = 0; i < na; i++) {
        ckpt_entry_info ea, eb;
        if (ckpt_reader_entry(ra, i, &ea) < 0) continue;
        if (ckpt_reader_find(rb, ea.key, &eb) < 0) {
            report(d, label, ea.key, "only in A");
            continue;
        }
        if (ea.kind == CKPT_ENTRY_TENSOR && eb.kind == CKPT_ENTRY_TENSOR)
            diff_tensor(d, label, ra, rb, &ea, &eb);
        else diff_scalar(d, label, ra, rb, &ea, &eb);
    }
    for (int64_t i = 0; i < nb; i++) {
        ckpt_entry_info ea, eb;
        if (ckpt_reader_entry(rb, i, &eb) < 0) continue;
        if (ckpt_reader_find(ra, eb.key, &ea) < 0) report(d, label, eb.key, "only in B");
    }
    ckpt_reader_free(ra);
    ckpt_reader_free(rb);
    return CLI_OK;
}

/* Metrics are measurements attached to a save, not state: their
 * differences are shown but not counted (an exported and re-imported
 * checkpoint carries none and is still equal). */
static void diff_metrics(const ckpt_checkpoint_info *a, const ckpt_checkpoint_info *b) {
    for (int pass = 0; pass < 2; pass++) {
        const ckpt_checkpoint_info *x = pass ? b : a, *y = pass ? a : b;
        for (int i = 0; i < x->num_metrics; i++) {
            const ckpt_metric *m = &x->metrics[i];
            const ckpt_metric *o = NULL;
            char va[40], vb[40];
            for (int j = 0; j < y->num_metrics; j++)
                if (strcmp(y->metrics[j].name, m->name) == 0) o = &y->metrics[j];
            if (!o)
                printf("checkpoint.json: metric %s: only in %c (metrics are not compared as "
                       "state)\n",
                       cli_esc(m->name), pass ? 'B' : 'A');
            else if (!pass && memcmp(&o->value, &m->value, sizeof m->value) != 0)
                printf("checkpoint.json: metric %s: %s vs %s (metrics are not compared as "
                       "state)\n",
                       cli_esc(m->name), cli_format_double(m->value, va, sizeof va),
                       cli_format_double(o->value, vb, sizeof vb));
        }
    }
}

static int diff_dirs(diff_ctx *d, const char *a, const char *b) {
    ckpt_checkpoint_info ia, ib;
    memset(&ia, 0, sizeof ia);
    memset(&ib, 0, sizeof ib);
    int va = ckpt_checkpoint_verify(a, false, &ia);
    int vb = ckpt_checkpoint_verify(b, false, &ib);
    if ((va == CKPT_OK) != (vb == CKPT_OK)) {
        printf("checkpoint.json: %s\n",
               va == CKPT_OK ? "B has no valid manifest" : "A has no valid manifest");
        d->differences++;
    } else if (va == CKPT_OK) {
        if (ia.step != ib.step) {
            printf("checkpoint.json: step: %lld vs %lld\n", (long long)ia.step, (long long)ib.step);
            d->differences++;
        }
        if (ia.num_processes != ib.num_processes)
            /* Not a difference by itself: sharded tensors are compared whole. */
            printf("checkpoint.json: num_processes: %d vs %d (sharded tensors compared "
                   "assembled)\n",
                   ia.num_processes, ib.num_processes);
        diff_metrics(&ia, &ib);
    }

    struct dirent **na = NULL, **nb = NULL;
    int ca = cli_list_state_files(a, &na);
    if (ca < 0) {
        cli_error("diff: %s: %s", a, strerror(errno));
        return CLI_RUNTIME;
    }
    int cb = cli_list_state_files(b, &nb);
    if (cb < 0) {
        cli_error("diff: %s: %s", b, strerror(errno));
        cli_free_names(na, ca);
        return CLI_RUNTIME;
    }
    int status = CLI_OK, i = 0, j = 0;
    /* both lists are sorted: walk them together */
    while (status == CLI_OK && (i < ca || j < cb)) {
        /* Shard files are read with their object's file. */
        if (i < ca && (cli_is_shard_file(na[i]->d_name) || cli_is_frozen_file(na[i]->d_name))) {
            i++;
            continue;
        }
        if (j < cb && (cli_is_shard_file(nb[j]->d_name) || cli_is_frozen_file(nb[j]->d_name))) {
            j++;
            continue;
        }
        /* a model saved as Hugging Face shards compares as its object */
        char oa[512], ob[512];
        const char *xa = i < ca ? cli_object_of(na[i]->d_name, oa, sizeof oa) : NULL;
        const char *xb = j < cb ? cli_object_of(nb[j]->d_name, ob, sizeof ob) : NULL;
        int c = i >= ca ? 1 : j >= cb ? -1 : strcmp(xa, xb);
        if (c < 0) {
            printf("%s: only in A\n", cli_esc(xa));
            i++;
            d->differences++;
        } else if (c > 0) {
            printf("%s: only in B\n", cli_esc(xb));
            j++;
            d->differences++;
        } else {
            char fa[4096], fb[4096];
            snprintf(fa, sizeof fa, "%s/%s", a, xa);
            snprintf(fb, sizeof fb, "%s/%s", b, xb);
            status = diff_files(d, fa, fb, xa);
            i++;
            j++;
        }
    }
    cli_free_names(na, ca);
    cli_free_names(nb, cb);
    return status;
}

int cli_diff(int argc, char **argv) {
    diff_ctx d = {0};
    const char *paths[2];
    int npaths = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(diff_help, stdout);
            return CLI_OK;
        } else if (!strcmp(a, "--atol") || !strncmp(a, "--atol=", 7)) {
            const char *v = a[6] == '=' ? a + 7 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return cli_usage_error("diff", "--atol needs a value");
            if (!cli_parse_double(v, &d.atol) || d.atol < 0)
                return cli_usage_error("diff", "bad value for --atol: '%s'", v);
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("diff", "unknown option '%s'", a);
        } else if (npaths == 2) {
            return cli_usage_error("diff", "unexpected argument '%s'", a);
        } else {
            paths[npaths++] = a;
        }
    }
    if (npaths != 2) return cli_usage_error("diff", "needs two paths, A and B");
    /* Each side is a checkpoint, a project (its newest valid checkpoint) or
     * a state file; anything else would compare nothing and call it equal. */
    static const char expected[] = "a checkpoint folder, a project folder or a .safetensors file";
    char resolved[2][4096];
    const char *use[2];
    bool dir[2];
    for (int k = 0; k < 2; k++) {
        const char *p = paths[k];
        cli_kind kind = cli_classify(p);
        use[k] = p;
        dir[k] = kind == CLI_KIND_CHECKPOINT || kind == CLI_KIND_PROJECT;
        switch (kind) {
        case CLI_KIND_MISSING:
            cli_error("diff: %s: %s", p,
                      strncmp(p, "s3://", 5) == 0 && *ckpt_errmsg() ? ckpt_errmsg()
                                                                    : strerror(errno));
            return CLI_RUNTIME;
        case CLI_KIND_CHECKPOINT:
        case CLI_KIND_STATE_FILE: break;
        case CLI_KIND_PROJECT: {
            int st = cli_newest_valid("diff", p, resolved[k], sizeof resolved[k]);
            if (st != CLI_OK) return st;
            use[k] = resolved[k];
            break;
        }
        default: return cli_wrong_kind("diff", p, kind, expected);
        }
    }
    if (dir[0] != dir[1])
        return cli_usage_error("diff",
                               "A and B must both be checkpoints (or projects) or both files");
    for (int k = 0; k < 2; k++)
        if (use[k] != paths[k])
            printf("%c: %s (the newest valid checkpoint of %s)\n", "AB"[k], cli_esc(use[k]),
                   cli_esc(paths[k]));
    /* object storage: each side read from a verified local copy */
    char copies[2][1024];
    for (int k = 0; k < 2; k++)
        if (strncmp(use[k], "s3://", 5) == 0) {
            int st = cli_local_copy("diff", use[k], copies[k], sizeof copies[k]);
            if (st != CLI_OK) return st;
            use[k] = copies[k];
        }
    int status = dir[0] ? diff_dirs(&d, use[0], use[1]) : diff_files(&d, use[0], use[1], "file");
    if (status != CLI_OK) return status;
    if (d.differences) {
        printf("%lld difference%s\n", (long long)d.differences, d.differences == 1 ? "" : "s");
        return CLI_DIFFER;
    }
    printf("equal: %lld tensors, %lld scalar entries%s\n", (long long)d.tensors,
           (long long)d.scalars, d.atol > 0 ? " (within --atol)" : ", bit for bit");
    return CLI_OK;
}
