/* One decode step of a whole quantized decoder on the CPU: every layer's norms, quantized
 * projections (helexa_wq_gemm), RoPE, K/V write into the paged cache and paged attention, in one
 * call. Each sequence of the batch brings exactly one new token.
 *
 * It computes what helexa.model.transformer.CausalLM does for such a step (its torch path, with
 * helexa.kernels.reference's write_kv and paged_attention, is the oracle of the tests), in float32:
 *
 *   per layer:  h = rms_norm(x) * w_in;  q|k|v = h @ Wqkv.T (+ b);  q, k = rope(norm_qk(q), norm_qk(k))
 *               cache[slot] = k, v;  a = softmax(q . K / sqrt(D)) V over the sequence's blocks
 *               x += a @ Wo.T (+ b);  h = rms_norm(x) * w_post;  g|u = h @ Wgu.T (+ b)
 *               x += (silu(g) * u) @ Wdown.T (+ b)
 *   at the end: out = rms_norm(x) * w_final
 *
 * Caches are float32 (NB, BS, KVH, D) with any strides but a contiguous last dimension; positions
 * past a sequence's length are never read. A slot of -1 writes nothing. D must be a multiple of 8 up
 * to 512, and H / KVH at most GMAX (16).
 * Threads: OpenMP (the runtime torch has loaded) over the projections' column tiles and over
 * attention's tasks: (sequence, KV head, chunk of KCHUNK keys), each scoring the KV head's query
 * heads together, the chunks then merged by their maxima and sums (split-K "flash decoding").
 */
#include <immintrin.h>
#include <math.h>
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
    float *k_cache, *v_cache;
    int64_t block_stride, row_stride, head_stride; /* of both caches, in floats */
} hx_layer;

typedef struct {
    int64_t num_layers, hidden, heads, kv_heads, head_dim, intermediate, block_size;
    double eps;
    const float *final_norm; /* (E,) */
    const hx_layer *layers;
} hx_model;

static void *scratch(size_t floats) { return aligned_alloc(64, ((floats * sizeof(float) + 63) / 64) * 64); }

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* y (n,) = x * w / sqrt(mean(x^2) + eps). */
static void rms_norm(const float *x, const float *w, int64_t n, double eps, float *y) {
    double ss = 0.0;
    for (int64_t i = 0; i < n; i++) ss += (double)x[i] * x[i];
    const float r = (float)(1.0 / sqrt(ss / (double)n + eps));
    for (int64_t i = 0; i < n; i++) y[i] = w[i] * (x[i] * r);
}

static void linear(const hx_linear *l, const float *x, int64_t m, float *y) {
    helexa_wq_gemm(x, m, l->k, l->int4 ? (const uint8_t *)l->weight : NULL, l->int4 ? NULL : (const int8_t *)l->weight,
                   l->scales, l->zero_terms, l->half, l->n, l->group, y);
    if (l->bias)
        for (int64_t r = 0; r < m; r++)
            for (int64_t i = 0; i < l->n; i++) y[r * l->n + i] += l->bias[i];
}

/* One head (D,) in place: optional RMSNorm, then rotate-half RoPE with cos and signed sin (D,). */
static void rope_head(float *x, const float *norm, double eps, const float *cos, const float *ssin, int64_t d) {
    float tmp[512];
    if (norm) rms_norm(x, norm, d, eps, x);
    const int64_t h = d / 2;
    for (int64_t i = 0; i < d; i++) tmp[i] = x[i] * cos[i] + x[i < h ? i + h : i - h] * ssin[i];
    memcpy(x, tmp, sizeof(float) * (size_t)d);
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

/* The 8 sums of 8 vectors, in order. */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 t0 = _mm256_hadd_ps(a0, a1), t1 = _mm256_hadd_ps(a2, a3);
    const __m256 t2 = _mm256_hadd_ps(a4, a5), t3 = _mm256_hadd_ps(a6, a7);
    const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3); /* lanes: 0123|0123, 4567|4567 */
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

#define KCHUNK 128 /* keys per attention task: a split of a sequence, merged afterwards */
#define GMAX 16    /* query heads per KV head the step takes (checked by the caller) */

/* One task of paged decode attention: the G query heads q (G, D) of KV head kvh over the keys
 * [j0, j1) of one sequence. Writes, per head g, the running max m[g], the sum of exp l[g] and the
 * unnormalised output o[g] (D,), for `merge`. */
static void attend_split(const float *q, int64_t G, const hx_layer *L, const int32_t *table, int64_t j0, int64_t j1,
                         int64_t bs, int64_t kvh, int64_t d, float scale, float *m, float *l, float *o) {
    float scores[GMAX * KCHUNK] __attribute__((aligned(32)));
    const float *kptr[KCHUNK], *vptr[KCHUNK];
    const int64_t n = j1 - j0, nv = d / 8;
    for (int64_t j = 0; j < n; j++) {
        const int64_t pos = j0 + j, off = (int64_t)table[pos / bs] * L->block_stride + (pos % bs) * L->row_stride;
        kptr[j] = L->k_cache + off + kvh * L->head_stride;
        vptr[j] = L->v_cache + off + kvh * L->head_stride;
    }
    for (int64_t g = 0; g < G; g++) {
        const float *qg = q + g * d;
        float *sg = scores + g * KCHUNK;
        int64_t j = 0;
        for (; j + 8 <= n; j += 8) {
            __m256 a[8];
            for (int r = 0; r < 8; r++) a[r] = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) {
                const __m256 qv = _mm256_loadu_ps(qg + i);
                for (int r = 0; r < 8; r++) a[r] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kptr[j + r] + i), a[r]);
            }
            _mm256_storeu_ps(sg + j, _mm256_mul_ps(hsum8(a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7]),
                                                   _mm256_set1_ps(scale)));
        }
        for (; j < n; j++) {
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qg + i), _mm256_loadu_ps(kptr[j] + i), acc);
            sg[j] = hsum(acc) * scale;
        }
        float mx = -INFINITY;
        for (j = 0; j < n; j++) mx = sg[j] > mx ? sg[j] : mx;
        const __m256 mv = _mm256_set1_ps(mx);
        __m256 sum8 = _mm256_setzero_ps();
        for (j = 0; j + 8 <= n; j += 8) {
            const __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + j), mv));
            _mm256_storeu_ps(sg + j, p);
            sum8 = _mm256_add_ps(sum8, p);
        }
        float sum = hsum(sum8);
        for (; j < n; j++) {
            sg[j] = expf(sg[j] - mx);
            sum += sg[j];
        }
        __m256 acc[64]; /* D <= 512 */
        for (int64_t i = 0; i < nv; i++) acc[i] = _mm256_setzero_ps();
        for (j = 0; j < n; j++) {
            const __m256 p = _mm256_set1_ps(sg[j]);
            const float *v = vptr[j];
            for (int64_t i = 0; i < nv; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
        for (int64_t i = 0; i < nv; i++) _mm256_storeu_ps(o + g * d + 8 * i, acc[i]);
        m[g] = mx;
        l[g] = sum;
    }
}

/* Paged decode attention of B sequences, one query each: q (B, H, D) -> out (B, H, D). Tasks are
 * (sequence, KV head, chunk of KCHUNK keys), spread over the threads, then merged per head. */
static int attend_all(const float *q, int64_t q_stride, const hx_layer *L, const int32_t *block_tables,
                      int64_t table_stride, const int32_t *seq_lens, int64_t B, int64_t H, int64_t KVH, int64_t D,
                      int64_t bs, float scale, float *out, int64_t out_stride) {
    const int64_t G = H / KVH;
    int64_t *first = (int64_t *)malloc(sizeof(int64_t) * (size_t)(B + 1)); /* first task of each sequence */
    if (!first) return -1;
    first[0] = 0;
    for (int64_t b = 0; b < B; b++) {
        const int64_t n = seq_lens[b] > 0 ? seq_lens[b] : 0;
        first[b + 1] = first[b] + KVH * ((n + KCHUNK - 1) / KCHUNK);
    }
    const int64_t tasks = first[B];
    float *part = scratch((size_t)(tasks * G * (D + 2))); /* per task and head: o (D), m, l */
    if (!part) {
        free(first);
        return -1;
    }
#pragma omp parallel for schedule(dynamic, 1) num_threads(helexa_threads())
    for (int64_t t = 0; t < tasks; t++) {
        int64_t b = 0;
        while (first[b + 1] <= t) b++;
        const int64_t chunks = (first[b + 1] - first[b]) / KVH, local = t - first[b];
        const int64_t kvh = local / chunks, c = local % chunks, n = seq_lens[b];
        float *p = part + t * G * (D + 2);
        attend_split(q + b * q_stride + kvh * G * D, G, L, block_tables + b * table_stride, c * KCHUNK,
                     (c + 1) * KCHUNK < n ? (c + 1) * KCHUNK : n, bs, kvh, D, scale, p + G * D, p + G * D + G, p);
    }
    for (int64_t b = 0; b < B; b++) {
        const int64_t chunks = (first[b + 1] - first[b]) / KVH;
        for (int64_t h = 0; h < H; h++) {
            const int64_t kvh = h / G, g = h % G;
            float *o = out + b * out_stride + h * D;
            float mx = -INFINITY, l = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float *p = part + (first[b] + kvh * chunks + c) * G * (D + 2);
                mx = p[G * D + g] > mx ? p[G * D + g] : mx;
            }
            for (int64_t i = 0; i < D; i++) o[i] = 0.0f;
            for (int64_t c = 0; c < chunks; c++) {
                const float *p = part + (first[b] + kvh * chunks + c) * G * (D + 2);
                const float w = expf(p[G * D + g] - mx);
                l += w * p[G * D + G + g];
                for (int64_t i = 0; i < D; i++) o[i] += w * p[g * D + i];
            }
            const float inv = l > 0.0f ? 1.0f / l : 0.0f;
            for (int64_t i = 0; i < D; i++) o[i] *= inv;
        }
    }
    free(part);
    free(first);
    return 0;
}

static void write_cache(const hx_layer *L, int64_t slot, int64_t bs, const float *k, const float *v, int64_t kvh,
                        int64_t d) {
    if (slot < 0) return;
    const int64_t base = (slot / bs) * L->block_stride + (slot % bs) * L->row_stride;
    for (int64_t h = 0; h < kvh; h++) {
        memcpy(L->k_cache + base + h * L->head_stride, k + h * d, sizeof(float) * (size_t)d);
        memcpy(L->v_cache + base + h * L->head_stride, v + h * d, sizeof(float) * (size_t)d);
    }
}

/* Standalone paged decode attention (the fused step's, exposed for its tests): q (B, H, D) -> out
 * (B, H, D), one query per sequence at position seq_lens[b] - 1, reading blocks through
 * block_tables (B, table_stride) int32. Returns 0, or -1 when scratch memory ran out. */
int helexa_paged_decode(const float *q, float *k_cache, float *v_cache, int64_t block_stride, int64_t row_stride,
                        int64_t head_stride, int64_t block_size, int64_t B, int64_t H, int64_t KVH, int64_t D,
                        const int32_t *block_tables, int64_t table_stride, const int32_t *seq_lens, float scale,
                        float *out) {
    hx_layer L;
    memset(&L, 0, sizeof L);
    L.k_cache = k_cache;
    L.v_cache = v_cache;
    L.block_stride = block_stride;
    L.row_stride = row_stride;
    L.head_stride = head_stride;
    return attend_all(q, H * D, &L, block_tables, table_stride, seq_lens, B, H, KVH, D, block_size, scale, out, H * D);
}

/* One decode step: x (B, E) holds the new tokens' embeddings on entry; out (B, E) receives the
 * final-normed hidden states. cos, ssin (B, D): RoPE of each token's position (sin with its first
 * half negated); slots (B,) int64; block_tables (B, table_stride) int32; seq_lens (B,) int32
 * (including the new token). Returns 0, or -1 when scratch memory could not be allocated. */
int helexa_decode_step(const hx_model *m, int64_t B, float *x, const float *cos, const float *ssin,
                       const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                       const int32_t *seq_lens, float *out) {
    const int64_t E = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t QS = H * D, KS = KVH * D, QKV = QS + 2 * KS, BS = m->block_size;
    const float scale = 1.0f / sqrtf((float)D);
    float *h = scratch((size_t)(B * E)), *qkv = scratch((size_t)(B * QKV)), *att = scratch((size_t)(B * QS));
    float *proj = scratch((size_t)(B * E)), *gu = scratch((size_t)(B * 2 * I)), *act = scratch((size_t)(B * I));
    int rc = 0;
    if (!h || !qkv || !att || !proj || !gu || !act) {
        rc = -1;
        goto done;
    }
    for (int64_t li = 0; li < m->num_layers; li++) {
        const hx_layer *L = m->layers + li;
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * E, L->input_norm, E, m->eps, h + b * E);
        linear(&L->qkv, h, B, qkv);
        for (int64_t b = 0; b < B; b++) {
            float *row = qkv + b * QKV;
            for (int64_t hd = 0; hd < H; hd++) rope_head(row + hd * D, L->q_norm, m->eps, cos + b * D, ssin + b * D, D);
            for (int64_t hd = 0; hd < KVH; hd++)
                rope_head(row + QS + hd * D, L->k_norm, m->eps, cos + b * D, ssin + b * D, D);
            write_cache(L, slots[b], BS, row + QS, row + QS + KS, KVH, D);
        }
        if (attend_all(qkv, QKV, L, block_tables, table_stride, seq_lens, B, H, KVH, D, BS, scale, att, QS)) {
            rc = -1;
            goto done;
        }
        linear(&L->o, att, B, proj);
        for (int64_t i = 0; i < B * E; i++) x[i] += proj[i];
        for (int64_t b = 0; b < B; b++) rms_norm(x + b * E, L->post_norm, E, m->eps, h + b * E);
        linear(&L->gate_up, h, B, gu);
        for (int64_t b = 0; b < B; b++)
            for (int64_t i = 0; i < I; i++) {
                const float g = gu[b * 2 * I + i];
                act[b * I + i] = g / (1.0f + expf(-g)) * gu[b * 2 * I + I + i];
            }
        linear(&L->down, act, B, proj);
        for (int64_t i = 0; i < B * E; i++) x[i] += proj[i];
    }
    for (int64_t b = 0; b < B; b++) rms_norm(x + b * E, m->final_norm, E, m->eps, out + b * E);
done:
    free(h);
    free(qkv);
    free(att);
    free(proj);
    free(gu);
    free(act);
    return rc;
}
