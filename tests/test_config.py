"""DeepSpeed-style configs: every example runs, flags override the file, bad configs are one line + exit 2."""

import json
from pathlib import Path

import pytest

from minizero.config import ConfigError, load_deepspeed_config
from minizero.run import main

EXAMPLES = sorted((Path(__file__).parent.parent / "examples").glob("*.json"))


def test_the_issue_example_maps_to_stage_2_with_offload():
    overrides, warnings = load_deepspeed_config(EXAMPLES[0].parent / "ds_config_zero2_offload.json", 4)
    assert overrides == {"batch_size": 64, "grad_accum": 2, "stage": 2, "offload": "optimizer"}
    assert warnings == []


def test_batch_size_rule_derives_the_missing_one():
    assert load_deepspeed_config({"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4)[0] \
        == {"batch_size": 24, "grad_accum": 2}
    assert load_deepspeed_config({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}, 4)[0] \
        == {"batch_size": 24, "grad_accum": 2}


def test_optimizer_precision_buckets_prefetch():
    cfg = {"bf16": {"enabled": True}, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "weight_decay": 0.1}},
           "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000, "stage3_prefetch_bucket_size": 0,
                                 "offload_param": {"device": "cpu"}}}
    overrides, _ = load_deepspeed_config(cfg, 2)
    assert overrides == {"dtype": "bf16", "clip_grad_norm": 0.5, "stage": 3, "offload": "params",
                         "bucket_size": 2000, "prefetch": False, "optimizer": "adamw", "lr": 1e-3,
                         "optimizer_params": {"betas": (0.8, 0.9), "weight_decay": 0.1}}


def test_not_implemented_keys_warn_by_name():
    _, warnings = load_deepspeed_config({"fp16": {"enabled": True}, "scheduler": {"type": "WarmupLR"},
                                         "zero_optimization": {"stage": 2, "overlap_comm": False,
                                                               "allgather_bucket_size": 5e8}}, 2)
    text = "\n".join(warnings)
    for key in ("'fp16'", "'scheduler'", "overlap_comm", "allgather_bucket_size"):
        assert key in text
    assert load_deepspeed_config({"fp16": {"enabled": False}}, 2)[1] == []


@pytest.mark.parametrize("cfg, message", [
    ({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3},
     "train_batch_size 64 != train_micro_batch_size_per_gpu x gradient_accumulation_steps x world size"),
    ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": "two"}}, "must be an integer"),
    ({"train_batch_size": 0}, "train_batch_size must be >= 1"),
    ({"zero_optimisation": {"stage": 2}}, "unknown key 'zero_optimisation'"),
    ({"zero_optimization": {"stagee": 2}}, "did you mean 'zero_optimization.stage'"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "needs zero_optimization.stage 3"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}, "NVMe offload is not implemented"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type must be one of"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "not a parameter of SGD"),
    ({"bf16": True}, "'bf16' must be an object"),
])
def test_bad_configs_raise_one_line(cfg, message):
    with pytest.raises(ConfigError, match=None) as info:
        load_deepspeed_config(cfg, 4)
    assert message in str(info.value) and "\n" not in str(info.value)


def _write(tmp_path, text):
    path = tmp_path / "ds.json"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("text, message", [
    ('{"train_batch_size": 64, "gradient_accumulation_steps": 3}', "not divisible"),
    ('{"zero_optimization": {"stage": 4}}', "stage must be 0, 1, 2 or 3"),
    ('{"train_batch_size": 64,}', "is not valid JSON"),
])
def test_cli_bad_config_exits_2(tmp_path, capsys, text, message):
    assert main(["--config", _write(tmp_path, text), "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_cli_missing_config_file_exits_2(capsys):
    assert main(["--config", "/nonexistent/ds.json"]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_every_example_runs_and_flags_override_the_file(tmp_path):
    for path in EXAMPLES:
        out = tmp_path / f"{path.stem}.json"
        # --stage 3 overrides the file's stage where the file allows it (offload_param needs 3 anyway)
        assert main(["--config", str(path), "--world-size", "2", "--steps", "2", "--model", "tiny",
                     "--quiet", "--json", str(out), "--stage", "3"]) == 0, path.name
        data = json.loads(out.read_text())
        assert data["stage"] == 3 and len(data["losses"]) == 2
    out = tmp_path / "override.json"
    assert main(["--config", str(EXAMPLES[0].parent / "ds_config_zero2_offload.json"), "--world-size", "2",
                 "--steps", "1", "--model", "tiny", "--quiet", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["offload"] == "optimizer"     # from the file
