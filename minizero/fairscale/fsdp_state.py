"""FairScale FSDP's state methods on minizero (read fairscale/fsdp.py first): the full parameters
between steps, state dicts full and local, and the optimizer's state gathered and sharded again.

    with model.summon_full_params():            # every unit gathered; writes persist
        model.module.layer.weight.mul_(0.5)
    full = model.state_dict()                   # the model's own names, CPU, fp32 (collective)
    full_osd = model.gather_full_optim_state_dict(optimizer)     # rank 0; None elsewhere
    optimizer.load_state_dict(model.get_shard_from_optim_state_dict(full_osd))

Run its tests:  python -m pytest tests/test_fairscale_scenarios.py

Names are the model's own: an adopted inner FSDP (fairscale/fsdp.py) puts `_fsdp_wrapped_module.` in
the module tree's names, which every method here takes out (and puts back on loading), as
FairScale's state-dict hooks do. The full optimizer state has one entry per parameter of the model,
numbered as model.parameters() numbers them: what torch.optim would hold for the unwrapped model.
"""

from __future__ import annotations

import contextlib
import math
from collections import OrderedDict

import torch
from torch import nn

from minizero import comm

WRAPPED = "_fsdp_wrapped_module."


def clean(name: str) -> str:
    """A name in the module tree -> the model's own name (no inner FSDP's wrapped-module step)."""
    return name.replace(WRAPPED, "")


class StateMixin:
    """FullyShardedDataParallel's state methods; self.engine (the root's) or self._outer_engine (an
    adopted instance's root engine) does the work."""

    def _engine_of(self):
        return self.engine if self.engine is not None else self._outer_engine

    def _own_params(self, recurse: bool) -> list[nn.Parameter]:
        """This instance's parameters: all of its module's, or only its own unit's."""
        if recurse:
            return list(self.module.parameters())
        home = self.module if self.engine is not None else self
        return [p for u in self._engine_of().units if u.module is home for p in u.params]

    # --- the full parameters between steps --------------------------------------------------------
    @contextlib.contextmanager
    def summon_full_params(self, recurse: bool = True, volatile: bool = False):
        """FairScale's: inside, the module's full parameters (recurse=False: this instance's own)
        are readable on every rank under their own names (named_parameters()), in full precision
        (with mixed precision: the fp32 masters gathered); what a rank writes to them persists in
        its partition (volatile=True: not kept). Collective, between steps."""
        engine, params = self._engine_of(), self._own_params(recurse)
        instances = [m for m in self.module.modules() if isinstance(m, StateMixin)] if recurse \
            else []
        for m in [self, *instances]:
            m._summoned = True
        try:
            with engine.gathering(params):
                masters = _masters_in_full(engine, params)     # 16-bit units: fp32 views instead
                yield
                if not volatile:
                    with torch.no_grad():
                        engine.after_user_write(params)   # each rank's partition of its writes
                        for master, full, b in masters:
                            master.copy_(engine.layout.my_partition(full, b))
                    engine.optimizer.refresh()          # the 16-bit partitions follow
        finally:
            for m in [self, *instances]:
                m._summoned = False

    # --- state dicts ------------------------------------------------------------------------------
    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The model's full state (its own names, CPU, fp32) on every rank (rank 0 only with
        state_dict_on_rank_0_only). Collective. Called by a module above (destination given) an
        adopted instance is an ordinary module."""
        if self.engine is None and destination is not None:
            return super().state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if self.engine is None:
            with self.summon_full_params():
                full = {k: v.detach().cpu().float().clone() if v.is_floating_point()
                        else v.detach().cpu().clone() for k, v in self.module.state_dict().items()}
        else:
            full = self.engine.full_state_dict()
        out = OrderedDict() if destination is None else destination
        if self.settings.state_dict_on_rank_0_only and comm.rank() != 0:
            return out
        for name, value in full.items():
            out[prefix + clean(name)] = value
        return out

    def load_state_dict(self, state_dict, strict: bool = True):
        """Load a full state dict (the model's own names); rank 0's is what every rank gets; with
        mixed precision the fp32 masters take its fp32 values. Collective."""
        engine = self._engine_of()
        names = {clean(k): k for k in self.module.state_dict(keep_vars=True)}
        mapped = {names.get(k, k): v for k, v in state_dict.items()}
        with engine.gathered([self.module], modifier_rank=0):
            result = self.module.load_state_dict(mapped, strict=strict)
        values = {id(p): mapped[name] for name, p in self.module.named_parameters()
                  if name in mapped}
        if self.engine is not None and all(id(p) in values for p in engine.trainable):
            engine._take_masters(values)
        return type(result)([clean(k) for k in result.missing_keys],
                            [clean(k) for k in result.unexpected_keys])

    def _pieces(self) -> dict[str, tuple[torch.Tensor, list]]:
        """This rank's partitions by local name: flat_param_i (a FlatParameter) and frozen_param_u
        (a unit's frozen parameters), each with its parameters' (names, shape) in bucket order."""
        engine = self.engine
        names: dict[int, list[str]] = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            names.setdefault(id(p), []).append(clean(name))

        def layout(bucket) -> list:
            return [(names[id(p)], tuple(p.shape)) for p in bucket.params]
        pieces = {f"flat_param_{i}": (p, layout(b)) for i, (p, b) in
                  enumerate(zip(engine.optimizer.params, engine.layout.buckets))}
        pieces.update({f"frozen_param_{u.index}": (u.frozen_shard, layout(u.frozen_bucket))
                       for u in engine.units if u.frozen_bucket is not None})
        return pieces

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's partitions (flat_param_i, frozen_param_u) and the model's buffers: loadable
        into the same model wrapped at the same world size, or consolidated with the other ranks'
        (consolidate_shard_weights)."""
        out = {key: t.detach().clone() for key, (t, _) in self._pieces().items()}
        out.update({clean(n): b.detach().clone() for n, b in self.module.named_buffers()})
        return out

    def local_metadata_dict(self) -> dict:
        """What consolidate_shard_weights needs besides the weights: each partition's parameters
        (their names and shapes, in order) and the buffers' names."""
        return {"world_size": comm.world_size(),
                "pieces": {key: params for key, (_, params) in self._pieces().items()},
                "buffers": [clean(n) for n, _ in self.module.named_buffers()]}

    @staticmethod
    def consolidate_shard_weights(shard_weights: list[dict], shard_metadata: list[dict]) -> dict:
        """Every rank's local_state_dict() and local_metadata_dict() (in rank order) -> the full
        state dict, the unwrapped model's names; no process group needed."""
        meta = shard_metadata[0]
        if len(shard_weights) != meta["world_size"]:
            raise ValueError(f"consolidate_shard_weights needs all {meta['world_size']} ranks' "
                             f"weights, got {len(shard_weights)}")
        out = {}
        for key, params in meta["pieces"].items():
            full, offset = torch.cat([w[key] for w in shard_weights]), 0   # ranks' partitions
            for names, shape in params:
                numel = math.prod(shape)
                value = full[offset: offset + numel].view(shape).float().clone()
                out.update({name: value for name in names})
                offset += numel
        out.update({name: shard_weights[0][name] for name in meta["buffers"]})
        return out

    def load_local_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """What local_state_dict() gave, on this rank (no communication)."""
        expected = self.local_state_dict().keys()
        if state_dict.keys() != expected:
            raise ValueError(f"local state dict keys differ: missing "
                             f"{sorted(expected - state_dict.keys())}, unexpected "
                             f"{sorted(state_dict.keys() - expected)}")
        with torch.no_grad():
            for key, (t, _) in self._pieces().items():
                t.copy_(state_dict[key])
            for n, b in self.module.named_buffers():
                b.copy_(state_dict[clean(n)])
        self.engine.optimizer.refresh()               # 16-bit partitions from the loaded masters

    # --- the optimizer's state --------------------------------------------------------------------
    def _numbering(self) -> dict[int, int]:
        """id(parameter) -> its number in model.parameters() (the unwrapped optimizer's)."""
        return {id(p): i for i, p in enumerate(self.module.parameters())}

    def gather_full_optim_state_dict(self, optim: torch.optim.Optimizer, **ignored):
        """The optimizer's state as torch.optim would hold it for the unwrapped model: one entry
        per parameter (its full tensors, CPU), on rank 0; None on the others. Collective."""
        engine, number = self.engine, self._numbering()
        flat = {id(p): (p, b) for p, b in zip(engine.optimizer.params, engine.layout.buckets)}
        sd = optim.state_dict()
        if len(sd["param_groups"]) != 1:
            raise ValueError("gather_full_optim_state_dict takes one parameter group (FairScale's)")
        order = [p for group in optim.param_groups for p in group["params"]]
        state: dict[int, dict] = {}
        for k, p in enumerate(order):
            _, b = flat[id(p)]
            for key, value in sd["state"].get(k, {}).items():
                per_param = [value] * len(b.params)
                if torch.is_tensor(value) and value.dim() == 1 and value.numel() == b.shard_numel:
                    full = torch.empty(b.padded_numel, dtype=value.dtype, device=engine.device)
                    comm.all_gather(full, value.to(engine.device).contiguous(), tag="optim state")
                    per_param = [view for _, view in b.views(full)]
                for param, v in zip(b.params, per_param):
                    v = v.detach().cpu().clone() if torch.is_tensor(v) else v
                    state.setdefault(number[id(param)], {})[key] = v
        if comm.rank() != 0:
            return None
        group = {k: v for k, v in sd["param_groups"][0].items() if k != "params"}
        return {"state": dict(sorted(state.items())),
                "param_groups": [{**group, "params": list(number.values())}],
                "uncollected_local_ids": []}      # FairScale's key: no instance keeps its own

    def get_shard_from_optim_state_dict(self, full_optim_state_dict: dict) -> dict:
        """A full optimizer state (gather_full_optim_state_dict's, or the unwrapped model's) ->
        what this rank's optimizer over model.parameters() loads: each tensor flattened into its
        unit's bucket and cut to this rank's partition. As FairScale's, it consumes its argument
        (its "state" becomes the shard's): pass a copy to keep it."""
        engine, number = self.engine, self._numbering()
        full_state = full_optim_state_dict["state"]
        state = {}
        for i, b in enumerate(engine.layout.buckets):
            first = full_state.get(number[id(b.params[0])])
            if first is None:
                continue                               # never stepped
            state[i] = {}
            for key, value in first.items():
                if torch.is_tensor(value) and value.dim() > 0 and \
                        value.shape == b.params[0].shape:
                    full = torch.zeros(b.padded_numel, dtype=value.dtype, device=engine.device)
                    for param, view in b.views(full):
                        view.copy_(full_state[number[id(param)]][key])
                    value = engine.layout.my_partition(full, b)
                state[i][key] = value.clone() if torch.is_tensor(value) else value
        group = {k: v for k, v in full_optim_state_dict["param_groups"][0].items()
                 if k != "params"}
        full_optim_state_dict["state"] = state        # FairScale's: the input is consumed in place
        return {"state": state,
                "param_groups": [{**group, "params": list(range(len(engine.layout.buckets)))}]}


def _masters_in_full(engine, params: list) -> list[tuple[torch.Tensor, torch.Tensor, object]]:
    """Mixed precision, inside summon_full_params: the fp32 masters of the units holding `params`,
    all-gathered, the parameters pointed at them (FairScale gathers in full precision); (master,
    its full buffer, bucket) for each. Unit.free() points the parameters back when released."""
    wanted = {id(p) for p in params}
    out = []
    for master, b in zip(engine.optimizer.params, engine.layout.buckets):
        part = engine.layout.shard(engine.params.shard, b)
        if master.data_ptr() == part.data_ptr() or not any(id(p) in wanted for p in b.params):
            continue                                   # fp32: the gathered parameters are full
        full = torch.empty(b.padded_numel, dtype=torch.float32, device=engine.device)
        comm.all_gather(full, master.detach().contiguous(), tag="summon_full_params masters")
        for p, view in b.views(full):
            p.data = view
        out.append((master, full, b))
    return out

