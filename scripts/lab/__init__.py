"""A cluster on one machine: test hosts in network namespaces, Slurm and OpenMPI, for rehearsing
(and testing) multi-node paratrain jobs. Needs root and ``ip netns``; see ``python -m scripts.lab --help``.

Everything the lab creates is named with the ``pt-`` prefix (namespaces ``pt-h0``..., the bridge
``pt-br0``, veths ``pt-v0``...) or lives under :data:`hosts.LAB_DIR`, so ``lab down`` finds and
removes it even after a killed run.
"""
