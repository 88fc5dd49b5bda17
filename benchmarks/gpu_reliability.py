"""Reliability on a CUDA device: exactness of every adapter family and of each policy and
predictor on the GPU, failures that surface and leave the model usable (an injected copy failure, an
injected CUDA out-of-memory while staging, a real CUDA out-of-memory in the middle of a forward, a
KeyboardInterrupt), and peak GPU memory against non-expert weights + budget + activations.

    python benchmarks/gpu_reliability.py --out DIR     # ~1-2 minutes on an H200; writes DIR/<date>-<device>-reliability.json
    python benchmarks/gpu_reliability.py --dtype bfloat16 --out DIR   # ...-<device>-bfloat16-reliability.json

Every model, the unwrapped reference and the wrapped one alike, is loaded in `--dtype` (float32 by default); "exact"
means the wrapped model's logits equal the reference's bit for bit (`torch.equal`, in that dtype) and its greedy
and beam tokens are identical. max_abs_logit_diff is reported beside it.

The CPU test suite checks the same behaviours on CPU (tests/test_reliability.py, tests/test_exactness.py).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))
from common import device_slug, environment, print_table, write_json  # noqa: E402
from composite_models import COMPOSITES  # noqa: E402

from mira_hf import LoaderError, MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.checkpoint import model_class_of  # noqa: E402
from mira_hf.config import LoaderConfig, QuantConfig  # noqa: E402
from mira_hf.quant.lossless import SUPPORTED_DTYPES as LOSSLESS_DTYPES  # noqa: E402
from mira_hf.testing import AUTO_FAMILIES, EXTRA_RECIPES, RECIPES, InterruptAt, build, make_auto_config, tiny_config  # noqa: E402

# The tiny models' records are far below LoaderConfig.split_min_bytes: 0 keeps the split-copy path under test.
SPLIT_ALL = LoaderConfig(split_min_bytes=0)

DEV = "cuda"
DTYPE = torch.float32  # --dtype: every model of the run, reference and wrapped, is loaded in it
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PROMPTS = torch.tensor([[5, 9, 14, 33, 7, 21], [0, 0, 11, 3, 8, 40]])  # row 1 left-padded
MASK = (PROMPTS != 0).long()
GEN = dict(max_new_tokens=12, min_new_tokens=12, do_sample=False, pad_token_id=0)
# (policy, predictor) pairs covering every policy and every predictor that needs no calibration
ONLY: list[str] = []  # --families
COMBOS = [("lru", None), ("heat", "auto"), ("priority", "markov"), ("heat", "global"), ("heat", "hybrid"), ("lru", "position")]


def save_tiny(name: str, root: str) -> str:
    """A tiny random model of an adapter family, of a family without an adapter (`AUTO_FAMILIES`), or a composite
    (vision-language, omni: `COMPOSITES`), saved."""
    import transformers

    torch.manual_seed(0)
    model = COMPOSITES[name](transformers) if name in COMPOSITES else build(tiny_config(name))
    path = os.path.join(root, name)
    model.save_pretrained(path)
    return path


def reference(path: str):
    """The unwrapped model, in the run's dtype, on the device, of the class mira-hf loads it as (a type without a
    causal-LM class, as Mistral 4, as its image-text-to-text model)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    return model_class_of(config).from_pretrained(path, dtype=DTYPE).to(DEV).eval()


def wrapped(path: str, cfg: MiraConfig):
    return MiraMoEModel.from_pretrained(path, cfg, progress=False, dtype=DTYPE)


def outputs(model) -> dict:
    ids, mask = PROMPTS.to(DEV), MASK.to(DEV)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits  # in the model's dtype: compared bit for bit
    return dict(
        logits=logits,
        greedy=model.generate(ids, attention_mask=mask, **GEN),
        beam=model.generate(ids[:1], num_beams=3, **GEN),
    )


def compare(ref: dict, got: dict) -> dict:
    """How the wrapped model's outputs differ from the reference's; `exact`: logits equal bit for bit, tokens identical."""
    row = dict(
        logits_equal=torch.equal(ref["logits"], got["logits"]),
        max_abs_logit_diff=(ref["logits"].float() - got["logits"].float()).abs().max().item(),
        greedy_identical=torch.equal(ref["greedy"], got["greedy"]),
        beam_identical=torch.equal(ref["beam"], got["beam"]),
    )
    row["exact"] = row["logits_equal"] and row["greedy_identical"] and row["beam_identical"]
    return row


def host_tiers(root: str) -> list[dict]:
    """The pinned store (torch's pinned allocator, and slabs page-locked in place as large ones are), the
    pageable store (copies through the pinned staging ring) and the disk tier (experts beyond host_budget,
    memory-mapped from offload_dir) on CUDA: exact, with their copy counts."""
    from mira_hf import pinned

    path = save_tiny("mixtral", root)
    ref = outputs(reference(path))
    rows = []
    for name, kw in (
        ("pinned", dict(host_memory="pinned")),
        ("pinned-registered", dict(host_memory="pinned")),  # the tiny slabs page-locked in place, as large ones are
        ("pageable", dict(host_memory="pageable")),
        ("disk", dict(host_memory="pageable", host_budget=1, offload_dir=os.path.join(root, "offload"))),
    ):
        row = dict(tier=name)
        register_min = pinned.REGISTER_MIN_BYTES
        if name == "pinned-registered":
            pinned.REGISTER_MIN_BYTES = 0
        try:
            model = wrapped(path, MiraConfig(gpu_budget=0.3, device=DEV, **kw))
            row["store_tiers"] = model.mira.store.tier_bytes()
            row.update(compare(ref, outputs(model)))
            row["loads"] = model.mira.stats()["loads"]
        except Exception as exc:
            row.update(exact=False, error=f"{type(exc).__name__}: {exc}"[:300])
        finally:
            pinned.REGISTER_MIN_BYTES = register_min
        rows.append(row)
    return rows


def speculation(root: str) -> list[dict]:
    """Speculative copies (cut short into idle link time, finished or dropped by the next block) on
    CUDA: exact with raw and lossless records, from the pinned and the pageable store. The tiny
    models' records are smaller than the 48 MiB default, so speculate_bytes is set below a record."""
    from mira_hf.predictors import PredictorConfig

    rows = []
    for name in ("mixtral", "qwen3_moe"):
        path = save_tiny(name, root)
        try:
            ref = outputs(reference(path))
        except Exception as exc:  # the unwrapped model itself fails in this dtype: nothing to compare against
            rows.append(dict(family=name, reference_error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        for quantization, host_memory in ((None, "pinned"), ("lossless", "pinned"), (None, "pageable")):
            if quantization == "lossless" and DTYPE not in LOSSLESS_DTYPES:
                continue  # lossless records hold bf16 and fp32 weights only
            row = dict(family=name, quantization=quantization, host_memory=host_memory)
            try:
                cfg = MiraConfig(
                    gpu_budget=0.3,
                    device=DEV,
                    policy="heat",
                    predictor="gate",
                    quantization=quantization,
                    host_memory=host_memory,
                    prediction=PredictorConfig(speculate_bytes=3000),
                    loader=SPLIT_ALL,
                )
                model = wrapped(path, cfg)
                row.update(compare(ref, outputs(model)))
                s = model.mira.stats()
                row.update(speculated=s["speculated"], speculated_used=s["speculated_used"], dropped=s["prefetch_wasted"])
            except Exception as exc:
                row.update(exact=False, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
    return rows


# A fraction below the minimum working set is raised to it: this one runs each model at its smallest budget
# (the top-k experts of one layer, in the row's transfer format), the budget in use recorded as budget_bytes.
MINIMUM = 1e-6
warnings.filterwarnings("ignore", message=r"mira-hf: gpu_budget=.* below the minimum working set")


def _has_composite(name: str) -> bool:
    import transformers

    try:
        with torch.device("meta"):
            COMPOSITES[name](transformers)
    except AttributeError:  # this transformers lacks the family
        return False
    return True


def exactness(root: str) -> list[dict]:
    rows = []
    auto = [n for n in AUTO_FAMILIES if make_auto_config(n) is not None]  # those this transformers has
    served = [n for n in sorted(RECIPES) + sorted(EXTRA_RECIPES) if tiny_config(n) is not None]  # likewise
    auto += [n for n in sorted(COMPOSITES) if _has_composite(n)]  # vision-language and omni, without an adapter
    for name in served + auto:
        if ONLY and name not in ONLY:
            continue
        path = save_tiny(name, root)
        try:
            ref = outputs(reference(path))
        except Exception as exc:  # the unwrapped model itself fails in this dtype: nothing to compare against
            rows.append(dict(family=name, reference_error=f"{type(exc).__name__}: {exc}"[:300]))
            continue
        combos = [(*c, None, "auto", MINIMUM) for c in (COMBOS if name == "mixtral" else COMBOS[:2])]
        if name in auto:  # served without an adapter: the default, then lossless records as for every family
            combos = combos[1:2]
        # lossless records (the classes exponent code, the default) decoded by the Triton kernel, both placements;
        # 0.5: the packed placement's decode scratch comes out of the budget
        if DTYPE in LOSSLESS_DTYPES:  # lossless records hold bf16 and fp32 weights only
            combos += [("heat", "auto", "lossless", placement, 0.5) for placement in ("packed", "dequant")]
        for policy, predictor, quantization, placement, budget in combos:
            row = dict(family=name, budget=budget, policy=policy, predictor=predictor, quantization=quantization)
            row["placement"] = placement
            try:
                cfg = MiraConfig(
                    gpu_budget=budget, device=DEV, policy=policy, predictor=predictor, quantization=quantization,
                    quant=QuantConfig(placement=placement), loader=SPLIT_ALL,
                )  # fmt: skip
                model = wrapped(path, cfg)
                row["budget_bytes"] = model.mira.stats()["budget_bytes"]
                row.update(compare(ref, outputs(model)))
            except Exception as exc:
                row.update(exact=False, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
    return rows


def _consistent(model) -> bool:
    m = model.mira
    no_pins = all(s.pins == 0 for pool in m.cache.pools.values() for s in pool.slots)
    return no_pins and not m._forward_lock.locked() and m.cache.resident_bytes <= m.budget.budget_bytes


def failures(root: str) -> list[dict]:
    path = save_tiny("mixtral", root)
    ids = PROMPTS[:1].to(DEV)
    expected = reference(path).generate(ids, **GEN)
    rows = []

    def case(name: str, inject, expect: type, restore=None):
        model = wrapped(path, MiraConfig(gpu_budget=0.3, device=DEV))
        model.generate(ids, **GEN)  # warm
        undo = inject(model)
        t0 = time.perf_counter()
        raised = None
        try:
            model.generate(ids, **GEN) if name != "keyboard_interrupt" else model.generate(
                ids, stopping_criteria=[InterruptAt(4)], **GEN
            )
        except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt is one of the cases
            raised = exc
        seconds = time.perf_counter() - t0
        if undo:
            undo()
        after_ok = _consistent(model)
        again = torch.equal(model.generate(ids, **GEN), expected)
        rows.append(
            dict(
                case=name,
                raised=type(raised).__name__ if raised else None,
                expected_type=expect.__name__,
                message=str(raised)[:240] if raised else None,
                seconds_to_raise=round(seconds, 3),
                consistent_after=after_ok,
                next_generate_exact=again,
                ok=isinstance(raised, expect) and after_ok and again,
            )
        )

    def failing_copy(model, exc_factory, at=3):
        real = model.mira.loader.copy_split  # every copy goes through it
        calls = {"n": 0}

        def copy(*a, **k):
            calls["n"] += 1
            if calls["n"] == at:
                raise exc_factory()
            return real(*a, **k)

        model.mira.loader.copy_split = copy

        def undo():
            model.mira.loader.copy_split = real

        return undo

    case("copy_failure", lambda m: failing_copy(m, lambda: RuntimeError("injected: bad page in host memory")), LoaderError)
    case(
        "cuda_oom_while_staging",
        lambda m: failing_copy(m, lambda: torch.OutOfMemoryError("CUDA out of memory (injected while staging)")),
        LoaderError,
    )
    case("keyboard_interrupt", lambda m: None, KeyboardInterrupt)
    if not DEV.startswith("cuda"):
        return rows

    # A real CUDA OOM in the middle of a forward: cap this process's device memory just above what is
    # allocated now, then ask for a batch whose activations cannot fit.
    model = wrapped(path, MiraConfig(gpu_budget=0.3, device=DEV))
    model.generate(ids, **GEN)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    frac = (torch.cuda.memory_reserved() + 64 * 2**20) / total
    torch.cuda.set_per_process_memory_fraction(frac)
    big = torch.randint(3, 120, (4096, 256), device=DEV)
    t0 = time.perf_counter()
    raised = None
    try:
        model(big)
    except BaseException as exc:  # noqa: BLE001
        raised = exc
    seconds = time.perf_counter() - t0
    torch.cuda.set_per_process_memory_fraction(1.0)
    del big
    torch.cuda.empty_cache()
    ok_after = _consistent(model)
    again = torch.equal(model.generate(ids, **GEN), expected)
    rows.append(
        dict(
            case="real_cuda_oom_mid_forward",
            raised=type(raised).__name__ if raised else None,
            expected_type="OutOfMemoryError",
            message=str(raised)[:240] if raised else None,
            seconds_to_raise=round(seconds, 3),
            consistent_after=ok_after,
            next_generate_exact=again,
            ok=isinstance(raised, torch.OutOfMemoryError) and ok_after and again,
        )
    )
    return rows


def peak_memory() -> dict:
    """A mid-size Mixtral-shaped model (bf16): peak GPU memory of mira at 25% against non-expert
    weights + budget + the activations the resident model needs for the same generate calls."""
    from transformers import MixtralConfig

    cfg = MixtralConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=3584,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    ids = torch.randint(3, 32000, (4, 256), device=DEV)

    def run(model) -> int:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        model.generate(ids, max_new_tokens=32, min_new_tokens=32, do_sample=False, pad_token_id=0)
        model.generate(ids[:1], num_beams=4, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    with torch.device(DEV):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    expert = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    resident_peak = run(model)
    activations = resident_peak - weights
    MiraMoEModel.wrap(model, MiraConfig(gpu_budget=0.25, device=DEV), progress=False)
    torch.cuda.empty_cache()
    mira_peak = run(model)
    budget = model.mira.budget.budget_bytes
    allowed = (weights - expert) + budget + activations
    return dict(
        non_expert_bytes=weights - expert,
        expert_bytes=expert,
        budget_bytes=budget,
        resident_peak_bytes=resident_peak,
        activation_bytes=activations,
        mira_peak_bytes=mira_peak,
        allowed_bytes=allowed,
        ok=mira_peak <= allowed * 1.05,
        note="allowed = non-expert weights + budget + the resident model's activation peak for the same calls; ok within 5%",
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.path.join(HERE, "results"))
    ap.add_argument("--families", default="", help="comma-separated adapter families (default: all)")
    ap.add_argument("--device", default="cuda", help="cpu only checks that the script runs (no OOM or peak parts)")
    ap.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="dtype of every model, reference and wrapped")
    args = ap.parse_args()
    global DEV, DTYPE
    DEV, DTYPE = args.device, DTYPES[args.dtype]
    ONLY.extend(f for f in args.families.split(",") if f)
    if DEV.startswith("cuda") and not torch.cuda.is_available():
        print("no CUDA device: this script checks GPU behaviour (the CPU suite covers the rest)")
        return 2
    command = "python benchmarks/gpu_reliability.py" + (f" --dtype {args.dtype}" if args.dtype != "float32" else "")
    result = dict(env=environment(), command=command, dtype=args.dtype, exact="logits torch.equal, tokens identical")
    with tempfile.TemporaryDirectory() as root:
        parts = [
            ("exactness", lambda: exactness(root)),
            ("host_tiers", lambda: host_tiers(root)),
            ("speculation", lambda: speculation(root)),
            ("failures", lambda: failures(root)),
            ("peak", peak_memory),
        ]
        for key, fn in parts if DEV.startswith("cuda") else parts[:4]:
            t0 = time.perf_counter()
            try:
                result[key] = fn()
            except Exception as exc:  # keep what the other parts measured
                result[key] = dict(error=f"{type(exc).__name__}: {exc}", trace=traceback.format_exc()[-2000:])
            result[f"{key}_s"] = time.perf_counter() - t0
            print(f"{key}: {time.perf_counter() - t0:.1f} s", flush=True)
    if isinstance(result.get("exactness"), list):
        print_table(
            result["exactness"],
            [
                "family",
                "budget",
                "budget_bytes",
                "policy",
                "predictor",
                "quantization",
                "placement",
                "logits_equal",
                "max_abs_logit_diff",
            ]
            + ["greedy_identical", "beam_identical", "exact"],
        )
    if isinstance(result.get("host_tiers"), list):
        print_table(
            result["host_tiers"],
            ["tier", "store_tiers", "logits_equal", "max_abs_logit_diff", "greedy_identical", "beam_identical", "loads", "exact"],
        )
    if isinstance(result.get("speculation"), list):
        print_table(
            result["speculation"],
            ["family", "quantization", "host_memory", "logits_equal", "max_abs_logit_diff", "greedy_identical", "beam_identical"]
            + ["speculated", "speculated_used", "dropped", "exact"],
        )
    if isinstance(result.get("failures"), list):
        print_table(result["failures"], ["case", "raised", "seconds_to_raise", "consistent_after", "next_generate_exact", "ok"])
    print("peak:", result.get("peak"))
    slug = device_slug(result["env"], DEV.startswith("cuda"))
    suffix = "" if args.dtype == "float32" else f"-{args.dtype}"
    write_json(os.path.join(args.out, f"{result['env']['date']}-{slug}{suffix}-reliability.json"), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
