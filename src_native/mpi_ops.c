/* MPI user operations for 16-bit float sums.
 *
 * Each reduction step widens both operands to float32, adds, and rounds the sum back to the
 * 16-bit format (nearest even): the same arithmetic as NCCL's half sums, so a buffer reduced here
 * or on a GPU agrees. The operations accept any 2-byte MPI datatype (UINT16_T, SHORT...), since
 * MPI has no 16-bit float type to name.
 */
#include "mpi_ops.h"

#include <stdio.h>

#include "kernels.h"

static MPI_Op ops[HH_OP_COUNT];
static int created = 0;

static size_t element_count(const int *len, const MPI_Datatype *type) {
    int size = 0;
    if (*type != MPI_UINT16_T && (MPI_Type_size(*type, &size) != MPI_SUCCESS || size != 2)) {
        fprintf(stderr, "hpc_horovod._native: a 16-bit float sum was given a %d-byte MPI datatype; "
                        "use MPI.UINT16_T (2 bytes per element)\n", size);
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    return (size_t)*len;
}

static void sum_f16(void *in, void *inout, int *len, MPI_Datatype *type) {
    hh_active->sum_f16((const uint16_t *)in, (const uint16_t *)inout, (uint16_t *)inout,
                       element_count(len, type));
}

static void sum_bf16(void *in, void *inout, int *len, MPI_Datatype *type) {
    hh_active->sum_bf16((const uint16_t *)in, (const uint16_t *)inout, (uint16_t *)inout,
                        element_count(len, type));
}

int hh_ops_ready(void) {
    int initialized = 0, finalized = 0;
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (!initialized || finalized)
        return 0;
    if (!created) {
        if (MPI_Op_create(sum_f16, 1, &ops[HH_OP_SUM_F16]) != MPI_SUCCESS)
            return 0;
        if (MPI_Op_create(sum_bf16, 1, &ops[HH_OP_SUM_BF16]) != MPI_SUCCESS) {
            MPI_Op_free(&ops[HH_OP_SUM_F16]);
            return 0;
        }
        created = 1;
    }
    return 1;
}

MPI_Op hh_op(hh_op_id id) {
    return ops[id];
}
