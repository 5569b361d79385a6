# The two commands of the README:  `make serve`  and  `make test`.
# Both create .venv on first use. torch is installed first, pinned to the CPU
# wheel, so that no dependency pulls a multi-GB CUDA build.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TORCH ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: serve test test-slow lint venv kernels proto bench-quick clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q "$(TORCH)"
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $(STAMP)

venv: $(STAMP)

# The CPU ops (paged attention, fused RMSNorm/rotary/SiLU-mul) compile once into the pdserve cache (about a minute the first time;
# a quick load afterwards). Building it here, in one process, keeps node processes from each
# compiling it at start. Without a compiler it reports the pure-torch fallback and succeeds.
kernels: $(STAMP)
	@$(BIN)/python -c "from pdserve.engine.kernels.cpu_build import load_paged_attention_op as b; \
	print('cpu ops (paged attention, fused elementwise):', 'ready' if b() else 'unavailable, using the pure-torch fallback')"

serve: kernels
	$(BIN)/pdserve up

test: lint kernels
	$(BIN)/python -m pytest -q $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no tests: failing"; exit 1; fi; exit $$rc

test-slow: kernels
	$(BIN)/python -m pytest -q -m slow $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "pytest collected no slow tests: failing"; exit 1; fi; exit $$rc

# ruff (pycodestyle + pyflakes) over the repository, mypy over every package;
# both are configured in pyproject.toml.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

proto: $(STAMP)
	$(BIN)/python scripts/gen_proto.py

clean:
	rm -rf $(VENV) build *.egg-info
