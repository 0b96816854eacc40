"""Mutant: steps the host masters but never copies them back: the device keeps the old
parameters."""


def offload_step(opt, grad_parts):
    for master, host, grad in zip(opt.masters, opt.host_grads, grad_parts):
        host.copy_(grad)
        master.grad = host
    opt.optimizer.step()
    for master in opt.masters:
        master.grad = None
