/* Native CPU kernels for decode and verify steps (fp32, AVX2 + FMA), called through ctypes.
 *
 * mtp_gemv_f32 — few-row matrix products y = x W^T (+ b).
 *
 * x: (M, K) with row stride xs; W: (N, K) contiguous (nn.Linear's weight); b: (N,) or NULL;
 * y: (M, N) with row stride ys. With M small (a decode step has 1 row, a verify step k + 1) the
 * product is bound by reading W, so the kernel streams W once, row by row, and keeps every row of
 * x in L1: each W row is loaded from memory once and used for all M rows of x. Rows of W are split
 * over OpenMP threads (the runtime torch itself uses, so both share one thread pool).
 *
 * Summation order: 4 (M = 1) or 1 (M > 1) interleaved 8-wide partial sums per output, then a
 * horizontal sum, then the K % 8 tail in scalar order.
 *
 * mtp_rmsnorm_f32 — RMSNorm of few rows, y = w * x / sqrt(mean(x^2) + eps), one pass to sum the
 * squares and one to scale: on a 576-wide row this is ~1 us where torch's composite takes ~70 us.
 */
#include <immintrin.h>
#include <math.h>
#include <stddef.h>

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

/* MB (1..4) outputs of one W row: y[m * ys] = dot(w, x[m * xs]); the W chunk is loaded once per k. */
static inline __attribute__((always_inline)) void dot_rows(const float *restrict w, const float *restrict x,
                                                           long xs, int MB, int K, float *y, long ys) {
    __m256 a[4];
    for (int m = 0; m < MB; m++) a[m] = _mm256_setzero_ps();
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        __m256 wv = _mm256_loadu_ps(w + k);
        for (int m = 0; m < MB; m++) a[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * xs + k), a[m]);
    }
    for (int m = 0; m < MB; m++) {
        float s = hsum(a[m]);
        for (int kk = k; kk < K; kk++) s += w[kk] * x[m * xs + kk];
        y[m * ys] = s;
    }
}

static void one_row(const float *w, const float *x, long xs, int M, int K, float *y, long ys) {
    int m = 0;
    for (; m + 4 <= M; m += 4) dot_rows(w, x + m * xs, xs, 4, K, y + m * ys, ys);
    switch (M - m) {
        case 3: dot_rows(w, x + m * xs, xs, 3, K, y + m * ys, ys); break;
        case 2: dot_rows(w, x + m * xs, xs, 2, K, y + m * ys, ys); break;
        case 1: y[m * ys] = dot1(w, x + m * xs, K); break;
    }
}

int mtp_gemv_f32(const float *x, long xs, const float *w, const float *b, float *y, long ys,
                 int M, int N, int K, int num_threads) {
    /* Rows per thread chunk: big enough that a chunk's W (>= 64 KiB) amortises the scheduling. */
    int chunk = (16384 + K - 1) / K;
    if (chunk < 1) chunk = 1;
    #pragma omp parallel for num_threads(num_threads) schedule(static) if (num_threads > 1 && (long)N * K >= 65536)
    for (int n0 = 0; n0 < N; n0 += chunk) {
        int n1 = n0 + chunk < N ? n0 + chunk : N;
        for (int n = n0; n < n1; n++) {
            one_row(w + (size_t)n * K, x, xs, M, K, y + n, ys);
            if (b) for (int m = 0; m < M; m++) y[m * ys + n] += b[n];
        }
    }
    return 0;
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
