"""A command with two outputs writes both or neither (``gelu --out J --plot P`` kept J when writing P failed): every
output goes to a temporary file first, and the names are given only when all are complete
(:func:`fewbit_design.table.write_files_atomic`)."""

from __future__ import annotations

import errno
import os
import signal

import pytest

from fewbit_design import table as table_module
from fewbit_design.cli import main
from fewbit_design.errors import FewBitError
from fewbit_design.table import write_files_atomic

FACTORY = """
import torch

def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.GELU(), torch.nn.Linear(8, 4))
"""


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def two_outputs(name: str, tmp_path, monkeypatch) -> tuple[list[str], list[str]]:
    """A quick command line of ``name`` with its two outputs, and their file names."""
    if name == "memory":
        module = f"both_models_{tmp_path.name.replace('-', '_')}"
        (tmp_path / f"{module}.py").write_text(FACTORY)
        args = ["memory", f"{module}:mlp", "--input-shape", "2,4", "--allow", "checkpoint"]
        return [*args, "--save", "plan.json", "--plot", "plan.png"], ["plan.json", "plan.png"]
    args = {
        "design": ["relu6", "--bits", "1", "--out", "t.json", "--plot", "t.png"],
        "curves": ["curves", "relu6", "--bits", "1", "--out", "c.png", "--csv", "c.csv"],
        "snr": ["snr", "--bits", "1", "relu6", "--out", "s.png", "--csv", "s.csv"],
    }[name]
    return args, [args[-3], args[-1]]


def fail_on_sync(monkeypatch, number: int, error: BaseException) -> None:
    """The ``number``-th file synced to disk fails with ``error`` (a full disk, or Ctrl-C while writing it)."""
    real_fsync = os.fsync
    calls = []

    def fsync(fd):
        calls.append(fd)
        if len(calls) == number:
            raise error
        real_fsync(fd)

    monkeypatch.setattr(table_module.os, "fsync", fsync)


COMMANDS = ["design", "curves", "snr", "memory"]
DISK_FULL = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("name", COMMANDS)
@pytest.mark.parametrize("failure", ["disk full", "ctrl-c"])
def test_when_the_second_output_fails_the_first_is_not_written(capsys, tmp_path, monkeypatch, name, failure):
    args, names = two_outputs(name, tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    before = sorted(os.listdir(tmp_path))
    fail_on_sync(monkeypatch, 2, DISK_FULL if failure == "disk full" else KeyboardInterrupt())
    code, _, err = run(capsys, *args)
    if failure == "disk full":
        assert code == 2 and err.count("\n") == 1 and "No space left on device" in err and names[1] in err, err
    else:
        assert code == 130 and err == "fewbit-design: interrupted\n"
    assert sorted(os.listdir(tmp_path)) == before  # neither output, no temporary file


@pytest.mark.parametrize("name", COMMANDS)
def test_with_force_a_failure_keeps_both_old_files(capsys, tmp_path, monkeypatch, name):
    args, names = two_outputs(name, tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)
    for file_name in names:
        (tmp_path / file_name).write_bytes(b"old " + file_name.encode())
    fail_on_sync(monkeypatch, 2, DISK_FULL)
    code, _, err = run(capsys, *args, "--force")
    assert code == 2, err
    assert [(tmp_path / n).read_bytes() for n in names] == [b"old " + n.encode() for n in names]
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]


def test_a_name_taken_meanwhile_undoes_the_files_already_created(tmp_path, monkeypatch):
    # Both names were free when checked; another writer creates the second while this one writes: the first file,
    # already given its name, is removed again, and the other writer's file is kept.
    first, second = tmp_path / "a.json", tmp_path / "b.png"
    real_fsync = os.fsync

    def other_writer_finishes(fd):
        real_fsync(fd)
        if not second.exists():
            second.write_text("the other writer's file")

    monkeypatch.setattr(table_module.os, "fsync", other_writer_finishes)
    with pytest.raises(FewBitError, match="b.png' exists; pass --force"):
        write_files_atomic({first: b"mine", second: b"mine too"})
    assert sorted(os.listdir(tmp_path)) == ["b.png"] and second.read_text() == "the other writer's file"


def test_ctrl_c_while_the_names_are_given_comes_after_all_of_them(tmp_path, monkeypatch):
    paths = [tmp_path / name for name in ("a.json", "b.png", "c.csv")]
    real_link = os.link

    def link_then_ctrl_c(source, target):
        real_link(source, target)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C after the first name is given

    monkeypatch.setattr(table_module.os, "link", link_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        write_files_atomic({path: path.name.encode() for path in paths})
    assert [path.read_bytes() for path in paths] == [b"a.json", b"b.png", b"c.csv"]
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.png", "c.csv"]
