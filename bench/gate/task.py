"""A gate task: what a candidate must compute, on which inputs, to which bound.

A task file is a Python module with a module-level ``TASK = Task(...)``: the reference
is jax.numpy code and the input domain needs value generators (labels below the vocab,
group sizes that sum to the rows), so the file is code, checked by the type checker,
rather than TOML that would have to name Python functions anyway. The shipped tasks are
the modules of ``pallascheck.bench.gate.tasks`` (``shipped_tasks()``).

The candidate is called as ``candidate(*inputs, **options)`` (plus ``interpret=`` where
its signature has that keyword) and must return one array of the reference's shape and
dtype.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import itertools
import pkgutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pallascheck.oracles.derive import Facts
from pallascheck.properties import strategies

Dims = Mapping[str, int]
# values(rng, dims, shape, dtype) -> array: an input's domain where the element kinds do not fit
Values = Callable[[np.random.Generator, Dims, tuple[int, ...], np.dtype], np.ndarray]


@dataclasses.dataclass(frozen=True)
class Arg:
    """One input of the task, in call order.

    - ``shape``: dimension names (from ``Task.dims``) or fixed sizes;
    - ``dtype``: None: the dtype under test; else fixed ("int32" labels);
    - ``values``: its domain (``Values``); None: the drawn adversarial element kind;
    - ``reduction``: the dimension name of the sums it enters (the "large" kind stays
      below overflow there);
    - ``kinds``: the element kinds that suit it (None: all);
    - ``differentiable``: its gradient is checked where the task asks for gradients.
    """

    shape: tuple[str | int, ...]
    dtype: str | None = None
    values: Values | None = None
    reduction: str | int = 1
    kinds: Sequence[str] | None = None
    differentiable: bool = True

    def shape_for(self, dims: Dims) -> tuple[int, ...]:
        return tuple(dims[d] if isinstance(d, str) else d for d in self.shape)


@dataclasses.dataclass(frozen=True)
class Task:
    """What the candidate must compute.

    - ``reference(*inputs, **options)``: plain jax.numpy, one output array; the gate
      derives the float64 oracle and the bound from it (oracles/derive.py);
    - ``dims``: each dimension's domain (its possible sizes, the small tier); ``shown``:
      the sizes the candidate's author was shown; the gate also draws others;
    - ``valid``: a rule over drawn sizes (a head count dividing another); None: any;
    - ``options``: each keyword option's values, the first the default;
    - ``facts``: how the kernel must compute (the declared precision: its bound);
    - ``dtypes``: the dtypes under test; ``gradients``: check the VJP;
    - ``signature``: what the candidate is, in one line, for its author;
    - ``formulations`` / ``gradient_formulations``: the task's contract. A derived
      bound models one order of operations; these name the other orders in which
      correct kernels compute the op (each in jax.numpy, called like the reference;
      the gradient ones ``f(*inputs, cotangent)`` -> each differentiable input's
      gradient), and every bound is the largest of their derivations and the
      reference's at the declared facts (``from_reference``). Each is an exact
      rewriting of the reference (the derivation refuses one that is not), so a
      kernel below the declared precision still fails.
    """

    name: str
    reference: Callable[..., Any]
    inputs: Mapping[str, Arg]
    dims: Mapping[str, Sequence[int]]
    shown: Dims
    signature: str
    options: Mapping[str, Sequence[Any]] = dataclasses.field(default_factory=dict)
    facts: Facts = Facts(compute_dtype="float32")
    dtypes: Sequence[str] = ("float32", "bfloat16")
    gradients: bool = False
    valid: Callable[[Dims], bool] | None = None
    kinds: Sequence[str] = strategies.ELEMENT_KINDS
    formulations: Sequence[Callable[..., Any]] = ()
    gradient_formulations: Sequence[Callable[..., Any]] = ()

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError(f"task {self.name}: inputs must name at least one argument")
        for name, arg in self.inputs.items():
            unknown = [d for d in arg.shape if isinstance(d, str) and d not in self.dims]
            if unknown:
                raise ValueError(
                    f"task {self.name}: input {name}'s shape names {unknown}, not in dims {list(self.dims)}"
                )
        if set(self.shown) != set(self.dims):
            raise ValueError(
                f"task {self.name}: shown must give every dim {sorted(self.dims)}, got {sorted(self.shown)}"
            )
        for d, size in self.shown.items():
            if size not in self.dims[d]:
                raise ValueError(f"task {self.name}: shown {d}={size} is not among dims[{d!r}] {tuple(self.dims[d])}")
        if not self.is_valid(self.shown):
            raise ValueError(f"task {self.name}: the shown sizes {dict(self.shown)} break the task's own rule (valid)")
        for opt, values in self.options.items():
            if not values:
                raise ValueError(f"task {self.name}: option {opt} needs at least one value (the first is its default)")
        for dtype in self.dtypes:
            strategies.np_dtype(dtype)  # an unknown dtype fails here, naming it
        if self.gradients and not any(a.differentiable and a.dtype is None for a in self.inputs.values()):
            raise ValueError(f"task {self.name}: gradients asked, but no input of the tested dtype is differentiable")
        if self.gradient_formulations and not self.gradients:
            raise ValueError(f"task {self.name}: gradient_formulations given, but gradients=False checks no gradient")

    def only_dtypes(self, dtypes: Sequence[str] | None) -> Task:
        """This task tested in ``dtypes`` only (a kernel written for some of its dtypes,
        a Mosaic GPU kernel without f32); None: all of them."""
        if dtypes is None:
            return self
        unknown = [d for d in dtypes if d not in self.dtypes]
        if unknown or not dtypes:
            raise ValueError(
                f"dtypes {list(dtypes)}: each must be one of task {self.name}'s dtypes ({', '.join(self.dtypes)})"
            )
        return dataclasses.replace(self, dtypes=tuple(dict.fromkeys(dtypes)))

    def is_valid(self, dims: Dims) -> bool:
        return self.valid is None or bool(self.valid(dims))

    def option_sets(self) -> list[dict[str, Any]]:
        """Every combination of the options, the defaults first."""
        names = list(self.options)
        return [dict(zip(names, combo)) for combo in itertools.product(*(self.options[n] for n in names))]

    def default_options(self) -> dict[str, Any]:
        return self.option_sets()[0]

    def shapes(self, dims: Dims) -> dict[str, tuple[int, ...]]:
        return {name: arg.shape_for(dims) for name, arg in self.inputs.items()}

    def draw_dims(self, seed: int, count: int) -> list[dict[str, int]]:
        """``count`` sizes of the domain other than the shown ones and each other, drawn
        uniformly from ``seed`` (fewer where the domain holds fewer). Uniform, not
        Hypothesis' ``find``: that shrinks every draw to the smallest sizes."""
        rng = np.random.default_rng(seed)
        valid = [
            dict(zip(self.dims, sizes))
            for sizes in itertools.product(*self.dims.values())
            if self.is_valid(dict(zip(self.dims, sizes))) and dict(zip(self.dims, sizes)) != dict(self.shown)
        ]
        picks = rng.permutation(len(valid))[:count]
        return [valid[int(i)] for i in picks]


TASKS_PACKAGE = "pallascheck.bench.gate.tasks"


def shipped_tasks() -> list[str]:
    """The names of the shipped tasks (the modules of ``TASKS_PACKAGE``)."""
    package = importlib.import_module(TASKS_PACKAGE)
    return sorted(m.name for m in pkgutil.iter_modules(package.__path__))


def load_task(name: str) -> Task:
    """The task a shipped name or a ``.py`` file names (its module-level ``TASK``)."""
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise ValueError(f"task: no file {name}")
        module_spec = importlib.util.spec_from_file_location(f"pallascheck_task_{path.stem}", path)
        assert module_spec is not None and module_spec.loader is not None  # a .py file always has both
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    elif name in shipped_tasks():
        module = importlib.import_module(f"{TASKS_PACKAGE}.{name}")
    else:
        raise ValueError(f"task: {name!r} is neither a .py file nor a shipped task ({', '.join(shipped_tasks())})")
    task = getattr(module, "TASK", None)
    if not isinstance(task, Task):
        raise ValueError(f"task: {name} must define a module-level TASK = Task(...), got {type(task).__name__}")
    return task
