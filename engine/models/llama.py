"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM2): GQA, RMSNorm, SwiGLU, rotary
embeddings with the rope scaling types transformers knows, tied or untied embeddings, and
Qwen2's qkv bias. q/k/v and gate/up are fused into one matmul each (see ``packed_modules``)."""

from typing import cast

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

import kernels
from engine.attention import PagedAttention
from engine.cuda_linear import GemvLinear
from engine.direct_module import DirectModule


class RMSNorm(DirectModule):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds ``residual`` first (when given); returns the normed value and the new residual.
        ``kernels.rms_norm``: transformers' LlamaRMSNorm arithmetic (fp32 inside) on the CPU,
        one fused kernel on CUDA."""
        return kernels.rms_norm(x, self.weight, self.eps, residual)


class RotaryEmbedding(DirectModule):
    cos: torch.Tensor  # buffers (register_buffer): nn.Module's __getattr__ types them loosely
    sin: torch.Tensor

    def __init__(self, config: PretrainedConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        rope = dict(getattr(config, "rope_parameters", None) or {})
        rope_type = rope.get("rope_type", "default")
        # Built on the CPU even while the model is built on "meta" for loading.
        with torch.device("cpu"):
            if rope_type == "default":
                theta = rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))
                steps = torch.arange(0, head_dim, 2, dtype=torch.int64).float()
                inv_freq, scaling = 1.0 / theta ** (steps / head_dim), 1.0
            else:
                inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, torch.device("cpu"))
            freqs = torch.outer(torch.arange(max_positions).float(), inv_freq.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor,
                k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # the reference arithmetic on the CPU, one fused kernel for q and k on CUDA
        return kernels.rotary(q, k, self.cos, self.sin, positions)


class Attention(DirectModule):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.rotary = rotary
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim,
                                   self.head_dim**-0.5)

    def forward(self, positions: torch.Tensor, x: torch.Tensor,
                keep: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's KV is stored; the output is of the rows ``keep`` (all where None)."""
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        q, k = self.rotary(positions, q, k)
        out = self.attn(q, k, v.view(-1, self.num_kv_heads, self.head_dim)).view(-1, self.q_size)
        return self.o_proj(out if keep is None else out[keep])


class MLP(DirectModule):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if isinstance(self.down_proj, GemvLinear):  # the activation fused into the product
            return self.down_proj.forward_swiglu(gate_up)
        return self.down_proj(kernels.silu_and_mul(gate_up))


class DecoderLayer(DirectModule):
    def __init__(self, config: PretrainedConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(config, rotary)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None,
                keep: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``keep``: the rows whose output is wanted (all where None); every row's KV is
        stored either way."""
        x, residual = self.input_layernorm(x, residual)
        out = self.self_attn(positions, x, keep)
        x, residual = self.post_attention_layernorm(
            out, residual if keep is None else residual[keep])
        return self.mlp(x), residual


class LlamaModel(DirectModule):
    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads)
        rotary = RotaryEmbedding(config, head_dim, max_positions)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, rotary) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output of the rows ``output_rows`` (every row where None). The
        last layer computes only those rows past its attention, as llama.cpp's graphs do (its
        ``inp_out_ids``): a prefill samples one token of each prompt, and the other tokens
        need of that layer only their stored KV. random-26m's 8 layers: a tenth of a
        prefill's products (o_proj and the MLP of one layer in eight); the same bits, a
        row's product being the same in any batch (engine.cpu_linear)."""
        x, residual = self.embed_tokens(input_ids), None
        layers = self.decoder_layers()
        for i, layer in enumerate(layers):
            x, residual = layer(positions, x, residual,
                                output_rows if i == len(layers) - 1 else None)
        return self.norm(x, residual)[0]

    def decoder_layers(self) -> list[DecoderLayer]:
        """``layers`` as what they hold: ``nn.ModuleList`` types its items as bare modules."""
        return cast(list[DecoderLayer], list(self.layers))


class LlamaForCausalLM(DirectModule):
    # fused parameter -> the checkpoint's parts, concatenated in this order
    packed_modules = {"qkv_proj": ("q_proj", "k_proj", "v_proj"),
                      "gate_up_proj": ("gate_proj", "up_proj")}

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        self.model = LlamaModel(config, max_positions)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                output_rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(input_ids, positions, output_rows)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)
