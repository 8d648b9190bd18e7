"""Pure functional token mixers on ``[B, T, H, d]`` tensors (causal).

Every op has a fast path, a ``*_naive`` reference (dense or a per-token loop, float64-friendly)
and a ``*_step`` for one decode token with an explicit state.
"""

from .cubit import CubitState, cubit_attention, cubit_attention_naive, cubit_attention_step, cubit_solve
from .deltaformer import (
    DeltaFormerState,
    deltaformer_attention,
    deltaformer_attention_naive,
    deltaformer_attention_step,
)
from .random_features import (
    RandomFeatureState,
    gaussian_random_features,
    orthogonal_random_features,
    positive_random_features,
    random_feature_attention,
    random_feature_attention_naive,
    random_feature_attention_step,
)
from .softmax import SoftmaxState, softmax_attention, softmax_attention_naive, softmax_attention_step

__all__ = [
    "CubitState",
    "DeltaFormerState",
    "RandomFeatureState",
    "SoftmaxState",
    "cubit_attention",
    "cubit_attention_naive",
    "cubit_attention_step",
    "cubit_solve",
    "deltaformer_attention",
    "deltaformer_attention_naive",
    "deltaformer_attention_step",
    "gaussian_random_features",
    "orthogonal_random_features",
    "positive_random_features",
    "random_feature_attention",
    "random_feature_attention_naive",
    "random_feature_attention_step",
    "softmax_attention",
    "softmax_attention_naive",
    "softmax_attention_step",
]
