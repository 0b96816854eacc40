"""DeepSpeed's front end: what `deepspeed.initialize` takes, on minizero's engines.

    engine, optimizer, _, scheduler = minizero.initialize(model=model, config="ds_config.json")
    python -m minizero.run --config examples/ds_config_zero2_offload.json

initialize.py (the engine DeepSpeed's scripts drive), config.py (its JSON config, read key by key;
every key its parser reads has one home in config_keys.py), deepspeed_checkpoint.py (tags, `latest`,
client_state over minizero/checkpoint.py) and adam.py (its bias_correction switch).
docs/deepspeed_config.md says which keys apply, which only warn, and why.
"""

from minizero.deepspeed.initialize import initialize

__all__ = ["initialize"]
