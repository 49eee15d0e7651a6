"""The README's recipe, as it is printed there: one training script whose every rank reports
to rankboard. Plain Python (a line fitted by SGD on made-up data), so it runs anywhere; put
your own model where ``train_step`` is. ``tests/agent/test_recipe.py`` runs it against a real
broker and checks that the README still prints exactly this code.

    rankboard up &                                      # broker + dashboard on :8585
    python examples/recipe.py                           # one process
    torchrun --nproc-per-node 2 examples/recipe.py      # or any launcher: one run, 2 ranks
"""
import random
import time

from rank_agent import RankAgent

EPOCHS, BATCHES, BATCH_SIZE, LR = 3, 50, 32, 0.05


def make_batch(rng):
    xs = [rng.uniform(-1.0, 1.0) for _ in range(BATCH_SIZE)]
    return xs, [3.0 * x + 0.5 + rng.gauss(0.0, 0.1) for x in xs]


def train_step(w, b, batch):
    """One SGD step of y = w*x + b on a batch; returns the new w, b and the batch's loss."""
    xs, ys = batch
    errs = [w * x + b - y for x, y in zip(xs, ys)]
    grad_w = 2.0 * sum(e * x for e, x in zip(errs, xs)) / len(errs)
    grad_b = 2.0 * sum(errs) / len(errs)
    return w - LR * grad_w, b - LR * grad_b, sum(e * e for e in errs) / len(errs)


def main():
    rng = random.Random(0)
    w = b = 0.0
    step = 0
    with RankAgent.from_env() as agent:             # rank, world size, run id: torchrun/Slurm
        agent.register(total_epochs=EPOCHS)          # optional: the progress bar's epoch count
        agent.set_metadata({"lr": LR, "batch_size": BATCH_SIZE})
        agent.set_hardware()                          # "<cpu> | <this rank's gpu>"
        agent.start_sampling(interval=2.0)            # CPU, RAM, GPU in a background thread
        for epoch in range(EPOCHS):
            started, total = time.perf_counter(), 0.0
            for _ in range(BATCHES):
                batch = make_batch(rng)
                agent.batch_ready()                       # the batch is in hand: the data wait
                w, b, loss = train_step(w, b, batch)
                agent.log_step(step, {"loss": loss}, samples=BATCH_SIZE)   # ~1 µs, never blocks
                step += 1
                total += loss
            agent.log_epoch(epoch, total / BATCHES, batches=BATCHES,
                            samples=BATCHES * BATCH_SIZE,
                            epoch_ms=(time.perf_counter() - started) * 1000.0,
                            scalars={"w": w, "b": b})
    # leaving the `with` sends finish("ok") ("error" on an exception) and closes the agent


if __name__ == "__main__":
    main()
