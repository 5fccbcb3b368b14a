/* What Bios's C kernels share: the vector type of the instruction set they are built for (VW floats: 16 with
 * AVX-512, 8 with AVX2; -DVW=... from bios/kernels/c_kernels.py) and a vectorized exp. */
#ifndef BIOS_VEC_H
#define BIOS_VEC_H

typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));
typedef int ivec __attribute__((vector_size(VW * 4), aligned(4)));

/* Loads and stores of VW floats at any float alignment (the vector type is aligned to 4 bytes). */
static inline vec vload(const float* p) { return *(const vec*)p; }
static inline void vstore(float* p, vec v) { *(vec*)p = v; }

/* Lanes of `yes` where `mask` is set (-1, as comparisons give), else of `no`. A vector cast keeps the bits. */
static inline vec blend(ivec mask, vec yes, vec no) { return (vec)(((ivec)yes & mask) | ((ivec)no & ~mask)); }

/* The sum of v's lanes (halves added pairwise where the compiler can shuffle vectors; GCC before 12: lane by lane)
 * and the largest of them. */
typedef float half_vec __attribute__((vector_size(VW * 2)));
typedef float quad __attribute__((vector_size(16)));

static inline float hsum(vec v) {
#if !__has_builtin(__builtin_shufflevector) /* GCC before 12: lane by lane */
  float sum = 0.0f;
  for (int t = 0; t < VW; t++) sum += v[t];
  return sum;
#else
#if VW == 16
  half_vec h = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7)
               + __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  quad a = __builtin_shufflevector(h, h, 0, 1, 2, 3) + __builtin_shufflevector(h, h, 4, 5, 6, 7);
#else
  quad a = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
#endif
  return (a[0] + a[2]) + (a[1] + a[3]);
#endif
}

static inline float hmax(vec v) {
  float most = v[0];
  for (int t = 1; t < VW; t++) most = v[t] > most ? v[t] : most;
  return most;
}

/* exp(x) lane by lane: Cephes' polynomial, as PyTorch's and Eigen's vectorized exp are. x is clamped to
 * [-87, 88], where 2^n stays a normal float: exp(-87) = 1.6e-38 stands for anything smaller (a softmax weight or a
 * silu's exp(-g) that small adds nothing), exp(88) = 1.7e38 for anything larger. */
static inline vec vexp(vec x) {
  const vec hi = (vec){0} + 88.0f, lo = (vec){0} - 87.0f;
  x = blend(x > hi, hi, x);
  x = blend(x < lo, lo, x);
  vec fx = x * 1.44269504088896341f + 0.5f;
  vec nf = __builtin_convertvector(__builtin_convertvector(fx, ivec), vec); /* toward zero, then down: floor */
  nf += __builtin_convertvector(nf > fx, vec);                              /* (a true comparison is -1) */
  ivec n = __builtin_convertvector(nf, ivec);
  x = x - nf * 0.693359375f + nf * 2.12194440e-4f;
  vec z = x * x;
  vec y = 1.9875691500e-4f * x + 1.3981999507e-3f;
  y = y * x + 8.3334519073e-3f;
  y = y * x + 4.1665795894e-2f;
  y = y * x + 1.6666665459e-1f;
  y = y * x + 5.0000001201e-1f;
  y = y * z + x + 1.0f;
  return y * (vec)((n + 127) << 23); /* 2^n, built in the exponent bits */
}

#endif
