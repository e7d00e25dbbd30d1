/* ckpt — the command-line tool: train (the demo), ls, inspect, verify, diff,
 * prune, export, import, each in a file of its own (cli_<command>.c), the
 * helpers they share in cli_common.c. It uses only the public API in
 * ckpt.h. */
#include <stdio.h>
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
    "  ls        list a project's checkpoints (or one checkpoint) with their status\n"
    "  inspect   show the objects, tensors and values in a checkpoint or .safetensors file\n"
    "  verify    check every file of a checkpoint (or of all of a project's) against its manifest\n"
    "  diff      compare two checkpoints, projects or .safetensors files tensor by tensor\n"
    "  prune     keep a project's newest N valid checkpoints, remove older ones and leftovers\n"
    "  export    write a checkpoint as a folder PyTorch / Accelerate loads as is\n"
    "  import    make a checkpoint from a PyTorch, Accelerate or Hugging Face folder or file\n"
    "\n"
    "options:\n"
    "  -h, --help     this help ('ckpt <command> --help' or 'ckpt help <command>' for a\n"
    "                 command's)\n"
    "  -V, --version  the version of the tool and of the library\n"
    "\n"
    "exit codes: 0 ok, 1 differences found or verification failed, 2 usage error,\n"
    "3 runtime error (I/O, malformed file, full disk...)\n";

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
    if (!strcmp(cmd, "help") && argc > 2) {
        /* 'ckpt help CMD' is 'ckpt CMD --help' */
        for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++) {
            if (!strcmp(argv[2], commands[i].name)) {
                char *args[] = {argv[2], "--help", NULL};
                return commands[i].run(2, args);
            }
        }
        cli_error("help: unknown command '%s' (see 'ckpt --help')", argv[2]);
        return CLI_USAGE;
    }
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
