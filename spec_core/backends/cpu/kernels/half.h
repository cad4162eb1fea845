/* IEEE half to float, exactly (every half is a float; F16C's conversion gives the same), shared by the
 * quantized matmuls (quant_gemm.c) and the GGUF formats (kquant_gemm.c). */
#ifndef SSD_HALF_H
#define SSD_HALF_H

#include <math.h>
#include <stdint.h>
#include <string.h>

static inline float half_to_float(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    float f;
    if (exp == 0) {
        f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    const uint32_t u = sign | (exp == 31 ? 0x7f800000u | (man << 13) : ((exp + 112) << 23) | (man << 13));
    memcpy(&f, &u, 4);
    return f;
}

#endif
