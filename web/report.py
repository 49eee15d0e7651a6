"""A finished run as one self-contained HTML file (PROTOCOL 4 ``report.html``, 6 ``export``).

The file is the dashboard page itself, fed from JSON embedded in it instead of the live
stream: the same markup (``<main>`` of ``templates/index.html``), the same stylesheet and the
same ES modules of ``web/static`` (store, views, chart kit), read at build time and inlined.
Nothing is a second copy: editing a view or a chart changes the dashboard and every report
made after it.

**How the modules are inlined** (:func:`bundle`). Browsers cannot ``import`` an inline
module by name; an import map of ``data:`` URLs could, but only with ``script-src data:``,
which would let any injected ``<script src="data:...">`` run and so defeat the CSP. Instead
the modules are linked here into one script, the way a bundler does it without rewriting
code: each module becomes a function scope evaluated once, in dependency order, whose
``export``ed declarations are returned as a frozen namespace object, and each ``import {a,
b as c} from "./m.js"`` becomes ``const {a, b: c} = <m's namespace>``. The rewrite is
mechanical and strict: only the forms the page uses (named imports of relative modules,
``export`` before a ``function``/``async function``/``class``/``const``/``let`` declaration)
are accepted, and anything else (a default or re-export, a dynamic ``import()``, an import
cycle) raises :class:`BundleError`, which the tests run on every module, rather than
produce a script that fails in a reader's browser. The one script runs as
``<script type="module">`` (strict, deferred), allowed by its SHA-256 in the CSP, as is the
one ``<style>``; the data is a ``<script type="application/json">`` (not executed).

**Data** (the ``rankboard-data`` element): ``{"format": 1, "run", "snapshot": <GET
/api/runs/<run>> (each epoch record's per-GPU lists packed as column tables:
:class:`Packer`), "series": {name: /steps buckets at N = 2000}, "last": {name: the bucket of
the last closed step}, "graph": data: URI or null, "stacks": <GET .../stacks> or null,
"collectives": <GET .../collectives>'s listed ``groups`` or null, "resources": <GET
.../resources> (the cluster's resources over time) or null (``rankboard export``: the journal
keeps samples, not their series), "generated_at", "version", "superseded": (8.1) [{attempt,
series: {name: buckets}, epochs: [records]}] for the latest 8 attempts with superseded
records (the line itself is "series" and the snapshot's records)}``. JSON is written by msgspec (non-finite numbers as ``null``),
then ``<``, ``>``, ``&``, U+2028 and U+2029 are escaped as ``\\uXXXX``: they can only occur
inside JSON strings, so the text means the same to ``JSON.parse`` and no metric name (say
``</script><script>``) can end the element or open a comment. Every string reaches the DOM
through ``textContent`` (``web/static/dom.js``); the model graph only as an ``<img>`` whose
source is a ``data:`` URI (an SVG as an image runs no script).

**Size and time** (bench ``report_1m_*``). The builder is a generator of chunks: the header
part, then one series at a time straight from the run's :class:`~broker.run.steps.store.StepStore`
(one ``reduceat`` pass per series, as ``/steps`` does), so a million-step run is never copied
and a served report streams while it is made.
"""
from __future__ import annotations

import base64
import configparser
import hashlib
import importlib.metadata
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Iterator

import msgspec

from broker.run.steps.store import StepStore

#: Buckets per embedded step series (PROTOCOL 4): zoom works within this resolution.
REPORT_POINTS = 2000
#: The series every run may have besides its metrics (PROTOCOL 4 ``/steps?metric=``).
BUILTIN_SERIES = ("step_ms", "samples_per_s", "tokens_per_s", "data_ms")
FORMAT = 1
#: (8.1) the report embeds the superseded series of the latest this many attempts, in about
#: this many bytes in all (the report stays within its 10 MiB)
SUPERSEDED_ATTEMPTS = 8
SUPERSEDED_BYTES = 2 * 1024 * 1024

_WEB = Path(__file__).resolve().parent
STATIC = _WEB / "static"
TEMPLATES = _WEB / "templates"
#: The report's entry module and stylesheets (the dashboard's first, then the report's own).
ENTRY = "report.js"
STYLES = ("style.css", "views.css", "report.css")

_json = msgspec.json.Encoder()
#: Characters that must not appear raw in embedded JSON (see the module docstring).
_UNSAFE = {ord("<"): "\\u003c", ord(">"): "\\u003e", ord("&"): "\\u0026",
           0x2028: "\\u2028", 0x2029: "\\u2029"}


class BundleError(ValueError):
    """A module uses a form the inliner does not handle (see :func:`bundle`)."""


# ------------------------------------------------------------------ module linking
_IMPORT = re.compile(r'^import\s*\{([^}]*)\}\s*from\s*"\./([A-Za-z0-9_.-]+\.js)"\s*;[ \t]*$',
                     re.M)
_EXPORT = re.compile(r"^export\s+((?:async\s+)?function\*?|class|const|let)\s+([A-Za-z_$][\w$]*)",
                     re.M)
_OTHER_IMPORT = re.compile(r"^\s*import\b|\bimport\s*\(", re.M)
_OTHER_EXPORT = re.compile(r"^\s*export\b", re.M)
_NAME = re.compile(r"^[A-Za-z_$][\w$]*$")


@dataclass
class _Module:
    name: str
    body: str
    imports: list[tuple[str, list[tuple[str, str]]]] = field(default_factory=list)
    exports: list[str] = field(default_factory=list)


def _parse(name: str, source: str) -> _Module:
    mod = _Module(name, source)
    def take_import(m: re.Match[str]) -> str:
        pairs = []
        for part in m.group(1).split(","):
            part = part.strip()
            if not part:
                continue
            bits = part.split()
            if len(bits) == 1 and _NAME.match(bits[0]):
                pairs.append((bits[0], bits[0]))
            elif len(bits) == 3 and bits[1] == "as" and _NAME.match(bits[0]) and _NAME.match(bits[2]):
                pairs.append((bits[0], bits[2]))
            else:
                raise BundleError(f"{name}: cannot inline the import {m.group(0)!r}")
        mod.imports.append((m.group(2), pairs))
        return ""
    body = _IMPORT.sub(take_import, source)
    # comments may say "import"; check code lines only
    code = "\n".join(ln for ln in body.splitlines() if not ln.lstrip().startswith(("//", "*", "/*")))
    if _OTHER_IMPORT.search(code):
        raise BundleError(f"{name}: an import the inliner does not handle (only "
                          "'import {{...}} from \"./x.js\";' on its own lines)")

    def take_export(m: re.Match[str]) -> str:
        mod.exports.append(m.group(2))
        return f"{m.group(1)} {m.group(2)}"
    body = _EXPORT.sub(take_export, body)
    code = "\n".join(ln for ln in body.splitlines() if not ln.lstrip().startswith(("//", "*", "/*")))
    if _OTHER_EXPORT.search(code):
        raise BundleError(f"{name}: an export the inliner does not handle (only 'export' "
                          "before a function, class, const or let declaration)")
    mod.body = body
    return mod


def bundle(entry: str = ENTRY, static: Path = STATIC) -> str:
    """The ``entry`` module and everything it imports from ``static``, linked into one
    script (see the module docstring); :class:`BundleError` for what it cannot link."""
    mods: dict[str, _Module] = {}
    order: list[str] = []
    visiting: set[str] = set()

    def visit(name: str, chain: tuple[str, ...]) -> None:
        if name in mods:
            return
        if name in visiting:
            raise BundleError("import cycle: " + " -> ".join((*chain, name)))
        path = static / name
        if not path.is_file():
            raise BundleError(f"{chain[-1] if chain else 'entry'}: no module {name}")
        visiting.add(name)
        mod = _parse(name, path.read_text(encoding="utf-8"))
        for dep, _ in mod.imports:
            visit(dep, (*chain, name))
        visiting.discard(name)
        mods[name] = mod
        order.append(name)

    visit(entry, ())
    for name in order:
        low = mods[name].body.lower()
        if "</script" in low or "<!--" in low:
            raise BundleError(f"{name}: holds '</script' or '<!--', which would end or "
                              "confuse the inline script")
    ident = {name: f"__rb{i}" for i, name in enumerate(order)}
    out = [f"// rankboard report: {len(order)} modules of web/static, linked by web/report.py\n"]
    for name in order:
        mod = mods[name]
        lines = [f"// ---- {name}\nconst {ident[name]} = (() => {{\n"]
        for dep, pairs in mod.imports:
            missing = [a for a, _ in pairs if a not in mods[dep].exports]
            if missing:
                raise BundleError(f"{name}: {dep} does not export {', '.join(missing)}")
            binds = ", ".join(a if a == b else f"{a}: {b}" for a, b in pairs)
            lines.append(f"const {{ {binds} }} = {ident[dep]};\n")
        lines.append(mod.body)
        lines.append(f"\nreturn Object.freeze({{ {', '.join(mod.exports)} }});\n}})();\n")
        out.append("".join(lines))
    return "".join(out)


# ------------------------------------------------------------------ the page shell
def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode() + "'"


def version() -> str:
    """rankboard's version: the installed distribution's, else setup.cfg's beside us."""
    try:
        return importlib.metadata.version("rankboard")
    except importlib.metadata.PackageNotFoundError:
        cfg = configparser.ConfigParser()
        try:
            cfg.read(_WEB.parent / "setup.cfg", encoding="utf-8")
            return cfg.get("metadata", "version", fallback="unknown")
        except (OSError, configparser.Error):
            return "unknown"


@dataclass(frozen=True)
class Shell:
    """The parts of a report that do not depend on the run: HTML around the data, and the
    CSP that allows exactly the one inline script and the one inline style."""

    head: str  # up to the data element's content
    tail: str  # after it: the script and the end of the page
    csp: str


def _main_markup() -> str:
    index = (TEMPLATES / "index.html").read_text(encoding="utf-8")
    start = index.index('<main id="app"')
    end = index.index("</main>", start) + len("</main>")
    return index[start:end]


_shell_cache: dict[tuple[float, ...], Shell] = {}


def shell() -> Shell:
    """The report shell, built from the current files of ``web/static`` and
    ``web/templates`` (cached until one of them changes)."""
    files = sorted(p for p in STATIC.iterdir() if p.is_file()) + sorted(TEMPLATES.iterdir())
    key = tuple(p.stat().st_mtime for p in files)
    cached = _shell_cache.get(key)
    if cached is not None:
        return cached
    script = bundle()
    style = "\n".join((STATIC / s).read_text(encoding="utf-8") for s in STYLES)
    icon = "data:image/svg+xml;base64," + base64.b64encode((STATIC / "favicon.svg").read_bytes()).decode()
    csp = ("default-src 'none'; script-src " + _sha256(script) + "; style-src " + _sha256(style)
           + "; img-src data:; base-uri 'none'; form-action 'none'")
    page = (TEMPLATES / "report.html").read_text(encoding="utf-8")
    page = (page.replace("@CSP@", csp).replace("@ICON@", icon).replace("@MAIN@", _main_markup())
            .replace("@STYLE@", style))
    head, rest = page.split("@DATA@")
    tail = rest.replace("@SCRIPT@", script)
    built = Shell(head, tail, csp)
    _shell_cache.clear()
    _shell_cache[key] = built
    return built


# ------------------------------------------------------------------ the data
def safe_json(value: Any) -> str:
    """``value`` as JSON that may sit inside a ``<script>`` element (module docstring)."""
    return _json.encode(value).decode("utf-8").translate(_UNSAFE)


def attachment_name(run: str) -> str:
    """The attachment's file name (PROTOCOL 4): the run id with ``:`` replaced by ``_``."""
    return run.replace(":", "_") + ".html"


@dataclass
class RunReport:
    """What a report shows of one run, wherever it comes from (the web's hub, or a run
    rebuilt from its journal by ``rankboard export``)."""

    run: str
    header: dict[str, Any]
    ranks: list[dict[str, Any]]
    records: list[dict[str, Any]]
    steps: StepStore
    svg: str | None = None
    stacks: Any = None
    #: ``GET .../collectives`` (section 7.2): its listed groups go in the file
    collectives: Any = None
    #: ``GET .../resources``: the cluster's resources over time (web/resourcetimeline.py)
    resources: Any = None
    #: (8.1) the run's :class:`broker.run.steps.line.StepLine` (None: no superseded steps) and
    #: its superseded epoch records
    line: Any = None
    epochs_superseded: list[dict[str, Any]] = field(default_factory=list)


def _graph_uri(svg: str | None) -> str | None:
    if not svg:
        return None
    return "data:image/svg+xml;base64," + base64.b64encode(svg.encode("utf-8")).decode("ascii")


#: JSON bytes of stack dumps and groups a report embeds at most (issue 32: a run with
#: maximal dumps made a 63 MiB report): groups first (the report shows them), then dumps,
#: each list cut where the next item would pass; ``groups_left_out``/``dumps_left_out``
#: say how many were left out.
MAX_REPORT_STACKS_BYTES = 2 * 1024 * 1024
_size = msgspec.json.Encoder().encode


def _stacks(value: Any) -> Any:
    """The run's stack dumps in ``GET .../stacks``'s shape, when the run has any, bounded
    to :data:`MAX_REPORT_STACKS_BYTES`."""
    if not (isinstance(value, dict) and (value.get("groups") or value.get("dumps"))):
        return None
    room = MAX_REPORT_STACKS_BYTES
    out: dict[str, Any] = {}
    for name in ("groups", "dumps"):
        found = value.get(name)
        items: list[Any] = found if isinstance(found, list) else []
        kept = []
        for item in items:
            size = len(_size(item))
            if size > room:
                break
            room -= size
            kept.append(item)
        out[name] = kept
        if len(kept) < len(items):
            out[f"{name}_left_out"] = len(items) - len(kept)
    return out


def _verdict(value: Any) -> Any:
    """The run's collective verdict (the listed groups of ``GET .../collectives``), or None."""
    if isinstance(value, dict) and isinstance(value.get("groups"), list) and value["groups"]:
        return value["groups"]
    return None


#: Significant digits kept of the fractional numbers in an epoch record's per-GPU tables
#: (``resources.gpus``, ``gpu_metrics``): 7, float32's precision, more than the page ever
#: shows (it formats to 4). Integers (bytes, indices) are exact, as is everything else.
TABLE_DIGITS = 7


def _column(values: list[Any]) -> Any:
    """One column of a per-GPU table: ``{"c": v}`` when every value is ``v``, ``{"a": a,
    "d": d}`` for integers ``a, a+d, a+2d, ...`` (device indices), else the list."""
    first = values[0]
    if all(type(v) is type(first) and v == first for v in values):
        return {"c": first}
    if all(type(v) is int for v in values) and len(values) > 1:
        d = values[1] - values[0]
        if all(values[i] - values[i - 1] == d for i in range(2, len(values))):
            return {"a": values[0], "d": d}
    return [float(f"{v:.{TABLE_DIGITS}g}") if type(v) is float and v == v and v not in
            (float("inf"), float("-inf")) else v for v in values]


class Packer:
    """Packs the per-GPU lists of epoch records (``resources.gpus``, ``gpu_metrics``) as
    column tables: ``{"$table": n, "keys": [...], "cols": [...]}``, each column as
    :func:`_column` writes it, or ``{"p": 1}`` when it equals the same column of the
    previous record's table (GPU names, totals: the same every epoch). ``report.js`` unpacks
    them, in the same order, before the store sees a record, so the page gets the shape of
    PROTOCOL 4. A 1,024-rank record is ~300 KB as JSON objects and ~30 KB packed: 100 of
    them are the difference between 30 and 3 MB (bench ``report_1m_bytes``)."""

    def __init__(self) -> None:
        self._prev: dict[tuple[str, str], list[Any]] = {}

    def table(self, path: str, rows: Any) -> Any:
        if not isinstance(rows, list) or len(rows) < 8 or not all(isinstance(r, dict) for r in rows):
            return rows
        keys = list(rows[0])
        if any(list(r) != keys for r in rows) or any(
                isinstance(r[k], (dict, list)) for r in rows for k in keys):
            return rows
        cols: list[Any] = []
        for k in keys:
            values = [r[k] for r in rows]
            if self._prev.get((path, k)) == values:
                cols.append({"p": 1})
            else:
                cols.append(_column(values))
            self._prev[(path, k)] = values
        return {"$table": len(rows), "keys": keys, "cols": cols}

    def record(self, record: dict[str, Any]) -> dict[str, Any]:
        """An epoch record with its per-GPU lists packed (a new dict: the web's is untouched)."""
        out = dict(record)
        if "gpu_metrics" in out:
            out["gpu_metrics"] = self.table("gpu_metrics", out["gpu_metrics"])
        res = out.get("resources")
        if isinstance(res, dict) and "gpus" in res:
            res = dict(res)
            res["gpus"] = self.table("gpus", res["gpus"])
            out["resources"] = res
        return out


def render(report: RunReport, *, now: float | None = None) -> Iterator[str]:
    """The report as chunks of text (join them, or stream them); see the module docstring."""
    sh = shell()
    store = report.steps
    yield sh.head
    snapshot = dict(report.header)
    snapshot["ranks"] = report.ranks
    packer = Packer()
    snapshot["records"] = [packer.record(r) for r in report.records]
    made = time.time() if now is None else now
    yield (f'{{"format":{FORMAT},"run":{safe_json(report.run)},"generated_at":{safe_json(made)},'
           f'"version":{safe_json(version())},"graph":{safe_json(_graph_uri(report.svg))},'
           f'"stacks":{safe_json(_stacks(report.stacks))},'
           f'"collectives":{safe_json(_verdict(report.collectives))},'
           f'"resources":{safe_json(report.resources)},')
    yield '"snapshot":' + safe_json(snapshot)
    names = [*store.metric_names(), *BUILTIN_SERIES]
    last = store.last_step
    yield ',"series":{'
    tail: dict[str, Any] = {}
    for i, name in enumerate(names):
        # ``end=last``: steps a live web adds while this streams do not reach later series
        buckets = store.series(name, None, last, REPORT_POINTS)
        yield ("," if i else "") + safe_json(name) + ":" + safe_json(buckets)
        if last is not None and buckets:
            one = store.series(name, last, last, 1)
            if one:
                tail[name] = one[0]
    yield '},"last":' + safe_json(tail)
    yield from _superseded(report, packer)
    yield "}"
    yield sh.tail


def _superseded(report: RunReport, packer: Packer) -> Iterator[str]:
    """(8.1) ``,"superseded": [{attempt, series: {name: buckets}, epochs: [records]}]``
    for the latest :data:`SUPERSEDED_ATTEMPTS` attempts that have superseded records, oldest
    first; each series at the points :data:`SUPERSEDED_BYTES` allows over all of them (at
    most :data:`REPORT_POINTS`, at least 8), so the file stays within its 10 MiB."""
    line = report.line
    epochs = report.epochs_superseded or []
    attempts = set(line.superseded_attempts()) if line is not None else set()
    attempts.update(r.get("attempt", 0) for r in epochs if isinstance(r, dict))
    chosen = sorted(attempts)[-SUPERSEDED_ATTEMPTS:]
    stores = {k: line.superseded_of(k) for k in chosen} if line is not None else {}
    n_series = sum(len(s.metric_names()) + len(BUILTIN_SERIES) for s in stores.values() if s.rows)
    points = max(8, min(REPORT_POINTS, SUPERSEDED_BYTES // (64 * max(1, n_series))))
    yield ',"superseded":['
    for i, k in enumerate(chosen):
        store = stores.get(k)
        series: dict[str, Any] = {}
        if store is not None and store.rows:
            for name in [*store.metric_names(), *BUILTIN_SERIES]:
                buckets = store.series(name, None, None, points)
                if buckets:
                    series[name] = buckets
        recs = [packer.record(r) for r in epochs if r.get("attempt", 0) == k]
        yield ("," if i else "") + safe_json({"attempt": k, "series": series, "epochs": recs})
    yield "]"


def from_parts(run: str, header: dict[str, Any], ranks: Iterable[dict[str, Any]],
               records: Iterable[dict[str, Any]], steps: StepStore, svg: str | None,
               stacks: Any = None) -> RunReport:
    """A :class:`RunReport` with the feed-only ``loss`` of each rank left out (the ranks
    array of PROTOCOL 4 is exact)."""
    public = [{k: v for k, v in r.items() if k != "loss"} if isinstance(r, dict) else r
              for r in ranks]
    return RunReport(run, header, public, list(records), steps, svg, stacks)


def report_of_state(state: Any, stacks: Any = None, collectives: Any = None) -> RunReport:
    """A report of a run as this web holds it (a :class:`web.runstate.RunState`): its
    public header, ranks, records, graph, step store (not copied) and ``stacks``, the
    run's ``GET .../stacks`` JSON (:meth:`web.hub.Hub.stacks_view`), shown when it holds
    any dump, and ``collectives`` (:meth:`web.hub.Hub.collectives_view`), whose verdict it
    carries."""
    rep = from_parts(state.run, state.public_header(), state.ranks,
                     [record for _, record in state.records], state.steps, state.svg, stacks)
    rep.collectives = collectives
    rep.resources = state.resources.to_json()
    rep.line = state.line  # 8.1
    rep.epochs_superseded = list(state.epoch_line.superseded)
    return rep
