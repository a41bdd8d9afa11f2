/* Float sums through the node's shared window, with the ranks' own tensors on both
 * ends (the native version of what backends/shm.py does with numpy).
 *
 * Every rank owns the bytes [lo, hi) of the group laid end to end (64-byte aligned slices, as
 * shm._slice_bounds cuts them). A rank copies into its segment of the window only the bytes the
 * other ranks own, sums its own slice straight from its own inputs and the peers' segments into
 * its own outputs and into the window's result, then copies from the result only the bytes the
 * other ranks summed. Compared with packing the whole group in and unpacking the whole of it
 * out, each rank copies (n - 1)/n of the group each way, and its own slice not at all.
 *
 * Two arrivals order the phases: every segment written, every slice summed. An arrival is a
 * counter per rank in the window, on its own cache line: a rank bumps its own, then waits until
 * every rank's has reached it. Nobody writes into a rank's tensors but the rank itself, so
 * nothing has to wait for the last copy out: the next reduction's first arrival, which no rank
 * passes before every rank has finished this one, guards the window's reuse.
 */
#ifndef HH_WINDOW_H
#define HH_WINDOW_H

#include <stddef.h>
#include <stdint.h>

#include "convert.h"

/* int64 counters per cache line: counter q is at flags[q * HH_WINDOW_FLAG_STRIDE] */
#define HH_WINDOW_FLAG_STRIDE 8

typedef struct {
    int n;                  /* ranks */
    int rank;               /* this rank, in [0, n) */
    const uint64_t *table;  /* `count` rows (input address, output address, bytes) of this rank,
                             * at most `capacity` bytes in all */
    size_t count;
    char *slot;             /* n segments of `capacity` bytes, then the result */
    size_t capacity;
    int64_t *flags;         /* the arrival counters, shared */
    hh_kind kind;           /* HH_F16, HH_BF16, HH_F32 or HH_F64 */
    double factor;          /* applied to the sum */
    double timeout_s;       /* of each arrival; 0: no limit */
    double yield_s;         /* waits yield the core this long before they sleep; 0: at once */
    /* Called every 100 ms while waiting for a peer; nonzero gives up (an interrupt). */
    int (*interrupted)(void *context);
    void *context;
} hh_window_job;

/* Run `job`. 0; -1 with a message in `error`; -2 when `interrupted` said so. */
int hh_window_reduce(const hh_window_job *job, char *error, size_t error_size);

#endif
