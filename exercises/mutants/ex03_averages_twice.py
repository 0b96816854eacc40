"""Mutant: divides each micro-batch's loss by K and then divides the accumulated gradient by K
again: every step is K times too small."""

from minizero import comm


def train_step(model, optimizer, micro_batches, loss_fn):
    k, step_loss = len(micro_batches), 0.0
    for inputs, targets in micro_batches:
        loss = loss_fn(model(inputs), targets) / k
        loss.backward()
        step_loss += loss.item()
    for p in model.parameters():
        comm.all_reduce(p.grad, op="avg")
        p.grad /= k                                  # the accumulation averaged a second time
    optimizer.step()
    optimizer.zero_grad()
    return step_loss
