"""FairScale's FSDP test scenarios (tests/nn/data_parallel/test_fsdp*.py and tests/nn/wrap, 0.4.13),
ported in minizero's own code onto minizero.FullyShardedDataParallel: FairScale's FSDP needs CUDA,
so its tests' expectations are the reference. Each scenario trains on N = 2 and 3 ranks and
compares with one process training the unwrapped model on the whole batch (what DDP computes), fp32
within 1e-5. One launch per N runs every scenario; a scenario that raises is reported, not fatal,
so the tally of scenarios passed can be taken on any version:
    PYTHONPATH=<checkout>:tests python tests/test_fairscale_scenarios.py
Run: python -m pytest tests/test_fairscale_scenarios.py -q"""

from __future__ import annotations

import contextlib
import copy
import math
import traceback
import warnings
from functools import partial

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import minizero
from minizero import comm
from minizero.zero3 import ShardState

FSDP = minizero.FullyShardedDataParallel
N = 2                                   # the tally's world size
WORLD_SIZES = (2, 3)                    # the tests': 3 divides no parameter count evenly
STEPS = 3
FP32 = 1e-5
# FairScale's tests train with SGD and momentum: Adam divides by the gradient's own size, so it
# amplifies the rounding of near-zero gradients (summed in another order here) past 1e-5.
MOMENTUM = partial(torch.optim.SGD, momentum=0.9)


def identity(module: nn.Module, **fsdp_kwargs) -> nn.Module:
    return module


class Nested(nn.Module):
    """FairScale's NestedWrappedModule: FSDP instances two deep inside the model."""

    def __init__(self, wrapped=identity):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.Sequential(
            nn.Linear(8, 4),
            wrapped(nn.Sequential(wrapped(nn.Linear(4, 16)), nn.Linear(16, 16))),
            wrapped(nn.Linear(16, 4)),
            nn.Linear(4, 8),
        )

    def forward(self, x):
        return self.layers(x)


class SharedTransformer(nn.Module):
    """FairScale's TransformerWithSharedParams in small: the embedding tied to the output layer, a
    buffer, transformer layers (wrapped or not)."""
    VOCAB, WIDTH = 13, 8

    def __init__(self, wrapped=identity):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(self.VOCAB, self.WIDTH)
        self.blocks = nn.ModuleList([wrapped(nn.TransformerEncoderLayer(
            self.WIDTH, 2, 16, dropout=0.0, batch_first=True)) for _ in range(2)])
        self.head = nn.Linear(self.WIDTH, self.VOCAB, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("vocab_bias", torch.linspace(0, 1, self.VOCAB))

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        return self.head(h) + self.vocab_bias


def sequential() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8))


# --- data, one step, and the one-process reference ------------------------------------------------
def float_batches(steps: int = STEPS, rows: int | None = None):
    rows = rows or 2 * comm.world_size()                     # two rows a rank
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(rows, 8, generator=g), torch.randn(rows, 8, generator=g))
            for _ in range(steps)]


def token_batches(steps: int = STEPS, rows: int | None = None):
    rows = rows or 2 * comm.world_size()
    g = torch.Generator().manual_seed(1)
    v = SharedTransformer.VOCAB
    return [(torch.randint(v, (rows, 5), generator=g), torch.randint(v, (rows, 5), generator=g))
            for _ in range(steps)]


def loss_of(model, x, y):
    out = model(x)
    if y.dtype == torch.long:
        return F.cross_entropy(out.float().reshape(-1, out.shape[-1]), y.reshape(-1))
    return F.mse_loss(out.float(), y)


def mine(t: torch.Tensor) -> torch.Tensor:
    return t.chunk(comm.world_size())[comm.rank()]          # this rank's rows of the batch


def train(model, optimizer, batches, local: bool, after_backward=None) -> list[float]:
    losses = []
    for step, (x, y) in enumerate(batches):
        if local:
            x, y = mine(x), mine(y)
        loss = loss_of(model, x, y)
        loss.backward()
        if after_backward is not None:
            after_backward(step)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def diff(a: dict, b: dict) -> float:
    """Largest difference between two state dicts (inf if their keys differ)."""
    if a.keys() != b.keys():
        return math.inf
    return max((a[k].double() - b[k].double().to(a[k].device)).abs().max().item() for k in a)


def compare(build, wrap, batches, optimizer=torch.optim.SGD, lr=0.1, **wrap_kwargs) -> dict:
    """Train wrap(build(FSDP)) on this rank's rows and build() on the whole batch: final diff."""
    model = FSDP(build(wrap), **wrap_kwargs) if wrap is not None else FSDP(build(), **wrap_kwargs)
    reference = build()
    train(model, optimizer(model.parameters(), lr=lr), batches, local=True)
    train(reference, optimizer(reference.parameters(), lr=lr), batches, local=False)
    return {"diff": diff(model.state_dict(), reference.state_dict()), "model": model}


def nested_fsdp(module):
    return FSDP(module)


# --- the scenarios --------------------------------------------------------------------------------
def root_without_parameters() -> dict:
    """test_fsdp.py's FSDP(nn.Sequential): the root owns no parameter, its children do."""
    model = FSDP(sequential())
    loss_of(model, *float_batches(1)[0]).backward()
    grads = [p.grad is not None for p in model.parameters()]
    return {"every flat parameter has a gradient": all(grads),
            "matches one process": compare(sequential, None, float_batches())["diff"] <= FP32}


def nested() -> dict:
    """test_fsdp.py's NestedWrappedModule: inner FSDPs are units; state_dict has every parameter
    under the unwrapped model's names."""
    run = compare(lambda wrapped=identity: Nested(wrapped), nested_fsdp, float_batches(),
                  optimizer=MOMENTUM, lr=0.1)
    model = run["model"]
    return {"matches one process": run["diff"] <= FP32,
            "one flat parameter per instance that trains": len(list(model.parameters())) == 4,
            "inner instances are FSDP": isinstance(model.module.layers[2], FSDP),
            "modules() reaches them": sum(isinstance(m, FSDP) for m in model.modules()) == 4,
            "print(model) shows the wrapping": repr(model).count("FullyShardedDataParallel") == 4}


def transformer_shared_params() -> dict:
    """test_fsdp.py's TransformerWithSharedParams: tied embedding and head, a buffer, each layer an
    inner FSDP; SGD with momentum, as FairScale's (Adam would amplify rounding noise: the key
    projection's bias has a gradient of exactly zero, softmax being blind to it)."""
    run = compare(lambda wrapped=identity: SharedTransformer(wrapped), nested_fsdp,
                  token_batches(), optimizer=MOMENTUM, lr=0.1)
    return {"matches one process": run["diff"] <= FP32}


def wrap_helpers() -> dict:
    """tests/nn/wrap: wrap() only inside enable_wrap(); auto_wrap by size; the root adopts them."""
    from minizero.fairscale.fsdp_wrap import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap
    plain = nn.Linear(5, 5)
    checks = {"wrap outside enable_wrap is the module": wrap(plain) is plain}
    policy = partial(default_auto_wrap_policy, min_num_params=200)

    def build(wrapped=None):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Sequential(nn.Linear(32, 32),
                                                                          nn.ReLU()),
                              nn.Linear(32, 8))
        if wrapped is None:
            return model
        with enable_wrap(wrapper_cls=FSDP):
            checks["wrap inside is FSDP"] = isinstance(wrap(nn.Linear(2, 2)), FSDP)
            model = auto_wrap(model, auto_wrap_policy=policy)
        checks["auto_wrap picked the big leaves"] = [
            isinstance(m, FSDP) for m in (model[0], model[2], model[2][0], model[3])] == [
            True, False, True, True]
        return model

    checks["matches one process"] = compare(build, True, float_batches())["diff"] <= FP32
    return checks


def accumulation(no_sync: bool) -> dict:
    """test_fsdp_no_sync.py / test_fsdp_grad_acc.py: two micro-batches per step, the first inside
    no_sync() (or not): the step sees their sum, as one process does."""
    model, reference = FSDP(Nested(nested_fsdp)), Nested()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for x, y in float_batches():
        halves = list(zip(x.chunk(2), y.chunk(2)))
        with model.no_sync() if no_sync else contextlib.nullcontext():
            loss_of(model, mine(halves[0][0]), mine(halves[0][1])).backward()
        loss_of(model, mine(halves[1][0]), mine(halves[1][1])).backward()
        optimizer.step()
        optimizer.zero_grad()
        for hx, hy in halves:
            loss_of(reference, hx, hy).backward()
        ref_optimizer.step()
        ref_optimizer.zero_grad()
    checks = {"matches one process": diff(model.state_dict(), reference.state_dict()) <= FP32}
    # test_fsdp_grad_acc: model.zero_grad(), then the gradients of a batch at once ...
    (x, y), = float_batches(1, rows=4 * comm.world_size())
    model.zero_grad()
    loss_of(model, mine(x), mine(y)).backward()
    at_once = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()                          # ... equal their sum, accumulated (halves' losses)
    halves = [(mine(x)[i::2], mine(y)[i::2]) for i in range(2)]
    with model.no_sync() if no_sync else contextlib.nullcontext():
        (loss_of(model, *halves[0]) / 2).backward()
    (loss_of(model, *halves[1]) / 2).backward()
    checks["zero_grad, then the same gradients"] = all(
        torch.allclose(a, p.grad, atol=1e-6) for a, p in zip(at_once, model.parameters()))
    return checks


def clip_grad_norm() -> dict:
    """test_fsdp.py's clipping: clip_grad_norm_(max_norm, norm_type) for 2, 1, 3 and inf returns the
    whole model's norm and clips as torch.nn.utils.clip_grad_norm_ does on one process."""
    norm_types = [2.0, 1.0, 3.0, math.inf]
    model, reference = FSDP(Nested(nested_fsdp)), Nested()
    norms, ref_norms = [], []
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), float_batches(4), local=True,
          after_backward=lambda s: norms.append(model.clip_grad_norm_(0.05, norm_types[s])))
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), float_batches(4),
          local=False, after_backward=lambda s: ref_norms.append(
              nn.utils.clip_grad_norm_(reference.parameters(), 0.05, norm_types[s])))
    return {"norms match": all(abs(float(a) - float(b)) <= FP32 for a, b in zip(norms, ref_norms)),
            "matches one process": diff(model.state_dict(), reference.state_dict()) <= FP32}


def summon_full_params() -> dict:
    """test_fsdp_summon_full_params.py: inside, full parameters under their own names; writes
    persist (volatile=False); recurse=False gathers only the instance's own."""
    model, reference = FSDP(Nested(nested_fsdp)), Nested()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), float_batches(1), local=True)
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), float_batches(1),
          local=False)
    with model.summon_full_params():
        named = dict(model.named_parameters())
        checks = {"original names": list(named) == [n for n, _ in reference.named_parameters()],
                  "full values": max((named[n] - p).abs().max().item()
                                     for n, p in reference.named_parameters()) <= FP32}
        with torch.no_grad():
            named["layers.2.weight"].mul_(0.5)
    with torch.no_grad():
        reference.layers[2].weight.mul_(0.5)
    checks["a write persists"] = diff(model.state_dict(), reference.state_dict()) <= FP32
    with model.summon_full_params(recurse=False):
        checks["recurse=False: the root's own"] = (
            not model.module.layers[0].weight.isnan().any().item()
            and model.module.layers[2].weight.isnan().all().item())
    outside = model.state_dict()
    with model.summon_full_params(volatile=True):
        checks["state_dict inside it"] = diff(model.state_dict(), outside) == 0.0
    checks["every unit freed after it"] = all(u.state is ShardState.FREE
                                              for u in model.engine.units)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), float_batches(), local=True)
    train(reference, torch.optim.SGD(reference.parameters(), lr=0.1), float_batches(),
          local=False)
    checks["trains on from the write"] = diff(model.state_dict(), reference.state_dict()) <= FP32
    return checks


def state_dicts() -> dict:
    """test_fsdp_state_dict.py: full state dict with the unwrapped names (buffers too), loaded into
    a model built from other weights; rank 0 only; local state dict round trip."""
    model = FSDP(SharedTransformer(nested_fsdp))
    train(model, torch.optim.Adam(model.parameters(), lr=0.01), token_batches(), local=True)
    full = model.state_dict()
    torch.manual_seed(5)
    other = FSDP(SharedTransformer(nested_fsdp))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    other.load_state_dict(full)
    checks = {"unwrapped names": list(full) == list(SharedTransformer().state_dict()),
              "loaded": diff(other.state_dict(), full) == 0.0}
    rank0 = FSDP(Nested(), state_dict_on_rank_0_only=True).state_dict()
    checks["rank 0 only"] = (len(rank0) > 0) == (comm.rank() == 0)
    local = model.local_state_dict()
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1), local=True)
    model.load_local_state_dict(local)
    checks["local round trip"] = diff(model.state_dict(), full) == 0.0
    return checks


class WithUnused(nn.Module):
    """test_fsdp_optimizer_utils.py's ModelWithUnusedParams: a frozen inner FSDP used without
    autograd, optionally a wrapped layer after it."""

    def __init__(self, wrap_last: bool):
        super().__init__()
        torch.manual_seed(0)
        self.first = nn.Linear(4, 4)
        self.not_trained = FSDP(nn.Linear(4, 4).requires_grad_(False))
        self.last = FSDP(nn.Linear(4, 4)) if wrap_last else nn.Linear(4, 4)

    def forward(self, x):
        with torch.no_grad():
            y = self.not_trained(x)
        return self.last(self.first(x)) - y


def optimizer_state() -> dict:
    """test_fsdp_optimizer_utils.py: gather_full_optim_state_dict is what the unwrapped model's Adam
    holds; get_shard_from_optim_state_dict resumes it exactly."""
    model, reference = FSDP(Nested(nested_fsdp)), Nested()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    ref_optimizer = torch.optim.Adam(reference.parameters(), lr=0.01)
    batches = float_batches(STEPS + 1)
    train(model, optimizer, batches[:STEPS], local=True)
    train(reference, ref_optimizer, batches[:STEPS], local=False)
    full = model.gather_full_optim_state_dict(optimizer)
    expected = ref_optimizer.state_dict()
    checks = {"rank 0 only": (full is None) == (comm.rank() != 0)}
    box = [full]
    dist.broadcast_object_list(box, src=0)
    full = box[0]
    checks["same entries"] = full["state"].keys() == expected["state"].keys()
    checks["same values"] = all(
        (torch.as_tensor(full["state"][i][k]).double()
         - torch.as_tensor(v).double()).abs().max().item() <= FP32
        for i, s in expected["state"].items() for k, v in s.items())
    resumed = FSDP(Nested(nested_fsdp))
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer = torch.optim.Adam(resumed.parameters(), lr=0.01)
    shard = resumed.get_shard_from_optim_state_dict(copy.deepcopy(full))
    own = optimizer.state_dict()
    checks["the shard is what the optimizer holds"] = shard.keys() == own.keys() and list(
        shard["param_groups"][0].items()) == list(own["param_groups"][0].items()) and all(
        torch.equal(torch.as_tensor(shard["state"][i][k]), torch.as_tensor(v))
        for i, s in own["state"].items() for k, v in s.items())
    resumed_optimizer.load_state_dict(shard)
    for wrap_last in (False, True):            # test_model_with_unused_params
        unused = FSDP(WithUnused(wrap_last))
        sgd = torch.optim.SGD(unused.parameters(), lr=0.1, momentum=0.9)
        unused(torch.rand(4)).sum().backward()
        sgd.step()
        unused.zero_grad(set_to_none=True)
        gathered = unused.gather_full_optim_state_dict(sgd)
        if comm.rank() == 0:
            shard, own = unused.get_shard_from_optim_state_dict(gathered), sgd.state_dict()
            checks[f"unused parameters, last wrapped={wrap_last}"] = shard.keys() == own.keys() \
                and all(torch.equal(shard["state"][i]["momentum_buffer"], s["momentum_buffer"])
                        for i, s in own["state"].items())
    train(resumed, resumed_optimizer, batches[STEPS:], local=True)
    train(model, optimizer, batches[STEPS:], local=True)      # the run not interrupted
    checks["resumes exactly"] = diff(resumed.state_dict(), model.state_dict()) == 0.0
    return checks


def uneven_and_shared() -> dict:
    """test_fsdp_uneven.py and test_fsdp_shared_weights.py: parameters smaller than N or not
    divisible by it; one weight used by two layers in different inner FSDPs."""
    def tiny(wrapped=identity):
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 1), wrapped(nn.Linear(1, 3)), nn.Linear(3, 8))

    def shared(wrapped=identity):
        torch.manual_seed(0)
        first, second = nn.Linear(8, 8), nn.Linear(8, 8)
        second.weight = first.weight
        return nn.Sequential(wrapped(first), nn.Tanh(), wrapped(second))

    return {"uneven": compare(tiny, nested_fsdp, float_batches())["diff"] <= FP32,
            "shared across inner FSDPs": compare(shared, nested_fsdp, float_batches(),
                                                 optimizer=MOMENTUM)["diff"]
            <= FP32}


def multiple_forward() -> dict:
    """test_fsdp_multiple_forward.py: two forwards, one backward."""
    model, reference = FSDP(Nested(nested_fsdp)), Nested()
    for m in (model, reference):
        (x, y), = float_batches(1)
        if m is model:
            x, y = mine(x), mine(y)
        (loss_of(m, x, y) + loss_of(m, x * 2, y)).backward()
        torch.optim.SGD(m.parameters(), lr=0.1).step()
    return {"matches one process": diff(model.state_dict(), reference.state_dict()) <= FP32}


def mixed_precision() -> dict:
    """test_fsdp.py's mixed_precision=True: fp16 compute, fp32 masters taken from the fp32 model,
    float inputs cast; fp32_reduce_scatter; bfloat16 compute. Tracks fp32 within 16-bit rounding."""
    checks = {}
    for name, kwargs in {"fp16": {}, "fp16, fp32 reduce": {"fp32_reduce_scatter": True},
                         "bf16": {"compute_dtype": torch.bfloat16}}.items():
        def inner(module, kwargs=kwargs):
            return FSDP(module, mixed_precision=True, **kwargs)
        model = FSDP(Nested(inner), mixed_precision=True, **kwargs)
        out = model(torch.randn(2, 8))
        checks[f"{name}: computes in 16 bits"] = out.dtype != torch.float32
        checks[f"{name}: fp32 masters"] = all(p.dtype == torch.float32
                                              for p in model.parameters())
        checks[f"{name}: masters start exact"] = diff(model.state_dict(),
                                                      Nested().state_dict()) == 0.0
        with model.summon_full_params():               # FairScale's: in full precision
            checks[f"{name}: summoned in fp32"] = all(
                p.dtype == torch.float32 for p in model.module.parameters())
            with torch.no_grad():
                model.module.layers[0].weight.add_(1e-4)  # below fp16's step near 1: fp32 keeps it
        expected = Nested().state_dict()
        expected["layers.0.weight"] += 1e-4
        checks[f"{name}: an fp32 write persists"] = diff(model.state_dict(), expected) <= 1e-7
        run = compare(lambda wrapped=identity: Nested(wrapped), inner, float_batches(),
                      mixed_precision=True, **kwargs)
        checks[f"{name}: tracks fp32"] = run["diff"] <= 2e-2
    return checks


def constructor_keywords() -> dict:
    """FairScale's constructor: the process group positionally, every keyword implemented or one
    line."""
    checks = {"process group positional": compare(
        sequential, None, float_batches(), process_group=dist.group.WORLD)["diff"] <= FP32}
    accepted = dict(flatten_parameters=True, move_params_to_cpu=True, cpu_offload=True,
                    move_grads_to_cpu=True, compute_dtype=torch.float32,
                    buffer_dtype=torch.float32, reshard_after_forward=False,
                    disable_reshard_on_root=False, compute_device="cpu",
                    force_input_to_fp32=True, verbose=True, state_dict_device="cpu")
    run = compare(sequential, None, float_batches(), **accepted)
    checks["accepted keywords train"] = run["diff"] <= FP32
    checks["verbose repr"] = "compute_dtype=fp32" in repr(run["model"])
    refused = dict(fp32_reduce_scatter=True,
                   no_broadcast_optim_state=True,
                   compute_dtype=torch.float16, buffer_dtype=torch.float16)
    for key, value in refused.items():
        try:
            FSDP(sequential(), **{key: value})
            checks[f"{key}={value} refused"] = False
        except (ValueError, TypeError) as e:
            checks[f"{key}={value} refused in one line"] = "\n" not in str(e)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        FSDP(sequential(), bucket_cap_mb=10, flatten_parameters=False)
    checks["bucket_cap_mb, flatten_parameters=False: a warning line each"] = [
        str(w.message).count("\n") for w in caught] == [0, 0]
    model = FSDP(sequential(), force_input_to_fp32=True)
    checks["force_input_to_fp32"] = model(torch.randn(2, 8).half()).dtype == torch.float32
    return checks


def inputs_and_passes() -> dict:
    """test_fsdp_input.py (a list or a dict as input, mixed precision too),
    test_fsdp_fwd_fwd_bwd_bwd.py (three forwards, then their backwards, the first two in no_sync:
    pure fp16, the model converted first) and an eval forward without autograd."""
    class Boxed(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(8, 8)

        def forward(self, box):
            return self.layer(box[0] if isinstance(box, list) else box["in"])

    checks = {}
    for mixed in (False, True):
        model, reference = FSDP(Boxed(), mixed_precision=mixed), Boxed()
        for m in (model, reference):
            optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
            for i, (x, y) in enumerate(float_batches()):
                x, y = (mine(x), mine(y)) if m is model else (x, y)
                loss_of(m, [x] if i % 2 else {"in": x}, y).backward()
                optimizer.step()
                optimizer.zero_grad()
        checks[f"list and dict inputs, mixed={mixed}"] = diff(
            model.state_dict(), reference.state_dict()) <= (2e-2 if mixed else FP32)
    half = FSDP(sequential().half(), compute_dtype=torch.float16)
    reference = sequential().half()
    batches = [mine(x).half() for x, _ in float_batches()]
    losses = [half(x).float().sum() for x in batches]
    with half.no_sync():
        losses[0].backward()
        losses[1].backward()
    losses[2].backward()
    sum(reference(x).float().sum() for x in batches).backward()
    grads = torch.cat([p.grad.float() for p in half.parameters()])
    checks["fwd fwd fwd, bwd bwd bwd, pure fp16"] = grads.dtype == torch.float32 and all(
        p.dtype == torch.float16 for p in half.parameters())
    model = FSDP(Nested(nested_fsdp))
    model.eval()
    with torch.no_grad():
        out = model(torch.ones(2, 8))
    checks["eval without autograd frees every unit"] = all(
        u.state is ShardState.FREE for u in model.engine.units)
    checks["eval output"] = (out - Nested().eval()(torch.ones(2, 8))).abs().max().item() <= FP32
    return checks


def wrapping_again_and_apply() -> dict:
    """test_fsdp_multiple_wrapping.py (a trained model wrapped again for inference) and
    test_fsdp_apply.py (model.apply(init) on the wrapped model writes every module's parameters).
    """
    inner_model = Nested(nested_fsdp)
    model = FSDP(inner_model)
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), float_batches(), local=True)
    x = torch.ones(2, 8)
    with torch.no_grad():
        before = model(x)
        again = FSDP(inner_model)
        checks = {"same output wrapped again": torch.allclose(before, again(x), atol=FP32),
                  "the first wrapper still runs": torch.allclose(before, model(x), atol=FP32)}
        del model, again                           # a wrapper nobody holds: its engine hands over
        checks["wrapped a third time"] = torch.allclose(before, FSDP(inner_model)(x), atol=FP32)

    def init(module):
        if isinstance(module, nn.Linear):
            with torch.no_grad():
                module.weight.fill_(0.01)
                module.bias.zero_()

    model, reference = FSDP(Nested(nested_fsdp)), Nested()
    checks["apply returns the wrapper"] = model.apply(init) is model
    reference.apply(init)
    checks["apply wrote every parameter"] = diff(model.state_dict(), reference.state_dict()) == 0
    try:
        model.half()
        checks["half() after wrapping refused"] = False
    except ValueError as e:
        checks["half() after wrapping refused in one line"] = "\n" not in str(e)
    return checks


def frozen_and_checkpointed() -> dict:
    """test_fsdp_freezing_weights.py (the root's own head frozen, the trunk an inner FSDP) and
    test_fsdp_with_checkpoint_wrapper.py (activation checkpointing inside a unit and around one,
    with torch.utils.checkpoint and FairScale's checkpoint_wrapper)."""
    from torch.utils.checkpoint import checkpoint

    class Frozen(nn.Module):
        def __init__(self, wrapped=identity):
            super().__init__()
            torch.manual_seed(0)
            self.trunk = wrapped(nn.Sequential(nn.Linear(8, 16), nn.ReLU()))
            self.head = nn.Linear(16, 8)
            self.head.requires_grad_(False)

        def forward(self, x):
            return self.head(self.trunk(x))

    class Recomputed(nn.Module):
        def __init__(self, inside, reentrant):
            super().__init__()
            self.inside, self.reentrant = inside, reentrant

        def forward(self, x):
            return checkpoint(self.inside, x, use_reentrant=self.reentrant)

    checks = {"frozen head": compare(Frozen, nested_fsdp, float_batches(),
                                     optimizer=MOMENTUM)["diff"]
              <= FP32}
    for reentrant in (False, True):
        def around(module, reentrant=reentrant):
            return Recomputed(FSDP(module), reentrant)         # checkpoint(FSDP(...))

        def inside(module, reentrant=reentrant):
            return FSDP(Recomputed(module, reentrant))         # FSDP(checkpoint(...))
        plain = partial(Recomputed, reentrant=reentrant)         # the reference's, same names
        for name, wrapped in (("around", around), ("inside", inside)):
            checks[f"checkpoint {name} a unit, reentrant={reentrant}"] = compare(
                lambda w=plain: Nested(w), wrapped, float_batches())["diff"] <= FP32
    try:
        from fairscale.nn.checkpoint import checkpoint_wrapper
    except ImportError:                        # FairScale absent: its wrapper is not tried
        return checks
    checks["fairscale checkpoint_wrapper"] = compare(
        lambda w=identity: Nested(w), lambda m: FSDP(checkpoint_wrapper(m)),
        float_batches())["diff"] <= FP32
    return checks


class DtypeRecorder(nn.Module):
    """FairScale's DeviceAndTypeCheckModule in small: records the dtypes its forward sees."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(8, 8)
        self.register_buffer("offset", torch.full((8,), 0.5))
        self.seen = {}

    def forward(self, x):
        self.seen = {"input": x.dtype, "param": self.linear.weight.dtype,
                     "buffer": self.offset.dtype}
        return self.linear(x) + self.offset


def module_properties() -> dict:
    """test_fsdp.py's TestModuleProperties, TestParamInit, TestNoGrad, TestResetParameters and
    TestMixedPrecision: FlatParameter names, original names and shapes inside summon_full_params, a
    FlatParameter changed after wrapping reaches the next forward, eval with and without autograd
    agree, reset_parameters, and the dtypes each configuration computes with."""
    model = FSDP(SharedTransformer(nested_fsdp))
    checks = {"flat_param_0": "flat_param_0" in next(iter(model.named_parameters()))[0],
              "FairScale's attributes": (model.mixed_precision, model.world_size) == (
                  False, comm.world_size())}
    train(model, torch.optim.SGD(model.parameters(), lr=0.1), token_batches(1), local=True)
    model.assert_state("IDLE")
    with model.summon_full_params():
        checks["names and shapes inside summon"] = [
            (n, p.shape) for n, p in model.named_parameters()] == [
            (n, p.shape) for n, p in SharedTransformer().named_parameters()]
    model.eval()
    tokens = token_batches(1)[0][0]
    with_grad = model(tokens)
    with torch.no_grad():
        checks["eval: no_grad output equal"] = torch.allclose(with_grad, model(tokens), atol=FP32)
    mixed = FSDP(Nested(), mixed_precision=True)
    before = mixed(torch.ones(2, 8))
    with torch.no_grad():
        nn.init.normal_(next(mixed.parameters()).data)
    after = mixed(torch.ones(2, 8))
    checks["a FlatParameter changed after wrapping"] = not torch.equal(before, after)
    resettable = FSDP(nn.Linear(8, 8), allow_reset_parameters=True)
    reference = nn.Linear(8, 8)
    torch.manual_seed(3)
    resettable.reset_parameters()
    torch.manual_seed(3)
    reference.reset_parameters()
    checks["reset_parameters"] = diff(resettable.state_dict(), reference.state_dict()) == 0.0
    expected = {  # config -> (input, param, buffer) dtypes the module computes with
        "fp32": ({}, (torch.float32,) * 3),
        "mixed": ({"mixed_precision": True}, (torch.float16,) * 3),
        "mixed, fp32 buffers": ({"mixed_precision": True, "buffer_dtype": torch.float32},
                                (torch.float16, torch.float16, torch.float32)),
        "mixed, fp32 compute": ({"mixed_precision": True, "compute_dtype": torch.float32},
                                (torch.float16, torch.float32, torch.float32))}
    for name, (config, dtypes) in expected.items():
        recorder = DtypeRecorder()
        wrapped = FSDP(recorder, **config)
        with torch.autocast("cpu", dtype=torch.float16, enabled=name == "mixed, fp32 compute"):
            loss = wrapped(torch.rand(2, 8)).float().sum()
        loss.backward()
        seen = recorder.seen
        checks[f"dtypes: {name}"] = (seen["input"], seen["param"], seen["buffer"]) == dtypes
        checks[f"fp32 state_dict: {name}"] = all(
            v.dtype == torch.float32 for v in wrapped.state_dict().values())
    return checks


class Convolutional(nn.Module):
    """test_fsdp_metadata.py's ConvolutionalModel in small: batch norms, inner FSDPs (two with
    flatten_parameters=False), a frozen layer."""

    def __init__(self, wrapped=identity):
        super().__init__()
        torch.manual_seed(0)

        def block(cin, cout):
            return nn.Sequential(nn.Conv2d(cin, cout, 3), nn.BatchNorm2d(cout), nn.ReLU())
        self.conv1, self.conv2 = block(3, 4), wrapped(block(4, 2))
        self.conv3 = wrapped(block(2, 4), flatten_parameters=False)
        self.fc1, self.fc2 = wrapped(nn.Linear(4, 6)), nn.Linear(6, 5)
        self.fc3 = wrapped(nn.Linear(5, 4), flatten_parameters=False)
        self.fc2.requires_grad_(False)

    def forward(self, x):
        x = self.conv3(self.conv2(self.conv1(x))).mean(dim=(2, 3))
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def metadata() -> dict:
    """test_fsdp_metadata.py: every rank's local_state_dict() and local_metadata_dict() consolidate
    into the full state dict without a process group, loadable into a wrapped model."""
    def wrapped(module, **kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")            # flatten_parameters=False: speed only
            return FSDP(module, **kwargs)
    model = FSDP(Convolutional(wrapped))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(2)
    for _ in range(2):
        x, y = torch.randn(2 * comm.world_size(), 3, 8, 8, generator=g), torch.zeros(
            2 * comm.world_size(), 4)
        loss_of(model, mine(x), mine(y)).backward()
        optimizer.step()
        optimizer.zero_grad()
    mine_ = {"weights": model.local_state_dict(), "meta": model.local_metadata_dict()}
    everyone = [None] * comm.world_size()
    dist.all_gather_object(everyone, mine_)
    full = FSDP.consolidate_shard_weights([c["weights"] for c in everyone],
                                          [c["meta"] for c in everyone])
    expected = model.state_dict()
    plain = Convolutional().state_dict()
    loaded = FSDP(Convolutional(wrapped))
    loaded.load_state_dict(full)
    params = [n for n, _ in Convolutional().named_parameters(remove_duplicate=False)]
    return {"the unwrapped model's keys and shapes": {k: v.shape for k, v in full.items()} == {
                k: v.shape for k, v in plain.items()},
            # parameters: the model's; buffers (batch-norm statistics, not synchronised): rank 0's
            "the model's parameters": diff({k: full[k] for k in params},
                                           {k: expected[k] for k in params}) == 0.0,
            "loads into a wrapped model": diff(loaded.state_dict(), full) == 0.0}


def docstring_loops() -> dict:
    """FairScale's FSDP docstring, scaled down: the plain loop (keyword inputs), and enable_wrap
    with mixed precision: wrap() gives an FSDP, auto_wrap(nn.Transformer) wraps its encoder and
    decoder, each then a root of its own that trains."""
    from minizero.fairscale.fsdp_wrap import auto_wrap, default_auto_wrap_policy, enable_wrap, wrap

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(8, 8)

        def forward(self, x, y=0, z=None):
            return self.layer(x) * y + z

    model, reference = FSDP(Keywords()), Keywords()
    for m in (model, reference):
        optimizer = torch.optim.Adam(m.parameters(), lr=0.01)
        x = torch.ones(2 * comm.world_size(), 8)
        m(mine(x) if m is model else x, y=3, z=torch.Tensor([1])).sum().backward()
        optimizer.step()
    checks = {"the plain loop": diff(model.state_dict(), reference.state_dict()) <= FP32}
    with enable_wrap(wrapper_cls=FSDP, mixed_precision=True, flatten_parameters=True):
        checks["wrap() is FSDP"] = isinstance(wrap(nn.Linear(5, 5)), FSDP)
        torch.manual_seed(0)
        big = nn.Transformer(d_model=8, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                             dim_feedforward=16, dropout=0.0)
        half = sum(p.numel() for p in big.parameters()) // 3
        big = auto_wrap(big, partial(default_auto_wrap_policy, min_num_params=half))
    checks["encoder and decoder wrapped"] = isinstance(big.encoder, FSDP) and isinstance(
        big.decoder, FSDP) and "FullyShardedDataParallel" in repr(big)
    big(torch.rand(5, 2, 8), torch.rand(4, 2, 8)).float().sum().backward()
    checks["both roots have gradients"] = all(
        p.grad is not None for p in [*big.encoder.parameters(), *big.decoder.parameters()])
    return checks


SCENARIOS = [root_without_parameters, nested, transformer_shared_params, wrap_helpers,
             lambda: accumulation(no_sync=True), lambda: accumulation(no_sync=False),
             clip_grad_norm, summon_full_params, state_dicts, optimizer_state, uneven_and_shared,
             multiple_forward, mixed_precision, constructor_keywords, inputs_and_passes,
             wrapping_again_and_apply, frozen_and_checkpointed, module_properties, metadata,
             docstring_loops]
NAMES = ["root_without_parameters", "nested", "transformer_shared_params", "wrap_helpers",
         "no_sync", "grad_accumulation", "clip_grad_norm", "summon_full_params", "state_dicts",
         "optimizer_state", "uneven_and_shared", "multiple_forward", "mixed_precision",
         "constructor_keywords", "inputs_and_passes", "wrapping_again_and_apply",
         "frozen_and_checkpointed", "module_properties", "metadata", "docstring_loops"]


def worker() -> dict:
    """Every scenario on this rank: name -> its checks, or the error it raised (one line)."""
    out = {}
    for name, scenario in zip(NAMES, SCENARIOS):
        try:
            out[name] = {k: bool(v) for k, v in scenario().items()}
        except Exception as e:                     # noqa: BLE001 - reported per scenario
            out[name] = {"raised": False, "error": f"{type(e).__name__}: {e}".splitlines()[0],
                         "where": traceback.format_exc().splitlines()[-3].strip()}
    return out


@pytest.fixture(scope="module")
def results():
    return {n: minizero.launch(worker, n, timeout=300) for n in WORLD_SIZES}


@pytest.mark.parametrize("n", WORLD_SIZES)
@pytest.mark.parametrize("name", NAMES)
def test_scenario(results, name, n):
    for rank, r in enumerate(results[n]):
        failed = {k: v for k, v in r[name].items() if v is not True}
        assert not failed, (rank, name, failed)


if __name__ == "__main__":                            # the tally, on whichever minizero is imported
    per_rank = minizero.launch(worker, N, timeout=300)
    passed = [n for n in NAMES if all(all(v is True for v in r[n].values()) for r in per_rank)]
    for n in NAMES:
        print(("pass " if n in passed else "FAIL ") + n,
              {k: v for k, v in per_rank[0][n].items() if v is not True})
    print(f"{len(passed)} of {len(NAMES)} scenarios pass")
