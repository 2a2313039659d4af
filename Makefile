# The two commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch; on a CUDA machine: make TORCH_SPEC=torch run
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test install install-test lint clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml setup.py
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	$(PY) -m pip install -q -e .
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PY) -m pip install -q -e ".[test]"
	touch $@

install: $(STAMP)
install-test: $(TEST_STAMP)

run: $(STAMP)
	$(VENV)/bin/freetokend $(ARGS)

test: $(TEST_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff format --check daemon ctl kernels tests
	$(VENV)/bin/ruff check daemon ctl kernels tests

clean:
	rm -rf $(VENV) build *.egg-info
