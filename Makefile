# helexa — set-up, test, serve and bench from a fresh machine with only Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU torch is pinned where there is no GPU (a local wheel here); with a GPU, the package's
# own range keeps whatever CUDA build is installed.
TORCH_CPU  ?= torch==2.13.0
TRITON_PIN ?= triton==3.6.0
# The newest Triton the kernels are tested on (pyproject's range ends after it); CPU machines test both.
TRITON_NEXT ?= triton==3.9.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup lint browser test test-triton-next serve bench bench-serve bench-admission bench-agent bench-peers bench-agreement soak pull clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
ifeq ($(HAS_GPU),1)
	$(PIP) install --quiet -e '.[test]'
else
	$(PIP) install --quiet $(TORCH_CPU) $(TRITON_PIN)
	$(PIP) install --quiet -e '.[test]'
endif
	touch $@

setup: $(VENV)/.installed

lint: setup
	$(PY) -m ruff check helexa tests bench
	$(PY) -m ruff format --check helexa tests bench
	$(PY) -m mypy

# The operator page's tests drive Debian's Chromium through Playwright (which never downloads a browser here).
# Installed when missing and we are root with apt; otherwise those tests skip and say why.
browser:
	@command -v chromium >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && \
		{ export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq --no-install-recommends chromium >/dev/null \
		|| { apt-get update -qq && apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; }; } \
		|| echo "chromium could not be installed: the operator page's browser tests will skip"

# OpenBLAS's Sandybridge kernels for NumPy in the tests: the Triton interpreter's tl.dot is NumPy's matmul, and
# the Haswell kernels gave a row of a small product bits that depend on the other rows (tests/conftest.py).
TEST_ENV := OPENBLAS_CORETYPE=Sandybridge

# The kernel and KV-cache tests, run again on the newest tested Triton.
KERNEL_TESTS := tests/kernels tests/kvcache
# Tests that are one core's work (the Triton interpreter, the device scripts' CPU dry runs) and share nothing (no
# servers, ports or timings): they run on a worker a core (pytest-xdist); the rest, whose servers and timings share
# the machine, one at a time.
PARALLEL_TESTS := $(KERNEL_TESTS) tests/engine/test_cuda_step_invariance.py tests/engine/test_cuda_graphs.py \
	tests/engine/test_fp8_kv_engine.py tests/engine/test_gpu_scripts.py
WORKERS ?= auto

test: lint browser
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) $(PARALLEL_TESTS)
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider tests $(PARALLEL_TESTS:%=--ignore=%)
ifneq ($(HAS_GPU),1)
	$(MAKE) test-triton-next
endif

# The kernel and KV-cache tests again, in the interpreter of the newest tested Triton (no CUDA needed).
.triton-next/.installed: Makefile
	rm -rf .triton-next
	$(PIP) install --quiet --no-deps --target .triton-next $(TRITON_NEXT)
	touch $@

test-triton-next: setup .triton-next/.installed
	PYTHONPATH=.triton-next $(PY) -c "import triton; print('kernel tests on triton', triton.__version__)"
	$(TEST_ENV) PYTHONPATH=.triton-next $(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) $(KERNEL_TESTS)

serve: setup
	$(PY) -m helexa.server $(ARGS)

pull: setup
	$(PY) -m helexa pull $(ARGS)

bench: setup
	$(PY) -m pytest -q -p no:cacheprovider bench --benchmark-enable --benchmark-only \
		--benchmark-columns=min,median,mean,ops --benchmark-sort=name

bench-serve: setup
	$(PY) bench/serve.py $(ARGS)

bench-agent: setup
	$(PY) bench/agent.py $(ARGS)

bench-admission: setup
	$(PY) bench/admission_accuracy.py $(ARGS)

# helexa vs llama.cpp on the same GGUF (the peer builds once into .peers/: bash bench/setup_llama_cpp.sh).
bench-peers: setup
	$(PY) bench/peers.py $(ARGS)

bench-agreement: setup
	$(PY) bench/agreement.py $(ARGS)

soak: setup
	HELEXA_SOAK=long $(PY) -m pytest -q -p no:cacheprovider tests -k soak

clean:
	rm -rf $(VENV) .triton-next build *.egg-info
