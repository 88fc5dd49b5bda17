"""Heat-score arithmetic (`mira_hf.heat.HeatTracker`) against sequences computed by hand.

The design's rules: +0.1 per activation (at most 1); ×0.95 per idle period; every `window_periods`
periods each expert's window count, divided by the layer's largest, is added with gain 0.1; a staged
expert that was used +0.03, one evicted unused −0.05 (kept in [0, 1]); HOT when the score is ≥ 0.3.
On the step clock a period is one forward step."""

import pytest

from mira_hf.errors import ConfigError
from mira_hf.heat import HeatConfig, HeatTracker


def scores(h, layer=0):
    return [h.score(layer, e) for e in range(len(h.scores[layer]))]


def test_activation_decay_and_window_follow_the_hand_computed_sequence():
    h = HeatTracker({0: 4})
    h.activate(0, [0, 1])
    assert scores(h) == pytest.approx([0.1, 0.1, 0.0, 0.0])
    h.end_step()  # period 1: 0 and 1 were active, nothing decays
    assert scores(h) == pytest.approx([0.1, 0.1, 0.0, 0.0])
    for _ in range(4):  # periods 2..5: expert 0 active, expert 1 idle
        h.activate(0, [0])
        h.end_step()
    # expert 0: 0.1 + 4 × 0.1 = 0.5, then the window closes (5 periods): counts [5, 1, 0, 0], largest 5,
    # so + 0.1 × 5/5 → 0.6. Expert 1: 0.1 × 0.95^4 = 0.081450625 (idle in periods 2..5), + 0.1 × 1/5 → 0.101450625.
    assert scores(h) == pytest.approx([0.6, 0.101450625, 0.0, 0.0], rel=1e-6)
    assert [h.is_hot(0, e) for e in range(4)] == [True, False, False, False]  # threshold 0.3
    assert h.counts[0].tolist() == [5, 1, 0, 0]
    h.end_step()  # period 6: the new window is empty; everyone idle decays
    assert scores(h) == pytest.approx([0.57, 0.0963780938, 0.0, 0.0], rel=1e-6)


def test_scores_stay_in_zero_one_and_feedback_moves_them():
    h = HeatTracker({0: 3})
    for _ in range(12):
        h.activate(0, [0])  # twelve activations in one period: capped at 1
    assert h.score(0, 0) == pytest.approx(1.0)
    h.feedback(0, 0, used=True)
    assert h.score(0, 0) == pytest.approx(1.0)  # +0.03 stays at the cap
    h.activate(0, [1])
    h.feedback(0, 1, used=True)  # a staged expert that was used: 0.1 + 0.03
    assert h.score(0, 1) == pytest.approx(0.13)
    h.feedback(0, 1, used=False)  # evicted unused: −0.05
    assert h.score(0, 1) == pytest.approx(0.08)
    h.feedback(0, 2, used=False)  # never below 0
    assert h.score(0, 2) == 0.0


def test_use_rate_is_a_moving_average_of_steps_that_used_the_expert():
    h = HeatTracker({0: 2, 1: 2})
    h.activate(0, [0])
    h.activate(0, [0])  # twice in one step counts once
    h.end_step()
    h.end_step()  # a step that used nothing
    h.activate(0, [1])
    h.end_step()
    # expert 0: 0.1 → 0.09 → 0.081; expert 1: 0 → 0 → 0.1; layer 1 untouched
    assert h.use_rate[0].tolist() == pytest.approx([0.081, 0.1])
    assert h.use_rate[1].tolist() == [0.0, 0.0]


def test_the_wall_clock_counts_periods_of_period_s(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("mira_hf.heat.time.monotonic", lambda: now[0])
    h = HeatTracker({0: 2}, HeatConfig(clock="wall", period_s=0.1))
    h.activate(0, [0, 1])
    now[0] += 0.25  # two whole periods pass before the next activation
    h.activate(0, [0])  # ends those periods first: both experts active in the first, idle in the second
    assert [h.score(0, 0), h.score(0, 1)] == pytest.approx([0.1 * 0.95 + 0.1, 0.1 * 0.95])
    h.end_step()  # on the wall clock a forward step is not a period
    assert [h.score(0, 0), h.score(0, 1)] == pytest.approx([0.195, 0.095])


def test_reset_clears_every_table():
    h = HeatTracker({0: 2})
    h.activate(0, [0, 1])
    h.end_step()
    h.reset()
    assert scores(h) == [0.0, 0.0] and h.counts[0].tolist() == [0, 0] and h.use_rate[0].tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(clock="cpu"), "clock"),
        (dict(decay_per_period=0.0), "decay_per_period"),
        (dict(decay_per_period=1.5), "decay_per_period"),
        (dict(window_periods=0), "window_periods"),
        (dict(period_s=0.0), "period_s"),
        (dict(hot_threshold=1.5), "hot_threshold"),
    ],
)
def test_heat_config_is_validated(bad, field):
    with pytest.raises(ConfigError, match=field):
        HeatConfig(**bad)
