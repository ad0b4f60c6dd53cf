"""``pallascheck bench --dispatch-stress KERNEL``: the kernel's outputs under
concurrent dispatch, compared bit for bit with the same calls made alone.

A check on hardware runs the kernel's forward and VJP and the float64 oracle programs
from several threads at once (runner.py). Production soaks on H100s saw rare failures
whose output changed between runs on the same inputs and passed when the campaign's
draws were replayed. This draws ``cases`` cases of one layout (bench/check_time.py),
computes each one's outputs alone (the reference bits), then for ``seconds`` calls
them from ``threads`` threads at once, beside one thread running the cases' oracle
program on the device, and counts the calls whose bits differ, tracing the first
wrong ones (``_trace``). A deterministic kernel on a sound runtime and device gives 0.

``inputs`` says how a call gets its inputs: ``placed`` as the checks do (each call's
numpy inputs copied to the device and waited for, ``numeric.placed``);
``host`` handed to the compiled program as numpy arrays, as ``jax.jit(f)(x)`` does;
``device`` placed on the device once, before the stress. ``reference`` stresses the
spec's XLA reference instead of the kernel. Together they tell a fault of the kernel
from one of the runtime or device: under jax 0.11.2 on H100s ``host`` gave wrong
outputs of XLA's own programs and ``device`` none (docs/results.md).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from pallascheck.bench.check_time import layout_cases
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import numeric
from pallascheck.properties import checks
from pallascheck.properties.device import identity as device_identity
from pallascheck.properties.device import layout_programs
from pallascheck.properties.spec import Case, KernelSpec

TRACED = 8  # wrong outputs kept and traced (_trace); the rest are counted
INPUTS = ("placed", "host", "device")  # how a call gets its inputs (module docstring)


def _programs(spec: KernelSpec, backend: Backend, reference: bool, inputs: str) -> dict[str, Callable[[Case], Any]]:
    """The calls stressed, by name: the kernel's forward and VJP (or the XLA
    reference's), each one compiled program per layout, as the checks call them."""
    config = spec.default_config_for(backend)

    def call(fn: Callable[..., Any], *statics: Any) -> Callable[[Case], Any]:
        def run(case: Case) -> Any:
            with numeric.kernel_side():
                out = layout_programs.call(fn, backend, case, *statics, place_inputs=inputs == "placed")
                return jax.tree_util.tree_map(np.asarray, out)

        return run

    if reference:
        found = {"forward": call(spec.reference)}
        if spec.gradients is not None and spec.gradients.reference_vjp is not None:
            found["vjp"] = call(spec.gradients.reference_vjp)
        return found
    found = {"forward": call(spec.kernel, config, backend)}
    if spec.gradients is not None:
        found["vjp"] = call(spec.gradients.kernel_vjp, config, backend)
    return found


def _nearest(got: Any, candidates: dict[str, Any]) -> tuple[str, int]:
    """The candidate (a description and its bits) ``got`` is closest to, and how many
    elements differ from it."""
    return min(((said, checks.changed_bits(bits, got)) for said, bits in candidates.items()), key=lambda so: so[1])


def _trace(
    got: Any, name: str, i: int, drawn: list[Case], wanted: dict[tuple[str, int], Any], program: Callable[[Case], Any]
) -> str:
    """Whose bits a wrong output of call ``name`` on case ``i`` are. First the other
    cases' outputs alone: a call that returns one of them bit for bit was handed that
    case's buffers. Then case ``i`` with one input taken from another case, each run
    alone: a match says which input the call read from another call's transfer.
    Neither: the call computed something else (a partial or corrupted input, or a
    wrong output)."""
    others = {f"case {j}'s bits alone": wanted[name, j] for j in range(len(drawn)) if j != i}
    if not others:
        return ""
    said, off = _nearest(got, others)
    if off:
        mixed = {
            f"the bits of case {i} with its {k} from case {j}": program(
                dataclasses.replace(drawn[i], arrays={**drawn[i].arrays, k: drawn[j].arrays[k]})
            )
            for j in range(len(drawn))
            if j != i
            for k in drawn[i].arrays
        }
        said, off = _nearest(got, {said: others[said], **mixed})
    return f"; they are {said}, exactly" if off == 0 else f"; nearest: {said}, which differs in {off}"


def run(
    spec: KernelSpec,
    backend: Backend,
    *,
    dtype: str,
    layout: str | None = None,
    cases: int = 3,
    seconds: float = 60.0,
    threads: int = 3,
    shapes: str = "production",
    inputs: str = "placed",
    reference: bool = False,
) -> dict[str, Any]:
    """Stress ``spec``'s calls on ``backend`` (module docstring); returns the calls and
    mismatches per call, the first mismatches' descriptions, and the device."""
    if threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads!r}")
    if seconds <= 0:
        raise ValueError(f"seconds must be > 0, got {seconds!r}")
    if cases < 1:
        raise ValueError(f"cases must be >= 1, got {cases!r}")
    if inputs not in INPUTS:
        raise ValueError(f"inputs must be one of {', '.join(INPUTS)}, got {inputs!r}")
    drawn = layout_cases(spec, backend, dtype=dtype, layout=layout, cases=cases, shapes=shapes)
    with backend.placement():
        if inputs == "device":
            drawn = [dataclasses.replace(c, arrays=numeric.placed(dict(c.arrays))) for c in drawn]
        programs = _programs(spec, backend, reference, inputs)
        wanted = {(name, i): fn(case) for name, fn in programs.items() for i, case in enumerate(drawn)}
        oracle_device = None if backend.is_interpreted else jax.devices(backend.platform)[0]
        counts = {name: [0, 0] for name in programs} | {"oracle": [0, 0]}
        wrong: list[tuple[str, int, Any, int]] = []  # the first TRACED wrong outputs, traced after the stress
        lock = threading.Lock()
        end = time.monotonic() + seconds

        def stress(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < end:
                name, i = rng.choice(sorted(programs)), rng.randrange(len(drawn))
                with backend.placement():  # the thread's own: JAX's default device is per thread
                    got = programs[name](drawn[i])
                changed = checks.changed_bits(wanted[name, i], got)
                with lock:
                    counts[name][0] += 1
                    if changed:
                        counts[name][1] += 1
                        if len(wrong) < TRACED:
                            wrong.append((name, i, got, changed))

        def oracle() -> None:
            while time.monotonic() < end:
                case = drawn[random.randrange(len(drawn))]
                with (
                    backend.placement(),
                    numeric.on_device(oracle_device) if oracle_device is not None else numeric.kernel_side(),
                ):
                    jax.block_until_ready(spec.oracle(case))
                with lock:
                    counts["oracle"][0] += 1

        workers = [threading.Thread(target=stress, args=(n,)) for n in range(threads)]
        workers.append(threading.Thread(target=oracle))
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        notes = [
            f"{name} of case {i}: {changed} elements differ from its bits alone"
            + _trace(got, name, i, drawn, wanted, programs[name])
            for name, i, got, changed in wrong
        ]
    device = jax.devices(backend.platform)[0]
    return {
        "kernel": spec.name,
        "dtype": dtype,
        "backend": str(backend),
        "jax": jax.__version__,
        "device": device_identity.describe(device) or device.device_kind,
        "shapes": drawn[0].describe()[:160],
        "seconds": seconds,
        "threads": threads,
        "inputs": inputs,
        "reference": reference,
        "calls": {k: v[0] for k, v in counts.items()},
        "mismatches": {k: v[1] for k, v in counts.items()},
        "notes": notes,
    }
