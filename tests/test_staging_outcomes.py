"""Staging copies a guess only while guesses like it have been used: the predictor's claim is checked against the
measured use of non-resident guesses of its layer and probability (`mira_hf.staging.CopyOutcomes`)."""

from __future__ import annotations

import pytest
import torch

from mira_hf.replay import replay
from mira_hf.staging import CopyOutcomes
from mira_hf.trace import RoutingTrace

STEPS, EXPERTS = 200, 16


def test_copy_outcomes_start_at_the_claim_and_follow_what_was_used():
    o = CopyOutcomes()
    assert o.probability(1, 0.97) == 0.97  # nothing measured: the guess's own probability
    for _ in range(10):
        o.watch(1, {3: 0.97, 4: 0.5})
        o.scored(1, {4})  # the sure guess is never used, the even one always
    assert o.probability(1, 0.97) == pytest.approx(2 * 0.97 / 12)
    assert o.probability(1, 0.5) == pytest.approx(11 / 12)
    assert o.probability(0, 0.97) == 0.97  # another layer keeps its own counts
    o.scored(1, {3})  # nothing watched for this block: nothing changes
    assert o.probability(1, 0.97) == pytest.approx(2 * 0.97 / 12)


def _layer1(t: int) -> list[int]:
    return [2 + t % 7, 2 + (t + 3) % 7]  # cycles through 7 experts: most guesses are not resident


class Claims:
    """Guesses layer 1 from layer 0 at 0.99: its true experts, plus (`wrong`) one expert it never uses."""

    name = "claims"

    def __init__(self, wrong: bool) -> None:
        self.wrong, self.step = wrong, -1

    def observe(self, layer, hidden, top_k_index) -> None:
        self.step += layer == 0

    def predict(self, layer, hidden):
        if layer != 0:
            return {}
        probs = torch.zeros(EXPERTS)
        probs[_layer1(self.step)] = 0.99
        if self.wrong:
            probs[10 + self.step % 5] = 0.99
        return {1: probs}

    def reset(self) -> None:
        self.step = -1


def _trace() -> RoutingTrace:
    experts = torch.tensor([[[0, 1], _layer1(t)] for t in range(STEPS)])  # [steps, L, K]
    return RoutingTrace(experts, torch.zeros(STEPS, 2, 1), [0], [EXPERTS, EXPERTS], [4096, 4096])


def test_claims_that_hold_are_copied_and_claims_that_fail_stop_being_copied():
    right = replay(_trace(), budget=0.16, policy="heat", predictor_obj=Claims(wrong=False))
    assert right["prefetch_used"] >= STEPS // 2 and right["prefetches"] - right["prefetch_used"] <= 2
    wrong = replay(_trace(), budget=0.16, policy="heat", predictor_obj=Claims(wrong=True))
    # a third of the sure guesses are never used: after the first outcomes, none of that probability is copied
    assert wrong["prefetches"] <= 10 and wrong["precision@1"] == pytest.approx(2 / 3, abs=0.02)
