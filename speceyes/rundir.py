"""A run folder: its files, appending to its log, the torn-last-line rule, reading it back.

``speceyes eval`` writes ``run.json`` (the configuration and the time segments, kept current
while the run goes), ``samples.jsonl`` (one JSON object a line, appended and flushed as each
query finishes) and ``results.json`` (metrics, written at the end). ``regate``, ``calibrate``,
``report``, ``view`` and the demo read them back; all of them go through this module.

The torn-line rule, the only one: a run killed mid-write can leave its last line cut off. So the
last non-blank line of ``samples.jsonl`` may fail to parse, and is then dropped as *torn*. A line
that fails anywhere else is corruption, an error that names the line (a lenient reader, the
viewer, skips it and says so instead). A file's bytes are only ever replaced whole: a temporary
file in the same folder, fsync, then ``os.replace``, so a kill at any moment leaves the old file
or the new one, never a half.

No numpy here: the viewer reads runs without it. ``bench/runlog.py`` parses the top-K logits
fast on top of this.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from speceyes.types import RESULTS_FILE, RUN_CONFIG_FILE, SAMPLES_FILE

__all__ = [
    "RESULTS_FILE",
    "RUN_CONFIG_FILE",
    "SAMPLES_FILE",
    "RunDir",
    "RunDirError",
    "SamplesWriter",
    "ScanReport",
    "TruncatedLogWarning",
    "parse_record",
    "read_json",
    "scan_lines",
    "write_json",
]

Record = dict[str, Any]


class RunDirError(ValueError):
    """A run folder that cannot be used as asked (it holds another run, the configuration
    differs) or whose files do not read as a run's log (a corrupt line, a results file that is
    not a JSON object)."""


class TruncatedLogWarning(UserWarning):
    """The last line of samples.jsonl is cut off (a killed run); it was skipped."""


# ---------------------------------------------------------------------------- JSON files


def json_default(o: Any) -> Any:
    """JSON for what the logs hold besides plain values: numpy scalars and arrays (by their
    ``tolist``, so numpy is never imported here) and paths."""
    if isinstance(o, Path):
        return str(o)
    tolist = getattr(o, "tolist", None)
    if callable(tolist):
        return tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _replace_atomically(path: Path, data: bytes, *, fsync: bool) -> None:
    """Write ``data`` to a temporary file beside ``path``, then rename it over ``path``: a crash
    at any point leaves the old file or the new one whole."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: Path, data: Any) -> None:
    """Replace a JSON file (indented) in one step."""
    text = json.dumps(data, indent=2, default=json_default)
    _replace_atomically(path, text.encode("utf-8"), fsync=False)


def read_json(path: Path) -> Record:
    """A file holding one JSON object; RunDirError when it holds anything else."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RunDirError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(value, dict):
        raise RunDirError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


# ---------------------------------------------------------------------------- the torn-line rule


def parse_record(line: bytes) -> Record:
    """One logged line as a dict; ValueError (JSON or Unicode) when it is not a JSON object."""
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    return obj


@dataclass
class ScanReport:
    """What a scan of samples.jsonl found besides its records."""

    torn: tuple[int, str] | None = None  # (line number, parse error) of the dropped last line
    corrupt: list[int] = field(default_factory=list)  # lines a lenient scan skipped


def scan_lines(
    lines: Iterable[tuple[int, bytes]],
    path: Path,
    parse: Callable[[bytes], Record] = parse_record,
    *,
    strict: bool = True,
    report: ScanReport | None = None,
) -> Iterator[tuple[int, Record]]:
    """(line number, record) for each numbered line, applying the torn-line rule.

    ``parse`` turns a line into a record or raises ValueError. A line that fails is held back
    until the next non-blank line shows it was not the last: then it is corrupt (RunDirError
    when ``strict``, else skipped and listed in ``report.corrupt``). A failing last line is torn:
    dropped and noted in ``report.torn``.
    """
    report = report if report is not None else ScanReport()
    pending: tuple[int, str] | None = None
    for lineno, line in lines:
        if not line.strip():
            continue
        if pending is not None:
            if strict:
                raise RunDirError(f"{path}:{pending[0]}: corrupt JSON line ({pending[1]})")
            report.corrupt.append(pending[0])
            pending = None
        try:
            record = parse(line)
        except ValueError as exc:
            pending = (lineno, str(exc))
            continue
        yield lineno, record
    report.torn = pending


# ---------------------------------------------------------------------------- appending


class SamplesWriter:
    """Appends records to samples.jsonl, one line each, flushed as it is written (a killed run
    keeps every finished query); closing fsyncs."""

    def __init__(self, path: Path) -> None:
        self._f = path.open("a", encoding="utf-8")

    def append(self, record: Record) -> None:
        self._f.write(json.dumps(record, default=json_default) + "\n")
        self._f.flush()

    def close(self) -> None:
        if self._f.closed:
            return
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        finally:
            self._f.close()

    def __enter__(self) -> SamplesWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:  # the run failed: keep what is written, skip the fsync
            self._f.close()


# ---------------------------------------------------------------------------- the folder


class RunDir:
    """The files of one run folder and the ways to write and read them."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    @property
    def config_file(self) -> Path:
        return self.path / RUN_CONFIG_FILE

    @property
    def samples_file(self) -> Path:
        return self.path / SAMPLES_FILE

    @property
    def results_file(self) -> Path:
        return self.path / RESULTS_FILE

    def holds_run(self) -> bool:
        """Whether a run was started here (its configuration or log exists)."""
        return self.config_file.exists() or self.samples_file.exists()

    # --- run.json and results.json

    def read_state(self) -> Record | None:
        """run.json (``{"config": ..., "segments": [...]}``), or None when there is none."""
        return read_json(self.config_file) if self.config_file.is_file() else None

    def write_state(self, state: Record) -> None:
        write_json(self.config_file, state)

    def read_results(self) -> Record:
        """results.json (written when the run finished); FileNotFoundError when missing."""
        if not self.results_file.is_file():
            raise FileNotFoundError(f"{self.results_file} is missing")
        return read_json(self.results_file)

    def write_results(self, results: Record) -> None:
        write_json(self.results_file, results)

    # --- samples.jsonl

    def iter_records(
        self, *, strict: bool = True, report: ScanReport | None = None
    ) -> Iterator[Record]:
        """Every record of samples.jsonl in order, streamed; the torn-line rule applies (a
        missing file has none)."""
        if not self.samples_file.exists():
            return
        with self.samples_file.open("rb") as f:
            lines = ((i, line.rstrip(b"\n")) for i, line in enumerate(f, 1))
            for _, record in scan_lines(lines, self.samples_file, strict=strict, report=report):
                yield record

    def records(self) -> list[Record]:
        """All records of samples.jsonl (see :meth:`iter_records`)."""
        return list(self.iter_records())

    def writer(self) -> SamplesWriter:
        """An appender to samples.jsonl; call :meth:`repair` first when resuming."""
        return SamplesWriter(self.samples_file)

    def repair(self) -> bool:
        """Make samples.jsonl safe to append to: drop a torn last line (rewriting the file
        atomically) or end a complete last line with its missing newline. True if it changed."""
        path = self.samples_file
        if not path.exists():
            return False
        data = path.read_bytes()
        body = data.rstrip()
        start = body.rfind(b"\n") + 1  # where the last non-blank line begins
        if not body:
            return False
        if not _parses(body[start:]):  # torn: keep every byte before it
            _replace_atomically(path, data[:start], fsync=True)
            return True
        if data.endswith(b"\n"):
            return False
        with path.open("ab") as f:  # complete, only its newline is missing
            f.write(b"\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def rewrite(self, records: Iterable[Record]) -> None:
        """Replace samples.jsonl with ``records`` atomically."""
        text = "".join(json.dumps(r, default=json_default) + "\n" for r in records)
        _replace_atomically(self.samples_file, text.encode("utf-8"), fsync=True)


def _parses(line: bytes) -> bool:
    try:
        parse_record(line)
    except ValueError:
        return False
    return True
