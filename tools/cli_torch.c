/* cli_torch.c — ckpt export / ckpt import: the bridge to PyTorch and Hugging
 * Face folders (the work is done by the library: ckpt_export_torch,
 * ckpt_import_torch). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "cli.h"

static const char export_help[] =
    "usage: ckpt export [options] CHECKPOINT OUT\n"
    "\n"
    "CHECKPOINT is a checkpoint folder, or a project folder (its newest valid\n"
    "checkpoint).\n"
    "Writes the checkpoint as a folder PyTorch and Hugging Face Accelerate load as\n"
    "they are: model.safetensors, optimizer.bin, scheduler.bin, scaler.pt (the exact\n"
    "structures of torch's state_dict()s) and a README.md saying what does not carry\n"
    "over and which PyTorch loads what. torch.load(..., weights_only=True) opens the\n"
    ".bin and .pt files on PyTorch 2.x; PyTorch 1.13's refuses any file holding a\n"
    "Python float (optimizer.bin, scheduler.bin, scaler.pt, as PyTorch's own), so\n"
    "there load the checkpoint with python/ckpt_torch instead (docs/PYTORCH.md).\n"
    "OUT must not exist; it appears complete or not at all.\n"
    "\n"
    "options:\n"
    "  --weights-only        only the model (for inference and the Hub)\n"
    "  --max-shard-size N    split the model into Hugging Face shards of at most N\n"
    "                        bytes (suffixes KB MB GB = 10^3.., KiB MiB GiB = 2^10..)\n"
    "                        plus model.safetensors.index.json\n"
    "  --bin                 the model as pytorch_model.bin (torch.save format, which\n"
    "                        torch.load(..., weights_only=True) opens from PyTorch\n"
    "                        1.13 on, no safetensors package needed); sharded as\n"
    "                        pytorch_model-0000k-of-0000N.bin plus\n"
    "                        pytorch_model.bin.index.json with --max-shard-size, or\n"
    "                        as the checkpoint's model is sharded\n"
    "  -h, --help            this help\n";

static const char import_help[] =
    "usage: ckpt import [options] SRC CHECKPOINT\n"
    "\n"
    "Makes a ckpt checkpoint from SRC: an Accelerate folder (model.safetensors or\n"
    "pytorch_model.bin, sharded or not, optimizer.bin, scheduler.bin, scaler.pt),\n"
    "a folder of Hugging Face weights, or one file (a torch.save'd state dict or a\n"
    ".safetensors file). Pickles are read by an allow-list reader that never runs\n"
    "code. CHECKPOINT must not exist.\n"
    "\n"
    "options:\n"
    "  --optimizer KIND      sgd, adam, adamw or rmsprop (needed for Adam/AdamW state with\n"
    "                        weight decay: the file cannot say which)\n"
    "  --scheduler KIND      steplr, exponentiallr, cosineannealinglr, warmup_cosine,\n"
    "                        warmup_linear or constant (needed for a LambdaLR)\n"
    "  --warmup N, --total N the LambdaLR schedule's warmup and total steps\n"
    "  --step N              the checkpoint's step (default: the optimizer's)\n"
    "  --seed N              seed of the checkpoint's random generator (default 0)\n"
    "  --param-names FILE    the names of optimizer.bin's parameters, one a line, in\n"
    "                        its order (torch before 2.6 keeps none; without them\n"
    "                        the import names them only when the model file proves\n"
    "                        the order, see docs/PYTORCH.md)\n"
    "  --max-output-size N   allow a checkpoint of up to N bytes of tensors (suffixes\n"
    "                        as for export); default 64 times the bytes of the files\n"
    "                        read, at least 1 MiB: a torch file's storage may be\n"
    "                        shared by many tensors, so a small file can stand for\n"
    "                        a huge checkpoint. The sizes are printed first\n"
    "  -h, --help            this help\n";

/* "--name VALUE" or "--name=VALUE"; NULL if a is not --name. */
static const char *opt_value(const char *a, const char *name, int argc, char **argv, int *i,
                             bool *missing) {
    size_t n = strlen(name);
    if (strncmp(a, name, n) != 0) return NULL;
    if (a[n] == '=') return a + n + 1;
    if (a[n] != '\0') return NULL;
    if (*i + 1 < argc) return argv[++*i];
    *missing = true;
    return NULL;
}

int cli_export(int argc, char **argv) {
    ckpt_export_options o = {0};
    const char *paths[2];
    int npaths = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        bool missing = false;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(export_help, stdout);
            return CLI_OK;
        } else if (!strcmp(a, "--weights-only")) {
            o.weights_only = true;
        } else if (!strcmp(a, "--bin")) {
            o.torch_bin = true;
        } else if ((v = opt_value(a, "--max-shard-size", argc, argv, &i, &missing)) || missing) {
            if (missing) return cli_usage_error("export", "--max-shard-size needs a value");
            if (!cli_parse_size(v, &o.max_shard_size))
                return cli_usage_error("export", "bad size for --max-shard-size: '%s'", v);
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("export", "unknown option '%s'", a);
        } else if (npaths == 2) {
            return cli_usage_error("export", "unexpected argument '%s'", a);
        } else {
            paths[npaths++] = a;
        }
    }
    if (npaths != 2) return cli_usage_error("export", "needs CHECKPOINT and OUT");
    /* a project folder stands for its newest valid checkpoint */
    char newest[4096];
    if (cli_classify(paths[0]) == CLI_KIND_PROJECT) {
        int st = cli_newest_valid("export", paths[0], newest, sizeof newest);
        if (st != CLI_OK) return st;
        printf("exporting %s (the newest valid checkpoint of %s)\n", cli_esc(newest),
               cli_esc(paths[0]));
        paths[0] = newest;
    }
    if (ckpt_export_torch(paths[0], paths[1], &o) < 0) {
        cli_error("%s", ckpt_errmsg());
        return CLI_RUNTIME;
    }
    printf("exported %s to %s\n", cli_esc(paths[0]), cli_esc(paths[1]));
    return CLI_OK;
}

/* The lines of a --param-names file (empty lines skipped) into *names, the
 * text they point into into *text. false with a message on failure. */
static bool read_param_names(const char *path, char **text, const char ***names, int64_t *n) {
    FILE *fp = cli_fopen_regular(path, 'r');
    if (!fp) {
        cli_error("--param-names: %s: %s", path,
                  errno == EINVAL ? "not a regular file" : strerror(errno));
        return false;
    }
    size_t cap = 0, len = 0;
    char *buf = NULL;
    bool ok = true;
    for (;;) {
        if (len + 4096 + 1 > cap) {
            char *g = cap > (64u << 20) ? NULL : realloc(buf, cap = cap * 2 + 4096 + 1);
            if (!g) {
                cli_error("--param-names: %s: too large or out of memory", path);
                ok = false;
                break;
            }
            buf = g;
        }
        size_t got = fread(buf + len, 1, 4096, fp);
        len += got;
        if (got < 4096) {
            if (ferror(fp)) {
                cli_error("--param-names: %s: read error", path);
                ok = false;
            }
            break;
        }
    }
    fclose(fp);
    if (!ok) {
        free(buf);
        return false;
    }
    buf[len] = '\0';
    if (strlen(buf) != len) {
        cli_error("--param-names: %s: not a text file (a NUL byte)", path);
        free(buf);
        return false;
    }
    const char **v = calloc(len / 2 + 2, sizeof *v);
    if (!v) {
        cli_error("--param-names: out of memory");
        free(buf);
        return false;
    }
    int64_t k = 0;
    for (char *line = buf; *line;) {
        char *end = strchr(line, '\n');
        char *next = end ? end + 1 : line + strlen(line);
        if (end) *end = '\0';
        size_t l = strlen(line);
        if (l && line[l - 1] == '\r') line[--l] = '\0';
        if (l) v[k++] = line;
        line = next;
    }
    *text = buf;
    *names = v;
    *n = k;
    return true;
}

/* The sizes, before anything is written. */
static void print_sizes(void *user, uint64_t input_bytes, uint64_t output_bytes) {
    (void)user;
    char in[32], out[32];
    printf("read %s (%llu bytes); the checkpoint will hold %s (%llu bytes) of tensors\n",
           cli_human_bytes(input_bytes, in, sizeof in), (unsigned long long)input_bytes,
           cli_human_bytes(output_bytes, out, sizeof out), (unsigned long long)output_bytes);
    fflush(stdout);
}

int cli_import(int argc, char **argv) {
    ckpt_import_options o = ckpt_import_defaults();
    const char *names_file = NULL;
    const char *paths[2];
    int npaths = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v;
        bool missing = false;
        int64_t n;
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(import_help, stdout);
            return CLI_OK;
        } else if ((v = opt_value(a, "--optimizer", argc, argv, &i, &missing)) || missing) {
            if (missing) return cli_usage_error("import", "--optimizer needs a value");
            if (!strcmp(v, "sgd")) o.optimizer = CKPT_OPTIM_SGD;
            else if (!strcmp(v, "adam")) o.optimizer = CKPT_OPTIM_ADAM;
            else if (!strcmp(v, "adamw")) o.optimizer = CKPT_OPTIM_ADAMW;
            else if (!strcmp(v, "rmsprop")) o.optimizer = CKPT_OPTIM_RMSPROP;
            else
                return cli_usage_error(
                    "import", "--optimizer must be sgd, adam, adamw or rmsprop, not '%s'", v);
        } else if ((v = opt_value(a, "--scheduler", argc, argv, &i, &missing)) || missing) {
            if (missing) return cli_usage_error("import", "--scheduler needs a value");
            o.scheduler = v;
        } else if ((v = opt_value(a, "--warmup", argc, argv, &i, &missing)) || missing) {
            if (missing || !cli_parse_i64(v, 0, INT64_MAX, &n))
                return cli_usage_error("import", "--warmup needs a number >= 0");
            o.warmup = n;
        } else if ((v = opt_value(a, "--total", argc, argv, &i, &missing)) || missing) {
            if (missing || !cli_parse_i64(v, 0, INT64_MAX, &n))
                return cli_usage_error("import", "--total needs a number >= 0");
            o.total = n;
        } else if ((v = opt_value(a, "--step", argc, argv, &i, &missing)) || missing) {
            if (missing || !cli_parse_i64(v, 0, INT64_MAX, &n))
                return cli_usage_error("import", "--step needs a number >= 0");
            o.step = n;
        } else if ((v = opt_value(a, "--max-output-size", argc, argv, &i, &missing)) || missing) {
            if (missing || !cli_parse_size(v, &o.max_output_size))
                return cli_usage_error("import", "--max-output-size needs a size in bytes (e.g. "
                                                 "20GB)");
        } else if ((v = opt_value(a, "--seed", argc, argv, &i, &missing)) || missing) {
            if (missing || !cli_parse_i64(v, 0, INT64_MAX, &n))
                return cli_usage_error("import", "--seed needs a number >= 0");
            o.seed = (uint64_t)n;
        } else if ((v = opt_value(a, "--param-names", argc, argv, &i, &missing)) || missing) {
            if (missing) return cli_usage_error("import", "--param-names needs a file");
            names_file = v;
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error("import", "unknown option '%s'", a);
        } else if (npaths == 2) {
            return cli_usage_error("import", "unexpected argument '%s'", a);
        } else {
            paths[npaths++] = a;
        }
    }
    if (npaths != 2) return cli_usage_error("import", "needs SRC and CHECKPOINT");
    char *text = NULL;
    const char **names = NULL;
    if (names_file) {
        if (!read_param_names(names_file, &text, &names, &o.num_param_names)) return CLI_RUNTIME;
        o.param_names = names;
    }
    o.on_sizes = print_sizes;
    int rc = ckpt_import_torch(paths[0], paths[1], &o);
    free(names);
    free(text);
    if (rc < 0) {
        cli_error("%s", ckpt_errmsg());
        return CLI_RUNTIME;
    }
    printf("imported %s into %s\n", cli_esc(paths[0]), cli_esc(paths[1]));
    return CLI_OK;
}
