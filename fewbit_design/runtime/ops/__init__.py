"""Ops: one module per op, each with a pure-torch ``*_reference``, a numba CPU kernel and a Triton kernel."""
