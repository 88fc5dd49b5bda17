"""Extension points: a predictor and an eviction policy registered from outside the package serve a
wrapped model by name, and the model still computes what the unwrapped one computes."""

import pytest
import torch
from conftest import load_reference

from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.policies import LRUPolicy
from mira_hf.registry import POLICIES, PREDICTORS, register_policy, register_predictor


class RepeatPredictor:
    """Guesses that the next MoE layer uses the experts this layer's tokens used (probability 1)."""

    name = "repeat"

    def __init__(self, spec) -> None:
        self.num_experts = spec.num_experts  # {layer: E}
        self.observed = 0
        self._used = None

    def observe(self, layer, hidden, top_k_index) -> None:
        self.observed += 1
        self._used = top_k_index.reshape(-1)  # [T*K]

    def predict(self, layer, hidden):
        E = self.num_experts.get(layer + 1)
        if E is None:
            return {}
        probs = torch.zeros(E, device=self._used.device)  # where the routing is (as the ARCHITECTURE example)
        probs[self._used[self._used < E]] = 1.0
        return {layer + 1: probs}

    def reset(self) -> None:
        self._used = None


class MostRecentlyUsed(LRUPolicy):
    """Evicts the most recently used expert: LRU's order read backwards."""

    name = "mru"

    def victim(self, candidates):
        allowed = set(candidates)
        return next((key for key in reversed(self._order) if key in allowed), None)


@pytest.fixture
def registered():
    made = []
    register_predictor("repeat", lambda spec: made.append(RepeatPredictor(spec)) or made[-1])
    register_policy("mru", lambda context, settings: MostRecentlyUsed())
    yield made
    PREDICTORS.unregister("repeat")
    POLICIES.unregister("mru")


def test_a_registered_predictor_and_policy_serve_a_wrapped_model_exactly(tiny_checkpoint, registered):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, policy="MRU", predictor="repeat")  # names read in any case
    assert (cfg.policy, cfg.predictor) == ("mru", "repeat")
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
    ids = torch.randint(3, 128, (2, 9), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, ref(ids).logits)
        gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
        assert torch.equal(model.generate(ids, **gen), ref.generate(ids, **gen))
    (predictor,) = registered
    assert model.mira.predictor is predictor and predictor.observed > 0
    assert {type(pool.policy) for pool in model.mira.cache.pools.values()} == {MostRecentlyUsed}
    s = model.mira.stats()
    assert s["prefetches"] > 0 and s["evictions"] > 0  # both did their work


def test_registries_refuse_duplicates_and_forget_what_is_unregistered(registered):
    with pytest.raises(ConfigError, match="already registered"):
        register_policy("mru", lambda context, settings: MostRecentlyUsed())
    with pytest.raises(ConfigError, match="already registered"):
        register_predictor("gate", RepeatPredictor)  # a built-in name
    assert "repeat" in PREDICTORS.names() and "mru" in POLICIES.names()
    POLICIES.unregister("mru")
    with pytest.raises(ConfigError, match="policy='mru' is not supported. Supported: lru, heat, priority"):
        MiraConfig(policy="mru")
    register_policy("mru", lambda context, settings: MostRecentlyUsed())  # the fixture unregisters it again


def test_an_adapter_registered_from_outside_is_found_until_unregistered():
    from model_adapters import MoEAdapter, get_adapter, register_adapter, registered_model_types, unregister_adapter

    adapter = register_adapter(MoEAdapter(name="my-moe", model_types=("my_moe",), experts_globs=("model.layers.*.moe.experts",)))
    try:
        assert get_adapter("my_moe") is adapter and "my_moe" in registered_model_types()
    finally:
        unregister_adapter("my_moe")
    assert get_adapter("my_moe") is None and "my_moe" not in registered_model_types()
    unregister_adapter("my_moe")  # a type without an adapter: nothing to forget
