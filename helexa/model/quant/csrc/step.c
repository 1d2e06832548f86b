/* One step of a whole quantized decoder on the CPU, for any mix of rows: decode (one new token of a
 * sequence), prefill, a chunk of a chunked prefill, an extend after a prefix-cache hit. Every layer's
 * norms, quantized projections (helexa_wq_gemm), RoPE, K/V write into the paged cache and paged
 * attention, in one call.
 *
 * It computes what helexa.model.transformer.CausalLM's torch layers compute (with
 * helexa.kernels.reference's write_kv and paged_attention, the oracle of the tests), in float32:
 *
 *   per layer:  h = rms_norm(x) * w_in;  q|k|v = h @ Wqkv.T (+ b);  q, k = rope(norm_qk(q), norm_qk(k))
 *               cache[slot] = k, v;  a = softmax(q . K / sqrt(D)) V over positions <= the query's
 *               x += a @ Wo.T (+ b);  h = rms_norm(x) * w_post;  g|u = h @ Wgu.T (+ b)
 *               x += (silu(g) * u) @ Wdown.T (+ b)
 *   at the end: out = rms_norm(x) * w_final
 *
 * Batch invariance (the reason this one function serves every step): each value a row produces is
 * computed by the same operations in the same order whatever else shares the call, however its
 * sequence's tokens were split into steps, and whichever thread runs it. Projections quantize and
 * sum each row on its own (wq_gemm.c); norms, RoPE (cos and sin of the row's own position, computed
 * here), SiLU and the residual adds are per row and per element; attention splits a query's keys at
 * fixed positions (chunks of KCHUNK keys from position 0), computes each (query, chunk) partial by one
 * function (chunk_partial) and folds the partials in chunk order by one function (fold), whether the
 * chunks ran as parallel tasks (a sequence with few query rows: decode) or in one task's loop (a tile
 * of prefill rows). Compiled with -ffp-contract=off: the arithmetic is the source's, with no fused
 * multiply-add the source does not ask for. So a token's K/V and logits are a function of the tokens
 * before it, bit for bit (tests/model/test_native_step.py).
 *
 * Caches are float32 or float16 (NB, BS, KVH, D) with any strides but a contiguous last dimension;
 * positions past a sequence's length are never read. A float16 cache stores each K/V value rounded
 * to nearest (F16C) when it is written and is read back widened exactly, so every read of a position
 * sees the same values: batch invariance holds for either dtype. A slot of -1 writes nothing. D must be a multiple of 8 up
 * to 512, and H / KVH at most GMAX (16).
 * Threads: OpenMP (the runtime torch has loaded) over rows, the projections' column tiles and
 * attention's tasks: a region per projection and per attention, or, for a step of fewer than ROWS_PAR rows
 * on more than one thread, one region for the whole step (decoder_team); either way each value is the
 * same bits.
 */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wq_gemm.h"

typedef struct {
    const void *weight;      /* tiled: uint8 (int4) or int8 */
    const void *scales;      /* tiled scales, float32 or float16 (half) */
    const void *zero_terms;  /* tiled zero terms (int4) of the scales' dtype, NULL for int8 */
    const float *bias;       /* (N,) or NULL */
    int64_t n, k, group, int4, half;
} hx_linear;

typedef struct {
    const float *input_norm, *post_norm; /* (E,) */
    const float *q_norm, *k_norm;        /* (D,) or NULL (no per-head norm) */
    hx_linear qkv, o, gate_up, down;
    void *k_cache, *v_cache;                       /* float32, or float16 when kv_half */
    int64_t block_stride, row_stride, head_stride; /* of both caches, in elements */
    int64_t kv_half;                               /* 1: the caches hold float16 */
} hx_layer;

/* A (rows, E) table of the model's vocabulary: the token embedding or the output head. Quantized and
 * tiled (q.weight set: q.n rows, q.k = E), or float32 (dense, rows x E); neither: the caller embeds. */
typedef struct {
    hx_linear q;
    const float *dense;
    int64_t rows;
} hx_table;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    double eps;
    const float *final_norm; /* (E,) */
    const hx_layer *layers;
    hx_table embed, head;
} hx_model;

static void *scratch(size_t floats) { return aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64); }

/* A call's large working buffers come from arenas kept per calling thread, one per use (`hx_slot`), grown
 * when a call needs more and never shrunk, instead of fresh memory each call. glibc maps every block of
 * 2 MiB or more afresh (helexa.heap sets the threshold, so freed steps give their memory back), and a
 * fresh mapping's pages fault in as the call first writes them: ~2.5 us a 4 KiB page on the VMs measured,
 * which made attention over 16 sequences of 8k tokens at the 1B shape ~25% slower (its partials are 8.6 MiB
 * a layer). A thread's arenas hold its largest call's bytes until the thread exits (then they are freed).
 * No two buffers of one call share a slot, and a thread runs one call at a time, so nothing is shared. */
enum hx_slot {
    S_X, S_PICKED, S_H, S_QKV, S_GU, S_DOWN, S_COS, S_SIN, S_TASK, S_PART_BASE, S_PART,
    S_RUNS, S_TEAM_X, S_TEAM_H, S_TEAM_ACT, S_TEAM_Q, /* decoder_team's: its runs; each thread's own rows */
    S_HEAD_BLOCK, S_HEAD_BEST,                        /* head_argmax's block of logits, each row's best value */
    S_SLOTS
};
typedef struct {
    void *p;
    size_t bytes;
} hx_arena;
static pthread_key_t arena_key;
static pthread_once_t arena_once = PTHREAD_ONCE_INIT;
static int arena_key_ok = 0;

static void arenas_free(void *v) {
    hx_arena *all = (hx_arena *)v;
    for (int i = 0; i < S_SLOTS; i++) free(all[i].p);
    free(all);
}

static void arena_key_make(void) { arena_key_ok = pthread_key_create(&arena_key, arenas_free) == 0; }

/* At least `bytes` (64-byte aligned) of this thread's arena `slot`, or NULL when it cannot grow (the
 * arena then holds nothing). Its contents are whatever the thread's last call left. */
static void *arena(enum hx_slot slot, size_t bytes) {
    pthread_once(&arena_once, arena_key_make);
    if (!arena_key_ok) return NULL;
    hx_arena *all = (hx_arena *)pthread_getspecific(arena_key);
    if (!all) {
        all = (hx_arena *)calloc(S_SLOTS, sizeof(hx_arena));
        if (!all || pthread_setspecific(arena_key, all)) {
            free(all);
            return NULL;
        }
    }
    hx_arena *a = &all[slot];
    if (a->bytes < bytes) {
        free(a->p);
        a->bytes = ((bytes + 63) / 64) * 64;
        a->p = aligned_alloc(64, a->bytes);
        if (!a->p) a->bytes = 0;
    }
    return a->p;
}

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* exp(x) for 8 floats (Cephes' expf: range reduction by ln 2, a degree-5 polynomial, relative error
 * ~1e-7 over the range used here, x <= 0). Inputs under -87.3 give 0. */
static inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f), hi = _mm256_set1_ps(88.3f);
    const __m256 valid = _mm256_cmp_ps(x, lo, _CMP_GE_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), hi);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    x = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), x);
    __m256 y = _mm256_set1_ps(1.9875691500e-4f);
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
    y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
    y = _mm256_fmadd_ps(_mm256_mul_ps(y, x), x, _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_and_ps(_mm256_mul_ps(y, _mm256_castsi256_ps(e)), valid);
}

/* The 4 sums of 4 vectors, twice: lanes 0-3 from lanes 0-3 of a0 .. a3, lanes 4-7 from their lanes 4-7. */
static inline __m256 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
    return _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
}

/* The 8 sums of 8 vectors, in order, from hsum4 of the first four (u0) and of the last four (u1). */
static inline __m256 hsum8_of(__m256 u0, __m256 u1) {
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* The 8 sums of 8 vectors, in order. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    return hsum8_of(hsum4(a0, a1, a2, a3), hsum4(a4, a5, a6, a7));
}

#define KCHUNK 128    /* keys per attention chunk, from position 0: a query's keys split at fixed positions */
#define GMAX 16       /* query heads per KV head the step takes (checked by the caller) */
#define SPLIT_ROWS 8  /* a sequence with at most this many rows in the step runs one task per chunk */
#define QTILE 16      /* query rows per task otherwise (each task walks its rows' chunks in order) */
#define ROWS_PAR 8    /* rows from which per-row work runs on all threads; fewer: one region a step (decoder_team) */
_Static_assert(ROWS_PAR - 1 <= SPLIT_ROWS, "decoder_team's attention must be chunk tasks (a tile task allocates)");
/* The MLP runs this many rows at a time: its gate and up values (2 x intermediate floats a row, the
 * activations then written over the gate half) are the step's largest scratch, 235 MiB for 2,048 rows
 * of an 8B model, 7 MiB at 64 rows.
 * Each row is computed alone whatever its neighbours (wq_gemm.c), so the split changes no bit; it
 * costs one more pass over the MLP weights per 64 rows, little beside those rows' arithmetic (prefill
 * at 64 and at 256 rows measured the same within noise at 135M and 1B, the 1B peak 18 MiB lower). */
#define MLP_ROWS 64

/* y (n,) = w * (x / sqrt(mean(x^2) + eps)), the sum of squares in double, in order. */
static void rms_norm(const float *x, const float *w, int64_t n, double eps, float *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

/* rms_norm of each of the T rows (T, n) -> (T, n). */
static void rms_norm_rows(const float *x, const float *w, int64_t T, int64_t n, double eps, float *y) {
    HX_FOR(T >= ROWS_PAR, t, T, { rms_norm(x + t * n, w, n, eps, y + t * n); });
}

/* y (m, c1 - c0) = columns [c0, c1) of x (m, k) @ W.T (+ bias), x's rows ldx floats apart; c0 and c1
 * multiples of the weight's tile of 16 columns (c1 may be n). The weight is tiled by columns, so the range is
 * a pointer offset and each column is computed as it is in the whole product. Returns helexa_wq_gemm's 0 or -1. */
static int linear_cols(const hx_linear *l, const float *x, int64_t m, int64_t ldx, int64_t c0, int64_t c1, float *y) {
    const int64_t k = l->k, w = c1 - c0, scale_bytes = l->half ? 2 : 4;
    const uint8_t *q4 = l->int4 ? (const uint8_t *)l->weight + c0 * (k / 2) : NULL;
    const int8_t *q8 = l->int4 ? NULL : (const int8_t *)l->weight + c0 * k;
    const size_t per_column = (size_t)(scale_bytes * (k / l->group)); /* its scales' (and zero terms') bytes */
    const void *scales = (const char *)l->scales + per_column * (size_t)c0;
    const void *zero_terms = l->zero_terms ? (const char *)l->zero_terms + per_column * (size_t)c0 : NULL;
    if (helexa_wq_gemm(x, m, k, ldx, q4, q8, scales, zero_terms, l->half, w, l->group, y)) return -1;
    if (l->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < w; i++) y[r * w + i] += l->bias[c0 + i];
    return 0;
}

/* y (m, n) = x (m, k) @ W.T (+ bias), x's rows ldx floats apart. Returns helexa_wq_gemm's 0 or -1. */
static int linear(const hx_linear *l, const float *x, int64_t m, int64_t ldx, float *y) {
    return linear_cols(l, x, m, ldx, 0, l->n, y);
}

/* cos and signed sin (T, D) of each row's position: angle i = float(pos) * inv_freq[i mod D/2] in
 * float32 (as CausalLM computes it), then cosf and sinf of it; sin's first half negated. */
static void rope_tables(const int64_t *positions, const float *inv_freq, int64_t T, int64_t d, float *cos_t,
                        float *ssin_t) {
    const int64_t h = d / 2;
    HX_FOR(T >= 64, t, T, {
        for (int64_t i = 0; i < h; i++) {
            const float a = (float)positions[t] * inv_freq[i], c = cosf(a), s = sinf(a);
            cos_t[t * d + i] = cos_t[t * d + h + i] = c;
            ssin_t[t * d + i] = -s;
            ssin_t[t * d + h + i] = s;
        }
    });
}

/* One head (D,) in place: optional RMSNorm, then rotate-half RoPE with cos and signed sin (D,). */
static void rope_head(float *x, const float *norm, double eps, const float *cos_r, const float *ssin_r, int64_t d) {
    float tmp[512];
    if (norm) rms_norm(x, norm, d, eps, x);
    const int64_t h = d / 2;
    for (int64_t i = 0; i < d; i++) tmp[i] = x[i] * cos_r[i] + x[i < h ? i + h : i - h] * ssin_r[i];
    memcpy(x, tmp, sizeof(float) * (size_t)d);
}

/* 8 values of silu(g) * u = g / (1 + exp(-g)) * u, exp by exp8. */
static inline __m256 silu_mul8(__m256 g, __m256 u) {
    const __m256 e = exp8(_mm256_xor_ps(g, _mm256_set1_ps(-0.0f)));
    return _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e)), u);
}

/* y (n,) = silu(g) * u, every value through silu_mul8 (a tail of fewer than 8 is padded). */
static void silu_mul(const float *g, const float *u, int64_t n, float *y) {
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, silu_mul8(_mm256_loadu_ps(g + i), _mm256_loadu_ps(u + i)));
    if (i < n) {
        float gt[8] = {0}, ut[8] = {0}, yt[8];
        memcpy(gt, g + i, sizeof(float) * (size_t)(n - i));
        memcpy(ut, u + i, sizeof(float) * (size_t)(n - i));
        _mm256_storeu_ps(yt, silu_mul8(_mm256_loadu_ps(gt), _mm256_loadu_ps(ut)));
        memcpy(y + i, yt, sizeof(float) * (size_t)(n - i));
    }
}

/* The K and V rows of keys [j0, j0 + n) of KV head kvh of one sequence (its block table). */
static void chunk_rows(const hx_layer *L, const int32_t *table, int64_t j0, int64_t n, int64_t bs, int64_t kvh,
                       const void **kp, const void **vp) {
    const int64_t width = L->kv_half ? 2 : 4; /* bytes per element */
    for (int64_t j = 0; j < n;) { /* a block at a time */
        const int64_t pos = j0 + j, first = pos % bs;
        const int64_t base = ((int64_t)table[pos / bs] * L->block_stride + kvh * L->head_stride) * width;
        const char *kb = (const char *)L->k_cache + base, *vb = (const char *)L->v_cache + base;
        for (int64_t r = first; r < bs && j < n; r++, j++) {
            kp[j] = kb + r * L->row_stride * width;
            vp[j] = vb + r * L->row_stride * width;
        }
    }
}

/* K and V rows asked for (into L2) ahead of their use. A chunk's rows lie in blocks scattered over the pool,
 * which the hardware prefetchers do not follow: without asking, each block's first reads wait on memory in turn.
 * A decode task asks for its first KV head's rows all at once before it starts (`ahead_finish` at once), and
 * for each next KV head's a few cache lines at a time while it computes the one before: every key loop of the
 * attention ticks, and each tick asks for `per` more lines, the K rows' first, `per` set so that the lines
 * spread over the ticks the head before made (every head of a task makes the same ticks; the first guesses
 * AHEAD_FIRST). Asked for all at once before the head before it started, the requests filled the core's miss
 * buffers and the computation waited for most of them: with K/V from memory a decode row at 4k-8k keys ran
 * 1.2-1.8x slower than this way (Zen 4, both paths; bench/cpu_attention.py). Changes no value. */
#define AHEAD_FIRST 2

typedef struct {
    const void *const *rows[2]; /* the K rows, then the V rows */
    int64_t n, lines, per;      /* rows of each, cache lines of a row, lines asked for a tick */
    int64_t kind, row, line;    /* the next line to ask for: kind 2 once every line was asked for */
    int64_t ticks;              /* ticks so far */
} hx_ahead;

/* Nothing to ask for (a task's last head); its ticks are still counted. */
static inline hx_ahead ahead_none(void) { return (hx_ahead){{NULL, NULL}, 0, 1, 1, 2, 0, 0, 0}; }

/* The rows kp, vp (n each, `bytes` bytes a row) to ask for from their first line, `per` lines a tick. */
static inline hx_ahead ahead_of(const void *const *kp, const void *const *vp, int64_t n, int64_t bytes,
                                int64_t per) {
    return (hx_ahead){{kp, vp}, n, (bytes + 63) / 64, per > 0 ? per : 1, n > 0 ? 0 : 2, 0, 0, 0};
}

/* Lines a tick so that the rows' 2 n `lines` lines spread over `ticks` ticks. */
static inline int64_t ahead_rate(int64_t n, int64_t bytes, int64_t ticks) {
    const int64_t all = 2 * n * ((bytes + 63) / 64);
    return ticks > 0 ? (all + ticks - 1) / ticks : AHEAD_FIRST;
}

/* One tick: ask for the next `per` lines of `a`'s rows (none once all were asked for). */
static inline __attribute__((always_inline)) void ahead_tick(hx_ahead *a) {
    a->ticks++;
    for (int64_t i = 0; i < a->per && a->kind < 2; i++) {
        _mm_prefetch((const char *)a->rows[a->kind][a->row] + 64 * a->line, _MM_HINT_T1);
        if (++a->line == a->lines) {
            a->line = 0;
            if (++a->row == a->n) a->row = 0, a->kind++;
        }
    }
}

/* Ask for every line of `a`'s rows not yet asked for. */
static inline void ahead_finish(hx_ahead *a) {
    while (a->kind < 2) ahead_tick(a);
}

#define VREGS 8 /* output vectors a pass over the values accumulates in registers */

/* out (8 R floats) = sum over keys j < n, in order, of p[j] * V[j][e0 .. e0 + 8 R): R (a constant at each
 * call site) accumulators stay in registers across the keys. Each output element sums its terms in key
 * order, whatever R and e0 are. */
static inline __attribute__((always_inline)) void weigh_values(const float *p, const void *const *vp, int64_t n,
                                                               int64_t e0, const int R, float *out, const int half,
                                                               hx_ahead *ahead) {
    __m256 acc[VREGS];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j++) {
        if (ahead) ahead_tick(ahead);
        const __m256 pj = _mm256_set1_ps(p[j]);
        for (int r = 0; r < R; r++) acc[r] = _mm256_fmadd_ps(pj, hx_load8(vp[j], e0 + 8 * r, half), acc[r]);
    }
    for (int r = 0; r < R; r++) _mm256_storeu_ps(out + 8 * r, acc[r]);
}

/* Scores of one query head (qg, D) against keys [j0, n) of a chunk, one key at a time, scaled, into sg. */
static inline __attribute__((always_inline)) void scores_each(const float *qg, const void *const *kp, int64_t j0,
                                                              int64_t n, int64_t d, float scale, float *sg,
                                                              const int half) {
    for (int64_t j = j0; j < n; j++) {
        __m256 acc = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), hx_load8(kp[j], i, half), acc);
        sg[j] = hsum(acc) * scale;
    }
}

/* Scores of one query head against the first n keys: 8 keys at a time, then one at a time. Key j's
 * score is the same bits wherever it is computed (here, in scores_grouped4 or in scores_pair): 8 lanes, lane l summing
 * q[i + l] * k[i + l] over i in order, the lanes summed by hsum8's tree (hsum's for the last keys). */
static inline __attribute__((always_inline)) void scores_of(const float *qg, const void *const *kp, int64_t n,
                                                            int64_t d, float scale, float *sg, const int half,
                                                            hx_ahead *ahead) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        if (ahead) ahead_tick(ahead);
        __m256 a[8];
        for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            const __m256 qv = _mm256_loadu_ps(qg + i);
            for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qv, hx_load8(kp[j + r], i, half), a[r]);
        }
        _mm256_storeu_ps(sg + j, _mm256_mul_ps(hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                               _mm256_set1_ps(scale)));
    }
    scores_each(qg, kp, j, n, d, scale, sg, half);
}

/* sg[j] = exp(sg[j] - max) over the first n scores; *m the maximum, *l the sum, in order. */
static inline void softmax_of(float *sg, int64_t n, float *m, float *l) {
    __m256 mx8 = _mm256_set1_ps(-INFINITY);
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) mx8 = _mm256_max_ps(_mm256_loadu_ps(sg + j), mx8);
    float lanes[8];
    _mm256_storeu_ps(lanes, mx8);
    float mx = -INFINITY;
    for (int r = 0; r < 8; r++) mx = lanes[r] > mx ? lanes[r] : mx;
    for (; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 sum8 = _mm256_setzero_ps();
    j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
        _mm256_storeu_ps(sg + j, p);
        sum8 = _mm256_add_ps(sum8, p);
    }
    float sum = hsum(sum8);
    for (; j < n; j++) {
        sg[j] = expf(sg[j] - mx);
        sum += sg[j];
    }
    *m = mx;
    *l = sum;
}

/* og (D) = the weights sg of the first n keys over their values, VREGS vectors of the output at a time. */
static inline __attribute__((always_inline)) void values_of(const float *sg, const void *const *vp, int64_t n,
                                                            int64_t d, float *og, const int half, hx_ahead *ahead) {
    const int64_t nv = d / 8;
    for (int64_t i0 = 0; i0 < nv; i0 += VREGS)
        switch (nv - i0 < VREGS ? nv - i0 : VREGS) {
#define VPART(R) case R: weigh_values(sg, vp, n, 8 * i0, R, og + 8 * i0, half, ahead); break;
            VPART(1) VPART(2) VPART(3) VPART(4) VPART(5) VPART(6) VPART(7) VPART(8)
#undef VPART
        }
}

#ifdef __AVX512F__

/* 8 floats of row a at index i, then 8 of row b (each widened exactly from float16, or copied). */
static inline __m512 load_pair(const void *a, const void *b, int64_t i, const int half) {
    if (half) {
        const __m128i lo = _mm_loadu_si128((const __m128i *)((const uint16_t *)a + i));
        const __m128i hi = _mm_loadu_si128((const __m128i *)((const uint16_t *)b + i));
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(lo), hi, 1));
    }
    const __m256d lo = _mm256_castps_pd(_mm256_loadu_ps((const float *)a + i));
    const __m256d hi = _mm256_castps_pd(_mm256_loadu_ps((const float *)b + i));
    return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(lo), hi, 1));
}

static inline __m256 low8(__m512 v) { return _mm512_castps512_ps256(v); }
static inline __m256 high8(__m512 v) { return _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)); }

/* scores_of for GV (a constant at each call site, at most 4) query heads q (GV, D) at once, into
 * sg (GV rows of KCHUNK): each pair of keys is widened once for all GV heads. Lanes 0-7 of a pair's
 * accumulator are its first key's 8 lanes of scores_of, lanes 8-15 its second's, each summed by the
 * same fused multiply-adds in the same order, then reduced by the same hsum8: the same bits. */
static inline __attribute__((always_inline)) void scores_grouped4(const float *q, const int GV,
                                                                 const void *const *kp, int64_t n, int64_t d,
                                                                 float scale, float *sg, const int half,
                                                                 hx_ahead *ahead) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        if (ahead) ahead_tick(ahead);
        __m512 a[4][4];
        for (int g = 0; g < GV; g++)
            for (int r = 0; r < 4; r++) a[g][r] = _mm512_setzero_ps();
        for (int64_t i = 0; i < d; i += 8) {
            __m512 k2[4];
            for (int r = 0; r < 4; r++) k2[r] = load_pair(kp[j + 2 * r], kp[j + 2 * r + 1], i, half);
            for (int g = 0; g < GV; g++) {
                const __m512 q2 = _mm512_castpd_ps(_mm512_broadcast_f64x4(_mm256_castps_pd(_mm256_loadu_ps(q + g * d + i))));
                for (int r = 0; r < 4; r++) a[g][r] = _mm512_fmadd_ps(q2, k2[r], a[g][r]);
            }
        }
        for (int g = 0; g < GV; g++)
            _mm256_storeu_ps(sg + g * KCHUNK + j,
                             _mm256_mul_ps(hsum8(low8(a[g][0]), high8(a[g][0]), low8(a[g][1]), high8(a[g][1]),
                                                 low8(a[g][2]), high8(a[g][2]), low8(a[g][3]), high8(a[g][3])),
                                           _mm256_set1_ps(scale)));
    }
    for (int g = 0; g < GV; g++) scores_each(q + g * d, kp, j, n, d, scale, sg + g * KCHUNK, half);
}

/* values_of for GV query heads at once, 64 output elements at a time (D % 64 == 0): each V row is
 * widened once for all GV heads. Every output element sums p[j] * V[j][e] over j in order by fused
 * multiply-adds from zero, as weigh_values does: the same bits. */
static inline __attribute__((always_inline)) void values_grouped4(const float *sg, const int GV,
                                                                 const void *const *vp, int64_t n, int64_t d,
                                                                 float *o, const int half, hx_ahead *ahead) {
    for (int64_t e0 = 0; e0 < d; e0 += 64) {
        __m512 acc[4][4];
        for (int g = 0; g < GV; g++)
            for (int r = 0; r < 4; r++) acc[g][r] = _mm512_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            if (ahead) ahead_tick(ahead);
            __m512 v[4];
            for (int r = 0; r < 4; r++) v[r] = hx_load16(vp[j], e0 + 16 * r, half);
            for (int g = 0; g < GV; g++) {
                const __m512 pj = _mm512_set1_ps(sg[g * KCHUNK + j]);
                for (int r = 0; r < 4; r++) acc[g][r] = _mm512_fmadd_ps(pj, v[r], acc[g][r]);
            }
        }
        for (int g = 0; g < GV; g++)
            for (int r = 0; r < 4; r++) _mm512_storeu_ps(o + g * d + e0 + 16 * r, acc[g][r]);
    }
}

/* The partials of GV (2 to 4) query heads (chunk_partial_of's m, l, o for them), sharing each row's widening. */
static inline __attribute__((always_inline)) void group_partial(const float *q, const int GV, const void *const *kp,
                                                                const void *const *vp, int64_t n, int64_t d,
                                                                float scale, float *sg, float *m, float *l, float *o,
                                                                const int half, hx_ahead *ahead) {
    scores_grouped4(q, GV, kp, n, d, scale, sg, half, ahead);
    for (int g = 0; g < GV; g++) softmax_of(sg + g * KCHUNK, n, m + g, l + g);
    values_grouped4(sg, GV, vp, n, d, o, half, ahead);
}
#endif

/* scores_of for two query heads q (2, D) at once, into sg (2 rows of KCHUNK): each key's 8 values at a
 * time are widened once for both heads. Each key's 8
 * lanes are summed by the same fused multiply-adds in the same order as in scores_of, and reduced by
 * hsum8's tree, four keys at a time: the same bits. */
static inline __attribute__((always_inline)) void scores_pair(const float *q, const void *const *kp, int64_t n, int64_t d,
                                                              float scale, float *sg, const int half, hx_ahead *ahead) {
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) {
        if (ahead) ahead_tick(ahead);
        __m256 u[2][2];
        for (int h = 0; h < 2; h++) { /* keys j + 4 h .. j + 4 h + 3 */
            __m256 a[2][4];
            for (int g = 0; g < 2; g++)
                for (int r = 0; r < 4; r++) a[g][r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) {
                __m256 k[4];
                for (int r = 0; r < 4; r++) k[r] = hx_load8(kp[j + 4 * h + r], i, half);
                for (int g = 0; g < 2; g++) {
                    const __m256 qv = _mm256_loadu_ps(q + g * d + i);
                    for (int r = 0; r < 4; r++) a[g][r] = _mm256_fmadd_ps(qv, k[r], a[g][r]);
                }
            }
            for (int g = 0; g < 2; g++) u[g][h] = hsum4(a[g][0], a[g][1], a[g][2], a[g][3]);
        }
        for (int g = 0; g < 2; g++)
            _mm256_storeu_ps(sg + g * KCHUNK + j, _mm256_mul_ps(hsum8_of(u[g][0], u[g][1]), _mm256_set1_ps(scale)));
    }
    for (int g = 0; g < 2; g++) scores_each(q + g * d, kp, j, n, d, scale, sg + g * KCHUNK, half);
}

/* values_of for two query heads at once, 32 output elements at a time (D % 32 == 0): each V row is
 * widened once per slice for both heads. Every output element sums p[j] * V[j][e] over j in order by
 * fused multiply-adds from zero, as weigh_values does: the same bits. */
static inline __attribute__((always_inline)) void values_pair(const float *sg, const void *const *vp, int64_t n, int64_t d,
                                                              float *o, const int half, hx_ahead *ahead) {
    for (int64_t e0 = 0; e0 < d; e0 += 32) {
        __m256 acc[2][4];
        for (int g = 0; g < 2; g++)
            for (int r = 0; r < 4; r++) acc[g][r] = _mm256_setzero_ps();
        for (int64_t j = 0; j < n; j++) {
            if (ahead) ahead_tick(ahead);
            __m256 v[4];
            for (int r = 0; r < 4; r++) v[r] = hx_load8(vp[j], e0 + 8 * r, half);
            for (int g = 0; g < 2; g++) {
                const __m256 pj = _mm256_set1_ps(sg[g * KCHUNK + j]);
                for (int r = 0; r < 4; r++) acc[g][r] = _mm256_fmadd_ps(pj, v[r], acc[g][r]);
            }
        }
        for (int g = 0; g < 2; g++)
            for (int r = 0; r < 4; r++) _mm256_storeu_ps(o + g * d + e0 + 8 * r, acc[g][r]);
    }
}

/* The partials of two query heads (chunk_partial_of's m, l, o for them), sharing each row's widening. */
static inline __attribute__((always_inline)) void pair_partial(const float *q, const void *const *kp,
                                                               const void *const *vp, int64_t n, int64_t d,
                                                               float scale, float *sg, float *m, float *l, float *o,
                                                               const int half, hx_ahead *ahead) {
    scores_pair(q, kp, n, d, scale, sg, half, ahead);
    for (int g = 0; g < 2; g++) softmax_of(sg + g * KCHUNK, n, m + g, l + g);
    values_pair(sg, vp, n, d, o, half, ahead);
}

/* The partial of one query over the first n keys of a chunk (kp, vp), for the G query heads q (G, D) of
 * one KV head: per head g the maximum score m[g], the sum of exp(score - m) l[g] and the unnormalised
 * output o[g] (D). The one computation of a (query, chunk) pair: its result depends on q, the keys
 * and n only. Query heads share each K and V row's widening in groups, with the per-head functions'
 * bits: of 4 in 512-bit registers where D is 64 (with AVX-512), else of 2 where D % 32 == 0 (at D 128
 * the groups of 2 measured 1.16x faster on a Zen 4 with K/V coming from memory, the groups of 4 1.06-1.19x
 * faster at D 64); a last head alone, and other D, one head at a time. */
static inline __attribute__((always_inline)) void chunk_partial_of(const float *q, int64_t G, const void *const *kp,
                                                                   const void *const *vp, int64_t n, int64_t d,
                                                                   float scale, float *m, float *l, float *o,
                                                                   const int half, hx_ahead *ahead) {
    float scores[GMAX * KCHUNK] __attribute__((aligned(64)));
    int64_t g0 = 0, group = 1; /* heads [0, g0) go in groups of `group`, the rest one at a time */
#ifdef __AVX512F__
    if (d == 64) group = 4;
#endif
    if (group == 1 && d % 32 == 0) group = 2;
    for (; group > 1 && g0 + 1 < G; g0 += group) {
        const float *qg = q + g0 * d;
        float *sg = scores + g0 * KCHUNK, *og = o + g0 * d;
#ifdef __AVX512F__
        const int64_t gv = G - g0 < group ? G - g0 : group; /* 2 to 4 heads */
        if (group == 4 && gv == 4)
            group_partial(qg, 4, kp, vp, n, d, scale, sg, m + g0, l + g0, og, half, ahead);
        else if (group == 4 && gv == 3)
            group_partial(qg, 3, kp, vp, n, d, scale, sg, m + g0, l + g0, og, half, ahead);
        else if (group == 4)
            group_partial(qg, 2, kp, vp, n, d, scale, sg, m + g0, l + g0, og, half, ahead);
        else
#endif
            pair_partial(qg, kp, vp, n, d, scale, sg, m + g0, l + g0, og, half, ahead);
    }
    for (int64_t g = g0; g < G; g++) {
        float *sg = scores + g * KCHUNK;
        scores_of(q + g * d, kp, n, d, scale, sg, half, ahead);
        softmax_of(sg, n, m + g, l + g);
        values_of(sg, vp, n, d, o + g * d, half, ahead);
    }
}

/* chunk_partial_of for the caches' dtype (half: float16), and with or without rows to ask for ahead (NULL:
 * none, the tiles of rows), each compiled with them fixed; its key loops ask for `ahead`'s rows as they go. */
static void chunk_partial(const float *q, int64_t G, const void *const *kp, const void *const *vp, int64_t n,
                          int64_t d, float scale, float *m, float *l, float *o, const int half, hx_ahead *ahead) {
    if (ahead && half)
        chunk_partial_of(q, G, kp, vp, n, d, scale, m, l, o, 1, ahead);
    else if (ahead)
        chunk_partial_of(q, G, kp, vp, n, d, scale, m, l, o, 0, ahead);
    else if (half)
        chunk_partial_of(q, G, kp, vp, n, d, scale, m, l, o, 1, NULL);
    else
        chunk_partial_of(q, G, kp, vp, n, d, scale, m, l, o, 0, NULL);
}

/* Fold one chunk's partial (m, l, o (D)) into a query head's running state (*M, *S, O (D)), which starts
 * at (-inf, 0, 0); the chunks are folded in order. The one merge, wherever the partials were made. */
static inline void fold(float *M, float *S, float *O, float m, float l, const float *o, int64_t d) {
    const float mx = m > *M ? m : *M;
    const float a = expf(*M - mx), b = expf(m - mx);
    *S = *S * a + l * b;
    for (int64_t i = 0; i < d; i++) O[i] = O[i] * a + o[i] * b;
    *M = mx;
}

/* out (D) = O / S. */
static inline void finish(const float *O, float S, int64_t d, float *out) {
    const float inv = S > 0.0f ? 1.0f / S : 0.0f;
    for (int64_t i = 0; i < d; i++) out[i] = O[i] * inv;
}

typedef struct {
    int64_t b, kvh, kvh1, i0, i1; /* sequence, KV heads [kvh, kvh1), its query rows [i0, i1) */
    int64_t chunk;                /* >= 0: the partials of this chunk for those rows; -1: the rows' whole attention */
} hx_task;

/* Chunk tasks (the split rows') cover every KV head of their chunk once the step has this many chunk
 * tasks per thread anyway: a task then reads its chunk's cache blocks whole, in address order (a
 * block's rows interleave the KV heads), which the hardware prefetchers follow; one task per KV head
 * read every KVH-th row, and a long context's attention waited on memory. Fewer chunks: a task per
 * (chunk, KV head), for the threads' sake. The grouping changes no partial's arithmetic. */
#define CHUNKS_PER_THREAD 4

/* A step's attention work: its tasks, and where each split row's partials go. */
typedef struct {
    hx_task *task;
    int64_t nt;         /* tasks */
    int64_t *part_base; /* per row of a split sequence: its first partial's offset in `part` */
    float *part;        /* the split rows' partials, (row, KV head, chunk) each G (D + 2) floats: o, m, l */
} hx_plan;

/* The tasks of a step's attention (sequence b's rows [qsl[b], qsl[b+1]), B sequences, H query heads over KVH KV
 * heads of size D) for `threads` threads, in the calling thread's arenas. Returns 0, -1 when memory ran out,
 * -2 when a sequence is shorter than its query rows. */
static int attend_plan(const int32_t *qsl, const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                       int threads, hx_plan *plan) {
    const int64_t G = H / KVH, P = G * (D + 2); /* floats of one (row, KV head, chunk) partial: o, m, l */
    const int64_t T = qsl[B];
    int64_t tasks = 0, parts = 0, chunks = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = qsl[b + 1] - qsl[b], len = seq_lens[b];
        if (qlen <= 0) continue;
        if (len < qlen) return -2;
        if (qlen <= SPLIT_ROWS) {
            chunks += (len + KCHUNK - 1) / KCHUNK;
            tasks += KVH * ((len + KCHUNK - 1) / KCHUNK);
            for (int64_t i = 0; i < qlen; i++) parts += KVH * ((len - qlen + i) / KCHUNK + 1);
        } else {
            tasks += KVH * ((qlen + QTILE - 1) / QTILE);
        }
    }
    hx_task *task = (hx_task *)arena(S_TASK, sizeof(hx_task) * (size_t)(tasks > 0 ? tasks : 1));
    int64_t *part_base = (int64_t *)arena(S_PART_BASE, sizeof(int64_t) * (size_t)(T > 0 ? T : 1)); /* split rows' first partial */
    float *part = (float *)arena(S_PART, sizeof(float) * (size_t)((parts > 0 ? parts : 1) * P));
    if (!task || !part_base || !part) return -1;
    const int64_t span = chunks >= CHUNKS_PER_THREAD * threads ? KVH : 1; /* KV heads per chunk task */
    int64_t nt = 0, np = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t qlen = qsl[b + 1] - qsl[b], len = seq_lens[b];
        if (qlen <= 0) continue;
        if (qlen <= SPLIT_ROWS) {
            for (int64_t i = 0; i < qlen; i++) {
                part_base[qsl[b] + i] = np; /* then (kvh * chunks + c) * P */
                np += KVH * ((len - qlen + i) / KCHUNK + 1) * P;
            }
            for (int64_t kvh = 0; kvh < KVH; kvh += span)
                for (int64_t c = 0; c * KCHUNK < len; c++) task[nt++] = (hx_task){b, kvh, kvh + span, 0, qlen, c};
        } else {
            for (int64_t kvh = 0; kvh < KVH; kvh++)
                for (int64_t i0 = 0; i0 < qlen; i0 += QTILE)
                    task[nt++] = (hx_task){b, kvh, kvh + 1, i0, i0 + QTILE < qlen ? i0 + QTILE : qlen, -1};
        }
    }
    *plan = (hx_plan){task, nt, part_base, part};
    return 0;
}

/* One task of a plan: a chunk's partials of its rows (into the plan's `part`), or a tile of rows' whole attention
 * (into out). Returns 0, or -1 when a tile's scratch could not be allocated. */
static int attend_task(const hx_task *task, const hx_plan *plan, const float *q, int64_t q_stride, const hx_layer *L,
                       const int32_t *qsl, const int32_t *tables, int64_t table_stride, const int32_t *seq_lens,
                       int64_t H, int64_t KVH, int64_t D, int64_t bs, float scale, float *out, int64_t out_stride) {
    const int64_t G = H / KVH, P = G * (D + 2);
    const hx_task k = *task;
    const int64_t qlen = qsl[k.b + 1] - qsl[k.b], prefix = seq_lens[k.b] - qlen;
    const int32_t *table = tables + k.b * table_stride;
    const void *kp[KCHUNK], *vp[KCHUNK];
    if (k.chunk >= 0) { /* this chunk's partial of every row that reaches it */
        const int64_t j0 = k.chunk * KCHUNK, last = prefix + k.i1 - 1;
        const int64_t rows = last + 1 - j0 < KCHUNK ? last + 1 - j0 : KCHUNK;
        const int64_t row_bytes = D * (L->kv_half ? 2 : 4);
        const void *kn[KCHUNK], *vn[KCHUNK];
        const void **ck = kp, **cv = vp, **nk = kn, **nv = vn; /* this KV head's rows, the next one's */
        chunk_rows(L, table, j0, rows, bs, k.kvh, ck, cv);
        hx_ahead first = ahead_of(ck, cv, rows, row_bytes, 1);
        ahead_finish(&first); /* the first KV head's rows, all at once */
        int64_t per = AHEAD_FIRST;
        for (int64_t kvh = k.kvh; kvh < k.kvh1; kvh++) {
            hx_ahead ahead = ahead_none(); /* the next KV head's rows, asked for while this one computes */
            if (kvh + 1 < k.kvh1) {
                chunk_rows(L, table, j0, rows, bs, kvh + 1, nk, nv);
                ahead = ahead_of(nk, nv, rows, row_bytes, per);
            }
            for (int64_t i = k.i0; i < k.i1; i++) {
                const int64_t pos = prefix + i, row = qsl[k.b] + i;
                if (pos < j0) continue;
                const int64_t n = pos + 1 - j0 < KCHUNK ? pos + 1 - j0 : KCHUNK;
                float *p = plan->part + plan->part_base[row] + (kvh * (pos / KCHUNK + 1) + k.chunk) * P;
                chunk_partial(q + row * q_stride + kvh * G * D, G, ck, cv, n, D, scale, p + G * D, p + G * D + G, p,
                              (int)L->kv_half, &ahead);
            }
            const int64_t ticks = ahead.ticks;
            ahead_finish(&ahead); /* what the key loops did not get to */
            per = ahead_rate(rows, row_bytes, ticks);
            const void **tk = ck, **tv = cv; /* the next KV head's rows become this one's */
            ck = nk, cv = nv, nk = tk, nv = tv;
        }
        return 0;
    }
    /* a tile of rows: every chunk in order, each folded as soon as it is computed (16 rows a chunk: more
     * arithmetic per byte than a decode row, so nothing asked for ahead) */
    const int64_t rows = k.i1 - k.i0;
    float *state = scratch((size_t)(rows * G * (D + 2) + P)); /* per (row, head): O (D), M, S; then a partial */
    if (!state) return -1;
    for (int64_t r = 0; r < rows * G; r++) {
        float *s = state + r * (D + 2);
        memset(s, 0, sizeof(float) * (size_t)D);
        s[D] = -INFINITY;
        s[D + 1] = 0.0f;
    }
    float *p = state + rows * G * (D + 2);
    const int64_t last = prefix + k.i1 - 1;
    for (int64_t j0 = 0; j0 <= last; j0 += KCHUNK) {
        chunk_rows(L, table, j0, (last + 1 - j0 < KCHUNK ? last + 1 - j0 : KCHUNK), bs, k.kvh, kp, vp);
        for (int64_t i = k.i0; i < k.i1; i++) {
            const int64_t pos = prefix + i, row = qsl[k.b] + i;
            if (pos < j0) continue;
            const int64_t n = pos + 1 - j0 < KCHUNK ? pos + 1 - j0 : KCHUNK;
            chunk_partial(q + row * q_stride + k.kvh * G * D, G, kp, vp, n, D, scale, p + G * D, p + G * D + G, p,
                          (int)L->kv_half, NULL);
            for (int64_t g = 0; g < G; g++) {
                float *s = state + ((i - k.i0) * G + g) * (D + 2);
                fold(s + D, s + D + 1, s, p[G * D + g], p[G * D + G + g], p + g * D, D);
            }
        }
    }
    for (int64_t i = k.i0; i < k.i1; i++)
        for (int64_t g = 0; g < G; g++) {
            const float *s = state + ((i - k.i0) * G + g) * (D + 2);
            finish(s, s[D + 1], D, out + (qsl[k.b] + i) * out_stride + (k.kvh * G + g) * D);
        }
    free(state);
    return 0;
}

/* Query head h's attention of row `row` of split sequence b: its chunk partials folded in chunk order, into out. */
static void attend_fold(const hx_plan *plan, const int32_t *qsl, const int32_t *seq_lens, int64_t b, int64_t row,
                        int64_t h, int64_t H, int64_t KVH, int64_t D, float *out, int64_t out_stride) {
    const int64_t G = H / KVH, P = G * (D + 2), kvh = h / G, g = h % G;
    const int64_t pos = seq_lens[b] - qsl[b + 1] + row, chunks = pos / KCHUNK + 1; /* the row's position, chunks */
    float O[512], M = -INFINITY, S = 0.0f;
    memset(O, 0, sizeof(float) * (size_t)D);
    for (int64_t c = 0; c < chunks; c++) {
        const float *p = plan->part + plan->part_base[row] + (kvh * chunks + c) * P;
        fold(&M, &S, O, p[G * D + g], p[G * D + G + g], p + g * D, D);
    }
    finish(O, S, D, out + row * out_stride + h * D);
}

/* Paged causal attention of one step: q rows (T, H, D) at stride q_stride, sequence b's rows
 * [qsl[b], qsl[b+1]) at positions seq_lens[b] - q_len_b + i, each attending to the positions up to
 * its own through the block table (B, table_stride). out (T, H, D) at stride out_stride. Returns 0,
 * -1 when memory ran out, -2 when a sequence is shorter than its query rows. */
static int attend(const float *q, int64_t q_stride, const hx_layer *L, const int32_t *qsl, const int32_t *tables,
                  int64_t table_stride, const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                  int64_t bs, float scale, float *out, int64_t out_stride) {
    hx_plan plan;
    const int rc = attend_plan(qsl, seq_lens, B, H, KVH, D, helexa_threads(), &plan);
    if (rc) return rc;
    int failed = 0;
#pragma omp parallel for schedule(dynamic, 1) num_threads(helexa_threads())
    for (int64_t t = 0; t < plan.nt; t++)
        if (attend_task(plan.task + t, &plan, q, q_stride, L, qsl, tables, table_stride, seq_lens, H, KVH, D, bs, scale,
                        out, out_stride)) {
#pragma omp atomic write
            failed = 1;
        }
    /* the split rows: fold each (row, head)'s partials in chunk order (one sequence's on one thread) */
    HX_FOR(B >= 2, b, B, {
        const int64_t qlen = qsl[b + 1] - qsl[b];
        if (qlen <= 0 || qlen > SPLIT_ROWS) continue;
        for (int64_t row = qsl[b]; row < qsl[b + 1]; row++)
            for (int64_t h = 0; h < H; h++) attend_fold(&plan, qsl, seq_lens, b, row, h, H, KVH, D, out, out_stride);
    });
    return failed ? -1 : 0;
}

/* d (a multiple of 8) floats into a cache row: copied (float32) or rounded to nearest float16. */
static void store_row(void *dst, const float *src, int64_t d, int64_t half) {
    if (!half) {
        memcpy(dst, src, sizeof(float) * (size_t)d);
        return;
    }
    for (int64_t i = 0; i < d; i += 8)
        _mm_storeu_si128((__m128i *)((uint16_t *)dst + i), _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
}

static void write_cache(const hx_layer *L, int64_t slot, int64_t bs, const float *k, const float *v, int64_t kvh,
                        int64_t d) {
    if (slot < 0) return;
    const int64_t width = L->kv_half ? 2 : 4;
    const int64_t base = (slot / bs) * L->block_stride + (slot % bs) * L->row_stride;
    for (int64_t h = 0; h < kvh; h++) {
        store_row((char *)L->k_cache + (base + h * L->head_stride) * width, k + h * d, d, L->kv_half);
        store_row((char *)L->v_cache + (base + h * L->head_stride) * width, v + h * d, d, L->kv_half);
    }
}

/* The step's attention alone (for its tests): q (T, H, D) -> out (T, H, D) over float32 (kv_half 0) or
 * float16 (kv_half 1) caches through
 * block_tables (B, table_stride) int32, seq_lens (B,) and query_start_loc (B + 1,) int32, as
 * helexa.kernels.reference.paged_attention defines it. Returns what `attend` returns. */
int helexa_paged_attention(const float *q, void *k_cache, void *v_cache, int64_t block_stride, int64_t row_stride,
                           int64_t head_stride, int64_t block_size, int64_t B, int64_t H, int64_t KVH, int64_t D,
                           const int32_t *query_start_loc, const int32_t *block_tables, int64_t table_stride,
                           const int32_t *seq_lens, float scale, int64_t kv_half, float *out) {
    hx_layer L;
    memset(&L, 0, sizeof L);
    L.k_cache = k_cache;
    L.v_cache = v_cache;
    L.block_stride = block_stride;
    L.row_stride = row_stride;
    L.head_stride = head_stride;
    L.kv_half = kv_half;
    return attend(q, H * D, &L, query_start_loc, block_tables, table_stride, seq_lens, B, H, KVH, D, block_size, scale,
                  out, H * D);
}

/* Row t of a step's q|k|v (`row`, QKV floats): RoPE (after the per-head norms, if any) on its H query heads and
 * KVH key heads, in place, then its K and V written to the cache at slots[t]. */
static void rope_and_write(const hx_model *m, const hx_layer *L, float *row, int64_t t, const float *cos_t,
                           const float *ssin_t, const int64_t *slots) {
    const int64_t H = m->heads, KVH = m->kv_heads, D = m->head_dim, QS = H * D, KS = KVH * D;
    for (int64_t hd = 0; hd < H; hd++) rope_head(row + hd * D, L->q_norm, m->eps, cos_t + t * D, ssin_t + t * D, D);
    for (int64_t hd = 0; hd < KVH; hd++)
        rope_head(row + QS + hd * D, L->k_norm, m->eps, cos_t + t * D, ssin_t + t * D, D);
    write_cache(L, slots[t], m->block_size, row + QS, row + QS + KS, KVH, D);
}

/* Every decoder layer of one step: x (T, E) holds the new tokens' embeddings on entry and their residual
 * stream after the last layer on return (updated in place). positions (T,) int64; inv_freq (D/2,) the
 * RoPE frequencies; slots (T,) int64; query_start_loc (B + 1,), block_tables (B, table_stride) and
 * seq_lens (B,) int32, as for helexa_paged_attention. Returns 0, -1 when scratch memory could not be
 * allocated, -2 when the metadata is inconsistent. */
static int decoder(const hx_model *m, int64_t T, float *x, const int64_t *positions, const float *inv_freq,
                   const int64_t *slots, int64_t B, const int32_t *query_start_loc, const int32_t *block_tables,
                   int64_t table_stride, const int32_t *seq_lens) {
    const int64_t E = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t QS = H * D, KS = KVH * D, QKV = QS + 2 * KS, BS = m->block_size;
    const float scale = 1.0f / sqrtf((float)D);
    if (query_start_loc[0] != 0 || query_start_loc[B] != T) return -2;
    /* Each buffer serves every value of its rows' layer that is dead by the time the next is written:
     * h the input norm's output, then the attention's (read by the output projection), then the post-norm's;
     * qkv the projected q|k|v, then the output projection's. The MLP's own buffers are per piece. */
    const int64_t mlp_rows = T < MLP_ROWS ? T : MLP_ROWS;
    const size_t f = sizeof(float);
    float *h = (float *)arena(S_H, f * (size_t)(T * (E > QS ? E : QS)));
    float *qkv = (float *)arena(S_QKV, f * (size_t)(T * (QKV > E ? QKV : E)));
    float *gu = (float *)arena(S_GU, f * (size_t)(mlp_rows * 2 * I)); /* per row: gate | up, then activations | up */
    float *down = (float *)arena(S_DOWN, f * (size_t)(mlp_rows * E));
    float *cos_t = (float *)arena(S_COS, f * (size_t)(T * D)), *ssin_t = (float *)arena(S_SIN, f * (size_t)(T * D));
    if (!h || !qkv || !gu || !down || !cos_t || !ssin_t) return -1;
    rope_tables(positions, inv_freq, T, D, cos_t, ssin_t);
    for (int64_t li = 0; li < m->num_layers; li++) {
        const hx_layer *L = m->layers + li;
        rms_norm_rows(x, L->input_norm, T, E, m->eps, h);
        if (linear(&L->qkv, h, T, E, qkv)) return -1;
        HX_FOR(T >= ROWS_PAR, t, T, { rope_and_write(m, L, qkv + t * QKV, t, cos_t, ssin_t, slots); });
        const int rc =
            attend(qkv, QKV, L, query_start_loc, block_tables, table_stride, seq_lens, B, H, KVH, D, BS, scale, h, QS);
        if (rc) return rc;
        if (linear(&L->o, h, T, QS, qkv)) return -1;
        for (int64_t i = 0; i < T * E; i++) x[i] += qkv[i];
        rms_norm_rows(x, L->post_norm, T, E, m->eps, h);
        for (int64_t t0 = 0; t0 < T; t0 += MLP_ROWS) { /* the MLP, MLP_ROWS rows at a time (see there) */
            const int64_t n = T - t0 < MLP_ROWS ? T - t0 : MLP_ROWS;
            if (linear(&L->gate_up, h + t0 * E, n, E, gu)) return -1;
            HX_FOR(n >= ROWS_PAR, t, n, { /* in place: each row's activations over its gate half */
                silu_mul(gu + t * 2 * I, gu + t * 2 * I + I, I, gu + t * 2 * I);
            });
            if (linear(&L->down, gu, n, 2 * I, down)) return -1;
            for (int64_t i = 0; i < n * E; i++) x[t0 * E + i] += down[i]; /* its rows' residual: no other piece reads x */
        }
    }
    return 0;
}

/* linear() for decoder_team's threads (helexa_wq_gemm_team; the bias added with the tiles). */
static void team_linear(const hx_linear *l, const float *x, int64_t m, int64_t ldx, float *y, void *runs, void *own) {
    helexa_wq_gemm_team(x, m, l->k, ldx, l->int4 ? (const uint8_t *)l->weight : NULL,
                        l->int4 ? NULL : (const int8_t *)l->weight, l->scales, l->zero_terms, l->half, l->n, l->group,
                        l->bias, y, runs, own);
}

/* decoder() for a step of fewer than ROWS_PAR rows (decode, a few drafts or sequences), with the same values, in
 * one parallel region for the whole step instead of one per projection and per attention. Entering a region
 * costs each projection ~1-2 us on the VMs measured (its threads woken after the weights streamed through the
 * caches), 121 times a step of the default model. Each thread keeps its own copy of the rows' residual stream
 * and computes their per-row work itself (norms, SiLU, residual adds, the projections' activation quantization:
 * the same operations on the same values on every thread, work one thread would do anyway at these row counts),
 * so the team waits only where a result is shared: after each projection (its column tiles shared out as
 * helexa_wq_gemm shares them), after RoPE and the K/V write (one thread), after the attention's tasks and after
 * their fold. Consecutive projections write different buffers, so a thread still reading one projection's
 * output is never overwritten by a thread already in the next. */
static int decoder_team(const hx_model *m, int64_t T, float *x, const int64_t *positions, const float *inv_freq,
                        const int64_t *slots, int64_t B, const int32_t *query_start_loc, const int32_t *block_tables,
                        int64_t table_stride, const int32_t *seq_lens) {
    const int64_t E = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t QS = H * D, KS = KVH * D, QKV = QS + 2 * KS, BS = m->block_size;
    const int64_t KMAX = E > QS ? (E > I ? E : I) : (QS > I ? QS : I); /* the widest projection input */
    const float scale = 1.0f / sqrtf((float)D);
    if (query_start_loc[0] != 0 || query_start_loc[B] != T || T <= 0 || T >= ROWS_PAR) return -2;
    const size_t f = sizeof(float);
    const int threads = helexa_threads();
    float *qkv = (float *)arena(S_QKV, f * (size_t)(T * QKV)); /* q|k|v, RoPE applied in place */
    float *att = (float *)arena(S_H, f * (size_t)(T * QS));    /* the attention's output */
    float *gu = (float *)arena(S_GU, f * (size_t)(T * 2 * I));  /* gate | up */
    float *od = (float *)arena(S_DOWN, f * (size_t)(T * E));    /* the output projection's, then down's */
    float *cos_t = (float *)arena(S_COS, f * (size_t)(T * D)), *ssin_t = (float *)arena(S_SIN, f * (size_t)(T * D));
    void *runs = arena(S_RUNS, helexa_wq_gemm_runs_bytes(threads));
    if (!qkv || !att || !gu || !od || !cos_t || !ssin_t || !runs) return -1;
    memset(runs, 0, helexa_wq_gemm_runs_bytes(threads));
    rope_tables(positions, inv_freq, T, D, cos_t, ssin_t);
    int64_t seq_of[ROWS_PAR]; /* each row's sequence, for the fold */
    for (int64_t b = 0; b < B; b++) {
        if (query_start_loc[b + 1] < query_start_loc[b] || query_start_loc[b + 1] > T) return -2;
        for (int64_t r = query_start_loc[b]; r < query_start_loc[b + 1]; r++) seq_of[r] = b;
    }
    hx_plan plan = {0};
    int failed = 0, rc = 0;
#pragma omp parallel num_threads(threads)
    {
        const int me = omp_get_thread_num(), team = omp_get_num_threads();
        float *xp = (float *)arena(S_TEAM_X, f * (size_t)(T * E)); /* this thread's copy of the residual stream */
        float *hp = (float *)arena(S_TEAM_H, f * (size_t)(T * E)); /* its norms' outputs */
        float *act = (float *)arena(S_TEAM_ACT, f * (size_t)(T * I));
        void *own = arena(S_TEAM_Q, helexa_wq_gemm_team_bytes(T, KMAX));
        if (!xp || !hp || !act || !own) {
#pragma omp atomic write
            failed = 1;
        } else {
            memcpy(xp, x, f * (size_t)(T * E));
        }
#pragma omp barrier
        for (int64_t li = 0; li < m->num_layers && !failed && !rc; li++) {
            const hx_layer *L = m->layers + li;
            for (int64_t t = 0; t < T; t++) rms_norm(xp + t * E, L->input_norm, E, m->eps, hp + t * E);
            team_linear(&L->qkv, hp, T, E, qkv, runs, own);
            if (me == 0) {
                for (int64_t t = 0; t < T; t++) rope_and_write(m, L, qkv + t * QKV, t, cos_t, ssin_t, slots);
                rc = attend_plan(query_start_loc, seq_lens, B, H, KVH, D, team, &plan);
            }
#pragma omp barrier
            if (rc) break;
#pragma omp for schedule(dynamic, 1)
            for (int64_t t = 0; t < plan.nt; t++) /* chunk tasks only: every sequence has at most SPLIT_ROWS rows */
                attend_task(plan.task + t, &plan, qkv, QKV, L, query_start_loc, block_tables, table_stride, seq_lens,
                            H, KVH, D, BS, scale, att, QS);
#pragma omp for schedule(static)
            for (int64_t rh = 0; rh < T * H; rh++)
                attend_fold(&plan, query_start_loc, seq_lens, seq_of[rh / H], rh / H, rh % H, H, KVH, D, att, QS);
            team_linear(&L->o, att, T, QS, od, runs, own);
            for (int64_t i = 0; i < T * E; i++) xp[i] += od[i];
            for (int64_t t = 0; t < T; t++) rms_norm(xp + t * E, L->post_norm, E, m->eps, hp + t * E);
            team_linear(&L->gate_up, hp, T, E, gu, runs, own);
            for (int64_t t = 0; t < T; t++) silu_mul(gu + t * 2 * I, gu + t * 2 * I + I, I, act + t * I);
            team_linear(&L->down, act, T, I, od, runs, own);
            for (int64_t i = 0; i < T * E; i++) xp[i] += od[i];
        }
        if (me == 0 && !failed && !rc) memcpy(x, xp, f * (size_t)(T * E));
    }
    return failed ? -1 : rc;
}

#define HEAD_COLS 64 /* output columns per task of the dense head: their weight stays in cache across the rows */

/* One dot product of the dense head: x (K) . w (K), 8 lanes over k with fused multiply-adds in order,
 * a tail of K % 8 in order, then the lanes summed by hsum. The one computation of a (row, column). */
static inline float dense_dot(const float *x, const float *w, int64_t k) {
    __m256 acc = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= k; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(x + i), _mm256_loadu_ps(w + i), acc);
    float s = hsum(acc);
    for (; i < k; i++) s += x[i] * w[i];
    return s;
}

/* y (M, N) = x (M, K) @ w (N, K).T in float32 for a dense output head, each (row, column) by dense_dot
 * whatever M is (torch's matmul may pick its summation order by the batch's shape). Tasks are blocks
 * of HEAD_COLS columns; within one, 2 columns x 4 rows share their loads. */
static void dense_head(const float *x, int64_t M, int64_t K, const float *w, int64_t N, float *y) {
#pragma omp parallel for schedule(static) num_threads(helexa_threads())
    for (int64_t n0 = 0; n0 < N; n0 += HEAD_COLS) {
        const int64_t n1 = n0 + HEAD_COLS < N ? n0 + HEAD_COLS : N;
        for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t m1 = m0 + 4 < M ? m0 + 4 : M;
            int64_t n = n0;
            if (m1 - m0 == 4 && K % 8 == 0)
                for (; n + 2 <= n1; n += 2) {
                    __m256 a[8];
                    for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
                    const float *w0 = w + n * K, *w1 = w0 + K;
                    for (int64_t i = 0; i < K; i += 8) {
                        const __m256 u0 = _mm256_loadu_ps(w0 + i), u1 = _mm256_loadu_ps(w1 + i);
                        for (int r = 0; r < 4; r++) {
                            const __m256 xv = _mm256_loadu_ps(x + (m0 + r) * K + i);
                            a[2 * r] = _mm256_fmadd_ps(xv, u0, a[2 * r]);
                            a[2 * r + 1] = _mm256_fmadd_ps(xv, u1, a[2 * r + 1]);
                        }
                    }
                    for (int r = 0; r < 4; r++) {
                        y[(m0 + r) * N + n] = hsum(a[2 * r]);
                        y[(m0 + r) * N + n + 1] = hsum(a[2 * r + 1]);
                    }
                }
            for (; n < n1; n++)
                for (int64_t m = m0; m < m1; m++) y[m * N + n] = dense_dot(x + m * K, w + n * K, K);
        }
    }
}

/* The index of the largest of x[0..n), n > 0, as torch's argmax gives it: the first of equal maxima
 * (-0.0 equals +0.0), and the first NaN where there is one (NaN counts as the largest). Two passes, 8
 * lanes at a time: the maximum and whether any value is NaN, then the first index holding the answer. */
static int64_t argmax_of(const float *x, int64_t n) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v); /* a NaN may land here: then the second pass looks for NaN instead */
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    int nan = _mm256_movemask_ps(unordered) != 0;
    for (; i < n; i++) {
        if (x[i] != x[i]) nan = 1;
        else if (x[i] > m) m = x[i];
    }
    if (nan) {
        for (i = 0; i < n; i++)
            if (x[i] != x[i]) return i;
    }
    const __m256 target = _mm256_set1_ps(m);
    for (i = 0; i + 8 <= n; i += 8) {
        const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), target, _CMP_EQ_OQ));
        if (hit) return i + __builtin_ctz((unsigned)hit);
    }
    for (; i < n; i++)
        if (x[i] == m) return i;
    return 0; /* not reached: m is one of the values */
}

/* out[r] = argmax_of(row r) for x (rows, cols), cols > 0, rows `stride` floats apart: a greedy step's
 * tokens from its logits, the rows in parallel from 4 of them. */
void helexa_argmax_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t *out) {
    HX_FOR(rows >= 4, r, rows, { out[r] = argmax_of(x + r * stride, cols); });
}

/* Log-probabilities of one row x (n > 0 floats): *mx its maximum, *logsum log of the sum of exp(x - *mx)
 * (exp8's, 8 lanes in order, then the tail by expf), and its k (0 <= k <= min(n, HX_TOP_MAX)) largest
 * values' indices in ids, largest first, equal values by the lower index, with their log-probabilities
 * (x - *mx) - *logsum in vals. One pass finds the maximum and the k (a value enters the list only when it
 * beats the list's smallest), a second sums; with mx NULL only ids are written (no sum). Returns 1 where
 * the row holds a NaN (the outputs then mean nothing), else 0. A row whose maximum is not finite gives NaN
 * sums, as a softmax does. */
#define HX_TOP_MAX 64
static int logprobs_of(const float *x, int64_t n, int64_t k, float *mx, float *logsum, int64_t *ids, float *vals) {
    float bv[HX_TOP_MAX];
    int64_t bi[HX_TOP_MAX], c = 0, i = 0;
    float m = -INFINITY;
    int nan = 0;
    for (; i < n && c < k; i++) { /* the first k values, insertion-sorted (after equal ones: lower index first) */
        const float v = x[i];
        if (v != v) nan = 1;
        else if (v > m) m = v;
        int64_t j = c++;
        for (; j > 0 && bv[j - 1] < v; j--) bv[j] = bv[j - 1], bi[j] = bi[j - 1];
        bv[j] = v, bi[j] = i;
    }
    float thr = k ? bv[k - 1] : INFINITY; /* what a value must beat to enter the list */
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (; i + 8 <= n; i += 8) {
        const __m256 v = _mm256_loadu_ps(x + i);
        top = _mm256_max_ps(top, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        int hit = _mm256_movemask_ps(_mm256_cmp_ps(v, _mm256_set1_ps(thr), _CMP_GT_OQ));
        while (hit) {
            const int64_t at = i + __builtin_ctz((unsigned)hit);
            hit &= hit - 1;
            const float xv = x[at];
            if (!(xv > thr)) continue; /* the list moved on within these 8 */
            int64_t j = k - 1;
            for (; j > 0 && bv[j - 1] < xv; j--) bv[j] = bv[j - 1], bi[j] = bi[j - 1];
            bv[j] = xv, bi[j] = at;
            thr = bv[k - 1];
        }
    }
    for (; i < n; i++) {
        const float v = x[i];
        if (v != v) {
            nan = 1;
            continue;
        }
        if (v > m) m = v;
        if (v > thr) {
            int64_t j = k - 1;
            for (; j > 0 && bv[j - 1] < v; j--) bv[j] = bv[j - 1], bi[j] = bi[j - 1];
            bv[j] = v, bi[j] = i;
            thr = bv[k - 1];
        }
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, top);
    for (int j = 0; j < 8; j++) m = lanes[j] > m ? lanes[j] : m;
    if (nan || _mm256_movemask_ps(unordered)) return 1;
    if (!mx) {
        for (int64_t t = 0; t < k; t++) ids[t] = bi[t];
        return 0;
    }
    const __m256 mv = _mm256_set1_ps(m);
    __m256 sum8 = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= n; j += 8) sum8 = _mm256_add_ps(sum8, exp8(_mm256_sub_ps(_mm256_loadu_ps(x + j), mv)));
    float sum = hsum(sum8);
    for (; j < n; j++) sum += expf(x[j] - m);
    const float ls = logf(sum);
    for (int64_t t = 0; t < k; t++) ids[t] = bi[t], vals[t] = (bv[t] - m) - ls;
    *mx = m;
    *logsum = ls;
    return 0;
}

/* logprobs_of for every row of x (rows, cols), rows `stride` floats apart, the rows in parallel from 4 of
 * them: shift (rows, 2) gets each row's maximum and log-sum, ids and vals (rows, k) its k largest; with
 * shift NULL, ids alone (vals is not read). Returns 0, -2 when k is outside [0, min(cols, HX_TOP_MAX)], or
 * 1 when a row holds a NaN. */
int helexa_logprobs_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, int64_t k, float *shift,
                         int64_t *ids, float *vals) {
    if (k < 0 || k > cols || k > HX_TOP_MAX || cols <= 0) return -2;
    int nan = 0;
#pragma omp parallel for schedule(static) if (rows >= 4) num_threads(helexa_threads()) reduction(| : nan)
    for (int64_t r = 0; r < rows; r++)
        nan |= shift ? logprobs_of(x + r * stride, cols, k, shift + 2 * r, shift + 2 * r + 1, ids + r * k, vals + r * k)
                     : logprobs_of(x + r * stride, cols, k, NULL, NULL, ids + r * k, NULL);
    return nan;
}

/* The 8 values of x from column j of n, divided by t unless t is 1, -inf past n. */
static inline __m256 scaled8(const float *x, int64_t j, int64_t n, float t) {
    __m256 v;
    if (j + 8 <= n) {
        v = _mm256_loadu_ps(x + j);
    } else {
        float lanes[8];
        for (int l = 0; l < 8; l++) lanes[l] = j + l < n ? x[j + l] : -INFINITY;
        v = _mm256_loadu_ps(lanes);
    }
    return t == 1.0f ? v : _mm256_div_ps(v, _mm256_set1_ps(t));
}

#define HX_DRAW_BLOCK 64 /* columns a block: the running sum walks whole blocks, then one block's columns */
#define HX_DRAW_BLOCKS 8192 /* blocks a row may have (columns up to 524,288) */

/* One token drawn from row x (n > 0 floats) at temperature t by the uniform u in [0, 1): with y = x / t
 * (x itself at t = 1), m = max(y) and w = exp8(y - m) (0 under -87.3, so for -inf), blocks of 64 columns
 * summed 8 lanes at a time then across the lanes (`hsum`), the blocks' sums added in order into the total;
 * the token is the first column whose running sum (the blocks before it, then its block's columns one by
 * one in order) exceeds u * total, or, where rounding leaves the target unreached, the last column of
 * positive weight in the block (or row) where it ran out. A column of weight 0 is never drawn. Returns -1
 * where the row holds a NaN or its maximum is not finite. */
static int64_t draw_of(const float *x, int64_t n, float t, float u) {
    __m256 top = _mm256_set1_ps(-INFINITY), unordered = _mm256_setzero_ps();
    for (int64_t j = 0; j < n; j += 8) {
        const __m256 v = scaled8(x, j, n, t);
        top = _mm256_max_ps(top, v);
        unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    }
    float lanes[8], m = -INFINITY;
    _mm256_storeu_ps(lanes, top);
    for (int l = 0; l < 8; l++) m = lanes[l] > m ? lanes[l] : m;
    if (_mm256_movemask_ps(unordered) || !isfinite(m)) return -1;
    const __m256 mv = _mm256_set1_ps(m);
    float sums[HX_DRAW_BLOCKS];
    const int64_t blocks = (n + HX_DRAW_BLOCK - 1) / HX_DRAW_BLOCK;
    float total = 0.0f;
    for (int64_t b = 0; b < blocks; b++) {
        __m256 s8 = _mm256_setzero_ps();
        const int64_t end = (b + 1) * HX_DRAW_BLOCK < n ? (b + 1) * HX_DRAW_BLOCK : n;
        for (int64_t j = b * HX_DRAW_BLOCK; j < end; j += 8)
            s8 = _mm256_add_ps(s8, exp8(_mm256_sub_ps(scaled8(x, j, n, t), mv)));
        sums[b] = hsum(s8);
        total += sums[b];
    }
    const float target = u * total;
    float running = 0.0f;
    int64_t b = 0, last = -1;
    for (; b < blocks; b++) {
        if (sums[b] > 0.0f) last = b;
        if (running + sums[b] > target) break;
        running += sums[b];
    }
    if (b == blocks) b = last; /* rounding: the last block of positive weight (the maximum's weight is 1) */
    const int64_t start = b * HX_DRAW_BLOCK, end = start + HX_DRAW_BLOCK < n ? start + HX_DRAW_BLOCK : n;
    float w[HX_DRAW_BLOCK];
    for (int64_t j = start; j < end; j += 8)
        _mm256_storeu_ps(w + (j - start), exp8(_mm256_sub_ps(scaled8(x, j, n, t), mv)));
    int64_t pick = -1;
    for (int64_t j = start; j < end; j++) {
        if (w[j - start] <= 0.0f) continue;
        pick = j;
        running += w[j - start];
        if (running > target) break;
    }
    return pick;
}

/* draw_of for the `count` rows `which` of x (rows `stride` floats apart, `cols` columns each), row which[i]
 * at temperature t[i] by u[i], into out[i], in parallel from 4 of them. Returns 0, -2 when cols is outside
 * [1, 64 x 8,192], or 1 when a row held a NaN or had no finite maximum (its out is then -1). */
int helexa_draw_rows(const float *x, int64_t cols, int64_t stride, const int64_t *which, int64_t count, const float *t,
                     const float *u, int64_t *out) {
    if (cols <= 0 || cols > (int64_t)HX_DRAW_BLOCK * HX_DRAW_BLOCKS) return -2;
    int bad = 0;
#pragma omp parallel for schedule(static) if (count >= 4) num_threads(helexa_threads()) reduction(| : bad)
    for (int64_t i = 0; i < count; i++) {
        out[i] = draw_of(x + which[i] * stride, cols, t[i], u[i]);
        bad |= out[i] < 0;
    }
    return bad;
}

/* A float's key for an ascending integer sort that ranks the floats descending: -0.0 keyed as +0.0 (a sort
 * ranks the two equal). */
static inline uint32_t descending_key(float v) {
    if (v == 0.0f) v = 0.0f;
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending with the float */
    return ~u;
}

/* Row x (n floats, no NaN) sorted descending, equal values in column order (a stable sort): its values into
 * vals and their columns into ids. An LSD radix sort of the keys, 11 + 11 + 10 bits, each pass stable, in
 * the scratch arrays key (2n) and col (2n). */
static void sort_descending_of(const float *x, int64_t n, float *vals, int64_t *ids, uint32_t *key, int32_t *col) {
    uint32_t *ka = key, *kb = key + n;
    int32_t *ca = col, *cb = col + n;
    for (int64_t i = 0; i < n; i++) ka[i] = descending_key(x[i]), ca[i] = (int32_t)i;
    static const int shift[3] = {0, 11, 22};
    for (int pass = 0; pass < 3; pass++) {
        int64_t start[2048] = {0};
        const int sh = shift[pass];
        for (int64_t i = 0; i < n; i++) start[(ka[i] >> sh) & 2047]++;
        int64_t at = 0;
        for (int d = 0; d < 2048; d++) {
            const int64_t c = start[d];
            start[d] = at;
            at += c;
        }
        for (int64_t i = 0; i < n; i++) {
            const int64_t to = start[(ka[i] >> sh) & 2047]++;
            kb[to] = ka[i], cb[to] = ca[i];
        }
        uint32_t *kt = ka;
        ka = kb, kb = kt;
        int32_t *ct = ca;
        ca = cb, cb = ct;
    }
    for (int64_t i = 0; i < n; i++) ids[i] = ca[i], vals[i] = x[ca[i]];
}

/* sort_descending_of for every row of x (rows, cols), rows `stride` floats apart, into vals and ids (rows,
 * cols), the rows in parallel from 2 of them. Returns 0, -1 when scratch memory could not be allocated, -2
 * when cols is outside [1, 2^31), or 1 when a row holds a NaN (nothing is sorted then). */
int helexa_sort_rows(const float *x, int64_t rows, int64_t cols, int64_t stride, float *vals, int64_t *ids) {
    if (cols <= 0 || cols >= ((int64_t)1 << 31)) return -2;
    int nan = 0;
    for (int64_t r = 0; r < rows && !nan; r++)
        for (int64_t i = 0; i < cols; i++)
            if (x[r * stride + i] != x[r * stride + i]) {
                nan = 1;
                break;
            }
    if (nan) return 1;
    int failed = 0;
#pragma omp parallel if (rows >= 2) num_threads(helexa_threads()) reduction(| : failed)
    {
        uint32_t *key = (uint32_t *)malloc(sizeof(uint32_t) * 2 * (size_t)cols);
        int32_t *col = (int32_t *)malloc(sizeof(int32_t) * 2 * (size_t)cols);
        if (!key || !col) failed = 1;
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++)
            if (key && col) sort_descending_of(x + r * stride, cols, vals + r * cols, ids + r * cols, key, col);
        free(key);
        free(col);
    }
    return failed ? -1 : 0;
}

/* The head's columns [c0, c1) of x (M, E) into y (M, c1 - c0): the quantized GEMM's (`linear_cols`: c0 and c1
 * on its tiles of 16 columns, or c1 its last) or dense_head's, each (row, column) computed as in the whole head. */
static int head_cols(const hx_table *head, const float *x, int64_t M, int64_t E, int64_t c0, int64_t c1, float *y) {
    if (head->q.weight) return linear_cols(&head->q, x, M, E, c0, c1, y);
    dense_head(x, M, E, head->dense + c0 * E, c1 - c0, y);
    return 0;
}

/* tokens[r] = argmax_of row r's logits over columns [0, cols) (0 < cols <= head->rows), x (A, E) the
 * final-normed rows: the head computed `block` columns at a time (rounded down to its tiles of 16, at least
 * one tile) into a block this thread keeps, each row's running answer folded after each block. A block's
 * logits are the whole head's bits (`head_cols`); the fold keeps a row's first NaN, else the first of its
 * largest values, so the token is argmax_of's over the whole row, and torch's argmax's. No row's logits are
 * ever stored whole: A x block floats at most. Returns 0 or -1 (scratch memory). */
static int head_argmax(const hx_table *head, const float *x, int64_t A, int64_t E, int64_t cols, int64_t block,
                       int64_t *tokens) {
    block = block < 16 ? 16 : block / 16 * 16;
    /* the columns computed: the quantized head's whole tiles covering [0, cols); a dense head's exactly */
    const int64_t end = head->q.weight ? ((cols + 15) / 16 * 16 < head->rows ? (cols + 15) / 16 * 16 : head->rows)
                                       : cols;
    if (block > end) block = end;
    float *y = (float *)arena(S_HEAD_BLOCK, sizeof(float) * (size_t)(A * block));
    float *best = (float *)arena(S_HEAD_BEST, sizeof(float) * (size_t)A);
    if (!y || !best) return -1;
    for (int64_t c0 = 0; c0 < end; c0 += block) {
        const int64_t c1 = c0 + block < end ? c0 + block : end, w = c1 - c0, n = (c1 < cols ? c1 : cols) - c0;
        if (head_cols(head, x, A, E, c0, c1, y)) return -1;
        HX_FOR(A >= 4, r, A, {
            const float *row = y + r * w;
            const int64_t i = argmax_of(row, n);
            const float v = row[i];
            /* a NaN found earlier stays; else a NaN, or a strictly larger value, takes over */
            if (c0 == 0 || (best[r] == best[r] && (v != v || v > best[r]))) best[r] = v, tokens[r] = c0 + i;
        });
    }
    return 0;
}

/* One step of the whole model, token ids to logits: the rows' embeddings looked up in m->embed (or, when
 * m->embed has no table, copied from x_in (T, E), which is only read), every decoder layer (`decoder`),
 * then for each of the S rows `rows` (S,) int64 of the step, in that order, its final-normed hidden state
 * through m->head into logits (S, V) float32, and for each of the A rows `arg_rows` (A,) only its logits'
 * argmax over columns [0, arg_cols) into tokens (A,) int64 (`head_argmax`, `arg_block` columns of the head
 * at a time; its logits are never stored). Each of these is the per-row computation the Python side
 * used to run around the decoder: the lookup is helexa_dequantize_rows' (or a float32 row's copy), the
 * norm is rms_norm's, the head is the quantized GEMM's (`linear`) or dense_head's, each row on its own;
 * so a row's logits do not depend on the other rows of the call. Returns 0, -1 when scratch memory could
 * not be allocated, -2 when the metadata is inconsistent (or a row is outside [0, T), or arg_cols outside
 * [1, V] while A > 0), -3 when a token id is outside the embedding's rows. On -2 or -3 nothing has been
 * written (caches, logits, tokens); after -1 logits and tokens mean nothing. */
int helexa_forward(const hx_model *m, int64_t T, const int64_t *ids, const float *x_in, const int64_t *positions,
                   const float *inv_freq, const int64_t *slots, int64_t B, const int32_t *query_start_loc,
                   const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, int64_t S,
                   const int64_t *rows, float *logits, int64_t A, const int64_t *arg_rows, int64_t arg_cols,
                   int64_t arg_block, int64_t *tokens) {
    const int64_t E = m->hidden;
    const hx_table *emb = &m->embed, *head = &m->head;
    for (int64_t s = 0; s < S; s++)
        if (rows[s] < 0 || rows[s] >= T) return -2;
    for (int64_t a = 0; a < A; a++)
        if (arg_rows[a] < 0 || arg_rows[a] >= T) return -2;
    if (A > 0 && (arg_cols < 1 || arg_cols > head->rows)) return -2;
    float *x = (float *)arena(S_X, sizeof(float) * (size_t)(T * E));
    float *picked = (float *)arena(S_PICKED, sizeof(float) * (size_t)((S + A > 0 ? S + A : 1) * E));
    if (!x || !picked) return -1;
    int rc = 0;
    if (emb->q.weight) {
        const hx_linear *q = &emb->q;
        rc = helexa_dequantize_rows(q->int4 ? (const uint8_t *)q->weight : NULL, q->int4 ? NULL : (const int8_t *)q->weight,
                                    q->scales, q->zero_terms, q->half, q->n, q->k, q->group, ids, T, x);
    } else if (emb->dense) {
        for (int64_t t = 0; t < T && !rc; t++)
            if (ids[t] < 0 || ids[t] >= emb->rows) rc = -3;
            else memcpy(x + t * E, emb->dense + ids[t] * E, sizeof(float) * (size_t)E);
    } else {
        memcpy(x, x_in, sizeof(float) * (size_t)(T * E));
    }
    if (rc) return rc;
    if (T > 0 && T < ROWS_PAR && helexa_threads() > 1) /* few rows and threads to share them: one region */
        rc = decoder_team(m, T, x, positions, inv_freq, slots, B, query_start_loc, block_tables, table_stride, seq_lens);
    else
        rc = decoder(m, T, x, positions, inv_freq, slots, B, query_start_loc, block_tables, table_stride, seq_lens);
    if (rc || S + A == 0) return rc;
    for (int64_t s = 0; s < S; s++) rms_norm(x + rows[s] * E, m->final_norm, E, m->eps, picked + s * E);
    for (int64_t a = 0; a < A; a++) rms_norm(x + arg_rows[a] * E, m->final_norm, E, m->eps, picked + (S + a) * E);
    if (S > 0 && head_cols(head, picked, S, E, 0, head->rows, logits)) return -1;
    if (A > 0) return head_argmax(head, picked + S * E, A, E, arg_cols, arg_block, tokens);
    return 0;
}
