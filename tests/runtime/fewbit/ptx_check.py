"""Compile every Triton launch of the few-bit runtime for real GPU targets and read its PTX (no GPU needed).

Run as a script (``TRITON_INTERPRET=0``, as test_triton_compile.py does in a subprocess): ``python ptx_check.py
out.json [arch ...]``. For each launch of :func:`launches` (the few-bit op's
:func:`fewbit_design.runtime.fewbit.triton_launch.triton_launches` and the group quantizer's
:func:`fewbit_design.runtime.linear.triton_quant.triton_launches`), the arguments are bound exactly as Triton binds
them at a launch (its own binder: the signature, the constexprs, the 16-byte alignment and divisibility
specialisation), compiled with ``triton.compile`` to a cubin for each target (the Triton wheel ships ptxas), and
the PTX is read: every global access is attributed to the kernel argument its address comes from (a def-use walk
from ``ld.param``), with its width and whether it sits in a loop; ptxas' report gives registers, stack and spills.
The JSON holds one record per (compiled variant, target).

:func:`global_accesses` is the PTX reader, tested on its own in test_triton_compile.py.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

ARCHS = (80, 90, 100)
_INSTRUCTION = re.compile(r"^\s*(?:@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);")
_LABEL = re.compile(r"^\s*(\$L__BB\w+):")
_BRANCH = re.compile(r"\bbra(?:\.uni)?\s+(\$L__BB\w+)\s*;")
_PARAM = re.compile(r"^\s*\.param\s+\.(\w+)(\s+\.ptr)?[^,)]*?\s(\w+_param_(\d+))")
_REGISTER = re.compile(r"%[\w.]+")
_WIDTHS = {"8": 1, "16": 2, "32": 4, "64": 8, "128": 16}
_GUARD = re.compile(r"^\s*@(!?)(%\w+)")
_THREADS = re.compile(r"^\s*\.reqntid\s+(\d+)", re.MULTILINE)
_SPILLS = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGISTERS = re.compile(r"Used (\d+) registers")


def _operands(text: str) -> list[str]:
    """The operands of one instruction, split at the commas outside braces and brackets."""
    parts, depth, current = [], 0, ""
    for char in text:
        depth += char in "{[" and 1 or (char in "}]" and -1 or 0)
        if char == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += char
    if current.strip():
        parts.append(current.strip())
    return parts


def _access_bytes(opcode: str) -> int:
    """Bytes one thread moves with a ld / st / atom / red instruction (``ld.global.v4.b32``: 16)."""
    tokens = opcode.split(".")
    lanes = next((int(t[1:]) for t in tokens if re.fullmatch(r"v\d", t)), 1)
    width = next(_WIDTHS[t[1:]] for t in reversed(tokens) if re.fullmatch(r"[bsuf](8|16|32|64|128)", t))
    return lanes * width


def _immediate(operand: str) -> int | None:
    try:
        return int(operand, 0)
    except ValueError:
        return None


class _ThreadBits:
    """Which bits of ``%tid.x`` each register depends on (an over-approximation: every operation joins the bits of
    its operands, data loaded from shared memory or another lane depends on them all), so that an access whose
    address depends on k of them touches at most 2**k distinct addresses per program. A register that is tid's bits
    moved by constant ``shl`` / ``shr`` / ``bfe`` / ``and`` keeps its shift (bit j is tid's bit j - shift), so a
    guard ``(tid & mask) == 0`` (Triton's one writer among threads that hold the same value) is known to keep only
    the threads whose bits of the mask are 0; ``and.pred`` joins the kept bits of its two guards."""

    def __init__(self, ptx: str) -> None:
        threads = _THREADS.search(ptx)
        self.all = frozenset(range((int(threads.group(1)) - 1).bit_length())) if threads else frozenset(range(10))
        self.depends: dict[str, frozenset] = {}
        self.shift: dict[str, int] = {}
        self.zero: dict[str, frozenset] = {}  # predicate -> tid bits that are 0 where it holds

    def _moved(self, family: str, source: str, constants: list[int | None]) -> tuple[frozenset, int] | None:
        """(bits, shift) of a constant shift / field / mask of a pure tid register, else None."""
        if source not in self.shift or None in constants or not constants:
            return None
        bits, shift = self.depends[source], self.shift[source]
        if family == "shl":
            return bits, shift + constants[0]
        if family == "shr":
            return frozenset(b for b in bits if b + shift >= constants[0]), shift - constants[0]
        if family == "bfe" and len(constants) == 2:
            low, high = constants[0], constants[0] + constants[1]
            return frozenset(b for b in bits if low <= b + shift < high), shift - constants[0]
        if family == "and":
            return frozenset(b for b in bits if constants[0] >> (b + shift) & 1), shift
        return None

    def step(self, opcode: str, operands: list[str]) -> None:
        """Follow one instruction (not a store)."""
        family, space = opcode.split(".")[0], (opcode.split(".") + [""])[1]
        destinations = _REGISTER.findall(operands[0])
        registers = [r for op in operands[1:] for r in _REGISTER.findall(op)]
        joined = frozenset().union(*(self.depends.get(r, frozenset()) for r in registers))
        moved, shift = None, None
        if family == "mov" and operands[1:] == ["%tid.x"]:
            moved, shift = self.all, 0
        elif family == "mov" and operands[1:] == ["%laneid"]:
            moved, shift = self.all & frozenset(range(5)), 0
        elif family == "mov" and len(operands) > 1 and operands[1].startswith(("%tid", "%warpid", "%ntid")):
            joined = self.all  # (the kernels are 1-D: any other thread coordinate, taken as every bit)
        elif family == "cvt" and registers and registers[0] in self.shift:
            moved, shift = self.depends[registers[0]], self.shift[registers[0]]
        elif family in ("shl", "shr", "bfe", "and") and registers:
            pure = self._moved(family, registers[0], [_immediate(op) for op in operands[2:]])
            if pure is not None:
                moved, shift = pure
        elif (family == "ld" and space in ("shared", "local")) or family == "shfl":
            joined = self.all  # data other threads wrote
        for register in destinations:
            self.depends[register] = moved if moved is not None else joined
            self.shift.pop(register, None)
            if shift is not None:
                self.shift[register] = shift
            if opcode.startswith("setp.eq") and len(registers) == 1 and registers[0] in self.shift:
                self.zero[register] = self.depends[registers[0]] if _immediate(operands[2]) == 0 else frozenset()
            elif opcode == "and.pred":
                self.zero[register] = frozenset().union(*(self.zero.get(r, frozenset()) for r in registers))
            else:
                self.zero.pop(register, None)

    def threads(self, line: str, address: str) -> int:
        """Distinct addresses per program (at most) of the access on ``line``."""
        guard = _GUARD.match(line)
        kept = self.zero.get(guard.group(2), frozenset()) if guard and not guard.group(1) else frozenset()
        bits = frozenset().union(*(self.depends.get(r, frozenset()) for r in _REGISTER.findall(address)))
        return 2 ** len(bits - kept)


def global_accesses(ptx: str) -> tuple[list[dict], dict[int, str]]:
    """The global memory accesses of a one-kernel PTX module, and its pointer parameters (index -> name).

    Each access: ``{"op": 'ld' / 'st' / 'atom' / 'red', "bytes": per thread, "params": [pointer parameter indices
    its address derives from], "threads": distinct addresses per program at most (:class:`_ThreadBits`), "in_loop":
    bool, "line": the instruction}``. Addresses are followed through every instruction from ``ld.param``; a value
    loaded from memory carries no pointer (data, e.g. a code used as an index, does not make a gather an access of
    the tensor it came from).
    """
    lines = ptx.splitlines()
    pointers = {}
    for line in lines:
        match = _PARAM.match(line)
        if match and match.group(2):
            pointers[match.group(3)] = int(match.group(4))
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := _LABEL.match(line))}
    loops = []
    for i, line in enumerate(lines):
        match = _BRANCH.search(line)
        if match and labels.get(match.group(1), i + 1) <= i:  # a branch back: the lines between form a loop
            loops.append((labels[match.group(1)], i))
    taint: dict[str, frozenset] = {}
    thread_bits = _ThreadBits(ptx)
    accesses: dict[int, dict] = {}
    instructions = []  # (line number, opcode, operands), parsed once
    for i, line in enumerate(lines):
        match = _INSTRUCTION.match(line)
        if match and not match.group(1).startswith("."):
            instructions.append((i, match.group(1), _operands(match.group(2))))
    for _ in range(3):  # registers carried around a loop are defined after their use: walk to a fixed point
        for i, opcode, operands in instructions:
            line = lines[i]
            family, space = opcode.split(".")[0], (opcode.split(".") + [""])[1]
            if family == "ld" and space == "param":
                param = re.search(r"\[\s*(\w+)", operands[1]).group(1)
                value = frozenset({pointers[param]}) if param in pointers else frozenset()
                for register in _REGISTER.findall(operands[0]):
                    taint[register] = value
                continue
            address = next((op for op in operands if op.startswith("[")), None)
            if family in ("ld", "st", "atom", "red") and space == "global":
                params = frozenset().union(*(taint.get(r, frozenset()) for r in _REGISTER.findall(address)))
                accesses[i] = {
                    "op": family,
                    "bytes": _access_bytes(opcode),
                    "params": sorted(params),
                    "threads": thread_bits.threads(line, address),
                    "in_loop": any(start <= i <= end for start, end in loops),
                    "line": line.strip(),
                }
            if family in ("st", "red", "bra", "bar", "ret", "membar", "fence") or not operands:
                continue
            thread_bits.step(opcode, operands)
            destinations = _REGISTER.findall(operands[0])
            if family in ("ld", "atom", "shfl"):
                value = frozenset()  # data read from memory or from another thread
            else:
                sources = [r for op in operands[1:] for r in _REGISTER.findall(op)]
                value = frozenset().union(*(taint.get(r, frozenset()) for r in sources))
            for register in destinations:
                taint[register] = value
    return [accesses[i] for i in sorted(accesses)], {index: name for name, index in pointers.items()}


def _bind(fn, backend, launch):
    """(signature, constexprs, attrs, options) of ``launch`` exactly as Triton's launcher binds them."""
    from triton.runtime.jit import create_function_from_signature

    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.options)
    return fn._pack_args(backend, launch.options, bound, specialization, options)


def launches() -> list[tuple[str, str, str, int, object]]:
    """Every Triton launch of the runtime: (module of its kernel, traffic kernel, dtype, bits, launch), from the
    launchers of the few-bit op and of the group quantizer (at the runtime's default group size)."""
    from fewbit_design.runtime.fewbit import triton_launch
    from fewbit_design.runtime.linear import quant, triton_quant

    return [
        *(("fewbit_design.runtime.fewbit._triton_kernels", *entry) for entry in triton_launch.triton_launches()),
        *(
            ("fewbit_design.runtime.linear._triton_quant", *entry)
            for entry in triton_quant.triton_launches(quant.GROUP_SIZE)
        ),
    ]


def _variants(arch: int, backend) -> list[tuple[dict, object, tuple]]:
    """(record, kernel, bound arguments) of every compiled variant for ``arch`` (float16 and bfloat16 launches
    share theirs: one record lists both dtypes)."""
    variants: dict[str, tuple[dict, object, tuple]] = {}
    for module, traffic, dtype, bits, launch in launches():
        fn = getattr(importlib.import_module(module), launch.kernel)
        bound = _bind(fn, backend, launch)
        _, signature, constexprs, attrs = bound
        key = repr((launch.kernel, signature, constexprs, attrs))
        if key in variants:
            variants[key][0]["dtypes"].append(dtype)
            continue
        record = {"kernel": launch.kernel, "traffic": traffic, "dtypes": [dtype], "bits": bits, "arch": arch}
        # the kernel's arguments in PTX order (constexprs are compiled in, not passed)
        arguments = [name for name, kind in signature.items() if kind != "constexpr"]
        record.update(tensors=launch.tensors, arguments=arguments, options=dict(launch.options))
        variants[key] = (record, fn, bound)
    return list(variants.values())


def _compile(record: dict, fn, bound: tuple, target) -> None:
    """Compile one variant for ``target`` and add its PTX's accesses and ptxas' report (or the error) to record."""
    import triton
    from triton.compiler import ASTSource

    options, signature, constexprs, attrs = bound
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log):
            source = ASTSource(fn, signature, constexprs, attrs)
            compiled = triton.compile(source, target=target, options=options.__dict__)
    except Exception as error:  # noqa: BLE001 - every failure is reported, with its message
        record["error"] = f"{type(error).__name__}: {error}"[:2000]
        return
    ptx = compiled.asm["ptx"]
    accesses, _ = global_accesses(ptx)
    spills = _SPILLS.search(log.getvalue())
    registers = _REGISTERS.search(log.getvalue())
    record.update(
        error=None,
        cubin_bytes=len(compiled.asm["cubin"]),
        local_memory=bool(re.search(r"\.local\b|__local_depot", ptx)),
        stack_spills=[int(v) for v in spills.groups()] if spills else None,
        registers=int(registers.group(1)) if registers else None,
        num_warps=compiled.metadata.num_warps,
        accesses=accesses,
    )


def _compile_part(task: tuple[int, int, int]) -> list[dict]:
    """The records of part ``part`` of ``parts`` of the variants for ``arch`` (every parts-th one)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    arch, part, parts = task
    target = GPUTarget("cuda", arch, 32)
    records = []
    for record, fn, bound in _variants(arch, make_backend(target))[part::parts]:
        _compile(record, fn, bound, target)
        records.append(record)
    return records


def main(argv: list[str]) -> None:
    out = argv[0]
    archs = [int(a) for a in argv[1:]] or list(ARCHS)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v: registers, stack frame, spill stores and loads
    workers = max(1, os.cpu_count() or 1)
    # every target's variants in `workers` parts, so that the processes finish together
    tasks = [(arch, part, workers) for arch in archs for part in range(workers)]
    with ProcessPoolExecutor(min(workers, len(tasks))) as pool:
        results = [record for records in pool.map(_compile_part, tasks) for record in records]
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1:])
