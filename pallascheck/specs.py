"""Check your own kernel: spec builders per op family, and the pytest glue.

    from pallascheck.specs import attention_like, spec_tests
    spec = attention_like(my_attention, name="my_attention", causal=(False, True))
    test_my_attention = spec_tests(spec)

A kernel no family covers: ``from_reference(kernel, reference, inputs=..., facts=...)``
derives the oracle and the bound from your own jax.numpy reference.

Each family builder takes your function and the facts only you know (layout, scale
convention, options, blocks along the reductions) and returns a ``KernelSpec`` with
our float64 oracle, derived bounds, adversarial strategies, gradients, relations and
bad inputs. Override one piece with ``dataclasses.replace(spec, oracle=...)``.
"""
from typing import Any

from pallascheck.properties.attention_spec import Blocks as AttentionBlocks
from pallascheck.properties.attention_spec import attention_like
from pallascheck.oracles.derive import Facts
from pallascheck.oracles.tolerance import PAIRWISE, SEQUENTIAL, blocked
from pallascheck.properties.cross_entropy_spec import Blocks as CrossEntropyBlocks
from pallascheck.properties.cross_entropy_spec import cross_entropy_like
from pallascheck.properties.derived_spec import Input, from_reference
from pallascheck.properties.elementwise_spec import Compute as ElementwiseCompute
from pallascheck.properties.elementwise_spec import elementwise_like
from pallascheck.properties.matmul_spec import Blocks as MatmulBlocks
from pallascheck.properties.matmul_spec import matmul_like
from pallascheck.properties.norms_spec import Blocks as NormBlocks
from pallascheck.properties.norms_spec import norm_like
from pallascheck.properties.ragged_dot_spec import Blocks as GroupedMatmulBlocks
from pallascheck.properties.ragged_dot_spec import grouped_matmul_like
from pallascheck.properties.softmax_spec import Blocks as SoftmaxBlocks
from pallascheck.properties.softmax_spec import softmax_like
from pallascheck.properties.spec import KernelSpec, register
from pallascheck.properties.top_k_spec import top_k_like



def __getattr__(name: str) -> Any:
    # spec_tests is pytest glue: imported on first use, so that building and checking
    # specs (verify, fuzz, notebooks) needs no pytest.
    if name == "spec_tests":
        from pallascheck.properties.pytest_plugin import spec_tests

        return spec_tests
    raise AttributeError(f"module 'pallascheck.specs' has no attribute {name!r}")


__all__ = [
    "PAIRWISE", "SEQUENTIAL", "AttentionBlocks", "CrossEntropyBlocks", "ElementwiseCompute", "Facts",
    "GroupedMatmulBlocks", "Input", "KernelSpec", "MatmulBlocks", "NormBlocks", "SoftmaxBlocks", "attention_like",
    "blocked", "cross_entropy_like", "elementwise_like", "from_reference", "grouped_matmul_like", "matmul_like",
    "norm_like", "register", "softmax_like", "spec_tests", "top_k_like",
]
