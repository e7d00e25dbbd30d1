/* object.c — one object of a checkpoint folder as one reader: its file plus
 * every shard file of it the manifest lists, each checked against the
 * manifest, so tools see sharded tensors whole whatever process count saved
 * them. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "format/hfindex.h"
#include "format/manifest.h"
#include "format/shard.h"
#include "format/statedict.h"
#include "store/s3/remote.h"
#include "store/s3/s3.h"

/* Where the checkpoint is: a local folder, or (rem not NULL) the objects
 * under key rkey of a bucket (dir is then its URL). */
typedef struct obj_src {
    const char *dir;
    ckpt_remote *rem;
    const char *rkey;
} obj_src;

/* An object of the checkpoint into private memory, by parallel ranged
 * GETs, hashed as it arrives (its size was checked against a listing). */
static int map_object(const obj_src *s, const ckpt_manifest_file *f, ckpt_mapped *mp) {
    char *key = ckpt__path_join(s->rkey, f->name);
    uint8_t *buf = key ? ckpt__malloc(f->size ? (size_t)f->size : 1) : NULL;
    if (!buf) {
        free(key);
        return ckpt__err_nomem("checkpoint object");
    }
    uint64_t h = 0;
    const char *k = key;
    int rc = ckpt__s3_get_many(s->rem->c, 1, &k, &f->size, &buf, &h, NULL);
    free(key);
    if (rc == 0 && h != f->xxh3)
        rc = ckpt__err(CKPT_ECORRUPT, "%s: %s does not match the manifest (checksum)", s->dir,
                       f->name);
    if (rc < 0) {
        free(buf);
        return rc;
    }
    mp->heap = buf;
    mp->data = buf;
    mp->size = f->size;
    return CKPT_OK;
}

/* Reads dir/f->name into private memory, hashing it on the way, and checks
 * it against the manifest: the readers then use exactly the bytes that were
 * checked, whatever happens to the file afterwards. */
static int map_checked(const obj_src *s, const ckpt_manifest_file *f, ckpt_mapped *mp) {
    if (s->rem) return map_object(s, f, mp);
    const char *dir = s->dir;
    size_t n = strlen(dir) + strlen(f->name) + 2;
    char *path = ckpt__malloc(n);
    if (!path) return ckpt__err_nomem("checkpoint path");
    snprintf(path, n, "%s/%s", dir, f->name);
    char *what = ckpt__malloc(n + 1);
    if (what) snprintf(what, n + 1, "%s: %s", dir, f->name);
    uint64_t h = 0;
    int rc = what ? ckpt__read_private(path, what, f->size, mp, &h) : ckpt__err_nomem(dir);
    if (rc == 0 && h != f->xxh3) {
        ckpt__unmap(mp);
        rc =
            ckpt__err(CKPT_ECORRUPT, "%s: %s does not match the manifest (checksum)", dir, f->name);
    }
    if (rc == 0) ckpt__io_verified(path);
    free(what);
    free(path);
    return rc;
}

/* A part of a model saved as Hugging Face shards: its file, checked against
 * the manifest, as a reader that owns the mapping. */
static int open_part(void *ctx, const ckpt_manifest_file *f, ckpt_reader **out) {
    const obj_src *s = ctx;
    ckpt_mapped mp;
    memset(&mp, 0, sizeof mp);
    int rc = map_checked(s, f, &mp);
    if (rc == 0) rc = ckpt_reader_open_memory(out, mp.data, (size_t)mp.size, f->name);
    if (rc == 0) rc = ckpt__reader_adopt_map(*out, &mp);
    if (rc < 0 && mp.data) ckpt__unmap(&mp);
    return rc;
}

static int open_hf(const obj_src *s, const ckpt_manifest *m, const ckpt_manifest_file *f,
                   const char *file, ckpt_reader **out) {
    ckpt_mapped im;
    memset(&im, 0, sizeof im);
    CKPT_TRY(map_checked(s, f, &im));
    int rc = ckpt__hf_open(m, f, im.data, (size_t)im.size, s->dir, file, open_part, (void *)s, out);
    ckpt__unmap(&im);
    return rc;
}

int ckpt_checkpoint_open_object(const char *dir, const char *file, ckpt_reader **out) {
    if (!out) return ckpt__err(CKPT_EINVAL, "checkpoint_open_object: out is NULL");
    *out = NULL;
    if (!dir || !file) return ckpt__err(CKPT_EINVAL, "checkpoint_open_object: NULL argument");
    obj_src src = {.dir = dir};
    ckpt_remote rem = {0};
    ckpt_manifest m;
    int rc = CKPT_OK;
    if (ckpt__s3_is_url(dir)) {
        /* the objects it needs, read into private memory: its manifest and
         * a listing (every size checked) first, nothing copied to disk */
        bool have = false;
        rc = ckpt__remote_open(&rem, dir);
        if (rc == 0 && !*rem.prefix)
            rc = ckpt__err(CKPT_EINVAL, "%s: a bucket, not a checkpoint folder", dir);
        if (rc == 0) rc = ckpt__remote_check(&rem, rem.prefix, NULL, false, &m, &have);
        if (rc < 0) {
            if (have) ckpt__manifest_clear(&m);
            ckpt__remote_close(&rem);
            return rc;
        }
        src.rem = &rem;
        src.rkey = rem.prefix;
    } else {
        CKPT_TRY(ckpt__manifest_read(dir, &m));
    }
    ckpt_reader *r = NULL;
    const ckpt_manifest_file *base = ckpt__manifest_find(&m, file);
    size_t stem = strlen(file);
    if (stem > 12 && strcmp(file + stem - 12, ".safetensors") == 0) stem -= 12;
    if (ckpt__shard_file_parse(file, NULL, NULL, NULL)) {
        rc = ckpt__err(CKPT_EINVAL, "%s: %s is one process's shard file: open its object", dir,
                       file);
        goto out;
    }
    int64_t nshards = 0;
    for (int64_t i = 0; i < m.nfiles; i++) {
        size_t sl = 0;
        if (ckpt__shard_file_parse(m.files[i].name, &sl, NULL, NULL) && sl == stem &&
            memcmp(m.files[i].name, file, stem) == 0)
            nshards++;
    }
    if (!base && stem < strlen(file)) { /* a model saved as Hugging Face shards? */
        char iname[300];
        snprintf(iname, sizeof iname, "%s.index.json", file);
        const ckpt_manifest_file *idx = ckpt__manifest_find(&m, iname);
        if (idx) {
            rc = open_hf(&src, &m, idx, file, &r);
            goto out;
        }
    }
    if (!base && nshards == 0) {
        rc = ckpt__err(CKPT_ENOENT, "%s: the manifest lists no %s", dir, file);
        goto out;
    }
    if (base) {
        ckpt_mapped mp;
        memset(&mp, 0, sizeof mp);
        rc = map_checked(&src, base, &mp);
        if (rc == 0) rc = ckpt_reader_open_memory(&r, mp.data, (size_t)mp.size, file);
        if (rc == 0) rc = ckpt__reader_adopt_map(r, &mp);
        if (rc < 0 && mp.data) ckpt__unmap(&mp);
    } else {
        rc = ckpt__reader_new_empty(&r, file);
    }
    for (int64_t i = 0; rc == 0 && i < m.nfiles; i++) {
        const ckpt_manifest_file *f = &m.files[i];
        size_t sl = 0;
        if (!ckpt__shard_file_parse(f->name, &sl, NULL, NULL) || sl != stem ||
            memcmp(f->name, file, stem) != 0)
            continue;
        if (!f->chunks && f->ntensors > 0) {
            rc = ckpt__err(CKPT_ECORRUPT, "%s: %s: the manifest records no chunks for it", dir,
                           f->name);
            break;
        }
        ckpt_mapped mp;
        memset(&mp, 0, sizeof mp);
        rc = map_checked(&src, f, &mp);
        if (rc < 0) break;
        const uint8_t *data = mp.data;
        size_t len = (size_t)mp.size;
        rc = ckpt__reader_adopt_map(r, &mp);
        if (rc < 0) {
            ckpt__unmap(&mp);
            break;
        }
        rc = ckpt__reader_attach_shard(r, data, len, f->name, (const char *const *)f->tensor_keys,
                                       f->chunks, f->ntensors, NULL);
    }
out:
    ckpt__manifest_clear(&m);
    if (src.rem) ckpt__remote_close(&rem);
    if (rc < 0) {
        ckpt_reader_free(r);
        return rc;
    }
    *out = r;
    return CKPT_OK;
}
