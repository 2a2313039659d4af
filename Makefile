# The two commands of the README: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
# The CPU build of PyTorch; on a CUDA machine: make TORCH_SPEC=torch run
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test

.PHONY: run test test-isas fuzz install install-test lint clean

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

# Property tests with fresh random examples, FUZZ_RUNS times (make test draws fixed ones).
FUZZ_RUNS ?= 10
fuzz: $(TEST_STAMP)
	for i in $$(seq $(FUZZ_RUNS)); do \
		$(PY) -m pytest -q -p no:cacheprovider --hypothesis-profile=explore \
			$$(grep -l '@given' tests/test_*.py | grep -v _slow) || exit 1; \
	done

# The kernel and model tests on each CPU kernel path in turn (FREETOKEN_CPU_ISA: what "auto"
# takes; avx512 runs emulated where the CPU lacks it, scalar anywhere), as on CPUs that have no
# more than that path. Slower than make test; not part of it.
ISA_PATHS ?= avx512 avx2 scalar
ISA_TESTS ?= tests/test_native_executor.py tests/test_native_formats.py tests/test_dense_native.py \
	tests/test_qlinear_native.py tests/test_decode_attention.py tests/test_rope_native.py \
	tests/test_gguf_blocks.py tests/test_cpu_decode.py tests/test_cpu_batch_invariance.py \
	tests/test_engine_families.py tests/test_quantize_experts.py
test-isas: $(TEST_STAMP)
	for isa in $(ISA_PATHS); do \
		echo "== FREETOKEN_CPU_ISA=$$isa"; \
		FREETOKEN_CPU_ISA=$$isa $(PY) -m pytest -p no:cacheprovider $(ISA_TESTS) $(PYTEST_ARGS) || exit 1; \
	done

lint: $(TEST_STAMP)
	$(VENV)/bin/ruff format --check daemon ctl kernels tests
	$(VENV)/bin/ruff check daemon ctl kernels tests

clean:
	rm -rf $(VENV) build *.egg-info

# Opt-in slow tests: real agent clients (Claude Code, Codex CLI, OpenCode, pinned below and
# installed from npm into .agents/) against the daemon, and schemathesis against its OpenAPI.
AGENTS_DIR ?= .agents
AGENT_PACKAGES ?= @anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33
AGENTS_STAMP := $(AGENTS_DIR)/.installed

$(AGENTS_STAMP): Makefile
	mkdir -p $(AGENTS_DIR)
	npm install --prefix $(AGENTS_DIR) --no-audit --no-fund --loglevel=error $(AGENT_PACKAGES)
	touch $@

install-agents: $(AGENTS_STAMP)

.PHONY: test-slow install-agents
test-slow: $(TEST_STAMP) $(AGENTS_STAMP)
	FT_AGENTS_DIR=$(abspath $(AGENTS_DIR)) $(PY) -m pytest -m slow --runslow $(PYTEST_ARGS)
