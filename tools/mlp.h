/* mlp.h — the demo's model: a multi-layer perceptron written out by hand.
 *
 * in -> [Linear, ReLU, dropout] x 2 -> Linear -> softmax cross-entropy, fp32,
 * llm.c style: plain loops a reader can follow top to bottom. Weights are laid
 * out as PyTorch's nn.Linear lays them out ([out, in], row-major), so the
 * model.safetensors file of a checkpoint loads into torch directly.
 */
#ifndef CKPT_TOOLS_MLP_H
#define CKPT_TOOLS_MLP_H

#include <stdint.h>

#include "ckpt.h"

#define MLP_LAYERS 3

typedef struct mlp {
    int sizes[MLP_LAYERS + 1]; /* in, hidden1, hidden2, out */
    int max_batch;

    /* parameters and their gradients, one block each, in the order
     * fc1.weight fc1.bias fc2.weight fc2.bias fc3.weight fc3.bias */
    float *params;
    float *grads;
    int64_t num_params;
    float *w[MLP_LAYERS], *b[MLP_LAYERS];
    float *gw[MLP_LAYERS], *gb[MLP_LAYERS];

    /* activations of the last forward pass, kept for backward */
    const float *input;           /* [B, in], borrowed from the caller */
    float *pre[MLP_LAYERS - 1];   /* hidden pre-activations [B, h] */
    float *act[MLP_LAYERS - 1];   /* after ReLU and dropout [B, h] */
    float *mask[MLP_LAYERS - 1];  /* dropout multipliers: 0 or 1/(1-p) */
    float *probs;                 /* softmax of the logits [B, out] */
    float *dact;                  /* scratch for backward [B, max hidden] */
    float *dpre;
    int batch;                    /* B of the last forward pass */
} mlp;

/* Allocates a network of the given sizes for batches of up to max_batch.
 * Returns 0, or -1 if out of memory (the struct is then freed). */
int mlp_init(mlp *m, int in, int hidden1, int hidden2, int out, int max_batch);
void mlp_free(mlp *m);

/* PyTorch's nn.Linear initialisation: weights and biases uniform in
 * [-1/sqrt(fan_in), 1/sqrt(fan_in)], drawn from g in parameter order. */
void mlp_init_params(mlp *m, ckpt_rng *g);

/* Name, shape and storage of parameter tensor i (0 .. 2*MLP_LAYERS-1), for
 * registering them with a ckpt_model. */
const char *mlp_param_name(int i);
int mlp_param_shape(const mlp *m, int i, int64_t shape[2]); /* returns ndim */
float *mlp_param_data(mlp *m, int i);
float *mlp_param_grad(mlp *m, int i);

/* Forward pass over B rows of x ([B, in]) with labels y; returns the mean
 * cross-entropy loss. With dropout_p > 0 and a generator, dropout masks are
 * drawn from g (layer by layer, row by row); with g NULL there is no dropout
 * and g is not touched (evaluation). x is borrowed until backward. */
float mlp_forward(mlp *m, const float *x, const int32_t *y, int B, float dropout_p, ckpt_rng *g);

/* Backward pass of the last forward: adds d(loss * loss_scale)/d(param) to
 * the gradients (call zero_grad between steps, as in PyTorch). */
void mlp_backward(mlp *m, const int32_t *y, float loss_scale);

/* Class with the highest probability for each of the last forward's rows. */
void mlp_argmax(const mlp *m, int32_t *pred);

#endif
