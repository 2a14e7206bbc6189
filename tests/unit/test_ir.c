// Unit tests of the IR: the op table and type helpers; builder -> print -> parse -> print gives
// the same text; parse errors give their exact messages and locations; the verifier catches
// arity, attribute, shape, dtype and undefined-value problems; and a hand-written full layer
// (gshard gate + tutel order + gpt ffn, forward, loss, backward with saves, optimizer) parses,
// verifies and round-trips byte for byte.
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "ir/ir.h"

// Diagnostics captured in memory.
typedef struct Capture {
  FILE *f;
  char *buf;
  size_t len;
  IrDiag d;
} Capture;

static void cap_open(Capture *c) {
  c->buf = NULL;
  c->len = 0;
  c->f = open_memstream(&c->buf, &c->len);
  assert_non_null(c->f);
  ir_diag_init(&c->d, c->f);
}

static const char *cap_text(Capture *c) {
  fflush(c->f);
  return c->buf ? c->buf : "";
}

static void cap_close(Capture *c) {
  fclose(c->f);
  free(c->buf);
}

// Fails the test with the text when `needle` is not in `hay`.
static void assert_contains(const char *hay, const char *needle) {
  if (!strstr(hay, needle)) {
    print_error("expected to find:\n%s\nin:\n%s\n", needle, hay);
    fail();
  }
}

typedef struct Parsed {
  IrSource *src;
  IrModule *m;
} Parsed;

static Parsed parse_text(IrDiag *d, const char *text) {
  Parsed p;
  p.src = ir_source_from_buffer("test.ir", text, strlen(text));
  assert_non_null(p.src);
  p.m = ir_parse(d, p.src);
  return p;
}

static void parsed_free(Parsed *p) {
  ir_module_free(p->m);
  ir_source_free(p->src);
}

// print(m), then parse that and print again: the two texts must be identical. Returns the first.
static char *assert_round_trip(const IrModule *m) {
  char *first = ir_print_to_string(m);
  assert_non_null(first);
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, first);
  if (!p.m) {
    print_error("the printed module does not parse:\n%s\n%s\n", cap_text(&c), first);
    fail();
  }
  char *second = ir_print_to_string(p.m);
  assert_string_equal(first, second);
  free(second);
  parsed_free(&p);
  cap_close(&c);
  return first;
}

// Parses text, which must verify and print back exactly as written (the module stays in p).
static Parsed parse_exact(Capture *c, const char *text) {
  Parsed p = parse_text(&c->d, text);
  assert_non_null(p.m);
  if (!ir_verify(&c->d, p.m)) print_error("%s", cap_text(c));
  assert_int_equal(c->d.errors, 0);
  char *out = assert_round_trip(p.m);
  assert_string_equal(out, text);
  free(out);
  return p;
}

// ---- the op table and types ----

static void test_op_table(void **state) {
  (void)state;
  assert_int_equal(ir_op_by_name("matmul"), IR_OP_MATMUL);
  assert_int_equal(ir_op_by_name("order.decode.grad_gates"), IR_OP_ORDER_DECODE_GRAD_G);
  assert_int_equal(ir_op_by_name("opt.adamw"), IR_OP_OPT_ADAMW);
  assert_int_equal(ir_op_by_name("matmull"), IR_OP_COUNT);
  assert_int_equal(ir_op_by_name(NULL), IR_OP_COUNT);
  for (int k = 0; k < IR_OP_COUNT; k++) {
    assert_non_null(ir_op_info[k].name);
    assert_int_equal(ir_op_by_name(ir_op_info[k].name), k);
    assert_true(ir_op_info[k].nargs >= 1 && ir_op_info[k].nargs <= IR_MAX_ARGS);
    assert_true(ir_op_info[k].nres == 0 || ir_op_info[k].nres == 1);
  }
  assert_int_equal(ir_op_info[IR_OP_GATE_LOCATIONS].nargs, 1);
  assert_string_equal(ir_op_info[IR_OP_GATE_LOCATIONS].attrs, "experts,groups,capacity");
  assert_int_equal(ir_op_info[IR_OP_PARAM_GRAD].nres, 0);
}

static void test_types(void **state) {
  (void)state;
  IrDtype t;
  assert_true(ir_dtype_by_name("bf16", &t));
  assert_int_equal(t, IR_BF16);
  assert_false(ir_dtype_by_name("f64", &t));
  assert_string_equal(ir_dtype_name(IR_I32), "i32");
  assert_int_equal(ir_dtype_size(IR_F32), 4);
  assert_int_equal(ir_dtype_size(IR_BF16), 2);
  assert_int_equal(ir_dtype_size(IR_I8), 1);
  IrType a = {.dtype = IR_F32, .rank = 2, .dim = {64, 32}};
  IrType b = ir_type2(IR_F32, 64, 32);
  assert_true(ir_type_equal(&a, &b));
  assert_int_equal(ir_type_numel(&a), 2048);
  assert_int_equal(ir_type_bytes(&a), 8192);
  b.dim[1] = 33;
  assert_false(ir_type_equal(&a, &b));
  IrType s = ir_type0(IR_F32);
  assert_int_equal(ir_type_numel(&s), 1);
  IrType big = ir_type3(IR_F32, INT64_MAX / 2, 4, 4);
  assert_int_equal(ir_type_numel(&big), INT64_MAX);  // saturates instead of overflowing
}

// ---- builder -> print -> parse -> print ----

static IrModule *build_small(void) {
  IrModule *m = ir_module_new("tiny");
  ir_attrs_set_int(m->attrs, &m->nattrs, "seqlen", 32);
  ir_attrs_set_int(m->attrs, &m->nattrs, "batch", 2);
  ir_attrs_set_str(m, m->attrs, &m->nattrs, "dtype", "fp32");
  ir_attrs_set_float(m->attrs, &m->nattrs, "lr", 0.01);
  IrParam *wg = ir_add_param(m, "block0.moe.gate.wg", ir_type2(IR_F32, 32, 4));
  ir_attrs_set_str(m, wg->attrs, &wg->nattrs, "init", "normal");
  ir_attrs_set_float(wg->attrs, &wg->nattrs, "std", 1.0 / sqrt(32.0));
  IrFunc *f = ir_add_func(m, "block0.fwd", ir_func_role_of_name("block0.fwd"));
  IrValue *x = ir_add_arg(f, m, "x", ir_type2(IR_F32, 64, 32));
  IrOp *op = ir_add_op(f, m, IR_OP_MATMUL, "logits", ir_type2(IR_F32, 64, 4));
  ir_op_arg(op, x);
  ir_op_param(op, wg);
  IrValue *logits = op->result;
  op = ir_add_op(f, m, IR_OP_GATE_SOFTMAX, "scores", ir_type2(IR_F32, 64, 4));
  ir_op_arg(op, logits);
  op->stream = IR_STREAM_INTER;
  op->phase = IR_PHASE_FWD;
  op->chunk = 1;
  op->waits[op->nwaits++] = 3;
  op->waits[op->nwaits++] = 4;
  op->event = 5;
  IrValue *scores = op->result;
  op = ir_add_op(f, m, IR_OP_GATE_TOPK, "idx", ir_type2(IR_I32, 64, 2));
  ir_op_arg(op, scores);
  ir_op_set_int(op, "k", 2);
  op->stream = IR_STREAM_COMPUTE;
  op = ir_add_op(f, m, IR_OP_GATE_Z_LOSS, "z", ir_type0(IR_F32));
  ir_op_arg(op, logits);
  ir_op_set_float(op, "coef", 1e-3);
  ir_op_set_int(op, "groups", 1);
  IrValue *z = op->result;
  ir_add_ret(f, m, scores);
  ir_add_ret(f, m, z);

  IrFunc *g = ir_add_func(m, "block0.bwd", ir_func_role_of_name("block0.bwd"));
  g->saves = f;
  IrValue *dl = ir_add_arg(g, m, "dlogits", ir_type2(IR_F32, 64, 4));
  op = ir_add_op(g, m, IR_OP_MATMUL, "dwg", ir_type2(IR_F32, 32, 4));
  ir_op_arg(op, x);  // a value of the saved function
  ir_op_arg(op, dl);
  ir_op_set_int(op, "ta", 1);
  IrValue *dwg = op->result;
  op = ir_add_op(g, m, IR_OP_PARAM_GRAD, NULL, ir_type0(IR_F32));
  ir_op_param(op, wg);
  ir_op_arg(op, dwg);

  IrFunc *o = ir_add_func(m, "optimizer", ir_func_role_of_name("optimizer"));
  op = ir_add_op(o, m, IR_OP_OPT_SGD, NULL, ir_type0(IR_F32));
  ir_op_param(op, wg);
  ir_op_set_float(op, "lr", 0.01);
  return m;
}

static const char small_text[] =
    "module tiny {batch=2, dtype=\"fp32\", lr=0.01, seqlen=32}\n"
    "\n"
    "param @block0.moe.gate.wg: f32[32, 4] {init=\"normal\", std=0.17677669529663687}\n"
    "\n"
    "func @block0.fwd(%x: f32[64, 32]) {\n"
    "  %logits: f32[64, 4] = matmul %x, @block0.moe.gate.wg\n"
    "  %scores: f32[64, 4] = gate.softmax %logits !{stream=inter, chunk=1, phase=fwd, wait=[3, 4], event=5}\n"
    "  %idx: i32[64, 2] = gate.topk %scores {k=2} !{stream=compute, chunk=0}\n"
    "  %z: f32[] = gate.z_loss %logits {coef=0.001, groups=1}\n"
    "  return %scores, %z\n"
    "}\n"
    "\n"
    "func @block0.bwd(%dlogits: f32[64, 4]) saves @block0.fwd {\n"
    "  %dwg: f32[32, 4] = matmul %x, %dlogits {ta=1}\n"
    "  param.grad @block0.moe.gate.wg, %dwg\n"
    "  return\n"
    "}\n"
    "\n"
    "func @optimizer() {\n"
    "  opt.sgd @block0.moe.gate.wg {lr=0.01}\n"
    "  return\n"
    "}\n";

// The failure policy: one line each for a failed allocation and an internal error, counted
// like any error, false returned; ir_type_str is what messages print types with.
static void test_failure_policy(void **state) {
  (void)state;
  Capture c;
  cap_open(&c);
  assert_false(ir_oom(&c.d));
  assert_false(ir_internal(&c.d, "pass '%s' left %d ops", "schedule", 3));
  assert_string_equal(cap_text(&c), "moec: error: out of memory\nmoec: error: internal error: pass 'schedule' left 3 ops\n");
  assert_int_equal(c.d.errors, 2);
  cap_close(&c);
  char s[64];
  IrType t = ir_type3(IR_BF16, 4, 8, 16);
  ir_type_str(&t, s, sizeof s);
  assert_string_equal(s, "bf16[4, 8, 16]");
  ir_type_str(&t, s, 6);
  assert_string_equal(s, "bf16[");
}

static void test_print_format(void **state) {
  (void)state;
  IrModule *m = build_small();
  char *text = assert_round_trip(m);
  assert_string_equal(text, small_text);
  Capture c;
  cap_open(&c);
  assert_true(ir_verify(&c.d, m));
  assert_string_equal(cap_text(&c), "");
  cap_close(&c);
  free(text);
  ir_module_free(m);
}

// Attribute values that are easy to get wrong: negative and extreme integers, floats that look
// like integers, tiny and huge floats, inf and nan, strings with quotes, backslashes, newlines.
static void test_attr_values_round_trip(void **state) {
  (void)state;
  IrModule *m = ir_module_new("attrs");
  IrAttr *a = m->attrs;
  int *n = &m->nattrs;
  ir_attrs_set_int(a, n, "neg", -7);
  ir_attrs_set_int(a, n, "min", INT64_MIN);
  ir_attrs_set_int(a, n, "max", INT64_MAX);
  ir_attrs_set_float(a, n, "one", 1.0);
  ir_attrs_set_float(a, n, "negzero", -0.0);
  ir_attrs_set_float(a, n, "third", 1.0 / 3.0);
  ir_attrs_set_float(a, n, "tiny", 4.9406564584124654e-324);
  ir_attrs_set_float(a, n, "huge", 1e300);
  ir_attrs_set_float(a, n, "inf", INFINITY);
  ir_attrs_set_float(a, n, "ninf", -INFINITY);
  ir_attrs_set_float(a, n, "nan", NAN);
  ir_attrs_set_str(m, a, n, "s", "a \"quoted\" \\ back\nslash\ttab\x01");
  char *text = assert_round_trip(m);
  assert_string_equal(text,
                      "module attrs {huge=1e+300, inf=inf, max=9223372036854775807, "
                      "min=-9223372036854775808, nan=nan, neg=-7, negzero=-0.0, ninf=-inf, one=1.0, "
                      "s=\"a \\\"quoted\\\" \\\\ back\\nslash\\ttab\\x01\", third=0.3333333333333333, "
                      "tiny=5e-324}\n");
  // The values read back exactly.
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, text);
  assert_non_null(p.m);
  assert_true(ir_mod_float(p.m, "third", 0) == 1.0 / 3.0);
  assert_true(ir_mod_float(p.m, "tiny", 0) == 4.9406564584124654e-324);
  assert_true(signbit(ir_mod_float(p.m, "negzero", 1)));
  assert_true(isnan(ir_mod_float(p.m, "nan", 0)));
  assert_int_equal(ir_mod_int(p.m, "min", 0), INT64_MIN);
  assert_int_equal(ir_attrs_get(p.m->attrs, p.m->nattrs, "one")->kind, IR_ATTR_FLOAT);
  assert_string_equal(ir_mod_str(p.m, "s", ""), "a \"quoted\" \\ back\nslash\ttab\x01");
  parsed_free(&p);
  cap_close(&c);
  free(text);
  ir_module_free(m);
}

// Names that are not plain identifiers print quoted and read back.
static void test_odd_names_round_trip(void **state) {
  (void)state;
  IrModule *m = ir_module_new("odd name");
  IrParam *p = ir_add_param(m, "w 1", ir_type1(IR_F32, 4));
  IrFunc *f = ir_add_func(m, "f\"x", ir_func_role_of_name("f\"x"));
  IrValue *x = ir_add_arg(f, m, "0-in", ir_type1(IR_F32, 4));
  IrOp *op = ir_add_op(f, m, IR_OP_BIAS, "a b", ir_type1(IR_F32, 4));
  op->args[op->nargs++] = (IrOperand){.value = x};
  op->args[op->nargs++] = (IrOperand){.param = p};
  ir_attrs_set_int(op->attrs, &op->nattrs, "odd key", 1);
  ir_add_ret(f, m, op->result);
  char *text = assert_round_trip(m);
  assert_contains(text, "module \"odd name\"\n");
  assert_contains(text, "param @\"w 1\": f32[4]\n");
  assert_contains(text, "func @\"f\\\"x\"(%0-in: f32[4]) {\n");
  assert_contains(text, "  %\"a b\": f32[4] = bias %0-in, @\"w 1\" {\"odd key\"=1}\n");
  free(text);
  ir_module_free(m);
}

// ---- parse errors ----

typedef struct ParseCase {
  const char *text;
  const char *message;  // a line of the diagnostics output
  int errors;           // how many errors the parse reports
} ParseCase;

#define HEAD "module t\nparam @w: f32[4, 4]\nfunc @f(%x: f32[8, 4]) {\n"

static const ParseCase parse_cases[] = {
    {HEAD "  %y f32[8, 4] = act.relu %x\n  return %y\n}\n",
     "test.ir:4:6: error: expected ':' after value name", 1},
    {HEAD "  %y: f32[8, 4] = matmull %x, @w\n  return %y\n}\n",
     "test.ir:4:19: error: unknown op 'matmull'; did you mean 'matmul'?", 1},
    {HEAD "  %y: f32[8, 4] = frobnicate %x\n}\n", "test.ir:4:19: error: unknown op 'frobnicate'\n", 1},
    {HEAD "  %y: f32[8, 4] = matmul %foo, @w\n  return %y\n}\n",
     "test.ir:4:26: error: use of undefined value '%foo'", 1},
    {HEAD "  %y: f32[8, 4] = matmul %x, @v\n  return %y\n}\n",
     "test.ir:4:30: error: unknown parameter '@v'; did you mean '@w'?", 1},
    {HEAD "  %y: f32[8, 4] = act.relu %x\n  %y: f32[8, 4] = act.relu %x\n  return %y\n}\n",
     "test.ir:5:3: error: value '%y' defined twice", 1},
    {HEAD "  %x: f32[8, 4] = act.relu %x\n  return\n}\n", "test.ir:4:3: error: value '%x' defined twice", 1},
    {HEAD "  %y: f32[1, 2, 3, 4, 5] = act.relu %x\n  return %y\n}\n",
     "test.ir:4:23: error: tensor rank exceeds 4", 1},
    {HEAD "  %y: f32[8, 4] = add %x, %x, %x, %x, %x, %x, %x\n  return %y\n}\n",
     "test.ir:4:47: error: too many operands for 'add' (at most 6)", 1},
    {HEAD "  %y: i32[8, 2] = gate.topk %x {a=1, b=2, c=3, d=4, e=5, f=6, g=7, h=8, i=9, j=10, k=11, l=12, m=13, "
         "n=14, o=15, p=16, q=17, r=18, s=19, t=20, u=21, v=22, w=23, x=24, y=25, z=26, aa=27, ab=28, ac=29, "
         "ad=30, ae=31, af=32, ag=33}\n}\n",
     "error: too many attributes (at most 32)", 1},
    {HEAD "  %y: i32[8, 2] = gate.topk %x {k=2, k=3}\n  return %y\n}\n", "error: attribute 'k' given twice", 1},
    {HEAD "  %y: i32[8, 2] = gate.topk %x {k=two}\n  return %y\n}\n",
     "error: expected a number or a string for attribute 'k', found 'two'; quote strings", 1},
    {"module t {name=\"abc}\n", "test.ir:1:16: error: unterminated string", 1},
    {"module t {name=\"a\\qb\"}\n", "test.ir:1:18: error: unknown escape in string", 1},
    {"func @f() {\n  return\n}\n", "test.ir:1:1: error: expected 'module NAME' at the start of the IR, found 'func'", 1},
    {"", "test.ir:1:1: error: expected 'module NAME' at the start of the IR, found end of file", 1},
    {HEAD "  %y: f32[8, 4] = act.relu %x\n", "test.ir:4:30: error: expected '}' to close @f", 1},
    {HEAD "  return %x\n  %y: f32[8, 4] = act.relu %x\n}\n", "test.ir:5:3: error: 'return' must be the last statement of @f", 1},
    {HEAD "  %y: f32[8, 4] = act.relu %x !{stream=gpu}\n  return %y\n}\n",
     "error: unknown stream 'gpu'; expected compute, intra or inter", 1},
    {HEAD "  %y: f32[8, 4] = act.relu %x !{chunk=1}\n  return %y\n}\n",
     "test.ir:4:31: error: scheduling annotation without a 'stream'", 1},
    {HEAD "  %y: f32[8, 4] = act.relu %x !{stream=intra, wait=[1, 2, 3, 4, 5, 6, 7, 8, 9]}\n  return %y\n}\n",
     "error: too many waits (at most 8)", 1},
    {"module t {big=99999999999999999999}\n", "test.ir:1:15: error: integer '99999999999999999999' does not fit in 64 bits", 1},
    {"module t {big=1e999}\n", "test.ir:1:15: error: number '1e999' is out of range", 1},
    {"module t {n=12ab}\n", "test.ir:1:13: error: malformed number '12ab'", 1},
    {"module t\nparam @w: f64[4]\n", "test.ir:2:11: error: unknown dtype 'f64'; expected f32, bf16, f16, i32 or i8", 1},
    {"module t\nparam @w: f32[-4]\n", "test.ir:2:15: error: expected a dimension (a non-negative integer)", 1},
    {"module t\nparam @w: f32[4]\nparam @w: f32[4]\n", "test.ir:3:7: error: parameter '@w' defined twice", 1},
    {"module t\nparam @w: f32[4611686018427387904, 4]\n", "test.ir:2:11: error: tensor type is too large", 1},
    {"module t\nfunc @b(%d: f32[4]) saves @a {\n  return\n}\n",
     "test.ir:2:27: error: unknown function '@a' (a saved function must come before)", 1},
    {"module t\nfunc @a(%x: f32[4]) {\n  return\n}\nfunc @b(%x: f32[4]) saves @a {\n  return\n}\n",
     "test.ir:5:9: error: value '%x' is already defined in @a, which @b saves", 1},
    {"module t\nfunc @a(%x: f32[4], %x: f32[4]) {\n  return\n}\n", "test.ir:2:21: error: value '%x' defined twice", 1},
    {"module t\nfunc @a() {\n  return\n}\nfunc @a() {\n  return\n}\n", "test.ir:5:6: error: function '@a' defined twice", 1},
    {HEAD "  %y: f32[8, 4] = act.relu %x %x\n  return %y\n}\n",
     "test.ir:4:31: error: expected end of line after the op, found '%x'", 1},
    {HEAD "  %y: f32[8, 4] = add %x,\n  return %y\n}\n",
     "test.ir:4:26: error: expected an operand (%value or @param) after ','", 1},
    {"module t\n$\n", "test.ir:2:1: error: unexpected character '$'", 1},
    {"module t\nparam @w: f32[4] {a=1}} \n", "test.ir:2:23: error: expected end of line after the parameter, found '}'", 1},
    // Fused groups (ir.h's IrGroup): the header's reads and writes are the members', the kind fits them.
    {HEAD "  fused 0 elementwise reads (%x, @w) writes (%z) {\n    %y: f32[8, 4] = act.relu %x {inner=1}\n"
          "    %z: f32[8, 4] = add %y, %x\n  }\n  return %z\n}\n",
     "test.ir:4:3: error: fused group 0 reads %x from outside it (its members' operands), not %x, @w as written", 1},
    {HEAD "  fused 0 elementwise reads (%x) writes (%y, %z) {\n    %y: f32[8, 4] = act.relu %x {inner=1}\n"
          "    %z: f32[8, 4] = add %y, %x\n  }\n  return %z\n}\n",
     "test.ir:4:3: error: fused group 0 writes %z (its members' results without inner=1), not %y, %z as written", 1},
    {HEAD "  fused 0 elementwize reads (%x) writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n  }\n  return %z\n}\n",
     "test.ir:4:11: error: expected the group's kind (elementwise, rows, store, colsums, gate, update) after its number; "
     "did you mean 'elementwise'?", 1},
    {HEAD "  fused 0 gate reads (%x) writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n  }\n  return %z\n}\n",
     "test.ir:4:3: error: fused group 0 (gate): a gate group is 3 ops (softmax or sigmoid, topk, gather), not 1", 1},
    {HEAD "  fused 0 elementwise reads (%x) writes (%z) {\n    %z: f32[8, 4] = matmul %x, @w\n  }\n  return %z\n}\n",
     "test.ir:4:3: error: fused group 0 (elementwise): 'matmul' is not elementwise (ir/scalar.def)", 1},
    {HEAD "  fused 0 elementwise in_gemm reads (%x) writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n  }\n  return %z\n}\n",
     "test.ir:4:3: error: fused group 0 (elementwise): an in_gemm group follows a matmul or expert_matmul", 1},
    {HEAD "  fused 0 elementwise reads (%x) writes (%z) {\n    fused 1 elementwise reads (%x) writes (%z) {\n"
          "    %z: f32[8, 4] = act.relu %x\n  }\n  return %z\n}\n",
     "test.ir:5:5: error: fused groups do not nest: close group 0 with '}' first", 1},
    {HEAD "  fused 0 elementwise reads () writes () {\n  }\n  return\n}\n", "test.ir:4:3: error: fused group 0 holds no op", 1},
    {HEAD "  fused 0 elementwise reads (%x) writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n    return %z\n  }\n}\n",
     "test.ir:6:5: error: 'return' cannot be inside fused group 0", 1},
    {HEAD "  fused 0 elementwise reads (%x) writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n",
     "test.ir:5:32: error: expected '}' to close fused group 0", 2},   // and @f
    {HEAD "  fused 0 elementwise reads %x writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n  }\n  return %z\n}\n",
     "test.ir:4:29: error: expected '(' after 'reads'", 1},
    {HEAD "  fused -1 elementwise reads (%x) writes (%z) {\n    %z: f32[8, 4] = act.relu %x\n  }\n  return %z\n}\n",
     "test.ir:4:9: error: expected the group's number (0 or more) after 'fused'", 1},
    // An update group: updates of parameters that join the first (ir_update_joins).
    {"module t\nparam @w: f32[4, 4]\nparam @v: f32[4]\nfunc @f() {\n  fused 0 update reads (@w, @v) writes () {\n"
     "    opt.adamw @w {beta1=0.9, beta2=0.999, eps=1e-08, lr=0.003}\n"
     "    opt.adamw @v {beta1=0.8, beta2=0.999, eps=1e-08, lr=0.003}\n  }\n  return\n}\n",
     "test.ir:5:3: error: fused group 0 (update): the updates differ in beta1, beta2 or eps", 1},
    {"module t\nparam @w: f32[4, 4]\nparam @v: f32[4]\nfunc @f() {\n  fused 0 update reads (@w, @v) writes () {\n"
     "    opt.adamw @w {beta1=0.9, beta2=0.999, eps=1e-08, lr=0.003}\n    opt.sgd @v {lr=0.003}\n  }\n  return\n}\n",
     "test.ir:5:3: error: fused group 0 (update): 'opt.sgd' is not an update of a parameter of the group's kind", 1},
    // Errors on several lines are all reported; uses of a value whose definition failed stay quiet.
    {HEAD "  %y: f32[8, 4] = act.relu %nope\n  %z: f32[8, 4] = act.relu %y\n  %w: f32[8, 4] = actt.relu %z\n  return %w\n}\n",
     "test.ir:6:19: error: unknown op 'actt.relu'; did you mean 'act.relu'?", 2},
};

static void test_parse_errors(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof parse_cases / sizeof parse_cases[0]; i++) {
    const ParseCase *pc = &parse_cases[i];
    Capture c;
    cap_open(&c);
    Parsed p = parse_text(&c.d, pc->text);
    const char *out = cap_text(&c);
    if (p.m || !strstr(out, pc->message) || c.d.errors != pc->errors) {
      print_error("case %zu:\n%s\nexpected %d error(s) with:\n%s\ngot %d:\n%s\n", i, pc->text, pc->errors,
                  pc->message, c.d.errors, out);
      fail();
    }
    parsed_free(&p);
    cap_close(&c);
  }
}

// Fused groups read back as they print: members, kinds, in_gemm; a verifier that finds two
// groups with one number says so at the second.
static void test_fused_groups_round_trip(void **state) {
  (void)state;
  const char *text = "module t\n\nparam @w: f32[4, 4]\nparam @b: f32[4]\n\n"
                     "func @f(%x: f32[8, 4]) {\n"
                     "  %h: f32[8, 4] = matmul %x, @w\n"
                     "  fused 3 elementwise in_gemm reads (%h, @b) writes (%a) {\n"
                     "    %hb: f32[8, 4] = bias %h, @b {inner=1}\n"
                     "    %a: f32[8, 4] = act.gelu %hb\n"
                     "  }\n"
                     "  %s: f32[8, 4] = gate.softmax %a\n"
                     "  fused 7 gate reads (%s) writes (%s2, %i, %g) {\n"
                     "    %s2: f32[8, 4] = gate.softmax %a\n"
                     "    %i: i32[8, 2] = gate.topk %s2 {k=2}\n"
                     "    %g: f32[8, 2] = gate.gather %s2, %i {renorm=1}\n"
                     "  }\n"
                     "  return %g\n"
                     "}\n";
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, text);
  assert_null(p.m);   // the gate group reads %a, not %s
  assert_contains(cap_text(&c), "fused group 7 reads %a from outside it (its members' operands), not %s as written");
  cap_close(&c);
  parsed_free(&p);

  char fixed[2048];
  snprintf(fixed, sizeof fixed, "%s", text);
  char *at = strstr(fixed, "reads (%s)");
  memcpy(at, "reads (%a)", 10);
  cap_open(&c);
  p = parse_text(&c.d, fixed);
  assert_non_null(p.m);
  if (!ir_verify(&c.d, p.m)) print_error("%s", cap_text(&c));
  assert_string_equal(cap_text(&c), "");
  const IrFunc *f = p.m->funcs[0];
  assert_int_equal(f->ngroups, 2);
  assert_int_equal(f->groups[0].id, 3);
  assert_int_equal(f->groups[0].kind, IR_GROUP_ELEMENTWISE);
  assert_true(f->groups[0].in_gemm);
  assert_int_equal(f->groups[0].first, 1);
  assert_int_equal(f->groups[0].n, 2);
  assert_int_equal(f->groups[1].kind, IR_GROUP_GATE);
  assert_ptr_equal(ir_group_at(f, 5), &f->groups[1]);
  assert_null(ir_group_at(f, 3));
  char *printed = ir_print_to_string(p.m);
  assert_string_equal(printed, fixed);
  free(printed);
  // Two groups numbered alike: the verifier says so.
  f->groups[1].id = 3;
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c), "fused group 3 is numbered twice in the module");
  // Removing a member shrinks its group; removing the last one removes the group.
  f->groups[1].id = 7;
  ir_remove_op(p.m->funcs[0], f->ops[3]);   // %s, before the gate group: it moves up
  assert_int_equal(f->groups[1].first, 3);
  cap_close(&c);
  parsed_free(&p);
}

// A function with an op on the intra or inter stream runs concurrently, unless MOEC_STREAMS=0.
static void test_func_concurrent(void **state) {
  (void)state;
  const char *head = HEAD "  %y: f32[8, 4] = act.relu %x !{stream=compute}\n  %z: f32[8, 4] = act.relu %y !{stream=";
  const char *streams[] = {"compute", "intra", "inter"};
  for (int i = 0; i < 3; i++) {
    char buf[512];
    snprintf(buf, sizeof buf, "%s%s}\n  return %%z\n}\n", head, streams[i]);
    Capture c;
    cap_open(&c);
    Parsed p = parse_text(&c.d, buf);
    if (!p.m) print_error("%s", cap_text(&c));
    assert_non_null(p.m);
    unsetenv("MOEC_STREAMS");
    assert_int_equal(ir_func_concurrent(p.m->funcs[0]), i > 0);
    setenv("MOEC_STREAMS", "0", 1);
    assert_false(ir_func_concurrent(p.m->funcs[0]));
    unsetenv("MOEC_STREAMS");
    cap_close(&c);
    parsed_free(&p);
  }
}

// The whole diagnostic: location, message, the source line and the caret under the op name.
static void test_parse_error_snippet(void **state) {
  (void)state;
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, HEAD "  %y: f32[8, 4] = matmull %x, @w\n  return %y\n}\n");
  assert_null(p.m);
  assert_string_equal(cap_text(&c),
                      "test.ir:4:19: error: unknown op 'matmull'; did you mean 'matmul'?\n"
                      "    4 |   %y: f32[8, 4] = matmull %x, @w\n"
                      "      |                   ^~~~~~~\n");
  parsed_free(&p);
  cap_close(&c);
}

// Comments, blank lines and free spacing within a line are accepted; the print is canonical.
static void test_parse_comments_and_spacing(void **state) {
  (void)state;
  const char *text =
      "# a comment\n"
      "module   t{b = 2 ,a=1}   # trailing\n"
      "\n"
      "param @w:f32[4,4]\n"
      "func @f( %x : f32[ 8 , 4 ] ){\n"
      "   # inside\n"
      "  %y:f32[8,4]=matmul %x,@w{tb=1}!{ event = 2 , stream = intra }\n"
      "  return %y,%x\n"
      "}\n";
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, text);
  assert_non_null(p.m);
  assert_true(ir_verify(&c.d, p.m));
  char *out = assert_round_trip(p.m);
  assert_string_equal(out,
                      "module t {a=1, b=2}\n"
                      "\n"
                      "param @w: f32[4, 4]\n"
                      "\n"
                      "func @f(%x: f32[8, 4]) {\n"
                      "  %y: f32[8, 4] = matmul %x, @w {tb=1} !{stream=intra, chunk=0, event=2}\n"
                      "  return %y, %x\n"
                      "}\n");
  assert_int_equal(p.m->funcs[0]->ops[0]->loc.line, 7);
  assert_int_equal(p.m->funcs[0]->ops[0]->loc.col, 15);
  free(out);
  parsed_free(&p);
  cap_close(&c);
}

// Inputs that once looked risky: they must give diagnostics, not crashes.
static void test_parse_garbage(void **state) {
  (void)state;
  static const char nul_text[] = "module t\nparam @w: f32[4] {s=\"a\0b\"}\n";
  const char *texts[] = {
      "module", "module t {", "module t {a", "module t {a=", "module t {a=1,", "module t\nfunc",
      "module t\nfunc @f(", "module t\nfunc @f(%x", "module t\nfunc @f(%x:", "module t\nfunc @f(%x: f32[",
      "module t\nfunc @f(%x: f32[4]", "module t\nfunc @f(%x: f32[4]) saves", "module t\nfunc @f() {",
      "module t\nfunc @f() {\n  %", "module t\nfunc @f() {\n  %\"", "module t\nfunc @f() {\n  @",
      "module t\nfunc @f() {\n  return %", "module t\nfunc @f() {\n  %a: f32[] = act.relu !{",
      "module t\nfunc @f() {\n  %a: f32[] = act.relu !{wait=[", "module t {s=\"\\x0\"}", "module t {s=\"\\x00\"}",
      "module t {n=-}", "module t {n=-inf}", "module t {n=inf, m=nan}", "module \"\"", "}}}}", "\xff\xfe",
      "module t\n}\nparam @w: f32[1]\nfunc @f() {\n}\n",
  };
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    Capture c;
    cap_open(&c);
    Parsed p = parse_text(&c.d, texts[i]);
    if (p.m) {
      char *s = assert_round_trip(p.m);
      free(s);
    } else {
      assert_true(c.d.errors > 0);
    }
    parsed_free(&p);
    cap_close(&c);
  }
  Capture c;
  cap_open(&c);
  IrSource *src = ir_source_from_buffer("test.ir", nul_text, sizeof nul_text - 1);
  assert_null(ir_parse(&c.d, src));
  assert_contains(cap_text(&c), "string contains a NUL byte");
  ir_source_free(src);
  cap_close(&c);
}

// ---- verifier ----

typedef struct VerifyCase {
  const char *name;
  void (*build)(IrModule *m, IrFunc *f, IrValue *x, IrParam *w);
  const char *message;
} VerifyCase;

static IrOp *op_v(IrFunc *f, IrModule *m, IrOpKind k, const char *name, IrType t, IrValue *a) {
  IrOp *op = ir_add_op(f, m, k, name, t);
  if (a) ir_op_arg(op, a);
  return op;
}

static void v_arity(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  op_v(f, m, IR_OP_MATMUL, "y", ir_type2(IR_F32, 64, 4), x);
}
static void v_missing_attr(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *op = op_v(f, m, IR_OP_MATMUL, "l", ir_type2(IR_F32, 64, 4), x);
  ir_op_param(op, w);
  op_v(f, m, IR_OP_GATE_TOPK, "idx", ir_type2(IR_I32, 64, 2), op->result);
}
static void v_inner_dims(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrParam *w2 = ir_add_param(m, "w2", ir_type2(IR_F32, 16, 4));
  IrOp *op = op_v(f, m, IR_OP_MATMUL, "y", ir_type2(IR_F32, 64, 4), x);
  ir_op_param(op, w2);
}
static void v_result_type(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *op = op_v(f, m, IR_OP_MATMUL, "y", ir_type2(IR_F32, 64, 5), x);
  ir_op_param(op, w);
}
static void v_other_func(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrFunc *g = ir_add_func(m, "g", ir_func_role_of_name("g"));
  op_v(g, m, IR_OP_ACT_RELU, "y", ir_type2(IR_F32, 64, 32), x);
}
static void v_param_grad(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *op = ir_add_op(f, m, IR_OP_PARAM_GRAD, NULL, ir_type0(IR_F32));
  ir_op_param(op, w);
  ir_op_arg(op, x);
}
static void v_dtype(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *l = op_v(f, m, IR_OP_MATMUL, "l", ir_type2(IR_F32, 64, 4), x);
  ir_op_param(l, w);
  IrOp *op = op_v(f, m, IR_OP_GATE_GATHER, "g", ir_type2(IR_F32, 64, 4), l->result);
  ir_op_arg(op, l->result);
  ir_op_set_int(op, "renorm", 1);
}
static void v_groups(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *l = op_v(f, m, IR_OP_MATMUL, "l", ir_type2(IR_F32, 64, 4), x);
  ir_op_param(l, w);
  IrOp *t = op_v(f, m, IR_OP_GATE_TOPK, "idx", ir_type2(IR_I32, 64, 2), l->result);
  ir_op_set_int(t, "k", 2);
  IrOp *op = op_v(f, m, IR_OP_GATE_LOCATIONS, "loc", ir_type2(IR_I32, 64, 2), t->result);
  ir_op_set_int(op, "experts", 4);
  ir_op_set_int(op, "groups", 3);
  ir_op_set_int(op, "capacity", 8);
}
static void v_topk_k(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *l = op_v(f, m, IR_OP_MATMUL, "l", ir_type2(IR_F32, 64, 4), x);
  ir_op_param(l, w);
  IrOp *t = op_v(f, m, IR_OP_GATE_TOPK, "idx", ir_type2(IR_I32, 64, 5), l->result);
  ir_op_set_int(t, "k", 5);
}
static void v_encode_slots(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *l = op_v(f, m, IR_OP_MATMUL, "l", ir_type2(IR_F32, 64, 4), x);
  ir_op_param(l, w);
  IrOp *t = op_v(f, m, IR_OP_GATE_TOPK, "idx", ir_type2(IR_I32, 64, 2), l->result);
  ir_op_set_int(t, "k", 2);
  IrValue *y = ir_add_arg(f, m, "y", ir_type3(IR_F32, 4, 16, 32));
  IrOp *op = op_v(f, m, IR_OP_ORDER_DECODE, "out", ir_type2(IR_F32, 64, 32), y);
  ir_op_arg(op, t->result);
  ir_op_arg(op, t->result);
  ir_op_arg(op, l->result);
  ir_op_set_int(op, "experts", 4);
  ir_op_set_int(op, "groups", 2);
  ir_op_set_int(op, "capacity", 16);
}
static void v_use_before_def(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *a = op_v(f, m, IR_OP_ACT_RELU, "a", ir_type2(IR_F32, 64, 32), NULL);
  IrOp *b = op_v(f, m, IR_OP_ACT_RELU, "b", ir_type2(IR_F32, 64, 32), x);
  ir_op_arg(a, b->result);
}
static void v_dup_name(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  op_v(f, m, IR_OP_ACT_RELU, "x", ir_type2(IR_F32, 64, 32), x);
}
static void v_result_count(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrOp *op = ir_add_op(f, m, IR_OP_OPT_SGD, "u", ir_type0(IR_F32));
  ir_op_param(op, w);
  ir_op_set_float(op, "lr", 0.1);
}
static void v_bad_ret(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrFunc *g = ir_add_func(m, "g", ir_func_role_of_name("g"));
  ir_add_ret(g, m, x);
}
static void v_saves_later(IrModule *m, IrFunc *f, IrValue *x, IrParam *w) {
  IrFunc *g = ir_add_func(m, "g", ir_func_role_of_name("g"));
  f->saves = g;
}

static const VerifyCase verify_cases[] = {
    {"arity", v_arity, "moec: error: in @f: op 0 (matmul): takes 2 operands, got 1\n"},
    {"missing attribute", v_missing_attr, "moec: error: in @f: op 1 (gate.topk): missing attribute 'k'\n"},
    {"inner dims", v_inner_dims,
     "moec: error: in @f: op 0 (matmul): inner dimensions differ: %x (f32[64, 32]) has k = 32 but "
     "@w2 (f32[16, 4]) has k = 16\n"},
    {"result type", v_result_type,
     "moec: error: in @f: op 0 (matmul): result '%y' is declared f32[64, 5] but its operands give f32[64, 4]\n"},
    {"other function", v_other_func,
     "moec: error: in @g: op 0 (act.relu): operand '%x' belongs to @f, which @g cannot read (it saves no function)\n"},
    {"param.grad type", v_param_grad,
     "moec: error: in @f: op 0 (param.grad): the gradient %x (f32[64, 32]) does not have the type of "
     "@w (f32[32, 4])\n"},
    {"dtype", v_dtype, "moec: error: in @f: op 1 (gate.gather): %l (f32[64, 4]) must be i32 ([S, K])\n"},
    {"groups", v_groups,
     "moec: error: in @f: op 2 (gate.locations): 64 tokens do not split into groups=3 equal routing groups\n"},
    {"topk k", v_topk_k, "moec: error: in @f: op 1 (gate.topk): k = 5 exceeds the E = 4 experts of %l (f32[64, 4])\n"},
    {"decode slots", v_encode_slots,
     "moec: error: in @f: op 2 (order.decode): %y (f32[4, 16, 32]) has C = 16 but groups*capacity = 32\n"},
    {"use before def", v_use_before_def,
     "moec: error: in @f: op 0 (act.relu): operand '%b' is used before it is defined\n"},
    {"duplicate name", v_dup_name, "moec: error: in @f: value '%x' defined twice\n"},
    {"result count", v_result_count, "moec: error: in @f: op 0 (opt.sgd): has no result, but one is named '%u'\n"},
    {"return", v_bad_ret, "moec: error: in @g: return value '%x' is not defined in @g\n"},
    {"saves order", v_saves_later, "moec: error: in @f: @f saves @g, which comes after it\n"},
};

static void test_verify_errors(void **state) {
  (void)state;
  for (size_t i = 0; i < sizeof verify_cases / sizeof verify_cases[0]; i++) {
    IrModule *m = ir_module_new("t");
    IrParam *w = ir_add_param(m, "w", ir_type2(IR_F32, 32, 4));
    IrFunc *f = ir_add_func(m, "f", ir_func_role_of_name("f"));
    IrValue *x = ir_add_arg(f, m, "x", ir_type2(IR_F32, 64, 32));
    verify_cases[i].build(m, f, x, w);
    Capture c;
    cap_open(&c);
    bool ok = ir_verify(&c.d, m);
    if (ok || strcmp(cap_text(&c), verify_cases[i].message) != 0) {
      print_error("verify case '%s': expected\n%sgot\n%s\n", verify_cases[i].name, verify_cases[i].message,
                  cap_text(&c));
      fail();
    }
    cap_close(&c);
    ir_module_free(m);
  }
}

// The verifier reports every problem, at the op's location when it was parsed.
static void test_verify_located_and_all(void **state) {
  (void)state;
  const char *text = HEAD
      "  %a: f32[8, 5] = matmul %x, @w\n"
      "  %b: i32[8, 2] = gate.topk %a\n"
      "  %c: f32[8, 4] = add %x, %x, %x\n"
      "  %d: f32[] = loss.mse %x, %x\n"
      "  return %d\n"
      "}\n";
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, text);
  assert_non_null(p.m);
  assert_false(ir_verify(&c.d, p.m));
  const char *out = cap_text(&c);
  assert_contains(out, "test.ir:4:19: error: matmul: result '%a' is declared f32[8, 5] but its operands give f32[8, 4]\n"
                       "    4 |   %a: f32[8, 5] = matmul %x, @w\n"
                       "      |                   ^~~~~~\n");
  assert_contains(out, "test.ir:5:19: error: gate.topk: missing attribute 'k'\n");
  assert_contains(out, "test.ir:6:19: error: add: takes 2 operands, got 3\n");
  assert_int_equal(c.d.errors, 3);
  parsed_free(&p);
  cap_close(&c);
}

// The ops the full layer below does not use, bf16 tensors, and both transposes at once.
static void test_shapes_dense(void **state) {
  (void)state;
  const char *text =
      "module t\n"
      "\n"
      "param @w: bf16[16, 8]\n"
      "param @b: bf16[16]\n"
      "\n"
      "func @f(%x: bf16[8, 4]) {\n"
      "  %h: bf16[4, 16] = matmul %x, @w {ta=1, tb=1}\n"
      "  %hb: bf16[4, 16] = bias %h, @b\n"
      "  %r: bf16[4, 16] = act.relu %hb\n"
      "  %dr: bf16[4, 16] = act.relu.grad %r, %hb\n"
      "  %db: bf16[16] = bias.grad %dr\n"
      "  param.grad @b, %db\n"
      "  return %r\n"
      "}\n";
  Capture c;
  cap_open(&c);
  Parsed p = parse_exact(&c, text);
  // Break things one at a time.
  p.m->params[1]->type.dim[0] = 5;
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c), "test.ir:8:22: error: bias: n differs: %h (bf16[4, 16]) has n = 16 but @b (bf16[5]) has n = 5\n");
  p.m->params[1]->type.dim[0] = 16;
  p.m->params[1]->type.dtype = IR_F32;
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c), "bias: dtypes differ: %h (bf16[4, 16]) and @b (f32[16])\n");
  parsed_free(&p);
  cap_close(&c);
}

// The other gates (sigmoid, expert choice), the gshard order, the mixtral, oss and xmoe helpers, hooks.
static void test_shapes_more_ops(void **state) {
  (void)state;
  const char *text =
      "module t\n"
      "\n"
      "param @wg: f32[8, 4]\n"
      "\n"
      "func @f(%x: f32[16, 8], %s: f32[]) {\n"
      "  %l: f32[16, 4] = matmul %x, @wg\n"
      "  %sg: f32[16, 4] = gate.sigmoid %l\n"
      "  %dsg: f32[16, 4] = gate.sigmoid.grad %sg, %sg\n"
      "  %st: f32[16, 4] = gate.softmax_tokens %l {groups=2}\n"
      "  %dst: f32[16, 4] = gate.softmax_tokens.grad %st, %st {groups=2}\n"
      "  %ec: i32[16, 4] = gate.expert_choice %st {capacity=4, experts=4, groups=2}\n"
      "  %io: i32[16, 4] = gate.iota %st\n"
      "  %dm: f32[16, 32] = order.dispatch_mask %io, %ec {capacity=4, experts=4, groups=2}\n"
      "  %cw: f32[16, 32] = order.combine_weights %io, %ec, %st {capacity=4, experts=4, groups=2}\n"
      "  %dg: f32[16, 4] = order.combine_weights.grad %cw, %io, %ec {capacity=4, experts=4, groups=2}\n"
      "  %xs: f32[16, 8] = act.silu %x\n"
      "  %dxs: f32[16, 8] = act.silu.grad %xs, %x\n"
      "  %mu: f32[16, 8] = mul %xs, %x\n"
      "  %r: f32[4, 4, 8] = reshape %mu {d0=4, d1=4, d2=8, rank=3}\n"
      "  %n: f32[16, 8] = l2norm %x\n"
      "  %dn: f32[16, 8] = l2norm.grad %n, %x\n"
      "  %xo: f32[16, 8] = act.oss %x, %xs\n"
      "  %dxo: f32[16, 8] = act.oss.grad_gate %n, %x, %xs\n"
      "  %dxu: f32[16, 8] = act.oss.grad_up %n, %x, %xs\n"
      "  %dv: f32[16, 8] = div_scalar %x, %s\n"
      "  %dvx: f32[16, 8] = div_scalar.grad_x %dv, %s\n"
      "  %dvs: f32[] = div_scalar.grad_s %dv, %x, %s\n"
      "  %c: bf16[4, 4, 8] = hook.compress %r {format=\"bf16\"}\n"
      "  %dc: f32[4, 4, 8] = hook.decompress %c\n"
      "  %sc: f32[16] = hook.scales %dc\n"
      "  %q: i8[4, 4, 8] = hook.compress_int8 %dc, %sc\n"
      "  %dq: f32[4, 4, 8] = hook.decompress_int8 %q, %sc\n"
      "  hook.record %dq {layer=0, point=\"after_dispatch\"}\n"
      "  return %dq, %dvs\n"
      "}\n";
  Capture c;
  cap_open(&c);
  Parsed p = parse_exact(&c, text);
  IrOp *reshape = p.m->funcs[0]->ops[13];
  assert_int_equal(reshape->kind, IR_OP_RESHAPE);
  ir_op_set_int(reshape, "d2", 9);
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c), "reshape: cannot reshape %mu (f32[16, 8]) to f32[4, 4, 9]: 128 elements vs 144\n");
  parsed_free(&p);
  cap_close(&c);
}

// layout.chunk with a chunk count that does not divide the rows per block: rows 5 (blocks 3) in
// 3 chunks of 1, 2 and 2 rows per block, assembled back by layout.concat.
static void test_shapes_chunk_uneven(void **state) {
  (void)state;
  const char *text =
      "module t\n"
      "\n"
      "func @f(%x: f32[2, 15, 4]) {\n"
      "  %c0: f32[2, 3, 4] = layout.chunk %x {blocks=3, chunks=3, index=0}\n"
      "  %c1: f32[2, 6, 4] = layout.chunk %x {blocks=3, chunks=3, index=1}\n"
      "  %c2: f32[2, 6, 4] = layout.chunk %x {blocks=3, chunks=3, index=2}\n"
      "  %a: f32[2, 9, 4] = layout.concat %c0, %c1 {blocks=3}\n"
      "  %y: f32[2, 15, 4] = layout.concat %a, %c2 {blocks=3}\n"
      "  return %y\n"
      "}\n";
  Capture c;
  cap_open(&c);
  Parsed p = parse_exact(&c, text);
  IrOp *c0 = p.m->funcs[0]->ops[0];
  assert_int_equal(c0->kind, IR_OP_LAYOUT_CHUNK);
  ir_op_set_int(c0, "chunks", 6);
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c), "layout.chunk: chunks = 6 is above the 5 rows per block of %x (f32[2, 15, 4])\n");
  ir_op_set_int(c0, "chunks", 3);
  ir_op_set_int(c0, "blocks", 2);
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c), "layout.chunk: dimension 1 of %x (f32[2, 15, 4]) (15) is not a multiple of blocks = 2\n");
  parsed_free(&p);
  cap_close(&c);
}

// ---- a full layer: gshard gate, tutel order, gpt ffn; forward, loss, backward, optimizer ----
// S = 64 tokens (batch 2 x seqlen 32), M = 32, E = 4 experts, H = 64, k = 2, capacity 32.

static const char layer_text[] =
    "module tiny {batch=2, embed=32, lr=0.01, optimizer=\"sgd\", seed=42, seqlen=32, weight_decay=0.0}\n"
    "\n"
    "param @block0.moe.gate.wg: f32[32, 4] {init=\"normal\", std=0.17677669529663687}\n"
    "param @block0.moe.experts.w1: f32[4, 32, 64] {init=\"normal\", std=0.17677669529663687}\n"
    "param @block0.moe.experts.b1: f32[4, 64] {init=\"zeros\"}\n"
    "param @block0.moe.experts.w2: f32[4, 64, 32] {init=\"normal\", std=0.125}\n"
    "param @block0.moe.experts.b2: f32[4, 32] {init=\"zeros\"}\n"
    "\n"
    "func @block0.fwd(%x: f32[64, 32]) {\n"
    "  %logits: f32[64, 4] = matmul %x, @block0.moe.gate.wg\n"
    "  %noisy: f32[64, 4] = gate.noise %logits {layer=0, sigma=1.0}\n"
    "  %scores: f32[64, 4] = gate.softmax %noisy\n"
    "  %idx: i32[64, 2] = gate.topk %scores {k=2}\n"
    "  %gates: f32[64, 2] = gate.gather %scores, %idx {renorm=1}\n"
    "  %loc: i32[64, 2] = gate.locations %idx {capacity=32, experts=4, groups=1}\n"
    "  %aux: f32[] = gate.aux_loss %scores, %idx {coef=0.01, groups=1}\n"
    "  %z: f32[] = gate.z_loss %logits {coef=0.001, groups=1}\n"
    "  %disp: f32[4, 32, 32] = order.encode %x, %idx, %loc {capacity=32, experts=4, groups=1}\n"
    "  %h: f32[4, 32, 64] = expert.matmul %disp, @block0.moe.experts.w1\n"
    "  %hb: f32[4, 32, 64] = expert.bias %h, @block0.moe.experts.b1\n"
    "  %act: f32[4, 32, 64] = act.gelu %hb\n"
    "  %y: f32[4, 32, 32] = expert.matmul %act, @block0.moe.experts.w2\n"
    "  %yb: f32[4, 32, 32] = expert.bias %y, @block0.moe.experts.b2\n"
    "  %moe: f32[64, 32] = order.decode %yb, %idx, %loc, %gates {capacity=32, experts=4, groups=1}\n"
    "  %out: f32[64, 32] = add %x, %moe\n"
    "  return %out, %aux, %z\n"
    "}\n"
    "\n"
    "func @loss.fwd(%out: f32[64, 32], %target: f32[64, 32]) {\n"
    "  %loss: f32[] = loss.mse %out, %target\n"
    "  return %loss\n"
    "}\n"
    "\n"
    "func @loss.bwd() saves @loss.fwd {\n"
    "  %dout: f32[64, 32] = loss.mse.grad %out, %target\n"
    "  return %dout\n"
    "}\n"
    "\n"
    "func @block0.bwd(%dout: f32[64, 32]) saves @block0.fwd {\n"
    "  %dyb: f32[4, 32, 32] = order.decode.grad_y %dout, %idx, %loc, %gates {capacity=32, experts=4, groups=1} "
    "!{stream=compute, chunk=0, phase=bwd, event=0}\n"
    "  %dgates: f32[64, 2] = order.decode.grad_gates %dout, %yb, %idx, %loc {capacity=32, experts=4, groups=1} "
    "!{stream=compute, chunk=0, phase=bwd}\n"
    "  %db2: f32[4, 32] = expert.bias.grad %dyb\n"
    "  param.grad @block0.moe.experts.b2, %db2\n"
    "  %dw2: f32[4, 64, 32] = expert.matmul %act, %dyb {ta=1} !{stream=inter, chunk=1, phase=bwd, wait=[0]}\n"
    "  param.grad @block0.moe.experts.w2, %dw2\n"
    "  %dact: f32[4, 32, 64] = expert.matmul %dyb, @block0.moe.experts.w2 {tb=1}\n"
    "  %dhb: f32[4, 32, 64] = act.gelu.grad %dact, %hb\n"
    "  %db1: f32[4, 64] = expert.bias.grad %dhb\n"
    "  param.grad @block0.moe.experts.b1, %db1\n"
    "  %dw1: f32[4, 32, 64] = expert.matmul %disp, %dhb {ta=1}\n"
    "  param.grad @block0.moe.experts.w1, %dw1\n"
    "  %ddisp: f32[4, 32, 32] = expert.matmul %dhb, @block0.moe.experts.w1 {tb=1}\n"
    "  %dx.1: f32[64, 32] = order.encode.grad %ddisp, %idx, %loc {capacity=32, experts=4, groups=1}\n"
    "  %dscores.1: f32[64, 4] = gate.gather.grad %dgates, %scores, %idx {renorm=1}\n"
    "  %dscores.2: f32[64, 4] = gate.aux_loss.grad %scores, %idx {coef=0.01, groups=1}\n"
    "  %dscores: f32[64, 4] = add %dscores.1, %dscores.2\n"
    "  %dnoisy: f32[64, 4] = gate.softmax.grad %dscores, %scores\n"
    "  %dlogits.1: f32[64, 4] = gate.z_loss.grad %logits {coef=0.001, groups=1}\n"
    "  %dlogits: f32[64, 4] = add %dnoisy, %dlogits.1\n"
    "  %dwg: f32[32, 4] = matmul %x, %dlogits {ta=1}\n"
    "  param.grad @block0.moe.gate.wg, %dwg\n"
    "  %dx.2: f32[64, 32] = matmul %dlogits, @block0.moe.gate.wg {tb=1}\n"
    "  %dx.3: f32[64, 32] = add %dx.1, %dx.2\n"
    "  %dx: f32[64, 32] = add %dout, %dx.3\n"
    "  return %dx\n"
    "}\n"
    "\n"
    "func @optimizer() {\n"
    "  opt.sgd @block0.moe.gate.wg {lr=0.01, weight_decay=0.0}\n"
    "  opt.sgd @block0.moe.experts.w1 {lr=0.01, weight_decay=0.0}\n"
    "  opt.sgd @block0.moe.experts.b1 {lr=0.01, weight_decay=0.0}\n"
    "  opt.sgd @block0.moe.experts.w2 {lr=0.01, weight_decay=0.0}\n"
    "  opt.adamw @block0.moe.experts.b2 {beta1=0.9, beta2=0.999, eps=1e-08, lr=0.001, "
    "weight_decay=0.01}\n"
    "  return\n"
    "}\n";

static void test_full_layer(void **state) {
  (void)state;
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, layer_text);
  if (!p.m) print_error("%s", cap_text(&c));
  assert_non_null(p.m);
  if (!ir_verify(&c.d, p.m)) print_error("%s", cap_text(&c));
  assert_int_equal(c.d.errors, 0);
  assert_int_equal(p.m->nparams, 5);
  assert_int_equal(p.m->nfuncs, 5);
  IrFunc *bwd = ir_find_func(p.m, "block0.bwd");
  assert_non_null(bwd);
  assert_ptr_equal(bwd->saves, ir_find_func(p.m, "block0.fwd"));
  assert_int_equal(bwd->ops[4]->stream, IR_STREAM_INTER);
  assert_int_equal(bwd->ops[4]->nwaits, 1);
  // The text is in canonical form, so printing what was parsed gives it back exactly.
  char *text = assert_round_trip(p.m);
  assert_string_equal(text, layer_text);
  free(text);
  // Each op's result type is what shape inference derives.
  for (int i = 0; i < p.m->nfuncs; i++)
    for (int j = 0; j < p.m->funcs[i]->nops; j++) {
      IrOp *op = p.m->funcs[i]->ops[j];
      IrType t;
      assert_true(ir_infer_type(&c.d, op, &t));
      if (op->result) assert_true(ir_type_equal(&t, &op->result->type));
    }
  parsed_free(&p);
  cap_close(&c);
}

// A change to one dimension of the layer is caught, with the dims named.
static void test_full_layer_mismatch(void **state) {
  (void)state;
  char *text = strdup(layer_text);
  char *at = strstr(text, "%dact: f32[4, 32, 64] = expert.matmul %dyb, @block0.moe.experts.w2 {tb=1}");
  assert_non_null(at);
  at = strstr(at, "{tb=1}");
  memcpy(at, "{ta=1}", 6);
  Capture c;
  cap_open(&c);
  Parsed p = parse_text(&c.d, text);
  assert_non_null(p.m);
  assert_false(ir_verify(&c.d, p.m));
  assert_contains(cap_text(&c),
                  "error: expert.matmul: inner dimensions differ: %dyb (f32[4, 32, 32]) has k = 32 (ta=1) but "
                  "@block0.moe.experts.w2 (f32[4, 64, 32]) has k = 64\n");
  assert_int_equal(c.d.errors, 1);
  parsed_free(&p);
  cap_close(&c);
  free(text);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(test_op_table),
      cmocka_unit_test(test_types),
      cmocka_unit_test(test_failure_policy),
      cmocka_unit_test(test_print_format),
      cmocka_unit_test(test_attr_values_round_trip),
      cmocka_unit_test(test_odd_names_round_trip),
      cmocka_unit_test(test_parse_errors),
      cmocka_unit_test(test_parse_error_snippet),
      cmocka_unit_test(test_fused_groups_round_trip),
      cmocka_unit_test(test_func_concurrent),
      cmocka_unit_test(test_parse_comments_and_spacing),
      cmocka_unit_test(test_parse_garbage),
      cmocka_unit_test(test_verify_errors),
      cmocka_unit_test(test_verify_located_and_all),
      cmocka_unit_test(test_shapes_dense),
      cmocka_unit_test(test_shapes_more_ops),
      cmocka_unit_test(test_shapes_chunk_uneven),
      cmocka_unit_test(test_full_layer),
      cmocka_unit_test(test_full_layer_mismatch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
