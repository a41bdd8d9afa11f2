import pytest

from hpc_horovod.slurm import validate


@pytest.mark.parametrize("text, seconds", [
    ("00:10:00", 600), ("20:00:00", 72000), ("100:00:00", 360000), ("1-12:00:30", 129630),
])
def test_parse_time(text, seconds):
    assert validate.parse_time(text) == seconds


@pytest.mark.parametrize("text", ["1:00", "10", "00:61:00", "00:00:60", "1h", "", "00:00:00",
                                  "-1:00:00", "10:00:00\n#SBATCH --x"])
def test_bad_times_name_the_format(text):
    with pytest.raises(ValueError, match="HH:MM:SS"):
        validate.parse_time(text)


def test_format_time_keeps_hours_over_a_day():
    assert validate.format_time(360000) == "100:00:00"
    assert validate.format_time(129630) == "36:00:30"


@pytest.mark.parametrize("value", ["x; rm -rf ~", "a\nb", "a b", "$(id)", "-x", "", "a\rb",
                                   "name`id`"])
def test_tokens_refuse_shell_and_sbatch_syntax(value):
    with pytest.raises(ValueError, match="#SBATCH line"):
        validate.token(value, "--job-name")


def test_tokens_accept_slurm_names():
    for value in ("train", "gpu_p13", "qos_gpu-t3", "v100-32g", "run.2+x"):
        assert validate.token(value, "--partition") == value


def test_env_names_are_checked_values_are_not():
    assert validate.env_vars(["A=1", "B_2=x y;$(z)", "C="]) == (
        ("A", "1"), ("B_2", "x y;$(z)"), ("C", ""))
    assert validate.env_vars({"NCCL_DEBUG": "INFO"}) == (("NCCL_DEBUG", "INFO"),)
    for bad in (["1A=2"], ["A-B=1"], ["A B=1"], ["X\n=1"]):
        with pytest.raises(ValueError, match="environment variable name"):
            validate.env_vars(bad)
    with pytest.raises(ValueError, match="NAME=VALUE"):
        validate.env_vars(["NOVALUE"])


def test_modules_and_outputs():
    assert validate.modules(["arch/a100", " pytorch-gpu/py3/2.3.0 ", ""]) == (
        "arch/a100", "pytorch-gpu/py3/2.3.0")
    with pytest.raises(ValueError, match="module name"):
        validate.modules(["x;y"])
    assert validate.output_pattern("logs/%x-%A_%a.out") == "logs/%x-%A_%a.out"
    for bad in ("a b.out", "x\n#SBATCH --uid=0", "$HOME/x"):
        with pytest.raises(ValueError, match="--output"):
            validate.output_pattern(bad)


def test_accounts():
    assert validate.account("abc@v100") == "abc@v100"
    with pytest.raises(ValueError, match="--account"):
        validate.account("abc def")


def test_positive_rejects_non_integers():
    with pytest.raises(TypeError):
        validate.positive("2", "--nodes")
    with pytest.raises(ValueError, match="at least 1"):
        validate.positive(0, "--nodes")
