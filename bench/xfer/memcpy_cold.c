/* Single-thread memcpy baseline for cold blocks: copies BLOCK-byte blocks from one POOL-byte
 * buffer to another, walking both pools so every block misses the cache, for SECS seconds.
 * Prints "memcpy_cold block=<B> gbps=<GB/s>". A measurement tool, not product code.
 * Build: cc -O2 -o memcpy_cold memcpy_cold.c */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
    size_t block = argc > 1 ? strtoull(argv[1], 0, 0) : 65536;
    size_t pool = argc > 2 ? strtoull(argv[2], 0, 0) : (1ull << 30);
    double secs = argc > 3 ? atof(argv[3]) : 3.0;
    size_t n = pool / block;
    char *src = aligned_alloc(4096, n * block), *dst = aligned_alloc(4096, n * block);
    if (!src || !dst || n == 0) {
        fprintf(stderr, "allocation failed\n");
        return 1;
    }
    memset(src, 0x5a, n * block);
    memset(dst, 0xa5, n * block);
    size_t i = 0, copies = 0;
    double t0 = now(), t;
    while ((t = now()) - t0 < 0.5) { /* warm-up */
        memcpy(dst + i * block, src + i * block, block);
        i = (i + 1) % n;
    }
    t0 = now();
    do {
        for (int k = 0; k < 64; k++) {
            memcpy(dst + i * block, src + i * block, block);
            i = (i + 1) % n;
            copies++;
        }
    } while ((t = now()) - t0 < secs);
    printf("memcpy_cold block=%zu gbps=%.3f\n", block, (double)copies * block / (t - t0) / 1e9);
    return dst[block / 2] == 0x11; /* keep the copies observable */
}
