/* Weight-only quantized GEMM for x86-64 CPUs with AVX2: y (M, N) = x (M, K) @ W.T, in float32.
 *
 * Activations are quantized on entry, per row and per block of 32 values, to int8 with one float32
 * scale (d = max|x| / 127, xq = round(x / d)): the scheme llama.cpp's CPU backend uses for its
 * activations. Products are integer dot products, and the weight is laid out so that 64 bytes hold 4
 * consecutive k of 16 output columns (int8; int4: two such chunks, in the low and high nibbles): one
 * broadcast of 4 activation bytes then yields 64 multiply-adds into 16 int32 lanes, one lane per
 * output column, summed over a block of 32 k before a single float conversion. The `avx512_vnni` path
 * (helexa.model.quant.isa, HX_VNNI) takes a tile's 16 columns in one 512-bit register by vpdpbusd, with
 * no reduction across lanes; the `avx2` path takes them 8 at a time (maddubs + madd + add on 256-bit
 * registers; a GEMM of few rows both halves of a block at once, of more rows one half of a tile at a time).
 * The `avx512_amx` path (HX_AMX) is the avx512_vnni build plus AMX: a GEMM's whole tiles of 16 rows take
 * one tile product per block and tile of columns (amx_tile), the other rows as on avx512_vnni.
 * Integer sums are exact and the float operations per column the same, so every path gives the same
 * result. Each weight chunk is decoded once per tile of rows, so a batch of decoding streams shares one
 * pass over the weight. Per column n, group g, block b:
 *
 *   int4: W = (q - 8) * s + z  ->  y += s_g * d_b * sum(q * xq) + (z_g - 8 s_g) * d_b * sum(xq)
 *   int8: W = q * s            ->  y += s_g * d_b * sum(q * xq)
 *
 * so y is exactly x_hat @ W.T, x_hat = d * xq (the activations' int8 round trip), up to the order of
 * the float32 sums.
 *
 * Weight layout ("tiled", made once by the caller), for each tile of 16 columns: int8, for each chunk of
 * 4 k, 64 bytes, byte v = value v = 4 * column + k_in_chunk; int4, for each pair of chunks (8 k), 64
 * bytes, byte v holding value v of the first chunk in its low nibble and of the second in its high
 * nibble. Scales and zero terms (z - 8 s) are laid out [tile][group][16], all float32 or all float16
 * (`half`: the caller stores them in half precision only when that is exact, as for GGUF files, whose
 * scales are float16; it halves the bytes they add to each pass over the weight).
 * Requirements (checked by the caller): N % 16 == 0, K % G == 0, G % 32 == 0, arrays contiguous.
 * Threads: OpenMP over column tiles, in the runtime the process has loaded (torch's libgomp), as many
 * as the caller last set with helexa_set_threads (torch's intra-op count: a thread that is not the
 * one torch.set_num_threads ran on would otherwise get OpenMP's default, every core). Each thread
 * owns a contiguous run of tiles and takes it from the front; one whose run is done takes what is
 * left of another's from the back (take_tiles). A tile's columns are computed the same whichever
 * thread takes it, so the result never depends on the split. helexa_wq_gemm opens a region of its own;
 * helexa_wq_gemm_team runs on the threads of the caller's (the fused step's, csrc/step.c), each of
 * which quantizes the activations itself and sets its own run.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <omp.h>

#include "wq_gemm.h"

static int threads = 0; /* set by the caller (torch's intra-op thread count); 0: OpenMP's default */

void helexa_set_threads(int64_t n) { threads = n > 0 ? (int)n : 0; }

int helexa_threads(void) { return threads > 0 ? threads : omp_get_max_threads(); }

#define QK 32 /* activation values per block */
#define NR 16 /* output columns per tile (one int32 lane each; AVX2 takes them 8 at a time) */
#define MR 4  /* activation rows per register tile */
/* Weights are read ahead of their use by software prefetch (into the next tiles: they are contiguous),
 * two ways by the GEMM's row count. Measured on a Zen 4 EPYC, 2 threads, over a 1B model's shapes and
 * weights far larger than the caches, on 2 MiB pages (hugepages.py), in the VM's slow (~34 GB/s) and fast
 * (~52 GB/s) bandwidth modes, alternating:
 * - 1 or 2 rows (`SHALLOW_ROWS`): int4 weights 4 KiB ahead into L1 (one-row int4 GEMMs went from ~63% to ~94%
 *   of one thread's read bandwidth on 4 KiB pages), int8 weights, twice the bytes per multiply, by the
 *   hardware prefetcher alone. Deeper prefetch into L2 read 21-30% slower in the fast mode at one row.
 * - 3 rows or more: both PREFETCH_DEEP bytes ahead into L2, where more reads stay in flight than for L1:
 *   there each weight byte takes longer to use, and the shallow way left the memory idle between reads.
 *   At 4 rows it read 6% (int4) and 1% (int8) faster in the slow mode and 12% and 27% faster in the fast
 *   one; at 8 rows 19% and 20% faster in either mode. */
#define SHALLOW_ROWS 2
#define PREFETCH 4096
#define PREFETCH_DEEP 8192

/* Block b's weight lines (int4: 4, int8: 8) ahead of their use: `deep` for GEMMs of more than SHALLOW_ROWS rows. */
static inline __attribute__((always_inline)) void prefetch_block(const uint8_t *w4, const int8_t *w8, int64_t b,
                                                                 const int deep) {
    if (deep) {
        const char *at = w4 ? (const char *)(w4 + b * QK * NR / 2) : (const char *)(w8 + b * QK * NR);
        const int lines = (w4 ? QK * NR / 2 : QK * NR) / 64;
        for (int l = 0; l < lines; l++) _mm_prefetch(at + PREFETCH_DEEP + 64 * l, _MM_HINT_T1);
    } else if (w4) {
        for (int l = 0; l < 4; l++) _mm_prefetch((const char *)(w4 + b * QK * NR / 2 + PREFETCH + 64 * l), _MM_HINT_T0);
    }
}

#if defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define HX_VNNI 1 /* the avx512_vnni build (helexa.model.quant.isa): vpdpbusd on 512-bit registers */
#endif
#if defined(__AMX_INT8__) || defined(HX_AMX_EMULATE)
#define HX_AMX 1 /* the avx512_amx build: whole tiles of 16 rows by AMX, the rest as on avx512_vnni */
#ifndef HX_VNNI
#error "the AMX build is the avx512_vnni build plus AMX-TILE and AMX-INT8"
#endif
#include <errno.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "amx.h"
#define AMX_ROWS 16 /* rows per A tile; GEMMs of fewer rows take the vpdpbusd path alone */
static int amx_granted = 0; /* set by helexa_amx_enable: no tile instruction runs before Linux grants them */
#endif

/* x (M, K), rows ldx floats apart -> xq (M, K) int8, d (M, K/32) scales, xs (M, K/32) = d * sum(xq) per
 * block and qs the same integer sums. Rounds x * (1 / d) to nearest, ties to even, as torch.round does
 * (the reference, quantize_activations). */
static void quantize_rows(const float *x, int64_t M, int64_t K, int64_t ldx, int8_t *xq, float *d, float *xs,
                          int32_t *qs) {
    const int64_t n = M * (K / QK), blocks = K / QK;
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7); /* undo the packs' lane interleave */
    HX_FOR(n > 512 && !omp_in_parallel(), i, n, { /* on one thread inside a team (helexa_wq_gemm_team) */
        const float *v = x + (i / blocks) * ldx + (i % blocks) * QK;
        __m256 f[4];
        __m256 amax = _mm256_setzero_ps();
        for (int j = 0; j < 4; j++) {
            f[j] = _mm256_loadu_ps(v + 8 * j);
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, f[j]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float di = _mm_cvtss_f32(m) / 127.0f, inv = di > 0.0f ? 1.0f / di : 0.0f;
        const __m256 iv = _mm256_set1_ps(inv);
        __m256i q[4];
        for (int j = 0; j < 4; j++)
            q[j] = _mm256_cvtps_epi32(
                _mm256_round_ps(_mm256_mul_ps(f[j], iv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        __m256i sum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(sum), _mm256_extracti128_si256(sum, 1));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
        s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
        const __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
        _mm256_storeu_si256((__m256i *)(xq + i * QK), _mm256_permutevar8x32_epi32(packed, order));
        d[i] = di;
        qs[i] = _mm_cvtsi128_si32(s4);
        xs[i] = di * (float)qs[i];
    });
}

/* The integer dot products of one block of 32 k for rows [0, R) of a tile's 8 columns [8 h, 8 h + 8)
 * (AVX2) or 16 columns (avx512_vnni): lane n of isum[r] = sum over the block's k of q[n][k] *
 * xq[r][k0 + k], exact in int32, where q is the tile's int4 value in [0, 15] (`w4`: the block's 256
 * bytes) or its int8 value (`w8`: its 512 bytes). The avx512_vnni build returns the int8 sums with
 * q + 128 in place of q (the caller takes 128 * sum(xq) back). Every variant sums the same products
 * exactly, so all give the same int32 sums. */
#ifdef HX_VNNI
/* 512-bit vpdpbusd; a 32-bit lane per column, so the block's sums need no reduction across lanes. The
 * block is 4 pairs of chunks of 4 k of the 16 columns: int4, 64 bytes a pair, the first chunk in the low
 * nibbles and the second in the high; int8, 64 bytes a chunk, made unsigned by q ^ 0x80 = q + 128. One
 * broadcast of 4 activation bytes per chunk feeds 64 multiply-adds; the pair's two chunks go to two
 * accumulators per row, which halves the chain of dependent vpdpbusd. */
static inline __attribute__((always_inline)) void block_sums(const int8_t *const *xr, int64_t k0, const uint8_t *w4,
                                                             const int8_t *w8, const int R, __m512i *isum) {
    const __m512i mask = _mm512_set1_epi8(0x0F), bias = _mm512_set1_epi8((char)0x80);
    __m512i a0[MR], a1[MR];
    for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_si512();
    for (int p = 0; p < QK / 8; p++) {
        __m512i u0, u1; /* the pair's chunks, unsigned */
        if (w4) {
            const __m512i raw = _mm512_loadu_si512((const void *)(w4 + p * 4 * NR));
            u0 = _mm512_and_si512(raw, mask);
            u1 = _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask);
        } else {
            u0 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w8 + 2 * p * 4 * NR)), bias);
            u1 = _mm512_xor_si512(_mm512_loadu_si512((const void *)(w8 + (2 * p + 1) * 4 * NR)), bias);
        }
        for (int r = 0; r < R; r++) {
            int32_t fa, fb;
            memcpy(&fa, xr[r] + k0 + 8 * p, sizeof fa);
            memcpy(&fb, xr[r] + k0 + 8 * p + 4, sizeof fb);
            a0[r] = _mm512_dpbusd_epi32(a0[r], u0, _mm512_set1_epi32(fa));
            a1[r] = _mm512_dpbusd_epi32(a1[r], u1, _mm512_set1_epi32(fb));
        }
    }
    for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(a0[r], a1[r]);
}
#else
/* AVX2: the 32 bytes of columns [8 h, 8 h + 8) of a pair of chunks (int4: the low nibbles the first chunk,
 * the high the second), or of each chunk of the pair (int8), fill a 256-bit register per chunk: one
 * broadcast of 4 activation bytes then yields 32 multiply-adds (maddubs + madd). Each int4 pair's 32
 * bytes are loaded once. */
static inline __attribute__((always_inline)) void block_sums(const int8_t *const *xr, int64_t k0, const uint8_t *w4,
                                                             const int8_t *w8, const int R, const int h,
                                                             __m256i *isum) {
    const __m256i ones = _mm256_set1_epi16(1), mask = _mm256_set1_epi8(0x0F);
    for (int r = 0; r < R; r++) isum[r] = _mm256_setzero_si256();
    for (int p = 0; p < QK / 8; p++) {
        __m256i w[2];
        if (w4) {
            const __m256i raw = _mm256_loadu_si256((const __m256i *)(w4 + p * 4 * NR + 32 * h));
            w[0] = _mm256_and_si256(raw, mask);
            w[1] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), mask);
        } else {
            w[0] = _mm256_loadu_si256((const __m256i *)(w8 + 2 * p * 4 * NR + 32 * h));
            w[1] = _mm256_loadu_si256((const __m256i *)(w8 + (2 * p + 1) * 4 * NR + 32 * h));
        }
        for (int c = 0; c < 2; c++) {
            const __m256i wu = w4 ? w[c] : _mm256_sign_epi8(w[c], w[c]); /* int8: |w| as unsigned */
            for (int r = 0; r < R; r++) {
                int32_t four;
                memcpy(&four, xr[r] + k0 + 8 * p + 4 * c, sizeof four);
                __m256i xv = _mm256_set1_epi32(four); /* these 4 k for all 8 columns */
                if (w4) { /* int16 lanes hold at most 8 chunks x 2 x 15 x 127 = 30480: no overflow */
                    isum[r] = _mm256_add_epi16(isum[r], _mm256_maddubs_epi16(wu, xv));
                } else {
                    xv = _mm256_sign_epi8(xv, w[c]); /* carry w's sign onto x */
                    isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(_mm256_maddubs_epi16(wu, xv), ones));
                }
            }
        }
        /* Each row's sum held in a register here: otherwise GCC reassociated the block's 8 R integer additions
         * into trees over every product, which it spilled to the stack (alone, this made a 64-row int4 GEMM
         * 1.34x faster on a Zen 3 EPYC; int8 1.10x). */
        for (int r = 0; r < R; r++) __asm__("" : "+x"(isum[r]));
    }
    if (w4)
        for (int r = 0; r < R; r++) isum[r] = _mm256_madd_epi16(isum[r], ones);
}
#endif

#ifdef HX_VNNI
/* The scales and zero terms of a tile's 16 columns for the group of the block being summed. */
typedef struct {
    int64_t g, left; /* the group, and its blocks still to come: no division in the block loop */
    __m512 sv, zv;
} group16;

static inline __attribute__((always_inline)) group16 group16_start(void) {
    return (group16){-1, 0, _mm512_setzero_ps(), _mm512_setzero_ps()};
}

/* Called once per block, in order: loads the next group's scales (and zero terms) where the block starts one. */
static inline __attribute__((always_inline)) void group16_next(group16 *gs, int64_t per_group, const void *s,
                                                              const void *zc, const int half) {
    if (gs->left-- == 0) {
        gs->g++;
        gs->left = per_group - 1;
        gs->sv = hx_load16(s, gs->g * NR, half);
        if (zc) gs->zv = hx_load16(zc, gs->g * NR, half);
    }
}

/* acc + isum * (s_g * d_b), then + z_g * xs_b (zero terms only): a block's float operations per column. */
static inline __attribute__((always_inline)) __m512 block16_add(__m512 acc, __m512i isum, const group16 *gs, float d,
                                                               float xs, const int zero_terms) {
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(gs->sv, _mm512_set1_ps(d)), acc);
    return zero_terms ? _mm512_fmadd_ps(gs->zv, _mm512_set1_ps(xs), acc) : acc;
}
#endif

#ifndef HX_VNNI
/* AVX2: block b (of group g) of columns [8 h, 8 h + 8) of rows [m0, m0 + R) added to acc (R): its integer sums,
 * then isum * (s_g * d_b) and z_g * xs_b per column, in that order. The one block step of both ways `tile` runs. */
static inline __attribute__((always_inline)) void half_block(const int8_t *const *xr, const float *d, const float *xs,
                                                             int64_t blocks, int64_t b, int64_t g, const uint8_t *w4,
                                                             const int8_t *w8, const void *s, const void *zc,
                                                             const int half, int64_t m0, const int R, const int h,
                                                             __m256 *acc) {
    __m256i isum[MR];
    block_sums(xr, b * QK, w4 ? w4 + b * QK * NR / 2 : NULL, w8 ? w8 + b * QK * NR : NULL, R, h, isum);
    const __m256 sv = hx_load8(s, g * NR + 8 * h, half); /* from L1: registers are short here */
    const __m256 zv = zc ? hx_load8(zc, g * NR + 8 * h, half) : _mm256_setzero_ps();
    for (int r = 0; r < R; r++) {
        const int64_t row = (m0 + r) * blocks + b;
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(sv, _mm256_set1_ps(d[row])), acc[r]);
        if (zc) acc[r] = _mm256_fmadd_ps(zv, _mm256_set1_ps(xs[row]), acc[r]);
    }
}

/* AVX2: columns [8 h, 8 h + 8) of rows [m0, m0 + R) of one tile, over every block (R and h constants at each
 * call site): `tile` for rows enough that the arithmetic, not the memory, bounds the GEMM. Its R accumulators,
 * not both halves' 2 R, then stay in the 16 registers with the block's sums and weights (on a Zen 3 EPYC, 64-row
 * GEMMs a further 1.17x faster (int4) and 1.21x (int8) than with both halves a block). A column's float
 * operations are `tile`'s, in the same order. */
static inline __attribute__((always_inline)) void tile_half(const int8_t *const *xr, const float *d, const float *xs,
                                                            int64_t blocks, int64_t per_group, const uint8_t *w4,
                                                            const int8_t *w8, const void *s, const void *zc,
                                                            const int half, int64_t m0, const int R, const int h,
                                                            int64_t N, int64_t n0, float *y, const int deep) {
    __m256 acc[MR];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    int64_t g = -1, left = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (left-- == 0) {
            g++;
            left = per_group - 1;
        }
        if (h == 0) prefetch_block(w4, w8, b, deep); /* the second half's lines are in the caches by then */
        half_block(xr, d, xs, blocks, b, g, w4, w8, s, zc, half, m0, R, h, acc);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(y + (m0 + r) * N + n0 + 8 * h, acc[r]);
}
#endif

/* The rows [m0, m0 + R) of one tile of 16 columns. R is a constant at each call site, so the
 * accumulators stay in registers. `w4` (int4) or `w8` (int8) is the tile's weight. Per column, each
 * block adds isum * (s_g * d_b), then z_g * xs_b, in block order: the same float operations on either
 * path (AVX2 takes the tile's two halves of 8 columns in turn within each block). */
static inline __attribute__((always_inline)) void tile(const int8_t *xq, const float *d, const float *xs,
                                                       const int32_t *qs, int64_t K,
                                                       const uint8_t *w4, const int8_t *w8, const void *s,
                                                       const void *zc, const int half, int64_t G, int64_t m0,
                                                       const int R, int64_t N, int64_t n0, float *y, const int deep) {
    const int64_t blocks = K / QK, per_group = G / QK;
    const int8_t *xr[MR];
    for (int r = 0; r < R; r++) xr[r] = xq + (m0 + r) * K;
#ifdef HX_VNNI
    __m512 acc[MR];
    for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
    group16 gs = group16_start();
    for (int64_t b = 0; b < blocks; b++) {
        group16_next(&gs, per_group, s, zc, half);
        prefetch_block(w4, w8, b, deep);
        __m512i isum[MR];
        block_sums(xr, b * QK, w4 ? w4 + b * QK * NR / 2 : NULL, w8 ? w8 + b * QK * NR : NULL, R, isum);
        if (w8) /* the unsigned weights were q + 128: take 128 * sum(xq) of the block back */
            for (int r = 0; r < R; r++)
                isum[r] = _mm512_sub_epi32(isum[r], _mm512_set1_epi32(128 * qs[(m0 + r) * blocks + b]));
        for (int r = 0; r < R; r++) {
            const int64_t row = (m0 + r) * blocks + b;
            acc[r] = block16_add(acc[r], isum[r], &gs, d[row], xs[row], zc != NULL);
        }
    }
    for (int r = 0; r < R; r++) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
#else
    (void)qs;
    if (R > SHALLOW_ROWS) { /* bound by the arithmetic: a half of the columns at a time (tile_half) */
        tile_half(xr, d, xs, blocks, per_group, w4, w8, s, zc, half, m0, R, 0, N, n0, y, deep);
        tile_half(xr, d, xs, blocks, per_group, w4, w8, s, zc, half, m0, R, 1, N, n0, y, deep);
        return;
    }
    __m256 acc[2][MR]; /* [h][r]: columns [8 h, 8 h + 8) of row m0 + r */
    for (int r = 0; r < R; r++) acc[0][r] = acc[1][r] = _mm256_setzero_ps();
    int64_t g = -1, left = 0;
    for (int64_t b = 0; b < blocks; b++) {
        if (left-- == 0) {
            g++;
            left = per_group - 1;
        }
        prefetch_block(w4, w8, b, deep);
        for (int h = 0; h < 2; h++) /* both halves of the block's cache lines while they are in L1 */
            half_block(xr, d, xs, blocks, b, g, w4, w8, s, zc, half, m0, R, h, acc[h]);
    }
    for (int r = 0; r < R; r++)
        for (int h = 0; h < 2; h++) _mm256_storeu_ps(y + (m0 + r) * N + n0 + 8 * h, acc[h][r]);
#endif
}

#ifdef HX_AMX
/* Rows [m0, m0 + 16) of one tile of 16 columns by AMX, with the same result as `tile`: per block of 32 k, one
 * TDPBSUD (int4: xq signed, q unsigned in [0, 15]) or TDPBSSD (int8: both signed) gives the 16 x 16 exact int32
 * sums that block_sums gives 4 rows at a time, and the float operations per column follow, in the same order.
 * Tiles: 0 the sums (C, 16 rows of 16 int32), 1 the block's weight (B, 8 chunks of 4 k: row j is chunk j, whose
 * 64 bytes are the tiled layout's, int4 unpacked from its pair's low or high nibbles), 2 the rows' activations
 * (A, 16 rows of the block's 32 bytes). */
static inline __attribute__((always_inline)) void amx_tile(const int8_t *xq, const float *d, const float *xs, int64_t K,
                                                           const uint8_t *w4, const int8_t *w8, const void *s,
                                                           const void *zc, const int half, int64_t G, int64_t m0,
                                                           int64_t N, int64_t n0, float *y) {
    const int64_t blocks = K / QK, per_group = G / QK;
    const __m512i mask = _mm512_set1_epi8(0x0F);
    uint8_t unpacked[QK / 4 * 64] __attribute__((aligned(64))); /* int4: the block's 8 chunks, one byte a value */
    int32_t sums[AMX_ROWS * NR] __attribute__((aligned(64)));
    __m512 acc[AMX_ROWS];
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) acc[r] = _mm512_setzero_ps();
    group16 gs = group16_start();
    for (int64_t b = 0; b < blocks; b++) {
        group16_next(&gs, per_group, s, zc, half);
        if (w4) {
            const uint8_t *pairs = w4 + b * QK * NR / 2;
            for (int p = 0; p < QK / 8; p++) {
                const __m512i raw = _mm512_loadu_si512((const void *)(pairs + 64 * p));
                _mm512_store_si512((void *)(unpacked + 128 * p), _mm512_and_si512(raw, mask));
                _mm512_store_si512((void *)(unpacked + 128 * p + 64), _mm512_and_si512(_mm512_srli_epi16(raw, 4), mask));
            }
            HX_TILE_LOAD(1, unpacked, 64);
        } else {
            HX_TILE_LOAD(1, w8 + b * QK * NR, 64);
        }
        HX_TILE_LOAD(2, xq + m0 * K + b * QK, K);
        HX_TILE_ZERO(0);
        if (w4)
            HX_TILE_DPBSUD(0, 2, 1);
        else
            HX_TILE_DPBSSD(0, 2, 1);
        HX_TILE_STORE(0, sums, 4 * NR);
#pragma GCC unroll 16
        for (int r = 0; r < AMX_ROWS; r++) {
            const int64_t row = (m0 + r) * blocks + b;
            const __m512i isum = _mm512_load_si512((const void *)(sums + r * NR));
            acc[r] = block16_add(acc[r], isum, &gs, d[row], xs[row], zc != NULL);
        }
    }
#pragma GCC unroll 16
    for (int r = 0; r < AMX_ROWS; r++) _mm512_storeu_ps(y + (m0 + r) * N + n0, acc[r]);
}

/* Ask Linux for this process's permission to use the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM for
 * XTILEDATA, Linux 5.16 and later): without it the first tile instruction faults. Returns 0 when granted, else
 * -errno; the kernel runs no tile instruction until it returned 0. The emulated build needs no permission. */
int helexa_amx_enable(void) {
#ifndef HX_AMX_EMULATE
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) != 0) return -errno;
#endif
    amx_granted = 1;
    return 0;
}

#ifdef HX_AMX_EMULATE
/* The emulated build only: how many tile products (TDPBSUD, TDPBSSD) it has run. */
int64_t helexa_amx_emulated_products(void) {
    int64_t n;
#pragma omp atomic read
    n = hx_emu_products;
    return n;
}
#endif
#else
/* Not an AMX build: returns 1 (native.load_path refuses it for a path that needs AMX). */
int helexa_amx_enable(void) { return 1; }
#endif

/* The tiles of one GEMM shared out among its threads. A static split (a contiguous half for each of two threads)
 * kept each weight one stream per thread, which a one-row GEMM needs to read at the memory's speed, but the halves
 * did not finish together: over three 1B decode steps' GEMMs (~36 ms; Zen 4 VM, 2 threads, the fast bandwidth
 * mode) one thread waited 3-5 ms for the other; an interleaved split (schedule(dynamic)) read 10-25% slower. So
 * each thread owns a contiguous run and takes it from the front RUN_TILES at a time, and one whose run is done
 * takes RUN_TILES at a time from the back of another's: the streams stay contiguous and the wait was ~0.5 ms.
 * A run's bounds are one word, [lo, hi) in its high and low halves, so either end moves by one compare-and-swap. */
#define RUN_TILES 2

typedef struct {
    uint64_t bounds;
    char pad[56]; /* a cache line each: the runs' owners do not share one */
} tile_run;

static inline uint64_t run_bounds(uint64_t lo, uint64_t hi) { return lo << 32 | hi; }

/* Thread i's run of n at the start of a GEMM of `tiles` tiles: its contiguous share [tiles i / n, tiles (i+1) / n). */
static inline uint64_t run_of(uint64_t tiles, int i, int n) {
    return run_bounds(tiles * (uint64_t)i / (uint64_t)n, tiles * (uint64_t)(i + 1) / (uint64_t)n);
}

/* Takes up to RUN_TILES tiles from the front (the run's owner) or the back (another thread) of `run`: 1 with
 * them in [*lo, *hi), or 0 when it is empty. */
static inline int take_tiles(tile_run *run, const int front, int64_t *lo, int64_t *hi) {
    uint64_t old = __atomic_load_n(&run->bounds, __ATOMIC_RELAXED);
    for (;;) {
        const uint64_t a = old >> 32, b = old & 0xffffffffu;
        if (a >= b) return 0;
        const uint64_t n = b - a < RUN_TILES ? b - a : RUN_TILES;
        const uint64_t next = front ? run_bounds(a + n, b) : run_bounds(a, b - n);
        if (__atomic_compare_exchange_n(&run->bounds, &old, next, 0, __ATOMIC_ACQ_REL, __ATOMIC_RELAXED)) {
            *lo = (int64_t)(front ? a : b - n);
            *hi = (int64_t)(front ? a + n : b);
            return 1;
        }
    }
}

/* The next tiles thread `me` computes, in [*lo, *hi): from its own run's front while it has any, then from the
 * back of the others' in turn (*at: how far it has got, counted from its own run; 0 at the start). 0 when every
 * run is empty. */
static inline int next_tiles(tile_run *runs, const int nruns, const int me, int *at, int64_t *lo, int64_t *hi) {
    for (; *at < nruns; ++*at) {
        const int r = (me + *at) % nruns;
        if (take_tiles(&runs[r], r == me, lo, hi)) return 1;
    }
    return 0;
}

/* Thread `me`'s part of a GEMM whose activations are quantized (xq, d, xs, qs) and whose `nruns` runs are set:
 * the tiles of its own run, then what is left of the others'. With `bias`, adds it to the columns of each tile it
 * computed (the same sum as adding it to y after the GEMM). */
static inline __attribute__((always_inline)) void gemm_tiles(const int8_t *xq, const float *d, const float *xs,
                                                              const int32_t *qs, int64_t M, int64_t K,
                                                              const uint8_t *q4, const int8_t *q8, const void *scales,
                                                              const void *zero_terms, int64_t half, int64_t N,
                                                              int64_t G, float *y, const float *bias, tile_run *runs,
                                                              int nruns, int me) {
    const size_t width = half ? 2 : 4; /* bytes per scale or zero term */
    const int64_t groups = K / G;
    const int deep = M > SHALLOW_ROWS; /* how far ahead the weights are prefetched (see PREFETCH) */
#ifdef HX_AMX
    /* whole tiles of 16 rows by AMX; the rest (and every GEMM of fewer rows) 4 rows at a time by vpdpbusd */
    const int64_t m_amx = amx_granted ? M / AMX_ROWS * AMX_ROWS : 0;
    /* These threads are torch's: its own AMX kernels (oneDNN's brgemm) may have left a tile configuration on
     * one, and may skip reloading it on their next call, so each thread's configuration is put back after. */
    hx_tile_config saved;
    if (m_amx) {
        HX_TILE_SAVE(&saved);
        hx_tile_config cfg;
        memset(&cfg, 0, sizeof cfg);
        cfg.palette = 1;
        cfg.rows[0] = AMX_ROWS, cfg.colsb[0] = 4 * NR; /* C: 16 rows of 16 int32 */
        cfg.rows[1] = QK / 4, cfg.colsb[1] = 64;       /* B: 8 chunks of 4 k x 16 columns */
        cfg.rows[2] = AMX_ROWS, cfg.colsb[2] = QK;     /* A: 16 rows of 32 activation bytes */
        HX_TILE_CONFIG(&cfg);
    }
#else
    const int64_t m_amx = 0;
#endif
    int at = 0;
    int64_t t_lo, t_hi;
    while (next_tiles(runs, nruns, me, &at, &t_lo, &t_hi)) {
        for (int64_t t = t_lo; t < t_hi; t++) {
            const uint8_t *w4 = q4 ? q4 + t * NR * (K / 2) : NULL;
            const int8_t *w8 = q8 ? q8 + t * NR * K : NULL;
            const char *s = (const char *)scales + width * (size_t)(t * groups * NR);
            const char *zc = zero_terms ? (const char *)zero_terms + width * (size_t)(t * groups * NR) : NULL;
#ifdef HX_AMX
            for (int64_t m0 = 0; m0 < m_amx; m0 += AMX_ROWS) {
                if (half) amx_tile(xq, d, xs, K, w4, w8, s, zc, 1, G, m0, N, t * NR, y);
                else amx_tile(xq, d, xs, K, w4, w8, s, zc, 0, G, m0, N, t * NR, y);
            }
#endif
            /* A loop compiled per weight type, scale width and row count: in each, the other type's
             * pointer is a null constant and its branches fold away. (Compiled with both pointers live,
             * the one-row int8 GEMM, a tied head, read 80-85% of the memory's bandwidth in this VM's
             * fast mode where alone it reads all of it; int4's loop was unchanged.) */
            for (int64_t m0 = m_amx; m0 < M; m0 += MR) {
                switch (M - m0 < MR ? M - m0 : MR) {
#define TILE_OF(R, W4, W8) if (half) tile(xq, d, xs, qs, K, W4, W8, s, zc, 1, G, m0, R, N, t * NR, y, deep); \
                           else tile(xq, d, xs, qs, K, W4, W8, s, zc, 0, G, m0, R, N, t * NR, y, deep);
#define TILE(R) case R: if (w4) { TILE_OF(R, w4, NULL) } else { TILE_OF(R, NULL, w8) } break;
                    TILE(1) TILE(2) TILE(3) TILE(4)
#undef TILE
#undef TILE_OF
                }
            }
            if (bias)
                for (int64_t m = 0; m < M; m++)
                    for (int64_t c = t * NR; c < (t + 1) * NR; c++) y[m * N + c] += bias[c];
        }
    }
#ifdef HX_AMX
    if (m_amx) {
        if (saved.palette) HX_TILE_CONFIG(&saved); /* tile data is not kept across calls: only the shapes */
        else HX_TILE_RELEASE();
    }
#endif
}

/* The quantized activations of M rows of K inside `mem`: d, xs and qs (M * K / 32 each), then xq (M * K). */
static size_t quantized_bytes(int64_t M, int64_t K) {
    return 3 * sizeof(float) * (size_t)(M * (K / QK)) + (size_t)(M * K);
}

static void quantize_into(unsigned char *mem, const float *x, int64_t M, int64_t K, int64_t ldx, int8_t **xq,
                          float **d, float **xs, int32_t **qs) {
    const int64_t blocks = K / QK;
    *d = (float *)mem, *xs = *d + M * blocks;
    *qs = (int32_t *)(*xs + M * blocks);
    *xq = (int8_t *)(*qs + M * blocks);
    quantize_rows(x, M, K, ldx, *xq, *d, *xs, *qs);
}

int helexa_wq_gemm(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q4, const int8_t *q8,
                   const void *scales, const void *zero_terms, int64_t half, int64_t N, int64_t G, float *y) {
    /* One allocation: the threads' runs of tiles, one per thread asked for (a team OpenMP makes smaller leaves
     * runs with no owner: the others take them), then the quantized activations. 64-byte aligned, so each run
     * has a cache line of its own. */
    const int nruns = helexa_threads();
    const size_t runs_bytes = sizeof(tile_run) * (size_t)nruns;
    const size_t bytes = runs_bytes + quantized_bytes(M, K);
    unsigned char *mem = (unsigned char *)aligned_alloc(64, (bytes + 63) / 64 * 64);
    if (!mem) return -1;
    tile_run *runs = (tile_run *)mem;
    int8_t *xq;
    float *d, *xs;
    int32_t *qs;
    quantize_into(mem + runs_bytes, x, M, K, ldx, &xq, &d, &xs, &qs);
    const uint64_t tiles = (uint64_t)(N / NR);
    for (int i = 0; i < nruns; i++) runs[i].bounds = run_of(tiles, i, nruns);
#pragma omp parallel num_threads(nruns)
    gemm_tiles(xq, d, xs, qs, M, K, q4, q8, scales, zero_terms, half, N, G, y, NULL, runs, nruns, omp_get_thread_num());
    free(mem);
    return 0;
}

size_t helexa_wq_gemm_team_bytes(int64_t M, int64_t K) { return quantized_bytes(M, K); }

size_t helexa_wq_gemm_runs_bytes(int64_t threads) { return sizeof(tile_run) * (size_t)threads; }

void helexa_wq_gemm_team(const float *x, int64_t M, int64_t K, int64_t ldx, const uint8_t *q4, const int8_t *q8,
                         const void *scales, const void *zero_terms, int64_t half, int64_t N, int64_t G,
                         const float *bias, float *y, void *runs, void *own) {
    const int nruns = omp_get_num_threads(), me = omp_get_thread_num();
    int8_t *xq;
    float *d, *xs;
    int32_t *qs;
    quantize_into((unsigned char *)own, x, M, K, ldx, &xq, &d, &xs, &qs);
    const uint64_t tiles = (uint64_t)(N / NR);
    tile_run *run = (tile_run *)runs;
    __atomic_store_n(&run[me].bounds, run_of(tiles, me, nruns), __ATOMIC_RELEASE);
    gemm_tiles(xq, d, xs, qs, M, K, q4, q8, scales, zero_terms, half, N, G, y, bias, run, nruns, me);
#pragma omp barrier
}

int helexa_int4_gemm(const float *x, int64_t M, int64_t K, const uint8_t *tiled, const void *scales,
                     const void *zero_terms, int64_t half, int64_t N, int64_t G, float *y) {
    return helexa_wq_gemm(x, M, K, K, tiled, NULL, scales, zero_terms, half, N, G, y);
}

int helexa_int8_gemm(const float *x, int64_t M, int64_t K, const int8_t *tiled, const void *scales, int64_t half,
                     int64_t N, int64_t G, float *y) {
    return helexa_wq_gemm(x, M, K, K, NULL, tiled, scales, NULL, half, N, G, y);
}

/* Rows `ids` (R,) of a tiled weight, dequantised into x (R, K) float32 (an embedding lookup): int4
 * (q - 8) * s + z with z = zero term + 8 s, int8 q * s, each product and sum a float32 operation in that order, as
 * QuantizedWeight.dequantize computes them on the canonical layout `untile` gives back (scales and zero
 * terms widened exactly from float16 when `half`). Reads only the rows' bytes. Returns 0, or -3 (x left
 * as it was) when an id is outside [0, N). */
int helexa_dequantize_rows(const uint8_t *q4, const int8_t *q8, const void *scales, const void *zero_terms,
                           int64_t half, int64_t N, int64_t K, int64_t G, const int64_t *ids, int64_t R, float *x) {
    for (int64_t r = 0; r < R; r++)
        if (ids[r] < 0 || ids[r] >= N) return -3;
    const int64_t groups = K / G;
    HX_FOR(R * K >= 65536, r, R, {
        const int64_t t = ids[r] / NR, c = ids[r] % NR;
        float *y = x + r * K;
        for (int64_t g = 0; g < groups; g++) {
            const int64_t at = (t * groups + g) * NR + c; /* scales and zero terms: [tile][group][16] */
            const float s = half ? _cvtsh_ss(((const uint16_t *)scales)[at]) : ((const float *)scales)[at];
            if (q4) {
                const float zt = half ? _cvtsh_ss(((const uint16_t *)zero_terms)[at]) : ((const float *)zero_terms)[at];
                const float z = zt + 8.0f * s;
                /* a pair of chunks (8 k) is 64 bytes: column c's 4 values of the first chunk in the low
                 * nibbles of its bytes 4 c .. 4 c + 3, of the second in their high nibbles */
                for (int64_t k = g * G; k < (g + 1) * G; k++) {
                    const uint8_t byte = q4[(t * (K / 8) + k / 8) * 64 + 4 * c + k % 4];
                    const int q = k % 8 < 4 ? byte & 0xF : byte >> 4;
                    y[k] = (float)(q - 8) * s + z;
                }
            } else {
                for (int64_t k = g * G; k < (g + 1) * G; k++) /* a chunk is 64 bytes: column c's at 4 c .. 4 c + 3 */
                    y[k] = (float)q8[(t * (K / 4) + k / 4) * 64 + 4 * c + k % 4] * s;
            }
        }
    });
    return 0;
}
