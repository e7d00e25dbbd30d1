/* cli_verify.c — `ckpt verify`: every file of a checkpoint (or of all of a
 * project's) against its manifest. */
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

static const char verify_help[] =
    "usage: ckpt verify PATH\n"
    "\n"
    "PATH is a checkpoint folder or a project folder (then every checkpoint in it),\n"
    "or one .safetensors file (then only its structure can be checked).\n"
    "Checks the manifest and every file's size and checksum, and that every state\n"
    "file is well-formed. Prints what fails, naming the file. Exit 0 only if all\n"
    "is good, 1 if something fails verification, 3 if PATH cannot be read.\n";

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
        info.status == CKPT_CHECKPOINT_COMPLETE ? "failed" : cli_status_name(info.status);
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
    int rc = cli_parse_simple(argc, argv, verify_help, NULL, NULL, NULL, NULL, &path);
    if (rc) return rc < 0 ? CLI_OK : rc;
    /* object storage: a checkpoint or a project URL, checked by the library */
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
    bool project = url || (cli_is_dir(sub) && !has_manifest);
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
    else
        printf("%lld of %lld checkpoints verified%s\n", (long long)(n - bad), (long long)n,
               bad ? "; see above for the failures" : "");
    cli_print_leftovers(path, false);
    if (n == 0) return CLI_DIFFER;
    return bad ? CLI_DIFFER : CLI_OK;
}
