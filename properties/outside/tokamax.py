"""Tokamax (openxla/tokamax, PyPI ``tokamax``) as an outside client: a spec for each of
its ops and implementations, built with the spec builders, named
``tokamax:<op>:<implementation>``, e.g. ``pallascheck verify --kernel
tokamax:layer_norm:xla``. Tokamax is optional (``pip install tokamax``, or the
``tokamax`` extra); ``names()`` lists these specs only where it is installed.

Each adapter below states how Tokamax's conventions map onto ours (scale, masks,
causal alignment, layouts, reductions, weight layout, what it accepts), read from
its sources (``tokamax/_src/ops/<op>/``); the checks, oracles and bounds are ours.

Backends. The XLA implementations (``xla``, ``xla_chunked``, ``chunked_xla``) contain
no Pallas call: their specs run on the ``interpret`` backend (the default), which
means "on the CPU, Pallas calls interpreted": there is nothing to interpret, so they
run as compiled XLA:CPU, IEEE arithmetic in an order XLA picks, which is what their
bounds assume (``arithmetic_for(Backend("interpret"))``). The builders hand them the
``interpret`` keyword like any function; they drop it.

The Pallas implementations run below Tokamax's device check ("Not supported on
cpu"): ``Op.bypass_device_check``, or the kernel function called directly.
tokamax 0.0.17 and jax 0.12.0.1 on the CPU:
- dot_product_attention "triton" (Pallas-Triton): the forward runs in Pallas'
  interpreter (``_pallas_interpreted``); its backward does not: "MLIR translation
  rule for primitive 'program_id' not found for platform cpu" (the backward kernel
  calls ``pl.program_id`` inside ``pl.when``, which the interpreter leaves unbound).
- dot_product_attention "mosaic", which is Mosaic TPU off NVIDIA GPUs (splash
  attention): forward and backward run in the TPU interpreter.
- ragged_dot "mosaic" on Hopper (the sm90 kernel): runs in the Mosaic GPU
  interpreter. Its sm80 kernel: "MLIR translation rule for primitive 'mma' not
  found for platform cpu"; sm100: "GPU interpret mode does not support
  `inline_mgpu`".
- dot_product_attention "mosaic" on NVIDIA GPUs: sm90 "GPU interpret mode does not
  support `inline_mgpu`" (its raw named-barrier calls); sm80 "Interpret mode does
  not support copy_gmem_to_smem without a barrier."; sm100 (collective) "Cluster
  barriers with `leader_tracked` are not yet supported in GPU kernel interpret mode."
- gated_linear_unit "mosaic": sm90 crashes inside the interpreter's wgmma
  ("'ReshapeTransform' object has no attribute 'indices'", with the SM count it
  reads from the device given as 2); sm80 the 'mma' rule as above; sm100
  ``inline_mgpu`` as above.
- layer_norm, gated_linear_unit and ragged_dot "triton" are Triton-language kernels
  (jax_triton), not Pallas: no interpreter runs them, and without a GPU install
  (``import triton``) Tokamax does not register them.
- ragged_dot "mosaic" with quantised weights (the sm90 kernel for int8/int4 rhs):
  "GPU interpret mode does not support `inline_mgpu`" (its warpgroup barriers);
  checked on the GPU only (``quantized_ragged_dot_mosaic_gpu``).
- ragged_dot "mosaic_tpu"/"mosaic_tpu_v2" and linear_softmax_cross_entropy_loss
  "mosaic_tpu" size their tiles from the TPU's hardware description: "Unsupported TPU
  device kind: cpu"; the ``use_abstract_mesh`` route that message suggests lowers
  for a TPU ("Passing lowering_platforms ... is required when only AbstractMesh
  exists"), not for the interpreter.

On an NVIDIA GPU (``--backend mosaic_gpu`` or ``triton``; Hopper for the Mosaic GPU
ones): the Triton attention forward and backward, the Mosaic GPU attention and ragged
dot through Tokamax's API (its heuristics' configs, forward and backward), and cuDNN's
attention (``implementation="cudnn"``, through ``jax.nn``; forward only, see
``attention_cudnn``). The findings on the GPU are in tests/test_tokamax.py
(``GPU_FINDINGS`` and the tests after it) and the README. The Triton-language
kernels (layer_norm, gated_linear_unit and ragged_dot "triton") need ``jax_triton``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import importlib.util
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from pallascheck.kernels.backends import MOSAIC_GPU, get_backend
from pallascheck.properties import builders
from pallascheck.properties.families import attention as attention_spec
from pallascheck.properties.families import gated_linear_unit as gated_linear_unit_spec
from pallascheck.properties.families import (
    linear_cross_entropy as linear_cross_entropy_spec,
)
from pallascheck.properties.families import matmul as matmul_spec
from pallascheck.properties.families import norms as norms_spec
from pallascheck.properties.families import ragged_dot as ragged_dot_spec
from pallascheck.properties.families.cross_entropy import IGNORE_INDEX
from pallascheck.properties.spec import BadInput, Case, KernelSpec

XLA = ("interpret",)  # an XLA implementation: the CPU, nothing to interpret
# a GPU op that is not a Pallas call (cuDNN): either GPU backend name runs it as it is
GPU = ("triton", "mosaic_gpu")
PIP = "pip install tokamax (or pip install 'pallascheck[tokamax]')"
LOW = ("bfloat16", "float16")
# Tokamax's attention asks XLA for F16_F16_F32 dots, which XLA:CPU refuses ("The
# precision 'F16_F16_F32' is not supported by dot_general on CPU")
ON_CPU = ("float32", "bfloat16")


def installed() -> bool:
    """Whether Tokamax is installed here (found on the path, not imported: that takes seconds)."""
    return importlib.util.find_spec("tokamax") is not None


def _tokamax(module: str = "") -> Any:
    """``tokamax`` or ``tokamax.<module>``, imported on first use."""
    try:
        return importlib.import_module("tokamax" + (f".{module}" if module else ""))
    except ModuleNotFoundError as err:
        if err.name != "tokamax":
            raise
        raise ModuleNotFoundError(
            f"the tokamax:* specs check Tokamax, which is not installed: {PIP}", name="tokamax"
        ) from None


def _xla(call: Callable[..., jax.Array], static: tuple[str, ...] = ()) -> Callable[..., jax.Array]:
    """``call`` taking (and dropping) the builders' ``interpret`` keyword: an XLA
    implementation has no Pallas call to interpret. It runs as one ``jax.jit`` program
    per layout (shapes, dtypes and the ``static`` keywords), as its users run it.
    Called eagerly, each of its operations compiles as a program of its own for every
    new shape: test_tokamax.py compiled for 24.7 s so, 14.8 s under ``jit``."""
    compiled = jax.jit(call, static_argnames=static)

    def dropping(*args: Any, interpret: Any, **kwargs: Any) -> jax.Array:
        del interpret
        return compiled(*args, **kwargs)

    return dropping


def _implementation(module: str, name: str, config: Any = None, vjp_config: Any = None) -> Any:
    """Tokamax's op ``name`` of ``tokamax._src.ops.<module>.api.IMPLEMENTATIONS``,
    with ``config`` (forward) and ``vjp_config`` (its VJP op's) pinned where given,
    else the configs its heuristics pick per call."""
    op = _tokamax(f"_src.ops.{module}.api").IMPLEMENTATIONS[name]
    if config is not None:
        op = op.replace(config=config)
    if vjp_config is not None:
        op = op.replace(vjp=op.vjp.replace(config=vjp_config))
    return op


# ------------------------------------------------------------------------ layer_norm


def layer_norm(kind: str) -> KernelSpec:
    """``tokamax.layer_norm(x, scale, offset, epsilon=, implementation="xla")``: over the
    last axis, x upcast to f32, mean, then the mean of squares of the centred x (two
    passes, as ours), ``rsqrt(var + epsilon)``, ``* (scale + scale_offset) + offset``
    in f32, one rounding to x's dtype; its gradients are autodiff of that f32 graph.
    ``epsilon`` is our ``eps``; ``scale``/``offset`` may be None (drawn both ways);
    ``scale_offset`` is left at 0.0 (a nonzero one adds a rounding of scale +
    scale_offset in f32 that our oracle, which takes the scale as given, does not
    model). ``kind="rms_norm"`` is ``subtract_mean=False`` (RMSNorm) with no offset."""
    tokamax = _tokamax()
    call: Callable[..., jax.Array]
    if kind == "layer_norm":

        def call(x: jax.Array, scale: Any, offset: Any, *, eps: float) -> jax.Array:
            return tokamax.layer_norm(x, scale, offset, epsilon=eps, implementation="xla")
    else:

        def call(x: jax.Array, scale: Any, *, eps: float) -> jax.Array:
            return tokamax.layer_norm(x, scale, None, epsilon=eps, subtract_mean=False, implementation="xla")

    return norms_spec.norm_like(
        _xla(call, ("eps",)),
        name=f"tokamax:{kind}:xla",
        kind=kind,
        optional_params=True,
        backends=XLA,
        interpret="interpret",
    )


# ------------------------------------------------------------------------ attention


def _key_zero_visible(case: Case) -> Case:
    """Key 0 made visible to every query (mask True, a -inf bias 0): Tokamax and we
    differ on a row with no visible key (``attention_xla``), so the main specs
    draw none; key 0 is visible under top-left causality whatever the query."""
    arrays = dict(case.arrays)
    if "mask" in arrays:
        arrays["mask"] = arrays["mask"].copy()
        arrays["mask"][..., 0] = True
    if "bias" in arrays:
        bias = arrays["bias"].copy()
        bias[..., 0] = np.where(np.isneginf(bias[..., 0]), 0, bias[..., 0])
        arrays["bias"] = bias
    return Case(arrays, case.params)


def _with_heads_axis(x: Any) -> Any:
    """A 2-D [sq, skv] bias or mask as [1, sq, skv]: Tokamax's annotations want at
    least [heads, sq, skv] (the same broadcast)."""
    return x[None] if x is not None and x.ndim == 2 else x


def attention_xla(implementation: str) -> KernelSpec:
    """``tokamax.dot_product_attention`` with ``implementation="xla"`` or
    ``"xla_chunked"``: [b, s, h, d] (ours), scale 1/sqrt(d) (``scale=None``), GQA with
    q heads grouped consecutively per kv head (ours), ``bias`` [b, h, sq, skv]
    broadcasting (added to the f32 logits), ``mask`` bool, True = visible (ours); both
    at least 3-D ([h, sq, skv]: ``_with_heads_axis``).
    ``is_causal`` aligns top-left (query i sees keys j <= i; ours is bottom-right), so
    causal cases have seq_q = seq_kv. Logits are an f32 dot (bf16/f16 products exact;
    f32 at DEFAULT precision: IEEE f32 on the CPU, tf32 on NVIDIA GPUs), scaled after
    it in f32; the softmax is in f32 (XLA:CPU keeps its weights in f32 for the p.v dot;
    the bound allows their rounding to v's dtype, as on tensor cores). A
    masked logit becomes f32's most negative finite number, not -inf: a row with no
    visible key gets uniform weights (the mean of v), where ours gives 0, and a row
    whose bias is -inf everywhere gives NaN; the cases have key 0 visible
    (``_key_zero_visible``).

    ``xla_chunked`` is called with chunks of (16 queries, 32 keys), not the API's
    (512, 1024), so that the drawn sequences (up to 129) span several kv chunks and
    its online softmax rescales: per chunk the same f32 logits, running max and sum,
    an f32 accumulator, divided at the end. Its gradients are autodiff through the
    chunk loop (it has no VJP of its own), which sums dk and dv over the query chunks
    in their own dtype; those of ``xla`` are autodiff of the softmax."""
    impl: tuple[Any, ...] | str  # Tokamax's implementation objects, or one's name
    if implementation == "xla_chunked":
        chunked = _implementation("attention", "xla_chunked").replace(chunk_size=(16, 32))
        impl, blocks = (chunked,), attention_spec.Blocks(block_k=32, qk_precision="default")
    else:
        impl, blocks = "xla", attention_spec.Blocks(qk_precision="default")
    return _api_spec(
        _xla(_api_call(impl), ("causal",)),
        f"tokamax:dot_product_attention:{implementation}",
        blocks=blocks,
        dtypes=ON_CPU,
        backends=XLA,
        interpret="interpret",
    )


def _api_call(implementation: Any) -> Callable[..., jax.Array]:
    """``tokamax.dot_product_attention`` with ``implementation``, taking our options:
    ``causal``, ``bias`` and ``mask`` (made at least 3-D)."""
    tokamax = _tokamax()

    def call(
        q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, bias: Any = None, mask: Any = None
    ) -> jax.Array:
        return tokamax.dot_product_attention(
            q,
            k,
            v,
            bias=_with_heads_axis(bias),
            mask=_with_heads_axis(mask),
            is_causal=causal,
            implementation=implementation,
        )

    return call


def _api_spec(call: Callable[..., jax.Array], name: str, **options: Any) -> KernelSpec:
    """``attention_like`` with the API's conventions (causal or not, aligned top-left;
    a bias and a mask), its cases with key 0 visible to every query (``_key_zero_visible``)."""
    spec = attention_spec.attention_like(
        call, name=name, causal=(False, True), causal_alignment="top_left", bias=True, mask=True, **options
    )
    return dataclasses.replace(spec, cases=lambda dtype, backend: spec.cases(dtype, backend).map(_key_zero_visible))


TRITON_BLOCK_Q, TRITON_BLOCK_K = 16, 32


@contextlib.contextmanager
def _pallas_interpreted() -> Iterator[None]:
    """Tokamax's Pallas-Triton kernels with ``interpret=True``: they pass no
    ``interpret`` of their own and JAX has no context forcing its generic interpreter,
    so Tokamax's one ``pallas_call`` wrapper (``tokamax._src.pallas.block``) adds it."""
    block = _tokamax("_src.pallas.block")
    pallas_call = block.pallas_call
    with mock.patch.object(block, "pallas_call", functools.partial(pallas_call, interpret=True)):
        yield


def attention_triton(differentiable: bool = True) -> KernelSpec:
    """``tokamax.dot_product_attention(..., implementation="triton")``: Tokamax's
    Pallas-Triton flash attention (``PallasTritonFlashAttention``) with fixed blocks:
    forward (block_q, block_k) = (16, 32), backward (q, kv) blocks (16, 32) for both
    its dk/dv and dq passes. Conventions as ``attention_xla`` (it shares the API:
    scale, GQA, mask, top-left causality); arithmetic: q scaled by the softmax scale
    in q's dtype before the dot (``values * const_scale``), f32 logits from a dot at
    DEFAULT precision, online softmax in f32 with natural exp, p rounded to v's dtype
    for the p.v dot. On the CPU it runs in Pallas' interpreter below Tokamax's device
    check (``bypass_device_check``: it refuses "Not supported on cpu").

    Its gradients run on a GPU only: the backward kernel calls ``pl.program_id``
    inside ``pl.when``, which Pallas' interpreter does not substitute ("MLIR
    translation rule for primitive 'program_id' not found for platform cpu": the
    module docstring), so on the CPU only its forward checks can pass.
    ``differentiable=False``: the forward-only spec."""
    fwd = _tokamax("_src.ops.attention.pallas_triton")
    bwd = _tokamax("_src.ops.attention.pallas_triton_vjp")
    fwd_config = fwd.Config(block_q=TRITON_BLOCK_Q, block_k=TRITON_BLOCK_K, num_warps=4, num_stages=2)
    bwd_config = bwd.Config(
        block_m1=TRITON_BLOCK_Q,
        block_n1=TRITON_BLOCK_K,
        block_m2=TRITON_BLOCK_Q,
        block_n2=TRITON_BLOCK_K,
        num_warps=4,
        num_stages=2,
    )

    def call(
        q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool, bias: Any = None, mask: Any = None, interpret: bool
    ) -> jax.Array:
        op = fwd.PallasTritonFlashAttention(
            config=fwd_config,
            bypass_device_check=interpret,
            vjp=bwd.PallasTritonFlashAttentionVjp(config=bwd_config, bypass_device_check=interpret),
        )
        with _pallas_interpreted() if interpret else contextlib.nullcontext():
            return _api_call((op,))(q, k, v, causal=causal, bias=bias, mask=mask)

    spec = _api_spec(
        call,
        "tokamax:dot_product_attention:triton",
        blocks=attention_spec.Blocks(TRITON_BLOCK_K, TRITON_BLOCK_Q, TRITON_BLOCK_K, qk_precision="default"),
        dtypes=ON_CPU,
        differentiable=differentiable,
        backends=("interpret", "triton"),
        interpret="interpret",
    )
    if not differentiable:
        return spec
    gradients = spec.gradients
    if gradients is None:
        raise ValueError(f"{spec.name}: a differentiable spec has gradients")
    vjp = gradients.kernel_vjp

    def kernel_vjp(case: Case, config: Any, backend: Any) -> Any:
        # the backward kernels are traced when the pullback runs, after ``call`` returned
        with _pallas_interpreted() if backend.name == "interpret" else contextlib.nullcontext():
            return vjp(case, config, backend)

    return dataclasses.replace(spec, gradients=dataclasses.replace(gradients, kernel_vjp=kernel_vjp))


def attention_mosaic_gpu(config: Any = None, vjp_config: Any = None) -> KernelSpec:
    """``tokamax.dot_product_attention(..., implementation="mosaic")`` on a Hopper GPU:
    Tokamax's Mosaic GPU flash attention (``pallas_mosaic_gpu_kernel_sm90``; two
    consumer warpgroups, TMA, wgmma) and its Mosaic GPU VJP, bf16/f16. Conventions as
    ``attention_xla`` (the same API), masked logits -inf. Arithmetic, from its source:
    f32 logits from a wgmma (bf16/f16 products exact), multiplied in f32 by the
    softmax scale times log2(e), exp2, an online softmax in f32 over kv blocks of
    ``block_kv``, p rounded to v's dtype for the p.v wgmma, one rounding of the output.
    ``config``/``vjp_config`` pin its configs (the autotuner check); without them its
    heuristics choose per shape, so the bound takes the kv block as unknown (the
    whole sequence, which bounds every blocking); with them, the forward's
    ``block_kv`` and the backward's dk/dv q block and dq kv block. Some drawn case
    fails to lower ("async_copy requires all GMEM strides except the last one to be a
    multiple of 16 bytes"; GPU_FINDINGS in tests/test_tokamax.py)."""
    op = _implementation("attention", "mosaic_gpu", config, vjp_config)
    blocks = attention_spec.Blocks(
        block_k=None if config is None else config.block_kv,
        block_q_bwd=None if vjp_config is None else vjp_config.block_q_dkv,
        block_k_bwd=None if vjp_config is None else vjp_config.block_kv_dq,
        exp2=True,
    )
    return _api_spec(
        _api_call((op,)),
        "tokamax:dot_product_attention:mosaic_gpu",
        seq_q=(17, 64, 128),
        seq_kv=(17, 64, 129, 256),
        head_dims=(64, 128),
        blocks=blocks,
        dtypes=LOW,
        backends=("mosaic_gpu",),
    )


def attention_cudnn() -> KernelSpec:
    """``tokamax.dot_product_attention(..., implementation="cudnn")``: cuDNN's fused
    flash attention through ``jax.nn.dot_product_attention(implementation="cudnn")``,
    bf16/f16, on any NVIDIA GPU backend (it is not a Pallas call). Conventions as
    ``attention_xla``. cuDNN's blocking and exp form are not published: the bound
    takes the kv block as unknown (the whole sequence, which bounds every blocking)
    and charges the exp2 form's extra rounding of the scaled logits. Forward only: its
    gradients raise "vjp not implemented" at lengths that are not a multiple of 64
    (17 and 129, which the spec draws; tests/test_tokamax.py), with or without a bias."""
    return _api_spec(
        _api_call("cudnn"),
        "tokamax:dot_product_attention:cudnn",
        blocks=attention_spec.Blocks(exp2=True),
        dtypes=LOW,
        differentiable=False,
        backends=GPU,
    )


SPLASH_BLOCK = 128


def _first_batch(case: Case) -> Case:
    """The case's first batch element (q, k, v and the cotangent hold the batch axis)."""
    return Case({n: a[:1] for n, a in case.arrays.items()}, case.params)


def attention_mosaic_tpu() -> KernelSpec:
    """``tokamax.dot_product_attention(..., implementation="mosaic")`` off NVIDIA GPUs:
    Tokamax's Mosaic TPU flash attention (splash attention) with its heuristic blocks
    of 128 (forward q, kv and kv compute; backward dq/dkv), f32 and bf16, sequences a
    multiple of 128. Conventions as ``attention_xla``, with no bias (it refuses one)
    and no mask (a boolean mask must be one for all heads: "Only num_mask_heads=1 is
    supported with a boolean mask"). Arithmetic: q multiplied by the softmax scale in
    q's dtype (``q *= logits_scale``) and, inside the splash kernel, by log2(e) in q's
    dtype (``use_base2_exp``: exp2 of the logits), f32 logits, online softmax in f32.
    On the CPU it runs in the TPU
    interpreter below Tokamax's device check, one batch element per case: JAX's TPU
    interpreter fails on the batched (vmapped) kernel under its grid shuffle
    ("safe_zip() argument 1 has length 2 but argument 0 has length 3", in
    ``_get_randomized_grid_coordinates``), whatever Tokamax does."""
    tokamax = _tokamax()
    op = _implementation("attention", "mosaic_tpu").replace(bypass_device_check=True)
    op = op.replace(vjp=op.vjp.replace(bypass_device_check=True))

    def call(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool) -> jax.Array:
        return tokamax.dot_product_attention(q, k, v, is_causal=causal, implementation=(op,))

    spec = attention_spec.attention_like(
        call,
        name="tokamax:dot_product_attention:mosaic_tpu",
        causal=(False, True),
        causal_alignment="top_left",
        seq_q=(SPLASH_BLOCK, 2 * SPLASH_BLOCK),
        seq_kv=(SPLASH_BLOCK, 2 * SPLASH_BLOCK),
        head_dims=(64, 128),
        blocks=attention_spec.Blocks(SPLASH_BLOCK, SPLASH_BLOCK, SPLASH_BLOCK, qk_precision="default", exp2=True),
        dtypes=ON_CPU,
        backends=("tpu_interpret", "tpu"),
    )
    return dataclasses.replace(spec, cases=lambda dtype, backend: spec.cases(dtype, backend).map(_first_batch))


# ------------------------------------------------------------------------ gated linear unit


def _gelu_exact(z: jax.Array) -> jax.Array:
    return jax.nn.gelu(z, approximate=False)


def _gelu_tanh(z: jax.Array) -> jax.Array:
    return jax.nn.gelu(z, approximate=True)


# Our activation names -> what Tokamax takes: a function applied to the f32 gate
# (a functools.partial fails: Tokamax writes its arguments into the HLO as JSON,
# "PydanticSerializationError: Unable to serialize unknown type: functools.partial")
ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array] | None] = {
    "none": None,
    "relu": jax.nn.relu,
    "gelu": _gelu_exact,
    "gelu_tanh": _gelu_tanh,
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
}


def gated_linear_unit() -> KernelSpec:
    """``tokamax.gated_linear_unit(x, weights, activation=, implementation="xla")``:
    fused weights [K, 2, N] with ``weights[:, 0]`` the gate and ``weights[:, 1]`` the
    up projection (our layout), ``activation(x @ gate) * (x @ up)``; the activation is
    a callable (ours by name, mapped to ``jax.nn``: gelu exact, gelu_tanh
    ``approximate=True``, silu, relu, sigmoid, none). Its arithmetic: one einsum of x
    with both projections, **output in x's dtype** (f32 accumulation, then rounded to
    bf16/f16), upcast to f32 for the activation and the product, one rounding to x's
    dtype; gradients are autodiff of that graph. The bound is ours for one XLA dot per
    projection in any order, gate and up kept in f32 (our xla_reference)."""
    tokamax = _tokamax()

    def call(x: jax.Array, weights: jax.Array, *, activation: str) -> jax.Array:
        return tokamax.gated_linear_unit(x, weights, activation=ACTIVATIONS[activation], implementation="xla")

    compiled = _xla(call, ("activation",))

    def adapted(
        x: jax.Array, weights: jax.Array, *, activation: str, config: Any = None, backend: Any = None
    ) -> jax.Array:
        del config  # one fixed (unknown) order
        return builders.call_on(compiled, get_backend(backend), XLA, "interpret", x, weights, activation=activation)

    def bad() -> list[BadInput]:
        x, weights = jnp.ones((4, 8), jnp.float32), jnp.ones((7, 2, 16), jnp.float32)
        return [
            builders.must_refuse(
                "contracting dimensions differ", lambda: adapted(x, weights, activation="silu", backend="interpret")
            )
        ]

    spec = gated_linear_unit_spec.make_spec(adapted, "tokamax:gated_linear_unit:xla")
    blocks = matmul_spec.Blocks()
    return dataclasses.replace(
        spec,
        configs=lambda case, backend: [blocks],
        default_config=blocks,
        # one config of its own: our GLU's config names are not its to meet
        parameters=tuple(p for p in spec.parameters if p.name != "config"),
        bad_inputs=bad,
        backends=XLA,
        dtypes_on={},
        default_config_on={},
    )


# ------------------------------------------------------------------------ ragged_dot


def ragged_dot() -> KernelSpec:
    """``tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="xla")``:
    ``jax.lax.ragged_dot``'s semantics (ours: lhs [m, k], rhs [g, k, n], rows past
    sum(group_sizes) 0), ``lax.ragged_dot_general`` accumulating in f32, one rounding
    to the inputs' dtype; gradients are autodiff of that (two more ragged dots)."""
    tokamax = _tokamax()

    def call(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation="xla")

    return ragged_dot_spec.grouped_matmul_like(
        _xla(call), name="tokamax:ragged_dot:xla", backends=XLA, interpret="interpret"
    )


RAGGED_BLOCK = 64


def ragged_dot_mosaic_gpu(rows_outside_groups: str = "unwritten") -> KernelSpec:
    """Tokamax's Hopper ragged dot (``pallas_mosaic_gpu_kernel_sm90.ragged_dot_kernel``,
    what ``implementation="mosaic"`` runs on an H100/H200), called directly below the
    op's device and architecture checks, with the config its heuristics pick for
    unquantized inputs (blocks 64 x 64, non-persistent grid) and block_k 64: bf16/f16,
    k a multiple of 64, output in the inputs' dtype; forward only (the op's VJP is
    more ragged-dot kernels, not this function's). It writes only the rows of each
    group (``copy_ragged_smem_to_gmem``): rows past sum(group_sizes) are never
    written, so its spec promises nothing there (``rows_outside_groups``)."""
    kernels = _tokamax("_src.ops.ragged_dot.pallas_mosaic_gpu_kernel_sm90")
    common = _tokamax("_src.ops.ragged_dot.pallas_mosaic_gpu_common")
    config = common.Config(
        block_m=RAGGED_BLOCK,
        block_n=RAGGED_BLOCK,
        block_k=RAGGED_BLOCK,
        num_stages=2,
        split_k=1,
        persistent=False,
        grid_minor_dim=common.MatmulDimension.M,
        grid_tile_width=1,
    )

    def call(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return kernels.ragged_dot_kernel(lhs, rhs, group_sizes, lhs.dtype, config)

    return ragged_dot_spec.grouped_matmul_like(
        call,
        name="tokamax:ragged_dot:mosaic_gpu",
        m=(64, 200),
        n=(64, 128),
        k=(64, 128),
        rows_outside_groups=rows_outside_groups,
        blocks=ragged_dot_spec.Blocks(block_k=RAGGED_BLOCK),
        dtypes=LOW,
        differentiable=False,
        backends=MOSAIC_GPU,
    )


def ragged_dot_mosaic_gpu_api(config: Any = None) -> KernelSpec:
    """``tokamax.ragged_dot(..., implementation="mosaic")`` on a Hopper GPU: the sm90
    kernel through Tokamax's API, with the config its heuristics pick (or ``config``:
    the autotuner check), forward and backward (its VJP is more Mosaic GPU ragged
    dots), bf16/f16. Its configs may split K (``split_k``) and pick any ``block_k``:
    the bound is the any-order one (every K sum one f32 chain in any order), which
    bounds every such split as long as the partial sums stay in f32. Rows past
    sum(group_sizes) are promised nothing (as the kernel called directly), so its
    cases have groups covering every row. Rows are multiples of 64: with m = 200
    its backward fails to lower ("dimension 1 must have size smaller or a multiple
    of its tiling 64, but got 200"; tests/test_tokamax.py shows it on the GPU)."""
    tokamax = _tokamax()
    op = _implementation("ragged_dot", "mosaic_gpu", config)

    def call(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        return tokamax.ragged_dot(lhs, rhs, group_sizes, implementation=(op,))

    return ragged_dot_spec.grouped_matmul_like(
        call,
        name="tokamax:ragged_dot:mosaic_gpu_api",
        m=(64, 256),
        n=(64, 128),
        k=(64, 128),
        rows_outside_groups="unwritten",
        dtypes=LOW,
        backends=("mosaic_gpu",),
    )


QUANTIZED_TYPES = ("int8", "int4")
QUANTIZED_TILE_K = 128  # one scale per output column and 128 rows of K, as Tokamax's W4A8 specs


def quantized_ragged_dot_mosaic_gpu(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, qtype: str
) -> tuple[jax.Array, np.ndarray]:
    """``tokamax.ragged_dot(lhs, qwix.quantize(rhs), ..., implementation="mosaic")`` on a
    Hopper GPU, which runs its sm90 quantised kernel (``ragged_dot_quantized_kernel``:
    the integer weights dequantised in registers to the scales' dtype, then a bf16
    wgmma), with the config its heuristics pick. rhs [g, k, n] is quantised by qwix
    to ``qtype`` (int8 or int4) with a scale per (group, 128 rows of K, column) in
    rhs's dtype. Returns the kernel's output and rhs dequantised exactly (q * scale in
    float64), the operand our ragged-dot oracle takes. GPU only: the kernel's
    warpgroup barriers are ``inline_mgpu`` calls, which the Mosaic GPU interpreter
    refuses ("GPU interpret mode does not support `inline_mgpu`"; tokamax 0.0.17)."""
    if qtype not in QUANTIZED_TYPES:
        raise ValueError(f"qtype must be one of {QUANTIZED_TYPES}, got {qtype!r}")
    if rhs.ndim != 3 or rhs.shape[1] % QUANTIZED_TILE_K:
        raise ValueError(f"rhs must be [g, k, n] with k a multiple of {QUANTIZED_TILE_K}, got shape {rhs.shape}")
    tokamax = _tokamax()
    qwix = importlib.import_module("qwix")
    quantized = qwix.quantize(rhs, qtype, channelwise_axes=(0, 2), tiled_axes={1: QUANTIZED_TILE_K})
    out = tokamax.ragged_dot(lhs, quantized, group_sizes, implementation="mosaic")
    scale = np.repeat(np.asarray(quantized.scale, np.float64), QUANTIZED_TILE_K, axis=1)
    return out, np.asarray(quantized.qvalue).astype(np.float64) * scale


# ------------------------------------------------------------------------ linear softmax cross-entropy


def _no_smoothing_none_ignored(case: Case) -> Case:
    """Tokamax has neither label smoothing nor an ignore index: smoothing 0, and each
    ignored token relabelled (its position modulo V), so "mean" is over all tokens
    in both semantics."""
    labels, vocab = case.arrays["labels"], case.arrays["w"].shape[1]
    relabelled = np.where(labels == IGNORE_INDEX, np.arange(labels.size) % vocab, labels).astype(labels.dtype)
    return Case({**case.arrays, "labels": relabelled}, {**case.params, "label_smoothing": 0.0})


def linear_softmax_cross_entropy(implementation: str) -> KernelSpec:
    """``tokamax.linear_softmax_cross_entropy_loss(x, labels, w, reduction=,
    implementation=)``: x [T, H], labels [T], w [H, V] (ours, argument order x,
    labels, w), reductions "sum", "mean" (over all T tokens) and "none"; no label
    smoothing and no ignore index (cases have neither: ``_no_smoothing_none_ignored``).

    ``xla`` (its reference): logits ``x @ w`` **in x's dtype**, ``log_softmax`` in that
    dtype, the loss per token summed in f32 (f32 output); gradients by its own VJP from
    the f32 lse: ``(softmax - onehot) @ w.T`` etc. in x's dtype. ``chunked_xla``: blocks
    of 1024 tokens and 2048 vocabulary columns (one block here), a running f32 lse, the
    target logit subtracted in x's dtype: ``loss = lse - z_y`` with the loss (and its
    sum) **in x's dtype**. The bound is ours for one XLA dot then cross-entropy in f32
    (our xla_reference), gradients every dot one chain in any order."""
    tokamax = _tokamax()

    def call(x: jax.Array, labels: jax.Array, w: jax.Array, *, reduction: str) -> jax.Array:
        return tokamax.linear_softmax_cross_entropy_loss(
            x, labels, w, reduction=reduction, implementation=implementation
        )

    compiled = _xla(call, ("reduction",))

    def adapted(
        x: jax.Array,
        w: jax.Array,
        labels: jax.Array,
        *,
        config: Any = None,
        backend: Any = None,
        label_smoothing: float,
        ignore_index: int,
        reduction: str,
    ) -> jax.Array:
        del config, ignore_index  # one fixed (unknown) order; no label is ignore_index
        if label_smoothing != 0.0:
            raise ValueError(f"Tokamax has no label smoothing, got {label_smoothing}")
        return builders.call_on(compiled, get_backend(backend), XLA, "interpret", x, labels, w, reduction=reduction)

    def bad() -> list[BadInput]:
        x, w, labels = jnp.zeros((4, 16), jnp.float32), jnp.zeros((16, 32), jnp.float32), jnp.zeros((3,), jnp.int32)
        return [
            builders.must_refuse(
                "labels one shorter than the tokens",
                lambda: adapted(
                    x, w, labels, backend="interpret", label_smoothing=0.0, ignore_index=IGNORE_INDEX, reduction="sum"
                ),
            )
        ]

    spec = linear_cross_entropy_spec.make_spec(adapted, f"tokamax:linear_softmax_cross_entropy_loss:{implementation}")
    gradients = spec.gradients
    if gradients is None or gradients.contract is None:
        raise ValueError(f"{spec.name}: the spec's gradients have a contract")
    contract = gradients.contract
    return dataclasses.replace(
        spec,
        cases=lambda dtype, backend: spec.cases(dtype, backend).map(_no_smoothing_none_ignored),
        configs=lambda case, backend: [None],
        default_config=None,
        bad_inputs=bad,
        backends=XLA,
        gradients=dataclasses.replace(
            gradients, bound=lambda case, ref, grads, config, arith: contract(case, ref, grads, arith)
        ),
    )


# ------------------------------------------------------------------------ registry

TOKAMAX: dict[str, Callable[[], KernelSpec]] = {
    "tokamax:layer_norm:xla": lambda: layer_norm("layer_norm"),
    "tokamax:rms_norm:xla": lambda: layer_norm("rms_norm"),
    "tokamax:dot_product_attention:xla": lambda: attention_xla("xla"),
    "tokamax:dot_product_attention:xla_chunked": lambda: attention_xla("xla_chunked"),
    "tokamax:dot_product_attention:triton": attention_triton,
    "tokamax:dot_product_attention:mosaic_tpu": attention_mosaic_tpu,
    "tokamax:dot_product_attention:mosaic_gpu": attention_mosaic_gpu,
    "tokamax:dot_product_attention:cudnn": attention_cudnn,
    "tokamax:gated_linear_unit:xla": gated_linear_unit,
    "tokamax:ragged_dot:xla": ragged_dot,
    "tokamax:ragged_dot:mosaic_gpu": ragged_dot_mosaic_gpu,
    "tokamax:ragged_dot:mosaic_gpu_api": ragged_dot_mosaic_gpu_api,
    "tokamax:linear_softmax_cross_entropy_loss:xla": lambda: linear_softmax_cross_entropy("xla"),
    "tokamax:linear_softmax_cross_entropy_loss:chunked_xla": lambda: linear_softmax_cross_entropy("chunked_xla"),
}


def names() -> list[str]:
    """The Tokamax specs, where Tokamax is installed (else none)."""
    return sorted(TOKAMAX) if installed() else []


@functools.cache
def spec(name: str) -> KernelSpec:
    """The spec of ``name``, built (and Tokamax imported) once."""
    if name not in TOKAMAX:
        raise KeyError(f"no Tokamax spec named {name!r}; there are: {sorted(TOKAMAX)}")
    return TOKAMAX[name]()
