# make test   — set up .venv (torch CPU build pinned, the project, then the example plugin) and run the test suite
# make serve  — set up and serve the built-in demo model on http://127.0.0.1:8000
# make ab     — A/B the built-in attention backends and KV allocators on the tiny model (CI gate)
# make triton-newest — the Triton kernels' interpreter tests against the newest triton pyproject.toml allows
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test serve ab triton-newest clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The example third-party plugin, installed (not editable) as a user would install it, so the
# tests see it as a real distribution. Any change to its files re-runs the install (the package
# folder itself is listed for files added or deleted).
EXAMPLE := examples/modserve-example-plugin
EXAMPLE_FILES := $(wildcard $(EXAMPLE)/pyproject.toml $(EXAMPLE)/README.md $(EXAMPLE)/modserve_example_plugin \
	$(EXAMPLE)/modserve_example_plugin/*.py)

# torch and the project in one resolution, torch pinned through constraints.txt: an unpinned
# torch would pull a multi-GB CUDA build. uv (from PyPI, into the venv) installs what pip would,
# several times faster (a fresh venv on 2 shared cores: 15-25 s against 100-145 s). uv reads none
# of pip's configuration: scripts/pip_config_for_uv.py hands it pip's indexes, links and
# constraints, and ours. INSTALLER=pip, or uv failing, installs with pip. The example after the
# project (it depends on modserve); its in-tree build/ goes first, or a file deleted from the
# example would still be installed from there.
INSTALLER ?= uv
UV_VERSION := 0.13.9
UV := $(VENV)/bin/uv
UV_PIP = eval "$$($(PY) scripts/pip_config_for_uv.py constraints.txt)" && $(UV) pip install --python $(PY)
# pip compiles every installed module's bytecode; uv does not. Where PYTHONDONTWRITEBYTECODE is
# set, every start then compiled the ~2,800 modules it imports again (~9 s on 2 cores), so those
# are compiled once here (~15 s); all 19k files, as pip or uv's --compile-bytecode do, took
# 35-66 s. (A start also imports torch's C++ extension builder, dynamo with sympy, and xgrammar.)
START_IMPORTS := modserve.cli, modserve.server.cli, modserve.engine.engine, modserve.server.app, modserve.server.run, \
	modserve.testing.checkpoints, torch.utils.cpp_extension, torch._dynamo, xgrammar
$(STAMP): $(PY) pyproject.toml constraints.txt $(EXAMPLE_FILES)
	@echo "install: torch 2.13.0 (CPU) and modserve[test] into $(VENV) with $(INSTALLER) (uv: ~40 s; pip: 2-3 min on 2 cores)"
	@if [ "$(INSTALLER)" = uv ] && $(PIP) install -qq uv==$(UV_VERSION) && $(UV_PIP) torch==2.13.0 -e ".[test]"; then \
		rm -rf $(EXAMPLE)/build && $(UV_PIP) --no-deps --no-build-isolation --reinstall-package modserve-example-plugin ./$(EXAMPLE) && \
		echo "install: compiling the bytecode a start imports" && env -u PYTHONDONTWRITEBYTECODE $(PY) -c \
			"import $(START_IMPORTS); from modserve.core.registry import get_registry; get_registry()"; \
	else \
		if [ "$(INSTALLER)" = uv ]; then echo "install: uv could not install; pip instead"; fi; \
		$(PIP) install -c constraints.txt torch==2.13.0 -e ".[test]" && \
		rm -rf $(EXAMPLE)/build && $(PIP) install -q --no-deps --no-build-isolation ./$(EXAMPLE); \
	fi
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q --durations=25

# Greedy outputs must agree exactly and logits within 1e-3 (float32); reports go to build/ab/.
AB_FLAGS := --threads 1 --workload random --input-len 48 --range-ratio 0.5 --num-prompts 8 --output-len 16 --repeats 2 \
	--min-agreement 1.0 --max-logit-diff 1e-3
ab: install
	model=$$($(PY) -c "from modserve.testing import cached_checkpoint; print(cached_checkpoint())") && \
	for pair in attention-reference:attention-paged kv-paged:kv-contiguous; do \
		$(VENV)/bin/modserve --log-level WARNING compare configs/ab/$${pair%:*}.yaml configs/ab/$${pair#*:}.yaml \
			--model "$$model" --out-dir build/ab/$${pair%:*}-vs-$${pair#*:} $(AB_FLAGS) || exit 1; \
	done

# The suite runs the Triton kernels (in the interpreter, without a GPU) with the triton that
# constraints.txt pins; this runs them with the newest one pyproject.toml's range allows, from a
# --target folder first on PYTHONPATH so the venv keeps its pin. ~80 s on 2 cores (download
# and interpreter), so CI runs it and `make test` does not.
TRITON_NEWEST := build/triton-newest
TRITON_SPEC := $(PY) -c "import tomllib; print(next(d.split(';')[0].strip() for d in \
	tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies'] if d.startswith('triton')))"
triton-newest: install
	spec=$$($(TRITON_SPEC)) && rm -rf $(TRITON_NEWEST) && \
		$(PIP) install -qq --no-deps --target $(TRITON_NEWEST) "$$spec" && \
		PYTHONPATH=$(TRITON_NEWEST) $(PY) -c "import triton; print('triton-newest: $$spec ->', triton.__version__)" && \
		PYTHONPATH=$(TRITON_NEWEST) $(PY) -m pytest -q tests/test_triton_attention.py tests/test_moe_backends.py \
			tests/test_quantization.py tests/test_lora_triton.py -k triton

serve: install
	$(VENV)/bin/modserve serve $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info $(EXAMPLE)/build $(EXAMPLE)/*.egg-info
