// Compression hooks (fp16, bf16, int8) and the record hook's statistics; the siblings of
// runtime/kernels/hook.c.
// See prelude.cu for the conventions and for how the build embeds this file.

// ---- 16-bit formats on the bits, as runtime/kernels/hook.c: round to nearest, ties to even ----
__device__ u32 mk_shift_round_even(u32 m, int shift) {
  u32 q = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1))) q++;
  return q;
}
__device__ u16 mk_half_from_float(float f) {
  u32 u = __float_as_uint(f);
  u16 sign = (u16)((u >> 16) & 0x8000);
  u32 a = u & 0x7fffffff, ex = a >> 23, mant = a & 0x7fffff;
  if (a > 0x7f800000) return sign | 0x7e00 | (u16)(mant >> 13);
  if (a >= 0x47800000) return sign | 0x7c00;
  if (a >= 0x38800000) {
    u32 h = ((ex - 112) << 10) | (mant >> 13);
    u32 rem = mant & 0x1fff;
    if (rem > 0x1000 || (rem == 0x1000 && (h & 1))) h++;
    return sign | (u16)h;
  }
  int shift = 126 - (int)ex;
  if (shift > 24) return sign;
  return sign | (u16)mk_shift_round_even(mant | 0x800000, shift);
}
__device__ float mk_float_from_half(u16 h) {
  u32 sign = (u32)(h & 0x8000) << 16, ex = (h >> 10) & 0x1f, mant = h & 0x3ff;
  if (ex == 31) return __uint_as_float(sign | 0x7f800000 | (mant << 13));
  if (ex == 0) return __uint_as_float(sign | __float_as_uint((float)mant * 5.9604644775390625e-8f));  // mant * 2^-24, exact
  return __uint_as_float(sign | ((ex + 112) << 23) | (mant << 13));
}
__device__ u16 mk_bf16_from_float(float f) {
  u32 u = __float_as_uint(f);
  if ((u & 0x7fffffff) > 0x7f800000) return (u16)((u >> 16) | 0x0040);
  return (u16)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}
__device__ float mk_float_from_bf16(u16 q) { return __uint_as_float((u32)q << 16); }

// ---- mk_compress_f16 ----
extern "C" __global__ void mk_compress_f16(const float *x, u16 *q, i64 n) {
  MK_FOR(i, n) q[i] = mk_half_from_float(x[i]);
}

// ---- mk_decompress_f16 ----
extern "C" __global__ void mk_decompress_f16(const u16 *q, float *x, i64 n) {
  MK_FOR(i, n) x[i] = mk_float_from_half(q[i]);
}

// ---- mk_compress_bf16 ----
// Four elements a thread where x is 16-byte and q 8-byte aligned (one 16-byte load, one 8-byte
// store: the dtype bf16 GEMMs' operand casts move gigabytes a step), the rest one at a time.
struct alignas(16) mk_f4 { float a, b, c, d; };
struct alignas(8) mk_u16x4 { u16 a, b, c, d; };
extern "C" __global__ void mk_compress_bf16(const float *x, u16 *q, i64 n) {
  i64 n4 = ((u64)x & 15) == 0 && ((u64)q & 7) == 0 ? n / 4 : 0;
  MK_FOR(i, n4) {
    mk_f4 v = ((const mk_f4 *)x)[i];
    ((mk_u16x4 *)q)[i] = mk_u16x4{mk_bf16_from_float(v.a), mk_bf16_from_float(v.b), mk_bf16_from_float(v.c),
                                  mk_bf16_from_float(v.d)};
  }
  MK_FOR(i, n - 4 * n4) q[4 * n4 + i] = mk_bf16_from_float(x[4 * n4 + i]);
}

// ---- mk_decompress_bf16 ----
extern "C" __global__ void mk_decompress_bf16(const u16 *q, float *x, i64 n) {
  MK_FOR(i, n) x[i] = mk_float_from_bf16(q[i]);
}

// ---- mk_int8_scales ----
// One block (MK_BLOCK threads) per row: max|x| / 127 (every NaN ignored: `>` is false for it,
// as in runtime/kernels/hook.c), 1 for a zero row.
extern "C" __global__ void mk_int8_scales(const float *x, float *scale, int rows, int n) {
  MK_FOR_BLOCKS(r, rows) {
    float mx = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
      float a = fabsf(x[r * n + i]);
      if (a > mx) mx = a;
    }
    mx = mk_block_max(mx);
    if (threadIdx.x == 0) scale[r] = mx > 0.0f ? mx / 127.0f : 1.0f;
  }
}

// ---- mk_compress_int8 ----
extern "C" __global__ void mk_compress_int8(const float *x, const float *scale, i8 *q, int rows, int n) {
  MK_FOR(i, (i64)rows * n) {
    float v = roundf(x[i] / scale[i / n]);
    if (v != v) v = 0.0f;
    q[i] = (i8)(v > 127.0f ? 127.0f : v < -127.0f ? -127.0f : v);
  }
}

// ---- mk_decompress_int8 ----
extern "C" __global__ void mk_decompress_int8(const i8 *q, const float *scale, float *x, int rows, int n) {
  MK_FOR(i, (i64)rows * n) x[i] = (float)q[i] * scale[i / n];
}

// ---- mk_record_stats ----
// One block of MK_BLOCK threads: out = {sum, max |x| over non-NaN, number of NaNs} for the
// host's record line (rt_record).
extern "C" __global__ void mk_record_stats(const float *x, double *out, i64 n) {
  double sum = 0.0, nans = 0.0;
  float mx = 0.0f;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
    sum += x[i];
    if (x[i] != x[i]) nans += 1.0;
    else mx = fmaxf(mx, fabsf(x[i]));
  }
  sum = mk_block_sum(sum);
  nans = mk_block_sum(nans);
  mx = mk_block_max(mx);
  if (threadIdx.x == 0) {
    out[0] = sum;
    out[1] = mx;
    out[2] = nans;
  }
}
