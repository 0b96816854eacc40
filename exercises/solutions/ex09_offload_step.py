"""Exercise 9, answer: the host step of ZeRO-Offload (minizero/offload.py, HostShardOptimizer, with
minizero/optim.py's ShardOptimizer.step): gradients down, step on the host, parameters back up."""


def offload_step(opt, grad_parts):
    for host, grad in zip(opt.host_grads, grad_parts):
        # device -> host, upcast to fp32: 2Ψ/N bytes over PCIe
        host.copy_(grad)
    for master, host in zip(opt.masters, opt.host_grads):
        master.grad = host
    opt.optimizer.step()                          # on the host, fp32 masters and their state
    for master, part in zip(opt.masters, opt.param_parts):
        master.grad = None
        part.copy_(master.detach())               # host -> device, rounded to the model's dtype
