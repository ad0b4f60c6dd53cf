"""Checks of the distributed kernels, run inside a child process with N CPU devices
(properties/multidevice.run_with_cpu_devices): one child per device count runs
many Hypothesis examples, so JAX starts once per count.

Every example draws a mesh layout (1-D or 2-D over the child's devices, named
axes, the ring axis, a PartitionSpec with free or replicated dimensions), a dtype and
inputs, runs the kernel under the TPU interpreter with race detection, and checks:

- values: *every device's* shard of the result (replicas included) against the
  float64 oracle of the unsharded computation, within the derived bound
  (oracles/collectives.py; 0 for all-gather: bit-exact);
- no race reported by the interpreter (compat.tpu_interpret_races_found);
- determinism: a rerun under another interpreter seed is bitwise identical;
- xla_reference (lax collectives) within the same kind of bound.

A failing example is recorded (not shrunk: interpretation is slow) with its layout,
dtype and element seed, and the interpreter's state is reset before the next one.
Results come back as JSON: per kernel and dtype the examples run and the worst
error/bound ratio ("budget used"), the meshes covered, and the failures.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

from pallascheck.kernels import collectives, compat
from pallascheck.kernels import mosaic_gpu_collectives as mgc
from pallascheck.kernels.backends import Backend
from pallascheck.oracles import collectives as oracle
from pallascheck.oracles.tolerance import arithmetic_for
from pallascheck.properties import checks, strategies
from pallascheck.properties.device import multidevice, sharding

FLOATS = ("float32", "bfloat16", "float16")
ROWS_PER_SHARD = (1, 3, 8)  # 1 and 3: blocks that match no hardware tile
COLS = (4, 16)
ELEMENT_KINDS = ("normal", "positive", "few_distinct", "large")
ARITH = arithmetic_for(Backend("tpu_interpret"))
KERNEL_BACKEND = Backend("tpu_interpret", 0)


@dataclasses.dataclass(frozen=True)
class EagerDmaBackend(Backend):
    """The TPU interpreter running every DMA the moment it starts. The default
    runs a DMA's write only when its receive semaphore is waited on, so a missing
    wait never overlaps the write with a read; eagerly the two race, and the race
    detector sees it."""

    def interpret_arg(self) -> Any:
        return compat.tpu_interpret_params(seed=self.seed, dma_execution_mode="eager")

    def __str__(self) -> str:
        return f"tpu_interpret:{self.seed} (eager DMAs)"


RESHUFFLED_BACKEND = EagerDmaBackend("tpu_interpret", 1)  # another seed and DMA timing: must agree bitwise


@dataclasses.dataclass(frozen=True)
class Setting:
    """Where the properties run and what that decides: the backend of the first run
    and of the determinism rerun (which must agree bitwise), whether the TPU
    interpreter's race detector is read, the mesh ranks drawn, and the shapes,
    dtypes and configs the kernels there accept."""

    backend: Backend
    rerun: Backend
    interpreter_races: bool
    ndims: tuple[int, ...]
    gather_rows: tuple[int, ...]  # rows of one device's block
    gather_cols: tuple[int, ...]
    matmul_floats: tuple[str, ...]
    configs: tuple[Any, ...]  # drawn for every kernel (None: the kernel's default)

    @property
    def arith(self) -> Any:
        return arithmetic_for(self.backend)

    def config_kwargs(self, config: Any) -> dict[str, Any]:
        return {} if config is None else {"config": config}


TPU_INTERPRET = Setting(
    KERNEL_BACKEND,
    RESHUFFLED_BACKEND,
    interpreter_races=True,
    ndims=(1, 2),
    gather_rows=ROWS_PER_SHARD,
    gather_cols=COLS,
    matmul_floats=FLOATS,
    configs=(None,),
)
# The GPU kernels (kernels/mosaic_gpu_collectives.py): a 1-D mesh; blocks of whole
# 128-element rows for the gather; bf16/f16 wgmma operands; few CTAs, so that small
# blocks still spread over several CTAs and each CTA loops over several boxes.
MOSAIC_GPU = Setting(
    Backend("mosaic_gpu"),
    Backend("mosaic_gpu"),
    interpreter_races=False,
    ndims=(1,),
    gather_rows=(1, 3, 8, 64, 200),
    gather_cols=(128, 256),
    matmul_floats=("bfloat16", "float16"),
    configs=(
        mgc.Config(ctas=4, copy_ctas=2, consumers=1),  # one-warpgroup compute CTAs
        mgc.Config(ctas=8, copy_ctas=3, tile_m=64, tile_n=128, consumers=1),
        mgc.Config(ctas=6, copy_ctas=1, tile_m=128, tile_n=64, consumers=1),
        mgc.Config(),
        mgc.Config(ctas=5, copy_ctas=2),  # warp-specialised compute CTAs (the default)
        mgc.Config(ctas=7, copy_ctas=3, tile_n=64),
    ),
)
SETTINGS = {"tpu_interpret": TPU_INTERPRET, "mosaic_gpu": MOSAIC_GPU}


class CheckFailed(AssertionError):
    pass


@dataclasses.dataclass
class Tally:
    examples: dict[str, int] = dataclasses.field(default_factory=dict)  # per dtype
    budget: dict[str, float] = dataclasses.field(default_factory=dict)  # worst error/bound per dtype
    reference_budget: dict[str, float] = dataclasses.field(default_factory=dict)
    meshes: set = dataclasses.field(default_factory=set)
    configs: set = dataclasses.field(default_factory=set)
    failures: list[str] = dataclasses.field(default_factory=list)
    current: str = "(before the example was drawn)"  # the example being checked

    def start(self, where: str) -> None:
        """The example about to run; printed, so that a hang's report (the child's
        output) names it."""
        self.current = where
        print(f"example: {where}", flush=True)

    def as_json(self) -> dict:
        return {
            "examples": self.examples,
            "budget": self.budget,
            "reference_budget": self.reference_budget,
            "meshes": sorted(self.meshes),
            "configs": sorted(self.configs),
            "failures": self.failures,
        }


def _host(a: Any) -> np.ndarray:
    return np.asarray(jax.device_get(a))


def check_every_shard(name: str, out: jax.Array, expected: np.ndarray, bound: np.ndarray) -> float:
    """Each device's piece of ``out`` against the matching piece of ``expected`` under
    :func:`checks.compare` (bit-exact where the bound is 0); returns the worst
    error/bound."""
    if tuple(out.shape) != tuple(expected.shape):
        raise CheckFailed(f"{name}: shape {tuple(out.shape)} != expected {tuple(expected.shape)}")
    worst = 0.0
    for shard in out.addressable_shards:
        outcome = checks.compare(
            _host(shard.data),
            expected[shard.index],
            bound[shard.index],
            name=f"{name}: device {shard.device.id} shard {shard.index}",
        )
        if not outcome.passed:
            raise CheckFailed(outcome.detail)
        worst = max(worst, outcome.budget_used)
    return worst


def run_checked(name: str, fn: Callable[[], jax.Array], setting: Setting) -> jax.Array:
    """Run one kernel; in the TPU interpreter, fail if it reported a race."""
    out = jax.block_until_ready(fn())
    if setting.interpreter_races and compat.tpu_interpret_races_found():
        raise CheckFailed(f"{name}: the TPU interpreter reported a data race")
    return out


def _bitwise_equal(a: jax.Array, b: jax.Array) -> bool:
    return all(
        np.array_equal(_host(sa.data).view(np.uint8), _host(sb.data).view(np.uint8))
        for sa, sb in zip(a.addressable_shards, b.addressable_shards)
    )


def run_twice(name: str, run: Callable[[Backend], jax.Array], setting: Setting) -> tuple[jax.Array, jax.Array]:
    """The kernel under the setting's backend and its rerun backend, both checked for
    races before any value is looked at (a race explains wrong values)."""
    return run_checked(name, lambda: run(setting.backend), setting), run_checked(
        name + f" [{setting.rerun}]", lambda: run(setting.rerun), setting
    )


def _deterministic(name: str, first: jax.Array, second: jax.Array, setting: Setting) -> None:
    if not _bitwise_equal(first, second):
        raise CheckFailed(f"{name}: a rerun under {setting.rerun} is not bitwise identical")


def _draw_config(data: st.DataObject, setting: Setting, tally: Tally) -> Any:
    config = data.draw(st.sampled_from(setting.configs))
    tally.configs.add(repr(config))
    return config


# --- the properties -------------------------------------------------------------------
def check_all_gather(
    data: st.DataObject, devices: int, tally: Tally, kernel: Callable[..., jax.Array], setting: Setting
) -> None:
    layout = data.draw(sharding.mesh_layouts((devices,), setting.ndims))
    axis = data.draw(st.sampled_from(layout.names))
    spec = data.draw(sharding.partition_specs(2, layout, required={0: axis}))
    dtype = data.draw(strategies.dtypes(FLOATS))
    config = _draw_config(data, setting, tally)
    if config is None:  # the TPU kernel's one knob
        config = collectives.Config(data.draw(st.booleans()))
    per_shard = (data.draw(strategies.dims(setting.gather_rows)), data.draw(strategies.dims(setting.gather_cols)))
    shape = sharding.divisible_dims(spec, layout, per_shard)
    element_seed = data.draw(strategies.seeds())
    x = strategies.elements(element_seed, shape, dtype, "normal")
    where = (
        f"all_gather mesh {layout.describe()} axis {axis!r} spec {spec} x{shape}:{dtype} {config} seed={element_seed}"
    )
    tally.meshes.add(layout.describe().split(" ")[0])
    tally.start(where)
    mesh = sharding.make_mesh(layout)
    xs = collectives.sharded(x, mesh, spec)

    def run(backend):
        return kernel(xs, mesh=mesh, axis=axis, spec=spec, config=config, backend=backend)

    out, rerun = run_twice(where, run, setting)
    expected = np.asarray(x, np.float64)
    budget = check_every_shard(where, out, expected, oracle.all_gather_bound(x))
    _deterministic(where, out, rerun, setting)
    ref = collectives.xla_reference_all_gather(xs, mesh=mesh, axis=axis, spec=spec)
    ref_budget = check_every_shard(where + " [xla_reference]", ref, expected, oracle.all_gather_bound(x))
    _record(tally, dtype, budget, ref_budget)


def _matmul_inputs(data: st.DataObject, dtype: str, m: int, k: int, n: int) -> tuple[np.ndarray, np.ndarray, str, int]:
    kind = data.draw(strategies.element_kinds(ELEMENT_KINDS))
    element_seed = data.draw(strategies.seeds())
    x = strategies.elements(element_seed, (m, k), dtype, kind, reduction=k)
    w = strategies.elements(element_seed + 1, (k, n), dtype, kind, reduction=k)
    return x, w, kind, element_seed


def _tiles(config: Any, consumers: bool = False) -> tuple[int, int, int]:
    """The multiples a device's block must have: the GPU matmul tile (with
    ``consumers``, a CTA tile of ``consumers`` tile_n columns), or 1."""
    if config is None:
        return 1, 1, 1
    return config.tile_m, config.tile_k, config.tile_n * (config.consumers if consumers else 1)


def check_all_gather_matmul(
    data: st.DataObject, devices: int, tally: Tally, kernel: Callable[..., jax.Array], setting: Setting
) -> None:
    layout = data.draw(sharding.mesh_layouts((devices,), setting.ndims))
    axis = data.draw(st.sampled_from(layout.names))
    p = layout.sizes[axis]
    dtype = data.draw(strategies.dtypes(setting.matmul_floats))
    out_dtype = data.draw(st.sampled_from(sorted({dtype, "float32"})))
    config = _draw_config(data, setting, tally)
    tm, tk, tn = _tiles(config, consumers=True)
    m, k, n = (
        p * tm * data.draw(strategies.dims((1, 8) if tm == 1 else (1, 2))),
        tk * data.draw(strategies.dims((16, 48) if tk == 1 else (1, 3, 4))),
        p * tn * data.draw(strategies.dims((4, 16) if tn == 1 else (1, 2))),
    )
    x, w, kind, element_seed = _matmul_inputs(data, dtype, m, k, n)
    where = f"all_gather_matmul mesh {layout.describe()} axis {axis!r} x({m},{k}) w({k},{n}):{dtype}->{out_dtype} {kind} {config} seed={element_seed}"
    tally.meshes.add(layout.describe().split(" ")[0])
    tally.start(where)
    mesh = sharding.make_mesh(layout)
    xs, ws = collectives.sharded(x, mesh, P(axis, None)), collectives.sharded(w, mesh, P(None, axis))

    def run(backend):
        return kernel(
            xs, ws, mesh=mesh, axis=axis, out_dtype=out_dtype, backend=backend, **setting.config_kwargs(config)
        )

    out, rerun = run_twice(where, run, setting)
    ref64 = oracle.all_gather_matmul_oracle(x, w)
    bound = oracle.all_gather_matmul_bound(
        ref64, operand_dtype=x.dtype, out_dtype=strategies.np_dtype(out_dtype), arith=setting.arith
    )
    budget = check_every_shard(where, out, ref64.out, bound)
    _deterministic(where, out, rerun, setting)
    ref = collectives.xla_reference_all_gather_matmul(xs, ws, mesh=mesh, axis=axis, out_dtype=out_dtype)
    ref_budget = check_every_shard(where + " [xla_reference]", ref, ref64.out, bound)
    _record(tally, dtype, budget, ref_budget)


def check_matmul_reduce_scatter(
    data: st.DataObject, devices: int, tally: Tally, kernel: Callable[..., jax.Array], setting: Setting
) -> None:
    layout = data.draw(sharding.mesh_layouts((devices,), setting.ndims))
    axis = data.draw(st.sampled_from(layout.names))
    row_axis = data.draw(st.sampled_from([None] + [a for a in layout.names if a != axis]))
    p = layout.sizes[axis]
    row_shards = p * (layout.sizes[row_axis] if row_axis else 1)
    dtype = data.draw(strategies.dtypes(setting.matmul_floats))
    out_dtype = data.draw(st.sampled_from(sorted({dtype, "float32"})))
    config = _draw_config(data, setting, tally)
    tm, tk, tn = _tiles(config)
    m, k, n = (
        row_shards * tm * data.draw(strategies.dims((1, 4) if tm == 1 else (1, 2))),
        p * tk * data.draw(strategies.dims((8, 24) if tk == 1 else (1, 2, 3))),
        tn * data.draw(strategies.dims((4, 16) if tn == 1 else (1, 2))),
    )
    x, w, kind, element_seed = _matmul_inputs(data, dtype, m, k, n)
    where = (
        f"matmul_reduce_scatter mesh {layout.describe()} axis {axis!r} row_axis {row_axis!r} "
        f"x({m},{k}) w({k},{n}):{dtype}->{out_dtype} {kind} {config} seed={element_seed}"
    )
    tally.meshes.add(layout.describe().split(" ")[0])
    tally.start(where)
    mesh = sharding.make_mesh(layout)
    x_spec = P(row_axis, axis)
    xs, ws = collectives.sharded(x, mesh, x_spec), collectives.sharded(w, mesh, P(axis, None))

    def run(backend):
        return kernel(
            xs,
            ws,
            mesh=mesh,
            axis=axis,
            row_axis=row_axis,
            out_dtype=out_dtype,
            backend=backend,
            **setting.config_kwargs(config),
        )

    out, rerun = run_twice(where, run, setting)
    ref64 = oracle.partials_oracle(x, w, p)
    out_np = strategies.np_dtype(out_dtype)
    bound = oracle.matmul_reduce_scatter_bound(
        ref64, operand_dtype=x.dtype, out_dtype=out_np, partial_dtype=np.float32, arith=setting.arith
    )
    budget = check_every_shard(where, out, ref64.out, bound)
    _deterministic(where, out, rerun, setting)
    ref = collectives.xla_reference_matmul_reduce_scatter(
        xs, ws, mesh=mesh, axis=axis, row_axis=row_axis, out_dtype=out_dtype
    )
    ref_bound = oracle.matmul_reduce_scatter_bound(
        ref64, operand_dtype=x.dtype, out_dtype=out_np, partial_dtype=out_np, arith=setting.arith
    )
    ref_budget = check_every_shard(where + " [xla_reference]", ref, ref64.out, ref_bound)
    _record(tally, dtype, budget, ref_budget)


def _record(tally: Tally, dtype: str, budget: float, ref_budget: float) -> None:
    tally.examples[dtype] = tally.examples.get(dtype, 0) + 1
    tally.budget[dtype] = max(tally.budget.get(dtype, 0.0), budget)
    tally.reference_budget[dtype] = max(tally.reference_budget.get(dtype, 0.0), ref_budget)


PROPERTIES: dict[str, tuple[Callable[..., Any], Callable[..., jax.Array]]] = {
    "all_gather": (check_all_gather, collectives.all_gather),
    "all_gather_matmul": (check_all_gather_matmul, collectives.all_gather_matmul),
    "matmul_reduce_scatter": (check_matmul_reduce_scatter, collectives.matmul_reduce_scatter),
}


def few_examples(examples: int, seed: int) -> Callable[[Callable[[st.DataObject], None]], Callable[[], None]]:
    """Hypothesis over ``examples`` examples from ``seed``, without shrinking or a
    database: each example is a multi-device run, and the failing one is the report."""

    def wrap(test: Callable[[st.DataObject], None]) -> Callable[[], None]:
        return settings(
            max_examples=examples,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            phases=(Phase.explicit, Phase.reuse, Phase.generate),
        )(hypothesis_seed(seed)(given(st.data())(test)))

    return wrap


def run_property(
    name: str, kernel: Callable[..., jax.Array], examples: int, seed: int, setting: Setting = TPU_INTERPRET
) -> Tally:
    """Up to ``examples`` Hypothesis examples of property ``name`` on all of this
    process's devices; stops at the first failure (no shrinking: each example is a
    multi-device run)."""
    check, _ = PROPERTIES[name]
    devices = len(jax.devices())
    tally = Tally()

    @few_examples(examples, seed)
    def prop(data: st.DataObject) -> None:
        tally.current = "(before the example was drawn)"
        try:
            check(data, devices, tally, kernel, setting)
        except Exception as err:
            if setting.interpreter_races:
                compat.reset_tpu_interpreter()
            message = f"{type(err).__name__}: {str(err)[:2000]}"
            if tally.current not in message:
                message += f"\nexample: {tally.current}"
            if message not in tally.failures:  # Hypothesis replays the failing example once
                tally.failures.append(message)
            raise

    try:
        prop()
    except Exception:  # noqa: BLE001 - recorded in tally.failures with its example
        pass
    return tally


def run_checks(
    examples: int, seed: int = 0, kernels: Sequence[str] = tuple(PROPERTIES), backend: str = "tpu_interpret"
) -> dict:
    """Entry point of the multi-device child: every property on ``backend``'s setting,
    then the bad-input errors."""
    setting = SETTINGS[backend]
    result = {name: run_property(name, PROPERTIES[name][1], examples, seed, setting).as_json() for name in kernels}
    result["errors"] = check_errors() if backend == "tpu_interpret" else check_gpu_errors()
    return result


# --- JAX's bundled collective matmul, checked as an outside client ----------------------
def bundled_tuning_space() -> list[Any]:
    """``collective_matmul_mgpu``'s tuning knobs, as its own example sweeps them
    (tile_m, tile_n, grid order, grid tile width, the warpgroup split); the first is
    the config the benchmark times."""
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm  # GPU-only op: imported on use

    dims = cm.MatmulDimension
    return [
        cm.TuningConfig(tm, tn, 64, 4, grid_minor_dim=minor, grid_tile_width=width, wg_dimension=wg)
        for tm, tn, minor, width, wg in (
            (128, 128, dims.N, 1, dims.N),
            (128, 64, dims.M, 4, dims.N),
            (128, 128, dims.M, 8, dims.M),
            (256, 128, dims.N, 4, dims.M),
            (128, 64, dims.N, 16, dims.M),
        )
    ]


def bundled_collective_matmul(mesh: Any, config: Any, dtype: Any) -> Callable[..., jax.Array]:
    """JAX's ``all_gather_lhs_matmul`` over ``mesh``'s axis "x", jitted: x rows and
    w columns sharded, the result's columns sharded."""
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm  # GPU-only op: imported on use

    return jax.jit(
        compat.shard_map(
            lambda a, b: cm.all_gather_lhs_matmul(a, b, "x", config=config, dtype=dtype),
            mesh=mesh,
            in_specs=(P("x", None), P(None, "x")),
            out_specs=P(None, "x"),
            check_vma=False,
        )
    )


def check_bundled_collective_matmul(data: st.DataObject, devices: int, tally: Tally, setting: Setting) -> None:
    """``all_gather_lhs_matmul`` (point-to-point remote copies, no multicast) over all
    of this process's GPUs: x rows and w columns sharded, every device's output block
    against the float64 oracle under the all-gather-matmul bound (f32 accumulation
    in wgmma tiles, one rounding to the output dtype), and a bitwise rerun."""
    from jax.experimental.pallas.ops.gpu import collective_matmul_mgpu as cm

    config = data.draw(st.sampled_from(bundled_tuning_space()))
    tally.configs.add(repr(config))
    dtype = data.draw(strategies.dtypes(setting.matmul_floats))
    cta_m = config.tile_m * (2 if config.wg_dimension == cm.MatmulDimension.M else 1)
    cta_n = config.tile_n * (2 if config.wg_dimension == cm.MatmulDimension.N else 1)
    m, k, n = (
        devices * cta_m * data.draw(strategies.dims((1, 2))),
        64 * data.draw(strategies.dims((2, 4, 8))),
        devices * cta_n * data.draw(strategies.dims((1, 2))),
    )
    x, w, kind, element_seed = _matmul_inputs(data, dtype, m, k, n)
    where = f"collective_matmul_mgpu.all_gather_lhs_matmul {devices} GPUs x({m},{k}) w({k},{n}):{dtype} {kind} {config} seed={element_seed}"
    tally.meshes.add(str(devices))
    tally.start(where)
    mesh = sharding.make_mesh(sharding.MeshLayout((devices,), ("x",)))
    xs, ws = collectives.sharded(x, mesh, P("x", None)), collectives.sharded(w, mesh, P(None, "x"))
    call = bundled_collective_matmul(mesh, config, jnp.dtype(dtype))
    out, rerun = jax.block_until_ready(call(xs, ws)), jax.block_until_ready(call(xs, ws))
    ref64 = oracle.all_gather_matmul_oracle(x, w)
    bound = oracle.all_gather_matmul_bound(ref64, operand_dtype=x.dtype, out_dtype=x.dtype, arith=setting.arith)
    budget = check_every_shard(where, out, ref64.out, bound)
    _deterministic(where, out, rerun, setting)
    _record(tally, dtype, budget, 0.0)


def run_bundled(examples: int, seed: int = 0) -> dict:
    """Entry point of a GPU child: JAX's collective matmul over every visible GPU."""
    devices = len(jax.devices())
    tally = Tally()

    @few_examples(examples, seed)
    def prop(data: st.DataObject) -> None:
        try:
            check_bundled_collective_matmul(data, devices, tally, MOSAIC_GPU)
        except Exception as err:
            message = f"{type(err).__name__}: {str(err)[:2000]}\nexample: {tally.current}"
            if message not in tally.failures:
                tally.failures.append(message)
            raise

    try:
        prop()
    except Exception:  # noqa: BLE001 - recorded in tally.failures with its example
        pass
    return tally.as_json()


# --- bad input ------------------------------------------------------------------------
def check_errors() -> dict[str, str]:
    """Each bad call must raise the promised exception with a message naming the rule;
    returns the cases that did not (empty when all do)."""
    devices = jax.devices()
    layout = (
        sharding.MeshLayout((2, len(devices) // 2), ("x", "y"))
        if len(devices) >= 4
        else sharding.MeshLayout((len(devices),), ("x",))
    )
    mesh = sharding.make_mesh(layout)
    p = layout.sizes["x"]
    x = jnp.ones((3 * p + 1, 8), jnp.float32)
    good = jnp.ones((2 * p, 8 * p), jnp.float32)
    cases = {
        "axis does not divide": (
            lambda: collectives.all_gather(x, mesh=mesh, axis="x", backend="tpu_interpret"),
            ValueError,
            "not divisible",
        ),
        "unknown axis": (
            lambda: collectives.all_gather(good, mesh=mesh, axis="z", backend="tpu_interpret"),
            ValueError,
            "not a mesh axis",
        ),
        "spec names unknown axis": (
            lambda: collectives.all_gather(good, mesh=mesh, axis="x", spec=P("x", "q"), backend="tpu_interpret"),
            ValueError,
            "not a mesh axis",
        ),
        "spec does not shard the gathered dim": (
            lambda: collectives.all_gather(good, mesh=mesh, axis="x", spec=P(None, "x"), backend="tpu_interpret"),
            ValueError,
            "shard dimension 0",
        ),
        "spec reuses an axis": (
            lambda: collectives.all_gather(good, mesh=mesh, axis="x", spec=P("x", "x"), backend="tpu_interpret"),
            ValueError,
            "twice",
        ),
        "spec not a PartitionSpec": (
            lambda: collectives.all_gather(good, mesh=mesh, axis="x", spec=cast(Any, ("x",)), backend="tpu_interpret"),
            TypeError,
            "PartitionSpec",
        ),
        "mesh not a Mesh": (
            lambda: collectives.all_gather(good, mesh=cast(Any, "x"), axis="x", backend="tpu_interpret"),
            TypeError,
            "mesh must be",
        ),
        "contracting mismatch": (
            lambda: collectives.all_gather_matmul(good, good, mesh=mesh, axis="x", backend="tpu_interpret"),
            ValueError,
            "contracting dimensions",
        ),
        "mixed dtypes": (
            lambda: collectives.matmul_reduce_scatter(
                good, good.T.astype(jnp.bfloat16), mesh=mesh, axis="x", backend="tpu_interpret"
            ),
            TypeError,
            "same dtype",
        ),
        "rows do not scatter": (
            lambda: collectives.matmul_reduce_scatter(
                jnp.ones((p + 1, 2 * p)), jnp.ones((2 * p, 4)), mesh=mesh, axis="x", backend="tpu_interpret"
            ),
            ValueError,
            "not divisible",
        ),
        "row_axis equals axis": (
            lambda: collectives.matmul_reduce_scatter(
                good, good.T, mesh=mesh, axis="x", row_axis="x", backend="tpu_interpret"
            ),
            ValueError,
            "row_axis must differ",
        ),
        "backend without ring kernels": (
            lambda: collectives.all_gather(good, mesh=mesh, axis="x", backend="triton"),
            ValueError,
            "xla_reference",
        ),
        "bad config": (
            lambda: collectives.all_gather(
                good, mesh=mesh, axis="x", config=cast(Any, {"bidirectional": True}), backend="tpu_interpret"
            ),
            TypeError,
            "collectives.Config",
        ),
    }
    return _missed(cases)


def check_gpu_errors() -> dict[str, str]:
    """The Mosaic GPU kernels' own rules: a 1-D mesh, P(axis) for the gather, whole
    128-element rows, bf16/f16 matmul operands, blocks that tile."""
    p = len(jax.devices())
    mesh = sharding.make_mesh(sharding.MeshLayout((p,), ("x",)))
    gpu = "mosaic_gpu"
    rows = collectives.sharded(np.ones((2 * p, 128), np.float32), mesh, P("x"))
    odd = collectives.sharded(np.ones((2 * p, 100), np.float32), mesh, P("x"))
    x16 = collectives.sharded(np.ones((128 * p, 64), np.float32), mesh, P("x", None))
    w16 = collectives.sharded(np.ones((64, 128 * p), np.float32), mesh, P(None, "x"))
    xb = collectives.sharded(np.ones((96 * p, 64), jnp.bfloat16), mesh, P("x", None))
    x128 = collectives.sharded(np.ones((128 * p, 64), jnp.bfloat16), mesh, P("x", None))
    wb = collectives.sharded(np.ones((64, 128 * p), jnp.bfloat16), mesh, P(None, "x"))
    cases: dict[str, tuple[Callable[[], Any], type[Exception], str]] = {
        "block not whole rows": (
            lambda: collectives.all_gather(odd, mesh=mesh, axis="x", backend=gpu),
            ValueError,
            "multiple of 128",
        ),
        "2-D mesh": (
            lambda: collectives.all_gather(
                rows, mesh=sharding.make_mesh(sharding.MeshLayout((1, p), ("a", "x"))), axis="x", backend=gpu
            ),
            ValueError,
            "1-D mesh",
        ),
        "TPU config": (
            lambda: collectives.all_gather(rows, mesh=mesh, axis="x", config=collectives.Config(), backend=gpu),
            TypeError,
            "mosaic_gpu_collectives.Config",
        ),
        "f32 matmul": (
            lambda: collectives.all_gather_matmul(x16, w16, mesh=mesh, axis="x", backend=gpu),
            TypeError,
            "bfloat16 or float16",
        ),
        "rows not a tile": (
            lambda: collectives.all_gather_matmul(xb, wb, mesh=mesh, axis="x", backend=gpu),
            ValueError,
            "multiple of the tile",
        ),
        "copy CTAs >= CTAs": (
            lambda: collectives.all_gather_matmul(
                x128, wb, mesh=mesh, axis="x", config=mgc.Config(ctas=4, copy_ctas=4, consumers=1), backend=gpu
            ),
            ValueError,
            "copy_ctas",
        ),
    }
    return _missed(cases)


def _missed(cases: dict[str, tuple[Callable[[], Any], type[Exception], str]]) -> dict[str, str]:
    """The cases whose call did not raise the promised exception with its pattern."""
    missed = {}
    for name, (call, exc, pattern) in cases.items():
        try:
            call()
            missed[name] = "no exception"
        except exc as err:
            if pattern not in str(err):
                missed[name] = f"message {str(err)!r} lacks {pattern!r}"
        except Exception as err:  # noqa: BLE001
            missed[name] = f"{type(err).__name__}: {err}"
    return missed


# --- sensitivity: deliberately broken kernels -------------------------------------------
def run_variants(
    variants: str, names: Sequence[str], examples: int, seed: int = 0, backend: str = "tpu_interpret"
) -> dict[str, dict]:
    """Run each broken kernel of ``variants`` ("module:VARIANTS", a dict name ->
    (property, kernel)) through its property until the first failure."""
    table = multidevice.resolve(variants)
    result = {}
    for name in names:
        prop, kernel = table[name]
        print(f"running variant {name}", flush=True)  # a hang is then placed in this variant
        tally = run_property(prop, kernel, examples, seed, SETTINGS[backend])
        result[name] = {"caught": bool(tally.failures), "failure": (tally.failures or [""])[0][:600]}
    return result


# --- the communication/compute schedule --------------------------------------------------
def schedules(mesh_shape: Sequence[int], axis: str = "x") -> dict[str, list]:
    """Program-order events of the collective matmuls on ``mesh_shape`` (axes x, y)."""
    layout = sharding.MeshLayout(tuple(mesh_shape), ("x", "y")[: len(mesh_shape)])
    mesh = sharding.make_mesh(layout)
    p = layout.sizes[axis]
    be = collectives.get_backend(KERNEL_BACKEND)
    x = collectives.sharded(np.ones((2 * p, 16), np.float32), mesh, P(axis, None))
    w = collectives.sharded(np.ones((16, 4 * p), np.float32), mesh, P(None, axis))
    agmm = collectives.record_schedule(
        lambda: collectives._all_gather_matmul_jit.__wrapped__(x, w, mesh, axis, jnp.dtype(jnp.float32), be)  # type: ignore[attr-defined]  # jax.jit sets __wrapped__; its JitWrapped stub omits it
    )
    x2 = collectives.sharded(np.ones((2 * p, 8 * p), np.float32), mesh, P(None, axis))
    w2 = collectives.sharded(np.ones((8 * p, 4), np.float32), mesh, P(axis, None))
    rs = collectives.record_schedule(
        lambda: collectives._matmul_reduce_scatter_jit.__wrapped__(x2, w2, mesh, axis, None, jnp.dtype(jnp.float32), be)  # type: ignore[attr-defined]  # as above
    )
    return {"all_gather_matmul": agmm, "matmul_reduce_scatter": rs}


def seed_case(m: int, k: int, n: int, through_kernel: bool, seed: int = 0) -> dict[str, Any]:
    """The seed notebook's layout on a 2x2 mesh (x, y): x ``P('x', 'y')``, w ``P('x', None)``,
    out ``P('x', None)``: w all-gathered over x, the K-sharded product reduce-scattered
    over y in f32, then all-gathered over y (all-reduce = reduce-scatter + all-gather).
    Compared, like the seed, with a plain single-device bf16 ``x @ w``.

    ``through_kernel`` runs the Pallas kernels; otherwise their xla_reference
    collectives with f32 partials (the seed's ``psum`` of f32 results)."""
    rng = np.random.default_rng(seed)
    bf16 = strategies.np_dtype("bfloat16")
    x = rng.standard_normal((m, k)).astype(bf16)
    w = rng.standard_normal((k, n)).astype(bf16)
    mesh = sharding.make_mesh(sharding.MeshLayout((2, 2), ("x", "y")))
    xs, ws = collectives.sharded(x, mesh, P("x", "y")), collectives.sharded(w, mesh, P("x", None))
    races = []

    def step(fn):
        out = jax.block_until_ready(fn())
        races.append(through_kernel and compat.tpu_interpret_races_found())
        return out

    if through_kernel:
        w_full = step(
            lambda: collectives.all_gather(ws, mesh=mesh, axis="x", spec=P("x", None), backend=KERNEL_BACKEND)
        )
        part = step(
            lambda: collectives.matmul_reduce_scatter(
                xs,
                collectives.sharded(w_full, mesh, P("y", None)),
                mesh=mesh,
                axis="y",
                row_axis="x",
                out_dtype=jnp.float32,
                backend=KERNEL_BACKEND,
            )
        )
        out = step(
            lambda: collectives.all_gather(part, mesh=mesh, axis="y", spec=P(("x", "y"), None), backend=KERNEL_BACKEND)
        )
    else:
        w_full = collectives.xla_reference_all_gather(ws, mesh=mesh, axis="x", spec=P("x", None))
        part = collectives.xla_reference_matmul_reduce_scatter(
            xs,
            collectives.sharded(w_full, mesh, P("y", None)),
            mesh=mesh,
            axis="y",
            row_axis="x",
            out_dtype=jnp.float32,
        )
        out = collectives.xla_reference_all_gather(part, mesh=mesh, axis="y", spec=P(("x", "y"), None))
    sharded_out = _host(out).astype(np.float64)
    plain = _host(jnp.dot(jnp.asarray(x), jnp.asarray(w))).astype(np.float64)  # bf16 result, as in the seed
    ref = oracle.all_gather_matmul_oracle(x, w)
    parts = oracle.partials_oracle(x, w, 2)
    sharded_bound = oracle.matmul_reduce_scatter_bound(
        parts, operand_dtype=bf16, out_dtype=np.float32, partial_dtype=np.float32, arith=ARITH
    )
    plain_bound = oracle.all_gather_matmul_bound(ref, operand_dtype=bf16, out_dtype=bf16, arith=ARITH)
    diff = np.abs(plain - sharded_out)
    worst = np.unravel_index(np.argmax(diff), diff.shape)
    attribution = oracle.attribute_unsharded_bf16(
        ref,
        cast(tuple[int, int], worst),  # numpy's integers, of a 2-D diff
        float(diff[worst]),
        other_err=float(sharded_bound[worst]),
        out_dtype=bf16,
        operand_dtype=bf16,
        arith=ARITH,
    )
    at_128 = np.abs(np.abs(plain) - 128.0) < 1e-9
    return {
        "shape": [m, k, n],
        "through_kernel": through_kernel,
        "races": any(races),
        "max_diff": float(diff.max()),
        "worst_index": [int(i) for i in worst],
        "plain_at_worst": float(plain[worst]),
        "sharded_at_worst": float(sharded_out[worst]),
        "max_diff_where_plain_is_128": float(diff[at_128].max()) if at_128.any() else None,
        "within_bound": bool(np.all(diff <= plain_bound + sharded_bound)),
        "sharded_budget": checks.compare(sharded_out, ref.out, sharded_bound).budget_used,
        "plain_budget": checks.compare(plain, ref.out, plain_bound).budget_used,
        "attribution": dataclasses.asdict(attribution),
        "explained_by_output_rounding": attribution.explained_by_output_rounding,
    }
