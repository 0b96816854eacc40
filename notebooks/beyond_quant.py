"""Notebook 08_beyond, section ZeRO++ qwZ and qgZ: int8 communication (minizero/quantize.py).

`cells()` is this section's cells; notebooks/build_notebooks.py puts them into 08_beyond. The experiment is
minizero.lab.quantized.quantized_experiment (launched ranks import it from the package).
"""

from __future__ import annotations


def cells() -> list:
    from build_notebooks import code, md     # imported here, not at the top: build_notebooks imports this module
    return [
        md("""
        ## ZeRO++ qwZ and qgZ: send int8, keep everything else exact

        Stage 3 moves 3Ψ per step: forward's all-gather, backward's all-gather, the gradients' reduce-scatter.
        ZeRO++ (Wang et al. 2023) sends two of them quantized: **qwZ**, forward's all-gather of the weights
        (`quantized_weights=True`, stage 3), and **qgZ**, the gradient reduce-scatter (`quantized_gradients=True`,
        stages 2-3), as an all-to-all of int8 chunks that each rank dequantizes and averages in fp32. Backward's
        all-gather stays exact, and nothing stored (shards, fp32 masters, optimizer states) is ever quantized.

        Block quantization (`minizero/quantize.py`): blocks of $B$ elements, $scale = absmax/127$ (fp32),
        $q = round(x/scale) \\in [-127, 127]$ (int8). The error of each element is at most $scale/2 =
        absmax/254$ of its block; $n$ elements travel as $n + 4\\lceil n/B \\rceil$ bytes instead of $4n$ (fp32)
        or $2n$ (bf16). Per step and rank, for fp32 stage 3:
        $\\frac{N-1}{N}\\,(3 \\cdot 4\\Psi) \\to \\frac{N-1}{N}\\,(\\Psi(1 + 4/B) + 4\\Psi + \\Psi(1 + 4/B))$.
        ZeRO++'s own qgZ is hierarchical (int4, an all-to-all inside the node, then across nodes); minizero's is
        the one-hop int8 form of the same idea.

        One launch of 3 ranks: one SGD step of a 432-parameter MLP ($B = 16$ divides every chunk, so the formula
        is exact) for each variant, and a short training run of the small GPT with and without quantization.
        """),
        code("""
        import os
        import matplotlib.pyplot as plt
        import minizero
        from minizero.lab.quantized import LR, PSI, VARIANTS, quantized_experiment
        from minizero.lab.train import TrainConfig
        from minizero.memory import comm_volume

        N, BLOCK = 3, 16
        QSTEPS = 4 if os.environ.get("MINIZERO_SMALL") == "1" else 20
        QRUNS = {"stage 3": {}, "stage 3 qwZ": {"quantized_weights": True}, "stage 3 qgZ": {"quantized_gradients": True},
                 "stage 3 qwZ+qgZ": {"quantized_weights": True, "quantized_gradients": True}}
        cfgs = [TrainConfig(stage=3, world_size=N, steps=QSTEPS, model="tiny", batch_size=12, **o) for o in QRUNS.values()]
        quant = minizero.launch(quantized_experiment, N, cfgs, BLOCK, backend="gloo")[0]

        print(f"{'variant':>16} {'measured B/step':>16} {'formula':>9}   by collective")
        for name, (stage, options) in VARIANTS.items():
            tally = quant["one_step"][name]["tally"]
            formula = comm_volume(PSI, N, stage, bytes_per_elem=4, block=BLOCK, **options)
            assert tally["total"] == formula, (name, tally, formula)
            kinds = ", ".join(f"{k} {v:.0f}" for k, v in tally.items() if k != "total")
            print(f"{name:>16} {tally['total']:16.0f} {formula:9.0f}   {kinds}")
        """),
        md("""
        **One step's error.** With qgZ each rank's chunk of its gradient $g_r$ arrives off by at most
        $absmax/254$ of its block, so the average by at most $\\max_r |g_r| / 254$ and the parameters after one
        SGD step by $lr$ times that. With qwZ, forward computes with weights within $absmax/254$ of the exact
        ones (backward uses the exact ones).
        """),
        code("""
        bound = LR * quant["grad_max"] / 254
        for stage in (2, 3):
            plain, q = quant["one_step"][f"stage {stage}"]["state"], quant["one_step"][f"stage {stage} qgZ"]["state"]
            err = max((plain[k] - q[k]).abs().max().item() for k in plain)
            assert err <= bound * 1.001 + 1e-7
            print(f"stage {stage} qgZ: one step's max |param - unquantized| = {err:.2e} <= bound {bound:.2e}")
        run = quant["one_step"]["stage 3 qwZ"]
        for i, (w, seen) in enumerate(zip((quant["initial"][f"{j}.weight"] for j in (0, 2, 4)), run["forward"])):
            print(f"qwZ layer {i}: forward weights off by {(seen - w).abs().max():.2e} <= max|w|/254 = "
                  f"{w.abs().max() / 254:.2e}")
        print(f"loss of that step: {quant['one_step']['stage 3']['loss']:.6f} exact, {run['loss']:.6f} with qwZ")
        """),
        code("""
        fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 3.6))
        for name, rec in zip(QRUNS, quant["runs"]):
            ax.plot(rec["losses"], label=name)
            bx.bar(name.replace("stage 3 ", "") or "exact", rec["comm_bytes_per_step"]["total"] / 1e3)
        ax.set(xlabel="step", ylabel="loss", title=f"small GPT, stage 3, N = {N}: loss")
        ax.legend()
        bx.set(ylabel="kB sent per step and rank", title="bytes per step (default B = 256)")
        plt.tight_layout()
        finals = [rec["losses"][-1] for rec in quant["runs"]]
        print("final losses:", ", ".join(f"{n} {f:.4f}" for n, f in zip(QRUNS, finals)))
        """),
        md("""
        The quantized runs follow the exact one within a few thousandths of the loss, for about half the bytes
        (fp32: 12 bytes an element per step become about 6). Every stored tensor stays exact, so the error does
        not accumulate in the weights: each step's quantization error is fresh and bounded.

        **Exercise.** [../exercises/ex09_block_quantize.py](../exercises/ex09_block_quantize.py): block
        quantize and dequantize, graded on the error bound and on the bytes stage 3 sends with them.
        """),
    ]
