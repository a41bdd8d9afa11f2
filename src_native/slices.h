/* The reduction of k equal slices (one per rank of a node) into m outputs, in one pass: what the
 * hierarchical host backend's reduce-scatter runs on the node's shared window. */
#ifndef HH_SLICES_H
#define HH_SLICES_H

#include <stddef.h>

/* Element types the slice reduction takes. */
typedef enum {
    HH_S_U8, HH_S_I8, HH_S_I16, HH_S_I32, HH_S_I64, HH_S_BOOL, HH_S_F16, HH_S_BF16, HH_S_F32,
    HH_S_F64, HH_S_NONE
} hh_slice_type;

/* Reduction ops, Horovod's numbers (common/types.py). */
enum { HH_S_SUM = 1, HH_S_MIN = 3, HH_S_MAX = 4, HH_S_PROD = 5 };

/* 1 when `op` reduces elements of `type` (16-bit floats: sums only; bool: min and max). */
int hh_slices_supported(hh_slice_type type, int op);

/* For i < n: r = in[0][i] op in[1][i] op ... op in[k-1][i], each input first multiplied by
 * `pre`, the result by `post`, stored into every out[j][i]. Inputs are combined in their order,
 * one rounding per step as one MPI reduction step rounds (16-bit floats through float32, as
 * src_native/mpi_ops.c sums them); scaling is numpy's (np.multiply(x, factor, out=x,
 * casting="unsafe"): float32 for 16- and 32-bit floats, float64 for float64 and integers,
 * truncated back to integers). Integer sums and products wrap. An output may be one of the
 * inputs (element by element the same place), never a partial overlap. */
void hh_reduce_slices(hh_slice_type type, int op, const void *const *in, int k,
                      void *const *out, int m, size_t n, double pre, double post);

#endif
