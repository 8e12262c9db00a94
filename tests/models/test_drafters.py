import json

import pytest
import torch

from draftlab.config import TargetSpec
from draftlab.models.drafters.build import init_drafter, load_drafter, resolve_drafter
from draftlab.models.drafters.registry import available_drafters
from draftlab.models.target import load_target


def greedy_pick(j, logits):
    return int(logits.argmax())


FAMILIES = ["p-eagle", "parallel", "autoregressive"]


def features(d, n: int) -> torch.Tensor:
    """(n, F) random target features of the width drafter `d` fuses."""
    return torch.randn(n, d.feature_size)


@pytest.fixture(scope="module")
def tiny_fp32():
    return load_target(TargetSpec(name="tiny-llama", dtype="float32"))


def test_registry_lists_families():
    assert available_drafters() == ["autoregressive", "p-eagle", "parallel"]
    with pytest.raises(
        KeyError,
        match=(
            r"unknown drafter family 'medusa'; available: \['autoregressive', 'p-eagle', "
            r"'parallel'\]"
        ),
    ):
        init_drafter("medusa", load_target("tiny-llama"))


@pytest.mark.parametrize("family", FAMILIES)
def test_propose_shapes_and_cache_rollback(tiny, family):
    d = init_drafter(family, tiny, k=4, depth=2)
    state = d.new_state()
    n = 5
    toks = torch.randint(0, tiny.vocab_size, (n,))
    hid = features(d, n)
    drafts, logits = d.propose(state, toks, hid, 4, greedy_pick)
    assert drafts.shape == (4,) and logits.shape == (4, tiny.vocab_size)
    assert torch.equal(drafts, logits.argmax(-1))
    # Only the committed entries stay in the drafter cache: masks / drafts are dropped.
    assert state.cache.get_seq_length() == n and state.pos == 1 + n


@pytest.mark.parametrize("family", ["parallel", "p-eagle"])
def test_parallel_one_pass_equals_stepwise_masks(tiny, family):
    """The k-1 masks see the context causally: drafting with k masks in one pass gives the
    same per-position logits as k separate passes over context + j masks."""
    d = init_drafter(family, tiny, k=4, depth=1, seed=3)
    toks = torch.randint(0, tiny.vocab_size, (6,))
    hid = features(d, 6)
    _, one_pass = d.propose(d.new_state(), toks, hid, 4, greedy_pick)
    for k in range(1, 5):
        _, lk = d.propose(d.new_state(), toks, hid, k, greedy_pick)
        torch.testing.assert_close(lk, one_pass[:k], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_rounds_of_proposals_equal_a_fresh_forward_over_the_committed_entries(tiny_fp32, family):
    """Round after round, with 1-3 entries committed each time (partial acceptance), every
    draft distribution equals a cache-free `forward` of the drafter over all committed
    entries plus the round's slots: the cached `step` path and the slot cropping drop nothing
    and keep nothing stale. In float32: bf16 rounds the cached and recomputed keys apart."""
    torch.manual_seed(0)
    d = init_drafter(family, tiny_fp32, k=4, depth=2, seed=5)
    k = 1 if family == "autoregressive" else 4  # its deeper drafts feed back its own tokens
    state, toks, feats = (
        d.new_state(),
        torch.empty(0, dtype=torch.long),
        torch.empty(0, d.feature_size),
    )
    for new in [7, 1, 3, 2, 1, 3]:
        t, f = torch.randint(0, tiny_fp32.vocab_size, (new,)), features(d, new)
        _, got = d.propose(state, t, f, k, greedy_pick)  # (k, V)
        toks, feats = torch.cat([toks, t]), torch.cat([feats, f])
        with torch.inference_mode():
            x = d.fuse(toks, feats)
            if k > 1:
                x = torch.cat([x, d.mask_input(torch.arange(k - 1)).to(x.dtype)])
            h = d(x[None], torch.arange(1, 1 + len(x))[None])[0]  # (n + k-1, H), no cache
        torch.testing.assert_close(got, d.logits(h[len(toks) - 1 :]), atol=1e-5, rtol=1e-5)
        assert state.cache.get_seq_length() == len(toks) and state.pos == 1 + len(toks)


def test_parallel_k_above_trained_fails(tiny):
    d = init_drafter("parallel", tiny, k=3)
    with pytest.raises(ValueError, match="k <= 3"):
        d.propose(
            d.new_state(), torch.tensor([1]), torch.zeros(1, tiny.hidden_size), 4, greedy_pick
        )


@pytest.mark.parametrize("family", FAMILIES)
def test_save_load_round_trip(tmp_path, tiny, family):
    d = init_drafter(family, tiny, k=4, depth=2, seed=7)
    d.save(tmp_path / "drafter")
    assert sorted(p.name for p in (tmp_path / "drafter").iterdir()) == [
        "config.json",
        "model.safetensors",
    ]
    cfg = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert cfg["target_fingerprint"] == tiny.fingerprint and cfg["family"] == family
    loaded = load_drafter(tmp_path / "drafter", tiny)
    for (n1, p1), (n2, p2) in zip(d.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert n1 == n2 and torch.equal(p1, p2)
    toks, hid = torch.tensor([3, 4, 5]), features(d, 3)
    _, a = d.propose(d.new_state(), toks, hid, 3, greedy_pick)
    _, b = loaded.propose(loaded.new_state(), toks, hid, 3, greedy_pick)
    torch.testing.assert_close(a, b)
    # The target's embedding and head are referenced, never saved.
    assert not any("embed_tokens" in k or "lm_head" in k for k in d.state_dict())


def test_load_against_wrong_target_fails(tmp_path, tiny):
    init_drafter("parallel", tiny).save(tmp_path / "d")
    with pytest.raises(
        ValueError, match=r"built for target 'tiny-llama'.*loaded target is 'tiny-llama-v8'"
    ):
        load_drafter(tmp_path / "d", load_target("tiny-llama-v8"))


def test_load_missing_or_corrupt_dir_fails(tmp_path, tiny):
    with pytest.raises(FileNotFoundError, match="not a drafter directory"):
        resolve_drafter(str(tmp_path), tiny)
    d = init_drafter("parallel", tiny, depth=1)
    d.save(tmp_path / "d")
    cfg = json.loads((tmp_path / "d" / "config.json").read_text())
    cfg["depth"] = 2
    cfg["decoder"]["num_hidden_layers"] = 2
    (tmp_path / "d" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="weights do not match the config"):
        load_drafter(tmp_path / "d", tiny)


def test_drafter_dtype_moves_never_touch_the_target_head(tiny):
    """The frozen target head is referenced, not registered: converting the drafter (float32
    master weights in training) must not convert the shared target in place, nor save it."""
    import torch

    from draftlab.models.drafters.build import init_drafter

    before = tiny.lm_head.weight.dtype
    drafter = init_drafter("parallel", tiny, k=2, depth=1).to(torch.float64)
    assert tiny.lm_head.weight.dtype == before
    assert not any(p is tiny.lm_head.weight for p in drafter.parameters())
    assert "_head_weight" not in drafter.state_dict()


def test_p_eagle_layout_is_vllms(tiny):
    """The EAGLE-3 layout vLLM loads: fc over the aux states, a first layer whose q/k/v read
    2H inputs and that has a hidden_norm, one shared mask_hidden of the aux width."""
    d = init_drafter("p-eagle", tiny, k=3, depth=2)
    h, aux = tiny.hidden_size, d.cfg.aux_layers
    assert (
        aux == [0, 1] and d.cfg.mask_token_id is not None
    )  # 2-layer target: 0, L/2, L-1 deduplicated
    sd = d.state_dict()
    assert sd["fc.weight"].shape == (h, len(aux) * h)
    assert sd["mask_hidden"].shape == (1, len(aux) * h)
    assert sd["decoder.layers.0.self_attn.q_proj.weight"].shape[1] == 2 * h
    assert sd["decoder.layers.0.hidden_norm.weight"].shape == (h,)
    assert (
        sd["decoder.layers.1.self_attn.q_proj.weight"].shape[1] == h
    )  # later layers are stock Llama
    assert not any("mask_embeddings" in k for k in sd)


def test_p_eagle_slots_share_one_input_and_differ_by_position(tiny):
    d = init_drafter("p-eagle", tiny, k=4, depth=1, seed=2)
    slots = d.mask_input(torch.arange(3))  # (3, 2H)
    assert torch.equal(slots[0], slots[2])
    _, logits = d.propose(d.new_state(), torch.tensor([5, 6, 7]), features(d, 3), 4, greedy_pick)
    assert not torch.allclose(logits[1], logits[2])  # same input, other position (RoPE) and context


def test_p_eagle_rejects_features_without_aux_states(tiny):
    d = init_drafter("p-eagle", tiny, k=2)
    with pytest.raises(ValueError, match=r"p-eagle needs the target's states at layers \[0, 1\]"):
        d.propose(
            d.new_state(), torch.tensor([1, 2]), torch.zeros(2, tiny.hidden_size), 2, greedy_pick
        )
    with pytest.raises(ValueError, match=r"aux_layers \[5\] must be layer ids in \[0, 1\]"):
        init_drafter("p-eagle", tiny, aux_layers=[5])


def test_target_features_are_the_residual_states_after_each_aux_layer(tiny):
    """Target.forward(aux_layers=...) returns [state after layer i for each i; last hidden],
    as vLLM's EAGLE-3 aux hidden states (hidden + residual after i layers)."""
    ids = torch.tensor([4, 9, 11, 20])
    _, last = tiny.forward(ids, torch.arange(4), tiny.new_cache())
    logits, feats = tiny.forward(ids, torch.arange(4), tiny.new_cache(), aux_layers=(0, 1))
    h = tiny.hidden_size
    assert feats.shape == (4, 3 * h)
    torch.testing.assert_close(feats[:, -h:], last)
    torch.testing.assert_close(feats[:, :h], tiny.embed(ids))  # after 0 layers: the embeddings
    with torch.inference_mode():
        x = tiny.embed(ids)[None]
        pos = torch.arange(4)[None]
        pe = tiny.model.model.rotary_emb(x, pos)
        after1 = tiny.model.model.layers[0](
            x, attention_mask=None, position_embeddings=pe, position_ids=pos
        )
    torch.testing.assert_close(feats[:, h : 2 * h], after1[0], atol=1e-5, rtol=1e-4)
