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

.PHONY: setup ruff lint browser test test-triton-next serve bench bench-serve bench-admission bench-agent bench-peers bench-agreement soak pull clean

# Byte-compiled at install: where PYTHONDONTWRITEBYTECODE is set (as on the 2-core EPYC measured), what pip leaves
# uncompiled is compiled again by every process that imports it (--no-compile: set-up 128 -> 61 s, but the whole
# fresh-clone run 1,032 -> 1,186 s).
INSTALL := $(PIP) install --quiet

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(INSTALL) --upgrade pip
ifeq ($(HAS_GPU),1)
	$(INSTALL) -e '.[test]'
else
	$(INSTALL) $(TORCH_CPU) $(TRITON_PIN)
	$(INSTALL) -e '.[test]'
endif
	touch $@

setup: $(VENV)/.installed

ruff: setup
	$(PY) -m ruff check helexa tests bench
	$(PY) -m ruff format --check helexa tests bench

lint: ruff
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
# The first run: tests that time nothing (the kernels' in the Triton interpreter, the KV cache's, the model's, the
# engine's driven step by step, admission's). The longest files come first: a worker takes whole files in this
# order (--dist loadfile: a file's module fixtures are computed once), so no long one starts last and runs alone.
ENGINE_LONG := tests/engine/test_speculative_exact.py tests/engine/test_default_model_batching.py \
	tests/engine/test_cuda_step_invariance.py tests/engine/test_cuda_graphs.py
# The engine's tests that wait on a clock (a served stream's frames, a consumer's wake-up) go to the second run.
ENGINE_TIMED := tests/engine/test_core_server.py tests/engine/test_stream.py
UNTIMED_TESTS := $(ENGINE_LONG) tests/model $(KERNEL_TESTS) tests/admission tests/test_layers.py tests/test_lazy.py \
	$(filter-out $(ENGINE_LONG) $(ENGINE_TIMED),$(wildcard tests/engine/test_*.py))
# The second run: every other test (servers on loopback, processes of their own, deadlines; any new directory),
# apart from the first run's load. Both runs put a worker on each core (pytest-xdist; WORKERS=1 for one at a time),
# each with one OpenMP thread: two processes' OpenMP teams on two cores spin at their barriers against each other
# (a default-model test ran 17x slower, measured on a 2-core EPYC). The kernels' tests set the thread counts they
# check themselves. Last, one at a time and on every thread: the tests marked `alone` (pyproject.toml), which
# measure latencies and stalls (beside another test, a soak's /health p99 was 1.02 s against its bound of 1.0).
WORKERS ?= auto
# --max-worker-restart 0: a worker that dies fails the run at once, naming the test it was running (a replaced
# worker was seen to leave the run waiting on it for good).
ON_WORKERS := $(TEST_ENV) OMP_NUM_THREADS=1 $(PY) -m pytest -q -p no:cacheprovider -n $(WORKERS) --dist loadfile \
	--max-worker-restart 0 -m "not alone"

# mypy (a minute, one core) runs beside the first run; its report is printed after it, and either failing fails.
test: ruff browser
	@log=$$(mktemp); $(PY) -m mypy >$$log 2>&1 & mypy=$$!; \
	$(ON_WORKERS) $(UNTIMED_TESTS); tests=$$?; \
	wait $$mypy; typed=$$?; echo "mypy:"; cat $$log; rm -f $$log; [ $$typed = 0 ] && exit $$tests || exit $$typed
	$(ON_WORKERS) tests $(UNTIMED_TESTS:%=--ignore=%)
	$(TEST_ENV) $(PY) -m pytest -q -p no:cacheprovider -m alone tests
ifneq ($(HAS_GPU),1)
	$(MAKE) test-triton-next
endif

# The kernel and KV-cache tests again, in the interpreter of the newest tested Triton (no CUDA needed).
.triton-next/.installed: Makefile
	rm -rf .triton-next
	$(INSTALL) --no-deps --target .triton-next $(TRITON_NEXT)
	touch $@

test-triton-next: setup .triton-next/.installed
	PYTHONPATH=.triton-next $(PY) -c "import triton; print('kernel tests on triton', triton.__version__)"
	PYTHONPATH=.triton-next $(ON_WORKERS) $(KERNEL_TESTS)

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
