/* See slices.h. Blocks of BLOCK elements: the partial result of a block stays in the caches
 * while every input's block is folded into it, then goes to each output. */
#include "slices.h"

#include <stdint.h>
#include <string.h>

#include "convert.h"
#include "kernels.h"

#define BLOCK 2048

int hh_slices_supported(hh_slice_type type, int op) {
    switch (type) {
    case HH_S_F16:
    case HH_S_BF16: return op == HH_S_SUM;
    case HH_S_BOOL: return op == HH_S_MIN || op == HH_S_MAX;
    case HH_S_NONE: return 0;
    default: return op == HH_S_SUM || op == HH_S_MIN || op == HH_S_MAX || op == HH_S_PROD;
    }
}

#define MIN_OF(a, b) ((b) < (a) ? (b) : (a))
#define MAX_OF(a, b) ((b) > (a) ? (b) : (a))

/* Integers: T the element type, U its unsigned twin (sums and products wrap without undefined
 * behaviour). Scaling goes through double and truncates, as numpy's unsafe cast. */
#define INT_KERNEL(NAME, T, U)                                                                \
    static void NAME(int op, const void *const *in, int k, void *const *out, int m, size_t n,  \
                     double pre, double post) {                                               \
        T acc[BLOCK];                                                                         \
        for (size_t off = 0; off < n; off += BLOCK) {                                         \
            size_t b = n - off < BLOCK ? n - off : BLOCK;                                     \
            for (int q = 0; q < k; q++) {                                                     \
                const T *x = (const T *)in[q] + off;                                          \
                if (q == 0) {                                                                 \
                    if (pre == 1.0)                                                           \
                        memcpy(acc, x, b * sizeof(T));                                        \
                    else                                                                      \
                        for (size_t i = 0; i < b; i++)                                        \
                            acc[i] = (T)((double)x[i] * pre);                                 \
                    continue;                                                                 \
                }                                                                             \
                for (size_t i = 0; i < b; i++) {                                              \
                    T v = pre == 1.0 ? x[i] : (T)((double)x[i] * pre);                        \
                    switch (op) {                                                             \
                    case HH_S_SUM: acc[i] = (T)((U)acc[i] + (U)v); break;                     \
                    case HH_S_PROD: acc[i] = (T)((U)acc[i] * (U)v); break;                    \
                    case HH_S_MIN: acc[i] = MIN_OF(acc[i], v); break;                         \
                    default: acc[i] = MAX_OF(acc[i], v); break;                               \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            if (post != 1.0)                                                                  \
                for (size_t i = 0; i < b; i++)                                                \
                    acc[i] = (T)((double)acc[i] * post);                                      \
            for (int j = 0; j < m; j++)                                                       \
                memcpy((T *)out[j] + off, acc, b * sizeof(T));                                \
        }                                                                                     \
    }

INT_KERNEL(reduce_u8, uint8_t, uint8_t)
INT_KERNEL(reduce_i8, int8_t, uint8_t)
INT_KERNEL(reduce_i16, int16_t, uint16_t)
INT_KERNEL(reduce_i32, int32_t, uint32_t)
INT_KERNEL(reduce_i64, int64_t, uint64_t)

/* Floats of 32 and 64 bits: the factor in the element's type, as numpy with a Python float. The
 * sum loops are kept apart from the switch so that the compiler vectorizes them. Sums take the
 * first two inputs in one pass; two unscaled inputs (two ranks on a node) are summed straight
 * into the first output, the others copied from it; an unscaled copy is a plain memcpy. Each
 * output of a block is written after every input of that block was read, so an output may be
 * one of the inputs. */
#define FLOAT_KERNEL(NAME, T)                                                                 \
    static void NAME(int op, const void *const *in, int k, void *const *out, int m, size_t n,  \
                     double pre_d, double post_d) {                                           \
        T acc[BLOCK], pre = (T)pre_d, post = (T)post_d;                                       \
        if (k == 1 && pre_d == 1.0 && post_d == 1.0) {                                        \
            for (int j = 0; j < m; j++)                                                       \
                if (out[j] != in[0])                                                          \
                    memcpy(out[j], in[0], n * sizeof(T));                                     \
            return;                                                                           \
        }                                                                                     \
        for (size_t off = 0; off < n; off += BLOCK) {                                         \
            size_t b = n - off < BLOCK ? n - off : BLOCK;                                     \
            const T *x0 = (const T *)in[0] + off;                                             \
            int q = 1;                                                                        \
            if (k == 2 && op == HH_S_SUM && pre_d == 1.0) {                                   \
                const T *x1 = (const T *)in[1] + off;                                         \
                T *o0 = (T *)out[0] + off;                                                    \
                for (size_t i = 0; i < b; i++)                                                \
                    o0[i] = x0[i] + x1[i];                                                    \
                if (post_d != 1.0)                                                            \
                    for (size_t i = 0; i < b; i++)                                            \
                        o0[i] *= post;                                                        \
                for (int j = 1; j < m; j++)                                                   \
                    memcpy((T *)out[j] + off, o0, b * sizeof(T));                             \
                continue;                                                                     \
            }                                                                                 \
            if (k > 1 && op == HH_S_SUM) { /* the first two inputs in one pass */             \
                const T *x1 = (const T *)in[1] + off;                                         \
                if (pre_d == 1.0)                                                             \
                    for (size_t i = 0; i < b; i++)                                            \
                        acc[i] = x0[i] + x1[i];                                               \
                else                                                                          \
                    for (size_t i = 0; i < b; i++)                                            \
                        acc[i] = x0[i] * pre + x1[i] * pre;                                   \
                q = 2;                                                                        \
            } else if (pre_d == 1.0) {                                                        \
                memcpy(acc, x0, b * sizeof(T));                                               \
            } else {                                                                          \
                for (size_t i = 0; i < b; i++)                                                \
                    acc[i] = x0[i] * pre;                                                     \
            }                                                                                 \
            for (; q < k; q++) {                                                              \
                const T *x = (const T *)in[q] + off;                                          \
                if (op == HH_S_SUM && pre_d == 1.0) {                                         \
                    for (size_t i = 0; i < b; i++)                                            \
                        acc[i] += x[i];                                                       \
                } else if (op == HH_S_SUM) {                                                  \
                    for (size_t i = 0; i < b; i++)                                            \
                        acc[i] += x[i] * pre;                                                 \
                } else {                                                                      \
                    for (size_t i = 0; i < b; i++) {                                          \
                        T v = pre_d == 1.0 ? x[i] : x[i] * pre;                               \
                        switch (op) {                                                         \
                        case HH_S_PROD: acc[i] *= v; break;                                   \
                        case HH_S_MIN: acc[i] = MIN_OF(acc[i], v); break;                     \
                        default: acc[i] = MAX_OF(acc[i], v); break;                           \
                        }                                                                     \
                    }                                                                         \
                }                                                                             \
            }                                                                                 \
            if (post_d != 1.0)                                                                \
                for (size_t i = 0; i < b; i++)                                                \
                    acc[i] *= post;                                                           \
            for (int j = 0; j < m; j++)                                                       \
                memcpy((T *)out[j] + off, acc, b * sizeof(T));                                \
        }                                                                                     \
    }

FLOAT_KERNEL(reduce_f32, float)
FLOAT_KERNEL(reduce_f64, double)

/* bool: min is logical and, max logical or, on numpy's 0/1 bytes. */
static void reduce_bool(int op, const void *const *in, int k, void *const *out, int m, size_t n,
                        double pre, double post) {
    (void)pre, (void)post;
    uint8_t acc[BLOCK];
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t b = n - off < BLOCK ? n - off : BLOCK;
        memcpy(acc, (const uint8_t *)in[0] + off, b);
        for (int q = 1; q < k; q++) {
            const uint8_t *x = (const uint8_t *)in[q] + off;
            for (size_t i = 0; i < b; i++)
                acc[i] = op == HH_S_MIN ? (acc[i] & x[i]) : (acc[i] | x[i]);
        }
        for (int j = 0; j < m; j++)
            memcpy((uint8_t *)out[j] + off, acc, b);
    }
}

/* 16-bit floats: sums only; each input scaled and rounded to 16 bits first (as the flat path
 * prescales in place), then summed step by step with the same rounding as the MPI op. */
static void reduce_half(hh_slice_type type, const void *const *in, int k, void *const *out,
                        int m, size_t n, double pre, double post) {
    hh_kind kind = type == HH_S_F16 ? HH_F16 : HH_BF16;
    void (*sum)(const uint16_t *, const uint16_t *, uint16_t *, size_t) =
        type == HH_S_F16 ? hh_active->sum_f16 : hh_active->sum_bf16;
    uint16_t acc[BLOCK], scaled[BLOCK];
    for (size_t off = 0; off < n; off += BLOCK) {
        size_t b = n - off < BLOCK ? n - off : BLOCK;
        hh_convert(kind, (const uint16_t *)in[0] + off, kind, acc, b, 2, pre);
        for (int q = 1; q < k; q++) {
            const uint16_t *x = (const uint16_t *)in[q] + off;
            if (pre != 1.0) {
                hh_convert(kind, x, kind, scaled, b, 2, pre);
                x = scaled;
            }
            sum(acc, x, acc, b);
        }
        if (post != 1.0)
            hh_convert(kind, acc, kind, acc, b, 2, post);
        for (int j = 0; j < m; j++)
            memcpy((uint16_t *)out[j] + off, acc, b * 2);
    }
}

void hh_reduce_slices(hh_slice_type type, int op, const void *const *in, int k,
                      void *const *out, int m, size_t n, double pre, double post) {
    switch (type) {
    case HH_S_U8: reduce_u8(op, in, k, out, m, n, pre, post); break;
    case HH_S_I8: reduce_i8(op, in, k, out, m, n, pre, post); break;
    case HH_S_I16: reduce_i16(op, in, k, out, m, n, pre, post); break;
    case HH_S_I32: reduce_i32(op, in, k, out, m, n, pre, post); break;
    case HH_S_I64: reduce_i64(op, in, k, out, m, n, pre, post); break;
    case HH_S_BOOL: reduce_bool(op, in, k, out, m, n, pre, post); break;
    case HH_S_F32: reduce_f32(op, in, k, out, m, n, pre, post); break;
    case HH_S_F64: reduce_f64(op, in, k, out, m, n, pre, post); break;
    case HH_S_F16:
    case HH_S_BF16: reduce_half(type, in, k, out, m, n, pre, post); break;
    default: break;
    }
}
