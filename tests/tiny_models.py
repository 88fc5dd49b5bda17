"""The tests' tiny models: `mira_hf.testing`, the one table of tiny configs shared with the benchmarks."""

from mira_hf.testing import (  # noqa: F401
    AUTO_FAMILIES,
    AUTO_OVERRIDES,
    AUTO_SMALL,
    BASE,
    EXTRA_RECIPES,
    RECIPES,
    InterruptAt,
    build,
    make_auto_config,
    make_config,
    tiny_config,
)
