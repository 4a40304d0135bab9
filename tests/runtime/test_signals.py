"""Ctrl-C always stops training: SIGINT at a random moment of a training loop with each technique (few-bit, BLPA,
reversible, checkpoint, offload in both forms, a planner plan) makes the process exit with KeyboardInterrupt within
5 s, and it leaves no child process, no extra thread, no temporary file and no pinned buffer lent.

A KeyboardInterrupt raised while Python runs a ``__del__`` or a weakref finalizer is printed as "Exception
ignored" and lost: the loop goes on. Autograd frees saved tensors all the time, so any such code on that path
loses some interrupts; an interrupt that lands between the creation of a temporary file and its removal, or inside
``Thread.start()``, must not leave the file or a half-started thread behind either.

Each try is a fresh process: a driver imports torch once and forks one child per try (a fork is ~100 times cheaper
than starting Python and torch again). The child trains; the driver waits for its warm-up steps, sleeps a random
delay, sends SIGINT and waits at most 5 s for the child to exit (a bound on a hang, not a timing claim). The child
catches the KeyboardInterrupt at the top of its loop, drops the training state, looks for what was left behind and
writes a report; the delays are printed on failure.

One loss is torch's, not ours: ``torch.utils.checkpoint`` (non-reentrant, what the checkpoint technique runs) keeps
its recomputed tensors in ``weakref.WeakKeyDictionary`` objects, whose removal callbacks are Python, so an interrupt
that lands in one is printed as "Exception ignored" and lost (seen once in a full suite run). A try that
hangs with only such a loss (the lost traceback is in ``WeakKeyDictionary``'s callback and names no file of this
project) is tried again, at most twice; a loss in this project's code still fails.
"""

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

# technique -> tries (offloading, the technique with Python code on autograd's path, gets more)
TRIES = {"fewbit": 3, "blpa": 3, "reversible": 3, "checkpoint": 3, "planner": 3, "offload": 8, "offload_region": 8}
DELAYS = (0.0, 0.25)  # seconds after the warm-up steps; a step takes about 5-40 ms here

DRIVER = r"""
import gc, json, os, random, signal, sys, tempfile, threading, time, traceback
import torch
from torch import nn

torch.set_num_threads(1)
from fewbit_design import runtime
from fewbit_design.runtime import blpa, checkpoint, offload, reversible


def mlp(width=64, activation=nn.GELU):
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, 4 * width), activation(), nn.Linear(4 * width, width))
                           for _ in range(4)])


def deep(width, depth):
    # many saved tensors: backward interleaves autograd's C++ with Python (hooks, and whatever runs when a saved
    # tensor is freed) many times per step
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(depth)])


_PLAN = {}


def planner_plan(folder):
    # planned once in the driver (the fork shares it); applied to a fresh model in each child
    if "plan" not in _PLAN:
        torch.manual_seed(0)
        plan = runtime.plan_memory(mlp(), torch.randn(64, 64), budget=0.95, repeats=1, offload_min_bytes=0)
        _PLAN["plan"] = plan
    return _PLAN["plan"]


def build(technique, folder):
    torch.manual_seed(0)
    x, target = torch.randn(64, 64), torch.randn(64, 64)
    if technique == "fewbit":
        model = runtime.convert(mlp(), bits=3)
    elif technique == "blpa":
        units = [blpa.BNReLULinear(256, 256, bits=4), blpa.BNReLULinear(256, 64, bits=4)]
        model = nn.Sequential(nn.Linear(64, 256), *units)
    elif technique == "reversible":
        model = reversible.revnet(2, 8, in_channels=3, num_classes=64, input_size=(16, 16))
        x = torch.randn(16, 3, 16, 16)
        target = torch.randn(16, 64)
    elif technique == "checkpoint":
        model = checkpoint.apply(mlp(), checkpoint.plan(checkpoint.profile(mlp(), x), strategy="sqrt"))
    elif technique == "offload":
        model, x, target = deep(256, 12), torch.randn(256, 256), torch.randn(256, 256)
        offload.apply(model, target="disk", min_bytes=0, directory=folder)
    elif technique == "offload_region":
        model, x, target = deep(64, 24), torch.randn(64, 64), torch.randn(64, 64)
    elif technique == "planner":
        plan = planner_plan(folder)
        model = plan.apply(mlp())
    else:
        raise ValueError(technique)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step():
        optimizer.zero_grad()
        if technique == "offload_region":
            with offload.saved_tensors(target="disk", min_bytes=0, directory=folder):
                loss = (model(x) - target).square().mean()
        else:
            loss = (model(x) - target).square().mean()
        loss.backward()
        optimizer.step()

    return step


def tasks():
    return len(os.listdir("/proc/self/task"))


def children():
    found = []
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/stat") as file:
                    fields = file.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[1] == me:
                found.append(int(pid))
    return found


def settle():
    gc.collect()
    deadline = time.monotonic() + 3  # liveness: an offload thread ends when its queue is empty
    while any(t.name.startswith("fewbit-offload") and t.is_alive() for t in threading.enumerate()):
        if time.monotonic() > deadline:
            break
        time.sleep(0.002)


def pinned_lent():
    cuda = sys.modules.get("fewbit_design.runtime.offload.cuda")
    return 0 if cuda is None else sum(pool.in_use_bytes for pool in cuda._POOLS.values())


def child(technique, folder, report, ready):
    tempfile.tempdir = folder
    result = {"technique": technique}
    try:
        step = build(technique, folder)
        step()
        step()
        settle()
        result["threads_before"] = tasks()
        result["python_threads_before"] = sorted(t.name for t in threading.enumerate())
        os.write(ready, b"r")
        result["steps"] = 0
        while True:
            step()
            result["steps"] += 1
    except BaseException as error:
        result["exception"] = type(error).__name__
        result["message"] = str(error)[:500]
    step = error = None
    settle()
    result["threads_after"] = tasks()
    result["python_threads_after"] = sorted(t.name for t in threading.enumerate())
    result["files"] = os.listdir(folder)
    result["children"] = children()
    result["pinned_lent"] = pinned_lent()
    with open(report, "w") as file:
        json.dump(result, file)
    os._exit(130 if result.get("exception") == "KeyboardInterrupt" else 1)


warm = set()
for line in sys.stdin:
    technique, folder, report, delay = line.split()
    if technique not in warm:  # compile and load once here (numba kernels, tables, the plan): children share it
        warm.add(technique)
        step = build(technique, tempfile.mkdtemp())
        step()
        step = None
        settle()
        offload.empty_cache()
    gc.freeze()  # the children's collections skip what they inherit (it would cost ~0.3 s each)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(read)
            child(technique, folder, report, write)
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(3)
    os.close(write)
    ready = os.read(read, 1)
    os.close(read)
    if ready:
        time.sleep(float(delay))
        os.kill(pid, signal.SIGINT)
    start = time.monotonic()
    status = None
    while time.monotonic() - start < 5.0:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.005)
    else:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        status = "hung"
    seconds = time.monotonic() - start
    code = os.waitstatus_to_exitcode(status) if isinstance(status, int) else status
    print(json.dumps({"ready": bool(ready), "exit": code, "seconds": round(seconds, 3)}), flush=True)
sys.stdout.flush()
os._exit(0)  # (what gc.freeze kept alive is not torn down)
"""


@pytest.mark.skipif(
    not hasattr(os, "fork") or not os.path.isdir("/proc/self/task"), reason="forks, and counts threads in /proc"
)
def test_sigint_at_random_moments_stops_training_and_leaves_nothing(tmp_path):
    rng = random.Random(os.urandom(8))
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    stderr = tmp_path / "stderr.txt"  # (a file, not a pipe: tracebacks of many children never block them)
    with open(stderr, "w") as sink:
        pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": sink}
        driver = subprocess.Popen([sys.executable, "-c", DRIVER], text=True, env=env, **pipes)
    failures = []
    third_party = []  # the stderr segments of tries lost in torch's weak-key callbacks, tried again
    try:
        for technique, tries in TRIES.items():
            attempts = [f"{attempt}" for attempt in range(tries)]
            while attempts:
                attempt = attempts.pop(0)
                folder = tmp_path / f"{technique}-{attempt}"
                folder.mkdir()
                report = tmp_path / f"{technique}-{attempt}.json"
                delay = rng.uniform(*DELAYS)
                seen = len(stderr.read_text())
                driver.stdin.write(f"{technique} {folder} {report} {delay:.4f}\n")
                driver.stdin.flush()
                answer = driver.stdout.readline()
                assert answer, f"the driver died: {stderr.read_text()[-3000:]}"
                outcome = json.loads(answer)
                result = json.loads(report.read_text()) if report.exists() else {}
                problems = []
                if not outcome["ready"]:
                    problems.append("did not start training")
                if outcome["exit"] != 130:
                    problems.append(f"exit {outcome['exit']} (130: stopped by KeyboardInterrupt; 'hung': not in 5 s)")
                if result.get("exception") != "KeyboardInterrupt":
                    problems.append(f"ended by {result.get('exception')}: {result.get('message')}")
                before, after = result.get("python_threads_before"), result.get("python_threads_after")
                if result.get("threads_after", 0) > result.get("threads_before", 0) or before != after:
                    counts = f"{result.get('threads_before')} -> {result.get('threads_after')}"
                    problems.append(f"threads {counts} (os), {before} -> {after} (python)")
                if result.get("files"):
                    problems.append(f"files left: {result['files']}")
                if result.get("children"):
                    problems.append(f"child processes: {result['children']}")
                if result.get("pinned_lent"):
                    problems.append(f"{result['pinned_lent']} bytes of pinned buffers still lent")
                segment = stderr.read_text()[seen:]
                if problems and outcome["exit"] == "hung" and _lost_in_torch_weak_keys(segment):
                    if attempt.count("again") < 2:
                        third_party.append(segment)
                        attempts.insert(0, f"{attempt}-again")
                        continue
                if problems:
                    failures.append(f"{technique} (SIGINT {delay:.3f} s after warm-up): {'; '.join(problems)}")
    finally:
        driver.stdin.close()
        driver.wait(timeout=60)
    errors = stderr.read_text()
    for segment in third_party:
        errors = errors.replace(segment, "", 1)
    lost = [line for line in errors.splitlines() if "Exception ignored" in line]
    assert not failures, "\n".join(failures) + ("\n" + errors[-4000:] if errors else "")
    assert not lost, errors[-4000:]  # an interrupt printed and dropped (it landed in a __del__ or a finalizer)


def _lost_in_torch_weak_keys(segment: str) -> bool:
    """Whether every interrupt lost in ``segment`` (a try's stderr) was lost in a ``WeakKeyDictionary`` removal
    callback (torch's checkpoint keeps its recomputed tensors in those) with no frame of this project."""
    blocks = segment.split("Exception ignored")[1:]
    return bool(blocks) and all(
        block.lstrip().startswith("in: <function WeakKeyDictionary") and "fewbit_design" not in block
        for block in blocks
    )


def test_only_losses_in_torchs_weak_key_callbacks_are_tried_again():
    torch_loss = (  # (the traceback once seen, with torch's non-reentrant checkpoint)
        "Exception ignored in: <function WeakKeyDictionary.__init__.<locals>.remove at 0x7f400dfca520>\n"
        "Traceback (most recent call last):\n"
        '  File "/usr/lib/python3.11/weakref.py", line 369, in remove\n'
        "    def remove(k, selfref=ref(self)):\n\nKeyboardInterrupt: \n"
    )
    ours = (
        "Exception ignored in: <function Session.__del__ at 0x7f00>\n"
        '  File "/x/fewbit_design/runtime/offload/session.py", line 1, in __del__\nKeyboardInterrupt: \n'
    )
    assert _lost_in_torch_weak_keys(torch_loss)
    assert not _lost_in_torch_weak_keys(ours)
    assert not _lost_in_torch_weak_keys(torch_loss + ours)
    assert not _lost_in_torch_weak_keys("")  # (a hang with nothing lost is a failure, not torch's)
