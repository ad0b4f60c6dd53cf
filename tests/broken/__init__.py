"""Deliberately broken kernels; each module lists its variants in ``VARIANTS``."""

# the modules test_sensitivity.py collects
MODULES = (
    "matmul_variants",
    "norms_variants",
    "attention_variants",
    "loss_variants",
    "moe_variants",
    "top_k_variants",
    "mosaic_gpu_matmul_variants",
    "mosaic_gpu_attention_variants",
    "mosaic_gpu_ragged_dot_variants",
    "fp8_matmul_variants",
    "mosaic_gpu_fp8_matmul_variants",
)
