/* The quantized GEMM of wq_gemm.c, shared with the fused step (step.c). */
#ifndef HELEXA_WQ_GEMM_H
#define HELEXA_WQ_GEMM_H
#include <immintrin.h>
#include <stddef.h>
#include <stdint.h>

/* y (M, N) = quantize_activations(x (M, K), rows ldx floats apart) @ W.T for a tiled weight: int4 (`q4`,
 * `zero_terms`) or int8 (`q8`, zero_terms NULL), its scales and zero terms float32 (half = 0) or float16
 * (half = 1). Returns 0, or -1 (y not written) when its activation buffer could not be allocated. See
 * wq_gemm.c for the layout and the requirements. */
int helexa_wq_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q4, const int8_t *q8,
                    const void *scales, const void *zero_terms, int64_t half, int64_t N, int64_t G, float *y);

/* helexa_wq_gemm, called by every thread of an enclosing parallel region (the fused step's team, csrc/step.c)
 * with the same arguments but `own`, plus `bias` ((N,) or NULL, added to y). Each thread quantizes x into its own
 * buffer `own` (helexa_wq_gemm_team_bytes(M, K) bytes; every thread's holds the same values), sets its own run
 * of `runs` (helexa_wq_gemm_runs_bytes(team size) bytes, shared, 64-byte aligned, zeroed before the team's first
 * call), computes that run's tiles and then what is left of the others', and waits at a barrier for the team, so
 * y is whole on return. A thread that looks at a run its owner has not yet set finds it empty (every run is
 * empty after a call) and leaves it to the owner. The same values as helexa_wq_gemm (and y += bias after it). */
void helexa_wq_gemm_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q4, const int8_t *q8,
                         const void *scales, const void *zero_terms, int64_t half, int64_t N, int64_t G,
                         const float *bias, float *y, void *runs, void *own);
size_t helexa_wq_gemm_team_bytes(int64_t M, int64_t K);
size_t helexa_wq_gemm_runs_bytes(int64_t threads);

/* Rows `ids` (R,) of a tiled weight dequantised into x (R, K) float32 (an embedding lookup). Returns 0, or
 * -3 (x not written) when an id is outside [0, N). See wq_gemm.c. */
int helexa_dequantize_rows(const uint8_t *q4, const int8_t *q8, const void *scales, const void *zero_terms,
                           int64_t half, int64_t N, int64_t K, int64_t G, const int64_t *ids, int64_t R, float *x);

/* 8 floats from float32 (half = 0) or float16 (half = 1) values at index i (F16C's exact widening). */
static inline __m256 hx_load8(const void *p, int64_t i, const int half) {
    if (half) return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i)));
    return _mm256_loadu_ps((const float *)p + i);
}

#ifdef __AVX512F__
/* 16 floats from float32 (half = 0) or float16 (half = 1) values at index i (exact widening). */
static inline __m512 hx_load16(const void *p, int64_t i, const int half) {
    if (half) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)((const uint16_t *)p + i)));
    return _mm512_loadu_ps((const float *)p + i);
}
#endif

/* The thread count of every parallel region of the library (helexa_set_threads, else OpenMP's). */
int helexa_threads(void);

/* for (int64_t i = 0; i < n; i++) { ... }: on helexa_threads() threads (OpenMP's static schedule) when `par`,
 * else on the calling thread without entering OpenMP. A `parallel for` whose `if` is false still sets up a team
 * of one (0.34 us against 0.04 for the bare loop with everything in cache, more after a GEMM has streamed its
 * weights through the caches), and a one-row step runs ~9 such loops a layer. Each iteration is computed the
 * same either way: neither changes a bit. */
#define HX_FOR(par, i, n, ...)                                                         \
    do {                                                                               \
        const int64_t hx_for_n = (n);                                                  \
        if (par) {                                                                     \
            _Pragma("omp parallel for schedule(static) num_threads(helexa_threads())") \
            for (int64_t i = 0; i < hx_for_n; i++) __VA_ARGS__                         \
        } else {                                                                       \
            for (int64_t i = 0; i < hx_for_n; i++) __VA_ARGS__                         \
        }                                                                              \
    } while (0)

#endif
