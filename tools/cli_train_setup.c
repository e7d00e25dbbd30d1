/* cli_train_setup.c — `ckpt train`'s trainer: the data set and its split,
 * the network, the training blocks handed to the accelerator, and the
 * gradient exchange of data-parallel ranks. */
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli_train.h"

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

void trainer_free(trainer *t) {
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
int train_fail(const char *what, int rc) {
    const char *msg = ckpt_errmsg();
    cli_error("%s: %s", what, *msg ? msg : ckpt_strerror(rc));
    return CLI_RUNTIME;
}

int trainer_setup(trainer *t) {
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
    if ((rc = ckpt_model_new(&t->model)) < 0) return train_fail("model", rc);
    int group_of[2 * MLP_LAYERS];
    for (int i = 0; i < 2 * MLP_LAYERS; i++) {
        int64_t shape[2];
        int nd = mlp_param_shape(&t->net, i, shape);
        rc = ckpt_model_add_param(t->model, mlp_param_name(i), CKPT_F32, nd, shape,
                                  mlp_param_data(&t->net, i), mlp_param_grad(&t->net, i));
        if (rc < 0) return train_fail("model", rc);
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
        if (rc < 0) return train_fail("--freeze", rc);
    }
    bool used[2] = {false, false};
    for (int i = 0; i < 2 * MLP_LAYERS; i++) {
        ckpt_param_info pi;
        if ((rc = ckpt_model_param(t->model, i, &pi)) < 0) return train_fail("model", rc);
        if (pi.frozen) group_of[i] = -1;
        else used[group_of[i]] = true;
    }
    if (!used[0] && !used[1]) {
        cli_error("--freeze: every parameter is frozen; nothing would be trained");
        return CLI_USAGE;
    }

    /* AdamW; weight decay on weights only, as is usual */
    if ((rc = ckpt_adamw_new(&t->optim, t->model, o->lr, 0.9, 0.999, 1e-8, 0.01)) < 0)
        return train_fail("optimizer", rc);
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
        return train_fail("optimizer", rc);

    /* the data loader: shuffled every epoch, prefetched by worker threads */
    if ((rc = ckpt_memory_dataset(&t->dataset, t->train_rows, t->ntrain, sizeof(digits_sample))) <
        0)
        return train_fail("dataset", rc);
    ckpt_dataloader_config dc = ckpt_dataloader_defaults();
    dc.batch_size = o->batch_size;
    dc.shuffle = true;
    dc.seed = (uint64_t)o->seed;
    dc.drop_last = true;
    dc.num_workers = (int)o->workers;
    if ((rc = ckpt_dataloader_new(&t->loader, &t->dataset, &dc)) < 0)
        return train_fail("data loader", rc);

    /* the accelerator first: preparing the loader shards it over the
     * processes, which sets the number of steps an epoch */
    ckpt_project_config pc = {
        .project_dir = o->project_dir,
        .automatic_checkpoint_naming = true,
        .total_limit = (int)o->total_limit,
        .link_copies = (int)o->link_copies,
        .comm = t->dist.comm,
        .save_interval_steps = o->save_every,
        .keep_every_steps = o->keep_every,
        .max_shard_size = o->max_shard_size,
        .best_metric = o->best_k ? o->best_metric : NULL,
        .best_mode = o->best_mode,
        .best_k = (int)o->best_k,
        .save_interval_seconds = o->save_every_seconds,
        .collective_timeout_s = o->collective_timeout > 0 ? o->collective_timeout : -1.0,
        .local_dir = o->local_dir,
        .local_replicas = o->replicas < 0    ? 0
                          : o->replicas == 0 ? -1
                                             : (int)o->replicas,
        .persist_every = (int)o->persist_every,
        .ranks_per_node = (int)o->ranks_per_node,
    };
    if ((rc = ckpt_accelerator_new(&t->acc, &pc)) < 0) return train_fail("accelerator", rc);
    ckpt_accelerator_set_log(t->acc, cli_library_log, NULL); /* escaped, as every output */
    if (o->shard_optimizer && (rc = ckpt_optimizer_set_shard(
                                   t->optim, t->dist.comm ? t->dist.comm : ckpt_comm_self())) < 0)
        return train_fail("--shard-optimizer", rc);
    if ((rc = ckpt_prepare_dataloader(t->acc, t->loader)) < 0) return train_fail("prepare", rc);
    int64_t per_epoch = ckpt_dataloader_num_batches(t->loader);
    if (per_epoch <= 0) {
        cli_error("data loader: no batches in an epoch");
        return CLI_RUNTIME;
    }
    int64_t total = per_epoch * o->epochs;

    if ((rc = ckpt_warmup_cosine_new(&t->sched, t->optim, total / 20, total)) < 0)
        return train_fail("scheduler", rc);
    /* a small growth interval so the scale actually moves during the demo */
    if ((rc = ckpt_grad_scaler_new(&t->scaler, 1024.0, 2.0, 0.5, 100)) < 0)
        return train_fail("grad scaler", rc);

    if ((rc = ckpt_prepare_model(t->acc, t->model)) < 0 ||
        (rc = ckpt_prepare_optimizer(t->acc, t->optim)) < 0 ||
        (rc = ckpt_prepare_scheduler(t->acc, t->sched)) < 0 ||
        (rc = ckpt_prepare_scaler(t->acc, t->scaler)) < 0)
        return train_fail("prepare", rc);
    t->config = (run_config){.epochs = o->epochs,
                             .batch_size = o->batch_size,
                             .seed = o->seed,
                             .train_rows = t->ntrain,
                             .hidden = HIDDEN,
                             .lr = o->lr};
    t->saved_config = t->config;
    if ((rc = ckpt_register_for_checkpointing(t->acc, &train_config_ops, &t->saved_config)) < 0)
        return train_fail("register", rc);
    /* the staging area ready before the first save, so it stalls like the others */
    if (o->async && (rc = ckpt_accelerator_prepare_async(t->acc)) < 0)
        return train_fail("prepare_async", rc);

    /* weights come from the seeded default generator; dropout draws from it
     * too, so its saved state carries the rest of the run's randomness */
    if ((rc = ckpt_set_seed(t->acc, (uint64_t)o->seed)) < 0) return train_fail("seed", rc);
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
int train_exchange(trainer *t, float *loss, bool *stop) {
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
