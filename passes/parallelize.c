// The `parallelize` pass: one rank's program of a parallel layout (the paper's Fig. 2).
//
// Lowering writes each layer for one DP rank's tokens (S = batch*seqlen) with mp*groups routing
// groups, the exact single-rank twin. This pass turns it into what every rank runs, given the
// module attributes dp, mp, ep, esp:
//   MP   in a language model's layer, attention by heads and an mlp by hidden units (Megatron:
//        comm.copy into the column-split projections, comm.allreduce after the row-split ones);
//        x -> comm.split (this rank's S/mp tokens: its routing groups) ... the combined MoE
//        output -> comm.allgather before the residual (its consumers are replicated, so its
//        backward is a split, not a reduce-scatter);
//   EP   expert input [E, C, M] -> comm.alltoall (block i to EP member i) -> layout.expert_major
//        ([El, ep*C, M]); the mirror after the experts;
//   ESP  -> comm.allgather of the tokens over the ESP group -> expert shards: each ESP rank
//        holds H/esp hidden columns of w1 (w3, b1) and rows of w2 -> partial outputs ->
//        comm.reducescatter; the output bias b2 is added after it, once.
// Expert parameters shrink to this rank's shard (attrs shard_ep / shard_esp name the split
// dimensions for the runtime). Gradients of replicated parameters are marked for an AllReduce
// (grad_reduce: the gate over the world, b2 over the ESP group), which autodiff inserts.
// A language model's vocabulary may be split over MP as well (`vocab_parallel true;`, vocab_split).
// Losses are shares: mse scaled by 1/dp (MP copies are identical; the runtime sums over DP),
// aux and z divided by dp*mp (the runtime sums over the world), so every loss and gradient
// equals the single-rank run's.
#include <string.h>

#include "pass.h"

typedef struct Par {
  IrModule *m;
  IrDiag *d;
  IrFunc *f;
  int64_t dp, mp, ep, esp;
} Par;

// Appends an op, then moves it to position `at` of f.
static IrOp *insert_at(Par *P, int at, IrOpKind kind, const char *name, IrValue *arg) {
  const char *unique = name;
  for (int n = 1; name && ir_find_value(P->f, unique); n++) unique = ir_strfmt(P->m, "%s.%d", name, n);
  IrOp *op = ir_add_op(P->f, P->m, kind, unique, (IrType){0});
  ir_op_arg(op, arg);
  IrFunc *f = P->f;
  memmove(&f->ops[at + 1], &f->ops[at], sizeof(IrOp *) * (size_t)(f->nops - 1 - at));
  f->ops[at] = op;
  for (int i = 0; i < f->nops; i++) f->ops[i]->index = i;
  return op;
}

static void set_str(Par *P, IrOp *op, const char *key, const char *v) {
  ir_attrs_set_str(P->m, op->attrs, &op->nattrs, key, v);
}

static IrOp *collective(Par *P, int at, IrOpKind kind, const char *name, IrValue *arg, const char *group,
                        int64_t size) {
  IrOp *op = insert_at(P, at, kind, name, arg);
  set_str(P, op, "group", group);
  ir_op_set_int(op, "size", size);
  return op;
}

static IrOp *layout(Par *P, int at, IrOpKind kind, const char *name, IrValue *arg, int64_t blocks) {
  IrOp *op = insert_at(P, at, kind, name, arg);
  ir_op_set_int(op, "blocks", blocks);
  return op;
}

// Replaces operand `from` by `to` in ops [lo, hi) of f.
static void replace_uses(IrFunc *f, int lo, int hi, IrValue *from, IrValue *to) {
  for (int i = lo; i < hi && i < f->nops; i++)
    for (int a = 0; a < f->ops[i]->nargs; a++)
      if (f->ops[i]->args[a].value == from) f->ops[i]->args[a].value = to;
}

static bool is_expert_param(const IrParam *p) {
  return p && ir_attrs_get(p->attrs, p->nattrs, "shard_expert") != NULL;
}

// MP: this rank's tokens in, the whole DP shard's outputs back before the residual.
static bool split_tokens(Par *P) {
  IrFunc *f = P->f;
  IrValue *x = f->args[0];
  int at = 0;
  // A language model's MoE starts at its normed input (marked moe_input by the lowering).
  for (int i = 0; i < f->nops; i++)
    if (ir_op_int(f->ops[i], "moe_input", 0)) {
      x = f->ops[i]->result;
      at = i + 1;
    }
  IrOp *residual = f->rets[0]->def;
  if (!residual || residual->kind != IR_OP_ADD || (at == 0 && residual->args[0].value != x))
    return ir_error(P->d, "parallelize: '@%s' does not end in the residual add", f->name);
  IrOp *split = collective(P, at, IR_OP_COMM_SPLIT, "xs", x, "mp", P->mp);
  replace_uses(f, at + 1, residual->index, x, split->result);
  IrOp *gather = collective(P, residual->index, IR_OP_COMM_ALLGATHER, "moe.all", residual->args[1].value, "mp", P->mp);
  ir_op_set_int(gather, "bwd_split", 1);
  residual->args[1].value = gather->result;
  for (int i = 0; i < f->nops; i++) {  // each rank routes its own groups
    IrOp *op = f->ops[i];
    const IrAttr *g = ir_attrs_get(op->attrs, op->nattrs, "groups");
    if (g && g->kind == IR_ATTR_INT) ir_op_set_int(op, "groups", g->i / P->mp);
    int64_t dim = ir_op_int(op, "mp_tokens", -1);   // order gshard's buffers: slots of the rank's groups
    if (op->kind == IR_OP_RESHAPE && dim >= 0) {
      const char *key = dim == 0 ? "d0" : dim == 1 ? "d1" : "d2";
      ir_op_set_int(op, key, ir_op_int(op, key, 0) / P->mp);
    }
  }
  return true;
}

static int64_t mp_split(const IrOperand *a) {
  return a->param ? ir_attr_int(a->param->attrs, a->param->nattrs, "mp_split", -1) : -1;
}

// MP inside a language model's layer (Megatron): a projection split by columns (its parameter
// marked mp_split 1 by frontend/lower_lm.c) reads its input through comm.copy, whose gradient is
// the AllReduce of the members' partial input gradients; one split by rows (mp_split 0) gives a
// partial product, summed by a comm.allreduce before its bias. Attention and rope compute the
// rank's heads/mp query and kv_heads/mp key/value heads. Multi-head latent attention (`mla`): its
// parts of heads too (heads.*), except the ops on the latent all heads share (attr mp_shared: its
// slices and the rope key's rope); the shared rope key enters the rank's heads (heads.cat with
// a_heads 1) through comm.copy, whose gradient sums the ranks' parts. Returns whether f had such
// a projection.
static bool split_heads(Par *P) {
  IrFunc *f = P->f;
  bool any = false;
  IrValue *from[8] = {0}, *copy[8] = {0};
  int ncopies = 0;
  for (int i = 0; i < f->nops; i++) {
    IrOp *op = f->ops[i];
    bool attn = op->kind == IR_OP_ATTN_CAUSAL || op->kind == IR_OP_ATTN_SINK;
    bool heads_op = op->kind == IR_OP_ROPE || attn || op->kind == IR_OP_HEADS_SLICE ||
                    op->kind == IR_OP_HEADS_PLACE || op->kind == IR_OP_HEADS_CAT;
    if (heads_op && !ir_op_int(op, "mp_shared", 0)) {
      ir_op_set_int(op, "heads", ir_op_int(op, "heads", 1) / P->mp);
      if (attn) ir_op_set_int(op, "kv_heads", ir_op_int(op, "kv_heads", 1) / P->mp);
      if (op->kind == IR_OP_HEADS_CAT && ir_op_int(op, "a_heads", 1) == 1) {   // the shared rope key
        IrValue *x = op->args[0].value;
        op->args[0].value = collective(P, i, IR_OP_COMM_COPY, ir_strfmt(P->m, "%s.mp", x->name), x, "mp", P->mp)->result;
        i++;
      } else if (op->kind == IR_OP_HEADS_CAT) {
        ir_op_set_int(op, "a_heads", ir_op_int(op, "a_heads", 1) / P->mp);
      }
      continue;
    }
    if (op->kind == IR_OP_RESHAPE && ir_op_int(op, "mp_split", -1) >= 0) {   // q or k by heads (qk_norm head)
      const char *key = ir_op_int(op, "mp_split", 0) == 0 ? "d0" : "d1";
      ir_op_set_int(op, key, ir_op_int(op, key, 0) / P->mp);
      continue;
    }
    if (op->kind != IR_OP_MATMUL || op->nargs < 2 || mp_split(&op->args[1]) < 0) continue;
    any = true;
    if (mp_split(&op->args[1]) == 1) {   // by columns: the input through one copy per value
      IrValue *x = op->args[0].value;
      int c = 0;
      while (c < ncopies && from[c] != x) c++;
      if (c == ncopies) {
        if (ncopies == 8) return ir_error(P->d, "parallelize: '@%s' has too many column-split inputs", f->name);
        from[c] = x;
        copy[c] = collective(P, i, IR_OP_COMM_COPY, ir_strfmt(P->m, "%s.mp", x->name), x, "mp", P->mp)->result;
        ncopies++;
        op = f->ops[++i];
      }
      op->args[0].value = copy[c];
    } else {                              // by rows: the partial sums reduced over MP
      IrOp *sum = collective(P, i + 1, IR_OP_COMM_ALLREDUCE, ir_strfmt(P->m, "%s.sum", op->result->name), op->result,
                             "mp", P->mp);
      replace_uses(f, i + 2, f->nops, op->result, sum->result);
      for (int r = 0; r < f->nrets; r++)
        if (f->rets[r] == op->result) f->rets[r] = sum->result;
      i++;
    }
  }
  return any;
}

static bool retype(Par *P) {
  for (int i = 0; i < P->f->nops; i++) {
    IrOp *op = P->f->ops[i];
    if (op->result && !ir_infer_type(P->d, op, &op->result->type)) return false;
  }
  return true;
}

// The parameters vocab_split splits: the embedding's table by rows (mp_split 0) and the head's
// weight, the same table when tied (logits = x·tableᵀ), else by columns (mp_split 1).
static void mark_vocab(IrModule *m) {
  for (int i = 0; i < m->nfuncs; i++)
    for (int j = 0; j < m->funcs[i]->nops; j++) {
      const IrOp *op = m->funcs[i]->ops[j];
      IrParam *w = op->nargs == 2 ? op->args[1].param : NULL;
      if (!w || (op->kind != IR_OP_EMBED && (op->kind != IR_OP_MATMUL || m->funcs[i]->role != IR_ROLE_LOSS_FWD))) continue;
      ir_attrs_set_int(w->attrs, &w->nattrs, "mp_split", op->kind == IR_OP_EMBED || ir_op_int(op, "tb", 0) ? 0 : 1);
    }
}

// A language model's vocabulary split over MP (module attribute vocab_parallel: the table's rows,
// or the untied head's columns, marked mp_split by mark_vocab): each rank holds the rows of V/mp
// tokens from vocab0 = mp_index * V/mp (the step value the kernels take).
//   embed   the rank's rows (zeros for the other tokens), summed by a comm.allreduce over MP: its
//           consumers are replicated, so its gradient passes unchanged;
//   head    its input through comm.copy (the gradient: the members' partial sums, all-reduced), the
//           rank's columns of the logits [t, V/mp];
//   loss    loss.xent -> loss.xent.stats (each row's logsumexp over the rank's columns and the
//           target's logit where it holds it), comm.allgather over MP, loss.xent.vp (the whole
//           row's logsumexp from the parts'); autodiff seeds loss.xent.vp.grad of the rank's
//           columns from them.
static bool vocab_split(Par *P) {
  IrFunc *f = P->f;
  int made = 0;
  for (int i = 0; i < f->nops; i++) {
    IrOp *op = f->ops[i];
    if (op->kind == IR_OP_EMBED && mp_split(&op->args[1]) == 0) {
      IrOp *sum = collective(P, i + 1, IR_OP_COMM_ALLREDUCE, ir_strfmt(P->m, "%s.sum", op->result->name), op->result,
                             "mp", P->mp);
      replace_uses(f, i + 2, f->nops, op->result, sum->result);
      for (int r = 0; r < f->nrets; r++)
        if (f->rets[r] == op->result) f->rets[r] = sum->result;
      i++, made++;
    } else if (f->role == IR_ROLE_LOSS_FWD && op->kind == IR_OP_MATMUL && op->nargs == 2 && mp_split(&op->args[1]) >= 0) {
      IrValue *x = op->args[0].value;
      op->args[0].value = collective(P, i, IR_OP_COMM_COPY, ir_strfmt(P->m, "%s.mp", x->name), x, "mp", P->mp)->result;
      i++, made++;
    } else if (op->kind == IR_OP_LOSS_XENT) {
      IrOp *st = insert_at(P, i, IR_OP_LOSS_XENT_STATS, "xent.stats", op->args[0].value);
      ir_op_arg(st, op->args[1].value);
      st->loc = op->loc;
      IrOp *all = collective(P, i + 1, IR_OP_COMM_ALLGATHER, "xent.stats.all", st->result, "mp", P->mp);
      op->kind = IR_OP_LOSS_XENT_VP;   // now at i + 2: the loss from every part's statistics
      op->args[0].value = all->result;
      op->args[1] = (IrOperand){0};
      op->nargs = 1;
      ir_op_set_int(op, "parts", P->mp);
      i += 2, made++;
    }
  }
  return made == 0 || retype(P);
}

// EP and ESP around the expert region: the ops that read expert parameters.
static bool shard_experts(Par *P, const char *algo) {
  IrFunc *f = P->f;
  int first = -1, last = -1;
  for (int i = 0; i < f->nops; i++)
    if (pass_op_of_experts(f->ops[i])) {
      if (first < 0) first = i;
      last = i;
    }
  if (first < 0) return ir_error(P->d, "parallelize: '@%s' has no expert parameters", f->name);
  IrValue *din = f->ops[first]->args[0].value;
  IrOp *out_op = f->ops[last];
  // With ESP the output bias is added after the reduce-scatter, once.
  IrOp *bias = NULL;
  if (P->esp > 1 && out_op->kind == IR_OP_EXPERT_BIAS &&
      !ir_attrs_get(out_op->args[1].param->attrs, out_op->args[1].param->nattrs, "shard_hidden"))
    bias = out_op;
  IrValue *dout = out_op->result;
  IrValue *partial = bias ? bias->args[0].value : dout;

  // Into the experts: alltoall over EP, expert-major, allgather over ESP, expert-major.
  int at = first;
  IrValue *v = din;
  if (P->ep > 1) {
    IrOp *a2a = collective(P, at++, IR_OP_COMM_ALLTOALL, "dispatched", v, "ep", P->ep);
    set_str(P, a2a, "algo", algo);
    v = layout(P, at++, IR_OP_LAYOUT_EXPERT_MAJOR, "dispatched.em", a2a->result, P->ep)->result;
  }
  if (P->esp > 1) {
    IrOp *ag = collective(P, at++, IR_OP_COMM_ALLGATHER, "gathered", v, "esp", P->esp);
    v = layout(P, at++, IR_OP_LAYOUT_EXPERT_MAJOR, "gathered.em", ag->result, P->esp)->result;
  }
  int shift = at - first;
  first += shift;
  last += shift;
  replace_uses(f, first, last + 1, din, v);

  // Out of the experts: rank-major, reduce-scatter over ESP, (+ b2), rank-major, alltoall over EP.
  int after = (bias ? bias->index : last) + 1;
  if (bias) {  // move the bias after the reduce-scatter: take it out of the op list for now
    memmove(&f->ops[bias->index], &f->ops[bias->index + 1], sizeof(IrOp *) * (size_t)(f->nops - bias->index - 1));
    f->nops--;
    for (int i = 0; i < f->nops; i++) f->ops[i]->index = i;
    after--;
  }
  v = partial;
  if (P->esp > 1) {
    v = layout(P, after++, IR_OP_LAYOUT_RANK_MAJOR, "partial.rm", v, P->esp)->result;
    v = collective(P, after++, IR_OP_COMM_REDUCESCATTER, "reduced", v, "esp", P->esp)->result;
  }
  if (bias) {
    IrFunc *g = f;
    memmove(&g->ops[after + 1], &g->ops[after], sizeof(IrOp *) * (size_t)(g->nops - after));
    g->ops[after] = bias;
    g->nops++;
    for (int i = 0; i < g->nops; i++) g->ops[i]->index = i;
    bias->args[0].value = v;
    v = bias->result;
    after++;
  }
  if (P->ep > 1) {
    v = layout(P, after++, IR_OP_LAYOUT_RANK_MAJOR, "combined.rm", v, P->ep)->result;
    IrOp *a2a = collective(P, after++, IR_OP_COMM_ALLTOALL, "combined", v, "ep", P->ep);
    set_str(P, a2a, "algo", algo);
    v = a2a->result;
  }
  replace_uses(f, after, f->nops, dout, v);
  for (int r = 0; r < f->nrets; r++)
    if (f->rets[r] == dout) f->rets[r] = v;
  return true;
}

// The rank layout `moec build -v` shows: MP and ESP groups are consecutive ranks, DP groups
// stride by mp and EP groups by esp; a node is gpus_per_node consecutive ranks.
static void print_groups(FILE *log, const Par *P, int64_t gpus_per_node) {
  int64_t world = P->dp * P->mp;
  fprintf(log, "# parallelize: dp %lld, mp %lld, ep %lld, esp %lld: %lld ranks, %lld per node\n", (long long)P->dp,
          (long long)P->mp, (long long)P->ep, (long long)P->esp, (long long)world, (long long)gpus_per_node);
  fprintf(log, "# %5s %5s %4s %4s %4s %4s  %-14s %-14s %-14s %-14s\n", "rank", "node", "dp", "mp", "ep", "esp",
          "mp group", "dp group", "esp group", "ep group");
  for (int64_t r = 0; r < world; r++) {
    char groups[4][64];
    int64_t first[4] = {r / P->mp * P->mp, r % P->mp, r / P->esp * P->esp, r % P->esp};
    int64_t count[4] = {P->mp, P->dp, P->esp, P->ep}, stride[4] = {1, P->mp, 1, P->esp};
    for (int g = 0; g < 4; g++) {
      int n = 0;
      groups[g][0] = 0;
      for (int64_t i = 0; i < count[g] && n < 56; i++)
        n += snprintf(groups[g] + n, sizeof groups[g] - (size_t)n, "%s%lld", i ? "," : "", (long long)(first[g] + i * stride[g]));
    }
    fprintf(log, "# %5lld %5lld %4lld %4lld %4lld %4lld  %-14s %-14s %-14s %-14s\n", (long long)r,
            (long long)(r / gpus_per_node), (long long)(r / P->mp), (long long)(r % P->mp), (long long)(r / P->esp),
            (long long)(r % P->esp), groups[0], groups[1], groups[2], groups[3]);
  }
}

bool pass_parallelize(IrModule *m, PassCtx *ctx) {
  Par P = {.m = m, .d = ctx->d, .dp = ir_mod_int(m, "dp", 1), .mp = ir_mod_int(m, "mp", 1),
           .ep = ir_mod_int(m, "ep", 1), .esp = ir_mod_int(m, "esp", 1)};
  int64_t world = P.dp * P.mp;
  if (world == 1) return true;  // one rank: the program is the lowered one
  if (world != P.ep * P.esp) return ir_error(ctx->d, "parallelize: dp*mp != ep*esp");
  // The cluster must hold the ranks, and MP and ESP groups (consecutive ranks) stay in a node.
  int64_t nodes = ir_mod_int(m, "nodes", 0), per_node = ir_mod_int(m, "gpus_per_node", world);
  if (nodes > 0 && world > nodes * per_node)
    return ir_error(ctx->d, "the layout needs %lld ranks but the cluster has %lld (%lld node%s x %lld gpus_per_node)",
                    (long long)world, (long long)(nodes * per_node), (long long)nodes, nodes == 1 ? "" : "s",
                    (long long)per_node);
  if (world > per_node && (per_node % P.mp != 0 || per_node % P.esp != 0))
    return ir_error(ctx->d, "mp %lld and esp %lld must divide gpus_per_node %lld: their groups are consecutive ranks "
                    "inside a node", (long long)P.mp, (long long)P.esp, (long long)per_node);

  bool vp = P.mp > 1 && ir_mod_int(m, "vocab_parallel", 0);   // the vocabulary split too (vocab_split)
  if (vp) mark_vocab(m);
  // Parameters: expert shards and gradient reductions.
  for (int i = 0; i < m->nparams; i++) {
    IrParam *p = m->params[i];
    int64_t split = ir_attr_int(p->attrs, p->nattrs, "mp_split", -1);
    if (P.mp > 1 && split >= 0) {   // a language model's head- or column-split projection
      p->type.dim[split] /= P.mp;
      ir_attrs_set_int(p->attrs, &p->nattrs, "shard_mp", split);
    }
    if (!is_expert_param(p)) {
      // A language model's dense parameters see the same tokens on every MP rank: DP only; but
      // a weight all heads share (mp_partial: qk_norm head's) sees only the rank's heads there.
      bool dense = ir_attr_int(p->attrs, p->nattrs, "dense", 0) && !ir_attr_int(p->attrs, p->nattrs, "mp_partial", 0);
      if (!dense || P.dp > 1) ir_attrs_set_str(m, p->attrs, &p->nattrs, "grad_reduce", dense ? "dp" : "world");
      continue;
    }
    int64_t ed = ir_attr_int(p->attrs, p->nattrs, "shard_expert", 0);
    int64_t hd = ir_attr_int(p->attrs, p->nattrs, "shard_hidden", -1);
    if (P.ep > 1) {
      p->type.dim[ed] /= P.ep;
      ir_attrs_set_int(p->attrs, &p->nattrs, "shard_ep", ed);
    }
    if (P.esp > 1 && hd >= 0) {
      p->type.dim[hd] /= P.esp;
      ir_attrs_set_int(p->attrs, &p->nattrs, "shard_esp", hd);
    } else if (P.esp > 1) {
      ir_attrs_set_str(m, p->attrs, &p->nattrs, "grad_reduce", "esp");
    }
  }

  for (int i = 0; i < m->nfuncs; i++) {
    IrFunc *f = m->funcs[i];
    P.f = f;
    if (f->role == IR_ROLE_LOSS_FWD) {
      for (int j = 0; j < f->nops; j++)
        if (f->ops[j]->kind == IR_OP_LOSS_MSE || f->ops[j]->kind == IR_OP_LOSS_XENT)
          ir_op_set_float(f->ops[j], "scale", 1.0 / (double)P.dp);
      if (vp && !vocab_split(&P)) return false;
      continue;
    }
    if (f->role != IR_ROLE_LAYER_FWD) continue;
    if (vp && !vocab_split(&P)) return false;
    bool heads = P.mp > 1 && split_heads(&P);
    bool moe = false;   // a language model's embedding and mlp layers have no MoE
    for (int j = 0; j < f->nops; j++) moe |= pass_op_of_experts(f->ops[j]);
    if (!moe) {
      if (heads && !retype(&P)) return false;
      continue;
    }
    const char *algo = "nccl";
    for (int j = 0; j < f->nops; j++)
      for (int a = 0; a < f->ops[j]->nargs; a++)
        if (is_expert_param(f->ops[j]->args[a].param))
          algo = ir_attr_str(f->ops[j]->args[a].param->attrs, f->ops[j]->args[a].param->nattrs, "dispatch", algo);
    for (int j = 0; j < f->nops; j++) {
      IrOp *op = f->ops[j];
      if (op->kind == IR_OP_GATE_AUX_LOSS || op->kind == IR_OP_GATE_Z_LOSS) ir_op_set_int(op, "share", world);
    }
    if (P.mp > 1 && !split_tokens(&P)) return false;
    if (P.ep * P.esp > 1 && !shard_experts(&P, algo)) return false;
    if (!retype(&P)) return false;
  }
  if (ctx->verbose) print_groups(ctx->log ? ctx->log : stderr, &P, ir_mod_int(m, "gpus_per_node", world));
  return true;
}
