"""`mira calibrate`: route a corpus, write each token's top-k experts, and train the learned predictor."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..bundled import BUNDLED_NAME
from ..errors import MiraError
from .options import add_model_options, doc, first_line, load, mira_config, model_source, output_dir, write_json

# Teacher-forced router top-k per token; not `mira_hf.trace.RoutingTrace` (decode-like, with hidden states).
TOPK_FORMAT = "mira-router-topk/1"
TOPK_NAME = "router_topk"  # DIR/router_topk.safetensors + DIR/router_topk.json


def register(sub: argparse._SubParsersAction) -> None:
    c = sub.add_parser(
        "calibrate", help="record routing over a corpus and train the learned predictor", description=doc(cmd_calibrate)
    )
    c.add_argument("model", metavar="MODEL", help=f'model directory or "{BUNDLED_NAME}"')
    c.add_argument("--data", required=True, metavar="FILE", help='UTF-8 text file, or a .safetensors file with "input_ids"')
    c.add_argument("--out", type=output_dir, required=True, metavar="DIR", help="output directory (created if missing)")
    c.add_argument("--max-tokens", type=int, default=16384, metavar="N", help="tokens to route at most (default 16384)")
    c.add_argument("--chunk-tokens", type=int, default=512, metavar="N", help="tokens per forward pass (default 512)")
    add_model_options(c, budget_default=None, predictors=False)
    c.add_argument("--traces-only", action="store_true", help="record the routing only; skip training the learned predictor")
    c.set_defaults(run=cmd_calibrate)


def cmd_calibrate(args: argparse.Namespace) -> int:
    """Route a corpus through MODEL with teacher forcing and record, per MoE layer, the top-k experts of every
    token (router_topk.safetensors) and per-expert counts (router_topk.json, readable by `mira stats`). Then,
    unless --traces-only, train the learned predictor on the same tokens (mira_hf.calibrate) and save it in DIR."""
    import torch
    from safetensors.torch import save_file

    from ..trace import record_topk

    if args.max_tokens < 2 or args.chunk_tokens < 2:
        raise ValueError("--max-tokens and --chunk-tokens must be ≥ 2.")
    cfg = mira_config(args)
    source = model_source(args.model)
    data_path = Path(args.data)
    if not data_path.is_file():
        what = "a directory" if data_path.is_dir() else "no such file"
        raise FileNotFoundError(f"--data {args.data}: {what}; give a text file or a .safetensors file of input_ids.")
    ids = _tensor_ids(data_path) if data_path.suffix == ".safetensors" else None  # read before the model loads
    model, tokenizer = load(source, cfg, args.dtype, with_tokenizer=ids is None)
    max_len = getattr(model.config, "max_position_embeddings", None) or args.chunk_tokens
    chunk_tokens = min(args.chunk_tokens, max_len)
    chunks = _token_chunks(data_path if ids is None else ids, tokenizer, args.max_tokens, chunk_tokens)
    total = sum(len(c) for c in chunks)
    if total == 0:
        raise ValueError(f"--data {args.data} holds no tokens.")
    vocab = model.get_input_embeddings().num_embeddings
    low, high = min(int(c.min()) for c in chunks if len(c)), max(int(c.max()) for c in chunks if len(c))
    if low < 0 or high >= vocab:
        raise ValueError(
            f"--data {args.data}: its input_ids run from {low} to {high}, outside the model's vocabulary [0, {vocab}). "
            "Tokenise the corpus with this model's tokenizer (or give a text file, which is tokenised here)."
        )
    if total < 2 and not args.traces_only:
        raise ValueError(f"--data {args.data} holds {total} token; training the predictor needs at least 2.")
    topk = record_topk(model, chunks)  # {MoE layer: [N, K]}, the routers' own choices
    num_experts = max(model.mira.layers[layer].num_experts for layer in topk)
    top_k = max(indices.shape[1] for indices in topk.values())

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = {
        "input_ids": torch.cat(chunks).to(torch.int32),
        "chunk_lengths": torch.tensor([len(c) for c in chunks], dtype=torch.int64),
    }
    layers = {}
    for layer, indices in topk.items():  # [N, K]
        tensors[f"topk.{layer}"] = indices.to(torch.int32)
        counts = torch.bincount(indices.reshape(-1).long(), minlength=num_experts)[:num_experts]
        layers[str(layer)] = {"counts": counts.tolist()}
    tensors["counts"] = torch.stack([torch.tensor(layers[str(layer)]["counts"]) for layer in sorted(topk)])  # [L, E]
    summary = {
        "format": TOPK_FORMAT,
        "model": args.model,
        "data": str(data_path),
        "tokens": total,
        "chunks": len(chunks),
        "num_layers": len(topk),
        "num_experts": num_experts,
        "top_k": top_k,
        "tensors": f"{TOPK_NAME}.safetensors",
        "layers": layers,
    }
    tensors_path, summary_path = out_dir / f"{TOPK_NAME}.safetensors", out_dir / f"{TOPK_NAME}.json"
    save_file(tensors, str(tensors_path), metadata={"format": TOPK_FORMAT})
    write_json(summary_path, summary)
    print(f"routed {total:,} tokens in {len(chunks)} chunks through {len(topk)} MoE layers (top-{top_k} of {num_experts})")
    print(f"wrote {tensors_path}  (input_ids [N], topk.<layer> [N, {top_k}], counts [L, E])")
    print(f"wrote {summary_path}  (summary: mira stats {summary_path})")

    if args.traces_only:
        return 0
    from ..calibrate import calibrate

    calibrate(model, chunks, out_dir=str(out_dir), max_tokens=total)
    print(
        f"learned predictor written to {out_dir}: mira generate {args.model} --predictor learned --predictor-path {out_dir} --prompt '...'"
    )
    return 0


def _tensor_ids(path: Path):
    """The "input_ids" tensor of a .safetensors corpus, refused with a one-line error where the file is not one."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            if "input_ids" not in f.keys():
                raise MiraError(f"--data {path} has no 'input_ids' tensor (has {sorted(f.keys())[:6]}).")
            return f.get_tensor("input_ids").long()
    except (OSError, SafetensorError) as exc:
        raise MiraError(f"--data {path} is not a readable .safetensors file ({first_line(exc)}).") from exc


def _token_chunks(data, tokenizer, max_tokens: int, chunk_tokens: int) -> list:
    """The first `max_tokens` tokens of `data`, as 1-D int64 chunks of at most `chunk_tokens`: token ids (a
    .safetensors corpus's "input_ids", each row a chunk source) or the path of a text file, tokenised."""
    import torch

    if isinstance(data, torch.Tensor):
        rows = data.reshape(-1, data.shape[-1]) if data.dim() > 1 else data.reshape(1, -1)
    else:
        # ~4 characters per token in practice; 32 is a generous cap so a huge corpus is not read whole.
        with open(data, encoding="utf-8", errors="replace") as f:
            text = f.read(max_tokens * 32)
        # verbose=False: a corpus is longer than the model's context on purpose; it is cut into chunks below
        rows = torch.tensor(tokenizer(text, verbose=False)["input_ids"], dtype=torch.long)[None]
    chunks, left = [], max_tokens
    for row in rows:
        for piece in row.split(chunk_tokens):
            if left <= 0:
                return chunks
            chunks.append(piece[:left])
            left -= len(chunks[-1])
    return chunks
