/* ckpt — the command-line tool: train (the demo), ls, inspect, verify, diff,
 * prune, export, import. It uses only the public API in ckpt.h. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt.h"
#include "cli.h"

static const char usage_text[] =
    "usage: ckpt <command> [options]\n"
    "\n"
    "Save and restore the whole state of a training run, exactly.\n"
    "\n"
    "commands:\n"
    "  train     train the demo MLP on handwritten digits, with checkpoints and --resume\n"
    "  ls        list a project's checkpoints (or one checkpoint) with their status\n"
    "  inspect   show the objects, tensors and values in a checkpoint or .safetensors file\n"
    "  verify    check every file of a checkpoint (or of all of a project's) against its manifest\n"
    "  diff      compare two checkpoints, projects or .safetensors files tensor by tensor\n"
    "  prune     keep a project's newest N valid checkpoints, remove older ones and leftovers\n"
    "  export    write a checkpoint as a folder PyTorch / Accelerate loads as is\n"
    "  import    make a checkpoint from a PyTorch, Accelerate or Hugging Face folder or file\n"
    "\n"
    "options:\n"
    "  -h, --help     this help ('ckpt <command> --help' for a command's)\n"
    "  -V, --version  the version of the tool and of the library\n"
    "\n"
    "exit codes: 0 ok, 1 differences found or verification failed, 2 usage error,\n"
    "3 runtime error (I/O, malformed file, full disk...)\n";

/* One write for the whole line: stderr is unbuffered, and the ranks of a job
 * share it, so a line written piecewise could be cut by another rank's. */
void cli_error(const char *fmt, ...) {
    char prefix[48];
    if (cli_rank >= 0) snprintf(prefix, sizeof prefix, "ckpt: [rank %d] ", cli_rank);
    else snprintf(prefix, sizeof prefix, "ckpt: ");
    va_list ap;
    va_start(ap, fmt);
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    size_t plen = strlen(prefix);
    char *line = n >= 0 ? malloc(plen + (size_t)n + 2) : NULL;
    if (line) {
        memcpy(line, prefix, plen);
        vsnprintf(line + plen, (size_t)n + 1, fmt, ap2);
        line[plen + (size_t)n] = '\n';
        fwrite(line, 1, plen + (size_t)n + 1, stderr);
        free(line);
    } else { /* no memory: piecewise is still better than nothing */
        fputs(prefix, stderr);
        vfprintf(stderr, fmt, ap2);
        fputc('\n', stderr);
    }
    va_end(ap2);
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ckpt %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    fprintf(stderr, "\n(see 'ckpt %s --help')\n", cmd);
    va_end(ap);
    return CLI_USAGE;
}

bool cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool cli_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v)) return false;
    *out = v;
    return true;
}

void cli_json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': fputs("\\\"", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        case '\n': fputs("\\n", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        default:
            if (*p < 0x20) printf("\\u%04x", *p);
            else putchar(*p);
        }
    }
    putchar('"');
}

const char *cli_human_bytes(uint64_t n, char *buf, int cap) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, (size_t)cap, "%llu B", (unsigned long long)n);
    else snprintf(buf, (size_t)cap, "%.1f %s", v, units[u]);
    return buf;
}

static const char *shortest(double v, bool single, char *buf, int cap) {
    if (isnan(v)) snprintf(buf, (size_t)cap, "nan");
    else if (isinf(v)) snprintf(buf, (size_t)cap, v < 0 ? "-inf" : "inf");
    else {
        for (int prec = 1; prec <= 17; prec++) {
            snprintf(buf, (size_t)cap, "%.*g", prec, v);
            if (single ? strtof(buf, NULL) == (float)v : strtod(buf, NULL) == v) {
                if (v != 0 || signbit(strtod(buf, NULL)) == signbit(v)) return buf;
            }
        }
        snprintf(buf, (size_t)cap, "%.17g", v);
    }
    return buf;
}

const char *cli_format_double(double v, char *buf, int cap) { return shortest(v, false, buf, cap); }

bool cli_parse_size(const char *s, uint64_t *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return false;
    static const struct {
        const char *suffix;
        double mult;
    } units[] = {{"", 1},         {"B", 1},          {"KB", 1e3},       {"MB", 1e6},
                 {"GB", 1e9},     {"TB", 1e12},      {"KiB", 1024.0},   {"MiB", 1048576.0},
                 {"GiB", 1073741824.0}, {"TiB", 1099511627776.0}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].suffix) == 0) {
            double b = v * units[i].mult;
            if (b < 1 || b > 1.8e19) return false;
            *out = (uint64_t)b;
            return true;
        }
    }
    return false;
}

bool cli_parse_keep_best(const char *s, char *metric, size_t cap, ckpt_best_mode *mode, int64_t *k) {
    const char *c1 = strchr(s, ':');
    if (!c1 || c1 == s || (size_t)(c1 - s) >= cap) return false;
    const char *c2 = strchr(c1 + 1, ':');
    if (!c2) return false;
    size_t ml = (size_t)(c2 - c1 - 1);
    if (ml == 3 && !strncmp(c1 + 1, "min", 3)) *mode = CKPT_BEST_MIN;
    else if (ml == 3 && !strncmp(c1 + 1, "max", 3)) *mode = CKPT_BEST_MAX;
    else return false;
    if (!cli_parse_i64(c2 + 1, 1, INT32_MAX, k)) return false;
    memcpy(metric, s, (size_t)(c1 - s));
    metric[c1 - s] = '\0';
    return true;
}

void cli_print_metrics(const ckpt_checkpoint_info *info, bool json) {
    if (info->num_metrics <= 0) return;
    if (json) printf(",\"metrics\":{");
    for (int i = 0; i < info->num_metrics; i++) {
        char num[40];
        cli_format_double(info->metrics[i].value, num, sizeof num);
        if (json) {
            if (i) putchar(',');
            cli_json_string(info->metrics[i].name);
            printf(":%s", num); /* names are plain; values are finite */
        } else {
            printf("%s%s=%s", i ? " " : "  ", info->metrics[i].name, num);
        }
    }
    if (json) putchar('}');
}
const char *cli_format_float(float v, char *buf, int cap) { return shortest(v, true, buf, cap); }

/* See cli.h. */
FILE *cli_fopen_regular(const char *path, char how) {
    int flags = how == 'r' ? O_RDONLY : O_WRONLY | O_CREAT;
    if (how == 'a') flags |= O_APPEND;
    if (how == 'x') flags |= O_EXCL;
    bool reading = how == 'r';
    int fd =
        open(path, flags | (reading ? 0 : O_NOFOLLOW) | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644);
    if (fd < 0) return NULL;
    struct stat st;
    int e = 0;
    if (fstat(fd, &st) != 0) e = errno;
    else if (!S_ISREG(st.st_mode) || (!reading && st.st_nlink > 1)) e = EINVAL;
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) e = errno;
    else if (how == 'w' && ftruncate(fd, 0) != 0) e = errno;
    FILE *f = e ? NULL : fdopen(fd, how == 'r' ? "r" : how == 'a' ? "a" : "w");
    if (!f) {
        if (!e) e = errno;
        close(fd);
        errno = e;
    }
    return f;
}

cli_kind cli_classify(const char *path) {
    struct stat st;
    if (stat(path, &st) != 0) return CLI_KIND_MISSING;
    if (S_ISDIR(st.st_mode)) {
        char sub[PATH_MAX];
        snprintf(sub, sizeof sub, "%s/checkpoint.json", path);
        if (access(sub, F_OK) == 0) return CLI_KIND_CHECKPOINT;
        snprintf(sub, sizeof sub, "%s/checkpoints", path);
        struct stat cs;
        if (stat(sub, &cs) == 0 && S_ISDIR(cs.st_mode)) return CLI_KIND_PROJECT;
        return CLI_KIND_FOLDER;
    }
    unsigned char head[9] = {0};
    size_t got = 0;
    /* Only a regular file is looked into (a FIFO would block the read):
     * the command that opens it says what else it is. */
    int fd = S_ISREG(st.st_mode) ? open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC) : -1;
    struct stat fs;
    if (fd >= 0 && fstat(fd, &fs) == 0 && S_ISREG(fs.st_mode)) {
        ssize_t r = read(fd, head, sizeof head);
        got = r > 0 ? (size_t)r : 0;
    }
    if (fd >= 0) close(fd);
    if (got >= 4 && !memcmp(head, "PK\x03\x04", 4)) return CLI_KIND_TORCH_ZIP;
    size_t n = strlen(path);
    if (n > 12 && !strcmp(path + n - 12, ".safetensors")) return CLI_KIND_STATE_FILE;
    /* safetensors: an 8-byte little-endian header length, then '{' */
    if (got == 9 && head[8] == '{') {
        uint64_t len = 0;
        for (int i = 7; i >= 0; i--) len = len << 8 | head[i];
        if (len >= 2 && len <= (uint64_t)st.st_size - 8) return CLI_KIND_STATE_FILE;
    }
    return CLI_KIND_OTHER_FILE;
}

int cli_wrong_kind(const char *cmd, const char *path, cli_kind kind, const char *expected) {
    switch (kind) {
    case CLI_KIND_TORCH_ZIP:
        return cli_usage_error(
            cmd,
            "%s is a PyTorch file (a zip archive, as torch.save writes), not safetensors; "
            "expected %s. 'ckpt import %s CHECKPOINT_DIR' converts it into a checkpoint; or, for "
            "a state dict of tensors, in Python: "
            "from safetensors.torch import save_file; save_file(torch.load('%s'), 'out.safetensors')",
            path, expected, path, path);
    case CLI_KIND_FOLDER:
        return cli_usage_error(cmd,
                               "%s is not a checkpoint (no checkpoint.json) nor a project (no "
                               "checkpoints folder); expected %s",
                               path, expected);
    case CLI_KIND_PROJECT:
        return cli_usage_error(cmd, "%s is a project folder; expected %s (see 'ckpt ls %s')", path,
                               expected, path);
    default:
        return cli_usage_error(cmd, "%s is not a checkpoint, a project or a safetensors file; "
                               "expected %s", path, expected);
    }
}

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
} command;

static const command commands[] = {
    {"train", cli_train}, {"ls", cli_ls},     {"inspect", cli_inspect},
    {"verify", cli_verify}, {"diff", cli_diff}, {"prune", cli_prune},
    {"export", cli_export}, {"import", cli_import},
};

int main(int argc, char **argv) {
    if (argc < 2) {
        fputs(usage_text, stderr);
        return CLI_USAGE;
    }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "-h") || !strcmp(cmd, "--help") || !strcmp(cmd, "help")) {
        fputs(usage_text, stdout);
        return CLI_OK;
    }
    if (!strcmp(cmd, "-V") || !strcmp(cmd, "--version")) {
        printf("ckpt %s (library %s)\n", CKPT_VERSION_STRING, ckpt_version());
        return CLI_OK;
    }
    for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
        if (!strcmp(cmd, commands[i].name)) return commands[i].run(argc - 1, argv + 1);
    cli_error("unknown command '%s' (see 'ckpt --help')", cmd);
    return CLI_USAGE;
}
