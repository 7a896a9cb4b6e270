"""Flight Recorder under nccl, read back by ``paratrain doctor`` (issue 36, item 6; part of the nccl check).

One GPU cannot hold two nccl ranks, so no rank can skip a collective here. What one rank can do is time
out: a child process joins a one-rank nccl group with a 3 s timeout and Flight Recorder on
(``TORCH_NCCL_TRACE_BUFFER_SIZE``, ``TORCH_NCCL_DUMP_ON_TIMEOUT``), runs one ``all_reduce`` that
completes, writes an on-demand dump, then queues a second ``all_reduce`` behind a kernel that spins
for longer than the timeout. NCCL's watchdog times it out, writes the ring to
``$TORCH_FR_DUMP_TEMP_FILE<rank>`` and aborts the process. ``paratrain doctor`` then reads that folder:
rank 0 still waiting in ``all_reduce #2``, from the child's own line. The CPU twin (gloo) has no
watchdog dump: it reads back gloo's on-demand dump (``TORCH_FR_BUFFER_SIZE``) the same way.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time

from .base import ROOT, CheckFailed

CHILD = '''\
import datetime, os, sys, time
import torch, torch.distributed as dist
gpu = sys.argv[1] == "gpu"
device = torch.device("cuda", 0) if gpu else torch.device("cpu")
if gpu:
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if gpu else "gloo", init_method="tcp://127.0.0.1:" + sys.argv[2], rank=0,
                        world_size=1, timeout=datetime.timedelta(seconds=3))
dist.all_reduce(torch.ones(10, device=device))  # completes
if gpu:
    torch.cuda.synchronize()
    time.sleep(1.0)  # the watchdog marks it completed
dumped = torch._C._distributed_c10d._dump_nccl_trace if gpu else torch._C._distributed_c10d._dump_fr_trace
dump = dumped(True, True, False)
with open(os.path.join(sys.argv[3], "nccl_trace_rank_0"), "wb") as f:
    f.write(dump)
if gpu:
    torch.cuda._sleep(int(60 * 2e9))  # about a minute of spinning on the stream the collective waits for
    dist.all_reduce(torch.ones(20, device=device))  # NCCL's watchdog times this one out after 3 s
    torch.cuda.synchronize()
    print("the second all_reduce returned: no timeout", flush=True)
    sys.exit(3)
dist.destroy_process_group()
'''


def flight_recorder(mode: str, budget: float) -> dict[str, object]:
    """Run the child, then ``paratrain doctor`` on each dump folder; the details, or :class:`CheckFailed`."""
    from paratrain.env.network import free_port

    gpu = mode == "gpu"
    work = tempfile.mkdtemp(prefix="paratrain-flight-")
    demand, timeout_dir = os.path.join(work, "on_demand"), os.path.join(work, "on_timeout")
    os.makedirs(demand)
    os.makedirs(timeout_dir)
    script = os.path.join(work, "flight_child.py")
    with open(script, "w") as f:
        f.write(CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p),
               TORCH_NCCL_TRACE_BUFFER_SIZE="2000", TORCH_FR_BUFFER_SIZE="2000", TORCH_NCCL_DUMP_ON_TIMEOUT="1",
               TORCH_FR_DUMP_TEMP_FILE=os.path.join(timeout_dir, "nccl_trace_rank_"),
               TORCH_NCCL_DEBUG_INFO_TEMP_FILE=os.path.join(timeout_dir, "nccl_trace_rank_"),
               TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC="5000")
    limit = max(20.0, budget - 15.0)
    print(f"$ {sys.executable} {script} {mode} (Flight Recorder on, timeout 3 s; limit {limit:.0f} s)", flush=True)
    t0 = time.monotonic()
    # in this check's process group: the driver's kill at the end of the slice ends it too (its spinning kernel
    # must not hold the GPU into the next step)
    child = subprocess.Popen([sys.executable, script, mode, str(free_port()), demand], env=env, cwd=work,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        output, _ = child.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        child.kill()
        output, _ = child.communicate()
    took = time.monotonic() - t0
    print(output[-3000:], f"(child: {took:.1f} s, exit {child.returncode})", sep="\n", flush=True)
    if gpu and child.returncode in (0, 3):
        raise CheckFailed(f"a collective past its 3 s nccl timeout did not end the process (exit {child.returncode})")
    if not gpu and child.returncode != 0:
        raise CheckFailed(f"the gloo child exited with {child.returncode}: {output.strip().splitlines()[-1:]}")
    details: dict[str, object] = {"child_exit": child.returncode, "child_seconds": round(took, 1)}
    folders = [("on_demand", demand, "doctor: the ranks agree")]
    if gpu:
        folders.append(("on_timeout", timeout_dir, "still waiting: rank 0 in all_reduce #"))
    for what, folder, expect in folders:
        if not os.listdir(folder):
            raise CheckFailed(f"no Flight Recorder dump was written {what.replace('_', ' ')} in {folder} "
                              f"(child exit {child.returncode})")
        try:
            res = subprocess.run([sys.executable, "-m", "paratrain", "doctor", folder], env=env, capture_output=True,
                                 text=True, timeout=60, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as e:
            raise CheckFailed(f"paratrain doctor {folder} ran past 60 s") from e
        print(f"$ paratrain doctor {folder}  (exit {res.returncode})", res.stdout[-3000:], res.stderr[-1500:],
              sep="\n", flush=True)
        if "Flight Recorder dumps of 1 rank(s)" not in res.stdout or expect not in res.stdout \
                or "flight_child.py:" not in res.stdout:
            raise CheckFailed(f"paratrain doctor on the {what.replace('_', ' ')} dump did not say {expect!r} with "
                              f"the child's line: {(res.stdout.strip() or res.stderr.strip()).splitlines()[:2]}")
        details[what] = res.stdout.splitlines()[1]
    shutil.rmtree(work, ignore_errors=True)  # kept (and named in the log) only when the check failed
    return details
