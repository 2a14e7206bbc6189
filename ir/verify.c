// The verifier: structural checks on a whole module, reporting every problem it finds.
//
// Per module: parameter and function names unique, valid types, a `saves` function that comes
// earlier. Per function: value names unique and not shadowing the saved function's names (a
// use would be ambiguous in text), return values defined. Per op (rules from ir/ops.def):
// operand and result counts, required attributes, operands that resolve (a value of this
// function defined before the op, or of the function it saves; a parameter of this module),
// sane scheduling fields, and finally the result type equal to what ir_infer_type derives.
// An op that fails a structural check is not shape-checked, so one mistake gives one message.
// Fused groups (ir.h's IrGroup): in order, inside the function, apart, their ids unique in the
// module, their members fitting their kind (ir_group_fits).
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

#include "ir.h"

typedef struct Verifier {
  IrDiag *d;
  const IrModule *m;
} Verifier;

static const char *str_or(const char *s) { return s ? s : "?"; }

static const char *op_name(const IrOp *op) {
  return (unsigned)op->kind < IR_OP_COUNT ? ir_op_info[op->kind].name : "?";
}

// At the op's location when it has one, else "in @f: op N (name): msg".
static bool op_error(Verifier *V, const IrFunc *f, int index, const IrOp *op, const char *fmt, ...)
    __attribute__((format(printf, 5, 6)));
static bool op_error(Verifier *V, const IrFunc *f, int index, const IrOp *op, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (op && op->loc.src) return ir_error_at(V->d, op->loc, "%s: %s", op_name(op), msg);
  return ir_error(V->d, "in @%s: op %d (%s): %s", str_or(f->name), index, op ? op_name(op) : "?", msg);
}

static bool func_error(Verifier *V, const IrFunc *f, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static bool func_error(Verifier *V, const IrFunc *f, const char *fmt, ...) {
  char msg[768];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  if (f->loc.src) return ir_error_at(V->d, f->loc, "%s", msg);
  return ir_error(V->d, "in @%s: %s", str_or(f->name), msg);
}

static bool valid_type(const IrType *t) {
  if ((unsigned)t->dtype >= IR_DTYPE_COUNT || t->rank < 0 || t->rank > IR_MAX_RANK) return false;
  for (int i = 0; i < t->rank; i++)
    if (t->dim[i] < 0) return false;
  return true;
}

static int cmp_str(const void *a, const void *b) {
  return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// Sorted copy of the non-NULL value names of f (malloc'd), count in *n; NULL when out of memory.
static const char **sorted_names(const IrFunc *f, int *n) {
  const char **names = malloc(sizeof *names * (size_t)(f->nvalues > 0 ? f->nvalues : 1));
  *n = 0;
  if (!names) return NULL;
  for (int i = 0; i < f->nvalues; i++)
    if (f->values[i] && f->values[i]->name) names[(*n)++] = f->values[i]->name;
  qsort(names, (size_t)*n, sizeof *names, cmp_str);
  return names;
}

static bool is_visible(const IrFunc *f, const IrValue *v) {
  return v->func == f || (f->saves && v->func == f->saves);
}

static void check_values(Verifier *V, const IrFunc *f) {
  for (int i = 0; i < f->nvalues; i++) {
    const IrValue *v = f->values[i];
    if (!v || !v->name || !*v->name) {
      func_error(V, f, "value %d has no name", i);
      continue;
    }
    if (v->func != f) func_error(V, f, "value '%%%s' is listed in @%s but belongs elsewhere", v->name, str_or(f->name));
    if (!valid_type(&v->type)) {
      char ts[128];
      ir_type_str(&v->type, ts, sizeof ts);
      func_error(V, f, "value '%%%s' has an invalid type %s (rank %d)", v->name, ts, v->type.rank);
    }
  }
  int n;
  const char **names = sorted_names(f, &n);
  if (!names) {
    ir_oom(V->d);
    return;
  }
  for (int i = 1; i < n; i++)
    if (strcmp(names[i - 1], names[i]) == 0 && (i < 2 || strcmp(names[i - 2], names[i]) != 0))
      func_error(V, f, "value '%%%s' defined twice", names[i]);
  if (f->saves && f->saves != f) {
    int ns;
    const char **saved = sorted_names(f->saves, &ns);
    if (!saved) ir_oom(V->d);
    for (int i = 0; saved && i < n; i++)
      if ((i == 0 || strcmp(names[i - 1], names[i]) != 0) &&
          bsearch(&names[i], saved, (size_t)ns, sizeof *saved, cmp_str))
        func_error(V, f, "value '%%%s' of @%s is also defined in @%s, which it saves; uses would be ambiguous",
                   names[i], str_or(f->name), str_or(f->saves->name));
    free(saved);
  }
  free(names);
}

// Required attributes: the comma-separated ATTRS column of ops.def.
static bool check_attrs(Verifier *V, const IrFunc *f, int index, const IrOp *op) {
  bool ok = true;
  if (op->nattrs < 0 || op->nattrs > IR_MAX_ATTRS)
    return op_error(V, f, index, op, "has %d attributes (at most %d)", op->nattrs, IR_MAX_ATTRS);
  for (int i = 0; i < op->nattrs; i++)
    if (!op->attrs[i].key) return op_error(V, f, index, op, "attribute %d has no key", i);
  const char *p = ir_op_info[op->kind].attrs;
  while (*p) {
    size_t len = strcspn(p, ",");
    char key[64];
    snprintf(key, sizeof key, "%.*s", (int)len, p);
    if (!ir_attrs_get(op->attrs, op->nattrs, key)) ok = op_error(V, f, index, op, "missing attribute '%s'", key);
    p += len;
    if (*p == ',') p++;
  }
  return ok;
}

static bool check_operands(Verifier *V, const IrFunc *f, int index, const IrOp *op) {
  const IrModule *m = V->m;
  bool ok = true;
  for (int i = 0; i < op->nargs; i++) {
    const IrOperand *a = &op->args[i];
    if (!a->value == !a->param) {
      ok = op_error(V, f, index, op, "operand %d is neither a value nor a parameter", i + 1);
    } else if (a->param) {
      const IrParam *p = a->param;
      if (p->index < 0 || p->index >= m->nparams || m->params[p->index] != p)
        ok = op_error(V, f, index, op, "operand '@%s' is not a parameter of this module", str_or(p->name));
    } else {
      const IrValue *v = a->value;
      if (!is_visible(f, v))
        ok = op_error(V, f, index, op, "operand '%%%s' belongs to @%s, which @%s %s", str_or(v->name),
                      v->func ? str_or(v->func->name) : "?", str_or(f->name),
                      f->saves ? "does not save" : "cannot read (it saves no function)");
      else if (v->func == f && v->def && (v->def == op || v->def->index >= op->index))
        ok = op_error(V, f, index, op, "operand '%%%s' is used before it is defined", str_or(v->name));
    }
  }
  return ok;
}

static bool check_schedule(Verifier *V, const IrFunc *f, int index, const IrOp *op) {
  if ((unsigned)op->stream > IR_STREAM_INTER || (unsigned)op->phase > IR_PHASE_OPT)
    return op_error(V, f, index, op, "invalid stream or phase");
  if (op->nwaits < 0 || op->nwaits > IR_MAX_WAITS)
    return op_error(V, f, index, op, "has %d event waits (at most %d)", op->nwaits, IR_MAX_WAITS);
  if (op->stream == IR_STREAM_NONE) return true;  // the rest is not printed
  if (op->chunk < 0) return op_error(V, f, index, op, "negative chunk %d", op->chunk);
  if (op->event < -1) return op_error(V, f, index, op, "invalid event %d", op->event);
  for (int i = 0; i < op->nwaits; i++)
    if (op->waits[i] < 0) return op_error(V, f, index, op, "waits on invalid event %d", op->waits[i]);
  return true;
}

static void check_op(Verifier *V, const IrFunc *f, int index, const IrOp *op) {
  if (!op) {
    op_error(V, f, index, NULL, "missing op");
    return;
  }
  if ((unsigned)op->kind >= IR_OP_COUNT) {
    op_error(V, f, index, op, "invalid op kind %d", (int)op->kind);
    return;
  }
  const IrOpInfo *info = &ir_op_info[op->kind];
  bool ok = true;
  if (op->nargs != info->nargs) {
    op_error(V, f, index, op, "takes %d operand%s, got %d", info->nargs, info->nargs == 1 ? "" : "s", op->nargs);
    if (op->nargs < 0 || op->nargs > IR_MAX_ARGS) return;
    ok = false;
  }
  if (info->nres == 1 && !op->result)
    ok = op_error(V, f, index, op, "must have a result");
  else if (info->nres == 0 && op->result)
    ok = op_error(V, f, index, op, "has no result, but one is named '%%%s'", str_or(op->result->name));
  if (op->result && (op->result->def != op || op->result->func != f))
    ok = op_error(V, f, index, op, "its result '%%%s' is not linked to it", str_or(op->result->name));
  if (!check_attrs(V, f, index, op)) ok = false;
  if (!check_operands(V, f, index, op)) ok = false;
  if (!check_schedule(V, f, index, op)) ok = false;
  if (op->result && !valid_type(&op->result->type)) ok = false;  // check_values reported it
  if (!ok) return;

  IrType inferred;
  if (!ir_infer_type(V->d, op, &inferred)) return;
  if (op->result && !ir_type_equal(&op->result->type, &inferred)) {
    char declared[128], want[128];
    ir_type_str(&op->result->type, declared, sizeof declared);
    ir_type_str(&inferred, want, sizeof want);
    op_error(V, f, index, op, "result '%%%s' is declared %s but its operands give %s", str_or(op->result->name),
             declared, want);
  }
}

static void check_func(Verifier *V, const IrFunc *f) {
  const IrModule *m = V->m;
  if (f->saves) {
    const IrFunc *s = f->saves;
    if (s == f)
      func_error(V, f, "@%s saves itself", str_or(f->name));
    else if (s->index < 0 || s->index >= m->nfuncs || m->funcs[s->index] != s)
      func_error(V, f, "@%s saves a function that is not in the module", str_or(f->name));
    else if (s->index > f->index)
      func_error(V, f, "@%s saves @%s, which comes after it", str_or(f->name), str_or(s->name));
  }
  for (int i = 0; i < f->nargs; i++)
    if (!f->args[i] || f->args[i]->def || f->args[i]->func != f)
      func_error(V, f, "argument %d of @%s is not one of its values", i + 1, str_or(f->name));
  check_values(V, f);
  for (int i = 0; i < f->nops; i++) check_op(V, f, i, f->ops[i]);
  for (int i = 0; i < f->nrets; i++) {
    const IrValue *v = f->rets[i];
    if (!v)
      func_error(V, f, "return value %d is missing", i + 1);
    else if (!is_visible(f, v))
      func_error(V, f, "return value '%%%s' is not defined in @%s", str_or(v->name), str_or(f->name));
  }
}

// A fused group of the module, for the check that no id is used twice.
typedef struct GroupId {
  int id, func, k;   // its id, its function's index, its place among the function's groups
} GroupId;

static int by_id(const void *a, const void *b) {
  const GroupId *x = a, *y = b;
  if (x->id != y->id) return x->id < y->id ? -1 : 1;
  if (x->func != y->func) return x->func < y->func ? -1 : 1;
  return x->k < y->k ? -1 : x->k > y->k;
}

// f's fused groups (f is the module's function fi); ids[] collects the module's (counted in
// *nids) for check_group_ids.
static void check_groups(Verifier *V, const IrFunc *f, int fi, GroupId *ids, int *nids) {
  for (int k = 0; k < f->ngroups; k++) {
    const IrGroup *g = &f->groups[k];
    const IrOp *op = g->first >= 0 && g->first < f->nops ? f->ops[g->first] : NULL;
    char why[160];
    if (g->n < 1 || g->first < 0 || g->first + g->n > f->nops) {
      func_error(V, f, "fused group %d of @%s is not a run of its ops", g->id, str_or(f->name));
      continue;
    }
    if (k > 0 && f->groups[k - 1].first + f->groups[k - 1].n > g->first)
      op_error(V, f, g->first, op, "fused groups %d and %d overlap", f->groups[k - 1].id, g->id);
    else if (!ir_group_fits(f, g, why, sizeof why))
      op_error(V, f, g->first, op, "fused group %d (%s): %s", g->id, ir_group_kind_name[g->kind], why);
    ids[(*nids)++] = (GroupId){g->id, fi, k};
  }
}

// Every group id once in the module: sorted, a repeated id is reported where it comes again.
static void check_group_ids(Verifier *V, GroupId *ids, int nids) {
  qsort(ids, (size_t)nids, sizeof *ids, by_id);
  for (int i = 1; i < nids; i++) {
    if (ids[i].id != ids[i - 1].id) continue;
    const IrFunc *f = V->m->funcs[ids[i].func];
    const IrGroup *g = &f->groups[ids[i].k];
    op_error(V, f, g->first, f->ops[g->first], "fused group %d is numbered twice in the module", g->id);
  }
}

static void check_param(Verifier *V, int index, const IrParam *p) {
  char where[160];
  if (!p) {
    ir_error(V->d, "parameter %d is missing", index);
    return;
  }
  snprintf(where, sizeof where, "parameter '@%.100s'", str_or(p->name));
  if (!p->name || !*p->name) ir_error(V->d, "parameter %d has no name", index);
  if (p->index != index) ir_error(V->d, "%s is listed at %d but says %d", where, index, p->index);
  if (!valid_type(&p->type)) {
    char ts[128];
    ir_type_str(&p->type, ts, sizeof ts);
    if (p->loc.src)
      ir_error_at(V->d, p->loc, "%s has an invalid type %s", where, ts);
    else
      ir_error(V->d, "%s has an invalid type %s", where, ts);
  }
}

bool ir_verify(IrDiag *d, const IrModule *m) {
  Verifier V = {.d = d, .m = m};
  int before = d->errors;
  for (int i = 0; i < m->nparams; i++) check_param(&V, i, m->params[i]);
  for (int i = 0; i < m->nparams; i++)
    for (int j = 0; j < i; j++)
      if (m->params[i] && m->params[j] && m->params[i]->name && m->params[j]->name &&
          strcmp(m->params[i]->name, m->params[j]->name) == 0) {
        ir_error(d, "parameter '@%s' declared twice", m->params[i]->name);
        break;
      }
  for (int i = 0; i < m->nfuncs; i++) {
    const IrFunc *f = m->funcs[i];
    if (!f || !f->name || !*f->name) {
      ir_error(d, "function %d is missing or has no name", i);
      continue;
    }
    if (f->index != i) ir_error(d, "function '@%s' is listed at %d but says %d", f->name, i, f->index);
    for (int j = 0; j < i; j++)
      if (m->funcs[j] && m->funcs[j]->name && strcmp(m->funcs[j]->name, f->name) == 0) {
        func_error(&V, f, "function '@%s' defined twice", f->name);
        break;
      }
    check_func(&V, f);
  }
  int ngroups = 0, nids = 0;
  for (int i = 0; i < m->nfuncs; i++) ngroups += m->funcs[i] ? m->funcs[i]->ngroups : 0;
  GroupId *ids = malloc(sizeof *ids * (size_t)(ngroups + 1));
  if (!ids) return ir_oom(d);
  for (int i = 0; i < m->nfuncs; i++)
    if (m->funcs[i]) check_groups(&V, m->funcs[i], i, ids, &nids);
  check_group_ids(&V, ids, nids);
  free(ids);
  return d->errors == before;
}
