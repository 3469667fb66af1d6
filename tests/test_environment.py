"""dl4py.environment(): DL4J's CudaEnvironment settings, their sources and their effects."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import dl4py
from dl4py.backend.cuda_environment import (
    DEFAULTS,
    VARIABLES,
    Environment,
    _reset_environment_for_tests,
    environment,
    parse_conf,
    parse_size,
)
from dl4py.backend.environment_settings import _MIN_CHUNK_MIB
from dl4py.backend.info import collect_info, format_info
from dl4py.config import EnvironmentConfig, RunConfig
from dl4py.errors import BackendError, ConfigError

ROOT = Path(__file__).resolve().parents[1]
# PyTorch's own allocator-settings parser, kept before the fixture stubs it (it is in libc10,
# so it parses on a CPU-only build too).
PYTORCH_SETTER = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
PYTORCH_GETTER = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
NETWORK = {
    "input_type": {"type": "feed_forward", "size": 4},
    "layers": [{"type": "output", "n_out": 3}],
}


def _flags():
    return (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled())


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """A fresh process Environment, no setting variables, and torch flags restored after.

    CUDA counts as not started (a test that means "after it started" says so), even where an
    earlier test in this process started it; and nothing reaches PyTorch's allocator, whose
    settings would outlive the test. The gpu tests run in fresh processes, past both stubs.
    """
    names = [v for v in os.environ if v.startswith(("DL4PY_", "ND4J_")) and v != "DL4PY_DATA"]
    for var in {*names, *VARIABLES}:
        monkeypatch.setenv(var, "")  # so that monkeypatch restores it, even if it was unset
        monkeypatch.delenv(var)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch._C, "_accelerator_setAllocatorSettings", lambda conf: None, raising=False)
    saved = _flags()
    _reset_environment_for_tests()
    yield monkeypatch
    _reset_environment_for_tests()
    tf32_mm, tf32_cudnn, benchmark, cudnn_det, det, warn_only = saved
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32_mm, tf32_cudnn
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = benchmark, cudnn_det
    if _flags()[4:] != (det, warn_only):
        torch.use_deterministic_algorithms(det, warn_only=warn_only)


@pytest.fixture
def allocator_pushes(clean_environment):
    """The strings dl4py hands PyTorch's allocator-settings setter, on a build that counts as
    having CUDA (dl4py pushes nothing on one without)."""
    pushes: list[str] = []
    clean_environment.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    clean_environment.setattr(torch._C, "_accelerator_setAllocatorSettings", pushes.append, raising=False)
    return pushes


# -- values ------------------------------------------------------------------------------

@pytest.mark.parametrize("text, size", [
    (1024, 1024), ("1024", 1024), ("6GB", 6 * 10**9), ("512MiB", 512 * 2**20), ("1kb", 1000),
    ("2 KiB", 2048), ("1.5GiB", 3 * 2**29), ("7b", 7), ("3gib", 3 * 2**30),
])
def test_sizes_accept_bytes_and_units(text, size):
    assert parse_size(text, "x") == size


@pytest.mark.parametrize("text", ["6XB", "GB", "-1", "0", "1e9", True, 1.5, [1]])
def test_bad_sizes_name_the_setting(text):
    with pytest.raises(ConfigError, match="^max_cacheable_chunk: "):
        Environment(max_cacheable_chunk=text)


@pytest.mark.parametrize("name, value, message", [
    ("gc_threshold", 1.0, "strictly between 0 and 1"),
    ("max_device_cache", 1.5, "fraction in \\(0, 1\\] or a whole number of bytes"),
    ("max_device_cache", 0, "fraction"),
    ("max_cacheable_chunk", "16MB", "at least 20 MiB"),
    ("max_cacheable_chunk", 20 * 2**20 - 1, "at least 20 MiB"),  # PyTorch's "mb" round down
    ("devices", [], "non-empty list"),
    ("devices", [0, 0], "twice"),
    ("devices", ["0"], "device indices"),
    ("compile", "fast", "off, default, max-autotune"),
    ("caching", 1, "true or false"),
    ("debug", None, "must not be null"),
    ("tf23", True, "unknown environment setting"),
])
def test_assignment_validates_and_names_the_setting(name, value, message):
    env = Environment()
    with pytest.raises(ConfigError, match=f"^{name}: .*{message}"):
        setattr(env, name, value)
    assert env.to_dict() == DEFAULTS  # nothing half-set


def test_defaults_round_trip_as_plain_data():
    env = Environment(devices=[1, 0], max_device_cache="6GB", compile="MAX-AUTOTUNE", tf32=True)
    data = env.to_dict()
    assert json.loads(json.dumps(data)) == data
    assert data["devices"] == [1, 0] and data["compile"] == "max-autotune"
    assert Environment.from_dict(data) == env
    assert pickle.loads(pickle.dumps(env)) == env
    assert Environment().to_dict() == DEFAULTS
    assert env.devices == (1, 0) and env.max_device_cache == "6GB"


def test_max_device_cache_is_a_fraction_up_to_one_and_bytes_above():
    from dl4py.backend.cuda_environment import device_cache_limit

    assert device_cache_limit(0.05) == ("fraction", 0.05)
    assert device_cache_limit(1) == ("fraction", 1.0)
    assert device_cache_limit("0.5") == ("fraction", 0.5)
    assert device_cache_limit("6GB") == ("bytes", 6 * 10**9)
    assert device_cache_limit(2**30) == ("bytes", 2**30)


# -- sources and precedence -------------------------------------------------------------

def test_variables_are_parsed_and_named_in_errors():
    env = Environment.from_environ({
        "DL4PY_MAX_DEVICE_CACHE": "6GB", "DL4PY_TF32": "1", "DL4PY_DEVICES": "0, 1",
        "DL4PY_COMPILE": "max-autotune", "DL4PY_CACHING": "off", "DL4PY_GC_THRESHOLD": "0.7",
        "DL4PY_MAX_CACHEABLE_CHUNK": "1073741824", "DL4PY_CUDA_GRAPHS": "yes",
    })
    assert env.max_device_cache == "6GB" and env.tf32 is True and env.devices == (0, 1)
    assert env.compile == "max-autotune" and env.caching is False and env.gc_threshold == 0.7
    assert env.max_cacheable_chunk == 2**30 and env.cuda_graphs is True
    assert env.set_by()["tf32"] == "DL4PY_TF32"
    assert Environment.from_environ({"DL4PY_MAX_DEVICE_CACHE": "0.8"}).max_device_cache == 0.8
    for var, raw, message in [("DL4PY_TF32", "maybe", "1/0, true/false"),
                              ("DL4PY_DEVICES", "0;1", "separated by commas"),
                              ("DL4PY_MAX_DEVICE_CACHE", "lots", "not a size"),
                              ("DL4PY_GC_THRESHOLD", "high", "between 0 and 1")]:
        with pytest.raises(ConfigError, match=f"^{var}: .*{message}"):
            Environment.from_environ({var: raw})


def test_nd4j_and_pytorch_variables_are_read_below_dl4py_ones():
    env = Environment.from_environ({
        "ND4J_CUDA_FORCE_SINGLE_GPU": "true", "ND4J_DEBUG": "1",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:256,backend:native",
        "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
    })
    assert env.allow_multi_gpu is False and env.debug is True
    assert env.expandable_segments is True and env.max_cacheable_chunk == "256MiB" and not env.caching
    assert env.set_by()["allow_multi_gpu"] == "ND4J_CUDA_FORCE_SINGLE_GPU"
    env = Environment.from_environ({"ND4J_CUDA_FORCE_SINGLE_GPU": "true", "DL4PY_ALLOW_MULTI_GPU": "1",
                                    "CUDA_LAUNCH_BLOCKING": "1", "DL4PY_DEBUG": "0"})
    assert env.allow_multi_gpu is True and env.debug is False


def test_process_environment_comes_from_variables_once(clean_environment):
    clean_environment.setenv("DL4PY_TF32", "true")
    env = environment()
    assert env is environment() and env.tf32 is True
    assert torch.backends.cuda.matmul.allow_tf32 == _flags()[0]  # reading applies nothing


def test_precedence_code_and_config_over_variables_over_defaults(clean_environment):
    clean_environment.setenv("DL4PY_TF32", "1")
    clean_environment.setenv("DL4PY_CUDNN_BENCHMARK", "1")
    clean_environment.setenv("DL4PY_COMPILE", "default")
    env = environment()
    config = RunConfig.from_dict({"network": NETWORK, "environment": {"tf32": False, "pinned_memory": False}})
    env.update_from_config(config.environment)
    assert env.tf32 is False and env.pinned_memory is False  # named in the config: config wins
    assert env.cudnn_benchmark is True and env.compile == "default"  # null there: the variable stands
    assert env.allow_multi_gpu is True  # nowhere: the default
    env.compile = "max-autotune"
    assert env.compile == "max-autotune"
    assert env.set_by() == {"tf32": "config", "cudnn_benchmark": "DL4PY_CUDNN_BENCHMARK",
                            "compile": "code", "pinned_memory": "config"}
    assert torch.backends.cuda.matmul.allow_tf32 is False and torch.backends.cudnn.benchmark is True


def test_temporarily_restores_values_and_where_they_came_from():
    env = Environment.from_environ({"DL4PY_TF32": "1"})
    with env.temporarily(tf32=False, fused_optimizer="off") as inside:
        assert inside.tf32 is False and inside.fused_optimizer == "off"
        assert env.set_by() == {"tf32": "code", "fused_optimizer": "code"}
    assert env.tf32 is True and env.fused_optimizer == "auto"
    assert env.set_by() == {"tf32": "DL4PY_TF32"}  # not "code": the block changed nothing for good
    with pytest.raises(ConfigError, match="fused_optimizer"):
        with env.temporarily(fused_optimizer="sometimes"):
            pass
    assert env.set_by() == {"tf32": "DL4PY_TF32"}


def test_temporarily_takes_back_the_variables_it_wrote():
    env = environment()
    env.apply()
    started = {var: os.environ.get(var) for var in VARIABLES}
    with env.temporarily(debug=True, caching=False, deterministic=True, expandable_segments=True):
        assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1" and os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1"
        assert "expandable_segments:True" in os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert {var: os.environ.get(var) for var in VARIABLES} == started  # child processes see no trace
    assert env.debug is False and env.caching is True and env.set_by() == {}


def test_config_section_round_trips_and_validates():
    section = {"allow_multi_gpu": False, "devices": [0, 1], "max_device_cache": "6GB",
               "max_cacheable_chunk": "512MiB", "gc_threshold": 0.8, "expandable_segments": True,
               "caching": True, "pinned_memory": True, "tf32": True, "cudnn_benchmark": True,
               "deterministic": False, "debug": False, "compile": "max-autotune", "cuda_graphs": True,
               "device_data": "on", "fused_optimizer": "off", "channels_last": "auto"}
    data = RunConfig.from_dict({"network": NETWORK, "environment": section}).to_dict()
    assert data["environment"] == section
    assert RunConfig.from_dict(data).to_dict() == data
    empty = RunConfig.from_dict({"network": NETWORK}).to_dict()["environment"]
    assert empty == {name: None for name in DEFAULTS}  # null: not set here
    assert EnvironmentConfig.from_dict({"compile": False}).compile == "off"  # YAML's bare `off`
    assert EnvironmentConfig.from_dict({"max_device_cache": 1.0}).max_device_cache == 1
    with pytest.raises(ConfigError, match=r"^environment\.gc_threshold: .*between 0 and 1"):
        RunConfig.from_dict({"network": NETWORK, "environment": {"gc_threshold": 2}})
    with pytest.raises(ConfigError, match=r"^environment\.max_device_cache: .*not a size"):
        RunConfig.from_dict({"network": NETWORK, "environment": {"max_device_cache": "six"}})
    with pytest.raises(ConfigError, match=r"environment\.tf33: unknown field"):
        RunConfig.from_dict({"network": NETWORK, "environment": {"tf33": True}})
    overridden = RunConfig.from_dict({"network": NETWORK}).with_overrides(
        ["environment.compile=off", "environment.devices=[1]", "environment.max_device_cache=0.5"])
    assert overridden.environment.compile == "off" and overridden.environment.devices == (1,)


def test_merging_checks_settings_that_cannot_act_together():
    with pytest.raises(ConfigError, match=r"^environment\.gc_threshold: acts only under a memory cap"):
        Environment().update_from_config({"gc_threshold": 0.8})
    with pytest.raises(ConfigError, match=r"^environment\.max_device_cache: has no effect with caching off"):
        Environment().update_from_config({"caching": False, "max_device_cache": 0.5})
    with pytest.raises(ConfigError, match=r"^cudnn_benchmark: contradicts deterministic"):
        Environment.from_dict({"deterministic": True, "cudnn_benchmark": True})
    Environment().update_from_config({"gc_threshold": 0.8, "max_device_cache": "4GiB"})


def test_pytorchs_own_variables_are_not_policed_and_stay_attributed(clean_environment):
    clean_environment.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.6")
    env = environment()
    env.check()  # PyTorch's own setting without a cap: PyTorch's business, not dl4py's
    worker = Environment.from_dict(env.to_dict())
    assert worker.set_by()["gc_threshold"] == "PYTORCH_CUDA_ALLOC_CONF" and worker == env
    worker.check()
    with pytest.raises(ConfigError, match="^gc_threshold: acts only under a memory cap"):
        Environment(gc_threshold=0.5).check()


# -- effects ----------------------------------------------------------------------------

def test_torch_flags_take_effect_and_unset_ones_are_left_alone():
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default for convolutions
    Environment(cudnn_benchmark=False).apply()
    assert torch.backends.cudnn.allow_tf32 is True  # tf32 not set: PyTorch's own flags stand
    env = environment().update(tf32=True, cudnn_benchmark=True)
    assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
    assert torch.backends.cudnn.benchmark
    env.update(tf32=False, cudnn_benchmark=False, deterministic=True)
    assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    assert torch.are_deterministic_algorithms_enabled() and torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    env.deterministic = False
    assert not torch.are_deterministic_algorithms_enabled() and "CUBLAS_WORKSPACE_CONFIG" not in os.environ


def test_allocator_variables_are_composed_and_taken_back():
    env = environment().update(max_cacheable_chunk="1GiB", expandable_segments=True)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:1024,expandable_segments:True"
    env.update(max_device_cache=0.9, gc_threshold=0.6)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == (
        "max_split_size_mb:1024,garbage_collection_threshold:0.6,expandable_segments:True")
    env.update(caching=False, debug=True, max_device_cache=None, gc_threshold=None,
               max_cacheable_chunk=None, expandable_segments=False)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ  # dl4py created it, dl4py removes it
    assert os.environ["PYTORCH_NO_CUDA_MEMORY_CACHING"] == "1" and os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
    env.update(caching=True, debug=False)
    assert not any(var in os.environ for var in VARIABLES)


def test_allocator_settings_merge_with_the_users_own(clean_environment):
    theirs = "roundup_power2_divisions:[64:8,>:1],max_split_size_mb:128"
    clean_environment.setenv("PYTORCH_CUDA_ALLOC_CONF", theirs)
    env = environment()
    assert env.max_cacheable_chunk == "128MiB"
    env.expandable_segments = True
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == theirs + ",expandable_segments:True"
    env.max_cacheable_chunk = 128 * 2**20  # the same value: nothing to refuse
    with pytest.raises(ConfigError, match="max_split_size_mb:128.*max_split_size_mb:512"):
        env.max_cacheable_chunk = "512MiB"
    assert env.max_cacheable_chunk == 128 * 2**20
    env.expandable_segments = False
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == theirs
    clean_environment.setenv("CUDA_LAUNCH_BLOCKING", "1")
    with pytest.raises(ConfigError, match="CUDA_LAUNCH_BLOCKING=1 is set .* debug=False"):
        Environment(debug=False).apply()


def test_a_generic_alloc_conf_is_merged_where_torch_reads_it(clean_environment):
    clean_environment.setenv("PYTORCH_ALLOC_CONF", "backend:native")
    environment().expandable_segments = True
    assert os.environ["PYTORCH_ALLOC_CONF"] == "backend:native,expandable_segments:True"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ


def test_changes_cuda_reads_at_start_are_refused_once_it_has_started(clean_environment):
    clean_environment.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env = environment()
    clean_environment.setattr(torch.cuda, "is_initialized", lambda: True)
    env.expandable_segments = True  # what is in force already: fine
    env.update(tf32=True, cudnn_benchmark=True, pinned_memory=False)  # flags can change any time
    for name, value in [("caching", False), ("debug", True), ("deterministic", True)]:
        with pytest.raises(BackendError, match=f"^{name}=.*CUDA is already initialised.*"
                                               f"DL4PY_{name.upper()}="):
            env.update(**{name: value}, cudnn_benchmark=False)
        assert env.to_dict()[name] == DEFAULTS[name]
    start_only = ("PYTORCH_NO_CUDA_MEMORY_CACHING", "CUDA_LAUNCH_BLOCKING", "CUBLAS_WORKSPACE_CONFIG")
    assert not any(var in os.environ for var in start_only)  # nothing half-applied
    # Contradicting the user's own variable is a ConfigError whenever it happens.
    with pytest.raises(ConfigError, match="PYTORCH_CUDA_ALLOC_CONF already sets expandable_segments:True"):
        env.expandable_segments = False
    assert env.expandable_segments is True
    clean_environment.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")  # set before CUDA started
    env.update(deterministic=True, cudnn_benchmark=False)
    assert torch.are_deterministic_algorithms_enabled()


def test_allocator_settings_change_live_once_cuda_has_started(clean_environment, allocator_pushes):
    env = environment().update(expandable_segments=True)
    clean_environment.setattr(torch.cuda, "is_initialized", lambda: True)
    env.update(max_cacheable_chunk="1GiB", max_device_cache=0.9, gc_threshold=0.7)
    conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert parse_conf(conf) == {"max_split_size_mb": "1024", "garbage_collection_threshold": "0.7",
                                "expandable_segments": "True"}
    assert allocator_pushes[-1] == conf  # PyTorch's allocator has it now, not only the variable
    env.expandable_segments = False
    assert "expandable_segments" not in os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    assert parse_conf(allocator_pushes[-1])["expandable_segments"] == "False"

    def refuse(conf):
        raise ValueError("CachingAllocator option refused")

    clean_environment.setattr(torch._C, "_accelerator_setAllocatorSettings", refuse)
    before = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    with pytest.raises(BackendError, match="PyTorch refused the allocator settings.*option refused"):
        env.max_cacheable_chunk = "2GiB"
    assert env.max_cacheable_chunk == "1GiB" and os.environ["PYTORCH_CUDA_ALLOC_CONF"] == before


def test_settings_back_to_default_turn_expandable_segments_off_in_pytorch(allocator_pushes):
    env = environment().update(expandable_segments=True, max_cacheable_chunk="1GiB")
    assert allocator_pushes[-1] == os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    env.update(expandable_segments=False, max_cacheable_chunk=None)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    # An empty string would leave PyTorch's expandable_segments on: its parser resets the
    # other keys when they are absent, but not that one.
    assert allocator_pushes[-1] == "expandable_segments:False"


@pytest.mark.skipif(PYTORCH_SETTER is None or PYTORCH_GETTER is None,
                    reason="this PyTorch has no accelerator allocator-settings setter")
def test_pushed_settings_are_ones_pytorchs_parser_accepts(allocator_pushes):
    env = environment().update(max_cacheable_chunk=f"{_MIN_CHUNK_MIB}MiB", max_device_cache=0.9,
                               gc_threshold=0.7, expandable_segments=True)
    env.update(expandable_segments=False, gc_threshold=None)
    saved = PYTORCH_GETTER()
    try:
        for conf in allocator_pushes:
            PYTORCH_SETTER(conf)  # raises on a key or value format PyTorch does not take
            assert PYTORCH_GETTER() == conf
        with pytest.raises((ValueError, RuntimeError), match="True.*False"):
            PYTORCH_SETTER("expandable_segments:false")  # why dl4py writes True/False, capitalised
        # dl4py's smallest chunk is PyTorch's: it takes the bound, refuses one MiB less.
        with pytest.raises((ValueError, RuntimeError), match=rf"max_split_size_mb too small, must be >= {_MIN_CHUNK_MIB}\b"):
            PYTORCH_SETTER(f"max_split_size_mb:{_MIN_CHUNK_MIB - 1}")
    finally:
        PYTORCH_SETTER(saved)


def test_a_variable_applied_too_late_says_how_to_apply_it_in_time(clean_environment):
    clean_environment.setenv("DL4PY_DEBUG", "1")
    clean_environment.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.raises(BackendError, match="came from DL4PY_DEBUG.*environment\\(\\)\\.apply\\(\\)"):
        environment().apply()


def test_a_worker_rebuilds_and_applies_the_same_settings(clean_environment):
    parent = environment().update(expandable_segments=True, caching=True, debug=True, tf32=True)
    conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
    data = json.loads(json.dumps(parent.to_dict()))  # what is sent to a worker
    _reset_environment_for_tests()  # a fresh process that inherited the variables
    worker = Environment.from_dict(data)
    worker.apply()
    assert environment() is worker and worker == parent
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == conf and os.environ["CUDA_LAUNCH_BLOCKING"] == "1"


def test_usable_cuda_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert Environment().usable_cuda_devices() == [0, 1, 2, 3]
    assert Environment(devices=[3, 1]).usable_cuda_devices() == [3, 1]
    assert Environment(allow_multi_gpu=False).usable_cuda_devices() == [0]
    assert Environment(devices=[2, 3], allow_multi_gpu=False).usable_cuda_devices() == [2]
    with pytest.raises(BackendError, match=r"devices lists \[5\].*only 4 CUDA device"):
        Environment(devices=[1, 5]).usable_cuda_devices()
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert Environment(devices=[1]).usable_cuda_devices() == []


def test_apply_on_a_device_sets_the_memory_cap(monkeypatch):
    fractions = {}
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(total_memory=8 * 10**9))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction",
                        lambda f, i: fractions.__setitem__(i, f))
    env = Environment(max_device_cache="6GB")
    env.apply(torch.device("cuda", 1))
    assert fractions == {1: 0.75} and environment() is env  # applying makes it the process's one
    env.max_device_cache = 0.05
    env.apply("cuda:1")
    assert fractions[1] == 0.05
    env.max_device_cache = None
    env.apply("cuda:1")
    assert fractions[1] == 1.0  # the cap dl4py set is lifted again
    env.apply("cpu")  # nothing per-device on the CPU
    with pytest.raises(BackendError, match="cuda:1 is not among the devices this environment permits"):
        Environment(allow_multi_gpu=False).apply("cuda:1")


def test_info_reports_the_settings(clean_environment):
    clean_environment.setenv("DL4PY_MAX_DEVICE_CACHE", "6GB")
    info = collect_info()
    assert info["environment"] == environment().to_dict()
    assert info["environment_detail"]["set_by"] == {"max_device_cache": "DL4PY_MAX_DEVICE_CACHE"}
    assert "environment    max_device_cache 6GB (DL4PY_MAX_DEVICE_CACHE)" in format_info(info)


def test_info_reports_a_device_list_no_backend_can_satisfy(clean_environment):
    """One visible CUDA device (faked) and devices=0,1: info says why, instead of failing."""
    clean_environment.setenv("DL4PY_DEVICES", "0,1")
    clean_environment.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    clean_environment.setattr(torch.cuda, "device_count", lambda: 1)
    clean_environment.setattr(torch.cuda, "is_available", lambda: True)
    clean_environment.setattr(torch.cuda, "get_device_properties", lambda i: SimpleNamespace(
        name="Fake GPU", major=8, minor=0, multi_processor_count=108, total_memory=40 * 2**30))
    clean_environment.setattr(torch.cuda, "mem_get_info", lambda i: (30 * 2**30, 40 * 2**30))
    info = collect_info()
    assert info["backend"] is None and info["device"] is None
    assert "devices lists [1], but only 1 CUDA device(s) are visible" in info["backend_reason"]
    assert info["environment_detail"]["usable_cuda_devices"].startswith("devices lists [1]")
    assert [d["name"] for d in info["devices"]] == ["Fake GPU"]
    text = format_info(info)
    assert "backend        none" in text and "devices lists [1]" in text


def test_info_command_in_a_fresh_process_reports_dl4py_variables():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DL4PY_", "ND4J_")) and k not in VARIABLES}
    env.update(PYTHONPATH=str(ROOT / "src"), DL4PY_TF32="1", DL4PY_MAX_DEVICE_CACHE="6GB",
               DL4PY_DEVICES="0,1", DL4PY_COMPILE="max-autotune", ND4J_CUDA_FORCE_SINGLE_GPU="true")
    out = subprocess.run([sys.executable, "-m", "dl4py", "info", "--json"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    reported = json.loads(out)["environment"]
    assert reported["tf32"] is True and reported["max_device_cache"] == "6GB"
    assert reported["devices"] == [0, 1] and reported["compile"] == "max-autotune"
    assert reported["allow_multi_gpu"] is False


def test_public_names():
    assert dl4py.environment is environment and dl4py.Environment is Environment


# -- on a CUDA device (each in a fresh process, so CUDA starts with the settings in force) --

def _run_fresh(code: str, **variables: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DL4PY_", "ND4J_")) and k not in VARIABLES}
    env.update(PYTHONPATH=str(ROOT / "src"), **variables)
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.gpu
def test_gpu_allocator_settings_are_what_pytorch_uses():
    _run_fresh("""
        import os, torch, dl4py
        env = dl4py.environment()
        env.apply(torch.device("cuda", 0))
        x = torch.ones(1024, device="cuda")  # CUDA starts here, reading the variables
        conf = os.environ["PYTORCH_CUDA_ALLOC_CONF"]
        assert conf == "max_split_size_mb:256,garbage_collection_threshold:0.7,expandable_segments:True", conf
        # PyTorch 2.12+ can read the live settings back; older builds only show them by their effects below.
        get = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
        assert get is None or get() == conf, get()
        stats = torch.cuda.memory_stats()
        assert stats["max_split_size"] == 256 * 2**20, stats["max_split_size"]

        def segment_of(tensor):  # the allocator's segment holding the tensor
            ptr = tensor.data_ptr()
            return next(s for s in torch.cuda.memory_snapshot()
                        if s["address"] <= ptr < s["address"] + s["total_size"])

        def oversize_now():
            return torch.cuda.memory_stats()["oversize_allocations.current"]

        MiB = 2**20
        kept = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        assert segment_of(kept)["is_expandable"] is True
        before = oversize_now()
        big = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        assert oversize_now() == before + 1  # 300 MiB is above max_split_size_mb:256
        del big
        # Changed while CUDA runs: the allocator reads these on every allocation.
        env.max_cacheable_chunk = "512MiB"
        big = torch.empty(300 * MiB, dtype=torch.uint8, device="cuda")
        assert oversize_now() == before, "max_split_size_mb:512 did not reach the allocator"
        del big
        env.expandable_segments = False
        assert get is None or get().endswith("expandable_segments:False"), get()
        torch.cuda.empty_cache()  # so the next block cannot come from an expandable segment
        fresh = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        assert segment_of(fresh)["is_expandable"] is False
        assert segment_of(kept)["is_expandable"] is True
        try:
            env.debug = True
        except dl4py.BackendError as exc:
            assert "already initialised" in str(exc)
        else:
            raise AssertionError("a change CUDA reads only at start was accepted")
    """, DL4PY_MAX_CACHEABLE_CHUNK="256MiB", DL4PY_GC_THRESHOLD="0.7", DL4PY_MAX_DEVICE_CACHE="0.9",
        DL4PY_EXPANDABLE_SEGMENTS="1")


@pytest.mark.gpu
def test_gpu_memory_cap_is_enforced():
    _run_fresh("""
        import torch, dl4py
        dl4py.environment().apply(torch.device("cuda", 0))
        total = torch.cuda.get_device_properties(0).total_memory
        small = torch.empty(int(total * 0.02), dtype=torch.uint8, device="cuda")
        try:
            torch.empty(int(total * 0.10), dtype=torch.uint8, device="cuda")
        except torch.cuda.OutOfMemoryError:
            pass
        else:
            raise AssertionError("allocated 10% of the device under a 5% cap")
    """, DL4PY_MAX_DEVICE_CACHE="0.05")


@pytest.mark.gpu
def test_gpu_debug_and_no_caching_reach_cuda():
    _run_fresh("""
        import os, torch, dl4py
        dl4py.environment().update(debug=True, caching=False, deterministic=True)
        torch.ones(1, device="cuda")
        assert os.environ["CUDA_LAUNCH_BLOCKING"] == "1"
        x = torch.empty(2**28, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        held = torch.cuda.mem_get_info()[0]
        del x
        torch.cuda.synchronize()
        assert torch.cuda.mem_get_info()[0] - held >= 2**27  # no cache: the driver got it back
        a = torch.randn(64, 64, device="cuda")
        (a @ a).sum().item()  # cuBLAS in deterministic mode: needs CUBLAS_WORKSPACE_CONFIG
    """)
