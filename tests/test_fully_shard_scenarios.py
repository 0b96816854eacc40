"""PyTorch's own FSDP2 test scenarios, ported: minizero.fully_shard and torch's fully_shard, each
against torch's DistributedDataParallel (or one process) on the same data.

    python -m pytest tests/test_fully_shard_scenarios.py

The scenarios of pytorch/pytorch test/distributed/_composable/fsdp/ (test_fully_shard_training,
_frozen, _mixed_precision, _clip_grad_norm_, _comm / gradient accumulation, HSDP), written anew
here on small models. Each scenario runs twice in the same process group, once per implementation
(`impl`), and its results are compared with DDP's, which runs beside it on the same rows, and with
the other implementation's. Collectives are counted by dispatch for both, as CommDebugMode counts
them: the same counts. One launch at N = 2 and one at N = 4 (HSDP on a
2 x 2 mesh, reshard_after_forward=2).
"""

from __future__ import annotations

import copy
import functools
import warnings

import _fsdp2 as H
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

import minizero
from minizero import comm
from _fsdp2 import counting, seeded
from minizero.lab.reference import max_abs_diff

IMPLS = tuple(H.IMPLEMENTATIONS)


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int | None = None):
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden or 2 * dim + 1)      # an odd number of rows
        self.out_proj = nn.Linear(hidden or 2 * dim + 1, dim)

    def forward(self, x):
        return self.out_proj(F.relu(self.in_proj(x)))


class Checkpointed(nn.Module):
    """A block whose forward is recomputed in backward (torch.utils.checkpoint)."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x):
        return checkpoint(self.block, x, use_reentrant=False)


def inputs(step: int, rows: int, dim: int) -> torch.Tensor:
    """This rank's rows of a seeded random global batch."""
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(rows * comm.world_size(), dim, generator=gen)
    return x[comm.rank() * rows:(comm.rank() + 1) * rows]


def ddp(model: nn.Module) -> DistributedDataParallel:
    return DistributedDataParallel(copy.deepcopy(model))


def full(model: nn.Module) -> dict[str, torch.Tensor]:
    inner = model.module if isinstance(model, DistributedDataParallel) else model
    return {k: v.detach().clone() for k, v in H.whole(inner).items()}


def lockstep(models_opts, steps: int, batch, set_to_none=lambda it: it % 2 == 0, after=None):
    """Train several (model, optimizer) pairs on the same rows, FSDP2's tests' loop: zero_grad
    (alternating set_to_none), forward, backward, step. Their losses per step."""
    losses = [[] for _ in models_opts]
    for it in range(steps):
        x = batch(it)
        for i, (model, opt) in enumerate(models_opts):
            opt.zero_grad(set_to_none=set_to_none(it))
            loss = model(x).sum()
            loss.backward()
            if after is not None:
                after(model)
            opt.step()
            losses[i].append(loss.item())
    return losses


# --------------------------------------------------------------------------------------------------
# Scenarios: each returns what the test compares, for one implementation
# --------------------------------------------------------------------------------------------------

def parity_with_ddp(impl: str, reshard_after_forward=True, offload=False, mesh=None) -> dict:
    """test_train_parity_multi_group: the GPT sharded per block and at the root against DDP,
    reshard_after_forward True / False / 2, with and without CPU offload (pin_memory=False), on a
    1-D mesh or HSDP's 2-D one. SGD, not Adam: the loss (a sum of logits) leaves some gradients
    zero up to rounding (the key bias), which Adam turns into lr-sized steps that differ between
    any two reduction orders; the parameters could not be compared."""
    model = H.gpt(awkward=False)
    ref = ddp(model)
    kwargs = dict(reshard_after_forward=reshard_after_forward, mesh=mesh)
    if offload:
        kwargs["offload_policy"] = H.policy(impl, "CPUOffloadPolicy", pin_memory=False)
    H.shard(impl, model, **kwargs)
    sgd = functools.partial(torch.optim.SGD, lr=1e-3, momentum=0.9)
    pairs = [(ref, sgd(ref.parameters())), (model, sgd(model.parameters()))]
    losses = lockstep(pairs, 4, lambda it: H.batch(it)[0])
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model),
            "devices": sorted({p.device.type for p in model.parameters()}
                              | {p.grad.device.type for p in model.parameters()}
                              | {v.device.type for s in pairs[1][1].state.values()
                                 for v in s.values()})}


def single_group(impl: str) -> dict:
    """test_train_parity_single_group: one unit (the root alone), uneven and even dim 0."""
    out = {}
    for shapes in ([(16, 15), (15, 8)], [(7, 15), (15, 3)], [(16, 17), (17, 8)]):
        model = seeded(lambda: nn.Sequential(nn.Linear(*shapes[0]), nn.ReLU(),
                                             nn.Linear(*shapes[1])))
        ref = ddp(model)
        H.IMPLEMENTATIONS[impl].fully_shard(model)
        pairs = [(ref, torch.optim.Adam(ref.parameters(), lr=1e-2)),
                 (model, torch.optim.Adam(model.parameters(), lr=1e-2))]
        losses = lockstep(pairs, 4, lambda it: inputs(it, 4, shapes[0][0]))
        out[str(shapes)] = {"losses": losses, "ddp": full(ref), "fsdp": full(model)}
    return out


def tied_uneven(impl: str) -> dict:
    """test_train_shared_params_uneven_shard: an embedding tied to the output layer, vocabulary
    N·4 + 1 (the last rank's shard is padded): every row trains, DDP's parity."""
    vocab, dim = comm.world_size() * 4 + 1, 16

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, dim)
            self.out = nn.Linear(dim, vocab, bias=False)
            self.out.weight = self.embed.weight

        def forward(self, ids):
            return self.out(self.embed(ids))

    model = seeded(Tied)
    first = model.embed.weight.detach().clone()
    ref = ddp(model)
    H.IMPLEMENTATIONS[impl].fully_shard(model)
    pairs = [(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
             (model, torch.optim.AdamW(model.parameters(), lr=1e-2))]
    ids = lambda it: torch.arange(vocab).repeat(2)[comm.rank()::comm.world_size()]  # noqa: E731
    losses = lockstep(pairs, 3, ids)
    last = model.embed.weight.full_tensor()
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model),
            "rows trained": int((last != first).any(dim=1).sum()), "vocab": vocab}


def grouped_tied(impl: str) -> dict:
    """test_train_shared_params_uneven_shard's grouping: the GPT's tied embedding and head as one
    unit (fully_shard([tok_emb, head])), the blocks, then the root; DDP's parity."""
    model = H.gpt()
    ref = ddp(model)
    fully_shard = H.IMPLEMENTATIONS[impl].fully_shard
    fully_shard([model.tok_emb, model.head])
    H.shard(impl, model)
    pairs = [(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
             (model, torch.optim.AdamW(model.parameters(), lr=1e-2))]
    with counting(impl) as count:
        losses = lockstep(pairs, 3, lambda it: H.batch(it)[0])
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model),
            "gathers": count.counts["all_gather"], "reductions": count.counts["reduce_scatter"]}


class ChunkedHead(nn.Module):
    """test_partial_group_forward_then_standalone's model: forward may skip the head, which the
    loop then runs chunk by chunk (a chunked loss)."""

    def __init__(self, dim: int = 8, vocab: int = 13):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.body = nn.Linear(dim, dim, bias=False)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, skip_head: bool = False):
        h = self.norm(self.body(self.embed(tokens)))
        return h if skip_head else self.head(h)


def partial_group_forward(impl: str | None) -> dict:
    """[norm, head] as one unit; forward skips the head, then the head runs per chunk, each chunk's
    loss.backward() on its own, then the body's backward from the chunks' input gradients
    (FSDP2's chunked-loss pattern). impl None: the model alone, gradients averaged by hand."""
    model = seeded(ChunkedHead)
    if impl is not None:
        fully_shard = H.IMPLEMENTATIONS[impl].fully_shard
        fully_shard(model.embed)
        fully_shard(model.body)
        fully_shard([model.norm, model.head])
        fully_shard(model)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for it in range(3):
        tokens = torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(
            100 * it + comm.rank()))
        h = model(tokens, skip_head=True)
        grads, total = [], 0.0
        for chunk in torch.chunk(h.detach(), 2, dim=1):
            chunk = chunk.contiguous().requires_grad_(True)
            loss = model.head(chunk).sum()
            loss.backward()
            grads.append(chunk.grad)
            total += loss.item()
        h.backward(torch.cat(grads, dim=1))
        if impl is None:
            for p in model.parameters():
                torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        opt.step()
        opt.zero_grad()
        losses.append(total)
    out = {"losses": losses, "params": full(model)}
    if impl is not None:           # test_double_partial_forward_then_backward: two partial
        tokens = torch.randint(0, 13, (2, 8))          # forwards, one backward; the head unused
        (model(tokens, skip_head=True).sum() + model(tokens, skip_head=True).sum()).backward()
        out["head grad after two partial forwards"] = model.head.weight.grad
        out["norm grad"] = model.norm.weight.grad is not None
    return out


MICRO, MLPS, DIM = 3, 3, 8


def gradient_accumulation(impl: str, mode: str, reshard_after_forward, reshard_after_backward,
                          mesh=None, all_reduce_only_last=False) -> dict:
    """test_gradient_accumulation: a Linear and three MLPs, the MLPs sharded and the root; sync
    off for every unit ("all"), the root only ("root_only") or two MLPs ("some_mlps") on all
    micro-batches but the last; collectives counted per iteration (all_reduce_only_last, HSDP:
    reduce-scatter every micro-batch, all-reduce only on the last)."""
    model = seeded(lambda: nn.Sequential(nn.Linear(DIM, DIM), *[MLP(DIM) for _ in range(MLPS)]))
    ref = copy.deepcopy(model)
    fully_shard = functools.partial(H.IMPLEMENTATIONS[impl].fully_shard, mesh=mesh,
                                    reshard_after_forward=reshard_after_forward)
    for mlp in model[1:]:
        fully_shard(mlp)
    fully_shard(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    sync = ((lambda m, on, recurse=True: m.set_requires_all_reduce(on, recurse=recurse))
            if all_reduce_only_last else
            (lambda m, on, recurse=True: m.set_requires_gradient_sync(on, recurse=recurse)))

    def flags(last: bool):
        targets = {"all": [(model, True)], "root_only": [(model, False)],
                   "some_mlps": [(mlp, True) for mlp in model[1:3]]}[mode]
        for module, recurse in targets:
            sync(module, last, recurse=recurse)
            if not reshard_after_backward:
                module.set_reshard_after_backward(last, recurse=recurse)

    counts, diffs = [], []
    for it in range(3):
        with counting(impl) as count:
            for micro in range(MICRO):
                flags(micro == MICRO - 1)
                x = inputs(10 * it + micro, 2, DIM)
                model(x).sum().backward()
                ref(x).sum().backward()
        for p in ref.parameters():
            torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
        diffs.append(max((p.grad.full_tensor() - q.grad).abs().max().item()
                         for p, q in zip(model.parameters(), ref.parameters())))
        counts.append(dict(count.counts))
        for o in (opt, ref_opt):
            o.step()
            o.zero_grad(set_to_none=it % 2 == 1)
    return {"counts": counts, "grad diffs": diffs, "fsdp": full(model)}


def expected_counts(mode: str, reshard_after_forward, reshard_after_backward, hsdp: bool,
                    all_reduce_only_last: bool) -> dict:
    """The collectives one iteration of gradient_accumulation issues (FSDP2's test's rule)."""
    units = MLPS + 1
    rs = units
    if mode == "some_mlps":
        rs += (MLPS - 2 + 1) * (MICRO - 1)
    elif mode == "root_only":
        rs += MLPS * (MICRO - 1)
    ar = rs if hsdp else 0
    if all_reduce_only_last:
        rs = units * MICRO
    ag = units
    if reshard_after_forward is not False:
        ag = 2 * units * MICRO
    elif reshard_after_backward:
        ag *= MICRO
    elif mode == "root_only":
        ag += MLPS * (MICRO - 1)
    out = {"all_gather": ag, "reduce_scatter": rs}
    if ar:
        out["all_reduce"] = ar
    return out


def frozen_per_group(impl: str, reshard_after_forward, freeze_after_init: bool) -> dict:
    """test_train_mixed_requires_grad_per_group: BitFit (only the biases train) with frozen and
    trainable parameters in one unit; each reduce-scatter carries the biases only."""
    model = seeded(lambda: nn.Sequential(*[MLP(8) for _ in range(3)]))

    def freeze(m):
        for name, p in m.named_parameters():
            if "bias" not in name:
                p.requires_grad_(False)
    if not freeze_after_init:
        freeze(model)
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=freeze_after_init)
    for mlp in model:
        H.IMPLEMENTATIONS[impl].fully_shard(mlp, reshard_after_forward=reshard_after_forward)
    H.IMPLEMENTATIONS[impl].fully_shard(model, reshard_after_forward=reshard_after_forward)
    if freeze_after_init:
        freeze(model)
        freeze(ref)
    pairs = [(ref, torch.optim.Adam(ref.parameters(), lr=1e-2)),
             (model, torch.optim.Adam(model.parameters(), lr=1e-2))]
    with H.recorded("collective") as log:
        losses = lockstep(pairs, 3, lambda it: inputs(it, 4, 8))
    numels = sorted({f["numel"] for _, f in log if f["kind"] == "reduce_scatter"})
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model), "reduce-scatter numels":
            numels if impl == "minizero" else None}


def frozen_across_groups(impl: str, reshard_after_forward, unfreeze: bool) -> dict:
    """test_train_mixed_requires_grad_across_groups: six Linear units and no root unit (each its
    own root), every other one frozen, a no_grad iteration, optionally unfrozen at the last."""
    model = seeded(lambda: nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(8, 8),
                                                                         nn.ReLU())]))
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    for module in model:
        if isinstance(module, nn.Linear):
            H.IMPLEMENTATIONS[impl].fully_shard(module, reshard_after_forward=reshard_after_forward)

    def set_frozen(seq, requires_grad):
        for i in range(0, 12, 4):
            seq[i].requires_grad_(requires_grad)
    set_frozen(model, False)
    set_frozen(ref.module, False)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-2) for m in (ref, model)]
    losses = [[], []]
    for it in range(3):
        x = inputs(it, 4, 8)
        for i, (m, opt) in enumerate(zip((ref, model), opts)):
            if unfreeze and it == 2:
                set_frozen(m.module if m is ref else m, True)
            if it == 1:
                with torch.no_grad():
                    losses[i].append(m(x).sum().item())
                continue
            loss = m(x).sum()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=it % 2 == 0)
            losses[i].append(loss.item())
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model)}


def multi_forward(impl: str, reshard_after_forward) -> dict:
    """test_multi_forward_mixed_requires_grad and test_multi_forward_module: units called
    several times in one forward, some under no_grad, a frozen one among them."""
    class Multi(nn.Module):
        def __init__(self):
            super().__init__()
            self.first = nn.Linear(5, 5)
            self.frozen = nn.Linear(5, 5).requires_grad_(False)
            self.trained = nn.Linear(5, 5)

        def forward(self, x):
            x = self.first(x) + self.first(x)
            for _ in range(3):
                x = self.frozen(F.relu(self.trained(x)))
                with torch.no_grad():                    # the same unit, without autograd
                    extra = F.relu(self.trained(x))
                x = x + extra
            return x

    model = seeded(Multi)
    ref = ddp(model)
    for m in (model.first, model.frozen, model.trained):
        H.IMPLEMENTATIONS[impl].fully_shard(m, reshard_after_forward=reshard_after_forward)
    H.IMPLEMENTATIONS[impl].fully_shard(model, reshard_after_forward=reshard_after_forward)
    pairs = [(ref, torch.optim.Adam(ref.parameters(), lr=1e-2)),
             (model, torch.optim.Adam(model.parameters(), lr=1e-2))]
    losses = lockstep(pairs, 4, lambda it: inputs(it, 4, 5))
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model)}


def mixed_precision(impl: str, reduce_dtype, output_dtype) -> dict:
    """test_fully_shard_mixed_precision: bf16 parameters, the reduce-scatter in reduce_dtype (its
    dtype on the event stream), the root's outputs cast to output_dtype."""
    mp = functools.partial(H.policy, impl, "MixedPrecisionPolicy", param_dtype=torch.bfloat16,
                           reduce_dtype=reduce_dtype)
    model = H.gpt()
    seen = []
    model.blocks[0].register_forward_pre_hook(
        lambda m, args: seen.append((m.ln1.weight.dtype, args[0].dtype)))
    for block in model.blocks:
        H.IMPLEMENTATIONS[impl].fully_shard(block, mp_policy=mp())
    H.IMPLEMENTATIONS[impl].fully_shard(model, mp_policy=mp(output_dtype=output_dtype))
    with H.recorded("collective") as log:
        out = H.train(model, steps=2, lr=1e-2)
    dtypes = {p.dtype for p in model.parameters()}          # the shards (fp32: the masters)
    x, _ = H.batch(0)
    with torch.no_grad():
        logits = model(x)
    return {"fsdp": out["params"], "losses": out["losses"], "inside block": seen[0],
            "logits": logits.dtype, "param": dtypes,
            "reduce dtypes": sorted({str(f["dtype"]) for _, f in log
                                     if f["kind"] == "reduce_scatter"})}


def clip_grad_norm(impl: str) -> dict:
    """test_clip_grad_norm_1d: norms 2, 1 and inf, each clipping (max_norm below every
    gradient's norm); the total norm and the clipped gradients as DDP's."""
    out = {}
    for norm_type in (2.0, 1.0, float("inf")):
        model = H.gpt()
        ref = ddp(model)
        H.shard(impl, model)
        x, y = H.batch(0)
        for m in (ref, model):
            H.loss_of(m, x, y).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01, norm_type=norm_type)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01, norm_type=norm_type)
        out[norm_type] = {"ddp norm": ref_norm.item(), "norm": norm.full_tensor().item(),
                          "grad diff": max((p.grad.full_tensor() - q.grad).abs().max().item()
                                           for p, q in zip(model.parameters(),
                                                           ref.module.parameters()))}
    return out


def explicit_prefetch(impl: str) -> dict:
    """test_explicit_prefetching: each block prefetches the next two in forward and the two before
    it in backward; DDP's parity, and (minizero) the prefetches on the event stream."""
    model = H.gpt(n_layer=4)
    ref = ddp(model)
    H.shard(impl, model)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        block.set_modules_to_forward_prefetch(blocks[i + 1:i + 3])
        block.set_modules_to_backward_prefetch(blocks[max(0, i - 2):i][::-1])
    pairs = [(ref, torch.optim.AdamW(ref.parameters(), lr=1e-2)),
             (model, torch.optim.AdamW(model.parameters(), lr=1e-2))]
    with H.recorded("unit gather") as log:
        losses = lockstep(pairs, 3, lambda it: H.batch(it)[0],
                          set_to_none=lambda it: True)
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model),
            "prefetched": sum(f["prefetch"] for _, f in log)}


def activation_checkpointing(impl: str, reshard_after_forward) -> dict:
    """test_train_parity_with_activation_checkpointing: each block recomputed in backward."""
    model = H.gpt()
    model.blocks = nn.ModuleList(Checkpointed(b) for b in model.blocks)
    ref = ddp(model)
    H.shard(impl, model, units=[c.block for c in model.blocks],      # recomputed: their forward
            reshard_after_forward=reshard_after_forward)              # runs again in backward
    pairs = [(ref, torch.optim.Adam(ref.parameters(), lr=1e-2)),
             (model, torch.optim.Adam(model.parameters(), lr=1e-2))]
    losses = lockstep(pairs, 3, lambda it: H.batch(it)[0])
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model)}


def non_root_forward(impl: str) -> dict:
    """test_non_root_forward_backward: a step through the root, then one through its first unit
    alone; against one process's gradients averaged by hand."""
    model = seeded(lambda: nn.Sequential(*[MLP(8) for _ in range(3)]))
    ref = copy.deepcopy(model)
    for mlp in model:
        H.IMPLEMENTATIONS[impl].fully_shard(mlp)
    H.IMPLEMENTATIONS[impl].fully_shard(model)
    opt, ref_opt = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (model, ref))
    x = inputs(0, 4, 8)
    losses = []
    for forward in (lambda m: m, lambda m: m[0]):
        for m, o in ((ref, ref_opt), (model, opt)):
            loss = forward(m)(x).sum()
            loss.backward()
            if m is ref:
                for p in ref.parameters():
                    if p.grad is not None:
                        torch.distributed.all_reduce(p.grad, op=torch.distributed.ReduceOp.AVG)
            o.step()
            o.zero_grad()
            losses.append(loss.item())
    return {"losses": [losses[0::2], losses[1::2]], "ddp": full(ref), "fsdp": full(model)}


def embedding_not_gathered_in_backward(impl: str) -> dict:
    """set_unshard_in_backward(False) on an embedding's unit (its backward needs the indices, not
    the weight): one all-gather less a step, the same training."""
    model = seeded(ChunkedHead)
    ref = ddp(model)
    fully_shard = H.IMPLEMENTATIONS[impl].fully_shard
    for m in (model.embed, model.body, model):
        fully_shard(m)
    model.embed.set_unshard_in_backward(False)
    pairs = [(ref, torch.optim.Adam(ref.parameters(), lr=1e-2)),
             (model, torch.optim.Adam(model.parameters(), lr=1e-2))]
    tokens = lambda it: torch.randint(0, 13, (2, 8), generator=torch.Generator().manual_seed(  # noqa: E731
        10 * it + comm.rank()))
    with counting(impl) as count:
        losses = lockstep(pairs, 3, tokens)
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model),
            "gathers": count.counts["all_gather"]}


def unused_on_one_rank(impl: str) -> dict:
    """set_reduce_scatter_unused_params(True): a parameter only rank 0's forward uses is reduced
    as zeros elsewhere, so every rank issues the same reduce-scatter; its gradient is rank 0's
    divided by N, as DDP's with find_unused_parameters."""
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.trunk = nn.Linear(6, 6)
            self.branch = nn.Linear(6, 6)

        def forward(self, x):
            x = self.trunk(x)
            return self.branch(x) if comm.rank() == 0 else x

    model = seeded(Branchy)
    ref = DistributedDataParallel(copy.deepcopy(model), find_unused_parameters=True)
    H.IMPLEMENTATIONS[impl].fully_shard(model)         # one unit: every rank gathers the branch
    model.set_reduce_scatter_unused_params(True)
    pairs = [(ref, torch.optim.SGD(ref.parameters(), lr=0.1)),
             (model, torch.optim.SGD(model.parameters(), lr=0.1))]
    losses = lockstep(pairs, 3, lambda it: inputs(it, 4, 6), set_to_none=lambda it: False)
    return {"losses": losses, "ddp": full(ref), "fsdp": full(model)}


def reset_after_a_failure(impl: str) -> dict:
    """reset_iter_state() after a forward that raised half way (a unit gathered, a backward
    hook registered): the next steps train as a run that never failed."""
    class Flaky(nn.Linear):
        fail = False

        def forward(self, x):             # fails inside its unit's forward, gathered
            if self.fail:
                raise RuntimeError("boom")
            return super().forward(x)

    out = {}
    for failing in (False, True):
        model = seeded(lambda: nn.Sequential(nn.Linear(6, 6), Flaky(6, 6)))
        for m in (model[0], model[1], model):
            H.IMPLEMENTATIONS[impl].fully_shard(m)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        if failing:
            model[1].fail = True
            try:
                model(inputs(99, 4, 6)).sum().backward()
            except RuntimeError:
                model.reset_iter_state()
            out["shards after reset"] = all(isinstance(p, DTensor) for p in model.parameters())
            model[1].fail = False
        for it in range(2):
            model(inputs(it, 4, 6)).sum().backward()
            opt.step()
            opt.zero_grad()
        out[failing] = full(model)
    return out


def setters_without_effect(impl: str) -> list[str]:
    """set_post_optim_event (stream synchronisation: nothing to do here) is a warning, and the
    old set_reduce_scatter_divide_factor a deprecation warning that still sets the factor."""
    model = seeded(lambda: nn.Linear(4, 4))
    H.IMPLEMENTATIONS[impl].fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.set_post_optim_event(None)
        model.set_reduce_scatter_divide_factor(1.0)
    return [str(w.message) for w in caught]


def divide_factor(impl: str) -> dict | str:
    """set_gradient_divide_factor(1): the gradients summed over the ranks, not averaged. (torch's
    reduces with ReduceOp.PREMUL_SUM, which gloo refuses: its message.)"""
    model = seeded(lambda: nn.Linear(4, 3))
    ref = copy.deepcopy(model)
    H.IMPLEMENTATIONS[impl].fully_shard(model)
    model.set_gradient_divide_factor(1.0)
    x = inputs(0, 2, 4)
    try:
        model(x).sum().backward()
    except RuntimeError as e:
        return str(e)
    ref(x).sum().backward()
    for p in ref.parameters():
        torch.distributed.all_reduce(p.grad)
    return {"diff": max((p.grad.full_tensor() - q.grad).abs().max().item()
                        for p, q in zip(model.parameters(), ref.parameters()))}


def hugging_face(impl: str, name: str, checkpointing: bool = False) -> dict:
    """Hugging Face models as FSDP2's users shard them: each decoder layer, then the model (GPT-2's
    head tied to its embedding, Llama, GPT-2 with a peft LoRA adapter on a frozen base; keyword
    inputs, a ModelOutput back; optionally HF's non-reentrant activation checkpointing)."""
    import _hf
    case = _hf.Case(model=name, stage=3, checkpointing=checkpointing)
    model = _hf.build(case)
    H.shard(impl, model, units=_hf.decoder_layers(model))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses = []
    for step in range(3):
        x, y = H.local_batch(*H.global_batch(step, case.batch_size, _hf.BLOCK, seed=case.seed),
                             comm.rank(), comm.world_size())
        loss = _hf.lm_loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full(model)}


def offload_pinned(impl: str) -> dict | str:
    """CPUOffloadPolicy() (pin_memory=True) without an accelerator: minizero warns once and
    trains; PyTorch raises."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            H.shard(impl, H.gpt(), offload_policy=H.policy(impl, "CPUOffloadPolicy"))
        return [str(w.message) for w in caught if "pin_memory" in str(w.message)]
    except RuntimeError as e:
        return f"RuntimeError: {e}"


# --------------------------------------------------------------------------------------------------
# The launches
# --------------------------------------------------------------------------------------------------

ACCUMULATION = [(mode, raf, rab) for mode in ("all", "root_only", "some_mlps")
                for raf in (True, False) for rab in (True, False)
                if rab or (raf is False and mode != "some_mlps")]


def worker() -> dict:
    """N = 2: every scenario on a 1-D mesh. N = 4: what needs more ranks (HSDP on a 2 x 2 mesh,
    reshard_after_forward=2 with 2 < N)."""
    n, out = comm.world_size(), {}
    for impl in IMPLS:
        if n == 4:
            hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            out[impl, "parity", 2] = parity_with_ddp(impl, 2)
            out[impl, "hsdp parity"] = parity_with_ddp(impl, mesh=hsdp)
            for only_last in (False, True):
                out[impl, "hsdp accumulation", only_last] = gradient_accumulation(
                    impl, "all", True, True, mesh=hsdp, all_reduce_only_last=only_last)
            continue
        for raf in (True, False):
            out[impl, "parity", raf] = parity_with_ddp(impl, raf)
        out[impl, "offload"] = parity_with_ddp(impl, offload=True)
        out[impl, "pinned"] = offload_pinned(impl)
        out[impl, "embedding"] = embedding_not_gathered_in_backward(impl)
        out[impl, "unused"] = unused_on_one_rank(impl)
        out[impl, "reset"] = reset_after_a_failure(impl)
        out[impl, "factor"] = divide_factor(impl)
        for name, checkpointing in (("gpt2", False), ("llama", False), ("lora", False),
                                    ("gpt2", True)):
            out[impl, "hf", name, checkpointing] = hugging_face(impl, name, checkpointing)
        if impl == "minizero":
            out[impl, "no effect"] = setters_without_effect(impl)
        for spec in ACCUMULATION:
            out[impl, "accumulation", spec] = gradient_accumulation(impl, *spec)
        out[impl, "single group"] = single_group(impl)
        out[impl, "tied uneven"] = tied_uneven(impl)
        out[impl, "grouped tied"] = grouped_tied(impl)
        out[impl, "partial group"] = partial_group_forward(impl)
        for raf in (True, False):
            for after in (False, True):
                out[impl, "frozen per group", raf, after] = frozen_per_group(impl, raf, after)
            out[impl, "frozen across groups", raf] = frozen_across_groups(impl, raf, True)
            out[impl, "multi forward", raf] = multi_forward(impl, raf)
            out[impl, "checkpointing", raf] = activation_checkpointing(impl, raf)
        for reduce_dtype in (None, torch.float32):
            out[impl, "mixed precision", reduce_dtype] = mixed_precision(
                impl, reduce_dtype, torch.float32 if reduce_dtype else None)
        out[impl, "clip"] = clip_grad_norm(impl)
        out[impl, "prefetch"] = explicit_prefetch(impl)
        out[impl, "non-root"] = non_root_forward(impl)
    if n == 2:
        out["alone", "partial group"] = partial_group_forward(None)
    return out


@pytest.fixture(scope="module", params=(2, 4), ids=lambda n: f"N={n}")
def runs(request):
    # check_every=0: the launcher's desync agreement (an all-reduce before each blocking collective,
    # beyond/desync.py) would be counted with fully_shard's own collectives; here only on a stall
    return request.param, minizero.launch(worker, request.param, backend="gloo", check_every=0)


def cases(runs, *key):
    """Each rank's (minizero's, torch's) result for a key, or skip where that N did not run it."""
    n, ranks = runs
    if ("minizero", *key) not in ranks[0]:
        pytest.skip(f"not run at N = {n}")
    return [(rank[("minizero", *key)], rank[("torch", *key)]) for rank in ranks]


def same_as_ddp(ours, theirs, atol=1e-5):
    """Both implementations' losses and parameters are DDP's (within atol), and each other's."""
    for result in (ours, theirs):
        assert result["losses"][0] == pytest.approx(result["losses"][1], rel=atol)
        assert max_abs_diff(result["fsdp"], result["ddp"]) <= atol
    assert max_abs_diff(ours["fsdp"], theirs["fsdp"]) <= 1e-6


@pytest.mark.parametrize("raf", (True, False, 2))
def test_training_parity_with_ddp(runs, raf):
    for ours, theirs in cases(runs, "parity", raf):
        same_as_ddp(ours, theirs)


def test_cpu_offload_trains_on_the_host_as_pytorch(runs):
    for ours, theirs in cases(runs, "offload"):
        same_as_ddp(ours, theirs)
        assert ours["devices"] == theirs["devices"] == ["cpu"]


def test_pin_memory_without_an_accelerator_is_a_warning(runs):
    for ours, theirs in cases(runs, "pinned"):
        assert len(ours) == 1 and "has no effect without an accelerator" in ours[0]
        assert theirs.startswith("RuntimeError: Cannot access accelerator device")


def test_an_embedding_not_gathered_in_backward(runs):
    for ours, theirs in cases(runs, "embedding"):
        same_as_ddp(ours, theirs)
        # a step: root, embed, body forward; body backward (embed not; the root kept): 4
        assert ours["gathers"] == theirs["gathers"] == 3 * 4


def test_a_parameter_unused_on_one_rank_is_reduced_as_zeros(runs):
    for ours, theirs in cases(runs, "unused"):
        same_as_ddp(ours, theirs, atol=1e-6)


def test_reset_iter_state_after_a_failed_forward(runs):
    for ours, theirs in cases(runs, "reset"):
        for result in (ours, theirs):
            assert result["shards after reset"]
            assert max_abs_diff(result[True], result[False]) == 0.0


def test_gradient_divide_factor(runs):
    for ours, theirs in cases(runs, "factor"):
        assert ours["diff"] <= 1e-6
        assert theirs == "Cannot use ReduceOp.PREMUL_SUM with Gloo"


def test_setters_that_cannot_take_effect_say_so(runs):
    n, ranks = runs
    if n != 2:
        pytest.skip("run at N = 2")
    for rank in ranks:
        messages = rank["minizero", "no effect"]
        assert messages[0].startswith("set_post_optim_event has no effect")
        assert messages[1].startswith("set_reduce_scatter_divide_factor is deprecated")


@pytest.mark.parametrize("name, checkpointing", [("gpt2", False), ("llama", False),
                                                  ("lora", False), ("gpt2", True)])
def test_hugging_face_models(runs, name, checkpointing):
    for ours, theirs in cases(runs, "hf", name, checkpointing):
        assert max_abs_diff(ours["params"], theirs["params"]) <= 1e-6
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=1e-6)


def test_one_unit_with_uneven_and_even_rows(runs):
    for ours, theirs in cases(runs, "single group"):
        for shapes in ours:
            same_as_ddp(ours[shapes], theirs[shapes])


def test_a_tied_weight_with_a_padded_shard_trains_every_row(runs):
    for ours, theirs in cases(runs, "tied uneven"):
        same_as_ddp(ours, theirs)
        assert ours["rows trained"] == theirs["rows trained"] == ours["vocab"]


def test_a_tied_embedding_and_head_as_one_unit(runs):
    """One all-gather per forward and per backward for the group (not one per module), one
    reduce-scatter: per step the root (kept from forward to backward), the group and the two
    blocks forward, the group and the blocks again backward: 3 x 7 = 21 all-gathers, 3 x 4 = 12
    reduce-scatters (seen 23 when the head's forward, the group's second module, prefetched)."""
    for ours, theirs in cases(runs, "grouped tied"):
        same_as_ddp(ours, theirs)
        assert (ours["gathers"], ours["reductions"]) == (theirs["gathers"],
                                                          theirs["reductions"]) == (21, 12)


def test_a_unit_of_two_modules_whose_forward_skips_one(runs):
    """The forward leaves the grouped head out; it runs later per chunk, each chunk a backward of
    its own; the same losses and parameters as torch's, and as the model alone (averaged by
    hand)."""
    n, ranks = runs
    if ("minizero", "partial group") not in ranks[0]:
        pytest.skip(f"not run at N = {n}")
    for rank in ranks:
        ours, theirs, alone = (rank[k, "partial group"] for k in ("minizero", "torch", "alone"))
        assert ours["losses"] == pytest.approx(alone["losses"], rel=1e-6)
        assert max_abs_diff(ours["params"], alone["params"]) <= 1e-5
        assert max_abs_diff(ours["params"], theirs["params"]) <= 1e-6
        for result in (ours, theirs):
            assert result["head grad after two partial forwards"] is None
            assert result["norm grad"]


@pytest.mark.parametrize("spec", ACCUMULATION, ids=str)
def test_gradient_accumulation_without_sync_counts_its_collectives(runs, spec):
    mode, raf, rab = spec
    for ours, theirs in cases(runs, "accumulation", spec):
        expected = expected_counts(mode, raf, rab, hsdp=False, all_reduce_only_last=False)
        assert ours["counts"] == theirs["counts"] == [expected] * 3
        assert max(ours["grad diffs"]) <= 1e-6
        assert max_abs_diff(ours["fsdp"], theirs["fsdp"]) <= 1e-6


@pytest.mark.parametrize("only_last", (False, True))
def test_hsdp_gradient_accumulation(runs, only_last):
    for ours, theirs in cases(runs, "hsdp accumulation", only_last):
        expected = expected_counts("all", True, True, hsdp=True, all_reduce_only_last=only_last)
        assert ours["counts"] == theirs["counts"] == [expected] * 3
        assert max(ours["grad diffs"]) <= 1e-6
        assert max_abs_diff(ours["fsdp"], theirs["fsdp"]) <= 1e-6


def test_hsdp_training_parity_with_ddp(runs):
    for ours, theirs in cases(runs, "hsdp parity"):
        same_as_ddp(ours, theirs)


@pytest.mark.parametrize("after_init", (False, True))
@pytest.mark.parametrize("raf", (True, False))
def test_frozen_and_trainable_parameters_in_one_unit(runs, raf, after_init):
    for ours, theirs in cases(runs, "frozen per group", raf, after_init):
        same_as_ddp(ours, theirs)
        n = runs[0]
        biases = [2 * 8 + 1, 8]                  # each MLP's in_proj and out_proj bias
        padded = n * sum(-(-b // n) for b in biases)
        assert ours["reduce-scatter numels"] == [padded]   # the biases only, padded


@pytest.mark.parametrize("raf", (True, False))
def test_frozen_units_a_no_grad_step_and_unfreezing(runs, raf):
    for ours, theirs in cases(runs, "frozen across groups", raf):
        same_as_ddp(ours, theirs)


@pytest.mark.parametrize("raf", (True, False))
def test_units_called_several_times_in_one_forward(runs, raf):
    for ours, theirs in cases(runs, "multi forward", raf):
        same_as_ddp(ours, theirs)


@pytest.mark.parametrize("raf", (True, False))
def test_activation_checkpointing(runs, raf):
    for ours, theirs in cases(runs, "checkpointing", raf):
        same_as_ddp(ours, theirs)


@pytest.mark.parametrize("reduce_dtype", (None, torch.float32), ids=("bf16 reduce", "fp32 reduce"))
def test_mixed_precision(runs, reduce_dtype):
    for ours, theirs in cases(runs, "mixed precision", reduce_dtype):
        assert max_abs_diff(ours["fsdp"], theirs["fsdp"]) <= 5e-3
        assert ours["losses"] == pytest.approx(theirs["losses"], abs=5e-3)
        assert ours["inside block"] == theirs["inside block"] == (torch.bfloat16, torch.bfloat16)
        assert ours["param"] == theirs["param"] == {torch.float32}
        assert ours["logits"] == theirs["logits"] == (torch.float32 if reduce_dtype
                                                      else torch.bfloat16)
        assert ours["reduce dtypes"] == [str(reduce_dtype or torch.bfloat16)]


@pytest.mark.parametrize("norm_type", (2.0, 1.0, float("inf")))
def test_clip_grad_norm(runs, norm_type):
    for ours, theirs in cases(runs, "clip"):
        for result in (ours[norm_type], theirs[norm_type]):
            assert result["norm"] == pytest.approx(result["ddp norm"], rel=1e-5)
            assert result["grad diff"] <= 1e-6
        assert ours[norm_type]["norm"] == theirs[norm_type]["norm"]


def test_explicit_prefetching(runs):
    for ours, theirs in cases(runs, "prefetch"):
        same_as_ddp(ours, theirs)
        assert ours["prefetched"] > 0


def test_a_forward_through_a_unit_alone_after_one_through_the_root(runs):
    for ours, theirs in cases(runs, "non-root"):
        same_as_ddp(ours, theirs)
