"""Vision-language families served by a registered adapter that have no causal-LM class (`MULTIMODAL_RECIPES`):
their image-text-to-text model wrapped in place and loaded with `from_pretrained`, whole and expert by expert,
computes what transformers computes, bit for bit, in fp32 and bf16."""

import copy

import pytest
import torch
from tiny_models import MULTIMODAL_RECIPES, build, config_or_skip

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.config import LoaderConfig

IDS = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3, 11]])
GEN = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)


def tiny(name: str):
    config = config_or_skip(name)
    torch.manual_seed(0)
    return build(config).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MULTIMODAL_RECIPES))
def test_wrapped_in_place_is_exact(name, dtype):
    ref = tiny(name).to(dtype)
    model = copy.deepcopy(ref)
    MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
        assert torch.equal(model.generate(input_ids=IDS, **GEN), ref.generate(input_ids=IDS, **GEN))
    assert model.mira.stats()["loads"] > 0


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("name", sorted(MULTIMODAL_RECIPES))
def test_checkpoint_loads_exactly(name, stream, tmp_path):
    original = tiny(name)
    original.save_pretrained(tmp_path)
    ref = type(original).from_pretrained(tmp_path).eval()
    cfg = MiraConfig(device="cpu", gpu_budget=0.5, loader=LoaderConfig(stream_experts=stream))
    model = MiraMoEModel.from_pretrained(tmp_path, cfg, progress=False)
    assert type(model) is type(ref)
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).logits, ref(input_ids=IDS).logits)
    assert model.mira.stats()["loads"] > 0


def test_step_3_7s_text_decoder_alone_is_served_by_its_adapter():
    """Step 3.7's text decoder has a config type of its own (`step3p5`, `Step3p7TextConfig`): built and wrapped
    alone, it is served by the Step 3.7 adapter (its sigmoid router's scoring for predictions), not the automatic
    one, and computes what it computes unwrapped."""
    import warnings

    import transformers

    config = config_or_skip("step3p7").text_config
    torch.manual_seed(0)
    ref = transformers.Step3p7TextModel(config).eval()
    model = copy.deepcopy(ref)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        MiraMoEModel.wrap(model, MiraConfig(device="cpu", gpu_budget=0.5))
    assert not [w for w in caught if "has no adapter" in str(w.message)]  # the automatic adapter's warning
    from model_adapters import get_adapter

    assert config.model_type == "step3p5" and get_adapter("step3p5").name == "step3p7"
    with torch.no_grad():
        assert torch.equal(model(input_ids=IDS).last_hidden_state, ref(input_ids=IDS).last_hidden_state)
