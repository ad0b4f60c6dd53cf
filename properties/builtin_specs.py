"""Registers the specs of the kernels shipped in pallascheck.kernels."""
from .attention_spec import SPEC as ATTENTION
from .matmul_spec import SPEC as MATMUL
from .norms_spec import LAYER_NORM, RMS_NORM
from .spec import register

for _spec in (MATMUL, LAYER_NORM, RMS_NORM, ATTENTION):
    register(_spec)
