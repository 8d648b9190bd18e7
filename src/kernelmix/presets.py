"""The model presets: named sizes of :class:`kernelmix.model.ModelConfig` (``ModelConfig.preset(name)``).

Plain data, in a module that imports nothing, so that the command line offers ``--preset``'s
choices without importing torch; :mod:`kernelmix.model` exports them as ``PRESETS`` too.
"""

from __future__ import annotations

from typing import Any

# GPT-3-style widths and depths (Brown et al. 2020, table 2.1) with a GPT-2 vocabulary; the
# SwiGLU hidden size of 8/3·d keeps the 12·d² parameters per block of the original MLP.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=256, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, max_seq_len=256,
                 chunk_size=16),
    # the main job's (kernelmix compare): the smallest model that gets past byte statistics in minutes on a CPU
    "mini": dict(vocab_size=256, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, max_seq_len=1024,
                 chunk_size=16),
    "small": dict(vocab_size=256, hidden_size=256, num_layers=6, num_heads=4, max_seq_len=2048),
    "125m": dict(vocab_size=50257, hidden_size=768, num_layers=12, num_heads=12, max_seq_len=2048),
    "350m": dict(vocab_size=50257, hidden_size=1024, num_layers=24, num_heads=16, max_seq_len=2048),
    "1.3b": dict(vocab_size=50257, hidden_size=2048, num_layers=24, num_heads=16, max_seq_len=2048),
}


__all__ = ["PRESETS"]
