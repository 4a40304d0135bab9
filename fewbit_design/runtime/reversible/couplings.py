"""Invertible modules, the additive coupling and the reversible sequence with its autograd function."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...errors import FewBitError, check_positive
from .._torchscript import NotScriptable
from ._autograd import (
    State,
    _add,
    _autocast_context,
    _autocast_state,
    _capture_rng_state,
    _cuda_device_indices,
    _flatten,
    _record_forward,
    _record_reverse,
    _replayed_rng,
    _select,
    _unflatten,
    _vjp,
    frozen_running_stats,
    uses_rng,
)


class InvertibleModule(NotScriptable, nn.Module):
    """A module with ``forward(x)`` and ``inverse(y)``; the base of every block of a :class:`ReversibleSequence`.

    Subclasses implement ``forward`` and ``inverse``. Blocks whose inverse needs something from the forward pass
    (batch statistics, RNG states) override ``_forward_keep`` and ``_inverse_kept``; blocks with a cheaper
    backward than "invert, recompute, vector-Jacobian product" override ``_reverse``.
    """

    def inverse(self, y: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        """Forward (called under ``no_grad``) that also returns the tensors the reversal needs later."""
        return self(x), ()

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        """Inverse using what ``_forward_keep`` returned."""
        return self.inverse(y)

    def _reverse(
        self, y: torch.Tensor, grad_y: torch.Tensor, state: State, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """From the output ``y`` and its gradient, give the input, its gradient and the gradients of ``params``.

        The default reconstructs the input with the inverse, recomputes the forward on it with autograd on, and
        takes one vector-Jacobian product. Only this block's graph is alive at a time.
        """
        with torch.no_grad():
            x = self._inverse_kept(y, state)
        with torch.enable_grad():
            x_leaf = x.detach().requires_grad_(True)
            output = self(x_leaf)
        grads = _vjp(output, [x_leaf, *params], grad_y)
        return x, grads[0], grads[1:]


def _split(x: torch.Tensor, dim: int, owner: str) -> tuple[torch.Tensor, torch.Tensor]:
    if x.dim() <= dim:
        raise FewBitError(f"{owner} splits dimension {dim}, got an input of shape {tuple(x.shape)}")
    size = x.shape[dim]
    if size % 2:
        raise FewBitError(
            f"{owner} splits dimension {dim} into two equal halves, got an input of shape {tuple(x.shape)} "
            f"whose size {size} along it is odd"
        )
    return x.narrow(dim, 0, size // 2), x.narrow(dim, size // 2, size // 2)


class AdditiveCoupling(InvertibleModule):
    """RevNet's reversible block: ``y1 = x1 + h f(x2)``, ``y2 = x2 + h g(y1)``; inverse ``x2 = y2 - h g(y1)``,
    ``x1 = y1 - h f(x2)``, with ``x = cat(x1, x2)`` split in equal halves along ``split_dim`` and the branch scale
    ``h = scale`` (1 by default: RevNet's block).

    ``f`` and ``g`` map a half to a tensor of the same shape; they need not be invertible. When they are
    layer-wise invertible (:class:`InvertibleModule`, e.g. a :class:`ReversibleSequence` of invertible layers, as
    in the hybrid architecture), backward runs them forward without keeping anything and then reconstructs their
    hidden activations layer by layer from their output along the gradient (section 4.4, figure 9); otherwise it
    recomputes them with autograd on (RevNet).

    Args:
        f: the first residual function (of x2).
        g: the second residual function (of y1).
        split_dim: the dimension split in two halves (channels for images).
        scale: the branch scale ``h > 0``, a fixed number: one step of size ``h`` of the flow ``dx/dt = (f, g)``
            (leapfrog form; Haber & Ruthotto 2017, Chang et al. 2018). The architectures set it to
            ``1 / depth`` so that a deep stack of couplings stays as well conditioned as a shallow one (see
            :func:`hybrid_net`). The inverse uses the same ``h``; with ``h = 1`` no multiplication is done.
        preserve_rng_state: replay the RNG of ``f`` and ``g`` in backward; ``None`` (default) does it when they
            contain a random module (see :func:`uses_rng`).

    >>> import torch
    >>> block = AdditiveCoupling(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), split_dim=-1).double()
    >>> x = torch.randn(3, 4, dtype=torch.float64)
    >>> torch.allclose(block.inverse(block(x)), x)
    True
    """

    def __init__(
        self,
        f: nn.Module,
        g: nn.Module,
        *,
        split_dim: int = 1,
        scale: float = 1.0,
        preserve_rng_state: bool | None = None,
    ):
        super().__init__()
        if not isinstance(f, nn.Module) or not isinstance(g, nn.Module):
            raise FewBitError(f"AdditiveCoupling needs two nn.Module, got {type(f).__name__} and {type(g).__name__}")
        self.f = f
        self.g = g
        self.split_dim = int(split_dim)
        self.scale = check_positive("AdditiveCoupling scale", scale)
        self.preserve_rng_state = preserve_rng_state

    def extra_repr(self) -> str:
        return f"split_dim={self.split_dim}" + (f", scale={self.scale:g}" if self.scale != 1.0 else "")

    def _scaled(self, branch_output: torch.Tensor) -> torch.Tensor:
        """``h * branch_output`` (the same expression in forward, inverse and backward, so they agree bitwise)."""
        return branch_output if self.scale == 1.0 else branch_output * self.scale

    def _halves(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dim = self.split_dim if self.split_dim >= 0 else x.dim() + self.split_dim
        return _split(x, dim, type(self).__name__)

    def _cat(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([a, b], dim=self.split_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x1, x2 = self._halves(x)
        y1 = x1 + self._scaled(self.f(x2))
        y2 = x2 + self._scaled(self.g(y1))
        return self._cat(y1, y2)

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        y1, y2 = self._halves(y)
        x2 = y2 - self._scaled(self.g(y1))
        x1 = y1 - self._scaled(self.f(x2))
        return self._cat(x1, x2)

    def _replays(self, module: nn.Module) -> bool:
        return uses_rng(module) if self.preserve_rng_state is None else bool(self.preserve_rng_state)

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        devices = _cuda_device_indices([x.device])
        x1, x2 = self._halves(x)
        f_state = _capture_rng_state(devices) if self._replays(self.f) else ()
        y1 = x1 + self._scaled(self.f(x2))
        g_state = _capture_rng_state(devices) if self._replays(self.g) else ()
        y2 = x2 + self._scaled(self.g(y1))
        return self._cat(y1, y2), (f_state, g_state)

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        f_state, g_state = state
        devices = _cuda_device_indices([y.device])
        y1, y2 = self._halves(y)
        with _replayed_rng(g_state, devices):
            x2 = y2 - self._scaled(self.g(y1))
        with _replayed_rng(f_state, devices):
            x1 = y1 - self._scaled(self.f(x2))
        return self._cat(x1, x2)

    @staticmethod
    def _function_vjp(
        function: nn.Module, z: torch.Tensor, grad: torch.Tensor, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        """``function(z)`` and the vector-Jacobian product of ``grad`` w.r.t. ``z`` and ``params``."""
        if isinstance(function, InvertibleModule):
            # Layer-wise invertible inner function (hybrid): keep nothing but its output, then reconstruct its
            # hidden activations from the output while the gradient flows back through it.
            with torch.no_grad():
                output, state = function._forward_keep(z)
            _, grad_z, grads = function._reverse(output, grad, state, params)
            return output, grad_z, grads
        with torch.enable_grad():
            z_leaf = z.detach().requires_grad_(True)
            output = function(z_leaf)
        grads = _vjp(output, [z_leaf, *params], grad)
        return output.detach(), grads[0], grads[1:]

    def _reverse(
        self, y: torch.Tensor, grad_y: torch.Tensor, state: State, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        # RevNet's algorithm: one recomputation of g and of f, each used both for the inverse and for the
        # vector-Jacobian product. With y1 = x1 + h f(x2), y2 = x2 + h g(y1):
        #   dL/dy1 (total) = dy1 + (dg/dy1)^T (h dy2),   dL/dx1 = dL/dy1 (total),
        #   dL/dx2 = dy2 + (df/dx2)^T (h dL/dy1 (total)).
        f_state, g_state = state
        devices = _cuda_device_indices([y.device])
        y1, y2 = self._halves(y)
        grad_y1, grad_y2 = self._halves(grad_y)
        f_params, g_params = _select(params, self.f), _select(params, self.g)
        with _replayed_rng(g_state, devices):
            g_y1, grad_through_g, g_grads = self._function_vjp(self.g, y1, self._scaled(grad_y2), g_params)
        x2 = y2 - self._scaled(g_y1)
        grad_y1 = _add(grad_y1, grad_through_g)
        with _replayed_rng(f_state, devices):
            f_x2, grad_through_f, f_grads = self._function_vjp(self.f, x2, self._scaled(grad_y1), f_params)
        x1 = y1 - self._scaled(f_x2)
        grad_x2 = _add(grad_y2, grad_through_f)
        by_id: dict[int, torch.Tensor | None] = {}
        for p, grad in [*zip(g_params, g_grads, strict=True), *zip(f_params, f_grads, strict=True)]:
            by_id[id(p)] = _add(by_id.get(id(p)), grad)
        return self._cat(x1, x2), self._cat(grad_y1, grad_x2), [by_id.get(id(p)) for p in params]


class _ReversibleFunction(torch.autograd.Function):
    """Runs a :class:`ReversibleSequence` keeping only its output and per-block state for backward."""

    @staticmethod
    def forward(ctx, sequence: ReversibleSequence, x: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        ctx.sequence = sequence
        ctx.params = params
        ctx.autocast = _autocast_state(x.device.type)
        ctx.input_dtype = x.dtype
        with torch.no_grad():
            y, state = sequence._forward_keep(x)
        if y.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
            y = y.clone()  # a pure reshaping sequence would return a view of its input
        flat: list[torch.Tensor] = []
        ctx.spec = _flatten(state, flat)
        ctx.save_for_backward(y, *flat)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        if torch.is_grad_enabled():  # create_graph=True: refuse now rather than give a graph that is not there
            raise FewBitError(
                "reversible sequences do not support higher-order gradients (backward with create_graph=True): "
                "they rebuild activations from the output in backward; pass reconstruct=False (plain autograd) "
                "for double backward"
            )
        y, *flat = ctx.saved_tensors
        state = _unflatten(ctx.spec, flat)
        with _autocast_context(ctx.autocast):
            _, grad_x, grads = ctx.sequence._reverse(y, grad_y, state, ctx.params)
        if grad_x is not None and ctx.needs_input_grad[1]:
            grad_x = grad_x.to(ctx.input_dtype)
        else:
            grad_x = None
        grads = [None if g is None else g.to(p.dtype) for g, p in zip(grads, ctx.params, strict=True)]
        return (None, grad_x, *grads)


class ReversibleSequence(InvertibleModule):
    """Invertible blocks in sequence, keeping only the output for backward (section 3.4 / 4.3 / 4.4).

    With couplings as blocks it is a RevNet stage; with single invertible layers it is the layer-wise invertible
    sequence of section 4.3; a sequence of layers can also serve as ``f`` or ``g`` of a coupling (hybrid).

    What is saved for backward: the output, plus for each :class:`InvertibleBatchNorm2d` in training mode its
    per-channel batch mean and variance (2 x channels numbers) and, for each random sub-module of a coupling, one
    RNG state (5056 bytes on CPU). Hidden activations are not saved.

    Args:
        *blocks: :class:`InvertibleModule` instances.
        reconstruct: ``False`` runs the blocks with plain autograd, storing every activation (the oracle).

    >>> import torch
    >>> from fewbit_design.runtime.reversible import ChannelPool2d, InvertibleBatchNorm2d, InvertibleLeakyReLU
    >>> seq = ReversibleSequence(InvertibleLeakyReLU(0.5), ChannelPool2d(), InvertibleBatchNorm2d(4))
    >>> x = torch.randn(2, 1, 4, 4, dtype=torch.float64)
    >>> seq.train(False) and torch.allclose(seq.inverse(seq(x)), x)
    True
    """

    def __init__(self, *blocks: nn.Module, reconstruct: bool = True):
        super().__init__()
        for index, block in enumerate(blocks):
            if not isinstance(block, InvertibleModule):
                raise FewBitError(
                    f"ReversibleSequence block {index} must be an invertible module (an InvertibleModule with "
                    f"forward and inverse), got {type(block).__name__}"
                )
        self.blocks = nn.ModuleList(blocks)
        self.reconstruct = bool(reconstruct)

    def extra_repr(self) -> str:
        return f"reconstruct={self.reconstruct}"

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, index: int) -> nn.Module:
        return self.blocks[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.parameters() if p.requires_grad]
        if (
            self.reconstruct
            and torch.is_grad_enabled()
            and len(self.blocks) > 0
            and (x.requires_grad or len(params) > 0)
        ):
            return _ReversibleFunction.apply(self, x, *params)
        for block in self.blocks:
            _record_forward(block, x)
            x = block(x)
        return x

    def inverse(self, y: torch.Tensor) -> torch.Tensor:
        for block in reversed(self.blocks):
            y = block.inverse(y)
        return y

    def _forward_keep(self, x: torch.Tensor) -> tuple[torch.Tensor, State]:
        states = []
        for block in self.blocks:
            _record_forward(block, x)
            x, state = block._forward_keep(x)
            states.append(state)
        return x, tuple(states)

    def _inverse_kept(self, y: torch.Tensor, state: State) -> torch.Tensor:
        for block, block_state in zip(reversed(self.blocks), reversed(state), strict=True):
            y = block._inverse_kept(y, block_state)
        return y

    def _reverse(
        self, y: torch.Tensor, grad_y: torch.Tensor, state: State, params: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor | None]]:
        by_id: dict[int, torch.Tensor | None] = {}
        for block, block_state in zip(reversed(self.blocks), reversed(state), strict=True):
            block_params = _select(params, block)
            with frozen_running_stats(block):
                y, grad_y, grads = block._reverse(y, grad_y, block_state, block_params)
            _record_reverse(block, y)
            for p, grad in zip(block_params, grads, strict=True):
                by_id[id(p)] = _add(by_id.get(id(p)), grad)
            if grad_y is None:  # nothing downstream depends on the input: start a zero gradient
                grad_y = torch.zeros_like(y)
        return y, grad_y, [by_id.get(id(p)) for p in params]
