"""Exercise 3, answer: what minizero's engines do with no_sync() (engine.py) and
minizero/lab/train.py's forward_backward: accumulate K micro-batches locally, average once, step
once."""

from minizero import comm


def train_step(model, optimizer, micro_batches, loss_fn):
    k, step_loss = len(micro_batches), 0.0
    for inputs, targets in micro_batches:            # no_sync: backward only adds into p.grad
        loss = loss_fn(model(inputs), targets) / k       # each micro-batch weighs 1/K of the step
        loss.backward()
        step_loss += loss.item()
    for p in model.parameters():                     # the one communication of the step
        if p.grad is not None:
            # the sum of K scaled means, averaged over N
            comm.all_reduce(p.grad, op="avg")
    optimizer.step()
    optimizer.zero_grad()
    return step_loss
