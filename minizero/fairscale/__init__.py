"""FairScale's front end: FullyShardedDataParallel with flat parameters, and its wrap helpers.

    from minizero.fairscale import FullyShardedDataParallel, auto_wrap, enable_wrap, wrap
    python -m pytest tests/test_fsdp.py tests/test_fairscale_scenarios.py

What `fairscale.nn` exports, on minizero's stage-3 engine: read fsdp.py first (the wrapper), then
fsdp_engine.py (what FairScale's way changes in zero3.py), fsdp_options.py (its constructor
keywords), fsdp_state.py (summon_full_params and the state dicts) and fsdp_wrap.py (enable_wrap,
wrap, auto_wrap).
"""

from minizero.fairscale.fsdp import FullyShardedDataParallel
from minizero.fairscale.fsdp_wrap import (auto_wrap, config_auto_wrap_policy,
                                          default_auto_wrap_policy, enable_wrap, wrap)

__all__ = ["FullyShardedDataParallel", "auto_wrap", "config_auto_wrap_policy",
           "default_auto_wrap_policy", "enable_wrap", "wrap"]
