"""Registers the specs of the kernels shipped in pallascheck.kernels."""
from .matmul_spec import SPEC as MATMUL
from .spec import register

for _spec in (MATMUL,):
    register(_spec)
