"""API keys on the router's client port (router/auth.py): the key sources and their rotation,
then a real router process with `--api-key-file` answering the unmodified `openai` client: no
key or a wrong one is a 401 in OpenAI's shape, the right one is served, the probes and
/metrics stay open, and a key file rewritten in place (a rotated Secret) takes effect without a
restart. Bad key sources exit 2 naming the flag."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from splitserve_workers.cli import main
from splitserve_workers.router.auth import MAX_KEY_BYTES, RECHECK_SECONDS, ApiKeyError, ApiKeys

# ---- key sources -------------------------------------------------------------------------


def test_disabled_without_a_source() -> None:
    keys = ApiKeys()
    assert not keys.enabled and keys.allows(None)


def test_file_and_environment_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys"
    path.write_text("# rotated monthly\nfirst-key\n\n  second-key  \n")
    keys = ApiKeys(str(path), env="env-a, env-b")
    for key in ("first-key", "second-key", "env-a", "env-b"):
        assert keys.allows(f"Bearer {key}")
        assert keys.allows(f"bearer  {key} ")  # scheme case and spacing as clients vary
    for header in (None, "", "Bearer", "Bearer nope", "Basic first-key", "first-key",
                   "Bearer # rotated monthly", "Bearer first-keyX"):  # fmt: skip
        assert not keys.allows(header), header
    assert not keys.allows("Bearer " + "k" * (MAX_KEY_BYTES + 100))


def test_rotation_vanishing_file_and_empty_file(tmp_path: Path) -> None:
    now = [0.0]
    path = tmp_path / "keys"
    path.write_text("old\n")
    keys = ApiKeys(str(path), clock=lambda: now[0])
    assert keys.allows("Bearer old")
    # kubelet replaces a Secret's file: a new inode, new content.
    (tmp_path / "next").write_text("new\n")
    os.replace(tmp_path / "next", path)
    assert keys.allows("Bearer old")  # not looked at again within RECHECK_SECONDS
    now[0] += RECHECK_SECONDS
    assert keys.allows("Bearer new") and not keys.allows("Bearer old")
    # Gone for a moment: the keys read last still hold; nothing opens, nobody is locked out.
    path.unlink()
    now[0] += RECHECK_SECONDS
    assert keys.allows("Bearer new") and not keys.allows(None)
    # An emptied file holds no key: every request is refused (never an open port).
    path.write_text("")
    now[0] += RECHECK_SECONDS
    assert not keys.allows("Bearer new")


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--api-key-file: cannot read {path}: No such file or directory"),
        ("# only a comment\n\n", "--api-key-file: {path} holds no key"),
        ("k" * (MAX_KEY_BYTES + 1), "--api-key-file: cannot read {path}: a key is longer"),
    ],
    ids=["missing", "no-key", "key-too-long"],
)
def test_unusable_key_file_exits_2_naming_it(
    content: str | None, message: str, tmp_path: Path, tiny_model: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ApiKeyError):
        ApiKeys(str(path))
    args = ["router", "--model", str(tiny_model), "--prefill", "p:1", "--decode", "d:1"]
    assert main([*args, "--api-key-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve router: " + message.format(path=path)), err


@pytest.mark.parametrize("value", [",", " , ,", "  "])
def test_env_var_without_a_key_exits_2(
    value: str, tiny_model: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:  # fmt: skip
    # It used to leave the API open, where a keyless --api-key-file exits 2.
    with pytest.raises(ApiKeyError):  # first: before the fix main() would serve, open
        ApiKeys(None, value)
    monkeypatch.setenv("SPLITSERVE_API_KEY", value)
    args = ["router", "--model", str(tiny_model), "--prefill", "p:1", "--decode", "d:1"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("splitserve router: SPLITSERVE_API_KEY: "), err
    assert "holds no key" in err
    assert not ApiKeys(None, "").enabled  # empty: no keys from the environment, as unset


# ---- a real router -----------------------------------------------------------------------


@pytest.fixture
def router(tiny_model: Path, launch_worker: Any, tmp_path: Path) -> dict[str, Any]:
    keys = tmp_path / "api-keys"
    keys.write_text("sk-first\n")
    # No worker listens on port 9: the API key check comes before any worker is needed.
    proc = launch_worker(
        "router",
        [
            "--model", str(tiny_model), "--port", "0", "--host", "127.0.0.1",
            "--prefill", "127.0.0.1:9", "--decode", "127.0.0.1:9",
            "--model-name", "tiny", "--api-key-file", str(keys), "--log-requests",
        ],
    )  # fmt: skip
    return {"base": f"http://127.0.0.1:{proc.port}", "keys": keys, "proc": proc}


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key=key, max_retries=0, timeout=60)


def test_the_api_needs_a_key_the_probes_do_not(router: dict[str, Any]) -> None:
    base = router["base"]
    assert [m.id for m in client(base, "sk-first").models.list()] == ["tiny"]
    with pytest.raises(openai.AuthenticationError) as info:
        client(base, "sk-wrong").models.list()
    assert info.value.status_code == 401
    for path, body in (("/v1/models", None), ("/v1/completions", {"prompt": "hi"})):
        r = httpx.request("POST" if body else "GET", base + path, json=body, timeout=30)
        assert r.status_code == 401 and r.headers["WWW-Authenticate"] == "Bearer"
        assert r.json() == {
            "error": {
                "message": "Incorrect or missing API key: send it as 'Authorization: Bearer <key>'",
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    # A refused generation request is in the request log (an operator auditing it sees the
    # attempts); the model list is not a generation request.
    deadline = time.monotonic() + 30
    while '"error_code":"invalid_api_key"' not in router["proc"].log():
        assert time.monotonic() < deadline, router["proc"].log()[-2000:]
        time.sleep(0.05)
    logged = [
        json.loads(line.partition(" INFO splitserve.requests: ")[2])
        for line in router["proc"].log().splitlines()
        if " INFO splitserve.requests: " in line
    ]
    assert len(logged) == 1, logged
    assert logged[0]["id"].startswith("cmpl-")
    assert {k: logged[0][k] for k in ("path", "status", "http_status", "error_code")} == {
        "path": "/v1/completions",
        "status": "rejected",
        "http_status": 401,
        "error_code": "invalid_api_key",
    }
    # The kubelet's probes and Prometheus carry no key.
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    assert httpx.get(base + "/ready", timeout=30).status_code == 503  # no worker, not 401
    assert httpx.get(base + "/metrics", timeout=30).status_code == 200


def test_a_rewritten_key_file_takes_effect_without_a_restart(router: dict[str, Any]) -> None:
    base, keys = router["base"], router["keys"]
    staged = keys.with_name("staged")
    staged.write_text("sk-second\n")
    os.replace(staged, keys)
    until = time.monotonic() + 60  # bounds a hang only
    while True:
        try:
            client(base, "sk-second").models.list()
            break
        except openai.AuthenticationError:
            assert time.monotonic() < until, "the new key was never accepted"
            time.sleep(0.2)
    with pytest.raises(openai.AuthenticationError):
        client(base, "sk-first").models.list()
