// The thread pool of libmoert's kernels and OpenBLAS (rt_internal.h, RT_PARALLEL_FOR).
//
// With OpenMP (libmoert built with -fopenmp and linked against OpenBLAS's OpenMP build), the
// kernels' parallel loops and OpenBLAS's GEMMs run on the same OpenMP threads: while the main
// thread runs a kernel the others help, and none spins in OpenBLAS's own pool waiting for GEMMs
// (the pthread build's workers yield-spin for a long while after each GEMM). The size is set
// once: OMP_NUM_THREADS when the user sets it, else this process's cores (its affinity mask,
// which containers and `mpirun --bind-to` narrow) shared among the ranks of this node.
// The kernels' results do not depend on the size (rt_internal.h). GEMMs are split here, not by
// OpenBLAS (rt_matmul): OpenBLAS runs on one thread and each thread of the pool multiplies its
// own range of rows of the product. On this project's shapes that is 1.5-2x faster
// than OpenBLAS's threading below a few hundred million multiply-accumulates (its threads wait on
// each other inside every call) and as fast above. The pieces are rows of the product at
// multiples that OpenBLAS's Haswell (and Zen) and Prescott kernels treat alike, so there a
// product has the same bits in any number of pieces; SkylakeX's pick their kernels by the size of
// the call (runtime/kernels/ffn.c). OPENBLAS_NUM_THREADS, when set, bounds the number of pieces
// (1: every GEMM whole, the same bits on any pool with any kernels).
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "moert.h"
#include "rt_internal.h"

#ifdef _OPENMP
#include <omp.h>
#endif

void openblas_set_num_threads(int num_threads);  // OpenBLAS (cblas.h pulls in more than needed)
char *openblas_get_corename(void);

// OpenBLAS (a DYNAMIC_ARCH build, as Debian's) picks its kernels once, while it is loaded, from
// the CPU's family and model. A model newer than the library knows gets its oldest x86-64
// kernels, Prescott's (SSE3): Debian 12's 0.3.21 on this machine's Xeon (family 6, model 207,
// AVX-512) runs SGEMM at 16 GMAC/s a thread there against 76 with the SkylakeX kernels, and the
// mid-size language model of make bench took 2.9 s a step instead of 1.3. Told the kernel by
// OPENBLAS_CORETYPE, it uses it; the variable is read only at load time, so the process sets it
// and runs itself again with its own command line (before MPI or any thread starts). A user's
// OPENBLAS_CORETYPE is kept (tests/golden_runs.sh pins Haswell), as is any core OpenBLAS knew.
void rt_blas_kernels(void) {
  if (getenv("OPENBLAS_CORETYPE"))
    return;
  const char *core = openblas_get_corename();
  if (!core || strcasecmp(core, "prescott") != 0)
    return;
  __builtin_cpu_init();
  const char *want = __builtin_cpu_supports("avx512f") ? "SkylakeX" : __builtin_cpu_supports("avx2") ? "Haswell" : NULL;
  if (!want)
    return;
  // The process's own command line (a caller may have consumed arguments of its own before).
  static char line[1 << 16];
  char *args[1024];
  FILE *f = fopen("/proc/self/cmdline", "rb");
  size_t len = f ? fread(line, 1, sizeof line - 1, f) : 0;
  if (f)
    fclose(f);
  int n = 0;
  if (len > 0 && len < sizeof line - 1) {
    line[len] = '\0';
    for (size_t i = 0; i < len && n < 1023; i += strlen(line + i) + 1) args[n++] = line + i;
  }
  args[n] = NULL;
  if (n > 0 && n < 1023) {
    setenv("OPENBLAS_CORETYPE", want, 1);
    execv("/proc/self/exe", args);
  }
  fprintf(stderr, "moert: warning: OpenBLAS runs its Prescott kernels on this CPU (it does not know its model); "
                  "OPENBLAS_CORETYPE=%s would be faster, and running again with it failed\n", want);
}

static int gemm_pieces = 1;   // rt_gemm_pieces

static int usable_cores(void) {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof set, &set) == 0 && CPU_COUNT(&set) > 0) return CPU_COUNT(&set);
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? (int)n : 1;
}

int rt_threads_setup(long ranks_on_node) {
  const char *env = getenv("OMP_NUM_THREADS");
  int n;
  if (env && atoi(env) > 0) {
    n = atoi(env);
  } else {
    long share = usable_cores() / (ranks_on_node > 1 ? ranks_on_node : 1);
    n = share > 1 ? (int)share : 1;
  }
  // OPENBLAS_NUM_THREADS, when set, bounds the GEMMs' pieces alone.
  const char *blas = getenv("OPENBLAS_NUM_THREADS");
  int g = blas && atoi(blas) > 0 && atoi(blas) < n ? atoi(blas) : n;
#ifdef _OPENMP
  gemm_pieces = g;               // rt_matmul splits each GEMM over the pool
  openblas_set_num_threads(1);   // and OpenBLAS multiplies each piece on the calling thread
  // After OpenBLAS: its OpenMP build sets the pool's size to its own thread count (so that
  // OPENBLAS_NUM_THREADS=1 once ran every kernel on one thread too).
  omp_set_num_threads(n);
#else
  openblas_set_num_threads(g);   // no pool here: OpenBLAS's own threads
#endif
  return rt_threads();
}

int rt_gemm_pieces(void) { return gemm_pieces; }

int rt_threads(void) {
#ifdef _OPENMP
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void rt_team(void (*fn)(RtStep *), RtStep *st) {
  RT_PARALLEL(rt_threads() > 1)
  fn(st);
}
