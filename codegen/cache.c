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
#include <dirent.h>
#include <sys/stat.h>
#include <utime.h>
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

// Two FNV-1a hashes of 64 bits with different offset bases, over each part's length and bytes.
CgCacheHash cg_cache_hash_begin(void) { return (CgCacheHash){{0xcbf29ce484222325ull, 0x84222325cbf29ce4ull}}; }

void cg_cache_hash_add(CgCacheHash *h, const void *data, size_t size) {
  const unsigned char *p = data;
  uint64_t len = size;
  for (int l = 0; l < 2; l++) {
    uint64_t x = h->h[l];
    for (int b = 0; b < 8; b++) x = (x ^ ((len >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    for (size_t j = 0; j < size; j++) x = (x ^ p[j]) * 0x100000001b3ull;
    h->h[l] = x;
  }
}

CgCacheKey cg_cache_hash_end(const CgCacheHash *h) {
  CgCacheKey k;
  snprintf(k.hex, sizeof k.hex, "%016llx%016llx", (unsigned long long)h->h[0], (unsigned long long)h->h[1]);
  return k;
}

CgCacheKey cg_cache_key(int n, const char *const *parts, const size_t *sizes) {
  CgCacheHash h = cg_cache_hash_begin();
  for (int i = 0; i < n; i++) cg_cache_hash_add(&h, parts[i], sizes[i]);
  return cg_cache_hash_end(&h);
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
    utime(path, NULL);   // used now: cg_cache_prune removes the least recently used first
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

// An entry of cg_cache_prune's listing.
typedef struct Entry {
  char name[80];
  off_t size;
  time_t used;
} Entry;

static int least_recent(const void *a, const void *b) {
  const Entry *x = a, *y = b;
  return x->used < y->used ? -1 : x->used > y->used;
}

void cg_cache_prune(const char *ext, size_t most) {
  char dir[4096], path[4200];
  if (!cache_dir(dir, sizeof dir)) return;
  DIR *dp = opendir(dir);
  if (!dp) return;
  Entry *e = NULL;
  size_t n = 0, cap = 0, total = 0, elen = strlen(ext);
  for (struct dirent *de; (de = readdir(dp));) {
    size_t len = strlen(de->d_name);
    struct stat st;
    if (len != 32 + 1 + elen || de->d_name[32] != '.' || strcmp(de->d_name + 33, ext) != 0) continue;
    snprintf(path, sizeof path, "%s/%s", dir, de->d_name);
    if (stat(path, &st) != 0) continue;
    if (n == cap) {
      Entry *grown = realloc(e, (cap = cap ? 2 * cap : 64) * sizeof *e);
      if (!grown) break;
      e = grown;
    }
    snprintf(e[n].name, sizeof e[n].name, "%s", de->d_name);
    e[n].size = st.st_size, e[n].used = st.st_mtime;
    total += (size_t)st.st_size;
    n++;
  }
  closedir(dp);
  if (total > most) {   // down to three quarters, the least recently used first
    qsort(e, n, sizeof *e, least_recent);
    for (size_t i = 0; i < n && total > most / 4 * 3; i++) {
      snprintf(path, sizeof path, "%s/%s", dir, e[i].name);
      if (unlink(path) == 0) total -= (size_t)e[i].size;
    }
  }
  free(e);
}
