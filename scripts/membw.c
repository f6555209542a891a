/* Streaming-read memory bandwidth: T threads each sum their slice of one buffer much larger than
 * the last-level cache; the best of P passes is reported. Compiled on the fly by scripts/bench-backend
 * (cc -O3 -march=native -pthread), which is what a decode step does with the weights: read every byte
 * once per token, no writes.
 *
 * Usage: membw SIZE_MIB THREADS PASSES   ->  prints: "<bytes> <threads> <best_seconds> <GB/s>"
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct {
    const uint64_t *p;
    size_t n;
    uint64_t sum;
} slice_t;

static void *read_slice(void *arg) {
    slice_t *s = arg;
    const uint64_t *p = s->p;
    uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0, a4 = 0, a5 = 0, a6 = 0, a7 = 0;
    size_t i = 0;
    for (; i + 8 <= s->n; i += 8) { /* eight accumulators: the compiler keeps them in vector registers */
        a0 += p[i]; a1 += p[i + 1]; a2 += p[i + 2]; a3 += p[i + 3];
        a4 += p[i + 4]; a5 += p[i + 5]; a6 += p[i + 6]; a7 += p[i + 7];
    }
    for (; i < s->n; i++) a0 += p[i];
    s->sum = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7;
    return NULL;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    if (argc != 4) {
        fprintf(stderr, "usage: %s SIZE_MIB THREADS PASSES\n", argv[0]);
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]) << 20;
    int threads = atoi(argv[2]), passes = atoi(argv[3]);
    if (bytes == 0 || threads < 1 || threads > 1024 || passes < 1) {
        fprintf(stderr, "membw: bad arguments\n");
        return 2;
    }
    uint64_t *buf = aligned_alloc(4096, bytes);
    if (!buf) {
        fprintf(stderr, "membw: cannot allocate %zu bytes\n", bytes);
        return 1;
    }
    memset(buf, 1, bytes); /* fault every page in before timing */
    size_t words = bytes / sizeof(uint64_t), per = words / threads;
    pthread_t tid[1024];
    slice_t sl[1024];
    double best = 1e30;
    uint64_t check = 0;
    for (int pass = 0; pass < passes; pass++) {
        double t0 = now_s();
        for (int t = 0; t < threads; t++) {
            sl[t].p = buf + (size_t)t * per;
            sl[t].n = (t == threads - 1) ? words - (size_t)t * per : per;
            pthread_create(&tid[t], NULL, read_slice, &sl[t]);
        }
        for (int t = 0; t < threads; t++) {
            pthread_join(tid[t], NULL);
            check += sl[t].sum;
        }
        double dt = now_s() - t0;
        if (dt < best) best = dt;
    }
    if (check == 42) fprintf(stderr, "?\n"); /* keeps the sums live */
    printf("%zu %d %.6f %.3f\n", bytes, threads, best, bytes / best / 1e9);
    free(buf);
    return 0;
}
