/* bench_gpt2.c — the project's performance targets on a GPT-2-small-sized
 * training state, through the real accelerator path, as ratios against
 * baselines measured in the same run:
 *
 *   state: GPT-2 small's 148 parameter tensors with their real shapes (fp32,
 *          124,439,808 elements) in a ckpt_model, an AdamW optimizer over it
 *          (exp_avg and exp_avg_sq per parameter, made non-zero by one step),
 *          both prepared on a ckpt_accelerator: ~1.49 GB of tensors.
 *
 *   save:  ckpt_save_state to the next automatic checkpoint (the full commit:
 *          every file fsync'd with its checksums, the manifest, the folder
 *          rename and fsyncs)  vs  dd conv=fsync of the same number of bytes,
 *          and vs torch.save + os.fsync of the same tensors (torch_baseline.py
 *          run with /usr/bin/python3). Best of 3, interleaved with dd (torch: best of 3).
 *   load:  ckpt_load_state of that checkpoint into the same objects (every
 *          checksum verified, then copied into the buffers already allocated),
 *          page cache warm  vs  cat of the checkpoint's files > /dev/null, and
 *          vs torch.load of the torch file. Split into its parts: the deep
 *          verification alone (ckpt_checkpoint_verify) and the raw read
 *          without verification (ckpt_reader_open + ckpt_read_tensor of every
 *          tensor into allocated buffers); memcpy of the same bytes is the
 *          ceiling for any load into buffers. Best of 5, interleaved (torch.load:
 *          best of 5 too). These are later loads of the accelerator that saved
 *          (transactional: two passes).
 *   resume: a new accelerator over the same objects, its first load (one pass,
 *          verified as the bytes land: docs/CHECKPOINTS.md, "One pass or two"),
 *          best of 5, against the same baselines.
 *   memory: peak RSS increase during ckpt_save_state (VmHWM reset through
 *          /proc/self/clear_refs), relative to the state size.
 *
 *   bench_gpt2 FOLDER [torch_baseline.py]
 *
 * FOLDER is a scratch folder on the disk to measure; everything written
 * there is removed at the end. Without the script path (or without
 * /usr/bin/python3 and torch) the torch columns are skipped. */
#include <dirent.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "ckpt.h"
#define BENCH_NAME "bench_gpt2"
#include "bench_util.h"
#include "gpt2.h"

static void sync_all(void) {
    if (system("sync") != 0) {
        fprintf(stderr, "bench_gpt2: sync failed\n");
        exit(1);
    }
}

static double run_shell(const char *cmd) {
    sync_all();
    double t0 = now();
    int rc = system(cmd);
    double t = now() - t0;
    if (rc != 0) {
        fprintf(stderr, "bench_gpt2: command failed: %s\n", cmd);
        exit(1);
    }
    return t;
}

static void *xmalloc(size_t n) {
    void *p = malloc(n ? n : 1);
    if (!p) {
        fprintf(stderr, "bench_gpt2: out of memory (%zu bytes)\n", n);
        exit(1);
    }
    return p;
}

/* ---- GPT-2 small: names and shapes (HF transformers' names) ---- */

typedef struct {
    char name[64];
    int ndim;
    int64_t shape[2];
    int64_t numel;
    float *data, *grad;
} param;

static int np_ = 0;
static param P[MAXP];

static void add(const char *name, int ndim, int64_t a, int64_t b) {
    param *p = &P[np_++];
    snprintf(p->name, sizeof p->name, "%s", name);
    p->ndim = ndim;
    p->shape[0] = a;
    p->shape[1] = b;
    p->numel = ndim == 1 ? a : a * b;
}

static void gpt2_small(void) { gpt2_small_each(add); }

/* ---- memory: /proc/self/status ---- */

/* Resets VmHWM to the current RSS (Linux >= 4.0). */
static int reset_hwm(void) {
    int fd = open("/proc/self/clear_refs", O_WRONLY);
    if (fd < 0) return -1;
    int ok = write(fd, "5", 1) == 1;
    close(fd);
    return ok ? 0 : -1;
}

/* ---- checkpoint files ---- */

/* The checkpoint's files (names malloc'd), and their total size. */
static int list_files(const char *dir, char ***names, uint64_t *total) {
    DIR *d = opendir(dir);
    if (!d) {
        perror(dir);
        exit(1);
    }
    struct dirent *e;
    int n = 0;
    *names = xmalloc(64 * sizeof **names);
    *total = 0;
    while ((e = readdir(d)) != NULL) {
        if (e->d_name[0] == '.') continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0 || !S_ISREG(st.st_mode) || n == 64) continue;
        (*names)[n++] = strdup(e->d_name);
        *total += (uint64_t)st.st_size;
    }
    closedir(d);
    return n;
}

static int is_safetensors(const char *name) {
    size_t n = strlen(name);
    return n > 12 && strcmp(name + n - 12, ".safetensors") == 0;
}

/* The raw read: every tensor of every state file into the arena, no
 * checksum verification. Returns the bytes read. */
static uint64_t raw_read(const char *dir, char **names, int nf, uint8_t *arena, uint64_t cap) {
    uint64_t at = 0;
    for (int f = 0; f < nf; f++) {
        if (!is_safetensors(names[f])) continue;
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, names[f]);
        ckpt_reader *r;
        if (ckpt_reader_open(&r, path)) die("reader_open");
        for (int64_t i = 0, n = ckpt_reader_count(r); i < n; i++) {
            ckpt_entry_info info;
            if (ckpt_reader_entry(r, i, &info)) die("reader_entry");
            if (info.kind != CKPT_ENTRY_TENSOR) continue;
            if (at + info.nbytes > cap) {
                fprintf(stderr, "bench_gpt2: arena too small\n");
                exit(1);
            }
            if (ckpt_read_tensor(r, info.key, info.dtype, info.ndim, info.shape, arena + at))
                die("read_tensor");
            at += info.nbytes;
        }
        ckpt_reader_free(r);
    }
    return at;
}

/* ---- torch baseline ---- */

typedef struct {
    int ok;
    char version[128];
    char load_all[128];
    double bytes, save_s, load_s;
} torch_result;

static torch_result run_torch(const char *script, const char *dir) {
    torch_result t;
    memset(&t, 0, sizeof t);
    if (!script || access("/usr/bin/python3", X_OK) != 0) return t;
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "/usr/bin/python3 '%s' '%s'", script, dir);
    sync_all();
    FILE *p = popen(cmd, "r");
    if (!p) return t;
    char line[256];
    int got = 0;
    while (fgets(line, sizeof line, p)) {
        char key[64], val[128];
        if (sscanf(line, "%63s %127s", key, val) != 2) continue;
        if (strcmp(key, "torch_version") == 0) snprintf(t.version, sizeof t.version, "%s", val), got++;
        else if (strcmp(key, "bytes") == 0) t.bytes = atof(val), got++;
        else if (strcmp(key, "save_s") == 0) t.save_s = atof(val), got++;
        else if (strcmp(key, "load_s") == 0) t.load_s = atof(val), got++;
        else if (strcmp(key, "load_all") == 0) snprintf(t.load_all, sizeof t.load_all, "%s", val);
    }
    t.ok = pclose(p) == 0 && got == 4;
    if (!t.ok) fprintf(stderr, "bench_gpt2: the torch baseline failed; its columns are skipped\n");
    return t;
}

/* A cheap fingerprint of every parameter (for the round-trip check). */
static uint64_t fingerprint(void) {
    uint64_t h = 1469598103934665603ULL;
    for (int i = 0; i < np_; i++) {
        const uint32_t *w = (const uint32_t *)P[i].data;
        for (int64_t k = 0; k < P[i].numel; k += 61) h = (h ^ w[k]) * 1099511628211ULL;
        h = (h ^ w[P[i].numel - 1]) * 1099511628211ULL;
    }
    return h;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: bench_gpt2 FOLDER [torch_baseline.py]\n");
        return 2;
    }
    const char *dir = argv[1];
    const char *script = argc > 2 ? argv[2] : NULL;
    char proj[4096], cmd[16384], ddpath[4096];
    snprintf(proj, sizeof proj, "%s/gpt2_project", dir);
    snprintf(ddpath, sizeof ddpath, "%s/gpt2_dd.bin", dir);

    /* ---- the state ---- */
    gpt2_small();
    ckpt_model *model;
    if (ckpt_model_new(&model)) die("model_new");
    int64_t numel = 0;
    for (int i = 0; i < np_; i++) {
        param *p = &P[i];
        p->data = xmalloc((size_t)p->numel * sizeof(float));
        p->grad = xmalloc((size_t)p->numel * sizeof(float));
        for (int64_t k = 0; k < p->numel; k++) {
            p->data[k] = (float)(k % 997) * 1e-3f - 0.5f + (float)i * 1e-4f;
            p->grad[k] = (float)(k % 773) * 1e-4f - 0.03f;
        }
        numel += p->numel;
        if (ckpt_model_add_param(model, p->name, CKPT_F32, p->ndim, p->shape, p->data, p->grad))
            die("add_param");
    }
    if (numel != GPT2_SMALL_PARAMS) {
        fprintf(stderr, "bench_gpt2: %lld parameters, expected 124439808\n", (long long)numel);
        return 1;
    }
    ckpt_optimizer *opt;
    if (ckpt_adamw_new(&opt, model, 1e-3, 0.9, 0.999, 1e-8, 0.01)) die("adamw_new");
    /* One step: the moments become non-zero and every page of them is touched. */
    if (ckpt_optimizer_step(opt)) die("step");
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (ckpt_prepare_model(acc, model) || ckpt_prepare_optimizer(acc, opt)) die("prepare");
    if (ckpt_set_seed(acc, 42)) die("seed");
    ckpt_accelerator_set_step(acc, 1);
    double state_bytes = (double)numel * 4.0 * 3.0;

    /* ---- save: ckpt_save_state vs dd conv=fsync, best of 2, interleaved ---- */
    double t_save = 1e30, t_dd = 1e30;
    long rss_before = 0, hwm_after = 0;
    int hwm_ok = 0;
    uint64_t ck_bytes = 0;
    char ckdir[4096] = "";
    char **names = NULL;
    int nf = 0;
    for (int rep = 0; rep < 3; rep++) {
        if (ckdir[0]) { /* the previous checkpoint, outside the timing */
            snprintf(cmd, sizeof cmd, "rm -rf '%s'", ckdir);
            if (system(cmd) != 0) return 1;
        }
        sync_all();
        hwm_ok = reset_hwm() == 0;
        rss_before = status_kib("VmRSS");
        double t0 = now();
        if (ckpt_save_state(acc, NULL)) die("save_state");
        double t = now() - t0;
        hwm_after = status_kib("VmHWM");
        if (t < t_save) t_save = t;
        snprintf(ckdir, sizeof ckdir, "%s", ckpt_accelerator_last_dir(acc));
        if (!names) nf = list_files(ckdir, &names, &ck_bytes);

        snprintf(cmd, sizeof cmd,
                 "dd if=/dev/zero of='%s' bs=1M count=%llu iflag=count_bytes conv=fsync status=none",
                 ddpath, (unsigned long long)ck_bytes);
        unlink(ddpath);
        t = run_shell(cmd);
        unlink(ddpath);
        if (t < t_dd) t_dd = t;
    }
    double gb = (double)ck_bytes / 1e9;

    /* ---- torch: save + fsync, then load (its own file, removed after) ---- */
    torch_result tr = run_torch(script, dir);

    /* ---- load, page cache warm: best of 5, interleaved ---- */
    uint64_t fp = fingerprint();
    snprintf(cmd, sizeof cmd, "cd '%s' && cat", ckdir);
    for (int f = 0; f < nf; f++) {
        size_t used = strlen(cmd);
        snprintf(cmd + used, sizeof cmd - used, " '%s'", names[f]);
    }
    {
        size_t used = strlen(cmd);
        snprintf(cmd + used, sizeof cmd - used, " > /dev/null");
    }
    if (system(cmd) != 0) return 1; /* warm the page cache once */
    uint64_t arena_cap = ck_bytes;
    uint8_t *arena = xmalloc((size_t)arena_cap);
    memset(arena, 0xa5, (size_t)arena_cap); /* touched: no first-touch faults billed to the read */
    uint8_t *arena2 = xmalloc((size_t)arena_cap);
    memset(arena2, 0x5a, (size_t)arena_cap);
    double t_cat = 1e30, t_load = 1e30, t_verify = 1e30, t_raw = 1e30, t_memcpy = 1e30;
    uint64_t raw_bytes = 0;
    char load_runs[128] = "";
    for (int rep = 0; rep < 5; rep++) {
        double t = run_shell(cmd);
        if (t < t_cat) t_cat = t;

        P[0].data[0] += 1.0f; /* the load must put it back */
        double t0 = now();
        if (ckpt_load_state(acc, NULL)) die("load_state");
        t = now() - t0;
        if (t < t_load) t_load = t;
        {
            size_t used = strlen(load_runs);
            snprintf(load_runs + used, sizeof load_runs - used, "%s%.3f", rep ? "," : "", t);
        }
        if (fingerprint() != fp) {
            fprintf(stderr, "bench_gpt2: the load did not restore the parameters\n");
            return 1;
        }

        ckpt_checkpoint_info info;
        t0 = now();
        if (ckpt_checkpoint_verify(ckdir, true, &info)) die("verify");
        t = now() - t0;
        if (t < t_verify) t_verify = t;

        t0 = now();
        raw_bytes = raw_read(ckdir, names, nf, arena, arena_cap);
        t = now() - t0;
        if (t < t_raw) t_raw = t;

        t0 = now();
        memcpy(arena2, arena, (size_t)raw_bytes);
        t = now() - t0;
        if (t < t_memcpy) t_memcpy = t;
    }
    if (memcmp(arena2, arena, (size_t)raw_bytes) != 0) return 1;

    /* ---- the resume: a new accelerator's first load (one pass), best of 5 ---- */
    if (acc) ckpt_accelerator_free(acc); /* it owns the project; a resumed run takes it over */
    acc = NULL;
    double t_resume = 1e30;
    char resume_runs[128] = "";
    for (int rep = 0; rep < 5; rep++) {
        ckpt_accelerator *ra;
        if (ckpt_accelerator_new(&ra, &cfg)) die("accelerator_new");
        if (ckpt_prepare_model(ra, model) || ckpt_prepare_optimizer(ra, opt)) die("prepare");
        P[0].data[0] += 1.0f; /* the load must put it back */
        double t0 = now();
        if (ckpt_load_state(ra, NULL)) die("resume");
        double t = now() - t0;
        if (t < t_resume) t_resume = t;
        size_t used = strlen(resume_runs);
        snprintf(resume_runs + used, sizeof resume_runs - used, "%s%.3f", rep ? "," : "", t);
        if (fingerprint() != fp) {
            fprintf(stderr, "bench_gpt2: the resume did not restore the parameters\n");
            return 1;
        }
        ckpt_accelerator_free(ra);
    }

    /* ---- clean up the multi-GB files ---- */
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", proj);
    if (system(cmd) != 0) return 1;
    unlink(ddpath);

    /* ---- report ---- */
    double rawgb = (double)raw_bytes / 1e9;
    printf("bench_gpt2: GPT-2 small, %d tensors, %lld params, AdamW: checkpoint %.3f GB in %d files, "
           "folder %s\n",
           np_, (long long)numel, gb, nf, dir);
    printf("  save  ckpt_save_state (durable)      %7.3f s  %6.2f GB/s\n", t_save, gb / t_save);
    printf("        dd conv=fsync, same bytes      %7.3f s  %6.2f GB/s\n", t_dd, gb / t_dd);
    if (tr.ok)
        printf("        torch.save + fsync             %7.3f s  %6.2f GB/s  (%.3f GB file, torch %s)\n",
               tr.save_s, tr.bytes / 1e9 / tr.save_s, tr.bytes / 1e9, tr.version);
    printf("  load  ckpt_load_state (verified)     %7.3f s  %6.2f GB/s  (runs: %s s)\n", t_load,
           gb / t_load, load_runs);
    printf("        resume: first load, one pass   %7.3f s  %6.2f GB/s  (runs: %s s)\n", t_resume,
           gb / t_resume, resume_runs);
    printf("          its verify pass alone        %7.3f s  %6.2f GB/s  (ckpt_checkpoint_verify deep)\n",
           t_verify, gb / t_verify);
    printf("        raw read, no verification      %7.3f s  %6.2f GB/s  (reader_open + read_tensor)\n",
           t_raw, rawgb / t_raw);
    printf("        cat files > /dev/null          %7.3f s  %6.2f GB/s\n", t_cat, gb / t_cat);
    printf("        memcpy of the same bytes       %7.3f s  %6.2f GB/s\n", t_memcpy, rawgb / t_memcpy);
    if (tr.ok)
        printf("        torch.load                     %7.3f s  %6.2f GB/s  (runs: %s s)\n", tr.load_s,
               tr.bytes / 1e9 / tr.load_s, tr.load_all);
    printf("  ratios (throughput of ckpt / baseline; same tensors for torch: time ratio)\n");
    printf("    save / dd conv=fsync                %5.2fx  (target >= 0.9)  %s\n", t_dd / t_save,
           t_dd / t_save >= 0.9 ? "met" : "NOT met");
    if (tr.ok)
        printf("    save / torch.save+fsync             %5.2fx  (target > 1)     %s\n",
               tr.save_s / t_save, tr.save_s / t_save > 1.0 ? "met" : "NOT met");
    else
        printf("    save / torch.save+fsync             skipped (no /usr/bin/python3 with torch)\n");
    printf("    load_state / cat                    %5.2fx  (target >= 0.8)  %s\n", t_cat / t_load,
           t_cat / t_load >= 0.8 ? "met" : "NOT met");
    printf("    resume / cat                        %5.2fx  (target >= 0.8)  %s\n",
           t_cat / t_resume, t_cat / t_resume >= 0.8 ? "met" : "NOT met");
    printf("    resume / raw read                   %5.2fx  (the same reads, verified)\n",
           t_raw / t_resume);
    printf("    raw read / cat                      %5.2fx  (no verification)\n",
           (rawgb / t_raw) / (gb / t_cat));
    printf("    raw read / memcpy                   %5.2fx  (memory-bandwidth ceiling)\n",
           t_memcpy / t_raw);
    if (tr.ok) {
        printf("    load_state / torch.load             %5.2fx  (target >= 3)    %s\n",
               tr.load_s / t_load, tr.load_s / t_load >= 3.0 ? "met" : "NOT met");
        printf("    resume / torch.load                 %5.2fx  (target >= 3)    %s\n",
               tr.load_s / t_resume, tr.load_s / t_resume >= 3.0 ? "met" : "NOT met");
        printf("    raw read / torch.load               %5.2fx\n", tr.load_s / t_raw);
    } else {
        printf("    load_state / torch.load             skipped\n");
    }
    if (hwm_ok && rss_before > 0 && hwm_after > 0) {
        double inc = (double)(hwm_after - rss_before) * 1024.0;
        printf("    save peak RSS increase              %.2f MiB = %.4f%% of the %.2f GB state "
               "(target O(1))\n",
               inc / 1048576.0, 100.0 * inc / state_bytes, state_bytes / 1e9);
    } else {
        printf("    save peak RSS increase              unavailable (/proc/self/clear_refs)\n");
    }

    if (acc) ckpt_accelerator_free(acc);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    for (int i = 0; i < np_; i++) {
        free(P[i].data);
        free(P[i].grad);
    }
    for (int f = 0; f < nf; f++) free(names[f]);
    free(names);
    free(arena);
    free(arena2);
    return 0;
}
