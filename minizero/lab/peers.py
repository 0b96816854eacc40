"""PyTorch's own implementation of each stage, trained exactly as minizero.lab.train
trains minizero's.

    results = minizero.launch(peer_worker, 2, TrainConfig(stage=3), "fsdp2")

The tests check that minizero ends where PyTorch ends, and the benchmark times both:
    stage 0  <->  torch.nn.parallel.DistributedDataParallel                     ("ddp")
    stage 1  <->  DDP + torch.distributed.optim.ZeroRedundancyOptimizer        ("zero_redundancy")
    stage 2  <->  FSDP2 fully_shard(reshard_after_forward=False)               ("fsdp2_no_reshard")
    stage 3  <->  FSDP2 fully_shard per block and at the root                  ("fsdp2")
(FSDP2 shards gradients as stage 2 does; without resharding after forward it keeps full
parameters from forward to backward, the closest PyTorch has to stage 2.) Same model, initial
weights, data, optimizer.
minizero.fully_shard  <->  FSDP2 fully_shard, both per block and at the root (build_front_end,
    front_end_worker: minizero's front ends run in PyTorch's loop too); minizero's
    DistributedDataParallel <-> "ddp", and with its ZeroRedundancyOptimizer <-> "zero_redundancy"
shard_group_size=S  <->  FSDP2 HSDP: fully_shard on a 2-D DeviceMesh (N/S, S) ("replicate",
                         "shard"),
    ("fsdp2_hsdp"): shards in rows of S consecutive ranks, replicates across them, as
    beyond/mesh.py's mesh(S).
stage 3, tensor_parallel=M  <->  PyTorch's tensor parallelism (parallelize_module with
    ColwiseParallel / RowwiseParallel on each block's qkv, proj and MLP) and FSDP2 on the data-
    parallel dimension of a 2-D DeviceMesh (N/M, M) ("dp", "tp") ("tp_fsdp2"), as torchtitan
    combines them. Its embedding and head stay whole on each row (minizero splits them by
    vocabulary), so the two send different bytes for them; the blocks are split alike.
"""

from __future__ import annotations

import contextlib
import functools
import types

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.nn.parallel import DistributedDataParallel

from minizero import comm
from minizero.beyond import tensor_parallel
from minizero.lab.model import make_model
from minizero.lab.train import OPTIMIZERS, TrainConfig, clock, forward_backward, timed_step
from minizero.memory import measure
from minizero.pytorch import DistributedDataParallel as MinizeroDDP
from minizero.pytorch import ZeroRedundancyOptimizer as MinizeroZero
from minizero.pytorch import fully_shard as minizero_fully_shard

PEER_OF_STAGE = {0: "ddp", 1: "zero_redundancy", 2: "fsdp2_no_reshard", 3: "fsdp2"}
TENSOR_PARALLEL_PEER = "tp_fsdp2"         # stage 3 on a mesh (TrainConfig.tensor_parallel > 1)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def build_peer(cfg: TrainConfig, peer: str):
    """(module to call, optimizer, no_sync context factory) for one of PyTorch's implementations."""
    device = comm.device()
    model = make_model(cfg.model_config(), seed=cfg.seed).to(device)
    if cfg.dtype != "fp32":
        raise ValueError("peers are compared in fp32")
    opt_cls = OPTIMIZERS[cfg.optimizer]
    opt_kwargs = {"lr": cfg.lr, **cfg.optimizer_params}
    if peer in ("ddp", "zero_redundancy"):
        ddp = DistributedDataParallel(model, bucket_cap_mb=cfg.bucket_size / 1e6,
                                      device_ids=[device.index] if device.type == "cuda" else None)
        params = [p for p in ddp.parameters() if p.requires_grad]
        if peer == "ddp":
            optimizer = opt_cls(params, **opt_kwargs)
        else:
            optimizer = ZeroRedundancyOptimizer(params, optimizer_class=opt_cls, **opt_kwargs)
        return ddp, optimizer, ddp.no_sync
    if peer in ("fsdp2", "fsdp2_no_reshard", "fsdp2_hsdp"):
        reshard = peer != "fsdp2_no_reshard"
        mesh = None
        if peer == "fsdp2_hsdp":                  # rows of S ranks shard, columns replicate
            s = cfg.shard_group_size or comm.world_size()
            mesh = init_device_mesh(
                device.type, (comm.world_size() // s, s), mesh_dim_names=("replicate", "shard")
            )
        for block in model.blocks:
            fully_shard(block, reshard_after_forward=reshard, mesh=mesh)
        fully_shard(model, reshard_after_forward=reshard, mesh=mesh)

        optimizer = opt_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
        return model, optimizer, functools.partial(_without_sync, model)
    if peer == TENSOR_PARALLEL_PEER:
        m = cfg.tensor_parallel
        mesh = init_device_mesh(device.type, (comm.world_size() // m, m),
                                mesh_dim_names=("dp", "tp"))
        plan = {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                "mlp.0": ColwiseParallel(), "mlp.2": RowwiseParallel()}
        for block in model.blocks:
            _interleave_qkv(block.attn.qkv, m)
            block.attn.n_head //= m
            parallelize_module(block, mesh["tp"], plan)
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        optimizer = opt_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
        return model, optimizer, contextlib.nullcontext
    raise ValueError(
        f"unknown peer {peer!r}; choose from {sorted(PEER_OF_STAGE.values())}, fsdp2_hsdp or "
        f"{TENSOR_PARALLEL_PEER}"
    )


def _qkv_order(out_features: int, m: int) -> torch.Tensor:
    """The row order that gives rank r of m, in ColwiseParallel's contiguous split, its q, k and v
    heads (minizero's split_pieces=3): [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]."""
    return torch.arange(out_features).view(3, m, -1).transpose(0, 1).reshape(-1)


def _interleave_qkv(linear: torch.nn.Linear, m: int) -> None:
    order = _qkv_order(linear.out_features, m)
    with torch.no_grad():
        linear.weight.copy_(linear.weight[order])
        linear.bias.copy_(linear.bias[order])


def _tensor_parallel_part(state: dict, cfg: TrainConfig) -> dict:
    """The tensor-parallel peer's whole state (qkv rows in its order) as minizero holds it on this
    rank: qkv rows back in order, then split as tensor_parallel.parallelize_gpt splits the GPT."""
    m = cfg.tensor_parallel
    for name in [k for k in state if k.endswith("attn.qkv.weight") or k.endswith("attn.qkv.bias")]:
        state[name] = state[name][torch.argsort(_qkv_order(state[name].shape[0], m))]
    model = make_model(cfg.model_config(), seed=cfg.seed)
    model.load_state_dict(state)
    row = types.SimpleNamespace(size=m, index=comm.rank() % m)     # splitting needs no collective
    return tensor_parallel.parallelize_gpt(model, row).state_dict()


def peer_worker(cfg: TrainConfig, peer: str, build=build_peer) -> dict:
    """The loop of minizero.lab.train.train_worker, with PyTorch's implementation instead of
    an engine (build: build_peer, or build_front_end for minizero's imitation of it)."""
    rank = comm.rank()
    module, optimizer, no_sync = build(cfg, peer)
    params = [p for p in module.parameters() if p.requires_grad]
    losses, step_times, phase_times, memory, tally = [], [], [], None, {}
    for step in range(cfg.steps):
        comm.reset_tally()                  # minizero's collectives only: a peer's are not in it
        start, phases = clock(), {}
        step_loss = forward_backward(cfg, step, module, torch.Tensor.backward, no_sync, phases)
        if step == cfg.steps - 1:
            memory = _memory(module, optimizer)
        timed_step(functools.partial(_step, optimizer, params, cfg.clip_grad_norm), phases)
        step_times.append(clock() - start)
        phase_times.append(phases)
        losses.append(step_loss)
        tally = comm.tally()
    result = {"rank": rank, "losses": losses, "step_times": step_times, "phase_times": phase_times,
              "memory": memory, "comm_bytes_per_step": tally,
              "num_params": sum(p.numel() for p in module.parameters())}
    if cfg.return_state:
        result["state_dict"] = full_state_dict(module)
        if peer == TENSOR_PARALLEL_PEER:
            result["state_dict"] = _tensor_parallel_part(result["state_dict"], cfg)
    return result


# minizero's front ends that take what a PyTorch implementation takes -> that implementation's peer
FRONT_ENDS = {"fully_shard": "fsdp2", "ddp": "ddp", "ddp+zero": "zero_redundancy"}


def build_front_end(cfg: TrainConfig, front_end: str):
    """(module, optimizer, no_sync) for minizero's front end, built as build_peer builds its peer:
    minizero.fully_shard per block, then at the root, as the "fsdp2" peer (the same units); its
    DistributedDataParallel with the same bucket size, and the user's optimizer or its
    ZeroRedundancyOptimizer over the optimizer class, as "ddp" and "zero_redundancy"."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"unknown front end {front_end!r}; choose from {sorted(FRONT_ENDS)}")
    if cfg.dtype != "fp32":
        raise ValueError("front ends are compared with their peers in fp32")
    model = make_model(cfg.model_config(), seed=cfg.seed).to(comm.device())
    opt_cls, opt_kwargs = OPTIMIZERS[cfg.optimizer], {"lr": cfg.lr, **cfg.optimizer_params}
    if front_end in ("ddp", "ddp+zero"):
        ddp = MinizeroDDP(model, bucket_cap_mb=cfg.bucket_size / 1e6)
        params = [p for p in ddp.parameters() if p.requires_grad]
        optimizer = (opt_cls(params, **opt_kwargs) if front_end == "ddp" else
                     MinizeroZero(params, opt_cls, **opt_kwargs))
        return ddp, optimizer, ddp.no_sync
    for block in model.blocks:
        minizero_fully_shard(block)
    minizero_fully_shard(model)
    optimizer = opt_cls([p for p in model.parameters() if p.requires_grad], **opt_kwargs)
    return model, optimizer, functools.partial(_without_sync, model)


def front_end_worker(cfg: TrainConfig, front_end: str) -> dict:
    """peer_worker's loop and report, for minizero's front end (FRONT_ENDS): what the bench pairs
    with the peer it imitates. Its comm_bytes_per_step is minizero's tally; it has no engine,
    so no counted peak (None)."""
    return {**peer_worker(cfg, front_end, build=build_front_end), "peak": None}


@contextlib.contextmanager
def _without_sync(model):
    """FSDP2's no_sync: set_requires_gradient_sync(False) inside."""
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def _step(optimizer, params, clip_grad_norm) -> None:
    """What engine.step() does, the PyTorch way: clip if asked, step, zero the gradients."""
    if clip_grad_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def full_state_dict(module) -> dict[str, torch.Tensor]:
    """Plain CPU tensors with the unwrapped model's keys (DDP's 'module.' prefix dropped,
    DTensors gathered)."""
    inner = module.module if isinstance(module, (DistributedDataParallel, MinizeroDDP)) else module
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu().clone()
            for k, v in inner.state_dict().items()}


def _memory(module, optimizer) -> dict[str, int]:
    """This rank's resident bytes, counted the way minizero counts its own (each storage once)."""
    params = list(module.parameters())
    if isinstance(optimizer, (ZeroRedundancyOptimizer, MinizeroZero)):
        state = optimizer.optim.state.values()                   # this rank's optimizer's
    else:
        state = optimizer.state.values()
    return measure(
        {
            "params": [_local(p) for p in params],
            "grads": [_local(p.grad) for p in params if p.grad is not None],
            "optimizer": [_local(v) for s in state for v in s.values() if torch.is_tensor(v)],
        }
    )
