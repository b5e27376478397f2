"""The package's shape: every import of every module, read from the source. No cycles; no layer
imports a layer above it (ray_job.LAYERS, lowest first); modules stay small; every package says in
one line what it owns; private Ray APIs are imported in one module only."""

from __future__ import annotations

import ast
import os
from collections import defaultdict


import ray_job
from conftest import ROOT



PACKAGE = os.path.join(ROOT, "ray_job")
MAX_LINES = 350


def modules() -> dict[str, str]:
    """Module name -> file, for every module of the package."""
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].replace(os.sep, ".")
                out[rel.removesuffix(".__init__")] = os.path.join(folder, f)
    return out


def imports(name: str, path: str) -> set[str]:
    """The ray_job modules (and ray modules) that a module imports, at any depth of its code."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    known = modules()
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            for a in node.names:  # `from pkg import module` imports that module; else names of pkg
                found.add(f"{module}.{a.name}" if f"{module}.{a.name}" in known else module)
                if module.split(".")[0] == "ray":
                    found.add(f"{module}.{a.name}")
    return {m for m in found if m in known and m != name} | {m for m in found if m.split(".")[0] == "ray"}


def layer(module: str) -> int:
    parts = module.split(".")
    return ray_job.LAYERS.index(parts[1]) if len(parts) > 1 and parts[1] in ray_job.LAYERS else -1


def graph() -> dict[str, set[str]]:
    return {name: {m for m in imports(name, path) if m.startswith("ray_job")} for name, path in modules().items()}


def test_every_package_is_a_layer_and_says_what_it_owns():
    top = {n.split(".")[1] for n in modules() if n.count(".") >= 1}
    assert top - {"__main__"} == set(ray_job.LAYERS)
    for name, path in modules().items():
        if path.endswith("__init__.py"):
            doc = ast.get_docstring(ast.parse(open(path).read()))
            assert doc and doc.strip(), f"{name} has no docstring saying what it owns"


def test_no_layer_imports_a_layer_above_it():
    upward = [(a, b) for a, deps in graph().items() for b in deps
              if layer(a) >= 0 and layer(b) > layer(a)]
    assert not upward, "\n".join(f"{a} imports {b}" for a, b in sorted(upward))


def test_no_import_cycles():
    g = graph()
    # a package's __init__ importing its own modules is not a cycle of the code
    edges = {a: {b for b in deps if not (b.startswith(a + ".") and modules()[a].endswith("__init__.py"))}
             for a, deps in g.items()}
    state, stack, cycles = defaultdict(int), [], []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state[nxt] == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif state[nxt] == 0:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(edges):
        if state[node] == 0:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_private_ray_apis_go_through_one_module():
    private = ("._", "_private", "_internal", "_raylet")
    users = {name: sorted(m for m in imports(name, path) if m.split(".")[0] == "ray" and any(p in m for p in private))
             for name, path in modules().items()}
    assert {n for n, ms in users.items() if ms} <= {"ray_job.cluster.raypriv"}, users
    for path in modules().values():  # nor as strings handed to importlib elsewhere
        if not path.endswith("raypriv.py"):
            text = open(path).read()
            assert "ray.train.v2._internal" not in text and "ray._raylet" not in text, path


def test_modules_stay_small():
    big = {name: n for name, path in modules().items() if (n := len(open(path).readlines())) > MAX_LINES}
    assert not big, big
