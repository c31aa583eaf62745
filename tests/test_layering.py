"""The package's imports run one way: serve -> decode -> drafters -> heads -> model -> ops (train
beside decode, reading decode's text helpers and driving its Engine to answer prompts); the top-level modules (cli, benchmark,
__init__) may use anything. No import cycles between modules, deferred imports included."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "turbospec")
RANK = {"ops": 0, "model": 1, "heads": 2, "drafters": 3, "decode": 4, "train": 4, "serve": 5}
# prompts -> ids and EOS ids, as generation does; --gen-engine batched answers through the Engine (the
# batched scheduler and its Request): train only drives decode, as serve does, never the reverse
ALLOWED_UP = {("train", "turbospec.decode.text"), ("train", "turbospec.decode.engine"),
              ("train", "turbospec.decode.batch")}


def modules() -> dict[str, str]:
    out = {}
    for d, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                out[rel[: -len(".__init__")] if rel.endswith(".__init__") else rel] = path
    return out


def imports(name: str, path: str, known: set[str]) -> set[str]:
    """turbospec modules that ``name`` imports (module level or inside functions)."""
    is_pkg = path.endswith("__init__.py")
    package = name if is_pkg else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("turbospec")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if not mod.startswith("turbospec"):
                continue
            for a in node.names:  # "from pkg import module" imports the module
                sub = f"{mod}.{a.name}"
                if a.name != "_C":  # the compiled extension sits below everything
                    found.add(sub if sub in known else mod)
    return {m for m in found if m in known and m != name}


def layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in RANK else None


GRAPH = None


def graph() -> dict[str, set[str]]:
    global GRAPH
    if GRAPH is None:
        mods = modules()
        GRAPH = {m: imports(m, p, set(mods)) for m, p in mods.items()}
    return GRAPH


def test_the_packages_exist():
    g = graph()
    for pkg in ("ops", "model", "heads", "drafters", "decode", "train"):
        assert f"turbospec.{pkg}" in g, f"turbospec/{pkg}/ is missing"
    assert len(g) > 30


def test_imports_point_down():
    bad = []
    for mod, deps in graph().items():
        src = layer(mod)
        if src is None:
            continue  # top level: cli, benchmark, __init__
        for dep in deps:
            dst = layer(dep)
            if dep.startswith("turbospec._C") or dst == src:
                continue
            if dst is None or RANK[dst] >= RANK[src]:
                if (src, dep) not in ALLOWED_UP:
                    bad.append(f"{mod} imports {dep}")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    g = graph()
    state: dict[str, int] = {}
    cycles = []

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for d in sorted(g[m]):
            if d == m or (m.startswith(d + ".") and d in g):  # a module's own package __init__
                continue
            if state.get(d) == 1:
                cycles.append(" -> ".join(stack[stack.index(d):] + [d]) if d in stack else f"{m} -> {d}")
            elif d not in state:
                visit(d, stack + [d])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


@pytest.mark.parametrize("bad", ["turbospec.decode.engine"])
def test_the_check_catches_an_upward_import(bad, tmp_path):
    """The checker itself: a model file importing decode is reported."""
    f = tmp_path / "x.py"
    f.write_text(f"from {bad} import Engine\n")
    deps = imports("turbospec.model.x", str(f), set(graph()) | {"turbospec.model.x"})
    assert bad in deps and RANK[layer(bad)] > RANK[layer("turbospec.model.x")]
