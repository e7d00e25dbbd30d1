/* remote_load.c — the load of an accelerator whose project folder is in
 * object storage (remote.c says how): the checkpoint chosen in the bucket
 * is copied into the staging folder, verified as it arrives, then loaded
 * as a local folder, and the copy removed. The public ckpt_load_state(_ex)
 * live here: a local load goes straight to load.c. */
#include "accel/remote.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "base/io.h"
#include "store/s3/project.h"
#include "store/s3/remote.h"
#include "store/store.h"

/* ---- loads ------------------------------------------------------------------ */

int ckpt__acc_remote_prefetch(ckpt_accelerator *acc, const char *input_dir, char **local,
                              char **url) {
    *local = NULL;
    *url = NULL;
    struct ckpt_acc_remote *rm = acc->remote;
    if (input_dir ? !ckpt__s3_is_url(input_dir) : !rm) return 0; /* a local folder */
    if (rm) CKPT_TRY(ckpt__acc_remote_refuse_mpi(acc, "load_state"));
    ckpt__acc_remote_after_load(acc, NULL); /* no stale copy may be chosen */
    char *cdir = ckpt__checkpoints_dir(acc->project_dir ? acc->project_dir : ".");
    if (!cdir) return ckpt__err_nomem("load path");
    int rc = 0;
    if (input_dir) {
        /* an explicit checkpoint URL: a verified copy in a private folder */
        char *root = NULL;
        free(cdir);
        rc = ckpt__remote_checkout(input_dir, local, &root);
        free(root); /* the parent of *local: after_load removes it */
        if (rc == 0 && !(*url = ckpt__strdup(input_dir))) rc = ckpt__err_nomem("load path");
        if (rc < 0) rc = ckpt__err_prefix(rc, "load_state");
        return rc;
    }
    /* the project's newest checkpoint that arrives whole and verified; a
     * damaged one is skipped with a warning (the fallback of a local load) */
    rc = ckpt__acc_remote_open(acc);
    ckpt_remote_entry *v = NULL;
    int64_t n = 0;
    if (rc == 0) rc = ckpt__remote_scan(&rm->r, &v, &n);
    if (rc == 0) rc = ckpt__mkdirs(cdir);
    for (int64_t i = n - 1; rc == 0 && i >= 0; i--) {
        if (!v[i].committed) continue;
        char rel[80], name[48];
        snprintf(name, sizeof name, "checkpoint_%" PRId64, v[i].number);
        snprintf(rel, sizeof rel, "checkpoints/%s", name);
        char *dir = ckpt__remote_key(&rm->r, rel);
        char *dst = ckpt__path_join(cdir, name);
        if (!dir || !dst) rc = ckpt__err_nomem("load path");
        struct stat st;
        if (rc == 0 && ckpt__os_lstat(dst, &st) == 0) rc = ckpt__remove_tree(dst);
        int frc = rc == 0 ? ckpt__remote_fetch(&rm->r, dir, dst, &acc->log) : rc;
        free(dir);
        free(dst);
        if (frc == 0) {
            if (!(*url = ckpt__acc_remote_checkpoint_url(acc, v[i].number)))
                rc = ckpt__err_nomem("load path");
            break;
        }
        if (frc != CKPT_ECORRUPT && frc != CKPT_ENOENT) {
            rc = ckpt__err_prefix(frc, "load_state");
            break;
        }
        ckpt__log(&acc->log, CKPT_LOG_WARNING, "skipping %s/%s: %s%s", rm->url, rel, ckpt_errmsg(),
                  i > 0 ? "; falling back to an older checkpoint" : "");
    }
    free(v);
    free(cdir);
    return rc;
}

int ckpt_load_state(ckpt_accelerator *acc, const char *input_dir) {
    return ckpt_load_state_ex(acc, input_dir, NULL, NULL);
}

int ckpt_load_state_ex(ckpt_accelerator *acc, const char *input_dir, const ckpt_load_options *opt,
                       ckpt_load_report *report) {
    if (!acc || (!acc->remote && !ckpt__s3_is_url(input_dir)))
        return ckpt__load_state_local(acc, input_dir, opt, report);
    if (report) memset(report, 0, sizeof *report);
    char *local = NULL, *url = NULL;
    int rc = ckpt__acc_remote_prefetch(acc, input_dir, &local, &url);
    if (rc < 0) {
        free(url);
        ckpt__acc_remote_after_load(acc, local);
        /* as a local load's failure: saves refuse until a load succeeds
         * (no such checkpoint aside) */
        if (rc != CKPT_ENOENT) {
            free(acc->load_failed_msg);
            acc->load_failed_msg = ckpt__strdup(ckpt_errmsg());
            acc->load_failed = true;
            acc->load_failed_code = rc;
        }
        return rc;
    }
    rc = ckpt__load_state_local(acc, local ? local : input_dir, opt, report);
    /* what was loaded is the bucket's checkpoint, not the copy (gone now) */
    if (rc == 0 && url && report) {
        char *d = ckpt__strdup(url);
        if (d) {
            free(report->dir);
            report->dir = d;
        }
    }
    if (rc == 0 && url) {
        free(acc->last_dir);
        acc->last_dir = url;
        url = NULL;
        free(acc->link_dir);
        acc->link_dir = NULL;
    }
    free(url);
    ckpt__acc_remote_after_load(acc, local);
    return rc;
}

void ckpt__acc_remote_after_load(ckpt_accelerator *acc, char *local) {
    /* the local copies go: the next load reads the bucket again */
    char *cdir = acc->project_dir ? ckpt__checkpoints_dir(acc->project_dir) : NULL;
    if (cdir && acc->remote) {
        int64_t *nums = NULL, count = 0;
        if (ckpt__list_numbers(cdir, &nums, &count) == 0)
            for (int64_t i = 0; i < count; i++) {
                char name[48];
                snprintf(name, sizeof name, "checkpoint_%" PRId64, nums[i]);
                char *p = ckpt__path_join(cdir, name);
                if (p) (void)ckpt__remove_tree(p);
                free(p);
            }
        free(nums);
    }
    if (local) {
        /* a checkout: <root>/checkpoint */
        char *root = ckpt__strdup(local);
        char *slash = root ? strrchr(root, '/') : NULL;
        if (slash) *slash = '\0';
        ckpt__remote_checkout_done(local, slash ? root : NULL);
        if (!slash) free(root);
    } else {
        free(local);
    }
    free(cdir);
}
