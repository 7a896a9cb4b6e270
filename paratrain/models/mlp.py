"""A multilayer perceptron: flatten -> Linear -> ReLU -> Linear."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """The network: ``flatten -> Linear(in_features, hidden) -> ReLU -> Linear(hidden, K)``.

    Classic tutorials return ``log_softmax`` outputs and trained with ``NLLLoss``; that is
    ``log_softmax=True`` here. The default ``False`` returns raw logits, for ``CrossEntropyLoss``
    (which equals ``NLLLoss`` on ``log_softmax``, so both train the same model).

    Every layer is a child module (``flatten``, ``fc1``, ``relu``, ``fc2``) and the default
    forward calls them in that order, so ``pipeline`` and ``devices`` can cut the model between
    any two of them. With ``log_softmax=True`` the forward adds a step outside the children, and
    those strategies refuse it. The ``state_dict`` keys are ``fc1.*`` and ``fc2.*`` either way.
    """

    def __init__(
        self,
        in_features: int = 784,
        hidden: int = 512,
        num_classes: int = 10,
        log_softmax: bool = False,
    ) -> None:
        super().__init__()
        if in_features < 1 or hidden < 1 or num_classes < 1:
            raise ValueError(
                f"MLP sizes must be >= 1: in_features={in_features}, hidden={hidden}, "
                f"num_classes={num_classes}"
            )
        self.log_softmax = log_softmax
        self.flatten = nn.Flatten()  # (N, *) -> (N, in_features), as torch.flatten(x, 1)
        self.fc1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        out = self.fc2(self.relu(self.fc1(self.flatten(x))))
        return torch.log_softmax(out, dim=1) if self.log_softmax else out
