"""A spec's oracle and bound functions as compiled programs on the oracle device.

Inside ``numeric.on_device`` the oracles and bounds compute in jax.numpy float64.
Run operation by operation, JAX compiles each operation as a program of its own for
every new shape: on the CPU about 20 ms each, 293 for three small attention cases
(tests/test_device_oracles.py compiled for 21.2 s so, 11.5 s as below).
``per_layout(fn)`` runs ``fn(case, *rest)`` there as one ``jax.jit`` program per
layout instead: the case's parameters and its arrays' shapes and dtypes, and the
hashable arguments in ``rest`` (config, arithmetic); the arrays in ``rest`` (an
oracle, registered as a pytree by ``numeric.pytree``, or a mapping of gradients) are
the program's arguments. XLA fuses the elementwise work, and every case of the layout
reuses the program. The program is only traced and called inside ``on_device``, so
inside its float64 scope; its inputs are upcast there exactly (``numeric.f64``).

The runner asks for a case's oracle and bounds from several threads at once
(runner.py), so that their programs compile at the same time; they run one at a time
(``_RUN_ALONE``): the production tier's memory rule (properties/production.py) counts
one oracle program's float64 intermediates, not ten.

On the host (numpy oracles) ``fn`` runs as it is. A function that reads its arrays'
values on the host (ragged_dot's group sizes) runs eagerly, as before, and so does one
whose arguments cannot be hashed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import jax

from pallascheck.oracles import numeric
from pallascheck.properties.device import layout_programs

# Without constant folding: a causal attention case's visibility is a function of
# iotas alone, and XLA's folding of its [group, sq, skv] reductions at compile time
# took 4.5 s of an H100 case's first compile (s 4096) for no gain at run time.
_OPTIONS = {"xla_disable_hlo_passes": "constant_folding"}
_RUN_ALONE = threading.Lock()


def per_layout(fn: Callable[..., Any], streams: Callable[[Any], bool] | None = None) -> Callable[..., Any]:
    """``fn(case, *rest)``, on the oracle device one compiled program per layout
    (``layout_programs.compiled``). A case for which ``streams(case)`` holds (an oracle
    computed in spans: oracles/chunks.py) runs eagerly instead, span by span, still
    alone: one program of all its spans would be free to keep every span's
    intermediates at once, and the memory rule counts one span's."""

    def run(case: Any, *rest: Any) -> Any:
        if numeric.active_device() is None:
            return fn(case, *rest)
        if streams is not None and streams(case):
            arrays, rest = layout_programs.placed((dict(case.arrays), rest))
            with _RUN_ALONE:
                return jax.block_until_ready(fn(type(case)(arrays, case.params), *rest))
        return layout_programs.compiled(fn, case, *rest, compiler_options=_OPTIONS, run_alone=_RUN_ALONE)

    return run
