// Diagnostics: one entry point prints "file:line:col: error: msg", the source line and a caret
// underline, the way chibicc's error_tok and bison's examples do. Errors are counted so callers
// can keep going and report several in one run, then fail once at the end.
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir_diag.h"

IrSource *ir_source_from_buffer(const char *path, const char *data, size_t len) {
  IrSource *s = calloc(1, sizeof *s);
  if (!s) return NULL;
  s->path = strdup(path);
  s->text = malloc(len + 1);
  if (!s->path || !s->text) {
    ir_source_free(s);
    return NULL;
  }
  if (len) memcpy(s->text, data, len);
  s->text[len] = '\0';
  s->len = len;
  return s;
}

IrSource *ir_source_read(IrDiag *d, const char *path) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    ir_error(d, "cannot read '%s': %s", path, strerror(errno));
    return NULL;
  }
  char *buf = NULL;
  size_t len = 0, cap = 0;
  for (;;) {
    if (len + 4096 + 1 > cap) {
      cap = cap ? cap * 2 : 8192;
      char *nb = realloc(buf, cap);
      if (!nb) {
        free(buf);
        fclose(f);
        ir_error(d, "cannot read '%s': out of memory", path);
        return NULL;
      }
      buf = nb;
    }
    size_t n = fread(buf + len, 1, cap - len - 1, f);
    len += n;
    if (n == 0) break;
  }
  int failed = ferror(f);
  int saved = errno;
  fclose(f);
  if (failed) {
    free(buf);
    ir_error(d, "cannot read '%s': %s", path, strerror(saved ? saved : EIO));
    return NULL;
  }
  IrSource *s = ir_source_from_buffer(path, buf ? buf : "", len);
  free(buf);
  return s;
}

void ir_source_free(IrSource *s) {
  if (!s) return;
  free(s->path);
  free(s->text);
  free(s);
}

void ir_diag_init(IrDiag *d, FILE *out) {
  d->out = out ? out : stderr;
  d->errors = 0;
  d->max_errors = 20;
}

// Prints the line of loc and a caret under loc's span. Tabs are kept so the caret lines up.
static void print_snippet(FILE *out, SrcLoc loc) {
  const char *text = loc.src->text, *end = text + loc.src->len;
  const char *line = text;
  for (int l = 1; l < loc.line && line < end; l++) {
    const char *nl = memchr(line, '\n', end - line);
    if (!nl) break;
    line = nl + 1;
  }
  const char *eol = line;
  while (eol < end && *eol != '\n' && *eol != '\r') eol++;
  fprintf(out, "%5d | ", loc.line);
  for (const char *p = line; p < eol; p++) {
    unsigned char c = (unsigned char)*p;
    fputc(c == '\t' || c >= 0x20 ? c : ' ', out);
  }
  fputs("\n      | ", out);
  int col = loc.col < 1 ? 1 : loc.col;
  for (int i = 1; i < col; i++) fputc(line + i - 1 < eol && line[i - 1] == '\t' ? '\t' : ' ', out);
  fputc('^', out);
  int width = loc.len;
  if (line + col - 1 + width > eol) width = (int)(eol - (line + col - 1));
  for (int i = 1; i < width; i++) fputc('~', out);
  fputc('\n', out);
}

static void report(IrDiag *d, SrcLoc loc, const char *kind, const char *fmt, va_list ap) {
  FILE *out = d->out ? d->out : stderr;
  if (loc.src)
    fprintf(out, "%s:%d:%d: %s: ", loc.src->path, loc.line, loc.col, kind);
  else
    fprintf(out, "moec: %s: ", kind);
  vfprintf(out, fmt, ap);
  fputc('\n', out);
  if (loc.src && loc.line >= 1) print_snippet(out, loc);
}

bool ir_error_vat(IrDiag *d, SrcLoc loc, const char *fmt, va_list ap) {
  int max = d->max_errors > 0 ? d->max_errors : 20;
  d->errors++;
  if (d->errors <= max) report(d, loc, "error", fmt, ap);
  if (d->errors == max + 1) fprintf(d->out ? d->out : stderr, "moec: too many errors, stopping\n");
  return false;
}

bool ir_error_at(IrDiag *d, SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ir_error_vat(d, loc, fmt, ap);
  va_end(ap);
  return false;
}

bool ir_error(IrDiag *d, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  SrcLoc none = {0};
  ir_error_vat(d, none, fmt, ap);
  va_end(ap);
  return false;
}

void ir_note_at(IrDiag *d, SrcLoc loc, const char *fmt, ...) {
  int max = d->max_errors > 0 ? d->max_errors : 20;
  if (d->errors > max) return;
  va_list ap;
  va_start(ap, fmt);
  if (loc.src) {
    report(d, loc, "note", fmt, ap);
  } else {
    FILE *out = d->out ? d->out : stderr;
    fputs("note: ", out);
    vfprintf(out, fmt, ap);
    fputc('\n', out);
  }
  va_end(ap);
}

static int edit_distance(const char *a, const char *b) {
  size_t la = strlen(a), lb = strlen(b);
  if (la > 64 || lb > 64) return 1 << 20;
  int row[65];
  for (size_t j = 0; j <= lb; j++) row[j] = (int)j;
  for (size_t i = 1; i <= la; i++) {
    int diag = row[0];
    row[0] = (int)i;
    for (size_t j = 1; j <= lb; j++) {
      int up = row[j];
      int best = diag + (a[i - 1] != b[j - 1]);
      if (up + 1 < best) best = up + 1;
      if (row[j - 1] + 1 < best) best = row[j - 1] + 1;
      row[j] = best;
      diag = up;
    }
  }
  return row[lb];
}

const char *ir_closest(const char *word, const char *const *candidates, int n) {
  int limit = (int)strlen(word) / 3;
  if (limit < 1) limit = 1;
  const char *best = NULL;
  int best_d = limit + 1;
  for (int i = 0; i < n; i++) {
    int dist = edit_distance(word, candidates[i]);
    if (dist < best_d) {
      best_d = dist;
      best = candidates[i];
    }
  }
  return best;
}

bool ir_oom(IrDiag *d) { return ir_error(d, "out of memory"); }

_Noreturn void ir_oom_exit(void) {
  fprintf(stderr, "moec: error: out of memory\n");
  exit(1);
}

static bool internal_vat(IrDiag *d, SrcLoc loc, const char *fmt, va_list ap) {
  char msg[1024];
  vsnprintf(msg, sizeof msg, fmt, ap);
  return ir_error_at(d, loc, "internal error: %s", msg);
}

bool ir_internal(IrDiag *d, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  internal_vat(d, (SrcLoc){0}, fmt, ap);
  va_end(ap);
  return false;
}

bool ir_internal_at(IrDiag *d, SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  internal_vat(d, loc, fmt, ap);
  va_end(ap);
  return false;
}

_Noreturn void ir_unreachable(const char *file, int line) {
  fprintf(stderr, "moec: internal error at %s:%d: unreachable code reached\n", file, line);
  abort();
}

// Memory in one human unit everywhere a person reads it (JSON keeps bytes): B, KiB, MiB, ...
char *ir_bytes(char *buf, size_t n, double bytes) {
  static const char *const unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024 && u < 4) bytes /= 1024, u++;
  snprintf(buf, n, u ? "%.2f %s" : "%.0f %s", bytes, unit[u]);
  return buf;
}
