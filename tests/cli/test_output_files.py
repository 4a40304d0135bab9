"""One output writer for the whole CLI: links are written through, FIFOs in place, the outputs of
one command must be different files, and the no-overwrite check is atomic."""

from __future__ import annotations

import os
import stat
import threading
import time

import pytest

from fewbit_design import table as table_module
from fewbit_design.cli import main
from fewbit_design.errors import FewBitError
from fewbit_design.table import check_outputs, write_bytes_atomic


def run(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    captured = capsys.readouterr()
    return exit_info.value.code, captured.out, captured.err


def leftovers(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.endswith(".tmp"))


def test_force_writes_through_a_symlink_and_keeps_the_link(capsys, tmp_path):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target.name)
    code, _, err = run(capsys, "relu6", "--bits", "1", "--out", str(link), "--force")
    assert code == 0, err
    assert link.is_symlink() and os.readlink(link) == "target.json"
    assert table_module.load(target).activation == "relu6"
    assert leftovers(tmp_path) == []


def test_a_dangling_symlink_creates_the_file_it_names(capsys, tmp_path):
    link = tmp_path / "link.json"
    link.symlink_to("made.json")
    code, _, err = run(capsys, "relu6", "--bits", "1", "--out", str(link))
    assert code == 0, err
    assert link.is_symlink() and table_module.load(tmp_path / "made.json").bits == 1


def test_a_symlink_to_an_existing_file_still_needs_force(capsys, tmp_path):
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    target.write_text("old")
    link.symlink_to(target)
    code, _, err = run(capsys, "relu6", "--bits", "1", "--out", str(link))
    assert code == 2 and "exists; pass --force" in err and err.count("\n") == 1
    assert target.read_text() == "old" and link.is_symlink()


def test_a_fifo_is_written_in_place_not_replaced(capsys, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    received = []
    reader = threading.Thread(target=lambda: received.append(fifo.read_bytes()), daemon=True)
    reader.start()
    try:
        code, _, err = run(capsys, "relu6", "--bits", "1", "--out", str(fifo), "--force")
    finally:
        # never leave the reader blocked if the write did not open the FIFO, and never block here either: a blocking
        # open for writing waits forever when the reader is alive but already done with the FIFO (it hung CI once)
        deadline = time.monotonic() + 10
        while reader.is_alive() and time.monotonic() < deadline:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a reader waiting in open() then reads EOF
            except OSError:  # ENXIO: no reader has it open (not yet, or no longer)
                pass
            reader.join(0.05)
    assert code == 0, err
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert table_module.loads(received[0].decode()).activation == "relu6"


def test_a_fifo_without_reader_is_one_error_not_a_hang_nor_a_replaced_fifo(capsys, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    code, _, err = run(capsys, "relu6", "--bits", "1", "--out", str(fifo), "--force")
    assert code == 2 and "FIFO with no reader" in err and err.count("\n") == 1
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("alias", ["same", "dot", "symlink", "hardlink"])
def test_curves_refuses_out_and_csv_naming_one_file(capsys, tmp_path, alias):
    out = tmp_path / "c.png"
    if alias == "same":
        other = str(out)
    elif alias == "dot":
        other = str(tmp_path / "." / "c.png")
    elif alias == "symlink":
        (tmp_path / "link.png").symlink_to("c.png")
        other = str(tmp_path / "link.png")
    else:
        out.write_bytes(b"old")
        os.link(out, tmp_path / "hard.png")
        other = str(tmp_path / "hard.png")
    code, stdout, err = run(capsys, "curves", "gelu", "--bits", "1", "--out", str(out), "--csv", other, "--force")
    assert code == 2 and "--out and --csv name the same file" in err and err.count("\n") == 1
    assert stdout == ""
    assert not out.exists() or out.read_bytes() == b"old"


def test_design_refuses_out_and_plot_naming_one_file_through_a_link(capsys, tmp_path):
    (tmp_path / "p.png").symlink_to("t.json")
    code, _, err = run(capsys, "relu6", "--bits", "1", "--out", str(tmp_path / "t.json"), "--plot",
                       str(tmp_path / "p.png"))  # fmt: skip
    assert code == 2 and "--out and --plot name the same file" in err
    assert not (tmp_path / "t.json").exists()


def test_memory_refuses_save_and_plot_naming_one_file(capsys, tmp_path, monkeypatch):
    name = f"output_models_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(
        "import torch\n\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.GELU())\n"
    )
    monkeypatch.chdir(tmp_path)
    code, _, err = run(capsys, "memory", f"{name}:mlp", "--input-shape", "2,4", "--save", "plan.png", "--plot",
                       "plan.png", "--force")  # fmt: skip
    assert code == 2 and "--save and --plot name the same file" in err and err.count("\n") == 1
    assert not (tmp_path / "plan.png").exists()


def test_character_devices_may_repeat_but_regular_files_may_not(tmp_path):
    assert check_outputs({"--out": os.devnull, "--csv": os.devnull}) == {
        "--out": table_module.Path(os.devnull),
        "--csv": table_module.Path(os.devnull),
    }
    with pytest.raises(FewBitError, match="--a and --b name the same file"):
        check_outputs({"--a": tmp_path / "x", "--b": tmp_path / "sub" / ".." / "x"})


def test_no_overwrite_is_atomic_against_a_writer_that_finishes_first(tmp_path, monkeypatch):
    # Both writers passed the up-front check; the other one creates the file while this one is writing. Before,
    # os.replace overwrote the other writer's file and both succeeded.
    path = tmp_path / "out.json"
    real_fsync = os.fsync

    def other_writer_finishes(fd):
        real_fsync(fd)
        if not path.exists():
            path.write_text("the other writer's file")

    monkeypatch.setattr(table_module.os, "fsync", other_writer_finishes)
    with pytest.raises(FewBitError, match="exists; pass --force"):
        write_bytes_atomic(path, b"mine")
    assert path.read_text() == "the other writer's file"
    assert leftovers(tmp_path) == []


def test_concurrent_writers_without_force_exactly_one_wins(tmp_path):
    path = tmp_path / "out.bin"
    barrier = threading.Barrier(8)
    results = []

    def writer(number):
        barrier.wait()
        try:
            write_bytes_atomic(path, bytes([number]) * 4096)
            results.append(number)
        except FewBitError:
            pass

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 1
    assert path.read_bytes() == bytes(results) * 4096
    assert leftovers(tmp_path) == []


def test_a_name_near_the_limit_is_written_and_one_over_it_is_one_error(tmp_path):
    limit = os.pathconf(tmp_path, "PC_NAME_MAX")
    longest = tmp_path / ("a" * (limit - 5) + ".json")  # its temporary name used to be longer than the limit
    write_bytes_atomic(longest, b"{}")
    assert longest.read_bytes() == b"{}" and leftovers(tmp_path) == []
    with pytest.raises(FewBitError, match=f"has a name of {limit + 1} bytes; the file system allows {limit}"):
        write_bytes_atomic(tmp_path / ("b" * (limit - 4) + ".json"), b"{}")


def test_an_interrupted_write_leaves_no_file_and_no_temporary(tmp_path, monkeypatch):
    def interrupted(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(table_module.os, "fsync", interrupted)
    with pytest.raises(KeyboardInterrupt):
        write_bytes_atomic(tmp_path / "out.json", b"{}")
    assert os.listdir(tmp_path) == []


def test_plot_functions_do_not_overwrite_without_force(tmp_path):
    from fewbit_design.plots import plot_curves

    path = tmp_path / "c.png"
    path.write_bytes(b"keep")
    rows = [{"activation": "gelu", "mode": "levelsets", "bits": 1, "error": 0.1, "snr_db": 3.0}]
    with pytest.raises(FewBitError, match="exists"):
        plot_curves(rows, path)
    assert path.read_bytes() == b"keep"
    plot_curves(rows, path, force=True)
    assert path.read_bytes()[:4] == b"\x89PNG"
