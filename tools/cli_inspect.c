/* cli_inspect.c — `ckpt inspect` and `ckpt diff`: what is inside a
 * checkpoint, and how two checkpoints differ. */
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "ckpt.h"
#include "cli.h"

static const char inspect_help[] =
    "usage: ckpt inspect [--json] PATH\n"
    "\n"
    "PATH is a checkpoint folder, one .safetensors file or a PyTorch file (torch.save:\n"
    "its values and tensors, read without running code, and the 'ckpt import' that\n"
    "takes it). For a checkpoint, shows the manifest (step,\n"
    "iteration, creation time, files) and, for every object (state file), its\n"
    "tensors with dtype, shape and bytes and its scalar entries with their values\n"
    "(floats as the shortest decimal that reads back to the same bits).\n"
    "\n"
    "  --json   one JSON document instead of text\n";

static const char diff_help[] =
    "usage: ckpt diff [--atol X] A B\n"
    "\n"
    "Compares two checkpoint folders (every state file) or two .safetensors files,\n"
    "entry by entry: tensors by dtype, shape and value (max absolute difference,\n"
    "elements that differ, the first differing pair), scalar entries by value, and\n"
    "the manifests' step and number of processes (metrics are shown where they\n"
    "differ but are not state: they do not count). A project folder stands for its\n"
    "newest valid checkpoint (printed as 'A: <checkpoint>'). Anything else (an\n"
    "empty folder, a folder without checkpoint.json, another kind of file) is a\n"
    "usage error.\n"
    "Creation times, checkpoint numbers and library versions are not compared.\n"
    "\n"
    "  --atol X   values within X of each other count as equal (default 0: bit for bit)\n"
    "\n"
    "Exit 0 if equal, 1 if they differ, 2 if A or B is not a checkpoint, a project\n"
    "or a state file, 3 if a file cannot be read or a project has no valid checkpoint.\n";

static bool is_dir(const char *path) {
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
static const char *object_of(const char *name, char *buf, size_t cap) {
    if (!has_suffix(name, ".safetensors.index.json")) return name;
    snprintf(buf, cap, "%.*s", (int)(strlen(name) - strlen(".index.json")), name);
    return buf;
}

/* Whether name is a part of a model saved as Hugging Face shards in dir:
 * "<stem>-DDDDD-of-DDDDD.safetensors" beside "<stem>.safetensors.index.json". */
static bool is_hf_part(const char *dir, const char *name) {
    size_t n = strlen(name), tail = strlen("-00000-of-00000.safetensors");
    if (n <= tail) return false;
    char p[4400];
    snprintf(p, sizeof p, "%s/%.*s.safetensors.index.json", dir, (int)(n - tail), name);
    struct stat st;
    return stat(p, &st) == 0;
}

/* The .safetensors files of a folder, sorted by name. Returns the count or
 * -1 with errno; free with free_names. */
static int list_state_files(const char *dir, struct dirent ***names) {
    return scandir(dir, names, state_file_filter, alphasort);
}

static void free_names(struct dirent **names, int n) {
    for (int i = 0; i < n; i++) free(names[i]);
    free(names);
}

/* The files a save pre-hook added (kind "extra" in the manifest). JSON: ends
 * the objects array and adds "extra_files". */
static void print_extra_files(const char *dir, bool json) {
    ckpt_checkpoint_file *v = NULL;
    int64_t n = 0;
    if (ckpt_checkpoint_files(dir, &v, &n) < 0) n = 0;
    int64_t shown = 0;
    if (json) printf("],\"extra_files\":[");
    for (int64_t i = 0; i < n; i++) {
        if (strcmp(v[i].kind, "extra") != 0) continue;
        if (json) {
            printf("%s{\"name\":", shown ? "," : "");
            cli_json_string(v[i].name);
            printf(",\"size\":%llu,\"xxh3\":\"%016llx\"}", (unsigned long long)v[i].size,
                   (unsigned long long)v[i].xxh3);
        } else {
            if (!shown)
                printf("\nextra files (added by a save pre-hook, verified with the rest):\n");
            char size[32];
            printf("  %s  %s  xxh3 %016llx\n", cli_esc(v[i].name),
                   cli_human_bytes(v[i].size, size, sizeof size), (unsigned long long)v[i].xxh3);
        }
        shown++;
    }
    if (json) printf("]");
    free(v);
}

static const char *kind_name(ckpt_entry_kind k) {
    const char *n = ckpt_entry_kind_name(k);
    return n ? n : "unknown";
}

static void print_shape(const ckpt_entry_info *e) {
    putchar('[');
    for (int d = 0; d < e->ndim; d++) printf("%s%lld", d ? ", " : "", (long long)e->shape[d]);
    putchar(']');
}

/* "<object>-DDDDD-of-DDDDD.safetensors": one process's shard file. */
static bool is_shard_file(const char *name) {
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

/* A state file; inside a checkpoint folder an object's file is opened with
 * its shard files, so sharded tensors read whole. */
static int open_state(const char *path, ckpt_reader **r) {
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    char dir[4096], manifest[4200];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    snprintf(manifest, sizeof manifest, "%s/checkpoint.json", dir);
    struct stat st;
    if (!is_shard_file(base) && stat(manifest, &st) == 0) {
        int rc = ckpt_checkpoint_open_object(dir, base, r);
        if (rc != CKPT_ENOENT) return rc;
    }
    return ckpt_reader_open(r, path);
}

static int lib_error(const char *what, int rc) {
    cli_error("%s: %s", what, *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
    return CLI_RUNTIME;
}

/* ---- inspect -------------------------------------------------------------- */

/* Prints one entry's value (scalars) or description (tensors). */
static int print_entry(ckpt_reader *r, const ckpt_entry_info *e, bool json) {
    int rc = CKPT_OK;
    if (json) {
        printf("{\"key\":");
        cli_json_string(e->key);
        printf(",\"kind\":\"%s\"", kind_name(e->kind));
    } else {
        printf("    %-40s ", cli_esc(e->key));
    }
    switch (e->kind) {
    case CKPT_ENTRY_TENSOR:
        if (json) {
            printf(",\"dtype\":\"%s\",\"shape\":", ckpt_dtype_name(e->dtype));
            print_shape(e);
            printf(",\"bytes\":%llu,\"offset\":%llu}", (unsigned long long)e->nbytes,
                   (unsigned long long)e->offset);
        } else {
            printf("%-5s ", ckpt_dtype_name(e->dtype));
            print_shape(e);
            printf("  %llu bytes\n", (unsigned long long)e->nbytes);
        }
        break;
    case CKPT_ENTRY_I64: {
        int64_t v = 0;
        rc = ckpt_read_i64(r, e->key, &v);
        printf(json ? ",\"value\":%lld}" : "= %lld\n", (long long)v);
        break;
    }
    case CKPT_ENTRY_F64: {
        double v = 0;
        rc = ckpt_read_f64(r, e->key, &v);
        char num[40];
        cli_format_double(v, num, sizeof num);
        if (json && !isfinite(v)) printf(",\"value\":\"%s\"}", num); /* JSON has no inf/nan */
        else printf(json ? ",\"value\":%s}" : "= %s\n", num);
        break;
    }
    case CKPT_ENTRY_STR: {
        char *buf = malloc(e->nbytes + 1);
        if (!buf) return CKPT_ENOMEM;
        rc = ckpt_read_str(r, e->key, buf, e->nbytes + 1);
        if (rc == CKPT_OK) {
            printf(json ? ",\"value\":" : "= ");
            cli_json_string(buf); /* escapes control characters */
            printf(json ? "}" : "\n");
        }
        free(buf);
        break;
    }
    case CKPT_ENTRY_BYTES: {
        unsigned char *buf = malloc(e->nbytes ? e->nbytes : 1);
        size_t n = 0;
        if (!buf) return CKPT_ENOMEM;
        rc = ckpt_read_bytes(r, e->key, buf, e->nbytes, &n);
        if (rc == CKPT_OK) {
            printf(json ? ",\"bytes\":%zu,\"hex\":\"" : "= <%zu bytes> ", n);
            for (size_t i = 0; i < n && (json || i < 32); i++) printf("%02x", buf[i]);
            printf(json ? "\"}" : (n > 32 ? "...\n" : "\n"));
        }
        free(buf);
        break;
    }
    }
    return rc;
}

static int inspect_file(const char *path, const char *label, bool json, bool first) {
    ckpt_reader *r = NULL;
    int rc = open_state(path, &r);
    if (rc < 0) return lib_error("inspect", rc);
    int64_t n = ckpt_reader_count(r);
    uint64_t tensor_bytes = 0;
    int64_t ntensors = 0;
    for (int64_t i = 0; i < n; i++) {
        ckpt_entry_info e;
        if (ckpt_reader_entry(r, i, &e) == CKPT_OK && e.kind == CKPT_ENTRY_TENSOR) {
            ntensors++;
            tensor_bytes += e.nbytes;
        }
    }
    if (json) {
        printf("%s{\"file\":", first ? "" : ",");
        cli_json_string(label);
        printf(",\"tensors\":%lld,\"tensor_bytes\":%llu,\"entries\":[", (long long)ntensors,
               (unsigned long long)tensor_bytes);
    } else {
        char size[32];
        printf("%s: %lld entries, %lld tensors (%s)%s\n", cli_esc(label), (long long)n,
               (long long)ntensors, cli_human_bytes(tensor_bytes, size, sizeof size),
               is_shard_file(label) ? ", one process's chunks of sharded tensors" : "");
    }
    for (int64_t i = 0; i < n && rc == CKPT_OK; i++) {
        ckpt_entry_info e;
        if ((rc = ckpt_reader_entry(r, i, &e)) < 0) break;
        if (json && i) putchar(',');
        rc = print_entry(r, &e, json);
    }
    if (json) printf("]}");
    if (rc < 0) {
        if (json) putchar('\n');
        fflush(stdout);
        lib_error("inspect", rc);
        ckpt_reader_free(r);
        return CLI_RUNTIME;
    }
    ckpt_reader_free(r);
    return CLI_OK;
}

/* ---- inspect of a torch.save file ---------------------------------------- */

typedef struct torch_walk {
    bool json;
    int64_t shown, tensors;
    uint64_t tensor_bytes;
} torch_walk;

/* Prints every leaf under v as a flat key (nested dicts, lists and tuples
 * joined with dots, as ckpt import flattens them); counts tensors when
 * print is false. */
static void torch_leaves(torch_walk *w, const ckpt_torch_value *v, char *key, size_t len,
                         size_t cap, bool print) {
    if (v->kind == CKPT_TORCH_DICT || v->kind == CKPT_TORCH_LIST || v->kind == CKPT_TORCH_TUPLE ||
        v->kind == CKPT_TORCH_SET) {
        bool dict = v->kind == CKPT_TORCH_DICT;
        for (int64_t i = 0; i < v->n; i++) {
            const ckpt_torch_value *k = dict ? v->items[2 * i] : NULL;
            const ckpt_torch_value *item = dict ? v->items[2 * i + 1] : v->items[i];
            char part[64];
            const char *name = part;
            if (!dict) snprintf(part, sizeof part, "%lld", (long long)i);
            else if (k->kind == CKPT_TORCH_STR) name = k->s;
            else if (k->kind == CKPT_TORCH_INT)
                snprintf(part, sizeof part, "%lld", (long long)k->i);
            else snprintf(part, sizeof part, "<%s key>", ckpt_torch_kind_name(k->kind));
            int n = snprintf(key + len, cap - len, "%s%s", len ? "." : "", name);
            size_t next = n < 0 || (size_t)n >= cap - len ? cap - 1 : len + (size_t)n;
            torch_leaves(w, item, key, next, cap, print);
            key[len] = '\0';
        }
        return;
    }
    if (!print) {
        if (v->kind == CKPT_TORCH_TENSOR) w->tensors++, w->tensor_bytes += v->nbytes;
        return;
    }
    const char *kname = ckpt_torch_kind_name(v->kind);
    if (w->json) {
        printf("%s{\"key\":", w->shown ? "," : "");
        cli_json_string(key);
        printf(",\"kind\":\"%s\"", kname ? kname : "unknown");
    } else {
        printf("    %-40s ", cli_esc(key));
    }
    w->shown++;
    char num[40];
    switch (v->kind) {
    case CKPT_TORCH_TENSOR:
        if (w->json) printf(",\"dtype\":\"%s\",\"shape\":[", ckpt_dtype_name(v->dtype));
        else printf("%-5s [", ckpt_dtype_name(v->dtype));
        for (int d = 0; d < v->ndim; d++) printf("%s%lld", d ? ", " : "", (long long)v->shape[d]);
        if (w->json) printf("],\"bytes\":%llu}", (unsigned long long)v->nbytes);
        else printf("]  %llu bytes\n", (unsigned long long)v->nbytes);
        break;
    case CKPT_TORCH_INT: printf(w->json ? ",\"value\":%lld}" : "= %lld\n", (long long)v->i); break;
    case CKPT_TORCH_BOOL:
        printf(w->json ? ",\"value\":%s}" : "= %s\n", v->b ? "true" : "false");
        break;
    case CKPT_TORCH_FLOAT:
        cli_format_double(v->f, num, sizeof num);
        if (w->json && !isfinite(v->f)) printf(",\"value\":\"%s\"}", num);
        else printf(w->json ? ",\"value\":%s}" : "= %s\n", num);
        break;
    case CKPT_TORCH_STR:
        printf(w->json ? ",\"value\":" : "= ");
        cli_json_string(v->s);
        printf(w->json ? "}" : "\n");
        break;
    case CKPT_TORCH_BYTES: printf(w->json ? ",\"bytes\":%zu}" : "= <%zu bytes>\n", v->len); break;
    default: printf(w->json ? "}" : "(%s)\n", kname ? kname : "unknown"); break;
    }
}

static bool file_exists(const char *path) {
    struct stat st;
    return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* What a torch file holds, and the ckpt import command that takes it (one
 * that works: an optimizer's, scheduler's or scaler's state dict imports
 * only with its model, from an Accelerate folder). */
static void torch_advice(const char *path, const ckpt_torch_value *root) {
    const char *slash = strrchr(path, '/');
    char dir[4096], p[4200];
    snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
    const char *base = slash ? slash + 1 : path;
    bool tensors_only = root->kind == CKPT_TORCH_DICT && root->n > 0;
    for (int64_t i = 0; tensors_only && i < root->n; i++)
        tensors_only = root->items[2 * i]->kind == CKPT_TORCH_STR &&
                       root->items[2 * i + 1]->kind == CKPT_TORCH_TENSOR;
    if (tensors_only) {
        printf("\na model state dict: 'ckpt import %s CHECKPOINT_DIR' makes a checkpoint of it\n",
               cli_esc(path));
        return;
    }
    const char *what = NULL, *as = NULL;
    if (ckpt_torch_dict_get(root, "state") && ckpt_torch_dict_get(root, "param_groups"))
        what = "an optimizer's state dict", as = "optimizer.bin";
    else if (ckpt_torch_dict_get(root, "last_epoch") && ckpt_torch_dict_get(root, "base_lrs"))
        what = "a learning-rate scheduler's state dict", as = "scheduler.bin";
    else if (ckpt_torch_dict_get(root, "growth_factor") && ckpt_torch_dict_get(root, "scale"))
        what = "a GradScaler's state dict", as = "scaler.pt";
    if (!what) {
        printf("\nnot a state dict 'ckpt import' knows (a model's of tensors, or an Accelerate "
               "folder's optimizer.bin, scheduler.bin, scaler.pt)\n");
        return;
    }
    bool model = false;
    static const char *const models[] = {"model.safetensors", "model.safetensors.index.json",
                                         "pytorch_model.bin", "pytorch_model.bin.index.json"};
    for (size_t i = 0; i < sizeof models / sizeof models[0] && !model; i++) {
        snprintf(p, sizeof p, "%s/%s", dir, models[i]);
        model = file_exists(p);
    }
    /* Adam and AdamW state with weight decay: the file cannot say which */
    bool decay = false;
    const ckpt_torch_value *groups = ckpt_torch_dict_get(root, "param_groups");
    for (int64_t g = 0; groups && groups->kind == CKPT_TORCH_LIST && g < groups->n; g++) {
        const ckpt_torch_value *wd = ckpt_torch_dict_get(groups->items[g], "weight_decay");
        if (ckpt_torch_dict_get(groups->items[g], "betas") && wd &&
            ((wd->kind == CKPT_TORCH_FLOAT && wd->f != 0) || (wd->kind == CKPT_TORCH_INT && wd->i)))
            decay = true;
    }
    const char *opt = decay ? "--optimizer adamw " : "";
    if (model && !strcmp(base, as))
        printf("\n%s, imported with the model beside it: 'ckpt import %s%s CHECKPOINT_DIR' (the "
               "folder)%s\n",
               what, opt, cli_esc(dir),
               decay ? "; Adam state with weight decay: say --optimizer adam or adamw, the file "
                       "cannot tell"
                     : "");
    else
        printf("\n%s: 'ckpt import' takes it with its model, from a folder that holds it as %s "
               "beside model.safetensors or pytorch_model.bin: 'ckpt import FOLDER "
               "CHECKPOINT_DIR'\n",
               what, as);
}

/* A torch.save file, through the allow-list reader (no code runs). */
static int inspect_torch(const char *path, bool json) {
    ckpt_torch_file *f = NULL;
    int rc = ckpt_torch_open(&f, path);
    if (rc < 0) return lib_error("inspect", rc);
    const ckpt_torch_value *root = ckpt_torch_root(f);
    torch_walk w = {.json = json};
    char key[4096] = "";
    torch_leaves(&w, root, key, 0, sizeof key, false);
    char size[32];
    if (json) {
        printf("{\"path\":");
        cli_json_string(path);
        printf(",\"format\":\"torch\",\"root\":\"%s\",\"tensors\":%lld,\"tensor_bytes\":%llu,"
               "\"entries\":[",
               ckpt_torch_kind_name(root->kind), (long long)w.tensors,
               (unsigned long long)w.tensor_bytes);
    } else {
        printf("%s: a PyTorch file (torch.save), read without running code: a %s, %lld tensors "
               "(%s)\n",
               cli_esc(path), ckpt_torch_kind_name(root->kind), (long long)w.tensors,
               cli_human_bytes(w.tensor_bytes, size, sizeof size));
    }
    torch_leaves(&w, root, key, 0, sizeof key, true);
    if (json) printf("]}\n");
    else torch_advice(path, root);
    ckpt_torch_close(f);
    return CLI_OK;
}

int cli_inspect(int argc, char **argv) {
    bool json = false;
    const char *path = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(inspect_help, stdout);
            return CLI_OK;
        } else if (!strcmp(a, "--json")) {
            json = true;
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("inspect", "unknown option '%s'", a);
        } else if (path) {
            return cli_usage_error("inspect", "unexpected argument '%s'", a);
        } else {
            path = a;
        }
    }
    if (!path) return cli_usage_error("inspect", "missing PATH");

    cli_kind kind = cli_classify(path);
    char copy[1024];
    if (kind == CLI_KIND_CHECKPOINT && strncmp(path, "s3://", 5) == 0) {
        int st = cli_local_copy("inspect", path, copy, sizeof copy);
        if (st != CLI_OK) return st;
        path = copy;
    }
    if (kind == CLI_KIND_MISSING && strncmp(path, "s3://", 5) == 0) {
        cli_error("inspect: %s: %s", path, *ckpt_errmsg() ? ckpt_errmsg() : strerror(errno));
        return CLI_RUNTIME;
    }
    if (kind == CLI_KIND_TORCH_ZIP) return inspect_torch(path, json);
    if (kind == CLI_KIND_OTHER_FILE || kind == CLI_KIND_PROJECT)
        return cli_wrong_kind("inspect", path, kind, "a checkpoint folder or a .safetensors file");
    if (!is_dir(path)) {
        if (json) printf("{\"path\":"), cli_json_string(path), printf(",\"objects\":[");
        int st = inspect_file(path, path, json, true);
        if (st == CLI_OK && json) printf("]}\n");
        return st;
    }

    struct dirent **names = NULL;
    int n = list_state_files(path, &names);
    if (n < 0) {
        cli_error("inspect: %s: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    if (kind == CLI_KIND_FOLDER && n == 0) {
        /* no manifest and no state file: nothing inspect can look into */
        free_names(names, n);
        return cli_wrong_kind("inspect", path, kind, "a checkpoint folder or a .safetensors file");
    }

    ckpt_checkpoint_info info;
    memset(&info, 0, sizeof info);
    int vrc = ckpt_checkpoint_verify(path, false, &info);
    char vmsg[1024];
    snprintf(vmsg, sizeof vmsg, "%s", vrc < 0 ? ckpt_errmsg() : "");
    char when[32] = "-";
    time_t ct = (time_t)info.created_unix;
    struct tm tm;
    if (info.created_unix > 0 && gmtime_r(&ct, &tm))
        strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S", &tm);
    if (json) {
        printf("{\"path\":");
        cli_json_string(path);
        if (vrc == CKPT_OK) {
            printf(",\"manifest\":{\"step\":%lld,\"iteration\":%lld,\"created_unix\":%lld,"
                   "\"files\":%d,\"bytes\":%llu,\"shared_bytes\":%llu,\"num_processes\":%d,"
                   "\"format_version\":%d,\"library_version\":",
                   (long long)info.step, (long long)info.iteration, (long long)info.created_unix,
                   info.num_files, (unsigned long long)info.total_bytes,
                   (unsigned long long)info.shared_bytes, info.num_processes, info.format_version);
            cli_json_string(info.library_version);
            cli_print_metrics(&info, true);
            putchar('}');
        } else {
            printf(",\"manifest\":null,\"manifest_error\":");
            cli_json_string(vmsg);
        }
        printf(",\"objects\":[");
    } else if (vrc == CKPT_OK) {
        char size[32];
        printf("checkpoint %s\n  step %lld, iteration %lld, created %s UTC, %d files, %s,\n"
               "  %d process%s, format %d, library %s\n",
               cli_esc(path), (long long)info.step, (long long)info.iteration, when, info.num_files,
               cli_human_bytes(info.total_bytes, size, sizeof size), info.num_processes,
               info.num_processes == 1 ? "" : "es", info.format_version,
               cli_esc(info.library_version));
        if (info.num_metrics > 0) {
            printf("  metrics:");
            cli_print_metrics(&info, false);
            putchar('\n');
        }
        if (info.shared_bytes > 0) {
            char shared[32];
            printf("  %s shared with the previous checkpoint (the same files on disk: linked, "
                   "not written again)\n",
                   cli_human_bytes(info.shared_bytes, shared, sizeof shared));
        }
    } else {
        printf("%s %s\n  manifest: %s\n", kind == CLI_KIND_CHECKPOINT ? "checkpoint" : "folder",
               cli_esc(path), cli_esc(vmsg));
    }
    int status = CLI_OK, shown = 0;
    for (int i = 0; i < n && status == CLI_OK; i++) {
        const char *name = names[i]->d_name;
        if (is_shard_file(name) && is_hf_part(path, name)) continue; /* shown with its index */
        char file[4096], obj[512], label[640];
        const char *o = object_of(name, obj, sizeof obj);
        snprintf(file, sizeof file, "%s/%s", path, o);
        if (o != name && !json)
            snprintf(label, sizeof label, "%s (Hugging Face shards: %s)", o, name);
        else snprintf(label, sizeof label, "%s", name);
        if (!json) putchar('\n');
        status = inspect_file(file, label, json, shown++ == 0);
    }
    free_names(names, n);
    if (status == CLI_OK) print_extra_files(path, json);
    if (status == CLI_OK && json) printf("}\n");
    return status;
}

/* ---- diff ----------------------------------------------------------------- */

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    float v;
    if (exp == 0) v = ldexpf((float)man, -24);
    else if (exp == 31) v = man ? NAN : INFINITY;
    else v = ldexpf((float)(man | 0x400), (int)exp - 25);
    return sign ? -v : v;
}

/* Element i of a tensor as a double; false for dtypes compared by bytes. */
static bool element_value(ckpt_dtype dt, const unsigned char *p, int64_t i, double *out) {
    union { float f; double d; int64_t i64; uint64_t u64; int32_t i32; uint32_t u32; int16_t i16;
            uint16_t u16; } u;
    switch (dt) {
    case CKPT_F64: memcpy(&u.d, p + 8 * i, 8); *out = u.d; return true;
    case CKPT_F32: memcpy(&u.f, p + 4 * i, 4); *out = u.f; return true;
    case CKPT_F16: memcpy(&u.u16, p + 2 * i, 2); *out = half_to_float(u.u16); return true;
    case CKPT_BF16: {
        uint16_t b;
        memcpy(&b, p + 2 * i, 2);
        u.u32 = (uint32_t)b << 16;
        float f;
        memcpy(&f, &u.u32, 4);
        *out = f;
        return true;
    }
    case CKPT_I64: memcpy(&u.i64, p + 8 * i, 8); *out = (double)u.i64; return true;
    case CKPT_U64: memcpy(&u.u64, p + 8 * i, 8); *out = (double)u.u64; return true;
    case CKPT_I32: memcpy(&u.i32, p + 4 * i, 4); *out = u.i32; return true;
    case CKPT_U32: memcpy(&u.u32, p + 4 * i, 4); *out = u.u32; return true;
    case CKPT_I16: memcpy(&u.i16, p + 2 * i, 2); *out = u.i16; return true;
    case CKPT_U16: memcpy(&u.u16, p + 2 * i, 2); *out = u.u16; return true;
    case CKPT_I8: *out = (int8_t)p[i]; return true;
    case CKPT_U8:
    case CKPT_BOOL: *out = p[i]; return true;
    default: return false;
    }
}

/* Element i of an integer tensor, exactly: signed ones in *s, unsigned in
 * *u. False for other dtypes. */
static bool element_int(ckpt_dtype dt, const unsigned char *p, int64_t i, bool *is_signed,
                        int64_t *s, uint64_t *u) {
    union { int64_t i64; uint64_t u64; int32_t i32; uint32_t u32; int16_t i16; uint16_t u16; } v;
    *is_signed = true;
    switch (dt) {
    case CKPT_I64: memcpy(&v.i64, p + 8 * i, 8); *s = v.i64; return true;
    case CKPT_I32: memcpy(&v.i32, p + 4 * i, 4); *s = v.i32; return true;
    case CKPT_I16: memcpy(&v.i16, p + 2 * i, 2); *s = v.i16; return true;
    case CKPT_I8: *s = (int8_t)p[i]; return true;
    default: break;
    }
    *is_signed = false;
    switch (dt) {
    case CKPT_U64: memcpy(&v.u64, p + 8 * i, 8); *u = v.u64; return true;
    case CKPT_U32: memcpy(&v.u32, p + 4 * i, 4); *u = v.u32; return true;
    case CKPT_U16: memcpy(&v.u16, p + 2 * i, 2); *u = v.u16; return true;
    case CKPT_U8:
    case CKPT_BOOL: *u = p[i]; return true;
    default: return false;
    }
}

/* Element i as text: integers as integers, floats as the shortest decimal
 * that reads back to the same value of the tensor's type. */
static const char *element_text(ckpt_dtype dt, const unsigned char *p, int64_t i, char *buf,
                                int cap) {
    bool sg;
    int64_t sv;
    uint64_t uv;
    double d = 0;
    if (element_int(dt, p, i, &sg, &sv, &uv)) {
        if (sg) snprintf(buf, (size_t)cap, "%lld", (long long)sv);
        else snprintf(buf, (size_t)cap, "%llu", (unsigned long long)uv);
    } else if (element_value(dt, p, i, &d)) {
        if (dt == CKPT_F64) cli_format_double(d, buf, cap);
        else cli_format_float((float)d, buf, cap);
    } else {
        snprintf(buf, (size_t)cap, "?");
    }
    return buf;
}

typedef struct diff_ctx {
    double atol;
    int64_t differences;
    int64_t tensors, scalars;
} diff_ctx;

static void report(diff_ctx *d, const char *file, const char *key, const char *fmt, ...)
    CLI_PRINTF(4, 5);
static void report(diff_ctx *d, const char *file, const char *key, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    printf("%s: %s: ", cli_esc(file), cli_esc(key));
    vprintf(fmt, ap);
    putchar('\n');
    va_end(ap);
    d->differences++;
}

static void diff_tensor_bytes(diff_ctx *d, const char *file, const ckpt_entry_info *ea,
                              const void *pa, const void *pb);

/* A tensor's bytes: a view, or (a tensor saved in chunks by several
 * processes) assembled into *own (free it). */
static bool tensor_bytes(ckpt_reader *r, const ckpt_entry_info *e, const void **p, void **own) {
    ckpt_entry_info info;
    int rc = ckpt_reader_tensor_view(r, e->key, p, &info);
    if (rc != CKPT_EUNSUPPORTED) return rc == CKPT_OK;
    *own = malloc(e->nbytes ? (size_t)e->nbytes : 1);
    if (!*own) return false;
    if (ckpt_read_tensor(r, e->key, e->dtype, e->ndim, e->shape, *own) < 0) return false;
    *p = *own;
    return true;
}

static void diff_tensor(diff_ctx *d, const char *file, ckpt_reader *ra, ckpt_reader *rb,
                        const ckpt_entry_info *ea, const ckpt_entry_info *eb) {
    d->tensors++;
    bool same_shape = ea->ndim == eb->ndim;
    for (int k = 0; same_shape && k < ea->ndim; k++) same_shape = ea->shape[k] == eb->shape[k];
    if (ea->dtype != eb->dtype || !same_shape) {
        printf("%s: %s: %s ", cli_esc(file), cli_esc(ea->key), ckpt_dtype_name(ea->dtype));
        print_shape(ea);
        printf(" vs %s ", ckpt_dtype_name(eb->dtype));
        print_shape(eb);
        putchar('\n');
        d->differences++;
        return;
    }
    const void *pa = NULL, *pb = NULL;
    void *own[2] = {NULL, NULL};
    if (!tensor_bytes(ra, ea, &pa, &own[0]) || !tensor_bytes(rb, eb, &pb, &own[1])) {
        report(d, file, ea->key, "cannot read: %s", cli_esc(ckpt_errmsg()));
        free(own[0]);
        free(own[1]);
        return;
    }
    diff_tensor_bytes(d, file, ea, pa, pb);
    free(own[0]);
    free(own[1]);
}

/* Compares the bytes of two tensors of the same dtype and shape. */
static void diff_tensor_bytes(diff_ctx *d, const char *file, const ckpt_entry_info *ea,
                              const void *pa, const void *pb) {
    if (ea->nbytes == 0 || !memcmp(pa, pb, ea->nbytes)) return;

    int64_t numel = 1;
    for (int k = 0; k < ea->ndim; k++) numel *= ea->shape[k];
    double a, b;
    if (!element_value(ea->dtype, pa, 0, &a)) {
        uint64_t nb = 0;
        for (uint64_t i = 0; i < ea->nbytes; i++)
            nb += ((const unsigned char *)pa)[i] != ((const unsigned char *)pb)[i];
        report(d, file, ea->key, "%llu of %llu bytes differ", (unsigned long long)nb,
               (unsigned long long)ea->nbytes);
        return;
    }
    double maxabs = 0.0;
    uint64_t maxint = 0; /* integer tensors: the exact largest difference */
    int64_t ndiff = 0, first = -1;
    size_t esz = (size_t)(ckpt_dtype_bits(ea->dtype) / 8);
    bool sg, integer = element_int(ea->dtype, pa, 0, &sg, &(int64_t){0}, &(uint64_t){0});
    for (int64_t i = 0; i < numel; i++) {
        if (!memcmp((const char *)pa + (size_t)i * esz, (const char *)pb + (size_t)i * esz, esz))
            continue;
        double diff;
        if (integer) {
            int64_t sa = 0, sb = 0;
            uint64_t ua = 0, ub = 0, du;
            element_int(ea->dtype, pa, i, &sg, &sa, &ua);
            element_int(ea->dtype, pb, i, &sg, &sb, &ub);
            if (sg) du = sa > sb ? (uint64_t)sa - (uint64_t)sb : (uint64_t)sb - (uint64_t)sa;
            else du = ua > ub ? ua - ub : ub - ua;
            if (du > maxint) maxint = du;
            diff = (double)du;
        } else {
            element_value(ea->dtype, pa, i, &a);
            element_value(ea->dtype, pb, i, &b);
            diff = fabs(a - b);
            if (isnan(diff)) diff = INFINITY;
            if (diff > maxabs) maxabs = diff;
        }
        if (diff > d->atol || d->atol == 0.0) {
            ndiff++;
            if (first < 0) first = i;
        }
    }
    if (ndiff == 0) return;
    char maxs[40], va[40], vb[40];
    if (integer) snprintf(maxs, sizeof maxs, "%llu", (unsigned long long)maxint);
    else cli_format_double(maxabs, maxs, sizeof maxs);
    report(d, file, ea->key,
           "max |a-b| = %s, %lld of %lld elements differ (first at flat index %lld: %s vs %s)",
           maxs, (long long)ndiff, (long long)numel, (long long)first,
           element_text(ea->dtype, pa, first, va, sizeof va),
           element_text(ea->dtype, pb, first, vb, sizeof vb));
}

static void diff_scalar(diff_ctx *d, const char *file, ckpt_reader *ra, ckpt_reader *rb,
                        const ckpt_entry_info *ea, const ckpt_entry_info *eb) {
    d->scalars++;
    if (ea->kind != eb->kind) {
        report(d, file, ea->key, "%s vs %s", kind_name(ea->kind), kind_name(eb->kind));
        return;
    }
    switch (ea->kind) {
    case CKPT_ENTRY_I64: {
        int64_t a = 0, b = 0;
        ckpt_read_i64(ra, ea->key, &a);
        ckpt_read_i64(rb, eb->key, &b);
        if (a != b) report(d, file, ea->key, "%lld vs %lld", (long long)a, (long long)b);
        break;
    }
    case CKPT_ENTRY_F64: {
        double a = 0, b = 0;
        ckpt_read_f64(ra, ea->key, &a);
        ckpt_read_f64(rb, eb->key, &b);
        bool same = !memcmp(&a, &b, sizeof a) || (d->atol > 0 && fabs(a - b) <= d->atol);
        char sa[40], sb[40];
        char sd[40];
        if (!same)
            report(d, file, ea->key, "%s vs %s (|a-b| = %s)", cli_format_double(a, sa, sizeof sa),
                   cli_format_double(b, sb, sizeof sb),
                   cli_format_double(fabs(a - b), sd, sizeof sd));
        break;
    }
    case CKPT_ENTRY_STR:
    case CKPT_ENTRY_BYTES: {
        size_t na = ea->nbytes, nb = eb->nbytes, ga = 0, gb = 0;
        char *a = malloc(na + 1), *b = malloc(nb + 1);
        if (!a || !b) {
            report(d, file, ea->key, "out of memory");
        } else if (ea->kind == CKPT_ENTRY_STR) {
            ckpt_read_str(ra, ea->key, a, na + 1);
            ckpt_read_str(rb, eb->key, b, nb + 1);
            if (strcmp(a, b)) report(d, file, ea->key, "\"%s\" vs \"%s\"", cli_esc(a), cli_esc(b));
        } else {
            ckpt_read_bytes(ra, ea->key, a, na, &ga);
            ckpt_read_bytes(rb, eb->key, b, nb, &gb);
            if (ga != gb || memcmp(a, b, ga))
                report(d, file, ea->key, "%zu bytes vs %zu bytes, contents differ", ga, gb);
        }
        free(a);
        free(b);
        break;
    }
    case CKPT_ENTRY_TENSOR: break;
    }
}

/* Compares two state files; CLI_RUNTIME if one cannot be opened. */
static int diff_files(diff_ctx *d, const char *pa, const char *pb, const char *label) {
    ckpt_reader *ra = NULL, *rb = NULL;
    int rc = open_state(pa, &ra);
    if (rc < 0) return lib_error("diff", rc);
    if ((rc = open_state(pb, &rb)) < 0) {
        ckpt_reader_free(ra);
        return lib_error("diff", rc);
    }
    int64_t na = ckpt_reader_count(ra), nb = ckpt_reader_count(rb);
    for (int64_t i = 0; i < na; i++) {
        ckpt_entry_info ea, eb;
        if (ckpt_reader_entry(ra, i, &ea) < 0) continue;
        if (ckpt_reader_find(rb, ea.key, &eb) < 0) {
            report(d, label, ea.key, "only in A");
            continue;
        }
        if (ea.kind == CKPT_ENTRY_TENSOR && eb.kind == CKPT_ENTRY_TENSOR)
            diff_tensor(d, label, ra, rb, &ea, &eb);
        else
            diff_scalar(d, label, ra, rb, &ea, &eb);
    }
    for (int64_t i = 0; i < nb; i++) {
        ckpt_entry_info ea, eb;
        if (ckpt_reader_entry(rb, i, &eb) < 0) continue;
        if (ckpt_reader_find(ra, eb.key, &ea) < 0) report(d, label, eb.key, "only in B");
    }
    ckpt_reader_free(ra);
    ckpt_reader_free(rb);
    return CLI_OK;
}

/* Metrics are measurements attached to a save, not state: their
 * differences are shown but not counted (an exported and re-imported
 * checkpoint carries none and is still equal). */
static void diff_metrics(const ckpt_checkpoint_info *a, const ckpt_checkpoint_info *b) {
    for (int pass = 0; pass < 2; pass++) {
        const ckpt_checkpoint_info *x = pass ? b : a, *y = pass ? a : b;
        for (int i = 0; i < x->num_metrics; i++) {
            const ckpt_metric *m = &x->metrics[i];
            const ckpt_metric *o = NULL;
            char va[40], vb[40];
            for (int j = 0; j < y->num_metrics; j++)
                if (strcmp(y->metrics[j].name, m->name) == 0) o = &y->metrics[j];
            if (!o)
                printf("checkpoint.json: metric %s: only in %c (metrics are not compared as "
                       "state)\n",
                       cli_esc(m->name), pass ? 'B' : 'A');
            else if (!pass && memcmp(&o->value, &m->value, sizeof m->value) != 0)
                printf("checkpoint.json: metric %s: %s vs %s (metrics are not compared as "
                       "state)\n",
                       cli_esc(m->name), cli_format_double(m->value, va, sizeof va),
                       cli_format_double(o->value, vb, sizeof vb));
        }
    }
}

static int diff_dirs(diff_ctx *d, const char *a, const char *b) {
    ckpt_checkpoint_info ia, ib;
    memset(&ia, 0, sizeof ia);
    memset(&ib, 0, sizeof ib);
    int va = ckpt_checkpoint_verify(a, false, &ia);
    int vb = ckpt_checkpoint_verify(b, false, &ib);
    if ((va == CKPT_OK) != (vb == CKPT_OK)) {
        printf("checkpoint.json: %s\n",
               va == CKPT_OK ? "B has no valid manifest" : "A has no valid manifest");
        d->differences++;
    } else if (va == CKPT_OK) {
        if (ia.step != ib.step) {
            printf("checkpoint.json: step: %lld vs %lld\n", (long long)ia.step, (long long)ib.step);
            d->differences++;
        }
        if (ia.num_processes != ib.num_processes)
            /* Not a difference by itself: sharded tensors are compared whole. */
            printf("checkpoint.json: num_processes: %d vs %d (sharded tensors compared "
                   "assembled)\n",
                   ia.num_processes, ib.num_processes);
        diff_metrics(&ia, &ib);
    }

    struct dirent **na = NULL, **nb = NULL;
    int ca = list_state_files(a, &na);
    if (ca < 0) {
        cli_error("diff: %s: %s", a, strerror(errno));
        return CLI_RUNTIME;
    }
    int cb = list_state_files(b, &nb);
    if (cb < 0) {
        cli_error("diff: %s: %s", b, strerror(errno));
        free_names(na, ca);
        return CLI_RUNTIME;
    }
    int status = CLI_OK, i = 0, j = 0;
    /* both lists are sorted: walk them together */
    while (status == CLI_OK && (i < ca || j < cb)) {
        /* Shard files are read with their object's file. */
        if (i < ca && is_shard_file(na[i]->d_name)) {
            i++;
            continue;
        }
        if (j < cb && is_shard_file(nb[j]->d_name)) {
            j++;
            continue;
        }
        /* a model saved as Hugging Face shards compares as its object */
        char oa[512], ob[512];
        const char *xa = i < ca ? object_of(na[i]->d_name, oa, sizeof oa) : NULL;
        const char *xb = j < cb ? object_of(nb[j]->d_name, ob, sizeof ob) : NULL;
        int c = i >= ca ? 1 : j >= cb ? -1 : strcmp(xa, xb);
        if (c < 0) {
            printf("%s: only in A\n", cli_esc(xa));
            i++;
            d->differences++;
        } else if (c > 0) {
            printf("%s: only in B\n", cli_esc(xb));
            j++;
            d->differences++;
        } else {
            char fa[4096], fb[4096];
            snprintf(fa, sizeof fa, "%s/%s", a, xa);
            snprintf(fb, sizeof fb, "%s/%s", b, xb);
            status = diff_files(d, fa, fb, xa);
            i++;
            j++;
        }
    }
    free_names(na, ca);
    free_names(nb, cb);
    return status;
}

int cli_diff(int argc, char **argv) {
    diff_ctx d = {0};
    const char *paths[2];
    int npaths = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(diff_help, stdout);
            return CLI_OK;
        } else if (!strcmp(a, "--atol") || !strncmp(a, "--atol=", 7)) {
            const char *v = a[6] == '=' ? a + 7 : (i + 1 < argc ? argv[++i] : NULL);
            if (!v) return cli_usage_error("diff", "--atol needs a value");
            if (!cli_parse_double(v, &d.atol) || d.atol < 0)
                return cli_usage_error("diff", "bad value for --atol: '%s'", v);
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("diff", "unknown option '%s'", a);
        } else if (npaths == 2) {
            return cli_usage_error("diff", "unexpected argument '%s'", a);
        } else {
            paths[npaths++] = a;
        }
    }
    if (npaths != 2) return cli_usage_error("diff", "needs two paths, A and B");
    /* Each side is a checkpoint, a project (its newest valid checkpoint) or
     * a state file; anything else would compare nothing and call it equal. */
    static const char expected[] = "a checkpoint folder, a project folder or a .safetensors file";
    char resolved[2][4096];
    const char *use[2];
    bool dir[2];
    for (int k = 0; k < 2; k++) {
        const char *p = paths[k];
        cli_kind kind = cli_classify(p);
        use[k] = p;
        dir[k] = kind == CLI_KIND_CHECKPOINT || kind == CLI_KIND_PROJECT;
        switch (kind) {
        case CLI_KIND_MISSING:
            cli_error("diff: %s: %s", p,
                      strncmp(p, "s3://", 5) == 0 && *ckpt_errmsg() ? ckpt_errmsg()
                                                                    : strerror(errno));
            return CLI_RUNTIME;
        case CLI_KIND_CHECKPOINT:
        case CLI_KIND_STATE_FILE: break;
        case CLI_KIND_PROJECT: {
            int st = cli_newest_valid("diff", p, resolved[k], sizeof resolved[k]);
            if (st != CLI_OK) return st;
            use[k] = resolved[k];
            break;
        }
        default: return cli_wrong_kind("diff", p, kind, expected);
        }
    }
    if (dir[0] != dir[1])
        return cli_usage_error("diff",
                               "A and B must both be checkpoints (or projects) or both files");
    for (int k = 0; k < 2; k++)
        if (use[k] != paths[k])
            printf("%c: %s (the newest valid checkpoint of %s)\n", "AB"[k], cli_esc(use[k]),
                   cli_esc(paths[k]));
    /* object storage: each side read from a verified local copy */
    char copies[2][PATH_MAX];
    for (int k = 0; k < 2; k++)
        if (strncmp(use[k], "s3://", 5) == 0) {
            int st = cli_local_copy("diff", use[k], copies[k], sizeof copies[k]);
            if (st != CLI_OK) return st;
            use[k] = copies[k];
        }
    int status = dir[0] ? diff_dirs(&d, use[0], use[1]) : diff_files(&d, use[0], use[1], "file");
    if (status != CLI_OK) return status;
    if (d.differences) {
        printf("%lld difference%s\n", (long long)d.differences, d.differences == 1 ? "" : "s");
        return CLI_DIFFER;
    }
    printf("equal: %lld tensors, %lld scalar entries%s\n", (long long)d.tensors,
           (long long)d.scalars, d.atol > 0 ? " (within --atol)" : ", bit for bit");
    return CLI_OK;
}
