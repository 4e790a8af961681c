"""raytrainer's modules form layers: no import circle, and no import from a lower layer up into a higher one
except the one docs/architecture.md names, with its reason. Lazy (function-level) imports count too."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2] / "raytrainer"

#: lowest first; a module's layer is that of its top-level name under raytrainer/
LAYERS = (
    ("foundation", {"protocol", "deps", "failures", "rank_context", "saving", "logging_utils", "storage",
                    "dcp_storage", "storage_check", "trainer_utils", "callbacks", "callback_scan",
                    "meta_model", "plot", "import_scratch"}),
    ("arguments", {"arg_types", "args", "accelerate_config", "hf_argparser", "hosted_recipe", "elastic",
                   "parallelism"}),
    ("engine", {"strategies", "checkpoint", "data", "optim", "final_weights", "consolidate",
                "integrations", "hosted_callbacks"}),
    ("worker", {"worker"}),
    ("driver", {"driver", "hub"}),
    ("search", {"search"}),
    ("api", {"seq2seq", "cli", "__main__", "__init__", "hosted", "trl", "one_loop",
             "in_process"}),
)

#: the imports that run back up the layers, each with its reason (docs/architecture.md repeats them)
UPWARD = {
    ("raytrainer.arg_types", "raytrainer.strategies.deepspeed_config"):
        "the arguments' DeepSpeed check fills the config exactly as the engine will (one source of truth)",
    ("raytrainer.hosted_recipe", "raytrainer.strategies.deepspeed_config"):
        "the ranks' arguments get the DeepSpeed config's missing precision sections (that module's job)",
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def _graph() -> dict[str, set[str]]:
    mods = _modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:  # raytrainer.x.y (a class) -> raytrainer.x
                    target = target.rpartition(".")[0]
                if target and target != name and target != "raytrainer":
                    graph[name].add(target)
    return graph


def _layer(module: str) -> int:
    head = module.split(".")[1] if "." in module else "__init__"
    for index, (_, names) in enumerate(LAYERS):
        if head in names:
            return index
    raise AssertionError(f"{module} is in no layer: add it to LAYERS")


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, found, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_circles():
    assert _cycles(_graph()) == []


def test_only_the_documented_import_runs_up_the_layers():
    graph = _graph()
    upward = {(a, b) for a in graph for b in graph[a] if _layer(b) > _layer(a)}
    assert upward == set(UPWARD)
    docs = (ROOT.parent / "docs" / "architecture.md").read_text()
    for (a, b), _ in UPWARD.items():
        assert f"`{a.removeprefix('raytrainer.')}` -> `{b.removeprefix('raytrainer.')}`" in docs


def test_the_checker_sees_a_circle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
