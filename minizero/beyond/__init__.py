"""Beyond the paper's ZeRO-DP: what later work added, plugged into the core's extension points.

    python -m minizero.run --stage 3 --world-size 4 --shard-group-size 2     # and
    notebooks/08_beyond

activations.py (ZeRO-R: activation memory measured, checkpointing, P_a), quantize.py (ZeRO++: qwZ,
qgZ), disk.py (ZeRO-Infinity's disk tier), network.py (a modelled cluster), desync.py (ranks out of
step, named), tensor_parallel.py and tensor_parallel_hf.py (Megatron's tensor parallelism on a 2-D
mesh), muon/ (Muon, an optimizer that needs whole matrices, at every stage). The core (minizero/'s
top level) is the paper; nothing here is needed to read it.
"""
