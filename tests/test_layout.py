"""Pure layout arithmetic: the worked example of the format notes, and properties on random layouts."""
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptlib.layout.flat import FlatGroupLayout, Zero3Layout, chunk_size, zero3_real_counts

# Appendix A of the format notes (real files, N=3): emb 370, l1.weight 70, l1.bias 7, l2.weight 185.
PARAMS = [("emb", (37, 10)), ("l1.weight", (7, 10)), ("l1.bias", (7,)), ("l2.weight", (37, 5))]


def test_zero2_worked_example():
    lay = FlatGroupLayout.build(PARAMS, world_size=3)
    assert lay.total == 632 and lay.padded_total == 636 and lay.partition_size == 212
    assert [lay.lean_length(r) for r in range(3)] == [212, 212, 208]
    assert [lay.tail_padding(r) for r in range(3)] == [0, 0, 4]
    assert [(p.rank, p.rank_start, p.param_start, p.count) for p in lay.pieces("emb")] == [(0, 0, 0, 212), (1, 0, 212, 158)]
    assert [(p.rank, p.rank_start, p.count) for p in lay.pieces("l1.weight")] == [(1, 158, 54), (2, 0, 16)]
    assert lay.slice_mappings(2) == {"l1.weight": (0, 16), "l1.bias": (16, 7), "l2.weight": (23, 185)}
    segs = lay.segments(2)
    assert segs[-1].is_padding and segs[-1].count == 4


def test_zero3_worked_example():
    lay = Zero3Layout.build([PARAMS[:1], PARAMS[1:]], world_size=3)
    assert lay.sub_group_sizes == (124, 24 + 3 + 62)
    assert zero3_real_counts(370, 3) == [124, 124, 122]
    assert [(p.rank, p.rank_start, p.param_start, p.count) for p in lay.pieces("l1.bias")] == [
        (0, 24, 0, 3), (1, 24, 3, 3), (2, 24, 6, 1)]
    # a parameter with fewer elements than ranks leaves trailing ranks with padding only
    tiny = Zero3Layout.build([[("t", (3,))]], world_size=5)
    assert [p.rank for p in tiny.pieces("t")] == [0, 1, 2]
    assert tiny.segments(4, 0)[0].is_padding


shapes = st.lists(st.tuples(st.integers(1, 40), st.integers(1, 5)), min_size=1, max_size=12)


@settings(max_examples=200, deadline=None)
@given(shapes=shapes, n=st.integers(1, 512), pads=st.booleans())
def test_flat_group_pieces_tile_every_parameter(shapes, n, pads):
    params = [(f"p{i}", s) for i, s in enumerate(shapes)]
    paddings = [(-math.prod(s)) % 8 for s in shapes[:-1]] + [0] if pads else None
    lay = FlatGroupLayout.build(params, world_size=n, paddings_after=paddings)
    assert lay.padded_total % (2 * n) == 0 and lay.padded_total - lay.total < 2 * n
    covered = 0
    for name, shape in params:
        pcs = lay.pieces(name)
        assert sum(p.count for p in pcs) == math.prod(shape)
        pos = 0
        for p in pcs:  # contiguous in the parameter, inside one rank's partition
            assert p.param_start == pos and 0 <= p.rank_start and p.rank_start + p.count <= lay.partition_size
            assert p.rank * lay.partition_size + p.rank_start == lay.slot(name).offset + p.param_start
            pos += p.count
        covered += pos
    # the segments of all ranks partition the padded group exactly
    # ranks past the data hold padding only, so checking the ranks that hold data covers everything
    busy = range(min(n, lay.total // max(lay.partition_size, 1) + 1))
    total = 0
    for r in busy:
        segs = lay.segments(r)
        assert sum(s.count for s in segs) == lay.partition_size
        assert all(a.rank_start + a.count == b.rank_start for a, b in zip(segs, segs[1:]))
        total += sum(s.count for s in segs if not s.is_padding)
    assert total == covered == lay.numel
    assert sum(lay.lean_length(r) for r in range(n)) == lay.total


@settings(max_examples=200, deadline=None)
@given(groups=st.lists(shapes, min_size=1, max_size=3), n=st.integers(1, 512))
def test_zero3_pieces_tile_every_parameter(groups, n):
    sub_groups = [[(f"g{g}p{i}", s) for i, s in enumerate(grp)] for g, grp in enumerate(groups)]
    lay = Zero3Layout.build(sub_groups, world_size=n)
    for g, grp in enumerate(sub_groups):
        assert lay.sub_group_sizes[g] == sum(chunk_size(math.prod(s), n) for _, s in grp)
        for r in {0, n // 2, n - 1}:
            assert sum(s.count for s in lay.segments(r, g)) == lay.sub_group_sizes[g]
        for name, shape in grp:
            pcs = lay.pieces(name)
            assert sum(p.count for p in pcs) == math.prod(shape)
            assert [p.param_start for p in pcs] == [p.rank * chunk_size(math.prod(shape), n) for p in pcs]


# ------------------------------------------------------------------------------------- N -> M re-slicing
from ckptlib.layout.flat import Zeros, reslice_flat, reslice_zero3, zero3_sub_groups  # noqa: E402


def _flat_buffers(lay, padded):
    """Each rank's saved partition, filled with the flat index (padding: -1)."""
    out = []
    for r in range(lay.world_size):
        start, end = lay.rank_range(r)
        stop = end if padded else min(end, lay.total)
        out.append([i if i < lay.total else -1 for i in range(start, max(start, stop))])
    return out


def _apply(pieces, bufs):
    vals = []
    for p in pieces:
        vals += [0] * p.count if isinstance(p, Zeros) else bufs[p.rank][p.rank_start:p.rank_start + p.count]
    return vals


@settings(max_examples=150, deadline=None)
@given(shapes=shapes, n=st.integers(1, 512), m=st.integers(1, 512), pads=st.booleans(), padded=st.booleans())
def test_flat_reslice_n_to_m_to_n_is_identity(shapes, n, m, pads, padded):
    params = [(f"p{i}", s) for i, s in enumerate(shapes)]
    paddings = [(-math.prod(s)) % 8 for s in shapes[:-1]] + [0] if pads else None
    a, b = (FlatGroupLayout.build(params, w, paddings_after=paddings) for w in (n, m))
    src = _flat_buffers(a, padded)
    mid = [_apply(reslice_flat(a, b, r, padded), src) for r in range(m)]
    assert mid == [[v if v >= 0 else 0 for v in row] for row in _flat_buffers(b, padded)]
    back = [_apply(reslice_flat(b, a, r, padded), mid) for r in range(n)]
    assert back == [[v if v >= 0 else 0 for v in row] for row in src]


@settings(max_examples=150, deadline=None)
@given(numels=st.lists(st.integers(1, 300), min_size=1, max_size=10), n=st.integers(1, 512), m=st.integers(1, 512),
       sgs=st.integers(1, 400))
def test_zero3_reslice_n_to_m_to_n_is_identity(numels, n, m, sgs):
    def layout(w):
        idx = zero3_sub_groups(numels, w, sgs)
        return Zero3Layout.build([[(f"p{i}", (numels[i],)) for i in g] for g in idx], w)

    a, b = layout(n), layout(m)
    # each rank's sub-group tensors hold (param, element) labels, padding None
    def bufs(lay):
        out = []
        for r in range(lay.world_size):
            row = []
            for g in range(len(lay.sub_group_sizes)):
                t = []
                for s in lay.slots:
                    if s.sub_group == g:
                        c = chunk_size(s.numel, lay.world_size)
                        t += [(s.name, i) if i < s.numel else None for i in range(r * c, r * c + c)]
                row.append(t)
            out.append(row)
        return out

    def apply(pieces, src):
        vals = []
        for p in pieces:
            vals += [None] * p.count if isinstance(p, Zeros) else src[p.rank][p.group][p.rank_start:p.rank_start + p.count]
        return vals

    src = bufs(a)
    mid = [[apply(reslice_zero3(a, b, r, g), src) for g in range(len(b.sub_group_sizes))] for r in range(m)]
    assert mid == bufs(b)
    back = [[apply(reslice_zero3(b, a, r, g), mid) for g in range(len(a.sub_group_sizes))] for r in range(n)]
    assert back == src


def test_zero3_sub_groups_follow_deepspeed_rule():
    # the fixture model's ZeRO-3 sub-groups at sub_group_size=500 are checked against real files elsewhere
    assert zero3_sub_groups([370, 70, 7, 185], 3, 100) == [[0], [1, 2, 3]]
    assert zero3_sub_groups([10, 10], 1, 10**9) == [[0, 1]]
    assert zero3_sub_groups([5, 5, 5], 1, 5) == [[0], [1], [2]]


@settings(max_examples=100, deadline=None)
@given(shapes=shapes, n=st.integers(1, 512), m=st.integers(1, 512))
def test_round_robin_reslice_n_to_m_to_n_is_identity(shapes, n, m):
    from ckptlib.layout.flat import reslice_by_params, round_robin_order

    natural = [(f"p{i}", s) for i, s in enumerate(shapes)]
    a, b = (FlatGroupLayout.build([natural[i] for i in round_robin_order(len(natural), w)], w) for w in (n, m))
    # flat buffers labelled (param, element)
    def bufs(lay):
        flat = [(s.name, i) for s in lay.slots for i in range(s.numel)]
        return [flat[r * lay.partition_size:(r + 1) * lay.partition_size] +
                [None] * max(0, (r + 1) * lay.partition_size - max(len(flat), r * lay.partition_size))
                for r in range(lay.world_size)]

    def apply(pieces, src):
        vals = []
        for p in pieces:
            vals += [None] * p.count if isinstance(p, Zeros) else src[p.rank][p.rank_start:p.rank_start + p.count]
        return vals

    src = bufs(a)
    mid = [apply(reslice_by_params(a, b, r), src) for r in range(m)]
    assert mid == bufs(b)
    assert [apply(reslice_by_params(b, a, r), mid) for r in range(n)] == src
    assert sorted(round_robin_order(len(natural), n)) == list(range(len(natural)))


# ------------------------------------------------------------------------------ placement: blocks side by side
from ckptlib.layout.placement import ROW, Block, blocks_from_rule, row_interleave, runs  # noqa: E402


def _expanded(rows, columns):
    """Runs as :func:`runs` gives them, from :func:`row_interleave`'s description."""
    out, pos = [], 0
    for i in range(rows):
        for source, at, width, stride in columns:
            out.append((pos, width, source, at + i * stride))
            pos += width
    return out


@settings(max_examples=300, deadline=None)
@given(rows=st.integers(1, 6), widths=st.lists(st.integers(1, 5), min_size=2, max_size=4),
       pad=st.lists(st.integers(0, 3), min_size=4, max_size=4), offset=st.lists(st.integers(0, 7), min_size=4, max_size=4),
       same_source=st.booleans(), data=st.data())
def test_blocks_side_by_side_give_the_runs_of_the_general_tiling(rows, widths, pad, offset, same_source, data):
    """row_interleave (planning a row-split tensor without sorting its runs) describes exactly what runs()
    gives, for shards stored with padding between their rows and at any offset; anything it does not
    describe (two neighbours of one source, a gap, an overlap, another row count) it leaves to runs()."""
    full_width = sum(widths)
    blocks, at = [], 0
    for j, w in enumerate(widths):
        source = "s" if same_source else f"s{j}"
        blocks.append(Block(source, (rows, w), at, (full_width, 1), offset[j], (w + pad[j], 1)))
        at += w
    order = data.draw(st.permutations(blocks))
    got = row_interleave(order, rows * full_width)
    want = [tuple(r) for r in runs(order, rows * full_width)]
    if same_source:
        assert got is None
    else:
        assert got is not None and _expanded(*got) == want
    broken = list(order)
    b = broken[0]
    broken[0] = Block(b.source, (rows + 1,) + b.shape[1:], b.full_offset, b.full_strides, b.local_offset, b.local_strides)
    assert row_interleave(broken, rows * full_width) is None
    shifted = [Block(x.source, x.shape, x.full_offset + (1 if x is order[-1] else 0), x.full_strides, x.local_offset,
                     x.local_strides) for x in order]
    assert row_interleave(shifted, rows * full_width) is None


def test_a_row_rule_split_is_side_by_side():
    full, blocks = blocks_from_rule(ROW, [(("t", 0), (4, 3)), (("t", 1), (4, 5))])
    assert full == (4, 8)
    assert row_interleave(blocks, 32) == (4, [(("t", 0), 0, 3, 3), (("t", 1), 0, 5, 5)])
