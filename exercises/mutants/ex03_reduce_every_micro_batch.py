"""Mutant: averages the gradients after every micro-batch: the right numbers (averaging is linear),
but K times the bytes: exactly what no_sync() exists to avoid."""

from minizero import comm


def train_step(model, optimizer, micro_batches, loss_fn):
    step_loss = 0.0
    for inputs, targets in micro_batches:
        loss = loss_fn(model(inputs), targets) / len(micro_batches)
        loss.backward()
        for p in model.parameters():
            comm.all_reduce(p.grad, op="avg")
        step_loss += loss.item()
    optimizer.step()
    optimizer.zero_grad()
    return step_loss
