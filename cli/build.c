// moec check, dump-ir and build: the options they share, the front end (read, parse, check, the
// cluster profile, lowering with the refusals of the target), the pass pipeline, and for build
// the target's emitter and link step. Targets are the structs of codegen/cg.h, chosen by name
// from the table below; --target auto takes the first whose device is visible.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "cli/options.h"
#include "cli/plan.h"
#include "codegen/cg.h"
#include "frontend/fe.h"
#include "ir/ir.h"
#include "passes/pass.h"

// Every target, the default first. Adding a target: its struct (codegen/target_NAME.c) here.
static const CgTarget *const targets[] = {&cg_target_cpu, &cg_target_cuda};
enum { NTARGETS = sizeof targets / sizeof targets[0] };

static const CgTarget *find_target(const char *name) {
  for (int i = 0; i < NTARGETS; i++)
    if (strcmp(targets[i]->name, name) == 0) return targets[i];
  return NULL;
}

void cli_check_usage(FILE *out) {
  fprintf(out,
          "usage: moec check F.moe\n"
          "\n"
          "Parses and checks a model and reports every error (file:line:col, the line, a caret).\n"
          "Exit status 0 when the model is valid, 1 when it has errors.\n");
}

void cli_dump_ir_usage(FILE *out) {
  fprintf(out,
          "usage: moec dump-ir F.moe [--after=PASS | --all] [--dot [--func NAME]] [--cluster C] [--stage N] [-v]\n"
          "       moec dump-ir F.ir [--dot [--func NAME]]\n"
          "\n"
          "Prints the IR of a model after all passes, or reads IR text back, verifies it and prints it.\n"
          "\n"
          "  --after=PASS      after one pass (lower: before any pass; 'moec passes' lists them)\n"
          "  --all             after every pass, each headed by its name\n"
          "  --dot             a Graphviz graph instead of text (dot -Tsvg draws it): ops coloured by\n"
          "                    stream, collectives as hexagons, events dashed, fused groups boxed;\n"
          "                    every function, each in a box of its own\n"
          "  --func NAME       with --dot: only function NAME (block0.fwd, loss.fwd, optimizer, ...)\n"
          "  --cluster C       cluster profile (overrides the model's 'cluster' statement)\n"
          "  --stage N         the program of pipeline stage N (a model with 'pp'; default 0)\n"
          "  -v                also report what the passes decided\n");
}

void cli_build_usage(FILE *out) {
  fprintf(out,
          "usage: moec build F.moe [-o BIN] [-v] [--target cpu|cuda|auto] [--gpu-arch sm_NN]\n"
          "                  [--cluster C] [--layout D,M,E,S[,ALGO][,pp=P][,microbatches=M]] [--emit c|cuda] [--keep-c F.c]\n"
          "                  [--no-fuse] [--stage N]\n"
          "\n"
          "Compiles a model into a training binary (BIN --help says what the binary can do).\n"
          "\n"
          "  -o BIN            output (default: the model file's name without .moe)\n"
          "  -v                report what the passes decided: memory plan, pipeline degrees,\n"
          "                    gradient slots, the link line\n"
          "  --target T        cpu (default): C kernels, OpenBLAS and MPI; cuda: one GPU per rank\n"
          "                    (NVRTC kernels, cuBLAS, NCCL); auto: cuda where a GPU is visible\n"
          "  --gpu-arch sm_NN  architecture of the CUDA kernels (default sm_90; PTX rides along)\n"
          "  --cluster C       cluster profile for the planner (overrides the model's 'cluster')\n"
          "  --layout D,M,E,S[,ALGO][,pp=P][,microbatches=M]  build this parallel layout (dp, mp, ep, esp,\n"
          "                    the EP AlltoAll nccl, 1dh or 2dh, the stages and microbatches) instead\n"
          "                    of the model's 'parallel'\n"
          "  --emit c          write the generated C program (of the target) to -o or stdout\n"
          "  --emit cuda       write the generated CUDA kernels (for NVRTC) to -o or stdout\n"
          "  --keep-c F.c      also keep the generated C program as F.c\n"
          "  --stage N         with --emit c: the program of pipeline stage N (a model with 'pp')\n"
          "  --no-fuse         the program op by op (no fuse pass; CUDA: no fused gate kernel, no\n"
          "                    split reductions, an update launch per parameter), for comparison\n");
}

typedef struct Options {
  const char *input, *output, *after, *emit, *keep_c, *cluster, *target, *gpu_arch, *layout, *stage_arg, *func;
  bool all, verbose, no_fuse, dot;
  int stage;   // the pipeline stage lowered (--stage N for dump-ir and --emit c; the build: each)
  const int64_t *pp_split;   // the stages' layers the first front end chose (build_stages); NULL: choose
} Options;

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

// Parses options after the command; false on a usage error (already reported).
static bool parse_options(int argc, char **argv, Options *o) {
  const CliOpt opts[] = {
      {"-o", NULL, false, &o->output},          {"--emit", NULL, false, &o->emit},
      {"--keep-c", NULL, false, &o->keep_c},    {"--cluster", NULL, false, &o->cluster},
      {"--target", NULL, false, &o->target},    {"--gpu-arch", NULL, false, &o->gpu_arch},
      {"--layout", NULL, false, &o->layout},    {"--gpu-arch=", NULL, false, &o->gpu_arch},
      {"--after=", NULL, false, &o->after},     {"--target=", NULL, false, &o->target},
      {"--emit=", NULL, false, &o->emit},       {"--all", NULL, true, &o->all},
      {"-v", "--verbose", true, &o->verbose},   {"--no-fuse", NULL, true, &o->no_fuse},
      {"--stage", NULL, false, &o->stage_arg},  {"--dot", NULL, true, &o->dot},
      {"--func", NULL, false, &o->func},        {"--func=", NULL, false, &o->func},
  };
  char for_what[64], help[64];
  snprintf(for_what, sizeof for_what, "'moec %s'", argv[1]);
  snprintf(help, sizeof help, "moec %s", argv[1]);
  CliArgs args = {.for_what = for_what, .help = help, .positional = &o->input, .second = "more than one input file",
                  .dash_is_positional = true, .opts = opts, .nopts = sizeof opts / sizeof opts[0]};
  if (!cli_parse_args(&args, argc, argv)) return false;
  if (!o->input) {
    fprintf(stderr, "moec: error: no input file (see 'moec --help')\n");
    return false;
  }
  if (o->stage_arg) {
    char *end = NULL;
    long v = strtol(o->stage_arg, &end, 10);
    if (!*o->stage_arg || *end || v < 0 || v > 1000) {
      fprintf(stderr, "moec: error: --stage takes a pipeline stage's number (0 for the first), not '%s'\n", o->stage_arg);
      return false;
    }
    o->stage = (int)v;
  }
  if (o->func && !o->dot) {
    fprintf(stderr, "moec: error: --func picks the function of a --dot graph; add --dot\n");
    return false;
  }
  if (o->dot && o->all) {
    fprintf(stderr, "moec: error: --dot draws the IR after one pass; use --after=PASS, not --all\n");
    return false;
  }
  if (o->after && !pass_known(o->after)) {
    fprintf(stderr, "moec: error: unknown pass '%s' for --after (see 'moec passes')\n", o->after);
    return false;
  }
  if (o->emit && strcmp(o->emit, "c") != 0 && strcmp(o->emit, "cuda") != 0) {
    fprintf(stderr, "moec: error: --emit takes 'c' or 'cuda'\n");
    return false;
  }
  if (o->target && strcmp(o->target, "auto") != 0 && !find_target(o->target)) {
    fprintf(stderr, "moec: error: unknown target '%s' (", o->target);
    for (int i = 0; i < NTARGETS; i++) fprintf(stderr, "%s%s", i ? ", " : "", targets[i]->name);
    fprintf(stderr, " or auto)\n");
    return false;
  }
  if (o->gpu_arch) {
    const char *digits = strncmp(o->gpu_arch, "sm_", 3) == 0 ? o->gpu_arch + 3 : "";
    if (!*digits || strspn(digits, "0123456789") != strlen(digits) || atoi(digits) < 50) {
      fprintf(stderr, "moec: error: --gpu-arch takes an architecture like sm_80 or sm_90, not '%s'\n", o->gpu_arch);
      return false;
    }
    const CgTarget *t = o->target ? find_target(o->target) : NULL;
    if (t && !t->takes_arch) {
      fprintf(stderr, "moec: error: --gpu-arch is for --target cuda (or auto), not --target %s\n", t->name);
      return false;
    }
  }
  return true;
}

// The cluster profile the passes price with (cli_cluster_from_fe converts the front end's form).
typedef struct Cluster {
  bool have;
  SchedCluster sc;
  char name[128];
  // The Hugging Face family of the program (frontend/hf.c): what its --export-hf writes, or
  // hf.config NULL and why not.
  FeHfExport hf;
  char hf_why[512];
  char layout_note[512];   // how the layout was chosen (parallel auto, --layout), "" when written
  char layout_spec[64];    // the layout parallel auto chose, as --layout takes it ("" otherwise)
  int64_t memory;          // the profile's `memory`: bytes a rank may use (0: no limit known)
  int stages;              // the model's pipeline stages (1: none)
  int64_t pp_split[FE_MAX_STAGES];   // with stages: the layer instances of each (written or chosen)
  char split_note[512];    // how they were chosen ("" when pp_layers writes them)
  char stage_layers[256];  // the stage lowered's layers (cli_stage_layers)
} Cluster;

// Front end: read, parse, check, load the cluster profile, lower (with the refusals of target).
// NULL on error.
static IrModule *front_end(IrDiag *d, const Options *o, const FeTargetCaps *target, IrSource **src_out, Cluster *cl) {
  IrSource *src = ir_source_read(d, o->input);
  *src_out = src;
  *cl = (Cluster){0};
  if (!src) return NULL;
  FeProgram *p = fe_load(d, src);
  if (!p) return NULL;
  FeCluster cluster;
  bool ok = true, have_cluster = o->cluster || p->cluster_path;
  if (o->cluster) ok = fe_load_cluster(d, o->cluster, (SrcLoc){0}, &cluster);
  else if (p->cluster_path) ok = fe_load_cluster(d, p->cluster_path, p->cluster_loc, &cluster);
  if (ok && have_cluster) {
    cli_cluster_from_fe(&cluster, &cl->sc);
    snprintf(cl->name, sizeof cl->name, "%s", cluster.name ? cluster.name : "cluster");
    cl->sc.name = cl->name;
    cl->have = true;
    cl->memory = cluster.memory;
  }
  // `parallel auto;` (or --layout): the layout is chosen before lowering (cli/layout.c).
  ok = ok && cli_resolve_layout(d, p, have_cluster ? &cluster : NULL, o->layout, o->verbose, cl->layout_note,
                                sizeof cl->layout_note, cl->layout_spec, sizeof cl->layout_spec);
  if (ok && o->stage >= (p->parallel.pp > 1 ? p->parallel.pp : 1)) {
    ir_error(d, "--stage %d: model '%s' has %lld pipeline stage%s (0 .. %lld)", o->stage, p->model.name,
             (long long)p->parallel.pp, p->parallel.pp == 1 ? "" : "s", (long long)p->parallel.pp - 1);
    ok = false;
  }
  p->stage = o->stage;
  cl->stages = p->parallel.pp > 1 ? (int)p->parallel.pp : 1;
  // The stages' layers: pp_layers as written, the split the first stage's front end chose, or the
  // cost model's (cli/stages.c).
  if (ok && cl->stages > 1 && p->parallel.npp_layers != p->parallel.pp) {
    if (o->pp_split) {
      memcpy(p->parallel.pp_layers, o->pp_split, (size_t)cl->stages * sizeof *o->pp_split);
      p->parallel.npp_layers = cl->stages;
    } else {
      ok = cli_stage_split(d, p, have_cluster ? &cluster : NULL, cl->split_note, sizeof cl->split_note);
    }
  }
  if (ok && cl->stages > 1) {
    for (int s = 0; s < cl->stages; s++) {
      int64_t first;
      fe_stage_layers(p, s, &first, &cl->pp_split[s]);
    }
    cli_stage_layers(p, o->stage, cl->stage_layers, sizeof cl->stage_layers);
  }
  IrModule *m = ok ? fe_lower(d, p, target) : NULL;
  if (ok && !have_cluster && p->schedule.pipeline_auto) {
    ir_error_at(d, p->schedule.pipeline_loc,
                "'pipeline auto' plans the degrees with a cluster profile: add 'cluster \"FILE\";' to the model "
                "or pass --cluster FILE (lang/clusters has some)");
    ir_module_free(m);
    m = NULL;
  }
  if (m && !fe_hf_export(d, p, &cl->hf, cl->hf_why, sizeof cl->hf_why) && !cl->hf_why[0]) {
    ir_module_free(m);   // its hf_config folder could not be read
    m = NULL;
  }
  int64_t world = p->parallel.dp * p->parallel.mp;
  if (m && (world > 1 || p->parallel.pp > 1)) {  // where the ranks sit: the cluster profile, or one node
    ir_attrs_set_int(m->attrs, &m->nattrs, "gpus_per_node", have_cluster ? cluster.gpus_per_node : world);
    ir_attrs_set_int(m->attrs, &m->nattrs, "nodes", have_cluster ? cluster.nodes : 0);
  }
  fe_program_free(p);
  return m;
}

static int cmd_check(IrDiag *d, const Options *o) {
  IrSource *src = ir_source_read(d, o->input);
  if (!src) return 1;
  FeProgram *p = fe_load(d, src);
  bool ok = p != NULL;
  if (p && p->cluster_path) {
    FeCluster c;
    ok = fe_load_cluster(d, p->cluster_path, p->cluster_loc, &c);
  }
  fe_program_free(p);
  ir_source_free(src);
  return ok && d->errors == 0 ? 0 : 1;
}

// The module as text, or with --dot as a Graphviz graph of every function or of --func's (an
// unknown name is an error that lists the module's functions). after: the pass it is after.
static int print_ir(const IrModule *m, const Options *o, const char *after) {
  if (!o->dot) {
    ir_print(stdout, m);
    return 0;
  }
  const IrFunc *only = NULL;
  if (o->func) {
    only = ir_find_func(m, o->func[0] == '@' ? o->func + 1 : o->func);
    if (!only) {
      fprintf(stderr, "moec: error: --func '%s': module '%s' has no such function; it has", o->func, m->name);
      for (int i = 0; i < m->nfuncs; i++) fprintf(stderr, "%s @%s", i ? "," : "", m->funcs[i]->name);
      fputc('\n', stderr);
      return 1;
    }
  }
  char note[96];
  snprintf(note, sizeof note, "%s%s", after ? "after " : "", after ? after : "as read");
  if (!ir_print_dot(stdout, m, only, note)) {
    fprintf(stderr, "moec: error: could not write the graph\n");
    return 1;
  }
  return 0;
}

static int cmd_dump_ir(IrDiag *d, const Options *o) {
  IrSource *src = NULL;
  int status = 1;
  if (ends_with(o->input, ".ir")) {
    if (o->after || o->all) {
      fprintf(stderr, "moec: error: --after and --all apply to .moe inputs; an .ir file is printed as read\n");
      return 2;
    }
    src = ir_source_read(d, o->input);
    IrModule *m = src ? ir_parse(d, src) : NULL;
    if (m && ir_verify(d, m)) status = print_ir(m, o, NULL);
    ir_module_free(m);
    ir_source_free(src);
    return status;
  }
  Cluster cl;
  IrModule *m = front_end(d, o, NULL, &src, &cl);   // the IR does not depend on the target
  if (m) {
    PassCtx ctx = {.d = d, .verbose = o->verbose, .log = stderr, .dump_out = stdout, .dump_all = o->all,
                   .cluster = cl.have ? &cl.sc : NULL,
                   .fuse = !o->no_fuse, .fuse_cpu = !o->target || strcmp(o->target, "cuda") != 0};
    const char *after = o->all ? NULL : (o->after ? o->after : pass_list[pass_count - 1].name);
    ctx.dump_after = o->dot ? NULL : after;   // --dot: the graph of the module where the pipeline stops
    ctx.stop_after = after;
    if (pass_run_pipeline(m, &ctx)) status = o->dot ? print_ir(m, o, after) : 0;
    pass_ctx_free(&ctx);
  }
  fe_hf_export_free(&cl.hf);
  ir_module_free(m);
  ir_source_free(src);
  return status;
}

static char *default_output(const char *input) {
  const char *base = strrchr(input, '/');
  base = base ? base + 1 : input;
  size_t n = strlen(base);
  if (ends_with(base, ".moe")) n -= 4;
  char *out = malloc(n + 2);
  if (!out) return NULL;
  memcpy(out, base, n);
  out[n] = '\0';
  if (n == 0) strcpy(out, "a");
  return out;
}

// The target of a build: --target as given (cpu by default), or for auto the first target
// whose device is visible and that this moec can build for (said, with the reason). arch: the
// device architecture kernels are compiled for: --gpu-arch, else with auto the visible device's
// own, else sm_90.
static const CgTarget *resolve_target(const Options *o, char *arch, size_t arch_size) {
  snprintf(arch, arch_size, "%s", o->gpu_arch ? o->gpu_arch : "sm_90");
  if (o->target && strcmp(o->target, "auto") != 0) {
    const CgTarget *t = find_target(o->target);
    if (o->verbose) fprintf(stderr, "# target: %s (--target %s)%s%s\n", t->name, t->name, t->takes_arch ? ", kernels for " : "", t->takes_arch ? arch : "");
    return t;
  }
  if (!o->target) {
    if (o->verbose) fprintf(stderr, "# target: %s (the default; --target auto picks cuda where a GPU is visible)\n", targets[0]->name);
    return targets[0];
  }
  for (int i = 0; i < NTARGETS; i++) {
    const CgTarget *t = targets[i];
    char why[512], seen[32] = "", missing[512];
    if (!t->probe) continue;
    if (!t->probe(why, sizeof why, seen, sizeof seen)) {
      fprintf(stderr, "# target: auto -> %s (no GPU: %s)\n", targets[0]->name, why);
      continue;
    }
    if (!t->available(missing, sizeof missing)) {
      fprintf(stderr, "# target: auto -> %s (a GPU is visible, %s, but this moec was built without the CUDA toolkit)\n",
              targets[0]->name, why);
      continue;
    }
    if (!o->gpu_arch && seen[0]) snprintf(arch, arch_size, "%s", seen);
    fprintf(stderr, "# target: auto -> %s (a GPU is visible: %s%s%s), kernels for %s\n", t->name, why, seen[0] ? ", " : "",
            seen, arch);
    return t;
  }
  return targets[0];
}

// Writes the target's program for m to out.
static bool emit_program(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const Options *o,
                         const CgTarget *target, const char *arch, const Cluster *cl, const char *path) {
  CgEmitOptions eo = {.source_name = o->input, .arch = target->takes_arch ? arch : NULL, .verbose = o->verbose,
                      .hf_config = cl->hf.config, .hf_refusal = cl->hf.config ? NULL : cl->hf_why,
                      .hf_generation = cl->hf.generation, .hf_changes = cl->hf.changes, .hf_adapter = cl->hf.adapter,
                      .layout_note = cl->layout_note[0] ? cl->layout_note : NULL, .program_path = path};
  return target->emit(d, out, m, plan, &eo);
}

// ---- the profile's memory, honoured (lang/manual.md §12, "Memory") ----

// What a build may change to fit `memory` (module attribute attr set to value): the sharded
// optimizer (a ReduceScatter where an AllReduce was, then an AllGather of the updated rows) and
// recomputation (the activations, then the norms' outputs too, then whole layers but their
// collectives, made again in the backward), all of them the same bits as the program as written;
// and, when those are not enough, a language model's vocabulary split over MP, whose head and
// loss add their sums in another order (inexact: losses equal to about 1e-6, not to the bit).
typedef struct MemoryChoice {
  const char *attr;
  int value;
  const char *what;
  bool inexact;
} MemoryChoice;
static const MemoryChoice memory_choices[] = {
    {"shard_optimizer", 1, "'optimizer adamw { shard true; }' (AdamW's moments sharded over each parameter's replicas)"},
    {"recompute", 1, "'recompute activations;' (the activations computed again in the backward)"},
    {"recompute", 2, "'recompute norms;' (the activations and the norms' outputs computed again in the backward)"},
    {"recompute", 3, "'recompute layers;' (every op of a layer but its collectives and routing computed again in the backward)"},
    {"vocab_parallel", 1, "'vocab_parallel true;' (the embedding, the head and the loss split over MP; their sums in "
                          "another order: losses equal to about 1e-6, not to the bit)", true},
};
enum { NCHOICES = sizeof memory_choices / sizeof memory_choices[0] };

static bool choice_applies(const MemoryChoice *c, const IrModule *m, const FeTargetCaps *caps) {
  if (strcmp(c->attr, "shard_optimizer") == 0)
    return caps->shard_optimizer && strcmp(ir_mod_str(m, "optimizer", "sgd"), "adamw") == 0 &&
           !ir_mod_int(m, "shard_optimizer", 0) && ir_mod_int(m, "dp", 1) * ir_mod_int(m, "mp", 1) > 1;
  if (strcmp(c->attr, "vocab_parallel") == 0) {
    int64_t mp = ir_mod_int(m, "mp", 1), vocab = ir_mod_int(m, "vocab", 0);
    if (mp < 2 || vocab <= 0 || vocab % mp != 0) return false;
  }
  return ir_mod_int(m, c->attr, 0) < c->value;
}

// A build of the program with memory choices: its module, the source its locations point into,
// the pass context holding its memory plan.
typedef struct Built {
  IrModule *m;
  IrSource *src;
  PassCtx ctx;
} Built;

static void built_free(Built *b) {
  ir_module_free(b->m);
  pass_ctx_free(&b->ctx);
  ir_source_free(b->src);
  *b = (Built){0};
}

static double built_step(const Built *b) { return ir_mod_float(b->m, "t_iter_pred", 0); }
static int64_t built_peak(const Built *b) { return pass_mem_peak(b->ctx.memplan); }

// The program built again (front end with the layout already chosen, every pass) with the choices
// in set, `recompute layers` in the first `upto` layers only when upto > 0; false when that failed
// (reported).
static bool rebuild(IrDiag *d, const Options *o, const FeTargetCaps *caps, const bool *set, int64_t upto,
                    const PassCtx *like, Built *out) {
  Cluster again;
  *out = (Built){0};
  IrModule *m = front_end(d, o, caps, &out->src, &again);
  fe_hf_export_free(&again.hf);
  out->ctx = *like;
  out->ctx.verbose = false;
  out->ctx.memplan = NULL;
  for (int k = 0; m && k < NCHOICES; k++) {
    const MemoryChoice *c = &memory_choices[k];
    if (set[k] && ir_mod_int(m, c->attr, 0) < c->value) ir_attrs_set_int(m->attrs, &m->nattrs, c->attr, c->value);
  }
  if (m && upto > 0) ir_attrs_set_int(m->attrs, &m->nattrs, "recompute_layers", upto);
  if (m && o->no_fuse) ir_attrs_set_int(m->attrs, &m->nattrs, "no_fuse", 1);
  out->m = m;
  if (m && pass_run_pipeline(m, &out->ctx)) return true;
  built_free(out);
  return false;
}

// `recompute layers` fits: the fewest first layers that still fit (bisection; each layer left
// out saves its GEMMs' second run). *b becomes that build; *upto its count (0: every layer).
static bool fewest_layers(IrDiag *d, const Options *o, const FeTargetCaps *caps, const bool *set, const PassCtx *like,
                          int64_t limit, Built *b, int64_t *upto, int64_t *layers) {
  *layers = 0;
  for (int i = 0; i < b->m->nfuncs; i++) *layers += b->m->funcs[i]->role == IR_ROLE_LAYER_BWD;
  int64_t lo = 1, hi = *layers;   // hi: the fewest known to fit
  *upto = 0;
  while (lo < hi) {
    int64_t mid = (lo + hi) / 2;
    Built t;
    if (!rebuild(d, o, caps, set, mid, like, &t)) return false;
    if (built_peak(&t) <= limit) {
      built_free(b);
      *b = t;
      hi = *upto = mid;
    } else {
      built_free(&t);
      lo = mid + 1;
    }
  }
  return true;
}

// When the memory plan's peak per rank exceeds the profile's memory, applies the choices that
// apply, each round the one whose build the cost model prices fastest (ties: one that fits, then
// the one listed first; the inexact one only when no exact one is left), `recompute layers` in
// the fewest first layers that fit, until the program fits (*m and *ctx are then that build's),
// saying each choice, its peak and the planned step. False (an error with the smallest peak
// reached and what would fit) when nothing does.
static bool fit_memory(IrDiag *d, const Options *o, const FeTargetCaps *caps, Cluster *cl, IrModule **m, PassCtx *ctx,
                       IrSource **src) {
  if (!cl->have || cl->memory <= 0) return true;
  int64_t peak = pass_mem_peak(ctx->memplan), limit = cl->memory;
  char a[32], b[32], c[32];
  if (peak <= limit) {
    if (o->verbose)
      fprintf(stderr, "# memory: peak %s per rank, within the memory of cluster '%s' (%s)\n",
              ir_bytes(a, sizeof a, (double)peak), cl->name, ir_bytes(b, sizeof b, (double)limit));
    return true;
  }
  // `parallel auto;` chose the layout (the search priced these choices too): the builds below take it
  // as chosen, without searching again.
  Options again_o = *o;
  if (cl->layout_spec[0]) again_o.layout = cl->layout_spec;
  bool set[NCHOICES] = {false};
  int64_t chosen_upto = 0;   // `recompute layers` in the first chosen_upto layers (0: all)
  while (peak > limit) {
    int best = -1;
    Built best_b = {0};
    double t0 = ir_mod_float(*m, "t_iter_pred", 0);
    // The exact choices first: an inexact one only when none of them is left.
    bool exact_left = false;
    for (int k = 0; k < NCHOICES; k++)
      exact_left |= !set[k] && !memory_choices[k].inexact && choice_applies(&memory_choices[k], *m, caps);
    for (int k = 0; k < NCHOICES; k++) {
      if (set[k] || (exact_left && memory_choices[k].inexact) || !choice_applies(&memory_choices[k], *m, caps)) continue;
      set[k] = true;
      Built t;
      bool built = rebuild(d, &again_o, caps, set, chosen_upto, ctx, &t);
      set[k] = false;
      if (!built) {
        built_free(&best_b);
        return false;
      }
      // The fastest; on a tie one that fits, then the one listed first (the smaller change).
      bool better = best < 0 || built_step(&t) < built_step(&best_b) ||
                    (built_step(&t) == built_step(&best_b) && built_peak(&t) <= limit && built_peak(&best_b) > limit);
      if (better) {
        built_free(&best_b);
        best = k, best_b = t;
      } else {
        built_free(&t);
      }
    }
    if (best < 0) break;
    set[best] = true;
    int64_t upto = 0, layers = 0;
    const MemoryChoice *ch = &memory_choices[best];
    if (strcmp(ch->attr, "recompute") == 0 && ch->value == 3 && built_peak(&best_b) <= limit &&
        !fewest_layers(d, &again_o, caps, set, ctx, limit, &best_b, &upto, &layers)) {
      built_free(&best_b);
      return false;
    }
    if (upto > 0) chosen_upto = upto;
    int64_t now = built_peak(&best_b);
    double best_t = built_step(&best_b);
    fprintf(stderr, "# memory: peak %s per rank, over the memory of cluster '%s' (%s): chose %s", ir_bytes(a, sizeof a, (double)peak),
            cl->name, ir_bytes(b, sizeof b, (double)limit), ch->what);
    if (upto > 0) fprintf(stderr, " in the first %lld of %lld layer functions", (long long)upto, (long long)layers);
    fprintf(stderr, ": peak %s", ir_bytes(c, sizeof c, (double)now));
    if (t0 > 0 && best_t > 0) fprintf(stderr, ", planned step %.2f -> %.2f ms (%+.1f %%)", t0, best_t, 100.0 * (best_t - t0) / t0);
    fprintf(stderr, "\n");
    ir_module_free(*m);
    pass_ctx_free(ctx);
    ir_source_free(*src);
    *m = best_b.m;
    *ctx = best_b.ctx;
    *src = best_b.src;
    ctx->verbose = o->verbose;
    peak = now;
    if (o->verbose)   // the plan the program is built with (the passes' own report was the first build's)
      fprintf(stderr, "# memplan: peak %s per rank (%lld bytes), with the memory choices\n", ir_bytes(a, sizeof a, (double)now),
              (long long)now);
  }
  if (peak <= limit) return true;
  const PassMemPlan *p = ctx->memplan;
  int64_t fixed = p->param_bytes + p->grad_bytes + p->optimizer_bytes + p->param16_bytes;
  char f[32];
  int64_t batch = ir_mod_int(*m, "batch", 1);
  int64_t fits = p->arena_bytes > 0 ? (int64_t)((double)batch * (double)(limit - fixed) / (double)p->arena_bytes) : batch;
  if (fixed >= limit || fits < 1) {
    ir_error(d,
             "the program does not fit: its smallest peak per rank is %s, over the memory of cluster '%s' (%s); its "
             "parameters, gradients and optimizer state take %s per rank and its activations %s at a batch of %lld%s: "
             "split them over more ranks (a larger mp, ep or esp)", ir_bytes(a, sizeof a, (double)peak), cl->name,
             ir_bytes(b, sizeof b, (double)limit), ir_bytes(f, sizeof f, (double)fixed),
             ir_bytes(c, sizeof c, (double)p->arena_bytes), (long long)batch,
             fixed < limit ? ", and a batch of 1 would not fit either" : "");
  } else {
    ir_error(d,
             "the program does not fit: its smallest peak per rank is %s, over the memory of cluster '%s' (%s; activations "
             "%s, parameters, gradients and optimizer state %s); the activations grow with the batch: a batch of "
             "about %lld per rank would fit, or more ranks (dp) for the same global batch",
             ir_bytes(a, sizeof a, (double)peak), cl->name, ir_bytes(b, sizeof b, (double)limit),
             ir_bytes(c, sizeof c, (double)p->arena_bytes), ir_bytes(f, sizeof f, (double)fixed), (long long)fits);
  }
  return false;
}

// What stage s's build reports (cli_pipe_report): its layers, planned times and peak with its
// microbatches in flight, each of which keeps an arena of its own (runtime/pipeline.c). False (an
// error) when that peak is over the profile's memory: fit_memory fitted one microbatch's.
static bool stage_built(IrDiag *d, const IrModule *m, const PassCtx *ctx, const Cluster *cl, int s, int stages,
                        CliStageBuilt *b) {
  int micro = (int)ir_mod_int(m, "microbatches", 1);
  bool gpipe = strcmp(ir_mod_str(m, "pp_schedule", "1f1b"), "gpipe") == 0;
  b->slots = sched_pipe_slots(stages, s, micro, gpipe);
  b->peak = pass_mem_peak(ctx->memplan) + (int64_t)(b->slots - 1) * ctx->memplan->arena_bytes;
  snprintf(b->layers, sizeof b->layers, "%s", cl->stage_layers);
  cli_module_times(m, &b->t_iter, &b->t_update, &b->t_local, &b->t_fwd);
  if (!cl->have || cl->memory <= 0 || b->peak <= cl->memory) return true;
  char a[32], c[32], e[32];
  return ir_error(d,
                  "stage %d does not fit: with %d microbatches in flight (%s) its peak is %s per rank, over the memory "
                  "of cluster '%s' (%s), each microbatch keeping %s of activations; fewer microbatches, 'pp_schedule "
                  "1f1b' (at most %d in flight on this stage) or more stages would lower it", s, b->slots,
                  gpipe ? "gpipe" : "1f1b", ir_bytes(a, sizeof a, (double)b->peak), cl->name,
                  ir_bytes(c, sizeof c, (double)cl->memory), ir_bytes(e, sizeof e, (double)ctx->memplan->arena_bytes),
                  stages - s);
}

// A model of several pipeline stages: each stage's program built like a whole model's (front end,
// passes, the memory it needs) into a C file of its own, and the main that runs a rank's stage.
// Every stage takes the layout and the split of its layers that the first front end chose (first:
// no second layout search, the same split); -v reports the stages, the bubble and the planned
// step (cli_pipe_report).
static int build_stages(IrDiag *d, const Options *o, const FeTargetCaps *caps, const CgTarget *target,
                        const char *arch, const Cluster *first) {
  int stages = first->stages;
  char paths[FE_MAX_STAGES + 1][64];
  const char *sources[FE_MAX_STAGES + 1] = {NULL};
  CliStageBuilt built[FE_MAX_STAGES];
  int made = 0, status = 1, micro = 1, ranks = 1;
  bool gpipe = false;
  double floats = 0;
  char *output = NULL;
  if (o->verbose && first->split_note[0]) fprintf(stderr, "# stages: %s\n", first->split_note);
  for (int s = 0; s < stages; s++) {
    Options os = *o;
    os.stage = s;
    os.pp_split = first->pp_split;
    if (first->layout_spec[0]) os.layout = first->layout_spec;
    IrSource *src = NULL;
    Cluster cl;
    if (o->verbose) fprintf(stderr, "# stage %d of %d\n", s, stages);
    IrModule *m = front_end(d, &os, caps, &src, &cl);
    if (m && o->no_fuse) ir_attrs_set_int(m->attrs, &m->nattrs, "no_fuse", 1);   // cg_cuda_lowering reads it
    snprintf(cl.layout_note, sizeof cl.layout_note, "%s", first->layout_note);
    PassCtx ctx = {.d = d, .verbose = o->verbose, .log = stderr, .cluster = cl.have ? &cl.sc : NULL,
                   .fuse = !o->no_fuse, .fuse_cpu = strcmp(target->name, "cuda") != 0};
    ctx.plan_step = cl.have;   // every stage's planned microbatch, for the pipeline's step
    ctx.after_pass = cli_local_hook, ctx.after_arg = cl.have ? &cl.sc : NULL;
    bool ok = m && pass_run_pipeline(m, &ctx) && fit_memory(d, &os, caps, &cl, &m, &ctx, &src);
    FILE *c = NULL;
    if (ok) {
      snprintf(paths[s], sizeof paths[s], "/tmp/moec-stage%d-XXXXXX.c", s);
      int fd = mkstemps(paths[s], 2);
      if (fd < 0 || !(c = fdopen(fd, "w"))) ok = ir_error(d, "cannot create a temporary file for the generated program");
      else sources[made++] = paths[s];
    }
    if (ok) {
      ok = emit_program(d, c, m, ctx.memplan, &os, target, arch, &cl, paths[s]);
      if (fclose(c) != 0) ok = ir_error(d, "cannot write '%s'", paths[s]);
      ok = ok && stage_built(d, m, &ctx, &cl, s, stages, &built[s]);
      micro = (int)ir_mod_int(m, "microbatches", 1);
      gpipe = strcmp(ir_mod_str(m, "pp_schedule", "1f1b"), "gpipe") == 0;
      ranks = (int)(ir_mod_int(m, "dp", 1) * ir_mod_int(m, "mp", 1));
      floats = (double)ir_mod_int(m, "batch", 1) * (double)ir_mod_int(m, "seqlen", 1) * (double)ir_mod_int(m, "embed", 1);
    }
    if (ok && o->verbose && s == stages - 1)
      cli_pipe_report(stderr, cl.have ? &cl.sc : NULL, built, stages, micro, gpipe, ranks, floats);
    fe_hf_export_free(&cl.hf);
    pass_ctx_free(&ctx);
    ir_module_free(m);
    ir_source_free(src);
    if (!ok) goto done;
  }
  {
    char main_c[] = "/tmp/moec-XXXXXX.c";
    int fd = mkstemps(main_c, 2);
    FILE *c = fd >= 0 ? fdopen(fd, "w") : NULL;
    if (!c) {
      ir_error(d, "cannot create a temporary file for the generated program");
      goto done;
    }
    const char *base = strrchr(o->input, '/');
    cg_emit_stages_main(c, base ? base + 1 : o->input, stages);
    bool ok = fclose(c) == 0;
    output = o->output ? strdup(o->output) : default_output(o->input);
    CgLinkExtra extra = {.cflags = "", .libs = "", .sources = sources};
    if (ok && output && (target->link_stages ? target->link_stages(d, main_c, sources, output, o->verbose)
                                             : cg_link_program(d, main_c, output, &extra, o->verbose))) {
      status = 0;
      if (o->verbose) fprintf(stderr, "# wrote %s\n", output);
    }
    if (o->keep_c) {   // the main and the stages' programs as F.c, F.stage0.c, ...
      char to[4200];
      rename(main_c, o->keep_c);
      for (int s = 0; s < made; s++) {
        size_t n = strlen(o->keep_c);
        int cut = n > 2 && strcmp(o->keep_c + n - 2, ".c") == 0 ? (int)n - 2 : (int)n;
        snprintf(to, sizeof to, "%.*s.stage%d.c", cut, o->keep_c, s);
        if (rename(paths[s], to) == 0) sources[s] = NULL;
      }
    } else {
      unlink(main_c);
    }
  }
done:
  for (int s = 0; s < made; s++)
    if (sources[s]) unlink(paths[s]);
  free(output);
  return status;
}

static int cmd_build(IrDiag *d, const Options *o) {
  IrSource *src = NULL;
  Cluster cl;
  // The target first: what the front end refuses depends on it (dtype bf16 runs on cuda only).
  bool cuda_unit = o->emit && strcmp(o->emit, "cuda") == 0;
  char arch[32] = "sm_90";
  const CgTarget *target = cuda_unit ? &cg_target_cuda : resolve_target(o, arch, sizeof arch);
  FeTargetCaps caps = {.name = target->name, .bf16 = target->bf16, .shard_optimizer = target->shard_optimizer,
                       .lora = target->lora};
  IrModule *m = front_end(d, o, &caps, &src, &cl);
  int status = 1;
  PassCtx ctx = {.d = d, .verbose = o->verbose, .log = stderr, .cluster = cl.have ? &cl.sc : NULL,
                 .fuse = !o->no_fuse, .fuse_cpu = strcmp(target->name, "cuda") != 0};
  char tmp[] = "/tmp/moec-XXXXXX.c";
  char *output = NULL;
  FILE *c = NULL;
  if (m && o->no_fuse) ir_attrs_set_int(m->attrs, &m->nattrs, "no_fuse", 1);   // cg_cuda_lowering reads it
  ctx.plan_step = cl.have && cl.memory > 0;   // fit_memory compares planned steps
  if (m && cl.stages > 1 && !o->emit) {   // one program per stage (--emit c writes --stage N's)
    status = build_stages(d, o, &caps, target, arch, &cl);
    goto done;
  }
  if (!m || !pass_run_pipeline(m, &ctx) || !fit_memory(d, o, &caps, &cl, &m, &ctx, &src)) goto done;

  if (o->emit) {  // --emit c: the program only; --emit cuda: the CUDA kernels only
    c = o->output ? fopen(o->output, "w") : stdout;
    if (!c) {
      ir_error(d, "cannot write '%s'", o->output);
      goto done;
    }
    bool ok;
    if (cuda_unit) {
      CgLaunches *ls = cg_cuda_launches(d, m);
      ok = ls && cg_emit_cuda(d, c, m, ls);
      cg_launches_free(ls);
    } else {
      ok = emit_program(d, c, m, ctx.memplan, o, target, arch, &cl, NULL);
    }
    if (c != stdout && fclose(c) != 0) ok = ir_error(d, "cannot write '%s'", o->output);
    c = NULL;
    status = ok ? 0 : 1;
    goto done;
  }
  const char *c_path = o->keep_c;
  if (!c_path) {
    int fd = mkstemps(tmp, 2);
    if (fd < 0 || !(c = fdopen(fd, "w"))) {
      ir_error(d, "cannot create a temporary file for the generated program");
      goto done;
    }
    c_path = tmp;
  } else if (!(c = fopen(c_path, "w"))) {
    ir_error(d, "cannot write '%s'", c_path);
    goto done;
  }
  bool ok = emit_program(d, c, m, ctx.memplan, o, target, arch, &cl, c_path);
  if (fclose(c) != 0) ok = ir_error(d, "cannot write '%s'", c_path);
  c = NULL;
  output = o->output ? strdup(o->output) : default_output(o->input);
  if (ok && output && target->link(d, c_path, output, o->verbose)) {
    status = 0;
    if (o->verbose) fprintf(stderr, "# wrote %s\n", output);
  }
  if (!o->keep_c) unlink(tmp);
done:
  free(output);
  fe_hf_export_free(&cl.hf);
  pass_ctx_free(&ctx);
  ir_module_free(m);
  ir_source_free(src);
  return status;
}

// check, dump-ir and build: their options (parse_options), then the command.
static int with_options(int argc, char **argv, int (*cmd)(IrDiag *d, const Options *o)) {
  Options o = {0};
  if (!parse_options(argc, argv, &o)) return 2;
  IrDiag d;
  ir_diag_init(&d, stderr);
  return cmd(&d, &o);
}

int cli_check(int argc, char **argv) { return with_options(argc, argv, cmd_check); }
int cli_dump_ir(int argc, char **argv) { return with_options(argc, argv, cmd_dump_ir); }
int cli_build(int argc, char **argv) { return with_options(argc, argv, cmd_build); }

