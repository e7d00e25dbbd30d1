/* ckpt — the command-line tool: train (the demo), ls, inspect, verify, diff,
 * prune. It uses only the public API in ckpt.h. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"
#include "cli.h"

static const char usage_text[] =
    "usage: ckpt <command> [options]\n"
    "\n"
    "Save and restore the whole state of a training run, exactly.\n"
    "\n"
    "commands:\n"
    "  train     train the demo MLP on handwritten digits, with checkpoints and --resume\n"
    "  ls        list a project's checkpoints with their status\n"
    "  inspect   show the objects, tensors and values in a checkpoint or .safetensors file\n"
    "  verify    check every file of a checkpoint (or of all of a project's) against its manifest\n"
    "  diff      compare two checkpoints (or two .safetensors files) tensor by tensor\n"
    "  prune     remove all but the newest N checkpoints of a project\n"
    "\n"
    "options:\n"
    "  -h, --help     this help ('ckpt <command> --help' for a command's)\n"
    "  -V, --version  the version of the tool and of the library\n"
    "\n"
    "exit codes: 0 ok, 1 differences found or verification failed, 2 usage error,\n"
    "3 runtime error (I/O, malformed file, full disk...)\n";

void cli_error(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    if (cli_rank >= 0) fprintf(stderr, "ckpt: [rank %d] ", cli_rank);
    else fputs("ckpt: ", stderr);
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
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

typedef struct command {
    const char *name;
    int (*run)(int argc, char **argv);
} command;

static const command commands[] = {
    {"train", cli_train}, {"ls", cli_ls},     {"inspect", cli_inspect},
    {"verify", cli_verify}, {"diff", cli_diff}, {"prune", cli_prune},
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
