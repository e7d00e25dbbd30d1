/* bench_s3.c — a GPT-2-small-sized training state saved to and loaded from
 * a project in object storage, against curl moving the same bytes to and
 * from the same server, in the same run:
 *
 *   state: GPT-2 small's 148 fp32 tensors (124,439,808 values) in a
 *          ckpt_model with AdamW (moments made non-zero by one step): ~1.49 GB.
 *   save:  ckpt_save_state to project_dir s3://<bucket>/gpt2 (each file
 *          streamed into its multipart upload as it is written, parts in
 *          parallel, manifest last; an optimizer step before each save, so
 *          that every file changes and is uploaded, none copied
 *          server-side)  vs  curl --aws-sigv4 -T of one file of the
 *          checkpoint's size (one PUT: curl has no multipart).
 *   load:  ckpt_load_state (parallel ranged GETs straight into the load's
 *          buffers, hashed as they arrive, then applied)  vs  curl GET of
 *          that file to /dev/null.
 *   Best of N (default 3), interleaved.
 *
 * Then the cost in requests, counted by the test proxy (its /__proxy/stats,
 * reset before each operation): of a GPT-2 save and load, and of the saves
 * of a small state (a model of 2 tensors, AdamW, the RNG, one custom
 * object: 4 files and the manifest, each below one part) to a project with
 * total_limit 3: the first save, a steady-state one (rotation included),
 * one whose files are all unchanged (server-side copies), and a load.
 *
 *   bench_s3 SCRATCH_DIR BUCKET [N]
 *
 * The server and credentials come from the AWS_* environment (bench/run
 * starts the tests' loopback server, tests/s3/server.js, for it). */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"
#define BENCH_NAME "bench_s3"
#include "bench_util.h"
#include "gpt2.h"

static double run_shell(const char *cmd) {
    double t0 = now();
    if (system(cmd) != 0) {
        fprintf(stderr, "bench_s3: command failed: %s\n", cmd);
        exit(1);
    }
    return now() - t0;
}

/* The test proxy's request counters (req_<kind>), reset first when reset
 * is set; "" when the endpoint is no test proxy. */
static void proxy_requests(bool reset, char *out, size_t cap) {
    const char *ep = getenv("AWS_ENDPOINT_URL");
    char cmd[1024], buf[4096];
    snprintf(cmd, sizeof cmd, "curl -sf %s '%s/__proxy/%s'", reset ? "-X POST" : "", ep,
             reset ? "reset" : "stats");
    out[0] = '\0';
    FILE *f = popen(cmd, "r");
    if (!f) return;
    size_t n = fread(buf, 1, sizeof buf - 1, f);
    buf[n] = '\0';
    if (pclose(f) != 0 || reset) return;
    size_t len = 0;
    long total = 0;
    for (const char *p = strstr(buf, "\"req_"); p; p = strstr(p, "\"req_")) {
        p += 5;
        const char *q = strchr(p, '"');
        if (!q || q[1] != ':') break;
        long v = strtol(q + 2, NULL, 10);
        total += v;
        if (len < cap)
            len += (size_t)snprintf(out + len, cap - len, "%s%.*s %ld", len ? ", " : "",
                                    (int)(q - p), p, v);
        p = q;
    }
    if (len < cap) snprintf(out + len, cap - len, " (%ld requests)", total);
}

static void die_if(int rc, const char *what) {
    if (rc) die(what);
}

/* The small state's requests per operation. */
static void small_state_requests(const char *bucket) {
    char out[1024];
    static float w[64 * 64], gw[64 * 64], b[64], gb[64];
    for (int i = 0; i < 64 * 64; i++) gw[i] = (float)(i % 7) * 1e-3f;
    for (int i = 0; i < 64; i++) gb[i] = 1e-3f;
    ckpt_model *m;
    ckpt_optimizer *o;
    int64_t sw[2] = {64, 64}, sb[1] = {64};
    die_if(ckpt_model_new(&m), "model_new");
    die_if(ckpt_model_add_param(m, "w", CKPT_F32, 2, sw, w, gw), "add_param");
    die_if(ckpt_model_add_param(m, "b", CKPT_F32, 1, sb, b, gb), "add_param");
    die_if(ckpt_adamw_new(&o, m, 1e-3, 0.9, 0.999, 1e-8, 0.01), "adamw_new");
    ckpt_rng g;
    ckpt_rng_seed(&g, 7);
    char proj[512];
    snprintf(proj, sizeof proj, "s3://%s/small", bucket);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 3;
    ckpt_accelerator *acc;
    die_if(ckpt_accelerator_new(&acc, &cfg), "accelerator_new");
    die_if(ckpt_prepare_model(acc, m) || ckpt_prepare_optimizer(acc, o), "prepare");
    die_if(ckpt_register_for_checkpointing(acc, ckpt_rng_ops(), &g), "register");
    printf(
        "bench_s3: requests of a small state's operations (4 files + manifest, total_limit 3):\n");
    for (int s = 0; s < 6; s++) {
        die_if(ckpt_optimizer_step(o), "step");
        ckpt_accelerator_set_step(acc, s + 1);
        proxy_requests(true, out, sizeof out);
        die_if(ckpt_save_state(acc, NULL), "save_state");
        proxy_requests(false, out, sizeof out);
        if (s == 0 || s == 5) printf("  %s save: %s\n", s == 0 ? "first" : "steady-state", out);
    }
    /* nothing changed: the same state saved again */
    proxy_requests(true, out, sizeof out);
    die_if(ckpt_save_state(acc, NULL), "save_state");
    proxy_requests(false, out, sizeof out);
    printf("  unchanged save: %s\n", out);
    proxy_requests(true, out, sizeof out);
    die_if(ckpt_load_state(acc, NULL), "load_state");
    proxy_requests(false, out, sizeof out);
    printf("  load: %s\n", out);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(o);
    ckpt_model_free(m);
}

static int np_ = 0;
static struct {
    char name[64];
    int ndim;
    int64_t shape[2], numel;
    float *data, *grad;
} P[MAXP];

static void add(const char *name, int ndim, int64_t a, int64_t b) {
    snprintf(P[np_].name, sizeof P[np_].name, "%s", name);
    P[np_].ndim = ndim;
    P[np_].shape[0] = a;
    P[np_].shape[1] = b;
    P[np_].numel = ndim == 1 ? a : a * b;
    np_++;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: bench_s3 SCRATCH_DIR BUCKET [N]\n");
        return 2;
    }
    const char *dir = argv[1], *bucket = argv[2];
    int reps = argc > 3 ? atoi(argv[3]) : 3;
    const char *ep = getenv("AWS_ENDPOINT_URL"), *ak = getenv("AWS_ACCESS_KEY_ID"),
               *sk = getenv("AWS_SECRET_ACCESS_KEY");
    const char *region = getenv("AWS_REGION") ? getenv("AWS_REGION") : "us-east-1";
    if (!ep || !ak || !sk) {
        fprintf(stderr,
                "bench_s3: set AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY\n");
        return 2;
    }
    gpt2_small_each(add);
    ckpt_model *model;
    if (ckpt_model_new(&model)) die("model_new");
    int64_t numel = 0;
    for (int i = 0; i < np_; i++) {
        P[i].data = malloc((size_t)P[i].numel * sizeof(float));
        P[i].grad = malloc((size_t)P[i].numel * sizeof(float));
        if (!P[i].data || !P[i].grad) die("malloc");
        for (int64_t k = 0; k < P[i].numel; k++) {
            P[i].data[k] = (float)(k % 997) * 1e-3f - 0.5f + (float)i * 1e-4f;
            P[i].grad[k] = (float)(k % 773) * 1e-4f - 0.03f;
        }
        numel += P[i].numel;
        if (ckpt_model_add_param(model, P[i].name, CKPT_F32, P[i].ndim, P[i].shape, P[i].data,
                                 P[i].grad))
            die("add_param");
    }
    ckpt_optimizer *opt;
    if (ckpt_adamw_new(&opt, model, 1e-3, 0.9, 0.999, 1e-8, 0.01)) die("adamw_new");
    if (ckpt_optimizer_step(opt)) die("step");
    char proj[512];
    snprintf(proj, sizeof proj, "s3://%s/gpt2", bucket);
    ckpt_project_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.project_dir = proj;
    cfg.automatic_checkpoint_naming = true;
    cfg.total_limit = 1;
    ckpt_accelerator *acc;
    if (ckpt_accelerator_new(&acc, &cfg)) die("accelerator_new");
    if (ckpt_prepare_model(acc, model) || ckpt_prepare_optimizer(acc, opt)) die("prepare");
    ckpt_accelerator_set_step(acc, 1);

    double t_save = 1e30, t_put = 1e30, t_load = 1e30, t_get = 1e30;
    uint64_t bytes = 0;
    char file[1024], cmd[4096], req_save[1024] = "", req_load[1024] = "";
    snprintf(file, sizeof file, "%s/bench_s3_curl.bin", dir);
    for (int r = 0; r < reps; r++) {
        if (r > 0 && ckpt_optimizer_step(opt)) die("step"); /* every file changes */
        ckpt_accelerator_set_step(acc, r + 1);
        proxy_requests(true, req_save, sizeof req_save);
        double t0 = now();
        if (ckpt_save_state(acc, NULL)) die("save_state");
        double t = now() - t0;
        if (r == reps - 1) proxy_requests(false, req_save, sizeof req_save);
        fprintf(stderr, "bench_s3: save %d: %.2f s\n", r, t);
        if (t < t_save) t_save = t;
        if (r == 0) {
            ckpt_checkpoint_info info;
            if (ckpt_checkpoint_verify(ckpt_accelerator_last_dir(acc), false, &info)) die("verify");
            bytes = info.total_bytes;
            snprintf(cmd, sizeof cmd, "head -c %llu /dev/urandom > '%s'", (unsigned long long)bytes,
                     file);
            run_shell(cmd);
        }
        snprintf(cmd, sizeof cmd,
                 "curl -sS -f --aws-sigv4 'aws:amz:%s:s3' -H 'x-amz-content-sha256: "
                 "UNSIGNED-PAYLOAD' --user '%s:%s' -T '%s' '%s/%s/curl.bin'",
                 region, ak, sk, file, ep, bucket);
        t = run_shell(cmd);
        if (t < t_put) t_put = t;
        proxy_requests(true, req_load, sizeof req_load);
        t0 = now();
        if (ckpt_load_state(acc, NULL)) die("load_state");
        t = now() - t0;
        if (r == reps - 1) proxy_requests(false, req_load, sizeof req_load);
        if (t < t_load) t_load = t;
        snprintf(cmd, sizeof cmd,
                 "curl -sS -f --aws-sigv4 'aws:amz:%s:s3' -H 'x-amz-content-sha256: "
                 "UNSIGNED-PAYLOAD' --user '%s:%s' -o /dev/null "
                 "'%s/%s/curl.bin'",
                 region, ak, sk, ep, bucket);
        t = run_shell(cmd);
        if (t < t_get) t_get = t;
    }
    remove(file);
    double gb = (double)bytes / 1e9;
    printf("bench_s3: GPT-2 small + AdamW, %.3f GB, loopback S3 (s3rver behind the test proxy), "
           "best of %d:\n",
           gb, reps);
    printf("  save %.2f s (%.2f GB/s) vs curl PUT %.2f s: %.2fx curl's time\n", t_save, gb / t_save,
           t_put, t_save / t_put);
    printf("  load %.2f s (%.2f GB/s) vs curl GET %.2f s: %.2fx curl's time\n", t_load, gb / t_load,
           t_get, t_load / t_get);
    if (*req_save)
        printf("  requests of a save: %s\n  requests of a load: %s\n", req_save, req_load);
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    small_state_requests(bucket);
    for (int i = 0; i < np_; i++) {
        free(P[i].data);
        free(P[i].grad);
    }
    return 0;
}
