/* mlp.c — forward and backward of the demo's MLP, written out plainly. */
#include "mlp.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static const char *const param_names[2 * MLP_LAYERS] = {
    "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias", "fc3.weight", "fc3.bias",
};

void mlp_free(mlp *m) {
    if (!m) return;
    free(m->params);
    free(m->grads);
    for (int l = 0; l < MLP_LAYERS - 1; l++) {
        free(m->pre[l]);
        free(m->act[l]);
        free(m->mask[l]);
    }
    free(m->probs);
    free(m->dact);
    free(m->dpre);
    memset(m, 0, sizeof *m);
}

int mlp_init(mlp *m, int in, int hidden1, int hidden2, int out, int max_batch) {
    memset(m, 0, sizeof *m);
    m->sizes[0] = in;
    m->sizes[1] = hidden1;
    m->sizes[2] = hidden2;
    m->sizes[3] = out;
    m->max_batch = max_batch;

    int64_t n = 0;
    for (int l = 0; l < MLP_LAYERS; l++) n += (int64_t)m->sizes[l + 1] * (m->sizes[l] + 1);
    m->num_params = n;
    m->params = calloc((size_t)n, sizeof(float));
    m->grads = calloc((size_t)n, sizeof(float));
    int widest = hidden1 > hidden2 ? hidden1 : hidden2;
    if (out > widest) widest = out;
    if (in > widest) widest = in;
    bool ok = m->params && m->grads;
    for (int l = 0; l < MLP_LAYERS - 1; l++) {
        size_t h = (size_t)max_batch * (size_t)m->sizes[l + 1];
        m->pre[l] = malloc(h * sizeof(float));
        m->act[l] = malloc(h * sizeof(float));
        m->mask[l] = malloc(h * sizeof(float));
        ok = ok && m->pre[l] && m->act[l] && m->mask[l];
    }
    m->probs = malloc((size_t)max_batch * (size_t)out * sizeof(float));
    m->dact = malloc((size_t)max_batch * (size_t)widest * sizeof(float));
    m->dpre = malloc((size_t)max_batch * (size_t)widest * sizeof(float));
    ok = ok && m->probs && m->dact && m->dpre;
    if (!ok) {
        mlp_free(m);
        return -1;
    }

    float *p = m->params, *g = m->grads;
    for (int l = 0; l < MLP_LAYERS; l++) {
        size_t nw = (size_t)m->sizes[l + 1] * (size_t)m->sizes[l];
        m->w[l] = p;
        m->gw[l] = g;
        p += nw;
        g += nw;
        m->b[l] = p;
        m->gb[l] = g;
        p += m->sizes[l + 1];
        g += m->sizes[l + 1];
    }
    return 0;
}

void mlp_init_params(mlp *m, ckpt_rng *g) {
    for (int l = 0; l < MLP_LAYERS; l++) {
        float bound = 1.0f / sqrtf((float)m->sizes[l]);
        size_t nw = (size_t)m->sizes[l + 1] * (size_t)m->sizes[l];
        for (size_t i = 0; i < nw; i++)
            m->w[l][i] = (2.0f * ckpt_rng_uniform_f32(g) - 1.0f) * bound;
        for (int i = 0; i < m->sizes[l + 1]; i++)
            m->b[l][i] = (2.0f * ckpt_rng_uniform_f32(g) - 1.0f) * bound;
    }
}

const char *mlp_param_name(int i) {
    return (i >= 0 && i < 2 * MLP_LAYERS) ? param_names[i] : NULL;
}

int mlp_param_shape(const mlp *m, int i, int64_t shape[2]) {
    int l = i / 2;
    if (i % 2 == 0) {
        shape[0] = m->sizes[l + 1];
        shape[1] = m->sizes[l];
        return 2;
    }
    shape[0] = m->sizes[l + 1];
    return 1;
}

float *mlp_param_data(mlp *m, int i) {
    return i % 2 == 0 ? m->w[i / 2] : m->b[i / 2];
}

float *mlp_param_grad(mlp *m, int i) {
    return i % 2 == 0 ? m->gw[i / 2] : m->gb[i / 2];
}

/* out[b, o] = bias[o] + sum_i in[b, i] * w[o, i] */
static void linear_forward(float *out, const float *in, const float *w, const float *bias, int B,
                           int nin, int nout) {
    for (int b = 0; b < B; b++) {
        const float *x = in + (size_t)b * nin;
        for (int o = 0; o < nout; o++) {
            const float *wrow = w + (size_t)o * nin;
            float s = bias[o];
            for (int i = 0; i < nin; i++) s += x[i] * wrow[i];
            out[(size_t)b * nout + o] = s;
        }
    }
}

/* Given dout = dL/dout, adds dL/dw and dL/dbias, and sets din = dL/din
 * (din may be NULL for the input layer). */
static void linear_backward(float *din, float *dw, float *dbias, const float *dout, const float *in,
                            const float *w, int B, int nin, int nout) {
    for (int b = 0; b < B; b++) {
        const float *d = dout + (size_t)b * nout;
        const float *x = in + (size_t)b * nin;
        for (int o = 0; o < nout; o++) {
            float *dwrow = dw + (size_t)o * nin;
            for (int i = 0; i < nin; i++) dwrow[i] += d[o] * x[i];
            dbias[o] += d[o];
        }
        if (din) {
            float *dx = din + (size_t)b * nin;
            for (int i = 0; i < nin; i++) dx[i] = 0.0f;
            for (int o = 0; o < nout; o++) {
                const float *wrow = w + (size_t)o * nin;
                for (int i = 0; i < nin; i++) dx[i] += d[o] * wrow[i];
            }
        }
    }
}

float mlp_forward(mlp *m, const float *x, const int32_t *y, int B, float dropout_p, ckpt_rng *g) {
    m->input = x;
    m->batch = B;
    const float *in = x;
    /* inverted dropout: kept units are scaled so evaluation needs no rescale */
    bool dropout = g && dropout_p > 0.0f;
    float keep_scale = dropout ? 1.0f / (1.0f - dropout_p) : 1.0f;
    for (int l = 0; l < MLP_LAYERS - 1; l++) {
        int nin = m->sizes[l], nout = m->sizes[l + 1];
        size_t n = (size_t)B * (size_t)nout;
        linear_forward(m->pre[l], in, m->w[l], m->b[l], B, nin, nout);
        for (size_t i = 0; i < n; i++) {
            float mk = 1.0f;
            if (dropout) mk = ckpt_rng_uniform_f32(g) < dropout_p ? 0.0f : keep_scale;
            m->mask[l][i] = mk;
            float r = m->pre[l][i] > 0.0f ? m->pre[l][i] : 0.0f;
            m->act[l][i] = r * mk;
        }
        in = m->act[l];
    }

    int nin = m->sizes[MLP_LAYERS - 1], nout = m->sizes[MLP_LAYERS];
    float *logits = m->probs; /* softmax is computed in place */
    linear_forward(logits, in, m->w[MLP_LAYERS - 1], m->b[MLP_LAYERS - 1], B, nin, nout);
    double loss = 0.0;
    for (int b = 0; b < B; b++) {
        float *z = logits + (size_t)b * nout;
        float zmax = z[0];
        for (int o = 1; o < nout; o++) zmax = z[o] > zmax ? z[o] : zmax;
        double sum = 0.0;
        for (int o = 0; o < nout; o++) sum += exp((double)(z[o] - zmax));
        double logsum = log(sum);
        /* -log softmax(z)[y] = logsumexp(z) - z[y] */
        if (y) loss += logsum - (double)(z[y[b]] - zmax);
        for (int o = 0; o < nout; o++) z[o] = (float)exp((double)(z[o] - zmax) - logsum);
    }
    return (float)(loss / B);
}

void mlp_backward(mlp *m, const int32_t *y, float loss_scale) {
    int B = m->batch;
    int L = MLP_LAYERS - 1;
    int nout = m->sizes[MLP_LAYERS];
    /* d(mean loss)/dlogits = (softmax - onehot) / B, times the loss scale */
    float *dz = m->dpre;
    float k = loss_scale / (float)B;
    for (int b = 0; b < B; b++) {
        for (int o = 0; o < nout; o++) {
            float t = (o == y[b]) ? 1.0f : 0.0f;
            dz[(size_t)b * nout + o] = (m->probs[(size_t)b * nout + o] - t) * k;
        }
    }
    for (int l = L; l >= 0; l--) {
        const float *in = l == 0 ? m->input : m->act[l - 1];
        float *din = l == 0 ? NULL : m->dact;
        linear_backward(din, m->gw[l], m->gb[l], m->dpre, in, m->w[l], B, m->sizes[l],
                        m->sizes[l + 1]);
        if (l == 0) break;
        /* through dropout and ReLU of hidden layer l-1 */
        size_t n = (size_t)B * (size_t)m->sizes[l];
        for (size_t i = 0; i < n; i++)
            m->dpre[i] = m->pre[l - 1][i] > 0.0f ? m->dact[i] * m->mask[l - 1][i] : 0.0f;
    }
}

void mlp_argmax(const mlp *m, int32_t *pred) {
    int nout = m->sizes[MLP_LAYERS];
    for (int b = 0; b < m->batch; b++) {
        const float *p = m->probs + (size_t)b * nout;
        int best = 0;
        for (int o = 1; o < nout; o++)
            if (p[o] > p[best]) best = o;
        pred[b] = best;
    }
}
