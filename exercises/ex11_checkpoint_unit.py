"""Exercise 11: ZeRO-R's activation checkpointing, one unit: forward without keeping its
activations, recompute them in backward.

    Grade it:    pytest exercises -k ex11            (or: python -m minizero.grade -k ex11)
    Notebook:    notebooks/07_activations.ipynb
    Compare:     minizero/beyond/activations.py (_Checkpoint, checkpoint)

ZeRO-DP shards the model states; ZeRO-R (the paper's section 6) deals with what is left, first of
all the *activations*: what a forward keeps for its backward (a Linear keeps its input, a softmax
its output). A transformer block keeps ~16·s·b·h + a·s²·b elements (sequence s, micro-batch b, width
h, a heads): for GPT-2 1.5B at s = 1K, b = 32 the paper counts ~60 GB, far more than its model
states. Activation checkpointing keeps only each unit's *input* (s·b·h) through the forward, and
runs the unit's forward a second time inside backward, just before the unit's backward needs its
activations: ~8 GB in the paper's example, for one more forward per step, ~33 % more compute (a
backward costs about two forwards). The paper's P_a goes further and partitions these checkpoints
over the model-parallel ranks, which hold replicas of them; in pure data parallelism each rank's
activations are its own and there is no replica to partition. What applies is P_a+cpu, keeping the
checkpoints in host memory (activation_checkpointing="cpu").

Write checkpoint(run, *inputs): the value of run(*inputs) and the same gradients, for parameters and
inputs alike, while saving for backward nothing but `inputs`. `run` is a function of tensors: here
the forward of one transformer block, whose parameters live inside it. The tool is a
torch.autograd.Function, CheckpointFunction, whose two static methods you write:

  forward(ctx, run, *inputs)   autograd calls it with grad disabled, so running the unit here
                               records no graph and saves no activation. Keep `run` on ctx, save the
                               inputs with ctx.save_for_backward (autograd frees them once backward
                               has used them, and minizero's saved-tensor meter counts them), return
                               the output.
  backward(ctx, *grads)        the gradient of the output arrives; autograd runs this with grad
                               disabled too. Turn the saved inputs into fresh leaves (detached,
                               requires_grad as the originals had), run the unit again with grad
                               enabled (the recompute: it builds the graph forward did not keep),
                               backpropagate `grads` through it (this computes the parameters'
                               gradients), and return one gradient per argument of forward: None for
                               `run`, then each input's gradient.

What the grader checks: two ranks train a 4-block GPT for 3 SGD steps with minizero's stage 2, each
block's forward replaced by checkpoint(the block's own forward, x); they must end where one process
training on the whole batch ends. And engine.memory()["activations"], the peak bytes saved for
backward during a step (recompute included: minizero/beyond/activations.py measures them with
autograd's saved-tensor hooks), must be at most half of the same run's without checkpointing.

Hints:
  * `with torch.enable_grad():` turns grad back on inside backward; x.detach().requires_grad_(flag)
    makes a leaf of a saved tensor, and ctx.needs_input_grad[i] says whether forward's argument i
    (counting `run` as 0) required grad.
  * torch.autograd.backward(outputs, grads) runs backward from `outputs` with the given gradients:
    the parameters' .grad accumulate (firing minizero's gradient hooks, so stage 2 reduces them as
    usual) and each leaf's .grad fills in.
  * The units here return one tensor and their inputs require grad. (If none did, apply's output
    would not require grad and the parameters inside would get none: minizero passes one more dummy
    input that requires grad.)
  * Extra, not graded: with dropout in the unit, the recompute must draw the same mask as the
    forward. Save torch.get_rng_state() in forward; in backward, recompute inside
    torch.random.fork_rng() after torch.set_rng_state(...) (on a GPU the CUDA generator too), so the
    training's own stream goes on untouched.
"""

import torch


class CheckpointFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *inputs):
        raise NotImplementedError("ex11: write CheckpointFunction.forward")

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError("ex11: write CheckpointFunction.backward")


def checkpoint(run, *inputs):
    """run(*inputs), keeping only the inputs for backward and recomputing run in backward."""
    raise NotImplementedError("ex11: write checkpoint (one line, with CheckpointFunction)")
