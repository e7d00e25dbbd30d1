/* cli_prune.c — `ckpt prune`: a project's rotation run by hand. */
#include <dirent.h>
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "cli.h"

static const char prune_help[] =
    "usage: ckpt prune PROJECT_DIR --keep N [--keep-every S] [--keep-best M:min|max:K]\n"
    "                  [--dry-run] [--force]\n"
    "\n"
    "Keeps the newest N valid (complete, deep-verified) checkpoints of PROJECT_DIR and\n"
    "removes the older ones; partial or corrupt checkpoints do not count toward N.\n"
    "The newest valid checkpoint is never removed (N >= 1). Partial or corrupt ones\n"
    "older than the newest valid checkpoint are removed, newer ones are kept. Leftover\n"
    "temporary folders of interrupted saves are removed too. Runs under the project's\n"
    "lock: while a save holds it, nothing is removed.\n"
    "\n"
    "  --keep-every S  also keep every valid checkpoint whose step is a multiple of S\n"
    "  --keep-best M:min|max:K\n"
    "                  also keep the K best valid checkpoints by metric M (lowest with\n"
    "                  min, highest with max; one without M is never among them; a tie\n"
    "                  goes to the newer). With either, --keep defaults to 1, the newest\n"
    "                  valid checkpoint always stays, and --keep 0 adds nothing\n"
    "  --dry-run  print what would be removed and why; remove nothing\n"
    "  --force    needed with --keep 0, which removes every checkpoint\n";

typedef struct prune_log {
    bool dry_run;
    bool policy; /* --keep-every / --keep-best */
    int64_t keep;
    int64_t leftovers;
    char kept_by[256]; /* the policies given: "--keep 3, --keep-every 100 or ..." */
} prune_log;

/* pl->kept_by: the retention options given, in words, and only those. */
static void prune_policies(prune_log *pl, int64_t every, const char *best) {
    const char *part[3];
    char b[3][160];
    int n = 0;
    if (pl->keep > 1) snprintf(b[n++], sizeof b[0], "--keep %lld", (long long)pl->keep);
    if (every > 0) snprintf(b[n++], sizeof b[0], "--keep-every %lld", (long long)every);
    if (best) snprintf(b[n++], sizeof b[0], "--keep-best %s", best);
    for (int i = 0; i < n; i++) part[i] = b[i];
    pl->kept_by[0] = '\0';
    for (int i = 0; i < n; i++) {
        size_t used = strlen(pl->kept_by);
        snprintf(pl->kept_by + used, sizeof pl->kept_by - used, "%s%s",
                 i == 0       ? ""
                 : i == n - 1 ? " or "
                              : ", ",
                 part[i]);
    }
}

static void prune_report(void *user, const char *path, ckpt_prune_reason reason, const char *why) {
    prune_log *pl = user;
    const char *verb = pl->dry_run ? "would remove" : "removing";
    path = cli_esc(path);
    why = why ? cli_esc(why) : NULL;
    switch (reason) {
    case CKPT_PRUNE_OLD:
        if (pl->policy)
            printf("%s %s  (valid, not the newest, not kept by %s)\n", verb, path, pl->kept_by);
        else if (pl->keep == 0) printf("%s %s  (--keep 0: every checkpoint goes)\n", verb, path);
        else if (why)
            printf("%s %s  (older than the newest %lld valid; it fails verification too: %s)\n",
                   verb, path, (long long)pl->keep, why);
        else
            printf("%s %s  (valid, older than the newest %lld valid)\n", verb, path,
                   (long long)pl->keep);
        break;
    case CKPT_PRUNE_INVALID:
        printf("%s %s  (not valid, older than the newest valid checkpoint: %s)\n", verb, path,
               why ? why : "fails verification");
        break;
    case CKPT_PRUNE_LEFTOVER:
        printf("%s %s  (temporary folder of an interrupted save)\n", verb, path);
        pl->leftovers++;
        break;
    }
}

/* Whether any checkpoint of the project records metric (ckpt_set_metric):
 * ranking by a metric none has would keep none of them, so a misspelt name
 * would remove the best checkpoints. *names gets the metrics they do record
 * (for the message). */
static bool metric_recorded(const char *dir, const char *metric, char *names, size_t cap) {
    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    names[0] = '\0';
    if (ckpt_checkpoint_list(dir, false, &list, &n) < 0) return true; /* prune reports it */
    bool found = n == 0; /* nothing to remove either way */
    for (int64_t i = 0; i < n; i++) {
        for (int j = 0; j < list[i].num_metrics; j++) {
            const char *m = list[i].metrics[j].name;
            if (!strcmp(m, metric)) found = true;
            size_t used = strlen(names), len = strlen(m);
            bool listed = false;
            for (const char *p = strstr(names, m); p && !listed; p = strstr(p + 1, m))
                listed = (p == names || p[-1] == ' ') && (p[len] == ',' || p[len] == '\0');
            if (!listed && used + len + 3 < cap)
                snprintf(names + used, cap - used, "%s%s", used ? ", " : "", m);
        }
    }
    free(list);
    return found;
}

int cli_prune(int argc, char **argv) {
    const char *dir = NULL;
    int64_t keep = -1, every = 0, best_k = 0;
    char metric[64] = "";
    const char *best_arg = NULL;
    ckpt_best_mode mode = CKPT_BEST_MIN;
    bool dry_run = false, force = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(prune_help, stdout);
            return CLI_OK;
        } else if (!strcmp(a, "--keep") || !strncmp(a, "--keep=", 7)) {
            const char *v = a[6] == '=' ? a + 7 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return cli_usage_error("prune", "--keep needs a value");
            if (!cli_parse_i64(v, 0, INT32_MAX, &keep))
                return cli_usage_error("prune", "bad value for --keep: '%s'", v);
        } else if (!strcmp(a, "--keep-every") || !strncmp(a, "--keep-every=", 13)) {
            const char *v = a[12] == '=' ? a + 13 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return cli_usage_error("prune", "--keep-every needs a value");
            if (!cli_parse_i64(v, 1, INT64_MAX, &every))
                return cli_usage_error("prune",
                                       "bad value for --keep-every: '%s', expected steps >= 1", v);
        } else if (!strcmp(a, "--keep-best") || !strncmp(a, "--keep-best=", 12)) {
            const char *v = a[11] == '=' ? a + 12 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return cli_usage_error("prune", "--keep-best needs a value");
            best_arg = v;
            if (!cli_parse_keep_best(v, metric, sizeof metric, &mode, &best_k))
                return cli_usage_error("prune",
                                       "bad value for --keep-best: '%s', expected "
                                       "METRIC:min:K or METRIC:max:K (e.g. val_loss:min:3)",
                                       v);
        } else if (!strcmp(a, "--dry-run")) {
            dry_run = true;
        } else if (!strcmp(a, "--force")) {
            force = true;
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("prune", "unknown option '%s'", a);
        } else if (dir) {
            return cli_usage_error("prune", "unexpected argument '%s'", a);
        } else {
            dir = a;
        }
    }
    if (!dir) return cli_usage_error("prune", "missing PROJECT_DIR");
    bool policy = every > 0 || best_k > 0;
    if (keep < 0 && policy) keep = 1;
    if (keep < 0) return cli_usage_error("prune", "missing --keep N");
    if (keep == 0 && !policy && !force && !dry_run)
        return cli_usage_error("prune", "--keep 0 removes every checkpoint, the valid ones too; "
                                        "add --force if that is what you want");
    cli_kind kind = cli_classify(dir);
    if (kind == CLI_KIND_CHECKPOINT)
        return cli_usage_error("prune",
                               "%s is a checkpoint folder; expected the project folder "
                               "that holds its checkpoints folder",
                               dir);
    if (best_k > 0) {
        char names[512];
        if (!metric_recorded(dir, metric, names, sizeof names)) {
            cli_error("prune: no checkpoint of %s records the metric '%s' (%s%s); --keep-best "
                      "would keep none by it, so nothing was removed",
                      dir, metric, *names ? "they record: " : "they record no metrics", names);
            return CLI_USAGE;
        }
    }
    prune_log pl = {.dry_run = dry_run, .policy = policy, .keep = keep};
    prune_policies(&pl, every, best_k > 0 ? best_arg : NULL);
    ckpt_prune_options o = {.keep = (int)keep,
                            .dry_run = dry_run,
                            .report = prune_report,
                            .user = &pl,
                            .keep_every_steps = every,
                            .best_metric = best_k ? metric : NULL,
                            .best_mode = mode,
                            .best_k = (int)best_k};
    int64_t removed = 0, valid = 0;
    o.valid_kept = &valid;
    int rc = ckpt_checkpoint_prune_ex(dir, &o, &removed);
    if (rc < 0) {
        cli_error("prune: %s%s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc),
                  rc == CKPT_EBUSY ? "; nothing removed, try again when the save is done" : "");
        return CLI_RUNTIME;
    }
    printf("%s %lld checkpoint%s and %lld leftover folder%s from %s, ",
           dry_run ? "would remove" : "removed", (long long)removed, removed == 1 ? "" : "s",
           (long long)pl.leftovers, pl.leftovers == 1 ? "" : "s", cli_esc(dir));
    const char *kept = dry_run ? "would keep" : "kept";
    if (keep == 0 && !policy) {
        printf("%s none (--keep 0)\n", kept);
        return CLI_OK;
    }
    if (valid == 0) {
        /* nothing to fall back to: the library removes no checkpoint then */
        printf("%s every checkpoint: none is valid ('ckpt verify %s' says why)\n", kept,
               cli_esc(dir));
        return CLI_OK;
    }
    printf("%s %lld valid checkpoint%s: the newest %lld", kept, (long long)valid,
           valid == 1 ? "" : "s", (long long)(keep < valid ? keep : valid));
    if (every > 0) printf(", every step multiple of %lld", (long long)every);
    if (best_k > 0)
        printf(", the best %lld by %s (%s)", (long long)best_k, cli_esc(metric),
               mode == CKPT_BEST_MIN ? "min" : "max");
    putchar('\n');
    return CLI_OK;
}
