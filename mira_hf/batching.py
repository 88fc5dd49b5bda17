"""Batch-aware use estimates: how likely each expert is to be needed by the next forward step of a batch.

One token routes to K experts; a step of B tokens (continuous batching: one new token per running
sequence, plus prompt chunks) needs the *union* of their experts, and at B = 16-64 that union is
nearly every expert of a layer. What the cache should keep is then not "was it used last step" (at
batch 32 every expert was) but how likely it is to be in the next step's union, which depends on
how many of the batch's tokens route to it and on how many tokens the next step carries:

    P(expert e used by a step of B tokens) = 1 - (1 - s_e)^B

where s_e is e's per-token share (rows routed to e / tokens, an EMA over steps). `BatchUsage`
keeps s_e from each block's routing counts (one bincount per MoE layer and one device-to-host copy
per step, only on steps with more than one token) and, after such a step, writes these
probabilities into the heat tracker's use rates, which the heat policy ranks evictions by
(`ExpectedDistance.keep_values`: 1 / expected layers to the next use). While no predictor runs, they
also stage: after a block, the experts at least `stage_probability` likely of the next blocks (two by default,
on into the next step) are copied ahead of their routers (`guesses_after`), as a predictor's guesses are. At one
token per step s_e is exactly the tracker's own EMA of "used this step" and nothing is staged, so single-sequence
decoding is unchanged.

Token-block grouping (computing a batch in groups of tokens that route alike) does not apply to
these proxies: each block call already groups its rows by expert and loads each needed expert once,
computing all its rows in one matmul; splitting the batch would load some experts twice and change
the number of rows per matmul (which may change the last bits), so it is not done.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping, Sequence

import numpy as np
import torch

SHARE_DECAY = 0.9  # weight of the past in the per-token share EMA: the heat tracker's use-rate decay (~10 steps)
# The next step's tokens are taken as the median of the latest steps': continuous batching mixes decode steps (one
# token per running sequence) with the odd prompt chunk of thousands of tokens, which a mean would follow.
BATCH_WINDOW_STEPS = 16


class BatchUsage:
    """Per-token routing share of every expert, and its projection to a step of `batch_tokens` tokens.

    Off unless turned on (`enable`; the server and `replay(concurrency > 1)` do): the manager then calls
    `observe` once per block (its `begin`) and `end_step` once per forward step."""

    def __init__(self, num_experts: Mapping[int, int]) -> None:
        self.num_experts = dict(num_experts)
        self.share = {layer: np.zeros(n, np.float32) for layer, n in self.num_experts.items()}  # EMA of rows / tokens
        self.batch_tokens = 1  # tokens expected in the next step: median of the latest steps' (largest block of each)
        self._recent = deque(maxlen=BATCH_WINDOW_STEPS)
        self._step: dict[int, tuple[Sequence[int], torch.Tensor | None, int]] = {}  # layer -> (experts, index, T)
        self._order = sorted(self.share)  # MoE layers in the order their blocks run
        # How well the estimate guessed, over the blocks of steps it was made for (batch_tokens > 1): the experts it
        # expected each block to use (the sum of their union probabilities) and the distinct experts the block used.
        self._expected: dict[int, float] = {}  # layer -> experts the estimate written for the next step expects
        self.reset_check()

    def observe(self, layer: int, experts: Sequence[int], top_k_index: torch.Tensor | None) -> None:
        """A block of `layer` routed its tokens to `experts` (distinct); `top_k_index` [T, K] (on any device) gives the
        rows per expert when T > 1. Nothing is read from the device here."""
        tokens = 1 if top_k_index is None or top_k_index.dim() != 2 else top_k_index.shape[0]
        self._step[layer] = (experts, top_k_index if tokens > 1 else None, tokens)

    def end_step(self, use_rate: Mapping[int, np.ndarray]) -> None:
        """A forward step ended: update the shares from its blocks and the expected tokens of the next step; when that
        is more than one, overwrite `use_rate` (the heat tracker's, in place) with each expert's probability of being
        used by a step of that many tokens. At one token `use_rate` is left as the tracker made it (the same estimate)."""
        if not self._step:
            return
        step, self._step = self._step, {}
        for layer, (experts, _, _) in step.items():  # the estimate made for this step (none at one token per step)
            if layer in self._expected:
                self.expected_union += self._expected[layer]
                self.observed_union += len(experts)
                self.blocks_checked += 1
        self._expected.clear()
        rows = self._rows(step)
        tokens = max(t for _, _, t in step.values())
        for layer, (experts, _, t) in step.items():
            s = self.share[layer]
            s *= np.float32(SHARE_DECAY)
            if layer in rows:
                s += np.float32(1 - SHARE_DECAY) * rows[layer] / np.float32(t)
            else:  # one token: each distinct expert has one row
                s[list(experts)] += np.float32(1 - SHARE_DECAY)
        self._recent.append(tokens)
        self.batch_tokens = int(statistics.median_low(self._recent))
        if self.batch_tokens > 1:
            for layer in self.share:
                use_rate[layer][:] = self.union_probability(layer)
                self._expected[layer] = float(use_rate[layer].sum())

    def union_probability(self, layer: int, batch_tokens: int | None = None) -> np.ndarray:
        """[E] probability that a step of `batch_tokens` tokens (default: the latest step's) uses each expert of
        `layer`: 1 - (1 - share)^B."""
        b = self.batch_tokens if batch_tokens is None else batch_tokens
        s = np.clip(self.share[layer], 0.0, 1.0)
        return (1.0 - np.power(1.0 - s, np.float32(b))).astype(np.float32)

    def expected_uses(self, layer: int, batch_tokens: int | None = None) -> np.ndarray:
        """[E] rows a step of `batch_tokens` tokens is expected to route to each expert of `layer`: share × B."""
        b = self.batch_tokens if batch_tokens is None else batch_tokens
        return self.share[layer] * np.float32(b)

    def guesses_after(self, layer: int, blocks: int) -> list[tuple[int, list[int], list[float]]]:
        """For staging while no predictor runs: `guess` for each of the next `blocks` MoE blocks after `layer`'s,
        nearest first, in layer order and on into the next step (after the last layer comes the first); empty when
        steps carry one token (the predictor's business then)."""
        if self.batch_tokens <= 1 or layer not in self.share:
            return []
        order = self._order
        at = order.index(layer)
        targets = (order[(at + d) % len(order)] for d in range(1, min(blocks, len(order)) + 1))
        return [guess for target in targets if (guess := self.guess(target))]

    def guess(self, target: int) -> tuple[int, list[int], list[float]] | None:
        """`(target, its experts most likely first, their probabilities of being used by its next block)`, or None
        when steps carry one token or `target` is not a MoE layer."""
        if self.batch_tokens <= 1 or target not in self.share:
            return None
        values = self.union_probability(target).tolist()
        return target, sorted(range(len(values)), key=lambda e: -values[e]), values

    def union_check(self) -> dict:
        """`{"blocks", "expected", "observed"}`: per block of the steps the estimate was made for, the experts it
        expected the block to use and the distinct experts the block used (means; None before any such step)."""
        n = self.blocks_checked
        return dict(
            blocks=n,
            expected=self.expected_union / n if n else None,
            observed=self.observed_union / n if n else None,
        )

    def reset_check(self) -> None:
        """Zero `union_check`'s counters (the manager's `reset_stats`)."""
        self.expected_union = self.observed_union = 0.0
        self.blocks_checked = 0

    def reset(self) -> None:
        for s in self.share.values():
            s[:] = 0
        self.reset_check()
        self._expected.clear()
        self.batch_tokens = 1
        self._recent.clear()
        self._step.clear()

    def _rows(self, step: dict) -> dict[int, np.ndarray]:
        """Rows per expert of each multi-token block of the step: one bincount per block, one copy to the host.
        Indices are shifted by one so padding (-1) and the expert-parallel sentinel (E) fall outside 0..E-1."""
        multi = [(layer, index) for layer, (_, index, _) in step.items() if index is not None]
        if not multi:
            return {}
        counts = [
            torch.bincount(index.reshape(-1).long() + 1, minlength=self.num_experts[layer] + 2)[1 : self.num_experts[layer] + 1]
            for layer, index in multi
        ]
        flat = torch.cat(counts).cpu().numpy().astype(np.float32)  # one sync per step
        out, at = {}, 0
        for layer, _ in multi:
            n = self.num_experts[layer]
            out[layer] = flat[at : at + n]
            at += n
        return out


def enable(manager) -> BatchUsage:
    """Turn batch-aware use estimates on for an `ExpertManager` (idempotent); returns its `BatchUsage`."""
    if getattr(manager, "batch", None) is None:
        manager.batch = BatchUsage({layer: info.num_experts for layer, info in manager.layers.items()})
    return manager.batch
