"""``mesh``: the layouts that compose, on one ``DeviceMesh`` whose dimensions are named.

The layout is said once, as the sizes of four dimensions, outermost first (torchtitan's order)::

    pp x dp_replicate x dp_shard x tp

``tp`` is innermost, so the ranks of one tensor-parallel group are consecutive: on a node of k
devices with ``tp <= k`` they are one node's, whose links are the fastest. ``dp_replicate`` is
outside ``dp_shard``: with HSDP the shards of a replica sit close together and only the replicas'
gradient all-reduce crosses the slower links between nodes.

* ``dp_shard`` alone is fsdp (FSDP2 over a 1-D mesh);
* ``dp_replicate x dp_shard`` is HSDP: FSDP2 on the 2-D mesh, each replica shards the model over
  its ``dp_shard`` ranks and the replicas all-reduce the gradient shards (``dp_shard`` 1: plain
  replication, DDP's numbers);
* ``... x tp``: the Linear layers split over ``tp`` first (tensor's plan), then the above over the
  data-parallel dimensions;
* a layout with ``pp`` is the pipeline strategy's (:mod:`.pipeline`): each stage split over ``tp``, then
  replicated or sharded (FSDP2, HSDP) over the data-parallel dimensions.

The batch is split over ``dp_replicate x dp_shard`` ranks (the ``tp`` ranks of a group read the
same samples), so the global batch and its samples are the same in every layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping


from ..env.process import Dist
from .base import NotApplicable, data_parallel_size, mesh_dimensions
from .fsdp import FSDPOptions
from .tensor import TensorOptions, TensorParallelStrategy

__all__ = ["DIMS", "MeshOptions", "Composition", "MeshStrategy", "describe", "layout_mesh", "data_parallel_mesh"]

DIMS = ("pp", "dp_replicate", "dp_shard", "tp")
"""The mesh's dimensions, outermost first: the order of ``init_device_mesh``'s shape."""

FLATTENED = ("dp_shard", "tp")
"""The dimensions :func:`layout_mesh` also makes one process group of, when both split the processes."""


def describe(sizes: dict[str, int]) -> str:
    """``"dp_replicate=2,dp_shard=2"``: the dimensions larger than 1, in mesh order (``"1"``: one process)."""
    return ",".join(f"{d}={sizes[d]}" for d in DIMS if sizes.get(d, 1) > 1) or "1"


def layout_mesh(device_type: str, sizes: Mapping[str, int], dims: tuple[str, ...] = DIMS) -> Any:
    """The job's ``DeviceMesh`` for the layout ``sizes``, with the dimensions ``dims`` outermost first (:data:`DIMS`
    by default; a size 1 included, so every name can be indexed). A collective."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, tuple(sizes.get(d, 1) for d in dims), mesh_dim_names=dims)
    if all(d in dims and sizes.get(d, 1) > 1 for d in FLATTENED):
        # One group over dp_shard x tp (torchtitan flattens its data-parallel dimensions alike): a gradient norm
        # partial over both (clipping under fsdp + tp) is then one all-reduce, where DTensor did one a dimension and
        # warned on every rank that the mesh should be flattened. Torch finds the flattened mesh by its layout.
        flatten = getattr(mesh[FLATTENED], "_flatten", None)
        if callable(flatten):
            flatten("_".join(FLATTENED))
    return mesh


def data_parallel_mesh(mesh: Any, sizes: Mapping[str, int]) -> Any:
    """The part of a :func:`layout_mesh` mesh that FSDP2 runs on: the 2-D ``(dp_replicate, dp_shard)``
    (HSDP) when the layout replicates, else ``dp_shard``."""
    return mesh["dp_replicate", "dp_shard"] if sizes.get("dp_replicate", 1) > 1 else mesh["dp_shard"]


@dataclass(kw_only=True)
class MeshOptions:
    """The layout: how many ways each dimension splits the processes (``pp x dp_replicate x
    dp_shard x tp``, outermost first). The sizes multiply to the world size; one may be -1, the rest.
    A dimension not given is 1, but for ``dp_shard``, which takes what the others leave."""

    pp: int | None = None
    """Pipeline stages."""
    dp_replicate: int | None = None
    """Data-parallel replicas: each holds the whole model (or its dp_shard shards); their gradients are all-reduced."""
    dp_shard: int | None = None
    """Data-parallel ranks that shard the model (FSDP2) within a replica. Not given: what the others leave."""
    tp: int | None = None
    """Tensor-parallel ranks: each Linear pair split over them (the tensor strategy's plan)."""

    def __post_init__(self) -> None:
        for name in DIMS:
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str) and value.strip().lstrip("-").isdigit():
                value = int(value)
            if isinstance(value, bool) or not isinstance(value, int) or not (value >= 1 or value == -1):
                raise ValueError(f"mesh {name}={value!r} must be a whole number >= 1, or -1 (the rest)")
            setattr(self, name, value)
        rest = [name for name in DIMS if getattr(self, name) == -1]
        if len(rest) > 1:
            raise ValueError(f"mesh {self}: only one dimension may be -1 (the rest), not {' and '.join(rest)}")

    @classmethod
    def parse(cls, text: str) -> MeshOptions:
        """``"pp=2,dp_shard=2,tp=2"`` (the command line's and ``PARATRAIN_PARALLEL``'s spelling)."""
        sizes: dict[str, Any] = {}
        for item in (part.strip() for part in str(text).split(",")):
            if not item:
                continue
            name, sep, value = (s.strip() for s in item.partition("="))
            if not sep or name not in DIMS:
                raise ValueError(f"mesh {text!r}: {item!r} is not NAME=SIZE with NAME one of {', '.join(DIMS)} "
                                 "(e.g. dp_shard=2,tp=2)")
            sizes[name] = value
        return cls(**sizes)

    @property
    def given(self) -> bool:
        """Whether any dimension is set (the default, none, leaves the layout to ``strategy``)."""
        return any(getattr(self, d) is not None for d in DIMS)

    def smallest_world(self) -> int:
        """The fewest processes the layout fits: the product of the sizes given (a -1, or a
        dimension not given, counts 1 there and takes the rest of a larger world)."""
        return math.prod(v for d in DIMS if (v := getattr(self, d)) not in (None, -1))

    def sizes(self, world: int) -> dict[str, int]:
        """Each dimension's size on ``world`` processes; a one-line error if they cannot make it."""
        given = {d: getattr(self, d) for d in DIMS}
        if given["dp_shard"] is None and -1 not in given.values():
            given["dp_shard"] = -1  # torchtitan's default: dp_shard takes the rest
        known = math.prod(v for v in given.values() if v not in (None, -1))
        rest = [d for d, v in given.items() if v == -1]
        if rest:
            if world % known:
                raise ValueError(f"mesh {self}: the other dimensions ({known}) do not divide the world size {world}: "
                                 f"use sizes whose product divides {world}")
            given[rest[0]] = world // known
        sizes = {d: v or 1 for d, v in given.items()}
        if math.prod(sizes.values()) != world:
            raise ValueError(f"mesh {self} makes {math.prod(sizes.values())} processes, not the world size {world}: "
                             f"give sizes whose product is {world}, or one of them as -1 (the rest)")
        return sizes

    def __str__(self) -> str:
        return ",".join(f"{d}={getattr(self, d)}" for d in DIMS if getattr(self, d) is not None) or "(none)"


@dataclass
class Composition:
    """What the mesh strategy is built with: the layout, and the sections of the parts it composes
    (``tensor``'s plan, ``fsdp``'s sharding settings)."""

    layout: MeshOptions
    tensor: TensorOptions
    fsdp: FSDPOptions


class MeshStrategy(TensorParallelStrategy):
    """``dp_replicate x dp_shard x tp`` on one DeviceMesh: tensor parallel over ``tp`` (as the
    tensor strategy does), then FSDP2 over the data-parallel dimensions, HSDP when both are above 1.

    The metrics, the batch layout and the DTensor machinery (optimizer re-pointing, clipping with one
    norm over every dimension, DCP checkpoints) are the tensor strategy's, over its ``(dp, tp)`` view.
    """

    name = "mesh"
    bench_default = "no"
    options_class = MeshOptions  # the ``[parallel.mesh]`` section: ``Parallel(mesh={"dp_shard": 2, "tp": 2})``

    @classmethod
    def options_of(cls, cfg: Any) -> Composition:
        return Composition(cfg.mesh, cfg.tensor, cfg.fsdp)

    @classmethod
    def validate(cls, cfg: Any) -> None:
        layout: MeshOptions = cfg.mesh
        if layout.pp not in (None, 1):
            raise ValueError(f"strategy 'mesh' runs no pipeline, and mesh {layout} has pp: leave strategy auto "
                             "(the pipeline strategy runs a layout with pp)")
        if layout.tp in (None, 1):
            super(TensorParallelStrategy, cls).validate(cfg)  # fsdp's rules: no tensor-parallel gradients to scale
        else:
            super().validate(cfg)

    @classmethod
    def layout_for(cls, world: int, options: Any = None) -> dict[str, int]:
        return options.layout.sizes(world) if options is not None else {"dp_shard": world}

    def __init__(self, dist_info: Dist, sync_batchnorm: bool = False, options: Composition | None = None,
                 **common: Any) -> None:
        options = options or Composition(MeshOptions(), TensorOptions(), FSDPOptions())
        super(TensorParallelStrategy, self).__init__(dist_info, sync_batchnorm, options, **common)
        try:
            self.sizes = options.layout.sizes(dist_info.world_size)
        except ValueError as e:
            raise NotApplicable(str(e)) from None
        self.tp = self.sizes["tp"]
        self.dp = data_parallel_size(self.sizes)
        self._mesh = None
        self._device_mesh: Any = None

    @property
    def tensor_options(self) -> TensorOptions:
        return self.options.tensor

    def comm_dimensions(self) -> dict[str, str]:
        return {**super().comm_dimensions(), **mesh_dimensions(self._device_mesh)}

    @property
    def device_mesh(self) -> Any:
        """The whole ``(dp_replicate, dp_shard, tp)`` DeviceMesh (a dimension may be 1)."""
        if self._device_mesh is None:
            self._device_mesh = layout_mesh(self.device.type, self.sizes, DIMS[1:])
        return self._device_mesh

    @property
    def splits(self) -> bool:  # type: ignore[override]
        return self.tp > 1

    @property
    def fsdp_options(self) -> FSDPOptions:  # type: ignore[override]
        return self.options.fsdp

    def split_meshes(self) -> tuple[Any, Any]:
        """``(tp mesh, data-parallel mesh)``: the latter 2-D ``(dp_replicate, dp_shard)`` for HSDP."""
        return self.device_mesh["tp"], data_parallel_mesh(self.device_mesh, self.sizes)

    def describe_split(self, plan: dict[str, str]) -> str:
        return f"paratrain mesh {describe(self.sizes)}" + (f": {len(plan)} Linear layers split over tp" if plan else "")
