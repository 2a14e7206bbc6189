// The IR builder: an arena per module and append-only construction of params, functions,
// values and ops. Everything a module points to lives in its arena and is freed at once by
// ir_module_free, so passes never free individual nodes.
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"

typedef struct ArenaBlock {
  struct ArenaBlock *next;
  size_t used, cap;
  _Alignas(16) unsigned char data[];
} ArenaBlock;

struct IrArena {
  ArenaBlock *head;
};

static void *arena_alloc(IrArena *a, size_t bytes) {
  bytes = (bytes + 15) & ~(size_t)15;
  if (!a->head || a->head->used + bytes > a->head->cap) {
    size_t cap = bytes > 65536 ? bytes : 65536;
    ArenaBlock *b = malloc(sizeof *b + cap);
    if (!b) ir_oom_exit();  // no builder call can fail: its callers do not check
    b->next = a->head;
    b->used = 0;
    b->cap = cap;
    a->head = b;
  }
  void *p = a->head->data + a->head->used;
  a->head->used += bytes;
  memset(p, 0, bytes);
  return p;
}

IrModule *ir_module_new(const char *name) {
  IrArena *arena = calloc(1, sizeof *arena);
  if (!arena) return NULL;
  IrModule *m = arena_alloc(arena, sizeof *m);
  m->arena = arena;
  m->name = ir_strdup(m, name ? name : "module");
  return m;
}

void ir_module_free(IrModule *m) {
  if (!m) return;
  IrArena *a = m->arena;
  for (ArenaBlock *b = a->head; b;) {
    ArenaBlock *next = b->next;
    free(b);
    b = next;
  }
  free(a);
}

void *ir_alloc(IrModule *m, size_t bytes) { return arena_alloc(m->arena, bytes); }

const char *ir_strdup(IrModule *m, const char *s) {
  size_t n = strlen(s);
  char *p = ir_alloc(m, n + 1);
  memcpy(p, s, n + 1);
  return p;
}

const char *ir_strfmt(IrModule *m, const char *fmt, ...) {
  va_list ap, ap2;
  va_start(ap, fmt);
  va_copy(ap2, ap);
  int n = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  char *p = ir_alloc(m, (size_t)n + 1);
  vsnprintf(p, (size_t)n + 1, fmt, ap2);
  va_end(ap2);
  return p;
}

// Grows an arena-backed pointer array; old storage stays in the arena until the module dies.
static void grow(IrModule *m, void ***items, int n, int *cap) {
  if (n < *cap) return;
  int nc = *cap ? *cap * 2 : 16;
  void **ni = ir_alloc(m, sizeof(void *) * (size_t)nc);
  if (n) memcpy(ni, *items, sizeof(void *) * (size_t)n);
  *items = ni;
  *cap = nc;
}

// A new zeroed item of size bytes with its name, appended to an arena-backed pointer array;
// *index is its position there.
static void *append_named(IrModule *m, void ***items, int *n, int *cap, size_t size, const char *name, int *index) {
  char *item = ir_alloc(m, size);
  *(const char **)item = ir_strdup(m, name);   // IrParam and IrFunc both start with their name
  *index = *n;
  grow(m, items, *n, cap);
  (*items)[(*n)++] = item;
  return item;
}

// The item named name of an array whose items start with their name, or NULL.
static void *find_named(void *const *items, int n, const char *name) {
  for (int i = 0; i < n; i++)
    if (strcmp(*(const char *const *)items[i], name) == 0) return items[i];
  return NULL;
}

IrParam *ir_add_param(IrModule *m, const char *name, IrType type) {
  int index;
  IrParam *p = append_named(m, (void ***)&m->params, &m->nparams, &m->cap_params, sizeof *p, name, &index);
  p->index = index;
  p->type = type;
  return p;
}

IrParam *ir_find_param(const IrModule *m, const char *name) {
  return find_named((void *const *)m->params, m->nparams, name);
}

const char *const ir_policy_name[IR_NPOLICIES + 1] = {
    [IR_POLICY_FSMOE] = "fsmoe",
    [IR_POLICY_FSMOE_NO_IIO] = "fsmoe-no-iio",
    [IR_POLICY_TUTEL] = "tutel",
    [IR_POLICY_TUTEL_IMPROVED] = "tutel-improved",
    [IR_POLICY_PIPEMOE_LINA] = "pipemoe-lina",
    [IR_POLICY_SEQUENTIAL] = "sequential",
    [IR_NPOLICIES] = NULL,
};

bool ir_policy_parse(const char *name, IrPolicy *out) {
  for (int i = 0; i < IR_NPOLICIES; i++)
    if (strcmp(name, ir_policy_name[i]) == 0) {
      *out = (IrPolicy)i;
      return true;
    }
  return false;
}

IrFuncRole ir_func_role_of_name(const char *name) {
  size_t n = strlen(name);
  if (strcmp(name, "loss.fwd") == 0) return IR_ROLE_LOSS_FWD;
  if (strcmp(name, "loss.bwd") == 0) return IR_ROLE_LOSS_BWD;
  if (strcmp(name, "optimizer") == 0) return IR_ROLE_OPTIMIZER;
  if (n > 4 && strcmp(name + n - 4, ".fwd") == 0) return IR_ROLE_LAYER_FWD;
  if (n > 4 && strcmp(name + n - 4, ".bwd") == 0) return IR_ROLE_LAYER_BWD;
  return IR_ROLE_OTHER;
}

IrPhase ir_role_phase(IrFuncRole role) {
  switch (role) {
  case IR_ROLE_LAYER_FWD:
  case IR_ROLE_LOSS_FWD: return IR_PHASE_FWD;
  case IR_ROLE_LAYER_BWD:
  case IR_ROLE_LOSS_BWD: return IR_PHASE_BWD;
  case IR_ROLE_OPTIMIZER: return IR_PHASE_OPT;
  case IR_ROLE_OTHER: break;
  }
  return IR_PHASE_NONE;
}

IrFunc *ir_add_func(IrModule *m, const char *name, IrFuncRole role) {
  int index;
  IrFunc *f = append_named(m, (void ***)&m->funcs, &m->nfuncs, &m->cap_funcs, sizeof *f, name, &index);
  f->index = index;
  f->role = role;
  return f;
}

IrFunc *ir_find_func(const IrModule *m, const char *name) {
  return find_named((void *const *)m->funcs, m->nfuncs, name);
}

static IrValue *add_value(IrFunc *f, IrModule *m, const char *name, IrType type) {
  IrValue *v = ir_alloc(m, sizeof *v);
  v->name = ir_strdup(m, name);
  v->type = type;
  v->func = f;
  v->id = f->nvalues;
  grow(m, (void ***)&f->values, f->nvalues, &f->cap_values);
  f->values[f->nvalues++] = v;
  return v;
}

IrValue *ir_add_arg(IrFunc *f, IrModule *m, const char *name, IrType type) {
  IrValue *v = add_value(f, m, name, type);
  IrValue **na = ir_alloc(m, sizeof(IrValue *) * (size_t)(f->nargs + 1));
  if (f->nargs) memcpy(na, f->args, sizeof(IrValue *) * (size_t)f->nargs);
  na[f->nargs++] = v;
  f->args = na;
  return v;
}

IrOp *ir_add_op(IrFunc *f, IrModule *m, IrOpKind kind, const char *name, IrType type) {
  IrOp *op = ir_alloc(m, sizeof *op);
  op->kind = kind;
  op->func = f;
  op->event = -1;
  op->index = f->nops;
  if (name) {
    op->result = add_value(f, m, name, type);
    op->result->def = op;
  }
  grow(m, (void ***)&f->ops, f->nops, &f->cap_ops);
  f->ops[f->nops++] = op;
  return op;
}

void ir_op_arg(IrOp *op, IrValue *v) {
  if (op->nargs >= IR_MAX_ARGS) UNREACHABLE();
  op->args[op->nargs++] = (IrOperand){.value = v};
}

void ir_remove_op(IrFunc *f, IrOp *op) {
  int k = 0, g = 0;
  for (int j = 0; j < f->ngroups; j++) {   // a group loses the op, or moves up one op; an empty one goes
    IrGroup *gr = &f->groups[j];
    if (op->index < gr->first) gr->first--;
    else if (op->index < gr->first + gr->n) gr->n--;
    if (gr->n > 0) f->groups[g++] = *gr;
  }
  f->ngroups = g;
  for (int i = 0; i < f->nops; i++)
    if (f->ops[i] != op) f->ops[k++] = f->ops[i];
  f->nops = k;
  int n = 0;
  for (int i = 0; i < f->nvalues; i++)
    if (f->values[i] != op->result) f->values[n++] = f->values[i];
  f->nvalues = n;
  for (int i = 0; i < f->nops; i++) f->ops[i]->index = i;
  for (int i = 0; i < f->nvalues; i++) f->values[i]->id = i;
}

void ir_op_param(IrOp *op, IrParam *p) {
  if (op->nargs >= IR_MAX_ARGS) UNREACHABLE();
  op->args[op->nargs++] = (IrOperand){.param = p};
}

IrValue *ir_find_value(const IrFunc *f, const char *name) {
  for (const IrFunc *g = f; g; g = (g == f ? f->saves : NULL))
    for (int i = 0; i < g->nvalues; i++)
      if (strcmp(g->values[i]->name, name) == 0) return g->values[i];
  return NULL;
}

void ir_add_ret(IrFunc *f, IrModule *m, IrValue *v) {
  IrValue **nr = ir_alloc(m, sizeof(IrValue *) * (size_t)(f->nrets + 1));
  if (f->nrets) memcpy(nr, f->rets, sizeof(IrValue *) * (size_t)f->nrets);
  nr[f->nrets++] = v;
  f->rets = nr;
}

static IrAttr *attr_slot(IrAttr *attrs, int *n, const char *key) {
  for (int i = 0; i < *n; i++)
    if (strcmp(attrs[i].key, key) == 0) return &attrs[i];
  if (*n >= IR_MAX_ATTRS) UNREACHABLE();
  IrAttr *a = &attrs[(*n)++];
  memset(a, 0, sizeof *a);
  a->key = key;
  return a;
}

// Attribute keys passed to the setters are string literals or arena strings, so they are stored
// by pointer.
void ir_attrs_set_int(IrAttr *attrs, int *n, const char *key, int64_t v) {
  IrAttr *a = attr_slot(attrs, n, key);
  a->kind = IR_ATTR_INT;
  a->i = v;
}

void ir_attrs_set_float(IrAttr *attrs, int *n, const char *key, double v) {
  IrAttr *a = attr_slot(attrs, n, key);
  a->kind = IR_ATTR_FLOAT;
  a->f = v;
}

void ir_attrs_set_str(IrModule *m, IrAttr *attrs, int *n, const char *key, const char *v) {
  IrAttr *a = attr_slot(attrs, n, key);
  a->kind = IR_ATTR_STR;
  a->s = ir_strdup(m, v);
}

const IrAttr *ir_attrs_get(const IrAttr *attrs, int n, const char *key) {
  for (int i = 0; i < n; i++)
    if (strcmp(attrs[i].key, key) == 0) return &attrs[i];
  return NULL;
}

int64_t ir_attr_int(const IrAttr *attrs, int n, const char *key, int64_t dflt) {
  const IrAttr *a = ir_attrs_get(attrs, n, key);
  if (!a) return dflt;
  if (a->kind == IR_ATTR_INT) return a->i;
  if (a->kind == IR_ATTR_FLOAT) return (int64_t)a->f;
  return dflt;
}

double ir_attr_float(const IrAttr *attrs, int n, const char *key, double dflt) {
  const IrAttr *a = ir_attrs_get(attrs, n, key);
  if (!a) return dflt;
  if (a->kind == IR_ATTR_FLOAT) return a->f;
  if (a->kind == IR_ATTR_INT) return (double)a->i;
  return dflt;
}

const char *ir_attr_str(const IrAttr *attrs, int n, const char *key, const char *dflt) {
  const IrAttr *a = ir_attrs_get(attrs, n, key);
  return a && a->kind == IR_ATTR_STR ? a->s : dflt;
}
