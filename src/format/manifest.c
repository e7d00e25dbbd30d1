/* manifest.c — checkpoint.json in memory: the file records a save collects
 * and a load looks up. Writing is in manifest_write.c, parsing (as hostile
 * input) in manifest_parse.c, verification in manifest_verify.c. */
#include <stdlib.h>
#include <string.h>

#include "base/error.h"
#include "base/io.h"
#include "format/manifest.h"
#include "format/manifest_int.h"

void ckpt__manifest_init(ckpt_manifest *m) {
    memset(m, 0, sizeof *m);
    m->format_version = 1; /* what one process writes; see CKPT_FORMAT_VERSION */
    m->process_index = -1;
    m->num_processes = 1;
}

void ckpt__manifest_clear(ckpt_manifest *m) {
    for (int64_t i = 0; i < m->nfiles; i++) file_clear(&m->files[i]);
    free(m->files);
    ckpt__manifest_init(m);
}

int ckpt__manifest_add(ckpt_manifest *m, const char *name, const char *kind,
                       const ckpt_file_digest *d) {
    ckpt_manifest_file *f = push_file(m);
    if (!f) return ckpt__err_nomem("manifest");
    f->name = ckpt__strdup(name);
    f->kind = ckpt__strdup(kind);
    int rc = (f->name && f->kind) ? 0 : ckpt__err_nomem("manifest");
    if (rc == 0) rc = alloc_tensors(f, d->ntensors);
    for (int64_t i = 0; rc == 0 && i < d->ntensors; i++) {
        f->tensor_keys[i] = ckpt__strdup(d->tensor_keys[i]);
        if (!f->tensor_keys[i]) {
            rc = ckpt__err_nomem("manifest tensor key");
            break;
        }
        f->tensor_xxh3[i] = d->tensor_xxh3[i];
        f->ntensors = i + 1;
    }
    if (rc == 0 && d->tensor_chunk) {
        f->chunks = ckpt__malloc((size_t)(d->ntensors ? d->ntensors : 1) * sizeof *f->chunks);
        if (!f->chunks) rc = ckpt__err_nomem("manifest chunks");
        else if (d->ntensors)
            memcpy(f->chunks, d->tensor_chunk, (size_t)d->ntensors * sizeof *f->chunks);
    }
    if (rc < 0) {
        file_clear(f);
        m->nfiles--;
        return rc;
    }
    f->size = d->size;
    f->xxh3 = d->xxh3;
    f->has_xxh128 = d->has_xxh128;
    f->xxh128 = d->xxh128;
    f->has_header_xxh3 = d->has_header_xxh3;
    f->header_xxh3 = d->header_xxh3;
    return 0;
}

const ckpt_manifest_file *ckpt__manifest_find(const ckpt_manifest *m, const char *name) {
    for (int64_t i = 0; i < m->nfiles; i++)
        if (strcmp(m->files[i].name, name) == 0) return &m->files[i];
    return NULL;
}
