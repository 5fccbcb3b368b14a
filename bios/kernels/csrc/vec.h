/* What Bios's C kernels share: the vector type of the instruction set they are built for (VW floats: 16 with
 * AVX-512, 8 with AVX2; -DVW=... from bios/kernels/c_kernels.py). */
#ifndef BIOS_VEC_H
#define BIOS_VEC_H

typedef float vec __attribute__((vector_size(VW * 4), aligned(4)));
typedef int ivec __attribute__((vector_size(VW * 4), aligned(4)));

#endif
