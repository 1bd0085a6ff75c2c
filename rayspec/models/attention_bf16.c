/* Unmasked bfloat16 self-attention over whole rows for a CPU with AVX-512 BF16 (rayspec.kernels.attention).
 *
 * out[b, i, h*64:(h+1)*64] = softmax_j(q[b, i, h] . k[b, j, h]) @ v[b, :, h]   (no scale: the caller scales q)
 *
 * Per (batch, head), the keys are packed once in pairs along the head dimension and the values in pairs along the keys
 * (the operand layouts of VDPBF16PS). A task is a block of QBLOCK query rows of one (batch, head): its scores over
 * every key are products of bfloat16 pairs accumulated in float32, held in a float32 buffer that fits in L2; each row's
 * softmax is taken there in float32 (its maximum, exp, sum), the unnormalised weights rounded to bfloat16 once, the
 * weighted values accumulated in float32 and divided by the row's sum, and the output rounded to bfloat16. A row's
 * arithmetic never depends on the other rows, the batch or the thread count: the same row gives the same bits in any
 * call. Tasks are taken by `threads` OpenMP threads (the caller passes torch's thread count): built with -fopenmp and
 * loaded after PyTorch, the library binds to PyTorch's own libgomp, so its threads are PyTorch's pool, not a second
 * pool competing with PyTorch's spinning threads on the same cores.
 *
 * Layouts: q, k, v are bfloat16 [B, S, H*64] with element stride 1 along the last axis and the given batch and row
 * strides (in elements); out is a contiguous bfloat16 [B, S, H*64]. Returns 0, or -1 where memory ran out.
 */
#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define DH 64          /* head dimension: every Whisper checkpoint's */
#define QBLOCK 32      /* query rows per task */
#define KBLOCK 64      /* keys per inner block (4 vectors of 16) */

typedef uint16_t bf16;

typedef struct {
    const bf16 *q, *k, *v;
    bf16 *out;
    long qb, qs, kb, ks, vb, vs;
    int B, S, H, Sp;
    bf16 *kpack, *vpack;  /* per (b, h): Sp*DH bfloat16 each */
    int ntasks, next_pack, npack;
    int next_task;
    int failed;
} job_t;

static inline float bf16_to_f32(bf16 x) {
    union { uint32_t u; float f; } c;
    c.u = ((uint32_t)x) << 16;
    return c.f;
}

/* exp(x) for x <= 0 (scores minus their row maximum) in float32: 2^(x log2 e) as 2^n * 2^f, |f| <= 1/2, 2^f by
 * its Taylor polynomial of degree 7 (truncation below 1e-8 relative, under float32's rounding; not measured apart:
 * the kernel's tests compare whole outputs with a float32 reference) */
static inline __m512 exp_nonpositive(__m512 x) {
    const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
    __m512 t = _mm512_mul_ps(_mm512_max_ps(x, _mm512_set1_ps(-100.0f)), log2e);
    __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 f = _mm512_sub_ps(t, n);
    /* 2^f on [-1/2, 1/2]: Taylor coefficients of e^(f ln 2), degree 7 */
    __m512 p = _mm512_set1_ps(1.5252733804059841e-05f);
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.5403530393381606e-04f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.3333558146428443e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076284772e-03f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108664821580e-02f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650695910071e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718055994531e-01f));
    p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* K of (b, h) as [DH/2][Sp][2] (pairs along the head dimension), V as [Sp/2][DH][2] (pairs along the keys); keys from
 * S to Sp are zero (their scores are masked, their weights zero). */
static void pack(job_t *j, int bh) {
    int b = bh / j->H, h = bh % j->H;
    bf16 *kp = j->kpack + (size_t)bh * j->Sp * DH, *vp = j->vpack + (size_t)bh * j->Sp * DH;
    memset(kp, 0, sizeof(bf16) * (size_t)j->Sp * DH);
    memset(vp, 0, sizeof(bf16) * (size_t)j->Sp * DH);
    for (int s = 0; s < j->S; s++) {
        const bf16 *kr = j->k + b * j->kb + s * j->ks + h * DH;
        const bf16 *vr = j->v + b * j->vb + s * j->vs + h * DH;
        for (int d = 0; d < DH; d += 2) {
            kp[((size_t)(d / 2) * j->Sp + s) * 2] = kr[d];
            kp[((size_t)(d / 2) * j->Sp + s) * 2 + 1] = kr[d + 1];
        }
        bf16 *vrow = vp + (size_t)(s / 2) * DH * 2 + (s & 1);
        for (int d = 0; d < DH; d++) vrow[d * 2] = vr[d];
    }
}

static void run_task(job_t *j, int task, float *scores, bf16 *weights, bf16 *qbuf) {
    int nq = (j->S + QBLOCK - 1) / QBLOCK;
    int bh = task / nq, i0 = (task % nq) * QBLOCK;
    int b = bh / j->H, h = bh % j->H;
    int rows = j->S - i0 < QBLOCK ? j->S - i0 : QBLOCK;
    const bf16 *kp = j->kpack + (size_t)bh * j->Sp * DH, *vp = j->vpack + (size_t)bh * j->Sp * DH;
    memset(qbuf, 0, sizeof(bf16) * QBLOCK * DH);
    for (int r = 0; r < rows; r++)
        memcpy(qbuf + r * DH, j->q + b * j->qb + (i0 + r) * j->qs + h * DH, sizeof(bf16) * DH);

    /* scores[r][s] = q_r . k_s over every key block, 4 rows x 64 keys a step */
    for (int s0 = 0; s0 < j->Sp; s0 += KBLOCK) {
        for (int r0 = 0; r0 < QBLOCK; r0 += 4) {
            const uint32_t *qp = (const uint32_t *)(qbuf + r0 * DH);  /* a row as DH/2 pairs */
            __m512 acc[4][4];
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
            for (int dp = 0; dp < DH / 2; dp++) {
                const bf16 *kr = kp + ((size_t)dp * j->Sp + s0) * 2;
                __m512bh kv0 = (__m512bh)_mm512_loadu_si512(kr);
                __m512bh kv1 = (__m512bh)_mm512_loadu_si512(kr + 32);
                __m512bh kv2 = (__m512bh)_mm512_loadu_si512(kr + 64);
                __m512bh kv3 = (__m512bh)_mm512_loadu_si512(kr + 96);
                for (int r = 0; r < 4; r++) {
                    __m512bh qv = (__m512bh)_mm512_set1_epi32((int)qp[r * (DH / 2) + dp]);
                    acc[r][0] = _mm512_dpbf16_ps(acc[r][0], qv, kv0);
                    acc[r][1] = _mm512_dpbf16_ps(acc[r][1], qv, kv1);
                    acc[r][2] = _mm512_dpbf16_ps(acc[r][2], qv, kv2);
                    acc[r][3] = _mm512_dpbf16_ps(acc[r][3], qv, kv3);
                }
            }
            for (int r = 0; r < 4; r++)
                for (int c = 0; c < 4; c++)
                    _mm512_storeu_ps(scores + (size_t)(r0 + r) * j->Sp + s0 + 16 * c, acc[r][c]);
        }
    }

    /* each row's softmax in float32: weights = exp(score - max) rounded to bfloat16 (padded keys 0), sums kept */
    float inv[QBLOCK];
    for (int r = 0; r < QBLOCK; r++) {
        float *sr = scores + (size_t)r * j->Sp;
        for (int s = j->S; s < j->Sp; s++) sr[s] = -1e30f;
        __m512 m = _mm512_set1_ps(-1e30f);
        for (int s = 0; s < j->Sp; s += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(sr + s));
        __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(m));
        __m512 sum = _mm512_setzero_ps();
        bf16 *wr = weights + (size_t)r * j->Sp;
        for (int s = 0; s < j->Sp; s += 16) {
            __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_loadu_ps(sr + s), mx));
            __m256bh w = _mm512_cvtneps_pbh(e);
            _mm256_storeu_si256((__m256i *)(wr + s), (__m256i)w);
            /* the sum of the rounded weights: the same numbers the value products use */
            sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)w), 16)));
        }
        inv[r] = 1.0f / _mm512_reduce_add_ps(sum);
    }

    /* out_r = (sum_s w_rs v_s) / sum_s w_rs, 4 rows x 64 dims a step, pairs of keys */
    for (int r0 = 0; r0 < rows; r0 += 4) {
        __m512 acc[4][4];
        for (int r = 0; r < 4; r++)
            for (int c = 0; c < 4; c++) acc[r][c] = _mm512_setzero_ps();
        for (int sp = 0; sp < j->Sp / 2; sp++) {
            const bf16 *vr = vp + (size_t)sp * DH * 2;
            __m512bh v0 = (__m512bh)_mm512_loadu_si512(vr);
            __m512bh v1 = (__m512bh)_mm512_loadu_si512(vr + 32);
            __m512bh v2 = (__m512bh)_mm512_loadu_si512(vr + 64);
            __m512bh v3 = (__m512bh)_mm512_loadu_si512(vr + 96);
            for (int r = 0; r < 4; r++) {
                const uint32_t *wpairs = (const uint32_t *)(weights + (size_t)(r0 + r) * j->Sp);
                __m512bh wv = (__m512bh)_mm512_set1_epi32((int)wpairs[sp]);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], wv, v0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], wv, v1);
                acc[r][2] = _mm512_dpbf16_ps(acc[r][2], wv, v2);
                acc[r][3] = _mm512_dpbf16_ps(acc[r][3], wv, v3);
            }
        }
        for (int r = 0; r < 4 && r0 + r < rows; r++) {
            bf16 *o = j->out + ((size_t)b * j->S + i0 + r0 + r) * (size_t)(j->H * DH) + h * DH;
            __m512 sc = _mm512_set1_ps(inv[r0 + r]);
            for (int c = 0; c < 4; c++) {
                __m256bh ob = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[r][c], sc));
                _mm256_storeu_si256((__m256i *)(o + 16 * c), (__m256i)ob);
            }
        }
    }
}

static int take(int *counter, int limit) {
    int t = __atomic_fetch_add(counter, 1, __ATOMIC_RELAXED);
    return t < limit ? t : -1;
}

static void pack_all(job_t *j) {
    int t;
    while ((t = take(&j->next_pack, j->npack)) >= 0) pack(j, t);
}

static void attend_all(job_t *j) {
    float *scores = aligned_alloc(64, sizeof(float) * QBLOCK * (size_t)j->Sp);
    bf16 *weights = aligned_alloc(64, sizeof(bf16) * QBLOCK * (size_t)j->Sp);
    bf16 *qbuf = aligned_alloc(64, sizeof(bf16) * QBLOCK * DH);
    if (!scores || !weights || !qbuf) {
        __atomic_store_n(&j->failed, 1, __ATOMIC_RELAXED);
    } else {
        int t;
        while ((t = take(&j->next_task, j->ntasks)) >= 0) run_task(j, t, scores, weights, qbuf);
    }
    free(scores);
    free(weights);
    free(qbuf);
}

int rs_attention_bf16(const bf16 *q, const bf16 *k, const bf16 *v, bf16 *out, int B, int S, int H,
                      long qb, long qs, long kb, long ks, long vb, long vs, int threads) {
    job_t j;
    memset(&j, 0, sizeof j);
    j.q = q; j.k = k; j.v = v; j.out = out;
    j.qb = qb; j.qs = qs; j.kb = kb; j.ks = ks; j.vb = vb; j.vs = vs;
    j.B = B; j.S = S; j.H = H;
    j.Sp = (S + KBLOCK - 1) / KBLOCK * KBLOCK;
    j.npack = B * H;
    j.ntasks = B * H * ((S + QBLOCK - 1) / QBLOCK);
    j.kpack = aligned_alloc(64, sizeof(bf16) * (size_t)j.npack * j.Sp * DH);
    j.vpack = aligned_alloc(64, sizeof(bf16) * (size_t)j.npack * j.Sp * DH);
    int rc = 0;
    if (!j.kpack || !j.vpack) {
        rc = -1;
    } else {
        int n = threads < 1 ? 1 : threads;
#pragma omp parallel num_threads(n)
        pack_all(&j);
#pragma omp parallel num_threads(n)
        attend_all(&j);
        rc = j.failed ? -1 : 0;
    }
    free(j.kpack);
    free(j.vpack);
    return rc;
}
