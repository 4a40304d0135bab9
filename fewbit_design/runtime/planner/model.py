"""The planner's cost model and optimiser: pure Python on measured numbers, it never runs a model.

Terms. The *chain* is the model's ``nn.Sequential`` or ``nn.ModuleList`` of blocks: block i maps the hidden state
x_i to x_{i+1}. Each block has *options* (plain, few-bit, BLPA, offload, checkpoint, and their combinations), each
measured alone (:class:`OptionCost`). Bytes are relative to the live bytes when the chain starts (``entry_bytes``
above the step's start: what the model computed before the chain, x_0 included).

A block under option o: its forward peaks ``forward_peak`` above its start (output included), then leaves
``kept`` bytes alive besides its output (what it holds for backward; a checkpointed block: nothing); it keeps its
input x_i alive when ``saves_input`` and its output when ``saves_output``. x_{i+1} stays alive when block i saves it or
block i + 1 saves it (``held``), else it is freed after block i + 1's forward; a held x_{i+1} is freed when the
backward of the last block that saves it is done (block i's when block i saves it, else block i + 1's).
Its backward peaks ``backward_peak`` above the bytes alive when it starts without its incoming gradient (which the
measured peak includes: autograd frees it once used, so it is not alive through the whole backward; for a
checkpointed block the peak includes
re-materialising what its inner option keeps, which is why checkpointing combines with per-block savings: the
inner option's bytes do not count during the forward pass, but they come back during that block's backward).
Then it leaves its parameters' gradients and its input's gradient, and frees what it kept and its incoming
gradient. Gradients of parameters are taken as absent at the start of the step (``zero_grad(set_to_none=True)``).

The whole step: what runs before the chain peaks ``pre_forward_peak`` and leaves ``entry_bytes``; after the chain,
the loss and the modules after it peak ``post_forward_peak`` above the chain's exit and leave ``post_bytes`` more
when the chain's backward starts (the gradient of x_n among them); after the chain's backward, the modules before
it peak at ``pre_backward_peak`` (absolute; the same for every plan, since all the chain holds is freed by then).

The blocks' other arguments (position ids, masks: the tensors a block receives besides its hidden state) are alive
from before the chain; the plain step frees some after the chain's forward (``argument_bytes``, folded into
``post_forward_peak``/``post_bytes``). An option that holds them (a checkpoint, for its recomputation) keeps them
alive until its own backward is done: from the chain's exit to the backward of the lowest-index block that holds them.

The optimiser (:func:`optimise`) is exact: a dynamic program over the blocks, left to right, whose state is the
option of the last block chosen, whether a block so far holds the arguments, and Q_i, the bytes that blocks before
i hold through the whole forward pass; for each state it keeps the Pareto front of (Q_i, time). Every peak event
of the step is Q_i plus terms that depend only on the options of blocks i - 1, i and i + 1 and on that flag
(derived in :func:`_transition`), and Q grows by a term that does not depend on Q, so a state with a larger Q and
no smaller time can never lead to a better plan: pruning it is exact. :func:`replay` simulates the step event by
event; tests check the optimiser against brute force over all option combinations, scored by :func:`replay`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

__all__ = [
    "OptionCost",
    "BlockCosts",
    "ChainCosts",
    "Replay",
    "replay",
    "optimise",
    "minimum_budget",
    "reserved_bytes",
    "pool_bytes",
    "settle_ties",
]

#: states kept per option in the dynamic program; beyond it, Q is bucketed (then exact up to the bucket width)
MAX_FRONT = 4096


@dataclass(frozen=True)
class OptionCost:
    """What one block costs under one option (bytes from ``memory.peak``/``memory.saved_bytes``; seconds of a
    forward + backward of the block alone). ``resident_bytes``: parameters and buffers the option adds to the block
    (a few-bit table's levels and boundaries), alive through the whole step; ``spread``: the timing noise of
    ``seconds`` (half the range of the timed runs; :func:`settle_ties`); ``pool_bytes``: a buffer of a size class
    that the option's region keeps for reuse (offload's staging buffer of packed small tensors), shared by every
    block of the chain under that region, so charged once per step for each distinct size chosen
    (:func:`pool_bytes`), not in ``forward_peak`` or ``kept``. All 0 in plans saved before they existed.
    ``holds_arguments``: the option keeps the block's other arguments (the tensors it receives besides its hidden
    state: position ids, masks) alive until its own backward, as a checkpoint does for its recomputation, so the
    chain's ``argument_bytes`` stay alive after the forward pass (False in plans saved before it existed)."""

    option: str
    forward_peak: int
    kept: int
    backward_peak: int
    saves_input: bool
    saves_output: bool
    seconds: float
    resident_bytes: int = 0
    spread: float = 0.0
    pool_bytes: int = 0
    holds_arguments: bool = False


@dataclass(frozen=True)
class BlockCosts:
    """A block of the chain: its name, hidden-state sizes, parameter-gradient bytes and its options (the first is
    ``plain``)."""

    name: str
    input_bytes: int
    output_bytes: int
    gradient_bytes: int
    options: tuple[OptionCost, ...]

    def option(self, name: str) -> OptionCost:
        for option in self.options:
            if option.option == name:
                return option
        raise KeyError(name)


@dataclass(frozen=True)
class ChainCosts:
    """The chain and the fixed parts of the step around it (see the module docstring). ``argument_bytes``: the
    bytes of the blocks' other arguments (besides the hidden state) that the plain step frees after the chain's
    forward pass (in ``post_forward_peak``/``post_bytes``); an option that ``holds_arguments`` keeps them alive
    until its backward is done (0 in plans saved before it existed)."""

    blocks: tuple[BlockCosts, ...]
    entry_bytes: int = 0
    pre_forward_peak: int = 0
    post_forward_peak: int = 0
    post_bytes: int = 0
    pre_backward_peak: int = 0
    argument_bytes: int = 0


@dataclass
class Replay:
    """The predicted step: ``peak`` (bytes above the step's start), ``seconds`` (sum of the options' block times)
    and the live bytes at every event (``timeline``: (label, bytes))."""

    peak: int
    seconds: float
    timeline: list[tuple[str, int]]


def _held(blocks: Sequence[BlockCosts], choice: Sequence[OptionCost], i: int) -> bool:
    """Whether x_i (0 < i < n) stays alive until the backward pass."""
    return choice[i - 1].saves_output or choice[i].saves_input


def replay(chain: ChainCosts, choice: Sequence[OptionCost]) -> Replay:
    """Simulate one training step with ``choice[i]`` for block i; event by event (the reference the optimiser is
    tested against)."""
    blocks = chain.blocks
    n = len(blocks)
    assert len(choice) == n and n > 0
    timeline: list[tuple[str, int]] = [("before the chain", chain.pre_forward_peak)]
    base = chain.entry_bytes
    live = 0
    for i in range(n):
        timeline.append((f"forward {blocks[i].name}", base + live + choice[i].forward_peak))
        live += choice[i].kept + blocks[i].output_bytes
        if i > 0 and not _held(blocks, choice, i):
            live -= blocks[i].input_bytes
    # the blocks' other arguments, kept by the options that hold them until the last of those (the lowest index)
    # is done with its backward
    holders = [i for i, option in enumerate(choice) if option.holds_arguments]
    if holders:
        live += chain.argument_bytes
    timeline.append(("loss and modules after the chain", base + live + chain.post_forward_peak))
    live += chain.post_bytes
    for i in range(n - 1, -1, -1):
        # the incoming gradient (x_{i+1}'s size) is alive in ``live``; the measured backward peak includes it
        timeline.append((f"backward {blocks[i].name}", base + live - blocks[i].output_bytes + choice[i].backward_peak))
        live += blocks[i].gradient_bytes - choice[i].kept - blocks[i].output_bytes
        if i > 0:
            live += blocks[i].input_bytes  # the gradient of x_i
        # a held hidden state is freed when the backward of the last block that saves it is done: x_{i+1} now when
        # block i saves it; x_i now when block i saves it and block i - 1 does not
        if i + 1 < n and choice[i].saves_output:
            live -= blocks[i].output_bytes
        if i > 0 and choice[i].saves_input and not choice[i - 1].saves_output:
            live -= blocks[i].input_bytes
        if holders and i == holders[0]:
            live -= chain.argument_bytes
    timeline.append(("modules before the chain (backward)", chain.pre_backward_peak))
    resident, pool = reserved_bytes(chain), pool_bytes(choice)
    # the pool exists from the first pack on: not before the chain, at every event after its start (an upper bound
    # for the blocks' forwards before the first block that packs)
    timeline = [(label, value + resident + (pool if k else 0)) for k, (label, value) in enumerate(timeline)]
    return Replay(max(value for _, value in timeline), sum(o.seconds for o in choice), timeline)


def pool_bytes(choice: Sequence[OptionCost]) -> int:
    """Bytes the regions of ``choice`` keep in their pools through the step: one buffer of each distinct
    ``pool_bytes`` (a size class) among the chosen options, since the blocks under a region reuse its buffer.
    Measured: one buffer per size class after a step of packed offload (``tests/runtime/planner``); a write still
    in flight when the next block packs would hold a second one, which this does not count."""
    return sum({o.pool_bytes for o in choice} - {0})


def reserved_bytes(chain: ChainCosts) -> int:
    """Bytes every prediction reserves for what options add to the model (``resident_bytes``: few-bit tables):
    per block, the most any of its options adds. Those bytes are alive at every event of the step, before the
    block that adds them too, so they are a constant of the chain, not a choice: the optimiser stays exact against
    :func:`replay`, and a prediction is above the truth by at most the bytes the unchosen options would add (a few
    KiB; 0 where no option adds any)."""
    return sum(max(o.resident_bytes for o in block.options) for block in chain.blocks)


def _suffix_gradients(blocks: Sequence[BlockCosts]) -> list[int]:
    """suffix[i] = parameter-gradient bytes of blocks i + 1 .. n - 1."""
    suffix = [0] * len(blocks)
    for i in range(len(blocks) - 2, -1, -1):
        suffix[i] = suffix[i + 1] + blocks[i + 1].gradient_bytes
    return suffix


def _transition(
    chain: ChainCosts, suffix: list[int], i: int, a: OptionCost, b: OptionCost, holding: bool
) -> tuple[int, int]:
    """From block i under ``a`` to block i + 1 under ``b``: (the largest event that this step decides, minus Q_i;
    the growth of Q). ``holding``: whether a block <= i holds the chain's arguments.

    Block i's backward starts with Q_i, what block i keeps, x_{i+1} if block i saves it (if only block i + 1 does,
    x_{i+1} was freed with block i + 1's backward), the gradients of blocks > i, the post-chain bytes, the incoming
    gradient (x_{i+1}'s size) and, when ``holding``, the arguments alive; block i + 1's forward starts with Q_i, what
    block i keeps and x_{i+1} alive. (Derived from :func:`replay` by summing its updates; tests check it.)"""
    blocks = chain.blocks
    out = blocks[i].output_bytes
    held = a.saves_output or b.saves_input
    arguments = chain.argument_bytes if holding else 0
    backward = a.kept + (out if a.saves_output else 0) + chain.post_bytes + suffix[i] + a.backward_peak + arguments
    forward = a.kept + out + b.forward_peak
    return max(backward, forward), a.kept + (out if held else 0)


def _terminal(chain: ChainCosts, a: OptionCost, holding: bool) -> int:
    """The events after the last block's forward, minus Q_{n-1}: the post-chain peak and the last block's backward
    (``holding``: whether a block holds the chain's arguments)."""
    exit_bytes = a.kept + chain.blocks[-1].output_bytes + (chain.argument_bytes if holding else 0)
    last = chain.blocks[-1].output_bytes
    return max(exit_bytes + chain.post_forward_peak, exit_bytes + chain.post_bytes - last + a.backward_peak)


#: distinct ``pool_bytes`` values the optimiser enumerates the subsets of (beyond: all of them are charged)
MAX_POOLS = 4


def optimise(chain: ChainCosts, budget: int, allowed: Sequence[Sequence[str]] | None = None) -> list[str] | None:
    """The options (one name per block) of least total time whose predicted peak (:func:`replay`) is at most
    ``budget`` bytes; None when none fits. ``allowed[i]`` restricts block i's options (default: all of them).

    Pools (:func:`pool_bytes`: a constant of the chosen set, not of a block) are exact by enumeration: for each
    set S of distinct pool sizes, the best plan among options whose pool is in S, with S's bytes charged at every
    event after the chain's start; the best over all S (a plan using fewer sizes than S is also found with its own
    set, charged less). More than :data:`MAX_POOLS` sizes: all are charged (an upper bound)."""
    options = _options(chain, allowed)
    sizes = sorted({o.pool_bytes for block in options for o in block} - {0})
    subsets = [()] + [s for r in range(1, len(sizes) + 1) for s in itertools.combinations(sizes, r)]
    if len(sizes) > MAX_POOLS:
        subsets = [tuple(sizes)]
    best = None
    for subset in subsets:
        allowed_here = [[o.option for o in block if o.pool_bytes == 0 or o.pool_bytes in subset] for block in options]
        found = _optimise(chain, budget, allowed_here, sum(subset))
        if found is not None and (best is None or found[0] < best[0]):
            best = found
    return None if best is None else best[1]


def _optimise(
    chain: ChainCosts, budget: int, allowed: Sequence[Sequence[str]], pool: int
) -> tuple[tuple[tuple[float, int], int], list[str]] | None:
    """:func:`optimise` with ``pool`` bytes charged at every event after the chain's start: ((cost, Q), names)."""
    blocks = chain.blocks
    n = len(blocks)
    options = _options(chain, allowed)
    budget -= reserved_bytes(chain)
    if chain.pre_forward_peak > budget or chain.pre_backward_peak + pool > budget:
        return None
    budget -= pool
    limit = budget - chain.entry_bytes
    suffix = _suffix_gradients(blocks)
    # state: (option index of the current block, whether a block so far holds the chain's arguments) -> list of
    # (Q, cost, path); a state's cost is (seconds, techniques): among plans of equal time, the one with fewer
    # techniques
    fronts: dict[tuple[int, bool], list[tuple[int, tuple[float, int], tuple[int, ...]]]] = {}
    for k, option in enumerate(options[0]):
        if option.forward_peak <= limit:
            fronts[(k, option.holds_arguments)] = [(0, (option.seconds, _count(option)), (k,))]
    for i in range(n - 1):
        following: dict[tuple[int, bool], list[tuple[int, tuple[float, int], tuple[int, ...]]]] = {}
        for (k, holding), front in fronts.items():
            a = options[i][k]
            for m, b in enumerate(options[i + 1]):
                event, growth = _transition(chain, suffix, i, a, b, holding)
                for q, (seconds, count), path in front:
                    if q + event <= limit:
                        cost = (seconds + b.seconds, count + _count(b))
                        following.setdefault((m, holding or b.holds_arguments), []).append(
                            (q + growth, cost, path + (m,))
                        )
        fronts = {key: _pareto(front, limit) for key, front in following.items()}
        if not fronts:
            return None
    finals = []
    for (k, holding), front in fronts.items():
        a = options[n - 1][k]
        end = _terminal(chain, a, holding)
        finals += [(cost, q + end, path) for q, cost, path in front if q + end <= limit]
    if not finals:
        return None
    cost, q, path = min(finals, key=lambda item: (item[0], item[1]))
    return (cost, q + pool), [options[i][k].option for i, k in enumerate(path)]


def _count(option: OptionCost) -> int:
    """The number of techniques of an option (``"plain"``: none; names are joined by ``+``)."""
    return 0 if option.option == "plain" else option.option.count("+") + 1


def _pareto(front: list, limit: int) -> list:
    """The states no other state beats in both Q and cost (Q ascending, cost strictly descending)."""
    front.sort(key=lambda item: (item[0], item[1]))
    kept = []
    best = (float("inf"), 0)
    for item in front:
        if item[1] < best:
            kept.append(item)
            best = item[1]
    if len(kept) > MAX_FRONT:  # bucket Q (rounded up, so the plan stays within the budget)
        width = max(1, limit // MAX_FRONT)
        buckets: dict[int, tuple] = {}
        for q, cost, path in kept:
            key = -(-q // width)
            if key not in buckets or cost < buckets[key][1]:
                buckets[key] = (key * width, cost, path)
        kept = sorted(buckets.values(), key=lambda item: (item[0], item[1]))
    return kept


def settle_ties(chain: ChainCosts, rank: Sequence[Sequence[int]] | None = None) -> ChainCosts:
    """``chain`` with timing noise taken out of the decisions: an option whose time is within the noise of options
    ranked before it (two medians differ by at most the sum of their spreads, the noise measured:
    :func:`.profile.timed_options`; options without a spread, such as plans saved before it existed, tie only when
    equal) is charged exactly the largest of those options' charged times, whether it measured faster or slower:
    a tie never makes an option ranked later cheaper than one ranked before it. So an option within the noise of
    plain costs plain's time, and plans that differ only by options tied this way cost the same sum to the last
    bit: with the tie-break of :func:`optimise` (fewer techniques at equal time, then fewer bytes held) the whole
    plan, not only each block's choice, goes to the ranked-first options, whatever the noise. An option measurably
    faster or slower than every option ranked before it keeps its time. ``rank[i][k]`` orders block i's options
    (lower first; default: fewer techniques first; equal ranks by their order in the block). Bytes are unchanged."""
    blocks = []
    for i, block in enumerate(chain.blocks):
        order = sorted(
            range(len(block.options)),
            key=lambda k: (rank[i][k] if rank is not None else _count(block.options[k]), k),
        )
        charged: dict[int, float] = {}
        for position, k in enumerate(order):
            o = block.options[k]
            tied = [j for j in order[:position] if _tie(o, block.options[j])]
            charged[k] = max((charged[j] for j in tied), default=o.seconds)
        options = tuple(replace(o, seconds=charged[k]) for k, o in enumerate(block.options))
        blocks.append(replace(block, options=options))
    return replace(chain, blocks=tuple(blocks))


def _tie(o: OptionCost, p: OptionCost) -> bool:
    """Whether two options' times differ by at most the noise measured (the sum of their spreads)."""
    return abs(o.seconds - p.seconds) <= o.spread + p.spread


def minimum_budget(chain: ChainCosts, allowed: Sequence[Sequence[str]] | None = None) -> int:
    """The smallest budget (bytes) for which :func:`optimise` finds a plan (bisection: feasibility is monotone in
    the budget; the upper end is the peak of the first allowed option of every block, which fits by definition)."""
    first = [next(iter(options)) for options in _options(chain, allowed)]
    high = replay(chain, first).peak
    low = max(chain.pre_forward_peak, chain.pre_backward_peak, chain.entry_bytes) - 1
    while high - low > 1:
        middle = (low + high) // 2
        if optimise(chain, middle, allowed) is None:
            low = middle
        else:
            high = middle
    return high


def _options(chain: ChainCosts, allowed: Sequence[Sequence[str]] | None) -> list[list[OptionCost]]:
    return [
        [o for o in block.options if allowed is None or o.option in allowed[i]] for i, block in enumerate(chain.blocks)
    ]
