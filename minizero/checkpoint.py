"""Sharded checkpoints: every rank saves what it owns; a resumed run is bit-identical, or resharded.

    engine.save("ckpt")      # collective, between steps: one file per rank, then one manifest
    engine.load("ckpt")      # collective, in fresh processes: any stage, N, dtype, offload, mesh
    python -m minizero.consolidate ckpt model.pt [--optimizer-state]   # the whole state, for any N
    # kill-safe auto-resume
    python -m minizero.run --save run --save-every 100 --keep-last 2 --resume
    python -m minizero.consolidate run model.pt     # a run directory: its newest checkpoint (find)

Run its tests:  python -m pytest tests/test_checkpoint.py

What a rank owns is what ZeRO partitioned: the fp32 master weights and the optimizer state of its
partition of every bucket, the K·Ψ/N of the paper (stage 0: all of Ψ, replicated, so every rank's
file is the same). Nothing is gathered to save, as in DeepSpeed (one file per rank; its
zero_to_fp32 stitches them together offline, like `consolidate` at the end of this file). bf16
model parameters are not saved: they are round(master), and load rebuilds them from the masters
exactly as step() does.

Format (format_version 1), one directory:

    ckpt/manifest.json      what was saved, and which version directory holds it. Written last.
    ckpt/v3/rank{r}.pt      rank r's shard, torch.save of {"step": optimizer steps taken,
                              "masters": [fp32 tensor per bucket: [Ψ_b/N], stage 0 [Ψ_b]],
                              "optimizer": the torch optimizer's state_dict() (moments,
                              step, lr...),
                              "rng": {"torch": CPU generator state, "cuda": current GPU's or None},
                              "loss_scaler": fp16's LossScaler.state_dict() (S, hysteresis credit,
                                             iteration, last overflow, skipped steps), the
                                             same on every rank; None without fp16; absent in
                                             older checkpoints}
    ckpt/v3/replicated.pt   what every rank holds identically and never steps, written by
                              rank 0: {name: tensor} of the frozen parameters and buffers, in
                              the model's dtype
    ckpt/v3/extra.pt        only if save() was given one: a front end's own state (initialize's
                              counters, schedule and client_state), written by rank 0

manifest.json: "format", "format_version", "version" (the v3 directory), "step", "stage",
"world_size" (N, or S with shard_group_size: the rank files), "dtype", "offload", "optimizer" (class
name), "num_params" (Ψ), "buckets" ([{"numel", "padded_numel",
"shard_numel" (elements per rank file), "params": [{"name", "shape", "offset"}]}]), "state_dict"
(every key of model.state_dict() in order: {"key", "source", "shape", "trainable"}; the tied
embedding/head weight is two keys with one source), "group_params" (the names of the parameters in
each optimizer parameter group, None for one group of all: load wants the same groups),
"tensor_parallel" (M), "whole_state_dict" (the model built without tensor parallelism:
tensor_parallel.whole_entries, {"key", "part", "shape", "trainable", "split"}) and "files"
({"rank0.pt": {"bytes", "sha256"}, ...}).

On a 2-D mesh (tensor_parallel=M, [Note: the 2-D mesh] in beyond/tensor_parallel.py) each
tensor-parallel part is a model of its own, saved by its column of N_d ranks: tp{i}-rank{r}.pt and
tp{i}-replicated.pt for part i; buckets, world_size and state_dict describe part 0's (every part
has the same shapes).

A run directory (save_numbered, latest; the CLI's --save-every) holds one such checkpoint per save:

    run/step-000100/        a checkpoint directory as above, saved after 100 steps
    run/step-000200/        the newest with a manifest is the one --resume continues from (latest())

and DeepSpeed's save folder (engine.save_checkpoint, deepspeed/deepspeed_checkpoint.py) one per tag:

    save/global_step50/     a checkpoint directory as above, with extra.pt
    save/latest             the newest tag's name ("global_step50"), written after its commit

Why a crash never leaves a checkpoint that loads as valid, nor destroys the previous one:
  1. every file is written under a temporary name, fsync'ed, then renamed (atomic on POSIX);
  2. a save writes a *new* version directory, never over the files the current manifest names;
  3. once every rank's files are on disk (an all-gather of their sizes and hashes), rank 0 replaces
     manifest.json, atomically. Before that instant the old checkpoint is what loads, after it the
     new one; only then is the old version directory removed;
  4. load checks every file's size and sha256 against the manifest: a truncated or damaged file is
     reported, not loaded (verify() checks them all, before the CLI starts any process);
  5. in a run directory a step-N without a manifest is not complete (latest() skips it; saving
     step N again finishes it), and old checkpoints are pruned only after the new commit, renamed
     away first.
Load checks the manifest against the engine first (optimizer class, parameter names, shapes,
which are trained) and all ranks agree on the verdict (an all-gather) before anything changes:
either every rank loads, or every rank raises CheckpointError with a one-line message, the
engine untouched.

Same layout (world size and buckets as saved; the stage, dtype and offload may differ): each rank
reads its own file, and the resumed run is bit-identical. The resumed run applies the same
operations to the same values: masters, Adam's moments and step counter, the bf16
parameters (= round(master)), the step count (so the data stream continues where it stopped), the
RNG states and fp16's loss scaler (S and its counters: a fresh one would start again at 2**16 and
skip other steps); gradients are zero between steps, the only time save() and load() accept (a
CheckpointError between a backward() and its step()). A checkpoint without a scaler state (older,
or not fp16) leaves the engine's fresh scaler as it is.

Another layout (another N, or other buckets: stage 1 has one, stages 0 and 2 bucket by bytes, so by
dtype and bucket size too, stage 3 has one per unit): resharding, with the optimizer state. The flat
layout is deterministic (flat.py) and the manifest records each parameter's bucket and offset, so
the shards concatenate back into whole parameters (universal()); optimizer state that is elementwise
(Adam's exp_avg and exp_avg_sq, SGD's momentum_buffer) is unsharded the same way, and scalar state
(Adam's step) is one value for every bucket. Each rank then lays these whole tensors out in its own
buckets and keeps its partition, exactly as the engine laid out the parameters when it was built.
Every rank reads every file: simple, and the whole model's state in host memory for a moment
(DeepSpeed's ds_to_universal does this offline; PyTorch DCP reads only the overlapping ranges). The
run continues as the uninterrupted one would up to floating point rounding (another N sums gradients
in another order), within 1e-6 in the tests. An optimizer whose state is neither elementwise nor
scalar cannot be cut: a one-line error.

Another mesh (another M; DeepSpeed's universal checkpoint exists for this): the whole tensors are
first rebuilt per tensor-parallel part, then merged across the M parts (tensor_parallel.merge: a
split parameter's parts concatenated along the axis it was cut on, a replicated one taken from part
0), giving the model built without tensor parallelism, under its own names; each rank of the new
mesh cuts its part from it (tensor_parallel.part), Adam's moments alike, and lays it out as above.
The same mesh keeps the same-layout path: bit-identical. Within 1e-5 of the uninterrupted run in
tests/test_mesh_checkpoint.py, (2, 2) -> (1, 4) and (4, 1) -> (2, 2).
Assumes a filesystem all ranks share: rank 0 writes the manifest for everyone.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import io
import json
import os
import re
import shutil

import torch

from minizero import comm, events
from minizero.beyond import tensor_parallel

FORMAT = "minizero-checkpoint"
FORMAT_VERSION = 1
UNIVERSAL = "minizero-universal"        # the whole-model form, universal()
MANIFEST = "manifest.json"
EXTRA = "extra.pt"                      # a front end's state beside the engine's (save's extra)
LATEST = "latest"                       # DeepSpeed's save folder: the newest tag's name, in a file
_VERSION_DIR = re.compile(r"v\d+")
_STEP_DIR = re.compile(r"step-(\d+)")
_MANIFEST_KEYS = (
    "version", "step", "stage", "world_size", "optimizer", "buckets", "state_dict", "files",
)


class CheckpointError(ValueError):
    """A checkpoint that is missing, damaged, saved for another configuration, or asked for
    between a backward() and its step() (one-line message)."""


def _between_steps(engine, verb: str, why: str) -> None:
    """A checkpoint is a state between steps: refuse one that would drop or misapply gradients.
    (Every rank runs the same loop, so every rank refuses.)"""
    if engine.mid_step:
        raise CheckpointError(f"engine.{verb}() between backward() and step(): {why}; call it "
                              "between steps")


# --------------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------------

def save(engine, directory: str, extra: dict | None = None) -> None:
    """engine.save: every rank writes its shard into a new version directory, then
    rank 0 commits. extra: what a front end keeps beside the engine (initialize's counters, its
    schedule and the script's client_state: deepspeed/deepspeed_checkpoint.py), rank 0's, written as
    extra.pt in the same commit (read_extra)."""
    _between_steps(engine, "save", "a checkpoint holds no gradients, so those since the last "
                   "step would be lost")
    directory = os.fspath(directory)
    version = _new_version_dir(directory) if engine.rank == 0 else None
    version = comm.all_gather_object(version)[0]             # everyone writes where rank 0 decided
    vdir = os.path.join(directory, version)
    os.makedirs(vdir, exist_ok=True)
    files = {}
    # shard_group_size=S < N: the N/S groups hold the same partitions; the first group's S files are
    # the checkpoint, as if saved by S ranks ([Note: hierarchical sharding], beyond/hierarchical.py)
    if engine.replicate_group is None or engine.replicate_group.index == 0:
        mine = shard_file(engine.layout.rank, _part_index(engine))
        files[mine] = _write_torch(os.path.join(vdir, mine), _shard_state(engine))
    replicated = _replicated_state(engine)           # collective: stage 3 gathers frozen parameters
    if comm.group_rank(engine.data_group) == 0:    # rank 0; on a mesh, one per tensor-parallel part
        name = shard_file(None, _part_index(engine))
        files[name] = _write_torch(os.path.join(vdir, name), replicated)
    if engine.rank == 0:
        if extra is not None:
            files[EXTRA] = _write_torch(os.path.join(vdir, EXTRA), extra)
    everyone = comm.all_gather_object(files)                  # returns once every shard is on disk
    if engine.rank == 0:
        manifest = {**describe(engine), "version": version, "step": engine.step_count,
                    "files": {name: info for f in everyone for name, info in f.items()}}
        events.emit("checkpoint commit", engine=engine, directory=directory)   # every shard on disk
        # commit
        write_atomic(os.path.join(directory, MANIFEST), json.dumps(manifest, indent=1).encode())
        for name in os.listdir(directory):                 # the old version, and any unfinished one
            if _VERSION_DIR.fullmatch(name) and name != version:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)
    comm.barrier()                                            # nobody returns before the commit


def _tensor_parallel(engine) -> int:
    return 1 if engine.tensor_group is None else engine.tensor_group.size


def _part_index(engine) -> int | None:
    """This rank's tensor-parallel part (its index in its row), None without tensor parallelism."""
    return None if engine.tensor_group is None else engine.tensor_group.index


def shard_file(rank: int | None, part: int | None) -> str:
    """rank{r}.pt (rank None: replicated.pt); on a 2-D mesh each tensor-parallel part has its own
    column of shards ([Note: the 2-D mesh] in beyond/tensor_parallel.py): tp{i}-rank{r}.pt,
    tp{i}-replicated.pt."""
    name = "replicated.pt" if rank is None else f"rank{rank}.pt"
    return name if part is None else f"tp{part}-{name}"


def describe(engine) -> dict:
    """What the manifest records about an engine, and what load compares with the running one."""
    names = _names(engine.module)
    buckets = [{"numel": b.numel, "padded_numel": b.padded_numel, "shard_numel": b.shard_numel,
                "params": [{"name": names[id(p)], "shape": list(p.shape), "offset": off}
                           for p, off in zip(b.params, b.offsets)]}
               for b in engine.layout.buckets]
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "stage": engine.stage,
        "world_size": engine.layout.world_size,
        "dtype": str(engine.dtype).removeprefix("torch."),
        "offload": getattr(engine, "offload", False),
        "optimizer": type(engine.optimizer.optimizer).__name__,
        "num_params": sum(p.numel() for p in engine.module.parameters()),
        "buckets": buckets,
        "state_dict": state_dict_entries(engine.module),
        "whole_state_dict": tensor_parallel.whole_entries(engine.module),
        "group_params": group_params(engine),
        "tensor_parallel": _tensor_parallel(engine),
    }


def group_params(engine) -> list[list[str]] | None:
    """The optimizer's parameter groups as the names of the parameters in each (None: one group of
    every trainable parameter, optim.py [Note: parameter groups]): a checkpoint's group settings
    load only into the same groups."""
    if engine.param_groups is None:
        return None
    names = _names(engine.module)
    return [[names[id(p)] for p in engine.trainable if engine.group_of.get(id(p)) == i]
            for i in range(len(engine.param_groups))]


def state_dict_entries(model) -> list[dict]:
    """The manifest's "state_dict": every key of model.state_dict() in order, the parameter or
    buffer it names ("source": a tied weight is two keys with one source), its shape, and whether it
    is trained."""
    names = _names(model)
    return [{"key": k, "source": names[id(t)], "shape": list(t.shape), "trainable": t.requires_grad}
            for k, t in model.state_dict(keep_vars=True).items()]


def _names(model) -> dict[int, str]:
    return {id(t): n for n, t in [*model.named_parameters(), *model.named_buffers()]}


def _shard_state(engine) -> dict:
    # to(copy=True): a master may be a view into the whole flat buffer, and torch.save would write
    # all of the storage under a view (N times this rank's share), so each is copied to a compact
    # CPU tensor.
    return {"step": engine.step_count,
            "masters": [m.to("cpu", copy=True) for m in engine.optimizer.master_values()],
            "optimizer": engine.optimizer.state_dict(),          # one entry per bucket (optim.py)
            "rng": {"torch": torch.get_rng_state(),
                    "cuda": torch.cuda.get_rng_state() if torch.cuda.is_initialized() else None},
            "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None}


def _replicated_state(engine) -> dict[str, torch.Tensor]:
    state = engine.module.state_dict(keep_vars=True)
    with engine.gathering(engine.frozen):               # stage 3 partitions frozen parameters too
        return {e["source"]: state[e["key"]].detach().to("cpu", copy=True)
                for e in describe(engine)["state_dict"] if not e["trainable"]}


def _new_version_dir(directory: str) -> str:
    """A fresh vN directory, N above every version there (finished or not): nothing current
    is touched."""
    os.makedirs(directory, exist_ok=True)
    taken = [int(n[1:]) for n in os.listdir(directory) if _VERSION_DIR.fullmatch(n)]
    version = f"v{max(taken, default=0) + 1}"
    os.mkdir(os.path.join(directory, version))
    return version


def _write_torch(path: str, obj) -> dict:
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    write_atomic(path, data)
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_atomic(path: str, data: bytes) -> None:
    """Write `data` to `path` so that `path` holds either its old content or all of the new, never
    a part."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())              # the bytes are on disk before the name points at them
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)                           # ... and so is the rename
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# A run directory: numbered checkpoints, the newest complete one resumes
# --------------------------------------------------------------------------------------------------

def save_numbered(engine, run_dir: str, keep_last: int | None = None) -> str:
    """Collective: save into run_dir/step-{step:06d} (a checkpoint directory as above), then rank 0
    removes all but the `keep_last` newest complete ones. Returns the new checkpoint's directory.

    A kill at any moment leaves the newest *committed* checkpoint loadable: the new one is
    invisible to latest() until its manifest exists (save's commit), and older ones are only
    removed after that."""
    path = os.path.join(os.fspath(run_dir), f"step-{engine.step_count:06d}")
    save(engine, path)
    if engine.rank == 0 and keep_last is not None:
        _prune(run_dir, keep_last)
    return path


def latest(run_dir: str) -> str | None:
    """The newest complete (committed) checkpoint of a run directory, or None if it has none yet."""
    complete = _complete(run_dir)
    return complete[-1] if complete else None


def find(directory: str) -> str:
    """The checkpoint to read from `directory`: the directory itself when it is one (it has a
    manifest), else the tag its `latest` file names (engine.save_checkpoint's folder, as DeepSpeed's
    zero_to_fp32 follows it), else the newest complete step-NNNNNN of a run directory (--save DIR
    --save-every K). CheckpointError (one line) for a run directory whose saves all failed to
    commit; anything else is returned as it is, for read_manifest to say what it lacks."""
    directory = os.fspath(directory)
    if os.path.exists(os.path.join(directory, MANIFEST)) or not os.path.isdir(directory):
        return directory
    tag = read_latest(directory)
    if tag is not None:                       # engine.save_checkpoint's folder: its `latest` tag
        return os.path.join(directory, tag)
    newest = latest(directory)
    if newest is None and any(map(_STEP_DIR.fullmatch, os.listdir(directory))):
        raise CheckpointError(f"{directory} has step-NNNNNN folders but no complete checkpoint "
                              f"(none has its {MANIFEST}: every save was interrupted)")
    return newest or directory


def read_latest(save_dir: str) -> str | None:
    """The tag a DeepSpeed-style save folder's `latest` file names (save_checkpoint writes it), or
    None without one."""
    try:
        with open(os.path.join(os.fspath(save_dir), LATEST)) as f:
            return f.read().strip()
    except FileNotFoundError:
        return None


def _complete(run_dir: str) -> list[str]:
    """run_dir's step-N checkpoints that have a manifest, oldest first; a save that was killed
    before its commit has none (a later save of the same step finishes it: save starts a new
    version directory)."""
    if not os.path.isdir(run_dir):
        return []
    steps = sorted(
        (int(m.group(1)), m.group(0)) for m in map(_STEP_DIR.fullmatch, os.listdir(run_dir)) if m
    )
    return [os.path.join(run_dir, name) for _, name in steps
            if os.path.exists(os.path.join(run_dir, name, MANIFEST))]


def _prune(run_dir: str, keep_last: int) -> None:
    # Each old checkpoint is renamed first (atomic), then deleted: a kill in the middle of a
    # deletion leaves a hidden leftover (removed by the next prune), never a step-N directory whose
    # manifest names files that are gone.
    for old in _complete(run_dir)[:-keep_last]:
        os.replace(old, os.path.join(run_dir, f".removing-{os.path.basename(old)}"))
    for name in os.listdir(run_dir):
        if name.startswith(".removing-"):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# Read and check (shared with minizero.consolidate)
# --------------------------------------------------------------------------------------------------

def read_manifest(directory: str) -> dict:
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise CheckpointError(f"{directory}: no such checkpoint directory")
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} has no {MANIFEST}: not a checkpoint, or its first save "
                              "did not finish")
    try:
        with open(path, "rb") as f:
            manifest = json.loads(f.read())
    except (ValueError, OSError) as e:      # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CheckpointError(f"{path} is damaged: {e}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a minizero checkpoint manifest")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path} has format_version {manifest.get('format_version')!r}; this "
                              f"minizero reads version {FORMAT_VERSION}")
    missing = [k for k in _MANIFEST_KEYS if k not in manifest]
    if missing:
        raise CheckpointError(f"{path} is damaged: it lacks {', '.join(missing)}")
    return manifest


def read_file(directory: str, manifest: dict, name: str) -> dict:
    """One file of the checkpoint, after checking its size and sha256 against the manifest."""
    return torch.load(io.BytesIO(_checked_bytes(directory, manifest, name)), map_location="cpu",
                      weights_only=True)


def read_extra(directory: str) -> dict | None:
    """save's `extra` (checked like every file), or None when that save had none. Unpickled in
    full (weights_only=False): it holds the script's own objects (client_state), which DeepSpeed's
    load_checkpoint unpickles too; load only checkpoints you trust."""
    manifest = read_manifest(directory)
    if EXTRA not in manifest["files"]:
        return None
    return torch.load(io.BytesIO(_checked_bytes(directory, manifest, EXTRA)), map_location="cpu",
                      weights_only=False)


def verify(directory: str) -> dict:
    """The manifest, after checking every file it lists (size and sha256) without loading
    any: what `python -m minizero.run --load/--resume` runs before it starts a process.
    Raises CheckpointError."""
    manifest = read_manifest(directory)
    for name in manifest["files"]:
        _checked_bytes(directory, manifest, name)
    return manifest


def _checked_bytes(directory: str, manifest: dict, name: str) -> bytes:
    path = os.path.join(os.fspath(directory), manifest["version"], name)
    expected = manifest["files"].get(name)
    if expected is None:
        raise CheckpointError(f"{directory}: the manifest lists no {name}")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing") from None
    except OSError as e:
        raise CheckpointError(f"{path}: {e.strerror}") from None
    if len(data) != expected["bytes"]:
        raise CheckpointError(
            f"{path} is truncated or damaged: {len(data)} bytes, the manifest says "
            f"{expected['bytes']}"
        )
    if hashlib.sha256(data).hexdigest() != expected["sha256"]:
        raise CheckpointError(f"{path} is damaged: its sha256 differs from the manifest's")
    return data


def check_compatible(saved: dict, engine, where: str) -> None:
    """The same model and optimizer class (a manifest, or a universal state's header); stage, world
    size, dtype and offload may differ."""
    here = describe(engine)
    if saved["optimizer"] != here["optimizer"]:
        raise CheckpointError(
            f"{where} was saved with optimizer {saved['optimizer']}, this engine has "
            f"optimizer {here['optimizer']}"
        )
    difference = model_difference(saved, here["whole_state_dict"])
    if difference:
        raise CheckpointError(f"{where} holds a different model: {difference}")
    if saved.get("group_params") != here["group_params"]:      # absent: saved before groups
        raise CheckpointError(f"{where} was saved with other parameter groups "
                              f"({_groups_in_words(saved.get('group_params'))}) than this "
                              f"engine's ({_groups_in_words(here['group_params'])})")


def _groups_in_words(groups: list[list[str]] | None) -> str:
    if groups is None:
        return "one of every trainable parameter"
    return "groups of " + ", ".join(f"{len(g)}" for g in groups) + " parameters"


def model_difference(saved: dict, entries: list[dict]) -> str | None:
    """The first way the saved whole model differs from one with these entries (whole_entries, or
    state_dict_entries of an unsplit model), in words; None if they fit (the CLI asks it before
    starting processes, about a model built on the meta device). Whole models: a checkpoint saved
    on one mesh fits a model split over another."""
    before = {e["key"]: e for e in whole_state_dict(saved)}
    now = {e["key"]: e for e in entries}
    if now.keys() - before.keys():
        return f"this model's {min(now.keys() - before.keys())} is not in the checkpoint"
    if before.keys() - now.keys():
        return f"the checkpoint's {min(before.keys() - now.keys())} is not in this model"
    for key, e in now.items():
        if e["shape"] != before[key]["shape"]:
            return f"{key} has shape {before[key]['shape']} there, {e['shape']} here"
        if e["trainable"] != before[key]["trainable"]:
            return f"{key} is {'frozen' if e['trainable'] else 'trainable'} there, not here"
    return None


# --------------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------------

def load(engine, path: str) -> None:
    """engine.load: check everything on every rank, agree, then restore; see the module docstring.
    `path` is a checkpoint directory, or a file written by
    `python -m minizero.consolidate --optimizer-state`."""
    _between_steps(engine, "load", "the gradients since the last step would step the loaded "
                   "weights")
    path = os.fspath(path)
    try:
        if os.path.isfile(path):
            saved = _read_universal(path)
        else:
            saved = read_manifest(path)
        check_compatible(saved, engine, path)
        if saved.get("format") == UNIVERSAL:
            restore = functools.partial(_restore_universal, engine, saved)
        elif (
            saved["world_size"] == engine.layout.world_size
            and saved["buckets"] == describe(engine)["buckets"]
            and saved.get("tensor_parallel", 1) == _tensor_parallel(engine)
        ):
            # same layout: my file is my shard
            shard = read_file(path, saved, shard_file(engine.layout.rank, _part_index(engine)))
            replicated = read_file(path, saved, shard_file(None, _part_index(engine)))
            frozen = {
                e["key"]: replicated[e["source"]] for e in saved["state_dict"] if not e["trainable"]
            }
            restore = functools.partial(
                _restore,
                engine,
                shard["masters"],
                shard["optimizer"],
                frozen,
                shard["step"],
                shard["rng"],
                shard.get("loss_scaler"),
            )
        else:
            restore = functools.partial(_restore_universal, engine, universal(path))   # reshard
        problem = None
    except CheckpointError as e:
        problem = str(e)
    # one rank's bad file stops them all
    problems = [p for p in comm.all_gather_object(problem) if p]
    if problems:
        raise CheckpointError(problems[0])
    restore()


def _restore(
    engine,
    masters: list[torch.Tensor],
    optimizer_state: dict,
    frozen: dict[str, torch.Tensor],
    step: int,
    rng: dict | None,
    loss_scaler: dict | None = None,
) -> None:
    """Put this rank's masters (one per bucket of this engine), its optimizer's state_dict, the
    frozen parameters and buffers ({state_dict key: value}, the same on every rank), step, RNG and
    the loss scaler's state (if both the checkpoint and the engine have one) in place."""
    opt = engine.optimizer
    opt.load_state_dict(optimizer_state)
    with torch.no_grad():
        for master, part, value in zip(opt.masters, opt.param_parts, masters):
            master.copy_(value)
            if master.data_ptr() != part.data_ptr():
                part.copy_(master)          # the model's parameters = round(master), as step() does
        engine.params.after_step()          # share them as step() does (stages 1-2 all-gather)
        state = engine.module.state_dict(keep_vars=True)
        with engine.gathering(engine.frozen, modifier_rank=0):    # every rank read the same values
            for key, value in frozen.items():
                state[key].copy_(value)
    engine.step_count = step
    if loss_scaler is not None and engine.scaler is not None:
        engine.scaler.load_state_dict(loss_scaler)
    if rng is not None:
        torch.set_rng_state(rng["torch"])
        if rng["cuda"] is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _restore_universal(engine, u: dict) -> None:
    """Reshard: cut the whole-model values for this rank's tensor-parallel part (as the model was
    split: tensor_parallel.part), lay them out in this engine's buckets and keep this rank's
    partition, exactly as the engine laid out the parameters when it was built (flat.py). Adam's
    moments, SGD's momentum, any state with one value per element, are cut like the masters; scalars
    (Adam's step) are the same for every bucket."""
    m, index = _tensor_parallel(engine), _part_index(engine) or 0
    entries = tensor_parallel.whole_entries(engine.module)

    def mine(whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{whole model's key: tensor} -> {this model's key: this rank's part}"""
        out: dict[str, torch.Tensor] = {}
        for e in entries:
            if e["key"] in whole and e["part"] not in out:
                out[e["part"]] = tensor_parallel.part(whole[e["key"]], e["split"], m, index)
        return out

    key_of: dict[int, str] = {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        key_of.setdefault(id(t), key)                        # a tied weight: its first key

    def my_parts(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        parts = []
        for b in engine.layout.buckets:
            full = torch.zeros(b.padded_numel, dtype=torch.float32)     # padding: zero, as at build
            for p, view in b.views(full):
                view.copy_(values[key_of[id(p)]])
            parts.append(engine.layout.my_partition(full, b) if engine.sharded else full)
        return parts

    model = mine(u["model"])
    masters = my_parts(model)
    state = {}
    if u["optimizer_state"] or u["scalars"]:
        state = {
            i: {name: v.clone() if torch.is_tensor(v) else v for name, v in u["scalars"].items()}
            for i in range(len(masters))
        }
        for name, values in u["optimizer_state"].items():
            for i, part in enumerate(my_parts(mine(values))):
                state[i][name] = part
    groups = [{**g, "params": []} for g in u["param_groups"]]      # its own views (optim.py)
    trainable = {id(p) for p in engine.trainable}
    frozen = {k: model[k] for k, t in engine.module.state_dict(keep_vars=True).items()
              if id(t) not in trainable}                     # frozen parameters and buffers
    _restore(
        engine,
        masters,
        {"state": state, "param_groups": groups},
        frozen,
        u["step"],
        u["rng"],
        u.get("loss_scaler"),
    )


# --------------------------------------------------------------------------------------------------
# Whole-model states from the shards, without a process group (minizero.consolidate)
# --------------------------------------------------------------------------------------------------

def consolidate(directory: str) -> dict[str, torch.Tensor]:
    """The whole model's fp32 state_dict from a sharded checkpoint, without a process
    group (DeepSpeed's zero_to_fp32.py; `python -m minizero.consolidate ckpt model.pt`).
    Raises CheckpointError.

    Concatenating a bucket's N partitions (one per rank file) rebuilds the padded bucket [N·Ψ_b/N];
    the manifest's offsets and shapes cut it back into parameters, exactly like flat.Bucket.views.
    Frozen parameters and buffers come from replicated.pt. On a 2-D mesh this gives each
    tensor-parallel part's model (its tp{i}- files), and tensor_parallel.merge joins the M parts of
    every split parameter (the manifest's whole_state_dict says along which axis). The result has
    the keys of the model built without tensor parallelism, in order, both names of a tied weight
    included, floating point tensors in fp32. Loaded into a fresh model and wrapped at another N
    (or mesh), it continues the run there with a fresh optimizer; universal() keeps the optimizer
    state too."""
    manifest = read_manifest(directory)
    return _merged(manifest, [part.model() for part in _parts(directory, manifest)])


def universal(directory: str) -> dict:
    """consolidate() plus the optimizer state, unsharded the same way: what engine.load reshards
    from, at any stage, N, dtype, offload and mesh (DeepSpeed's ds_to_universal; PyTorch DCP
    reshards the same way).

        {"format": "minizero-universal", "step", "optimizer" (class name), "state_dict" (the
         whole model's entries: key, shape, trainable), "model": consolidate()'s state_dict,
         "optimizer_state": {state name: {key: fp32 tensor shaped like the whole parameter}} for
         every per-element state (exp_avg, exp_avg_sq, momentum_buffer),
         "scalars": {state name: value} (step: the same for every bucket), "param_groups":
         [lr, betas... of each group], "group_params": the manifest's,
         "rng": rank 0's, "loss_scaler": rank 0's (the same on every rank; None without fp16)}

    A state that is neither per-element nor one scalar for all buckets cannot be cut:
    CheckpointError."""
    manifest = read_manifest(directory)
    parts = _parts(directory, manifest)
    saved = parts[0].get(0)["optimizer"]
    per_element, scalars = set(), {}
    # every rank's file: an optimizer stepping two kinds of groups (beyond/muon/: Muon's momentum,
    # AdamW's moments) may hold a state on some ranks only; where a rank has none it is zeros
    ranks = max((b["padded_numel"] // b["shard_numel"] for b in manifest["buckets"]), default=1)
    for r in range(ranks):
        for i, b in enumerate(manifest["buckets"]):
            for name, v in parts[0].get(r)["optimizer"]["state"].get(i, {}).items():
                if (
                    torch.is_tensor(v)
                    and v.dim() == 1
                    and v.numel() == b["shard_numel"]
                    and name not in scalars
                ):
                    per_element.add(name)              # one value per element: cut like the masters
                elif (not torch.is_tensor(v) or v.dim() == 0) and name not in per_element and \
                        _same(scalars.setdefault(name, v), v):
                    pass                                  # one value for every bucket: carried over
                else:
                    raise CheckpointError(
                        f"{directory}: {manifest['optimizer']}'s state {name!r} is neither one "
                        "value per element nor one scalar: it cannot be resharded"
                    )
    return {
        "format": UNIVERSAL,
        "format_version": FORMAT_VERSION,
        "step": manifest["step"],
        "optimizer": manifest["optimizer"],
        "state_dict": [{"key": e["key"], "shape": e["shape"], "trainable": e["trainable"]}
                       for e in whole_state_dict(manifest)],
        "group_params": manifest.get("group_params"),
        "model": _merged(manifest, [part.model() for part in parts]),
        "optimizer_state": {name: _merged(manifest, [part.trainable(
            lambda f, i, n=name: f["optimizer"]["state"].get(i, {}).get(
                n, torch.zeros(manifest["buckets"][i]["shard_numel"]))) for part in parts])
            for name in sorted(per_element)},
        "scalars": scalars,
        "rng": parts[0].get(0)["rng"],
        "loss_scaler": parts[0].get(0).get("loss_scaler"),
        "param_groups": [
            {k: v for k, v in g.items() if k != "params"} for g in saved["param_groups"]
        ],
    }


def _same(a, b) -> bool:
    return torch.equal(a, b) if torch.is_tensor(a) and torch.is_tensor(b) else a == b


def whole_state_dict(saved: dict) -> list[dict]:
    """The whole model a manifest (or a universal state) describes: its "whole_state_dict"
    (tensor_parallel.whole_entries of rank 0's model), or, saved before there was one, its
    "state_dict" (a model without tensor parallelism: each key its own part, none split)."""
    if "whole_state_dict" in saved:
        return saved["whole_state_dict"]
    if saved.get("tensor_parallel", 1) > 1:           # its parts cannot be told apart from copies
        raise CheckpointError(f"a checkpoint saved on tensor-parallel rows of "
                              f"{saved['tensor_parallel']} before manifests recorded how the parts "
                              "are split (whole_state_dict): save it again")
    return [{"key": e["key"], "part": e["key"], "shape": e["shape"], "trainable": e["trainable"],
             "split": None} for e in saved["state_dict"]]


def _parts(directory: str, manifest: dict) -> list[_Shards]:
    """Each tensor-parallel part's files (one part without tensor parallelism)."""
    m = manifest.get("tensor_parallel", 1)
    return [_Shards(directory, manifest, None if m == 1 else i) for i in range(m)]


def _merged(manifest: dict, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """{whole model's key: whole tensor} from each tensor-parallel part's {key: tensor}, in rank
    order (one part without tensor parallelism: the same tensors)."""
    return {e["key"]: tensor_parallel.merge([p[e["part"]] for p in parts], e["split"])
            for e in whole_state_dict(manifest) if e["part"] in parts[0]}


class _Shards:
    """One tensor-parallel part's rank files (`part` None: the checkpoint's, without tensor
    parallelism), each read (and checked) once, and the whole tensors of that part they hold
    together."""

    def __init__(self, directory: str, manifest: dict, part: int | None = None):
        self.directory, self.manifest, self.part, self.files = directory, manifest, part, {}

    def get(self, r: int) -> dict:
        if r not in self.files:
            self.files[r] = read_file(self.directory, self.manifest, shard_file(r, self.part))
        return self.files[r]

    def trainable(self, pick) -> dict[str, torch.Tensor]:
        """{state_dict key: whole tensor} of the trainable parameters, pick(rank file, bucket index)
        being one rank's flat part of a bucket (its masters, or a state of its optimizer)."""
        values: dict[str, torch.Tensor] = {}
        for i, b in enumerate(self.manifest["buckets"]):
            # N for stages 1-3; 1 for DDP (replicated)
            parts = b["padded_numel"] // b["shard_numel"]
            full = torch.cat([pick(self.get(r), i).float() for r in range(parts)])  # [padded_numel]
            for p in b["params"]:
                numel = torch.Size(p["shape"]).numel()
                values[p["name"]] = full[p["offset"]: p["offset"] + numel].view(p["shape"]).clone()
        return {
            e["key"]: values[e["source"]]
            for e in self.manifest["state_dict"]
            if e["source"] in values
        }

    def model(self) -> dict[str, torch.Tensor]:
        values = self.trainable(lambda f, i: f["masters"][i])
        replicated = read_file(self.directory, self.manifest, shard_file(None, self.part))
        for e in self.manifest["state_dict"]:
            if e["key"] not in values:
                t = replicated[e["source"]]
                values[e["key"]] = t.float() if t.is_floating_point() else t
        return {e["key"]: values[e["key"]] for e in self.manifest["state_dict"]}


def _read_universal(path: str) -> dict:
    try:
        u = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:                   # truncated or not a torch file: pickle/zip errors vary
        raise CheckpointError(f"{path} is not a readable torch file: {type(e).__name__}") from None
    if not isinstance(u, dict) or u.get("format") != UNIVERSAL:
        raise CheckpointError(
            f"{path} holds no optimizer state (a plain state_dict loads with "
            "model.load_state_dict; python -m minizero.consolidate --optimizer writes one)"
        )
    return u
