"""The proxy's host-compute path, one experts module at a time: misses sent to the host
(`MiraConfig(host_compute="on")`, injected costs) put their outputs into the rows the device would fill,
beside experts computed on the device in the same block, and the planner is told each expert's rows.

On a CPU the host runs the device's own kernels (`F.linear`: one `mm` per expert), so the outputs are
exact: transformers' own experts module bit for bit under grouped_mm and eager; under batched_mm the rows of
an expert computed on the host are grouped_mm's (the host's `mm`) and those of one computed on the device
batched_mm's (`bmm`), weighted and summed as batched_mm does. `tests/test_combine.py`'s hard routings
(skewed, repeated picks, four per token, the expert-parallel sentinel), with experts 0 and 1 resident: most
blocks mix both paths, some run wholly on the host. Fast: no generate, no checkpoint; the planner itself
and whole models are in `tests/test_host_compute.py`.
"""

import pytest
import torch
from test_combine import (
    IMPLS,
    experts_pair,
    needs_post_expert_norm,
    require_sentinel_reference,
    routings,
    with_and_without_sentinel,
)
from test_host_compute import all_on_host, costs

RESIDENT = (0, 1)  # computed on the device; every other expert of a block on the host


def host_pair(name: str, dtype: torch.dtype, post_norm: bool = False):
    """(transformers' experts module, the proxy with host compute on): no predictor, so the experts on the
    device are only those a test puts there."""
    return experts_pair(name, dtype, post_norm, host_costs=all_on_host, predictor=None)


def make_resident(proxy, experts) -> None:
    """Exactly `experts` of the proxy's layer on the device."""
    m, layer = proxy.manager, proxy.layer
    m.set_host_only({layer: range(proxy.num_experts)})  # evicts the layer's experts
    m.set_host_only({})
    m.prefetch(layer, list(experts))
    assert resident(proxy) == set(experts)


def resident(proxy) -> set[int]:
    return {e for e in range(proxy.num_experts) if proxy.manager.cache.lookup((proxy.layer, e)) is not None}


def slot_rows(ref, impl: str, hidden, index) -> torch.Tensor:
    """[T, K, H]: transformers' output row of each (token, slot) under `impl` (its weight one, the others zero)."""
    ref.config._experts_implementation = impl
    T, K = index.shape
    rows = []
    for k in range(K):
        one = torch.zeros(T, K)
        one[:, k] = 1.0
        with torch.no_grad():
            rows.append(ref(hidden, index, one))  # row * 1 + rows * 0: the row exactly
    return torch.stack(rows, dim=1)


def expected(ref, impl: str, hidden, index, w, on_host: set[int]) -> torch.Tensor:
    """What the proxy must return when the experts `on_host` run on the host (see the module docstring)."""
    if impl != "batched_mm":
        ref.config._experts_implementation = impl
        with torch.no_grad():
            return ref(hidden, index, w)
    T, K = index.shape
    host = torch.tensor([[e in on_host for e in row] for row in index.tolist()]).unsqueeze(-1)  # [T, K, 1]
    y = torch.where(host, slot_rows(ref, "grouped_mm", hidden, index), slot_rows(ref, "batched_mm", hidden, index))
    return (y.view(T * K, -1) * w.reshape(-1, 1)).view(T, K, -1).sum(dim=1).to(hidden.dtype)  # batched_mm's combine


# gpt_oss: transposed experts with biases; nemotron_h: non-gated, eager sums in the weights' dtype (before transformers
# 5.25); qwen3_moe with a post-expert norm (applied on the device to the host's rows; transformers' eager forwards have none).
CASES = [(name, False, impl) for name in ("mixtral", "gpt_oss", "nemotron_h") for impl in IMPLS]
CASES += [pytest.param("qwen3_moe", True, impl, marks=needs_post_expert_norm) for impl in ("grouped_mm", "batched_mm")]


@pytest.mark.filterwarnings("ignore:mira-hf. model_type")
@with_and_without_sentinel
@pytest.mark.parametrize(("name", "post_norm", "impl"), CASES)
def test_rows_computed_on_the_host_combine_exactly_as_on_the_device(name, post_norm, impl, sentinel):
    """Each routing with experts 0 and 1 on the device: every other expert of the block is computed on the
    host (none is copied, none is cached), and its outputs land in the rows the device would have filled."""
    for dtype in (torch.float32, torch.bfloat16):
        ref, proxy = host_pair(name, dtype, post_norm)
        if sentinel:
            require_sentinel_reference(ref, impl)
        proxy.base.config._experts_implementation = impl
        H, E = proxy.base.config.hidden_size, proxy.num_experts
        for case, (index, w) in routings(E, sentinel=sentinel).items():
            hidden = (torch.randn(index.shape[0], H, generator=torch.Generator().manual_seed(len(case))) * 4).to(dtype)
            on_host = {e for e in index.unique().tolist() if e < E} - set(RESIDENT)
            for w_dtype in {torch.float32, dtype}:
                make_resident(proxy, RESIDENT)
                before = proxy.manager.stats()
                with torch.no_grad():
                    got = proxy(hidden, index, w.to(w_dtype))
                after = proxy.manager.stats()
                assert after["host_computed"] - before["host_computed"] == len(on_host), (case, dtype)
                assert after["loads"] == before["loads"] and resident(proxy) == set(RESIDENT), (case, dtype)
                want = expected(ref, impl, hidden, index, w.to(w_dtype), on_host)
                assert got.dtype == want.dtype and torch.equal(got, want), (case, dtype, w_dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_the_planner_is_given_each_experts_rows_in_the_block(impl):
    """An expert goes to the host only when its rows there finish before its copy: with one row taking a
    microsecond on the host, two rows ten seconds and a copy one second, an expert picked by one token is
    computed on the host and one with two rows (two tokens, or one token picking it twice) is copied and stays
    cached; a decode step's experts have one row each."""
    ref, proxy = host_pair("mixtral", torch.float32)
    proxy.base.config._experts_implementation = impl
    m, H = proxy.manager, proxy.base.config.hidden_size
    one_second_copies = m.store.record_bytes(proxy.layer)  # link bytes per second at which a copy takes 1 s
    try:
        for index, copied, on_host in (
            (torch.tensor([[0, 1], [0, 2]]), {0}, {1, 2}),  # a block of two tokens: expert 0 has two rows
            (torch.tensor([[3, 4]]), set(), {3, 4}),  # a decode step
            (torch.tensor([[5, 5]]), {5}, set()),  # one token picking expert 5 twice: two rows
        ):
            host_s = {layer: {1: 1e-6, 2: 10.0} for layer in m.layers}  # seconds per expert on 1 and 2 rows
            m.host.set_costs(costs(link_bytes_per_s=one_second_copies, host_s=host_s))
            make_resident(proxy, [])
            w = torch.rand(index.shape, generator=torch.Generator().manual_seed(0))
            hidden = torch.randn(index.shape[0], H, generator=torch.Generator().manual_seed(1))
            before = m.stats()
            with torch.no_grad():
                got = proxy(hidden, index, w)
            after = m.stats()
            assert after["host_computed"] - before["host_computed"] == len(on_host), index
            assert after["loads"] - before["loads"] == len(copied) and resident(proxy) == copied, index
            assert torch.equal(got, expected(ref, impl, hidden, index, w, on_host)), index
    finally:
        m.host.set_costs(all_on_host(list(m.layers)))
