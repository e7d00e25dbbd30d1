/* cli_inspect.c — `ckpt inspect`: what is inside a checkpoint, a state
 * file or a PyTorch file. */
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

/* ---- inspect -------------------------------------------------------------- */

/* A 0-dim tensor's value (a step count, a scale kept as a tensor): as
 * numbers are printed, or its bytes in hex for a dtype without a number
 * form here (F8, F4, C64...). */
static void print_tensor_value(ckpt_reader *r, const ckpt_entry_info *e, bool json) {
    const void *data = NULL;
    char num[48];
    if (ckpt_reader_tensor_view(r, e->key, &data, NULL) < 0 || !data) return;
    const unsigned char *p = data;
    cli_element_text(e->dtype, p, 0, num, sizeof num);
    if (strcmp(num, "?") != 0) {
        bool finite = strspn(num, "-+0123456789.eE") == strlen(num);
        printf(json ? (finite ? ",\"value\":%s" : ",\"value\":\"%s\"") : "  = %s", num);
        return;
    }
    printf(json ? ",\"hex\":\"" : "  = 0x");
    for (uint64_t i = e->nbytes; i-- > 0;)
        printf("%02x", p[i]); /* little-endian: high byte first */
    if (json) putchar('"');
}

/* Prints one entry's value (scalars, 0-dim tensors) or description (tensors,
 * aliases). */
static int print_entry(ckpt_reader *r, const ckpt_entry_info *e, bool json) {
    int rc = CKPT_OK;
    if (json) {
        printf("{\"key\":");
        cli_json_string(e->key);
        printf(",\"kind\":\"%s\"", cli_kind_name(e->kind));
    } else {
        printf("    %-40s ", cli_esc(e->key));
    }
    switch (e->kind) {
    case CKPT_ENTRY_TENSOR:
        if (json) {
            printf(",\"dtype\":\"%s\",\"shape\":", ckpt_dtype_name(e->dtype));
            cli_print_shape(e);
            printf(",\"bytes\":%llu,\"offset\":%llu", (unsigned long long)e->nbytes,
                   (unsigned long long)e->offset);
            if (e->ndim == 0) print_tensor_value(r, e, true);
            putchar('}');
        } else {
            printf("%-5s ", ckpt_dtype_name(e->dtype));
            cli_print_shape(e);
            printf("  %llu bytes", (unsigned long long)e->nbytes);
            if (e->ndim == 0) print_tensor_value(r, e, false);
            putchar('\n');
        }
        break;
    case CKPT_ENTRY_ALIAS:
        if (json) {
            printf(",\"target\":");
            cli_json_string(e->target ? e->target : "");
            putchar('}');
        } else {
            printf("-> %s (tied: the same tensor, saved once)\n",
                   cli_esc(e->target ? e->target : ""));
        }
        break;
    case CKPT_ENTRY_U64: {
        uint64_t v = 0;
        rc = ckpt_read_u64(r, e->key, &v);
        printf(json ? ",\"value\":%llu}" : "= %llu\n", (unsigned long long)v);
        break;
    }
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

/* What a part file holds, for its heading: "the frozen tensors of
 * model.safetensors, whole" (the frozen file, and a model's shard 1 of 1
 * written by one process before format version 3), else "rank 2's chunks
 * of tensors of optimizer.safetensors". */
static void part_note(const char *name, const char *obj, const char *kind, int nprocs, char *buf,
                      size_t cap) {
    size_t n = strlen(name), tail = strlen("-00000-of-00000.safetensors");
    bool frozen = cli_is_frozen_file(name);
    int rank = frozen ? 0 : atoi(name + n - tail + 1) - 1;
    bool single = frozen || (nprocs == 1 && strstr(name + n - tail, "-of-00001."));
    if (single && !strcmp(kind, "model"))
        snprintf(buf, cap, "the frozen tensors of %s, whole", obj);
    else
        snprintf(buf, cap, "rank %d's chunks of tensors of %s (sharded, or split over the ranks)",
                 rank, obj);
}

/* For an object's file: which files of the folder hold its other tensors
 * ("; its other tensors are in model.frozen.safetensors"), or "". */
static void companions_note(const char *dir, const char *file, struct dirent **names, int n,
                            char *buf, size_t cap) {
    int count = 0;
    const char *one = NULL;
    char obj[512];
    for (int i = 0; i < n; i++)
        if (cli_part_of(dir, names[i]->d_name, obj, sizeof obj) && !strcmp(obj, file)) {
            count++;
            if (!one) one = names[i]->d_name;
        }
    if (count == 0) buf[0] = '\0';
    else if (count == 1) snprintf(buf, cap, "; its other tensors are in %s", one);
    else snprintf(buf, cap, "; its other tensors are chunks in %d shard files", count);
}

/* Lists the entries of path: of that file alone (whole false), or of the
 * object it is with its other files (a model saved as Hugging Face shards).
 * check (may be NULL): an object's file, opened first as the library opens
 * a checkpoint's object (every file of it checked against the manifest,
 * never through a link), so that a damaged file is refused before its
 * entries are listed. note follows the heading; part: the object a part
 * file belongs to. */
static int inspect_file(const char *path, const char *label, const char *note, const char *part,
                        bool whole, const char *check, bool json, bool first) {
    ckpt_reader *r = NULL;
    int rc = CKPT_OK;
    if (!whole && check) {
        rc = cli_open_state(check, &r);
        ckpt_reader_free(r);
        r = NULL;
        if (rc < 0) return cli_lib_error("inspect", rc);
    }
    rc = whole ? cli_open_state(path, &r) : ckpt_reader_open(&r, path);
    if (rc < 0) return cli_lib_error("inspect", rc);
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
        if (part) printf(",\"part_of\":"), cli_json_string(part);
        printf(",\"tensors\":%lld,\"tensor_bytes\":%llu,\"entries\":[", (long long)ntensors,
               (unsigned long long)tensor_bytes);
    } else {
        char size[32];
        printf("%s: %lld entries, %lld tensors (%s)%s\n", cli_esc(label), (long long)n,
               (long long)ntensors, cli_human_bytes(tensor_bytes, size, sizeof size),
               cli_esc(note));
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
        cli_lib_error("inspect", rc);
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
    if (rc < 0) return cli_lib_error("inspect", rc);
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
    if (!cli_is_dir(path)) {
        if (json) printf("{\"path\":"), cli_json_string(path), printf(",\"objects\":[");
        /* inside a checkpoint, its object is checked first (a part file's
         * object is the file it belongs to) */
        const char *slash = strrchr(path, '/');
        char dir[4096], obj[512], manifest[4200], check[4700];
        snprintf(dir, sizeof dir, "%.*s", slash ? (int)(slash - path) : 1, slash ? path : ".");
        snprintf(manifest, sizeof manifest, "%s/checkpoint.json", dir);
        struct stat mst;
        bool in_ckpt = lstat(manifest, &mst) == 0;
        if (in_ckpt && cli_part_of(dir, slash ? slash + 1 : path, obj, sizeof obj))
            snprintf(check, sizeof check, "%s/%s", dir, obj);
        else snprintf(check, sizeof check, "%s", path);
        int st = inspect_file(path, path, "", NULL, false, check, json, true);
        if (st == CLI_OK && json) printf("]}\n");
        return st;
    }

    struct dirent **names = NULL;
    int n = cli_list_state_files(path, &names);
    if (n < 0) {
        cli_error("inspect: %s: %s", path, strerror(errno));
        return CLI_RUNTIME;
    }
    if (kind == CLI_KIND_FOLDER && n == 0) {
        /* no manifest and no state file: nothing inspect can look into */
        cli_free_names(names, n);
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
    ckpt_checkpoint_file *files = NULL; /* the manifest's kinds, if it reads */
    int64_t nfiles = 0;
    if (ckpt_checkpoint_files(path, &files, &nfiles) < 0) nfiles = 0;
    char **checked = calloc((size_t)n + 1, sizeof *checked); /* objects checked so far */
    int nchecked = 0;
    if (!checked) {
        cli_free_names(names, n);
        free(files);
        cli_error("inspect: out of memory");
        return CLI_RUNTIME;
    }
    char manifest[4200]; /* with one, each object is checked as the library opens it */
    snprintf(manifest, sizeof manifest, "%s/checkpoint.json", path);
    struct stat mst;
    bool in_ckpt = lstat(manifest, &mst) == 0;
    int status = CLI_OK, shown = 0;
    for (int i = 0; i < n && status == CLI_OK; i++) {
        const char *name = names[i]->d_name;
        if (cli_is_shard_file(name) && cli_is_hf_part(path, name))
            continue; /* shown with its index */
        char file[4096], obj[512], label[640], note[1024] = "", part[512];
        const char *o = cli_object_of(name, obj, sizeof obj);
        snprintf(file, sizeof file, "%s/%s", path, o);
        if (o != name && !json)
            snprintf(label, sizeof label, "%s (Hugging Face shards: %s)", o, name);
        else snprintf(label, sizeof label, "%s", name);
        /* each file lists what it holds; a frozen or shard file says whose
         * tensors, an object's file where its other tensors are */
        bool is_part = cli_part_of(path, name, part, sizeof part);
        if (is_part) {
            char what[900];
            const char *fkind = "";
            for (int64_t k = 0; k < nfiles; k++)
                if (!strcmp(files[k].name, name)) fkind = files[k].kind;
            part_note(name, part, fkind, vrc == CKPT_OK ? info.num_processes : 0, what,
                      sizeof what);
            snprintf(note, sizeof note, ", %s", what);
        } else if (o == name) {
            companions_note(path, name, names, n, note, sizeof note);
        }
        /* each object is checked once, before the first of its files */
        const char *objname = is_part ? part : name;
        bool seen = false;
        for (int k = 0; k < nchecked && !seen; k++) seen = !strcmp(checked[k], objname);
        char check[4600];
        snprintf(check, sizeof check, "%s/%s", path, objname);
        if (!seen && nchecked < n && (checked[nchecked] = strdup(objname)) != NULL) nchecked++;
        if (!json) putchar('\n');
        status = inspect_file(file, label, note, is_part ? part : NULL, o != name,
                              seen || !in_ckpt ? NULL : check, json, shown++ == 0);
    }
    for (int k = 0; k < nchecked; k++) free(checked[k]);
    free(checked);
    cli_free_names(names, n);
    free(files);
    if (status == CLI_OK) print_extra_files(path, json);
    if (status == CLI_OK && json) printf("}\n");
    return status;
}
