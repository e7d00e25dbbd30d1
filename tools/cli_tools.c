/* cli_tools.c — `ckpt ls`, `ckpt verify`, `ckpt prune`: a project's
 * checkpoints, their status and their rotation. */
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
    "usage: ckpt ls [--fast] [--json] PROJECT_DIR\n"
    "\n"
    "Lists PROJECT_DIR/checkpoints/checkpoint_<n>: number, step, creation time (UTC),\n"
    "size and status: complete, partial (no manifest: an interrupted save) or corrupt\n"
    "(the manifest or a file fails verification; the reason follows).\n"
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
    "usage: ckpt prune PROJECT_DIR --keep N\n"
    "\n"
    "Removes all but the newest N automatic checkpoints of PROJECT_DIR (under the\n"
    "project's lock, so never during another process's save).\n";

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

/* ---- ls ------------------------------------------------------------------ */

int cli_ls(int argc, char **argv) {
    bool fast = false, json = false;
    const char *dir;
    int rc = parse_simple(argc, argv, ls_help, "--fast", &fast, "--json", &json, &dir);
    if (rc) return rc < 0 ? CLI_OK : rc;

    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    rc = ckpt_checkpoint_list(dir, !fast, &list, &n);
    if (rc < 0) {
        cli_error("ls: %s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    if (json) printf("{\"project_dir\":");
    if (json) cli_json_string(dir);
    if (json) printf(",\"checkpoints\":[");
    else if (n == 0) printf("no checkpoints in %s\n", dir);
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
                   "\"bytes\":%llu,\"files\":%d,\"num_processes\":%d,\"status\":\"%s\","
                   "\"path\":",
                   i ? "," : "", (long long)c->number, (long long)c->step, (long long)c->iteration,
                   (long long)c->created_unix, (unsigned long long)c->total_bytes, c->num_files,
                   c->num_processes, status_name(c->status));
            cli_json_string(c->path);
            if (*reason) {
                printf(",\"error\":");
                cli_json_string(reason);
            }
            putchar('}');
        } else {
            char stepbuf[32];
            if (c->status == CKPT_CHECKPOINT_PARTIAL) snprintf(stepbuf, sizeof stepbuf, "-");
            else snprintf(stepbuf, sizeof stepbuf, "%lld", (long long)c->step);
            printf("%-8lld %10s  %-19s  %10s  %-8s  %s", (long long)c->number, stepbuf,
                   c->status == CKPT_CHECKPOINT_PARTIAL ? "-" : when,
                   c->status == CKPT_CHECKPOINT_PARTIAL ? "-" : size, status_name(c->status),
                   c->path);
            if (c->num_processes > 1) printf("  (%d processes)", c->num_processes);
            putchar('\n');
            if (*reason) printf("         %s\n", reason);
        }
    }
    if (json) printf("]}\n");
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
        if (info.num_processes > 1) snprintf(procs, sizeof procs, ", %d processes", info.num_processes);
        printf("ok       %s  (step %lld, %d files, %s%s)\n", dir, (long long)info.step,
               info.num_files, cli_human_bytes(info.total_bytes, size, sizeof size), procs);
        return true;
    }
    const char *msg = *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc);
    const char *what = info.status == CKPT_CHECKPOINT_COMPLETE ? "failed" : status_name(info.status);
    printf("%-8s %s\n         %s\n", what, dir, msg);
    return false;
}

int cli_verify(int argc, char **argv) {
    const char *path;
    int rc = parse_simple(argc, argv, verify_help, NULL, NULL, NULL, NULL, &path);
    if (rc) return rc < 0 ? CLI_OK : rc;
    struct stat st;
    if (stat(path, &st) != 0) {
        cli_error("verify: %s: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    if (!S_ISDIR(st.st_mode)) {
        /* one state file: everything but a checksum can be checked */
        ckpt_reader *r = NULL;
        rc = ckpt_reader_open(&r, path);
        if (rc < 0) {
            printf("corrupt  %s\n         %s\n", path, *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
            return CLI_DIFFER;
        }
        printf("ok       %s  (%lld entries, well-formed; checksums live in a checkpoint's manifest)\n",
               path, (long long)ckpt_reader_count(r));
        ckpt_reader_free(r);
        return CLI_OK;
    }

    char sub[PATH_MAX], manifest[PATH_MAX];
    snprintf(sub, sizeof sub, "%s/checkpoints", path);
    snprintf(manifest, sizeof manifest, "%s/checkpoint.json", path);
    bool project = is_dir(sub) && access(manifest, F_OK) != 0;
    if (!project) return verify_one(path) ? CLI_OK : CLI_DIFFER;

    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    rc = ckpt_checkpoint_list(path, false, &list, &n);
    if (rc < 0) {
        cli_error("verify: %s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) bad += !verify_one(list[i].path);
    free(list);
    if (n == 0) {
        printf("no checkpoints in %s\n", path);
        return CLI_DIFFER;
    }
    printf("%lld of %lld checkpoints verified%s\n", (long long)(n - bad), (long long)n,
           bad ? "; see above for the failures" : "");
    return bad ? CLI_DIFFER : CLI_OK;
}

/* ---- prune --------------------------------------------------------------- */

int cli_prune(int argc, char **argv) {
    const char *dir = NULL;
    int64_t keep = -1;
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
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("prune", "unknown option '%s'", a);
        } else if (dir) {
            return cli_usage_error("prune", "unexpected argument '%s'", a);
        } else {
            dir = a;
        }
    }
    if (!dir) return cli_usage_error("prune", "missing PROJECT_DIR");
    if (keep < 0) return cli_usage_error("prune", "missing --keep N");
    int64_t removed = 0;
    int rc = ckpt_checkpoint_prune(dir, (int)keep, &removed);
    if (rc < 0) {
        cli_error("prune: %s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    printf("removed %lld checkpoint%s from %s, kept the newest %lld\n", (long long)removed,
           removed == 1 ? "" : "s", dir, (long long)keep);
    return CLI_OK;
}
