"""Heat-score arithmetic (`mira_hf.heat.HeatTracker`) against sequences computed by hand.

The design's rules: +0.1 per activation (at most 1); ×0.95 per idle period; every `window_periods`
periods each expert's window count, divided by the layer's largest, is added with gain 0.1; a staged
expert that was used +0.03, one evicted unused −0.05 (kept in [0, 1]); HOT when the score is ≥ 0.3.
On the step clock a period is one forward step."""

import numpy as np
import pytest

import mira_hf.heat as heat_mod
from mira_hf.errors import ConfigError
from mira_hf.heat import HeatConfig, HeatTracker, UseRates


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
    h = HeatTracker({0: 2, 1: 2}, HeatConfig(use_rate_decay=0.9))
    h.activate(0, [0])
    h.activate(0, [0])  # twice in one step counts once
    h.end_step()
    h.end_step()  # a step that used nothing
    h.activate(0, [1])
    h.end_step()
    # expert 0: 0.1 → 0.09 → 0.081; expert 1: 0 → 0 → 0.1; layer 1 untouched
    assert h.use_rate[0].tolist() == pytest.approx([0.081, 0.1])
    assert h.use_rate[1].tolist() == [0.0, 0.0]
    assert h.use_rate_decays() == {0: 0.9, 1: 0.9}  # a memory given is every layer's


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
        (dict(use_rate_decay=1.0), "use_rate_decay"),
        (dict(use_rate_decay=-0.1), "use_rate_decay"),
    ],
)
def test_heat_config_is_validated(bad, field):
    with pytest.raises(ConfigError, match=field):
        HeatConfig(**bad)


def test_boundary_settings_are_accepted_and_messages_name_the_field():
    for ok in (
        dict(decay_per_period=1.0),
        dict(window_periods=1),
        dict(hot_threshold=0.0),
        dict(hot_threshold=1.0),
        dict(use_rate_decay=0.0),  # no memory: the last step's use
    ):
        HeatConfig(**ok)  # the edges of each range are valid
    with pytest.raises(
        ConfigError, match=r"^HeatConfig\.use_rate_decay=1\.0: must be a number in \[0, 1\), or None \(chosen online\)\.$"
    ):
        HeatConfig(use_rate_decay=1.0)
    with pytest.raises(
        ConfigError, match=r"^HeatConfig\.window_periods=0: must be an int ≥ 1 \(periods per counting window\)\.$"
    ):
        HeatConfig(window_periods=0)
    for bad in (dict(window_periods=2.5), dict(period_s=float("nan")), dict(period_s=0), dict(period_s="1")):
        with pytest.raises(ConfigError, match=rf"^HeatConfig\.{next(iter(bad))}="):
            HeatConfig(**bad)
    for name in ("activation_gain", "window_gain", "used_prefetch_gain", "wasted_prefetch_penalty"):
        for value in (-1.0, float("nan"), 1.5, "0.1"):
            with pytest.raises(ConfigError, match=rf"^HeatConfig\.{name}=.*: must be a number in \[0, 1\]"):
                HeatConfig(**{name: value})
        assert getattr(HeatConfig(**{name: 0.0}), name) == 0.0


def test_tables_have_the_documented_types_and_a_model_without_moe_layers_is_fine():
    h = HeatTracker({0: 3, 2: 5})
    assert h.scores[0].dtype == np.float32 and h.use_rate[2].dtype == np.float32 and h.counts[0].dtype == np.int64
    assert h._window[0].dtype == np.float32 and h._step_active[0].dtype == np.bool_
    empty = HeatTracker({})
    empty.end_step()
    assert empty.layers == [] and empty.use_rates(np.array([], np.intp), np.array([], np.intp)).size == 0


def test_the_threshold_itself_is_hot():
    h = HeatTracker({0: 2}, HeatConfig(activation_gain=0.25, hot_threshold=0.5))
    h.activate(0, [0, 0])  # 0.25 + 0.25 = 0.5 exactly
    h.activate(0, [1])
    assert h.is_hot(0, 0) and not h.is_hot(0, 1)


def test_windows_close_every_window_periods_and_start_empty():
    h = HeatTracker({0: 2, 1: 2})  # layer 1 is never used: its window stays empty (no 0 / 0)
    h.activate(0, [0])  # one activation in the window: the largest count is 1
    for _ in range(5):
        h.end_step()
    # 0.1, idle for periods 2..5: × 0.95^4, then the window closes: + 0.1 · 1/1
    assert scores(h) == pytest.approx([0.1 * 0.95**4 + 0.1, 0.0], rel=1e-6) and scores(h, 1) == [0.0, 0.0]
    h.activate(0, [1])  # period 6, in the second window
    for _ in range(4):
        h.end_step()
    # the second window (periods 6..10) is still open after period 9: expert 1 has only its activation
    assert scores(h)[1] == pytest.approx(0.1 * 0.95**3, rel=1e-6)
    h.end_step()  # it closes: expert 1 had the largest count (1) and gains 0.1; expert 0 (0 of 1) nothing
    assert scores(h) == pytest.approx([(0.1 * 0.95**4 + 0.1) * 0.95**5, 0.1 * 0.95**4 + 0.1], rel=1e-6)
    h.reset()
    h.activate(0, [1])
    for _ in range(4):
        h.end_step()
    assert scores(h)[1] == pytest.approx(0.1 * 0.95**3, rel=1e-6)  # after a reset too, a window is 5 periods
    h.end_step()
    assert scores(h)[1] == pytest.approx(0.1 * 0.95**4 + 0.1, rel=1e-6)


def test_a_window_gain_never_lifts_a_score_above_one():
    h = HeatTracker({0: 2})
    for _ in range(5):
        h.activate(0, [0] * 3)  # at 1.0 from the fourth period on; the window then adds its 0.1
        h.end_step()
    assert h.score(0, 0) == 1.0


def test_a_long_idle_wall_clock_gap_decays_at_most_1000_periods_and_the_clock_keeps_time(monkeypatch):
    now = [1000.0]
    monkeypatch.setattr("mira_hf.heat.time.monotonic", lambda: now[0])
    h = HeatTracker({0: 2}, HeatConfig(clock="wall", period_s=0.125, decay_per_period=0.99, window_gain=0.0))
    h.activate(0, [0])
    now[0] += 625.0  # 5000 periods
    h.activate(0, [1])  # active in the first of them, idle for 999 more
    assert h.score(0, 0) == pytest.approx(0.1 * 0.99**999, rel=1e-4)
    now[0] += 0.0625  # half a period: nothing passes
    h.activate(0, [1])
    assert h.score(0, 0) == pytest.approx(0.1 * 0.99**999, rel=1e-4)
    now[0] += 0.0625  # now a whole one since the last tick
    h.activate(0, [1])
    assert h.score(0, 0) == pytest.approx(0.1 * 0.99**1000, rel=1e-4)


def _use_rates_by_definition(num_experts: dict[int, int], steps: list[dict[int, list[int]]]):
    """HeatConfig.use_rate_decay=None from its definition, one layer and one candidate memory at a time in
    float64: each candidate's moving average p of an expert's per-step use; each step is scored before it
    updates them, by log p for a used expert and log(1 - p) for an unused one (p clipped to [1e-3, 1 - 1e-3]);
    a candidate's running loss is 0.99 × its loss + the step's; the layer uses the candidate of lowest loss
    (the first on a tie). Yields, after each step, {layer: (memory in use, its estimates)}."""
    decays = heat_mod.USE_RATE_DECAYS
    ema = {layer: np.zeros((len(decays), n)) for layer, n in num_experts.items()}
    loss = {layer: np.zeros(len(decays)) for layer in num_experts}
    for step in steps:
        now = {}
        for layer, n in num_experts.items():
            used = np.zeros(n, bool)
            used[step.get(layer, [])] = True
            p = np.clip(ema[layer], 1e-3, 1 - 1e-3)
            loss[layer] = 0.99 * loss[layer] - np.where(used, np.log(p), np.log1p(-p)).sum(axis=1)
            for c, d in enumerate(decays):
                ema[layer][c] = d * ema[layer][c] + (1 - d) * used
            best = int(np.argmin(loss[layer]))
            now[layer] = (decays[best], ema[layer][best].copy())
        yield now


# unequal widths: the shared table pads the narrow layers
_WIDTHS = {0: 12, 3: 5, 7: 9}


def _mixed_trace(num_experts: dict[int, int]) -> list[dict[int, list[int]]]:
    """400 steps of layer 0 churning (a new pair every step), layer 3 sticky (one expert for 25 steps at a
    time) and layer 7 sticky with noise, skipping a step now and then."""
    rng = np.random.default_rng(0)
    steps, sticky = [], {0: [1, 2], 3: [0], 7: [4, 5, 6]}
    for t in range(400):
        step = {}
        for layer, n in num_experts.items():
            if layer == 0:  # churning: a new pair every step
                step[layer] = list(rng.choice(n, 2, replace=False))
            elif layer == 3:  # sticky: one expert for 25 steps at a time
                step[layer] = [(t // 25) % n]
            else:  # sticky with noise, a layer that skips a step now and then
                if rng.random() < 0.1:
                    sticky[7] = list(rng.choice(n, 3, replace=False))
                step[layer] = [] if t % 17 == 0 else sticky[7]
        steps.append(step)
    return steps


def test_use_rates_chosen_online_follow_their_definition_step_by_step_on_layers_of_unequal_width():
    num_experts = _WIDTHS
    steps = _mixed_trace(num_experts)
    tracker = HeatTracker(num_experts, HeatConfig(clock="steps"))
    middle = heat_mod.USE_RATE_DECAYS[len(heat_mod.USE_RATE_DECAYS) // 2]
    assert set(tracker.use_rate_decays().values()) == {middle}  # before any step: the middle memory
    seen = set()
    for t, (step, expected) in enumerate(zip(steps, _use_rates_by_definition(num_experts, steps))):
        for layer, experts in step.items():
            if experts:
                tracker.activate(layer, experts)
        tracker.end_step()
        memories = tracker.use_rate_decays()
        for layer, (memory, rates) in expected.items():
            assert memories[layer] == memory, (t, layer)
            np.testing.assert_allclose(tracker.use_rate[layer], rates, rtol=1e-5, atol=2e-9, err_msg=f"step {t} layer {layer}")
            seen.add((layer, memory))
    assert {m for layer, m in seen if layer == 3} != {m for layer, m in seen if layer == 0}  # the memories differ
    tracker.reset()
    assert all(not tracker.use_rate[layer].any() for layer in num_experts)
    tracker.activate(0, [4])
    tracker.end_step()  # after a reset the losses start again from zero: the same first step as a new tracker
    fresh = HeatTracker(num_experts, HeatConfig(clock="steps"))
    fresh.activate(0, [4])
    fresh.end_step()
    assert tracker.use_rate_decays() == fresh.use_rate_decays()
    assert all(np.array_equal(tracker.use_rate[layer], fresh.use_rate[layer]) for layer in num_experts)


def _active(num_experts: dict[int, int], step: dict[int, list[int]]) -> np.ndarray:
    """One step's use as `UseRates.update` takes it: [layers, widest] bool, the layers in order."""
    active = np.zeros((len(num_experts), max(num_experts.values())), bool)
    for row, layer in enumerate(sorted(num_experts)):
        active[row, step.get(layer, [])] = True
    return active


def test_use_rates_are_float32_moving_averages_bit_for_bit():
    """Each memory d's estimates are float32 moving averages, rounded as float32 arithmetic rounds them: each
    step p ← p · d, then + (1 − d) where used, d and 1 − d in float32, and below 1e-9 flushed to 0. The
    tracker's rates are those of the memory it reports in use, bit for bit (an average kept in float64, or
    with d in float64, and rounded to float32 at the end differs in the last bits)."""
    decays = np.asarray(heat_mod.USE_RATE_DECAYS, np.float32)[:, None]  # [C, 1]
    tracker = HeatTracker(_WIDTHS)
    ema = {layer: np.zeros((len(decays), n), np.float32) for layer, n in _WIDTHS.items()}
    for t, step in enumerate(_mixed_trace(_WIDTHS)):
        for layer, experts in step.items():
            if experts:
                tracker.activate(layer, experts)
        tracker.end_step()
        memories = tracker.use_rate_decays()
        for layer, n in _WIDTHS.items():
            used = np.zeros(n, bool)
            used[step.get(layer, [])] = True
            e = ema[layer]
            e *= decays
            e += (1 - decays) * used
            e[e < np.float32(1e-9)] = 0
            chosen = heat_mod.USE_RATE_DECAYS.index(memories[layer])
            assert np.array_equal(tracker.use_rate[layer], e[chosen]), (t, layer)


def test_a_layers_running_loss_counts_only_its_own_experts():
    """`UseRates.loss[c, row]`, the running log loss that picks a layer's memory: each step 0.99 × its value
    − Σ log p over the used experts − Σ log(1 − p) over the unused ones, p clipped to [1e-3, 1 − 1e-3]. A
    layer narrower than the widest is padded in the table; the padding holds no expert and adds nothing."""
    num_experts = {0: 4, 1: 2}
    rates = UseRates(list(num_experts.values()), heat_mod.USE_RATE_DECAYS)
    out = np.zeros((2, 4), np.float32)
    for _ in range(3):  # idle: every estimate 0, taken as 1e-3
        rates.update(_active(num_experts, {}), out)
    unused = -np.log1p(-1e-3)
    idle = unused * (1 + 0.99 + 0.99**2)
    np.testing.assert_allclose(rates.loss[:, 0], 4 * idle, rtol=1e-6)
    np.testing.assert_allclose(rates.loss[:, 1], 2 * idle, rtol=1e-6)
    rates.update(_active(num_experts, {0: [0]}), out)  # expert 0 used while estimated at 1e-3
    np.testing.assert_allclose(rates.loss[:, 0], 0.99 * 4 * idle - np.log(1e-3) + 3 * unused, rtol=1e-6)
    np.testing.assert_allclose(rates.loss[:, 1], 0.99 * 2 * idle + 2 * unused, rtol=1e-6)


def test_after_a_reset_use_rates_are_new_ones_bit_for_bit():
    """A reset forgets the estimates and the losses: replaying a trace then gives what a new `UseRates` gives."""
    trace = _mixed_trace(_WIDTHS)
    used, fresh = (UseRates(list(_WIDTHS.values()), heat_mod.USE_RATE_DECAYS) for _ in range(2))
    out_used, out_fresh = (np.zeros((3, 12), np.float32) for _ in range(2))
    for step in trace[:200]:
        used.update(_active(_WIDTHS, step), out_used)
    used.reset()
    for step in trace[200:300]:
        used.update(_active(_WIDTHS, step), out_used)
        fresh.update(_active(_WIDTHS, step), out_fresh)
    assert np.array_equal(used.loss, fresh.loss) and np.array_equal(used.ema, fresh.ema)
    assert np.array_equal(used.best, fresh.best) and np.array_equal(out_used, out_fresh)


def test_an_estimate_below_1e_9_is_zero():
    """No float32 denormals: an estimate that decays below 1e-9 becomes 0. A layer that moves on to a new
    expert every two steps keeps the shortest memory, 0.5; expert e, used at steps 2e and 2e + 1 (0.75), has
    been idle 78 − 2e steps after step 79: 0.75 · 2^-(78 − 2e), below 1e-9 from 30 idle steps on (e ≤ 24)."""
    h = HeatTracker({0: 40})
    for t in range(80):
        h.activate(0, [t // 2])
        h.end_step()
    assert h.use_rate_decays() == {0: 0.5}
    rates = h.use_rate[0]
    assert not rates[:25].any()
    assert rates[25:].tolist() == [0.75 * 2.0 ** -(78 - 2 * e) for e in range(25, 40)]


def test_a_prompts_block_moves_use_rates_by_each_experts_share_of_its_tokens():
    # A prompt of 4 tokens: layer 0's experts 0, 1, 2 took 4, 2 and 1 of its rows, layer 1's expert 3 all 4. Each
    # rate moves as 4 decode steps with those shares would in expectation: (1 - 0.9^4) × share from 0.
    h = HeatTracker({0: 4, 1: 4}, HeatConfig(use_rate_decay=0.9))
    h.activate(0, [0, 1, 2], shares=[1.0, 0.5, 0.25], tokens=4)
    h.activate(1, [3], shares=[1.0], tokens=4)
    h.end_step()
    k = 1 - 0.9**4
    assert h.use_rate[0].tolist() == pytest.approx([k, k * 0.5, k * 0.25, 0.0], rel=1e-6)
    assert h.use_rate[1].tolist() == pytest.approx([0.0, 0.0, 0.0, k], rel=1e-6)
    h.activate(0, [3])  # then a decode step, as always
    h.end_step()
    assert h.use_rate[0].tolist() == pytest.approx([0.9 * k, 0.45 * k, 0.225 * k, 0.1], rel=1e-6)
    assert h.use_rate[1].tolist() == pytest.approx([0.0, 0.0, 0.0, 0.9 * k], rel=1e-6)


def test_a_long_prompt_fills_a_use_rate_once_and_the_earlier_rates_keep_a_share():
    # 512 tokens at a memory of 0.9 count as 1 / (1 - 0.9) = 10 steps: 0.9^10 (~1/e) of the earlier rate is left, so
    # what decoding used before the prompt is not forgotten at once when the text turns from read to generated.
    h = HeatTracker({0: 2}, HeatConfig(use_rate_decay=0.9))
    for _ in range(100):  # expert 0 used at every step: its rate ~1
        h.activate(0, [0])
        h.end_step()
    before = h.use_rate[0].tolist()
    h.activate(0, [1], shares=[1.0], tokens=512)
    h.end_step()
    keep = 0.9**10
    assert h.use_rate[0].tolist() == pytest.approx([keep * before[0], (1 - keep) * 1.0], rel=1e-5)


def test_a_prompt_moves_every_memory_by_its_own_decay_and_scores_none():
    h = HeatTracker({0: 3})  # memories chosen online
    for _ in range(5):
        h.activate(0, [0])
        h.end_step()
    rates = h._rates
    loss, best, ema = rates.loss.copy(), rates.best.copy(), rates.ema.copy()
    h.activate(0, [1, 2], shares=[0.75, 0.25], tokens=8)
    h.end_step()
    decays = np.asarray(heat_mod.USE_RATE_DECAYS, np.float32)[:, None]  # [C, 1]
    keep = decays ** np.minimum(8, 1 / (1 - decays))  # 8 steps, or one memory's worth where shorter (0.5: 2, 0.7: 3.3)
    expected = ema[:, 0] * keep + (1 - keep) * np.asarray([0.0, 0.75, 0.25], np.float32)
    expected[expected < heat_mod._TINY] = 0
    np.testing.assert_allclose(rates.ema[:, 0], expected, rtol=1e-6)
    assert np.array_equal(rates.loss, loss) and np.array_equal(rates.best, best)  # a prompt is not a scored step
    assert h.use_rate[0].tolist() == pytest.approx(expected[best[0]].tolist(), rel=1e-6)


@pytest.mark.parametrize(
    ("seed_from_prompt", "sequences", "impl"),
    [(True, 1, "grouped_mm"), (False, 1, "grouped_mm"), (True, 3, "grouped_mm"), (True, 3, "batched_mm")],
)
def test_a_wrapped_models_prompt_moves_the_use_rates_by_its_routing(tiny_checkpoint, seed_from_prompt, sequences, impl):
    import torch

    from mira_hf import MiraConfig, MiraMoEModel

    heat = HeatConfig(use_rate_decay=0.9, seed_from_prompt=seed_from_prompt)
    model = MiraMoEModel.from_pretrained(
        tiny_checkpoint("qwen3_moe"), MiraConfig(gpu_budget=0.5, device="cpu", heat=heat), progress=False
    )
    model.set_experts_implementation(impl)  # the prompt's routing reaches the cache through either path of the proxy
    routed = {}
    model.mira.recorder = lambda layer, hidden, index: routed.__setitem__(layer, index.clone())
    tokens = 12
    ids = torch.randint(3, 128, (sequences, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids)  # no KV cache: this forward starts its sequences, its blocks are their prompts'
    assert routed
    for layer, index in routed.items():
        E = model.mira.heat.use_rate[layer].size
        rows = np.stack([np.bincount(seq.reshape(-1).numpy(), minlength=E) for seq in index.view(sequences, -1)])  # [B, E]
        if not seed_from_prompt:  # one step that used every expert the prompts named
            expected = 0.1 * (rows.sum(0) > 0)
        else:  # as 12 decode steps of one token from each sequence (up to one memory's worth, 10 steps at 0.9): the
            # chance that one of them uses the expert
            expected = (1 - 0.9 ** min(tokens, 10)) * (1 - np.prod(1 - rows / tokens, axis=0))
        np.testing.assert_allclose(model.mira.heat.use_rate[layer], expected, rtol=1e-5, atol=1e-7)


def test_the_step_hooks_count_the_sequences_a_forward_holds():
    import torch

    from mira_hf.step_hooks import _sequences

    ids, embeds = torch.zeros(3, 7, dtype=torch.long), torch.zeros(2, 5, 8)
    assert _sequences((ids,), {}) == 3  # model(ids)
    assert _sequences((), {"input_ids": ids}) == 3  # generate's forwards
    assert _sequences((), {"input_ids": None, "inputs_embeds": embeds}) == 2  # embeddings given instead (VLMs)
    assert _sequences((torch.zeros(7, dtype=torch.long),), {}) == 1  # one unbatched sequence
    assert _sequences((), {}) == 1
