/* s3_async — an asynchronous save to a project in object storage, driven
 * step by step by tests/integration/test_s3_async.sh:
 *
 *   s3_async <project URL>
 *
 * registers one custom object holding a 4 MiB F32 tensor (element i = i),
 * calls ckpt_save_state_async (the test proxy holds the upload of its file,
 * so the call can only return because the upload runs in the background)
 * and prints "returned <rc>"; then sets every element to -1 (the save holds
 * the state at the call), reads a line on stdin (sent once the test has
 * looked at the bucket and released the upload), calls ckpt_save_wait and
 * prints "waited <rc> <last dir>"; frees the accelerator, loads the newest
 * checkpoint into a fresh one and prints "loaded <rc> <0|1: the values at
 * the call>". Exit 0 when every step succeeded. */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt.h"

enum { N = 1 << 20 };

static float *vals;

static int sd(void *self, ckpt_writer *w) {
    (void)self;
    int64_t shape[1] = {N};
    return ckpt_write_tensor(w, "w", CKPT_F32, 1, shape, vals);
}

static int lsd(void *self, ckpt_reader *r) {
    (void)self;
    int64_t shape[1] = {N};
    return ckpt_read_tensor(r, "w", CKPT_F32, 1, shape, vals);
}

static const ckpt_stateful_ops ops = {sd, lsd, NULL};

static int open_acc(const char *url, ckpt_accelerator **acc) {
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = url;
    cfg.automatic_checkpoint_naming = true;
    int rc = ckpt_accelerator_new(acc, &cfg);
    if (rc == 0) rc = ckpt_register_for_checkpointing(*acc, &ops, NULL);
    return rc;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: s3_async <project URL>\n");
        return 2;
    }
    vals = malloc((size_t)N * sizeof *vals);
    if (!vals) return 1;
    for (int i = 0; i < N; i++) vals[i] = (float)i;
    ckpt_accelerator *acc = NULL;
    int rc = open_acc(argv[1], &acc);
    if (rc == 0) rc = ckpt_save_state_async(acc, NULL);
    printf("returned %d\n", rc);
    fflush(stdout);
    if (rc < 0) fprintf(stderr, "s3_async: %s\n", ckpt_errmsg());
    for (int i = 0; i < N; i++) vals[i] = -1.0f;
    char line[64];
    if (rc == 0 && !fgets(line, sizeof line, stdin)) rc = -1;
    if (rc == 0) {
        rc = ckpt_save_wait(acc);
        const char *last = ckpt_accelerator_last_dir(acc);
        printf("waited %d %s\n", rc, rc == 0 && last ? last : "-");
        if (rc < 0) fprintf(stderr, "s3_async: %s\n", ckpt_errmsg());
    }
    ckpt_accelerator_free(acc);
    acc = NULL;
    if (rc == 0) {
        rc = open_acc(argv[1], &acc);
        if (rc == 0) rc = ckpt_load_state(acc, NULL);
        int same = 1;
        for (int i = 0; rc == 0 && i < N; i++) same &= vals[i] == (float)i;
        printf("loaded %d %d\n", rc, same);
        if (rc < 0) fprintf(stderr, "s3_async: %s\n", ckpt_errmsg());
        if (rc == 0 && !same) rc = -1;
        ckpt_accelerator_free(acc);
    }
    free(vals);
    return rc == 0 ? 0 : 1;
}
