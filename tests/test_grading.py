"""The graders can fail: each rejects plausible wrong answers (exercises/mutants/) with a message
that says what is wrong; the solutions score full marks and the untouched skeletons zero (via
minizero.grade)."""

import importlib
import json
import subprocess
import sys
import warnings

import pytest

from minizero.cli.grade import main
from minizero.lab.grade import EXERCISES, verdict

# graders, answers and mutants are imported by name from there
sys.path.insert(0, str(EXERCISES))
import _grading

EXERCISE_NAMES = sorted(p.stem for p in EXERCISES.glob("ex[0-9][0-9]_*.py"))

# (grader, its check, mutant, what the failure message must say)
MUTANTS = [
    ("test_ex01_ring_allreduce", "check", "ex01_no_allgather_phase",
     r"rank 0, .* expected the sum over ranks"),
    ("test_ex01_ring_allreduce", "check", "ex01_whole_tensor",
     r"sent 80 bytes through exchange.*, 64 bytes"),
    ("test_ex02_ddp_bucket", "check_buckets", "ex02_bucket_overflow",
     r"expected buckets \[\[0, 1\], \[2\]"),
    ("test_ex02_ddp_bucket", "check_training", "ex02_sum_not_average",
     r"rank 0, .*averaged over the ranks"),
    ("test_ex02_ddp_bucket", "check_training", "ex02_blocking",
     r"bucket 0: all_reduce_bucket returned None"),
    ("test_ex03_grad_accumulation", "check_bytes", "ex03_reduce_every_micro_batch",
     r"sent 528 bytes, expected 264, .*: 2 x that, did you all-reduce after every micro-batch"),
    ("test_ex03_grad_accumulation", "check_training", "ex03_averages_twice",
     r"update is 0.5\d* x the ref"),
    ("test_ex04_zero1_partition", "check_partitions", "ex04_no_padding",
     r"padded_numel\(1, 2\) = 1, expected"),
    ("test_ex04_zero1_partition", "check_partitions", "ex04_floor_plus_one",
     r"padded_numel\(1, 1\) = 2"),
    ("test_ex04_zero1_partition", "check_training", "ex04_no_all_gather",
     r"rank \d, .* after 3 SGD steps"),
    ("test_ex05_clip_global_norm", "check_clipping", "ex05_local_norm",
     r"rank 0, clipping applies .*: partition 0 was scaled by 0.539, expected 0.25"),
    ("test_ex05_clip_global_norm", "check_bytes", "ex05_gathers_the_gradients",
     r"sent 128 bytes to clip 16 elements; .* all-reduce the sum of squares"),
    ("test_ex06_zero2_reduce_scatter", "check_training", "ex06_sum_not_average",
     r"update .* x the reference.*One step alone: 3 x .*exactly N = 3, a sum over the ranks"),
    ("test_ex06_zero2_reduce_scatter", "check_training", "ex06_grads_not_freed",
     r"p\.grad of .* still set"),
    ("test_ex07_zero3_hooks", "check_training", "ex07_no_free_after_forward",
     r"post_forward: after it, unit.full still holds"),
    ("test_ex07_zero3_hooks", "check_training", "ex07_no_gather_before_backward",
     r"pre_backward: after it, its parameters are not materialized"),
    ("test_ex07_zero3_hooks", "check_training", "ex07_no_prefetch",
     r"unit 'blocks.1', pre_backward: this unit was not prefetched"),
    ("test_ex07_zero3_hooks", "check_training", "ex07_calls_unit_gather",
     r"pre_forward: your hook called unit.gather\(\)"),
    ("test_ex08_zero3_from_scratch", "check_memory", "ex08_no_free_after_forward",
     r"rank 0: 35816 bytes of full parameters were materialized at once, .* \(18792 bytes"),
    ("test_ex08_zero3_from_scratch", "check_prefetch", "ex08_never_frees",
     r"when blocks.0's forward ended, the next block was still materialized .*never freed"),
    ("test_ex08_zero3_from_scratch", "check_training", "ex08_never_frees",
     r"After backward 35816 bytes .* still materialized: a unit never freed"),
    ("test_ex08_zero3_from_scratch", "check_prefetch", "ex08_no_prefetch",
     r"when blocks.0's forward ended, the next block's all-gather had not been issued"),
    ("test_ex08_zero3_from_scratch", "check_bytes", "ex08_all_reduce_gradients",
     r"sent 71632 bytes \(all_gather 35816, all_reduce 35816\), expected 3Ψ\(N-1\)/N = 53718"),
    ("test_ex08_zero3_from_scratch", "check_training", "ex08_local_norm",
     r"update of this tensor is 1.2\d* x"),
    ("test_ex09_offload_step", "check_training", "ex09_no_copy_back",
     r"differ from the updated masters"),
    ("test_ex09_offload_step", "check_training", "ex09_device_grads",
     r"host_grads\[0\] does not hold"),
    ("test_ex10_global_overflow", "check_decisions", "ex10_local_only",
     r"rank 0, step 1: your found_overflow returned False, expected True: rank 1's .* flags"),
    ("test_ex10_global_overflow", "check_training", "ex10_local_only",
     r"rank \d, .*: after 4 fp16 steps your run differs from minizero's by up to \d"),
    ("test_ex10_global_overflow", "check_decisions", "ex10_inf_not_nan",
     r"rank \d, step 2: .* returned False, expected True: rank 0's .* held a nan .*isfinite"),
    ("test_ex10_global_overflow", "check_training", "ex10_inf_not_nan",
     r"differs from minizero's by up to nan"),
    ("test_ex11_checkpoint_unit", "check_memory", "ex11_keeps_the_graph",
     r"rank 0: .* is \d+ bytes, 100% of the \d+ bytes saved without checkpointing"),
    ("test_ex11_checkpoint_unit", "check_training", "ex11_no_input_grads",
     r"rank 0, .* x the reference's"),
    ("test_ex11_checkpoint_unit", "check_training", "ex11_recompute_without_grad",
     r"rank \d, blocks\.3: the recompute in backward ran with grad disabled"),
    ("test_ex12_predict_and_plan", "check_predictions", "ex12_no_master_copy",
     r"model_states\(.*bf16.*\)\['optimizer'\] = 0.0, expected .* \(4 per parameter\)"),
    ("test_ex12_predict_and_plan", "check_predictions", "ex12_stage3_sends_2psi",
     r"bytes_per_step\(.*stage 3.*\) = .*, expected .* \(2.625 Ψ elements"),
    ("test_ex12_predict_and_plan", "check_launch", "ex12_plan_without_activations",
     r"your plan .*'micro_batch': 8} did not train under a cap of \d+ MB .*: rank \d failed: "
     r"out of memory"),
    ("test_ex12_predict_and_plan", "check_launch", "ex12_plan_too_cautious",
     r"your plan .*'micro_batch': 1} trains under a cap .*, but so does one row more"),
    ("test_ex13_block_quantize", "check_error_bound", "ex13_scale_255",
     r"rows \[3, 50\]: element \d+ .* an error of \d.* x absmax/254 .* scale = absmax / 127"),
    ("test_ex13_block_quantize", "check_bytes", "ex13_not_int8",
     r"rank \d: the .* sent \d.* bytes .* your quantize, \d.* with minizero's: q must be int8"),
    ("test_ex14_overlap_buckets", "check_overlap", "ex14_launch_at_finish",
     r"rank \d: your step took \d+ ms for \d+ ms of compute and 320 ms of communication"),
    ("test_ex14_overlap_buckets", "check_policy", "ex14_out_of_order",
     r"launched in the order \[0, 1, 3, 2, 4, 5, 7, 6, .*\], .*: launch strictly 0, 1, 2"),
    ("test_ex14_overlap_buckets", "check_policy", "ex14_unbounded",
     r"16 buckets were in flight at once, at most max_in_flight = 2"),
    ("test_ex14_overlap_buckets", "check_overlap", "ex14_blocking",
     r"your step took .* never wait for one you just started"),
    ("test_ex14_overlap_buckets", "check_bucket_size", "ex14_one_bucket",
     r"latency-bound link .*, your 400 MB buckets make the step 325.0 ms; .* beats the default"),
    ("test_ex14_overlap_buckets", "check_prefetch", "ex14_gather_on_use",
     r"depth 1: the pass took 347.1 ms for 240 ms of compute .*: start the next visits' gathers"),
    ("test_ex14_overlap_buckets", "check_prefetch", "ex14_prefetch_next_number",
     r"depth 1: all-gathers issued for units \[0, .*\], expected .*: each unit once per pass"),
    ("test_ex14_overlap_buckets", "check_prefetch", "ex14_free_every_unit",
     r"depth 1: all-gathers issued for units \[0, 1, 2, 3, 4, 5, 6, 7, 7, .*forward's last unit"),
    ("test_ex14_overlap_buckets", "check_prefetch", "ex14_never_free",
     r"depth 1: 8 units materialized at once, at most depth \+ 1 = 2: free each unit"),
    ("test_ex14_overlap_buckets", "check_bucket_size", "ex14_four_buckets",
     r"bandwidth-bound link .*, your 100 MB buckets make the step 265.0 ms; .*: come within 1.05"),
    ("test_ex14_overlap_buckets", "check_bucket_size", "ex14_default_bucket",
     r"on the latency-bound link .*, your 25 MB buckets .* 315.6 ms; the 25 MB default 315.6 ms, "
     r"12 buckets of 33.3 MB 270.0 ms .*: on a latency-bound link, choose a size that beats"),
    ("test_ex15_tensor_parallel_linear", "check_shards", "ex15_wrong_split_axis",
     r"rank 0: the first weight shard is \[12, 2\], expected \[4, 6\]: a column-parallel layer "
     r"splits the outputs"),
    ("test_ex15_tensor_parallel_linear", "check_forward", "ex15_g_averages",
     r"rank 0: the output differs .*: it is 1/3 of it, g must sum the partial outputs"),
    ("test_ex15_tensor_parallel_linear", "check_backward", "ex15_no_all_reduce_in_backward",
     r"rank 0: the input's gradient is not the whole MLP's: .* f's backward must all-reduce"),
    ("test_ex16_muon_designs", "check_straddlers", "ex16_slice_alone",
     r"rank 0, stage 1: your O of up.weight differs .*: Newton-Schulz of a piece is not the piece"),
    ("test_ex16_muon_designs", "check_straddlers", "ex16_misses_a_straddler",
     r"rank 1, stage 1: your O of .* \(62 zeros where minizero's has 0\): a matrix that begins in "
     r"another rank's partition straddles into yours"),
    ("test_ex16_muon_designs", "check_round_robin", "ex16_keeps_its_own_update",
     r"rank 0, stage 1: your O .*: the owner's O never reached this rank"),
    ("test_ex16_muon_designs", "check_round_robin", "ex16_every_rank_writes",
     r"rank 0, stage 1: your O .*: it is 3.00 x minizero's"),
    ("test_ex17_dim0_shards", "check_shards", "ex17_no_padding",
     r"rank 0 of 2, a parameter of shape \[5, 4\]: your shard is \[2, 4\], expected \[3, 4\] "
     r"\(5 // 2 rows: floor, not ceil, and no padding\?\)"),
    ("test_ex17_dim0_shards", "check_shards", "ex17_wrong_rank_rows",
     r"rank 0 of 2, .*: your shard holds rows \[3, 4, 5\], rank 1's; expected rows \[0, 1, 2\]"),
    ("test_ex17_dim0_shards", "check_reduce", "ex17_sum_not_average",
     r"rank 0, first.weight's gradient: .*they are 3 x it: exactly N = 3: a sum over the ranks"),
    ("test_ex17_dim0_shards", "check_reduce", "ex17_all_reduce_grads",
     r"sent 128 bytes \(all_reduce 128\), .*: an all-reduce sends twice what a reduce-scatter"),
    ("test_ex17_dim0_shards", "check_gather", "ex17_gather_keeps_padding",
     r"rank 0, first.weight: your all_gather_param returned \[6, 4\], expected \[5, 4\]: drop "
     r"the padding rows"),
]
# Every exercise refuses an answer borrowed from minizero (or PyTorch): one mutant each imports it.
# The guard reads the source, so the grader's first check rejects it before launching anything.
MUTANTS += [(f"test_{name}", check, f"{name[:4]}_imports_the_answer",
             r"line \d+: uses .*, which does what this exercise asks you to build")
            for name, check in [("ex01_ring_allreduce", "check"),
                                ("ex02_ddp_bucket", "check_buckets"),
                                ("ex03_grad_accumulation", "check_training"),
                                ("ex04_zero1_partition", "check_partitions"),
                                ("ex05_clip_global_norm", "check_clipping"),
                                ("ex06_zero2_reduce_scatter", "check_training"),
                                ("ex07_zero3_hooks", "check_training"),
                                ("ex08_zero3_from_scratch", "check_training"),
                                ("ex09_offload_step", "check_training"),
                                ("ex10_global_overflow", "check_decisions"),
                                ("ex11_checkpoint_unit", "check_training"),
                                ("ex12_predict_and_plan", "check_predictions"),
                                ("ex13_block_quantize", "check_error_bound"),
                                ("ex14_overlap_buckets", "check_policy"),
                                ("ex15_tensor_parallel_linear", "check_shards"),
                                ("ex16_muon_designs", "check_straddlers"),
                                ("ex17_dim0_shards", "check_shards")]]


def load(grader: str):
    # @pytest.mark.points is registered by exercises/conftest.py only
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", pytest.PytestUnknownMarkWarning)
        return importlib.import_module(grader)


@pytest.mark.parametrize(
    "grader, check, mutant, message", MUTANTS, ids=[f"{m[2]}-{m[1]}" for m in MUTANTS]
)
def test_grader_rejects_a_plausible_wrong_answer(grader, check, mutant, message):
    with pytest.raises(AssertionError, match=message):
        getattr(load(grader), check)(f"mutants.{mutant}")


def test_every_mutant_is_used_and_every_exercise_has_one():
    on_disk = {p.stem for p in (EXERCISES / "mutants").glob("ex*.py")}
    assert on_disk == {m[2] for m in MUTANTS}
    assert {m[2][:4] for m in MUTANTS} == {name[:4] for name in EXERCISE_NAMES}
    assert [name[:4] for name in EXERCISE_NAMES] == [f"ex{i:02d}" for i in range(1, 18)]   # no gap


@pytest.mark.parametrize("name", EXERCISE_NAMES)
def test_solutions_show_the_answer_instead_of_importing_it(name):
    grader = load(f"test_{name}")
    # raises if it borrows
    _grading.guard(f"solutions.{name}", getattr(grader, "REFUSED", ()),
                   getattr(grader, "ALLOWED", _grading.ALLOWED))


def grade(tmp_path, *flags) -> tuple[subprocess.CompletedProcess, dict | None]:
    out = tmp_path / "score.json"
    proc = subprocess.run([sys.executable, "-m", "minizero.grade", *flags, "--json", str(out)],
                          capture_output=True, text=True, timeout=600)
    return proc, json.loads(out.read_text()) if out.exists() else None


def test_solutions_score_full_marks(tmp_path):
    proc, score = grade(tmp_path, "--solutions", "--expect-full")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    # every exercise is graded
    assert [row["exercise"] for row in score["exercises"]] == EXERCISE_NAMES
    assert score["points"] == score["max_points"] >= len(EXERCISE_NAMES)
    assert "total" in proc.stdout and f"{score['points']}/{score['max_points']}" in proc.stdout


def test_untouched_skeletons_score_zero(tmp_path):
    proc, score = grade(tmp_path, "--expect-zero")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert [row["exercise"] for row in score["exercises"]] == EXERCISE_NAMES
    assert score["points"] == 0 and score["max_points"] > 0
    for test in score["tests"]:      # failing for the right reason, not because a grader is broken
        assert "not implemented yet" in test["message"], test


def test_expect_flags_decide_the_exit_code():
    rows = [{"exercise": "ex01_x", "points": 3, "max_points": 3, "passed": 1, "tests": 1},
            {"exercise": "ex02_y", "points": 0, "max_points": 3, "passed": 0, "tests": 2}]
    assert verdict(rows) == (0, "")
    zero = "expected every exercise to score zero: ex01_x scored"
    assert verdict(rows, expect_zero=True) == (1, zero)
    assert verdict(rows, expect_full=True) == (1, "expected every test to pass: ex02_y did not")
    assert (
        verdict(rows[1:], expect_zero=True)[0] == 0 and verdict(rows[:1], expect_full=True)[0] == 0
    )


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--expect-zero", "--expect-full"], "not allowed with"),
        (["--exercises", "/nonexistent"], "no graders in /nonexistent"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
