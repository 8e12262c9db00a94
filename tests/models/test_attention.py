"""Row-exact attention: a verified block reproduces token-by-token decoding bit for bit.

The model is a random GQA Llama (4 query heads on 2 KV heads of dim 64) in bfloat16. With a
30-token context, plain SDPA over a block, or key counts padded to anything but whole
16-key blocks, gives rows that differ in the last bits from decoding (the tests fail with
`attention.BLOCK = 1`): that is what row-exact attention must remove.
"""

import os
import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from draftlab.decoding.ngram import graft
from draftlab.decoding.tree import load_tree
from draftlab.models import attention, fused_attention, row_kernel
from draftlab.models.target import (
    Target,
    cpu_has_amx_bf16,
    cpu_has_fast_bf16,
    rows_invariant_linears,
)

PREFIX = torch.arange(30) % 23 + 3


def _prefilled(target):
    cache = target.new_cache()
    target.forward(PREFIX, torch.arange(len(PREFIX)), cache)
    return cache


def _stepwise(target, path: list[int]) -> torch.Tensor:
    """Logits (len(path), V) of feeding `path` one token per forward after the prefix."""
    cache, ctx = _prefilled(target), len(PREFIX)
    rows = [
        target.forward(torch.tensor([tok]), torch.tensor([ctx + i]), cache)[0]
        for i, tok in enumerate(path)
    ]
    return torch.cat(rows)


@pytest.fixture(scope="module")
def tiny_bf16(tiny):
    if not cpu_has_fast_bf16():
        pytest.skip("bit-exact bf16 rows rely on oneDNN's AMX or AVX512-BF16 matmuls")
    cfg = LlamaConfig(
        vocab_size=tiny.vocab_size,
        hidden_size=256,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    attention.install(model)
    if not cpu_has_amx_bf16():  # as load_target does
        rows_invariant_linears(model)
    return Target("gqa-bf16", model, tiny.tokenizer, "random")


def _need_kernel() -> None:
    if row_kernel.compiler() is None:
        pytest.skip("no C++ compiler: the row kernel cannot be built here (CI installs g++)")
    if row_kernel.load() is None:
        pytest.fail("the CPU row kernel did not build here (see the warning above)")


@pytest.fixture(params=["kernel", "sdpa"])
def rows_impl(request, monkeypatch):
    """Row-exact attention through the CPU row kernel, or through SDPA per row (what runs
    where the kernel cannot be built): both must reproduce decoding bit for bit."""
    if request.param == "kernel":
        _need_kernel()
    else:
        monkeypatch.setattr(row_kernel, "supports", lambda query, key: False)
    return request.param


@pytest.mark.parametrize(
    "path", [[4, 9, 33, 12, 6], [7, 1, 2, 40, 5, 5, 8, 19, 3, 11, 6, 2, 9, 30]]
)
def test_chain_block_equals_token_by_token_bitwise(tiny_bf16, rows_impl, path):
    ctx = len(PREFIX)
    cache = _prefilled(tiny_bf16)
    rows = [ctx + i + 1 for i in range(len(path))]
    block, _ = tiny_bf16.forward(
        torch.tensor(path), torch.arange(ctx, ctx + len(path)), cache, rows=rows
    )
    assert torch.equal(block, _stepwise(tiny_bf16, path))


@pytest.mark.parametrize("grafted", [False, True], ids=["static", "grafted"])
def test_tree_rows_see_only_their_ancestors_bitwise(tiny_bf16, rows_impl, grafted):
    """Rows of a tree block equal decoding their root-to-node paths. A grafted tree's branch
    leads the block as a chain: those rows read the cache in place (`RowPlan.prefix`), the
    others gather their keys; a static (len, lex)-ordered tree leads with the root and [0]."""
    tree = load_tree("small-6")
    tokens = [4, 9, 33, 12, 6, 21, 14][: tree.num_nodes + 1]
    if grafted:
        tree, tokens = graft(tree, tokens, [9, 6, 40, 41])
    ctx = len(PREFIX)
    cache = _prefilled(tiny_bf16)
    seen = [row.nonzero()[:, 0] for row in tree.ancestor_mask]
    plan = attention.RowPlan.tree(
        ctx,
        torch.nn.utils.rnn.pad_sequence(seen, batch_first=True),
        torch.tensor([len(s) for s in seen]),
    )
    assert plan.prefix == (5 if grafted else 2)
    explicit = attention.RowPlan.build([torch.cat([torch.arange(ctx), ctx + s]) for s in seen])
    assert torch.equal(plan.mask, explicit.mask)
    assert torch.equal(plan.index[plan.mask[:, 0, 0]], explicit.index[explicit.mask[:, 0, 0]])
    positions = ctx + tree.depths
    block, _ = tiny_bf16.forward(torch.tensor(tokens), positions, cache, rows=plan)
    for node, s in enumerate(seen):  # each node's row equals decoding its root-to-node path
        path = [tokens[i] for i in s.tolist()]
        assert torch.equal(block[node], _stepwise(tiny_bf16, path)[-1]), f"node {node}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_row_kernel_rows_do_not_depend_on_their_neighbours(dtype):
    """The kernel's contract, on its own: a row over a shuffled gather of its keys, computed
    beside other rows on two threads, equals the same row alone on one thread, bit for bit;
    and it is attention (float32 SDPA over the same keys, to float32 rounding)."""
    _need_kernel()
    g = torch.Generator().manual_seed(0)
    kv, heads, d, keys = 2, 6, 64, 700
    k, v = (torch.randn(kv, keys, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(5, heads, d, generator=g)
    counts = torch.tensor([1, 17, 300, 640, 700])
    index = torch.stack([torch.randperm(keys, generator=g) for _ in range(5)])  # (5, keys)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        block = row_kernel.rows_attention(q, k, v, index, counts, 0.125)
        torch.set_num_threads(1)
        for r in range(5):
            n = int(counts[r])
            alone = row_kernel.rows_attention(
                q[r : r + 1], k, v, index[r : r + 1, :n], counts[r : r + 1], 0.125
            )
            assert torch.equal(alone[0], block[r]), f"row {r}"
            kr, vr = (
                t[:, index[r, :n]].float().repeat_interleave(heads // kv, 0) for t in (k, v)
            )  # (heads, n, d)
            ref = torch.nn.functional.scaled_dot_product_attention(
                q[r][:, None], kr, vr, scale=0.125
            )[:, 0]
            torch.testing.assert_close(block[r], ref, rtol=1e-5, atol=1e-6)
    finally:
        torch.set_num_threads(threads)


def test_row_kernel_is_used_on_cpu_and_can_be_turned_off(tiny, monkeypatch):
    """A CPU decoding step goes through the kernel; `DRAFTLAB_ROW_KERNEL=0` falls back."""
    _need_kernel()
    assert row_kernel.supports(torch.zeros(1, 4, 1, 64), torch.zeros(1, 2, 3, 64))
    assert not row_kernel.supports(torch.zeros(1, 4, 1, 48), torch.zeros(1, 2, 3, 48))  # head size
    assert not row_kernel.supports(
        torch.zeros(1, 4, 1, 64), torch.zeros(1, 2, 3, 64, dtype=torch.float16)
    )
    calls = []
    real = row_kernel.rows_attention
    monkeypatch.setattr(
        row_kernel, "rows_attention", lambda *a: calls.append(a[0].shape) or real(*a)
    )
    cache = _prefilled(tiny)
    tiny.forward(torch.tensor([5]), torch.tensor([len(PREFIX)]), cache)
    assert calls and all(shape[0] == 1 for shape in calls)  # one row per layer
    row_kernel.load.cache_clear()
    monkeypatch.setenv("DRAFTLAB_ROW_KERNEL", "0")
    try:
        assert row_kernel.load() is None
    finally:
        row_kernel.load.cache_clear()


LOAD = "from draftlab.models import row_kernel; assert row_kernel.load() is not None"
HOLD = """
import fcntl, sys, time
from draftlab.models import row_kernel
lock_file = row_kernel.lock_path(row_kernel.build_dir())
lock_file.parent.mkdir(parents=True, exist_ok=True)
lock = open(lock_file, "w")
fcntl.flock(lock, fcntl.LOCK_EX)
print("held", flush=True)
time.sleep(600)
"""


@pytest.mark.slow  # kills a real kernel build
def test_a_process_killed_while_loading_the_kernel_blocks_no_later_one(tmp_path):
    """Ray workers are killed at any point (node faults, tests), also inside the kernel's
    load or build. What they leave (torch's build lock file, which outlives its process; a
    build directory half-built; our own lock, held when killed) must not make a later process
    wait: with torch's lock alone, every later load of that directory waited for ever."""
    _need_kernel()
    env = {**os.environ, "DRAFTLAB_KERNEL_CACHE": str(tmp_path)}
    where = tmp_path / row_kernel.build_dir().relative_to(row_kernel.kernels_dir())
    where.mkdir(parents=True)
    (where / "lock").touch()  # torch's baton, left by a process killed in cpp_extension.load
    (where.parent / f"{where.name}.tmp-1").mkdir()  # a build killed half-way
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD], env=env, stdout=subprocess.PIPE, text=True
    )
    assert holder.stdout.readline() == "held\n"
    holder.kill()
    holder.wait()
    subprocess.run([sys.executable, "-c", LOAD], env=env, check=True, timeout=300)  # builds (~20 s)
    assert (where / f"{row_kernel.NAME}.so").exists() and not list(where.parent.glob("*.tmp-*"))
    (where / "lock").touch()  # again, now beside a built kernel
    subprocess.run([sys.executable, "-c", LOAD], env=env, check=True, timeout=60)


def test_rows_must_match_queries(tiny):
    cache = _prefilled(tiny)
    with pytest.raises(ValueError, match="2 rows for 3 queries"):
        tiny.forward(torch.tensor([1, 2, 3]), torch.arange(10, 13), cache, rows=[11, 12])


def test_single_rows_equal_batched_rows_bitwise():
    """The reason for `rows_invariant_linears`: without AMX, a bf16 GEMV (one row) rounds a
    few outputs of a 1536-wide reduction differently from the 2+ row kernel."""
    if not cpu_has_fast_bf16():
        pytest.skip("bf16 matmuls are slow here: targets run in float32")
    torch.manual_seed(0)
    lin = torch.nn.Linear(1536, 576, bias=False).to(torch.bfloat16)
    rows_invariant_linears(lin)
    x = torch.randn(17, 1536, dtype=torch.bfloat16)
    for m in (2, 5, 9, 17):
        block = lin(x[:m])
        for i in range(m):
            assert torch.equal(block[i], lin(x[i : i + 1])[0]) and torch.equal(block[i], lin(x[i]))


# --- Attention chosen per device: row-exact on CPU, fused on CUDA -------------------------


def test_choose_picks_by_device_and_honours_overrides():
    """CUDA cannot run here: `torch.device("cuda")` is only a label handed to `choose`
    (nothing is allocated on it); the fused path itself is checked on CPU tensors below."""
    assert attention.choose("auto", "cpu") == "row-exact"
    assert attention.choose("auto", torch.device("cuda", 0)) == "fused"
    assert attention.choose("fused", "cpu") == "fused"
    assert attention.choose("row-exact", torch.device("cuda")) == "row-exact"
    with pytest.raises(ValueError, match="attention 'flash' is not one of auto, row-exact, fused"):
        attention.choose("flash", "cpu")


def test_target_attention_setting_selects_the_implementation(tiny):
    from pydantic import ValidationError

    from draftlab.config import TargetSpec
    from draftlab.models.target import load_target

    assert tiny.model.config._attn_implementation == attention.NAME  # auto on CPU
    fused = load_target(TargetSpec(name="tiny-llama", attention="fused"))
    assert fused.model.config._attn_implementation == fused_attention.NAME
    with pytest.raises(ValidationError, match="attention"):
        TargetSpec(name="tiny-llama", attention="flash")


def _fp32_target(tiny, mode: str) -> Target:
    """A random GQA Llama (4 query heads on 2 KV heads of dim 64) in float32; the same
    weights for every mode."""
    cfg = LlamaConfig(
        vocab_size=tiny.vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    assert attention.install(model, mode) == mode
    return Target(f"gqa-fp32-{mode}", model, tiny.tokenizer, "random")


@pytest.fixture(scope="module")
def exact32(tiny):
    return _fp32_target(tiny, "row-exact")


@pytest.fixture(scope="module")
def fused32(tiny):
    return _fp32_target(tiny, "fused")


def _tree_plan(tree, ctx: int) -> attention.RowPlan:
    ancestors, counts = tree.ancestor_rows
    return attention.RowPlan.tree(ctx, ancestors, counts)


@pytest.mark.parametrize("grafted", [False, True], ids=["static", "grafted"])
def test_fused_mask_is_the_whole_context_plus_ancestors_and_self(grafted):
    tree, tokens = load_tree("small-6"), [4, 9, 33, 12, 6, 21, 14]
    if grafted:
        tree, tokens = graft(tree, tokens, [9, 6, 40, 41])
    ctx, rows = 30, tree.num_nodes + 1
    context = torch.ones(rows, ctx, dtype=torch.bool)
    expected = torch.cat([context, tree.ancestor_mask], dim=1)  # (T, ctx + T)
    plan = _tree_plan(tree, ctx)
    assert torch.equal(plan.visible(ctx + rows), expected)
    # 2 query heads per KV head
    mask = fused_attention.block_mask(plan, ctx + rows, 2, torch.float32)
    assert mask.shape == (2 * rows, ctx + rows)
    for j in range(2):  # folded row j * T + t is row t's visibility, for either head of a KV head
        assert torch.equal(mask[j * rows : (j + 1) * rows] == 0, expected)
        assert torch.all(mask[j * rows : (j + 1) * rows][~expected] == float("-inf"))


def test_fused_mask_of_a_chain_and_of_a_decoding_step():
    ctx, rows = 30, 5
    chain = attention.RowPlan.build([ctx + i + 1 for i in range(rows)])
    causal = torch.ones(rows, ctx + rows, dtype=torch.bool).tril(ctx)  # row i sees keys 0..ctx+i
    assert torch.equal(chain.visible(ctx + rows), causal)
    step = attention.RowPlan.build([ctx + 1])  # a decoding step sees the whole cache: no mask
    assert fused_attention.block_mask(step, ctx + 1, 2, torch.float32) is None
    with pytest.raises(ValueError, match="row plan reaches key 34 but the cache has 33"):
        chain.visible(ctx + 3)


def test_fused_chain_block_matches_row_exact_and_decoding(exact32, fused32):
    path = [7, 1, 2, 40, 5, 5, 8, 19, 3, 11, 6, 2, 9, 30]
    ctx = len(PREFIX)
    rows = [ctx + i + 1 for i in range(len(path))]
    reference = _stepwise(exact32, path)  # row-exact decoding, one token per forward
    positions = torch.arange(ctx, ctx + len(path))
    for target in (exact32, fused32):
        block, _ = target.forward(torch.tensor(path), positions, _prefilled(target), rows=rows)
        torch.testing.assert_close(block, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(_stepwise(fused32, path), reference, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("grafted", [False, True], ids=["static", "grafted"])
def test_fused_tree_rows_match_decoding_their_paths(exact32, fused32, grafted):
    tree = load_tree("small-6")
    tokens = [4, 9, 33, 12, 6, 21, 14][: tree.num_nodes + 1]
    if grafted:
        tree, tokens = graft(tree, tokens, [9, 6, 40, 41])
    ctx = len(PREFIX)
    ids, positions, plan = torch.tensor(tokens), ctx + tree.depths, _tree_plan(tree, ctx)
    fused, _ = fused32.forward(ids, positions, _prefilled(fused32), rows=plan)
    exact, _ = exact32.forward(ids, positions, _prefilled(exact32), rows=plan)
    torch.testing.assert_close(fused, exact, rtol=1e-4, atol=1e-4)
    for node, row in enumerate(tree.ancestor_mask):  # each row = decoding its root-to-node path
        path = [tokens[i] for i in row.nonzero()[:, 0].tolist()]
        torch.testing.assert_close(fused[node], _stepwise(exact32, path)[-1], rtol=1e-4, atol=1e-4)


def test_fused_verify_is_one_sdpa_call_per_layer_over_the_cache_in_place(fused32):
    """No per-row key copies: every layer runs one SDPA call whose keys are the layer's KV
    cache tensor itself (same storage), with the query heads folded into the rows."""
    from torch.overrides import TorchFunctionMode

    calls = []

    class Spy(TorchFunctionMode):  # observes the real call, changes nothing
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if func is torch.nn.functional.scaled_dot_product_attention:
                calls.append((args[0].shape, args[1].shape, args[1].untyped_storage().data_ptr()))
            return func(*args, **(kwargs or {}))

    tree, ctx = load_tree("small-6"), len(PREFIX)
    rows, cache = tree.num_nodes + 1, _prefilled(fused32)
    plan = _tree_plan(tree, ctx)
    with Spy():
        fused32.forward(torch.arange(rows) + 3, ctx + tree.depths, cache, rows=plan)
    assert len(calls) == fused32.num_layers
    for (q, k, ptr), layer in zip(calls, cache.layers, strict=True):
        assert q == (1, 2, 2 * rows, 64) and k == (1, 2, ctx + rows, 64)
        assert ptr == layer.keys.untyped_storage().data_ptr()


def test_fused_forward_many_equals_each_requests_forward(fused32):
    """Several requests' blocks in one forward (the server's batching) keep each request's
    rows to its own keys under the fused mask."""
    tree = load_tree("small-6")
    rows, ctx = tree.num_nodes + 1, len(PREFIX)
    blocks = [torch.arange(rows) + 3, torch.arange(rows) + 20]
    positions = ctx + tree.depths
    alone = [
        fused32.forward(ids, positions, _prefilled(fused32), rows=_tree_plan(tree, ctx))[0]
        for ids in blocks
    ]
    items = [(ids, positions, _prefilled(fused32), _tree_plan(tree, ctx)) for ids in blocks]
    together = fused32.forward_many(items)
    for (logits, _), ref in zip(together, alone, strict=True):
        torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)


def test_fused_verify_takes_sdpa_output_in_a_transposed_layout(fused32, monkeypatch):
    """SDPA's float32 kernels on CUDA return the output as a (B, T, H, d) buffer seen through
    a transpose (non-contiguous); `.view` on it crashed the first decoding step there. CUDA
    cannot run here, so SDPA is wrapped to hand back the same values in that layout (a
    stand-in for the CUDA kernel): the block's logits must not change."""
    tree, ctx = load_tree("small-6"), len(PREFIX)
    ids, positions = torch.arange(tree.num_nodes + 1) + 3, ctx + tree.depths
    expected, _ = fused32.forward(ids, positions, _prefilled(fused32), rows=_tree_plan(tree, ctx))
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def strided(*args, **kwargs):
        out = sdpa(*args, **kwargs)  # (B, H, T, d)
        strided_out = (
            out.transpose(1, 2).contiguous().transpose(1, 2)
        )  # same values, (B, T, H, d) memory
        assert not strided_out.is_contiguous()
        return strided_out

    monkeypatch.setattr(fused_attention.F, "scaled_dot_product_attention", strided)
    got, _ = fused32.forward(ids, positions, _prefilled(fused32), rows=_tree_plan(tree, ctx))
    step, _ = fused32.forward(
        torch.tensor([5]), torch.tensor([ctx]), _prefilled(fused32)
    )  # a decoding step
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert step.shape == (1, fused32.vocab_size)
