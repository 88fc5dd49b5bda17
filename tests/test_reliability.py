"""Failures surface and leave the model usable; concurrency is safe; nothing grows without bound;
nothing is ever unpickled."""

import os
import pathlib
import re
import signal
import threading

import pytest
import torch
from conftest import load_reference
from tiny_models import InterruptAt

from mira_hf import CheckpointError, LoaderError, MiraConfig, MiraMoEModel, UnsupportedModelError

PROMPT = torch.tensor([[5, 9, 14, 33, 7]])
GEN = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)


def _no_pins(model) -> bool:
    return all(s.pins == 0 for pool in model.mira.cache.pools.values() for s in pool.slots)


def _wrapped(path, **kw):
    return MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3, device="cpu", **kw), progress=False)


@pytest.mark.parametrize("at", [1, 2, 3, 5, 8])  # the n-th copy fails: in begin, acquire, release or staging
def test_copy_failure_raises_and_model_stays_usable(tiny_checkpoint, at):
    path = tiny_checkpoint("mixtral")
    expected = load_reference(path).generate(PROMPT, **GEN)
    model = _wrapped(path)
    real_copy = model.mira.loader.copy_split  # every copy goes through it
    calls = {"n": 0}

    def failing_copy(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            raise RuntimeError("injected: bad page in host memory")
        return real_copy(*args, **kwargs)

    model.mira.loader.copy_split = failing_copy
    with pytest.raises(LoaderError, match="injected"):
        model.generate(PROMPT, **GEN)
    assert _no_pins(model) and not model.mira._forward_lock.locked()
    assert model.mira.cache.resident_bytes <= model.mira.budget.budget_bytes
    model.mira.loader.copy_split = real_copy
    assert torch.equal(model.generate(PROMPT, **GEN), expected)  # next call works and is exact


def test_keyboard_interrupt_mid_generate_leaves_cache_consistent(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    expected = load_reference(path).generate(PROMPT, **GEN)
    model = _wrapped(path, policy="heat", predictor="markov")
    with pytest.raises(KeyboardInterrupt):
        model.generate(PROMPT, stopping_criteria=[InterruptAt(4)], **GEN)
    assert _no_pins(model) and not model.mira._forward_lock.locked()
    assert torch.equal(model.generate(PROMPT, **GEN), expected)


@pytest.mark.parametrize("next_call", ["model", "base model"])
def test_keyboard_interrupt_inside_a_forward_leaves_the_model_usable_at_once(tiny_checkpoint, next_call):
    """Ctrl-C while a layer computes (torch skips the forward hooks that end a step on a KeyboardInterrupt): the
    next call of the same thread runs at once and is exact, nothing stays pinned, and the step lock is free after,
    whether that call is of the model or of its base model (whose step is a new one, not part of the interrupted)."""
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    expected = ref.generate(PROMPT, **GEN) if next_call == "model" else ref.model(PROMPT).last_hidden_state
    model = _wrapped(path, policy="heat", predictor="markov")
    calls = {"n": 0}

    def interrupt(module, args):
        calls["n"] += 1
        if calls["n"] == 7:  # a decode step's second MoE layer, after the first has been served
            raise KeyboardInterrupt

    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    hook = experts[1].register_forward_pre_hook(interrupt)
    with pytest.raises(KeyboardInterrupt):
        model.generate(PROMPT, **GEN)
    hook.remove()
    assert _no_pins(model)

    def hung(signum, frame):
        raise TimeoutError("the next call waited for the interrupted step")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(30)  # the next call in the same thread, as a notebook's next cell: a wait fails instead of hanging
    try:
        with torch.no_grad():
            got = model.generate(PROMPT, **GEN) if next_call == "model" else model.model(PROMPT).last_hidden_state
        assert torch.equal(got, expected)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert _no_pins(model) and not model.mira._forward_lock.locked()


def test_a_step_interrupted_in_one_thread_does_not_hold_up_another(tiny_checkpoint):
    """Ctrl-C in a notebook's thread leaves its step open (torch skips the hooks that end it); a call from another
    thread (a web demo's worker) ends that step, whose forward no longer runs, and runs at once, exact, while the
    interrupted thread never calls again."""
    import threading

    path = tiny_checkpoint("mixtral")
    expected = load_reference(path).generate(PROMPT, **GEN)
    model = _wrapped(path, policy="heat", predictor="markov")
    experts = [m for n, m in model.named_modules() if n.endswith("mlp.experts")]
    hook = experts[1].register_forward_pre_hook(lambda module, args: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        model.generate(PROMPT, **GEN)
    hook.remove()
    assert model.mira._forward_lock.locked()  # the interrupted step, still open
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("tokens", model.generate(PROMPT, **GEN)), daemon=True)
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive() and torch.equal(out["tokens"], expected)
    assert _no_pins(model) and not model.mira._forward_lock.locked()
    assert torch.equal(model.generate(PROMPT, **GEN), expected)  # and the interrupted thread's next call too


def test_concurrent_generate_from_two_threads_is_serialised_and_exact(tiny_checkpoint):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    prompts = [torch.tensor([[5, 9, 14, 33, 7]]), torch.tensor([[3, 4, 8, 21, 99]])]
    expected = [ref.generate(p, **GEN) for p in prompts]
    model = _wrapped(path, predictor="gate")
    results, errors = [None, None], []

    def run(i):
        try:
            for _ in range(3):
                results[i] = model.generate(prompts[i], **GEN)
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors
    assert all(torch.equal(r, e) for r, e in zip(results, expected))


def test_the_base_model_called_from_threads_is_serialised_and_exact(tiny_checkpoint):
    """Embedding code calls the base model (`model.model(...)`, `get_decoder()`) or `model.forward(...)` directly:
    each call is a step of its own, serialised across threads as the model's own calls are, and one call of the model
    (which calls its base model) is one step."""
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=1e-6, device="cpu"), progress=False)  # every step copies
    inputs = [
        torch.randint(3, 100, (b, s), generator=torch.Generator().manual_seed(i))
        for i, (b, s) in enumerate([(2, 8), (1, 5), (3, 17)])
    ]
    with torch.no_grad():
        expected = [ref.model(x).last_hidden_state for x in inputs]
        steps = model.mira.stats()["steps"]
        model(inputs[0])
        assert model.mira.stats()["steps"] == steps + 1
    errors, wrong = [], []

    def run(i):
        try:
            with torch.no_grad():
                for k in range(6):
                    call = (model.model, model.get_decoder(), lambda x: model.forward(x, output_hidden_states=True))[k % 3]
                    out = call(inputs[i])
                    hidden = out.hidden_states[-1] if k % 3 == 2 else out.last_hidden_state
                    wrong.extend([i] if not torch.equal(hidden, expected[i]) else [])
        except Exception as e:  # surfaced below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not wrong


@pytest.mark.parametrize("quantization", [None, "int8"])  # records that give the experts back exactly, and lossy ones
@pytest.mark.parametrize("fails", ["moving the model to its device", "exposing the second layer's experts"])
def test_a_wrap_that_fails_after_storing_the_experts_leaves_the_model_as_it_was(
    tiny_checkpoint, monkeypatch, fails, quantization
):
    """The device out of memory while the non-expert weights move to it, or a Ctrl-C while the experts become the
    model's parameters: the error propagates and the model is as it was (no proxy, hook, `mira` or per-instance
    method left; every parameter the same object with the same values), so it can be wrapped again."""
    from mira_hf.proxy import MiraExperts
    from mira_hf.state import ExpertState

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), load_reference(path)
    params = dict(model.named_parameters())
    values = {k: v.clone() for k, v in model.state_dict().items()}
    if fails == "moving the model to its device":
        real_to, moves = type(model).to, []

        def to(*args, **kwargs):  # the device runs out of memory on the way there; the way back works
            moves.append(args)
            if len(moves) == 1:
                raise torch.OutOfMemoryError("CUDA out of memory (injected)")
            return real_to(model, *args, **kwargs)

        model.to = to
        error = torch.OutOfMemoryError
    else:
        real_expose, exposed = ExpertState.expose, []

        def expose(self, proxy, parameter=None):
            exposed.append(proxy.layer)
            if len(exposed) == 2:
                raise KeyboardInterrupt
            real_expose(self, proxy, parameter)

        monkeypatch.setattr(ExpertState, "expose", expose)
        error = KeyboardInterrupt
    with pytest.raises(error):
        MiraMoEModel.wrap(model, gpu_budget=0.3, device="cpu", quantization=quantization)
    model.__dict__.pop("to", None)
    monkeypatch.undo()
    assert not any(isinstance(m, MiraExperts) for m in model.modules())
    assert not any(k in vars(m) for m in model.modules() for k in ("mira", "_mira_state", "_apply", "unload"))
    assert not model._forward_pre_hooks and not model._forward_hooks and not model.model._forward_pre_hooks
    now = dict(model.named_parameters())
    assert now.keys() == params.keys() and all(now[k] is p for k, p in params.items())
    state = model.state_dict()
    assert state.keys() == values.keys() and all(torch.equal(state[k], v) for k, v in values.items())
    with torch.no_grad():
        assert torch.equal(model(PROMPT).logits, ref(PROMPT).logits)
    MiraMoEModel.wrap(model, gpu_budget=0.3, device="cpu")  # and it wraps again
    assert torch.equal(model.generate(PROMPT, **GEN), ref.generate(PROMPT, **GEN))


@pytest.mark.skipif(not hasattr(os, "fork"), reason="os.fork is POSIX-only")
def test_a_process_forked_while_another_thread_generates_uses_the_model(tiny_checkpoint):
    """multiprocessing's fork start method, a DataLoader worker: a child forked while another thread of the parent is
    in a step gets the model with its locks free, and its forward is exact (it waited for good on a lock held by a
    thread the child does not have)."""
    import time

    from conftest import torch_threads

    path = tiny_checkpoint("mixtral")
    with torch.no_grad(), torch_threads(1):  # as the child computes: a CPU's kernels may round by the thread count
        expected = load_reference(path)(PROMPT).logits
    model = _wrapped(path)
    stop = threading.Event()

    def generate():
        while not stop.is_set():
            model.generate(PROMPT, max_new_tokens=4, min_new_tokens=4, do_sample=False, pad_token_id=0)

    codes = []
    with torch_threads(1):  # torch's CPU thread pool does not survive a fork; one thread uses none
        worker = threading.Thread(target=generate, daemon=True)
        worker.start()
        try:
            for _ in range(6):
                time.sleep(0.05)
                pid = os.fork()
                if pid == 0:  # the child: one forward; its exit status says whether it was exact
                    signal.alarm(60)  # a child that hangs is ended (SIGALRM), not the test run
                    try:
                        with torch.no_grad():
                            os._exit(0 if torch.equal(model(PROMPT).logits, expected) else 3)
                    except BaseException:
                        os._exit(4)
                codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
        finally:
            stop.set()
            worker.join(timeout=60)
    assert codes == [0] * 6


@pytest.mark.parametrize("budget", [0.26, 0.6])
def test_a_moe_block_called_on_its_own_while_another_thread_generates_is_serialised_and_exact(tiny_checkpoint, budget):
    """Analysis code calls a decoder layer's MoE block directly (`model.model.layers[i].mlp(h)`, outside any forward
    of the model) while another thread generates: each block call waits for the other thread's step, as a step does,
    and both threads' outputs are exact (the two had interleaved in the expert cache's bookkeeping and raised)."""
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    hidden = torch.randn(1, 24, ref.config.hidden_size, generator=torch.Generator().manual_seed(5))
    gen = dict(max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        blocks = [ref.model.layers[i].mlp(hidden) for i in range(2)]
    expected = ref.generate(PROMPT, **gen)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=budget, device="cpu"), progress=False)
    errors, wrong = [], []

    def generate():
        try:
            for _ in range(3):
                wrong.extend(["generate"] if not torch.equal(model.generate(PROMPT, **gen), expected) else [])
        except Exception as e:  # surfaced below
            errors.append(e)

    worker = threading.Thread(target=generate)
    worker.start()
    try:
        while worker.is_alive() and not errors:
            with torch.no_grad():
                for i in range(2):
                    wrong.extend([i] if not torch.equal(model.model.layers[i].mlp(hidden), blocks[i]) else [])
    except Exception as e:  # surfaced below
        errors.append(e)
    finally:
        worker.join(timeout=120)
    assert not errors and not wrong
    assert _no_pins(model) and not model.mira._forward_lock.locked()


def test_unload_while_another_thread_generates_waits_for_its_step(tiny_checkpoint):
    """`unload()` from one thread while another generates: it waits for the running step to end, and the generating
    thread goes on with the unwrapped model, its tokens exact (it had crashed inside the cache, torn down under it)."""
    import time

    path = tiny_checkpoint("mixtral")
    gen = dict(max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    expected = load_reference(path).generate(PROMPT, **gen)
    for delay in (0.0, 0.02, 0.05, 0.1, 0.2, 0.3):
        model = _wrapped(path)
        out = {}

        def generate(model, out):
            try:
                out["tokens"] = model.generate(PROMPT, **gen)
            except Exception as e:  # surfaced below
                out["error"] = e

        worker = threading.Thread(target=generate, args=(model, out))
        worker.start()
        time.sleep(delay)
        model.unload()
        worker.join(timeout=120)
        assert "error" not in out and torch.equal(out["tokens"], expected), (delay, out.get("error"))
        assert not hasattr(model, "mira") and torch.equal(model.generate(PROMPT, **gen), expected)


def test_truncated_checkpoint_gives_a_clear_error(tiny_checkpoint, tmp_path):
    import shutil

    dst = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint("mixtral"), dst)
    weights = dst / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(
        CheckpointError, match=r"missing, truncated or corrupted: copy or download it again \(nothing was loaded\)"
    ):
        MiraMoEModel.from_pretrained(dst, MiraConfig(device="cpu"), progress=False)


def test_missing_model_directory_gives_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist: no such directory"):
        MiraMoEModel.from_pretrained(tmp_path / "nope", MiraConfig(device="cpu"), progress=False)


@pytest.mark.parametrize(
    "broken, error, says",
    [
        ("config.json given as the model", CheckpointError, r"config.json is a file; a model is a directory"),
        ("config.json not JSON", CheckpointError, r"config.json could not be read .*copy or download it again"),
        ("no weight files", CheckpointError, r"no weight files .*give the directory save_pretrained wrote"),
        ("only pytorch_model.bin", UnsupportedModelError, r"only pytorch_model.bin. .*save it once as safetensors"),
    ],
)
def test_a_checkpoint_that_cannot_load_says_what_is_wrong_with_it(tiny_checkpoint, tmp_path, broken, error, says):
    """Each is refused before anything is built, saying what the files lack and what to do (the streamed load is
    asked for: a .bin checkpoint loads whole otherwise); the files are left as they were."""
    import shutil

    from mira_hf.config import LoaderConfig

    dst = tmp_path / "model"
    shutil.copytree(tiny_checkpoint("mixtral"), dst)
    target = dst
    if broken == "config.json given as the model":
        target = dst / "config.json"
    elif broken == "config.json not JSON":
        (dst / "config.json").write_text("{ not json")
    elif broken == "no weight files":
        (dst / "model.safetensors").unlink()
    else:
        from safetensors.torch import load_file

        torch.save(load_file(dst / "model.safetensors"), dst / "pytorch_model.bin")  # as older checkpoints ship
        (dst / "model.safetensors").unlink()
    before = {p.name: p.read_bytes() for p in dst.iterdir()}
    cfg = MiraConfig(device="cpu", loader=LoaderConfig(stream_experts=True))
    with pytest.raises(error, match=says):
        MiraMoEModel.from_pretrained(target, cfg, progress=False)
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == before


def test_telemetry_and_predictor_state_stay_bounded(tiny_checkpoint):
    model = _wrapped(tiny_checkpoint("mixtral"), policy="priority", predictor="hybrid")
    model.mira.telemetry.history_limit = 50
    ids = torch.randint(3, 128, (1, 4))
    for _ in range(4):
        model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    m = model.mira
    assert len(m.hit_rate_history()) <= 50
    assert len(m.loader._stalls) <= 512
    assert len(m.telemetry.predictions) <= len(m.layers) * m.predictor_config.lookahead * 3
    assert len(m.staging.predicted) <= sum(li.num_experts for li in m.layers.values())
    assert all(len(w) <= w.maxlen for w in m.predictor.position._window.values())


@pytest.mark.parametrize("settings", [{}, {"host_compute": "on"}, {"predictor": "hybrid", "policy": "lru"}])
def test_a_dropped_model_is_freed_at_once(tiny_checkpoint, settings):
    """`del model` frees a wrapped model, its manager and its store by reference counting alone, as it frees the
    unwrapped model (a notebook reloading a model in a loop gets its host memory back), and the host worker ends."""
    import gc
    import weakref

    model = _wrapped(tiny_checkpoint("mixtral"), **settings)
    before = set(threading.enumerate())
    model.generate(PROMPT, **GEN)
    started = [t for t in threading.enumerate() if t not in before]
    assert started if settings.get("host_compute") == "on" else True  # the host worker
    refs = [weakref.ref(model), weakref.ref(model.mira), weakref.ref(model.mira.store)]
    gc.disable()
    try:
        del model
        assert [r() is None for r in refs] == [True, True, True]
    finally:
        gc.enable()
    for t in started:
        t.join(timeout=10)
    assert not any(t.is_alive() for t in started)


def test_a_part_kept_after_the_model_is_dropped_is_cast_as_the_unwrapped_part_is(tiny_checkpoint):
    """The model holds its own links weakly, and a part of it kept on its own (`base = model.model; del model`, as a
    value head built on the backbone keeps it) still follows a cast: its outputs equal the unwrapped part cast alike."""
    path = tiny_checkpoint("mixtral")
    reference = load_reference(path).model.to(torch.bfloat16)
    base = _wrapped(path).model
    base.to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(base(PROMPT).last_hidden_state, reference(PROMPT).last_hidden_state)


def test_no_code_path_unpickles_user_files():
    """Weights, predictors, traces and stats are safetensors or JSON: no torch.load, no pickle."""
    root = pathlib.Path(__file__).resolve().parent.parent
    offenders = []
    for sub in ("mira_hf", "model_adapters"):
        for f in (root / sub).rglob("*.py"):
            text = f.read_text()
            if re.search(r"\btorch\.load\(|\bimport pickle\b|\bpickle\.load|\bimport dill\b|\bjoblib\.load", text):
                offenders.append(os.fspath(f.relative_to(root)))
    assert offenders == []


def test_hybrid_predictor_restarts_with_each_sequence(tiny_checkpoint):
    from mira_hf.predictors import PredictorConfig

    cfg = MiraConfig(device="cpu", gpu_budget=0.5, predictor="hybrid", prediction=PredictorConfig(hybrid_switch_tokens=8))
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), cfg, progress=False)
    model.generate(PROMPT, **GEN)  # 5 prompt tokens + 11 decoded: past the switch
    assert model.mira.predictor.sequence_tokens == 16
    model.generate(PROMPT[:, :3], max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    assert model.mira.predictor.sequence_tokens == 4  # a new sequence: counted from its own start


def test_speculation_and_next_step_state_stay_bounded(tiny_checkpoint):
    """Speculative copies (forced on, on CPU), the learned predictor's next-step guesses and the copy
    latencies: what they keep between steps does not grow with the number of steps."""
    from mira_hf.calibrate import calibrate
    from mira_hf.loader import LATENCY_SAMPLES
    from mira_hf.predictors import PredictorConfig

    cfg = MiraConfig(device="cpu", gpu_budget=0.3, policy="heat", prediction=PredictorConfig(speculate_bytes=2000))
    model = MiraMoEModel.from_pretrained(tiny_checkpoint("mixtral"), cfg, progress=False)
    calibrate(model, torch.randint(3, 128, (4, 32), generator=torch.Generator().manual_seed(0)), epochs=2, progress=False)
    ids = torch.randint(3, 128, (1, 4))
    for _ in range(4):
        model.generate(ids, max_new_tokens=40, min_new_tokens=40, do_sample=False, pad_token_id=0)
    m = model.mira
    assert m.stats()["speculated"] > 0
    assert len(m.staging.cut_short) <= len(m.layers)  # at most the next layer's guess of the current step
    assert sum(len(v) for v in m._staged.values()) <= sum(li.num_experts for li in m.layers.values())
    assert m.staging.next_step <= set(m.layers) and set(m.staging.layer_probs) <= set(m.layers)
    assert len(m.loader._pending_latency) <= 512 and len(m.loader.latencies()) <= LATENCY_SAMPLES
