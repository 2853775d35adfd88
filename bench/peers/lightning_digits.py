"""ddpflow's default job as a standalone PyTorch Lightning script: a LightningModule around the
same model, Trainer(accelerator="cpu", devices=2, strategy="ddp"), the DistributedSampler
Lightning inserts, validation after every epoch, then trainer.test for the test accuracy.

Same job as `snakemake` with the shipped config (digits_job.py says what is shared). The
Trainer keeps its defaults otherwise, as a user's script would: sanity-check validation,
a checkpoint after every epoch (ddpflow checkpoints every epoch too), the default logger
and progress bar. Lightning is not a ddpflow dependency: bench/install-peers puts it in
bench/.peers-site, and bench/end_to_end.py runs this script with that folder on PYTHONPATH:

    PYTHONPATH=bench/.peers-site .venv/bin/python bench/peers/lightning_digits.py \
        [--job run.json] [--result result.json]

Test accuracy: Lightning's test DistributedSampler pads the 359 test images to 360 (one
repeated), so correct/total summed over ranks counts 360 samples; the result says so.
"""

from __future__ import annotations

import sys

import digits_job
import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class DigitsModule(L.LightningModule):
    def __init__(self, job: dict, model: nn.Module, steps_per_epoch: int):
        super().__init__()
        self.job, self.model, self.steps_per_epoch = job, model, steps_per_epoch
        self.loss_fn = nn.CrossEntropyLoss(label_smoothing=job["train"]["label_smoothing"])
        self.test_counts = torch.zeros(2, dtype=torch.int64)  # correct, total

    def setup(self, stage: str) -> None:
        torch.set_num_threads(self.job["machine"]["cpus_per_task"])  # as ddpflow's ranks

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.model(x)
        acc = (logits.argmax(1) == y).float().mean()
        self.log("val_loss", self.loss_fn(logits, y), sync_dist=True)
        self.log("val_acc", acc, prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.test_counts += torch.tensor([int((self.model(x).argmax(1) == y).sum()), len(y)])

    def on_test_epoch_end(self) -> None:
        self.test_counts = self.trainer.strategy.reduce(self.test_counts, reduce_op="sum")

    def configure_optimizers(self):
        optimizer, scheduler = digits_job.optimizer_and_schedule(
            self.job, self.parameters(), self.steps_per_epoch
        )
        return digits_job.lightning_optimizers(optimizer, scheduler)


def main(argv: list[str] | None = None) -> int:
    args, job = digits_job.command_line(__doc__, argv)
    L.seed_everything(job["train"]["seed"])
    data = digits_job.load_splits(job)
    train_x, train_y = data["train"]
    # per rank: ddpflow's micro-batch, so the global batch is ddpflow's; no short last batch
    batch, eval_batch = digits_job.micro_batch(job), job["eval"]["batch_size"]
    train = DataLoader(
        TensorDataset(train_x, train_y), batch_size=batch, shuffle=True, drop_last=True
    )
    val = DataLoader(TensorDataset(*data["val"]), batch_size=eval_batch)
    test = DataLoader(TensorDataset(*data["test"]), batch_size=eval_batch)
    steps = digits_job.steps_per_epoch(job, len(train_y))
    module = DigitsModule(job, digits_job.build(job, train_x), steps)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=job["machine"]["cpu_ranks_per_node"],
        num_nodes=job["machine"]["nodes"],
        strategy="ddp",
        max_epochs=job["train"]["epochs"],
    )
    trainer.fit(module, train, val)
    trainer.test(module, test, verbose=False)
    correct, counted = (int(n) for n in module.test_counts)
    if trainer.is_global_zero:
        print(f"test accuracy {correct / counted:.4f} ({counted} samples counted)")
        if args.result:
            digits_job.write_result(
                args.result,
                peer="lightning",
                lightning=L.__version__,
                test_accuracy=correct / counted,
                test_samples=len(data["test"][1]),
                test_samples_counted=counted,
                train_samples=len(train_y),
                epochs=trainer.current_epoch,
                world_size=trainer.world_size,
                steps=trainer.global_step,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
