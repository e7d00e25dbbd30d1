/* cli_train.h — `ckpt train`'s pieces shared by its files: the options
 * (cli_train_opts.c), the trainer's setup and gradient exchange
 * (cli_train_setup.c), what the run asks of checkpoints (cli_train_ckpt.c:
 * resume, --init-from, saves, the run's settings saved with them) and the
 * training loop with its log (cli_train.c). */
#ifndef CKPT_TOOLS_CLI_TRAIN_H
#define CKPT_TOOLS_CLI_TRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ckpt.h"
#include "cli.h"
#include "digits.h"
#include "mlp.h"

#define HIDDEN 256
#define DROPOUT 0.1f
/* every TEST_EVERY-th row (offset TEST_EVERY-1) is held out: a fixed split
 * that samples all the data set's writers, unlike its last rows alone */
#define TEST_EVERY 6

typedef struct train_opts {
    int64_t epochs, batch_size, seed, save_every, total_limit, workers, log_every;
    int64_t link_copies; /* 0: the library's default */
    double lr, save_every_seconds;
    double collective_timeout;  /* seconds; 0: none (the config's negative) */
    int64_t keep_every, best_k; /* retention beyond --total-limit */
    char best_metric[64];
    ckpt_best_mode best_mode;
    const char *project_dir;
    const char *data;
    const char *init_from;   /* a checkpoint folder: its model only */
    const char *resume_from; /* --resume-from: that checkpoint, not the newest */
    const char *freeze[16];  /* --freeze patterns */
    int nfreeze;
    uint64_t max_shard_size;
    /* storage tiers: --local-dir, --replicas (-1: not given), --persist-every,
     * --ranks-per-node */
    const char *local_dir;
    int64_t replicas, persist_every, ranks_per_node;
    bool resume, quiet, shard_optimizer, async;
    bool drop_data_position; /* resume with another global batch (see the help) */
    bool log_every_given;    /* --log-every: lines, never a redrawn bar */
} train_opts;

/* Saved as a custom object so that a resume with different settings is
 * refused instead of silently continuing a different run. */
typedef struct run_config {
    int64_t epochs, batch_size, seed, train_rows, hidden;
    double lr;
} run_config;

/* A progress line shows the mean loss of the steps since the previous line
 * (the last --log-every steps; at most LOSS_RING). A resumed run refills the
 * ring from the metrics log, which holds every step's loss exactly (%.9g of
 * a float round-trips) and is cut back to the resumed step, so the first line
 * after a resume averages the same losses, in the same order, as the
 * uninterrupted run's line. Nothing of it is in the checkpoint: what is
 * printed never changes what is saved. */
#define LOSS_RING 1024
typedef struct loss_history {
    float loss[LOSS_RING]; /* step s's loss at (s - 1) % LOSS_RING */
    int64_t steps;         /* the last step recorded */
    int64_t known_from;    /* losses of steps known_from..steps are held */
} loss_history;

typedef struct trainer {
    train_opts opt;
    digits_sample *rows;
    digits_sample *train_rows, *test_rows;
    int64_t ntrain, ntest;
    mlp net;
    float *x;
    int32_t *y, *pred;
    ckpt_model *model;
    ckpt_optimizer *optim;
    ckpt_scheduler *sched;
    ckpt_grad_scaler *scaler;
    ckpt_dataset dataset;
    ckpt_dataloader *loader;
    ckpt_accelerator *acc;
    run_config config, saved_config;
    loss_history losses;
    FILE *metrics;
    bool tty; /* a progress bar is being redrawn on stdout */
    /* many processes: data parallel over dist.comm (cli_dist.c) */
    cli_dist dist;
    bool speak;      /* this process prints and writes metrics (rank 0) */
    float *exchange; /* every gradient, then the loss and the stop flag */
    float *scratch;  /* every rank's exchange */
    size_t nexchange;
    double ckpt_seconds; /* spent inside checkpoint calls by the loop */
    int64_t nsaves;
    /* bytes written and linked by the synchronous saves: the first, the rest */
    uint64_t first_written, later_written, later_linked;
    int64_t nlater;
    char resumed_from[4096]; /* the checkpoint --resume loaded */
} trainer;

/* cli_train_opts.c: the command line into o; 0, -1 after --help (done), or
 * the exit code of a usage error. */
int train_parse_opts(int argc, char **argv, train_opts *o);

/* cli_train_setup.c */
int trainer_setup(trainer *t);
void trainer_free(trainer *t);
/* Reports a failed library call and returns CLI_RUNTIME. */
int train_fail(const char *what, int rc);
int train_exchange(trainer *t, float *loss, bool *stop);

/* cli_train_ckpt.c */
extern const ckpt_stateful_ops train_config_ops;
double train_now(void);
int64_t train_evaluate(mlp *net, const digits_sample *rows, int64_t n, float *x, int32_t *y,
                       int32_t *pred, double *mean_loss);
bool train_has_checkpoint(const char *project_dir);
int train_init_from(trainer *t);
int train_resume(trainer *t);
int train_save(trainer *t, int64_t step, bool last);
void train_report_time(const trainer *t, double run_seconds, bool quiet);

#endif
