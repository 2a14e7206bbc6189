// Deterministic, counter-based randomness for data, parameter init and gate noise.
//
// Every random number is a pure function of a 64-bit key and an index, so what a rank draws
// does not depend on how many ranks there are or on the order work is done in. Keys are
// chained with rt_key (seed -> stream -> step -> layer ...), numbers come from splitmix64's
// finaliser. tests/ref reimplements these bit for bit in numpy: keep them exactly as
// documented in moert.h.
#include <math.h>
#include <stdbool.h>
#include <string.h>

#include "rt_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

static inline uint64_t mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rt_mix(uint64_t z) { return mix(z); }

uint64_t rt_key(uint64_t a, uint64_t b) { return rt_mix(a ^ rt_mix(b)); }

// The top 24 bits, centred in their bucket: never 0 or 1 (so log(u) is finite), exact in double.
double rt_uniform(uint64_t h) { return ((double)(h >> 40) + 0.5) / 16777216.0; }

// Normal pair j of key: Box-Muller on one splitmix64 draw h = rt_mix(key + j * 0x9e3779b97f4a7c15),
// in float from +, -, *, /, sqrt and bit operations only, so that a loop of it vectorises and
// numpy (tests/ref/moe_ref.py) repeats it bit for bit:
//   a = h >> 41 (23 bits): ln u1 = ln((a + 0.5) 2^-23) = (e - 23) ln2 + ln f, where a + 0.5 = f 2^e,
//       f in [sqrt(1/2), sqrt(2)), ln f = 2 atanh(s), s = (f - 1) / (f + 1), by its series to s^9;
//   b = (h >> 17) & (2^24 - 1): quadrant q = b >> 22, angle psi = ((b mod 2^22 + 0.5) 2^-22 - 0.5) pi/2
//       in (-pi/4, pi/4), cos and sin of psi by their Taylor series to degrees 8 and 9;
//   r = sqrt(-2 ln u1); the pair is r (cos, sin) of q pi/2 + psi: (c, s), (-s, c), (-c, -s), (s, -c).
static inline __attribute__((always_inline)) void normal_pair(uint64_t key, uint64_t j, float *z0, float *z1) {
  uint64_t h = mix(key + j * 0x9e3779b97f4a7c15ULL);
  float x = (float)(int32_t)(h >> 41) + 0.5f;
  uint32_t xb;
  memcpy(&xb, &x, sizeof xb);
  int32_t e = (int32_t)(xb >> 23) - 127;
  uint32_t fb = (xb & 0x007fffffu) | 0x3f800000u;
  float f;
  memcpy(&f, &fb, sizeof f);
  bool big = f > 1.41421356f;
  f = big ? 0.5f * f : f;
  e = big ? e + 1 : e;
  float s = (f - 1.0f) / (f + 1.0f), s2 = s * s;
  float lf = 2.0f * s * (1.0f + s2 * (0.333333343f + s2 * (0.2f + s2 * (0.142857149f + s2 * 0.111111112f))));
  float ln_u1 = (float)(e - 23) * 0.693147182f + lf;
  float r = sqrtf(-2.0f * ln_u1);
  uint32_t b = (uint32_t)(h >> 17) & 0xffffffu, q = b >> 22;
  float psi = (((float)(b & 0x3fffffu) + 0.5f) * 2.38418579e-7f - 0.5f) * 1.57079633f, p2 = psi * psi;
  float c = 1.0f + p2 * (-0.5f + p2 * (4.16666679e-2f + p2 * (-1.38888892e-3f + p2 * 2.48015876e-5f)));
  float sn = psi * (1.0f + p2 * (-0.166666672f + p2 * (8.33333377e-3f + p2 * (-1.98412701e-4f + p2 * 2.75573188e-6f))));
  float cq = q == 0 ? c : q == 1 ? -sn : q == 2 ? -c : sn;
  float sq = q == 0 ? sn : q == 1 ? c : q == 2 ? -sn : -c;
  *z0 = r * cq;
  *z1 = r * sq;
}

double rt_normal(uint64_t key, uint64_t i) {
  float z0, z1;
  normal_pair(key, i >> 1, &z0, &z1);
  return (i & 1) ? z1 : z0;
}

// Pairs j0 .. j1-1 into out (out[0] is element 2 j0).
RT_VECTOR_BODY void normal_pairs_body(uint64_t key, uint64_t j0, uint64_t j1, float *out) {
  int64_t count = (int64_t)(j1 - j0);
RT_SIMD
  for (int64_t k = 0; k < count; k++)
    normal_pair(key, j0 + (uint64_t)k, &out[2 * k], &out[2 * k + 1]);
}
RT_VECTOR_PATHS(normal_pairs, (uint64_t key, uint64_t j0, uint64_t j1, float *out),
                (key, j0, j1, out))

void rt_normal_fill(uint64_t key, uint64_t first, int64_t n, float *out) {
  if (n <= 0) return;
  if (first & 1) {   // an odd first element: the second of its pair
    *out++ = (float)rt_normal(key, first++);
    n--;
  }
  uint64_t j0 = first >> 1, pairs = (uint64_t)n >> 1;
#ifdef _OPENMP
  if (n >= RT_PAR_MIN / 8) {
#pragma omp parallel
    {
      uint64_t t = (uint64_t)omp_get_thread_num(), nt = (uint64_t)omp_get_num_threads();
      uint64_t lo = pairs * t / nt, hi = pairs * (t + 1) / nt;
      normal_pairs(key, j0 + lo, j0 + hi, out + 2 * lo);
    }
  } else
#endif
    normal_pairs(key, j0, j0 + pairs, out);
  if (n & 1)   // an odd last element: the first of its pair
    out[n - 1] = (float)rt_normal(key, first + (uint64_t)n - 1);
}

uint64_t rt_hash_name(const char *s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ULL;
  }
  return h;
}
