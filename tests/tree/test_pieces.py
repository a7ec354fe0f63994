"""``sp.ShardedPieces``: several pieces of one global tensor on one rank, in one process
(the distributed tests save and load them across world sizes)."""

import pytest
import torch

import shardpoint as sp

G = (6, 4)
FULL = torch.arange(24, dtype=torch.float32).reshape(G)


def rows(a, b, **kw):
    return sp.ShardedTensor(FULL[a:b].clone(), G, (a, 0), **kw)


def flat(a, b):
    return sp.ShardedTensor(
        FULL.reshape(-1)[a:b].clone(), G, (0, 0), local_shape=G, flattened_range=(a, b)
    )


def test_pieces_in_any_order_and_kind_save_and_fill_in_place(tmp_ckpt):
    st = {"m": {"w": sp.ShardedPieces([rows(4, 6), flat(0, 5), flat(5, 16)])}}
    sp.save(st, tmp_ckpt)
    assert torch.equal(sp.load(tmp_ckpt)["m"]["w"], FULL)
    like = sp.ShardedPieces(
        [
            sp.ShardedTensor(torch.zeros(6, 1), G, (0, 3)),
            sp.ShardedTensor(torch.zeros(0, 4), G, (6, 0)),  # empty
            sp.ShardedTensor(torch.zeros(4), G, (1, 0), local_shape=(2, 3), flattened_range=(1, 5)),
        ]
    )
    out = sp.load(tmp_ckpt, like={"m": {"w": like}})["m"]["w"]
    assert isinstance(out, list) and all(o is p.data for o, p in zip(out, like))
    assert torch.equal(out[0], FULL[:, 3:]) and out[1].shape == (0, 4)
    assert torch.equal(out[2], FULL[1:3, :3].reshape(-1)[1:5])


@pytest.mark.parametrize(
    "pieces,spec_id,words",
    [
        ([rows(0, 3), rows(2, 6)], "SP-COVER-3", "pieces 0 and 1 overlap"),
        ([flat(0, 10), rows(2, 3)], "SP-COVER-3", "pieces 0 and 1 overlap"),
        ([rows(0, 3), rows(0, 3)], "SP-COVER-3", "overlap"),
        ([rows(0, 3), sp.ShardedTensor(FULL[3:].double(), G, (3, 0))], "SP-COVER-4", "float64"),
        ([rows(0, 3), sp.ShardedTensor(FULL[3:].clone(), (7, 4), (3, 0))], "SP-COVER-4", "(7, 4)"),
    ],
)
def test_inconsistent_pieces_name_the_key(tmp_ckpt, pieces, spec_id, words):
    with pytest.raises(sp.InvalidShardingError) as e:
        sp.save({"layers": {"qkv": sp.ShardedPieces(pieces)}}, tmp_ckpt)
    assert e.value.spec_id == spec_id and "'layers/qkv'" in str(e.value)
    assert words in str(e.value)
    sp.save({"layers": {"qkv": FULL}}, tmp_ckpt)
    with pytest.raises(sp.InvalidShardingError) as e:  # like= is checked the same way
        sp.load(tmp_ckpt, like={"layers": {"qkv": sp.ShardedPieces(pieces)}})
    assert e.value.spec_id == spec_id and "'layers/qkv'" in str(e.value)


def test_pieces_must_be_sharded_tensors_and_at_least_one():
    with pytest.raises(sp.InvalidShardingError, match="piece 1 is a Tensor"):
        sp.ShardedPieces([rows(0, 3), FULL[3:]])
    with pytest.raises(sp.InvalidShardingError, match="at least one piece"):
        sp.ShardedPieces([])


def test_gap_between_one_ranks_pieces_is_a_coverage_error(tmp_ckpt):
    with pytest.raises(sp.InvalidShardingError) as e:
        sp.save({"w": sp.ShardedPieces([rows(0, 2), rows(3, 6)])}, tmp_ckpt)
    assert e.value.spec_id == "SP-COVER-2" and "'w'" in str(e.value)
