"""Exercise 9: CPU offload, the optimizer step on the host and the copy back.

    Grade it:    pytest exercises -k ex09            (or: python -m minizero.grade -k ex09)
    Notebook:    notebooks/05_offload.ipynb
    Compare:     minizero/offload.py (HostShardOptimizer), minizero/optim.py (ShardOptimizer.step)

ZeRO-Offload moves what is biggest and used least, the optimizer (fp32 master weights and their
state, the KΨ/N of the paper), to host memory. The device keeps what computes: parameters and
gradients. Per step, for this rank's partition (Ψ/N elements):

    device gradients  --copy (upcast to fp32)-->  host gradient buffers       2Ψ/N bytes over PCIe
    host: optimizer step on the fp32 master weights
    host master weights  --copy (round to the model's dtype)-->  device parameters   2Ψ/N bytes back

Write offload_step(opt, grad_parts). `opt` is minizero's HostShardOptimizer for this rank, with one
entry per bucket in each of these lists:
    opt.param_parts  the device parameters this rank owns (views into the model: update in place)
    opt.masters      the host fp32 master weights, nn.Parameters: what opt.optimizer steps
    opt.host_grads   preallocated host fp32 buffers, one per part (pinned on CUDA)
    opt.optimizer    the torch optimizer over opt.masters
and grad_parts[i] is the averaged device gradient of param_parts[i]. After your step the device
parameters must equal the updated masters (rounded to the model's dtype).

What the grader checks: two ranks train a small GPT for 3 SGD steps with minizero's stage 2 and
offload, your offload_step in place of minizero's; after every step each host gradient buffer must
hold its averaged gradient and each device part must equal its master; the result must match one
process training on the whole batch. Write the three moves yourself: minizero's ShardOptimizer.step
does all of them, and minizero.optim and minizero.offload are refused in your file.

Hints:
  * tensor.copy_(other) converts the dtype (and, on a GPU, copies device <-> host).
  * An optimizer steps the parameters whose .grad is set; set master.grad to the host buffer, step,
    and set it back to None.
"""


def offload_step(opt, grad_parts: list) -> None:
    """Host optimizer step on this rank's masters from the device gradients; copy the result
    back."""
    raise NotImplementedError("ex09: write offload_step")
