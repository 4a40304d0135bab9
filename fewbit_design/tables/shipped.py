"""The shipped table set (:mod:`fewbit_design.tables` re-exports it): what it contains, how it is built
deterministically, and how it is verified.

The set is every registry activation at torch's default parameters, plus the ``VARIANTS`` (gelu with
approximate='tanh'), x bits 1..8 x two modes (``levelsets``; ``intervals``, with ``symmetric`` where f' is even) x two
weights: ``uniform`` (w = 1 on [-10, 10]) and ``normal`` (the standard normal density on [-10, 10]). Files live in
``fewbit_design/tables/<activation>/`` (a variant in ``<activation>_<value>/``, e.g. ``gelu_tanh/``) and
``fewbit_design/tables/index.json`` lists every table with its key (activation, params, bits, mode, symmetric,
weight) and error, so the runtime finds a table without scanning (format ``fewbit-index/1``).

``verify`` and ``build(check=True)`` compare tables by the cross-machine definition of :mod:`.same`; byte-for-byte
equality of a rebuild is expected only on the same machine and versions.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import FewBitError
from ..output_files import write_text_atomic
from ..table import INDEX_FORMAT, Table, check_index, load, parse_json, read_table_text

__all__ = [
    "INDEX_FORMAT",
    "TABLES_DIR",
    "SHIPPED_WEIGHTS",
    "TableSpec",
    "table_specs",
    "build_table",
    "build",
    "check",
    "verify",
    "read_index",
    "sample_specs",
]

TABLES_DIR = Path(__file__).resolve().parent
RANGE = (-10.0, 10.0)
# weight name in the index -> keyword arguments of design()
SHIPPED_WEIGHTS: dict[str, dict[str, Any]] = {
    "uniform": {"weight": "uniform"},
    "normal": {"weight": "normal", "loc": 0.0, "scale": 1.0},
}
BITS = tuple(range(1, 9))
MODES = ("levelsets", "intervals")
#: Parameter sets shipped besides torch's defaults: activation -> list of non-default params.
VARIANTS: dict[str, list[dict[str, Any]]] = {"gelu": [{"approximate": "tanh"}]}


@dataclass(frozen=True)
class TableSpec:
    """One table of the shipped set.

    Attributes:
        activation: the registry name
        bits: bits per element
        mode: ``levelsets`` or ``intervals``
        symmetric: intervals designed on |x| (even f')
        weight: ``uniform`` or ``normal``
        params: non-default parameters, as sorted (name, value) pairs (``gelu_tanh``)
    """

    activation: str
    bits: int
    mode: str
    symmetric: bool
    weight: str
    #: Non-default parameters as sorted (name, value) pairs; () for torch's defaults.
    params: tuple[tuple[str, Any], ...] = ()

    @property
    def folder(self) -> str:
        """``<activation>`` or, for a variant, ``<activation>_<value>...`` (e.g. ``gelu_tanh``).

        An identifier, like every folder of the set: setuptools lists them as (data-only) packages.
        """
        return "_".join([self.activation, *(str(value) for _, value in self.params)])

    @property
    def file(self) -> str:
        """Path relative to the tables folder, e.g. ``gelu/levelsets-uniform-3bit.json``."""
        mode = "intervals-symmetric" if self.symmetric else self.mode
        return f"{self.folder}/{mode}-{self.weight}-{self.bits}bit.json"

    def design(self) -> Table:
        """Compute this table (deterministic: fixed range, default grid and refinement)."""
        from ..design import design

        return design(
            self.activation,
            self.bits,
            params=dict(self.params) or None,
            mode=self.mode,
            symmetric=self.symmetric,
            low=RANGE[0],
            high=RANGE[1],
            **SHIPPED_WEIGHTS[self.weight],
        )


def table_specs(activations: Iterable[str] | None = None) -> list[TableSpec]:
    """Every table of the shipped set, in a fixed order (optionally only for some activations)."""
    from ..design import activations as registry

    names = list(activations) if activations is not None else registry.names()
    specs = []
    for name in names:
        for params in [{}, *VARIANTS.get(registry.get(name).name, [])]:
            bound = registry.bind(name, params)
            key = tuple(sorted(params.items()))
            for weight in SHIPPED_WEIGHTS:
                for mode in MODES:
                    symmetric = mode == "intervals" and bound.even
                    for bits in BITS:
                        specs.append(TableSpec(bound.name, bits, mode, symmetric, weight, key))
    return specs


def build_table(spec: TableSpec) -> tuple[TableSpec, str]:
    """Design one table and return its JSON text (runs in worker processes).

    Args:
        spec: the table to design
    """
    return spec, spec.design().to_json()


def _index_entry(spec: TableSpec, table: Table) -> dict[str, Any]:
    return {
        "file": spec.file,
        "activation": table.activation,
        "params": dict(table.params),
        "bits": table.bits,
        "mode": table.mode,
        "symmetric": table.symmetric,
        "weight": spec.weight,
        "error": table.to_dict()["error"],
    }


def _index_text(entries: list[dict[str, Any]]) -> str:
    document = {"format": INDEX_FORMAT, "range": list(RANGE), "tables": entries}
    return json.dumps(document, indent=1) + "\n"


def _design_all(
    specs: list[TableSpec], jobs: int | None, progress: Callable[[TableSpec], None] | None
) -> dict[TableSpec, str]:
    """JSON text of every spec, designed in ``jobs`` worker processes (default: all cores).

    Interrupt-safe (:class:`_Workers`): Ctrl-C stops the build at once, with every worker ended and nothing written.
    """
    jobs = max(1, int(jobs or os.cpu_count() or 1))
    results: dict[TableSpec, str] = {}
    if jobs == 1:
        for spec in specs:
            results[spec] = build_table(spec)[1]
            if progress:
                progress(spec)
        return results
    # Most expensive first keeps the workers busy until the end.
    order = sorted(specs, key=lambda s: (-s.bits, s.file))
    with _Workers(min(jobs, len(order))) as workers:
        for spec, text in workers.run(build_table, order):
            results[spec] = text
            if progress:
                progress(spec)
    return results


@contextlib.contextmanager
def _sigint_deferred():
    """Hold SIGINT back during the block (in the main thread) and deliver it, once, when the block ends.

    Both halves are needed: the signal mask keeps the kernel from delivering SIGINT (and is inherited by the worker
    processes spawned meanwhile), and a recording handler catches a SIGINT that arrived just before the block but
    whose Python handler had not run yet (it would raise KeyboardInterrupt half-way through starting a worker, whose
    start-up data then never arrived: an ``EOFError`` traceback from the orphaned worker).
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    caught: list[int] = []
    previous_handler = signal.signal(signal.SIGINT, lambda number, frame: caught.append(number))
    previous_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous_mask)  # a held-back SIGINT reaches the recorder now
        signal.signal(signal.SIGINT, previous_handler)
        if caught:
            signal.raise_signal(signal.SIGINT)  # once, to the handler that was in place (KeyboardInterrupt)


class _Workers:
    """Worker processes (spawned: numba and OpenMP do not survive a fork) fed one task at a time over a pipe each.

    Interrupt safety, the reason this is not a ``ProcessPoolExecutor`` (whose Ctrl-C handling hung the build in 3 of
    6 tries and left workers computing after the parent had gone):

    * workers start with SIGINT blocked and then ignore it, so a Ctrl-C to the terminal's process group reaches only
      the parent, never a worker half-way through its start-up (which printed a traceback);
    * the parent waits on the pipes (interruptible); on any exception, Ctrl-C included, leaving the ``with`` block
      terminates every worker (SIGTERM, then SIGKILL after 5 s) and joins it, with SIGINT held back meanwhile so a
      second Ctrl-C cannot cut the clean-up short, and re-raises;
    * a worker whose parent dies anyway (SIGKILL) gets SIGTERM from the kernel (Linux ``PR_SET_PDEATHSIG``) or
      notices within a second that its parent is gone, and exits.
    """

    def __init__(self, count: int) -> None:
        import multiprocessing

        self.context = multiprocessing.get_context("spawn")
        self.count = count
        self.processes: list[Any] = []
        self.pipes: list[Any] = []

    def __enter__(self) -> _Workers:
        from multiprocessing import resource_tracker

        try:
            # multiprocessing starts its resource tracker with the first process and unblocks SIGINT afterwards:
            # start it first, so that the workers below inherit the blocked mask (no KeyboardInterrupt in their
            # start-up)
            resource_tracker.ensure_running()
            with _sigint_deferred():
                for _ in range(self.count):
                    parent_end, child_end = self.context.Pipe()
                    process = self.context.Process(
                        target=_worker_main, args=(child_end, os.getpid()), name="fewbit-tables-worker", daemon=True
                    )
                    process.start()
                    child_end.close()
                    self.processes.append(process)
                    self.pipes.append(parent_end)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, kind: Any, value: Any, traceback: Any) -> None:
        self.close()

    def run(self, function: Callable[[Any], Any], tasks: Sequence[Any]):
        """Yield ``function(task)`` for every task, in the order they finish; a task's exception is raised here."""
        from multiprocessing.connection import wait

        todo = list(reversed(tasks))
        busy: dict[Any, Any] = {}
        for pipe in self.pipes:
            if todo:
                busy[pipe] = todo.pop()
                pipe.send((function, busy[pipe]))
        while busy:
            for pipe in wait(list(busy)):
                try:
                    status, payload = pipe.recv()
                except (EOFError, OSError):
                    process = self.processes[self.pipes.index(pipe)]
                    process.join(1)
                    raise FewBitError(
                        f"a worker process died (exit code {process.exitcode}) while designing {busy[pipe]!r}"
                    ) from None
                task = busy.pop(pipe)
                if status == "error":
                    raise (
                        payload
                        if isinstance(payload, FewBitError)
                        else RuntimeError(f"designing {task!r} failed in a worker process:\n{payload}")
                    )
                if todo:
                    busy[pipe] = todo.pop()
                    pipe.send((function, busy[pipe]))
                yield payload

    def close(self) -> None:
        """End every worker and wait for it (SIGINT held back meanwhile)."""
        with _sigint_deferred():
            for pipe in self.pipes:
                with contextlib.suppress(OSError):
                    pipe.send(None)  # a worker between tasks exits on its own
            for process in self.processes:
                if process.is_alive():
                    process.terminate()
            for process in self.processes:
                process.join(5)
                if process.is_alive():
                    process.kill()
                    process.join()
            for pipe in self.pipes:
                pipe.close()
            self.processes, self.pipes = [], []


def _worker_main(pipe: Any, parent: int) -> None:
    """A worker's loop: run ``(function, task)`` messages until ``None`` or until the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    _die_with_parent(parent)
    try:  # one numba thread per worker process: the processes already use every core
        import numba

        numba.set_num_threads(1)
    except Exception:  # pragma: no cover - numba missing or threading layer refuses; the build still works
        pass
    while True:
        try:
            while not pipe.poll(1.0):
                if os.getppid() != parent:
                    return
            message = pipe.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        function, task = message
        try:
            reply = ("ok", function(task))
        except FewBitError as exc:
            reply = ("error", FewBitError(str(exc)))
        except Exception:
            import traceback

            reply = ("error", traceback.format_exc())
        try:
            pipe.send(reply)
        except (OSError, EOFError):
            return


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to send SIGTERM when the parent exits (Linux); exit now if it is already gone."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):  # pragma: no cover - no prctl: the poll in _worker_main still notices
            pass
    if os.getppid() != parent:
        os._exit(0)


def check(
    root: str | os.PathLike | None = None,
    *,
    jobs: int | None = None,
    activations: Sequence[str] | None = None,
    progress: Callable[[TableSpec], None] | None = None,
) -> list[str]:
    """Rebuild in memory (no file written) and compare with the set in ``root`` by the definition of :mod:`.same`.

    Returns the problems found, each naming the table file, the field and both values ([] when the set is the same).

    Args:
        root: the tables folder (default: the package's)
        jobs: worker processes (default: the CPU count)
        activations: only these activations' tables
        progress: called with each spec when its table is done (for progress output)
    """
    root = Path(root) if root is not None else TABLES_DIR
    specs = table_specs(activations)
    fresh = _design_all(specs, jobs, progress)
    return _verify(root, specs, {spec: Table.from_dict(json.loads(text)) for spec, text in fresh.items()})


def build(
    out: str | os.PathLike | None = None,
    *,
    jobs: int | None = None,
    activations: Sequence[str] | None = None,
    progress: Callable[[TableSpec], None] | None = None,
) -> Path:
    """Regenerate the table set into ``out`` (default: the package's tables folder) and write its index.

    Deterministic on one machine: the same files, byte for byte, on every run with the same versions (another machine
    builds the same tables by the definition of :mod:`.same`). ``jobs`` worker processes (default: all cores).

    Args:
        out: the folder to write (default: the package's tables folder)
        jobs: worker processes (default: the CPU count)
        activations: only these activations' tables (replaced in an existing index)
        progress: called with each spec when its table is done (for progress output)
    """
    out = Path(out) if out is not None else TABLES_DIR
    if out.exists() and not out.is_dir():
        raise FewBitError(f"--out {str(out)!r} is a file; give a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FewBitError(f"cannot create output directory {str(out)!r}: {exc.strerror}") from None
    if not os.access(out, os.W_OK):
        raise FewBitError(f"output directory {str(out)!r} is not writable")
    specs = table_specs(activations)
    results = _design_all(specs, jobs, progress)
    entries = []
    if activations is not None and (out / "index.json").exists():
        # a partial build replaces only its own tables in an existing index
        built = {spec.file for spec in specs}
        entries = [entry for entry in read_index(out)["tables"] if entry.get("file") not in built]
    for spec in specs:
        text = results[spec]
        path = out / spec.file
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, text, force=True)
        entries.append(_index_entry(spec, Table.from_dict(json.loads(text), source=str(path))))
    order = {spec.file: number for number, spec in enumerate(table_specs())}  # the order of a full build
    entries.sort(key=lambda entry: order.get(entry.get("file"), len(order)))
    write_text_atomic(out / "index.json", _index_text(entries), force=True)
    return out


def read_index(root: str | os.PathLike | None = None) -> dict[str, Any]:
    """Read and check ``index.json`` of a tables folder.

    Args:
        root: the tables folder (default: the package's)
    """
    root = Path(root) if root is not None else TABLES_DIR
    path = root / "index.json"
    if not path.exists():
        raise FewBitError(f"no table index at {str(path)!r}; run 'fewbit-design tables build'")
    where = f"table index {str(path)!r}"
    document = parse_json(read_table_text(path), where)  # the size and nesting bounds of a table file
    check_index(document, where)
    return document


def sample_specs(specs: list[TableSpec], n: int, *, seed: int = 0) -> list[TableSpec]:
    """``n`` tables chosen at random but covering every activation once before any repeats.

    Args:
        specs: the specs to choose from
        n: how many
        seed: the random seed
    """
    rng = random.Random(seed)
    by_activation: dict[str, list[TableSpec]] = {}
    for spec in specs:
        by_activation.setdefault(spec.activation, []).append(spec)
    chosen: list[TableSpec] = []
    pools = {name: rng.sample(group, len(group)) for name, group in by_activation.items()}
    names = sorted(pools)
    while len(chosen) < min(n, len(specs)):
        for name in rng.sample(names, len(names)):
            if pools[name] and len(chosen) < n:
                chosen.append(pools[name].pop())
    return chosen


def _params_key(table: Table) -> tuple:
    return tuple(sorted((key, repr(value)) for key, value in table.params.items()))


def _load_set(root: Path, specs: list[TableSpec], problems: list[str]) -> dict[TableSpec, Table]:
    """Load and validate every table of ``specs`` listed in the index; record what is missing or inconsistent."""
    document = read_index(root)
    entries = {entry.get("file"): entry for entry in document["tables"]}
    tables: dict[TableSpec, Table] = {}
    for spec in specs:
        if spec.file not in entries:
            problems.append(f"table {spec.file!r} is missing from the index")
            continue
        try:
            table = load(root / spec.file)
        except FewBitError as exc:
            problems.append(str(exc))
            continue
        entry = entries[spec.file]
        expected = _index_entry(spec, table)
        if entry != expected:
            field = next(k for k in expected if entry.get(k) != expected[k])
            problems.append(f"index entry for {spec.file!r}: field {field!r} does not match the table file")
        tables[spec] = table
    return tables


def _verify(root: Path, specs: list[TableSpec], fresh: dict[TableSpec, Table]) -> list[str]:
    """Compare the set in ``root`` (every spec) with fresh designs of some specs by the definition of :mod:`.same`."""
    from .same import OBJECTIVE_RTOL, differences

    problems: list[str] = []
    tables = _load_set(root, specs, problems)
    intervals = {(s.folder, s.weight, s.bits): t for s, t in tables.items() if s.mode == "intervals"}
    for spec, table in tables.items():
        twin = intervals.get((spec.folder, spec.weight, spec.bits)) if spec.mode == "levelsets" else None
        if twin is not None and table.error > twin.error * (1 + OBJECTIVE_RTOL) + 1e-15:
            problems.append(
                f"table {spec.file!r}: field 'error' {table.error:.6g} is above the intervals table's {twin.error:.6g}"
            )
    for spec, table in fresh.items():
        if spec in tables:
            problems.extend(f"table {spec.file!r}: {message}" for message in differences(tables[spec], table))
    return problems


def verify(
    root: str | os.PathLike | None = None,
    *,
    sample: int | None = None,
    seed: int = 0,
    activations: Sequence[str] | None = None,
    progress: Callable[[TableSpec], None] | None = None,
) -> list[str]:
    """Check the shipped set; return the problems found (empty when it passes).

    Every listed file is loaded and validated; the set must be complete; for every activation, weight and bit width
    the level-sets error must be at most the intervals error; then every table (or ``sample`` of them, covering
    every activation; or only the tables of ``activations``) is recomputed and compared with the shipped one by the
    cross-machine definition of :mod:`.same` (structure exact, the objective first, pinned boundaries and levels
    within tolerance).

    Args:
        root: the tables folder (default: the package's)
        sample: recompute only this many tables (None: all)
        seed: the seed of the sample
        activations: only these activations' tables
        progress: called with each spec when its table is done (for progress output)
    """
    root = Path(root) if root is not None else TABLES_DIR
    read_index(root)
    specs = table_specs()
    listed = {entry.get("file") for entry in read_index(root)["tables"]}
    extra = sorted(listed - {spec.file for spec in specs})
    wanted = None if activations is None else {a for a in activations}
    candidates = [s for s in specs if wanted is None or s.activation in wanted]
    chosen = candidates if sample is None else sample_specs(candidates, sample, seed=seed)
    fresh: dict[TableSpec, Table] = {}
    for spec in chosen:
        fresh[spec] = spec.design()
        if progress:
            progress(spec)
    problems = _verify(root, specs, fresh)
    problems.extend(f"index lists {name!r}, which is not part of the table set" for name in extra)
    return problems
