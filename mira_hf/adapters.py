"""Per-architecture adapters, under the name the documentation uses: `mira_hf.adapters`.

They live in the top-level `model_adapters` package (which stays importable as it is); this module is the
same objects, so registering an adapter through either name registers it once:

    from mira_hf.adapters import MoEAdapter, register_adapter
    register_adapter(MoEAdapter(name="mymoe", model_types=("mymoe",), experts_globs=("*.moe.experts",)))
"""

from model_adapters import *  # noqa: F403  (re-exported: the same registry and classes)
from model_adapters import __all__  # noqa: F401
