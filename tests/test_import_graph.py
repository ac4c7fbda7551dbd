"""The project's import graph (issue 29): no module imports another that imports it back, directly or round a longer
circle, function-level imports included."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package ``hybridtron``
SKIP = {"tests", ".venv", "build", "docs"}


def _module_name(path: Path) -> str:
    parts = ["hybridtron", *path.relative_to(ROOT).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules() -> dict[str, Path]:
    out = {}
    for p in ROOT.rglob("*.py"):
        rel = p.relative_to(ROOT).parts
        if rel[0] in SKIP or rel[0].startswith(".") or any(part.startswith(".") for part in rel):
            continue
        out[_module_name(p)] = p
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str | None:
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (anywhere in the file). ``from pkg import x`` counts as importing
    ``pkg.x`` when that is a module, else ``pkg``; a package's ``__init__`` is a module like any other."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg
                    for _ in range(node.level - 1):
                        base = base.rpartition(".")[0]
                    base = f"{base}.{node.module}" if node.module else base
                else:
                    base = node.module or ""
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            else:
                continue
            for t in targets:
                if t.startswith("hybridtron") and (m := _resolve(t, modules)) is not None and m != name:
                    deps.add(m)
        graph[name] = deps
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
    return out


def test_the_circle_finder_finds_a_planted_circle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(g) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_one_that_imports_it_back():
    found = circles(import_graph())
    assert not found, "import circles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_command_line_sits_above_train_and_slurm():
    """hybridtron/cli.py imports train/ and slurm/; neither imports it, and train/ imports nothing of slurm/ (the
    launcher builds on the trainer, not the other way round)."""
    graph = import_graph()
    up = {m: sorted(d for d in deps if d == "hybridtron.cli" or (m.startswith("hybridtron.train") and
                                                                 d.startswith("hybridtron.slurm")))
          for m, deps in graph.items() if m.startswith(("hybridtron.train", "hybridtron.slurm"))}
    assert not any(up.values()), {m: d for m, d in up.items() if d}
    assert {"hybridtron.train.recipe", "hybridtron.slurm.submit"} <= graph["hybridtron.cli"]


def test_configs_import_nothing_above_them():
    """configs/ is the ground floor (issue 29.5): its modules import only each other; the rules that need the
    kernels or the world size are train/parallel/layout.py's."""
    graph = import_graph()
    above = {m: sorted(d for d in deps if not d.startswith("hybridtron.configs"))
             for m, deps in graph.items() if m.startswith("hybridtron.configs")}
    assert "hybridtron.configs.job" in above and not any(above.values()), {m: d for m, d in above.items() if d}


def _imports_torch(module: str) -> bool:
    path = _modules()[module]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        if any(n == "torch" or n.startswith("torch.") for n in names):
            return True
    return False


def test_the_layout_rules_and_kernel_limits_need_no_torch():
    """The layout is arithmetic on the config (issue 29.5): neither it nor the kernels' size limits import torch,
    and the backend rules it asks (kernels/rules.py) import it only inside the one function that asks torch whether a
    GPU is visible (issue 39: the command line checks a config without torch). tests/test_cli_import_cost.py runs
    the commands and looks at sys.modules; this is the same rule read from the source."""
    assert not _imports_torch("hybridtron.train.parallel.layout")
    assert not _imports_torch("hybridtron.kernels.limits")
    assert _imports_torch("hybridtron.kernels.backend")  # the checker sees an import where there is one
    rules = _modules()["hybridtron.kernels.rules"]
    tree = ast.parse(rules.read_text())
    top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
    top += [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom) and not n.level]
    assert not any(m == "torch" or m.startswith("torch.") for m in top), top
    graph = import_graph()
    assert graph["hybridtron.kernels.limits"] == set()
    assert graph["hybridtron.kernels.rules"] == {"hybridtron.kernels.limits"}
    assert graph["hybridtron.kernels"] == set()  # the package imports nothing: kernels/__init__.py
    assert graph["hybridtron.train.parallel.layout"] == {"hybridtron.configs", "hybridtron.kernels.rules"}


def test_every_package_is_installed():
    """pyproject.toml lists the packages a non-editable install (a wheel for a cluster) carries: every directory
    with an __init__.py is one (hybridtron.train.plan and hybridtron.kernels.moe_gemm were missing: `hybridtron plan`
    and the MoE kernels were absent from a wheel)."""
    import re

    line = next(ln for ln in (ROOT / "pyproject.toml").read_text().splitlines() if ln.startswith("packages = ["))
    listed = set(re.findall(r'"([\w.]+)"', line))  # (tomllib is Python 3.11's; the project runs on 3.10)
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    assert packages - listed == set(), sorted(packages - listed)
