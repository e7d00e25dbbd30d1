/* cli_dist.c — `ckpt train` under mpirun: MPI start-up and the collectives
 * the training loop needs, over the public ckpt_comm. In a build without
 * MPI, or outside mpirun, one process and no MPI call at all. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "ckpt.h"
#ifdef CKPT_HAVE_MPI
#include <mpi.h>

#include "ckpt_mpi.h"
#endif

/* The environment mpirun (Open MPI, or a PMI/PMIx launcher) gives a rank. */
static long launched_size(void) {
    static const char *const vars[] = {"OMPI_COMM_WORLD_SIZE", "PMIX_SIZE", "PMI_SIZE"};
    for (size_t i = 0; i < sizeof vars / sizeof vars[0]; i++) {
        const char *v = getenv(vars[i]);
        if (v && *v) return strtol(v, NULL, 10);
    }
    return getenv("PMIX_RANK") ? 1 : 0;
}

bool cli_dist_launched(void) { return launched_size() > 0; }

int cli_rank = -1; /* cli_error's "[rank r]" tag; -1: one process */

int cli_dist_init(cli_dist *d, bool threads) {
    memset(d, 0, sizeof *d);
    d->size = 1;
    long launched = launched_size();
#ifdef CKPT_HAVE_MPI
    if (launched <= 0) return CLI_OK;
    int level = 0;
    if ((threads ? MPI_Init_thread(NULL, NULL, MPI_THREAD_MULTIPLE, &level)
                 : MPI_Init(NULL, NULL)) != MPI_SUCCESS) {
        cli_error("MPI_Init failed");
        return CLI_RUNTIME;
    }
    d->mpi = true;
    ckpt_comm *c = NULL;
    int rc = ckpt_comm_mpi(&c, MPI_COMM_WORLD);
    if (rc < 0) {
        cli_error("MPI: %s", ckpt_errmsg());
        return CLI_RUNTIME;
    }
    d->owned = c;
    d->comm = c;
    d->rank = c->rank;
    d->size = c->size;
    if (d->size > 1) cli_rank = d->rank;
    return CLI_OK;
#else
    (void)threads;
    if (launched > 1) {
        cli_error("started as one of %ld processes, but this ckpt was built without MPI", launched);
        return CLI_USAGE;
    }
    return CLI_OK;
#endif
}

void cli_dist_finish(cli_dist *d) {
    ckpt_comm_free(d->owned);
    d->owned = NULL;
    d->comm = NULL;
#ifdef CKPT_HAVE_MPI
    if (d->mpi) MPI_Finalize();
#endif
    d->mpi = false;
}

int cli_dist_max(const cli_dist *d, int64_t *v, int n) {
    if (d->size <= 1) return CKPT_OK;
    return d->comm->allreduce_i64(d->comm->ctx, v, n, CKPT_REDUCE_MAX);
}

int cli_dist_average(const cli_dist *d, float *buf, size_t n, float *scratch) {
    if (d->size <= 1) return CKPT_OK;
    size_t *lens = malloc((size_t)d->size * sizeof *lens);
    if (!lens) return ckpt_set_error(CKPT_ENOMEM, "out of memory (gradient exchange)");
    for (int r = 0; r < d->size; r++) lens[r] = n * sizeof *buf;
    int rc = d->comm->allgather(d->comm->ctx, buf, scratch, lens);
    free(lens);
    if (rc < 0) return rc;
    /* Rank order, one element at a time: every rank adds the same numbers
     * in the same order, so every rank gets the same bits, run after run. */
    float inv = 1.0f / (float)d->size;
    for (size_t i = 0; i < n; i++) {
        float s = 0.0f;
        for (int r = 0; r < d->size; r++) s += scratch[(size_t)r * n + i];
        buf[i] = s * inv;
    }
    return CKPT_OK;
}
