"""The tests' tiny models: `mira_hf.testing`, the one table of tiny configs shared with the benchmarks."""

import pytest
import transformers

from mira_hf.testing import (  # noqa: F401
    AUTO_FAMILIES,
    AUTO_OVERRIDES,
    AUTO_SMALL,
    BASE,
    EXTRA_RECIPES,
    MULTIMODAL_RECIPES,
    RECIPES,
    SEQ2SEQ_RECIPES,
    InterruptAt,
    build,
    make_auto_config,
    make_config,
    tiny_config,
)


def config_or_skip(name: str, **overrides):
    """`tiny_config(name, **overrides)`; the test is skipped where the installed transformers lacks the family."""
    config = tiny_config(name, **overrides)
    if config is None:
        pytest.skip(f"transformers {transformers.__version__} has no {name}")
    return config
