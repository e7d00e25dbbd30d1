/* cli_train_opts.c — `ckpt train`'s help and command line. */
#include <getopt.h>
#include <stdio.h>
#include <string.h>

#include "cli_train.h"

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
    "  --link-copies N    keep N physical copies of every unchanged file among the\n"
    "                     retained checkpoints (default 2; 1: link every unchanged\n"
    "                     file, one copy shared by all)\n"
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
    "  --resume-from CKPT continue from checkpoint folder CKPT (a folder that is not\n"
    "                     a checkpoint is an error naming those that exist)\n"
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
    "                     the state (ckpt_save_state_async); the last save is waited for;\n"
    "                     with --local-dir under MPI the replicas are sent in the\n"
    "                     background too (MPI_THREAD_MULTIPLE)\n"
    "  --freeze PATTERN   freeze the parameters whose names match the glob PATTERN\n"
    "                     (e.g. 'fc1.*'; repeatable): the optimizer leaves them alone\n"
    "                     and checkpoints keep them in a file of their own that\n"
    "                     later saves link instead of writing again, while\n"
    "                     --link-copies physical copies remain (default 2)\n"
    "  --shard-optimizer  ZeRO-1: each process keeps the AdamW moments of its share\n"
    "                     of the parameters (saved as sharded tensors)\n"
    "  --local-dir DIR    storage tiers: every save goes first to DIR, a folder on\n"
    "                     each node (%n: the node's index, %r: the rank; e.g.\n"
    "                     /dev/shm/ckpt-%n, memory, which lasts as long as the\n"
    "                     node), and each rank's part is copied to --replicas\n"
    "                     other nodes; --resume takes the newest save whose every\n"
    "                     part is on some node or in the project folder\n"
    "                     (docs/DISTRIBUTED.md, \"Storage tiers\")\n"
    "  --replicas N       with --local-dir: other nodes that keep a copy of each\n"
    "                     rank's part (default 1; 0 = none)\n"
    "  --persist-every K  with --local-dir: every K-th save also goes to the project\n"
    "                     folder (default 1); so do the last save and a save at a\n"
    "                     preemption signal\n"
    "  --ranks-per-node J with --local-dir: J ranks make a node (default: the\n"
    "                     machines MPI found); set it to simulate nodes on one\n"
    "                     machine\n"
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

int train_parse_opts(int argc, char **argv, train_opts *o) {
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
        O_RESUME_FROM,
        O_LINK_COPIES,
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
        O_FREEZE,
        O_LOCAL_DIR,
        O_REPLICAS,
        O_PERSIST_EVERY,
        O_RANKS_PER_NODE
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
        {"resume-from", required_argument, NULL, O_RESUME_FROM},
        {"link-copies", required_argument, NULL, O_LINK_COPIES},
        {"init-from", required_argument, NULL, O_INIT_FROM},
        {"freeze", required_argument, NULL, O_FREEZE},
        {"max-shard-size", required_argument, NULL, O_MAX_SHARD},
        {"drop-data-position", no_argument, NULL, O_DROP_POSITION},
        {"log-every", required_argument, NULL, O_LOG_EVERY},
        {"quiet", no_argument, NULL, O_QUIET},
        {"shard-optimizer", no_argument, NULL, O_SHARD_OPTIM},
        {"async", no_argument, NULL, O_ASYNC},
        {"local-dir", required_argument, NULL, O_LOCAL_DIR},
        {"replicas", required_argument, NULL, O_REPLICAS},
        {"persist-every", required_argument, NULL, O_PERSIST_EVERY},
        {"ranks-per-node", required_argument, NULL, O_RANKS_PER_NODE},
        {"help", no_argument, NULL, 'h'},
        {NULL, 0, NULL, 0},
    };
    *o = (train_opts){.epochs = 10,
                      .batch_size = 32,
                      .seed = 1,
                      .save_every = 50,
                      .total_limit = 3,
                      .workers = 2,
                      .log_every = 50,
                      .lr = 2e-3,
                      .collective_timeout = CKPT_COLLECTIVE_TIMEOUT_DEFAULT_S,
                      .replicas = -1,
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
        case O_LINK_COPIES: ok = cli_parse_i64(a, 1, 64, &o->link_copies); break;
        case O_WORKERS: ok = cli_parse_i64(a, 0, 64, &o->workers); break;
        case O_PROJECT: o->project_dir = a; break;
        case O_DATA: o->data = a; break;
        case O_RESUME: o->resume = true; break;
        case O_RESUME_FROM:
            o->resume = true;
            o->resume_from = a;
            ok = *a != '\0';
            break;
        case O_INIT_FROM:
            o->init_from = a;
            ok = *a != '\0';
            break;
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
        case O_LOCAL_DIR:
            o->local_dir = a;
            ok = *a != '\0';
            break;
        case O_REPLICAS: ok = cli_parse_i64(a, 0, 1 << 20, &o->replicas); break;
        case O_PERSIST_EVERY: ok = cli_parse_i64(a, 1, INT32_MAX, &o->persist_every); break;
        case O_RANKS_PER_NODE: ok = cli_parse_i64(a, 1, 1 << 24, &o->ranks_per_node); break;
        case O_KEEP_EVERY: ok = cli_parse_i64(a, 1, INT64_MAX, &o->keep_every); break;
        case O_KEEP_BEST:
            if (!cli_parse_keep_best(a, o->best_metric, sizeof o->best_metric, &o->best_mode,
                                     &o->best_k))
                return cli_usage_error("train",
                                       "bad value for '--keep-best': '%s', expected "
                                       "METRIC:min:K or METRIC:max:K (e.g. test_loss:min:3)",
                                       a);
            if (strcmp(o->best_metric, "test_loss") != 0 && strcmp(o->best_metric, "test_acc") != 0)
                return cli_usage_error("train",
                                       "--keep-best: metric '%s' is not recorded; train "
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
    if (!o->local_dir && (o->replicas >= 0 || o->persist_every || o->ranks_per_node))
        return cli_usage_error("train", "--replicas, --persist-every and --ranks-per-node "
                                        "apply with --local-dir only");
    if (o->drop_data_position && !o->resume)
        return cli_usage_error("train", "--drop-data-position applies to a --resume only");
    if (o->init_from && o->resume)
        return cli_usage_error("train", "--init-from and --resume exclude each other: --resume "
                                        "continues this project's run, --init-from starts a new "
                                        "one from another run's weights");
    return 0;
}
