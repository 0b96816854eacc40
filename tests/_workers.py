"""Worker functions for tests: importable by the launched processes (pytest puts tests/
on sys.path)."""

from __future__ import annotations

import os
import time

import torch


from minizero import comm
from minizero.beyond import mesh, quantize
from minizero.ring import ring_all_reduce


def collectives() -> dict:
    """Every collective of minizero.comm on rank-dependent data, with the tally after each."""
    r, n = comm.rank(), comm.world_size()
    out = {}
    comm.reset_tally()
    x = torch.arange(10, dtype=torch.float32) + 100 * r            # 10: not divisible by 3 or 4
    comm.all_reduce(x, op="sum")
    out["all_reduce"], out["tally_all_reduce"] = x, comm.tally()["all_reduce"]
    inp = torch.arange(4 * n, dtype=torch.float32) * (r + 1)
    mine = torch.empty(4)
    comm.reduce_scatter(mine, inp, op="avg")
    out["reduce_scatter"], out["tally_reduce_scatter"] = mine, comm.tally()["reduce_scatter"]
    full = torch.zeros(3 * n)
    full[3 * r: 3 * r + 3] = r + 1
    comm.all_gather(full, full[3 * r: 3 * r + 3])                  # in place
    out["all_gather"], out["tally_all_gather"] = full, comm.tally()["all_gather"]
    b = torch.full((5,), float(r))
    comm.broadcast(b, src=n - 1)
    out["broadcast"] = b
    torch.manual_seed(r)
    y = torch.randn(3, 7)                                        # 21 elements, non-contiguous below
    expected = y.clone()
    comm.all_reduce(expected, op="sum")
    comm.reset_tally()
    ring_all_reduce(y.t())
    out["ring_matches"] = torch.allclose(y, expected, atol=1e-6)
    out["tally_ring"] = comm.tally()["ring_all_reduce"]
    # all_to_all: chunk j of rank r's input [r*10 + j] lands as chunk r of rank j's output.
    sent = torch.arange(n, dtype=torch.float32) + 10 * r
    received = torch.empty(n)
    quantize.all_to_all(received, sent)
    out["all_to_all"] = received
    if n % 2 == 0:                                                 # a 2-D mesh: rows of 2 ranks
        shard, replicate = mesh.mesh(2)
        z = torch.full((3,), float(r))
        comm.all_reduce(z, op="sum", group=shard)
        out["row_sum"], out["row"] = z, shard.ranks
        w = torch.full((3,), float(r))
        comm.all_reduce(w, op="sum", group=replicate)
        out["column_sum"], out["column"] = w, replicate.ranks
        comm.reset_tally()
        part = torch.empty(2)
        comm.reduce_scatter(part, torch.arange(4.0) + r, op="sum", group=shard)
        out["row_reduce_scatter"], out["tally_group"] = part, comm.tally()["reduce_scatter"]
    return out


def raise_on(rank_to_fail: int, pid_dir: str) -> int:
    with open(os.path.join(pid_dir, f"{comm.rank()}.pid"), "w") as f:
        f.write(str(os.getpid()))
    if comm.rank() == rank_to_fail:
        raise ValueError("boom from the test")
    comm.barrier()                    # the survivors block here, waiting for the dead rank
    return comm.rank()


def rank_and_size() -> tuple[int, int]:
    return comm.rank(), comm.world_size()


def zero3_with_tied_units(steps: int) -> dict:
    """Stage 3 where the embedding and the head it is tied to are separate units: the shared
    weight must belong to their common ancestor (the root), be gathered whenever either runs, and
    get both gradients."""
    import functools

    import minizero
    from minizero.lab.data import global_batch, local_batch
    from minizero.lab.model import GPTConfig, make_model
    from minizero.lab.train import loss_fn
    model = make_model(GPTConfig.named("tiny"))
    units = [model.tok_emb, *model.blocks, model.head]
    engine = minizero.wrap(model, 3, functools.partial(torch.optim.SGD, lr=0.5), units=units)
    for step in range(steps):
        x, y = local_batch(*global_batch(step, 12, 17), comm.rank(), comm.world_size())
        engine.backward(loss_fn(engine(x), y))
        engine.step()
    return {
        "state_dict": engine.full_state_dict(),
        "rank": comm.rank(),
        "unit_names": engine.unit_names,
    }


def accumulate_without_no_sync(stage: int, options: dict, steps: int = 2) -> dict:
    """Two micro-batches per step, both backwards *outside* no_sync(): every stage must still
    average the sum of both exactly once (DDP all-reduces twice, stage 1 reduces at the step, stages
    2-3 add reduce-scattered buckets into the shard)."""
    import functools

    import minizero
    from minizero.lab.data import global_batch, local_batch
    from minizero.lab.model import GPTConfig, make_model
    from minizero.lab.train import loss_fn
    engine = minizero.wrap(make_model(GPTConfig.named("tiny")), stage,
                           functools.partial(torch.optim.SGD, lr=0.5), **options)
    for step in range(steps):
        x, y = global_batch(step, 12, 17)
        for micro in range(2):
            xm, ym = local_batch(x, y, comm.rank(), comm.world_size(), micro, 2)
            engine.backward(loss_fn(engine(xm), ym) / 2)
        engine.step()
    return {"rank": comm.rank(), "state_dict": engine.full_state_dict()}


def buckets_launched_during_backward(stage: int) -> tuple[int, int]:
    """(buckets, how many the reducer launched while backward was still running) for a small
    bucket size."""
    import functools

    import minizero
    from minizero.lab.data import global_batch, local_batch
    from minizero.lab.model import GPTConfig, make_model
    from minizero.lab.train import loss_fn
    engine = minizero.wrap(
        make_model(GPTConfig()),
        stage,
        functools.partial(torch.optim.SGD, lr=0.1),
        bucket_size=100_000,
    )
    from minizero.lab.record import recorded
    x, y = local_batch(*global_batch(0, 8, 32), comm.rank(), comm.world_size())
    with recorded("bucket launched") as launched:
        engine.backward(loss_fn(engine(x), y))
    return len(engine.layout.buckets), sum(f["in_backward"] for _, _, f in launched)


def build_sharded(kind: str, seed: int = 3) -> dict:
    """Build a model normally and under minizero.sharded_init; gather every partitioned parameter
    back and compare bit for bit; report what construction held (bytes)."""
    from minizero.construct import full_value, partition_of, sharded_init
    from minizero.lab.model import GPTConfig, make_model

    def build():
        if kind == "gpt":
            return make_model(GPTConfig.named("default"), seed=seed)
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(seed)
        return GPT2LMHeadModel(
            GPT2Config(vocab_size=64, n_positions=8, n_embd=16, n_layer=3, n_head=2)
        )

    normal = build()
    with sharded_init() as init:
        model = build()
    names = [n for n, _ in model.named_parameters()]
    return {
        "names": names,
        "differ": [n for (n, p), (_, q) in zip(model.named_parameters(), normal.named_parameters())
                   if not torch.equal(full_value(p), q.detach())],
        "unpartitioned": [n for n, p in model.named_parameters() if partition_of(p) is None],
        # after the context each parameter is absent (absent.py): NaN, one shared value of 4 bytes
        "held_after": sum({p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                           for p in model.parameters()}.values()),
        "absent_after": all(p.isnan().all() for p in model.parameters()),
        "peak": init.peak_bytes, "shard": init.shard_bytes,
        "model_bytes": sum(p.numel() * p.element_size() for p in normal.parameters()),
        "largest_child": max(
            sum(p.numel() * p.element_size() for p in m.parameters())
            for m in normal.modules()
            if m is not normal and not isinstance(m, torch.nn.ModuleList)
        ),
    }


def gathered_round_trip(stage: int, options: dict) -> dict:
    """engine.gathered(): read the full parameters on every rank, then let rank 1 write new
    values and check that every rank (and the optimizer's masters, through full_state_dict) has
    them afterwards."""
    import functools

    import minizero
    from minizero.lab.data import global_batch, local_batch
    from minizero.lab.model import GPTConfig, make_model
    from minizero.lab.train import loss_fn
    cfg = GPTConfig.named("tiny", frozen=("pos_emb.weight",))
    model = make_model(cfg)
    engine = minizero.wrap(model, stage, functools.partial(torch.optim.AdamW, lr=1e-2), **options)
    x, y = global_batch(0, 8, cfg.block_size)
    xm, ym = local_batch(x, y, comm.rank(), comm.world_size())
    engine.backward(loss_fn(engine(xm), ym))
    engine.step()
    before = engine.full_state_dict()
    names = dict(model.named_parameters())
    with engine.gathered():
        inner = engine.full_state_dict()                    # nested: the outer block stays gathered
        with torch.no_grad():
            engine(xm)                     # an evaluation inside the block leaves it gathered too
        read = {n: p.detach().float().clone() for n, p in names.items()}
    # outside: stage 3's parameters are absent (absent.py), the others are the trained values
    outside = {n: p.detach().float().clone() for n, p in names.items()}
    try:
        with torch.no_grad():
            next(iter(names.values())).add_(0)
        write_refused = False
    except RuntimeError:
        write_refused = True
    with engine.gathered(modifier_rank=1):
        if comm.rank() == 1:
            with torch.no_grad():
                for i, p in enumerate(names.values()):
                    p.fill_(0.5 + i / 64)                           # exact in bf16 too
    after = engine.full_state_dict()
    engine.backward(loss_fn(engine(xm), ym))                       # and training goes on from there
    engine.step()
    exact = options.get("dtype", "fp32") == "fp32"               # bf16 parameters are round(master)
    return {"read_ok": all(torch.equal(inner[n], before[n]) for n in names) and all(
                torch.equal(read[n], before[n]) if exact else
                           torch.allclose(read[n], before[n], rtol=1e-2, atol=1e-3) for n in names),
            "outside": {"shapes_kept": all(outside[n].shape == before[n].shape for n in names),
                        "absent": all(outside[n].isnan().all() for n in names),
                        "same": all(torch.equal(outside[n], read[n]) for n in names),
                        "write_refused": write_refused},
            "written_ok": all(torch.equal(after[n], torch.full_like(after[n], 0.5 + i / 64))
                              for i, n in enumerate(names)),
            "state": engine.full_state_dict()}


def gathered_round_trips(settings: list[tuple[int, dict]]) -> list[dict]:
    return [gathered_round_trip(stage, options) for stage, options in settings]


def fp16_runs(cfgs: list, inject: dict) -> dict:
    """Worker for test_loss_scale.py: fp16 training runs (train_several), then for each stage an inf
    injected into rank 1's gradient shard at the steps inject["steps"] (after the reduction, so only
    the rank owning that shard sees it)."""
    from minizero.lab.train import train_several
    return {
        "runs": train_several(cfgs),
        "injected": [_injected_overflow(s, **inject) for s in inject["stages"]],
    }


def _injected_overflow(stage: int, stages, steps: tuple, loss_scale: dict, n_steps: int) -> dict:
    import minizero
    from minizero.lab.model import make_model
    from minizero.lab.train import TrainConfig, forward_backward
    cfg = TrainConfig(
        stage=stage, model="tiny", dtype="fp16", loss_scale=loss_scale, batch_size=12, lr=1e-2
    )
    engine = minizero.wrap(make_model(cfg.model_config(), seed=0), stage, cfg.optimizer_factory(),
                           **cfg.engine_options())
    grad_parts = engine.grads.parts

    def poisoned():                            # the test hook: one element of rank 1's shard is inf
        parts = grad_parts()
        if comm.rank() == 1 and engine.step_count in steps:
            parts[0][0] = float("inf")
        return parts

    engine.grads.parts = poisoned
    scales, unchanged = [], []
    for step in range(n_steps):
        before = engine.full_state_dict()
        forward_backward(cfg, step, engine, engine.backward, engine.no_sync)
        engine.step()
        after = engine.full_state_dict()
        unchanged.append(all(torch.equal(before[k], after[k]) for k in before))
        scales.append(engine.loss_scale)
    adam_steps = sorted({float(s["step"]) for s in engine.optimizer.optimizer.state.values()})
    return {
        "scales": scales,
        "unchanged": unchanged,
        "skipped": engine.skipped_steps,
        "adam_steps": adam_steps,
        "state": after,
    }


def exit_leaving_the_pipe_open(seconds: float) -> None:
    """Rank 0 starts a process that outlives it holding every inherited descriptor (the result
    pipe's writing end among them) for `seconds`, then exits without a word; the others return."""
    if comm.rank() != 0:
        return None
    if os.fork() == 0:
        time.sleep(seconds)
        os._exit(0)
    os._exit(3)
