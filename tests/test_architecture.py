"""Two rules of the engine's shape, read from the source (docs/architecture.md):

    python -m pytest tests/test_architecture.py

1. A unit's lifecycle states (zero3.py's ShardState, TrainingState; units.py's held_for_user)
   change only in the methods of zero3.Unit and of the classes that derive from it (units.py's
   ModelUnit, beyond/hpz.py's mixin; fully_shard's Unit, minizero/pytorch/fsdp_unit.py, the same
   lifecycle for per-parameter shards), and only on the unit itself (`self.state = ...`).
   Everything else asks a unit to do something (gather, free, hold_for_user) and reads its state;
   so the states a unit can be in, and how it moves between them, are the unit's business, as in
   FSDP2's param group.
2. No `__init__` calls a method that a subclass overrides. A constructor that calls `self.m()`
   runs the subclass's m on a half-built object (the subclass's own __init__ has not run yet);
   the engine used to be built that way (`_make_grads`, `_make_optimizer`, ... overridden stage by
   stage). Now each stage is a row of stages.TABLE and the engine builds the row's families in one
   order, top to bottom.
"""

from __future__ import annotations

import ast
import inspect
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "minizero"
LIFECYCLE_ATTRIBUTES = {"training_state", "held_for_user"}
LIFECYCLE_ENUMS = {"ShardState", "TrainingState"}


def _sources() -> dict[str, str]:
    return {str(p.relative_to(PACKAGE.parent)): p.read_text()
            for p in sorted(PACKAGE.rglob("*.py"))}


def _names(node: ast.AST) -> set[str]:
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def lifecycle_writes(source: str, owners: set[str] = frozenset()) -> list[str]:
    """Lines that set a unit's lifecycle state: an attribute in LIFECYCLE_ATTRIBUTES assigned, or
    any attribute assigned a ShardState / TrainingState value (also through setattr). Inside the
    classes named in `owners` only writes to `self.<attr>` are allowed."""
    found, tree = [], ast.parse(source)
    inside = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) and c.name in owners
              for n in ast.walk(c)}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            flat = [t for target in targets for t in
                    (target.elts if isinstance(target, ast.Tuple) else [target])]
            for target in flat:
                if not isinstance(target, ast.Attribute):
                    continue
                if (target.attr in LIFECYCLE_ATTRIBUTES
                        or (node.value is not None and _names(node.value) & LIFECYCLE_ENUMS)):
                    on_self = isinstance(target.value, ast.Name) and target.value.id == "self"
                    if not (id(node) in inside and on_self):
                        found.append(f"{node.lineno}: {ast.unparse(target)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id == "setattr" and len(node.args) == 3
              and (_names(node.args[2]) & LIFECYCLE_ENUMS
                   or (isinstance(node.args[1], ast.Constant)
                       and node.args[1].value in LIFECYCLE_ATTRIBUTES))):
            found.append(f"{node.lineno}: setattr")
    return found


def unit_classes(sources: dict[str, str]) -> set[str]:
    """zero3.Unit and every class that derives from it (or is mixed into one: its methods run on
    the unit, beyond/hpz.py's HpzUnit), by name."""
    classes = _classes(sources)
    units = {"Unit"}
    while True:
        more = {name for name, (bases, _, _) in classes.items()
                if name not in units and set(bases) & units}
        more |= {base for name in units for base in classes.get(name, ([], None, ""))[0]
                 if base in classes and base not in units and base.endswith("Unit")}
        if not more:
            return units
        units |= more


def test_only_a_unit_moves_its_lifecycle_states():
    sources = _sources()
    units = unit_classes(sources)
    bad = {path: lines for path, source in sources.items()
           if (lines := lifecycle_writes(source, owners=units))}
    assert not bad, (f"unit lifecycle states set outside the unit ({bad}): ask the unit "
                     "(gather, free, hold_for_user, ...) and let zero3.Unit move its state")


def test_the_lifecycle_rule_can_fail():
    outside = ("from minizero.unit import ShardState, TrainingState\n"
               "unit.training_state = TrainingState.IDLE\n"
               "u.state = ShardState.FREE\n"
               "unit.held_for_user = True\n"
               "setattr(unit, 'state', ShardState.GATHERED)\n"
               "self.state = 'idle'\n"          # not a lifecycle value: fine anywhere
               "engine.sync = False\n")
    assert [int(s.split(":")[0]) for s in lifecycle_writes(outside)] == [2, 3, 4, 5]
    inside = ("class Unit:\n    def free(self):\n        self.state = ShardState.FREE\n"
              "        other.training_state = TrainingState.IDLE\n"
              "class ShardedUnits:\n    def f(self):\n        self.state = ShardState.FREE\n")
    assert lifecycle_writes(inside, owners={"Unit"}) == ["4: other.training_state",
                                                         "7: self.state"]
    assert unit_classes({"a.py": "class Unit: pass\nclass ModelUnit(HpzUnit, Unit): pass\n"
                                 "class HpzUnit: pass\nclass ShardedUnits: pass\n"}) == {
        "Unit", "ModelUnit", "HpzUnit"}


def _classes(sources: dict[str, str]) -> dict[str, tuple[list[str], ast.ClassDef, str]]:
    """Every class in the sources by name: (its base classes' names, its node, its file)."""
    out = {}
    for path, source in sources.items():
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ClassDef):
                bases = [b.attr if isinstance(b, ast.Attribute) else getattr(b, "id", "")
                         for b in node.bases]
                out[node.name] = (bases, node, path)
    return out


def _methods(node: ast.ClassDef) -> dict[str, ast.FunctionDef]:
    return {f.name: f for f in node.body if isinstance(f, ast.FunctionDef)}


def _runs_now(function: ast.FunctionDef):
    """The nodes of a function's body that run when it is called: not those inside a lambda or a
    nested def (a hook registered in __init__ runs later, on a whole object)."""
    todo = list(function.body)
    while todo:
        node = todo.pop()
        yield node
        todo.extend(child for child in ast.iter_child_nodes(node)
                    if not isinstance(child, (ast.Lambda, ast.FunctionDef)))


def constructor_calls_to_overridden_methods(sources: dict[str, str]) -> list[str]:
    """`self.m()` inside some class's __init__ where a subclass (anywhere in the sources)
    defines m."""
    classes = _classes(sources)

    def ancestors(name: str) -> set[str]:
        seen, todo = set(), list(classes.get(name, ([], None, ""))[0])
        while todo:
            base = todo.pop()
            if base in classes and base not in seen:
                seen.add(base)
                todo.extend(classes[base][0])
        return seen

    found = []
    for name, (_, node, path) in classes.items():
        init = _methods(node).get("__init__")
        if init is None:
            continue
        called = {c.func.attr: c.lineno for c in _runs_now(init)
                  if isinstance(c, ast.Call) and isinstance(c.func, ast.Attribute)
                  and isinstance(c.func.value, ast.Name) and c.func.value.id == "self"}
        for sub, (_, sub_node, sub_path) in classes.items():
            if name not in ancestors(sub):
                continue
            for method in called.keys() & _methods(sub_node).keys():
                found.append(f"{path}:{called[method]} {name}.__init__ calls self.{method}(), "
                             f"which {sub} ({sub_path}) overrides")
    return sorted(found)


def test_no_constructor_calls_a_method_a_subclass_overrides():
    bad = constructor_calls_to_overridden_methods(_sources())
    assert not bad, "\n".join(bad)


def test_the_constructor_rule_can_fail():
    sources = {"a.py": ("class Engine:\n    def __init__(self):\n        self.grads = "
                        "self._make_grads()\n        self.log()\n"
                        "        hook(lambda: self._make_grads())\n"
                        "    def _make_grads(self):\n        return None\n"
                        "    def log(self):\n        pass\n"),
               "b.py": ("import a\nclass Zero1(a.Engine):\n    pass\n"
                        "class Zero2(Zero1):\n    def _make_grads(self):\n        return 2\n")}
    assert constructor_calls_to_overridden_methods(sources) == [
        "a.py:3 Engine.__init__ calls self._make_grads(), which Zero2 (b.py) overrides"]


def _interface(protocol: type) -> dict[str, list[str]]:
    """A Protocol's methods (its own and inherited) with their argument names."""
    return {name: list(inspect.signature(f).parameters)
            for cls in protocol.__mro__ if cls.__module__ == protocol.__module__
            for name, f in vars(cls).items() if inspect.isfunction(f) and not name.startswith("_")}


def missing_from(home: type, protocol: type) -> list[str]:
    out = []
    for name, arguments in _interface(protocol).items():
        method = getattr(home, name, None)
        if method is None or list(inspect.signature(method).parameters) != arguments:
            out.append(name)
    return out


def test_every_optimizer_home_implements_the_written_interface():
    """homes.OptimizerHome: what the engine, checkpoints and memory use of wherever P_os lives.
    Every home has all of it; those the engine steps have SteppedHome's too."""
    from minizero.beyond.disk import DiskShardOptimizer
    from minizero.fairscale.fsdp_engine import FlatParameters
    from minizero.homes import DeviceHome, HostHome, OptimizerHome, SteppedHome
    for home in (DeviceHome, HostHome, DiskShardOptimizer):
        assert not missing_from(home, SteppedHome), (home, missing_from(home, SteppedHome))
    assert not missing_from(FlatParameters, OptimizerHome)


def test_the_interface_rule_can_fail():
    from minizero.homes import SteppedHome

    class NoReload:
        def step(self, grads): ...              # another argument name, and reload() missing
    assert {"reload", "step"} <= set(missing_from(NoReload, SteppedHome))
