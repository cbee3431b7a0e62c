"""The longest sequence a deployment serves: model context, pool, --max-model-len, sliding window."""

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
