"""The planner's kernel seconds per rank against that rank's block plan timed alone.

    python benchmarks/rank_work.py                        # P in {2,4}, T in {512,1024,2048,4096}
    python benchmarks/rank_work.py --json rank_work.json

``plan_vs_measured`` compares the planner with whole demo runs, where a rank's kernels run
between transfers and beside other ranks. This isolates the planner's half: after
calibrating (``ctxpar.calibrate``), it runs each rank's compute exactly as the ring and
all-gather strategies do between their transfers (``blockwise.forward_tiles`` /
``backward_tiles`` over the rank's block plan, the all-gather's head groups and key
order; random K/V in place of the gathered ones) in this one process, one thread, and
takes the best of ``--repeat`` runs of the process CPU time, forward + backward. Against it:
``cost.compute_seconds(w, hw, rank)`` (each tile at the size curve's rate for its keys,
plus its merge and gradient adds: ``cost.tile_overhead_seconds``).
The demo's shape: H=8, H_kv=2, D=64, float32, causal, zigzag; ``--window`` and ``--doc-len``
add a sliding window or packed documents to the mask. Error = predicted / timed - 1.
"""

from __future__ import annotations

import argparse
import time

import torch

from ctxpar.blocks import gathered_key_order
from ctxpar.calibrate import calibrate, load_calibration
from ctxpar.demo import DemoConfig
from ctxpar.layout import get_layout
from ctxpar.masks import Mask
from ctxpar.models.config import attention_only
from ctxpar.plan import cost
from ctxpar.plan.hardware import local_hardware
from ctxpar.plan.workload import Workload
from ctxpar.strategies.allgather import _arrange, _attend_backward, _attend_forward, _by_arrival, head_groups
from ctxpar.strategies.blockwise import backward_tiles, forward_tiles, gradient_accumulators, output_accumulators
from ctxpar.strategies.ring import ring_schedule
import flags
from report import write_json

TIMED = ("ring", "allgather")  # the strategies whose per-rank compute this times


def _best_cpu_seconds(run, prepare, repeat: int) -> float:
    """Best process CPU seconds of ``run(*prepare())``: what ``prepare`` makes (the buffers the
    strategies allocate outside their timed compute) is not timed."""
    best = float("inf")
    for _ in range(repeat):
        buffers = prepare()
        start = time.process_time()
        run(*buffers)
        best = min(best, time.process_time() - start)
    return best


def rank_compute(cfg: DemoConfig, rank: int, repeat: int, mask: Mask) -> tuple[float, float]:
    """(forward, backward) CPU seconds of ``rank``'s compute under ``cfg.strategy`` and ``mask``,
    alone: what the strategy runs inside ``profile.timed("compute")``, no more."""
    world, seq = cfg.nproc, cfg.seq
    layout, local, scale = get_layout(cfg.layout, world), cfg.seq // cfg.nproc, cfg.head_dim**-0.5
    gen = torch.Generator().manual_seed(rank)
    q, dout = (torch.randn(cfg.batch, cfg.heads, local, cfg.head_dim, generator=gen) for _ in range(2))
    shards = torch.randn(world, 2, cfg.batch, cfg.kv_heads, local, cfg.head_dim, generator=gen)  # every rank's K/V
    if cfg.strategy == "ring":
        plan = ring_schedule(layout, seq, mask, rank)
        sources = [(rank - step) % world for step in range(plan.steps + 1)]  # whose keys step s holds

        def forward(out, lse):
            for step, src in enumerate(sources):
                forward_tiles(q, shards[src, 0], shards[src, 1], plan.tiles[step], out, lse, scale)

        def gradients():  # dQ, and a dK/dV share per step: its own shard's, then fresh zeros
            dq, own = gradient_accumulators(q, shards[rank, 0])
            return dq, [own] + [torch.zeros_like(own) for _ in sources[1:]]

        def backward(dq, shares):
            for step, src in enumerate(sources):
                backward_tiles(dout, q, shards[src, 0], shards[src, 1], out, lse, plan.tiles[step], scale, dq,
                               shares[step][0], shares[step][1])
    elif cfg.strategy == "allgather":
        order = gathered_key_order(layout, seq, rank, mask)
        per_kv = cfg.heads // cfg.kv_heads
        groups = [(slice(h.start * per_kv, h.stop * per_kv), _arrange(shards[:, :, :, h], order))
                  for h in head_groups(cfg.kv_heads)]  # arranged outside the compute, as the strategy does

        def forward(out, lse):
            for qh, keys in groups:
                _attend_forward(q[:, qh], keys, order, out[:, qh], lse[:, qh], scale)

        def gradients():
            return (gradient_accumulators(q, shards[rank, 0])[0],)

        def backward(dq):  # the shares are allocated inside, as in the strategy
            for qh, keys in groups:
                _by_arrival(_attend_backward(dout[:, qh], q[:, qh], keys, out[:, qh], lse[:, qh], order, scale,
                                             dq[:, qh]), order, world)
    else:
        raise ValueError(f"rank_work times {' and '.join(TIMED)}, not {cfg.strategy!r}")
    out, lse = output_accumulators(q)
    forward(out, lse)  # warm-up, and the (out, lse) the backward reads
    backward(*gradients())
    return (_best_cpu_seconds(forward, lambda: output_accumulators(q), repeat),
            _best_cpu_seconds(backward, gradients, repeat))


def documents_of(seq: int, length: int) -> tuple[int, ...]:
    """Documents of ``length`` tokens filling ``seq``, the last one shorter if it must be."""
    return (length,) * (seq // length) + ((seq % length,) if seq % length else ())


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[DemoConfig], dict | None]:
    """The flags, the cases they make and the ``--calibration`` read (None: measure one), every
    one checked before the minute of calibration."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nprocs", type=flags.counts, default="2,4")
    p.add_argument("--seqs", type=flags.counts, default="512,1024,2048,4096")
    p.add_argument("--strategies", type=flags.names(TIMED), default="ring,allgather")
    p.add_argument("--repeat", type=flags.count, default=10, help="runs per rank; best CPU seconds")
    p.add_argument("--calibration", metavar="PATH", help="a saved calibration instead of measuring one")
    p.add_argument("--window", type=flags.count, help="a causal sliding window of this many keys")
    p.add_argument("--doc-len", type=flags.count,
                   help="documents of this many tokens packed in the row (the last shorter)")
    p.add_argument("--json", metavar="PATH", type=flags.output_file)
    args = p.parse_args(argv)
    cfgs = [DemoConfig(nproc=nproc, seq=seq, strategy=strategy) for nproc in args.nprocs for seq in args.seqs
            for strategy in args.strategies]
    calibration = None
    with flags.refusals(p):
        for cfg in cfgs:
            cfg.validate(cfg.nproc, seq_flag="--seqs")
        if args.calibration is not None:
            calibration = load_calibration(args.calibration)
            try:
                local_hardware(calibration)
            except ValueError as e:
                raise ValueError(f"--calibration {args.calibration!r}: {e}") from None
    return args, cfgs, calibration


def main() -> None:
    args, cfgs, calibration = parse_args()
    torch.set_num_threads(1)
    if calibration is None:
        calibration = calibrate()
    hw = local_hardware(calibration)
    rows = []
    for cfg in cfgs:
        documents = None if args.doc_len is None else documents_of(cfg.seq, args.doc_len)
        mask = Mask(causal=cfg.causal, window=args.window, documents=documents)
        w = Workload(attention_only(cfg.heads, cfg.kv_heads, cfg.head_dim), batch=cfg.batch, seq=cfg.seq,
                     dtype=cfg.dtype, cp=cfg.nproc, strategy=cfg.strategy, layout=cfg.layout, causal=cfg.causal,
                     window=args.window, documents=documents)
        for rank in range(cfg.nproc):
            timed, planned = rank_compute(cfg, rank, args.repeat, mask), cost.compute_seconds(w, hw, rank)
            rows.append(dict(nproc=cfg.nproc, seq=cfg.seq, strategy=cfg.strategy, rank=rank,
                             tokens_per_rank=cfg.seq // cfg.nproc, forward_timed=timed[0], backward_timed=timed[1],
                             forward_planned=planned[0], backward_planned=planned[1],
                             error=sum(planned) / sum(timed) - 1))
    print(f"{'P':>2} {'T':>5} {'strategy':<10} {'rank':>4} {'fwd ms':>7} {'plan':>7} {'bwd ms':>7} {'plan':>7} "
          f"{'error':>7}")
    for r in rows:
        print(f"{r['nproc']:>2} {r['seq']:>5} {r['strategy']:<10} {r['rank']:>4} {r['forward_timed'] * 1e3:>7.2f} "
              f"{r['forward_planned'] * 1e3:>7.2f} {r['backward_timed'] * 1e3:>7.2f} "
              f"{r['backward_planned'] * 1e3:>7.2f} {r['error']:>+7.1%}")
    worst = max(rows, key=lambda r: abs(r["error"]))
    print(f"\nlargest error {worst['error']:+.1%} (P={worst['nproc']}, T={worst['seq']}, {worst['strategy']}, "
          f"rank {worst['rank']}) over {len(rows)} ranks")
    if args.json:
        write_json(args.json, args, calibration=calibration, rows=rows)


if __name__ == "__main__":
    main()
