/* cuda_memory_ops.c — ckpt_memory_ops for CUDA device memory, and a short
 * run that checkpoints parameters and AdamW state living on the GPU.
 *
 * The handle of a tensor is its device pointer; the library never
 * dereferences it, it only asks for bytes [offset, offset + n) through
 * cudaMemcpy (at most CKPT_MEMORY_PIECE bytes a call, always from the thread
 * that called the save or load, so the current device and context are the
 * caller's). Built only where CMake finds the CUDA toolkit
 * (example_cuda_memory_ops); without a CUDA device it says so and exits 0.
 *
 *   example_cuda_memory_ops [PROJECT_DIR]     (default: runs/cuda)
 */
#include <stdio.h>
#include <stdlib.h>

#include <cuda_runtime_api.h>

#include "ckpt.h"

static int cuda_status(cudaError_t e, const char *what) {
    if (e == cudaSuccess) return 0;
    return ckpt_set_error(CKPT_EIO, "%s: %s", what, cudaGetErrorString(e));
}

static int cuda_to_host(void *handle, uint64_t offset, void *dst, uint64_t n) {
    return cuda_status(
        cudaMemcpy(dst, (const char *)handle + offset, (size_t)n, cudaMemcpyDeviceToHost),
        "cudaMemcpy device to host");
}

static int cuda_from_host(void *handle, uint64_t offset, const void *src, uint64_t n) {
    return cuda_status(cudaMemcpy((char *)handle + offset, src, (size_t)n, cudaMemcpyHostToDevice),
                       "cudaMemcpy host to device");
}

/* The ops for any tensor in device memory: pass its device pointer as handle. */
static const ckpt_memory_ops cuda_memory_ops = {cuda_to_host, cuda_from_host};

#define CHECK(call)                                                                                \
    do {                                                                                           \
        if ((call) < 0) {                                                                          \
            fprintf(stderr, "cuda_memory_ops: %s\n", ckpt_errmsg());                               \
            return 1;                                                                              \
        }                                                                                          \
    } while (0)

enum { N = 1 << 20 };

int main(int argc, char **argv) {
    int ndev = 0;
    if (cudaGetDeviceCount(&ndev) != cudaSuccess || ndev == 0) {
        printf("no CUDA device: nothing to run\n");
        return 0;
    }
    /* a parameter and its two AdamW moments, all on the device */
    float *host = malloc(sizeof(float) * N);
    void *w = NULL, *m = NULL, *v = NULL;
    for (int i = 0; i < N; i++) host[i] = (float)i * 1e-6f;
    if (cudaMalloc(&w, sizeof(float) * N) || cudaMalloc(&m, sizeof(float) * N) ||
        cudaMalloc(&v, sizeof(float) * N) ||
        cudaMemcpy(w, host, sizeof(float) * N, cudaMemcpyHostToDevice) ||
        cudaMemset(m, 0, sizeof(float) * N) || cudaMemset(v, 0, sizeof(float) * N)) {
        fprintf(stderr, "cuda_memory_ops: device allocation failed\n");
        return 1;
    }
    ckpt_model *model;
    ckpt_optimizer *opt;
    ckpt_accelerator *acc;
    CHECK(ckpt_model_new(&model));
    CHECK(ckpt_model_add_param_mem(model, "w", CKPT_F32, 1, (int64_t[]){N}, &cuda_memory_ops, w));
    ckpt_optim_options oo = ckpt_optim_defaults(CKPT_OPTIM_ADAMW);
    CHECK(ckpt_optimizer_external_new(&opt, CKPT_OPTIM_ADAMW, model, &oo));
    CHECK(ckpt_optimizer_set_state_mem(opt, "w", "exp_avg", &cuda_memory_ops, m));
    CHECK(ckpt_optimizer_set_state_mem(opt, "w", "exp_avg_sq", &cuda_memory_ops, v));
    ckpt_project_config cfg = {.project_dir = argc > 1 ? argv[1] : "runs/cuda",
                               .automatic_checkpoint_naming = true,
                               .total_limit = 2};
    CHECK(ckpt_accelerator_new(&acc, &cfg));
    CHECK(ckpt_prepare_model(acc, model));
    CHECK(ckpt_prepare_optimizer(acc, opt));
    int rc = ckpt_load_state(acc, NULL);
    if (rc < 0 && rc != CKPT_ENOENT) CHECK(rc);
    printf("%s at step %lld\n", rc == 0 ? "resumed" : "started",
           (long long)ckpt_optimizer_get_step(opt));
    /* (the caller's own kernels would update w, m and v here) */
    CHECK(ckpt_optimizer_set_step(opt, ckpt_optimizer_get_step(opt) + 1));
    CHECK(ckpt_save_state(acc, NULL));
    printf("saved %s\n", ckpt_accelerator_last_dir(acc));
    ckpt_accelerator_free(acc);
    ckpt_optimizer_free(opt);
    ckpt_model_free(model);
    cudaFree(w);
    cudaFree(m);
    cudaFree(v);
    free(host);
    return 0;
}
