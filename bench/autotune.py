"""Autotuning that validates numerics: ``pallascheck.autotune(fn, *args)``.

1. **Find the kernels.** ``fn(*args)`` runs once while ``kernels.pinning.recording``
   collects every pallascheck kernel call it makes (kernel, shapes, options, backend),
   once per backend tuned for (``$PALLASCHECK_BACKEND`` set to each in turn). Calls
   that pass a config themselves are left alone.
2. **Gate every candidate.** Each config of the kernel's autotuning space
   (``spec.configs``, the default config included) is checked against the float64
   oracle under the kernel's derived bound (values, and gradients where the kernel is
   differentiable) on the call's own inputs and on the spec's adversarial inputs with
   the same shapes (``KernelSpec.adversarial``, else one per element kind of
   ``properties.strategies``), before it is timed. Gates run several at a time in
   threads (their float64 bounds are the cost at large shapes). A config that fails a
   check, raises (a compile error, out of memory) or runs past ``timeout_s`` is
   rejected, with the reason kept; it is never chosen.
3. **Time the survivors**, alone on the device, on the call's own inputs (on the
   device before timing): after a warm-up each, ``repeats`` rounds that run every
   config once in a shuffled order (``bench.timing.interleaved_seconds``), so that
   drift falls on all alike; median and interquartile range.
4. **The result** (``AutotuneResult``) is a versioned JSON document: per call key the
   chosen config, the default, every candidate's time and budget used, the rejected
   configs with reasons, and the largest disagreement between two validated configs
   (as a fraction of their two bounds: what changing the config can do to the
   numbers). It is valid for the device kind and jax/jaxlib it was tuned with
   (``kernels.pinning``). ``with result:``, ``use_configs(path)`` or
   ``$PALLASCHECK_CONFIGS`` pin its configs for every kernel call with a matching key.

A hung config is abandoned after ``timeout_s`` (its thread cannot be stopped; the
tuner goes on with the next config); it is not isolated in a process.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import itertools
import json
import os
import statistics
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np

from pallascheck.bench.timing import interleaved_seconds
from pallascheck.kernels import pinning
from pallascheck.kernels.backends import ENV_VAR, Backend, NotOnBackend, get_backend
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks, runner, strategies
from pallascheck.properties.registry import get_spec
from pallascheck.properties.spec import Case, KernelSpec

# kernel name in pinning.Call -> spec name, where they differ
SPEC_NAMES = {"linear_cross_entropy": "linear_softmax_cross_entropy"}
INTEGER_ARRAYS = ("labels", "group_sizes")  # kept as recorded: their values are semantics, not data
GPU_BACKENDS = ("triton", "mosaic_gpu")


@dataclasses.dataclass
class AutotuneResult:
    """A parsed autotuning result (``pinning.parse_result``'s document)."""

    data: dict[str, Any]
    source: str = "<autotune result>"

    def __post_init__(self) -> None:
        self._stack: contextlib.ExitStack | None = None

    @property
    def entries(self) -> list[dict[str, Any]]:
        return self.data["entries"]

    def configs(self) -> dict[str, Any]:
        """Call key -> chosen config (empty, with a warning, on another device or jax)."""
        return pinning.pins_of(self.data, self.source)

    def dumps(self) -> str:
        return json.dumps(self.data, indent=1, sort_keys=True)

    @classmethod
    def loads(cls, text: str, source: str = "<string>") -> AutotuneResult:
        return cls(pinning.parse_result(text, source), source)

    def dump(self, path: str) -> None:
        with open(path, "w") as f:
            f.write(self.dumps())

    @classmethod
    def load(cls, path: str) -> AutotuneResult:
        with open(path) as f:
            return cls.loads(f.read(), path)

    def __enter__(self) -> AutotuneResult:
        self._stack = contextlib.ExitStack()
        self._stack.enter_context(pinning.pinned(self.configs()))
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._stack is not None
        self._stack.close()


@contextlib.contextmanager
def use_configs(path: str) -> Iterator[AutotuneResult]:
    """Every kernel call in the block uses the configs tuned in ``path``."""
    with AutotuneResult.load(path) as result:
        yield result


@contextlib.contextmanager
def _backend_env(name: str) -> Iterator[None]:
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = name
    try:
        yield
    finally:
        if old is None:
            del os.environ[ENV_VAR]
        else:
            os.environ[ENV_VAR] = old


def default_backends() -> list[str]:
    """The GPU backends that run here, else the session's backend."""
    if jax.default_backend() == "gpu":
        names = []
        for name in GPU_BACKENDS:
            try:
                Backend(name).require_available()
                names.append(name)
            except RuntimeError:
                pass
        return names
    return [get_backend().name]


def find_calls(
    fn: Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any], backends: Sequence[str]
) -> list[pinning.Call]:
    """The pallascheck kernel calls ``fn`` makes on each backend, one per key, those
    with a config chosen by the caller left out. A backend some kernel of ``fn`` has no
    version for is skipped with a warning."""
    calls: dict[str, pinning.Call] = {}
    for name in backends:
        with _backend_env(name), pinning.recording() as seen:
            try:
                jax.block_until_ready(fn(*args, **kwargs))
            except NotOnBackend as missing:
                warnings.warn(f"not tuned for {name}: {missing}", stacklevel=3)
                continue
        for call in seen:
            if not call.explicit_config:
                calls.setdefault(call.key, call)
    return list(calls.values())


def _concrete(call: pinning.Call, args: Sequence[Any], seed: int) -> dict[str, np.ndarray]:
    """The call's arrays: as recorded where concrete; where ``fn`` was traced, an
    argument of ``fn`` with the same shape and dtype, else N(0, 1) (zeros for integers)."""
    leaves = [np.asarray(x) for x in jax.tree_util.tree_leaves(args) if hasattr(x, "shape")]
    out = {}
    for i, (name, a) in enumerate(call.arrays.items()):
        if not isinstance(a, jax.ShapeDtypeStruct):
            out[name] = np.asarray(a)
            continue
        match = next((x for x in leaves if x.shape == a.shape and x.dtype == a.dtype), None)
        if match is not None:
            out[name] = match
        elif _is_float(a):
            out[name] = strategies.elements(seed + i, a.shape, a.dtype.name, "normal")
        else:
            out[name] = np.zeros(a.shape, a.dtype)
    return out


def gate_cases(
    spec: KernelSpec,
    params: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    backend: Backend,
    kinds: Sequence[str],
    seed: int = 0,
) -> list[Case]:
    """The call's own case, then the spec's adversarial cases at its shapes
    (``KernelSpec.adversarial``), or one per element kind in ``kinds``: the float arrays
    redrawn with that kind and the same shapes (``reduction``: the last axis). No
    ``kinds``: the call's own case only."""
    base = Case(dict(arrays), dict(params))
    out = jax.eval_shape(lambda: spec.kernel(base, spec.default_config_for(backend), backend))
    cotangent = strategies.elements(seed, out.shape, np.dtype(out.dtype).name, "normal")
    cases = [Case({**arrays, "cotangent": cotangent}, dict(params))]
    if not kinds:
        return cases
    if spec.adversarial is not None:
        return cases + list(spec.adversarial(cases[0], seed))
    for j, kind in enumerate(kinds):
        drawn = {
            name: (
                strategies.elements(seed + 7 * j + i, a.shape, a.dtype.name, kind, reduction=a.shape[-1])
                if _is_float(a) and name not in INTEGER_ARRAYS
                else a
            )
            for i, (name, a) in enumerate(arrays.items())
        }
        cases.append(Case({**drawn, "cotangent": cotangent}, dict(params)))
    return cases


def _is_float(a: np.ndarray | jax.ShapeDtypeStruct) -> bool:
    return a.dtype.name == "bfloat16" or np.issubdtype(a.dtype, np.floating)


def gate(spec: KernelSpec, cases: Sequence[Case], config: Any, backend: Backend) -> dict[str, Any]:
    """Every case's checks under ``config`` (raises CheckFailure on the first failure):
    the worst budget used, and the output on the call's own inputs."""
    selected = ("values", "gradients") if spec.gradients is not None else ("values",)
    ctx = checks.Context(
        kernel=spec.name, dtype=str(cases[0].arrays[next(iter(cases[0].arrays))].dtype), backend=str(backend)
    )
    budget = 0.0
    for case in cases:
        tally = runner.check_case(spec, case, config, backend, context=ctx, selected=selected)
        budget = max([budget] + [o.budget_used for o in tally.outcomes.values()])
    with backend.placement():
        out = np.asarray(jax.device_get(spec.kernel(cases[0], config, backend))).astype(np.float64)
    return {"budget": budget, "out": out}


def _summary(times: Sequence[float]) -> dict[str, float]:
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0],) * 3
    return {"median_s": statistics.median(times), "iqr_s": q3 - q1}


def gate_workers() -> int:
    """Gates run in threads: their float64 bounds (numpy, which releases the GIL) are
    the cost at large shapes; half the cores, so the kernels' own threads keep some."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


def rejection_reason(err: BaseException) -> str:
    # the failing check and its worst element (CheckFailure: first two lines)
    text = " / ".join(line.strip() for line in str(err).strip().splitlines()[:2])[:400]
    if isinstance(err, checks.CheckFailure):
        return f"numerics: {text}"
    if "RESOURCE_EXHAUSTED" in str(err) or "out of memory" in str(err).lower():
        return f"out of memory: {text}"
    return f"crash: {type(err).__name__}: {text}"


_MEMO_GUARD = threading.Lock()


def memoised(spec: KernelSpec, memo: dict[Any, Any] | None = None) -> KernelSpec:
    """``spec`` with its float64 oracle and oracle gradients computed once per case:
    the gate checks every config on the same cases. ``memo``: shared with the specs
    of the same op with other configs pinned (a spec per config, an outside kernel's
    fixed tiling), which then also share a bound wherever their tilings are equal."""
    memo = {} if memo is None else memo

    def once(key: tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        # gates run in threads: a key's first caller computes it, the others wait for it
        with _MEMO_GUARD:
            lock = memo.setdefault(("lock", key), threading.Lock())
        with lock:
            if key not in memo:
                memo[key] = compute()
        return memo[key]

    def oracle(case: Case) -> Any:
        return once(("oracle", id(case)), lambda: spec.oracle(case))

    # a bound is a function of the case (its oracle follows), the config and the
    # arithmetic: the gate asks for each twice (values, and the probabilistic budget)
    def bound(case: Case, ref: Any, config: Any, arith: Any) -> Any:
        return once(("bound", id(case), config, arith), lambda: spec.bound(case, ref, config, arith))

    if spec.gradients is None:
        return dataclasses.replace(spec, oracle=oracle, bound=bound)
    g = spec.gradients

    def oracle_vjp(case: Case, ref: Any) -> Any:
        return once(("oracle_vjp", id(case)), lambda: g.oracle_vjp(case, ref))

    def gradient_bound(case: Case, ref: Any, grads: Any, config: Any, arith: Any) -> Any:
        return once(("gradient_bound", id(case), config, arith), lambda: g.bound(case, ref, grads, config, arith))

    return dataclasses.replace(
        spec, oracle=oracle, bound=bound, gradients=dataclasses.replace(g, oracle_vjp=oracle_vjp, bound=gradient_bound)
    )


def tune_call(
    spec: KernelSpec,
    call: pinning.Call,
    arrays: Mapping[str, np.ndarray],
    *,
    repeats: int,
    timeout_s: float,
    kinds: Sequence[str],
    progress: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """One result entry: every candidate gated and timed, the fastest valid one chosen;
    ``progress`` gets a line per candidate."""
    spec = memoised(spec)
    backend = Backend(call.backend)
    params = {k: v for k, v in call.options.items() if k != "axis_name"}
    cases = gate_cases(spec, params, arrays, backend, kinds)
    for case in cases:  # the float64 oracles, once, before the gates share them
        ref = spec.oracle(case)
        if spec.gradients is not None:
            spec.gradients.oracle_vjp(case, ref)
    default = spec.default_config_for(backend)
    candidates = list(dict.fromkeys([default, *spec.configs(cases[0], backend)]))
    timed: list[dict[str, Any]]
    timed, rejected, outputs = [], [], {}

    def reject(config: Any, reason: str) -> None:
        rejected.append({"config": pinning.config_to_json(config), "reason": reason})
        progress(f"  {config}: rejected, {reason}")

    # 1. gate every candidate, several at a time; a config that hangs keeps its thread
    gates = concurrent.futures.ThreadPoolExecutor(max_workers=gate_workers())
    futures = {config: gates.submit(gate, spec, cases, config, backend) for config in candidates}
    passed = []
    for config, future in futures.items():
        try:
            got = future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            reject(config, f"timeout: over {timeout_s:g} s")
            continue
        except Exception as err:  # noqa: BLE001 - every failure of a candidate is a reason to reject it
            reject(config, rejection_reason(err))
            continue
        outputs[config] = got["out"]
        passed.append((config, got["budget"]))
    gates.shutdown(wait=False)
    # 2. warm the valid ones up, one at a time (a hang is a timeout), with the inputs on
    #    the device once (no host copy inside a timed call); then time them in rounds,
    #    each round every config once in a shuffled order, alone on the device
    on_device = Case({k: jax.device_put(v) for k, v in cases[0].arrays.items()}, cases[0].params)
    warm: dict[Any, tuple[Callable[[], Any], float]] = {}
    for config, budget in passed:

        def run_config(config: Any = config) -> Any:
            return spec.kernel(on_device, config, backend)

        timer = concurrent.futures.ThreadPoolExecutor(max_workers=1)
        try:
            timer.submit(lambda: jax.block_until_ready(run_config())).result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            reject(config, f"timeout: over {timeout_s:g} s while warmed up for timing")
            outputs.pop(config)
            continue
        finally:
            timer.shutdown(wait=False)
        warm[config] = (run_config, budget)
    samples = interleaved_seconds([fn for fn, _ in warm.values()], repeats)
    for (config, (_, budget)), times in zip(warm.items(), samples):
        got = _summary(times)
        timed.append({"config": pinning.config_to_json(config), **got, "budget": budget})
        progress(f"  {config}: {got['median_s'] * 1e3:.3f} ms (IQR {got['iqr_s'] * 1e3:.3f}), budget {budget:.2f}")
    entry: dict[str, Any] = {
        "kernel": call.kernel,
        "spec": spec.name,
        "key": call.key,
        "backend": call.backend,
        "default": pinning.config_to_json(default),
        "candidates": timed,
        "rejected": rejected,
        "chosen": None,
        "largest_config_difference": _largest_difference(spec, cases[0], outputs, backend),
    }
    if timed:
        best = min(timed, key=lambda c: c["median_s"])
        entry["chosen"] = best["config"]
        default_time = next((c["median_s"] for c in timed if c["config"] == entry["default"]), None)
        entry["speedup_over_default"] = None if default_time is None else default_time / best["median_s"]
    return entry


def _largest_difference(
    spec: KernelSpec, case: Case, outputs: Mapping[Any, np.ndarray], backend: Backend
) -> dict[str, Any] | None:
    """max over pairs of validated configs of max |out_a - out_b| / (bound_a + bound_b)."""
    if len(outputs) < 2:
        return None
    arith = arithmetic_for(backend)
    ref = spec.oracle(case)
    bounds = {c: np.asarray(spec.bound(case, ref, c, arith), dtype=np.float64) for c in outputs}
    worst = (0.0, None, None)
    for a, b in itertools.combinations(outputs, 2):
        with np.errstate(divide="ignore", invalid="ignore"):
            diff = np.abs(outputs[a] - outputs[b])
            ratio = np.where(diff == 0, 0.0, diff / (bounds[a] + bounds[b]))
        if float(np.max(ratio, initial=0.0)) >= worst[0]:
            worst = (float(np.max(ratio, initial=0.0)), a, b)
    return {"budget": worst[0], "configs": [pinning.config_to_json(worst[1]), pinning.config_to_json(worst[2])]}


def autotune(
    fn: Callable[..., Any],
    *args: Any,
    backends: Sequence[str] | None = None,
    repeats: int = 10,
    timeout_s: float = 300.0,
    adversarial: Sequence[str] = strategies.ELEMENT_KINDS,
    specs: Mapping[str, KernelSpec] | None = None,
    progress: Callable[[str], None] = lambda line: None,
    **kwargs: Any,
) -> AutotuneResult:
    """Tune every pallascheck kernel ``fn(*args, **kwargs)`` calls, on ``backends``
    (default: the GPU backends that run here, else the session's), choosing per call
    the fastest config that passes the numerics gate (module docstring). ``specs``
    replaces the spec of a kernel by name (a variant under test); ``adversarial=()``
    gates on the call's own inputs only; ``progress`` gets a line per call and config."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    backends = list(backends) if backends is not None else default_backends()
    entries = []
    for i, call in enumerate(find_calls(fn, args, kwargs, backends)):
        name = SPEC_NAMES.get(call.kernel, call.kernel)
        spec = (specs or {}).get(name) or get_spec(name)
        if not spec.runs_on(Backend(call.backend)):
            raise NotOnBackend(f"{name} has no version for {call.backend}")
        progress(call.key)
        entries.append(
            tune_call(
                spec,
                call,
                _concrete(call, args, seed=i),
                repeats=repeats,
                timeout_s=timeout_s,
                kinds=adversarial,
                progress=progress,
            )
        )
    data = {
        "format": pinning.FORMAT,
        "version": pinning.VERSION,
        "environment": pinning.environment(),
        "entries": entries,
    }
    return AutotuneResult(data)
