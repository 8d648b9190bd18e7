"""Pure functional token mixers on ``[B, T, H, d]`` tensors (causal).

Every op has a fast path, a ``*_naive`` reference (dense or a per-token loop, float64-friendly)
and a ``*_step`` for one decode token with an explicit state. Softmax and random-feature attention
also have a ``*_masked`` dense form for an arbitrary ``[B, T, L]`` mask; ``data_aware_transform``
is DARKFormer's function-preserving initialisation of the random-feature transform;
``expand_heads`` repeats grouped key/value heads to the query heads (what every op does inside);
``solve_operands`` picks the operands of the Triton solve's tensor-core products (Cubit, DeltaFormer:
TF32 by default, or bf16).
"""

from ._backend import BACKENDS, SOLVE_OPERAND_CHOICES, check_backend, keep_solve_operands, solve_operands
from ._common import expand_heads
from .cubit import CubitState, cubit_attention, cubit_attention_naive, cubit_attention_step, cubit_solve
from .cubit_rf import CubitRFState, cubit_rf_attention, cubit_rf_attention_naive, cubit_rf_attention_step
from .data_aware import data_aware_transform, regularised_second_moments
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
    random_feature_attention_masked,
    random_feature_attention_naive,
    random_feature_attention_step,
)
from .softmax import (
    SoftmaxState,
    softmax_attention,
    softmax_attention_masked,
    softmax_attention_naive,
    softmax_attention_step,
)

__all__ = [
    "BACKENDS",
    "SOLVE_OPERAND_CHOICES",
    "check_backend",
    "keep_solve_operands",
    "solve_operands",
    "CubitState",
    "CubitRFState",
    "DeltaFormerState",
    "RandomFeatureState",
    "expand_heads",
    "SoftmaxState",
    "cubit_attention",
    "cubit_attention_naive",
    "cubit_attention_step",
    "cubit_solve",
    "cubit_rf_attention",
    "cubit_rf_attention_naive",
    "cubit_rf_attention_step",
    "data_aware_transform",
    "deltaformer_attention",
    "deltaformer_attention_naive",
    "deltaformer_attention_step",
    "gaussian_random_features",
    "orthogonal_random_features",
    "positive_random_features",
    "random_feature_attention",
    "random_feature_attention_masked",
    "random_feature_attention_naive",
    "random_feature_attention_step",
    "regularised_second_moments",
    "softmax_attention",
    "softmax_attention_masked",
    "softmax_attention_naive",
    "softmax_attention_step",
]
