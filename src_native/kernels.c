/* Scalar and AVX2+F16C implementations of the 16-bit float kernels (see kernels.h). */
#include "kernels.h"

#include <string.h>

#include "half.h"

/* ---- scalar reference ------------------------------------------------------------------------ */

static void sum_f16_scalar(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = hh_f32_to_f16(hh_f16_to_f32(a[i]) + hh_f16_to_f32(b[i]));
}

static void sum_bf16_scalar(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n) {
    for (size_t i = 0; i < n; i++)
        out[i] = hh_f32_to_bf16(hh_bf16_to_f32(a[i]) + hh_bf16_to_f32(b[i]));
}

static void f16_to_f32_scalar(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = hh_f16_to_f32(src[i]);
}

static void bf16_to_f32_scalar(const uint16_t *src, float *dst, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = hh_bf16_to_f32(src[i]);
}

static void f32_to_f16_scalar(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = hh_f32_to_f16(src[i]);
}

static void f32_to_bf16_scalar(const float *src, uint16_t *dst, size_t n) {
    for (size_t i = 0; i < n; i++)
        dst[i] = hh_f32_to_bf16(src[i]);
}

static const hh_kernels scalar_kernels = {
    "scalar",           sum_f16_scalar,     sum_bf16_scalar,   f16_to_f32_scalar,
    bf16_to_f32_scalar, f32_to_f16_scalar, f32_to_bf16_scalar,
};

/* ---- AVX2 + F16C ----------------------------------------------------------------------------- */

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HH_HAVE_AVX2 1
#include <immintrin.h>

#define HH_AVX2 __attribute__((target("avx2,f16c")))

HH_AVX2 static inline __m256 load_f16x8(const uint16_t *p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)p));
}

HH_AVX2 static inline void store_f16x8(uint16_t *p, __m256 v) {
    __m128i halves = _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128((__m128i *)p, halves);
}

HH_AVX2 static inline __m256 load_bf16x8(const uint16_t *p) {
    __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

/* Eight floats rounded to bfloat16 (nearest even; nan kept quiet), as hh_f32_to_bf16 does, each
 * in the low half of its 32-bit lane. */
HH_AVX2 static inline __m256i bf16_bits(__m256 v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(x, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)));
    __m256i quiet = _mm256_or_si256(x, _mm256_set1_epi32(0x400000));
    __m256i is_nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    return _mm256_srli_epi32(_mm256_blendv_epi8(rounded, quiet, is_nan), 16);
}

HH_AVX2 static inline void store_bf16x8(uint16_t *p, __m256 v) {
    /* pack 8 x u32 (each <= 0xffff) into 8 x u16: packus works per 128-bit lane, so pack the two
     * lanes against each other */
    __m256i high = bf16_bits(v);
    __m128i lo = _mm256_castsi256_si128(high);
    __m128i hi = _mm256_extracti128_si256(high, 1);
    _mm_storeu_si128((__m128i *)p, _mm_packus_epi32(lo, hi));
}

/* Sixteen bfloat16 as two vectors of floats in the order the 16-bit unpacks give, lane by lane:
 * elements 0-3 and 8-11 in `lo`, 4-7 and 12-15 in `hi`. One unpack per eight values (each
 * value's bits become the high half of a float's), and store_bf16x16 packs them back in their
 * order: for sums, where both sides are in the same order, this halves the shuffles of
 * load_bf16x8. */
HH_AVX2 static inline void load_bf16x16(const uint16_t *p, __m256 *lo, __m256 *hi) {
    __m256i x = _mm256_loadu_si256((const __m256i *)p), zero = _mm256_setzero_si256();
    *lo = _mm256_castsi256_ps(_mm256_unpacklo_epi16(zero, x));
    *hi = _mm256_castsi256_ps(_mm256_unpackhi_epi16(zero, x));
}

HH_AVX2 static inline void store_bf16x16(uint16_t *p, __m256 lo, __m256 hi) {
    _mm256_storeu_si256((__m256i *)p, _mm256_packus_epi32(bf16_bits(lo), bf16_bits(hi)));
}

HH_AVX2 static void sum_f16_avx2(const uint16_t *a, const uint16_t *b, uint16_t *out,
                                  size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 s0 = _mm256_add_ps(load_f16x8(a + i), load_f16x8(b + i));
        __m256 s1 = _mm256_add_ps(load_f16x8(a + i + 8), load_f16x8(b + i + 8));
        store_f16x8(out + i, s0);
        store_f16x8(out + i + 8, s1);
    }
    for (; i + 8 <= n; i += 8)
        store_f16x8(out + i, _mm256_add_ps(load_f16x8(a + i), load_f16x8(b + i)));
    sum_f16_scalar(a + i, b + i, out + i, n - i);
}

HH_AVX2 static void sum_bf16_avx2(const uint16_t *a, const uint16_t *b, uint16_t *out,
                                   size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m256 a0, a1, b0, b1;
        load_bf16x16(a + i, &a0, &a1);
        load_bf16x16(b + i, &b0, &b1);
        store_bf16x16(out + i, _mm256_add_ps(a0, b0), _mm256_add_ps(a1, b1));
    }
    for (; i + 8 <= n; i += 8)
        store_bf16x8(out + i, _mm256_add_ps(load_bf16x8(a + i), load_bf16x8(b + i)));
    sum_bf16_scalar(a + i, b + i, out + i, n - i);
}

HH_AVX2 static void f16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, load_f16x8(src + i));
    f16_to_f32_scalar(src + i, dst + i, n - i);
}

HH_AVX2 static void bf16_to_f32_avx2(const uint16_t *src, float *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        _mm256_storeu_ps(dst + i, load_bf16x8(src + i));
    bf16_to_f32_scalar(src + i, dst + i, n - i);
}

HH_AVX2 static void f32_to_f16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 8 <= n; i += 8)
        store_f16x8(dst + i, _mm256_loadu_ps(src + i));
    f32_to_f16_scalar(src + i, dst + i, n - i);
}

HH_AVX2 static void f32_to_bf16_avx2(const float *src, uint16_t *dst, size_t n) {
    size_t i = 0;
    for (; i + 16 <= n; i += 16) { /* packed lane by lane, then the four quarters in order */
        __m256i packed = _mm256_packus_epi32(bf16_bits(_mm256_loadu_ps(src + i)),
                                             bf16_bits(_mm256_loadu_ps(src + i + 8)));
        _mm256_storeu_si256((__m256i *)(dst + i), _mm256_permute4x64_epi64(packed, 0xd8));
    }
    for (; i + 8 <= n; i += 8)
        store_bf16x8(dst + i, _mm256_loadu_ps(src + i));
    f32_to_bf16_scalar(src + i, dst + i, n - i);
}

static const hh_kernels avx2_kernels = {
    "avx2+f16c",      sum_f16_avx2,    sum_bf16_avx2,    f16_to_f32_avx2,
    bf16_to_f32_avx2, f32_to_f16_avx2, f32_to_bf16_avx2,
};

static int cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
}
#endif

/* ---- selection ------------------------------------------------------------------------------- */

const hh_kernels *hh_active = &scalar_kernels;
static const hh_kernels *available[3] = {&scalar_kernels, NULL, NULL};

void hh_kernels_init(void) {
#ifdef HH_HAVE_AVX2
    if (cpu_has_avx2())
        available[1] = &avx2_kernels;
#endif
    for (int i = 0; available[i] != NULL; i++)
        hh_active = available[i];
}

const hh_kernels *const *hh_kernels_available(void) {
    return available;
}

int hh_kernels_use(const char *name) {
    for (int i = 0; available[i] != NULL; i++) {
        if (strcmp(available[i]->name, name) == 0) {
            hh_active = available[i];
            return 0;
        }
    }
    return -1;
}
