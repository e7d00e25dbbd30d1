/* remote.c — an accelerator whose project folder is in object storage
 * (project_dir "s3://bucket/prefix"). The checkpoints, their numbering, the
 * lock object and the retention are the bucket's (store/s3/remote.h): a save
 * streams each file into its object and commits with the manifest last
 * (save_remote.c), a load reads the objects straight into its buffers
 * (load_remote.c).
 *
 * project_dir becomes a local folder, <CKPT_S3_STAGING_DIR or $TMPDIR or
 * /tmp>/ckpt-s3-<uid>/<bucket>/<prefix>, for what is not a checkpoint: the
 * logs (by default), the local lock that keeps two runs of this host off
 * the project, and the small temporary folders where save pre-hooks leave
 * their files and load hooks find them. No checkpoint file is written there. */
#include "accel/remote.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "store/s3/s3.h"

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
    ckpt__remote_scan_free(rm->scan, rm->nscan);
    free(rm->url);
    free(rm);
    acc->remote = NULL;
}

const char *ckpt__acc_remote_url(const ckpt_accelerator *acc) {
    return acc && acc->remote ? acc->remote->url : NULL;
}

int ckpt__acc_remote_open(ckpt_accelerator *acc) {
    struct ckpt_acc_remote *rm = acc->remote;
    if (rm->opened) return 0;
    CKPT_TRY(ckpt__remote_open(&rm->r, rm->url));
    rm->opened = true;
    return 0;
}

int ckpt__acc_remote_for(ckpt_accelerator *acc, const char *url, ckpt_remote *own, ckpt_remote **r,
                         char **dir) {
    *r = NULL;
    *dir = NULL;
    memset(own, 0, sizeof *own);
    char *bucket = NULL, *key = NULL, *pb = NULL, *pp = NULL;
    CKPT_TRY(ckpt__s3_parse_url(url, &bucket, &key));
    int rc = 0;
    if (!*key) rc = ckpt__err(CKPT_EINVAL, "%s: a bucket, not a checkpoint folder", url);
    /* the project's own bucket: its client */
    bool same = rc == 0 && acc && acc->remote &&
                ckpt__s3_parse_url(acc->remote->url, &pb, &pp) == 0 && strcmp(pb, bucket) == 0;
    free(pb);
    free(pp);
    if (same) {
        rc = ckpt__acc_remote_open(acc);
        if (rc == 0) *r = &acc->remote->r;
    } else if (rc == 0) {
        char *root = ckpt__malloc(strlen(bucket) + 8);
        if (!root) rc = ckpt__err_nomem("s3 client");
        else sprintf(root, "s3://%s", bucket);
        if (rc == 0) rc = ckpt__remote_open(own, root);
        free(root);
        if (rc == 0) *r = own;
    }
    free(bucket);
    if (rc < 0) {
        free(key);
        return rc;
    }
    *dir = key;
    return 0;
}
