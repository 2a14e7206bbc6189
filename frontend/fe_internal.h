// Front-end internals shared by the lexer (lang/lexer.l), the parser (lang/parser.y), the tree
// builder (ast.c), the checker (check.c) and the loader (load.c). Not part of the public fe.h.
//
// The parser is pure and the lexer reentrant; both reach the state of one parse through
// FeParseCtx (the lexer as yyextra, the parser as a %parse-param). Every string and node of a
// tree lives in the tree's arena, so neither the lexer nor the parser ever frees anything and
// error recovery cannot leak.
#ifndef FE_INTERNAL_H
#define FE_INTERNAL_H

#include <stddef.h>

#include "fe.h"

// The whole file at path, NUL-terminated (*len its length), or NULL with errno (load.c).
char *fe_read_file(const char *path, size_t *len);

// Blocks may nest this deep; deeper input gets a diagnostic instead of a deep parser stack.
#define FE_MAX_DEPTH 64

// ---- arena (ast.c) ----
FeArena *fe_arena_new(void);
void fe_arena_free(FeArena *a);
// Zeroed memory that lives as long as the arena; NULL when out of memory.
void *fe_arena_alloc(FeArena *a, size_t bytes);
char *fe_arena_strndup(FeArena *a, const char *s, size_t n);

// ---- one parse ----
typedef struct FeParseCtx {
  IrDiag *diag;
  const IrSource *src;
  FeTree *tree;
  int line, col;               // the lexer's position: of the next byte to read (1-based)
  int tok;                     // kind of the last token the lexer returned (a parser token)
  int prev_tok;                // the one before it, for hints such as "};"
  FeValue tok_val;             // text and location of the last token
  int tok_line;                // line of the last token
  int line_indent;             // column of the first token on that line
  int stmt_indent;             // line_indent of the current statement's keyword
  FeNode *stmt;                // the statement whose keyword and values are being read
  int depth;                   // open blocks
  FeNode *open[FE_MAX_DEPTH];  // their statements, innermost last
  SrcLoc open_brace[FE_MAX_DEPTH];
  int open_indent[FE_MAX_DEPTH];  // stmt_indent of each open statement
  SrcLoc misplaced_close;      // first '}' indented left of the block it closes (hint)
  const FeNode *misplaced_node;
  bool lex_error;              // the lexer reported an error; the parser stays quiet
  bool oom;                    // an allocation failed
} FeParseCtx;

// ---- tree construction, called from the parser's actions (ast.c) ----
// A new statement whose keyword is kw, appended to the innermost open block. NULL: out of memory.
FeNode *fe_ast_stmt(FeParseCtx *ctx, const FeValue *kw);
// Appends a value to stmt. False: out of memory.
bool fe_ast_value(FeParseCtx *ctx, FeNode *stmt, const FeValue *v);
// The statement ends with ';' at loc.
void fe_ast_end(FeParseCtx *ctx, FeNode *stmt, SrcLoc loc);
// stmt's '{' at loc opens a block. False (after a diagnostic) when blocks nest too deeply.
bool fe_ast_open(FeParseCtx *ctx, FeNode *stmt, SrcLoc loc);
// stmt's block is closed by '}' at loc.
void fe_ast_close(FeParseCtx *ctx, FeNode *stmt, SrcLoc loc);
// "k 2" / "layer block x 12": a statement's keyword and values as the user wrote them
// (shortened with "..." past max bytes), for messages. Written to buf.
const char *fe_stmt_text(const FeNode *stmt, char *buf, size_t size, size_t max);
// The location just after stmt's last value (or keyword): where a ';' would go.
SrcLoc fe_stmt_end(const FeNode *stmt);

#endif
