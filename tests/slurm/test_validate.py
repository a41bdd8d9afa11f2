import math

import pytest

from hpc_horovod.slurm import validate

#: SLURM's six formats (``man sbatch``, --time), and what each means in seconds; the same
#: strings are checked against the local SLURM's own reading in test_real_slurm.py
SLURM_TIMES = [
    ("30", 1800), ("90", 5400), ("010", 600),                      # MM (minutes unbounded)
    ("1:30", 90), ("90:30", 5430), ("0:05", 5),                   # MM:SS
    ("00:10:00", 600), ("20:00:00", 72000), ("100:00:00", 360000),  # HH:MM:SS
    ("1-0", 86400), ("2-12", 216000),                             # D-HH
    ("1-2:30", 95400),                                            # D-HH:MM
    ("1-12:00:30", 129630), ("0-0:0:1", 1),                       # D-HH:MM:SS
    ("UNLIMITED", math.inf), ("INFINITE", math.inf), ("unlimited", math.inf),  # no limit
    ("0", math.inf), ("00:00:00", math.inf),                      # sbatch's 0: no limit either
]
#: refused: not a time, or a later field out of range (which SLURM would silently carry into
#: the next one)
BAD_TIMES = ["20h", "1:2:3:4", "", "-1", "-1:00:00", "UNLIMITEDX", "1-",
             "00:61:00", "00:00:60", "61:61", "1-25", "1-2:61", "10:00:00\n#SBATCH --x",
             "1 0", "١٠"]


@pytest.mark.parametrize("text, seconds", SLURM_TIMES)
def test_parse_time(text, seconds):
    assert validate.parse_time(text) == seconds


@pytest.mark.parametrize("text", BAD_TIMES)
def test_bad_times_name_the_value_and_the_formats(text):
    with pytest.raises(ValueError, match=r"--time .* is not a SLURM time") as info:
        validate.parse_time(text)
    assert repr(text) in str(info.value) and "MM:SS" in str(info.value)


@pytest.mark.parametrize("text, seconds", [("USR2@300", 300), ("SIGUSR2@90", 90), ("usr2", 60),
                                           ("12@30", 30), ("B:USR2@300", 300)])
def test_signal(text, seconds):
    assert validate.signal_seconds(text) == seconds


@pytest.mark.parametrize("text, error", [("USR1@300", "USR2@SECONDS"), ("B:USR1@300", "USR2@"),
                                         ("USR2@5m", "USR2@SECONDS")])
def test_bad_signals(text, error):
    with pytest.raises(ValueError, match=error):
        validate.signal_seconds(text)


def test_format_time_keeps_hours_over_a_day():
    assert validate.format_time(math.inf) == "UNLIMITED"
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
    with pytest.raises(ValueError, match="--env expects NAME=VALUE, got 'NOVALUE'"):
        validate.env_vars(["NOVALUE"])
    assert validate.assignments(["A=b=c", "B="], "--setenv") == {"A": "b=c", "B": ""}


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
