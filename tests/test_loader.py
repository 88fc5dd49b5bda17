"""The loader's host→device copies: issued through the CUDA runtime where torch's is found, through torch's `copy_`
otherwise, the same bytes either way, in one piece or two, from page-locked memory or through the staging ring,
and with work run after them on the copy stream. A wrapped model decodes the same tokens both ways."""

import pytest
import torch

from mira_hf import MiraConfig, MiraMoEModel
from mira_hf.loader import Loader, runtime_memcpy
from mira_hf.pinned import pinned_empty

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_no_runtime_is_bound_without_a_cuda_device():
    if torch.cuda.is_available():
        pytest.skip("checks the CPU case")
    assert runtime_memcpy() is None
    assert Loader(torch.device("cpu")).memcpy is None


def _pieces(record: torch.Tensor, cuts: list[int]) -> list[tuple[int, torch.Tensor]]:
    edges = [0, *cuts, record.numel()]
    return [(a, record[a:b]) for a, b in zip(edges, edges[1:])]


def test_cpu_copies_land_every_piece():
    record = torch.randint(0, 256, (1000,), dtype=torch.uint8)
    dst = torch.zeros(1000, dtype=torch.uint8)
    loader = Loader(torch.device("cpu"))
    assert loader.copy_split(dst, _pieces(record, [300, 700]), True, 500) == (None, None)
    assert torch.equal(dst, record)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("pinned", [True, False])
def test_runtime_copies_give_the_bytes_of_torch_copies(pinned):
    """Split and whole copies, page-locked sources (store slabs) and pageable ones (through the ring, in chunks
    smaller than a piece), each way; the slot's previous reader (`after`) and `then` ordered on the copy stream."""
    dev = torch.device("cuda")
    n = 3 * 2**20 + 77
    record = pinned_empty(n) if pinned else torch.empty(n, dtype=torch.uint8)
    record.copy_(torch.randint(0, 256, (n,), dtype=torch.uint8))
    pieces = _pieces(record, [2**20 + 5, 2 * 2**20 + 11])
    loader = Loader(dev, ring_bytes=2**20, ring_chunks=4)
    assert loader.memcpy is not None and loader.memcpy is runtime_memcpy()  # torch's runtime was found
    out = {}
    for way, fn in (("runtime", loader.memcpy), ("torch", None)):
        loader.memcpy = fn
        dst, whole, doubled = (torch.zeros(n, dtype=torch.uint8, device=dev) for _ in range(3))
        torch.cuda.synchronize()  # the buffers are written before any copy is issued
        after = torch.cuda.Event()
        torch.cuda._sleep(10**6)  # the slot's last reader still runs: the copy must wait for it
        dst.fill_(1)
        after.record()
        first, done = loader.copy_split(dst, pieces, pinned, 2**20 + 5, after)
        torch.cuda.current_stream().wait_event(done)
        ready = loader.copy(whole, pieces, pinned, then=lambda: doubled.copy_(whole * 2))  # noqa: B023
        torch.cuda.current_stream().wait_event(ready)
        assert first is not None
        out[way] = (dst.cpu(), whole.cpu(), doubled.cpu())
    for got in out.values():
        assert torch.equal(got[0], record) and torch.equal(got[1], record) and torch.equal(got[2], record * 2)
    assert len(loader.latencies()) == 4  # one sample per copy


class _Done:
    """A copy's event pair as the loader reads it: done or not, and the milliseconds from `start`."""

    def __init__(self, ms: float, done: bool = True) -> None:
        self.ms, self.done = ms, done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end: "_Done") -> float:
        return end.ms


def test_the_link_speed_is_taken_over_the_latest_finished_copies():
    """Bytes over seconds of the copies already done, none before LINK_MIN_SAMPLES of them, the oldest leaving
    once LINK_SAMPLES are kept, and a copy still crossing (and every one after it) not read yet."""
    import mira_hf.loader as ld

    loader, start = Loader(torch.device("cpu")), _Done(0.0)
    assert loader.time_link is False and loader.link_speed() is None
    mb = 10**6
    for _ in range(ld.LINK_MIN_SAMPLES - 1):
        loader._transfers.append((50 * mb, start, _Done(1.0)))  # 50 MB in 1 ms: 50 GB/s
    assert loader.link_speed() is None
    loader._transfers.append((50 * mb, start, _Done(1.0)))
    assert loader.link_speed() == pytest.approx(50e9)
    crossing = _Done(0.1, done=False)
    loader._transfers.extend([(mb, start, crossing), (50 * mb, start, _Done(1e-3))])
    assert loader.link_speed() == pytest.approx(50e9)  # the copy behind the one crossing waits too
    crossing.done = True
    speed = loader.link_speed()
    n = ld.LINK_MIN_SAMPLES
    assert speed == pytest.approx((n * 50 + 1 + 50) * mb / ((n + 0.1 + 1e-3) * 1e-3))
    for _ in range(ld.LINK_SAMPLES):
        loader._transfers.append((20 * mb, start, _Done(1.0)))  # the link slowed to 20 GB/s
    assert loader.link_speed() == pytest.approx(20e9)  # only the latest LINK_SAMPLES count


@pytest.mark.gpu
@cuda
def test_timed_copies_give_the_links_speed():
    """With `time_link`, each copy's bytes between its start on the copy stream and its done event: a speed between
    1 and 1000 GB/s from real copies (page-locked, 8 MiB each)."""
    dev = torch.device("cuda")
    n = 8 * 2**20
    record = pinned_empty(n)
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    loader = Loader(dev)
    loader.time_link = True
    for _ in range(6):
        loader.copy(dst, [(0, record)], True)
    loader.synchronize()
    assert 1e9 < loader.link_speed() < 1e12


@pytest.mark.gpu
@cuda
def test_a_wrapped_model_decodes_the_same_tokens_with_either_copy(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_moe")
    model = MiraMoEModel.from_pretrained(path, MiraConfig(gpu_budget=0.3), progress=False)
    ids = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3, 11]], device="cuda")
    kw = dict(max_new_tokens=12, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        tokens = model.generate(ids, **kw)
        loads = model.mira.stats()["loads"]
        model.mira.loader.memcpy = None
        assert torch.equal(model.generate(ids, **kw), tokens)
    assert loads > 0


@pytest.mark.gpu
@cuda
def test_the_staging_ring_made_in_inference_mode_serves_outside_it(tiny_checkpoint):
    """A pageable store's copies cross through a page-locked ring allocated at the first copy; made during a forward
    in inference mode, it must still take copies after it, under no_grad, with the same logits."""
    path = tiny_checkpoint("qwen3_moe")
    cfg = MiraConfig(gpu_budget=0.3, host_memory="pageable")
    ids = torch.tensor([[5, 9, 17, 33, 42, 7, 64, 100, 3, 11]], device="cuda")
    with torch.no_grad():
        expected = MiraMoEModel.from_pretrained(path, cfg, progress=False)(ids).logits
    model = MiraMoEModel.from_pretrained(path, cfg, progress=False)
    with torch.inference_mode():
        model(ids)
    assert model.mira.loader._ring is not None
    with torch.no_grad():
        assert torch.equal(model(ids).logits, expected)
