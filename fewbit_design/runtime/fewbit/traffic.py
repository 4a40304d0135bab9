"""The memory traffic of the few-bit op on CUDA: global bytes per element, against the native torch activation.

An elementwise activation on a GPU is bound by memory bandwidth, so bytes moved per element predict its time. For
an element size ``s`` (4 for float32, 2 for float16 / bfloat16, 8 for float64) and ``b`` bits per code:

* native: forward reads x and writes y (2s); backward reads grad and x, writes grad_x (3s); 5s in all;
* one pass (:mod:`.one_pass`): forward reads x, writes y and the codes (2s + b/8); backward reads grad and the
  codes, writes grad_x (2s + b/8); 4s + b/4 in all;
* two passes (the other activations, float64): torch's op (2s), then the codes kernel (s + b/8); the same
  backward; 5s + b/4 in all.

(One pass at 3 bits: 16.75 / 20 = 0.84x native in float32, 8.75 / 10 = 0.88x in bfloat16.) The table, the
non-finite flag and the launch are a few hundred bytes per call and are left out.

The group quantizer of compressed linear inputs (:mod:`..linear.quant`, also the norms', the gated op's and
attention's codes), group size ``G``: its forward kernel reads x and writes the codes and a float32 (low, step) per
group (s + b/8 + 8/G); its decoder reads the codes and the scales and writes the values (b/8 + 8/G + s). Native
keeps x itself and moves nothing for it, so these 2s + b/4 + 16/G bytes are what compression adds to a step
(:func:`group_traffic`).

:func:`kernel_traffic` gives the bytes of each Triton kernel per tensor; ``tests/runtime/fewbit/
test_triton_compile.py`` checks the compiled PTX of every kernel against it. Times from these bytes are *predicted*
(:func:`predicted_seconds`), not measured.
"""

from __future__ import annotations

from typing import NamedTuple

from ...errors import FewBitError, check_bits, check_choice, check_integer

__all__ = [
    "ELEMENT_SIZES",
    "GROUP_KERNELS",
    "GROUP_SCALE_BYTES",
    "H100_BANDWIDTH",
    "KERNELS",
    "PATHS",
    "KernelTraffic",
    "OpTraffic",
    "kernel_traffic",
    "op_traffic",
    "group_traffic",
    "predicted_seconds",
    "markdown_table",
    "group_markdown_table",
]

#: bytes per element of the dtypes the op takes (torch's names)
ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}
#: HBM bandwidth of an H100 80 GB SXM (NVIDIA's data sheet), bytes per second: the bandwidth of predicted times
H100_BANDWIDTH = 3.35e12
#: the Triton kernels: the forward in one pass (x -> y and codes), the codes pass alone (x -> codes: two-pass
#: forwards, float64), the backward (grad and codes -> grad_x)
KERNELS = ("forward", "codes", "backward")
#: the Triton kernels of the group quantizer: x -> codes and scales ('group_quantize'), codes and scales -> the
#: decoded values y ('group_dequantize'); float32, float16 and bfloat16, 2 to 8 bits
GROUP_KERNELS = ("group_quantize", "group_dequantize")
#: bytes of one group's scales: float32 (low, step)
GROUP_SCALE_BYTES = 8
_GROUP_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_GROUP_SIZE = 64  # linear.quant.GROUP_SIZE (not imported: this module loads nothing of the runtime)
PATHS = ("native", "one_pass", "two_pass")


class KernelTraffic(NamedTuple):
    """Global bytes per element one kernel reads and writes, per tensor."""

    reads: dict[str, float]
    writes: dict[str, float]

    @property
    def total(self) -> float:
        """Bytes per element read and written."""
        return sum(self.reads.values()) + sum(self.writes.values())


class OpTraffic(NamedTuple):
    """Global bytes per element of one activation's forward and backward."""

    forward: float
    backward: float

    @property
    def total(self) -> float:
        """Bytes per element of a training step's forward and backward."""
        return self.forward + self.backward


def _element_size(dtype: str) -> int:
    return ELEMENT_SIZES[check_choice("dtype", dtype, ELEMENT_SIZES)]


def kernel_traffic(kernel: str, dtype: str, bits: int, *, group_size: int = _DEFAULT_GROUP_SIZE) -> KernelTraffic:
    """Bytes per element that a Triton kernel of the few-bit op or of the group quantizer moves, per tensor.

    Args:
        kernel: 'forward' (one pass: reads x, writes y and the codes), 'codes' (reads x, writes the codes),
            'backward' (reads grad and the codes, writes grad_x), 'group_quantize' (reads x, writes the codes and
            the scales) or 'group_dequantize' (reads the codes and the scales, writes y)
        dtype: the element type of x / grad / y ('float32', 'float16', 'bfloat16', or 'float64' for the few-bit
            op's kernels)
        bits: bits per code, 1 to 8 (2 to 8 for the group quantizer)
        group_size: values per group of the group quantizer (its scales are 8 bytes a group)

    >>> kernel_traffic("forward", "float32", 3)
    KernelTraffic(reads={'x': 4}, writes={'y': 4, 'codes': 0.375})
    >>> kernel_traffic("group_quantize", "bfloat16", 4)
    KernelTraffic(reads={'x': 2}, writes={'codes': 0.5, 'scales': 0.125})
    """
    check_choice("kernel", kernel, KERNELS + GROUP_KERNELS)
    if kernel in GROUP_KERNELS:
        return _group_kernel_traffic(kernel, dtype, bits, group_size)
    size = _element_size(dtype)
    codes = check_bits(bits) / 8
    if kernel == "forward":
        return KernelTraffic({"x": size}, {"y": size, "codes": codes})
    if kernel == "codes":
        return KernelTraffic({"x": size}, {"codes": codes})
    return KernelTraffic({"grad": size, "codes": codes}, {"grad_x": size})


def _group_kernel_traffic(kernel: str, dtype: str, bits: int, group_size: int) -> KernelTraffic:
    size = ELEMENT_SIZES[check_choice("dtype of the group quantizer", dtype, _GROUP_DTYPES)]
    codes = check_bits(bits, low=2, high=8) / 8
    scales = GROUP_SCALE_BYTES / check_integer("group_size", group_size, low=1)
    if kernel == "group_quantize":
        return KernelTraffic({"x": size}, {"codes": codes, "scales": scales})
    return KernelTraffic({"codes": codes, "scales": scales}, {"y": size})


def group_traffic(dtype: str, bits: int, group_size: int = _DEFAULT_GROUP_SIZE) -> OpTraffic:
    """Bytes per element the group quantizer adds to a training step on CUDA: its forward kernel (x -> codes and
    scales) and, in the backward, its decoder (-> y, which the backward reads where native reads the saved x).
    Native keeps x and moves nothing for it.

    Args:
        dtype: the element type of x ('float32', 'float16' or 'bfloat16')
        bits: bits per code, 2 to 8
        group_size: values per group

    >>> group_traffic("bfloat16", 8).total
    6.25
    """
    return OpTraffic(
        kernel_traffic("group_quantize", dtype, bits, group_size=group_size).total,
        kernel_traffic("group_dequantize", dtype, bits, group_size=group_size).total,
    )


def op_traffic(path: str, dtype: str, bits: int) -> OpTraffic:
    """Bytes per element of an activation's forward and backward on CUDA.

    Args:
        path: 'native' (torch's op: its backward reads grad and x), 'one_pass' (the few-bit forward kernel) or
            'two_pass' (torch's op, then the codes kernel: activations :mod:`.one_pass` does not serve, float64)
        dtype: the element type ('float32', 'float16', 'bfloat16' or 'float64')
        bits: bits per code, 1 to 8 (ignored for 'native')

    >>> round(op_traffic("one_pass", "float32", 3).total / op_traffic("native", "float32", 3).total, 4)
    0.8375
    """
    check_choice("path", path, PATHS)
    size = _element_size(dtype)
    if path == "native":
        return OpTraffic(2 * size, 3 * size)
    backward = kernel_traffic("backward", dtype, bits).total
    if path == "one_pass":
        return OpTraffic(kernel_traffic("forward", dtype, bits).total, backward)
    return OpTraffic(2 * size + kernel_traffic("codes", dtype, bits).total, backward)


def predicted_seconds(numel: int, bytes_per_element: float, bandwidth: float = H100_BANDWIDTH) -> float:
    """Predicted time of moving ``bytes_per_element`` for ``numel`` elements at ``bandwidth`` bytes per second.

    A lower bound that assumes the kernel reaches the full bandwidth; a prediction, not a measurement.

    Args:
        numel: elements of the activation
        bytes_per_element: global bytes moved per element (e.g. ``op_traffic(...).total``)
        bandwidth: bytes per second (default: :data:`H100_BANDWIDTH`)

    >>> round(predicted_seconds(2**28, 20.0) * 1e3, 3)  # 2^28 float32 native GELU forward + backward, in ms
    1.603
    """
    if bandwidth <= 0:
        raise FewBitError(f"bandwidth must be positive bytes per second, got {bandwidth!r}")
    return numel * bytes_per_element / bandwidth


def markdown_table(numel: int = 2**28, bandwidth: float = H100_BANDWIDTH) -> str:
    """The traffic of one-pass few-bit activations against native, forward + backward, as a Markdown table.

    One row per dtype and bit width (1, 2, 3, 4, 8): bytes per element (forward, backward, total), the ratio to
    native, and the *predicted* time of ``numel`` elements at ``bandwidth`` (docs/cuda.md shows it; a test checks the
    page against this function).

    Args:
        numel: elements of the activation for the predicted times
        bandwidth: bytes per second of the predicted times
    """
    header = (
        "| dtype | bits | forward B/elt | backward B/elt | total B/elt | native B/elt | ratio | "
        "predicted few-bit ms | predicted native ms |"
    )
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for dtype in ("float32", "bfloat16", "float16"):
        native = op_traffic("native", dtype, 1).total
        for bits in (1, 2, 3, 4, 8):
            fewbit = op_traffic("one_pass", dtype, bits)
            predicted = predicted_seconds(numel, fewbit.total, bandwidth) * 1e3
            predicted_native = predicted_seconds(numel, native, bandwidth) * 1e3
            lines.append(
                f"| {dtype} | {bits} | {fewbit.forward:g} | {fewbit.backward:g} | {fewbit.total:g} | {native:g} | "
                f"{fewbit.total / native:.3f} | {predicted:.3f} | {predicted_native:.3f} |"
            )
    return "\n".join(lines)


def group_markdown_table(
    numel: int = 2**28, bandwidth: float = H100_BANDWIDTH, group_size: int = _DEFAULT_GROUP_SIZE
) -> str:
    """The traffic the group quantizer adds to a step, as a Markdown table: one row per dtype and bit width (2, 3,
    4, 8), bytes per element of the forward kernel, the decoder and both, and the *predicted* time of ``numel``
    elements at ``bandwidth`` (docs/cuda.md shows it; a test checks the page against this function).

    Args:
        numel: elements of the input for the predicted times
        bandwidth: bytes per second of the predicted times
        group_size: values per group
    """
    header = "| dtype | bits | quantize B/elt | decode B/elt | total B/elt | predicted ms |"
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for dtype in _GROUP_DTYPES:
        for bits in (2, 3, 4, 8):
            added = group_traffic(dtype, bits, group_size)
            predicted = predicted_seconds(numel, added.total, bandwidth) * 1e3
            lines.append(
                f"| {dtype} | {bits} | {added.forward:g} | {added.backward:g} | {added.total:g} | {predicted:.3f} |"
            )
    return "\n".join(lines)
