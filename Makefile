# helexa — set-up, test, serve and bench from a fresh machine with only Python 3.11.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# CPU torch is pinned where there is no GPU (a local wheel here); with a GPU, the package's
# own range keeps whatever CUDA build is installed.
TORCH_CPU  ?= torch==2.13.0
TRITON_PIN ?= triton==3.6.0
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)

.PHONY: setup test serve bench bench-serve soak pull clean

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

test: setup
	$(PY) -m pytest -q -p no:cacheprovider tests

serve: setup
	$(PY) -m helexa.server $(ARGS)

pull: setup
	$(PY) -m helexa pull $(ARGS)

bench: setup
	$(PY) -m pytest -q -p no:cacheprovider bench --benchmark-enable --benchmark-only \
		--benchmark-columns=min,median,mean,ops --benchmark-sort=name

bench-serve: setup
	$(PY) bench/serve.py $(ARGS)

soak: setup
	HELEXA_SOAK=long $(PY) -m pytest -q -p no:cacheprovider tests -k soak

clean:
	rm -rf $(VENV) build *.egg-info
