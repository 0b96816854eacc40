"""Real clients: Hugging Face models trained by minizero at every stage end where one process ends.

    python -m pytest tests/test_hf.py        # add -s to see the LoRA run's parameter bytes per rank

GPT-2 (tied head) and Llama at stages 0-3, with and without optimizer offload, GPT-2 with a peft
LoRA adapter (frozen base) at stages 2 and 3, and stage 3 with HF's activation checkpointing, each
against a single-process reference training the same model on the global batch (tests/_hf.py).
Skipped when transformers or peft is not installed (both are in the dev extra). One launch per world
size. Last, the example examples/finetune_lora.py runs a few steps as a user would run it.
"""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

from _hf import Case, reference_train, train_cases  # noqa: E402 (only once the skips have passed)

import minizero  # noqa: E402
from minizero.memory import estimate_breakdown, within_padding  # noqa: E402

# SGD is linear in the gradient, so 1e-6 catches any wrong scale (Adam is blind to one); AdamW
# divides by the gradient's own size and leaves rounding of ~lr * 1e-3 on near-zero gradients (lr
# 1e-3 here).
ATOL = {"sgd": 1e-6, "adamw": 1e-5}
# momentum: offload holds state
SGD = dict(optimizer="sgd", lr=0.5, optimizer_params=(("momentum", 0.9),))


def _cases() -> dict[str, Case]:
    cases = {}
    for model, opt in (("gpt2", {}), ("llama", SGD)):
        for stage in range(4):
            for offload in (False, True) if stage else (False,):
                cases[f"{model}-stage{stage}" + "-offload" * offload] = Case(
                    model, stage, offload, **opt
                )
    cases["gpt2-stage3-default-units"] = Case("gpt2", 3, units=False)
    cases["gpt2-stage3-N3"] = Case("gpt2", 3, world_size=3)    # 3 ranks: odd partitions and padding
    cases["lora-stage2"] = Case("lora", 2, lr=1e-2)
    # the fine-tuning case, N = 4
    cases["lora-stage3"] = Case("lora", 3, lr=1e-2, world_size=4, batch_size=8)
    cases["gpt2-stage3-checkpointing"] = Case("gpt2", 3, checkpointing=True)
    cases["gpt2-stage3-checkpointing-N3"] = Case("gpt2", 3, checkpointing=True, world_size=3)
    return cases


CASES = _cases()
# each has a test of its own below
OWN_TEST = ("lora-stage3", "gpt2-stage3-checkpointing", "gpt2-stage3-checkpointing-N3")


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    """{case name: [per-rank result]}: every case of a world size in one launch."""
    out = {}
    for n in sorted({case.world_size for case in CASES.values()}):
        names = [name for name, case in CASES.items() if case.world_size == n]
        per_rank = minizero.launch(train_cases, n, [CASES[name] for name in names], timeout=300)
        for i, name in enumerate(names):
            out[name] = [rank_results[i] for rank_results in per_rank]
    return out


def assert_matches_reference(case: Case, results: list[dict]) -> None:
    # Every key of the reference's state_dict, so a tied weight is compared under both of its
    # names (GPT-2: transformer.wte.weight and lm_head.weight, one Parameter whose gradient sums
    # both uses).
    expected = reference_train(case)["state_dict"]
    for res in results:
        got = res["state_dict"]
        assert got.keys() == expected.keys(), (
            f"rank {res['rank']}: keys differ: {got.keys() ^ expected.keys()}"
        )
        for key, value in expected.items():
            diff = (got[key].double() - value.double()).abs().max().item()
            assert diff <= ATOL[case.optimizer], (
                f"rank {res['rank']}, {key}: max |minizero - reference| = {diff:.3g} ({case})"
            )


@pytest.mark.parametrize("name", [name for name in CASES if name not in OWN_TEST])
def test_matches_single_process_reference(runs, name):
    assert_matches_reference(CASES[name], runs[name])


def test_default_units_are_the_decoder_layers(runs):
    """Without units=, stage 3 takes the first nn.ModuleList: for GPT-2 exactly transformer.h."""
    assert (
        runs["gpt2-stage3-default-units"][0]["unit_names"] == runs["gpt2-stage3"][0]["unit_names"]
    )


def test_lora_with_frozen_base_at_stage_3(runs):
    """The adapter trains like one process, and the frozen base is sharded too:
    parameter bytes per rank are (Ψ_trainable + Ψ_frozen)·4/N up to padding, the formula
    of minizero.memory.estimate(frozen=Ψ_f)."""
    case = CASES["lora-stage3"]
    assert_matches_reference(case, runs["lora-stage3"])
    for res in runs["lora-stage3"]:
        formula = estimate_breakdown(
            res["trainable"],
            case.world_size,
            3,
            param_bytes=4,
            grad_bytes=4,
            k=8,
            frozen=res["frozen"],
        )
        print(
            f"\nLoRA GPT-2, stage 3, N={case.world_size}, rank "
            f"{res['rank']}: params {res['memory']['params']} "
            f"bytes, formula {formula['params']:.0f}, whole fp32 model {res['model_bytes']}"
        )
        for cat in ("params", "grads", "optimizer"):
            assert within_padding(res["memory"][cat], formula[cat], case.world_size), (
                cat,
                res["memory"],
                formula,
            )
        assert res["memory"]["params"] <= 1.02 * formula["params"] + 4 * 16 * case.world_size


def test_activation_checkpointing_at_stage_3(runs):
    """HF's gradient_checkpointing_enable (non-reentrant) recomputes each decoder layer in backward.
    The units are those layers; transformers 5 checkpoints a layer's forward, not its __call__, so
    minizero's unit hooks stay outside the recomputation (the layer is still gathered for its
    backward when it runs)."""
    for name in ("gpt2-stage3-checkpointing", "gpt2-stage3-checkpointing-N3"):
        assert_matches_reference(CASES[name], runs[name])


def test_finetune_lora_example_runs():
    """examples/finetune_lora.py as a user runs it, with few steps: loss printed, memory next to
    the formula."""
    script = Path(__file__).parents[1] / "examples" / "finetune_lora.py"
    p = subprocess.run([sys.executable, str(script), "--steps", "3", "--world-size", "2"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "step   3/3  loss" in p.stdout and "formula" in p.stdout, p.stdout
