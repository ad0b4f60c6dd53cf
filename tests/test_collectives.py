"""The distributed kernels (kernels/collectives.py) on meshes of 2, 4 and 8 CPU devices.

Each device count runs in one child process (properties/device/multidevice.py) that draws
many examples inside, so the pytest process stays single-device and ``-n auto``
stays correct. The checks themselves are in properties/families/collectives.py.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pallascheck.properties.device import multidevice, sharding

CHECKS = "pallascheck.properties.families.collectives"
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))  # where the child imports broken.* from
VARIANTS = "broken.collectives_variants:VARIANTS"
# examples per kernel per device count (ci); more under the dev/fuzz profiles
EXAMPLES = {"ci": 6, "dev": 20, "fuzz": 100, "hardware": 6}


def _examples() -> int:
    return EXAMPLES.get(os.environ.get("PALLASCHECK_PROFILE", "ci"), 6)


# Every 1-D and 2-D mesh the strategies draw for each device count.
MESHES = {2: {"2"}, 4: {"4", "2x2"}, 8: {"8", "2x4", "4x2"}}


@pytest.mark.parametrize("devices", [2, 4, 8])
def test_collectives_on_cpu_devices(devices: int) -> None:
    """Values (every device's shard) within the derived bound, all-gather bit-exact,
    no race reported, bitwise determinism across interpreter seeds, xla_reference
    within the same model, and clear errors for bad layouts."""
    result = multidevice.run_with_cpu_devices(
        f"{CHECKS}:run_checks", devices, {"examples": _examples(), "seed": devices}, timeout_s=400
    )
    assert result.pop("errors") == {}
    for kernel, tally in result.items():
        assert not tally["failures"], f"{kernel} on {devices} devices:\n" + "\n".join(tally["failures"])
        assert sum(tally["examples"].values()) == _examples(), (kernel, tally)
        assert all(b <= 1.0 for b in tally["budget"].values()), (kernel, tally["budget"])
        if kernel == "all_gather":
            assert set(tally["budget"].values()) == {0.0}  # bit-exact
    covered = set().union(*(set(t["meshes"]) for t in result.values()))
    assert covered == MESHES[devices], covered


def test_broken_variants_are_caught() -> None:
    """Kill rate 100%: every broken kernel except the deadlock fails a check on 4
    devices (meshes 4 and 2x2) within a few examples."""
    from broken import collectives_variants

    names = sorted(set(collectives_variants.VARIANTS) - set(collectives_variants.DEADLOCKS))
    result = multidevice.run_with_cpu_devices(
        f"{CHECKS}:run_variants",
        4,
        {"variants": VARIANTS, "names": names, "examples": 12},
        timeout_s=400,
        import_path=TESTS_DIR,
    )
    survived = [name for name in names if not result[name]["caught"]]
    assert not survived, f"survived: {survived}"
    # Which check fires first depends on the interpreter's thread interleaving: the
    # race variants (shared receive semaphore, same destination slot, missing wait)
    # are reported as data races in some runs and by their wrong (NaN) values in
    # others; either way they are caught, which is what is asserted.


def test_deadlock_is_a_timeout_not_a_hang() -> None:
    """A wait with no matching send comes back as ChildTimeout, within the limit, and
    the child had reached the deadlocking kernel (its output names the variant). The
    child gets there in about 3 s (start, imports, the first draw); 8 s leaves room for
    a loaded machine, and a deadlock waits out the whole limit."""
    with pytest.raises(multidevice.ChildTimeout, match=r"deadlock(.|\n)*running variant deadlock_missing_send"):
        multidevice.run_with_cpu_devices(
            f"{CHECKS}:run_variants",
            4,
            {"variants": VARIANTS, "names": ["deadlock_missing_send"], "examples": 1},
            timeout_s=8,
            import_path=TESTS_DIR,
        )


def test_collective_matmuls_overlap_each_copy_with_a_matmul() -> None:
    """Program order of every device: at each step the copy bringing the next block
    starts before the matmul of the block present, and is waited for after it; the
    all-gather-matmul takes p steps (p - 1 copies), the reduce-scatter p - 1 hops."""
    p = 4
    events = multidevice.run_with_cpu_devices(f"{CHECKS}:schedules", p, {"mesh_shape": [p]}, timeout_s=120)
    agmm = [tuple(e[:2]) for e in events["all_gather_matmul"]]
    assert [s for kind, s in agmm if kind == "compute"] == list(range(p))
    for s in range(p - 1):
        assert agmm.index(("start", s)) < agmm.index(("compute", s)) < agmm.index(("wait", s))
    assert ("start", p - 1) not in agmm
    rs = [tuple(e[:2]) for e in events["matmul_reduce_scatter"]]
    assert [s for kind, s in rs if kind == "start"] == list(range(1, p))
    for s in range(1, p):
        assert rs.index(("start", s)) < rs.index(("compute", s)) < rs.index(("wait", s))


def test_seed_bf16_difference_is_output_rounding() -> None:
    """The seed's case: (2048x2048)·(2048x1024) bf16 on a 2x2 mesh, x P('x','y'),
    w P('x', None), out P('x', None), compared with a plain bf16 ``x @ w``. The
    sharded result (f32 partials, psum over y) and the plain one each stay within
    their bounds, and the largest difference (~0.5 near 128, where half a bf16 ulp
    is 0.5) exceeds what accumulation alone allows: the model attributes it to the
    plain product's rounding to bf16, not to a bug. Full size through the
    xla_reference collectives; the Pallas kernels run the same layout smaller."""
    full = multidevice.run_with_cpu_devices(
        f"{CHECKS}:seed_case", 4, {"m": 2048, "k": 2048, "n": 1024, "through_kernel": False}, timeout_s=300
    )
    assert full["within_bound"] and full["explained_by_output_rounding"], full
    assert 0.25 < full["max_diff"] <= 0.5 and 128 <= abs(full["plain_at_worst"]) < 256, full
    assert full["max_diff_where_plain_is_128"] <= 0.5
    small = multidevice.run_with_cpu_devices(
        f"{CHECKS}:seed_case", 4, {"m": 64, "k": 512, "n": 32, "through_kernel": True}, timeout_s=300
    )
    assert not small["races"] and small["within_bound"] and small["sharded_budget"] <= 1.0, small
    assert small["explained_by_output_rounding"], small


@given(st.data())
def test_sharding_strategies_draw_valid_layouts(data) -> None:
    """Meshes over 2/4/8 devices, distinct axis names, and specs that use each mesh
    axis at most once, put the required axis last on its dimension, and tile the
    dimensions built by divisible_dims (single process: no devices needed)."""
    layout = data.draw(sharding.mesh_layouts())
    assert layout.devices in sharding.DEVICE_COUNTS and len(layout.shape) in (1, 2)
    axis = data.draw(st.sampled_from(layout.names))
    dim = data.draw(st.integers(0, 2))
    spec = data.draw(sharding.partition_specs(3, layout, required={dim: axis}))
    entries = [
        () if e is None else (e if isinstance(e, tuple) else (e,)) for e in tuple(spec) + (None,) * (3 - len(spec))
    ]
    used = [a for e in entries for a in e]
    assert len(used) == len(set(used)) and set(used) <= set(layout.names)
    assert entries[dim][-1] == axis
    shape = sharding.divisible_dims(spec, layout, (3, 1, 5))
    assert all(n % sharding.shards(spec, d, layout) == 0 for d, n in enumerate(shape))
