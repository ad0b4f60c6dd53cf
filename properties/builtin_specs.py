"""Registers the specs of the kernels shipped in pallascheck.kernels."""
from .attention_spec import SPEC as ATTENTION
from .cross_entropy_spec import SPEC as CROSS_ENTROPY
from .gated_linear_unit_spec import SPEC as GATED_LINEAR_UNIT
from .linear_cross_entropy_spec import SPEC as LINEAR_CROSS_ENTROPY
from .matmul_spec import SPEC as MATMUL
from .norms_spec import LAYER_NORM, RMS_NORM
from .ragged_dot_spec import SPEC as RAGGED_DOT
from .spec import register
from .top_k_spec import SPEC as TOP_K

for _spec in (
    MATMUL, LAYER_NORM, RMS_NORM, ATTENTION, CROSS_ENTROPY, LINEAR_CROSS_ENTROPY,
    RAGGED_DOT, GATED_LINEAR_UNIT, TOP_K,
):
    register(_spec)
