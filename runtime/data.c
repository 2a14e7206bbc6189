// A language model's token data: a token file and its training and validation windows,
// synthetic windows when there is no file, windows given as an --input .npy; and the few
// formulas a language model's training loop needs beside them: sampling a token, the
// learning-rate schedule and the gradient clip factor.
//
// A window is L+1 tokens (L = seqlen): the model reads tokens 0..L-1 and position i's target is
// token i+1. A training window is a pure function of (seed, step, g), g the global index of the
// sample in its step (0 .. global batch - 1), never of the rank that reads it, so every parallel
// layout sees the same global batch. With the runtime's counter-based hash (moert.h), in uint64,
//
//   h(seed, step, g) = rt_key(rt_key(rt_key(seed, RT_STREAM_DATA = 5), step), g)
//
// - training window of sample g of step `step` in a file of N tokens: tokens [o, o + L], where
//   o = h(seed, step, g) mod (N - L), so every offset 0 .. N-L-1 can come and the window ends at
//   most at token N-1 (step and g as the caller passes them, as uint64);
// - validation window w: tokens [w*L, w*L + L], for w = 0 .. min(max_windows, (N-1) / L) - 1;
// - synthetic window (no file), vocab V >= 2: with s = h(seed, step, g) ^ 0x73796e7468657469
//   ("syntheti" in ASCII), start = s mod V, stride = 1 + (s >> 32) mod min(4, V - 1), token i is
//   (start + i * stride) mod V for i = 0 .. L. From the third on, each token follows from the
//   two before it, so a model that learns the rule drives the loss far below ln V, where a model
//   that does not stays.
//
// Token files: "bytes" is one token per byte (any file; V < 256 only when every byte is below
// it), "u16" is little-endian uint16 per token (nanoGPT's .bin, no header), "llmc" is llm.c's
// .bin: a header of 256 little-endian int32 (magic 20240520, version 1, token count N, the rest
// unused) and then N little-endian uint16 tokens. Without a format given, a file whose first
// int32 is llm.c's magic is llmc, else .txt/.text are bytes and the rest u16. The file is read
// whole, every token checked against V, and kept as uint16 (bytes widened).
//
// Sampling (rt_sample_token), in double: m = max_i l_i, e_i = exp((l_i - m) / T) with T the
// temperature, E_i = e_0 + ... + e_i summed in index order (numpy's cumsum), u =
// rt_uniform(key); the token is the first i with E_i / E_{V-1} > u (V-1 should rounding leave
// none). T <= 0 is argmax, ties to the lower index.
//
// Learning rate (rt_lr_at), t = step counted from 1, W = warmup, D = decay_steps:
//   t <= W (W > 0):        lr * t / W
//   D > W, W < t < D:      min_lr + 0.5 * (lr - min_lr) * (1 + cos(pi * (t - W) / (D - W)))
//   D > W, t >= D:         min_lr
//   otherwise (D <= 0 or D <= W: no decay): lr
#include "rt_internal.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

static const uint64_t synthetic_salt = 0x73796e7468657469ULL;

static uint64_t window_hash(uint64_t seed, int64_t step, int64_t g) {
  return rt_key(rt_key(rt_key(seed, RT_STREAM_DATA), (uint64_t)step), (uint64_t)g);
}

// ---- token files ----

enum { LLMC_MAGIC = 20240520, LLMC_VERSION = 1, LLMC_HEADER_INTS = 256 };

static int32_t int32_le(const unsigned char *p) {
  return (int32_t)((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 |
                   (uint32_t)p[3] << 24);
}

// The format named, or NULL when the name is unknown.
static const char *known_format(const char *format) {
  static const char *const formats[] = {"bytes", "u16", "llmc"};
  for (int i = 0; i < 3; i++)
    if (strcmp(format, formats[i]) == 0)
      return formats[i];
  return NULL;
}

// No format given: llmc when the file begins with llm.c's magic, else by extension (.txt and
// .text are bytes, anything else u16).
static const char *detect_format(FILE *f, const char *path) {
  unsigned char head[4];
  bool magic = fread(head, 1, 4, f) == 4 && int32_le(head) == LLMC_MAGIC;
  rewind(f);
  if (magic)
    return "llmc";
  const char *dot = strrchr(path, '.');
  const char *slash = strrchr(path, '/');
  bool text = dot && (!slash || dot > slash) &&
              (strcasecmp(dot, ".txt") == 0 || strcasecmp(dot, ".text") == 0);
  return text ? "bytes" : "u16";
}

static int read_failed(FILE *f, const char *path) {
  if (ferror(f))
    return rt_fail("cannot read token file '%s': %s", path, strerror(errno));
  return rt_fail("cannot read token file '%s': it ended early (changed while read?)", path);
}

// Reads n tokens of the given format from f into dst.
static int read_tokens(FILE *f, const char *path, bool bytes, uint16_t *dst, int64_t n) {
  if (!bytes)
    return fread(dst, 2, (size_t)n, f) == (size_t)n ? 0 : read_failed(f, path);
  unsigned char buf[1 << 14];
  for (int64_t done = 0; done < n;) {
    size_t want = n - done < (int64_t)sizeof buf ? (size_t)(n - done) : sizeof buf;
    if (fread(buf, 1, want, f) != want)
      return read_failed(f, path);
    for (size_t i = 0; i < want; i++)
      dst[done + i] = buf[i];
    done += (int64_t)want;
  }
  return 0;
}

static int check_vocab(const RtTokens *t, int64_t vocab) {
  for (int64_t i = 0; i < t->count; i++)
    if (t->tokens[i] >= vocab)
      return rt_fail("'%s': token %d at offset %lld (token index) is not below vocab %lld",
                     t->path, t->tokens[i], (long long)i, (long long)vocab);
  return 0;
}

// The file's size in bytes, or -1 with the reason recorded.
static int64_t file_size(FILE *f, const char *path) {
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0)
    return rt_fail("cannot read token file '%s': %s", path, strerror(errno));
  if (!S_ISREG(sb.st_mode))
    return rt_fail("token file '%s' is not a regular file", path);
  return (int64_t)sb.st_size;
}

// llm.c's header: its magic, version and token count against the file's size; leaves f at the
// first token.
static int read_llmc_header(FILE *f, const char *path, int64_t size, int64_t *count) {
  enum { HEADER_BYTES = 4 * LLMC_HEADER_INTS };
  unsigned char header[HEADER_BYTES];
  if (size < HEADER_BYTES)
    return rt_fail("llm.c token file '%s' has %lld bytes, fewer than its %d-byte header", path,
                   (long long)size, HEADER_BYTES);
  if (fread(header, 1, HEADER_BYTES, f) != HEADER_BYTES)
    return read_failed(f, path);
  int32_t magic = int32_le(header), version = int32_le(header + 4), n = int32_le(header + 8);
  int64_t holds = (size - HEADER_BYTES) / 2;
  if (magic != LLMC_MAGIC)
    return rt_fail("llm.c token file '%s' begins with %d, not llm.c's magic %d", path, magic,
                   LLMC_MAGIC);
  if (version != LLMC_VERSION)
    return rt_fail("llm.c token file '%s': version %d, this reader knows version %d", path,
                   version, LLMC_VERSION);
  if (n != holds || (size - HEADER_BYTES) % 2 != 0)
    return rt_fail("llm.c token file '%s' says %d tokens but holds %lld (%lld bytes after its "
                   "%d-byte header, 2 per token)", path, n, (long long)holds,
                   (long long)(size - HEADER_BYTES), HEADER_BYTES);
  *count = n;
  return 0;
}

static int load_open(RtTokens *t, FILE *f, const char *path, int64_t vocab, int64_t seqlen) {
  bool bytes = strcmp(t->format, "bytes") == 0, llmc = strcmp(t->format, "llmc") == 0;
  int64_t size = file_size(f, path);
  if (size < 0)
    return -1;
  if (llmc) {
    if (read_llmc_header(f, path, size, &t->count) != 0)
      return -1;
  } else if (!bytes && size % 2 != 0) {
    return rt_fail("token file '%s' has %lld bytes, an odd number; a u16 file holds 2 bytes "
                   "per token", path, (long long)size);
  } else {
    t->count = bytes ? size : size / 2;
  }
  if (t->count < seqlen + 1)
    return rt_fail("'%s' holds %lld tokens; a window needs seqlen+1 = %lld", path,
                   (long long)t->count, (long long)(seqlen + 1));
  t->tokens = rt_alloc((size_t)t->count * sizeof *t->tokens, "the tokens of a token file");
  if (read_tokens(f, path, bytes, t->tokens, t->count) != 0)
    return -1;
  return check_vocab(t, vocab);
}

int rt_tokens_load(RtTokens *t, const char *path, const char *format, int64_t vocab,
                   int64_t seqlen) {
  memset(t, 0, sizeof *t);
  if (format && !known_format(format))
    return rt_fail("unknown token file format '%s' for '%s'; use bytes, u16 or llmc", format,
                   path);
  if (vocab < 1 || seqlen < 1)
    return rt_fail("cannot load '%s': vocab %lld and seqlen %lld must be positive", path,
                   (long long)vocab, (long long)seqlen);
  FILE *f = fopen(path, "rb");
  if (!f)
    return rt_fail("cannot open token file '%s': %s", path, strerror(errno));
  t->path = rt_strdup(path, "a token file's name");
  t->format = format ? known_format(format) : detect_format(f, path);
  int status = load_open(t, f, path, vocab, seqlen);
  fclose(f);
  if (status != 0)
    rt_tokens_free(t);
  return status;
}

void rt_tokens_free(RtTokens *t) {
  free(t->tokens);
  free(t->path);
  memset(t, 0, sizeof *t);
}

// ---- windows ----

static void copy_window(const RtTokens *t, int64_t offset, int64_t seqlen, int32_t *dst) {
  for (int64_t i = 0; i <= seqlen; i++)
    dst[i] = t->tokens[offset + i];
}

void rt_tokens_train_window(const RtTokens *t, uint64_t seed, int64_t step, int64_t g,
                            int64_t seqlen, int32_t *dst) {
  uint64_t starts = (uint64_t)(t->count - seqlen);
  copy_window(t, (int64_t)(window_hash(seed, step, g) % starts), seqlen, dst);
}

int64_t rt_tokens_val_count(const RtTokens *t, int64_t seqlen, int64_t max_windows) {
  int64_t n = (t->count - 1) / seqlen;
  return max_windows > 0 && max_windows < n ? max_windows : n;
}

void rt_tokens_val_window(const RtTokens *t, int64_t w, int64_t seqlen, int32_t *dst) {
  copy_window(t, w * seqlen, seqlen, dst);
}

void rt_tokens_synthetic(uint64_t seed, int64_t step, int64_t g, int64_t seqlen, int64_t vocab,
                         int32_t *dst) {
  if (vocab < 2) {  // one token: nothing to choose
    memset(dst, 0, (size_t)(seqlen + 1) * sizeof *dst);
    return;
  }
  uint64_t s = window_hash(seed, step, g) ^ synthetic_salt;
  uint64_t strides = vocab - 1 < 4 ? (uint64_t)(vocab - 1) : 4;
  int64_t start = (int64_t)(s % (uint64_t)vocab);
  int64_t stride = 1 + (int64_t)((s >> 32) % strides);
  for (int64_t i = 0; i <= seqlen; i++)
    dst[i] = (int32_t)((start + i * stride) % vocab);
}

// ---- --input windows (.npy) ----

static int64_t npy_element(const RtArray *a, int64_t i) {
  switch (a->dtype) {
  case RT_DTYPE_I32: return ((const int32_t *)a->data)[i];
  case RT_DTYPE_I64: return ((const int64_t *)a->data)[i];
  case RT_DTYPE_U16: return ((const uint16_t *)a->data)[i];
  default: return -1;
  }
}

static int copy_npy_tokens(const char *path, const RtArray *a, int64_t cols, int64_t vocab,
                           int32_t *dst) {
  for (int64_t i = 0; i < a->numel; i++) {
    int64_t v = npy_element(a, i);
    if (v < 0 || v >= vocab)
      return rt_fail("'%s': token %lld at row %lld, column %lld is not in [0, %lld)", path,
                     (long long)v, (long long)(i / cols), (long long)(i % cols),
                     (long long)vocab);
    dst[i] = (int32_t)v;
  }
  return 0;
}

int rt_tokens_read_npy(const char *path, int64_t rows, int64_t cols, int64_t vocab,
                       int32_t *dst) {
  RtArray a;
  if (rt_npy_read(path, &a) != 0)
    return -1;
  int64_t dims[2] = {rows, cols};
  char want[160], got[160];
  int status;
  if (a.dtype != RT_DTYPE_I32 && a.dtype != RT_DTYPE_I64 && a.dtype != RT_DTYPE_U16)
    status = rt_fail("'%s' holds %s; expected int32 tokens (int64 and uint16 are accepted too; "
                     "save it with x.astype(np.int32))", path, rt_dtype_name(a.dtype));
  else if (a.rank != 2 || a.dims[0] != rows || a.dims[1] != cols)
    status = rt_fail("'%s' has shape %s; expected %s (global batch, seqlen+1)", path,
                     rt_shape_str(got, sizeof got, a.rank, a.dims),
                     rt_shape_str(want, sizeof want, 2, dims));
  else
    status = copy_npy_tokens(path, &a, cols, vocab, dst);
  rt_array_free(&a);
  return status;
}

// ---- sampling ----

static int32_t argmax(const float *logits, int vocab) {
  int32_t best = 0;
  for (int i = 1; i < vocab; i++)
    if (logits[i] > logits[best])
      best = i;
  return best;
}

int32_t rt_sample_token(const float *logits, int vocab, float temperature, uint64_t key) {
  int32_t best = argmax(logits, vocab);
  if (temperature <= 0)
    return best;
  // Two passes over the same sums instead of a buffer: the second E_i are the first's exactly.
  double m = logits[best], temp = temperature, total = 0;
  for (int i = 0; i < vocab; i++)
    total += exp(((double)logits[i] - m) / temp);
  double u = rt_uniform(key), running = 0;
  for (int i = 0; i < vocab; i++) {
    running += exp(((double)logits[i] - m) / temp);
    if (running / total > u)
      return i;
  }
  return vocab - 1;
}

// ---- the optimizer's schedule ----

double rt_lr_at(double lr, int64_t warmup, int64_t decay_steps, double min_lr, int64_t step) {
  double t = (double)step;
  if (warmup > 0 && step <= warmup)
    return lr * t / (double)warmup;
  int64_t w = warmup > 0 ? warmup : 0;
  if (decay_steps <= 0 || decay_steps <= w)
    return lr;
  if (step >= decay_steps)
    return min_lr;
  double progress = (t - (double)w) / (double)(decay_steps - w);
  return min_lr + 0.5 * (lr - min_lr) * (1.0 + cos(M_PI * progress));
}

double rt_clip_scale(double norm, double clip) {
  if (clip <= 0 || !isfinite(norm) || norm <= clip)
    return 1.0;
  return clip / norm;
}
