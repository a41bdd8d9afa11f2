/* Cross-memory reduction between the ranks of one node (see peer.h). */
#define _GNU_SOURCE
#include "peer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "kernels.h"

#define IOV_BATCH 1024 /* IOV_MAX on Linux: the most segments one call takes */
#define BLOCK 1024     /* elements summed at a time, in an accumulator that stays in L1 */

int hh_peer_allow(void) {
#ifdef PR_SET_PTRACER
    /* EINVAL: no Yama in this kernel, nothing to allow */
    if (prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY, 0, 0, 0) != 0 && errno != EINVAL)
        return -1;
#endif
    return 0;
}

/* Pairs of segments of equal lengths, here and in `pid`: copy them (remote -> local, or local ->
 * remote when `write`), at most IOV_BATCH pairs per call. 0, or -1 with errno set. */
static int transfer(long pid, struct iovec *local, struct iovec *remote, size_t count, int write) {
    for (size_t i = 0; i < count; i += IOV_BATCH) {
        unsigned long m = (unsigned long)(count - i < IOV_BATCH ? count - i : IOV_BATCH);
        size_t want = 0;
        for (unsigned long k = 0; k < m; k++)
            want += local[i + k].iov_len;
        ssize_t got = write ? process_vm_writev((pid_t)pid, local + i, m, remote + i, m, 0)
                            : process_vm_readv((pid_t)pid, local + i, m, remote + i, m, 0);
        if (got < 0)
            return -1;
        if ((size_t)got != want) { /* a page of the peer's range is not mapped */
            errno = EFAULT;
            return -1;
        }
    }
    return 0;
}

int hh_peer_copy(long pid, uint64_t address, void *buf, size_t nbytes, int write) {
    struct iovec local = {buf, nbytes};
    struct iovec remote = {(void *)(uintptr_t)address, nbytes};
    return transfer(pid, &local, &remote, 1, write);
}

/* Two ranks of float32 or float64: one pass, which the compiler vectorizes (twice as fast as the
 * general loop below); `out` may be `a` or `b`. */
static void sum_two_f32(const float *a, const float *b, float *out, size_t m, float factor) {
    if (factor == 1.0f)
        for (size_t k = 0; k < m; k++)
            out[k] = a[k] + b[k];
    else
        for (size_t k = 0; k < m; k++)
            out[k] = (a[k] + b[k]) * factor;
}

static void sum_two_f64(const double *a, const double *b, double *out, size_t m, double factor) {
    if (factor == 1.0)
        for (size_t k = 0; k < m; k++)
            out[k] = a[k] + b[k];
    else
        for (size_t k = 0; k < m; k++)
            out[k] = (a[k] + b[k]) * factor;
}

/* The float32 values of `m` elements of `kind` at `src`, in `wide` unless they already are
 * float32. */
static const float *as_f32(hh_kind kind, const char *src, float *wide, size_t m) {
    if (kind == HH_F32)
        return (const float *)src;
    if (kind == HH_F16)
        hh_active->f16_to_f32((const uint16_t *)src, wide, m);
    else
        hh_active->bf16_to_f32((const uint16_t *)src, wide, m);
    return wide;
}

void hh_sum_ranks(hh_kind kind, int n, const char *const *srcs, char *out, size_t m,
                  double factor) {
    size_t item = hh_kind_size(kind, 0);
    if (n == 2 && kind == HH_F32) {
        sum_two_f32((const float *)srcs[0], (const float *)srcs[1], (float *)out, m,
                    (float)factor);
        return;
    }
    if (n == 2 && kind == HH_F64) {
        sum_two_f64((const double *)srcs[0], (const double *)srcs[1], (double *)out, m, factor);
        return;
    }
    if (n == 2 && factor == 1.0 && (kind == HH_F16 || kind == HH_BF16)) {
        /* one rounding of the float32 sum: what the MPI operation's kernels do */
        const uint16_t *a = (const uint16_t *)srcs[0], *b = (const uint16_t *)srcs[1];
        if (kind == HH_F16)
            hh_active->sum_f16(a, b, (uint16_t *)out, m);
        else
            hh_active->sum_bf16(a, b, (uint16_t *)out, m);
        return;
    }
    for (size_t k0 = 0; k0 < m; k0 += BLOCK) {
        size_t b = m - k0 < BLOCK ? m - k0 : BLOCK;
        if (kind == HH_F64) {
            double acc[BLOCK];
            memcpy(acc, srcs[0] + k0 * item, b * item);
            for (int q = 1; q < n; q++) {
                const double *s = (const double *)(srcs[q] + k0 * item);
                for (size_t k = 0; k < b; k++)
                    acc[k] += s[k];
            }
            hh_convert(HH_F64, acc, HH_F64, out + k0 * item, b, 8, factor);
            continue;
        }
        float acc[BLOCK], wide[BLOCK];
        const float *first = as_f32(kind, srcs[0] + k0 * item, acc, b);
        if (first != acc)
            memcpy(acc, first, b * sizeof(float));
        for (int q = 1; q < n; q++) {
            const float *s = as_f32(kind, srcs[q] + k0 * item, wide, b);
            for (size_t k = 0; k < b; k++)
                acc[k] += s[k];
        }
        hh_convert(HH_F32, acc, kind, out + k0 * item, b, 4, factor);
    }
}

/* The segments of bytes [a, b) of the group in column `column` (0: inputs, 1: outputs) of
 * `table`, starting from row `row` at group offset `start`; returns how many. */
static size_t segments(const uint64_t *table, int column, size_t row, size_t start, size_t a,
                       size_t b, struct iovec *out) {
    size_t count = 0;
    for (size_t at = start; at < b; row++) {
        size_t len = (size_t)table[row * 3 + 2];
        size_t lo = a > at ? a : at, hi = b < at + len ? b : at + len;
        if (hi > lo) {
            out[count].iov_base = (char *)(uintptr_t)table[row * 3 + column] + (lo - at);
            out[count].iov_len = hi - lo;
            count++;
        }
        at += len;
    }
    return count;
}

static int fail(char *error, size_t size, const char *what, int q, long pid) {
    snprintf(error, size, "%s rank %d's tensors (pid %ld): %s", what, q, pid, strerror(errno));
    return -1;
}

int hh_peer_reduce(const hh_peer_job *job, char *error, size_t error_size) {
    const size_t count = job->count;
    const int n = job->n, r = job->rank;
    const uint64_t *own = job->tables + (size_t)r * count * 3;
    for (int q = 0; q < n; q++)
        for (size_t i = 0; i < count; i++)
            if (job->tables[((size_t)q * count + i) * 3 + 2] != own[i * 3 + 2]) {
                snprintf(error, error_size, "rank %d's tensor %zu has %llu bytes, this rank's %llu",
                         q, i, (unsigned long long)job->tables[((size_t)q * count + i) * 3 + 2],
                         (unsigned long long)own[i * 3 + 2]);
                return -1;
            }
    if (job->hi <= job->lo)
        return 0;
    const size_t item = hh_kind_size(job->kind, 0);
    struct iovec *local = malloc(2 * (count ? count : 1) * sizeof(struct iovec));
    const char **srcs = malloc((size_t)n * sizeof(char *));
    if (local == NULL || srcs == NULL) {
        free(local);
        free(srcs);
        snprintf(error, error_size, "out of memory");
        return -1;
    }
    struct iovec *remote = local + count;
    int status = 0;
    size_t row = 0, start = 0; /* the row holding byte `a`, and its offset in the group */
    for (size_t a = job->lo, b; a < job->hi && status == 0; a = b) {
        b = job->hi - a < HH_PEER_CHUNK ? job->hi : a + HH_PEER_CHUNK;
        while (start + (size_t)own[row * 3 + 2] <= a)
            start += (size_t)own[row++ * 3 + 2];
        /* 1. every peer's slice of its inputs, into scratch */
        for (int q = 0, slot = 0; q < n && status == 0; q++) {
            if (q == r)
                continue;
            const uint64_t *theirs = job->tables + (size_t)q * count * 3;
            size_t m = segments(theirs, 0, row, start, a, b, remote);
            char *dst = job->scratch + (size_t)slot++ * HH_PEER_CHUNK;
            for (size_t k = 0; k < m; k++) {
                local[k].iov_base = dst;
                local[k].iov_len = remote[k].iov_len;
                dst += remote[k].iov_len;
            }
            if (transfer(job->pids[q], local, remote, m, 0) != 0)
                status = fail(error, error_size, "reading", q, job->pids[q]);
        }
        if (status != 0)
            break;
        /* 2. the sum, tensor by tensor, into this rank's outputs */
        size_t m = segments(own, 0, row, start, a, b, local);
        segments(own, 1, row, start, a, b, remote);
        size_t offset = 0; /* of the segment in the chunk */
        for (size_t k = 0; k < m; k++) {
            for (int q = 0, slot = 0; q < n; q++)
                srcs[q] = q == r ? (const char *)local[k].iov_base
                                 : job->scratch + (size_t)slot++ * HH_PEER_CHUNK + offset;
            hh_sum_ranks(job->kind, n, srcs, remote[k].iov_base, local[k].iov_len / item,
                       job->factor);
            offset += local[k].iov_len;
        }
        /* 3. the result, from this rank's outputs into every peer's */
        for (size_t k = 0; k < m; k++)
            local[k] = remote[k];
        for (int q = 0; q < n && status == 0; q++) {
            if (q == r)
                continue;
            segments(job->tables + (size_t)q * count * 3, 1, row, start, a, b, remote);
            if (transfer(job->pids[q], local, remote, m, 1) != 0)
                status = fail(error, error_size, "writing into", q, job->pids[q]);
        }
    }
    free(local);
    free(srcs);
    return status;
}
