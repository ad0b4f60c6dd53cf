"""Kernel-aware mutation operators: single-point changes to a kernel module's source.

Generic mutation tools (mutmut, cosmic-ray) turn ``+`` into ``-``; the bugs of a Pallas
kernel are elsewhere: a block index map off by one, ``pl.cdiv`` written as ``//``, a
mask that is inclusive where it should not be, an accumulator left in bfloat16, a
dropped online-softmax rescale, a pipeline slot off by one. Each operator below writes
one such bug at one place; ``generate`` lists every mutant of a module's source as the
full mutated source (libcst keeps everything else byte for byte).

Not mutated: argument validation and error paths (``raise``, ``assert``, functions
named like ``_validate`` / ``_check`` / ``configs`` / ``smem_bytes`` / ``xla_reference*``), config dataclasses,
annotations and the jit/custom_vjp/dataclass decorators; a mutant there tests the
harness' error checks or its config space, not the kernel's arithmetic.
"""

from __future__ import annotations

import dataclasses
import difflib
import random
import re
from collections.abc import Sequence
from typing import cast

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import MetadataWrapper, PositionProvider

OPERATORS: dict[str, str] = {
    "index_offset": "an index or block offset off by one: BlockSpec index maps, pl.ds, slices, pl.program_id",
    "loop_bound": "a loop bound off by one: lax.fori_loop, pl.loop, range",
    "cdiv": "pl.cdiv written as floor division, or floor division as pl.cdiv",
    "mask": "a comparison flipped or made (non-)inclusive; a mask's & made |",
    "cast": "a cast removed (.astype, preferred_element_type), a dtype narrowed or widened, or a rounding to "
    "bfloat16 added after a reduction",
    "accumulator": "an accumulator's initial value changed (zeros -> ones, -inf -> 0) or its initialisation dropped",
    "rescale": "a factor or divisor dropped (a * b -> a, a / b -> a, x *= s removed)",
    "reduction": "a reduction's operand swapped for its neighbour (the local bound just before it), or its axis shifted",
    "pipeline": "a pipeline slot or barrier index shifted (x.at[i] -> x.at[i + 1], a % n -> (a + 1) % n)",
    "constant": "a constant perturbed: eps-like (|c| < 1e-3) x10, others by 2^-7 relative",
    "running_stat": "a max/min or running statistic replaced by the new value (maximum(m, x) -> x, acc + x -> x, "
    "+= -> =)",
}

# Functions and classes whose mutants test the harness' error checks or the config
# space, not the kernel.
EXCLUDED_FUNCTIONS = re.compile(
    r"_?validate.*|.*_validate|_?check(_\w+)?|_?smem_bytes|xla_reference.*|configs"
    r"|supported_activations|__\w+__"
)
EXCLUDED_CLASSES = re.compile(r".*Config")
# Decorators that wire a function up rather than compute (pl.when / pl.loop stay in).
WIRING_DECORATORS = re.compile(
    r"(functools\.)?partial|jax\.jit|jit|jax\.custom_vjp|custom_vjp|dataclass(es\.dataclass)?"
    r"|property|staticmethod|classmethod|functools\.\w+"
)
REDUCTIONS = frozenset(
    {
        "sum",
        "mean",
        "max",
        "min",
        "prod",
        "dot",
        "matmul",
        "dot_general",
        "einsum",
        "cumsum",
        "logsumexp",
        "wgmma",
        "argmax",
        "argmin",
        "var",
    }
)
TWO_OPERANDS = frozenset({"dot", "matmul", "dot_general", "wgmma"})
INITIALISERS = frozenset({"zeros", "zeros_like", "full", "full_like", "empty"})
# A perturbation of 2^-7 relative is just above bfloat16's unit roundoff: a constant
# typed to bfloat16's precision. eps-like constants are off by an order of magnitude.
RELATIVE_PERTURBATION = 1.0 + 2.0**-7
EPS_LIKE = 1e-3


@dataclasses.dataclass(frozen=True)
class Mutant:
    """One mutant: where it is, what it changes, and the whole mutated source."""

    id: int
    operator: str
    function: str  # the enclosing function's dotted name, "<module>" at the top level
    line: int
    reach: tuple[int, int]  # the lines of the enclosing statement: one of them executed = reached
    before: str
    after: str
    source: str

    @property
    def label(self) -> str:
        return f"#{self.id} {self.operator} line {self.line} ({self.function}): {_short(self.before)} -> {_short(self.after)}"

    def diff(self, original: str, path: str) -> str:
        return "".join(
            difflib.unified_diff(
                original.splitlines(keepends=True),
                self.source.splitlines(keepends=True),
                fromfile=f"a/{path}",
                tofile=f"b/{path} (mutant #{self.id})",
                n=1,
            )
        )


def _short(code: str, width: int = 70) -> str:
    flat = " ".join(code.split())
    return flat if len(flat) <= width else flat[: width - 3] + "..."


def generate(
    source: str,
    *,
    path: str = "<kernel>",
    operators: Sequence[str] | None = None,
    function: str | None = None,
    max_mutants: int | None = None,
    seed: int = 0,
) -> list[Mutant]:
    """Every mutant of ``source`` by ``operators`` (default all), in functions whose
    dotted name matches the regex ``function`` (default any); ``max_mutants``: a
    sample of that many, drawn with ``seed``, in source order. Mutants whose source
    is another mutant's, or does not compile, are dropped."""
    unknown = sorted(set(operators or ()) - set(OPERATORS))
    if unknown:
        raise ValueError(f"operators must be among {sorted(OPERATORS)}, got {unknown}")
    if max_mutants is not None and max_mutants < 1:
        raise ValueError(f"max_mutants must be >= 1, got {max_mutants}")
    wrapper = MetadataWrapper(cst.parse_module(source))
    finder = _Finder(wrapper.module, set(operators or OPERATORS), re.compile(function) if function else None)
    wrapper.visit(finder)
    seen = {source}
    mutants: list[Mutant] = []
    for found in finder.found:
        mutated = cast(cst.Module, wrapper.module.deep_replace(found.old, found.new)).code  # a module stays one
        if mutated in seen:
            continue
        seen.add(mutated)
        try:
            compile(mutated, path, "exec")
        except SyntaxError:
            continue
        mutants.append(
            Mutant(
                len(mutants),
                found.operator,
                found.function,
                found.line,
                found.reach,
                wrapper.module.code_for_node(found.old),
                wrapper.module.code_for_node(found.new),
                mutated,
            )
        )
    if max_mutants is not None and len(mutants) > max_mutants:
        keep = set(random.Random(seed).sample(range(len(mutants)), max_mutants))
        mutants = [m for m in mutants if m.id in keep]
    return mutants


@dataclasses.dataclass(frozen=True)
class _Found:
    operator: str
    old: cst.CSTNode
    new: cst.CSTNode
    function: str
    line: int
    reach: tuple[int, int]


@dataclasses.dataclass
class _Scope:
    name: str
    carried: list[str]  # params, and names unpacked from a param (a loop body's carry)
    bindings: list[str]  # params, then names bound in the body, in order of first binding
    is_function: bool


def _expr(code: str) -> cst.BaseExpression:
    return cst.parse_expression(code)


class _Bindings(cst.CSTVisitor):
    """Names a function body binds, in order, without entering nested functions."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def _add(self, target: cst.CSTNode) -> None:
        if isinstance(target, cst.Name):
            if target.value not in self.names:
                self.names.append(target.value)
        elif isinstance(target, (cst.Tuple, cst.List)):
            for element in target.elements:
                self._add(element.value)

    def visit_AssignTarget(self, node: cst.AssignTarget) -> None:
        self._add(node.target)

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        self._add(node.target)

    def visit_For(self, node: cst.For) -> None:
        self._add(node.target)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        return False

    def visit_Lambda(self, node: cst.Lambda) -> bool:
        return False


class _Rename(cst.CSTTransformer):
    """Every ``old`` name that is a variable (not an attribute or a keyword) becomes ``new``."""

    def __init__(self, old: str, new: str):
        self.old, self.new = old, new

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        return True

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.Attribute:
        return updated.with_changes(attr=original.attr)

    def leave_Arg(self, original: cst.Arg, updated: cst.Arg) -> cst.Arg:
        return updated.with_changes(keyword=original.keyword)

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.Name:
        return updated.with_changes(value=self.new) if original.value == self.old else updated


def _variables(node: cst.CSTNode) -> list[str]:
    """Variable names used in ``node`` (not attribute names, keywords or called functions' attributes)."""
    names: list[str] = []

    class Collect(cst.CSTVisitor):
        def visit_Attribute(self, attribute: cst.Attribute) -> bool:
            attribute.value.visit(self)
            return False

        def visit_Arg(self, arg: cst.Arg) -> bool:
            arg.value.visit(self)
            return False

        def visit_Name(self, name: cst.Name) -> None:
            if name.value not in names:
                names.append(name.value)

    node.visit(Collect())
    return names


def _module_names(module: cst.Module) -> set[str]:
    """The names the module's top-level imports bind (``jnp``, ``pl``, ``lax``, ...)."""
    names: set[str] = set()
    for statement in module.body:
        if not isinstance(statement, cst.SimpleStatementLine):
            continue
        for small in statement.body:
            if isinstance(small, (cst.Import, cst.ImportFrom)) and not isinstance(small.names, cst.ImportStar):
                for alias in small.names:
                    bound = alias.asname.name if alias.asname else alias.name
                    name = get_full_name_for_node(bound) or ""
                    names.add(name.split(".")[0])
    return names


def _number(node: cst.BaseExpression) -> int | None:
    """The value of an integer literal (possibly negated), else None."""
    if isinstance(node, cst.Integer):
        return int(node.value, 0)
    if (
        isinstance(node, cst.UnaryOperation)
        and isinstance(node.operator, cst.Minus)
        and isinstance(node.expression, cst.Integer)
    ):
        return -int(node.expression.value, 0)
    return None


_FLIPPED = {
    cst.LessThan: cst.GreaterThanEqual,
    cst.LessThanEqual: cst.GreaterThan,
    cst.GreaterThan: cst.LessThanEqual,
    cst.GreaterThanEqual: cst.LessThan,
    cst.Equal: cst.NotEqual,
    cst.NotEqual: cst.Equal,
}
_INCLUSIVE = {
    cst.LessThan: cst.LessThanEqual,
    cst.LessThanEqual: cst.LessThan,
    cst.GreaterThan: cst.GreaterThanEqual,
    cst.GreaterThanEqual: cst.GreaterThan,
}


class _Finder(cst.CSTVisitor):
    METADATA_DEPENDENCIES = (PositionProvider,)

    def __init__(self, module: cst.Module, operators: set[str], function: re.Pattern[str] | None):
        self.module = module
        self.operators = operators
        self.function = function
        self.imports = _module_names(module)
        self.found: list[_Found] = []
        self.scopes: list[_Scope] = []
        self.statements: list[cst.CSTNode] = []

    # ------------------------------------------------------------------ bookkeeping

    def code(self, node: cst.CSTNode) -> str:
        return self.module.code_for_node(node)

    def qualname(self) -> str:
        return ".".join(s.name for s in self.scopes) or "<module>"

    def add(self, operator: str, old: cst.CSTNode, new: cst.CSTNode | str) -> None:
        if operator not in self.operators:
            return
        if self.function is not None and not self.function.fullmatch(self.qualname()):
            return
        position = self.get_metadata(PositionProvider, old)
        first, last = position.start.line, position.end.line
        if self.statements:
            statement = self.get_metadata(PositionProvider, self.statements[-1])
            first, last = min(first, statement.start.line), max(last, statement.end.line)
        new_node = _expr(new) if isinstance(new, str) else new
        self.found.append(_Found(operator, old, new_node, self.qualname(), position.start.line, (first, last)))

    def function_scope(self) -> _Scope | None:
        return next((s for s in reversed(self.scopes) if s.is_function), None)

    def binding_scope(self, name: str) -> _Scope | None:
        """The innermost enclosing function that binds ``name``."""
        return next((s for s in reversed(self.scopes) if s.is_function and name in s.bindings), None)

    def visit_FunctionDef(self, node: cst.FunctionDef) -> bool:
        params = [p.name.value for p in (*node.params.posonly_params, *node.params.params, *node.params.kwonly_params)]
        for star in (node.params.star_arg, node.params.star_kwarg):
            if isinstance(star, cst.Param):
                params.append(star.name.value)
        bindings = _Bindings()
        node.body.visit(bindings)
        carried = list(params)
        for statement in node.body.body:
            for small in statement.body if isinstance(statement, cst.SimpleStatementLine) else ():
                if isinstance(small, cst.Assign) and isinstance(small.value, cst.Name) and small.value.value in params:
                    unpacked = _Bindings()
                    for target in small.targets:
                        unpacked._add(target.target)
                    carried += unpacked.names
        self.scopes.append(
            _Scope(node.name.value, carried, params + [n for n in bindings.names if n not in params], True)
        )
        return not EXCLUDED_FUNCTIONS.fullmatch(node.name.value)

    def leave_FunctionDef(self, original_node: cst.FunctionDef) -> None:
        self.scopes.pop()

    def visit_ClassDef(self, node: cst.ClassDef) -> bool:
        self.scopes.append(_Scope(node.name.value, [], [], False))
        return not EXCLUDED_CLASSES.fullmatch(node.name.value)

    def leave_ClassDef(self, original_node: cst.ClassDef) -> None:
        self.scopes.pop()

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> None:
        self.statements.append(node)

    def leave_SimpleStatementLine(self, original_node: cst.SimpleStatementLine) -> None:
        self.statements.pop()

    def visit_Raise(self, node: cst.Raise) -> bool:
        return False

    def visit_Assert(self, node: cst.Assert) -> bool:
        return False

    def visit_Annotation(self, node: cst.Annotation) -> bool:
        return False

    def visit_Decorator(self, node: cst.Decorator) -> bool:
        return not WIRING_DECORATORS.fullmatch(get_full_name_for_node(node.decorator) or "")

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    # ------------------------------------------------------------------ operators

    def visit_Call(self, node: cst.Call) -> None:
        name = get_full_name_for_node(node.func) or ""
        short = name.rsplit(".", 1)[-1]
        module_call = name.split(".")[0] in self.imports and "." in name
        positional = [a for a in node.args if a.keyword is None and not a.star]
        if name.endswith("BlockSpec"):
            for arg in node.args:
                if isinstance(arg.value, cst.Lambda):
                    self.index_map(arg.value)
        elif short in ("ds", "dslice") and module_call and len(positional) >= 2:
            self.add("index_offset", positional[0].value, f"({self.code(positional[0].value)} + 1)")
            self.add("index_offset", positional[1].value, f"({self.code(positional[1].value)} - 1)")
        elif short == "program_id" and module_call:
            self.add("index_offset", node, f"({self.code(node)} + 1)")
        elif short == "cdiv" and len(positional) == 2:
            a, b = (self.code(p.value) for p in positional)
            self.add("cdiv", node, f"(({a}) // ({b}))")
        elif (short == "fori_loop" or (short == "loop" and module_call)) and len(positional) >= 2:
            self.loop_bounds(positional[0].value, positional[1].value)
            if short == "fori_loop" and len(positional) >= 4:
                self.initialisers(positional[3].value)
        elif name == "range" and positional:
            if len(positional) == 1:
                self.add("loop_bound", positional[0].value, f"({self.code(positional[0].value)} - 1)")
            else:
                self.loop_bounds(positional[0].value, positional[1].value)
        elif short == "astype" and isinstance(node.func, cst.Attribute) and len(node.args) == 1:
            self.add("cast", node, node.func.value)
        if module_call and short in REDUCTIONS:
            self.reduction(node, positional[: 2 if short in TWO_OPERANDS else 1])
        if (
            module_call
            and short in ("maximum", "minimum", "max", "min")
            and len(positional) == 2
            and not any(a.keyword for a in node.args)
        ):
            self.add("running_stat", node, positional[1].value)
        if (
            module_call
            and short in ("full", "full_like")
            and len(positional) >= 2
            and "-inf"
            in self.code(positional[1].value)
            .replace(" ", "")
            .replace("jnp.", "")
            .replace("np.", "")
            .replace("math.", "")
        ):
            self.add("accumulator", positional[1].value, "0.0")
        for arg in node.args:
            if arg.keyword is not None and arg.keyword.value == "preferred_element_type":
                kept = [a for a in node.args if a is not arg]
                kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
                self.add("cast", node, node.with_changes(args=kept))

    def index_map(self, fn: cst.Lambda) -> None:
        body = fn.body
        elements = [e.value for e in body.elements] if isinstance(body, cst.Tuple) else [body]
        for element in elements:
            self.add("index_offset", element, f"({self.code(element)} + 1)")

    def loop_bounds(self, lower: cst.BaseExpression, upper: cst.BaseExpression) -> None:
        self.add("loop_bound", lower, f"({self.code(lower)} + 1)")
        self.add("loop_bound", upper, f"({self.code(upper)} - 1)")

    def initialisers(self, init: cst.BaseExpression) -> None:
        """zeros -> ones in an accumulator's initial value (a call, or a tuple of calls)."""
        values = [e.value for e in init.elements] if isinstance(init, (cst.Tuple, cst.List)) else [init]
        for value in values:
            if isinstance(value, cst.Call):
                name = get_full_name_for_node(value.func) or ""
                if name.rsplit(".", 1)[-1] in ("zeros", "zeros_like") and isinstance(value.func, cst.Attribute):
                    ones = value.func.attr.value.replace("zeros", "ones")
                    self.add(
                        "accumulator", value, value.with_changes(func=value.func.with_changes(attr=cst.Name(ones)))
                    )

    def reduction(self, node: cst.Call, operands: Sequence[cst.Arg]) -> None:
        for operand in operands:
            for variable in _variables(operand.value):
                scope = self.binding_scope(variable)
                if scope is None:
                    continue
                names = scope.bindings
                i = names.index(variable)
                neighbour = names[i - 1] if i > 0 else (names[1] if len(names) > 1 else None)
                if neighbour is not None:
                    # a rename never removes the expression nor splits it
                    renamed = cast(cst.BaseExpression, operand.value.visit(_Rename(variable, neighbour)))
                    self.add("reduction", operand.value, renamed)
        for arg in node.args:
            if arg.keyword is not None and arg.keyword.value == "axis" and (axis := _number(arg.value)) is not None:
                shifted = axis + 1 if axis == 0 else axis - 1
                self.add("reduction", arg.value, str(shifted))
        if "jnp" in self.imports and not self.code(node).endswith("bfloat16)"):
            self.add("cast", node, f"{self.code(node)}.astype(jnp.bfloat16)")

    def visit_Attribute(self, node: cst.Attribute) -> None:
        name = get_full_name_for_node(node) or ""
        prefix, _, attr = name.rpartition(".")
        if prefix.split(".")[0] not in self.imports:
            return
        if attr == "float32":
            self.add("cast", node, node.with_changes(attr=cst.Name("bfloat16")))
        elif attr in ("bfloat16", "float16"):
            self.add("cast", node, node.with_changes(attr=cst.Name("float32")))
        elif attr in ("e", "pi"):
            self.add("constant", node, f"({name} * {RELATIVE_PERTURBATION!r})")

    def visit_Subscript(self, node: cst.Subscript) -> None:
        if isinstance(node.value, cst.Attribute) and node.value.attr.value == "at":
            for element in node.slice:
                if isinstance(element.slice, cst.Index) and isinstance(
                    element.slice.value, (cst.Name, cst.Integer, cst.BinaryOperation)
                ):
                    self.add("pipeline", element.slice.value, f"({self.code(element.slice.value)} + 1)")

    def visit_Slice(self, node: cst.Slice) -> None:
        if node.lower is not None:
            self.add("index_offset", node.lower, f"({self.code(node.lower)} + 1)")
        if node.upper is not None:
            self.add("index_offset", node.upper, f"({self.code(node.upper)} - 1)")

    def visit_Comparison(self, node: cst.Comparison) -> None:
        operands = [node.left] + [t.comparator for t in node.comparisons]
        if any(isinstance(o, (cst.SimpleString, cst.FormattedString, cst.ConcatenatedString)) for o in operands):
            return  # Python-level dispatch on a name ("layer_norm"), not a mask
        for target in node.comparisons:
            op = type(target.operator)
            for table in (_FLIPPED, _INCLUSIVE):
                if op in table:
                    new_op = table[op](
                        whitespace_before=target.operator.whitespace_before,  # type: ignore[attr-defined]  # every concrete BaseCompOp has it; the base class does not declare it
                        whitespace_after=target.operator.whitespace_after,  # type: ignore[attr-defined]  # as above
                    )
                    self.add("mask", node, node.deep_replace(target.operator, new_op))

    def visit_BinaryOperation(self, node: cst.BinaryOperation) -> None:
        if any(isinstance(o, (cst.SimpleString, cst.FormattedString)) for o in (node.left, node.right)):
            return
        left, right = self.code(node.left), self.code(node.right)
        op = node.operator
        if isinstance(op, cst.FloorDivide):
            self.add(
                "cdiv", node, f"pl.cdiv({left}, {right})" if "pl" in self.imports else f"(-(-({left}) // ({right})))"
            )
        elif isinstance(op, cst.BitAnd):
            self.add(
                "mask",
                node,
                node.with_changes(
                    operator=cst.BitOr(whitespace_before=op.whitespace_before, whitespace_after=op.whitespace_after)
                ),
            )
        elif isinstance(op, cst.Modulo):
            self.add("pipeline", node, f"(({left} + 1) % {right})")
        elif isinstance(op, (cst.Multiply, cst.Divide)):
            self.add("rescale", node, f"({left})")
        elif isinstance(op, cst.Add):
            scope = self.function_scope()
            nested = sum(s.is_function for s in self.scopes) >= 2
            if scope is not None and nested and set(_variables(node.left)) & set(scope.carried):
                self.add("running_stat", node, f"({right})")

    def visit_AugAssign(self, node: cst.AugAssign) -> None:
        if isinstance(node.operator, (cst.MultiplyAssign, cst.DivideAssign)):
            self.add("rescale", node, cst.Pass())
        elif isinstance(node.operator, cst.AddAssign):
            self.add("running_stat", node, cst.Assign(targets=[cst.AssignTarget(node.target)], value=node.value))

    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) != 1 or self.function_scope() is None:
            return
        value = node.value
        if (
            not isinstance(value, cst.Call)
            or (get_full_name_for_node(value.func) or "").rsplit(".", 1)[-1] not in INITIALISERS
        ):
            return
        self.initialisers(value)
        if isinstance(node.targets[0].target, cst.Subscript):  # a scratch/output ref initialised in place
            self.add("accumulator", node, cst.Pass())

    def visit_Float(self, node: cst.Float) -> None:
        value = float(node.value)
        if value == 0.0:
            return
        perturbed = value * 10.0 if abs(value) < EPS_LIKE else value * RELATIVE_PERTURBATION
        self.add("constant", node, cst.Float(repr(perturbed)))
