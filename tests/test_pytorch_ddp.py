"""minizero.DistributedDataParallel against torch's DistributedDataParallel and one process, on the
same data: PyTorch's own DDP scenarios, ported.

    python -m pytest tests/test_pytorch_ddp.py

Each scenario trains the same model three ways with the user's own loop and optimizer: one process
on the global batch, minizero's DDP and torch's DDP on N gloo ranks (both in the same launch). The
scenarios follow torch's tests (test/distributed/test_c10d_common.py, test_c10d_gloo.py and
torch/testing/_internal/distributed/distributed_test.py): parity over several steps with
zero_grad() between them, gradient accumulation in no_sync(), globally and locally unused
parameters, buffers broadcast (or not) from rank 0, activation checkpointing with static_graph,
outputs that get no backward, state dicts, a process group of some ranks. One launch per world size
(N = 2 and 3) runs them all.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZeRO
from torch.nn.parallel import DistributedDataParallel as TorchDDP
from torch.utils.checkpoint import checkpoint

from _checks import each_rank, launch_per_world_size
import minizero
import pytest
from minizero import comm
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import GPTConfig, make_model
from minizero.lab.record import recorded
from minizero.lab.reference import max_abs_diff
from minizero.lab.train import loss_fn

WORLD_SIZES = (2, 3)
ROWS, STEPS = 12, 3                       # 12 rows split evenly over 2 and 3 ranks
# fp32: SGD is linear in the gradient (a wrong average shows at once); AdamW divides by the
# gradient's own size and amplifies rounding of near-zero gradients (tests/_checks.py's ATOL)
SGD_ATOL, ADAMW_ATOL = 1e-5, 5e-5
# minizero's DDP and torch's on the same data: torch multiplies each gradient by 1/N and sums, gloo
# averages (sums, then divides): equal at N = 2, a rounding apart at N = 3, which AdamW amplifies
TORCH_ATOL = 1e-6


def sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def gpt() -> nn.Module:
    return make_model(GPTConfig.named("tiny"), seed=0)     # tied weights, a causal-mask buffer


def gpt_batch(step: int, rank: int | None = None, micro: int = 0, micros: int = 1):
    """The global batch of `step` (rank None: one process), or this rank's rows of a micro-batch."""
    x, y = global_batch(step, ROWS, GPTConfig.named("tiny").block_size)
    if rank is None:
        return x, y
    return local_batch(x, y, rank, comm.world_size(), micro, micros)


def state(module: nn.Module) -> dict:
    inner = getattr(module, "module", module)
    return {k: v.detach().float().clone() for k, v in inner.state_dict().items()}


def grads(module: nn.Module) -> dict:
    inner = getattr(module, "module", module)
    return {n: None if p.grad is None else p.grad.clone() for n, p in inner.named_parameters()}


WRAPPERS = {"one process": lambda m, **kw: m, "minizero": minizero.DistributedDataParallel,
            "torch": TorchDDP}


def train(kind: str, make=gpt, optimizer=sgd, clear=lambda model, opt: opt.zero_grad(),
          steps: int = STEPS, **ddp) -> tuple[dict, dict]:
    """The user's loop: (final state, last step's gradients) of `kind` (WRAPPERS)."""
    model = WRAPPERS[kind](make(), **ddp)
    opt = optimizer(model.parameters())
    for step in range(steps):
        x, y = gpt_batch(step, None if kind == "one process" else comm.rank())
        clear(model, opt)
        loss_fn(model(x), y).backward()
        opt.step()
    return state(model), grads(model)


def three_ways(**kwargs) -> dict:
    return {kind: train(kind, **kwargs) for kind in WRAPPERS}


# --- scenario models (torch's tests use the same shapes of problem) -------------------------------

class Task(nn.Module):
    def __init__(self):
        super().__init__()
        self.p = nn.Parameter(torch.ones(2, 2))

    def forward(self, x):
        return self.p + x


class GlobalAndLocalUnused(nn.Module):
    """Rank 0 uses t0, the others t1; nobody uses `unused` (torch's multi-task scenario)."""
    def __init__(self):
        super().__init__()
        self.t0, self.t1, self.unused = Task(), Task(), Task()

    def forward(self, x, rank):
        return self.t0(x) if rank == 0 else self.t1(x)


class BatchNormNet(nn.Module):
    """Buffers that forward changes (running statistics) and one set per rank at construction."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.fc1, self.bn, self.fc2 = nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3)
        self.register_buffer("rank_mark", torch.full((1,), float(comm.rank())))

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


class CheckpointedTwice(nn.Module):
    """One layer run twice under reentrant checkpointing: its gradient arrives twice a backward."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.l1, self.l2 = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x):
        x = self.l1(x)
        x = checkpoint(self.l2, x, use_reentrant=True)
        return checkpoint(self.l2, x, use_reentrant=True)


class IgnoredHead(nn.Module):
    """fc3 is never used (torch's test_ignored_output_with_unused_parameters)."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.fc1, self.fc2, self.fc3 = (nn.Linear(2, 10, bias=False), nn.Linear(10, 4, bias=False),
                                        nn.Linear(4, 4, bias=False))

    def forward(self, x):
        return F.softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


@dataclasses.dataclass
class Heads:
    first: torch.Tensor | None
    rest: dict


class DataclassOutput(nn.Module):
    """Returns a dataclass: one field None (its layer unused), tensors in a dict (torch's
    test_dataclass_output_unused_param)."""
    def __init__(self):
        super().__init__()
        torch.manual_seed(4)
        self.unused, self.used = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return Heads(first=None, rest={"b": self.used(x)})


def one_line(call) -> str:
    """What `call` raises, as 'Type: message' (its first line), or 'none'."""
    try:
        call()
    except Exception as e:                                   # noqa: BLE001 - the test reads it
        return f"{type(e).__name__}: {e}"
    return "none"


# --- the scenarios, one launch per world size -----------------------------------------------------

def parity() -> dict:
    out = {}
    zero_grads = {"optimizer.zero_grad()": lambda m, o: o.zero_grad(),
                  "zero_grad(set_to_none=False)": lambda m, o: o.zero_grad(set_to_none=False),
                  "model.zero_grad()": lambda m, o: m.zero_grad()}
    for name, clear in zero_grads.items():
        out["sgd", name] = three_ways(clear=clear, bucket_cap_mb=0.002)   # ~7 buckets
    out["adamw", "default buckets"] = three_ways(optimizer=adamw)
    out["adamw", "gradient_as_bucket_view"] = three_ways(optimizer=adamw, bucket_cap_mb=0.002,
                                                         gradient_as_bucket_view=True)
    # no zero_grad at all: every step steps on the sum of all gradients so far, in every way
    out["sgd", "never zeroed"] = three_ways(clear=lambda m, o: None)
    return out


def accumulation() -> dict:
    """Two micro-batches per step, the first inside no_sync() (forward and backward): no bucket is
    all-reduced there, and the step sees the average of the sum."""
    out = {}
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](gpt(), bucket_cap_mb=0.002)
        opt = sgd(model.parameters())
        reduced_in_no_sync = 0
        for step in range(STEPS):
            opt.zero_grad()
            with recorded("collective") as log, model.no_sync():
                x, y = gpt_batch(step, comm.rank(), 0, 2)
                (loss_fn(model(x), y) / 2).backward()
            reduced_in_no_sync += sum(fields["kind"] == "all_reduce" for _, _, fields in log)
            x, y = gpt_batch(step, comm.rank(), 1, 2)
            (loss_fn(model(x), y) / 2).backward()
            opt.step()
        out[kind] = state(model)
        out[kind, "reduced in no_sync"] = reduced_in_no_sync
        # torch decides at forward: a forward inside no_sync() whose backward runs after the block
        # does not all-reduce either (and one outside whose backward runs inside it does)
        opt.zero_grad()
        x, y = gpt_batch(0, comm.rank())
        with model.no_sync():
            loss = loss_fn(model(x), y)
        with recorded("collective") as log:
            loss.backward()
        out[kind, "forward in no_sync"] = grads(model)
        out[kind, "reduced after"] = sum(fields["kind"] == "all_reduce" for _, _, fields in log)
    out["one process"] = train("one process")[0]
    return out


def unused() -> dict:
    out = {}
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](GlobalAndLocalUnused(), find_unused_parameters=True)
        opt = adamw(model.parameters())
        seen = [[p.grad is None for p in model.parameters()]]          # before any backward
        for step in range(STEPS):
            opt.zero_grad()
            out_ = model(torch.full((2, 2), float(step + comm.rank())), comm.rank())
            seen.append([p.grad is None for p in (model.module.t0.p, model.module.t1.p,
                                                  model.module.unused.p)])
            out_.mean().backward()
            seen.append([p.grad is None for p in (model.module.t0.p, model.module.t1.p,
                                                  model.module.unused.p)])
            out[kind, "grads", step] = grads(model)
            opt.step()
        out[kind, "grad is None"] = seen
        out[kind] = state(model)
        # without find_unused_parameters a parameter without gradient is an error, not a hang
        model = WRAPPERS[kind](IgnoredHead())
        x = torch.rand(4, 2)
        out[kind, "unused, not declared"] = one_line(lambda: model(x).sum().backward()) \
            if kind == "minizero" else None
    # outputs nobody backwards through (torch's test_ignored_output*), then training goes on
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](IgnoredHead(), find_unused_parameters=True)
        opt = sgd(model.parameters())
        for _ in range(3):
            model(torch.rand(4, 2))
        for step in range(STEPS):
            opt.zero_grad()
            torch.manual_seed(10 + step + comm.rank())
            F.cross_entropy(model(torch.rand(4, 2)), torch.randint(0, 4, (4,))).backward()
            opt.step()
        out[kind, "ignored outputs"] = state(model)
        out[kind, "fc3 grad"] = model.module.fc3.weight.grad
    return out


def buffers() -> dict:
    out = {}
    for broadcast in (True, False):
        for kind in ("minizero", "torch"):
            model = WRAPPERS[kind](BatchNormNet(), broadcast_buffers=broadcast)
            out[kind, broadcast, "at construction"] = float(model.module.rank_mark)
            opt = sgd(model.parameters())
            for step in range(STEPS):
                torch.manual_seed(100 * step + comm.rank())        # each rank its own rows
                opt.zero_grad()
                model(torch.randn(8, 4)).square().mean().backward()
                opt.step()
            out[kind, broadcast] = state(model)
    return out


def checkpointing() -> dict:
    out = {}
    torch.manual_seed(5)
    x = torch.randn(6 * comm.world_size(), 6)[6 * comm.rank():][:6]
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](CheckpointedTwice(), static_graph=True)
        opt = sgd(model.parameters())
        for _ in range(STEPS):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
        out[kind] = state(model)
    model = minizero.DistributedDataParallel(CheckpointedTwice())
    out["without static_graph"] = one_line(lambda: model(x).square().mean().backward())
    # a static graph with a parameter nobody uses: learned in the first backward (no all-reduce of
    # the used parameters after it), and every later backward overlaps its buckets
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](IgnoredHead(), static_graph=True, bucket_cap_mb=0.0001)
        opt = sgd(model.parameters())
        launched = []
        for step in range(STEPS):
            opt.zero_grad()
            torch.manual_seed(10 + step + comm.rank())
            with recorded("collective", "bucket launched") as log:
                F.cross_entropy(model(torch.rand(4, 2)), torch.randint(0, 4, (4,))).backward()
            launched.append([f.get("in_backward") for _, name, f in log if name != "collective"])
            out[kind, "static collectives"] = [f["tag"] for _, name, f in log
                                               if name == "collective"]
            opt.step()
        out[kind, "static"], out[kind, "static fc3"] = state(model), model.module.fc3.weight.grad
        out[kind, "static launched"] = launched
    return out


def state_dicts() -> dict:
    out = {}
    mine, theirs = minizero.DistributedDataParallel(gpt()), TorchDDP(gpt())
    out["keys"] = (list(mine.state_dict()), list(theirs.state_dict()))
    saved = {k: v.clone() for k, v in mine.state_dict().items()}
    fresh = minizero.DistributedDataParallel(make_model(GPTConfig.named("tiny"), seed=7))
    fresh.load_state_dict(saved)
    out["round trip"] = max_abs_diff(state(fresh), state(mine))
    # torch.save(model) of the whole wrapper, as torch's DDP tests do: loaded, it still averages
    for kind, model in (("minizero", mine), ("torch", theirs)):
        buffer = io.BytesIO()
        torch.save(model, buffer)
        buffer.seek(0)
        loaded = torch.load(buffer, weights_only=False)
        x, y = gpt_batch(0, comm.rank())
        loss_fn(loaded(x), y).backward()
        out["pickled", kind] = {n: g for n, g in grads(loaded).items() if g is not None}
    return out


def awkward_and_real() -> dict:
    """The awkward GPT (a frozen embedding, a parameter forward never uses, tied weights, odd
    sizes) and a Hugging Face GPT-2 with a LoRA adapter (frozen base, ModelOutput), three ways."""
    out = {}
    awkward = lambda: make_model(GPTConfig.named("tiny", frozen=("pos_emb.weight",),   # noqa: E731
                                                 unused_param=True), seed=0)
    out["awkward"] = three_ways(make=awkward, optimizer=adamw, find_unused_parameters=True,
                                bucket_cap_mb=0.002)
    try:
        from peft import LoraConfig, get_peft_model
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return out

    class LoRAGPT2(nn.Module):
        """GPT-2 with LoRA on c_attn, logits out (the loss is the test's)."""
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            base = GPT2LMHeadModel(GPT2Config(  # no dropout: one process draws other masks
                vocab_size=64, n_positions=16, n_embd=16, n_layer=2, n_head=2, bos_token_id=0,
                eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
            self.hf = get_peft_model(base, LoraConfig(r=2, target_modules=["c_attn"]))

        def forward(self, x):
            return self.hf(input_ids=x).logits[:, :, :12]

    out["lora"] = three_ways(make=LoRAGPT2, optimizer=adamw)
    return out


def through_the_module() -> dict:
    """A backward through model.module(x), bypassing DDP's forward: torch's DDP leaves it local;
    minizero reduces it all the same rather than leave its buckets half counted."""
    model = minizero.DistributedDataParallel(gpt(), bucket_cap_mb=0.002)
    x, y = gpt_batch(0, comm.rank())
    loss_fn(model.module(x), y).backward()
    direct = grads(model)
    model.zero_grad()
    loss_fn(model(x), y).backward()
    return {"direct": direct, "through forward": grads(model)}


def dataclass_output() -> dict:
    """The output's tensors found inside a dataclass, with find_unused_parameters, both DDPs."""
    out = {}
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](DataclassOutput(), find_unused_parameters=True)
        x = torch.full((2, 4), float(comm.rank() + 1))
        model(x).rest["b"].pow(2).sum().backward()
        out[kind] = grads(model)
    return out


def buckets_in_backward() -> dict:
    model = minizero.DistributedDataParallel(gpt(), bucket_cap_mb=0.002)
    x, y = gpt_batch(0, comm.rank())
    with recorded("bucket launched") as log:
        loss_fn(model(x), y).backward()
    return {"buckets": len(model.layout.buckets),
            "in backward": sum(fields["in_backward"] for _, _, fields in log)}


def refusals() -> dict:
    """torch's keywords minizero does not implement, and misuse: one line each."""
    out = {}
    refused = {"delay_all_reduce_named_params": [("w", None)], "param_to_hook_all_reduce": "x",
               "mixed_precision": object(), "skip_all_reduce_unused_params": True,
               "device_ids": [0], "output_device": 1}
    for name, value in refused.items():
        kw = {name: value}
        if name == "delay_all_reduce_named_params":
            kw["param_to_hook_all_reduce"] = nn.Parameter(torch.ones(1))
        out[name] = one_line(lambda: minizero.DistributedDataParallel(gpt(), **kw))
    for kind in ("minizero", "torch"):      # torch lets a falsy output_device through on a CPU
        out["output_device=0", kind] = one_line(lambda: WRAPPERS[kind](gpt(), output_device=0))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            WRAPPERS[kind](BatchNormNet(), broadcast_buffers=True)
        out["broadcast_buffers warns", kind] = [w.category for w in caught
                                                if "broadcast_buffers" in str(w.message)]
    out["process_group and device_mesh"] = one_line(lambda: minizero.DistributedDataParallel(
        gpt(), process_group=dist.group.WORLD, device_mesh=object()))
    frozen = gpt().requires_grad_(False)
    out["nothing to train"] = one_line(lambda: minizero.DistributedDataParallel(frozen))
    bag = nn.Sequential(nn.Linear(2, 2), nn.EmbeddingBag(4, 2, sparse=True))
    out["sparse"] = one_line(lambda: minizero.DistributedDataParallel(bag))
    model = gpt()
    minizero.DistributedDataParallel(model)
    out["twice"] = one_line(lambda: minizero.DistributedDataParallel(model))
    out["then wrap"] = one_line(lambda: minizero.wrap(model, 0, sgd))
    other = gpt()
    minizero.wrap(other, 0, sgd)
    out["after wrap"] = one_line(lambda: minizero.DistributedDataParallel(other))
    return out


def uneven() -> dict:
    """Uneven inputs (torch's test_ddp_uneven_inputs, test_zero_join_cpu): rank r has 3 + r
    batches, the loop runs in model.join() or Join([model, optimizer]); a rank out of data shadows
    the others' collectives, and at the end every rank holds the last one's model."""
    out = {}
    batches = 3 + comm.rank()
    cases = {("gpt", True): (gpt, {"bucket_cap_mb": 0.002}), ("gpt", False): (gpt, {}),
             ("batchnorm", True): (BatchNormNet, {}),
             ("unused", False): (GlobalAndLocalUnused, {"find_unused_parameters": True})}
    for (name, divide), (make, ddp) in cases.items():
        for kind in ("minizero", "torch"):
            model = WRAPPERS[kind](make(), **ddp)
            opt = sgd(model.parameters())
            with model.join(divide_by_initial_world_size=divide):
                for step in range(batches):
                    opt.zero_grad()
                    _uneven_loss(name, model, step).backward()
                    opt.step()
            out[name, divide, kind] = state(model)
    zeros = {"minizero": minizero.ZeroRedundancyOptimizer, "torch": TorchZeRO}
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](gpt(), bucket_cap_mb=0.002)
        # SGD, not torch's test's Adam: Adam amplifies N = 3's rounding apart (TORCH_ATOL above)
        opt = zeros[kind](model.parameters(), torch.optim.SGD, lr=0.5, momentum=0.9)
        with Join([model, opt]):
            for step in range(batches):
                opt.zero_grad()
                _uneven_loss("gpt", model, step).backward()
                opt.step()
        out["zero", kind] = state(model)
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](gpt())

        def until_one_runs_out():
            with model.join(throw_on_early_termination=True):
                for step in range(batches):
                    _uneven_loss("gpt", model, step).backward()
        out["throw", kind] = one_line(until_one_runs_out)
    return out


def _uneven_loss(name: str, model: nn.Module, step: int) -> torch.Tensor:
    if name == "gpt":
        return loss_fn(model(*gpt_batch(step, comm.rank())[:1]), gpt_batch(step, comm.rank())[1])
    if name == "unused":
        return model(torch.full((2, 2), float(step + comm.rank())), comm.rank()).mean()
    torch.manual_seed(100 * step + comm.rank())
    return model(torch.randn(8, 4)).square().mean()


def subgroup() -> dict | None:
    """DDP over ranks 0 and 2 of 3 (torch's non-default process group): rank 1 is not part."""
    group = dist.new_group([0, 2])                      # collective: every rank makes it
    if comm.rank() == 1:
        return None
    rank = [0, 2].index(comm.rank())
    out = {}
    for kind in ("minizero", "torch"):
        model = WRAPPERS[kind](gpt(), process_group=group)
        opt = sgd(model.parameters())
        for step in range(STEPS):
            x, y = gpt_batch(step)
            x, y = local_batch(x, y, rank, 2)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        out[kind] = state(model)
    return out


def ignored() -> dict:
    """A parameter named through DDP's static _set_params_and_buffers_to_ignore_for_model keeps each
    rank's own gradient (torch's test_ddp_ignore_params_arg)."""
    out = {}
    for kind in ("minizero", "torch"):
        torch.manual_seed(0)
        module = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        WRAPPERS[kind]._set_params_and_buffers_to_ignore_for_model(module, ["0.weight"])
        model = WRAPPERS[kind](module)
        torch.manual_seed(comm.rank())                           # each rank its own rows
        model(torch.randn(8, 4)).square().mean().backward()
        out[kind] = grads(model)
    return out


def scenarios() -> dict:
    out = {"parity": parity(), "accumulation": accumulation(), "unused": unused(),
           "buffers": buffers(), "checkpointing": checkpointing(), "state dicts": state_dicts(),
           "buckets": buckets_in_backward(), "refusals": refusals(),
           "through the module": through_the_module(), "awkward and real": awkward_and_real(),
           "dataclass output": dataclass_output(), "uneven": uneven(), "ignored": ignored()}
    if comm.world_size() == 3:
        out["subgroup"] = subgroup()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return launch_per_world_size(scenarios, WORLD_SIZES)      # N = 3: on a group (_checks.py)


# --- parity ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [
    ("sgd", "optimizer.zero_grad()"), ("sgd", "zero_grad(set_to_none=False)"),
    ("sgd", "model.zero_grad()"), ("sgd", "never zeroed"), ("adamw", "default buckets"),
    ("adamw", "gradient_as_bucket_view")])
def test_the_users_loop_ends_where_torchs_ddp_and_one_process_end(runs, case):
    atol = SGD_ATOL if case[0] == "sgd" else ADAMW_ATOL
    for n, r, rank in each_rank(runs):
        ways = rank["parity"][case]
        (mine, mine_grads), (theirs, their_grads) = ways["minizero"], ways["torch"]
        assert max_abs_diff(mine, theirs) <= (TORCH_ATOL if case[0] == "sgd" else atol), (n, r)
        assert max_abs_diff(mine, ways["one process"][0]) <= atol, (n, r, case)
        assert all((g is None) == (their_grads[k] is None) for k, g in mine_grads.items())
        assert max_abs_diff({k: g for k, g in mine_grads.items() if g is not None},
                            {k: g for k, g in their_grads.items() if g is not None}) <= TORCH_ATOL


def test_no_sync_accumulates_without_communicating(runs):
    for n, r, rank in each_rank(runs):
        acc = rank["accumulation"]
        assert acc["minizero", "reduced in no_sync"] == 0
        assert acc["minizero", "reduced after"] == acc["torch", "reduced after"] == 0
        assert max_abs_diff(acc["minizero", "forward in no_sync"],
                            acc["torch", "forward in no_sync"]) <= TORCH_ATOL
        assert max_abs_diff(acc["minizero"], acc["torch"]) <= TORCH_ATOL
        assert max_abs_diff(acc["minizero"], acc["one process"]) <= SGD_ATOL


@pytest.mark.parametrize("case", ["awkward", "lora"])
def test_an_awkward_model_and_a_hugging_face_lora_model(runs, case):
    if case == "lora":
        pytest.importorskip("transformers")
        pytest.importorskip("peft")
    for n, r, rank in each_rank(runs):
        ways = rank["awkward and real"][case]
        (mine, mine_grads), (theirs, their_grads) = ways["minizero"], ways["torch"]
        assert max_abs_diff(mine, theirs) <= ADAMW_ATOL and max_abs_diff(
            mine, ways["one process"][0]) <= ADAMW_ATOL, (n, r, case)
        frozen = [k for k, g in their_grads.items() if g is None]      # torch's: frozen, unused
        assert frozen and [k for k, g in mine_grads.items() if g is None] == frozen


def test_a_backward_through_the_module_itself_is_reduced_too(runs):
    for n, r, rank in each_rank(runs):
        t = rank["through the module"]
        assert max_abs_diff(t["direct"], t["through forward"]) <= TORCH_ATOL


def test_an_output_in_a_dataclass_with_an_unused_field(runs):
    for n, r, rank in each_rank(runs):
        mine, theirs = rank["dataclass output"]["minizero"], rank["dataclass output"]["torch"]
        assert mine.pop("unused.weight") is None and theirs.pop("unused.weight") is None
        assert mine.pop("unused.bias") is None and theirs.pop("unused.bias") is None
        torch.testing.assert_close(mine, theirs, rtol=1e-6, atol=TORCH_ATOL)   # grads ~20: N = 3


def test_buckets_are_all_reduced_during_backward(runs):
    for n, r, rank in each_rank(runs):
        assert rank["buckets"]["buckets"] > 3
        assert rank["buckets"]["in backward"] == rank["buckets"]["buckets"]


# --- unused parameters ----------------------------------------------------------------------------

def test_globally_unused_parameters_keep_grad_none_and_locally_unused_get_the_average(runs):
    for n, r, rank in each_rank(runs):
        u = rank["unused"]
        # before each backward every grad is None; after it t0 and t1 have one on every rank
        # (the rank that did not use one gets the average), `unused` stays None
        expected = [[True] * 3] + [[True, True, True], [False, False, True]] * STEPS
        assert u["minizero", "grad is None"] == u["torch", "grad is None"] == expected
        for step in range(STEPS):
            mine, theirs = u["minizero", "grads", step], u["torch", "grads", step]
            assert mine["unused.p"] is None and theirs["unused.p"] is None
            for name in ("t0.p", "t1.p"):
                assert torch.allclose(mine[name], theirs[name], atol=TORCH_ATOL, rtol=0)
        # AdamW's weight decay would move `unused` had it been given a zero gradient
        assert max_abs_diff(u["minizero"], u["torch"]) <= ADAMW_ATOL
        assert torch.equal(u["minizero"]["unused.p"], torch.ones(2, 2))


def test_a_parameter_without_gradient_needs_find_unused_parameters_in_one_line(runs):
    for n, r, rank in each_rank(runs):
        message = rank["unused"]["minizero", "unused, not declared"]
        assert message.startswith("RuntimeError: DistributedDataParallel: 1 parameter(s) got no "
                                  "gradient in this backward (fc3.weight): pass "
                                  "find_unused_parameters=True")
        assert "\n" not in message


def test_outputs_without_backward_then_training(runs):
    for n, r, rank in each_rank(runs):
        u = rank["unused"]
        assert max_abs_diff(u["minizero", "ignored outputs"], u["torch", "ignored outputs"]) \
            <= TORCH_ATOL
        assert u["minizero", "fc3 grad"] is None and u["torch", "fc3 grad"] is None


# --- buffers, checkpointing, state dicts ----------------------------------------------------------

@pytest.mark.parametrize("broadcast", [True, False])
def test_buffers_come_from_rank_0_before_each_forward_or_stay_each_ranks(runs, broadcast):
    for n, r, rank in each_rank(runs):
        b = rank["buffers"]
        # torch 2.13: broadcast_buffers=False skips the buffers at construction too
        assert b["minizero", broadcast, "at construction"] == (0.0 if broadcast else r)
        assert b["minizero", broadcast, "at construction"] == b["torch", broadcast,
                                                                 "at construction"]
        assert max_abs_diff(b["minizero", broadcast], b["torch", broadcast]) <= TORCH_ATOL
    if not broadcast:        # each rank's running statistics are its own rows': they differ
        first, second = runs[2][0]["buffers"], runs[2][1]["buffers"]
        assert max_abs_diff(first["minizero", False], second["minizero", False]) > 1e-3


def test_reentrant_checkpointing_twice_with_static_graph_and_without(runs):
    for n, r, rank in each_rank(runs):
        c = rank["checkpointing"]
        assert max_abs_diff(c["minizero"], c["torch"]) <= TORCH_ATOL
        assert c["without static_graph"].startswith("RuntimeError: DistributedDataParallel: l2.")
        assert "gradient arrived twice in one backward" in c["without static_graph"]
        # the words PyTorch's own tests look for, and users search for
        assert "Expected to mark a variable ready only once" in c["without static_graph"]


def test_a_static_graph_is_learned_once_then_overlapped(runs):
    for n, r, rank in each_rank(runs):
        c = rank["checkpointing"]
        assert max_abs_diff(c["minizero", "static"], c["torch", "static"]) <= TORCH_ATOL
        assert c["minizero", "static fc3"] is None and c["torch", "static fc3"] is None
        first, *later = c["minizero", "static launched"]
        assert len(first) == 2 and not any(first)             # [fc3, fc2], [fc1]: after backward
        assert all(launches == [True] * 2 for launches in later)
        assert "used parameters" not in c["minizero", "static collectives"]    # the last step's


def test_state_dict_keys_are_torchs_and_load_back(runs):
    for n, r, rank in each_rank(runs):
        mine, theirs = rank["state dicts"]["keys"]
        assert mine == theirs and all(k.startswith("module.") for k in mine)
        assert rank["state dicts"]["round trip"] == 0.0


def test_the_whole_module_pickles_and_averages_after_loading(runs):
    for n, r, rank in each_rank(runs):
        loaded = rank["state dicts"]
        assert max_abs_diff(loaded["pickled", "minizero"], loaded["pickled", "torch"]) <= TORCH_ATOL


def test_a_process_group_of_some_ranks(runs):
    results = runs[3]
    assert results[1]["subgroup"] is None
    for rank in (0, 2):
        s = results[rank]["subgroup"]
        assert max_abs_diff(s["minizero"], s["torch"]) <= TORCH_ATOL
    assert max_abs_diff(results[0]["subgroup"]["minizero"],
                        results[2]["subgroup"]["minizero"]) == 0.0


# --- uneven inputs: Join --------------------------------------------------------------------------

@pytest.mark.parametrize("case", [("gpt", True), ("gpt", False), ("batchnorm", True),
                                  ("unused", False), ("zero",)])
def test_uneven_inputs_under_join_end_where_torchs_ddp_ends_on_every_rank(runs, case):
    for n, r, rank in each_rank(runs):
        u = rank["uneven"]
        assert max_abs_diff(u[(*case, "minizero")], u[(*case, "torch")]) <= TORCH_ATOL, (n, r)
        # post_hook: every rank holds the model of the last rank to join
        assert max_abs_diff(u[(*case, "minizero")], runs[n][-1]["uneven"][(*case, "minizero")]) \
            == 0.0, (n, r)
    if case == ("gpt", False):     # the last batches weigh more than with True: the models differ
        u = runs[3][0]["uneven"]
        assert max_abs_diff(u["gpt", True, "minizero"], u["gpt", False, "minizero"]) > 1e-4


def test_throw_on_early_termination_raises_one_line_on_every_rank(runs):
    for n, r, rank in each_rank(runs):
        mine, theirs = rank["uneven"]["throw", "minizero"], rank["uneven"]["throw", "torch"]
        assert mine == theirs, (n, r)
        assert mine == ("RuntimeError: Rank 0 exhausted all inputs." if r == 0 else
                        "RuntimeError: Detected at least one rank that exhausted inputs. "
                        "Throwing across all ranks.")


# --- what is refused ------------------------------------------------------------------------------

REFUSALS = {
    "delay_all_reduce_named_params": "ValueError: DistributedDataParallel: "
                                     "delay_all_reduce_named_params is not supported",
    "param_to_hook_all_reduce": "ValueError: DistributedDataParallel: param_to_hook_all_reduce "
                                "is not supported",
    "mixed_precision": "ValueError: DistributedDataParallel: mixed_precision is not supported",
    "skip_all_reduce_unused_params": "ValueError: DistributedDataParallel: "
                                     "skip_all_reduce_unused_params is not supported",
    "device_ids": "ValueError: DistributedDataParallel: device_ids and output_device are for a "
                  "module on one GPU; this one is on cpu (device_ids=[0]",
    "output_device": "ValueError: DistributedDataParallel: device_ids and output_device are for",
    "process_group and device_mesh": "RuntimeError: DistributedDataParallel: pass process_group "
                                     "or device_mesh, not both",
    "nothing to train": "RuntimeError: DistributedDataParallel: no parameter of the module "
                        "requires a gradient",
    "sparse": "ValueError: DistributedDataParallel: sparse gradients (1: "
              "nn.EmbeddingBag(sparse=True)) are not supported",
    "twice": "ValueError: tok_emb.weight is already owned by minizero.DistributedDataParallel; "
             "minizero.DistributedDataParallel cannot take it too",
    "then wrap": "ValueError: tok_emb.weight is already owned by "
                 "minizero.DistributedDataParallel; a minizero stage-0 engine cannot take it",
    "after wrap": "ValueError: tok_emb.weight is already owned by a minizero stage-0 engine; "
                  "minizero.DistributedDataParallel cannot take it too",
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_minizero_does_not_do_is_refused_in_one_line(runs, case):
    for n, r, rank in each_rank(runs):
        message = rank["refusals"][case]
        assert message.startswith(REFUSALS[case]), message
        assert "\n" not in message


def test_parameters_named_to_ignore_keep_each_ranks_gradient(runs):
    for n, r, rank in each_rank(runs):
        mine, theirs = rank["ignored"]["minizero"], rank["ignored"]["torch"]
        assert max_abs_diff(mine, theirs) <= TORCH_ATOL
    first, second = runs[2][0]["ignored"]["minizero"], runs[2][1]["ignored"]["minizero"]
    def apart(name):
        return max_abs_diff({name: first[name]}, {name: second[name]})
    assert apart("0.weight") > 1e-3 and apart("1.weight") == 0.0       # not averaged; averaged


def test_what_torch_accepts_on_a_cpu_module_and_its_deprecation_warning(runs):
    for n, r, rank in each_rank(runs):
        refusals = rank["refusals"]
        assert refusals["output_device=0", "minizero"] == refusals["output_device=0", "torch"]
        assert refusals["output_device=0", "minizero"] == "none"
        assert refusals["broadcast_buffers warns", "minizero"] == [FutureWarning]
        assert refusals["broadcast_buffers warns", "torch"] == [FutureWarning]


# --- the benchmark's pairs ------------------------------------------------------------------------

def test_the_bench_runs_both_front_ends_next_to_torchs():
    """python -m minizero.bench --stages ddp ddp+zero: each front end in the user's loop next to
    the original, same data, ratio in the same run (one launch)."""
    from minizero.lab import bench
    report = bench.compare((2,), sizes=("tiny",), steps=2, repeats=1, variants=("ddp", "ddp+zero"),
                           peers=("torch",), meter=False)
    pairs = {p["variant"]: p for p in report["pairs"]}
    assert {v: p["peer"] for v, p in pairs.items()} == {"ddp": "ddp",
                                                        "ddp+zero": "zero_redundancy"}
    for p in pairs.values():
        assert p["max_param_diff"] <= TORCH_ATOL and p["ratio"] > 0
        # the same ring bytes as the peer's collectives, and the buffers' broadcast before forward
        assert 0 < p["comm_bytes_per_step"]["minizero"] - p["comm_bytes_per_step"]["peer"] < 1e3
    text = bench.format_table(report)
    assert "ddp+zero zero_redundancy" in text
