/* cli_train_ckpt.c — what `ckpt train` asks of checkpoints: the run's
 * settings saved with each (a custom object), --resume and its checks,
 * --init-from, the saves with their metrics, and the time they took. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cli_train.h"

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

const ckpt_stateful_ops train_config_ops = {
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

double train_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Accuracy on held-out rows, in chunks of the network's batch size; no
 * dropout, no random draws. */
/* Correct predictions on rows; *mean_loss (may be NULL) gets the mean
 * cross-entropy. Touches no generator: a run's numbers do not depend on
 * whether or how often it evaluates. */
int64_t train_evaluate(mlp *net, const digits_sample *rows, int64_t n, float *x, int32_t *y,
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

/* Whether the project has a complete checkpoint to resume from. */
bool train_has_checkpoint(const char *project_dir) {
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
int train_init_from(trainer *t) {
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
    if (rc == CKPT_EINVAL && cli_classify(dir) != CLI_KIND_CHECKPOINT) {
        cli_error("--init-from %s: not a checkpoint folder nor a project (%s); pass one such "
                  "as RUN/checkpoints/checkpoint_N, or RUN for its newest valid checkpoint",
                  dir, ckpt_errmsg());
        return CLI_USAGE;
    }
    if (rc < 0) return train_fail("init-from", rc);
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
int train_resume(trainer *t) {
    const train_opts *o = &t->opt;
    int rc = ckpt_load_state(t->acc, o->resume_from);
    if (rc == CKPT_EINVAL && o->resume_from &&
        cli_classify(o->resume_from) != CLI_KIND_CHECKPOINT) {
        cli_error("--resume-from: %s", ckpt_errmsg());
        return CLI_USAGE;
    }
    /* with node-local tiers a run may have saves there and none in the
     * project folder yet: nothing anywhere is a fresh start */
    if (rc == CKPT_ENOENT && o->local_dir && !o->resume_from) {
        t->resumed_from[0] = '\0';
        return CLI_OK;
    }
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
        if (ckpt_load_state_ex(t->acc, o->resume_from, &lo, &rep) < 0) {
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
            return train_fail("resume", rc);
        ckpt_load_options all_but_loader = {.objects = CKPT_LOAD_ALL & ~CKPT_LOAD_DATALOADERS};
        rc = ckpt_load_state_ex(t->acc, t->resumed_from, &all_but_loader, &rep);
        if (rc == 0) {
            /* a partial load leaves the step alone: it is the checkpoint's */
            ckpt_accelerator_set_step(t->acc, rep.step);
            ckpt_load_report_free(&rep);
            rc = ckpt_dataloader_set_epoch(t->loader, pos > 0 ? epoch + 1 : epoch);
        }
        if (rc < 0) return train_fail("resume", rc);
    } else {
        return train_fail("resume", rc);
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
            return train_fail("resume: schedule", rc);
    }
    /* the next saves record this run's settings */
    t->saved_config = t->config;
    return CLI_OK;
}

/* last: the run ends after it, so an asynchronous save is waited for. */
int train_save(trainer *t, int64_t step, bool last) {
    /* collective over the ranks: each returns the same status and message */
    double t0 = train_now();
    /* the test set's loss and accuracy go with the checkpoint (ckpt ls shows
     * them; --keep-best ranks by them) */
    double test_loss = 0.0;
    int64_t correct =
        train_evaluate(&t->net, t->test_rows, t->ntest, t->x, t->y, t->pred, &test_loss);
    int rc = ckpt_set_metric(t->acc, "test_loss", test_loss);
    if (rc == 0)
        rc = ckpt_set_metric(t->acc, "test_acc",
                             t->ntest ? (double)correct / (double)t->ntest : 0.0);
    /* with node-local tiers the last save (the end, a preemption) also goes
     * to the project folder, whatever --persist-every says */
    if (rc == 0 && last) rc = ckpt_accelerator_persist_next_save(t->acc);
    if (rc == 0)
        rc = t->opt.async ? ckpt_save_state_async(t->acc, NULL) : ckpt_save_state(t->acc, NULL);
    if (rc == 0 && t->opt.async && last) rc = ckpt_save_wait(t->acc);
    t->ckpt_seconds += train_now() - t0;
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

/* How long the loop waited for checkpoints, against the whole loop. */
void train_report_time(const trainer *t, double run_seconds, bool quiet) {
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
