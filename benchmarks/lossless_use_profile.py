"""Where a packed lossless expert's time goes at decode, against uncompressed records (GPU).

Wraps the gpt-oss expert shape (`host_compute.py`'s workload: 8 layers, random bf16 weights, routers spread as
trained ones are) at a 25% budget twice, `quantization="lossless"` (packed: each use decodes its record) and None,
and for each: the device time of decoding each tensor of one record (lossless only; 20 calls after 3 warm-ups)
with its escapes, the wall time of `generate` (12 new tokens after a 32-token prompt, after a warm-up call) and
torch.profiler's tables of that call by host and by device time. Writes $OUT/probe.json (default /tmp/out).

    OUT=/tmp/out python benchmarks/lossless_use_profile.py      # H200: ~1 minute
"""

from __future__ import annotations

import copy
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from bench.measure import release_wrapped  # noqa: E402
from bench.workloads import Workload, model_facts  # noqa: E402
from host_compute import WORKLOADS, build, spread_routers  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402


def decode_times(m) -> dict:
    """Milliseconds per decode of each tensor of the first layer's first record, and its escapes."""
    layer, codec = m.first_ordinal, m.store.codec
    rec = m.store.record(layer, 0).to("cuda")
    res = {"layout": repr(m.store.layout(layer))[:2000]}
    for e in m.store.layout(layer).entries:
        for i in range(23):
            if i == 3:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
            codec.decode_entry(rec, e, e.dtype, None, codec.uses_triton(rec))
        torch.cuda.synchronize()
        res[f"decode_ms_{e.name}"] = (time.perf_counter() - t0) / 20 * 1e3
        if e.quantized:
            res[f"esc_{e.name}"] = e.section("esc_index").nbytes // 4
    return res


def main() -> None:
    torch.backends.cuda.enable_cudnn_sdp(False)
    label, shape, _, _, _ = WORKLOADS["gpt-oss"]
    wl = Workload("gpt-oss", label, shape, 0)
    base = build(wl, "cuda", False)
    wl.facts = model_facts(base)
    spread_routers(base, 32, 0)
    ids = wl.prompts(1, 32, wl.facts["vocab_size"], "cuda")
    pad = wl.facts["pad_token_id"]
    out = {}
    for q in ("lossless", None):
        model = MiraMoEModel.wrap(copy.deepcopy(base), MiraConfig(gpu_budget=0.25, device="cuda", quantization=q))
        m = model.mira
        res = decode_times(m) if q else {}
        model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=pad)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=pad)
            torch.cuda.synchronize()
            res["gen_s"] = time.perf_counter() - t0
        res["cpu_top"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
        res["cuda_top"] = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=20)
        out[str(q)] = res
        release_wrapped(m)
        model = m = None
        torch.cuda.empty_cache()
    where = os.environ.get("OUT", "/tmp/out")
    os.makedirs(where, exist_ok=True)
    with open(os.path.join(where, "probe.json"), "w") as f:
        json.dump(out, f, indent=1)
    for q, r in out.items():
        print(q, {k: v for k, v in r.items() if k.startswith(("decode", "esc", "gen"))})


if __name__ == "__main__":
    main()
