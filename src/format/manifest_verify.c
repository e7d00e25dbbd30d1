/* manifest_verify.c — opening a checkpoint: every file the manifest lists
 * checked (size, checksums; in parallel for big ones), nothing unlisted,
 * and the files handed out mapped. */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/error.h"
#include "base/hashread.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/manifest_int.h"
#include "format/hfindex.h"
#include "format/shard.h"

/* ---- verification ------------------------------------------------------- */

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

/* The file's digest differs: say which tensor if the file still parses. */
static int name_mismatch(const char *dir, const ckpt_manifest_file *f, const ckpt_mapped *mp) {
    /* A save pre-hook's file is not a state file: nothing to parse. */
    if (strcmp(f->kind, "extra") == 0)
        return ckpt__err(CKPT_ECORRUPT, "%s: %s: checksum mismatch (a file a save pre-hook added)",
                         dir, f->name);
    /* The index of a model saved as Hugging Face shards is JSON. */
    if (ends_with(f->name, ".index.json")) {
        ckpt_hf_index x;
        memset(&x, 0, sizeof x);
        int rc = ckpt__hf_index_parse((const char *)mp->data, (size_t)mp->size, f->name, &x);
        ckpt__hf_index_free(&x);
        if (rc < 0)
            return ckpt__err_prefix(CKPT_ECORRUPT,
                                    "%s: %s: checksum mismatch and the shard index does not parse",
                                    dir, f->name);
        return ckpt__err(CKPT_ECORRUPT,
                         "%s: %s: checksum mismatch in the shard index (it still parses)", dir,
                         f->name);
    }
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

static int check_unlisted(const char *dir, const ckpt_manifest *m) {
    DIR *d = ckpt__os_opendir(dir);
    if (!d) return ckpt__err_os(errno, "%s", dir);
    struct dirent *e;
    int rc = 0;
    while ((e = ckpt__os_readdir(d)) != NULL) {
        if (!ends_with(e->d_name, ".safetensors") || e->d_name[0] == '.') continue;
        if (!ckpt__manifest_find(m, e->d_name)) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s is not listed in the manifest", dir, e->d_name);
            break;
        }
    }
    ckpt__os_closedir(d);
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
    if (ckpt__os_lstat(path, &st) != 0) {
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
    if (rc == 0) ckpt__io_verified(path);
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
    /* A file large enough to be read on two threads by itself (hashread.h)
     * is: the files then go one after the other (else four threads would
     * share two cores). */
    bool large = false;
    for (int64_t i = 0; i < n && ckpt__hashread_helpers() > 0; i++)
        if ((!shallow || !shallow[i]) && m->files[i].size >= CKPT_HASHREAD_MIN) large = true;
    bool parallel = deep && n >= 2 && !large && total >= atomic_load(&parallel_check_bytes);
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

int ckpt__checkpoint_open_manifest(const char *dir, ckpt_checkpoint_open *c) {
    memset(c, 0, sizeof *c);
    int rc = ckpt__manifest_read(dir, &c->m);
    if (rc < 0) {
        char *path = join(dir, CKPT_MANIFEST_NAME);
        struct stat st;
        c->no_manifest = path && ckpt__os_stat(dir, &st) == 0 && S_ISDIR(st.st_mode) &&
                         ckpt__os_stat(path, &st) != 0 && errno == ENOENT;
        free(path);
        return rc;
    }
    c->have_manifest = true;
    for (int64_t i = 0; i < c->m.nfiles; i++)
        if (__builtin_add_overflow(c->total_bytes, c->m.files[i].size, &c->total_bytes))
            c->total_bytes = UINT64_MAX;
    return CKPT_OK;
}

int ckpt__checkpoint_read_files(const char *dir, bool deep, bool keep_maps, const bool *shallow,
                                ckpt_arena *arena, ckpt_checkpoint_open *c) {
    int rc = CKPT_OK;
    if (keep_maps && deep) {
        c->maps = ckpt__calloc((size_t)(c->m.nfiles ? c->m.nfiles : 1), sizeof *c->maps);
        if (!c->maps) {
            ckpt__checkpoint_close(c);
            return ckpt__err_nomem("checkpoint maps");
        }
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

int ckpt__checkpoint_read_files_from(const ckpt_file_source *src, const char *dir,
                                     const bool *shallow, ckpt_arena *arena,
                                     ckpt_checkpoint_open *c) {
    int64_t n = c->m.nfiles;
    c->maps = ckpt__calloc((size_t)(n ? n : 1), sizeof *c->maps);
    if (!c->maps) {
        ckpt__checkpoint_close(c);
        return ckpt__err_nomem("checkpoint maps");
    }
    /* Every size (and nothing unlisted) before a byte is reserved or read. */
    int rc = src->check(src->ctx, &c->m);
    if (rc == 0 && !ckpt__addressable(c->total_bytes))
        rc = ckpt__err(CKPT_ECORRUPT,
                       "%s: the listed files' sizes add up to %" PRIu64
                       " bytes, more than memory can hold (forged sizes)",
                       dir, c->total_bytes);
    uint8_t **dst = NULL;
    int64_t *idx = NULL, k = 0;
    uint64_t *h = NULL;
    if (rc == 0) rc = place_files(dir, c, shallow, arena, &dst);
    if (rc == 0) {
        idx = ckpt__calloc((size_t)(n ? n : 1), sizeof *idx);
        h = ckpt__calloc((size_t)(n ? n : 1), sizeof *h);
        if (!idx || !h) rc = ckpt__err_nomem("checkpoint check");
    }
    for (int64_t i = 0; rc == 0 && i < n; i++)
        if (!shallow || !shallow[i]) idx[k++] = i;
    if (rc == 0) rc = src->read(src->ctx, &c->m, idx, k, dst, h);
    /* The readers use only the bytes hashed here; a mismatch names the
     * tensor when the file still parses. */
    for (int64_t j = 0; rc == 0 && j < k; j++) {
        const ckpt_manifest_file *f = &c->m.files[idx[j]];
        ckpt_mapped *mp = &c->maps[idx[j]];
        mp->data = f->size ? dst[idx[j]] : empty_file; /* borrowed from the read buffers */
        mp->size = f->size;
        if (h[idx[j]] != f->xxh3) rc = name_mismatch(dir, f, mp);
    }
    free(idx);
    free(h);
    free(dst);
    if (rc < 0 && c->maps) {
        for (int64_t i = 0; i < n; i++) memset(&c->maps[i], 0, sizeof c->maps[i]);
        free(c->maps);
        c->maps = NULL;
    }
    return rc;
}

static int open_checkpoint(const char *dir, bool deep, bool keep_maps,
                           bool (*want)(const ckpt_manifest_file *f, void *ctx), void *ctx,
                           ckpt_arena *arena, ckpt_checkpoint_open *c) {
    CKPT_TRY(ckpt__checkpoint_open_manifest(dir, c));
    bool *shallow = NULL;
    if (want) {
        shallow = ckpt__calloc((size_t)(c->m.nfiles ? c->m.nfiles : 1), sizeof *shallow);
        if (!shallow) {
            ckpt__checkpoint_close(c);
            return ckpt__err_nomem("checkpoint check");
        }
        for (int64_t i = 0; i < c->m.nfiles; i++) shallow[i] = !want(&c->m.files[i], ctx);
    }
    int rc = ckpt__checkpoint_read_files(dir, deep, keep_maps, shallow, arena, c);
    free(shallow);
    return rc;
}

int ckpt__checkpoint_files_local(const char *dir, ckpt_checkpoint_file **out, int64_t *count) {
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
        if (p && ckpt__os_lstat(p, &st) == 0 && S_ISREG(st.st_mode)) {
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
