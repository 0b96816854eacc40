"""Notebook 08_beyond, section: hierarchical sharding (HSDP / MiCS) and ZeRO++'s hpZ.

    from beyond_hsdp import cells          # notebooks/build_notebooks.py puts cells() into 08_beyond

The cells are self-contained (their own imports; MINIZERO_SMALL=1: the tiny model). One launch at N = 4
trains stage 3 with shard groups of S = 1, 2, 4 ranks and with hpZ (R = 2), through the ordinary worker
minizero.lab.train.train_several, and compares memory per rank and bytes per kind of collective with
minizero.memory's formulas. Intra- vs inter-node bytes are attributed here from the per-kind tally and
each collective's group (memory.step_collectives, memory.group_ranks); once comm.tally() splits bytes into
"intra_node" / "inter_node" (the network model), those measured totals replace the attribution.
"""

from __future__ import annotations


def cells() -> list:
    # imported here, not at the top: build_notebooks imports this module
    from build_notebooks import code, md
    return [
        md("""
        ## Hierarchical sharding: shard within a group, replicate across groups (HSDP, MiCS)

        ZeRO shards over all N ranks, so every collective of every step spans every rank, across the
        slowest links of the cluster. FSDP2's HSDP and DeepSpeed's MiCS shard within a *group* of S ranks
        (a node, say) and keep N/S replicas of it: `minizero.wrap(model, stage, opt, shard_group_size=S)`
        for stages 1-3 (`--shard-group-size S`). Per rank, S replaces N in every sharded term:

        | stage | per rank, ZeRO (S = N) | per rank, groups of S |
        |---|---|---|
        | 1 | $2Ψ + 2Ψ + KΨ/N$ | $2Ψ + 2Ψ + KΨ/S$ |
        | 2 | $2Ψ + (2 + K)Ψ/N$ | $2Ψ + (2 + K)Ψ/S$ |
        | 3 | $(2 + 2 + K)Ψ/N$ | $(2 + 2 + K)Ψ/S$ |

        Gradients are reduce-scattered within the group, $\\frac{S-1}{S}Ψ$, then each rank's partition
        is all-reduced across the N/S groups, $2\\frac{N/S-1}{N/S}\\cdot\\frac{Ψ}{S}$; parameters are
        all-gathered within the group. The total is unchanged (for stages 1-2, $2\\frac{N-1}{N}Ψ$ either
        way): what changes is that only the small all-reduce leaves the group.
        (`[Note: hierarchical sharding]` in `minizero/engine.py`.)
        """),
        code("""
        import os
        import minizero
        from minizero.lab.train import TrainConfig, train_several
        from minizero.lab.report import theory
        from minizero.memory import (comm_volume_by_kind, comm_volume_by_node, group_ranks,
                                     secondary_partition_bytes, step_collectives, within_padding)

        SMALL = os.environ.get("MINIZERO_SMALL") == "1"
        N, RANKS_PER_NODE = 4, 2
        base = dict(stage=3, world_size=N, steps=2, batch_size=8, model="tiny" if SMALL else "default")
        hsdp_cfgs = {f"S = {s}": TrainConfig(**base, shard_group_size=s) for s in (1, 2, 4)}
        hsdp_cfgs["hpZ, R = 2"] = TrainConfig(**base, hpz_group_size=RANKS_PER_NODE)
        per_rank = minizero.launch(train_several, N, list(hsdp_cfgs.values()))
        hsdp_runs = {name: [r[i] for r in per_rank] for i, name in enumerate(hsdp_cfgs)}

        print(f"stage 3, N = {N}, rank 0, kB          params   grads   optim   (formula: params grads optim)")
        for name, cfg in hsdp_cfgs.items():
            res = hsdp_runs[name][0]
            th = theory(cfg, res["num_params"], res["num_frozen"])
            m = res["memory"]
            print(f"{name:>10}  measured {m['params']/1e3:8.1f} {m['grads']/1e3:7.1f} {m['optimizer']/1e3:7.1f}"
                  f"   formula {th['params']/1e3:7.1f} {th['grads']/1e3:7.1f} {th['optimizer']/1e3:7.1f}")
            for r in hsdp_runs[name]:
                assert all(within_padding(r["memory"][c], th[c], N) for c in ("params", "grads", "optimizer"))
        print("every rank's memory equals the formula with S in place of N (up to padding)")
        """),
        md("""
        ## ZeRO++ hpZ: backward's all-gather stays in the node

        Stage 3 all-gathers every unit twice a step (forward and backward) and reduce-scatters once: 3Ψ,
        all of it across nodes. ZeRO++'s hpZ (`hpz_group_size=R`, R = ranks per node; DeepSpeed's
        `zero_hpz_partition_size`) keeps, after each unit's forward all-gather, a *secondary* partition:
        the 1/R of the unit this rank owns within its node. Backward rebuilds the unit from those, inside
        the node. Inter-node bytes fall from $3\\frac{N-1}{N}Ψ$ to $2\\frac{N-1}{N}Ψ$; the price is Ψ/R more
        parameter memory from each unit's forward to its backward (`[Note: hpZ]` in `minizero/zero3.py`).

        Below, each kind of collective's measured bytes (rank 0's `comm.tally()`) next to its formula, and
        the split into intra- and inter-node bytes by the group each collective ran in
        (`memory.step_collectives`: shard rows, replicate columns, hpZ rows; nodes of 2 ranks).
        """),
        code("""
        def split_by_node(cfg, res, rank=0):
            # measured bytes of each kind, attributed to the groups step_collectives says it ran in
            psi, frozen = res["num_params"] - res["num_frozen"], res["num_frozen"]
            options = dict(bytes_per_elem=4, frozen=frozen, shard_group_size=cfg.shard_group_size,
                           hpz_group_size=cfg.hpz_group_size)
            rows = step_collectives(psi, N, 3, **options)
            formula = comm_volume_by_kind(psi, N, 3, **options)
            out = {"intra_node": 0.0, "inter_node": 0.0}
            for row in rows:                  # a group of 1 rank sends nothing
                share = row["bytes"] / formula[row["kind"]] * res["comm_bytes_per_step"][row["kind"]] if row["bytes"] else 0
                ranks = group_ranks(row["group"], rank, N, cfg.shard_group_size, cfg.hpz_group_size)
                out["intra_node" if len({r // RANKS_PER_NODE for r in ranks}) == 1 else "inter_node"] += share
            return out, formula, comm_volume_by_node(psi, N, 3, RANKS_PER_NODE, rank=rank, **options)

        bytes_table = {}
        for name, cfg in hsdp_cfgs.items():
            res = hsdp_runs[name][0]
            measured, formula, by_node = split_by_node(cfg, res)
            bytes_table[name] = measured
            kinds = "  ".join(f"{k} {res['comm_bytes_per_step'][k]/1e3:.1f} ({v/1e3:.1f})" for k, v in formula.items())
            print(f"{name:>10}: {kinds}   intra {measured['intra_node']/1e3:.1f} kB, inter {measured['inter_node']/1e3:.1f} kB")
            for k, v in formula.items():
                assert within_padding(res["comm_bytes_per_step"][k], v, N, times=2)
            assert all(within_padding(measured[k], by_node[k], N, times=3) for k in by_node)
        psi = hsdp_runs["S = 4"][0]["num_params"]
        extra = secondary_partition_bytes(psi, RANKS_PER_NODE, param_bytes=4)
        print(f"hpZ's price: Ψ/R = {extra/1e3:.1f} kB more parameters per rank between forward and backward "
              f"(rank 0's parameter peak: {hsdp_runs['hpZ, R = 2'][0]['memory']['peak_params']/1e3:.1f} kB with hpZ, "
              f"{hsdp_runs['S = 4'][0]['memory']['peak_params']/1e3:.1f} kB without)")
        """),
        code("""
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3))
        names = list(bytes_table)
        intra = [bytes_table[n]["intra_node"] / 1e3 for n in names]
        inter = [bytes_table[n]["inter_node"] / 1e3 for n in names]
        ax.bar(names, inter, label="inter-node")
        ax.bar(names, intra, bottom=inter, label="intra-node")
        ax.set_ylabel("kB per step, rank 0")
        ax.set_title(f"stage 3, N = {N}, nodes of {RANKS_PER_NODE} ranks")
        ax.legend();
        """),
    ]
