"""``ctxpar generate``: generation with the reference model over local CPU ranks (or torchrun's).

Every rank builds the same randomly initialised model (``--model``, seeded) and the same
random prompt of ``--prompt-len`` tokens, prefills it over the ranks and decodes
``--new-tokens`` tokens. ``--compare`` generates the same tokens in one process the plain
way (``reference_generate``: no cache, no CP) and reports whether they are equal.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ctxpar import launch, limits, profile, strategy_rules
from ctxpar.inference.generate import check_sampling, generate, prefilled_length, reference_generate
from ctxpar.inference.prefill import INFERENCE_STRATEGIES
from ctxpar.layout import get_layout
from ctxpar.models import Transformer, get_config


@dataclass(frozen=True)
class GenerateConfig:
    nproc: int = 4
    prompt_len: int = 1024
    new_tokens: int = 32
    batch: int = 1
    model: str = "tiny"
    layout: str = "zigzag"
    strategy: str = "ring"
    ulysses_degree: int | None = None  # hybrid only; the ring degree is nproc / ulysses_degree
    temperature: float = 0.0  # 0: greedy
    seed: int = 0
    compare: bool = False
    progress: bool = True
    device: str | None = None  # "cpu" | "cuda"; None: launch.resolve_device_type's default

    def validate(self, world: int) -> None:
        """Every value, before any rank starts; errors name the flag."""
        limits.plain_values(self)
        for field in ("prompt_len", "new_tokens", "batch"):
            limits.check_count(field, getattr(self, field))
        if self.strategy not in INFERENCE_STRATEGIES:
            raise ValueError(f"--strategy {self.strategy!r} is not supported by generate; use one of "
                             f"{', '.join(INFERENCE_STRATEGIES)}")
        cfg = get_config(self.model)
        get_layout(self.layout, world)  # any --prompt-len: what the layout does not split goes to partial_prefill
        strategy_rules.check_heads_split(self.strategy, cfg.heads, cfg.kv_heads, strategy_rules.call_ulysses_degree(
            self.strategy, world, self.ulysses_degree, name="--ulysses-degree"))
        try:
            check_sampling(self.temperature, self.seed)
        except ValueError as e:
            raise ValueError(f"--{e}") from None

    def check_memory(self, ranks: int) -> None:
        """Refuse a run this machine cannot hold: each local rank holds the whole fp32 model
        and its 1/P of the KV cache (a lower bound)."""
        cfg = get_config(self.model)
        positions = self.prompt_len + self.new_tokens - 1
        cache = 2 * cfg.layers * self.batch * cfg.kv_heads * cfg.head_dim * positions * 4
        launch.check_local_memory(4 * ranks * cfg.parameters + cache,
                                  f"--model {self.model} on {ranks} ranks with --prompt-len {self.prompt_len}, "
                                  f"--new-tokens {self.new_tokens} and --batch {self.batch}",
                                  "choose a smaller --model, or lower --prompt-len, --new-tokens, --batch or the "
                                  "ranks on this machine (--nproc, or torchrun's --nproc-per-node)")


def build(cfg: GenerateConfig, device: torch.device) -> tuple[Transformer, torch.Tensor]:
    """The model and prompt every rank (and the reference) builds alike from the seed."""
    torch.manual_seed(cfg.seed)
    model = Transformer(get_config(cfg.model)).to(device).eval()
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    prompt = torch.randint(0, model.cfg.vocab, (cfg.batch, cfg.prompt_len), generator=gen)
    return model, prompt.to(device)


def generate_rank(rank: int, world: int, cfg: GenerateConfig, device: torch.device | None = None) -> dict | None:
    """One rank of ``ctxpar generate``; the report on rank 0."""
    device = device or torch.device("cpu")
    cfg.validate(world)
    model, prompt = build(cfg, device)
    bar = None
    if rank == 0 and cfg.progress and launch.stderr_is_a_terminal():
        from tqdm import tqdm

        bar = tqdm(total=cfg.new_tokens, desc="generate", unit="tok")
    mesh = launch.hybrid_mesh(device.type, world, cfg.ulysses_degree) if cfg.strategy == "hybrid" else None
    with profile.record(timing=False) as rec:  # what strategy="auto" chose, without synchronising the device
        result = generate(model, prompt, layout=cfg.layout, strategy=cfg.strategy, mesh=mesh,
                          new_tokens=cfg.new_tokens, temperature=cfg.temperature, seed=cfg.seed,
                          on_token=bar.update if bar else None)
    if bar is not None:
        bar.close()
    chosen = dict(rec.strategy_choices)  # strategy="auto": {strategy: why}, one entry per distinct choice
    per_rank = [None] * world
    dist.all_gather_object(per_rank, result.kv_cache_bytes)
    if rank != 0:
        return None
    return dict(config=dict(asdict(cfg), nproc=world), tokens=result.tokens.tolist(), ttft_s=result.ttft_s,
                tpot_s=result.tpot_s, kv_cache_bytes_per_rank=per_rank, strategy_chosen=chosen,
                prompt_tail=asdict(result.tail) if result.tail else None,
                device=str(device), backend=dist.get_backend())  # what ran: config's device is the flag, or None


def run_generate(cfg: GenerateConfig, *, timeout_s: float = launch.DEFAULT_TIMEOUT_S) -> dict | None:
    """Generate on local gloo ranks (or torchrun's), then in one process with ``cfg.compare``."""
    cfg.validate(launch.world_size(cfg.nproc))
    cfg.check_memory(launch.local_ranks(cfg.nproc))
    report = launch.run(generate_rank, cfg.nproc, (cfg,), device_type=cfg.device, timeout_s=timeout_s)
    if report is not None and cfg.compare:
        model, prompt = build(cfg, torch.device("cpu"))
        reference = reference_generate(model, prompt, new_tokens=cfg.new_tokens, temperature=cfg.temperature,
                                       seed=cfg.seed)
        report["reference_tokens"] = reference.tolist()
        report["tokens_match"] = report["tokens"] == report["reference_tokens"]
    return report


def _strategy_words(report: dict) -> str:
    c = report["config"]
    layout = get_layout(c["layout"], c["nproc"])
    if not prefilled_length(layout, c["prompt_len"]):  # the strategy moves K/V in prefill only
        return f"no prefill: a prompt under {layout.multiple} tokens goes to partial_prefill"
    if c["strategy"] == "hybrid":
        return f"hybrid: ulysses {c['ulysses_degree']} x ring {c['nproc'] // c['ulysses_degree']}"
    return strategy_rules.named_with_choice(c["strategy"], report.get("strategy_chosen", {}))


def format_report(report: dict) -> str:
    c = report["config"]
    per_rank = report["kv_cache_bytes_per_rank"]
    tpot = "-" if report["tpot_s"] is None else f"{report['tpot_s'] * 1e3:.2f} ms"
    lines = [f"ctxpar generate: {c['model']} model, prompt {c['prompt_len']} x batch {c['batch']}, "
             f"{c['new_tokens']} new tokens, {c['nproc']} rank{'s' * (c['nproc'] != 1)} "
             f"({_strategy_words(report)}, {c['layout']})",
             f"time to first token   {report['ttft_s'] * 1e3:.2f} ms",
             f"time per output token {tpot}",
             f"KV cache per rank     {', '.join(f'{b:,}' for b in per_rank)} bytes"]
    lines += strategy_rules.choice_lines(report.get("strategy_chosen", {}))
    tail = report.get("prompt_tail")
    if tail:
        n = tail["tokens"]
        which = (f"the whole prompt ({n} token{'s' * (n != 1)})" if n == c["prompt_len"] else
                 "the last prompt token" if n == 1 else f"the last {n} prompt tokens")
        lines.append(f"partial_prefill took {which} by {tail['method']}: {tail['why']}")
    for row, tokens in enumerate(report["tokens"]):
        lines.append(f"tokens[{row}]: {' '.join(map(str, tokens))}")
    if "reference_tokens" in report:
        lines.append("OK: the tokens equal the single-process generation" if report["tokens_match"] else
                     "MISMATCH: the tokens differ from the single-process generation")
    return "\n".join(lines)
