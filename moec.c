// moec, the command line: .moe -> checked program -> IR -> passes -> C -> model binary.
//
//   moec check F.moe                 parse and check only
//   moec dump-ir F.moe [--after=PASS | --all]
//   moec dump-ir F.ir                read IR text back, verify it, print it
//   moec dump-ir F.moe|F.ir --dot [--func NAME]   the IR as a Graphviz graph (ir/ir_dot.c)
//   moec build F.moe [-o BIN] [-v] [--emit c|cuda] [--keep-c F.c] [--cluster C] [--target T]
//                    [--gpu-arch sm_NN]
//   moec plan | sweep                the FSMoE schedule model (cli/plan.c, cli/sweep.c)
//   mpirun -np P moec tune ...       profile a cluster, fit, write a .cluster (cli/tune.c)
//   moec import-hf DIR -o PREFIX     a Hugging Face checkpoint as a model (cli/import_hf.c)
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
          "      --dot [--func NAME]   ... as a Graphviz graph (dot -Tsvg), of every function or one\n"
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
          "  tune [-o F.cluster] [--quick] [--model F.moe] [--gpus-per-node G] [-v] [--target cpu|cuda]\n"
          "                            under mpirun (P >= 2 ranks; P >= 1 GPUs with --target cuda): time\n"
          "                            GEMMs and collectives, fit t = alpha + beta*n, write a cluster\n"
          "                            profile (see 'moec tune --help')\n"
          "  import-hf DIR -o PREFIX   a Hugging Face checkpoint (mixtral) as PREFIX.moe and\n"
          "                            PREFIX.safetensors (see 'moec import-hf --help')\n"
          "  ops                       list the IR ops\n"
          "  passes                    list the passes in pipeline order\n"
          "  --help, --version [-v]    'moec COMMAND --help' for one command's options; --version -v\n"
          "                            also prints the configuration moec was built with\n"
          "\n"
          "The language manual is lang/manual.md; example models are in lang/models/.\n");
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
  char why[512];
  cg_link_configuration(out);
  fprintf(out, "nvrtc %s\n", cg_target_cuda.available(why, sizeof why) ? "yes" : "no");
}

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
    {"check", cli_check_usage, cli_check}, {"dump-ir", cli_dump_ir_usage, cli_dump_ir}, {"build", cli_build_usage, cli_build},
    {"plan", cli_plan_usage, cli_plan},  {"sweep", cli_sweep_usage, cli_sweep},   {"tune", cli_tune_usage, cli_tune},
    {"import-hf", cli_import_hf_usage, cli_import_hf},
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
