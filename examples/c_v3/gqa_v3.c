/*
 * gqa_v3.c: GQA flash-attention prefill behind the `_v3` C entry point, on host memory.
 *
 * The ABI is docs/c-abi.md's:
 *
 *   int gqa_flash_prefill_v3(const void *q, const void *k, const void *v, const void *sink,
 *                            void *out, int B, int Sq, int Hq, int Hkv, int d, int S_cap,
 *                            int past_len, int window, int sink_mode, float scale);
 *
 *   q    (B, Sq, Hq, d)      fp16, the chunk's queries; row i sits at position past_len + i
 *   k, v (B, Hkv, S_cap, d)  fp16, the KV cache (BNSH); rows [0, past_len + Sq) are valid
 *   sink (Hq,)               fp16 logits when sink_mode == 1, else unread (may be NULL)
 *   out  (B, Sq, Hq, d)      fp16, written only when the function returns 0
 *
 * sink_mode: 0 none, 1 per-head sink logits, 2 smooth softmax (a sink logit of 0).
 * window: -1 (none) or W >= 1 keys, the row's own key included (ONNX Runtime's
 * local_window_size). scale: multiplies q.k into the logit. Query head h reads KV head h / G,
 * G = Hq / Hkv.
 *
 * Returns 0 when it computed `out`, -1 when it declines (a head dim other than 64 or 128:
 * nothing is written), -2 for arguments that are not a valid call (nothing is written).
 * Everything is computed in fp32 (fp16 inputs widened, fp32 accumulation, one rounding to fp16
 * at the end).
 *
 * Build:  cc -O2 -shared -fPIC -o libgqa_v3.so gqa_v3.c -lm     (or: make)
 *
 * Fault switches, each compiled in only when its macro is defined, so the harness's tests can
 * check that it catches the bug:
 *   -DBROKEN_WINDOW          a window of W keys sees W - 1 (the first visible key dropped)
 *   -DDECLINE_WRITES_OUTPUT  a decline zero-fills `out` before returning -1
 *   -DDECLINE_AFTER_FIRST    only the first call in the process computes; later calls return -1
 */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t man = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0) {
        if (man == 0) {
            bits = sign;
        } else {  /* subnormal: normalise the mantissa */
            exp = 127 - 15 + 1;
            while (!(man & 0x400u)) {
                man <<= 1;
                exp--;
            }
            bits = sign | (exp << 23) | ((man & 0x3ffu) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | (man << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (man << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

/* Round to nearest, ties to even. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t a = x & 0x7fffffffu;
    if (a >= 0x7f800000u)  /* inf, or NaN (kept quiet) */
        return (uint16_t)(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u | ((a >> 13) & 0x3ffu) : 0u));
    if (a >= 0x477ff000u)  /* >= 65520 rounds to inf */
        return (uint16_t)(sign | 0x7c00u);
    if (a < 0x38800000u) {  /* below 2^-14: a subnormal half, or zero */
        if (a < 0x33000000u)  /* below 2^-25: rounds to zero */
            return (uint16_t)sign;
        uint32_t e = a >> 23;
        uint32_t m = (a & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e;
        uint32_t r = m >> shift, rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (r & 1u)))
            r++;
        return (uint16_t)(sign | r);
    }
    uint32_t r = a - 0x38000000u;  /* exponent rebiased from 127 to 15 */
    uint32_t h = r >> 13, rem = r & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++;
    return (uint16_t)(sign | h);
}

static float dot(const float *a, const float *b, int n) {
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f, s4 = 0.f, s5 = 0.f, s6 = 0.f, s7 = 0.f;
    for (int t = 0; t < n; t += 8) {  /* n is 64 or 128 */
        s0 += a[t] * b[t];
        s1 += a[t + 1] * b[t + 1];
        s2 += a[t + 2] * b[t + 2];
        s3 += a[t + 3] * b[t + 3];
        s4 += a[t + 4] * b[t + 4];
        s5 += a[t + 5] * b[t + 5];
        s6 += a[t + 6] * b[t + 6];
        s7 += a[t + 7] * b[t + 7];
    }
    return ((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7));
}

int gqa_flash_prefill_v3(const void *q_, const void *k_, const void *v_, const void *sink_,
                         void *out_, int B, int Sq, int Hq, int Hkv, int d, int S_cap,
                         int past_len, int window, int sink_mode, float scale) {
    const uint16_t *q = (const uint16_t *)q_, *k = (const uint16_t *)k_;
    const uint16_t *v = (const uint16_t *)v_, *sink = (const uint16_t *)sink_;
    uint16_t *out = (uint16_t *)out_;

    if (B < 1 || Sq < 1 || Hq < 1 || Hkv < 1 || d < 1 || Hq % Hkv || past_len < 0 ||
        S_cap < 1 || (long long)past_len + Sq > S_cap || window == 0 || window < -1 ||
        sink_mode < 0 || sink_mode > 2 || (sink_mode == 1 && !sink) || !(scale > 0.f) ||
        !isfinite(scale) || !q || !k || !v || !out)
        return -2;
#ifdef DECLINE_AFTER_FIRST
    static int calls = 0;
    if (calls++ > 0)
        return -1;
#endif
    if (d != 64 && d != 128) {
#ifdef DECLINE_WRITES_OUTPUT
        memset(out, 0, (size_t)B * Sq * Hq * d * sizeof(uint16_t));
#endif
        return -1;
    }

    const int G = Hq / Hkv, skv = past_len + Sq;
    float *kf = malloc((size_t)skv * d * sizeof(float));
    float *vf = malloc((size_t)skv * d * sizeof(float));
    float *qf = malloc((size_t)d * sizeof(float));
    float *acc = malloc((size_t)d * sizeof(float));
    float *s = malloc((size_t)skv * sizeof(float));
    if (!kf || !vf || !qf || !acc || !s) {
        free(kf), free(vf), free(qf), free(acc), free(s);
        return -2;
    }
    for (int b = 0; b < B; b++) {
        for (int kvh = 0; kvh < Hkv; kvh++) {
            const size_t base = ((size_t)b * Hkv + kvh) * (size_t)S_cap * d;
            for (size_t t = 0; t < (size_t)skv * d; t++) {  /* rows past skv are never read */
                kf[t] = half_to_float(k[base + t]);
                vf[t] = half_to_float(v[base + t]);
            }
            for (int g = 0; g < G; g++) {
                const int h = kvh * G + g;
                const float sig = sink_mode == 1 ? half_to_float(sink[h])
                                  : sink_mode == 2 ? 0.f : -INFINITY;
                for (int i = 0; i < Sq; i++) {
                    const int p = past_len + i;
                    int lo = 0;
                    if (window > 0) {
#ifdef BROKEN_WINDOW
                        lo = p - window + 2;
#else
                        lo = p - window + 1;
#endif
                        if (lo < 0)
                            lo = 0;
                    }
                    const size_t qo = (((size_t)b * Sq + i) * Hq + h) * d;
                    for (int t = 0; t < d; t++)
                        qf[t] = half_to_float(q[qo + t]);
                    float m = sig;
                    for (int j = lo; j <= p; j++) {
                        s[j] = scale * dot(qf, kf + (size_t)j * d, d);
                        if (s[j] > m)
                            m = s[j];
                    }
                    for (int t = 0; t < d; t++)
                        acc[t] = 0.f;
                    float l = 0.f;
                    if (m != -INFINITY) {  /* else the row sees nothing: it outputs 0 */
                        for (int j = lo; j <= p; j++) {
                            const float e = expf(s[j] - m);
                            const float *vj = vf + (size_t)j * d;
                            l += e;
                            for (int t = 0; t < d; t++)
                                acc[t] += e * vj[t];
                        }
                        if (sink_mode != 0)
                            l += expf(sig - m);  /* the denominator only; -inf adds 0 */
                    }
                    const float inv = l > 0.f ? 1.f / l : 0.f;
                    for (int t = 0; t < d; t++)
                        out[qo + t] = float_to_half(acc[t] * inv);
                }
            }
        }
    }
    free(kf), free(vf), free(qf), free(acc), free(s);
    return 0;
}
