/* hooks.c — keeping your own files with a checkpoint, as Accelerate's
 * save_state pre-hooks do: the hook gets the folder being written and every
 * regular file it puts there is listed in the manifest with its checksum,
 * published atomically with the state files and verified on every load.
 * A post-save hook then learns where the checkpoint landed.
 *
 *   example_hooks [PROJECT_DIR]      (default: runs/hooks)
 *
 * Try `ckpt inspect PROJECT_DIR/checkpoints/checkpoint_0`: notes.txt is shown
 * as an extra file; change a byte of it and `ckpt verify` calls it corrupt.
 */
#include <stdio.h>

#include "ckpt.h"

#define CHECK(call)                                                                                \
    do {                                                                                           \
        int rc_ = (call);                                                                          \
        if (rc_ < 0) {                                                                             \
            fprintf(stderr, "hooks: %s\n", ckpt_errmsg());                                         \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

/* Writes notes.txt into the checkpoint being saved (dir exists, and is
 * published with everything in it once the save commits). */
static int write_notes(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)user;
    char path[4096];
    snprintf(path, sizeof path, "%s/notes.txt", dir);
    FILE *f = fopen(path, "w");
    if (!f) return ckpt_set_error(CKPT_EIO, "hooks: cannot create %s", path);
    fprintf(f, "step %lld, written by a save_state pre-hook\n",
            (long long)ckpt_accelerator_step(acc));
    if (fclose(f) != 0) return ckpt_set_error(CKPT_EIO, "hooks: cannot write %s", path);
    return 0;
}

/* After the commit: the final folder (here, a line on stdout; an upload or
 * a message to a scheduler in real life). */
static int announce(void *user, ckpt_accelerator *acc, const char *dir) {
    (void)user;
    printf("step %lld saved: %s\n", (long long)ckpt_accelerator_step(acc), dir);
    return 0;
}

int main(int argc, char **argv) {
    float w[4] = {1, 2, 3, 4};
    ckpt_model *model;
    ckpt_accelerator *acc;
    CHECK(ckpt_model_new(&model));
    CHECK(ckpt_model_add_param(model, "w", CKPT_F32, 1, (int64_t[]){4}, w, NULL));
    ckpt_project_config cfg = {.project_dir = argc > 1 ? argv[1] : "runs/hooks",
                               .automatic_checkpoint_naming = true};
    CHECK(ckpt_accelerator_new(&acc, &cfg));
    CHECK(ckpt_prepare_model(acc, model));
    CHECK(ckpt_register_save_state_pre_hook(acc, write_notes, NULL, NULL));
    CHECK(ckpt_register_save_state_post_hook(acc, announce, NULL, NULL));

    int rc = ckpt_load_state(acc, NULL);
    if (rc == CKPT_ENOENT) printf("no checkpoint yet: starting at step 0\n");
    else CHECK(rc); /* anything else (corrupt, mismatch) must not be a fresh start */
    for (int i = 0; i < 2; i++) {
        ckpt_accelerator_set_step(acc, ckpt_accelerator_step(acc) + 10);
        CHECK(ckpt_save_state(acc, NULL));
    }
    ckpt_accelerator_free(acc);
    ckpt_model_free(model);
    return 0;
}
