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

from typing import TYPE_CHECKING, Any

from pallascheck.oracles.derive import Facts
from pallascheck.oracles.tolerance import PAIRWISE, SEQUENTIAL, blocked
from pallascheck.properties.families.attention import Blocks as AttentionBlocks
from pallascheck.properties.families.attention import attention_like
from pallascheck.properties.families.cross_entropy import Blocks as CrossEntropyBlocks
from pallascheck.properties.families.cross_entropy import cross_entropy_like
from pallascheck.properties.families.derived import Input, from_reference
from pallascheck.properties.families.elementwise import Compute as ElementwiseCompute
from pallascheck.properties.families.elementwise import elementwise_like
from pallascheck.properties.families.matmul import Blocks as MatmulBlocks
from pallascheck.properties.families.matmul import matmul_like
from pallascheck.properties.families.norms import Blocks as NormBlocks
from pallascheck.properties.families.norms import norm_like
from pallascheck.properties.families.ragged_dot import Blocks as GroupedMatmulBlocks
from pallascheck.properties.families.ragged_dot import grouped_matmul_like
from pallascheck.properties.families.softmax import Blocks as SoftmaxBlocks
from pallascheck.properties.families.softmax import softmax_like
from pallascheck.properties.families.top_k import top_k_like
from pallascheck.properties.registry import register
from pallascheck.properties.spec import CodePath, KernelSpec

if TYPE_CHECKING:  # at run time, on first use (__getattr__)
    from pallascheck.properties.pytest_plugin import spec_tests


def __getattr__(name: str) -> Any:
    # spec_tests is pytest glue: imported on first use, so that building and checking
    # specs (verify, fuzz, notebooks) needs no pytest.
    if name == "spec_tests":
        from pallascheck.properties.pytest_plugin import spec_tests

        return spec_tests
    raise AttributeError(f"module 'pallascheck.specs' has no attribute {name!r}")


__all__ = [
    "PAIRWISE",
    "CodePath",
    "SEQUENTIAL",
    "AttentionBlocks",
    "CrossEntropyBlocks",
    "ElementwiseCompute",
    "Facts",
    "GroupedMatmulBlocks",
    "Input",
    "KernelSpec",
    "MatmulBlocks",
    "NormBlocks",
    "SoftmaxBlocks",
    "attention_like",
    "blocked",
    "cross_entropy_like",
    "elementwise_like",
    "from_reference",
    "grouped_matmul_like",
    "matmul_like",
    "norm_like",
    "register",
    "softmax_like",
    "spec_tests",
    "top_k_like",
]
