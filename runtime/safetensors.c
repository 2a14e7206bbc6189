// safetensors files: weights (--weights), checkpoints (--save/--resume) and anything else that
// holds named tensors.
//
// Layout: an 8-byte little-endian header length N, N bytes of JSON
//   {"NAME": {"dtype": "F32", "shape": [..], "data_offsets": [BEGIN, END]}, ...,
//    "__metadata__": {"KEY": "VALUE", ...}}
// (padded with spaces to a multiple of 8), then the data; offsets are relative to the data's
// start. The reader loads the whole file and checks every claim the header makes against it
// before anyone touches a tensor, so a truncated or hand-edited file gives a sentence, not a
// crash. It takes F32, F64, BF16 and F16 tensors and converts them to float32 when copied out
// (rt_st_copy); the writer writes F32. The writer goes through PATH.tmp, fsync and rename, so a
// crash mid-write leaves the previous file (say, the last good checkpoint) intact. Running out of
// memory, ours or cJSON's, ends the job (rt_alloc, error.c): it is never reported as a fault of
// the file.
//
// A set (rt_st_open) is what Hugging Face writes: one model.safetensors, or an index
// model.safetensors.index.json whose "weight_map" names the shard file of every tensor. Every
// shard is read whole, the index is checked against what the shards hold, and the tensors of all
// shards are sorted by name so that a lookup is a binary search.
#include "rt_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

// The reference implementation refuses headers over 100 MB; so do we.
enum { MAX_HEADER = 100 * 1000 * 1000 };
#define MAX_EXACT_INT 9007199254740992.0   // 2^53: beyond it a JSON number is not an exact offset

// ---- writing ----

static char *tmp_path_of(const char *path) {
  size_t n = strlen(path);
  char *tmp = rt_alloc(n + 5, "the name of a temporary file");
  memcpy(tmp, path, n);
  memcpy(tmp + n, ".tmp", 5);
  return tmp;
}

// fsync of the directory makes the rename itself durable.
static void sync_parent_dir(const char *path) {
  const char *slash = strrchr(path, '/');
  size_t n = slash ? (slash == path ? 1 : (size_t)(slash - path)) : 1;
  char *dir = rt_alloc(n + 1, "the name of a folder");
  memcpy(dir, slash ? path : ".", n);
  dir[n] = '\0';
  int fd = open(dir, O_RDONLY | O_DIRECTORY);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
  free(dir);
}

// cJSON fails only for want of memory here (every name and string is given).
static void *json_made(void *item) {
  if (!item)
    rt_out_of_memory(0, "the JSON header of a safetensors file");
  return item;
}

static void json_add(cJSON *array, cJSON *item) {
  if (!cJSON_AddItemToArray(array, json_made(item)))
    rt_out_of_memory(0, "the JSON header of a safetensors file");
}

static cJSON *build_header(int ntensors, const RtStTensor *tensors, int nmeta,
                           const char *const *meta) {
  cJSON *root = json_made(cJSON_CreateObject());
  if (nmeta > 0) {
    cJSON *m = json_made(cJSON_AddObjectToObject(root, "__metadata__"));
    for (int i = 0; i < nmeta; i++)
      json_made(cJSON_AddStringToObject(m, meta[2 * i], meta[2 * i + 1]));
  }
  uint64_t offset = 0;
  for (int i = 0; i < ntensors; i++) {
    const RtStTensor *t = &tensors[i];
    cJSON *obj = json_made(cJSON_AddObjectToObject(root, t->name));
    json_made(cJSON_AddStringToObject(obj, "dtype", "F32"));
    cJSON *shape = json_made(cJSON_AddArrayToObject(obj, "shape"));
    cJSON *offsets = json_made(cJSON_AddArrayToObject(obj, "data_offsets"));
    uint64_t numel = 1;
    for (int d = 0; d < t->rank; d++) {
      json_add(shape, cJSON_CreateNumber((double)t->dims[d]));
      numel *= (uint64_t)t->dims[d];
    }
    json_add(offsets, cJSON_CreateNumber((double)offset));
    offset += numel * sizeof(float);
    json_add(offsets, cJSON_CreateNumber((double)offset));
  }
  return root;
}

int rt_commit_file(FILE *f, bool ok, const char *tmp, const char *path) {
  ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
  int saved = errno;
  if (fclose(f) != 0 && ok) {
    ok = false;
    saved = errno;
  }
  if (!ok) {
    rt_fail("cannot write '%s': %s", tmp, strerror(saved));
    remove(tmp);
    return -1;
  }
  if (rename(tmp, path) != 0) {
    rt_fail("cannot rename '%s' to '%s': %s", tmp, path, strerror(errno));
    remove(tmp);
    return -1;
  }
  sync_parent_dir(path);
  return 0;
}

int rt_st_write(const char *path, int ntensors, const RtStTensor *tensors, int nmeta,
                const char *const *meta) {
  for (int i = 0; i < ntensors; i++) {
    if (strcmp(tensors[i].name, "__metadata__") == 0)
      return rt_fail("cannot write '%s': a tensor may not be called __metadata__", path);
    for (int j = 0; j < i; j++)
      if (strcmp(tensors[i].name, tensors[j].name) == 0)
        return rt_fail("cannot write '%s': two tensors are called '%s'", path,
                       tensors[i].name);
  }
  cJSON *root = build_header(ntensors, tensors, nmeta, meta);
  char *json = json_made(cJSON_PrintUnformatted(root));
  cJSON_Delete(root);
  char *tmp = tmp_path_of(path);
  size_t json_len = strlen(json);
  size_t header_len = (json_len + 7) / 8 * 8;
  unsigned char len_bytes[8];
  for (int i = 0; i < 8; i++)
    len_bytes[i] = (unsigned char)((uint64_t)header_len >> (8 * i));

  int status = -1;
  FILE *f = fopen(tmp, "wb");
  if (!f) {
    rt_fail("cannot create '%s': %s", tmp, strerror(errno));
    goto done;
  }
  bool ok = fwrite(len_bytes, 1, 8, f) == 8 && fwrite(json, 1, json_len, f) == json_len;
  for (size_t i = json_len; ok && i < header_len; i++)
    ok = fputc(' ', f) != EOF;
  for (int i = 0; ok && i < ntensors; i++) {
    size_t numel = 1;
    for (int d = 0; d < tensors[i].rank; d++)
      numel *= (size_t)tensors[i].dims[d];
    ok = numel == 0 || fwrite(tensors[i].data, sizeof(float), numel, f) == numel;
  }
  if (rt_commit_file(f, ok, tmp, path) == 0)
    status = 0;
done:
  free(json);
  free(tmp);
  return status;
}

// ---- dtypes ----

// Indexed by RtStDtype.
static const struct {
  const char *name;
  size_t size;
} dtypes[] = {{"F32", 4}, {"F64", 8}, {"BF16", 2}, {"F16", 2}};

const char *rt_st_dtype_name(RtStDtype d) {
  return dtypes[d].name;
}

static bool dtype_of(const char *name, RtStDtype *d) {
  for (int i = 0; i < (int)(sizeof dtypes / sizeof dtypes[0]); i++)
    if (strcmp(dtypes[i].name, name) == 0) {
      *d = (RtStDtype)i;
      return true;
    }
  return false;
}

static uint64_t load_le(const unsigned char *p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; i++)
    v |= (uint64_t)p[i] << (8 * i);
  return v;
}

static float float_of_bits(uint32_t bits) {
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

// bfloat16 is the upper half of a float32.
static float bf16_to_float(uint16_t h) {
  return float_of_bits((uint32_t)h << 16);
}

// IEEE half: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Every half is a float exactly.
static float f16_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (exponent == 0) {   // zero or subnormal: mantissa * 2^-24, exact in float
    float f = (float)mantissa * 0x1p-24f;
    return sign ? -f : f;
  }
  if (exponent == 31)    // infinity, or NaN with its payload
    return float_of_bits(sign | 0x7f800000u | mantissa << 13);
  return float_of_bits(sign | (exponent + 127 - 15) << 23 | mantissa << 13);
}

void rt_st_copy(const RtStEntry *t, float *dst) {
  const unsigned char *p = t->bytes;
  switch (t->dtype) {
  case RT_ST_F32:
    if (t->numel > 0)
      memcpy(dst, p, (size_t)t->numel * sizeof(float));
    return;
  case RT_ST_F64:
    for (int64_t i = 0; i < t->numel; i++) {
      uint64_t bits = load_le(p + 8 * i, 8);
      double d;
      memcpy(&d, &bits, sizeof d);
      dst[i] = (float)d;   // round to nearest
    }
    return;
  case RT_ST_BF16:
    for (int64_t i = 0; i < t->numel; i++)
      dst[i] = bf16_to_float((uint16_t)load_le(p + 2 * i, 2));
    return;
  case RT_ST_F16:
    for (int64_t i = 0; i < t->numel; i++)
      dst[i] = f16_to_float((uint16_t)load_le(p + 2 * i, 2));
    return;
  }
}

// ---- reading ----

static void release_file(unsigned char *buf, size_t size, bool mapped);

void rt_st_free(RtStFile *f) {
  for (int i = 0; i < f->ntensors; i++)
    free(f->tensors[i].name);
  for (int i = 0; i < 2 * f->nmeta; i++)
    free(f->meta[i]);
  free(f->tensors);
  free(f->meta);
  if (f->buffer)
    release_file(f->buffer, f->size, f->mapped);
  memset(f, 0, sizeof *f);
}

// A large file is mapped (read-only, its pages the page cache's: no copy, no fresh memory; a file
// changed while it is read is the caller's error), a small one read into memory. *mapped says
// which; release_file undoes either.
static int read_whole_file(const char *path, unsigned char **buf, size_t *size, bool *mapped) {
  int fd = open(path, O_RDONLY);
  if (fd < 0)
    return rt_fail("cannot open '%s': %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    close(fd);
    return rt_fail("cannot read '%s': it is not a regular file", path);
  }
  size_t n = (size_t)sb.st_size;
  *mapped = false;
  if (n >= RT_BIG_PAGE && !rt_plain_memory()) {
    void *m = mmap(NULL, n, PROT_READ, MAP_PRIVATE | MAP_POPULATE, fd, 0);
    if (m != MAP_FAILED) {
      close(fd);
      *buf = m;
      *size = n;
      *mapped = true;
      return 0;
    }
  }
  unsigned char *b = rt_alloc(n ? n : 1, "a safetensors file read whole");
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, b + got, n - got);
    if (r < 0 && errno == EINTR)
      continue;
    if (r <= 0) {
      int saved = r < 0 ? errno : EIO;
      free(b);
      close(fd);
      return rt_fail("cannot read '%s': %s", path, strerror(saved));
    }
    got += (size_t)r;
  }
  close(fd);
  *buf = b;
  *size = n;
  return 0;
}

static void release_file(unsigned char *buf, size_t size, bool mapped) {
  if (mapped)
    munmap(buf, size);
  else
    free(buf);
}

// A JSON number that is an exact non-negative integer.
static bool get_count(const cJSON *item, uint64_t *v) {
  if (!cJSON_IsNumber(item))
    return false;
  double d = item->valuedouble;
  if (!(d >= 0 && d <= MAX_EXACT_INT) || d != (double)(uint64_t)d)
    return false;
  *v = (uint64_t)d;
  return true;
}

typedef struct Range {
  uint64_t begin, end;
  int index;
} Range;

static int range_cmp(const void *a, const void *b) {
  const Range *x = a, *y = b;
  if (x->begin != y->begin)
    return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

static int name_cmp(const void *a, const void *b) {
  return strcmp(*(char *const *)a, *(char *const *)b);
}

static int read_metadata(const char *path, const cJSON *obj, RtStFile *out) {
  if (!cJSON_IsObject(obj))
    return rt_fail("'%s': __metadata__ is not a JSON object", path);
  int n = cJSON_GetArraySize(obj);
  const char *what = "the metadata of a safetensors file";
  out->meta = rt_calloc(2 * (size_t)n + 1, sizeof(char *), what);
  for (const cJSON *kv = obj->child; kv; kv = kv->next) {
    if (!cJSON_IsString(kv))
      return rt_fail("'%s': __metadata__ value '%s' is not a string", path, kv->string);
    out->meta[2 * out->nmeta] = rt_strdup(kv->string, what);
    out->meta[2 * out->nmeta + 1] = rt_strdup(kv->valuestring, what);
    out->nmeta++;
  }
  return 0;
}

// entry = {"dtype": ("F32" | "F64" | "BF16" | "F16"), "shape": [int*], "data_offsets": [int, int]}
static int read_entry(const char *path, const cJSON *obj, const unsigned char *data,
                      uint64_t data_size, RtStEntry *t, Range *range) {
  const char *name = obj->string;
  if (!cJSON_IsObject(obj))
    return rt_fail("'%s': the header entry for '%s' is not a JSON object", path, name);
  const cJSON *dtype = cJSON_GetObjectItemCaseSensitive(obj, "dtype");
  const cJSON *shape = cJSON_GetObjectItemCaseSensitive(obj, "shape");
  const cJSON *offsets = cJSON_GetObjectItemCaseSensitive(obj, "data_offsets");
  if (!cJSON_IsString(dtype) || !cJSON_IsArray(shape) || !cJSON_IsArray(offsets))
    return rt_fail("'%s': tensor '%s' needs a string \"dtype\", an array \"shape\" and an array "
                   "\"data_offsets\"", path, name);
  if (!dtype_of(dtype->valuestring, &t->dtype))
    return rt_fail("'%s': tensor '%s' has dtype %s; only F32, F64, BF16 and F16 tensors are "
                   "supported", path, name, dtype->valuestring);
  size_t size = dtypes[t->dtype].size;
  int rank = cJSON_GetArraySize(shape);
  if (rank > RT_MAX_RANK)
    return rt_fail("'%s': tensor '%s' has %d dimensions; at most %d are supported", path, name,
                   rank, RT_MAX_RANK);
  t->rank = rank;
  int d = 0;
  bool empty = false;
  for (const cJSON *dim = shape->child; dim; dim = dim->next, d++) {
    uint64_t v;
    if (!get_count(dim, &v))
      return rt_fail("'%s': tensor '%s' has a shape entry that is not a non-negative integer",
                     path, name);
    t->dims[d] = (int64_t)v;
    empty = empty || v == 0;
  }
  // numel saturates just past what the data section can hold; the size check reports it.
  uint64_t numel = empty ? 0 : 1;
  for (d = 0; d < rank && numel > 0; d++) {
    if (numel > data_size / (uint64_t)t->dims[d] + 1) {
      numel = data_size + 1;
      break;
    }
    numel *= (uint64_t)t->dims[d];
  }
  uint64_t begin, end;
  if (cJSON_GetArraySize(offsets) != 2 || !get_count(offsets->child, &begin) ||
      !get_count(offsets->child->next, &end))
    return rt_fail("'%s': tensor '%s' needs \"data_offsets\": [BEGIN, END] with non-negative "
                   "integers", path, name);
  if (begin > end || end > data_size)
    return rt_fail("'%s': tensor '%s' has data_offsets [%llu, %llu] outside the file's %llu "
                   "data bytes (is the file truncated?)", path, name, (unsigned long long)begin,
                   (unsigned long long)end, (unsigned long long)data_size);
  char buf[160];
  if (numel > data_size / size)
    return rt_fail("'%s': tensor '%s' of shape %s does not fit in the file's %llu data bytes",
                   path, name, rt_shape_str(buf, sizeof buf, t->rank, t->dims),
                   (unsigned long long)data_size);
  if (end - begin != numel * size)
    return rt_fail("'%s': tensor '%s' of shape %s needs %llu bytes but its data_offsets span "
                   "%llu", path, name, rt_shape_str(buf, sizeof buf, t->rank, t->dims),
                   (unsigned long long)(numel * size),
                   (unsigned long long)(end - begin));
  t->numel = (int64_t)numel;
  t->bytes = data + begin;
  range->begin = begin;
  range->end = end;
  return 0;
}

static int read_header(const char *path, const cJSON *root, const unsigned char *data,
                       uint64_t data_size, RtStFile *out) {
  if (!cJSON_IsObject(root))
    return rt_fail("'%s': the safetensors header is not a JSON object", path);
  int n = 0;
  for (const cJSON *it = root->child; it; it = it->next)
    n += strcmp(it->string, "__metadata__") != 0;
  const char *what = "the tensors of a safetensors file";
  out->tensors = rt_calloc((size_t)n + 1, sizeof(RtStEntry), what);
  Range *ranges = rt_calloc((size_t)n + 1, sizeof(Range), what);
  char **names = rt_calloc((size_t)n + 1, sizeof(char *), what);
  int status = -1;
  for (const cJSON *it = root->child; it; it = it->next) {
    if (strcmp(it->string, "__metadata__") == 0) {
      if (out->meta) {
        rt_fail("'%s': the header has two __metadata__ entries", path);
        goto done;
      }
      if (read_metadata(path, it, out) != 0)
        goto done;
      continue;
    }
    int i = out->ntensors;
    RtStEntry *t = &out->tensors[i];
    t->name = rt_strdup(it->string, what);
    out->ntensors++;
    if (read_entry(path, it, data, data_size, t, &ranges[i]) != 0)
      goto done;
    ranges[i].index = i;
    names[i] = t->name;
  }
  qsort(names, (size_t)n, sizeof(char *), name_cmp);
  for (int i = 1; i < n; i++)
    if (strcmp(names[i - 1], names[i]) == 0) {
      rt_fail("'%s': the header names tensor '%s' twice", path, names[i]);
      goto done;
    }
  qsort(ranges, (size_t)n, sizeof(Range), range_cmp);
  uint64_t covered = 0;
  int last = -1;
  for (int i = 0; i < n; i++) {
    if (ranges[i].begin == ranges[i].end)
      continue;
    if (ranges[i].begin < covered) {
      rt_fail("'%s': the data of tensors '%s' and '%s' overlap", path,
              out->tensors[ranges[last].index].name, out->tensors[ranges[i].index].name);
      goto done;
    }
    covered = ranges[i].end;
    last = i;
  }
  status = 0;
done:
  free(ranges);
  free(names);
  return status;
}

// Parses the file read whole into buf (size bytes; mapped: read_whole_file's), which *out takes.
static int parse_file(const char *path, unsigned char *buf, size_t size, bool mapped, RtStFile *out) {
  memset(out, 0, sizeof *out);
  out->buffer = buf;
  out->size = size;
  out->mapped = mapped;
  if (size < 8) {
    rt_fail("'%s' is not a safetensors file: it has %zu bytes, fewer than the 8-byte header "
            "length", path, size);
    goto fail;
  }
  uint64_t header_len = 0;
  for (int i = 0; i < 8; i++)
    header_len |= (uint64_t)buf[i] << (8 * i);
  if (header_len > size - 8 || header_len > MAX_HEADER) {
    rt_fail("'%s' is not a safetensors file or is truncated: it declares a %llu-byte header "
            "but has %zu bytes", path, (unsigned long long)header_len, size);
    goto fail;
  }
  const char *json = (const char *)buf + 8;
  const char *parse_end = NULL;
  cJSON *root = cJSON_ParseWithLengthOpts(json, (size_t)header_len, &parse_end, false);
  if (!root) {
    const char *at = cJSON_GetErrorPtr();
    long where = at && at >= json && at <= json + header_len ? (long)(at - json) : -1;
    rt_fail("'%s': the safetensors header is not valid JSON (near byte %ld of the header)",
            path, where);
    goto fail;
  }
  for (const char *p = parse_end; p && p < json + header_len; p++)
    if (*p != ' ' && *p != '\n' && *p != '\r' && *p != '\t') {
      cJSON_Delete(root);
      rt_fail("'%s': the safetensors header has text after its JSON object", path);
      goto fail;
    }
  int status = read_header(path, root, buf + 8 + header_len, size - 8 - header_len, out);
  cJSON_Delete(root);
  if (status != 0)
    goto fail;
  return 0;
fail:
  rt_st_free(out);
  return -1;
}

int rt_st_read(const char *path, RtStFile *out) {
  memset(out, 0, sizeof *out);
  unsigned char *buf = NULL;
  size_t size = 0;
  bool mapped;
  if (read_whole_file(path, &buf, &size, &mapped) != 0)
    return -1;
  return parse_file(path, buf, size, mapped, out);
}

const RtStEntry *rt_st_find(const RtStFile *f, const char *name) {
  for (int i = 0; i < f->ntensors; i++)
    if (strcmp(f->tensors[i].name, name) == 0)
      return &f->tensors[i];
  return NULL;
}

const char *rt_st_meta(const RtStFile *f, const char *key) {
  for (int i = 0; i < f->nmeta; i++)
    if (strcmp(f->meta[2 * i], key) == 0)
      return f->meta[2 * i + 1];
  return NULL;
}

// ---- sets: one file, or a Hugging Face index and its shards ----

// A tensor and the file of the set that holds it.
typedef struct Located {
  const RtStEntry *entry;
  int file;
} Located;

// A tensor the index lists and the file it names for it.
typedef struct Mapped {
  const char *name;
  int file;
} Mapped;

static int located_cmp(const void *a, const void *b) {
  return strcmp(((const Located *)a)->entry->name, ((const Located *)b)->entry->name);
}

static int mapped_cmp(const void *a, const void *b) {
  return strcmp(((const Mapped *)a)->name, ((const Mapped *)b)->name);
}

static int entry_cmp(const void *key, const void *elem) {
  return strcmp((const char *)key, (*(const RtStEntry *const *)elem)->name);
}

void rt_st_set_free(RtStSet *s) {
  for (int i = 0; i < s->nfiles; i++) {
    if (s->files)
      rt_st_free(&s->files[i]);
    if (s->paths)
      free(s->paths[i]);
  }
  free(s->files);
  free(s->paths);
  free(s->by_name);
  memset(s, 0, sizeof *s);
}

const RtStEntry *rt_st_set_find(const RtStSet *s, const char *name) {
  if (s->ntensors == 0)
    return NULL;
  const RtStEntry *const *hit =
      bsearch(name, s->by_name, (size_t)s->ntensors, sizeof *s->by_name, entry_cmp);
  return hit ? *hit : NULL;
}

static char *path_join(const char *dir, size_t dir_len, const char *name) {
  size_t n = strlen(name);
  char *p = rt_alloc(dir_len + n + 2, "the name of a file");
  memcpy(p, dir, dir_len);
  p[dir_len] = '/';
  memcpy(p + dir_len + 1, name, n + 1);
  return p;
}

// A shard named in an index is relative to the index's folder unless absolute.
static char *resolve_beside(const char *index, const char *name) {
  const char *slash = strrchr(index, '/');
  if (name[0] == '/' || !slash)
    return rt_strdup(name, "the name of a file");
  return path_join(index, (size_t)(slash - index), name);
}

// Every tensor of every file of the set, sorted by name; a name in two files is an error.
static Located *sort_located(RtStSet *s, const char *index) {
  int n = 0;
  for (int k = 0; k < s->nfiles; k++)
    n += s->files[k].ntensors;
  Located *all = rt_calloc((size_t)n + 1, sizeof(Located), "the tensors of a safetensors set");
  int i = 0;
  for (int k = 0; k < s->nfiles; k++)
    for (int j = 0; j < s->files[k].ntensors; j++)
      all[i++] = (Located){&s->files[k].tensors[j], k};
  qsort(all, (size_t)n, sizeof(Located), located_cmp);
  for (i = 1; i < n; i++)
    if (strcmp(all[i - 1].entry->name, all[i].entry->name) == 0) {
      rt_fail("index '%s': tensor '%s' is in two shards, '%s' and '%s'", index,
              all[i].entry->name, s->paths[all[i - 1].file], s->paths[all[i].file]);
      free(all);
      return NULL;
    }
  s->ntensors = n;
  s->by_name = rt_calloc((size_t)n + 1, sizeof(RtStEntry *), "the tensors of a safetensors set");
  for (i = 0; i < n; i++)
    s->by_name[i] = all[i].entry;
  return all;
}

// The index says exactly where every tensor is: each listed tensor is in the file it names, and
// each tensor of a shard is listed. all is sorted by name (sort_located); mapped is sorted here.
static int check_index(const char *index, const RtStSet *s, const Located *all,
                       Mapped *mapped, int nmapped) {
  qsort(mapped, (size_t)nmapped, sizeof(Mapped), mapped_cmp);
  for (int i = 1; i < nmapped; i++)
    if (strcmp(mapped[i - 1].name, mapped[i].name) == 0)
      return rt_fail("index '%s' lists tensor '%s' twice", index, mapped[i].name);
  for (int i = 0; i < nmapped; i++) {
    RtStEntry key = {.name = (char *)mapped[i].name};
    const Located *at = bsearch(&(Located){&key, 0}, all, (size_t)s->ntensors, sizeof(Located),
                                located_cmp);
    if (!at)
      return rt_fail("index '%s' maps tensor '%s' to '%s', which does not hold it (nor does any "
                     "other shard)", index, mapped[i].name, s->paths[mapped[i].file]);
    if (at->file != mapped[i].file)
      return rt_fail("index '%s' maps tensor '%s' to '%s', which does not hold it (it is in "
                     "'%s')", index, mapped[i].name, s->paths[mapped[i].file],
                     s->paths[at->file]);
  }
  for (int i = 0; i < s->ntensors; i++)
    if (!bsearch(&(Mapped){all[i].entry->name, 0}, mapped, (size_t)nmapped, sizeof(Mapped),
                 mapped_cmp))
      return rt_fail("shard '%s' holds tensor '%s', which index '%s' does not list",
                     s->paths[all[i].file], all[i].entry->name, index);
  return 0;
}

// The set's file for shard NAME of the index, added when new.
static int shard_file(RtStSet *s, const char *index, const char *name) {
  char *path = resolve_beside(index, name);
  for (int k = s->nfiles - 1; k >= 0; k--)
    if (strcmp(s->paths[k], path) == 0) {
      free(path);
      return k;
    }
  s->paths[s->nfiles] = path;
  return s->nfiles++;
}

// index = {"metadata": {..}, "weight_map": {NAME: FILE, ..}}; *mapped gets one row per NAME.
static int read_weight_map(const char *index, const cJSON *root, RtStSet *s, Mapped **mapped,
                           int *nmapped) {
  const cJSON *map = cJSON_IsObject(root) ? cJSON_GetObjectItemCaseSensitive(root, "weight_map")
                                          : NULL;
  if (!cJSON_IsObject(map))
    return rt_fail("'%s' is neither a safetensors file nor a Hugging Face index (JSON with a "
                   "\"weight_map\" object)", index);
  int n = cJSON_GetArraySize(map);
  if (n == 0)
    return rt_fail("index '%s': its \"weight_map\" lists no tensors", index);
  const char *what = "the weight map of a Hugging Face index";
  s->files = rt_calloc((size_t)n, sizeof(RtStFile), what);
  s->paths = rt_calloc((size_t)n, sizeof(char *), what);
  *mapped = rt_calloc((size_t)n, sizeof(Mapped), what);
  for (const cJSON *kv = map->child; kv; kv = kv->next) {
    if (!cJSON_IsString(kv) || !kv->valuestring[0])
      return rt_fail("index '%s': the \"weight_map\" entry of tensor '%s' is not a file name",
                     index, kv->string);
    (*mapped)[(*nmapped)++] = (Mapped){kv->string, shard_file(s, index, kv->valuestring)};
  }
  return 0;
}

// Reads the index (text, size bytes) and every shard it names.
static int open_index(const char *index, const char *text, size_t size, RtStSet *s) {
  cJSON *root = cJSON_ParseWithLength(text, size);
  Mapped *mapped = NULL;
  Located *all = NULL;
  int nmapped = 0, status = -1;
  if (read_weight_map(index, root, s, &mapped, &nmapped) != 0)
    goto done;
  for (int k = 0; k < s->nfiles; k++)
    if (rt_st_read(s->paths[k], &s->files[k]) != 0) {
      char why[1024];
      snprintf(why, sizeof why, "%s", rt_last_error());
      rt_fail("index '%s': %s", index, why);
      goto done;
    }
  all = sort_located(s, index);
  if (all)
    status = check_index(index, s, all, mapped, nmapped);
done:
  free(all);
  free(mapped);
  cJSON_Delete(root);
  return status;
}

// An 8-byte header length that fits the file, then the header's '{'.
static bool looks_like_safetensors(const unsigned char *buf, size_t size) {
  return size >= 9 && load_le(buf, 8) <= size - 8 && buf[8] == '{';
}

// JSON text: its first byte that is not white space (after a UTF-8 byte order mark, which cJSON
// skips too) is '{'.
static bool looks_like_json(const unsigned char *buf, size_t size) {
  size_t i = size >= 3 && memcmp(buf, "\xef\xbb\xbf", 3) == 0 ? 3 : 0;
  while (i < size && (buf[i] == ' ' || buf[i] == '\n' || buf[i] == '\r' || buf[i] == '\t'))
    i++;
  return i < size && buf[i] == '{';
}

// A safetensors file or a Hugging Face index, told apart by content.
static int open_file(const char *path, RtStSet *s) {
  unsigned char *buf = NULL;
  size_t size = 0;
  bool mapped;
  if (read_whole_file(path, &buf, &size, &mapped) != 0)
    return -1;
  if (!looks_like_safetensors(buf, size) && looks_like_json(buf, size)) {
    int status = open_index(path, (const char *)buf, size, s);
    release_file(buf, size, mapped);
    return status;
  }
  const char *what = "a safetensors set";
  s->files = rt_calloc(1, sizeof(RtStFile), what);
  s->paths = rt_calloc(1, sizeof(char *), what);
  s->paths[0] = rt_strdup(path, what);
  s->nfiles = 1;
  if (parse_file(path, buf, size, mapped, &s->files[0]) != 0)
    return -1;
  Located *all = sort_located(s, path);   // one file's names are distinct (parse_file)
  if (!all)
    return -1;
  free(all);
  return 0;
}

static bool exists(const char *path) {
  struct stat sb;
  return stat(path, &sb) == 0;
}

// A folder as Hugging Face writes it: model.safetensors or model.safetensors.index.json.
static int open_folder(const char *dir, RtStSet *s) {
  size_t n = strlen(dir);
  while (n > 1 && dir[n - 1] == '/')
    n--;
  char *single = path_join(dir, n, "model.safetensors");
  char *index = path_join(dir, n, "model.safetensors.index.json");
  bool has_single = exists(single), has_index = exists(index);
  int status;
  if (has_single && has_index)
    status = rt_fail("folder '%s' holds both model.safetensors and model.safetensors.index.json; "
                     "give the path of the one to read", dir);
  else if (!has_single && !has_index)
    status = rt_fail("folder '%s' holds neither model.safetensors nor "
                     "model.safetensors.index.json", dir);
  else
    status = open_file(has_index ? index : single, s);
  free(single);
  free(index);
  return status;
}

int rt_st_open(const char *path, RtStSet *out) {
  memset(out, 0, sizeof *out);
  struct stat sb;
  int status;
  if (stat(path, &sb) != 0)
    status = rt_fail("cannot open '%s': %s", path, strerror(errno));
  else if (S_ISDIR(sb.st_mode))
    status = open_folder(path, out);
  else
    status = open_file(path, out);
  if (status != 0)
    rt_st_set_free(out);
  return status;
}
