"""A fleet replica on ``k`` tensor-parallel ranks asks Ray for them in one placement group.

No Ray cluster runs here: the deployment options are checked as data, and as the Ray Serve
deployment the fleet's application binds (its options are read back, nothing is scheduled).
"""

from __future__ import annotations

import pytest

from lorapage.config import EngineConfig
from lorapage.fleet.cli import build_parser, fleet_config
from lorapage.fleet.config import ENGINE_DEPLOYMENT, INGRESS_CPUS, FleetConfig, replica_cpus_for


def _fleet(tp: int, cpus: float = 0.5, gpus: float = 0.0) -> FleetConfig:
    return FleetConfig(
        engine=EngineConfig(tensor_parallel_size=tp), tenants_toml="", replica_cpus=cpus, replica_gpus=gpus
    )


def test_one_rank_is_one_actor_without_a_placement_group():
    fleet = _fleet(1, 0.75)
    assert fleet.engine_options(fleet.engine) == {"ray_actor_options": {"num_cpus": 0.75, "num_gpus": 0.0}}


def test_k_ranks_on_cpu_are_k_bundles_of_cpus_packed_on_one_node():
    fleet = _fleet(2, 0.5)
    assert fleet.engine_options(fleet.engine) == {
        "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 0.0},
        "placement_group_bundles": [{"CPU": 0.5}, {"CPU": 0.5}],
        "placement_group_strategy": "STRICT_PACK",
    }
    assert fleet.replica_needs()[ENGINE_DEPLOYMENT] == {"CPU": 1.0, "GPU": 0.0}


def test_k_ranks_on_gpus_the_replicas_bundle_holds_the_k_devices():
    """The ranks are the replica's child processes: they see the GPUs Ray gave its actor only."""
    fleet = _fleet(4, 1.0, gpus=1.0)
    options = fleet.engine_options(fleet.engine)
    assert options["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 4.0}
    assert options["placement_group_bundles"] == [{"CPU": 1.0, "GPU": 4.0}] + [{"CPU": 1.0}] * 3
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert fleet.replica_needs()[ENGINE_DEPLOYMENT] == {"CPU": 4.0, "GPU": 4.0}


def test_the_bound_deployment_carries_the_placement_group():
    pytest.importorskip("ray.serve", reason="the fleet needs ray[serve]")
    from lorapage.fleet.app import build_app

    fleet = _fleet(2, 0.5)
    app = build_app(fleet)
    engines = app._bound_deployment.init_args[0]._bound_deployment  # the ingress is bound to the engines
    assert engines.name == ENGINE_DEPLOYMENT
    assert engines._replica_config.placement_group_bundles == [{"CPU": 0.5}, {"CPU": 0.5}]
    assert engines._replica_config.placement_group_strategy == "STRICT_PACK"
    assert engines._replica_config.ray_actor_options["num_cpus"] == 0.5


def test_the_flag_and_the_cpus_a_rank_gets():
    args = build_parser().parse_args(["--tensor-parallel-size", "2", "--replicas", "1"])
    cpus = replica_cpus_for(2.0, 1, INGRESS_CPUS, None, ranks=args.tensor_parallel_size)
    assert cpus == 0.75  # 1 replica x 2 ranks x 0.75 + 0.5 = 2
    config = fleet_config(args, cpus, "")
    assert config.engine.tensor_parallel_size == 2
    assert config.replica_needs()[ENGINE_DEPLOYMENT]["CPU"] == 1.5
    with pytest.raises(ValueError, match=r"--replica-cpus 1 x 1 replicas x 2 ranks \+ 0.5 for the ingress = 2.5 CPUs"):
        replica_cpus_for(2.0, 1, INGRESS_CPUS, 1.0, ranks=2)
