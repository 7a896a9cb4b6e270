"""An Accelerate loop (``Accelerator().prepare``), unchanged: ``paratrain run`` launches it as
``accelerate launch`` or torchrun would (tests/cli/test_third_party_scripts.py); it ends with
``end_training()``, as Accelerate's examples do."""

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader, TensorDataset

accelerator = Accelerator(cpu=True)
torch.manual_seed(0)
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
for x, y in loader:
    accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
    optimizer.step()
    optimizer.zero_grad()
checksum = sum(float(p.detach().double().sum()) for p in model.parameters())
print(f"RANK {accelerator.process_index} WORLD {accelerator.num_processes} CHECKSUM {checksum:.12e}", flush=True)
accelerator.end_training()
