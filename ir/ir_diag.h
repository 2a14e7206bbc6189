// Source locations and diagnostics, shared by the front end, the cluster reader and the IR
// parser, so nothing below the front end reaches up into it.
//
// A source is a named buffer kept alive for the whole compilation; every token, AST node and
// IR op carries a SrcLoc pointing into one. ir_error_at() prints
//
//   file:line:col: error: message
//    12 |   gate gshrad { k 2; }
//       |        ^~~~~~
//
// and counts the error; callers keep going where they can so one run reports several errors.
#ifndef IR_DIAG_H
#define IR_DIAG_H

#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

typedef struct IrSource {
  char *path;   // as given by the user ("<stdin>" etc.)
  char *text;   // NUL-terminated contents
  size_t len;   // bytes, excluding the NUL
} IrSource;

typedef struct SrcLoc {
  const IrSource *src;  // NULL: no location (internal or command-line)
  int line;             // 1-based
  int col;              // 1-based, in bytes
  int len;              // bytes to underline, >= 1
} SrcLoc;

typedef struct IrDiag {
  FILE *out;        // where diagnostics go (stderr by default)
  int errors;       // errors reported so far
  int max_errors;   // stop reporting after this many (0 = 20)
} IrDiag;

// Reads a whole file; on failure reports "cannot read FILE: reason" and returns NULL.
IrSource *ir_source_read(IrDiag *d, const char *path);
// Wraps a buffer (copied) as a source, e.g. for fuzzers and tests.
IrSource *ir_source_from_buffer(const char *path, const char *data, size_t len);
void ir_source_free(IrSource *s);

void ir_diag_init(IrDiag *d, FILE *out);
// file:line:col: error: msg + source line + caret. Returns false so callers can `return ir_error_at(...)`.
bool ir_error_at(IrDiag *d, SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
bool ir_error_vat(IrDiag *d, SrcLoc loc, const char *fmt, va_list ap);
// A note attached to the previous error (e.g. "did you mean 'gshard'?"), printed as
// "file:line:col: note: msg" with its own caret when loc has a source, else "note: msg".
void ir_note_at(IrDiag *d, SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// An error with no location: "moec: error: msg".
bool ir_error(IrDiag *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// bytes as a person reads them ("49.31 KiB", "512 B") into buf; returns buf (ir/diag.c).
char *ir_bytes(char *buf, size_t n, double bytes);

// The closest of candidates[0..n) to word by edit distance, or NULL if none is close enough
// (distance <= max(1, strlen(word)/3)). Used for "did you mean" hints.
const char *ir_closest(const char *word, const char *const *candidates, int n);

// The compiler's failure policy: a failed allocation and an internal error (a bug, never user
// input) each have one entry point, report one line and return false, so the caller returns
// false and the compilation ends with a non-zero status like any other error:
//   moec: error: out of memory
//   moec: error: internal error: msg            (file:line:col: error: internal error: msg at loc)
bool ir_oom(IrDiag *d);
bool ir_internal(IrDiag *d, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
bool ir_internal_at(IrDiag *d, SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
// For the few allocators whose callers cannot fail (the IR arena behind every builder call, the
// IR text parser's buffers): the same line as ir_oom on stderr, then exit status 1.
_Noreturn void ir_oom_exit(void);
// Code that cannot be reached, whatever the input: prints where and aborts.
#define UNREACHABLE() ir_unreachable(__FILE__, __LINE__)
_Noreturn void ir_unreachable(const char *file, int line);

#endif
