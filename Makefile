# moec: build the compiler (build/moec), the runtime (build/libmoert.a), tests and demo.
#
#   make deps    install the Debian packages moec needs (skips what is there)
#   make         build/moec and build/libmoert.a
#   make demo    deps + build + train lang/models/gpt_moe_bytes.moe on the GPL-3 text (tests/demo.sh)
#   make test    deps + build + every test suite (tests/suites.txt), with the totals
#   make check   the suites; make check T="NAME..." builds what those need and runs them
#   make fuzz    both fuzzers (front end, IR parser) for FUZZ_SECONDS each (default 300)
#   make bench   benchmarks (long; never part of make test)
#
# Every goal but `clean` first installs missing packages (mk/deps.sh) and writes this machine's
# configuration (mk/configure.sh -> build/config.mk), before anything is compiled.

# Every goal builds on all of the machine's cores unless the caller says how many (make -jN).
ifeq ($(filter -j%,$(MAKEFLAGS)),)
MAKEFLAGS += -j$(shell nproc 2>/dev/null || echo 1)
endif

CC      ?= cc
BUILD   ?= build
CFLAGS  ?= -O2 -g
CFLAGS  += -std=c11 -D_GNU_SOURCE -Wall -Wextra -Wno-unused-parameter -Wno-sign-compare \
           -Wno-missing-field-initializers -fPIC
ROOT    := $(abspath .)
CUDA    ?= /usr/local/cuda

DEB_PACKAGES := flex bison libnlopt-dev libopenmpi-dev openmpi-bin libopenblas-dev libopenblas-openmp-dev libcjson-dev \
                libcmocka-dev python3-numpy clang libclang-rt-14-dev iproute2 util-linux graphviz

# ---- configuration: packages first, then the flags of this machine, then anything compiled ----
# build/config.mk (mk/configure.sh: MPI, cJSON, OpenBLAS, CUDA, NCCL flags) is included below;
# make remakes it before it reads the rest, on every run: mk/deps.sh installs missing packages,
# then mk/configure.sh rewrites the file only when what it finds differs, and make restarts with
# the new values. Every object depends on it, so a changed configuration rebuilds what uses it.
.DEFAULT_GOAL := all
CONFIG := $(BUILD)/config.mk
CONFIG_ENV := CUDA=$(CUDA) $(if $(filter command line environment,$(origin NCCL_HOME)),NCCL_HOME=$(NCCL_HOME))
ifneq ($(filter-out clean,$(or $(MAKECMDGOALS),all)),)
include $(CONFIG)
endif
$(CONFIG): FORCE
	@bash mk/deps.sh $(DEB_PACKAGES)
	@$(CONFIG_ENV) bash mk/configure.sh $@
FORCE:

INCLUDES     := -I. -Iir -Ifrontend -Iruntime -I$(BUILD)/gen
# The runtime's kernels: math functions never set errno (nothing reads it) and floating-point
# operations never trap, so sqrtf and compare-and-select loops vectorise; results are the same bits
# (no -ffast-math: no reassociation, no contraction, -std=c11 keeps -ffp-contract=off).
RT_CFLAGS    := $(BLAS_CFLAGS) $(OMP_CFLAGS) $(CJSON_CFLAGS) $(MPI_CFLAGS) -fno-math-errno -fno-trapping-math

# codegen/nvrtc.c needs the CUDA toolkit: it is built by the CUDA rules below, never here; the
# CUDA target's struct (codegen/target_cuda.c), which calls it, is linked into moec only.
COMPILER_SRC := $(filter-out codegen/nvrtc.c codegen/target_cuda.c,$(wildcard frontend/*.c ir/*.c passes/*.c sched/*.c codegen/*.c))
RUNTIME_SRC  := $(wildcard runtime/*.c runtime/kernels/*.c)
GEN_SRC      := $(BUILD)/gen/parser.c $(BUILD)/gen/lexer.c
GEN_INC      := $(BUILD)/gen/cuda_kernels.inc
COMPILER_OBJ := $(COMPILER_SRC:%.c=$(BUILD)/obj/%.o) $(BUILD)/obj/gen/parser.o $(BUILD)/obj/gen/lexer.o
RUNTIME_OBJ  := $(RUNTIME_SRC:%.c=$(BUILD)/obj/%.o)

# ---- CUDA parts: only where the toolkit is (CUDA=/path overrides /usr/local/cuda) ----
# codegen/nvrtc.c (NVRTC: CUDA C -> CUBIN/PTX) and tests/cuda/nvrtc_check, which tests/cuda/run.sh
# runs on every model's `moec build --emit cuda`. Without a toolkit `make` says so and skips them.
# With cuBLAS and NCCL as well: the GPU runtime build/libmoert_cuda.a (runtime/cuda) and
# build/cuda/gpu_check, which `make test-gpu` runs (docs/gpu.md). NCCL is the toolkit's, else a
# Python venv's nvidia/nccl package; NCCL_HOME=/path (holding include/nccl.h and lib/) overrides.
# moec itself links NVRTC there (for `moec build --target cuda`) and gets the flags the CUDA
# programs it links need (MOEC_CUDA_CFLAGS, MOEC_CUDA_LIBS); build/cuda/libfake_cuda.a is the
# fake device tests/cuda/host.sh links CUDA programs against (MOEC_CUDA_FAKE=1).
ifeq ($(HAVE_NVRTC),yes)
CUDA_TARGETS := $(BUILD)/cuda/nvrtc_check $(BUILD)/cuda/libfake_cuda.a $(BUILD)/cuda/moec-tune-fake
MOEC_NVRTC   := $(BUILD)/obj/cuda/nvrtc.o -L$(CUDA_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -lnvrtc
ifeq ($(HAVE_GPU_RUNTIME),yes)
CUDA_TARGETS += $(BUILD)/libmoert_cuda.a $(BUILD)/cuda/gpu_check $(BUILD)/cuda/moec-tune-cuda
else
CUDA_TARGETS += gpu-skip
endif
else
CUDA_TARGETS := cuda-skip
endif

COMPILER_DEFS := -DMOEC_ROOT=\"$(ROOT)\" -DMOEC_BUILD=\"$(abspath $(BUILD))\" -DMOEC_MPI_LIBS='"$(MPI_LIBS)"' \
                 -DMOEC_MPI_CFLAGS='"$(MPI_CFLAGS)"' -DMOEC_CUDA_CFLAGS='"$(CUDA_PROGRAM_CFLAGS)"' \
                 -DMOEC_CUDA_LIBS='"$(CUDA_PROGRAM_LIBS)"' -DMOEC_BLAS_LIBS='"$(BLAS_LIBS)"'

.PHONY: all deps demo test test-gpu gpu-models gpu-pack fuzz bench clean cuda-skip gpu-skip FORCE
all: $(BUILD)/moec $(BUILD)/libmoert.a $(CUDA_TARGETS)

# The packages were installed (or found) when build/config.mk was remade, before this runs.
deps:
	@if [ -d $(CUDA) ]; then echo "# CUDA found at $(CUDA)"; else echo "# no CUDA toolkit at $(CUDA): CUDA parts are skipped"; fi

# Grouped targets (&:): one bison or flex run makes both files. With plain targets a parallel make
# could run the generator once per file, the second rewriting lexer.c while the first's reader
# compiled it (clang died of SIGBUS on a fresh clone's make test).
$(BUILD)/gen/parser.c $(BUILD)/gen/parser.h &: lang/parser.y
	@mkdir -p $(BUILD)/gen
	bison -Wall -Werror --defines=$(BUILD)/gen/parser.h -o $(BUILD)/gen/parser.c $<

$(BUILD)/gen/lexer.c $(BUILD)/gen/lexer.h &: lang/lexer.l $(BUILD)/gen/parser.h
	@mkdir -p $(BUILD)/gen
	flex --header-file=$(BUILD)/gen/lexer.h -o $(BUILD)/gen/lexer.c $<

# The CUDA kernels' sources as C strings for codegen/kernels.c: the prelude, then one file per
# kernel family in this fixed order (each the sibling of runtime/kernels/FAMILY.c).
CUDA_KERNEL_FAMILIES := elementwise ffn norm embed attn loss gate gate_loss order hook layout optim
CUDA_KERNEL_SRC      := codegen/cuda/prelude.cu $(CUDA_KERNEL_FAMILIES:%=codegen/cuda/%.cu)
$(BUILD)/gen/cuda_kernels.inc: $(CUDA_KERNEL_SRC) mk/embed_cuda.awk
	@mkdir -p $(BUILD)/gen
	awk -f mk/embed_cuda.awk $(CUDA_KERNEL_SRC) >$@.tmp && mv $@.tmp $@
$(BUILD)/obj/codegen/kernels.o: $(BUILD)/gen/cuda_kernels.inc

$(BUILD)/obj/gen/%.o: $(BUILD)/gen/%.c $(BUILD)/gen/parser.h $(BUILD)/gen/lexer.h $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Wno-unused-function $(INCLUDES) -c $< -o $@

$(BUILD)/obj/frontend/%.o: frontend/%.c $(BUILD)/gen/parser.h $(BUILD)/gen/lexer.h $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) $(COMPILER_DEFS) -MMD -MP -c $< -o $@

$(BUILD)/obj/runtime/%.o: runtime/%.c $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) $(RT_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/obj/%.o: %.c $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) $(COMPILER_DEFS) $(MPI_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libmoec.a: $(COMPILER_OBJ)
	@rm -f $@
	ar rcs $@ $^

$(BUILD)/libmoert.a: $(RUNTIME_OBJ)
	@rm -f $@
	ar rcs $@ $^

RUNTIME_LIBS := $(BLAS_LIBS) $(CJSON_LIBS) $(MPI_LIBS) -lm

# The command line: moec.c, the entry point, and the subcommands in cli/ (check, dump-ir, build,
# plan, sweep, tune) with the CUDA target; `moec tune` runs the runtime's kernels and collectives,
# so moec links libmoert too.
CLI_SRC := moec.c $(filter-out cli/tune_cuda.c,$(wildcard cli/*.c)) codegen/target_cuda.c
CLI_OBJ := $(CLI_SRC:%.c=$(BUILD)/obj/%.o)
$(BUILD)/moec: $(CLI_OBJ) $(BUILD)/libmoec.a $(BUILD)/libmoert.a $(filter %.o,$(MOEC_NVRTC))
	$(CC) $(CFLAGS) -o $@ $(CLI_OBJ) $(MOEC_NVRTC) $(BUILD)/libmoec.a $(BUILD)/libmoert.a -lnlopt -ldl $(RUNTIME_LIBS)

# What moec and its link step were configured with (NVRTC, the CUDA and MPI flags) is in these
# objects: rebuild them when the Makefile or the configuration changes.
$(BUILD)/obj/codegen/target_cuda.o $(BUILD)/obj/codegen/link.o: Makefile $(CONFIG)
ifneq ($(MOEC_NVRTC),)
$(BUILD)/obj/codegen/target_cuda.o: COMPILER_DEFS += -DMOEC_NVRTC
endif

ifeq ($(HAVE_NVRTC),yes)
$(BUILD)/obj/cuda/nvrtc.o: codegen/nvrtc.c codegen/cg.h $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) -I$(CUDA)/include -c $< -o $@

$(BUILD)/cuda/nvrtc_check: tests/cuda/nvrtc_check.c $(BUILD)/obj/cuda/nvrtc.o $(BUILD)/libmoec.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) -o $@ $< $(BUILD)/obj/cuda/nvrtc.o $(BUILD)/libmoec.a \
	  -L$(CUDA_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -lnvrtc -lm

# The GPU runtime. The driver (libcuda.so.1) is not linked: runtime/cuda/rt_cuda.c loads it at
# run time, so that gpu_check (and later the CUDA model binaries) start on a machine without an
# NVIDIA driver and say so. cuBLAS, NCCL and NVRTC are found through the rpath of their folders.
CUDA_RT_OBJ   := $(patsubst %.c,$(BUILD)/obj/%.o,$(wildcard runtime/cuda/*.c))
CUDA_INCLUDES := -I$(CUDA)/include -I$(NCCL_HOME)/include
CUDA_LIBS     := -L$(CUDA_LIBDIR) -L$(NCCL_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -Wl,-rpath,$(NCCL_LIBDIR) \
                 -lcublas -lcublasLt -l:libnccl.so.2 -lnvrtc -ldl
CUDA_CXXFLAGS := $(filter-out -std=%,$(CFLAGS)) -std=c++20

$(BUILD)/obj/runtime/cuda/%.o: runtime/cuda/%.c $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) $(CUDA_INCLUDES) $(MPI_CFLAGS) -MMD -MP -c $< -o $@

$(BUILD)/libmoert_cuda.a: $(CUDA_RT_OBJ)
	@rm -f $@
	ar rcs $@ $^

# gpu_check compiles the kernel library as host C++ too, for the kernels' parameter types.
$(BUILD)/cuda/kernel_library.cu: $(BUILD)/cuda/nvrtc_check
	$< --print-library >$@

# The fake device (tests/cuda/fake_cuda.cpp): rt_cuda.h on host memory, the kernel library run
# as host C++ under emulation (MK_KERNEL list: which kernels synchronise their threads). The
# programs' device hooks (runtime/cuda/session.c) call only rt_cuda.h, so they run over it too.
$(BUILD)/cuda/kernel_list.h: $(BUILD)/cuda/nvrtc_check
	$< --print-kernel-list >$@

$(BUILD)/obj/cuda/fake_cuda.o: tests/cuda/fake_cuda.cpp tests/cuda/host_kernels.h runtime/cuda/rt_cuda.h \
                               runtime/rt_mpi.h runtime/moert.h $(BUILD)/cuda/kernel_library.cu $(BUILD)/cuda/kernel_list.h $(CONFIG)
	@mkdir -p $(dir $@)
	$(CXX) $(CUDA_CXXFLAGS) $(INCLUDES) -Iruntime/cuda -I$(CUDA)/include $(MPI_CFLAGS) \
	  -DMK_LIBRARY='"$(abspath $(BUILD))/cuda/kernel_library.cu"' -DMK_KERNEL_LIST='"$(abspath $(BUILD))/cuda/kernel_list.h"' \
	  -c $< -o $@

$(BUILD)/cuda/libfake_cuda.a: $(BUILD)/obj/cuda/fake_cuda.o $(BUILD)/obj/runtime/cuda/session.o
	@rm -f $@
	ar rcs $@ $^

# `moec tune --target cuda` (cli/tune.c with the engine of cli/tune_cuda.c, which moec does not
# link): cuBLAS GEMMs and NCCL collectives, in a program of its own so that moec does not load
# cuBLAS at every start; moec runs it in its place. moec-tune-fake is the same program on the
# fake device (MOEC_CUDA_FAKE=1, tests/tune_cuda.sh). Both compile the kernel library with NVRTC.
TUNE_CUDA_OBJ := $(BUILD)/obj/cuda/tune_cuda.o $(BUILD)/obj/cli/tune.o $(BUILD)/obj/cli/options.o $(BUILD)/obj/cuda/nvrtc.o
$(BUILD)/obj/cuda/tune_cuda.o: cli/tune_cuda.c cli/tune.h runtime/cuda/rt_cuda.h runtime/moert.h $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) -I$(CUDA)/include $(MPI_CFLAGS) -c $< -o $@

$(BUILD)/cuda/moec-tune-cuda: $(TUNE_CUDA_OBJ) $(BUILD)/libmoert_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a
	$(CC) $(CFLAGS) -o $@ $(TUNE_CUDA_OBJ) $(BUILD)/libmoert_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a $(CUDA_LIBS) -lnlopt $(RUNTIME_LIBS) -pthread

$(BUILD)/cuda/moec-tune-fake: $(TUNE_CUDA_OBJ) $(BUILD)/cuda/libfake_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a
	$(CXX) $(CUDA_CXXFLAGS) -o $@ $(TUNE_CUDA_OBJ) $(BUILD)/cuda/libfake_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a \
	  -L$(CUDA_LIBDIR) -Wl,-rpath,$(CUDA_LIBDIR) -lnvrtc -lnlopt $(RUNTIME_LIBS) -pthread

$(BUILD)/cuda/gpu_check: tests/cuda/gpu_check.cpp tests/cuda/kernel_cases.h tests/cuda/host_kernels.h \
                         $(BUILD)/cuda/kernel_library.cu $(BUILD)/obj/cuda/nvrtc.o $(BUILD)/libmoert_cuda.a \
                         $(BUILD)/libmoec.a $(BUILD)/libmoert.a
	@mkdir -p $(dir $@)
	$(CXX) $(CUDA_CXXFLAGS) $(INCLUDES) $(CUDA_INCLUDES) $(MPI_CFLAGS) \
	  -DMK_LIBRARY='"$(abspath $(BUILD))/cuda/kernel_library.cu"' -o $@ $< $(BUILD)/obj/cuda/nvrtc.o \
	  $(BUILD)/libmoert_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a $(CUDA_LIBS) $(RUNTIME_LIBS) -pthread

endif

# The GPU checks (tests/cuda/gpu.sh): one line per check and the totals; without a GPU (or without
# a toolkit: no gpu_check) one skip line. No `deps`: GPU machines have no apt. gpu-models: the
# CUDA and CPU model binaries that gpu.sh compares, built here to be carried to a GPU machine
# (docs/gpu.md). gpu-pack: everything a GPU session runs (gpu_check, the model binaries, moec and
# tune --target cuda, bench/gpu_predict.sh's models, gpu_layer, bench/gpu_compiled.sh's layers)
# with their Debian libraries, in one file to carry: build/gpu-pack.tar.xz, which
# tests/cuda/session.sh unpacks and runs on the GPU (docs/gpu.md). Where a part is missing they
# say so.
GPU_RUNTIME := $(filter yes,$(HAVE_GPU_RUNTIME))
test-gpu: $(filter $(BUILD)/cuda/gpu_check,$(CUDA_TARGETS))
	@BUILD=$(BUILD) CUDA=$(CUDA) bash tests/cuda/gpu.sh
gpu-models: $(if $(filter yes,$(HAVE_NVRTC)),$(BUILD)/moec $(BUILD)/libmoert.a $(filter $(BUILD)/libmoert_cuda.a,$(CUDA_TARGETS)))
	@$(if $(filter yes,$(HAVE_NVRTC)),BUILD=$(BUILD) CUDA=$(CUDA) bash tests/cuda/gpu.sh --build-models,echo "# no CUDA toolkit at $(CUDA): no CUDA model binaries")
gpu-pack: $(if $(GPU_RUNTIME),all gpu-models $(BUILD)/bench/gpu_layer,$(filter cuda-skip gpu-skip,$(CUDA_TARGETS)))
	$(if $(GPU_RUNTIME),@BUILD=$(BUILD) bash bench/gpu_predict.sh --build)
	$(if $(GPU_RUNTIME),@BUILD=$(BUILD) bash bench/gpu_lm.sh --build)
	$(if $(GPU_RUNTIME),@BUILD=$(BUILD) bash bench/gpu_compiled.sh --build)
	$(if $(GPU_RUNTIME),@BUILD=$(BUILD) bash tests/cuda/pack.sh)
gpu-skip:
	@echo "# no cuBLAS ($(CUDA)/include/cublas_v2.h) or NCCL (NCCL_HOME=$(NCCL_HOME): include/nccl.h, lib/libnccl.so.2): libmoert_cuda.a and gpu_check skipped"
cuda-skip:
	@echo "# no CUDA toolkit at $(CUDA) ($(CUDA)/include/nvrtc.h): CUDA parts (NVRTC, nvrtc_check) skipped"

-include $(shell find $(BUILD)/obj -name '*.d' 2>/dev/null)

# ---- tests ----
UNIT_SRC  := $(wildcard tests/unit/test_*.c)
UNIT_BIN  := $(UNIT_SRC:tests/unit/%.c=$(BUILD)/tests/%)

$(BUILD)/tests/%: tests/unit/%.c $(BUILD)/libmoec.a $(BUILD)/libmoert.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) $(COMPILER_DEFS) $(MPI_CFLAGS) -o $@ $< $(BUILD)/libmoec.a $(BUILD)/libmoert.a -lcmocka -lnlopt $(RUNTIME_LIBS)

# Multi-rank test programs (run under mpirun by tests/mpi/*.sh).
MPI_TEST_BIN := $(patsubst tests/mpi/%.c,$(BUILD)/mpi/%,$(wildcard tests/mpi/*.c))
$(BUILD)/mpi/%: tests/mpi/%.c $(BUILD)/libmoert.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) $(MPI_CFLAGS) -o $@ $< $(BUILD)/libmoert.a $(RUNTIME_LIBS)

# Sanitizer build of the compiler, used by the diagnostics tests: an object per source (so that
# make -j compiles them side by side), linked into one program.
ASAN_SRC := $(CLI_SRC) $(COMPILER_SRC) $(RUNTIME_SRC) $(GEN_SRC)
ASAN_OBJ := $(ASAN_SRC:%.c=$(BUILD)/asan/obj/%.o)
$(BUILD)/asan/obj/%.o: %.c $(GEN_SRC) $(GEN_INC) $(CONFIG)
	@mkdir -p $(dir $@)
	$(CC) -std=c11 -D_GNU_SOURCE -O1 -g -fsanitize=address,undefined -fno-sanitize-recover=undefined \
	  -fno-omit-frame-pointer $(INCLUDES) $(COMPILER_DEFS) $(BLAS_CFLAGS) $(CJSON_CFLAGS) $(MPI_CFLAGS) -MMD -MP -c $< -o $@
$(BUILD)/asan/moec: $(ASAN_OBJ)
	$(CC) -fsanitize=address,undefined -o $@ $(ASAN_OBJ) -lnlopt $(BLAS_LIBS) $(CJSON_LIBS) $(MPI_LIBS) -lm

# libFuzzer harnesses (clang). The configured BLAS flags; clang's -fopenmp would link its own
# libomp where OpenBLAS's OpenMP build needs GCC's libgomp, so that is named instead. The compiler's
# objects are built once (instrumented for the fuzzer, not linked with its main) and shared by
# every harness.
FUZZ_BLAS_LIBS := $(patsubst -fopenmp,-lgomp,$(BLAS_LIBS))
FUZZ_SRC := $(wildcard tests/fuzz/fuzz_*.c)
FUZZ_BIN := $(FUZZ_SRC:tests/fuzz/%.c=$(BUILD)/fuzz/%)
FUZZ_OBJ := $(patsubst %.c,$(BUILD)/fuzz/obj/%.o,$(COMPILER_SRC) $(GEN_SRC))
FUZZ_CFLAGS = -std=c11 -D_GNU_SOURCE -O1 -g -Wno-unused-function $(INCLUDES) $(COMPILER_DEFS) $(CJSON_CFLAGS)
$(BUILD)/fuzz/obj/%.o: %.c $(GEN_SRC) $(GEN_INC) $(CONFIG)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer-no-link,address,undefined -MMD -MP -c $< -o $@
$(BUILD)/fuzz/%: tests/fuzz/%.c $(FUZZ_OBJ)
	@mkdir -p $(dir $@)
	clang $(FUZZ_CFLAGS) -fsanitize=fuzzer,address,undefined -o $@ $< $(FUZZ_OBJ) -lnlopt $(FUZZ_BLAS_LIBS) $(CJSON_LIBS) -lm
.SECONDARY: $(FUZZ_OBJ)
-include $(shell find $(BUILD)/asan/obj $(BUILD)/fuzz/obj -name '*.d' 2>/dev/null)

# make test: every suite of tests/suites.txt (tests/run.sh), after building all they need.
test: deps all $(UNIT_BIN) $(MPI_TEST_BIN) $(BUILD)/asan/moec $(FUZZ_BIN)
	@BUILD=$(BUILD) bash tests/run.sh

# make check T="NAME..." runs these suites only, after building what they need (the table's
# third column, below); make check alone lists them. Only the Debian packages they need are
# installed (mk/deps.sh: none is missing, no apt-get).
SUITE_TABLE := tests/suites.txt
SUITE_NAMES := $(shell awk -F'|' '!/^\#/ && NF > 2 {print $$1}' $(SUITE_TABLE))
CHECK_NEEDS := $(sort $(shell awk -F'|' -v t=" $(strip $(T)) " '!/^\#/ && NF > 2 { n = $$1; gsub(/ /, "", n); if (index(t, " " n " ")) print $$3 }' $(SUITE_TABLE)))
NEEDS_moec  := $(BUILD)/moec $(BUILD)/libmoert.a
NEEDS_cuda  := $(CUDA_TARGETS)
NEEDS_unit  := $(UNIT_BIN)
NEEDS_mpi   := $(MPI_TEST_BIN)
NEEDS_asan  := $(BUILD)/asan/moec
NEEDS_fuzz  := $(FUZZ_BIN)
PACKAGES_unit  := libcmocka-dev
PACKAGES_fuzz  := clang libclang-rt-14-dev
PACKAGES_netns := iproute2 util-linux
ifeq ($(MAKECMDGOALS),check)
ifneq ($(filter-out $(SUITE_NAMES),$(T)),)
$(error no suite '$(filter-out $(SUITE_NAMES),$(T))' (make check lists them))
endif
DEB_PACKAGES := $(filter-out $(foreach n,unit fuzz netns,$(if $(filter $(n),$(CHECK_NEEDS)),,$(PACKAGES_$(n)))),$(DEB_PACKAGES))
endif
.PHONY: check
check: $(foreach n,$(CHECK_NEEDS),$(NEEDS_$(n)))
	@BUILD=$(BUILD) bash tests/run.sh $(if $(strip $(T)),$(T),--list)

fuzz: deps $(FUZZ_BIN)
	@BUILD=$(BUILD) FUZZ_SECONDS=$${FUZZ_SECONDS:-300} bash tests/fuzz/run.sh

demo: deps all
	@BUILD=$(BUILD) bash tests/demo.sh

$(BUILD)/bench/alltoall: bench/alltoall.c $(BUILD)/libmoert.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Iruntime $(MPI_CFLAGS) -o $@ $< $(BUILD)/libmoert.a $(RUNTIME_LIBS)

$(BUILD)/bench/gate_order: bench/gate_order.c $(BUILD)/libmoert.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -Iruntime $(RT_CFLAGS) -o $@ $< $(BUILD)/libmoert.a $(RUNTIME_LIBS)

$(BUILD)/bench/sched_bench: bench/sched_bench.c $(BUILD)/libmoec.a
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) $(INCLUDES) -o $@ $< $(BUILD)/libmoec.a -lnlopt -lm

bench: deps all $(BUILD)/bench/gate_order $(BUILD)/bench/alltoall $(BUILD)/bench/sched_bench
	@BUILD=$(BUILD) bash bench/step_time.sh
	@echo
	@BUILD=$(BUILD) bash bench/cpu.sh
	@echo
	@BUILD=$(BUILD) bash bench/memory.sh
	@echo
	@BUILD=$(BUILD) bash bench/lora.sh
	@echo
	@BUILD=$(BUILD) bash bench/predict.sh
	@echo
	$(BUILD)/bench/sched_bench .
	@for c in testbed-a testbed-a-solver testbed-b; do echo; $(BUILD)/moec sweep --cluster lang/clusters/$$c.cluster || exit 1; done
	@echo
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 4 $(BUILD)/bench/alltoall --gpus-per-node 2
	@echo
	OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 mpirun --oversubscribe -np 8 $(BUILD)/bench/alltoall --gpus-per-node 4
	@echo
	$(BUILD)/bench/gate_order
	@echo
	@BUILD=$(BUILD) bash bench/streams.sh
	@BUILD=$(BUILD) bash bench/cluster/layouts.sh --search-only

# ---- make cluster-bench (issue 23): planned schedules on an emulated multi-node cluster ----
# Network namespaces joined by links shaped with tbf (tests/cluster/cluster.sh, docs/cluster.md):
# every policy's predicted and measured step, an r sweep, a table and an SVG under
# build/cluster-bench. About an hour and a half; CLUSTER_BENCH_ARGS=--quick about 20 minutes. Then the layout
# search (issue 25, bench/cluster/layouts.sh): every fitting layout of the stack built and run on
# 2 x 2, measured beside predicted (layouts.md); `make cluster-layouts` runs only that part
# (CLUSTER_LAYOUTS_ARGS=--quick: one round). Then (issue 42, bench/predict.sh) one profile of each
# cluster without --model and four models predicted beside measured (predict.md; --quick: 2 x 1).
# Then (issue 62, bench/cluster/pipeline.sh) a language model at pp 2 with 4 and 8 microbatches
# beside dp 2 on 2 x 1, predicted and measured steps and bubbles (pipeline.md).
.PHONY: cluster-bench cluster-layouts
cluster-bench: deps all
	@BUILD=$(BUILD) bash bench/cluster/bench.sh $(CLUSTER_BENCH_ARGS)
	@BUILD=$(BUILD) bash bench/cluster/layouts.sh $(if $(findstring --quick,$(CLUSTER_BENCH_ARGS)),--quick) $(CLUSTER_LAYOUTS_ARGS)
	@rm -f $(BUILD)/cluster-bench/predict.md
	@BUILD=$(BUILD) bash bench/predict.sh --cluster 2x1 --out $(BUILD)/cluster-bench
	$(if $(findstring --quick,$(CLUSTER_BENCH_ARGS)),,@BUILD=$(BUILD) bash bench/predict.sh --cluster 2x2 --out $(BUILD)/cluster-bench)
	@BUILD=$(BUILD) bash bench/cluster/pipeline.sh $(if $(findstring --quick,$(CLUSTER_BENCH_ARGS)),--rounds 1) --out $(BUILD)/cluster-bench
cluster-layouts: deps all
	@BUILD=$(BUILD) bash bench/cluster/layouts.sh $(CLUSTER_LAYOUTS_ARGS)

# ---- make interop (issue 24): Hugging Face checkpoints against transformers itself ----
# tests/interop/run.sh: installs torch and transformers into build/interop-venv once; tiny random
# checkpoints of each family imported, run, exported and compared. Never part of make test.
.PHONY: interop
interop: deps all
	@BUILD=$(BUILD) bash tests/interop/run.sh

clean:
	rm -rf $(BUILD)

# ---- make bench-gpu (issue 7): one MoE layer on a GPU, moec beside PyTorch and the cuBLAS roofline ----
# build/bench/gpu_layer (bench/gpu_layer.cpp: moec's CUDA kernels + cuBLAS through libmoert_cuda),
# built where gpu_check is (the CUDA toolkit, cuBLAS and NCCL), then bench/gpu.sh runs it and
# bench/torch_ref.py on the same shapes. Without a GPU, skip lines and exit status 0 (docs/gpu.md).
.PHONY: bench-gpu
$(BUILD)/bench/gpu_layer: bench/gpu_layer.cpp tests/cuda/host_kernels.h $(BUILD)/cuda/kernel_library.cu \
                          $(BUILD)/obj/cuda/nvrtc.o $(BUILD)/libmoert_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a
	@mkdir -p $(dir $@)
	$(CXX) $(CUDA_CXXFLAGS) $(INCLUDES) $(CUDA_INCLUDES) $(MPI_CFLAGS) \
	  -DMK_LIBRARY='"$(abspath $(BUILD))/cuda/kernel_library.cu"' -o $@ $< $(BUILD)/obj/cuda/nvrtc.o \
	  $(BUILD)/libmoert_cuda.a $(BUILD)/libmoec.a $(BUILD)/libmoert.a $(CUDA_LIBS) $(RUNTIME_LIBS) -pthread

bench-gpu: $(if $(GPU_RUNTIME),$(BUILD)/bench/gpu_layer,$(filter cuda-skip gpu-skip,$(CUDA_TARGETS)))
	@BUILD=$(BUILD) CUDA=$(CUDA) bash bench/gpu.sh $(BENCH_GPU_ARGS)
