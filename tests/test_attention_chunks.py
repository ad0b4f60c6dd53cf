"""A large attention case's device oracle is computed in chunks of query rows
(properties/families/attention_slices.py), a causal chunk over the keys its rows see
and a stand-in for the rest: the chunks' oracle output, bound, contract, float64
gradients and gradient bounds are the whole case's, elementwise. Device
oracles run on the CPU here (``numeric.on_device``, as tests/test_device_oracles.py);
a small ``SLICE_ELEMENTS`` makes small cases chunk."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

from pallascheck.kernels.backends import Backend
from pallascheck.oracles import numeric
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import runner
from pallascheck.properties.device import programs as device_programs
from pallascheck.properties.families import attention_slices
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case

# Values: a chunk's sums over rows (dk, dv, dbias) and its programs' other shapes
# reassociate float64 sums of n <= 256 terms, |delta| <= n 2^-53 sum|terms|, where
# every bound is >= 2^-24 sum|terms| (an f32 accumulation's gamma): <= 2^-21 bound.
VALUE_OF_BOUND = 2.0**-20
# Bounds: sums of non-negative terms (no cancellation), reassociated: <= n 2^-53
# relative for n <= 256 terms.
BOUND_RTOL = 2.0**-45


def _case(
    b: int,
    sq: int,
    skv: int,
    h: int,
    hkv: int,
    *,
    causal: bool,
    bias: tuple[int, ...] | None = None,
    mask: tuple[int, ...] | None = None,
    dtype: type = ml_dtypes.bfloat16,
) -> Case:
    rng = np.random.default_rng(sq * skv + h)
    arrays = {
        "q": rng.standard_normal((b, sq, h, 16)),
        "k": rng.standard_normal((b, skv, hkv, 16)),
        "v": rng.standard_normal((b, skv, hkv, 16)),
        "cotangent": rng.standard_normal((b, sq, h, 16)),
    }
    if bias is not None:  # -inf entries mask their keys
        arrays["bias"] = np.where(rng.random(bias) < 0.1, -np.inf, rng.standard_normal(bias))
    arrays = {name: a.astype(dtype) for name, a in arrays.items()}
    if mask is not None:
        arrays["mask"] = rng.random(mask) < 0.8
    return Case(arrays, {"causal": causal, "sm_scale": None})


def _evaluate(case: Case, held: bool = False) -> tuple[object, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The oracle (a ``Sliced`` plan when chunked), then every value and bound the
    spec computes from it, as numpy arrays; ``held``: a chunked case's results held
    on the host (``numeric.on_device``)."""
    spec, arith = get_spec("attention"), arithmetic_for(Backend("interpret"))
    with numeric.on_device(jax.devices("cpu")[0], hold_results=held):
        ref = spec.oracle(case)
        values = {"out": spec.expected(ref)}
        bounds = {
            "out": spec.bound(case, ref, spec.default_config, arith),
            "contract out": spec.contract(case, ref, arith),
        }
        grads = spec.gradients.oracle_vjp(case, ref)
        values.update(grads)
        bounds.update(spec.gradients.bound(case, ref, grads, spec.default_config, arith))
        contract = spec.gradients.contract(case, ref, grads, arith)
        bounds.update({f"contract {k}": v for k, v in contract.items()})
    held = all(isinstance(x, np.ndarray) for x in [*values.values(), *bounds.values()])
    HELD_ON_HOST[id(case)] = held
    return ref, {k: np.asarray(v) for k, v in values.items()}, {k: np.asarray(v) for k, v in bounds.items()}


HELD_ON_HOST: dict[int, bool] = {}  # per case evaluated: whether all its results came back as numpy arrays


CASES = {
    # sliced by batch row and kv head, then 3 chunks of 16 of 48 queries on 20 keys
    "causal, sq > skv, GQA, 4-D mask": (_case(2, 48, 20, 4, 2, causal=True, mask=(2, 4, 48, 20)), 2 * 16 * 20, 16),
    # a per-key bias: sliced by batch row only; its gradient sums over the chunks;
    # 36 queries in chunks of 8, the last of 4, on 52 keys
    "causal, sq < skv, per-key bias": (_case(2, 36, 52, 4, 2, causal=True, bias=(2, 1, 1, 52)), 4 * 52 * 8, 8),
    # MQA, one batch row: not sliced, chunked; a bias with rows: its gradient concatenated
    "non-causal, full bias, MQA, float32": (
        _case(1, 40, 24, 2, 1, causal=False, bias=(1, 2, 40, 24), dtype=np.float32),
        2 * 24 * 16,
        16,
    ),
    # causal sq == skv, MQA, a full bias (rows and keys): 40 queries in chunks of 16,
    # the last of 8; the first two chunks see a prefix of the keys
    "causal, sq == skv, full bias, MQA, float32": (
        _case(1, 40, 40, 2, 1, causal=True, bias=(1, 2, 40, 40), dtype=np.float32),
        2 * 40 * 16,
        16,
    ),
    # a 2-D bias and mask (shared by batch and heads: not sliced) in chunks of one row,
    # where a chunk's bias rows look like a bias broadcast over rows
    "causal, 2-D bias and mask, one-row chunks": (
        _case(2, 12, 20, 2, 2, causal=True, bias=(12, 20), mask=(12, 20)),
        1,
        1,
    ),
}


# every case with its results on the device; held on the host, with the default
# gathering (a slice's chunks joined before their copy to the host) and with each
# chunk's rows copied alone (1), a case sliced by batch and head and one whose bias has
# rows (a dbias gathered by rows): the held path's placing by slice, row and key
HELD = ("causal, sq > skv, GQA, 4-D mask", "non-causal, full bias, MQA, float32")
GATHERED = (
    [(name, attention_slices.GATHER_ELEMENTS, False) for name in CASES]
    + [(name, attention_slices.GATHER_ELEMENTS, True) for name in HELD]
    + [(name, 1, True) for name in HELD]
)


@pytest.mark.parametrize(("name", "gather", "held"), GATHERED)
def test_chunked_oracle_and_bounds_are_the_whole_ones(
    name: str, gather: int, held: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    case, threshold, rows = CASES[name]
    monkeypatch.setattr(attention_slices, "GATHER_ELEMENTS", gather)
    whole_ref, whole, whole_bound = _evaluate(case, held)
    assert not HELD_ON_HOST[id(case)]  # a whole case's results stay on the device
    monkeypatch.setattr(attention_slices, "SLICE_ELEMENTS", threshold)
    ref, chunked, chunked_bound = _evaluate(case, held)
    # a chunked pass holds them on the host where asked, else keeps them on the device
    assert HELD_ON_HOST[id(case)] == held
    assert type(whole_ref).__name__ == "AttentionOracle"
    assert isinstance(ref, attention_slices.Sliced) and ref.rows == rows  # chunked as planned
    assert set(chunked) == set(whole) and set(chunked_bound) == set(whole_bound)
    for key, value in whole.items():
        assert chunked[key].shape == value.shape, key
        finite = np.isfinite(value)
        np.testing.assert_array_equal(np.isfinite(chunked[key]), finite, err_msg=key)
        gap = np.abs(np.where(finite, chunked[key] - value, 0.0))
        assert np.all(gap <= VALUE_OF_BOUND * whole_bound[key]), (key, float(np.max(gap)))
    for key, bound in whole_bound.items():
        np.testing.assert_allclose(chunked_bound[key], bound, rtol=BOUND_RTOL, atol=0, err_msg=key)


def _shaped(*shape: int) -> np.ndarray:
    """An array of ``shape`` that holds no memory: planning reads shapes only."""
    return np.broadcast_to(np.zeros((), ml_dtypes.bfloat16), shape)


def test_chunk_rule_at_production_lengths() -> None:
    """Rows per chunk: the largest power of two within SLICE_ELEMENTS (a multiple of
    128 from 128 up); slices that fit are not chunked; one row at least."""
    assert attention_slices.SLICE_ELEMENTS == 2**25
    rows = attention_slices._chunk_rows
    assert rows(2048, 4 * 4096) is None  # [4, 2048, 4096]: 2^25 elements fit
    assert rows(4096, 4 * 4096) == 2048
    assert rows(32768, 4 * 32768) == 256  # llama-3 8B at 32k: group 4
    assert rows(131072, 4 * 131072) == 64
    assert rows(4000, 16 * 4000) == 512  # not sliced by head: 16 heads; 4000 rows in 8 chunks
    assert rows(1024, 2**26) == 1  # one row over the budget: one row at a time

    def plan(s: int, on_device: bool = True) -> attention_slices.Sliced | None:
        kv = _shaped(1, s, 8, 128)
        case = Case({"q": _shaped(1, s, 32, 128), "k": kv, "v": kv}, {"causal": True, "sm_scale": None})
        if not on_device:
            return attention_slices._plan(case)
        with numeric.on_device(jax.devices("cpu")[0]):
            return attention_slices._plan(case)

    assert plan(32768, on_device=False) is None  # on the host: never sliced
    long = plan(32768)  # llama-3 8B at 32k: by kv head, 256 rows at a time
    assert long.slices == tuple((None, j) for j in range(8)) and long.rows == 256
    assert plan(2048).rows is None and len(plan(2048).slices) == 8  # a slice of [4, 2048, 2048] fits


def test_causal_chunks_compute_over_the_keys_they_see() -> None:
    """A causal chunk's keys: those its last row sees (bottom-right), rounded up to a
    multiple of an eighth of seq_kv; None (all of them) where that reaches seq_kv."""
    keys = attention_slices._visible_keys
    assert [keys(32768, 32768, f, 256) for f in (0, 3840, 4096, 28672, 32512)] == [
        4096,
        4096,
        8192,
        None,
        None,
    ]
    assert len({keys(32768, 32768, f, 256) for f in range(0, 32768, 256)}) == 8  # 7 prefixes and all
    assert keys(48, 20, 0, 16) == 4  # sq > skv: no key visible, one step at least
    assert keys(36, 52, 0, 8) == 24  # sq < skv: the first row sees 17 keys, the last 24
    assert keys(32767, 32767, 0, 256) == 4096  # unaligned: steps of 4096 still


def test_a_pass_joins_the_gradient_bound_and_its_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    """Asked in one round (as the runner asks them), the gradient bound and its contract
    of a chunked case are one call of the pass (``per_slice(fn, joins=1)``), and each
    is the whole case's, asked alone."""
    case, threshold, _ = CASES["causal, sq < skv, per-key bias"]
    _, _, whole_bound = _evaluate(case)
    monkeypatch.setattr(attention_slices, "SLICE_ELEMENTS", threshold)
    calls: list[tuple[int, int]] = []
    joined = attention_slices._joined

    def counted(asked: list[Any], joins: dict[Any, int]) -> tuple[list[Any], Callable[[list[Any]], list[Any]]]:
        requests, split = joined(asked, joins)
        calls.append((len(asked), len(requests)))
        return requests, split

    monkeypatch.setattr(attention_slices, "_joined", counted)
    spec, arith = get_spec("attention"), arithmetic_for(Backend("interpret"))
    device = jax.devices("cpu")[0]

    def on_device(fn: Callable[..., Any], *args: Any) -> Any:
        with numeric.on_device(device):
            return fn(*args)

    with numeric.on_device(device):
        ref = spec.oracle(case)
        grads = spec.gradients.oracle_vjp(case, ref)
        device_programs.asked_in_rounds(ref, [2])
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            bound = pool.submit(on_device, spec.gradients.bound, case, ref, grads, spec.default_config, arith)
            contract = pool.submit(on_device, spec.gradients.contract, case, ref, grads, arith)
            results = {**bound.result(), **{f"contract {k}": v for k, v in contract.result().items()}}
    assert calls[-1] == (2, 1)  # the two asked, one call served them
    assert set(results) == set(whole_bound) - {"out", "contract out"}
    for key, value in results.items():
        np.testing.assert_allclose(np.asarray(value), whole_bound[key], rtol=BOUND_RTOL, atol=0, err_msg=key)


def test_the_runner_asks_every_oracle_side_call_of_a_chunked_case_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's gradient bounds read no exact gradient, so the runner asks them with
    the oracle's own calls: one pass over the chunks serves all six (each chunk's oracle
    computed once, not once a round), and they are the whole case's."""
    case, threshold, _ = CASES["causal, sq < skv, per-key bias"]
    _, whole_grads, whole_bound = _evaluate(case)
    monkeypatch.setattr(attention_slices, "SLICE_ELEMENTS", threshold)
    spec, arith = get_spec("attention"), arithmetic_for(Backend("interpret"))
    device = jax.devices("cpu")[0]
    need = frozenset({"exact_gradients", "bound", "contract_bound", "gradient_contract_bound"})

    def on_device(call: Callable[[], Any]) -> Any:
        with numeric.on_device(device):
            return call()

    with numeric.on_device(device), concurrent.futures.ThreadPoolExecutor(8) as pool:
        ref = spec.oracle(case)
        got = runner._oracle_side(
            spec,
            case,
            ref,
            spec.default_config,
            spec.default_config,
            arith,
            need,
            has_gradients=True,
            reference_vjp=False,
            started=lambda call: pool.submit(on_device, call).result,
        )
        results = {name: get() for name, get in got.items()}
    assert ref.passes.served == [6], ref.passes.served
    assert set(results) == {"expected", "exact_gradients", "bound", "contract_bound", "gradient_bound"} | {
        "gradient_contract_bound"
    }
    for key, value in results["gradient_bound"].items():
        np.testing.assert_allclose(np.asarray(value), whole_bound[key], rtol=BOUND_RTOL, atol=0, err_msg=key)
    for key, value in results["exact_gradients"].items():  # reassociated sums: as above
        assert np.all(np.abs(np.asarray(value) - whole_grads[key]) <= VALUE_OF_BOUND * whole_bound[key]), key


def test_joined_calls_split_back() -> None:
    """``_joined``: calls of a joining function that agree on every other argument (the
    same arrays, equal statics) are one, their options in one order whatever the order
    asked, and each gets its own results back; other calls stay as they are."""
    joins, other = object(), object()
    grads, grads_too = {"dq": np.zeros(1)}, {"dq": np.zeros(1)}
    asked = [
        (joins, (grads, ("a",), "arith")),
        (other, (grads, ("x",), "arith")),
        (joins, (grads, ("b", "c"), "arith")),
        (joins, (grads_too, ("d",), "arith")),  # other arrays: its own call
        (joins, (grads, ("e",), "other arith")),  # another static: its own call
    ]
    calls, split = attention_slices._joined(asked, {joins: 1})
    assert calls == [
        (joins, (grads, ("a", "b", "c"), "arith")),
        (other, (grads, ("x",), "arith")),
        (joins, (grads_too, ("d",), "arith")),
        (joins, (grads, ("e",), "other arith")),
    ]
    results = [("A", "B", "C"), "X", ("D",), ("E",)]
    assert split(results) == [("A",), "X", ("B", "C"), ("D",), ("E",)]
    # asked in another order (the threads'): the same joint call, its results split back
    backwards, split = attention_slices._joined([asked[2], asked[0]], {joins: 1})
    assert backwards == [(joins, (grads, ("a", "b", "c"), "arith"))]
    assert split([("A", "B", "C")]) == [("B", "C"), ("A",)]
