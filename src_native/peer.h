/* Reduction of a fused group by reading and writing the peers' own tensors (Linux cross-memory
 * attach: process_vm_readv / process_vm_writev), for ranks that share a node.
 *
 * Every rank describes its group with a table of (input address, output address, bytes) rows,
 * one per tensor, in the agreed order: the rows have the same sizes on every rank. Rank r owns
 * the bytes [lo, hi) of the group laid end to end: it reads them from every peer's inputs, sums
 * them with its own in rank order, scales, writes the result into its own outputs and into every
 * peer's. Nobody else touches those bytes of anyone's tensors meanwhile, so the only
 * synchronization needed is before (the tables are exchanged) and after (every slice arrived).
 */
#ifndef HH_PEER_H
#define HH_PEER_H

#include <stddef.h>
#include <stdint.h>

#include "convert.h"

typedef struct {
    int n;                  /* ranks */
    int rank;               /* this rank, in [0, n) */
    const long *pids;       /* n process ids */
    const uint64_t *tables; /* n tables of `count` rows (input, output, bytes) */
    size_t count;
    size_t lo, hi;          /* this rank's bytes of the group */
    hh_kind kind;           /* HH_F16, HH_BF16, HH_F32 or HH_F64 */
    double factor;          /* applied to the sum */
    char *scratch;          /* at least (n - 1) x HH_PEER_CHUNK bytes */
} hh_peer_job;

/* Bytes of each peer's slice staged in scratch at a time. */
#define HH_PEER_CHUNK ((size_t)256 * 1024)

/* Let processes of this user read and write this one's memory (needed where the Yama security
 * module restricts cross-memory attach to descendants). 0 or -1 (errno set). */
int hh_peer_allow(void);

/* Copy `nbytes` between `buf` and `address` in process `pid`: from there when `write` is 0, to
 * there otherwise. 0 or -1 (errno set). */
int hh_peer_copy(long pid, uint64_t address, void *buf, size_t nbytes, int write);

/* out = factor * (srcs[0] + srcs[1] + ... + srcs[n-1]), `m` elements of `kind` (HH_F16, HH_BF16,
 * HH_F32 or HH_F64), summed in rank order in float32 (float64 for float64) and rounded once: every
 * slice of a result is computed the same way whichever rank owns it. `out` may be a source. */
void hh_sum_ranks(hh_kind kind, int n, const char *const *srcs, char *out, size_t m,
                  double factor);

/* Run `job`. 0, or -1 with a message in `error`. */
int hh_peer_reduce(const hh_peer_job *job, char *error, size_t error_size);

#endif
