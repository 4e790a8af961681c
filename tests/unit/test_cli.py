"""The `raytrainer` command's checks that need no cluster: addresses, tokens, refusing insecure or
secret-leaking submissions before anything is sent. Submitting to a real Ray head: integration/test_submit."""

from __future__ import annotations

import pytest

from raytrainer import cli


@pytest.fixture
def no_token(tmp_path, monkeypatch):
    for name in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS", "RAY_API_SERVER_ADDRESS"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token


def test_addresses(no_token, monkeypatch):
    assert cli.resolve_address(None) == "http://127.0.0.1:8265"
    assert cli.resolve_address("10.0.0.5:8265") == "http://10.0.0.5:8265"
    monkeypatch.setenv("RAY_ADDRESS", "https://ray.example.com")
    assert cli.resolve_address(None) == "https://ray.example.com"
    with pytest.raises(cli.CliError, match="Ray Client address"):
        cli.resolve_address("ray://head:10001")
    assert cli.is_loopback("http://127.0.0.2:8265") and cli.is_loopback("http://localhost:1")
    assert not cli.is_loopback("http://10.0.0.5:8265")


def test_token_sources_in_rays_order(no_token, tmp_path, monkeypatch):
    assert cli.auth_token() is None
    (tmp_path / ".ray").mkdir()
    (tmp_path / ".ray" / "auth_token").write_text("from-home\n")
    assert cli.auth_token() == "from-home"
    (tmp_path / "tok").write_text("from-path")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(tmp_path / "tok"))
    assert cli.auth_token() == "from-path"
    monkeypatch.setenv("RAY_AUTH_TOKEN", "from-env")
    assert cli.auth_token() == "from-env"


def test_refuses_a_remote_dashboard_without_a_token(no_token, capsys):
    # 192.0.2.1 (TEST-NET-1) is never routable: the command must stop before trying to connect.
    code = cli.main(["submit", "--address", "http://192.0.2.1:8265", "--", "python", "train.py"])
    err = capsys.readouterr().err
    assert code == 2
    assert "not a loopback address and no Ray auth token" in err and "--insecure" in err


def test_refuses_secrets_in_the_runtime_env(no_token, capsys):
    code = cli.main(["submit", "--env", "HF_TOKEN=hf_abc", "--", "python", "train.py"])
    err = capsys.readouterr().err
    assert code == 2 and "--env HF_TOKEN=... looks like a secret" in err and "hf_abc" not in err
    args = cli.build_parser().parse_args(["submit", "--env", "A=1", "--env", "B=x=y", "--pip", "p1", "p2",
                                          "--working-dir", ".", "--", "python", "t.py", "--lr", "1"])
    assert cli.runtime_env(args) == {"working_dir": ".", "pip": ["p1", "p2"],
                                     "env_vars": {"A": "1", "B": "x=y"}}
    assert cli._entrypoint(args.command) == "python t.py --lr 1"


def test_bad_input_is_named(no_token, capsys):
    assert cli.main(["submit", "--env", "NOVALUE", "--", "python", "t.py"]) == 2
    assert "--env 'NOVALUE' must be KEY=VALUE" in capsys.readouterr().err
    assert cli.main(["submit", "--working-dir", "/no/such/dir", "--", "python", "t.py"]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert cli.main(["submit"]) == 2
    assert "nothing to run" in capsys.readouterr().err
