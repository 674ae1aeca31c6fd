"""Linear layers with their weights prepacked for oneDNN, for float32 models on the CPU.

``F.linear`` hands MKL a weight it repacks on every call; for decode-sized batches that copy of
every weight costs about as much as the product itself (py-spy on SmolLM2: 21% of the CPU time
in MKL's ``scopy`` against 24% in its kernel). oneDNN takes a weight packed once at load time.
"""

import torch
from torch import nn

_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any count works


def can_pack(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(),
                                                              _BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()
        probe = torch.randn(2, self.in_features, generator=torch.Generator().manual_seed(0))
        self.pad_single_row = not torch.equal(self._product(probe[:1]), self._product(probe)[:1])

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """A row's product has the same bits in any batch: oneDNN's one-row path sums another
        way past 1,024 inputs (SmolLM2's down_proj: 1.9e-6 off its many-row result, while 2 to
        4,096 rows all agree), so a lone row goes in twice where the probe at load saw it
        differ. Free at that size (161 against 164 us); the lm_head (576 inputs) needs none."""
        if self.pad_single_row and x.shape[0] == 1 and x.dim() == 2:
            return self._product(x.expand(2, -1).contiguous())[:1]
        return self._product(x)


def pack_linears(model: nn.Module) -> None:
    """Swaps every ``nn.Linear`` of ``model`` for a ``PackedLinear``, holding the weight only in
    its packed form. A tied ``lm_head`` is packed too, its embedding kept for lookups: that
    holds vocab x hidden floats twice (113 MB on SmolLM2) but spares repacking the largest
    matrix at every step (12% of the CPU time on SmolLM2, py-spy)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
