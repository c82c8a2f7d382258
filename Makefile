# `make run` starts a local cluster on the built-in demo model; `make test` runs the test suite.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install run test clean protos

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: on these machines pip takes the local CPU wheel; an unpinned torch
	# would pull a multi-GB CUDA build.
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]' --config-settings editable_mode=compat
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(BIN)/tandem up --demo-request

test: $(STAMP)
	$(BIN)/python -m pytest -q -x tests

protos: $(STAMP)
	$(BIN)/python -m tandem.protos_build

clean:
	rm -rf $(VENV)
