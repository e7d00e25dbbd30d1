/* cli_train.c — `ckpt train`: a real training run that survives kill -9.
 *
 * An MLP (64-256-256-10, ReLU, dropout 0.1) learns handwritten digits with
 * AdamW, warmup + cosine learning rate, dynamic loss scaling and a shuffled
 * prefetching data loader. Every object whose state matters is handed to the
 * accelerator, which saves it every --save-every steps; --resume continues
 * from the newest complete checkpoint, bit for bit as if never stopped.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cli_train.h"

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

/* Whether this process is one of a parallel job: a communicator of several,
 * or a launcher's environment (Open MPI gives every rank a pseudo-terminal,
 * so isatty says yes while the output goes to a shared log). */
static bool launched_by_mpi(const cli_dist *d) {
    return d->size > 1 || d->mpi || cli_dist_launched();
}

int cli_train(int argc, char **argv) {
    trainer t;
    memset(&t, 0, sizeof t);
    int rc = train_parse_opts(argc, argv, &t.opt);
    if (rc != 0) return rc < 0 ? CLI_OK : rc;
    const train_opts *o = &t.opt;

    /* a stop request only sets a flag: the loop finishes the step, saves and
     * exits, so a preemption never interrupts a save half-way */
    static const int preempt_signals[] = {SIGTERM, SIGUSR1, SIGINT};
    if ((rc = ckpt_preemption_install(preempt_signals, 3)) < 0) return train_fail("signals", rc);

    /* an asynchronous save with node-local tiers replicates in the
     * background if MPI allows calls from two threads */
    int status = cli_dist_init(&t.dist, o->local_dir && o->async);
    if (status != CLI_OK) goto done;
    t.speak = t.dist.rank == 0;
    status = trainer_setup(&t);
    if (status != CLI_OK) goto done;

    int64_t step = 0, saved_step = -1;
    int64_t per_epoch = ckpt_dataloader_num_batches(t.loader);
    int64_t total = per_epoch * o->epochs;
    bool resumed = false;
    /* the ranks agree on whether there is one to resume from */
    int64_t has = train_has_checkpoint(o->project_dir);
    if ((rc = cli_dist_max(&t.dist, &has, 1)) < 0) {
        status = train_fail("MPI", rc);
        goto done;
    }
    if (o->resume) {
        /* with --local-dir the tiers may hold saves the project does not */
        if (has || o->local_dir || o->resume_from) {
            if ((status = train_resume(&t)) != CLI_OK) goto done;
            has = t.resumed_from[0] != '\0';
        }
        if (has) {
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
    } else if (o->init_from && (status = train_init_from(&t)) != CLI_OK) {
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
    double t0 = train_now(), last_draw = 0.0;
    int64_t start_step = step;
    /* one process stops at the signal; many at the step they agree on */
    bool stop = false;
    while (step < total && !(t.dist.size > 1 ? stop : ckpt_preemption_requested())) {
        ckpt_batch b;
        rc = ckpt_dataloader_next(t.loader, &b);
        if (rc < 0) {
            status = train_fail("data loader", rc);
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
        if (t.dist.size > 1 && (rc = train_exchange(&t, &loss, &stop)) < 0) {
            status = train_fail("gradient exchange", rc);
            goto done;
        }
        if ((rc = ckpt_grad_scaler_step(t.scaler, t.optim, NULL)) < 0 ||
            (rc = ckpt_grad_scaler_update(t.scaler)) < 0) {
            status = train_fail("optimizer step", rc);
            goto done;
        }
        if ((rc = ckpt_scheduler_step(t.sched)) < 0) {
            status = train_fail("scheduler", rc);
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
            status = train_fail("should_save", due);
            goto done;
        }
        if (due || step == total) {
            /* the run's last save: at the end, or at the step a preemption
             * stops at (persisted with --local-dir, waited for with --async) */
            bool ending = step == total || (t.dist.size > 1 ? stop : ckpt_preemption_requested());
            if ((status = train_save(&t, step, ending)) != CLI_OK) goto done;
            saved_step = step;
        } else if (o->async && (rc = ckpt_save_poll(t.acc)) < 0) {
            /* a background save whose files are written is committed here,
             * not at the next save: a kill in between keeps it */
            status = train_fail("save", rc);
            goto done;
        }

        double now = train_now(), el = now - t0;
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
        if (saved_step != step && (status = train_save(&t, step, true)) != CLI_OK) goto done;
        if (saved_step == step && t.opt.async && (rc = ckpt_save_wait(t.acc)) < 0) {
            status = train_fail("save", rc);
            goto done;
        }
        train_report_time(&t, train_now() - t0, quiet);
        if (t.speak)
            printf("preempted at step %lld, checkpoint saved: %s\n", (long long)step,
                   cli_esc(ckpt_accelerator_last_dir(t.acc)));
        status = CLI_OK;
        goto done;
    }
    train_report_time(&t, train_now() - t0, quiet);
    int64_t correct = train_evaluate(&t.net, t.test_rows, t.ntest, t.x, t.y, t.pred, NULL);
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
