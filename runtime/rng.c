// Deterministic, counter-based randomness for data, parameter init and gate noise.
//
// Every random number is a pure function of a 64-bit key and an index, so what a rank draws
// does not depend on how many ranks there are or on the order work is done in. Keys are
// chained with rt_key (seed -> stream -> step -> layer ...), numbers come from splitmix64's
// finaliser. tests/ref reimplements these bit for bit in numpy: keep them exactly as
// documented in moert.h.
#include <math.h>

#include "moert.h"

uint64_t rt_mix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t rt_key(uint64_t a, uint64_t b) { return rt_mix(a ^ rt_mix(b)); }

// The top 24 bits, centred in their bucket: never 0 or 1 (so log(u) is finite), exact in double.
double rt_uniform(uint64_t h) { return ((double)(h >> 40) + 0.5) / 16777216.0; }

// Box-Muller, cosine branch only, so that element i depends on nothing but (key, i).
double rt_normal(uint64_t key, uint64_t i) {
  double u1 = rt_uniform(rt_key(key, 2 * i));
  double u2 = rt_uniform(rt_key(key, 2 * i + 1));
  return sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2);
}

uint64_t rt_hash_name(const char *s) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
    h ^= *p;
    h *= 0x100000001b3ULL;
  }
  return h;
}
