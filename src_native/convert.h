/* Copy with scaling and casting between float formats: the element loop of pack and unpack. */
#ifndef HH_CONVERT_H
#define HH_CONVERT_H

#include <stddef.h>

typedef enum { HH_RAW, HH_F16, HH_BF16, HH_F32, HH_F64 } hh_kind;

/* Name of a kind, for error messages. */
const char *hh_kind_name(hh_kind kind);

/* Bytes of one element of `kind`; `raw_itemsize` for HH_RAW. */
size_t hh_kind_size(hh_kind kind, size_t raw_itemsize);

/* 1 when hh_convert can copy `src` elements into `dst` elements (scaled or not). RAW copies only
 * to the same format unscaled, float64 only to float64; float16/bfloat16/float32 mix freely. */
int hh_convert_supported(hh_kind src, hh_kind dst, int scaled);

/* dst[i] = dst_kind(float(src[i]) * factor) for i < n, computed in float32 for 16/32-bit floats
 * (float64 for float64): what numpy gives for np.multiply(src, factor, out=dst, dtype=float32
 * [float64], casting="unsafe"). A factor of 1 is a plain copy or cast. `itemsize` is the size of a
 * RAW element. dst may be src itself (same kind), never a partial overlap. */
void hh_convert(hh_kind src_kind, const void *src, hh_kind dst_kind, void *dst, size_t n,
                size_t itemsize, double factor);

#endif
