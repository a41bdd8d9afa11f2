/* MPI reduction operations MPI lacks: float16 and bfloat16 sums over a 2-byte MPI datatype. */
#ifndef HH_MPI_OPS_H
#define HH_MPI_OPS_H

#include <mpi.h>

typedef enum { HH_OP_SUM_F16 = 0, HH_OP_SUM_BF16 = 1, HH_OP_COUNT } hh_op_id;

/* Create the operations on first call; 1 when they are usable (MPI initialized and not yet
 * finalized), 0 otherwise. Not thread-safe: the caller holds the GIL. */
int hh_ops_ready(void);

/* The operation `id`; only valid after hh_ops_ready() returned 1. */
MPI_Op hh_op(hh_op_id id);

#endif
