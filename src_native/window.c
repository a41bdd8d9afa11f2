/* Float sums through the node's shared window (see window.h). */
#define _GNU_SOURCE
#include "window.h"

#include <stdio.h>
#include <string.h>
#include <sched.h>
#include <time.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#include "peer.h"

#define ALIGN 64                 /* slice bounds on cache lines, as shm._slice_bounds */
#define BLOCK ((size_t)64 * 1024) /* bytes summed before they are copied into the result */
/* How an arrival waits: spinning, then, up to the job's yield_s (nonzero while a thread of the
 * rank waits for a result, see common/patience.py), sched_yield, which gives the core to any
 * other thread of it without leaving it idle; after that short sleeps, as backends/waiting.py.
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

/* Bump this rank's counter, then wait until every rank's has reached it. */
static int arrive(const hh_window_job *job, const char *phase, char *error, size_t error_size) {
    int64_t *mine = job->flags + (size_t)job->rank * HH_WINDOW_FLAG_STRIDE;
    int64_t target = __atomic_load_n(mine, __ATOMIC_RELAXED) + 1;
    __atomic_store_n(mine, target, __ATOMIC_RELEASE); /* this rank's writes before it */
    double start = 0.0, checked = 0.0;
    for (int q = 0; q < job->n; q++) {
        const int64_t *theirs = job->flags + (size_t)q * HH_WINDOW_FLAG_STRIDE;
        while (__atomic_load_n(theirs, __ATOMIC_ACQUIRE) < target) {
            double t = now_s();
            if (start == 0.0)
                start = checked = t;
            if (job->timeout_s > 0 && t - start > job->timeout_s) {
                size_t used = (size_t)snprintf(error, error_size, "rank(s)");
                for (int p = 0; p < job->n && used < error_size; p++)
                    if (__atomic_load_n(job->flags + (size_t)p * HH_WINDOW_FLAG_STRIDE,
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

/* memcpy into the window, with non-temporal stores where the CPU has them. The other ranks read
 * what a rank writes there, so its lines sit in their caches: an ordinary store first takes
 * each line back from them (a read for ownership, a cross-core round trip per 64 bytes), a
 * streaming store does not. 200 x 16 KiB summed between two ranks: 0.88-0.98 ms against
 * 1.05-1.11 ms; 50 x 16 KiB: 0.23 ms against 0.48-0.53 ms. */
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

/* Streaming stores are not ordered with the arrival that publishes them: fence them first. */
static void fence_window_writes(void) {
#ifdef __SSE2__
    _mm_sfence();
#endif
}

/* Copy the parts of the group outside [lo, hi): from this rank's inputs into `window` (at their
 * offsets in the group) when `in`, from `window` into this rank's outputs otherwise. */
static void copy_outside(const hh_window_job *job, size_t lo, size_t hi, char *window, int in) {
    size_t at = 0;
    for (size_t i = 0; i < job->count; i++) {
        char *tensor = (char *)(uintptr_t)job->table[i * 3 + (in ? 0 : 1)];
        size_t len = (size_t)job->table[i * 3 + 2];
        size_t parts[2][2] = {{at, at + len < lo ? at + len : lo},
                              {at > hi ? at : hi, at + len}};
        for (int k = 0; k < 2; k++) {
            size_t a = parts[k][0], b = parts[k][1];
            if (b <= a)
                continue;
            if (in)
                copy_into_window(window + a, tensor + (a - at), b - a);
            else
                memcpy(tensor + (a - at), window + a, b - a);
        }
        at += len;
    }
}

int hh_window_reduce(const hh_window_job *job, char *error, size_t error_size) {
    const int n = job->n, r = job->rank;
    const size_t item = hh_kind_size(job->kind, 0);
    size_t total = 0;
    for (size_t i = 0; i < job->count; i++)
        total += (size_t)job->table[i * 3 + 2];
    size_t lo, hi;
    slice_of(total, n, r, &lo, &hi);
    char *result = job->slot + (size_t)n * job->capacity;
    copy_outside(job, lo, hi, job->slot + (size_t)r * job->capacity, 1);
    fence_window_writes();
    int status = arrive(job, "write their part of the group", error, error_size);
    if (status != 0)
        return status;
    const char *srcs[n];
    size_t at = 0;
    for (size_t i = 0; i < job->count && at < hi; i++) {
        size_t len = (size_t)job->table[i * 3 + 2];
        size_t a = at > lo ? at : lo, b = at + len < hi ? at + len : hi;
        const char *in = (const char *)(uintptr_t)job->table[i * 3];
        char *out = (char *)(uintptr_t)job->table[i * 3 + 1];
        for (size_t c = a, d; c < b; c = d) {
            d = b - c < BLOCK ? b : c + BLOCK;
            for (int q = 0; q < n; q++)
                srcs[q] = q == r ? in + (c - at) : job->slot + (size_t)q * job->capacity + c;
            hh_sum_ranks(job->kind, n, srcs, out + (c - at), (d - c) / item, job->factor);
            copy_into_window(result + c, out + (c - at), d - c);
        }
        at += len;
    }
    fence_window_writes();
    status = arrive(job, "sum their slice of the group", error, error_size);
    if (status != 0)
        return status;
    copy_outside(job, lo, hi, result, 0);
    return 0;
}
