/* cli.h — shared pieces of the ckpt command-line tool. */
#ifndef CKPT_TOOLS_CLI_H
#define CKPT_TOOLS_CLI_H

#include <stdio.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "ckpt.h"

/* Exit codes (docs/CLI.md). */
enum {
    CLI_OK = 0,      /* success; checkpoints equal; everything verified */
    CLI_DIFFER = 1,  /* differences found, or verification failed */
    CLI_USAGE = 2,   /* bad command line */
    CLI_RUNTIME = 3  /* the operation failed (I/O error, bad file, full disk...) */
};

#if defined(__GNUC__)
#define CLI_PRINTF(a, b) __attribute__((format(printf, a, b)))
#else
#define CLI_PRINTF(a, b)
#endif

/* "ckpt: <message>" on stderr. */
void cli_error(const char *fmt, ...) CLI_PRINTF(1, 2);
/* "ckpt <cmd>: <message>" and a pointer to --help on stderr; returns CLI_USAGE. */
int cli_usage_error(const char *cmd, const char *fmt, ...) CLI_PRINTF(2, 3);

/* Strict number parsing for options: the whole string, in range. */
bool cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out);
bool cli_parse_double(const char *s, double *out);

/* Writes s as a JSON string literal (quotes and escapes) to stdout. Control
 * characters (C0, DEL, C1) and bytes that are not UTF-8 are \u escapes. */
void cli_json_string(const char *s);

/* s (a name or message that may come from a file) made safe to print on a
 * terminal: control characters (C0, DEL and C1, U+0080..U+009F) become \n,
 * \r, \t or \xNN, bytes that are not UTF-8 \xNN, and a backslash \\; the
 * rest is kept. Returns a view valid for the next 15 calls (a ring of
 * buffers, so one printf may escape several strings); NULL gives "(null)".
 * Very long text is cut and ends with "...". Every text output of the tool
 * that shows a name, key, path or message passes through it. */
const char *cli_esc(const char *s);
/* The same into out (cap bytes, at least 4): for a thread of its own.
 * Returns out. */
char *cli_escape_into(const char *s, char *out, size_t cap);
/* A ckpt_log_fn: "ckpt: warning: <msg>" (or error, info) on stderr in one
 * write, msg escaped; safe on any thread. */
void cli_library_log(void *user, ckpt_log_level level, const char *msg);

/* Human-readable byte count ("1.5 MiB") into buf. */
const char *cli_human_bytes(uint64_t n, char *buf, int cap);

/* Shortest decimal that reads back (strtod / strtof) to exactly v: "0.1",
 * "1e+21", "-0", "inf", "nan". Returns buf. */
const char *cli_format_double(double v, char *buf, int cap);
const char *cli_format_float(float v, char *buf, int cap);

/* A checkpoint's metrics (ckpt_set_metric): json: ',"metrics":{"name":v,...}'
 * (nothing when it has none); else "  name=v name=v" (shortest decimals). */
void cli_print_metrics(const ckpt_checkpoint_info *info, bool json);

/* A byte count: a number with an optional unit (B, KB, MB, GB, TB, KiB,
 * MiB, GiB, TiB), at least 1 byte. */
bool cli_parse_size(const char *s, uint64_t *out);
/* --keep-best METRIC:min|max:K into metric (cap bytes), mode and k (>= 1);
 * false if s is not of that form (the caller reports it). */
bool cli_parse_keep_best(const char *s, char *metric, size_t cap, ckpt_best_mode *mode, int64_t *k);

/* The newest checkpoint of a project that deep-verifies, into out (cap
 * bytes): what a project folder stands for where a checkpoint is expected.
 * CLI_OK, or CLI_RUNTIME after an error naming cmd and the project. */
int cli_newest_valid(const char *cmd, const char *project, char *out, size_t cap);

/* What a path on the command line is. */
typedef enum cli_kind {
    CLI_KIND_MISSING,    /* cannot be stat'ed (errno says why) */
    CLI_KIND_CHECKPOINT, /* a folder with a checkpoint.json */
    CLI_KIND_PROJECT,    /* a folder with a checkpoints folder and no checkpoint.json */
    CLI_KIND_FOLDER,     /* any other folder */
    CLI_KIND_STATE_FILE, /* a file named *.safetensors or that starts like one */
    CLI_KIND_TORCH_ZIP,  /* a zip archive (PK\3\4): what torch.save writes */
    CLI_KIND_OTHER_FILE  /* any other file */
} cli_kind;
cli_kind cli_classify(const char *path);
/* A verified local copy of the checkpoint at an s3:// URL (in a private
 * folder removed at exit), for the commands that read a folder: its path in
 * out. CLI_OK, or the exit status after printing the error. */
int cli_local_copy(const char *cmd, const char *url, char *out, size_t cap);
/* fopen that never blocks on a FIFO and opens only a regular file (else
 * NULL, errno EINVAL). how 'r': reads (a symlink is followed: a user's
 * input). 'w', 'a', 'x' (a new file, O_EXCL): a file the tool itself writes
 * (a log): a symlink at path is not followed (ELOOP) and a file with
 * another name (a hard link) is refused (EINVAL); 'w' truncates only once
 * that is known. */
FILE *cli_fopen_regular(const char *path, char how);
/* The usage error for a path of the wrong kind, naming it and what was
 * expected (`expected`, e.g. "a checkpoint, a project or a state file"),
 * with advice for a PyTorch file. Returns CLI_USAGE. */
int cli_wrong_kind(const char *cmd, const char *path, cli_kind kind, const char *expected);

/* ---- what `ls` and `verify` both print (cli_common.c) ---- */
/* "complete", "partial", "corrupt". */
const char *cli_status_name(ckpt_checkpoint_status s);
/* Parses "[options] ARG" where the only options are the given flags. Returns
 * 0 with *arg set, -1 after --help, or CLI_USAGE. */
int cli_parse_simple(int argc, char **argv, const char *help, const char *flag1, bool *val1,
                     const char *flag2, bool *val2, const char **arg);
/* Prints the project's leftover temporary folders (if any) after a table. */
void cli_print_leftovers(const char *project, bool json);

/* ---- a checkpoint folder's state files, for inspect and diff (cli_files.c) ---- */
struct dirent;
bool cli_is_dir(const char *path);
/* A model saved as Hugging Face shards is listed by its index,
 * "<stem>.safetensors.index.json": the object is "<stem>.safetensors". Other
 * names are themselves. */
const char *cli_object_of(const char *name, char *buf, size_t cap);
/* Whether name is a part of a model saved as Hugging Face shards in dir. */
bool cli_is_hf_part(const char *dir, const char *name);
/* The .safetensors files of a folder (and Hugging Face indexes), sorted by
 * name. Returns the count or -1 with errno; free with cli_free_names. */
int cli_list_state_files(const char *dir, struct dirent ***names);
void cli_free_names(struct dirent **names, int n);
const char *cli_kind_name(ckpt_entry_kind k);
/* "[d0, d1, ...]" on stdout. */
void cli_print_shape(const ckpt_entry_info *e);
/* "<object>-DDDDD-of-DDDDD.safetensors": one process's shard file. */
bool cli_is_shard_file(const char *name);
/* "<stem>.frozen.safetensors": a model's frozen tensors, kept apart by one
 * process (format version 3). */
bool cli_is_frozen_file(const char *name);
/* Whether name is a file of chunks of another object's tensors in the
 * checkpoint folder dir (a shard file, the frozen file; not a Hugging Face
 * part); if so that object's file name goes to obj. */
bool cli_part_of(const char *dir, const char *name, char *obj, size_t cap);
/* A state file; inside a checkpoint folder an object's file is opened with
 * its shard files, so sharded tensors read whole. */
int cli_open_state(const char *path, ckpt_reader **r);
/* Reports a failed library call ("what: message") and returns CLI_RUNTIME. */
int cli_lib_error(const char *what, int rc);
/* Element i of a tensor's bytes p as text (cli_diff.c): integers exactly,
 * floats as the shortest decimal that reads back to the same value of the
 * dtype; "?" for a dtype without a number form here (F8, F4, C64...). */
const char *cli_element_text(ckpt_dtype dt, const unsigned char *p, int64_t i, char *buf, int cap);

/* ---- many processes (cli_dist.c) ---- */
struct ckpt_comm;
typedef struct cli_dist {
    const struct ckpt_comm *comm; /* NULL: one process */
    struct ckpt_comm *owned;
    int rank, size;
    bool mpi; /* MPI_Init was called */
} cli_dist;
/* The rank cli_error tags its messages with ("ckpt: [rank r] ..."); -1 for
 * one process. */
extern int cli_rank;
/* Under mpirun (and built with MPI): MPI_Init and a communicator over
 * MPI_COMM_WORLD; otherwise one process. threads: ask MPI for
 * MPI_THREAD_MULTIPLE, so that an asynchronous save replicates to other
 * nodes in its background thread (ckpt_comm.exchange_background); without
 * it from MPI the run goes on, replicating in the caller's thread. Returns
 * an exit code. */
int cli_dist_init(cli_dist *d, bool threads);
void cli_dist_finish(cli_dist *d);
/* Whether a launcher (mpirun: Open MPI, PMIx or PMI) started this process
 * as a rank of a job, of any size, whether or not the build has MPI. */
bool cli_dist_launched(void);
/* Elementwise maximum of n values over every rank, in place. */
int cli_dist_max(const cli_dist *d, int64_t *v, int n);
/* buf (n floats) becomes the mean over every rank's buf, summed in rank
 * order so that it is reproducible; scratch holds size * n floats. */
int cli_dist_average(const cli_dist *d, float *buf, size_t n, float *scratch);

/* Subcommands: argv[0] is the subcommand's name. Each returns an exit code. */
int cli_train(int argc, char **argv);
int cli_ls(int argc, char **argv);
int cli_inspect(int argc, char **argv);
int cli_verify(int argc, char **argv);
int cli_diff(int argc, char **argv);
int cli_prune(int argc, char **argv);
int cli_export(int argc, char **argv);
int cli_import(int argc, char **argv);

#endif
