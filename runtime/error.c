// The runtime's errors, for the training driver (main.c and its rooms, rt_trainer.h) and the
// file helpers (npy.c, safetensors.c, checkpoint.c) alike.
//
// An error on user input (a file, a flag, a checkpoint) never ends the process where it is
// found: the failing function records one sentence with rt_fail and returns -1, its callers
// unwind, and rt_main prints "moert: error: SENTENCE" once and returns non-zero.
//
// Running out of memory is not such an error: rt_alloc, rt_calloc and rt_strdup end the job with
// one sentence that says what needed how many bytes (rt_out_of_memory: on several ranks through
// rt_comm_abort, so that no rank waits forever for the one that stopped) and exit status 1. The
// same holds where a library allocates for us (cJSON building a header): its failure is ours.
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "moert.h"
#include "rt_internal.h"

static _Thread_local char last_error[1024];

int rt_fail(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(last_error, sizeof last_error, fmt, ap);
  va_end(ap);
  return -1;
}

const char *rt_last_error(void) {
  return last_error;
}

void rt_clear_error(void) {
  last_error[0] = '\0';
}

_Noreturn void rt_out_of_memory(size_t bytes, const char *what) {
  if (bytes == 0)
    rt_comm_abort("out of memory: %s", what);
  rt_comm_abort("out of memory: %s needs %zu bytes", what, bytes);
}

void *rt_alloc(size_t bytes, const char *what) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p)
    rt_out_of_memory(bytes, what);
  return p;
}

void *rt_calloc(size_t n, size_t size, const char *what) {
  void *p = calloc(n ? n : 1, size ? size : 1);
  if (!p)
    rt_out_of_memory(n * size, what);
  return p;
}

// MOERT_PLAIN_MEMORY=1 (bench/memory.sh's baseline): calloc'ed blocks, files read into memory,
// no touching ahead, as before.
bool rt_plain_memory(void) {
  static int plain = -1;
  if (plain < 0) {
    const char *v = getenv("MOERT_PLAIN_MEMORY");
    plain = v && strcmp(v, "1") == 0;
  }
  return plain;
}

static size_t big_length(size_t bytes) { return (bytes + RT_BIG_PAGE - 1) / RT_BIG_PAGE * RT_BIG_PAGE; }

void *rt_big_alloc(size_t bytes, const char *what) {
  if (bytes < RT_BIG_PAGE || rt_plain_memory())
    return rt_calloc(1, bytes, what);
  size_t len = big_length(bytes);
  // One huge page more than needed, then the unaligned head and the tail given back.
  unsigned char *p = mmap(NULL, len + RT_BIG_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED)
    rt_out_of_memory(bytes, what);
  uintptr_t at = ((uintptr_t)p + RT_BIG_PAGE - 1) & ~(uintptr_t)(RT_BIG_PAGE - 1);
  size_t head = at - (uintptr_t)p;
  if (head)
    munmap(p, head);
  if (RT_BIG_PAGE - head)
    munmap((unsigned char *)at + len, RT_BIG_PAGE - head);
  return (void *)at;
}

void rt_big_touch(void *p, size_t bytes) {
  if (rt_plain_memory() || bytes < RT_BIG_PAGE)
    return;
  // The whole pages inside the block, in chunks of RT_BIG_PAGE (the last one shorter).
  uintptr_t lo = ((uintptr_t)p + 4095) & ~(uintptr_t)4095, hi = ((uintptr_t)p + bytes) & ~(uintptr_t)4095;
  int64_t chunks = (int64_t)((hi - lo + RT_BIG_PAGE - 1) / RT_BIG_PAGE);
  RT_PARALLEL_FOR(true)
  for (int64_t i = 0; i < chunks; i++) {
    uintptr_t a = lo + (uintptr_t)i * RT_BIG_PAGE, e = a + RT_BIG_PAGE < hi ? a + RT_BIG_PAGE : hi;
#ifdef MADV_POPULATE_WRITE
    // The pages faulted in writable, their contents kept (Linux 5.14 on).
    if (madvise((void *)a, e - a, MADV_POPULATE_WRITE) == 0)
      continue;
#endif
    for (volatile unsigned char *c = (volatile unsigned char *)a; (uintptr_t)c < e; c += 4096)
      *c = *c;   // each access happens: the page's first touch, its byte kept
  }
}

void rt_big_free(void *p, size_t bytes) {
  if (!p)
    return;
  if (bytes < RT_BIG_PAGE || rt_plain_memory())
    free(p);
  else
    munmap(p, big_length(bytes));
}

char *rt_strdup(const char *s, const char *what) {
  size_t bytes = strlen(s) + 1;
  return memcpy(rt_alloc(bytes, what), s, bytes);
}
