/* AMX tile operations for wq_gemm.c's `avx512_amx` path: Intel's intrinsics in the build for CPUs with
 * AMX-TILE and AMX-INT8 (-mamx-tile -mamx-int8), or, with -DHX_AMX_EMULATE, the same operations in plain
 * C, as Intel's Software Developer's Manual defines them (tile configuration loaded and stored, TILELOADD, TILESTORED,
 * TILEZERO, TDPBSSD, TDPBSUD), on per-thread emulated tiles. The emulation exists so the AMX kernel's
 * layouts and loops are tested on every machine (tests/model/test_quant.py); it checks each operation's
 * shapes against the configuration, as the hardware would fault on, and aborts when one is wrong.
 *
 * Tiles hold up to 16 rows of up to 64 bytes. For C (int32) += A (int8, M x 4K bytes) . B (int8, K rows of
 * 4N bytes): C[m][n] += sum over k < K, i < 4 of A[m][4k + i] * B[k][4n + i], exactly, in int32; TDPBSSD
 * takes both A and B signed, TDPBSUD A signed and B unsigned. */
#ifndef HELEXA_AMX_H
#define HELEXA_AMX_H
#include <stdint.h>
#include <string.h>

/* The 64-byte tile configuration (palette 1). */
typedef struct {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t colsb[16]; /* bytes per row of tile i (8 tiles; the rest reserved, zero) */
    uint8_t rows[16];   /* rows of tile i */
} hx_tile_config;

#ifndef HX_AMX_EMULATE
#include <immintrin.h>
#define HX_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define HX_TILE_SAVE(cfg) _tile_storeconfig(cfg)
#define HX_TILE_RELEASE() _tile_release()
#define HX_TILE_ZERO(t) _tile_zero(t)
#define HX_TILE_LOAD(t, base, stride) _tile_loadd(t, base, stride)
#define HX_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define HX_TILE_DPBSSD(c, a, b) _tile_dpbssd(c, a, b)
#define HX_TILE_DPBSUD(c, a, b) _tile_dpbsud(c, a, b)
#else
#include <stdio.h>
#include <stdlib.h>

static _Thread_local hx_tile_config hx_emu_cfg;
static _Thread_local int hx_emu_configured;
static _Thread_local uint8_t hx_emu_tile[8][16][64];

static void hx_emu_fail(const char *what) {
    fprintf(stderr, "helexa AMX emulation: %s\n", what);
    abort();
}

static void hx_emu_check(int t) {
    if (!hx_emu_configured) hx_emu_fail("tile used before a configuration was loaded");
    if (t < 0 || t > 7 || hx_emu_cfg.rows[t] == 0 || hx_emu_cfg.colsb[t] == 0) hx_emu_fail("tile not configured");
}

static inline void hx_emu_config(const void *p) {
    memcpy(&hx_emu_cfg, p, sizeof hx_emu_cfg);
    if (hx_emu_cfg.palette != 1 || hx_emu_cfg.start_row != 0) hx_emu_fail("palette must be 1, start_row 0");
    for (int t = 0; t < 16; t++) {
        const int unused = t >= 8;
        if (hx_emu_cfg.rows[t] > 16 || hx_emu_cfg.colsb[t] > 64 || hx_emu_cfg.colsb[t] % 4 ||
            (unused && (hx_emu_cfg.rows[t] || hx_emu_cfg.colsb[t])) ||
            (!hx_emu_cfg.rows[t] != !hx_emu_cfg.colsb[t]))
            hx_emu_fail("a tile's rows or bytes per row are out of range");
    }
    memset(hx_emu_tile, 0, sizeof hx_emu_tile);
    hx_emu_configured = 1;
}

static inline void hx_emu_release(void) { hx_emu_configured = 0; }

/* the configuration loaded now, or 64 zero bytes when none is (TILESTORECFG) */
static inline void hx_emu_save(void *p) {
    if (hx_emu_configured) memcpy(p, &hx_emu_cfg, sizeof hx_emu_cfg);
    else memset(p, 0, sizeof hx_emu_cfg);
}

static inline void hx_emu_zero(int t) {
    hx_emu_check(t);
    memset(hx_emu_tile[t], 0, sizeof hx_emu_tile[t]);
}

/* rows[t] rows of colsb[t] bytes from base, `stride` bytes apart; the rest of the tile zeroed */
static inline void hx_emu_load(int t, const void *base, int64_t stride) {
    hx_emu_check(t);
    memset(hx_emu_tile[t], 0, sizeof hx_emu_tile[t]);
    for (int r = 0; r < hx_emu_cfg.rows[t]; r++)
        memcpy(hx_emu_tile[t][r], (const uint8_t *)base + r * stride, hx_emu_cfg.colsb[t]);
}

static inline void hx_emu_store(int t, void *base, int64_t stride) {
    hx_emu_check(t);
    for (int r = 0; r < hx_emu_cfg.rows[t]; r++)
        memcpy((uint8_t *)base + r * stride, hx_emu_tile[t][r], hx_emu_cfg.colsb[t]);
}

static int64_t hx_emu_products = 0; /* tile products run, for tests (helexa_amx_emulated_products) */

static inline void hx_emu_dp(int c, int a, int b, int b_signed) {
#pragma omp atomic
    hx_emu_products++;
    hx_emu_check(c);
    hx_emu_check(a);
    hx_emu_check(b);
    if (hx_emu_cfg.colsb[a] / 4 != hx_emu_cfg.rows[b] || hx_emu_cfg.rows[c] != hx_emu_cfg.rows[a] ||
        hx_emu_cfg.colsb[c] != hx_emu_cfg.colsb[b])
        hx_emu_fail("tile shapes do not compose (A colsb/4 == B rows, C rows == A rows, C colsb == B colsb)");
    for (int m = 0; m < hx_emu_cfg.rows[c]; m++)
        for (int n = 0; n < hx_emu_cfg.colsb[c] / 4; n++) {
            int32_t acc;
            memcpy(&acc, &hx_emu_tile[c][m][4 * n], sizeof acc);
            for (int k = 0; k < hx_emu_cfg.rows[b]; k++)
                for (int i = 0; i < 4; i++) {
                    const int32_t av = (int8_t)hx_emu_tile[a][m][4 * k + i];
                    const uint8_t raw = hx_emu_tile[b][k][4 * n + i];
                    acc += av * (b_signed ? (int32_t)(int8_t)raw : (int32_t)raw);
                }
            memcpy(&hx_emu_tile[c][m][4 * n], &acc, sizeof acc);
        }
}

#define HX_TILE_CONFIG(cfg) hx_emu_config(cfg)
#define HX_TILE_SAVE(cfg) hx_emu_save(cfg)
#define HX_TILE_RELEASE() hx_emu_release()
#define HX_TILE_ZERO(t) hx_emu_zero(t)
#define HX_TILE_LOAD(t, base, stride) hx_emu_load(t, base, stride)
#define HX_TILE_STORE(t, base, stride) hx_emu_store(t, base, stride)
#define HX_TILE_DPBSSD(c, a, b) hx_emu_dp(c, a, b, 1)
#define HX_TILE_DPBSUD(c, a, b) hx_emu_dp(c, a, b, 0)
#endif

#endif
