/* Element kernels on 16-bit floats, in a scalar and (x86-64) an AVX2+F16C flavour.
 *
 * The flavour is picked once at import from what the CPU supports; both give identical results
 * (the scalar one is the reference), so the choice is only about speed.
 */
#ifndef HH_KERNELS_H
#define HH_KERNELS_H

#include <stddef.h>
#include <stdint.h>

typedef struct {
    const char *name;
    /* out[i] = round(float(a[i]) + float(b[i])): one reduction step; out may be a or b */
    void (*sum_f16)(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n);
    void (*sum_bf16)(const uint16_t *a, const uint16_t *b, uint16_t *out, size_t n);
    void (*f16_to_f32)(const uint16_t *src, float *dst, size_t n);
    void (*bf16_to_f32)(const uint16_t *src, float *dst, size_t n);
    void (*f32_to_f16)(const float *src, uint16_t *dst, size_t n);
    void (*f32_to_bf16)(const float *src, uint16_t *dst, size_t n);
} hh_kernels;

/* The kernels in use. Set by hh_kernels_init(); hh_kernels_use() swaps them (tests). */
extern const hh_kernels *hh_active;

/* Select the fastest flavour this CPU supports. */
void hh_kernels_init(void);

/* Flavours this CPU can run, best last; NULL-terminated. */
const hh_kernels *const *hh_kernels_available(void);

/* Use the flavour called `name`; returns 0, or -1 when this CPU cannot run it. */
int hh_kernels_use(const char *name);

#endif
