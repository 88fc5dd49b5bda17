"""What the commands share: the model options, reading them into a `MiraConfig`, and loading a model.

Nothing here imports torch or transformers at module level: `mira --help` and a mistyped flag answer at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from pathlib import Path

from ..bundled import BUNDLED_NAME, resolve_model_name
from ..config import HOST_COMPUTE_MODES, POLICIES, PREDICTORS, MiraConfig, choices_text, chosen_quantizations, spelling

DTYPES = ("auto", "float32", "bfloat16", "float16")
MODEL_HELP = f'model directory or hub id (downloaded as transformers downloads it; default: "{BUNDLED_NAME}", the bundled model)'


def add_model_options(p: argparse.ArgumentParser, budget_default: str | None, predictors: bool = True, host: bool = True) -> None:
    """--budget, --policy, (--predictor,) --quantization, (--host-compute, --host-share,) --device and --dtype: the
    MiraConfig a command loads with."""
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
        help=f"cache eviction policy: {choices_text(POLICIES)} (default {defaults['policy']})",
    )
    if predictors:
        p.add_argument(
            "--predictor",
            default=defaults["predictor"],
            metavar="P",
            help=f"expert predictor for prefetching: {choices_text(PREDICTORS)} (default {spelling(defaults['predictor'])})",
        )
    formats = choices_text(chosen_quantizations())
    p.add_argument(
        "--quantization",
        default=defaults["quantization"],
        metavar="Q",
        help=f"expert transfer format: {formats} (default {spelling(defaults['quantization'])}: lossless where copies are the "
        "bottleneck, else none; int8/int4/nf4 change the numbers)",
    )
    if host:
        add_host_options(p, defaults)
    p.add_argument("--device", default=None, metavar="D", help="cpu, cuda or cuda:N (default: cuda if available)")
    p.add_argument(
        "--dtype", default=None, choices=DTYPES, help="weights dtype (default float32 on CPU, the checkpoint's on GPU)"
    )


def add_host_options(p: argparse.ArgumentParser, defaults: dict) -> None:
    """--host-compute and --host-share (`MiraConfig.host_compute`, `host_share`)."""
    p.add_argument(
        "--host-compute",
        default=defaults["host_compute"],
        metavar="H",
        help=f"compute on the host CPU: {choices_text(HOST_COMPUTE_MODES)} (default {defaults['host_compute']}; not bit-exact: "
        "'auto'/'on' compute some misses there, 'split' a share of every expert)",
    )
    p.add_argument(
        "--host-share",
        type=float,
        default=None,
        metavar="S",
        help=f"with --host-compute split: the share of each expert's neurons the host computes (default {defaults['host_share']})",
    )


def output_file(text: str) -> str:
    """An argparse type: a file the command will write once its work is done, checked before any of it runs."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory; give a file name, e.g. {path / 'run.json'}")
    _writable_parent(text, path.parent)
    return text


def output_dir(text: str) -> str:
    """An argparse type: a directory the command creates if missing and writes into, checked before any work."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a file, not a directory; give a directory (created if missing)")
    _writable_parent(text, path if path.exists() else path.parent)
    return text


def _writable_parent(text: str, parent: Path) -> None:
    """Refuse `text` when the directory it goes in cannot be made or written (the first part of it that exists)."""
    existing = parent  # a bare file name's parent is "."
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise argparse.ArgumentTypeError(f"{text}: {existing} is a file, so nothing can be written under it")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{text}: {existing} is not writable")


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (0: any free port)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port number: 0-65535 (0: any free port)")
    return port


def doc(fn) -> str:
    """A command's description: its function's docstring."""
    return (fn.__doc__ or "").strip()


def parse_budget(text: str | None) -> int | float | str | None:
    """CLI budget text -> a `MiraConfig.gpu_budget` value: "0.25" is a fraction, "12GiB" a size, "1000000" bytes."""
    if text is None:
        return None
    text = text.strip()
    if re.fullmatch(r"\d+", text):
        return int(text)
    if re.fullmatch(r"(\d*\.\d+|\d+\.\d*|\d+)[eE][-+]?\d+|\d*\.\d+|\d+\.\d*", text):  # 0.25, 1e-1, 2.5E-2
        return float(text)
    return text  # a size string, validated by MiraConfig


def mira_config(args: argparse.Namespace) -> MiraConfig:
    """Validated before anything loads, so a bad flag fails in milliseconds (torch is imported only after)."""
    predictor_path = getattr(args, "predictor_path", None)
    if str(getattr(args, "predictor", None)).lower() == "learned" and not predictor_path:
        raise ValueError(
            "--predictor learned needs --predictor-path DIR, a predictor mira calibrate wrote (mira calibrate MODEL "
            "--data CORPUS --out DIR); --predictor gate needs no training."
        )
    if getattr(args, "host_share", None) is not None and str(getattr(args, "host_compute", None)).lower() != "split":
        raise ValueError(f"--host-share {args.host_share} applies to --host-compute split only: add it, or drop --host-share.")
    cfg = MiraConfig(
        gpu_budget=parse_budget(args.budget),
        device=args.device,
        policy=args.policy,
        predictor=getattr(args, "predictor", None),  # spelled as typed: MiraConfig reads "none", "Gate", ...
        quantization=args.quantization,
        **{name: getattr(args, name) for name in ("host_compute", "host_share") if getattr(args, name, None) is not None},
        **({"predictor_path": predictor_path} if predictor_path else {}),
    )
    if cfg.device is None:
        import torch

        cfg = cfg.replace(device="cuda" if torch.cuda.is_available() else "cpu")
    return cfg


def torch_dtype(name: str | None, device: str):
    import torch

    if name is None:
        name = "float32" if device == "cpu" else "auto"  # CPU bf16 matmuls are slow; on GPU keep the checkpoint's
    return "auto" if name == "auto" else getattr(torch, name)


def model_source(name: str | None) -> str:
    """The bundled model's directory for `mira-tiny`, a local directory as given, or a hub id (left to transformers)."""
    path = resolve_model_name(name)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(f"{path} has no config.json: expected a transformers model directory.")
        return path
    looks_local = os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") != 1 or os.path.exists(path)
    if looks_local:
        raise FileNotFoundError(f"model {path!r}: no such directory (give a model directory, a hub id or {BUNDLED_NAME}).")
    return path


def load(source: str, cfg: MiraConfig, dtype_name: str | None, with_tokenizer: bool = True):
    """(model wrapped by mira-hf, in eval mode; its tokenizer or None). Load failures become FileNotFoundError."""
    from transformers import AutoTokenizer

    from ..model import MiraMoEModel

    tokenizer = None
    if with_tokenizer:
        try:
            tokenizer = AutoTokenizer.from_pretrained(source)
        except (OSError, ValueError) as exc:  # ValueError: files found, none a tokenizer transformers can build
            raise FileNotFoundError(
                f"could not load a tokenizer from {source} (its tokenizer.json or tokenizer_config.json and vocabulary "
                f"files): {first_line(exc)}"
            ) from exc
    try:
        model = MiraMoEModel.from_pretrained(source, cfg, progress=True, dtype=torch_dtype(dtype_name, cfg.device))
    except OSError as exc:  # not a directory, not in the hub cache, or unreadable files
        raise FileNotFoundError(f"could not load model {source}: {first_line(exc)}") from exc
    model.eval()
    return model, tokenizer


def first_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else type(exc).__name__


def write_json(path: str | os.PathLike, data: dict) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
