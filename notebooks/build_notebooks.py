"""Write the notebooks of this folder from the cells below, without outputs (diff-friendly).

    python notebooks/build_notebooks.py          # then open them: jupyter lab notebooks/

Edit the cells here, not in the .ipynb files, and rerun: the .ipynb files are generated and committed.
The experiments themselves live in minizero/lab/demo.py (launched ranks must import their worker function)
and the figures in notebooks/plots.py, so each notebook is prose, a few calls, a check and its plots.
"""

from __future__ import annotations

import copy
import os
import textwrap

import nbformat

HERE = os.path.dirname(os.path.abspath(__file__))
EXERCISES = {0: "ex01_ring_allreduce.py", 1: "ex02_ddp_bucket.py", 2: "ex03_zero1_partition.py",
             3: "ex04_zero2_reduce_scatter.py", 4: "ex05_zero3_hooks.py", 5: "ex06_offload_step.py",
             7: "ex07_checkpoint_unit.py", 8: "ex08_global_overflow.py"}


def md(text: str):
    return nbformat.v4.new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return nbformat.v4.new_code_cell(textwrap.dedent(text).strip())


def exercise(number: int, what: str):
    path = f"../exercises/{EXERCISES[number]}"
    return md(f"**Exercise.** [{path}]({path}): {what}")


SETUP = code("""
    import os
    from minizero.lab import demo
    import plots                                  # notebooks/plots.py: the figures

    SMALL = os.environ.get("MINIZERO_SMALL") == "1"     # CI: the tiny model, 2 steps
    MODEL, STEPS = ("tiny", 2) if SMALL else ("default", 10)
    DTYPE = "fp32"        # or "bf16": the paper's 2 + 2 + 12 bytes per parameter (looser reference check)
    BACKEND, WORLD_SIZES = demo.backend_and_world_sizes()   # gloo on CPU; NCCL with 2 or more GPUs
    if SMALL:
        WORLD_SIZES = (WORLD_SIZES[0], WORLD_SIZES[-1])     # one launch fewer
    print(f"backend {BACKEND}, world sizes {WORLD_SIZES}, model {MODEL!r}, {STEPS} steps, {DTYPE}")
""")


def measure_and_check(stage: int, title: str) -> list:
    """The cells every stage notebook shares: train at every N, check, plot loss and memory, export."""
    return [
        md("""
        ## Run it

        One `minizero.launch` per world size runs `minizero.lab.train.train_worker` on every rank (the worker
        lives in `minizero/lab/demo.py`, because launched processes cannot import a notebook cell). Every run
        is compared with `minizero.lab.reference.reference_train`: one process, the whole global batch, plain
        `torch.optim`. Data parallelism must not change the result, only where the bytes live.
        """),
        code(f"""
        runs = demo.measure_stage({stage}, WORLD_SIZES, DTYPE, steps=STEPS, model=MODEL, backend=BACKEND)
        for n, rec in runs.items():
            print(f"N = {{n}}: max |param - reference| = {{rec['max_abs_diff']:.2e}} (tolerance {{rec['tolerance']:g}}), "
                  f"loss {{rec['losses'][0]:.3f}} -> {{rec['losses'][-1]:.3f}}")
        """),
        md("""
        ## Measured memory next to the formula

        `engine.memory()` counts the bytes of every tensor rank 0 holds, by category, at the end of the last
        backward (optimizer state exists, gradients are complete). The black ticks are
        `minizero.run.theory`, i.e. `minizero.memory.estimate_breakdown` with this run's bytes per element
        and K. The check below is the same comparison the plot shows: measured = formula, up to the padding
        of each bucket to a multiple of N elements.
        """),
        code("""
        table = demo.memory_table(runs)          # what the plot draws, as rows
        for row in table:
            if row["formula"] or row["measured"]:
                print(f"N = {row['world_size']}  {row['category']:>9}: measured {row['measured'] / 1e3:8.1f} kB, "
                      f"formula {row['formula'] / 1e3:8.1f} kB")
        demo.check(runs)                         # reference, memory and comm against the formulas
        print("all ranks match the reference and the formulas")
        """),
        code(f"""
        plots.memory_by_category(runs, "{title}");
        """),
        code(f"""
        demo.export("stage_{stage}", {{"runs": list(runs.values())}});   # for tests/test_notebooks.py
        """),
    ]


def step_through(name: str, config: str, choices: str, look: str, heading: str = "One step, rank by rank") -> list:
    """The "one step, rank by rank" cells: one launch of minizero.lab.stepthrough at StepConfig(config),
    every phase printed (the static view, checked), then the widget over phases driven by `choices`."""
    return [
        md(f"""
        ## {heading}

        A model small enough to read every number: `Linear(2, 3)`, tanh, `Linear(3, 2)`, Ψ = 17 parameters (none
        of N = 2, 3, 4 divides 17, so the flat buffer is padded), SGD with momentum 0.9 and lr 0.1 (the first
        step is $p - 0.1\\,g$), 12 rows split over the ranks. `minizero.lab.stepthrough.record` wraps it with
        `minizero.wrap`, trains one step on N processes and records what every rank holds after each phase, read
        from the engine's own buffers. Each buffer is a grid: a row per rank, a column per element of the padded
        flat buffer (the parameter each element belongs to is named on top). Dashed lines: partition boundaries
        (partition r is rank r's); solid: bucket boundaries; grey: padding; blank: the rank does not hold that
        element; bold and framed: changed in this phase. (The recorder lets one bucket communicate at a time, so
        each collective is its own phase; minizero overlaps two.)

        {textwrap.dedent(look).strip()}
        """),
        code(f"""
        from minizero.lab import stepthrough

        steps = stepthrough.record(stepthrough.StepConfig({config}))      # one launch
        stepthrough.check(steps)       # every phase against one process stepping all 12 rows
        print(plots.step_table(steps))           # every phase: each buffer that changed, on every rank
        demo.export("{name}", {{"steps": steps}});   # tests/test_notebooks.py checks it again
        """),
        md("""
        Press play or drag the slider through the phases. A menu records the step again with another setting
        (one launch, about a second; each setting is kept once computed).
        """),
        code(f"""
        plots.step_widget(steps, {choices})
        """),
    ]


def what_to_try(text: str):
    return md("## What to try\n\n" + textwrap.dedent(text).strip())


def stage_notebook(stage: int, title: str, intro: str, number: int, exercise_text: str, extra=(), *,
                   steps: list, try_text: str) -> list:
    return [md(f"# {title}\n\n" + textwrap.dedent(intro).strip()), exercise(number, exercise_text), SETUP,
            *steps, *measure_and_check(stage, f"stage {stage}" if stage else "DDP"), *extra,
            what_to_try(try_text)]


NOTEBOOKS = {}

NOTEBOOKS["00_communication"] = [
    md("""
    # 00 · Communication: the four collectives and the ring

    Every ZeRO stage is built from four collectives, all in `minizero/comm.py`:

    | collective | before (rank r holds) | after (every rank holds) | bytes one rank sends in a ring |
    |---|---|---|---|
    | all-reduce | a tensor $x_r$ of S bytes | $\\sum_r x_r$ | $2\\frac{N-1}{N}S$ |
    | reduce-scatter | $x_r$ of S bytes | rank r: the sum of chunk r only (S/N) | $\\frac{N-1}{N}S$ |
    | all-gather | a chunk of S/N bytes | all N chunks (S) | $\\frac{N-1}{N}S$ |
    | broadcast | rank `src`: a tensor | the same tensor | $\\frac{N-1}{N}S$ (pipelined) |

    An all-reduce *is* a reduce-scatter followed by an all-gather, which is why it costs twice as much.
    These are the numbers behind the ZeRO paper's claim that stages 1 and 2 cost no more communication
    than DDP (2Ψ) and stage 3 costs 1.5× (3Ψ).
    """),
    exercise(0, "build the ring all-reduce from send/recv yourself."),
    SETUP,
    code("""
    NUMEL = 10_000 if SMALL else 1_000_000          # fp32 elements: 4 MB by default
    results = demo.measure_collectives((2, 4) if SMALL else (2, 3, 4), numel=NUMEL, backend=BACKEND)
    """),
    md("""
    ## What each collective does

    On 4 ranks, rank r starts with `10 r + [0, 1, 2, 3]`. Sums use `op="sum"`; reduce-scatter hands
    rank r the sum of element r; all-gather collects element 0 of every rank; broadcast copies rank 0's.
    """),
    code("""
    shown = results[max(results)]["shown_all"]
    for kind in ("input", "all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        print(f"{kind:>15}: " + " | ".join(f"rank {r}: {s[kind]}" for r, s in enumerate(shown)))
    """),
    md("""
    ## The ring all-reduce, from point-to-point messages

    `minizero.comm.ring_all_reduce` cuts the tensor into N chunks and passes chunks around a ring. In
    N-1 steps of reduce-scatter every rank adds the chunk its left neighbour sends into its own copy;
    after them rank r owns the complete sum of one chunk. N-1 steps of all-gather then pass the finished
    chunks around. Each rank sends 2(N-1) chunks of S/N bytes: $2\\frac{N-1}{N}S$, almost independent of
    N. It must give exactly what the library's all-reduce gives:
    """),
    code("""
    for n, res in results.items():
        print(f"N = {n}: max |ring_all_reduce - all_reduce| = {res['ring_max_abs_diff']:.2e}")
        assert res["ring_max_abs_diff"] < 1e-4
    """),
    md("""
    ### The ring, exchange by exchange

    `minizero.lab.stepthrough.ring` runs `minizero.comm.ring_all_reduce` on N processes and watches its
    point-to-point exchanges: before each one, every rank's padded buffer and the chunk it sends to its
    right neighbour. Rank r starts with 10 r + [1, 2, 3, 4, 5]: 5 elements in N chunks of ⌈5/N⌉, padded.
    In the first N-1 exchanges the received chunk is *added*; after them rank r holds the complete sum of
    chunk r+1. In the last N-1 it *replaces* the local chunk, and the finished sums travel once around the
    ring.
    """),
    code("""
    from minizero.lab import stepthrough

    ring = stepthrough.ring(3)                     # one launch, 3 ranks
    stepthrough.check_ring(ring)                   # each exchange adds (or copies) exactly the sent chunk
    print(plots.ring_table(ring))
    demo.export("ring_0", {"ring": ring});
    """),
    md("""
    Green: the chunk the last exchange wrote; orange frame: the chunk each rank sends next. Press play or drag
    the slider over the 2(N-1) exchanges; the menu runs the ring on another N.
    """),
    code("""
    plots.ring_widget(ring)
    """),
    md("""
    ## Bytes moved, measured vs formula

    `comm.tally()` counts, per rank and per kind of collective, the bytes a bandwidth-optimal ring sends.
    For the four library collectives that is the formula applied to each call's tensor; for
    `ring_all_reduce` it is what the teaching ring really handed to `send` (chunks of ⌈S/N⌉ elements).
    """),
    code("""
    FORMULA = {"all_reduce": 2, "reduce_scatter": 1, "all_gather": 1, "broadcast": 1, "ring_all_reduce": 2}
    for n, res in results.items():
        for kind, factor in FORMULA.items():
            formula = factor * (n - 1) / n * res["full_bytes"]
            sent = res["sent"][kind]
            print(f"N = {n} {kind:>15}: sent {sent / 1e6:6.3f} MB, formula {formula / 1e6:6.3f} MB, "
                  f"{res['seconds'][kind] * 1e3:6.1f} ms")
            assert formula - 1e-6 <= sent <= formula + 2 * n * 4 * (n - 1)   # ring pads to N chunks
    plots.collective_bytes(results);
    """),
    code("""
    demo.export("00_communication", {"collectives": list(results.values())});
    """),
    md("""
    The time column is a rough guide only: gloo on a laptop's cores is not a network. What carries over
    to real clusters is the byte count: per-rank traffic of a ring collective barely depends on N. One
    more reason: gloo's own reduce-scatter is slower than its all-reduce, and its all-gather slower than N
    broadcasts, so on gloo `minizero.comm` runs them that way (`[Note: collectives on gloo]` in
    `minizero/comm.py`; `python -m minizero.bench --collectives` times both). The tally still counts the
    ring's bytes: what the algorithm needs, and what NCCL sends.
    """),
    what_to_try("""
    In the ring widget, switch N and count the exchanges: 2(N-1), each moving one chunk of ⌈S/N⌉ elements,
    so a rank sends 2(N-1)/N·S whatever N. Find the exchange after which rank r first holds a complete sum
    (the end of the reduce-scatter half) and check it is chunk r+1. In the byte table, set `NUMEL` to a
    number no N divides and see the ring's padding in the sent bytes. Then do exercise 1: build the ring
    from send and recv yourself.
    """),
]

NOTEBOOKS["01_ddp"] = stage_notebook(0, "01 · DDP: the baseline ZeRO starts from", """
    Distributed data parallel (`minizero/ddp.py`): every rank keeps the **whole** model, its gradients
    and its optimizer state, and processes 1/N of the global batch. After backward the gradients are
    averaged with an all-reduce, in buckets that start while backward is still running, so every replica
    takes the same step.

    Per rank, with Ψ parameters, $b_p$ / $b_g$ bytes per parameter and gradient and K bytes of optimizer
    state per parameter (the paper: bf16 and Adam, $2 + 2 + 12$):

    $$M_{DDP} = (b_p + b_g + K)\\,\\Psi = 16\\Psi \\quad\\text{for every } N$$

    Communication per step: one all-reduce of the gradients, $2\\Psi\\frac{N-1}{N}$ elements.
    (Here in fp32: $b_p = b_g = 4$, and Adam's K = 8 with no separate master copy; also 16Ψ.)
    """, 1, "gradient buckets that all-reduce during backward.", steps=step_through("steps_0", "stage=0", "stage=[0, 1, 2, 3], world_size=[2, 3, 4]", """
    What to look for: when a bucket's gradients are complete every rank holds its *own* gradients (its own
    rows); the bucket's all-reduce replaces them with the average, on every rank, while backward goes on with
    the next bucket. The step then does the same update on every rank, and every rank keeps the whole
    momentum (the optimizer state, K bytes per parameter): N identical copies of everything, the
    redundancy ZeRO removes. Pick stage 1, 2 or 3 in the menu to see what each removes.
    """), try_text="""
    In the step-through, switch N between 2, 3 and 4: the averaged gradient is the same every time (it is the
    gradient of the same 12 rows), only each rank's own gradients change. Switch to stage 1 and compare the
    momentum row. Above, set `DTYPE = "bf16"` in the setup cell and run all: the parameter and gradient bars
    halve, the optimizer bar grows (fp32 master weights join Adam's moments), and the reference check loosens
    to bf16's tolerance. Then do exercise 2: build the bucket hook yourself.
    """, extra=[
    md("""
    ## Same training as one process

    The mean loss over ranks at each step, for every N, on top of the single-process reference:
    """),
    code("""
    plots.loss_curves(runs, "DDP: losses at every N equal the reference");
    """),
    md("""
    Nothing in the memory plot shrinks with N: that redundancy, N copies of 16Ψ bytes, is what ZeRO
    removes, one category at a time, in the next three notebooks.
    """)])

NOTEBOOKS["02_zero1"] = stage_notebook(1, "02 · ZeRO stage 1 (P_os): shard the optimizer state", """
    The optimizer state (K = 12 of the 16 bytes per parameter for bf16 + Adam) is only ever used
    elementwise, so rank r can keep it for its own 1/N partition of the parameters (`minizero/zero1.py`):

    $$M_{P_{os}} = (b_p + b_g)\\,\\Psi + \\frac{K\\Psi}{N} \\qquad (4\\Psi + 12\\Psi/N\\text{ in the paper})$$

    All parameters are laid end to end in one flat buffer, padded to a multiple of N and cut into N
    partitions (`minizero/flat.py`). After backward a **reduce-scatter** gives rank r the averaged gradient
    of its partition (half an all-reduce: Ψ); it steps that partition; an **all-gather** (Ψ) shares the
    updated parameters. Total 2Ψ per step: the same as DDP.
    """, 2, "partition a flat buffer and step only your partition.", steps=step_through("steps_1", "stage=1", "stage=[0, 1, 2, 3], world_size=[2, 3, 4]", """
    What to look for: after backward every rank holds its own full gradients. The reduce-scatter averages
    partition r into rank r only: the rest of its gradient buffer was the collective's workspace (blank:
    nobody reads it again; on gloo minizero runs the reduce-scatter as an all-reduce, which is faster there,
    see `[Note: collectives on gloo]` in `minizero/comm.py`). The step updates partition r on rank r only, and only there does momentum exist (KΨ/N):
    for one phase the ranks hold *different* parameters, until the all-gather hands every rank every
    updated partition. 17 elements padded to a multiple of N: the last partition carries the padding.
    """), try_text="""
    In the step-through, try N = 2, 3 and 4 and watch where the partition boundaries cut the parameters: a
    weight can straddle two ranks (as in DeepSpeed), and the padding moves with N. Check one stepped element
    by hand: new = old - 0.1 × averaged gradient (the momentum buffer is the gradient at the first step).
    Above, the optimizer bar falls as KΨ/N (K = 8 here: fp32 Adam's two moments, no separate master copy)
    while parameters and gradients stay. Then do exercise 3: partition the flat buffer and step only yours.
    """)

NOTEBOOKS["03_zero2"] = stage_notebook(2, "03 · ZeRO stage 2 (P_os+g): shard the gradients too", """
    A rank only ever uses the gradient of its own partition, so it need not keep the rest
    (`minizero/zero2.py`): as soon as a bucket of gradients is complete during backward it is
    reduce-scattered, rank r keeps its partition in a gradient shard of Ψ/N elements, and the full
    gradients are freed.

    $$M_{P_{os+g}} = b_p\\,\\Psi + \\frac{(b_g + K)\\,\\Psi}{N} \\qquad (2\\Psi + 14\\Psi/N\\text{ in the paper})$$

    Communication is unchanged: reduce-scatter Ψ + all-gather Ψ = 2Ψ per step, now overlapped with
    backward. (The measured *peak* during backward adds the buckets in flight; the plot shows what
    persists.)
    """, 3, "reduce-scatter a gradient bucket into a shard during backward.", steps=step_through("steps_2", "stage=2", "stage=[0, 1, 2, 3], world_size=[2, 3, 4]", """
    What to look for: gradients now live in two places. *Gradients in flight* is a bucket's full gradients,
    from the moment they are complete until its reduce-scatter arrives; the *gradient shard* (Ψ/N) is the
    only gradient memory that persists. Bucket 0 (the last layer, whose gradients backward produces first) is
    reduce-scattered into the shard while bucket 1 is still being computed; after backward the in-flight row
    is empty and each rank holds only the averaged gradients of its own partitions.
    """), try_text="""
    In the step-through, switch between stage 1 and stage 2 at the same N and compare the gradient rows at the
    end of backward: a full buffer per rank against a shard. Try N = 4: each bucket is padded to a multiple of
    4 on its own, so padding appears in both buckets. Above, the gradient bar should be Ψ/N of the DDP one.
    Then do exercise 4: reduce-scatter a bucket into the shard from the backward hook.
    """)

NOTEBOOKS["04_zero3"] = stage_notebook(3, "04 · ZeRO stage 3 (P_os+g+p): shard the parameters", """
    Stage 3 (`minizero/zero3.py`) also keeps only 1/N of the parameters. The model is cut into *units*
    (here: each transformer block, plus the root with the embeddings). A unit's full parameters exist only
    while it computes: a forward pre-hook all-gathers them, a post-hook frees them; in backward a hook on
    the unit's output gathers them again, and when the unit's gradients are complete they are
    reduce-scattered and the parameters freed.

    $$M_{P_{os+g+p}} = \\frac{(b_p + b_g + K)\\,\\Psi}{N} \\qquad (16\\Psi/N\\text{ in the paper})$$

    plus the few units gathered at a time. Communication: all-gather Ψ (forward) + all-gather Ψ
    (backward) + reduce-scatter Ψ = **3Ψ**, 1.5× DDP, the price of not replicating parameters.
    """, 4, "the pre-forward / post-forward hooks that gather and free a unit.", steps=step_through("steps_3", "stage=3", "stage=[0, 1, 2, 3], world_size=[2, 3, 4]", """
    What to look for: between uses a rank holds only its *parameter shard*; the parameters row is empty except
    while a unit (here each Linear) is gathered. Each unit is all-gathered for its forward and freed, gathered
    again for its backward, its gradients reduce-scattered into the gradient shard, and freed. The step updates
    the shard in place and nothing is gathered after it: the next forward gathers what it needs. (Prefetch is
    off here, so each gather is its own phase; with prefetch the next unit's all-gather would already be in
    flight.)
    """), try_text="""
    In the step-through, count the collectives per unit at stage 3 (two all-gathers, one reduce-scatter: the
    3Ψ) against stage 2 (one reduce-scatter per bucket and one all-gather after the step: 2Ψ). In the unit
    timeline, run with `MODEL = "default"` and compare the peak parameters with prefetch on and off. In the
    LoRA section, change the world sizes and watch the frozen parameters shrink as 1/N. Then do exercise 5:
    the hooks that gather and free a unit.
    """, extra=[
    md("""
    ## When is each unit gathered?

    A Zero3 engine records `(time, "gather" | "prefetch" | "free", unit)` in `engine.timeline` when that
    is set to a list (`minizero.lab.demo.zero3_timeline_worker` does so for one step after a warm-up step,
    which records the order prefetch follows). Each bar is a span during which a unit's full parameters
    exist on rank 0. Without prefetch a unit is gathered when it is needed and the computation waits;
    with prefetch the next unit's all-gather is already in flight while the current one computes
    (hatched bars), at the cost of one more unit in memory.
    """),
    code("""
    timelines = demo.zero3_timelines(max(WORLD_SIZES), model=MODEL, backend=BACKEND)   # one launch
    intervals = {p: demo.unit_intervals(rec) for p, rec in timelines.items()}
    for p, ivs in intervals.items():
        names = timelines[p]["unit_names"]
        for b, name in enumerate(names):   # every unit: gathered once for forward, once for backward
            assert [iv["phase"] for iv in ivs if iv["unit"] == b] == ["forward", "backward"], name
        print(f"prefetch {'on ' if p else 'off'}: {len(ivs)} gather->free spans over {len(names)} units, "
              f"peak parameters {timelines[p]['peak_params'] / 1e3:.1f} kB")
    plots.unit_timeline(timelines, intervals);
    """),
    code("""
    demo.export("timeline_3", {"intervals": {str(p): ivs for p, ivs in intervals.items()},
                               "unit_names": timelines[True]["unit_names"]});
    """),
    md("""
    The root unit (embeddings, final LayerNorm, the head tied to the embedding) stays gathered for the
    whole forward and again for the whole backward: it runs first and last. The blocks take turns.
    """),
    md("""
    ## Fine-tuning: the frozen weights are sharded too

    In fine-tuning most parameters are frozen (Ψ_f: LoRA trains small adapters on a frozen base). They
    have no gradient and no optimizer state, but they are parameters: stage 3 partitions them with their
    unit (a second buffer, gathered and freed with it, never reduced), so per rank

    $$M_{params} = \\frac{(\\Psi + \\Psi_f)\\,b_p}{N}, \\qquad M_{grads} = \\frac{b_g\\,\\Psi}{N}, \\qquad M_{optim} = \\frac{K\\,\\Psi}{N}$$

    (`minizero.memory.estimate(..., frozen=Ψ_f)`). Stages 0-2 replicate them, as the paper and DeepSpeed do.

    Building the model is the other place a whole copy appears: a model constructed the usual way exists in
    full on every rank before `wrap` shards it. Under `with minizero.sharded_init():` each module's
    parameters are partitioned as soon as the module is built (`minizero/construct.py`), so a rank holds
    its chunks plus the module being built, never the whole model. Below: a Hugging Face GPT-2 with LoRA
    (peft), built both ways, trained one step at stage 3 with its decoder layers as units.
    """),
    code("""
    lora = demo.lora_memory(WORLD_SIZES, backend=BACKEND)         # one launch per N
    for r in lora:
        print(f"N = {r['world_size']}: Ψ = {r['trainable']:,} trained, Ψ_f = {r['frozen']:,} frozen; "
              f"params {r['params']:,} B per rank (formula {r['formula']:,.0f}); building held "
              f"{r['construction_peak']['normal']:,} B normally, {r['construction_peak']['sharded_init']:,} B sharded")
    plots.lora_memory(lora);
    demo.export("lora_3", {"lora": lora});
    """)])

NOTEBOOKS["05_offload"] = [
    md("""
    # 05 · Offload: the optimizer on the host

    ZeRO-Offload moves what is only touched once per step, the optimizer, into host (CPU) memory
    (`minizero/offload.py`). Per step rank r copies its averaged gradient partition to the host (Ψ/N),
    the CPU steps the fp32 master weights with Adam, and the updated partition is copied back (Ψ/N).
    With stage 2, per rank:

    $$M_{device} = b_p\\,\\Psi + \\frac{b_g\\,\\Psi}{N}, \\qquad
      M_{host} = \\frac{(K + 4)\\,\\Psi}{N}$$

    where K counts the fp32 master weights and Adam's two moments (12) and 4 is the fp32 gradient
    partition the host steps on. With stage 3, `offload="params"` keeps the parameter shard on the host
    too, and each gather first copies the unit's partition to the device:
    $M_{device} = b_g\\Psi/N$ (plus units in flight).

    On this CPU-only machine "device" and "host" are the same RAM, but the code path is the same as on a
    GPU (separate host buffers, explicit copies), so the accounting is exactly what a GPU would see.
    """),
    exercise(5, "the host-side optimizer step: copy down, step, copy up."),
    SETUP,
    *step_through("steps_5", "stage=2, offload=True", "stage=[1, 2, 3], world_size=[2, 3, 4], offload=[True, False]", """
    What to look for: with the optimizer offloaded, the master weights, the momentum and an fp32 copy of the
    gradient partition live in host memory (the rows marked host). At the step, rank r copies its averaged
    gradient partition down (*gradients (host)*), the CPU steps the host master weights, and the updated
    partition is copied up into the device parameters, which the all-gather then shares. The device keeps
    parameters and the gradient shard only.
    """),
    code("""
    from minizero.lab.train import TrainConfig
    base = dict(dtype=DTYPE, steps=STEPS, model=MODEL, batch_size=24)
    variants = {"stage 2": TrainConfig(stage=2, **base),
                "stage 2 + offload": TrainConfig(stage=2, offload="optimizer", **base),
                "stage 3 + offload params": TrainConfig(stage=3, offload="params", **base)}
    measured = demo.measure(variants, WORLD_SIZES, BACKEND)        # one launch per N, all three variants
    for name, runs in measured.items():
        demo.check(runs)                     # reference, memory (device and host) and comm vs formulas
        worst = max(rec["max_abs_diff"] for rec in runs.values())
        print(f"{name:>25}: max |param - reference| over all N = {worst:.2e}")
    """),
    md("""
    ## Device vs host bytes

    Left, what stays on the compute device; right, what moved to the host. The black ticks are
    `minizero.memory.estimate_breakdown`. Offload trades device memory for host memory and two
    copies of Ψ/N per step.
    """),
    code("""
    plots.device_vs_host(measured, "Offload: device vs host model-state bytes per rank (rank 0)");
    """),
    code("""
    plots.memory_by_category(measured["stage 2 + offload"], "stage 2 + offload");
    """),
    code("""
    demo.export("offload_5", {"runs": [rec for runs in measured.values() for rec in runs.values()]});
    """),
    md("""
    ## fp16: dynamic loss scaling, and why the overflow check is global

    The paper's 2 + 2 + K bytes are fp16 mixed precision (`dtype="fp16"`, `minizero/loss_scale.py`).
    fp16 flushes magnitudes below ~6e-8 to zero, where many gradients live, so backward runs on the loss
    times a scale S (every gradient S times larger, by the chain rule) and the step divides by S again, in
    fp32, before clipping and the optimizer. S is *dynamic* (DeepSpeed's defaults: $2^{16}$, window 1000,
    hysteresis 2): a step whose gradients hold an inf or a nan is **skipped** (no optimizer step, its state
    untouched) and S backs off; `hysteresis` - 1 overflows are tolerated at the same S first, a credit that
    only a growth restores; after `loss_scale_window` good steps in a row S doubles.

    With ZeRO the check is where sharding bites: after the reduce-scatter each rank holds only its
    partition of the gradients, so an inf lands on **one** rank. Decided locally, that rank would skip the
    step and the others take it, and their parameters and scales part ways for good. So each rank's 0/1
    flag goes through one all-reduce (max) and every rank takes the same decision.

    Below: stage 2, an inf injected into one element of one rank's partition at steps 3, 4, 5 and 12
    (alternating ranks; the experiment's fault, `minizero.lab.demo.loss_scale_worker`). Window 4,
    hysteresis 2: step 3 uses up the credit, steps 4 and 5 halve S, it doubles again after 4 good steps
    (step 11), which restores the credit, so step 12 is skipped at the same S.
    """),
    exercise(8, "the global overflow check: one collective over the ranks' local flags."),
    code("""
    FAULTS = {3: 1, 4: 0, 5: 1, 12: 1}               # step: the rank whose gradient partition gets an inf
    SCALING = {"initial_scale_power": 10, "loss_scale_window": 4, "hysteresis": 2}
    fp16 = demo.loss_scale_run(max(WORLD_SIZES), FAULTS, SCALING, steps=16, stage=2, backend=BACKEND)
    for res in fp16["ranks"]:
        print(f"rank {res['rank']}: skipped {[t['step'] for t in res['trace'] if t['skipped']]}, "
              f"own partition overflowed at {[t['step'] for t in res['trace'] if t['local_overflow']]}")
    decisions = {r["rank"]: [(t["scale"], t["skipped"]) for t in r["trace"]] for r in fp16["ranks"]}
    assert all(d == decisions[0] for d in decisions.values()), "the ranks took different decisions"
    plots.loss_scale_trajectory(fp16);
    """),
    code("""
    demo.export("loss_scale_5", {"loss_scale": fp16});
    """),
    what_to_try("""
    In the step-through, turn offload off and on at the same stage: the host rows appear and the device
    keeps no optimizer state; at stage 3 the parameter shard stays on the device here (`offload="params"`
    would move it too). In the fp16 section, change `FAULTS` so two ranks overflow in the same step, or
    `SCALING["hysteresis"]` to 1, and predict the trajectory before you run it. Then do exercises 6 (the host
    step) and 8 (the global overflow check).
    """),
]

NOTEBOOKS["06_compare"] = [
    md("""
    # 06 · All stages side by side

    The same small GPT under DDP and ZeRO stages 1-3, measured at every world size (one launch per N runs
    all four stages), next to the paper's formulas; then the estimator for models of any size.

    | | device bytes per rank | communication per step |
    |---|---|---|
    | DDP | $(b_p + b_g + K)\\Psi$ | $2\\Psi$ |
    | stage 1 | $(b_p + b_g)\\Psi + K\\Psi/N$ | $2\\Psi$ |
    | stage 2 | $b_p\\Psi + (b_g + K)\\Psi/N$ | $2\\Psi$ |
    | stage 3 | $(b_p + b_g + K)\\Psi/N$ | $3\\Psi$ |
    """),
    SETUP,
    code("""
    from minizero.lab.train import TrainConfig
    variants = {s: TrainConfig(stage=s, dtype=DTYPE, steps=STEPS, model=MODEL, batch_size=24) for s in range(4)}
    stages = demo.measure(variants, WORLD_SIZES, BACKEND)       # {stage: {N: record}}
    for s, runs in stages.items():
        demo.check(runs)
    print("every stage at every N matches the reference and the formulas")
    """),
    md("""
    ## Measured: memory, communication, time

    Left: device model-state bytes per rank (dots: measured on rank 0; lines: formula). Middle: bytes one
    rank sent in the last step (tally) against $2\\Psi$ / $3\\Psi$ × (N-1)/N. Right: median step time,
    which on CPU processes sharing two cores says more about the machine than about the method.
    """),
    code("""
    plots.compare_measured(stages);
    """),
    code("""
    demo.export("compare_6", {"runs": [rec for runs in stages.values() for rec in runs.values()]});
    """),
    md("""
    ## Against PyTorch and DeepSpeed

    `minizero.bench` trains the same GPT with minizero and with each stage's peer in one process group:
    PyTorch's DDP, `ZeroRedundancyOptimizer` and FSDP2 (one `fully_shard` per block, as minizero's units),
    and DeepSpeed's stages 0-3 and optimizer offload when it is installed (`pip install -e ".[peers]"`).
    Runs alternate (minizero, peers, then the reverse), a step counts at its slowest rank, and the ratio
    compares medians: below 1, minizero is faster. Every pair must end at the same parameters. Here two
    small sizes; `python -m minizero.bench --sizes 1M,8M,50M` measures the sizes where real models live.
    """),
    code("""
    from minizero.lab import bench
    from minizero.lab.figures import bench_ratios
    BENCH_SIZES = ("tiny",) if SMALL else ("default", "1M")
    PEERS = ("torch",) if SMALL else bench.PEER_FAMILIES     # CI: PyTorch's only (DeepSpeed: tests/test_bench.py)
    report = bench.compare((2,), sizes=BENCH_SIZES, steps=STEPS if SMALL else 6, repeats=1 if SMALL else 2,
                           peers=PEERS, meter=False)
    print(bench.format_table(report))
    assert all(p["max_param_diff"] < 1e-5 for p in report["pairs"]), "a peer ended elsewhere"
    bench_ratios(report);
    """),
    md("""
    ## Move a run to fewer ranks

    A checkpoint holds each rank's partition of the masters and of Adam's moments. The flat layout is
    deterministic, so `engine.load` cuts them again for another N (or another stage): the run continues as
    if nothing happened. Restarting from the weights alone (`python -m minizero.consolidate`, a fresh
    optimizer) is what a checkpoint without resharding offers: Adam's moments start from zero, and the
    loss jumps.
    """),
    code("""
    import tempfile
    from minizero.lab.reference import tolerance
    FROM, TO = WORLD_SIZES[-1], max(WORLD_SIZES[-1] // 2, 1)
    moved = demo.move_run(FROM, TO, STEPS, tempfile.mkdtemp(), MODEL, BACKEND)
    assert moved["resumed_diff"] <= tolerance("fp32") < moved["fresh_diff"], moved
    print(f"N = {FROM} -> {TO} after {moved['half']} steps: max |param - uninterrupted| "
          f"{moved['resumed_diff']:.1e} resharded, {moved['fresh_diff']:.1e} with a fresh optimizer")
    plots.moved_run(moved);
    """),
    md("""
    ## What fits: the estimator

    Since every formula is linear in Ψ, the largest model whose model states fit a per-rank budget is
    budget / (bytes per parameter). With 80 GB per GPU (activations not counted): DDP stops at 5 B
    parameters whatever N, stage 3 grows linearly with N.
    """),
    code("""
    from minizero.memory import estimate
    BUDGET = 80e9
    for n in (1, 8, 64, 1024):
        fits = {s: BUDGET / estimate(1, n, s) for s in range(4)}        # bf16 + Adam: 2 + 2 + 12
        print(f"N = {n:>4}: " + ", ".join(f"{plots.STAGE_NAMES[s]} {psi / 1e9:7.1f} B" for s, psi in fits.items()))
    plots.largest_model(BUDGET, "bf16");
    """),
    md("""
    ## Try it

    Pick a model size, a world size and a dtype: the bars are `minizero.memory.estimate_breakdown` per
    stage (the paper's example: 7.5 B parameters on N = 64 needs 120 GB per GPU under DDP, 1.9 GB under
    stage 3), the right panel `minizero.memory.comm_volume`.
    """),
    code("""
    from ipywidgets import Dropdown, FloatLogSlider, SelectionSlider, interact
    interact(plots.estimator_view,
             world_size=SelectionSlider(options=[2 ** i for i in range(11)], value=64, description="N"),
             params_billion=FloatLogSlider(value=7.5, base=10, min=-1, max=3, step=0.05, description="Ψ (B)"),
             dtype=Dropdown(options=["bf16", "fp32"], value="bf16", description="dtype"),
             budget_gb=Dropdown(options=[16, 24, 40, 80], value=80, description="budget GB"));
    """),
    md("""
    ## Coming from DeepSpeed, FairScale or FSDP?

    Each term of their documentation next to the minizero code that implements the same idea (the line
    numbers are read from the code as it is now; the same table is `docs/concepts.md`).
    """),
    code("""
    from IPython.display import Markdown
    from minizero.lab.concepts import to_markdown
    Markdown(to_markdown(link_prefix="../").split("\\n", 5)[5])   # the table, without the page's header
    """),
    what_to_try("""
    In the estimator, find the smallest N at which a 7.5 B model fits 16 GB per GPU under each stage, and
    how much bf16 saves over fp32. Move the run above to another N (`FROM`, `TO`) or to stage 3 and check
    the resumed run still matches the uninterrupted one. Run the notebook with `MINIZERO_SMALL` unset to
    measure the default model: the memory lines should still sit on the formulas.
    """),
]

NOTEBOOKS["07_activations"] = [
    md("""
    # 07 · ZeRO-R: activations, checkpointing, and the whole memory of a step

    ZeRO-DP shards the model states; the other half of the paper (section 6, ZeRO-R) is what is left:
    *activations* (what a forward keeps for its backward), temporary buffers and fragmentation. For GPT-2
    1.5B at sequence 1K and batch 32 the paper counts ~60 GB of activations (its rough $12 \\cdot h \\cdot b
    \\cdot s$ per layer), ~8 GB with activation checkpointing, for ~33 % more compute.

    minizero measures them: `engine.memory()["activations"]` is the peak of the bytes saved for backward
    during the last step (autograd's saved-tensor hooks, each storage once, parameters left out;
    `minizero/activations.py`). `minizero.memory.activation_bytes` predicts them for minizero's GPT, term by
    term: per block $e \\cdot s \\cdot b \\cdot ((8 + 2r)h + a \\cdot s + 4) + s^2$. `wrap(...,
    activation_checkpointing=True)` keeps only each block's input ($e \\cdot s \\cdot b \\cdot h$) and
    recomputes the block in backward; `"cpu"` keeps those inputs in host memory (the paper's P_a+cpu; P_a
    itself partitions what *model* parallelism replicates, which pure data parallelism does not have).
    """),
    exercise(7, "checkpoint a unit: an autograd Function that keeps only the inputs and recomputes in backward."),
    SETUP,
    *step_through("steps_7", "stage=3, checkpointing=True",
                  "checkpointing=[True, False], stage=[0, 1, 2, 3], world_size=[2, 3, 4]", """
    What to look for here: the title of each phase gives the bytes each rank has saved for backward at that
    moment (`engine.activations.alive`). They rise through forward and fall to zero through backward; with
    checkpointing on, every unit keeps only its input and is recomputed in backward, at stage 3 after its
    parameters were gathered for it. Switch checkpointing off and compare the peak: for this tiny model
    checkpointing keeps *more*, because a Linear saves nothing but its input anyway. It pays off for units
    whose forward saves much more than their input, like the transformer blocks measured below.
    """),
    md("""
    ## Measured next to the estimate, across sequence length and micro-batch

    One process is enough: a rank's activations depend on its own micro-batch, not on N or the stage.
    """),
    code("""
    SEQS, BATCHES = ((8, 16), (2, 4)) if SMALL else ((8, 16, 32), (2, 4, 8))
    rows = demo.activation_sweep(MODEL, SEQS, BATCHES)
    for r in rows:
        assert abs(r["measured"] - r["estimate"]) <= 0.1 * r["estimate"], r
    print(f"{'checkpointing':>14} {'s':>3} {'b':>3} {'measured kB':>12} {'estimate kB':>12}")
    for r in rows:
        print(f"{str(r['checkpointing']):>14} {r['seq']:>3} {r['batch']:>3} {r['measured'] / 1e3:12.1f} "
              f"{r['estimate'] / 1e3:12.1f}")
    plots.activation_sweep(rows);
    """),
    md("""
    Without checkpointing the activations grow with $s \\cdot b$ and, through the attention scores, with
    $a \\cdot s^2 \\cdot b$; checkpointed, the blocks keep $s \\cdot b \\cdot h$ each, plus one block while
    backward recomputes it.

    ## Every stage, with and without checkpointing: model states + activations

    One launch per world size trains all eight runs; each is checked against the single-process reference
    and the model states against the paper's formulas, as in the other notebooks.
    """),
    code("""
    from minizero.lab.train import TrainConfig
    variants = {(s, ckpt): TrainConfig(stage=s, dtype=DTYPE, steps=STEPS, model=MODEL, batch_size=24,
                                       activation_checkpointing=ckpt)
                for s in range(4) for ckpt in (False, True)}
    measured = demo.measure(variants, WORLD_SIZES, BACKEND)      # {(stage, checkpointing): {N: record}}
    for runs in measured.values():
        demo.check(runs)
    N = WORLD_SIZES[-1]
    for (s, ckpt), runs in measured.items():
        m = runs[N]["ranks"][0]["memory"]
        states = m["params"] + m["grads"] + m["optimizer"]
        print(f"stage {s}, checkpointing {str(ckpt):5}: model states {states / 1e3:7.1f} kB, "
              f"activations {m['activations'] / 1e3:7.1f} kB, step {runs[N]['step_time_s'] * 1e3:6.1f} ms")
    plots.full_memory({key: runs[N] for key, runs in measured.items()});
    """),
    md("""
    The step times above are the recompute's cost: one more forward of every block per step (the paper's
    ~33 %; on CPU processes sharing two cores the measurement is noisy, and Python's overhead per block
    weighs more on a small model).

    ## One step, event by event

    `engine.memory_timeline = []` records the bytes by category at each event: the end of a block's
    forward, the start of its backward, a gradient bucket launched and arrived, the step. Activations rise
    block by block through forward and fall in reverse through backward; stage 3 gathers each block's
    parameters for its backward and frees them after.
    """),
    code("""
    timelines = demo.memory_timelines((0, 3), N, MODEL, BACKEND)
    plots.memory_timeline(timelines);
    """),
    md("""
    ## The rest of ZeRO-R in minizero's code

    - **Constant-size buffers (C_B).** A fused buffer of all gradients grows with the model (the paper: 12 GB
      for 3 B parameters in fp32); gradients are reduced in buckets of at most `bucket_size` bytes instead
      (`minizero.flat.split_into_buckets`, default `minizero.flat.DEFAULT_BUCKET_BYTES` = 25 MB, PyTorch DDP's
      `bucket_cap_mb`), and at most two are in flight (`minizero.reducer.GradBuckets`).
    - **Memory defragmentation (M_D).** Long-lived tensors live in preallocated contiguous buffers
      (`minizero/flat.py`: parameters and gradients as views of one flat buffer per bucket; stage 3's
      `Unit.full`); short-lived gradients are copied into their bucket's buffer the moment they are complete
      (`minizero.zero2.Zero2.contiguous_gradients`), so they never interleave with activations.
    """),
    code("""
    demo.export("activations_7", {"runs": [rec for runs in measured.values() for rec in runs.values()],
                                  "activations": rows, "memory_timelines": timelines});
    """),
    what_to_try("""
    In the step-through, turn checkpointing off and on at stage 0 and at stage 3 and compare the bytes saved
    for backward phase by phase. In the sweep, add a longer sequence to `SEQS` (64, say) and watch the
    attention term $a \\cdot s^2 \\cdot b$ take over without checkpointing. In the timeline, compare stage 0
    and stage 3 with checkpointing: the parameters rise and fall with each block's backward only at stage 3.
    Then do exercise 7: checkpoint a unit yourself.
    """),
]


# --------------------------------------------------------------------------------------------------------
# 08_beyond: the designs beyond the ZeRO paper, one function per section. Each returns its cells; the
# notebook is their concatenation, so adding a section (HSDP, hpZ, ZeRO++: notebooks/beyond_*.py) is one
# entry in BEYOND_SECTIONS.
# --------------------------------------------------------------------------------------------------------

def beyond_intro() -> list:
    return [
        md("""
        # 08 · Beyond the paper: a network model that makes overlap visible

        On one machine the ranks talk over loopback, so communication is almost free next to compute, and what
        the later ZeRO papers are about cannot be seen: whether DDP's bucketed all-reduce really hides behind
        backward, what stage 3's prefetch buys, what stage 3's 3Ψ costs next to 2Ψ. This notebook turns on
        minizero's **network model** and measures exactly that.
        """),
        code("""
        import os
        import network_plots                              # notebooks/network_plots.py: this notebook's figures
        from minizero.lab import demo, network_runs
        from minizero.lab.train import TrainConfig

        SMALL = os.environ.get("MINIZERO_SMALL") == "1"     # CI: the tiny model
        MODEL = "tiny" if SMALL else "default"
        BASE = TrainConfig(stage=0, world_size=2, steps=4, batch_size=8, model=MODEL, backend="gloo",
                           bucket_size=network_runs.BASE.bucket_size if not SMALL else 400)
        print(f"model {MODEL!r}, N = {BASE.world_size}, {BASE.steps} steps per run")
        """),
    ]


def beyond_network_model() -> list:
    return [
        md("""
        ## The model, and what it leaves out

        `minizero/network.py` describes a cluster: nodes of `ranks_per_node` consecutive ranks, a bandwidth β
        and a latency α per hop between nodes (and, optionally, inside a node: unlimited by default). Turn it on
        with `comm.set_network("1gbps,10us,ranks_per_node=2")`, `MINIZERO_NETWORK=...` or `python -m
        minizero.run --network ...`. Every collective then still runs for real over gloo (its values stay
        exact), but its handle's `wait()` returns no earlier than a ring on that network would have finished:

        $$t = \\text{hops} \\cdot \\alpha + \\frac{\\text{bytes one rank sends}}{\\beta}, \\qquad
        \\text{all-reduce over } n: 2(n-1) \\text{ hops}, \\; 2\\frac{n-1}{n} S \\text{ bytes}$$

        with the inter-node α, β as soon as the ring crosses a node boundary (the slowest link sets the pace of
        a ring). A rank's link is one resource: collectives queue on it one after another, so an asynchronous
        all-reduce issued from a backward hook runs *while autograd computes*, and a synchronous one blocks.

        **Left out**, so real clusters do worse: ranks of a node sharing its NICs (contention), protocol and
        message-size effects (NCCL's trees), the CPU time of the real gloo collective, clock skew between ranks.
        """),
        code("""
        from minizero import comm
        from minizero.network import parse_network
        net = parse_network("1gbps,10us,ranks_per_node=2")
        print(repr(net))                                      # bytes/s and seconds
        for n in (2, 4, 8, 64):
            sent = comm.ring_bytes("all_reduce", 100e6, n)          # a 100 MB gradient all-reduce
            print(f"N = {n:>2}: {sent / 1e6:6.1f} MB sent per rank, "
                  f"{net.time('all_reduce', sent, n, inter_node=True) * 1e3:7.1f} ms at 1 Gb/s across nodes")
        """),
    ]


def beyond_overlap() -> list:
    return [
        md("""
        ## Overlap made visible: DDP with and without it

        Bandwidth is picked relative to this machine (`minizero/lab/network_runs.py`): one launch first trains
        DDP with no network to measure a step's compute time T, then models the bandwidth at which DDP's
        all-reduce takes ρ·T. At ρ = 1 communication is as long as compute. `wrap(model, 0, overlap=False)`
        is DDP that launches every bucket after backward instead of from the autograd hooks.

        The same launch also runs stage 3 with and without prefetch and the bandwidth sweep of the next
        sections (one launch, about 20 short runs).
        """),
        code("""
        out = network_runs.measure(network_runs.overlap_runs(1.0) + network_runs.sweep_runs(), BASE)
        runs = network_runs.by_label(out)
        print(f"compute T = {out['compute_s'] * 1e3:.1f} ms per step; DDP all-reduces {out['allreduce_bytes'] / 1e3:.0f} kB")
        for label in ("DDP", "DDP, no overlap", "stage 3", "stage 3, no prefetch"):
            r = runs[label]
            print(f"{label:22} {r['network']:32} step {r['step_time_s'] * 1e3:6.1f} ms (fastest of {BASE.steps - 1})")
        network_plots.step_times(out, ["DDP", "DDP, no overlap"]);
        """),
        md("""
        The fastest step of each run (the CPU is shared: other work slows steps at random, never speeds them
        up), as recorded: the orange bars are the modelled link busy, the blue ticks the blocks' compute events. With overlap, the first buckets go out while backward still computes the earlier layers; without
        it, the link idles through backward and the step waits for all of it afterwards.
        """),
        code("""
        network_plots.timelines(out, ["DDP", "DDP, no overlap"]);
        """),
    ]


def beyond_prefetch() -> list:
    return [
        md("""
        ## Prefetch in stage 3

        Stage 3 all-gathers each unit before its forward and again before its backward. With prefetch
        (`wrap(..., prefetch=True)`, the default) the next unit's all-gather is issued while the current unit
        computes; without it every gather waits in front of its unit.
        """),
        code("""
        network_plots.step_times(out, ["stage 3", "stage 3, no prefetch"]);
        network_plots.timelines(out, ["stage 3", "stage 3, no prefetch"]);
        """),
    ]


def beyond_bandwidth() -> list:
    return [
        md("""
        ## Stages 0-3 as bandwidth falls

        The same ratios for every stage: ρ = 0.25, 1, 4 (the bandwidth falls by 16×). Stages 0-2 send 2Ψ per
        step, stage 3 3Ψ; stages 1 and 2 also move their all-gather *after* the step, where nothing is left to
        hide it behind. The dashed lines are the same stage with no network.
        """),
        code("""
        network_plots.bandwidth_sweep(out);
        """),
        md("""
        Where the bytes go: every collective of stages 0-3 spans all N ranks, so as soon as there is more than one
        node, every byte crosses nodes (`comm.tally()["inter_node"]`). Hierarchical designs exist to change
        that split.
        """),
        code("""
        for stage in range(4):
            sent = runs[f"stage {stage}, ratio 1.0"]["comm"]
            print(f"stage {stage}: {sent['total'] / 1e3:7.1f} kB per step, {sent['intra_node'] / 1e3:6.1f} kB inside "
                  f"nodes, {sent['inter_node'] / 1e3:7.1f} kB across")
        demo.export("network_8", {"network": out});       # for tests/test_notebooks.py
        """),
    ]


def beyond_try() -> list:
    return [
        md("""
        ## Try it

        The model's prediction at any bandwidth, from the runs above: each stage's compute T (no network) and
        bytes per step S give C = S / β; a step takes between max(T, C) (all communication hidden) and T + C
        (none hidden). The measurements above fall in between: DDP hides most of its all-reduce, stage 1 and 2's
        parameter all-gather after the step hides nothing.
        """),
        code("""
        from ipywidgets import FloatLogSlider, interact
        interact(lambda mbps: network_plots.prediction(out, mbps),
                 mbps=FloatLogSlider(value=out["runs"][0]["bandwidth"] * 8 / 1e6, base=10, min=-1, max=4, step=0.05,
                                     description="Mb/s"));
        """),
        md("""
        **What to try**

        - `python -m minizero.run --stage 0 --world-size 2 --network 100mbps` and again with `--no-overlap`;
          `--stage 3` with `--no-prefetch`.
        - A latency-bound network (`1tbps,1ms`): many small buckets now cost hops, not bytes; raise
          `--bucket-size-mb`.
        - `ranks_per_node=2` at N = 4: stage 3's collectives still all cross nodes. Which collectives would you keep
          inside a node?
        - The step-through with ZeRO++'s hpZ: `plots.step_widget(stepthrough.record(stepthrough.StepConfig(stage=3,
          world_size=4, hpz_group_size=2)))`: each unit's backward all-gather now reads the "secondary partition
          (hpZ)" kept from its forward, within pairs of ranks.
        """),
    ]


def beyond_hierarchical() -> list:
    from beyond_hsdp import cells            # HSDP / MiCS and ZeRO++'s hpZ: notebooks/beyond_hsdp.py
    return cells()


def beyond_hierarchical_steps() -> list:
    """Hierarchical sharding, one step rank by rank: stage 2 with shard groups of 2 at N = 4."""
    cells = step_through("steps_8", "stage=2, world_size=4, shard_group_size=2",
                         "stage=[1, 2, 3], shard_group_size=[1, 2, 4]", """
        **Shard groups of S = 2 at N = 4** (`shard_group_size=2`, `[Note: hierarchical sharding]` in
        `minizero/engine.py`). `comm.mesh(2)` cuts the 4 ranks into rows of 2 consecutive ranks, the *shard
        groups* {0, 1} and {2, 3} (`engine.shard_group`), and columns {0, 2} and {1, 3}, the *replicate groups*
        (`engine.replicate_group`): the ranks that hold the same partition. So each bucket is cut into S = 2
        partitions, not N = 4: rank r owns partition r mod 2 of its row, and ranks 0 and 2 hold the same one.
        Watch the phases in order:

        1. **reduce-scatter within each shard group**, bucket by bucket during backward: rank r's partition
           holds the average of *its group's* 6 rows, not yet the whole batch's; ranks 0 and 2 hold different
           values of the same partition (the end of backward shows both in the gradient shard);
        2. **all-reduce across the groups**, one per bucket at the start of `step()`: each partition is
           averaged over its column, the N/S = 2 ranks that own it, so every owner now holds the whole batch's
           gradient: the average over all N. It is the only collective that leaves a shard group
           (2(N/S - 1)/(N/S) · Ψ/S elements per rank);
        3. **the optimizer step** on each rank's partition: ranks 0 and 2 compute the same update (replicas);
        4. **all-gather within each shard group**: every rank has every updated parameter again.

        `stepthrough.check` replays it: after the reduce-scatter each owner holds its group's mean, after
        the all-reduce the whole batch's gradient, and at the end every rank the one-process step. The menu
        changes the stage (stage 3: the all-gathers of each unit also stay in the group) and S (S = 4 is the
        paper's ZeRO: no all-reduce across groups; S = 1: groups of one rank, so the all-reduce across them is
        DDP's and every rank steps every parameter).
        """, heading="One step, rank by rank: shard groups of 2 at N = 4")
    imports = "import plots                # notebooks/plots.py: the step-through's grids\n"    # self-contained
    cells[1].source = imports + cells[1].source.replace("from minizero.lab import stepthrough",
                                                        "from minizero.lab import demo, stepthrough")
    return cells


def beyond_quantized() -> list:
    from beyond_quant import cells           # ZeRO++'s qwZ and qgZ: notebooks/beyond_quant.py
    return cells()


BEYOND_SECTIONS = [beyond_intro, beyond_network_model, beyond_overlap, beyond_prefetch, beyond_bandwidth,
                   beyond_hierarchical, beyond_hierarchical_steps, beyond_quantized, beyond_try]
NOTEBOOKS["08_beyond"] = [cell for section in BEYOND_SECTIONS for cell in section()]


def main() -> None:
    for name, cells in NOTEBOOKS.items():
        cells = copy.deepcopy(cells)                 # SETUP is shared; ids differ per notebook
        for i, cell in enumerate(cells):
            cell.id = f"cell-{i:02d}"                # stable ids: rebuilding changes no line by itself
        nb = nbformat.v4.new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nb.metadata["language_info"] = {"name": "python"}
        nbformat.validate(nb)
        path = os.path.join(HERE, f"{name}.ipynb")
        with open(path, "w") as f:
            nbformat.write(nb, f)
        print(f"wrote {os.path.relpath(path)}")


if __name__ == "__main__":
    main()
