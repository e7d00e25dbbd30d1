/* cli_train.c — `ckpt train`: a real training run that survives kill -9.
 *
 * An MLP (64-256-256-10, ReLU, dropout 0.1) learns handwritten digits with
 * AdamW, warmup + cosine learning rate, dynamic loss scaling and a shuffled
 * prefetching data loader. Every object whose state matters is handed to the
 * accelerator, which saves it every --save-every steps; --resume continues
 * from the newest complete checkpoint, bit for bit as if never stopped.
 */
#include <errno.h>
#include <getopt.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#include "cli.h"
#include "digits.h"
#include "mlp.h"

#define HIDDEN 256
#define DROPOUT 0.1f
/* every TEST_EVERY-th row (offset TEST_EVERY-1) is held out: a fixed split
 * that samples all the data set's writers, unlike its last rows alone */
#define TEST_EVERY 6

static const char train_help[] =
    "usage: ckpt train [options]\n"
    "\n"
    "Trains an MLP (64-256-256-10) on the handwritten digits data set with AdamW,\n"
    "warmup + cosine learning rate, loss scaling and a shuffled prefetching loader,\n"
    "saving a checkpoint every --save-every steps and at the end. SIGTERM, SIGUSR1\n"
    "(what schedulers such as Slurm send before a kill) and SIGINT save a checkpoint\n"
    "at the current step, even mid-epoch, and exit 0. --resume continues from the\n"
    "newest complete checkpoint, exactly as if the run had never stopped.\n"
    "\n"
    "options:\n"
    "  --epochs N         epochs to train (default 10)\n"
    "  --batch-size N     samples a step (default 32)\n"
    "  --lr X             peak learning rate (default 0.002)\n"
    "  --seed N           seed of weights, data order and dropout (default 1)\n"
    "  --save-every N     steps between checkpoints (default 50; 0 = only at the end)\n"
    "  --save-every-seconds S\n"
    "                     also save once S seconds passed since the last save\n"
    "                     (default 0 = off)\n"
    "  --collective-timeout S\n"
    "                     under mpirun: a save or load gives up with CKPT_ETIMEDOUT\n"
    "                     after waiting S seconds for another rank (default 600;\n"
    "                     0 = wait forever)\n"
    "  --total-limit N    keep the newest N valid checkpoints (default 3; 0 = all)\n"
    "  --keep-every N     also keep every checkpoint whose step is a multiple of N\n"
    "  --keep-best METRIC:min|max:K\n"
    "                     also keep the K best checkpoints by test_loss or test_acc\n"
    "                     (recorded with every checkpoint; ckpt ls shows them)\n"
    "  --max-shard-size SIZE\n"
    "                     save the model as Hugging Face shards of at most SIZE\n"
    "                     (e.g. 100KB) plus model.safetensors.index.json\n"
    "  --workers N        data loader prefetch threads (default 2)\n"
    "  --project-dir DIR  checkpoints in DIR/checkpoints, metrics in DIR/logs\n"
    "                     (default runs/digits)\n"
    "  --data FILE        the data set (default: the project's data/digits.csv.gz,\n"
    "                     or $CKPT_DATA)\n"
    "  --resume           continue from the newest complete checkpoint in DIR\n"
    "  --drop-data-position\n"
    "                     with --resume, when the global batch (--batch-size x\n"
    "                     processes) differs from the checkpoint's: keep the step,\n"
    "                     model, optimizer, schedule, scaler and generator, and start\n"
    "                     the data loader at the next epoch's first batch (the rest\n"
    "                     of the saved epoch is skipped) instead of refusing\n"
    "  --init-from CKPT   start from the model weights of checkpoint folder CKPT (of\n"
    "                     another run; a project folder: its newest valid\n"
    "                     checkpoint) with a fresh optimizer, schedule and data\n"
    "                     order, at step 0: fine-tuning (not with --resume)\n"
    "  --async            save in the background: the loop stalls only for the copy of\n"
    "                     the state (ckpt_save_state_async); the last save is waited for\n"
    "  --freeze PATTERN   freeze the parameters whose names match the glob PATTERN\n"
    "                     (e.g. 'fc1.*'; repeatable): the optimizer leaves them alone\n"
    "                     and checkpoints keep them in a file of their own that\n"
    "                     every later save links instead of writing again\n"
    "  --shard-optimizer  ZeRO-1: each process keeps the AdamW moments of its share\n"
    "                     of the parameters (saved as sharded tensors)\n"
    "  --log-every N      steps between progress lines (default 50); on a terminal a\n"
    "                     progress bar is redrawn instead, unless --log-every is given\n"
    "                     or the run is part of an MPI job\n"
    "  --quiet            print only the result\n"
    "  -h, --help         this help\n"
    "\n"
    "Under mpirun -np N (a build with MPI) N processes train data parallel: each\n"
    "takes --batch-size samples of every global batch, gradients are averaged in rank\n"
    "order (reproducible), and saves and loads are collective (docs/DISTRIBUTED.md).\n"
    "\n"
    "The learning rate and seed of a resumed run must be those of the run that saved\n"
    "the checkpoint, and so must the global batch unless --drop-data-position is\n"
    "given. --epochs may change: a run resumed with more epochs continues to the new\n"
    "end, on the new run's learning-rate schedule (warmup, then cosine decay to 0 at\n"
    "the new last step) taken up at the saved step. Metrics: DIR/logs/metrics.jsonl,\n"
    "one line a step (step, epoch, loss, lr, scale).\n";

typedef struct train_opts {
    int64_t epochs, batch_size, seed, save_every, total_limit, workers, log_every;
    double lr, save_every_seconds;
    double collective_timeout; /* seconds; 0: none (the config's negative) */
    int64_t keep_every, best_k; /* retention beyond --total-limit */
    char best_metric[64];
    ckpt_best_mode best_mode;
    const char *project_dir;
    const char *data;
    const char *init_from; /* a checkpoint folder: its model only */
    const char *freeze[16]; /* --freeze patterns */
    int nfreeze;
    uint64_t max_shard_size;
    bool resume, quiet, shard_optimizer, async;
    bool drop_data_position; /* resume with another global batch (see the help) */
    bool log_every_given;    /* --log-every: lines, never a redrawn bar */
} train_opts;

/* ---- the run's settings, saved with every checkpoint -------------------- */

/* Saved as a custom object so that a resume with different settings is
 * refused instead of silently continuing a different run. */
typedef struct run_config {
    int64_t epochs, batch_size, seed, train_rows, hidden;
    double lr;
} run_config;

static int run_config_state_dict(void *self, ckpt_writer *w) {
    const run_config *c = self;
    int rc;
    if ((rc = ckpt_write_i64(w, "epochs", c->epochs)) < 0) return rc;
    if ((rc = ckpt_write_i64(w, "batch_size", c->batch_size)) < 0) return rc;
    if ((rc = ckpt_write_i64(w, "seed", c->seed)) < 0) return rc;
    if ((rc = ckpt_write_i64(w, "train_rows", c->train_rows)) < 0) return rc;
    if ((rc = ckpt_write_i64(w, "hidden", c->hidden)) < 0) return rc;
    return ckpt_write_f64(w, "lr", c->lr);
}

static int run_config_load_state_dict(void *self, ckpt_reader *r) {
    run_config c;
    int rc;
    if ((rc = ckpt_read_i64(r, "epochs", &c.epochs)) < 0) return rc;
    if ((rc = ckpt_read_i64(r, "batch_size", &c.batch_size)) < 0) return rc;
    if ((rc = ckpt_read_i64(r, "seed", &c.seed)) < 0) return rc;
    if ((rc = ckpt_read_i64(r, "train_rows", &c.train_rows)) < 0) return rc;
    if ((rc = ckpt_read_i64(r, "hidden", &c.hidden)) < 0) return rc;
    if ((rc = ckpt_read_f64(r, "lr", &c.lr)) < 0) return rc;
    *(run_config *)self = c;
    return CKPT_OK;
}

static const ckpt_stateful_ops run_config_ops = {
    .state_dict = run_config_state_dict,
    .load_state_dict = run_config_load_state_dict,
};

/* saved_procs/now_procs: the process counts of the saving and this run; the
 * global batch (--batch-size x processes) is what must stay the same, unless
 * drop_position (--drop-data-position): then *drop says whether the loader's
 * position must go. --epochs may differ (the run gets longer or shorter). */
static bool run_config_check(const run_config *saved, const run_config *now, int saved_procs,
                             int now_procs, bool drop_position, bool *drop) {
    bool ok = true;
    int64_t sg = saved->batch_size * saved_procs, ng = now->batch_size * now_procs;
    *drop = false;
    if (sg != ng && drop_position) {
        *drop = true;
    } else if (sg != ng) {
        char hint[160];
        if (sg % now_procs == 0)
            snprintf(hint, sizeof hint, "--batch-size %lld keeps it on %d process%s",
                     (long long)(sg / now_procs), now_procs, now_procs == 1 ? "" : "es");
        else snprintf(hint, sizeof hint, "no --batch-size on %d processes keeps it", now_procs);
        cli_error("resume: the checkpoint was trained with a global batch of %lld (%d x "
                  "--batch-size %lld), this run has %lld (%d x --batch-size %lld): %s, or "
                  "--drop-data-position continues at the saved step from the next epoch's start",
                  (long long)sg, saved_procs, (long long)saved->batch_size, (long long)ng,
                  now_procs, (long long)now->batch_size, hint);
        ok = false;
    }
#define CHECK_I64(field, opt)                                                                      \
    if (saved->field != now->field) {                                                              \
        cli_error("resume: the checkpoint was trained with " opt " %lld, this run has %lld",       \
                  (long long)saved->field, (long long)now->field);                                 \
        ok = false;                                                                                \
    }
    CHECK_I64(seed, "--seed")
    CHECK_I64(train_rows, "a training set of rows")
    CHECK_I64(hidden, "hidden width")
#undef CHECK_I64
    if (saved->lr != now->lr) {
        char a[40], b[40];
        cli_error("resume: the checkpoint was trained with --lr %s, this run has %s",
                  cli_format_double(saved->lr, a, sizeof a),
                  cli_format_double(now->lr, b, sizeof b));
        ok = false;
    }
    return ok;
}

/* ---- the recent losses ------------------------------------------------- */

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

/* Records step's loss; steps come in order, a gap drops what came before. */
static void loss_history_put(loss_history *h, int64_t step, float loss) {
    if (step < 1) return;
    if (step != h->steps + 1 || h->known_from < 1) h->known_from = step;
    h->loss[(step - 1) % LOSS_RING] = loss;
    h->steps = step;
    if (h->steps - h->known_from + 1 > LOSS_RING) h->known_from = h->steps - LOSS_RING + 1;
}

/* The mean of the losses of the last n steps (as many of them as are held),
 * summed oldest first. */
static double loss_history_mean(const loss_history *h, int64_t n) {
    if (h->known_from < 1) return 0.0;
    if (n > h->steps - h->known_from + 1) n = h->steps - h->known_from + 1;
    if (n <= 0) return 0.0;
    double sum = 0.0;
    for (int64_t s = h->steps - n + 1; s <= h->steps; s++) sum += h->loss[(s - 1) % LOSS_RING];
    return sum / (double)n;
}

/* ---- small helpers ------------------------------------------------------ */

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* mkdir -p */
static int make_dirs(const char *path) {
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof buf, "%s", path) >= (int)sizeof buf) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1;; p++) {
        if (*p == '/' || *p == '\0') {
            char c = *p;
            *p = '\0';
            if (mkdir(buf, 0777) != 0 && errno != EEXIST) return -1;
            *p = c;
            if (c == '\0') break;
        }
    }
    return 0;
}

static bool readable(const char *path) { return access(path, R_OK) == 0; }

/* The data set: --data, $CKPT_DATA, beside the executable (build tree or
 * installed share folder), or the source tree it was built from. */
static const char *find_data(char *buf, size_t cap) {
    const char *env = getenv("CKPT_DATA");
    if (env && *env) return env;
    char exe[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", exe, sizeof exe - 1);
    if (n > 0) {
        exe[n] = '\0';
        char *slash = strrchr(exe, '/');
        if (slash) *slash = '\0';
        static const char *const rel[] = {"/../data/digits.csv.gz", "/../share/ckpt/digits.csv.gz",
                                          "/data/digits.csv.gz"};
        for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
            if (snprintf(buf, cap, "%s%s", exe, rel[i]) < (int)cap && readable(buf)) return buf;
        }
    }
#ifdef CKPT_SOURCE_DIR
    if (snprintf(buf, cap, "%s/data/digits.csv.gz", CKPT_SOURCE_DIR) < (int)cap && readable(buf))
        return buf;
#endif
    return NULL;
}

/* Opens the metrics log for appending. On resume it first drops every line
 * past the resumed step (and a torn last line), so the log reads as if the
 * run had never stopped; a fresh run starts it empty. */
static FILE *metrics_open(const char *path, bool resume, int64_t keep_upto, loss_history *losses) {
    if (!resume) return cli_fopen_regular(path, 'w');
    /* the log is ckpt's own: a symlink there is refused, not read through */
    struct stat ls;
    if (lstat(path, &ls) == 0 && S_ISLNK(ls.st_mode)) {
        errno = ELOOP;
        return NULL;
    }
    FILE *in = cli_fopen_regular(path, 'r');
    if (!in) return errno == ENOENT ? cli_fopen_regular(path, 'w') : NULL;
    char tmp[PATH_MAX];
    if (snprintf(tmp, sizeof tmp, "%s.tmp", path) >= (int)sizeof tmp) {
        fclose(in);
        errno = ENAMETOOLONG;
        return NULL;
    }
    (void)unlink(tmp); /* a kill's leftover; never followed */
    FILE *out = cli_fopen_regular(tmp, 'x');
    if (!out) {
        fclose(in);
        return NULL;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    while ((len = getline(&line, &cap, in)) > 0) {
        long long step;
        if (line[len - 1] != '\n') break; /* torn by a kill mid-write */
        if (sscanf(line, "{\"step\":%lld", &step) != 1 || step > keep_upto) break;
        fputs(line, out);
        const char *lp = strstr(line, "\"loss\":");
        float loss;
        if (lp && sscanf(lp, "\"loss\":%f", &loss) == 1) loss_history_put(losses, step, loss);
    }
    free(line);
    fclose(in);
    if (fclose(out) != 0 || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        errno = e;
        return NULL;
    }
    return cli_fopen_regular(path, 'a');
}

static void format_duration(double s, char *buf, size_t cap) {
    if (s < 0 || s > 1e7) s = 0;
    long t = (long)(s + 0.5);
    if (t >= 3600) snprintf(buf, cap, "%ld:%02ld:%02ld", t / 3600, t / 60 % 60, t % 60);
    else snprintf(buf, cap, "%ld:%02ld", t / 60, t % 60);
}

/* Accuracy on held-out rows, in chunks of the network's batch size; no
 * dropout, no random draws. */
/* Correct predictions on rows; *mean_loss (may be NULL) gets the mean
 * cross-entropy. Touches no generator: a run's numbers do not depend on
 * whether or how often it evaluates. */
static int64_t evaluate(mlp *net, const digits_sample *rows, int64_t n, float *x, int32_t *y,
                        int32_t *pred, double *mean_loss) {
    int64_t correct = 0;
    double loss_sum = 0.0;
    for (int64_t i = 0; i < n; i += net->max_batch) {
        int B = (int)((n - i) < net->max_batch ? (n - i) : net->max_batch);
        for (int k = 0; k < B; k++) {
            memcpy(x + (size_t)k * DIGITS_PIXELS, rows[i + k].x, sizeof rows[i + k].x);
            y[k] = rows[i + k].label;
        }
        loss_sum += (double)mlp_forward(net, x, y, B, 0.0f, NULL) * B;
        mlp_argmax(net, pred);
        for (int k = 0; k < B; k++) correct += pred[k] == y[k];
    }
    if (mean_loss) *mean_loss = n > 0 ? loss_sum / (double)n : 0.0;
    return correct;
}

static int parse_train_opts(int argc, char **argv, train_opts *o) {
    enum {
        O_EPOCHS = 256,
        O_BATCH,
        O_LR,
        O_SEED,
        O_SAVE_EVERY,
        O_TOTAL_LIMIT,
        O_WORKERS,
        O_PROJECT,
        O_DATA,
        O_RESUME,
        O_LOG_EVERY,
        O_QUIET,
        O_SHARD_OPTIM,
        O_ASYNC,
        O_SAVE_SECONDS,
        O_KEEP_EVERY,
        O_KEEP_BEST,
        O_INIT_FROM,
        O_MAX_SHARD,
        O_DROP_POSITION,
        O_COLL_TIMEOUT,
        O_FREEZE
    };
    static const struct option longopts[] = {
        {"epochs", required_argument, NULL, O_EPOCHS},
        {"batch-size", required_argument, NULL, O_BATCH},
        {"lr", required_argument, NULL, O_LR},
        {"seed", required_argument, NULL, O_SEED},
        {"save-every", required_argument, NULL, O_SAVE_EVERY},
        {"save-every-seconds", required_argument, NULL, O_SAVE_SECONDS},
        {"collective-timeout", required_argument, NULL, O_COLL_TIMEOUT},
        {"keep-every", required_argument, NULL, O_KEEP_EVERY},
        {"keep-best", required_argument, NULL, O_KEEP_BEST},
        {"total-limit", required_argument, NULL, O_TOTAL_LIMIT},
        {"workers", required_argument, NULL, O_WORKERS},
        {"project-dir", required_argument, NULL, O_PROJECT},
        {"data", required_argument, NULL, O_DATA},
        {"resume", no_argument, NULL, O_RESUME},
        {"init-from", required_argument, NULL, O_INIT_FROM},
        {"freeze", required_argument, NULL, O_FREEZE},
        {"max-shard-size", required_argument, NULL, O_MAX_SHARD},
        {"drop-data-position", no_argument, NULL, O_DROP_POSITION},
        {"log-every", required_argument, NULL, O_LOG_EVERY},
        {"quiet", no_argument, NULL, O_QUIET},
        {"shard-optimizer", no_argument, NULL, O_SHARD_OPTIM},
        {"async", no_argument, NULL, O_ASYNC},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    *o = (train_opts){.epochs = 10, .batch_size = 32, .seed = 1, .save_every = 50,
                      .total_limit = 3, .workers = 2, .log_every = 50, .lr = 2e-3,
                      .collective_timeout = CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S,
                      .project_dir = "runs/digits"};
    opterr = 0;
    optind = 0;
    int c, li = -1;
    while ((c = getopt_long(argc, argv, ":h", longopts, &li)) != -1) {
        const char *a = optarg;
        bool ok = true;
        switch (c) {
        case O_EPOCHS: ok = cli_parse_i64(a, 1, 1000000, &o->epochs); break;
        case O_BATCH: ok = cli_parse_i64(a, 1, 65536, &o->batch_size); break;
        case O_LR: ok = cli_parse_double(a, &o->lr) && o->lr > 0; break;
        case O_SEED: ok = cli_parse_i64(a, 0, INT64_MAX, &o->seed); break;
        case O_SAVE_EVERY: ok = cli_parse_i64(a, 0, INT64_MAX, &o->save_every); break;
        case O_SAVE_SECONDS:
            ok = cli_parse_double(a, &o->save_every_seconds) && o->save_every_seconds >= 0 &&
                 o->save_every_seconds <= 1e9;
            break;
        case O_COLL_TIMEOUT:
            ok = cli_parse_double(a, &o->collective_timeout) && o->collective_timeout >= 0 &&
                 o->collective_timeout <= 1e9;
            break;
        case O_TOTAL_LIMIT: ok = cli_parse_i64(a, 0, INT32_MAX, &o->total_limit); break;
        case O_WORKERS: ok = cli_parse_i64(a, 0, 64, &o->workers); break;
        case O_PROJECT: o->project_dir = a; break;
        case O_DATA: o->data = a; break;
        case O_RESUME: o->resume = true; break;
        case O_INIT_FROM: o->init_from = a; ok = *a != '\0'; break;
        case O_FREEZE:
            if (o->nfreeze == (int)(sizeof o->freeze / sizeof o->freeze[0]))
                return cli_usage_error("train", "--freeze: at most %d patterns",
                                       (int)(sizeof o->freeze / sizeof o->freeze[0]));
            o->freeze[o->nfreeze++] = a;
            ok = *a != '\0';
            break;
        case O_MAX_SHARD: ok = cli_parse_size(a, &o->max_shard_size); break;
        case O_DROP_POSITION: o->drop_data_position = true; break;
        case O_LOG_EVERY:
            ok = cli_parse_i64(a, 1, INT64_MAX, &o->log_every);
            o->log_every_given = true;
            break;
        case O_QUIET: o->quiet = true; break;
        case O_SHARD_OPTIM: o->shard_optimizer = true; break;
        case O_ASYNC: o->async = true; break;
        case O_KEEP_EVERY: ok = cli_parse_i64(a, 1, INT64_MAX, &o->keep_every); break;
        case O_KEEP_BEST:
            if (!cli_parse_keep_best(a, o->best_metric, sizeof o->best_metric, &o->best_mode,
                                     &o->best_k))
                return cli_usage_error("train",
                                       "bad value for '--keep-best': '%s', expected "
                                       "METRIC:min:K or METRIC:max:K (e.g. test_loss:min:3)",
                                       a);
            if (strcmp(o->best_metric, "test_loss") != 0 && strcmp(o->best_metric, "test_acc") != 0)
                return cli_usage_error("train", "--keep-best: metric '%s' is not recorded; train "
                                                "records test_loss and test_acc",
                                       o->best_metric);
            break;
        case 'h': fputs(train_help, stdout); return -1;
        case ':': return cli_usage_error("train", "option '%s' needs a value", argv[optind - 1]);
        default: return cli_usage_error("train", "unknown option '%s'", argv[optind - 1]);
        }
        if (!ok)
            return cli_usage_error("train", "bad value for '--%s': '%s'", longopts[li].name, a);
    }
    if (optind < argc) return cli_usage_error("train", "unexpected argument '%s'", argv[optind]);
    if (!*o->project_dir) return cli_usage_error("train", "--project-dir is empty");
    if (o->drop_data_position && !o->resume)
        return cli_usage_error("train", "--drop-data-position applies to a --resume only");
    if (o->init_from && o->resume)
        return cli_usage_error("train", "--init-from and --resume exclude each other: --resume "
                                        "continues this project's run, --init-from starts a new "
                                        "one from another run's weights");
    return 0;
}

/* ---- the run ------------------------------------------------------------ */

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
    bool speak;       /* this process prints and writes metrics (rank 0) */
    float *exchange;  /* every gradient, then the loss and the stop flag */
    float *scratch;   /* every rank's exchange */
    size_t nexchange;
    double ckpt_seconds; /* spent inside checkpoint calls by the loop */
    int64_t nsaves;
    /* bytes written and linked by the synchronous saves: the first, the rest */
    uint64_t first_written, later_written, later_linked;
    int64_t nlater;
    char resumed_from[4096]; /* the checkpoint --resume loaded */
} trainer;

static void trainer_free(trainer *t) {
    ckpt_accelerator_free(t->acc);
    ckpt_dataloader_free(t->loader);
    ckpt_grad_scaler_free(t->scaler);
    ckpt_scheduler_free(t->sched);
    ckpt_optimizer_free(t->optim);
    ckpt_model_free(t->model);
    mlp_free(&t->net);
    free(t->x);
    free(t->y);
    free(t->pred);
    free(t->rows);
    free(t->train_rows);
    free(t->exchange);
    free(t->scratch);
    if (t->metrics) fclose(t->metrics);
}

/* Reports a failed library call and returns CLI_RUNTIME. */
static int lib_fail(const char *what, int rc) {
    const char *msg = ckpt_errmsg();
    cli_error("%s: %s", what, *msg ? msg : ckpt_strerror(rc));
    return CLI_RUNTIME;
}

static int trainer_setup(trainer *t) {
    const train_opts *o = &t->opt;
    char pathbuf[PATH_MAX], err[512];
    const char *data = o->data ? o->data : find_data(pathbuf, sizeof pathbuf);
    if (!data) {
        cli_error("cannot find the data set digits.csv.gz: pass --data FILE or set CKPT_DATA");
        return CLI_RUNTIME;
    }
    int64_t nrows;
    if (digits_load(data, &t->rows, &nrows, err, sizeof err) != 0) {
        cli_error("data: %s", err);
        return CLI_RUNTIME;
    }
    /* the split: rows TEST_EVERY-1, 2*TEST_EVERY-1, ... are the test set */
    t->train_rows = malloc((size_t)nrows * sizeof *t->train_rows);
    if (!t->train_rows) {
        cli_error("out of memory");
        return CLI_RUNTIME;
    }
    t->ntest = nrows / TEST_EVERY;
    t->ntrain = nrows - t->ntest;
    t->test_rows = t->train_rows + t->ntrain;
    for (int64_t i = 0, a = 0, b = 0; i < nrows; i++) {
        if (i % TEST_EVERY == TEST_EVERY - 1) t->test_rows[b++] = t->rows[i];
        else t->train_rows[a++] = t->rows[i];
    }
    if (t->ntrain < o->batch_size) {
        cli_error("data: %lld training rows, fewer than --batch-size %lld", (long long)t->ntrain,
                  (long long)o->batch_size);
        return CLI_RUNTIME;
    }

    int B = (int)o->batch_size;
    if (mlp_init(&t->net, DIGITS_PIXELS, HIDDEN, HIDDEN, DIGITS_CLASSES, B) != 0) {
        cli_error("out of memory");
        return CLI_RUNTIME;
    }
    t->x = malloc((size_t)B * DIGITS_PIXELS * sizeof *t->x);
    t->y = malloc((size_t)B * sizeof *t->y);
    t->pred = malloc((size_t)B * sizeof *t->pred);
    if (!t->x || !t->y || !t->pred) {
        cli_error("out of memory");
        return CLI_RUNTIME;
    }

    int rc;
    /* the model: the network's tensors under PyTorch's nn.Linear names */
    if ((rc = ckpt_model_new(&t->model)) < 0) return lib_fail("model", rc);
    int group_of[2 * MLP_LAYERS];
    for (int i = 0; i < 2 * MLP_LAYERS; i++) {
        int64_t shape[2];
        int nd = mlp_param_shape(&t->net, i, shape);
        rc = ckpt_model_add_param(t->model, mlp_param_name(i), CKPT_F32, nd, shape,
                                  mlp_param_data(&t->net, i), mlp_param_grad(&t->net, i));
        if (rc < 0) return lib_fail("model", rc);
        group_of[i] = nd == 2 ? 0 : 1; /* weights decay, biases do not */
    }
    /* --freeze: out of the optimizer's groups, and in a file of their own */
    for (int k = 0; k < o->nfreeze; k++) {
        rc = ckpt_model_set_frozen(t->model, o->freeze[k], true);
        if (rc == CKPT_ENOENT) {
            cli_error("--freeze '%s': no parameter name matches; the model's are fc1.weight, "
                      "fc1.bias, ..., fc%d.bias",
                      cli_esc(o->freeze[k]), MLP_LAYERS);
            return CLI_USAGE;
        }
        if (rc < 0) return lib_fail("--freeze", rc);
    }
    bool used[2] = {false, false};
    for (int i = 0; i < 2 * MLP_LAYERS; i++) {
        ckpt_param_info pi;
        if ((rc = ckpt_model_param(t->model, i, &pi)) < 0) return lib_fail("model", rc);
        if (pi.frozen) group_of[i] = -1;
        else used[group_of[i]] = true;
    }
    if (!used[0] && !used[1]) {
        cli_error("--freeze: every parameter is frozen; nothing would be trained");
        return CLI_USAGE;
    }

    /* AdamW; weight decay on weights only, as is usual */
    if ((rc = ckpt_adamw_new(&t->optim, t->model, o->lr, 0.9, 0.999, 1e-8, 0.01)) < 0)
        return lib_fail("optimizer", rc);
    ckpt_optim_options groups[2];
    groups[0] = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    groups[0].lr = o->lr;
    groups[0].weight_decay = 0.01;
    groups[1] = groups[0];
    groups[1].weight_decay = 0.0;
    int ngroups = 2;
    if (!used[0] || !used[1]) { /* --freeze emptied one group: the other is group 0 */
        for (int i = 0; i < 2 * MLP_LAYERS; i++)
            if (group_of[i] >= 0) group_of[i] = 0;
        if (!used[0]) groups[0] = groups[1];
        ngroups = 1;
    }
    if ((rc = ckpt_optimizer_set_groups(t->optim, ngroups, group_of, groups)) < 0)
        return lib_fail("optimizer", rc);

    /* the data loader: shuffled every epoch, prefetched by worker threads */
    if ((rc = ckpt_memory_dataset(&t->dataset, t->train_rows, t->ntrain, sizeof(digits_sample))) <
        0)
        return lib_fail("dataset", rc);
    ckpt_dataloader_config dc = ckpt_dataloader_defaults();
    dc.batch_size = o->batch_size;
    dc.shuffle = true;
    dc.seed = (uint64_t)o->seed;
    dc.drop_last = true;
    dc.num_workers = (int)o->workers;
    if ((rc = ckpt_dataloader_new(&t->loader, &t->dataset, &dc)) < 0)
        return lib_fail("data loader", rc);

    /* the accelerator first: preparing the loader shards it over the
     * processes, which sets the number of steps an epoch */
    ckpt_project_config pc = {
        .project_dir = o->project_dir,
        .automatic_checkpoint_naming = true,
        .total_limit = (int)o->total_limit,
        .comm = t->dist.comm,
        .save_interval_steps = o->save_every,
        .keep_every_steps = o->keep_every,
        .max_shard_size = o->max_shard_size,
        .best_metric = o->best_k ? o->best_metric : NULL,
        .best_mode = o->best_mode,
        .best_k = (int)o->best_k,
        .save_interval_seconds = o->save_every_seconds,
        .collective_timeout_s = o->collective_timeout > 0 ? o->collective_timeout : -1.0,
    };
    if ((rc = ckpt_accelerator_new(&t->acc, &pc)) < 0) return lib_fail("accelerator", rc);
    ckpt_accelerator_set_log(t->acc, cli_library_log, NULL); /* escaped, as every output */
    if (o->shard_optimizer && (rc = ckpt_optimizer_set_shard(
                                   t->optim, t->dist.comm ? t->dist.comm : ckpt_comm_self())) < 0)
        return lib_fail("--shard-optimizer", rc);
    if ((rc = ckpt_prepare_dataloader(t->acc, t->loader)) < 0) return lib_fail("prepare", rc);
    int64_t per_epoch = ckpt_dataloader_num_batches(t->loader);
    if (per_epoch <= 0) {
        cli_error("data loader: no batches in an epoch");
        return CLI_RUNTIME;
    }
    int64_t total = per_epoch * o->epochs;

    if ((rc = ckpt_warmup_cosine_new(&t->sched, t->optim, total / 20, total)) < 0)
        return lib_fail("scheduler", rc);
    /* a small growth interval so the scale actually moves during the demo */
    if ((rc = ckpt_grad_scaler_new(&t->scaler, 1024.0, 2.0, 0.5, 100)) < 0)
        return lib_fail("grad scaler", rc);

    if ((rc = ckpt_prepare_model(t->acc, t->model)) < 0 ||
        (rc = ckpt_prepare_optimizer(t->acc, t->optim)) < 0 ||
        (rc = ckpt_prepare_scheduler(t->acc, t->sched)) < 0 ||
        (rc = ckpt_prepare_scaler(t->acc, t->scaler)) < 0)
        return lib_fail("prepare", rc);
    t->config = (run_config){.epochs = o->epochs, .batch_size = o->batch_size, .seed = o->seed,
                             .train_rows = t->ntrain, .hidden = HIDDEN, .lr = o->lr};
    t->saved_config = t->config;
    if ((rc = ckpt_register_for_checkpointing(t->acc, &run_config_ops, &t->saved_config)) < 0)
        return lib_fail("register", rc);
    /* the staging area ready before the first save, so it stalls like the others */
    if (o->async && (rc = ckpt_accelerator_prepare_async(t->acc)) < 0)
        return lib_fail("prepare_async", rc);

    /* weights come from the seeded default generator; dropout draws from it
     * too, so its saved state carries the rest of the run's randomness */
    if ((rc = ckpt_set_seed(t->acc, (uint64_t)o->seed)) < 0) return lib_fail("seed", rc);
    if (t->dist.rank == 0) {
        mlp_init_params(&t->net, ckpt_accelerator_rng(t->acc));
    } else {
        /* every rank starts from rank 0's weights: the same draws, from
         * rank 0's stream, without touching this rank's own generator */
        ckpt_rng g;
        ckpt_rng_seed_stream(&g, (uint64_t)o->seed, 0);
        mlp_init_params(&t->net, &g);
    }

    if (t->dist.size > 1) {
        size_t n = 2; /* the loss and the stop flag */
        for (int i = 0; i < 2 * MLP_LAYERS; i++) {
            int64_t shape[2] = {1, 1};
            int nd = mlp_param_shape(&t->net, i, shape);
            n += (size_t)(nd == 2 ? shape[0] * shape[1] : shape[0]);
        }
        t->nexchange = n;
        t->exchange = malloc(n * sizeof *t->exchange);
        t->scratch = malloc((size_t)t->dist.size * n * sizeof *t->scratch);
        if (!t->exchange || !t->scratch) {
            cli_error("out of memory");
            return CLI_RUNTIME;
        }
    }
    return CLI_OK;
}

static size_t param_count(const mlp *net, int i) {
    int64_t shape[2] = {1, 1};
    int nd = mlp_param_shape(net, i, shape);
    return (size_t)(nd == 2 ? shape[0] * shape[1] : shape[0]);
}

/* Data parallel: every rank's gradients and loss become their mean over the
 * ranks (each rank's loss is the mean over its equal share of the global
 * batch, so this is the gradient of the global batch's mean loss), and
 * *stop says whether any rank was asked to stop. */
static int exchange(trainer *t, float *loss, bool *stop) {
    size_t k = 0;
    for (int i = 0; i < 2 * MLP_LAYERS; i++) {
        size_t n = param_count(&t->net, i);
        memcpy(t->exchange + k, mlp_param_grad(&t->net, i), n * sizeof(float));
        k += n;
    }
    t->exchange[k] = *loss;
    t->exchange[k + 1] = ckpt_preemption_requested() ? 1.0f : 0.0f;
    int rc = cli_dist_average(&t->dist, t->exchange, t->nexchange, t->scratch);
    if (rc < 0) return rc;
    k = 0;
    for (int i = 0; i < 2 * MLP_LAYERS; i++) {
        size_t n = param_count(&t->net, i);
        memcpy(mlp_param_grad(&t->net, i), t->exchange + k, n * sizeof(float));
        k += n;
    }
    *loss = t->exchange[k];
    *stop = t->exchange[k + 1] > 0.0f;
    return CKPT_OK;
}

/* Whether the project has a complete checkpoint to resume from. */
static bool has_checkpoint(const char *project_dir) {
    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    if (ckpt_checkpoint_list(project_dir, false, &list, &n) < 0) return false;
    bool any = false;
    for (int64_t i = 0; i < n; i++) any = any || list[i].status == CKPT_CHECKPOINT_COMPLETE;
    free(list);
    return any;
}

/* --init-from: the model of another run's checkpoint, nothing else (the
 * optimizer, schedule, loader, scaler and generators stay fresh; the step
 * and this project's numbering start at 0). */
static int init_from(trainer *t) {
    const char *dir = t->opt.init_from;
    /* a project folder stands for its newest valid checkpoint */
    char newest[4096];
    if (cli_classify(dir) == CLI_KIND_PROJECT) {
        int st = cli_newest_valid("--init-from", dir, newest, sizeof newest);
        if (st != CLI_OK) return st;
        dir = newest;
    }
    ckpt_load_options lo = {.objects = CKPT_LOAD_MODELS};
    ckpt_load_report rep;
    int rc = ckpt_load_state_ex(t->acc, dir, &lo, &rep);
    if (rc == CKPT_ENOENT) {
        cli_error("--init-from %s: not a checkpoint folder nor a project (%s); pass one such "
                  "as RUN/checkpoints/checkpoint_N, or RUN for its newest valid checkpoint",
                  dir, ckpt_errmsg());
        return CLI_USAGE;
    }
    if (rc < 0) return lib_fail("init-from", rc);
    if (!t->opt.quiet && t->speak)
        printf("initialised the model from %s (its step %lld); optimizer, schedule and data "
               "order start fresh at step 0\n",
               cli_esc(rep.dir), (long long)rep.step);
    ckpt_load_report_free(&rep);
    return CLI_OK;
}

/* Sets the optimizer's learning rates to those of this run's schedule
 * (trainer_setup's: warmup total/20, cosine decay to 0 at total) after step
 * scheduler steps: a scratch scheduler built from the peak rate and
 * stepped there sets them exactly as the run's own would have. */
static int restart_schedule_at(trainer *t, int64_t step) {
    int64_t total = ckpt_dataloader_num_batches(t->loader) * t->opt.epochs;
    int rc = CKPT_OK;
    for (int g = 0; g < 2 && rc == CKPT_OK; g++) rc = ckpt_optimizer_set_lr(t->optim, g, t->opt.lr);
    ckpt_scheduler *s = NULL;
    if (rc == CKPT_OK) rc = ckpt_warmup_cosine_new(&s, t->optim, total / 20, total);
    for (int64_t i = 0; i < step && rc == CKPT_OK; i++) rc = ckpt_scheduler_step(s);
    ckpt_scheduler_free(s);
    return rc;
}

/* The saved data loader's epoch and batches yielded in it (its state dict,
 * docs/DATALOADER.md), read from checkpoint dir. */
static int saved_loader_position(const char *dir, int64_t *epoch, int64_t *pos) {
    ckpt_reader *r = NULL;
    int rc = ckpt_checkpoint_open_object(dir, "dataloader.safetensors", &r);
    if (rc == 0) rc = ckpt_read_i64(r, "epoch", epoch);
    if (rc == 0) rc = ckpt_read_i64(r, "batches_yielded", pos);
    ckpt_reader_free(r);
    return rc;
}

/* --resume: one load of everything, then the run's settings (a custom
 * object) are checked against this run's. A load the objects refuse
 * (CKPT_EMISMATCH: the data loader's position counts global batches, so
 * another global batch is refused there in the library's terms) changed
 * nothing; then the settings alone are loaded to say which option differs,
 * naming the flag, and with --drop-data-position and another global batch
 * everything but the data loader is loaded, which starts the epoch after
 * the saved one. */
static int resume(trainer *t) {
    const train_opts *o = &t->opt;
    int rc = ckpt_load_state(t->acc, NULL);
    int saved_procs = 1, now_procs = t->dist.size > 0 ? t->dist.size : 1;
    bool drop = false;
    int64_t epoch = 0, pos = 0;
    ckpt_checkpoint_info info;
    if (rc == CKPT_OK) {
        snprintf(t->resumed_from, sizeof t->resumed_from, "%s", ckpt_accelerator_last_dir(t->acc));
        memset(&info, 0, sizeof info);
        (void)ckpt_checkpoint_verify(t->resumed_from, false, &info);
        saved_procs = info.num_processes > 0 ? info.num_processes : 1;
        if (!run_config_check(&t->saved_config, &t->config, saved_procs, now_procs, false, &drop))
            return CLI_USAGE;
    } else if (rc == CKPT_EMISMATCH) {
        char why[2048];
        snprintf(why, sizeof why, "%s", ckpt_errmsg());
        static const char *const config_only[] = {"custom_checkpoint_0"};
        ckpt_load_options lo = {.names = config_only, .num_names = 1};
        ckpt_load_report rep;
        if (ckpt_load_state_ex(t->acc, NULL, &lo, &rep) < 0) {
            cli_error("resume: %s", why);
            return CLI_RUNTIME;
        }
        snprintf(t->resumed_from, sizeof t->resumed_from, "%s", rep.dir);
        ckpt_load_report_free(&rep);
        memset(&info, 0, sizeof info);
        (void)ckpt_checkpoint_verify(t->resumed_from, false, &info);
        saved_procs = info.num_processes > 0 ? info.num_processes : 1;
        if (!run_config_check(&t->saved_config, &t->config, saved_procs, now_procs,
                              o->drop_data_position, &drop))
            return CLI_USAGE;
        if (!drop) { /* the settings match: the refusal is about something else */
            cli_error("resume: %s", why);
            return CLI_RUNTIME;
        }
        if ((rc = saved_loader_position(t->resumed_from, &epoch, &pos)) < 0)
            return lib_fail("resume", rc);
        ckpt_load_options all_but_loader = {.objects = CKPT_LOAD_ALL & ~CKPT_LOAD_DATALOADERS};
        rc = ckpt_load_state_ex(t->acc, t->resumed_from, &all_but_loader, &rep);
        if (rc == 0) {
            /* a partial load leaves the step alone: it is the checkpoint's */
            ckpt_accelerator_set_step(t->acc, rep.step);
            ckpt_load_report_free(&rep);
            rc = ckpt_dataloader_set_epoch(t->loader, pos > 0 ? epoch + 1 : epoch);
        }
        if (rc < 0) return lib_fail("resume", rc);
    } else {
        return lib_fail("resume", rc);
    }
    int64_t per_epoch = ckpt_dataloader_num_batches(t->loader);
    if (!o->quiet && t->speak && drop)
        printf("the global batch changed from %lld to %lld (--drop-data-position): the data "
               "loader starts epoch %lld (the checkpoint was at batch %lld of epoch %lld); the "
               "step, model, optimizer, schedule, scaler and generator carry over\n",
               (long long)(t->saved_config.batch_size * saved_procs),
               (long long)(t->config.batch_size * now_procs),
               (long long)(pos > 0 ? epoch + 1 : epoch) + 1, (long long)pos, (long long)epoch + 1);
    if (!o->quiet && t->speak && t->saved_config.epochs != t->config.epochs)
        printf("--epochs %lld (the checkpoint's run had %lld): the run now ends at step %lld, "
               "on the learning-rate schedule of %lld steps (warmup %lld, then cosine decay to "
               "0), taken up at the saved step\n",
               (long long)t->config.epochs, (long long)t->saved_config.epochs,
               (long long)(per_epoch * t->config.epochs), (long long)(per_epoch * t->config.epochs),
               (long long)(per_epoch * t->config.epochs / 20));
    if (drop || t->saved_config.epochs != t->config.epochs) {
        /* The loaded learning rates are the old schedule's; the first step
         * after the resume uses the new one's, as the scheduler will set
         * it after every later step. */
        if ((rc = restart_schedule_at(t, ckpt_accelerator_step(t->acc))) < 0)
            return lib_fail("resume: schedule", rc);
    }
    /* the next saves record this run's settings */
    t->saved_config = t->config;
    return CLI_OK;
}

/* last: the run ends after it, so an asynchronous save is waited for. */
static int save(trainer *t, int64_t step, bool last) {
    /* collective over the ranks: each returns the same status and message */
    double t0 = now_seconds();
    /* the test set's loss and accuracy go with the checkpoint (ckpt ls shows
     * them; --keep-best ranks by them) */
    double test_loss = 0.0;
    int64_t correct = evaluate(&t->net, t->test_rows, t->ntest, t->x, t->y, t->pred, &test_loss);
    int rc = ckpt_set_metric(t->acc, "test_loss", test_loss);
    if (rc == 0)
        rc = ckpt_set_metric(t->acc, "test_acc",
                             t->ntest ? (double)correct / (double)t->ntest : 0.0);
    if (rc == 0)
        rc = t->opt.async ? ckpt_save_state_async(t->acc, NULL) : ckpt_save_state(t->acc, NULL);
    if (rc == 0 && t->opt.async && last) rc = ckpt_save_wait(t->acc);
    t->ckpt_seconds += now_seconds() - t0;
    t->nsaves++;
    if (rc == 0 && !t->opt.async) {
        uint64_t written = 0, linked = 0;
        ckpt_accelerator_last_save_bytes(t->acc, &written, &linked);
        if (t->nsaves == 1) {
            t->first_written = written;
        } else {
            t->later_written += written;
            t->later_linked += linked;
            t->nlater++;
        }
    }
    if (rc < 0) {
        const char *msg = ckpt_errmsg();
        if (t->tty) putchar('\n'); /* end the progress bar's line first */
        fflush(stdout);
        cli_error("save failed: %s (at step %lld)", *msg ? msg : ckpt_strerror(rc),
                  (long long)step);
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

/* Whether this process is one of a parallel job: a communicator of several,
 * or a launcher's environment (Open MPI gives every rank a pseudo-terminal,
 * so isatty says yes while the output goes to a shared log). */
static bool launched_by_mpi(const cli_dist *d) {
    return d->size > 1 || d->mpi || cli_dist_launched();
}

/* How long the loop waited for checkpoints, against the whole loop. */
static void report_ckpt_time(const trainer *t, double run_seconds, bool quiet) {
    if (quiet || t->nsaves == 0) return;
    double pct = run_seconds > 0 ? 100.0 * t->ckpt_seconds / run_seconds : 0.0;
    printf("checkpoint time: %.2f s in %lld save%s (%.1f%% of the run%s)\n", t->ckpt_seconds,
           (long long)t->nsaves, t->nsaves == 1 ? "" : "s", pct,
           t->opt.async ? ", asynchronous" : "");
    /* incremental saves: what a save after the first costs, when it links */
    if (t->nlater > 0 && t->later_linked > 0 && t->speak) {
        char first[32], later[32], linked[32];
        uint64_t avg = t->later_written / (uint64_t)t->nlater;
        printf("bytes written per save: %s the first, then %s on average (%.1f%%; %s of "
               "unchanged files linked each time)\n",
               cli_human_bytes(t->first_written, first, sizeof first),
               cli_human_bytes(avg, later, sizeof later),
               t->first_written ? 100.0 * (double)avg / (double)t->first_written : 0.0,
               cli_human_bytes(t->later_linked / (uint64_t)t->nlater, linked, sizeof linked));
    }
}

int cli_train(int argc, char **argv) {
    trainer t;
    memset(&t, 0, sizeof t);
    int rc = parse_train_opts(argc, argv, &t.opt);
    if (rc != 0) return rc < 0 ? CLI_OK : rc;
    const train_opts *o = &t.opt;

    /* a stop request only sets a flag: the loop finishes the step, saves and
     * exits, so a preemption never interrupts a save half-way */
    static const int preempt_signals[] = {SIGTERM, SIGUSR1, SIGINT};
    if ((rc = ckpt_preemption_install(preempt_signals, 3)) < 0) return lib_fail("signals", rc);

    int status = cli_dist_init(&t.dist);
    if (status != CLI_OK) goto done;
    t.speak = t.dist.rank == 0;
    status = trainer_setup(&t);
    if (status != CLI_OK) goto done;

    int64_t step = 0, saved_step = -1;
    int64_t per_epoch = ckpt_dataloader_num_batches(t.loader);
    int64_t total = per_epoch * o->epochs;
    bool resumed = false;
    /* the ranks agree on whether there is one to resume from */
    int64_t has = has_checkpoint(o->project_dir);
    if ((rc = cli_dist_max(&t.dist, &has, 1)) < 0) {
        status = lib_fail("MPI", rc);
        goto done;
    }
    if (o->resume) {
        if (has) {
            if ((status = resume(&t)) != CLI_OK) goto done;
            step = ckpt_accelerator_step(t.acc);
            saved_step = step;
            resumed = true;
            /* with many ranks each says where it resumed: they all agree */
            if (!o->quiet && t.dist.size > 1)
                printf("[rank %d] resumed from %s at step %lld\n", t.dist.rank,
                       cli_esc(t.resumed_from), (long long)step);
            else if (!o->quiet)
                printf("resumed from %s at step %lld\n", cli_esc(t.resumed_from), (long long)step);
        } else if (!o->quiet && t.speak) {
            printf("no checkpoint in %s yet: starting from step 0\n", cli_esc(o->project_dir));
        }
    } else if (has) {
        cli_error("%s already has checkpoints: pass --resume to continue that run, or choose "
                  "another --project-dir",
                  o->project_dir);
        status = CLI_USAGE;
        goto done;
    } else if (o->init_from && (status = init_from(&t)) != CLI_OK) {
        goto done;
    }

    char logdir[PATH_MAX], metrics_path[PATH_MAX + 16];
    /* the library's: <DIR>/logs, or for an s3:// project its local staging folder's */
    if (snprintf(logdir, sizeof logdir, "%s", ckpt_accelerator_logging_dir(t.acc)) >=
            (int)sizeof logdir ||
        !logdir[0]) {
        cli_error("--project-dir is too long");
        status = CLI_USAGE;
        goto done;
    }
    snprintf(metrics_path, sizeof metrics_path, "%s/metrics.jsonl", logdir);
    if (t.speak && (make_dirs(logdir) != 0 ||
                    !(t.metrics = metrics_open(metrics_path, resumed, step, &t.losses)))) {
        if (errno == ELOOP || errno == EINVAL)
            cli_error("%s: not a regular file of its own (a symlink, a FIFO, a folder or a hard "
                      "link); the log is not written through it: remove it",
                      metrics_path);
        else cli_error("%s: %s", metrics_path, strerror(errno));
        status = CLI_RUNTIME;
        goto done;
    }

    bool quiet = o->quiet || !t.speak;
    bool tty = t.tty =
        !quiet && isatty(STDOUT_FILENO) && !o->log_every_given && !launched_by_mpi(&t.dist);
    if (!quiet && t.dist.size > 1)
        printf("data parallel on %d processes: each takes %lld samples of every global batch of "
               "%lld\n",
               t.dist.size, (long long)o->batch_size, (long long)o->batch_size * t.dist.size);
    if (!quiet)
        printf("training %lld steps (%lld epochs of %lld batches of %lld), %lld training rows, "
               "%lld test rows\n",
               (long long)total, (long long)o->epochs, (long long)per_epoch,
               (long long)o->batch_size, (long long)t.ntrain, (long long)t.ntest);

    ckpt_rng *rng = ckpt_accelerator_rng(t.acc);
    double t0 = now_seconds(), last_draw = 0.0;
    int64_t start_step = step;
    /* one process stops at the signal; many at the step they agree on */
    bool stop = false;
    while (step < total && !(t.dist.size > 1 ? stop : ckpt_preemption_requested())) {
        ckpt_batch b;
        rc = ckpt_dataloader_next(t.loader, &b);
        if (rc < 0) {
            status = lib_fail("data loader", rc);
            goto done;
        }
        if (rc == 0) continue; /* end of an epoch; the next call starts the next one */

        const digits_sample *s = b.data;
        int B = (int)b.size;
        for (int k = 0; k < B; k++) {
            memcpy(t.x + (size_t)k * DIGITS_PIXELS, s[k].x, sizeof s[k].x);
            t.y[k] = s[k].label;
        }
        double lr = ckpt_optimizer_get_lr(t.optim, 0);
        double scale = ckpt_grad_scaler_scale(t.scaler);

        /* one step: forward, backward of the scaled loss, unscale + step,
         * scale update, learning-rate schedule */
        ckpt_optimizer_zero_grad(t.optim);
        float loss = mlp_forward(&t.net, t.x, t.y, B, DROPOUT, rng);
        mlp_backward(&t.net, t.y, (float)scale);
        if (t.dist.size > 1 && (rc = exchange(&t, &loss, &stop)) < 0) {
            status = lib_fail("gradient exchange", rc);
            goto done;
        }
        if ((rc = ckpt_grad_scaler_step(t.scaler, t.optim, NULL)) < 0 ||
            (rc = ckpt_grad_scaler_update(t.scaler)) < 0) {
            status = lib_fail("optimizer step", rc);
            goto done;
        }
        if ((rc = ckpt_scheduler_step(t.sched)) < 0) {
            status = lib_fail("scheduler", rc);
            goto done;
        }
        step++;
        ckpt_accelerator_set_step(t.acc, step);

        if (t.metrics)
            fprintf(t.metrics,
                    "{\"step\":%lld,\"epoch\":%lld,\"loss\":%.9g,\"lr\":%.17g,\"scale\":%.17g}\n",
                    (long long)step, (long long)b.epoch, (double)loss, lr, scale);
        /* flushed every step so the log can be followed while the run goes */
        if (t.metrics && fflush(t.metrics) != 0) {
            cli_error("%s: %s", metrics_path, strerror(errno));
            status = CLI_RUNTIME;
            goto done;
        }
        loss_history_put(&t.losses, step, loss);

        /* every --save-every steps, once --save-every-seconds passed, at a
         * preemption signal (the same step on every process), and at the end */
        int due = ckpt_should_save(t.acc, step);
        if (due < 0) {
            status = lib_fail("should_save", due);
            goto done;
        }
        if (due || step == total) {
            if ((status = save(&t, step, step == total)) != CLI_OK) goto done;
            saved_step = step;
        }

        double now = now_seconds(), el = now - t0;
        double rate = el > 0 ? (double)(step - start_step) / el : 0.0;
        if (tty && (now - last_draw >= 0.1 || step == total)) { /* ~10 redraws a second */
            last_draw = now;
            char eta[32];
            format_duration(rate > 0 ? (double)(total - step) / rate : 0.0, eta, sizeof eta);
            int width = 24, filled = (int)(width * step / total);
            printf("\repoch %lld/%lld [%.*s%*s] step %lld/%lld loss %.4f %.1f it/s ETA %s ",
                   (long long)b.epoch + 1, (long long)o->epochs, filled,
                   "########################", width - filled, "", (long long)step,
                   (long long)total, (double)loss, rate, eta);
            fflush(stdout);
        } else if (!tty && !quiet && (step % o->log_every == 0 || step == total)) {
            printf("epoch %lld step %lld/%lld loss %.4f lr %.3g scale %g %.1f it/s\n",
                   (long long)b.epoch + 1, (long long)step, (long long)total,
                   loss_history_mean(&t.losses, step - (step - 1) / o->log_every * o->log_every),
                   lr, scale, rate);
            fflush(stdout);
        }
    }
    if (tty) putchar('\n');

    if ((t.dist.size > 1 ? stop : ckpt_preemption_requested()) && step < total) {
        if (saved_step != step && (status = save(&t, step, true)) != CLI_OK) goto done;
        if (saved_step == step && t.opt.async && (rc = ckpt_save_wait(t.acc)) < 0) {
            status = lib_fail("save", rc);
            goto done;
        }
        report_ckpt_time(&t, now_seconds() - t0, quiet);
        if (t.speak)
            printf("preempted at step %lld, checkpoint saved: %s\n", (long long)step,
                   cli_esc(ckpt_accelerator_last_dir(t.acc)));
        status = CLI_OK;
        goto done;
    }
    report_ckpt_time(&t, now_seconds() - t0, quiet);
    int64_t correct = evaluate(&t.net, t.test_rows, t.ntest, t.x, t.y, t.pred, NULL);
    if (!quiet) printf("final checkpoint: %s\n", cli_esc(ckpt_accelerator_last_dir(t.acc)));
    if (t.speak)
        printf("test accuracy: %.2f%% (%lld/%lld)\n", 100.0 * (double)correct / (double)t.ntest,
           (long long)correct, (long long)t.ntest);
    status = CLI_OK;

done:
    trainer_free(&t);
    cli_dist_finish(&t.dist);
    ckpt_preemption_uninstall();
    return status;
}
