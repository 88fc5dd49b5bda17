"""Where the neuron split's outputs depart from the exact model's: rounding, or a router that picks other experts.

The split (`MiraConfig(host_compute="split")`) sums each expert's output from two parts, one computed on the host,
so it rounds differently from the unwrapped model. On a workload of `host_split.py` (random bf16 weights, routers
spread as trained ones are) this probe runs one forward of a prompt through the unwrapped model and through each
wrapped system, and reports per MoE layer: the hidden state's largest difference from the unwrapped model's
(relative to its largest value) and the share of its elements that differ at all, the share of tokens whose top-k
experts differ, and the reference router's margin (k-th minus (k+1)-th probability) at those tokens; then the
logits' largest difference over all positions and over the positions before the first token whose experts differ.

    python benchmarks/split_fidelity_probe.py --models mixtral --out benchmarks/results/   # GPU, ~1 minute
    python benchmarks/split_fidelity_probe.py --smoke --out /tmp                          # CPU, tiny shapes

Writes OUT/<date>-<device>-split-fidelity.json.
"""

from __future__ import annotations

import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import argparse  # noqa: E402
import copy  # noqa: E402

from bench.clock import START, log  # noqa: E402, F401  (before torch: the log counts imports too)

if __name__ == "__main__":
    for _k, _v in (("HF_HUB_DISABLE_PROGRESS_BARS", "1"), ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_VERBOSITY", "error")):
        os.environ.setdefault(_k, _v)

import torch  # noqa: E402
from bench.measure import release_wrapped  # noqa: E402
from bench.workloads import Workload, model_facts  # noqa: E402
from common import device_slug, environment, print_table, write_json  # noqa: E402
from host_compute import WORKLOADS, budget_of, build, spread_routers  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402


def routed(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]:
    """(logits [T, V] fp32, hidden states after each layer [T, H] fp32, [(router probabilities [T, E], top-k [T, K])]
    per MoE layer) of one forward of `ids` [1, T]."""
    gates, seen = [], []
    for layer in model.model.layers:
        gate = getattr(getattr(layer, "mlp", None), "gate", None) or getattr(getattr(layer, "mlp", None), "router", None)
        if gate is not None:
            gates.append(gate.register_forward_hook(lambda _m, _i, out: seen.append((out[0].float().softmax(-1), out[-1]))))
    try:
        with torch.no_grad():
            out = model(ids, output_hidden_states=True)
    finally:
        for h in gates:
            h.remove()
    return out.logits[0].float(), [h[0].float() for h in out.hidden_states[1:]], seen


def compare(reference, other, k: int) -> dict:
    """Per layer and overall: how far `other`'s forward (a `routed` result) is from `reference`'s."""
    (ref_logits, ref_hidden, ref_routes), (logits, hidden, routes) = reference, other
    layers, first_flip = [], None
    for i, ((probs, index), (_, other_index)) in enumerate(zip(ref_routes, routes)):
        flipped = (index.sort(-1).values != other_index.sort(-1).values).any(-1)  # [T]
        top = probs.topk(k + 1, dim=-1).values
        margin = top[:, k - 1] - top[:, k]
        row = dict(layer=i, flipped_share=flipped.float().mean().item())
        if flipped.any():
            row["margin_at_flips_max"] = margin[flipped].max().item()
            first = int(flipped.nonzero()[0, 0])
            first_flip = first if first_flip is None else min(first_flip, first)
        row["margin_median"] = margin.median().item()
        layers.append(row)
    for i, (a, b) in enumerate(zip(ref_hidden, hidden)):
        if i < len(layers):
            layers[i]["hidden_rel_diff"] = ((a - b).abs().max() / a.abs().max()).item()
            layers[i]["hidden_differing_share"] = a.ne(b).float().mean().item()  # elements not bit-equal
    rel = (logits - ref_logits).abs().max() / ref_logits.abs().max()
    out = dict(logit_rel_diff=rel.item(), first_flip_position=first_flip, layers=layers)
    if first_flip != 0:
        n = first_flip if first_flip is not None else logits.shape[0]
        out["logit_rel_diff_before_flip"] = ((logits[:n] - ref_logits[:n]).abs().max() / ref_logits[:n].abs().max()).item()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="mixtral", help="workloads: " + ",".join(WORKLOADS))
    ap.add_argument("--budget", default="consumer", help="a fraction of the expert bytes, or 'consumer'")
    ap.add_argument("--shares", default="0.2,0.3", help="host_share values of the split systems")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script")
    args = ap.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        print("no CUDA GPU visible: run on a GPU machine, or pass --smoke for the CPU check.", flush=True)
        return 2
    device = "cpu" if args.smoke else "cuda"
    budget = args.budget if args.budget == "consumer" else float(args.budget)
    shares = [float(s) for s in args.shares.split(",") if s.strip()]
    env = environment()
    result = dict(env=env, args=vars(args), rows=[])
    for key in [m.strip() for m in args.models.split(",") if m.strip()]:
        label, shape, smoke_shape, consumer, full_layers = WORKLOADS[key]
        wl = Workload(key, label, smoke_shape if args.smoke else shape, args.seed)
        base = build(wl, device, args.smoke)
        facts = model_facts(base)
        if not args.smoke:
            spread_routers(base, args.prompt_len, args.seed)
        gpu_budget, budget_label = budget_of(budget, facts, consumer, full_layers)
        ids = wl.prompts(1, args.prompt_len, facts["vocab_size"], device)
        reference = routed(base, ids)
        k = reference[2][0][1].shape[-1]
        systems = [("default", MiraConfig(gpu_budget=gpu_budget, device=device))]
        systems += [
            (f"split-{s:g}", MiraConfig(gpu_budget=gpu_budget, device=device, host_compute="split", host_share=s)) for s in shares
        ]
        for system, cfg in systems:
            model = MiraMoEModel.wrap(copy.deepcopy(base), cfg)
            row = dict(model=key, budget=budget_label, system=system, codec=model.mira.store.codec.name)
            row.update(compare(reference, routed(model, ids), k))
            flips = [r["layer"] for r in row["layers"] if r["flipped_share"] > 0]
            before = row["layers"][: flips[0]] if flips else row["layers"]  # the layers before any token's experts differ
            row["max_hidden_rel_diff_before_flip_layer"] = max((r["hidden_rel_diff"] for r in before), default=None)
            result["rows"].append(row)
            log(f"{key} / {system}: logits {row['logit_rel_diff']:.3g}, first flip at position {row['first_flip_position']}")
            release_wrapped(model.mira)
            del model
        del base
    columns = ["model", "budget", "system", "codec", "logit_rel_diff", "logit_rel_diff_before_flip", "first_flip_position"]
    print_table(result["rows"], columns)
    path = os.path.join(args.out, f"{env['date']}-{device_slug(env, on_gpu=not args.smoke)}-split-fidelity.json")
    write_json(path, result)
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
