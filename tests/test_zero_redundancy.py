"""minizero.ZeroRedundancyOptimizer against torch's ZeroRedundancyOptimizer and one process, on the
same data: the scenarios of torch's test/distributed/optim/test_zero_redundancy_optimizer.py,
ported.

    python -m pytest tests/test_zero_redundancy.py

Whole parameters per rank, assigned as torch assigns them; gradients averaged before the step by
minizero's DDP, torch's DDP or the user; each rank steps its own, then every parameter comes from
its owner. Checked: the partition (the same as torch's), training parity (the two DDPs, the user's
own averaging, several parameter groups, a group added later, step(closure), buckets as views,
trainability changing mid-run), the state dict (torch's format, consolidated on any rank, loaded
back, exchanged with torch's and with a plain optimizer), the scheduler, the constructor's
refusals, uneven inputs under torch's Join, an optimizer built again over the same parameters.
One launch per world size (N = 2 and 3).
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.algorithms.join import Join
from torch.distributed.optim import ZeroRedundancyOptimizer as TorchZero
from torch.nn.parallel import DistributedDataParallel as TorchDDP

from _checks import each_rank, launch_per_world_size
import minizero
from minizero import comm
from minizero.lab.reference import max_abs_diff
from minizero.lab.train import loss_fn
from test_pytorch_ddp import ADAMW_ATOL, SGD_ATOL, TORCH_ATOL, gpt, gpt_batch, one_line, state

WORLD_SIZES = (2, 3)
STEPS = 3
PAIRS = {   # (DDP, ZeroRedundancyOptimizer) as a user puts them together
    "minizero": (minizero.DistributedDataParallel, minizero.ZeroRedundancyOptimizer),
    "torch": (TorchDDP, TorchZero),
    "torch's DDP, minizero's optimizer": (TorchDDP, minizero.ZeroRedundancyOptimizer),
}


def averaged_by_hand(model, **kwargs):
    """No DDP: the user all-reduces the gradients after backward (torch's test_step)."""
    return model


def groups_of(model, split: bool):
    """One group, or torch's two (weights without decay, the rest with it, another lr)."""
    if not split:
        return model.parameters()
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.0},
            {"params": [p for n, p in named if not n.endswith("weight")], "lr": 3e-3,
             "weight_decay": 0.1}]


def run(pair: str, optimizer=torch.optim.AdamW, split: bool = False, add_later: bool = False,
        closure: bool = False, steps: int = STEPS, model=None, **zero) -> tuple[dict, list]:
    """The user's loop with a DDP and a ZeroRedundancyOptimizer: (final state, losses)."""
    wrapper, zero_class = PAIRS.get(pair, (averaged_by_hand, minizero.ZeroRedundancyOptimizer))
    ddp = wrapper(model if model is not None else gpt())
    params = groups_of(ddp.module if hasattr(ddp, "module") else ddp, split)
    defaults = {"lr": 1e-2, "weight_decay": 0.1} if optimizer is torch.optim.AdamW else \
        {"lr": 0.5, "momentum": 0.9}
    if add_later:                                   # torch's test_multiple_param_groups
        first, second = params
        opt = zero_class([first], optimizer, **defaults, **zero)
        opt.add_param_group(second)
    else:
        opt = zero_class(params, optimizer, **defaults, **zero)
    losses = []
    for step in range(steps):
        x, y = gpt_batch(step, comm.rank())

        def forward_backward():
            opt.zero_grad()
            loss = loss_fn(ddp(x), y)
            loss.backward()
            if wrapper is averaged_by_hand:
                for p in ddp.parameters():
                    dist.all_reduce(p.grad, op=dist.ReduceOp.AVG)
            return loss
        losses.append(float(opt.step(forward_backward) if closure else
                            (forward_backward(), opt.step())[0]))
    return state(ddp), losses


def one_process(optimizer=torch.optim.AdamW, split: bool = False, steps: int = STEPS) -> dict:
    model = gpt()
    defaults = {"lr": 1e-2, "weight_decay": 0.1} if optimizer is torch.optim.AdamW else \
        {"lr": 0.5, "momentum": 0.9}
    opt = optimizer(groups_of(model, split), **defaults)
    for step in range(steps):
        x, y = gpt_batch(step)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    return state(model)


# --- the scenarios --------------------------------------------------------------------------------

def partitions() -> dict:
    """Which rank each parameter goes to, here and in torch's (by position), for torch's tests'
    shapes, the GPT, several groups and a group added later."""
    n = comm.world_size()

    def assignment(opt, params):
        position = {id(p): i for i, p in enumerate(params)}
        if isinstance(opt, TorchZero):
            per_rank = opt._partition_parameters()           # torch's, read from its private API
        else:
            per_rank = [[{"params": ps} for ps in groups] for groups in opt.partition]
        return [[[position[id(p)] for p in g["params"]] for g in groups] for groups in per_rank]

    out = {}
    cases = {
        "torch's sizes": lambda: [torch.rand(s, 1) for s in [9, 7, 5, 3] * n],
        "gpt": lambda: list(gpt().parameters()),
        "two groups": lambda: groups_of(gpt(), split=True),
    }
    for name, make in cases.items():
        for cls in (minizero.ZeroRedundancyOptimizer, TorchZero):
            params = make()
            flat = list(itertools.chain.from_iterable(g["params"] for g in params)) \
                if isinstance(params[0], dict) else params
            opt = cls(params, torch.optim.SGD, lr=0.1)
            out[name, cls.__module__.split(".")[0]] = assignment(opt, flat)
            if name == "torch's sizes":
                out[name, cls.__module__.split(".")[0], "mine"] = sum(
                    p.numel() for g in opt.optim.param_groups for p in g["params"])
    for cls in (minizero.ZeroRedundancyOptimizer, TorchZero):          # torch's add_param_group
        params = [torch.rand(s, 1) for s in ([9, 7, 5, 3] * n)[:-1]]
        opt = cls(params, torch.optim.SGD, lr=0.1)
        added = torch.rand(3, 1)
        opt.add_param_group({"params": [added]})
        out["added", cls.__module__.split(".")[0]] = (
            assignment(opt, params + [added]), len(opt.optim.param_groups),
            sum(p.numel() for g in opt.optim.param_groups for p in g["params"]))
    return out


def training() -> dict:
    out = {"one process": one_process(), "one process, sgd": one_process(torch.optim.SGD),
           "one process, groups": one_process(split=True)}
    for pair in [*PAIRS, "by hand"]:
        out[pair] = run(pair)
    out["minizero", "sgd"] = run("minizero", torch.optim.SGD)
    out["torch", "sgd"] = run("torch", torch.optim.SGD)
    out["minizero", "bucket view"] = run("minizero", parameters_as_bucket_view=True)
    out["torch", "bucket view"] = run("torch", parameters_as_bucket_view=True)
    for pair in ("minizero", "torch"):
        out[pair, "groups"] = run(pair, split=True)
        out[pair, "added later"] = run(pair, split=True, add_later=True)
        out[pair, "closure"] = run(pair, closure=True)
    return out


def trainability() -> dict:
    """torch's test_local_optimizer_parity: the first parameter thawed and frozen in turn, with
    find_unused_parameters; buckets as views must be rebuilt each time (frozen when the optimizer
    is built, the parameter is in no bucket: its owner's update would reach nobody)."""
    out = {}
    for pair in ("minizero", "torch"):
        for view in (False, True):
            ddp_class, zero_class = PAIRS[pair]
            ddp = ddp_class(gpt(), find_unused_parameters=True)
            first = next(ddp.parameters())
            first.requires_grad_(False)
            opt = zero_class(ddp.parameters(), torch.optim.AdamW, lr=1e-2,
                             parameters_as_bucket_view=view)
            for step in range(6):
                first.requires_grad_(step in (1, 2, 4))
                x, y = gpt_batch(step, comm.rank())
                opt.zero_grad()
                loss_fn(ddp(x), y).backward()
                opt.step()
            out[pair, view] = state(ddp)
    return out


def state_dicts() -> dict:
    """Consolidated on rank 0 (and on the last rank), torch's format, loaded back and across."""
    out = {}
    last = comm.world_size() - 1
    saved = {}
    for pair in ("minizero", "torch"):
        ddp_class, zero_class = PAIRS[pair]
        ddp = ddp_class(gpt())
        opt = zero_class(ddp.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)  # run's
        for step in range(2):
            x, y = gpt_batch(step, comm.rank())
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()
        out[pair, "not consolidated"] = one_line(opt.state_dict)
        opt.consolidate_state_dict(to=last)
        out[pair, "on the last rank"] = (comm.rank() == last and
                                         len(opt.state_dict()["state"]))
        opt.consolidate_state_dict()
        whole = [opt.state_dict() if comm.rank() == 0 else None]
        dist.broadcast_object_list(whole, src=0)
        saved[pair] = whole[0]
        out[pair, "saved"] = whole[0]
    plain = torch.optim.AdamW(gpt().parameters(), lr=1e-2)        # a plain optimizer's state
    out["plain keys"] = list(plain.state_dict()["param_groups"][0])

    def resume(pair: str, loaded: dict) -> dict:
        """Steps 2-4 after loading the state of steps 0-1 into a fresh optimizer (another lr)."""
        ddp_class, zero_class = PAIRS[pair]
        model = gpt()
        model.load_state_dict(run_two_steps_state)
        ddp = ddp_class(model)
        opt = zero_class(ddp.parameters(), torch.optim.AdamW, lr=0.5, weight_decay=0.0)
        opt.load_state_dict(loaded)
        lr = opt.param_groups[0]["lr"], opt.param_groups[0]["weight_decay"]
        for step in range(2, 5):
            x, y = gpt_batch(step, comm.rank())
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()
        return {"state": state(ddp), "lr": lr}

    run_two_steps_state = run("minizero", steps=2)[0]
    out["uninterrupted"] = run("minizero", steps=5)[0]
    for pair in ("minizero", "torch"):
        for source in ("minizero", "torch"):
            # (torch's load_state_dict writes into the dict it is given: a copy each time)
            out["resumed", pair, "from", source] = resume(pair, copy.deepcopy(saved[source]))
    return out


class SGDWithNewKey(torch.optim.SGD):
    """An optimizer that adds a key of its own to its groups at step (torch's test)."""
    def step(self, closure=None):
        super().step()
        self.param_groups[0]["new_key"] = 0.1


class SGDWithoutClosure(torch.optim.SGD):
    def step(self):
        return super().step()


def interface() -> dict:
    """zero_grad, a scheduler, step's keywords, optimizers' own keys, the constructor's refusals,
    a second owner."""
    out = {}
    x = torch.tensor([1.0], requires_grad=True)
    opt = minizero.ZeroRedundancyOptimizer([x], torch.optim.SGD, lr=0.1)
    x.backward(torch.ones(1))
    opt.zero_grad(set_to_none=False)
    out["zeroed"] = x.grad.tolist()
    opt.zero_grad()
    out["none"] = x.grad is None
    for cls in (minizero.ZeroRedundancyOptimizer, torch.optim.SGD):       # a scheduler over it
        w = torch.ones(3, requires_grad=True)
        opt = (cls([w], torch.optim.SGD, lr=0.1) if cls is minizero.ZeroRedundancyOptimizer
               else cls([w], lr=0.1))
        schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        for _ in range(4):
            w.sum().backward()
            opt.step()
            opt.zero_grad()
            schedule.step()
        out["scheduler", cls.__name__] = (w.tolist(), opt.param_groups[0]["lr"])
    for optimizer_class in (SGDWithNewKey, SGDWithoutClosure):
        w = torch.ones(2, requires_grad=True)
        opt = minizero.ZeroRedundancyOptimizer([w], optimizer_class, lr=0.1)
        w.sum().backward()
        opt.step()
        out[optimizer_class.__name__] = (w.tolist(), opt.param_groups[0].get("new_key"))
    linear = torch.nn.Linear(5, 10)
    refused = {
        "empty": [], "a tensor": torch.randn(1), "a float": 1.2,
        "not all tensors": list(linear.parameters()) + [42],
        "two dtypes": [torch.zeros(1), torch.zeros(1, dtype=torch.float64)],
        "sparse": [torch.sparse_coo_tensor(size=(2, 3))],
        "a group without params": [{"lr": 0.1}],
    }
    for name, params in refused.items():
        out["refused", name] = one_line(
            lambda: minizero.ZeroRedundancyOptimizer(params, torch.optim.SGD, lr=0.1))
    out["refused", "overlap_with_ddp"] = one_line(lambda: minizero.ZeroRedundancyOptimizer(
        linear.parameters(), torch.optim.SGD, overlap_with_ddp=True, lr=0.1))
    out["accepted"] = [one_line(lambda: minizero.ZeroRedundancyOptimizer(
        ps, torch.optim.SGD, lr=0.1)) for ps in (
        torch.nn.Linear(2, 2).parameters(), list(torch.nn.Linear(2, 2).parameters()),
        [{"params": [torch.zeros(2)]}, {"params": [torch.zeros(3)], "lr": 1.0}])]
    model = gpt()            # an optimizer built again to resume into (torch's test_state_dict)
    minizero.ZeroRedundancyOptimizer(model.parameters(), torch.optim.SGD, lr=0.1)
    out["twice"] = one_line(lambda: minizero.ZeroRedundancyOptimizer(
        model.parameters(), torch.optim.SGD, lr=0.1))
    other = gpt()
    minizero.wrap(other, 0, lambda ps: torch.optim.SGD(ps, lr=0.1))
    out["over an engine's"] = one_line(lambda: minizero.ZeroRedundancyOptimizer(
        other.parameters(), torch.optim.SGD, lr=0.1))
    return out


def uneven_inputs() -> dict:
    """torch's test_zero_join_cpu: rank r has 2 + r batches. Under Join, a rank out of data
    steps with the gradients it has, so that its parameters still reach the others: after torch's
    DDP (Join's first joinable) as torch's pair does, and alone (torch's desynchronizes there)."""
    out = {}
    for zero_class, with_ddp in ((TorchZero, True), (minizero.ZeroRedundancyOptimizer, True),
                                 (minizero.ZeroRedundancyOptimizer, False)):
        model = gpt()
        net = TorchDDP(model) if with_ddp else model
        opt = zero_class(model.parameters(), torch.optim.SGD, lr=0.5, momentum=0.9)
        with Join([net, opt] if with_ddp else [opt]):
            for step in range(2 + comm.rank()):
                x, y = gpt_batch(step, comm.rank())
                opt.zero_grad()
                loss_fn(net(x), y).backward()
                opt.step()
        out[zero_class.__module__.split(".")[0], with_ddp] = state(model)
    return out


def subgroup() -> dict | None:
    """torch's test_nondefault_process_group: ranks 0 and 2 of 3 train, rank 1 is not part."""
    group = dist.new_group([0, 2])
    if comm.rank() == 1:
        return None
    rank = [0, 2].index(comm.rank())
    out = {}
    for pair in ("minizero", "torch"):
        ddp_class, zero_class = PAIRS[pair]
        ddp = ddp_class(gpt(), process_group=group)
        opt = zero_class(ddp.parameters(), torch.optim.SGD, process_group=group, lr=0.5,
                         momentum=0.9)
        for step in range(STEPS):
            x, y = gpt_batch(step)
            x, y = x[rank * 6:][:6], y[rank * 6:][:6]
            opt.zero_grad()
            loss_fn(ddp(x), y).backward()
            opt.step()
        out[pair] = state(ddp)
    return out


def scenarios() -> dict:
    out = {"partitions": partitions(), "training": training(), "trainability": trainability(),
           "state dicts": state_dicts(), "interface": interface(), "uneven": uneven_inputs()}
    if comm.world_size() == 3:
        out["subgroup"] = subgroup()
    return out


@pytest.fixture(scope="module")
def runs() -> dict:
    return launch_per_world_size(scenarios, WORLD_SIZES)      # N = 3: on a group (_checks.py)


# --- the partition --------------------------------------------------------------------------------

@pytest.mark.parametrize("case", ["torch's sizes", "gpt", "two groups"])
def test_each_rank_gets_the_whole_parameters_torch_gives_it(runs, case):
    for n, r, rank in each_rank(runs):
        p = rank["partitions"]
        assert p[case, "minizero"] == p[case, "torch"], (n, case)
        indices = sorted(i for groups in p[case, "minizero"] for g in groups for i in g)
        assert indices == list(range(len(indices)))                      # each one rank's
        if case == "torch's sizes":             # sizes [9, 7, 5, 3] * N: one of each per rank
            assert p[case, "minizero", "mine"] == p[case, "torch", "mine"] == 24


def test_an_added_group_is_partitioned_by_the_same_rule(runs):
    for n, r, rank in each_rank(runs):
        mine, theirs = rank["partitions"]["added", "minizero"], rank["partitions"]["added", "torch"]
        assert mine == theirs
        assert mine[1] == 2 and mine[2] == 24                 # every rank: 9 + 7 + 5 + 3 elements


# --- training -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pair", [*PAIRS, "by hand"])
def test_each_pair_ends_where_torchs_pair_and_one_process_end(runs, pair):
    for n, r, rank in each_rank(runs):
        t = rank["training"]
        assert max_abs_diff(t[pair][0], t["torch"][0]) <= ADAMW_ATOL, (n, r, pair)
        assert max_abs_diff(t[pair][0], t["one process"]) <= ADAMW_ATOL, (n, r, pair)
        assert t[pair][1] == pytest.approx(t["torch"][1], abs=1e-6)


@pytest.mark.parametrize("case", ["sgd", "bucket view", "groups", "added later", "closure"])
def test_sgd_bucket_views_parameter_groups_and_closures(runs, case):
    reference = {"sgd": "one process, sgd", "groups": "one process, groups",
                 "added later": "one process, groups"}.get(case, "one process")
    atol = SGD_ATOL if case == "sgd" else ADAMW_ATOL
    for n, r, rank in each_rank(runs):
        t = rank["training"]
        mine, theirs = t["minizero", case], t["torch", case]
        assert max_abs_diff(mine[0], theirs[0]) <= (TORCH_ATOL if case == "sgd" else atol)
        assert max_abs_diff(mine[0], t[reference]) <= atol, (n, r, case)
        assert mine[1] == pytest.approx(theirs[1], abs=1e-6)       # step(closure) returns the loss


@pytest.mark.parametrize("view", [False, True])
def test_freezing_and_thawing_a_parameter_mid_run(runs, view):
    for n, r, rank in each_rank(runs):
        t = rank["trainability"]
        assert max_abs_diff(t["minizero", view], t["torch", view]) <= ADAMW_ATOL, (n, r)


def test_a_process_group_of_some_ranks(runs):
    results = runs[3]
    assert results[1]["subgroup"] is None
    for rank in (0, 2):
        s = results[rank]["subgroup"]
        assert max_abs_diff(s["minizero"], s["torch"]) <= TORCH_ATOL


def test_uneven_inputs_under_join_end_where_torchs_pair_ends(runs):
    for n, r, rank in each_rank(runs):
        u, first = rank["uneven"], runs[n][0]["uneven"]
        assert max_abs_diff(u["minizero", True], u["torch", True]) <= TORCH_ATOL, (n, r)
        for key in u:                                    # every rank holds the same parameters
            assert max_abs_diff(u[key], first[key]) == 0, (n, r, key)


# --- state dicts ----------------------------------------------------------------------------------

def test_the_consolidated_state_dict_is_torchs(runs):
    for n, r, rank in each_rank(runs):
        s = rank["state dicts"]
        mine, theirs = s["minizero", "saved"], s["torch", "saved"]
        assert mine["param_groups"] == theirs["param_groups"]
        assert set(mine["param_groups"][0]) == set(s["plain keys"])        # a plain AdamW's
        assert list(mine["state"]) == list(theirs["state"]) == list(range(len(mine["state"])))
        for index, values in mine["state"].items():
            assert values.keys() == theirs["state"][index].keys()
            for key, value in values.items():
                assert torch.allclose(value, theirs["state"][index][key], atol=1e-6), (index, key)
        assert s["minizero", "on the last rank"] == (len(mine["state"]) if r == n - 1 else False)


def test_state_dict_before_consolidating_is_an_error_in_one_line(runs):
    for n, r, rank in each_rank(runs):
        assert rank["state dicts"]["torch", "not consolidated"].startswith("RuntimeError")
        message = rank["state dicts"]["minizero", "not consolidated"]
        assert message == ("RuntimeError: ZeroRedundancyOptimizer.state_dict(): no consolidated "
                           f"state on rank {r}: call consolidate_state_dict(to={r}) on every "
                           "rank first")


@pytest.mark.parametrize("pair", ["minizero", "torch"])
@pytest.mark.parametrize("source", ["minizero", "torch"])
def test_a_saved_state_resumes_here_and_in_torchs(runs, pair, source):
    for n, r, rank in each_rank(runs):
        s = rank["state dicts"]
        resumed = s["resumed", pair, "from", source]
        assert resumed["lr"] == (1e-2, 0.1)                   # the saved settings, not the new
        assert max_abs_diff(resumed["state"], s["uninterrupted"]) <= ADAMW_ATOL, (n, r)


# --- the interface --------------------------------------------------------------------------------

def test_zero_grad_schedulers_and_optimizers_own_keys(runs):
    for n, r, rank in each_rank(runs):
        i = rank["interface"]
        assert i["zeroed"] == [0.0] and i["none"] is True
        assert i["scheduler", "ZeroRedundancyOptimizer"] == i["scheduler", "SGD"]
        assert i["SGDWithNewKey"] == (pytest.approx([0.9, 0.9]), 0.1)
        assert i["SGDWithoutClosure"] == (pytest.approx([0.9, 0.9]), None)


REFUSED = {       # the same exception types as torch's (its test_constructor)
    "empty": "ValueError: ZeroRedundancyOptimizer: params is empty",
    "a tensor": "TypeError: ZeroRedundancyOptimizer: params must be an iterable of tensors or of "
                "parameter groups (dicts), got torch.FloatTensor",
    "a float": "TypeError: ZeroRedundancyOptimizer: params must be an iterable of tensors",
    "not all tensors": "TypeError: ZeroRedundancyOptimizer: params must be all tensors or all",
    "two dtypes": "ValueError: ZeroRedundancyOptimizer: every parameter must be dense and of one",
    "sparse": "ValueError: ZeroRedundancyOptimizer: every parameter must be dense and of one",
    "a group without params": "ValueError: ZeroRedundancyOptimizer: a parameter group without",
    "overlap_with_ddp": "ValueError: ZeroRedundancyOptimizer: overlap_with_ddp=True",
}


@pytest.mark.parametrize("case", REFUSED)
def test_the_constructor_refuses_what_torchs_refuses_in_one_line(runs, case):
    for n, r, rank in each_rank(runs):
        message = rank["interface"]["refused", case]
        assert message.startswith(REFUSED[case]) and "\n" not in message


def test_the_constructor_takes_generators_lists_and_groups(runs):
    for n, r, rank in each_rank(runs):
        assert rank["interface"]["accepted"] == ["none"] * 3


def test_a_second_owner_is_refused_in_one_line_a_second_optimizer_is_not(runs):
    for n, r, rank in each_rank(runs):
        i = rank["interface"]
        assert i["twice"] == "none"
        assert i["over an engine's"].startswith("ValueError: a parameter of shape (12, 14) is "
                                                "already owned by a minizero stage-0 engine")


# --- python -m minizero.bench --partitions --------------------------------------------------------

def test_whole_parameters_leave_a_large_embedding_alone_on_one_rank():
    """GPT-2 small's shapes (modelled, no training): at N = 4 one rank holds the 50,257 x 768
    embedding and nothing else, 1.36 x the least loaded; the flat partition is ceil(Ψ/N) each."""
    from minizero.lab.partitions import gpt2_small_shapes, modelled
    rows = {row["world_size"]: row for row in modelled(gpt2_small_shapes(), (2, 4, 8))}
    psi = 124_439_808
    for n, row in rows.items():
        assert sum(row["whole"]) == psi and row["flat"] == -(-psi // n)
    assert rows[4]["whole"][0] == rows[8]["whole"][0] == 50_257 * 768
    assert 1.3 < rows[4]["imbalance"] < 1.4 and rows[8]["imbalance"] > 3


def test_the_partitions_command_measures_both_sides(capsys):
    from minizero.cli import partitions
    from minizero.lab.partitions import measure_partitions
    assert partitions.main(["--world-size", "5"]) == 2
    assert "every N must be >= 2 and split the 12 rows" in capsys.readouterr().err
    flat, whole = measure_partitions((3,), "tiny")["rows"]              # Ψ = 4,690, 28 tensors
    psi, n = 4690, 3
    # flat: equal partitions of the buffer padded to 4,692; whole: each parameter once, no padding
    assert [r["stepped"] for r in flat["ranks"]] == [1564] * 3 and flat["ranks"][0]["padding"] == 2
    assert sum(r["stepped"] for r in whole["ranks"]) == psi and whole["ranks"][0]["padding"] == 0
    # a reduce-scatter and an all-gather, against DDP's all-reduce, the buffers' broadcast before
    # forward and one broadcast per rank; their ring bytes 2(N-1)/N and 3(N-1)/N of 4 Ψ
    assert flat["ranks"][0]["collectives"] == 2 and whole["ranks"][0]["collectives"] == 2 + n
    masks = 2 * 17 * 17                                                    # bool causal masks
    assert flat["ranks"][0]["sent"]["total"] == pytest.approx(2 * (n - 1) / n * 4692 * 4)
    assert whole["ranks"][0]["sent"]["total"] == pytest.approx((n - 1) / n * (3 * psi * 4 + masks))
