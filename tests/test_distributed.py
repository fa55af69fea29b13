"""Every strategy on 1-4 gloo ranks against the float64 reference; bad inputs; traffic."""

from __future__ import annotations

import pytest

import dist_cases
import spawned
from ctxpar.plan import traffic
from ctxpar.strategies.allgather import head_groups
from ctxpar.strategy_rules import MAX_GATHERS, gather_groups

WORLD_SIZES = (1, 2, 3, 4)
for _world in WORLD_SIZES:
    spawned.declare(f"dist-P{_world}", dist_cases.run_all, _world, timeout_s=60)


def results(world: int) -> list[dict]:
    """Per-rank results of ``dist_cases.run_all`` on ``world`` ranks."""
    return spawned.results(f"dist-P{world}")


CASES = [
    pytest.param(world, case, id=f"P{world}-{case.id}")
    for world in WORLD_SIZES
    for case in dist_cases.exactness_cases()
    if case.runs_on(world)
]


@pytest.mark.parametrize("world, case", CASES)
def test_matches_fp64_reference(world: int, case: dist_cases.Case) -> None:
    for res in results(world):
        assert res["exactness"][case.id] == "ok", res["exactness"][case.id]


def test_every_strategy_is_exercised_on_every_world_size_it_allows() -> None:
    ran = {(world, case.strategy) for world, case in (p.values for p in CASES)}
    assert ran == {(w, s) for w in WORLD_SIZES for s in ("ring", "allgather", "alltoall")} | {(4, "hybrid")}


EXPECTED_MESSAGES = {
    "length": ["sequence length", "2*P=", "zigzag", "pad to"],
    "heads": ["H=4", "H_kv=3"],
    "dtype": ["dtypes differ"],
    "device": ["different devices"],
    "kv_shape": ["same shape"],
    "seq_mismatch": ["must agree"],
    "batch_mismatch": ["q (2, 4, 6, 8) and k/v (1, 2, 6, 8) must agree on batch"],
    "rank3": ["4-D"],
    "layout_world": ["built for P=", "process group has"],
    "layout_name": ["unknown layout", "zigzag"],
    "layout_type": ["layout must be a name", "got list"],
    "strategy": ["unknown strategy", "ring", "hybrid, auto"],
    "scale": ["scale"],
    "scale_overflow": ["scale must be a positive finite number, got 1000"],
    "scale_under_float32": ["scale 1e-50 is outside float32's range", "torch.float32 attention is computed"],
    "scale_over_float32": ["scale 1e+39 is outside float32's range"],
    "int_dtype": ["not supported"],
    "empty": ["empty input"],
    "causal_type": ["causal must be True or False"],
    "consistency_type": ["check_consistency must be True or False, got 'no'"],
    "hybrid_without_mesh": ["takes mesh=", "and none was given"],
    "hybrid_with_group": ["takes mesh=", "not group="],
    "mesh_for_ring": ["mesh= is for strategy='hybrid'"],
    "mesh_type": ["mesh= must be a torch DeviceMesh", "got str"],
    "group_type": ["group=", "got str"],
    "alltoall_heads": ["H=5", "H_kv=5", "P="],
    "gloo_device": ["uses gloo", "move them to the CPU"],
    "hybrid_layout_world": ["ulysses degree 2", "ring degree 2"],
    "hybrid_heads": ["H=5", "ulysses degree=2"],
    "hybrid_mesh_permuted": ["ranks ascend along each dim", "[[3, 1], [0, 2]]"],
    "hybrid_mesh_rows_descending": ["ranks ascend along each dim", "[[2, 3], [0, 1]]"],
    "non_member": ["not a member", "call ctxpar.attention only on the ranks of the CP group"],
    # the other entries taking a group once all told to call ctxpar.attention only on its ranks
    "non_member_cp_loss": ["not a member", "call cp_loss only on the ranks of the CP group"],
    "non_member_apply_context_parallel": ["call apply_context_parallel only on the ranks of the CP group"],
    "non_member_KVCache": ["call KVCache only on the ranks of the CP group"],
    "non_member_generate": ["call generate only on the ranks of the CP group"],
    # a DeviceMesh as group= (or the wrong one as mesh=) was refused without saying what to pass
    "group_dp_cp_mesh": ["got a DeviceMesh (2D with mesh_dim_names ('dp', 'cp'))",
                         "pass its CP dim's process group, group=mesh.get_group('cp')"],
    "group_mesh_dim": ["got a DeviceMesh (1D with mesh_dim_names ('cp',))", "group=mesh.get_group()"],
    "group_hybrid_mesh": ["pass mesh=mesh (the hybrid strategy's) instead"],
    # group= alone is refused for "hybrid": the advice names the strategies that take it
    "hybrid_dp_cp_mesh": ["got 2D with mesh_dim_names ('dp', 'cp'); for the ranks of its CP dim pass "
                          "group=mesh.get_group('cp') instead with a strategy that takes group= (ring, allgather, "
                          "alltoall or auto)"],
    "hybrid_3d_mesh": ["got 3D with mesh_dim_names ('dp', 'ring', 'ulysses'); pass its sub-mesh "
                       "mesh['ring', 'ulysses']"],
    "documents_sum": ["sum to 7", "tokens"],
    "documents_empty": ["lengths must be >= 1"],
    "documents_float": ["1-D integer tensor"],
    "documents_cu_seqlens_short": ["read as cu_seqlens, which must end at the sequence length"],
    "window_zero": ["window must be an integer >= 1"],
    "window_not_causal": ["needs causal=True"],
    "sinks_shape": ["shape (H,) = (4,)"],
    "sinks_nan": ["finite"],
    "q_dtensor": ["q is a DTensor", "q.to_local()"],
    "sinks_past_float32": ["sinks must be finite in torch.float32, in which torch.float32 attention is computed"],
    "sinks_int": ["floating point"],
    "sinks_meta": ["sinks are on meta"],
}


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_bad_inputs_raise_clear_errors_without_hanging(world: int) -> None:
    for rank, res in enumerate(results(world)):
        messages = dict(res["bad_inputs"])
        after = messages.pop("after")
        assert after == "ok", f"attention after the rejected calls: {after}"
        for name, message in messages.items():
            for fragment in EXPECTED_MESSAGES[name]:
                assert fragment in message, f"rank {rank} {name}: {fragment!r} not in {message!r}"
        expected = set(EXPECTED_MESSAGES)
        non_member = {name for name in expected if name.startswith("non_member")}
        if world == 1:
            expected -= {"length", "alltoall_heads", "gloo_device", *non_member}
        if world != 4:
            expected -= {"hybrid_layout_world", "hybrid_heads", "hybrid_mesh_permuted", "hybrid_mesh_rows_descending",
                         "q_dtensor", "group_dp_cp_mesh", "group_mesh_dim", "group_hybrid_mesh", "hybrid_dp_cp_mesh",
                         "hybrid_3d_mesh"}
        if rank != 0:
            expected -= non_member
        assert set(messages) == expected


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_counted_bytes_equal_the_documented_formulas(world: int) -> None:
    checked = set()
    for res in results(world):
        for (strategy, (b, h, hkv, s, d), dtype), counted in res["traffic"].items():
            elem, acc = (8, 8) if dtype == "torch.float64" else (2, 4)
            want = traffic.per_rank(
                strategy, batch=b, seq_len=s * world, heads=h, kv_heads=hkv, head_dim=d, world=world,
                elem=elem, acc=acc, ulysses=dist_cases.HYBRID_MESH[1] if strategy == "hybrid" else None,
            )
            assert counted["forward"] == (want.forward, want.forward), (strategy, hkv, dtype)
            assert counted["backward"] == (want.backward, want.backward), (strategy, hkv, dtype)
            checked.add(strategy)
    assert checked == set(dist_cases.STRATEGIES) - (set() if world == 4 else {"hybrid"})


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_a_sliding_window_sends_only_the_halo(world: int) -> None:
    """Counted ring bytes per rank under windows on the contiguous layout equal
    ``traffic.ring_window``; a window wider than T sends what plain causal sends. A ring step
    that moves nothing either way is no post (they were counted as posts of 0 bytes, which
    no wait follows): every post is waited on once."""
    b, hkv, s, d = 1, 2, 6, 8
    for rank, res in enumerate(results(world)):
        for window, counted in res["window_traffic"].items():
            forward_posts, forward_waits, backward_posts, backward_waits = counted["syncs"]
            assert (forward_posts, backward_posts) == (forward_waits, backward_waits), (rank, window, counted)
            if window >= s * world:
                plain = traffic.ring(batch=b, local_len=s, kv_heads=hkv, head_dim=d, world=world, elem=4, acc=4)
                want_sent = want_received = plain
            else:
                want_sent, want_received = traffic.ring_window(batch=b, local_len=s, kv_heads=hkv, head_dim=d,
                                                               world=world, window=window, rank=rank, elem=4, acc=4)
            assert counted["sent"] == (want_sent.forward, want_sent.backward), (rank, window)
            assert counted["received"] == (want_received.forward, want_received.backward), (rank, window)
    if world > 1:  # the halo: w-1 keys' K/V, not the (P-1) shards of plain causal
        sent, _ = traffic.ring_window(batch=b, local_len=s, kv_heads=hkv, head_dim=d, world=world, window=4, rank=0,
                                      elem=4, acc=4)
        assert sent.forward == 3 * 2 * b * hkv * d * 4
    if world == 3:  # a halo of 9 keys (window s + 3) takes two ring steps, and rank 0's second moves nothing
        assert results(world)[0]["window_traffic"][s + 3]["syncs"][:2] == (2, 2)  # the consistency check, step 0


def _expected_syncs(strategy: str, world: int, kv_heads: int) -> tuple[int, int, int, int]:
    """(forward posts, forward waits, backward posts, backward waits): docs/strategies.md's
    table, the consistency check included."""
    if world == 1:
        return (0, 0, 0, 0)
    if strategy == "ring":
        return (world, world, 2 * (world - 1), 2 * (world - 1))
    if strategy == "allgather":
        groups = len(head_groups(kv_heads))
        return (groups + 1, groups + 1, 2 * groups, 2 * groups)
    if strategy == "alltoall":
        return (4, 3, 2, 2)
    ring = dist_cases.HYBRID_MESH[0]
    return (2 + 1 + (ring - 1) + 2, 2 + 1 + (ring - 1) + 1, 2 + 2 * (ring - 1), 2 + 2 * (ring - 1))


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_synchronisation_points_are_the_documented_few(world: int) -> None:
    for res in results(world):
        for (strategy, (_, _, hkv, _, _), dtype), counted in res["traffic"].items():
            assert counted["syncs"] == _expected_syncs(strategy, world, hkv), (strategy, hkv, dtype)


def test_allgather_head_groups_take_every_kv_head_once() -> None:
    """For 1..64 K/V heads the all-gather's groups are consecutive, together exactly range(h),
    at most MAX_GATHERS of them (as many as the planner counts), equal but for a smaller last
    one. Leaving that last group out (9 or 11 heads) gathered no K/V for its query heads and
    passed the exactness grid, whose head counts all split into equal groups."""
    for h in range(1, 65):
        groups = head_groups(h)
        assert [i for group in groups for i in range(h)[group]] == list(range(h)), (h, groups)
        sizes = [group.stop - group.start for group in groups]
        assert len(groups) == gather_groups(h) <= MAX_GATHERS, (h, groups)
        assert len(set(sizes[:-1])) <= 1 and 1 <= sizes[-1] <= sizes[0], (h, groups)


def test_ring_volume_by_hand() -> None:
    """The formula itself, spelled out once: K and V in one buffer, P-1 hops."""
    t = traffic.per_rank("ring", batch=2, seq_len=24, heads=8, kv_heads=2, head_dim=16, world=4, elem=2, acc=4)
    kv = 2 * 2 * 2 * 6 * 16  # K and V, B=2, H_kv=2, S=6, D=16
    assert (t.forward, t.backward) == (3 * kv * 2, 3 * kv * (2 + 4))


def test_alltoall_volume_by_hand() -> None:
    """Ulysses on 4 ranks with 2 K/V heads: each copied twice (the fewest making 4 heads), so q and out
    (8 heads each) and K and V (4 heads each), 4 tokens of 8 dims in bf16, three quarters of it leaving
    the rank; the forward adds the float32 lse of the 8 heads."""
    t = traffic.per_rank("alltoall", batch=1, seq_len=16, heads=8, kv_heads=2, head_dim=8, world=4, elem=2, acc=4)
    tensors = (8 + 8 + 4 + 4) * 4 * 8 * 2 * 3 // 4
    assert (t.forward, t.backward) == (tensors + 8 * 4 * 4 * 3 // 4, tensors) == (1248, 1152)


def test_the_ring_on_a_transport_that_sends_late_is_exact_waits_every_request_and_overlaps() -> None:
    """On 3 ranks (a dK/dV accumulator passes a rank on its way home), a transport posting each
    transfer only when it is first waited for: a buffer written again before its send was waited
    for sends the new contents there (gloo's eager loopback had sent it already: exact), a wait
    leaving a request alone hangs, and a forward that waits before it computes, hiding no
    transfer, changed no number and no counter."""
    for rank, res in enumerate(results(3)):
        for name, r in res["lazy_transport"].items():
            assert max(r["errors"]) < 1e-10, (rank, name, r["errors"])
            assert r["unwaited"] == 0, (rank, name, r["unwaited"])
        # zigzag, plain causal: three tiles, the next shard's transfer posted while each of the first two computes
        assert res["lazy_transport"]["causal"]["forward_overlapped"] == [True, True, False], rank


def test_strategies_splitting_heads_refuse_exactly_the_counts_their_degree_does_not_divide() -> None:
    """Every H <= 16 and H_kv dividing it over U <= 8 ranks: the bad-input grid's H=5 over 2 or 4
    is coprime to U, so a rule refusing only heads coprime to U passed it, and H=6 over U=4 then
    failed inside the all-to-all with torch's "unflatten: Provided sizes ... don't multiply up"."""
    import itertools

    from ctxpar.strategies import STRATEGIES
    from ctxpar.topology import Topology

    for strategy, heads, ulysses in itertools.product(("alltoall", "hybrid"), range(1, 17), range(1, 9)):
        rings = 2 if strategy == "hybrid" else 1
        topo = Topology(rank=0, world_size=ulysses * rings, ulysses_degree=ulysses, ring_degree=rings,
                        hybrid=strategy == "hybrid")
        for kv_heads in (h for h in range(1, heads + 1) if heads % h == 0):
            if heads % ulysses:
                with pytest.raises(ValueError, match=f"H={heads} .* which does not divide them"):
                    STRATEGIES[strategy].check(heads, kv_heads, topo)
            else:
                STRATEGIES[strategy].check(heads, kv_heads, topo)


@pytest.mark.parametrize("strategy", ["ring", "allgather", "alltoall"])
def test_a_strategy_keeps_for_its_backward_only_the_tensors_it_saves(strategy: str) -> None:
    """Every floating-point tensor a strategy's autograd nodes hold after the forward went through
    ``save_for_backward``: what saved-tensor hooks (save_on_cpu, checkpointing's) see and the
    memory tables count. One kept as a ctx attribute (the ring's last K/V received, the
    all-to-all's whole receive buffer) stayed alive until the backward in every layer, unseen by
    the hooks and by the exactness tests. Index tensors are not floating point."""
    import torch

    import ctxpar

    def floats(value) -> list:
        if isinstance(value, torch.Tensor):
            return [value] if value.is_floating_point() else []
        if isinstance(value, (tuple, list)):
            return [t for item in value for t in floats(item)]
        return [t for item in value.values() for t in floats(item)] if isinstance(value, dict) else []

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, 16, 8, generator=gen, requires_grad=True) for h in (4, 2, 2))
    nodes, seen, kept = [ctxpar.attention(q, k, v, layout="zigzag", strategy=strategy).grad_fn], set(), {}
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        nodes += [fn for fn, _ in node.next_functions]
        extra = [t for name, value in getattr(node, "__dict__", {}).items() if not name.startswith("_")
                 for t in floats(value)]
        if extra:
            kept[type(node).__name__] = sum(t.numel() * t.element_size() for t in extra)
    assert kept == {}, f"{strategy}: floating-point tensors kept outside save_for_backward (bytes per node): {kept}"


def test_hybrid_on_every_mesh_shape_and_dim_order() -> None:
    seen_ranks = {}
    for rank, res in enumerate(results(4)):
        for mesh, r in res["hybrid_meshes"].items():
            assert r["verdict"] == "ok", f"{mesh}: {r['verdict']}"
            assert r["sinks_verdict"] == "ok", f"{mesh} with sinks: {r['sinks_verdict']}"
            ulysses = int(mesh.split("ulysses")[1][0])  # read by the dims' names, not their positions
            assert r["degrees"] == (ulysses, 4 // ulysses), (mesh, r["degrees"])
            # rank 0 alone without requires_grad: every rank raises; rank 0 hears of it in its row and its
            # column, each naming its own ranks (a description kept once per field dropped the column's)
            said = r["requires_grad_on_rank_0_alone"]
            assert "different requires_grad" in said or "(seen by another rank)" in said, (mesh, rank, said)
            if rank == 0 and mesh == "ulysses2xring2":
                assert said.count("requires_grad (of q, k, v, sinks: rank 0: none; rank ") == 2, said
            seen_ranks.setdefault(mesh, []).append(r["cp_rank"])
    assert sorted(seen_ranks["ulysses2xring2"]) == [0, 1, 2, 3]
    assert seen_ranks["ulysses2xring2"] != [0, 1, 2, 3], "with the dims swapped the CP rank is not the global rank"


def test_broadcast_and_all_gather_over_a_hybrid_mesh_follow_the_layout_order() -> None:
    """topology.broadcast from every place reaches every rank with that place's tensor, and
    all_gather returns the places in layout order, on 1x4, 4x1 and 2x2 (dims swapped) meshes
    (HF generate broadcasts the last position's logits so; a source taken modulo the ring
    degree instead of the ulysses degree passed on the square mesh alone)."""
    for res in results(4):
        for mesh, r in res["hybrid_meshes"].items():
            assert r["broadcast"] == [0.0, 1.0, 2.0, 3.0], mesh
            assert r["all_gather"] == [0.0, 1.0, 2.0, 3.0], mesh


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_loss_divides_by_the_global_token_count(world: int) -> None:
    for res in results(world):
        r = res["loss_weighting"]
        assert r["loss"] == pytest.approx(r["want"], rel=1e-13)  # float64 logits: cp_loss works in float64
        assert r["sum_of_shares"] == pytest.approx(r["want"], rel=1e-13)


@pytest.mark.parametrize("world", WORLD_SIZES[1:], ids=lambda w: f"P{w}")
def test_ranks_that_disagree_all_raise_with_check_consistency(world: int) -> None:
    for rank, res in enumerate(results(world)):
        r = res["consistency"]
        assert "different local_len" in r["length"]
        assert "different causal" in r["causal"]
        assert "different documents/window" in r["documents"]
        assert "different layout" in r["balanced_deal"] and "different layout" in r["balanced_documents"]
        if rank == world - 1:
            assert "H_kv=3" in r["invalid"], "the rank with invalid inputs raises its own error"
            assert r["invalid_flag"] == "check_consistency must be True or False, got None"
        else:
            assert f"ranks [{world - 1}]" in r["invalid"] and "rejected" in r["invalid"]
            assert f"ranks [{world - 1}]" in r["invalid_flag"] and "rejected" in r["invalid_flag"]
        assert r["agreeing"] == "ok"


def test_any_process_group_not_only_world() -> None:
    for rank, res in enumerate(results(4)):
        listed = [3, 1] if rank % 2 else [2, 0]  # new_group's lists; group ranks ascend by global rank
        assert {"ring", "allgather", "alltoall", "listed_descending"} <= set(res["subgroups"]), res["subgroups"]
        for strategy, verdict in res["subgroups"].items():
            if strategy == "broadcast_from_each_group_rank":
                assert verdict == sorted(float(r) for r in listed), (rank, verdict)
            elif strategy == "broadcast_bytes":  # 4 bytes sent by each source, received by its peer
                assert verdict == [(4, 0) if src == sorted(listed).index(rank) else (0, 4) for src in range(2)], (
                    rank, verdict)
            elif strategy in ("ring", "allgather", "alltoall", "listed_descending"):
                assert verdict == "ok", f"{strategy} on a subgroup: {verdict}"


def test_a_refusal_on_a_subgroup_names_the_global_ranks() -> None:
    """Global rank 3 of new_group([2, 3]) (its group rank 1) passes invalid K/V, or refuses
    the inputs of another call: its peer's refusal once named "ranks [1]", a rank of the other
    group. A value unknown on one rank of a group is compared on none of its ranks."""
    for rank, res in enumerate(results(4)):
        got = res["subgroups"]["refused_by_global_rank"]
        if rank < 2:
            assert got == "NO ERROR", (rank, got)
        elif rank == 3:
            assert "H_kv=3" in got, (rank, got)
        else:
            assert "ranks [3]" in got and "rejected" in got, (rank, got)
        got = res["subgroups"]["values_refused_by_global_rank"]
        assert got == ("NO ERROR" if rank < 2 else "mine" if rank == 3 else
                       "ranks [3] of the CP group rejected their decode step inputs; see their errors"), (rank, got)
        unknown, differing, minus_one = res["subgroups"]["unknown_on_one_rank"]
        assert unknown == "NO ERROR", (rank, unknown)  # every rank went on, comparing it nowhere
        assert f"disagree on the decode step: weights {[7, 8] if rank < 2 else [9, 10]} (one value" in differing, (
            rank, differing)  # each group rank's own value, in group rank order
        assert "disagree on the decode step: step [-1, 7] (one value" in minus_one, (rank, minus_one)
        got = res["subgroups"]["layout_for_two_on_a_group_of_one"]
        assert "the zigzag layout was built for P=2 ranks but the process group has 1" in got, (rank, got)
        got = res["subgroups"]["requires_grad_by_global_rank"]
        assert got == "NO ERROR" if rank < 2 else "different requires_grad" in got and "rank 2: q, k, v; rank 3: " \
            "none" in got, (rank, got)
        got = res["subgroups"]["refusal_through_rows_and_columns"]
        assert got == "mine" if rank == 0 else "of the CP group rejected their decode step inputs" in got, (rank, got)


@pytest.mark.parametrize("world", WORLD_SIZES, ids=lambda w: f"P{w}")
def test_auto_strategy_is_exact_chosen_alike_and_recorded(world: int) -> None:
    per_rank = [res["auto"] for res in results(world)]
    for rank, r in enumerate(per_rank):
        assert r["error"] <= 1e-5, f"P={world} rank {rank}: auto vs ring relative error {r['error']:.2e}"
        assert len(r["choices"]) == 1 and r["choices"] == per_rank[0]["choices"], r["choices"]
    strategy, why = per_rank[0]["choices"][0]
    assert strategy in ("ring", "allgather", "alltoall")
    if world == 1:
        assert "one rank" in why
        return
    assert "predicted per layer forward + backward on cpu-default" in why
    on_cpu, on_h100 = per_rank[0]["predicted"]
    assert on_cpu != on_h100, "the test needs hardware on which the choice differs"
    others = f"rank{'s' if world > 2 else ''} {', '.join(map(str, range(world - 1)))}"
    for rank, r in enumerate(per_rank):  # the last rank chose on H100 figures: every rank raises, naming each choice
        assert f"different strategy ({on_cpu} on {others}; {on_h100} on rank {world - 1}; or the one strategy='auto' " \
               f"chose, which follows whether a backward will run and the planner's hardware: requires_grad and " \
               f"ctxpar.auto.set_hardware must be alike" in r["disagreeing"], (rank, r["disagreeing"])
        assert r["refused_choices"] == [], (rank, r["refused_choices"])  # a call refused records no choice
