/* Copy, scale and cast between float formats through a float32 staging block that stays in L1. */
#include "convert.h"

#include <stdint.h>
#include <string.h>

#include "kernels.h"

#define BLOCK 2048 /* float32 elements staged at a time: 8 KiB */

const char *hh_kind_name(hh_kind kind) {
    switch (kind) {
    case HH_F16: return "float16";
    case HH_BF16: return "bfloat16";
    case HH_F32: return "float32";
    case HH_F64: return "float64";
    default: return "non-float";
    }
}

static int is_f32_family(hh_kind kind) {
    return kind == HH_F16 || kind == HH_BF16 || kind == HH_F32;
}

int hh_convert_supported(hh_kind src, hh_kind dst, int scaled) {
    if (src == HH_RAW || dst == HH_RAW)
        return src == dst && !scaled;
    if (src == HH_F64 || dst == HH_F64)
        return src == dst;
    return 1;
}

size_t hh_kind_size(hh_kind kind, size_t raw_itemsize) {
    switch (kind) {
    case HH_F16:
    case HH_BF16: return 2;
    case HH_F32: return 4;
    case HH_F64: return 8;
    default: return raw_itemsize;
    }
}

static void scale_f32(const float *src, float *dst, size_t n, float factor) {
    for (size_t i = 0; i < n; i++)
        dst[i] = src[i] * factor;
}

static void scale_f64(const double *src, double *dst, size_t n, double factor) {
    for (size_t i = 0; i < n; i++)
        dst[i] = src[i] * factor;
}

static void to_f32(hh_kind kind, const uint16_t *src, float *dst, size_t n) {
    if (kind == HH_F16)
        hh_active->f16_to_f32(src, dst, n);
    else
        hh_active->bf16_to_f32(src, dst, n);
}

static void from_f32(hh_kind kind, const float *src, uint16_t *dst, size_t n) {
    if (kind == HH_F16)
        hh_active->f32_to_f16(src, dst, n);
    else
        hh_active->f32_to_bf16(src, dst, n);
}

void hh_convert(hh_kind sk, const void *src, hh_kind dk, void *dst, size_t n, size_t itemsize,
                double factor) {
    int scaled = factor != 1.0;
    if (sk == dk && !scaled) {
        if (src != dst)
            memmove(dst, src, n * hh_kind_size(sk, itemsize));
        return;
    }
    if (sk == HH_F64) {
        scale_f64((const double *)src, (double *)dst, n, factor);
        return;
    }
    if (!is_f32_family(sk) || !is_f32_family(dk))
        return; /* rejected by hh_convert_supported */
    float f = (float)factor;
    if (sk == HH_F32 && dk == HH_F32) {
        scale_f32((const float *)src, (float *)dst, n, f);
        return;
    }
    float stage_block[BLOCK];
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t m = n - off < BLOCK ? n - off : BLOCK;
        /* a float32 destination is its own staging area */
        float *stage = dk == HH_F32 ? (float *)dst + off : stage_block;
        const float *x;
        if (sk == HH_F32) {
            x = (const float *)src + off;
        } else {
            to_f32(sk, (const uint16_t *)src + off, stage, m);
            x = stage;
        }
        if (scaled) {
            scale_f32(x, stage, m, f);
            x = stage;
        }
        if (dk != HH_F32)
            from_f32(dk, x, (uint16_t *)dst + off, m);
    }
}
