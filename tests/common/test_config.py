"""``Settings.from_env``: Horovod's variable names, units and defaults, and clear parse errors."""

from __future__ import annotations

import pytest

from hpc_horovod.common.config import Settings


def test_defaults_are_horovods():
    s = Settings.from_env({})
    assert s.fusion_threshold == 128 * 1024 * 1024
    assert s.cycle_time_ms == 1.0
    assert s.cache_capacity == 1024
    assert s.timeline == "" and s.timeline_mark_cycles is False
    assert s.stall_check is True
    assert s.stall_check_time_s == 60.0
    assert s.stall_shutdown_time_s == 0.0  # 0 = never shut down on a stall
    assert s.dynamic_process_sets is False
    assert s.hierarchical_allreduce is True
    assert s.log_level == "warning" and s.log_hide_time is False
    assert s == Settings()


def test_empty_values_mean_the_default():
    env = {name: "" for name in (
        "HOROVOD_FUSION_THRESHOLD", "HOROVOD_CYCLE_TIME", "HOROVOD_CACHE_CAPACITY",
        "HOROVOD_STALL_CHECK_DISABLE", "HOROVOD_STALL_CHECK_TIME_SECONDS",
        "HOROVOD_DYNAMIC_PROCESS_SETS", "HOROVOD_TIMELINE_MARK_CYCLES", "HOROVOD_LOG_LEVEL",
        "HOROVOD_LOG_HIDE_TIME")}
    assert Settings.from_env(env) == Settings()


def test_every_variable_is_read():
    s = Settings.from_env({
        "HOROVOD_FUSION_THRESHOLD": "0",
        "HOROVOD_CYCLE_TIME": "2.5",
        "HOROVOD_CACHE_CAPACITY": "0",
        "HOROVOD_TIMELINE": "/tmp/tl.json",
        "HOROVOD_TIMELINE_MARK_CYCLES": "1",
        "HOROVOD_STALL_CHECK_DISABLE": "1",
        "HOROVOD_STALL_CHECK_TIME_SECONDS": "5",
        "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS": "30",
        "HOROVOD_PEER_TIMEOUT_SECONDS": "120",
        "HOROVOD_DYNAMIC_PROCESS_SETS": "1",
        "HOROVOD_HIERARCHICAL_ALLREDUCE": "1",
        "HOROVOD_LOG_LEVEL": "DEBUG",
        "HOROVOD_LOG_HIDE_TIME": "1",
    })
    assert s == Settings(
        fusion_threshold=0, cycle_time_ms=2.5, cache_capacity=0, timeline="/tmp/tl.json",
        timeline_mark_cycles=True, stall_check=False, stall_check_time_s=5.0,
        stall_shutdown_time_s=30.0, peer_timeout_s=120.0, dynamic_process_sets=True,
        hierarchical_allreduce=True, log_level="debug", log_hide_time=True,
    )


@pytest.mark.parametrize("value,expected", [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), ("on", True), (" 1 ", True),
    ("0", False), ("false", False), ("no", False), ("off", False),
])
def test_flags(value, expected):
    assert Settings.from_env({"HOROVOD_DYNAMIC_PROCESS_SETS": value}).dynamic_process_sets \
        is expected
    assert Settings.from_env({"HOROVOD_STALL_CHECK_DISABLE": value}).stall_check is not expected


def test_timeline_dynamic_is_kept_verbatim():
    assert Settings.from_env({"HOROVOD_TIMELINE": "DYNAMIC"}).timeline == "DYNAMIC"


def test_numbers_accept_surrounding_spaces():
    s = Settings.from_env({"HOROVOD_FUSION_THRESHOLD": " 1048576 ", "HOROVOD_CYCLE_TIME": "0.5 "})
    assert (s.fusion_threshold, s.cycle_time_ms) == (1048576, 0.5)


@pytest.mark.parametrize("name,value,fragment", [
    ("HOROVOD_FUSION_THRESHOLD", "64MB", "is not a valid int"),
    ("HOROVOD_FUSION_THRESHOLD", "1.5", "is not a valid int"),
    ("HOROVOD_FUSION_THRESHOLD", "-1", "must not be negative"),
    ("HOROVOD_CACHE_CAPACITY", "lots", "is not a valid int"),
    ("HOROVOD_CYCLE_TIME", "1ms", "is not a valid float"),
    ("HOROVOD_CYCLE_TIME", "-5", "must not be negative"),
    ("HOROVOD_STALL_CHECK_TIME_SECONDS", "1m", "is not a valid float"),
    ("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "-1", "must not be negative"),
    ("HOROVOD_PEER_TIMEOUT_SECONDS", "never", "is not a valid float"),
])
def test_bad_numbers_are_value_errors_naming_the_variable(name, value, fragment):
    with pytest.raises(ValueError) as info:
        Settings.from_env({name: value})
    assert f"{name}={value!r}" in str(info.value) and fragment in str(info.value)


@pytest.mark.parametrize("value", ["nan", "inf"])
def test_non_finite_cycle_time_is_a_value_error(value):
    with pytest.raises(ValueError, match="HOROVOD_CYCLE_TIME"):
        Settings.from_env({"HOROVOD_CYCLE_TIME": value})


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("HOROVOD_FUSION_THRESHOLD", "4096")
    assert Settings.from_env().fusion_threshold == 4096
