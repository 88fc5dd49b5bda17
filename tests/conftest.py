import atexit
import collections
import contextlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download
if "MIRA_HF_RECORD_CACHE" not in os.environ:  # records cached by the tests' loads: never in the user's cache
    os.environ["MIRA_HF_RECORD_CACHE"] = tempfile.mkdtemp(prefix="mira-records-")
    atexit.register(shutil.rmtree, os.environ["MIRA_HF_RECORD_CACHE"], ignore_errors=True)  # after cache writers end
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from tiny_models import EXTRA_RECIPES, MULTIMODAL_RECIPES, RECIPES, build, tiny_config  # noqa: E402

ALL_TINY = sorted(RECIPES) + sorted(EXTRA_RECIPES)
MULTIMODAL = sorted(MULTIMODAL_RECIPES)  # served by an adapter, built as image-text-to-text models


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A function: family name -> directory of a saved tiny random model (fp32), built once per session."""
    cache = {}

    def get(name: str) -> str:
        if name not in cache:
            config = tiny_config(name)
            if config is None:
                import transformers  # imported here: huggingface_hub reads HF_HUB_OFFLINE (set above) on import

                pytest.skip(f"transformers {transformers.__version__} has no {name}")
            torch.manual_seed(0)
            model = build(config)
            path = tmp_path_factory.mktemp(f"tiny-{name}")
            model.save_pretrained(path)
            cache[name] = str(path)
        return cache[name]

    return get


@pytest.fixture(scope="module")
def kernel_device():
    """'cuda' with real kernels, else 'cpu' with the Triton kernels built under TRITON_INTERPRET=1."""
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton not installed (normal on CPU-only machines)")
    if torch.cuda.is_available():
        yield "cuda"
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TRITON_INTERPRET", "1")  # read when the kernels are decorated, i.e. on import
        mp.delitem(sys.modules, "mira_hf.quant.triton_kernels", raising=False)
        import mira_hf.quant.triton_kernels  # noqa: F401

        yield "cpu"
        sys.modules.pop("mira_hf.quant.triton_kernels", None)  # later imports get compiled kernels


def reference_kwargs(path: str, dtype=None) -> dict:
    """What a test passes to transformers' `from_pretrained` to load a checkpoint as transformers computes it on a
    CPU: `dtype`, and for an MXFP4 checkpoint its experts dequantized on load. transformers ≥ 5.25 would otherwise
    fetch its hub kernels for MXFP4 on a CPU (tests run offline); up to 5.24 it dequantized there on its own."""
    import json

    kw = {"dtype": dtype} if dtype is not None else {}
    with open(os.path.join(path, "config.json")) as f:
        quant = json.load(f).get("quantization_config") or {}
    if quant.get("quant_method") == "mxfp4":
        from transformers import Mxfp4Config

        kw["quantization_config"] = Mxfp4Config(dequantize=True)
    return kw


def load_reference(path: str, dtype=None, **hf_kwargs):
    """The unwrapped model of a checkpoint, loaded by transformers (in `dtype`, as mira-hf is given it), with its
    routed experts' weights at 16-byte-aligned addresses and every other weight where transformers put it, as in the
    wrapped model. A tensor that transformers maps from the file as is sits where the file put it, which safetensors
    aligns to 8 bytes only, and a CPU kernel may round a weight by its address: torch's grouped matmul (torch ≥ 2.11),
    and on some CPUs a one-row `F.linear` (an lm_head computing the last position only). The unwrapped model's last
    bits then depend on the file's layout. mira-hf's copies of the experts, like any copy (`.to`, `.clone`), are
    aligned (docs/ARCHITECTURE.md); the rest of the model it leaves as transformers loaded it. `hf_kwargs` go to
    from_pretrained as well (`trust_remote_code=True`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, **reference_kwargs(path, dtype), **hf_kwargs).eval()
    return align_experts(model)


def reinitialised(ref, model, forward) -> tuple:
    """(forward(model), forward(ref)) after `m.apply(m._init_weights)` on both from the same seed, the wrapped
    `model`'s experts copied to its cache first (by a forward): what re-initialising as transformers does gives."""
    with torch.no_grad():
        forward(model)
        for m in (ref, model):
            torch.manual_seed(3)
            m.apply(m._init_weights)
        return forward(model), forward(ref)


def scaled_and_redrawn(ref, model, forward) -> tuple[list, list]:
    """`m.apply(fn)` on both from the same seed, with an `fn` that notes each module it meets (class, shapes of its own
    parameters), doubles those parameters and adds new random values to them; the wrapped `model`'s experts copied to
    its cache first (by a forward). Returns the modules met: (by `ref`, by `model`)."""
    met = {"ref": [], "model": []}

    def scale_and_redraw(key):
        def fn(m):
            own = list(m.parameters(recurse=False))
            met[key].append((type(m).__name__, [tuple(p.shape) for p in own]))
            with torch.no_grad():
                for p in own:
                    p.mul_(2).add_(torch.randn_like(p), alpha=0.01)

        return fn

    with torch.no_grad():
        forward(model)
    for key, m in (("ref", ref), ("model", model)):
        torch.manual_seed(3)
        m.apply(scale_and_redraw(key))
    return met["ref"], met["model"]


def halved_through_apply(ref, model, kinds: tuple, forward) -> tuple:
    """`m.apply(fn)` on both, with an `fn` that gives each module of `kinds` new parameters in place of its own (their
    values halved), the wrapped `model`'s experts copied to its cache first (by a forward). Returns the logits of
    `forward(ref)` before, and of `forward(ref)` and `forward(model)` after."""

    def halve(m):
        if isinstance(m, kinds):
            for n, p in list(m.named_parameters(recurse=False)):
                setattr(m, n, torch.nn.Parameter(p.detach() * 0.5, requires_grad=p.requires_grad))

    with torch.no_grad():
        before = forward(ref).logits
        forward(model)
        ref.apply(halve), model.apply(halve)
        return before, forward(ref).logits, forward(model).logits


def shared_storages(model) -> list[list[str]]:
    """Names of state-dict tensors that share a storage, as transformers groups them to find tied weights."""
    from transformers.pytorch_utils import id_tensor_storage

    groups = collections.defaultdict(list)
    for key, tensor in model.state_dict().items():
        groups[id_tensor_storage(tensor)].append(key)
    return sorted(sorted(names) for names in groups.values() if len(names) > 1)


def align_experts(model):
    """`model` with its routed experts' weights moved to 16-byte-aligned addresses where transformers left them
    where the checkpoint file put them (`load_reference`)."""
    from model_adapters import get_adapter

    adapter = get_adapter(model.config.model_type)
    if adapter is not None:  # where its adapter says the experts are (DBRX's and JetMoE's on a child)
        experts = [p for _, m in adapter.find_experts(model) for p in adapter.experts_layout.parameters(m).values()]
    else:
        experts = [
            p
            for name, module in model.named_modules()
            if name.endswith("experts") and isinstance(getattr(module, "num_experts", None), int)
            for p in module.parameters(recurse=False)
        ]
    for p in experts:
        if p.data_ptr() % 16:
            p.data = p.data.clone()
    return model


def new_thread_cpu_threads() -> int:
    """torch's CPU thread count in a thread started now: what a user's new thread computes with."""
    seen = []
    thread = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
    thread.start()
    thread.join()
    return seen[0]


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's CPU threads set to `n` for the block, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# Property-based test profiles: "ci" is bounded for CI; "long" for local soak runs
# (HYPOTHESIS_PROFILE=long python -m pytest tests/test_properties.py).
try:
    from hypothesis import HealthCheck, settings

    settings.register_profile("ci", max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
    settings.register_profile("long", max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in the test extra; property tests skip without it
    pass


# Source for a measuring subprocess (the tests run it with `python -c`): the peak growth of the
# process's anonymous memory (RssAnon: heap, not memory-mapped file pages) while a block of code runs.
# Use: `peak = PeakAnon()`, do the work, `growth = peak.stop()`.
PEAK_ANON_SOURCE = """
import threading, time
def anon_bytes():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon"):
            return int(line.split()[1]) * 1024
class PeakAnon:
    def __init__(self, period_s=0.0005):
        self.base = self.peak = anon_bytes()
        self._done = False
        def poll():
            while not self._done:
                self.peak = max(self.peak, anon_bytes())
                time.sleep(period_s)
        self._thread = threading.Thread(target=poll)
        self._thread.start()
    def stop(self):
        self._done = True
        self._thread.join()
        return self.peak - self.base
"""


def run_measuring(code: str) -> dict:
    """Run `code` (a script built on PEAK_ANON_SOURCE) in a fresh process and return the JSON its last line prints.
    One torch thread; pieces of 1 MiB and more come from their own mappings, given back when freed, as a real
    checkpoint's tensors (hundreds of MiB, above glibc's largest threshold) always are: a tiny model's pieces of 1-2 MiB
    would otherwise come from malloc's heaps, whose freed chunks stay or go with thread timing (docs/RELIABILITY.md)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_=str(2**20))
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])
