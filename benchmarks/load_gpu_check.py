"""GPU check of the loading pipeline: the records a load on a CUDA device builds are the bytes a CPU load builds.

A load on a GPU reads experts on several threads through page-locked staging buffers and copies them on
the readers' own streams, encodes on the device, and page-locks the store's slabs ahead on a background
thread (while planning, for a streamed lossless load). This loads a sharded tiny Mixtral-shape bf16
checkpoint (experts split over several shards) on the GPU and on the CPU, with quantization=None and
"lossless", and checks with torch.equal that every layer's records are identical, that the GPU store is
page-locked, and that the logits of the GPU load equal those of the unwrapped model on the GPU. Prints one
line per check and the GPU loads' stage reports; exit status 1 on any mismatch. Under a minute on a GPU.

    python benchmarks/load_gpu_check.py
    python benchmarks/load_gpu_check.py --dir /tmp/load-check --hidden 1024 --inter 3584   # larger experts
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from mira_hf import MiraConfig, MiraMoEModel  # noqa: E402
from mira_hf.config import LoaderConfig  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dir", default=None, help="where the checkpoint is written (default: a temporary directory)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--inter", type=int, default=1792)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (the CPU paths are covered by the test suite)")
        return 0
    import transformers

    path = args.dir or tempfile.mkdtemp(prefix="mira-load-check-")
    config = transformers.MixtralConfig(
        hidden_size=args.hidden,
        intermediate_size=args.inter,
        num_hidden_layers=args.layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=512,
        num_local_experts=8,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    expert_bytes = 3 * args.hidden * args.inter * 2
    model.save_pretrained(path, max_shard_size=f"{max(4 * expert_bytes // 2**20, 1)}MB")  # experts over several shards
    reference = model.cuda().eval()
    ids = torch.randint(3, 512, (2, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = reference(ids.cuda()).logits
    del reference, model
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    print(f"checkpoint: {path}, {len(shards)} shards")

    failed = []
    for quantization in (None, "lossless"):
        loads = {}
        for device in ("cuda", "cpu"):
            cfg = MiraConfig(
                device=device,
                gpu_budget=0.5,
                quantization=quantization,
                loader=LoaderConfig(stream_experts=True, record_cache=None),
            )
            loads[device] = MiraMoEModel.from_pretrained(path, cfg, progress=False).eval()
        gpu, cpu = loads["cuda"].mira.store, loads["cpu"].mira.store
        same = all(torch.equal(gpu.slabs()[layer].cpu(), cpu.slabs()[layer]) for layer in cpu.layers)
        pinned = gpu.tier_bytes()["pinned"] == gpu.nbytes
        with torch.no_grad():
            exact = torch.equal(loads["cuda"](ids.cuda()).logits, want)
        label = f"quantization={quantization}"
        for name, ok in (("records equal to the CPU load's", same), ("store page-locked", pinned), ("logits exact", exact)):
            print(f"{'ok  ' if ok else 'FAIL'} {label}: {name}")
            if not ok:
                failed.append(f"{label}: {name}")
        print(f"     GPU load: {loads['cuda'].mira_load_report()}")
        del loads
        torch.cuda.empty_cache()
    if args.dir is None:
        shutil.rmtree(path, ignore_errors=True)
    print("FAILED: " + "; ".join(failed) if failed else "all checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
