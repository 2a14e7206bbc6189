// Unit tests of a language model's token data and training formulas (runtime/data.c): token
// files (bytes, u16 and llm.c's) and their errors, training, validation and synthetic windows,
// --input token .npy files, sampling, the learning-rate schedule and the clip factor.
//
// Windows are checked against the formulas of data.c's header comment written out again here,
// on files whose token i is i, so that a window's first token is its offset.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "moert.h"
#include "rt_internal.h"

static char tmpdir[256];

// A path in the test's directory; 16 of them stay valid at a time.
static const char *tmp_path(const char *name) {
  static char buf[16][512];
  static int next;
  char *p = buf[next++ % 16];
  snprintf(p, 512, "%s/%s", tmpdir, name);
  return p;
}

static void write_bytes(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

// A u16 file whose token i is i (n <= 65536).
static const char *write_counting_u16(const char *name, int n) {
  const char *path = tmp_path(name);
  uint16_t *tokens = malloc((size_t)n * sizeof *tokens);
  for (int i = 0; i < n; i++)
    tokens[i] = (uint16_t)i;
  write_bytes(path, tokens, (size_t)n * sizeof *tokens);
  free(tokens);
  return path;
}

// The call fails and the recorded sentence is exactly `want`.
static void expect_load_error(const char *path, const char *format, int64_t vocab,
                              int64_t seqlen, const char *want) {
  RtTokens t;
  rt_clear_error();
  assert_int_equal(rt_tokens_load(&t, path, format, vocab, seqlen), -1);
  assert_string_equal(rt_last_error(), want);
  assert_null(t.tokens);
  assert_null(t.path);
}

static char *sentence(const char *fmt, const char *path, long long a, long long b, long long c) {
  static char buf[4][1024];
  static int next;
  char *s = buf[next++ % 4];
  snprintf(s, 1024, fmt, path, a, b, c);
  return s;
}

// ---- token files ----

static void test_load_bytes(void **state) {
  const char *path = tmp_path("corpus.txt");
  const char text[] = "hello, world\n\xff";
  write_bytes(path, text, sizeof text - 1);
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, path, NULL, 256, 4), 0);   // .txt: bytes
  assert_string_equal(t.format, "bytes");
  assert_string_equal(t.path, path);
  assert_int_equal(t.count, sizeof text - 1);
  for (int i = 0; i < t.count; i++)
    assert_int_equal(t.tokens[i], (unsigned char)text[i]);
  rt_tokens_free(&t);
  assert_null(t.tokens);

  const char *upper = tmp_path("CORPUS.TEXT");
  write_bytes(upper, text, sizeof text - 1);
  assert_int_equal(rt_tokens_load(&t, upper, NULL, 256, 4), 0);
  assert_string_equal(t.format, "bytes");
  rt_tokens_free(&t);

  // bytes with a vocab below 256: fine while every byte is below it.
  const char *ascii = tmp_path("ascii.bin");
  write_bytes(ascii, "abcdefgh", 8);
  assert_int_equal(rt_tokens_load(&t, ascii, "bytes", 128, 7), 0);
  assert_int_equal(t.count, 8);
  assert_int_equal(t.tokens[7], 'h');
  rt_tokens_free(&t);
}

static void test_load_u16(void **state) {
  const char *path = tmp_path("train.bin");
  uint16_t tokens[6] = {0, 1, 50256, 65535, 7, 300};
  write_bytes(path, tokens, sizeof tokens);
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, path, NULL, 65536, 5), 0);   // not .txt: u16
  assert_string_equal(t.format, "u16");
  assert_int_equal(t.count, 6);
  assert_memory_equal(t.tokens, tokens, sizeof tokens);
  rt_tokens_free(&t);

  // Little-endian on disk: 0x0102 is the bytes 02 01.
  const char *le = tmp_path("le.bin");
  write_bytes(le, "\x02\x01\x00\x00", 4);
  assert_int_equal(rt_tokens_load(&t, le, "u16", 65536, 1), 0);
  assert_int_equal(t.tokens[0], 0x0102);
  rt_tokens_free(&t);

  // The format given wins over the extension.
  assert_int_equal(rt_tokens_load(&t, path, "bytes", 256, 5), 0);
  assert_int_equal(t.count, 12);
  rt_tokens_free(&t);
}

static void test_load_errors(void **state) {
  const char *odd = tmp_path("odd.bin");
  write_bytes(odd, "\x01\x00\x02\x00\x03", 5);
  expect_load_error(odd, NULL, 256, 1,
                    sentence("token file '%s' has %lld bytes, an odd number; a u16 file holds "
                             "2 bytes per token", odd, 5, 0, 0));

  const char *shrt = tmp_path("short.bin");
  uint16_t three[3] = {1, 2, 3};
  write_bytes(shrt, three, sizeof three);
  expect_load_error(shrt, NULL, 256, 8,
                    sentence("'%s' holds %lld tokens; a window needs seqlen+1 = %lld", shrt, 3, 9,
                             0));
  expect_load_error(shrt, NULL, 256, 3,
                    sentence("'%s' holds %lld tokens; a window needs seqlen+1 = %lld", shrt, 3, 4,
                             0));
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, shrt, NULL, 256, 2), 0);   // exactly seqlen+1: fine
  rt_tokens_free(&t);

  const char *big = tmp_path("big.bin");
  uint16_t tokens[8] = {1, 2, 3, 4, 5, 300, 6, 7};
  write_bytes(big, tokens, sizeof tokens);
  expect_load_error(big, NULL, 256, 4,
                    sentence("'%s': token %lld at offset %lld (token index) is not below vocab "
                             "%lld", big, 300, 5, 256));
  expect_load_error(big, NULL, 300, 4,
                    sentence("'%s': token %lld at offset %lld (token index) is not below vocab "
                             "%lld", big, 300, 5, 300));
  assert_int_equal(rt_tokens_load(&t, big, NULL, 301, 4), 0);
  rt_tokens_free(&t);

  const char *text = tmp_path("small.txt");
  write_bytes(text, "abcz", 4);
  expect_load_error(text, NULL, 'z', 2,
                    sentence("'%s': token %lld at offset %lld (token index) is not below vocab "
                             "%lld", text, 'z', 3, 'z'));

  const char *missing = tmp_path("missing.bin");
  expect_load_error(missing, NULL, 256, 2,
                    sentence("cannot open token file '%s': No such file or directory", missing, 0,
                             0, 0));
  expect_load_error(tmpdir, NULL, 256, 2,
                    sentence("token file '%s' is not a regular file", tmpdir, 0, 0, 0));
  rt_clear_error();
  assert_int_equal(rt_tokens_load(&t, big, "u32", 256, 2), -1);
  assert_string_equal(rt_last_error(),
                      sentence("unknown token file format 'u32' for '%s'; use bytes, u16 or llmc",
                               big, 0, 0, 0));
}

// An llm.c token file: a header of 256 little-endian int32 (magic, version, count, zeros),
// then n uint16 tokens; the header's count need not be n.
static const char *write_llmc(const char *name, int32_t magic, int32_t version, int32_t count,
                              const uint16_t *tokens, int n) {
  const char *path = tmp_path(name);
  unsigned char *buf = calloc(1024 + 2 * (size_t)n, 1);
  int32_t head[3] = {magic, version, count};
  for (int i = 0; i < 3; i++)
    for (int b = 0; b < 4; b++)
      buf[4 * i + b] = (unsigned char)((uint32_t)head[i] >> (8 * b));
  for (int i = 0; i < n; i++) {
    buf[1024 + 2 * i] = (unsigned char)(tokens[i] & 0xff);
    buf[1024 + 2 * i + 1] = (unsigned char)(tokens[i] >> 8);
  }
  write_bytes(path, buf, 1024 + 2 * (size_t)n);
  free(buf);
  return path;
}

static void test_load_llmc(void **state) {
  uint16_t tokens[6] = {0, 1, 50256, 65535, 7, 300};
  const char *path = write_llmc("llmc.bin", 20240520, 1, 6, tokens, 6);
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, path, NULL, 65536, 5), 0);   // by its magic
  assert_string_equal(t.format, "llmc");
  assert_int_equal(t.count, 6);
  assert_memory_equal(t.tokens, tokens, sizeof tokens);
  rt_tokens_free(&t);
  assert_int_equal(rt_tokens_load(&t, path, "llmc", 65536, 5), 0);   // named
  assert_string_equal(t.format, "llmc");
  assert_memory_equal(t.tokens, tokens, sizeof tokens);
  rt_tokens_free(&t);
  // Named u16, the same file is 518 raw tokens, its header's ints among them.
  assert_int_equal(rt_tokens_load(&t, path, "u16", 65536, 5), 0);
  assert_int_equal(t.count, 518);
  assert_int_equal(t.tokens[0], 20240520 & 0xffff);
  rt_tokens_free(&t);
  // Without the magic the file is u16 by its extension.
  const char *plain = write_llmc("plain.bin", 12345, 1, 6, tokens, 6);
  assert_int_equal(rt_tokens_load(&t, plain, NULL, 65536, 5), 0);
  assert_string_equal(t.format, "u16");
  assert_int_equal(t.count, 518);
  rt_tokens_free(&t);
  // A .txt file that begins with the magic is llm.c's too: the header decides.
  const char *txt = write_llmc("llmc.txt", 20240520, 1, 6, tokens, 6);
  assert_int_equal(rt_tokens_load(&t, txt, NULL, 65536, 5), 0);
  assert_string_equal(t.format, "llmc");
  rt_tokens_free(&t);
}

static void test_load_llmc_errors(void **state) {
  uint16_t tokens[8] = {1, 2, 300, 4, 5, 6, 7, 8};
  const char *v2 = write_llmc("v2.bin", 20240520, 2, 8, tokens, 8);
  expect_load_error(v2, NULL, 65536, 4,
                    sentence("llm.c token file '%s': version %lld, this reader knows version "
                             "%lld", v2, 2, 1, 0));
  expect_load_error(v2, "llmc", 65536, 4,
                    sentence("llm.c token file '%s': version %lld, this reader knows version "
                             "%lld", v2, 2, 1, 0));
  const char *more = write_llmc("more.bin", 20240520, 1, 10, tokens, 8);
  expect_load_error(more, NULL, 65536, 4,
                    sentence("llm.c token file '%s' says %lld tokens but holds %lld (%lld bytes "
                             "after its 1024-byte header, 2 per token)", more, 10, 8, 16));
  const char *neg = write_llmc("neg.bin", 20240520, 1, -1, tokens, 8);
  expect_load_error(neg, NULL, 65536, 4,
                    sentence("llm.c token file '%s' says %lld tokens but holds %lld (%lld bytes "
                             "after its 1024-byte header, 2 per token)", neg, -1, 8, 16));
  // An odd byte after the tokens: the count matches the whole tokens, not the size.
  const char *odd = tmp_path("odd_llmc.bin");
  FILE *f = fopen(write_llmc("odd_llmc.bin", 20240520, 1, 8, tokens, 8), "ab");
  assert_non_null(f);
  fputc(0, f);
  fclose(f);
  expect_load_error(odd, NULL, 65536, 4,
                    sentence("llm.c token file '%s' says %lld tokens but holds %lld (%lld bytes "
                             "after its 1024-byte header, 2 per token)", odd, 8, 8, 17));
  const char *wrong = write_llmc("wrong.bin", 12345, 1, 8, tokens, 8);
  expect_load_error(wrong, "llmc", 65536, 4,
                    sentence("llm.c token file '%s' begins with %lld, not llm.c's magic %lld",
                             wrong, 12345, 20240520, 0));
  // Shorter than the header: named, or cut after the magic.
  const char *shrt = tmp_path("short_llmc.bin");
  const unsigned char head[8] = {0x88, 0xd8, 0x34, 0x01, 1, 0, 0, 0};   // 20240520, 1
  write_bytes(shrt, head, sizeof head);
  expect_load_error(shrt, NULL, 65536, 2,
                    sentence("llm.c token file '%s' has %lld bytes, fewer than its %lld-byte "
                             "header", shrt, 8, 1024, 0));
  expect_load_error(shrt, "llmc", 65536, 2,
                    sentence("llm.c token file '%s' has %lld bytes, fewer than its %lld-byte "
                             "header", shrt, 8, 1024, 0));
  // What holds for every token file holds here: enough tokens, each below vocab.
  const char *ok = write_llmc("ok.bin", 20240520, 1, 8, tokens, 8);
  expect_load_error(ok, NULL, 65536, 8,
                    sentence("'%s' holds %lld tokens; a window needs seqlen+1 = %lld", ok, 8, 9,
                             0));
  expect_load_error(ok, "llmc", 256, 4,
                    sentence("'%s': token %lld at offset %lld (token index) is not below vocab "
                             "%lld", ok, 300, 2, 256));
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, ok, NULL, 301, 7), 0);
  rt_tokens_free(&t);
}

// ---- windows ----

static uint64_t data_hash(uint64_t seed, int64_t step, int64_t g) {
  return rt_key(rt_key(rt_key(seed, 5), (uint64_t)step), (uint64_t)g);
}

static void test_train_windows(void **state) {
  enum { N = 1000, L = 16 };
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, write_counting_u16("count.bin", N), NULL, N, L), 0);
  int32_t a[L + 1], b[L + 1];
  int64_t first[8];
  for (int g = 0; g < 8; g++) {
    rt_tokens_train_window(&t, 42, 3, g, L, a);
    rt_tokens_train_window(&t, 42, 3, g, L, b);
    assert_memory_equal(a, b, sizeof a);                       // deterministic
    int64_t offset = a[0];
    assert_int_equal(offset, data_hash(42, 3, g) % (N - L));   // the documented formula
    for (int i = 0; i <= L; i++)
      assert_int_equal(a[i], offset + i);                      // consecutive tokens of the file
    first[g] = offset;
  }
  for (int g = 1; g < 8; g++)
    assert_int_not_equal(first[g], first[0]);                  // different g, other windows
  rt_tokens_train_window(&t, 42, 4, 0, L, a);
  assert_int_not_equal(a[0], first[0]);                        // other step, other windows
  rt_tokens_train_window(&t, 43, 3, 0, L, a);
  assert_int_not_equal(a[0], first[0]);                        // other seed, other windows
  rt_tokens_free(&t);

  // A short file: every offset 0 .. N-L-1 comes, never one past it.
  enum { SHORT = 20, SL = 4 };
  assert_int_equal(rt_tokens_load(&t, write_counting_u16("short20.bin", SHORT), NULL, SHORT, SL),
                   0);
  int seen[SHORT] = {0};
  int32_t w[SL + 1];
  for (int step = 1; step <= 100; step++)
    for (int g = 0; g < 20; g++) {
      rt_tokens_train_window(&t, 7, step, g, SL, w);
      assert_true(w[0] >= 0 && w[SL] <= SHORT - 1);
      seen[w[0]]++;
    }
  for (int o = 0; o < SHORT - SL; o++)
    assert_true(seen[o] > 0);
  for (int o = SHORT - SL; o < SHORT; o++)
    assert_int_equal(seen[o], 0);
  rt_tokens_free(&t);
}

static void test_val_windows(void **state) {
  enum { N = 1000, L = 64 };
  RtTokens t;
  assert_int_equal(rt_tokens_load(&t, write_counting_u16("val.bin", N), NULL, N, L), 0);
  assert_int_equal(rt_tokens_val_count(&t, L, 0), (N - 1) / L);
  assert_int_equal(rt_tokens_val_count(&t, L, -1), 15);
  assert_int_equal(rt_tokens_val_count(&t, L, 4), 4);
  assert_int_equal(rt_tokens_val_count(&t, L, 100), 15);
  int32_t w[L + 1];
  for (int k = 0; k < 15; k++) {
    rt_tokens_val_window(&t, k, L, w);
    for (int i = 0; i <= L; i++)
      assert_int_equal(w[i], k * L + i);   // stride L: window k+1 starts at window k's last token
  }
  rt_tokens_free(&t);

  // N - 1 a multiple of L: the last window ends at the last token.
  assert_int_equal(rt_tokens_load(&t, write_counting_u16("val129.bin", 129), NULL, 129, L), 0);
  assert_int_equal(rt_tokens_val_count(&t, L, 0), 2);
  rt_tokens_val_window(&t, 1, L, w);
  assert_int_equal(w[L], 128);
  rt_tokens_free(&t);
  assert_int_equal(rt_tokens_load(&t, write_counting_u16("val128.bin", 128), NULL, 128, L), 0);
  assert_int_equal(rt_tokens_val_count(&t, L, 0), 1);
  rt_tokens_free(&t);
}

static void test_synthetic(void **state) {
  enum { L = 32 };
  int32_t a[L + 1], b[L + 1];
  int strides[5] = {0};
  for (int64_t vocab = 2; vocab <= 50; vocab += 48)
    for (int g = 0; g < 64; g++) {
      rt_tokens_synthetic(9, 2, g, L, vocab, a);
      rt_tokens_synthetic(9, 2, g, L, vocab, b);
      assert_memory_equal(a, b, sizeof a);
      uint64_t s = data_hash(9, 2, g) ^ 0x73796e7468657469ULL;
      int64_t stride = 1 + (int64_t)((s >> 32) % (uint64_t)(vocab - 1 < 4 ? vocab - 1 : 4));
      assert_int_equal(a[0], s % (uint64_t)vocab);
      for (int i = 0; i < L; i++) {
        assert_true(a[i] >= 0 && a[i] < vocab);
        assert_int_equal(a[i + 1], (a[i] + stride) % vocab);   // arithmetic mod vocab
      }
      if (vocab == 50)
        strides[stride]++;
    }
  for (int s = 1; s <= 4; s++)
    assert_true(strides[s] > 0);
  rt_tokens_synthetic(9, 2, 0, L, 50, a);
  rt_tokens_synthetic(9, 2, 1, L, 50, b);
  assert_memory_not_equal(a, b, sizeof a);
  rt_tokens_synthetic(9, 3, 0, L, 50, b);
  assert_memory_not_equal(a, b, sizeof a);
}

// ---- --input tokens (.npy) ----

// The file's header (after the 10-byte prefix) starts with `want`, numpy's spelling.
static void expect_descr(const char *path, const char *want) {
  char head[128] = {0};
  FILE *f = fopen(path, "rb");
  assert_non_null(f);
  assert_int_equal(fread(head, 1, 10 + strlen(want), f), 10 + strlen(want));
  fclose(f);
  assert_string_equal(head + 10, want);
}

static void test_npy_tokens(void **state) {
  enum { ROWS = 3, COLS = 5, V = 10 };
  const char *path = tmp_path("tokens.npy");
  int64_t dims[2] = {ROWS, COLS};
  int32_t tokens[ROWS * COLS], back[ROWS * COLS];
  for (int i = 0; i < ROWS * COLS; i++)
    tokens[i] = (i * 7) % V;
  assert_int_equal(rt_npy_write(path, RT_DTYPE_I32, 2, dims, tokens), 0);
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), 0);
  assert_memory_equal(back, tokens, sizeof tokens);

  int64_t wide[ROWS * COLS];
  uint16_t narrow[ROWS * COLS];
  for (int i = 0; i < ROWS * COLS; i++) {
    wide[i] = tokens[i];
    narrow[i] = (uint16_t)tokens[i];
  }
  memset(back, 0, sizeof back);
  assert_int_equal(rt_npy_write(path, RT_DTYPE_I64, 2, dims, wide), 0);
  expect_descr(path, "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 5), }");
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), 0);
  assert_memory_equal(back, tokens, sizeof tokens);
  memset(back, 0, sizeof back);
  assert_int_equal(rt_npy_write(path, RT_DTYPE_U16, 2, dims, narrow), 0);
  expect_descr(path, "{'descr': '<u2', 'fortran_order': False, 'shape': (3, 5), }");
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), 0);
  assert_memory_equal(back, tokens, sizeof tokens);

  char want[1024];
  assert_int_equal(rt_npy_write(path, RT_DTYPE_I32, 2, dims, tokens), 0);
  assert_int_equal(rt_tokens_read_npy(path, COLS, ROWS, V, back), -1);
  snprintf(want, sizeof want, "'%s' has shape [3, 5]; expected [5, 3] (global batch, seqlen+1)",
           path);
  assert_string_equal(rt_last_error(), want);
  int64_t flat = ROWS * COLS;
  assert_int_equal(rt_npy_write(path, RT_DTYPE_I32, 1, &flat, tokens), 0);
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), -1);
  assert_non_null(strstr(rt_last_error(), "has shape [15]; expected [3, 5]"));

  float floats[ROWS * COLS] = {0};
  assert_int_equal(rt_npy_write(path, RT_DTYPE_F32, 2, dims, floats), 0);
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), -1);
  assert_non_null(strstr(rt_last_error(), "holds float32; expected int32 tokens"));

  tokens[1 * COLS + 2] = V;
  assert_int_equal(rt_npy_write(path, RT_DTYPE_I32, 2, dims, tokens), 0);
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), -1);
  snprintf(want, sizeof want, "'%s': token 10 at row 1, column 2 is not in [0, 10)", path);
  assert_string_equal(rt_last_error(), want);
  tokens[1 * COLS + 2] = 0;
  tokens[2 * COLS + 4] = -1;
  assert_int_equal(rt_npy_write(path, RT_DTYPE_I32, 2, dims, tokens), 0);
  assert_int_equal(rt_tokens_read_npy(path, ROWS, COLS, V, back), -1);
  assert_non_null(strstr(rt_last_error(), "token -1 at row 2, column 4 is not in [0, 10)"));
}

// ---- sampling ----

static void test_sample_argmax(void **state) {
  float logits[5] = {1, 3, 3, 2, -INFINITY};
  assert_int_equal(rt_sample_token(logits, 5, 0, 1), 1);    // ties to the lower index
  assert_int_equal(rt_sample_token(logits, 5, -1, 99), 1);
  float one[1] = {0};
  assert_int_equal(rt_sample_token(one, 1, 1, 5), 0);
  // -inf is never drawn.
  for (uint64_t k = 0; k < 1000; k++) {
    int32_t tok = rt_sample_token(logits, 5, 1.0f, rt_key(3, k));
    assert_true(tok >= 0 && tok < 4);
  }
}

static void test_sample_frequencies(void **state) {
  enum { V = 6, DRAWS = 20000 };
  float logits[V] = {0.0f, 1.0f, 2.0f, -1.0f, 0.5f, 1.5f};
  for (int pass = 0; pass < 2; pass++) {
    float temperature = pass == 0 ? 1.0f : 0.7f;
    double p[V], sum = 0;
    for (int i = 0; i < V; i++)
      sum += p[i] = exp((logits[i] - 2.0) / temperature);
    int count[V] = {0};
    for (int k = 0; k < DRAWS; k++) {
      int32_t tok = rt_sample_token(logits, V, temperature, rt_key(11 + pass, (uint64_t)k));
      assert_true(tok >= 0 && tok < V);
      count[tok]++;
    }
    for (int i = 0; i < V; i++)
      assert_true(fabs((double)count[i] / DRAWS - p[i] / sum) < 0.02);
  }
  assert_int_equal(rt_sample_token(logits, V, 1.0f, 77), rt_sample_token(logits, V, 1.0f, 77));
}

// ---- the optimizer's schedule ----

static void expect_near(double got, double want, double tolerance) {
  if (!(fabs(got - want) <= tolerance))
    fail_msg("got %.17g, expected %.17g (tolerance %g)", got, want, tolerance);
}

static void test_lr_schedule(void **state) {
  const double lr = 1e-3, min_lr = 1e-4, eps = 1e-15;
  // warmup 10, cosine to step 110
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 1), 1e-4, eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 5), 5e-4, eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 10), lr, eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 11),
                      min_lr + 0.5 * (lr - min_lr) * (1 + cos(M_PI * 0.01)), eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 60), 5.5e-4, eps);   // the middle
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 85),
                      min_lr + 0.5 * (lr - min_lr) * (1 - sqrt(0.5)), eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 109),
                      min_lr + 0.5 * (lr - min_lr) * (1 + cos(M_PI * 0.99)), eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 110), min_lr, eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 111), min_lr, eps);   // no cosine past D
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 160), min_lr, eps);
  expect_near(rt_lr_at(lr, 10, 110, min_lr, 1000), min_lr, eps);
  // no decay
  expect_near(rt_lr_at(lr, 10, 0, min_lr, 11), lr, eps);
  expect_near(rt_lr_at(lr, 10, 0, min_lr, 1000), lr, eps);
  expect_near(rt_lr_at(lr, 10, 10, min_lr, 1000), lr, eps);   // D <= W: no decay
  // neither
  expect_near(rt_lr_at(lr, 0, 0, min_lr, 1), lr, eps);
  expect_near(rt_lr_at(lr, 0, -5, min_lr, 7), lr, eps);
  // decay without warmup: the cosine starts at t = 0
  expect_near(rt_lr_at(lr, 0, 100, 0.0, 50), 0.5 * lr, eps);
  expect_near(rt_lr_at(lr, 0, 100, 0.0, 100), 0.0, eps);
}

static void test_clip_scale(void **state) {
  expect_near(rt_clip_scale(5.0, 1.0), 0.2, 1e-15);
  expect_near(rt_clip_scale(1.0, 1.0), 1.0, 0);
  expect_near(rt_clip_scale(0.5, 1.0), 1.0, 0);
  expect_near(rt_clip_scale(5.0, 0.0), 1.0, 0);
  expect_near(rt_clip_scale(5.0, -1.0), 1.0, 0);
  expect_near(rt_clip_scale(INFINITY, 1.0), 1.0, 0);
  expect_near(rt_clip_scale(NAN, 1.0), 1.0, 0);
  expect_near(rt_clip_scale(0.0, 1.0), 1.0, 0);
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  return remove(path);
}

static int setup(void **state) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/moert_data_XXXXXX");
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
  return nftw(tmpdir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_load_bytes),
      cmocka_unit_test(test_load_u16),
      cmocka_unit_test(test_load_errors),
      cmocka_unit_test(test_load_llmc),
      cmocka_unit_test(test_load_llmc_errors),
      cmocka_unit_test(test_train_windows),
      cmocka_unit_test(test_val_windows),
      cmocka_unit_test(test_synthetic),
      cmocka_unit_test(test_npy_tokens),
      cmocka_unit_test(test_sample_argmax),
      cmocka_unit_test(test_sample_frequencies),
      cmocka_unit_test(test_lr_schedule),
      cmocka_unit_test(test_clip_scale),
  };
  return cmocka_run_group_tests(tests, setup, teardown);
}
