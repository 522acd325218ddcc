"""The CP partitioning of packed sequences (:mod:`megatron_tg.parallel.cp`), no processes.

Checked against what megatron-core and TE do: TE's worked example of the THD split (its
``attn_forward_func_with_cp`` docstring: sequences of 8 and 4 tokens at CP 2), megatron's
THD RoPE under CP (``_apply_rotary_pos_emb_thd`` with a CP rank), and the round trip real
order -> padded -> per-rank shares -> merged -> real order, exact, including padding
segments and sequences shorter than 2·CP.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tg.parallel.cp import CPLayout
from megatron_tg.parallel.dims import LayoutError

# Two long sequences, three shorter than 2·CP at CP 2..4, and a row-padding segment.
SEQLENS = [13, 1, 7, 2, 3, 20, 5]


def test_each_segment_padded_to_a_multiple_of_2cp():
    lay = CPLayout.build(SEQLENS, 2)
    assert lay.padded == (16, 4, 8, 4, 4, 20, 8)
    assert lay.padded_tokens == 64 and lay.local_tokens == 32 and lay.num_tokens == 51
    assert lay.cu_seqlens.tolist() == [0, 13, 14, 21, 23, 26, 46, 51]
    assert lay.cu_seqlens_padded.tolist() == [0, 16, 20, 28, 32, 36, 56, 64]
    assert lay.cu_seqlens_padded.dtype == torch.int32 and lay.max_seqlen == 20
    assert CPLayout.build(SEQLENS, 1).padded == tuple(2 * -(-n // 2) for n in SEQLENS)


def test_sequence_parallel_share_is_a_multiple_of_tp():
    # 64 padded tokens at cp 2 -> share 32; tp 3 needs the total a multiple of lcm(4, 6) = 12.
    lay = CPLayout.build(SEQLENS, 2, tp=3)
    assert lay.padded_tokens == 72 and lay.local_tokens % 3 == 0
    assert lay.padded[:-1] == (16, 4, 8, 4, 4, 20) and lay.padded[-1] == 16  # last one grows


def test_split_matches_transformer_engines_worked_example():
    # TE: seq_lens [8, 4], cp 2 -> GPU0 holds positions 0 1 6 7 | 0 3, GPU1 2 3 4 5 | 1 2.
    lay = CPLayout.build([8, 4], 2)
    assert lay.positions(0).tolist() == [0, 1, 6, 7, 0, 3]
    assert lay.positions(1).tolist() == [2, 3, 4, 5, 1, 2]
    assert lay.rank_index(0).tolist() == [0, 1, 6, 7, 8, 11]
    assert lay.rank_index(1).tolist() == [2, 3, 4, 5, 9, 10]


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_round_trip_is_exact(cp):
    lay = CPLayout.build(SEQLENS, cp, tp=2)
    x = torch.randn(sum(SEQLENS), 3, generator=torch.Generator().manual_seed(cp))
    padded = lay.pad(x, value=float("nan"))
    assert padded.shape[0] == lay.padded_tokens
    assert padded.isnan().any(dim=1).sum() == lay.padded_tokens - lay.num_tokens
    shares = [lay.split(padded, r) for r in range(cp)]
    print(f"cp={cp}: per-rank tokens {[s.shape[0] for s in shares]} of {lay.padded_tokens} "
          f"padded ({lay.num_tokens} real)")
    assert all(s.shape[0] == lay.padded_tokens // cp for s in shares)
    # Every padded token is on exactly one rank.
    held = torch.cat([lay.rank_index(r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(lay.padded_tokens))
    merged = lay.merge(shares)
    torch.testing.assert_close(merged, padded, equal_nan=True, rtol=0, atol=0)
    assert torch.equal(lay.unpad(merged), x)


@pytest.mark.parametrize("cp", [2, 3])
def test_owner_finds_every_real_token(cp):
    lay = CPLayout.build(SEQLENS, cp)
    x = torch.arange(lay.num_tokens) * 10 + 7
    shares = [lay.split(lay.pad(x, value=-1), r) for r in range(cp)]
    rank, local = lay.owner(torch.arange(lay.num_tokens))
    got = torch.stack([shares[r][i] for r, i in zip(rank.tolist(), local.tolist())])
    assert torch.equal(got, x)
    # Load balance: each rank holds two chunks of every segment, 1/cp of each.
    for s, p in zip(lay.starts, lay.padded):
        for r in range(cp):
            idx = lay.rank_index(r)
            assert int(((idx >= s) & (idx < s + p)).sum()) == p // cp


def test_shares_carry_megatrons_thd_rope_positions():
    """Applying megatron's THD RoPE on a rank's share equals rotating each token by the
    position :meth:`CPLayout.positions` gives it."""
    from megatron.core.models.common.embeddings.rope_utils import (
        _apply_rotary_pos_emb_bshd,
        _apply_rotary_pos_emb_thd,
    )

    class FakeGroup:  # what megatron reads of the CP group here
        def __init__(self, size, rank):
            self._size, self._rank = size, rank

        def size(self):
            return self._size

        def rank(self):
            return self._rank

    dim = 8
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    for cp in (2, 4):
        lay = CPLayout.build(SEQLENS, cp)
        freqs = torch.outer(torch.arange(lay.max_seqlen, dtype=torch.float64), inv)
        freqs = torch.cat([freqs, freqs], dim=-1)[:, None, None, :]  # [max_s, 1, 1, dim]
        for r in range(cp):
            t = torch.randn(lay.local_tokens, 2, dim, dtype=torch.float64)
            got = _apply_rotary_pos_emb_thd(t, lay.cu_seqlens_padded, freqs,
                                            cp_group=FakeGroup(cp, r))
            want = _apply_rotary_pos_emb_bshd(t.unsqueeze(1), freqs[lay.positions(r)]).squeeze(1)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            # The check can fail: positions of the plain (unbalanced) split are different.
            naive = torch.cat([torch.arange(r * p // cp, (r + 1) * p // cp) for p in lay.padded])
            assert not torch.equal(naive, lay.positions(r))


def test_packed_seq_params_carry_global_padded_bounds():
    params = CPLayout.build([5, 3], 2).packed_seq_params()
    assert params.qkv_format == "thd" and params.cu_seqlens_q_padded.tolist() == [0, 8, 12]
    # One tensor for all four: TE sees no padding between sequences, the attention no prefix.
    assert params.cu_seqlens_q is params.cu_seqlens_kv is params.cu_seqlens_q_padded
    assert params.max_seqlen_q == params.max_seqlen_kv == 8


def test_from_padded_reads_back_a_built_layout():
    lay = CPLayout.build(SEQLENS, 2)
    back = CPLayout.from_padded(lay.cu_seqlens_padded, 2)
    assert back.padded == lay.padded
    assert all(torch.equal(back.rank_index(r), lay.rank_index(r)) for r in range(2))


@pytest.mark.parametrize("call, message", [
    (lambda: CPLayout.build([4, 0, 3], 2), "segment 1 has 0 tokens"),
    (lambda: CPLayout.build([], 2), "no segments"),
    (lambda: CPLayout.build([4], 0), "cp=0"),
    (lambda: CPLayout.build([4], 2, tp=0), "tp=0"),
    (lambda: CPLayout.build([100, 30], 4, max_tokens=128),
     "2 segments of 130 tokens pad to 136 for cp=4 .* over the budget of 128"),
    (lambda: CPLayout.from_padded(torch.tensor([0, 8, 14]), 2),
     "padded segment 1 has 6 tokens, not a positive multiple of 2·cp = 4"),
    (lambda: CPLayout.from_padded([0, 8, 4], 2), "decreases at segment 1 \\(8 -> 4\\)"),
    (lambda: CPLayout.from_padded([3, 8], 2), "must start at 0"),
    (lambda: CPLayout.build([5, 3], 2).pad(torch.zeros(7)), "has 7 tokens along dim 0, "
     "the layout has 8"),
    (lambda: CPLayout.build([5, 3], 2).merge([torch.zeros(5)] * 2),
     "rank 0's share tensor has 5 tokens"),
    (lambda: CPLayout.build([5, 3], 2).merge([torch.zeros(6)]), "1 shares for cp=2"),
    (lambda: CPLayout.build([5, 3], 2).rank_index(2), "CP rank 2 outside 0..1"),
    (lambda: CPLayout.build([5, 3], 2).owner([8]), "outside 0..7"),
    (lambda: CPLayout(cp=2, seqlens=(5,), padded=(6,)), "multiples of 2·cp = 4"),
])
def test_bad_input_is_refused_naming_the_numbers(call, message):
    with pytest.raises(LayoutError, match=message):
        call()
