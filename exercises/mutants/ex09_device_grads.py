"""Mutant: hands the optimizer fresh copies of the device gradients instead of the host buffers."""


def offload_step(opt, grad_parts):
    for master, grad in zip(opt.masters, grad_parts):
        master.grad = grad.float()
    opt.optimizer.step()
    for master, part in zip(opt.masters, opt.param_parts):
        master.grad = None
        part.copy_(master.detach())
