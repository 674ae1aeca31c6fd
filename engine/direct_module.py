"""``DirectModule``: an ``nn.Module`` whose call goes straight to ``forward``.

``nn.Module.__call__`` checks for compiled forwards, tracing, and eight kinds of hooks before it
calls ``forward``. A decode step of SmolLM2 makes some 330 module calls, and streaming the
weights through the caches (0.54 GB a step) leaves that Python cold: skipping those checks in
every module of the model made one stream 1.039x faster (median of 12 paired runs of 64 tokens,
alternating in one process, 0.89-1.15x: this machine's speed wanders; 2 threads, AMD EPYC).
The price: module hooks do not fire on these modules, and nothing here uses them.
"""

from typing import Any

from torch import nn


class DirectModule(nn.Module):
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)
