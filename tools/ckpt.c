/* ckpt — the command-line tool (placeholder until the CLI lands). */
#include <stdio.h>

#include "ckpt.h"

int main(int argc, char **argv) {
    (void)argc;
    (void)argv;
    printf("ckpt %s\n", ckpt_version());
    return 0;
}
