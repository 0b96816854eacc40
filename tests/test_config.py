"""DeepSpeed-style configs: the mapping, the warning/error policy, flags over the file, every
example runs."""

import json
import re
from pathlib import Path

import pytest

from minizero.cli.run import build_parser, config_from_args, main
from minizero.deepspeed.config import (
    ALWAYS_ON, KEYS, NOT_IMPLEMENTED, ConfigError, build_scheduler, load_deepspeed_config,
)
from minizero.deepspeed.config_keys import markdown

ROOT = Path(__file__).parent.parent
EXAMPLES = sorted((ROOT / "examples").glob("ds_config_*.json"))
ZERO2_OFFLOAD = ROOT / "examples" / "ds_config_zero2_offload.json"
FP16 = ROOT / "examples" / "ds_config_fp16.json"


def test_the_issue_example_maps_to_stage_2_with_offload():
    assert json.loads(ZERO2_OFFLOAD.read_text()) == {
        "train_batch_size": 64, "gradient_accumulation_steps": 2,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    overrides, warnings = load_deepspeed_config(ZERO2_OFFLOAD, 4)
    # no gradient_clipping: DeepSpeed's default, 1.0
    assert overrides == {
        "batch_size": 64,
        "grad_accum": 2,
        "stage": 2,
        "offload": "optimizer",
        "clip_grad_norm": 1.0,
    }
    assert warnings == []


def test_batch_size_rule_derives_the_missing_one():
    clip = {"clip_grad_norm": 1.0}
    assert load_deepspeed_config(
        {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, 4
    )[0] == {"batch_size": 24, "grad_accum": 2, **clip}
    assert load_deepspeed_config({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3}, 4)[
        0
    ] == {"batch_size": 24, "grad_accum": 2, **clip}
    assert load_deepspeed_config({"train_batch_size": 24, "gradient_accumulation_steps": 3}, 4)[0] \
        == {"batch_size": 24, "grad_accum": 3, **clip}


def test_precision_buckets_prefetch_offload():
    cfg = {
        "bf16": {"enabled": True},
        "gradient_clipping": 0.5,
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 1000,
            "stage3_prefetch_bucket_size": 0,
        },
    }
    assert load_deepspeed_config(cfg, 2) == ({"dtype": "bf16", "clip_grad_norm": 0.5, "stage": 2,
                                              "bucket_size": 2000, "prefetch": False}, [])
    cfg = {"gradient_clipping": 0, "zero_optimization": {"stage": 3, "reduce_bucket_size": 1000,
                                                         "offload_param": {"device": "cpu"}}}
    overrides, warnings = load_deepspeed_config(cfg, 2)
    assert overrides == {
        "clip_grad_norm": None,
        "stage": 3,
        "offload": "params",
        "bucket_size": 4000,
    }
    assert warnings == ["'zero_optimization.reduce_bucket_size' has no effect at stage 3: "
                        "each unit's gradients form one bucket"]


def test_a_reduce_bucket_size_of_0_is_one_bucket_per_parameter():
    """transformers' zero3 test config has reduce_bucket_size 0: one bucket per parameter in the
    DeepSpeed it was written for (0.19.8's parser refuses 0)."""
    import torch

    from minizero.flat import by_size
    overrides, _ = load_deepspeed_config({"zero_optimization": {"stage": 2,
                                                                "reduce_bucket_size": 0}}, 2)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (1, 3, 2)]
    assert [len(b) for b in by_size(params, overrides["bucket_size"])] == [1, 1, 1]


def test_optimizer_follows_deepspeed_semantics():
    def opt(section):
        out = load_deepspeed_config({"optimizer": section}, 2)[0]
        return out["optimizer"], out.get("lr"), out["optimizer_params"]
    # DeepSpeed's "Adam" is AdamW unless adam_w_mode is false; its weight_decay defaults to 0
    assert opt({"type": "Adam", "params": {"lr": 1e-3, "weight_decay": 0.1}}) == (
        "adamw",
        1e-3,
        {"weight_decay": 0.1},
    )
    assert opt({"type": "Adam", "params": {"adam_w_mode": False}}) == (
        "adam",
        None,
        {"weight_decay": 0.0},
    )
    assert opt({"type": "AdamW", "params": {"betas": [0.8, 0.9], "torch_adam": True}}) \
        == ("adamw", None, {"betas": (0.8, 0.9), "weight_decay": 0.0})
    assert opt({"type": "sgd", "params": {"lr": 0.1, "momentum": 0.9}}) == (
        "sgd",
        0.1,
        {"momentum": 0.9},
    )


def test_hugging_face_auto_means_not_set():
    cfg = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "bf16": {"enabled": "auto"},
        "fp16": {"enabled": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
    }
    assert load_deepspeed_config(cfg, 2) == (
        {
            "stage": 3,
            "optimizer": "adamw",
            "clip_grad_norm": 1.0,
            "optimizer_params": {"weight_decay": 0.0},
        },
        [],
    )


def test_fp16_section_sets_dtype_and_loss_scale():
    def fp16(section):
        return load_deepspeed_config({"fp16": section, "gradient_clipping": 0}, 2)
    assert fp16({"enabled": True}) == (
        {"clip_grad_norm": None, "dtype": "fp16", "loss_scale": None},
        [],
    )
    assert fp16({"enabled": True, "loss_scale": 128})[0]["loss_scale"] == 128.0           # static
    assert fp16(
        {
            "enabled": True,
            "loss_scale": 0,
            "initial_scale_power": 12,
            "loss_scale_window": 500,
            "hysteresis": 1,
            "min_loss_scale": 4,
            "consecutive_hysteresis": False,
        }
    )[0]["loss_scale"] == {
        "initial_scale_power": 12,
        "loss_scale_window": 500,
        "hysteresis": 1,
        "min_loss_scale": 4,
    }
    assert fp16({"enabled": False, "loss_scale": 128})[0] == {
        "clip_grad_norm": None,
        "dtype": "fp32",
    }
    assert fp16({"enabled": True, "auto_cast": True})[1] == [
        "'fp16.auto_cast' is not implemented: inputs are not "
        "cast; the model's floating parameters and buffers are"
    ]


def test_grad_accum_dtype_sets_reduce_dtype(tmp_path):
    def load(dtype_section, accum):
        return load_deepspeed_config(
            {**dtype_section, "data_types": {"grad_accum_dtype": accum}}, 2
        )
    assert load({"bf16": {"enabled": True}}, "fp32") == ({"clip_grad_norm": 1.0, "dtype": "bf16",
                                                          "reduce_dtype": "fp32"}, [])
    assert load({"fp16": {"enabled": True}}, "fp32")[0]["reduce_dtype"] == "fp32"
    # the compute dtype: a no-op
    assert "reduce_dtype" not in load({"bf16": {"enabled": True}}, "bf16")[0]
    with pytest.raises(
        ConfigError, match='grad_accum_dtype must be "fp32" or the training precision "fp32"'
    ):
        load({}, "bf16")
    # the CLI flag, and a file's fp32 reduction kept when --dtype fp32 makes it a no-op
    assert _cfg("--dtype", "bf16", "--reduce-dtype", "fp32").reduce_dtype == "fp32"
    path = tmp_path / "ds.json"
    path.write_text(
        json.dumps({"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}})
    )
    assert (
        _cfg("--config", str(path)).reduce_dtype,
        _cfg("--config", str(path), "--dtype", "fp32").dtype,
    ) == ("fp32", "fp32")


def test_not_implemented_keys_warn_by_name():
    _, warnings = load_deepspeed_config({"amp": {"enabled": True}, "steps_per_print": 10,
                                         "zero_optimization": {"stage": 2, "overlap_comm": False,
                                                               "contiguous_gradients": True,
                                                               "allgather_bucket_size": 5e8}}, 2)
    assert len(warnings) == 4
    for key, warning in zip(("'amp'", "'steps_per_print'",
                             "'zero_optimization.allgather_bucket_size'",
                             "'zero_optimization.overlap_comm: false'"), warnings):
        assert warning.startswith(key + " is not implemented: ")
    assert (
        load_deepspeed_config({"fp16": {"enabled": False}, "wall_clock_breakdown": False}, 2)[1]
        == []
    )
    assert (
        load_deepspeed_config({"zero_optimization": {k.split(".")[1]: True for k in ALWAYS_ON}}, 2)[
            1
        ]
        == []
    )


def test_activation_checkpointing_section_turns_it_on_and_its_model_parallel_keys_warn():
    # 1.0: DeepSpeed's default clipping
    on = {"activation_checkpointing": True, "clip_grad_norm": 1.0}
    assert load_deepspeed_config({"activation_checkpointing": {}}, 2) == (on, [])
    section = {
        "partition_activations": True,
        "cpu_checkpointing": True,
        "number_checkpoints": 4,
        "contiguous_memory_optimization": True,
        "synchronize_checkpoint_boundary": True,
        "profile": True,
    }
    overrides, warnings = load_deepspeed_config({"activation_checkpointing": section}, 2)
    assert overrides == {"activation_checkpointing": "cpu", "clip_grad_norm": 1.0}
    assert [w.split(" is not implemented: ")[0] for w in warnings] == [
        f"'activation_checkpointing.{k}'" for k in section if k != "cpu_checkpointing"]
    assert "model parallelism" in warnings[0]
    off = {k: False for k in section if k != "number_checkpoints"}
    assert load_deepspeed_config({"activation_checkpointing": off}, 2) == (on, [])


@pytest.mark.parametrize("cfg, message", [
    (
        {
            "train_batch_size": 64,
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 3,
        },
        "train_batch_size 64 != train_micro_batch_size_per_gpu "
        "x gradient_accumulation_steps x world size "
        "= 4 x 3 x 4",
    ),
    ({"train_batch_size": 64, "gradient_accumulation_steps": 3}, "not divisible"),
    ({"gradient_accumulation_steps": 2},
     "needs train_batch_size or train_micro_batch_size_per_gpu"),
    ({"zero_optimization": {"stage": 4}},
     "zero_optimization.stage 4: stage must be one of 0, 1, 2, 3 (0 = DDP), got 4"),
    ({"zero_optimization": {"stage": "two"}},
     'zero_optimization.stage must be an integer, got "two"'),
    ({"train_batch_size": 0}, "train_batch_size must be >= 1, got 0"),
    ({"train_micro_batch_size_per_gpu": 2.5}, "must be an integer, got 2.5"),
    ({"gradient_clipping": "1.0"}, 'gradient_clipping must be a number >= 0, got "1.0"'),
    ({"bf16": {"enabled": 1}}, "bf16.enabled must be true or false, got 1"),
    ({"bf16": True}, "'bf16' must be an object"),
    ({"activation_checkpointing": {"cpu_checkpointing": "yes"}},
     "cpu_checkpointing must be true or false"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}},
     "bf16.enabled and fp16.enabled are both true"),
    ({"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis must be >= 1, got 0"),
    ({"fp16": {"enabled": True, "loss_scale": -1}},
     "fp16.loss_scale must be a number >= 0, got -1"),
    ({"zero_optimisation": {"stage": 2}},
     "unknown key 'zero_optimisation' (did you mean 'zero_optimization'?)"),
    ({"zero_optimization": {"stagee": 2}}, "did you mean 'zero_optimization.stage'"),
    ({"train_batch": 8}, "unknown key 'train_batch'"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True,
                            "offload_optimizer": {"device": "cpu"}}},
     "'zero_optimization.cpu_offload' and 'zero_optimization.offload_optimizer.device' are both"),
    ({"gradient_allreduce_op": "sum"}, "minizero averages gradients"),
    ({"progressive_layer_drop": {"enabled": True}}, "'progressive_layer_drop' is refused"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": -1}},
     "reduce_bucket_size must be a number >= 0, got -1"),
    ({"zero_optimization": {"cpu_ofload": True}},
     "did you mean 'zero_optimization.cpu_offload'"),
    ({"bf16": {"fp16_master_weights_and_grads": True}},       # not fp16's key: this section's
     "did you mean 'bf16.bf16_master_weights_and_grads'"),
    ({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}},
     "nvme_path is needed with device"),
    ({"zero_optimization": {"offload_optimizer": {"device": "gpu"}}},
     'must be one of "cpu", "nvme"'),
    ({"zero_optimization": {"overlap_comm": "yes"}}, "overlap_comm must be true or false"),
    ({"optimizer": {"type": "Lamb"}}, "optimizer.type must be one of AdamW, Adam, SGD"),
    ({"optimizer": {"params": {"lr": 1e-3}}}, "optimizer.params needs optimizer.type"),
    ({"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.99]}}}, "not a parameter of SGD"),
    ({"optimizer": {"type": "AdamW", "params": {"eps": "tiny"}}},
     "optimizer.params.eps must be a number"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 0}}}, "optimizer.params.lr must be > 0"),
    ({"optimizer": {"type": "AdamW", "params": {"betas": [1.5, 0.9]}}},
     "rejected by torch.optim.AdamW: "),
])
def test_bad_configs_raise_one_line(cfg, message):
    with pytest.raises(ConfigError) as info:
        load_deepspeed_config(cfg, 4)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize("text, message", [
    (
        '{"train_batch_size": 64, "train_micro_batch_size_per_gpu": '
        '4, "gradient_accumulation_steps": 3}',
        "train_batch_size 64 != ",
    ),
    ('{"zero_optimization": {"stage": 4}}', "stage must be one of 0, 1, 2, 3"),
    ('{"zero_optimization": {"stage": "two"}}', "must be an integer"),
    ('{"zero_optimisation": {"stage": 2}}', "unknown key 'zero_optimisation' (did you mean"),
    ('{"train_batch_size": 64,}', "is not valid JSON: "),
    ('[1, 2]', "the config must be a JSON object"),
    ('{"scheduler": {"type": "OneCycle"}}',
     "scheduler.type must be one of WarmupLR, WarmupDecayLR, WarmupCosineLR"),
    (None, "config file not found: "),
])
def test_cli_bad_config_is_one_line_exit_2(tmp_path, capsys, text, message):
    path = tmp_path / "ds.json"
    if text is not None:
        path.write_text(text)
    assert main(["--config", str(path), "--world-size", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"minizero.run: error: --config {path}: ") and message in err, err
    assert err.count("\n") == 1


def _cfg(*argv):
    return config_from_args(build_parser().parse_args(list(argv)))


def test_flags_given_override_the_file_and_only_those(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({
        "train_batch_size": 32, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
        "bf16": {"enabled": True}, "scheduler": {"type": "WarmupLR"},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.8, 0.9]}},
        "zero_optimization": {
            "stage": 2,
            "reduce_bucket_size": 1000,
            "offload_optimizer": {"device": "cpu"},
        }}))
    cfg = _cfg("--config", str(path), "--world-size", "4")
    assert (
        cfg.stage, cfg.world_size, cfg.batch_size, cfg.grad_accum, cfg.dtype, cfg.offload, cfg.lr,
        cfg.clip_grad_norm, cfg.bucket_size, cfg.optimizer_params,
    ) == (
        2, 4, 32, 2, "bf16", "optimizer", 1e-3, 1.0, 2000,
        {"betas": (0.8, 0.9), "weight_decay": 0.0},
    )
    assert cfg.scheduler == {"type": "WarmupLR", "params": {}}
    assert capsys.readouterr().err == ""
    cfg = _cfg(
        "--config", str(path), "--world-size", "2", "--stage", "3", "--offload", "params",
        "--batch-size", "8", "--grad-accum", "1", "--dtype", "fp32", "--lr", "0.01",
        "--clip-grad-norm", "2", "--bucket-size-mb", "1", "--no-prefetch", "--optimizer", "sgd",
    )
    assert (
        cfg.stage, cfg.world_size, cfg.batch_size, cfg.grad_accum, cfg.dtype, cfg.offload, cfg.lr,
        cfg.clip_grad_norm, cfg.bucket_size, cfg.prefetch, cfg.optimizer, cfg.optimizer_params,
    ) == (3, 2, 8, 1, "fp32", "params", 0.01, 2.0, 1e6, False, "sgd", {})
    assert (
        "--optimizer sgd replaces the file's adamw: its "
        "optimizer.params betas, weight_decay are not used" in capsys.readouterr().err
    )
    # the file's batch sizes are checked against the world size the flags give
    with pytest.raises(
        Exception, match="not divisible by gradient_accumulation_steps x world size = 2 x 3"
    ):
        _cfg("--config", str(path), "--world-size", "3")


def test_docs_hold_the_generated_key_tables_and_name_every_example():
    """The page's tables are config_keys.markdown(), exactly: one home for each key's fate."""
    doc = (ROOT / "docs" / "deepspeed_config.md").read_text()
    begin, end = (f"<!-- generated by python -m minizero.deepspeed.config_keys: {w} -->\n"
                  for w in ("begin", "end"))
    assert doc[doc.index(begin) + len(begin):doc.index(end)] == markdown()
    named = set(re.findall(r"`([a-z0-9_.]+)`", doc))
    missing = [k for k in (*KEYS, *ALWAYS_ON, *NOT_IMPLEMENTED) if k not in named]
    assert not missing, f"docs/deepspeed_config.md does not name {missing}"
    for path in EXAMPLES:
        assert f"examples/{path.name}" in doc, path.name
    assert "unknown keys are errors" in build_parser().format_help()


def test_the_fp16_example_runs_dynamic_loss_scaling_without_a_warning(tmp_path, capsys):
    overrides, warnings = load_deepspeed_config(FP16, 2)
    assert warnings == [] and overrides["dtype"] == "fp16"
    assert overrides["loss_scale"] == {
        "initial_scale_power": 12,
        "loss_scale_window": 100,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    out = tmp_path / "fp16.json"
    assert (
        main(
            [
                "--config", str(FP16), "--world-size", "2", "--steps", "2", "--model", "tiny",
                "--quiet", "--json", str(out),
            ]
        )
        == 0
    )
    assert "fp16" not in capsys.readouterr().err                  # no warning about fp16
    data = json.loads(out.read_text())
    assert data["dtype"] == "fp16" and len(data["losses"]) == 2


def test_every_example_runs_and_a_flag_overrides_it(tmp_path):
    assert len(EXAMPLES) >= 5
    for path in EXAMPLES:
        overrides, _ = load_deepspeed_config(path, 2)
        extra = ["--stage", "3", "--dtype", "bf16"] if path == ZERO2_OFFLOAD else []
        out = tmp_path / f"{path.stem}.json"
        assert (
            main(
                [
                    "--config", str(path), "--world-size", "2", "--steps", "2", "--model", "tiny",
                    "--quiet", "--json", str(out),
                    *extra,
                ]
            )
            == 0
        ), path.name
        data = json.loads(out.read_text())
        expected = {"stage": 3, "dtype": "bf16", "offload": "optimizer"} if extra else \
            {"stage": overrides["stage"], "dtype": overrides.get("dtype", "fp32"),
             "offload": overrides.get("offload", False)}
        assert {k: data[k] for k in expected} == expected, path.name
        assert len(data["losses"]) == 2


def test_the_disk_tier_and_the_stall_timeout_come_from_the_config(tmp_path):
    # DeepSpeed's offload_optimizer "nvme" is minizero's disk tier (beyond/disk.py); stall_timeout
    # is minizero's own key for beyond/desync.py's watchdog, which the CLI's --stall-timeout
    # overrides
    cfg = {"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path), "pipeline_read": True}}, "stall_timeout": 7}
    out, warnings = load_deepspeed_config(cfg, world_size=2)
    assert (out["offload"], out["offload_path"], out["stall_timeout"], warnings) == \
        ("disk", str(tmp_path), 7, [])
    cfg["zero_optimization"]["offload_optimizer"]["nvme_path"] = str(tmp_path / "missing")
    with pytest.raises(ConfigError, match="is not an existing folder"):
        load_deepspeed_config(cfg, world_size=2)


def test_deepspeeds_other_spellings_mean_what_they_mean_there():
    """bfloat16 is bf16; cpu_offload offloads the OPTIMIZER (cpu_offload_param the parameters);
    the stage3_ short names and gather_fp16 are the same keys; offload below the stage that uses
    it is ignored with a warning, as DeepSpeed ignores it."""
    read = lambda cfg: load_deepspeed_config(cfg, 2)                      # noqa: E731
    assert read({"bfloat16": {"enabled": True}})[0]["dtype"] == "bf16"
    assert read({"zero_optimization": {"stage": 2, "cpu_offload": True}})[0]["offload"] \
        == "optimizer"
    assert "offload" not in read({"zero_optimization": {"stage": 2, "cpu_offload": False}})[0]
    assert read({"zero_optimization": {"stage": 3, "cpu_offload_param": True}})[0]["offload"] \
        == "params"
    assert read({"zero_optimization": {"stage": 3, "prefetch_bucket_size": 0}})[0]["prefetch"] \
        is False
    assert read({"zero_optimization": True})[0]["stage"] == 1             # DeepSpeed's legacy form
    for old in ("stage3_gather_fp16_weights_on_model_save", "gather_16bit_weights_on_model_save"):
        assert read({"zero_optimization": {old: True}})[1] == [
            "'zero_optimization.stage3_gather_16bit_weights_on_model_save' is not implemented: "
            "use engine.full_state_dict()"]
    overrides, warnings = read({"zero_optimization": {"stage": 2,
                                                      "offload_param": {"device": "cpu"}}})
    assert "offload" not in overrides and warnings == [
        "'zero_optimization.offload_param' has no effect at stage 2, as in DeepSpeed: only stage 3 "
        "partitions the parameters"]
    overrides, warnings = read({"bf16": {"enabled": False}, "bfloat16": {"enabled": True}})
    assert "dtype" in overrides and overrides["dtype"] == "fp32" and len(warnings) == 1
    # a top-level key DeepSpeed ignores: one warning; close to a real key: an error (above)
    assert read({"cuda_visible_devices": 0})[1] == [
        f"'cuda_visible_devices' is not implemented: {NOT_IMPLEMENTED['cuda_visible_devices']}"]
    assert read({"my_launcher_note": "x"})[1] == [
        "'my_launcher_note' is not a DeepSpeed 0.19.8 key: DeepSpeed ignores it, and so does "
        "minizero"]
    assert read({"optimizer": {"type": "Adam", "params": {"bias_correction": True}}})[0][
        "optimizer_params"] == {"weight_decay": 0.0}
    assert read({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})[0][
        "optimizer_params"] == {"bias_correction": False, "weight_decay": 0.0}  # deepspeed/adam.py


HF_AUTO = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
           "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
           "fp16": {"enabled": "auto"},
           "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                     "weight_decay": "auto"}},
           "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                        "warmup_max_lr": "auto",
                                                        "warmup_num_steps": "auto"}},
           "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto",
                                 "stage3_prefetch_bucket_size": "auto"}}


def test_auto_resolves_where_something_decides_it_else_one_line_naming_what_would():
    with pytest.raises(ConfigError) as info:
        load_deepspeed_config(HF_AUTO, 2, flags=False, hidden_size=8)
    assert str(info.value) == (
        "\"auto\" that nothing in minizero.initialize decides: optimizer.params.lr (the "
        "Trainer's learning_rate; give a number, or pass optimizer= with a section of \"auto\" "
        "only); scheduler.params.warmup_num_steps (the Trainer's warmup_steps)")
    cfg = json.loads(json.dumps(HF_AUTO))
    cfg["scheduler"]["params"]["warmup_num_steps"] = 5
    overrides, warnings = load_deepspeed_config(cfg, 2, flags=False, hidden_size=8,
                                                client_optimizer=True)
    # optimizer= decides the all-"auto" section; h² = 64 elements of fp32; prefetch on; clipping
    # 1.0 and fp32 (the Trainer's defaults are DeepSpeed's); the batch: the script's micro-batches
    assert overrides == {"clip_grad_norm": 1.0, "stage": 2, "bucket_size": 256, "prefetch": True,
                         "scheduler": {"type": "WarmupLR",
                                       "params": {"warmup_max_lr": "auto",
                                                  "warmup_num_steps": 5}}}
    assert warnings == ["train_batch_size and train_micro_batch_size_per_gpu are \"auto\" or "
                        "left out: the script's micro-batches decide them "
                        "(engine.train_micro_batch_size_per_gpu() is None)"]
    # warmup_max_lr "auto": the optimizer's lr, when the schedule is built
    import torch
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.25)
    assert build_scheduler(optimizer, overrides["scheduler"]).max_lrs == [0.25]
    decay = {"type": "WarmupDecayLR", "params": {"warmup_max_lr": "auto", "total_num_steps": 9}}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.25)
    assert build_scheduler(optimizer, decay).max_lrs == [0.25]        # not its default, 0.001
    # accumulation given, sizes "auto": accepted, accumulation kept
    cfg["gradient_accumulation_steps"] = 3
    assert load_deepspeed_config(cfg, 2, flags=False, client_optimizer=True)[0]["grad_accum"] == 3


def test_initialize_lets_its_optimizer_decide_a_section_of_auto():
    """Hugging Face's configs with optimizer=: the object passed decides the all-"auto" section
    (its lr reaches the schedule's "auto" peak); a section with numbers still conflicts."""
    import torch

    import minizero
    model = torch.nn.Linear(2, 2)
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": "auto",
              "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto",
                                                           "warmup_max_lr": "auto",
                                                           "warmup_num_steps": 4}}}
    _, optimizer, _, schedule = minizero.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3), config=config)
    assert isinstance(optimizer, torch.optim.SGD) and schedule.max_lrs == [0.3]
    config["optimizer"]["params"]["lr"] = 0.1
    with pytest.raises(ConfigError, match="choose one"):
        minizero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.3),
                            config=config)
