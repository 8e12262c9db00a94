"""P-EAGLE: vLLM's parallel drafting (an EAGLE-3 drafter, `parallel_drafting: true`).

The math is vLLM 0.29's `model_executor/models/llama_eagle3.py` and
`v1/spec_decode/llm_base_proposer.py`, so `draftlab export --format vllm` is a renaming:

* features: the target's residual states after 3 layers (`aux_layers`; vLLM's default
  (2, L/2, L-3)), concatenated (3H) and projected by `fc` to H;
* decoder layer 0 attends over [input_layernorm(embed(x)); hidden_norm(fc(aux))] (2H
  inputs to q/k/v) with fc(aux) as its residual; layers 1.. are stock Llama layers; then
  `norm` and the (trimmed) head;
* the k-1 parallel slots all take the same input: the embedding of `mask_token_id`
  (vLLM's `ptd_token_id`) and fc(`mask_hidden`), one learned (1, 3H) vector. Slots
  differ only by position. One forward drafts k tokens, as `parallel` does.

Any k works at inference (the slots share one input); quality beyond the trained K is
untrained territory, so `check_k` keeps k <= K as for `parallel`.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRMSNorm

from draftlab.models.drafters.network import DrafterConfig
from draftlab.models.drafters.parallel import ParallelDrafter
from draftlab.models.drafters.registry import register_drafter
from draftlab.models.target import Target


def resolve_aux_layers(value: list[int] | str | None, num_layers: int) -> list[int]:
    """A config's `aux_layers` (ids, `eagle3` or None) as layer ids (None = none)."""
    if value is None:
        return []
    return eagle3_aux_layers(num_layers) if value == "eagle3" else list(value)


def eagle3_aux_layers(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 feature layers for a target of `num_layers` decoder layers
    (low, middle, high); targets under 6 layers (test models) take 0, L/2 and L-1."""
    if num_layers >= 6:
        return [2, num_layers // 2, num_layers - 3]
    return sorted({0, num_layers // 2, num_layers - 1})


class FusedInputLayer(LlamaDecoderLayer):
    """EAGLE-3's first decoder layer: its input is [embed; hidden] (2H), its residual the hidden."""

    def __init__(self, config: LlamaConfig):
        super().__init__(config, layer_idx=0)
        h, attn = config.hidden_size, self.self_attn
        bias = getattr(config, "attention_bias", False)
        for name in ("q_proj", "k_proj", "v_proj"):  # 2H inputs instead of H
            old = getattr(attn, name)
            setattr(attn, name, nn.Linear(2 * h, old.out_features, bias=bias))
        self.hidden_norm = LlamaRMSNorm(h, eps=config.rms_norm_eps)

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        emb, hid = hidden_states.chunk(2, dim=-1)  # (B, T, H) each
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(hid)], dim=-1)  # (B, T, 2H)
        attn, _ = self.self_attn(hidden_states=x, **kwargs)  # (B, T, H)
        h = hid + attn  # the residual stream starts at the fused hidden state
        return h + self.mlp(self.post_attention_layernorm(h))  # (B, T, H)


@register_drafter("p-eagle")
class PEagleDrafter(ParallelDrafter):
    @classmethod
    def configure(cls, cfg: DrafterConfig, target: Target) -> DrafterConfig:
        n = target.num_layers
        layers = cfg.aux_layers or eagle3_aux_layers(n)
        if len(layers) < 1 or any(not 0 <= i < n for i in layers):
            raise ValueError(
                f"aux_layers {layers} must be layer ids in [0, {n - 1}] of the target ({n} layers)"
            )
        tok = target.tokenizer
        mask = cfg.mask_token_id
        if mask is None:  # any fixed token works (its embedding is frozen, the rest is learned)
            mask = next(
                t
                for t in (tok.pad_token_id, tok.unk_token_id, tok.eos_token_id, 0)
                if t is not None
            )
        return cfg.model_copy(update={"aux_layers": list(layers), "mask_token_id": int(mask)})

    def fc_inputs(self, hidden: int) -> int:
        return len(self.cfg.aux_layers) * hidden

    def build_extra(self, cfg: DrafterConfig) -> None:
        self.decoder.layers[0] = FusedInputLayer(self.decoder.config)
        # vLLM loads it as a buffer; here it is learned.
        self.mask_hidden = nn.Parameter(
            torch.randn(1, self.fc_inputs(cfg.decoder["hidden_size"])) * 0.02
        )

    def _project(self, emb: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
        """(..., H) embeddings + (..., 3H) aux states -> (..., 2H) decoder inputs."""
        hid = self.fc(aux.to(self.fc.weight.dtype))  # (..., H)
        return torch.cat([emb.to(hid.dtype), hid], dim=-1)  # (..., 2H)

    def fuse(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        aux = features[..., : self.fc.in_features]  # (..., 3H): the last hidden state follows
        if aux.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"p-eagle needs the target's states at layers {self.cfg.aux_layers} "
                f"({self.fc.in_features} columns), got {features.shape[-1]}"
            )
        return self._project(self._target_io[0](tokens), aux)

    def mask_input(self, j: torch.Tensor) -> torch.Tensor:
        tok = torch.full((1,), self.cfg.mask_token_id, device=self.mask_hidden.device)
        x = self._project(self._target_io[0](tok), self.mask_hidden)[0]  # (2H,)
        return x.expand(*j.shape, x.shape[-1])  # (..., 2H): every slot alike
