"""Device copies of the host parts of the experts used most (`MiraConfig(host_compute="split", host_part_cache=...)`).

With the split every use of an expert needs its host part, hits included: computed on the host, or copied across
the link for that use where the host would finish later (`HostCosts.balance`). In a batch or a beam search the
resident experts' uses then wait for the host, and the link carries their parts again and again. A share of the
budget (`BudgetPlan.buffer_bytes["host_parts"]`) holds device copies of the host parts of the experts used most:
their uses need neither.

An entry is filled as a block places its parts (`admit`, most used first): where its part is copied for this use
anyway, if that expert is used more than the entry's least used one; where an entry is free; or where the expert is
used more than `ADMIT_MARGIN` times as often as the least used one (its part then crosses once instead of being
computed on the host). The copy runs on the computing stream, after every earlier read of the entry it replaces.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

Key = tuple[int, int]  # (layer, expert)

ALIGN = 256  # bytes: each tensor of an entry starts so (the device's matmuls read aligned rows)

# An expert whose part the host would compute replaces an entry's only when used this many times as often as the
# entry's least used expert: its part crosses the link once, and equal use rates would trade entries back and forth.
ADMIT_MARGIN = 2.0


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class PartCache:
    """Entries of one size in the device buffer `buffer` (uint8; None or too small: no entries), each holding one
    expert's host part as `parts` (`neuron_split.HostParts`) stores it. `rates(layers, experts)`: how often each of
    those experts is used lately, in one gather (`HeatTracker.use_rates`)."""

    def __init__(
        self,
        buffer: torch.Tensor | None,
        parts,
        layers: Iterable[int],
        rates: Callable[[np.ndarray, np.ndarray], np.ndarray],
    ) -> None:
        self.parts, self.rates, self.buffer = parts, rates, buffer
        # layer -> [(tensor name, its offset in an entry, bytes, shape, dtype)]: one expert's host part as stored
        self._layout: dict[int, list[tuple[str, int, int, tuple[int, ...], torch.dtype]]] = {}
        for layer in layers:
            at, self._layout[layer] = 0, []
            for name, t in parts.tensors[layer].items():
                n = t[0].numel() * t.element_size()
                self._layout[layer].append((name, at, n, tuple(t.shape[1:]), t.dtype))
                at += _aligned(n)
        self.entry_bytes = max((_aligned(o + n) for spec in self._layout.values() for _, o, n, _, _ in spec), default=0)
        n = buffer.numel() // self.entry_bytes if buffer is not None and self.entry_bytes else 0
        self.layer_of = np.full(n, -1, np.intp)  # each entry's expert (layer -1: free)
        self.expert_of = np.zeros(n, np.intp)
        self.index: dict[Key, int] = {}

    def __len__(self) -> int:
        return len(self.layer_of)

    def __contains__(self, key: Key) -> bool:
        return key in self.index

    def views(self, key: Key) -> dict[str, torch.Tensor]:
        """The tensors of `key`'s entry (held: `key in self`), as `HostParts.weights` gives them on the host."""
        start = self.index[key] * self.entry_bytes
        return {
            name: self.buffer[start + at : start + at + n].view(dtype).view(shape)
            for name, at, n, shape, dtype in self._layout[key[0]]
        }

    def admit(self, layer: int, copied: Sequence[int], host: Sequence[int], keep: Iterable[int] = ()) -> list[int]:
        """Of a block's host parts not held, those given an entry now (the caller fills each: `fill`): `copied`, those
        copied for this use anyway, and `host`, those the host would compute. `keep`: experts of the block whose
        entries this block reads, never replaced by it."""
        if not len(self) or not (copied or host):
            return []
        used = self.layer_of >= 0
        held = np.where(used, self.rates(np.where(used, self.layer_of, layer), self.expert_of), -np.inf)  # free: first
        for e in keep:
            held[self.index[(layer, e)]] = np.inf
        block = list(copied) + list(host)
        own = self.rates(np.full(len(block), layer, np.intp), np.asarray(block, np.intp))
        admitted = []
        for j in sorted(range(len(block)), key=lambda j: -own[j]):  # most used first; stable: ties in the block's order
            i = int(held.argmin())
            if held[i] == np.inf:
                break  # every entry is read by this block or was filled by it
            margin = 1.0 if j < len(copied) else ADMIT_MARGIN
            if self.layer_of[i] >= 0:
                if own[j] <= held[i] * margin:
                    continue
                del self.index[(int(self.layer_of[i]), int(self.expert_of[i]))]
            e = block[j]
            self.layer_of[i], self.expert_of[i] = layer, e
            self.index[(layer, e)] = i
            held[i] = np.inf
            admitted.append(e)
        return admitted

    def close(self) -> None:
        """Hold nothing from now on, and let go of the device buffer (the arena is closed or planned anew)."""
        self.buffer = None
        self.layer_of, self.expert_of = self.layer_of[:0], self.expert_of[:0]
        self.index.clear()

    def fill(self, key: Key) -> dict[str, torch.Tensor]:
        """Copy `key`'s host part into its entry (given by `admit`), on the current stream; its tensors there."""
        out = self.views(key)
        for name, t in self.parts.weights(*key).items():
            out[name].copy_(t, non_blocking=True)
        return out
