/* load_remote.c — the load op's storage back end for object storage
 * (load_int.h): choose lists the bucket's committed checkpoints, plan
 * fetches the candidate's manifest, read fetches this rank's files by
 * parallel ranged GETs straight into the load's buffers, checked and hashed
 * as they arrive (store/s3/remote.h). Nothing is copied to the local disk
 * but the checkpoint's pre-hook files, which the load hooks read from a
 * small local folder. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "accel/load_int.h"
#include "accel/remote.h"
#include "base/error.h"
#include "base/io.h"
#include "store/s3/remote.h"
#include "store/s3/s3.h"
#include "store/store.h"

bool ckpt__load_is_remote(const ckpt_accelerator *acc, const char *input_dir) {
    return input_dir ? ckpt__s3_is_url(input_dir) : acc && acc->remote;
}

int ckpt__load_remote_numbers(ckpt__load_op *op, int64_t **nums, int64_t *count) {
    *nums = NULL;
    *count = 0;
    ckpt_accelerator *acc = op->acc;
    CKPT_TRY(ckpt__acc_remote_open(acc));
    ckpt_remote_entry *v = NULL;
    int64_t n = 0;
    CKPT_TRY(ckpt__remote_scan(&acc->remote->r, &v, &n));
    int rc = 0;
    *nums = ckpt__calloc((size_t)(n ? n : 1), sizeof **nums);
    if (!*nums) rc = ckpt__err_nomem("load candidates");
    /* a checkpoint exists when its manifest does: the others are leftovers */
    for (int64_t i = 0; rc == 0 && i < n; i++)
        if (v[i].committed) (*nums)[(*count)++] = v[i].number;
    ckpt__remote_scan_free(v, n);
    return rc;
}

/* The client and the key of the candidate op->dir. */
static int open_candidate(ckpt__load_op *op) {
    free(op->rdir);
    op->rdir = NULL;
    ckpt_remote own, *r = NULL;
    char *dir = NULL;
    CKPT_TRY(ckpt__acc_remote_for(op->acc, op->dir, &own, &r, &dir));
    if (r == &own) {
        /* another bucket than the project's: a client of the op's own */
        if (op->rem_own) {
            ckpt__remote_close(op->rem_own);
            free(op->rem_own);
        }
        op->rem_own = ckpt__malloc(sizeof *op->rem_own);
        if (!op->rem_own) {
            ckpt__remote_close(&own);
            free(dir);
            return ckpt__err_nomem("load");
        }
        *op->rem_own = own;
        r = op->rem_own;
    }
    op->rem = r;
    op->rdir = dir;
    return CKPT_OK;
}

int ckpt__load_remote_manifest(ckpt__load_op *op) {
    memset(&op->c, 0, sizeof op->c);
    CKPT_TRY(open_candidate(op));
    return ckpt__remote_open_manifest(op->rem, op->rdir, op->dir, &op->c);
}

int ckpt__load_remote_read(ckpt__load_op *op, const bool *shallow) {
    return ckpt__remote_read_files(op->rem, op->rdir, op->dir, shallow, &op->acc->arena, &op->c);
}

/* ---- the hooks' folder --------------------------------------------------------- */

static int write_file(const char *path, const uint8_t *p, uint64_t n) {
    ckpt_ostream s;
    CKPT_TRY(ckpt__ostream_open(&s, path));
    int rc = ckpt__ostream_write(&s, p, (size_t)n);
    if (rc) {
        ckpt__ostream_abort(&s);
        return rc;
    }
    return ckpt__ostream_finish(&s, NULL, NULL);
}

int ckpt__load_remote_hook_dir(ckpt__load_op *op) {
    ckpt_accelerator *acc = op->acc;
    if (op->hook_dir) return CKPT_OK;
    /* under the project's local folder (or $TMPDIR): .<checkpoint>.load.<pid> */
    char *parent = NULL;
    if (acc->project_dir && !ckpt__s3_is_url(acc->project_dir)) {
        parent = ckpt__checkpoints_dir(acc->project_dir);
    } else {
        const char *t = getenv("TMPDIR");
        parent = ckpt__strdup(t && *t ? t : "/tmp");
    }
    if (!parent) return ckpt__err_nomem("load path");
    const char *base = strrchr(op->dir, '/');
    char name[160];
    snprintf(name, sizeof name, ".%s.load.%ld.%d", base ? base + 1 : "checkpoint", (long)getpid(),
             op->comm->rank);
    int rc = ckpt__mkdirs(parent);
    op->hook_dir = rc == 0 ? ckpt__path_join(parent, name) : NULL;
    free(parent);
    if (rc == 0 && !op->hook_dir) rc = ckpt__err_nomem("load path");
    struct stat st;
    if (rc == 0 && ckpt__os_lstat(op->hook_dir, &st) == 0) rc = ckpt__remove_tree(op->hook_dir);
    if (rc == 0 && ckpt__os_mkdir(op->hook_dir, 0755) != 0)
        rc =
            ckpt__err_os(errno, "load_state: %s: create a folder for the load hooks", op->hook_dir);
    /* the pre-hooks' files, from the bytes read and verified */
    const ckpt_manifest *m = &op->c.m;
    for (int64_t j = 0; rc == 0 && j < m->nfiles; j++) {
        if (strcmp(m->files[j].kind, "extra") != 0) continue;
        if (!op->c.maps || (!op->c.maps[j].data && m->files[j].size))
            continue; /* not read by this rank */
        char *path = ckpt__path_join(op->hook_dir, m->files[j].name);
        rc = path ? write_file(path, op->c.maps[j].data, op->c.maps[j].size)
                  : ckpt__err_nomem("load path");
        free(path);
    }
    if (rc < 0) rc = ckpt__err_prefix(rc, "load_state: %s", op->dir);
    return rc;
}

void ckpt__load_remote_free(ckpt__load_op *op) {
    if (op->hook_dir) {
        struct stat st;
        if (ckpt__os_lstat(op->hook_dir, &st) == 0) (void)ckpt__remove_tree(op->hook_dir);
        free(op->hook_dir);
        op->hook_dir = NULL;
    }
    if (op->rem_own) {
        ckpt__remote_close(op->rem_own);
        free(op->rem_own);
        op->rem_own = NULL;
    }
    free(op->rdir);
    op->rdir = NULL;
}
