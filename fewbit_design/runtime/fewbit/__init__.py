"""Few-bit activations: forward exactly as torch, backward from b-bit codes and a design table.

What it owns: :mod:`.nn` (drop-in ``torch.nn`` modules and :class:`~.nn.FewBit` for any activation),
:mod:`.functional` (the ``torch.nn.functional`` forms), :mod:`.convert` (swap a model's activations),
:mod:`.lookup` (the runtime lookup of tables: the shipped set or files), :mod:`.ops` (the autograd function and the
``torch.library`` custom ops) over :mod:`.backends` (the table tensors, the pure-torch reference, the launchers and
the dispatch by device) with its kernels :mod:`._numba_kernels` (CPU) and :mod:`._triton_kernels` (CUDA). Bit
packing is shared with the other techniques (:mod:`fewbit_design.runtime._packing`).

It may import torch, numba and triton (lazily), :mod:`fewbit_design.errors`, :mod:`fewbit_design.table` and
:mod:`fewbit_design.design.activations`. Users reach it through :mod:`fewbit_design.runtime.nn`,
:mod:`fewbit_design.runtime.functional`, ``runtime.convert`` and ``runtime.load_table``.
"""
