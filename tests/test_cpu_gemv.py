"""``cpu_gemv``, the CPU linear layers' product for decode batches: against torch's product,
and bit for bit against oneDNN's many-row one where ``PackedLinear``'s probe picks it."""

import pytest
import torch

from engine import LLM
from engine.cpu_linear import F32_ROWS, GEMV_ROWS, PackedLinear
from engine.cpu_malloc import HugePageArena
from kernels import cpu_gemv, cpu_native

pytestmark = pytest.mark.skipif(not cpu_gemv.available(), reason="no C compiler or AVX2 here")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 9, 17, 70, 130, 341])  # past whole tiles
@pytest.mark.parametrize(("in_features", "out_features"), [(100, 33), (576, 160), (1536, 48)])
@pytest.mark.parametrize("block", [16, 512, None])
def test_gemv_matches_torch(rows: int, in_features: int, out_features: int,
                            block: int | None) -> None:
    gen = torch.Generator().manual_seed(rows * in_features)
    linear = torch.nn.Linear(in_features, out_features, bias=rows % 2 == 1)
    x = torch.randn(rows, in_features, generator=gen)
    panels = cpu_gemv.pack_panels(linear.weight.detach())
    bias = None if linear.bias is None else linear.bias.detach()
    y = cpu_gemv.gemv(x, panels, bias, out_features, block or in_features)
    torch.testing.assert_close(y, linear(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("out_features", [16, 40, 64, 100, 144])  # 1 to 9 panels of 16
@pytest.mark.parametrize("with_bias", [False, True])
def test_few_rows_have_the_bits_of_a_batch(out_features: int, with_bias: bool) -> None:
    """One to three rows take the panels in groups of their own (on AVX2 four, three and two
    at once: cpu_gemv.c's FEW_ROWS_PANELS), yet sum as rows of a batch do: the same bits,
    whole and partial groups alike."""
    gen = torch.Generator().manual_seed(out_features)
    linear = torch.nn.Linear(1100, out_features, bias=with_bias)
    x = torch.randn(5, 1100, generator=gen)
    panels = cpu_gemv.pack_panels(linear.weight.detach())
    bias = None if linear.bias is None else linear.bias.detach()
    batch = cpu_gemv.gemv(x, panels, bias, out_features, 512)
    for rows in (1, 2, 3):
        for r in range(5 - rows + 1):
            assert torch.equal(cpu_gemv.gemv(x[r:r + rows], panels, bias, out_features, 512),
                               batch[r:r + rows])


def test_gemv_reads_strided_rows_and_refuses_what_it_cannot_take() -> None:
    linear = torch.nn.Linear(64, 40, bias=False)
    panels = cpu_gemv.pack_panels(linear.weight.detach())
    wide = torch.randn(3, 100)
    y = cpu_gemv.gemv(wide[:, 10:74], panels, None, 40, 64)  # rows 100 floats apart
    torch.testing.assert_close(y, linear(wide[:, 10:74]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="rows of the panels. inputs"):
        cpu_gemv.gemv(torch.randn(0, 64), panels, None, 40, 64)
    with pytest.raises(ValueError, match="unit stride"):
        cpu_gemv.gemv(torch.randn(64, 2).T, panels, None, 40, 64)


@pytest.mark.parametrize("in_features", [96, 576, 1536])
def test_few_rows_have_onednn_many_row_bits(in_features: int) -> None:
    """Where the probe found the block (AVX-512 machines: 512 up to 1,024 inputs, 1,024 past
    them, measured on an AMD EPYC and a Xeon), batches through the C kernel equal the same
    rows inside a batch of 1,000 through oneDNN, bit for bit: decode batches, and a prefill's
    many rows (cpu_gemv_many.h: past 128 on AVX-512, past 64 on AVX2), partial tiles and
    groups included."""
    layer = PackedLinear(torch.nn.Linear(in_features, 200, bias=True))
    if cpu_native.cpu_has("avx512f"):
        assert layer.panels is not None, "no block made cpu_gemv sum as oneDNN does"
        # one chain up to 512 inputs (the probe tries the whole width first)
        assert layer.block == min(in_features, 512 if in_features <= 1024 else 1024)
    if layer.panels is not None:
        # past GEMV_ROWS whichever ran faster at load (both: the same bits, checked below)
        assert layer.gemv_rows in (F32_ROWS, GEMV_ROWS) and F32_ROWS > 1000
    x = torch.randn(1000, in_features, generator=torch.Generator().manual_seed(in_features))
    batch = layer.onednn_product(x)
    assert GEMV_ROWS < 300
    # AVX-512: 9 to 128 chunked (to 64 on Intel with AVX-512 BF16), past it many_rows; AVX2:
    # past 64 many_rows (cpu_gemv.c)
    for rows in (1, 2, 3, 4, 8, 13, 16, 64, 65, 100, 129, GEMV_ROWS, 337, 1000):
        for start in sorted({0, 7, 1000 - rows}):
            rows_x = x[start:start + rows]
            assert torch.equal(layer(rows_x), batch[start:start + rows])
            if layer.panels is not None:  # the C kernel itself, whichever the layer picked
                assert torch.equal(cpu_gemv.gemv(rows_x, layer.panels, layer.bias,
                                                 layer.out_features, layer.block),
                                   batch[start:start + rows])


def test_the_engine_says_what_computes_few_rows(tiny_llama3) -> None:
    llm = LLM(str(tiny_llama3))
    path = llm.engine.model_runner.linear_rows
    assert path in ("c", "onednn") or path.startswith("c in ")
    if cpu_native.cpu_has("avx512f"):
        assert path == "c"


def test_panels_share_one_arena_in_huge_pages(tiny_llama3) -> None:
    """Every layer's panels are views of one allocation that starts on a 2 MiB boundary (the
    part ``madvise`` asks to be backed by huge pages), and the arena refuses to overflow."""
    model = LLM(str(tiny_llama3)).engine.model_runner.model
    panels = [m.panels for m in model.modules() if isinstance(m, PackedLinear)]
    if not cpu_native.cpu_has("avx512f"):
        panels = [p for p in panels if p is not None]
    assert panels and all(p is not None for p in panels)
    storage = {p.untyped_storage().data_ptr() for p in panels}
    assert len(storage) == 1
    assert min(p.data_ptr() for p in panels) % (2 << 20) == 0
    arena = HugePageArena(10)
    assert torch.equal(arena.take(torch.arange(6.0).view(2, 3)), torch.arange(6.0).view(2, 3))
    with pytest.raises(ValueError, match="no room"):
        arena.take(torch.ones(5))
