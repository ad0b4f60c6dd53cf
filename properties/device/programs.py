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

An oracle computed in parts (attention's chunks: properties/families/attention_slices.py)
serves the calls a check makes with it in shared passes (``SharedPasses``): each part's
oracle once, fed to every call of the pass, instead of once a call. The runner says
how many calls each round asks (``asked_in_rounds``; the second round's calls read the
first's exact gradients), so that one pass serves a round whatever order its threads
ask in. A pass runs its programs one after another on one thread, so it compiles them
first, together on threads (``LayoutProgram.ahead``: an input another program of the
pass computes is given by its shape, ``jax.eval_shape``).

On the host (numpy oracles) ``fn`` runs as it is. A function that reads its arrays'
values on the host (ragged_dot's group sizes) runs eagerly, as before, and so does one
whose arguments cannot be hashed.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax

from pallascheck.oracles import numeric
from pallascheck.properties.device import layout_programs

# Without constant folding: a causal attention case's visibility is a function of
# iotas alone, and XLA's folding of its [group, sq, skv] reductions at compile time
# took 4.5 s of an H100 case's first compile (s 4096) for no gain at run time.
# With XLA's GEMM autotuning (its default level, 4), which a worker process turns off
# for every other program (compilation.GPU_WORKER_FLAGS): a device oracle runs only
# for a large case, and a chunked one runs each of its programs a thousand times a
# case, their float64 dots the most of it. Attention at 32k on an H100 (b1 s32768
# h32/8 d128 bf16 causal, the same machine, jax 0.11.2): a case after the first took
# 47.5 s with no program autotuned, 34.6 s with every program autotuned; the first
# case 61.4 and 91.6 s, the kernel's own programs' autotuning 43 s of it. With these
# programs alone autotuned (another machine of the kind): 38.1 s a case; the first
# case 101.5 s with an empty compilation cache and 42.4 s with the one it left (an
# autotuned program is kept there), docs/results.md.
_OPTIONS = {"xla_disable_hlo_passes": "constant_folding", "xla_gpu_autotune_level": "4"}
_RUN_ALONE = threading.Lock()


class LayoutProgram:
    """``fn(case, *rest)``, on the oracle device one compiled program per layout
    (``layout_programs.compiled``). A case for which ``streams(case)`` holds (an oracle
    computed in spans: oracles/chunks.py) runs eagerly instead, span by span, still
    alone: one program of all its spans would be free to keep every span's
    intermediates at once, and the memory rule counts one span's. The arrays in
    ``rest`` stay where they are: where the runner has the case's results held on
    the host (``numeric.on_device(hold_results=True)``), ``chunks.part`` copies each
    span of them to the device when it is read."""

    def __init__(self, fn: Callable[..., Any], streams: Callable[[Any], bool] | None = None) -> None:
        self.fn = fn
        self.streams = streams

    def __call__(self, case: Any, *rest: Any) -> Any:
        if numeric.active_device() is None:
            return self.fn(case, *rest)
        if self.streams is not None and self.streams(case):
            arrays = numeric.placed(dict(case.arrays))
            with _RUN_ALONE:
                return jax.block_until_ready(self.fn(type(case)(arrays, case.params), *rest))
        return layout_programs.compiled(self.fn, case, *rest, compiler_options=_OPTIONS, run_alone=_RUN_ALONE)

    def ahead(self, case: Any, *rest: Any) -> None:
        """Compile the program for these arguments (``jax.ShapeDtypeStruct`` for an
        input yet to be computed) without running it; nothing on the host or for a
        case that streams."""
        if numeric.active_device() is None or (self.streams is not None and self.streams(case)):
            return
        layout_programs.compile_ahead(self.fn, case, *rest, compiler_options=_OPTIONS)


def per_layout(fn: Callable[..., Any], streams: Callable[[Any], bool] | None = None) -> LayoutProgram:
    """``fn(case, *rest)`` as a ``LayoutProgram``."""
    return LayoutProgram(fn, streams)


@dataclasses.dataclass
class _Ask:
    request: Any
    done: threading.Event = dataclasses.field(default_factory=threading.Event)
    taken: bool = False  # a thread serves it
    result: Any = None
    error: BaseException | None = None


class SharedPasses:
    """Calls that one pass over an oracle's parts serves together. ``ask(request)``
    queues a call and returns its result; once the round it belongs to has all its
    calls (``asked_in_rounds``), or when nothing holds them (no rounds said, or
    ``release()``), the asking thread serves every queued call with ``serve`` (a list
    of requests -> their results, in order) and the others wait for theirs. The results
    are the calls' own: a pass feeds each the same parts, whichever calls share it."""

    def __init__(self, serve: Callable[[list[Any]], list[Any]]) -> None:
        self._serve = serve
        self._changed = threading.Condition()
        self._queue: list[_Ask] = []
        self._rounds: collections.deque[int] = collections.deque()
        self.served: list[int] = []  # the calls of each pass, in the order served

    def expect(self, rounds: Sequence[int]) -> None:
        """The calls still to come arrive in rounds of these many (a round's calls can
        ask only once the round before it is served)."""
        with self._changed:
            self._rounds = collections.deque(n for n in rounds if n > 0)

    def release(self) -> None:
        """Serve what is queued, and every later call at once (a check that stops
        early: the calls it counted on may never come)."""
        with self._changed:
            self._rounds.clear()
            self._changed.notify_all()

    def ask(self, request: Any) -> Any:
        mine = _Ask(request)
        with self._changed:
            self._queue.append(mine)
            if self._rounds:
                self._rounds[0] -= 1
                if self._rounds[0] == 0:
                    self._rounds.popleft()
                    self._changed.notify_all()
                else:  # wait for the round's last call, which serves the round
                    self._changed.wait_for(lambda: mine.taken or not self._rounds)
            batch = [] if mine.taken else self._queue
            if batch:
                self._queue = []
                for ask in batch:
                    ask.taken = True
        if batch:
            self._run(batch)
        mine.done.wait()
        if mine.error is not None:
            raise mine.error
        return mine.result

    def _run(self, batch: list[_Ask]) -> None:
        self.served.append(len(batch))
        try:
            for ask, result in zip(batch, self._serve([a.request for a in batch]), strict=True):
                ask.result = result
        except BaseException as error:  # every call of the pass gets it
            for ask in batch:
                ask.error = error
        finally:
            for ask in batch:
                ask.done.set()


def asked_in_rounds(oracle: Any, rounds: Sequence[int]) -> None:
    """Tell an oracle served in shared passes (its ``passes``) how many calls each
    round will ask of it; nothing for another oracle."""
    if isinstance(passes := getattr(oracle, "passes", None), SharedPasses):
        passes.expect(rounds)


def release(oracle: Any) -> None:
    """No more calls are held for ``oracle``'s rounds (``SharedPasses.release``)."""
    if isinstance(passes := getattr(oracle, "passes", None), SharedPasses):
        passes.release()
