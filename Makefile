# Set-up and entry points. Everything runs in a virtual environment .venv that
# sees the system's site-packages, so a torch already installed there is reused
# instead of downloaded again.
#
#   make install   create or reuse .venv; install torch (only if none is importable)
#                  and hfkern in editable mode with its demo and test extras
#   make demo      the fused 16-model hyper-parameter sweep (examples/digits_sweep.py)
#   make test      the test suite (without a GPU, Triton kernels run in Triton's
#                  interpreter on CPU tensors; tests/conftest.py chooses)
#   make clean     remove .venv and build/test leftovers
#
# DEMO_ARGS passes options to the demo, e.g. make demo DEMO_ARGS="--quick".

PYTHON ?= python3
TORCH_VERSION ?= 2.13.0
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.hfkern-installed
DEMO_ARGS ?=

.PHONY: install demo test clean

install: $(STAMP)

$(VPY):
	$(PYTHON) -m venv --system-site-packages $(VENV)

$(STAMP): $(VPY) setup.py
	@if $(VPY) -c "import torch" 2>/dev/null; then \
		echo "using torch $$($(VPY) -c 'import torch; print(torch.__version__)')"; \
	else \
		$(VPY) -m pip install "torch==$(TORCH_VERSION)"; \
	fi
	@# The setuptools a Python 3.11 venv bundles (65) shadows the system's and
	@# cannot build an editable wheel; upgrade it only when it is that old.
	@$(VPY) -c "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))" \
		|| $(VPY) -m pip install "setuptools>=70.1"
	@# No build isolation: an isolated build environment would fetch its own torch.
	$(VPY) -m pip install --no-build-isolation -e ".[demo,test]"
	touch $@

demo: install
	$(VPY) examples/digits_sweep.py $(DEMO_ARGS)

# pytest's exit status is make's: 5 (no tests collected) fails the target too.
test: install
	$(VPY) -m pytest -q tests

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache
	find . -name __pycache__ -type d -prune -not -path "./.git/*" -exec rm -rf {} +
