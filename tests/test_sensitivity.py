"""Sensitivity of the harness: every deliberately broken kernel in tests/broken/
must be caught by the same checks that pass the real kernels. The fraction caught
is the kill rate; anything below 100% fails the suite."""
from __future__ import annotations

import pytest

from broken import matmul_variants, norms_variants
from pallascheck.properties import runner
from pallascheck.properties.matmul_spec import make_spec as matmul_spec
from pallascheck.properties.norms_spec import make_spec as norm_spec

# Enough examples for Hypothesis to reach the triggering shapes (ragged K, an
# activation); a caught variant stops at its first failing example.
EXAMPLES = 30
ALL = ("float32", "bfloat16", "float16")

# variant -> (spec of the broken kernel, dtypes where it is wrong)
MATMUL = {
    name: (matmul_spec(fn, name=f"matmul[{name}]", differentiable=grads), ALL)
    for name, (fn, grads) in matmul_variants.VARIANTS.items()
}
# An input-dtype accumulator is the real kernel when the input is f32.
MATMUL["input_dtype_accumulator"] = (MATMUL["input_dtype_accumulator"][0], ("bfloat16", "float16"))

NORMS = {
    name: (norm_spec(kind, fn, name=f"{kind}[{name}]"), ALL)
    for name, (kind, fn) in norms_variants.VARIANTS.items()
}
# E[x^2] - E[x]^2 computed in f32 is the real kernel's precision class for f32 input
# only in the one-pass sense; in bf16/f16 it cancels catastrophically.
NORMS["ln_one_pass_variance_in_input_dtype"] = (NORMS["ln_one_pass_variance_in_input_dtype"][0], ("bfloat16", "float16"))

VARIANTS = {**{f"matmul/{k}": v for k, v in MATMUL.items()}, **{f"norms/{k}": v for k, v in NORMS.items()}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_broken_variant_is_caught(variant: str, backend) -> None:
    spec, dtypes = VARIANTS[variant]
    survived = []
    for dtype in dtypes:
        tally = runner.run_property(spec, dtype, backend, examples=EXAMPLES, seed=0)
        if not tally.failure:
            survived.append(dtype)
    assert not survived, f"{variant} survived {EXAMPLES} examples on {survived}"
