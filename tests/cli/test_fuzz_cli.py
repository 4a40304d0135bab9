"""Fuzzing the command line: generated argument lists for ``fewbit-design ACTIVATION``,
``plot``, ``curves``, ``tables`` and ``snr``, valid and invalid values mixed, output paths that exist, collide, are
directories, links, FIFOs or too long. Every run exits 0, or 2 with exactly one line on stderr; never a traceback,
never a temporary file left, never a partial output file, and an existing file is replaced only with ``--force``.

Kept cheap (about 15 s): designs use 1 or 2 bits and small grids; ``tables build`` only gets arguments it must
refuse; the reconstruction mode of ``snr`` (PyTorch networks) only gets invalid options.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import stat
import tempfile
from pathlib import Path

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fewbit_design.cli import main
from fewbit_design.table import loads

settings.register_profile("fewbit-cli-fuzz", max_examples=120, deadline=None)
settings.register_profile("fewbit-cli-fuzz-nightly", max_examples=1200, deadline=None)
PROFILE = settings.get_profile(
    "fewbit-cli-fuzz-nightly" if os.environ.get("HYPOTHESIS_PROFILE") == "nightly" else "fewbit-cli-fuzz"
)
FUZZ = settings(PROFILE, suppress_health_check=[HealthCheck.too_slow])

PROGRESS = ("designing tables", "recomputing tables", "measuring")
SUFFIXES = (".json", ".png", ".csv", ".svg", ".gif")


def pick(draw, valid, invalid=(), chance=8):
    """A valid value, or about one time in ``chance`` an invalid one: most command lines then get far enough to
    design, plot and write."""
    if invalid and draw(st.integers(0, chance - 1)) == 0:
        return draw(st.sampled_from(invalid))
    return draw(st.sampled_from(valid))


ACTIVATIONS = (["relu6", "hardtanh", "relu", "leaky_relu", "gelu", "silu", "GELU", "softplus"],
               ["nope", "", "-x", "gelo"])  # fmt: skip
BITS = (["1", "2", "1,2", "1-2"], ["0", "9", "-1", "x", "", "1e3", "2-1", "99999999999999999999", " 1"])
NUMBERS = (["1", "0.5", "2", "-1", "3"], ["0", "nan", "inf", "-inf", "1e-300", "1e300", "x", ""])
PARAMS = (["negative_slope=0.2", "approximate=tanh", "beta=2", "min_val=-2", "alpha=0.5"],
          ["negative_slope=1e308", "negative_slope=nan", "x=1", "=", "alpha", "max_val=-2", "approximate=fast",
           "threshold=1e300", "beta=1e308"])  # fmt: skip
RANGES = (
    [("-10", "10"), ("-4", "4"), ("-8", "2")],
    [("1", "-1"), ("nan", "1"), ("-1e308", "1e308"), ("0", "1e-300"), ("-1e7", "1"), ("0", "0"), ("-inf", "1")],
)


@st.composite
def weight_args(draw, workdir: Path):
    args = []
    kind = pick(draw, ["uniform", "normal", "laplace", "student-t", "Normal"], ["empirical", "cauchy", ""])
    if draw(st.booleans()):
        args += ["--weight", kind]
    if kind in ("normal", "laplace", "student-t", "Normal"):
        for option in ("--loc", "--scale"):
            if draw(st.integers(0, 3)) == 0:
                args += [option, pick(draw, *NUMBERS)]
    if kind == "student-t" or draw(st.integers(0, 9)) == 0:
        args += ["--df", pick(draw, ["3", "1"], ["0", "-1", "nan", "x"])]
    if kind == "empirical" or draw(st.integers(0, 9)) == 0:
        args += [
            "--weight",
            "empirical",
            "--samples",
            str(workdir / pick(draw, ["samples.npy", "big.npy"], ["missing.npy", "text.npy"], chance=3)),
        ]
    if draw(st.integers(0, 2)) == 0:
        args += ["--range", *pick(draw, *RANGES)]
    return args


@st.composite
def output_path(draw, workdir: Path, suffix: str):
    """A path in ``workdir``: new (most often), existing, a directory, a link, a FIFO, a missing folder, too long."""
    new = [str(workdir / f"{name}{suffix}") for name in ("a", "b", "c")]
    special = [
        str(workdir / f"existing{suffix}"),
        str(workdir / "folder"),
        str(workdir / f"link{suffix}"),
        str(workdir / "fifo"),
        str(workdir / "missing" / f"x{suffix}"),
        str(workdir / ("n" * 300 + suffix)),
        "",
    ]
    return pick(draw, new, special, chance=3)  # fmt: skip


@st.composite
def command_lines(draw, workdir: Path):
    command = draw(st.sampled_from(["design", "design", "design", "plot", "curves", "tables", "snr"]))
    if command == "design":
        args = [pick(draw, *ACTIVATIONS), "--bits", pick(draw, ["1", "2"], ["0", "9", "x", "-1", "1-2"])]
        mode = pick(draw, ["levelsets", "intervals", "Intervals"], ["bogus"])
        if draw(st.booleans()):
            args += ["--mode", mode]
        if mode != "levelsets" and draw(st.integers(0, 2)) == 0 or draw(st.integers(0, 15)) == 0:
            args += ["--symmetric"]
        if draw(st.integers(0, 3)) == 0:
            args += ["--grid", pick(draw, ["65", "257"], ["5", "3", "0", "x", "99999999", "1e3"])]
        if draw(st.integers(0, 3)) == 0:
            args += ["--spacing", pick(draw, ["adaptive", "uniform"], ["log"])]
        for _ in range(draw(st.integers(0, 1))):
            args += ["--param", pick(draw, *PARAMS)]
        args += draw(weight_args(workdir))
        if draw(st.booleans()):
            args += ["--out", draw(output_path(workdir, ".json"))]
        if draw(st.integers(0, 3)) == 0:
            same = [args[-1]] if args[-2] == "--out" else []
            args += ["--plot", draw(st.sampled_from([draw(output_path(workdir, ".png")), *same]))]
        if draw(st.booleans()):
            args += ["--json"]
        if draw(st.integers(0, 3)) == 0:
            args += ["--no-refine"]
    elif command == "plot":
        args = ["plot", pick(draw, *ACTIVATIONS), "--bits", pick(draw, ["1", "2", "1,2"], ["0", "x", "9"])]
        if draw(st.booleans()):
            args += ["--mode", pick(draw, ["levelsets", "intervals"], ["bogus"])]
        for _ in range(draw(st.integers(0, 1))):
            args += ["--param", pick(draw, *PARAMS)]
        args += draw(weight_args(workdir))
        args += ["--out", draw(output_path(workdir, ".png"))]
    elif command == "curves":
        args = ["curves", *[pick(draw, *ACTIVATIONS) for _ in range(draw(st.integers(1, 2)))], "--bits"]
        args += [pick(draw, *BITS)]
        args += draw(weight_args(workdir))
        args += ["--out", draw(output_path(workdir, ".png"))]
        if draw(st.booleans()):
            args += ["--csv", draw(st.one_of(output_path(workdir, ".csv"), st.just(args[-1])))]
    elif command == "tables":
        if draw(st.booleans()):
            args = ["tables", "verify", "--sample", pick(draw, ["1"], ["0", "-1", "x"]), "--activation", "relu"]
            if draw(st.booleans()):
                args += ["--dir", str(workdir / draw(st.sampled_from(["folder", "missing", "existing.json"])))]
        else:
            args = ["tables", "build", "--out", str(workdir / draw(st.sampled_from(["existing.json", "missing/x"])))]
            args += draw(st.sampled_from([["--jobs", "0"], ["--jobs", "x"], ["--activation", "nope"], ["--check"]]))
    else:
        if draw(st.integers(0, 3)):
            args = ["snr", "--bits", pick(draw, ["1", "1-2"], ["0", "x"])]
            args += [pick(draw, *ACTIVATIONS) for _ in range(draw(st.integers(1, 2)))]
            if draw(st.integers(0, 5)) == 0:
                args += ["--slope", "0.1"]
        else:
            invalid = [["--channels", "3"], ["--size", "3"], ["--arch", "bogus"], ["--slope", "0"], ["--depth", "0"]]
            args = ["snr", *draw(st.sampled_from(invalid))]
        args += ["--out", draw(output_path(workdir, pick(draw, [".png", ".svg"], [".gif"])))]
        if draw(st.booleans()):
            args += ["--csv", draw(st.one_of(output_path(workdir, ".csv"), st.just(args[-1])))]
    if draw(st.integers(0, 2)) == 0 and args[:2] != ["tables", "verify"]:
        args += ["--force"]
    return args


def prepare(workdir: Path) -> dict[Path, bytes]:
    """The files the generated command lines refer to; returns the bytes of the existing files."""
    (workdir / "folder").mkdir()
    existing = {}
    for suffix in SUFFIXES:
        path = workdir / f"existing{suffix}"
        path.write_bytes(b"keep " + suffix.encode())
        existing[path] = path.read_bytes()
        (workdir / f"link{suffix}").symlink_to(f"existing{suffix}")
    os.mkfifo(workdir / "fifo")
    np.save(workdir / "samples.npy", np.random.default_rng(0).standard_normal(2000))
    np.save(workdir / "big.npy", np.array([-1e308, 1e308, 0.0, 1.0]))
    (workdir / "text.npy").write_text("not an array")
    return existing


def check_outputs(workdir: Path, existing: dict[Path, bytes], args: list[str], code: int) -> None:
    """No temporary file, every output whole, existing files replaced only by a successful run with --force, links
    and the FIFO still what they were (written through, never replaced)."""
    assert stat.S_ISFIFO(os.lstat(workdir / "fifo").st_mode)
    for suffix in SUFFIXES:
        assert (workdir / f"link{suffix}").is_symlink()
    for path in workdir.rglob("*"):
        assert not path.name.endswith(".tmp"), f"temporary file left: {path}"
        if path.is_symlink() or not path.is_file() or path.name.startswith(("samples", "big", "text")):
            continue
        data = path.read_bytes()
        if path in existing and data == existing[path]:
            continue
        assert path not in existing or ("--force" in args and code == 0), f"{path.name} replaced without --force"
        if path.suffix == ".json":
            loads(data.decode())
        elif path.suffix == ".png":
            assert data.startswith(b"\x89PNG\r\n\x1a\n") and data.endswith(b"IEND\xaeB`\x82"), path
        elif path.suffix == ".csv":
            assert data.endswith(b"\n") and data.count(b"\n") >= 2, path
        elif path.suffix == ".svg":
            assert data.rstrip().endswith(b"</svg>"), path


@FUZZ
@given(data=st.data())
def test_generated_command_lines_exit_0_or_2_with_one_line(data):
    with tempfile.TemporaryDirectory(prefix="fewbit-cli-fuzz-") as folder:
        workdir = Path(folder)
        existing = prepare(workdir)
        args = data.draw(command_lines(workdir), label="args")
        stdout, stderr = io.StringIO(), io.StringIO()
        cwd = os.getcwd()
        os.chdir(workdir)  # a relative path among the arguments lands here, not in the repository
        try:
            with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
                main(args)
        except SystemExit as exit_info:
            code = exit_info.code
        else:
            code = 0
        finally:
            os.chdir(cwd)
        err = stderr.getvalue()
        assert "Traceback" not in err, err
        assert code in (0, 2), (code, err)
        if code == 2:
            lines = [line for line in err.splitlines() if line.strip() and not line.startswith(PROGRESS)]
            assert len(lines) == 1 and lines[0].startswith("fewbit-design: error: "), err
        if code == 0 and "--json" in args and args[0] not in ("plot", "curves", "tables", "snr"):
            json.loads(stdout.getvalue())
        check_outputs(workdir, existing, args, code)
        if os.environ.get("FEWBIT_FUZZ_LOG"):
            with open(os.environ["FEWBIT_FUZZ_LOG"], "a") as log:
                log.write(f"{code} {args[:2]} {err.strip().splitlines()[-1][:150] if err.strip() else ''}\n")
