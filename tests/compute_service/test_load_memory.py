"""Peak host memory while loading a checkpoint stays near the final weights (bounded-memory load).

A random Llama checkpoint of ~240 MB (bfloat16 on disk, two shards with an index, as
`save_pretrained` shards) is loaded as float32 (~480 MB of packed weights) in a fresh
subprocess. The subprocess samples its anonymous memory (/proc/self/status RssAnon) in a thread
every millisecond and at every tensor the loader reads (the weight source's read hook); the peak
above its own baseline (after imports and a warm-up of oneDNN) must stay within
`PEAK_BOUND` x the model's final weight bytes. Loading the float32 dict of every weight first, as
the loader did before, would need at least 2x (the dict plus the packed copies).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from compute_service.weights.source import LAYER_TENSORS

PEAK_BOUND = 1.3
#: Shape of the checkpoint: ~240 MB in bfloat16, ~480 MB as float32.
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS, HEAD_DIM = 8192, 1024, 2816, 8, 8, 4, 128

CHILD = r"""
import json, sys, threading, time
import torch
from compute_service.model.linear import Linear
from compute_service.model.llama import LlamaForPagedLM
from compute_service.weights.source import load_model_source


def rss_anon():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024


Linear(torch.randn(64, 64), packed=True)(torch.randn(2, 64))  # oneDNN's one-time set-up, before the baseline
baseline = peak = rss_anon()
done = threading.Event()


def sample(*_):
    global peak
    peak = max(peak, rss_anon())


def sampler():
    while not done.is_set():
        sample()
        time.sleep(0.001)


thread = threading.Thread(target=sampler)
thread.start()
config, weights = load_model_source(sys.argv[1])
weights.hooks.append(sample)
model = LlamaForPagedLM(config, weights, "cpu", torch.float32)
weights.close()
del weights
sample()
final = rss_anon()
done.set()
thread.join()

# A few weights against a direct computation from the file (float64 from the stored bf16).
from safetensors import safe_open

def stored(key):
    for f in sys.argv[2:]:
        with safe_open(f, "pt") as h:
            if key in h.keys():
                return h.get_tensor(key).double()

torch.manual_seed(1)
x = torch.randn(3, config.hidden_size)
p = "model.layers.5.self_attn."
wqkv = torch.cat([stored(p + "q_proj.weight"), stored(p + "k_proj.weight"), stored(p + "v_proj.weight")])
checks = {
    "norm": (model.norm.weight.double() - stored("model.norm.weight")).abs().max().item(),
    "embed": (model.embed.double() - stored("model.embed_tokens.weight")).abs().max().item(),
    "layers.5.wqkv": (model.layers[5].attn.wqkv(x).double() - x.double() @ wqkv.T).abs().max().item(),
    "lm_head": (model.lm_head(x).double() - x.double() @ stored("lm_head.weight").T).abs().max().item(),
}
h = torch.randn(3, config.intermediate_size)
checks["layers.7.w_down"] = (model.layers[7].mlp.w_down(h).double()
                             - h.double() @ stored("model.layers.7.mlp.down_proj.weight").T).abs().max().item()
print(json.dumps({"baseline": baseline, "peak": peak, "final": final, "weight_bytes": model.nbytes(),
                  "checks": checks}))
"""


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A random Llama directory in two safetensors shards (bf16) with an index; returns (dir, files)."""
    path = tmp_path_factory.mktemp("big_llama")
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTERMEDIATE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 1024, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    }  # fmt: skip
    (path / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    qd, kd = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = {"wq": (qd, HIDDEN), "wk": (kd, HIDDEN), "wv": (kd, HIDDEN), "wo": (HIDDEN, qd), "attn_norm": (HIDDEN,),
              "mlp_norm": (HIDDEN,), "w_gate": (INTERMEDIATE, HIDDEN), "w_up": (INTERMEDIATE, HIDDEN),
              "w_down": (HIDDEN, INTERMEDIATE)}

    def rand(*shape):
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    shards = [{"model.embed_tokens.weight": rand(VOCAB, HIDDEN)}, {"model.norm.weight": rand(HIDDEN) + 1,
                                                                  "lm_head.weight": rand(VOCAB, HIDDEN)}]
    for i in range(LAYERS):
        for ours, hf in LAYER_TENSORS.items():
            shards[i * 2 // LAYERS][f"model.layers.{i}.{hf}.weight"] = rand(*shapes[ours])
    files, weight_map = [], {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path / name, metadata={"format": "pt"})
        files.append(str(path / name))
        weight_map.update(dict.fromkeys(shard, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path, files


def test_peak_memory_of_a_load_stays_near_the_final_weights(checkpoint):
    path, files = checkpoint
    disk = sum(os.path.getsize(f) for f in files)
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path), *files], capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    weight_bytes = got["weight_bytes"]
    peak, final = got["peak"] - got["baseline"], got["final"] - got["baseline"]
    ratio = peak / weight_bytes
    print(f"checkpoint {disk / 2**20:.0f} MiB on disk (bf16), weights {weight_bytes / 2**20:.0f} MiB as float32; "
          f"anonymous memory above baseline: peak {peak / 2**20:.0f} MiB = {ratio:.3f}x the weights, "
          f"after the load {final / 2**20:.0f} MiB")
    assert weight_bytes >= 1.9 * disk * 0.99  # float32 of every bf16 tensor (packed)
    assert ratio <= PEAK_BOUND, f"peak {ratio:.3f}x the final weights > {PEAK_BOUND}x"
    assert final <= PEAK_BOUND * weight_bytes
    for name, diff in got["checks"].items():
        # bf16 -> fp32 is exact; a product differs from the float64 one by fp32 rounding only.
        tol = 0.0 if name in ("norm", "embed") else 1e-4
        assert diff <= tol, f"{name}: loaded model differs from the stored tensor by {diff:.3g}"
