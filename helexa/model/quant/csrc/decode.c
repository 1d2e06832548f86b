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
 * past a sequence's length are never read. A slot of -1 writes nothing. D must be a multiple of 8.
 * Threads: OpenMP (the runtime torch has loaded) over the projections' column tiles and over the
 * (sequence, head) pairs of attention.
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

/* out (D,) = softmax(q . K * scale) V over the first n positions of one sequence's blocks, KV head kvh.
 * `scores` holds n floats. */
static void attend(const float *q, const hx_layer *L, const int32_t *table, int64_t n, int64_t bs, int64_t kvh,
                   int64_t d, float scale, float *scores, float *out) {
    const float *kc = L->k_cache + kvh * L->head_stride, *vc = L->v_cache + kvh * L->head_stride;
    float mx = -INFINITY;
    for (int64_t j0 = 0; j0 < n; j0 += bs) {
        const int64_t rows = n - j0 < bs ? n - j0 : bs;
        const float *kb = kc + (int64_t)table[j0 / bs] * L->block_stride;
        for (int64_t r = 0; r < rows; r++) {
            const float *k = kb + r * L->row_stride;
            __m256 acc = _mm256_setzero_ps();
            for (int64_t i = 0; i < d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(q + i), _mm256_loadu_ps(k + i), acc);
            const float s = hsum(acc) * scale;
            scores[j0 + r] = s;
            mx = s > mx ? s : mx;
        }
    }
    float sum = 0.0f;
    for (int64_t j = 0; j < n; j++) {
        scores[j] = expf(scores[j] - mx);
        sum += scores[j];
    }
    __m256 acc[64]; /* D <= 512 */
    for (int64_t i = 0; i < d / 8; i++) acc[i] = _mm256_setzero_ps();
    for (int64_t j0 = 0; j0 < n; j0 += bs) {
        const int64_t rows = n - j0 < bs ? n - j0 : bs;
        const float *vb = vc + (int64_t)table[j0 / bs] * L->block_stride;
        for (int64_t r = 0; r < rows; r++) {
            const float *v = vb + r * L->row_stride;
            const __m256 p = _mm256_set1_ps(scores[j0 + r]);
            for (int64_t i = 0; i < d / 8; i++) acc[i] = _mm256_fmadd_ps(p, _mm256_loadu_ps(v + 8 * i), acc[i]);
        }
    }
    const __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (int64_t i = 0; i < d / 8; i++) _mm256_storeu_ps(out + 8 * i, _mm256_mul_ps(acc[i], inv));
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
 * block_tables (B, table_stride) int32. */
void helexa_paged_decode(const float *q, float *k_cache, float *v_cache, int64_t block_stride, int64_t row_stride,
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
    const int64_t group = H / KVH;
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t t = 0; t < B * H; t++) {
        const int64_t b = t / H, h = t % H, n = seq_lens[b];
        float *scores = scratch((size_t)(n > 0 ? n : 1));
        attend(q + t * D, &L, block_tables + b * table_stride, n, block_size, h / group, D, scale, scores, out + t * D);
        free(scores);
    }
}

/* One decode step: x (B, E) holds the new tokens' embeddings on entry; out (B, E) receives the
 * final-normed hidden states. cos, ssin (B, D): RoPE of each token's position (sin with its first
 * half negated); slots (B,) int64; block_tables (B, table_stride) int32; seq_lens (B,) int32
 * (including the new token). Returns 0, or -1 when scratch memory could not be allocated. */
int helexa_decode_step(const hx_model *m, int64_t B, float *x, const float *cos, const float *ssin,
                       const int64_t *slots, const int32_t *block_tables, int64_t table_stride,
                       const int32_t *seq_lens, float *out) {
    const int64_t E = m->hidden, H = m->heads, KVH = m->kv_heads, D = m->head_dim, I = m->intermediate;
    const int64_t QS = H * D, KS = KVH * D, QKV = QS + 2 * KS, BS = m->block_size, group = H / KVH;
    const float scale = 1.0f / sqrtf((float)D);
    int64_t max_len = 1;
    for (int64_t b = 0; b < B; b++) max_len = seq_lens[b] > max_len ? seq_lens[b] : max_len;
    float *h = scratch((size_t)(B * E)), *qkv = scratch((size_t)(B * QKV)), *att = scratch((size_t)(B * QS));
    float *proj = scratch((size_t)(B * E)), *gu = scratch((size_t)(B * 2 * I)), *act = scratch((size_t)(B * I));
    float *scores = scratch((size_t)(B * H * max_len));
    int rc = 0;
    if (!h || !qkv || !att || !proj || !gu || !act || !scores) {
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
#pragma omp parallel for schedule(dynamic, 1)
        for (int64_t t = 0; t < B * H; t++) {
            const int64_t b = t / H, hd = t % H;
            attend(qkv + b * QKV + hd * D, L, block_tables + b * table_stride, seq_lens[b], BS, hd / group, D, scale,
                   scores + t * max_len, att + t * D);
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
    free(scores);
    return rc;
}
