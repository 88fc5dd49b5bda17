"""`mira generate`: a completion, streamed, then what the expert cache did."""

from __future__ import annotations

import argparse
import time

from .. import report
from ..bundled import BUNDLED_NAME
from .options import MODEL_HELP, add_model_options, doc, load, mira_config, model_source, output_file, write_json


def register(sub: argparse._SubParsersAction) -> None:
    g = sub.add_parser("generate", help="generate text and print cache statistics", description=doc(cmd_generate))
    g.add_argument("model", nargs="?", default=BUNDLED_NAME, metavar="MODEL", help=MODEL_HELP)
    g.add_argument("--prompt", required=True, help="text to continue")
    g.add_argument("--max-new-tokens", type=int, default=48, metavar="N", help="tokens to generate (default 48)")
    add_model_options(g, budget_default="0.25")
    g.add_argument("--predictor-path", metavar="DIR", help="calibrated predictor directory, for --predictor learned (or auto)")
    g.add_argument("--num-beams", type=int, default=1, metavar="N", help="beam search with N beams (no streaming when > 1)")
    g.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    g.add_argument("--temperature", type=float, default=None, metavar="T", help="sampling temperature (with --do-sample)")
    g.add_argument("--seed", type=int, default=0, metavar="S", help="random seed (default 0)")
    g.add_argument(
        "--stats-out", type=output_file, metavar="FILE", help="also write the run's settings, timing and counters as JSON"
    )
    g.set_defaults(run=cmd_generate)


def cmd_generate(args: argparse.Namespace) -> int:
    """Generate a completion of --prompt, streaming the text, then print what the expert cache did:
    hit rate, bytes moved host to device, stall time, tokens/s and peak GPU memory. MODEL defaults to the
    bundled mira-tiny, which runs in seconds on a CPU."""
    if args.max_new_tokens < 1 or args.num_beams < 1:
        raise ValueError(f"--max-new-tokens {args.max_new_tokens} --num-beams {args.num_beams}: both must be ≥ 1.")
    if args.temperature is not None and not args.do_sample:
        raise ValueError("--temperature applies to sampling: add --do-sample.")
    if args.temperature is not None and not args.temperature > 0:
        raise ValueError(f"--temperature {args.temperature}: must be > 0 (for greedy decoding, leave out --do-sample).")
    cfg = mira_config(args)
    source = model_source(args.model)
    import torch  # after the arguments are checked: a mistake is reported without waiting for it

    model, tokenizer = load(source, cfg, args.dtype)
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
    # a decoder-only model's output continues its prompt; an encoder-decoder's starts at its decoder's start token
    new_tokens = out.shape[-1] - (1 if model.config.is_encoder_decoder else prompt_tokens)
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
        # inexact modes are named where chosen (None: left out of the settings line)
        host_compute=cfg.host_compute if cfg.host_compute != "off" else None,
        host_share=cfg.host_share if cfg.host_compute == "split" else None,
    )
    record = report.run_record(args.model, settings, generation, model.mira)
    print()
    print(report.format_run(record))
    if args.stats_out:
        write_json(args.stats_out, record)
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
