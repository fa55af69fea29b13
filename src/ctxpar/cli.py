"""The ``ctxpar`` command: thin argparse over the library."""

from __future__ import annotations

import argparse
import difflib
import json
import os
import sys
import traceback
import warnings
from typing import NoReturn

import torch

import ctxpar
from ctxpar import calibrate as calibration_
from ctxpar import launch
from ctxpar import plan as planning
from ctxpar import rank_server
from ctxpar.demo import DTYPES, DemoConfig, format_report, run_demo
from ctxpar.inference import command as generation
from ctxpar.layout import LAYOUT_NAMES, get_layout
from ctxpar.limits import check_count, check_seed
from ctxpar.models.config import PRESETS as MODEL_PRESETS
from ctxpar.strategy_rules import CALL_STRATEGIES, STRATEGY_NAMES
from ctxpar.train import GRADIENT_RTOL, JUDGED_STEPS, LOSS_RTOL, TRAIN_STRATEGIES, TrainConfig, run_train
from ctxpar.train import format_report as format_train_report


STDOUT = "-"  # --json - : the JSON on stdout, the report for people on stderr (``| jq``)
TO_STDOUT = " (- for stdout, the report then on stderr)"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where it says something: not for an unset flag (None), not for a
    plain switch (--compare's False, --no-progress's True) and not where the help already states its
    default in words."""

    def _get_help_string(self, action: argparse.Action) -> str:
        switch = action.nargs == 0 and not isinstance(action, argparse.BooleanOptionalAction)
        if action.default is None or action.default is argparse.SUPPRESS or switch or "default" in action.help:
            return action.help
        return super()._get_help_string(action)


def _demo_parser(sub) -> None:
    d = DemoConfig()
    p = sub.add_parser(
        "demo",
        help="run CP attention on local CPU ranks (or torchrun's) and check it against unsplit attention",
        formatter_class=_HelpFormatter,
    )
    _launch_flags(p, d.nproc)
    p.add_argument("--seq", type=int, default=d.seq, help="global sequence length T")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences B")
    p.add_argument("--heads", type=int, default=d.heads, help="query heads H")
    p.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads H_kv (GQA)")
    p.add_argument("--head-dim", type=int, default=d.head_dim, help="head dim D")
    p.add_argument("--layout", choices=LAYOUT_NAMES, default=d.layout, help="which positions each rank holds")
    p.add_argument("--strategy", choices=CALL_STRATEGIES, default=d.strategy,
                   help="how ranks exchange K/V (auto: the one the planner predicts fastest for these shapes)")
    p.add_argument("--ulysses-degree", type=int, default=d.ulysses_degree,
                   help="hybrid only: all-to-all degree; the ring degree is nproc / this")
    p.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype, help="dtype of q, k, v")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=d.causal, help="causal mask")
    p.add_argument("--seed", type=int, default=d.seed, help="seed of the random inputs")
    p.add_argument("--json", metavar="PATH", help="also write the full report as JSON" + TO_STDOUT)


def _launch_flags(p: argparse.ArgumentParser, nproc: int) -> None:
    p.add_argument("--nproc", type=int, default=nproc,
                   help="local ranks to spawn (under torchrun leave it out: torchrun's own parser reads it "
                        "as an abbreviation of its --nproc-per-node and refuses the launch)")
    p.add_argument("--device", choices=launch.DEVICE_TYPES,
                   help="where ranks compute (default: the GPU under torchrun when there is one, else the CPU); "
                        "--device cuda with more local ranks than GPUs shares them, staging transfers through host "
                        "memory (a test and debug path)")
    p.add_argument("--timeout", type=float, default=launch.DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help="how long a rank waits at one collective (or for the others to join) before the run "
                        f"fails, naming the rank that did not arrive ({launch.MIN_TIMEOUT_S:g} to "
                        f"{launch.MAX_TIMEOUT_S:g}); the run as a whole has no time limit")


def _check_launch_flags(args: argparse.Namespace) -> int:
    """--nproc, --device and --timeout; returns the number of ranks the run will have."""
    if not launch.launched_by_torchrun():
        launch.check_nproc(args.nproc, "--nproc")
    launch.resolve_device_type(args.device, "--device")
    launch.check_timeout(args.timeout, "--timeout")
    return launch.world_size(args.nproc)


def check_output(flag: str, path: str | None, example: str = "out.json", stdout_ok: bool = False) -> None:
    """Refuse an output file that could not be written, before any work is done. ``-`` is
    stdout where ``stdout_ok``, and refused elsewhere: it was written as a file named '-'."""
    if path is None:
        return
    if not path.strip():
        raise ValueError(f"{flag} needs a file path, e.g. {example}; got an empty one")
    if path == STDOUT:
        if stdout_ok:
            return
        raise ValueError(f"{flag} '-' would write a file named '-' here; give a file path, e.g. {example} "
                         f"(or ./- for that name)")
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path!r} is a directory; give a file path, e.g. {os.path.join(path, example)}")
    if path.endswith(os.sep):  # a directory that does not exist (yet): writing said "Is a directory"
        raise ValueError(f"{flag} {path!r} ends in {os.sep!r}, so names a directory, not a file; give a file path, "
                         f"e.g. {os.path.join(path, example)}")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise ValueError(f"{flag} {path!r}: the directory {parent} does not exist; create it first "
                         f"(mkdir -p {parent}) or choose another path")
    if os.path.exists(path) and not os.path.isfile(path):
        return  # /dev/stdout, a FIFO: opening one to try it could block
    try:  # permission bits are not the whole answer (root, read-only mounts, /proc): try it
        if os.path.lexists(path):  # a file, or a link to one to be (a missing directory fails here)
            with open(path, "a"):
                pass
        else:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL))
            except FileExistsError:  # another torchrun rank's probe, at this instant: it removes its own
                return
            os.remove(path)
    except OSError as e:
        raise ValueError(f"{flag} {path!r} is not writable ({e.strerror}); choose a path you can write") from None


def _report(text: str, json_path: str | None, data: dict) -> None:
    """Print a command's report and write its JSON, the JSON first: a reader of stdout that
    is gone (``| head``) must not cost the file, nor the command's exit status. With
    ``--json -`` the JSON is what stdout gets, and the report goes to stderr."""
    if json_path == STDOUT:
        launch.note(text)  # stderr's reader gone or its disk full: stdout still gets the JSON
        text, json_path = json.dumps(data, indent=2), None
    json_error = None  # why the JSON could not be written
    if json_path:
        try:
            with open(json_path, "w") as f:
                json.dump(data, f, indent=2)
        except OSError as e:  # e.g. the disk filled up during the run
            json_error = e.strerror
    json_said = "" if not json_path else f"; nor could --json {json_path!r} ({json_error})" if json_error \
        else f"; --json {json_path!r} holds it"
    if sys.stdout is None:  # started with stdout closed (1>&-): print would drop the report without a word
        raise ReportUnwritten(f"the report could not be written to stdout (it is closed){json_said}")
    encoding = getattr(sys.stdout, "encoding", None)
    if encoding:  # '·' and '≤' as '?' where stdout's encoding lacks them (an ASCII locale): the encoding
        text = text.encode(encoding, "replace").decode(encoding)  # error, a ValueError, read as a bad flag
    try:
        print(text, flush=True)
    except BrokenPipeError:  # stdout's reader is gone (``| head``): what it did not read, nobody wants
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor Python's flush at exit
    except OSError as e:  # stdout is a file on a full disk, or gone otherwise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail again
        raise ReportUnwritten(f"the report could not be written to stdout ({e.strerror}){json_said}")
    if json_error is not None:
        raise ReportUnwritten(f"--json {json_path!r} could not be written ({json_error}); the report above is "
                              f"complete")


class ReportUnwritten(Exception):
    """A command's report (stdout, --json, --plot) could not be written once its work was done (a
    full disk): exit status 1, said in one line; status 2 is for values refused up front."""


def _run_demo(args: argparse.Namespace) -> int:
    _check_launch_flags(args)
    check_output("--json", args.json, stdout_ok=True)
    cfg = DemoConfig(
        nproc=args.nproc, seq=args.seq, heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
        layout=args.layout, strategy=args.strategy, dtype=args.dtype, causal=args.causal,
        batch=args.batch, seed=args.seed, ulysses_degree=args.ulysses_degree, device=args.device,
    )
    report = run_demo(cfg, timeout_s=args.timeout)
    if report is None:  # a non-zero rank under torchrun
        return 0
    _report(format_report(report), args.json, report)
    return 0 if report["ok"] else 1


def _train_parser(sub) -> None:
    d = TrainConfig()
    p = sub.add_parser(
        "train",
        help="train the reference model with CP (x FSDP data parallelism) on a long-range recall task",
        formatter_class=_HelpFormatter,
    )
    _launch_flags(p, d.nproc)
    p.add_argument("--dp", type=int, default=d.dp, help="data-parallel degree; CP degree = ranks / dp")
    p.add_argument("--cp", type=int, help="CP degree; if given, must equal ranks / dp")
    p.add_argument("--seq", type=int, default=d.seq, help="sequence length T")
    p.add_argument("--batch", type=int, default=d.batch, help="sequences per data-parallel group per step")
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    p.add_argument("--lr", type=float, default=d.lr, help="learning rate")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=d.model, help="model preset")
    p.add_argument("--strategy", choices=TRAIN_STRATEGIES, default=d.strategy, help="how ranks exchange K/V")
    p.add_argument("--ulysses-degree", type=int, default=d.ulysses_degree,
                   help="hybrid only: all-to-all degree; the ring degree is the CP degree / this")
    p.add_argument("--layout", choices=LAYOUT_NAMES, default=d.layout, help="which positions each rank holds")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the weights and the data")
    p.add_argument("--activation-checkpointing", action="store_true",
                   help="recompute each decoder layer in the backward instead of storing its activations")
    p.add_argument("--compare", action="store_true",
                   help="also train on unsplit sequences in one process and compare (exit status 1 where a "
                        f"parameter's gradient of step 1 differs by more than {GRADIENT_RTOL:g} of its norm, or a "
                        f"loss of the first {JUDGED_STEPS} steps by more than {LOSS_RTOL:g} of it, from the "
                        f"reference's)")
    p.add_argument("--checkpoint-dir",
                   help="where torch.distributed.checkpoint saves the last step (and every --save-every steps) "
                        "and --resume continues from; made, with any missing parents, if it does not exist")
    p.add_argument("--save-every", type=int, default=d.save_every,
                   help="with --checkpoint-dir: steps between checkpoints besides the last (0: the last only)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest verified checkpoint in --checkpoint-dir, to --steps in all")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", metavar="PATH", help="write losses (and reference losses) as JSON" + TO_STDOUT)


def _run_train(args: argparse.Namespace) -> int:
    world = _check_launch_flags(args)
    if args.json and args.json.strip() and args.json != STDOUT and args.checkpoint_dir and args.checkpoint_dir.strip():
        # before check_output, which would suggest a file inside an existing directory; through symbolic links
        report, directory = os.path.realpath(args.json), os.path.realpath(args.checkpoint_dir)
        if os.path.commonpath([report, directory]) == directory:
            beside = os.path.join(os.path.dirname(directory), "report.json")
            where = "is the" if report == directory else "is inside the"
            raise ValueError(f"--json {args.json!r} {where} --checkpoint-dir; give the report a file of its own "
                             f"outside it (--resume names every file in it that is not a checkpoint), e.g. {beside}")
    check_output("--json", args.json, stdout_ok=True)
    if args.cp is not None and (args.cp < 1 or args.cp * args.dp != world):
        raise ValueError(f"--cp {args.cp} x --dp {args.dp} must equal the {world} ranks; leave --cp out to use "
                         f"ranks / dp")
    cfg = TrainConfig(
        nproc=args.nproc, dp=args.dp, seq=args.seq, batch=args.batch, steps=args.steps, lr=args.lr,
        model=args.model, strategy=args.strategy, ulysses_degree=args.ulysses_degree, layout=args.layout,
        seed=args.seed, activation_checkpointing=args.activation_checkpointing, compare=args.compare,
        checkpoint_dir=args.checkpoint_dir, save_every=args.save_every, resume=args.resume, progress=args.progress,
        device=args.device,
    )
    try:
        report = run_train(cfg, timeout_s=args.timeout)
    except launch.StopRun as e:  # a torchrun rank (local ranks' stops come as a RankFailure) or --compare's run
        return _stop("train", e, 1)
    if report is None:  # a non-zero rank under torchrun
        return 0
    _report(format_train_report(report), args.json, {k: v for k, v in report.items() if not k.endswith("parameters")})
    return 1 if False in (report.get("losses_match"), report.get("gradients_match")) else 0


def _plan_parser(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="memory, traffic and time per GPU for a model and sequence; when CP pays off, and which CP to use",
        formatter_class=_HelpFormatter,
    )
    shape = p.add_argument_group("model shape (fields not given come from --model)")
    shape.add_argument("--model", choices=sorted(MODEL_PRESETS), help=f"preset (default {planning.DEFAULT_MODEL})")
    for flag, what in (("layers", "decoder layers L"), ("hidden", "model width d"),
                       ("heads", "query heads H (default hidden / head-dim when those are given)"),
                       ("kv-heads", "key/value heads H_kv"), ("head-dim", "head dim D"), ("ffn", "SwiGLU width"),
                       ("vocab", "vocabulary size V")):
        shape.add_argument(f"--{flag}", type=int, help=what)
    p.add_argument("--batch", type=int, default=1, help="sequences per step B")
    p.add_argument("--seq", type=int, default=32768, help="sequence length T")
    p.add_argument("--dtype", choices=sorted(planning.ELEMENT_BYTES), default="bfloat16", help="activation dtype")
    p.add_argument("--cp", type=int, default=8, help="CP degree P")
    p.add_argument("--strategy", choices=STRATEGY_NAMES, default="ring", help="how ranks exchange K/V")
    p.add_argument("--layout", choices=LAYOUT_NAMES, default="zigzag", help="which positions each rank holds")
    p.add_argument("--ulysses-degree", type=int, help="hybrid only (default: the largest fitting in a node)")
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True, help="causal mask")
    mask = p.add_argument_group("mask (work and traffic follow it exactly, or the traffic is reported as a bound)")
    mask.add_argument("--window", type=int, metavar="W",
                      help="causal sliding window: each query sees itself and the W-1 keys before it")
    mask.add_argument("--documents", metavar="LENGTHS",
                      help="lengths of the documents packed into a row, e.g. 8192,512,30000; repeated or cut to --seq")
    mask.add_argument("--doc-dist", metavar="DIST",
                      help="document lengths drawn from DIST until the row is full: fixed:LEN or lognormal:MEAN,SIGMA "
                           "(MEAN tokens on average; SIGMA the spread of ln length, 1-2 for real corpora)")
    mask.add_argument("--doc-seed", type=int, help="seed of --doc-dist's draws (default 0: the same plan every run)")
    par = p.add_argument_group("parallel composition (rank order TP innermost, then CP, DP, PP, as Megatron)")
    par.add_argument("--tp", type=int, default=1,
                     help="tensor-parallel degree: heads, MLP width and vocabulary split over TP GPUs (Megatron)")
    par.add_argument("--sequence-parallel", action=argparse.BooleanOptionalAction, default=True,
                     help="with --tp: Megatron's sequence parallelism (norms and stored inputs split over TP)")
    par.add_argument("--dp", type=int,
                     help="data-parallel replicas of the TP x CP group (default: 1, or the fewest --fsdp needs)")
    par.add_argument("--fsdp", type=int, default=1,
                     help="degree sharding each TP rank's parameters, gradients, optimizer states; divides DP x CP")
    par.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages, each a TP x CP group (Megatron)")
    par.add_argument("--microbatches", type=int, default=1,
                     help="micro-batches of --batch sequences per step (through the pipeline; without --pp: "
                          "gradient accumulation)")
    par.add_argument("--virtual-stages", type=int, default=1,
                     help="with --pp: chunks of layers per GPU, Megatron's interleaved schedule (1: plain 1F1B)")
    p.add_argument("--checkpointing", choices=planning.CHECKPOINTING, default="none", help="activation checkpointing")
    p.add_argument("--max-cp", type=int, help="largest CP degree to compare (default max(--cp, 16))")
    hw = p.add_argument_group("hardware")
    hw.add_argument("--hardware", default="H100-SXM", help=f"one of {', '.join(planning.HARDWARE_NAMES)}")
    hw.add_argument("--bandwidth", help="link bytes/s per GPU per direction: 100GB/s, 400Gb/s")
    hw.add_argument("--flops", help="peak FLOP/s: 989T, 2.25P")
    hw.add_argument("--efficiency", type=float, help="achieved fraction of a preset's peak FLOP/s")
    hw.add_argument("--gpus-per-node", type=int,
                    help="GPUs joined by the intra-node link (default: the hardware's); wider groups use the NIC")
    hw.add_argument("--calibrate", action="store_true", help="with --hardware local: measure this machine first")
    hw.add_argument("--calibration", metavar="PATH", help="with --hardware local: a JSON from --calibrate --json")
    hw.add_argument("--latency", metavar="SECONDS",
                    help="seconds every message costs, 20us or 0.00002 (default: the hardware's, 0 for presets, "
                         "measured for local)")
    hw.add_argument("--launch-overhead", metavar="SECONDS",
                    help="seconds every kernel call costs, e.g. 5us (default: the hardware's: measured by make "
                         "gpu-check for H200, 0 for the other presets, measured here for local)")
    hw.add_argument("--step-overhead", metavar="SECONDS",
                    help="seconds every ring step (pipeline stage) costs besides kernels and messages (default 0 for "
                         "presets; measured per strategy for local, fixed and per byte sent: this replaces both)")
    hw.add_argument("--tile-overhead", metavar="SECONDS[,SECONDS]",
                    help="seconds every tile of a block plan costs beyond its kernel call (merging its output; "
                         "adding its gradients), forward,backward or one value for both, e.g. 20us,10us (default 0 "
                         "for presets; measured for local, fixed and per byte: this replaces both; make gpu-check "
                         "measures a GPU's tile loop)")
    hw.add_argument("--fp8", action="store_true",
                    help="matmuls in fp8: the fp8 dense peak x the matmul efficiency (attention stays in --dtype)")
    serve = p.add_argument_group("inference (serving instead of a training step; --seq is the prompt length)")
    serve.add_argument("--inference", action="store_true",
                       help="prefill time (time to first token), decode time per token and KV cache per GPU against "
                            "CP degree, and pass-KV vs pass-Q for a chunk on top of the cache")
    serve.add_argument("--new-tokens", type=int, default=argparse.SUPPRESS, metavar="N",
                       help="tokens generated after the prompt (default: 256)")
    serve.add_argument("--chunk", type=int, default=argparse.SUPPRESS, metavar="T_NEW",
                       help="a follow-up chunk prefilled on top of prompt + new tokens, for pass-KV vs pass-Q "
                            "(default: --seq // 16, at least 1)")
    p.add_argument("--json", metavar="PATH", help="write every figure (exact bytes, seconds) as JSON" + TO_STDOUT)
    p.add_argument("--plot", metavar="PATH", help="write a PNG: efficiency vs sequence length, memory per GPU")


def _plan_documents(args: argparse.Namespace) -> tuple[tuple[int, ...] | None, str | None]:
    """(document lengths, where they came from) from --documents / --doc-dist / --doc-seed."""
    if args.documents is not None and args.doc_dist is not None:
        raise ValueError("--documents and --doc-dist both describe the documents; give one of them")
    if args.doc_seed is not None:
        if args.doc_dist is None:
            raise ValueError("--doc-seed seeds --doc-dist's draws; add --doc-dist or drop --doc-seed")
        check_seed(args.doc_seed, "--doc-seed")
    if args.documents is not None:
        return planning.parse_lengths(args.documents, "--documents"), "given"
    if args.doc_dist is None:
        return None, None
    dist = planning.parse_doc_dist(args.doc_dist, "--doc-dist")
    seed = args.doc_seed or 0
    # one stream of documents for every length the sweep evaluates (a shorter row is its prefix)
    tokens = max(planning.sweep_seqs(args.seq))
    return planning.sample_lengths(dist, tokens, seed), f"{dist} seed {seed}"


DEFAULT_NEW_TOKENS = 256


def _inference_flags(args: argparse.Namespace) -> tuple[int, int | None]:
    """(new tokens, chunk) of --inference (chunk None: the planner's default); refuses the flags
    that describe only a training step with it, and its own flags without it."""
    given = vars(args)
    if not args.inference:
        for flag in ("--new-tokens", "--chunk"):
            if flag[2:].replace("-", "_") in given:
                raise ValueError(f"{flag} is an input of the inference plan; add --inference or drop {flag}")
        return DEFAULT_NEW_TOKENS, None
    if args.dp is not None:
        raise ValueError("--dp: --inference plans one serving replica (data-parallel replicas serve other prompts and "
                         "change nothing per GPU); drop --dp")
    training = (("--checkpointing", args.checkpointing, "none"), ("--fsdp", args.fsdp, 1), ("--plot", args.plot, None),
                ("--pp", args.pp, 1), ("--microbatches", args.microbatches, 1),
                ("--virtual-stages", args.virtual_stages, 1),
                ("--window", args.window, None), ("--documents", args.documents, None),
                ("--doc-dist", args.doc_dist, None), ("--doc-seed", args.doc_seed, None))
    for flag, value, default in training:
        if value != default:
            raise ValueError(f"{flag} {value} describes a training step; --inference plans serving (causal prompts, "
                             f"the whole model on every CP rank, split over --tp, no backward): drop {flag}")
    if not args.causal:
        raise ValueError("--no-causal: --inference plans a causal decoder; drop --no-causal")
    new_tokens, chunk = given.get("new_tokens", DEFAULT_NEW_TOKENS), given.get("chunk")
    check_count("new_tokens", new_tokens)
    if chunk is not None:
        check_count("chunk", chunk)
    return new_tokens, chunk


def _check_prompt_splits(seq: int, layout: str, cp: int) -> None:
    """Refuse an --inference prompt the layout does not split, saying how generate serves it."""
    multiple = get_layout(layout, cp).multiple
    if seq % multiple:
        head = seq // multiple * multiple
        fix = (f"plan --seq {head} (--chunk gives a partial prefill's time)" if head else
               "plan a lower --cp")
        raise ValueError(f"--seq {seq}: the {layout} layout on --cp {cp} prefills prompts of a multiple of {multiple} "
                         f"tokens; ctxpar generate takes any length, prefilling the longest such head ({head} "
                         f"tokens) and the other {seq - head} as a partial prefill: {fix}")


def _run_plan(args: argparse.Namespace) -> int:
    # everything is checked first; measuring this machine (--calibrate) starts processes, so it comes last
    new_tokens, chunk = _inference_flags(args)
    bandwidth = planning.parse_bandwidth(args.bandwidth) if args.bandwidth is not None else None
    peak_flops = planning.parse_flops(args.flops) if args.flops is not None else None
    latency, launch_overhead, step = (None if text is None else planning.parse_latency(text, flag) for text, flag in (
        (args.latency, "--latency"), (args.launch_overhead, "--launch-overhead"),
        (args.step_overhead, "--step-overhead")))
    tile = None if args.tile_overhead is None else planning.parse_tile_overhead(args.tile_overhead)
    planning.check_overrides(bandwidth=bandwidth, peak_flops=peak_flops, efficiency=args.efficiency,
                             gpus_per_node=args.gpus_per_node, hardware=args.hardware)
    if args.fp8:
        planning.gpus_per_node(args.hardware)  # an unknown --hardware is refused as such
        planning.check_fp8(args.hardware)
    calibration_.check_calibration_flags(args.hardware, measure=args.calibrate, path=args.calibration)
    with warnings.catch_warnings(record=True) as notes:  # a line each, not a UserWarning with its source line
        warnings.simplefilter("always", calibration_.OldCalibration)
        calibration = calibration_.load_calibration(args.calibration) if args.calibration is not None else None
    for note in notes:
        if issubclass(note.category, calibration_.OldCalibration):
            launch.note(f"ctxpar plan: note: {note.message}")
        else:  # another library's warning: as it would have been shown
            warnings.warn_explicit(note.message, note.category, note.filename, note.lineno)
    check_output("--json", args.json, stdout_ok=True)
    check_output("--plot", args.plot, "plan.png")
    if args.plot is not None:
        planning.check_plot_support(args.plot)
        if args.json and os.path.realpath(args.json) == os.path.realpath(args.plot):
            raise ValueError(f"--json and --plot both name {args.plot!r}: the plot would overwrite the JSON; give "
                             f"them different paths")
    model = planning.resolve_model(args.model, layers=args.layers, hidden=args.hidden, heads=args.heads,
                                   kv_heads=args.kv_heads, head_dim=args.head_dim, ffn=args.ffn, vocab=args.vocab)
    gpus_per_node = planning.gpus_per_node(args.hardware)  # also refuses an unknown --hardware
    gpus_per_node = args.gpus_per_node or gpus_per_node
    check_count("tp", args.tp)
    ulysses = args.ulysses_degree
    if args.strategy == "hybrid" and ulysses is None:
        ulysses = planning.default_ulysses(model.heads, args.cp, gpus_per_node, args.tp)
        if ulysses is None:
            raise ValueError(f"--strategy hybrid: no all-to-all degree U fits: U must divide --cp {args.cp} "
                             f"(below it) and the {model.heads // args.tp} query heads per TP rank, "
                             f"with --tp {args.tp} x U dividing the {gpus_per_node} GPUs per node; "
                             "give --ulysses-degree, or use --strategy ring")
    planning.check_plan_size(args.seq, args.cp, args.max_cp)
    if args.inference:
        _check_prompt_splits(args.seq, args.layout, args.cp)
    documents, documents_from = _plan_documents(args)
    workload = planning.Workload(
        model, batch=args.batch, seq=args.seq, dtype=args.dtype, cp=args.cp, strategy=args.strategy,
        layout=args.layout, ulysses=ulysses, tp=args.tp, dp=args.dp, fsdp=args.fsdp, pp=args.pp,
        microbatches=args.microbatches, virtual_stages=args.virtual_stages, sequence_parallel=args.sequence_parallel,
        checkpointing=args.checkpointing, causal=args.causal,
        window=args.window, documents=documents, documents_from=documents_from)
    if args.calibrate:
        calibration = calibration_.plan_calibration(args.hardware, measure=True, path=None)
        shown = calibration_.format_calibration(calibration) + "\n"
        if args.json == STDOUT:
            launch.note(shown)
        else:
            print(shown)
    hardware = planning.get_hardware(args.hardware, calibration=calibration, efficiency=args.efficiency,
                                     bandwidth=bandwidth, peak_flops=peak_flops, latency=latency,
                                     gpus_per_node=args.gpus_per_node, launch_overhead=launch_overhead,
                                     step_overhead=step, tile_overhead=tile, fp8=args.fp8)
    if args.inference:
        served = planning.make_inference_plan(workload, hardware, new_tokens=new_tokens, chunk=chunk,
                                              max_cp=args.max_cp, calibration=calibration)
        _report(planning.format_inference_plan(served), args.json, planning.inference_to_json(served))
        return 0
    plan = planning.make_plan(workload, hardware, max_cp=args.max_cp, calibration=calibration)
    _report(planning.format_plan(plan), args.json, planning.to_json(plan))
    if args.plot:
        try:
            planning.write_plot(plan, args.plot)
        except OSError as e:  # e.g. the disk filled up: one line, as --json says it
            raise ReportUnwritten(f"--plot {args.plot!r} could not be written ({e.strerror or e}); the report above "
                                  f"is complete") from None
    return 0


def _generate_parser(sub) -> None:
    d = generation.GenerateConfig()
    p = sub.add_parser(
        "generate",
        help="generate with the reference model, its KV cache sharded over the ranks; time to first token, time "
             "per output token, KV-cache bytes per rank",
        formatter_class=_HelpFormatter,
    )
    _launch_flags(p, d.nproc)
    p.add_argument("--prompt-len", type=int, default=d.prompt_len, help="prompt length T (random tokens)")
    p.add_argument("--new-tokens", type=int, default=d.new_tokens, help="tokens to generate per sequence")
    p.add_argument("--batch", type=int, default=d.batch, help="prompts decoded together (one length)")
    p.add_argument("--model", choices=sorted(MODEL_PRESETS), default=d.model,
                   help="model preset, randomly initialised from --seed")
    p.add_argument("--layout", choices=LAYOUT_NAMES, default=d.layout, help="how prefill splits the prompt")
    p.add_argument("--strategy", choices=generation.INFERENCE_STRATEGIES, default=d.strategy,
                   help="how prefill moves K/V (auto: the planner picks per layer)")
    p.add_argument("--ulysses-degree", type=int, default=d.ulysses_degree,
                   help="hybrid only: ranks per all-to-all (the ring degree is nproc / this)")
    p.add_argument("--temperature", type=float, default=d.temperature, help="0: greedy; else sample")
    p.add_argument("--seed", type=int, default=d.seed, help="seeds the model, the prompt and the sampling")
    p.add_argument("--compare", action="store_true",
                   help="also generate in one process without cache or CP and check the tokens are equal")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--json", metavar="PATH",
                   help="write tokens, reference_tokens, ttft_s, tpot_s, kv_cache_bytes_per_rank, strategy_chosen, "
                        "prompt_tail, device, backend as JSON" + TO_STDOUT)


def _run_generate(args: argparse.Namespace) -> int:
    _check_launch_flags(args)
    check_output("--json", args.json, stdout_ok=True)
    cfg = generation.GenerateConfig(
        nproc=args.nproc, prompt_len=args.prompt_len, new_tokens=args.new_tokens, batch=args.batch,
        model=args.model, layout=args.layout, strategy=args.strategy, ulysses_degree=args.ulysses_degree,
        temperature=args.temperature, seed=args.seed, compare=args.compare, progress=args.progress, device=args.device,
    )
    report = generation.run_generate(cfg, timeout_s=args.timeout)
    if report is None:  # a non-zero rank under torchrun
        return 0
    _report(generation.format_report(report), args.json, report)
    return 0 if report.get("tokens_match", True) else 1


# the commands that run local ranks, and what their ranks import beyond the rank server's PRELOAD (a training rank's
# FSDP, DTensor and the optimizer's torch._dynamo: 2.4 s of CPU a rank on 2 cores), imported once by the server the
# command starts; "plan" runs ranks only to measure this machine (--calibrate)
RANK_IMPORTS = {"demo": (), "train": ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor"),
                "generate": (), "plan": ()}


def _rank_imports(argv: list[str]) -> tuple[str, ...] | None:
    """What the ranks of the command ``argv`` runs import, or None where it runs no local rank; read
    before argparse reads ``argv`` (a wrong guess costs time, never a result)."""
    command = next((word for word in argv if not word.startswith("-")), None)
    if command == "plan" and "--calibrate" not in argv:
        return None
    return RANK_IMPORTS.get(command)


COMMANDS = {
    "demo": (_demo_parser, _run_demo),
    "train": (_train_parser, _run_train),
    "plan": (_plan_parser, _run_plan),
    "generate": (_generate_parser, _run_generate),
}


class _Parser(argparse.ArgumentParser):
    """argparse's, whose usage errors under torchrun also reach torchrun's failure summary, and
    which takes each flag by its whole name only: argparse's prefix matching ran a misspelt
    --new-token as --new-tokens, and would run a flag's prefix as another flag once one is
    added that shares it."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})

    def error(self, message: str) -> NoReturn:
        launch.tell_torchrun(f"{self.prog}: error: {message}")
        super().error(message)


def _did_you_mean(command: argparse.ArgumentParser, unknown: list[str]) -> str:
    """The command's flags nearest the unknown ones it was given (``--new-token``: ``--new-tokens``)."""
    flags = [f for f in command._option_string_actions if f.startswith("--")]
    near = {}
    for word in unknown:
        name = "--" + word.split("=", 1)[0].lstrip("-").lower()
        if word.startswith("-"):  # a flag of which it is the start (once taken for it), else the closest
            started = [f for f in flags if f.startswith(name)]
            near.update(dict.fromkeys(started if len(started) == 1 else
                                      difflib.get_close_matches(name, flags, n=1, cutoff=0.7)))
    return f" (did you mean {', '.join(near)}?)" if near else ""


def main(argv: list[str] | None = None) -> int:
    """Run one ``ctxpar`` command; its exit status. Under torchrun, why it failed also goes to
    the rank's error file, for torchrun's failure summary."""
    parser = _Parser(prog="ctxpar", description="Exact context-parallel attention: check it (demo), train with it, "
                     "plan for it, generate with it. Each command's --help lists its flags.")
    parser.add_argument("--version", action="version",
                        version=f"ctxpar {ctxpar.__version__} (torch {torch.__version__})")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in COMMANDS.values():
        add_parser(sub)
    argv = sys.argv[1:] if argv is None else argv
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # the command's flags are suggested for what follows its name alone
        given = argv[argv.index(args.command) + 1:]
        command = sub.choices[args.command]
        after = [word for word in unknown if word in given]
        # the command's usage where every stray word follows its name, as its own refusals show it
        (command if after == unknown else parser).error(
            f"unrecognized arguments: {' '.join(unknown)}{_did_you_mean(command, after)}")
    if not launch.launched_by_torchrun():
        return _run_command(args)
    try:
        status = _run_command(args)
    except Exception as e:
        launch.tell_torchrun(f"{type(e).__name__}: {e}", traceback.format_exc())
        raise
    if status and not launch.told_torchrun():  # a report that says why (demo's mismatch), on rank 0
        launch.tell_torchrun(f"ctxpar {args.command}: exit status {status}; rank 0's report says why")
    return status


def entry() -> NoReturn:
    """The ``ctxpar`` console script, ``python -m ctxpar`` and ``python -m ctxpar.cli``: ``main``'s status as the
    process's. A torchrun rank's process ends through ``launch.exit_torchrun_rank``."""
    if not launch.launched_by_torchrun():
        # before anything runs: the local ranks start without importing torch again, nor what the command's ranks import
        imports = _rank_imports(sys.argv[1:])
        if imports is not None:
            rank_server.start_here(imports)
        sys.exit(main())
    try:
        status = main()
    except SystemExit as e:  # argparse's refusal (status 2) or --help (0)
        status = e.code if isinstance(e.code, int) else int(e.code is not None)
    except Exception:  # what Python would print, and its exit status
        traceback.print_exc()
        status = 1
    launch.exit_torchrun_rank(status)


def _stop(command: str, e: Exception, status: int) -> int:
    """Say why ``command`` stops; under torchrun its failure summary says it too."""
    message = f"ctxpar {command}: error: {e}"
    launch.note(message)
    launch.tell_torchrun(message)
    return status


def _run_command(args: argparse.Namespace) -> int:
    try:
        return COMMANDS[args.command][1](args)
    except ValueError as e:  # a value the user can change: argparse's convention, exit status 2
        return _stop(args.command, e, 2)
    except (launch.RankFailure, calibration_.MeasurementError, ReportUnwritten) as e:
        return _stop(args.command, e, 1)
    except KeyboardInterrupt:
        said = f"ctxpar {args.command}: interrupted; the ranks were stopped"
        launch.note(said)
        launch.tell_torchrun(said)
        return 130


if __name__ == "__main__":
    entry()
