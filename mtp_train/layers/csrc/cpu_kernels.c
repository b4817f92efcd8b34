/* Native CPU kernels for decode and verify steps (fp32, AVX2 + FMA), called through ctypes.
 *
 * mtp_gemv_f32 — few-row matrix products y = x W^T (+ b).
 *
 * x: (M, K) with row stride xs; W: (N, K) contiguous (nn.Linear's weight); b: (N,) or NULL;
 * y: (M, N) with row stride ys. With M small (a decode step has 1 row, a verify step k + 1) the
 * product is bound by reading W, so the kernel streams W once, a few rows at a time, and keeps every row of
 * x in L1: each W row is loaded from memory once and used for all M rows of x. Rows of W are split
 * over OpenMP threads (the runtime torch itself uses, so both share one thread pool).
 *
 * Blocks of 4 W rows times up to 2 (AVX2) or 4 (AVX-512) x rows, W prefetched ahead (GEMV_CHUNK below).
 *
 * mtp_gemv_f32_avx512 — the same product with 16-wide AVX-512 registers. Compiled with per-function target
 * attributes, so the library still loads on an AVX2-only machine; it returns -1 without touching y where the CPU
 * (or the OS) does not offer AVX-512F/VL/DQ (mtp_cpu_avx512 says which), and the caller picks it only where
 * mtp_cpu_avx512 returned 1.
 *
 * mtp_gemv_bf16w, mtp_gemv_bf16w_avx512 — the same product over a bfloat16 W (float32 x, b, y and sums): half
 * the bytes streamed, for weights that may be rounded (a draft head's). mtp_gemv_i8w, mtp_gemv_i8w_avx512 — over
 * int8 rows with a float32 scale each: a quarter of the bytes.
 *
 * mtp_rmsnorm_f32 — RMSNorm of few rows, y = w * x / sqrt(mean(x^2) + eps), one pass to sum the
 * squares and one to scale: on a 576-wide row this is ~1 us where torch's composite takes ~70 us.
 *
 * mtp_soft_ce_f32 — training's fused soft cross-entropy over a (C, V) logits chunk: per row, the CE, the
 * target's argmax and its rank among the head's logits, and the gradient written over the head's logits.
 * mtp_soft_ce_f32_avx512 is the same on 16-wide registers (it streams the chunk, as the gemv streams weights), with
 * the same -1 answer where the CPU cannot run it.
 */
#include <immintrin.h>
#include <limits.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* Below this much work (positions attended x Hq x D) a paged attention call stays on one thread. */
#define PAGED_ATTENTION_PARALLEL_WORK 65536L

static inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* One output: dot(w[0:K], x[0:K]) with four independent accumulators (hides FMA latency). */
static inline float dot1(const float *restrict w, const float *restrict x, int K) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    int k = 0;
    for (; k + 32 <= K; k += 32) {
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
    }
    for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + k), _mm256_loadu_ps(x + k), a0);
    float s = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
    for (; k < K; k++) s += w[k] * x[k];
    return s;
}

/* ---- the few-row product's body, one per instruction set and weight type (GEMV_CHUNK below) ------------------
 * A thread's chunk of W is walked GEMV_ROWS rows at a time; each block of rows is multiplied by up to MMAX rows of
 * x at once (then by the next MMAX rows, while the block is still in L1), one register of sums per (W row, x row).
 * Every x chunk is loaded once for the block's GEMV_ROWS W rows and every W chunk once for the MMAX x rows, so the
 * loads per FMA fall as rows are added, and the block prefetches the W bytes GEMV_PREFETCH ahead of its reads: W
 * is read as one stream, and a stream the hardware prefetcher alone follows kept the memory bus idle part of the
 * time. Measured on a 2-core Intel Xeon (AVX-512) over 30 SmolLM2 layers of float32 weights, in a bare loop of
 * calls: 1 / 2 / 3 / 4 rows at 30.7 / 29.3 / 27.8 / 27.3 GB/s, where one W row at a time with pairs of x rows and
 * no prefetch ran at 26.4 / 22.0 / 19.5 / 17.1 (and a blocked body without the prefetch at 28.0 / 25.0 / 22.2 /
 * 22.3); `bench.cpu_kernels --baseline-source` times it against another build.
 *
 * Summation order: one LANES-wide partial sum per output, its horizontal sum, then the K % LANES tail in scalar
 * order. */
#define GEMV_ROWS 4
#define GEMV_PREFETCH 16384  /* bytes ahead of the block's reads (1 KiB to 32 KiB timed) */

/* GEMV_CHUNK(NAME, ATTR, WT, VEC, LANES, MMAX, ZERO, LOADX, LOADW, FMA, REDUCE, TOF32) defines NAME, a
   gemv_chunk_fn over a W of element type WT (float, or bfloat16 bits as uint16_t) on VEC registers of LANES
   floats: ZERO() a zero register, LOADX(p) LANES floats of x, LOADW(p) LANES weights widened to float, FMA(a, b, c)
   a * b + c, REDUCE(v) the sum of v's lanes, TOF32(w) one weight as a float. NAME##_block computes an RB x MB block
   of outputs (RB W rows from w, MB x rows from x); its callers pass both as constants, so the compiler keeps each
   shape's sums in registers. */
#define GEMV_CHUNK(NAME, ATTR, WT, VEC, LANES, MMAX, ZERO, LOADX, LOADW, FMA, REDUCE, TOF32)                   \
ATTR static inline __attribute__((always_inline)) void NAME##_block(                                           \
        const WT *restrict w, int K, const float *restrict x, long xs, int RB, int MB, float *y, long ys,       \
        int prefetch) {                                                                                        \
    VEC a[GEMV_ROWS][MMAX];                                                                                    \
    for (int r = 0; r < RB; r++) for (int m = 0; m < MB; m++) a[r][m] = ZERO();                                \
    int k = 0;                                                                                                 \
    for (; k + LANES <= K; k += LANES) {                                                                       \
        VEC xv[MMAX];                                                                                          \
        for (int m = 0; m < MB; m++) xv[m] = LOADX(x + m * xs + k);                                            \
        for (int r = 0; r < RB; r++) {                                                                         \
            const WT *wr = w + (size_t)r * K + k;                                                              \
            if (prefetch) _mm_prefetch((const char *)wr + GEMV_PREFETCH, _MM_HINT_T0);                         \
            VEC wv = LOADW(wr);                                                                                \
            for (int m = 0; m < MB; m++) a[r][m] = FMA(wv, xv[m], a[r][m]);                                    \
        }                                                                                                      \
    }                                                                                                          \
    for (int r = 0; r < RB; r++)                                                                               \
        for (int m = 0; m < MB; m++) {                                                                         \
            float s = REDUCE(a[r][m]);                                                                         \
            for (int kk = k; kk < K; kk++) s += TOF32(w[(size_t)r * K + kk]) * x[m * xs + kk];                 \
            y[m * ys + r] = s;                                                                                 \
        }                                                                                                      \
}                                                                                                              \
                                                                                                               \
/* An RB x mb block, mb (1..MMAX) given at run time: one constant shape per case. */                            \
ATTR static inline __attribute__((always_inline)) void NAME##_rows(                                            \
        const WT *w, int K, const float *x, long xs, int RB, int mb, float *y, long ys, int prefetch) {        \
    if (mb == 1) NAME##_block(w, K, x, xs, RB, 1, y, ys, prefetch);                                            \
    else if (mb == 2) NAME##_block(w, K, x, xs, RB, 2, y, ys, prefetch);                                       \
    else if (mb == 3) NAME##_block(w, K, x, xs, RB, 3 < MMAX ? 3 : MMAX, y, ys, prefetch);                     \
    else NAME##_block(w, K, x, xs, RB, MMAX, y, ys, prefetch);                                                 \
}                                                                                                              \
                                                                                                               \
ATTR static void NAME(const float *x, long xs, const void *wv, const float *b, float *y, long ys, int M, int K, \
                      int n0, int n1) {                                                                        \
    const WT *w = wv;                                                                                          \
    for (int n = n0; n < n1; n += GEMV_ROWS) {                                                                 \
        const WT *wn = w + (size_t)n * K;                                                                      \
        int rb = n1 - n < GEMV_ROWS ? n1 - n : GEMV_ROWS;                                                      \
        for (int m0 = 0; m0 < M; m0 += MMAX) {                                                                 \
            int mb = M - m0 < MMAX ? M - m0 : MMAX, pf = m0 == 0;  /* later x rows find the block in L1 */     \
            if (rb == GEMV_ROWS) NAME##_rows(wn, K, x + m0 * xs, xs, GEMV_ROWS, mb, y + m0 * ys + n, ys, pf);  \
            else for (int r = 0; r < rb; r++)                                                                  \
                NAME##_rows(wn + (size_t)r * K, K, x + m0 * xs, xs, 1, mb, y + m0 * ys + n + r, ys, pf);       \
        }                                                                                                      \
        if (b) for (int m = 0; m < M; m++) for (int r = 0; r < rb; r++) y[m * ys + n + r] += b[n + r];         \
    }                                                                                                          \
}

/* Rows n0 .. n1 - 1 of W (and of the bias) into columns n0 .. n1 - 1 of y: one thread's chunk. */
typedef void (*gemv_chunk_fn)(const float *x, long xs, const void *w, const float *b, float *y, long ys,
                              int M, int K, int n0, int n1);

/* The thread split shared by both instruction sets (the OpenMP region holds no ISA-specific code). */
static int gemv_split(const float *x, long xs, const void *w, const float *b, float *y, long ys,
                      int M, int N, int K, int num_threads, gemv_chunk_fn chunk_fn) {
    /* Rows per thread chunk, whole blocks of GEMV_ROWS: big enough that a chunk's W (>= 32 KiB in bf16, 64 KiB
       in fp32) amortises the scheduling. */
    int chunk = ((16384 + K - 1) / K + GEMV_ROWS - 1) / GEMV_ROWS * GEMV_ROWS;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && (long)N * K >= 65536)
    for (int n0 = 0; n0 < N; n0 += chunk)
        chunk_fn(x, xs, w, b, y, ys, M, K, n0, n0 + chunk < N ? n0 + chunk : N);
    return 0;
}

#define F32_LOAD8(p) _mm256_loadu_ps(p)
#define F32_ID(v) (v)
GEMV_CHUNK(chunk_avx2, , float, __m256, 8, 2, _mm256_setzero_ps, F32_LOAD8, F32_LOAD8, _mm256_fmadd_ps, hsum,
           F32_ID)

int mtp_gemv_f32(const float *x, long xs, const float *w, const float *b, float *y, long ys,
                 int M, int N, int K, int num_threads) {
    return gemv_split(x, xs, w, b, y, ys, M, N, K, num_threads, chunk_avx2);
}

/* ---- AVX-512 (F, VL, DQ): built into the same library, run only where mtp_cpu_avx512() is 1 ---------------- */
#define AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))

/* 1 when this CPU and OS run AVX-512F/VL/DQ code (libgcc / compiler-rt check the OS's ZMM state too), else 0. */
int mtp_cpu_avx512(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl")
           && __builtin_cpu_supports("avx512dq");
}

#define F32_LOAD16(p) _mm512_loadu_ps(p)
GEMV_CHUNK(chunk_avx512, AVX512, float, __m512, 16, 4, _mm512_setzero_ps, F32_LOAD16, F32_LOAD16, _mm512_fmadd_ps,
           _mm512_reduce_add_ps, F32_ID)

/* mtp_gemv_f32 on AVX-512; -1 (y untouched) where this CPU cannot run it. */
int mtp_gemv_f32_avx512(const float *x, long xs, const float *w, const float *b, float *y, long ys,
                        int M, int N, int K, int num_threads) {
    if (!mtp_cpu_avx512()) return -1;
    return gemv_split(x, xs, w, b, y, ys, M, N, K, num_threads, chunk_avx512);
}

/* ---- bf16 weights (mtp_gemv_bf16w, mtp_gemv_bf16w_avx512) ------------------------------------------------------
 * The same few-row product with W stored as bfloat16 and x, b, y float32, accumulated in float32. A bfloat16 is
 * the upper half of a float32, so each weight widens exactly by a 16-bit shift: the product is the float32 one
 * over the rounded weights, and each product streams half the bytes. For weights whose rounding is harmless (a
 * draft head's: the target verifies every drafted token). Same loop shapes as the float32 bodies above. */

static inline float bf16_to_f32(uint16_t v) {
    union { uint32_t u; float f; } c = { (uint32_t)v << 16 };
    return c.f;
}

/* 8 bfloat16 weights → 8 float32 lanes. */
static inline __m256 bf16x8(const uint16_t *p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
}

GEMV_CHUNK(chunk_bf16_avx2, , uint16_t, __m256, 8, 2, _mm256_setzero_ps, F32_LOAD8, bf16x8, _mm256_fmadd_ps, hsum,
           bf16_to_f32)

/* x: (M, K) float32, row stride xs; w: (N, K) bfloat16 bits, contiguous; b: (N,) float32 or NULL; y as gemv_f32. */
int mtp_gemv_bf16w(const float *x, long xs, const uint16_t *w, const float *b, float *y, long ys,
                   int M, int N, int K, int num_threads) {
    return gemv_split(x, xs, w, b, y, ys, M, N, K, num_threads, chunk_bf16_avx2);
}

/* 16 bfloat16 weights → 16 float32 lanes. */
AVX512 static inline __m512 bf16x16(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)),
                                                 16));
}

GEMV_CHUNK(chunk_bf16_avx512, AVX512, uint16_t, __m512, 16, 4, _mm512_setzero_ps, F32_LOAD16, bf16x16,
           _mm512_fmadd_ps, _mm512_reduce_add_ps, bf16_to_f32)

/* mtp_gemv_bf16w on AVX-512; -1 (y untouched) where this CPU cannot run it. */
int mtp_gemv_bf16w_avx512(const float *x, long xs, const uint16_t *w, const float *b, float *y, long ys,
                          int M, int N, int K, int num_threads) {
    if (!mtp_cpu_avx512()) return -1;
    return gemv_split(x, xs, w, b, y, ys, M, N, K, num_threads, chunk_bf16_avx512);
}

/* ---- int8 weights (mtp_gemv_i8w, mtp_gemv_i8w_avx512) -----------------------------------------------------------
 * W as int8 rows with a float32 scale each (W[n][k] = scale[n] q[n][k], |q| <= 127), packed in one buffer: the N x K
 * int8 rows, then (from the next multiple of 4 bytes) the N scales. x, b, y and the sums stay float32; each finished
 * sum is scaled by its row's scale. A quarter of float32's bytes and half of bfloat16's, for a draft head's
 * weights (`linear.int8_copy`); same loop shapes as the float32 bodies above. */

static inline float i8_to_f32(int8_t v) { return (float)v; }

/* 8 int8 weights → 8 float32 lanes. */
static inline __m256 i8x8(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

GEMV_CHUNK(chunk_i8_avx2, , int8_t, __m256, 8, 2, _mm256_setzero_ps, F32_LOAD8, i8x8, _mm256_fmadd_ps, hsum,
           i8_to_f32)

/* 16 int8 weights → 16 float32 lanes. */
AVX512 static inline __m512 i8x16(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}

GEMV_CHUNK(chunk_i8_avx512, AVX512, int8_t, __m512, 16, 4, _mm512_setzero_ps, F32_LOAD16, i8x16, _mm512_fmadd_ps,
           _mm512_reduce_add_ps, i8_to_f32)

/* The integer rows' products over the packed buffer w, then y = sum * scale (+ b), column by column. */
static int gemv_i8(const float *x, long xs, const int8_t *w, const float *b, float *y, long ys, int M, int N,
                   int K, int num_threads, gemv_chunk_fn chunk_fn) {
    gemv_split(x, xs, w, NULL, y, ys, M, N, K, num_threads, chunk_fn);
    const int8_t *scales = w + ((size_t)N * K + 3) / 4 * 4;  /* the rows, rounded up to 4 bytes */
    for (int n = 0; n < N; n++) {
        float sc, bn = b ? b[n] : 0.f;
        memcpy(&sc, scales + 4 * (size_t)n, sizeof sc);
        for (int m = 0; m < M; m++) y[m * ys + n] = y[m * ys + n] * sc + bn;
    }
    return 0;
}

/* x: (M, K) float32, row stride xs; w: the packed int8 rows and scales of an (N, K) weight; b, y as gemv_f32. */
int mtp_gemv_i8w(const float *x, long xs, const int8_t *w, const float *b, float *y, long ys,
                 int M, int N, int K, int num_threads) {
    return gemv_i8(x, xs, w, b, y, ys, M, N, K, num_threads, chunk_i8_avx2);
}

/* mtp_gemv_i8w on AVX-512; -1 (y untouched) where this CPU cannot run it. */
int mtp_gemv_i8w_avx512(const float *x, long xs, const int8_t *w, const float *b, float *y, long ys,
                        int M, int N, int K, int num_threads) {
    if (!mtp_cpu_avx512()) return -1;
    return gemv_i8(x, xs, w, b, y, ys, M, N, K, num_threads, chunk_i8_avx512);
}

/* x: (M, K) row stride xs; w: (K,); y: (M, K) contiguous. */
void mtp_rmsnorm_f32(const float *x, long xs, const float *w, float *y, int M, int K, float eps) {
    for (int m = 0; m < M; m++) {
        const float *xr = x + (size_t)m * xs;
        float *yr = y + (size_t)m * K;
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        int k = 0;
        for (; k + 16 <= K; k += 16) {
            __m256 v0 = _mm256_loadu_ps(xr + k), v1 = _mm256_loadu_ps(xr + k + 8);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
            a1 = _mm256_fmadd_ps(v1, v1, a1);
        }
        for (; k + 8 <= K; k += 8) {
            __m256 v0 = _mm256_loadu_ps(xr + k);
            a0 = _mm256_fmadd_ps(v0, v0, a0);
        }
        float ss = hsum(_mm256_add_ps(a0, a1));
        for (; k < K; k++) ss += xr[k] * xr[k];
        float r = 1.0f / sqrtf(ss / (float)K + eps);
        __m256 rv = _mm256_set1_ps(r);
        k = 0;
        for (; k + 8 <= K; k += 8)
            _mm256_storeu_ps(yr + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xr + k), rv)));
        for (; k < K; k++) yr[k] = w[k] * (xr[k] * r);
    }
}

/* e^x for 8 floats (x <= 0 here: scores minus their max): 2^n * p(r), x = n ln2 + r, |r| <= ln2 / 2,
 * p a degree-6 Taylor polynomial (relative error < 2e-7 on that interval, like expf's). */
static inline __m256 exp8(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  /* below: e^x underflows to 0 in fp32 anyway */
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  /* ln2 split in two for accuracy */
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* The 8 horizontal sums of a0..a7, in order, as one register (three rounds of pairwise adds: one hsum's
 * shuffles serve eight dot products). */
static inline __m256 hsum8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));  /* a0..a3: low | high halves */
    __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}

/* s[i] = scale * dot(q[0:D], k_i[0:D]) for the 8 keys k_i = k + i * ks: eight accumulators fed by one load of q
 * per 8 dimensions, summed together at the end (hsum8). */
static inline void scores8(const float *restrict q, const float *restrict k, long ks, int D, float scale,
                           float *restrict s) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    int d = 0;
    for (; d + 8 <= D; d += 8) {
        __m256 qv = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(_mm256_loadu_ps(k + d), qv, a0);
        a1 = _mm256_fmadd_ps(_mm256_loadu_ps(k + ks + d), qv, a1);
        a2 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 2 * ks + d), qv, a2);
        a3 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 3 * ks + d), qv, a3);
        a4 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 4 * ks + d), qv, a4);
        a5 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 5 * ks + d), qv, a5);
        a6 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 6 * ks + d), qv, a6);
        a7 = _mm256_fmadd_ps(_mm256_loadu_ps(k + 7 * ks + d), qv, a7);
    }
    __m256 r = _mm256_mul_ps(hsum8(a0, a1, a2, a3, a4, a5, a6, a7), _mm256_set1_ps(scale));
    if (d < D) {  /* D % 8 dimensions left: in scalar order, after the vector sums */
        float t[8];
        _mm256_storeu_ps(t, hsum8(a0, a1, a2, a3, a4, a5, a6, a7));
        for (int i = 0; i < 8; i++) {
            for (int dd = d; dd < D; dd++) t[i] += k[i * ks + dd] * q[dd];
            t[i] *= scale;
        }
        r = _mm256_loadu_ps(t);
    }
    _mm256_storeu_ps(s, r);
}

/* o[0:64] += sum_j w[j] * v_j[0:64] over the n rows v_j = v + j * vs: the 64 sums stay in eight registers. */
static inline void weighted64(const float *restrict w, const float *restrict v, long vs, long n, float *restrict o) {
    __m256 a0 = _mm256_loadu_ps(o), a1 = _mm256_loadu_ps(o + 8), a2 = _mm256_loadu_ps(o + 16),
           a3 = _mm256_loadu_ps(o + 24), a4 = _mm256_loadu_ps(o + 32), a5 = _mm256_loadu_ps(o + 40),
           a6 = _mm256_loadu_ps(o + 48), a7 = _mm256_loadu_ps(o + 56);
    for (long j = 0; j < n; j++, v += vs) {
        __m256 pw = _mm256_broadcast_ss(w + j);
        a0 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v), a0);
        a1 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 8), a1);
        a2 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 16), a2);
        a3 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 24), a3);
        a4 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 32), a4);
        a5 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 40), a5);
        a6 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 48), a6);
        a7 = _mm256_fmadd_ps(pw, _mm256_loadu_ps(v + 56), a7);
    }
    _mm256_storeu_ps(o, a0);
    _mm256_storeu_ps(o + 8, a1);
    _mm256_storeu_ps(o + 16, a2);
    _mm256_storeu_ps(o + 24, a3);
    _mm256_storeu_ps(o + 32, a4);
    _mm256_storeu_ps(o + 40, a5);
    _mm256_storeu_ps(o + 48, a6);
    _mm256_storeu_ps(o + 56, a7);
}

/* weighted64 over the dn (< 64) columns of a head's last block: eight at a time, then one by one. */
static inline void weighted_rest(const float *restrict w, const float *restrict v, long vs, long n, int dn,
                                 float *restrict o) {
    int d = 0;
    for (; d + 8 <= dn; d += 8) {
        __m256 a = _mm256_loadu_ps(o + d);
        for (long j = 0; j < n; j++) a = _mm256_fmadd_ps(_mm256_broadcast_ss(w + j), _mm256_loadu_ps(v + j * vs + d), a);
        _mm256_storeu_ps(o + d, a);
    }
    for (; d < dn; d++) {
        float a = o[d];
        for (long j = 0; j < n; j++) a += w[j] * v[j * vs + d];
        o[d] = a;
    }
}

/* ---- paged attention's blocks ------------------------------------------------------------------------------------
 * Every query vector that reads one K/V head (the query heads sharing it, for every row a sequence has in the step)
 * is attended in blocks of up to QB vectors, and each key and value row is loaded once per block: one query at a
 * time loaded it once per query, 9 loads per 8 multiply-adds, where a block of 3 makes it 7 per 12.
 *
 * ATT_BLOCKS(SFX, ATTR, VEC, LANES, QB, ZERO, LOAD, STORE, FMA, SET1, FOLD8) defines, on VEC registers of LANES
 * floats and blocks of up to QB queries:
 * - qk4##SFX: ss[r][off + i] = scale * dot(qs[r][0:D], k_i[0:D]) for r < NQ and the 4 keys k_i = k + i * ks, each key
 *   loaded once per LANES dimensions for all NQ queries; a query's 4 sums folded to 8 lanes (FOLD8) and added by
 *   one shuffle tree; the D % LANES tail in scalar order, after the vector sums;
 * - pv##SFX: os[r][d0 : d0 + NC LANES] += sum_{j < n} ws[r][j] * v_j[d0 : d0 + NC LANES] (v_j = v + j * vs), each
 *   value row loaded once for all NQ weights;
 * - qk_run##SFX, pv_run##SFX: one block of nq (1..QB) queries over the keys j0 .. j1 of one page (krow: key j0's
 *   row, rows ks apart; scores into ss[r][j - c0]), and over the values of n keys weighted by ws[r][0:n] (into
 *   os[r][0:D], 4 registers of columns a time, then 1, then one column). Each shape a constant, in registers. */
/* pv##SFX over nq (1..6, at most QB) queries and NC registers of columns from d0: one constant shape per case. */
#define ATT_PV_CASES(SFX, QB, NC)                                                                                  \
    switch (nq) {                                                                                                  \
    case 6: pv##SFX(ws, 6 < QB ? 6 : QB, vrow, vs, n, NC, os, d0); break;                                          \
    case 5: pv##SFX(ws, 5 < QB ? 5 : QB, vrow, vs, n, NC, os, d0); break;                                          \
    case 4: pv##SFX(ws, 4 < QB ? 4 : QB, vrow, vs, n, NC, os, d0); break;                                          \
    case 3: pv##SFX(ws, 3 < QB ? 3 : QB, vrow, vs, n, NC, os, d0); break;                                          \
    case 2: pv##SFX(ws, 2, vrow, vs, n, NC, os, d0); break;                                                        \
    default: pv##SFX(ws, 1, vrow, vs, n, NC, os, d0);                                                              \
    }

#define ATT_BLOCKS(SFX, ATTR, VEC, LANES, QB, ZERO, LOAD, STORE, FMA, SET1, FOLD8)                                  \
ATTR static inline __attribute__((always_inline)) void qk4##SFX(const float *const *qs, int NQ,                    \
        const float *restrict k, long ks, int D, float scale, float *const *ss, long off) {                       \
    VEC a[QB][4];                                                                                                  \
    for (int r = 0; r < NQ; r++) for (int i = 0; i < 4; i++) a[r][i] = ZERO();                                     \
    int d = 0;                                                                                                     \
    for (; d + LANES <= D; d += LANES) {                                                                           \
        VEC qv[QB];                                                                                                \
        for (int r = 0; r < NQ; r++) qv[r] = LOAD(qs[r] + d);                                                      \
        for (int i = 0; i < 4; i++) {                                                                              \
            VEC kv = LOAD(k + i * ks + d);                                                                         \
            for (int r = 0; r < NQ; r++) a[r][i] = FMA(kv, qv[r], a[r][i]);                                        \
        }                                                                                                          \
    }                                                                                                              \
    for (int r = 0; r < NQ; r++) {                                                                                 \
        /* hadd(hadd(a0, a1), hadd(a2, a3)): each 128-bit half holds the 4 keys' sums of its half of the lanes */ \
        __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(FOLD8(a[r][0]), FOLD8(a[r][1])),                                 \
                                  _mm256_hadd_ps(FOLD8(a[r][2]), FOLD8(a[r][3])));                                 \
        __m128 s = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));                             \
        if (d < D) {                                                                                               \
            float u[4];                                                                                            \
            _mm_storeu_ps(u, s);                                                                                   \
            for (int i = 0; i < 4; i++) for (int dd = d; dd < D; dd++) u[i] += k[i * ks + dd] * qs[r][dd];        \
            s = _mm_loadu_ps(u);                                                                                   \
        }                                                                                                          \
        _mm_storeu_ps(ss[r] + off, _mm_mul_ps(s, _mm_set1_ps(scale)));                                             \
    }                                                                                                              \
}                                                                                                                  \
                                                                                                                   \
ATTR static inline __attribute__((always_inline)) void pv##SFX(const float *const *ws, int NQ,                     \
        const float *restrict v, long vs, long n, int NC, float *const *os, int d0) {                              \
    VEC a[QB][4];                                                                                                  \
    for (int r = 0; r < NQ; r++) for (int c = 0; c < NC; c++) a[r][c] = LOAD(os[r] + d0 + LANES * c);             \
    v += d0;                                                                                                       \
    for (long j = 0; j < n; j++, v += vs) {                                                                        \
        VEC w[QB];                                                                                                 \
        for (int r = 0; r < NQ; r++) w[r] = SET1(ws[r][j]);                                                        \
        for (int c = 0; c < NC; c++) {                                                                             \
            VEC vv = LOAD(v + LANES * c);                                                                          \
            for (int r = 0; r < NQ; r++) a[r][c] = FMA(w[r], vv, a[r][c]);                                         \
        }                                                                                                          \
    }                                                                                                              \
    for (int r = 0; r < NQ; r++) for (int c = 0; c < NC; c++) STORE(os[r] + d0 + LANES * c, a[r][c]);              \
}                                                                                                                  \
                                                                                                                   \
ATTR static void qk_run##SFX(const float *const *qs, int nq, const float *krow, long ks, long j0, long j1,         \
                             long c0, int D, float scale, float *const *ss) {                                      \
    long j = j0;                                                                                                   \
    for (; j + 4 <= j1 + 1; j += 4, krow += 4 * ks)                                                                \
        switch (nq) {                                                                                              \
        case 6: qk4##SFX(qs, 6 < QB ? 6 : QB, krow, ks, D, scale, ss, j - c0); break;                              \
        case 5: qk4##SFX(qs, 5 < QB ? 5 : QB, krow, ks, D, scale, ss, j - c0); break;                              \
        case 4: qk4##SFX(qs, 4 < QB ? 4 : QB, krow, ks, D, scale, ss, j - c0); break;                              \
        case 3: qk4##SFX(qs, 3 < QB ? 3 : QB, krow, ks, D, scale, ss, j - c0); break;                              \
        case 2: qk4##SFX(qs, 2, krow, ks, D, scale, ss, j - c0); break;                                            \
        default: qk4##SFX(qs, 1, krow, ks, D, scale, ss, j - c0);                                                  \
        }                                                                                                          \
    for (; j <= j1; j++, krow += ks)                                                                               \
        for (int r = 0; r < nq; r++) ss[r][j - c0] = dot1(krow, qs[r], D) * scale;                                 \
}                                                                                                                  \
                                                                                                                   \
ATTR static void pv_run##SFX(const float *const *ws, int nq, const float *vrow, long vs, long n, int D,            \
                             float *const *os) {                                                                   \
    int d0 = 0;                                                                                                    \
    for (; d0 + 4 * LANES <= D; d0 += 4 * LANES)                                                                   \
        ATT_PV_CASES(SFX, QB, 4)                                                                                   \
    for (; d0 + LANES <= D; d0 += LANES)                                                                           \
        ATT_PV_CASES(SFX, QB, 1)                                                                                   \
    for (; d0 < D; d0++)                                                                                           \
        for (int r = 0; r < nq; r++) {                                                                             \
            float acc = os[r][d0];                                                                                 \
            for (long j = 0; j < n; j++) acc += ws[r][j] * vrow[j * vs + d0];                                      \
            os[r][d0] = acc;                                                                                       \
        }                                                                                                          \
}

#define ATT_QB 3     /* AVX2: 3 queries x 4 keys of sums + 3 queries + a key, the 16 registers */
#define ATT_QB512 6  /* AVX-512: 6 x 4 sums + 6 queries + a key, 31 of the 32 */
#define F32_STORE8(p, v) _mm256_storeu_ps(p, v)
#define F32_SET8(x) _mm256_set1_ps(x)
#define F32_STORE16(p, v) _mm512_storeu_ps(p, v)
#define F32_SET16(x) _mm512_set1_ps(x)
#define FOLD512(v) /* 16 lanes → 8: the low half plus the high half */ \
    _mm256_add_ps(_mm512_castps512_ps256(v), _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)))

ATT_BLOCKS(, , __m256, 8, ATT_QB, _mm256_setzero_ps, F32_LOAD8, F32_STORE8, _mm256_fmadd_ps, F32_SET8, F32_ID)
ATT_BLOCKS(_512, AVX512, __m512, 16, ATT_QB512, _mm512_setzero_ps, F32_LOAD16, F32_STORE16, _mm512_fmadd_ps,
           F32_SET16, FOLD512)

/* Whether paged attention runs the AVX-512 blocks (mtp_set_attention_avx512, as the caller's instruction set says;
 * they are built with the gemv's per-function target and run only where mtp_cpu_avx512 is 1). */
static int att_avx512 = 0;

/* Paged attention on the AVX-512 blocks (on != 0, where this CPU runs them) or the AVX2 ones; returns the choice. */
int mtp_set_attention_avx512(int on) {
    att_avx512 = on && mtp_cpu_avx512();
    return att_avx512;
}

/* Where token t of a paged attention step attends (see mtp_paged_attention_f32): its sequence b, its position pos,
 * the step's first new slot s0 of that sequence, the window's lowest position wlo, and the tree positions a window
 * counts (NULL when none apply). Returns lo, the first position the token reads. */
static inline long token_span(int t, const int *qo_indptr, int B, const int64_t *positions, int window,
                              const int64_t *tree_bits, const int64_t *tree_pos, int *b_out, long *pos_out,
                              long *s0_out, long *wlo_out, const int64_t **new_pos_out) {
    int b = 0;
    while (b + 1 < B && qo_indptr[b + 1] <= t) b++;
    long pos = positions[t];
    long s0 = positions[qo_indptr[b]];  /* the step's first new slot of this sequence (tree steps) */
    /* the window counts positions: a slot in the cache, a tree position among a tree step's new tokens */
    long wpos = (tree_bits && tree_pos) ? tree_pos[t] : pos;
    long wlo = (window > 0 && wpos - window + 1 > 0) ? wpos - window + 1 : 0;
    const int64_t *new_pos = (tree_bits && tree_pos && window > 0) ? tree_pos + qo_indptr[b] : NULL;
    *b_out = b, *pos_out = pos, *s0_out = s0, *wlo_out = wlo, *new_pos_out = new_pos;
    /* a tree's new tokens sit in slots from s0 on whatever their positions: they are read from s0 at the latest */
    return new_pos && wlo > s0 ? s0 : wlo;
}

/* s[0:n] <- e^(s - m), m = the largest of s[0:n] and `floor` (-INFINITY, or a sink's logit, which joins the max);
 * returns their sum, m in *mx. Where m is -INFINITY (every score hidden: the chunk adds nothing) s is zeroed and the
 * sum is 0. */
static float exp_shifted(float *s, long n, float floor, float *mx) {
    __m256 m8 = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= n; j += 8) m8 = _mm256_max_ps(m8, _mm256_loadu_ps(s + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    float m = _mm_cvtss_f32(m4), sum = 0.f;
    for (; j < n; j++) if (s[j] > m) m = s[j];
    if (floor > m) m = floor;
    *mx = m;
    if (!(m > -INFINITY)) {
        memset(s, 0, sizeof(float) * (size_t)n);
        return 0.f;
    }
    m8 = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    for (j = 0; j + 8 <= n; j += 8) {
        __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), m8));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    sum = hsum(acc);
    for (; j < n; j++) { s[j] = expf(s[j] - m); sum += s[j]; }
    return sum;
}

/* The new tokens' K and V, (T, Hkv, D) each, into their slots of one layer's pool (page id * ps + offset). */
static void write_new_kv(float *cache, int ps, int Hkv, int D, int T, const float *k_new, const float *v_new,
                         const int64_t *slots) {
    long tok_stride = (long)Hkv * D, page_stride = 2L * ps * tok_stride;
    for (int t = 0; t < T; t++) {
        float *dst = cache + (size_t)(slots[t] / ps) * page_stride + (slots[t] % ps) * tok_stride;
        memcpy(dst, k_new + (size_t)t * tok_stride, tok_stride * sizeof(float));
        memcpy(dst + (long)ps * tok_stride, v_new + (size_t)t * tok_stride, tok_stride * sizeof(float));
    }
}

/* out[0:D] <- the merge of a split token's `used` chunk partials (pc, pstride apart: max, sum, D unnormalised sums
 * of values): sum_c e^(m_c - m) o_c / (sum_c e^(m_c - m) l_c [+ e^(sink - m)]), m the largest max (and sink). */
static void merge_partials(const float *pc, int used, long pstride, const float *sink, float *o, int D) {
    float m = sink ? *sink : -INFINITY;
    for (int cc = 0; cc < used; cc++) if (pc[cc * pstride] > m) m = pc[cc * pstride];
    memset(o, 0, (size_t)D * sizeof(float));
    float sum = sink ? expf(*sink - m) : 0.f;
    for (int cc = 0; cc < used; cc++) {
        const float *part = pc + cc * pstride;
        if (!(part[0] > -INFINITY)) continue;
        float f = expf(part[0] - m);
        sum += f * part[1];
        __m256 f8 = _mm256_set1_ps(f);
        int d = 0;
        for (; d + 8 <= D; d += 8)
            _mm256_storeu_ps(o + d, _mm256_fmadd_ps(f8, _mm256_loadu_ps(part + 2 + d), _mm256_loadu_ps(o + d)));
        for (; d < D; d++) o[d] += f * part[2 + d];
    }
    float inv = 1.f / sum;
    for (int d = 0; d < D; d++) o[d] *= inv;
}

/* mtp_paged_attention_f32's decode steps (one new token per sequence): one task per token (and K/V head, where the
 * tokens are fewer than the threads) and chunk, every query head of the token in it, so that the task reads each
 * page's rows of all the K/V heads, contiguous in memory, in one stream: such a step is bound by reading them, and a
 * task per K/V head reading a third of each page ran 0.84x as fast over 1024 cached tokens. Per query head three
 * passes over the chunk's keys, page by page: the scores, eight keys at a time (one load of the query per eight dot
 * products, one shuffle tree per eight sums); their max, exp and sum; the values' weighted sum, 64 columns at a time
 * in registers. Arguments as mtp_paged_attention_f32's (the new K/V written already). */
static void attention_by_token(const float *q, int T, int Hq, int Hkv, int D, float *cache, int ps,
                             const int *block_tables, int max_pages, const int *qo_indptr, int B,
                             const int64_t *positions, int window, float scale, float *scores, long max_kv,
                             float *out, int num_threads, const int64_t *tree_bits,
                             const float *sinks, const int64_t *tree_pos,
                             long chunk, float *partials) {
    int group = Hq / Hkv;
    long tok_stride = (long)Hkv * D;          /* between tokens of a page */
    long page_stride = 2L * ps * tok_stride;  /* between pages; V starts ps * tok_stride after K */
    if (chunk < 8) chunk = 8;
    int nch = (int)((max_kv + chunk - 1) / chunk);  /* chunks of the longest token's positions */
    if (!partials) nch = 1, chunk = max_kv > 8 ? max_kv : 8;
    long pstride = D + 2;  /* a chunk's partial: its max, its sum, then its D unnormalised sums of values */
    long work = 0;
    for (int t = 0; t < T; t++) work += positions[t] + 1;
    /* Fewer chunks than threads (a short decode step): each K/V head's query heads a task of their own as well */
    int par = num_threads > 1 && work * Hq * D >= PAGED_ATTENTION_PARALLEL_WORK;
    int gsplit = par && T * nch < num_threads ? Hkv : 1, gper = Hkv / gsplit;
    int tasks = T * nch * gsplit;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (par && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        int hlo = (task % gsplit) * gper * group, hhi = hlo + gper * group;  /* this task's query heads */
        int c = (task / gsplit) % nch, t = task / (gsplit * nch);
        int b;
        long pos, s0, wlo;
        const int64_t *new_pos;
        long lo = token_span(t, qo_indptr, B, positions, window, tree_bits, tree_pos, &b, &pos, &s0, &wlo, &new_pos);
        const int *bt = block_tables + (size_t)b * max_pages;
        int64_t bits = tree_bits ? tree_bits[t] : 0;
#define HIDDEN(j) (!(((uint64_t)bits >> ((j) - s0)) & 1u) || (new_pos && new_pos[(j) - s0] < wlo))  /* j >= s0, j - s0 <= 63 */
        long c0 = lo + c * chunk;  /* this task's positions: c0 .. c1 */
        if (c0 > pos) continue;
        long c1 = c0 + chunk - 1 < pos ? c0 + chunk - 1 : pos;
        int whole = pos - lo + 1 <= chunk;  /* one chunk holds all the token's positions: normalise here */
        long n = c1 - c0 + 1;
        long tj = s0 > c0 ? s0 : c0;  /* the first position HIDDEN may name */
/* head h's sums of values: its output row (normalised in place) or its chunk's partial (after the max and sum) */
#define HEAD_SUMS(h) (whole ? out + ((size_t)t * Hq + (h)) * D \
                      : partials + (((size_t)t * Hq + (h)) * nch + c) * pstride + 2)
        float *st = scores + (size_t)t * Hq * max_kv + (c0 - lo);  /* head h's score of position j: st[h * max_kv + j - c0] */
        /* pass 1: scores, page by page (each page's K rows, every head's, read from memory once), eight keys at a time */
        for (long p = c0 / ps; p <= c1 / ps; p++) {
            const float *kpage = cache + (size_t)bt[p] * page_stride;
            long j0 = p * ps > c0 ? p * ps : c0, j1 = (p + 1) * ps - 1 < c1 ? (p + 1) * ps - 1 : c1;
            for (int h = hlo; h < hhi; h++) {
                const float *qh = q + ((size_t)t * Hq + h) * D, *kh = kpage + (long)(h / group) * D;
                float *s = st + (long)h * max_kv;
                long j = j0;
                for (; j + 8 <= j1 + 1; j += 8) scores8(qh, kh + (j - p * ps) * tok_stride, tok_stride, D, scale,
                                                        s + (j - c0));
                for (; j <= j1; j++) s[j - c0] = dot1(kh + (j - p * ps) * tok_stride, qh, D) * scale;
            }
        }
        float mxs[Hq], sums[Hq];
        for (int h = hlo; h < hhi; h++) {
            float *s = st + (long)h * max_kv;
            /* the new tokens a tree step hides from this one (and, under a window, those standing out of it) */
            if (tree_bits)
                for (long jj = tj; jj <= c1; jj++) if (HIDDEN(jj)) s[jj - c0] = -INFINITY;
            /* pass 2: max, exp and sum (the max covers the sink where the chunk is the whole: a merge's does) */
            float mx, sum = exp_shifted(s, n, whole && sinks ? sinks[h] : -INFINITY, &mx);
            if (tree_bits)  /* exactly no weight (exp8 clamps e^-inf to ~1e-38, below any sum's rounding) */
                for (long jj = tj; jj <= c1; jj++) if (HIDDEN(jj)) s[jj - c0] = 0.f;
            mxs[h] = mx;
            sums[h] = sum;
            memset(HEAD_SUMS(h), 0, (size_t)D * sizeof(float));
        }
        /* pass 3: the values' weighted sums, page by page (each page's V rows read from memory once), 64 columns at a
           time */
        for (long p = c0 / ps; p <= c1 / ps; p++) {
            const float *vpage = cache + (size_t)bt[p] * page_stride + (long)ps * tok_stride;
            long j0 = p * ps > c0 ? p * ps : c0, j1 = (p + 1) * ps - 1 < c1 ? (p + 1) * ps - 1 : c1;
            for (int h = hlo; h < hhi; h++) {
                float *o = HEAD_SUMS(h);
                const float *vrow = vpage + (j0 - p * ps) * tok_stride + (long)(h / group) * D;
                const float *w = st + (long)h * max_kv + (j0 - c0);
                int d0 = 0;
                for (; d0 + 64 <= D; d0 += 64) weighted64(w, vrow + d0, tok_stride, j1 - j0 + 1, o + d0);
                if (d0 < D) weighted_rest(w, vrow + d0, tok_stride, j1 - j0 + 1, D - d0, o + d0);
            }
        }
        for (int h = hlo; h < hhi; h++) {
            if (!whole) {
                float *part = HEAD_SUMS(h) - 2;
                part[0] = mxs[h];
                part[1] = sums[h];
                continue;
            }
            float *o = HEAD_SUMS(h), sum = sums[h];
            if (sinks) sum += expf(sinks[h] - mxs[h]);
            __m256 inv8 = _mm256_set1_ps(1.f / sum);
            int d = 0;
            for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv8));
            for (; d < D; d++) o[d] *= 1.f / sum;
        }
    }
    if (nch == 1) return;
    /* the merge of split tokens: out = sum_c e^(m_c - m) o_c / (sum_c e^(m_c - m) l_c [+ e^(sink - m)]) */
    for (int th = 0; th < T * Hq; th++) {
        int t = th / Hq, h = th % Hq, b;
        long pos, s0, wlo;
        const int64_t *new_pos;
        long lo = token_span(t, qo_indptr, B, positions, window, tree_bits, tree_pos, &b, &pos, &s0, &wlo, &new_pos);
        long n = pos - lo + 1;
        if (n <= chunk) continue;  /* normalised in its task */
        int used = (int)((n + chunk - 1) / chunk);
        merge_partials(partials + (size_t)th * nch * pstride, used, pstride, sinks ? sinks + h : NULL,
                       out + (size_t)th * D, D);
    }
}
#undef HIDDEN
#undef HEAD_SUMS

/* Attention of decode / verify tokens straight over the paged KV cache (no gather).
 *
 * q: (T, Hq, D) contiguous, already rotated; cache: one layer's pool (num_pages, 2, ps, Hkv, D)
 * contiguous (index 0 = K, 1 = V); block_tables: (B, max_pages) int32; qo_indptr: (B + 1,) int32
 * (new tokens of sequence b are rows qo_indptr[b] .. qo_indptr[b + 1] - 1); positions: (T,) int64
 * absolute position of each new token, whose K/V are already in the cache. Token t attends to
 * positions max(0, pos - window + 1) .. pos (window <= 0: no window) of its own sequence — causal
 * among the new tokens, as the metadata defines.
 * A decode step (one new token per sequence) runs attention_by_token. Otherwise (verify and tree steps) one task is
 * one sequence, one K/V head and one chunk of `chunk` of the positions its new tokens attend to (the
 * span from the lowest any of them reads to the last); tasks run on the OpenMP threads when there is enough work.
 * A task attends all the query vectors that read its K/V head — the Hq / Hkv query heads of each of the sequence's
 * new tokens — in blocks of ATT_QB, so that each key and value row is loaded once per block. Three passes over the
 * chunk, page by page: every query's scores (qk4: four keys a time); per query, over the positions its token sees,
 * the max, exp and sum (the positions it does not see get weight exactly 0); the values' weighted sums (pv: 32
 * columns a time in registers). A sequence whose span fills one chunk is normalised there; a longer one (split so
 * that two cores share even one token's keys) leaves each chunk's max, sum and unnormalised sum of values in
 * `partials`, merged after (each chunk rescaled by e^(its max - the max)). The softmax is in float32, max
 * subtracted.
 * scores: scratch of T * Hq * max_kv floats; partials: scratch of T * Hq * ceil(max_kv / chunk) * (D + 2) floats
 * (unused when max_kv <= chunk: may be NULL then). out: (T, Hq, D). max_kv: at least every sequence's length.
 * tree_bits: NULL, or (T,) int64 for a step whose new tokens form a tree (a token's position is then its slot,
 * not its depth): token t sees the new token i of its own sequence (slot positions[qo_indptr[b]] + i) only when
 * bit i of tree_bits[t] is set; cached tokens before the step stay visible. Hidden slots get no weight at all
 * (their weight is exactly 0).
 * sinks: NULL, or (Hq,) learned logits (GPT-OSS attention sinks): head h's sink joins the softmax denominator
 * as one more score that has no value, so the weights of the real keys sum to less than 1.
 * tree_pos: NULL, or with tree_bits the (T,) position each new token stands at in its sequence (its tree depth
 * after the cached prefix), which a window counts: token t then sees cached slots j > tree_pos[t] - window and the
 * new tokens its bits name whose own tree_pos is > tree_pos[t] - window.
 * k_new, v_new, slots: NULL, or the new tokens' K and V, (T, Hkv, D) contiguous, and the (T,) slot each goes to
 * (page id * ps + offset in the page): they are written into the cache first (one dispatch less per layer than
 * torch's indexed writes), and then read as the cached tokens are.
 */
void mtp_paged_attention_f32(const float *q, int T, int Hq, int Hkv, int D, float *cache, int ps,
                             const int *block_tables, int max_pages, const int *qo_indptr, int B,
                             const int64_t *positions, int window, float scale, float *scores, long max_kv,
                             float *out, int num_threads, const int64_t *tree_bits,
                             const float *sinks, const int64_t *tree_pos,
                             const float *k_new, const float *v_new, const int64_t *slots,
                             long chunk, float *partials) {
    int rmax = 0;  /* the most new tokens a sequence has */
    for (int b = 0; b < B; b++) if (qo_indptr[b + 1] - qo_indptr[b] > rmax) rmax = qo_indptr[b + 1] - qo_indptr[b];
    if (slots) write_new_kv(cache, ps, Hkv, D, T, k_new, v_new, slots);
    if (rmax <= 1) {  /* a decode step: bound by reading the pages, see attention_by_token */
        attention_by_token(q, T, Hq, Hkv, D, cache, ps, block_tables, max_pages, qo_indptr, B, positions, window,
                           scale, scores, max_kv, out, num_threads, tree_bits, sinks, tree_pos, chunk, partials);
        return;
    }
    int group = Hq / Hkv;
    long tok_stride = (long)Hkv * D;          /* between tokens of a page */
    long page_stride = 2L * ps * tok_stride;  /* between pages; V starts ps * tok_stride after K */
    if (chunk < 8) chunk = 8;
    int nch = (int)((max_kv + chunk - 1) / chunk);  /* chunks of the longest span */
    if (!partials) nch = 1, chunk = max_kv > 8 ? max_kv : 8;
    long pstride = D + 2;  /* a chunk's partial: its max, its sum, then its D unnormalised sums of values */
    /* each sequence's span: from the lowest position one of its new tokens reads to the highest it is at */
    long *span = malloc(sizeof(long) * 2 * (size_t)(B > 0 ? B : 1));
    if (!span) return;
    long work = 0;
    for (int b = 0; b < B; b++) {
        span[2 * b] = LONG_MAX, span[2 * b + 1] = -1;
        for (int t = qo_indptr[b]; t < qo_indptr[b + 1]; t++) {
            int bb;
            long pos, s0, wlo;
            const int64_t *new_pos;
            long lo = token_span(t, qo_indptr, B, positions, window, tree_bits, tree_pos, &bb, &pos, &s0, &wlo,
                                 &new_pos);
            if (lo < span[2 * b]) span[2 * b] = lo;
            if (pos > span[2 * b + 1]) span[2 * b + 1] = pos;
            work += pos - lo + 1;
        }
    }
    int par = num_threads > 1 && work * Hq * D >= PAGED_ATTENTION_PARALLEL_WORK;
    int w512 = att_avx512, qb = w512 ? ATT_QB512 : ATT_QB;
    /* Fewer (sequence, K/V head, chunk) tasks than two a thread (a short decode step): each one's queries split
       in parts, tasks of their own */
    int base = B * Hkv * nch, qsplit = 1;
    rmax *= group;
    if (par && base < 2 * num_threads) qsplit = (2 * num_threads + base - 1) / base;
    if (qsplit > rmax) qsplit = rmax > 0 ? rmax : 1;
    int tasks = base * qsplit;
    #pragma omp parallel for num_threads(num_threads) schedule(dynamic, 1) if (par && tasks > 1)
    for (int task = 0; task < tasks; task++) {
        int part = task % qsplit, rest = task / qsplit;
        int g = rest % Hkv, c = (rest / Hkv) % nch, b = rest / (Hkv * nch);
        int t0 = qo_indptr[b], Rall = (qo_indptr[b + 1] - t0) * group, Rs = (Rall + qsplit - 1) / qsplit;
        int rlo = part * Rs, rhi = rlo + Rs < Rall ? rlo + Rs : Rall;  /* this task's query vectors */
        long LO = span[2 * b], HI = span[2 * b + 1];
        long c0 = LO + c * chunk;  /* this task's positions: c0 .. c1 */
        if (rlo >= rhi || c0 > HI) continue;
        long c1 = c0 + chunk - 1 < HI ? c0 + chunk - 1 : HI;
        int whole = HI - LO + 1 <= chunk;  /* one chunk holds the whole span: normalise here */
        long n = c1 - c0 + 1;
        const int *bt = block_tables + (size_t)b * max_pages;
/* query vector r: token t0 + r / group, head g * group + r % group; its scores (at j - c0), its query, its sums of
   values (its output row, normalised in place, or its chunk's partial after the max and sum) */
#define QT(r) (t0 + (r) / group)
#define QH(r) (g * group + (r) % group)
#define QSCORES(r) (scores + ((size_t)QT(r) * Hq + QH(r)) * max_kv + (c0 - LO))
#define QSUMS(r) (whole ? out + ((size_t)QT(r) * Hq + QH(r)) * D \
                  : partials + (((size_t)QT(r) * Hq + QH(r)) * nch + c) * pstride + 2)
        /* pass 1: scores, page by page (a page's K rows of this head read once per block of queries) */
        for (int r0 = rlo; r0 < rhi; r0 += qb) {
            int nq = rhi - r0 < qb ? rhi - r0 : qb;
            const float *qs[ATT_QB512];
            float *ss[ATT_QB512];
            for (int r = 0; r < nq; r++) qs[r] = q + ((size_t)QT(r0 + r) * Hq + QH(r0 + r)) * D, ss[r] = QSCORES(r0 + r);
            for (long p = c0 / ps; p <= c1 / ps; p++) {
                long j0 = p * ps > c0 ? p * ps : c0, j1 = (p + 1) * ps - 1 < c1 ? (p + 1) * ps - 1 : c1;
                const float *krow = cache + (size_t)bt[p] * page_stride + (j0 - p * ps) * tok_stride + (long)g * D;
                if (w512) qk_run_512(qs, nq, krow, tok_stride, j0, j1, c0, D, scale, ss);
                else qk_run(qs, nq, krow, tok_stride, j0, j1, c0, D, scale, ss);
            }
        }
        /* pass 2, per query: over the positions its token sees, max, exp and sum; weight 0 elsewhere */
        float mxs[rhi - rlo], sums[rhi - rlo];
        for (int r = rlo; r < rhi; r++) {
            int t = QT(r), h = QH(r), bb;
            long pos, s0, wlo;
            const int64_t *new_pos;
            long lo = token_span(t, qo_indptr, B, positions, window, tree_bits, tree_pos, &bb, &pos, &s0, &wlo,
                                 &new_pos);
            int64_t bits = tree_bits ? tree_bits[t] : 0;
#define HIDDEN(j) (!(((uint64_t)bits >> ((j) - s0)) & 1u) || (new_pos && new_pos[(j) - s0] < wlo))  /* j >= s0, j - s0 <= 63 */
            float *s = QSCORES(r);
            long a = lo > c0 ? lo : c0, e = pos < c1 ? pos : c1;  /* what it sees of the chunk: a .. e */
            float mx = -INFINITY, sum = 0.f;
            if (a <= e) {
                float *sa = s + (a - c0);
                long m = e - a + 1, tj = s0 > a ? s0 : a;  /* tj: the first position HIDDEN may name */
                if (tree_bits)  /* the new tokens a tree step hides from this one (and those out of a window) */
                    for (long jj = tj; jj <= e; jj++) if (HIDDEN(jj)) s[jj - c0] = -INFINITY;
                sum = exp_shifted(sa, m, whole && sinks ? sinks[h] : -INFINITY, &mx);
                if (tree_bits)  /* exactly no weight (exp8 clamps e^-inf to ~1e-38, below any sum's rounding) */
                    for (long jj = tj; jj <= e; jj++) if (HIDDEN(jj)) s[jj - c0] = 0.f;
            }
            if (a > e) {
                memset(s, 0, sizeof(float) * (size_t)n);
            } else {
                if (a > c0) memset(s, 0, sizeof(float) * (size_t)(a - c0));
                if (e < c1) memset(s + (e + 1 - c0), 0, sizeof(float) * (size_t)(c1 - e));
            }
            mxs[r - rlo] = mx;
            sums[r - rlo] = sum;
            memset(QSUMS(r), 0, (size_t)D * sizeof(float));
        }
        /* pass 3: the values' weighted sums, page by page (a page's V rows of this head read once per block) */
        for (int r0 = rlo; r0 < rhi; r0 += qb) {
            int nq = rhi - r0 < qb ? rhi - r0 : qb;
            const float *ws[ATT_QB512];
            float *os[ATT_QB512];
            for (long p = c0 / ps; p <= c1 / ps; p++) {
                long j0 = p * ps > c0 ? p * ps : c0, j1 = (p + 1) * ps - 1 < c1 ? (p + 1) * ps - 1 : c1;
                const float *vrow = cache + (size_t)bt[p] * page_stride + (long)ps * tok_stride
                                    + (j0 - p * ps) * tok_stride + (long)g * D;
                for (int r = 0; r < nq; r++) ws[r] = QSCORES(r0 + r) + (j0 - c0), os[r] = QSUMS(r0 + r);
                if (w512) pv_run_512(ws, nq, vrow, tok_stride, j1 - j0 + 1, D, os);
                else pv_run(ws, nq, vrow, tok_stride, j1 - j0 + 1, D, os);
            }
        }
        for (int r = rlo; r < rhi; r++) {
            float *o = QSUMS(r);
            if (!whole) {
                o[-2] = mxs[r - rlo];
                o[-1] = sums[r - rlo];
                continue;
            }
            float sum = sums[r - rlo];
            if (sinks) sum += expf(sinks[QH(r)] - mxs[r - rlo]);
            __m256 inv8 = _mm256_set1_ps(1.f / sum);
            int d = 0;
            for (; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(_mm256_loadu_ps(o + d), inv8));
            for (; d < D; d++) o[d] *= 1.f / sum;
        }
    }
    if (nch > 1) {
        /* the merge of split spans: out = sum_c e^(m_c - m) o_c / (sum_c e^(m_c - m) l_c [+ e^(sink - m)]) */
        for (int th = 0; th < T * Hq; th++) {
            int t = th / Hq, h = th % Hq, b = 0;
            while (b + 1 < B && qo_indptr[b + 1] <= t) b++;
            long n = span[2 * b + 1] - span[2 * b] + 1;
            if (n <= chunk) continue;  /* normalised in its task */
            int used = (int)((n + chunk - 1) / chunk);
            merge_partials(partials + (size_t)th * nch * pstride, used, pstride, sinks ? sinks + h : NULL,
                           out + (size_t)th * D, D);
        }
    }
    free(span);
}
#undef HIDDEN
#undef QT
#undef QH
#undef QSCORES
#undef QSUMS

/* Rotate-half RoPE in place: x rows (T, row stride xs) hold `heads` consecutive heads of D values from
 * column 0; cos, sin: (T, D) contiguous. x[i] <- x[i] cos[i] - x[i + D/2] sin[i],
 * x[i + D/2] <- x[i + D/2] cos[i + D/2] + x[i] sin[i + D/2] (the reference's x cos + rotate_half(x) sin). */
void mtp_rope_f32(float *x, long xs, int T, int heads, int D, const float *cos, const float *sin) {
    int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (size_t)t * D, *s = sin + (size_t)t * D;
        for (int h = 0; h < heads; h++) {
            float *v = x + (size_t)t * xs + (size_t)h * D;
            int i = 0;
            for (; i + 8 <= half; i += 8) {
                __m256 a = _mm256_loadu_ps(v + i), b = _mm256_loadu_ps(v + half + i);
                __m256 ra = _mm256_sub_ps(_mm256_mul_ps(a, _mm256_loadu_ps(c + i)), _mm256_mul_ps(b, _mm256_loadu_ps(s + i)));
                __m256 rb = _mm256_add_ps(_mm256_mul_ps(b, _mm256_loadu_ps(c + half + i)),
                                          _mm256_mul_ps(a, _mm256_loadu_ps(s + half + i)));
                _mm256_storeu_ps(v + i, ra);
                _mm256_storeu_ps(v + half + i, rb);
            }
            for (; i < half; i++) {
                float a = v[i], b = v[half + i];
                v[i] = a * c[i] - b * s[i];
                v[half + i] = b * c[half + i] + a * s[half + i];
            }
        }
    }
}

/* ---- one decoder layer of few rows (mtp_decoder_layer_f32) -------------------------------------------------- */

/* y[i] += x[i], n floats. */
static void add_(float *restrict y, const float *restrict x, long n) {
    long i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i), _mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] += x[i];
}

/* Each of M rows of gu (row stride gs) holds [gate (I) ; up (I)]: its first I columns <- silu(gate) * up.
 * silu(g) = g / (1 + e^-g), with e^-|g| from exp8 (relative error < 2e-7, like expf's). */
static void silu_mul_(float *gu, long gs, int M, int I) {
    const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
    for (int m = 0; m < M; m++) {
        float *g = gu + (size_t)m * gs, *u = g + I;
        int i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(g + i);
            __m256 e = exp8(_mm256_or_ps(x, sign));  /* e^-|x| */
            __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));  /* sigmoid(|x|) */
            __m256 neg = _mm256_cmp_ps(x, _mm256_setzero_ps(), _CMP_LT_OQ);
            __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(e, r), neg);  /* x < 0: e^x / (1 + e^x) */
            _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), _mm256_loadu_ps(u + i)));
        }
        for (; i < I; i++) g[i] = g[i] / (1.0f + expf(-g[i])) * u[i];
    }
}

/* A weight's kind in a plan's `wkinds` bits: weight j (layer: 0 qkv, 1 o, 2 gate|up, 3 down; head: 0 fc, 1 lm) is
 * bfloat16 bits where bit j is set, int8 rows and scales (mtp_gemv_i8w's buffer) where bit j + 4 is, else float32. */
#define WKIND(bits, j) (((bits) >> (j) & 1) ? 1 : ((bits) >> ((j) + 4) & 1) ? 2 : 0)

/* One Llama-family decoder layer's weights and shapes (mtp_train.models.families.llama: DecoderLayer), as
 * `cpu_kernels.LayerPlan` fills it once per layer. Weights are (N, K) contiguous, of the kinds `wkinds` gives
 * (WKIND); NULL norms and biases are absent. */
typedef struct {
    const float *ln1, *ln2, *q_norm, *k_norm;  /* input / post-attention RMSNorm (H,), q / k RMSNorm (D,) */
    const void *wqkv, *wo, *wgu, *wd;          /* (Hq·D + 2·Hkv·D, H), (H, Hq·D), (2I, H), (H, I) */
    const float *bqkv, *bo, *sinks;            /* biases; sinks (Hq,) */
    float eps, scale;
    int wkinds, H, I, Hq, Hkv, D, window;
} mtp_layer;

/* y = x W^T (+ b) over a weight of `kind` (WKIND: 0 float32, 1 bfloat16, 2 int8 rows and scales). */
static int layer_gemv(const float *x, long xs, const void *w, int kind, const float *b, float *y, long ys, int M,
                      int N, int K, int use512, int num_threads) {
    if (kind == 2)
        return gemv_i8(x, xs, w, b, y, ys, M, N, K, num_threads, use512 ? chunk_i8_avx512 : chunk_i8_avx2);
    gemv_chunk_fn fn = kind ? (use512 ? chunk_bf16_avx512 : chunk_bf16_avx2) : (use512 ? chunk_avx512 : chunk_avx2);
    return gemv_split(x, xs, w, b, y, ys, M, N, K, num_threads, fn);
}

/* out (M, H) <- the layer over x (M, H): x + attention(norm1(x)), then + mlp(norm2(·)), the new tokens' K/V
 * written into the cache at the step's slots. ain, when not NULL, is what q/k/v read in place of norm1(x): (M, ak)
 * contiguous (EAGLE-3's [norm(embedding) ; norm(x)], 2H wide, its qkv weight (Nqkv, ak)); x stays the residual.
 * The attention arguments are mtp_paged_attention_f32's (the step's tables, scratch and chunk); cos, sin: (M, D)
 * the rows' RoPE. use512: the gemv's AVX-512 body (the caller checked the CPU runs it). Returns 0, or -1 when its
 * scratch could not be allocated (nothing written). */
static int decoder_layer(const mtp_layer *L, const float *x, const float *ain, int ak, float *out, int M,
                         const float *cos, const float *sin, float *cache, int ps, const int *block_tables,
                         int max_pages, const int *qo_indptr, int B, const int64_t *positions,
                         const int64_t *tree_bits, const int64_t *tree_pos, const int64_t *slots, float *scores,
                         long max_kv, float *partials, long chunk, int use512, int num_threads) {
    int H = L->H, I = L->I, D = L->D, Nq = L->Hq * D, Nkv = L->Hkv * D, Nqkv = Nq + 2 * Nkv;
    size_t n = (size_t)M * ((size_t)H + Nqkv + Nq + 2 * Nkv + Nq + 2 * (size_t)I);
    float *buf = malloc(n * sizeof(float));
    if (!buf) return -1;
    float *h = buf, *qkv = h + (size_t)M * H, *q = qkv + (size_t)M * Nqkv, *k = q + (size_t)M * Nq,
          *v = k + (size_t)M * Nkv, *att = v + (size_t)M * Nkv, *gu = att + (size_t)M * Nq;
    const float *hin = ain ? ain : x;
    int K = ain ? ak : H;
    if (!ain && L->ln1) {
        mtp_rmsnorm_f32(x, H, L->ln1, h, M, H, L->eps);
        hin = h;
    }
    layer_gemv(hin, K, L->wqkv, WKIND(L->wkinds, 0), L->bqkv, qkv, Nqkv, M, Nqkv, K, use512, num_threads);
    for (int m = 0; m < M; m++) {  /* the heads of each, contiguous: what the norms, RoPE and attention read */
        const float *r = qkv + (size_t)m * Nqkv;
        memcpy(q + (size_t)m * Nq, r, sizeof(float) * Nq);
        memcpy(k + (size_t)m * Nkv, r + Nq, sizeof(float) * Nkv);
        memcpy(v + (size_t)m * Nkv, r + Nq + Nkv, sizeof(float) * Nkv);
    }
    if (L->q_norm) {  /* Qwen3: per-head RMSNorm of q and k before RoPE (in place: one row at a time) */
        mtp_rmsnorm_f32(q, D, L->q_norm, q, M * L->Hq, D, L->eps);  /* rows of one head each */
        mtp_rmsnorm_f32(k, D, L->k_norm, k, M * L->Hkv, D, L->eps);
    }
    mtp_rope_f32(q, Nq, M, L->Hq, D, cos, sin);
    mtp_rope_f32(k, Nkv, M, L->Hkv, D, cos, sin);
    mtp_paged_attention_f32(q, M, L->Hq, L->Hkv, D, cache, ps, block_tables, max_pages, qo_indptr, B, positions,
                            L->window, L->scale, scores, max_kv, att, num_threads, tree_bits, L->sinks, tree_pos,
                            k, v, slots, chunk, partials);
    layer_gemv(att, Nq, L->wo, WKIND(L->wkinds, 1), L->bo, out, H, M, H, Nq, use512, num_threads);
    add_(out, x, (long)M * H);
    mtp_rmsnorm_f32(out, H, L->ln2, h, M, H, L->eps);
    layer_gemv(h, H, L->wgu, WKIND(L->wkinds, 2), NULL, gu, 2 * I, M, 2 * I, H, use512, num_threads);
    silu_mul_(gu, 2 * I, M, I);
    layer_gemv(gu, 2 * I, L->wd, WKIND(L->wkinds, 3), NULL, h, H, M, H, I, use512, num_threads);  /* h: read already */
    add_(out, h, (long)M * H);
    free(buf);
    return 0;
}

/* decoder_layer with q/k/v over norm1(x). */
int mtp_decoder_layer_f32(const mtp_layer *L, const float *x, float *out, int M, const float *cos, const float *sin,
                          float *cache, int ps, const int *block_tables, int max_pages, const int *qo_indptr, int B,
                          const int64_t *positions, const int64_t *tree_bits, const int64_t *tree_pos,
                          const int64_t *slots, float *scores, long max_kv, float *partials, long chunk, int use512,
                          int num_threads) {
    return decoder_layer(L, x, NULL, 0, out, M, cos, sin, cache, ps, block_tables, max_pages, qo_indptr, B, positions,
                         tree_bits, tree_pos, slots, scores, max_kv, partials, chunk, use512, num_threads);
}

/* out (M, H) <- n decoder layers one after another over x (M, H), layer i on caches[i] (what n calls of
 * mtp_decoder_layer_f32 compute, without returning to the caller between them); saved[i], where not NULL, receives
 * layer i's input (M, H) (a forward's hidden_states[i]). The attention arguments are the step's, shared by every
 * layer. Returns 0, or -1 when a scratch could not be allocated (earlier layers' K/V may have been written). */
int mtp_decoder_stack_f32(const mtp_layer *const *layers, int n, float *const *caches, float *const *saved,
                          const float *x, float *out, int M, const float *cos, const float *sin, int ps,
                          const int *block_tables, int max_pages, const int *qo_indptr, int B,
                          const int64_t *positions, const int64_t *tree_bits, const int64_t *tree_pos,
                          const int64_t *slots, float *scores, long max_kv, float *partials, long chunk, int use512,
                          int num_threads) {
    if (n <= 0) return 0;
    size_t row = (size_t)M * layers[0]->H;
    float *tmp = malloc(sizeof(float) * row);
    if (!tmp) return -1;
    /* ping-pong so that the last layer writes `out`: with n odd the first one does too */
    float *bufs[2] = { n % 2 ? out : tmp, n % 2 ? tmp : out };
    const float *in = x;
    for (int i = 0; i < n; i++) {
        if (saved && saved[i]) memcpy(saved[i], in, sizeof(float) * row);
        float *dst = bufs[i % 2];
        if (mtp_decoder_layer_f32(layers[i], in, dst, M, cos, sin, caches[i], ps, block_tables, max_pages, qo_indptr,
                                  B, positions, tree_bits, tree_pos, slots, scores, max_kv, partials, chunk, use512,
                                  num_threads)) {
            free(tmp);
            return -1;
        }
        in = dst;
    }
    free(tmp);
    return 0;
}

/* A chain head's whole step (mtp_train.head_types.mtp.head: MTPHead.features, then its logits at chosen rows) as
 * `cpu_kernels.HeadPlan` fills it once per set of weights: the frozen embedding's rows of the next tokens and the
 * features, each through its RMSNorm where the head has one, concatenated [e ; h] into the fc, the head's decoder
 * layer, its final norm, and the (draft-vocabulary) lm_head rows. fc and lm are (N, K) contiguous, of the kinds
 * `wkinds` gives (WKIND: 0 fc, 1 lm); NULL norms and bias are absent.
 * Without an fc (EAGLE-3, mtp_train.head_types.eagle3.head): [enorm(e) ; hnorm(h)] is what the layer's q/k/v read (its qkv
 * weight (Nqkv, 2H), its own ln1 NULL) and h its residual; raw_out: the step's features are the layer's output
 * before the final norm (the logits still read its norm), as EAGLE-3 feeds its next step. */
typedef struct {
    const float *embed, *enorm, *hnorm, *norm;  /* (vocab, H) float32; (H,) RMSNorm weights */
    const void *fc, *lm;                        /* (H, 2H) or NULL; (V, H) */
    const float *fc_bias;                       /* (H,) */
    const mtp_layer *layer;
    float eps;
    int wkinds, H, V, vocab;                    /* WKIND bits (0 fc, 1 lm); vocab: the embedding's rows */
    int raw_out;
} mtp_head;

/* out (M, H) <- the head's features of M rows (hidden (M, H), row stride hs: the target's or the head's own; ids
 * (M,): the token after each row), the layer's K/V written into its cache as mtp_decoder_layer_f32 does; logits
 * (N, V) <- the lm rows over out's rows `rows` (N >= 0). use512: the fc's and the layer's gemv body (M rows),
 * lm512: the lm_head's (N rows). Returns 0; -2 (nothing written) for a token id outside the embedding or a row
 * outside 0..M-1; -1 when a scratch could not be allocated (the K/V may have been written). */
int mtp_head_step_f32(const mtp_head *P, const float *hidden, long hs, const int64_t *ids, int M,
                      const int64_t *rows, int N, float *out, float *logits, const float *cos, const float *sin,
                      float *cache, int ps, const int *block_tables, int max_pages, const int *qo_indptr, int B,
                      const int64_t *positions, const int64_t *tree_bits, const int64_t *tree_pos,
                      const int64_t *slots, float *scores, long max_kv, float *partials, long chunk, int use512,
                      int lm512, int num_threads) {
    int H = P->H;
    for (int m = 0; m < M; m++)
        if (ids[m] < 0 || ids[m] >= P->vocab) return -2;
    for (int n = 0; n < N; n++)
        if (rows[n] < 0 || rows[n] >= M) return -2;
    float *buf = malloc(sizeof(float) * ((size_t)M * 4 * H + (size_t)N * H));
    if (!buf) return -1;
    float *cat = buf, *x = cat + (size_t)M * 2 * H, *y = x + (size_t)M * H, *sel = y + (size_t)M * H;
    for (int m = 0; m < M; m++) {
        const float *e = P->embed + (size_t)ids[m] * H, *h = hidden + (size_t)m * hs;
        float *ce = cat + (size_t)m * 2 * H, *ch = ce + H;
        if (P->enorm) mtp_rmsnorm_f32(e, H, P->enorm, ce, 1, H, P->eps);
        else memcpy(ce, e, sizeof(float) * H);
        if (P->hnorm) mtp_rmsnorm_f32(h, H, P->hnorm, ch, 1, H, P->eps);
        else memcpy(ch, h, sizeof(float) * H);
    }
    const float *ain = NULL;
    if (P->fc) layer_gemv(cat, 2 * H, P->fc, WKIND(P->wkinds, 0), P->fc_bias, x, H, M, H, 2 * H, use512, num_threads);
    else {  /* EAGLE-3: the rows themselves are the residual, [e ; h] the attention's input */
        for (int m = 0; m < M; m++) memcpy(x + (size_t)m * H, hidden + (size_t)m * hs, sizeof(float) * H);
        ain = cat;
    }
    if (decoder_layer(P->layer, x, ain, 2 * H, y, M, cos, sin, cache, ps, block_tables, max_pages, qo_indptr, B,
                      positions, tree_bits, tree_pos, slots, scores, max_kv, partials, chunk, use512, num_threads)) {
        free(buf);
        return -1;
    }
    if (P->raw_out) {  /* the features before the final norm; the chosen rows normed for the logits */
        memcpy(out, y, sizeof(float) * (size_t)M * H);
        for (int n = 0; n < N; n++) {
            const float *r = y + (size_t)rows[n] * H;
            if (P->norm) mtp_rmsnorm_f32(r, H, P->norm, sel + (size_t)n * H, 1, H, P->eps);
            else memcpy(sel + (size_t)n * H, r, sizeof(float) * H);
        }
    } else {
        if (P->norm) mtp_rmsnorm_f32(y, H, P->norm, out, M, H, P->eps);
        else memcpy(out, y, sizeof(float) * (size_t)M * H);
        for (int n = 0; n < N; n++) memcpy(sel + (size_t)n * H, out + (size_t)rows[n] * H, sizeof(float) * H);
    }
    if (N > 0) layer_gemv(sel, H, P->lm, WKIND(P->wkinds, 1), NULL, logits, P->V, N, P->V, H, lm512, num_threads);
    free(buf);
    return 0;
}

/* The soft cross-entropy row's last pass from column i on, in scalar code (the tail a register does not fill):
 * z <- q - p with q = z * isz, p = t * ist, and a + the sum of min(q, p) returned. */
static inline float diff_tail(float *restrict z, const float *restrict t, int i, int V, float isz, float ist, float a) {
    for (; i < V; i++) {
        float q = z[i] * isz, p = t[i] * ist;
        a += q < p ? q : p;
        z[i] = q - p;
    }
    return a;
}

/* One row of the fused soft cross-entropy (training: mtp_train/train/losses.py, ce_impl=fused).
 *
 * z: the head's logits (V,), t: the target's logits (V,), both overwritten: z <- softmax(z) - softmax(t)
 * (d CE / d z), t <- e^(t - max t) (scratch). Returns CE = logsumexp(z) - sum softmax(t) z; *best = argmax t
 * (the first maximal index, as torch.argmax), *rank = #{i : z_i > z_best} (0: the head's argmax is the target's),
 * *alpha = sum min(softmax(z), softmax(t)) (the acceptance a draft sampled from the head would get).
 * Three passes over a row that stays in L2: max (z and t), then exponentials and sums (written back), then
 * the difference of the two normalised rows, with their minimum summed on the way. */
static float soft_ce_row(float *restrict z, float *restrict t, int V, int64_t *best, int64_t *rank, float *alpha) {
    __m256 mz8 = _mm256_set1_ps(-INFINITY), mt8 = mz8;
    int i = 0;
    for (; i + 8 <= V; i += 8) {
        mz8 = _mm256_max_ps(mz8, _mm256_loadu_ps(z + i));
        mt8 = _mm256_max_ps(mt8, _mm256_loadu_ps(t + i));
    }
    float buf[8], mz = -INFINITY, mt = -INFINITY;
    _mm256_storeu_ps(buf, mz8);
    for (int j = 0; j < 8; j++) mz = buf[j] > mz ? buf[j] : mz;
    _mm256_storeu_ps(buf, mt8);
    for (int j = 0; j < 8; j++) mt = buf[j] > mt ? buf[j] : mt;
    for (; i < V; i++) {
        mz = z[i] > mz ? z[i] : mz;
        mt = t[i] > mt ? t[i] : mt;
    }
    int b = 0;
    while (b < V - 1 && t[b] != mt) b++;
    float zb = z[b];
    __m256 sz8 = _mm256_setzero_ps(), st8 = sz8, d8 = sz8, r8 = sz8;
    __m256 vmz = _mm256_set1_ps(mz), vmt = _mm256_set1_ps(mt), vzb = _mm256_set1_ps(zb), one = _mm256_set1_ps(1.f);
    for (i = 0; i + 8 <= V; i += 8) {
        __m256 zv = _mm256_loadu_ps(z + i);
        __m256 ez = exp8(_mm256_sub_ps(zv, vmz)), et = exp8(_mm256_sub_ps(_mm256_loadu_ps(t + i), vmt));
        sz8 = _mm256_add_ps(sz8, ez);
        st8 = _mm256_add_ps(st8, et);
        d8 = _mm256_fmadd_ps(et, zv, d8);
        r8 = _mm256_add_ps(r8, _mm256_and_ps(_mm256_cmp_ps(zv, vzb, _CMP_GT_OQ), one));
        _mm256_storeu_ps(z + i, ez);
        _mm256_storeu_ps(t + i, et);
    }
    float sz = hsum(sz8), st = hsum(st8), d = hsum(d8), r = hsum(r8);
    for (; i < V; i++) {
        float ez = expf(z[i] - mz), et = expf(t[i] - mt);
        sz += ez;
        st += et;
        d += et * z[i];
        r += z[i] > zb;
        z[i] = ez;
        t[i] = et;
    }
    float isz = 1.f / sz, ist = 1.f / st;
    __m256 visz = _mm256_set1_ps(isz), vist = _mm256_set1_ps(ist), a8 = _mm256_setzero_ps();
    for (i = 0; i + 8 <= V; i += 8) {
        __m256 q = _mm256_mul_ps(_mm256_loadu_ps(z + i), visz), p = _mm256_mul_ps(_mm256_loadu_ps(t + i), vist);
        a8 = _mm256_add_ps(a8, _mm256_min_ps(q, p));
        _mm256_storeu_ps(z + i, _mm256_sub_ps(q, p));
    }
    float a = diff_tail(z, t, i, V, isz, ist, hsum(a8));
    *best = b;
    *rank = (int64_t)r;
    *alpha = a;
    return mz + logf(sz) - d * ist;
}

/* mtp_soft_ce_f32 — the soft cross-entropy of C rows and its gradient, in place (see soft_ce_row).
 * z, t: (C, V) contiguous; ce, alpha: (C,) per-row CE and acceptance; best, rank: (C,). Rows are split over OpenMP
 * threads. */
typedef float (*soft_ce_row_fn)(float *restrict z, float *restrict t, int V, int64_t *best, int64_t *rank,
                                float *alpha);

static void soft_ce_split(float *z, float *t, int C, int V, float *ce, int64_t *best, int64_t *rank, float *alpha,
                          int num_threads, soft_ce_row_fn row_fn) {
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && C > 1)
    for (int r = 0; r < C; r++)
        ce[r] = row_fn(z + (size_t)r * V, t + (size_t)r * V, V, best + r, rank + r, alpha + r);
}

void mtp_soft_ce_f32(float *z, float *t, int C, int V, float *ce, int64_t *best, int64_t *rank, float *alpha,
                     int num_threads) {
    soft_ce_split(z, t, C, V, ce, best, rank, alpha, num_threads, soft_ce_row);
}

/* ---- the soft cross-entropy on AVX-512 (run only where mtp_cpu_avx512() is 1) --------------------------------- */

/* exp8 on 16 lanes (the same reduction and polynomial; 2^n applied by scalef). */
AVX512 static inline __m512 exp16(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.f / 720);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
    return _mm512_scalef_ps(p, n);
}

/* soft_ce_row on 16-wide registers: the same three passes, the same outputs (the V % 16 tail in scalar code). */
AVX512 static float soft_ce_row_512(float *restrict z, float *restrict t, int V, int64_t *best, int64_t *rank,
                                    float *alpha) {
    __m512 mz16 = _mm512_set1_ps(-INFINITY), mt16 = mz16;
    int i = 0;
    for (; i + 16 <= V; i += 16) {
        mz16 = _mm512_max_ps(mz16, _mm512_loadu_ps(z + i));
        mt16 = _mm512_max_ps(mt16, _mm512_loadu_ps(t + i));
    }
    float mz = _mm512_reduce_max_ps(mz16), mt = _mm512_reduce_max_ps(mt16);
    for (; i < V; i++) {
        mz = z[i] > mz ? z[i] : mz;
        mt = t[i] > mt ? t[i] : mt;
    }
    int b = 0;
    while (b < V - 1 && t[b] != mt) b++;
    float zb = z[b];
    __m512 sz16 = _mm512_setzero_ps(), st16 = sz16, d16 = sz16;
    __m512 vmz = _mm512_set1_ps(mz), vmt = _mm512_set1_ps(mt), vzb = _mm512_set1_ps(zb);
    long r = 0;
    for (i = 0; i + 16 <= V; i += 16) {
        __m512 zv = _mm512_loadu_ps(z + i);
        __m512 ez = exp16(_mm512_sub_ps(zv, vmz)), et = exp16(_mm512_sub_ps(_mm512_loadu_ps(t + i), vmt));
        sz16 = _mm512_add_ps(sz16, ez);
        st16 = _mm512_add_ps(st16, et);
        d16 = _mm512_fmadd_ps(et, zv, d16);
        r += __builtin_popcount((unsigned)_mm512_cmp_ps_mask(zv, vzb, _CMP_GT_OQ));
        _mm512_storeu_ps(z + i, ez);
        _mm512_storeu_ps(t + i, et);
    }
    float sz = _mm512_reduce_add_ps(sz16), st = _mm512_reduce_add_ps(st16), d = _mm512_reduce_add_ps(d16);
    for (; i < V; i++) {
        float ez = expf(z[i] - mz), et = expf(t[i] - mt);
        sz += ez;
        st += et;
        d += et * z[i];
        r += z[i] > zb;
        z[i] = ez;
        t[i] = et;
    }
    float isz = 1.f / sz, ist = 1.f / st;
    __m512 visz = _mm512_set1_ps(isz), vist = _mm512_set1_ps(ist), a16 = _mm512_setzero_ps();
    for (i = 0; i + 16 <= V; i += 16) {
        __m512 q = _mm512_mul_ps(_mm512_loadu_ps(z + i), visz), p = _mm512_mul_ps(_mm512_loadu_ps(t + i), vist);
        a16 = _mm512_add_ps(a16, _mm512_min_ps(q, p));
        _mm512_storeu_ps(z + i, _mm512_sub_ps(q, p));
    }
    float a = diff_tail(z, t, i, V, isz, ist, _mm512_reduce_add_ps(a16));
    *best = b;
    *rank = (int64_t)r;
    *alpha = a;
    return mz + logf(sz) - d * ist;
}

/* mtp_soft_ce_f32 on AVX-512; -1 (nothing written) where this CPU cannot run it. */
int mtp_soft_ce_f32_avx512(float *z, float *t, int C, int V, float *ce, int64_t *best, int64_t *rank,
                           float *alpha, int num_threads) {
    if (!mtp_cpu_avx512()) return -1;
    soft_ce_split(z, t, C, V, ce, best, rank, alpha, num_threads, soft_ce_row_512);
    return 0;
}
#undef AVX512
