"""The frozen target LM: one forward gives logits *and* last hidden states for the drafter.

Composes with any HF causal LM (`get_decoder()` + `get_output_embeddings()`); no model
file is forked. All calls use batch size 1 and a transformers `DynamicCache`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    DynamicCache,
    GenerationConfig,
    PreTrainedModel,
)

from draftlab.config import TargetSpec
from draftlab.decoding.cache import StackedCache
from draftlab.errors import DraftlabError
from draftlab.models import attention
from draftlab.models.fingerprint import NotFromFiles, files_fingerprint, weights_fingerprint
from draftlab.models.presets import PRESETS, available_presets, preset_files


@dataclass
class Target:
    name: str
    model: PreTrainedModel
    tokenizer: object
    fingerprint: str
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.lm_head.weight.shape[0]

    @property
    def embed(self) -> nn.Embedding:
        return self.model.get_input_embeddings()

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.get_output_embeddings()

    def new_cache(self) -> DynamicCache:
        return DynamicCache(config=self.model.config)

    @property
    def num_layers(self) -> int:
        return self.model.config.num_hidden_layers

    def features(self, out, aux_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """(B, T, F) drafter features from a decoder output: the residual states after each
        of `aux_layers` (run with `output_hidden_states`), then the last hidden state (after
        the final norm). F = (len(aux_layers) + 1) * H."""
        if not aux_layers:
            return out.last_hidden_state
        if any(not 0 <= i < self.num_layers for i in aux_layers):
            raise ValueError(
                f"aux layers {list(aux_layers)} must lie in [0, {self.num_layers - 1}]"
            )
        # hidden_states[i] = after i layers (0 = embeddings); its last entry is normed, hence < L.
        return torch.cat(
            [out.hidden_states[i] for i in aux_layers] + [out.last_hidden_state], dim=-1
        )

    def run_decoder(self, aux_layers: tuple[int, ...] = (), **kw) -> torch.Tensor:
        """The decoder on `kw` (input_ids, positions, cache, ...): (B, T, F) `features`."""
        out = self.model.get_decoder()(output_hidden_states=bool(aux_layers), **kw)
        return self.features(out, aux_layers)

    @torch.inference_mode()
    def forward(
        self,
        ids: torch.Tensor,  # (T,) new tokens
        positions: torch.Tensor,  # (T,) absolute positions
        cache: DynamicCache,
        rows: list | attention.RowPlan | None = None,  # keys per row; see attention.RowPlan
        aux_layers: tuple[int, ...] = (),
        last_logits: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Append `ids` to `cache`; return logits (T, V) float32 and features (T, F) (the
        last hidden state (T, H) without `aux_layers`; see `features`). `last_logits`: the
        last row's logits alone, (1, V) (a prefill: the LM head over every prompt row would
        cost T x V float32 for one row's use).

        A decode step (one token) and a verify block (`rows` given) use row-exact attention,
        so verified rows equal decoded rows bit for bit; a prefill (T > 1, no `rows`) is
        plain causal SDPA."""
        if rows is None and ids.numel() == 1:
            rows = [cache.get_seq_length() + 1]  # the step sees the whole cache and itself
        if isinstance(rows, list):
            rows = attention.RowPlan.build(rows, self.device)
        extra = {} if rows is None else {"draftlab_rows": rows}
        feats = self.run_decoder(
            aux_layers,
            input_ids=ids[None],
            position_ids=positions[None],
            cache=cache,
            use_cache=True,
            **extra,
        )[0]  # (T, F)
        head_in = feats[-1:] if last_logits else feats  # (1 or T, F)
        return self.lm_head(head_in[:, -self.hidden_size :]).float(), feats

    @torch.inference_mode()
    def forward_many(
        self, items: list[tuple], aux_layers: tuple[int, ...] = ()
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Several requests' blocks in one forward: items are (ids (T_i,), positions (T_i,),
        cache, rows) as `forward` takes them (`rows` as ints or a `RowPlan`). Every row keeps
        exactly the keys it sees alone (offset into the stacked caches), so each request's
        logits and features equal its own `forward`'s bit for bit."""
        if len(items) == 1:
            ids, positions, cache, rows = items[0]
            return [self.forward(ids, positions, cache, rows, aux_layers)]

        lengths = [ids.numel() for ids, *_ in items]
        rows_abs, offset = [], 0
        for ids, _, cache, rows in items:
            for r in _row_keys(rows, self.device):
                rows_abs.append(r + offset)
            offset += cache.get_seq_length() + ids.numel()
        plan = attention.RowPlan.build(rows_abs, self.device)
        stacked = StackedCache([c for _, _, c, _ in items], lengths)
        ids = torch.cat([i for i, *_ in items])
        positions = torch.cat([p for _, p, *_ in items])
        feats = self.run_decoder(
            aux_layers,
            input_ids=ids[None],
            position_ids=positions[None],
            cache=stacked,
            use_cache=True,
            draftlab_rows=plan,
        )[0]  # (sum T_i, F)
        logits = self.lm_head(feats[:, -self.hidden_size :]).float()
        return list(zip(logits.split(lengths), feats.split(lengths), strict=True))

    def encode_prompt(self, text: str | list[dict], chat: bool = True) -> list[int]:
        """Token ids for `text`, wrapped in the chat template as a user turn when one exists;
        or for OpenAI-style `messages` (a multi-turn chat) through the template."""
        tok = self.tokenizer
        messages = text if isinstance(text, list) else [{"role": "user", "content": text}]
        if chat and getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, dict) or hasattr(ids, "keys"):  # BatchEncoding in some versions
                ids = ids["input_ids"]
            return list(ids)
        return tok("\n\n".join(m["content"] for m in messages), add_special_tokens=True)[
            "input_ids"
        ]


def _row_keys(rows: list | attention.RowPlan, device: torch.device) -> list[torch.Tensor]:
    """Each row's visible cache indices as a LongTensor (ints n mean keys 0..n-1)."""
    if isinstance(rows, attention.RowPlan):
        mask = rows.mask[:, 0, 0]  # (T, Lp)
        index = (
            rows.index
            if rows.index is not None
            else torch.arange(mask.shape[1], device=device).expand_as(mask)
        )
        return [index[i][mask[i]] for i in range(mask.shape[0])]
    return [torch.arange(n, device=device) for n in rows]


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise DraftlabError(
            "device 'cuda' requested, but this torch sees no CUDA device "
            "(torch.cuda.is_available() is False): use --device cpu or auto, or install a CUDA "
            "build of torch"
        )
    return torch.device(device)


def cpu_has_amx_bf16() -> bool:
    """True on CPUs with AMX tiles (Xeon Sapphire Rapids+), where bf16 matmuls beat fp32."""
    return bool(getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)())


def cpu_has_fast_bf16() -> bool:
    """AMX, or AVX512-BF16 (e.g. AMD Zen 4 EPYC): bf16 matmuls of 1-16 rows cost about the
    same there, and several times less than fp32's."""
    return cpu_has_amx_bf16() or bool(
        getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)()
    )


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto`: bfloat16 on CUDA and on CPUs with fast bf16 matmuls (verifying 16 tokens
    costs about what one does there), float32 on other CPUs (where bf16 is slower)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    return getattr(torch, dtype)


def rows_invariant_linears(model: nn.Module) -> None:
    """Make every Linear compute a single row as a two-row matmul (the row, twice).

    Without AMX, oneDNN's bf16 kernel for one row (a GEMV) rounds a few outputs differently
    from its kernel for 2+ rows, which agree with each other row for row. A decode step is
    one row and a verify block several, so greedy speculative output could drift from
    decoding on near-ties; two rows cost the same as one in bf16 (see `cpu_has_fast_bf16`).
    """
    _wrap_linears(model, "_draftlab_two_rows", _two_row_forward)


def weight_major_linears(model: nn.Module) -> None:
    """Make every Linear compute 2+ rows as (W @ x^T)^T; one row stays a GEMV.

    In float32 on a CPU (torch's MKL), `x @ W^T` with a few rows against a wide weight (an LM
    head) is several times slower than the same product taken as `W @ x^T`, while a decoding
    step (one row) costs the same either way. Taken weight-major, a speculative round's
    verify block costs about one decoding step, not nearly two
    (docs/benchmarks.md#verify-cost-on-cpus). (Rows match `x @ W^T`'s to float32 precision,
    not bit for bit; float32 rows already differ in the last bits between 1-3 and 4+ rows.)"""
    _wrap_linears(model, "_draftlab_weight_major", _weight_major_forward)


def _wrap_linears(model: nn.Module, marker: str, wrap) -> None:
    """Replace every Linear's forward by `wrap(linear)`, once per `marker`."""
    for module in model.modules():
        if isinstance(module, nn.Linear) and not getattr(module, marker, False):
            module.forward = wrap(module)
            setattr(module, marker, True)


def _weight_major_forward(linear: nn.Linear):
    inner = linear.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows <= 1:
            return inner(x)
        out = (linear.weight @ x.reshape(rows, x.shape[-1]).T).T  # (rows, out)
        if linear.bias is not None:
            out = out + linear.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def _two_row_forward(linear: nn.Linear):
    inner = linear.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.numel() != x.shape[-1]:
            return inner(x)
        flat = x.reshape(1, -1)  # (1, in)
        out = inner(torch.cat([flat, flat]))[:1]  # (1, out): row 0 of the two-row product
        return out.reshape(*x.shape[:-1], out.shape[-1])

    return forward


def freeze(model: PreTrainedModel) -> PreTrainedModel:
    model.eval()
    model.requires_grad_(False)
    return model


def _contiguous_input(module: nn.Module, args: tuple) -> tuple:
    return tuple(a.contiguous() if isinstance(a, torch.Tensor) else a for a in args)


def load_target(spec: TargetSpec | str) -> Target:
    """Load a frozen target from a preset name, hub id, local directory or GGUF file."""
    spec = TargetSpec(name=spec) if isinstance(spec, str) else spec
    device = resolve_device(spec.device)
    dtype = resolve_dtype(spec.dtype, device)
    name = spec.name
    if name in PRESETS:
        model, tokenizer = PRESETS[name](dtype)
    else:
        path = Path(name).expanduser()
        if path.suffix == ".gguf":
            if not path.is_file():
                raise FileNotFoundError(f"GGUF file not found: {path}")
            kw = dict(gguf_file=path.name, trust_remote_code=spec.trust_remote_code)
            tokenizer = AutoTokenizer.from_pretrained(path.parent, **kw)
            model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=dtype, **kw)
        else:
            looks_local = path.exists() or name.startswith((".", "/", "~"))
            if looks_local and not (path / "config.json").is_file():
                raise FileNotFoundError(
                    f"target {name!r}: {path} is not an HF model directory (no config.json). "
                    f"Presets: {available_presets()}"
                )
            try:
                tokenizer = AutoTokenizer.from_pretrained(
                    name, trust_remote_code=spec.trust_remote_code
                )
                # safetensors only: a pickled checkpoint (pytorch_model.bin) can run code on load
                # device_map: the weights go straight to the GPU (an 8B model would otherwise
                # pass through 16 GB of host memory first)
                model = AutoModelForCausalLM.from_pretrained(
                    name,
                    dtype=dtype,
                    trust_remote_code=spec.trust_remote_code,
                    use_safetensors=True,
                    **({"device_map": str(device)} if device.type == "cuda" else {}),
                )
            except OSError as e:
                raise OSError(
                    f"could not load target {name!r} (not a preset, local dir or reachable hub "
                    f"id). Presets: {available_presets()}. Cause: {e}"
                ) from None
    return assemble_target(name, model, tokenizer, device, dtype, spec.attention)


def assemble_target(
    name: str,
    model: PreTrainedModel,
    tokenizer,
    device: torch.device,
    dtype: torch.dtype,
    attention_mode: attention.Mode = "auto",
) -> Target:
    """A frozen `Target` of an HF causal LM already built or loaded: moved to `device` and
    `dtype`, with the verify attention installed and the CPU matmul arrangements applied."""
    model = freeze(model.to(device=device, dtype=dtype))
    attention.install(model, attention_mode)
    if device.type == "cpu" and dtype == torch.bfloat16 and not cpu_has_amx_bf16():
        rows_invariant_linears(model)
    if device.type == "cpu" and dtype == torch.float32:
        weight_major_linears(model)
    # HF generate's prefill hands the LM head a strided (B, 1, H) slice; torch's matmul then
    # broadcasts the (H, V) weight to (B, H, V) and copies it (GBs at V=49k). Contiguous
    # input keeps it one matmul.
    model.get_output_embeddings().register_forward_pre_hook(_contiguous_input)
    return Target(
        name,
        model,
        tokenizer,
        weights_fingerprint(model),
        _eos_ids(model.generation_config, tokenizer),
    )


def _eos_ids(generation_config, tokenizer) -> frozenset[int]:
    """The generation config's EOS ids, else the tokenizer's EOS."""
    eos = generation_config.eos_token_id if generation_config else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return frozenset([eos] if isinstance(eos, int) else (eos or []))


def placed_spec(spec: TargetSpec, use_gpu: bool, field: str, what: str) -> TargetSpec:
    """The spec a task that reserved (or did not reserve) a GPU loads: no "auto" left in
    device or dtype, resolved from `use_gpu` and the config strings alone (no CUDA query).

    The device follows `use_gpu`, not CUDA availability: Ray 2.60 leaves
    CUDA_VISIBLE_DEVICES alone for tasks that reserved no GPU, so "auto" would grab an
    unreserved GPU on a GPU node.
    """
    if spec.device == "cuda" and not use_gpu:
        raise ValueError(f"target.device is 'cuda' but {field} is False: {what} get no GPU")
    device = spec.device if spec.device != "auto" else ("cuda" if use_gpu else "cpu")
    if spec.dtype == "auto":
        dtype = (
            "bfloat16"
            if device == "cuda"
            else str(resolve_dtype("auto", torch.device("cpu"))).removeprefix("torch.")
        )
    else:
        dtype = spec.dtype
    return spec.model_copy(update={"device": device, "dtype": dtype})


@dataclass(frozen=True)
class TargetInfo:
    """What a job driver needs of a target: no weights."""

    name: str
    tokenizer: object
    fingerprint: str
    eos_token_ids: frozenset[int]


def _weights_dir(name: str) -> Path | None:
    """The directory holding a target's safetensors and tokenizer files, fetched if needed
    (files only: a hub id lands in the HF cache, where the workers on this node find it);
    None for GGUF files and in-memory presets."""
    if name in PRESETS:
        return preset_files(name)
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        return None
    if path.exists() or name.startswith((".", "/", "~")):
        return path

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken"]
    return Path(snapshot_download(name, allow_patterns=patterns))


def describe_target(spec: TargetSpec | str) -> TargetInfo:
    """Name, tokenizer, fingerprint and EOS ids of a target without loading its weights.

    The fingerprint comes from the safetensors headers and a memory-mapped sample of the
    values (`files_fingerprint`), equal to the one `load_target` computes on the loaded
    weights for the dtype `spec` resolves to. GGUF files, in-memory presets and checkpoints
    whose tensors do not map one to one onto the model's are loaded on the CPU instead.
    """
    spec = TargetSpec(name=spec) if isinstance(spec, str) else spec
    directory = _weights_dir(spec.name)
    if directory is not None:
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(
                f"target {spec.name!r}: {directory} is not an HF model directory (no config.json)"
            )
        load_dtype = resolve_dtype(
            spec.dtype, torch.device("cuda" if spec.device == "cuda" else "cpu")
        )
        try:
            fingerprint = files_fingerprint(directory, load_dtype)
        except NotFromFiles:
            directory = None
    if directory is None:
        loaded = load_target(spec.model_copy(update={"device": "cpu"}))
        return TargetInfo(loaded.name, loaded.tokenizer, loaded.fingerprint, loaded.eos_token_ids)
    tokenizer = AutoTokenizer.from_pretrained(directory, trust_remote_code=spec.trust_remote_code)
    try:
        generation_config = GenerationConfig.from_pretrained(directory)
    except OSError:  # no generation_config.json: transformers derives one from config.json
        generation_config = GenerationConfig.from_model_config(
            AutoConfig.from_pretrained(directory)
        )
    return TargetInfo(spec.name, tokenizer, fingerprint, _eos_ids(generation_config, tokenizer))
