"""Runs inside spawned ranks sharing this machine's GPU(s): every strategy on CUDA vs fp64.

``test_cuda.py`` spawns one group per world size with ``device_type="cuda"`` (NCCL when
every rank has its own GPU, else gloo staging through host memory) and asserts on what
``run_all`` reports. The cases are ``dist_cases``' checks with the tensors on the GPU.
"""

from __future__ import annotations

import itertools

import torch

from dist_cases import HYBRID_MESH, LAYOUTS, STRATEGIES, Case, check_case

CUDA_DTYPES = ("bfloat16", "float16", "float32")


def cuda_cases() -> list[Case]:
    grid = [Case(*c) for c in itertools.product(STRATEGIES, LAYOUTS, (True, False), ("mha", "gqa"), CUDA_DTYPES)]
    for strategy in STRATEGIES:
        # longer shards cross the fused kernels' tiles; float64 takes the tiled reference kernel
        grid += [Case(strategy, "zigzag", True, "gqa", dtype, chunk=96) for dtype in CUDA_DTYPES]
        grid += [Case(strategy, "zigzag", True, "mqa", "float64"),
                 Case(strategy, "striped", True, "gqa", "bfloat16", memory="interleaved")]
        # masks: PARTIAL tiles take the tiled reference kernel on CUDA, the rest the fused ops
        grid += [Case(strategy, "zigzag", True, "gqa", dtype, chunk=40, documents="random", window=17)
                 for dtype in CUDA_DTYPES]
        grid += [Case(strategy, "balanced", True, "mha", "bfloat16", chunk=6, documents="random", sinks=True),
                 Case(strategy, "contiguous", False, "gqa", "float32", chunk=5, documents="mixed")]
    return grid


def run_all(rank: int, world: int, device: torch.device) -> dict:
    """Every CUDA case that runs on ``world`` ranks; failures are reported, not raised."""
    mesh = None
    if world == HYBRID_MESH[0] * HYBRID_MESH[1]:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cuda", HYBRID_MESH, mesh_dim_names=("ring", "ulysses"))
    results = {}
    for case in cuda_cases():
        if not case.runs_on(world):
            continue
        results[case.id] = check_case(case, rank, world, mesh=mesh if case.strategy == "hybrid" else None,
                                      device=str(device))
    return results
