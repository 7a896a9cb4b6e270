"""DDP's own failures in one line that names paratrain's option or the cause (issue 27, item 3).

torch's unused-parameter error is a paragraph that tells the user to pass
``find_unused_parameters=True`` to a ``DistributedDataParallel`` they never constructed; its check
that every rank has the same model says ``params[0] ... appears not to match``. Each is tested at
world size 2 over gloo, through ``paratrain.launch`` (whose ``LaunchError`` carries the worker's
exception line) and, for the unused parameters, through ``paratrain run`` (torchrun).
"""

from __future__ import annotations

import re

import pytest
import torch

import paratrain
from paratrain.launch.spawn import LaunchError
from paratrain.strategies.ddp import (DDPModelError, explain_model_mismatch, explain_unused_parameters,
                                      reduced_parameter_names)

pytestmark = pytest.mark.timeout(180)

OPTION = 'ddp={"find_unused_parameters": True}'


class _TwoHeads(torch.nn.Module):
    """``unused`` never takes part in the loss."""

    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.unused = torch.nn.Linear(4, 2)
        self.head = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(x)))


def _train_with_an_unused_layer(local_rank: int, ddp: dict) -> list[torch.Tensor]:
    torch.manual_seed(0)
    pt = paratrain.Parallel(strategy="ddp", global_batch=4, ddp=ddp)
    net = _TwoHeads()
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    for _ in range(3):  # DDP notices the missing gradients at the second forward
        opt.zero_grad()
        pt.backward(model(torch.randn(2, 4)).pow(2).mean())
        opt.step()
    pt.close()
    return [p.detach() for p in net.parameters()]


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


def test_unused_parameters_name_the_parameters_and_paratrains_option():
    with pytest.raises(LaunchError) as caught:
        paratrain.launch(_train_with_an_unused_layer, nprocs=2, args=({},), timeout=120)
    line = _one_line(caught.value)
    assert re.search(r"rank \d failed: [\w.]*DDPModelError: parameters unused\.weight, unused\.bias got no gradient in the "
                     r"previous backward on rank \d", line), line
    assert OPTION in line and "DistributedDataParallel" not in line, line


def test_the_option_it_names_fixes_it():
    ranks = paratrain.launch(_train_with_an_unused_layer, nprocs=2, args=({"find_unused_parameters": True},),
                             timeout=120)
    assert all(torch.equal(a, b) for a, b in zip(*ranks))


def _build_a_rank_dependent_model(local_rank: int, what: str) -> None:
    pt = paratrain.Parallel(strategy="ddp", global_batch=4)
    if what == "count":  # rank 1 has one more layer
        net: torch.nn.Module = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(1 + pt.rank)])
    else:  # a size computed from the rank
        net = torch.nn.Sequential(torch.nn.Linear(4, 3 + pt.rank), torch.nn.Linear(3 + pt.rank, 2))
    pt.setup(net)


def test_a_different_number_of_parameters_on_another_rank_is_named():
    with pytest.raises(LaunchError) as caught:
        paratrain.launch(_build_a_rank_dependent_model, nprocs=2, args=("count",), timeout=120)
    line = _one_line(caught.value)
    assert re.search(r"[\w.]*DDPModelError: the model differs between ranks: rank (\d) has (2|4) trainable parameter "
                     r"tensors, rank \d has (2|4); DDP needs the same model on every rank", line), line


def test_a_parameter_of_another_shape_on_another_rank_is_named():
    with pytest.raises(LaunchError) as caught:
        paratrain.launch(_build_a_rank_dependent_model, nprocs=2, args=("shape",), timeout=120)
    line = _one_line(caught.value)
    # rank 0 only broadcasts the shapes; rank 1 compares and fails (rank 0 then loses its peer)
    assert re.search(r"rank 1 failed: [\w.]*DDPModelError: the model differs between ranks: parameter 0\.weight has shape "
                     r"\[4, 4\] on rank 1 but another on rank 0; DDP needs the same model", line), line


# torch's texts (2.13): what the translations read
_TORCH_UNUSED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. This error indicates that "
    "your module has parameters that were not used in producing loss. You can enable unused parameter detection by "
    "passing the keyword argument `find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by "
    "\nmaking sure all `forward` function outputs participate in calculating loss. \nIf you already have done the above, "
    "then the distributed data parallel module wasn't able to locate the output tensors in the return value of your "
    "module's `forward` function. Please include the loss function and the structure of the return value of `forward` "
    "of your module when reporting this issue (e.g. list, dict, iterable).\n{names}Parameter indices which did not "
    "receive grad for rank 1: 2 3\n In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to "
    "either INFO or DETAIL to print out information about which particular parameters did not receive gradient on "
    "this rank as part of this error")


class _FakeDDP:
    def __init__(self, find_unused: bool) -> None:
        self.module = _TwoHeads()
        self.find_unused_parameters = find_unused
        self.parameters_to_ignore: set[str] = set()


def test_translations_read_torchs_texts():
    assert reduced_parameter_names(_TwoHeads()) == ["body.weight", "body.bias", "unused.weight", "unused.bias",
                                                    "head.weight", "head.bias"]
    why = explain_unused_parameters(RuntimeError(_TORCH_UNUSED.format(names="")), _FakeDDP(False))  # type: ignore[arg-type]
    assert isinstance(why, DDPModelError) and isinstance(why, ValueError) and isinstance(why, RuntimeError)
    assert str(why).startswith("parameters unused.weight, unused.bias got no gradient in the previous backward on "
                               "rank 1") and OPTION in _one_line(why)
    # the option is on already: then an output of forward took no part in the loss
    why = explain_unused_parameters(RuntimeError(_TORCH_UNUSED.format(names="")), _FakeDDP(True))  # type: ignore[arg-type]
    assert why is not None and "find_unused_parameters on: an output of forward" in _one_line(why)
    assert explain_unused_parameters(RuntimeError("Timed out"), _FakeDDP(False)) is None  # type: ignore[arg-type]
    count = RuntimeError("DDP expects same model across all ranks, but Rank 1 has 4 params, while rank 0 has "
                         "inconsistent 2 params.")
    why = explain_model_mismatch(count, _TwoHeads())
    assert why is not None and _one_line(why).startswith("the model differs between ranks: rank 1 has 4 trainable "
                                                         "parameter tensors, rank 0 has 2")
    shape = RuntimeError("[1]: params[4] in this process with sizes [3, 4] appears not to match sizes of the same "
                         "param in process 0.")
    why = explain_model_mismatch(shape, _TwoHeads())
    assert why is not None and "parameter head.weight has shape [3, 4] on this rank but another on rank 0" in str(why)
    assert explain_model_mismatch(RuntimeError("something else"), _TwoHeads()) is None


_SCRIPT = """
import torch
import paratrain

class TwoHeads(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.unused, self.head = torch.nn.Linear(4, 4), torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.body(x))

pt = paratrain.Parallel(strategy="ddp", global_batch=4)
net = TwoHeads()
model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
for _ in range(3):
    opt.zero_grad()
    pt.backward(model(torch.randn(2, 4)).sum())
    opt.step()
"""


def test_paratrain_run_shows_the_one_line(tmp_path):
    from clitools import run_cli

    script = tmp_path / "unused.py"
    script.write_text(_SCRIPT)
    out = run_cli(["run", "--nproc-per-node", "2", str(script)], timeout=150, cwd=tmp_path)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert re.search(r"failed .*: [\w.]*DDPModelError: parameters unused\.weight, unused\.bias got no gradient", last), \
        out.stderr[-3000:]
    assert OPTION in last, last
