/* The grammar shared by .moe and .cluster files: a file is a list of statements, and a
 * statement is a keyword, zero or more values, then ';' or a block of statements:
 *
 *   file  = stmt*
 *   stmt  = IDENT value* ( ";" | "{" stmt* "}" )
 *   value = IDENT | INT | FLOAT | STRING | "*"
 *
 * The grammar knows no keywords: which statements a block accepts, how many values of which
 * type, ranges and defaults are the schema in frontend/check.c. Keeping the grammar generic
 * keeps it conflict-free and lets the checker give precise messages ("unknown gate 'gshrad'").
 *
 * The actions only call fe_ast_* (frontend/ast.c). Everything lives in the tree's arena, so no
 * symbol needs a %destructor: discarding a symbol during error handling frees nothing.
 *
 * Syntax errors are worded by yyreport_syntax_error() below from the parser state (LAC gives
 * the exact set of expected tokens): a missing ';', an unterminated block (reported at its
 * '{'), an unmatched '}', a ';' after '}'. The parse stops at the first syntax error.
 */
%define api.pure full
%define api.prefix {fe_yy}
%define parse.error custom
%define parse.lac full
%locations
%expect 0

%param {yyscan_t scanner}
%parse-param {FeParseCtx *ctx}

%code requires {
#include "fe_internal.h"
#ifndef YY_TYPEDEF_YY_SCANNER_T
#define YY_TYPEDEF_YY_SCANNER_T
typedef void *yyscan_t;
#endif
}

%code provides {
// The names flex's bison-bridge expects.
#define YYSTYPE FE_YYSTYPE
#define YYLTYPE FE_YYLTYPE
}

%code {
#include <string.h>

#include "lexer.h"

static void fe_yyerror(FE_YYLTYPE *loc, yyscan_t scanner, FeParseCtx *ctx, const char *msg);
static SrcLoc srcloc(const FeParseCtx *ctx, const FE_YYLTYPE *l);
}

%union {
  FeValue val;
  FeNode *node;
}

%token <val> IDENT "identifier"
%token <val> INT "integer"
%token <val> FLOAT "number"
%token <val> STRING "string"
%token <val> STAR "*"
%token <val> LBRACE "{"
%token <val> RBRACE "}"
%token <val> SEMI ";"

%type <node> head
%type <val> value

%%

file
  : stmts
  ;

stmts
  : %empty
  | stmts stmt
  ;

stmt
  : head ";"                  { fe_ast_end(ctx, $1, srcloc(ctx, &@2)); }
  | head "{"                  { if (!fe_ast_open(ctx, $1, srcloc(ctx, &@2))) YYABORT; }
      stmts "}"               { fe_ast_close(ctx, $1, srcloc(ctx, &@5)); }
  ;

head
  : IDENT                     { if (!($$ = fe_ast_stmt(ctx, &$1))) YYNOMEM; }
  | head value                { if (!fe_ast_value(ctx, $1, &$2)) YYNOMEM; $$ = $1; }
  ;

value
  : IDENT
  | INT
  | FLOAT
  | STRING
  | "*"
  ;

%%

static SrcLoc srcloc(const FeParseCtx *ctx, const FE_YYLTYPE *l) {
  int len = l->last_line == l->first_line ? l->last_column - l->first_column : 1;
  return (SrcLoc){.src = ctx->src, .line = l->first_line, .col = l->first_column,
                  .len = len > 0 ? len : 1};
}

// Only reached when the parser runs out of memory (YYNOMEM, or a stack past YYMAXDEPTH, which
// the nesting limit of fe_ast_open keeps from happening).
static void fe_yyerror(FE_YYLTYPE *loc, yyscan_t scanner, FeParseCtx *ctx, const char *msg) {
  (void)scanner;
  if (ctx->oom)
    ir_error_at(ctx->diag, srcloc(ctx, loc), "out of memory while parsing");
  else
    ir_error_at(ctx->diag, srcloc(ctx, loc), "input nested too deeply (%s)", msg);
}

static bool expects(const yypcontext_t *yyctx, yysymbol_kind_t sym) {
  yysymbol_kind_t expected[YYNTOKENS];
  int n = yypcontext_expected_tokens(yyctx, expected, YYNTOKENS);
  for (int i = 0; i < n; i++)
    if (expected[i] == sym)
      return true;
  return false;
}

static const char *token_name(yysymbol_kind_t sym) {
  switch (sym) {
  case YYSYMBOL_YYEOF: return "end of file";
  case YYSYMBOL_IDENT: return "identifier";
  case YYSYMBOL_INT: return "integer";
  case YYSYMBOL_FLOAT: return "number";
  case YYSYMBOL_STRING: return "string";
  case YYSYMBOL_STAR: return "'*'";
  case YYSYMBOL_LBRACE: return "'{'";
  case YYSYMBOL_RBRACE: return "'}'";
  case YYSYMBOL_SEMI: return "';'";
  default: return "token";
  }
}

static int yyreport_syntax_error(const yypcontext_t *yyctx, yyscan_t scanner, FeParseCtx *ctx) {
  (void)scanner;
  yysymbol_kind_t tok = yypcontext_token(yyctx);
  SrcLoc at = srcloc(ctx, yypcontext_location(yyctx));
  IrDiag *d = ctx->diag;
  char head[64];

  if (tok == YYSYMBOL_YYUNDEF || ctx->lex_error)
    return 0;  // the lexer has said what is wrong
  if (expects(yyctx, YYSYMBOL_SEMI) && ctx->stmt) {
    // After `k 2` only a value, ';' or '{' can follow: the ';' is missing.
    ir_error_at(d, fe_stmt_end(ctx->stmt), "expected ';' or '{' after '%s'",
                fe_stmt_text(ctx->stmt, head, sizeof head, 40));
    return 0;
  }
  switch (tok) {
  case YYSYMBOL_YYEOF:
    if (ctx->depth > 0) {
      const FeNode *open = ctx->open[ctx->depth - 1];
      ir_error_at(d, ctx->open_brace[ctx->depth - 1],
                  "unterminated '{' block of '%s': the file ends before its '}'",
                  fe_stmt_text(open, head, sizeof head, 40));
      if (ctx->misplaced_node)
        ir_note_at(d, ctx->misplaced_close,
                   "this '}' closes '%s' (line %d) but is indented like an outer block; "
                   "is a '}' missing before it?",
                   fe_stmt_text(ctx->misplaced_node, head, sizeof head, 40),
                   ctx->misplaced_node->loc.line);
      return 0;
    }
    break;
  case YYSYMBOL_RBRACE:
    ir_error_at(d, at, "unexpected '}': no block is open here");
    return 0;
  case YYSYMBOL_SEMI:
    if (ctx->prev_tok == RBRACE)
      ir_error_at(d, at, "unexpected ';' after '}': a block needs no ';'");
    else
      ir_error_at(d, at, "unexpected ';': expected a statement keyword");
    return 0;
  case YYSYMBOL_LBRACE:
    ir_error_at(d, at, "expected a statement keyword before '{'");
    return 0;
  case YYSYMBOL_STAR:
    ir_error_at(d, at, "expected a statement keyword, got '*'");
    return 0;
  case YYSYMBOL_INT:
  case YYSYMBOL_FLOAT:
  case YYSYMBOL_STRING:
    ir_error_at(d, at, "expected a statement keyword, got %s '%s'", token_name(tok),
                ctx->tok_val.text);
    return 0;
  default:
    break;
  }
  ir_error_at(d, at, "syntax error: unexpected %s", token_name(tok));
  return 0;
}
