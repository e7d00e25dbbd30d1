/* bench_adamw — one AdamW step over N fp32 parameters (default 10^8: 400 MB
 * each for parameters, gradients and the two moments) through the library,
 * against a plain C loop doing the same arithmetic over its own buffers, in
 * the same run. Prints the ratio of step times (library / plain loop; lower
 * is better, 1.0 = as fast as the hand-written loop).
 *
 * Usage: bench_adamw [N] [steps] */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "ckpt.h"

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static float *alloc_floats(size_t n) {
    float *p = aligned_alloc(64, ((n * sizeof(float) + 63) / 64) * 64);
    if (!p) {
        fprintf(stderr, "bench_adamw: out of memory (%zu floats)\n", n);
        exit(1);
    }
    return p;
}

/* The baseline: PyTorch's AdamW step written the obvious way, with the
 * scalars hoisted and restrict pointers, as a careful user would. */
static void plain_adamw(float *restrict p, const float *restrict g, float *restrict m,
                        float *restrict v, size_t n, double lr, double b1, double b2, double eps,
                        double wd, int step) {
    const float decay = (float)(1.0 - lr * wd);
    const float fb1 = (float)b1, fb2 = (float)b2;
    const float omb1 = (float)(1.0 - b1), omb2 = (float)(1.0 - b2);
    const float bc2_sqrt = (float)sqrt(1.0 - pow(b2, step));
    const float neg_step = (float)-(lr / (1.0 - pow(b1, step)));
    const float feps = (float)eps;
    for (size_t i = 0; i < n; i++) {
        float gi = g[i];
        float mi = m[i] * fb1 + omb1 * gi;
        float vi = v[i] * fb2 + omb2 * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] = p[i] * decay + neg_step * mi / (sqrtf(vi) / bc2_sqrt + feps);
    }
}

int main(int argc, char **argv) {
    size_t n = argc > 1 ? (size_t)strtoull(argv[1], NULL, 10) : 100000000u;
    int steps = argc > 2 ? atoi(argv[2]) : 3;
    if (n == 0 || steps < 1) {
        fprintf(stderr, "usage: bench_adamw [N] [steps]\n");
        return 2;
    }
    const double lr = 1e-3, b1 = 0.9, b2 = 0.999, eps = 1e-8, wd = 0.01;
    float *p = alloc_floats(n), *g = alloc_floats(n);
    float *p2 = alloc_floats(n), *m2 = alloc_floats(n), *v2 = alloc_floats(n);
    for (size_t i = 0; i < n; i++) {
        p[i] = p2[i] = (float)((double)(i % 1000) * 1e-3 - 0.5);
        g[i] = (float)((double)(i % 777) * 1e-3 - 0.3);
        m2[i] = v2[i] = 0.0f;
    }
    ckpt_model *model;
    ckpt_optimizer *opt;
    int64_t shape[1] = {(int64_t)n};
    if (ckpt_model_new(&model) < 0 ||
        ckpt_model_add_param(model, "w", CKPT_F32, 1, shape, p, g) < 0 ||
        ckpt_adamw_new(&opt, model, lr, b1, b2, eps, wd) < 0) {
        fprintf(stderr, "bench_adamw: %s\n", ckpt_errmsg());
        return 1;
    }
    /* One untimed step each touches every page of the state. */
    if (ckpt_optimizer_step(opt) < 0) {
        fprintf(stderr, "bench_adamw: %s\n", ckpt_errmsg());
        return 1;
    }
    plain_adamw(p2, g, m2, v2, n, lr, b1, b2, eps, wd, 1);
    /* The two compute the same thing (up to fused multiply-adds). */
    double worst = 0;
    for (size_t i = 0; i < n; i += n / 1000 + 1) {
        double d = fabs((double)p[i] - (double)p2[i]) / fmax(fabs((double)p2[i]), 1e-3);
        worst = d > worst ? d : worst;
    }
    if (worst > 1e-5) {
        fprintf(stderr, "bench_adamw: results differ (relative %g)\n", worst);
        return 1;
    }
    double best_lib = 1e30, best_plain = 1e30;
    for (int s = 2; s < 2 + steps; s++) {
        double t0 = now();
        if (ckpt_optimizer_step(opt) < 0) return 1;
        double t1 = now();
        plain_adamw(p2, g, m2, v2, n, lr, b1, b2, eps, wd, s);
        double t2 = now();
        best_lib = fmin(best_lib, t1 - t0);
        best_plain = fmin(best_plain, t2 - t1);
    }
    double gb = 7.0 * (double)n * sizeof(float) / 1e9; /* read p,g,m,v; write p,m,v */
    printf("bench_adamw: %zu params, best of %d steps: library %.1f GB/s, plain loop %.1f GB/s\n",
           n, steps, gb / best_lib, gb / best_plain);
    printf("bench_adamw: ratio library/plain step time = %.2f (lower is better)\n",
           best_lib / best_plain);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    free(p);
    free(g);
    free(p2);
    free(m2);
    free(v2);
    return 0;
}
