"""Where settings come from: defaults < ``--config`` file < ``EXPERTMESH_*`` environment < flags
given, through the real ``expertmesh`` parser; a bad key or value in any source is one line naming
it. Nothing here starts a server: settings are read and checked before anything starts."""

from pathlib import Path

import pytest
import yaml

from expertmesh.cli.main import build_parser, main
from expertmesh.config.settings import ConfigError, DataPlaneConfig, ServingConfig, settings_from_args
from expertmesh.models.resolve import data_plane_config


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch):
    """The settings' own variables only as each test sets them."""
    import os

    for name in list(os.environ):
        if name.startswith("EXPERTMESH_") and name != "EXPERTMESH_TEST_REDIS_URL":
            monkeypatch.delenv(name)


def _up(*argv):
    return build_parser().parse_args(["up", *map(str, argv)])


def _file(tmp_path, document) -> Path:
    path = tmp_path / "expertmesh.yaml"
    path.write_text(yaml.safe_dump(document) if not isinstance(document, str) else document)
    return path


def _one_error_line(capsys, argv) -> str:
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exit:  # argparse's own errors
        code = exit.code
    assert code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


def test_defaults_are_the_config_objects():
    serving = settings_from_args(ServingConfig, _up())
    assert serving == ServingConfig()
    plane = settings_from_args(DataPlaneConfig, _up(), fallback={"model": Path("m")})
    assert plane == DataPlaneConfig(model=Path("m"))


def test_file_sets_field_names_and_helm_keys(tmp_path, tiny_checkpoints):
    model = tiny_checkpoints("mixtral")
    path = _file(
        tmp_path,
        {
            "model": {"path": str(model), "dtype": "bfloat16"},
            "router": {"port": 6000, "healthPort": 6001, "http": {"enabled": True, "port": 8080}},
            "expertGroups": {"numCpus": 0.5},
            "redis": {"external": {"url": "redis://redis:6379/3"}},
            "groups": 3,
            "max_active_sequences": 4,
        },
    )
    args = _up("--config", path)
    plane = data_plane_config(args)
    assert (plane.model, plane.dtype, plane.group_num_cpus, plane.state_url, plane.groups) == (
        model,
        "bfloat16",
        0.5,
        "redis://redis:6379/3",
        3,
    )
    assert plane.model_name is None  # a local directory: served under its own name
    serving = settings_from_args(ServingConfig, args)
    assert (serving.port, serving.health_port, serving.http_port, serving.max_active_sequences) == (6000, 6001, 8080, 4)


def test_helm_switch_off_leaves_the_setting_unset(tmp_path):
    path = _file(tmp_path, {"router": {"http": {"enabled": False, "port": 8000}}})
    assert settings_from_args(ServingConfig, _up("--config", path)).http_port is None


def test_environment_overrides_the_file(tmp_path, monkeypatch):
    path = _file(tmp_path, {"groups": 3, "router": {"port": 6000}, "dtype": "float16"})
    monkeypatch.setenv("EXPERTMESH_GROUPS", "4")
    monkeypatch.setenv("EXPERTMESH_PORT", "7000")
    args = _up("--config", path)
    plane = settings_from_args(DataPlaneConfig, args, fallback={"model": Path("m")})
    assert (plane.groups, plane.dtype) == (4, "float16")  # dtype: the file's, nothing overrides it
    assert settings_from_args(ServingConfig, args).port == 7000


def test_flags_override_the_environment_and_the_file(tmp_path, monkeypatch):
    path = _file(tmp_path, {"groups": 3, "model": str(tmp_path / "from-file")})
    monkeypatch.setenv("EXPERTMESH_GROUPS", "4")
    monkeypatch.setenv("EXPERTMESH_MAX_ACTIVE_SEQUENCES", "8")
    monkeypatch.setenv("EXPERTMESH_MODEL", str(tmp_path / "from-env"))
    args = _up("--config", path, "--groups", 5, "--max-active", 2, "--model", tmp_path)
    plane = settings_from_args(DataPlaneConfig, args)
    assert (plane.groups, plane.model) == (5, tmp_path)
    assert settings_from_args(ServingConfig, args).max_active_sequences == 2


def test_the_environment_names_the_model_when_no_flag_does(tmp_path, monkeypatch):
    monkeypatch.setenv("EXPERTMESH_MODEL", str(tmp_path))
    assert data_plane_config(_up()).model == tmp_path


def test_unset_flags_do_not_hide_the_environment(monkeypatch):
    """The bug this replaces: every flag passed its own default and overrode EXPERTMESH_*."""
    for name, value in {
        "GROUPS": "3",
        "DTYPE": "bfloat16",
        "PORT": "6123",
        "HTTP_PORT": "8123",
        "STATE_URL": "redis://x/1",
    }.items():
        monkeypatch.setenv(f"EXPERTMESH_{name}", value)
    args = _up()
    plane = settings_from_args(DataPlaneConfig, args, fallback={"model": Path("m")})
    serving = settings_from_args(ServingConfig, args)
    assert (plane.groups, plane.dtype, plane.state_url) == (3, "bfloat16", "redis://x/1")
    assert (serving.port, serving.http_port) == (6123, 8123)


@pytest.mark.parametrize(
    ("argv", "env", "file", "expected"),
    [
        (
            ["--groups", "0"],
            {},
            None,
            "expertmesh up: error: --groups: Input should be greater than or equal to 1 (got 0)",
        ),
        (
            ["--max-active", "0"],
            {},
            None,
            "expertmesh up: error: --max-active: Input should be greater than or equal to 1",
        ),
        (
            [],
            {"EXPERTMESH_GROUPS": "many"},
            None,
            "expertmesh up: error: EXPERTMESH_GROUPS: Input should be a valid integer",
        ),
        (
            [],
            {"EXPERTMESH_DTYPE": "int8"},
            None,
            "expertmesh up: error: EXPERTMESH_DTYPE: Input should be 'float32', 'bfloat16'",
        ),
        (
            [],
            {"EXPERTMESH_PORT": "99999"},
            None,
            "expertmesh up: error: EXPERTMESH_PORT: Input should be less than or equal to 65535",
        ),
        (
            ["--router-device", "gpu"],
            {},
            None,
            "expertmesh up: error: --router-device: a device is auto, cpu, cuda or cuda:N (got 'gpu')",
        ),
        ([], {}, {"groups": -1}, "{file}: groups: Input should be greater than or equal to 1 (got -1)"),
        ([], {}, {"router": {"port": "http"}}, "{file}: router.port: Input should be a valid integer"),
        ([], {}, {"groupz": 3}, "config file {file}: unknown key 'groupz'"),
        ([], {}, {"router": {"replicas": 3}}, "config file {file}: unknown key 'router.replicas'"),
        ([], {}, "- groups\n", "config file {file} must be a mapping of settings, not list"),
        ([], {}, "groups: [1\n", "config file {file} is not YAML"),
    ],
)
def test_a_bad_key_or_value_is_one_line_naming_it(tmp_path, monkeypatch, capsys, argv, env, file, expected):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    if file is not None:
        path = _file(tmp_path, file)
        argv = ["--config", path, *argv]
        expected = expected.format(file=path)
    line = _one_error_line(capsys, ["up", *argv])
    assert expected in line, line


def test_a_bad_flag_type_is_one_line(capsys):
    line = _one_error_line(capsys, ["up", "--groups", "two"])
    assert line == "expertmesh up: error: argument --groups: invalid int value: 'two' (see expertmesh up --help)"


def test_a_missing_config_file_is_one_line(tmp_path, capsys):
    line = _one_error_line(capsys, ["up", "--config", tmp_path / "absent.yaml"])
    assert (
        line == f"expertmesh up: error: cannot read config file {tmp_path / 'absent.yaml'}: No such file or directory"
    )


def test_settings_are_checked_before_anything_starts(tmp_path, capsys):
    """A bad serving setting fails ahead of the model: no Ray, no checkpoint read."""
    line = _one_error_line(capsys, ["up", "--model", tmp_path / "absent", "--port", "-1"])
    assert "--port: Input should be greater than or equal to 0" in line


def test_hedge_delays_out_of_order_are_one_line_before_anything_starts(tmp_path, capsys, monkeypatch):
    line = _one_error_line(capsys, ["up", "--model", tmp_path / "absent", "--hedge-delay-min-s", "0.6"])
    assert line.endswith("hedge_delay_min_s (0.6) must not exceed hedge_delay_max_s (0.5)"), line
    monkeypatch.setenv("EXPERTMESH_HEDGE_DELAY_MAX_S", "0.01")
    line = _one_error_line(capsys, ["up", "--model", tmp_path / "absent"])
    assert line.endswith("hedge_delay_min_s (0.05) must not exceed hedge_delay_max_s (0.01)"), line
    plane = settings_from_args(
        DataPlaneConfig, _up("--model", tmp_path, "--hedge-calls", "false", "--hedge-delay-min-s", "0.01")
    )
    assert (plane.hedge_calls, plane.hedge_delay_min_s, plane.hedge_delay_max_s) == (False, 0.01, 0.01)


def test_every_setting_flag_says_its_default_and_variable():
    up = build_parser()._subparsers._group_actions[0].choices["up"]
    flags = {
        a.dest: a for a in up._actions if a.dest in DataPlaneConfig.model_fields or a.dest in ServingConfig.model_fields
    }
    assert {"model", "groups", "dtype", "state_url", "port", "http_port", "max_active_sequences"} <= set(flags)
    for dest, action in flags.items():
        assert action.default is None, dest  # unset unless given: the other sources decide
        assert f"env EXPERTMESH_{dest.upper()}" in action.help and "default: " in action.help, action.help


def test_config_error_is_an_input_error():
    with pytest.raises(ConfigError):
        settings_from_args(ServingConfig, _up("--port", "70000"))


def test_the_readme_example_config_file_means_what_it_says(tmp_path):
    readme = (Path(__file__).parents[1] / "docs" / "configuration.md").read_text()
    example = readme.split("# expertmesh up --config expertmesh.yaml\n", 1)[1].split("```", 1)[0]
    args = _up("--config", _file(tmp_path, example))
    plane = settings_from_args(DataPlaneConfig, args)
    serving = settings_from_args(ServingConfig, args)
    assert (str(plane.model), plane.dtype, plane.groups, plane.group_num_cpus) == (
        "/models/Mixtral-8x7B-v0.1",
        "bfloat16",
        4,
        1.0,
    )
    assert plane.state_url == "redis://redis:6379/0"
    assert (serving.port, serving.health_port, serving.http_port, serving.max_active_sequences) == (
        50051,
        50061,
        8000,
        16,
    )


def test_orchestrator_takes_the_same_settings(tmp_path, monkeypatch, capsys):
    """Its model, placement and store come through the same precedence; what it needs is named."""
    monkeypatch.setenv("EXPERTMESH_STATE_URL", "redis://127.0.0.1:1/0")
    line = _one_error_line(capsys, ["orchestrator", "--placement", tmp_path / "p.yaml"])
    assert line == "expertmesh orchestrator: error: --model is required (or EXPERTMESH_MODEL, or model in --config)"
    monkeypatch.setenv("EXPERTMESH_MODEL", str(tmp_path))
    line = _one_error_line(
        capsys, ["orchestrator", "--config", _file(tmp_path, {"redis": {"external": {"url": "memory://"}}})]
    )
    assert (
        line
        == "expertmesh orchestrator: error: --placement (or EXPERTMESH_PLACEMENT, or placement in --config) is required"
    )


def test_kv_cache_settings_from_flags_file_and_environment(tmp_path, monkeypatch):
    assert (ServingConfig().kv_cache_bytes, ServingConfig().kv_block_size, ServingConfig().prefix_caching) == (
        None,
        16,
        True,
    )
    assert ServingConfig().max_step_tokens == 1024
    args = _up(
        "--kv-cache-bytes", 1 << 20, "--kv-block-size", 8, "--prefix-caching", "false", "--max-step-tokens", 2048
    )
    serving = settings_from_args(ServingConfig, args)
    assert (serving.kv_cache_bytes, serving.kv_block_size, serving.prefix_caching) == (1 << 20, 8, False)
    assert serving.max_step_tokens == 2048
    monkeypatch.setenv("EXPERTMESH_PREFIX_CACHING", "false")
    path = _file(tmp_path, {"kv_block_size": 32})
    serving = settings_from_args(ServingConfig, _up("--config", path))
    assert (serving.kv_block_size, serving.prefix_caching) == (32, False)
    with pytest.raises(SystemExit):
        _up("--prefix-caching", "maybe")


def test_default_routing_policies_with_parameters_and_per_domain_from_every_source(tmp_path, monkeypatch, capsys):
    flags = _up(
        "--routing-policy",
        "delta_gap(delta=0.25)",
        "--domain-routing-policies",
        "legal=restrict(top_n=4,alpha=1) ; code=confidence_k",
    )
    serving = settings_from_args(ServingConfig, flags)
    assert serving.routing_policy == "delta_gap(delta=0.25)"
    assert serving.domain_routing_policies == {"legal": "restrict(top_n=4,alpha=1)", "code": "confidence_k"}
    assert ServingConfig().domain_routing_policies == {}
    path = _file(
        tmp_path,
        {"router": {"routingPolicy": "confidence_k(k_max=3)", "domainRoutingPolicies": {"legal/contract": "restrict"}}},
    )
    from_file = settings_from_args(ServingConfig, _up("--config", path))
    assert from_file.routing_policy == "confidence_k(k_max=3)"
    assert from_file.domain_routing_policies == {"legal/contract": "restrict"}
    monkeypatch.setenv("EXPERTMESH_DOMAIN_ROUTING_POLICIES", "medical=sticky(sticky_strength=1)")
    from_env = settings_from_args(ServingConfig, _up("--config", path))
    assert from_env.domain_routing_policies == {"medical": "sticky(sticky_strength=1)"}
    monkeypatch.delenv("EXPERTMESH_DOMAIN_ROUTING_POLICIES")
    line = _one_error_line(capsys, ["up", "--domain-routing-policies", "legal"])
    assert "--domain-routing-policies: expected DOMAIN=POLICY;DOMAIN=POLICY, got 'legal'" in line, line
    line = _one_error_line(capsys, ["up", "--domain-routing-policies", "legal=exact;legal=prefer"])
    assert "--domain-routing-policies: domain 'legal' is given twice" in line, line
