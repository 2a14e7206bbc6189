// The IR parser: a hand-written lexer and a recursive-descent parser for the text form that
// ir/print.c writes (grammar at the top of ir.h and above each function below).
//
// The lexer hands out one token at a time (P->tok); the parser looks at that one token only and
// copies names into the module's arena before moving on. The text is line-oriented: every
// top-level item and every statement starts a line and ends at the end of its line, which is
// how an operand list knows where it stops and how the parser resynchronises after an error
// (skip to the next line, keep going, so one run reports several problems). Names are resolved
// as they are read: values in the function or in the function it `saves`, parameters and
// functions declared above. The grammar has no nesting, so nothing recurses; every array
// has its bound checked (rank, operands, attributes, waits) with a diagnostic.
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"

typedef enum TokKind {
  T_EOF,
  T_ERROR,   // the lexer reported it already
  T_IDENT,   // keyword, op name, dtype, attribute key
  T_LOCAL,   // %name
  T_GLOBAL,  // @name
  T_INT,
  T_FLOAT,
  T_STRING,
  T_PUNCT,   // one of : = , ( ) { } [ ] !
} TokKind;

typedef struct Token {
  TokKind kind;
  SrcLoc loc;
  bool bol;         // the first token on its line (EOF counts as one)
  const char *str;  // T_IDENT, T_LOCAL, T_GLOBAL, T_STRING: decoded text in Parser.buf
  int64_t i;
  double f;
  char punct;
} Token;

typedef struct ArgDecl {
  const char *name;
  IrType type;
  SrcLoc loc;
} ArgDecl;

typedef struct Parser {
  IrDiag *d;
  const IrSource *src;
  IrModule *m;
  IrFunc *f;           // function being parsed
  size_t pos;          // lexer position in src->text
  int line, col;       // of pos
  int prev_line;       // line of the previous token
  SrcLoc prev_end;     // just past the previous token, for "expected X after Y"
  long ntok;           // tokens read so far
  Token tok;
  int nerr;            // errors this parse reported
  char *buf;           // decoded text of the current token
  size_t buf_len, buf_cap;
  char desc[96];       // describe() output
  const char **poisoned;  // results of failed statements in f: uses stay quiet
  int npoisoned, cap_poisoned;
  ArgDecl *decls;      // arguments of the function header being parsed
  int ndecls, cap_decls;
} Parser;

static void *xrealloc(void *p, size_t n) {
  void *q = realloc(p, n ? n : 1);
  if (!q) ir_oom_exit();
  return q;
}

// ---- diagnostics ----

static bool err_at(Parser *P, SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool err_at(Parser *P, SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ir_error_vat(P->d, loc, fmt, ap);
  va_end(ap);
  P->nerr++;
  return false;
}

// An error about the current token; silent when the lexer already reported it.
#define err_tok(P, ...) ((P)->tok.kind == T_ERROR ? false : err_at((P), (P)->tok.loc, __VA_ARGS__))
// "expected X after Y": points just past the previous token when the current one is on a later
// line, so a missing piece at the end of a line is shown there.
#define err_after(P, ...)                                                                       \
  ((P)->tok.kind == T_ERROR ? false                                                             \
   : err_at((P), (P)->tok.bol ? (P)->prev_end : (P)->tok.loc, __VA_ARGS__))

static const char *describe(Parser *P) {
  const Token *t = &P->tok;
  switch (t->kind) {
  case T_EOF: return "end of file";
  case T_IDENT: snprintf(P->desc, sizeof P->desc, "'%.60s'", t->str); break;
  case T_LOCAL: snprintf(P->desc, sizeof P->desc, "'%%%.60s'", t->str); break;
  case T_GLOBAL: snprintf(P->desc, sizeof P->desc, "'@%.60s'", t->str); break;
  case T_INT: snprintf(P->desc, sizeof P->desc, "'%lld'", (long long)t->i); break;
  case T_FLOAT: return "a number";
  case T_STRING: return "a string";
  case T_PUNCT: snprintf(P->desc, sizeof P->desc, "'%c'", t->punct); break;
  default: return "a bad token";
  }
  return P->desc;
}

// ---- lexer ----

static int peekc(const Parser *P, size_t ahead) {
  size_t at = P->pos + ahead;
  return at < P->src->len ? (unsigned char)P->src->text[at] : -1;
}

static void advance(Parser *P, size_t n) {
  for (size_t i = 0; i < n && P->pos < P->src->len; i++) {
    if (P->src->text[P->pos] == '\n') {
      P->line++;
      P->col = 1;
    } else {
      P->col++;
    }
    P->pos++;
  }
}

static bool is_ident_start(int c) { return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || c == '_'; }
static bool is_digit(int c) { return c >= '0' && c <= '9'; }
static bool is_ident_char(int c) { return is_ident_start(c) || is_digit(c) || c == '.'; }
// Characters of an unquoted %value / @global name; keep in sync with print.c.
static bool is_name_char(int c) { return is_ident_char(c) || c == '-'; }

static void buf_clear(Parser *P) {
  if (!P->buf) {
    P->buf_cap = 64;
    P->buf = xrealloc(NULL, P->buf_cap);
  }
  P->buf_len = 0;
  P->buf[0] = '\0';
}
static void buf_push(Parser *P, char c) {
  if (P->buf_len + 2 > P->buf_cap) {
    P->buf_cap = P->buf_cap ? P->buf_cap * 2 : 64;
    P->buf = xrealloc(P->buf, P->buf_cap);
  }
  P->buf[P->buf_len++] = c;
  P->buf[P->buf_len] = '\0';
}
static int hex_value(int c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

static bool lex_error(Parser *P, SrcLoc loc, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool lex_error(Parser *P, SrcLoc loc, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  ir_error_vat(P->d, loc, fmt, ap);
  va_end(ap);
  P->nerr++;
  P->tok.kind = T_ERROR;
  return false;
}

// string = '"' (char | '\' ( '"' | '\' | 'n' | 't' | 'x' hex hex ))* '"', on one line.
// Decodes into P->buf; the cursor is on the opening quote. A bad escape is reported and the rest
// of the string still read, so the text after it lexes normally.
static bool lex_quoted(Parser *P, SrcLoc *loc) {
  SrcLoc open = {P->src, P->line, P->col, 1};
  bool bad = false;
  advance(P, 1);
  buf_clear(P);
  for (;;) {
    int c = peekc(P, 0);
    if (c < 0 || c == '\n') return bad ? false : lex_error(P, open, "unterminated string");
    if (c == '"') {
      advance(P, 1);
      break;
    }
    SrcLoc at = {P->src, P->line, P->col, 1};
    if (c == '\0') {
      advance(P, 1);
      if (!bad) lex_error(P, at, "string contains a NUL byte");
      bad = true;
      continue;
    }
    if (c != '\\') {
      buf_push(P, (char)c);
      advance(P, 1);
      continue;
    }
    int e = peekc(P, 1);
    at.len = 2;
    if (e == '"' || e == '\\') {
      buf_push(P, (char)e);
      advance(P, 2);
    } else if (e == 'n') {
      buf_push(P, '\n');
      advance(P, 2);
    } else if (e == 't') {
      buf_push(P, '\t');
      advance(P, 2);
    } else if (e == 'x' && hex_value(peekc(P, 2)) >= 0 && hex_value(peekc(P, 3)) >= 0) {
      int v = hex_value(peekc(P, 2)) * 16 + hex_value(peekc(P, 3));
      at.len = 4;
      advance(P, 4);
      if (v == 0) {
        if (!bad) lex_error(P, at, "string contains a NUL byte");
        bad = true;
      }
      buf_push(P, (char)v);
    } else {
      advance(P, e < 0 || e == '\n' ? 1 : 2);
      if (!bad) lex_error(P, at, "unknown escape in string; use \\\", \\\\, \\n, \\t or \\xHH");
      bad = true;
    }
  }
  if (bad) return false;
  loc->len = P->col - loc->col;
  return true;
}

// number = '-'? digit+ ('.' digit*)? ([eE] [+-]? digit+)?  |  '-inf'
static void lex_number(Parser *P) {
  Token *t = &P->tok;
  size_t start = P->pos, n = 0;
  bool neg = peekc(P, 0) == '-', is_float = false;
  if (neg) n++;
  while (is_digit(peekc(P, n))) n++;
  if (peekc(P, n) == '.') {
    is_float = true;
    n++;
    while (is_digit(peekc(P, n))) n++;
  }
  if (peekc(P, n) == 'e' || peekc(P, n) == 'E') {
    size_t e = n + 1;
    if (peekc(P, e) == '+' || peekc(P, e) == '-') e++;
    if (is_digit(peekc(P, e))) {
      while (is_digit(peekc(P, e))) e++;
      n = e;
      is_float = true;
    }
  }
  size_t bad = n;
  while (is_name_char(peekc(P, bad))) bad++;
  t->loc.len = (int)(bad > INT_MAX ? INT_MAX : bad);
  if (bad != n) {
    advance(P, bad);
    lex_error(P, t->loc, "malformed number '%.*s'", (int)(bad > 60 ? 60 : bad), P->src->text + start);
    return;
  }
  const char *text = P->src->text + start;
  advance(P, n);
  if (!is_float) {
    // Accumulate the magnitude as unsigned so INT64_MIN reads back too.
    uint64_t v = 0, limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (size_t i = neg; i < n; i++) {
      uint64_t digit = (uint64_t)(text[i] - '0');
      if (v > (limit - digit) / 10) {
        lex_error(P, t->loc, "integer '%.*s' does not fit in 64 bits", (int)(n > 60 ? 60 : n), text);
        return;
      }
      v = v * 10 + digit;
    }
    t->kind = T_INT;
    if (!neg)
      t->i = (int64_t)v;
    else
      t->i = v == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)v;
    return;
  }
  buf_clear(P);
  for (size_t i = 0; i < n; i++) buf_push(P, text[i]);
  errno = 0;
  double v = strtod(P->buf, NULL);
  if (errno == ERANGE && isinf(v)) {
    lex_error(P, t->loc, "number '%.*s' is out of range", (int)(n > 60 ? 60 : n), text);
    return;
  }
  t->kind = T_FLOAT;
  t->f = v;
}

// Reads the next token into P->tok.
static void next(Parser *P) {
  Token *t = &P->tok;
  if (P->ntok > 0 && t->kind != T_EOF) {
    P->prev_line = t->loc.line;
    P->prev_end = (SrcLoc){P->src, t->loc.line, t->loc.col + t->loc.len, 1};
  }
  for (;;) {
    int c = peekc(P, 0);
    if (c == ' ' || c == '\t' || c == '\r' || c == '\n' || c == '\f' || c == '\v') {
      advance(P, 1);
    } else if (c == '#') {
      while (peekc(P, 0) >= 0 && peekc(P, 0) != '\n') advance(P, 1);
    } else {
      break;
    }
  }
  P->ntok++;
  *t = (Token){.loc = {P->src, P->line, P->col, 1}};
  t->bol = P->line != P->prev_line;
  int c = peekc(P, 0);
  if (c < 0) {
    t->kind = T_EOF;
    t->bol = true;
    return;
  }
  if (is_ident_start(c)) {
    buf_clear(P);
    size_t n = 0;
    while (is_ident_char(peekc(P, n))) buf_push(P, (char)peekc(P, n)), n++;
    advance(P, n);
    t->kind = T_IDENT;
    t->str = P->buf;
    t->loc.len = (int)(n > INT_MAX ? INT_MAX : n);
    return;
  }
  if (c == '%' || c == '@') {
    t->kind = c == '%' ? T_LOCAL : T_GLOBAL;
    if (peekc(P, 1) == '"') {
      advance(P, 1);
      if (!lex_quoted(P, &t->loc)) return;  // the span starts at the sigil
      if (P->buf_len == 0) {
        lex_error(P, t->loc, "empty name after '%c'", c);
        return;
      }
    } else {
      buf_clear(P);
      size_t n = 1;
      while (is_name_char(peekc(P, n))) buf_push(P, (char)peekc(P, n)), n++;
      advance(P, n);
      t->loc.len = (int)(n > INT_MAX ? INT_MAX : n);
      if (n == 1) {
        lex_error(P, t->loc, "expected a name after '%c'", c);
        return;
      }
    }
    t->str = P->buf;
    return;
  }
  if (c == '"') {
    if (!lex_quoted(P, &t->loc)) return;
    t->kind = T_STRING;
    t->str = P->buf;
    return;
  }
  if (is_digit(c) || (c == '-' && is_digit(peekc(P, 1)))) {
    lex_number(P);
    return;
  }
  if (c == '-' && peekc(P, 1) == 'i' && peekc(P, 2) == 'n' && peekc(P, 3) == 'f' &&
      !is_name_char(peekc(P, 4))) {
    advance(P, 4);
    t->kind = T_FLOAT;
    t->f = -INFINITY;
    t->loc.len = 4;
    return;
  }
  if (strchr(":=,(){}[]!", c) && c != '\0') {
    advance(P, 1);
    t->kind = T_PUNCT;
    t->punct = (char)c;
    return;
  }
  advance(P, 1);
  if (c >= 0x20 && c < 0x7f)
    lex_error(P, t->loc, "unexpected character '%c'", c);
  else
    lex_error(P, t->loc, "unexpected byte 0x%02x", c);
}

// ---- parser helpers ----

static bool is_punct(const Parser *P, char c) { return P->tok.kind == T_PUNCT && P->tok.punct == c; }
static bool is_keyword(const Parser *P, const char *kw) {
  return P->tok.kind == T_IDENT && strcmp(P->tok.str, kw) == 0;
}
// A token that continues the current line (operands and optional parts must not start a line).
static bool on_line(const Parser *P) { return !P->tok.bol; }

static bool expect(Parser *P, char c, const char *after) {
  if (is_punct(P, c)) {
    next(P);
    return true;
  }
  return err_after(P, "expected '%c' %s", c, after);
}

// A statement or item is done: the next token must start a line.
static bool expect_eol(Parser *P, const char *after) {
  if (P->tok.bol) return true;
  return err_tok(P, "expected end of line after %s, found %s", after, describe(P));
}

// Skips to the first token of the next line (not the token `start` the failed statement began at).
static void sync_line(Parser *P, long start) {
  while (P->tok.kind != T_EOF && !(P->tok.bol && P->ntok != start)) next(P);
}

static const char *dup_tok(Parser *P) { return ir_strdup(P->m, P->tok.str); }

static void poison(Parser *P, const char *name) {
  if (P->npoisoned == P->cap_poisoned) {
    P->cap_poisoned = P->cap_poisoned ? P->cap_poisoned * 2 : 16;
    P->poisoned = xrealloc(P->poisoned, sizeof *P->poisoned * (size_t)P->cap_poisoned);
  }
  P->poisoned[P->npoisoned++] = name;
}

static bool is_poisoned(const Parser *P, const char *name) {
  for (int i = 0; i < P->npoisoned; i++)
    if (strcmp(P->poisoned[i], name) == 0) return true;
  return false;
}

// ---- grammar ----

// type = dtype "[" (int ("," int)*)? "]"
static bool parse_type(Parser *P, IrType *out, const char *after) {
  *out = (IrType){0};
  if (P->tok.kind != T_IDENT) return err_after(P, "expected a type %s", after);
  SrcLoc start = P->tok.loc;
  if (!ir_dtype_by_name(P->tok.str, &out->dtype))
    return err_tok(P, "unknown dtype '%s'; expected f32, bf16, f16, i32 or i8", P->tok.str);
  next(P);
  if (!expect(P, '[', "after the dtype")) return false;
  if (!is_punct(P, ']')) {
    for (;;) {
      if (P->tok.kind != T_INT || P->tok.i < 0)
        return err_after(P, "expected a dimension (a non-negative integer)");
      if (out->rank == IR_MAX_RANK) return err_tok(P, "tensor rank exceeds %d", IR_MAX_RANK);
      out->dim[out->rank++] = P->tok.i;
      next(P);
      if (is_punct(P, ',')) {
        next(P);
        continue;
      }
      if (!is_punct(P, ']')) return err_after(P, "expected ',' or ']' in the shape");
      break;
    }
  }
  int64_t bytes = ir_dtype_size(out->dtype);
  for (int i = 0; i < out->rank; i++)
    if (__builtin_mul_overflow(bytes, out->dim[i], &bytes))
      return err_at(P, start, "tensor type is too large (more than 2^63 bytes)");
  next(P);  // ']'
  return true;
}

// attrs = "{" (key "=" value ("," key "=" value)*)? "}"
// key = ident | string;  value = int | float | "inf" | "nan" | string
static bool parse_attrs(Parser *P, IrAttr *attrs, int *n, int cap) {
  if (!expect(P, '{', "before attributes")) return false;
  if (is_punct(P, '}')) {
    next(P);
    return true;
  }
  for (;;) {
    if (P->tok.kind != T_IDENT && P->tok.kind != T_STRING)
      return err_after(P, "expected an attribute name");
    if (ir_attrs_get(attrs, *n, P->tok.str)) return err_tok(P, "attribute '%s' given twice", P->tok.str);
    if (*n >= cap) return err_tok(P, "too many attributes (at most %d)", cap);
    IrAttr a = {.key = dup_tok(P)};
    next(P);
    if (!is_punct(P, '=')) return err_after(P, "expected '=' after attribute name '%s'", a.key);
    next(P);
    switch (P->tok.kind) {
    case T_INT: a.kind = IR_ATTR_INT, a.i = P->tok.i; break;
    case T_FLOAT: a.kind = IR_ATTR_FLOAT, a.f = P->tok.f; break;
    case T_STRING: a.kind = IR_ATTR_STR, a.s = dup_tok(P); break;
    case T_IDENT:
      if (strcmp(P->tok.str, "inf") == 0) {
        a.kind = IR_ATTR_FLOAT, a.f = INFINITY;
        break;
      }
      if (strcmp(P->tok.str, "nan") == 0) {
        a.kind = IR_ATTR_FLOAT, a.f = NAN;
        break;
      }
      return err_tok(P, "expected a number or a string for attribute '%s', found %s; quote strings",
                     a.key, describe(P));
    default:
      return err_after(P, "expected a number or a string for attribute '%s'", a.key);
    }
    attrs[(*n)++] = a;
    next(P);
    if (is_punct(P, ',')) {
      next(P);
      continue;
    }
    if (is_punct(P, '}')) {
      next(P);
      return true;
    }
    return err_after(P, "expected ',' or '}' after attribute '%s'", a.key);
  }
}

typedef struct Schedule {
  IrStream stream;
  IrPhase phase;
  int chunk, event;
  int waits[IR_MAX_WAITS];
  int nwaits;
} Schedule;

static bool parse_sched_int(Parser *P, const char *key, int *out) {
  if (P->tok.kind != T_INT || P->tok.i < 0 || P->tok.i > INT_MAX)
    return err_after(P, "expected a non-negative integer for '%s'", key);
  *out = (int)P->tok.i;
  next(P);
  return true;
}

// sched = "!" "{" skey "=" sval ("," skey "=" sval)* "}"
// skey = stream | chunk | phase | wait | event;  wait's value = "[" (int ("," int)*)? "]"
static bool parse_schedule(Parser *P, Schedule *s) {
  SrcLoc bang = P->tok.loc;
  next(P);  // '!'
  if (!is_punct(P, '{')) return err_after(P, "expected '{' after '!'");
  next(P);
  unsigned seen = 0;
  static const char *const keys[] = {"stream", "chunk", "phase", "wait", "event"};
  while (!is_punct(P, '}')) {
    if (P->tok.kind != T_IDENT) return err_after(P, "expected a scheduling key (stream, chunk, phase, wait or event)");
    int key = -1;
    for (int i = 0; i < 5; i++)
      if (strcmp(P->tok.str, keys[i]) == 0) key = i;
    if (key < 0)
      return err_tok(P, "unknown scheduling key '%s'; expected stream, chunk, phase, wait or event",
                     P->tok.str);
    if (seen & (1u << key)) return err_tok(P, "scheduling key '%s' given twice", keys[key]);
    seen |= 1u << key;
    next(P);
    if (!expect(P, '=', "after the scheduling key")) return false;
    if (key == 0 || key == 2) {
      if (P->tok.kind != T_IDENT) return err_after(P, "expected a %s name", keys[key]);
      const char *w = P->tok.str;
      if (key == 0) {
        if (strcmp(w, "compute") == 0) s->stream = IR_STREAM_COMPUTE;
        else if (strcmp(w, "intra") == 0) s->stream = IR_STREAM_INTRA;
        else if (strcmp(w, "inter") == 0) s->stream = IR_STREAM_INTER;
        else return err_tok(P, "unknown stream '%s'; expected compute, intra or inter", w);
      } else {
        if (strcmp(w, "fwd") == 0) s->phase = IR_PHASE_FWD;
        else if (strcmp(w, "bwd") == 0) s->phase = IR_PHASE_BWD;
        else if (strcmp(w, "opt") == 0) s->phase = IR_PHASE_OPT;
        else if (strcmp(w, "none") == 0) s->phase = IR_PHASE_NONE;
        else return err_tok(P, "unknown phase '%s'; expected fwd, bwd or opt", w);
      }
      next(P);
    } else if (key == 1) {
      if (!parse_sched_int(P, "chunk", &s->chunk)) return false;
    } else if (key == 4) {
      if (!parse_sched_int(P, "event", &s->event)) return false;
    } else {
      if (!expect(P, '[', "after 'wait='")) return false;
      while (!is_punct(P, ']')) {
        if (s->nwaits == IR_MAX_WAITS) return err_tok(P, "too many waits (at most %d)", IR_MAX_WAITS);
        if (!parse_sched_int(P, "wait", &s->waits[s->nwaits])) return false;
        s->nwaits++;
        if (is_punct(P, ',')) {
          next(P);
          if (is_punct(P, ']')) return err_tok(P, "expected an event after ','");
        } else if (!is_punct(P, ']')) {
          return err_after(P, "expected ',' or ']' in the wait list");
        }
      }
      next(P);  // ']'
    }
    if (is_punct(P, ',')) {
      next(P);
      if (is_punct(P, '}')) return err_tok(P, "expected a scheduling key after ','");
    } else if (!is_punct(P, '}')) {
      return err_after(P, "expected ',' or '}' in the scheduling annotation");
    }
  }
  next(P);  // '}'
  if (s->stream == IR_STREAM_NONE) return err_at(P, bang, "scheduling annotation without a 'stream'");
  return true;
}

static void hint_value(Parser *P, char *hint, size_t cap, const char *name) {
  const IrFunc *f = P->f;
  int n = f->nvalues + (f->saves ? f->saves->nvalues : 0);
  const char **names = xrealloc(NULL, sizeof *names * (size_t)(n ? n : 1));
  int k = 0;
  for (int i = 0; i < f->nvalues; i++) names[k++] = f->values[i]->name;
  for (int i = 0; f->saves && i < f->saves->nvalues; i++) names[k++] = f->saves->values[i]->name;
  const char *best = ir_closest(name, names, k);
  if (best) snprintf(hint, cap, "; did you mean '%%%s'?", best);
  free(names);
}

// A %name read as an operand or a return value.
static bool resolve_value(Parser *P, IrValue **out) {
  const char *name = P->tok.str;
  *out = ir_find_value(P->f, name);
  if (*out) return true;
  if (is_poisoned(P, name)) return false;  // its definition already failed with an error
  char hint[128] = "";
  hint_value(P, hint, sizeof hint, name);
  return err_tok(P, "use of undefined value '%%%s'%s", name, hint);
}

static bool resolve_param(Parser *P, IrParam **out) {
  const char *name = P->tok.str;
  *out = ir_find_param(P->m, name);
  if (*out) return true;
  const char **names = xrealloc(NULL, sizeof *names * (size_t)(P->m->nparams ? P->m->nparams : 1));
  for (int i = 0; i < P->m->nparams; i++) names[i] = P->m->params[i]->name;
  const char *best = ir_closest(name, names, P->m->nparams);
  char hint[128] = "";
  if (best) snprintf(hint, sizeof hint, "; did you mean '@%s'?", best);
  free(names);
  return err_tok(P, "unknown parameter '@%s'%s", name, hint);
}

// A new value name in the current function: not defined yet there, nor in the function it saves
// (where a use would be ambiguous).
static bool check_new_value(Parser *P, const char *name, SrcLoc loc, const IrFunc *saves) {
  for (int i = 0; i < P->f->nvalues; i++)
    if (strcmp(P->f->values[i]->name, name) == 0) {
      err_at(P, loc, "value '%%%s' defined twice", name);
      const IrOp *def = P->f->values[i]->def;
      if (def && def->loc.src) ir_note_at(P->d, def->loc, "first defined here");
      return false;
    }
  if (saves)
    for (int i = 0; i < saves->nvalues; i++)
      if (strcmp(saves->values[i]->name, name) == 0)
        return err_at(P, loc, "value '%%%s' is already defined in @%s, which @%s saves", name,
                      saves->name, P->f->name);
  return true;
}

static const char *const *op_names(void) {
  static const char *names[IR_OP_COUNT];
  for (int i = 0; i < IR_OP_COUNT; i++) names[i] = ir_op_info[i].name;
  return names;
}

// stmt = (%name ":" type "=")? opname (operand ("," operand)*)? attrs? sched?
// operand = %name | @name
static bool parse_op(Parser *P) {
  const char *rname = NULL;
  IrType rtype = {0};
  if (P->tok.kind == T_LOCAL) {
    SrcLoc name_loc = P->tok.loc;
    if (!check_new_value(P, P->tok.str, name_loc, P->f->saves)) return false;
    rname = dup_tok(P);
    next(P);
    // From here a failure poisons the name so later uses stay quiet.
    bool ok = expect(P, ':', "after value name") && parse_type(P, &rtype, "after ':'") &&
              expect(P, '=', "after the result type");
    if (!ok) {
      poison(P, rname);
      return false;
    }
    if (P->tok.kind != T_IDENT || !on_line(P)) {
      poison(P, rname);
      return err_after(P, "expected an op name after '='");
    }
  }
  if (P->tok.kind != T_IDENT) return err_tok(P, "expected an op or 'return', found %s", describe(P));
  IrOpKind kind = ir_op_by_name(P->tok.str);
  SrcLoc op_loc = P->tok.loc;
  if (kind == IR_OP_COUNT) {
    const char *best = ir_closest(P->tok.str, op_names(), IR_OP_COUNT);
    if (rname) poison(P, rname);
    if (best) return err_tok(P, "unknown op '%s'; did you mean '%s'?", P->tok.str, best);
    return err_tok(P, "unknown op '%s'", P->tok.str);
  }
  next(P);

  IrOperand args[IR_MAX_ARGS];
  int nargs = 0;
  IrAttr attrs[IR_MAX_ATTRS];
  int nattrs = 0;
  Schedule sched = {.event = -1};
  bool ok = true;
  if ((P->tok.kind == T_LOCAL || P->tok.kind == T_GLOBAL) && on_line(P)) {
    for (;;) {
      IrOperand a = {0};
      if ((P->tok.kind != T_LOCAL && P->tok.kind != T_GLOBAL) || !on_line(P))
        ok = err_after(P, "expected an operand (%%value or @param) after ','");
      else if (nargs == IR_MAX_ARGS)
        ok = err_tok(P, "too many operands for '%s' (at most %d)", ir_op_info[kind].name, IR_MAX_ARGS);
      else if (P->tok.kind == T_LOCAL)
        ok = resolve_value(P, &a.value);
      else
        ok = resolve_param(P, &a.param);
      if (!ok) break;
      args[nargs++] = a;
      next(P);
      if (!is_punct(P, ',') || !on_line(P)) break;
      next(P);
    }
  }
  if (ok && is_punct(P, '{') && on_line(P)) ok = parse_attrs(P, attrs, &nattrs, IR_MAX_ATTRS);
  if (ok && is_punct(P, '!') && on_line(P)) ok = parse_schedule(P, &sched);
  if (ok) ok = expect_eol(P, "the op");
  if (!ok) {
    if (rname) poison(P, rname);
    return false;
  }

  IrOp *op = ir_add_op(P->f, P->m, kind, rname, rtype);
  for (int i = 0; i < nargs; i++) op->args[i] = args[i];
  op->nargs = nargs;
  memcpy(op->attrs, attrs, sizeof attrs[0] * (size_t)nattrs);
  op->nattrs = nattrs;
  op->loc = op_loc;
  op->stream = sched.stream;
  op->phase = sched.phase;
  op->chunk = sched.chunk;
  op->event = sched.event;
  memcpy(op->waits, sched.waits, sizeof sched.waits);
  op->nwaits = sched.nwaits;
  return true;
}

// return = "return" (%name ("," %name)*)?
static bool parse_return(Parser *P) {
  next(P);  // 'return'
  if (P->tok.kind == T_LOCAL && on_line(P)) {
    for (;;) {
      IrValue *v;
      if (P->tok.kind != T_LOCAL || !on_line(P)) return err_after(P, "expected a value after ','");
      if (!resolve_value(P, &v)) return false;
      ir_add_ret(P->f, P->m, v);
      next(P);
      if (!is_punct(P, ',') || !on_line(P)) break;
      next(P);
    }
  }
  return expect_eol(P, "'return'");
}

static bool at_top_keyword(const Parser *P) {
  return P->tok.bol && (is_keyword(P, "func") || is_keyword(P, "param") || is_keyword(P, "module"));
}

// A list of names as written or as computed ("%a, @w"), to compare a group's header with its
// members.
typedef struct Names {
  char *s;
  size_t len, cap;
} Names;

static void names_add(Names *l, char sigil, const char *name) {
  size_t need = l->len + strlen(name) + 4;
  if (need > l->cap) {
    l->cap = need * 2;
    l->s = xrealloc(l->s, l->cap);
  }
  l->len += (size_t)sprintf(l->s + l->len, "%s%c%s", l->len ? ", " : "", sigil, name);
}

static const char *names_text(const Names *l) { return l->len ? l->s : "nothing"; }

// "(" (operand ("," operand)*)? ")" after the word what, into l.
static bool parse_names(Parser *P, Names *l, const char *what) {
  if (!is_keyword(P, what) || !on_line(P)) return err_after(P, "expected '%s (...)' in the fused group's header", what);
  next(P);
  if (!is_punct(P, '(') || !on_line(P)) return err_after(P, "expected '(' after '%s'", what);
  next(P);
  while (!is_punct(P, ')')) {
    if ((P->tok.kind != T_LOCAL && P->tok.kind != T_GLOBAL) || !on_line(P))
      return err_after(P, "expected a %%value or @param in the group's '%s' list, or ')'", what);
    names_add(l, P->tok.kind == T_LOCAL ? '%' : '@', P->tok.str);
    next(P);
    if (is_punct(P, ',') && on_line(P)) next(P);
    else if (!is_punct(P, ')')) return err_after(P, "expected ',' or ')' in the group's '%s' list", what);
  }
  next(P);
  return true;
}

// Whether group g's reads and writes (ir_group_io) are the lists its header wrote.
static bool check_group_io(Parser *P, SrcLoc loc, const IrGroup *g, const Names *reads, const Names *writes) {
  int cap = g->n * IR_MAX_ARGS, nr = 0, nw = 0;
  IrOperand *r = xrealloc(NULL, sizeof *r * (size_t)cap);
  const IrValue **w = xrealloc(NULL, sizeof *w * (size_t)cap);
  ir_group_io(P->f, g, r, &nr, w, &nw, cap);
  Names have[2] = {{0}, {0}};
  for (int j = 0; j < nr; j++) names_add(&have[0], r[j].param ? '@' : '%', r[j].param ? r[j].param->name : r[j].value->name);
  for (int j = 0; j < nw; j++) names_add(&have[1], '%', w[j]->name);
  bool ok = true;
  if (strcmp(names_text(&have[0]), names_text(reads)))
    ok = err_at(P, loc, "fused group %d reads %.300s from outside it (its members' operands), not %.300s as written",
                g->id, names_text(&have[0]), names_text(reads));
  else if (strcmp(names_text(&have[1]), names_text(writes)))
    ok = err_at(P, loc, "fused group %d writes %.300s (its members' results without inner=1), not %.300s as written",
                g->id, names_text(&have[1]), names_text(writes));
  free(r), free(w), free(have[0].s), free(have[1].s);
  return ok;
}

// The group's members, up to its '}'; false when one failed (each reported).
static bool parse_members(Parser *P, int id) {
  bool ok = true;
  for (;;) {
    if (P->d->errors > (P->d->max_errors > 0 ? P->d->max_errors : 20)) return false;
    if (is_punct(P, '}')) {
      next(P);
      return expect_eol(P, "'}'") && ok;
    }
    if (P->tok.kind == T_EOF || at_top_keyword(P)) return err_after(P, "expected '}' to close fused group %d", id);
    long start = P->ntok;
    bool one;
    if (is_keyword(P, "fused")) one = err_tok(P, "fused groups do not nest: close group %d with '}' first", id);
    else if (is_keyword(P, "return")) one = err_tok(P, "'return' cannot be inside fused group %d", id);
    else one = parse_op(P);
    if (!one) sync_line(P, start), ok = false;
  }
}

// A group's header: its number, kind, in_gemm, reads and writes, up to the end of its '{' line.
static bool parse_group_header(Parser *P, int *id, int *kind, bool *in_gemm, Names *reads, Names *writes) {
  if (P->tok.kind != T_INT || !on_line(P) || P->tok.i < 0 || P->tok.i > INT32_MAX)
    return err_after(P, "expected the group's number (0 or more) after 'fused'");
  *id = (int)P->tok.i;
  next(P);
  *kind = 0;
  while (*kind < IR_GROUP_KINDS && !(P->tok.kind == T_IDENT && strcmp(P->tok.str, ir_group_kind_name[*kind]) == 0)) (*kind)++;
  if (*kind == IR_GROUP_KINDS || !on_line(P)) {
    const char *best = P->tok.kind == T_IDENT ? ir_closest(P->tok.str, ir_group_kind_name, IR_GROUP_KINDS) : NULL;
    char hint[64] = "";
    if (best) snprintf(hint, sizeof hint, "; did you mean '%s'?", best);
    return err_after(P, "expected the group's kind (elementwise, rows, store, colsums, gate, update) after its number%s", hint);
  }
  next(P);
  *in_gemm = is_keyword(P, "in_gemm") && on_line(P);
  if (*in_gemm) next(P);
  return parse_names(P, reads, "reads") && parse_names(P, writes, "writes") && expect(P, '{', "to open the fused group") &&
         (P->tok.bol || err_tok(P, "expected end of line after '{'"));
}

// group = "fused" INT KIND "in_gemm"? "reads" "(" names ")" "writes" "(" names ")" "{" NL (stmt NL)+ "}"
static bool parse_group(Parser *P) {
  SrcLoc loc = P->tok.loc;
  next(P);   // 'fused'
  int id = 0, kind = 0;
  bool in_gemm = false;
  Names reads = {0}, writes = {0};
  bool ok = parse_group_header(P, &id, &kind, &in_gemm, &reads, &writes);
  if (!ok) {   // past the group's members: to its '}' line (no member's line starts with '}'); the
               // values they define stay quiet when used later
    while (P->tok.kind != T_EOF && !(P->tok.bol && (is_punct(P, '}') || at_top_keyword(P)))) {
      if (P->tok.bol && P->tok.kind == T_LOCAL) poison(P, dup_tok(P));
      next(P);
    }
    if (is_punct(P, '}')) next(P);
  }
  int first = P->f->nops;
  ok = ok && parse_members(P, id);
  IrGroup *g = NULL;
  char why[160];
  if (ok && P->f->nops == first) ok = err_at(P, loc, "fused group %d holds no op", id);
  if (ok && !(g = ir_add_group(P->f, P->m, id, (IrGroupKind)kind, first, P->f->nops - first)))
    ok = err_at(P, loc, "fused group %d: its ops are in another group", id);
  if (ok) g->in_gemm = in_gemm;
  if (ok && !ir_group_fits(P->f, g, why, sizeof why)) ok = err_at(P, loc, "fused group %d (%s): %s", id, ir_group_kind_name[kind], why);
  if (ok) ok = check_group_io(P, loc, g, &reads, &writes);
  free(reads.s), free(writes.s);
  return ok;
}

// body = "{" NL ((stmt | group) NL)* (return NL)? "}"
static bool parse_body(Parser *P) {
  if (!expect(P, '{', "to open the function body")) return false;
  if (!P->tok.bol) return err_tok(P, "expected end of line after '{'");
  bool returned = false;
  for (;;) {
    if (P->d->errors > (P->d->max_errors > 0 ? P->d->max_errors : 20)) return false;
    if (is_punct(P, '}')) {
      next(P);
      return expect_eol(P, "'}'");
    }
    if (P->tok.kind == T_EOF || at_top_keyword(P))
      return err_after(P, "expected '}' to close @%s", P->f->name);
    long start = P->ntok;
    bool ok;
    if (returned)
      ok = err_tok(P, "'return' must be the last statement of @%s", P->f->name);
    else if (is_keyword(P, "return"))
      returned = true, ok = parse_return(P);
    else if (is_keyword(P, "fused"))
      ok = parse_group(P);
    else
      ok = parse_op(P);
    if (!ok) sync_line(P, start);
  }
}

// func = "func" @name "(" (%name ":" type ("," %name ":" type)*)? ")" ("saves" @name)?
//        ("attributes" attrs)? body
static bool parse_func(Parser *P) {
  next(P);  // 'func'
  if (P->tok.kind != T_GLOBAL || !on_line(P)) return err_after(P, "expected a function name (@name) after 'func'");
  SrcLoc name_loc = P->tok.loc;
  if (ir_find_func(P->m, P->tok.str)) return err_tok(P, "function '@%s' defined twice", P->tok.str);
  const char *name = dup_tok(P);
  next(P);
  if (!expect(P, '(', "after the function name")) return false;
  P->ndecls = 0;
  while (!is_punct(P, ')')) {
    if (P->tok.kind != T_LOCAL) return err_after(P, "expected an argument (%%name: type) or ')'");
    for (int i = 0; i < P->ndecls; i++)
      if (strcmp(P->decls[i].name, P->tok.str) == 0)
        return err_tok(P, "value '%%%s' defined twice", P->tok.str);
    if (P->ndecls == P->cap_decls) {
      P->cap_decls = P->cap_decls ? P->cap_decls * 2 : 8;
      P->decls = xrealloc(P->decls, sizeof *P->decls * (size_t)P->cap_decls);
    }
    ArgDecl *a = &P->decls[P->ndecls];
    a->name = dup_tok(P);
    a->loc = P->tok.loc;
    next(P);
    if (!expect(P, ':', "after value name") || !parse_type(P, &a->type, "after ':'")) return false;
    P->ndecls++;
    if (is_punct(P, ',')) {
      next(P);
      if (is_punct(P, ')')) return err_tok(P, "expected an argument after ','");
    } else if (!is_punct(P, ')')) {
      return err_after(P, "expected ',' or ')' after the argument");
    }
  }
  next(P);  // ')'
  IrFunc *saves = NULL;
  if (is_keyword(P, "saves") && on_line(P)) {
    next(P);
    if (P->tok.kind != T_GLOBAL) return err_after(P, "expected a function name (@name) after 'saves'");
    if (strcmp(P->tok.str, name) == 0) return err_tok(P, "@%s cannot save its own values", name);
    saves = ir_find_func(P->m, P->tok.str);
    if (!saves) {
      const char **names = xrealloc(NULL, sizeof *names * (size_t)(P->m->nfuncs ? P->m->nfuncs : 1));
      for (int i = 0; i < P->m->nfuncs; i++) names[i] = P->m->funcs[i]->name;
      const char *best = ir_closest(P->tok.str, names, P->m->nfuncs);
      char hint[128] = "";
      if (best) snprintf(hint, sizeof hint, "; did you mean '@%s'?", best);
      free(names);
      return err_tok(P, "unknown function '@%s' (a saved function must come before)%s", P->tok.str, hint);
    }
    next(P);
  }
  IrAttr attrs[IR_MAX_ATTRS];
  int nattrs = 0;
  if (is_keyword(P, "attributes") && on_line(P)) {
    next(P);
    if (!is_punct(P, '{') || !on_line(P)) return err_after(P, "expected '{' after 'attributes'");
    if (!parse_attrs(P, attrs, &nattrs, IR_MAX_ATTRS)) return false;
  }
  IrFunc *f = ir_add_func(P->m, name, ir_func_role_of_name(name));
  f->loc = name_loc;
  f->saves = saves;
  memcpy(f->attrs, attrs, sizeof attrs[0] * (size_t)nattrs);
  f->nattrs = nattrs;
  P->f = f;
  P->npoisoned = 0;
  bool ok = true;
  for (int i = 0; i < P->ndecls; i++) {
    if (!check_new_value(P, P->decls[i].name, P->decls[i].loc, saves)) ok = false;
    ir_add_arg(f, P->m, P->decls[i].name, P->decls[i].type);
  }
  return parse_body(P) && ok;
}

// param = "param" @name ":" type attrs?
static bool parse_param(Parser *P) {
  next(P);  // 'param'
  if (P->tok.kind != T_GLOBAL || !on_line(P)) return err_after(P, "expected a parameter name (@name) after 'param'");
  SrcLoc loc = P->tok.loc;
  if (ir_find_param(P->m, P->tok.str)) return err_tok(P, "parameter '@%s' defined twice", P->tok.str);
  const char *name = dup_tok(P);
  next(P);
  IrType type;
  if (!expect(P, ':', "after the parameter name") || !parse_type(P, &type, "after ':'")) return false;
  IrAttr attrs[IR_MAX_ATTRS];
  int nattrs = 0;
  if (is_punct(P, '{') && on_line(P) && !parse_attrs(P, attrs, &nattrs, IR_MAX_ATTRS)) return false;
  if (!expect_eol(P, "the parameter")) return false;
  IrParam *p = ir_add_param(P->m, name, type);
  memcpy(p->attrs, attrs, sizeof attrs[0] * (size_t)nattrs);
  p->nattrs = nattrs;
  p->loc = loc;
  return true;
}

// header = "module" (ident | string) attrs?
static bool parse_header(Parser *P) {
  if (!is_keyword(P, "module")) return err_tok(P, "expected 'module NAME' at the start of the IR, found %s", describe(P));
  next(P);
  if ((P->tok.kind != T_IDENT && P->tok.kind != T_STRING) || !on_line(P))
    return err_after(P, "expected a module name after 'module'");
  P->m->name = dup_tok(P);
  next(P);
  if (is_punct(P, '{') && on_line(P) &&
      !parse_attrs(P, P->m->attrs, &P->m->nattrs, (int)(sizeof P->m->attrs / sizeof P->m->attrs[0])))
    return false;
  return expect_eol(P, "the module header");
}

// module = header (param | func)*
IrModule *ir_parse(IrDiag *d, const IrSource *src) {
  Parser P = {.d = d, .src = src, .line = 1, .col = 1, .prev_end = {src, 1, 1, 1}};
  P.m = ir_module_new(NULL);
  if (!P.m) {
    ir_oom(d);
    return NULL;
  }
  next(&P);
  long start = P.ntok;
  if (!parse_header(&P)) {
    // Without a header, look for the first item so later errors still show.
    while (P.tok.kind != T_EOF && !(at_top_keyword(&P) && !is_keyword(&P, "module"))) next(&P);
  }
  while (P.tok.kind != T_EOF) {
    if (d->errors > (d->max_errors > 0 ? d->max_errors : 20)) break;
    start = P.ntok;
    bool ok;
    P.f = NULL;
    if (!P.tok.bol)
      ok = err_tok(&P, "expected a new line before %s", describe(&P));
    else if (is_keyword(&P, "param"))
      ok = parse_param(&P);
    else if (is_keyword(&P, "func"))
      ok = parse_func(&P);
    else if (is_keyword(&P, "module"))
      ok = err_tok(&P, "a second 'module' header");
    else
      ok = err_tok(&P, "expected 'param' or 'func', found %s", describe(&P));
    if (!ok) {
      // Skip to the next item (but not back onto the one that just failed).
      while (P.tok.kind != T_EOF &&
             !(P.ntok != start && P.tok.bol && (is_keyword(&P, "param") || is_keyword(&P, "func"))))
        next(&P);
    }
  }
  free(P.buf);
  free(P.poisoned);
  free(P.decls);
  if (P.nerr > 0) {
    ir_module_free(P.m);
    return NULL;
  }
  return P.m;
}
