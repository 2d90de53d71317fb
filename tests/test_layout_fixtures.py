"""The pure layout arithmetic reproduces what DeepSpeed itself recorded in every real fixture."""
import ckptlib
from ckptlib.deepspeed import BF16_OPTIMIZER, NO_ZERO
from ckptlib.layout.flat import chunk_size, zero3_sub_groups
from ckptlib.mesh import Rank


def test_layout_matches_deepspeeds_own_records(ds_fixture):
    fx = ds_fixture
    with ckptlib.open_checkpoint(fx["checkpoint_path"]) as ck:
        if ck.flavor == NO_ZERO:
            assert ck.layouts == []
            return
        n = ck.partition_count
        assert n == fx["world_size"]
        if ck.zero_stage == 3:
            lay = ck.layouts[0]
            sgs = int(float((ck.ds_config.get("zero_optimization") or {}).get("sub_group_size", 1e9)))
            osd = ck.optimizer_state_dict(Rank(dp=0))
            for group in osd["optimizer_state_dict"]["param_groups"]:
                subs = group["params"]
                params = [s for k in subs for s in lay.slots if s.sub_group == k]
                cut = zero3_sub_groups([s.numel for s in params], n, sgs)
                assert [[params[i].name for i in c] for c in cut] == \
                    [[s.name for s in lay.slots if s.sub_group == k] for k in subs]
            for r in range(n):
                flats = ck.optimizer_state_dict(Rank(dp=r))["fp32_flat_groups"]
                assert [t.numel for t in flats] == list(lay.sub_group_sizes)
                frags = ck.model_states_file(Rank(dp=r)).obj.get("frozen_param_fragments") or {}
                for name, t in frags.items():
                    assert t.numel == chunk_size(ck.param(name).numel, n)
            return
        round_robin = bool((ck.ds_config.get("zero_optimization") or {}).get("round_robin_gradients"))
        rr_mismatch = False
        for r in range(n):
            osd = ck.optimizer_state_dict(Rank(dp=r))
            for g, lay in enumerate(ck.layouts):
                assert lay.padded_total % (2 * n) == 0
                fp32 = osd["single_partition_of_fp32_groups"][g]
                if ck.flavor == BF16_OPTIMIZER:  # padded partitions; all padding recorded on the last rank
                    assert fp32.numel == lay.partition_size
                    assert osd["group_paddings"][g] == ((lay.padded_total - lay.total) if r == n - 1 else 0)
                else:  # lean partitions; each rank records the padding it holds
                    assert fp32.numel == lay.lean_length(r)
                    assert osd["group_paddings"][g] == lay.tail_padding(r)
                for key, t in osd["base_optimizer_state"]["state"][g].items():
                    if key != "step":
                        assert t.numel == lay.partition_size
                if "param_alignment_paddings" in osd:
                    assert list(osd["param_alignment_paddings"][g]) == [s.padding_after for s in lay.slots]
                recorded = {k: (a.start, a.numel) for k, a in osd["param_slice_mappings"][g].items()}
                if round_robin:
                    # DeepSpeed 0.19.8 records these in natural parameter order although the flat group is in
                    # round-robin order: its own records are wrong here (and ds_to_universal with them)
                    rr_mismatch |= recorded != lay.slice_mappings(r)
                else:
                    assert recorded == lay.slice_mappings(r)
        assert rr_mismatch == (round_robin and n > 1)
