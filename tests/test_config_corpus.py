"""Third-party DeepSpeed configs, kept verbatim in tests/data/deepspeed_configs (MANIFEST.json names
each one's repository, path and commit, and what DeepSpeed 0.19.8's parser and minizero's reader
say of it at N = 2), run through minizero and, where DeepSpeed is installed, through DeepSpeed:

  * minizero's reader (minizero.initialize's: flags=False) gives the recorded verdict, never
    "unknown key", and refuses a config DeepSpeed accepts only where MANIFEST says why ("differs");
  * DeepSpeed's parser still gives the recorded verdict, and every key it reads has a home in
    minizero/deepspeed/config_keys.py (its pydantic sections' fields and aliases; the top-level keys
    DeepSpeedConfig looks up, recorded by a dict that notes each lookup);
  * each config minizero accepts trains the tiny GPT of examples/deepspeed_style.py for 3 steps
    with minizero.initialize at N = 2 (one launch for all), and ends where DeepSpeed ends on the
    same data, compared on the fp32 master weights (DeepSpeed's safe_get_full_fp32_param; its
    16-bit parameters at stage 0, where it gives none): fp32 within 1e-5, bf16/fp16 within 5e-3
    (one launch runs both libraries).
For the training run (only) each config is adapted, the same way on both sides: the batch sizes
become 2 rows per rank per micro-batch (the configs' own are for real models and clusters), with
the config's accumulation when it gives one of at most 3; a config without an optimizer gets
AdamW(lr 1e-3). DeepSpeed's side also gets what makes it step with torch's AdamW instead of
compiling its fused ops (torch_adam, zero_allow_untested_optimizer, zero_force_ds_cpu_optimizer
false, and weight_decay 0 when the config gives none: FusedAdam's default, which torch's AdamW
would make 0.01), keeps torch's own linear at stage 3 (memory_efficient_linear false; its own
rounds differently, tests/test_deepspeed.py); an Adam with bias_correction false is given to it as
a client optimizer, minizero/deepspeed/adam.py's uncorrected step (DeepSpeed's own needs its
compiled ops on a CPU; its ZeRO partitioning, reduction and step order are still its own); it leaves
"auto" out (DeepSpeed's default: what minizero's reader resolves it to in the configs it accepts)
and drops zenflow (which steps its own optimizer there; minizero accepts it without effect, so
DeepSpeed without it is what minizero claims to match); a reduce_bucket_size of 0 (one bucket per
parameter, which DeepSpeed 0.19.8's parser refuses) reaches it as 1, the same buckets. An fp16
config skips DeepSpeed's side on a CPU where DeepSpeed refuses fp16 (no AVX512-FP16 or AMX).

Run: python -m pytest tests/test_config_corpus.py -q    (DeepSpeed: pip install -e ".[peers]")
"""

from __future__ import annotations

import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest

import minizero
from minizero.deepspeed import adam
from minizero.deepspeed.config import ConfigError, load_deepspeed_config
from minizero.deepspeed.config_keys import SECTIONS, known
from minizero.lab import deepspeed_peer
from minizero.lab.reference import max_abs_diff

ROOT = Path(__file__).parent.parent
CORPUS = ROOT / "tests" / "data" / "deepspeed_configs"
MANIFEST = json.loads((CORPUS / "MANIFEST.json").read_text())
EXAMPLE = ROOT / "examples" / "deepspeed_style.py"
N, STEPS = 2, 3
TRAINED = [name for name, entry in MANIFEST.items() if entry["minizero"] == "accepts"]


def read(config) -> str:
    """minizero.initialize's reading of a config: "accepts" or its one-line error."""
    try:
        load_deepspeed_config(config, N, flags=False)
    except ConfigError as e:
        return str(e)
    return "accepts"


def test_the_corpus_is_verbatim_third_party_material_with_its_source():
    files = {p.name for p in CORPUS.glob("*.json")} - {"MANIFEST.json"}
    assert files == set(MANIFEST) and len(files) >= 25
    for entry in MANIFEST.values():
        assert entry["repo"].count("/") == 1 and entry["path"].endswith(".json")
        assert re.fullmatch(r"[0-9a-f]{40}", entry["commit"])


@pytest.mark.parametrize("name", MANIFEST)
def test_minizero_reads_each_config_as_recorded(name):
    entry, verdict = MANIFEST[name], read(CORPUS / name)
    assert verdict == entry["minizero"]
    assert "unknown key" not in verdict
    # a config DeepSpeed accepts is refused only where the manifest says why
    assert (entry["deepspeed"] == "accepts") == (verdict == "accepts") or entry.get("differs")


# --- DeepSpeed's side: its parser, its keys, and training next to it ---------------------------

def for_training(config: dict, deepspeed: bool) -> dict:
    """The config as the training check runs it (the module docstring says why)."""
    config = copy.deepcopy(config)
    accumulation = config.get("gradient_accumulation_steps")
    for key in ("train_batch_size", "train_micro_batch_size_per_gpu",
                "gradient_accumulation_steps"):
        config.pop(key, None)
    config["train_micro_batch_size_per_gpu"] = 2
    if isinstance(accumulation, int) and accumulation <= 3:
        config["gradient_accumulation_steps"] = accumulation
    config.setdefault("optimizer", {"type": "AdamW", "params": {"lr": 1e-3}})
    if deepspeed:
        config = _without_auto(config)
        if config["optimizer"]["type"].lower() in ("adam", "adamw"):
            params = config["optimizer"].setdefault("params", {})
            params["torch_adam"] = True
            params.setdefault("weight_decay", 0.0)        # FusedAdam's default, not torch's 0.01
        config.update(zero_allow_untested_optimizer=True, zero_force_ds_cpu_optimizer=False)
        zero = config.get("zero_optimization")
        if isinstance(zero, dict):
            zero["memory_efficient_linear"] = False
            if zero.get("reduce_bucket_size") == 0:     # one bucket per parameter, as 0.19.8 spells
                zero["reduce_bucket_size"] = 1          # it (its parser refuses 0: MANIFEST)
            zero.pop("zenflow", None)
    return config


def _uncorrected(config: dict) -> bool:
    return config.get("optimizer", {}).get("params", {}).get("bias_correction") is False


class _ClientAdam:
    """deepspeed, handed the config's uncorrected Adam as a client optimizer object."""

    def __init__(self, deepspeed, section: dict):
        self._deepspeed, self._section = deepspeed, section

    def initialize(self, model, model_parameters, config):
        params = dict(self._section.get("params", {}))
        decoupled = self._section["type"].lower() == "adamw" or params.pop("adam_w_mode", True)
        params.pop("torch_adam", None)
        optimizer = (adam.AdamW if decoupled else adam.Adam)(model_parameters, **params)
        config = {k: v for k, v in config.items() if k != "optimizer"}
        return self._deepspeed.initialize(model=model, optimizer=optimizer, config=config)

    def __getattr__(self, name):
        return getattr(self._deepspeed, name)


def _without_auto(section: dict) -> dict:
    """DeepSpeed's side: "auto" left out (its default), as minizero's reader resolves the "auto"
    in the configs it accepts."""
    return {k: _without_auto(v) if isinstance(v, dict) else v for k, v in section.items()
            if v != "auto"}


def sixteen_bit(config: dict) -> bool:
    return any(config.get(s, {}).get("enabled") is True for s in ("bf16", "bfloat16", "fp16"))


def _example():
    spec = importlib.util.spec_from_file_location("deepspeed_style", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def train_all(names: list[str], with_deepspeed: bool) -> dict:
    """Worker: each config trained by minizero (and DeepSpeed); with DeepSpeed also its parser's
    verdict on every corpus config and the keys it reads."""
    script, out = _example(), {}
    deepspeed = deepspeed_peer.join() if with_deepspeed else None
    script.full_parameters = _fp32_parameters          # both sides' fp32 masters
    for name in names:
        config = json.loads((CORPUS / name).read_text())
        try:
            ours = script.train(minizero, for_training(config, False), STEPS)
        except Exception as e:                            # recorded, asserted in the test
            out[name] = {"minizero_error": f"{type(e).__name__}: {e}".splitlines()[0]}
            continue
        result = {"losses": ours[0]}
        if deepspeed is not None:
            try:
                theirs_config = for_training(config, True)
                peer = (_ClientAdam(deepspeed, theirs_config["optimizer"]) if _uncorrected(config)
                        else deepspeed)
                theirs = script.train(peer, theirs_config, STEPS)
                result["max_param_diff"] = max_abs_diff(ours[1], theirs[1])
            except Exception as e:                        # recorded, asserted in the test
                result["deepspeed_error"] = f"{type(e).__name__}: {e}".splitlines()[0]
        out[name] = result
    if deepspeed is not None:
        out["_parser"] = {name: _deepspeed_verdict(json.loads((CORPUS / name).read_text()))
                          for name in MANIFEST}
        out["_keys"] = _deepspeed_keys()
    return out


def _fp32_parameters(deepspeed, engine) -> dict:
    """The fp32 master weights, by the model's names: minizero's full_state_dict holds them;
    DeepSpeed's safe_get_full_fp32_param gathers them where its optimizer keeps them apart from
    the module (ZeRO 1-3, bf16), else the module's parameters are its masters."""
    if not hasattr(deepspeed, "zero"):
        return engine.full_state_dict()
    from deepspeed.utils import safe_get_full_fp32_param
    out = {}
    for name, tensor in engine.module.state_dict(keep_vars=True).items():    # tied: both names
        master = safe_get_full_fp32_param(tensor) if tensor.requires_grad else None
        out[name] = (tensor if master is None else master).detach().float().cpu().clone()
    return out


def _deepspeed_verdict(config: dict) -> str:
    from deepspeed.runtime.config import DeepSpeedConfig
    try:
        DeepSpeedConfig(config)
    except Exception:                                     # its asserts, TypeErrors, pydantic's
        return "refuses"
    return "accepts"


class _Recorder(dict):
    """A config dict that notes every key DeepSpeedConfig looks up in it (get, in, [])."""

    def __init__(self, data: dict, prefix: str, seen: set):
        super().__init__(data)
        self.prefix, self.seen = prefix, seen

    def get(self, key, *default):
        self.seen.add(self.prefix + key)
        return super().get(key, *default)

    def __contains__(self, key):
        self.seen.add(self.prefix + key)
        return super().__contains__(key)

    def __getitem__(self, key):
        self.seen.add(self.prefix + key)
        return super().__getitem__(key)

    def keys(self):                                       # `key in config.keys()` is a lookup too
        return self


def _deepspeed_keys() -> list[str]:
    """Every key DeepSpeed 0.19.8's parser reads: the top-level lookups of DeepSpeedConfig, and the
    fields (and aliases) of its pydantic sections."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (
        DeepSpeedZeroOffloadOptimizerConfig,
        DeepSpeedZeroOffloadParamConfig,
    )
    seen: set[str] = set()
    sections = {name: _Recorder({}, name + ".", seen)
                for name in ("checkpoint", "data_types", "torch_autocast")}
    DeepSpeedConfig(_Recorder({"train_batch_size": N, **sections,
                               "optimizer": _Recorder({"type": "AdamW"}, "optimizer.", seen),
                               "scheduler": _Recorder({"type": "WarmupLR"}, "scheduler.", seen)},
                              "", seen))
    for prefix, model in (("zero_optimization.", DeepSpeedZeroConfig),
                          ("zero_optimization.offload_param.", DeepSpeedZeroOffloadParamConfig),
                          ("zero_optimization.offload_optimizer.",
                           DeepSpeedZeroOffloadOptimizerConfig),
                          ("bf16.", DeepSpeedBF16Config), ("fp16.", DeepSpeedFP16Config)):
        for field, info in model.model_fields.items():
            seen.update(prefix + name for name in {field, info.alias} if name)
    return sorted(seen)


@pytest.fixture(scope="module")
def runs():
    with_deepspeed = deepspeed_peer.available()
    per_rank = minizero.launch(train_all, N, TRAINED, with_deepspeed, backend="gloo", timeout=600)
    return per_rank


def _need_deepspeed():
    if not deepspeed_peer.available():
        pytest.skip("DeepSpeed is not installed (DS_BUILD_OPS=0 pip install -e '.[peers]'): "
                    "minizero's side of the corpus runs without it")


def covered(key: str) -> bool:
    """Whether a key DeepSpeed reads has a home: itself, or the whole section it lies in (a
    section minizero does not open), or optimizer/scheduler's type and params."""
    section = key.partition(".")[0]
    return key in known() or (section in known() and section not in SECTIONS) or \
        key in ("optimizer.type", "optimizer.params", "scheduler.type", "scheduler.params") or \
        key in SECTIONS


def test_every_key_deepspeeds_parser_reads_has_a_home(runs):
    _need_deepspeed()
    keys = runs[0]["_keys"]
    assert len(keys) > 100                               # the recorder saw the parser at work
    missing = [key for key in keys if not covered(key)]
    assert not missing, ("keys DeepSpeed 0.19.8 reads with no home in deepspeed/config_keys.py: "
                         f"{missing}")


def test_deepspeeds_parser_gives_the_recorded_verdicts(runs):
    _need_deepspeed()
    assert runs[0]["_parser"] == {name: e["deepspeed"] for name, e in MANIFEST.items()}


@pytest.mark.parametrize("name", TRAINED)
def test_each_accepted_config_trains_and_ends_where_deepspeed_ends(runs, name):
    for rank in runs:
        assert "minizero_error" not in rank[name], rank[name]["minizero_error"]
        losses = rank[name]["losses"]
        assert len(losses) >= STEPS and all(loss == loss and loss < 1e4 for loss in losses)
    _need_deepspeed()
    tolerance = 5e-3 if sixteen_bit(json.loads((CORPUS / name).read_text())) else 1e-5
    for rank in runs:
        error = rank[name].get("deepspeed_error", "")
        if "is not supported on your device" in error:      # fp16 on a CPU without AVX512-FP16/AMX
            pytest.skip(f"DeepSpeed cannot run {name} on this CPU: {error}")
        assert not error, error
        assert rank[name]["max_param_diff"] <= tolerance, (name, rank[name]["max_param_diff"])
