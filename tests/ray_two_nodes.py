"""A Ray cluster of two nodes on this machine, as ``ray start`` makes one across two machines: two raylets
on loopback, one logical GPU each (``ray.cluster_utils.Cluster``). Started by the end-to-end tests in an
environment without the launcher's variables, so its workers see only what a launch forwards to them.

Prints ``address <host:port>`` once both nodes are up, then waits for its standard input to close; it
then prints ``actors <json>`` (each actor's class and node, dead ones included) and shuts the cluster down.
"""

import json
import sys
from pathlib import Path

import ray
from ray._private.utils import get_ray_address_file
from ray.cluster_utils import Cluster
from ray.util.state import list_actors

NODE = {"num_gpus": 1, "num_cpus": 8, "object_store_memory": 1 << 30}


def main() -> None:
    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    # Ray's test cluster records itself as this machine's current cluster, which every plain ray.init()
    # would then join (the other runs beside this one): only a launch given its address may.
    Path(get_ray_address_file(None)).unlink(missing_ok=True)
    print(f"address {cluster.address}", flush=True)
    sys.stdin.read()
    ray.init(address=cluster.address, logging_level="ERROR")
    actors = [{"class": actor.class_name, "node": actor.node_id, "state": actor.state}
              for actor in list_actors(address=cluster.address, detail=False, limit=10_000,
                                       raise_on_missing_output=False)]
    print(f"actors {json.dumps(actors)}", flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main()
