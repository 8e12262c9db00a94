import pytest
import torch
import torch.nn.functional as F
from torch import nn

from draftlab.config import TargetSpec
from draftlab.models.presets import available_presets
from draftlab.models.target import load_target, weight_major_linears, weights_fingerprint


def test_tiny_presets_load_fast_and_frozen(tiny):
    assert tiny.name == "tiny-llama"
    assert not any(p.requires_grad for p in tiny.model.parameters())
    assert tiny.eos_token_ids == {tiny.tokenizer.eos_token_id}


def test_forward_returns_logits_and_hidden(tiny):
    cache = tiny.new_cache()
    ids = torch.tensor(tiny.encode_prompt("Hi"))
    logits, hidden = tiny.forward(ids, torch.arange(len(ids)), cache)
    assert logits.shape == (len(ids), tiny.vocab_size)
    assert hidden.shape == (len(ids), tiny.hidden_size)
    ref = tiny.model(ids[None]).logits[0]
    torch.testing.assert_close(logits, ref.float(), atol=1e-5, rtol=1e-5)
    assert cache.get_seq_length() == len(ids)


def test_fingerprint_is_stable_and_distinguishes_weights(tiny):
    again = load_target("tiny-llama")
    assert again.fingerprint == tiny.fingerprint
    other = load_target("tiny-llama-v8")
    assert other.fingerprint != tiny.fingerprint
    with torch.no_grad():
        again.model.lm_head.weight[0, 0] += 1.0
    assert weights_fingerprint(again.model) != tiny.fingerprint


def test_chat_template_applied(tiny):
    ids = tiny.encode_prompt("Hi")
    assert tiny.tokenizer.decode(ids) == "<user>Hi</s><assistant>"
    chat = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Yo"},
        {"role": "user", "content": "Again"},
    ]
    assert (
        tiny.tokenizer.decode(tiny.encode_prompt(chat))
        == "<user>Hi</s><assistant>Yo</s><user>Again</s><assistant>"
    )


def test_local_dir_roundtrip(tmp_path, tiny):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    local = load_target(str(tmp_path))
    assert local.fingerprint == tiny.fingerprint


def test_bad_targets_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="not an HF model directory"):
        load_target(str(tmp_path))
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_target(str(tmp_path / "x.gguf"))
    with pytest.raises(ValueError, match="nonsense"):
        TargetSpec(name="tiny-llama", nonsense=1)
    assert "smollm2-135m" in available_presets()


def test_float32_cpu_linears_take_several_rows_weight_major():
    """On a CPU in float32, 2+ rows go through (W @ x^T)^T (2-3x faster there for verify
    blocks); one row is the plain GEMV, bit for bit; every row count matches F.linear."""
    tiny = load_target(TargetSpec(name="tiny-llama", device="cpu", dtype="float32"))
    linears = [m for m in tiny.model.modules() if isinstance(m, nn.Linear)]
    assert linears and all(getattr(m, "_draftlab_weight_major", False) for m in linears)
    gen = torch.Generator().manual_seed(0)
    for m in (tiny.model.model.layers[0].self_attn.q_proj, tiny.lm_head):
        for shape in (
            (1, 1, m.in_features),
            (3, m.in_features),
            (1, 5, m.in_features),
            (2, 4, m.in_features),
        ):
            x = torch.randn(*shape, generator=gen)
            want = F.linear(x, m.weight, m.bias)
            got = m(x)
            assert got.shape == want.shape
            if x.numel() == x.shape[-1]:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    biased = nn.Linear(8, 3)
    weight_major_linears(biased)
    weight_major_linears(biased)  # idempotent: wrapped once
    x = torch.randn(4, 8, generator=gen)
    torch.testing.assert_close(biased(x), F.linear(x, biased.weight, biased.bias))
