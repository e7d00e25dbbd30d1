/* cli_common.c — what the ckpt commands share: messages and their escaping,
 * option parsing, numbers and sizes printed, what a path on the command line
 * is, files opened safely, and the pieces `ls` and `verify` both print. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "ckpt.h"
#include "cli.h"

/* The message formatted, then escaped (cli_esc): names and messages quoted
 * from files may hold control characters. NULL without memory. */
static char *format_escaped(const char *fmt, va_list ap) {
    va_list ap2;
    va_copy(ap2, ap);
    int n = vsnprintf(NULL, 0, fmt, ap2);
    va_end(ap2);
    char *raw = n >= 0 ? malloc((size_t)n + 1) : NULL;
    if (!raw) return NULL;
    vsnprintf(raw, (size_t)n + 1, fmt, ap);
    const char *esc = cli_esc(raw);
    free(raw);
    return strdup(esc);
}

/* One write for the whole line: stderr is unbuffered, and the ranks of a job
 * share it, so a line written piecewise could be cut by another rank's. */
void cli_error(const char *fmt, ...) {
    char prefix[48];
    if (cli_rank >= 0) snprintf(prefix, sizeof prefix, "ckpt: [rank %d] ", cli_rank);
    else snprintf(prefix, sizeof prefix, "ckpt: ");
    va_list ap;
    va_start(ap, fmt);
    char *msg = format_escaped(fmt, ap);
    va_end(ap);
    if (!msg) {
        fprintf(stderr, "%sout of memory while reporting an error\n", prefix);
        return;
    }
    size_t plen = strlen(prefix), mlen = strlen(msg);
    char *line = malloc(plen + mlen + 2);
    if (line) {
        memcpy(line, prefix, plen);
        memcpy(line + plen, msg, mlen);
        line[plen + mlen] = '\n';
        fwrite(line, 1, plen + mlen + 1, stderr);
        free(line);
    } else {
        fprintf(stderr, "%s%s\n", prefix, msg);
    }
    free(msg);
}

/* The library's warnings (a fallback to an older checkpoint names the
 * damage it found, which may quote a file's key) and an asynchronous save's
 * failure, escaped like everything else. It may run on the accelerator's
 * background thread: a buffer of its own, one write. */
void cli_library_log(void *user, ckpt_log_level level, const char *msg) {
    (void)user;
    const char *what = level == CKPT_LOG_ERROR     ? "error"
                       : level == CKPT_LOG_WARNING ? "warning"
                                                   : "info";
    char line[8192 + 64];
    int n = cli_rank >= 0 ? snprintf(line, 64, "ckpt: [rank %d] %s: ", cli_rank, what)
                          : snprintf(line, 64, "ckpt: %s: ", what);
    cli_escape_into(msg, line + n, sizeof line - (size_t)n - 1);
    size_t len = strlen(line);
    line[len] = '\n';
    fwrite(line, 1, len + 1, stderr);
}

int cli_usage_error(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    char *msg = format_escaped(fmt, ap);
    va_end(ap);
    fprintf(stderr, "ckpt %s: %s\n(see 'ckpt %s --help')\n", cmd,
            msg ? msg : "bad usage (out of memory while reporting it)", cmd);
    free(msg);
    return CLI_USAGE;
}

bool cli_parse_i64(const char *s, int64_t lo, int64_t hi, int64_t *out) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool cli_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !isfinite(v)) return false;
    *out = v;
    return true;
}

/* The length of the UTF-8 sequence at p (1..4) if it is well formed and not
 * a C1 control character (U+0080..U+009F); 0 otherwise. p is NUL-terminated. */
static int utf8_printable_len(const unsigned char *p) {
    unsigned char c = p[0];
    int n;
    uint32_t cp;
    if (c < 0x80) return 1;
    if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1f;
    else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0f;
    else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07;
    else return 0;
    for (int i = 1; i < n; i++) {
        if ((p[i] & 0xc0) != 0x80) return 0;
        cp = cp << 6 | (p[i] & 0x3f);
    }
    if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) ||
        (cp >= 0xd800 && cp <= 0xdfff) || (cp >= 0x80 && cp <= 0x9f))
        return 0;
    return n;
}

void cli_json_string(const char *s) {
    putchar('"');
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        switch (*p) {
        case '"': fputs("\\\"", stdout); break;
        case '\\': fputs("\\\\", stdout); break;
        case '\n': fputs("\\n", stdout); break;
        case '\r': fputs("\\r", stdout); break;
        case '\t': fputs("\\t", stdout); break;
        default: {
            int n = *p == 0x7f ? 0 : utf8_printable_len(p);
            if (*p < 0x20 || n == 0) {
                /* a C1 character as its code point; a stray byte as U+00XX */
                unsigned cp = *p;
                if (*p == 0xc2 && p[1] >= 0x80 && p[1] <= 0x9f) cp = *++p;
                printf("\\u%04x", cp);
            } else {
                fwrite(p, 1, (size_t)n, stdout);
                p += n - 1;
            }
        }
        }
    }
    putchar('"');
}

const char *cli_esc(const char *s) {
    enum { SLOTS = 16, CAP = 8192 };
    static char ring[SLOTS][CAP];
    static unsigned next;
    return cli_escape_into(s, ring[next++ % SLOTS], CAP);
}

char *cli_escape_into(const char *s, char *out, size_t cap) {
    if (!s) s = "(null)";
    size_t o = 0;
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        char piece[8];
        int n = 0;
        int u = *p == 0x7f ? 0 : utf8_printable_len(p);
        if (*p == '\\') n = snprintf(piece, sizeof piece, "\\\\");
        else if (*p == '\n') n = snprintf(piece, sizeof piece, "\\n");
        else if (*p == '\r') n = snprintf(piece, sizeof piece, "\\r");
        else if (*p == '\t') n = snprintf(piece, sizeof piece, "\\t");
        else if (*p < 0x20 || u == 0) n = snprintf(piece, sizeof piece, "\\x%02x", *p);
        if (o + (size_t)(n ? n : u) + 4 >= cap) {
            memcpy(out + o, "...", 4);
            return out;
        }
        if (n) {
            memcpy(out + o, piece, (size_t)n);
            o += (size_t)n;
        } else {
            memcpy(out + o, p, (size_t)u);
            o += (size_t)u;
            p += u - 1;
        }
    }
    out[o] = '\0';
    return out;
}

const char *cli_human_bytes(uint64_t n, char *buf, int cap) {
    static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
    double v = (double)n;
    int u = 0;
    while (v >= 1024.0 && u < 4) {
        v /= 1024.0;
        u++;
    }
    if (u == 0) snprintf(buf, (size_t)cap, "%llu B", (unsigned long long)n);
    else snprintf(buf, (size_t)cap, "%.1f %s", v, units[u]);
    return buf;
}

/* %g writes a number with fewer significant digits than its integer part
 * in exponent form (180 at 2 digits is "1.8e+02"); below 1e16 it reads better
 * as plain digits ("180"), which read back the same. */
static void plain_digits(double v, int prec, char *buf, int cap) {
    const char *e = strchr(buf, 'e');
    if (!e) return;
    int exp10 = atoi(e + 1);
    if (exp10 < prec || exp10 >= 16) return;
    snprintf(buf, (size_t)cap, "%.0f", v);
}

static const char *shortest(double v, bool single, char *buf, int cap) {
    if (isnan(v)) snprintf(buf, (size_t)cap, "nan");
    else if (isinf(v)) snprintf(buf, (size_t)cap, v < 0 ? "-inf" : "inf");
    else {
        for (int prec = 1; prec <= 17; prec++) {
            snprintf(buf, (size_t)cap, "%.*g", prec, v);
            if (single ? strtof(buf, NULL) == (float)v : strtod(buf, NULL) == v) {
                if (v != 0 || signbit(strtod(buf, NULL)) == signbit(v)) {
                    plain_digits(v, prec, buf, cap);
                    return buf;
                }
            }
        }
        snprintf(buf, (size_t)cap, "%.17g", v);
    }
    return buf;
}

const char *cli_format_double(double v, char *buf, int cap) { return shortest(v, false, buf, cap); }

bool cli_parse_size(const char *s, uint64_t *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || v <= 0) return false;
    static const struct {
        const char *suffix;
        double mult;
    } units[] = {{"", 1},
                 {"B", 1},
                 {"KB", 1e3},
                 {"MB", 1e6},
                 {"GB", 1e9},
                 {"TB", 1e12},
                 {"KiB", 1024.0},
                 {"MiB", 1048576.0},
                 {"GiB", 1073741824.0},
                 {"TiB", 1099511627776.0}};
    for (size_t i = 0; i < sizeof units / sizeof units[0]; i++) {
        if (strcmp(end, units[i].suffix) == 0) {
            double b = v * units[i].mult;
            if (b < 1 || b > 1.8e19) return false;
            *out = (uint64_t)b;
            return true;
        }
    }
    return false;
}

bool cli_parse_keep_best(const char *s, char *metric, size_t cap, ckpt_best_mode *mode,
                         int64_t *k) {
    const char *c1 = strchr(s, ':');
    if (!c1 || c1 == s || (size_t)(c1 - s) >= cap) return false;
    const char *c2 = strchr(c1 + 1, ':');
    if (!c2) return false;
    size_t ml = (size_t)(c2 - c1 - 1);
    if (ml == 3 && !strncmp(c1 + 1, "min", 3)) *mode = CKPT_BEST_MIN;
    else if (ml == 3 && !strncmp(c1 + 1, "max", 3)) *mode = CKPT_BEST_MAX;
    else return false;
    if (!cli_parse_i64(c2 + 1, 1, INT32_MAX, k)) return false;
    memcpy(metric, s, (size_t)(c1 - s));
    metric[c1 - s] = '\0';
    return true;
}

void cli_print_metrics(const ckpt_checkpoint_info *info, bool json) {
    if (info->num_metrics <= 0) return;
    if (json) printf(",\"metrics\":{");
    for (int i = 0; i < info->num_metrics; i++) {
        char num[40];
        cli_format_double(info->metrics[i].value, num, sizeof num);
        if (json) {
            if (i) putchar(',');
            cli_json_string(info->metrics[i].name);
            printf(":%s", num); /* names are plain; values are finite */
        } else {
            printf("%s%s=%s", i ? " " : "  ", info->metrics[i].name, num);
        }
    }
    if (json) putchar('}');
}
const char *cli_format_float(float v, char *buf, int cap) { return shortest(v, true, buf, cap); }

/* See cli.h. */
FILE *cli_fopen_regular(const char *path, char how) {
    int flags = how == 'r' ? O_RDONLY : O_WRONLY | O_CREAT;
    if (how == 'a') flags |= O_APPEND;
    if (how == 'x') flags |= O_EXCL;
    bool reading = how == 'r';
    int fd =
        open(path, flags | (reading ? 0 : O_NOFOLLOW) | O_NONBLOCK | O_NOCTTY | O_CLOEXEC, 0644);
    if (fd < 0) return NULL;
    struct stat st;
    int e = 0;
    if (fstat(fd, &st) != 0) e = errno;
    else if (!S_ISREG(st.st_mode) || (!reading && st.st_nlink > 1)) e = EINVAL;
    else if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK) != 0) e = errno;
    else if (how == 'w' && ftruncate(fd, 0) != 0) e = errno;
    FILE *f = e ? NULL : fdopen(fd, how == 'r' ? "r" : how == 'a' ? "a" : "w");
    if (!f) {
        if (!e) e = errno;
        close(fd);
        errno = e;
    }
    return f;
}

static bool is_url(const char *path) { return strncmp(path, "s3://", 5) == 0; }

/* An s3:// URL: a checkpoint if its manifest reads, a project if it holds
 * checkpoints, else missing (errno ENOENT; the library's message says more). */
static cli_kind classify_url(const char *url) {
    ckpt_checkpoint_file *files = NULL;
    int64_t n = 0;
    int rc = ckpt_checkpoint_files(url, &files, &n);
    free(files);
    if (rc == 0) return CLI_KIND_CHECKPOINT;
    if (rc != CKPT_ENOENT && rc != CKPT_EINVAL) {
        errno = EIO;
        return CLI_KIND_MISSING;
    }
    ckpt_checkpoint_info *list = NULL;
    rc = ckpt_checkpoint_list(url, false, &list, &n);
    free(list);
    if (rc == 0 && n > 0) return CLI_KIND_PROJECT;
    errno = rc == 0 || rc == CKPT_ENOENT ? ENOENT : EIO;
    return CLI_KIND_MISSING;
}

static char fetch_root[512];
static void remove_fetched(void) {
    if (!fetch_root[0]) return;
    pid_t pid = fork();
    if (pid == 0) {
        execlp("rm", "rm", "-rf", "--", fetch_root, (char *)NULL);
        _exit(127);
    }
    int st;
    if (pid > 0) waitpid(pid, &st, 0);
}

int cli_local_copy(const char *cmd, const char *url, char *out, size_t cap) {
    if (!fetch_root[0]) {
        const char *tmp = getenv("TMPDIR");
        snprintf(fetch_root, sizeof fetch_root, "%s/ckpt-fetch-XXXXXX", tmp && *tmp ? tmp : "/tmp");
        if (!mkdtemp(fetch_root)) {
            cli_error("%s: %s: %s", cmd, fetch_root, strerror(errno));
            fetch_root[0] = '\0';
            return CLI_RUNTIME;
        }
        atexit(remove_fetched);
    }
    static int seq;
    const char *base = strrchr(url, '/');
    snprintf(out, cap, "%s/%d/%s", fetch_root, seq, base && base[1] ? base + 1 : "checkpoint");
    char parent[600];
    snprintf(parent, sizeof parent, "%s/%d", fetch_root, seq++);
    if (mkdir(parent, 0700) != 0) {
        cli_error("%s: %s: %s", cmd, parent, strerror(errno));
        return CLI_RUNTIME;
    }
    int rc = ckpt_checkpoint_fetch(url, out);
    if (rc < 0) {
        cli_error("%s: %s", cmd, *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return rc == CKPT_ECORRUPT ? CLI_DIFFER : CLI_RUNTIME;
    }
    return CLI_OK;
}

cli_kind cli_classify(const char *path) {
    if (is_url(path)) return classify_url(path);
    struct stat st;
    if (stat(path, &st) != 0) return CLI_KIND_MISSING;
    if (S_ISDIR(st.st_mode)) {
        char sub[PATH_MAX];
        snprintf(sub, sizeof sub, "%s/checkpoint.json", path);
        if (access(sub, F_OK) == 0) return CLI_KIND_CHECKPOINT;
        snprintf(sub, sizeof sub, "%s/checkpoints", path);
        struct stat cs;
        if (stat(sub, &cs) == 0 && S_ISDIR(cs.st_mode)) return CLI_KIND_PROJECT;
        return CLI_KIND_FOLDER;
    }
    unsigned char head[9] = {0};
    size_t got = 0;
    /* Only a regular file is looked into (a FIFO would block the read):
     * the command that opens it says what else it is. */
    int fd = S_ISREG(st.st_mode) ? open(path, O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC) : -1;
    struct stat fs;
    if (fd >= 0 && fstat(fd, &fs) == 0 && S_ISREG(fs.st_mode)) {
        ssize_t r = read(fd, head, sizeof head);
        got = r > 0 ? (size_t)r : 0;
    }
    if (fd >= 0) close(fd);
    if (got >= 4 && !memcmp(head, "PK\x03\x04", 4)) return CLI_KIND_TORCH_ZIP;
    size_t n = strlen(path);
    if (n > 12 && !strcmp(path + n - 12, ".safetensors")) return CLI_KIND_STATE_FILE;
    /* safetensors: an 8-byte little-endian header length, then '{' */
    if (got == 9 && head[8] == '{') {
        uint64_t len = 0;
        for (int i = 7; i >= 0; i--) len = len << 8 | head[i];
        if (len >= 2 && len <= (uint64_t)st.st_size - 8) return CLI_KIND_STATE_FILE;
    }
    return CLI_KIND_OTHER_FILE;
}

int cli_newest_valid(const char *cmd, const char *project, char *out, size_t cap) {
    ckpt_checkpoint_info *list = NULL;
    int64_t n = 0;
    int rc = ckpt_checkpoint_list(project, true, &list, &n);
    if (rc < 0) {
        cli_error("%s: %s", cmd, *ckpt_errmsg() ? ckpt_errmsg() : ckpt_strerror(rc));
        return CLI_RUNTIME;
    }
    int64_t best = -1;
    for (int64_t i = 0; i < n; i++)
        if (list[i].status == CKPT_CHECKPOINT_COMPLETE) best = i;
    if (best >= 0) snprintf(out, cap, "%s", list[best].path);
    free(list);
    if (best < 0) {
        cli_error("%s: project %s has no valid checkpoint (%lld checkpoint folder%s; see 'ckpt ls "
                  "%s')",
                  cmd, project, (long long)n, n == 1 ? "" : "s", project);
        return CLI_RUNTIME;
    }
    return CLI_OK;
}

int cli_wrong_kind(const char *cmd, const char *path, cli_kind kind, const char *expected) {
    switch (kind) {
    case CLI_KIND_TORCH_ZIP:
        return cli_usage_error(
            cmd,
            "%s is a PyTorch file (a zip archive, as torch.save writes), not safetensors; "
            "expected %s. 'ckpt inspect %s' shows what it holds and the 'ckpt import' command "
            "that converts it into a checkpoint; or, for a state dict of tensors, in Python: "
            "from safetensors.torch import save_file; save_file(torch.load('%s'), "
            "'out.safetensors')",
            path, expected, path, path);
    case CLI_KIND_FOLDER:
        return cli_usage_error(cmd,
                               "%s is not a checkpoint (no checkpoint.json) nor a project (no "
                               "checkpoints folder); expected %s",
                               path, expected);
    case CLI_KIND_PROJECT:
        return cli_usage_error(cmd, "%s is a project folder; expected %s (see 'ckpt ls %s')", path,
                               expected, path);
    default:
        return cli_usage_error(cmd,
                               "%s is not a checkpoint, a project or a safetensors file; "
                               "expected %s",
                               path, expected);
    }
}

const char *cli_status_name(ckpt_checkpoint_status s) {
    switch (s) {
    case CKPT_CHECKPOINT_COMPLETE: return "complete";
    case CKPT_CHECKPOINT_PARTIAL: return "partial";
    case CKPT_CHECKPOINT_CORRUPT: return "corrupt";
    }
    return "unknown";
}

/* Parses "[options] ARG" where the only options are the given flags. Returns
 * 0 with *arg set, -1 after --help, or CLI_USAGE. */
int cli_parse_simple(int argc, char **argv, const char *help, const char *flag1, bool *val1,
                     const char *flag2, bool *val2, const char **arg) {
    *arg = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            fputs(help, stdout);
            return -1;
        } else if (flag1 && !strcmp(a, flag1)) {
            *val1 = true;
        } else if (flag2 && !strcmp(a, flag2)) {
            *val2 = true;
        } else if (a[0] == '-' && a[1]) {
            return cli_usage_error(argv[0], "unknown option '%s'", a);
        } else if (*arg) {
            return cli_usage_error(argv[0], "unexpected argument '%s'", a);
        } else {
            *arg = a;
        }
    }
    if (!*arg) return cli_usage_error(argv[0], "missing argument");
    return 0;
}

/* Prints the project's leftover temporary folders (if any) after a table. */
void cli_print_leftovers(const char *project, bool json) {
    ckpt_leftover_info *lo = NULL;
    int64_t n = 0;
    if (ckpt_checkpoint_leftovers(project, &lo, &n) < 0) n = 0;
    if (json) printf(",\"leftovers\":[");
    for (int64_t i = 0; i < n; i++) {
        if (json) {
            printf("%s{\"path\":", i ? "," : "");
            cli_json_string(lo[i].path);
            printf(",\"pid\":%lld,\"running\":%s}", (long long)lo[i].pid,
                   lo[i].running ? "true" : "false");
        } else if (lo[i].running) {
            printf("in use   %s  (process %lld is running: a save in progress?)\n",
                   cli_esc(lo[i].path), (long long)lo[i].pid);
        } else {
            printf("leftover %s  (temporary folder of an interrupted save; 'ckpt prune %s --keep N'"
                   " removes it)\n",
                   cli_esc(lo[i].path), cli_esc(project));
        }
    }
    if (json) putchar(']');
    free(lo);
}
