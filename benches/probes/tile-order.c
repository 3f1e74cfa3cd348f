// How fast one core streams a large matrix of 3,360-byte tiles (a Q6_K lanes-layout tile: 16 rows x 210 bytes) from
// memory, reading each tile's 64-byte vectors front to back, or in the order the VNNI Q6_K row groups would take them
// were the word runs laid out in the block's order (the group scales near the tile's end first, then three runs a
// kilobyte apart by turns, the rows' d last). A probe of the CPU's prefetchers, not of the engine.
//
//   gcc -O2 -mavx512f benches/probes/tile-order.c -o /tmp/tile-order && taskset -c 1 /tmp/tile-order
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

enum { TILE = 3360, VECTORS = 53 };

int main(void) {
    size_t n = (size_t)361 << 20; // the default target's Q6_K head and down projections are about this size
    char *buf = aligned_alloc(2 << 20, n + 4096);
    if (!buf) return 1;
    memset(buf, 1, n + 4096);
    int in_order[VECTORS], old_order[VECTORS] = {48, 49, 50, 51, 0, 1, 2, 3, 8, 9, 10, 11, 32, 33, 34, 35, 4, 5,
        6, 7, 12, 13, 14, 15, 36, 37, 38, 39, 16, 17, 18, 19, 24, 25, 26, 27, 40, 41, 42, 43, 20, 21, 22, 23, 28, 29,
        30, 31, 44, 45, 46, 47, 52};
    for (int i = 0; i < VECTORS; i++) in_order[i] = i;
    const char *names[2] = {"front to back", "the old kernel's order"};
    const int *orders[2] = {in_order, old_order};
    for (int rep = 0; rep < 3; rep++) {
        for (int o = 0; o < 2; o++) {
            __m512i acc = _mm512_setzero_si512();
            double t0 = now();
            for (size_t t = 0; t < n / TILE; t++) {
                const char *b = buf + t * TILE;
                for (int i = 0; i < VECTORS; i++)
                    acc = _mm512_add_epi32(acc, _mm512_loadu_si512(b + orders[o][i] * 64));
            }
            double dt = now() - t0;
            printf("%s: %.1f GB/s (%d)\n", names[o], n / dt / 1e9, _mm512_reduce_add_epi32(acc) & 1);
        }
    }
    free(buf);
    return 0;
}
