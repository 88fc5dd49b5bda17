"""torch.compile of a wrapped model: each experts proxy is one opaque operator (`mira::experts`), so the
whole model compiles with `fullgraph=True`, and compiled generation (static cache) gives the unwrapped
model's tokens while the experts are still served from the store.

Compiled graphs may fuse and reorder the arithmetic around the experts (they are compiled too in the
unwrapped model, differently), so compiled logits are compared to eager ones within fp32 noise; tokens
are compared exactly."""

import pytest
import torch
from conftest import load_reference

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.errors import UnsupportedOperationError
from mira_hf.proxy import MiraExperts

IDS = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3, 11], [8, 1, 4, 90, 2, 6, 71, 3, 3, 12]])
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles models of its own: dynamo's caches of earlier tests' graphs (up to its recompile limit per
    code object, which a worker running many tests reaches) start empty."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _wrapped(path):
    return MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.5, device="cpu"), progress=False).eval()


def test_the_experts_operator_passes_torch_library_checks(tiny_checkpoint):
    """Schema, fake (meta) implementation, and dispatch as `torch.library.opcheck` checks them."""
    model = _wrapped(tiny_checkpoint("qwen3_moe"))
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, model.config.hidden_size, generator=g)
    index = torch.tensor([[0, 5], [2, 1], [7, 0]])
    weights = torch.rand(3, 2, generator=g)
    args = (proxy._handle, hidden, index, weights)
    torch.library.opcheck(torch.ops.mira.experts.default, args, test_utils=("test_schema", "test_faketensor"))
    with torch.no_grad():
        assert torch.equal(torch.ops.mira.experts(*args), proxy(hidden, index, weights))


@pytest.mark.parametrize("name, fullgraph", [("mixtral", True), ("mixtral", False), ("llama4", True), ("dbrx", True)])
def test_compiled_forward_matches_eager(tiny_checkpoint, name, fullgraph):
    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path)
    compiled = torch.compile(model, fullgraph=fullgraph, backend="aot_eager")
    with torch.no_grad():
        expected = ref(IDS).logits
        loads = model.mira.stats()["loads"]
        for _ in range(2):  # the second call runs the cached graph
            got = compiled(IDS).logits
            if name == "llama4":  # the unwrapped block sums over every expert, the proxy over the chosen ones
                assert (got - expected).abs().max() <= 1e-5
            else:  # aot_eager runs the eager kernels: the same bits
                assert torch.equal(got, expected)
    assert model.mira.stats()["loads"] > loads  # the experts are still served by the manager
    assert torch.equal(compiled.generate(IDS, **GEN), ref.generate(IDS, **GEN))


def test_decoder_layers_compiled_one_by_one_share_one_graph(tiny_checkpoint):
    """`layer.compile()` on each decoder layer: the layers' proxies reach the operator through handles the graph takes
    as inputs, so every layer runs the one graph the unwrapped model's layers share (a handle the compiler took as a
    constant would make one graph per MoE layer, and past its recompile limit the rest would run uncompiled)."""
    from torch._dynamo.utils import counters

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path)
    with torch.no_grad():
        expected = ref(IDS, use_cache=False).logits
        counters.clear()
        for layer in model.model.layers:
            layer.compile(fullgraph=True, backend="aot_eager")
        got = [model(IDS, use_cache=False).logits for _ in range(2)]
    assert len(model.model.layers) > 1 and counters["stats"]["unique_graphs"] == 1
    assert torch.equal(got[0], expected) and torch.equal(got[1], expected)


@pytest.mark.parametrize(
    "name, backend",
    [("mixtral", "aot_eager"), pytest.param("mixtral", "inductor", marks=pytest.mark.slow)]
    + [pytest.param("qwen3_moe", "inductor", marks=pytest.mark.slow)],
)
def test_compiled_generation_with_a_static_cache_is_token_identical(tiny_checkpoint, name, backend):
    """generate's own compilation (compile_config, static cache), fullgraph=True; Inductor needs a C++
    toolchain and minutes on a small CPU, so it runs with the slow tests."""
    from transformers import CompileConfig

    path = tiny_checkpoint(name)
    ref, model = load_reference(path), _wrapped(path)
    config = CompileConfig(fullgraph=True, mode="default", backend=backend)
    config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    kw = dict(GEN, cache_implementation="static", compile_config=config)
    expected = ref.generate(IDS, **GEN)
    assert torch.equal(model.generate(IDS, **kw), expected)
    assert torch.equal(model.generate(IDS, **kw), expected)  # the compiled step again, for a new sequence
    assert hasattr(model, "_compiled_call")  # generate did compile the forward


@pytest.mark.parametrize("only_experts", [False, True], ids=["all", "only-experts-ask-for-gradients"])
def test_compiled_model_refuses_backward_like_the_eager_one(tiny_checkpoint, only_experts):
    """A compiled forward with autograd on: the backward says why it cannot work, as the eager proxy's does, also
    where only expert parameters ask for gradients (nothing else in the graph needs the refusal's result)."""
    model = _wrapped(tiny_checkpoint("mixtral"))
    if only_experts:
        for name, p in model.named_parameters():
            p.requires_grad_(".experts." in name)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with pytest.raises(UnsupportedOperationError, match="backward through mira-hf's offloaded experts"):
        compiled(IDS).logits.sum().backward()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_compiled_llama4_under_autocast_equals_the_compiled_unwrapped_model(tiny_checkpoint, dtype):
    """A compiled graph calls Llama 4's experts operator outside the caller's autocast: the operator is given its dtype
    and runs the experts under it, so they give autocast's dtype as the module's `bmm` does."""
    path = tiny_checkpoint("llama4")
    model, ref = _wrapped(path), load_reference(path)
    compiled, compiled_ref = (torch.compile(m, fullgraph=True, backend="aot_eager") for m in (model, ref))
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        assert torch.equal(compiled(IDS).logits, compiled_ref(IDS).logits)
    proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
    rows = torch.zeros(proxy.num_experts * 2, model.config.hidden_size)
    rows[0] = 1.0  # token 0 routed to expert 0
    torch.library.opcheck(
        torch.ops.mira.scaled_experts.default, (proxy._handle, rows, dtype), test_utils=("test_schema", "test_faketensor")
    )


@pytest.mark.parametrize("implementation", ["batched_mm", "eager"])
def test_compiled_model_under_autocast_equals_the_compiled_unwrapped_model(tiny_checkpoint, implementation):
    """The experts operator is called outside the caller's autocast too: it is given autocast's dtype and runs the
    experts' matmuls under it, as the module's do (`batched_mm`, which `generate` picks on a GPU, and `eager` round
    differently under autocast)."""
    path = tiny_checkpoint("mixtral")
    model, ref = _wrapped(path), load_reference(path)
    for m in (model, ref):
        m.set_experts_implementation(implementation)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled_ref = torch.compile(ref, backend="aot_eager")  # transformers' eager loop breaks its graph
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(compiled(IDS).logits, compiled_ref(IDS).logits)


def test_expert_edits_between_compiled_calls_reach_the_experts(tiny_checkpoint):
    """A compiled graph leaves the forward hooks out: each block checks its layer's expert parameters instead, so an
    in-place edit reaches the experts and a replaced parameter is refused, as eagerly."""
    path = tiny_checkpoint("mixtral")
    model, ref = _wrapped(path), load_reference(path)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    with torch.no_grad():
        compiled(IDS)
        for m in (model, ref):
            m.model.layers[1].mlp.experts.down_proj[2].mul_(0.5)
        assert torch.equal(compiled(IDS).logits, ref(IDS).logits)
        experts = model.model.layers[1].mlp.experts
        original = experts.down_proj
        experts.down_proj = torch.nn.Parameter(torch.zeros_like(original))
        with pytest.raises(UnsupportedOperationError, match="were replaced"):
            compiled(IDS)
        experts.down_proj = original
        assert torch.equal(compiled(IDS).logits, ref(IDS).logits)


def test_a_compiled_model_called_from_several_threads_gives_each_its_outputs(tiny_checkpoint):
    """A compiled graph runs without the step hooks that make threads take turns per forward step: each experts
    block takes the model's turn instead, so four threads calling one compiled model (as a web demo does) get the
    unwrapped model's logits, where their blocks had interleaved in the expert cache and raised."""
    import threading

    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.25, device="cpu"), progress=False).eval()
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randint(3, 128, (2, 10), generator=g) for _ in range(4)]
    with torch.no_grad():
        expected = [ref(x).logits for x in inputs]
        assert all(torch.equal(compiled(x).logits, e) for x, e in zip(inputs, expected))  # compiled once, here
    failures = []

    def worker(i: int) -> None:
        try:
            with torch.no_grad():
                for r in range(10):
                    j = (i + r) % 4
                    if not torch.equal(compiled(inputs[j]).logits, expected[j]):
                        failures.append(f"thread {i}: wrong logits")
        except Exception as exc:  # noqa: BLE001 (reported below)
            failures.append(f"thread {i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads) and failures == []
    assert not model.mira._forward_lock.locked()


def test_a_compiled_model_counts_every_forward_step(tiny_checkpoint):
    """A compiled graph runs without the step hooks: its last MoE layer's block ends the step, so three compiled
    forwards are three steps in `stats()` and in the hit-rate history, as three eager ones are."""
    counts = []
    for compile_it in (False, True):
        model = _wrapped(tiny_checkpoint("mixtral"))
        run = torch.compile(model, fullgraph=True, backend="aot_eager") if compile_it else model
        with torch.no_grad():
            for _ in range(3):
                run(IDS)
        counts.append((model.mira.stats()["steps"], len(model.mira.hit_rate_history())))
    assert counts == [(3, 3), (3, 3)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_generate_compiled_as_transformers_compiles_it_gives_the_compiled_unwrapped_tokens(tiny_checkpoint, dtype):
    """generate's compilation with its default mode ("reduce-overhead": CUDA graphs around the experts operators, which
    stay out of capture) and a static cache, on CUDA: the tokens of the unwrapped model compiled the same way, steps
    after the first replaying the captured graphs; and decoder layers compiled one by one share one graph there too."""
    from torch._dynamo.utils import counters
    from transformers import CompileConfig

    path = tiny_checkpoint("mixtral")
    ids = IDS.cuda()
    ref = load_reference(path, dtype).cuda()
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.5), dtype=dtype, progress=False).eval()
    kw = dict(
        GEN, max_new_tokens=10, min_new_tokens=10, cache_implementation="static", compile_config=CompileConfig(fullgraph=True)
    )
    expected = ref.generate(ids, **kw)
    torch._dynamo.reset()
    assert torch.equal(model.generate(ids, **kw), expected)
    assert torch.equal(model.generate(ids, **kw), expected)  # a new sequence through the compiled step
    assert hasattr(model, "_compiled_call")
    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(ids, use_cache=False).logits
        counters.clear()
        for layer in model.model.layers:
            layer.compile(fullgraph=True)
        got = [model(ids, use_cache=False).logits for _ in range(2)]
    assert counters["stats"]["unique_graphs"] == 1 and torch.equal(got[0], got[1])
    assert (got[0] - eager).abs().max() <= (1e-4 if dtype == torch.float32 else 5e-2)  # Inductor's rounding


def test_generate_compiling_its_decode_steps_still_starts_each_sequence_at_its_prompt(tiny_checkpoint, monkeypatch):
    """generate runs a prompt's forward eagerly and compiles the decode steps: the prompt's step hooks run, so each
    generate call starts a sequence (the predictor's restart, the heat's prompt seeding) as an eager one does."""
    from transformers import CompileConfig

    model = _wrapped(tiny_checkpoint("mixtral"))
    starts = []
    monkeypatch.setattr(model.mira.staging, "new_sequence", lambda: starts.append(1))
    config = CompileConfig(fullgraph=True, backend="aot_eager")
    config._compile_all_devices = True  # generate compiles on CUDA only unless told otherwise
    for _ in range(2):
        model.generate(IDS, **GEN, cache_implementation="static", compile_config=config)
    assert hasattr(model, "_compiled_call") and len(starts) == 2


def test_a_model_compiled_before_wrapping_is_wrapped_in_place_and_unloads(tiny_checkpoint, tmp_path):
    """`MiraMoEModel.wrap(torch.compile(model))`, the compiled module called once before: the model it compiled is
    wrapped in place and the compiled module returned, computing as the unwrapped model; it saves an ordinary
    checkpoint, and `unload()` gives back the plain model, which the compiled module then runs again."""
    from transformers import AutoModelForCausalLM

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), load_reference(path)
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad():
        expected = ref(IDS).logits
        assert torch.equal(compiled(IDS).logits, expected)
        assert MiraMoEModel.wrap(compiled, MiraConfig(gpu_budget=0.5, device="cpu")) is compiled
        assert any(isinstance(m, MiraExperts) for m in model.modules())  # the model it compiled, wrapped in place
        assert torch.equal(compiled(IDS).logits, expected)
        assert model.mira.stats()["loads"] > 0  # the compiled module ran the wrapped model
        assert MiraMoEModel.wrap(compiled, MiraConfig(gpu_budget=0.5, device="cpu")) is compiled  # idempotent
        compiled.save_pretrained(tmp_path / "saved")
        assert torch.equal(AutoModelForCausalLM.from_pretrained(tmp_path / "saved").eval()(IDS).logits, expected)
        assert compiled.unload() is model and not any(isinstance(m, MiraExperts) for m in model.modules())
        assert torch.equal(compiled(IDS).logits, expected)


class Logits(torch.nn.Module):
    """A model's logits without a cache: what `torch.export` and `torch.jit.trace` take."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(ids, use_cache=False).logits


def test_an_exported_graph_whose_model_is_gone_refuses_to_run_saying_why(tiny_checkpoint):
    """A graph exported with `torch.export` holds each proxy's handle: after `unload()`, or run in a process where no
    proxy has that handle (a program saved and loaded elsewhere), it raises saying why, never computing with another
    model's experts."""

    path = tiny_checkpoint("mixtral")
    ref, model = load_reference(path), _wrapped(path)
    with torch.no_grad():
        program = torch.export.export(Logits(model), (IDS,))
        assert torch.equal(program.module()(IDS), ref(IDS, use_cache=False).logits)
        proxy = next(m for m in model.modules() if isinstance(m, MiraExperts))
        hidden, index, weights = torch.zeros(1, model.config.hidden_size), torch.tensor([[0, 1]]), torch.ones(1, 2)
        unknown = torch.tensor(int(proxy._handle) ^ (1 << 40))  # a handle of no proxy of this process
        with pytest.raises(UnsupportedOperationError, match="no longer wrapped in this process"):
            torch.ops.mira.experts(unknown, hidden, index, weights)
        model.unload()
        with pytest.raises(UnsupportedOperationError, match="unloaded .* or dropped after the graph was compiled or exported"):
            program.module()(IDS)


def test_jit_trace_of_a_wrapped_model_is_refused_naming_what_works(tiny_checkpoint):
    model = _wrapped(tiny_checkpoint("mixtral"))
    with pytest.raises(UnsupportedOperationError, match=r"torch.jit.trace cannot record.*torch.compile"), torch.no_grad():
        torch.jit.trace(Logits(model), (IDS,), strict=False)
