# make test   — set up .venv (torch CPU build pinned first, then the example plugin) and run the test suite
# make serve  — set up and serve the built-in demo model on http://127.0.0.1:8000
# make ab     — A/B the built-in attention backends and KV allocators on the tiny model (CI gate)
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test serve ab clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# The example third-party plugin, installed (not editable) as a user would install it, so the
# tests see it as a real distribution. Any change to its files re-runs the install (the package
# folder itself is listed for files added or deleted).
EXAMPLE := examples/modserve-example-plugin
EXAMPLE_FILES := $(wildcard $(EXAMPLE)/pyproject.toml $(EXAMPLE)/README.md $(EXAMPLE)/modserve_example_plugin \
	$(EXAMPLE)/modserve_example_plugin/*.py)

# torch first, pinned through constraints.txt: an unpinned torch would pull a multi-GB CUDA build.
# The example after the project (it depends on modserve); its in-tree build/ goes first, or a
# file deleted from the example would still be installed from there.
$(STAMP): $(PY) pyproject.toml constraints.txt $(EXAMPLE_FILES)
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	rm -rf $(EXAMPLE)/build
	$(PIP) install -q --no-deps --no-build-isolation ./$(EXAMPLE)
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

# Greedy outputs must agree exactly and logits within 1e-3 (float32); reports go to build/ab/.
AB_FLAGS := --threads 1 --workload random --input-len 48 --range-ratio 0.5 --num-prompts 8 --output-len 16 --repeats 2 \
	--min-agreement 1.0 --max-logit-diff 1e-3
ab: install
	model=$$($(PY) -c "from modserve.testing import cached_checkpoint; print(cached_checkpoint())") && \
	for pair in attention-reference:attention-paged kv-paged:kv-contiguous; do \
		$(VENV)/bin/modserve --log-level WARNING compare configs/ab/$${pair%:*}.yaml configs/ab/$${pair#*:}.yaml \
			--model "$$model" --out-dir build/ab/$${pair%:*}-vs-$${pair#*:} $(AB_FLAGS) || exit 1; \
	done

serve: install
	$(VENV)/bin/modserve serve $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info $(EXAMPLE)/build $(EXAMPLE)/*.egg-info
