"""Per-engine model checks: the longest sequence served (model context, pool, --max-model-len,
sliding window) and one model across the workers."""

import pytest

from client.stop import context_limit


def test_model_pool_and_flag_cap_the_context():
    assert context_limit(2048, 0, 4096, None) == 2048
    assert context_limit(2048, 0, 1024, None) == 1024  # the pool holds fewer tokens
    assert context_limit(2048, 0, 4096, 512) == 512
    assert context_limit(0, 0, 4096, None) == 4096  # unknown model context: the pool


def test_sliding_window_caps_by_default_and_refuses_a_longer_flag():
    assert context_limit(32768, 4096, 1 << 20, None) == 4096  # Mistral v0.1: within the window
    assert context_limit(32768, 4096, 1 << 20, 4096) == 4096
    assert context_limit(32768, 4096, 1000, None) == 1000
    with pytest.raises(ValueError, match="sliding window of 4096 tokens.*--max-model-len 4096 or less"):
        context_limit(32768, 4096, 1 << 20, 4097)


def test_workers_of_one_engine_must_run_one_model():
    """Workers whose model, revision or KV dtype differ would share KV under one prefix-cache
    identity: the engine refuses them at start, naming both and the field."""
    from client.stop import same_model
    from pagedkv.compute.v1 import compute_service_pb2 as cpb

    def info(**kw):
        base = dict(model_name="m", model_source="org/m", revision="a" * 40, dtype="float32",
                    architecture="LlamaForCausalLM", vocab_size=64, eos_token_ids=[2], max_context=128)
        return cpb.GetModelInfoResponse(**{**base, **kw})

    a = info()
    assert same_model([a, info()], ["w0", "w1"]) is a
    for field, value in [("revision", "b" * 40), ("dtype", "bfloat16"), ("architecture", "Qwen2ForCausalLM"),
                         ("eos_token_ids", [2, 3]), ("sliding_window", 64), ("model_source", "org/n")]:
        with pytest.raises(ValueError, match=f"workers w0 and w2 run different models: {field}"):
            same_model([a, info(), info(**{field: value})], ["w0", "w1", "w2"])
