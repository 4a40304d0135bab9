"""``fewbit-design snr`` reconstruction mode: every size and slope is checked against its range before any work, one
line naming the option and the range (a slope of 1e308 divided by zero, 100000 channels failed to allocate)."""

from __future__ import annotations

import pytest

from fewbit_design.cli import main, snr


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


@pytest.fixture
def measured(monkeypatch):
    """The arguments the measurement would get; it does not run (the checks come before any work)."""
    calls = []

    def reconstruction(slopes, depths, archs, **options):
        calls.append((slopes, depths, archs, options))
        raise snr.FewBitError("measurement reached")

    monkeypatch.setattr(snr, "_reconstruction", reconstruction)
    return calls


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--slope", "1e308"], "--slope values must be from 0.0001 to 10000, got 1e308"),
        (["--slope", "0.1,1e-5"], "--slope values must be from 0.0001 to 10000, got 1e-5"),
        (["--channels", "100000"], "--channels must be an integer from 4 to 256, got 100000"),
        (["--channels", "0"], "--channels must be an integer from 4 to 256, got 0"),
        (["--batch", "5000"], "--batch must be an integer from 1 to 1024, got 5000"),
        (["--size", "4096"], "--size must be an integer from 2 to 1024, got 4096"),
        (["--seed", "99999999999999999999"], "--seed must be an integer from 0 to 4294967295"),
        (["--seed", "-1"], "--seed must be an integer from 0 to 4294967295, got -1"),
        (
            ["--depth", "256", "--channels", "64", "--batch", "8", "--size", "32"],
            "--batch x --channels x --size² x the largest --depth is 8 x 64 x 32² x 256 = 134217728 values, over "
            "the limit of 2**24",
        ),
    ],
)
def test_out_of_range_is_one_line_naming_the_option_and_range_before_any_work(capsys, tmp_path, measured, args,
                                                                              message):  # fmt: skip
    out = tmp_path / "snr.png"
    code, stdout, stderr = run(capsys, "snr", *args, "--out", str(out))
    assert (code, stdout) == (2, "")
    assert stderr.count("\n") == 1 and stderr.startswith("fewbit-design: error: ") and message in stderr, stderr
    assert measured == [] and list(tmp_path.iterdir()) == []


def test_the_limits_themselves_are_accepted(capsys, tmp_path, measured):
    # 2**24 values exactly: batch 1 x 256 channels x 16² x depth 256
    args = ["--slope", "1e-4,1e4", "--depth", "256", "--channels", "256", "--batch", "1", "--size", "16"]
    code, _, stderr = run(capsys, "snr", *args, "--seed", str(2**32 - 1), "--out", str(tmp_path / "snr.png"))
    assert code == 2 and "measurement reached" in stderr
    ((slopes, depths, _, options),) = measured
    assert slopes == [1e-4, 1e4] and max(depths) == 256
    assert options["channels"] * options["batch"] * options["size"] ** 2 * max(depths) == snr.MAX_VALUES
    code, _, stderr = run(capsys, "snr", "--batch", "1024", "--size", "1024", "--channels", "4", "--depth", "1",
                          "--out", str(tmp_path / "snr.png"))  # fmt: skip
    assert "--batch x --channels" in stderr  # each alone in range, together over the limit


def test_the_help_gives_the_ranges_and_why(capsys):
    code, stdout, _ = run(capsys, "snr", "--help")
    assert code == 0
    for text in ("1e-4 to 1e4", "4 to 256", "1 to 1024", "2 to 1024", "0 to 2**32 - 1", "2**24 values"):
        assert text in " ".join(stdout.split()), text
