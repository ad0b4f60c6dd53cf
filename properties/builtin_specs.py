"""Registers the specs of the kernels shipped in pallascheck.kernels."""
from .matmul_spec import SPEC as MATMUL
from .ragged_dot_spec import SPEC as RAGGED_DOT
from .gated_linear_unit_spec import SPEC as GATED_LINEAR_UNIT
from .norms_spec import LAYER_NORM, RMS_NORM
from .spec import register

for _spec in (MATMUL, LAYER_NORM, RMS_NORM, RAGGED_DOT, GATED_LINEAR_UNIT):
    register(_spec)
