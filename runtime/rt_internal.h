// Internals shared by the runtime's files: the error message of the last failed call, .npy and
// safetensors files.
//
// Errors: a function that can fail on user input records one sentence with rt_fail() and
// returns -1; whoever gives up (rt_main) prints it once as "moert: error: SENTENCE". The
// sentence names the file and what is wrong with it, so nothing below has to print.
#ifndef RT_INTERNAL_H
#define RT_INTERNAL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "libmoert reads and writes little-endian files with memcpy; port npy.c and safetensors.c"
#endif

// ---- errors ----
// Records the message (printf format) and returns -1.
int rt_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
// The message of the last rt_fail, "" when none.
const char *rt_last_error(void);
void rt_clear_error(void);

// ---- routing statistics (kernels.c) ----
// Adds the per-expert loads of one layer (load[e]: tokens or choices kept by each expert) to
// st's load_min / load_max / load_sum / load_count. st may be NULL.
typedef struct RtStep RtStep;
void rt_add_loads(RtStep *st, const int64_t *load, int e);

// ---- .npy (version 1.0 written; 1.0, 2.0 and 3.0 read), little-endian, C order ----
typedef enum RtDtype { RT_DTYPE_F32, RT_DTYPE_F64, RT_DTYPE_I32 } RtDtype;

enum { RT_MAX_RANK = 8 };

typedef struct RtArray {
  RtDtype dtype;
  int rank;                     // 0 for a scalar
  int64_t dims[RT_MAX_RANK];
  int64_t numel;
  void *data;                   // numel elements, malloc'ed; rt_array_free releases it
} RtArray;

size_t rt_dtype_size(RtDtype dtype);
const char *rt_dtype_name(RtDtype dtype);    // "float32", "float64", "int32"

// Writes data as PATH. rank 0 writes a 0-d array of one element.
int rt_npy_write(const char *path, RtDtype dtype, int rank, const int64_t *dims,
                 const void *data);
// Reads any supported .npy into *out (zeroed on failure).
int rt_npy_read(const char *path, RtArray *out);
// Reads a float32 array that must have exactly the given shape into dst (numel floats).
int rt_npy_read_f32(const char *path, int rank, const int64_t *dims, float *dst);
void rt_array_free(RtArray *a);

// Formats a shape as "[2, 3]" ("[]" for a scalar) into buf.
const char *rt_shape_str(char *buf, size_t len, int rank, const int64_t *dims);

// ---- safetensors (F32 tensors only) ----
typedef struct RtStTensor {     // one tensor to write
  const char *name;
  int rank;
  const int64_t *dims;
  const float *data;
} RtStTensor;

// Writes PATH atomically: PATH.tmp, fsync, rename, fsync of the directory. meta holds nmeta
// key/value pairs (2*nmeta strings) for "__metadata__"; nmeta may be 0.
int rt_st_write(const char *path, int ntensors, const RtStTensor *tensors, int nmeta,
                const char *const *meta);

typedef struct RtStEntry {
  char *name;
  int rank;
  int64_t dims[RT_MAX_RANK];
  int64_t numel;
  const unsigned char *bytes;   // numel little-endian floats inside the file's buffer, unaligned
} RtStEntry;

typedef struct RtStFile {
  int ntensors;
  RtStEntry *tensors;           // in file order
  int nmeta;
  char **meta;                  // 2*nmeta strings: key, value, ...
  unsigned char *buffer;        // the whole file
  size_t size;
} RtStFile;

// Reads and validates PATH (header, dtypes, shapes, offsets); *out is zeroed on failure.
int rt_st_read(const char *path, RtStFile *out);
const RtStEntry *rt_st_find(const RtStFile *f, const char *name);
const char *rt_st_meta(const RtStFile *f, const char *key);   // NULL when absent
void rt_st_copy(const RtStEntry *t, float *dst);                // numel floats
void rt_st_free(RtStFile *f);

#endif
