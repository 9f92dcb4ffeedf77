"""Copy census: exact strided overlap, per-launch classification, and the decoders that rebuild
the copies vLLM's Mamba copy paths make (pure functions; no engine)."""
from __future__ import annotations

import itertools
import random

import statescope  # noqa: F401
import pytest
import torch

from statescope.capture import census
from statescope.capture import census_decode as cd


def _bytes(start, nbytes, rows, stride):
    return {start + r * stride + i for r in range(max(rows, 1)) for i in range(nbytes)}


def test_ranges_overlap_matches_brute_force_on_random_strided_sets():
    rng = random.Random(3)
    checked = 0
    for _ in range(3000):
        a = (rng.randrange(0, 80), rng.randrange(0, 9), rng.randrange(1, 5), rng.randrange(0, 25))
        b = (rng.randrange(0, 80), rng.randrange(0, 9), rng.randrange(1, 5), rng.randrange(0, 25))
        want = bool(_bytes(*a) & _bytes(*b))
        assert census.ranges_overlap(*a, *b) == want, (a, b)
        checked += want
    assert checked > 200  # both outcomes were exercised


def test_interleaved_rows_do_not_overlap_but_shifted_rows_do():
    # DS conv layout: rows of 10 bytes every 100 bytes; a second set offset by 50 interleaves
    assert not census.ranges_overlap(0, 10, 8, 100, 50, 10, 8, 100)
    assert census.ranges_overlap(0, 10, 8, 100, 5, 10, 8, 100)
    assert not census.ranges_overlap(0, 10, 1, 0, 10, 10, 1, 0)  # touching is not overlapping


def _copy(src, dst, n, sb=0, db=0, rows=1, stride=0):
    return {"src_addr": src, "dst_addr": dst, "nbytes": n, "src_block": sb, "dst_block": db,
            "rows": rows, "row_stride": stride}


@pytest.mark.parametrize("copy,kind", [
    (_copy(100, 200, 0), "empty"),
    (_copy(100, 100, 50, 1, 1), "same_address"),
    (_copy(120, 100, 60, 1, 1), "left_shift_same_block"),
    (_copy(100, 120, 60, 1, 1), "self_overlap"),
    (_copy(100, 300, 60, 1, 2), "disjoint"),
])
def test_self_kind(copy, kind):
    assert census.self_kind(copy) == kind
    assert census.classify_launch([copy]) == [kind]


def test_chain_and_cycle_within_one_launch():
    a = _copy(0, 1000, 100, 0, 10)       # writes [1000, 1100)
    b = _copy(1050, 2000, 100, 10, 20)   # reads [1050, 1150): a's write clobbers it -> chain
    c = _copy(5000, 6000, 10, 50, 60)    # unrelated
    assert census.classify_launch([a, b, c]) == ["chain", "chain", "disjoint"]
    swap_x = _copy(0, 500, 100, 0, 5)    # x -> y
    swap_y = _copy(500, 0, 100, 5, 0)    # y -> x: no order is correct
    assert census.classify_launch([swap_x, swap_y, c]) == ["cycle", "cycle", "disjoint"]
    # a 3-cycle plus a tail hanging off it
    r = [_copy(0, 100, 10), _copy(100, 200, 10), _copy(200, 0, 10), _copy(205, 900, 10)]
    assert census.classify_launch(r) == ["cycle", "cycle", "cycle", "chain"]


def test_in_place_shift_next_to_a_chain_keeps_both_kinds():
    shift = _copy(1024, 0, 3072, 7, 7)              # in-place left shift in block 7
    other = _copy(8192, 16384, 4096, 8, 16)
    assert census.classify_launch([shift, other]) == ["left_shift_same_block", "disjoint"]
    assert census.clobber_edges([shift, other]) == []


def test_census_counts_flat_and_grouped():
    rows = [{"kind": "disjoint", "kernel": "pre"}, {"kind": "disjoint", "kernel": "post"},
            {"kind": "cycle", "kernel": "post"}]
    flat = census.census_counts(rows)
    assert flat["disjoint"] == 2 and flat["cycle"] == 1 and flat["chain"] == 0
    assert set(census.KINDS) <= set(flat)
    grouped = census.census_counts(rows, by=["kernel"])
    assert grouped == {"pre|disjoint": 1, "post|disjoint": 1, "post|cycle": 1}


# ---- decoders ----------------------------------------------------------------------------------

STATE_LEN, CONV_DIM, HEADS, VD, KD = 5, 8, 2, 4, 4


def _layer_states(num_blocks=12, pad=24):
    """conv (bf16) and ssm (fp32) of one layer sharing one padded page per block, like vLLM."""
    conv_bytes = STATE_LEN * CONV_DIM * 2
    page = conv_bytes + HEADS * VD * KD * 4 + pad
    raw = torch.zeros(num_blocks * page, dtype=torch.uint8)
    conv = torch.as_strided(raw.view(torch.bfloat16), (num_blocks, STATE_LEN, CONV_DIM),
                            (page // 2, CONV_DIM, 1))
    ssm = torch.as_strided(raw.view(torch.float32), (num_blocks, HEADS, VD, KD),
                           (page // 4, VD * KD, KD, 1), conv_bytes // 4)
    return raw, conv, ssm, page


def test_geometry_and_fused_decode_addresses():
    raw, conv, ssm, page = _layer_states()
    geoms = cd.geometry_from_states([("L0", 0, [conv, ssm])])
    assert [g.kind for g in geoms] == ["conv", "ssm"]
    assert geoms[0].block_stride == page and geoms[1].block_stride == page
    assert geoms[0].conv_width == STATE_LEN and geoms[0].inner == CONV_DIM
    assert geoms[1].inner == HEADS * VD * KD and geoms[1].natural_bytes == HEADS * VD * KD * 4
    table = {"r0": ([3, 4, 5, 6],)}
    rows = cd.decode_fused_precopy(geoms, dst_cols=[1], src_cols=[0], biases=[2], req_ids=["r0"],
                                   block_ids=table)
    c, s = rows
    token = CONV_DIM * 2
    assert (c["src_block"], c["dst_block"], c["nbytes"]) == (3, 4, (STATE_LEN - 2) * token)
    assert c["src_addr"] == conv.data_ptr() + 3 * page + 2 * token
    assert c["dst_addr"] == conv[4].data_ptr()
    assert (s["src_block"], s["dst_block"]) == (5, 4)  # recurrent: column src + bias
    assert s["src_addr"] == ssm[5].data_ptr() and s["dst_addr"] == ssm[4].data_ptr()
    # no copy when the source column is fresh (-1) or equal to the destination
    assert cd.decode_fused_precopy(geoms, [1, 2], [-1, 2], [0, 0], ["r0", "r0"], table) == []


def _reference_decision(acc, col, sched, comp, drafts, bs):
    running = comp + sched - drafts
    new = running + acc - 1
    aligned = new // bs * bs
    if aligned < running:
        return (0, col, aligned // bs - 1, aligned - running, 0)
    dst, bias = aligned // bs - 1, aligned - running
    return (int(not (col == dst and bias == 0)), col, dst, bias, int(col == dst))


def test_postprocess_decisions_mirror_the_kernel_rule():
    bs = 8
    cases = list(itertools.product([1, 2, 3], [0, 1, 2], [1, 3], [0, 3, 5, 6, 7, 13, 14], [0, 2]))
    cases = [c for c in cases if c[2] > c[4]]  # scheduled tokens include the drafts
    acc, col, sched, comp, drafts = (torch.tensor(v, dtype=torch.int32) for v in zip(*cases))
    got = cd.postprocess_decisions(acc, col, sched, comp, drafts, bs).tolist()
    want = [_reference_decision(*c, bs) for c in cases]
    for g, w in zip(got, want):
        assert g[0] == w[0] and g[4] == w[4]
        if w[0]:
            assert g[1:4] == list(w[1:4])
    assert any(g[0] and g[1] == g[2] and g[3] > 0 for g in got)  # in-place shifts were generated


def test_postprocess_decode_marks_in_place_shift():
    raw, conv, ssm, page = _layer_states()
    geoms = cd.geometry_from_states([("L0", 0, [conv, ssm])])
    rows = cd.decode_fused_postprocess(geoms, [[1, 0, 0, 2, 1], [0, 0, 0, 0, 0]], ["a", "b"],
                                       {"a": ([7, 8, 9],), "b": ([1, 2, 3],)})
    assert len(rows) == 2  # request b: no copy
    kinds = census.classify_launch(rows)
    assert kinds == ["left_shift_same_block", "disjoint"]  # conv in place; ssm from column 2


def test_decode_scalar_locates_layer_kind_and_block_by_address():
    raw, conv, ssm, page = _layer_states()
    geoms = cd.geometry_from_states([("L0", 0, [conv, ssm])])
    token = CONV_DIM * 2
    src = [conv.data_ptr() + 2 * page + 1 * token, ssm[6].data_ptr(), 12345]
    dst = [conv[5].data_ptr(), ssm[5].data_ptr(), 54321]
    rows = cd.decode_scalar(geoms, src, dst, [4 * token, 128, 8],
                            [{"req_id": "r", "src_col": 0, "dst_col": 1, "bias": 1}])
    assert [(r["state_kind"], r["src_block"], r["dst_block"]) for r in rows] == [
        ("conv", 2, 5), ("ssm", 6, 5), ("unknown", -1, -1)]
    assert rows[0]["req_id"] == "r" and rows[1]["req_id"] is None
    assert census.classify_launch(rows) == ["disjoint", "disjoint", "disjoint"]
