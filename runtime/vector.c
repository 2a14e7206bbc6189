// The vector paths of libmoert's vectorised kernels (rt_internal.h, RT_VECTOR_PATHS): which one
// runs, the widest this CPU has or the one MOERT_VECTOR names. A file of its own, on nothing but
// libc, so that tests/ref/moe_ref.py compiles runtime/rng.c with it alone.
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moert.h"
#include "rt_internal.h"

static const char *const vector_names[] = {"baseline", "avx2", "avx512"};

const char *rt_vector_name(RtVectorPath path) { return vector_names[path]; }

// The widest path this CPU runs (the baseline where the paths are not compiled).
static RtVectorPath widest_path(void) {
#ifdef RT_VECTOR_BUILT
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return RT_VECTOR_AVX512;
  if (__builtin_cpu_supports("avx2")) return RT_VECTOR_AVX2;
#endif
  return RT_VECTOR_BASELINE;
}

// MOERT_VECTOR's path, or -1 when it is unset, -2 when it names none.
static int named_path(void) {
  const char *env = getenv("MOERT_VECTOR");
  if (!env || !*env) return -1;
  for (int p = 0; p < 3; p++)
    if (strcmp(env, vector_names[p]) == 0) return p;
  return -2;
}

int rt_vector_check(char *why, size_t size) {
  int named = named_path();
  if (named == -2) {
    snprintf(why, size, "MOERT_VECTOR=%s names no vector path (avx512, avx2 or baseline)", getenv("MOERT_VECTOR"));
    return -1;
  }
  if (named > (int)widest_path()) {
#ifdef RT_VECTOR_BUILT
    const char *what = "CPU";
#else
    const char *what = "build of libmoert";
#endif
    snprintf(why, size, "MOERT_VECTOR=%s: this %s runs the %s path at most", vector_names[named], what,
             vector_names[widest_path()]);
    return -1;
  }
  return 0;
}

RtVectorPath rt_vector_path(void) {
  static _Atomic int path = -1;   // chosen on the first call
  int p = atomic_load_explicit(&path, memory_order_relaxed);
  if (p < 0) {
    int widest = (int)widest_path(), named = named_path();
    p = named >= 0 && named < widest ? named : widest;   // a path the CPU lacks: rt_vector_check refused it
    atomic_store_explicit(&path, p, memory_order_relaxed);
  }
  return (RtVectorPath)p;
}
