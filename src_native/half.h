/* Scalar float16 / bfloat16 <-> float32 conversions, round-to-nearest-even.
 *
 * These are the reference the vector kernels must match bit for bit (NaN payloads aside), and the
 * fallback on CPUs without F16C/AVX2. They rely on the default IEEE rounding mode and on strict
 * float semantics (no -ffast-math).
 */
#ifndef HH_HALF_H
#define HH_HALF_H

#include <stdint.h>
#include <string.h>

static inline uint32_t hh_f32_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float hh_bits_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline float hh_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    if (exp == 0x1fu) /* inf, nan */
        return hh_bits_f32(sign | 0x7f800000u | (mant << 13));
    if (exp != 0) /* normal: rebias 15 -> 127 */
        return hh_bits_f32(sign | ((exp + 112u) << 23) | (mant << 13));
    /* zero or subnormal: mant * 2^-24, exact in float32 */
    return hh_bits_f32(sign | hh_f32_bits((float)mant * 0x1p-24f));
}

static inline uint16_t hh_f32_to_f16(float f) {
    uint32_t x = hh_f32_bits(f);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax >= 0x7f800000u) /* inf stays inf; nan stays a quiet nan with its top payload bits */
        return sign | (ax == 0x7f800000u ? 0x7c00u : (uint16_t)(0x7e00u | ((ax >> 13) & 0x3ffu)));
    if (ax >= 0x477ff000u) /* >= 65520 rounds to infinity */
        return sign | 0x7c00u;
    if (ax < 0x38800000u) {
        /* below the smallest normal half: adding 0.5 puts the value where one float32 ulp is one
         * half subnormal step (2^-24), so the FPU's round-to-nearest-even does the rounding */
        float shifted = hh_bits_f32(ax) + 0.5f;
        return sign | (uint16_t)(hh_f32_bits(shifted) - 0x3f000000u);
    }
    /* normal: rebias 127 -> 15 and round the 13 dropped bits to nearest even; a carry out of the
     * mantissa correctly bumps the exponent */
    uint32_t odd = (ax >> 13) & 1u;
    ax += ((uint32_t)(15 - 127) << 23) + 0xfffu + odd;
    return sign | (uint16_t)(ax >> 13);
}

static inline float hh_bf16_to_f32(uint16_t h) {
    return hh_bits_f32((uint32_t)h << 16);
}

static inline uint16_t hh_f32_to_bf16(float f) {
    uint32_t x = hh_f32_bits(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) /* nan: truncate and keep it quiet */
        return (uint16_t)((x >> 16) | 0x40u);
    x += 0x7fffu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}

#endif
