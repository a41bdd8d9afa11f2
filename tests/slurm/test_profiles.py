import textwrap

import pytest

from hpc_horovod.slurm.profiles import get_profile, load_profiles, user_profiles_path

NO_USER_FILE = {"HPC_HOROVOD_CLUSTERS": "/nonexistent/clusters.toml"}


def test_builtin_profiles():
    profiles = load_profiles(NO_USER_FILE)
    assert {"generic", "jean-zay", "oscar"} <= set(profiles)
    jz = profiles["jean-zay"]
    assert jz.hint_nomultithread and jz.srun_mpi == "pmix" and jz.template == "jean-zay"
    p13, p2 = jz.partitions["gpu_p13"], jz.partitions["gpu_p2"]
    assert (p13.gpus_per_node, p13.cpus_per_task, p13.account_suffix) == (4, 10, "v100")
    assert (p2.gpus_per_node, p2.cpus_per_task) == (8, 3)
    a100, h100 = jz.constraints["a100"], jz.constraints["h100"]
    assert (a100.gpus_per_node, a100.cpus_per_task, a100.modules) == (8, 8, ("arch/a100",))
    assert (h100.gpus_per_node, h100.cpus_per_task, h100.account_suffix) == (4, 24, "h100")
    limits = {name: q.max_time // 3600 for name, q in jz.qos.items()}
    assert limits["qos_gpu-t3"] == 20 and limits["qos_gpu-t4"] == 100
    assert limits["qos_gpu-dev"] == 2
    assert p13.default_qos == "qos_gpu-t3"
    assert set(jz.storage) == {"WORK", "SCRATCH", "DSDIR"}
    oscar = profiles["oscar"]
    assert oscar.partitions["gpu-he"].gpus_per_node == 4
    assert oscar.partitions["batch"].gpus_per_node == 0 and not oscar.qos
    assert not profiles["generic"].partitions


def test_user_file_overrides_and_adds_clusters(tmp_path):
    path = tmp_path / "clusters.toml"
    path.write_text(textwrap.dedent("""\
        [jean-zay]
        default_modules = ["pytorch-gpu/py3/2.3.0"]
        [jean-zay.partitions.gpu_p13]
        cpus_per_task = 8

        [mylab]
        based_on = "generic"
        srun_mpi = "pmi2"
        default = "gpu"
        [mylab.partitions.gpu]
        gpus_per_node = 2
        cpus_per_task = 6
        max_time = "48:00:00"
        """))
    profiles = load_profiles({"HPC_HOROVOD_CLUSTERS": str(path)})
    jz = profiles["jean-zay"]
    assert jz.default_modules == ("pytorch-gpu/py3/2.3.0",)
    assert jz.partitions["gpu_p13"].cpus_per_task == 8
    assert jz.partitions["gpu_p13"].gpus_per_node == 4  # the rest of the table is kept
    assert jz.hint_nomultithread
    lab = profiles["mylab"]
    assert lab.srun_mpi == "pmi2" and lab.partitions["gpu"].max_time == 48 * 3600
    assert lab.source == str(path)


@pytest.mark.parametrize("text, error", [
    ("[x]\nbased_on = 'nowhere'\n", "unknown cluster 'nowhere'"),
    ("[x]\npartitons = {}\n", "unknown keys"),
    ("[x]\n[x.partitions.p]\ngpus = 4\n", "unknown keys"),
    ("[x]\n[x.partitions.p]\nqos = ['q']\n", "does not define"),
    ("[x]\ndefault = 'p'\n", "neither a partition"),
    ("[x]\n[x.partitions.p]\nmax_time = '100h'\n", "'100h' is not a SLURM time"),
    ("x = 1\n", "must be a table"),
    ("[x\n", "clusters.toml"),
])
def test_bad_user_files_are_explained(tmp_path, text, error):
    path = tmp_path / "clusters.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=error):
        load_profiles({"HPC_HOROVOD_CLUSTERS": str(path)})


def test_user_file_location():
    assert str(user_profiles_path({"HOME": "/h"})) == "/h/.config/hpc_horovod/clusters.toml"
    assert str(user_profiles_path({"XDG_CONFIG_HOME": "/c", "HOME": "/h"})) == \
        "/c/hpc_horovod/clusters.toml"


def test_unknown_cluster_lists_the_known_ones():
    with pytest.raises(ValueError, match="generic, jean-zay, oscar"):
        get_profile("jeanzay", NO_USER_FILE)
