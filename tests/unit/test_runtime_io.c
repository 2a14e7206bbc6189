// Unit tests of libmoert's file I/O (.npy; safetensors, its dtypes and Hugging Face sets of
// files) and of the training driver rt_main.
//
// rt_main is driven with a model written here by hand: y = x·W with one parameter W [M, M]
// and loss mse(y, target). The synthetic teacher target = 0.5·x shifted by one channel is
// exactly such a linear map, so training must drive the loss down. Variants of the model
// check the rest: AdamW (for the optimizer moments in checkpoints), a backward scaled by 1.1
// (which --check-grad must reject), and a "router" that flips when W[0] crosses a threshold
// (which --check-grad must skip, not fail). rt_main runs in-process with stdout/stderr
// redirected to files, so LeakSanitizer sees its allocations too.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>

#include <cmocka.h>

#include <fcntl.h>
#include <ftw.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "moert.h"
#include "rt_internal.h"

// rt_main starts MPI through rt_comm_create and, when it started it, finalizes it on return; MPI
// cannot start twice in one process, so this test, which runs rt_main many times, starts MPI
// itself (a world of one) and rt_main leaves it alone.
#if __has_include(<mpi.h>)
#include <mpi.h>
#else
int MPI_Init(int *argc, char ***argv);
int MPI_Finalize(void);
#endif

static char tmpdir[256];

// A path in the test's directory; 64 of them stay valid at a time.
static const char *tmp_path(const char *name) {
  static char buf[64][512];
  static int next;
  char *p = buf[next++ % 64];
  snprintf(p, 512, "%s/%s", tmpdir, name);
  return p;
}

static bool file_exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

static char *read_text(const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *s = malloc((size_t)n + 1);
  size_t got = fread(s, 1, (size_t)n, f);
  s[got] = '\0';
  fclose(f);
  return s;
}

static void write_bytes(const char *path, const void *data, size_t n) {
  FILE *f = fopen(path, "wb");
  assert_non_null(f);
  assert_int_equal(fwrite(data, 1, n, f), n);
  fclose(f);
}

// ---- .npy ----

static void test_npy_f32_round_trip(void **state) {
  const char *path = tmp_path("a.npy");
  float data[24];
  for (int i = 0; i < 24; i++)
    data[i] = (float)i * 0.5f - 3.0f;
  int64_t dims[3] = {2, 3, 4};
  assert_int_equal(rt_npy_write(path, RT_DTYPE_F32, 3, dims, data), 0);
  // numpy's layout: 10-byte prefix + header padded to 64 bytes, then the data.
  char *text = read_text(path);
  assert_memory_equal(text, "\x93NUMPY\x01\x00", 8);
  int header_len = (unsigned char)text[8] | (unsigned char)text[9] << 8;
  assert_int_equal((10 + header_len) % 64, 0);
  assert_non_null(
      strstr(text + 10, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, 4), }"));
  assert_int_equal(text[10 + header_len - 1], '\n');
  free(text);

  RtArray a;
  assert_int_equal(rt_npy_read(path, &a), 0);
  assert_int_equal(a.dtype, RT_DTYPE_F32);
  assert_int_equal(a.rank, 3);
  assert_int_equal(a.dims[0], 2);
  assert_int_equal(a.dims[2], 4);
  assert_int_equal(a.numel, 24);
  assert_memory_equal(a.data, data, sizeof data);
  rt_array_free(&a);

  float back[24];
  assert_int_equal(rt_npy_read_f32(path, 3, dims, back), 0);
  assert_memory_equal(back, data, sizeof data);
}

static void test_npy_scalar_and_int(void **state) {
  const char *path = tmp_path("s.npy");
  double loss = 0.123456789012345;
  assert_int_equal(rt_npy_write(path, RT_DTYPE_F64, 0, NULL, &loss), 0);
  char *text = read_text(path);
  assert_non_null(strstr(text + 10, "'descr': '<f8'"));
  assert_non_null(strstr(text + 10, "'shape': ()"));
  free(text);
  RtArray a;
  assert_int_equal(rt_npy_read(path, &a), 0);
  assert_int_equal(a.dtype, RT_DTYPE_F64);
  assert_int_equal(a.rank, 0);
  assert_int_equal(a.numel, 1);
  assert_true(*(double *)a.data == loss);
  rt_array_free(&a);

  const char *ipath = tmp_path("i.npy");
  int32_t idx[5] = {3, -1, 0, 7, 2147483647};
  int64_t n = 5;
  assert_int_equal(rt_npy_write(ipath, RT_DTYPE_I32, 1, &n, idx), 0);
  text = read_text(ipath);
  assert_non_null(strstr(text + 10, "'descr': '<i4', 'fortran_order': False, 'shape': (5,), }"));
  free(text);
  assert_int_equal(rt_npy_read(ipath, &a), 0);
  assert_int_equal(a.dtype, RT_DTYPE_I32);
  assert_int_equal(a.rank, 1);
  assert_int_equal(a.dims[0], 5);
  assert_memory_equal(a.data, idx, sizeof idx);
  rt_array_free(&a);
}

// A .npy with a hand-written header (padded to 64 like numpy's) and data bytes.
static void write_npy_raw(const char *path, const char *dict, const void *data, size_t n) {
  char buf[256 + 4096];
  size_t len = strlen(dict);
  size_t header = (10 + len + 1 + 63) / 64 * 64 - 10;
  memcpy(buf, "\x93NUMPY\x01\x00", 8);
  buf[8] = (char)(header & 0xff);
  buf[9] = (char)(header >> 8);
  memcpy(buf + 10, dict, len);
  memset(buf + 10 + len, ' ', header - len - 1);
  buf[10 + header - 1] = '\n';
  memcpy(buf + 10 + header, data, n);
  write_bytes(path, buf, 10 + header + n);
}

static void expect_npy_error(const char *path, const char *fragment) {
  RtArray a;
  rt_clear_error();
  assert_int_not_equal(rt_npy_read(path, &a), 0);
  assert_null(a.data);
  if (!strstr(rt_last_error(), fragment))
    fail_msg("error '%s' does not mention '%s'", rt_last_error(), fragment);
}

static void test_npy_errors(void **state) {
  float data[6] = {0};
  int64_t dims[2] = {2, 3};
  const char *path = tmp_path("bad.npy");

  expect_npy_error(tmp_path("missing.npy"), "No such file or directory");

  write_npy_raw(path, "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", data,
                sizeof data);
  expect_npy_error(path, "Fortran order");

  write_npy_raw(path, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }", data,
                sizeof data - 4);
  expect_npy_error(path, "truncated");

  write_npy_raw(path, "{'descr': '<f2', 'fortran_order': False, 'shape': (2, 3), }", data,
                12);
  expect_npy_error(path, "dtype '<f2'");

  write_npy_raw(path, "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }", data,
                sizeof data);
  expect_npy_error(path, "big-endian");

  write_npy_raw(path, "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3, }", data,
                sizeof data);
  expect_npy_error(path, "shape");

  write_npy_raw(path, "{'descr': '<f4', 'shape': (2, 3), }", data, sizeof data);
  expect_npy_error(path, "fortran_order");

  write_npy_raw(path, "{'descr': '<f4', 'fortran_order': False, 'shape': (999999999999,), }",
                data, sizeof data);
  expect_npy_error(path, "truncated");

  write_bytes(path, "PK\x03\x04 not numpy", 15);
  expect_npy_error(path, "not a .npy file");

  // The typed reader names what it wanted.
  double d6[6] = {0};
  rt_npy_write(path, RT_DTYPE_F64, 2, dims, d6);
  rt_clear_error();
  assert_int_not_equal(rt_npy_read_f32(path, 2, dims, data), 0);
  assert_non_null(strstr(rt_last_error(), "holds float64; expected float32"));
  rt_npy_write(path, RT_DTYPE_F32, 2, dims, data);
  int64_t other[2] = {3, 2};
  assert_int_not_equal(rt_npy_read_f32(path, 2, other, data), 0);
  assert_non_null(strstr(rt_last_error(), "has shape [2, 3]; expected [3, 2]"));
}

// Every prefix of a valid file is rejected cleanly (ASan watches for overreads).
static void test_npy_every_truncation(void **state) {
  const char *path = tmp_path("t.npy"), *cut = tmp_path("cut.npy");
  float data[5] = {1, 2, 3, 4, 5};
  int64_t n = 5;
  assert_int_equal(rt_npy_write(path, RT_DTYPE_F32, 1, &n, data), 0);
  char *text = read_text(path);
  size_t size = 64 + sizeof data;
  for (size_t len = 0; len < size; len++) {
    write_bytes(cut, text, len);
    RtArray a;
    assert_int_not_equal(rt_npy_read(cut, &a), 0);
  }
  free(text);
}

// ---- safetensors ----

static void test_st_round_trip(void **state) {
  const char *path = tmp_path("w.safetensors");
  float a[6] = {1, 2, 3, 4, 5, 6}, b[3] = {-1.5f, 0.25f, 1e30f}, c = 42;
  int64_t da[2] = {2, 3}, db[1] = {3};
  RtStTensor tensors[3] = {
      {"block0.moe.gate.wg", 2, da, a}, {"b \"quoted\"", 1, db, b}, {"scalar", 0, NULL, &c}};
  const char *meta[] = {"format", "test", "step", "7"};
  assert_int_equal(rt_st_write(path, 3, tensors, 2, meta), 0);
  assert_false(file_exists(tmp_path("w.safetensors.tmp")));

  RtStFile f;
  assert_int_equal(rt_st_read(path, &f), 0);
  // Header length is a multiple of 8 and the data follows it directly.
  uint64_t header_len = 0;
  for (int i = 0; i < 8; i++)
    header_len |= (uint64_t)f.buffer[i] << (8 * i);
  assert_int_equal(header_len % 8, 0);
  assert_int_equal(f.size, 8 + header_len + sizeof a + sizeof b + sizeof c);
  assert_int_equal(f.ntensors, 3);
  const RtStEntry *t = rt_st_find(&f, "block0.moe.gate.wg");
  assert_non_null(t);
  assert_int_equal(t->rank, 2);
  assert_int_equal(t->dims[0], 2);
  assert_int_equal(t->dims[1], 3);
  float back[6];
  rt_st_copy(t, back);
  assert_memory_equal(back, a, sizeof a);
  t = rt_st_find(&f, "b \"quoted\"");
  assert_non_null(t);
  rt_st_copy(t, back);
  assert_memory_equal(back, b, sizeof b);
  t = rt_st_find(&f, "scalar");
  assert_non_null(t);
  assert_int_equal(t->rank, 0);
  assert_int_equal(t->numel, 1);
  assert_null(rt_st_find(&f, "nope"));
  assert_string_equal(rt_st_meta(&f, "format"), "test");
  assert_string_equal(rt_st_meta(&f, "step"), "7");
  assert_null(rt_st_meta(&f, "model"));
  rt_st_free(&f);

  // Overwriting replaces the file in one rename and leaves no temporary behind.
  assert_int_equal(rt_st_write(path, 1, tensors, 0, NULL), 0);
  assert_false(file_exists(tmp_path("w.safetensors.tmp")));
  assert_int_equal(rt_st_read(path, &f), 0);
  assert_int_equal(f.ntensors, 1);
  assert_int_equal(f.nmeta, 0);
  rt_st_free(&f);

  // A directory that does not exist: an error, nothing written.
  rt_clear_error();
  assert_int_not_equal(rt_st_write(tmp_path("no/such/dir.safetensors"), 1, tensors, 0, NULL),
                       0);
  assert_non_null(strstr(rt_last_error(), "cannot create"));
}

// A safetensors file with the given header text and data bytes.
static void write_st_raw(const char *path, const char *json, uint64_t declared_len,
                         const void *data, size_t n) {
  size_t len = strlen(json);
  unsigned char *buf = malloc(8 + len + n);
  for (int i = 0; i < 8; i++)
    buf[i] = (unsigned char)(declared_len >> (8 * i));
  memcpy(buf + 8, json, len);
  if (n)
    memcpy(buf + 8 + len, data, n);
  write_bytes(path, buf, 8 + len + n);
  free(buf);
}

static void expect_st_error(const char *json, size_t data_bytes, const char *fragment) {
  const char *path = tmp_path("bad.safetensors");
  static const unsigned char zeros[64];
  write_st_raw(path, json, strlen(json), zeros, data_bytes);
  RtStFile f;
  rt_clear_error();
  assert_int_not_equal(rt_st_read(path, &f), 0);
  assert_null(f.buffer);
  assert_null(f.tensors);
  if (!strstr(rt_last_error(), fragment))
    fail_msg("for header %s: error '%s' does not mention '%s'", json, rt_last_error(), fragment);
}

static void test_st_malformed(void **state) {
  const char *ok = "{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}";
  const char *path = tmp_path("bad.safetensors");
  RtStFile f;
  expect_st_error(ok, 4, "outside the file's 4 data bytes");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]", 8,
                  "not valid JSON");
  expect_st_error("[1, 2]", 0, "not a JSON object");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,16]}}", 16,
                  "needs 8 bytes but its data_offsets span 16");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,0]}}", 8,
                  "outside");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"b\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
                  12, "overlap");
  expect_st_error("{\"a\":{\"dtype\":\"I8\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
                  "tensor 'a' has dtype I8; only F32, F64, BF16 and F16 tensors are supported");
  expect_st_error("{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,8]}}", 8,
                  "needs 4 bytes but its data_offsets span 8");
  expect_st_error("{\"a\":{\"dtype\":\"F16\",\"shape\":[3],\"data_offsets\":[0,4]}}", 8,
                  "needs 6 bytes but its data_offsets span 4");
  expect_st_error("{\"a\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,8]}}", 16,
                  "needs 16 bytes but its data_offsets span 8");
  expect_st_error("{\"a\":{\"dtype\":\"F64\",\"shape\":[2],\"data_offsets\":[0,16]}}", 8,
                  "outside the file's 8 data bytes");
  expect_st_error("{\"a\":{\"dtype\":\"F64\",\"shape\":[3],\"data_offsets\":[0,8]}}", 8,
                  "does not fit in the file's 8 data bytes");
  expect_st_error("{\"a\":{\"dtype\":\"BF16\",\"shape\":[2],\"data_offsets\":[0,4]},"
                  "\"b\":{\"dtype\":\"F16\",\"shape\":[2],\"data_offsets\":[2,6]}}",
                  6, "overlap");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[-2],\"data_offsets\":[0,8]}}", 8,
                  "shape entry");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2.5],\"data_offsets\":[0,8]}}", 8,
                  "shape entry");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[4294967296,4294967296,4294967296],"
                  "\"data_offsets\":[0,8]}}",
                  8, "does not fit");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2]}}", 8, "data_offsets");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                  "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
                  16, "twice");
  expect_st_error("{\"__metadata__\":{\"step\":5}}", 0, "not a string");
  expect_st_error("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}} x", 8,
                  "text after");

  // Declared header length past the end of the file; a file shorter than 8 bytes.
  write_st_raw(path, ok, 1u << 20, NULL, 0);
  assert_int_not_equal(rt_st_read(path, &f), 0);
  assert_non_null(strstr(rt_last_error(), "truncated"));
  write_bytes(path, "\x10\x00\x00", 3);
  assert_int_not_equal(rt_st_read(path, &f), 0);
  assert_non_null(strstr(rt_last_error(), "fewer than the 8-byte"));
  assert_int_not_equal(rt_st_read(tmpdir, &f), 0);
  assert_non_null(strstr(rt_last_error(), "not a regular file"));
  assert_int_not_equal(rt_st_read(tmp_path("missing.safetensors"), &f), 0);
  assert_non_null(strstr(rt_last_error(), "No such file"));

  // Empty tensors and a header padded with spaces are fine.
  write_st_raw(path, "{\"e\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[0,0]}}   ",
               strlen("{\"e\":{\"dtype\":\"F32\",\"shape\":[0,3],\"data_offsets\":[0,0]}}   "),
               NULL, 0);
  assert_int_equal(rt_st_read(path, &f), 0);
  assert_int_equal(rt_st_find(&f, "e")->numel, 0);
  rt_st_free(&f);
}

// ---- safetensors dtypes ----

// One tensor of a hand-made safetensors file: its dtype's name and its raw little-endian bytes.
typedef struct RawTensor {
  const char *name, *dtype, *shape;   // shape: "8,8" for [8, 8]
  const void *bytes;
  size_t size;
} RawTensor;

// A safetensors file of the given tensors, their data in order, without padding (so that most
// tensors start unaligned).
static void write_st_tensors(const char *path, int n, const RawTensor *t) {
  char json[4096];
  size_t len = 0, total = 0;
  len += (size_t)snprintf(json + len, sizeof json - len, "{\"__metadata__\":{\"format\":\"pt\"}");
  for (int i = 0; i < n; i++) {
    len += (size_t)snprintf(json + len, sizeof json - len,
                            ",\"%s\":{\"dtype\":\"%s\",\"shape\":[%s],\"data_offsets\":[%zu,%zu]}",
                            t[i].name, t[i].dtype, t[i].shape, total, total + t[i].size);
    total += t[i].size;
  }
  snprintf(json + len, sizeof json - len, "}");
  unsigned char *data = malloc(total + 1);
  size_t at = 0;
  for (int i = 0; i < n; i++) {
    memcpy(data + at, t[i].bytes, t[i].size);
    at += t[i].size;
  }
  write_st_raw(path, json, strlen(json), data, total);
  free(data);
}

static uint32_t bits_of(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

// The value of a half and of a bfloat16 from their fields, in double: independent of the bit
// shuffling in safetensors.c.
static double half_value(uint16_t h) {
  int e = (h >> 10) & 31, m = h & 1023;
  double v = e == 0 ? ldexp(m, -24) : e == 31 ? (m ? NAN : INFINITY) : ldexp(1024 + m, e - 25);
  return h >> 15 ? -v : v;
}

static double bf16_value(uint16_t h) {
  int e = (h >> 7) & 255, m = h & 127;
  double v = e == 0 ? ldexp(m, -133) : e == 255 ? (m ? NAN : INFINITY) : ldexp(128 + m, e - 134);
  return h >> 15 ? -v : v;
}

// got is the value v exactly (the sign of a zero included), or a NaN when v is one.
static void expect_exact(float got, double v, const char *what, unsigned code) {
  if (isnan(v) ? !isnan(got) : ((double)got != v || !signbit(got) != !signbit(v)))
    fail_msg("%s 0x%04x: got %.9g (0x%08x), expected %.17g", what, code, got, bits_of(got), v);
}

// Every BF16 and every F16 value, converted exactly (subnormals, infinities, NaNs with their
// payload, negative zero); F64 rounded to the nearest float; the dtype of each entry.
static void test_st_dtypes(void **state) {
  enum { ALL = 65536 };
  unsigned char *halves = malloc(2 * ALL);
  for (int i = 0; i < ALL; i++) {
    halves[2 * i] = (unsigned char)(i & 0xff);
    halves[2 * i + 1] = (unsigned char)(i >> 8);
  }
  const double f64[] = {0.1, 1.0 + 0x1p-24, 1.0 + 3 * 0x1p-24, 1e40, -1e40, 0x1p-149, 0x1p-151,
                        -0.0, INFINITY, NAN, -2.5, 65504.0};
  const float f64_want[] = {0.1f, 1.0f, 1.0f + 0x1p-22f, INFINITY, -INFINITY, 0x1p-149f, 0.0f,
                            -0.0f, INFINITY, NAN, -2.5f, 65504.0f};
  enum { NF64 = sizeof f64 / sizeof f64[0] };
  unsigned char f64_bytes[8 * NF64];
  for (int i = 0; i < NF64; i++) {
    uint64_t u;
    memcpy(&u, &f64[i], 8);
    for (int b = 0; b < 8; b++)
      f64_bytes[8 * i + b] = (unsigned char)(u >> (8 * b));
  }
  const float f32[3] = {1.5f, -0.0f, 3e38f};
  const unsigned char one[2] = {0x01, 0x00};   // F16 2^-24
  _Static_assert(NF64 == 12, "the shape of tensor f64 below");
  // "one" moves every tensor after it off 4-byte alignment.
  RawTensor t[] = {{"empty", "BF16", "0", one, 0},
                   {"bf16", "BF16", "65536", halves, 2 * ALL},
                   {"one", "F16", "1", one, 2},
                   {"f16", "F16", "65536", halves, 2 * ALL},
                   {"f64", "F64", "12", f64_bytes, sizeof f64_bytes},
                   {"f32", "F32", "3", f32, sizeof f32}};
  const char *path = tmp_path("dtypes.safetensors");
  write_st_tensors(path, 6, t);
  free(halves);
  RtStFile f;
  assert_int_equal(rt_st_read(path, &f), 0);
  float *got = malloc(ALL * sizeof(float));

  const RtStEntry *e = rt_st_find(&f, "bf16");
  assert_int_equal(e->dtype, RT_ST_BF16);
  assert_string_equal(rt_st_dtype_name(e->dtype), "BF16");
  assert_int_equal(e->numel, ALL);
  rt_st_copy(e, got);
  for (unsigned h = 0; h < ALL; h++) {
    expect_exact(got[h], bf16_value((uint16_t)h), "bf16", h);
    assert_int_equal(bits_of(got[h]), h << 16);   // NaN payloads too: the upper half of a float
  }

  e = rt_st_find(&f, "f16");
  assert_int_equal(e->dtype, RT_ST_F16);
  assert_string_equal(rt_st_dtype_name(e->dtype), "F16");
  rt_st_copy(e, got);
  for (unsigned h = 0; h < ALL; h++) {
    expect_exact(got[h], half_value((uint16_t)h), "f16", h);
    if (isnan(got[h]))   // the sign and payload kept
      assert_int_equal(bits_of(got[h]), (h >> 15) << 31 | 0x7f800000u | (h & 1023) << 13);
  }
  assert_true(got[0x0001] == 0x1p-24f);              // the smallest subnormal
  assert_true(got[0x03ff] == 1023 * 0x1p-24f);       // the largest subnormal
  assert_true(got[0x0400] == 0x1p-14f);              // the smallest normal
  assert_true(got[0x7bff] == 65504.0f);              // the largest finite
  assert_true(got[0x3c00] == 1.0f && got[0xc000] == -2.0f);
  assert_true(isinf(got[0x7c00]) && got[0x7c00] > 0);
  assert_true(isinf(got[0xfc00]) && got[0xfc00] < 0);
  assert_true(isnan(got[0x7e00]) && isnan(got[0xfe01]));
  assert_true(got[0x8000] == 0.0f && signbit(got[0x8000]));
  e = rt_st_find(&f, "one");
  rt_st_copy(e, got);
  assert_true(got[0] == 0x1p-24f);

  e = rt_st_find(&f, "f64");
  assert_int_equal(e->dtype, RT_ST_F64);
  assert_string_equal(rt_st_dtype_name(e->dtype), "F64");
  rt_st_copy(e, got);
  for (int i = 0; i < NF64; i++) {
    if (isnan(f64_want[i]))
      assert_true(isnan(got[i]));
    else if (bits_of(got[i]) != bits_of(f64_want[i]))
      fail_msg("f64 %.17g: got %.9g, expected %.9g", f64[i], got[i], f64_want[i]);
  }
  assert_int_equal(bits_of(got[0]), 0x3dcccccd);   // 0.1 to the nearest float

  e = rt_st_find(&f, "f32");
  assert_int_equal(e->dtype, RT_ST_F32);
  rt_st_copy(e, got);
  assert_memory_equal(got, f32, sizeof f32);
  e = rt_st_find(&f, "empty");
  assert_int_equal(e->numel, 0);
  rt_st_copy(e, got);
  free(got);
  rt_st_free(&f);

  // Every other dtype of the format is refused by name.
  const char *other[] = {"I8", "U8", "I16", "U16", "I32", "U32", "I64", "U64", "BOOL",
                         "F8_E4M3", "F8_E5M2", "bf16"};
  for (size_t i = 0; i < sizeof other / sizeof other[0]; i++) {
    char json[160], want[160];
    snprintf(json, sizeof json, "{\"w\":{\"dtype\":\"%s\",\"shape\":[2],\"data_offsets\":[0,8]}}",
             other[i]);
    snprintf(want, sizeof want, "tensor 'w' has dtype %s; only F32, F64, BF16 and F16", other[i]);
    expect_st_error(json, 8, want);
  }
}

// ---- sets of files: Hugging Face indexes and folders ----

static void write_text(const char *path, const char *text) {
  write_bytes(path, text, strlen(text));
}

static void expect_set_error(const char *path, const char *fragment) {
  RtStSet s;
  rt_clear_error();
  assert_int_not_equal(rt_st_open(path, &s), 0);
  assert_int_equal(s.nfiles, 0);
  assert_null(s.files);
  assert_null(s.paths);
  assert_null(s.by_name);
  if (!strstr(rt_last_error(), fragment))
    fail_msg("opening %s: error '%s' does not mention '%s'", path, rt_last_error(), fragment);
}

// The index of the folder hf/: x and y in a.safetensors, z in b.safetensors, unless the map
// given says otherwise.
static const char *write_hf_index(const char *map) {
  const char *index = tmp_path("hf/model.safetensors.index.json");
  char text[1024];
  snprintf(text, sizeof text, "{\"metadata\": {\"total_size\": 40}, \"weight_map\": {%s}}", map);
  write_text(index, text);
  return index;
}

static void test_st_set(void **state) {
  mkdir(tmp_path("hf"), 0755);
  const float x[4] = {1, 2, 3, 4}, y[2] = {-1, 0.5f};
  const unsigned char z[4] = {0x80, 0x3f, 0x00, 0xc0};   // BF16 1.0, -2.0
  RawTensor a[2] = {{"x", "F32", "4", x, sizeof x}, {"y", "F32", "2", y, sizeof y}};
  RawTensor b[1] = {{"z", "BF16", "2", z, sizeof z}};
  write_st_tensors(tmp_path("hf/a.safetensors"), 2, a);
  write_st_tensors(tmp_path("hf/b.safetensors"), 1, b);
  const char *good = "\"x\": \"a.safetensors\", \"z\": \"b.safetensors\", \"y\": \"a.safetensors\"";
  const char *index = write_hf_index(good);
  const char *by[2] = {tmp_path("hf"), index};
  for (int k = 0; k < 2; k++) {   // by the folder, by the index
    RtStSet s;
    assert_int_equal(rt_st_open(by[k], &s), 0);
    assert_int_equal(s.nfiles, 2);   // each shard read once
    assert_int_equal(s.ntensors, 3);
    assert_string_equal(s.paths[0], tmp_path("hf/a.safetensors"));
    assert_string_equal(s.paths[1], tmp_path("hf/b.safetensors"));
    float got[4];
    const RtStEntry *t = rt_st_set_find(&s, "x");
    assert_non_null(t);
    rt_st_copy(t, got);
    assert_memory_equal(got, x, sizeof x);
    rt_st_copy(rt_st_set_find(&s, "y"), got);
    assert_memory_equal(got, y, sizeof y);
    t = rt_st_set_find(&s, "z");
    assert_int_equal(t->dtype, RT_ST_BF16);
    rt_st_copy(t, got);
    assert_true(got[0] == 1.0f && got[1] == -2.0f);
    assert_null(rt_st_set_find(&s, "w"));
    assert_null(rt_st_set_find(&s, ""));
    rt_st_set_free(&s);
    assert_int_equal(s.nfiles, 0);
  }

  // An index that begins with a UTF-8 byte order mark.
  RtStSet s;
  write_text(index, "\xef\xbb\xbf {\"weight_map\": {\"x\": \"a.safetensors\", "
                    "\"y\": \"a.safetensors\", \"z\": \"b.safetensors\"}}");
  assert_int_equal(rt_st_open(index, &s), 0);
  assert_int_equal(s.ntensors, 3);
  rt_st_set_free(&s);

  // One file, by its path or as a folder's model.safetensors.
  assert_int_equal(rt_st_open(tmp_path("hf/a.safetensors"), &s), 0);
  assert_int_equal(s.nfiles, 1);
  assert_int_equal(s.ntensors, 2);
  assert_string_equal(s.paths[0], tmp_path("hf/a.safetensors"));
  assert_non_null(rt_st_set_find(&s, "y"));
  assert_null(rt_st_set_find(&s, "z"));
  assert_string_equal(rt_st_meta(&s.files[0], "format"), "pt");
  rt_st_set_free(&s);
  mkdir(tmp_path("one"), 0755);
  write_st_tensors(tmp_path("one/model.safetensors"), 1, b);
  assert_int_equal(rt_st_open(tmp_path("one/"), &s), 0);
  assert_int_equal(s.nfiles, 1);
  assert_string_equal(s.paths[0], tmp_path("one/model.safetensors"));
  assert_non_null(rt_st_set_find(&s, "z"));
  rt_st_set_free(&s);

  // The folders: both files, neither.
  write_st_tensors(tmp_path("hf/model.safetensors"), 1, b);
  expect_set_error(tmp_path("hf"), "holds both model.safetensors and "
                                   "model.safetensors.index.json");
  remove(tmp_path("hf/model.safetensors"));
  mkdir(tmp_path("empty"), 0755);
  expect_set_error(tmp_path("empty"), "holds neither model.safetensors nor "
                                      "model.safetensors.index.json");
  expect_set_error(tmp_path("nowhere"), "cannot open '");

  // The index and the shards disagree.
  char want[1024];
  write_hf_index("\"x\": \"a.safetensors\", \"z\": \"a.safetensors\", \"y\": \"b.safetensors\"");
  snprintf(want, sizeof want, "index '%s' maps tensor 'y' to '%s', which does not hold it (it is "
           "in '%s')", index, tmp_path("hf/b.safetensors"), tmp_path("hf/a.safetensors"));
  expect_set_error(index, want);
  write_hf_index("\"x\": \"a.safetensors\", \"z\": \"b.safetensors\", \"y\": \"a.safetensors\", "
                 "\"w\": \"b.safetensors\"");
  snprintf(want, sizeof want, "index '%s' maps tensor 'w' to '%s', which does not hold it (nor "
           "does any other shard)", index, tmp_path("hf/b.safetensors"));
  expect_set_error(index, want);
  write_hf_index("\"x\": \"a.safetensors\", \"z\": \"b.safetensors\"");
  snprintf(want, sizeof want, "shard '%s' holds tensor 'y', which index '%s' does not list",
           tmp_path("hf/a.safetensors"), index);
  expect_set_error(tmp_path("hf"), want);
  RawTensor twice[2] = {{"z", "BF16", "2", z, sizeof z}, {"y", "F32", "2", y, sizeof y}};
  write_st_tensors(tmp_path("hf/b.safetensors"), 2, twice);
  write_hf_index(good);
  snprintf(want, sizeof want, "index '%s': tensor 'y' is in two shards, '%s' and '%s'", index,
           tmp_path("hf/a.safetensors"), tmp_path("hf/b.safetensors"));
  expect_set_error(index, want);
  write_st_tensors(tmp_path("hf/b.safetensors"), 1, b);
  write_hf_index("\"x\": \"a.safetensors\", \"z\": \"b.safetensors\", \"y\": \"a.safetensors\", "
                 "\"x\": \"a.safetensors\"");
  expect_set_error(index, "lists tensor 'x' twice");

  // Broken indexes and shards.
  write_hf_index("\"x\": \"a.safetensors\", \"z\": \"c.safetensors\", \"y\": \"a.safetensors\"");
  snprintf(want, sizeof want, "index '%s': cannot open '%s': No such file or directory", index,
           tmp_path("hf/c.safetensors"));
  expect_set_error(index, want);
  write_hf_index("\"x\": \"a.safetensors\", \"z\": 3");
  expect_set_error(index, "the \"weight_map\" entry of tensor 'z' is not a file name");
  write_hf_index("");
  expect_set_error(index, "its \"weight_map\" lists no tensors");
  write_text(index, "{\"metadata\": {}}");
  expect_set_error(tmp_path("hf"), "is neither a safetensors file nor a Hugging Face index");
  write_text(index, "{\"weight_map\": {\"x\": \"a.safetensors\"");
  expect_set_error(index, "is neither a safetensors file nor a Hugging Face index");
  RawTensor int8[1] = {{"q", "I8", "4", z, sizeof z}};
  write_st_tensors(tmp_path("hf/b.safetensors"), 1, int8);
  write_hf_index("\"x\": \"a.safetensors\", \"q\": \"b.safetensors\", \"y\": \"a.safetensors\"");
  snprintf(want, sizeof want, "index '%s': '%s': tensor 'q' has dtype I8", index,
           tmp_path("hf/b.safetensors"));
  expect_set_error(tmp_path("hf/"), want);
  // A shard with an absolute path is read where it says.
  char map[1024];
  write_st_tensors(tmp_path("hf/b.safetensors"), 1, b);
  snprintf(map, sizeof map, "\"x\": \"a.safetensors\", \"z\": \"%s\", \"y\": \"a.safetensors\"",
           tmp_path("one/model.safetensors"));
  write_hf_index(map);
  assert_int_equal(rt_st_open(index, &s), 0);
  assert_string_equal(s.paths[1], tmp_path("one/model.safetensors"));
  rt_st_set_free(&s);
}

// Every truncation and many single-byte corruptions of a valid file: errors, never crashes.
static void test_st_corruptions(void **state) {
  const char *path = tmp_path("c.safetensors"), *bad = tmp_path("cut.safetensors");
  float a[4] = {1, 2, 3, 4};
  int64_t dims[2] = {2, 2};
  RtStTensor tensors[2] = {{"x", 2, dims, a}, {"y", 2, dims, a}};
  const char *meta[] = {"k", "v"};
  assert_int_equal(rt_st_write(path, 2, tensors, 1, meta), 0);
  RtStFile f;
  assert_int_equal(rt_st_read(path, &f), 0);
  size_t size = f.size;
  unsigned char *orig = malloc(size);
  memcpy(orig, f.buffer, size);
  rt_st_free(&f);
  for (size_t len = 0; len < size; len++) {
    write_bytes(bad, orig, len);
    assert_int_not_equal(rt_st_read(bad, &f), 0);
  }
  unsigned char *copy = malloc(size);
  const unsigned char values[] = {0, '"', '{', '}', ',', '9', 0xff, ']', ' '};
  for (size_t pos = 0; pos < size; pos++)
    for (size_t v = 0; v < sizeof values; v++) {
      memcpy(copy, orig, size);
      copy[pos] = values[v];
      write_bytes(bad, copy, size);
      if (rt_st_read(bad, &f) == 0)
        rt_st_free(&f);
    }
  free(copy);
  free(orig);
}

// ---- rt_main on a hand-written model ----

enum { B = 2, L = 8, M = 8, S = B * L, N = S * M };

static float learning_rate = 2.0f;
static float backward_scale = 1.0f;
static float route_threshold = INFINITY;   // the "router" flips when W[route_index] > this
static int route_index;
static bool lin_moe;   // also route the tokens (dropless) and call the record hook

// A fixed dropless routing of the S = 16 tokens to 4 experts, k = 1: token t goes to expert
// t % 3, so the loads are 6, 5, 5, 0 and the capacity used is 6.
static void lin_route(RtStep *st, const float *out) {
  int32_t idx[S], loc[S];
  for (int t = 0; t < S; t++)
    idx[t] = t % 3;
  rt_gate_locations(idx, loc, st, S, 1, 4, 1, 0);
  rt_record(st, "before_dispatch", 0, out, N);
}

static void lin_forward(RtStep *st) {
  rt_step_begin_forward(st);
  float *out = (float *)st->arena;
  rt_matmul(st->input, st->params, out, S, M, M, false, false, false);
  if (st->params[route_index] > route_threshold) {   // a discontinuity, as a routing change makes one
    st->route_hash = 1;
    for (int i = 0; i < N; i++)
      out[i] += 1.0f;
  }
  if (lin_moe)
    lin_route(st, out);
  st->mse = rt_mse_value(out, st->target, N);
  st->output = out;
}

static void lin_backward(RtStep *st) {
  float *out = (float *)st->arena, *dout = out + N;
  rt_mse_grad(out, st->target, dout, N, 1.0f);
  rt_matmul(st->input, dout, st->grads, M, M, S, true, false, false);
  for (int i = 0; i < M * M; i++)
    st->grads[i] *= backward_scale;
}

static void lin_update_sgd(RtStep *st) {
  rt_sgd(st->params, st->grads, M * M, learning_rate, 0.0f, 1.0f, 1.0f);
}

static void lin_update_adamw(RtStep *st) {
  rt_adamw(st->params, st->grads, st->opt_m, st->opt_v, M * M, 0.05f, 0.9f, 0.999f, 1e-8f,
           0.01f, st->step, 1.0f, 1.0f);
}

static const RtParam lin_params[1] = {
    {.name = "lin.w", .rank = 2, .dims = {M, M}, .init = RT_INIT_NORMAL, .std = 0.1f,
     .offset = 0, .numel = M * M, .global_dims = {M, M}, .shard_ep = -1, .shard_esp = -1, .shard_mp = -1}};

static RtModel lin_model(RtOptKind opt) {
  return (RtModel){.name = "linear_test", .batch = B, .seqlen = L, .embed = M, .seed = 42,
                   .nparams = 1, .params = lin_params, .param_floats = M * M,
                   .arena_bytes = 2 * N * sizeof(float), .opt = opt, .nlayers = 0,
                   .layout = {1, 1, 1, 1, 1},
                   .forward = lin_forward, .backward = lin_backward,
                   .update = opt == RT_OPT_ADAMW ? lin_update_adamw : lin_update_sgd};
}

typedef struct Run {
  int rc;
  char *out, *err;
} Run;

static void run_free(Run *r) {
  free(r->out);
  free(r->err);
}

// Runs rt_main(model, "model", args..., NULL) with stdout and stderr captured.
static Run run_main(const RtModel *model, ...) {
  char *argv[32] = {"model"};
  int argc = 1;
  va_list ap;
  va_start(ap, model);
  for (char *a; (a = va_arg(ap, char *)) != NULL;)
    argv[argc++] = a;
  va_end(ap);
  char out_path[512], err_path[512];
  snprintf(out_path, sizeof out_path, "%s/stdout.txt", tmpdir);
  snprintf(err_path, sizeof err_path, "%s/stderr.txt", tmpdir);
  fflush(stdout);
  fflush(stderr);
  int saved_out = dup(1), saved_err = dup(2);
  int fo = open(out_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  int fe = open(err_path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
  dup2(fo, 1);
  dup2(fe, 2);
  Run r;
  r.rc = rt_main(model, argc, argv);
  fflush(stdout);
  fflush(stderr);
  dup2(saved_out, 1);
  dup2(saved_err, 2);
  close(fo);
  close(fe);
  close(saved_out);
  close(saved_err);
  r.out = read_text(out_path);
  r.err = read_text(err_path);
  return r;
}

// The per-step lines without their time field, concatenated, from step `from` on.
static char *step_lines(const char *out, int from) {
  char *res = calloc(strlen(out) + 1, 1);
  for (const char *line = out; *line;) {
    const char *end = strchr(line, '\n');
    size_t len = end ? (size_t)(end - line) : strlen(line);
    int step;
    if (sscanf(line, "step %d ", &step) == 1 && step >= from) {
      const char *time = strstr(line, "  time ");
      assert_non_null(time);
      assert_true(time < line + len);
      strncat(res, line, (size_t)(time - line));
      strcat(res, "\n");
    }
    line += len + (end != NULL);
  }
  return res;
}

static double step_loss(const char *out, int step) {
  char key[32];
  snprintf(key, sizeof key, "step %d  loss ", step);
  const char *p = strstr(out, key);
  if (!p)
    fail_msg("no line for step %d in:\n%s", step, out);
  return strtod(p + strlen(key), NULL);
}

static void test_main_trains(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  Run r = run_main(&model, "--steps", "30", NULL);
  assert_int_equal(r.rc, 0);
  assert_string_equal(r.err, "");
  // The exact line format of lang/manual.md §12; no MoE layer: no aux or z in the objective,
  // load 0/0.0/0, no capacity.
  double loss, mse, dropped, load_mean, ms;
  long long load_min, load_max;
  int step;
  const char *first = strstr(r.out, "step 1 ");
  assert_non_null(first);
  assert_int_equal(sscanf(first, "step %d  loss %lf  mse %lf  dropped %lf  "
                                 "load min/mean/max %lld/%lf/%lld  time %lf ms", &step, &loss, &mse,
                          &dropped, &load_min, &load_mean, &load_max, &ms),
                   8);
  assert_true(loss == mse && dropped == 0 && ms >= 0);
  assert_true(load_min == 0 && load_mean == 0 && load_max == 0);
  assert_null(strstr(r.out, "capacity"));
  double l1 = step_loss(r.out, 1), l30 = step_loss(r.out, 30);
  assert_true(l30 < 0.1 * l1);
  assert_non_null(strstr(r.out, "# trained 30 steps; final loss"));
  run_free(&r);

  // --quiet: no step lines.
  r = run_main(&model, "--steps", "3", "--quiet", NULL);
  assert_int_equal(r.rc, 0);
  assert_null(strstr(r.out, "step 1 "));
  run_free(&r);
}

static void test_main_deterministic(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  Run a = run_main(&model, "--steps", "8", NULL);
  Run b = run_main(&model, "--steps", "8", NULL);
  assert_int_equal(a.rc, 0);
  assert_int_equal(b.rc, 0);
  char *la = step_lines(a.out, 1), *lb = step_lines(b.out, 1);
  assert_true(strlen(la) > 0);
  assert_string_equal(la, lb);
  // A different seed gives different data.
  model.seed = 43;
  Run c = run_main(&model, "--steps", "8", NULL);
  char *lc = step_lines(c.out, 1);
  assert_string_not_equal(la, lc);
  free(la);
  free(lb);
  free(lc);
  run_free(&a);
  run_free(&b);
  run_free(&c);
}

// The one shard file a checkpoint written by one rank has.
static const char *shard_of(const char *checkpoint) {
  static char buf[4][600];
  static int next;
  char *p = buf[next++ % 4];
  snprintf(p, 600, "%s.rank0-of-1.safetensors", checkpoint);
  return p;
}

static void assert_same_tensors(const char *pa, const char *pb) {
  RtStFile a, b;
  assert_int_equal(rt_st_read(pa, &a), 0);
  assert_int_equal(rt_st_read(pb, &b), 0);
  assert_int_equal(a.ntensors, b.ntensors);
  for (int i = 0; i < a.ntensors; i++) {
    const RtStEntry *t = rt_st_find(&b, a.tensors[i].name);
    assert_non_null(t);
    assert_int_equal(t->numel, a.tensors[i].numel);
    assert_memory_equal(t->bytes, a.tensors[i].bytes, (size_t)t->numel * sizeof(float));
  }
  rt_st_free(&a);
  rt_st_free(&b);
}

static void test_main_resume(void **state) {
  for (int opt = 0; opt < 2; opt++) {
    RtModel model = lin_model(opt ? RT_OPT_ADAMW : RT_OPT_SGD);
    const char *full = tmp_path("full.safetensors"), *half = tmp_path("half.safetensors"),
               *resumed = tmp_path("resumed.safetensors");
    Run a = run_main(&model, "--steps", "10", "--save", full, NULL);
    Run b = run_main(&model, "--steps", "5", "--save", half, NULL);
    Run c = run_main(&model, "--resume", half, "--steps", "10", "--save", resumed, NULL);
    assert_int_equal(a.rc, 0);
    assert_int_equal(b.rc, 0);
    if (c.rc != 0)
      fail_msg("resume failed: %s", c.err);
    assert_false(file_exists(tmp_path("half.safetensors.tmp")));
    assert_null(strstr(c.out, "step 5 "));
    char *la = step_lines(a.out, 6), *lc = step_lines(c.out, 1);
    assert_true(strlen(la) > 0);
    assert_string_equal(la, lc);
    assert_false(file_exists(tmp_path("half.safetensors.rank0-of-1.safetensors.tmp")));
    assert_same_tensors(shard_of(full), shard_of(resumed));

    // The index names the shard; the shard labels every tensor with its box.
    char *index = read_text(half);
    assert_non_null(index);
    assert_non_null(strstr(index, "\"format\": \"moec-checkpoint-2\""));
    assert_non_null(strstr(index, "\"step\": 5"));
    assert_non_null(strstr(index, "\"world\": 1"));
    assert_non_null(strstr(index, "\"half.safetensors.rank0-of-1.safetensors\""));
    free(index);
    RtStFile f;
    assert_int_equal(rt_st_read(shard_of(half), &f), 0);
    assert_string_equal(rt_st_meta(&f, "format"), "moec-checkpoint-2");
    assert_string_equal(rt_st_meta(&f, "step"), "5");
    assert_string_equal(rt_st_meta(&f, "model"), "linear_test");
    assert_string_equal(rt_st_meta(&f, "optimizer"), opt ? "adamw" : "sgd");
    assert_string_equal(rt_st_meta(&f, "layout"), "dp=1 mp=1 ep=1 esp=1");
    assert_string_equal(rt_st_meta(&f, "shard.lin.w"), "global=[8,8] offset=[0,0]");
    assert_non_null(rt_st_find(&f, "lin.w"));
    assert_int_equal(rt_st_find(&f, "opt.m.lin.w") != NULL, opt == 1);
    assert_int_equal(rt_st_find(&f, "opt.v.lin.w") != NULL, opt == 1);
    if (opt)
      assert_string_equal(rt_st_meta(&f, "shard.opt.v.lin.w"), "global=[8,8] offset=[0,0]");
    rt_st_free(&f);
    free(la);
    free(lc);
    run_free(&a);
    run_free(&b);
    run_free(&c);

    // Past the requested step: an error, not a silent no-op.
    Run d = run_main(&model, "--resume", full, "--steps", "5", NULL);
    assert_int_equal(d.rc, 1);
    assert_non_null(strstr(d.err, "is at step 10, past --steps 5"));
    run_free(&d);
  }
}

// A checkpoint shard file holding rows [row0, row0 + rows) of lin.w (and of its moments) from
// the whole [8, 8] tensors w, m, v, labelled as such.
static void write_row_shard(const char *path, const char *step, int row0, int rows,
                            const float *w, const float *m, const float *v, bool adamw) {
  int64_t dims[2] = {rows, M};
  char box[64];
  snprintf(box, sizeof box, "global=[8,8] offset=[%d,0]", row0);
  RtStTensor t[3] = {{"lin.w", 2, dims, w + row0 * M},
                     {"opt.m.lin.w", 2, dims, m + row0 * M},
                     {"opt.v.lin.w", 2, dims, v + row0 * M}};
  const char *meta[] = {"format", "moec-checkpoint-2", "model", "linear_test",
                        "optimizer", adamw ? "adamw" : "sgd", "step", step,
                        "shard.lin.w", box, "shard.opt.m.lin.w", box, "shard.opt.v.lin.w", box};
  assert_int_equal(rt_st_write(path, adamw ? 3 : 1, t, adamw ? 7 : 5, meta), 0);
}

static void write_index(const char *path, const char *optimizer, int step, int n,
                        const char *const *shards) {
  FILE *f = fopen(path, "w");
  assert_non_null(f);
  fprintf(f, "{\"format\": \"moec-checkpoint-2\", \"model\": \"linear_test\", \"optimizer\": "
             "\"%s\", \"step\": %d, \"world\": %d, \"shards\": [", optimizer, step, n);
  for (int i = 0; i < n; i++)
    fprintf(f, "%s\"%s\"", i ? ", " : "", shards[i]);
  fprintf(f, "]}\n");
  fclose(f);
}

// Checkpoints as sets of boxes: a checkpoint split by hand into two shards of rows (as two
// ranks would write it), the single-file format of before, --steps 0 conversion, and the
// errors of a broken set.
static void test_main_checkpoint_shards(void **state) {
  for (int opt = 0; opt < 2; opt++) {
    RtModel model = lin_model(opt ? RT_OPT_ADAMW : RT_OPT_SGD);
    const char *optimizer = opt ? "adamw" : "sgd";
    const char *c = tmp_path("c3"), *conv = tmp_path("c3_converted");
    Run a = run_main(&model, "--steps", "3", "--save", c, NULL);
    assert_int_equal(a.rc, 0);
    Run b = run_main(&model, "--resume", c, "--steps", "6", NULL);
    assert_int_equal(b.rc, 0);
    char *want = step_lines(b.out, 1);
    assert_true(strlen(want) > 0);
    RtStFile f;
    assert_int_equal(rt_st_read(shard_of(c), &f), 0);
    float w[M * M], m[M * M] = {0}, v[M * M] = {0};
    rt_st_copy(rt_st_find(&f, "lin.w"), w);
    if (opt) {
      rt_st_copy(rt_st_find(&f, "opt.m.lin.w"), m);
      rt_st_copy(rt_st_find(&f, "opt.v.lin.w"), v);
    }
    rt_st_free(&f);

    // Two shards of rows 0-2 and 3-7, in a subfolder named relative to the index.
    assert_int_equal(mkdir(tmp_path("split"), 0777), 0);
    write_row_shard(tmp_path("split/top.safetensors"), "3", 0, 3, w, m, v, opt);
    write_row_shard(tmp_path("split/bottom.safetensors"), "3", 3, 5, w, m, v, opt);
    const char *both[] = {"split/bottom.safetensors", "split/top.safetensors"};
    write_index(tmp_path("split_index"), optimizer, 3, 2, both);
    Run r = run_main(&model, "--resume", tmp_path("split_index"), "--steps", "6", NULL);
    if (r.rc != 0)
      fail_msg("resume from two shards failed: %s", r.err);
    char *got = step_lines(r.out, 1);
    assert_string_equal(want, got);
    free(got);
    run_free(&r);

    // --steps 0 --resume --save: the same tensors and step, in this run's layout.
    r = run_main(&model, "--steps", "0", "--resume", tmp_path("split_index"), "--save", conv, NULL);
    assert_int_equal(r.rc, 0);
    assert_non_null(strstr(r.out, "# --steps 0: nothing trained; the parameters stay at step 3"));
    assert_null(strstr(r.out, "step 1 "));
    run_free(&r);
    assert_same_tensors(shard_of(c), shard_of(conv));
    char *index = read_text(conv);
    assert_non_null(strstr(index, "\"step\": 3,"));
    free(index);

    // The single-file checkpoint format of before still resumes.
    int64_t dims[2] = {M, M};
    RtStTensor t[3] = {{"lin.w", 2, dims, w}, {"opt.m.lin.w", 2, dims, m},
                       {"opt.v.lin.w", 2, dims, v}};
    const char *meta[] = {"format", "moec-checkpoint-1", "step", "3", "model", "linear_test",
                          "optimizer", optimizer};
    assert_int_equal(rt_st_write(tmp_path("v1.safetensors"), opt ? 3 : 1, t, 4, meta), 0);
    r = run_main(&model, "--resume", tmp_path("v1.safetensors"), "--steps", "6", NULL);
    assert_int_equal(r.rc, 0);
    got = step_lines(r.out, 1);
    assert_string_equal(want, got);
    free(got);
    run_free(&r);

    // Only the top rows: the first element nobody holds is named.
    write_index(tmp_path("split_index"), optimizer, 3, 1, both + 1);
    r = run_main(&model, "--resume", tmp_path("split_index"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "does not cover tensor 'lin.w': element [3, 0] (needed by "
                                  "rank 0) is in none of its 1 shard file"));
    run_free(&r);
    // Overlapping shards: rows 0-3 and 2-7 cover the tensor and resume; rows 0-3 listed twice
    // add up to the tensor's size but leave row 4 to none of them.
    write_row_shard(tmp_path("split/upper.safetensors"), "3", 0, 4, w, m, v, opt);
    write_row_shard(tmp_path("split/lower.safetensors"), "3", 2, 6, w, m, v, opt);
    const char *overlap[] = {"split/upper.safetensors", "split/lower.safetensors"};
    write_index(tmp_path("split_index"), optimizer, 3, 2, overlap);
    r = run_main(&model, "--resume", tmp_path("split_index"), "--steps", "6", NULL);
    if (r.rc != 0)
      fail_msg("resume from overlapping shards failed: %s", r.err);
    got = step_lines(r.out, 1);
    assert_string_equal(want, got);
    free(got);
    run_free(&r);
    const char *twice[] = {"split/upper.safetensors", "split/upper.safetensors"};
    write_index(tmp_path("split_index"), optimizer, 3, 2, twice);
    r = run_main(&model, "--resume", tmp_path("split_index"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "does not cover tensor 'lin.w': element [4, 0] (needed by "
                                  "rank 0) is in none of its 2 shard files"));
    run_free(&r);
    // A shard of another step: torn.
    write_row_shard(tmp_path("split/top.safetensors"), "4", 0, 3, w, m, v, opt);
    write_index(tmp_path("split_index"), optimizer, 3, 2, both);
    r = run_main(&model, "--resume", tmp_path("split_index"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "is at step 4 but the index says 3"));
    run_free(&r);
    // A shard file listed but missing.
    const char *gone[] = {"split/bottom.safetensors", "split/gone.safetensors"};
    write_index(tmp_path("split_index"), optimizer, 3, 2, gone);
    r = run_main(&model, "--resume", tmp_path("split_index"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "split/gone.safetensors': No such file or directory"));
    run_free(&r);
    // A box of a tensor of another shape.
    write_row_shard(tmp_path("split/top.safetensors"), "3", 0, 3, w, m, v, opt);
    RtStTensor wide = {"lin.w", 2, (int64_t[2]){3, 8}, w};
    const char *bad_meta[] = {"format", "moec-checkpoint-2", "model", "linear_test", "step", "3",
                              "shard.lin.w", "global=[8,16] offset=[0,0]"};
    assert_int_equal(rt_st_write(tmp_path("split/top.safetensors"), 1, &wide, 4, bad_meta), 0);
    write_index(tmp_path("split_index"), optimizer, 3, 2, both);
    r = run_main(&model, "--weights", tmp_path("split_index"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "tensor 'lin.w' is a slice of a tensor of shape [8, 16], the "
                                  "model needs [8, 8]"));
    run_free(&r);
    // A box without its label.
    assert_int_equal(rt_st_write(tmp_path("split/top.safetensors"), 1, &wide, 3, bad_meta), 0);
    r = run_main(&model, "--weights", tmp_path("split_index"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "lacks a valid \"shard.lin.w\" entry"));
    run_free(&r);
    // A shard given where the index belongs; a JSON file that is no index.
    r = run_main(&model, "--resume", shard_of(c), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "is one shard of a checkpoint; resume from its index file"));
    run_free(&r);
    r = run_main(&model, "--weights", shard_of(c), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "is one shard of a checkpoint; load its index file"));
    run_free(&r);
    write_bytes(tmp_path("not_index.json"), "{\"format\": \"x\"}", 15);
    r = run_main(&model, "--weights", tmp_path("not_index.json"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "is neither a safetensors file nor a moec checkpoint index"));
    run_free(&r);
    r = run_main(&model, "--resume", tmp_path("not_index.json"), NULL);
    assert_int_equal(r.rc, 1);
    assert_non_null(strstr(r.err, "is not a moec checkpoint"));
    run_free(&r);

    remove(tmp_path("split/top.safetensors"));
    remove(tmp_path("split/bottom.safetensors"));
    remove(tmp_path("split/upper.safetensors"));
    remove(tmp_path("split/lower.safetensors"));
    assert_int_equal(rmdir(tmp_path("split")), 0);
    free(want);
    run_free(&a);
    run_free(&b);
  }
}

static void test_main_weights(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  const char *init = tmp_path("init.safetensors");
  Run a = run_main(&model, "--steps", "0", "--save", init, NULL);
  assert_int_equal(a.rc, 0);
  Run b = run_main(&model, "--steps", "4", NULL);
  Run c = run_main(&model, "--steps", "4", "--weights", init, NULL);
  assert_int_equal(c.rc, 0);
  char *lb = step_lines(b.out, 1), *lc = step_lines(c.out, 1);
  assert_string_equal(lb, lc);
  free(lb);
  free(lc);
  run_free(&a);
  run_free(&b);
  run_free(&c);

  // Wrong shape, missing tensor, other model's checkpoint, not a checkpoint.
  const char *bad = tmp_path("bad_w.safetensors");
  float w[12] = {0};
  int64_t dims[2] = {3, 4};
  RtStTensor t = {"lin.w", 2, dims, w};
  assert_int_equal(rt_st_write(bad, 1, &t, 0, NULL), 0);
  Run d = run_main(&model, "--weights", bad, NULL);
  assert_int_equal(d.rc, 1);
  assert_non_null(strstr(d.err, "moert: error: "));
  assert_non_null(strstr(d.err, "tensor 'lin.w' has shape [3, 4], the model needs [8, 8]"));
  run_free(&d);
  t.name = "other";
  assert_int_equal(rt_st_write(bad, 1, &t, 0, NULL), 0);
  d = run_main(&model, "--weights", bad, NULL);
  assert_int_equal(d.rc, 1);
  assert_non_null(strstr(d.err, "has no tensor 'lin.w'"));
  run_free(&d);
  d = run_main(&model, "--resume", bad, NULL);
  assert_int_equal(d.rc, 1);
  assert_non_null(strstr(d.err, "is not a moec checkpoint"));
  run_free(&d);
  RtModel other = model;
  other.name = "another_model";
  d = run_main(&other, "--resume", init, NULL);
  assert_int_equal(d.rc, 1);
  assert_non_null(strstr(d.err, "is of model 'linear_test', but this binary trains "
                                "'another_model'"));
  run_free(&d);
  RtModel adam = lin_model(RT_OPT_ADAMW);
  d = run_main(&adam, "--resume", init, NULL);
  assert_int_equal(d.rc, 1);
  assert_non_null(strstr(d.err, "optimizer sgd, but this binary uses adamw"));
  run_free(&d);
  d = run_main(&model, "--weights", tmp_path("nothere.safetensors"), NULL);
  assert_int_equal(d.rc, 1);
  assert_non_null(strstr(d.err, "moert: error: cannot open '"));
  assert_non_null(strstr(d.err, "nothere.safetensors': No such file or directory"));
  run_free(&d);
}

// bf16 bits of a float that bf16 holds exactly.
static uint16_t bf16_bits(float f) {
  assert_int_equal(bits_of(f) & 0xffff, 0);
  return (uint16_t)(bits_of(f) >> 16);
}

// --weights in the other dtypes and as a Hugging Face index or folder: the same values give the
// same run as the F32 file.
static void test_main_weights_hf(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  float w[M * M];
  unsigned char as_bf16[2 * M * M], as_f16[2 * M * M], as_f64[8 * M * M];
  for (int i = 0; i < M * M; i++) {
    w[i] = (float)((i * 37) % 17 - 8) / 64.0f;   // exact in bf16, f16 and f64
    uint16_t b = bf16_bits(w[i]);
    as_bf16[2 * i] = (unsigned char)(b & 0xff);
    as_bf16[2 * i + 1] = (unsigned char)(b >> 8);
    double d = w[i];
    uint64_t u;
    memcpy(&u, &d, 8);
    for (int k = 0; k < 8; k++)
      as_f64[8 * i + k] = (unsigned char)(u >> (8 * k));
    // f16 of k/64 (|k| <= 8): built from its fields, exponent of 2^e with the value m*2^e.
    int k = (i * 37) % 17 - 8, mag = k < 0 ? -k : k;
    uint16_t h = 0;
    if (mag) {
      int e = 0;
      while ((mag >> e) > 1)
        e++;
      // |w| = mag * 2^-6 = (1 + frac) * 2^(e-6); f16 exponent field e - 6 + 15.
      h = (uint16_t)((e + 9) << 10 | ((mag << 10 >> e) & 1023));
    }
    if (k < 0)
      h |= 0x8000;
    as_f16[2 * i] = (unsigned char)(h & 0xff);
    as_f16[2 * i + 1] = (unsigned char)(h >> 8);
  }
  int64_t dims[2] = {M, M};
  RtStTensor t = {"lin.w", 2, dims, w};
  assert_int_equal(rt_st_write(tmp_path("w32.safetensors"), 1, &t, 0, NULL), 0);
  Run base = run_main(&model, "--steps", "4", "--weights", tmp_path("w32.safetensors"), NULL);
  assert_int_equal(base.rc, 0);
  char *want = step_lines(base.out, 1);

  mkdir(tmp_path("hfw"), 0755);
  const float other[3] = {9, 9, 9};
  RawTensor shard1[1] = {{"lin.w", "BF16", "8,8", as_bf16, sizeof as_bf16}};
  RawTensor shard2[1] = {{"unused.bias", "F32", "3", other, sizeof other}};
  write_st_tensors(tmp_path("hfw/model-00001-of-00002.safetensors"), 1, shard1);
  write_st_tensors(tmp_path("hfw/model-00002-of-00002.safetensors"), 1, shard2);
  write_text(tmp_path("hfw/model.safetensors.index.json"),
             "{\"metadata\": {\"total_size\": 140},\n \"weight_map\": {\n"
             "  \"lin.w\": \"model-00001-of-00002.safetensors\",\n"
             "  \"unused.bias\": \"model-00002-of-00002.safetensors\"}}\n");
  RawTensor f16[1] = {{"lin.w", "F16", "8,8", as_f16, sizeof as_f16}};
  RawTensor f64[1] = {{"lin.w", "F64", "8,8", as_f64, sizeof as_f64}};
  write_st_tensors(tmp_path("w16.safetensors"), 1, f16);
  write_st_tensors(tmp_path("w64.safetensors"), 1, f64);
  const char *sources[] = {tmp_path("hfw"), tmp_path("hfw/model.safetensors.index.json"),
                           tmp_path("w16.safetensors"), tmp_path("w64.safetensors")};
  for (int k = 0; k < 4; k++) {
    Run r = run_main(&model, "--steps", "4", "--weights", sources[k], NULL);
    if (r.rc != 0)
      fail_msg("--weights %s: %s", sources[k], r.err);
    char *got = step_lines(r.out, 1);
    assert_string_equal(got, want);
    free(got);
    run_free(&r);
  }

  // A tensor of another shape, a missing tensor, a folder with neither file, --resume.
  RawTensor wide[1] = {{"lin.w", "BF16", "2,2", as_bf16, 8}};
  write_st_tensors(tmp_path("hfw/model-00001-of-00002.safetensors"), 1, wide);
  Run r = run_main(&model, "--weights", tmp_path("hfw"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "tensor 'lin.w' has shape [2, 2], the model needs [8, 8]"));
  run_free(&r);
  RawTensor both[2] = {shard1[0], shard2[0]};
  write_st_tensors(tmp_path("hfw/model-00001-of-00002.safetensors"), 2, both);
  write_text(tmp_path("hfw/model.safetensors.index.json"),
             "{\"weight_map\": {\"unused.bias\": \"model-00001-of-00002.safetensors\"}}");
  r = run_main(&model, "--weights", tmp_path("hfw/"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "holds tensor 'lin.w', which index '"));
  run_free(&r);
  write_st_tensors(tmp_path("hfw/model-00001-of-00002.safetensors"), 1, shard2);
  remove(tmp_path("hfw/model-00002-of-00002.safetensors"));
  r = run_main(&model, "--weights", tmp_path("hfw/model.safetensors.index.json"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "model.safetensors.index.json' has no tensor 'lin.w'"));
  run_free(&r);
  r = run_main(&model, "--resume", tmp_path("hfw/model.safetensors.index.json"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "is not a moec checkpoint"));
  run_free(&r);
  mkdir(tmp_path("hfw_empty"), 0755);
  r = run_main(&model, "--weights", tmp_path("hfw_empty"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "holds neither model.safetensors nor "
                                "model.safetensors.index.json"));
  run_free(&r);
  r = run_main(&model, "--resume", tmp_path("hfw_empty"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "it is not a regular file"));
  run_free(&r);
  free(want);
  run_free(&base);
}

static void test_main_dump_and_input(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  const char *dir = tmp_path("dump/nested");
  Run a = run_main(&model, "--steps", "2", "--dump", dir, NULL);
  assert_int_equal(a.rc, 0);
  char path[600];
  RtArray x, t, y, loss, g;
  snprintf(path, sizeof path, "%s/input.npy", dir);
  assert_int_equal(rt_npy_read(path, &x), 0);
  snprintf(path, sizeof path, "%s/target.npy", dir);
  assert_int_equal(rt_npy_read(path, &t), 0);
  snprintf(path, sizeof path, "%s/output.npy", dir);
  assert_int_equal(rt_npy_read(path, &y), 0);
  snprintf(path, sizeof path, "%s/loss.npy", dir);
  assert_int_equal(rt_npy_read(path, &loss), 0);
  snprintf(path, sizeof path, "%s/grad/lin.w.npy", dir);
  assert_int_equal(rt_npy_read(path, &g), 0);
  assert_int_equal(x.rank, 3);
  assert_int_equal(x.dims[0], B);
  assert_int_equal(x.dims[1], L);
  assert_int_equal(x.dims[2], M);
  assert_int_equal(y.dtype, RT_DTYPE_F32);
  assert_int_equal(y.numel, N);
  assert_int_equal(loss.dtype, RT_DTYPE_F64);
  assert_int_equal(loss.rank, 0);
  assert_int_equal(g.rank, 2);
  assert_int_equal(g.dims[0], M);

  // The dump agrees with an independent computation: synthetic data from the seed, the
  // teacher rule, the loss of the dumped output, and the gradient x^T (y - t) / N.
  const float *xs = x.data, *ts = t.data, *ys = y.data, *gs = g.data;
  uint64_t key = rt_key(rt_key(rt_key(42, RT_STREAM_INPUT), 1), 1);   // step 1, sample 1
  assert_true(xs[L * M + 5] == (float)rt_normal(key, 5));
  for (int s = 0; s < S; s++)
    for (int m = 0; m < M; m++)
      assert_true(ts[s * M + m] == 0.5f * xs[s * M + (m + 1) % M]);
  double mse = 0;
  for (int i = 0; i < N; i++)
    mse += ((double)ys[i] - ts[i]) * ((double)ys[i] - ts[i]);
  mse /= 2.0 * N;
  assert_true(fabs(mse - *(double *)loss.data) < 1e-6);
  assert_true(fabs(step_loss(a.out, 1) - mse) < 2e-6);
  for (int i = 0; i < M; i++)
    for (int j = 0; j < M; j++) {
      double ref = 0;
      for (int s = 0; s < S; s++)
        ref += (double)xs[s * M + i] * ((double)ys[s * M + j] - ts[s * M + j]) / N;
      assert_true(fabs(ref - gs[i * M + j]) < 1e-5 * (1 + fabs(ref)));
    }

  // The dumped input fed back with --input gives the same first step (target derived).
  snprintf(path, sizeof path, "%s/input.npy", dir);
  Run b = run_main(&model, "--steps", "1", "--input", path, NULL);
  assert_int_equal(b.rc, 0);
  char *la = step_lines(a.out, 1), *lb = step_lines(b.out, 1);
  assert_true(strncmp(la, lb, strlen(lb)) == 0);
  free(la);
  free(lb);
  run_free(&b);
  // ... and with an explicit --target too.
  char tpath[600];
  snprintf(tpath, sizeof tpath, "%s/target.npy", dir);
  b = run_main(&model, "--steps", "1", "--input", path, "--target", tpath, NULL);
  assert_int_equal(b.rc, 0);
  assert_true(step_loss(b.out, 1) == step_loss(a.out, 1));
  run_free(&b);
  // The wrong shape is refused with the expected one named.
  snprintf(path, sizeof path, "%s/grad/lin.w.npy", dir);
  b = run_main(&model, "--input", path, NULL);
  assert_int_equal(b.rc, 1);
  assert_non_null(strstr(b.err, "has shape [8, 8]; expected [2, 8, 8]"));
  run_free(&b);

  rt_array_free(&x);
  rt_array_free(&t);
  rt_array_free(&y);
  rt_array_free(&loss);
  rt_array_free(&g);
  run_free(&a);
}

static void test_main_check_grad(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  Run r = run_main(&model, "--check-grad", NULL);
  if (r.rc != 0)
    fail_msg("check-grad failed on a correct model:\n%s%s", r.out, r.err);
  assert_non_null(strstr(r.out, "|fd - g| <= atol + rtol * |g| + noise, rtol = 5e-02"));
  int checked, skipped;
  const char *row = strstr(r.out, "\nlin.w ");
  assert_non_null(row);
  assert_int_equal(sscanf(row, "\nlin.w %d %d", &checked, &skipped), 2);
  assert_int_equal(checked, 12);
  assert_int_equal(skipped, 0);
  assert_non_null(strstr(r.out, "\nOK\n"));
  assert_null(strstr(r.out, "step 1 "));
  run_free(&r);

  backward_scale = 1.1f;
  r = run_main(&model, "--check-grad", NULL);
  backward_scale = 1.0f;
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.out, "FAILED\n"));
  run_free(&r);

  // A "routing decision" that flips between W[j] and W[j] + eps: that entry is skipped. j is
  // the first entry the check samples: hash(name) % (numel / 12).
  route_index = (int)(rt_hash_name("lin.w") % (M * M / 12));
  uint64_t key = rt_key(rt_key(42, RT_STREAM_INIT), rt_hash_name("lin.w"));
  float w0 = (float)(0.1f * rt_normal(key, (uint64_t)route_index));
  route_threshold = w0 + 0.5e-2f * fmaxf(1.0f, fabsf(w0));
  r = run_main(&model, "--check-grad", NULL);
  route_threshold = INFINITY;
  if (r.rc != 0)
    fail_msg("check-grad did not skip the routing change:\n%s", r.out);
  row = strstr(r.out, "\nlin.w ");
  assert_int_equal(sscanf(row, "\nlin.w %d %d", &checked, &skipped), 2);
  assert_int_equal(checked, 11);
  assert_int_equal(skipped, 1);
  run_free(&r);
}

static void test_main_command_line(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  Run r = run_main(&model, "--frobnicate", NULL);
  assert_int_equal(r.rc, 2);
  assert_non_null(strstr(r.err, "moert: error: unknown option '--frobnicate'"));
  assert_non_null(strstr(r.err, "usage: model"));
  assert_string_equal(r.out, "");
  run_free(&r);
  r = run_main(&model, "--help", NULL);
  assert_int_equal(r.rc, 0);
  assert_non_null(strstr(r.out, "usage: model"));
  assert_non_null(strstr(r.out, "--check-grad"));
  run_free(&r);
  r = run_main(&model, "--steps", "ten", NULL);
  assert_int_equal(r.rc, 2);
  assert_non_null(strstr(r.err, "--steps needs a whole number"));
  run_free(&r);
  r = run_main(&model, "--steps", NULL);
  assert_int_equal(r.rc, 2);
  assert_non_null(strstr(r.err, "option '--steps' needs a value"));
  run_free(&r);
  r = run_main(&model, "--steps=2", "--quiet", NULL);
  assert_int_equal(r.rc, 0);
  assert_non_null(strstr(r.out, "# trained 2 steps"));
  run_free(&r);
  r = run_main(&model, "--weights", "a", "--resume", "b", NULL);
  assert_int_equal(r.rc, 2);
  assert_non_null(strstr(r.err, "cannot be combined"));
  run_free(&r);
  r = run_main(&model, "--target", "t.npy", NULL);
  assert_int_equal(r.rc, 2);
  run_free(&r);
  // --dump into a path blocked by a file.
  const char *blocker = tmp_path("blocker");
  write_bytes(blocker, "x", 1);
  r = run_main(&model, "--steps", "1", "--dump", blocker, NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "it exists and is not a folder"));   // before the first step
  assert_null(strstr(r.out, "step 1 "));
  run_free(&r);
}

static int count_lines(const char *text) {
  int n = 0;
  for (const char *p = text; p && *p; p++)
    n += *p == '\n';
  return n;
}

// The load figures, the dropless capacity and the record hook's file (fresh, resumed, default
// name, --check-grad).
static void test_main_record_and_loads(void **state) {
  RtModel model = lin_model(RT_OPT_SGD);
  model.records = true;
  model.dropless = true;
  lin_moe = true;
  const char *rec = tmp_path("run.record.jsonl");
  Run r = run_main(&model, "--steps", "3", "--record", rec, NULL);
  assert_int_equal(r.rc, 0);
  assert_non_null(strstr(r.out, "dropped 0.0000  load min/mean/max 0/4.0/6  capacity 6  time "));
  char *text = read_text(rec);
  assert_non_null(text);
  assert_int_equal(count_lines(text), 3);
  const char *line = text;
  for (int t = 1; t <= 3; t++) {
    int step, layer;
    long long numel;
    double mean, max_abs, dropped;
    char point[32];
    assert_int_equal(sscanf(line, "{\"step\": %d, \"layer\": %d, \"point\": \"%31[^\"]\", "
                                  "\"numel\": %lld, \"mean\": %lf, \"max_abs\": %lf, "
                                  "\"dropped\": %lf}", &step, &layer, point, &numel, &mean,
                            &max_abs, &dropped),
                     7);
    assert_int_equal(step, t);
    assert_int_equal(layer, 0);
    assert_string_equal(point, "before_dispatch");
    assert_int_equal(numel, N);
    assert_true(max_abs > 0 && fabs(mean) <= max_abs && dropped == 0);
    line = strchr(line, '\n') + 1;
  }
  free(text);
  run_free(&r);

  // A resumed run appends to the file.
  const char *half = tmp_path("rec_half.safetensors");
  r = run_main(&model, "--steps", "2", "--record", rec, "--save", half, NULL);
  assert_int_equal(r.rc, 0);
  run_free(&r);
  r = run_main(&model, "--resume", half, "--steps", "4", "--record", rec, "--quiet", NULL);
  assert_int_equal(r.rc, 0);
  text = read_text(rec);
  assert_int_equal(count_lines(text), 4);
  assert_non_null(strstr(text, "{\"step\": 4, "));
  free(text);
  run_free(&r);

  // Default file name in the current directory; --check-grad records nothing.
  char cwd[1024];
  assert_non_null(getcwd(cwd, sizeof cwd));
  assert_int_equal(chdir(tmpdir), 0);
  r = run_main(&model, "--steps", "1", NULL);
  assert_int_equal(r.rc, 0);
  assert_true(file_exists("linear_test.record.jsonl"));
  run_free(&r);
  r = run_main(&model, "--check-grad", "--record", "grad.record.jsonl", NULL);
  assert_int_equal(r.rc, 0);
  assert_false(file_exists("grad.record.jsonl"));
  run_free(&r);
  assert_int_equal(chdir(cwd), 0);

  // An unwritable record file is an error before any step runs.
  r = run_main(&model, "--record", tmp_path("no/such/dir.jsonl"), NULL);
  assert_int_equal(r.rc, 1);
  assert_non_null(strstr(r.err, "--record"));
  assert_non_null(strstr(r.err, "does not exist"));
  assert_null(strstr(r.out, "step 1 "));
  run_free(&r);
  lin_moe = false;
}

static int remove_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw) {
  return remove(path);
}

static int setup(void **state) {
  snprintf(tmpdir, sizeof tmpdir, "/tmp/moert_io_XXXXXX");
  return mkdtemp(tmpdir) ? 0 : -1;
}

static int teardown(void **state) {
  return nftw(tmpdir, remove_entry, 16, FTW_DEPTH | FTW_PHYS);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_npy_f32_round_trip),
      cmocka_unit_test(test_npy_scalar_and_int),
      cmocka_unit_test(test_npy_errors),
      cmocka_unit_test(test_npy_every_truncation),
      cmocka_unit_test(test_st_round_trip),
      cmocka_unit_test(test_st_malformed),
      cmocka_unit_test(test_st_corruptions),
      cmocka_unit_test(test_st_dtypes),
      cmocka_unit_test(test_st_set),
      cmocka_unit_test(test_main_trains),
      cmocka_unit_test(test_main_deterministic),
      cmocka_unit_test(test_main_resume),
      cmocka_unit_test(test_main_checkpoint_shards),
      cmocka_unit_test(test_main_weights),
      cmocka_unit_test(test_main_weights_hf),
      cmocka_unit_test(test_main_dump_and_input),
      cmocka_unit_test(test_main_check_grad),
      cmocka_unit_test(test_main_command_line),
      cmocka_unit_test(test_main_record_and_loads),
  };
  MPI_Init(NULL, NULL);
  int status = cmocka_run_group_tests(tests, setup, teardown);
  MPI_Finalize();
  return status;
}
