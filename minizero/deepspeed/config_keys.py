"""Every key DeepSpeed 0.19.8's config parser reads, and what minizero does with it: the one table.

    python -m minizero.deepspeed.config_keys          # the tables of docs/deepspeed_config.md, as
    Markdown

minizero/deepspeed/config.py applies it; docs/deepspeed_config.md shows it (tests/test_config.py
checks the page holds exactly `markdown()`); tests/test_config_corpus.py checks, where DeepSpeed is
installed, that every key its parser reads (its pydantic sections' fields and aliases, and the
top-level keys DeepSpeedConfig looks up) has a home here. Each key is in exactly one of:
  * KEYS: applied (what it becomes);
  * ALWAYS_ON: names something minizero always does: true is silent, false is one warning;
  * NOT_IMPLEMENTED: accepted, one warning line saying it has no effect here and why (a section
    switched off, {"enabled": false}, or a plain false needs no warning);
  * REFUSED: an error, one line with the reason (DeepSpeed 0.19.8 refuses these too);
  * ALIASES / LEGACY_OFFLOAD: DeepSpeed's other spellings, read as the key they stand for.
A top-level key DeepSpeed does not read at all (it ignores such keys silently) is one warning here,
or an error when it is close to a real key: a typo such as "zero_optimisation" must not run stage 0.
"""

from __future__ import annotations

# Keys minizero applies, and what they become.
KEYS = {
    "train_batch_size": "batch_size (global rows per step)",
    "train_micro_batch_size_per_gpu": "rows per rank per micro-batch (determines batch_size / "
        "grad_accum)",
    "gradient_accumulation_steps": "grad_accum",
    "gradient_clipping": "clip_grad_norm (0 = off; absent: 1.0, DeepSpeed's default)",
    "gradient_allreduce_op": "\"avg\" (DeepSpeed's default): gradients are averaged, as minizero "
        "always does; \"sum\": an error (minizero has no summed-gradient mode)",
    "bf16.enabled": "dtype = bf16 (fp32 master weights)",
    "fp16.enabled": "dtype = fp16 (fp32 master weights, loss scaling); with bf16.enabled too: an "
        "error",
    "fp16.loss_scale": "loss_scale: 0 = dynamic (default), > 0 = static",
    "fp16.initial_scale_power": "dynamic loss scale starts at 2**power (default 16)",
    "fp16.loss_scale_window": "good steps before the scale doubles (default 1000)",
    "fp16.hysteresis": "overflows before the scale halves (default 2)",
    "fp16.min_loss_scale": "the lowest dynamic scale (default 1)",
    "data_types.grad_accum_dtype": "reduce_dtype: \"fp32\" reduces and accumulates bf16/fp16 "
        "gradients in fp32; the compute dtype: as without it",
    "zero_optimization.stage": "stage (0 = DDP); the legacy \"zero_optimization\": true / false "
        "is stage 1 / 0, as in DeepSpeed",
    "zero_optimization.offload_optimizer.device": "offload = optimizer ('cpu'), disk ('nvme': "
        "ZeRO-Infinity's disk tier, beyond/disk.py) or off ('none')",
    "zero_optimization.offload_optimizer.nvme_path": "offload_path: the folder of the disk tier's "
        "files",
    "stall_timeout": "minizero's own: stop a run in which no collective finishes for this many "
        "seconds while a rank waits, naming the rank out of step (beyond/desync.py; 0: off)",
    "zero_optimization.offload_param.device": "offload = params ('cpu', stage 3 only; 'nvme': "
        "host memory, with a warning: minizero's disk tier holds the optimizer only)",
    "zero_optimization.reduce_bucket_size": "bucket_size in bytes = elements x 2 (bf16) or 4 "
        "(fp32); stages 0 and 2 (stage 1 has one bucket, stage 3 one per unit); 0: one bucket per "
        "parameter (what the DeepSpeed of transformers' zero3 test config did; 0.19.8 refuses 0)",
    "zero_optimization.stage3_prefetch_bucket_size": "prefetch (0 = off; any other size = one "
        "unit ahead)",
    "zero_optimization.zero_quantized_weights": "quantized_weights: ZeRO++ qwZ, stage 3's forward "
        "all-gather in int8",
    "zero_optimization.zero_quantized_gradients": "quantized_gradients: ZeRO++ qgZ, the gradient "
        "reduce-scatter in int8 (stages 2-3; one hop, not ZeRO++'s 2-hop int4)",
    "zero_optimization.mics_shard_size": "shard_group_size (MiCS / HSDP: partitions within S "
        "ranks; -1 = off)",
    "zero_optimization.zero_hpz_partition_size": "hpz_group_size (ZeRO++ hpZ, stage 3: backward's "
        "all-gather within R ranks; 1 = off)",
    "zero_optimization.leaf_module.classes": "stage 3: modules of these classes (a name or "
        "module.qualname) are leaf modules, each gathered whole as one unit (units.py; default: "
        "DeepSpeed's, Mixtral's and Qwen's sparse MoE blocks)",
    "zero_optimization.leaf_module.names": "stage 3: the modules so named are leaf modules",
    "zero_optimization.leaf_module.name_suffixes": "stage 3: modules whose names end so are leaf "
        "modules",
    "zero_optimization.offload_optimizer.pipeline_read": "accepted: the disk tier always reads the "
        "next piece while it steps one (beyond/disk.py)",
    "zero_optimization.offload_optimizer.pipeline_write": "accepted: the disk tier always writes "
        "the last piece while it steps one (beyond/disk.py)",
    "zero_optimization.offload_optimizer.pin_memory": "accepted: host buffers are pinned whenever "
        "CUDA is used",
    "zero_optimization.offload_param.pin_memory": "accepted: host buffers are pinned whenever "
        "CUDA is used",
    "zero_optimization.offload_optimizer.ratio": "1 (DeepSpeed's default): the whole optimizer "
        "is offloaded; below 1 warns: minizero offloads all of it or none",
    "optimizer.type": "optimizer: AdamW, Adam (= AdamW, as in DeepSpeed, unless adam_w_mode is "
        "false), SGD, Muon (torch.optim.Muon for the matrices, AdamW for the rest: "
        "minizero/deepspeed/muon.py); DeepSpeed's own (Lamb, OneBitAdam, Lion...): an error",
    "optimizer.params": "lr and the optimizer's keyword arguments (Adam/AdamW weight_decay "
        "defaults to 0, as in DeepSpeed; bias_correction true is torch's Adam, false DeepSpeed's "
        "uncorrected step: minizero/deepspeed/adam.py); Muon's: lr, muon_lr, adam_lr, momentum, "
        "weight_decay, betas, eps with DeepSpeed's defaults (ns_method: a warning, minizero uses "
        "torch's Newton-Schulz; per_head_muon and adam_w_mode false: an error)",
    "scheduler.type": "the learning-rate schedule, stepped with the optimizer: WarmupLR, "
        "WarmupDecayLR, WarmupCosineLR, as DeepSpeed defines them (deepspeed/config.py's "
        "SCHEDULES); "
        "OneCycle, LRRangeTest: an error",
    "scheduler.params": "the schedule's parameters, DeepSpeed's names and defaults "
        "(total_num_steps: the CLI's --steps when left out or \"auto\")",
    "activation_checkpointing": "the section turns on activation_checkpointing: each block "
        "recomputed in backward (in DeepSpeed the model calls deepspeed.checkpointing.checkpoint)",
    "activation_checkpointing.cpu_checkpointing": "activation_checkpointing = cpu (the blocks' "
        "inputs on the host)",
    "tensor_parallel.autotp_size": "tensor_parallel = M (0 or 1: off; it must divide N): "
        "minizero's GPT, GPT-2 or Llama split over rows of M ranks, ZeRO along the columns of N/M "
        "(docs/tensor_parallel.md); initialize's model gives whole logits (its head all-gathers "
        "them), as an AutoTP script's loss expects; another model: an error",
}

# Keys naming something minizero always does: true is accepted silently, false warns.
ALWAYS_ON = {
    "zero_optimization.overlap_comm": "gradient communication always overlaps backward in stages "
        "0, 2 and 3",
    "zero_optimization.contiguous_gradients": "gradients are always copied into contiguous flat "
        "buckets",
    "zero_optimization.reduce_scatter": "stages 1-3 always reduce-scatter gradients",
    "zero_optimization.allgather_partitions": "stages 1-2 always all-gather the updated partitions",
    "zero_optimization.ignore_unused_parameters": "unused parameters always get zero gradients",
    "zero_optimization.compute_grad_norm": "the gradient norm is computed whenever clipping is on",
    "zero_optimization.use_multi_rank_bucket_allreduce": "buckets are reduced with one collective "
        "each",
    "zero_optimization.override_module_apply": "module.apply is never patched: stage 3 gathers "
        "units only around their own forward and backward",
}

_MONITOR = "no monitor; the CLI's --json writes the results"
_NOT_DP = "minizero is data parallelism only"
_LAYOUTS = ("the layers are split as beyond/tensor_parallel_hf.py knows them (minizero's GPT, "
            "GPT-2, "
            "Llama)")

# Keys DeepSpeed reads that minizero accepts without effect: key -> why, or what it does instead.
NOT_IMPLEMENTED = {
    "fp16.auto_cast": "inputs are not cast; the model's floating parameters and buffers are",
    "fp16.consecutive_hysteresis": "hysteresis is restored only when the scale grows (DeepSpeed's "
        "default)",
    "fp16.fp16_master_weights_and_grads": "master weights are always fp32",
    "bf16.bf16_master_weights_and_grads": "master weights and gradients are always fp32",
    "bf16.bf16_optimizer_states": "the optimizer's moments are always fp32",
    "bf16.check_grad_overflow": "bf16 steps are never checked for overflow and skipped (bf16 has "
        "fp32's range)",
    "bf16.immediate_grad_update": "gradients are accumulated in their bucket and reduced, as "
        "without it",
    "amp": "no apex AMP; use bf16.enabled, fp16.enabled or fp32",
    "torch_autocast": "no torch.autocast: the model computes in the dtype of bf16/fp16.enabled "
        "(its parameters cast), or fp32",
    "steps_per_print": "progress is printed every steps/10 steps",
    "wall_clock_breakdown": "the CLI reports the median step time",
    "memory_breakdown": "engine.memory() and the CLI report memory by category",
    "flops_profiler": "no profiler; the CLI reports memory and bytes communicated",
    "tensorboard": _MONITOR,
    "wandb": _MONITOR,
    "csv_monitor": _MONITOR,
    "comet": _MONITOR,
    "comms_logger": "no communication log; the CLI reports the bytes each collective moved",
    "timers": "no timers; the CLI reports the step time",
    "dump_state": "nothing is dumped",
    "log_level": "minizero logs nothing but warnings",
    "gradient_predivide_factor": "gradients are averaged with one AVG collective",
    "prescale_gradients": "gradients are averaged with one AVG collective",
    "communication_data_type": "gradients are communicated in the dtype they are accumulated in "
        "(data_types.grad_accum_dtype)",
    "seq_parallel_communication_data_type": _NOT_DP,
    "data_types.param_dtype": "parameters follow bf16/fp16.enabled",
    "data_types.buffer_dtype": "buffers follow bf16/fp16.enabled",
    "data_types.keep_in_fp32_modules": "every floating parameter and buffer is cast to the "
        "training dtype",
    "zero_allow_untested_optimizer": "any torch.optim optimizer works",
    "zero_force_ds_cpu_optimizer": "the host optimizer is torch.optim's",
    "disable_allgather": "stages 1-2 always all-gather the updated partitions",
    "disable_python_gc": "Python's garbage collector is left as it is",
    "dataloader_drop_last": "initialize's training_data loader keeps the last short batch",
    "sparse_gradients": "embedding gradients are dense",
    "sparse_attention": "no sparse attention kernels: the model's own attention runs",
    "pipeline": _NOT_DP + " (no pipeline stages)",
    "tensor_parallel.dtype": "the model computes in the dtype of bf16/fp16.enabled, or fp32",
    "tensor_parallel.tp_overlap_comm": "f and g's all-reduces run when the layer reaches them",
    "tensor_parallel.tensor_parallel": "inference's settings: autotp_size sets the training split",
    "tensor_parallel.injection_policy_tuple": _LAYOUTS,
    "tensor_parallel.partition_config": _LAYOUTS,
    "tensor_parallel.preset_model": _LAYOUTS,
    "tensor_parallel.keep_module_on_host": "the model is split where it was built, then moved "
        "with the engine",
    "tensor_parallel.replace_with_kernel_inject": "no inference kernels: the model's own layers "
        "run",
    "expert_parallel": _NOT_DP + " (no expert parallelism)",
    "sequence_parallel_size": _NOT_DP + " (no sequence parallelism)",
    "use_data_before_expert_parallelism": _NOT_DP + " (no expert parallelism)",
    "hybrid_engine": "no RLHF generation engine: the model's own forward generates",
    "elasticity": "the world size is the one launched with; a checkpoint loads at its own",
    "autotuning": "no autotuner: the config's own sizes are used",
    "eigenvalue": "no eigenvalue computation (it feeds DeepSpeed's quantizer schedule only)",
    "curriculum_learning": "no curriculum: the script's batches are used as they come",
    "data_efficiency": "no data sampling or routing: the script's batches are used as they come",
    "compression_training": "no compression: the model trains as it is",
    "weight_quantization": "no weight quantization of the model (zero_quantized_weights "
        "quantizes stage 3's all-gather)",
    "compile": "no torch.compile: the model runs eagerly",
    "graph_harvesting": "no CUDA graphs",
    "checkpoint": "checkpoints are engine.save/load's own (one file per rank)",
    "datastates_ckpt": "checkpoints are engine.save/load's own (one file per rank)",
    "nebula": "checkpoints are engine.save/load's own (one file per rank)",
    "aio": "the disk tier reads and writes with torch.save/load (beyond/disk.py), not libaio",
    "vocabulary_size": "used by DeepSpeed only for a tensor-core alignment warning",
    "managed_gradient_accumulation": "the engine counts micro-batches itself (engine.step at "
        "each boundary), DeepSpeed's default",
    "cuda_visible_devices": "not a DeepSpeed key either (DeepSpeed ignores it): the launcher's "
        "CUDA_VISIBLE_DEVICES chooses the devices",
    "optimizer.legacy_fusion": "torch.optim steps each tensor",
    "zero_optimization.allgather_bucket_size": "parameters are all-gathered per reduce bucket "
        "(stages 1-2) or per unit (stage 3)",
    "zero_optimization.round_robin_gradients": "partitions are contiguous ranges",
    "zero_optimization.sub_group_size": "the optimizer steps one tensor per bucket",
    "zero_optimization.load_from_fp32_weights": "checkpoints always restore the fp32 masters",
    "zero_optimization.elastic_checkpoint": "a checkpoint loads at its own world size; python -m "
        "minizero.consolidate for another",
    "zero_optimization.stage3_max_live_parameters": "units in flight: the current one and one "
        "prefetched",
    "zero_optimization.stage3_max_reuse_distance": "units are freed right after use",
    "zero_optimization.stage3_param_persistence_threshold": "every unit is sharded, however small",
    "zero_optimization.stage3_model_persistence_threshold": "every unit is sharded, however small",
    "zero_optimization.stage3_module_granularity_threshold": "units are the blocks wrap chooses",
    "zero_optimization.stage3_use_all_reduce_for_fetch_params": "units are gathered with "
        "all-gather",
    "zero_optimization.stage3_allgather_sequential": "each unit is gathered with one all-gather",
    "zero_optimization.memory_efficient_linear": "torch.nn.functional.linear is never replaced "
        "(DeepSpeed's stage 3 swaps in its own, process-wide)",
    "zero_optimization.stage3_gather_16bit_weights_on_model_save": "use engine.full_state_dict()",
    "zero_optimization.mics_hierarchical_params_gather": "parameters are all-gathered within the "
        "shard group in one step",
    "zero_optimization.legacy_stage1": "stage 1 is the ZeRO paper's P_os",
    "zero_optimization.parameter_alignment": "partitions are padded to N equal parts only",
    "zero_optimization.zero_quantized_nontrainable_weights": "frozen parameters are gathered "
        "unquantized",
    "zero_optimization.pipeline_loading_checkpoint": "checkpoints load whole",
    "zero_optimization.log_trace_cache_warnings": "no trace cache: units run in call order",
    "zero_optimization.enable_sanity_checks": "beyond/desync.py checks every collective's order "
        "anyway",
    "zero_optimization.save_muon_momentum_buffer_in_memory": "Muon's momentum is optimizer "
        "state, where offload puts it (memory, or the host)",
    "zero_optimization.leaf_module": "units are the blocks wrap chooses (DeepSpeed's leaf modules "
        "stop its hooks below a module)",
    "zero_optimization.zenflow": "no ZenFlow: every gradient updates the optimizer at every step",
    "zero_optimization.cpu_offload_use_pin_memory": "host buffers are pinned whenever CUDA is used",
    "zero_optimization.offload_optimizer.buffer_count": "one host buffer per bucket",
    "zero_optimization.offload_optimizer.fast_init": "the host optimizer is built the ordinary way",
    "zero_optimization.offload_optimizer.super_offload": "the host optimizer is torch.optim's",
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": "the host optimizer is torch.optim's",
    "zero_optimization.offload_param.nvme_path": "parameters are offloaded to host memory only",
    "zero_optimization.offload_param.buffer_count": "one device buffer per gathered unit",
    "zero_optimization.offload_param.buffer_size": "one device buffer per gathered unit",
    "zero_optimization.offload_param.max_in_cpu": "every parameter shard stays on the host",
    "activation_checkpointing.partition_activations": "P_a splits the checkpoints that model "
        "parallelism replicates over its ranks; in pure data parallelism each rank's activations "
        "are its own rows: kept whole (cpu_checkpointing applies)",
    "activation_checkpointing.contiguous_memory_optimization": "it packs P_a's partitions into "
        "one buffer: no partitions, checkpoints stay separate tensors",
    "activation_checkpointing.number_checkpoints": "one checkpoint per block",
    "activation_checkpointing.synchronize_checkpoint_boundary": "no device synchronization at "
        "checkpoints",
    "activation_checkpointing.profile": "no per-checkpoint timing; the CLI reports the step time",
}

# Keys DeepSpeed 0.19.8 reads only to refuse them: an error here too, with its reason.
REFUSED = {
    "progressive_layer_drop": "DeepSpeed 0.19.8 removed Progressive Layer Dropping and refuses "
        "the section",
    "quantize_training": "DeepSpeed 0.19.8 removed MoQ (quantize_training) and refuses the "
        "section",
}

# DeepSpeed's other spellings (pydantic aliases, deprecated names): read as the key they stand for.
ALIASES = {
    "bfloat16": "bf16",
    "zero_optimization.prefetch_bucket_size": "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.param_persistence_threshold":
        "zero_optimization.stage3_param_persistence_threshold",
    "zero_optimization.model_persistence_threshold":
        "zero_optimization.stage3_model_persistence_threshold",
    "zero_optimization.max_live_parameters": "zero_optimization.stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "zero_optimization.stage3_max_reuse_distance",
    "zero_optimization.gather_16bit_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save":
        "zero_optimization.stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.module_granularity_threshold":
        "zero_optimization.stage3_module_granularity_threshold",
    "zero_optimization.use_all_reduce_for_fetch_params":
        "zero_optimization.stage3_use_all_reduce_for_fetch_params",
    "zero_optimization.allgather_sequential": "zero_optimization.stage3_allgather_sequential",
    "tensor_parallel.tp": "tensor_parallel.tensor_parallel",
    "tensor_parallel.kernel_inject": "tensor_parallel.replace_with_kernel_inject",
}

# DeepSpeed's deprecated booleans: true means this device "cpu" (its new_param_fn).
LEGACY_OFFLOAD = {
    "zero_optimization.cpu_offload": "zero_optimization.offload_optimizer.device",
    "zero_optimization.cpu_offload_param": "zero_optimization.offload_param.device",
}

# Sections opened key by key (any other section is one value: its key decides).
SECTIONS = {"bf16", "fp16", "data_types", "zero_optimization", "zero_optimization.leaf_module",
            "zero_optimization.offload_optimizer", "zero_optimization.offload_param", "optimizer",
            "optimizer.params", "activation_checkpointing", "scheduler", "scheduler.params",
            "tensor_parallel"}


def known() -> set[str]:
    """Every key with a home in the tables (its aliases included)."""
    return (set(KEYS) | set(ALWAYS_ON) | set(NOT_IMPLEMENTED) | set(REFUSED) | set(ALIASES)
            | set(LEGACY_OFFLOAD))


def markdown() -> str:
    """The tables of docs/deepspeed_config.md, generated from the ones above."""
    def table(header: tuple[str, str], rows: dict) -> list[str]:
        return [f"| {header[0]} | {header[1]} |", "|---|---|",
                *(f"| `{key}` | {text} |" for key, text in rows.items()), ""]
    legacy = {old: f"`{new}`: \"cpu\" when true" for old, new in LEGACY_OFFLOAD.items()}
    return "\n".join([
        "### Keys minizero applies", "", *table(("key", "becomes"), KEYS),
        "### Keys for things minizero always does (`false` gives a warning)", "",
        *table(("key", "what minizero does"), ALWAYS_ON),
        "### Keys accepted without effect (one warning each)", "",
        *table(("key", "why it has no effect here"), NOT_IMPLEMENTED),
        "### Keys refused (an error, one line)", "", *table(("key", "why"), REFUSED),
        "### DeepSpeed's other spellings", "",
        *table(("spelling", "read as"), {**{k: f"`{v}`" for k, v in ALIASES.items()}, **legacy}),
    ])


if __name__ == "__main__":
    print(markdown())
