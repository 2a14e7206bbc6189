// The statement tree: an arena, the tree-building calls made by the parser's actions, and
// fe_parse(), which runs the flex scanner and the bison parser over one source.
//
// A tree is a root statement (key "") whose kids are the file's statements; each statement has
// a keyword, values and, when written with a block, kids. Every node, value array and string
// is allocated in the tree's arena, which fe_tree_free() releases at once: the parser never
// frees anything, so a syntax error in the middle of a file cannot leak.
//
// Arrays grow by doubling inside the arena without a capacity field: an array of n elements
// has room for 4 when n <= 4 and for the next power of two otherwise.
#include <limits.h>
#include <stdalign.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fe_internal.h"
#include "parser.h"
#include "lexer.h"

// ---- arena ----
typedef struct Chunk {
  struct Chunk *next;
  size_t used, cap;
  alignas(max_align_t) unsigned char data[];
} Chunk;

struct FeArena {
  Chunk *head;
};

enum { CHUNK_BYTES = 32 * 1024 };

FeArena *fe_arena_new(void) { return calloc(1, sizeof(FeArena)); }

void fe_arena_free(FeArena *a) {
  if (!a)
    return;
  for (Chunk *c = a->head, *next; c; c = next) {
    next = c->next;
    free(c);
  }
  free(a);
}

void *fe_arena_alloc(FeArena *a, size_t bytes) {
  const size_t align = alignof(max_align_t);
  if (bytes > SIZE_MAX / 2)
    return NULL;
  bytes = (bytes + align - 1) / align * align;
  Chunk *c = a->head;
  if (!c || c->cap - c->used < bytes) {
    size_t cap = bytes > CHUNK_BYTES ? bytes : CHUNK_BYTES;
    c = malloc(sizeof(Chunk) + cap);
    if (!c)
      return NULL;
    c->cap = cap;
    c->used = 0;
    // A big allocation gets a chunk of its own behind the current one, which stays in use.
    if (bytes > CHUNK_BYTES && a->head) {
      c->next = a->head->next;
      a->head->next = c;
    } else {
      c->next = a->head;
      a->head = c;
    }
  }
  void *p = c->data + c->used;
  c->used += bytes;
  memset(p, 0, bytes);
  return p;
}

char *fe_arena_strndup(FeArena *a, const char *s, size_t n) {
  char *p = fe_arena_alloc(a, n + 1);
  if (!p)
    return NULL;
  memcpy(p, s, n);
  p[n] = '\0';
  return p;
}

// Makes room for element n of *arr (see the file comment). False when out of memory.
static bool grow(FeArena *a, void **arr, int n, size_t elem) {
  if ((n > 0 && n < 4) || (n > 4 && (n & (n - 1)) != 0))
    return true;
  if (n > INT_MAX / 2)
    return false;
  int cap = n == 0 ? 4 : n * 2;
  void *p = fe_arena_alloc(a, (size_t)cap * elem);
  if (!p)
    return false;
  if (n > 0)
    memcpy(p, *arr, (size_t)n * elem);
  *arr = p;
  return true;
}

// ---- building the tree (called from lang/parser.y) ----
FeNode *fe_ast_stmt(FeParseCtx *ctx, const FeValue *kw) {
  FeArena *a = ctx->tree->arena;
  FeNode *parent = ctx->depth > 0 ? ctx->open[ctx->depth - 1] : ctx->tree->root;
  FeNode *n = fe_arena_alloc(a, sizeof *n);
  if (!n || !grow(a, (void **)&parent->kids, parent->nkids, sizeof(FeNode *))) {
    ctx->oom = true;
    return NULL;
  }
  n->key = kw->text;
  n->loc = kw->loc;
  parent->kids[parent->nkids++] = n;
  ctx->stmt = n;
  ctx->stmt_indent = ctx->line_indent;
  return n;
}

bool fe_ast_value(FeParseCtx *ctx, FeNode *stmt, const FeValue *v) {
  if (!grow(ctx->tree->arena, (void **)&stmt->vals, stmt->nvals, sizeof(FeValue))) {
    ctx->oom = true;
    return false;
  }
  stmt->vals[stmt->nvals++] = *v;
  return true;
}

void fe_ast_end(FeParseCtx *ctx, FeNode *stmt, SrcLoc loc) {
  stmt->end_loc = loc;
  ctx->stmt = NULL;
}

bool fe_ast_open(FeParseCtx *ctx, FeNode *stmt, SrcLoc loc) {
  if (ctx->depth >= FE_MAX_DEPTH) {
    ir_error_at(ctx->diag, loc, "blocks nested more than %d levels deep", FE_MAX_DEPTH);
    return false;
  }
  stmt->has_block = true;
  ctx->open[ctx->depth] = stmt;
  ctx->open_brace[ctx->depth] = loc;
  ctx->open_indent[ctx->depth] = ctx->stmt_indent;
  ctx->depth++;
  ctx->stmt = NULL;
  return true;
}

void fe_ast_close(FeParseCtx *ctx, FeNode *stmt, SrcLoc loc) {
  ctx->depth--;
  stmt->end_loc = loc;
  // A '}' alone at the start of its line, left of the line that opened its block, probably
  // belongs to an outer block: remember the first one for "unterminated block" errors.
  bool first_on_line = ctx->tok_line == loc.line && ctx->line_indent == loc.col;
  if (!ctx->misplaced_node && first_on_line && loc.line > stmt->loc.line &&
      loc.col < ctx->open_indent[ctx->depth]) {
    ctx->misplaced_node = stmt;
    ctx->misplaced_close = loc;
  }
}

// ---- statement text for messages ----
static void append(char *buf, size_t size, size_t *len, const char *s) {
  for (; *s && *len + 1 < size; s++)
    buf[(*len)++] = *s;
  buf[*len] = '\0';
}

const char *fe_stmt_text(const FeNode *stmt, char *buf, size_t size, size_t max) {
  char tmp[256];
  size_t len = 0;
  buf[0] = '\0';
  tmp[0] = '\0';
  append(tmp, sizeof tmp, &len, stmt->key);
  for (int i = 0; i < stmt->nvals && len < max; i++) {
    const FeValue *v = &stmt->vals[i];
    append(tmp, sizeof tmp, &len, " ");
    if (v->kind == FE_VAL_STRING) {
      append(tmp, sizeof tmp, &len, "\"");
      for (const char *s = v->text; *s; s++) {
        char c[3] = {'\\', *s, 0};
        append(tmp, sizeof tmp, &len, (*s == '"' || *s == '\\') ? c : c + 1);
      }
      append(tmp, sizeof tmp, &len, "\"");
    } else {
      append(tmp, sizeof tmp, &len, v->text);
    }
  }
  if (max + 4 > size)
    max = size > 4 ? size - 4 : 0;
  len = strlen(tmp);
  if (len > max) {
    memcpy(buf, tmp, max);
    strcpy(buf + max, "...");
  } else {
    memcpy(buf, tmp, len + 1);
  }
  return buf;
}

SrcLoc fe_stmt_end(const FeNode *stmt) {
  SrcLoc last = stmt->nvals > 0 ? stmt->vals[stmt->nvals - 1].loc : stmt->loc;
  return (SrcLoc){.src = last.src, .line = last.line, .col = last.col + last.len, .len = 1};
}

// ---- parsing ----
FeTree *fe_parse(IrDiag *d, const IrSource *src) {
  if (src->len > INT_MAX / 2) {
    ir_error(d, "%s: file too large (%zu bytes)", src->path, src->len);
    return NULL;
  }
  FeTree *tree = calloc(1, sizeof *tree);
  if (!tree || !(tree->arena = fe_arena_new()) ||
      !(tree->root = fe_arena_alloc(tree->arena, sizeof(FeNode)))) {
    ir_oom(d);
    fe_tree_free(tree);
    return NULL;
  }
  tree->src = src;
  tree->root->key = "";
  tree->root->loc = (SrcLoc){.src = src, .line = 1, .col = 1, .len = 1};
  tree->root->has_block = true;

  FeParseCtx ctx = {.diag = d, .src = src, .tree = tree, .line = 1, .col = 1};
  int errors = d->errors;
  yyscan_t scanner;
  if (fe_yylex_init_extra(&ctx, &scanner) != 0) {
    ir_oom(d);
    fe_tree_free(tree);
    return NULL;
  }
  YY_BUFFER_STATE buf = fe_yy_scan_bytes(src->text, (int)src->len, scanner);
  int rc = fe_yyparse(scanner, &ctx);
  fe_yy_delete_buffer(buf, scanner);
  fe_yylex_destroy(scanner);
  if (rc != 0 || d->errors != errors) {
    if (d->errors == errors)
      ir_error_at(d, ctx.tok_val.loc, "syntax error");
    fe_tree_free(tree);
    return NULL;
  }
  return tree;
}

void fe_tree_free(FeTree *t) {
  if (!t)
    return;
  fe_arena_free(t->arena);
  free(t);
}
