"""The benchmark pages' figures, read from bench/results/*.json while mkdocs builds (an mkdocs-macros module).

No figure is typed into a page: a page names a result file and a path inside it, and the build renders the value.
mkdocs.yml loads this module (`modules: [lorafleet_ops.docsite.macros]`, `on_error_fail: true`), so a page naming a
file that is missing or not JSON fails the build; a field the file lacks renders as "not recorded", never a guess.

The calls a page can make (Jinja, `{{ ... }}`):

- `bench_meta(file)`: a table of the run's record (record.py): date, machine, commit, versions, command, and
  the record's note where it has one (an older result's record says where its fields came from).
  `bench_meta(file, "date")` gives one of those fields as text (`date`, `machine`, `commit`, `versions`,
  `command`, or `hardware`: the machine's cores and GPUs only).
- `bench_value(file, path, fmt="{}", scale=1, none="—")`: one value. `fmt` is a str.format pattern ("{:.1f}",
  "{:,.0f}", "{:.1%}"); a number is multiplied by `scale` first (1000: seconds to ms); `none` is shown for a
  value recorded as null. Unless `fmt` says otherwise, true and false show as yes and no, a mapping as
  `key=value, ...` and a list as `a, b` (an empty one as `none`).
- `bench_ratio(file, numerator, denominator, fmt="{:.2f}x")`: numerator / denominator, two paths of one file.
- `bench_table(file, path, columns, rows=None, where=None)`: a markdown table, one row per item of the list or
  mapping at `path` (in `rows`' order and only those, when given: keys or indices; only the items whose `where`
  path holds a value that is not empty or false, when given). `columns` is a list of
  `[header, path, fmt, scale, none]` (the last three optional, as in bench_value), each path inside the row;
  `"_key"` is a mapping row's key, `"_index"` a list row's index, `"_value"` the row itself.
- `bench_exists(file)`: whether the result file is there, for a page that says "not yet measured" until its
  benchmark has run (`{% if bench_exists("bench-gpu-sync.json") %} ... {% else %} ... {% endif %}`).
- `bench_plot(file, alt)`: the PNG `file` (under bench/results/) inlined as an image, so that the site needs
  no copy of it under docs/.

`file` is a name under bench/results/ ("bench-sync.json"). A `path` is dotted keys and list indices
("modes.elide.sync_s.p50", "results.0.runs"), or a list of keys where a key holds a dot; in a list, a step
`field=value` takes the first item whose field is that value ("configs.name=fast.peak_gib").
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from html import escape
from pathlib import Path
from typing import Any

from lorafleet_ops.docsite.record import RECORD_KEY

NOT_RECORDED = "not recorded"
RESULTS = Path("bench") / "results"
META_FIELDS = ("date", "machine", "commit", "versions", "command")
_MISSING = object()
COLUMN_DEFAULTS = ("{}", 1, "—")  # fmt, scale, none: as bench_value's


class BenchFileError(Exception):
    """A page names a result file that is missing or not JSON: the build must fail, not render a blank."""


KeyPath = str | Sequence[str | int]


class Results:
    """The result files under one bench/results folder, each read once per build. `strict` names files whose every
    value a page reads must be there (page_check: a rehearsal's results against the page that will read them)."""

    def __init__(self, folder: Path, strict: frozenset[str] = frozenset()) -> None:
        self.folder = folder
        self.strict = strict
        self._cache: dict[str, Any] = {}

    def path(self, file: str) -> Path:
        """`file` under the folder; a name that leaves it is refused."""
        resolved = (self.folder / file).resolve()
        if self.folder.resolve() not in resolved.parents:
            raise BenchFileError(f"{file!r} is not a file under {self.folder}")
        if not resolved.is_file():
            raise BenchFileError(f"benchmark result {self.folder / file} does not exist (run its benchmark, or fix "
                                 "the name on the page)")
        return resolved

    def exists(self, file: str) -> bool:
        """Whether `file` is a result under the folder (a name that leaves it is refused, as by `path`)."""
        try:
            self.path(file)
        except BenchFileError as error:
            if "does not exist" in str(error):
                return False
            raise
        return True

    def load(self, file: str) -> Any:
        if file not in self._cache:
            try:
                self._cache[file] = json.loads(self.path(file).read_text())
            except json.JSONDecodeError as error:
                raise BenchFileError(f"benchmark result {self.folder / file} is not JSON: {error}") from error
        return self._cache[file]

    def meta(self, file: str, field: str | None = None) -> str:
        """The run's record as a markdown table, or one of META_FIELDS as text."""
        data = self.load(file)
        record = data.get(RECORD_KEY) if isinstance(data, dict) else None
        record = record if isinstance(record, dict) else {}
        texts = {"date": _text(record.get("date")), "machine": machine_text(record.get("machine")),
                 "commit": commit_text(record.get("commit")), "versions": versions_text(record.get("versions")),
                 "command": f"`{record['command']}`" if record.get("command") else NOT_RECORDED,
                 "hardware": machine_text(record.get("machine"), short=True)}
        if field is not None:
            if field not in texts:
                raise ValueError(f"bench_meta field {field!r}: one of {', '.join(texts)}")
            return texts[field]
        rows = [f"| {name} | {_cell(texts[name])} |" for name in META_FIELDS]
        if record.get("note"):  # where a field came from, when not from the run itself (an older result)
            rows.append(f"| note | {_cell(str(record['note']))} |")
        return "\n".join([f"| this run ({file}) | |", "|---|---|", *rows])

    def find(self, file: str, path: KeyPath) -> Any:
        """The value at `path` in `file` (_MISSING where absent; BenchFileError for a strict file)."""
        found = lookup(self.load(file), path)
        if found is _MISSING and file in self.strict:
            raise BenchFileError(f"{self.folder / file} has no {path!r}, which the page reads")
        return found

    def value(self, file: str, path: KeyPath, fmt: str = "{}", scale: float = 1, none: str = "—") -> str:
        return format_value(self.find(file, path), fmt, scale, none)

    def ratio(self, file: str, numerator: KeyPath, denominator: KeyPath, fmt: str = "{:.2f}x") -> str:
        top, bottom = self.find(file, numerator), self.find(file, denominator)
        if not _is_number(top) or not _is_number(bottom) or bottom == 0:
            return NOT_RECORDED
        return fmt.format(top / bottom)

    def table(self, file: str, path: KeyPath, columns: Sequence[Sequence[Any]],
              rows: Sequence[str | int] | None = None, where: KeyPath | None = None) -> str:
        items = self.find(file, path)
        if items is _MISSING:
            return f"*{path}: {NOT_RECORDED}*"
        specs = [_column(column) for column in columns]
        lines = ["| " + " | ".join(header for header, *_ in specs) + " |", "|" + "---|" * len(specs)]
        for key, row in _rows(items, rows):
            if where is not None and not _holds(lookup(row, where)):
                continue
            cells = [format_value(_row_field(key, row, column_path), fmt, scale, none)
                     for _, column_path, fmt, scale, none in specs]
            lines.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
        return "\n".join(lines)

    def plot(self, file: str, alt: str) -> str:
        data = base64.b64encode(self.path(file).read_bytes()).decode()
        return f'<img alt="{escape(alt)}" src="data:image/png;base64,{data}">'


def lookup(data: Any, path: KeyPath) -> Any:
    """The value at `path` in `data`, or _MISSING where a key or index is absent."""
    keys: Sequence[str | int] = path.split(".") if isinstance(path, str) else path
    for key in keys:
        if isinstance(data, Mapping) and str(key) in data:
            data = data[str(key)]
        elif isinstance(data, list) and _index(key, len(data)) is not None:
            data = data[_index(key, len(data))]  # type: ignore[index]
        elif isinstance(data, list) and (item := _item_where(data, key)) is not _MISSING:
            data = item
        else:
            return _MISSING
    return data


def _item_where(items: list[Any], key: str | int) -> Any:
    """The first item whose field equals the value of a `field=value` step ("configs.name=fast"), else _MISSING."""
    field, equals, wanted = str(key).partition("=")
    if not equals:
        return _MISSING
    return next((item for item in items if isinstance(item, Mapping) and str(item.get(field, _MISSING)) == wanted),
                _MISSING)


def format_value(value: Any, fmt: str = "{}", scale: float = 1, none: str = "—") -> str:
    """`value` by `fmt` (numbers times `scale`); NOT_RECORDED for a missing one, `none` for a recorded null."""
    if value is _MISSING:
        return NOT_RECORDED
    if value is None:
        return none
    if fmt == "{}" and isinstance(value, bool):
        return "yes" if value else "no"
    if fmt == "{}" and isinstance(value, dict | list):  # "KEY=value, ...", "a, b"; none when empty
        items = [f"{key}={item}" for key, item in value.items()] if isinstance(value, dict) else map(str, value)
        return ", ".join(items) or none
    if _is_number(value) and scale != 1:
        value = value * scale
    return fmt.format(value)


def machine_text(machine: Any, short: bool = False) -> str:
    """"2 cores (Intel Xeon), 23.5 GiB, no GPU, ..." from a record's machine (`short`: cores and GPUs only); cores
    and GPUs missing say so."""
    if not isinstance(machine, dict):
        return NOT_RECORDED
    cores = machine.get("cores")
    parts = [f"{cores} cores" if cores is not None else f"cores {NOT_RECORDED}"]
    if machine.get("cpu") and not short:
        parts[0] += f" ({machine['cpu']})"
    if machine.get("memory_gib") is not None and not short:
        parts.append(f"{machine['memory_gib']} GiB")
    gpus = machine.get("gpus")
    if gpus is None:
        parts.append(f"GPU {NOT_RECORDED}")
    else:
        parts.append(", ".join(f"{gpus.count(name)} x {name}" for name in dict.fromkeys(gpus)) if gpus else "no GPU")
    if short:
        return ", ".join(parts)
    if machine.get("gpu_driver"):
        parts.append(f"NVIDIA driver {machine['gpu_driver']}")
    if machine.get("kernel"):
        parts.append(machine["kernel"])
    if machine.get("load_average_1m") is not None:
        parts.append(f"load average {machine['load_average_1m']} when recorded")
    return ", ".join(parts)


def commit_text(commit: Any) -> str:
    if not isinstance(commit, dict) or not commit.get("sha"):
        return NOT_RECORDED
    return f"`{str(commit['sha'])[:12]}`" + (" with uncommitted changes" if commit.get("dirty") else "")


def versions_text(versions: Any) -> str:
    if not isinstance(versions, dict) or not versions:
        return NOT_RECORDED
    return ", ".join(f"{name} {version}" for name, version in versions.items() if version is not None)


def define_env(env: Any) -> None:
    """mkdocs-macros' entry point: the calls above, reading bench/results next to the docs folder."""
    for name, call in macro_calls(Results(Path(env.conf["docs_dir"]).resolve().parent / RESULTS)).items():
        env.macro(call, name)


def macro_calls(results: Results) -> dict[str, Callable[..., str]]:
    """Every macro a page may call, by name, reading `results`."""
    return {"bench_meta": results.meta, "bench_value": results.value, "bench_ratio": results.ratio,
            "bench_table": results.table, "bench_plot": results.plot, "bench_exists": results.exists,
            "canary_tolerance": canary_tolerance, "canary_renewable": canary_renewable,
            "ratio_departure": ratio_departure}


def canary_tolerance(dtype: str) -> str:
    """The agreement canary's default tolerance for replicas serving in `dtype`, as the proxy computes it."""
    from lorafleet_proxy.canary import tolerance_for

    return f"{tolerance_for([dtype]):g}"


def canary_renewable() -> str:
    """How many tolerances a re-loaded lone replica may depart and still renew its reference (the proxy's own)."""
    from lorafleet_proxy.canary import RENEWABLE_TOLERANCES

    return f"{RENEWABLE_TOLERANCES:g}"


def ratio_departure(what: str) -> str:
    """The ratio watch's settings (lorafleet.ratio_outliers): its `shift` and `floor` (nats), `threshold` or
    `min_tokens`."""
    from lorafleet import ratio_outliers

    values = {"shift": ratio_outliers.DIVERGENCE_SHIFT_NATS, "floor": ratio_outliers.TOKEN_SD_FLOOR_NATS,
              "threshold": ratio_outliers.EVIDENCE_THRESHOLD, "min_tokens": ratio_outliers.MIN_TOKENS}
    return f"{values[what]:g}"


def _rows(items: Any, wanted: Sequence[str | int] | None) -> list[tuple[str | int, Any]]:
    if isinstance(items, Mapping):
        pairs: list[tuple[str | int, Any]] = list(items.items())
    elif isinstance(items, list):
        pairs = list(enumerate(items))
    else:
        raise ValueError(f"bench_table: a list or a mapping is needed, found {type(items).__name__}")
    if wanted is None:
        return pairs
    found = dict(pairs)
    return [(key, found.get(key, _MISSING)) for key in wanted]


def _row_field(key: str | int, row: Any, path: KeyPath) -> Any:
    if path in ("_key", "_index"):
        return key
    if path == "_value":
        return row
    return _MISSING if row is _MISSING else lookup(row, path)


def _column(column: Sequence[Any]) -> tuple[str, KeyPath, str, float, str]:
    if not 2 <= len(column) <= 5:
        raise ValueError(f"bench_table column {column!r}: [header, path, fmt, scale, none], the last three optional")
    header, path, fmt, scale, none = (*column, *COLUMN_DEFAULTS[len(column) - 2:])
    return str(header), path, str(fmt), float(scale), str(none)


def _index(key: str | int, length: int) -> int | None:
    try:
        index = int(key)
    except (TypeError, ValueError):
        return None
    return index if -length <= index < length else None


def _holds(value: Any) -> bool:
    """A value a `where` filter keeps: present, and not null, false or empty (a zero counts)."""
    if value is _MISSING or value is None or value is False:
        return False
    return not (isinstance(value, str | list | dict) and not value)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _text(value: Any) -> str:
    return NOT_RECORDED if value in (None, "") else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
