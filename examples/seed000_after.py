"""Seed 000 converted to paratrain in five edited lines (``diff seed000_before.py seed000_after.py``).

``import paratrain``; ``paratrain.Parallel`` instead of ``init_distributed()``, with the global
batch the seed trained with (its per-process batch x processes); ``pt.setup`` around the model
(the script's own DistributedDataParallel is kept) and the optimizer; ``pt.train_loader`` around
its DataLoader (paratrain's global-batch sampler replaces the DistributedSampler, whose
``set_epoch`` is now a no-op); ``pt.backward`` instead of ``.backward()``. Everything else — the
rank helpers, SyncBatchNorm, GradScaler/autocast, the save line — is the seed's. Launch it as
the "before"::

    python -m paratrain run --nproc-per-node 2 examples/seed000_after.py --epochs 1

Keeping the global batch fixed instead of the per-process one (``global_batch=args.batch_size``)
makes the result independent of the number of processes. ``seed000_full.py`` goes further:
paratrain's precision, SyncBatchNorm and rank helpers instead of the hand-written ones.
"""

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.optim as optim
import paratrain
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

try:
    import torchvision
    import torchvision.transforms as transforms
except ImportError:  # FALLBACK (not in the seed): see fallback()
    torchvision = None


def init_distributed():
    dist_url = "env://"
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ["LOCAL_RANK"])

    dist.init_process_group(
        backend="nccl" if torch.cuda.is_available() else "gloo",
        init_method=dist_url,
        world_size=world_size,
        rank=rank,
    )

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    dist.barrier()


def is_dist_avail_and_initialized():
    if not dist.is_available():
        return False
    if not dist.is_initialized():
        return False
    return True


def get_rank():
    if not is_dist_avail_and_initialized():
        return 0
    return dist.get_rank()


def is_main_process():
    return get_rank() == 0


def save_on_master(*args, **kwargs):
    if is_main_process():
        torch.save(*args, **kwargs)


# --- FALLBACK (not in the seed): no torchvision here -> real 8x8 digits and resnet8 -------------
def fallback(what):
    try:
        import paratrain.data.datasets as datasets, paratrain.models as models
    except ImportError:  # a source checkout without `pip install -e .`
        import sys
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        import paratrain.data.datasets as datasets, paratrain.models as models
    if what == "data":
        return datasets.digits(train=True), datasets.digits(train=False)
    return models.build_model("resnet8", (1, 8, 8), 10)
# -------------------------------------------------------------------------------------------------


def create_data_loader_cifar10(batch_size=256, workers=10):
    if torchvision is None:  # FALLBACK
        trainset, testset = fallback("data")
        workers = 0
    else:
        transform = transforms.Compose([
            transforms.RandomCrop(32),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize((0.5, 0.5, 0.5), (0.5, 0.5, 0.5)),
        ])
        trainset = torchvision.datasets.CIFAR10(root="./data", train=True,
                                                download=True, transform=transform)
        testset = torchvision.datasets.CIFAR10(root="./data", train=False,
                                               download=True, transform=transform)
    train_sampler = DistributedSampler(dataset=trainset, shuffle=True)
    trainloader = DataLoader(trainset, batch_size=batch_size, sampler=train_sampler,
                             num_workers=workers, pin_memory=torch.cuda.is_available())
    testloader = DataLoader(testset, batch_size=batch_size, shuffle=False, num_workers=workers)
    return trainloader, testloader


def train(net, trainloader, device, epochs=1, max_steps=None):
    if is_main_process():
        print("Start training...")
    criterion = nn.CrossEntropyLoss()
    net, optimizer = pt.setup(net, optim.SGD(net.parameters(), lr=0.001, momentum=0.9))
    use_amp = device.type == "cuda"
    fp16_scaler = torch.amp.GradScaler("cuda", enabled=use_amp)

    for epoch in range(epochs):
        trainloader.sampler.set_epoch(epoch)
        running_loss = 0.0
        num_of_batches = 0
        for i, data in enumerate(pt.train_loader(trainloader), 0):
            if max_steps is not None and i >= max_steps:
                break
            inputs, labels = data
            images, labels = inputs.to(device), labels.to(device)

            optimizer.zero_grad()

            with torch.autocast("cuda", enabled=use_amp):
                outputs = net(images)
                loss = criterion(outputs, labels)

            pt.backward(fp16_scaler.scale(loss))
            fp16_scaler.step(optimizer)
            fp16_scaler.update()

            running_loss += loss.item()
            num_of_batches += 1

        if is_main_process():
            print(f"[Epoch {epoch + 1}/{epochs}] loss: {running_loss / max(num_of_batches, 1):.3f}")

    if is_main_process():
        print("Finished Training")


@torch.no_grad()
def test(net, testloader, device):
    net.eval()
    correct, total = 0, 0
    for images, labels in testloader:
        images, labels = images.to(device), labels.to(device)
        outputs = net(images)
        correct += (outputs.argmax(1) == labels).sum().item()
        total += labels.size(0)
    net.train()
    return 100.0 * correct / total


def main():
    parser = argparse.ArgumentParser(description="Seed 000: CIFAR-10 on N processes (DDP, AMP on GPUs)")
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--steps", type=int, default=None, help="stop each epoch after this many steps")
    parser.add_argument("--batch-size", type=int, default=256, help="per process")
    parser.add_argument("--workers", type=int, default=10, help="DataLoader workers (0 in the fallback)")
    parser.add_argument("--checkpoint", default=os.path.join(
        tempfile.gettempdir(), os.path.splitext(os.path.basename(__file__))[0] + ".pt"))
    args = parser.parse_args()

    start = time.time()
    global pt; pt = paratrain.Parallel(strategy="ddp", global_batch=args.batch_size * int(os.environ["WORLD_SIZE"]))
    local_rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", local_rank) if torch.cuda.is_available() else torch.device("cpu")

    trainloader, testloader = create_data_loader_cifar10(args.batch_size, args.workers)
    if torchvision is None:  # FALLBACK
        net = fallback("model").to(device)
    else:
        net = torchvision.models.resnet50(weights=None).to(device)
    if torch.cuda.is_available():  # torch's SyncBatchNorm is GPU-only
        net = nn.SyncBatchNorm.convert_sync_batchnorm(net)
    net = nn.parallel.DistributedDataParallel(net, device_ids=[local_rank] if device.type == "cuda" else None)

    t0 = time.time()
    train(net, trainloader, device, args.epochs, args.steps)
    train_time = time.time() - t0
    accuracy = test(net, testloader, device)
    save_on_master(net.module.state_dict(), args.checkpoint)
    if is_main_process():
        print(f"Training time: {train_time:.2f} s, total time: {time.time() - start:.2f} s")
        print(f"Accuracy of the network on the test images: {accuracy:.1f} %")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
