/* A training pass's elementwise steps in fp32, one pass over memory each instead of several PyTorch ops (each a
 * pass of its own over activation-sized tensors). Rows are many (a pass's tokens), split over PyTorch's threads.
 * Built by bios/kernels/c_kernels.py. */
#include "vec.h"

/* The SwiGLU activation's gradient: from gate_up [rows][2n] (gate, then up; row stride ld) and grad_y [rows][n]
 * (row stride ld_grad), grad [rows][2n] (row stride ld_out): d/dgate = grad_y·up·silu'(gate), d/dup =
 * grad_y·silu(gate), with silu(g) = g·s, s = 1 / (1 + exp(-g)), silu'(g) = s·(1 + g·(1 - s)); on `threads`
 * threads. */
void bios_swiglu_backward(const float* gate_up, long ld, const float* grad_y, long ld_grad, float* grad, long ld_out,
                          int rows, int n, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    const float* gate = gate_up + r * ld;
    const float* up = gate + n;
    const float* gy = grad_y + r * ld_grad;
    float* grad_gate = grad + r * ld_out;
    float* grad_up = grad_gate + n;
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vec g = vload(gate + i), gyv = vload(gy + i);
      vec s = 1.0f / (1.0f + vexp(-g));
      vstore(grad_up + i, gyv * (g * s));
      vstore(grad_gate + i, gyv * vload(up + i) * (s * (1.0f + g * (1.0f - s))));
    }
    for (; i < n; i++) {
      float g = gate[i], s = 1.0f / (1.0f + __builtin_expf(-g));
      grad_up[i] = gy[i] * (g * s);
      grad_gate[i] = gy[i] * up[i] * (s * (1.0f + g * (1.0f - s)));
    }
  }
}

/* RMSNorm backward (its forward: bios_add_rms_norm in csrc/decode_ops.c), from x, inv_rms and grad_y [rows][n]: grad_x = inv_rms · (g - x̂ · mean(g · x̂)) with
 * g = grad_y · weight and x̂ = x · inv_rms; and, if grad_weight is given, grad_weight = Σ_rows grad_y · x̂ (summed by
 * column blocks, so no two threads write one sum). All rows have stride n. */
void bios_rms_norm_backward(const float* x, const float* weight, const float* inv_rms, const float* grad_y,
                            float* grad_x, float* grad_weight, int rows, int n, int threads) {
  #pragma omp parallel num_threads(threads) if (threads > 1)
  {
    #pragma omp for schedule(static)
    for (int r = 0; r < rows; r++) {
      const float* h = x + (long)r * n;
      const float* gy = grad_y + (long)r * n;
      float inverse = inv_rms[r], dot = 0.0f;
      #pragma omp simd reduction(+ : dot)
      for (int i = 0; i < n; i++) dot += gy[i] * weight[i] * (h[i] * inverse);
      float projection = dot / (float)n;
      float* gx = grad_x + (long)r * n;
      #pragma omp simd
      for (int i = 0; i < n; i++) gx[i] = (gy[i] * weight[i] - h[i] * inverse * projection) * inverse;
    }
    if (grad_weight) {
      #pragma omp for schedule(static)
      for (int start = 0; start < n; start += 64) {
        int end = start + 64 < n ? start + 64 : n;
        float sums[64] = {0};
        for (int r = 0; r < rows; r++) {
          const float* h = x + (long)r * n;
          const float* gy = grad_y + (long)r * n;
          float inverse = inv_rms[r];
          #pragma omp simd
          for (int i = start; i < end; i++) sums[i - start] += gy[i] * (h[i] * inverse);
        }
        for (int i = start; i < end; i++) grad_weight[i] = sums[i - start];
      }
    }
  }
}

/* The output head's log-softmax, each row of logits [rows][n] (row stride ld) read once from memory and then
 * worked on in the cache: lse[r] = max + log Σ exp(l - max), logprobs[r] = l[targets[r]] - lse[r]. With `grads`,
 * the row is overwritten by the gradient of scale·logprobs[r] with respect to it: scale·(onehot(target) -
 * softmax), scale = row_scale[r] (1 where row_scale is NULL); PyTorch's ops took four passes over memory
 * (bios/kernels/cross_entropy.py). On `threads` threads. */
void bios_log_softmax_rows(float* logits, long ld, const long* targets, const float* row_scale, float* logprobs,
                           float* lse, int rows, int n, int grads, int threads) {
  #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
  for (int r = 0; r < rows; r++) {
    float* l = logits + r * ld;
    vec top = (vec){0} - __builtin_inff();
    int i = 0;
    for (; i + VW <= n; i += VW) {
      vec v = vload(l + i);
      top = blend(v > top, v, top);
    }
    float most = -__builtin_inff();
    for (int k = 0; k < VW; k++) most = top[k] > most ? top[k] : most;
    for (; i < n; i++) most = l[i] > most ? l[i] : most;
    float target = l[targets[r]];
    vec sums = (vec){0};
    for (i = 0; i + VW <= n; i += VW) {
      vec e = vexp(vload(l + i) - most);
      sums += e;
      if (grads) vstore(l + i, e);
    }
    float sum = 0.0f;
    for (int k = 0; k < VW; k++) sum += sums[k];
    for (; i < n; i++) {
      float e = __builtin_expf(l[i] - most);
      sum += e;
      if (grads) l[i] = e;
    }
    lse[r] = most + __builtin_logf(sum);
    logprobs[r] = target - lse[r];
    if (!grads) continue;
    float scale = row_scale ? row_scale[r] : 1.0f;
    vec coefficient = (vec){0} - scale / sum;
    for (i = 0; i + VW <= n; i += VW) vstore(l + i, vload(l + i) * coefficient);
    for (; i < n; i++) l[i] *= -scale / sum;
    l[targets[r]] += scale;
  }
}
