"""The codec registry: a format added from outside the package serves a model, the registry refuses
conflicts, MiraConfig reads it, and the built-in formats keep the identities their files on disk carry."""

from __future__ import annotations

import pytest
import torch
from conftest import load_reference

from mira_hf import ConfigError, MiraConfig, MiraMoEModel
from mira_hf.config import QuantConfig, quantizations
from mira_hf.layout import IdentityCodec, RawLayout
from mira_hf.quant import (
    CodecEntry,
    CodecInputError,
    CodecRegistryError,
    codec_for_config,
    format_codes,
    get_codec_entry,
    make_codec,
    pack_expert,
    register_codec,
    unregister_codec,
)
from mira_hf.store import codec_spec

IDS = torch.tensor([[4, 8, 15, 16, 23, 42, 7, 9]])


class CopyCodec:
    """An exact codec written outside the package: records hold the expert's tensors as they are."""

    name = "copy"
    exact = True
    supports_calib = False

    def plan(self, specs) -> RawLayout:
        return IdentityCodec().plan(specs)

    def record_bytes(self, layout: RawLayout) -> int:
        return layout.nbytes

    def encode(self, tensors, layout: RawLayout, out: torch.Tensor, **_) -> None:
        out.zero_()
        IdentityCodec().encode(tensors, layout, out)

    def decode(self, record, layout: RawLayout, dtype, out=None) -> dict[str, torch.Tensor]:
        views = IdentityCodec().decode(record, layout)
        if out is None:
            return {n: v.to(dtype, copy=True) for n, v in views.items()}
        return {n: out[n].copy_(v) for n, v in views.items()}

    def linear(self, x, record, layout, name, transposed):
        w = self.decode(record, layout, x.dtype)[name]
        return x @ w if transposed else torch.nn.functional.linear(x, w)


class HalfCodec(CopyCodec):
    """A lossy codec written outside the package: fp32 experts stored as fp16 (half the bytes)."""

    name = "half"
    exact = False

    def plan(self, specs) -> RawLayout:
        return IdentityCodec().plan({n: (shape, torch.float16) for n, (shape, _) in specs.items()})

    def encode(self, tensors, layout: RawLayout, out: torch.Tensor, **_) -> None:
        super().encode({n: t.to(torch.float16) for n, t in tensors.items()}, layout, out)


@pytest.fixture
def registered():
    """Register the test codecs for one test; unregistered afterwards."""
    entries = [CodecEntry("copy", factory=CopyCodec, exact=True), CodecEntry("half", factory=HalfCodec)]
    for entry in entries:
        register_codec(entry)
    yield entries
    for entry in entries:
        unregister_codec(entry.name)


def test_register_codec_serves_a_wrapped_model_exactly(tiny_checkpoint, registered):
    path = tiny_checkpoint("mixtral")
    ref = load_reference(path)
    with torch.no_grad():
        expected = ref(IDS).logits
    model = MiraMoEModel.wrap(load_reference(path), MiraConfig(device="cpu", gpu_budget=0.5, quantization="copy"))
    assert isinstance(model.mira.store.codec, CopyCodec) and model.mira.store.exact
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)
    assert model.mira.stats()["misses"] > 0  # the experts did come through the codec's records


def test_a_registered_lossy_codec_computes_what_its_rounding_gives(tiny_checkpoint, registered):
    path = tiny_checkpoint("mixtral")
    rounded = load_reference(path)
    for name, p in rounded.named_parameters():
        if ".experts." in name:  # what fp16 storage gives back
            p.data.copy_(p.data.half().float())
    with torch.no_grad():
        expected = rounded(IDS).logits
    model = MiraMoEModel.from_pretrained(path, MiraConfig(device="cpu", gpu_budget=0.5, quantization="half"), progress=False)
    assert model.mira.store.record_bytes(0) < IdentityCodec().plan(model.mira.store.expert_specs(0)).nbytes
    assert not model.mira.store.exact
    with torch.no_grad():
        assert torch.equal(model(IDS).logits, expected)


def test_mira_config_reads_the_registry(registered):
    assert "copy" in quantizations() and MiraConfig(quantization="COPY").quantization == "copy"
    unregister_codec("copy")
    with pytest.raises(ConfigError, match=r"quantization='copy' is not supported.*lossless"):
        MiraConfig(quantization="copy")
    register_codec(registered[0])


def test_duplicate_names_and_format_codes_are_refused(registered):
    with pytest.raises(CodecRegistryError, match="'copy' is already registered"):
        register_codec(CodecEntry("copy", factory=HalfCodec))
    with pytest.raises(CodecRegistryError, match="format code 2 is taken by 'int4'"):
        register_codec(CodecEntry("int5", factory=CopyCodec, format_code=2))
    register_codec(CodecEntry("copy", factory=CopyCodec, exact=True))  # the same definition again: a no-op
    replaced = register_codec(CodecEntry("copy", factory=HalfCodec), override=True)
    assert get_codec_entry("copy") is replaced
    with pytest.raises(CodecRegistryError, match="reserved"):
        CodecEntry("auto", factory=CopyCodec)


def test_built_in_formats_keep_their_identities_on_disk():
    # the byte in every record's header: records written before stay readable
    assert format_codes() == {"int8": 1, "int4": 2, "nf4": 3, "lossless": 4}
    # what keys the record cache and a saved store's format (`codec_spec`): entries written before are found
    quant = QuantConfig()
    int4 = "PackedCodec(QuantSpec(fmt='int4', group_size=64, symmetric=False, double_quant=True, refine_iters=2, superblock_groups=64))"
    assert codec_spec(codec_for_config("int4", quant)) == dict(name="int4", group_size=64, inner=int4)
    assert codec_spec(codec_for_config("lossless", quant)) == dict(
        name="lossless", group_size=None, inner="LosslessCodec(code='classes')"
    )
    assert get_codec_entry("lossless").exact and get_codec_entry("lossless").default_placement == "packed"
    assert [get_codec_entry(n).role for n in ("fp8_block", "mxfp4")] == ["native", "native"]


@pytest.mark.parametrize("name", ["int4", "lossless"])
def test_a_bound_record_computes_what_the_checked_linear_does(name):
    codec = make_codec(name)
    g = torch.Generator().manual_seed(0)
    tensors = {"w": (0.02 * torch.randn(96, 128, generator=g)).bfloat16(), "w_bias": torch.randn(96, generator=g).bfloat16()}
    layout, record = pack_expert(codec, tensors) if name != "lossless" else _lossless(codec, tensors)
    x = torch.randn(3, 128, generator=g).bfloat16()
    bound = codec.bind(record, layout)
    assert torch.equal(bound.linear(x, "w", False), codec.linear(x, record, layout, "w", False))
    assert torch.equal(bound.raw("w_bias", torch.float32), tensors["w_bias"].float())
    with pytest.raises(CodecInputError, match="uint8"):  # checked when bound, not per token
        codec.bind(record[:-64], layout)


def _lossless(codec, tensors):
    layout = codec.plan_experts({n: t.unsqueeze(0) for n, t in tensors.items()})
    record = torch.empty(layout.nbytes, dtype=torch.uint8)
    codec.encode(tensors, layout, record)
    return layout, record


def test_backends_are_resolved_when_a_codec_is_built():
    with pytest.raises(ConfigError, match="backend='cuda' is not supported"):
        make_codec("int4", backend="cuda")
    assert make_codec("lossless", backend="torch").uses_triton(torch.empty(64, dtype=torch.uint8)) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["int4", "int8", "lossless"])
def test_a_bound_cuda_record_runs_the_backend_resolved_at_construction(name):
    codec = make_codec(name)
    g = torch.Generator().manual_seed(0)
    tensors = {"w": (0.02 * torch.randn(256, 512, generator=g)).bfloat16()}
    layout, record = pack_expert(codec, tensors) if name != "lossless" else _lossless(codec, tensors)
    record = record.cuda()
    bound = codec.bind(record, layout)
    assert bound.use_triton == codec.uses_triton(record)
    for tokens in (1, 5, 40):  # the fused kernel up to FUSED_MAX_TOKENS, dequant + matmul beyond
        x = torch.randn(tokens, 512, generator=g).bfloat16().cuda()
        assert torch.equal(bound.linear(x, "w", False), codec.linear(x, record, layout, "w", False))
