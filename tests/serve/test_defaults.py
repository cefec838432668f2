"""Every serve default has one home, `Settings`' field: doel-serve's flags take theirs from it,
and no function in serve/ writes a second literal of it under the same parameter name (it is
required there, or defaults to the field). Read from the parser and from the source (ast)."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

from doel.serve.cli import build_parser
from doel.serve.settings import Settings

SERVE = Path(__file__).resolve().parents[2] / "serve"
DEFAULTS = {
    f.name: f.default for f in dataclasses.fields(Settings) if f.default is not dataclasses.MISSING
}


def _literal(node: ast.expr | None):
    """The value of a literal default (`16`, `1 << 20`, `"x"`), or None for anything else."""
    if node is None:
        return None
    try:
        return ast.literal_eval(node)
    except ValueError:
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.LShift):
            left, right = _literal(node.left), _literal(node.right)
            return left << right if isinstance(left, int) and isinstance(right, int) else None
        return None


def _signature_defaults(tree: ast.AST):
    """(line, parameter, its default's node) for every function of a module."""
    for fn in ast.walk(tree):
        if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            args = fn.args
            positional = [*args.posonlyargs, *args.args]
            pairs = zip(positional[len(positional) - len(args.defaults) :], args.defaults)
            pairs = [*pairs, *zip(args.kwonlyargs, args.kw_defaults)]
            yield from ((fn.lineno, a.arg, d) for a, d in pairs if d is not None)


def test_the_parsers_defaults_are_the_settings_fields():
    parser = build_parser()
    shared = {a.dest: a.default for a in parser._actions if a.dest in DEFAULTS}
    assert {"threads", "slots", "max_queue", "max_body_bytes", "max_headers"} <= set(shared)
    assert shared == {name: DEFAULTS[name] for name in shared}


def test_no_serve_default_is_written_twice():
    """A literal equal to a Settings default, under that field's name, in a signature or as an
    `add_argument(default=)` of its flag, is a second home of it."""
    twice = []
    for path in sorted(SERVE.rglob("*.py")):
        if path.name == "settings.py":
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for line, name, node in _signature_defaults(tree):
            value = _literal(node)
            if name in DEFAULTS and value is not None and value == DEFAULTS[name]:
                twice.append(f"{path.name}:{line} {name}={value!r}")
        for call in ast.walk(tree):
            if not (
                isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument"
            ):
                continue
            flags = [a.value for a in call.args if isinstance(a, ast.Constant)]
            dest = next((f.lstrip("-").replace("-", "_") for f in flags), "")
            given = {k.arg: k.value for k in call.keywords}
            if dest in DEFAULTS and _literal(given.get("default")) is not None:
                twice.append(
                    f"{path.name}:{call.lineno} --{dest} default={_literal(given['default'])!r}"
                )
    assert not twice, "defaults written again outside Settings: " + ", ".join(twice)
