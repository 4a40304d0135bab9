"""benchmarks/harness.py: the timer interleaves its candidates, keeps warm-up calls and hooks out of the samples,
computes medians, spread and ratios right (on a fake clock), and its CSV writer round-trips rows."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_harness():
    spec = importlib.util.spec_from_file_location("benchmarks_harness", ROOT / "benchmarks" / "harness.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


harness = load_harness()


class FakeClock:
    """A clock that moves only when a candidate says how long it took; it logs every reading."""

    def __init__(self, log: list[str]) -> None:
        self.now = 0.0
        self.log = log

    def __call__(self) -> float:
        self.log.append("clock")
        return self.now


def candidate(name: str, durations: list[float], clock: FakeClock):
    """A call that logs its name and advances the clock by its next duration."""
    remaining = iter(durations)

    def call() -> str:
        clock.log.append(name)
        clock.now += next(remaining)
        return f"result of {name}"

    return call


def test_candidates_are_called_in_turn_after_the_warm_up():
    log: list[str] = []
    clock = FakeClock(log)
    candidates = {name: candidate(name, [1.0] * 10, clock) for name in "ABC"}
    timings = harness.measure(candidates, repeats=3, warmup=2, clock=clock)
    assert [entry for entry in log if entry != "clock"] == list("ABC") * 2 + list("ABC") * 3
    assert timings.rounds == 3 and all(len(timings[name].samples) == 3 for name in "ABC")


def test_alternate_reverses_every_other_round():
    log: list[str] = []
    clock = FakeClock(log)
    candidates = {name: candidate(name, [1.0] * 10, clock) for name in "AB"}
    harness.measure(candidates, repeats=4, alternate=True, clock=clock)
    assert [entry for entry in log if entry != "clock"] == list("AB") + list("ABBAABBA")


def test_medians_spread_and_ratios_from_the_timed_calls_only():
    log: list[str] = []
    clock = FakeClock(log)
    candidates = {
        "native": candidate("native", [100.0, 3.0, 1.0, 2.0, 4.0], clock),  # 100: the warm-up call
        "fewbit": candidate("fewbit", [100.0, 10.0, 30.0, 20.0, 50.0], clock),
    }
    timings = harness.measure(candidates, repeats=4, clock=clock, baseline="native")
    assert timings["native"].samples == (3.0, 1.0, 2.0, 4.0)
    assert timings["fewbit"].samples == (10.0, 30.0, 20.0, 50.0)
    assert timings.medians() == {"native": 2.5, "fewbit": 25.0}
    assert (timings["native"].min, timings["native"].max) == (1.0, 4.0)
    assert timings["native"].quartiles == (1.75, 3.25)
    assert timings.ratio("fewbit") == 10.0 and timings.ratio("native", "fewbit") == 0.1
    assert timings.ratios() == {"native": 1.0, "fewbit": 10.0}


def test_hooks_and_synchronize_stay_outside_the_timed_interval():
    log: list[str] = []
    clock = FakeClock(log)
    kept: list[tuple[str, object]] = []

    def before(name: str) -> None:
        log.append(f"before {name}")
        clock.now += 1000.0  # work outside the timed call must not show in the samples

    def after(name: str, result: object) -> None:
        log.append(f"after {name}")
        kept.append((name, result))
        clock.now += 1000.0

    timings = harness.measure(
        {"A": candidate("A", [7.0, 5.0], clock)},
        repeats=1,
        clock=clock,
        synchronize=lambda: log.append("synchronize"),
        before=before,
        after=after,
    )
    assert timings["A"].samples == (5.0,)
    start = log.index("before A")
    assert log[:start] == ["synchronize", "clock", "A", "synchronize", "clock"]  # the warm-up call runs no hooks
    assert log[start:] == ["before A", "synchronize", "clock", "A", "synchronize", "clock", "after A"]
    assert kept == [("A", "result of A")]


def test_budget_stops_new_rounds_but_runs_the_first():
    log: list[str] = []
    clock = FakeClock(log)
    timings = harness.measure(
        {"A": candidate("A", [1.0] * 5, clock)}, repeats=4, warmup=0, clock=clock, budget_seconds=-1.0
    )
    assert timings.rounds == 1 and timings["A"].samples == (1.0,)


def test_bad_arguments_are_refused():
    call = {"A": lambda: None}
    with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
        harness.measure(call, repeats=0)
    with pytest.raises(ValueError, match="baseline 'B' is not among the candidates A"):
        harness.measure(call, repeats=1, baseline="B")
    with pytest.raises(ValueError, match="needs a baseline"):
        harness.measure(call, repeats=1).ratio("A")


def test_csv_round_trip(tmp_path):
    rows = [
        {"activation": "gelu", "bits": 3, "ratio": 0.123456789, "plain_s": None},
        {"activation": "silu", "bits": 4, "ratio": 2.0, "plain_s": 1.5, "note": "only here"},
    ]
    path = harness.write_csv(tmp_path / "sub" / "rows.csv", rows)
    assert path == tmp_path / "sub" / "rows.csv"
    assert path.read_text().splitlines()[0] == "activation,bits,ratio,plain_s,note"  # keys in order of appearance
    assert harness.read_csv(path) == [
        {"activation": "gelu", "bits": "3", "ratio": "0.123456789", "plain_s": "", "note": ""},
        {"activation": "silu", "bits": "4", "ratio": "2.0", "plain_s": "1.5", "note": "only here"},
    ]
    harness.write_csv(path, rows, columns=["activation", "ratio"], float_format=".3g", extrasaction="ignore")
    assert harness.read_csv(path) == [{"activation": "gelu", "ratio": "0.123"}, {"activation": "silu", "ratio": "2"}]


def test_csv_writer_flushes_each_row(tmp_path):
    path = tmp_path / "partial.csv"
    with harness.CsvWriter(path, ["a", "b"]) as writer:
        writer.write({"a": 1, "b": 2})
        assert harness.read_csv(path) == [{"a": "1", "b": "2"}]  # readable before the file is closed


def test_shared_options():
    parser = argparse.ArgumentParser()
    harness.add_options(parser, out=None, repeats=5, threads=1, clock="process")
    args = parser.parse_args([])
    assert (args.out, args.repeats, args.threads, args.clock) == (None, 5, 1, "process")
    args = parser.parse_args(["--csv", "x.csv", "--repeats", "2", "--clock", "wall"])
    assert (args.out, args.repeats, harness.CLOCKS[args.clock]) == ("x.csv", 2, harness.time.perf_counter)
