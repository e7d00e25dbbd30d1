/* deadline_run.c — collective deadlines under mpirun: one rank is held back
 * inside a save, then inside a load, past a short deadline.
 *
 *   mpirun -np P deadline_run <project_dir> <sleeper rank> <timeout s>
 *
 * The sleeper waits in a save pre-hook (then a load pre-hook) until every
 * other rank has returned from that save (load) and said so with a file
 * <project_dir>/back.<what>.<rank>, so no timing decides anything: the others
 * can only have returned by their deadline. Then every rank meets at an
 * MPI_Barrier of the test itself and goes on. Each rank prints lines
 *
 *   rank <r> <what> <CKPT_STATUS> <message>
 *
 * for what = save1 (all present), save2 (sleeper held), save3 (all back),
 * load2 (sleeper held), value2 (the object after that failed load), load3,
 * value3, save4. The object is one int64 "value", 7 when saved; set to -1
 * before the loads, so value2 must stay -1 and value3 be 7. The shell test
 * (tests/integration/test_deadline.sh) checks the lines. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "ckpt_mpi.h"

typedef struct run {
    const char *dir;
    int rank, size, sleeper;
    const char *held; /* the pre-hook that holds the sleeper back, or NULL */
    int64_t value;
} run;

static int value_save(void *self, ckpt_writer *w) {
    return ckpt_write_i64(w, "value", ((run *)self)->value);
}

static int value_load(void *self, ckpt_reader *r) {
    return ckpt_read_i64(r, "value", &((run *)self)->value);
}

static void back_file(const run *t, const char *what, int rank, char *out, size_t cap) {
    snprintf(out, cap, "%s/back.%s.%d", t->dir, what, rank);
}

/* The sleeper: waits (at most 10 minutes) until every other rank is back. */
static void hold(run *t, const char *what) {
    for (int tries = 0; tries < 6000; tries++) {
        int back = 0;
        for (int r = 0; r < t->size; r++) {
            char path[512];
            struct stat st;
            back_file(t, what, r, path, sizeof path);
            back += r != t->sleeper && stat(path, &st) == 0;
        }
        if (back == t->size - 1) return;
        usleep(100000);
    }
}

static int hook(void *user, ckpt_accelerator *acc, const char *dir, const char *what) {
    (void)acc, (void)dir;
    run *t = user;
    if (t->held && strcmp(t->held, what) == 0 && t->rank == t->sleeper) hold(t, what);
    return 0;
}

static int save_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    return hook(user, acc, dir, "save2");
}
static int load_hook(void *user, ckpt_accelerator *acc, const char *dir) {
    return hook(user, acc, dir, "load2");
}

static void say(run *t, const char *what, int rc) {
    const char *name = ckpt_strerror(rc);
    char code[32];
    size_t n = strcspn(name, ":");
    snprintf(code, sizeof code, "%.*s", (int)n, name);
    printf("rank %d %s %s %s\n", t->rank, what, code, rc < 0 ? ckpt_errmsg() : "");
    fflush(stdout);
    if (t->held && strcmp(t->held, what) == 0 && t->rank != t->sleeper) {
        char path[512];
        back_file(t, what, t->rank, path, sizeof path);
        FILE *f = fopen(path, "w");
        if (f) fclose(f);
    }
}

int main(int argc, char **argv) {
    if (argc != 4 && argc != 5) {
        fprintf(stderr, "usage: %s <project_dir> <sleeper rank> <timeout s> [save2|load2]\n",
                argv[0]);
        return 2;
    }
    const char *stop = argc == 5 ? argv[4] : "";
    MPI_Init(&argc, &argv);
    run t = {.dir = argv[1], .sleeper = atoi(argv[2]), .value = 7};
    MPI_Comm_rank(MPI_COMM_WORLD, &t.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &t.size);
    ckpt_comm *comm = NULL;
    ckpt_accelerator *acc = NULL;
    ckpt_project_config cfg = {.project_dir = t.dir,
                               .automatic_checkpoint_naming = true,
                               .collective_timeout_s = atof(argv[3])};
    static const ckpt_stateful_ops ops = {value_save, value_load, NULL};
    int rc = ckpt_comm_mpi(&comm, MPI_COMM_WORLD);
    cfg.comm = comm;
    if (rc != 0 || ckpt_accelerator_new(&acc, &cfg) != 0 ||
        ckpt_register_for_checkpointing(acc, &ops, &t) != 0 ||
        ckpt_register_save_state_pre_hook(acc, save_hook, &t, NULL) ||
        ckpt_register_load_state_pre_hook(acc, load_hook, &t, NULL)) {
        fprintf(stderr, "rank %d: setup: %s\n", t.rank, ckpt_errmsg());
        MPI_Abort(MPI_COMM_WORLD, 2);
    }
    say(&t, "save1", ckpt_save_state(acc, NULL));
    t.held = "save2";
    say(&t, "save2", ckpt_save_state(acc, NULL));
    if (strcmp(stop, "save2") == 0) goto end;
    MPI_Barrier(MPI_COMM_WORLD);
    t.held = NULL;
    say(&t, "save3", ckpt_save_state(acc, NULL));
    t.value = -1;
    t.held = "load2";
    say(&t, "load2", ckpt_load_state(acc, NULL));
    printf("rank %d value2 %lld\n", t.rank, (long long)t.value);
    if (strcmp(stop, "load2") == 0) goto end;
    MPI_Barrier(MPI_COMM_WORLD);
    t.held = NULL;
    say(&t, "load3", ckpt_load_state(acc, NULL));
    printf("rank %d value3 %lld\n", t.rank, (long long)t.value);
    say(&t, "save4", ckpt_save_state(acc, NULL));
end:
    ckpt_accelerator_free(acc);
    ckpt_comm_free(comm);
    MPI_Finalize();
    return 0;
}
