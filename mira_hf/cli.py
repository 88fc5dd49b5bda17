"""The `mira` command.

    mira generate --prompt "def fib(n):"                 # the bundled mira-tiny model, on the GPU if there is one
    mira generate PATH --prompt ... --budget 12GiB --stats-out run.json
    mira calibrate PATH --data corpus.txt --out cal/     # router top-k per token, and the learned predictor
    mira bench run -- --models bundled                   # a script of benchmarks/
    mira stats run.json                                  # summary of a saved stats or trace file
    mira env --model PATH                                # GPU, PCIe, bandwidth, versions and a suggested gpu_budget
    mira serve PATH --port 8000 --kv-cache-memory 4GiB   # OpenAI-compatible server (pip install "mira-hf[serve]")

A user mistake (bad budget, missing model, unknown policy, ...) prints one line, `mira: error: ...`, and exits
with status 2, as argparse does for bad arguments; `--traceback` shows the full traceback instead.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import importlib
import importlib.metadata
import json
import os
import platform
import re
import struct
import subprocess
import sys
import time
from pathlib import Path

from . import report
from .bundled import BUNDLED_NAME, resolve_model_name
from .config import POLICIES, PREDICTORS, QUANTIZATIONS, MiraConfig, choices_text, spelling
from .errors import MiraError

# What a user can get wrong; anything else is a bug and keeps its traceback.
USER_ERRORS = (MiraError, FileNotFoundError, ValueError)
DTYPES = ("auto", "float32", "bfloat16", "float16")
# Teacher-forced router top-k per token; not `mira_hf.trace.RoutingTrace` (decode-like, with hidden states).
TOPK_FORMAT = "mira-router-topk/1"
TOPK_NAME = "router_topk"  # DIR/router_topk.safetensors + DIR/router_topk.json
REPO_ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `mira` console script; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2, already printed): return it rather than exit
        return exc.code if isinstance(exc.code, int) else 0
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.run(args)
    except USER_ERRORS as exc:
        if args.traceback:
            raise
        message = " ".join(str(exc).split()) or type(exc).__name__
        print(f"mira: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("mira: interrupted", file=sys.stderr)
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mira",
        description="Run Mixture-of-Experts transformers models with routed experts in host memory and a GPU expert cache.",
        epilog="Run `mira COMMAND --help` for the options of each command.",
    )
    parser.add_argument("--traceback", action="store_true", help="show the full traceback of errors (for bug reports)")
    parser.set_defaults(command=None, traceback=False)
    sub = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    policies = choices_text(POLICIES)
    predictors = choices_text(PREDICTORS)
    model_help = f'model directory or hub id already in the local cache (default: "{BUNDLED_NAME}", the bundled model)'

    g = sub.add_parser("generate", help="generate text and print cache statistics", description=_doc(cmd_generate))
    g.add_argument("model", nargs="?", default=BUNDLED_NAME, metavar="MODEL", help=model_help)
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=48, metavar="N", help="tokens to generate (default 48)")
    _add_model_options(g, budget_default="0.25", policies=policies, predictors=predictors)
    g.add_argument("--predictor-path", metavar="DIR", help="calibrated predictor directory, for --predictor learned (or auto)")
    g.add_argument("--num-beams", type=int, default=1, metavar="N", help="beam search with N beams (no streaming when > 1)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None, metavar="T", help="sampling temperature (with --do-sample)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    g.add_argument("--stats-out", metavar="FILE", help="also write the run's settings, timing and counters as JSON")
    g.set_defaults(run=cmd_generate)

    c = sub.add_parser(
        "calibrate", help="record routing over a corpus and train the learned predictor", description=_doc(cmd_calibrate)
    )
    c.add_argument("model", metavar="MODEL", help=f'model directory or "{BUNDLED_NAME}"')
    c.add_argument("--data", required=True, metavar="FILE", help='UTF-8 text file, or a .safetensors file with "input_ids"')
    c.add_argument("--out", required=True, metavar="DIR", help="output directory (created if missing)")
    c.add_argument("--max-tokens", type=int, default=16384, metavar="N", help="tokens to route at most (default 16384)")
    c.add_argument("--chunk-tokens", type=int, default=512, metavar="N", help="tokens per forward pass (default 512)")
    _add_model_options(c, budget_default=None, policies=policies, predictors=None)
    c.add_argument("--traces-only", action="store_true", help="skip predictor training even when mira_hf.calibrate is installed")
    c.set_defaults(run=cmd_calibrate)

    b = sub.add_parser("bench", help="run a script of benchmarks/ (lists them without NAME)", description=_doc(cmd_bench))
    b.add_argument("name", nargs="?", metavar="NAME", help="script name, e.g. run for benchmarks/run.py")
    b.add_argument("args", nargs=argparse.REMAINDER, metavar="ARGS", help="passed to the script (after an optional --)")
    b.set_defaults(run=cmd_bench)

    s = sub.add_parser("stats", help="summarise a saved stats or routing-trace JSON file", description=_doc(cmd_stats))
    s.add_argument("file", metavar="FILE", help="JSON written by `mira generate --stats-out` or `mira calibrate`")
    s.set_defaults(run=cmd_stats)

    v = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching", description=_doc(cmd_serve))
    v.add_argument("model", nargs="?", default=BUNDLED_NAME, metavar="MODEL", help=model_help)
    v.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    v.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    v.add_argument("--served-model-name", metavar="NAME", help="the model id clients send (default: MODEL as given)")
    v.add_argument("--max-tokens", type=int, default=256, metavar="N", help="completion tokens when a request gives none (256)")
    v.add_argument(
        "--kv-cache-memory",
        metavar="B",
        help="bytes of the paged KV cache, e.g. 4GiB (default: a share of the device memory left after the weights and "
        "the expert cache; 64MiB on a CPU)",
    )
    v.add_argument("--memory-report", action="store_true", help="print how device memory is split, then exit")
    v.add_argument(
        "--device-memory",
        metavar="B",
        help="device bytes to use in all, e.g. 24GiB: the split between expert cache and KV cache is planned (--budget "
        "or --kv-cache-memory fix a part)",
    )
    v.add_argument(
        "--concurrency", type=int, default=32, metavar="N", help="with --device-memory: sequences at once at most (32)"
    )
    v.add_argument("--prompt-tokens", type=int, default=512, metavar="N", help="with --device-memory: tokens per prompt (512)")
    v.add_argument(
        "--routing-trace",
        metavar="FILE",
        help="with --device-memory: routing of MODEL for the plan's hit rates (a trace file, or a mira calibrate DIR)",
    )
    _add_model_options(v, budget_default="0.25", policies=policies, predictors=predictors)
    v.set_defaults(run=cmd_serve, budget=None)  # None: 0.25, or planned with --device-memory

    e = sub.add_parser("env", help="GPU, PCIe, copy bandwidth, host memory and library versions", description=_doc(cmd_env))
    e.add_argument("--model", metavar="PATH", help="also suggest a gpu_budget for this model directory (or mira-tiny)")
    e.set_defaults(run=cmd_env)
    return parser


def _add_model_options(p: argparse.ArgumentParser, budget_default: str | None, policies: str, predictors: str | None) -> None:
    fit = "0.25" if budget_default else "all experts that fit in 90%% of free GPU memory"
    p.add_argument(
        "--budget",
        default=budget_default,
        metavar="B",
        help=f"GPU bytes for experts: a fraction of all expert bytes (0.25), a size (12GiB) or bytes (default: {fit})",
    )
    defaults = {f.name: f.default for f in dataclasses.fields(MiraConfig)}
    p.add_argument(
        "--policy",
        default=defaults["policy"],
        metavar="P",
        help=f"cache eviction policy: {policies} (default {defaults['policy']})",
    )
    if predictors is not None:
        p.add_argument(
            "--predictor",
            default=defaults["predictor"],
            metavar="P",
            help=f"expert predictor for prefetching: {predictors} (default {spelling(defaults['predictor'])})",
        )
    formats = choices_text(QUANTIZATIONS)
    p.add_argument(
        "--quantization",
        default=defaults["quantization"],
        metavar="Q",
        help=f"expert transfer format: {formats} (default {spelling(defaults['quantization'])}: lossless where copies are the "
        "bottleneck, else none; int8/int4/nf4 change the numbers)",
    )
    p.add_argument("--device", default=None, metavar="D", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument(
        "--dtype", default=None, choices=DTYPES, help="weights dtype (default float32 on CPU, the checkpoint's on GPU)"
    )


def _doc(fn) -> str:
    return (fn.__doc__ or "").strip()


# -- shared steps -----------------------------------------------------------------------------------
def parse_budget(text: str | None) -> int | float | str | None:
    """CLI budget text -> a `MiraConfig.gpu_budget` value: "0.25" is a fraction, "12GiB" a size, "1000000" bytes."""
    if text is None:
        return None
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"\d*\.\d+|\d+\.\d*", text):
        return float(text)
    return text  # a size string, validated by MiraConfig


def _mira_config(args: argparse.Namespace) -> MiraConfig:
    """Validated before anything loads, so a bad flag fails in milliseconds (torch is imported only after)."""
    predictor_path = getattr(args, "predictor_path", None)
    cfg = MiraConfig(
        gpu_budget=parse_budget(args.budget),
        device=args.device,
        policy=args.policy,
        predictor=getattr(args, "predictor", None),  # spelled as typed: MiraConfig reads "none", "Gate", ...
        quantization=args.quantization,
        **({"predictor_path": predictor_path} if predictor_path else {}),
    )
    if cfg.device is None:
        import torch

        cfg = cfg.replace(device="cuda" if torch.cuda.is_available() else "cpu")
    return cfg


def _torch_dtype(name: str | None, device: str):
    import torch

    if name is None:
        name = "float32" if device == "cpu" else "auto"  # CPU bf16 matmuls are slow; on GPU keep the checkpoint's
    return "auto" if name == "auto" else getattr(torch, name)


def _model_source(name: str | None) -> str:
    """The bundled model's directory for `mira-tiny`, a local directory as given, or a hub id (left to transformers)."""
    path = resolve_model_name(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json: expected a transformers model directory.")
        return path
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") != 1 or os.path.exists(path)
    if looks_local:
        raise FileNotFoundError(f"model {path!r}: no such directory (give a model directory, a cached hub id or {BUNDLED_NAME}).")
    return path


def _load(source: str, cfg: MiraConfig, dtype_name: str | None, with_tokenizer: bool = True):
    from transformers import AutoTokenizer

    from .model import MiraMoEModel

    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except OSError as exc:
            raise FileNotFoundError(f"could not load a tokenizer from {source}: {_first_line(exc)}") from exc
    try:
        model = MiraMoEModel.from_pretrained(source, cfg, progress=True, dtype=_torch_dtype(dtype_name, cfg.device))
    except OSError as exc:  # not a directory, not in the hub cache, or unreadable files
        raise FileNotFoundError(f"could not load model {source}: {_first_line(exc)}") from exc
    model.eval()
    return model, tokenizer


def _first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


# -- generate ---------------------------------------------------------------------------------------
def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion of --prompt, streaming the text, then print what the expert cache did:
    hit rate, bytes moved host to device, stall time, tokens/s and peak GPU memory. MODEL defaults to the
    bundled mira-tiny, which runs in seconds on a CPU."""
    if args.max_new_tokens < 1 or args.num_beams < 1:
        raise ValueError("--max-new-tokens and --num-beams must be ≥ 1.")
    if args.temperature is not None and not args.do_sample:
        raise ValueError("--temperature applies to sampling: add --do-sample.")
    cfg = _mira_config(args)
    source = _model_source(args.model)
    import torch  # after the arguments are checked: a mistake is reported without waiting for it

    model, tokenizer = _load(source, cfg, args.dtype)
    inputs = tokenizer(args.prompt, return_tensors="pt").to(model.device)
    if inputs["input_ids"].shape[-1] == 0:
        raise ValueError("--prompt is empty after tokenisation: give some text to continue.")

    torch.manual_seed(args.seed)
    streamer = _timed_streamer(tokenizer) if args.num_beams == 1 else None  # beams cannot be streamed
    options = dict(max_new_tokens=args.max_new_tokens, num_beams=args.num_beams, do_sample=args.do_sample)
    if args.temperature is not None:
        options["temperature"] = args.temperature
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    on_cuda = model.device.type == "cuda"
    if on_cuda:
        torch.cuda.synchronize(model.device)
        torch.cuda.reset_peak_memory_stats(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, **options, pad_token_id=pad, streamer=streamer)
    if on_cuda:
        torch.cuda.synchronize(model.device)
    seconds = time.perf_counter() - start
    if streamer is None:
        print(tokenizer.decode(out[0], skip_special_tokens=True), flush=True)

    prompt_tokens = inputs["input_ids"].shape[-1]
    new_tokens = out.shape[-1] - prompt_tokens
    arrivals = streamer.arrivals if streamer is not None else []
    generation = dict(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        seconds=seconds,
        tokens_per_s=new_tokens / seconds if seconds > 0 else None,
        # The first token carries the prefill (and, on a GPU, kernel warm-up); the rest are the decode rate.
        first_token_s=arrivals[0] - start if arrivals else None,
        decode_tokens_per_s=(len(arrivals) - 1) / (arrivals[-1] - arrivals[0]) if len(arrivals) > 1 else None,
        peak_gpu_bytes=torch.cuda.max_memory_allocated(model.device) if on_cuda else None,
        num_beams=args.num_beams,
        do_sample=args.do_sample,
        seed=args.seed,
    )
    settings = dict(
        gpu_budget=cfg.gpu_budget,
        device=cfg.device,
        dtype=str(model.dtype).removeprefix("torch."),
        policy=cfg.policy,
        predictor=cfg.predictor,
        quantization=model.mira.quantization or "none",  # "auto" resolved
        predictor_path=getattr(cfg, "predictor_path", None),
    )
    record = report.run_record(args.model, settings, generation, model.mira)
    print()
    print(report.format_run(record))
    if args.stats_out:
        _write_json(args.stats_out, record)
        print(f"\nstats written to {args.stats_out}")
    return 0


def _timed_streamer(tokenizer):
    """A TextStreamer that also notes when each new token arrives (the prompt comes first and is not counted)."""
    from transformers import TextStreamer

    class TimedStreamer(TextStreamer):
        def __init__(self) -> None:
            super().__init__(tokenizer, skip_special_tokens=True)
            self.arrivals: list[float] = []
            self._prompt_done = False

        def put(self, value) -> None:
            if self._prompt_done:
                self.arrivals.append(time.perf_counter())
            self._prompt_done = True
            super().put(value)

    return TimedStreamer()


def _write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


# -- serve ------------------------------------------------------------------------------------------
PROVISIONAL_SERVE_BUDGET = "0.05"  # share of the experts loaded before --device-memory's plan resizes the cache


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve MODEL over HTTP with an OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
    /health, /metrics), many requests at once through transformers' continuous batching. Prints how the device
    memory is split between weights, expert cache and KV cache. Needs pip install "mira-hf[serve]"."""
    from .serve.options import ServeConfig, require_serve

    fixed_experts = args.budget is not None and args.device_memory is not None
    if args.budget is None:  # with a plan, load with a small cache: the plan resizes it before serving
        args.budget = PROVISIONAL_SERVE_BUDGET if args.device_memory else "0.25"
    serve_config = ServeConfig(  # validated before anything loads
        model_name=args.served_model_name or args.model,
        default_max_tokens=args.max_tokens,
        kv_cache_memory=parse_budget(args.kv_cache_memory),
        device_memory=parse_budget(args.device_memory),
        expert_cache_memory=parse_budget(args.budget) if fixed_experts else None,
        concurrency=args.concurrency,
        prompt_tokens=args.prompt_tokens,
        routing_trace=args.routing_trace,
    )
    require_serve()
    cfg = _mira_config(args)
    model, tokenizer = _load(_model_source(args.model), cfg, args.dtype)

    import logging

    from .serve.app import BackgroundServer, build_app, serve
    from .serve.memory import format_split

    logging.getLogger("transformers.cli.serving").setLevel(logging.ERROR)  # one warning per request otherwise
    if args.memory_report:
        with BackgroundServer(build_app(model, tokenizer, serve_config, on_ready=lambda split: print(format_split(split)))):
            pass
        return 0

    def ready(split: dict) -> None:
        print(format_split(split))
        print(f"serving {serve_config.model_name!r} on http://{args.host}:{args.port} (Ctrl-C stops)", flush=True)

    serve(model, tokenizer, serve_config, host=args.host, port=args.port, on_ready=ready)
    return 0


# -- calibrate --------------------------------------------------------------------------------------
def cmd_calibrate(args: argparse.Namespace) -> int:
    """Route a corpus through MODEL with teacher forcing and record, per MoE layer, the top-k experts of every
    token (router_topk.safetensors) and per-expert counts (router_topk.json, readable by `mira stats`). Then,
    unless --traces-only, train the learned predictor on the same tokens (mira_hf.calibrate) and save it in DIR."""
    import torch
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    if args.max_tokens < 2 or args.chunk_tokens < 2:
        raise ValueError("--max-tokens and --chunk-tokens must be ≥ 2.")
    cfg = _mira_config(args)
    source = _model_source(args.model)
    data_path = Path(args.data)
    if not data_path.is_file():
        raise FileNotFoundError(f"--data {args.data}: no such file.")
    is_tensor_file = data_path.suffix == ".safetensors"
    model, tokenizer = _load(source, cfg, args.dtype, with_tokenizer=not is_tensor_file)
    max_len = getattr(model.config, "max_position_embeddings", None) or args.chunk_tokens
    chunk_tokens = min(args.chunk_tokens, max_len)
    chunks = _token_chunks(data_path, tokenizer, args.max_tokens, chunk_tokens)
    total = sum(len(c) for c in chunks)
    if total == 0:
        raise ValueError(f"--data {args.data} holds no tokens.")
    text_config = getattr(model.config, "text_config", None) or model.config
    top_k = next((getattr(text_config, k) for k in ("num_experts_per_tok", "moe_top_k") if hasattr(text_config, k)), None)
    if not isinstance(top_k, int):
        raise MiraError(f"{source}: its config names no experts-per-token count (num_experts_per_tok).")

    topk: dict[int, list[torch.Tensor]] = {}
    with torch.inference_mode(), tqdm(total=total, desc="routing", unit="tok") as bar:
        for chunk in chunks:
            out = model(chunk[None].to(model.device), output_router_logits=True, use_cache=False)
            for layer, logits in enumerate(getattr(out, "router_logits", None) or ()):  # [T, E] per MoE layer, in order
                probs = torch.softmax(logits.float(), dim=-1)
                topk.setdefault(layer, []).append(torch.topk(probs, top_k, dim=-1).indices.to(torch.int32).cpu())
            bar.update(len(chunk))
    if not topk:
        raise MiraError(f"{source}: the forward returned no router logits; mira calibrate needs an MoE model that reports them.")

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    num_experts = int(out.router_logits[0].shape[-1])
    tensors = {
        "input_ids": torch.cat(chunks).to(torch.int32),
        "chunk_lengths": torch.tensor([len(c) for c in chunks], dtype=torch.int64),
    }
    layers = {}
    for layer, parts in topk.items():
        indices = torch.cat(parts)  # [N, K]
        tensors[f"topk.{layer}"] = indices
        counts = torch.bincount(indices.reshape(-1).long(), minlength=num_experts)
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
    _write_json(summary_path, summary)
    print(f"routed {total:,} tokens in {len(chunks)} chunks through {len(topk)} MoE layers (top-{top_k} of {num_experts})")
    print(f"wrote {tensors_path}  (input_ids [N], topk.<layer> [N, {top_k}], counts [L, E])")
    print(f"wrote {summary_path}  (summary: mira stats {summary_path})")

    learn = None if args.traces_only else _learned_calibrate()
    if learn is None:
        if not args.traces_only:
            print("learned predictor: skipped (mira_hf.calibrate is not available in this installation)")
        return 0
    learn(model, chunks, out_dir=str(out_dir), max_tokens=total)
    print(f"learned predictor written to {out_dir}: mira generate {args.model} --predictor learned --predictor-path {out_dir}")
    return 0


def _token_chunks(path: Path, tokenizer, max_tokens: int, chunk_tokens: int) -> list:
    """The first `max_tokens` tokens of `path`, as 1-D int64 chunks of at most `chunk_tokens`.
    A .safetensors file gives its "input_ids" (each row a chunk source); a text file is tokenised."""
    import torch

    if path.suffix == ".safetensors":
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            if "input_ids" not in f.keys():
                raise MiraError(f"{path} has no 'input_ids' tensor (has {sorted(f.keys())[:6]}).")
            ids = f.get_tensor("input_ids").long()
        rows = ids.reshape(-1, ids.shape[-1]) if ids.dim() > 1 else ids[None]
    else:
        # ~4 characters per token in practice; 32 is a generous cap so a huge corpus is not read whole.
        with open(path, encoding="utf-8", errors="replace") as f:
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


def _learned_calibrate():
    """`mira_hf.calibrate.calibrate` if that module exists (it is optional); errors inside it propagate."""
    try:
        module = importlib.import_module("mira_hf.calibrate")
    except ModuleNotFoundError as exc:
        if exc.name == "mira_hf.calibrate":
            return None
        raise
    return getattr(module, "calibrate", None)


# -- bench ------------------------------------------------------------------------------------------
def cmd_bench(args: argparse.Namespace) -> int:
    """Run benchmarks/NAME.py with this Python, passing the remaining arguments, and print its output.
    Without NAME, list the scripts. Benchmarks live in a source checkout of mira-hf."""
    root = _benchmarks_dir()
    scripts = _bench_scripts(root)
    if args.name is None:
        print(f"benchmark scripts in {root}:")
        print("\n".join(report.aligned_rows([(name, _summary_line(path)) for name, path in scripts.items()])) or "  (none)")
        print("\nrun one with: mira bench NAME [-- ARGS...]")
        return 0
    name = args.name.removesuffix(".py")
    if name not in scripts:
        raise FileNotFoundError(f"no benchmark {args.name!r} in {root}; available: {', '.join(scripts) or 'none'}.")
    extra = args.args[1:] if args.args[:1] == ["--"] else args.args
    env = dict(os.environ, PYTHONUNBUFFERED="1")  # stream the child's lines as they come
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    with subprocess.Popen(
        [sys.executable, str(scripts[name]), *extra],
        cwd=root.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    ) as proc:
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                sys.stdout.flush()
        except KeyboardInterrupt:
            proc.terminate()
            raise
    return proc.returncode


def _benchmarks_dir() -> Path:
    for candidate in (REPO_ROOT / "benchmarks", Path.cwd() / "benchmarks"):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(
        "no benchmarks/ folder: `mira bench` runs the scripts of a source checkout of mira-hf (git clone it)."
    )


def _bench_scripts(root: Path) -> dict[str, Path]:
    """Runnable scripts: *.py except private ones and shared helpers (common.py)."""
    return {p.stem: p for p in sorted(root.glob("*.py")) if not p.stem.startswith("_") and p.stem != "common"}


def _summary_line(path: Path) -> str:
    try:
        doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    except (SyntaxError, UnicodeDecodeError):
        doc = None
    return doc.strip().splitlines()[0] if doc else ""


# -- stats ------------------------------------------------------------------------------------------
def cmd_stats(args: argparse.Namespace) -> int:
    """Print a summary of FILE: a stats JSON from `mira generate --stats-out` (or json.dump(model.mira.stats())),
    or a routing summary (router_topk.json from `mira calibrate`, a trace's JSON, or any JSON with "layers"/"steps" keys)."""
    print(report.summarize_file(args.file))
    return 0


# -- env --------------------------------------------------------------------------------------------
def cmd_env(args: argparse.Namespace) -> int:
    """Print the GPU(s) and their PCIe links, measured host-to-device copy bandwidth (pinned and pageable),
    host memory and library versions; with --model, the model's expert and non-expert bytes (read from the
    safetensors headers, no weights loaded) and a suggested gpu_budget."""
    import torch

    from . import __version__

    sections: list[tuple[str, list[tuple[str, str]]]] = []
    versions = [("python", platform.python_version()), ("mira-hf", __version__)]
    for package in ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "bitsandbytes", "triton"):
        try:
            versions.append((package, importlib.metadata.version(package)))
        except importlib.metadata.PackageNotFoundError:
            versions.append((package, "not installed"))
    total, available = _host_memory()
    host = [
        ("platform", platform.platform()),
        ("CPU cores", str(os.cpu_count())),
        ("memory", f"{report.format_bytes(total)} total, {report.format_bytes(available)} available"),
    ]
    sections += [("host", host), ("libraries", versions)]

    gpus: list[tuple[str, str]] = []
    if torch.cuda.is_available():
        links = _pcie_links()
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            free, total_gpu = torch.cuda.mem_get_info(i)
            gpus.append(
                (
                    f"cuda:{i}",
                    f"{props.name}, {report.format_bytes(total_gpu)} ({report.format_bytes(free)} free), "
                    f"compute {props.major}.{props.minor}",
                )
            )
            gpus.append(("  PCIe", _pcie_text(props, i, links)))
        device = torch.device("cuda", torch.cuda.current_device())
        for pinned in (True, False):
            label = f"  {'pinned' if pinned else 'pageable'} host→device"
            gpus.append((label, f"{_h2d_bandwidth(device, pinned) / 1e9:.1f} GB/s (256 MiB copy, cuda:{device.index})"))
    else:
        gpus.append(("CUDA", f"not available (torch {torch.__version__}); the device is the CPU"))
    sections.append(("GPU", gpus))
    if args.model:
        sections.append(("model", _budget_suggestion(args.model)))

    for title, rows in sections:
        print(f"{title}:")
        print("\n".join("  " + line for line in report.aligned_rows(rows)))
    return 0


def _host_memory() -> tuple[int | None, int | None]:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return vm.total, vm.available
    except ImportError:
        pass
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        return info.get("MemTotal"), info.get("MemAvailable")
    except OSError:
        return None, None


def _pcie_links() -> dict[str, str]:
    """PCI bus id (lowercase, "0000:19:00.0") -> "gen 5 x16 (max gen 5 x16)", from nvidia-smi; {} without it."""
    query = "pci.bus_id,pcie.link.gen.current,pcie.link.width.current,pcie.link.gen.max,pcie.link.width.max"
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=15,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    links = {}
    for line in out.strip().splitlines():
        fields = [f.strip() for f in line.split(",")]
        if len(fields) == 5:
            bus, gen, width, gen_max, width_max = fields
            links[_normal_bus_id(bus)] = f"gen {gen} x{width} (max gen {gen_max} x{width_max}; an idle link may run slower)"
    return links


def _normal_bus_id(bus_id: str) -> str:
    """nvidia-smi writes an 8-digit PCI domain ("00000000:19:00.0"), torch a 4-digit one: compare the last 12 characters."""
    return bus_id.lower()[-12:]


def _pcie_text(props, index: int, links: dict[str, str]) -> str:
    domain, bus, dev = (getattr(props, a, None) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id"))
    if None not in (domain, bus, dev):
        key = _normal_bus_id(f"{domain:04x}:{bus:02x}:{dev:02x}.0")
        if key in links:
            return links[key]
    ordered = list(links.values())
    if len(ordered) == 1 or ("CUDA_VISIBLE_DEVICES" not in os.environ and index < len(ordered)):
        return ordered[index if len(ordered) > 1 else 0]
    return "unknown (nvidia-smi not available)"


def _h2d_bandwidth(device, pinned: bool, nbytes: int = 256 * 2**20) -> float:
    """Bytes per second of one host-to-device copy of `nbytes`, best of 3 after a warm-up copy."""
    import torch

    from .pinned import pinned_empty

    src = pinned_empty(nbytes) if pinned else torch.empty(nbytes, dtype=torch.uint8)  # the memory the store copies from
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    best = float("inf")
    for i in range(4):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src, non_blocking=pinned)
        torch.cuda.synchronize(device)
        if i:  # the first copy warms up the allocator and the DMA path
            best = min(best, time.perf_counter() - start)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / best


def _budget_suggestion(model: str) -> list[tuple[str, str]]:
    """Rows of `mira env --model`: the model's shape and bytes, and a gpu_budget to start from."""
    import torch

    path = resolve_model_name(model)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--model {model}: no such directory (env reads config.json and the safetensors headers).")
    config_path = os.path.join(path, "config.json")
    if not os.path.isfile(config_path):
        raise FileNotFoundError(f"{path} has no config.json: expected a transformers model directory.")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    text = config.get("text_config") or config
    num_experts = next((text[k] for k in ("num_local_experts", "num_experts", "n_routed_experts") if k in text), None)
    top_k = text.get("num_experts_per_tok") or text.get("moe_top_k")
    expert_bytes, other_bytes, moe_layers, files = _checkpoint_bytes(path)
    rows = [
        ("path", path),
        (
            "architecture",
            f"{config.get('model_type', '?')}: {text.get('num_hidden_layers', '?')} layers, {len(moe_layers)} with routed "
            f"experts, {num_experts or '?'} experts per layer, top-{top_k or '?'}",
        ),
        (
            "weights",
            f"{report.format_bytes(expert_bytes)} routed experts + {report.format_bytes(other_bytes)} other, "
            f"in {len(files)} safetensors file(s), at the checkpoint's dtype",
        ),
    ]
    if not expert_bytes:
        rows.append(("gpu_budget", 'no tensor named "*.experts.*": not an MoE checkpoint mira-hf can offload'))
        return rows
    if num_experts and top_k and moe_layers:
        per_expert = expert_bytes / (len(moe_layers) * num_experts)
        rows.append(("minimum budget", f"{report.format_bytes(top_k * per_expert)} (the top-{top_k} experts of one layer)"))
    if not torch.cuda.is_available():
        rows.append(
            (
                "gpu_budget",
                "no CUDA GPU: the device is host memory, so gpu_budget only bounds the expert cache; "
                "--budget 0.25 makes the caching visible",
            )
        )
        return rows
    free, _ = torch.cuda.mem_get_info()
    room = int(0.8 * free) - other_bytes  # 20% headroom for activations and the KV cache
    if room <= 0:
        rows.append(
            (
                "gpu_budget",
                f"the non-expert weights ({report.format_bytes(other_bytes)}) do not fit in 80% of the "
                f"{report.format_bytes(free)} free on the GPU",
            )
        )
        return rows
    budget = min(expert_bytes, room)
    note = "every expert fits" if budget == expert_bytes else f"{budget / expert_bytes:.0%} of the experts"
    rows.append(
        (
            "gpu_budget",
            f'"{report.format_bytes(budget).replace(" ", "")}" ({note}; min(all experts, 0.8 × free GPU memory '
            "− non-expert weights))",
        )
    )
    return rows


def _checkpoint_bytes(path: str) -> tuple[int, int, set[str], list[str]]:
    """(routed-expert bytes, other bytes, MoE layer ids, files) from the safetensors headers; no tensor is read.
    Expert tensors are those whose name contains ".experts." (shared experts are "shared_expert(s)", not counted)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(path, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} has no safetensors weights (mira env reads their headers).")
    expert, other, layers = 0, 0, set()
    for name in files:
        for key, nbytes in _safetensors_sizes(os.path.join(path, name)).items():
            if ".experts." in key:
                expert += nbytes
                match = re.search(r"layers\.(\d+)\.", key)
                layers.add(match.group(1) if match else key.rsplit(".experts.", 1)[0])
            else:
                other += nbytes
    return expert, other, layers, files


def _safetensors_sizes(path: str) -> dict[str, int]:
    """Tensor name -> bytes, from the file's JSON header (8-byte little-endian length, then the header)."""
    try:
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
    except (OSError, struct.error, ValueError) as exc:
        raise MiraError(f"{path} is not a readable safetensors file: {exc}") from None
    return {k: v["data_offsets"][1] - v["data_offsets"][0] for k, v in header.items() if k != "__metadata__"}


if __name__ == "__main__":
    sys.exit(main())
