from __future__ import annotations

import pathlib

import pytest

from frontend.config import ConfigError, OrchestratorConfig, for_one_of_several_front_ends, load_config, parse_config

VALID = """\
hostname: 0.0.0.0
port: 9000
context_servers:
  urls: ["http://ctx-0:8001/", "http://ctx-1:8001"]
generation_servers:
  urls: ["http://gen-0:8002"]
  router: {type: round_robin}
gen_tokids_metadata_only: true
max_retries: 2
"""


def write(tmp_path: pathlib.Path, text: str) -> pathlib.Path:
    path = tmp_path / "orchestrator.yaml"
    path.write_text(text)
    return path


def test_valid_yaml_loads(tmp_path: pathlib.Path) -> None:
    config = load_config(write(tmp_path, VALID))
    assert isinstance(config, OrchestratorConfig)
    assert config.hostname == "0.0.0.0"
    assert config.port == 9000
    assert config.context_servers.urls == ["http://ctx-0:8001", "http://ctx-1:8001"]  # trailing slash dropped
    assert config.generation_servers.urls == ["http://gen-0:8002"]
    assert config.gen_tokids_metadata_only is True
    assert config.gen_tokids_ctxbytes is True
    assert config.max_retries == 2


def test_overrides_win_and_none_is_ignored(tmp_path: pathlib.Path) -> None:
    config = load_config(write(tmp_path, VALID), hostname=None, port=1234)
    assert (config.hostname, config.port) == ("0.0.0.0", 1234)


def test_config_is_immutable(tmp_path: pathlib.Path) -> None:
    config = load_config(write(tmp_path, VALID))
    with pytest.raises(ValueError, match="frozen"):
        config.port = 1


@pytest.mark.parametrize(
    ("text", "names"),
    [
        pytest.param(VALID + "gen_tokids_metadata_onyl: true\n", ["unknown key", "gen_tokids_metadata_onyl"],
                     id="unknown-key"),
        pytest.param(VALID.replace("  router: {type: round_robin}", "  router: {type: random}"),
                     ["generation_servers.router.type"], id="bad-router"),
        pytest.param(VALID + "context_servers_extra: 1\n", ["context_servers_extra"], id="another-unknown"),
        pytest.param(VALID.replace("generation_servers:\n  urls: [\"http://gen-0:8002\"]\n  router: "
                                   "{type: round_robin}\n", ""), ["missing key", "generation_servers"],
                     id="missing-key"),
        pytest.param(VALID.replace("port: 9000", "port: 70000"), ["bad value", "port"], id="port-out-of-range"),
        pytest.param(VALID.replace("max_retries: 2", "max_retries: many"), ["bad value", "max_retries"],
                     id="not-an-int"),
        pytest.param(VALID.replace("http://gen-0:8002", "ftp://gen-0:8002"), ["generation_servers.urls"],
                     id="url-with-another-scheme"),
        pytest.param(VALID.replace('["http://gen-0:8002"]', "[]"), ["generation_servers", "urls"], id="no-urls"),
        pytest.param(VALID + "request_timeout_s: 0\n", ["request_timeout_s"], id="zero-timeout"),
        pytest.param(VALID + "max_body_bytes: 10\n", ["max_body_bytes"], id="tiny-body-limit"),
    ],
)
def test_bad_config_names_the_key(tmp_path: pathlib.Path, text: str, names: list[str]) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    message = str(caught.value)
    assert str(path) in message
    for name in names:
        assert name in message


def test_unreadable_and_invalid_files(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "port: [1, 2\n"))
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- a\n- b\n"))
    with pytest.raises(ConfigError, match="missing key 'context_servers'"):
        load_config(write(tmp_path, ""))


def test_parse_config_from_a_dict() -> None:
    config = parse_config({"context_servers": {"urls": ["http://a"]}, "generation_servers": {"urls": ["http://b"]}})
    assert config.gen_tokids_metadata_only is False
    with pytest.raises(ConfigError, match="mapping"):
        parse_config(["not", "a", "mapping"])


def test_the_response_store_has_bounded_defaults_and_takes_its_limits_from_yaml(tmp_path: pathlib.Path) -> None:
    default = load_config(write(tmp_path, VALID)).response_store
    assert default.enabled and default.store_by_default
    assert default.max_entries > 0 and default.max_bytes > 0 and default.ttl_s > 0
    text = VALID + "response_store: {max_entries: 5, max_bytes: 1000, ttl_s: 60, store_by_default: false}\n"
    limits = load_config(write(tmp_path, text)).response_store
    assert (limits.max_entries, limits.max_bytes, limits.ttl_s, limits.store_by_default) == (5, 1000, 60, False)


def test_a_bad_response_store_limit_is_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match=r"response_store\.ttl_s"):
        load_config(write(tmp_path, VALID + "response_store: {ttl_s: 0}\n"))


def test_one_of_several_front_ends_keeps_no_response_store(tmp_path: pathlib.Path) -> None:
    # Each process would hold its own: a follow-up reaching another process would 404 at random.
    config = for_one_of_several_front_ends(load_config(write(tmp_path, VALID)))
    assert not config.response_store.enabled
    assert config.max_retries == 2


def test_a_redis_store_is_kept_by_every_one_of_several_front_ends(tmp_path: pathlib.Path) -> None:
    text = VALID + "response_store: {backend: redis, url: 'redis://cache:6379/0', max_entries: 5}\n"
    config = for_one_of_several_front_ends(load_config(write(tmp_path, text)))
    store = config.response_store
    assert (store.enabled, store.shared, store.url, store.max_entries) == (True, True, "redis://cache:6379/0", 5)


def test_the_store_url_from_the_command_line_turns_the_redis_store_on_and_keeps_the_files_limits(
    tmp_path: pathlib.Path,
) -> None:
    path = write(tmp_path, VALID + "response_store: {ttl_s: 60}\n")
    store = load_config(path, response_store_url="rediss://:pw@cache:6380/1").response_store
    assert (store.backend, store.url, store.ttl_s) == ("redis", "rediss://:pw@cache:6380/1", 60)
    assert load_config(path).response_store.backend == "memory"


@pytest.mark.parametrize(("store", "named"), [
    ("{backend: redis}", "needs a 'url'"),
    ("{url: 'redis://cache:6379/0'}", "for backend: redis"),
    ("{backend: redis, url: 'http://cache:6379'}", "must start with redis://"),
    ("{backend: redis, url: 'redis://:secret@cache:6379', timeout_s: 0}", r"response_store\.timeout_s"),
    ("{backend: postgres}", r"response_store\.backend"),
])
def test_a_bad_store_setting_is_named_without_echoing_the_url(tmp_path: pathlib.Path, store: str, named: str
                                                              ) -> None:
    with pytest.raises(ConfigError, match=named) as caught:
        load_config(write(tmp_path, VALID + f"response_store: {store}\n"))
    assert "secret" not in str(caught.value)


def test_a_config_that_names_the_removed_httpx_client_fails_at_load_naming_what_to_use() -> None:
    servers = {"context_servers": {"urls": ["http://c:1"]}, "generation_servers": {"urls": ["http://g:1"]}}
    with pytest.raises(ConfigError, match=r"bad value for 'upstream_client': .*httpx client was removed: use "
                                          r"httptools \(the default\) or aiohttp"):
        parse_config({**servers, "upstream_client": "httpx"})
    assert parse_config({**servers, "upstream_client": "aiohttp"}).upstream_client == "aiohttp"
    assert parse_config(servers).upstream_client == "httptools"
