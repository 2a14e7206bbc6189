// moec, the command line: .moe -> checked program -> IR -> passes -> C -> model binary.
//
//   moec check F.moe                 parse and check only
//   moec dump-ir F.moe [--after=PASS | --all]
//   moec dump-ir F.ir                read IR text back, verify it, print it
//   moec build F.moe [-o BIN] [-v] [--emit c|cuda] [--keep-c F.c] [--cluster C] [--target T]
//                    [--gpu-arch sm_NN]
//   moec plan | sweep                the FSMoE schedule model (cli/plan.c)
//   mpirun -np P moec tune ...       profile a cluster, fit, write a .cluster (cli/tune.c)
//   moec ops | passes                the op table and the pass list
//
// Exit status: 0 success, 1 the input has errors (all reported), 2 bad command line.
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli/cli.h"
#include "codegen/cg.h"
#include "frontend/fe.h"
#include "ir/ir.h"
#include "passes/pass.h"

#define MOEC_VERSION "0.1.0"

static void usage(FILE *out) {
  fprintf(out,
          "usage: moec COMMAND [options]\n"
          "\n"
          "commands:\n"
          "  check F.moe               parse and check a model; report every error\n"
          "  dump-ir F.moe             print the IR after all passes\n"
          "      --after=PASS          ... after one pass (lower = before any pass; see 'moec passes')\n"
          "      --all                 ... after every pass\n"
          "  dump-ir F.ir              read IR text, verify it and print it again\n"
          "  build F.moe               compile a model into a training binary\n"
          "      -o BIN                output (default: the model file's name without .moe)\n"
          "      -v                    report what the passes decided (memory plan, ...)\n"
          "      --emit c              write the generated C program (of the target) to -o (or stdout) instead\n"
          "      --emit cuda           write the generated CUDA kernels (for NVRTC) to -o (or stdout)\n"
          "      --keep-c F.c          also keep the generated C program as F.c\n"
          "      --cluster C           cluster profile (overrides the model's 'cluster' statement)\n"
          "      --target cpu|cuda|auto  cpu (default): OpenBLAS and MPI; cuda: one GPU per rank (CUDA\n"
          "                            kernels, cuBLAS, NCCL); auto: cuda where a GPU is visible, else cpu\n"
          "      --gpu-arch sm_NN      the GPU architecture of the CUDA kernels (default sm_90; the PTX\n"
          "                            embedded beside them runs on newer GPUs)\n"
          "  plan F.moe [--cluster C] [--policy P|all] [--svg F] [--trace F] [--json F]\n"
          "                            the FSMoE schedule model: pipeline degrees, gradient partition,\n"
          "                            predicted times per policy, timelines (see 'moec plan --help')\n"
          "  sweep --cluster C [--quick]\n"
          "                            every policy over the paper's Table 4 space (Table 5 averages)\n"
          "  tune [-o F.cluster] [--quick] [--model F.moe] [--gpus-per-node G] [-v]\n"
          "                            under mpirun (P >= 2 ranks): time GEMMs and collectives, fit\n"
          "                            t = alpha + beta*n, write a cluster profile (see 'moec tune --help')\n"
          "  ops                       list the IR ops\n"
          "  passes                    list the passes in pipeline order\n"
          "  --help, --version [-v]    'moec COMMAND --help' for one command's options; --version -v\n"
          "                            also prints the configuration moec was built with\n"
          "\n"
          "The language manual is lang/manual.md; example models are in lang/models/.\n");
}

static void usage_check(FILE *out) {
  fprintf(out,
          "usage: moec check F.moe\n"
          "\n"
          "Parses and checks a model and reports every error (file:line:col, the line, a caret).\n"
          "Exit status 0 when the model is valid, 1 when it has errors.\n");
}

static void usage_dump_ir(FILE *out) {
  fprintf(out,
          "usage: moec dump-ir F.moe [--after=PASS | --all] [--cluster C] [-v]\n"
          "       moec dump-ir F.ir\n"
          "\n"
          "Prints the IR of a model after all passes, or reads IR text back, verifies it and prints it.\n"
          "\n"
          "  --after=PASS      after one pass (lower: before any pass; 'moec passes' lists them)\n"
          "  --all             after every pass, each headed by its name\n"
          "  --cluster C       cluster profile (overrides the model's 'cluster' statement)\n"
          "  -v                also report what the passes decided\n");
}

static void usage_build(FILE *out) {
  fprintf(out,
          "usage: moec build F.moe [-o BIN] [-v] [--target cpu|cuda|auto] [--gpu-arch sm_NN]\n"
          "                  [--cluster C] [--emit c|cuda] [--keep-c F.c]\n"
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
          "  --emit c          write the generated C program (of the target) to -o or stdout\n"
          "  --emit cuda       write the generated CUDA kernels (for NVRTC) to -o or stdout\n"
          "  --keep-c F.c      also keep the generated C program as F.c\n");
}

static void usage_ops(FILE *out) {
  fprintf(out, "usage: moec ops\n\nLists the IR ops: name, number of arguments and results, what each does.\n");
}

static void usage_passes(FILE *out) {
  fprintf(out, "usage: moec passes\n\nLists the passes in pipeline order (the names --after takes).\n");
}

// The configuration this moec was built with (build/config.mk, written by mk/configure.sh), as
// `key value` lines: the flags it compiles and links generated programs with. make test compares
// them with what mk/configure.sh finds on the machine now.
static void print_configuration(FILE *out) {
  cg_link_configuration(out);
#ifdef MOEC_NVRTC
  fprintf(out, "nvrtc yes\n");
#else
  fprintf(out, "nvrtc no\n");
#endif
}

typedef struct Options {
  const char *input, *output, *after, *emit, *keep_c, *cluster, *target, *gpu_arch;
  bool all, verbose;
} Options;

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), k = strlen(suffix);
  return n >= k && strcmp(s + n - k, suffix) == 0;
}

// Parses options after the command; false on a usage error (already reported).
static bool parse_options(int argc, char **argv, Options *o) {
  for (int i = 2; i < argc; i++) {
    const char *a = argv[i];
    const char **value = NULL;
    if (strcmp(a, "-o") == 0) value = &o->output;
    else if (strcmp(a, "--emit") == 0) value = &o->emit;
    else if (strcmp(a, "--keep-c") == 0) value = &o->keep_c;
    else if (strcmp(a, "--cluster") == 0) value = &o->cluster;
    else if (strcmp(a, "--target") == 0) value = &o->target;
    else if (strcmp(a, "--gpu-arch") == 0) value = &o->gpu_arch;
    else if (strncmp(a, "--gpu-arch=", 11) == 0) o->gpu_arch = a + 11;
    else if (strncmp(a, "--after=", 8) == 0) o->after = a + 8;
    else if (strncmp(a, "--target=", 9) == 0) o->target = a + 9;
    else if (strncmp(a, "--emit=", 7) == 0) o->emit = a + 7;
    else if (strcmp(a, "--all") == 0) o->all = true;
    else if (strcmp(a, "-v") == 0 || strcmp(a, "--verbose") == 0) o->verbose = true;
    else if (a[0] == '-' && a[1]) {
      fprintf(stderr, "moec: error: unknown option '%s' for 'moec %s' (see 'moec %s --help')\n", a, argv[1], argv[1]);
      return false;
    } else if (!o->input) o->input = a;
    else {
      fprintf(stderr, "moec: error: more than one input file ('%s' and '%s')\n", o->input, a);
      return false;
    }
    if (value) {
      if (++i >= argc) {
        fprintf(stderr, "moec: error: option '%s' needs a value\n", a);
        return false;
      }
      *value = argv[i];
    }
  }
  if (!o->input) {
    fprintf(stderr, "moec: error: no input file (see 'moec --help')\n");
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
  if (o->target && strcmp(o->target, "cpu") != 0 && strcmp(o->target, "cuda") != 0 && strcmp(o->target, "auto") != 0) {
    fprintf(stderr, "moec: error: unknown target '%s' (cpu, cuda or auto)\n", o->target);
    return false;
  }
  if (o->gpu_arch) {
    const char *digits = strncmp(o->gpu_arch, "sm_", 3) == 0 ? o->gpu_arch + 3 : "";
    if (!*digits || strspn(digits, "0123456789") != strlen(digits) || atoi(digits) < 50) {
      fprintf(stderr, "moec: error: --gpu-arch takes an architecture like sm_80 or sm_90, not '%s'\n", o->gpu_arch);
      return false;
    }
    if (o->target && strcmp(o->target, "cpu") == 0) {
      fprintf(stderr, "moec: error: --gpu-arch is for --target cuda (or auto), not --target cpu\n");
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
} Cluster;

// Front end: read, parse, check, load the cluster profile, lower (with the refusals of target).
// NULL on error.
static IrModule *front_end(IrDiag *d, const Options *o, FeTarget target, IrSource **src_out, Cluster *cl) {
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
  }
  IrModule *m = ok ? fe_lower(d, p, target) : NULL;
  if (ok && !have_cluster && p->schedule.pipeline_auto) {
    ir_error_at(d, p->schedule.pipeline_loc,
                "'pipeline auto' plans the degrees with a cluster profile: add 'cluster \"FILE\";' to the model "
                "or pass --cluster FILE (lang/clusters has some)");
    ir_module_free(m);
    m = NULL;
  }
  int64_t world = p->parallel.dp * p->parallel.mp;
  if (m && world > 1) {  // where the ranks sit: the cluster profile, or one node
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
    if (m && ir_verify(d, m)) {
      ir_print(stdout, m);
      status = 0;
    }
    ir_module_free(m);
    ir_source_free(src);
    return status;
  }
  Cluster cl;
  IrModule *m = front_end(d, o, FE_TARGET_ANY, &src, &cl);   // the IR does not depend on the target
  if (m) {
    PassCtx ctx = {.d = d, .verbose = o->verbose, .log = stderr, .dump_out = stdout, .dump_all = o->all,
                   .cluster = cl.have ? &cl.sc : NULL};
    ctx.dump_after = o->all ? NULL : (o->after ? o->after : pass_list[pass_count - 1].name);
    ctx.stop_after = o->all ? NULL : ctx.dump_after;
    if (pass_run_pipeline(m, &ctx)) status = 0;
    pass_ctx_free(&ctx);
  }
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

// ---- targets ----

#ifdef MOEC_NVRTC
#define HAVE_NVRTC true
// The model's kernels (cg_emit_cuda) compiled by NVRTC: the CUBIN for arch and the PTX of its
// virtual architecture. The images are malloc'd (freed by free_images).
static bool cuda_images(IrDiag *d, const IrModule *m, const PassMemPlan *plan, const char *arch, CgCudaImages *img) {
  char *src = NULL;
  size_t n = 0;
  FILE *f = open_memstream(&src, &n);
  if (!f) return ir_error(d, "out of memory");
  bool ok = cg_emit_cuda(d, f, m, plan);
  if (fclose(f) != 0) ok = ir_error(d, "out of memory");
  void *cubin = NULL;
  char *ptx = NULL;
  ok = ok && cg_nvrtc_compile(d, src, arch, &cubin, &img->cubin_size) && cg_nvrtc_ptx(d, src, arch, &ptx, &img->ptx_size);
  free(src);
  img->arch = arch;
  img->cubin = cubin;
  img->ptx = ptx;
  return ok;
}
#else
#define HAVE_NVRTC false
static bool cuda_images(IrDiag *d, const IrModule *m, const PassMemPlan *plan, const char *arch, CgCudaImages *img) {
  (void)m, (void)plan, (void)arch, (void)img;
  return ir_error(d, "this moec was built without NVRTC (make links it into build/moec only where it finds the CUDA "
                     "toolkit, CUDA=/usr/local/cuda by default), so it cannot compile the kernels of --target cuda; "
                     "use a moec built by 'make' where the toolkit is, or build with --target cpu");
}
#endif

static void free_images(CgCudaImages *img) {
  free((void *)img->cubin);
  free((void *)img->ptx);
}

// The target of a build: --target as given, auto decided here (and said, with the reason).
// arch: the GPU architecture the kernels are compiled for: --gpu-arch, else with auto the
// visible GPU's own, else sm_90.
static CgTarget resolve_target(const Options *o, char *arch, size_t arch_size) {
  snprintf(arch, arch_size, "%s", o->gpu_arch ? o->gpu_arch : "sm_90");
  const char *t = o->target ? o->target : "cpu";
  if (strcmp(t, "cuda") == 0) {
    if (o->verbose) fprintf(stderr, "# target: cuda (--target cuda), kernels for %s\n", arch);
    return CG_TARGET_CUDA;
  }
  if (strcmp(t, "cpu") == 0) {
    if (o->verbose) fprintf(stderr, "# target: cpu%s\n", o->target ? " (--target cpu)" : " (the default; --target auto picks cuda where a GPU is visible)");
    return CG_TARGET_CPU;
  }
  char why[512], seen[32];
  bool gpu = cg_gpu_probe(why, sizeof why, seen, sizeof seen);
  if (gpu && HAVE_NVRTC) {
    if (!o->gpu_arch && seen[0]) snprintf(arch, arch_size, "%s", seen);
    fprintf(stderr, "# target: auto -> cuda (a GPU is visible: %s%s%s), kernels for %s\n", why, seen[0] ? ", " : "",
            seen, arch);
    return CG_TARGET_CUDA;
  }
  if (gpu)
    fprintf(stderr, "# target: auto -> cpu (a GPU is visible, %s, but this moec was built without the CUDA toolkit)\n", why);
  else
    fprintf(stderr, "# target: auto -> cpu (no GPU: %s)\n", why);
  return CG_TARGET_CPU;
}

// Writes the host program of the target to out (the CUDA one compiles the kernels first).
static bool emit_program(IrDiag *d, FILE *out, const IrModule *m, const PassMemPlan *plan, const Options *o,
                         CgTarget target, const char *arch) {
  if (target == CG_TARGET_CPU) return cg_emit_c(d, out, m, plan, o->input);
  CgCudaImages img = {0};
  bool ok = cuda_images(d, m, plan, arch, &img);
  if (ok && o->verbose)
    fprintf(stderr, "# nvrtc: CUBIN for %s %zu bytes, PTX %zu bytes, embedded in the program\n", img.arch,
            img.cubin_size, img.ptx_size);
  ok = ok && cg_emit_cuda_host(d, out, m, plan, o->input, &img);
  free_images(&img);
  return ok;
}

static int cmd_build(IrDiag *d, const Options *o) {
  IrSource *src = NULL;
  Cluster cl;
  // The target first: what the front end refuses depends on it (dtype bf16 runs on cuda only).
  bool cuda_unit = o->emit && strcmp(o->emit, "cuda") == 0;
  char arch[32] = "sm_90";
  CgTarget target = cuda_unit ? CG_TARGET_CUDA : resolve_target(o, arch, sizeof arch);
  IrModule *m = front_end(d, o, target == CG_TARGET_CUDA ? FE_TARGET_CUDA : FE_TARGET_CPU, &src, &cl);
  int status = 1;
  PassCtx ctx = {.d = d, .verbose = o->verbose, .log = stderr, .cluster = cl.have ? &cl.sc : NULL};
  char tmp[] = "/tmp/moec-XXXXXX.c";
  char *output = NULL;
  FILE *c = NULL;
  if (!m || !pass_run_pipeline(m, &ctx)) goto done;

  if (o->emit) {  // --emit c: the program only; --emit cuda: the CUDA kernels only
    c = o->output ? fopen(o->output, "w") : stdout;
    if (!c) {
      ir_error(d, "cannot write '%s'", o->output);
      goto done;
    }
    bool ok = cuda_unit ? cg_emit_cuda(d, c, m, ctx.memplan) : emit_program(d, c, m, ctx.memplan, o, target, arch);
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
  bool ok = emit_program(d, c, m, ctx.memplan, o, target, arch);
  if (fclose(c) != 0) ok = ir_error(d, "cannot write '%s'", c_path);
  c = NULL;
  output = o->output ? strdup(o->output) : default_output(o->input);
  if (ok && output && cg_link(d, c_path, output, target, o->verbose)) {
    status = 0;
    if (o->verbose) fprintf(stderr, "# wrote %s\n", output);
  }
  if (!o->keep_c) unlink(tmp);
done:
  free(output);
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

static int run_check(int argc, char **argv) { return with_options(argc, argv, cmd_check); }
static int run_dump_ir(int argc, char **argv) { return with_options(argc, argv, cmd_dump_ir); }
static int run_build(int argc, char **argv) { return with_options(argc, argv, cmd_build); }

static int cmd_ops(int argc, char **argv) {
  (void)argc, (void)argv;
  for (int i = 0; i < IR_OP_COUNT; i++)
    printf("%-24s args %d  results %d  %s\n", ir_op_info[i].name, ir_op_info[i].nargs, ir_op_info[i].nres,
           ir_op_info[i].doc);
  return 0;
}

static int cmd_passes(int argc, char **argv) {
  (void)argc, (void)argv;
  for (int i = 0; i < pass_count; i++) printf("%-12s %s\n", pass_list[i].name, pass_list[i].doc);
  return 0;
}

// Every command: its usage (`moec COMMAND --help`) and what runs it, with main's argc/argv.
static const struct {
  const char *name;
  void (*usage)(FILE *out);
  int (*run)(int argc, char **argv);
} commands[] = {
    {"check", usage_check, run_check},   {"dump-ir", usage_dump_ir, run_dump_ir}, {"build", usage_build, run_build},
    {"plan", cli_plan_usage, cli_plan},  {"sweep", cli_sweep_usage, cli_sweep},   {"tune", cli_tune_usage, cli_tune},
    {"ops", usage_ops, cmd_ops},         {"passes", usage_passes, cmd_passes},
};
enum { NCOMMANDS = sizeof commands / sizeof commands[0] };

int main(int argc, char **argv) {
  if (argc < 2 || strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("moec %s\n", MOEC_VERSION);
    if (argc > 2 && (strcmp(argv[2], "-v") == 0 || strcmp(argv[2], "--verbose") == 0))
      print_configuration(stdout);
    return 0;
  }
  const char *cmd = argv[1];
  int c = 0;
  while (c < NCOMMANDS && strcmp(cmd, commands[c].name) != 0) c++;
  if (c == NCOMMANDS) {
    const char *names[NCOMMANDS];
    for (int i = 0; i < NCOMMANDS; i++) names[i] = commands[i].name;
    const char *near = ir_closest(cmd, names, NCOMMANDS);
    fprintf(stderr, "moec: error: unknown command '%s'%s%s%s (see 'moec --help')\n", cmd,
            near ? "; did you mean '" : "", near ? near : "", near ? "'?" : "");
    return 2;
  }
  for (int i = 2; i < argc; i++)
    if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
      commands[c].usage(stdout);
      return 0;
    }
  return commands[c].run(argc, argv);
}
