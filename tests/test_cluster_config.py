import os

import yaml


def test_cluster_yaml_validates_with_rays_own_schema():
    from ray.autoscaler._private.util import prepare_config, validate_config

    path = os.path.join(os.path.dirname(__file__), "..", "cluster.yaml")
    with open(path) as f:
        config = yaml.safe_load(f)
    validate_config(prepare_config(config))  # what `ray up` does before launching
    assert config["available_node_types"]["gpu_worker"]["max_workers"] >= 1
