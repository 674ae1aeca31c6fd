"""Linear layers with their weights prepacked for oneDNN, for float32 models on the CPU.

``F.linear`` hands MKL a weight it repacks on every call; for decode-sized batches that copy of
every weight costs about as much as the product itself (py-spy on SmolLM2: 21% of the CPU time
in MKL's ``scopy`` against 24% in its kernel). oneDNN takes a weight packed once at load time.

Its packed product is a poor matrix-vector product, though: at one to four rows (one user's
decode step) ``kernels.skinny_linear`` reads the plain weight at 32-40 GB/s where oneDNN's
reads its packed one at 24 (``kernels.cpu_ops``), and a batch-1 step is almost all weight
reads. So each layer keeps both: the plain weight costs the layers' float32 size once more
(SmolLM2: +425 MB; its tied lm_head's plain weight is the embedding, held anyway).
"""

import torch
from torch import nn

import kernels

_BATCH_HINT = 64  # oneDNN picks the packed layout for this many rows; any count works
SKINNY_ROWS = 4  # up to this many rows, kernels.skinny_linear on the plain weight


def can_pack(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype == torch.float32
            and torch.backends.mkldnn.is_available())


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(self.weight, _BATCH_HINT)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= SKINNY_ROWS:
            out = kernels.skinny_linear(x, self.weight)
            return out if self.bias is None else out.add_(self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> None:
    """Swaps every ``nn.Linear`` of ``model`` for a ``PackedLinear``. A tied ``lm_head`` is
    packed too, its embedding kept for lookups: that holds vocab x hidden floats twice (113 MB
    on SmolLM2) but spares repacking the largest matrix at every step (12% of the CPU time on
    SmolLM2, py-spy)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child))
