"""Linear layers with their weights prepacked for oneDNN, for float32 models on the CPU, their
weights float32 or bfloat16.

``F.linear`` hands MKL a weight it repacks on every call; for decode-sized batches that copy of
every weight costs about as much as the product itself (py-spy on SmolLM2: 21% of the CPU time
in MKL's ``scopy`` against 24% in its kernel). oneDNN takes a weight packed once at load time.

bfloat16 weights (``engine.loader``'s bfloat16 on the CPU) take float32 rows and give float32
rows: up to ``GEMV_ROWS`` rows through ``cpu_gemv``'s bfloat16 build (with AVX-512 BF16 the
inputs rounded to bfloat16 and taken in pairs, else the weights widened and the inputs as they
are), past them through oneDNN's bfloat16 product, the inputs rounded to bfloat16 (a
prefill's 2,048 x 512 x 3,072 product: 17.6 against 30.6 ms in float32, 2 threads, AMD EPYC
Zen 4 with AVX-512 BF16). oneDNN's bfloat16 products need AVX-512 (BW, VL, DQ) or
AVX-NE-CONVERT; elsewhere (AVX2) its float32 product of the rounded weights serves past
``GEMV_ROWS``, at float32's speed and memory for that copy.
"""

import sys

import torch
from torch import nn

from engine.cpu_malloc import HugePageArena
from engine.direct_module import DirectModule
from engine.timing import best_seconds
from kernels import cpu_gemv, cpu_native

_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any count works
_GEMV_BLOCKS: dict[int, int] = {}  # in_features -> the block the last probe found, tried first
# Batches up to this many rows go to cpu_gemv's few-row tiles where it serves, larger to
# oneDNN or to its many-row tiles (F32_ROWS). AVX-512's tiles (8 rows by 32 outputs, the next
# weights prefetched) led oneDNN to 256 rows (SmolLM2's 121 layers, cold, 2 threads, AMD EPYC
# Zen 5: 128 rows 74 against 80 ms, 256 rows 148 against 157); AVX2's (6 rows by 16 outputs)
# keep pace with oneDNN's AVX2 kernels to 64 rows and fall behind past them (an AMD EPYC Zen
# 3, random-26m's 32 layers: 64 rows 31.8 against 34.3 ms, 128 rows 74.7 against 64.6), where
# the many-row tiles take over.
GEMV_ROWS = 256 if cpu_native.cpu_has("avx512f") else 64
# float32 weights: every batch, a prefill's too, where past GEMV_ROWS rows cpu_gemv's many-row
# tiles (the rows split between the threads, cpu_gemv_many.h) ran faster than oneDNN's packed
# product at load (``_prefill_rows``): they give the same bits, but which leads depends on the
# machine. SmolLM2's four shapes, cold, 2 threads: a Xeon with AMX (model 167), 256 rows
# 307-313 against oneDNN's 288 GFLOP/s, 2,048 rows 320-329 against 304; an Emerald Rapids Xeon
# (model 207) whose memory feeds a core 11-13 GB/s, 512 rows 207 against 237, 2,048 rows
# 205-224 against 232-257, and 32 prompts of 256 tokens prefilled in 8.60 s against 10.13
# (medians of 4 alternating) with this choice; an AMD EPYC Zen 3 (AVX2: 6 x 16 tiles), 2,048
# rows 180-183 against 155-161.
F32_ROWS = sys.maxsize
PREFILL_PROBE_ROWS = 512
# larger layers (an output layer's vocabulary) keep cpu_gemv unprobed: they take a step's
# sampling rows, seldom past GEMV_ROWS, and their probe would cost ~0.1 s a run
PREFILL_PROBE_WEIGHTS = 1 << 23
_PREFILL_ROWS: dict[tuple[int, int], int] = {}  # (in, out) -> the gemv_rows the probe chose
ONEDNN_BF16 = (torch.backends.mkldnn.is_available()
               and torch.ops.mkldnn._is_mkldnn_bf16_supported())
# bfloat16 weights where oneDNN has AMX tiles: past a few rows its product leads cpu_gemv's
# AVX-512 BF16 pairs (a Xeon with AMX, 2 threads, cold weights; random-26m's 32 layers / SmolLM2's
# 120: 8 rows 2.16 / 10.4 ms against oneDNN's 1.90 / 13.1, 16 rows 3.90 / 17.6 against 2.22 /
# 12.7, 64 rows 14.9 / 63.8 against 4.02 / 18.5, 256 rows 60.7 / 270 against 10.3 / 43.2),
# unless cpu_gemv takes those rows to the tiles itself (cpu_gemv.tiles, one run beside
# oneDNN's: 16 rows 1.79 / 11.0 ms against 2.54 / 15.3, 64 rows 3.41 / 16.8 against 4.57 /
# 22.5, 256 rows 14.6 / 41.5 against 13.6 / 52.9), so that the native decode step keeps them.
GEMV_ROWS_AMX = 8
AMX = cpu_native.cpu_has("amx_bf16", "amx_tile")


def _row_bucket(rows: int) -> int:
    """The rows a bfloat16 product pads to: oneDNN builds a kernel for each new row count, and
    with AMX that took 3 ms where the product of 300 rows of random-26m's gate_up then took
    0.7; a run of random-26m's 128 requests met hundreds of counts (py-spy: 7 % of the main
    thread in oneDNN's primitive creation). Multiples of 16 (AMX's tile rows) to 256, of 64
    past them."""
    return -(-rows // 16) * 16 if rows <= 256 else -(-rows // 64) * 64


def can_pack(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class PackedLinear(DirectModule):
    def __init__(self, linear: nn.Linear, weight_dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().to(weight_dtype)
        # oneDNN's copy: of weight_dtype, or float32 where oneDNN has no bfloat16 product
        self.product_dtype = (weight_dtype if weight_dtype == torch.float32 or ONEDNN_BF16
                              else torch.float32)
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(self.product_dtype),
                                                              _BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        # up to this many rows through cpu_gemv's panels, where the layer has them
        self.gemv_rows = (F32_ROWS if weight_dtype == torch.float32
                          else GEMV_ROWS_AMX if self.product_dtype == torch.bfloat16 and AMX
                          and not cpu_gemv.tiles(self.in_features, weight_dtype)
                          else GEMV_ROWS)
        self.panels: torch.Tensor | None
        if weight_dtype != torch.float32:
            # no probe: oneDNN's bfloat16 (or float32) product and cpu_gemv's sum otherwise
            self.pad_single_row = False
            self.panels, self.block = ((cpu_gemv.pack_panels(weight), self.in_features)
                                       if cpu_gemv.available() else (None, 0))
            return
        probe = torch.randn(3, self.in_features, generator=torch.Generator().manual_seed(0))
        many_rows = self.onednn_product(probe)
        self.pad_single_row = not torch.equal(self.onednn_product(probe[:1]), many_rows[:1])
        self.panels, self.block = self._find_gemv(linear, probe, many_rows)
        if (self.panels is not None and F32_ROWS > GEMV_ROWS
                and self.in_features * self.out_features <= PREFILL_PROBE_WEIGHTS):
            self.gemv_rows = self._prefill_rows(self.panels)

    def _prefill_rows(self, panels: torch.Tensor) -> int:
        """F32_ROWS where cpu_gemv's product of PREFILL_PROBE_ROWS rows took less than 1.05x
        oneDNN's (``best_seconds`` of 3), else GEMV_ROWS; once a shape in a process."""
        shape = (self.in_features, self.out_features)
        if shape not in _PREFILL_ROWS:
            x = torch.randn(PREFILL_PROBE_ROWS, self.in_features,
                            generator=torch.Generator().manual_seed(0))
            best = best_seconds((lambda: cpu_gemv.gemv(x, panels, self.bias, self.out_features,
                                                       self.block),
                                 lambda: self.onednn_product(x)), 3)
            _PREFILL_ROWS[shape] = F32_ROWS if best[0] < 1.05 * best[1] else GEMV_ROWS
        return _PREFILL_ROWS[shape]

    def _find_gemv(self, linear: nn.Linear, probe: torch.Tensor,
                   many_rows: torch.Tensor) -> tuple[torch.Tensor | None, int]:
        """The weights in ``cpu_gemv``'s panels and the block of inputs with which its sums
        equal oneDNN's many-row ones bit for bit on the probe, or (None, 0) where no block
        does (or the C kernel cannot be built). On AVX-512 machines oneDNN's kernel sums
        blocks of 512 inputs up to 1,024 and 1,024 past them; elsewhere it may sum otherwise,
        and its own paths serve every batch. The panels hold the weights a second time (540
        MB more for SmolLM2): oneDNN's packed copy has no address to read."""
        if not cpu_gemv.available():
            return None, 0
        panels = cpu_gemv.pack_panels(linear.weight.detach())
        blocks = [self.in_features] + [b for b in (4096, 2048, 1024, 512, 256, 128, 64, 32, 16)
                                       if b < self.in_features]
        if self.in_features in _GEMV_BLOCKS:  # a model's layers share a few widths
            blocks.insert(0, _GEMV_BLOCKS[self.in_features])
        for block in blocks:
            rows = cpu_gemv.gemv(probe, panels, self.bias, self.out_features, block)
            if torch.equal(rows, many_rows):
                _GEMV_BLOCKS[self.in_features] = block
                return panels, block
        return None, 0

    def onednn_product(self, x: torch.Tensor) -> torch.Tensor:
        """``x``'s product through oneDNN's packed weights, whatever the rows: what ``forward``
        takes past ``gemv_rows``, and the sums ``cpu_gemv``'s are held to."""
        if self.product_dtype == torch.float32:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        rows = x.shape[0] if x.dim() == 2 else 0
        bucket = _row_bucket(rows) if rows else 0
        if bucket > rows:  # the rows padded with zeros to their bucket (see _row_bucket)
            padded = x.new_empty(bucket, x.shape[1], dtype=self.product_dtype)
            padded[:rows].copy_(x)
            padded[rows:].zero_()
            xb = padded
        else:
            xb = x.to(self.product_dtype)
        y = torch.ops.mkldnn._linear_pointwise(xb, self.packed, None, "none", [], "")
        y = y[:rows].float() if bucket > rows else y.float()
        return y if self.bias is None else y.add_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A row's product has the same bits in any batch. Up to ``gemv_rows`` rows
        (``GEMV_ROWS``; float32 weights any batch, ``F32_ROWS``, where the probe
        found cpu_gemv's many rows the faster) go to
        ``cpu_gemv`` where the probe found its block: at one row it streams the weights at 2x
        oneDNN's rate (SmolLM2's layers, 2 threads, an AMD EPYC), and to 64 rows it kept pace
        with oneDNN or led (8 rows: 3.55 against 4.12 ms over SmolLM2's five shapes, a Xeon).
        Else oneDNN: its one-row path sums another way past 1,024 inputs (SmolLM2's down_proj:
        1.9e-6 off its many-row result, while 2 to 4,096 rows all agree), so a lone row goes in
        twice where the probe at load saw it differ. Free at that size (161 against 164 us).
        bfloat16 weights keep that only within each side of ``GEMV_ROWS``: the two sum in
        other orders."""
        if (self.panels is not None and x.dim() == 2 and x.shape[0] <= self.gemv_rows
                and x.stride(1) == 1):
            return cpu_gemv.gemv(x, self.panels, self.bias, self.out_features, self.block)
        if self.pad_single_row and x.shape[0] == 1 and x.dim() == 2:
            return self.onednn_product(x.expand(2, -1).contiguous())[:1]
        return self.onednn_product(x)


def pack_linears(model: nn.Module, weight_dtype: torch.dtype = torch.float32) -> None:
    """Swaps every ``nn.Linear`` of ``model`` for a ``PackedLinear`` of ``weight_dtype``, holding
    the weight only in its packed forms (oneDNN's, and ``cpu_gemv``'s panels where they
    serve). A tied ``lm_head``
    is packed too, its embedding kept for lookups: that holds vocab x hidden floats twice (113
    MB on SmolLM2) but spares repacking the largest matrix at every step (12% of the CPU time
    on SmolLM2, py-spy)."""
    linears = [(module, name, child) for module in list(model.modules())
               for name, child in module.named_children() if type(child) is nn.Linear]
    # cpu_gemv's panels in huge pages, each moved there as its layer is packed (one layer's
    # copy at a time beside the arena)
    arena = HugePageArena(sum(cpu_gemv.packed_size(c.out_features, c.in_features, weight_dtype)
                              for _, _, c in linears), weight_dtype)
    for module, name, child in linears:
        layer = PackedLinear(child, weight_dtype)
        if layer.panels is not None:
            layer.panels = arena.take(layer.panels)
        setattr(module, name, layer)


def few_rows_path(model: nn.Module) -> str | None:
    """For the start-up log: what computes a decode of up to ``GEMV_ROWS`` rows in the
    packed layers, ``"c"`` (every layer found its block), ``"onednn"`` (none did) or ``"c in
    a of b layers"``; None where no layer is packed."""
    layers = [m for m in model.modules() if isinstance(m, PackedLinear)]
    fast = sum(m.panels is not None for m in layers)
    if not layers:
        return None
    return "c" if fast == len(layers) else "onednn" if not fast else (
        f"c in {fast} of {len(layers)} layers")
