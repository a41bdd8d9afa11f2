/* Float sums through the node's shared window (see window.h). */
#define _GNU_SOURCE
#include "window.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "peer.h"

#define ALIGN 64                 /* slice bounds on cache lines, as shm._slice_bounds */
/* How a group goes, by its size. Slices go in rounds, which let a rank sum what the others
 * have copied while they copy the rest. Up to CACHED_BYTES the group stays in the caches, and
 * ordinary stores leave the peers' copies there for the rank that reads them: rounds of 1 MiB.
 * Larger groups do not fit, and streaming stores spare each line's read for ownership: rounds
 * of 256 KiB. Two ranks here, alternated, when MPI was quick (its 3.2 MB call at 0.70-0.85 ms):
 * 200 x 16 KiB in place 0.61-0.75 ms with ordinary stores in rounds of 1 MiB (about as in one
 * round), 0.69-0.79 in rounds of 256 KiB, 0.78-0.93 streaming; 200 x 64 KiB, 2.78-3.22 ms
 * streaming in rounds of 256 KiB, 3.25-3.67 with ordinary stores. */
#define CACHED_BYTES ((size_t)8 << 20)
#define CACHED_ROUND ((size_t)1 << 20)
#define STREAMED_ROUND ((size_t)256 << 10)
#define BLOCK ((size_t)64 * 1024) /* bytes summed before they are copied into the result */
/* The counters carry the reduction's number above the round's: every rank numbers its native
 * reductions alike, so a counter is never mistaken for one of the previous reduction. */
#define EPOCH_SHIFT 24
/* How a rank waits for the others: spinning, then, up to the job's yield_s (nonzero while a
 * thread of the rank waits for a result, see common/patience.py), sched_yield, which gives the
 * core to any other thread of it without leaving it idle; after that short sleeps, as
 * backends/waiting.py.
 * A vCPU that sleeps even 20 us comes back slowly: with sleeps from 50 us on, 200 x 16 KiB took
 * 0.12-0.25 ms more per batch than yielding up to 5-10 ms (1.34-1.39 against 1.15-1.17 ms, two
 * ranks, alternated). */
#define SPIN_S 50e-6
#define SHORT_SLEEP_S 0.01       /* sleeps of 20 us up to here, then of 200 us */
#define CHECK_EVERY_S 0.1

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void pause_briefly(double waited, double yield_s) {
    if (waited < SPIN_S) {
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        return;
    }
    if (waited < yield_s) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, waited < SHORT_SLEEP_S ? 20000 : 200000};
    nanosleep(&ts, NULL);
}

/* Bytes [lo, hi) of the group that rank q owns. */
static void slice_of(size_t total, int n, int q, size_t *lo, size_t *hi) {
    size_t per = (total + (size_t)n * ALIGN - 1) / ((size_t)n * ALIGN) * ALIGN;
    size_t a = (size_t)q * per;
    *lo = a < total ? a : total;
    *hi = *lo + per < total ? *lo + per : total;
}

/* memcpy into the window, with non-temporal stores where the CPU has them: for groups larger
 * than the caches, where an ordinary store would first read each line it writes (a read for
 * ownership) only for the line to be evicted before a peer reads it. */
static void copy_into_window(char *dst, const char *src, size_t n) {
#ifdef __SSE2__
    if (n >= 256) {
        size_t head = (16 - ((uintptr_t)dst & 15)) & 15;
        memcpy(dst, src, head);
        dst += head, src += head, n -= head;
        for (; n >= 64; dst += 64, src += 64, n -= 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)src);
            __m128i b = _mm_loadu_si128((const __m128i *)(src + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(src + 32));
            __m128i d = _mm_loadu_si128((const __m128i *)(src + 48));
            _mm_stream_si128((__m128i *)dst, a);
            _mm_stream_si128((__m128i *)(dst + 16), b);
            _mm_stream_si128((__m128i *)(dst + 32), c);
            _mm_stream_si128((__m128i *)(dst + 48), d);
        }
    }
#endif
    memcpy(dst, src, n);
}

/* Streaming stores are not ordered with the counter that publishes them: fence them first. */
static void fence_window_writes(void) {
#ifdef __SSE2__
    _mm_sfence();
#endif
}

/* One reduction's shape: the group's bytes, its rounds' and how its copies store. */
typedef struct {
    size_t total, round;
    int stream;
} shape;

/* Whether rank q's slice has a round k (k < 0: every rank counts). */
static int has_round(const shape *g, int n, int q, long k) {
    if (k < 0)
        return 1;
    size_t lo, hi;
    slice_of(g->total, n, q, &lo, &hi);
    return lo + (size_t)k * g->round < hi;
}

/* Wait until the counter `which` (0: written, 1: summed) of every other rank that has a round
 * k reaches `target`. 0; -1 with the ranks still behind named in `error`; -2 when interrupted. */
static int wait_for(const hh_window_job *job, int which, int64_t target, const shape *g, long k,
                    const char *phase, char *error, size_t error_size) {
    double start = 0.0, checked = 0.0;
    for (int q = 0; q < job->n; q++) {
        if (q == job->rank || !has_round(g, job->n, q, k))
            continue;
        const int64_t *theirs = job->flags + (size_t)q * HH_WINDOW_FLAG_STRIDE + which;
        while (__atomic_load_n(theirs, __ATOMIC_ACQUIRE) < target) {
            double t = now_s();
            if (start == 0.0)
                start = checked = t;
            if (job->timeout_s > 0 && t - start > job->timeout_s) {
                size_t used = (size_t)snprintf(error, error_size, "rank(s)");
                for (int p = 0; p < job->n && used < error_size; p++)
                    if (p != job->rank && has_round(g, job->n, p, k) &&
                        __atomic_load_n(job->flags + (size_t)p * HH_WINDOW_FLAG_STRIDE + which,
                                        __ATOMIC_ACQUIRE) < target)
                        used += (size_t)snprintf(error + used, error_size - used, " %d", p);
                if (used < error_size)
                    snprintf(error + used, error_size - used, " did not %s within %g s", phase,
                             job->timeout_s);
                return -1;
            }
            if (job->interrupted != NULL && t - checked > CHECK_EVERY_S) {
                checked = t;
                if (job->interrupted(job->context))
                    return -2;
            }
            pause_briefly(t - start, job->yield_s);
        }
    }
    return 0;
}

/* The row holding byte `at` of the group (rows start at starts[i]; empty rows are skipped). */
static size_t row_at(const size_t *starts, size_t count, size_t at) {
    size_t lo = 0, hi = count;
    while (hi - lo > 1) {
        size_t mid = lo + (hi - lo) / 2;
        if (starts[mid] <= at)
            lo = mid;
        else
            hi = mid;
    }
    return lo;
}

/* Into the window, streaming or not. */
static void store(const shape *g, char *dst, const char *src, size_t n) {
    if (g->stream)
        copy_into_window(dst, src, n);
    else
        memcpy(dst, src, n);
}

/* Bytes [a, b) of the group: from this rank's inputs into `window` (at their offsets in the
 * group) when `in`, from `window` into its outputs otherwise. */
static void copy_range(const hh_window_job *job, const shape *g, const size_t *starts, size_t a,
                       size_t b, char *window, int in) {
    for (size_t i = row_at(starts, job->count, a); i < job->count && starts[i] < b; i++) {
        size_t at = starts[i], len = (size_t)job->table[i * 3 + 2];
        size_t x = at > a ? at : a, y = at + len < b ? at + len : b;
        if (y <= x)
            continue;
        if (in)
            store(g, window + x, (const char *)(uintptr_t)job->table[i * 3] + (x - at), y - x);
        else
            memcpy((char *)(uintptr_t)job->table[i * 3 + 1] + (x - at), window + x, y - x);
    }
}

/* Round k of every other rank's slice: into this rank's segment (`in`), or out of the result. */
static void copy_round(const hh_window_job *job, const shape *g, const size_t *starts, size_t k,
                       char *window, int in) {
    for (int q = 0; q < job->n; q++) {
        size_t lo, hi;
        slice_of(g->total, job->n, q, &lo, &hi);
        size_t a = lo + k * g->round, b = a + g->round < hi ? a + g->round : hi;
        if (q != job->rank && a < b)
            copy_range(job, g, starts, a, b, window, in);
    }
}

/* Bytes [a, b) of this rank's slice: summed from its inputs and the peers' segments into its
 * outputs, and copied into the result. */
static void sum_range(const hh_window_job *job, const shape *g, const size_t *starts, size_t a,
                      size_t b, const char **srcs) {
    const int n = job->n, r = job->rank;
    const size_t item = hh_kind_size(job->kind, 0);
    char *result = job->slot + (size_t)n * job->capacity;
    for (size_t i = row_at(starts, job->count, a); i < job->count && starts[i] < b; i++) {
        size_t at = starts[i], len = (size_t)job->table[i * 3 + 2];
        const char *in = (const char *)(uintptr_t)job->table[i * 3];
        char *out = (char *)(uintptr_t)job->table[i * 3 + 1];
        size_t x0 = at > a ? at : a, y = at + len < b ? at + len : b;
        for (size_t x = x0, z; x < y; x = z) {
            z = y - x < BLOCK ? y : x + BLOCK;
            for (int q = 0; q < n; q++)
                srcs[q] = q == r ? in + (x - at) : job->slot + (size_t)q * job->capacity + x;
            hh_sum_ranks(job->kind, n, srcs, out + (x - at), (z - x) / item, job->factor);
            store(g, result + x, out + (x - at), z - x);
        }
    }
}

static int reduce(const hh_window_job *job, const shape *g, const size_t *starts,
                  const char **srcs, char *error, size_t error_size) {
    const int r = job->rank;
    size_t per = (g->total + (size_t)job->n * ALIGN - 1) / ((size_t)job->n * ALIGN) * ALIGN;
    size_t rounds = (per + g->round - 1) / g->round, lo, hi;
    slice_of(g->total, job->n, r, &lo, &hi);
    int64_t *written = job->flags + (size_t)r * HH_WINDOW_FLAG_STRIDE, *summed = written + 1;
    int64_t base = ((__atomic_load_n(written, __ATOMIC_RELAXED) >> EPOCH_SHIFT) + 1)
                   << EPOCH_SHIFT;
    char *segment = job->slot + (size_t)r * job->capacity;
    char *result = job->slot + (size_t)job->n * job->capacity;
    int status;
    for (size_t k = 0; k <= rounds; k++) {
        if (k < rounds) {
            copy_round(job, g, starts, k, segment, 1);
            if (g->stream)
                fence_window_writes();
            __atomic_store_n(written, base + (int64_t)k + 1, __ATOMIC_RELEASE);
            size_t a = lo + k * g->round, b = a + g->round < hi ? a + g->round : hi;
            if (a < b) {
                status = wait_for(job, 0, base + (int64_t)k + 1, g, -1,
                                  "write their part of the group", error, error_size);
                if (status != 0)
                    return status;
                sum_range(job, g, starts, a, b, srcs);
                if (g->stream)
                    fence_window_writes();
                __atomic_store_n(summed, base + (int64_t)k + 1, __ATOMIC_RELEASE);
            }
        }
        if (k >= 1) { /* a round behind: the others had the time to sum it */
            status = wait_for(job, 1, base + (int64_t)k, g, (long)k - 1,
                              "sum their slice of the group", error, error_size);
            if (status != 0)
                return status;
            copy_round(job, g, starts, k - 1, result, 0);
        }
    }
    return 0;
}

int hh_window_reduce(const hh_window_job *job, char *error, size_t error_size) {
    size_t *starts = malloc((job->count + 1) * sizeof(size_t));
    const char **srcs = malloc((size_t)job->n * sizeof(char *));
    int status = -1;
    if (starts == NULL || srcs == NULL) {
        snprintf(error, error_size, "out of memory for a group of %zu tensors", job->count);
        goto done;
    }
    size_t total = 0;
    for (size_t i = 0; i < job->count; i++) {
        starts[i] = total;
        total += (size_t)job->table[i * 3 + 2];
    }
    starts[job->count] = total;
    shape g = {total, total <= CACHED_BYTES ? CACHED_ROUND : STREAMED_ROUND,
               total > CACHED_BYTES};
    status = total == 0 ? 0 : reduce(job, &g, starts, srcs, error, error_size);
done:
    free(starts);
    free(srcs);
    return status;
}
