"""The tooling around the ZeRO implementation: what experiments, tests, notebooks and commands use.

    model.py data.py       a small GPT with tied weights, and a sorting task that is its data
    train.py               one training run as every rank executes it (TrainConfig, train_worker)
    reference.py           the oracle: one process training on the global batch; the tolerances
    report.py              the paper's formulas for a run, next to what it measured
    peers.py               PyTorch's own DDP / ZeroRedundancyOptimizer / FSDP2, trained the same way
    deepspeed_peer.py      DeepSpeed's ZeRO stages 0-3 and offload, inside minizero.launch
                           (extra [peers])
    bench.py scale.py      experiments: minizero vs PyTorch; the largest model each stage fits
    demo.py figures.py     what the notebooks and the slides run
    concepts.py grade.py   the concept map; the exercises' grader (DeepSpeed configs: ../config.py)
    faults.py              failures on purpose, for the tests that a failing rank never hangs
                           the others

The implementation (minizero/*.py) never imports from here: tests/test_layout.py checks it.
"""
