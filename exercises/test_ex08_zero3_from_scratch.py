"""Grader for exercise 8 (the capstone, ZeRO-3 from plain PyTorch):  pytest exercises -k ex08 -s

Two ranks (and, for the training check, four) train a 4-block GPT (a tied weight, a parameter
forward never uses) for 3 SGD steps of two accumulated micro-batches each, clipped by the global
norm, with your Zero3; and, in a launch of its own, the same run with minizero's stage 3, for
comparison (-s prints both). The grader's own hooks,
registered after yours, measure on the parameters' storages what is materialized, and read
comm.tally as each unit's forward ends.
"""

import dataclasses

import pytest

import _grading as g
from minizero import comm
from minizero.flat import padded_size
from minizero.lab.data import global_batch, local_batch
from minizero.lab.model import make_model
from minizero.lab.train import loss_fn, train_worker

# below every step's norm: clipping acts; 16 rows: two micro-batches on 2 ranks and on 4
CFG = g.config(stage=3, world_size=2, clip_grad_norm=0.05, batch_size=16,
               model_overrides={"unused_param": True, "n_layer": 4})
TRAINED_ON = (2, 4)                 # world sizes the training check runs (the others: CFG's)
# PyTorch's
REFUSED = ("torch.distributed.fsdp", "torch.distributed._composable", "torch.nn.parallel")
WORDS = 4                                                          # bytes per fp32 element


def materialized(model) -> int:
    """Bytes of the parameters' storages that hold memory now (a unit's parameters share one)."""
    held = {}
    for p in model.parameters():
        storage = p.untyped_storage()
        if storage.nbytes():
            held[storage.data_ptr()] = storage.nbytes()
    return sum(held.values())


def numels(model) -> list[int]:
    """Ψ_u of each unit, in forward order: the root (what no block holds, the tied weight once),
    then each block."""
    blocks = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    return [sum(p.numel() for p in model.parameters()) - sum(blocks), *blocks]


class Meter:
    """The grader's hooks: the peak of materialized parameter bytes (after each unit's pre-forward
    and each gradient's accumulation) and, when a block's forward ends, whether the next block's
    all-gather has been issued already (comm.tally, reset before each micro-batch)."""

    def __init__(self, model):
        self.model, self.peak, self.late = model, 0, None
        n = comm.world_size()
        gathered = [comm.ring_bytes("all_gather", WORDS * u, n) for u in numels(model)]
        for i, module in enumerate([model, *model.blocks]):
            module.register_forward_pre_hook(lambda *_: self.sample())
            if 1 <= i < len(gathered) - 1:          # a block with a block after it
                # the root, the blocks up to this one, and the next
                needed = sum(gathered[: i + 2])
                module.register_forward_hook(
                    lambda *_, i=i, needed=needed: self.prefetched(i, needed)
                )
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: self.sample())

    def sample(self) -> None:
        self.peak = max(self.peak, materialized(self.model))

    def prefetched(self, i: int, needed: float) -> None:
        """Block i - 1's forward ended; `needed`: the all-gather bytes of the root, the blocks up to
        it and the next one. Short of them: late, and whether the next block was still
        materialized (kept from an earlier pass: never freed) or not gathered yet (not
        prefetched)."""
        if self.late is None and comm.tally().get("all_gather", 0) < needed:
            self.late = (f"blocks.{i - 1}", materialized(self.model.blocks[i]) > 0)


def worker(module_name: str) -> dict:
    answer, rank, n = g.learner(module_name), comm.rank(), comm.world_size()
    model = make_model(CFG.model_config(), seed=CFG.seed)
    engine = g.call(answer.Zero3, model, [model, *model.blocks], CFG.lr, CFG.clip_grad_norm)
    meter, sent, norms, left = Meter(model), [], [], 0
    for step in range(CFG.steps):
        x, y = global_batch(step, CFG.batch_size, CFG.model_config().block_size, seed=CFG.seed)
        for micro in range(CFG.grad_accum):
            xm, ym = local_batch(x, y, rank, n, micro, CFG.grad_accum)
            comm.reset_tally()
            engine.backward(loss_fn(engine(xm), ym) / CFG.grad_accum)
            sent.append(comm.tally())
            left = max(left, materialized(model))       # after backward every unit is freed
        norms.append(engine.step())
    yours = {"peak": meter.peak, "late": meter.late, "sent": sent, "norms": norms, "left": left}
    return {"rank": rank, "state_dict": engine.full_state_dict(), "live": None, "yours": yours}


def minizero_worker(_: str) -> dict:
    """minizero's own stage 3 on the same run, for the comparison the grader prints."""
    result = train_worker(dataclasses.replace(CFG, return_state=False))
    return {"peak": result["memory"]["peak_params"], "sent": result["comm_bytes_per_step"]}


def launched(impl: str, world_size: int = CFG.world_size) -> list[dict]:
    __tracebackhide__ = True
    g.guard(impl, REFUSED)
    return g.launch_once(worker, world_size, impl)


def minizeros() -> list[dict]:
    return g.launch_once(minizero_worker, CFG.world_size, "minizero")


NEVER_FREED = ("a unit never freed is never all-gathered again (its storage is still there), so "
               "after a step it keeps its old values: free each unit after its forward and after "
               "its backward.")


def check_training(impl: str) -> None:
    __tracebackhide__ = True
    for n in TRAINED_ON:
        results = launched(impl, n)
        left = max(res["yours"]["left"] for res in results)
        hint = (f"After backward {left} bytes of full parameters were still materialized: "
                f"{NEVER_FREED}" if left else
                "Is every unit reduce-scattered with op avg, each micro-batch's partition added "
                "into the gradient shard, and the norm summed over every rank's shards before "
                "clipping?")
        g.assert_matches_reference(dataclasses.replace(CFG, world_size=n), results, atol=1e-5,
                                   hint=hint)


def check_memory(impl: str) -> None:
    __tracebackhide__ = True
    n = CFG.world_size
    units = [WORDS * padded_size(u, n) for u in numels(make_model(CFG.model_config()))]
    bound = units[0] + 2 * max(units[1:])
    for res, theirs in zip(launched(impl), minizeros()):
        peak, shard = res["yours"]["peak"], sum(units) // n
        print(f"rank {res['rank']}: parameters peak at Ψ/N + {peak} bytes materialized = "
              f"{shard + peak} bytes with your Zero3, {theirs['peak']} with minizero's stage 3")
        if peak > bound:
            raise AssertionError(
                f"rank {res['rank']}: {peak} bytes of full parameters were materialized at once, "
                f"more than the root unit and two blocks ({bound} bytes: the unit computing and "
                f"the one prefetched; all {len(units)} units are {sum(units)} bytes). Free each "
                "unit after its forward, and after its backward")


def check_bytes(impl: str) -> None:
    __tracebackhide__ = True
    n = CFG.world_size
    sizes = numels(make_model(CFG.model_config()))
    least = 3 * comm.ring_bytes("all_gather", WORDS * sum(sizes), n)
    most = 3 * comm.ring_bytes("all_gather", WORDS * sum(padded_size(u, n) for u in sizes), n)
    for res, theirs in zip(launched(impl), minizeros()):
        step = sum(sent["total"] for sent in res["yours"]["sent"][-CFG.grad_accum:])
        print(f"rank {res['rank']}: a step of {CFG.grad_accum} micro-batches sent {step:.0f} bytes "
              f"with your Zero3, {theirs['sent']['total']:.0f} with minizero's stage 3, which "
              "reduce-scatters once a step (no_sync keeps the first micro-batch's full gradients: "
              f"memory for bytes); 3Ψ(N-1)/N = {least:.0f} fp32 bytes")
        for micro, sent in enumerate(res["yours"]["sent"]):
            gathered = sent.get("all_gather", 0)
            if gathered < 2 / 3 * least:          # fewer than two all-gathers of every unit
                raise AssertionError(
                    f"rank {res['rank']}, micro-batch {micro}: all-gathered {gathered:.0f} bytes, "
                    f"expected 2Ψ(N-1)/N = {2 / 3 * least:.0f} (every unit for its forward and "
                    f"again for its backward): {NEVER_FREED}")
            if not least <= sent["total"] <= most:
                kinds = ", ".join(
                    f"{k} {v:.0f}"
                    for k, v in sent.items()
                    if k not in ("total", "intra_node", "inter_node") and v
                )
                raise AssertionError(
                    f"rank {res['rank']}, micro-batch {micro}: sent {sent['total']:.0f} bytes ("
                    f"{kinds}), expected 3Ψ(N-1)/N = {least:.0f} to {most:.0f} with the padding: "
                    "an all-gather in forward, one in backward, a reduce-scatter of the gradients"
                    + (
                        " (an all-reduce sends twice a reduce-scatter's bytes)"
                        if sent.get("all_reduce")
                        else ""
                    )
                )


def check_prefetch(impl: str) -> None:
    __tracebackhide__ = True
    for res in launched(impl):
        if res["yours"]["late"]:
            late, kept = res["yours"]["late"]
            if kept:
                raise AssertionError(f"rank {res['rank']}: when {late}'s forward ended, the next "
                                     "block was still materialized from an earlier pass and "
                                     f"nothing was all-gathered for it: {NEVER_FREED}")
            raise AssertionError(f"rank {res['rank']}: when {late}'s forward ended, the next "
                                 "block's all-gather had not been issued: prefetch it "
                                 f"(async_op=True) when {late}'s forward begins, so the network "
                                 f"works while {late} computes")


@pytest.mark.points(4)
def test_your_zero3_trains_like_one_process(impl):
    check_training(impl)


@pytest.mark.points(2)
def test_at_most_two_blocks_are_materialized(impl):
    check_memory(impl)


@pytest.mark.points(1)
def test_three_psi_bytes_per_micro_batch(impl):
    check_bytes(impl)


@pytest.mark.points(1)
def test_the_next_unit_is_prefetched(impl):
    check_prefetch(impl)
