"""Your own loop under ``Parallel``: model outputs of any type, schedulers, dict batches, your own
DataLoader, metrics — the things an Accelerate or Fabric user's loop does (issue 10)."""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections import OrderedDict, namedtuple

import pytest
import torch
from torch import nn

import paratrain

Pair = namedtuple("Pair", ["logits", "hidden"])


@dataclasses.dataclass
class Output:
    loss: torch.Tensor
    logits: torch.Tensor
    name: str = "out"


class AttrDict(OrderedDict):
    """What HuggingFace's ``ModelOutput`` is: an OrderedDict whose keys are also attributes."""

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        super().__setattr__(key, value)

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None


class AnyOutput(nn.Module):
    """A linear model that returns its output in the container ``kind`` names."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 3)

    def forward(self, x, labels=None):
        logits = self.lin(x)
        loss = logits.float().logsumexp(1).mean()  # any scalar that depends on the weights
        ids = torch.arange(len(x))
        if self.kind == "tensor":
            return logits
        if self.kind == "tuple":
            return logits, ids, "tag"
        if self.kind == "list":
            return [logits, ids]
        if self.kind == "dict":
            return {"loss": loss, "logits": logits, "ids": ids, "note": "kept"}
        if self.kind == "ordered":
            return OrderedDict(loss=loss, logits=logits)
        if self.kind == "attrdict":
            out = AttrDict()
            out["loss"], out["logits"] = loss, logits
            return out
        if self.kind == "dataclass":
            return Output(loss, logits)
        if self.kind == "namedtuple":
            return Pair(logits, (logits, ids))
        raise ValueError(self.kind)


KINDS = ["tensor", "tuple", "list", "dict", "ordered", "attrdict", "dataclass", "namedtuple"]


def _collect(obj):
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclasses.is_dataclass(obj):
        obj = [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    if isinstance(obj, dict):
        obj = list(obj.values())
    return [t for o in obj for t in _collect(o)] if isinstance(obj, (list, tuple)) else []


@pytest.mark.parametrize("precision", ["32", "bf16-mixed", "fp16-mixed", "bf16-true"])
def test_outputs_keep_their_type(precision):
    """Every container comes back as the same type; floating tensors in fp32 under autocast;
    integers, strings and attributes untouched; backward works through ``out.loss``."""
    pt = paratrain.Parallel(precision=precision, global_batch=4)
    for kind in KINDS:
        model = AnyOutput(kind)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        model, opt = pt.setup(model, opt)
        out = model(torch.randn(4, 4))
        assert type(out) is {"tensor": torch.Tensor, "tuple": tuple, "list": list, "dict": dict,
                             "ordered": OrderedDict, "attrdict": AttrDict, "dataclass": Output,
                             "namedtuple": Pair}[kind], kind
        for t in _collect(out):
            assert t.dtype in (torch.float32, torch.int64), (kind, t.dtype)
        if kind == "tuple":
            assert out[2] == "tag" and out[1].dtype == torch.int64
        if kind == "dict":
            assert out["note"] == "kept" and torch.equal(out["ids"], torch.arange(4))
        if kind == "namedtuple":
            assert isinstance(out.hidden, tuple) and out.hidden[1].dtype == torch.int64
        if kind == "dataclass":
            assert out.name == "out"
        if kind in ("attrdict", "dataclass"):
            before = model.lin.weight.detach().clone()
            opt.zero_grad()
            pt.backward(out.loss)
            opt.step()
            assert not torch.equal(before, model.lin.weight.detach()), kind
    pt.close()


def test_huggingface_model_output_keeps_its_type():
    """A real ``transformers`` ``ModelOutput`` (OrderedDict + dataclass) survives bf16-mixed."""
    modeling_outputs = pytest.importorskip("transformers.modeling_outputs")

    class HF(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            logits = self.lin(x)
            return modeling_outputs.SequenceClassifierOutput(loss=logits.logsumexp(1).mean(), logits=logits)

    pt = paratrain.Parallel(precision="bf16-mixed", global_batch=4)
    model = pt.setup(HF())
    out = model(torch.randn(4, 4))
    assert type(out) is modeling_outputs.SequenceClassifierOutput
    assert out.logits.dtype == torch.float32 and out["logits"] is out.logits and out.loss.dtype == torch.float32
    assert out.hidden_states is None and list(out.keys()) == ["loss", "logits"]
    pt.backward(out.loss)
    assert model.lin.weight.grad is not None
    pt.close()


# --- schedulers ---------------------------------------------------------------------------------
N, B, SEED = 48, 8, 5  # 6 optimizer steps per epoch


def regression_data(dtype=torch.float64):
    """Learnable (a noisy linear map): a well-conditioned problem for exact comparisons."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, 4, generator=g, dtype=dtype)
    y = x @ torch.randn(4, 2, generator=g, dtype=dtype) + 0.01 * torch.randn(N, 2, generator=g, dtype=dtype)
    return x, y


def make_scheduler(opt):
    warmup = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.25, total_iters=3)
    decay = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warmup, decay], milestones=[3])


def reference_run(epochs):
    """Plain PyTorch: one optimizer step and one scheduler step per global batch of B samples."""
    x, y = regression_data()
    torch.manual_seed(SEED)
    model = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = make_scheduler(opt)
    lrs = []
    for epoch in range(epochs):
        perm = paratrain.data.epoch_permutation(N, SEED, epoch)
        for s in range(N // B):
            i = perm[s * B:(s + 1) * B]
            opt.zero_grad()
            nn.functional.mse_loss(model(x[i]), y[i]).backward()
            opt.step()
            sched.step()
            lrs.append(opt.param_groups[0]["lr"])
    return model.state_dict(), lrs


def paratrain_run(pattern, epochs, accumulation=2, checkpoint=None, resume=None):
    pt = paratrain.Parallel(global_batch=B, accumulation=accumulation, seed=SEED)
    torch.manual_seed(SEED)
    model = nn.Linear(4, 2).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    if pattern == "setup":  # built on the user's optimizer, handed to setup, stepped by the user
        model, opt, sched = pt.setup(model, opt, make_scheduler(opt))
    else:  # built on the optimizer setup returns
        model, opt = pt.setup(model, opt)
        sched = make_scheduler(opt)
        if pattern == "register":
            pt.register_scheduler(sched)
    if resume:
        pt.load_checkpoint(resume, model, opt)
    loader = pt.train_loader(torch.utils.data.TensorDataset(*regression_data()))
    lrs = []
    while pt.global_step < epochs * (N // B):
        for xb, yb in loader:
            opt.zero_grad()
            pt.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step()
            if pattern != "register":
                sched.step()  # after every optimizer.step(): once per micro-batch
            if pt.micro_step == 0:
                lrs.append(opt.param_groups[0]["lr"])
                if checkpoint and pt.global_step == checkpoint[1]:
                    pt.save_checkpoint(checkpoint[0], model, opt)
    state = {k: v.clone() for k, v in pt.unwrap(model).state_dict().items()}
    pt.close()
    return state, lrs, sched


def assert_states_equal(got, ref, rtol):
    assert got.keys() == ref.keys()
    for k in ref:
        err = ((got[k] - ref[k]).norm() / ref[k].norm()).item()
        assert err <= rtol, f"{k}: relative error {err:.1e}"


@pytest.mark.parametrize("edit", ["clip", "zero_grad", None, "clip at the last micro-step"])
def test_gradients_edited_between_micro_steps_are_reported_once(edit):
    # clip_grad_norm_ in the loop body with accumulation > 1 clips partial gradients: the result
    # then depends on the accumulation, hence on the world size
    pt = paratrain.Parallel(global_batch=8, accumulation=2)
    net = nn.Linear(4, 2, dtype=torch.float64)
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for xb, yb in pt.train_loader(torch.utils.data.TensorDataset(*regression_data())):
            opt.zero_grad()
            pt.backward(nn.functional.mse_loss(model(xb), yb))
            if edit == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            elif edit == "zero_grad":
                model.zero_grad()
            elif edit is not None and pt.micro_step == pt.accumulation:  # the whole global batch's gradients
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
    messages = [str(w.message) for w in caught]
    if edit in ("clip", "zero_grad"):
        assert len(messages) == 1 and messages[0].startswith("gradients changed between micro-batches 1 and 2")
        assert caught[0].filename == __file__  # points at the loop
    else:
        assert messages == []


def test_scheduler_accepts_setup_optimizer_without_warnings():
    pt = paratrain.Parallel(global_batch=4)
    model, opt = pt.setup(net := nn.Linear(4, 2), torch.optim.SGD(net.parameters(), lr=0.1))
    assert isinstance(opt, torch.optim.Optimizer)
    for build in (lambda o: torch.optim.lr_scheduler.StepLR(o, 2), lambda o: torch.optim.lr_scheduler.OneCycleLR(o, 1.0, 10),
                  lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10), make_scheduler,
                  lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o)):
        build(opt)
    pt.close()


@pytest.mark.parametrize("pattern", ["setup", "register"])
def test_scheduler_steps_once_per_optimizer_step(pattern, recwarn):
    """accumulation=2, world size 1: the scheduler follows the optimizer steps, not the micro-batches,
    and the run equals plain PyTorch (float64: 1e-10), with no ordering warning."""
    ref, ref_lrs = reference_run(epochs=2)
    got, lrs, sched = paratrain_run(pattern, epochs=2)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12)
    assert sched.last_epoch == 12
    assert_states_equal(got, ref, 1e-10)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "learning rate" in str(w.message)]


def test_scheduler_built_on_the_setup_optimizer_follows_its_steps(recwarn):
    """A scheduler built on the optimizer setup returns, not given to setup, and stepped after every
    optimizer.step() under accumulation: it steps once per optimizer step, as plain PyTorch does
    (issue 27, item 4; more schedulers and world size 2: tests/test_wrappers.py)."""
    ref, ref_lrs = reference_run(epochs=2)
    got, lrs, sched = paratrain_run("user", epochs=2)
    assert lrs == pytest.approx(ref_lrs, rel=1e-12) and sched.last_epoch == 12
    assert_states_equal(got, ref, 1e-10)
    assert not [w for w in recwarn if "lr_scheduler" in str(w.message) or "learning rate" in str(w.message)]


def test_an_lr_moved_mid_accumulation_is_reported():
    """An lr the loop moves itself between the micro-steps of a global batch: one warning says how to fix it."""
    pt = paratrain.Parallel(global_batch=4, accumulation=2)
    net = nn.Linear(4, 2)
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
    with pytest.warns(UserWarning, match="changed in the middle of an accumulation"):
        for _ in range(2):
            opt.zero_grad()
            pt.backward(model(torch.ones(2, 4)).sum())
            opt.step()
            opt.param_groups[0]["lr"] *= 0.5  # a schedule of the loop's own, per micro-batch
    pt.close()


def _own_scaler_run(use_pt: bool, tmp_path=None):
    """A loop with its own GradScaler (a start scale of 4 here), a scheduler stepped every
    batch, and an inf loss at batch 1, which the scaler answers by not calling optimizer.step()."""
    torch.manual_seed(0)
    model = nn.Linear(4, 1).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5)
    pt = None
    if use_pt:
        pt = paratrain.Parallel(global_batch=8)
        model, opt, sched = pt.setup(model, opt, sched)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    g = torch.Generator().manual_seed(1)
    for i in range(4):
        x = torch.randn(8, 4, generator=g, dtype=torch.float64)
        opt.zero_grad()
        loss = model(x).pow(2).mean() * (float("inf") if i == 1 else 1.0)
        if pt is not None:
            pt.backward(scaler.scale(loss))
        else:
            scaler.scale(loss).backward()
        if i == 2:  # unscaled by the loop itself, to clip
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
        scaler.step(opt)
        scaler.update()
        sched.step()
        if pt is not None and i == 1:
            pt.save_checkpoint(str(tmp_path), model, opt)  # right after the skipped step: not mid-accumulation
    return model, opt, pt


def test_own_grad_scaler_skipping_a_step(tmp_path):
    """A loop that keeps its own GradScaler: a step it skips for inf gradients ends the global
    batch as a skipped step (it used to leave the batch open: the next backward failed), a step it
    unscaled itself (to clip) is not unscaled twice, and weights, lr and momentum equal plain
    PyTorch's (float64). With accumulation the GradScaler is refused in one line."""
    ref_model, ref_opt, _ = _own_scaler_run(False)
    model, opt, pt = _own_scaler_run(True, tmp_path)
    assert pt.global_step == 4 and pt.skipped_steps == 1
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.1 * 0.5 ** 4
    assert_states_equal(pt.unwrap(model).state_dict(), ref_model.state_dict(), 1e-12)
    for p, q in zip(pt.unwrap(model).parameters(), ref_model.parameters()):
        torch.testing.assert_close(opt.state[p]["momentum_buffer"], ref_opt.state[q]["momentum_buffer"])
    assert os.listdir(tmp_path)
    pt.close()
    pt = paratrain.Parallel(global_batch=8, accumulation=2)
    model, opt = pt.setup(net := nn.Linear(4, 1), torch.optim.SGD(net.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    pt.backward(scaler.scale(model(torch.ones(4, 4)).sum()))
    with pytest.raises(ValueError, match="your own GradScaler with accumulation 2: .*precision='fp16-mixed'"):
        scaler.step(opt)
    pt.close()


@pytest.mark.parametrize("pattern", ["setup", "register"])
def test_scheduler_state_resumes_exactly(pattern, tmp_path):
    ref, ref_lrs = reference_run(epochs=2)
    paratrain_run(pattern, epochs=1, checkpoint=(tmp_path, 5))  # saved at step 5, mid-epoch
    got, lrs, sched = paratrain_run(pattern, epochs=2, resume=tmp_path)
    assert lrs == pytest.approx(ref_lrs[5:], rel=1e-12)
    assert sched.last_epoch == 12
    assert_states_equal(got, ref, 1e-10)


# --- dict batches, evaluate, metrics -----------------------------------------------------------
class DictData(torch.utils.data.Dataset):
    """HuggingFace-style samples: a dict with the inputs, the labels and a string."""

    def __init__(self, n, classes=3, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 4, generator=g, dtype=dtype)
        self.y = (self.x @ torch.randn(4, classes, generator=g, dtype=dtype)).argmax(1)  # learnable

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"features": self.x[i], "labels": self.y[i], "id": f"s{i}"}


class KwargsModel(nn.Module):
    """Takes the batch as keyword arguments; computes its loss when given labels (like HF)."""

    def __init__(self, classes=3):
        super().__init__()
        self.lin = nn.Linear(4, classes)

    def forward(self, features, labels=None, id=None, **extra):
        logits = self.lin(features)
        out = OrderedDict(logits=logits)
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits.float(), labels)
            out.move_to_end("loss", last=False)
        return out


def plain_eval(state, data):
    net = KwargsModel()
    net.load_state_dict(state)
    with torch.no_grad():
        logits = net.lin(data.x)
    return nn.functional.cross_entropy(logits, data.y).item(), (logits.argmax(1) == data.y).float().mean().item()


def test_dict_batches_train_and_evaluate():
    pt = paratrain.Parallel(global_batch=8, accumulation=2, precision="bf16-mixed")
    net = KwargsModel()
    model, opt = pt.setup(net, torch.optim.SGD(net.parameters(), lr=0.5))
    loader = pt.train_loader(DictData(32))
    for batch in loader:
        assert isinstance(batch, dict) and batch["features"].shape == (4, 4) and len(batch["id"]) == 4
        opt.zero_grad()
        out = model(**batch)
        pt.backward(out["loss"])
        opt.step()
    pt.training_step(model, next(iter(loader)))  # a dict batch through training_step: the model's loss
    opt.step()
    eval_set = DictData(11, seed=1)
    ref_loss, ref_acc = plain_eval(pt.unwrap(model).state_dict(), eval_set)
    got = pt.evaluate(model, pt.eval_loader(eval_set, batch_size=4))  # the model's own loss (labels in the batch)
    assert got["count"] == 11 and got["accuracy"] == pytest.approx(ref_acc)
    assert got["loss"] == pytest.approx(ref_loss, rel=2e-2)  # bf16 forward: a few bf16 ulps

    def step_fn(net, batch):  # the user says how a batch becomes (predictions, targets)
        return net(batch["features"])["logits"], batch["labels"]

    got = pt.evaluate(model, pt.eval_loader(eval_set, batch_size=4), step_fn=step_fn)
    assert got["accuracy"] == pytest.approx(ref_acc) and got["loss"] == pytest.approx(ref_loss, rel=2e-2)
    got = pt.evaluate(model, pt.eval_loader(eval_set, batch_size=4), step_fn=lambda net, b: net(**b)["loss"])
    assert set(got) == {"loss", "count"} and got["loss"] == pytest.approx(ref_loss, rel=2e-2)
    pt.close()


def test_evaluate_reports_what_the_task_has():
    """A regressor gets its MSE and no accuracy; metric functions are averaged over samples;
    integer targets with logits get accuracy."""
    x, y = regression_data(torch.float32)
    pt = paratrain.Parallel(global_batch=8)
    model = pt.setup(nn.Linear(4, 2))
    loader = pt.eval_loader(torch.utils.data.TensorDataset(x, y), batch_size=5)
    got = pt.evaluate(model, loader, metrics={"mae": lambda p, t: (p - t).abs().mean()})
    with torch.no_grad():
        pred = pt.unwrap(model)(x)
    assert set(got) == {"loss", "count", "mae"} and got["count"] == N
    assert got["loss"] == pytest.approx(nn.functional.mse_loss(pred, y).item(), rel=1e-5)
    assert got["mae"] == pytest.approx((pred - y).abs().mean().item(), rel=1e-5)
    labels = torch.randint(0, 2, (N,))
    got = pt.evaluate(model, pt.eval_loader(torch.utils.data.TensorDataset(x, labels), batch_size=5))
    assert got["accuracy"] == pytest.approx((pred.argmax(1) == labels).float().mean().item())
    pt.close()


def test_the_epoch_loop_resumes_from_the_loader_epoch():
    pt = paratrain.Parallel(global_batch=8)
    loader = pt.train_loader(torch.utils.data.TensorDataset(*regression_data()))
    per_epoch = loader.steps_per_epoch
    assert per_epoch > 2 and loader.epoch == 0
    pt.global_step = per_epoch + 1  # what load_checkpoint restores: one step into the second epoch
    assert loader.epoch == 1 and len(loader) == per_epoch - 1
    steps = 0
    for _epoch in range(loader.epoch, 3):  # the README's loop, resumed
        for _ in loader:
            pt.global_step += 1  # what optimizer.step() does at the end of each global batch
            steps += 1
    assert steps == 3 * per_epoch - (per_epoch + 1) and loader.epoch == 3
    pt.close()


def test_training_step_gives_a_dict_output_to_the_users_loss_and_its_logits_to_cross_entropy():
    class AuxNet(nn.Module):  # logits plus an auxiliary loss, as some user models return
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def forward(self, x):
            logits = self.fc(x)
            return {"logits": logits, "aux": logits.pow(2).mean()}

    pt = paratrain.Parallel(global_batch=4)
    model = pt.setup(AuxNet())
    x, y = torch.randn(4, 4), torch.tensor([0, 1, 2, 0])
    with torch.no_grad():
        out = pt.unwrap(model)(x)
    own = pt.training_step(model, (x, y), lambda out, y: nn.functional.cross_entropy(out["logits"], y) + out["aux"])
    assert own.item() == pytest.approx((nn.functional.cross_entropy(out["logits"], y) + out["aux"]).item())
    pt.micro_step = 0
    default = pt.training_step(model, (x, y))
    assert default.item() == pytest.approx(nn.functional.cross_entropy(out["logits"], y).item())
    pt.close()


def test_setup_refuses_arguments_of_the_wrong_kind_at_once():
    pt = paratrain.Parallel(global_batch=4)
    net = nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    with pytest.raises(TypeError, match="the scheduler 'cosine' is not an LR scheduler"):
        pt.setup(net, opt, "cosine")
    with pytest.raises(TypeError, match=r"the optimizer is a StepLR, not a torch.optim.Optimizer \(a scheduler\?"):
        pt.setup(net, torch.optim.lr_scheduler.StepLR(opt, 1))
    with pytest.raises(TypeError, match="the model is a list, not a torch.nn.Module"):
        pt.setup([net], opt)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(8, 2)), batch_size=2)
    with pytest.raises(TypeError, match=r"the scheduler is a DataLoader: .* pass the loader to pt.train_loader\(loader\)"):
        pt.setup(net, opt, loader)  # Accelerate's prepare(model, optimizer, loader)
    pt.close()


def test_token_logits_whose_vocabulary_equals_the_length_get_no_accuracy():
    from paratrain.metrics import is_classification

    tokens = torch.randint(0, 5, (2, 5))
    assert not is_classification(torch.randn(2, 5, 5), tokens)  # (N, T, V) with V == T: ambiguous
    assert not is_classification(torch.randn(2, 5, 7), tokens)  # a language model's (N, T, V)
    assert is_classification(torch.randn(2, 7, 5), tokens)  # (N, C, d1), as cross_entropy reads it
    assert is_classification(torch.randn(2, 3), torch.tensor([0, 2]))


def test_all_gather_and_reduce_in_one_process():
    pt = paratrain.Parallel(global_batch=8)
    assert torch.equal(pt.all_gather(torch.arange(3)), torch.arange(3))
    assert pt.all_gather({"a": 1}) == [{"a": 1}]
    assert pt.reduce(torch.tensor(3.0), "sum").item() == 3.0 and pt.reduce(2, "mean").item() == 2.0
    pt.close()


# --- your own DataLoader ----------------------------------------------------------------------
def tag_collate(samples):
    """A user's collate_fn: default collation, plus which worker ran it and whether its
    worker_init_fn ran first."""
    batch = torch.utils.data.default_collate(samples)
    info = torch.utils.data.get_worker_info()
    batch["worker"] = -1 if info is None else info.id
    batch["init"] = os.environ.get("PT_TEST_WORKER_INIT") == "1"
    return batch


def mark_worker(worker_id):
    os.environ["PT_TEST_WORKER_INIT"] = "1"


def test_own_dataloader_keeps_its_settings(recwarn):
    pt = paratrain.Parallel(global_batch=16, seed=SEED)
    data = DictData(40)
    user = torch.utils.data.DataLoader(data, batch_size=16, shuffle=True, collate_fn=tag_collate, num_workers=1,
                                       worker_init_fn=mark_worker, persistent_workers=True)
    loader = pt.train_loader(user)
    dl = loader.dataloader
    assert (dl.dataset.dataset, dl.collate_fn, dl.num_workers, dl.worker_init_fn, dl.persistent_workers) == \
        (data, tag_collate, 1, mark_worker, True)  # its dataset, each sample's random draws seeded (SeededSamples)
    perm = paratrain.data.epoch_permutation(40, SEED, 0)
    batches = list(loader)
    assert len(batches) == 2  # 40 // 16, the tail dropped
    for s, batch in enumerate(batches):
        assert batch["id"] == [f"s{i}" for i in perm[16 * s:16 * (s + 1)]]  # paratrain's order, the loader's collate
        assert batch["worker"] == 0 and batch["init"] is True
    assert not [w for w in recwarn if "train_loader" in str(w.message)]
    with pytest.warns(UserWarning, match="batch_size 5 is replaced by the micro-batch 16"):
        pt.train_loader(torch.utils.data.DataLoader(data, batch_size=5))
    in_order = pt.train_loader(torch.utils.data.DataLoader(data, batch_size=16, shuffle=False))
    assert torch.equal(next(iter(in_order))["features"], data.x[:16])
    # batches out of order would make a step's samples depend on the workers' timing: always in order
    any_order = torch.utils.data.DataLoader(data, batch_size=16, num_workers=1, in_order=False)
    assert pt.train_loader(any_order).dataloader.in_order is True
    pt.close()


def test_a_stateful_dataloader_is_read_as_a_dataloader_and_resumes_at_the_global_step(recwarn):
    """torchdata's StatefulDataLoader (issue 37): its shuffle is torch's (its own RandomSampler class, read without a
    warning), and the position its state_dict would hold is paratrain's global step, which the checkpoint restores: a
    run resumed two steps into the epoch reads the batches the uninterrupted run read from there."""
    stateful = pytest.importorskip("torchdata.stateful_dataloader")
    data = DictData(40)

    def ids(start: int) -> list[list[str]]:
        pt = paratrain.Parallel(global_batch=8, seed=SEED)
        loader = pt.train_loader(stateful.StatefulDataLoader(data, batch_size=8, shuffle=True))
        pt.global_step = start  # what load_checkpoint restores
        seen = []
        for batch in loader:
            seen.append(batch["id"])
            pt.global_step += 1  # what optimizer.step() does at the end of each global batch
        pt.close()
        return seen

    whole, resumed = ids(0), ids(2)
    perm = paratrain.data.epoch_permutation(40, SEED, 0)
    assert whole == [[f"s{i}" for i in perm[8 * s:8 * (s + 1)]] for s in range(5)]
    assert resumed == whole[2:]
    assert not [w for w in recwarn if "train_loader" in str(w.message)]


def test_own_dataloader_subset_samplers_keep_their_part_of_the_dataset():
    """A train/val split by SubsetRandomSampler on one dataset: the training reads only the train
    part and the evaluation counts only the val part (both once read the whole dataset)."""
    from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset, WeightedRandomSampler

    pt = paratrain.Parallel(global_batch=8, seed=SEED)
    x = torch.arange(40, dtype=torch.float64).unsqueeze(1)
    data = TensorDataset(x, torch.zeros(40, dtype=torch.long))
    train_ids, val_ids = list(range(0, 40, 4)) + list(range(1, 40, 4)), list(range(2, 40, 4))
    train = pt.train_loader(DataLoader(data, batch_size=8, sampler=SubsetRandomSampler(train_ids)))
    seen = torch.cat([xb[:, 0] for xb, _ in train]).long().tolist()
    assert len(seen) == 16 and set(seen) <= set(train_ids)  # 20 samples: two global batches of 8
    val = pt.eval_loader(DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(val_ids)))
    assert sorted(torch.cat([xb[:, 0] for xb, _ in val]).long().tolist()) == val_ids
    model = pt.setup(nn.Linear(1, 2).double())
    assert pt.evaluate(model, val)["count"] == len(val_ids)

    class EveryOther(torch.utils.data.Sampler):  # a sampler of the user's own: a part, in its order
        def __iter__(self):
            return iter(range(0, 40, 2))

        def __len__(self):
            return 20

    assert pt.evaluate(model, pt.eval_loader(DataLoader(data, sampler=EveryOther())))["count"] == 20
    # a batch sampler's own drop_last does not drop a drawn epoch's tail for good: what it batches counts
    batched = DataLoader(data, batch_sampler=torch.utils.data.BatchSampler(torch.utils.data.RandomSampler(data), 6, True))
    assert pt.train_loader(batched).dataloader.dataset.tensors[0] is x
    rng = torch.get_rng_state()
    with pytest.raises(ValueError, match="WeightedRandomSampler draws some samples more than once an epoch"):
        pt.train_loader(DataLoader(data, batch_size=8, sampler=WeightedRandomSampler([1.0] * 40, 40)))
    assert torch.equal(torch.get_rng_state(), rng)  # reading the sampler's epoch drew from no global generator
    with pytest.raises(ValueError, match="RandomSampler draws 10 of the 40 samples"):
        pt.train_loader(DataLoader(data, batch_size=8, sampler=torch.utils.data.RandomSampler(data, num_samples=10)))
    pt.close()


class HandleData(torch.utils.data.Dataset):
    """Opens a per-worker handle in worker_init_fn (the h5py/lmdb pattern)."""

    def __init__(self):
        self.path, self.handle = "data.bin", None

    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([float(i)]), torch.tensor(0.0 if self.handle is None else 1.0)


def open_handle(worker_id):
    dataset = torch.utils.data.get_worker_info().dataset
    dataset.handle = f"open {dataset.path}"


def test_worker_init_fn_sees_and_sets_the_users_dataset():
    pt = paratrain.Parallel(global_batch=8, seed=SEED)
    loader = pt.train_loader(torch.utils.data.DataLoader(HandleData(), batch_size=8, num_workers=1,
                                                         worker_init_fn=open_handle))
    assert all(bool((opened == 1).all()) for _, opened in loader)
    pt.close()


# --- compiled models -----------------------------------------------------------------------------
def compiled_run(strategy, mode, directory, steps=3):
    """float64 regression, ``mode``: plain, Parallel(compile=True), or torch.compile before or after
    setup (backend "eager": compiling with inductor needs a C++ compiler and minutes on a CPU)."""
    pt = paratrain.Parallel(strategy=strategy, global_batch=8, seed=SEED, compile=(mode == "config"),
                            compile_backend="eager")
    torch.manual_seed(SEED)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    if mode == "before":
        model = torch.compile(model, backend="eager")
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, opt = pt.setup(model, opt)
    if mode == "after":
        model = torch.compile(model, backend="eager")
    for xb, yb in pt.train_loader(torch.utils.data.TensorDataset(*regression_data())):
        opt.zero_grad()
        pt.backward(nn.functional.mse_loss(model(xb), yb))
        opt.step()
        if pt.global_step == steps:
            break
    pt.save_checkpoint(directory, model, opt)
    state = pt.full_state_dict(model)
    # the checkpoint loads into a compiled model and into an uncompiled one alike
    for compile_it in (True, False):
        fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
        fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
        fresh, fresh_opt = pt.setup(torch.compile(fresh, backend="eager") if compile_it else fresh, fresh_opt)
        pt.load_checkpoint(directory, fresh, fresh_opt)
        loaded = pt.full_state_dict(fresh)
        assert all(torch.equal(loaded[k], state[k]) for k in state), (mode, compile_it)
    return state


def test_compiled_models_train_and_checkpoint_uncompiled_keys(tmp_path):
    ref = compiled_run("single", "plain", tmp_path / "plain")
    for mode in ("config", "before", "after"):
        state = compiled_run("single", mode, tmp_path / mode)
        assert_states_equal(state, ref, 1e-10)
        saved = torch.load(next((tmp_path / mode).glob("step-*.pt")), weights_only=True)["model"]
        assert sorted(saved) == sorted(ref)  # no "_orig_mod." anywhere


def test_checkpoint_with_compiled_keys_loads_into_a_plain_model(tmp_path):
    """A checkpoint whose model keys carry ``_orig_mod.`` (saved from a compiled model by an older
    paratrain) loads into an uncompiled model and exports with plain keys."""
    from paratrain.checkpoint import load_file, write_checkpoint
    from paratrain.checkpoint.export import export_checkpoint, load_model

    compiled_run("single", "plain", tmp_path / "plain")
    state = load_file(next((tmp_path / "plain").glob("step-*.pt")))
    plain = dict(state["model"])
    state["model"] = {f"_orig_mod.{k}": v for k, v in plain.items()}
    write_checkpoint(tmp_path / "old", state["global_step"], state)
    pt = paratrain.Parallel(strategy="single", global_batch=8, seed=SEED)
    fresh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    fresh, _ = pt.setup(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))
    pt.load_checkpoint(tmp_path / "old", fresh)
    assert all(torch.equal(pt.full_state_dict(fresh)[k], plain[k]) for k in plain)
    export_checkpoint(tmp_path / "old", tmp_path / "exported")
    assert sorted(load_model(tmp_path / "exported")) == sorted(plain)


# --- the same at world size 2, under ddp and fsdp: one launch each checks everything ---------------
def world2_worker(rank, directory):
    """Every check, under ddp then fsdp: the Parallel objects of one process share its group."""
    reports = {strategy: strategy_checks(rank, strategy, os.path.join(directory, strategy))
               for strategy in ("ddp", "fsdp")}
    reports["auto"] = paratrain.Parallel(global_batch=8).config.strategy  # the default strategy, on 2 processes
    paratrain.destroy(wait_for_peers=True)
    return reports


def strategy_checks(rank, strategy, directory):
    try:
        import torchmetrics
    except ImportError:
        torchmetrics = None
    pt = paratrain.Parallel(strategy=strategy, global_batch=8, accumulation=2, precision="bf16-mixed", seed=SEED)
    report = {}
    # outputs keep their type through DDP/FSDP
    kinds = {}
    for kind in ("dict", "attrdict", "dataclass", "namedtuple"):
        out = pt.setup(AnyOutput(kind))(torch.randn(4, 4))
        kinds[kind] = (type(out).__name__, sorted({str(t.dtype) for t in _collect(out)}))
    report["kinds"] = kinds
    # a scheduler built on the user's optimizer before setup (fsdp rebuilds the optimizer) steps the real one
    net = KwargsModel()
    opt = torch.optim.SGD(net.parameters(), lr=0.5)
    model, opt, sched = pt.setup(net, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5))
    # a DDP script's model.module: the user's module at every world size, keys without "module."
    report["module"] = (model.module is net, sorted(model.module.state_dict()) == sorted(KwargsModel().state_dict()))
    ids = []
    user_loader = torch.utils.data.DataLoader(DictData(32), batch_size=2, shuffle=True, collate_fn=tag_collate)
    with warnings.catch_warnings(record=True) as caught:  # accumulation 2, nothing edits gradients mid-way
        warnings.simplefilter("always")
        for batch in pt.train_loader(user_loader):  # dict batches, model(**batch), out.loss
            ids.append(batch["id"])
            opt.zero_grad()
            pt.backward(model(**batch)["loss"])
            opt.step()
            sched.step()
    report["loop warnings"] = [str(w.message) for w in caught]
    report["ids"] = ids
    report["lr"] = (pt._clock.optimizers[-1].param_groups[0]["lr"], sched.get_last_lr()[0], pt.global_step)
    # evaluation of 5 samples on 2 ranks: shards of 2 and 3, batches of 2 (fsdp pads the short shard)
    eval_set = DictData(5, seed=1)
    metrics = {"acc_fn": lambda p, t: (p.argmax(1) == t).float().mean()}
    if torchmetrics is not None:
        metrics["tm_acc"] = torchmetrics.classification.MulticlassAccuracy(num_classes=3, average="micro")
    report["eval"] = pt.evaluate(model, pt.eval_loader(eval_set, batch_size=2), metrics=metrics)
    # the user's own validation DataLoader: its batch size and collate_fn kept, its sampler sharded
    user_eval = torch.utils.data.DataLoader(eval_set, batch_size=2, collate_fn=tag_collate)
    report["eval of a DataLoader"] = pt.evaluate(model, pt.eval_loader(user_eval), metrics=metrics)
    report["state"] = pt.full_state_dict(model)
    # all_gather of uneven tensors and of objects; reduce
    report["gather"] = pt.all_gather(torch.full((rank + 1, 2), rank)).tolist()
    report["objects"] = pt.all_gather({"rank": rank})
    # a rank with nothing to give (an empty shard's torch.empty(0)) takes the others' shape and dtype
    mine = torch.empty(0) if rank == 0 else torch.tensor([[7, 8]])
    gathered = pt.all_gather(mine)
    report["empty gather"] = (gathered.tolist(), str(gathered.dtype))
    report["reduce"] = (pt.reduce(torch.tensor(rank + 1.0), "sum").item(), pt.reduce(rank, "max").item())
    # compiled models (the process group is shared by the Parallel objects of one process)
    report["compiled"] = {mode: compiled_run(strategy, mode, os.path.join(directory, mode))
                          for mode in ("plain", "config", "before", "after")}
    return report


@pytest.fixture(scope="module")
def world2_reports(tmp_path_factory):
    return paratrain.launch(world2_worker, nprocs=2, args=(str(tmp_path_factory.mktemp("world2")),), timeout=360)


def test_the_default_strategy_is_single_in_one_process_and_ddp_in_several(world2_reports):
    """``strategy="auto"`` (the default), as Lightning's and Accelerate's defaults choose."""
    assert [r["auto"] for r in world2_reports] == ["ddp", "ddp"]
    cfg = paratrain.ParallelConfig
    assert cfg().strategy == "auto" and cfg().for_world(4).strategy == "ddp" and cfg().for_world(1).strategy == "single"
    assert cfg(strategy="fsdp").for_world(4).strategy == "fsdp"
    pt = paratrain.Parallel(global_batch=8)
    assert pt.config.strategy == "single" and pt.describe()["strategy"] == "single"
    pt.close()


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_own_loop_at_world_size_2(strategy, world2_reports):
    reports = [r[strategy] for r in world2_reports]
    for r in reports:
        assert r["kinds"] == {"dict": ("dict", ["torch.float32", "torch.int64"]),
                              "attrdict": ("AttrDict", ["torch.float32"]),
                              "dataclass": ("Output", ["torch.float32"]),
                              "namedtuple": ("Pair", ["torch.float32", "torch.int64"])}
        assert r["lr"] == (0.5 * 0.5 ** 4, 0.5 * 0.5 ** 4, 4)  # 32 samples / 8 = 4 optimizer steps
        assert r["loop warnings"] == []
        assert r["module"] == (True, True)
        assert r["gather"] == [[0, 0], [1, 1], [1, 1]]
        assert r["objects"] == [{"rank": 0}, {"rank": 1}]
        assert r["empty gather"] == ([[7, 8]], "torch.int64")
        assert r["reduce"] == (3.0, 1)
    for step in range(4):  # the user's DataLoader, resampled: each optimizer step holds the global batch
        got_ids = sorted(i for r in reports for i in r["ids"][2 * step] + r["ids"][2 * step + 1])
        assert got_ids == sorted(f"s{i}" for i in paratrain.data.epoch_permutation(32, SEED, 0)[8 * step:8 * step + 8])
    ref_loss, ref_acc = plain_eval(reports[0]["state"], DictData(5, seed=1))
    got = reports[0]["eval"]
    assert got["count"] == 5 and got["accuracy"] == pytest.approx(ref_acc) and got["acc_fn"] == pytest.approx(ref_acc)
    assert got["loss"] == pytest.approx(ref_loss, rel=2e-2)  # bf16 forward
    if "tm_acc" in got:  # torchmetrics synced across ranks by itself
        assert got["tm_acc"] == pytest.approx(ref_acc)
    assert reports[1]["eval"] == got
    assert all(r["eval of a DataLoader"] == got for r in reports)
    ref = reports[0]["compiled"]["plain"]  # compiled or not, the same training
    for r in reports:
        for mode in ("config", "before", "after"):
            assert_states_equal(r["compiled"][mode], ref, 1e-10)


def test_a_stateful_metric_counts_one_evaluation_and_one_logit_is_not_classification():
    from paratrain.metrics import is_classification

    class Count:  # the torchmetrics protocol: update / compute / reset
        def __init__(self):
            self.n = 0

        def update(self, preds, targets):
            self.n += len(targets)

        def compute(self):
            return torch.tensor(float(self.n))

        def reset(self):
            self.n = 0

    pt = paratrain.Parallel(global_batch=8)
    model = pt.setup(nn.Linear(4, 3))
    loader = pt.eval_loader(torch.utils.data.TensorDataset(torch.randn(10, 4), torch.randint(0, 3, (10,))))
    metric = Count()
    assert pt.evaluate(model, loader, metrics={"n": metric})["n"] == 10
    assert pt.evaluate(model, loader, metrics={"n": metric})["n"] == 10  # once 20: never reset
    assert not is_classification(torch.randn(4, 1), torch.tensor([0, 1, 1, 0]))  # a BCE classifier's logit
    assert is_classification(torch.randn(4, 2), torch.tensor([0, 1, 1, 0]))
    pt.close()


def _metrics_under_tensor_parallelism(rank):
    pt = paratrain.Parallel(strategy="tensor", global_batch=4)
    loader = pt.eval_loader(torch.utils.data.TensorDataset(torch.arange(6.0).unsqueeze(1)), batch_size=6)
    seen = torch.cat([x for (x,) in loader])
    out = (pt.all_gather(seen).flatten().tolist(), pt.reduce(len(seen), "sum").item(), pt.reduce(True, "max").item())
    pt.close()
    return out


def test_all_gather_and_reduce_count_a_tensor_parallel_group_once():
    """The ranks of a tp group read the same evaluation shard: gathering over the world once gave
    every sample twice and a sum of twice the count."""
    out = paratrain.launch(_metrics_under_tensor_parallelism, 2, timeout=90)
    assert out == [([0.0, 1.0, 2.0, 3.0, 4.0, 5.0], 6, True)] * 2


class TokenModel(nn.Module):
    """A HuggingFace-style model: a dict batch in, its own token-mean loss out (-100 ignored)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(5, 5)

    def forward(self, input_ids, labels):
        logits = self.emb(input_ids).double()
        return {"loss": nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100),
                "logits": logits}


class TokenSet(torch.utils.data.Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 5, (4, 6), generator=g)
        self.labels = self.ids.clone()
        self.labels[0, 1:] = -100  # one counted token in the first sequence, six in the others
        self.labels[3, :] = -100  # none in the last

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def test_evaluation_loss_is_a_mean_over_the_tokens_that_count_at_any_batch_size():
    """A token-mean loss was weighted by sequences, so the evaluation loss changed with how batches
    were cut (the world size); a batch with no counted token made it NaN."""
    pt = paratrain.Parallel(global_batch=4)
    torch.manual_seed(0)
    model = pt.setup(TokenModel())
    data = TokenSet()
    out = model(input_ids=data.ids, labels=data.labels)
    expected = out["loss"].item()  # the mean over all 13 counted tokens at once
    for batch_size in (1, 2, 3):
        result = pt.evaluate(model, pt.eval_loader(data, batch_size=batch_size))
        assert result["loss"] == pytest.approx(expected, rel=1e-12), batch_size
    pt.close()


def reach_throughs(root):
    """``file:line`` of every place in ``root/paratrain`` (outside ``parallel.py``) that reaches through a
    ``Parallel`` (``pt`` or ``self.pt``) into its parts (``pt.strategy.x``, ``pt.plan.x``, ``pt.dist.x``,
    ``pt.precision.x``), or into its private state (``pt._x``): issue 25, library code uses its face."""
    import ast

    parts = {"strategy", "plan", "dist", "precision", "config"}

    def is_pt(node):
        return (isinstance(node, ast.Name) and node.id == "pt") or (
            isinstance(node, ast.Attribute) and node.attr == "pt" and isinstance(node.value, ast.Name))

    found = []
    for path in sorted((root / "paratrain").rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel == "paratrain/parallel.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), rel)):
            if not isinstance(node, ast.Attribute):
                continue
            inner = node.value
            if (isinstance(inner, ast.Attribute) and inner.attr in parts and is_pt(inner.value)) or (
                    is_pt(inner) and node.attr.startswith("_")):
                found.append(f"{rel}:{node.lineno}")
    return sorted(set(found))


def test_no_library_module_reaches_through_parallel(tmp_path):
    import pathlib

    assert reach_throughs(pathlib.Path(__file__).resolve().parents[1]) == []
    (tmp_path / "paratrain").mkdir()
    (tmp_path / "paratrain" / "m.py").write_text("a = pt.strategy.all_reduce_max(t)\nb = self.pt.plan.global_batch\n"
                                                 "c = pt._clock\nd = pt.global_batch\ne = pt.strategy\n")
    assert reach_throughs(tmp_path) == ["paratrain/m.py:1", "paratrain/m.py:2", "paratrain/m.py:3"]


def test_a_batch_plan_made_earlier_in_the_process_is_handed_down():
    """Issue 25: ``paratrain train`` makes the plan once and hands it to its job's Parallel."""
    from paratrain.data.sampler import BatchPlan

    cfg = paratrain.ParallelConfig(global_batch=8, accumulation=2)
    plan = cfg.batch_plan(1)
    pt = paratrain.Parallel(cfg, plan=plan)
    assert pt.plan is plan and pt.accumulation == 2
    pt.close()
    with pytest.raises(ValueError, match=r"the batch plan \(16 = .*\) is not this config's over 1 process"):
        paratrain.Parallel(cfg, plan=BatchPlan.derive(16, 1))


def test_parallel_stays_a_thin_facade():
    """Issue 25: ``Parallel`` joins the process, strategy, precision, step clock and trackers; the step
    rules (``clock.py``), the wrappers (``wrappers.py``), loader preparation (``data/prepare.py``) and
    resuming (``checkpoint/resume.py``) each have their own module. Keep it that way: at most 400
    lines, at most 10 attributes set in ``__init__``."""
    import ast
    import pathlib

    path = pathlib.Path(paratrain.parallel.__file__)
    source = path.read_text()
    assert len(source.splitlines()) <= 400
    init = next(n for n in ast.walk(ast.parse(source)) if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    assigned = {t.attr for n in ast.walk(init) if isinstance(n, (ast.Assign, ast.AnnAssign))
                for target in (n.targets if isinstance(n, ast.Assign) else [n.target]) for t in ast.walk(target)
                if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    assert len(assigned) <= 10, sorted(assigned)


def test_every_option_is_a_named_typed_documented_parameter():
    """Issue 24: ``Parallel(strategy=..., precision=...)`` completes in an editor and type-checks:
    each ParallelConfig field is a keyword of ``__init__`` (a strategy's section typed with its options
    class), the strategy and precision names are Literal types equal to the registries, and ``help``
    documents every keyword."""
    import inspect
    import typing

    from paratrain import precision, strategies
    from paratrain.config import ParallelConfig

    params = inspect.signature(paratrain.Parallel).parameters
    own = ["config", "log_to", "log_dir", "loggers", "plan"]
    assert sorted(params) == sorted(ParallelConfig.option_names() + own)
    assert all(params[name].kind is inspect.Parameter.KEYWORD_ONLY for name in ParallelConfig.option_names())
    hints = typing.get_type_hints(paratrain.Parallel.__init__)
    for name, cls in strategies.STRATEGIES.items():
        if cls.options_class is not None:
            assert cls.options_class in typing.get_args(hints[name]), name
    assert typing.get_args(strategies.StrategyName) == (strategies.AUTO, *strategies.STRATEGIES)
    assert set(typing.get_args(precision.PrecisionName)) == set(precision.PRECISIONS) | set(precision.ALIASES)
    doc = inspect.getdoc(paratrain.Parallel)
    for name in params:
        line = next((line for line in doc.splitlines() if line.strip().startswith(f"{name}: ")), "")
        assert len(line.split(": ", 1)[-1]) > 10 and "See ParallelConfig" not in line, name


def test_options_left_out_or_none_keep_their_defaults_and_a_config_excludes_them():
    from paratrain.config import ParallelConfig

    pt = paratrain.Parallel(seed=None, global_batch=8, ddp={"bucket_cap_mb": 5})
    assert (pt.config.seed, pt.config.global_batch, pt.config.ddp.bucket_cap_mb) == (0, 8, 5)
    pt.close()
    with pytest.raises(ValueError, match="either a ParallelConfig or keyword arguments"):
        paratrain.Parallel(ParallelConfig(), seed=1)
    with pytest.raises(TypeError, match="strategi"):
        paratrain.Parallel(strategie="ddp")  # type: ignore[call-arg]
