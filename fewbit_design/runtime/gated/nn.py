"""The gated-MLP module: the linears of an existing gated MLP, run through the op of :mod:`.ops`."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...errors import FewBitError, check_choice
from .._torchscript import NotScriptable
from ..linear.quant import GROUP_SIZE, check_options
from ..modules import class_path
from .compressed import gated_mlp_compressed
from .ops import ACTIVATIONS, gated_mlp
from .recompute import gated_mlp_recompute

__all__ = ["GatedMLP", "Layout", "LAYOUTS", "MODES"]

#: the op's modes: ``exact`` keeps x, gate and up (exact gradients); ``compressed`` keeps K-bit group codes of
#: x, gate and up and recomputes act(gate) and act'(gate) from them (approximate gradients, :mod:`.compressed`);
#: ``recompute`` keeps K-bit group codes of x only and recomputes gate and up from them (two matmuls more in
#: backward; approximate gradients, :mod:`.recompute`)
MODES = ("exact", "compressed", "recompute")


class Layout(NamedTuple):
    """Where a gated MLP keeps its linears: attribute names of the gate, up (None: fused into the gate's linear,
    gate rows first) and down projections."""

    gate: str
    up: str | None
    down: str


#: the attribute layouts recognised (LLaMA / Mistral / Qwen2 / Gemma; T5 v1.1; Mixtral's experts; Phi-3 fused)
LAYOUTS = (
    Layout("gate_proj", "up_proj", "down_proj"),
    Layout("wi_0", "wi_1", "wo"),
    Layout("w1", "w3", "w2"),
    Layout("gate_up_proj", None, "down_proj"),
)


class GatedMLP(NotScriptable, torch.nn.Module):
    """``down(act(gate(x)) * up(x))`` with the gated-MLP op: ``mode="exact"`` saves x, gate and up (exact
    gradients); ``mode="compressed"`` saves ``bits``-bit group codes of x, gate and up (``group_size``, ``rounding``
    as in :func:`fewbit_design.runtime.linear.convert`) and recomputes act(gate) and act'(gate) from gate's codes;
    ``mode="recompute"`` saves ``bits``-bit group codes of x only and recomputes gate and up from them. Both have an
    exact forward and approximate gradients.

    It holds the original module's children under their own names (the same ``nn.Linear`` objects, so parameter
    names, ``state_dict`` keys and optimizer state are unchanged); ``activation`` is one of
    :data:`~.ops.ACTIVATIONS`, ``original`` the replaced class (for reports).

    >>> mlp = GatedMLP({"gate_proj": torch.nn.Linear(4, 8), "up_proj": torch.nn.Linear(4, 8),
    ...                 "down_proj": torch.nn.Linear(8, 4)}, LAYOUTS[0], "silu")
    >>> mlp(torch.randn(2, 3, 4)).shape
    torch.Size([2, 3, 4])

    Args:
        children: the original module's children, by name (the same objects)
        layout: where the gate, up and down linears are (:class:`Layout`)
        activation: one of :data:`~.ops.ACTIVATIONS`
        original: the replaced class's name, for reports
    """

    #: the op computes the activation: the original activation child is kept (names, state) but never called, so
    #: few-bit conversion does not replace it (:func:`~..fewbit.matching.owns_activation`)
    owns_activation = True
    #: it computes with its linear children's weights itself: compressed linear inputs leave them alone
    owns_linears = True

    def __init__(
        self,
        children: dict[str, torch.nn.Module],
        layout: Layout,
        activation: str,
        *,
        original: str = "",
        mode: str = "exact",
        bits: int = 8,
        group_size: int = GROUP_SIZE,
        rounding: str = "stochastic",
    ) -> None:
        super().__init__()
        assert activation in ACTIVATIONS, activation
        self.mode = check_choice("gated MLP mode", mode, MODES)
        self.bits, self.group_size, self.rounding = check_options(bits, group_size, rounding)
        for name, child in children.items():
            self.add_module(name, child)
        self.layout = layout
        self.activation = activation
        self.original = original

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = getattr(self, self.layout.gate)
        up = getattr(self, self.layout.up) if self.layout.up is not None else None
        down = getattr(self, self.layout.down)
        _check_plain(self.layout, gate, up, down)
        arguments = (
            x,
            gate.weight,
            gate.bias,
            None if up is None else up.weight,
            None if up is None else up.bias,
            down.weight,
            down.bias,
            self.activation,
        )
        if self.mode == "exact":
            return gated_mlp(*arguments)
        op = gated_mlp_compressed if self.mode == "compressed" else gated_mlp_recompute
        return op(*arguments, bits=self.bits, group_size=self.group_size, rounding=self.rounding)

    def extra_repr(self) -> str:
        fused = ", fused gate_up" if self.layout.up is None else ""
        if self.mode == "exact":
            return f"activation={self.activation!r}{fused}"
        return (
            f"activation={self.activation!r}{fused}, mode={self.mode!r}, bits={self.bits}, group_size="
            f"{self.group_size}, rounding={self.rounding!r}"
        )


def _check_plain(layout: Layout, *linears: torch.nn.Module | None) -> None:
    """The op computes with the linears' weights itself: a child replaced since conversion (a PEFT adapter layer,
    whose ``weight`` is its base layer's) would be bypassed, its adapters without output or gradient."""
    for name, linear in zip(layout, linears, strict=True):
        if linear is not None and type(linear) is not torch.nn.Linear:
            raise FewBitError(
                f"GatedMLP: {name!r} is now {class_path(type(linear))}, not the torch.nn.Linear it was converted "
                "with (an adapter added after runtime.convert?); the gated-MLP op computes with its weight and would "
                "bypass it: convert after peft.get_peft_model, or runtime.unconvert the model before adding adapters"
            )
