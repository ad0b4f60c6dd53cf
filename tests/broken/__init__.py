"""Deliberately broken kernels; each module lists its variants in ``VARIANTS``."""

# the modules test_sensitivity.py collects
MODULES = ("matmul_variants", "norms_variants", "moe_variants")
