/* cli_files.c — the state files of a checkpoint folder as `ckpt inspect`
 * and `ckpt diff` see them: listed by name, a Hugging Face sharded model by
 * its index, an object's file opened with its shard files. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "ckpt.h"
#include "cli.h"

bool cli_is_dir(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISDIR(st.st_mode);
}

static bool has_suffix(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n > m && !strcmp(s + n - m, suffix);
}

static int state_file_filter(const struct dirent *d) {
    return d->d_name[0] != '.' && (has_suffix(d->d_name, ".safetensors") ||
                                   has_suffix(d->d_name, ".safetensors.index.json"));
}

/* A model saved as Hugging Face shards is listed by its index,
 * "<stem>.safetensors.index.json": the object is "<stem>.safetensors"
 * (opened with every part, see ckpt_checkpoint_open_object). Other names
 * are themselves. */
const char *cli_object_of(const char *name, char *buf, size_t cap) {
    if (!has_suffix(name, ".safetensors.index.json")) return name;
    snprintf(buf, cap, "%.*s", (int)(strlen(name) - strlen(".index.json")), name);
    return buf;
}

/* Whether name is a part of a model saved as Hugging Face shards in dir:
 * "<stem>-DDDDD-of-DDDDD.safetensors" beside "<stem>.safetensors.index.json". */
bool cli_is_hf_part(const char *dir, const char *name) {
    size_t n = strlen(name), tail = strlen("-00000-of-00000.safetensors");
    if (n <= tail) return false;
    char p[4400];
    snprintf(p, sizeof p, "%s/%.*s.safetensors.index.json", dir, (int)(n - tail), name);
    struct stat st;
    return stat(p, &st) == 0;
}

/* The .safetensors files of a folder, sorted by name. Returns the count or
 * -1 with errno; free with free_names. */
int cli_list_state_files(const char *dir, struct dirent ***names) {
    return scandir(dir, names, state_file_filter, alphasort);
}

void cli_free_names(struct dirent **names, int n) {
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
}

const char *cli_kind_name(ckpt_entry_kind k) {
    const char *n = ckpt_entry_kind_name(k);
    return n ? n : "unknown";
}

void cli_print_shape(const ckpt_entry_info *e) {
    putchar('[');
    for (int d = 0; d < e->ndim; d++) printf("%s%lld", d ? ", " : "", (long long)e->shape[d]);
    putchar(']');
}

/* "<object>-DDDDD-of-DDDDD.safetensors": one process's shard file. */
bool cli_is_shard_file(const char *name) {
    static const char tail[] = "-00000-of-00000.safetensors";
    size_t n = strlen(name), k = sizeof tail - 1;
    if (n <= k) return false;
    const char *t = name + n - k;
    for (size_t i = 0; i < k; i++) {
        bool digit = tail[i] == '0';
        if (digit ? (t[i] < '0' || t[i] > '9') : t[i] != tail[i]) return false;
    }
    return true;
}

bool cli_is_frozen_file(const char *name) { return has_suffix(name, ".frozen.safetensors"); }

bool cli_part_of(const char *dir, const char *name, char *obj, size_t cap) {
    size_t n = strlen(name), tail = 0;
    if (cli_is_frozen_file(name)) tail = strlen(".frozen.safetensors");
    else if (cli_is_shard_file(name) && !cli_is_hf_part(dir, name))
        tail = strlen("-00000-of-00000.safetensors");
    if (!tail || n <= tail) return false;
    snprintf(obj, cap, "%.*s.safetensors", (int)(n - tail), name);
    return true;
}

/* A state file; inside a checkpoint folder an object's file is opened with
 * its shard files, so sharded tensors read whole. */
int cli_open_state(const char *path, ckpt_reader **r) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    char dir[4096], manifest[4200];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    snprintf(manifest, sizeof manifest, "%s/checkpoint.json", dir);
    struct stat st;
    if (!cli_is_shard_file(base) && !cli_is_frozen_file(base) && stat(manifest, &st) == 0) {
        int rc = ckpt_checkpoint_open_object(dir, base, r);
        if (rc != CKPT_ENOENT) return rc;
    }
    return ckpt_reader_open(r, path);
}

int cli_lib_error(const char *what, int rc) {
    cli_error("%s: %s", what, *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
    return CLI_RUNTIME;
}
