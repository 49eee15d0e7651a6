"""The import graph of rankboard's packages: no cycle, and each layer imports only below it.

The layers, bottom up: ``rank_agent`` (inside training processes: it must never pull in the
broker or the web), ``broker``, ``web``, ``rankboard`` (the command line, which runs both).
Every ``import`` counts, at module level or inside a function (a lazy import is still a
dependency: it only moves the moment it fails), so a circle cannot hide behind laziness as
``broker/cli -> web/cli -> broker/cli`` once did. The graph is read from the source with
:mod:`ast`, nothing is imported. The checker itself is tested on small synthetic trees,
including one with a cycle, so that the real tree passing means something.
"""
from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterable, Mapping

import pytest

ROOT = Path(__file__).resolve().parent.parent
#: bottom to top: a package may import its own layer and those before it
LAYERS = ("rank_agent", "broker", "web", "rankboard")

Graph = Mapping[str, "set[str]"]


def module_names(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """``dotted.name -> file`` of every module under ``packages`` (``pkg/__init__.py`` is
    ``pkg``)."""
    found: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _resolve(module: str, is_package: bool, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    if level == 0:
        return target or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, target] if target else base)


def imports_of(module: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that ``module`` imports anywhere in its file."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    is_package = path.name == "__init__.py"
    wanted: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(module, is_package, node.level, node.module)
            # ``from pkg import sub`` depends on the module pkg.sub when there is one (as
            # import-linter counts it), on pkg itself for any other name
            subs = [f"{base}.{alias.name}" for alias in node.names]
            names = [sub for sub in subs if sub in known]
            if len(names) < len(subs):
                names.append(base)
        else:
            continue
        for name in names:
            # ``import a.b.c`` depends on a.b.c: the nearest known module at or above it
            parts = name.split(".")
            while parts and ".".join(parts) not in known:
                parts.pop()
            if parts:
                wanted.add(".".join(parts))
    wanted.discard(module)
    return wanted


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    modules = module_names(root, packages)
    known = set(modules)
    return {name: imports_of(name, path, known) for name, path in modules.items()}


def find_cycle(graph: Graph) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None: an iterative depth-first search."""
    WHITE, GREY, BLACK = 0, 1, 2
    colour = {node: WHITE for node in graph}
    for start in sorted(graph):
        if colour[start] != WHITE:
            continue
        path = [start]
        stack = [iter(sorted(graph[start]))]
        colour[start] = GREY
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                colour[path.pop()] = BLACK
                stack.pop()
                continue
            if nxt not in colour:
                continue
            if colour[nxt] == GREY:
                return [*path[path.index(nxt):], nxt]
            if colour[nxt] == WHITE:
                colour[nxt] = GREY
                path.append(nxt)
                stack.append(iter(sorted(graph.get(nxt, ()))))
    return None


def layer_violations(graph: Graph, layers: tuple[str, ...] = LAYERS) -> list[str]:
    """``a imports b`` for every import of a layer above the importer's."""
    rank = {name: i for i, name in enumerate(layers)}
    bad = []
    for module, targets in sorted(graph.items()):
        mine = rank[module.split(".")[0]]
        for target in sorted(targets):
            if rank[target.split(".")[0]] > mine:
                bad.append(f"{module} imports {target}")
    return bad


# ------------------------------------------------------------------- the real tree
def test_the_tree_has_no_import_cycle() -> None:
    graph = import_graph(ROOT, LAYERS)
    assert len(graph) > 30 and "rankboard.cli" in graph  # it read the tree
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph) or [])


def test_each_layer_imports_only_the_layers_below() -> None:
    assert layer_violations(import_graph(ROOT, LAYERS)) == []


def test_the_graph_sees_lazy_imports_of_the_real_tree() -> None:
    """The command line's lazy import of the web commands is an edge like any other."""
    graph = import_graph(ROOT, LAYERS)
    assert "rankboard.up" in graph["rankboard.cli"]
    assert "web.serve" in graph["web.workers"]


# ---------------------------------------------------------------- the checker itself
def test_find_cycle_on_small_graphs() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None  # a diamond
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"b", "c"}, "c": set()}) == ["b", "b"]
    assert find_cycle({"x": set(), "a": {"b"}, "b": {"d"}, "d": {"b"}}) == ["b", "d", "b"]


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")


def test_a_lazy_import_cycle_between_layers_is_caught(tmp_path: Path) -> None:
    """The shape this test exists for: a low layer's function importing a high one that
    imports it back (``from . import`` and ``import a.b`` forms alike)."""
    _write(tmp_path, {
        "rank_agent/__init__.py": "",
        "broker/__init__.py": "",
        "broker/cli.py": "def run():\n    from web import cli\n    return cli\n",
        "broker/server.py": "from .cli import run\n",
        "web/__init__.py": "",
        "web/cli.py": "import broker.cli\n",
        "rankboard/__init__.py": "",
    })
    graph = import_graph(tmp_path, LAYERS)
    assert graph["broker.cli"] == {"web.cli"}
    assert graph["broker.server"] == {"broker.cli"}
    assert graph["web.cli"] == {"broker.cli"}
    assert find_cycle(graph) == ["broker.cli", "web.cli", "broker.cli"]
    assert layer_violations(graph) == ["broker.cli imports web.cli"]


def test_a_clean_synthetic_tree_passes(tmp_path: Path) -> None:
    _write(tmp_path, {
        "rank_agent/__init__.py": "from rank_agent.agent import Agent\n",
        "rank_agent/agent.py": "import os\n",
        "broker/__init__.py": "",
        "broker/server.py": "from rank_agent import agent\n",
        "web/__init__.py": "",
        "web/serve.py": "from broker.server import x\nfrom . import config\n",
        "web/config.py": "",
        "rankboard/__init__.py": "",
        "rankboard/cli.py": "def main():\n    from web import serve\n",
    })
    graph = import_graph(tmp_path, LAYERS)
    assert graph["broker.server"] == {"rank_agent.agent"}
    assert graph["web.serve"] == {"broker.server", "web.config"}
    assert graph["rankboard.cli"] == {"web.serve"}
    assert find_cycle(graph) is None and layer_violations(graph) == []


@pytest.mark.parametrize("importer, imported", [
    ("rank_agent/agent.py", "broker.server"),
    ("rank_agent/agent.py", "rankboard.cli"),
    ("broker/server.py", "web.serve"),
    ("web/serve.py", "rankboard.cli"),
])
def test_an_upward_import_is_a_violation(tmp_path: Path, importer: str,
                                         imported: str) -> None:
    _write(tmp_path, {
        "rank_agent/__init__.py": "", "rank_agent/agent.py": "",
        "broker/__init__.py": "", "broker/server.py": "",
        "web/__init__.py": "", "web/serve.py": "",
        "rankboard/__init__.py": "", "rankboard/cli.py": "",
    })
    (tmp_path / importer).write_text(f"def late():\n    import {imported}\n", encoding="utf-8")
    module = importer[:-3].replace("/", ".")
    assert layer_violations(import_graph(tmp_path, LAYERS)) == [f"{module} imports {imported}"]


# ------------------------------------------------------- the broker's family folders
#: the broker's families (issue 27): each a folder, reached from the rest of the broker
#: through the modules named here, and never the other way round
FAMILIES = ("broker.journal", "broker.run.steps", "broker.stacks")
#: what the web may import from the broker: the feed codec and the pure shared stores (and
#: the step-run ETA over a store, which the web recomputes as it does steps_done: 8.5; and
#: the one-request-a-run-a-second rule both apply, issue 44)
WEB_MAY_IMPORT = {"broker.feed", "broker.run.steps.store", "broker.run.steps.encodings",
                  "broker.stacks.groups", "broker.stacks.store", "broker.run.steps.eta",
                  "broker.stacks.gate",
                  "broker.run.steps.line"}  # (8.1: the line and superseded records)


def test_the_broker_families_are_folders_not_prefixes() -> None:
    flat = sorted(p.name for p in (ROOT / "broker").glob("*.py")
                  if p.name.startswith(("journal", "step", "stack")))
    assert flat == [], f"family modules outside their folder: {flat}"
    for family in FAMILIES:
        assert (ROOT / family.replace(".", "/") / "__init__.py").is_file(), family


def test_steps_and_stacks_never_import_the_journal_or_the_sink() -> None:
    """The journal stores what the sink was fed; steps and stacks are below both."""
    graph = import_graph(ROOT, LAYERS)
    bad = [f"{m} imports {t}" for m, targets in sorted(graph.items())
           if m.startswith(("broker.run.steps", "broker.stacks"))
           for t in sorted(targets)
           if t.startswith("broker.journal") or t in ("broker.run.sink", "broker.runs",
                                                       "broker.server")]
    assert bad == []


def test_the_web_imports_only_the_brokers_shared_modules() -> None:
    graph = import_graph(ROOT, LAYERS)
    used = {t for m, targets in graph.items() if m.startswith("web")
            for t in targets if t.startswith("broker")}
    assert used and used <= WEB_MAY_IMPORT, sorted(used - WEB_MAY_IMPORT)


# ------------------------------------------------------------ one run's pure state
#: the I/O around a run's state (issue 44): the run's folder imports none of it
RUN_MAY_NOT_IMPORT = ("broker.server", "broker.ingest", "broker.router", "broker.runs",
                      "broker.journal", "broker.webhooks", "broker.retention",
                      "broker.snapshots")
#: modules of the standard library and beyond that mean sockets, clocks, files or threads
RUN_MAY_NOT_USE = ("zmq", "socket", "select", "time", "os", "pathlib", "io", "shutil",
                   "tempfile", "threading", "urllib", "http", "gevent", "flask", "psutil")


def _top_names(path: Path) -> set[str]:
    """The first component of every absolute import in ``path``."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def test_the_run_folder_imports_no_io() -> None:
    """broker/run/README.md: no sockets, no clock, no files, nothing of the server's side."""
    graph = import_graph(ROOT, LAYERS)
    run = [m for m in graph if m == "broker.run" or m.startswith("broker.run.")]
    assert "broker.run.sink" in run and "broker.run.steps.closer" in run
    bad = [f"{m} imports {t}" for m in sorted(run) for t in sorted(graph[m])
           if t.startswith(RUN_MAY_NOT_IMPORT)]
    assert bad == []
    used = {f"{p.relative_to(ROOT)} imports {name}"
            for p in (ROOT / "broker" / "run").rglob("*.py")
            for name in _top_names(p) if name in RUN_MAY_NOT_USE}
    assert used == set()


def package_graph(graph: Graph, prefix: str = "broker") -> dict[str, set[str]]:
    """The graph of ``prefix``'s sub-packages (``broker.run.steps.closer`` counts as
    ``broker.run``, a top-level module as itself), without self-edges."""
    def room(name: str) -> str:
        return ".".join(name.split(".")[:2])
    rooms: dict[str, set[str]] = {}
    for module, targets in graph.items():
        if module.startswith(prefix + "."):
            edges = rooms.setdefault(room(module), set())
            edges.update(room(t) for t in targets
                         if t.startswith(prefix + ".") and room(t) != room(module))
    return rooms


def test_package_graph_sees_a_cycle_between_folders() -> None:
    graph = {"broker.run.sink": {"broker.stacks.feed"}, "broker.stacks.feed": {"broker.x"},
             "broker.x": {"broker.run.events"}, "broker.run.events": set()}
    assert find_cycle(package_graph(graph)) == ["broker.run", "broker.stacks", "broker.x",
                                                "broker.run"]


def test_the_brokers_rooms_have_no_cycle() -> None:
    """Folders as units: no module cycle hides as two folders importing each other."""
    rooms = package_graph(import_graph(ROOT, LAYERS))
    assert "broker.run" in rooms and "broker.stacks" in rooms
    assert find_cycle(rooms) is None, " -> ".join(find_cycle(rooms) or [])


def test_the_brokers_top_reads_as_the_pipeline() -> None:
    """At most 16 rooms at broker/'s top (modules and folders, ``__init__`` aside)."""
    broker = ROOT / "broker"
    rooms = [p.name for p in broker.iterdir()
             if (p.suffix == ".py" and p.name != "__init__.py")
             or (p.is_dir() and (p / "__init__.py").is_file())]
    assert len(rooms) <= 16, sorted(rooms)


def test_no_class_declares_attributes_for_the_type_checker() -> None:
    """No ``if TYPE_CHECKING:`` inside a class (a mixin re-declaring another class's
    fields, issue 44): state lives in the object whose rules use it."""
    bad = []
    for path in sorted((ROOT / "broker").rglob("*.py")):
        for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(cls, ast.ClassDef):
                bad += [f"{path.relative_to(ROOT)}:{node.lineno} {cls.name}"
                        for node in cls.body if isinstance(node, ast.If)
                        and "TYPE_CHECKING" in ast.unparse(node.test)]
    assert bad == []


def test_a_file_past_800_lines_says_why_it_is_one_idea() -> None:
    """One idea per file, not a line count (issue 44 item 3): a module past 800 lines says
    in its docstring why it is one idea."""
    long = []
    for package in LAYERS:
        for path in sorted((ROOT / package).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            if text.count("\n") > 800:
                doc = ast.get_docstring(ast.parse(text)) or ""
                if "one idea" not in doc:
                    long.append(str(path.relative_to(ROOT)))
    assert long == []


def test_design_names_every_package_module() -> None:
    """docs/DESIGN.md's module tree names only what exists, and every module's file."""
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    missing = sorted(str(path.relative_to(ROOT)) for path in module_names(ROOT, LAYERS).values()
                     if path.name != "__init__.py" and path.name not in design)
    assert missing == []
