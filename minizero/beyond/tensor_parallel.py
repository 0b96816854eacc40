"""Tensor parallelism, Megatron's way: each block's matmuls split over the M ranks of a group.

    group = mesh.row_group(M)                       # M consecutive ranks (a node): one TP group
    model = tensor_parallel.parallelize_gpt(make_model(cfg), group)   # split in place, same seed
    loss = tensor_parallel.cross_entropy(model(x), y, group)          # logits stay split by vocab
    python -m pytest tests/test_tensor_parallel.py

ZeRO shards what data parallelism *replicates* (model states); tensor parallelism (Shoeybi et al.,
2019, "Megatron-LM") splits the *computation* of each layer, and the ZeRO paper combines the two
for its largest models: M-way model parallelism inside a node, ZeRO's N_d-way data parallelism
across. Each of the M ranks of a tensor-parallel group holds 1/M of every block's weights and
computes 1/M of its matmuls; what crosses between them is activations, not parameters.

A transformer block is two pairs of linear layers (attention: qkv then proj; MLP: fc then proj).
The first of a pair is *column-parallel*: its weight [out, in] is split along out, so each rank
computes out/M of the outputs from the whole input, and an elementwise function after it (GELU,
or attention over the rank's heads) needs nothing from the others. The second is *row-parallel*:
its weight is split along in, so each rank multiplies its out/M slice of the activations by its
in/M columns and gets a partial sum of the whole output; one all-reduce adds the M partial sums.
So a block costs two collectives forward and two backward, written f and g in the Megatron paper:

    f: forward the identity (every rank needs the whole input);   backward an all-reduce (each
       rank's input gradient is a partial sum: it flowed back through its out/M outputs only)
    g: forward an all-reduce (the row-parallel partial sums);     backward the identity (the
       output gradient is whole on every rank already)

f and g are the mirror of each other, as a column split is the transpose of a row split. The
embedding is split by vocabulary (each rank holds V/M rows; a token's row lives on one rank, the
others contribute zeros, then g), and with tied weights the head reuses that split: each rank
computes the logits of its V/M tokens, and `cross_entropy` computes the loss from them with three
all-reduces of [B, T] numbers instead of gathering [B, T, V] logits.

Everything else (LayerNorms, biases of row-parallel layers, position embeddings) is replicated in
the group: each rank computes it on the same whole activations, and its gradient, computed from the
same whole output gradient, is the same on every rank, so no collective is needed for it.

[Note: the 2-D mesh] wrap(..., tensor_parallel=M) cuts the N ranks into rows of M consecutive
ranks (mesh.py), each row one tensor-parallel group that splits every block (below), and columns of
N_d = N/M ranks that hold the same split: the data-parallel group. ZeRO is data parallelism, so
everything the engine does "over the N ranks" runs over the column (`data_group`, the core engine's
`group`): gradients are averaged, partitions cut and gathered among the N_d ranks, and each rank's
model is its tensor-parallel part. Two things see the rows: the global gradient norm
(`squared_norm`: a split parameter's squares are summed over the row, a replicated one counted
once) and the fp16 overflow check (every rank, as always). assembled.py plugs both in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minizero import comm
from minizero.param_groups import group_runs


def check_divides(what: str, size: int, group: comm.Group) -> None:
    """Megatron splits evenly: a size M does not divide is an error, said once, here."""
    if size % group.size:
        raise ValueError(f"tensor parallelism over {group.size} ranks: {what} = {size} is not "
                         f"divisible by {group.size}")


def is_split(p: nn.Parameter) -> bool:
    """Whether each rank of the group holds another part of `p` (a split weight), not the same
    values (a replicated one): the global gradient norm counts a replicated parameter once."""
    return getattr(p, "tensor_parallel_split", None) is not None


def _split_parameter(whole: nn.Parameter, group: comm.Group, dim: int,
                     pieces: int = 1) -> nn.Parameter:
    """This rank's 1/M of a layer's weight or bias along `dim` (part), as a Parameter that
    remembers how it was cut: checkpoints merge the parts and cut them again (merge, part)."""
    rule = {"dim": dim, "pieces": pieces, "transposed": False}
    p = nn.Parameter(part(whole.data, rule, group.size, group.index),
                     requires_grad=whole.requires_grad)
    p.tensor_parallel_split = rule
    return p


# --------------------------------------------------------------------------------------------------
# f and g: the two collectives of a tensor-parallel block, forward and backward side by side
# --------------------------------------------------------------------------------------------------

class _CopyToGroup(torch.autograd.Function):
    """f: the identity forward, an all-reduce (sum) of the input's gradient backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()                                 # all-reduce works in place
        comm.all_reduce(grad, op="sum", group=ctx.group, tag="tensor parallel f")
        return grad, None


class _ReduceFromGroup(torch.autograd.Function):
    """g: an all-reduce (sum) of the partial outputs forward, the identity backward."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group: comm.Group) -> torch.Tensor:
        out = partial.contiguous().clone()                       # the caller's tensor untouched
        comm.all_reduce(out, op="sum", group=group, tag="tensor parallel g")
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class _GatherFromGroup(torch.autograd.Function):
    """The whole last dimension from each rank's slice of it: an all-gather forward, this rank's
    slice of the gradient backward. For a head whose logits a loss takes whole (an AutoTP script's
    F.cross_entropy, Hugging Face's labels=): each rank computes the same loss from the same whole
    logits, so each rank's slice of its gradient is already the gradient of its own logits."""

    @staticmethod
    def forward(ctx, mine: torch.Tensor, group: comm.Group) -> torch.Tensor:
        ctx.group = group
        gathered = mine.new_empty((group.size, *mine.shape))              # [M, ..., V/M]
        comm.all_gather(gathered, mine.contiguous(), group=group, tag="tensor parallel logits")
        return torch.cat(gathered.unbind(0), dim=-1)                      # [..., V]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.chunk(ctx.group.size, dim=-1)[ctx.group.index].contiguous(), None


def copy_to_group(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return _CopyToGroup.apply(x, group)


def reduce_from_group(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return _ReduceFromGroup.apply(x, group)


def gather_from_group(x: torch.Tensor, group: comm.Group) -> torch.Tensor:
    return _GatherFromGroup.apply(x, group)


# --------------------------------------------------------------------------------------------------
# The layers
# --------------------------------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y_i = f(x) W_i^T + b_i: this rank's out/M outputs. Built from a whole nn.Linear, which it
    splits (`pieces`: how many fused matrices its rows hold, 3 for qkv). gather_output (Megatron's
    name): all-gather the M slices, every rank gets all out outputs (an untied head whose logits a
    loss takes whole)."""

    gather_output = False

    def __init__(self, linear: nn.Linear, group: comm.Group, pieces: int = 1):
        super().__init__()
        check_divides("a column-parallel layer's outputs", linear.out_features // pieces, group)
        self.group = group
        self.weight = _split_parameter(linear.weight, group, 0, pieces)            # [out/M, in]
        self.bias = None if linear.bias is None else _split_parameter(linear.bias, group, 0,
                                                                      pieces)

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # x: [..., in] -> [..., out/M]
        y = F.linear(copy_to_group(x, self.group), self.weight, self.bias)         # <- f
        return gather_from_group(y, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """y = g(x_i W_i^T) + b: the M partial sums added; the bias once, after the sum."""

    def __init__(self, linear: nn.Linear, group: comm.Group):
        super().__init__()
        check_divides("a row-parallel layer's inputs", linear.in_features, group)
        self.group = group
        self.weight = _split_parameter(linear.weight, group, 1)                    # [out, in/M]
        self.bias = None if linear.bias is None else nn.Parameter(
            linear.bias.data.clone(), requires_grad=linear.bias.requires_grad)   # replicated

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # x: [..., in/M] -> [..., out]
        y = reduce_from_group(F.linear(x, self.weight), self.group)               # <- g
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows [start, end) of the vocabulary on this rank: a token outside them looks up zeros, and g
    adds the M lookups, of which exactly one is the token's row."""

    def __init__(self, embedding: nn.Embedding, group: comm.Group):
        super().__init__()
        vocab = embedding.num_embeddings
        check_divides("the vocabulary", vocab, group)
        self.group, per_rank = group, vocab // group.size
        self.start, self.end = group.index * per_rank, (group.index + 1) * per_rank
        self.weight = _split_parameter(embedding.weight, group, 0)                 # [V/M, C]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:      # ids: [B, T] -> [B, T, C]
        elsewhere = (ids < self.start) | (ids >= self.end)
        rows = F.embedding((ids - self.start).masked_fill(elsewhere, 0), self.weight)
        return reduce_from_group(rows.masked_fill(elsewhere.unsqueeze(-1), 0.0), self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy over the scored positions, from logits split by vocabulary [N, V/M]:
    log Σ_v exp(z_v) - z_target, each sum over v an all-reduce of N numbers."""

    @staticmethod
    def forward(ctx, logits, target, group, start, ignore_index):   # logits [N, V/M], target [N]
        logits = logits.float()
        peak = logits.max(dim=-1).values                                          # [N]
        comm.all_reduce(peak, op="max", group=group, tag="tensor parallel loss")
        shifted = logits - peak.unsqueeze(-1)                 # exp cannot overflow: at most 1
        exp = shifted.exp()
        total = exp.sum(dim=-1)                                                   # [N]
        comm.all_reduce(total, op="sum", group=group, tag="tensor parallel loss")
        local = target - start
        here = (local >= 0) & (local < logits.shape[-1])      # this rank holds the target's logit
        index = local.clamp(0, logits.shape[-1] - 1).unsqueeze(-1)
        picked = shifted.gather(-1, index).squeeze(-1).masked_fill(~here, 0.0)    # [N]
        comm.all_reduce(picked, op="sum", group=group, tag="tensor parallel loss")
        scored = target != ignore_index
        count = scored.sum().clamp(min=1)
        loss = ((total.log() - picked) * scored).sum() / count
        ctx.save_for_backward(exp / total.unsqueeze(-1), index, here & scored, scored, count)
        return loss

    @staticmethod
    def backward(ctx, grad):
        softmax, index, target_here, scored, count = ctx.saved_tensors
        # d loss / d z_v = (softmax_v - [v = target]) / count, on this rank's V/M logits only
        g = softmax.clone()
        g.scatter_add_(-1, index, -target_here.unsqueeze(-1).to(g.dtype))
        g *= (scored.unsqueeze(-1) * grad / count)
        return g, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, group: comm.Group,
                  ignore_index: int = -100) -> torch.Tensor:
    """F.cross_entropy(whole logits, target, ignore_index) from this rank's vocab slice of the
    logits [..., V/M] (the layout parallelize_gpt's head gives): the loss, equal on every rank."""
    per_rank = logits.shape[-1]
    return _VocabParallelCrossEntropy.apply(logits.flatten(0, -2), target.flatten(), group,
                                            group.index * per_rank, ignore_index)


# --------------------------------------------------------------------------------------------------
# Applying it to a model
# --------------------------------------------------------------------------------------------------

def group_of(model: nn.Module) -> comm.Group | None:
    """The group `model` is split over (its first tensor-parallel layer's), or None: not split."""
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            return module.group
    return None


class TiedVocabHead(nn.Module):
    """The head tied to a vocab-parallel embedding: this rank's V/M logits, f(x) E_i^T (all V of
    them with gather_output, as ColumnParallelLinear's)."""

    gather_output = False

    def __init__(self, embedding: VocabParallelEmbedding):
        super().__init__()
        self.embedding, self.group = [embedding], embedding.group    # a list: not a submodule

    def forward(self, x: torch.Tensor) -> torch.Tensor:        # [B, T, C] -> [B, T, V/M]
        y = F.linear(copy_to_group(x, self.group), self.embedding[0].weight)       # <- f
        return gather_from_group(y, self.group) if self.gather_output else y


def check_tied_heads(model: nn.Module, units: list[nn.Module]) -> None:
    """Stage 3 frees a unit's parameters outside its forward (zero3.py). A TiedVocabHead reads its
    embedding's weight without holding it (it is no submodule), so that weight is only present
    when the head runs if both are in one unit: else the head would compute with NaN (absent.py).
    Raise ValueError (one line) when they are not; a transformer's default units (its blocks, the
    model keeping the embedding and the head) always keep them together."""
    def unit_of(target: nn.Module) -> nn.Module:      # the innermost unit holding it, or the model
        holding = [u for u in units if any(m is target for m in u.modules())]
        return min(holding, key=lambda u: sum(1 for _ in u.modules()), default=model)
    names = {id(m): name for name, m in model.named_modules()}
    for head in (m for m in model.modules() if isinstance(m, TiedVocabHead)):
        embedding = head.embedding[0]
        if unit_of(head) is not unit_of(embedding):
            raise ValueError(
                f"stage 3 with tensor_parallel: the tied head ({names[id(head)]}) reads the weight "
                f"of {names[id(embedding)]}, which is in another unit; choose units that keep "
                "them together (units=list(model.blocks), say: the model keeps both)")


def parallelize_gpt(model: nn.Module, group: comm.Group) -> nn.Module:
    """Split minizero's GPT (minizero/lab/model.py's shape: blocks of attn.qkv / attn.proj and
    mlp[0] / mlp[2], tok_emb, a tied head) over `group`, in place; returns the model. Its output is
    this rank's vocab slice of the logits: take the loss with `cross_entropy`."""
    if getattr(model.cfg, "tie_weights", False) is not True:
        raise ValueError("parallelize_gpt splits the head as the tied embedding: tie_weights=True")
    check_divides("the number of heads", model.cfg.n_head, group)
    for block in model.blocks:
        attn = block.attn
        attn.qkv = ColumnParallelLinear(attn.qkv, group, pieces=3)   # q, k, v: n_head/M heads each
        attn.proj = RowParallelLinear(attn.proj, group)
        attn.n_head //= group.size
        block.mlp[0] = ColumnParallelLinear(block.mlp[0], group)
        block.mlp[2] = RowParallelLinear(block.mlp[2], group)
    model.tok_emb = VocabParallelEmbedding(model.tok_emb, group)
    model.head = TiedVocabHead(model.tok_emb)
    return model


# --------------------------------------------------------------------------------------------------
# Whole and split: the one rule checkpoints use to merge the M parts and cut them for another M
# --------------------------------------------------------------------------------------------------

def part(whole: torch.Tensor, rule: dict | None, m: int, index: int) -> torch.Tensor:
    """Part `index` of m of a whole tensor, cut by `rule` (a split parameter's
    tensor_parallel_split: {"dim", "pieces", "transposed"}; None: replicated, every part is the
    whole). With pieces > 1 (a fused qkv weight) each of the equal pieces is cut on its own, so a
    rank gets its q, its k and its v."""
    if rule is None:
        return whole
    whole = whole.t() if rule["transposed"] else whole        # the whole model's [in, out]
    pieces = whole.chunk(rule["pieces"], dim=rule["dim"])
    return torch.cat([p.chunk(m, dim=rule["dim"])[index] for p in pieces], dim=rule["dim"]).clone()


def merge(parts: list[torch.Tensor], rule: dict | None) -> torch.Tensor:
    """The whole tensor from its m parts (in rank order): part's inverse."""
    if rule is None:
        return parts[0]
    dim, pieces = rule["dim"], rule["pieces"]
    cut = [p.chunk(pieces, dim=dim) for p in parts]           # each part: its 1/m of each piece
    whole = torch.cat([c[i] for i in range(pieces) for c in cut], dim=dim)
    return whole.t().contiguous() if rule["transposed"] else whole


def whole_entries(model: nn.Module) -> list[dict]:
    """The whole model's state_dict, described from this rank's split model: for every key of the
    model built without tensor parallelism, in its order, {"key", "part": the key of this model
    that holds this rank's part, "shape": the whole shape, "trainable", "split": how it is cut
    (part's rule), None when replicated}. A head tied to a vocab-parallel embedding is no submodule
    (TiedVocabHead), so its key is added here, where the whole model has it. An unsplit model:
    its own keys, none split."""
    group = group_of(model)
    m = 1 if group is None else group.size
    state = model.state_dict(keep_vars=True)
    first = {}                                        # a tensor's first key: a tie names it twice
    for key, t in state.items():
        first.setdefault(id(t), key)
    own: dict[str, list[str]] = {}                    # each module's own keys, as state_dict orders
    for key in state:
        own.setdefault(key.rpartition(".")[0], []).append(key)
    entries = []
    for name, module in model.named_modules(remove_duplicate=False):
        prefix = f"{name}." if name else ""
        pairs = [(key, key) for key in own.pop(name, [])]
        if isinstance(module, TiedVocabHead):
            pairs.append((prefix + "weight", first[id(module.embedding[0].weight)]))
        for key, holder in pairs:
            t = state[holder]
            rule = getattr(t, "tensor_parallel_split", None)
            shape = list(t.shape)
            if rule is not None:
                shape[rule["dim"]] *= m
                shape = shape[::-1] if rule["transposed"] else shape
            entries.append({"key": key, "part": holder, "shape": shape,
                            "trainable": t.requires_grad, "split": rule})
    return entries


def squared_norm(engine, grads: list[torch.Tensor]) -> torch.Tensor:
    """‖g‖² of the whole model on the mesh ([Note: the 2-D mesh]): each rank adds its elements of
    split parameters and 1/M of those of replicated ones (every rank of the row holds them alike),
    then one all-reduce over all N ranks counts each element of the whole model once."""
    squares = torch.zeros((), dtype=torch.float32, device=engine.device)
    weight = (1.0, 1.0 / engine.tensor_group.size)            # split, replicated; padding: None
    for b, g in zip(engine.layout.buckets, grads):
        start = comm.group_rank(engine.group) * g.numel() if engine.sharded else 0
        kind = {id(p): int(not is_split(p)) for p in b.params}
        for lo, hi, k in group_runs(b, start, start + g.numel(), kind):  # this rank's runs
            if k is not None:
                squares += g[lo:hi].float().pow(2).sum() * weight[k]
    comm.all_reduce(squares, op="sum", tag="gradient norm")                # over the whole mesh
    return squares
