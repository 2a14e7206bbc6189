// Checkpoints that any layout can resume, and --weights. A checkpoint is a set of boxes of the
// whole tensors (shard.c), each labelled with its global shape and offsets. Loading intersects the
// box a rank needs with every box on disk (hyper-rectangle intersection) and checks that the union
// covers it, so a checkpoint written by 4 ranks resumes on 1, 2 or 8. --weights reads the same
// boxes from whole tensors too: one safetensors file, or a Hugging Face index or folder of them
// (rt_st_open), in any of the dtypes safetensors.c converts to float32. A checkpoint's faults (a
// missing shard, a torn or hand-edited file) are returned errors; running out of memory ends the
// job (rt_alloc, error.c).
//
// Layer: above shard.c (boxes) and world.c (saving is collective: rt_world_agree).
#include "moert.h"
#include "rt_internal.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char checkpoint_v1[] = "moec-checkpoint-1";
static const char checkpoint_v2[] = "moec-checkpoint-2";

// ---- small text helpers ----

static const char *shape_text(char *buf, size_t len, int rank, const int64_t *dims) {
  size_t n = (size_t)snprintf(buf, len, "[");
  for (int d = 0; d < rank && n < len; d++)
    n += (size_t)snprintf(buf + n, len - n, "%s%lld", d ? "," : "", (long long)dims[d]);
  if (n < len)
    snprintf(buf + n, len - n, "]");
  return buf;
}

// list = "[" (int ("," int)*)? "]"; returns the count, or -1.
static int parse_list(const char **s, int64_t *out, int max) {
  const char *p = *s;
  if (*p++ != '[')
    return -1;
  int n = 0;
  if (*p == ']') {
    *s = p + 1;
    return 0;
  }
  for (;;) {
    if (n == max || *p < '0' || *p > '9')
      return -1;
    char *end;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    if (errno)
      return -1;
    out[n++] = v;
    p = end;
    if (*p == ']') {
      *s = p + 1;
      return n;
    }
    if (*p++ != ',')
      return -1;
  }
}

// "global=[4,8,8] offset=[2,0,0]"
static bool parse_box(const char *text, int *rank, int64_t *global, int64_t *off) {
  const char *s = text;
  if (strncmp(s, "global=", 7) != 0)
    return false;
  s += 7;
  int n = parse_list(&s, global, RT_MAX_RANK);
  if (n < 0 || strncmp(s, " offset=", 8) != 0)
    return false;
  s += 8;
  int m = parse_list(&s, off, RT_MAX_RANK);
  if (m != n || *s != '\0')
    return false;
  *rank = n;
  return true;
}

static char *str_printf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static char *str_printf(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  char *s = rt_alloc((size_t)n + 1, "a checkpoint's text");
  va_start(ap, fmt);
  vsnprintf(s, (size_t)n + 1, fmt, ap);
  va_end(ap);
  return s;
}

static const char *optimizer_of(const RtModel *m) {
  return m->opt == RT_OPT_ADAMW ? "adamw" : "sgd";
}

// The shard file of rank `rank` of `world`: PATH.rank<R>-of-<P>.safetensors.
static char *shard_path(const char *path, int rank, int world) {
  return str_printf("%s.rank%d-of-%d.safetensors", path, rank, world);
}

static const char *base_name(const char *path) {
  const char *slash = strrchr(path, '/');
  return slash ? slash + 1 : path;
}

// A shard named in an index is relative to the index's folder unless absolute.
static char *resolve_beside(const char *index_path, const char *name) {
  const char *slash = strrchr(index_path, '/');
  if (name[0] == '/' || !slash)
    return rt_strdup(name, "a checkpoint's text");
  return str_printf("%.*s/%s", (int)(slash - index_path), index_path, name);
}

// ---- writing ----

// Writes text to PATH atomically: PATH.tmp, fsync, rename, fsync of the folder.
static int write_text_atomic(const char *path, const char *text) {
  char *tmp = str_printf("%s.tmp", path);
  int status = -1;
  FILE *f = fopen(tmp, "wb");
  if (!f) {
    rt_fail("cannot create '%s': %s", tmp, strerror(errno));
    goto done;
  }
  size_t len = strlen(text);
  if (rt_commit_file(f, fwrite(text, 1, len, f) == len, tmp, path) == 0)
    status = 0;
done:
  free(tmp);
  return status;
}

// This rank's shard file: the boxes it owns of every parameter and moment.
static int write_shard(const RtComm *c, const char *file, const RtModel *m, const RtRanks *r, int64_t step,
                       const float *params, const float *opt_m, const float *opt_v, const bool *skip) {
  enum { FIXED_META = 7 };
  int per = m->opt == RT_OPT_ADAMW ? 3 : 1;
  size_t cap = (size_t)m->nparams * per + 1;
  const char *what = "the table of a checkpoint shard";
  RtStTensor *tensors = rt_calloc(cap, sizeof(RtStTensor), what);
  char **names = rt_calloc(cap, sizeof(char *), what);
  char **keys = rt_calloc(cap, sizeof(char *), what);
  char **boxes = rt_calloc(cap, sizeof(char *), what);
  const char **meta = rt_calloc(2 * (cap + FIXED_META), sizeof(char *), what);
  int n = 0;
  char step_text[32], world_text[16], rank_text[16], layout_text[96];
  snprintf(step_text, sizeof step_text, "%lld", (long long)step);
  snprintf(world_text, sizeof world_text, "%d", rt_all_size(c));
  snprintf(rank_text, sizeof rank_text, "%d", rt_all_rank(c));
  // "pp=P " with pipeline stages only (one stage's shards as before)
  int at = r->stages > 1 ? snprintf(layout_text, sizeof layout_text, "pp=%d ", r->stages) : 0;
  snprintf(layout_text + at, sizeof layout_text - (size_t)at, "dp=%d mp=%d ep=%d esp=%d", r->dp, r->mp, r->ep, r->esp);
  const char *fixed[2 * FIXED_META] = {"format", checkpoint_v2, "model", m->name,
                                       "optimizer", optimizer_of(m), "step", step_text,
                                       "world", world_text, "rank", rank_text,
                                       "layout", layout_text};
  memcpy(meta, fixed, sizeof fixed);
  const float *src[3] = {params, opt_m, opt_v};
  const char *prefix[3] = {"", "opt.m.", "opt.v."};
  int64_t (*dims)[4] = rt_calloc(cap, sizeof *dims, what);
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    bool owner = rt_shard_owner(p, r);
    if (skip && skip[i])   // an earlier pipeline stage writes it (a tied embedding)
      continue;
    for (int k = 0; k < (p->frozen ? 1 : per); k++) {   // a frozen parameter has no moments
      // The owner writes the shard; a sharded moment's rows come from each member that keeps them.
      bool rows = k > 0 && p->shard;
      int64_t off[4], lo, numel;
      rt_box_of(c, p, r, k > 0, off, dims[n], &lo, &numel);
      if (rows ? numel == 0 : !owner)
        continue;
      char global[160], offset[160];
      shape_text(global, sizeof global, p->rank, p->global_dims);
      shape_text(offset, sizeof offset, p->rank, off);
      names[n] = str_printf("%s%s", prefix[k], p->name);
      keys[n] = str_printf("shard.%s%s", prefix[k], p->name);
      boxes[n] = str_printf("global=%s offset=%s", global, offset);
      tensors[n] = (RtStTensor){names[n], p->rank, dims[n], src[k] + p->offset + lo};
      meta[2 * (FIXED_META + n)] = keys[n];
      meta[2 * (FIXED_META + n) + 1] = boxes[n];
      n++;
    }
  }
  int status = rt_st_write(file, n, tensors, FIXED_META + n, meta);
  for (int i = 0; i < n; i++) {
    free(names[i]);
    free(keys[i]);
    free(boxes[i]);
  }
  free(names);
  free(keys);
  free(boxes);
  free(meta);
  free(tensors);
  free(dims);
  return status;
}

char *rt_json_quote(const char *s, const char *what) {
  cJSON *item = cJSON_CreateString(s);
  char *text = item ? cJSON_PrintUnformatted(item) : NULL;
  cJSON_Delete(item);
  if (!text)
    rt_out_of_memory(0, what);
  return text;
}

// The index: JSON text, one shard file per rank, named relative to the index's folder.
// Every rank of every pipeline stage writes a shard: world is the whole job's.
static char *index_text(const char *path, const RtModel *m, const RtRanks *r, int world, int64_t step) {
  char *model = rt_json_quote(m->name, "the index of a checkpoint");
  char pp_json[32] = "";   // "pp" with pipeline stages only (the index of one stage as before)
  if (r->stages > 1) snprintf(pp_json, sizeof pp_json, "\"pp\": %d, ", r->stages);
  char *text = str_printf("{\n  \"format\": \"%s\",\n  \"model\": %s,\n  "
                          "\"optimizer\": \"%s\",\n  \"step\": %lld,\n  \"world\": %d,\n  "
                          "\"layout\": {%s\"dp\": %d, \"mp\": %d, \"ep\": %d, \"esp\": %d},\n  "
                          "\"shards\": [",
                          checkpoint_v2, model, optimizer_of(m), (long long)step, world, pp_json, r->dp,
                          r->mp, r->ep, r->esp);
  free(model);
  for (int k = 0; k < world; k++) {
    char *name = shard_path(base_name(path), k, world);
    char *quoted = rt_json_quote(name, "the index of a checkpoint");
    char *longer = str_printf("%s%s\n    %s", text, k ? "," : "", quoted);
    free(name);
    free(quoted);
    free(text);
    text = longer;
  }
  char *whole = str_printf("%s\n  ]\n}\n", text);
  free(text);
  return whole;
}

int rt_checkpoint_save(RtComm *c, const char *path, const RtModel *m, const RtRanks *r,
                       int64_t step, const float *params, const float *opt_m,
                       const float *opt_v, const bool *skip) {
  char *file = shard_path(path, rt_all_rank(c), rt_all_size(c));
  int status = write_shard(c, file, m, r, step, params, opt_m, opt_v, skip);
  free(file);
  // Every shard is durable (written, fsynced, renamed) before the index that names them.
  if (rt_world_agree(c, status) != 0)
    return -1;
  status = 0;
  if (rt_all_rank(c) == 0) {
    char *text = index_text(path, m, r, rt_all_size(c), step);
    status = write_text_atomic(path, text);
    free(text);
  }
  return rt_world_agree(c, status);
}

// ---- reading ----

// A box of a tensor, [lo, hi) in each dimension of its global shape.
typedef struct Box {
  int64_t lo[RT_MAX_RANK], hi[RT_MAX_RANK];
} Box;

// One tensor a rank needs: its destination box, the parts of it the sources filled, whether any
// source had it.
typedef struct Wanted {
  char *name;
  const RtParam *param;
  float *dst;
  int64_t off[4], dims[4], numel;   // the box: the rank's shard, or its rows of a sharded moment
  Box *filled;
  int nfilled, max_filled;
  bool found;
} Wanted;

typedef struct Wants {
  int n;
  Wanted *w;
} Wants;

static void wants_free(Wants *ws) {
  for (int i = 0; i < ws->n; i++) {
    free(ws->w[i].name);
    free(ws->w[i].filled);
  }
  free(ws->w);
  memset(ws, 0, sizeof *ws);
}

static int wants_make(Wants *ws, const RtComm *c, const RtModel *m, const RtRanks *r, float *params,
                      float *opt_m, float *opt_v) {
  int per = opt_m ? 3 : 1;
  ws->n = 0;
  ws->w = rt_calloc((size_t)m->nparams * per + 1, sizeof(Wanted), "the tensors to load");
  float *dst[3] = {params, opt_m, opt_v};
  const char *prefix[3] = {"", "opt.m.", "opt.v."};
  for (int i = 0; i < m->nparams; i++) {
    const RtParam *p = &m->params[i];
    for (int k = 0; k < (p->frozen ? 1 : per); k++) {   // a frozen parameter has no moments
      Wanted *w = &ws->w[ws->n++];
      int64_t lo;
      w->param = p;
      rt_box_of(c, p, r, k > 0, w->off, w->dims, &lo, &w->numel);
      w->dst = dst[k] + p->offset + lo;
      w->name = str_printf("%s%s", prefix[k], p->name);
    }
  }
  return 0;
}

static bool same_dims(int rank, const int64_t *a, const int64_t *b) {
  for (int d = 0; d < rank; d++)
    if (a[d] != b[d])
      return false;
  return true;
}

// The tensor's elements as float32: the file's own bytes when they are F32, else converted
// into *converted (freed by the caller).
static const void *floats_of(const RtStEntry *t, float **converted) {
  *converted = NULL;
  if (t->dtype == RT_ST_F32 || t->numel == 0)
    return t->bytes;
  *converted = rt_alloc((size_t)t->numel * sizeof(float), "a tensor converted to float32");
  rt_st_copy(t, *converted);
  return *converted;
}

// A tensor the model needs is not in path: a file of a Hugging Face model (its names start with
// "model.") gets the command that converts it.
static int missing_tensor(const char *path, const RtStSet *set, const char *name) {
  for (int i = 0; i < set->ntensors; i++)
    if (strncmp(set->by_name[i]->name, "model.", 6) == 0)
      return rt_fail("'%s' has no tensor '%s': it holds a Hugging Face model's names ('%s'); convert the "
                     "checkpoint's folder first: moec import-hf DIR -o PREFIX writes PREFIX.moe to build "
                     "and PREFIX.safetensors for --weights", path, name, set->by_name[i]->name);
  return rt_fail("'%s' has no tensor '%s'", path, name);
}

// A LoRA model's adapter or its scale (W.lora_A, W.lora_B, W.lora_scale).
static bool lora_param(const char *name) {
  const char *dot = strrchr(name, '.');
  return dot && (strcmp(dot, ".lora_A") == 0 || strcmp(dot, ".lora_B") == 0 || strcmp(dot, ".lora_scale") == 0);
}

// Copies what files of whole tensors (--weights, moec-checkpoint-1) hold of every wanted one; a
// LoRA adapter they lack keeps its initial value (the base model's weights, then --adapter).
static int take_whole(const char *path, const RtStSet *set, Wants *ws) {
  int64_t zero[RT_MAX_RANK] = {0};
  for (int i = 0; i < ws->n; i++) {
    Wanted *w = &ws->w[i];
    const RtParam *p = w->param;
    const RtStEntry *t = rt_st_set_find(set, w->name);
    if (!t && lora_param(w->name))
      continue;
    if (!t)
      return missing_tensor(path, set, w->name);
    if (t->rank != p->rank || !same_dims(p->rank, t->dims, p->global_dims)) {
      char have[160], want[160];
      return rt_fail("'%s': tensor '%s' has shape %s, the model needs %s", path, w->name,
                     rt_shape_str(have, sizeof have, t->rank, t->dims),
                     rt_shape_str(want, sizeof want, p->rank, p->global_dims));
    }
    float *converted;
    rt_box_copy(p->rank, zero, t->dims, floats_of(t, &converted), w->off, w->dims, w->dst);
    free(converted);
    w->found = true;
  }
  return 0;
}

// Copies what one shard file of a checkpoint holds of every wanted tensor.
static int take_shard(const char *file, const RtStFile *f, Wants *ws) {
  for (int i = 0; i < ws->n; i++) {
    Wanted *w = &ws->w[i];
    const RtParam *p = w->param;
    const RtStEntry *t = rt_st_find(f, w->name);
    if (!t)
      continue;
    char key[600];
    snprintf(key, sizeof key, "shard.%s", w->name);
    const char *box = rt_st_meta(f, key);
    int rank;
    int64_t global[RT_MAX_RANK], off[RT_MAX_RANK];
    if (!box || !parse_box(box, &rank, global, off))
      return rt_fail("checkpoint shard '%s': tensor '%s' lacks a valid \"%s\" entry "
                     "(\"global=[..] offset=[..]\") in its __metadata__", file, w->name, key);
    char have[160], want[160], whole[160];
    if (rank != p->rank || !same_dims(rank, global, p->global_dims))
      return rt_fail("checkpoint shard '%s': tensor '%s' is a slice of a tensor of shape %s, "
                     "the model needs %s", file, w->name,
                     rt_shape_str(have, sizeof have, rank, global),
                     rt_shape_str(want, sizeof want, p->rank, p->global_dims));
    bool inside = t->rank == rank;
    for (int d = 0; inside && d < rank; d++)
      inside = off[d] >= 0 && t->dims[d] <= global[d] && off[d] <= global[d] - t->dims[d];
    if (!inside)
      return rt_fail("checkpoint shard '%s': tensor '%s' of shape %s at offset %s does not lie "
                     "inside its whole tensor %s", file, w->name,
                     rt_shape_str(have, sizeof have, t->rank, t->dims),
                     rt_shape_str(want, sizeof want, rank, off),
                     rt_shape_str(whole, sizeof whole, rank, global));
    float *converted;
    rt_box_copy(p->rank, off, t->dims, floats_of(t, &converted), w->off, w->dims, w->dst);
    free(converted);
    w->found = true;
    Box b;
    if (rt_box_meet(p->rank, off, t->dims, w->off, w->dims, b.lo, b.hi)) {
      if (w->nfilled == w->max_filled) {
        w->max_filled = w->max_filled ? 2 * w->max_filled : 4;
        Box *more = realloc(w->filled, (size_t)w->max_filled * sizeof *more);
        if (!more)
          rt_out_of_memory((size_t)w->max_filled * sizeof *more, "the boxes a checkpoint filled");
        w->filled = more;
      }
      w->filled[w->nfilled++] = b;
    }
  }
  return 0;
}

static bool boxes_meet(int rank, const Box *a, const Box *b) {
  for (int d = 0; d < rank; d++)
    if (a->hi[d] <= b->lo[d] || b->hi[d] <= a->lo[d])
      return false;
  return true;
}

// The first element of w's box that none of the filled boxes holds (its index in the box), or -1.
// Boxes that do not overlap (the shards of a checkpoint moec saved) cover the box when their
// sizes add up to it; otherwise a map of the box's elements is drawn.
static int64_t first_hole(const Wanted *w) {
  int rank = w->param->rank;
  int64_t sum = 0;
  bool apart = true;
  for (int i = 0; i < w->nfilled; i++) {
    int64_t n = 1;
    for (int d = 0; d < rank; d++)
      n *= w->filled[i].hi[d] - w->filled[i].lo[d];
    sum += n;
    for (int j = 0; j < i && apart; j++)
      apart = !boxes_meet(rank, &w->filled[i], &w->filled[j]);
  }
  if (apart && sum == w->numel)
    return -1;
  unsigned char *map = rt_calloc((size_t)w->numel + 1, 1, "the map of loaded elements");
  int64_t stride[RT_MAX_RANK], hole = -1;
  rt_box_strides(rank, w->dims, stride);
  for (int i = 0; i < w->nfilled; i++) {
    const Box *b = &w->filled[i];
    int64_t n = 1, c[RT_MAX_RANK];
    for (int d = 0; d < rank; d++)
      n *= b->hi[d] - b->lo[d];
    for (int64_t e = 0; e < n; e++) {   // element e of the box, row-major
      int64_t rest = e, at = 0;
      for (int d = rank - 1; d >= 0; d--) {
        c[d] = b->lo[d] + rest % (b->hi[d] - b->lo[d]);
        rest /= b->hi[d] - b->lo[d];
        at += (c[d] - w->off[d]) * stride[d];
      }
      map[at] = 1;
    }
  }
  for (int64_t j = 0; j < w->numel && hole < 0; j++)
    if (!map[j])
      hole = j;
  free(map);
  return hole;
}

// Every wanted element came from somewhere.
static int check_covered(const char *path, const Wants *ws, int nshards, const RtRanks *r) {
  for (int i = 0; i < ws->n; i++) {
    const Wanted *w = &ws->w[i];
    const RtParam *p = w->param;
    if (!w->found)
      return rt_fail("checkpoint '%s' has no tensor '%s' in any of its %d shard file%s", path,
                     w->name, nshards, nshards == 1 ? "" : "s");
    int64_t j = first_hole(w);
    if (j >= 0) {
      int64_t g = rt_box_global_index(p, w->off, w->dims, j), coord[4];
      for (int d = p->rank - 1; d >= 0; d--) {
        coord[d] = g % p->global_dims[d];
        g /= p->global_dims[d];
      }
      char at[160];
      return rt_fail("checkpoint '%s' does not cover tensor '%s': element %s (needed by rank "
                     "%d) is in none of its %d shard file%s; is a shard missing from the "
                     "index?", path, w->name, rt_shape_str(at, sizeof at, p->rank, coord),
                     r->rank, nshards, nshards == 1 ? "" : "s");
    }
  }
  return 0;
}

static int read_text_file(const char *path, char **out, size_t *size) {
  *out = NULL;
  FILE *f = fopen(path, "rb");
  if (!f)
    return rt_fail("cannot open '%s': %s", path, strerror(errno));
  struct stat sb;
  if (fstat(fileno(f), &sb) != 0 || !S_ISREG(sb.st_mode)) {
    fclose(f);
    return rt_fail("cannot read '%s': it is not a regular file", path);
  }
  char *buf = rt_alloc((size_t)sb.st_size + 1, "a checkpoint index read whole");
  size_t got = fread(buf, 1, (size_t)sb.st_size, f);
  int err = ferror(f) ? errno : 0;
  fclose(f);
  if (err || got != (size_t)sb.st_size) {
    free(buf);
    return rt_fail("cannot read '%s': %s", path, err ? strerror(err) : "it changed size");
  }
  buf[got] = '\0';
  *out = buf;
  *size = got;
  return 0;
}

// A safetensors file starts with its header length N (8 bytes, little-endian), then N bytes of
// JSON; an index file is JSON text from its first byte. Only a safetensors file can pass both
// checks below, since JSON text read as a length is far larger than any file.
static bool looks_like_safetensors(const char *buf, size_t size) {
  if (size < 9)
    return false;
  uint64_t n = 0;
  for (int i = 0; i < 8; i++)
    n |= (uint64_t)(unsigned char)buf[i] << (8 * i);
  return n <= size - 8 && buf[8] == '{';
}

typedef struct Index {
  char *model, *optimizer;
  int64_t step;
  int nshards;
  char **shards;   // resolved paths
} Index;

static void index_free(Index *ix) {
  free(ix->model);
  free(ix->optimizer);
  for (int i = 0; i < ix->nshards; i++)
    free(ix->shards[i]);
  free(ix->shards);
  memset(ix, 0, sizeof *ix);
}

static const char *json_string(const cJSON *obj, const char *key) {
  const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
  return cJSON_IsString(item) ? item->valuestring : NULL;
}

static bool json_count(const cJSON *obj, const char *key, int64_t max, int64_t *v) {
  const cJSON *item = cJSON_GetObjectItemCaseSensitive(obj, key);
  if (!cJSON_IsNumber(item))
    return false;
  double d = item->valuedouble;
  if (!(d >= 0 && d <= (double)max) || d != (double)(int64_t)d)
    return false;
  *v = (int64_t)d;
  return true;
}

// index = {"format": "moec-checkpoint-2", "model": S, "optimizer": S, "step": N, "world": N,
//          "layout": {...}, "shards": [S, ...]}
static int parse_index(const char *path, const char *text, size_t size, bool for_weights,
                       Index *ix) {
  memset(ix, 0, sizeof *ix);
  cJSON *root = cJSON_ParseWithLength(text, size);
  const char *format = root ? json_string(root, "format") : NULL;
  int status = -1;
  if (!cJSON_IsObject(root) || !format || strcmp(format, checkpoint_v2) != 0) {
    if (for_weights)
      rt_fail("'%s' is neither a safetensors file nor a moec checkpoint index (JSON with "
              "\"format\": \"%s\") nor a Hugging Face index (JSON with \"weight_map\")", path,
              checkpoint_v2);
    else
      rt_fail("'%s' is not a moec checkpoint (neither a checkpoint index with \"format\": "
              "\"%s\" nor a safetensors file)", path, checkpoint_v2);
    goto done;
  }
  const char *model = json_string(root, "model"), *optimizer = json_string(root, "optimizer");
  const cJSON *shards = cJSON_GetObjectItemCaseSensitive(root, "shards");
  int64_t world = -1;
  if (!model || !optimizer) {
    rt_fail("checkpoint '%s' lacks its \"model\" or \"optimizer\"", path);
    goto done;
  }
  if (!json_count(root, "step", INT32_MAX, &ix->step)) {
    rt_fail("checkpoint '%s' has no valid \"step\"", path);
    goto done;
  }
  if (!cJSON_IsArray(shards) || cJSON_GetArraySize(shards) == 0) {
    rt_fail("checkpoint '%s' lists no \"shards\"", path);
    goto done;
  }
  if (cJSON_GetObjectItemCaseSensitive(root, "world") &&
      (!json_count(root, "world", INT_MAX, &world) || world != cJSON_GetArraySize(shards))) {
    rt_fail("checkpoint '%s' says \"world\" is %lld but lists %d shard files", path,
            (long long)world, cJSON_GetArraySize(shards));
    goto done;
  }
  const char *what = "a checkpoint's index";
  ix->model = rt_strdup(model, what);
  ix->optimizer = rt_strdup(optimizer, what);
  ix->shards = rt_calloc((size_t)cJSON_GetArraySize(shards), sizeof(char *), what);
  for (const cJSON *s = shards->child; s; s = s->next) {
    if (!cJSON_IsString(s) || !s->valuestring[0]) {
      rt_fail("checkpoint '%s': an entry of \"shards\" is not a file name", path);
      goto done;
    }
    ix->shards[ix->nshards++] = resolve_beside(path, s->valuestring);
  }
  status = 0;
done:
  cJSON_Delete(root);
  if (status != 0)
    index_free(ix);
  return status;
}

// Checks a checkpoint's model and optimizer against this binary's.
static int check_identity(const char *path, const RtModel *m, const char *model,
                          const char *optimizer, bool want_optimizer) {
  if (!model || strcmp(model, m->name) != 0)
    return rt_fail("checkpoint '%s' is of model '%s', but this binary trains '%s'", path,
                   model ? model : "(none)", m->name);
  if (want_optimizer && (!optimizer || strcmp(optimizer, optimizer_of(m)) != 0))
    return rt_fail("checkpoint '%s' was trained with optimizer %s, but this binary uses %s",
                   path, optimizer ? optimizer : "(none)", optimizer_of(m));
  return 0;
}

// Fills the wanted boxes from every shard the index lists.
static int load_sharded(const char *path, const Index *ix, Wants *ws, const RtRanks *r) {
  char step_text[32];
  snprintf(step_text, sizeof step_text, "%lld", (long long)ix->step);
  for (int k = 0; k < ix->nshards; k++) {
    const char *file = ix->shards[k];
    RtStFile f;
    if (rt_st_read(file, &f) != 0) {
      char why[1024];
      snprintf(why, sizeof why, "%s", rt_last_error());
      return rt_fail("checkpoint '%s': %s", path, why);
    }
    const char *format = rt_st_meta(&f, "format"), *model = rt_st_meta(&f, "model");
    const char *step = rt_st_meta(&f, "step");
    int status = 0;
    if (!format || strcmp(format, checkpoint_v2) != 0)
      status = rt_fail("checkpoint '%s': shard '%s' is not a moec checkpoint shard (its "
                       "__metadata__ lacks \"format\": \"%s\")", path, file, checkpoint_v2);
    else if (!model || strcmp(model, ix->model) != 0)
      status = rt_fail("checkpoint '%s': shard '%s' is of model '%s', the index says '%s'",
                       path, file, model ? model : "(none)", ix->model);
    else if (!step || strcmp(step, step_text) != 0)
      status = rt_fail("checkpoint '%s': shard '%s' is at step %s but the index says %s; the "
                       "checkpoint is torn (a save was interrupted?)", path, file,
                       step ? step : "(none)", step_text);
    else
      status = take_shard(file, &f, ws);
    rt_st_free(&f);
    if (status != 0)
      return -1;
  }
  return check_covered(path, ws, ix->nshards, r);
}

// A Hugging Face index: JSON with a "weight_map" object (a moec index has none).
static bool is_hf_index(const char *text, size_t size) {
  cJSON *root = cJSON_ParseWithLength(text, size);
  bool hf = cJSON_IsObject(cJSON_GetObjectItemCaseSensitive(root, "weight_map"));
  cJSON_Delete(root);
  return hf;
}

// Reads what is at path: a moec index (ix filled, *set zeroed) or safetensors files of whole
// tensors (*set filled): one file, or for --weights also a Hugging Face index or folder.
static int open_source(const char *path, bool for_weights, Index *ix, RtStSet *set,
                       bool *is_index) {
  memset(ix, 0, sizeof *ix);
  memset(set, 0, sizeof *set);
  *is_index = false;
  struct stat sb;
  if (for_weights && stat(path, &sb) == 0 && S_ISDIR(sb.st_mode))
    return rt_st_open(path, set);
  char *text = NULL;
  size_t size = 0;
  if (read_text_file(path, &text, &size) != 0)
    return -1;
  *is_index = !looks_like_safetensors(text, size) && !(for_weights && is_hf_index(text, size));
  int status = *is_index ? parse_index(path, text, size, for_weights, ix) : 0;
  free(text);
  if (!*is_index)
    status = rt_st_open(path, set);
  return status;
}

int rt_checkpoint_load(RtComm *c, const char *path, const RtModel *m, const RtRanks *r, float *params,
                       float *opt_m, float *opt_v, int64_t *step) {
  bool adamw = m->opt == RT_OPT_ADAMW, is_index;
  Index ix;
  RtStSet set;
  if (open_source(path, false, &ix, &set, &is_index) != 0)
    return -1;
  const RtStFile *f = is_index ? NULL : &set.files[0];   // one file: no index, no folder
  Wants ws = {0};
  size_t bytes = (size_t)m->param_floats * sizeof(float);   // their first touch, by every thread
  rt_big_touch(params, bytes);
  if (adamw)
    rt_touch_moments(c, m, opt_m, opt_v);
  int status = wants_make(&ws, c, m, r, params, adamw ? opt_m : NULL, adamw ? opt_v : NULL);
  if (status == 0 && is_index) {
    status = check_identity(path, m, ix.model, ix.optimizer, true);
    if (status == 0)
      status = load_sharded(path, &ix, &ws, r);
    if (status == 0)
      *step = ix.step;
  } else if (status == 0) {
    const char *format = rt_st_meta(f, "format"), *text = rt_st_meta(f, "step");
    char *end = NULL;
    long long done = text ? strtoll(text, &end, 10) : -1;
    if (format && strcmp(format, checkpoint_v2) == 0)
      status = rt_fail("'%s' is one shard of a checkpoint; resume from its index file (the "
                       "path given to --save)", path);
    else if (!format || strcmp(format, checkpoint_v1) != 0)
      status = rt_fail("'%s' is not a moec checkpoint (its __metadata__ lacks \"format\": "
                       "\"%s\"); to start from its weights use --weights", path, checkpoint_v2);
    else if ((status = check_identity(path, m, rt_st_meta(f, "model"),
                                      rt_st_meta(f, "optimizer"), true)) != 0)
      ;
    else if (!text || *end || done < 0 || done > INT32_MAX)
      status = rt_fail("checkpoint '%s' has no valid \"step\" in its __metadata__", path);
    else
      status = take_whole(path, &set, &ws);
    if (status == 0)
      *step = done;
  }
  wants_free(&ws);
  index_free(&ix);
  rt_st_set_free(&set);
  return status;
}

// A checkpoint's shard file given where its index belongs.
static int refuse_shards(const RtStSet *set) {
  for (int k = 0; k < set->nfiles; k++) {
    const char *format = rt_st_meta(&set->files[k], "format");
    if (format && strcmp(format, checkpoint_v2) == 0)
      return rt_fail("'%s' is one shard of a checkpoint; load its index file (the path given "
                     "to --save)", set->paths[k]);
  }
  return 0;
}

int rt_weights_load(const char *path, const RtModel *m, const RtRanks *r, float *params) {
  bool is_index;
  Index ix;
  RtStSet set;
  if (open_source(path, true, &ix, &set, &is_index) != 0)
    return -1;
  Wants ws = {0};
  rt_big_touch(params, (size_t)m->param_floats * sizeof(float));   // their first touch, by every thread
  int status = wants_make(&ws, NULL, m, r, params, NULL, NULL);
  if (status == 0 && is_index) {
    status = check_identity(path, m, ix.model, ix.optimizer, false);
    if (status == 0)
      status = load_sharded(path, &ix, &ws, r);
  } else if (status == 0) {
    status = refuse_shards(&set);
    for (int i = 0; status == 0 && i < m->nparams; i++)   // what the file lacks of them stays so
      if (lora_param(m->params[i].name))
        rt_shard_init(&m->params[i], r, m->seed, params + m->params[i].offset);
    if (status == 0)
      status = take_whole(path, &set, &ws);
  }
  wants_free(&ws);
  index_free(&ix);
  rt_st_set_free(&set);
  return status;
}
