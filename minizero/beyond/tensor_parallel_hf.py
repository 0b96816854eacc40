"""Tensor parallelism for the layouts it knows: Hugging Face's GPT-2 and Llama built from their
configs, and minizero's GPT (tensor_parallel.parallelize_gpt). `wrap(..., tensor_parallel=M)`
splits a model here.

    model = GPT2LMHeadModel(GPT2Config(...))            # or LlamaForCausalLM(LlamaConfig(...))
    group = mesh.row_group(M)
    model = tensor_parallel_hf.parallelize(model, group)           # split in place, same weights
    logits = model(input_ids=x, use_cache=False).logits            # this rank's V/M of the vocab
    loss = tensor_parallel.cross_entropy(logits[:, :-1], x[:, 1:], group)
    python -m pytest tests/test_tensor_parallel.py

The same four layers as minizero's GPT (minizero/beyond/tensor_parallel.py explains f, g and the
split): in each block the attention's input projection(s) and the MLP's first layer(s) are
column-parallel, the attention's output projection and the MLP's last layer row-parallel; the token
embedding is split by vocabulary, and the head reuses that split (tied, GPT-2) or is column-parallel
over the vocabulary (untied, Llama's default). The attention modules compute their head count from
the width they receive (`view(..., -1, head_dim)`), so only GPT-2's `split_size` must be told.

GPT-2's layers are `Conv1D`s (weight [in, out], y = x W + b): each is turned into the nn.Linear it
is (weight [out, in]) before it is split.
"""

from __future__ import annotations

from torch import nn

from minizero import comm
from minizero.beyond.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TiedVocabHead,
    VocabParallelEmbedding,
    check_divides,
    is_split,
    parallelize_gpt,
)


def knows(model: nn.Module) -> bool:
    """Whether parallelize can split this model: it is split already, or has one of the layouts."""
    return (any(is_split(p) for p in model.parameters()) or _gpt_layout(model)
            or _gpt2_layout(model) or _llama_layout(model))


def _gpt_layout(model: nn.Module) -> bool:
    return hasattr(model, "blocks") and hasattr(model, "tok_emb")


def _gpt2_layout(model: nn.Module) -> bool:
    return hasattr(model, "transformer") and hasattr(model.transformer, "h")


def _llama_layout(model: nn.Module) -> bool:
    return hasattr(model, "model") and hasattr(model.model, "layers")


def parallelize(model: nn.Module, group: comm.Group) -> nn.Module:
    """Split a GPT2LMHeadModel, a LlamaForCausalLM or minizero's GPT (or a model of their layout)
    over `group`, in place; returns the model, whose logits are this rank's vocabulary slice. A
    model that holds split parameters already (its own parallel layers) is returned as it is."""
    if any(is_split(p) for p in model.parameters()):
        return model
    if _gpt_layout(model):
        parallelize_gpt(model, group)
    elif _gpt2_layout(model):
        _gpt2(model, group)
    elif _llama_layout(model):
        _llama(model, group)
    else:
        raise TypeError(f"tensor parallelism knows GPT-2's and Llama's layouts, not "
                        f"{type(model).__name__}'s: split its layers with "
                        "minizero.beyond.tensor_parallel")
    return model


def gather_logits(model: nn.Module) -> nn.Module:
    """Make a split model's head all-gather its logits: every rank gets all V of them, for a loss
    computed on whole logits (a DeepSpeed AutoTP script's, Hugging Face's labels=), instead of
    tensor_parallel.cross_entropy on its V/M. Costs one all-gather of [B, T, V] per forward (and
    keeps the whole logits for backward); returns the model."""
    head = model.head if _gpt_layout(model) else model.lm_head
    if not isinstance(head, (TiedVocabHead, ColumnParallelLinear)):
        raise TypeError(f"gather_logits: {type(model).__name__}'s head is not split")
    head.gather_output = True
    return model


def _from_conv1d(layer: nn.Module) -> nn.Module:
    """A parallel layer built from a Conv1D: the whole model holds its weight as [in, out], so a
    checkpoint merges the parts into that form (tensor_parallel.merge)."""
    layer.weight.tensor_parallel_split["transposed"] = True
    return layer


def _as_linear(conv1d: nn.Module) -> nn.Linear:
    """GPT-2's Conv1D (weight [in, out]) as the nn.Linear it computes (weight [out, in])."""
    n_in, n_out = conv1d.weight.shape
    linear = nn.Linear(n_in, n_out, bias=conv1d.bias is not None)
    linear.weight.data.copy_(conv1d.weight.data.t())
    if conv1d.bias is not None:
        linear.bias.data.copy_(conv1d.bias.data)
    return linear


def _head(model: nn.Module, embedding: VocabParallelEmbedding, group: comm.Group) -> None:
    if getattr(model.config, "tie_word_embeddings", False):
        model.lm_head = TiedVocabHead(embedding)
    else:
        model.lm_head = ColumnParallelLinear(model.lm_head, group)    # [V/M, C]: the same rows


def _gpt2(model: nn.Module, group: comm.Group) -> None:
    check_divides("the number of heads", model.config.n_head, group)
    for block in model.transformer.h:
        attn, mlp = block.attn, block.mlp
        attn.c_attn = _from_conv1d(ColumnParallelLinear(_as_linear(attn.c_attn), group,
                                                        pieces=3))                 # q, k, v
        attn.c_proj = _from_conv1d(RowParallelLinear(_as_linear(attn.c_proj), group))
        attn.split_size //= group.size              # forward splits c_attn's output by this width
        mlp.c_fc = _from_conv1d(ColumnParallelLinear(_as_linear(mlp.c_fc), group))
        mlp.c_proj = _from_conv1d(RowParallelLinear(_as_linear(mlp.c_proj), group))
    model.transformer.wte = VocabParallelEmbedding(model.transformer.wte, group)
    _head(model, model.transformer.wte, group)


def _llama(model: nn.Module, group: comm.Group) -> None:
    check_divides("the number of heads", model.config.num_attention_heads, group)
    check_divides("the number of key-value heads", model.config.num_key_value_heads, group)
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        attn.q_proj = ColumnParallelLinear(attn.q_proj, group)
        attn.k_proj = ColumnParallelLinear(attn.k_proj, group)
        attn.v_proj = ColumnParallelLinear(attn.v_proj, group)
        attn.o_proj = RowParallelLinear(attn.o_proj, group)
        mlp.gate_proj = ColumnParallelLinear(mlp.gate_proj, group)
        mlp.up_proj = ColumnParallelLinear(mlp.up_proj, group)
        mlp.down_proj = RowParallelLinear(mlp.down_proj, group)
    model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, group)
    _head(model, model.model.embed_tokens, group)
