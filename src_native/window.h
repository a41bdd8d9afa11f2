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
 * The slices go in rounds (1 MiB while the group fits the caches, 256 KiB with streaming
 * stores above 8 MiB, see window.c), pipelined: in round k a rank copies the k-th piece of
 * every other rank's slice into its segment and says so, sums the k-th piece of its own once
 * every rank has said so, says that too, then copies out the pieces of round k - 1 the others
 * have summed meanwhile. Each rank has two counters in the window, on its own cache line:
 * rounds written and rounds summed, above the reduction's number (every rank numbers its
 * native reductions alike). Nobody writes into a rank's tensors but the rank itself, so nothing
 * waits for the last copy out: a rank cannot finish a reduction before every other has written
 * its first round of it, hence finished the previous one, so two slots alternating are enough
 * for the window's reuse.
 */
#ifndef HH_WINDOW_H
#define HH_WINDOW_H

#include <stddef.h>
#include <stdint.h>

#include "convert.h"

/* int64 counters per cache line: rank q's are at flags[q * HH_WINDOW_FLAG_STRIDE] (rounds
 * written) and the one after (rounds summed) */
#define HH_WINDOW_FLAG_STRIDE 8

typedef struct {
    int n;                  /* ranks */
    int rank;               /* this rank, in [0, n) */
    const uint64_t *table;  /* `count` rows (input address, output address, bytes) of this rank,
                             * at most `capacity` bytes in all */
    size_t count;
    char *slot;             /* n segments of `capacity` bytes, then the result */
    size_t capacity;
    int64_t *flags;         /* the ranks' counters, shared, zero at first */
    hh_kind kind;           /* HH_F16, HH_BF16, HH_F32 or HH_F64 */
    double factor;          /* applied to the sum */
    double timeout_s;       /* of each wait for the others; 0: no limit */
    double yield_s;         /* waits yield the core this long before they sleep; 0: at once */
    /* Called every 100 ms while waiting for a peer; nonzero gives up (an interrupt). */
    int (*interrupted)(void *context);
    void *context;
} hh_window_job;

/* Run `job`. 0; -1 with a message in `error`; -2 when `interrupted` said so. */
int hh_window_reduce(const hh_window_job *job, char *error, size_t error_size);

#endif
