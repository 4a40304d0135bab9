"""What every benchmark shares: the timer, the CSV and figure writers, and the common command-line options.

Timing (:func:`measure`): every candidate (a callable without arguments) is first called ``warmup`` times (those
calls are not kept: compilation, caches, the allocator), then ``repeats`` rounds call every candidate once, in turn
(A B A B ...; with ``alternate``, every other round reversed: A B B A ...), so that a slow spell of the shared
machine hits all candidates alike. (Candidates that change each other's state are timed in separate calls instead:
benchmarks/design_speed.py times its serial and parallel DPs apart, as a serial call would idle the parallel one's
thread pool.) Each call is timed alone:

* by default with the wall clock ``time.perf_counter``, ``synchronize`` (e.g. ``torch.cuda.synchronize``) called
  before the clock starts and before it stops, so that queued device work is counted in the call that queued it;
* with ``clock=time.process_time`` (``--clock process``): the CPU seconds of this process. Only the single-threaded
  CPU benchmarks choose it, deliberately (each says why in its docstring): on a busy shared machine other processes
  do not inflate it, but it adds up the CPU time of all threads, so with several torch threads it is no wall time;
* or with another ``timer``, such as :class:`CudaEvents` (CUDA events around the call, the L2 cache flushed first).

The result (:class:`Timings`) keeps every sample per candidate, their median and spread (min, quartiles, max), and
ratios of medians against a baseline candidate measured in the same run.

Files: :func:`write_csv` (the header from the row dicts, or given columns), :class:`CsvWriter` (rows written as they
are measured), :func:`save_figure` (matplotlib on the Agg backend). Results go to ``benchmarks/results/``
(:data:`RESULTS`), figures to ``docs/figures/`` (:data:`FIGURES`), dry runs to the temporary folder
(:func:`scratch`). :func:`add_options` adds the options the scripts share (``--out``/``--csv``, ``--figure``,
``--repeats``, ``--threads``, ``--clock``).

The scripts are run as ``python benchmarks/NAME.py`` and import this module as ``harness`` (each puts its own folder
on ``sys.path`` first, so that this also works when a test loads a script by its path).
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"
FIGURES = ROOT / "docs" / "figures"
CLOCKS: dict[str, Callable[[], float]] = {"wall": time.perf_counter, "process": time.process_time}


# --- timing -------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Timing:
    """The timed samples (seconds) of one candidate, in the order they were measured."""

    samples: tuple[float, ...]

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def quartiles(self) -> tuple[float, float]:
        """First and third quartiles (inclusive method: both within [min, max])."""
        if len(self.samples) < 2:
            return self.samples[0], self.samples[0]
        first, _, third = statistics.quantiles(self.samples, n=4, method="inclusive")
        return first, third


@dataclass(frozen=True)
class Timings:
    """Timings of the candidates of one :func:`measure` call, in the order the candidates were given."""

    by_candidate: dict[str, Timing]
    baseline: str | None = None
    rounds: int = 0  # rounds completed (fewer than ``repeats`` when ``budget_seconds`` stopped them)

    def __getitem__(self, name: str) -> Timing:
        return self.by_candidate[name]

    def medians(self) -> dict[str, float]:
        return {name: timing.median for name, timing in self.by_candidate.items()}

    def ratio(self, name: str, baseline: str | None = None) -> float:
        """Median of ``name`` over the median of the baseline (``baseline``, else the one given to measure)."""
        baseline = baseline or self.baseline
        if baseline is None:
            raise ValueError("ratio needs a baseline: none was given to measure() or here")
        return self.by_candidate[name].median / self.by_candidate[baseline].median

    def ratios(self) -> dict[str, float]:
        """Every candidate's median over the baseline's."""
        return {name: self.ratio(name) for name in self.by_candidate}


class Clock:
    """Times one call with a host clock; ``synchronize`` is called before the clock starts and before it stops."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter, synchronize: Callable[[], object] | None = None):
        self.clock = clock
        self.synchronize = synchronize

    def __call__(self, function: Callable[[], object]) -> tuple[float, object]:
        if self.synchronize is not None:
            self.synchronize()
        start = self.clock()
        result = function()
        if self.synchronize is not None:
            self.synchronize()
        return self.clock() - start, result


class CudaEvents:
    """Times one call with two CUDA events around it, the L2 cache flushed first (a write of ``flush_bytes``, outside
    the events) so that no call finds its inputs in the cache the previous call left."""

    def __init__(self, device, flush_bytes: int = 256 << 20) -> None:
        import torch

        self.torch = torch
        self.flush = torch.empty(flush_bytes, dtype=torch.uint8, device=device)

    def __call__(self, function: Callable[[], object]) -> tuple[float, object]:
        self.flush.zero_()
        start = self.torch.cuda.Event(enable_timing=True)
        end = self.torch.cuda.Event(enable_timing=True)
        start.record()
        result = function()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3, result


def cuda_synchronize(device) -> Callable[[], object] | None:
    """``torch.cuda.synchronize(device)`` for a CUDA device, else None (nothing to wait for)."""
    import torch

    device = torch.device(device)
    return (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else None


def gpu_or_dry_run(script: str, tiny: bool):
    """The CUDA device for a GPU benchmark; on a machine without one, the CPU for a ``--tiny`` dry run, else ``None``
    after one line on stderr (the caller exits with status 2)."""
    import sys

    import torch

    if torch.cuda.is_available():
        return torch.device("cuda")
    if tiny:
        return torch.device("cpu")
    print(f"{script}: no CUDA device; use --tiny for a dry run on CPU", file=sys.stderr)
    return None


def measure(
    candidates: Mapping[str, Callable[[], object]],
    *,
    repeats: int,
    warmup: int = 1,
    baseline: str | None = None,
    alternate: bool = False,
    clock: Callable[[], float] = time.perf_counter,
    synchronize: Callable[[], object] | None = None,
    timer: Callable[[Callable[[], object]], tuple[float, object]] | None = None,
    before: Callable[[str], object] | None = None,
    after: Callable[[str, object], object] | None = None,
    budget_seconds: float = math.inf,
) -> Timings:
    """Warm up, then time ``repeats`` interleaved rounds of the candidates (see the module docstring).

    ``timer`` (a :class:`Clock` or :class:`CudaEvents`) replaces ``clock`` and ``synchronize``. ``before(name)`` and
    ``after(name, result)`` run around each timed call, outside the timed interval (not around the warm-up calls):
    e.g. resetting a peak-memory counter, or keeping what the call returned; otherwise a call's result is dropped as
    soon as it is timed. No round starts once ``budget_seconds`` (wall clock) have passed since the first, which
    always runs; ``Timings.rounds`` says how many did.

    >>> timings = measure({"a": lambda: sum(range(100)), "b": lambda: sum(range(1000))}, repeats=3, baseline="a")
    >>> len(timings["a"].samples), timings.rounds
    (3, 3)
    """
    if not candidates:
        raise ValueError("measure needs at least one candidate")
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    if warmup < 0:
        raise ValueError(f"warmup must be at least 0, got {warmup}")
    if baseline is not None and baseline not in candidates:
        raise ValueError(f"baseline {baseline!r} is not among the candidates {', '.join(candidates)}")
    names = list(candidates)
    time_call = timer or Clock(clock, synchronize)
    for _ in range(warmup):
        for name in names:
            time_call(candidates[name])
    samples: dict[str, list[float]] = {name: [] for name in names}
    started = time.perf_counter()
    rounds = 0
    for repeat in range(repeats):
        if repeat and time.perf_counter() - started > budget_seconds:
            break
        for name in names[::-1] if alternate and repeat % 2 else names:
            if before is not None:
                before(name)
            seconds, result = time_call(candidates[name])
            samples[name].append(seconds)
            if after is not None:
                after(name, result)
            del result
        rounds += 1
    return Timings({name: Timing(tuple(values)) for name, values in samples.items()}, baseline, rounds)


# --- files --------------------------------------------------------------------------------------------------------
def scratch(name: str) -> Path:
    """A path in the temporary folder: where dry runs write, so that they never overwrite measured results."""
    return Path(tempfile.gettempdir()) / name


def _formatted(row: Mapping[str, object], float_format: str | None) -> dict[str, object]:
    if float_format is None:
        return dict(row)
    return {key: format(value, float_format) if isinstance(value, float) else value for key, value in row.items()}


class CsvWriter:
    """A CSV file written row by row (each row flushed: a run stopped early keeps what it measured).

    ``float_format`` (e.g. ``".6g"``) formats float values; missing keys are written empty; keys not in ``columns``
    raise unless ``extrasaction="ignore"`` (as ``csv.DictWriter``).
    """

    def __init__(
        self,
        path: str | Path,
        columns: Iterable[str],
        *,
        float_format: str | None = None,
        extrasaction: str = "raise",
    ) -> None:
        self.path = Path(path)
        self.columns = list(columns)
        self.float_format = float_format
        self.extrasaction = extrasaction

    def __enter__(self) -> CsvWriter:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._handle = self.path.open("w", newline="")
        self._writer = csv.DictWriter(self._handle, fieldnames=self.columns, extrasaction=self.extrasaction)
        self._writer.writeheader()
        self._handle.flush()
        return self

    def write(self, row: Mapping[str, object]) -> None:
        self._writer.writerow(_formatted(row, self.float_format))
        self._handle.flush()

    def __exit__(self, *exc_info) -> None:
        self._handle.close()


def write_csv(
    path: str | Path,
    rows: Iterable[Mapping[str, object]],
    *,
    columns: Iterable[str] | None = None,
    float_format: str | None = None,
    extrasaction: str = "raise",
) -> Path:
    """Write ``rows`` to ``path`` (folders created); the header is ``columns``, else the rows' keys in order of first
    appearance. Returns the path."""
    rows = list(rows)
    if columns is None:
        columns = dict.fromkeys(key for row in rows for key in row)
    with CsvWriter(path, columns, float_format=float_format, extrasaction=extrasaction) as writer:
        for row in rows:
            writer.write(row)
    return writer.path


def read_csv(path: str | Path) -> list[dict[str, str]]:
    """The rows of a CSV file as dicts of strings (what :func:`write_csv` wrote, read back)."""
    with Path(path).open(newline="") as handle:
        return list(csv.DictReader(handle))


def pyplot():
    """``matplotlib.pyplot`` on the Agg backend (no display needed); imported only when a figure is drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(figure, path: str | Path, *, dpi: int) -> Path:
    """Lay out ``figure`` (tight), save it to ``path`` (folders created) and close it. Returns the path."""
    path = Path(path)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    pyplot().close(figure)
    return path


# --- command line -------------------------------------------------------------------------------------------------
_ABSENT = object()
_HELP = {
    "out": "output CSV (default: {})",
    "figure": "output PNG (default: {})",
    "repeats": "timed calls per candidate (median; default {})",
    "threads": "torch threads (0: torch's default; default {})",
    "clock": "wall: time.perf_counter; process: CPU seconds of this process, time.process_time (default {})",
}


def add_options(
    parser: argparse.ArgumentParser,
    *,
    out: object = _ABSENT,
    figure: object = _ABSENT,
    repeats: object = _ABSENT,
    threads: object = _ABSENT,
    clock: object = _ABSENT,
    help_texts: Mapping[str, str] | None = None,
) -> argparse.ArgumentParser:
    """Add the options the benchmarks share, each only when its default is given (None: the script fills it in after
    parsing, e.g. from --quick):

    * ``--out`` (alias ``--csv``; ``args.out``): the CSV written;
    * ``--figure``: the PNG written;
    * ``--repeats`` (``args.repeats``): timed calls per candidate;
    * ``--threads``: torch threads (apply with :func:`set_threads`);
    * ``--clock``: ``wall`` or ``process`` (look up with ``CLOCKS[args.clock]``).

    ``help_texts`` replaces the standard help text of an option (keys as above; ``{}`` stands for the default).
    """
    texts = {**_HELP, **(help_texts or {})}

    def text(key: str, default: object) -> str:
        return texts[key].format("none" if default is None else default)

    if out is not _ABSENT:
        parser.add_argument("--out", "--csv", dest="out", default=out, help=text("out", out))
    if figure is not _ABSENT:
        parser.add_argument("--figure", default=figure, help=text("figure", figure))
    if repeats is not _ABSENT:
        parser.add_argument("--repeats", type=int, default=repeats, help=text("repeats", repeats))
    if threads is not _ABSENT:
        parser.add_argument("--threads", type=int, default=threads, help=text("threads", threads))
    if clock is not _ABSENT:
        parser.add_argument("--clock", choices=sorted(CLOCKS), default=clock, help=text("clock", clock))
    return parser


def set_threads(threads: int) -> None:
    """``torch.set_num_threads(threads)``; 0 keeps torch's default."""
    if threads:
        import torch

        torch.set_num_threads(threads)
