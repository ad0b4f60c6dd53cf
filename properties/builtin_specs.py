"""Registers the specs of the kernels shipped in pallascheck.kernels."""
from .cross_entropy_spec import SPEC as CROSS_ENTROPY
from .linear_cross_entropy_spec import SPEC as LINEAR_CROSS_ENTROPY
from .matmul_spec import SPEC as MATMUL
from .norms_spec import LAYER_NORM, RMS_NORM
from .spec import register

for _spec in (MATMUL, LAYER_NORM, RMS_NORM, CROSS_ENTROPY, LINEAR_CROSS_ENTROPY):
    register(_spec)
