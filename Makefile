# Two commands do all the set-up on a fresh machine:
#   make demo   installs everything and trains the demo GPT through a pipeline
#   make test   installs everything and runs the test suite
# Everything goes into .venv (made with --system-site-packages, so a torch already installed on the
# machine, e.g. a CUDA build on a GPU machine, is used as it is). Without one, TORCH_SPEC is
# installed: the CPU build by default.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS ?=
TRITON ?= 1
SOURCES := pyproject.toml setup.py $(wildcard csrc/*.cpp csrc/*.h csrc/*/*.cpp csrc/*/*.cu csrc/*/*.h)

.PHONY: install demo test test-fast check-cuda-syntax bench info clean

$(VENV)/.installed: $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "$(TORCH_SPEC)" $(TORCH_PIP_ARGS)
	$(PY) -m pip install setuptools wheel ninja
	$(PY) -m pip install -e ".[test]" --no-build-isolation
	# Triton (the fused ops' GPU kernels; the tests run them on its CPU interpreter) only beside
	# a CPU torch: a CUDA torch brings the Triton it was built with. TRITON=0 skips it.
	if [ "$(TRITON)" != 0 ] && $(PY) -c "import sys, torch; sys.exit(torch.version.cuda is not None)"; then \
		$(PY) -m pip install triton; fi
	$(PY) -m fastpipe info
	touch $@

install: $(VENV)/.installed

demo: install
	$(PY) -m fastpipe demo

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow" $(PYTEST_ARGS)

# Compile-only check of the CUDA sources against torch's and the CUDA toolkit's headers (no GPU).
check-cuda-syntax: install
	tools/check_cuda_syntax.sh $(PY)

info: install
	$(PY) -m fastpipe info

bench: install
	$(PY) -m pip install --no-deps torchgpipe==0.0.7
	$(PY) -m pip install matplotlib
	$(PY) benchmarks/overhead.py
	$(PY) benchmarks/cpu_concurrency.py
	$(PY) benchmarks/schedules.py --png benchmarks/schedules.png
	$(PY) benchmarks/simulator_scale.py
	$(PY) benchmarks/distributed.py
	$(PY) benchmarks/ops.py
	$(PY) benchmarks/transfer.py
	$(PY) benchmarks/offload.py

clean:
	rm -rf build $(VENV) *.egg-info fastpipe/_C*.so
