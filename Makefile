# Two commands do all the set-up on a fresh machine:
#   make demo   installs everything and trains the demo GPT through a pipeline
#   make test   installs everything and runs the test suite (make test-all: with the long runs
#               marked slow too; CI runs make ci: test-all and the CUDA sources' compile check)
# Everything goes into .venv (made with --system-site-packages, so a torch already installed on the
# machine, e.g. a CUDA build on a GPU machine, is used as it is). Without one, TORCH_SPEC is
# installed: on a machine without an NVIDIA GPU from PyTorch's CPU wheel index (TORCH_INDEX),
# falling back to the default index (which serves the CUDA build on Linux) when that index cannot
# be reached. Triton (for the tests only) is installed by `make test`, not by `make demo`.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
TRITON ?= 1
# non-empty when the machine has an NVIDIA GPU: then torch comes from the default index
GPU ?= $(shell command -v nvidia-smi >/dev/null 2>&1 && echo 1)
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h)

.PHONY: install torch demo test test-all ci check-cuda-syntax bench info clean

$(VENV)/.installed: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(MAKE) --no-print-directory torch
	$(PY) -m pip install setuptools wheel ninja
	$(PY) -m pip install -e ".[test]" --no-build-isolation
	$(PY) -m fastpipe info
	touch $@

# torch when the venv sees none: the CPU build without a GPU (PyTorch's CPU index), else (or when
# that index cannot be reached) TORCH_SPEC from the default index.
torch:
ifneq ($(if $(strip $(GPU)),,$(strip $(TORCH_INDEX))),)
	$(PY) -m pip install --retries 1 --timeout 20 "$(TORCH_SPEC)" --index-url $(TORCH_INDEX) \
		$(TORCH_PIP_ARGS) || { echo "fastpipe: $(TORCH_INDEX) could not be used; installing \
	$(TORCH_SPEC) from the default index (on Linux the CUDA build, several GB; set TORCH_SPEC \
	and TORCH_PIP_ARGS to choose)"; $(PY) -m pip install "$(TORCH_SPEC)" $(TORCH_PIP_ARGS); }
else
	$(PY) -m pip install "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
endif

# Triton (the fused ops' GPU kernels; the tests run them on its CPU interpreter), for the tests
# only and only beside a CPU torch: a CUDA torch brings the Triton it was built with. TRITON=0
# skips it.
$(VENV)/.triton: $(VENV)/.installed
	if [ "$(TRITON)" != 0 ] && $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install triton; fi
	touch $@

# torchgpipe 0.0.7, for the parity tests and the benchmarks: without its dependencies (it would
# pull another torch); the tests that compare with it skip where it is absent.
$(VENV)/.torchgpipe: $(VENV)/.installed
	$(PY) -m pip install --no-deps torchgpipe==0.0.7
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m fastpipe demo

test: install $(VENV)/.triton $(VENV)/.torchgpipe
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# The long runs too (tests marked slow: repeated elastic restarts, every compiled schedule, ...).
test-all: install $(VENV)/.triton $(VENV)/.torchgpipe
	$(PY) -m pytest $(PYTEST_ARGS)

# What CI runs (.ci/run): every test, the slow ones and torchgpipe's parity tests included, then
# the compile-only check of the CUDA sources.
ci: test-all check-cuda-syntax

# Compile-only check of the CUDA sources against torch's and the CUDA toolkit's headers (no GPU).
check-cuda-syntax: install
	tools/check_cuda_syntax.sh $(PY)

info: install
	$(PY) -m fastpipe info

bench: install $(VENV)/.torchgpipe
	$(PY) -m pip install matplotlib
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/cpu_concurrency.py
	$(PY) benchmarks/schedules.py --png benchmarks/schedules.png
	$(PY) benchmarks/simulator_scale.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/three_d.py
	$(PY) benchmarks/ops.py
	$(PY) benchmarks/transfer.py
	$(PY) benchmarks/offload.py

clean:
	rm -rf build $(VENV) *.egg-info fastpipe/_C*.so
