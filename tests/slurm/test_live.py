"""Jobs checked against what sinfo says (the cluster itself), and against a profile's CPUs per
node, without SLURM; test_real_slurm.py checks the same against the local SLURM's own sinfo."""

import math

import pytest

from hpc_horovod.slurm import live, render_job
from hpc_horovod.slurm.profiles import profile_from_dict

SINFO = """\
cpu*|48|(null)|2-00:00:00|skylake,ib
cpu*|64|(null)|2-00:00:00|icelake
gpu|40|gpu:v100:4(S:0-1)|20:00:00|v100
debug|8|gpu:1,nvme:1|30:00|(null)
long|16|(null)|infinite|(null)
"""


def test_parse_sinfo_takes_the_largest_node_of_each_partition():
    cluster = live.parse_sinfo(SINFO)
    assert cluster.default == "cpu" and set(cluster.partitions) == {"cpu", "gpu", "debug",
                                                                     "long"}
    cpu, gpu = cluster.partitions["cpu"], cluster.partitions["gpu"]
    assert (cpu.cpus_per_node, cpu.gpus_per_node, cpu.max_time) == (64, 0, 2 * 86400)
    assert cpu.features == {"skylake", "ib", "icelake"}
    assert (gpu.gpus_per_node, gpu.max_time) == (4, 20 * 3600)
    assert cluster.partitions["debug"].gpus_per_node == 1
    assert cluster.partitions["debug"].max_time == 1800
    assert cluster.partitions["long"].max_time == math.inf


def plan(**options):
    return render_job(["python", "t.py"], cluster="generic", live=live.parse_sinfo(SINFO),
                      profile_env={"HPC_HOROVOD_CLUSTERS": "/nonexistent"}, **options)


@pytest.mark.parametrize("options, error", [
    (dict(partition="a100"), "--partition a100: no such partition on this cluster \\(sinfo\\); "
                             "it has cpu, debug, gpu, long"),
    (dict(partition="gpu", gpus_per_node=8), "--gpus-per-node 8: the nodes of partition gpu "
                                             "have 4 GPU"),
    (dict(gpus_per_node=1), "the nodes of partition cpu have 0 GPU.*leave GPUs out"),
    (dict(ntasks_per_node=65), "65 task\\(s\\) per node x --cpus-per-task 1 = 65 CPUs per node"
                               ", but the nodes of partition cpu have 64"),
    (dict(partition="gpu", gpus_per_node=4, cpus_per_task=11), "44 CPUs per node.* have 40"),
    (dict(partition="debug", time="31"), "--time 00:31:00 is over the 00:30:00 MaxTime of "
                                         "partition debug"),
    (dict(partition="gpu", constraint="a100", gpus_per_node=1), "--constraint a100: no node of "
                                                                "partition gpu has"),
])
def test_the_live_cluster_refuses_what_it_cannot_run(options, error):
    with pytest.raises(ValueError, match=error):
        plan(**options)


def test_the_live_cluster_lets_through_what_it_has():
    plan(partition="gpu", gpus_per_node=4, cpus_per_task=10, time="20:00:00",
         constraint="v100")
    plan(ntasks_per_node=64, time="2-0")               # the default partition, its larger node
    plan(partition="long", time="UNLIMITED")
    plan(constraint="skylake")                        # a feature of the default partition


def test_a_profile_can_say_cpus_per_node():
    profile = profile_from_dict("site", {"cpus_per_node": 32, "partitions": {
        "big": {"gpus_per_node": 0, "cpus_per_node": 128}}})
    with pytest.raises(ValueError, match="33 CPUs per node, but the default partition of "
                                         "cluster site has 32"):
        render_job(["python", "t.py"], cluster=profile, ntasks_per_node=33)
    render_job(["python", "t.py"], cluster=profile, partition="big", ntasks_per_node=128)
    with pytest.raises(ValueError, match="has 128"):
        render_job(["python", "t.py"], cluster=profile, partition="big", ntasks_per_node=64,
                   cpus_per_task=4)
