"""API keys and the internal token (services/common/auth.py, internal_auth.py): where they come
from, how they are matched, and that they never show in a repr or an error."""

from __future__ import annotations

import argparse

import pytest

from services import launcher
from services.common.auth import (
    KeySet,
    add_api_key_arguments,
    api_key_argv,
    api_key_env,
    api_keys_from,
    bearer_token,
)
from services.common.internal_auth import InternalAuth, add_internal_auth_arguments


def _api_args(*argv: str, environ: dict[str, str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_api_key_arguments(parser)
    return parser.parse_args(list(argv))


def test_keys_from_flags_env_and_file_are_merged(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nfile-key-1\n\n  file-key-2  \n")
    args = _api_args("--api-key", "flag-a", "--api-key", "flag-b", "--api-key-file", str(key_file))
    keys = api_keys_from(args, {"PDSERVE_API_KEY": "env-1, env-2,"})
    for key in ("flag-a", "flag-b", "env-1", "env-2", "file-key-1", "file-key-2"):
        assert keys.matches(key), key
    assert len(keys.digests) == 6
    for wrong in ("", None, "flag-a ", "FLAG-A", "# team keys", "env-1,env-2", "flag"):
        assert not keys.matches(wrong), wrong


def test_no_keys_means_open_and_matches_nothing():
    keys = api_keys_from(_api_args(), {})
    assert not keys.is_enabled
    assert not keys.matches("anything") and not keys.matches("")


def test_bad_keys_and_files_are_refused_without_echoing_them(tmp_path):
    for bad in (["ok", ""], ["has space"], ["a,b"], ["tab\there"], ["nul\x00"]):
        with pytest.raises(ValueError, match="key #"):
            KeySet.of(bad)
    with pytest.raises(ValueError, match="cannot read key file .*missing"):
        api_keys_from(_api_args("--api-key-file", str(tmp_path / "missing")), {})
    keys = KeySet.of(["sk-secret-value"])
    assert "sk-secret" not in repr(keys) and "sk-secret" not in str(keys)
    auth = InternalAuth(token="tok-secret-value")
    assert "tok-secret" not in repr(auth) and auth.describe() == "token"


def test_bearer_scheme_is_case_insensitive_and_nothing_else_passes():
    assert bearer_token("Bearer sk-1") == "sk-1"
    assert bearer_token("bearer   sk-1 ") == "sk-1"
    assert bearer_token("BEARER sk-1") == "sk-1"
    for header in (None, "", "Basic c2stMQ==", "sk-1", "Bearer", "Bearer "):
        assert bearer_token(header) is None, header


def test_a_key_matches_whichever_position_it_has():
    keys = KeySet.of([f"key-{i}" for i in range(50)])
    assert all(keys.matches(f"key-{i}") for i in (0, 25, 49))
    assert KeySet.of(["a", "a"]).digests == KeySet.of(["a"]).digests  # duplicates collapse


def _internal(*argv: str, environ: dict[str, str] | None = None) -> InternalAuth:
    parser = argparse.ArgumentParser()
    add_internal_auth_arguments(parser, environ or {})
    return InternalAuth.from_args(parser.parse_args(list(argv)))


def test_internal_auth_from_env_flags_and_file(tmp_path):
    assert _internal() == InternalAuth() and not InternalAuth().is_enabled
    assert _internal(environ={"PDSERVE_INTERNAL_TOKEN": "t0k"}).token == "t0k"
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    assert _internal("--internal-token-file", str(token_file)).token == "from-file"
    token_file.write_text("one\ntwo\n")
    with pytest.raises(ValueError, match="expected one token line, found 2"):
        _internal("--internal-token-file", str(token_file))


def test_tls_needs_all_three_files(tmp_path):
    for name in ("c", "k", "ca"):
        (tmp_path / name).write_bytes(b"PEM " + name.encode())
    with pytest.raises(ValueError, match="missing --tls-ca, --tls-key"):
        _internal("--tls-cert", str(tmp_path / "c"))
    with pytest.raises(ValueError, match="--tls-ca .*nope: cannot read"):
        _internal("--tls-cert", str(tmp_path / "c"), "--tls-key", str(tmp_path / "k"),
                  "--tls-ca", str(tmp_path / "nope"))
    auth = _internal(environ={"PDSERVE_TLS_CERT": str(tmp_path / "c"), "PDSERVE_TLS_KEY": str(tmp_path / "k"),
                              "PDSERVE_TLS_CA": str(tmp_path / "ca")})
    assert auth.tls is not None and auth.tls.root_ca == b"PEM ca" and auth.describe() == "mTLS"
    assert "PEM" not in repr(auth)


def test_launcher_hands_keys_and_token_to_children_by_env_only(tmp_path, monkeypatch):
    for name in ("PDSERVE_API_KEY", "PDSERVE_INTERNAL_TOKEN", "PDSERVE_API_KEY_FILE"):
        monkeypatch.delenv(name, raising=False)
    key_file = tmp_path / "keys"
    key_file.write_text("file-key\n")
    args = launcher.build_parser().parse_args(
        ["--api-key", "sk-argv", "--api-key-file", str(key_file), "--metrics-auth",
         "--internal-token", "tok-123"])
    workers, router = launcher.plan(args, tmp_path)
    argv = " ".join(router.argv + [word for w in workers for word in w.argv])
    assert "sk-argv" not in argv and "tok-123" not in argv
    assert api_key_argv(args) == ["--api-key-file", str(key_file.resolve()), "--metrics-auth"]
    assert router.env == {"PDSERVE_API_KEY": "sk-argv"} == api_key_env(args, {})
    assert launcher.internal_auth_env(args) == {"PDSERVE_INTERNAL_TOKEN": "tok-123"}


def test_each_launch_makes_its_own_internal_token(monkeypatch):
    from services.common import internal_auth

    monkeypatch.delenv("PDSERVE_INTERNAL_TOKEN", raising=False)
    monkeypatch.setattr(internal_auth, "_installed", None)
    tokens = set()
    for _ in range(2):
        parser = launcher.build_parser()
        args = parser.parse_args([])
        launcher.prepare_auth(args, parser)
        assert len(args.internal_token) >= 32 and internal_auth.current().token == args.internal_token
        tokens.add(args.internal_token)
    assert len(tokens) == 2


def test_only_loopback_binds_skip_the_no_key_warning():
    from services.router.app import is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "127.3.2.1", "::1", "localhost"))
    assert not any(is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.5", "router.svc", ""))


def test_ray_replicas_get_the_drivers_token_or_a_new_one():
    from services.ray.__main__ import internal_auth_env

    made = internal_auth_env({})
    assert set(made) == {"PDSERVE_INTERNAL_TOKEN"} and len(made["PDSERVE_INTERNAL_TOKEN"]) >= 32
    assert internal_auth_env({})["PDSERVE_INTERNAL_TOKEN"] != made["PDSERVE_INTERNAL_TOKEN"]
    given = {"PDSERVE_INTERNAL_TOKEN": "tok", "PDSERVE_TLS_CA": "/etc/ca.pem", "PDSERVE_TLS_KEY": "",
             "HOME": "/root"}
    assert internal_auth_env(given) == {"PDSERVE_INTERNAL_TOKEN": "tok", "PDSERVE_TLS_CA": "/etc/ca.pem"}


def test_the_launch_token_file_is_private(tmp_path):
    path = tmp_path / launcher.TOKEN_FILE
    path.write_text("old")
    path.chmod(0o644)
    launcher.write_token_file(path, "tok-abc")
    assert path.read_text() == "tok-abc\n" and path.stat().st_mode & 0o777 == 0o600
    parser = argparse.ArgumentParser()
    add_internal_auth_arguments(parser, {})
    assert InternalAuth.from_args(parser.parse_args(["--internal-token-file", str(path)])).token == "tok-abc"
