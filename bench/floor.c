/* What bounds a few-row gemv on this machine, for `python -m bench.cpu_kernels`: the time to only read its weights
 * (the memory floor) and the core's peak rate of fused multiply-adds (the arithmetic floor). Built by the bench
 * with the kernels' own flags; not part of the package.
 *
 * read_fma_f32(w, n, nt, avx512, m): n floats of w read once over nt OpenMP threads (contiguous parts, prefetched
 * ahead as the gemv prefetches), with m FMAs on every loaded vector (m = 0..3) into 8·m independent sums whose x
 * operands stay in registers: the gemv's arithmetic on its stream without the rest of its loop, to see how much of
 * a row's multiply-adds this core hides behind the reads. m stops at 3: 8 × 3 sums, 3 x and the loaded vector fill
 * AVX-512's 32 registers. The sum is returned so that the reads cannot be dropped.
 * With m = 0 they are the bare reads, the gemv's memory floor.
 * fma_rate(avx512, n): vector FMAs per second on one core, from n rounds of 12 independent chains (enough to
 * cover the latency of every port), 8 (AVX2) or 16 (AVX-512) lanes each. */
#include <immintrin.h>
#include <omp.h>
#include <time.h>

#define AVX512 __attribute__((target("avx512f,avx512vl,avx512dq,avx2,fma")))

/* Reads w[a, b) 8 vectors at a time, M FMAs on each (M a constant in each case below). */
#define READ_FMA(NAME, ATTR, VEC, LANES, ZERO, LOAD, SET1, FMA, ADD, STORE)                                       \
ATTR static inline __attribute__((always_inline)) float NAME(const float *w, long a, long b, int M) {       \
    VEC s[8][3], x[3];                                                                                           \
    for (int j = 0; j < 8; j++) for (int r = 0; r < 3; r++) s[j][r] = ZERO();                                    \
    for (int r = 0; r < 3; r++) x[r] = SET1(1.0f + 0.125f * r);                                                 \
    long i = a;                                                                                                  \
    for (; i + 8 * LANES <= b; i += 8 * LANES) {                                                                 \
        _mm_prefetch((const char *)(w + i) + 16384, _MM_HINT_T0);                                               \
        if (8 * LANES > 16) _mm_prefetch((const char *)(w + i) + 16384 + 256, _MM_HINT_T0);                      \
        for (int j = 0; j < 8; j++) {                                                                            \
            VEC v = LOAD(w + i + j * LANES);                                                                     \
            if (M == 0) s[j][0] = ADD(s[j][0], v);                                                               \
            for (int r = 0; r < M; r++) s[j][r] = FMA(v, x[r], s[j][r]);                                         \
        }                                                                                                        \
    }                                                                                                            \
    VEC t = ZERO();                                                                                              \
    for (int j = 0; j < 8; j++) for (int r = 0; r < 3; r++) t = ADD(t, s[j][r]);                                 \
    float o[LANES], sum = 0;                                                                                     \
    STORE(o, t);                                                                                                 \
    for (int j = 0; j < LANES; j++) sum += o[j];                                                                 \
    return sum;                                                                                                  \
}                                                                                                                \
ATTR static float NAME##_m(const float *w, long a, long b, int M) {                                              \
    switch (M) {                                                                                                 \
    case 0: return NAME(w, a, b, 0);                                                                             \
    case 1: return NAME(w, a, b, 1);                                                                             \
    case 2: return NAME(w, a, b, 2);                                                                             \
    default: return NAME(w, a, b, 3);                                                                            \
    }                                                                                                            \
}

READ_FMA(rf512, AVX512, __m512, 16, _mm512_setzero_ps, _mm512_loadu_ps,
         _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps)
READ_FMA(rf256, , __m256, 8, _mm256_setzero_ps, _mm256_loadu_ps,
         _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps)

float read_fma_f32(const float *w, long n, int nt, int avx512, int m) {
    float total = 0;
    #pragma omp parallel num_threads(nt) reduction(+ : total)
    {
        int t = omp_get_thread_num(), T = omp_get_num_threads();
        long a = n / T * t, b = t == T - 1 ? n : n / T * (t + 1);
        total += avx512 ? rf512_m(w, a, b, m) : rf256_m(w, a, b, m);
    }
    return total;
}

static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

AVX512 static double rate512(long n) {
    __m512 a[12], x = _mm512_set1_ps(0.5f), y = _mm512_set1_ps(0.25f);
    for (int j = 0; j < 12; j++) a[j] = _mm512_set1_ps((float)j);
    double t0 = seconds();
    for (long i = 0; i < n; i++)
        for (int j = 0; j < 12; j++) a[j] = _mm512_fmadd_ps(a[j], x, y);  /* converges to 0.5: no overflow */
    double dt = seconds() - t0;
    volatile float sink = 0;
    for (int j = 0; j < 12; j++) sink += _mm512_reduce_add_ps(a[j]);
    return 12.0 * n / dt;
}

static double rate256(long n) {
    __m256 a[12], x = _mm256_set1_ps(0.5f), y = _mm256_set1_ps(0.25f);
    for (int j = 0; j < 12; j++) a[j] = _mm256_set1_ps((float)j);
    double t0 = seconds();
    for (long i = 0; i < n; i++)
        for (int j = 0; j < 12; j++) a[j] = _mm256_fmadd_ps(a[j], x, y);
    double dt = seconds() - t0;
    volatile float sink = 0;
    float t[8];
    for (int j = 0; j < 12; j++) { _mm256_storeu_ps(t, a[j]); sink += t[0]; }
    return 12.0 * n / dt;
}

double fma_rate(int avx512, long n) { return avx512 ? rate512(n) : rate256(n); }
