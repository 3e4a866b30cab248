"""The package's import direction: serve/compat -> fronts -> process -> engine -> runner -> state ->
attention/cache/models/lora/memory/weights -> layers/device/parsers/chat and the top-level value
modules. No import cycles, no imports of another module's underscore names, `rollout` never imports
`integrations`, code outside rollout/engine reaches no private component of an Engine (its weight
manager, memory manager, pools, scheduler, runner, pipeline: it uses Engine's public methods and
properties), and the checker catches a planted wrong-way import, cycle, private name and component
read (docs/architecture.md)."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rollout", "integrations")

# a module may import modules of its own rank or lower (the top-level value modules are rank 0)
RANKS = {
    "layers": 0,
    "device": 0,
    "parsers": 0,  # text in, text out: tool-call and reasoning parsers
    "chat": 0,  # chat requests with tools (the parsers, sampling): used by fronts/ and serve/
    "attention": 1,
    "cache": 1,
    "models": 1,
    "lora": 1,
    "memory": 1,
    "weights": 1,
    "state": 2,
    "runner": 3,
    "engine": 4,
    "process": 5,
    "fronts": 6,
    "serve": 7,
    "compat": 7,
}
TOP = 0  # config, api, sampling, outputs, distributed
FACADES = {"rollout", "rollout.__main__"}  # the package's own names and the demo: import anything
INTEGRATIONS = 9
# an Engine's components, its own business: outside rollout/engine only its public API is used
ENGINE_COMPONENTS = frozenset(
    {
        "weights",
        "memory",
        "kv",
        "state",
        "routes",
        "pages",
        "scheduler",
        "runner",
        "pipeline",
        "request_maker",
    }
)
# same rank, still not to be imported: the two outer fronts stay apart
FORBIDDEN = {("serve", "compat"), ("compat", "serve")}


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages under `root`."""
    out = {}
    for pkg in PACKAGES:
        for f in sorted((root / pkg).rglob("*.py")):
            parts = list(f.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = f
    return out


@functools.cache
def parse(text: str) -> ast.Module:
    return ast.parse(text)


def imports(root: Path, planted: dict[str, str]) -> tuple[dict[str, set[str]], list[str]]:
    """Every module's imports of the packages' modules (also lazy and TYPE_CHECKING ones), and the
    imports of underscore names from another module. `planted`: lines added to modules' text."""
    mods = modules(root)
    edges: dict[str, set[str]] = {m: set() for m in mods}
    private = []
    for name, f in mods.items():
        tree = parse(f.read_text() + planted.get(name, ""))
        aliases: dict[str, str] = {}  # local name -> imported module of ours
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    target = full if full in mods else node.module
                    if target in mods:
                        edges[name].add(target)
                        if full in mods:
                            aliases[a.asname or a.name] = full
                    if a.name.startswith("_") and not a.name.startswith("__") and target != name:
                        private.append(f"{name} imports {node.module}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in mods:
                        edges[name].add(a.name)
                        if a.asname:
                            aliases[a.asname] = a.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                target = aliases.get(node.value.id)
                if target and node.attr.startswith("_") and not node.attr.startswith("__"):
                    private.append(f"{name} reads {target}.{node.attr}")
        if not name.startswith("rollout.engine"):
            private += [f"{name} reads {r}" for r in component_reads(tree)]
        edges[name].discard(name)
    return edges, private


def component_reads(tree: ast.Module) -> list[str]:
    """`engine.weights`, `self.engine.kv`, ...: a component read off a value named like an engine."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ENGINE_COMPONENTS:
            owner = node.value
            owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
            if "engine" in owner_name.lower():
                found.append(f"{owner_name}.{node.attr} (line {node.lineno})")
    return found


def rank(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "integrations":
        return INTEGRATIONS
    if module in FACADES:
        return None
    if len(parts) == 2 and parts[1] not in RANKS:
        return TOP  # a top-level module of rollout
    return RANKS[parts[1]]


def folder(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def wrong_way(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        for dst in targets:
            if src in FACADES:
                continue
            rs, rd = rank(src), rank(dst)
            if rd is None:  # the facade imports everything: only integrations may use it
                if rs != INTEGRATIONS:
                    bad.append(f"{src} -> {dst} (the package facade)")
                continue
            if rd > rs or (folder(src), folder(dst)) in FORBIDDEN:
                bad.append(f"{src} -> {dst}")
    return sorted(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    found = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def problems(root: Path = ROOT, planted: dict[str, str] | None = None) -> list[str]:
    edges, private = imports(root, planted or {})
    return wrong_way(edges) + [f"cycle: {' <-> '.join(c)}" for c in cycles(edges)] + private


def test_the_tree_imports_downward_without_cycles_or_private_names():
    assert problems() == []


def test_every_folder_says_its_purpose_and_imports():
    tops = sorted(p.name for p in (ROOT / "rollout").glob("*.py"))
    assert len(tops) <= 8, tops
    for init in sorted((ROOT / "rollout").glob("*/__init__.py")):
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and "May import" in doc, f"{init.relative_to(ROOT)}: its purpose and what it may import"
    assert set(RANKS) == {p.parent.name for p in (ROOT / "rollout").glob("*/__init__.py")}


@pytest.mark.parametrize(
    ("module", "line", "found"),
    [
        ("rollout.runner.batch", "from rollout.engine.scheduler import Scheduler", "-> rollout.engine"),
        ("rollout.layers.rotary", "from rollout.models.config import ModelConfig", "-> rollout.models"),
        ("rollout.engine.stop", "import rollout.fronts.stream_deltas", "-> rollout.fronts"),
        ("rollout.process.wire", "from rollout.fronts import async_front", "-> rollout.fronts"),
        ("rollout.serve.protocol", "from rollout.compat import vllm", "-> rollout.compat"),
        ("rollout.weights.bucket", "from integrations import sync_weights", "-> integrations"),
        ("rollout.weights.bucket", "from rollout.weights.plan import PlanCache", "cycle: "),
        ("rollout.engine.stop", "from rollout.engine.detok import _ANY", "imports rollout.engine.detok._ANY"),
        ("rollout.engine.stop", "from rollout.engine import detok\nx = detok._y", "reads rollout.engine"),
        ("integrations.weight_sync", "order = engine.weights.storage_order()", "reads engine.weights"),
        ("rollout.process.child", "n = self.engine.kv.num_pages", "reads engine.kv"),
    ],
)
def test_a_planted_import_is_caught(module: str, line: str, found: str):
    found_now = problems(ROOT, {module: f"\n{line}\n"})
    assert any(found in p for p in found_now), found_now
