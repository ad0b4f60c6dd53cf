"""Registers the specs of the kernels shipped in pallascheck.kernels."""
from .matmul_spec import SPEC as MATMUL
from .norms_spec import LAYER_NORM, RMS_NORM
from .spec import register
from .top_k_spec import SPEC as TOP_K

for _spec in (MATMUL, LAYER_NORM, RMS_NORM, TOP_K):
    register(_spec)
