/* One query position per row attending over a prompt every row shares and then the row's own positions: the
 * cascade attention of a decode step whose rows are samples of one prompt (bios/worker/decode_cache.py).
 *
 * PyTorch runs it as a dozen small ops a layer; here each (row, kv head) is one task: the scores of its query heads
 * against the prompt's keys and its own, one softmax over both (max, exp, sum in fp32), and the weighted sum of
 * values, written once. Heads of width 64 or 128 keep up to four query heads' queries and sums in registers while
 * each key and value streams past once; other widths take a plain loop. exp is Cephes' polynomial, as PyTorch's
 * and Eigen's vectorized exp are. SmolLM2's layer, 16 rows, 50 + 32 positions (Intel Xeon, 2 threads): 42 us
 * against PyTorch's ops' 111 (cache warm; AVX2 code 49 against 115), and in a decode step 4.6 against 7.6 ms a
 * step for the 30 layers. Vectors move through registers (vload, vector casts), never memcpy: GCC's AVX2 code
 * spilled such copies to the stack in 16-byte halves, which made it 2x slower.
 * Built by bios/kernels/c_kernels.py. */
#include <stdlib.h>
#include <string.h>

#include "vec.h"

static inline float dot(const float* a, const float* b, int d) {
  float sum = 0.0f;
  #pragma omp simd reduction(+ : sum)
  for (int i = 0; i < d; i++) sum += a[i] * b[i];
  return sum;
}

#define HEADS_AT_ONCE 4 /* query heads of one kv head attended together: each key and value read once for them */


/* exp(scores - max) in place over n scores (room for VW past n), their sum. */
static float softmax_numerators(float* scores, int n) {
  float best = -__builtin_inff();
  for (int j = 0; j < n; j++) best = scores[j] > best ? scores[j] : best;
  for (int j = n; j < n + VW; j++) scores[j] = best;
  vec total = {0};
  for (int j = 0; j < n; j += VW) {
    vec s = vexp(vload(scores + j) - best);
    vstore(scores + j, s);
    if (j + VW <= n) total += s;
    else for (int t = 0; j + t < n; t++) total[0] += s[t];
  }
  return hsum(total);
}

/* Up to HEADS_AT_ONCE query heads of one kv head, head width D (a multiple of VW, known when inlined): their
 * queries and sums stay in registers while the keys and values stream past once. */
static inline __attribute__((always_inline)) void attend_heads(
    const float* query, int count, const float* pk, const float* pv, int prompt, const float* ok,
    const float* ov, int own, float* out, float scaling, float* scores, int stride, const int D) {
  vec q[HEADS_AT_ONCE][D / VW], acc[HEADS_AT_ONCE][D / VW];
  for (int g = 0; g < count; g++)
    for (int c = 0; c < D / VW; c++) q[g][c] = vload(query + g * D + c * VW);
  for (int j = 0; j < prompt + own; j++) {
    const float* key = j < prompt ? pk + (size_t)j * D : ok + (size_t)(j - prompt) * D;
    vec k[D / VW];
    for (int c = 0; c < D / VW; c++) k[c] = vload(key + c * VW);
    for (int g = 0; g < count; g++) {
      vec s = q[g][0] * k[0];
      for (int c = 1; c < D / VW; c++) s += q[g][c] * k[c];
      scores[g * stride + j] = hsum(s) * scaling;
    }
  }
  float inverse[HEADS_AT_ONCE];
  for (int g = 0; g < count; g++) {
    inverse[g] = 1.0f / softmax_numerators(scores + g * stride, prompt + own);
    for (int c = 0; c < D / VW; c++) acc[g][c] = (vec){0};
  }
  for (int j = 0; j < prompt + own; j++) {
    const float* value = j < prompt ? pv + (size_t)j * D : ov + (size_t)(j - prompt) * D;
    vec v[D / VW];
    for (int c = 0; c < D / VW; c++) v[c] = vload(value + c * VW);
    for (int g = 0; g < count; g++) {
      float w = scores[g * stride + j];
      for (int c = 0; c < D / VW; c++) acc[g][c] += w * v[c];
    }
  }
  for (int g = 0; g < count; g++)
    for (int c = 0; c < D / VW; c++) {
      vstore(out + g * D + c * VW, acc[g][c] * inverse[g]);
    }
}

/* q [rows][heads][d] (row stride q_row), prompt keys/values [kv_heads][prompt][d | dv] contiguous, own keys and
 * values [rows][kv_heads][own][d | dv] (row and head strides given, positions contiguous), out [rows][heads][dv]
 * contiguous. Query head h reads kv head h / (heads / kv_heads), as grouped-query attention does. */
void bios_cascade_attention(const float* q, long q_row, const float* prompt_keys, const float* prompt_values,
                            int prompt, const float* keys, const float* values, long k_row, long k_head, long v_row,
                            long v_head, int own, float* out, int rows, int heads, int kv_heads, int d, int dv,
                            float scaling, int threads) {
  int group = heads / kv_heads, positions = prompt + own;
  #pragma omp parallel num_threads(threads)
  {
    int stride = (positions + VW + 15) / 16 * 16;
    float* scores = malloc((size_t)HEADS_AT_ONCE * stride * sizeof(float));
    float* sum_v = malloc((size_t)dv * sizeof(float));
    if (!scores || !sum_v) abort();
    #pragma omp for schedule(static)
    for (int task = 0; task < rows * kv_heads; task++) {
      int row = task / kv_heads, kv = task % kv_heads;
      const float* pk = prompt_keys + (size_t)kv * prompt * d;
      const float* pv = prompt_values + (size_t)kv * prompt * dv;
      const float* ok = keys + row * k_row + kv * k_head;
      const float* ov = values + row * v_row + kv * v_head;
      if (d == dv && (d == 64 || d == 128)) {
        for (int g = 0; g < group; g += HEADS_AT_ONCE) {
          int count = group - g < HEADS_AT_ONCE ? group - g : HEADS_AT_ONCE, head = kv * group + g;
          const float* query = q + row * q_row + (size_t)head * d;
          float* o = out + ((size_t)row * heads + head) * dv;
          if (d == 64) attend_heads(query, count, pk, pv, prompt, ok, ov, own, o, scaling, scores, stride, 64);
          else attend_heads(query, count, pk, pv, prompt, ok, ov, own, o, scaling, scores, stride, 128);
        }
        continue;
      }
      for (int g = 0; g < group; g++) {
        int head = kv * group + g;
        const float* query = q + row * q_row + (size_t)head * d;
        for (int j = 0; j < prompt; j++) scores[j] = dot(query, pk + (size_t)j * d, d) * scaling;
        for (int j = 0; j < own; j++) scores[prompt + j] = dot(query, ok + (size_t)j * d, d) * scaling;
        float sum = softmax_numerators(scores, positions);
        memset(sum_v, 0, (size_t)dv * sizeof(float));
        for (int j = 0; j < prompt; j++) {
          const float* v = pv + (size_t)j * dv;
          float w = scores[j];
          #pragma omp simd
          for (int i = 0; i < dv; i++) sum_v[i] += w * v[i];
        }
        for (int j = 0; j < own; j++) {
          const float* v = ov + (size_t)j * dv;
          float w = scores[prompt + j];
          #pragma omp simd
          for (int i = 0; i < dv; i++) sum_v[i] += w * v[i];
        }
        float* o = out + ((size_t)row * heads + head) * dv;
        float inverse = 1.0f / sum;
        for (int i = 0; i < dv; i++) o[i] = sum_v[i] * inverse;
      }
    }
    free(scores);
    free(sum_v);
  }
}
