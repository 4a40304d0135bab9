"""Compile every Triton launch of the few-bit runtime for real GPU targets and read its PTX (no GPU needed).

Run as a script (``TRITON_INTERPRET=0``, as test_triton_compile.py does in a subprocess): ``python ptx_check.py
out.json [arch ...]``. For each launch of
:func:`fewbit_design.runtime.fewbit.triton_launch.triton_launches`, the arguments are bound exactly as Triton binds
them at a launch (its own binder: the signature, the constexprs, the 16-byte alignment and divisibility
specialisation), compiled with ``triton.compile`` to a cubin for each target (the Triton wheel ships ptxas), and
the PTX is read: every global access is attributed to the kernel argument its address comes from (a def-use walk
from ``ld.param``), with its width and whether it sits in a loop; ptxas' report gives registers, stack and spills.
The JSON holds one record per (compiled variant, target).

:func:`global_accesses` is the PTX reader, tested on its own in test_triton_compile.py.
"""

from __future__ import annotations

import contextlib
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


def global_accesses(ptx: str) -> tuple[list[dict], dict[int, str]]:
    """The global memory accesses of a one-kernel PTX module, and its pointer parameters (index -> name).

    Each access: ``{"op": 'ld' / 'st' / 'atom' / 'red', "bytes": per thread, "params": [pointer parameter indices
    its address derives from], "in_loop": bool, "line": the instruction}``. Addresses are followed through every
    instruction from ``ld.param``; a value loaded from memory carries no pointer (data, e.g. a code used as an
    index, does not make a gather an access of the tensor it came from).
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
    accesses: dict[int, dict] = {}
    for _ in range(3):  # registers carried around a loop are defined after their use: walk to a fixed point
        for i, line in enumerate(lines):
            match = _INSTRUCTION.match(line)
            if not match or match.group(1).startswith("."):
                continue
            opcode, operands = match.group(1), _operands(match.group(2))
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
                    "in_loop": any(start <= i <= end for start, end in loops),
                    "line": line.strip(),
                }
            if family in ("st", "red", "bra", "bar", "ret", "membar", "fence") or not operands:
                continue
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


def _compile_target(arch: int) -> list[dict]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    from fewbit_design.runtime.fewbit import _triton_kernels as kernels
    from fewbit_design.runtime.fewbit import triton_launch

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    records, seen = [], {}
    for traffic, dtype, bits, launch in triton_launch.triton_launches():
        fn = getattr(kernels, launch.kernel)
        options, signature, constexprs, attrs = _bind(fn, backend, launch)
        key = repr((launch.kernel, signature, constexprs, attrs))
        if key in seen:  # float16 and bfloat16 share a variant
            seen[key]["dtypes"].append(dtype)
            continue
        record = {"kernel": launch.kernel, "traffic": traffic, "dtypes": [dtype], "bits": bits, "arch": arch}
        # the kernel's arguments in PTX order (constexprs are compiled in, not passed)
        arguments = [name for name, kind in signature.items() if kind != "constexpr"]
        record.update(tensors=launch.tensors, arguments=arguments, options=dict(launch.options))
        seen[key] = record
        records.append(record)
        log = io.StringIO()
        try:
            with contextlib.redirect_stdout(log):
                source = ASTSource(fn, signature, constexprs, attrs)
                compiled = triton.compile(source, target=target, options=options.__dict__)
        except Exception as error:  # noqa: BLE001 - every failure is reported, with its message
            record["error"] = f"{type(error).__name__}: {error}"[:2000]
            continue
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
    return records


def main(argv: list[str]) -> None:
    out = argv[0]
    archs = [int(a) for a in argv[1:]] or list(ARCHS)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas -v: registers, stack frame, spill stores and loads
    workers = max(1, min(len(archs), os.cpu_count() or 1))
    with ProcessPoolExecutor(workers) as pool:
        results = [record for records in pool.map(_compile_target, archs) for record in records]
    with open(out, "w", encoding="utf-8") as handle:
        json.dump(results, handle)


if __name__ == "__main__":
    main(sys.argv[1:])
