"""The network shared by every drafter family, plus save/load.

EAGLE-style input: the entry for token x_t pairs its (frozen, target) embedding with the
target's states at t-1 (those that produced x_t), fused by `fc`, and sits at position t.
`depth` stock HF Llama decoder layers follow; the target's frozen LM head turns the result
into logits. The target's embedding and head are *referenced*, never saved.

Target states ("features") arrive as `Target.forward` returns them for the drafter's
`aux_layers`: (..., (n_aux + 1) * H), the residual states after each aux layer, then the
last hidden state (after the final norm, what the target's head reads). Families without
aux layers read the last H columns.

A family (one file each, see the registry) decides how it fuses inputs (`fuse`,
`build_extra`; the parallel families add `mask_input` and `embed_nodes`' slot inputs) and how
one drafting round uses the network:
`propose(state, tokens, features, k, pick) -> (draft_tokens (k,), logits (k, V))`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from pydantic import BaseModel, ConfigDict
from safetensors.torch import save_file
from torch import nn
from transformers import DynamicCache, LlamaConfig, LlamaModel

from draftlab.models.target import Target

Pick = Callable[[int, torch.Tensor], int]  # (draft position j, logits (V,)) -> token id


class DrafterConfig(BaseModel):
    """Saved as `config.json` next to `model.safetensors`."""

    model_config = ConfigDict(extra="forbid")

    family: str
    """Registered family name (`parallel`, `autoregressive`, ...)."""
    k: int
    """Draft tokens per round the drafter was built/trained for (parallel: k-1 masks)."""
    depth: int
    """Number of decoder layers."""
    target_name: str
    """Name of the target it was built for."""
    target_fingerprint: str
    """`weights_fingerprint` of that target; loading against other weights fails."""
    decoder: dict
    """LlamaConfig kwargs of the decoder stack (hidden size etc. follow the target)."""
    vocab_size: int | None = None
    """VocabTrim: the head scores only these many target tokens (ids saved as the
    `vocab_ids` tensor); None = the full target vocabulary."""
    aux_layers: list[int] | None = None
    """Target layers whose residual states `fc` fuses (EAGLE-3 / P-EAGLE; vLLM's
    `eagle_aux_hidden_state_layer_ids`); None = the last hidden state alone."""
    mask_token_id: int | None = None
    """P-EAGLE: the target token whose embedding every parallel slot takes (vLLM's
    `ptd_token_id`)."""


@dataclass
class DraftState:
    """Per-request drafter state: its KV cache, the position of the next entry, and inputs
    that depend on the weights alone, computed once per request (a parallel family's slot
    inputs, by k)."""

    cache: DynamicCache
    pos: int
    slots: dict[int, torch.Tensor] = field(default_factory=dict)


def decoder_config(target: Target, depth: int) -> dict:
    tc = target.model.config
    heads = tc.num_attention_heads
    return dict(
        hidden_size=tc.hidden_size,
        intermediate_size=getattr(tc, "intermediate_size", 4 * tc.hidden_size),
        num_hidden_layers=depth,
        num_attention_heads=heads,
        num_key_value_heads=getattr(tc, "num_key_value_heads", None) or heads,
        head_dim=getattr(tc, "head_dim", None) or tc.hidden_size // heads,
        max_position_embeddings=getattr(tc, "max_position_embeddings", 4096),
        rms_norm_eps=getattr(tc, "rms_norm_eps", 1e-6),
        rope_parameters=dict(
            getattr(tc, "rope_parameters", None) or {"rope_type": "default", "rope_theta": 10000.0}
        ),
        # The decoder never embeds ids (we pass inputs_embeds); a 1-row table keeps HF happy.
        vocab_size=1,
        pad_token_id=None,
        bos_token_id=None,
        eos_token_id=None,
    )


class DrafterNet(nn.Module):
    # set by @register_drafter from the family's `registry.Family`
    family: str = "?"
    trains_groups: bool = False
    uses_aux_features: bool = False

    @property
    def groups(self) -> int:
        """Training groups per packed position: K for a parallel family, 1 (EAGLE) otherwise."""
        return self.cfg.k if self.trains_groups else 1

    def __init__(self, cfg: DrafterConfig, target: Target):
        super().__init__()
        self.cfg = cfg
        hidden = cfg.decoder["hidden_size"]
        # Frozen target modules kept outside the module tree: not saved, not trained,
        # not wrapped by DDP. Stored in a tuple so nn.Module does not register them.
        self._target_io = (target.embed, target.lm_head)
        self.fc = nn.Linear(self.fc_inputs(hidden), hidden, bias=False)
        self.decoder = LlamaModel(LlamaConfig(**cfg.decoder))
        self.decoder.embed_tokens = None  # unused: inputs are fused embeddings
        self.build_extra(cfg)
        if cfg.vocab_size:
            # Filled by `set_vocab` (training) or by the saved weights (loading).
            self.register_buffer("vocab_ids", torch.zeros(cfg.vocab_size, dtype=torch.long))
        self.to(device=target.device, dtype=target.dtype)
        self.refresh_head()

    # -- building blocks (families override these) ------------------------------------
    def fc_inputs(self, hidden: int) -> int:
        """Width of `fc`'s input: [token embedding; last hidden state] here."""
        return 2 * hidden

    def build_extra(self, cfg: DrafterConfig) -> None:
        """Family parameters beyond fc + decoder (mask embeddings, ...); none here."""

    @property
    def hidden_size(self) -> int:
        return self.cfg.decoder["hidden_size"]

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """Target layers whose states `fuse` reads (`Target.forward(aux_layers=...)`)."""
        return tuple(self.cfg.aux_layers or ())

    @property
    def feature_size(self) -> int:
        """F: width of the target features `fuse` takes (aux states, then the last state)."""
        return (len(self.aux_layers) + 1) * self.hidden_size

    def fuse(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """(...,) token ids + (..., F) target features -> (..., D) decoder inputs."""
        emb = self._target_io[0](tokens)  # (..., H)
        last = features[..., -self.hidden_size :]  # (..., H) the last hidden state
        x = torch.cat([emb, last.to(emb.dtype)], dim=-1)  # (..., 2H) in the target's dtype
        return self.fc(x.to(self.fc.weight.dtype))  # (..., H); float32 master weights in training

    def forward(
        self,
        x: torch.Tensor,  # (B, T, H) fused inputs
        position_ids: torch.Tensor,  # (B, T)
        attention_mask: torch.Tensor | None = None,  # (B, 1, T, ctx+T) additive, or None = causal
        cache: DynamicCache | None = None,
    ) -> torch.Tensor:
        """Decoder hidden states (B, T, H), after the drafter's final norm."""
        out = self.decoder(
            inputs_embeds=x,
            position_ids=position_ids,
            attention_mask=attention_mask,
            cache=cache,
            use_cache=cache is not None,
        )
        return out.last_hidden_state

    # -- the (possibly trimmed) head --------------------------------------------------
    @property
    def target_vocab_size(self) -> int:
        return self._target_io[1].weight.shape[0]

    @property
    def target_head_weight(self) -> torch.Tensor:
        """(V, H) the target's full (frozen) LM head."""
        return self._target_io[1].weight

    def set_vocab(self, ids: torch.Tensor) -> None:
        """VocabTrim: score only `ids` (the most frequent target tokens)."""
        if not self.cfg.vocab_size or ids.numel() != self.cfg.vocab_size:
            raise ValueError(
                f"set_vocab needs exactly vocab_size={self.cfg.vocab_size} ids, got {ids.numel()}"
            )
        self.vocab_ids.copy_(ids.to(self.vocab_ids.device))
        self.refresh_head()

    def refresh_head(self) -> None:
        """Cache the head rows in use (the frozen target head, or its trimmed rows)."""
        w = self.target_head_weight  # (V, H)
        # A plain tensor, never the target's Parameter: assigning that would register it
        # here, so `.float()` / `.to()` on the drafter would convert the target's own head
        # in place (and `save` would write it out).
        self._head_weight = w[self.vocab_ids] if self.cfg.vocab_size else w.detach()  # (Vt, H)
        self._head_row = None
        if self.cfg.vocab_size:  # full id -> head row (-1 = trimmed away), built once
            self._head_row = torch.full((w.shape[0],), -1, dtype=torch.long, device=w.device)
            self._head_row[self.vocab_ids] = torch.arange(self.cfg.vocab_size, device=w.device)

    @property
    def head_weight(self) -> torch.Tensor:
        """(Vt, H) the frozen head rows in use: `head_logits(h)` is h @ head_weight.T."""
        return self._head_weight

    def head_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Map full target ids to rows of the head (-1 where VocabTrim dropped the id)."""
        return ids if self._head_row is None else self._head_row[ids]

    def head_logits(self, h: torch.Tensor, upcast: bool = True) -> torch.Tensor:
        """(..., H) -> (..., Vt) logits over the head's vocabulary (training): float32, or
        without `upcast` in the head's dtype (for a consumer that upcasts in a fused kernel)."""
        z = torch.nn.functional.linear(h.to(self.head_weight.dtype), self.head_weight)
        return z.float() if upcast else z

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """(..., H) -> (..., V) logits over the full target vocabulary (trimmed ids = -inf)."""
        small = self.head_logits(h)  # (..., Vt)
        if not self.cfg.vocab_size:
            return small
        full = small.new_full(
            (*small.shape[:-1], self.target_vocab_size), float("-inf")
        )  # (..., V)
        full[..., self.vocab_ids] = small
        return full

    def embed_nodes(
        self, tokens: torch.Tensor, features: torch.Tensor, mask_idx: torch.Tensor
    ) -> torch.Tensor:
        """Decoder inputs for packed training nodes.

        tokens, mask_idx: (B, M); features: (B, M, F) target states for real nodes.
        mask_idx[b, m] = j >= 0 selects parallel slot j's input (families that train groups
        override this); -1 = a real (token, state) node, the only kind a one-group family has.
        """
        return self.fuse(tokens, features)  # (B, M, D)

    def step(self, state: DraftState, x: torch.Tensor) -> torch.Tensor:
        """Append (n, D) inputs at the next positions of `state`; return (n, H) outputs.

        The same layers as `forward`, called directly: `LlamaModel.forward`'s wrappers, mask
        builder and output object cost about as much as the layer itself at these few rows
        (tests: equal to `forward` over the whole sequence, round after round)."""
        n, past = x.shape[0], state.cache.get_seq_length()
        pos = torch.arange(state.pos, state.pos + n, device=x.device)[None]  # (1, n)
        # Each new row sees the cache and the new rows up to itself. SDPA's own causal flag
        # aligns top-left, so rows after a cache need this mask; one row or no cache do not.
        mask = (
            torch.ones(n, past + n, dtype=torch.bool, device=x.device).tril(past)[None, None]
            if n > 1 and past
            else None
        )
        h = x[None]  # (1, n, D)
        rope = self.decoder.rotary_emb(h, position_ids=pos)
        for layer in self.decoder.layers:
            h = layer(
                h,
                attention_mask=mask,
                position_embeddings=rope,
                position_ids=pos,
                cache=state.cache,
                use_cache=True,
            )
        state.pos += n
        return self.decoder.norm(h)[0]  # (n, H)

    # -- per-request API ---------------------------------------------------------------
    def new_state(self, first_position: int = 1) -> DraftState:
        """Entries start at position 1: token x_0 has no preceding hidden state."""
        return DraftState(DynamicCache(config=self.decoder.config), first_position)

    def propose(
        self, state: DraftState, tokens: torch.Tensor, hidden: torch.Tensor, k: int, pick: Pick
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Commit the new entries (tokens (n,), features (n, F)) and draft k tokens.

        Returns (draft tokens (k,), draft logits (k, V)). Row j is the distribution for the
        (j+1)-th token after `tokens[-1]`. The cache keeps only the committed entries.
        """
        raise NotImplementedError

    @classmethod
    def configure(cls, cfg: DrafterConfig, target: Target) -> DrafterConfig:
        """Fill family-specific config fields for a new drafter of `target` (none here)."""
        return cfg

    def check_k(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")

    # -- persistence ---------------------------------------------------------------------
    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in self.state_dict().items()}
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "config.json").write_text(json.dumps(self.cfg.model_dump(), indent=2) + "\n")
        return path

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
