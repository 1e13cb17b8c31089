"""Which level groups can execute a seeded defect's edit: impact analysis for the sweep (grader/sweep/).

The clean oracle is graded once under branch coverage (grade(..., coverage=True)), which gives the lines
each level group's sandboxed child executed, per candidate file. A mutant differs from the oracle in one file.
A level group whose child executed no code the edit changes runs the mutant exactly as it ran the oracle
(same code executed, same inputs, deterministic CPU: same outputs), so the sweep reuses the clean scores
there instead of running that child.

What "code the edit changes" is, from the narrowest that is still sound to the widest:

- line level (`anchors`): the old and the new file are parsed and their statement trees compared. Where a
  compound statement keeps its header (an `if`'s test, a `def`'s name, arguments, decorators, a `for`'s
  target and iterable, ...) the comparison descends into its bodies; a statement that differs otherwise is
  an *anchor*, and so is, in a body whose length changed, the first statement that differs (or the last one
  when statements were appended). Execution of the mutant equals the oracle's until control reaches an
  anchor: statements in a body run in order, so any changed statement after an anchor is reached only
  through it. An anchor is reached only if the oracle's child recorded a line event in its span (first
  decorator line to last line): CPython 3.10+ (PEP 626) emits a line event for every executed line, and
  coverage.py records the raw lines. A `def` or decorator or default-argument edit is an anchor on the
  `def` statement, which runs at import; a function body edit is an anchor inside the body, which runs
  only when called.
- file level, where the line level cannot be shown sound: the edit changes a statement that has no
  bytecode of its own (a docstring, `global`, a bare annotation, a constant-folded branch: reaching it
  leaves no trace), or it changes how *unchanged* statements compile: the code objects of the old and the
  new file differ in shape (nesting, names, flags such as generator or coroutine, argument counts) or in
  how a name both use is bound (local, cell, free or global: an assignment added in one branch makes a
  name local in the whole function). Then the whole file counts: a group is impacted when its child
  executed any line of the file. A module's top level runs whenever it is imported, so this is "the child
  imported the file".
- a group whose coverage run did not reproduce the clean scores (a timeout under the tracer's slowdown,
  say) has no trustworthy coverage and is always graded.

What the coverage can see: the child starts the tracer before it imports any candidate module (grader/probes/
common.py; tests/grader/test_sweep.py checks that no grader module imports one at its top), and candidate code runs on
the child's Python threads only (no JAX host callbacks or threads in the solution trees: also a test), so a
line the child ran is a line the tracer recorded. The premise is the one the sweep's noise already rests on:
on this CPU the same code on the same inputs gives the same outputs (two clean gradings are bit-identical).

Dependencies between groups: training L6 runs on the adapter the L5 child produced (grader/app.py), so
when L5 is graded, L6 is too. Every grade still runs the independence gate (L0/torch_free, a static scan
of the whole tree and import-linter) in the grader process.
"""
from __future__ import annotations

import ast
import types
from dataclasses import dataclass

from catalog import pysource

__all__ = ["Anchors", "CANDIDATE_ROOTS", "Impact", "anchors", "edited_spans", "group_impact"]

CANDIDATE_ROOTS = ("jax_oracles", "serving_engine", "conversion")  # what a mutant edits (grader/sweep/)

# compound statements whose bodies are compared one by one when their headers agree
_BODIES = ("body", "orelse", "finalbody")
_DESCEND = (ast.If, ast.For, ast.AsyncFor, ast.While, ast.With, ast.AsyncWith, ast.FunctionDef,
            ast.AsyncFunctionDef, ast.ClassDef, ast.Try)
_SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)


def _same(a, b) -> bool:
    return ast.dump(a, include_attributes=False) == ast.dump(b, include_attributes=False)


def _header_same(o: ast.stmt, n: ast.stmt) -> bool:
    for field in o._fields:
        if field in _BODIES or field == "handlers":
            continue
        a, b = getattr(o, field), getattr(n, field)
        if isinstance(a, list):
            if len(a) != len(b) or not all(_same(x, y) if isinstance(x, ast.AST) else x == y for x, y in zip(a, b)):
                return False
        elif isinstance(a, ast.AST) or isinstance(b, ast.AST):
            if not (isinstance(a, ast.AST) and isinstance(b, ast.AST) and _same(a, b)):
                return False
        elif a != b:
            return False
    return True


def _diff_body(old: list, new: list, parent, out: list) -> None:
    if len(old) == len(new):
        for o, n in zip(old, new):
            if not _same(o, n):
                _diff_stmt(o, n, out)
        return
    if not old or not new:  # a body appears or goes (an else added): the parent statement changed
        out.append(parent)
        return
    i = next((k for k, (o, n) in enumerate(zip(old, new)) if not _same(o, n)), min(len(old), len(new)))
    out.append(old[min(i, len(old) - 1)])


def _diff_stmt(o: ast.stmt, n: ast.stmt, out: list) -> None:
    if type(o) is not type(n) or not isinstance(o, _DESCEND) or not _header_same(o, n):
        out.append(o)
        return
    if isinstance(o, ast.Try):
        if len(o.handlers) != len(n.handlers) or not all(
                _same_opt(a.type, b.type) and a.name == b.name for a, b in zip(o.handlers, n.handlers)):
            out.append(o)
            return
        for a, b in zip(o.handlers, n.handlers):
            _diff_body(a.body, b.body, o, out)
    for field in _BODIES:
        if field in o._fields:
            _diff_body(getattr(o, field), getattr(n, field), o, out)


def _same_opt(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and _same(a, b))


def _span(node: ast.stmt) -> tuple[int, int]:
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


def _code_objects(code: types.CodeType):
    yield code
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            yield from _code_objects(c)


def _code_lines(code: types.CodeType) -> set[int]:
    return {line for _, _, line in code.co_lines() if line is not None}


def _shape_difference(old: types.CodeType, new: types.CodeType) -> str | None:
    """Why unchanged statements could compile differently in `new` (None when they cannot): the code objects
    pair up one to one (same nesting, names, flags, argument counts) and every name both code objects use is
    bound the same way in both (a local, a cell, a free variable, or looked up by name)."""
    olds, news = list(_code_objects(old)), list(_code_objects(new))
    if [c.co_qualname for c in olds] != [c.co_qualname for c in news]:
        return "the edit adds, removes or renames a function, class, lambda or comprehension"
    for a, b in zip(olds, news):
        for attr in ("co_flags", "co_argcount", "co_posonlyargcount", "co_kwonlyargcount"):
            if getattr(a, attr) != getattr(b, attr):
                return f"{a.co_qualname}: {attr} changes (e.g. it becomes a generator)"

        def binding(c, name):
            return (name in c.co_varnames, name in c.co_cellvars, name in c.co_freevars)

        shared = (set(a.co_varnames) | set(a.co_cellvars) | set(a.co_freevars) | set(a.co_names)) & (
            set(b.co_varnames) | set(b.co_cellvars) | set(b.co_freevars) | set(b.co_names))
        moved = sorted(x for x in shared if binding(a, x) != binding(b, x))
        if moved:
            return f"{a.co_qualname}: the binding of {', '.join(moved[:5])} changes"
    return None


@dataclass(frozen=True)
class Anchors:
    """The line spans of the old file a child must have executed to be affected (file_level: any line)."""
    spans: tuple[tuple[int, int], ...]
    file_level: str | None  # why the line level is not used (None: it is)


def anchors(old_src: str, new_src: str, filename: str = "<defect>") -> Anchors:
    old_tree, new_tree = pysource.parse(old_src, filename), pysource.parse(new_src, filename)
    out: list[ast.stmt] = []
    _diff_body(old_tree.body, new_tree.body, None, out)
    if not out or any(o is None for o in out):
        return Anchors((), "the edit changes the module as a whole")
    old_code, new_code = compile(old_src, filename, "exec"), compile(new_src, filename, "exec")
    why = _shape_difference(old_code, new_code)
    if why:
        return Anchors((), why)
    # each anchor must have bytecode of its own, in the code object that runs it
    owners = {(c.co_name, c.co_firstlineno): c for c in _code_objects(old_code)}
    scope_of = _enclosing_scopes(old_tree)
    spans = []
    for node in out:
        scope = scope_of.get(id(node))
        if scope is None:
            code = old_code
        else:
            name = "<lambda>" if isinstance(scope, ast.Lambda) else scope.name
            code = owners.get((name, _span(scope)[0] if not isinstance(scope, ast.Lambda) else scope.lineno))
        first, last = _span(node)
        if code is None or not _code_lines(code) & set(range(first, last + 1)):
            return Anchors((), f"line {first}: the changed statement has no bytecode of its own (a docstring, "
                               f"a declaration, a folded constant branch)")
        spans.append((first, last))
    return Anchors(tuple(sorted(set(spans))), None)


def _enclosing_scopes(tree: ast.Module) -> dict[int, ast.AST]:
    """id(statement) -> the innermost def/class (or lambda) whose code object runs it; module level absent."""
    out: dict[int, ast.AST] = {}

    def visit(node, scope):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt) and scope is not None:
                out[id(child)] = scope
            # a def's decorators, defaults and annotations hold no statements; its body runs in its own code
            visit(child, child if isinstance(child, _SCOPES) else scope)

    visit(tree, None)
    return out


def edited_spans(old_src: str, new_src: str) -> Anchors:
    """anchors(), or file level when the sources do not parse (a defect always parses: tests check it)."""
    try:
        return anchors(old_src, new_src)
    except SyntaxError as e:
        return Anchors((), f"does not parse: {e}")


@dataclass(frozen=True)
class Impact:
    """Per level group: is the mutant graded there, and why (or why not)."""
    graded: dict[str, bool]
    why: dict[str, str]


def group_impact(file: str, spans: Anchors, executed_by_group: dict[str, dict | None],
                 depends: dict[str, tuple[str, ...]] | None = None) -> Impact:
    """executed_by_group: group name -> {file: {"lines": [...]}} from the clean coverage run, or None where that
    run is not trustworthy (the group is then graded). depends: group -> groups whose outputs it consumes."""
    graded, why = {}, {}
    for group, executed in executed_by_group.items():
        if executed is None:
            graded[group], why[group] = True, "no trustworthy coverage of the clean oracle"
            continue
        lines = set((executed.get(file) or {}).get("lines") or ())
        if not lines:
            graded[group], why[group] = False, f"the clean oracle's child never imports {file}"
        elif spans.file_level is not None:
            graded[group], why[group] = True, f"imports {file} (file level: {spans.file_level})"
        else:
            hit = [(a, b) for a, b in spans.spans if lines & set(range(a, b + 1))]
            graded[group] = bool(hit)
            why[group] = (f"executes the edited lines {', '.join(f'{a}-{b}' for a, b in hit)}" if hit else
                          f"imports {file} but never executes lines "
                          f"{', '.join(f'{a}-{b}' for a, b in spans.spans)}")
    for group, needs in (depends or {}).items():
        hit = [g for g in needs if graded.get(g, True)]  # a group outside the run: assume it changes
        if group in graded and not graded[group] and hit:
            graded[group], why[group] = True, f"consumes what {', '.join(hit)} produces, which is graded"
    return Impact(graded, why)
