// .npy files: numpy's single-array format, used for --input/--target, token windows (int32,
// int64 or uint16: data.c) and the --dump tensors.
//
// A file is the magic "\x93NUMPY", a version (1.0: 16-bit header length; 2.0/3.0: 32-bit), a
// header that is a Python dict literal {'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }
// padded with spaces and a newline to a multiple of 64 bytes, then the elements in C order.
// We write version 1.0 and read all three versions. The header is parsed by a small scanner
// for exactly that dict literal, so any file numpy writes for our dtypes is accepted and
// anything else gets a sentence saying what is wrong, never a crash. Running out of memory is not
// the file's fault: it ends the job (rt_alloc, error.c).
#include "rt_internal.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char npy_magic[6] = {'\x93', 'N', 'U', 'M', 'P', 'Y'};

size_t rt_dtype_size(RtDtype dtype) {
  switch (dtype) {
  case RT_DTYPE_U16: return 2;
  case RT_DTYPE_F32: return 4;
  case RT_DTYPE_I32: return 4;
  case RT_DTYPE_F64: return 8;
  case RT_DTYPE_I64: return 8;
  }
  return 4;
}

const char *rt_dtype_name(RtDtype dtype) {
  switch (dtype) {
  case RT_DTYPE_F32: return "float32";
  case RT_DTYPE_F64: return "float64";
  case RT_DTYPE_I32: return "int32";
  case RT_DTYPE_I64: return "int64";
  case RT_DTYPE_U16: return "uint16";
  }
  return "?";
}

static const char *dtype_descr(RtDtype dtype) {
  switch (dtype) {
  case RT_DTYPE_F32: return "<f4";
  case RT_DTYPE_F64: return "<f8";
  case RT_DTYPE_I32: return "<i4";
  case RT_DTYPE_I64: return "<i8";
  case RT_DTYPE_U16: return "<u2";
  }
  return "?";
}

const char *rt_shape_str(char *buf, size_t len, int rank, const int64_t *dims) {
  size_t n = 0;
  n += snprintf(buf, len, "[");
  for (int i = 0; i < rank && n < len; i++)
    n += snprintf(buf + n, len - n, "%s%lld", i ? ", " : "", (long long)dims[i]);
  if (n < len)
    snprintf(buf + n, len - n, "]");
  return buf;
}

void rt_array_free(RtArray *a) {
  free(a->data);
  memset(a, 0, sizeof *a);
}

// ---- writing ----

int rt_npy_write(const char *path, RtDtype dtype, int rank, const int64_t *dims,
                 const void *data) {
  if (rank < 0 || rank > RT_MAX_RANK)
    return rt_fail("cannot write '%s': rank %d is not supported", path, rank);
  char header[512];
  int n = snprintf(header, sizeof header, "{'descr': '%s', 'fortran_order': False, 'shape': (",
                   dtype_descr(dtype));
  int64_t numel = 1;
  for (int i = 0; i < rank; i++) {
    n += snprintf(header + n, sizeof header - n, "%s%lld", i ? ", " : "", (long long)dims[i]);
    numel *= dims[i];
  }
  if (rank == 1)  // a 1-tuple is written "(3,)"
    n += snprintf(header + n, sizeof header - n, ",");
  n += snprintf(header + n, sizeof header - n, "), }");
  // Pad with spaces so that magic + version + length + header ends on a 64-byte boundary, the
  // last byte being '\n'.
  int total = 10 + n + 1;
  int padded = (total + 63) / 64 * 64;
  while (n < padded - 10 - 1)
    header[n++] = ' ';
  header[n++] = '\n';

  FILE *f = fopen(path, "wb");
  if (!f)
    return rt_fail("cannot create '%s': %s", path, strerror(errno));
  unsigned char prefix[10];
  memcpy(prefix, npy_magic, 6);
  prefix[6] = 1;
  prefix[7] = 0;
  prefix[8] = (unsigned char)(n & 0xff);
  prefix[9] = (unsigned char)(n >> 8);
  size_t bytes = (size_t)numel * rt_dtype_size(dtype);
  bool ok = fwrite(prefix, 1, 10, f) == 10 && fwrite(header, 1, n, f) == (size_t)n &&
            (bytes == 0 || fwrite(data, 1, bytes, f) == bytes);
  int saved = errno;
  if (fclose(f) != 0 && ok) {
    ok = false;
    saved = errno;
  }
  if (!ok) {
    remove(path);
    return rt_fail("cannot write '%s': %s", path, strerror(saved));
  }
  return 0;
}

// ---- reading ----

typedef struct Scanner {
  const char *p, *end;
} Scanner;

static void skip_space(Scanner *s) {
  while (s->p < s->end && (*s->p == ' ' || *s->p == '\t' || *s->p == '\n' || *s->p == '\r'))
    s->p++;
}

static bool accept(Scanner *s, char c) {
  skip_space(s);
  if (s->p < s->end && *s->p == c) {
    s->p++;
    return true;
  }
  return false;
}

// string = "'" chars "'" | '"' chars '"'
static bool scan_string(Scanner *s, char *buf, size_t len) {
  skip_space(s);
  if (s->p >= s->end || (*s->p != '\'' && *s->p != '"'))
    return false;
  char quote = *s->p++;
  size_t n = 0;
  while (s->p < s->end && *s->p != quote) {
    if (n + 1 >= len)
      return false;
    buf[n++] = *s->p++;
  }
  if (s->p >= s->end)
    return false;
  s->p++;
  buf[n] = '\0';
  return true;
}

static bool scan_word(Scanner *s, const char *word) {
  skip_space(s);
  size_t n = strlen(word);
  if ((size_t)(s->end - s->p) >= n && memcmp(s->p, word, n) == 0) {
    s->p += n;
    return true;
  }
  return false;
}

// shape = "(" [int ("," int)* [","]] ")"   (Python may write 3L for a long in old files)
static bool scan_shape(Scanner *s, int *rank, int64_t *dims) {
  if (!accept(s, '('))
    return false;
  *rank = 0;
  for (;;) {
    skip_space(s);
    if (accept(s, ')'))
      return true;
    if (*rank == RT_MAX_RANK || s->p >= s->end || *s->p < '0' || *s->p > '9')
      return false;
    int64_t v = 0;
    while (s->p < s->end && *s->p >= '0' && *s->p <= '9') {
      if (v > (INT64_MAX - 9) / 10)
        return false;
      v = v * 10 + (*s->p++ - '0');
    }
    if (s->p < s->end && *s->p == 'L')
      s->p++;
    dims[(*rank)++] = v;
    if (!accept(s, ',')) {
      return accept(s, ')');
    }
  }
}

// header = "{" (key ":" value ",")* "}" with keys descr, fortran_order, shape
static int parse_header(const char *path, const char *text, size_t len, RtArray *a,
                        bool *fortran) {
  Scanner s = {text, text + len};
  char descr[32] = "";
  bool have_descr = false, have_order = false, have_shape = false;
  if (!accept(&s, '{'))
    return rt_fail("'%s' is not a valid .npy file: its header is not a dict", path);
  while (!accept(&s, '}')) {
    char key[32];
    if (!scan_string(&s, key, sizeof key) || !accept(&s, ':'))
      return rt_fail("'%s' is not a valid .npy file: cannot parse its header", path);
    if (strcmp(key, "descr") == 0) {
      if (!scan_string(&s, descr, sizeof descr))
        return rt_fail("'%s': the header's 'descr' is not a simple dtype string "
                       "(structured arrays are not supported)", path);
      have_descr = true;
    } else if (strcmp(key, "fortran_order") == 0) {
      if (scan_word(&s, "True"))
        *fortran = true;
      else if (scan_word(&s, "False"))
        *fortran = false;
      else
        return rt_fail("'%s' is not a valid .npy file: 'fortran_order' is not True or False",
                       path);
      have_order = true;
    } else if (strcmp(key, "shape") == 0) {
      if (!scan_shape(&s, &a->rank, a->dims))
        return rt_fail("'%s' is not a valid .npy file: cannot parse its shape (at most %d "
                       "dimensions)", path, RT_MAX_RANK);
      have_shape = true;
    } else {
      return rt_fail("'%s' is not a valid .npy file: unknown header key '%s'", path, key);
    }
    if (!accept(&s, ',')) {
      if (accept(&s, '}'))
        break;
      return rt_fail("'%s' is not a valid .npy file: cannot parse its header", path);
    }
  }
  if (!have_descr || !have_order || !have_shape)
    return rt_fail("'%s' is not a valid .npy file: its header lacks '%s'", path,
                   !have_descr ? "descr" : !have_order ? "fortran_order" : "shape");
  // '=' is native order, little-endian on every machine we build for.
  const char *d = descr;
  if (d[0] == '>')
    return rt_fail("'%s' holds big-endian data ('%s'); save it little-endian "
                   "(x.astype(x.dtype.newbyteorder('<')))", path, descr);
  if (d[0] == '<' || d[0] == '=')
    d++;
  if (strcmp(d, "f4") == 0)
    a->dtype = RT_DTYPE_F32;
  else if (strcmp(d, "f8") == 0)
    a->dtype = RT_DTYPE_F64;
  else if (strcmp(d, "i4") == 0)
    a->dtype = RT_DTYPE_I32;
  else if (strcmp(d, "i8") == 0)
    a->dtype = RT_DTYPE_I64;
  else if (strcmp(d, "u2") == 0)
    a->dtype = RT_DTYPE_U16;
  else
    return rt_fail("'%s' has dtype '%s'; supported are float32 '<f4', float64 '<f8', "
                   "int32 '<i4', int64 '<i8' and uint16 '<u2'", path, descr);
  return 0;
}

int rt_npy_read(const char *path, RtArray *out) {
  memset(out, 0, sizeof *out);
  FILE *f = fopen(path, "rb");
  if (!f)
    return rt_fail("cannot open '%s': %s", path, strerror(errno));
  RtArray a = {0};
  char *header = NULL;
  unsigned char prefix[12];
  int status = -1;
  if (fread(prefix, 1, 8, f) != 8 || memcmp(prefix, npy_magic, 6) != 0) {
    rt_fail("'%s' is not a .npy file (no \\x93NUMPY magic)", path);
    goto done;
  }
  size_t header_len;
  if (prefix[6] == 1) {
    if (fread(prefix + 8, 1, 2, f) != 2) {
      rt_fail("'%s' is truncated inside its header", path);
      goto done;
    }
    header_len = prefix[8] | (size_t)prefix[9] << 8;
  } else if (prefix[6] == 2 || prefix[6] == 3) {
    if (fread(prefix + 8, 1, 4, f) != 4) {
      rt_fail("'%s' is truncated inside its header", path);
      goto done;
    }
    header_len = prefix[8] | (size_t)prefix[9] << 8 | (size_t)prefix[10] << 16 |
                 (size_t)prefix[11] << 24;
    if (header_len > (1u << 24)) {
      rt_fail("'%s' is not a valid .npy file: header length %zu is implausible", path,
              header_len);
      goto done;
    }
  } else {
    rt_fail("'%s' has .npy format version %d.%d; versions 1.0 to 3.0 are supported", path,
            prefix[6], prefix[7]);
    goto done;
  }
  header = rt_alloc(header_len + 1, "the header of an .npy file");
  if (fread(header, 1, header_len, f) != header_len) {
    rt_fail("'%s' is truncated inside its header", path);
    goto done;
  }
  header[header_len] = '\0';
  bool fortran = false;
  if (parse_header(path, header, header_len, &a, &fortran) != 0)
    goto done;
  a.numel = 1;
  int big_dims = 0;
  for (int i = 0; i < a.rank; i++) {
    if (a.dims[i] != 0 && a.numel > INT64_MAX / 8 / a.dims[i]) {
      rt_fail("'%s': shape is too large", path);
      goto done;
    }
    a.numel *= a.dims[i];
    big_dims += a.dims[i] > 1;
  }
  if (fortran && big_dims > 1) {
    rt_fail("'%s' is stored in Fortran order; save it in C order (np.ascontiguousarray)",
            path);
    goto done;
  }
  size_t bytes = (size_t)a.numel * rt_dtype_size(a.dtype);
  // Compare with the file's size before allocating, so a corrupt shape reads as truncation.
  long data_start = ftell(f);
  if (data_start >= 0 && fseek(f, 0, SEEK_END) == 0) {
    long file_end = ftell(f);
    if (file_end >= data_start && (size_t)(file_end - data_start) < bytes) {
      rt_fail("'%s' is truncated: its shape needs %zu bytes of data, the file has %ld", path,
              bytes, file_end - data_start);
      goto done;
    }
    fseek(f, data_start, SEEK_SET);
  }
  a.data = rt_alloc(bytes, "the data of an .npy file");
  size_t got = fread(a.data, 1, bytes, f);
  if (got != bytes) {
    if (ferror(f))
      rt_fail("cannot read '%s': %s", path, strerror(errno));
    else
      rt_fail("'%s' is truncated: its shape needs %zu bytes of data, the file has %zu", path,
              bytes, got);
    goto done;
  }
  if (fgetc(f) != EOF) {
    rt_fail("'%s' has bytes after its data; it is not a single .npy array", path);
    goto done;
  }
  *out = a;
  a.data = NULL;
  status = 0;
done:
  free(a.data);
  free(header);
  fclose(f);
  return status;
}

int rt_npy_read_f32(const char *path, int rank, const int64_t *dims, float *dst) {
  RtArray a;
  if (rt_npy_read(path, &a) != 0)
    return -1;
  char want[160], got[160];
  int status = 0;
  if (a.dtype != RT_DTYPE_F32) {
    status = rt_fail("'%s' holds %s; expected float32 (save it with x.astype(np.float32))",
                     path, rt_dtype_name(a.dtype));
  } else {
    bool same = a.rank == rank;
    for (int i = 0; same && i < rank; i++)
      same = a.dims[i] == dims[i];
    if (!same)
      status = rt_fail("'%s' has shape %s; expected %s", path,
                       rt_shape_str(got, sizeof got, a.rank, a.dims),
                       rt_shape_str(want, sizeof want, rank, dims));
    else
      memcpy(dst, a.data, (size_t)a.numel * sizeof(float));
  }
  rt_array_free(&a);
  return status;
}
