"""fp16 loss scaling (minizero/loss_scale.py): the scaler's rule on a synthetic overflow pattern,
fp16 runs at every stage against one process taking the same decisions, and the global overflow
check: an inf in one rank's gradient shard makes every rank skip the step."""

import pytest
import torch
from _checks import (
    assert_comm_matches_formula,
    assert_matches_reference,
    assert_memory_matches_formula,
    reference,
)
from _workers import fp16_runs

import minizero
from minizero.lab.reference import tolerance
from minizero.lab.train import TrainConfig
from minizero.loss_scale import LossScaler

# --- the rule, no processes -----------------------------------------------------------------------


def trajectory(scaler: LossScaler, overflows: str) -> list[float]:
    out = []
    for c in overflows:                      # "x": the step overflowed, ".": it did not
        scaler.update(c == "x")
        out.append(scaler.scale)
    return out


def test_hysteresis_and_growth_window_follow_deepspeed():
    scaler = LossScaler({"initial_scale_power": 4, "loss_scale_window": 2, "hysteresis": 2})
    # 1st overflow uses up the hysteresis credit, the 2nd halves; after 2 good steps the 3rd doubles
    # (and restores the credit); from then on every 2nd good step doubles; non-consecutive overflows
    # still spend the credit (DeepSpeed's consecutive_hysteresis off), and once it is spent each
    # overflow halves.
    assert trajectory(scaler, "xx.....x.xx...") == [
        16, 8, 8, 8, 16, 16, 32, 32, 32, 16, 8, 8, 8, 16,
    ]
    assert scaler.skipped_steps == 5


def test_defaults_are_deepspeeds_and_the_minimum_holds():
    scaler = LossScaler()
    assert (scaler.scale, scaler.window, scaler.hysteresis, scaler.min_scale) == (
        2.0**16,
        1000,
        2,
        1.0,
    )
    assert trajectory(scaler, "." * 1000) == [2.0 ** 16] * 1000
    assert trajectory(scaler, ".") == [2.0 ** 17]
    low = LossScaler({"initial_scale_power": 2, "hysteresis": 1, "min_loss_scale": 2})
    assert trajectory(low, "x") == [2.0]
    with pytest.raises(RuntimeError, match="minimum loss scale 2"):
        low.update(True)


def test_static_scale_never_moves_but_overflows_still_skip():
    scaler = LossScaler(128.0)
    assert trajectory(scaler, "x." * 3) == [128.0] * 6 and scaler.skipped_steps == 3


@pytest.mark.parametrize(
    "bad, error",
    [
        (0.0, "loss_scale must be > 0"),
        ({"window": 2}, "unknown option"),
        ({"hysteresis": 0}, "hysteresis must be an integer >= 1"),
        ("dynamic", "None, a number or a dict"),
    ],
)
def test_bad_options_are_one_line_errors(bad, error):
    with pytest.raises((ValueError, TypeError), match=error):
        LossScaler(bad)


# --- fp16 runs: one launch per world size ---------------------------------------------------------

# Scales far from overflow: with N ranks the fp16 *sum* inside the reduction overflows N times
# sooner than one process would (gloo and NCCL add before they divide), so a scale at the edge would
# skip steps in one and not the other. Window 2: the scale doubles at steps 2, 4 and 6, all ranks
# and the reference alike.
LOSS_SCALE = {"initial_scale_power": 10, "loss_scale_window": 2}
EXPECTED_SCALES = [1024.0, 1024.0, 2048.0, 2048.0, 4096.0, 4096.0, 8192.0]
# Injected: an inf in rank 1's shard at steps 1 and 2; hysteresis 2: step 1 is skipped at the same
# scale, step 2 is skipped and halves it.
INJECT = {"steps": (1, 2), "loss_scale": {"initial_scale_power": 10, "hysteresis": 2}, "n_steps": 4,
          "stages": (0, 1, 2, 3)}


def configs(n: int) -> dict[str, TrainConfig]:
    base = dict(world_size=n, steps=len(EXPECTED_SCALES), batch_size=24, model="tiny", dtype="fp16",
                loss_scale=LOSS_SCALE, return_state=True)
    out = {f"stage{s}": TrainConfig(stage=s, optimizer="adamw", lr=1e-2, **base) for s in range(4)}
    out["stage2_offload"] = TrainConfig(stage=2, offload=True, optimizer="adamw", lr=1e-2, **base)
    # SGD is linear in the gradient: a wrong unscale fails here, and a clip on the scaled norm below
    out["stage1_sgd"] = TrainConfig(stage=1, optimizer="sgd", lr=0.5, **base)
    out["stage3_sgd_clip"] = TrainConfig(
        stage=3, optimizer="sgd", lr=0.5, clip_grad_norm=0.3, **base
    )
    return out


def memory_configs(n: int) -> dict[str, TrainConfig]:
    """The default GPT in fp16: the paper's own accounting (2 + 2 + K, K = 12 with Adam's fp32
    master). (At 2**16 its first steps overflow, and a skipped step sends no all-gather: the scale
    stays low.)"""
    return {
        f"memory_stage{s}": TrainConfig(
            stage=s, world_size=n, steps=2, batch_size=24, dtype="fp16", loss_scale=LOSS_SCALE
        )
        for s in (1, 3)
    }


@pytest.fixture(scope="module")
def runs():
    out = {}
    for n in (2, 3):
        cfgs = {**configs(n), **memory_configs(n)}
        per_rank = minizero.launch(fp16_runs, n, list(cfgs.values()), INJECT)
        for i, (name, cfg) in enumerate(cfgs.items()):
            out[(n, name)] = (cfg, [r["runs"][i] for r in per_rank])
        for i, stage in enumerate(INJECT["stages"]):
            out[(n, "injected", stage)] = [r["injected"][i] for r in per_rank]
    return out


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", list(configs(2)))
def test_fp16_matches_one_process_with_the_same_scaler(runs, n, name):
    cfg, results = runs[(n, name)]
    ref = reference(cfg)
    assert ref["loss_scales"] == EXPECTED_SCALES and ref["skipped_steps"] == 0
    for res in results:
        assert res["loss_scales"] == ref["loss_scales"], f"rank {res['rank']}: scale trajectory"
        assert res["skipped_steps"] == ref["skipped_steps"]
    assert_matches_reference(cfg, results, atol=tolerance("fp16"))


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("stage", INJECT["stages"])
def test_inf_in_one_shard_makes_every_rank_skip(runs, n, stage):
    ranks = runs[(n, "injected", stage)]
    for r, res in enumerate(ranks):
        where = f"rank {r} of {n}, stage {stage}"
        assert res["unchanged"] == [False, True, True, False], (
            f"{where}: parameters changed on a skipped step"
        )
        assert res["scales"] == [1024.0, 1024.0, 512.0, 512.0], f"{where}: scales {res['scales']}"
        assert res["skipped"] == 2 and res["adam_steps"] == [2.0], (
            f"{where}: optimizer stepped on a skip"
        )
        for name, value in res["state"].items():
            assert torch.equal(value, ranks[0]["state"][name]), (
                f"{where}: {name} differs from rank 0"
            )


@pytest.mark.parametrize("n", (2, 3))
@pytest.mark.parametrize("name", list(memory_configs(2)))
def test_fp16_memory_and_comm_match_the_paper(runs, n, name):
    assert_memory_matches_formula(*runs[(n, name)])
    assert_comm_matches_formula(*runs[(n, name)])
