/* cli_tools.c — `ckpt ls`, `ckpt verify`, `ckpt prune`: a project's
 * checkpoints, their status and their rotation. */
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

static const char ls_help[] =
    "usage: ckpt ls [--fast] [--json] PROJECT_DIR|CHECKPOINT_DIR\n"
    "\n"
    "Lists PROJECT_DIR/checkpoints/checkpoint_<n> (or the one checkpoint folder given):\n"
    "number, step, creation time (UTC), size and status: complete, partial (no\n"
    "manifest: not a checkpoint) or corrupt (the manifest or a file fails\n"
    "verification; the reason follows). Then any leftover temporary folders of\n"
    "interrupted saves ('ckpt prune' removes them).\n"
    "\n"
    "  --fast   check manifests only, not every file's checksum\n"
    "  --json   one JSON document instead of a table\n";

static const char verify_help[] =
    "usage: ckpt verify PATH\n"
    "\n"
    "PATH is a checkpoint folder or a project folder (then every checkpoint in it),\n"
    "or one .safetensors file (then only its structure can be checked).\n"
    "Checks the manifest and every file's size and checksum, and that every state\n"
    "file is well-formed. Prints what fails, naming the file. Exit 0 only if all\n"
    "is good, 1 if something fails verification, 3 if PATH cannot be read.\n";

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

static const char *status_name(ckpt_checkpoint_status s) {
    switch (s) {
    case CKPT_CHECKPOINT_COMPLETE: return "complete";
    case CKPT_CHECKPOINT_PARTIAL: return "partial";
    case CKPT_CHECKPOINT_CORRUPT: return "corrupt";
    }
    return "unknown";
}

static void format_time(int64_t unix_s, char *buf, size_t cap) {
    time_t t = (time_t)unix_s;
    struct tm tm;
    if (unix_s <= 0 || !gmtime_r(&t, &tm) || !strftime(buf, cap, "%Y-%m-%d %H:%M:%S", &tm))
        snprintf(buf, cap, "-");
}

/* Parses "[options] ARG" where the only options are the given flags. Returns
 * 0 with *arg set, -1 after --help, or CLI_USAGE. */
static int parse_simple(int argc, char **argv, const char *help, const char *flag1, bool *val1,
                        const char *flag2, bool *val2, const char **arg) {
    *arg = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(help, stdout);
            return -1;
        } else if (flag1 && !strcmp(a, flag1)) {
            *val1 = true;
        } else if (flag2 && !strcmp(a, flag2)) {
            *val2 = true;
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error(argv[0], "unknown option '%s'", a);
        } else if (*arg) {
            return cli_usage_error(argv[0], "unexpected argument '%s'", a);
        } else {
            *arg = a;
        }
    }
    if (!*arg) return cli_usage_error(argv[0], "missing argument");
    return 0;
}

/* Prints the project's leftover temporary folders (if any) after a table. */
static void print_leftovers(const char *project, bool json) {
    ckpt_leftover_info *lo = NULL;
    int64_t n = 0;
    if (ckpt_checkpoint_leftovers(project, &lo, &n) < 0) n = 0;
    if (json) printf(",\"leftovers\":[");
    for (int64_t i = 0; i < n; i++) {
        if (json) {
            printf("%s{\"path\":", i ? "," : "");
            cli_json_string(lo[i].path);
            printf(",\"pid\":%lld,\"running\":%s}", (long long)lo[i].pid,
                   lo[i].running ? "true" : "false");
        } else if (lo[i].running) {
            printf("in use   %s  (process %lld is running: a save in progress?)\n",
                   cli_esc(lo[i].path), (long long)lo[i].pid);
        } else {
            printf("leftover %s  (temporary folder of an interrupted save; 'ckpt prune %s --keep N'"
                   " removes it)\n",
                   cli_esc(lo[i].path), cli_esc(project));
        }
    }
    if (json) putchar(']');
    free(lo);
}

/* ---- ls ------------------------------------------------------------------ */

int cli_ls(int argc, char **argv) {
    bool fast = false, json = false;
    const char *dir;
    int rc = parse_simple(argc, argv, ls_help, "--fast", &fast, "--json", &json, &dir);
    if (rc) return rc < 0 ? CLI_OK : rc;

    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    bool single = cli_classify(dir) == CLI_KIND_CHECKPOINT;
    if (single) {
        /* a checkpoint folder: list that one */
        list = calloc(1, sizeof *list);
        if (!list) {
            cli_error("ls: out of memory");
            return CLI_RUNTIME;
        }
        (void)ckpt_checkpoint_verify(dir, !fast, list);
        n = 1;
    } else if ((rc = ckpt_checkpoint_list(dir, !fast, &list, &n)) < 0) {
        cli_error("ls: %s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    if (json) printf("{\"project_dir\":");
    if (json) cli_json_string(dir);
    if (json) printf(",\"checkpoints\":[");
    else if (n == 0) printf("no checkpoints in %s\n", cli_esc(dir));
    else printf("%-8s %10s  %-19s  %10s  %-8s  %s\n", "NUMBER", "STEP", "CREATED (UTC)", "SIZE",
                "STATUS", "PATH");
    for (int64_t i = 0; i < n; i++) {
        const ckpt_checkpoint_info *c = &list[i];
        char when[32], size[32], reason[1024] = "";
        format_time(c->created_unix, when, sizeof when);
        cli_human_bytes(c->total_bytes, size, sizeof size);
        if (c->status == CKPT_CHECKPOINT_CORRUPT) {
            /* the list gives the status; a second look gives the reason */
            ckpt_checkpoint_info again;
            if (ckpt_checkpoint_verify(c->path, !fast, &again) < 0)
                snprintf(reason, sizeof reason, "%s", ckpt_errmsg());
        }
        if (json) {
            printf("%s{\"number\":%lld,\"step\":%lld,\"iteration\":%lld,\"created_unix\":%lld,"
                   "\"bytes\":%llu,\"shared_bytes\":%llu,\"files\":%d,\"num_processes\":%d,"
                   "\"status\":\"%s\",\"path\":",
                   i ? "," : "", (long long)c->number, (long long)c->step, (long long)c->iteration,
                   (long long)c->created_unix, (unsigned long long)c->total_bytes,
                   (unsigned long long)c->shared_bytes, c->num_files, c->num_processes,
                   status_name(c->status));
            cli_json_string(c->path);
            if (*reason) {
                printf(",\"error\":");
                cli_json_string(reason);
            }
            cli_print_metrics(c, true);
            putchar('}');
        } else {
            char stepbuf[32];
            if (c->status == CKPT_CHECKPOINT_PARTIAL) snprintf(stepbuf, sizeof stepbuf, "-");
            else snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)c->step);
            char num[24];
            if (c->number < 0) snprintf(num, sizeof num, "-");
            else snprintf(num, sizeof num, "%lld", (long long)c->number);
            printf("%-8s %10s  %-19s  %10s  %-8s  %s", num, stepbuf,
                   c->status == CKPT_CHECKPOINT_PARTIAL ? "-" : when,
                   c->status == CKPT_CHECKPOINT_PARTIAL ? "-" : size, status_name(c->status),
                   cli_esc(c->path));
            if (c->num_processes > 1) printf("  (%d processes)", c->num_processes);
            if (c->shared_bytes > 0) {
                char shared[32];
                printf("  (%s shared with the previous)",
                       cli_human_bytes(c->shared_bytes, shared, sizeof shared));
            }
            cli_print_metrics(c, false);
            putchar('\n');
            if (*reason) printf("         %s\n", cli_esc(reason));
        }
    }
    if (json) putchar(']');
    if (!single) print_leftovers(dir, json);
    if (json) printf("}\n");
    free(list);
    return CLI_OK;
}

/* ---- verify -------------------------------------------------------------- */

static bool is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

/* Verifies one checkpoint folder and prints one line (and the reason). */
static bool verify_one(const char *dir) {
    ckpt_checkpoint_info info;
    memset(&info, 0, sizeof info);
    int rc = ckpt_checkpoint_verify(dir, true, &info);
    if (rc == CKPT_OK) {
        char size[32];
        char procs[48] = "";
        if (info.num_processes > 1)
            snprintf(procs, sizeof procs, ", %d processes", info.num_processes);
        printf("ok       %s  (step %lld, %d files, %s%s)\n", cli_esc(dir), (long long)info.step,
               info.num_files, cli_human_bytes(info.total_bytes, size, sizeof size), procs);
        return true;
    }
    const char *msg = *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc);
    const char *what =
        info.status == CKPT_CHECKPOINT_COMPLETE ? "failed" : status_name(info.status);
    printf("%-8s %s\n         %s\n", what, cli_esc(dir), cli_esc(msg));
    return false;
}

/* Checkpoint i failed: for each of its files that other checkpoints share
 * (one copy on disk, linked by incremental saves) and that is damaged, names
 * every checkpoint holding that copy, since the damage is theirs too. */
static void name_sharers(const ckpt_checkpoint_info *list, int64_t n, int64_t i) {
    ckpt_checkpoint_file *files = NULL;
    int64_t nf = 0;
    if (ckpt_checkpoint_files(list[i].path, &files, &nf) < 0) return;
    for (int64_t f = 0; f < nf; f++) {
        if (files[f].links < 2 || ckpt_checkpoint_verify_file(list[i].path, files[f].name) == 0)
            continue;
        printf("         %s is one copy on disk shared by:", cli_esc(files[f].name));
        for (int64_t j = 0; j < n; j++) {
            ckpt_checkpoint_file *other = NULL;
            int64_t no = 0;
            if (ckpt_checkpoint_files(list[j].path, &other, &no) < 0) continue;
            for (int64_t k = 0; k < no; k++)
                if (other[k].inode == files[f].inode && other[k].device == files[f].device &&
                    other[k].inode != 0) {
                    const char *base = strrchr(list[j].path, '/');
                    printf(" %s", cli_esc(base ? base + 1 : list[j].path));
                    break;
                }
            free(other);
        }
        putchar('\n');
    }
    free(files);
}

/* A folder without a manifest that a save could have left: named like a
 * checkpoint or a save's temporary folder, or holding a state file. Else it
 * is some other folder, and verify says so rather than "partial". */
static bool looks_like_partial(const char *dir) {
    const char *base = strrchr(dir, '/');
    base = base && base[1] ? base + 1 : dir;
    if (!strncmp(base, "checkpoint_", 11) || (base[0] == '.' && strstr(base, ".tmp."))) return true;
    DIR *d = opendir(dir);
    if (!d) return true; /* let the verification name the error */
    bool found = false;
    struct dirent *e;
    while (!found && (e = readdir(d)) != NULL) {
        size_t n = strlen(e->d_name);
        found = n > 12 && !strcmp(e->d_name + n - 12, ".safetensors");
    }
    closedir(d);
    return found;
}

int cli_verify(int argc, char **argv) {
    const char *path;
    int rc = parse_simple(argc, argv, verify_help, NULL, NULL, NULL, NULL, &path);
    if (rc) return rc < 0 ? CLI_OK : rc;
    bool url = strncmp(path, "s3://", 5) == 0;
    cli_kind ukind = url ? cli_classify(path) : CLI_KIND_MISSING;
    if (url && ukind == CLI_KIND_MISSING) {
        cli_error("verify: %s: %s", path, *ckpt_errmsg() ? ckpt_errmsg() : strerror(errno));
        return CLI_RUNTIME;
    }
    if (url && ukind == CLI_KIND_CHECKPOINT) return verify_one(path) ? CLI_OK : CLI_DIFFER;
    struct stat st;
    if (!url && stat(path, &st) != 0) {
        cli_error("verify: %s: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    if (!url && !S_ISDIR(st.st_mode)) {
        cli_kind kind = cli_classify(path);
        if (kind == CLI_KIND_TORCH_ZIP)
            return cli_wrong_kind("verify", path, kind,
                                  "a checkpoint, a project or a .safetensors file");
        /* one state file: everything but a checksum can be checked */
        ckpt_reader *r = NULL;
        rc = ckpt_reader_open(&r, path);
        if (rc < 0) {
            printf("corrupt  %s\n         %s\n", cli_esc(path),
                   cli_esc(*ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc)));
            return CLI_DIFFER;
        }
        printf(
            "ok       %s  (%lld entries, well-formed; checksums live in a checkpoint's manifest)\n",
            cli_esc(path), (long long)ckpt_reader_count(r));
        ckpt_reader_free(r);
        return CLI_OK;
    }

    char sub[PATH_MAX], manifest[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/checkpoints", path);
    snprintf(manifest, sizeof manifest, "%s/checkpoint.json", path);
    bool has_manifest = !url && access(manifest, F_OK) == 0;
    bool project = url || (is_dir(sub) && !has_manifest);
    if (!project && !has_manifest && !looks_like_partial(path))
        return cli_wrong_kind("verify", path, CLI_KIND_FOLDER,
                              "a checkpoint folder, a project or a .safetensors file");
    if (!project) return verify_one(path) ? CLI_OK : CLI_DIFFER;

    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    rc = ckpt_checkpoint_list(path, false, &list, &n);
    if (rc < 0) {
        cli_error("verify: %s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++)
        if (!verify_one(list[i].path)) {
            bad++;
            name_sharers(list, n, i);
        }
    free(list);
    if (n == 0) printf("no checkpoints in %s\n", cli_esc(path));
    else printf("%lld of %lld checkpoints verified%s\n", (long long)(n - bad), (long long)n,
                bad ? "; see above for the failures" : "");
    print_leftovers(path, false);
    if (n == 0) return CLI_DIFFER;
    return bad ? CLI_DIFFER : CLI_OK;
}

/* ---- prune --------------------------------------------------------------- */

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
        else printf("%s %s  (valid, older than the newest %lld valid)\n", verb, path,
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
        return cli_usage_error("prune", "%s is a checkpoint folder; expected the project folder "
                                        "that holds its checkpoints folder", dir);
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
    int64_t removed = 0;
    int rc = ckpt_checkpoint_prune_ex(dir, &o, &removed);
    if (rc < 0) {
        cli_error("prune: %s%s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc),
                  rc == CKPT_EBUSY ? "; nothing removed, try again when the save is done" : "");
        return CLI_RUNTIME;
    }
    printf("%s %lld checkpoint%s and %lld leftover folder%s from %s, kept the newest %lld valid",
           dry_run ? "would remove" : "removed", (long long)removed, removed == 1 ? "" : "s",
           (long long)pl.leftovers, pl.leftovers == 1 ? "" : "s", cli_esc(dir), (long long)keep);
    if (every > 0) printf(", every step multiple of %lld", (long long)every);
    if (best_k > 0)
        printf(", the best %lld by %s (%s)", (long long)best_k, cli_esc(metric),
               mode == CKPT_BEST_MIN ? "min" : "max");
    putchar('\n');
    return CLI_OK;
}
