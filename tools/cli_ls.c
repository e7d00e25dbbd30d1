/* cli_ls.c — `ckpt ls`: a project's checkpoints and their status. */
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
    "usage: ckpt ls [--fast] [--json] PROJECT_DIR|CHECKPOINT_DIR|LOCAL_DIR\n"
    "\n"
    "Lists PROJECT_DIR/checkpoints/checkpoint_<n> (or the one checkpoint folder given):\n"
    "number, step, creation time (UTC), size and status: complete, partial (no\n"
    "manifest: not a checkpoint) or corrupt (the manifest or a file fails\n"
    "verification; the reason follows). Then any leftover temporary folders of\n"
    "interrupted saves ('ckpt prune' removes them). For one checkpoint folder, also\n"
    "the objects it holds, by name (a custom object's kind in parentheses).\n"
    "\n"
    "A node-local tier (train --local-dir, ckpt_project_config.local_dir) as one node\n"
    "has it (the folder its rank_<r> folders are in, one of them, or one checkpoint\n"
    "in one): each rank's saves with the parts they hold (its own and the other\n"
    "nodes' ranks it keeps a copy for), and what the folder lasts: one in memory\n"
    "(tmpfs, /dev/shm) is gone when the node stops.\n"
    "\n"
    "  --fast   check manifests only, not every file's checksum\n"
    "  --json   one JSON document instead of a table\n";

static void format_time(int64_t unix_s, char *buf, size_t cap) {
    time_t t = (time_t)unix_s;
    struct tm tm;
    if (unix_s <= 0 || !gmtime_r(&t, &tm) || !strftime(buf, cap, "%Y-%m-%d %H:%M:%S", &tm))
        snprintf(buf, cap, "-");
}

/* The objects of one checkpoint, by name (the file's stem: "model",
 * "rng_state"; a model saved as Hugging Face shards by its index), from its
 * manifest: a line, or, with json, an "objects" member. */
static void print_objects(const char *dir, bool json) {
    ckpt_checkpoint_file *files = NULL;
    int64_t n = 0;
    if (ckpt_checkpoint_files(dir, &files, &n) < 0) return;
    printf(json ? ",\"objects\":[" : "         objects:");
    int shown = 0;
    for (int64_t i = 0; i < n; i++) {
        const char *f = files[i].name;
        size_t len = strlen(f), cut = 0;
        if (!strcmp(files[i].kind, "extra") || cli_is_shard_file(f)) continue;
        if (len > 23 && !strcmp(f + len - 23, ".safetensors.index.json")) cut = 23;
        else if (len > 12 && !strcmp(f + len - 12, ".safetensors")) cut = 12;
        else continue;
        char name[256];
        snprintf(name, sizeof name, "%.*s", (int)(len - cut), f);
        if (json) {
            printf("%s{\"name\":", shown ? "," : "");
            cli_json_string(name);
            printf(",\"kind\":");
            cli_json_string(files[i].kind);
            putchar('}');
        } else {
            printf("%s %s", shown ? "," : "", cli_esc(name));
            if (!strcmp(files[i].kind, "custom")) printf(" (custom)");
        }
        shown++;
    }
    printf(json ? "]" : "\n");
    free(files);
}

/* Whether dir is a node-local tier's: a rank_<r> folder, a checkpoint folder
 * in one, or a folder holding rank_<r> folders. */
static bool is_rank_name(const char *name) {
    return strncmp(name, "rank_", 5) == 0 && name[5] &&
           strspn(name + 5, "0123456789") == strlen(name + 5);
}

static bool is_tier_dir(const char *dir) {
    char buf[PATH_MAX];
    snprintf(buf, sizeof buf, "%s", dir);
    size_t n = strlen(buf);
    while (n > 1 && buf[n - 1] == '/') buf[--n] = '\0';
    char *base = strrchr(buf, '/');
    if (is_rank_name(base ? base + 1 : buf)) return true;
    cli_kind kind = cli_classify(dir);
    if (kind == CLI_KIND_CHECKPOINT) {
        if (!base) return false;
        *base = '\0';
        char *up = strrchr(buf, '/');
        return is_rank_name(up ? up + 1 : buf);
    }
    if (kind != CLI_KIND_FOLDER) return false;
    /* a folder with rank_<r> folders in it (the library looks) */
    ckpt_tier_info *v = NULL;
    int64_t count = 0;
    bool tier = ckpt_tier_list(dir, false, &v, &count) == 0;
    free(v);
    ckpt_clear_error();
    return tier;
}

/* A node-local tier: every rank's folders, with the parts each holds. */
static int ls_tier(const char *dir, bool fast, bool json) {
    ckpt_tier_info *v = NULL;
    int64_t n = 0;
    int rc = ckpt_tier_list(dir, !fast, &v, &n);
    if (rc < 0) {
        cli_error("ls: %s", *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    bool ram = n > 0 && v[0].in_memory;
    const char *lasts = ram ? "in memory (tmpfs): it lasts only as long as the node runs"
                            : "on the node's disk: it lasts as long as that disk";
    if (json) {
        printf("{\"local_dir\":");
        cli_json_string(dir);
        printf(",\"in_memory\":%s,\"checkpoints\":[", ram ? "true" : "false");
    } else if (n == 0) {
        printf("no checkpoints in the node-local tier %s\n", cli_esc(dir));
    } else {
        printf("node-local tier %s, %s; the project folder keeps the persisted saves\n",
               cli_esc(dir), lasts);
        printf("%-5s %-8s %10s  %-19s  %10s  %-8s  %-10s %s\n", "RANK", "NUMBER", "STEP",
               "CREATED (UTC)", "SIZE", "STATUS", "PARTS", "PATH");
    }
    for (int64_t i = 0; i < n; i++) {
        const ckpt_tier_info *c = &v[i];
        char when[32], size[32], parts[96] = "", reason[1024] = "";
        format_time(c->created_unix, when, sizeof when);
        cli_human_bytes(c->bytes, size, sizeof size);
        for (int k = 0, used = 0; k < c->num_parts && used < (int)sizeof parts; k++)
            used += snprintf(parts + used, sizeof parts - (size_t)used, "%s%d", k ? "," : "",
                             c->parts[k]);
        if (c->status != CKPT_CHECKPOINT_COMPLETE) {
            ckpt_tier_info again;
            if (ckpt_tier_verify(c->path, !fast, &again) < 0)
                snprintf(reason, sizeof reason, "%s", ckpt_errmsg());
        }
        if (json) {
            printf("%s{\"rank\":%d,\"number\":%lld,\"step\":%lld,\"created_unix\":%lld,"
                   "\"bytes\":%llu,\"num_processes\":%d,\"status\":\"%s\",\"parts\":[%s],"
                   "\"in_memory\":%s,\"path\":",
                   i ? "," : "", c->rank, (long long)c->number, (long long)c->step,
                   (long long)c->created_unix, (unsigned long long)c->bytes, c->num_processes,
                   cli_status_name(c->status), parts, c->in_memory ? "true" : "false");
            cli_json_string(c->path);
            if (*reason) {
                printf(",\"error\":");
                cli_json_string(reason);
            }
            putchar('}');
            continue;
        }
        char rank[16], num[24];
        snprintf(rank, sizeof rank, "%d", c->rank);
        snprintf(num, sizeof num, "%lld", (long long)c->number);
        printf("%-5s %-8s %10lld  %-19s  %10s  %-8s  %-10s %s\n", rank, num, (long long)c->step,
               when, size, cli_status_name(c->status), *parts ? parts : "-", cli_esc(c->path));
        if (*reason) printf("         %s\n", cli_esc(reason));
    }
    if (json) printf("]}\n");
    free(v);
    return CLI_OK;
}

int cli_ls(int argc, char **argv) {
    bool fast = false, json = false;
    const char *dir;
    int rc = cli_parse_simple(argc, argv, ls_help, "--fast", &fast, "--json", &json, &dir);
    if (rc) return rc < 0 ? CLI_OK : rc;

    if (is_tier_dir(dir)) return ls_tier(dir, fast, json);
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
    else
        printf("%-8s %10s  %-19s  %10s  %-8s  %s\n", "NUMBER", "STEP", "CREATED (UTC)", "SIZE",
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
                   cli_status_name(c->status));
            cli_json_string(c->path);
            if (*reason) {
                printf(",\"error\":");
                cli_json_string(reason);
            }
            cli_print_metrics(c, true);
            if (single && c->status == CKPT_CHECKPOINT_COMPLETE) print_objects(c->path, true);
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
                   c->status == CKPT_CHECKPOINT_PARTIAL ? "-" : size, cli_status_name(c->status),
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
            if (single && c->status == CKPT_CHECKPOINT_COMPLETE) print_objects(c->path, false);
        }
    }
    if (json) putchar(']');
    if (!single) cli_print_leftovers(dir, json);
    if (json) printf("}\n");
    free(list);
    return CLI_OK;
}
