"""Which saved tensor of the gated MLP's compressed mode dominates the gradient error of one LLaMA step.

One training batch of the byte-level LLaMA of :mod:`transformer_loss` (same corpus, model and sizes); the parameter
gradient of each variant against native's (relative L2 error over all parameters). Each variant turns ONE
approximation on alone (the rest exact): the gated MLPs run a pure-torch autograd function that keeps exact copies
of everything except the named tensors, which go through the project's own quantizers (``linear.quant`` group
codes, the few-bit table kernels), so the figures are those of the modes' parts; "the first version" is the
first compressed mode (K-bit a, up and x, 3-bit few-bit codes of act'(gate)), "now" the shipped
one (K-bit gate, up and x; act and act' recomputed from gate), also run through ``gated.convert`` itself, and the
recompute mode (K-bit x alone; gate and up recomputed from it in backward).
``linear`` compresses the other linear layers' saved inputs (attention projections, the head) with
``linear.convert``.

    python benchmarks/gated_error.py            # K = 8 and 4, seeds 0..2 of the stochastic rounding
    python benchmarks/gated_error.py --quick    # a 2-layer, width-64 model, one seed

Writes ``benchmarks/results/gated_error.csv``.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import real_models  # noqa: E402

from fewbit_design.runtime import gated, linear  # noqa: E402
from fewbit_design.runtime.fewbit.backends import quantize, scale, table_tensors  # noqa: E402
from fewbit_design.runtime.fewbit.lookup import load_table  # noqa: E402
from fewbit_design.runtime.linear.quant import dequantize_groups, quantize_groups  # noqa: E402

GROUP = 64


def _round(t: torch.Tensor, bits: int, stochastic: bool = True) -> torch.Tensor:
    """``t`` through K-bit group codes and back (the linear technique's quantizer)."""
    rows = t.reshape(-1, t.shape[-1])
    seed = int(torch.randint(0, 2**62, ()))
    packed, scales = quantize_groups(rows, bits, GROUP, stochastic=stochastic, seed=seed)
    return dequantize_groups(packed, scales, rows.shape[-1], bits, GROUP, t.dtype).reshape(t.shape)


class _Gated(torch.autograd.Function):
    """SwiGLU ``down(silu(gate) * up)`` whose backward reads the approximations named in ``spec``:
    ``x``/``a``/``up``/``gate`` (K-bit codes; ``gate`` recomputes silu and silu' from the decoded gate),
    ``derivative`` (few-bit table codes of silu'(gate) at ``spec['derivative']`` bits)."""

    @staticmethod
    def forward(ctx, x, w_gate, w_up, w_down, spec):
        gate, up = x @ w_gate.t(), x @ w_up.t()
        a = torch.nn.functional.silu(gate)
        ctx.save_for_backward(x, gate, up, w_gate, w_up, w_down)
        ctx.spec = spec
        return (a * up) @ w_down.t()

    @staticmethod
    def backward(ctx, g):
        x, gate, up, w_gate, w_up, w_down = ctx.saved_tensors
        spec = ctx.spec
        bits = spec["bits"]
        sig = torch.sigmoid(gate)
        a, derivative = gate * sig, sig * (1 + gate * (1 - sig))
        if "gate" in spec["on"]:
            gate_q = _round(gate, bits, spec.get("stochastic", True))
            sig = torch.sigmoid(gate_q)
            a, derivative = gate_q * sig, sig * (1 + gate_q * (1 - sig))
        if "a" in spec["on"]:
            a = _round(a, bits)
        if "up" in spec["on"]:
            up = _round(up, bits)
        if "x" in spec["on"]:
            x = _round(x, bits)
        g2 = g.reshape(-1, g.shape[-1])
        x2, a2, up2 = (t.reshape(-1, t.shape[-1]) for t in (x, a, up))
        grad_h = g2 @ w_down
        grad_up = grad_h * a2
        if "derivative" in spec["on"]:
            tensors = spec["table"]
            gate2 = gate.reshape(-1, gate.shape[-1]).contiguous()
            codes = quantize(gate2, tensors.boundaries32, tensors.interval_codes, tensors.bits)
            grad_gate = scale((grad_h * up2).contiguous(), codes, tensors.levels32, tensors.bits)
        else:
            grad_gate = grad_h * up2 * derivative.reshape(grad_h.shape)
        grad_x = (grad_gate @ w_gate + grad_up @ w_up).reshape(g.shape[:-1] + (w_gate.shape[1],))
        return grad_x, grad_gate.t() @ x2, grad_up.t() @ x2, g2.t() @ (a2 * up2), None


def _patch(model: torch.nn.Module, spec: dict) -> None:
    for module in model.modules():
        if type(module).__name__ == "LlamaMLP":
            module.forward = lambda x, m=module: _Gated.apply(
                x, m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight, spec
            )


VARIANTS = {
    "act' as 3-bit few-bit codes (the first version)": {"on": {"derivative"}, "derivative": 3},
    "act' as K-bit few-bit codes": {"on": {"derivative"}, "derivative": "K"},
    "a = act(gate)": {"on": {"a"}},
    "up": {"on": {"up"}},
    "x (gate/up weight gradients)": {"on": {"x"}},
    "gate, act and act' recomputed (stochastic)": {"on": {"gate"}},
    "gate, act and act' recomputed (nearest)": {"on": {"gate"}, "stochastic": False},
    "linear inputs of attention and head": {"linear": True},
    "first version: a, up, x + 3-bit act'": {"on": {"derivative", "a", "up", "x"}, "derivative": 3},
    "now: gate, up, x": {"on": {"gate", "up", "x"}},
    "now, the shipped op (gated.convert compressed)": {"shipped": True},
    "first version + linear (compressedK before)": {
        "on": {"derivative", "a", "up", "x"},
        "derivative": 3,
        "linear": True,
    },
    "now + linear (compressedK)": {"shipped": True, "linear": True},
    "recompute: x only, gate and up rebuilt (gated.convert recompute)": {"shipped": "recompute"},
    "recompute + linear (compress=K)": {"shipped": "recompute", "linear": True},
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seeds", default="0,1,2", help="seeds of the stochastic rounding")
    harness.add_options(parser, threads=1, out=str(harness.RESULTS / "gated_error.csv"))
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.width, args.seq, args.batch, args.seeds = 2, 64, 32, 4, "0"
        args.out = args.out.replace(".csv", "-quick.csv")
    harness.set_threads(args.threads)
    real_models.transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    data = torch.tensor(list(real_models.corpus(400_000)), dtype=torch.int64)
    window = real_models.batches(data, 1, args.batch, args.seq, seed=0)[0]
    inputs = real_models.model_inputs("llama", window, seed=0)
    torch.manual_seed(0)
    native = real_models.build("llama", args.layers, args.width, args.seq)
    native(**inputs).loss.backward()
    reference = real_models.flat_grad(native)
    native.zero_grad(set_to_none=True)
    rows = []
    for bits in (8, 4):
        for name, variant in VARIANTS.items():
            spec = {"bits": bits, **variant}
            if "derivative" in spec:
                table_bits = bits if spec["derivative"] == "K" else spec["derivative"]
                spec["table"] = table_tensors(load_table("silu", bits=table_bits))
            errors = []
            for seed in [int(s) for s in args.seeds.split(",")]:
                model = copy.deepcopy(native)
                if spec.get("shipped"):
                    mode = spec["shipped"] if isinstance(spec["shipped"], str) else "compressed"
                    model = gated.convert(model, mode=mode, bits=bits)
                elif spec.get("on"):
                    _patch(model, spec)
                if spec.get("linear"):
                    if not spec.get("shipped"):
                        model = gated.convert(model)  # the MLP linears stay out of linear.convert
                        if spec.get("on"):
                            _patch(model, spec)
                    model = linear.convert(model, bits=bits)
                torch.manual_seed(seed)
                model(**inputs).loss.backward()
                approx = real_models.flat_grad(model)
                errors.append(float((approx - reference).norm() / reference.norm()))
            row = {"bits": bits, "variant": name, "grad_rel_error": statistics.fmean(errors),
                   "spread": (max(errors) - min(errors)) / 2, "seeds": len(errors)}  # fmt: skip
            rows.append(row)
            print(f"K={bits} {name:55s} {row['grad_rel_error']:.4f} +- {row['spread']:.4f}", flush=True)
    print(f"wrote {harness.write_csv(args.out, rows)}")


if __name__ == "__main__":
    main()
