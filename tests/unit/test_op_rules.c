// Unit tests of the op table's rules as data (ir/ops.def: SHAPE, GRAD, KERNEL; runtime/kernels.def).
//
// Every rule of the table is well formed: a shape rule names its operands and binds the result's
// dims, a gradient rule names ops of the table with their operand counts, a kernel rule names
// kernels of runtime/kernels.def with one argument of the right kind per parameter. Malformed
// rules are rejected with a reason. And the rules do what they say on an op added through them
// alone (norm.rms): its shape is inferred and checked, autodiff writes its gradient op, and the
// lowering calls rt_rmsnorm / mk_rmsnorm with the row count, the row length and eps. The CUDA
// lowering splits loss.mse and loss.xent into partial sums and their sum; the CPU's stays one call.
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "codegen/cg_internal.h"
#include "ir/ir.h"
#include "passes/pass.h"

static bool ir_attrs_has_key(const char *keys, const char *key) { return strstr(keys, key) != NULL; }

// An IR_STORE op's KERNEL rule: one kernel whose parameters are pointers (operands, the result)
// and integers, which codegen/fused.c passes to the storing function.
static void check_store_rule(const char *rule, const char *name) {
  if (strchr(rule, ';')) fail_msg("%s: IR_STORE with a KERNEL rule of several kernels", name);
  char kernel[64];
  size_t len = strcspn(rule, "(");
  snprintf(kernel, sizeof kernel, "%.*s", (int)len, rule);
  int k = cg_kernel_by_name(kernel);
  if (k < 0) fail_msg("%s: no kernel %s", name, kernel);
  for (const char *c = cg_kernel_info[k].sig; *c; c++)
    if (*c != 'p' && *c != 'i') fail_msg("%s: IR_STORE's kernel %s takes a parameter other than pointers and ints", name, kernel);
}

static void test_every_rule_is_well_formed(void **state) {
  (void)state;
  int shapes = 0, grads = 0, kernels = 0;
  for (int k = 0; k < IR_OP_COUNT; k++) {
    const IrOpInfo *o = &ir_op_info[k];
    char why[200] = "";
    if (o->shape[0] && !ir_shape_rule_check(o->shape, o->nargs, why, sizeof why))
      fail_msg("%s: SHAPE \"%s\": %s", o->name, o->shape, why);
    if (o->grad[0] && !pass_grad_rule_check(o->grad, o->nargs, o->nres == 1, why, sizeof why))
      fail_msg("%s: GRAD \"%s\": %s", o->name, o->grad, why);
    if (o->kernel[0] && !cg_lower_rule_check(o->kernel, o->nargs, o->nres == 1, why, sizeof why))
      fail_msg("%s: KERNEL \"%s\": %s", o->name, o->kernel, why);
    if (o->grad[0] && o->cls == IR_CLASS_ROUTE) fail_msg("%s: a ROUTE op has no gradient", o->name);
    shapes += o->shape[0] != 0;
    grads += o->grad[0] != 0;
    kernels += o->kernel[0] != 0;
  }
  printf("# %d ops: %d shape rules, %d gradient rules, %d kernel rules as data\n", IR_OP_COUNT, shapes, grads, kernels);
  // every scalar expression (ir/scalar.def) of an op with a result, well formed
  int scalars = 0;
  for (int k = 0; k < IR_OP_COUNT; k++) {
    const char *e = ir_op_scalar((IrOpKind)k);
    char why[200] = "";
    if (!e) continue;
    scalars++;
    if (ir_op_info[k].nres != 1) fail_msg("%s: a scalar expression but no result", ir_op_info[k].name);
    if (!cg_scalar_check(e, ir_op_info[k].nargs, why, sizeof why)) fail_msg("%s: SCALAR \"%s\": %s", ir_op_info[k].name, e, why);
    // the CPU loops: one call of rt_fv_NAME (runtime/rt_fused.h) or arithmetic alone
    if (!cg_scalar_c_form(e)) fail_msg("%s: SCALAR \"%s\" mixes a function call with arithmetic", ir_op_info[k].name, e);
  }
  int rows = 0, colsums = 0, stores = 0;
  for (int k = 0; k < IR_OP_COUNT; k++) {
    if (ir_op_row((IrOpKind)k)) {   // a row function of the CUDA prelude, taking a loader per operand
      char fn[64];
      snprintf(fn, sizeof fn, "mk_%s_row(", ir_op_row((IrOpKind)k)->function);
      if (!strstr(cg_cuda_prelude(), fn)) fail_msg("%s: IR_ROW names %s, not in the CUDA prelude", ir_op_info[k].name, fn);
      if (ir_op_row((IrOpKind)k)->eps && !ir_attrs_has_key(ir_op_info[k].attrs, "eps"))
        fail_msg("%s: IR_ROW takes eps, the op has none", ir_op_info[k].name);
      rows++;
    }
    if (ir_op_store((IrOpKind)k)) {   // a storing function; its kernel: one call of pointers and integers
      char fn[64];
      snprintf(fn, sizeof fn, "mk_%s_store(", ir_op_store((IrOpKind)k));
      if (!strstr(cg_cuda_prelude(), fn)) fail_msg("%s: IR_STORE names %s, not in the CUDA prelude", ir_op_info[k].name, fn);
      check_store_rule(ir_op_info[k].kernel, ir_op_info[k].name);
      stores++;
    }
    if (ir_op_colsum((IrOpKind)k) >= 0) {
      if (ir_op_info[k].nargs != 1 + ir_op_colsum((IrOpKind)k)) fail_msg("%s: IR_COLSUM's operands", ir_op_info[k].name);
      colsums++;
    }
  }
  printf("# %d elementwise ops as scalar expressions, %d row-wise ops, %d column sums, %d storing ops a fused kernel can hold\n",
         scalars, rows, colsums, stores);
  assert_true(rows >= 4 && colsums >= 3 && stores >= 2);
  assert_true(scalars >= 10);
  // every kernel of runtime/kernels.def has a name and at most CG_MAX_KERNEL_ARGS parameters
  for (int k = 0; k < CG_K_COUNT; k++) {
    assert_int_equal(cg_kernel_by_name(cg_kernel_name(k)), k);
    assert_true(strlen(cg_kernel_info[k].sig) > 0);
  }
}

static void expect_bad(bool ok, const char *why, const char *reason) {
  if (ok) fail_msg("a malformed rule was accepted (expected: %s)", reason);
  if (!strstr(why, reason)) fail_msg("reason \"%s\" does not contain \"%s\"", why, reason);
}

// Every function an IR_SCALAR row calls has its chunk loop rt_fv_NAME in runtime/rt_fused.h, and
// every norm of IR_ROW its rows function rt_NAME_rows, which the CPU program's fused groups call
// (codegen/fused.c).
static void test_scalar_functions_have_cpu_loops(void **state) {
  (void)state;
  FILE *h = fopen(MOEC_ROOT "/runtime/rt_fused.h", "r");
  assert_non_null(h);
  static char text[1 << 16];
  size_t n = fread(text, 1, sizeof text - 1, h);
  text[n] = '\0';
  fclose(h);
  int functions = 0;
  for (int k = 0; k < IR_OP_COUNT; k++) {
    const char *e = ir_op_scalar((IrOpKind)k);
    char fn[48], decl[80];
    // a function call: a name right before its '(' (plain arithmetic, parentheses and all, has no loop)
    if (!e || sscanf(e, "%40[a-z_0-9]", fn) != 1 || e[strlen(fn)] != '(') continue;
    snprintf(decl, sizeof decl, "rt_fv_%s(int64_t m", fn);
    if (!strstr(text, decl)) fail_msg("%s: runtime/rt_fused.h has no %s", ir_op_info[k].name, decl);
    functions++;
  }
  assert_true(functions >= 8);
  int norms = 0;   // and every norm a CPU group can hold (a block a row) its rows function there
  for (int k = 0; k < IR_OP_COUNT; k++) {
    const IrRowInfo *ri = ir_op_row((IrOpKind)k);
    char decl[80];
    if (!ri || ri->per_thread) continue;
    snprintf(decl, sizeof decl, "void rt_%s_rows(", ri->function);
    if (!strstr(text, decl)) fail_msg("%s: runtime/rt_fused.h has no %s", ir_op_info[k].name, decl);
    norms++;
  }
  assert_true(norms >= 4);
}

static void test_malformed_rules_are_rejected(void **state) {
  (void)state;
  char why[200];
  expect_bad(ir_shape_rule_check("f[r,n] -> f[m]", 1, why, sizeof why), why, "dim 'm' is not an operand's");
  expect_bad(ir_shape_rule_check("f[r,n] f[n] -> =0", 2, why, sizeof why), why, "a ',' should follow operand 0");
  expect_bad(ir_shape_rule_check("f[r,n]", 1, why, sizeof why), why, "'->'");
  expect_bad(ir_shape_rule_check("=1, f* -> =0", 2, why, sizeof why), why, "not an earlier one");
  expect_bad(ir_shape_rule_check("q[r] -> =0", 1, why, sizeof why), why, "does not parse");
  expect_bad(pass_grad_rule_check("act.nope(dy, x0)", 1, true, why, sizeof why), why, "is not OP(");
  expect_bad(pass_grad_rule_check("mul(dy)", 2, true, why, sizeof why), why, "mul takes 2 operands");
  expect_bad(pass_grad_rule_check("dy", 2, true, why, sizeof why), why, "1 rules for 2 operands");
  expect_bad(pass_grad_rule_check("act.gelu.grad(dy, x1)", 1, true, why, sizeof why), why, "names an operand");
  expect_bad(cg_lower_rule_check("nokernel(x0) : one", 1, true, why, sizeof why), why, "no such kernel");
  expect_bad(cg_lower_rule_check("relu(x0, y) : threads n", 1, true, why, sizeof why), why, "fewer arguments");
  expect_bad(cg_scalar_check("x0 + x2", 2, why, sizeof why), why, "the op has 2 operands");
  expect_bad(cg_scalar_check("x0 * x1[col]", 2, why, sizeof why), why, "the index is c, r, ec, 0 or slice");
  expect_bad(cg_scalar_check("tanhish(x0)", 1, why, sizeof why), why, "the CUDA prelude has no mk_f_tanhish");
  expect_bad(cg_scalar_check("x0 + y", 1, why, sizeof why), why, "a name is an operand xK or a function call");
  expect_bad(cg_scalar_check("x0 ; x0", 1, why, sizeof why), why, "is not C arithmetic");
  assert_true(cg_scalar_check("gelu_grad(x0, x1) * x1[ec] + x0[0]", 2, why, sizeof why));
  expect_bad(cg_lower_rule_check("relu(x0, y, n, n) : threads n", 1, true, why, sizeof why), why, "more arguments");
  expect_bad(cg_lower_rule_check("relu(x1, y, n) : threads n", 1, true, why, sizeof why), why, "no such operand");
  expect_bad(cg_lower_rule_check("relu(x0, y, n)", 1, true, why, sizeof why), why, "': grid' is expected");
  expect_bad(cg_lower_rule_check("relu(x0, y, n) : warps n", 1, true, why, sizeof why), why, "threads, blocks, columns or one");
  expect_bad(cg_lower_rule_check("relu(x0, y, n) : columns 1", 1, true, why, sizeof why), why, "is expected");
  expect_bad(cg_lower_rule_check("relu(x0, grid, n) : one", 1, true, why, sizeof why), why, "a pointer");
  expect_bad(cg_lower_rule_check("lib blas", 1, true, why, sizeof why), why, "lib gemm");
  expect_bad(cg_lower_rule_check("sgd(x0, grad, n, @lr, @weight_decay) : one", 1, false, why, sizeof why), why,
             "no such operand");   // opt.sgd has no result: no n
  expect_bad(cg_lower_rule_check("relu(x0, y, y.7) : one", 1, true, why, sizeof why), why, "a dimension");
  expect_bad(cg_lower_rule_check("iota(y, y.0, y.1) : one", 1, false, why, sizeof why), why, "no such operand");
  expect_bad(cg_lower_rule_check("record_stats(x0, y, n0) : one", 1, true, why, sizeof why), why, "CUDA-only");
}

// A layer of matmul, norm.rms and a residual, with its loss: the IR text the front end would make.
static const char *const norm_module =
    "module t\n"
    "\n"
    "param @w: f32[8, 8]\n"
    "\n"
    "func @l0.fwd(%x: f32[4, 8]) {\n"
    "  %h: f32[4, 8] = matmul %x, @w\n"
    "  %n: f32[4, 8] = norm.rms %h {eps=0.001}\n"
    "  %y: f32[4, 8] = add %n, %x\n"
    "  return %y\n"
    "}\n"
    "\n"
    "func @loss.fwd(%out: f32[4, 8], %target: f32[4, 8]) {\n"
    "  %l: f32[] = loss.mse %out, %target\n"
    "  return %l\n"
    "}\n";

static IrModule *parse(IrDiag *d, const char *text, IrSource **src) {
  *src = ir_source_from_buffer("norm.ir", text, strlen(text));
  IrModule *m = ir_parse(d, *src);
  return m;
}

static void test_norm_rms_through_its_rules(void **state) {
  (void)state;
  IrDiag d;
  ir_diag_init(&d, stderr);
  IrSource *src;
  IrModule *m = parse(&d, norm_module, &src);
  assert_non_null(m);
  assert_true(ir_verify(&d, m));

  // the shape rule: a declared type that disagrees is caught, naming the op
  char *buf = NULL;
  size_t len = 0;
  FILE *f = open_memstream(&buf, &len);
  IrDiag quiet;
  ir_diag_init(&quiet, f);
  IrSource *bad_src;
  char *bad = strdup(norm_module);
  memcpy(strstr(bad, "%n: f32[4, 8]"), "%n: f32[4, 9]", 13);
  IrModule *bad_m = parse(&quiet, bad, &bad_src);
  fflush(f);
  assert_true(bad_m == NULL || !ir_verify(&quiet, bad_m));
  fflush(f);
  assert_non_null(strstr(buf, "norm.rms"));
  assert_non_null(strstr(buf, "f32[4, 8]"));
  ir_module_free(bad_m);
  ir_source_free(bad_src);
  fclose(f);
  free(buf);
  free(bad);

  // the gradient rule: autodiff writes norm.rms.grad(dy, h) with the forward's eps
  PassCtx ctx = {.d = &d};
  assert_true(pass_autodiff(m, &ctx));
  assert_true(ir_verify(&d, m));
  const IrOp *grad = NULL;
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++)
      if (m->funcs[i]->ops[j]->kind == IR_OP_NORM_RMS_GRAD) grad = m->funcs[i]->ops[j];
  assert_non_null(grad);
  assert_string_equal(grad->args[1].value->name, "h");
  assert_true(ir_op_float(grad, "eps", 0) == 0.001);

  // the kernel rule: rmsnorm_grad(dy, h, dh, rows 4, cols 8, eps), one block per row
  CgLaunch l;
  assert_true(cg_lower_op(grad, &l));
  assert_int_equal(l.ncalls, 1);
  assert_int_equal(l.call[0].kernel, CG_K_RMSNORM_GRAD);
  assert_int_equal(l.call[0].grid, 4);
  assert_int_equal(l.call[0].nargs, 6);
  assert_int_equal(l.call[0].args[0].kind, CG_ARG_OPERAND);
  assert_int_equal(l.call[0].args[2].kind, CG_ARG_RESULT);
  assert_int_equal(l.call[0].args[3].i, 4);
  assert_int_equal(l.call[0].args[4].i, 8);
  assert_int_equal(l.call[0].args[5].kind, CG_ARG_FLOAT);
  assert_true(l.call[0].args[5].f == 0.001);
  ir_module_free(m);
  ir_source_free(src);
}

// The CUDA target (cg_lower with fuse) runs the whole-tensor losses as a grid of partial sums in
// the launch's scratch and mk_sum_parts; the CPU (without fuse) keeps the one rt_mse / rt_xent.
static const char *const xent_module =
    "module t\n"
    "\n"
    "func @loss.fwd(%z: f32[1000, 16], %t: i32[1000]) {\n"
    "  %l: f32[] = loss.xent %z, %t\n"
    "  return %l\n"
    "}\n";

static void expect_split(const IrFunc *f, int kernel, int part_kernel, int64_t parts, int64_t div) {
  CgLaunch l;
  assert_true(cg_lower(f, 0, false, &l));   // the CPU: one call, no scratch
  assert_int_equal(l.ncalls, 1);
  assert_int_equal(l.call[0].kernel, kernel);
  assert_int_equal(l.scratch_bytes, 0);
  assert_true(cg_lower(f, 0, true, &l));    // CUDA: partial sums, then their sum
  assert_int_equal(l.ncalls, 2);
  assert_int_equal(l.call[0].kernel, part_kernel);
  assert_int_equal(l.call[0].grid, parts);
  assert_int_equal(l.call[0].args[0].kind, CG_ARG_OPERAND);
  assert_int_equal(l.call[0].args[1].kind, CG_ARG_OPERAND);
  assert_int_equal(l.call[0].args[2].kind, CG_ARG_SCRATCH);
  assert_int_equal(l.call[1].kernel, CG_K_SUM_PARTS);
  assert_int_equal(l.call[1].grid, 1);
  assert_int_equal(l.call[1].nargs, 5);
  assert_int_equal(l.call[1].args[0].kind, CG_ARG_SCRATCH);
  assert_int_equal(l.call[1].args[1].kind, CG_ARG_RESULT);
  assert_int_equal(l.call[1].args[2].i, parts);
  assert_int_equal(l.call[1].args[3].i, div);
  assert_int_equal(l.call[1].args[4].kind, CG_ARG_FLOAT);
  assert_int_equal(l.scratch_bytes, parts * (int64_t)sizeof(double));
}

static void test_cuda_splits_whole_tensor_losses(void **state) {
  (void)state;
  IrDiag d;
  ir_diag_init(&d, stderr);
  IrSource *src;
  IrModule *m = parse(&d, norm_module, &src);   // loss.mse over 32 elements: one block of parts
  assert_non_null(m);
  const IrFunc *f = m->funcs[m->nfuncs - 1];
  assert_int_equal(f->ops[0]->kind, IR_OP_LOSS_MSE);
  expect_split(f, CG_K_MSE, CG_K_MSE_PART, 1, 64);
  ir_module_free(m);
  ir_source_free(src);
  m = parse(&d, xent_module, &src);   // loss.xent over 1000 rows: 512 blocks of rows, the mean over 1000
  assert_non_null(m);
  assert_true(ir_verify(&d, m));
  f = m->funcs[0];
  assert_int_equal(f->ops[0]->kind, IR_OP_LOSS_XENT);
  expect_split(f, CG_K_XENT, CG_K_XENT_PART, 512, 1000);
  ir_module_free(m);
  ir_source_free(src);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_cuda_splits_whole_tensor_losses),
      cmocka_unit_test(test_every_rule_is_well_formed),
      cmocka_unit_test(test_scalar_functions_have_cpu_loops),
      cmocka_unit_test(test_malformed_rules_are_rejected),
      cmocka_unit_test(test_norm_rms_through_its_rules),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
