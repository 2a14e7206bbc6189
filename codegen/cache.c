// The toolchain of codegen/ (beside layer 1): it calls nothing else in codegen/.
//
// The build cache of `moec build` (cg.h): results that are slow to compute and depend only on their
// inputs (NVRTC's images of a model's kernels: a second of compilation a build), kept as files named
// by a hash of those inputs. The directory: MOEC_CACHE when set ("off" or "0": no cache), else
// $XDG_CACHE_HOME/moec, else $HOME/.cache/moec. A file is written under a temporary name and renamed,
// so a reader sees it whole or not at all; a cache that cannot be read or written is no cache (the
// build computes the result, as without one).
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "cg.h"

// The directory (made if missing); false when there is none.
static bool cache_dir(char *buf, size_t size) {
  const char *env = getenv("MOEC_CACHE");
  if (env && (strcmp(env, "off") == 0 || strcmp(env, "0") == 0)) return false;
  const char *xdg = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
  int n;
  if (env && *env) n = snprintf(buf, size, "%s", env);
  else if (xdg && *xdg) n = snprintf(buf, size, "%s/moec", xdg);
  else if (home && *home) n = snprintf(buf, size, "%s/.cache/moec", home);
  else return false;
  if (n <= 0 || (size_t)n >= size) return false;
  // mkdir -p: each component of the path
  for (char *p = buf + 1; *p; p++) {
    if (*p != '/') continue;
    *p = '\0';
    bool made = mkdir(buf, 0755) == 0 || errno == EEXIST;
    *p = '/';
    if (!made) return false;
  }
  return mkdir(buf, 0755) == 0 || errno == EEXIST;
}

CgCacheKey cg_cache_key(int n, const char *const *parts, const size_t *sizes) {
  // Two FNV-1a hashes of 64 bits with different offset bases, over each part's length and bytes.
  uint64_t h[2] = {0xcbf29ce484222325ull, 0x84222325cbf29ce4ull};
  for (int i = 0; i < n; i++) {
    uint64_t len = sizes[i];
    for (int l = 0; l < 2; l++) {
      for (int b = 0; b < 8; b++) h[l] = (h[l] ^ ((len >> (8 * b)) & 0xff)) * 0x100000001b3ull;
      for (size_t j = 0; j < sizes[i]; j++) h[l] = (h[l] ^ (unsigned char)parts[i][j]) * 0x100000001b3ull;
    }
  }
  CgCacheKey k;
  snprintf(k.hex, sizeof k.hex, "%016llx%016llx", (unsigned long long)h[0], (unsigned long long)h[1]);
  return k;
}

static bool entry_path(const CgCacheKey *k, const char *ext, char *buf, size_t size) {
  char dir[4096];
  if (!cache_dir(dir, sizeof dir)) return false;
  int n = snprintf(buf, size, "%s/%s.%s", dir, k->hex, ext);
  return n > 0 && (size_t)n < size;
}

bool cg_cache_get(const CgCacheKey *k, const char *ext, void **data, size_t *size) {
  char path[4200];
  *data = NULL;
  *size = 0;
  if (!entry_path(k, ext, path, sizeof path)) return false;
  FILE *f = fopen(path, "rb");
  if (!f) return false;
  char *buf = NULL;
  long n = -1;
  if (fseek(f, 0, SEEK_END) == 0 && (n = ftell(f)) >= 0 && fseek(f, 0, SEEK_SET) == 0 && (buf = malloc(n ? n : 1)) &&
      fread(buf, 1, (size_t)n, f) == (size_t)n) {
    fclose(f);
    *data = buf;
    *size = (size_t)n;
    return true;
  }
  fclose(f);
  free(buf);
  return false;
}

void cg_cache_put(const CgCacheKey *k, const char *ext, const void *data, size_t size) {
  char path[4200], tmp[4300];
  if (!entry_path(k, ext, path, sizeof path)) return;
  snprintf(tmp, sizeof tmp, "%s.%ld.tmp", path, (long)getpid());
  FILE *f = fopen(tmp, "wb");
  if (!f) return;
  bool ok = fwrite(data, 1, size, f) == size;
  if (fclose(f) != 0) ok = false;
  if (!ok || rename(tmp, path) != 0) unlink(tmp);
}
