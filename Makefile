# make test   — set up .venv (torch CPU build pinned first) and run the test suite
# make serve  — set up and serve the built-in demo model on http://127.0.0.1:8000
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed

.PHONY: install test serve clean

$(PY):
	$(PYTHON) -m venv $(VENV)

# torch first, pinned through constraints.txt: an unpinned torch would pull a multi-GB CUDA build.
$(STAMP): $(PY) pyproject.toml constraints.txt
	$(PIP) install -q -c constraints.txt torch==2.13.0
	$(PIP) install -q -c constraints.txt -e ".[test]"
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest -q

serve: install
	$(VENV)/bin/modserve serve $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info
