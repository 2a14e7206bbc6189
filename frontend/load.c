// Loading: source text -> checked program (fe_load) or cluster profile (fe_load_cluster).
//
// fe_load parses and checks a .moe source. It does not open the cluster profile that a
// `cluster "F";` statement names, since `moec build --cluster F` may override it: the caller
// loads the profile it uses with fe_load_cluster: a relative F named in a .moe file is taken from
// that file's folder, and where it is not there from the current folder (so that a model names
// its profile beside it and runs from anywhere, and the paths older files give from the
// repository's root still work); --cluster F from the current folder. fe_load_cluster reads the
// file itself (rather than with ir_source_read) so that "cannot read" points at the statement
// that named the file.
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fe_internal.h"

FeProgram *fe_load(IrDiag *d, const IrSource *src) {
  FeTree *tree = fe_parse(d, src);
  if (!tree)
    return NULL;
  FeProgram *p = fe_check(d, tree);
  if (!p) {
    fe_tree_free(tree);
    return NULL;
  }
  return p;
}

// Reads a whole file into a malloc'd, NUL-terminated buffer. NULL with errno set on failure.
char *fe_read_file(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  if (!f)
    return NULL;
  size_t cap = 4096, n = 0;
  char *buf = malloc(cap);
  while (buf) {
    if (n + 1 >= cap) {
      char *bigger = cap < ((size_t)1 << 30) ? realloc(buf, cap * 2) : NULL;
      if (!bigger) {
        free(buf);
        buf = NULL;
        errno = ENOMEM;
        break;
      }
      buf = bigger;
      cap *= 2;
    }
    size_t got = fread(buf + n, 1, cap - n - 1, f);
    n += got;
    if (got == 0) {
      if (ferror(f)) {
        int err = errno ? errno : EIO;
        free(buf);
        buf = NULL;
        errno = err;
      }
      break;
    }
  }
  int err = errno;
  fclose(f);
  errno = err;
  if (buf) {
    buf[n] = '\0';
    *len = n;
  }
  return buf;
}

// FeCluster.name must outlive the cluster file's tree, and FeCluster has no owner to free it:
// names are interned for the life of the process (a handful of short strings).
static const char *intern(const char *name) {
  static struct Interned { struct Interned *next; char name[]; } *names;
  for (struct Interned *i = names; i; i = i->next)
    if (strcmp(i->name, name) == 0)
      return i->name;
  size_t len = strlen(name);
  struct Interned *i = malloc(sizeof *i + len + 1);
  if (!i)
    return NULL;
  memcpy(i->name, name, len + 1);
  i->next = names;
  names = i;
  return i->name;
}

char *fe_path_beside(const char *path, SrcLoc at) {
  if (!at.src || !at.src->path || path[0] == '/') return NULL;
  const char *slash = strrchr(at.src->path, '/');
  if (!slash) return NULL;
  size_t n = (size_t)(slash - at.src->path) + 1 + strlen(path) + 1;
  char *full = malloc(n);
  if (full) snprintf(full, n, "%.*s/%s", (int)(slash - at.src->path), at.src->path, path);
  return full;
}

bool fe_load_cluster(IrDiag *d, const char *path, SrcLoc at, FeCluster *out) {
  memset(out, 0, sizeof *out);
  size_t len = 0;
  char *text = NULL, *beside = fe_path_beside(path, at);
  if (beside && (text = fe_read_file(beside, &len))) {
    const char *kept = intern(beside);   // the profile's diagnostics name the file read
    path = kept ? kept : path;
  }
  free(beside);
  errno = 0;
  if (!text) text = fe_read_file(path, &len);
  if (!text)
    return ir_error_at(d, at, "cannot read '%s': %s", path, strerror(errno ? errno : EIO));
  IrSource *src = ir_source_from_buffer(path, text, len);
  free(text);
  if (!src)
    return ir_error_at(d, at, "out of memory reading '%s'", path);
  int errors = d->errors;
  FeTree *tree = fe_parse(d, src);
  bool ok = tree && fe_check_cluster(d, tree, out);
  if (ok) {
    out->loc = at;  // the profile's own source is freed below
    out->name = intern(out->name);
    if (!out->name)
      ok = ir_error_at(d, at, "out of memory reading '%s'", path);
  }
  if (!ok && d->errors > errors && at.src)
    ir_note_at(d, at, "in the cluster profile named here");
  fe_tree_free(tree);
  ir_source_free(src);
  if (!ok)
    memset(out, 0, sizeof *out);
  return ok;
}
