"""A Lightning ``Trainer(strategy="ddp")`` script, unchanged: ``paratrain run`` launches it as torchrun
would, and Lightning takes the processes it finds (tests/cli/test_third_party_scripts.py)."""

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
module = Regression()
trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_steps=3, logger=False,
                    enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(module, DataLoader(data, batch_size=8))
checksum = sum(float(p.detach().double().sum()) for p in module.parameters())
print(f"RANK {trainer.global_rank} WORLD {trainer.world_size} CHECKSUM {checksum:.12e}", flush=True)
