"""Seed 000 with paratrain: the same script as ``seed000_before.py``; changed lines say ``# paratrain:``.

paratrain.Parallel replaces init_distributed, set_device, SyncBatchNorm + DDP, the
DistributedSampler + set_epoch, GradScaler/autocast and the rank helpers. The loop stays the
user's. It runs as plain python (one process, no process group) or on N processes::

    python examples/seed000_full.py --epochs 1
    python -m paratrain run --nproc-per-node 2 examples/seed000_full.py --epochs 1
    torchrun --nproc-per-node 2 examples/seed000_full.py --epochs 1

Like the "before" script, it falls back to scikit-learn's 8x8 digits and resnet8 when
torchvision is not installed (FALLBACK, not in the seed).
"""

import argparse
import os
import tempfile
import time

import torch
import torch.nn as nn
import torch.optim as optim
from torch.utils.data import DataLoader

try:
    import torchvision
    import torchvision.transforms as transforms
except ImportError:  # FALLBACK (not in the seed): see fallback()
    torchvision = None

try:  # paratrain:
    import paratrain
except ImportError:  # a source checkout without `pip install -e .`
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    import paratrain

# paratrain: init_distributed, is_dist_avail_and_initialized, get_rank, is_main_process and
# save_on_master are gone: paratrain.Parallel and paratrain.save_on_main do their jobs.


# --- FALLBACK (not in the seed): no torchvision here -> real 8x8 digits and resnet8 -------------
def fallback(what):
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
    # paratrain: no DistributedSampler/DataLoader here: pt.train_loader(trainset) shards the set
    testloader = DataLoader(testset, batch_size=batch_size, shuffle=False, num_workers=workers)
    return trainset, testloader, workers  # paratrain: the dataset, not a loader


def train(pt, net, trainloader, epochs=1, max_steps=None):  # paratrain: gets pt, no device
    pt.print("Start training...")  # paratrain: prints on the main process only
    criterion = nn.CrossEntropyLoss()
    optimizer = optim.SGD(net.parameters(), lr=0.001, momentum=0.9)
    # paratrain: no GradScaler: pt.backward/pt.step scale the loss when precision is fp16-mixed

    for epoch in range(epochs):
        # paratrain: no trainloader.sampler.set_epoch(epoch): each pass over the loader is the next epoch
        running_loss = 0.0
        num_of_batches = 0
        for i, data in enumerate(trainloader, 0):
            if max_steps is not None and i >= max_steps:
                break
            images, labels = data  # paratrain: batches arrive on the device

            optimizer.zero_grad()

            outputs = net(images)  # paratrain: pt.setup made net autocast when precision asks for it
            loss = criterion(outputs, labels)

            pt.backward(loss)  # paratrain: was fp16_scaler.scale(loss).backward()
            pt.step(optimizer)  # paratrain: was fp16_scaler.step(optimizer); fp16_scaler.update()

            running_loss += loss.item()
            num_of_batches += 1

        pt.print(f"[Epoch {epoch + 1}/{epochs}] loss: {running_loss / max(num_of_batches, 1):.3f}")  # paratrain:

    pt.print("Finished Training")  # paratrain:


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
    pt = paratrain.Parallel(  # paratrain: replaces init_distributed() and torch.cuda.set_device
        strategy="ddp",
        precision="fp16-mixed" if torch.cuda.is_available() else "32",  # the seed's AMP, on GPUs
        global_batch=args.batch_size * paratrain.world_size(),  # the seed's batch: 256 per process
        sync_batchnorm=True,  # the seed's SyncBatchNorm (paratrain's also works on CPU/gloo)
    )
    device = pt.device  # paratrain: cuda:<local rank> or cpu, chosen by paratrain

    with paratrain.main_process_first():  # paratrain: rank 0 downloads first, the others then read
        trainset, testloader, workers = create_data_loader_cifar10(args.batch_size, args.workers)
    trainloader = pt.train_loader(trainset, num_workers=workers,  # paratrain: sharded, seeded
                                  pin_memory=device.type == "cuda")
    if torchvision is None:  # FALLBACK
        net = fallback("model")
    else:
        net = torchvision.models.resnet50(weights=None)
    net = pt.setup(net)  # paratrain: replaces .to(device), convert_sync_batchnorm and DistributedDataParallel

    t0 = time.time()
    train(pt, net, trainloader, args.epochs, args.steps)  # paratrain: passes pt
    train_time = time.time() - t0
    accuracy = test(net, testloader, device)
    paratrain.save_on_main(pt.unwrap(net).state_dict(), args.checkpoint)  # paratrain: was save_on_master(net.module...)
    pt.print(f"Training time: {train_time:.2f} s, total time: {time.time() - start:.2f} s")  # paratrain:
    pt.print(f"Accuracy of the network on the test images: {accuracy:.1f} %")  # paratrain:
    pt.close()  # paratrain: was dist.destroy_process_group()


if __name__ == "__main__":
    main()
