"""``python -m scripts.lab up|down|net|cut|heal|exec|slurm|mpi``: see the package docstring."""

from __future__ import annotations

import argparse
import os
import sys

from . import hosts, mpi, procs, slurm


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scripts.lab", description=__doc__)
    sub = p.add_subparsers(dest="cmd", required=True)
    up = sub.add_parser("up", help="create test hosts pt-h0.. on a private bridge")
    up.add_argument("--hosts", type=int, default=2)
    sub.add_parser("down", help="stop the lab's daemons and remove everything it created (idempotent)")
    sub.add_parser("slurm", help="install (once) and start munged, slurmctld, slurmd; prints SLURM_CONF")
    sub.add_parser("mpi", help="install an MPI (once)").add_argument(
        "--kind", choices=mpi.KINDS, default="openmpi", help="openmpi (mpirun) or mpich (Hydra's mpiexec)")
    sub.add_parser("status", help="list the hosts and their addresses")
    net = sub.add_parser("net", help="shape every host's link (tc)")
    net.add_argument("--rate", help="e.g. 1gbit, 100mbit")
    net.add_argument("--delay", help="e.g. 0.2ms (needs netem in the kernel)")
    for cmd in ("cut", "heal"):
        sub.add_parser(cmd, help=f"{cmd} a host's link").add_argument("host")
    ex = sub.add_parser("exec", help="run a command on a host: lab exec pt-h1 -- cmd ...")
    ex.add_argument("host")
    ex.add_argument("command", nargs=argparse.REMAINDER)
    args = p.parse_args(argv)
    try:
        if args.cmd in ("up", "net", "cut", "heal", "exec") and (why := hosts.unavailable()):
            raise RuntimeError(f"lab: {why}")
        if args.cmd == "up":
            for i, a in enumerate(hosts.up(args.hosts)):
                print(f"{hosts.name(i)} {a}")
        elif args.cmd == "down":
            procs.stop_daemons()
            hosts.down()
        elif args.cmd == "slurm":
            node = slurm.up()
            print(f"export SLURM_CONF={slurm.conf_path()}  # node {node}; logs in {slurm.DIR}")
        elif args.cmd == "mpi":
            mpi.up(args.kind)
            print(" ".join(mpi.mpirun(2, args.kind)) + " ...")
        elif args.cmd == "status":
            for ns in hosts.hosts():
                print(f"{ns} {hosts.addr(hosts.index(ns))}")
        elif args.cmd == "net":
            hosts.net(args.rate, args.delay)
        elif args.cmd == "cut":
            hosts.cut(args.host)
        elif args.cmd == "heal":
            hosts.heal(args.host)
        elif args.cmd == "exec":
            cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
            if not cmd:
                raise ValueError("lab exec: give a command after --")
            argv2 = hosts.exec_argv(args.host, cmd)
            os.execvp(argv2[0], argv2)
    except (RuntimeError, ValueError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
