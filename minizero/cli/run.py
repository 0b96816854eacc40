"""Train the small GPT with a ZeRO stage and print what it measured.

    python -m minizero.run --stage 2 --world-size 4
    python -m minizero.run --stage 3 --world-size 4 --dtype bf16 --offload params --json out.json
    # fp16: dynamic (or static) loss scaling
    python -m minizero.run --dtype fp16 [--loss-scale 1024]
    # gradients reduced and accumulated in fp32
    python -m minizero.run --dtype bf16 --reduce-dtype fp32
    # ZeRO++ int8 communication
    python -m minizero.run --stage 3 --quantized-weights --quantized-gradients
    # a modelled network
    python -m minizero.run --stage 0 --network 1gbps,10us,ranks_per_node=2 [--no-overlap]
    # no collective overlaps another: the bytes on the wire exact per collective kind
    python -m minizero.run --stage 3 --synchronous
    # DeepSpeed JSON
    python -m minizero.run --config examples/ds_config_zero2_offload.json --world-size 4
    # HSDP / MiCS: shard in pairs
    python -m minizero.run --stage 3 --world-size 4 --shard-group-size 2
    # ZeRO++ hpZ: nodes of 2 ranks
    python -m minizero.run --stage 3 --world-size 4 --hpz-group-size 2
    python -m minizero.run --stage 3 --world-size 4 --tensor-parallel 2   # a 2 x 2 mesh
    torchrun --nproc-per-node 4 -m minizero.run --stage 3        # uses torchrun's process group
    torchrun --nproc-per-node 4 -m minizero.run --stage 3 --tensor-parallel 2     # its mesh too

Ends with a per-rank table: measured parameter / gradient / optimizer / offloaded bytes next to the
ZeRO paper's formula (minizero.memory.estimate); bytes per step, modelled (the ring bytes comm
tallies, 2Ψ / 3Ψ in the paper) and measured on the wire (minizero/memory/wire.py), also by
collective kind for rank 0; the loss from first to last step, and the step time. Bad input: one
line on stderr, exit code 2. Precedence: defaults < --config file (minizero.deepspeed.config) <
flags given on the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import types

from minizero import checkpoint, comm
from minizero.beyond import desync, tensor_parallel
from minizero.cli import OneLineParser, UsageError, add_json_flag, emit
from minizero.deepspeed.config import ConfigError, load_deepspeed_config
from minizero.lab.model import MODEL_NAMES, make_model
from minizero.lab.report import format_table, summarize
from minizero.lab.train import OPTIMIZERS, TrainConfig, progress_wanted, train_worker
from minizero.launcher import launch
from minizero.loss_scale import scaler_for
from minizero.beyond.network import network_from_env, parse_network, set_network
from minizero.wrap import check, check_mesh, check_options


def build_parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog="python -m minizero.run", description=__doc__.split("\n")[0])
    p.add_argument(
        "--config",
        default=None,
        metavar="JSON",
        help=(
            "a DeepSpeed-style config (docs/deepspeed_config.md); unknown keys are errors, "
            "keys minizero does not implement are warnings; flags override it"
        ),
    )
    p.add_argument("--stage", type=int, default=None, help="0 = DDP, 1, 2, 3 (default 2)")
    p.add_argument(
        "--world-size", type=int, default=None, help="processes (default 2; torchrun: its own)"
    )
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (default 50)")
    p.add_argument(
        "--dtype",
        default=None,
        help=(
            "fp32, bf16 or fp16 (16-bit compute, fp32 master weights; fp16 also scales the loss)"
        ),
    )
    p.add_argument(
        "--reduce-dtype",
        default=None,
        choices=["fp32"],
        help=(
            "bf16/fp16: reduce and accumulate gradients in fp32 (4 bytes a gradient instead of "
            "2; DeepSpeed's data_types.grad_accum_dtype)"
        ),
    )
    p.add_argument(
        "--loss-scale",
        type=float,
        default=None,
        metavar="S",
        help="fp16: a static loss scale S; 0 = dynamic (default; DeepSpeed's fp16.loss_scale)",
    )
    p.add_argument("--offload", nargs="?", const="optimizer", default=None, metavar="WHAT",
                   help=(
                       "stages 1-3: optimizer state on the "
                       "host; '--offload params' (stage 3) also "
                       "keeps parameter shards there; '--offload disk' keeps the optimizer "
                       "state in a file of --offload-path (ZeRO-Infinity's disk tier, "
                       "beyond/disk.py)"
                   ))
    p.add_argument("--offload-path", default=None, metavar="DIR",
                   help="--offload disk: the folder of each rank's file (DeepSpeed's nvme_path)")
    p.add_argument("--backend", default=None,
                   help="gloo or nccl (default: nccl with a GPU for every rank, else gloo)")
    p.add_argument(
        "--batch-size", type=int, default=None, help="global batch rows per step (default 16)"
    )
    p.add_argument(
        "--grad-accum", type=int, default=None, help="micro-batches per step (default 1)"
    )
    p.add_argument(
        "--clip-grad-norm", type=float, default=None, help="clip by global gradient norm"
    )
    p.add_argument(
        "--optimizer", default=None, help=f"one of {', '.join(OPTIMIZERS)} (default adamw)"
    )
    p.add_argument("--lr", type=float, default=None, help="learning rate (default 3e-3)")
    p.add_argument(
        "--bucket-size-mb", type=float, default=None, help="gradient bucket size (default 25)"
    )
    p.add_argument(
        "--no-prefetch", action="store_true", help="stage 3: gather units only when needed"
    )
    p.add_argument(
        "--quantized-weights",
        action="store_true",
        help="stage 3: forward's all-gather sends int8 blocks (ZeRO++ qwZ; "
             "minizero/beyond/quantize.py)",
    )
    p.add_argument("--quantized-gradients", action="store_true",
                   help="stages 2-3: the gradient reduce-scatter sends int8 blocks (ZeRO++ qgZ)")
    p.add_argument(
        "--no-overlap", action="store_true", help="stage 0: all-reduce every bucket after backward"
    )
    p.add_argument(
        "--synchronous", action="store_true",
        help=("every collective completes before it returns (comm.synchronous()): no overlap, "
              "so the bytes on the wire are measured per collective kind exactly; slower")
    )
    p.add_argument(
        "--network",
        default=None,
        metavar="SPEC",
        help=(
            "model a cluster network, e.g. 1gbps,10us,ranks_per_node=2 "
            "(minizero/beyond/network.py; "
            "default: $MINIZERO_NETWORK, else none)"
        ),
    )
    p.add_argument(
        "--shard-group-size",
        type=int,
        default=None,
        metavar="S",
        help=(
            "stages 1-3: partition within groups of S consecutive ranks, replicate across the "
            "N/S groups (HSDP / DeepSpeed MiCS); S must divide the world size"
        ),
    )
    p.add_argument(
        "--hpz-group-size",
        type=int,
        default=None,
        metavar="R",
        help=(
            "stage 3: keep a secondary partition within groups of R ranks (a node) so backward's "
            "all-gather stays inside them (ZeRO++ hpZ, DeepSpeed's zero_hpz_partition_size)"
        ),
    )
    p.add_argument(
        "--tensor-parallel",
        type=int,
        default=None,
        metavar="M",
        help=(
            "rows of M consecutive ranks split the GPT (Megatron's tensor parallelism) and the "
            "stage shards along the columns of N/M: a 2-D mesh (docs/tensor_parallel.md)"
        ),
    )
    p.add_argument(
        "--activation-checkpointing",
        nargs="?",
        const=True,
        default=None,
        choices=["cpu"],
        metavar="cpu",
        help=(
            "recompute each block's forward in backward, keeping only its input; "
            "'cpu': keep those inputs in host memory (ZeRO-R's P_a+cpu)"
        ),
    )
    p.add_argument("--model", default=None, help="default or tiny")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument(
        "--save", default=None, metavar="DIR", help="write a sharded checkpoint after the last step"
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=None,
        metavar="K",
        help="save DIR/step-NNNNNN every K steps and after the last (DIR is then a run directory)",
    )
    p.add_argument(
        "--keep-last",
        type=int,
        default=None,
        metavar="M",
        help="with --save-every: keep the M newest",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="with --save-every: continue from DIR's newest complete checkpoint, if it has one",
    )
    p.add_argument("--load", default=None, metavar="DIR",
                   help=(
                       "resume from a checkpoint of this model "
                       "and optimizer, saved at any stage, world "
                       "size, dtype or offload (resharded; --steps counts from 0); a --save-every "
                       "directory: its newest complete step-NNNNNN"
                   ))
    p.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        metavar="S",
        help=(
            "stop a run in which no collective finishes for S seconds "
            "while a rank waits, naming the rank out of step (minizero/beyond/desync.py; "
            "default: the "
            f"config's stall_timeout, else {desync.DEFAULT_STALL_TIMEOUT_S:g}; 0: off)"
        ),
    )
    add_json_flag(p, "the results")
    p.add_argument("--quiet", action="store_true", help="no progress lines or bar")
    return p


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    """Defaults, then the --config file, then flags; validated before any process starts."""
    cfg = TrainConfig()
    if args.world_size is not None:
        cfg.world_size = args.world_size
    elif "WORLD_SIZE" in os.environ:
        cfg.world_size = int(os.environ["WORLD_SIZE"])
    if args.config is not None:
        try:
            overrides, warnings = load_deepspeed_config(args.config, cfg.world_size)
        except ConfigError as e:
            raise UsageError(f"--config {args.config}: {e}") from None
        for w in warnings:
            print(f"minizero.run: warning: {w}", file=sys.stderr)
        for name, value in overrides.items():
            setattr(cfg, name, value)
        if args.optimizer not in (None, cfg.optimizer) and cfg.optimizer_params:
            print(
                f"minizero.run: warning: --optimizer {args.optimizer} "
                f"replaces the file's {cfg.optimizer}: "
                f"its optimizer.params {', '.join(cfg.optimizer_params)} are not used",
                file=sys.stderr,
            )
            cfg.optimizer_params = {}
    pairs = {
        "stage": args.stage,
        "world_size": args.world_size,
        "steps": args.steps,
        "dtype": args.dtype,
        "backend": args.backend,
        "batch_size": args.batch_size,
        "grad_accum": args.grad_accum,
        "clip_grad_norm": args.clip_grad_norm,
        "optimizer": args.optimizer,
        "lr": args.lr,
        "model": args.model,
        "seed": args.seed,
        "reduce_dtype": args.reduce_dtype,
        "shard_group_size": args.shard_group_size,
        "hpz_group_size": args.hpz_group_size,
        "tensor_parallel": args.tensor_parallel,
    }
    for name, value in pairs.items():
        if value is not None:
            setattr(cfg, name, value)
    if args.loss_scale is not None:
        cfg.loss_scale = args.loss_scale or None          # 0: dynamic, as in DeepSpeed
    elif cfg.dtype != "fp16" and cfg.loss_scale is not None:
        print(
            f"minizero.run: warning: --dtype {cfg.dtype}: the file's fp16 loss scaling is not used",
            file=sys.stderr,
        )
        cfg.loss_scale = None
    if args.offload is not None:
        cfg.offload = args.offload
    if args.offload_path is not None:
        cfg.offload_path = args.offload_path
    if args.bucket_size_mb is not None:
        cfg.bucket_size = args.bucket_size_mb * 1e6
    if args.no_prefetch:
        cfg.prefetch = False
    cfg.quantized_weights = cfg.quantized_weights or args.quantized_weights
    cfg.quantized_gradients = cfg.quantized_gradients or args.quantized_gradients
    if args.no_overlap:
        cfg.overlap = False
    cfg.synchronous = args.synchronous
    if args.activation_checkpointing is not None:
        cfg.activation_checkpointing = args.activation_checkpointing
    cfg.save_dir, cfg.load_dir = args.save, args.load
    cfg.save_every, cfg.keep_last = args.save_every or 0, args.keep_last
    _check_saving(args)
    if args.resume:
        cfg.load_dir = checkpoint.latest(args.save)          # None: nothing saved yet, start fresh
    elif cfg.load_dir is not None:
        cfg.load_dir = _find_checkpoint(cfg.load_dir)   # a run directory: its newest checkpoint
    if cfg.load_dir not in (None, args.load):
        print(f"minizero.run: loading {cfg.load_dir}, the newest complete checkpoint of "
              f"{args.load or args.save}", file=sys.stderr)
    validate(cfg)
    if cfg.load_dir is not None:
        _check_checkpoint(cfg.load_dir, cfg)
    return cfg


def network_from_args(args: argparse.Namespace):
    """--network, else $MINIZERO_NETWORK, else None: the network model (minizero/beyond/network.py)
    of
    the run."""
    try:
        return parse_network(args.network) if args.network is not None else network_from_env()
    except ValueError as e:
        raise UsageError(f"--network: {e}" if args.network is not None else str(e)) from None


def _check_saving(args: argparse.Namespace) -> None:
    if args.save is not None:
        _check_save_dir(args.save)
    if args.save_every is not None and (args.save is None or args.save_every < 1):
        raise UsageError("--save-every K needs --save DIR and K >= 1")
    if args.keep_last is not None and (args.save_every is None or args.keep_last < 1):
        raise UsageError("--keep-last M needs --save-every and M >= 1")
    if args.resume and (args.save_every is None or args.load is not None):
        raise UsageError(
            "--resume needs --save DIR --save-every K (it continues from DIR), not --load"
        )


def _check_save_dir(directory: str) -> None:
    """--save DIR must be a folder, or one that can be made: found out before training, not at
    the first save, when the run's work would be lost."""
    if os.path.exists(directory) and not os.path.isdir(directory):
        raise UsageError(f"--save {directory}: a file is there, not a folder")
    existing = os.path.abspath(directory)
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise UsageError(f"--save {directory}: {existing} is a file, not a folder")
    try:                           # tried, as cli._writable_file tries --json's file
        os.rmdir(tempfile.mkdtemp(dir=existing))
    except OSError as e:
        raise UsageError(f"--save {directory}: cannot write in {existing} ({e.strerror})") from None


def _find_checkpoint(directory: str) -> str:
    try:
        return checkpoint.find(directory)
    except checkpoint.CheckpointError as e:
        raise UsageError(f"--load {directory}: {e}") from None


def _check_checkpoint(directory: str, cfg: TrainConfig) -> None:
    """Before any process starts: every file of the checkpoint intact (checkpoint.verify), and
    saved for this model and optimizer (load reshards any stage, world size, dtype or offload; it
    checks again)."""
    import torch
    try:
        manifest = checkpoint.verify(directory)
    except checkpoint.CheckpointError as e:
        raise UsageError(f"--load {directory}: {e}") from None
    with torch.device("meta"):                           # shapes only: nothing is allocated
        model = make_model(cfg.model_config())
    difference = checkpoint.model_difference(manifest, checkpoint.state_dict_entries(model))
    if difference:
        raise UsageError(f"--load {directory} holds a different model: {difference}")
    if manifest["optimizer"] != OPTIMIZERS[cfg.optimizer].__name__:
        raise UsageError(
            f"--load {directory}: saved with optimizer {manifest['optimizer']}, this run has "
            f"--optimizer {cfg.optimizer}"
        )


def _check_split(cfg: TrainConfig) -> None:
    """The GPT splits over rows of --tensor-parallel M (heads, vocabulary: tensor_parallel's own
    checks, ValueError), found before any process starts, not by every rank (under torchrun each
    one's traceback). The model is built on the meta device: shapes only."""
    import torch
    with torch.device("meta"):
        model = make_model(cfg.model_config())
    row = types.SimpleNamespace(size=cfg.tensor_parallel, index=0)   # splitting needs no collective
    tensor_parallel.parallelize_gpt(model, row)


def validate(cfg: TrainConfig) -> None:
    """Everything wrong with a run's settings, found before any process starts (UsageError,
    one line)."""
    def bad(msg):
        raise UsageError(msg)
    if cfg.offload is True:
        cfg.offload = "optimizer"
    try:
        # the engines' own rules (minizero.wrap)
        check(cfg.stage, cfg.dtype, cfg.offload, cfg.reduce_dtype,
              shard_group_size=cfg.shard_group_size, hpz_group_size=cfg.hpz_group_size,
              world_size=cfg.world_size, offload_path=cfg.offload_path)
        wrap_arguments = {"activation_checkpointing", "offload_path"}     # wrap's own, not options
        check_options(cfg.stage, set(cfg.engine_options()) - wrap_arguments)
        scaler_for(cfg.dtype, cfg.loss_scale)             # ... and the loss scaler's
    except (ValueError, TypeError) as e:
        bad(str(e))
    if cfg.world_size < 1:
        bad(f"--world-size must be >= 1, got {cfg.world_size}")
    if cfg.steps < 1:
        bad(f"--steps must be >= 1, got {cfg.steps}")
    if cfg.backend not in (None, "gloo", "nccl"):
        bad(f"--backend must be gloo or nccl, got {cfg.backend!r}")
    if cfg.optimizer == "muon":          # a config's "type": "Muon" (docs/muon.md)
        bad("Muon trains through minizero.initialize or minizero.wrap; python -m minizero.run "
            "has no Muon yet (its memory table assumes one optimizer for every parameter)")
    if cfg.optimizer not in OPTIMIZERS:
        bad(f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {cfg.optimizer!r}")
    if cfg.model not in MODEL_NAMES:
        bad(f"--model must be one of {', '.join(MODEL_NAMES)}, got {cfg.model!r}")
    if cfg.lr <= 0 or (cfg.clip_grad_norm is not None and cfg.clip_grad_norm <= 0):
        bad("--lr and --clip-grad-norm must be > 0")
    if cfg.bucket_size <= 0:
        bad("--bucket-size-mb must be > 0")
    if cfg.grad_accum < 1 or cfg.batch_size < 1:
        bad("--grad-accum and --batch-size must be >= 1")
    try:
        check_mesh(cfg.tensor_parallel, cfg.world_size, cfg.engine_options())
        if cfg.tensor_parallel > 1:
            _check_split(cfg)
    except ValueError as e:
        bad(str(e))
    n_d = cfg.world_size // cfg.tensor_parallel            # the ranks of a mesh's row share rows
    if cfg.batch_size % (n_d * cfg.grad_accum):
        bad(f"--batch-size {cfg.batch_size} must be divisible by data-parallel ranks x grad "
            f"accum = {n_d} x {cfg.grad_accum}")
    if cfg.backend == "nccl":
        import torch
        if torch.cuda.device_count() < cfg.world_size and "RANK" not in os.environ:
            bad(f"--backend nccl needs one GPU per rank: {torch.cuda.device_count()} GPUs, "
                f"world size {cfg.world_size}")


# --------------------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        cfg = config_from_args(args)
        network = network_from_args(args)
        if args.stall_timeout is not None and args.stall_timeout < 0:
            raise UsageError(f"--stall-timeout must be >= 0 seconds, got {args.stall_timeout:g}")
    except UsageError as e:
        print(f"minizero.run: error: {e}", file=sys.stderr)
        return 2
    # 0: off
    stall_timeout = next(s for s in (args.stall_timeout, cfg.stall_timeout,
                                     desync.DEFAULT_STALL_TIMEOUT_S) if s is not None) or None
    # on a terminal a progress bar (loss, time left) replaces the progress lines
    cfg.progress = progress_wanted(args.quiet, args.json)
    cfg.log_every = 0 if args.quiet or cfg.progress else max(1, cfg.steps // 10)
    cfg.measure_peak = True             # the throughput line's MFU (lab/throughput.py)
    set_network(network)           # here under torchrun; minizero.launch hands it to its ranks
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    try:
        if under_torchrun:
            results, is_reporter = _run_under_torchrun(cfg, args, stall_timeout)
        else:
            results = launch(train_worker, cfg.world_size, cfg, backend=cfg.backend,
                             stall_timeout=stall_timeout)
            is_reporter = True
    except UsageError as e:
        print(f"minizero.run: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:                 # a rank failed: the launcher says which and why
        print(f"minizero.run: {e}", file=sys.stderr)
        return 1
    if is_reporter:
        summary = summarize(cfg, results, network)
        emit(format_table(summary), summary, args.json)
    if under_torchrun:
        # Everything is reported and written, and the process group is destroyed. A torchrun rank
        # that then leaves through the interpreter's normal teardown was seen, rarely (about 1 run
        # in 40, also in CI), to abort with "terminate called without an active exception": a C++
        # thread of the distributed runtime destroyed while still joinable. So it leaves at once,
        # with its exit code.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0


def _run_under_torchrun(cfg: TrainConfig, args,
                        stall_timeout: float | None) -> tuple[list[dict], bool]:
    world = int(os.environ["WORLD_SIZE"])
    if args.world_size is not None and args.world_size != world:
        raise UsageError(
            f"--world-size {args.world_size} disagrees with torchrun's WORLD_SIZE={world}"
        )
    # cfg.world_size already came from WORLD_SIZE (config_from_args) and was validated there
    comm.init(backend=cfg.backend)
    watch = desync.watch(stall_timeout=stall_timeout)
    result = train_worker(cfg)
    if watch is not None:
        watch.stop()
    result.pop("state_dict", None)
    results = comm.all_gather_object(result)      # every rank's numbers; rank 0 reports them
    comm.destroy(wait_for_peers=True)
    return results, result["rank"] == 0
