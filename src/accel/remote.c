/* remote.c — an accelerator whose project folder is in object storage
 * (project_dir "s3://bucket/prefix"): the save's commit, the numbering, the
 * lock and the retention go to the bucket (store/s3/remote.h); the files
 * are written in a local staging folder first, and a load reads a verified
 * local copy of the checkpoint it chose.
 *
 * The staging folder, <CKPT_S3_STAGING_DIR or $TMPDIR or /tmp>/ckpt-s3-<uid>/
 * <bucket>/<prefix>, stands in for the project folder locally (the save's
 * temporary folder, the local lock, the logs by default): a save writes its
 * files into the temporary folder there as for a local project, and its
 * commit uploads them (data objects, then the manifest with If-None-Match:
 * *) instead of renaming the folder, then removes it. Nothing of a
 * checkpoint stays on the local disk once its save or load returns. */
#include "accel/remote.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "base/io.h"
#include "store/s3/project.h"
#include "store/s3/remote.h"
#include "store/store.h"

int ckpt__acc_remote_init(ckpt_accelerator *acc, const char *url) {
    CKPT_TRY(ckpt__s3_available(url));
    char *bucket = NULL, *prefix = NULL;
    CKPT_TRY(ckpt__s3_parse_url(url, &bucket, &prefix));
    const char *base = getenv("CKPT_S3_STAGING_DIR");
    char root[1024];
    if (base && *base) snprintf(root, sizeof root, "%s", base);
    else {
        const char *tmp = getenv("TMPDIR");
        snprintf(root, sizeof root, "%s/ckpt-s3-%ld", tmp && *tmp ? tmp : "/tmp", (long)getuid());
    }
    size_t n = strlen(root) + strlen(bucket) + strlen(prefix) + 4;
    char *dir = ckpt__malloc(n);
    struct ckpt_acc_remote *rm = ckpt__calloc(1, sizeof *rm);
    int rc = dir && rm ? 0 : ckpt__err_nomem("accelerator");
    if (rc == 0) {
        snprintf(dir, n, "%s/%s%s%s", root, bucket, *prefix ? "/" : "", prefix);
        rm->url = ckpt__malloc(strlen(bucket) + strlen(prefix) + 8);
        if (!rm->url) rc = ckpt__err_nomem("accelerator");
        else sprintf(rm->url, "s3://%s%s%s", bucket, *prefix ? "/" : "", prefix);
    }
    free(bucket);
    free(prefix);
    if (rc < 0) {
        free(dir);
        if (rm) free(rm->url);
        free(rm);
        return rc;
    }
    free(acc->project_dir);
    acc->project_dir = dir;
    acc->remote = rm;
    return 0;
}

void ckpt__acc_remote_free(ckpt_accelerator *acc) {
    struct ckpt_acc_remote *rm = acc->remote;
    if (!rm) return;
    if (rm->opened) {
        ckpt__remote_unlock(&rm->r, &rm->lk);
        ckpt__remote_close(&rm->r);
    }
    free(rm->url);
    free(rm);
    acc->remote = NULL;
}

const char *ckpt__acc_remote_url(const ckpt_accelerator *acc) {
    return acc->remote ? acc->remote->url : NULL;
}

int ckpt__acc_remote_open(ckpt_accelerator *acc) {
    struct ckpt_acc_remote *rm = acc->remote;
    if (rm->opened) return 0;
    CKPT_TRY(ckpt__remote_open(&rm->r, rm->url));
    rm->opened = true;
    return 0;
}

int ckpt__acc_remote_refuse_mpi(const ckpt_accelerator *acc, const char *what) {
    if (acc->comm && acc->comm->size > 1)
        return ckpt__err(CKPT_EUNSUPPORTED,
                         "%s: %s: a project in object storage is not supported with several "
                         "processes yet (each rank would upload its own part); save to a "
                         "shared folder and copy it",
                         what, acc->remote->url);
    return 0;
}

int ckpt__acc_remote_plan(ckpt_accelerator *acc, int64_t *number, const ckpt_logger *lg) {
    struct ckpt_acc_remote *rm = acc->remote;
    CKPT_TRY(ckpt__acc_remote_refuse_mpi(acc, "save_state"));
    CKPT_TRY(ckpt__acc_remote_open(acc));
    int rc = rm->lk.held ? ckpt__remote_lock_renew(&rm->r, &rm->lk)
                         : ckpt__remote_lock(&rm->r, &rm->lk, lg);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    /* under the lock, nothing else writes: what has no manifest is a leftover */
    rc = ckpt__remote_remove_leftovers(&rm->r, lg, NULL);
    ckpt_remote_entry *v = NULL;
    int64_t n = 0;
    if (rc == 0) rc = ckpt__remote_scan(&rm->r, &v, &n);
    if (rc == 0 && n > 0 && v[n - 1].number + 1 > *number) *number = v[n - 1].number + 1;
    free(v);
    if (rc < 0) rc = ckpt__err_prefix(rc, "save_state");
    return rc;
}

/* Removes the committed checkpoints beyond the newest `keep` that check
 * (manifest, and every file present with its size); unreadable ones older
 * than the newest good one go too. A failure is a warning: the save is
 * committed. */
static void rotate(ckpt_accelerator *acc, const ckpt_logger *lg) {
    struct ckpt_acc_remote *rm = acc->remote;
    if (acc->total_limit <= 0) return;
    if (ckpt__retention_active(&acc->retention)) {
        ckpt__log(lg, CKPT_LOG_WARNING,
                  "%s: keep_every_steps and best_k are not applied in object storage yet; "
                  "total_limit is",
                  rm->url);
    }
    ckpt_remote_entry *v = NULL;
    int64_t n = 0, kept = 0;
    int rc = ckpt__remote_scan(&rm->r, &v, &n);
    for (int64_t i = n - 1; rc == 0 && i >= 0; i--) {
        if (!v[i].committed) continue;
        char rel[80];
        snprintf(rel, sizeof rel, "checkpoints/checkpoint_%" PRId64, v[i].number);
        char *dir = ckpt__remote_key(&rm->r, rel);
        if (!dir) break;
        bool go = kept >= acc->total_limit;
        if (!go) {
            ckpt_manifest m;
            bool have = false;
            int vrc = ckpt__remote_check(&rm->r, dir, false, &m, &have);
            if (have) ckpt__manifest_clear(&m);
            if (vrc == 0) kept++;
            else if (vrc == CKPT_ECORRUPT || vrc == CKPT_ENOENT) go = kept > 0;
            else rc = vrc;
        }
        free(dir);
        if (rc == 0 && go) rc = ckpt__remote_remove(&rm->r, v[i].number);
    }
    free(v);
    if (rc < 0) ckpt__log(lg, CKPT_LOG_WARNING, "total_limit rotation: %s", ckpt_errmsg());
}

int ckpt__acc_remote_commit(ckpt_accelerator *acc, const char *tmp, int64_t number,
                            int64_t *committed, const ckpt_logger *lg) {
    struct ckpt_acc_remote *rm = acc->remote;
    CKPT_TRY(ckpt__acc_remote_open(acc));
    /* still ours? a lease that ran out during a long save means another
     * process may write here now */
    int rc = ckpt__remote_lock_renew(&rm->r, &rm->lk);
    if (rc == 0) rc = ckpt__remote_publish(&rm->r, tmp, number, committed, lg);
    if (rc < 0) return ckpt__err_prefix(rc, "save_state");
    rotate(acc, lg);
    return 0;
}

char *ckpt__acc_remote_checkpoint_url(const ckpt_accelerator *acc, int64_t number) {
    size_t n = strlen(acc->remote->url) + 64;
    char *p = ckpt__malloc(n);
    if (p) snprintf(p, n, "%s/checkpoints/checkpoint_%" PRId64, acc->remote->url, number);
    return p;
}
