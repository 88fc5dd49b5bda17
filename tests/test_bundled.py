"""The bundled trained model loads offline and the wrapped model generates what the original does."""

import json
import os

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from mira_hf import MiraConfig, MiraMoEModel, bundled_model_path


def test_bundled_model_greedy_output_equals_the_unwrapped_model():
    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    prompt = tok("import os\n\ndef main(", return_tensors="pt").input_ids
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=0.25), dtype=torch.float32, progress=False)
    kw = dict(max_new_tokens=48, min_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(model.generate(prompt, **kw), ref.generate(prompt, **kw))
    assert model.mira.stats()["hits"] > 0  # real routing has reuse for the cache to find


def test_a_text_generation_pipeline_over_the_wrapped_model_writes_the_unwrapped_models_text():
    """transformers' `pipeline("text-generation", model=...)` takes a wrapped model as it takes the original: the same
    texts, one prompt at a time and in padded batches."""
    from transformers import pipeline

    path = bundled_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=0.25), dtype=torch.float32, progress=False)
    prompts = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, item):"]
    texts = []
    for m in (ref, model):
        for batch_size in (1, 2):
            generate = pipeline("text-generation", model=m, tokenizer=tok, batch_size=batch_size)
            out = generate(prompts, max_new_tokens=12, min_new_tokens=12, do_sample=False)
            texts.append([o[0]["generated_text"] for o in out])
    assert texts[2:] == texts[:2]
    assert all(len(t) > len(p) for t, p in zip(texts[3], prompts))


def test_bundled_model_ships_heldout_tokens_and_a_training_report_that_match_its_files():
    path = bundled_model_path()
    ids = load_file(f"{path}/heldout_tokens.safetensors")["input_ids"]
    assert ids.dim() == 2 and ids.shape[1] == 256 and int(ids.max()) < 6144
    report = json.load(open(f"{path}/training_report.json"))
    for name, size in report["files"].items():  # the report describes the files shipped beside it
        assert os.path.getsize(os.path.join(path, name)) == size, name
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    experts = sum(p.numel() for n, p in ref.named_parameters() if ".experts." in n)
    assert (sum(p.numel() for p in ref.parameters()), experts) == (report["params"]["total"], report["params"]["experts"])
    # The held-out loss, recomputed on the first 8 shipped sequences (2048 tokens, 256-token context): 2.116.
    # The report's 1.952 is over 262,144 tokens at a 512-token context; an untrained model scores ln(6144) = 8.72.
    with torch.no_grad():
        loss = ref(ids[:8].long(), labels=ids[:8].long()).loss.item()
    assert loss < 2.5 and abs(loss - report["heldout"]["loss"]) < 0.25, (loss, report["heldout"]["loss"])
