"""`HostSwitch` (`MiraConfig(host_compute="auto")`): host sends are kept for a step width only while steps
that plan them are measured faster than steps that do not. Its schedule and decisions on hand-made step
times; in a model, the steps it turns off plan no host sends."""

import pytest
import torch
from test_host_compute import IDS, _forced, _tiny

from mira_hf.host_compute import HostCompute
from mira_hf.host_switch import HostSwitch


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def run(switch: HostSwitch, clock: Clock, width: int, steps: int, host_s: float, without_s: float) -> list[bool]:
    """`steps` steps of `width`, each taking `host_s` when it plans host sends and `without_s` otherwise;
    returns each step's choice."""
    chosen = []
    for _ in range(steps):
        on = switch.step(width)
        chosen.append(on)
        clock.t += host_s if on else without_s
    return chosen


def test_it_explores_abba_then_keeps_the_faster_choice():
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, recheck_steps=100, clock=clock)
    assert run(s, clock, 1, 12, host_s=0.010, without_s=0.012) == [True] * 2 + [False] * 4 + [True] * 6
    assert s.summary() == {1: {"host_ms": 10.0, "without_ms": 12.0, "host_sends": True}}
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, recheck_steps=100, clock=clock)  # 5% slower with host sends: the whole round
    assert run(s, clock, 1, 12, host_s=0.0105, without_s=0.010) == [True] * 2 + [False] * 4 + [True] * 2 + [False] * 4
    assert s.summary()[1]["host_sends"] is False


def test_host_sends_clearly_slower_stop_the_exploring_early():
    # 20% slower, past stop_margin: once two steps each way are timed, the second window with host sends is left out
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, recheck_steps=100, stop_margin=0.1, clock=clock)
    assert run(s, clock, 1, 12, host_s=0.012, without_s=0.010) == [True] * 2 + [False] * 10
    assert s.summary() == {1: {"host_ms": 12.0, "without_ms": 10.0, "host_sends": False}}
    # where the steps without host sends are timed first (copy waits reported), right after the first window with them
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, recheck_steps=100, stop_margin=0.1, clock=clock)
    chosen = run_waiting(s, clock, 10, host_s=0.012, without_s=0.010, wait_s=0.004)
    assert chosen == [False] * 2 + [True] * 2 + [False] * 6
    # one slow step with host sends (a layer's first host use measures its host times) is not a clear loss
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, recheck_steps=100, stop_margin=0.1, clock=clock)
    chosen, host_times = [], iter([0.030] + [0.009] * 4)
    for _ in range(9):
        on = s.step(1)
        chosen.append(on)
        clock.t += next(host_times) if on else 0.010
    assert chosen == [True] * 2 + [False] * 4 + [True] * 3


def test_a_gain_within_the_margin_keeps_the_exact_path():
    clock = Clock()
    s = HostSwitch(window=1, rounds=1, margin=0.03, clock=clock)
    assert run(s, clock, 1, 6, host_s=0.0098, without_s=0.010) == [True, False, False, True, False, False]
    clock = Clock()
    s = HostSwitch(window=1, rounds=1, margin=0.03, clock=clock)
    assert run(s, clock, 1, 6, host_s=0.0096, without_s=0.010) == [True, False, False, True, True, True]


def test_the_other_choice_is_timed_again_and_the_decision_follows_a_change():
    clock = Clock()
    s = HostSwitch(window=1, rounds=1, recheck_steps=3, history=2, clock=clock)
    # Host sends pay at first: after ABBA (4 steps), 3 steps with them, then one without (the recheck) ...
    assert run(s, clock, 1, 8, host_s=0.010, without_s=0.020) == [True, False, False, True, True, True, True, False]
    # ... then they stop paying (the cache filled, say): the steps with them are timed as they run, and one step
    # of 30 ms makes their median (of the last 2: 10 and 30 ms) no faster than the 20 ms without them. The recheck
    # after 3 more steps times them once more (30 ms: still slower).
    assert run(s, clock, 1, 5, host_s=0.030, without_s=0.020) == [True, False, False, True, False]
    assert s.summary()[1] == {"host_ms": 30.0, "without_ms": 20.0, "host_sends": False}


def test_widths_are_decided_apart_and_prefills_always_plan_host_sends():
    clock = Clock()
    s = HostSwitch(window=1, rounds=1, max_width=16, clock=clock)
    chosen = {1: [], 4: []}
    for _ in range(8):  # batch-1 steps and 4-beam steps interleaved: each step's time counts for its own width
        for width, host_s, without_s in ((1, 0.010, 0.020), (4, 0.030, 0.020)):
            on = s.step(width)
            chosen[width].append(on)
            clock.t += host_s if on else without_s
    assert chosen[1] == [True, False, False, True, True, True, True, True]
    assert chosen[4] == [True, False, False, True, False, False, False, False]
    assert s.step(17) is True and s.step(512) is True  # prefill widths: never switched, never timed
    assert set(s.widths) == {1, 4}


def test_one_long_pause_does_not_flip_a_decision():
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, clock=clock)
    assert run(s, clock, 1, 8, host_s=0.010, without_s=0.020) == [True, True, False, False, False, False, True, True]
    clock.t += 5.0  # the user paused between two generate calls: the step before counts 5 s longer
    assert run(s, clock, 1, 4, host_s=0.010, without_s=0.020) == [True] * 4
    s.forget()
    assert s.widths == {} and s.step(1) is True  # forgotten (the model was moved or cast): exploring again


def run_waiting(switch: HostSwitch, clock: Clock, steps: int, host_s: float, without_s: float, wait_s: float, waited=None):
    """As `run` at width 1, the manager reporting copy waits: `wait_s` in each step without host sends (`waited`:
    the running total, a one-element list, carried between calls)."""
    waited = [0.0] if waited is None else waited
    chosen = []
    for _ in range(steps):
        on = switch.step(1, waited[0])
        chosen.append(on)
        clock.t += host_s if on else without_s
        waited[0] += 0.0 if on else wait_s
    return chosen


def test_steps_that_barely_wait_for_copies_are_never_explored():
    # Host sends save at most a step's copy waits: 0.2 ms of 10 ms is under the 3% margin, so no step plans them,
    # not even at the recheck (every 4 steps here).
    clock = Clock()
    s = HostSwitch(window=2, rounds=1, recheck_steps=4, margin=0.03, clock=clock)
    assert run_waiting(s, clock, 12, host_s=0.005, without_s=0.010, wait_s=0.0002) == [False] * 12
    assert s.summary() == {1: {"host_ms": None, "without_ms": 10.0, "host_sends": False, "stall_ms": 0.2}}


def test_host_sends_are_explored_once_the_steps_wait_for_copies():
    clock, waited = Clock(), [0.0]
    s = HostSwitch(window=1, rounds=1, recheck_steps=100, history=2, margin=0.03, clock=clock)
    assert run_waiting(s, clock, 3, host_s=0.005, without_s=0.010, wait_s=0.0001, waited=waited) == [False] * 3
    # The text moved on and the cache misses: the steps without host sends wait 6 of their 10 ms. Within the
    # history of two steps the median wait passes the margin, and ABBA finds host sends faster.
    chosen = run_waiting(s, clock, 8, host_s=0.005, without_s=0.010, wait_s=0.006, waited=waited)
    assert chosen == [False, True, False, False, True, True, True, True]
    assert s.summary()[1]["host_sends"] is True


def test_bad_settings_say_what_is_allowed():
    with pytest.raises(ValueError, match=r"window=0.*must be at least 1, margin in \[0, 1\)"):
        HostSwitch(window=0)
    with pytest.raises(ValueError, match=r"margin=1.5"):
        HostSwitch(margin=1.5)
    with pytest.raises(ValueError, match=r"stop_margin=0.01.*stop_margin at least margin"):
        HostSwitch(margin=0.03, stop_margin=0.01)


def test_only_auto_switches():
    auto, on = HostCompute("auto"), HostCompute("on")
    try:
        assert isinstance(auto.switch, HostSwitch) and on.switch is None  # "on" plans every miss, as asked
    finally:
        auto.close()
        on.close()


def test_steps_the_switch_turns_off_plan_no_host_sends():
    model = _forced(_tiny(), gpu_budget=0.3)
    m = model.mira
    clock = Clock()
    m.host.switch = HostSwitch(window=1, rounds=1, max_width=4, clock=clock)
    first = min(m.layers)
    steps = []  # per decode step: (the switch's choice, host-computed misses)
    waited = [0.0]  # the copy waits the manager reports, in total: 10 of the 20 ms of a step without host sends
    m.loader.stall_total = lambda: waited[0]

    def recorder(layer, hidden, top_k_index):  # before the switch reads the clock at the step's first block
        if layer == first and hidden.shape[0] == 1:
            steps.append((m.host.sending, m.stats()["host_computed"]))
            clock.t += 0.030 if m.host.sending else 0.020  # the step that ended: host sends made it slower
            waited[0] += 0.0 if m.host.sending else 0.010

    m.recorder = recorder
    with torch.no_grad():
        out = model.generate(IDS, max_new_tokens=9, min_new_tokens=9, do_sample=False)
    assert out.shape[1] == IDS.shape[1] + 9
    steps.append((m.host.sending, m.stats()["host_computed"]))
    # steps[i]: step i's choice and the count after it (step 0: the prompt, at max_width 4 never switched)
    choices = [on for on, _ in steps[1:]]
    sent = [b - a for (_, a), (_, b) in zip(steps, steps[1:])]
    # a window without host sends (its copy waits could pay), ABBA, then the faster: without
    assert choices == [False, True, False, False, True, False, False, False]
    # Steps that plan host sends computed misses there (not every one: a step may hit in every layer); the others none.
    assert sum(n for on, n in zip(choices, sent) if on) > 0 and all(n == 0 for on, n in zip(choices, sent) if not on)
    assert m.host.switch.summary()[1]["host_sends"] is False
