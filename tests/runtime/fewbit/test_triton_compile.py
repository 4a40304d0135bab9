"""Every Triton launch of the runtime, compiled for sm_80, sm_90 and sm_100 on the CPU, its PTX checked.

The interpreter, which the other tests use, accepts programs that the compiler rejects (and the reverse), and says
nothing about the code a GPU runs. So one subprocess (``TRITON_INTERPRET=0``: tests/conftest.py turns the
interpreter on for this process) binds the arguments of every launch of :func:`ptx_check.launches` as Triton does
(the few-bit op: every dtype it takes, 1 to 8 bits; the group quantizer: float32, float16 and bfloat16, 2 to 8 bits,
the default group size; 16-byte aligned tensors whose element count is a multiple of 128, the specialisation a
training tensor gets), compiles each to a cubin with the ptxas that the Triton wheel ships, and reads the PTX
(ptx_check.py). Checked here:

* every variant compiles for every target;
* no local memory in the PTX and none from ptxas (stack frame, spill stores and loads all 0);
* x, y, the gradient and grad_x move in 16-byte accesses (``ld.global.v4.b32``, ``st.global.v4.b32``,
  ``.v2.b64``);
* the global bytes per element each tensor moves are those of :func:`~fewbit_design.runtime.fewbit.traffic.
  kernel_traffic`, with no access to them inside a loop (where a static count would not be the traffic); only the
  table and the non-finite flag (constant size, cached) are left out. An access counts once per distinct address
  a program can touch (a group's scales, which the threads that hold its values share, once per group).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from ptx_check import ARCHS, global_accesses, launches

from fewbit_design.runtime.fewbit import traffic
from fewbit_design.runtime.fewbit.triton_launch import TRITON_CACHED_ARGUMENTS

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")

HERE = Path(__file__).parent
ROOT = HERE.parents[2]
STREAMED = {"x", "y", "grad", "grad_x"}  # the tensors of the element size (the codes are bits / 8 per element)
#: the streamed tensors each traffic kernel moves
STREAMED_BY_KERNEL = {
    "forward": {"x", "y"},
    "codes": {"x"},
    "backward": {"grad", "grad_x"},
    "group_quantize": {"x"},
    "group_dequantize": {"y"},
}


@pytest.fixture(scope="module")
def variants(tmp_path_factory):
    """One record per (compiled variant, target), from one subprocess for all of them."""
    folder = tmp_path_factory.mktemp("ptx")
    out = folder / "kernels.json"
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(folder / "cache"))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    completed = subprocess.run(
        [sys.executable, str(HERE / "ptx_check.py"), str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-4000:]
    return json.loads(out.read_text())


def describe(record):
    return f"{record['kernel']} {'/'.join(record['dtypes'])} {record['bits']} bits sm_{record['arch']}"


def per_element(record):
    """{(tensor, 'read' / 'written'): global bytes per element} and the accesses not attributed to one argument."""
    options = record["options"]
    # per program: BLOCK_GROUPS groups of 8 elements (the few-bit op), of GROUP_SIZE (the group quantizer)
    elements = options["BLOCK_GROUPS"] * options.get("GROUP_SIZE", 8)
    moved, unattributed = defaultdict(float), []
    for access in record["accesses"]:
        if len(access["params"]) != 1:
            unattributed.append(access["line"])
            continue
        argument = record["arguments"][access["params"][0]]
        if argument in TRITON_CACHED_ARGUMENTS:
            continue
        tensor = record["tensors"].get(argument)
        if tensor is None:
            unattributed.append(access["line"])
            continue
        direction = "read" if access["op"] == "ld" else "written"
        moved[tensor, direction] += access["bytes"] * access["threads"] / elements
    return dict(moved), unattributed


def streamed_accesses(record):
    for access in record["accesses"]:
        if len(access["params"]) == 1:
            tensor = record["tensors"].get(record["arguments"][access["params"][0]])
            if tensor is not None:
                yield tensor, access


def test_every_launch_compiles_to_a_cubin_for_sm80_sm90_and_sm100(variants):
    failed = [f"{describe(r)}: {r['error']}" for r in variants if r["error"] is not None]
    assert not failed, "\n".join(failed)
    assert all(r["cubin_bytes"] > 0 for r in variants)
    compiled = {(r["kernel"], dtype, r["bits"], r["arch"]) for r in variants for dtype in r["dtypes"]}
    launched = {(launch.kernel, dtype, bits, arch) for _, _, dtype, bits, launch in launches() for arch in ARCHS}
    assert launched == compiled
    # the few-bit op: two kernels, four dtypes, 1-8 bits; the group quantizer: two kernels, three dtypes, 2-8 bits
    assert len(launched) == (2 * 4 * 8 + 2 * 3 * 7) * len(ARCHS)


def test_no_local_memory_and_no_spills(variants):
    spilled = [
        f"{describe(r)}: local memory in the PTX {r['local_memory']}, ptxas stack / spill stores / loads "
        f"{r['stack_spills']}"
        for r in variants
        if r["error"] is None and (r["local_memory"] or r["stack_spills"] != [0, 0, 0])
    ]
    assert not spilled, "\n".join(spilled)


def test_x_y_and_gradients_move_in_16_byte_accesses(variants):
    narrow, missing = [], []
    for record in variants:
        if record["error"] is not None:
            continue
        seen = set()
        for tensor, access in streamed_accesses(record):
            if tensor in STREAMED:
                seen.add(tensor)
                if access["bytes"] != 16:
                    narrow.append(f"{describe(record)}: {tensor}: {access['line']}")
        expected = STREAMED_BY_KERNEL[record["traffic"]]
        if seen != expected:
            missing.append(f"{describe(record)}: accesses to {sorted(seen)}, expected {sorted(expected)}")
    assert not narrow and not missing, "\n".join(narrow + missing)


def test_bytes_per_element_are_the_traffic_model(variants):
    wrong = []
    for record in variants:
        if record["error"] is not None:
            continue
        moved, unattributed = per_element(record)
        if unattributed:
            wrong.append(f"{describe(record)}: accesses not attributed to one known argument: {unattributed}")
        looped = [a["line"] for _, a in streamed_accesses(record) if a["in_loop"]]
        if looped:
            wrong.append(f"{describe(record)}: tensor accesses inside a loop: {looped}")
        for dtype in record["dtypes"]:
            group_size = {"group_size": record["options"]["GROUP_SIZE"]} if "GROUP_SIZE" in record["options"] else {}
            model = traffic.kernel_traffic(record["traffic"], dtype, record["bits"], **group_size)
            expected = {(t, "read"): b for t, b in model.reads.items()}
            expected.update({(t, "written"): b for t, b in model.writes.items()})
            if moved != expected:
                wrong.append(f"{describe(record)} ({dtype}): PTX moves {moved} bytes per element, the model {expected}")
    assert not wrong, "\n".join(wrong)


# ---------------------------------------------------------------------------------------------------------------------
# the PTX reader on hand-written PTX

PTX = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0,
	.param .u64 .ptr .global .align 1 k_param_1,
	.param .u32 k_param_2
)
{
	ld.param.b64 	%rd1, [k_param_0];
	ld.param.b64 	%rd2, [k_param_1];
	ld.param.b32 	%r1, [k_param_2];
	mul.wide.s32 	%rd3, %r1, 4;
	add.s64 	%rd4, %rd1, %rd3;
	@%p1 ld.global.v4.b32 { %r2, %r3, %r4, %r5 }, [ %rd4 + 0 ];
	mul.wide.s32 	%rd5, %r2, 4;
	add.s64 	%rd6, %rd2, %rd5;
	ld.global.b32 	{ %r6 }, [ %rd6 + 0 ];
$L__BB0_1:
	add.s64 	%rd7, %rd2, %rd3;
	st.global.b8 	[ %rd7 + 0 ], { %rs1 };
	@%p2 bra 	$L__BB0_1;
	st.global.v2.b64 	[ %rd4 + 0 ], { %rd8, %rd9 };
	ret;
}
"""


def test_the_ptx_reader_attributes_widths_and_loops():
    accesses, pointers = global_accesses(PTX)
    assert pointers == {0: "k_param_0", 1: "k_param_1"}
    assert [(a["op"], a["bytes"], a["params"], a["in_loop"]) for a in accesses] == [
        ("ld", 16, [0], False),
        ("ld", 4, [1], False),  # a gather indexed by loaded data is an access of its own pointer only
        ("st", 1, [1], True),
        ("st", 16, [0], False),
    ]


PTX_THREADS = """
.visible .entry k(
	.param .u64 .ptr .global .align 1 k_param_0
)
.reqntid 128
{
	mov.u32 	%r1, %tid.x;
	ld.param.b64 	%rd1, [k_param_0];
	mul.wide.u32 	%rd2, %r1, 4;
	add.s64 	%rd3, %rd1, %rd2;
	ld.global.b32 	{ %r2 }, [ %rd3 + 0 ];
	bfe.u32 	%r3, %r1, 4, 3;
	mul.wide.u32 	%rd4, %r3, 8;
	add.s64 	%rd5, %rd1, %rd4;
	ld.global.b32 	{ %r4 }, [ %rd5 + 0 ];
	shr.u32 	%r9, %r1, 5;
	cvt.u64.u32 	%rd8, %r9;
	add.s64 	%rd9, %rd1, %rd8;
	ld.global.b32 	{ %r10 }, [ %rd9 + 0 ];
	and.b32 	%r5, %r1, 112;
	setp.eq.b32 	%p1, %r5, 0;
	setp.lt.s32 	%p2, %r2, 7;
	and.pred 	%p3, %p1, %p2;
	@%p3 st.global.b32 [ %rd3 + 0 ], { %r4 };
	@!%p3 st.global.b32 [ %rd3 + 0 ], { %r4 };
	ld.shared.b32 	%r6, [%r7];
	mul.wide.u32 	%rd6, %r6, 4;
	add.s64 	%rd7, %rd1, %rd6;
	ld.global.b32 	{ %r8 }, [ %rd7 + 0 ];
	ret;
}
"""


def test_the_ptx_reader_counts_the_distinct_addresses_of_a_program():
    accesses, _ = global_accesses(PTX_THREADS)
    assert [a["threads"] for a in accesses] == [
        128,  # every thread its own address
        8,  # an address from bits 4-6 of the thread index (a group's scales, shared by 16 threads)
        4,  # the warp index
        16,  # a store guarded by (tid & 112) == 0: Triton's one writer among 8 threads holding the same values
        128,  # a negated guard keeps no known thread out
        128,  # an address from data in shared memory: any thread's
    ]


def test_the_traffic_model_gives_the_design_ratios():
    # one pass, 3 bits: (4s + b/4) / 5s = 0.84x native in float32, 0.88x in bfloat16
    for dtype, ratio in (("float32", 0.8375), ("bfloat16", 0.875)):
        one_pass = traffic.op_traffic("one_pass", dtype, 3).total
        assert one_pass / traffic.op_traffic("native", dtype, 3).total == pytest.approx(ratio, abs=1e-12)
    assert traffic.op_traffic("two_pass", "float32", 3).total == 4 * 5 + 3 / 4


def test_the_group_quantizer_adds_its_kernels_bytes():
    # quantize: s + b/8 + 8/G (x read; codes and a float32 (low, step) per group written); decode: the same
    for dtype, size in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
        for bits in range(2, 9):
            for group_size in (32, 64, 128):
                expected = size + bits / 8 + 8 / group_size
                added = traffic.group_traffic(dtype, bits, group_size)
                assert added.forward == pytest.approx(expected, abs=1e-12)  # sums of exact binary fractions
                assert added.backward == pytest.approx(expected, abs=1e-12)


def test_the_cuda_page_shows_the_group_quantizers_traffic_table():
    page = (ROOT / "docs" / "cuda.md").read_text()
    begin = page.index("\n", page.index("<!-- group traffic table")) + 1
    assert page[begin : page.index("\n<!-- end of group traffic table -->")] == traffic.group_markdown_table()


def test_the_cuda_page_shows_the_models_traffic_table():
    # docs/cuda.md prints the model's own table (predicted times at 3.35 TB/s): no number there that the code lacks
    page = (ROOT / "docs" / "cuda.md").read_text()
    begin = page.index("\n", page.index("<!-- traffic table")) + 1
    assert page[begin : page.index("\n<!-- end of traffic table -->")] == traffic.markdown_table()
