"""A hand-written one-process script, as a user writes it: scikit-learn's digits, an MLP, SGD.

One optimizer step, then the test accuracy. ``benchmarks/startup.py`` times it as a whole process
against ``paratrain train --max-steps 1`` on the same task.
"""

import torch
from sklearn.datasets import load_digits
from torch import nn

torch.manual_seed(0)
x, y = load_digits(return_X_y=True)
x = torch.tensor(x, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
y = torch.tensor(y)
perm = torch.randperm(len(y))
test, train = perm[:359], perm[359:]
mean, std = x[train].mean(), x[train].std()
x = (x - mean) / std
model = nn.Sequential(nn.Flatten(), nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x[train], y[train]), batch_size=64, shuffle=True)
for xb, yb in loader:
    opt.zero_grad()
    nn.functional.cross_entropy(model(xb), yb).backward()
    opt.step()
    break
with torch.no_grad():
    acc = (model(x[test]).argmax(1) == y[test]).float().mean().item()
print(f"test accuracy {acc:.4f}")
