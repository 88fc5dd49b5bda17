"""The small trained MoE shipped inside the package ("mira-tiny"), so the first command needs no download.

`mira-tiny` is a Mixtral-style model (see `scripts/README.md` for how it is built) stored as an ordinary
transformers directory: it loads with `MiraMoEModel.from_pretrained(bundled_model_path())` and
`AutoTokenizer.from_pretrained(bundled_model_path())`.
"""

from __future__ import annotations

import os
from importlib import resources

from .errors import MiraError

BUNDLED_NAME = "mira-tiny"
# Files a usable bundled model directory holds (the tokenizer is needed by the CLI and the notebook).
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json")


def bundled_model_path() -> str:
    """Directory of the bundled `mira-tiny` model. Raises `MiraError` if the package was installed without it."""
    path = os.fspath(resources.files("mira_hf").joinpath("bundled").joinpath(BUNDLED_NAME))
    missing = [f for f in _REQUIRED_FILES if not os.path.isfile(os.path.join(path, f))]
    if missing:
        raise MiraError(
            f"the bundled model {BUNDLED_NAME!r} is missing from {path} (no {', '.join(missing)}). Reinstall mira-hf "
            "from a full checkout or wheel, or rebuild it as scripts/README.md describes."
        )
    return path


def resolve_model_name(name_or_path: str | os.PathLike | None) -> str:
    """`None` or `"mira-tiny"` -> the bundled model's directory; anything else is returned unchanged (as a str).

    The name wins over a local folder called `mira-tiny`: pass `./mira-tiny` to mean that folder."""
    if name_or_path is None or os.fspath(name_or_path) == BUNDLED_NAME:
        return bundled_model_path()
    return os.fspath(name_or_path)
