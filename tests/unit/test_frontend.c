// Unit tests of the front end: valid sources parse and check into the FeProgram fields the
// manual promises (values, defaults, variants, hooks, schedule), the shipped cluster profiles
// load, the statement tree keeps values and locations, and broken sources give the expected
// number of errors with the expected messages (the full texts are the tests/diag goldens).
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "frontend/fe.h"

#ifndef MOEC_ROOT
#define MOEC_ROOT "."
#endif

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

// Parses and checks text; the source is returned through src_out for the caller to free.
static FeProgram *load(Capture *c, const char *text, IrSource **src_out) {
  IrSource *src = ir_source_from_buffer("t.moe", text, strlen(text));
  assert_non_null(src);
  *src_out = src;
  return fe_load(&c->d, src);
}

static const char *const full_model =
    "# every construct of the language\n"
    "model big {\n"
    "  dtype bf16; batch 4; seqlen 256; embed 768; seed 7; vocab 50257; position rope { theta 500000; } norm rmsnorm { eps 1e-6; } tie_embeddings false;\n"
    "  optimizer adamw { lr 3e-4; beta1 0.8; eps 1e-6; weight_decay 0.1; }\n"
    "}\n"
    "parallel { dp 2; mp 2; ep 2; esp 2; }\n"
    "cluster \"lang/clusters/testbed-a.cluster\";\n"
    "layer block x 12 {\n"
    "  attention { heads 12; }\n"
    "  moe {\n"
    "    experts 8 { ffn gpt { hidden 3072; act relu; bias false; } }\n"
    "    gate gshard { k 2; capacity 1.2; noise 1.0; aux_loss 0.01; z_loss 0.001; groups 4; }\n"
    "    order gshard;\n"
    "    dispatch { algo 2dh; }\n"
    "    hook before_dispatch compress bf16;\n"
    "    hook after_combine record;\n"
    "  }\n"
    "}\n"
    "layer tail { attention { heads 4; kv_heads 2; bias false; }\n"
    "  moe {\n"
    "    experts 4 { ffn mixtral { hidden 1024; } }\n"
    "    gate xmoe { k 1; capacity *; proj 8; }\n"
    "  }\n"
    "}\n"
    "schedule { policy fsmoe; pipeline { forward 2; backward 4; } grad_partition chunk 30MB; }\n";

static void test_full_model(void **state) {
  Capture c;
  IrSource *src;
  cap_open(&c);
  FeProgram *p = load(&c, full_model, &src);
  assert_string_equal(cap_text(&c), "");
  assert_non_null(p);
  assert_string_equal(p->model.name, "big");
  assert_string_equal(p->model.dtype, "bf16");
  assert_int_equal(p->model.dtype_loc.line, 3);
  assert_int_equal(p->model.batch, 4);
  assert_int_equal(p->model.seqlen, 256);
  assert_int_equal(p->model.embed, 768);
  assert_int_equal(p->model.seed, 7);
  assert_string_equal(p->model.optimizer.name, "adamw");
  assert_true(p->model.optimizer.lr == 3e-4);
  assert_true(p->model.optimizer.beta1 == 0.8);
  assert_true(p->model.optimizer.beta2 == 0.999);
  assert_true(p->model.optimizer.eps == 1e-6);
  assert_true(p->model.optimizer.weight_decay == 0.1);
  assert_true(p->model.has_vocab);
  assert_int_equal(p->model.vocab, 50257);
  assert_string_equal(p->model.position, "rope");
  assert_true(p->model.rope_theta == 500000);
  assert_string_equal(p->model.norm, "rmsnorm");
  assert_true(p->model.norm_eps == 1e-6);
  assert_false(p->model.tie_embeddings);
  assert_int_equal(p->layers[1].heads, 4);
  assert_int_equal(p->layers[1].kv_heads, 2);
  assert_false(p->layers[1].attn_bias);
  assert_false(p->layers[1].attn_bias_out);
  assert_true(p->layers[0].attn_bias);
  assert_true(p->layers[0].attn_bias_out);
  assert_int_equal(p->layers[0].kv_heads, 12);
  assert_int_equal(p->layers[0].head_dim, 64);   // embed/heads when not written
  assert_int_equal(p->layers[1].head_dim, 192);
  assert_int_equal(p->parallel.dp, 2);
  assert_int_equal(p->parallel.esp, 2);
  assert_non_null(p->parallel.loc.src);
  assert_string_equal(p->cluster_path, "lang/clusters/testbed-a.cluster");
  assert_int_equal(p->cluster_loc.line, 7);
  assert_int_equal(p->cluster_loc.col, 9);
  assert_int_equal(p->nlayers, 2);

  const FeLayer *l = &p->layers[0];
  assert_string_equal(l->name, "block");
  assert_int_equal(l->repeat, 12);
  assert_true(l->has_attention);
  assert_int_equal(l->heads, 12);
  assert_int_equal(l->moe.experts.count, 8);
  assert_string_equal(l->moe.experts.kind, "gpt");
  assert_int_equal(l->moe.experts.hidden, 3072);
  assert_string_equal(l->moe.experts.act, "relu");
  assert_false(l->moe.experts.bias);
  assert_string_equal(l->moe.gate.name, "gshard");
  assert_int_equal(l->moe.gate.loc.line, 12);
  assert_int_equal(l->moe.gate.loc.col, 10);
  assert_int_equal(l->moe.gate.k, 2);
  assert_true(l->moe.gate.capacity == 1.2);
  assert_false(l->moe.gate.dropless);
  assert_true(l->moe.gate.noise == 1.0);
  assert_true(l->moe.gate.aux_loss == 0.01);
  assert_true(l->moe.gate.z_loss == 0.001);
  assert_int_equal(l->moe.gate.groups, 4);
  assert_int_equal(l->moe.gate.field_loc[FE_GATE_F_GROUPS].line, 12);
  assert_null(l->moe.gate.field_loc[FE_GATE_F_PROJ].src);
  assert_true(l->moe.gate.renormalize);            // default: k > 1
  assert_string_equal(l->moe.order, "gshard");
  assert_string_equal(l->moe.algo, "2dh");
  assert_int_equal(l->moe.nhooks, 2);
  assert_string_equal(l->moe.hooks[0].point, "before_dispatch");
  assert_string_equal(l->moe.hooks[0].action, "compress");
  assert_string_equal(l->moe.hooks[0].arg, "bf16");
  assert_string_equal(l->moe.hooks[1].point, "after_combine");
  assert_string_equal(l->moe.hooks[1].action, "record");
  assert_null(l->moe.hooks[1].arg);

  l = &p->layers[1];
  assert_string_equal(l->name, "tail");
  assert_int_equal(l->repeat, 1);
  assert_true(l->has_attention);
  assert_string_equal(l->moe.experts.kind, "mixtral");
  assert_null(l->moe.experts.act);
  assert_false(l->moe.experts.bias);
  assert_string_equal(l->moe.gate.name, "xmoe");
  assert_true(l->moe.gate.dropless);
  assert_int_equal(l->moe.gate.proj, 8);
  assert_false(l->moe.gate.renormalize);           // default: k 1 keeps the score
  assert_string_equal(l->moe.order, "tutel");
  assert_string_equal(l->moe.algo, "nccl");
  assert_int_equal(l->moe.nhooks, 0);

  assert_string_equal(p->schedule.policy, "fsmoe");
  assert_false(p->schedule.pipeline_auto);
  assert_int_equal(p->schedule.pipeline_fwd, 2);
  assert_int_equal(p->schedule.pipeline_bwd, 4);
  assert_string_equal(p->schedule.grad_partition, "chunk");
  assert_int_equal(p->schedule.grad_chunk_bytes, 30 << 20);
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

// The smallest model: every default of the manual.
static void test_defaults(void **state) {
  Capture c;
  IrSource *src;
  cap_open(&c);
  FeProgram *p = load(&c,
                      "model m { batch 1; seqlen 8; embed 4; optimizer sgd { lr 0.1; } }\n"
                      "layer a { moe { experts 2 { ffn gpt { hidden 8; } } gate gshard; } }\n",
                      &src);
  assert_string_equal(cap_text(&c), "");
  assert_non_null(p);
  assert_string_equal(p->model.dtype, "fp32");
  assert_int_equal(p->model.seed, 0);
  assert_string_equal(p->model.optimizer.name, "sgd");
  assert_true(p->model.optimizer.lr == 0.1);
  assert_int_equal(p->parallel.dp, 1);
  assert_int_equal(p->parallel.mp, 1);
  assert_int_equal(p->parallel.ep, 1);
  assert_int_equal(p->parallel.esp, 1);
  assert_null(p->parallel.loc.src);
  assert_null(p->cluster_path);
  const FeMoe *m = &p->layers[0].moe;
  assert_string_equal(m->experts.act, "gelu");
  assert_true(m->experts.bias);
  assert_int_equal(m->gate.k, 1);
  assert_true(m->gate.capacity == 1.0);
  assert_true(m->gate.noise == 0 && m->gate.aux_loss == 0 && m->gate.z_loss == 0);
  assert_int_equal(m->gate.groups, 1);
  assert_int_equal(m->gate.proj, 16);
  assert_int_equal(m->gate.slots, 1);
  assert_string_equal(m->order, "tutel");
  assert_string_equal(m->algo, "nccl");
  assert_null(p->schedule.loc.src);
  assert_string_equal(p->schedule.policy, "sequential");
  assert_false(p->schedule.pipeline_auto);
  assert_int_equal(p->schedule.pipeline_fwd, 1);
  assert_int_equal(p->schedule.pipeline_bwd, 1);
  assert_string_equal(p->schedule.grad_partition, "none");
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

// The fields the Hugging Face families need (lang/manual.md §19): renormalisation of the top k as a
// field, q/k/v biases without the output's, a head width of its own.
static void test_hf_fields(void **state) {
  Capture c;
  IrSource *src;
  cap_open(&c);
  FeProgram *p = load(&c,
                      "model m { batch 1; seqlen 8; embed 16; vocab 32; position rope; optimizer sgd { lr 0.1; } }\n"
                      "layer a { attention { heads 3; kv_heads 1; head_dim 6; bias qkv; }\n"
                      "  moe { experts 4 { ffn gpt { hidden 8; } } gate gshard { k 2; renormalize false; } } }\n"
                      "layer b { attention { heads 4; bias false; }\n"
                      "  moe { experts 4 { ffn gpt { hidden 8; } } gate xmoe { k 1; renormalize true; } } }\n"
                      "layer c { attention { heads 2; } moe { experts 4 { ffn gpt { hidden 8; } } gate sigmoid { k 2; } } }\n",
                      &src);
  assert_string_equal(cap_text(&c), "");
  assert_non_null(p);
  const FeLayer *a = &p->layers[0], *b = &p->layers[1], *l = &p->layers[2];
  assert_int_equal(a->head_dim, 6);
  assert_true(a->attn_bias);
  assert_false(a->attn_bias_out);
  assert_false(a->moe.gate.renormalize);
  assert_non_null(a->moe.gate.field_loc[FE_GATE_F_RENORM].src);
  assert_int_equal(b->head_dim, 4);
  assert_false(b->attn_bias);
  assert_false(b->attn_bias_out);
  assert_true(b->moe.gate.renormalize);
  assert_int_equal(l->head_dim, 8);
  assert_true(l->attn_bias && l->attn_bias_out);
  assert_false(l->moe.gate.renormalize);           // sigmoid never renormalises
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

// The shared expert (Qwen2-MoE, DeepSeek): `shared { ffn mixtral { hidden Hs; } [gate sigmoid;] }`.
static void test_shared_expert(void **state) {
  Capture c;
  IrSource *src;
  cap_open(&c);
  FeProgram *p = load(&c,
                      "model m { batch 1; seqlen 8; embed 16; optimizer sgd { lr 0.1; } }\n"
                      "layer a { moe { experts 4 { ffn gpt { hidden 8; } } gate gshard;\n"
                      "  shared { ffn mixtral { hidden 12; } gate sigmoid; } } }\n"
                      "layer b { moe { experts 4 { ffn mixtral { hidden 8; } } shared { ffn mixtral { hidden 6; } } gate gshard; } }\n"
                      "layer c { moe { experts 4 { ffn gpt { hidden 8; } } gate gshard; } }\n",
                      &src);
  assert_string_equal(cap_text(&c), "");
  assert_non_null(p);
  const FeMoe *a = &p->layers[0].moe, *b = &p->layers[1].moe, *l = &p->layers[2].moe;
  assert_true(a->has_shared && a->shared_gated);
  assert_string_equal(a->shared.kind, "mixtral");
  assert_int_equal(a->shared.hidden, 12);
  assert_null(a->shared.act);
  assert_false(a->shared.bias);
  assert_non_null(a->shared_gate_loc.src);
  assert_true(b->has_shared && !b->shared_gated);
  assert_int_equal(b->shared.hidden, 6);
  assert_false(l->has_shared);
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

// gpt-oss's experts (`ffn oss { hidden H; }`): no activation choice, always their biases; the
// lowering's parameters with the ESP splits of gpt's and mixtral's (w1, w3 by columns, b1 and b3
// with them, w2 by rows, b2 whole).
static void test_oss_expert(void **state) {
  Capture c;
  IrSource *src;
  cap_open(&c);
  FeProgram *p = load(&c,
                      "model m { batch 1; seqlen 8; embed 16; optimizer sgd { lr 0.1; } }\n"
                      "layer a { moe { experts 4 { ffn oss { hidden 8; } } gate gshard { k 2; bias true; } } }\n",
                      &src);
  assert_string_equal(cap_text(&c), "");
  assert_non_null(p);
  const FeExperts *e = &p->layers[0].moe.experts;
  assert_string_equal(e->kind, "oss");
  assert_int_equal(e->hidden, 8);
  assert_null(e->act);
  assert_true(e->bias);
  IrModule *m = fe_lower(&c.d, p, NULL);
  assert_non_null(m);
  static const struct { const char *name; int rank; int64_t d1, d2; int64_t hidden; const char *init; } want[] = {
      {"a0.moe.experts.w1", 3, 16, 8, 2, "normal"}, {"a0.moe.experts.b1", 2, 8, 0, 1, "zeros"},
      {"a0.moe.experts.w3", 3, 16, 8, 2, "normal"}, {"a0.moe.experts.b3", 2, 8, 0, 1, "zeros"},
      {"a0.moe.experts.w2", 3, 8, 16, 1, "normal"}, {"a0.moe.experts.b2", 2, 16, 0, -1, "zeros"},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const IrParam *q = ir_find_param(m, want[i].name);
    assert_non_null(q);
    assert_int_equal(q->type.rank, want[i].rank);
    assert_int_equal(q->type.dim[0], 4);
    assert_int_equal(q->type.dim[1], want[i].d1);
    if (want[i].rank == 3) assert_int_equal(q->type.dim[2], want[i].d2);
    assert_int_equal(ir_attr_int(q->attrs, q->nattrs, "shard_expert", -1), 0);
    assert_int_equal(ir_attr_int(q->attrs, q->nattrs, "shard_hidden", -1), want[i].hidden);
    assert_string_equal(ir_attr_str(q->attrs, q->nattrs, "init", ""), want[i].init);
  }
  ir_module_free(m);
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

// The demo model, read from the repository.
static void test_tiny_model(void **state) {
  Capture c;
  cap_open(&c);
  IrSource *src = ir_source_read(&c.d, MOEC_ROOT "/lang/models/tiny.moe");
  assert_non_null(src);
  FeProgram *p = fe_load(&c.d, src);
  assert_string_equal(cap_text(&c), "");
  assert_non_null(p);
  assert_string_equal(p->model.name, "tiny");
  assert_int_equal(p->model.embed, 32);
  assert_string_equal(p->model.optimizer.name, "adamw");
  assert_true(p->model.optimizer.lr == 0.003);
  assert_int_equal(p->nlayers, 1);
  assert_int_equal(p->layers[0].repeat, 2);
  assert_int_equal(p->layers[0].moe.gate.k, 2);
  assert_true(p->layers[0].moe.gate.capacity == 1.25);
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

static void test_cluster_files(void **state) {
  Capture c;
  cap_open(&c);
  FeCluster cl;
  assert_true(fe_load_cluster(&c.d, MOEC_ROOT "/lang/clusters/testbed-a.cluster", (SrcLoc){0}, &cl));
  assert_string_equal(cl.name, "testbed_a");
  assert_int_equal(cl.nodes, 6);
  assert_int_equal(cl.gpus_per_node, 8);
  assert_true(cl.gemm.alpha == 4.26e-2 && cl.gemm.beta == 2.29e-11);
  assert_true(cl.alltoall.alpha == 2.87e-1 && cl.alltoall.beta == 2.21e-7);
  assert_true(cl.allgather.alpha == 3.37e-1 && cl.allgather.beta == 2.32e-6);
  assert_true(cl.reducescatter.alpha == 3.95e-1 && cl.reducescatter.beta == 2.34e-7);
  assert_true(cl.allreduce.alpha == 5.11e-1 && cl.allreduce.beta == 4.95e-6);
  assert_true(fe_load_cluster(&c.d, MOEC_ROOT "/lang/clusters/testbed-a-solver.cluster", (SrcLoc){0}, &cl));
  assert_true(cl.alltoall.alpha == 0.235 && cl.alltoall.beta == 1.85e-6);
  assert_true(fe_load_cluster(&c.d, MOEC_ROOT "/lang/clusters/testbed-b.cluster", (SrcLoc){0}, &cl));
  assert_int_equal(cl.nodes, 8);
  assert_int_equal(cl.gpus_per_node, 4);
  assert_true(cl.allreduce.alpha == 8.37e-2 && cl.allreduce.beta == 5.99e-7);
  assert_string_equal(cap_text(&c), "");
  assert_false(fe_load_cluster(&c.d, MOEC_ROOT "/no/such.cluster", (SrcLoc){0}, &cl));
  assert_non_null(strstr(cap_text(&c), "cannot read '" MOEC_ROOT "/no/such.cluster': No such file or directory"));
  cap_close(&c);
}

// The generic statement tree: keys, values of every kind, locations, nesting.
static void test_tree(void **state) {
  Capture c;
  cap_open(&c);
  const char *text = "a 1 -2.5e-3 \"q\\\"s\" * 1dh x.y-z {\n  b;\n  c { }\n}\n";
  IrSource *src = ir_source_from_buffer("t.moe", text, strlen(text));
  FeTree *t = fe_parse(&c.d, src);
  assert_non_null(t);
  assert_int_equal(t->root->nkids, 1);
  const FeNode *a = t->root->kids[0];
  assert_string_equal(a->key, "a");
  assert_true(a->has_block);
  assert_int_equal(a->nvals, 6);
  assert_int_equal(a->vals[0].kind, FE_VAL_INT);
  assert_int_equal(a->vals[0].i, 1);
  assert_int_equal(a->vals[1].kind, FE_VAL_FLOAT);
  assert_true(a->vals[1].f == -2.5e-3);
  assert_string_equal(a->vals[1].text, "-2.5e-3");
  assert_int_equal(a->vals[2].kind, FE_VAL_STRING);
  assert_string_equal(a->vals[2].text, "q\"s");
  assert_int_equal(a->vals[2].loc.col, 13);
  assert_int_equal(a->vals[2].loc.len, 6);
  assert_int_equal(a->vals[3].kind, FE_VAL_STAR);
  assert_int_equal(a->vals[4].kind, FE_VAL_IDENT);
  assert_string_equal(a->vals[4].text, "1dh");
  assert_string_equal(a->vals[5].text, "x.y-z");
  assert_int_equal(a->nkids, 2);
  assert_string_equal(a->kids[0]->key, "b");
  assert_false(a->kids[0]->has_block);
  assert_int_equal(a->kids[0]->loc.line, 2);
  assert_int_equal(a->kids[0]->loc.col, 3);
  assert_true(a->kids[1]->has_block);
  assert_int_equal(a->kids[1]->nkids, 0);
  assert_int_equal(a->end_loc.line, 4);
  fe_tree_free(t);
  ir_source_free(src);
  cap_close(&c);
}

// Error counts: each independent problem is one error; syntax errors stop at the first.
// LoRA fine-tuning (lang/manual.md §7.3): `lora { r R; alpha A; targets ...; dropout 0; }` in the
// model block; alpha defaults to 8 (PEFT's lora_alpha), dropout to 0, a target not written is false.
static void test_lora(void **state) {
  static const char *const texts[] = {
    "model m { batch 2; seqlen 8; embed 16; vocab 32; optimizer adamw { lr 0.001; }\n"
    "  lora { r 4; alpha 8; targets q v experts; } }\n"
    "layer a x 2 { attention { heads 2; } moe { experts 4 { ffn gpt { hidden 8; } } gate gshard { k 2; } } }\n",
    "model m { batch 2; seqlen 8; embed 16; vocab 32; optimizer adamw { lr 0.001; }\n"
    "  lora { r 16; targets o k shared mlp; dropout 0; } }\n"
    "layer a { attention { heads 2; } moe { experts 4 { ffn gpt { hidden 8; } } gate gshard;\n"
    "  shared { ffn mixtral { hidden 8; } } } }\n"
    "layer b { attention { heads 2; } mlp { ffn mixtral { hidden 8; } } }\n",
  };
  for (int t = 0; t < 2; t++) {
    Capture c;
    IrSource *src;
    cap_open(&c);
    FeProgram *p = load(&c, texts[t], &src);
    assert_string_equal(cap_text(&c), "");
    assert_non_null(p);
    const FeLora *lo = &p->model.lora;
    assert_true(p->model.has_lora);
    assert_non_null(lo->loc.src);
    assert_non_null(lo->targets_loc.src);
    assert_true(lo->dropout == 0);
    assert_true(lo->alpha == 8);   // written in the first, the default in the second
    if (t == 0) {
      assert_int_equal(lo->r, 4);
      assert_true(lo->q && lo->v && lo->experts);
      assert_false(lo->k || lo->o || lo->shared || lo->mlp);
      assert_null(lo->dropout_loc.src);
    } else {
      assert_int_equal(lo->r, 16);
      assert_true(lo->o && lo->k && lo->shared && lo->mlp);
      assert_false(lo->q || lo->v || lo->experts);
      assert_non_null(lo->dropout_loc.src);
    }
    fe_program_free(p);
    ir_source_free(src);
    cap_close(&c);
  }
  // without a lora block: has_lora false and no target
  Capture c;
  IrSource *src;
  cap_open(&c);
  FeProgram *p = load(&c,
                      "model m { batch 1; seqlen 8; embed 4; optimizer sgd { lr 0.1; } }\n"
                      "layer a { moe { experts 2 { ffn gpt { hidden 8; } } gate gshard; } }\n",
                      &src);
  assert_non_null(p);
  assert_false(p->model.has_lora);
  assert_false(p->model.lora.q || p->model.lora.experts);
  fe_program_free(p);
  ir_source_free(src);
  cap_close(&c);
}

typedef struct ErrCase {
  const char *text;
  int errors;
  const char *message;  // a part of the output
} ErrCase;

static void test_errors(void **state) {
  static const ErrCase cases[] = {
    {"", 1, "empty file: expected a 'model' block"},
    {"model m { batch 1 }", 1, "expected ';' or '{' after 'batch 1'"},
    {"model m {", 1, "unterminated '{' block of 'model m'"},
    {"}", 1, "unexpected '}'"},
    {"model m { batch $; }", 1, "stray '$' in program"},
    {"cluster \"abc", 1, "unterminated string"},
    {"model m { batch 0; seqlen -1; embed x; optimizer sgd { lr 0; } }\n"
     "layer a { moe { experts 2 { ffn gpt { hidden 8; } } gate gshrad; } }\n",
     5, "did you mean 'gshard'?"},
    {"model m { batch 1; seqlen 8; embed 4; optimizer sgd { lr 0.1; } }\n"
     "parallel { dp 2; ep 4; }\n"
     "layer a { moe { experts 6 { ffn gpt { hidden 8; } } gate gshard { k 7; groups 3; } } }\n",
     4, "dp*mp must equal ep*esp"},
    {"model m { batch 1; batch 2; seqlen 8; embed 4; optimizer sgd { lr 0.1; } }\n"
     "layer a { moe { experts 2 { ffn gpt { act gelu; } } gate gshard; } }\n",
     2, "missing 'hidden' in 'ffn gpt'"},
    {"layer a { moe { experts 2 { ffn gpt { hidden 8; } } gate gshard; } }\n", 1, "missing 'model' block"},
    {"model m { batch 1; seqlen 8; embed 4; optimizer sgd { lr 0.1; } lora { r 0; alpha 4; dropout 0.1; } }\n"
     "layer a { moe { experts 2 { ffn gpt { hidden 8; } } gate gshard; } }\n",
     3, "only dropout 0 is supported"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    Capture c;
    IrSource *src;
    cap_open(&c);
    FeProgram *p = load(&c, cases[i].text, &src);
    if (p || c.d.errors != cases[i].errors || !strstr(cap_text(&c), cases[i].message))
      fail_msg("case %zu: %d errors (expected %d), output:\n%s", i, c.d.errors, cases[i].errors, cap_text(&c));
    ir_source_free(src);
    cap_close(&c);
  }
}

// Deep nesting gives a diagnostic, not a deep stack.
static void test_deep_nesting(void **state) {
  Capture c;
  IrSource *src;
  cap_open(&c);
  size_t n = 100000;
  char *text = malloc(4 * n + 1);
  assert_non_null(text);
  for (size_t i = 0; i < n; i++)
    memcpy(text + 4 * i, "a { ", 4);
  text[4 * n] = '\0';
  assert_null(load(&c, text, &src));
  assert_int_equal(c.d.errors, 1);
  assert_non_null(strstr(cap_text(&c), "nested more than 64 levels"));
  free(text);
  ir_source_free(src);
  cap_close(&c);
}

int main(void) {
  const struct CMUnitTest tests[] = {
    cmocka_unit_test(test_full_model),
    cmocka_unit_test(test_defaults),
    cmocka_unit_test(test_hf_fields),
    cmocka_unit_test(test_shared_expert),
    cmocka_unit_test(test_oss_expert),
    cmocka_unit_test(test_tiny_model),
    cmocka_unit_test(test_lora),
    cmocka_unit_test(test_cluster_files),
    cmocka_unit_test(test_tree),
    cmocka_unit_test(test_errors),
    cmocka_unit_test(test_deep_nesting),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}
