// The built-in hook actions: compression (fp16, bf16, int8) and the record hook. The siblings of
// codegen/cuda/hook.cu (which also holds mk_record_stats, the record hook's statistics on the device).
//
// A `hook POINT compress T` compresses the tensor at POINT and decompresses it at the matching
// after-point, so the model computes on what survived the round trip (on one rank the bytes go
// nowhere; the point is that training sees the same rounding a compressed all-to-all would give).
// The conversions are done on the bits, not with _Float16 or compiler builtins, so that every
// build rounds the same way: round to nearest, ties to even, for both 16-bit formats; int8 is
// symmetric per-row quantisation with round-half-away-from-zero.
//
// The record hook appends one JSON line of statistics per tensor per step to st->record (a FILE
// that rt_main opens with --record), for watching activations and routing during training.
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "moert.h"

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

// Shifts m right by `shift` (1..31) and rounds the result to nearest, ties to even.
static uint32_t shift_round_even(uint32_t m, int shift) {
  uint32_t q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1)))
    q++;
  return q;
}

// ---- fp16: IEEE binary16, 1 sign, 5 exponent (bias 15), 10 mantissa bits ----

// A binary32 with biased exponent ex is 1.m * 2^(ex-127). Halves from 2^-14 up are normal
// (exponent ex - 112); below, the value counted in units of 2^-24 is (1.m * 2^23) * 2^(ex-126).
// A rounding carry out of the mantissa steps the exponent up, which also turns 65520 and above
// into infinity (0x7c00) as round-to-nearest-even requires.
static uint16_t half_from_float(float f) {
  uint32_t u = float_bits(f);
  uint16_t sign = (uint16_t)((u >> 16) & 0x8000);
  uint32_t a = u & 0x7fffffff, ex = a >> 23, mant = a & 0x7fffff;
  if (a > 0x7f800000)                        // NaN: keep it quiet and keep the top payload bits
    return sign | 0x7e00 | (uint16_t)(mant >> 13);
  if (a >= 0x47800000)                       // >= 2^16, or inf: certainly out of range
    return sign | 0x7c00;
  if (a >= 0x38800000) {                     // >= 2^-14: normal
    uint32_t h = ((ex - 112) << 10) | (mant >> 13);
    uint32_t rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
      h++;
    return sign | (uint16_t)h;
  }
  int shift = 126 - (int)ex;                 // >= 14 here
  if (shift > 24)                            // below 2^-25 (binary32 subnormals too): zero
    return sign;
  return sign | (uint16_t)shift_round_even(mant | 0x800000, shift);
}

static float float_from_half(uint16_t h) {
  uint32_t sign = (uint32_t)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (ex == 31)
    return bits_float(sign | 0x7f800000 | (mant << 13));
  if (ex == 0)                                // zero or subnormal: mant * 2^-24, exact
    return bits_float(sign | float_bits(ldexpf((float)mant, -24)));
  return bits_float(sign | ((ex + 112) << 23) | (mant << 13));
}

void rt_compress_f16(const float *x, uint16_t *q, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    q[i] = half_from_float(x[i]);
}

void rt_decompress_f16(const uint16_t *q, float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    x[i] = float_from_half(q[i]);
}

// ---- bf16: the top half of a binary32 ----

// Adding 0x7fff plus the lowest kept bit rounds to nearest even; a carry may ripple into the
// exponent, up to infinity. NaN is handled first so that rounding cannot turn it into inf.
void rt_compress_bf16(const float *x, uint16_t *q, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    uint32_t u = float_bits(x[i]);
    if ((u & 0x7fffffff) > 0x7f800000)
      q[i] = (uint16_t)((u >> 16) | 0x0040);
    else
      q[i] = (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
  }
}

void rt_decompress_bf16(const uint16_t *q, float *x, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    x[i] = bits_float((uint32_t)q[i] << 16);
}

// ---- int8: symmetric per-row quantisation ----

// scale = max|x| / 127 over the row (NaN ignored), 1 for a row with nothing but zeros.
// The maximum is taken with `>` (false for every NaN), not fmaxf: glibc's fmaxf returns NaN for
// a signalling NaN (IEEE 754-2008 maxNum), so a row holding one would get scale 1 here and a
// real scale wherever a max ignores all NaNs (numpy's SIMD reduction, a GPU's fmaxf).
void rt_int8_scales(const float *x, float *scale, int rows, int n) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    float mx = 0.0f;
    for (int i = 0; i < n; i++) {
      float a = fabsf(xr[i]);
      if (a > mx)
        mx = a;
    }
    scale[r] = mx > 0.0f ? mx / 127.0f : 1.0f;
  }
}

// NaN quantises to 0; the clamp guards against a scale from somewhere else.
void rt_compress_int8(const float *x, const float *scale, int8_t *q, int rows, int n) {
  for (int r = 0; r < rows; r++) {
    const float *xr = x + (size_t)r * n;
    int8_t *qr = q + (size_t)r * n;
    for (int i = 0; i < n; i++) {
      float v = roundf(xr[i] / scale[r]);
      if (isnan(v))
        v = 0.0f;
      qr[i] = (int8_t)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
    }
  }
}

void rt_decompress_int8(const int8_t *q, const float *scale, float *x, int rows, int n) {
  for (int r = 0; r < rows; r++) {
    const int8_t *qr = q + (size_t)r * n;
    float *xr = x + (size_t)r * n;
    for (int i = 0; i < n; i++)
      xr[i] = (float)qr[i] * scale[r];
  }
}

// ---- record ----

// JSON has no NaN or infinity; a non-finite statistic is written as null.
static void put_number(FILE *f, const char *key, double v) {
  if (isfinite(v))
    fprintf(f, ", \"%s\": %.9g", key, v);
  else
    fprintf(f, ", \"%s\": null", key);
}

// point is a hook point name (an identifier); anything JSON would need escaped is replaced.
void rt_record(RtStep *st, const char *point, int layer, const float *x, int64_t n) {
  if (!st || !st->record)
    return;
  double sum = 0.0, max_abs = 0.0;
  int64_t nans = 0;
  for (int64_t i = 0; i < n; i++) {
    sum += x[i];
    double a = fabs((double)x[i]);
    if (isnan(a))
      nans++;
    else if (a > max_abs)
      max_abs = a;
  }
  rt_record_stats(st, point, layer, n, sum, max_abs, nans);
}

void rt_record_stats(RtStep *st, const char *point, int layer, int64_t n, double sum,
                     double max_abs, int64_t nans) {
  if (!st || !st->record)
    return;
  FILE *f = st->record;
  if (nans > 0)
    max_abs = NAN;
  double mean = n > 0 ? sum / (double)n : 0.0;
  double dropped = st->routed > 0 ? (double)st->dropped / (double)st->routed : 0.0;
  fprintf(f, "{\"step\": %lld, \"layer\": %d, \"point\": \"", (long long)st->step, layer);
  for (const char *p = point ? point : ""; *p; p++)
    fputc(*p == '"' || *p == '\\' || (unsigned char)*p < 0x20 ? '_' : *p, f);
  fprintf(f, "\", \"numel\": %lld", (long long)n);
  put_number(f, "mean", mean);
  put_number(f, "max_abs", max_abs);
  put_number(f, "dropped", dropped);
  fputs("}\n", f);
}
