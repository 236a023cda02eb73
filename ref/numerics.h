/* numerics.h - host-side bit-exact conversions shared by the references, the
 * checkpoint writer and the tests.  Storage types: bf16 is a uint16_t bit
 * pattern, e4m3 (float8_e4m3fn: no infinities, 0x7F/0xFF are NaN, max 448) a
 * uint8_t bit pattern, E8M0 a uint8_t biased exponent.  Spec §10.7, §8. */
#ifndef M3_NUMERICS_H
#define M3_NUMERICS_H

#include <math.h>
#include <stdint.h>
#include <string.h>

typedef uint16_t m3_bf16;
typedef uint8_t m3_e4m3;

static inline float m3_bf16_to_f32(m3_bf16 h) {
  uint32_t u = (uint32_t)h << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Round-to-nearest-even; NaN stays a (quiet) NaN. */
static inline m3_bf16 m3_f32_to_bf16(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return (m3_bf16)((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return (m3_bf16)(u >> 16);
}

static inline float m3_round_bf16(float f) { return m3_bf16_to_f32(m3_f32_to_bf16(f)); }

/* e4m3 -> f32, exact. */
static inline float m3_e4m3_to_f32(m3_e4m3 b) {
  int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  float v;
  if (e == 15 && m == 7) return NAN;
  if (e == 0) v = ldexpf((float)m, -9); /* subnormal: m * 2^-3 * 2^-6 */
  else v = ldexpf(1.0f + (float)m / 8.0f, e - 7);
  return s ? -v : v;
}

/* f32 -> e4m3 with saturation to +-448 and round-to-nearest-even
 * (__NV_SATFINITE semantics); NaN -> 0x7F. No finite input gives 0x7F/0xFF. */
static inline m3_e4m3 m3_f32_to_e4m3(float f) {
  if (isnan(f)) return 0x7f;
  uint8_t sign = signbit(f) ? 0x80 : 0;
  float a = fabsf(f);
  if (a >= 448.0f) return sign | 0x7e;
  /* Pick the quantum of a's binade: normals have 3 mantissa bits from 2^-6 up;
   * below 2^-6 the quantum is the subnormal step 2^-9. */
  int ex;
  frexpf(a, &ex);          /* a = fr * 2^ex, fr in [0.5,1) -> binade 2^(ex-1) */
  int e = ex - 1;
  if (e < -6) e = -6;
  float q = ldexpf(1.0f, e - 3);
  float r = nearbyintf(a / q) * q; /* default rounding mode is RNE; a/q exact */
  if (r > 448.0f) r = 448.0f;
  /* Encode r exactly. */
  if (r == 0.0f) return sign;
  int rex;
  frexpf(r, &rex);
  int re = rex - 1;
  if (re < -6) return sign | (uint8_t)(r / ldexpf(1.0f, -9)); /* subnormal */
  int m = (int)(r / ldexpf(1.0f, re) * 8.0f) - 8;
  return sign | (uint8_t)((re + 7) << 3) | (uint8_t)m;
}

static inline float m3_round_e4m3(float f) { return m3_e4m3_to_f32(m3_f32_to_e4m3(f)); }

/* E8M0 scale s -> 2^(s-127); s = 255 is NaN by the OCP MX spec. */
static inline float m3_e8m0_to_f32(uint8_t s) {
  return s == 255 ? NAN : ldexpf(1.0f, (int)s - 127);
}

#endif
